//! The daemon's CPU scheduler thread (the `gate` backend): every tick it reads
//! each vCPU thread's CPU clock, feeds the usage to the pure policy of
//! `corral-scheduler`, and parks or unparks VMs through their gates.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::util::lock;
use corral_scheduler::policy::VmUsage;
use corral_scheduler::{Gate, Scheduler, VmId};

use crate::daemon::hostload::{HostStat, StatReader};
use proc_source::ProcSource;

#[path = "cpusched_proc.rs"]
mod proc_source;

pub use crate::threadclock::{own_thread_cpu_ns, thread_cpu_ns};

/// Reads the clocks of a VM's extra (device) threads; returns their sum
/// (using the last reading of a thread that is gone) and how many of them
/// ran at least 1/[`BUSY_FRACTION`] of a tick within the last
/// [`RUNNABLE_MEMORY_TICKS`] ticks.
fn sample_extra(v: &mut Tracked, tick_ns: u64) -> (u64, u32) {
    let mut busy = 0;
    for ((t, last), idle) in v
        .extra
        .iter()
        .zip(v.extra_last.iter_mut())
        .zip(v.extra_idle.iter_mut())
    {
        let prev = *last;
        if let Some(ns) = thread_cpu_ns(*t) {
            *last = prev.max(ns);
        }
        busy += u32::from(note_run(idle, *last - prev, tick_ns));
    }
    (v.extra_last.iter().sum(), busy)
}

/// Updates a thread's count of ticks since it last ran, given the CPU time
/// `ran_ns` it used in this tick; true if it counts as runnable (it ran at
/// least 1/[`BUSY_FRACTION`] of a tick within the last
/// [`RUNNABLE_MEMORY_TICKS`] ticks).
fn note_run(idle: &mut u8, ran_ns: u64, tick_ns: u64) -> bool {
    if ran_ns * BUSY_FRACTION >= tick_ns {
        *idle = 0;
    } else {
        *idle = idle.saturating_add(1);
    }
    *idle < RUNNABLE_MEMORY_TICKS
}

struct Tracked {
    gate: Arc<Gate>,
    tids: Vec<libc::pid_t>,
    last: Vec<u64>,
    /// Per vCPU: ticks since it last ran (saturating).
    idle_ticks: Vec<u8>,
    runnable: u32,
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
    /// Parked, and sampled after every vCPU was blocked on the gate.
    settled: bool,
    /// The VM's total (vCPUs + extra threads) last reported, ns.
    reported: u64,
    /// A VM in its own process: sampled through its process clock and its
    /// gate's page instead of `tids` and `extra`.
    process: Option<ProcSource>,
}

/// Host idle, steal and busy time are read from /proc/stat every this many
/// ticks.
const IDLE_SAMPLE_TICKS: u64 = 4;

/// A vCPU that ran at least this fraction (1/N) of a tick was runnable.
const BUSY_FRACTION: u64 = 100;
/// A vCPU counts as runnable for this many ticks after it last ran: on a
/// contended host a runnable thread may get no CPU in a given tick.
const RUNNABLE_MEMORY_TICKS: u8 = 3;

struct Inner {
    vms: HashMap<VmId, Tracked>,
    usages: Vec<VmUsage>,
    /// CPU time the scheduler thread itself used, ns.
    self_cpu_ns: u64,
    /// Reads /proc/stat for the daemon's CPUs.
    stat: StatReader,
    /// Host times at the last sample.
    last_stat: Option<HostStat>,
    /// CPU the VMs used since the last sample, ns.
    vms_since_sample_ns: u64,
    /// `self_cpu_ns` at the last sample.
    self_at_sample_ns: u64,
    /// Host CPU taken by the hypervisor below over the last sampling
    /// interval, percent of one CPU.
    measured_steal: Option<f64>,
    last_tick_ns: u64,
    /// Host idle over the last sampling interval, percent of one CPU.
    measured_idle: Option<f64>,
    tick_count: u64,
    ticks: u64,
}

/// The scheduler service: policy state plus the tick thread.
pub struct CpuScheduler {
    sched: Arc<Mutex<Scheduler>>,
    inner: Mutex<Inner>,
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
    epoch: Instant,
}

impl std::fmt::Debug for CpuScheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuScheduler").finish_non_exhaustive()
    }
}

