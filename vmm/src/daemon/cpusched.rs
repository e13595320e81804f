//! The daemon's CPU scheduler thread (the `gate` backend): every tick it reads
//! each vCPU thread's CPU clock, feeds the usage to the pure policy of
//! `corral-scheduler`, and parks or unparks VMs through their gates.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::util::lock;
use corral_scheduler::policy::VmUsage;
use corral_scheduler::{Gate, Scheduler, VmId};

use crate::daemon::hostload::{HostStat, StatReader};
use proc_source::ProcSource;
use thread_source::{IDLE_EXTRA_READ_TICKS, ThreadSource};

#[path = "cpusched_proc.rs"]
mod proc_source;
#[path = "cpusched_threads.rs"]
mod thread_source;

pub use crate::threadclock::{own_thread_cpu_ns, thread_cpu_ns};

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

/// What one sample of a VM gives the policy.
struct Sample {
    /// The VM's CPU time so far, ns.
    total: u64,
    /// vCPUs that count as runnable; `None`: not read (parked and
    /// settled), the last count holds.
    busy: Option<u32>,
    /// Busy threads besides the vCPUs (its device thread).
    helpers: u32,
    /// Whether those threads did real work (an I/O VM's device thread),
    /// if this sample tells: a VM process's other threads' time is the
    /// process clock less its vCPUs', and a spinning VM process shows a
    /// "busy helper" now and then from the two readings' skew alone.
    io: Option<bool>,
}

/// Where a VM's CPU time comes from.
enum Source {
    /// Threads of this process: their CPU clocks.
    Threads(ThreadSource),
    /// A VM in its own process: its process clock and its gate's page.
    Process(ProcSource),
}

struct Tracked {
    id: VmId,
    gate: Arc<Gate>,
    /// Per vCPU: ticks since it last ran (saturating).
    idle_ticks: Vec<u8>,
    runnable: u32,
    /// Parked, and sampled after every vCPU was blocked on the gate.
    settled: bool,
    /// The VM's total (vCPUs + extra threads) last reported, ns.
    reported: u64,
    source: Source,
    /// Position of the VM's decision in the policy's last output (the
    /// policy's order, which `Inner::vms` follows: usages in that order
    /// spare the policy a lookup per VM, decisions are found without one).
    slot: usize,
    /// The decision in force (`None`: the policy does not know the VM).
    run: Option<bool>,
    /// Whether it had a busy helper thread (its device thread) the last
    /// time it ran with a runnable vCPU: an I/O VM, whose turns start and
    /// end with a handover (see `PolicyConfig::handover_ns`).
    io: bool,
}

/// A parked and settled VM's idle device thread (or its quiet VM
/// process) is read every this many ticks. Its vCPUs wait on the gate, so
/// only I/O still in flight can use CPU: what it uses is charged at the
/// next reading (clocks are cumulative), at most 160 ms late. With 25 VMs
/// of 4 spinning vCPUs on 2 CPUs nearly all VMs are parked and settled at
/// any tick, and reading them every 4th tick was ~6 of the ~15 reads of a
/// tick (BENCHMARKS.md, "Session 8").
const SETTLED_READ_TICKS: u64 = 16;

/// Host idle, steal and busy time are read from /proc/stat every this many
/// ticks.
const IDLE_SAMPLE_TICKS: u64 = 4;

/// A vCPU that ran at least this fraction (1/N) of a tick was runnable.
const BUSY_FRACTION: u64 = 100;
/// A vCPU counts as runnable for this many ticks after it last ran: on a
/// contended host a runnable thread may get no CPU in a given tick.
const RUNNABLE_MEMORY_TICKS: u8 = 3;

