//! Property tests with a fake clock: (a) the window bound, (f) no deadlock
//! with oversize requests, for random limits and request streams, on single
//! disks and on groups of disks polling on their own timers.

mod common;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::*;
use corral_blkthrottle::{Decision, Limits, Nanos, OpKind, Request, Throttle, ThrottleGroup};
use proptest::prelude::*;

fn rate_bytes() -> impl Strategy<Value = Option<u64>> {
    prop::option::weighted(0.4, prop_oneof![1u64..=10_000, 10_000u64..=4_000_000_000])
}

fn rate_ops() -> impl Strategy<Value = Option<u64>> {
    prop::option::weighted(0.4, prop_oneof![1u64..=100, 100u64..=1_000_000])
}

prop_compose! {
    fn limits()(
        bps in rate_bytes(), rbps in rate_bytes(), wbps in rate_bytes(),
        iops in rate_ops(), riops in rate_ops(), wiops in rate_ops(),
        burst_bytes in prop::option::of(1u64..=4_000_000),
        burst_ops in prop::option::of(1u64..=1000),
        onetime_bytes in prop::option::weighted(0.3, 1u64..=4_000_000),
        onetime_ops in prop::option::weighted(0.3, 1u64..=100),
    ) -> Limits {
        let mut l = Limits { bps, rbps, wbps, iops, riops, wiops, burst_bytes, burst_ops,
                             onetime_bytes, onetime_ops };
        // drop bursts that have no rate to belong to
        if l.bps.or(l.rbps).or(l.wbps).is_none() { l.burst_bytes = None; l.onetime_bytes = None; }
        if l.iops.or(l.riops).or(l.wiops).is_none() { l.burst_ops = None; l.onetime_ops = None; }
        l
    }
}

fn request() -> impl Strategy<Value = Request> {
    let bytes = prop_oneof![
        Just(512u64),
        Just(4096),
        Just(65536),
        Just(1 << 20),
        1u64..=(4 << 20)
    ];
    (0u8..3, bytes).prop_map(|(k, bytes)| match k {
        0 => Request::read(bytes),
        1 => Request::write(bytes),
        _ => Request::other(),
    })
}

/// (arrival gap in ns, request)
fn stream() -> impl Strategy<Value = Vec<(Nanos, Request)>> {
    prop::collection::vec(
        (
            prop_oneof![Just(0u64), 0u64..=2_000_000, 0u64..=200_000_000],
            request(),
        ),
        1..60,
    )
}

struct Disk {
    t: Throttle,
    arrivals: VecDeque<(Nanos, Request)>,
    queue: VecDeque<Request>,
    timer: Option<Nanos>,
    log: Vec<(Nanos, Request)>,
    /// Set by the group's waker.
    woken: Arc<AtomicBool>,
}

/// Event simulation: each disk receives its stream, polls its head at
/// arrivals and when its timer (granularity `grid`, plus `late` ns) fires.
/// Returns the total number of polls. Panics if a wait instant is not in the
/// future or if the simulation does not finish (a deadlock).
fn simulate(disks: &mut [Disk], grid: u64, late: u64) -> u64 {
    let mut polls = 0u64;
    let mut now: Nanos = 0;
    loop {
        for d in disks.iter_mut() {
            if d.woken.swap(false, Ordering::Relaxed) {
                d.timer = None;
            }
            while d.arrivals.front().is_some_and(|a| a.0 <= now) {
                let (_, r) = d.arrivals.pop_front().unwrap();
                d.queue.push_back(r);
                d.t.note_enqueued();
            }
            if d.timer.is_some_and(|t| t > now) {
                continue;
            }
            d.timer = None;
            while let Some(&r) = d.queue.front() {
                polls += 1;
                assert!(polls < 2_000_000, "no progress: deadlock?");
                match d.t.poll(r, now) {
                    Decision::Admit => {
                        d.queue.pop_front();
                        d.t.note_dequeued();
                        d.log.push((now, r));
                    }
                    Decision::Wait { until, .. } => {
                        assert!(until > now, "wait instant {until} not after {now}");
                        d.timer = Some(quantize(until, grid) + late);
                        break;
                    }
                }
            }
        }
        let next = disks
            .iter()
            .flat_map(|d| {
                let woken = d.woken.load(Ordering::Relaxed).then_some(now);
                d.timer
                    .into_iter()
                    .chain(d.arrivals.front().map(|a| a.0))
                    .chain(woken)
            })
            .min();
        match next {
            Some(t) => now = t,
            None => return polls,
        }
    }
}