impl CpuScheduler {
    /// A scheduler service around `sched` (shared with the manager, which
    /// changes the model); call [`start`](Self::start) to run ticks. Lock
    /// order: this service's state, then `sched`.
    pub fn new(sched: Arc<Mutex<Scheduler>>) -> Arc<Self> {
        Arc::new(Self {
            sched,
            inner: Mutex::new(Inner {
                vms: HashMap::new(),
                usages: Vec::new(),
                self_cpu_ns: 0,
                ticks: 0,
                stat: StatReader::for_affinity(),
                last_stat: None,
                vms_since_sample_ns: 0,
                self_at_sample_ns: 0,
                measured_steal: None,
                last_tick_ns: 0,
                measured_idle: None,
                tick_count: 0,
            }),
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
            epoch: Instant::now(),
        })
    }

    /// Runs `f` on the policy state (model changes, stats).
    pub fn with<R>(&self, f: impl FnOnce(&mut Scheduler) -> R) -> R {
        f(&mut lock(&self.sched))
    }

    /// Starts the tick thread (idempotent).
    pub fn start(self: &Arc<Self>) -> std::io::Result<()> {
        let mut t = lock(&self.thread);
        if t.is_some() {
            return Ok(());
        }
        let me = self.clone();
        *t = Some(
            std::thread::Builder::new()
                .name("cpusched".into())
                .spawn(move || me.run())?,
        );
        Ok(())
    }

