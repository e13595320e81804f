//! Summary statistics the kernel lists used: min / avg / max / sdev / spread.

/// Summary of one series of samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Number of samples.
    pub n: usize,
    /// Smallest.
    pub min: f64,
    /// Mean.
    pub avg: f64,
    /// Largest.
    pub max: f64,
    /// Sample standard deviation (n - 1); 0 for one sample.
    pub sdev: f64,
}

impl Summary {
    /// Summary of `xs`; `None` when empty.
    pub fn of(xs: &[f64]) -> Option<Self> {
        if xs.is_empty() {
            return None;
        }
        let n = xs.len();
        let min = xs.iter().copied().fold(f64::INFINITY, f64::min);
        let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let avg = xs.iter().sum::<f64>() / n as f64;
        let sdev = if n > 1 {
            (xs.iter().map(|x| (x - avg).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
        } else {
            0.0
        };
        Some(Self {
            n,
            min,
            avg,
            max,
            sdev,
        })
    }

    /// (max - min) / avg, as a fraction.
    pub fn spread(&self) -> f64 {
        if self.avg == 0.0 {
            0.0
        } else {
            (self.max - self.min) / self.avg
        }
    }
}

/// `(x - base) / base` in percent.
pub fn diff_pct(x: f64, base: f64) -> f64 {
    if base == 0.0 {
        0.0
    } else {
        (x - base) / base * 100.0
    }
}

/// The two-sided 95 % quantile of Student's t with `df` degrees of freedom
/// (exact table up to 30, then the Cornish-Fisher expansion around the
/// normal quantile, within 0.001 of the exact value from there on).
pub fn t_975(df: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::INFINITY,
        1..=30 => TABLE[df - 1],
        _ => {
            let z = 1.959_963_984_540_054_f64;
            let n = df as f64;
            z + (z.powi(3) + z) / (4.0 * n)
                + (5.0 * z.powi(5) + 16.0 * z.powi(3) + 3.0 * z) / (96.0 * n * n)
        }
    }
}

/// A ratio measured in pairs (the same job on a base and on a candidate,
/// run back to back, the order alternating), with its 95 % confidence
/// interval: a t-interval on the logarithms of the per-pair ratios, so the
/// interval of `x / base` is not skewed by which side is the divisor. Pairs
/// cancel the drift of a shared machine (a slower minute slows both runs of
/// a pair); the alternating order cancels what the first run of a pair
/// leaves for the second (caches, CPU frequency).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RatioCi {
    /// Pairs.
    pub n: usize,
    /// The geometric mean of the ratios, as a change in percent.
    pub mean_pct: f64,
    /// Lower end of the 95 % interval, percent.
    pub lo_pct: f64,
    /// Upper end, percent.
    pub hi_pct: f64,
}

impl RatioCi {
    /// From `(base, candidate)` pairs of positive values; `None` with fewer
    /// than two usable pairs.
    pub fn of(pairs: &[(f64, f64)]) -> Option<Self> {
        let logs: Vec<f64> = pairs
            .iter()
            .filter(|(b, x)| *b > 0.0 && *x > 0.0 && b.is_finite() && x.is_finite())
            .map(|(b, x)| (x / b).ln())
            .collect();
        let n = logs.len();
        if n < 2 {
            return None;
        }
        let mean = logs.iter().sum::<f64>() / n as f64;
        let var = logs.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        let half = t_975(n - 1) * (var / n as f64).sqrt();
        let pct = |l: f64| (l.exp() - 1.0) * 100.0;
        Some(Self {
            n,
            mean_pct: pct(mean),
            lo_pct: pct(mean - half),
            hi_pct: pct(mean + half),
        })
    }

    /// Half the interval's width, percent.
    pub fn half_width_pct(&self) -> f64 {
        (self.hi_pct - self.lo_pct) / 2.0
    }

    /// The verdict in the kernel lists' terms, for "`what` costs ...".
    pub fn verdict(&self, what: &str, target_pct: f64) -> String {
        let half = self.half_width_pct();
        if self.lo_pct > 0.0 {
            format!("{what} costs {:+.2} % ± {half:.2} %", self.mean_pct)
        } else if self.hi_pct < 0.0 {
            format!("{what} is faster: {:+.2} % ± {half:.2} %", self.mean_pct)
        } else if half <= target_pct {
            format!(
                "no overhead detectable at ±{target_pct} % ({what}: {:+.2} %, 95 % interval {:+.2} … {:+.2} %)",
                self.mean_pct, self.lo_pct, self.hi_pct
            )
        } else {
            format!(
                "inconclusive: {what} {:+.2} % with a 95 % interval of ±{half:.2} % after {} pairs (wanted ±{target_pct} %)",
                self.mean_pct, self.n
            )
        }
    }
}

