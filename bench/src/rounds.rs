//! The stop rule of the adaptive benchmarks (`interference`, `overhead`):
//! which jobs run another round, and when the run ends. A pure function of
//! what the rounds so far gave (tested on fake data below).
//!
//! Each job (a victim of `interference`, a guest job of `overhead`) has
//! ratios measured in pairs within a round (a slowdown against the run
//! alone, B/A and C/A). A job whose intervals are all within the target
//! stops, so the rounds that remain go to the job that swings: in
//! `interference` a round of one victim is its three runs (alone and the
//! two headline scenarios), about 40 s with victims of 10 s, where a round
//! of every scenario of both victims was ~4 min.

use super::stats::{RatioCi, pairs_needed};

/// What the rounds so far gave for one job.
#[derive(Debug, Clone)]
pub(crate) struct Progress {
    /// Rounds it has run.
    pub(crate) rounds: u32,
    /// Seconds one round of it takes (mean over its rounds, set-up and
    /// warm-up included).
    pub(crate) round_secs: f64,
    /// Its ratios' intervals (`None` before two rounds).
    pub(crate) ratios: Vec<Option<RatioCi>>,
}

impl Progress {
    /// Whether every interval is within `target` percent.
    fn settled(&self, min_rounds: u32, target: f64) -> bool {
        self.rounds >= min_rounds
            && self
                .ratios
                .iter()
                .all(|s| s.is_some_and(|r| r.half_width_pct() <= target))
    }
}

/// What to do after a round.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Next {
    /// Run another round of these jobs (indices).
    Run(Vec<usize>),
    /// Every interval is within the target.
    Settled,
    /// The next round would overrun the budget.
    BudgetSpent,
}

/// The stop rule: another round for each job that has run fewer than
/// `min_rounds` rounds or has an interval wider than `target` percent,
/// unless that round (the sum of those jobs' round times) would end after
/// `budget_s`.
pub(crate) fn next(
    jobs: &[Progress],
    elapsed_s: f64,
    budget_s: f64,
    min_rounds: u32,
    target: f64,
) -> Next {
    let open: Vec<usize> = jobs
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.settled(min_rounds, target))
        .map(|(i, _)| i)
        .collect();
    if open.is_empty() {
        return Next::Settled;
    }
    let cost: f64 = open.iter().map(|&i| jobs[i].round_secs).sum();
    if elapsed_s + cost > budget_s {
        return Next::BudgetSpent;
    }
    Next::Run(open)
}

/// [`next`] over the jobs in `selected` only (indices into `jobs`, which
/// holds every job's progress): the jobs not selected never run and do not
/// keep the rounds going. Returns indices into `jobs`.
pub(crate) fn next_selected(
    selected: &[usize],
    jobs: &[Progress],
    elapsed_s: f64,
    budget_s: f64,
    min_rounds: u32,
    target: f64,
) -> Next {
    let mine: Vec<Progress> = selected
        .iter()
        .filter_map(|&i| jobs.get(i).cloned())
        .collect();
    match next(&mine, elapsed_s, budget_s, min_rounds, target) {
        Next::Run(v) => Next::Run(v.into_iter().map(|k| selected[k]).collect()),
        other => other,
    }
}

/// "N rounds", or "cpu N rounds, io M rounds" when the jobs differ.
pub(crate) fn describe(names: &[&str], p: &[Progress]) -> String {
    let first = p.first().map_or(0, |v| v.rounds);
    if p.iter().all(|v| v.rounds == first) {
        return format!("{first} rounds");
    }
    names
        .iter()
        .zip(p)
        .map(|(j, v)| format!("{j} {} rounds", v.rounds))
        .collect::<Vec<_>>()
        .join(", ")
}

