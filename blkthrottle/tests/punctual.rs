//! The caller's half of a tight wait ([`Punctual`]) on the fake clock: a
//! device loop that follows the planner's steps while every timer wake-up
//! is late by an injected amount. The window bound holds whatever the
//! lateness; a one-request stream loses exactly the admission lateness the
//! planner counts; and once the margin has learnt the lateness (a few
//! wake-ups), the rate is the limit's within ±0.1 %, down to buckets one
//! request deep with milliseconds of lateness per wake-up.

mod common;
use common::*;
use corral_blkthrottle::punctual::{EARLY_MAX_NS, EARLY_MIN_NS, WINDOW};
use corral_blkthrottle::{
    Decision, Lateness, Limits, Nanos, Punctual, Request, Step, TIGHT_SLACK_NS, Throttle,
};
use proptest::prelude::*;

struct Run {
    /// Admission instants.
    log: Vec<Nanos>,
    /// Time spent waiting on the clock.
    spun: Nanos,
    lateness: Lateness,
    /// Timer wake-ups.
    wakes: usize,
}

/// A backlogged stream of `req` on `l`, `count` admissions, the device
/// loop of `devices/src/virtio/blk/queue.rs` on a fake clock: tight waits
/// follow the planner (a timer armed for `at` runs `late(i)` ns after it,
/// i counting wake-ups; a spin ends on the due nanosecond), other waits
/// sleep to the instant the throttle gave, late by the same.
fn run(
    l: &Limits,
    req: Request,
    count: usize,
    boost: bool,
    mut late: impl FnMut(usize) -> Nanos,
) -> Run {
    let mut t = Throttle::new(l, 0).unwrap();
    let mut p = Punctual::new(boost);
    let (mut now, mut spun, mut wakes) = (0, 0, 0);
    let mut log = Vec::with_capacity(count);
    while log.len() < count {
        assert!(wakes < 10 * count, "no progress: {} admitted", log.len());
        let until = match t.poll(req, now) {
            Decision::Admit => {
                p.admitted(now);
                log.push(now);
                continue;
            }
            Decision::Wait { until, .. } => until,
        };
        assert!(until > now);
        if t.wait_slack(req, now) >= TIGHT_SLACK_NS {
            p.abandon();
            now = until + late(wakes);
            wakes += 1;
            continue;
        }
        match p.plan(now, until) {
            Step::Fine { at, .. } => {
                assert!(at > now);
                now = at + late(wakes);
                wakes += 1;
                p.woke(at, now);
            }
            Step::Spin { until, .. } => {
                assert!(until - now <= p.cap(), "spun {} ns", until - now);
                spun += until - now;
                now = until;
            }
        }
    }
    Run {
        log,
        spun,
        lateness: p.lateness(),
        wakes,
    }
}

/// (rate, units per request) of the one bucket of `l`.
fn bucket(l: &Limits, req: &Request) -> (u64, u64) {
    match l.bps {
        Some(r) => (r, req.bytes),
        None => (l.iops.unwrap(), 1),
    }
}

/// Rate error (fraction) of admissions `from..` against the limit.
fn rate_error(log: &[Nanos], from: usize, rate: u64, units: u64) -> f64 {
    let span = (log[log.len() - 1] - log[from]) as f64;
    let got = ((log.len() - 1 - from) as u64 * units) as f64 / (span / S as f64);
    got / rate as f64 - 1.0
}

fn one_request_deep(ops: bool, rate: u64, bytes: u64) -> (Limits, Request) {
    let l = if ops {
        Limits {
            iops: Some(rate),
            burst_ops: Some(1),
            ..Default::default()
        }
    } else {
        Limits {
            bps: Some(rate),
            burst_bytes: Some(bytes),
            ..Default::default()
        }
    };
    (l, Request::read(bytes))
}

/// `check_window_bound` over the run's admissions.
fn bound_holds(l: &Limits, req: Request, log: &[Nanos]) {
    let log: Vec<(Nanos, Request)> = log.iter().map(|&t| (t, req)).collect();
    check_window_bound(l, &log, 0);
}