impl RatioCi {
    /// The verdict on a slowdown goal, "at most `limit` times the time
    /// alone", with the interval half-width wanted (`target_pct`): met when
    /// the whole interval is at or under the limit, missed when all of it is
    /// over, undecided when it straddles.
    pub fn goal_verdict(&self, limit: f64, target_pct: f64) -> String {
        let x = |p: f64| 1.0 + p / 100.0;
        let (m, lo, hi) = (x(self.mean_pct), x(self.lo_pct), x(self.hi_pct));
        let half = self.half_width_pct();
        let what = if hi <= limit {
            "meets"
        } else if lo > limit {
            "misses"
        } else {
            "undecided at"
        };
        let width = if half <= target_pct {
            String::new()
        } else {
            format!("; interval ±{half:.1} %, wider than the ±{target_pct} % wanted")
        };
        format!("{what} ≤{limit:.2}×: {m:.3}× (95 % {lo:.3}× … {hi:.3}×{width})")
    }
}

/// How many pairs an interval of half-width `half` after `n` pairs would
/// need to shrink to `target` at the same spread: the standard error goes
/// as 1/sqrt(n), and t(n - 1) shrinks too, so `n (half / target)^2` is an
/// upper estimate (never below `n + 1` while `half > target`).
pub fn pairs_needed(n: usize, half: f64, target: f64) -> Option<usize> {
    if !(half.is_finite() && target > 0.0) || n < 2 {
        return None;
    }
    if half <= target {
        return Some(n);
    }
    let est = (n as f64 * (half / target).powi(2)).ceil();
    (est < 1e9).then(|| (est as usize).max(n + 1))
}

