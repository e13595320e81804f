//! A deterministic simulator: the real [`Scheduler`] against synthetic VMs on
//! a model of N host CPUs, with a fake clock.
//!
//! # Host model
//!
//! Time advances in steps of [`SimConfig::step_ns`] (default 1 ms). In each
//! step the host OS is fair among the runnable, unparked vCPU threads
//! (max-min fair, at most one CPU per thread): with `k` spinning threads on
//! `C` CPUs each gets `min(1, C/k)` of a CPU; a thread that needs less for
//! the rest of its current work (a request or job finishing) takes only that
//! and the rest is shared among the others. Every [`PolicyConfig::tick_ns`] the simulator
//! reports each VM's cumulative CPU time and the most vCPUs it had runnable
//! (parked ones included) since the previous tick, calls
//! [`Scheduler::tick`], and applies the decisions: unpark at once, park
//! after [`SimConfig::park_latency_ns`] (the time a kick takes to get a vCPU
//! out of `KVM_RUN`; ~4 ms measured on kvm_pvm hosts).
//!
//! # Outside load
//!
//! [`Simulator::set_outside_load`] adds spinning threads that are not
//! corral's (a build, a busy loop): the host model is fair among them and
//! the VMs' threads alike, as CFS is. Every [`OUTSIDE_SAMPLE_TICKS`] ticks
//! the simulator measures what they used, like the VMM does from
//! `/proc/stat` (counted in whole jiffies of [`SimConfig::stat_jiffy_ns`]
//! if set), and hands it to the policy
//! ([`Scheduler::set_measured_outside`]) with the host's idle time, unless
//! [`SimConfig::measure_outside`] is off (the policy then plans with the
//! nominal capacity, as before issue 13).
//!
//! # Workloads
//!
//! See [`Pattern`]: hogs, bursty on/off VMs, mostly idle VMs, latency
//! sensitive request/response VMs and fixed-size jobs. Randomness (phases,
//! arrival times) comes from a seeded PRNG: runs are reproducible.
//!
//! # Measurements
//!
//! [`Simulator::report`] gives, per VM, CPU received, time parked while
//! wanting CPU, the longest stretch with runnable vCPUs but no CPU
//! (starvation), request latencies and job completion times; for the host,
//! idle time, *wasted* time (host CPU idle while a parked VM of a class
//! without cap wanted it: a work-conservation violation) and the policy's
//! cost per tick (wall clock, measured around [`Scheduler::tick`]).

use std::collections::VecDeque;
use std::time::Instant;

use crate::model::{Capacity, ClassSpec, ModelError, VmId, VmSpec};
use crate::policy::{ALL_VCPUS, Action, PolicyConfig, VmUsage};
use crate::scheduler::Scheduler;

#[path = "sim_helper.rs"]
mod helper;

/// Simulator settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimConfig {
    /// Host model step, ns (default 1 ms). Should divide the tick.
    pub step_ns: u64,
    /// Policy configuration (tick, period).
    pub policy: PolicyConfig,
    /// Delay between a park decision and the vCPUs actually stopping, ns.
    pub park_latency_ns: u64,
    /// Report the exact number of runnable vCPUs (`true`, default) or only
    /// "wants CPU" (`false`: all vCPUs counted when any is runnable).
    pub exact_runnable: bool,
    /// PRNG seed.
    pub seed: u64,
    /// Measure the outside load and the host's idle time and hand them to
    /// the policy (default `true`).
    pub measure_outside: bool,
    /// Count the measured outside load in whole jiffies of this length per
    /// CPU, as `/proc/stat` does (default 0: exact).
    pub stat_jiffy_ns: u64,
}

/// The outside load is measured every this many ticks (as the VMM does).
pub const OUTSIDE_SAMPLE_TICKS: u64 = 4;

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            step_ns: 1_000_000,
            policy: PolicyConfig::default(),
            park_latency_ns: 0,
            exact_runnable: true,
            seed: 1,
            measure_outside: true,
            stat_jiffy_ns: 0,
        }
    }
}

