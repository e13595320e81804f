//! The disk's control API: live limits and groups through the device (no
//! downcast), and the counters it publishes, read while the device is held.

use std::sync::mpsc;
use std::time::Duration;

use corral_blkthrottle::{DEFAULT_WEIGHT, Limits, Throttle, ThrottleGroup};

use super::tests::{BUF, harness};
use super::throttle::monotonic_ns;
use super::*;
use crate::bus::lock;

const OK: u8 = blk_status::OK;

fn read_4k(h: &mut crate::virtio::testing::Harness) {
    let (s, _) = h.req(request::T_IN, 0, &[(BUF, 4096, true)]);
    assert_eq!(s, OK);
}

#[test]
fn limits_and_group_change_live_and_are_published() {
    let (_t, mut h) = harness();
    let c = lock(&h.block).counters();
    assert!(c.limits().is_unlimited());
    assert_eq!(c.group(), None);
    // Unlimited on a disk without a throttle: nothing to install.
    lock(&h.block).set_limits(&Limits::default()).unwrap();
    read_4k(&mut h);
    assert_eq!(c.throttle_stats().read.ops, 0, "no throttle yet");

    let lim = Limits::parse("iops=1000,bps=10M").unwrap();
    lock(&h.block).set_limits(&lim).unwrap();
    assert_eq!(c.limits(), lim);
    read_4k(&mut h);

    let g = ThrottleGroup::new("class:gold", &Limits::default(), monotonic_ns()).unwrap();
    lock(&h.block)
        .set_group(Some((&g, DEFAULT_WEIGHT)))
        .unwrap();
    assert_eq!(c.group().as_deref(), Some("class:gold"));
    assert_eq!(c.group_weight(), Some(DEFAULT_WEIGHT));
    read_4k(&mut h);
    // The weight in the group changes live and is published.
    lock(&h.block).set_group_weight(300).unwrap();
    assert_eq!(c.group_weight(), Some(300));
    assert!(lock(&h.block).set_group_weight(0).is_err());
    assert!(lock(&h.block).set_group_weight(10_001).is_err());
    assert_eq!(c.group_weight(), Some(300));
    assert_eq!(g.member_count(), 1);

    // Limits the throttle refuses change nothing.
    let bad = Limits {
        burst_ops: Some(5),
        ..Limits::default()
    };
    assert!(lock(&h.block).set_limits(&bad).is_err());
    assert_eq!(c.limits(), lim);
    assert!(lock(&h.block).set_group(Some((&g, 0))).is_err(), "weight 0");

    // A throttle installed from outside counts on into the same counters.
    let t = Throttle::new(&Limits::default(), monotonic_ns()).unwrap();
    lock(&h.block).set_throttle(Some(Box::new(t)));
    assert_eq!(c.group(), None, "the new throttle is in no group");
    assert_eq!(c.group_weight(), None);
    assert!(c.limits().is_unlimited());
    read_4k(&mut h);

    let s = c.throttle_stats();
    assert_eq!((s.read.ops, s.read.bytes), (3, 3 * 4096), "{s:?}");
    assert_eq!(s.read.latency.count(), 3);
    assert_eq!(lock(&h.block).throttle_stats(), s);
    assert_eq!(g.stats().read.ops, 1, "the group saw the one request in it");
    let d = c.device();
    assert_eq!((d.read_ops, d.read_bytes), (4, 4 * 4096), "{d:?}");
    assert_eq!(d.io_errors + d.malformed + d.broken_rings, 0);
}

#[test]
fn counters_answer_while_the_device_is_held() {
    let (_t, mut h) = harness();
    lock(&h.block)
        .set_limits(&Limits::parse("iops=1000").unwrap())
        .unwrap();
    read_4k(&mut h);
    let c = lock(&h.block).counters();
    // The device thread holds the device's lock while it serves the queue
    // (preadv, the polling window): a reader elsewhere does not wait.
    let held = lock(&h.block);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send((c.device(), c.throttle_stats(), c.limits(), c.group()));
    });
    let got = rx.recv_timeout(Duration::from_secs(5));
    drop(held);
    let (dev, thr, lim, group) = got.expect("the counters answered while the device was held");
    assert_eq!(dev.read_ops, 1);
    assert_eq!(thr.read.ops, 1);
    assert_eq!(lim.iops, Some(1000));
    assert_eq!(group, None);
}
