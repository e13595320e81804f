//! Per-disk behaviour through the public API: (d) live changes keep tokens
//! and the queue, (e) removing limits releases at once, counters, group
//! moves.

mod common;
use common::*;
use corral_blkthrottle::{Decision, Limits, OpKind, Request, Throttle, ThrottleGroup, WaitCause};

fn wait(until: u64) -> Decision {
    Decision::Wait {
        until,
        cause: WaitCause::Disk,
    }
}

#[test]
fn live_change_keeps_tokens_and_queue() {
    let mut t = Throttle::new(&Limits::parse("iops=100,burst_ops=100").unwrap(), 0).unwrap();
    for _ in 0..60 {
        assert_eq!(t.poll(Request::read(1), 0), Decision::Admit);
    }
    // 40 earned tokens survive a change that keeps them under the new size
    t.set_limits(&Limits::parse("iops=1000,burst_ops=50").unwrap(), 0)
        .unwrap();
    for _ in 0..40 {
        assert_eq!(t.poll(Request::read(1), 0), Decision::Admit);
    }
    assert_eq!(t.poll(Request::read(1), 0), wait(MS));
    // half-way through a wait, lowering the rate keeps the half token earned
    t.set_limits(&Limits::parse("iops=10,burst_ops=50").unwrap(), MS / 2)
        .unwrap();
    assert_eq!(t.poll(Request::read(1), MS / 2), wait(MS / 2 + 50 * MS));
    // a smaller size clamps
    t.set_limits(&Limits::parse("iops=10,burst_ops=1").unwrap(), 10 * S)
        .unwrap();
    assert_eq!(t.poll(Request::read(1), 10 * S), Decision::Admit);
    assert_eq!(t.poll(Request::read(1), 10 * S), wait(10 * S + S / 10));
    // invalid limits are refused and change nothing
    assert!(
        t.set_limits(
            &Limits::parse("iops=5").unwrap().with_burst_bytes(7),
            10 * S
        )
        .is_err()
    );
    assert_eq!(t.limits(), Limits::parse("iops=10,burst_ops=1").unwrap());
}

trait WithBurst {
    fn with_burst_bytes(self, b: u64) -> Self;
}
impl WithBurst for Limits {
    fn with_burst_bytes(mut self, b: u64) -> Self {
        self.burst_bytes = Some(b);
        self
    }
}

#[test]
fn removing_limits_releases_at_once() {
    let mut t = Throttle::new(&Limits::parse("bps=1K,burst_bytes=1K").unwrap(), 0).unwrap();
    assert_eq!(t.poll(Request::write(1024), 0), Decision::Admit);
    assert_eq!(t.poll(Request::write(1 << 20), 0), wait(S));
    t.set_limits(&Limits::UNLIMITED, 1).unwrap();
    for _ in 0..1000 {
        assert_eq!(t.poll(Request::write(1 << 20), 1), Decision::Admit);
    }
    // a debt taken before is forgotten with the limit
    t.set_limits(&Limits::parse("bps=1K,burst_bytes=1K").unwrap(), 1)
        .unwrap();
    assert_eq!(t.poll(Request::write(1024), 1), Decision::Admit);
}

#[test]
fn counters() {
    let mut t = Throttle::new(&Limits::parse("iops=10,burst_ops=1").unwrap(), 0).unwrap();
    for _ in 0..3 {
        t.note_enqueued();
    }
    assert_eq!(t.stats().queue_depth, 3);
    assert_eq!(t.poll(Request::read(4096), 0), Decision::Admit);
    t.note_dequeued();
    assert_eq!(t.poll(Request::write(512), 0), wait(S / 10));
    assert_eq!(t.poll(Request::write(512), S / 20), wait(S / 10));
    assert_eq!(t.poll(Request::write(512), S / 10), Decision::Admit);
    t.note_dequeued();
    assert_eq!(t.poll(Request::other(), S / 10), wait(2 * S / 10));
    assert_eq!(t.poll(Request::other(), 3 * S / 10), Decision::Admit);
    t.note_dequeued();
    t.note_dequeued(); // one too many: ignored
    t.record_latency(OpKind::Read, 30_000);
    t.record_latency(OpKind::Write, 2 * S);
    let s = t.stats();
    assert_eq!((s.read.ops, s.read.bytes), (1, 4096));
    assert_eq!((s.write.ops, s.write.bytes), (1, 512));
    assert_eq!((s.other.ops, s.other.bytes), (1, 0));
    assert_eq!(s.throttled_requests, 2);
    assert_eq!(s.throttled_ns, S / 10 + 2 * S / 10);
    assert_eq!(s.queue_depth, 0);
    assert_eq!(s.read.latency.count(), 1);
    assert_eq!(s.read.latency.cumulative().nth(2), Some((50e-6, 1)));
    assert_eq!(s.write.latency.sum_seconds(), 2.0);
    assert_eq!(s.total_ops(), 3);
}

