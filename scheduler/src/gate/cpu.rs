//! CPU time published in the gate's page: the VM process writes the
//! cumulative CPU time of each vCPU thread ([`Gate::publish_cpu`]), the
//! daemon reads it with plain loads ([`Gate::read_cpu`]) instead of one
//! thread-clock syscall per vCPU and tick, and passes it through a
//! [`CpuClamp`], because the VM process may write anything.
//!
//! The clamp takes time as an input (no clock here): each vCPU's figure is
//! made monotonic and may grow by at most the wall time since the last
//! reading (a thread cannot run longer than that), so a VM's total is
//! bounded by wall time × vCPUs. A VM process can still under-report (and
//! so look cheaper than it is); the daemon's trusted cross-check is the
//! kernel's clock of the whole process, one syscall per VM.

use std::sync::atomic::Ordering;

use super::{Gate, Side};

pub use super::shm::MAX_PUBLISHED_VCPUS;

impl Gate {
    /// Peer (or in-process) side: publishes the cumulative CPU time of
    /// each vCPU thread, in ns (at most [`MAX_PUBLISHED_VCPUS`] slots).
    pub fn publish_cpu(&self, per_vcpu_ns: &[u64]) {
        let b = self.block();
        let n = per_vcpu_ns.len().min(MAX_PUBLISHED_VCPUS);
        for (slot, ns) in b.cpu_ns.iter().zip(per_vcpu_ns) {
            slot.store(*ns, Ordering::Relaxed);
        }
        b.cpu_vcpus.store(n as u32, Ordering::Release);
        b.cpu_seq.fetch_add(1, Ordering::Release);
    }

    /// Reads the published per-vCPU CPU times into `out` (untrusted on the
    /// owner of a shared gate: pass them through a [`CpuClamp`]). Returns
    /// how many slots were published, at most `out.len()`, and the
    /// publication count (unchanged since the last call: nothing new).
    pub fn read_cpu(&self, out: &mut [u64]) -> (usize, u64) {
        let b = self.block();
        let seq = b.cpu_seq.load(Ordering::Acquire);
        let n = (b.cpu_vcpus.load(Ordering::Acquire) as usize)
            .min(out.len())
            .min(MAX_PUBLISHED_VCPUS);
        for (o, slot) in out.iter_mut().zip(&b.cpu_ns).take(n) {
            *o = slot.load(Ordering::Relaxed);
        }
        (n, seq)
    }

    /// Whether the figures read by [`read_cpu`](Self::read_cpu) come from
    /// an untrusted peer (this is the owner of a gate made with
    /// [`new_shared`](Self::new_shared)).
    pub fn cpu_is_untrusted(&self) -> bool {
        self.side == Side::Owner && self.is_shared()
    }
}

/// Makes untrusted per-vCPU CPU times safe to charge: monotonic, and
/// growing by at most the wall time elapsed per vCPU.
#[derive(Debug, Clone)]
pub struct CpuClamp {
    last: Vec<u64>,
    at_ns: u64,
    /// Readings that had to be clamped (a misbehaving VM process).
    clamped: u64,
}

impl CpuClamp {
    /// A clamp for `vcpus` vCPUs, starting at time `now_ns` from the
    /// figures `start` (missing ones count as 0).
    pub fn new(vcpus: usize, now_ns: u64, start: &[u64]) -> Self {
        let mut last = vec![0; vcpus];
        for (l, s) in last.iter_mut().zip(start) {
            *l = *s;
        }
        Self {
            last,
            at_ns: now_ns,
            clamped: 0,
        }
    }

    /// Takes the raw figures `raw` read at `now_ns`; returns the clamped
    /// per-vCPU times (a vCPU without a figure keeps its last one).
    pub fn update(&mut self, now_ns: u64, raw: &[u64]) -> &[u64] {
        let wall = now_ns.saturating_sub(self.at_ns);
        self.at_ns = self.at_ns.max(now_ns);
        for (l, r) in self.last.iter_mut().zip(raw) {
            let v = (*r).clamp(*l, l.saturating_add(wall));
            if v != *r {
                self.clamped += 1;
            }
            *l = v;
        }
        &self.last
    }

    /// The clamped figures of the last update.
    pub fn last(&self) -> &[u64] {
        &self.last
    }

    /// Their sum.
    pub fn total(&self) -> u64 {
        self.last.iter().fold(0u64, |a, b| a.saturating_add(*b))
    }

    /// How many figures had to be clamped so far.
    pub fn clamped(&self) -> u64 {
        self.clamped
    }
}