/// Synthetic demand of a simulated VM.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pattern {
    /// Never wants CPU.
    Idle,
    /// All vCPUs always runnable.
    Hog,
    /// `busy_vcpus` vCPUs always runnable, the rest idle.
    PartialHog {
        /// How many vCPUs spin.
        busy_vcpus: u32,
    },
    /// All vCPUs runnable for `on_ns`, then idle for `off_ns`, repeating
    /// (random phase per VM).
    Bursty {
        /// Length of a busy phase.
        on_ns: u64,
        /// Length of an idle phase.
        off_ns: u64,
    },
    /// Requests of `burst_ns` CPU work on one vCPU arrive at exponentially
    /// distributed gaps of mean `mean_gap_ns`. Latencies are recorded.
    MostlyIdle {
        /// Mean time between requests.
        mean_gap_ns: u64,
        /// CPU work per request.
        burst_ns: u64,
    },
    /// Requests of `work_ns` CPU work on one vCPU arrive every
    /// `interval_ns` (±10 % jitter); latencies (arrival to completion) are
    /// recorded.
    Latency {
        /// Time between requests.
        interval_ns: u64,
        /// CPU work per request.
        work_ns: u64,
    },
    /// Every vCPU has `work_ns` of CPU work from the VM's start; the time
    /// until all of it is done is recorded. Idle afterwards.
    Job {
        /// CPU work per vCPU.
        work_ns: u64,
    },
    /// An I/O-bound VM behind a throttle, with a device thread: a request
    /// is admitted every `interval_ns`; each needs `helper_ns` of the VM's
    /// device thread (which does the I/O, is charged to the VM, reported
    /// as a busy helper and never parked) and `vcpu_ns` of one vCPU (the
    /// guest completes it and submits the next). Latencies (admission to
    /// the vCPU's part done) are recorded.
    Throttled {
        /// Time between admitted requests.
        interval_ns: u64,
        /// vCPU work per request.
        vcpu_ns: u64,
        /// Device-thread work per request.
        helper_ns: u64,
    },
    /// An I/O-bound guest in a closed loop, as the probe's disk job with
    /// `probe.qd` requests in flight behind a token-bucket limit: each
    /// request needs `helper_ns` of the VM's device thread (the I/O; never
    /// parked, charged to the VM, reported as a busy helper), then
    /// `vcpu_ns` of one vCPU (the guest handles the completion and submits
    /// the next request at once), `latency_ns` apart (the host's I/O and the
    /// wake-up of the halted vCPU: time in flight that uses no CPU of the
    /// VM's threads). A submitted request waits for a token: one
    /// accrues every `interval_ns` (0 = no limit), at most `burst` are kept
    /// (blkthrottle's default bucket is one second of the rate). A parked
    /// vCPU submits nothing: its completions wait, the device thread runs
    /// dry and the bucket fills, so an unpark is followed by a burst.
    /// Latencies (admission to the vCPU's part done) are recorded; their
    /// count is the requests completed.
    IoLoop {
        /// Requests in flight.
        queue_depth: u32,
        /// Time per token of the limit (0 = unlimited).
        interval_ns: u64,
        /// Bucket size, tokens.
        burst: u32,
        /// vCPU work per request.
        vcpu_ns: u64,
        /// Device-thread work per request.
        helper_ns: u64,
        /// Time between the device thread's part and the vCPU's.
        latency_ns: u64,
    },
}

/// Results for one simulated VM over the measurement window.
#[derive(Debug, Clone, PartialEq)]
pub struct VmReport {
    /// The VM.
    pub id: VmId,
    /// Its class (at the end of the run).
    pub class: String,
    /// Its vCPU count.
    pub vcpus: u32,
    /// CPU received, ns.
    pub cpu_ns: f64,
    /// CPU received, percent of one CPU, averaged over the window.
    pub cpu_pct: f64,
    /// Time with at least one runnable vCPU, ns.
    pub wanted_ns: u64,
    /// Time parked while wanting CPU, ns.
    pub parked_wanting_ns: u64,
    /// Longest stretch with runnable vCPUs but no CPU at all, ns.
    pub longest_starve_ns: u64,
    /// Job completion time measured from the VM's start (jobs only).
    pub job_done_ns: Option<u64>,
    /// Request latencies, ns, in completion order (request patterns only).
    pub latencies_ns: Vec<u64>,
    /// Entitlement at the last tick, percent.
    pub entitlement_pct: f64,
    /// Times the policy parked it.
    pub parks: u64,
    /// Mean demand the policy counted it at, percent (over the ticks).
    pub demand_pct: f64,
}