/// How many more rounds of a job an interval of `r` would need to reach
/// `target` percent at the same spread, and the minutes they would take:
/// `None` when it is there already (or cannot say: fewer than two rounds).
pub(crate) fn more_rounds(r: &RatioCi, target: f64, round_secs: f64) -> Option<(usize, f64)> {
    let need = pairs_needed(r.n, r.half_width_pct(), target)?;
    let more = need.saturating_sub(r.n);
    (more > 0).then(|| (more, more as f64 * round_secs / 60.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An interval from fake per-round ratios: `mean` ± `swing` alternating.
    fn ci(rounds: usize, mean: f64, swing: f64) -> RatioCi {
        let pairs: Vec<(f64, f64)> = (0..rounds)
            .map(|i| {
                let s = if i % 2 == 0 { swing } else { -swing };
                (10.0, 10.0 * mean * (1.0 + s))
            })
            .collect();
        RatioCi::of(&pairs).unwrap()
    }

    fn job(rounds: u32, swing: f64) -> Progress {
        Progress {
            rounds,
            round_secs: 40.0,
            ratios: vec![
                (rounds >= 2).then(|| ci(rounds as usize, 1.34, swing)),
                (rounds >= 2).then(|| ci(rounds as usize, 1.45, swing)),
            ],
        }
    }

    #[test]
    fn runs_every_job_until_the_minimum() {
        // Tight intervals after 2 rounds, but the minimum is 3.
        let v = [job(2, 0.001), job(2, 0.001)];
        assert_eq!(next(&v, 100.0, 2400.0, 3, 5.0), Next::Run(vec![0, 1]));
        // No interval yet (1 round): keep going whatever the minimum.
        let v = [job(1, 0.0)];
        assert_eq!(next(&v, 10.0, 2400.0, 1, 5.0), Next::Run(vec![0]));
    }

    #[test]
    fn a_settled_job_stops_and_the_other_goes_on() {
        // Job 0 swings ±1 %: settled; job 1 swings ±20 %: not.
        let v = [job(4, 0.01), job(4, 0.20)];
        assert!(v[0].ratios[0].unwrap().half_width_pct() < 5.0);
        assert!(v[1].ratios[0].unwrap().half_width_pct() > 5.0);
        assert_eq!(next(&v, 300.0, 2400.0, 3, 5.0), Next::Run(vec![1]));
        // One wide interval is enough to keep a job open.
        let mut w = job(4, 0.01);
        w.ratios[1] = Some(ci(4, 1.45, 0.2));
        assert_eq!(next(&[w], 300.0, 2400.0, 3, 5.0), Next::Run(vec![0]));
    }

    #[test]
    fn stops_when_every_interval_is_within_the_target() {
        let v = [job(5, 0.01), job(3, 0.005)];
        assert_eq!(next(&v, 300.0, 2400.0, 3, 5.0), Next::Settled);
    }

    #[test]
    fn stops_before_a_round_that_would_overrun_the_budget() {
        // Both open: the next round costs 80 s.
        let v = [job(4, 0.2), job(4, 0.2)];
        assert_eq!(next(&v, 2320.0, 2400.0, 3, 5.0), Next::Run(vec![0, 1]));
        assert_eq!(next(&v, 2321.0, 2400.0, 3, 5.0), Next::BudgetSpent);
        // Only one open: 40 s is what counts.
        let v = [job(4, 0.01), job(4, 0.2)];
        assert_eq!(next(&v, 2360.0, 2400.0, 3, 5.0), Next::Run(vec![1]));
        assert_eq!(next(&v, 2361.0, 2400.0, 3, 5.0), Next::BudgetSpent);
    }

    /// The whole loop on fake data: job 0 swings ±2 % a round, job 1
    /// ±12 %; rounds of 40 s each, 40 min budget. Job 0 stops early,
    /// job 1 goes on alone until its intervals are within ±5 %, well
    /// inside the budget, and its slowdown interval covers the true 1.45.
    #[test]
    fn the_loop_settles_the_swinging_job_with_the_time_left() {
        let swings = [0.02, 0.12];
        let mut rounds = [0u32; 2];
        let mut elapsed = 0.0;
        let mut ratios: [Vec<(f64, f64)>; 2] = [Vec::new(), Vec::new()];
        // A fixed pseudo-random sequence in [-1, 1].
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut noise = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 2001) as f64 / 1000.0 - 1.0
        };
        let mut run = vec![0, 1];
        let end = loop {
            for &i in &run {
                rounds[i] += 1;
                elapsed += 40.0;
                ratios[i].push((10.0, 14.5 * (1.0 + swings[i] * noise())));
            }
            let v: Vec<Progress> = (0..2)
                .map(|i| Progress {
                    rounds: rounds[i],
                    round_secs: 40.0,
                    ratios: vec![RatioCi::of(&ratios[i]); 2],
                })
                .collect();
            match next(&v, elapsed, 2400.0, 3, 5.0) {
                Next::Run(r) => run = r,
                other => break (other, v),
            }
        };
        assert_eq!(end.0, Next::Settled, "{:?}", end.1);
        assert!(rounds[0] <= 4, "{rounds:?}");
        assert!(rounds[1] > rounds[0] + 2, "{rounds:?}");
        let r = end.1[1].ratios[0].unwrap();
        assert!(r.half_width_pct() <= 5.0);
        assert!(r.lo_pct < 45.0 && r.hi_pct > 45.0, "{r:?}");
        assert!(elapsed < 2400.0);
    }

    /// `--victims io`: only job 1 runs. The cpu victim (job 0) has no
    /// rounds, so its intervals are open; before, the stop rule saw it and
    /// ran it from the second round on.
    #[test]
    fn only_the_selected_jobs_run_and_decide_the_stop() {
        let v = [job(0, 0.0), job(1, 0.0)];
        assert_eq!(
            next_selected(&[1], &v, 40.0, 2400.0, 3, 5.0),
            Next::Run(vec![1])
        );
        let v = [job(0, 0.0), job(4, 0.01)];
        assert_eq!(
            next_selected(&[1], &v, 300.0, 2400.0, 3, 5.0),
            Next::Settled
        );
        // Both selected: as `next`.
        let v = [job(4, 0.2), job(4, 0.01)];
        assert_eq!(
            next_selected(&[0, 1], &v, 300.0, 2400.0, 3, 5.0),
            next(&v, 300.0, 2400.0, 3, 5.0)
        );
        assert_eq!(
            next_selected(&[0, 1], &v, 300.0, 2400.0, 3, 5.0),
            Next::Run(vec![0])
        );
    }

    #[test]
    fn describes_rounds() {
        let p = [job(4, 0.01), job(9, 0.2)];
        assert_eq!(describe(&["cpu", "io"], &p), "cpu 4 rounds, io 9 rounds");
        assert_eq!(
            describe(&["cpu", "io"], &[job(3, 0.0), job(3, 0.0)]),
            "3 rounds"
        );
    }

    #[test]
    fn rounds_still_needed() {
        // ±10 % after 4 rounds: ±5 % needs ~16, so 12 more, 8 min at 40 s.
        let r = RatioCi {
            n: 4,
            mean_pct: 40.0,
            lo_pct: 30.0,
            hi_pct: 50.0,
        };
        let (more, min) = more_rounds(&r, 5.0, 40.0).unwrap();
        assert_eq!(more, 12);
        assert!((min - 8.0).abs() < 1e-9);
        let tight = RatioCi {
            n: 4,
            mean_pct: 40.0,
            lo_pct: 37.0,
            hi_pct: 43.0,
        };
        assert_eq!(more_rounds(&tight, 5.0, 40.0), None);
    }
}