fn make_disk(l: &Limits, stream: &[(Nanos, Request)]) -> Disk {
    let mut at = 0;
    Disk {
        t: Throttle::new(l, 0).unwrap(),
        arrivals: stream
            .iter()
            .map(|&(gap, r)| {
                at += gap;
                (at, r)
            })
            .collect(),
        queue: VecDeque::new(),
        timer: None,
        log: Vec::new(),
        woken: Arc::new(AtomicBool::new(false)),
    }
}

fn grid() -> impl Strategy<Value = u64> {
    prop_oneof![Just(1u64), Just(1000), Just(MS)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// (a) For every window [t, t+T]: admitted ≤ r·(T + 1 ns) + O + max(b, M),
    /// per bucket. (f) Every request is admitted; every wait is in the future.
    #[test]
    fn single_disk_window_bound(l in limits(), s in stream(), grid in grid(), late in prop_oneof![Just(0u64), 0u64..=3_000_000]) {
        let mut disks = [make_disk(&l, &s)];
        simulate(&mut disks, grid, late);
        let d = &disks[0];
        prop_assert_eq!(d.log.len(), s.len());
        prop_assert!(d.queue.is_empty());
        let w = check_window_bound(&l, &d.log, 0);
        if std::env::var("SHOW_SLACK").is_ok() { eprintln!("worst {w:.4}"); }
        let st = d.t.stats();
        prop_assert_eq!(st.total_ops(), s.len() as u64);
        prop_assert_eq!(st.queue_depth, 0);
        let bytes: u64 = s.iter().map(|(_, r)| r.charged_bytes()).sum();
        prop_assert_eq!(st.total_bytes(), bytes);
    }

    /// Same on 1–4 disks (own random limits) sharing a group: the bound holds
    /// for each disk's buckets, and for the group's buckets over all disks up
    /// to the disks' own polling lateness (the group charges when it grants;
    /// a disk sees the grant when it polls).
    #[test]
    fn group_window_bound(
        gl in limits(),
        disks in prop::collection::vec((limits(), stream()), 1..5),
        grid in grid(),
        late in prop_oneof![Just(0u64), 0u64..=3_000_000],
    ) {
        let group = ThrottleGroup::new("g", &gl, 0).unwrap();
        let mut ds: Vec<Disk> = disks.iter().map(|(l, s)| {
            let mut d = make_disk(l, s);
            let w = d.woken.clone();
            d.t.join_group(&group, 100, Some(Arc::new(move || w.store(true, Ordering::Relaxed)))).unwrap();
            d
        }).collect();
        simulate(&mut ds, grid, late);
        let mut all = Vec::new();
        for (d, (l, s)) in ds.iter().zip(&disks) {
            prop_assert_eq!(d.log.len(), s.len());
            check_window_bound(l, &d.log, 0);
            all.extend_from_slice(&d.log);
        }
        all.sort_by_key(|e| e.0);
        // Disks poll at most `grid - 1 + late` after the instant they were
        // told, so they pick up grants at most that late.
        check_window_bound(&gl, &all, grid - 1 + late);
        let gs = group.stats();
        prop_assert_eq!(gs.total_ops(), all.len() as u64);
        prop_assert_eq!(gs.queue_depth, 0);
    }

    /// (f) Requests far larger than every bucket are admitted one after the
    /// other, each as soon as the buckets are full again: never deadlocked,
    /// at most two polls per request when polled at the returned instants.
    #[test]
    fn oversize_never_deadlocks(
        rate in 1u64..=1_000_000, size in 1u64..=1000, n in 1usize..40,
        big in 1_000u64..=100_000_000, write in any::<bool>(),
    ) {
        let l = Limits { bps: Some(rate), burst_bytes: Some(size), iops: Some(rate), burst_ops: Some(1),
                         ..Default::default() };
        let req = if write { Request::write(big) } else { Request::read(big) };
        let mut d = make_disk(&l, &vec![(0, req); n]);
        let polls = simulate(std::slice::from_mut(&mut d), 1, 0);
        prop_assert_eq!(d.log.len(), n);
        prop_assert!(polls <= 2 * n as u64, "{} polls for {} requests", polls, n);
        // each one waits exactly for the debt of the previous one to be repaid
        for w in d.log.windows(2) {
            let need = (big as u128 * S as u128).div_ceil(rate as u128) as u64;
            prop_assert!(w[1].0 - w[0].0 <= need + 1);
            prop_assert!(w[1].0 - w[0].0 + 1 >= need);
        }
        let _ = OpKind::Read;
    }
}