impl VmReport {
    /// Latency percentile `q` in `0.0..=1.0` (nearest rank), if any.
    pub fn latency_percentile(&self, q: f64) -> Option<u64> {
        if self.latencies_ns.is_empty() {
            return None;
        }
        let mut v = self.latencies_ns.clone();
        v.sort_unstable();
        let rank = ((q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize).clamp(1, v.len());
        Some(v[rank - 1])
    }
}

/// Results of a run (since the last [`Simulator::reset_counters`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SimReport {
    /// Length of the measurement window, ns.
    pub window_ns: u64,
    /// Host capacity, percent of one CPU.
    pub capacity_pct: u64,
    /// Per VM, by id.
    pub vms: Vec<VmReport>,
    /// CPU time used by all VMs, ns.
    pub busy_ns: f64,
    /// Idle host CPU time, ns.
    pub idle_ns: f64,
    /// CPU time used by the outside load, ns.
    pub outside_ns: f64,
    /// Idle host CPU time while a parked VM of an uncapped class wanted CPU.
    pub wasted_ns: f64,
    /// Policy ticks run.
    pub ticks: u64,
    /// Total wall-clock time spent in [`Scheduler::tick`], ns.
    pub policy_ns_total: u64,
    /// Slowest tick, ns.
    pub policy_ns_max: u64,
}

impl SimReport {
    /// The report of one VM.
    pub fn vm(&self, id: VmId) -> &VmReport {
        self.vms
            .iter()
            .find(|v| v.id == id)
            .unwrap_or_else(|| panic!("no VM {id} in report"))
    }

    /// CPU received by all VMs of `class` (as of the end), percent of one CPU.
    pub fn class_pct(&self, class: &str) -> f64 {
        self.vms
            .iter()
            .filter(|v| v.class == class)
            .map(|v| v.cpu_pct)
            .sum()
    }

    /// Wasted time as a fraction of total host capacity over the window.
    pub fn wasted_fraction(&self) -> f64 {
        self.wasted_ns / (self.window_ns as f64 * self.capacity_pct as f64 / 100.0)
    }

    /// CPU received by `class` as a percentage of all the VMs received.
    pub fn class_share(&self, class: &str) -> f64 {
        let total: f64 = self.vms.iter().map(|v| v.cpu_pct).sum();
        self.class_pct(class) * 100.0 / total.max(1e-9)
    }

    /// Busy time as a fraction of total host capacity over the window.
    pub fn utilisation(&self) -> f64 {
        self.busy_ns / (self.window_ns as f64 * self.capacity_pct as f64 / 100.0)
    }

    /// Mean policy cost per tick, ns.
    pub fn policy_ns_per_tick(&self) -> f64 {
        self.policy_ns_total as f64 / self.ticks.max(1) as f64
    }
}

/// splitmix64: small, fast, deterministic.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }
}

#[derive(Debug, Clone)]
struct SimVm {
    id: VmId,
    class: String,
    capped: bool,
    vcpus: u32,
    pattern: Pattern,
    start_ns: u64,
    phase_ns: u64,
    job_left: Vec<f64>,
    requests: VecDeque<(u64, f64)>,
    next_arrival: u64,
    parked: bool,
    park_at: Option<u64>,
    runnable: u32,
    tick_runnable: u32,
    cpu_total: f64,
    // Measurement window.
    cpu_ns: f64,
    wanted_ns: u64,
    parked_wanting_ns: u64,
    starve_ns: u64,
    longest_starve_ns: u64,
    job_done_ns: Option<u64>,
    latencies: Vec<u64>,
    /// The VM's device thread ([`Pattern::Throttled`], [`Pattern::IoLoop`]).
    helper: helper::Helper,
    /// [`Pattern::IoLoop`]: requests in the device thread's hands (admission
    /// time, device work left), FIFO.
    device: VecDeque<(u64, f64)>,
    /// [`Pattern::IoLoop`]: requests done by the device thread, not yet
    /// seen by the vCPU (when they will be, admission time).
    in_flight: VecDeque<(u64, u64)>,
    /// [`Pattern::IoLoop`]: tokens in the bucket and when it was refilled.
    tokens: f64,
    refilled_ns: u64,
    /// Parks applied in the measurement window.
    parks: u64,
    /// Sum of the demand the policy counted the VM at, percent, over the
    /// window's ticks.
    demand_sum: f64,
}

