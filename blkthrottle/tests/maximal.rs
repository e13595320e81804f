//! The bucket is the *maximal* rule under its window bound (crate docs,
//! "Lateness"): whenever it makes a request wait, admitting that request
//! then would put more than `b + r·(t − s)` units into some window `[s, t]`.
//! So a late poll loses only what every rule that keeps the bound must lose,
//! and "admitting at the due instant in virtual time" cannot recover more.
//! Checked on the fake clock with random rates, sizes, request streams and
//! poll lateness, and, for the one-request bucket of BENCHMARKS.md, that
//! on-time polls give the rate to the nanosecond.

mod common;
use common::*;
use corral_blkthrottle::{Decision, Limits, Nanos, Request, Throttle};
use proptest::prelude::*;

/// Scaled units (× 10⁹) of the largest window ending at `t` over `log`
/// (admissions of `units` each, sorted by time) plus `n` more at `t`,
/// minus what the bound `b + r·(t − s)` allows for it; positive means the
/// window would break the bound. Windows start at 0 (the bucket starts
/// full) or at an admission.
fn worst_excess(log: &[(Nanos, u64)], t: Nanos, n: u64, rate: u64, size: u64) -> i128 {
    let sc = S as i128;
    let mut starts: Vec<Nanos> = vec![0];
    starts.extend(log.iter().map(|e| e.0));
    let mut worst = i128::MIN;
    for s in starts {
        let inside: u64 = log
            .iter()
            .filter(|e| e.0 >= s && e.0 <= t)
            .map(|e| e.1)
            .sum();
        let used = (inside as i128 + n as i128) * sc;
        let allowed = size as i128 * sc + rate as i128 * (t - s) as i128;
        worst = worst.max(used - allowed);
    }
    worst
}

/// One backlogged stream of `sizes` (cycled) on a single-bucket limit,
/// each wait polled `lateness[i]` ns after the instant the throttle gave.
/// Returns the admissions and, for every refusal, (t, n, excess).
#[allow(clippy::type_complexity)]
fn run(
    l: &Limits,
    sizes: &[u64],
    lateness: &[u64],
    ops: bool,
    count: usize,
) -> (Vec<(Nanos, u64)>, Vec<(Nanos, u64, i128)>) {
    let (rate, size) = if ops {
        (l.iops.unwrap(), l.burst_ops.unwrap())
    } else {
        (l.bps.unwrap(), l.burst_bytes.unwrap())
    };
    let mut t = Throttle::new(l, 0).unwrap();
    let (mut log, mut refusals) = (Vec::new(), Vec::new());
    let mut now = 0;
    let mut polls = 0usize;
    while log.len() < count {
        assert!(polls < 100 * count, "no progress: {} admitted", log.len());
        let bytes = sizes[log.len() % sizes.len()];
        let n = if ops { 1 } else { bytes };
        match t.poll(Request::read(bytes), now) {
            Decision::Admit => log.push((now, n)),
            Decision::Wait { until, .. } => {
                refusals.push((now, n, worst_excess(&log, now, n, rate, size)));
                // Sometimes poll again before the instant, as a timer
                // armed early does; otherwise at it, plus the lateness.
                now = if polls % 5 == 4 && until > now + 1 {
                    now + (until - now) / 2
                } else {
                    until + lateness[polls % lateness.len()]
                };
                polls += 1;
            }
        }
    }
    (log, refusals)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Bytes buckets: every refusal is forced by the bound.
    #[test]
    fn every_byte_wait_is_forced_by_the_bound(
        rate in prop_oneof![1_000u64..=100_000, 100_000u64..=4_000_000_000],
        sizes in prop::collection::vec(1u64..=(1 << 20), 1..4),
        extra in prop_oneof![Just(0u64), 0u64..=(1 << 20)],
        lateness in prop::collection::vec(prop_oneof![Just(0u64), 0u64..=3_000_000], 1..6),
    ) {
        let size = sizes.iter().copied().max().unwrap() + extra;
        let l = Limits { bps: Some(rate), burst_bytes: Some(size), ..Default::default() };
        let (log, refusals) = run(&l, &sizes, &lateness, false, 60);
        prop_assert!(!refusals.is_empty() || log.len() == 60);
        for (t, n, excess) in refusals {
            prop_assert!(excess > 0, "refused {} units at {} though every window keeps the bound ({})", n, t, excess);
        }
        check_window_bound(&l, &log.iter().map(|e| (e.0, Request::read(e.1))).collect::<Vec<_>>(), 0);
    }

    /// Ops buckets, down to one op deep.
    #[test]
    fn every_op_wait_is_forced_by_the_bound(
        rate in 1u64..=1_000_000,
        size in prop_oneof![Just(1u64), 1u64..=50],
        lateness in prop::collection::vec(prop_oneof![Just(0u64), 0u64..=3_000_000], 1..6),
    ) {
        let l = Limits { iops: Some(rate), burst_ops: Some(size), ..Default::default() };
        let (_, refusals) = run(&l, &[4096], &lateness, true, 80);
        for (t, n, excess) in refusals {
            prop_assert!(excess > 0, "refused {} op at {}: excess {}", n, t, excess);
        }
    }
}

/// The one-request bucket of BENCHMARKS.md polled exactly on time: the k-th
/// request after the first is admitted at ⌈k · n / r⌉ ns, so the rate over
/// any span of it is the limit within one nanosecond per span (±0.1 % is
/// then only a question of the device polling on time).
#[test]
fn one_request_bucket_on_time_is_exact() {
    const K: u64 = 128 << 10;
    let rate = 10u64 << 20;
    let l = Limits::parse("bps=10M,burst_bytes=128K").unwrap();
    let (log, _) = run(&l, &[K], &[0], false, 200);
    for (k, (t, _)) in log.iter().enumerate() {
        let due = (k as u128 * K as u128 * S as u128).div_ceil(rate as u128) as u64;
        assert_eq!(*t, due, "request {k}");
    }
    // And 100 µs of lateness per poll costs exactly 100 µs per request:
    // every admission is n/r after the previous one, never closer.
    let (late, _) = run(&l, &[K], &[100_000], false, 200);
    for w in late.windows(2) {
        let gap = w[1].0 - w[0].0;
        let nr = K * S / rate;
        assert!(gap >= nr && gap <= nr + 100_001, "gap {gap}");
    }
}