/// What the scheduler thread's ticks did so far (cumulative), for tests
/// and benchmarks that hold its per-tick work down: deterministic counts,
/// where its CPU time depends on the host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TickWork {
    /// Ticks.
    pub ticks: u64,
    /// CPU-time readings, one syscall each: thread clocks, process clocks,
    /// `schedstat` reads of a VM process's vCPU threads.
    pub clock_reads: u64,
    /// Reads of `/proc/stat`.
    pub stat_reads: u64,
    /// Gates parked (each kicks the VM's vCPUs out of `KVM_RUN`).
    pub parks: u64,
    /// Gates opened (each wakes the VM's vCPUs waiting on it).
    pub unparks: u64,
    /// Ticks whose unparks waited for a handover (see
    /// `PolicyConfig::handover_ns`).
    pub handovers: u64,
    /// Handovers that ended at their deadline, the outgoing vCPUs not all
    /// off the CPU yet.
    pub handover_timeouts: u64,
    /// Time from the parks to the unparks, summed over the handovers, ns.
    pub handover_wait_ns: u64,
}

struct Inner {
    /// In the policy's order (see [`Tracked::slot`]).
    vms: Vec<Tracked>,
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
    work: TickWork,
    /// A pending handover: the VMs parked by the last tick, the VMs it
    /// unparks once those are off the CPU, and when it started and must
    /// end (ns, [`CpuScheduler::now_ns`]).
    handover_out: Vec<VmId>,
    handover_in: Vec<VmId>,
    handover_at: Option<(u64, u64)>,
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
                vms: Vec::new(),
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
                work: TickWork::default(),
                handover_out: Vec::new(),
                handover_in: Vec::new(),
                handover_at: None,
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
        for v in &lock(&self.inner).vms {
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
        let vcpus = tids.len();
        let source = ThreadSource::new(tids, extra);
        let reported = source.start_total();
        self.insert(id, gate, vcpus, reported, Source::Threads(source));
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
        self.insert(id, gate, vcpus, reported, Source::Process(source));
    }

    fn insert(&self, id: VmId, gate: Arc<Gate>, vcpus: usize, reported: u64, source: Source) {
        let mut inner = lock(&self.inner);
        // Under the lock, so no tick runs between the sync and the insert:
        // a decision taken before the VM was attached holds from now on.
        let parked = lock(&self.sched).is_parked(id);
        if let Some(parked) = parked {
            enforce(&gate, !parked);
        }
        let v = Tracked {
            id,
            gate,
            idle_ticks: vec![0; vcpus],
            runnable: vcpus as u32,
            settled: false,
            reported,
            source,
            // Found (and the list put in order) at the next tick.
            slot: usize::MAX,
            run: parked.map(|p| !p),
            io: false,
        };
        match inner.vms.iter_mut().find(|t| t.id == id) {
            Some(t) => *t = v,
            None => inner.vms.push(v),
        }
    }

    /// Stops enforcing for VM `id` and unparks it.
    pub fn detach(&self, id: VmId) {
        let v = {
            let mut inner = lock(&self.inner);
            let i = inner.vms.iter().position(|t| t.id == id);
            i.map(|i| inner.vms.remove(i))
        };
        if let Some(v) = v {
            v.gate.unpark();
        }
    }