impl SimVm {
    fn runnable_at(&self, t: u64) -> u32 {
        match self.pattern {
            Pattern::Idle => 0,
            Pattern::Hog => self.vcpus,
            Pattern::PartialHog { busy_vcpus } => busy_vcpus.min(self.vcpus),
            Pattern::Bursty { on_ns, off_ns } => {
                let cycle = (on_ns + off_ns).max(1);
                if (t - self.start_ns + self.phase_ns) % cycle < on_ns {
                    self.vcpus
                } else {
                    0
                }
            }
            Pattern::MostlyIdle { .. }
            | Pattern::Latency { .. }
            | Pattern::Throttled { .. }
            | Pattern::IoLoop { .. } => u32::from(!self.requests.is_empty()),
            Pattern::Job { .. } => self.job_left.iter().filter(|&&w| w > 0.0).count() as u32,
        }
    }

    fn arrivals(&mut self, t: u64, rng: &mut Rng) {
        match self.pattern {
            Pattern::MostlyIdle {
                mean_gap_ns,
                burst_ns,
            } => {
                while self.next_arrival <= t {
                    self.requests
                        .push_back((self.next_arrival, burst_ns as f64));
                    let gap = -(mean_gap_ns as f64) * rng.unit().ln();
                    self.next_arrival += (gap as u64).max(1);
                }
            }
            Pattern::Latency {
                interval_ns,
                work_ns,
            } => {
                while self.next_arrival <= t {
                    self.requests.push_back((self.next_arrival, work_ns as f64));
                    let jitter = interval_ns / 10;
                    let gap = interval_ns - jitter + rng.below(2 * jitter + 1);
                    self.next_arrival += gap.max(1);
                }
            }
            Pattern::Throttled {
                interval_ns,
                vcpu_ns,
                helper_ns,
            } => {
                while self.next_arrival <= t {
                    self.requests.push_back((self.next_arrival, vcpu_ns as f64));
                    self.helper.left += helper_ns as f64;
                    self.next_arrival += interval_ns.max(1);
                }
            }
            Pattern::IoLoop {
                queue_depth,
                interval_ns,
                burst,
                helper_ns,
                vcpu_ns,
                ..
            } => {
                while let Some(&(ready, at)) = self.in_flight.front() {
                    if ready > t {
                        break;
                    }
                    self.in_flight.pop_front();
                    self.requests.push_back((at, vcpu_ns as f64));
                }
                let waiting = (queue_depth as usize)
                    .saturating_sub(self.device.len() + self.in_flight.len() + self.requests.len());
                let admit = if interval_ns == 0 {
                    waiting
                } else {
                    let dt = t.saturating_sub(self.refilled_ns);
                    self.tokens =
                        (self.tokens + dt as f64 / interval_ns as f64).min(f64::from(burst.max(1)));
                    waiting.min(self.tokens as usize)
                };
                self.refilled_ns = t;
                for _ in 0..admit {
                    self.device.push_back((t, helper_ns as f64));
                    self.helper.left += helper_ns as f64;
                }
                if interval_ns != 0 {
                    self.tokens -= admit as f64;
                }
            }
            _ => {}
        }
    }

    /// [`Pattern::IoLoop`]: the device thread did `done` ns of work in the
    /// step ending at `end`; finished requests go to the vCPU after the
    /// latency.
    fn device_done(&mut self, mut done: f64, end: u64) {
        let Pattern::IoLoop { latency_ns, .. } = self.pattern else {
            return;
        };
        while done > 0.0 {
            let Some(front) = self.device.front_mut() else {
                break;
            };
            let take = front.1.min(done);
            front.1 -= take;
            done -= take;
            if front.1 <= 1e-9 {
                let (at, _) = self.device.pop_front().expect("front exists");
                self.in_flight.push_back((end + latency_ns, at));
            }
        }
    }