#[test]
fn group_counters_and_moves() {
    let g1 = ThrottleGroup::new("vm1", &Limits::parse("iops=10,burst_ops=1").unwrap(), 0).unwrap();
    let g2 = ThrottleGroup::new("gold", &Limits::UNLIMITED, 0).unwrap();
    let mut t = Throttle::new(&Limits::UNLIMITED, 0).unwrap();
    t.join_group(&g1, 100, None).unwrap();
    t.note_enqueued();
    t.note_enqueued();
    assert_eq!(g1.stats().queue_depth, 2);
    assert_eq!(t.poll(Request::read(8), 0), Decision::Admit);
    t.note_dequeued();
    assert_eq!(
        t.poll(Request::read(8), 0),
        Decision::Wait {
            until: S / 10,
            cause: WaitCause::Group
        }
    );
    t.record_latency(OpKind::Read, 1000);
    // move to another group live: the waiting request goes at once there
    t.join_group(&g2, 300, None).unwrap();
    assert_eq!(g1.member_count(), 0);
    assert_eq!(g1.stats().queue_depth, 0);
    assert_eq!(g2.stats().queue_depth, 1);
    assert_eq!(t.poll(Request::read(8), 1), Decision::Admit);
    t.note_dequeued();
    let s1 = g1.stats();
    assert_eq!((s1.read.ops, s1.read.bytes), (1, 8));
    assert_eq!(s1.read.latency.count(), 1);
    let s2 = g2.stats();
    assert_eq!((s2.read.ops, s2.queue_depth), (1, 0));
    let st = t.stats();
    assert_eq!(
        (st.read.ops, st.throttled_requests, st.throttled_ns),
        (2, 1, 1)
    );
    assert!(t.join_group(&g2, 0, None).is_err());
    assert!(t.set_weight(10_001).is_err());
    assert_eq!(t.group().map(|g| g.name()), Some("gold"));
    assert_eq!(t.weight(), Some(300));
    t.set_weight(250).unwrap();
    assert_eq!(t.weight(), Some(250));
    t.leave_group();
    assert_eq!(g2.member_count(), 0);
    assert_eq!(t.weight(), None);
}

/// A request the disk drops (device reset) gives its place in the group
/// up: the next member is not held back.
#[test]
fn cancel_frees_the_group() {
    let g =
        ThrottleGroup::new("g", &Limits::parse("bps=1000,burst_bytes=1000").unwrap(), 0).unwrap();
    let mut a = Throttle::new(&Limits::UNLIMITED, 0).unwrap();
    let mut b = Throttle::new(&Limits::UNLIMITED, 0).unwrap();
    a.join_group(&g, 100, None).unwrap();
    b.join_group(&g, 100, None).unwrap();
    assert_eq!(b.poll(Request::write(900), 0), Decision::Admit);
    // a waits for a full bucket (900 ms), reserving it
    assert!(
        matches!(a.poll(Request::write(5000), 0), Decision::Wait { until, .. } if until == 900 * MS)
    );
    assert!(matches!(
        b.poll(Request::write(100), 0),
        Decision::Wait { .. }
    ));
    a.cancel();
    assert_eq!(b.poll(Request::write(100), 0), Decision::Admit);
}

/// Admissions of a backlogged stream of `n`-byte reads over `horizon` ns when
/// every wait is polled `late` ns after the instant the throttle gave.
fn admitted_polling_late(limits: &str, n: u64, late: u64, horizon: u64) -> u64 {
    let mut t = Throttle::new(&Limits::parse(limits).unwrap(), 0).unwrap();
    let (mut now, mut count) = (0u64, 0u64);
    while now <= horizon {
        match t.poll(Request::read(n), now) {
            Decision::Admit => count += 1,
            Decision::Wait { until, .. } => now = until + late,
        }
    }
    count
}

#[test]
fn wait_slack_is_the_lateness_that_costs_nothing() {
    const K: u64 = 128 << 10;
    // A bucket one request deep: no slack, and any lateness costs rate.
    let mut t = Throttle::new(&Limits::parse("bps=10M,burst_bytes=128K").unwrap(), 0).unwrap();
    assert_eq!(t.poll(Request::read(K), 0), Decision::Admit);
    assert!(matches!(t.poll(Request::read(K), 0), Decision::Wait { .. }));
    assert_eq!(t.wait_slack(Request::read(K), 0), 0);
    let exact = admitted_polling_late("bps=10M,burst_bytes=128K", K, 0, 10 * S);
    let late = admitted_polling_late("bps=10M,burst_bytes=128K", K, 100_000, 10 * S);
    assert_eq!(
        exact,
        1 + 10 * (10 << 20) / K,
        "on time: the rate exactly (10M = 10 MiB/s)"
    );
    assert!(
        late < exact,
        "100 µs late on a one-request bucket loses: {late} vs {exact}"
    );

    // Four requests deep: 3 requests of headroom, 3 · 128 KiB / 10 MiB/s.
    let mut t = Throttle::new(&Limits::parse("bps=10M,burst_bytes=512K").unwrap(), 0).unwrap();
    for _ in 0..4 {
        assert_eq!(t.poll(Request::read(K), 0), Decision::Admit);
    }
    let slack = t.wait_slack(Request::read(K), 0);
    let headroom = 3 * K * S / (10 << 20);
    assert!(slack.abs_diff(headroom) <= 1, "{slack} vs {headroom}");
    // Polling late by less than the slack admits as many (but for the last
    // poll or two, which the lateness pushes past the horizon)...
    let on_time = admitted_polling_late("bps=10M,burst_bytes=512K", K, 0, 10 * S);
    let within = admitted_polling_late("bps=10M,burst_bytes=512K", K, slack / 2, 10 * S);
    assert!(on_time - within <= 2, "{within} vs {on_time}");
    // ...and late by more than the slack loses.
    let beyond = admitted_polling_late("bps=10M,burst_bytes=512K", K, slack * 2, 10 * S);
    assert!(beyond + 10 < on_time, "{beyond} vs {on_time}");
    // Unlimited: no bucket, no limit on lateness.
    let mut t = Throttle::new(&Limits::default(), 0).unwrap();
    assert_eq!(t.wait_slack(Request::read(K), 0), u64::MAX);
}
