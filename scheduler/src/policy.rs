//! The share policy: entitlements by water-filling, credits, park decisions.
//!
//! [`Policy`] is a pure state machine: it is driven by [`Policy::tick`] with
//! a timestamp and per-VM usage, never reads a clock and never blocks, so it
//! is tested and simulated with a fake clock. See the [crate docs](crate) for
//! the algorithm; this module documents the mechanics.
//!
//! # Inputs
//!
//! Each tick the caller reports, per VM, a [`VmUsage`]: CPU time (a
//! monotonically increasing total, or the delta since the previous tick) and
//! how many vCPUs *wanted* CPU during the tick (`runnable_vcpus`; `0` = idle,
//! i.e. halted in the guest). A parked VM whose vCPUs are waiting on the gate
//! wants CPU: report those vCPUs as runnable. VMs not mentioned in a tick are
//! treated as idle with no usage. Unknown ids are ignored (a VM removed
//! concurrently).
//!
//! # Cost
//!
//! A tick is `O(n log n)` for `n` VMs: one sort to rank the VMs that want
//! CPU, plus the water-filling when some demand changed (it sorts
//! breakpoints; a linear fast path handles the common case where no VM in a
//! class is limited by its demand). All buffers are reused: a tick does not
//! allocate once the model is stable. Model changes resynchronise in
//! `O(n log n)` with allocation.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use thiserror::Error;

use crate::capacity::HostLoad;

#[path = "policy_tree.rs"]
mod tree;
use crate::model::{ClassSpec, Model, VmId, VmSpec};

/// Tunables of the policy. Both can be changed live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyConfig {
    /// Expected interval between ticks, in ns (default 10 ms). The policy
    /// uses the real time between ticks for accounting; this value only
    /// sizes the debt bound (one tick of overrun is always repaid).
    pub tick_ns: u64,
    /// Accounting period, in ns (default 100 ms): credit carry-over is
    /// bounded by one period's worth of entitlement, and `used_pct` in the
    /// stats is averaged over about one period.
    pub period_ns: u64,
    /// Minimum slice, in ns (default 20 ms, two ticks): a VM that is
    /// unparked to take its turn keeps running for at least this long
    /// (unless a cap stops it or it goes idle) before it is ranked against
    /// the VMs that wait. Each turn costs a kick of the VM parked for it
    /// and a wake of the VM unparked: with 25 VMs of 4 spinning vCPUs on 2
    /// CPUs, one-tick turns were a park and an unpark at every tick, and
    /// the signals and futex wakes were 27 % of the scheduler thread's time
    /// (BENCHMARKS.md, "Session 8", scheduler thread). A kick takes ~4 ms on
    /// kvm_pvm, so one-tick turns also ran the outgoing and the incoming VM
    /// side by side for much of each turn. Credits are charged as before,
    /// so the long-run shares do not change; turns are just longer (Xen's
    /// credit scheduler has 10-ms ticks and 30-ms slices for the same
    /// reasons). 0, or a value up to one tick, gives one-tick turns.
    pub min_slice_ns: u64,
    /// Handover, in ns (default 5 ms; 0 = off): at a tick that parks a VM
    /// and unparks another, if either is an I/O VM (one with a busy device
    /// thread), the enforcer opens the incoming VM's gate only once the
    /// outgoing VMs' vCPUs are all off the CPU (waiting on their gates), or
    /// after this long. A kick takes up to ~4 ms on kvm_pvm: without the
    /// handover the two VMs ran side by side that long at every turn, and
    /// the I/O VM's vCPU and device thread, which hand each request to each
    /// other, waited for a CPU behind the other VM's spinning vCPUs at
    /// every hand-off. At
    /// most one tick. Not a policy input: the policy charges each VM what
    /// it used, so the shares do not depend on it.
    pub handover_ns: u64,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            tick_ns: 10_000_000,
            period_ns: 100_000_000,
            min_slice_ns: 20_000_000,
            handover_ns: 5_000_000,
        }
    }
}

/// How much of the learnt idle margin is added to the admission target.
const MARGIN_GAIN: f64 = 2.0;

/// A VM that used at least this fraction of what its runnable vCPUs could
/// use counts as wanting all of it. On a real host, usage is diluted by the
/// VMs admitted beside it between two ticks, and an estimate read from a
/// diluted usage admits more VMs, which dilutes it further: 0.6 let a
/// 3:1 share collapse to ~57:43 on real VMs; 0.4 holds it.
const DEMAND_FULL_FRACTION: f64 = 0.4;

/// A VM with busy helper threads (its device thread) whose threads used
/// less than this fraction of the fair share per thread (capacity over all
/// unparked runnable threads) was not held back by the host's contention
/// but by its own work (I/O, a throttle): its usage is not scaled up by
/// the contention (see `Policy::contention`). A spinning VM's threads get
/// about the fair share, less kick latency and noise.
const LIGHT_FRACTION: f64 = 0.5;

/// A VM is diluted (see `dilutes`) if it would get less than this fraction
/// of its entitlement: estimates carry headroom (`× 1.1 + 5 %`), and a
/// light I/O VM beside the victim must not be refused for taking a
/// percent more than it was counted at.
const DILUTION_FRACTION: f64 = 0.9;

/// A VM with busy helpers that covers the host by its estimate gets a
/// co-runner only if, the last time it ran, it used under this fraction of
/// the planned capacity (the throttled I/O hog: 115 % of 189 %). A
/// spinning VM process whose device thread looked busy for a tick fills
/// the host and gets none (with 25 such VMs on 2 CPUs, co-running them
/// raised the parks a tick from 0.50 to 0.65).
const CORUN_USED_FRACTION: f64 = 0.7;

/// Shortest tick accepted by [`PolicyConfig::validate`].
pub const MIN_TICK_NS: u64 = 100_000;

impl PolicyConfig {
    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.tick_ns < MIN_TICK_NS {
            return Err(ConfigError::TickTooShort(self.tick_ns));
        }
        if self.period_ns < self.tick_ns {
            return Err(ConfigError::PeriodShorterThanTick {
                period_ns: self.period_ns,
                tick_ns: self.tick_ns,
            });
        }
        if self.min_slice_ns > self.period_ns {
            return Err(ConfigError::SliceLongerThanPeriod {
                min_slice_ns: self.min_slice_ns,
                period_ns: self.period_ns,
            });
        }
        if self.handover_ns > self.tick_ns {
            return Err(ConfigError::HandoverLongerThanTick {
                handover_ns: self.handover_ns,
                tick_ns: self.tick_ns,
            });
        }
        Ok(())
    }
}

/// An invalid [`PolicyConfig`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    /// Tick below [`MIN_TICK_NS`].
    #[error("tick must be at least {MIN_TICK_NS} ns, got {0} ns")]
    TickTooShort(u64),
    /// Period shorter than a tick.
    #[error("accounting period ({period_ns} ns) must be at least one tick ({tick_ns} ns)")]
    PeriodShorterThanTick {
        /// Requested period.
        period_ns: u64,
        /// Requested tick.
        tick_ns: u64,
    },
    /// A minimum slice longer than the accounting period.
    #[error(
        "minimum slice ({min_slice_ns} ns) must be at most one accounting period ({period_ns} ns)"
    )]
    SliceLongerThanPeriod {
        /// Requested minimum slice.
        min_slice_ns: u64,
        /// Requested period.
        period_ns: u64,
    },
    /// A handover longer than a tick.
    #[error("handover ({handover_ns} ns) must be at most one tick ({tick_ns} ns)")]
    HandoverLongerThanTick {
        /// Requested handover.
        handover_ns: u64,
        /// Requested tick.
        tick_ns: u64,
    },
}

/// How CPU time is reported in a [`VmUsage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuTime {
    /// Total CPU time of the VM's vCPU threads since some fixed origin (e.g.
    /// the sum of their `pthread_getcpuclockid` clocks). The first report of
    /// a VM only sets the baseline. A total that goes backwards counts as 0.
    Total(u64),
    /// CPU time consumed since the previous tick.
    Delta(u64),
}

/// `runnable_vcpus` value meaning "all of the VM's vCPUs".
pub const ALL_VCPUS: u32 = u32::MAX;

/// One VM's usage report for a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmUsage {
    /// The VM.
    pub vm: VmId,
    /// CPU time consumed.
    pub cpu: CpuTime,
    /// How many vCPUs wanted CPU during the tick (runnable, running, or
    /// waiting on a parked gate); clamped to the VM's vCPU count. `0` means
    /// the VM was idle (halted): it gets no entitlement and burns no credit.
    pub runnable_vcpus: u32,
    /// How many of the VM's other threads whose CPU time is in `cpu` (its
    /// device thread, which does its I/O) wanted CPU during the tick. Each
    /// adds one CPU to the VM's demand bound, on top of its vCPUs: an
    /// I/O-bound VM with one busy vCPU and a busy device thread can use two
    /// CPUs, and capping its demand at one would hand the second to others.
    pub busy_helpers: u32,
}

impl VmUsage {
    /// Usage as a cumulative CPU total; `wants_cpu` marks all vCPUs runnable.
    pub fn total(vm: VmId, cpu_ns_total: u64, wants_cpu: bool) -> Self {
        VmUsage {
            vm,
            cpu: CpuTime::Total(cpu_ns_total),
            runnable_vcpus: if wants_cpu { ALL_VCPUS } else { 0 },
            busy_helpers: 0,
        }
    }

    /// Usage as a delta since the previous tick; `wants_cpu` marks all vCPUs
    /// runnable.
    pub fn delta(vm: VmId, cpu_ns: u64, wants_cpu: bool) -> Self {
        VmUsage {
            vm,
            cpu: CpuTime::Delta(cpu_ns),
            runnable_vcpus: if wants_cpu { ALL_VCPUS } else { 0 },
            busy_helpers: 0,
        }
    }

    /// Builder: report exactly `n` runnable vCPUs (more precise than a bool
    /// for VMs whose vCPUs are not all busy).
    pub fn with_runnable_vcpus(mut self, n: u32) -> Self {
        self.runnable_vcpus = n;
        self
    }

    /// Builder: `n` helper threads (see [`VmUsage::busy_helpers`]) were busy.
    pub fn with_busy_helpers(mut self, n: u32) -> Self {
        self.busy_helpers = n;
        self
    }
}

/// What to do with a VM's gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Park: kick the vCPUs out of `KVM_RUN` and hold them on the gate.
    Park,
    /// Unpark: release the vCPUs.
    Unpark,
}