    /// Gives each runnable vCPU `slice` ns of CPU (rate `rate`) in the step
    /// starting at `t`; returns CPU used.
    fn run(&mut self, t: u64, rate: f64, slice: f64) -> f64 {
        let used = match self.pattern {
            Pattern::Idle => 0.0,
            Pattern::Hog | Pattern::PartialHog { .. } | Pattern::Bursty { .. } => {
                f64::from(self.runnable) * slice
            }
            Pattern::MostlyIdle { .. }
            | Pattern::Latency { .. }
            | Pattern::Throttled { .. }
            | Pattern::IoLoop { .. } => {
                let mut budget = slice;
                while budget > 0.0 {
                    let Some(front) = self.requests.front_mut() else {
                        break;
                    };
                    let take = front.1.min(budget);
                    front.1 -= take;
                    budget -= take;
                    if front.1 <= 0.0 {
                        let done = t + ((slice - budget) / rate) as u64;
                        self.latencies.push(done.saturating_sub(front.0));
                        self.requests.pop_front();
                    }
                }
                slice - budget
            }
            Pattern::Job { .. } => {
                let mut used = 0.0;
                let mut last_done: Option<u64> = None;
                for w in self.job_left.iter_mut().filter(|w| **w > 0.0) {
                    let take = w.min(slice);
                    *w -= take;
                    used += take;
                    if *w <= 0.0 {
                        let done = t + (take / rate) as u64;
                        last_done = Some(last_done.map_or(done, |d| d.max(done)));
                    }
                }
                if let Some(done) = last_done
                    && self.job_left.iter().all(|&w| w <= 0.0)
                {
                    self.job_done_ns = Some(done - self.start_ns);
                }
                used
            }
        };
        self.cpu_total += used;
        self.cpu_ns += used;
        used
    }
}

/// The simulator. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct Simulator {
    config: SimConfig,
    scheduler: Scheduler,
    vms: Vec<SimVm>,
    rng: Rng,
    now: u64,
    next_tick: u64,
    next_id: u64,
    generation: Option<u64>,
    usages: Vec<VmUsage>,
    partial: Vec<f64>,
    capacity_cpus: f64,
    /// Spinning threads that are not corral's.
    outside_threads: u32,
    /// Outside CPU and idle time since the last sample, ns.
    outside_acc: f64,
    idle_acc: f64,
    /// Outside CPU counted in whole jiffies so far, and the true total.
    outside_counted: f64,
    outside_total: f64,
    last_sample: Option<u64>,
    // Measurement window.
    window_start: u64,
    busy_ns: f64,
    idle_ns: f64,
    outside_ns: f64,
    wasted_ns: f64,
    ticks: u64,
    policy_ns_total: u64,
    policy_ns_max: u64,
}

impl Simulator {
    /// A simulator with `capacity` host CPUs and no classes or VMs.
    ///
    /// # Panics
    /// If the policy configuration is invalid or `step_ns` is zero.
    pub fn new(capacity: Capacity, config: SimConfig) -> Self {
        assert!(config.step_ns > 0, "step must be positive");
        let scheduler = Scheduler::new(capacity, config.policy).expect("valid policy config");
        Simulator {
            config,
            scheduler,
            vms: Vec::new(),
            rng: Rng(config.seed),
            now: 0,
            next_tick: 0,
            next_id: 1,
            generation: None,
            usages: Vec::new(),
            partial: Vec::new(),
            capacity_cpus: capacity.cpus(),
            outside_threads: 0,
            outside_acc: 0.0,
            idle_acc: 0.0,
            outside_counted: 0.0,
            outside_total: 0.0,
            last_sample: None,
            window_start: 0,
            busy_ns: 0.0,
            idle_ns: 0.0,
            outside_ns: 0.0,
            wasted_ns: 0.0,
            ticks: 0,
            policy_ns_total: 0,
            policy_ns_max: 0,
        }
    }

    /// The scheduler under test.
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// The scheduler, for live changes in the middle of a run (classes,
    /// weights, moves; capacity changes also change the simulated host).
    pub fn scheduler_mut(&mut self) -> &mut Scheduler {
        &mut self.scheduler
    }

