//! The interference benchmark's scenarios, its goals, the cells a run
//! collects and the slowdown of a scenario with its interval.

use super::super::stats::RatioCi;

/// Issue 13's goals: the slowdown beside each hog with shares 3:1 (plus a
/// limit on the I/O hog), for both victims.
pub(super) const GOALS: [(&str, f64); 2] = [("cpu-hog-3:1", 1.40), ("io-hog-3:1+limit", 1.50)];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HogKind {
    None,
    Cpu,
    Io,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Scenario {
    pub(super) key: &'static str,
    pub(super) what: &'static str,
    pub(super) hog: HogKind,
    /// Gate scheduler (else CPU backend none).
    pub(super) gate: bool,
    pub(super) victim_shares: u32,
    pub(super) hog_limited: bool,
}

pub(super) const SCENARIOS: [Scenario; 7] = [
    Scenario {
        key: "alone",
        what: "victim alone",
        hog: HogKind::None,
        gate: true,
        victim_shares: 1,
        hog_limited: false,
    },
    Scenario {
        key: "cpu-hog-off",
        what: "CPU hog, manager off (host scheduler only)",
        hog: HogKind::Cpu,
        gate: false,
        victim_shares: 1,
        hog_limited: false,
    },
    Scenario {
        key: "cpu-hog-1:1",
        what: "CPU hog, equal classes",
        hog: HogKind::Cpu,
        gate: true,
        victim_shares: 1,
        hog_limited: false,
    },
    Scenario {
        key: "cpu-hog-3:1",
        what: "CPU hog, shares 3:1 for the victim",
        hog: HogKind::Cpu,
        gate: true,
        victim_shares: 3,
        hog_limited: false,
    },
    Scenario {
        key: "io-hog-off",
        what: "I/O hog, manager off (host scheduler only)",
        hog: HogKind::Io,
        gate: false,
        victim_shares: 1,
        hog_limited: false,
    },
    Scenario {
        key: "io-hog-1:1",
        what: "I/O hog, equal classes",
        hog: HogKind::Io,
        gate: true,
        victim_shares: 1,
        hog_limited: false,
    },
    Scenario {
        key: "io-hog-3:1+limit",
        what: "I/O hog, shares 3:1 for the victim, I/O limit on the hog",
        hog: HogKind::Io,
        gate: true,
        victim_shares: 3,
        hog_limited: true,
    },
];

pub(super) struct Cell {
    pub(super) round: u32,
    pub(super) job: &'static str,
    pub(super) scn: Scenario,
    pub(super) total_s: f64,
    pub(super) guest_s: Option<f64>,
    pub(super) victim_cpu_s: f64,
    pub(super) hog_cpu_s: f64,
    pub(super) hog_restarts: u64,
    pub(super) timeline: Vec<Point>,
    /// What the victim's and the hog's threads did during the victim's run
    /// (in [`super::threads::ROLES`] order).
    pub(super) threads: [super::threads::Sched; 5],
    /// What the gate's policy did during the victim's run.
    pub(super) gate: super::gatelog::GateTotals,
    /// Seconds the whole cell took (the hog's start and warm-up, the
    /// victim's run and the teardown).
    pub(super) secs: f64,
}

/// One sample of the run: CPU used and entitled per class, in percent of
/// one host CPU.
#[derive(Debug, Clone, Copy)]
pub(super) struct Point {
    pub(super) t: f64,
    pub(super) victim: f64,
    pub(super) hog: f64,
    pub(super) victim_ent: Option<f64>,
    pub(super) hog_ent: Option<f64>,
    /// The policy's state at the sample (gate scenarios).
    pub(super) gate: Option<super::gatelog::GateSample>,
}

/// The slowdown of scenario `key` for victim `job`: per round, its total
/// seconds over the same round's run alone.
pub(super) fn slowdown(cells: &[Cell], job: &str, key: &str) -> Option<RatioCi> {
    let pairs: Vec<(f64, f64)> = cells
        .iter()
        .filter(|c| c.job == job && c.scn.key == "alone")
        .filter_map(|al| {
            cells
                .iter()
                .find(|c| c.job == job && c.scn.key == key && c.round == al.round)
                .map(|c| (al.total_s, c.total_s))
        })
        .collect();
    RatioCi::of(&pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(round: u32, key: &str, total_s: f64) -> Cell {
        let scn = *SCENARIOS.iter().find(|s| s.key == key).unwrap();
        Cell {
            round,
            job: "cpu",
            scn,
            total_s,
            guest_s: None,
            victim_cpu_s: 0.0,
            hog_cpu_s: 0.0,
            hog_restarts: 0,
            timeline: Vec::new(),
            threads: Default::default(),
            gate: Default::default(),
            secs: 0.0,
        }
    }

    /// Each round's run beside the hog is divided by the same round's run
    /// alone (a slow round slows both), not by the mean of all runs alone.
    #[test]
    fn slowdown_pairs_by_round() {
        let cells = [
            cell(1, "alone", 10.0),
            cell(1, "cpu-hog-3:1", 13.0),
            cell(2, "alone", 20.0),
            cell(2, "cpu-hog-3:1", 26.0),
            cell(3, "alone", 12.0),
            cell(3, "cpu-hog-3:1", 15.6),
            cell(4, "alone", 11.0), // no partner in round 4: left out
        ];
        let r = slowdown(&cells, "cpu", "cpu-hog-3:1").unwrap();
        assert_eq!(r.n, 3);
        assert!((r.mean_pct - 30.0).abs() < 1e-9, "{r:?}");
        assert!(r.half_width_pct() < 1e-9, "{r:?}");
        assert!(
            r.goal_verdict(1.40, 5.0)
                .starts_with("meets ≤1.40×: 1.300×")
        );
        assert!(slowdown(&cells, "io", "cpu-hog-3:1").is_none());
    }
}