    /// Stops the tick thread and releases every parked VM.
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
        for v in lock(&self.inner).vms.values() {
            v.gate.unpark();
        }
    }

    /// Starts enforcing for VM `id` (already added to the model) whose vCPU
    /// threads are `tids` and whose vCPUs wait on `gate`. The CPU time of
    /// `extra` threads (the VM's device thread, which serves its I/O) is
    /// charged to the VM as well; they are never parked.
    pub fn attach(
        &self,
        id: VmId,
        gate: Arc<Gate>,
        tids: Vec<libc::pid_t>,
        extra: Vec<libc::pid_t>,
    ) {
        let extra_last: Vec<u64> = extra
            .iter()
            .map(|t| thread_cpu_ns(*t).unwrap_or(0))
            .collect();
        let last: Vec<u64> = tids
            .iter()
            .map(|t| thread_cpu_ns(*t).unwrap_or(0))
            .collect();
        let reported = last.iter().chain(&extra_last).sum();
        let runnable = tids.len() as u32;
        let idle_ticks = vec![0; tids.len()];
        let mut inner = lock(&self.inner);
        // Under the lock, so no tick runs between the sync and the insert:
        // a decision taken before the VM was attached holds from now on.
        if let Some(parked) = lock(&self.sched).is_parked(id) {
            enforce(&gate, !parked);
        }
        inner.vms.insert(
            id,
            Tracked {
                gate,
                tids,
                last,
                idle_ticks,
                runnable,
                total: 0,
                extra_idle: vec![RUNNABLE_MEMORY_TICKS; extra.len()],
                extra,
                extra_last,
                settled: false,
                reported,
                process: None,
            },
        );
    }

    /// Starts enforcing for VM `id` (already added to the model) that runs
    /// in its own process `pid` with `vcpus` vCPUs waiting on `gate` (the
    /// owner side, from `Gate::new_shared`); `tids` are the vCPU threads'
    /// host tids, if the daemon knows them (empty otherwise). Its CPU time
    /// is the kernel's clock of the whole process (one syscall per tick,
    /// device thread included); busy vCPUs come from the `tids`' clocks,
    /// else from the figures the process publishes in the gate's page
    /// (untrusted, clamped), else from the total (see `cpusched_proc.rs`).
    /// The kick is the gate's own ([`crate::vmgate::signal_kick`] or the
    /// VM's watcher).
    pub fn attach_process(
        &self,
        id: VmId,
        gate: Arc<Gate>,
        pid: libc::pid_t,
        vcpus: usize,
        tids: Vec<libc::pid_t>,
    ) {
        let source = ProcSource::new(pid, tids, &gate, vcpus, self.now_ns());
        let reported = source.start_total();
        let mut inner = lock(&self.inner);
        if let Some(parked) = lock(&self.sched).is_parked(id) {
            enforce(&gate, !parked);
        }
        inner.vms.insert(
            id,
            Tracked {
                gate,
                tids: Vec::new(),
                last: Vec::new(),
                idle_ticks: vec![0; vcpus],
                runnable: vcpus as u32,
                total: 0,
                extra: Vec::new(),
                extra_last: Vec::new(),
                extra_idle: Vec::new(),
                settled: false,
                reported,
                process: Some(source),
            },
        );
    }

    /// Stops enforcing for VM `id` and unparks it.
    pub fn detach(&self, id: VmId) {
        if let Some(v) = lock(&self.inner).vms.remove(&id) {
            v.gate.unpark();
        }
    }

    /// (ticks done, CPU time the scheduler thread used in ns).
    pub fn self_usage(&self) -> (u64, u64) {
        let g = lock(&self.inner);
        (g.ticks, g.self_cpu_ns)
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    fn run(self: Arc<Self>) {
        crate::util::raise_priority();
        // The scheduler thread's own filter (inherits the runtime's). It
        // belongs to no VM: a violation is reported and the syscall fails.
        if let Err(e) = crate::seccomp::install(crate::seccomp::ThreadKind::Scheduler) {
            tracing::error!("scheduler thread: {e}; it does not run");
            return;
        }
        let tick = Duration::from_nanos(self.with(|s| s.config().tick_ns).max(1_000_000));
        let mut next = Instant::now() + tick;
        while !self.stop.load(Ordering::SeqCst) {
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            }
            next += tick;
            // Do not try to catch up after a long stall.
            if next < Instant::now() {
                next = Instant::now() + tick;
            }
            let c0 = own_thread_cpu_ns();
            self.tick(tick.as_nanos() as u64);
            let c1 = own_thread_cpu_ns();
            let mut g = lock(&self.inner);
            g.self_cpu_ns += c1.saturating_sub(c0);
            g.ticks += 1;
        }
    }

    /// One tick: sample, decide, enforce. Public for tests.
    pub fn tick(&self, tick_ns: u64) {
        let now = self.now_ns();
        let mut g = lock(&self.inner);
        let inner = &mut *g;
        inner.usages.clear();
        for (id, v) in inner.vms.iter_mut() {
            let parked = v.gate.is_parked();
            if let Some(p) = v.process.as_mut() {
                if !parked {
                    v.settled = false;
                }
                let settled = parked && v.settled;
                if parked && v.gate.waiting() >= v.idle_ticks.len() as u64 {
                    v.settled = true;
                }
                let s = p.sample(&v.gate, now, tick_ns, &mut v.idle_ticks, settled);
                inner.vms_since_sample_ns += v.report(s.total);
                let runnable = match s.busy {
                    _ if parked => v.runnable.max(1),
                    Some(b) => b,
                    None => v.runnable,
                };
                v.runnable = runnable;
                inner.usages.push(
                    VmUsage::total(*id, s.total, runnable > 0)
                        .with_runnable_vcpus(runnable)
                        .with_busy_helpers(s.helpers),
                );
                continue;
            }
            if !parked {
                v.settled = false;
            }
            if parked && v.settled {
                // Every vCPU is blocked on the gate (the kick has landed and
                // they have been sampled since): off the CPU for sure, so
                // their clocks cannot have moved. Skipping them keeps the
                // scheduler cheap with many parked VMs; the device thread
                // may still be serving I/O, so it is read.
                let (extra, helpers) = sample_extra(v, tick_ns);
                inner.vms_since_sample_ns += v.report(v.total + extra);
                inner.usages.push(
                    VmUsage::total(*id, v.total + extra, v.runnable > 0)
                        .with_runnable_vcpus(v.runnable)
                        .with_busy_helpers(helpers),
                );
                continue;
            }
            // All vCPUs blocked on the gate before we read their clocks:
            // these readings are final until the VM is unparked.
            if parked && v.gate.waiting() >= v.tids.len() as u64 {
                v.settled = true;
            }
            let mut total = 0u64;
            let mut busy = 0u32;
            for (i, tid) in v.tids.iter().enumerate() {
                let Some(ns) = thread_cpu_ns(*tid) else {
                    continue; // thread gone: the VM is stopping
                };
                let prev = v.last.get(i).copied().unwrap_or(ns);
                if let Some(idle) = v.idle_ticks.get_mut(i) {
                    busy += u32::from(note_run(idle, ns.saturating_sub(prev), tick_ns));
                }
                if let Some(l) = v.last.get_mut(i) {
                    *l = ns;
                }
                total += ns;
            }
            v.total = total;
            let (extra, helpers) = sample_extra(v, tick_ns);
            let total = total + extra;
            inner.vms_since_sample_ns += v.report(total);
            // A parked VM's vCPUs wait on the gate: they still want CPU as
            // much as when they were parked.
            let runnable = if parked { v.runnable.max(1) } else { busy };
            v.runnable = runnable;
            inner.usages.push(
                VmUsage::total(*id, total, runnable > 0)
                    .with_runnable_vcpus(runnable)
                    .with_busy_helpers(helpers),
            );
        }
        inner.tick_count += 1;
        let outside = if inner.tick_count % IDLE_SAMPLE_TICKS == 1 || inner.last_stat.is_none() {
            self.sample_host(inner, now)
        } else {
            None
        };
        let measured = inner.measured_idle;
        let steal = inner.measured_steal;
        let mut sched = lock(&self.sched);
        sched.set_measured_idle(measured);
        sched.set_measured_steal(steal);
        if let Some((pct, interval)) = outside {
            sched.set_measured_outside(Some(pct), interval);
        }
        let out = sched.tick(now, &inner.usages);
        // Level-triggered: every gate is made to match the policy's current
        // decision, not only the gates of this tick's changes. A change for
        // a VM that was not attached yet (the policy can park a VM in the
        // milliseconds between `add_vm` and `attach`) would otherwise be
        // lost for good: the policy emits a change only once, and a capped
        // VM ran uncapped for a whole test with `parked = true`.
        for d in out.vms() {
            if let Some(v) = inner.vms.get(&d.vm) {
                enforce(&v.gate, d.should_run);
            }
        }
    }
}