/// A change of a VM's parked state decided by a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Change {
    /// The VM.
    pub vm: VmId,
    /// What to do.
    pub action: Action,
}

/// The per-VM result of a tick.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VmDecision {
    /// The VM.
    pub vm: VmId,
    /// `false` if the VM must be parked until a later tick says otherwise.
    pub should_run: bool,
    /// Current entitlement in percent of one CPU (0 when idle).
    pub entitlement_pct: f64,
}

/// Result of [`Policy::tick`]; buffers are reused between ticks.
#[derive(Debug, Clone, Default)]
pub struct TickOutput {
    now_ns: u64,
    changes: Vec<Change>,
    vms: Vec<VmDecision>,
}

impl TickOutput {
    /// Timestamp of the tick.
    pub fn now_ns(&self) -> u64 {
        self.now_ns
    }

    /// Parked-state changes of this tick (only VMs whose state changed).
    /// Enforcement should follow [`vms`](Self::vms) (the decision in force
    /// for every VM) rather than these alone: a change that cannot be
    /// applied when it is emitted (VM not attached yet) is not repeated.
    pub fn changes(&self) -> &[Change] {
        &self.changes
    }

    /// Decision for every VM in the model (ordered by class, then id).
    pub fn vms(&self) -> &[VmDecision] {
        &self.vms
    }
}

/// Entitlements of classes and VMs for a given demand, in percent of one CPU
/// (see [`entitlements`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Entitlements {
    /// Per class (classes with no runnable VM get 0).
    pub classes: BTreeMap<String, f64>,
    /// Per VM (idle VMs get 0).
    pub vms: BTreeMap<VmId, f64>,
}

/// Scheduling statistics of one VM.
#[derive(Debug, Clone, PartialEq)]
pub struct VmStats {
    /// The VM.
    pub vm: VmId,
    /// Its class.
    pub class: String,
    /// Its weight in the class.
    pub weight: u32,
    /// Its vCPU count.
    pub vcpus: u32,
    /// Its own cap, percent of one CPU.
    pub cap: Option<u32>,
    /// Remaining budget of its own cap, ns (only with a cap).
    pub cap_budget_ns: Option<i64>,
    /// Whether its own cap is what currently limits it.
    pub cap_bound: bool,
    /// vCPUs that wanted CPU in the last tick.
    pub runnable_vcpus: u32,
    /// Current entitlement, percent of one CPU.
    pub entitlement_pct: f64,
    /// Demand estimated at the last tick (what admission counts the VM
    /// as), percent of one CPU.
    pub demand_pct: f64,
    /// CPU used, percent of one CPU, averaged over about one period.
    pub used_pct: f64,
    /// Total CPU time accounted since the VM was added, ns.
    pub cpu_ns: u64,
    /// Current credit, ns of CPU time (negative = debt).
    pub credit_ns: i64,
    /// Whether the VM is currently parked.
    pub parked: bool,
    /// Total time spent parked, ns.
    pub parked_ns: u64,
    /// Number of times the VM was parked.
    pub park_count: u64,
}

/// Scheduling statistics of one class (sums over its VMs).
#[derive(Debug, Clone, PartialEq)]
pub struct ClassStats {
    /// Class name.
    pub name: String,
    /// Its parent class, if it is not a root.
    pub parent: Option<String>,
    /// Its settings.
    pub spec: ClassSpec,
    /// Number of VMs.
    pub vms: usize,
    /// Number of VMs currently parked.
    pub parked_vms: usize,
    /// Class entitlement, percent of one CPU.
    pub entitlement_pct: f64,
    /// CPU used by the VMs of its subtree, percent of one CPU, averaged over
    /// about a period.
    pub used_pct: f64,
    /// Total CPU time of its current VMs, ns.
    pub cpu_ns: u64,
    /// Remaining cap budget, ns (only for capped classes).
    pub cap_budget_ns: Option<i64>,
    /// Whether the cap is what currently limits the class.
    pub cap_bound: bool,
}

/// Snapshot of the scheduler state, for metrics and `corral top`.
#[derive(Debug, Clone, PartialEq)]
pub struct Stats {
    /// Capacity (the model's), percent of one CPU.
    pub capacity_pct: u64,
    /// The capacity planned with: capacity less steal and outside load.
    pub available_pct: f64,
    /// Host CPU lost to steal, percent of one CPU.
    pub steal_pct: f64,
    /// Host CPU used by everything but corral's VMs (averaged), percent.
    pub outside_pct: f64,
    /// Reservations claimed now (each class's bounded by its demand).
    pub claimed_reservations_pct: f64,
    /// Fraction of the claimed reservations the available capacity cannot
    /// deliver (0 = all honoured).
    pub shortfall_ratio: f64,
    /// Sum of class reservations, percent of one CPU.
    pub reserved_pct: u64,
    /// Ticks run so far.
    pub ticks: u64,
    /// Timestamp of the last tick.
    pub last_tick_ns: Option<u64>,
    /// Per class, by name.
    pub classes: Vec<ClassStats>,
    /// Per VM, ordered by class then id.
    pub vms: Vec<VmStats>,
}

/// Fx-style hasher for `VmId` keys (cheap; ids are not attacker-chosen).
#[derive(Default, Clone, Copy)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

type IdMap = HashMap<VmId, usize, BuildHasherDefault<IdHasher>>;

#[derive(Debug, Clone)]
struct VmState {
    id: VmId,
    class: usize,
    weight: u32,
    vcpus: u32,
    /// The VM's own cap, percent.
    cap: Option<u32>,
    /// Its cap budget, ns (like a class's; 0 without a cap).
    budget: f64,
    /// Whether its own cap is what limits it.
    cap_bound: bool,
    last_total: Option<u64>,
    // Inputs of the current tick.
    used_ns: u64,
    runnable: u32,
    /// Busy helper threads among `runnable`.
    helpers: u32,
    /// Whether it had a busy helper thread the last time it ran unparked
    /// with a runnable vCPU (an I/O VM; a parked VM's device thread soon
    /// goes quiet).
    io: bool,
    prev_runnable: u32,
    /// Estimated demand for the next tick, percent.
    demand: f64,
    prev_demand: f64,
    /// Last usage-based estimate (0 = none yet).
    last_est: f64,
    /// Unparked by the previous tick (its last usage may be diluted by the
    /// kick latency of the VM parked at the same time).
    just_unparked: bool,
    /// What it used (percent, uncorrected) in the last tick it ran
    /// unparked through; infinite before it did.
    run_used: f64,
    /// When the VM was last unparked (ns; its turn's start).
    unparked_at: u64,
    // Policy state.
    credit: f64,
    ent: f64,
    ent_ref: f64,
    parked: bool,
    run: bool,
    // Statistics.
    cpu_ns: u64,
    parked_ns: u64,
    park_count: u64,
    used_pct: f64,
}

impl VmState {
    /// Demand bounded by the VM's own cap.
    fn capped_demand(&self) -> f64 {
        self.cap
            .map_or(self.demand, |cap| self.demand.min(f64::from(cap)))
    }

    /// Whether the VM's own cap budget is spent.
    fn cap_spent(&self) -> bool {
        self.cap.is_some() && self.budget <= 0.0
    }

    /// Whether the VM, which used `used` percent in the last tick, was held
    /// back by its own work rather than the contention (`level`: the fair
    /// share per thread, percent): a VM with busy helper threads (its I/O)
    /// whose threads used less than [`LIGHT_FRACTION`] of the fair share.
    /// VMs without helpers keep the correction: a latency-sensitive VM's
    /// short bursts, taken at face value, made its demand and entitlement
    /// so small that its requests queued behind 1000 others (p99 2.6 s,
    /// `sim_large`).
    fn is_light(&self, used: f64, level: f64) -> bool {
        self.helpers > 0 && used < LIGHT_FRACTION * level * f64::from(self.runnable)
    }

    fn new(id: VmId, class: usize, spec: &VmSpec) -> Self {
        VmState {
            id,
            class,
            weight: spec.weight,
            vcpus: spec.vcpus,
            cap: spec.cap,
            budget: 0.0,
            cap_bound: false,
            last_total: None,
            used_ns: 0,
            runnable: 0,
            helpers: 0,
            io: false,
            prev_runnable: 0,
            demand: 0.0,
            prev_demand: 0.0,
            last_est: 0.0,
            just_unparked: false,
            run_used: f64::INFINITY,
            unparked_at: 0,
            credit: 0.0,
            ent: 0.0,
            ent_ref: 0.0,
            parked: false,
            run: true,
            cpu_ns: 0,
            parked_ns: 0,
            park_count: 0,
            used_pct: 0.0,
        }
    }
}

#[derive(Debug, Clone)]
struct ClassState {
    name: String,
    spec: ClassSpec,
    /// Parent class (index), `None` for a root.
    parent: Option<usize>,
    /// Child classes (indices).
    children: Vec<usize>,
    /// Effective reservation: own, or the children's together if more.
    eff_res: f64,
    start: usize,
    end: usize,
    /// vCPUs of the VMs in its subtree.
    vcpus: u64,
    budget: f64,
    ent: f64,
    /// Demand of its subtree (own VMs' capped demand + children's bounds).
    sub_demand: f64,
    /// Water-filling bounds of the class among its siblings.
    lo: f64,
    hi: f64,
    cap_bound: bool,
    /// It or an ancestor is held back by its cap.
    held: bool,
    /// It or an ancestor has spent its cap budget.
    spent: bool,
    /// CPU used by its subtree in the last tick.
    used_ns: u64,
    used_pct: f64,
}

/// One item of a water-filling problem.
#[derive(Debug, Clone, Copy)]
struct Wf {
    w: f64,
    lo: f64,
    hi: f64,
}

/// The admitted VMs of one admission question, with the scratch space to
/// answer it: [`Dilution::dilutes`].
#[derive(Debug, Clone, Default)]
struct Dilution {
    /// Each admitted VM as a water-filling item: weight its threads,
    /// bounds 0 and its demand (its share is then `threads × min(level,
    /// demand per thread)`, the host's max-min per thread).
    items: Vec<Wf>,
    /// Each admitted VM's floor: its entitlement or its demand, if smaller.
    floors: Vec<f64>,
    out: Vec<f64>,
    events: Vec<(f64, f64)>,
}

impl Dilution {
    fn clear(&mut self) {
        self.items.clear();
        self.floors.clear();
    }