    /// The per-tick work done so far; see [`TickWork`].
    pub fn work(&self) -> TickWork {
        lock(&self.inner).work
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
            while self.handover() && !self.stop.load(Ordering::Relaxed) {
                std::thread::sleep(HANDOVER_POLL);
            }
            let c1 = own_thread_cpu_ns();
            let mut g = lock(&self.inner);
            g.self_cpu_ns += c1.saturating_sub(c0);
            g.ticks += 1;
        }
    }

    /// One tick: sample, decide, enforce. Public for tests.
    ///
    /// Per tick and VM: one clock read per vCPU (none while the VM is
    /// parked and settled), its device thread's only while busy or every
    /// [`IDLE_EXTRA_READ_TICKS`]th tick; a VM process: one process clock
    /// (plus its vCPUs' `schedstat` while it runs). No allocation in steady
    /// state, and the policy's lock is not held across a syscall: kicks and
    /// futex wakes run after it is released (this thread's own state stays
    /// locked, so an `attach` still cannot fall between decision and
    /// enforcement).
    pub fn tick(&self, tick_ns: u64) {
        let now = self.now_ns();
        let mut g = lock(&self.inner);
        let inner = &mut *g;
        inner.usages.clear();
        inner.tick_count += 1;
        inner.work.ticks += 1;
        let tick_no = inner.tick_count;
        for v in inner.vms.iter_mut() {
            let parked = v.gate.is_parked();
            if !parked {
                v.settled = false;
            }
            let settled = parked && v.settled;
            // All vCPUs blocked on the gate before we read their clocks:
            // these readings are final until the VM is unparked. (Every
            // vCPU is off the CPU for sure once the kick has landed, so
            // skipping their clocks keeps the scheduler cheap with many
            // parked VMs; the device thread may still serve I/O.)
            // (Not read again once settled: the gate's shared block is a
            // cache and TLB miss per VM and tick, a tenth of the thread's
            // time in the profile, BENCHMARKS.md.)
            if parked && !v.settled && v.gate.waiting() >= v.idle_ticks.len() as u64 {
                v.settled = true;
            }
            let reads = &mut inner.work.clock_reads;
            // Idle device threads (quiet VM processes) are read in turn: a
            // quarter of the running VMs at each tick, a sixteenth of the
            // settled parked ones.
            let every = if settled {
                SETTLED_READ_TICKS
            } else {
                IDLE_EXTRA_READ_TICKS
            };
            let due = tick_no.wrapping_add(v.slot as u64).is_multiple_of(every);
            let s = match &mut v.source {
                Source::Process(p) => {
                    let idle = &mut v.idle_ticks;
                    p.sample(&v.gate, now, tick_ns, idle, settled, due, reads)
                }
                Source::Threads(t) => t.sample(tick_ns, &mut v.idle_ticks, settled, due, reads),
            };
            inner.vms_since_sample_ns += v.report(s.total);
            // A parked VM's vCPUs wait on the gate: they still want CPU as
            // much as when they were parked.
            let runnable = match s.busy {
                _ if parked => v.runnable.max(1),
                Some(b) => b,
                None => v.runnable,
            };
            v.runnable = runnable;
            if !parked
                && s.busy.is_some_and(|b| b > 0)
                && let Some(io) = s.io
            {
                v.io = io;
            }
            inner.usages.push(
                VmUsage::total(v.id, s.total, runnable > 0)
                    .with_runnable_vcpus(runnable)
                    .with_busy_helpers(s.helpers),
            );
        }
        let outside = if tick_no % IDLE_SAMPLE_TICKS == 1 || inner.last_stat.is_none() {
            inner.work.stat_reads += 1;
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
        let handover_ns = sched.config().handover_ns;
        let out = sched.tick(now, &inner.usages);
        // Level-triggered: every gate is made to match the policy's current
        // decision, not only the gates of this tick's changes. A change for
        // a VM that was not attached yet (the policy can park a VM in the
        // milliseconds between `add_vm` and `attach`) would otherwise be
        // lost for good: the policy emits a change only once, and a capped
        // VM ran uncapped for a whole test with `parked = true`.
        let decisions = out.vms();
        let mut in_order = true;
        let mut prev = 0;
        for v in inner.vms.iter_mut() {
            let d = match decisions.get(v.slot) {
                Some(d) if d.vm == v.id => Some(d),
                // Attached, moved or removed since the last tick: one
                // search (then the slot holds until the model changes).
                _ => decisions.iter().position(|d| d.vm == v.id).map(|i| {
                    v.slot = i;
                    &decisions[i]
                }),
            };
            v.run = d.map(|d| d.should_run);
            in_order &= v.slot >= prev;
            prev = v.slot;
        }
        drop(sched);
        if !in_order {
            inner.vms.sort_unstable_by_key(|v| v.slot);
        }
        // Parks first. A VM to unpark while another was just parked waits
        // for the handover (`handover`, called by the tick thread until it
        // is done) if either is an I/O VM: the incoming VM's vCPUs start
        // once the outgoing ones are off the CPU. An I/O VM's vCPU and
        // device thread hand each request to each other, and each hand-off
        // waited for a CPU behind the other VM's spinning vCPUs, at its
        // turn's start and at its end (io victim beside the CPU hog: vCPU
        // waits 1.43 s a run without the handover, 2.09 s with it only for
        // an incoming I/O VM, 0.36 s with it both ways); between CPU-bound
        // VMs the overlap costs nothing the credits do not charge, and at 100
        // spinning vCPUs the polls cost the scheduler thread ~0.2 % of a
        // CPU (BENCHMARKS.md, Session 10).
        // A handover still pending from the last tick is superseded: this
        // tick's decisions are enforced in full.
        enforce_all(inner, handover_ns, now);
    }

    /// Ends a pending handover once every VM the last tick parked has its
    /// vCPUs off the CPU (all waiting on its gate), or at its deadline:
    /// opens the gates of the VMs that tick decided to unpark. Returns
    /// whether a handover is still pending. A VM
    /// process's count of waiting vCPUs is its own (untrusted): one that
    /// under-reports only delays the next VM by the deadline (at most one
    /// tick), one that over-reports only ends the handover early.
    pub fn handover(&self) -> bool {
        let now = self.now_ns();
        let mut g = lock(&self.inner);
        let inner = &mut *g;
        let Some((start, until)) = inner.handover_at else {
            return false;
        };
        let off_cpu = |id: &VmId| {
            inner.vms.iter().find(|v| v.id == *id).is_none_or(|v| {
                !v.gate.is_parked() || v.gate.waiting() >= v.idle_ticks.len() as u64
            })
        };
        let settled = inner.handover_out.iter().all(off_cpu);
        if !settled && now < until {
            return true;
        }
        let work = &mut inner.work;
        if !settled {
            work.handover_timeouts += 1;
        }
        work.handover_wait_ns += now.saturating_sub(start);
        for id in &inner.handover_in {
            if let Some(v) = inner.vms.iter().find(|v| v.id == *id)
                && v.run == Some(true)
                && enforce(&v.gate, true)
            {
                work.unparks += 1;
            }
        }
        inner.handover_in.clear();
        inner.handover_out.clear();
        inner.handover_at = None;
        false
    }
}