impl CpuScheduler {
    /// Reads the host's CPU times and updates the idle and steal figures;
    /// returns the outside load (percent of one CPU) over the interval since
    /// the last sample, and its length in ns.
    ///
    /// Real idle time, so that CPU taken by other processes is not mistaken
    /// for CPU our VMs left unused; and the outside load, the CPU that
    /// everything but our VMs and this thread used (host busy time less
    /// their thread clocks), so that the policy plans with what the VMs can
    /// get beside it.
    fn sample_host(&self, inner: &mut Inner, now: u64) -> Option<(f64, u64)> {
        let stat = inner.stat.read();
        let dt = now.saturating_sub(inner.last_tick_ns);
        let last = inner.last_stat;
        let pct = |f: fn(&HostStat) -> u64| match (stat, last) {
            (Some(c), Some(l)) if dt > 0 => {
                Some(f(&c).saturating_sub(f(&l)) as f64 * 100.0 / dt as f64)
            }
            _ => None,
        };
        inner.measured_idle = pct(|s| s.idle_ns);
        inner.measured_steal = pct(|s| s.steal_ns);
        let busy = pct(|s| s.busy_ns);
        let ours =
            inner.vms_since_sample_ns + inner.self_cpu_ns.saturating_sub(inner.self_at_sample_ns);
        inner.vms_since_sample_ns = 0;
        inner.self_at_sample_ns = inner.self_cpu_ns;
        inner.last_stat = stat;
        inner.last_tick_ns = now;
        let outside = busy? - ours as f64 * 100.0 / dt as f64;
        Some((outside.max(0.0), dt))
    }
}

impl Tracked {
    /// Records the VM's total CPU time `total`; returns what it used since
    /// the last report.
    fn report(&mut self, total: u64) -> u64 {
        let d = total.saturating_sub(self.reported);
        self.reported = self.reported.max(total);
        d
    }
}

/// Makes `gate` match a decision: parks it (kicking its vCPUs) if the VM
/// must not run and the gate is open, opens it if the VM may run.
fn enforce(gate: &Gate, should_run: bool) {
    if gate.is_parked() == should_run {
        if should_run {
            gate.unpark();
        } else {
            gate.park();
        }
    }
}

impl Drop for CpuScheduler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

#[cfg(test)]
#[path = "cpusched_tests.rs"]
mod tests;