    /// Adds an admitted VM of `demand` on `threads` threads with `floor`.
    fn push(&mut self, demand: f64, threads: f64, floor: f64) {
        self.items.push(Wf {
            w: threads,
            lo: 0.0,
            hi: demand,
        });
        self.floors.push(floor);
    }

    /// Whether running a VM of `demand` on `threads` threads beside the
    /// admitted VMs would leave one of them with less than
    /// [`DILUTION_FRACTION`] of its floor, with the `cap` percent divided
    /// the way the host's scheduler does it: max-min fair per thread.
    ///
    /// Why it matters: two 2-thread VMs on 2 CPUs share the host 50/50 while
    /// both run, whatever their shares; shares 3:1 hold only while the smaller
    /// one is parked part of the time. Admitting a VM because the admitted
    /// demand fell a few percent short of the capacity (an io victim counted at
    /// 181 % on a host planned at 189 %) ran the victim's limited I/O hog beside
    /// it all the time, and the victim got 47 % of a CPU where it was entitled
    /// to 146 %. The other way round the admission is right: a throttled hog
    /// that cannot fill the host alone leaves the CPU idle unless the victim
    /// runs beside it, and the hog's own share is not diluted by that.
    fn dilutes(&mut self, demand: f64, threads: f64, cap: f64) -> bool {
        let total = demand + self.items.iter().map(|a| a.hi).sum::<f64>();
        if total <= cap || threads <= 0.0 {
            return false;
        }
        self.items.push(Wf {
            w: threads,
            lo: 0.0,
            hi: demand,
        });
        water_fill(&self.items, cap, &mut self.out, &mut self.events);
        self.items.pop();
        self.out
            .iter()
            .zip(&self.floors)
            .any(|(&got, &floor)| got < DILUTION_FRACTION * floor)
    }
}

/// Weighted max-min fair division of `total` among `items`: finds the level
/// `λ` such that `Σ clamp(λ·w, lo, hi) = min(total, Σ hi)` and writes each
/// item's share to `out`. Requires `w > 0` and `0 <= lo <= hi`. If even the
/// lower bounds do not fit, they are scaled down proportionally.
fn water_fill(items: &[Wf], total: f64, out: &mut Vec<f64>, events: &mut Vec<(f64, f64)>) {
    out.clear();
    let (mut sum_lo, mut sum_hi, mut sum_w) = (0.0, 0.0, 0.0);
    for it in items {
        sum_lo += it.lo;
        sum_hi += it.hi;
        if it.hi > 0.0 {
            sum_w += it.w;
        }
    }
    let total = total.max(0.0);
    if sum_hi <= total {
        out.extend(items.iter().map(|it| it.hi));
        return;
    }
    if sum_lo >= total {
        let scale = if sum_lo > 0.0 { total / sum_lo } else { 0.0 };
        out.extend(items.iter().map(|it| it.lo * scale));
        return;
    }
    // Fast path: every item with room is strictly inside its bounds.
    let level = total / sum_w;
    if items
        .iter()
        .all(|it| it.hi == 0.0 || (it.lo <= level * it.w && level * it.w <= it.hi))
    {
        out.extend(
            items
                .iter()
                .map(|it| if it.hi == 0.0 { 0.0 } else { level * it.w }),
        );
        return;
    }
    // General case: sweep the breakpoints of the piecewise-linear
    // f(λ) = Σ clamp(λ·w, lo, hi); slope +w at lo/w, -w at hi/w.
    events.clear();
    for it in items.iter().filter(|it| it.hi > 0.0) {
        events.push((it.lo / it.w, it.w));
        events.push((it.hi / it.w, -it.w));
    }
    events.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
    let (mut f, mut slope, mut cur) = (sum_lo, 0.0_f64, 0.0_f64);
    let mut level = f64::INFINITY;
    for &(x, dw) in events.iter() {
        let fx = f + slope * (x - cur);
        if fx >= total && slope > 0.0 {
            level = cur + (total - f) / slope;
            break;
        }
        f = fx;
        cur = x;
        slope += dw;
    }
    out.extend(items.iter().map(|it| (level * it.w).clamp(it.lo, it.hi)));
}

/// The policy state. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct Policy {
    config: PolicyConfig,
    generation: Option<u64>,
    /// The capacity the policy plans with: the model's, less steal and the
    /// outside load (see [`HostLoad`]), updated when it moves by 1 % of a
    /// CPU or more.
    capacity_pct: f64,
    /// Steal, outside load and the capacity they leave.
    host: HostLoad,
    /// Reservations claimed at the last planning (each class's bounded by
    /// its demand), percent.
    claimed_pct: f64,
    reserved_pct: u64,
    vms: Vec<VmState>,
    classes: Vec<ClassState>,
    /// Class indices by depth, roots first.
    tree_order: Vec<usize>,
    index: IdMap,
    last_now: Option<u64>,
    ticks: u64,
    ent_dirty: bool,
    /// Extra admission (percent) learnt from CPU left idle while VMs waited.
    margin: f64,
    /// The host's measured idle CPU over the coming tick, percent, if the
    /// caller measures it (e.g. from /proc/stat). Without it, idle is
    /// inferred as capacity minus the VMs' usage, which overstates it when
    /// other processes use the host.
    measured_idle_pct: Option<f64>,
    // Scratch buffers, reused between ticks.
    items: Vec<Wf>,
    shares: Vec<f64>,
    events: Vec<(f64, f64)>,
    /// Light incumbent, lag, within its minimum slice, index.
    candidates: Vec<(bool, f64, bool, u32)>,
    /// VMs that may be light: use per thread, use, threads.
    light: Vec<(f64, f64, f64)>,
    /// Admitted VMs for [`Dilution::dilutes`].
    fill: Dilution,
    output: TickOutput,
}