/// The loss identity: the span of a one-request stream is the ideal one
/// (`k·n/r` for k gaps) plus the admission lateness, within the rounding
/// of one nanosecond per admission.
fn loss_is_the_lateness(r: &Run, rate: u64, units: u64) {
    let k = (r.log.len() - 1) as u128;
    let ideal = k * units as u128 * S as u128 / rate as u128;
    let span = (r.log[r.log.len() - 1] - r.log[0]) as u128;
    let with_late = ideal + r.lateness.total_ns as u128;
    assert!(
        span + k >= with_late && span <= with_late + k,
        "span {span} ns, ideal {ideal} + lateness {} (count {})",
        r.lateness.total_ns,
        r.lateness.count
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// One request deep, every wake-up late by one of a few values
    /// (cycled) of up to 3 ms with the boost, or up to 750 µs without it
    /// (the margins the planner may take then): after the planner's first
    /// wake-ups the rate is within ±0.1 % (and exact to the nanosecond
    /// where the margin covers every lateness); the bound always holds.
    #[test]
    fn one_request_bucket_keeps_its_rate_under_injected_lateness(
        ops in any::<bool>(),
        boost in any::<bool>(),
        per_request_us in 100u64..=100_000,
        bytes in prop_oneof![Just(128u64 << 10), 4096u64..=(1 << 20)],
        late in prop::collection::vec(0u64..=1000, 1..8),
    ) {
        let most = if boost { 3_000_000 } else { EARLY_MAX_NS * 3 / 4 };
        let late: Vec<u64> = late.iter().map(|&x| x * most / 1000).collect();
        let per_request_ns = per_request_us * 1000;
        let rate = if ops { S / per_request_ns } else { bytes * S / per_request_ns };
        prop_assume!(rate > 0);
        let (l, req) = one_request_deep(ops, rate, bytes);
        let (rate, units) = bucket(&l, &req);
        let r = run(&l, req, 300, boost, |i| late[i % late.len()]);
        bound_holds(&l, req, &r.log);
        loss_is_the_lateness(&r, rate, units);
        let err = rate_error(&r.log, 4 * WINDOW, rate, units);
        prop_assert!(err.abs() <= 0.001, "rate {:+.4} % (lateness {:?}, {} wake-ups, spun {} ns)",
            err * 100.0, r.lateness, r.wakes, r.spun);
    }

    /// Random lateness with rare long spikes (up to 20 ms: the host's
    /// hypervisor taking the CPU), on buckets one request deep and deeper:
    /// the bound holds, a one-request stream loses exactly what the planner
    /// counts as admission lateness, and a spin never lasts longer than the
    /// margin's cap.
    #[test]
    fn time_lost_is_the_admission_lateness(
        boost in any::<bool>(),
        rate in 1_000_000u64..=100_000_000,
        bytes in 4096u64..=(1 << 20),
        extra in prop_oneof![Just(0u64), 0u64..=(4 << 20)],
        body_us in 0u64..=500,
        spike_every in 2u64..=64,
        seed in any::<u64>(),
    ) {
        let l = Limits { bps: Some(rate), burst_bytes: Some(bytes + extra), ..Default::default() };
        let req = Request::read(bytes);
        let mut x = seed | 1;
        let r = run(&l, req, 200, boost, |_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let spike = (x >> 40) % spike_every == 0;
            if spike { (x >> 8) % 20_000_000 } else { (x >> 8) % (body_us * 1000 + 1) }
        });
        bound_holds(&l, req, &r.log);
        if extra == 0 {
            loss_is_the_lateness(&r, rate, bytes);
        }
    }
}

/// The fault of BENCHMARKS.md ("Block throttling"): a bucket one request
/// deep (`bps=10M,burst_bytes=128K`, 128 KiB requests) whose device thread
/// wakes 2 ms late every time. Its polls used to land late by what the
/// 1 ms early margin did not cover (−7.4 % of the rate); the boosted
/// planner learns the lateness at the first wake-up and takes a margin
/// that covers it.
#[test]
fn two_ms_of_lateness_per_wake_up_costs_the_rate_nothing() {
    let (l, req) = one_request_deep(false, 10 << 20, 128 << 10);
    let r = run(&l, req, 400, true, |_| 2 * MS);
    bound_holds(&l, req, &r.log);
    loss_is_the_lateness(&r, 10 << 20, 128 << 10);
    let err = rate_error(&r.log, 0, 10 << 20, 128 << 10);
    assert!(err.abs() <= 0.001, "rate {:+.4} %", err * 100.0);
    // Only the first wait was late: the margin was not learnt yet
    // (2 ms − EARLY_MIN_NS).
    assert_eq!(
        r.lateness.total_ns,
        2 * MS - EARLY_MIN_NS,
        "{:?}",
        r.lateness
    );
    // What it costs: 0.52 ms on the clock per 12.5 ms request (the margin
    // is 2 ms × 5/4 + 20 µs).
    assert!(r.spun <= 399 * 520_000, "spun {} ns", r.spun);
}

/// The same host without the boost (no real-time priority to be had): the
/// margin is capped at `EARLY_MAX_NS` (spinning longer at normal priority
/// gets the thread preempted on a busy host), so lateness beyond it costs
/// what it exceeds, no more — and exactly that.
#[test]
fn without_the_boost_lateness_beyond_the_cap_costs_its_excess() {
    let (l, req) = one_request_deep(false, 10 << 20, 128 << 10);
    let r = run(&l, req, 200, false, |_| 2 * MS);
    bound_holds(&l, req, &r.log);
    loss_is_the_lateness(&r, 10 << 20, 128 << 10);
    // The first wait woke EARLY_MIN_NS early (nothing learnt yet), every
    // later one EARLY_MAX_NS early.
    let first = 2 * MS - EARLY_MIN_NS;
    assert_eq!(r.lateness.count, 199);
    assert_eq!(
        r.lateness.total_ns,
        first + 198 * (2 * MS - EARLY_MAX_NS),
        "{:?}",
        r.lateness
    );
}