/// Parses a duration: `90`, `90s`, `15m`, `1h`, `1h30m`.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let bad = || format!("bad duration {s:?}: use e.g. 90s, 15m, 1h30m");
    let s = s.trim();
    if s.is_empty() {
        return Err(bad());
    }
    if let Ok(secs) = s.parse::<u64>() {
        return Ok(std::time::Duration::from_secs(secs));
    }
    let (mut total, mut num) = (0u64, String::new());
    for c in s.chars() {
        if c.is_ascii_digit() {
            num.push(c);
            continue;
        }
        let mult = match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            _ => return Err(bad()),
        };
        let v: u64 = num.parse().map_err(|_| bad())?;
        total = v
            .checked_mul(mult)
            .and_then(|x| total.checked_add(x))
            .ok_or_else(bad)?;
        num.clear();
    }
    if !num.is_empty() {
        return Err(bad());
    }
    Ok(std::time::Duration::from_secs(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary() {
        let s = Summary::of(&[1.0, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!(s.n, 4);
        assert_eq!(s.min, 1.0);
        assert_eq!(s.max, 4.0);
        assert!((s.avg - 2.5).abs() < 1e-12);
        assert!((s.sdev - 1.290_994_448_735_805_6).abs() < 1e-9);
        assert!((s.spread() - 1.2).abs() < 1e-12);
        assert!(Summary::of(&[]).is_none());
        assert_eq!(Summary::of(&[5.0]).unwrap().sdev, 0.0);
        assert!((diff_pct(101.0, 100.0) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn t_quantiles() {
        assert!((t_975(1) - 12.706).abs() < 1e-9);
        assert!((t_975(30) - 2.042).abs() < 1e-9);
        // Exact values: df 40 -> 2.0211, df 120 -> 1.9799.
        assert!((t_975(40) - 2.0211).abs() < 1e-3, "{}", t_975(40));
        assert!((t_975(120) - 1.9799).abs() < 1e-3, "{}", t_975(120));
        assert!(t_975(0).is_infinite());
    }

    #[test]
    fn ratio_interval() {
        // Ratios of exactly 1.01: the interval is a point at +1 %.
        let pairs: Vec<(f64, f64)> = (1..=10)
            .map(|i| (f64::from(i), f64::from(i) * 1.01))
            .collect();
        let r = RatioCi::of(&pairs).unwrap();
        assert_eq!(r.n, 10);
        assert!((r.mean_pct - 1.0).abs() < 1e-9);
        assert!(r.half_width_pct() < 1e-9);
        assert!(
            r.verdict("B", 0.3).starts_with("B costs +1.00 %"),
            "{}",
            r.verdict("B", 0.3)
        );
        // Ratios 0.99 and 1.01 alternating: centred on ~0, wide.
        let pairs: Vec<(f64, f64)> = (0..10)
            .map(|i| (1.0, if i % 2 == 0 { 0.99 } else { 1.01 }))
            .collect();
        let r = RatioCi::of(&pairs).unwrap();
        assert!(r.lo_pct < 0.0 && r.hi_pct > 0.0);
        assert!(
            r.verdict("B", 0.3).starts_with("inconclusive"),
            "{}",
            r.verdict("B", 0.3)
        );
        assert!(
            r.verdict("B", 5.0)
                .starts_with("no overhead detectable at ±5 %")
        );
        // Faster.
        let r = RatioCi::of(&[(1.0, 0.9), (2.0, 1.8), (3.0, 2.71)]).unwrap();
        assert!(r.verdict("B", 0.3).starts_with("B is faster"));
        // Too few or unusable pairs.
        assert!(RatioCi::of(&[(1.0, 1.0)]).is_none());
        assert!(RatioCi::of(&[(0.0, 1.0), (1.0, f64::NAN), (1.0, 1.0)]).is_none());
    }

    /// Known samples, known interval: log ratios 0.01, 0.02, 0.03 have
    /// mean 0.02, sd 0.01, standard error 0.01/sqrt(3) = 0.0057735; with
    /// t(2) = 4.303 the half-width is 0.0248434, so the interval is
    /// exp(0.02 ± 0.0248434) - 1 = -0.4832 % … +4.5862 %, mean +2.0201 %.
    #[test]
    fn ratio_interval_known_values() {
        let pairs: Vec<(f64, f64)> = [0.01f64, 0.02, 0.03]
            .iter()
            .zip([1.0, 5.0, 0.2])
            .map(|(l, base)| (base, base * l.exp()))
            .collect();
        let r = RatioCi::of(&pairs).unwrap();
        assert_eq!(r.n, 3);
        assert!((r.mean_pct - 2.0201).abs() < 1e-3, "{r:?}");
        assert!((r.lo_pct - -0.4832).abs() < 1e-3, "{r:?}");
        assert!((r.hi_pct - 4.5862).abs() < 1e-3, "{r:?}");
        // Ten pairs, ratios 1.003 and 1.001 alternating: log mean
        // 0.0019985, sd 0.0010536 (n - 1), se 0.00033317, t(9) = 2.262:
        // half 0.00075364 -> +0.1246 % … +0.2754 %: a cost, resolved at
        // ±0.3 %.
        let pairs: Vec<(f64, f64)> = (0..10)
            .map(|i| (2.0, 2.0 * if i % 2 == 0 { 1.003 } else { 1.001 }))
            .collect();
        let r = RatioCi::of(&pairs).unwrap();
        assert!((r.lo_pct - 0.1246).abs() < 1e-3, "{r:?}");
        assert!((r.hi_pct - 0.2754).abs() < 1e-3, "{r:?}");
        assert!(r.half_width_pct() < 0.3);
        assert_eq!(r.verdict("B", 0.3), "B costs +0.20 % ± 0.08 %");
    }

    #[test]
    fn goal_verdicts() {
        let ci = |mean: f64, lo: f64, hi: f64| RatioCi {
            n: 5,
            mean_pct: mean,
            lo_pct: lo,
            hi_pct: hi,
        };
        assert_eq!(
            ci(35.0, 33.0, 37.0).goal_verdict(1.40, 5.0),
            "meets ≤1.40×: 1.350× (95 % 1.330× … 1.370×)"
        );
        assert_eq!(
            ci(60.6, 55.0, 66.0).goal_verdict(1.50, 5.0),
            "misses ≤1.50×: 1.606× (95 % 1.550× … 1.660×; interval ±5.5 %, wider than the ±5 % wanted)"
        );
        assert!(
            ci(46.0, 40.0, 52.0)
                .goal_verdict(1.50, 5.0)
                .starts_with("undecided at ≤1.50×")
        );
    }

    #[test]
    fn pairs_to_reach_a_target() {
        // ±0.6 % after 10 pairs: ±0.3 % needs 4x the pairs.
        assert_eq!(pairs_needed(10, 0.6, 0.3), Some(40));
        assert_eq!(pairs_needed(10, 0.2, 0.3), Some(10));
        assert_eq!(pairs_needed(10, 0.301, 0.3), Some(11));
        assert_eq!(pairs_needed(1, 1.0, 0.3), None);
        assert_eq!(pairs_needed(5, f64::INFINITY, 0.3), None);
    }

    #[test]
    fn durations() {
        use std::time::Duration;
        assert_eq!(parse_duration("90").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("15m").unwrap(), Duration::from_secs(900));
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("45s").unwrap(), Duration::from_secs(45));
        for bad in ["", "m", "10x", "5m3", "-1"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
