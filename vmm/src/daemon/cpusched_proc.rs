//! Sampling a VM that runs in its own process: its CPU time from the
//! kernel's clock of the whole process (one syscall per VM and tick,
//! trusted; it covers the device thread too), and which of its vCPUs are
//! busy from, in this order:
//!
//! 1. the vCPU threads' run times by host tid (`/proc/<pid>/task/<tid>/schedstat`,
//!    kept open: one `pread` per vCPU, trusted; skipped while the VM is
//!    parked and settled, as in one process; thread CPU clocks cannot be
//!    read across processes). Skipped as well in a tick in which every
//!    vCPU counts as runnable whatever it did (each ran in one of the
//!    last [`RUNNABLE_MEMORY_TICKS`]` - 1` ticks: a spinning VM is read
//!    at every 3rd tick on a quiet host): the count is the same without
//!    the reads, and the process clock still gives the usage of every
//!    tick (see [`ProcSource::sample`] for the device thread's share);
//! 2. the per-vCPU figures the VM process publishes in its gate's page
//!    (untrusted: clamped, and only ever adding to 3.);
//! 3. the process total: at least as many busy vCPUs as whole ticks of CPU
//!    it used.
//!
//! Measured (BENCHMARKS.md, "Cross-process gate"): a publisher thread
//! waking every tick costs the VM process 29–43 µs per tick on this host,
//! far more than the daemon's reads of 1., so 1. is the default and 2.
//! serves a VM process whose host tids the daemon lacks.

use corral_scheduler::{CpuClamp, Gate};

use super::{BUSY_FRACTION, RUNNABLE_MEMORY_TICKS, Sample, note_run};
use crate::vmgate::{ThreadRunTime, process_cpu_ns};

/// A publication older than this many ticks is not used: the runnable
/// count then comes from the process total.
const STALE_TICKS: u8 = 3;

/// A VM process whose threads besides its vCPUs used at least 1/N of a
/// CPU is an I/O VM (its device thread serves requests), for the
/// handover: an io victim's device thread is busy most of the time, and
/// the skew between the process clock and the vCPUs' run times stays well
/// under this.
const IO_FRACTION: u64 = 10;

pub(super) struct ProcSource {
    pid: libc::pid_t,
    /// The vCPU threads' run-time files (may be empty).
    tids: Vec<ThreadRunTime>,
    /// Their run times at the last read.
    tid_last: Vec<u64>,
    clamp: CpuClamp,
    /// Clamped figures of the previous tick.
    prev: Vec<u64>,
    buf: Vec<u64>,
    seq: u64,
    /// Ticks since the page last changed (saturating).
    stale: u8,
    /// The process total at the last sample.
    total: u64,
    /// Ticks since the process last used 1/[`BUSY_FRACTION`] of a tick
    /// (saturating).
    quiet: u8,
    /// Process CPU time of the ticks whose `schedstat` reads were skipped
    /// since the last reading, and how many such ticks.
    unread_used: u64,
    unread_ticks: u64,
    /// Busy helper threads at the last `schedstat` reading (held through
    /// the skipped ticks).
    helpers: u32,
}

impl ProcSource {
    pub(super) fn new(
        pid: libc::pid_t,
        tids: Vec<libc::pid_t>,
        gate: &Gate,
        vcpus: usize,
        now_ns: u64,
    ) -> Self {
        // A tid whose file cannot be opened (not a thread of `pid`) is
        // dropped; with none left, the page or the total count.
        let tids: Vec<ThreadRunTime> = tids
            .iter()
            .filter_map(|t| ThreadRunTime::open(pid, *t).ok())
            .collect();
        let tid_last = tids.iter().map(|t| t.read_ns().unwrap_or(0)).collect();
        let mut buf = vec![0; vcpus];
        let (n, seq) = gate.read_cpu(&mut buf);
        let start: Vec<u64> = buf.iter().take(n).copied().collect();
        let clamp = CpuClamp::new(vcpus, now_ns, &start);
        Self {
            pid,
            tids,
            tid_last,
            prev: clamp.last().to_vec(),
            clamp,
            buf,
            seq,
            stale: STALE_TICKS,
            total: process_cpu_ns(pid).unwrap_or(0),
            quiet: RUNNABLE_MEMORY_TICKS,
            unread_used: 0,
            unread_ticks: 0,
            helpers: 0,
        }
    }

    /// The process's CPU time when it was attached.
    pub(super) fn start_total(&self) -> u64 {
        self.total
    }