    /// Sets the number of spinning threads outside corral from now on.
    pub fn set_outside_load(&mut self, threads: u32) {
        self.outside_threads = threads;
    }

    /// Current simulated time, ns.
    pub fn now(&self) -> u64 {
        self.now
    }

    /// Creates a class.
    pub fn create_class(&mut self, name: &str, spec: ClassSpec) -> Result<(), ModelError> {
        self.scheduler.create_class(name, spec)
    }

    /// Creates a class under `parent`.
    pub fn create_class_in(
        &mut self,
        name: &str,
        spec: ClassSpec,
        parent: &str,
    ) -> Result<(), ModelError> {
        self.scheduler.create_class_in(name, spec, Some(parent))
    }

    /// Adds a VM starting now and returns its id.
    pub fn add_vm(
        &mut self,
        class: &str,
        weight: u32,
        vcpus: u32,
        pattern: Pattern,
    ) -> Result<VmId, ModelError> {
        let id = VmId(self.next_id);
        self.scheduler
            .add_vm(id, VmSpec::new(class, vcpus).with_weight(weight))?;
        self.next_id += 1;
        let phase_ns = match pattern {
            Pattern::Bursty { on_ns, off_ns } => self.rng.below(on_ns + off_ns),
            _ => 0,
        };
        let next_arrival = self.now
            + match pattern {
                Pattern::MostlyIdle { mean_gap_ns, .. } => self.rng.below(mean_gap_ns),
                Pattern::Latency { interval_ns, .. } => self.rng.below(interval_ns),
                _ => 0,
            };
        let job_left = match pattern {
            Pattern::Job { work_ns } => vec![work_ns as f64; vcpus as usize],
            _ => Vec::new(),
        };
        self.vms.push(SimVm {
            id,
            class: class.to_owned(),
            capped: false,
            vcpus,
            pattern,
            start_ns: self.now,
            phase_ns,
            job_left,
            requests: VecDeque::new(),
            next_arrival,
            parked: false,
            park_at: None,
            runnable: 0,
            tick_runnable: 0,
            cpu_total: 0.0,
            cpu_ns: 0.0,
            wanted_ns: 0,
            parked_wanting_ns: 0,
            starve_ns: 0,
            longest_starve_ns: 0,
            job_done_ns: None,
            latencies: Vec::new(),
            helper: helper::Helper::default(),
            device: VecDeque::new(),
            in_flight: VecDeque::new(),
            tokens: 0.0,
            refilled_ns: self.now,
            parks: 0,
            demand_sum: 0.0,
        });
        Ok(id)
    }

    /// Removes a VM.
    pub fn remove_vm(&mut self, id: VmId) -> Result<(), ModelError> {
        self.scheduler.remove_vm(id)?;
        self.vms.retain(|v| v.id != id);
        Ok(())
    }

    /// Starts a new measurement window (zeroes all counters).
    pub fn reset_counters(&mut self) {
        self.window_start = self.now;
        self.busy_ns = 0.0;
        self.idle_ns = 0.0;
        self.outside_ns = 0.0;
        self.wasted_ns = 0.0;
        self.ticks = 0;
        self.policy_ns_total = 0;
        self.policy_ns_max = 0;
        for vm in &mut self.vms {
            vm.cpu_ns = 0.0;
            vm.wanted_ns = 0;
            vm.parked_wanting_ns = 0;
            vm.starve_ns = 0;
            vm.longest_starve_ns = 0;
            vm.latencies.clear();
            vm.parks = 0;
            vm.demand_sum = 0.0;
        }
    }

    /// Re-reads class membership and caps after model changes, and orders
    /// the VMs like the policy does (fast path in `tick`).
    fn refresh(&mut self) {
        let model = self.scheduler.model();
        if self.generation == Some(model.generation()) {
            return;
        }
        self.generation = Some(model.generation());
        self.capacity_cpus = model.capacity().cpus();
        for vm in &mut self.vms {
            if let Some(spec) = model.vm(vm.id) {
                vm.class.clone_from(&spec.class);
                vm.vcpus = spec.vcpus;
            }
            vm.capped = model.class(&vm.class).is_some_and(|c| c.cap.is_some())
                || model.vm(vm.id).is_some_and(|v| v.cap.is_some());
        }
        self.vms
            .sort_by(|a, b| a.class.cmp(&b.class).then(a.id.cmp(&b.id)));
    }

