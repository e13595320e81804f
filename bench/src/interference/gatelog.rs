//! The gate's side of a victim run, from the scheduler's own statistics:
//! how long the policy kept the victim and the hog parked and how often it
//! parked them, the capacity it planned with (the nominal one less steal
//! and the outside load), and the demand it counted each VM as. These are
//! the policy's decisions, not wall-clock figures: they say on a loaded
//! host as well as on a quiet one whether the gate held a VM back.

use std::collections::HashMap;

use corral_scheduler::VmId;
use corral_scheduler::policy::Stats;
use corral_vmm::manager::Manager;

/// What the policy did during one victim run (means over the samples).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct GateTotals {
    /// Seconds the victim was parked.
    pub(super) victim_parked_s: f64,
    /// Times it was parked.
    pub(super) victim_parks: u64,
    /// Seconds the hog (all its VMs, restarts included) was parked.
    pub(super) hog_parked_s: f64,
    /// Times it was parked.
    pub(super) hog_parks: u64,
    /// Mean capacity planned with, percent of one CPU.
    pub(super) available_pct: f64,
    /// Mean outside load measured, percent of one CPU.
    pub(super) outside_pct: f64,
    /// Mean demand the policy counted the victim as, percent.
    pub(super) victim_demand_pct: f64,
    /// Mean demand the policy counted the hog as, percent.
    pub(super) hog_demand_pct: f64,
    /// Samples the means are over.
    pub(super) samples: u32,
}

/// One sample, for the timeline.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct GateSample {
    pub(super) available_pct: f64,
    pub(super) outside_pct: f64,
    pub(super) victim_parked: bool,
    pub(super) victim_demand_pct: f64,
    pub(super) hog_demand_pct: f64,
}

/// Per VM id: (parked ns, park count) at the baseline and at the last
/// reading.
type Seen = HashMap<VmId, ((u64, u64), (u64, u64))>;

/// The gate accounting of one victim run. VMs that exist when it begins
/// count from their reading then; VMs added later (the victim, a restarted
/// hog) from zero; a VM that is gone keeps its last reading.
pub(super) struct GateLog {
    victim: String,
    hog: Option<String>,
    seen: [Seen; 2],
    begun: bool,
    sums: GateTotals,
}

impl GateLog {
    /// Accounting for victim VM `victim` beside hog VM `hog` (the hog's
    /// restarts keep its name); takes the baselines.
    pub(super) fn begin(mgr: &Manager, victim: &str, hog: Option<&str>) -> Self {
        let mut g = Self {
            victim: victim.to_string(),
            hog: hog.map(str::to_string),
            seen: [HashMap::new(), HashMap::new()],
            begun: false,
            sums: GateTotals::default(),
        };
        g.read(mgr);
        g.begun = true;
        g
    }

    /// Reads the scheduler's statistics; returns the sample (for the
    /// timeline) and adds it to the means.
    pub(super) fn sample(&mut self, mgr: &Manager) -> Option<GateSample> {
        let s = self.read(mgr)?;
        self.sums.available_pct += s.available_pct;
        self.sums.outside_pct += s.outside_pct;
        self.sums.victim_demand_pct += s.victim_demand_pct;
        self.sums.hog_demand_pct += s.hog_demand_pct;
        self.sums.samples += 1;
        Some(s)
    }

    fn read(&mut self, mgr: &Manager) -> Option<GateSample> {
        let ids: Vec<(VmId, String)> = mgr
            .sched_vms()
            .into_iter()
            .map(|v| (v.id, v.name))
            .collect();
        let stats: Stats = mgr
            .scheduler()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .stats();
        let mut sample = GateSample {
            available_pct: stats.available_pct,
            outside_pct: stats.outside_pct,
            ..Default::default()
        };
        let names = [Some(self.victim.as_str()), self.hog.as_deref()];
        for (k, name) in names.iter().enumerate() {
            let Some(name) = name else { continue };
            for (id, _) in ids.iter().filter(|(_, n)| n == name) {
                let Some(v) = stats.vms.iter().find(|v| v.vm == *id) else {
                    continue;
                };
                let now = (v.parked_ns, v.park_count);
                let begun = self.begun;
                let e = self
                    .seen
                    .get_mut(k)?
                    .entry(*id)
                    .or_insert_with(|| (if begun { (0, 0) } else { now }, now));
                e.1 = now;
                if k == 0 {
                    sample.victim_parked = v.parked;
                    sample.victim_demand_pct += v.demand_pct;
                } else {
                    sample.hog_demand_pct += v.demand_pct;
                }
            }
        }
        Some(sample)
    }

    /// What the policy did since `begin`.
    pub(super) fn totals(&self) -> GateTotals {
        let mut t = self.sums;
        let n = f64::from(t.samples.max(1));
        t.available_pct /= n;
        t.outside_pct /= n;
        t.victim_demand_pct /= n;
        t.hog_demand_pct /= n;
        let delta = |seen: &Seen| -> (f64, u64) {
            seen.values()
                .fold((0.0, 0), |(s, c), ((b_ns, b_n), (ns, n))| {
                    (
                        s + ns.saturating_sub(*b_ns) as f64 / 1e9,
                        c + n.saturating_sub(*b_n),
                    )
                })
        };
        (t.victim_parked_s, t.victim_parks) = delta(&self.seen[0]);
        (t.hog_parked_s, t.hog_parks) = delta(&self.seen[1]);
        t
    }
}