    /// Reads the process clock, then the vCPU clocks (unless `settled`:
    /// parked and every vCPU seen on the gate) or the page; updates each
    /// vCPU's idle count in `idle` (one entry per vCPU). `busy` is `None`
    /// when settled (the caller keeps its count). A settled VM whose
    /// process has been quiet for [`RUNNABLE_MEMORY_TICKS`] ticks (its
    /// vCPUs wait on the gate, its device thread has nothing to do) is not
    /// read at all unless `due` (every 16th tick, as a settled VM's idle
    /// device thread in one process): its clock is cumulative, so what it used then is
    /// charged at the next reading. Adds the clock reads it made (the
    /// process clock, `schedstat` reads) to `reads`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn sample(
        &mut self,
        gate: &Gate,
        now_ns: u64,
        tick_ns: u64,
        idle: &mut [u8],
        settled: bool,
        due: bool,
        reads: &mut u64,
    ) -> Sample {
        if settled && self.quiet >= RUNNABLE_MEMORY_TICKS && !due {
            self.quiet = self.quiet.saturating_add(1);
            return Sample {
                total: self.total,
                busy: None,
                helpers: 0,
                io: None,
            };
        }
        *reads += 1;
        let total = process_cpu_ns(self.pid)
            .unwrap_or(self.total)
            .max(self.total);
        let mut used = total - self.total;
        self.total = total;
        if used.saturating_mul(BUSY_FRACTION) >= tick_ns {
            self.quiet = 0;
        } else {
            self.quiet = self.quiet.saturating_add(1);
        }
        let (n, seq) = gate.read_cpu(&mut self.buf);
        if seq != self.seq {
            self.seq = seq;
            self.stale = 0;
        } else {
            self.stale = self.stale.saturating_add(1);
        }
        // A lower bound on the busy vCPUs that the VM cannot fake: whole
        // ticks of CPU the kernel charged to the process.
        let k = if used.saturating_mul(BUSY_FRACTION) >= tick_ns {
            used.div_ceil(tick_ns.max(1))
        } else {
            0
        };
        let mut busy = 0;
        let mut vcpus_used = 0u64;
        if settled {
            return Sample {
                total,
                busy: None,
                helpers: u32::from(used.saturating_mul(BUSY_FRACTION) >= tick_ns),
                io: None,
            };
        }
        // Ticks the helper share below is taken over.
        let mut window = 1;
        if !self.tids.is_empty() && used == 0 {
            // The process ran no thread since the last sample: no vCPU ran
            // and their run times are as last read (no syscall).
            for i in idle.iter_mut().take(self.tids.len()) {
                busy += u32::from(note_run(i, 0, tick_ns));
            }
        } else if !self.tids.is_empty()
            && self.tids.len() == idle.len()
            && idle
                .iter()
                .all(|i| i.saturating_add(1) < RUNNABLE_MEMORY_TICKS)
        {
            // Every vCPU ran in a tick less than RUNNABLE_MEMORY_TICKS - 1
            // ago: each counts as runnable in this tick whatever it did
            // since (no syscall). What it ran is found at the next
            // reading; the device thread's share of these ticks then too,
            // and until then its count of the last reading holds.
            for i in idle.iter_mut().take(self.tids.len()) {
                busy += u32::from(note_run(i, 0, tick_ns));
            }
            self.unread_used = self.unread_used.saturating_add(used);
            self.unread_ticks += 1;
            return Sample {
                total,
                busy: Some(busy),
                helpers: self.helpers,
                io: None,
            };
        } else if !self.tids.is_empty() {
            for ((t, last), i) in self
                .tids
                .iter()
                .zip(&mut self.tid_last)
                .zip(idle.iter_mut())
            {
                *reads += 1;
                let Some(ns) = t.read_ns() else {
                    continue; // thread gone: the VM is stopping
                };
                let ran = ns.saturating_sub(*last);
                *last = (*last).max(ns);
                vcpus_used = vcpus_used.saturating_add(ran);
                busy += u32::from(note_run(i, ran, tick_ns));
            }
            // The run times read cover the skipped ticks as well.
            used = used.saturating_add(self.unread_used);
            window += self.unread_ticks;
            self.unread_used = 0;
            self.unread_ticks = 0;
        } else if self.stale < STALE_TICKS {
            let now = self.clamp.update(now_ns, self.buf.get(..n).unwrap_or(&[]));
            for ((i, p), c) in idle.iter_mut().zip(self.prev.iter_mut()).zip(now) {
                let ran = c.saturating_sub(*p);
                vcpus_used = vcpus_used.saturating_add(ran);
                busy += u32::from(note_run(i, ran, tick_ns));
                *p = *c;
            }
            // Published figures can only add busy vCPUs to the bound.
            busy = busy.max(k.min(idle.len() as u64) as u32);
        } else {
            // No fresh figures: as many vCPUs as whole ticks of CPU used.
            for (j, i) in idle.iter_mut().enumerate() {
                let ran = if (j as u64) < k { tick_ns } else { 0 };
                busy += u32::from(note_run(i, ran, tick_ns));
            }
            vcpus_used = used;
        }
        // What the vCPUs did not use went to the VM's other threads (its
        // device thread): busy if it used 1/BUSY_FRACTION of a tick per
        // tick of the window.
        let helpers = u32::from(
            used.saturating_sub(vcpus_used)
                .saturating_mul(BUSY_FRACTION)
                >= tick_ns.saturating_mul(window),
        );
        self.helpers = helpers;
        // An I/O VM: its other threads used a tenth of a CPU or more.
        let io = used.saturating_sub(vcpus_used).saturating_mul(IO_FRACTION)
            >= tick_ns.saturating_mul(window);
        Sample {
            total,
            busy: Some(busy),
            helpers,
            io: Some(io),
        }
    }
}