/// Makes every gate match the decision in force (parks first; a VM to
/// unpark beside a fresh park waits for the handover if it or a VM parked
/// is an I/O VM).
fn enforce_all(inner: &mut Inner, handover_ns: u64, now: u64) {
    let Inner {
        vms,
        work,
        handover_out,
        handover_in,
        handover_at,
        ..
    } = inner;
    handover_out.clear();
    handover_in.clear();
    *handover_at = None;
    let mut io_out = false;
    for v in vms.iter() {
        if v.run == Some(false) && enforce(&v.gate, false) {
            work.parks += 1;
            handover_out.push(v.id);
            io_out |= v.io;
        }
    }
    for v in vms.iter() {
        if v.run == Some(true) && v.gate.is_parked() {
            if handover_ns > 0 && (v.io || io_out) && !handover_out.is_empty() {
                handover_in.push(v.id);
            } else if enforce(&v.gate, true) {
                work.unparks += 1;
            }
        }
    }
    if !handover_in.is_empty() {
        work.handovers += 1;
        *handover_at = Some((now, now + handover_ns));
    }
}

/// How often the tick thread looks whether a handover can end.
const HANDOVER_POLL: Duration = Duration::from_micros(500);

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
/// must not run and the gate is open, opens it if the VM may run; true if
/// it changed the gate.
fn enforce(gate: &Gate, should_run: bool) -> bool {
    if gate.is_parked() == should_run {
        if should_run {
            gate.unpark()
        } else {
            gate.park()
        }
    } else {
        false
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