    /// Runs the simulation for `duration_ns` of simulated time.
    pub fn run_for(&mut self, duration_ns: u64) {
        let end = self.now + duration_ns;
        while self.now < end {
            if self.now >= self.next_tick {
                self.policy_tick();
                self.next_tick += self.config.policy.tick_ns;
            }
            self.step();
        }
    }

    fn policy_tick(&mut self) {
        self.refresh();
        let exact = self.config.exact_runnable;
        self.usages.clear();
        for vm in &mut self.vms {
            let runnable = if exact || vm.tick_runnable == 0 {
                vm.tick_runnable
            } else {
                ALL_VCPUS
            };
            let helpers = vm.helper.end_tick(self.config.policy.tick_ns);
            self.usages.push(
                VmUsage::total(vm.id, vm.cpu_total as u64, false)
                    .with_runnable_vcpus(runnable)
                    .with_busy_helpers(helpers),
            );
            vm.tick_runnable = 0;
        }
        self.sample_outside();
        let t0 = Instant::now();
        let out = self.scheduler.tick(self.now, &self.usages);
        let cost = t0.elapsed().as_nanos() as u64;
        self.ticks += 1;
        self.policy_ns_total += cost;
        self.policy_ns_max = self.policy_ns_max.max(cost);
        for change in out.changes() {
            // `vms` is in policy order, so a binary search by position works
            // only for the full list; changes are few, a scan is fine.
            let Some(vm) = self.vms.iter_mut().find(|v| v.id == change.vm) else {
                continue;
            };
            match change.action {
                Action::Unpark => {
                    vm.parked = false;
                    vm.park_at = None;
                }
                Action::Park if self.config.park_latency_ns == 0 => {
                    vm.parked = true;
                    vm.parks += 1;
                }
                Action::Park => {
                    vm.park_at = Some(self.now + self.config.park_latency_ns);
                    vm.parks += 1;
                }
            }
        }
        for vm in &mut self.vms {
            vm.demand_sum += self.scheduler.demand_pct(vm.id).unwrap_or(0.0);
        }
    }

    /// Every [`OUTSIDE_SAMPLE_TICKS`] ticks: hands the outside load and the
    /// idle time measured since the last sample to the policy.
    fn sample_outside(&mut self) {
        let every = OUTSIDE_SAMPLE_TICKS * self.config.policy.tick_ns;
        let last = *self.last_sample.get_or_insert(self.now);
        let interval = self.now - last;
        if interval < every {
            return;
        }
        self.last_sample = Some(self.now);
        let (outside, idle) = (self.outside_acc, self.idle_acc);
        self.outside_acc = 0.0;
        self.idle_acc = 0.0;
        if !self.config.measure_outside {
            return;
        }
        let outside = match self.config.stat_jiffy_ns {
            0 => outside,
            j => {
                // Whole jiffies of the running total, as /proc/stat counts.
                let j = j as f64;
                let counted = (self.outside_total / j).floor() * j;
                let d = counted - self.outside_counted;
                self.outside_counted = counted;
                d
            }
        };
        let pct = |ns: f64| ns / interval as f64 * 100.0;
        self.scheduler
            .set_measured_outside(Some(pct(outside)), interval);
        self.scheduler.set_measured_idle(Some(pct(idle)));
    }