impl Policy {
    /// A policy with no VMs; it picks the model up on the first tick (or
    /// [`sync`](Self::sync)).
    ///
    /// # Panics
    /// If `config` is invalid (see [`PolicyConfig::validate`]).
    pub fn new(config: PolicyConfig) -> Self {
        config.validate().expect("invalid policy config");
        Policy {
            config,
            generation: None,
            capacity_pct: 0.0,
            host: HostLoad::new(0.0),
            claimed_pct: 0.0,
            reserved_pct: 0,
            vms: Vec::new(),
            classes: Vec::new(),
            tree_order: Vec::new(),
            index: IdMap::default(),
            last_now: None,
            ticks: 0,
            ent_dirty: true,
            margin: 0.0,
            measured_idle_pct: None,
            items: Vec::new(),
            shares: Vec::new(),
            events: Vec::new(),
            candidates: Vec::new(),
            light: Vec::new(),
            fill: Dilution::default(),
            output: TickOutput::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> PolicyConfig {
        self.config
    }

    /// Changes the configuration live.
    pub fn set_config(&mut self, config: PolicyConfig) -> Result<(), ConfigError> {
        config.validate()?;
        self.config = config;
        Ok(())
    }

    /// Picks up model changes (no-op if the model's generation is unchanged).
    /// VM state (credit, parked, statistics) survives by id, also across a
    /// class move. Called by [`tick`](Self::tick) automatically.
    pub fn sync(&mut self, model: &Model) {
        if self.generation == Some(model.generation()) {
            return;
        }
        self.generation = Some(model.generation());
        self.host.set_nominal(model.capacity().percent() as f64);
        self.capacity_pct = self.host.available_pct();
        self.reserved_pct = model.reserved_percent();
        self.ent_dirty = true;

        // Both lists are sorted by name (the model's classes are a sorted
        // map, and ours were built from it): a merge keeps each class's
        // state and its name without hashing or copying every name again.
        // (A HashMap of cloned names here made every class change O(n) in
        // allocations and hashes: 10k `Scheduler::create_class` calls took
        // 150 s in a debug build, 14.8 s with the merge. Still O(n) per
        // change, so the daemon bounds the class count: --max-classes.)
        let old = std::mem::replace(&mut self.classes, Vec::with_capacity(model.class_count()));
        let mut old_classes = old.into_iter().peekable();
        let mut names: Vec<&str> = Vec::with_capacity(model.class_count());
        for (name, spec) in model.classes() {
            // One comparison per class (most are where they were).
            let mut same = None;
            while let Some(c) = old_classes.peek() {
                match c.name.as_str().cmp(name) {
                    std::cmp::Ordering::Less => {
                        old_classes.next();
                    }
                    std::cmp::Ordering::Equal => {
                        same = old_classes.next();
                        break;
                    }
                    std::cmp::Ordering::Greater => break,
                }
            }
            let (name_owned, budget, used_pct) = match same {
                Some(c) => (c.name, c.budget, c.used_pct),
                None => (name.to_owned(), 0.0, 0.0),
            };
            names.push(name);
            self.classes.push(ClassState {
                name: name_owned,
                spec: *spec,
                parent: None,
                children: Vec::new(),
                eff_res: 0.0,
                start: 0,
                end: 0,
                vcpus: 0,
                budget,
                ent: 0.0,
                sub_demand: 0.0,
                lo: 0.0,
                hi: 0.0,
                cap_bound: false,
                held: false,
                spent: false,
                used_ns: 0,
                used_pct,
            });
        }
        for (ci, (_, _, parent)) in model.classes_with_parents().enumerate() {
            let Some(parent) = parent.and_then(|p| names.binary_search(&p).ok()) else {
                continue;
            };
            self.classes[ci].parent = Some(parent);
            self.classes[parent].children.push(ci);
        }

        let mut order: Vec<(usize, VmId, &VmSpec)> = model
            .vms()
            .map(|(id, spec)| {
                let class = names
                    .binary_search(&spec.class.as_str())
                    .expect("model VM in unknown class");
                (class, id, spec)
            })
            .collect();
        order.sort_unstable_by_key(|&(class, id, _)| (class, id));

        let mut old_vms = std::mem::take(&mut self.vms);
        let old_index = std::mem::take(&mut self.index);
        for (slot, &(class, id, spec)) in order.iter().enumerate() {
            let state = match old_index.get(&id) {
                Some(&i) => {
                    let mut s = std::mem::replace(&mut old_vms[i], VmState::new(id, class, spec));
                    s.class = class;
                    s.weight = spec.weight;
                    s.vcpus = spec.vcpus;
                    s.cap = spec.cap;
                    s
                }
                None => VmState::new(id, class, spec),
            };
            self.vms.push(state);
            self.index.insert(id, slot);
            let c = &mut self.classes[class];
            if c.end == 0 {
                c.start = slot;
            }
            c.end = slot + 1;
            c.vcpus += u64::from(spec.vcpus);
        }
        for c in &mut self.classes {
            if c.end == 0 {
                c.start = 0;
            }
        }
        self.sync_tree();
    }

    /// Tells the next tick how much host CPU was really idle during it
    /// (percent of one CPU), so that CPU used by other processes is not
    /// mistaken for CPU the VMs left idle.
    pub fn set_measured_idle(&mut self, idle_pct: Option<f64>) {
        self.measured_idle_pct = idle_pct;
    }

    /// Tells the policy how much host CPU the hypervisor below took (steal
    /// time, percent of one CPU) over the last measurement. The policy then
    /// plans with the capacity that is really there: a reservation is a
    /// guarantee of real CPU, so on a host that loses 14 % of its CPU to
    /// steal, a 100 % reservation still gets a whole CPU and the others
    /// share what is left (planning with the nominal capacity cut every
    /// class in proportion, the reserved one to ~93 %). Below 1 % of a CPU
    /// steal is ignored as noise; at most half the capacity is discounted.
    pub fn set_measured_steal(&mut self, steal_pct: Option<f64>) {
        self.host.set_steal(steal_pct);
        self.replan_capacity();
    }

    /// Tells the policy how much host CPU everything but corral's VMs used
    /// over the last `interval_ns` (percent of one CPU): other processes,
    /// which the host's scheduler serves by its own fairness whatever the
    /// shares say. The policy plans with what is left (averaged, see
    /// [`HostLoad`]), so every entitlement is one the VMs can reach.
    /// `None` forgets the outside load.
    pub fn set_measured_outside(&mut self, outside_pct: Option<f64>, interval_ns: u64) {
        match outside_pct {
            Some(x) => self.host.add_outside_sample(x, interval_ns),
            None => self.host.clear_outside(),
        }
        self.replan_capacity();
    }

    /// Re-plans when the available capacity moved by 1 % of a CPU or more.
    fn replan_capacity(&mut self) {
        let c = self.host.available_pct();
        if (c - self.capacity_pct).abs() >= 1.0 {
            self.capacity_pct = c;
            self.ent_dirty = true;
        }
    }

    /// Steal, outside load and the capacity planned with.
    pub fn host_load(&self) -> &HostLoad {
        &self.host
    }

    /// Runs one tick at time `now_ns` with the given usage reports and
    /// returns the decisions. See the [crate docs](crate) for the algorithm.
    ///
    /// Passing `usages` in the order of [`TickOutput::vms`] (class, then id)
    /// lets the policy skip a hash lookup per VM; any order is accepted.
    pub fn tick(&mut self, model: &Model, now_ns: u64, usages: &[VmUsage]) -> &TickOutput {
        self.sync(model);
        let dt = self.last_now.map_or(0, |last| now_ns.saturating_sub(last));
        self.last_now = Some(now_ns);
        self.ticks += 1;
        self.read_usages(usages);
        self.estimate_demand(dt);
        if self.ent_dirty || self.vms.iter().any(|v| v.demand != v.prev_demand) {
            self.compute_entitlements();
            self.ent_dirty = false;
        }
        if dt > 0 {
            self.account(dt);
        }
        self.decide(now_ns);
        self.emit(now_ns);
        &self.output
    }

    fn read_usages(&mut self, usages: &[VmUsage]) {
        for vm in &mut self.vms {
            vm.used_ns = 0;
            vm.runnable = 0;
            vm.helpers = 0;
        }
        let mut unknown = 0usize;
        for (k, u) in usages.iter().enumerate() {
            let i = match self.vms.get(k) {
                Some(v) if v.id == u.vm => k,
                _ => match self.index.get(&u.vm) {
                    Some(&i) => i,
                    None => {
                        unknown += 1;
                        continue;
                    }
                },
            };
            let vm = &mut self.vms[i];
            let used = match u.cpu {
                CpuTime::Total(total) => {
                    let d = vm.last_total.map_or(0, |last| total.saturating_sub(last));
                    vm.last_total = Some(total);
                    d
                }
                CpuTime::Delta(d) => d,
            };
            vm.used_ns = vm.used_ns.saturating_add(used);
            // Helpers count only beside a runnable vCPU: a device thread
            // finishing I/O for a halted VM does not make it demanding.
            let vcpus = u.runnable_vcpus.min(vm.vcpus);
            let mut helpers = if vcpus > 0 { u.busy_helpers.min(4) } else { 0 };
            // A parked I/O VM's device thread goes quiet once its requests
            // are done, but the VM wants it as much as when it was parked
            // (as its vCPUs, which wait on the gate): counted at its
            // vCPUs alone, a parked io victim looked like half its demand,
            // and the limited I/O hog was admitted beside it when it
            // returned.
            if vm.parked && vm.io && vcpus > 0 {
                helpers = helpers.max(1);
            }
            vm.runnable = vm.runnable.max(vcpus + helpers);
            vm.helpers = vm.helpers.max(helpers);
            if !vm.parked && vcpus > 0 {
                vm.io = vm.helpers > 0;
            }
        }
        if unknown > 0 {
            tracing::debug!(unknown, "usage reports for unknown VMs ignored");
        }
    }

    /// Estimates each VM's demand (percent) for the coming tick.
    ///
    /// The bound is always `100 × runnable vCPUs` ("full"). A VM that ran
    /// unparked through the last tick shows its demand in its usage,
    /// corrected for the host contention among unparked vCPUs (not for a
    /// light I/O VM, see [`LIGHT_FRACTION`]): if that is at
    /// least 60 % of full it is taken as full (a spinning VM whose usage was
    /// diluted by noise or kick latency must not look smaller than it is),
    /// otherwise usage `× 1.1 + 5 %` (headroom to grow). A VM unparked only
    /// at the last tick never looks smaller than before. A parked VM, or one
    /// that just woke up, keeps its last estimate (full if it has none).
    fn estimate_demand(&mut self, dt: u64) {
        let (level, rate) = self.contention(dt);
        for vm in &mut self.vms {
            let full = f64::from(vm.runnable) * 100.0;
            let remembered = if vm.last_est > 0.0 {
                vm.last_est.min(full)
            } else {
                full
            };
            vm.demand = if vm.runnable == 0 {
                0.0
            } else if vm.parked || vm.prev_runnable == 0 || dt == 0 {
                remembered
            } else {
                let used = vm.used_ns as f64 / dt as f64 * 100.0;
                if !vm.just_unparked {
                    vm.run_used = used;
                }
                // A VM whose threads used well under the fair share per
                // thread was not held back by the contention: its usage
                // is its demand, uncorrected.
                let used = if vm.is_light(used, level) {
                    used
                } else {
                    used / rate
                };
                let mut est = if used >= DEMAND_FULL_FRACTION * full {
                    full
                } else {
                    (used * 1.1 + 5.0).min(full)
                };
                if vm.just_unparked {
                    est = est.max(remembered);
                }
                vm.last_est = est;
                est
            };
            vm.just_unparked = false;
        }
    }

    /// The host contention among the unparked VMs over the last tick of
    /// `dt` ns: the fair share per thread of the VMs that are not light
    /// (see [`LIGHT_FRACTION`]) — the capacity the light VMs left, shared
    /// among the others' threads, max-min as the host's scheduler divides
    /// it (percent; infinite without contention) — and the rate at which
    /// those threads ran (the same over 100; 1 without contention). A VM is
    /// light against the level the lighter ones leave: measured against
    /// `capacity / threads` alone, an io victim using 36 % beside a light
    /// I/O hog on a host planned at 108 % (one busy loop) counted as held
    /// back (the level was 27 % per thread), was scaled up to a full 200 %
    /// and, ranked first, parked the hog; the hog's unpark did the same to
    /// the victim (parked 17 % of the time, the hog counted at 147 %;
    /// `tests/sim_iohog.rs`).
    ///
    /// Correcting every VM by the first figure made a throttled I/O VM
    /// (one vCPU and its device thread runnable, ~15 % of a CPU used) look
    /// like it wanted a full 200 % beside a spinning 2-vCPU VM on a host
    /// planned at ~140 %: while it ranked first nothing else was admitted,
    /// and a victim of shares 3 was parked 22 % of the time (simulator,
    /// `tests/sim_iohog.rs`; the interference benchmark's cpu victim
    /// beside the I/O hog got 120 % of the 144 % it was entitled to).
    fn contention(&mut self, dt: u64) -> (f64, f64) {
        if dt == 0 {
            return (f64::INFINITY, 1.0);
        }
        let cap = self.capacity_pct;
        let threads: f64 = self
            .vms
            .iter()
            .filter(|v| !v.parked)
            .map(|v| f64::from(v.runnable))
            .sum();
        if threads * 100.0 <= cap {
            return (f64::INFINITY, 1.0);
        }
        // Max-min: the VMs that could be light, by their use per thread;
        // each one lighter than the level left by those before it is light
        // and leaves the rest of its fair share to the others (the level
        // only rises, so the first that is not light ends the sweep).
        let light = &mut self.light;
        light.clear();
        for v in self
            .vms
            .iter()
            .filter(|v| !v.parked && v.runnable > 0 && v.helpers > 0)
        {
            let used = v.used_ns as f64 / dt as f64 * 100.0;
            let n = f64::from(v.runnable);
            light.push((used / n, used, n));
        }
        light.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
        let (mut light_used, mut light_threads) = (0.0, 0.0);
        let mut level = cap / threads;
        for &(per_thread, used, n) in light.iter() {
            if per_thread >= LIGHT_FRACTION * level {
                break;
            }
            light_used += used;
            light_threads += n;
            let rest = threads - light_threads;
            if rest <= 0.0 {
                return (f64::INFINITY, 1.0);
            }
            level = ((cap - light_used) / rest).max(level);
        }
        (level, (level / 100.0).min(1.0))
    }

    /// Credits and cap budgets for the `dt` ns that just elapsed.
    fn account(&mut self, dt: u64) {
        let dtf = dt as f64;
        let period = self.config.period_ns as f64;
        let tick = self.config.tick_ns as f64;
        let alpha = (dtf / period).min(1.0);
        for c in &mut self.classes {
            c.used_ns = 0;
        }
        // Work-conservation feedback: host CPU left idle during the tick
        // while admissible VMs waited parked (a VM that was admitted went
        // idle mid-tick) raises the admission margin; it decays otherwise.
        self.refresh_holds();
        let mut used_total = 0.0;
        let mut waiting = 0.0;
        for vm in &self.vms {
            used_total += vm.used_ns as f64;
            let c = &self.classes[vm.class];
            let held_by_a_cap = c.held || vm.cap_bound || vm.cap_spent() || c.spent;
            if vm.parked && vm.runnable > 0 && !held_by_a_cap {
                waiting += vm.demand;
            }
        }
        // Below 1 % of a CPU the idle time is measurement noise.
        let mut idle_pct = self.capacity_pct - used_total / dtf * 100.0;
        if let Some(m) = self.measured_idle_pct.take() {
            idle_pct = idle_pct.min(m);
        }
        let idle_pct = if idle_pct < 1.0 { 0.0 } else { idle_pct };
        let wasted_pct = idle_pct.min(waiting);
        self.margin += alpha * (wasted_pct - self.margin);
        // The exclusion charge: CPU the host left idle while VMs that
        // wanted it waited parked was held for the VMs that ran. It is
        // charged to their credit (not their usage), in proportion to what
        // each used: a turn that leaves part of the host idle costs the
        // whole host's time it kept the others out. Without it, a throttled
        // I/O hog whose threads use 105 % of the host while it runs alone
        // (its vCPU and device thread waking for every request) paid for
        // 105 % and took turns of ~49 % of the time for a 25 % share, in
        // which an io victim of three times its shares did nothing. VMs of
        // classes with a reservation are not charged: a reservation is a
        // guarantee of CPU used, not of host time.
        let charged = |v: &VmState, classes: &[ClassState]| {
            !v.parked && classes[v.class].spec.reserved_percent() == 0
        };
        let unparked_used: f64 = self
            .vms
            .iter()
            .filter(|v| charged(v, &self.classes))
            .map(|v| v.used_ns as f64)
            .sum();
        let exclusion_per_used = if unparked_used > 0.0 {
            wasted_pct / 100.0 * dtf / unparked_used
        } else {
            0.0
        };
        // Reservations are guarantees of the CPU the host delivers. When the
        // host is contended (VMs waited) but delivered less than its
        // capacity (switches between VMs, kick latency), VMs of classes
        // with a reservation earn their full entitlement and the others
        // earn what is left of the delivered CPU. Otherwise every VM's
        // credit inflates alike, lags keep their ratios, and a reserved
        // class bears its proportional part of the loss (it got ~96 % of a
        // 100 % reservation on real VMs).
        let mut others_scale = 1.0;
        if self.reserved_pct > 0 && waiting > 0.0 {
            let (mut reserved, mut others) = (0.0, 0.0);
            for vm in &self.vms {
                let e = vm.ent / 100.0 * dtf;
                if self.classes[vm.class].spec.reserved_percent() > 0 {
                    reserved += e;
                } else {
                    others += e;
                }
            }
            if others > 0.0 && reserved + others > used_total {
                others_scale = ((used_total - reserved) / others).clamp(0.0, 1.0);
            }
        }
        // The upper bound applies to VMs that were free to run (unparked):
        // one that did not use its entitlement cannot bank more than a
        // period of it. A parked VM's credit is what it is owed for waiting
        // its turn and is not clipped (with many VMs per CPU the wait is
        // longer than a period).
        //
        // Credit a demanding VM earns but cannot keep (it could not use its
        // entitlement, e.g. because its vCPUs were already flat out) is
        // handed to the other demanding VMs in proportion to their
        // entitlements, i.e. by shares and weights: what one VM cannot use
        // goes to the others, also in the credit ledger.
        let mut excess = 0.0;
        let mut receivers = 0.0;
        for vm in &mut self.vms {
            let used = vm.used_ns as f64;
            vm.cpu_ns = vm.cpu_ns.saturating_add(vm.used_ns);
            if vm.parked {
                vm.parked_ns += dt;
            }
            self.classes[vm.class].used_ns += vm.used_ns;
            if vm.runnable > 0 {
                vm.ent_ref = vm.ent;
            }
            let upper = period * vm.ent_ref / 100.0;
            let lower = -(upper + 2.0 * tick * f64::from(vm.vcpus));
            let scale = if self.classes[vm.class].spec.reserved_percent() > 0 {
                1.0
            } else {
                others_scale
            };
            let earned = vm.ent / 100.0 * dtf * scale;
            let excluded = if charged(vm, &self.classes) {
                used * exclusion_per_used
            } else {
                0.0
            };
            let mut credit = vm.credit + earned - used - excluded;
            // Only under-use (free to run, used less than it earned) is
            // clipped: credit above the bound that was earned while parked
            // is owed and kept until spent. Clipping it at the unpark (as
            // before) handed a VM's owed credit to the others at every
            // park/unpark cycle, and on real VMs a 3:1 share drifted to
            // ~60:40 as the low-share VM's credit grew without bound.
            if !vm.parked && credit > upper && used < earned {
                let keep = upper.max(vm.credit);
                if vm.runnable > 0 {
                    excess += credit - keep;
                }
                credit = keep;
            } else if vm.runnable > 0 && !self.classes[vm.class].held && !vm.cap_bound {
                receivers += vm.ent;
            }
            vm.credit = credit.max(lower);
            if let Some(cap) = vm.cap {
                let rate = f64::from(cap) / 100.0;
                let upper = period * rate;
                let lower = -(upper + 2.0 * tick * f64::from(vm.vcpus));
                vm.budget = (vm.budget + rate * dtf - used).clamp(lower, upper);
            } else {
                vm.budget = 0.0;
            }
            vm.used_pct += alpha * (used / dtf * 100.0 - vm.used_pct);
        }
        if excess > 0.0 && receivers > 0.0 {
            let per_pct = excess / receivers;
            for vm in &mut self.vms {
                let upper = period * vm.ent_ref / 100.0;
                if vm.runnable > 0
                    && (vm.parked || vm.credit < upper)
                    && !self.classes[vm.class].held
                    && !vm.cap_bound
                {
                    vm.credit += per_pct * vm.ent;
                    if !vm.parked {
                        vm.credit = vm.credit.min(upper);
                    }
                }
            }
        }
        self.add_subtree_usage();
        for c in &mut self.classes {
            let used = c.used_ns as f64;
            c.used_pct += alpha * (used / dtf * 100.0 - c.used_pct);
            match c.spec.cap {
                Some(cap) => {
                    let rate = f64::from(cap) / 100.0;
                    let upper = period * rate;
                    let lower = -(upper + 2.0 * tick * c.vcpus as f64);
                    c.budget = (c.budget + rate * dtf - used).clamp(lower, upper);
                }
                None => c.budget = 0.0,
            }
        }
    }

    /// Chooses which VMs run at `now_ns`.
    fn decide(&mut self, now_ns: u64) {
        self.refresh_holds();
        let Policy {
            vms,
            classes,
            candidates,
            capacity_pct,
            margin,
            config,
            fill,
            ..
        } = self;
        // A turn that started less than the minimum slice ago (less half a
        // tick, for the ticks' jitter) goes on.
        let slice_end = config.min_slice_ns.saturating_sub(config.tick_ns / 2);
        candidates.clear();
        for (i, vm) in vms.iter_mut().enumerate() {
            let c = &classes[vm.class];
            vm.run = if c.spent || vm.cap_spent() {
                // Class or VM cap budget spent: parked even on an idle host.
                false
            } else if vm.runnable == 0 {
                // Idle VMs stay unparked so they react at once when they wake.
                true
            } else if (c.held || vm.cap_bound) && vm.credit <= 0.0 {
                // Held back by its class's or its own cap: no credit, no
                // CPU, even if the host is idle.
                false
            } else {
                // Rank by lag: credit in units of the VM's own entitlement
                // (how far ahead of its fair schedule it is); positive
                // credit always ranks above debt. A VM that was running and
                // still has credit and uses less than its entitlement on
                // average goes first: light and latency-sensitive VMs are
                // not preempted by VMs that waited their turn.
                let incumbent = !vm.parked && vm.credit > 0.0 && vm.used_pct < 0.5 * vm.ent;
                let in_slice = !vm.parked
                    && vm.unparked_at > 0
                    && now_ns.saturating_sub(vm.unparked_at) < slice_end;
                candidates.push((incumbent, vm.credit / vm.ent.max(1e-9), in_slice, i as u32));
                false
            };
        }
        // Admit in order of lag until the admitted demand covers the host.
        candidates
            .sort_unstable_by(|a, b| b.0.cmp(&a.0).then(b.1.total_cmp(&a.1)).then(a.3.cmp(&b.3)));
        let mut admitted = 0.0;
        let target = *capacity_pct + MARGIN_GAIN * *margin - 1e-6;
        for &(.., i) in candidates.iter() {
            if admitted >= target {
                break;
            }
            // Past the capacity, the learnt margin admits a further VM only
            // if at least half of its demand fits in it: a margin of a few
            // percent (measurement noise on a busy host) must not let a VM
            // that is out of credit run a whole tick.
            if admitted >= *capacity_pct - 1e-6 && admitted + 0.5 * vms[i as usize].demand > target
            {
                break;
            }
            // Below the capacity, a VM of which less than a quarter fits in
            // what is left runs beside the admitted ones on the host's
            // per-thread fairness, not in the leftover: it is admitted only
            // if none of them is then expected to get less than its
            // entitlement (or its demand, if smaller). See [`dilutes`].
            // An I/O VM runs beside admitted VMs only where all of its
            // demand fits: beside them it waits for a CPU at every hand-off
            // between its vCPU and its device thread, like a co-runner
            // (below). An io victim admitted beside a throttled I/O hog
            // whenever the hog ranked first ran with it in 16 % of the time
            // as a filler, and in 11 % as a VM of which a quarter fit
            // (BENCHMARKS.md, Session 11). It must fit in the capacity,
            // not in the learnt margin: the idle CPU of the turns it waits
            // out raises the margin (the io victim was admitted beside the
            // light hog after two such ticks). Its lag grows while it
            // waits, and the first VM admitted is never refused.
            let cand = &vms[i as usize];
            if admitted > 0.0 && cand.io && admitted + cand.demand > *capacity_pct {
                continue;
            }
            if admitted > 0.0 && admitted + 0.25 * cand.demand > target {
                fill.clear();
                for &(.., j) in candidates.iter() {
                    let v = &vms[j as usize];
                    if v.run && v.runnable > 0 {
                        fill.push(v.demand, f64::from(v.runnable), v.demand.min(v.ent));
                    }
                }
                if fill.dilutes(cand.demand, f64::from(cand.runnable), *capacity_pct) {
                    continue;
                }
            }
            let vm = &mut vms[i as usize];
            vm.run = true;
            admitted += vm.demand;
        }
        // A VM with busy helper threads (its device thread) that covers the
        // host by itself may be counted at more than it can use: a
        // throttled I/O VM's two threads at ~57 % each count as a full
        // 200 % (`DEMAND_FULL_FRACTION`), and alone it left 85 % of the
        // host idle while a CPU-bound VM with 3 times its shares waited
        // (the cpu victim beside the limited I/O hog, BENCHMARKS.md). The
        // next VM runs beside it if that does not dilute it below its
        // entitlement, if it used under `CORUN_USED_FRACTION` of the host
        // when it last ran, and if that VM is not an I/O VM itself: an io victim
        // beside the hog waits for the host's CPU at every hand-off between
        // its vCPU and its device thread, and got 30 % of its rate alone
        // there while using 50 % of the host (2.09x slower overall where
        // taking turns gave 1.96x; BENCHMARKS.md, Session 9).
        let mut ran = candidates.iter().filter(|&&(.., j)| vms[j as usize].run);
        if let (Some(&(.., f)), None) = (ran.next(), ran.next()) {
            let first = &vms[f as usize];
            let next = candidates.iter().find(|&&(.., j)| !vms[j as usize].run);
            let leaves_idle =
                first.helpers > 0 && first.run_used < CORUN_USED_FRACTION * *capacity_pct;
            let next = next.filter(|&&(.., j)| leaves_idle && !vms[j as usize].io);
            if let Some(&(.., c)) = next {
                fill.clear();
                fill.push(
                    first.demand,
                    f64::from(first.runnable),
                    first.demand.min(first.ent),
                );
                let cand = &vms[c as usize];
                if !fill.dilutes(cand.demand, f64::from(cand.runnable), *capacity_pct) {
                    let vm = &mut vms[c as usize];
                    vm.run = true;
                    admitted += vm.demand;
                }
            }
        }
        // A VM within its minimum slice keeps running. To make room, the
        // VMs this tick would unpark (parked now) are deferred, lowest lag
        // first, as long as what runs still covers the host: a slice never
        // parks a running VM and never leaves CPU idle. Deferral stops at
        // the first VM that cannot be deferred, so a tick that defers the
        // waiting VM with the most lag unparks no other VM and starts no
        // new slice: it gets in within one slice. An I/O VM is deferred
        // even where that leaves CPU idle for the rest of the slice (the
        // exclusion charge bills it to the VM in its slice): beside it, an
        // io victim waits for a CPU at every hand-off as when co-run (see
        // above). Unparked at the second tick of a throttled I/O hog's
        // two-tick turn, it ran beside the hog in 23 % of the time and its
        // vCPU waited 3 s a run for a CPU (interference benchmark,
        // BENCHMARKS.md, Session 11).
        let mut added = false;
        for &(_, _, in_slice, i) in candidates.iter() {
            let vm = &mut vms[i as usize];
            if in_slice && !vm.run {
                vm.run = true;
                admitted += vm.demand;
                added = true;
            }
        }
        if !added {
            return;
        }
        for &(.., i) in candidates.iter().rev() {
            let vm = &mut vms[i as usize];
            if !(vm.run && vm.parked) {
                continue;
            }
            if admitted - vm.demand < target && !vm.io {
                break;
            }
            vm.run = false;
            admitted -= vm.demand;
        }
    }

    fn emit(&mut self, now_ns: u64) {
        let out = &mut self.output;
        out.now_ns = now_ns;
        out.changes.clear();
        out.vms.clear();
        for vm in &mut self.vms {
            let park = !vm.run;
            if park != vm.parked {
                out.changes.push(Change {
                    vm: vm.id,
                    action: if park { Action::Park } else { Action::Unpark },
                });
                if park {
                    vm.park_count += 1;
                } else {
                    vm.just_unparked = true;
                    vm.unparked_at = now_ns.max(1);
                }
                vm.parked = park;
            }
            vm.prev_runnable = vm.runnable;
            vm.prev_demand = vm.demand;
            out.vms.push(VmDecision {
                vm: vm.id,
                should_run: vm.run,
                entitlement_pct: vm.ent,
            });
        }
    }

    /// VM ids in the policy's internal order (class name, then id), which
    /// is also the order of [`TickOutput::vms`]. Reporting usages in this
    /// order makes [`tick`](Self::tick) skip a hash lookup per VM.
    pub fn vm_order(&self) -> impl Iterator<Item = VmId> + '_ {
        self.vms.iter().map(|v| v.id)
    }

    /// The output of the last tick.
    pub fn last_output(&self) -> &TickOutput {
        &self.output
    }

    /// Whether a VM is currently parked (`None` if unknown).
    pub fn is_parked(&self, vm: VmId) -> Option<bool> {
        self.index.get(&vm).map(|&i| self.vms[i].parked)
    }

    /// Current entitlement of a VM in percent (`None` if unknown).
    pub fn entitlement_pct(&self, vm: VmId) -> Option<f64> {
        self.index.get(&vm).map(|&i| self.vms[i].ent)
    }

    /// The demand admission counted a VM at in the last tick, percent
    /// (`None` if unknown).
    pub fn demand_pct(&self, vm: VmId) -> Option<f64> {
        self.index.get(&vm).map(|&i| self.vms[i].demand)
    }

    fn class_stats_of(&self, c: &ClassState) -> ClassStats {
        let members = self.vms.get(c.start..c.end).unwrap_or(&[]);
        ClassStats {
            name: c.name.clone(),
            parent: c.parent.map(|p| self.classes[p].name.clone()),
            spec: c.spec,
            vms: members.len(),
            parked_vms: members.iter().filter(|v| v.parked).count(),
            entitlement_pct: c.ent,
            used_pct: c.used_pct,
            cpu_ns: members.iter().map(|v| v.cpu_ns).sum(),
            cap_budget_ns: c.spec.cap.map(|_| c.budget as i64),
            cap_bound: c.cap_bound,
        }
    }

    /// One class's statistics, without a snapshot of all of them (`None`
    /// for an unknown class). O(log classes + its VMs).
    pub fn class_stats(&self, name: &str) -> Option<ClassStats> {
        let i = self
            .classes
            .binary_search_by(|c| c.name.as_str().cmp(name))
            .ok()?;
        self.classes.get(i).map(|c| self.class_stats_of(c))
    }

    /// Ticks run so far.
    pub fn ticks(&self) -> u64 {
        self.ticks
    }

    /// A snapshot of all statistics (allocates; not for the tick path).
    pub fn stats(&self) -> Stats {
        let vms: Vec<VmStats> = self
            .vms
            .iter()
            .map(|v| VmStats {
                vm: v.id,
                class: self.classes[v.class].name.clone(),
                weight: v.weight,
                vcpus: v.vcpus,
                cap: v.cap,
                cap_budget_ns: v.cap.map(|_| v.budget as i64),
                cap_bound: v.cap_bound,
                runnable_vcpus: v.runnable,
                entitlement_pct: v.ent,
                demand_pct: v.demand,
                used_pct: v.used_pct,
                cpu_ns: v.cpu_ns,
                credit_ns: v.credit as i64,
                parked: v.parked,
                parked_ns: v.parked_ns,
                park_count: v.park_count,
            })
            .collect();
        let classes = self
            .classes
            .iter()
            .map(|c| self.class_stats_of(c))
            .collect();
        Stats {
            capacity_pct: self.host.nominal_pct() as u64,
            available_pct: self.capacity_pct,
            steal_pct: self.host.steal_pct(),
            outside_pct: self.host.outside_pct(),
            claimed_reservations_pct: self.claimed_pct,
            shortfall_ratio: crate::capacity::shortfall_ratio(self.claimed_pct, self.capacity_pct),
            reserved_pct: self.reserved_pct,
            ticks: self.ticks,
            last_tick_ns: self.last_now,
            classes,
            vms,
        }
    }
}

/// Entitlements for a hypothetical demand: `runnable(vm, spec)` says how many
/// vCPUs of each VM want CPU. Pure; uses the same code as [`Policy::tick`].
/// Handy for "what if" queries and tests.
pub fn entitlements(model: &Model, mut runnable: impl FnMut(VmId, &VmSpec) -> u32) -> Entitlements {
    let mut p = Policy::new(PolicyConfig::default());
    p.sync(model);
    for vm in &mut p.vms {
        let spec = model.vm(vm.id).expect("synced VM exists");
        vm.runnable = runnable(vm.id, spec).min(vm.vcpus);
        vm.demand = f64::from(vm.runnable) * 100.0;
    }
    p.compute_entitlements();
    Entitlements {
        classes: p.classes.iter().map(|c| (c.name.clone(), c.ent)).collect(),
        vms: p.vms.iter().map(|v| (v.id, v.ent)).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Capacity, ClassSpec, VmSpec};

    fn wf(items: &[(f64, f64, f64)], total: f64) -> Vec<f64> {
        let items: Vec<Wf> = items.iter().map(|&(w, lo, hi)| Wf { w, lo, hi }).collect();
        let mut out = Vec::new();
        water_fill(&items, total, &mut out, &mut Vec::new());
        out
    }

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-6, "{a:?} != {b:?}");
        }
    }

    #[test]
    fn water_fill_basics() {
        // Unconstrained 3:1.
        close(
            &wf(&[(3.0, 0.0, 200.0), (1.0, 0.0, 200.0)], 200.0),
            &[150.0, 50.0],
        );
        // Everyone satisfied.
        close(
            &wf(&[(3.0, 0.0, 50.0), (1.0, 0.0, 60.0)], 200.0),
            &[50.0, 60.0],
        );
        // Upper bound redistributes.
        close(
            &wf(&[(3.0, 0.0, 200.0), (1.0, 0.0, 20.0)], 200.0),
            &[180.0, 20.0],
        );
        close(
            &wf(&[(1.0, 0.0, 50.0), (3.0, 0.0, 200.0)], 200.0),
            &[50.0, 150.0],
        );
        // Lower bound.
        close(
            &wf(
                &[(1.0, 100.0, 200.0), (10.0, 0.0, 200.0), (10.0, 0.0, 200.0)],
                200.0,
            ),
            &[100.0, 50.0, 50.0],
        );
        // Lower bound not binding.
        close(
            &wf(&[(10.0, 10.0, 200.0), (10.0, 0.0, 200.0)], 200.0),
            &[100.0, 100.0],
        );
        // Idle items get nothing.
        close(
            &wf(&[(1.0, 0.0, 0.0), (1.0, 0.0, 300.0)], 200.0),
            &[0.0, 200.0],
        );
        // Lower bounds over capacity are scaled.
        close(
            &wf(&[(1.0, 300.0, 300.0), (1.0, 100.0, 300.0)], 200.0),
            &[150.0, 50.0],
        );
        // Mixed: one capped, one reserved, rest shares.
        let out = wf(
            &[
                (5.0, 0.0, 30.0),
                (1.0, 120.0, 400.0),
                (2.0, 0.0, 400.0),
                (2.0, 0.0, 100.0),
            ],
            400.0,
        );
        close(&out, &[30.0, 120.0, 150.0, 100.0]);
    }

    #[test]
    fn entitlements_three_to_one_with_weights() {
        let mut m = Model::new(Capacity::from_cpus(2));
        m.create_class("a", ClassSpec::new(3)).unwrap();
        m.create_class("b", ClassSpec::new(1)).unwrap();
        m.add_vm(VmId(1), VmSpec::new("a", 2)).unwrap();
        m.add_vm(VmId(2), VmSpec::new("b", 2).with_weight(100))
            .unwrap();
        m.add_vm(VmId(3), VmSpec::new("b", 2).with_weight(300))
            .unwrap();
        let e = entitlements(&m, |_, s| s.vcpus);
        assert!((e.classes["a"] - 150.0).abs() < 1e-9);
        assert!((e.vms[&VmId(2)] - 12.5).abs() < 1e-9);
        assert!((e.vms[&VmId(3)] - 37.5).abs() < 1e-9);
        // B idle: A gets everything its vCPUs can use.
        let e = entitlements(&m, |id, s| if id == VmId(1) { s.vcpus } else { 0 });
        assert!((e.classes["a"] - 200.0).abs() < 1e-9);
        assert_eq!(e.classes["b"], 0.0);
        // A class without VMs on an otherwise idle host is entitled to +0
        // (not -0, which the CLI showed as "-0.0").
        let mut m = Model::new(Capacity::from_cpus(2));
        m.create_class("empty", ClassSpec::new(5)).unwrap();
        let e = entitlements(&m, |_, s| s.vcpus);
        assert!(e.classes["empty"] == 0.0 && e.classes["empty"].is_sign_positive());
    }

    fn two_hogs() -> Model {
        let mut m = Model::new(Capacity::from_cpus(2));
        m.create_class("a", ClassSpec::new(3)).unwrap();
        m.create_class("b", ClassSpec::new(1)).unwrap();
        m.add_vm(VmId(1), VmSpec::new("a", 2)).unwrap();
        m.add_vm(VmId(2), VmSpec::new("b", 2)).unwrap();
        m
    }

    /// Three 2-vCPU VMs on 2 CPUs: one in a class with a 100 % reservation
    /// (shares 1), two in classes of shares 10.
    fn reserved_and_two_big() -> Model {
        let mut m = Model::new(Capacity::from_cpus(2));
        m.create_class("res", ClassSpec::new(1).with_reservation(100))
            .unwrap();
        m.create_class("x", ClassSpec::new(10)).unwrap();
        m.create_class("y", ClassSpec::new(10)).unwrap();
        for (id, c) in [(1, "res"), (2, "x"), (3, "y")] {
            m.add_vm(VmId(id), VmSpec::new(c, 2)).unwrap();
        }
        m
    }

    /// VM `id`'s entitlement at the last tick.
    fn ent(p: &Policy, id: u64) -> f64 {
        p.last_output()
            .vms()
            .iter()
            .find(|d| d.vm == VmId(id))
            .unwrap()
            .entitlement_pct
    }

    /// With CPU lost to steal, a reservation is still a whole CPU: the
    /// other classes share what is really left.
    #[test]
    fn steal_shrinks_the_others_not_the_reservation() {
        let m = reserved_and_two_big();
        let mut p = Policy::new(PolicyConfig::default());
        let usage = |t: u64| -> Vec<VmUsage> {
            (1..=3)
                .map(|i| VmUsage::total(VmId(i), t * 2, true))
                .collect()
        };
        p.tick(&m, 0, &usage(0));
        assert!((ent(&p, 1) - 100.0).abs() < 1e-6 && (ent(&p, 2) - 50.0).abs() < 1e-6);
        p.set_measured_steal(Some(14.0));
        p.tick(&m, 10_000_000, &usage(10_000_000));
        assert!((ent(&p, 1) - 100.0).abs() < 1e-6, "{}", ent(&p, 1));
        assert!((ent(&p, 2) - 43.0).abs() < 1e-6, "{}", ent(&p, 2));
        assert!((ent(&p, 3) - 43.0).abs() < 1e-6, "{}", ent(&p, 3));
        // Noise below 1 % of a CPU is ignored; steal gone, back to nominal.
        p.set_measured_steal(Some(0.4));
        p.tick(&m, 20_000_000, &usage(20_000_000));
        assert!((ent(&p, 2) - 50.0).abs() < 1e-6, "{}", ent(&p, 2));
        assert_eq!(p.stats().shortfall_ratio, 0.0);
        // Never below a quarter of the capacity; the reservation that no
        // longer fits is cut, and the shortfall says by how much.
        p.set_measured_steal(Some(180.0));
        p.tick(&m, 30_000_000, &usage(30_000_000));
        assert!((ent(&p, 1) - 50.0).abs() < 1e-6, "{}", ent(&p, 1));
        assert!(ent(&p, 2).abs() < 1e-6, "{}", ent(&p, 2));
        let st = p.stats();
        assert_eq!(st.capacity_pct, 200);
        assert_eq!(st.available_pct, 50.0);
        assert!(
            (st.shortfall_ratio - 0.5).abs() < 1e-9,
            "{}",
            st.shortfall_ratio
        );
    }

    /// A 1-vCPU VM whose device thread is busy too can use two CPUs: its
    /// demand bound counts the helper, so with shares 3:1 it is entitled
    /// to 150 % against a 2-vCPU hog, not to the 100 % of its one vCPU.
    #[test]
    fn a_busy_device_thread_adds_to_demand() {
        let mut m = Model::new(Capacity::from_cpus(2));
        m.create_class("victim", ClassSpec::new(3)).unwrap();
        m.create_class("hog", ClassSpec::new(1)).unwrap();
        m.add_vm(VmId(1), VmSpec::new("victim", 1)).unwrap();
        m.add_vm(VmId(2), VmSpec::new("hog", 2)).unwrap();
        let mut p = Policy::new(PolicyConfig::default());
        let tick = 10_000_000;
        for helpers in [0, 1] {
            let mut p2 = p.clone();
            for k in 0..5u64 {
                let u = [
                    VmUsage::total(VmId(1), k * tick * (1 + u64::from(helpers)), true)
                        .with_busy_helpers(helpers),
                    VmUsage::total(VmId(2), k * tick, true),
                ];
                p2.tick(&m, k * tick, &u);
            }
            let want = if helpers == 0 { 100.0 } else { 150.0 };
            assert!(
                (ent(&p2, 1) - want).abs() < 1e-6,
                "{helpers}: {}",
                ent(&p2, 1)
            );
            assert!((ent(&p2, 2) - (200.0 - want)).abs() < 1e-6);
        }
        // A helper beside no runnable vCPU (I/O finishing for a halted VM)
        // makes no demand.
        p.tick(
            &m,
            0,
            &[VmUsage::total(VmId(1), 0, false).with_busy_helpers(1)],
        );
        assert_eq!(ent(&p, 1), 0.0);
    }

    /// A host that delivers only 92 % of its capacity to the VMs (switch
    /// overhead): the reserved class still gets its whole CPU, the others
    /// share the loss.
    #[test]
    fn reservation_holds_when_the_host_delivers_less() {
        let m = reserved_and_two_big();
        let mut p = Policy::new(PolicyConfig::default());
        let tick = 10_000_000u64;
        let mut total = [0u64; 3];
        let mut run = [true; 3];
        let ticks = 3000u64;
        for k in 0..ticks {
            let u: Vec<VmUsage> = (0..3)
                .map(|i| VmUsage::total(VmId(i as u64 + 1), total[i], true))
                .collect();
            let out = p.tick(&m, k * tick, &u);
            for d in out.vms() {
                run[(d.vm.0 - 1) as usize] = d.should_run;
            }
            // The admitted VMs share 184 % of a CPU (2 CPUs less 8 %), each
            // up to its 2 vCPUs.
            let n = run.iter().filter(|r| **r).count() as u64;
            for i in 0..3 {
                if run[i] && n > 0 {
                    total[i] += (184 * tick / 100 / n).min(2 * tick);
                }
            }
        }
        let pct = |i: usize| total[i] as f64 / (ticks * tick) as f64 * 100.0;
        assert!(pct(0) >= 99.0, "reserved class got {:.2} %", pct(0));
        assert!(
            (pct(1) - pct(2)).abs() < 2.0,
            "{:.2} vs {:.2}",
            pct(1),
            pct(2)
        );
    }

    /// A victim (shares 3) beside a limited I/O hog (shares 1), on a host
    /// model that divides 2 CPUs max-min per thread among the admitted VMs:
    /// the hog is one vCPU and a device thread held by its throttle to
    /// 57.5 % each (115 % of the host's 200, less than it can fill). With
    /// `io_victim` the victim is one vCPU and a busy device thread, else
    /// two spinning vCPUs; each thread uses a whole CPU. Returns the
    /// victim's and the hog's CPU (percent) and the share of the ticks in
    /// which both ran.
    fn beside_a_throttled_hog(io_victim: bool) -> (f64, f64, f64) {
        beside_an_io_hog(io_victim, 57.5)
    }

    /// The host model of [`beside_a_throttled_hog`] with a hog whose two
    /// threads each use `hog_thread` % of a CPU when they run.
    fn beside_an_io_hog(io_victim: bool, hog_thread: f64) -> (f64, f64, f64) {
        let mut m = Model::new(Capacity::from_cpus(2));
        m.create_class("victim", ClassSpec::new(3)).unwrap();
        m.create_class("hog", ClassSpec::new(1)).unwrap();
        let vcpus = if io_victim { 1 } else { 2 };
        m.add_vm(VmId(1), VmSpec::new("victim", vcpus)).unwrap();
        m.add_vm(VmId(2), VmSpec::new("hog", 1)).unwrap();
        let mut p = Policy::new(PolicyConfig::default());
        let tick = 10_000_000u64;
        let want = [100.0, hog_thread]; // per thread, two threads each
        let mut total = [0u64; 2];
        let mut run = [true; 2];
        let mut both = 0u64;
        let ticks = 3000u64;
        for k in 0..ticks {
            let u = [
                VmUsage::total(VmId(1), total[0], true)
                    .with_runnable_vcpus(vcpus)
                    .with_busy_helpers(u32::from(io_victim)),
                VmUsage::total(VmId(2), total[1], true)
                    .with_runnable_vcpus(1)
                    .with_busy_helpers(1),
            ];
            let out = p.tick(&m, k * tick, &u);
            for d in out.vms() {
                run[(d.vm.0 - 1) as usize] = d.should_run;
            }
            both += u64::from(run[0] && run[1]);
            // The host's max-min per thread among the running VMs.
            let running: Vec<usize> = (0..2).filter(|&i| run[i]).collect();
            let items: Vec<(f64, f64, f64)> =
                running.iter().map(|&i| (2.0, 0.0, 2.0 * want[i])).collect();
            for (&i, got) in running.iter().zip(wf(&items, 200.0)) {
                total[i] += (got / 100.0 * tick as f64) as u64;
            }
        }
        let pct = |i: usize| total[i] as f64 / (ticks * tick) as f64 * 100.0;
        (pct(0), pct(1), both as f64 / ticks as f64)
    }

    /// The cpu victim: running the hog alone leaves 85 % of the host idle,
    /// so the victim must run beside it while the hog takes its 50 %: the
    /// victim gets ~150 %. Before, the hog, counted as full (its use is
    /// over `DEMAND_FULL_FRACTION` of its bound), covered the host whenever
    /// it ranked first and the victim was parked while the CPU idled:
    /// 133 % in this model (the interference benchmark's cpu victim beside
    /// the I/O hog: 1.52x slower than alone, 1.28x with the rule).
    #[test]
    fn a_throttled_hog_does_not_run_alone_while_a_cpu_victim_waits() {
        let (victim, hog, both) = beside_a_throttled_hog(false);
        eprintln!("victim {victim:.1} %, hog {hog:.1} %, both ran {both:.3}");
        assert!(victim >= 140.0, "victim got {victim:.1} %");
        assert!((45.0..=55.0).contains(&hog), "hog got {hog:.1} %");
    }

    /// The io victim takes turns with the hog instead: beside it, real VMs
    /// showed the victim waiting for the host's CPU at every hand-off
    /// between its vCPU and its device thread (this model, fair per thread,
    /// would make running them together look better than it is). They never
    /// run together here: 50 % of the ticks if the hog took the io victim
    /// beside it as it does the cpu victim, 22 % when the victim was
    /// unparked in the hog's slice. The hog's turns leave 85 % of the host
    /// idle while the victim waits, and the exclusion charge bills the hog
    /// for it: the victim gets its 150 % (132.9 % without the charge, when
    /// the hog got 48.1 % of a CPU in turns of ~42 % of the time), the hog
    /// 25 % of the host's time, in which it uses 28.8 % of a CPU.
    #[test]
    fn an_io_victim_takes_turns_with_a_throttled_hog() {
        let (victim, hog, both) = beside_a_throttled_hog(true);
        eprintln!("victim {victim:.1} %, hog {hog:.1} %, both ran {both:.3}");
        assert!(
            both <= 0.02,
            "both ran in {:.1} % of the ticks",
            both * 100.0
        );
        assert!(victim >= 145.0, "victim got {victim:.1} %");
        assert!((25.0..=35.0).contains(&hog), "hog got {hog:.1} %");
    }

    /// A lighter hog (two threads at 35 %, 70 % of a CPU: not counted as
    /// full) ranked first left room for a quarter of the io victim, which
    /// was admitted beside it (or in the margin that the idle CPU of the
    /// hog's turn raised): both ran in 30 % of the ticks and the victim got
    /// 119.4 %. An I/O VM now joins running VMs only where all its demand
    /// fits in the capacity.
    #[test]
    fn an_io_victim_is_not_admitted_beside_a_light_hog_it_does_not_fit_beside() {
        let (victim, hog, both) = beside_an_io_hog(true, 35.0);
        eprintln!("victim {victim:.1} %, hog {hog:.1} %, both ran {both:.3}");
        assert!(
            both <= 0.02,
            "both ran in {:.1} % of the ticks",
            both * 100.0
        );
        assert!(victim >= 145.0, "victim got {victim:.1} %");
    }

    #[test]
    fn dilutes_follows_max_min_per_thread() {
        // `admitted`: demand, threads, floor; `cand`: demand, threads.
        let d = |admitted: &[(f64, f64, f64)], cand: (f64, f64), cap: f64| {
            let mut f = Dilution::default();
            for &(demand, n, floor) in admitted {
                f.push(demand, n, floor);
            }
            f.dilutes(cand.0, cand.1, cap)
        };
        // Victim 2 threads at 90.5 (floor: its entitlement 146), the hog
        // 2 threads at 57.5: the level is 47.25 on 189, the victim would
        // get 94.5.
        assert!(d(&[(181.0, 2.0, 146.0)], (115.0, 2.0), 189.0));
        // The other way round: the hog (floor 49.5) keeps 94.5.
        assert!(!d(&[(115.0, 2.0, 49.5)], (195.0, 2.0), 189.0));
        // Everything fits: no dilution whatever the floors.
        assert!(!d(&[(100.0, 2.0, 100.0)], (80.0, 2.0), 200.0));
        // A light thread below the level keeps its demand: 10 + 2 × 95.
        assert!(!d(&[(10.0, 1.0, 10.0)], (200.0, 2.0), 200.0));
        // The level is 95 (within 10 % of the floor: not diluted), or
        // 63.3 with a 2-thread candidate.
        let two = [(10.0, 1.0, 10.0), (100.0, 1.0, 100.0)];
        assert!(!d(&two, (100.0, 1.0), 200.0));
        assert!(d(&two, (200.0, 2.0), 200.0));
    }

    #[test]
    fn tick_parks_the_overuser() {
        let m = two_hogs();
        let mut p = Policy::new(PolicyConfig::default());
        let tick = 10_000_000;
        let mut a = 0;
        let b = 0;
        // Nobody has credit yet: the host is filled by the first candidate
        // (2 vCPUs cover 2 CPUs), the other one is parked.
        let out = p.tick(
            &m,
            0,
            &[
                VmUsage::total(VmId(1), a, true),
                VmUsage::total(VmId(2), b, true),
            ],
        );
        assert_eq!(
            out.changes(),
            &[Change {
                vm: VmId(2),
                action: Action::Park
            }]
        );
        // A had the host (2 CPUs) for the tick: it earned 150 % × 10 ms and
        // used 20 ms; B earned 50 % × 10 ms while parked. B is now ahead.
        a += 2 * tick;
        let out = p.tick(
            &m,
            tick,
            &[
                VmUsage::total(VmId(1), a, true),
                VmUsage::total(VmId(2), b, true),
            ],
        );
        let by_id = |id| out.vms().iter().find(|d| d.vm == id).unwrap();
        assert!((by_id(VmId(1)).entitlement_pct - 150.0).abs() < 1e-9);
        assert!((by_id(VmId(2)).entitlement_pct - 50.0).abs() < 1e-9);
        assert!(!by_id(VmId(1)).should_run);
        assert!(by_id(VmId(2)).should_run);
        assert_eq!(
            out.changes(),
            &[
                Change {
                    vm: VmId(1),
                    action: Action::Park
                },
                Change {
                    vm: VmId(2),
                    action: Action::Unpark
                }
            ]
        );
        assert_eq!(p.is_parked(VmId(1)), Some(true));
        let s = p.stats();
        assert_eq!(s.vms[0].credit_ns, -5_000_000);
        assert_eq!(s.vms[1].credit_ns, 5_000_000);
        assert_eq!(s.vms[1].parked_ns, tick);
    }

    #[test]
    fn idle_vms_burn_nothing_and_stay_unparked() {
        let m = two_hogs();
        let mut p = Policy::new(PolicyConfig::default());
        for t in 0..10u64 {
            let out = p.tick(
                &m,
                t * 10_000_000,
                &[
                    VmUsage::delta(VmId(1), 0, false),
                    VmUsage::delta(VmId(2), 0, false),
                ],
            );
            assert!(
                out.vms()
                    .iter()
                    .all(|d| d.should_run && d.entitlement_pct == 0.0)
            );
        }
        assert!(p.stats().vms.iter().all(|v| v.credit_ns == 0));
    }

    #[test]
    fn unknown_and_missing_vms_are_tolerated() {
        let m = two_hogs();
        let mut p = Policy::new(PolicyConfig::default());
        p.tick(&m, 0, &[VmUsage::delta(VmId(99), 5, true)]);
        let out = p.tick(&m, 10_000_000, &[]);
        assert_eq!(out.vms().len(), 2);
    }

    #[test]
    fn config_validation() {
        assert!(PolicyConfig::default().validate().is_ok());
        assert_eq!(
            PolicyConfig {
                tick_ns: 10,
                period_ns: 100,
                min_slice_ns: 0,
                handover_ns: 0,
            }
            .validate(),
            Err(ConfigError::TickTooShort(10))
        );
        assert!(
            PolicyConfig {
                tick_ns: 10_000_000,
                period_ns: 1_000_000,
                min_slice_ns: 0,
                handover_ns: 0,
            }
            .validate()
            .is_err()
        );
        assert_eq!(
            PolicyConfig {
                min_slice_ns: 200_000_000,
                ..PolicyConfig::default()
            }
            .validate(),
            Err(ConfigError::SliceLongerThanPeriod {
                min_slice_ns: 200_000_000,
                period_ns: 100_000_000
            })
        );
        assert_eq!(
            PolicyConfig {
                handover_ns: 20_000_000,
                ..PolicyConfig::default()
            }
            .validate(),
            Err(ConfigError::HandoverLongerThanTick {
                handover_ns: 20_000_000,
                tick_ns: 10_000_000
            })
        );
    }
}
