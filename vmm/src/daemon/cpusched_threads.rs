//! Sampling a VM whose threads are threads of this process (`--vm-mode
//! thread`, `corral run`'s library users): one `clock_gettime` on each
//! vCPU thread's CPU clock per tick (skipped while the VM is parked and
//! settled), and the device thread's clock, read every tick only while it
//! is busy.
//!
//! An idle device thread (it ran less than 1/[`BUSY_FRACTION`](super::BUSY_FRACTION) of a tick in
//! each of the last [`RUNNABLE_MEMORY_TICKS`] ticks) is read every
//! [`IDLE_EXTRA_READ_TICKS`]th tick only: a VM without I/O has one, and at
//! 25 VMs it was 25 of the ~33 clock reads of a tick. What it does use is
//! charged when it is read (its clock is cumulative, nothing is lost), at
//! most that many ticks late; a thread found busy is read every tick again
//! until it has been idle for [`RUNNABLE_MEMORY_TICKS`] ticks.

use super::{RUNNABLE_MEMORY_TICKS, Sample, note_run};
use crate::threadclock::local_thread_cpu_ns;

/// An idle extra thread's clock is read every this many ticks.
pub(super) const IDLE_EXTRA_READ_TICKS: u64 = 4;

pub(super) struct ThreadSource {
    tids: Vec<libc::pid_t>,
    last: Vec<u64>,
    /// Sum of the vCPU clocks at the last sample.
    total: u64,
    /// Threads that work for the VM but are not parked (its device
    /// thread): their CPU time counts as the VM's usage.
    extra: Vec<libc::pid_t>,
    /// Their clocks at the last sample (kept when a thread is gone, so the
    /// VM's total never goes backwards).
    extra_last: Vec<u64>,
    /// Per extra thread: ticks since it last ran (saturating).
    extra_idle: Vec<u8>,
}

impl ThreadSource {
    pub(super) fn new(tids: Vec<libc::pid_t>, extra: Vec<libc::pid_t>) -> Self {
        let extra_last = extra
            .iter()
            .map(|t| local_thread_cpu_ns(*t).unwrap_or(0))
            .collect();
        let last = tids
            .iter()
            .map(|t| local_thread_cpu_ns(*t).unwrap_or(0))
            .collect();
        Self {
            tids,
            last,
            total: 0,
            extra_idle: vec![RUNNABLE_MEMORY_TICKS; extra.len()],
            extra,
            extra_last,
        }
    }

    /// The VM's CPU time when it was attached (vCPUs and extra threads).
    pub(super) fn start_total(&self) -> u64 {
        self.last.iter().chain(&self.extra_last).sum()
    }

    /// Reads the vCPU clocks (unless `settled`: parked and every vCPU seen
    /// on the gate, so their clocks cannot have moved) and the extra
    /// threads' (an idle one only if `extra_due`); updates each vCPU's idle
    /// count in `idle`. `busy` is `None` when settled (the caller keeps its
    /// count). Adds the clock reads it made to `reads`.
    pub(super) fn sample(
        &mut self,
        tick_ns: u64,
        idle: &mut [u8],
        settled: bool,
        extra_due: bool,
        reads: &mut u64,
    ) -> Sample {
        let mut busy = None;
        if !settled {
            let mut total = 0u64;
            let mut n = 0u32;
            for (i, tid) in self.tids.iter().enumerate() {
                *reads += 1;
                let Some(ns) = local_thread_cpu_ns(*tid) else {
                    continue; // thread gone: the VM is stopping
                };
                let prev = self.last.get(i).copied().unwrap_or(ns);
                if let Some(idle) = idle.get_mut(i) {
                    n += u32::from(note_run(idle, ns.saturating_sub(prev), tick_ns));
                }
                if let Some(l) = self.last.get_mut(i) {
                    *l = ns;
                }
                total += ns;
            }
            self.total = total;
            busy = Some(n);
        }
        let (extra, helpers) = self.sample_extra(tick_ns, extra_due, reads);
        Sample {
            total: self.total + extra,
            busy,
            helpers,
            io: Some(helpers > 0),
        }
    }

    /// Reads the clocks of the extra threads (an idle one only if `due`);
    /// returns their sum (using the last reading of a thread that is gone
    /// or not read) and how many of them ran at least 1/[`BUSY_FRACTION`](super::BUSY_FRACTION)
    /// of a tick within the last [`RUNNABLE_MEMORY_TICKS`] ticks.
    fn sample_extra(&mut self, tick_ns: u64, due: bool, reads: &mut u64) -> (u64, u32) {
        let mut busy = 0;
        for ((t, last), idle) in self
            .extra
            .iter()
            .zip(self.extra_last.iter_mut())
            .zip(self.extra_idle.iter_mut())
        {
            if *idle >= RUNNABLE_MEMORY_TICKS && !due {
                // Idle for a while: not runnable either way (note_run of
                // nothing), and its clock is read at its next due tick.
                note_run(idle, 0, tick_ns);
                continue;
            }
            let prev = *last;
            *reads += 1;
            if let Some(ns) = local_thread_cpu_ns(*t) {
                *last = prev.max(ns);
            }
            busy += u32::from(note_run(idle, *last - prev, tick_ns));
        }
        (self.extra_last.iter().sum(), busy)
    }
}