    fn step(&mut self) {
        let t = self.now;
        let step = self.config.step_ns;
        let stepf = step as f64;
        // Per-thread demand for this step: spinning threads want the whole
        // step, threads finishing a request or job want what is left of it.
        let mut spinning = 0u64;
        self.partial.clear();
        for vm in &mut self.vms {
            if let Some(at) = vm.park_at
                && at <= t
            {
                vm.parked = true;
                vm.park_at = None;
            }
            vm.arrivals(t, &mut self.rng);
            vm.runnable = vm.runnable_at(t);
            vm.tick_runnable = vm.tick_runnable.max(vm.runnable);
            // The device thread is never parked.
            vm.helper.demand(stepf, &mut spinning, &mut self.partial);
            if vm.parked || vm.runnable == 0 {
                continue;
            }
            match vm.pattern {
                Pattern::MostlyIdle { .. }
                | Pattern::Latency { .. }
                | Pattern::Throttled { .. }
                | Pattern::IoLoop { .. } => {
                    let queued: f64 = vm.requests.iter().map(|r| r.1).sum();
                    if queued >= stepf {
                        spinning += 1;
                    } else {
                        self.partial.push(queued);
                    }
                }
                Pattern::Job { .. } => {
                    for &w in vm.job_left.iter().filter(|&&w| w > 0.0) {
                        if w >= stepf {
                            spinning += 1;
                        } else {
                            self.partial.push(w);
                        }
                    }
                }
                _ => spinning += u64::from(vm.runnable),
            }
        }
        spinning += u64::from(self.outside_threads);
        // Max-min fair share per thread (`level` ns of CPU in this step).
        let mut left = self.capacity_cpus * stepf;
        let partial_sum: f64 = self.partial.iter().sum();
        let level = if partial_sum + spinning as f64 * stepf <= left {
            stepf
        } else {
            self.partial.sort_unstable_by(f64::total_cmp);
            let mut n = spinning as f64 + self.partial.len() as f64;
            for &p in &self.partial {
                if p * n <= left {
                    left -= p;
                    n -= 1.0;
                } else {
                    break;
                }
            }
            (left / n).min(stepf)
        };
        let slice = level;
        let rate = level / stepf;
        let mut used = 0.0;
        let mut parked_wanting = 0u64;
        for vm in &mut self.vms {
            let h = vm.helper.run(slice);
            vm.device_done(h, t + step);
            vm.cpu_total += h;
            vm.cpu_ns += h;
            used += h;
            if vm.runnable == 0 {
                vm.starve_ns = 0;
                continue;
            }
            vm.wanted_ns += step;
            if vm.parked {
                vm.parked_wanting_ns += step;
                if !vm.capped {
                    parked_wanting += u64::from(vm.runnable);
                }
                vm.starve_ns += step;
                vm.longest_starve_ns = vm.longest_starve_ns.max(vm.starve_ns);
            } else {
                used += vm.run(t, rate, slice);
                vm.starve_ns = 0;
            }
        }
        let outside = f64::from(self.outside_threads) * slice;
        let capacity = self.capacity_cpus * step as f64;
        let idle = (capacity - used - outside).max(0.0);
        self.busy_ns += used;
        self.idle_ns += idle;
        self.outside_ns += outside;
        self.outside_acc += outside;
        self.outside_total += outside;
        self.idle_acc += idle;
        self.wasted_ns += idle.min(parked_wanting as f64 * step as f64);
        self.now += step;
    }

    /// The results since the last [`reset_counters`](Self::reset_counters).
    pub fn report(&self) -> SimReport {
        let window = (self.now - self.window_start).max(1);
        let out = self.scheduler.last_output();
        let mut vms: Vec<VmReport> = self
            .vms
            .iter()
            .map(|vm| VmReport {
                id: vm.id,
                class: vm.class.clone(),
                vcpus: vm.vcpus,
                cpu_ns: vm.cpu_ns,
                cpu_pct: vm.cpu_ns / window as f64 * 100.0,
                wanted_ns: vm.wanted_ns,
                parked_wanting_ns: vm.parked_wanting_ns,
                longest_starve_ns: vm.longest_starve_ns,
                job_done_ns: vm.job_done_ns,
                latencies_ns: vm.latencies.clone(),
                entitlement_pct: out
                    .vms()
                    .iter()
                    .find(|d| d.vm == vm.id)
                    .map_or(0.0, |d| d.entitlement_pct),
                parks: vm.parks,
                demand_pct: vm.demand_sum / self.ticks.max(1) as f64,
            })
            .collect();
        vms.sort_by_key(|v| v.id);
        SimReport {
            window_ns: window,
            capacity_pct: self.scheduler.model().capacity().percent(),
            vms,
            busy_ns: self.busy_ns,
            idle_ns: self.idle_ns,
            outside_ns: self.outside_ns,
            wasted_ns: self.wasted_ns,
            ticks: self.ticks,
            policy_ns_total: self.policy_ns_total,
            policy_ns_max: self.policy_ns_max,
        }
    }
}
