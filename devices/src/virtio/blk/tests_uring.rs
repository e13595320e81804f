//! The io_uring engine: requests in flight, the throttle's accounting with
//! requests in flight (fake clock, both engines), FLUSH ordering, and
//! draining on reset.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use vm_memory::{Bytes, GuestAddress};

use super::tests::{BUF, disk_file, disk_file_pattern, engines};
use super::throttle::{self, Decision, Nanos, OpKind, ThrottleRequest};
use super::*;
use crate::bus::lock;
use crate::virtio::testing::*;

const MIB: usize = 1 << 20;
/// Request headers, 16 bytes each (up to 64), and status bytes (up to 64).
const HDR: u64 = DATA_ADDR + 0x400;
const STATUS: u64 = DATA_ADDR + 0x800;

/// A real throttle on a fake clock: the device's `now` is ignored.
struct FakeClock {
    inner: corral_blkthrottle::Throttle,
    clock: Arc<AtomicU64>,
    polls: Arc<Mutex<Vec<ThrottleRequest>>>,
    latencies: Arc<AtomicU64>,
}

impl RequestThrottle for FakeClock {
    fn poll(&mut self, req: ThrottleRequest, _now: Nanos) -> Decision {
        self.polls.lock().unwrap().push(req);
        self.inner.poll(req, self.clock.load(Ordering::Relaxed))
    }
    fn cancel(&mut self) {
        self.inner.cancel()
    }
    fn record_latency(&mut self, kind: OpKind, ns: Nanos) {
        self.latencies.fetch_add(1, Ordering::Relaxed);
        self.inner.record_latency(kind, ns)
    }
    fn set_limits(&mut self, l: &throttle::Limits, _: Nanos) -> Result<(), throttle::LimitsError> {
        let now = self.clock.load(Ordering::Relaxed);
        RequestThrottle::set_limits(&mut self.inner, l, now)
    }
    fn set_group(
        &mut self,
        g: Option<(&throttle::ThrottleGroup, u32)>,
    ) -> Result<(), throttle::LimitsError> {
        RequestThrottle::set_group(&mut self.inner, g)
    }
    fn set_weight(&mut self, w: u32) -> Result<(), throttle::LimitsError> {
        RequestThrottle::set_weight(&mut self.inner, w)
    }
    fn limits(&self) -> throttle::Limits {
        RequestThrottle::limits(&self.inner)
    }
    fn group_name(&self) -> Option<String> {
        RequestThrottle::group_name(&self.inner)
    }
    fn group_weight(&self) -> Option<u32> {
        RequestThrottle::group_weight(&self.inner)
    }
    fn count_into(&mut self, sink: Arc<throttle::SharedStats>) {
        RequestThrottle::count_into(&mut self.inner, sink)
    }
}

/// A direct (O_DIRECT) disk where the file system allows it: its requests
/// stay in flight on the io_uring engine (they wait for the device).
fn direct_harness(engine: IoEngine, mem: usize) -> (vmm_sys_util::tempfile::TempFile, Harness) {
    let (t, p) = disk_file(4 * MIB);
    t.as_file().sync_all().unwrap();
    let disk = DiskFile::open(&p, false, true)
        .or_else(|_| DiskFile::open(&p, false, false))
        .unwrap();
    (t, Harness::with_engine(disk, mem, 0, engine))
}

/// Posts `n` reads of `len` bytes (sector `i * len / 512` into
/// `BUF + i * len`), without notifying.
fn post_reads(h: &mut Harness, n: u64, len: u32) -> Vec<u16> {
    (0..n)
        .map(|i| {
            write_header(
                &h.mem,
                HDR + 16 * i,
                request::T_IN,
                i * u64::from(len) / 512,
            );
            h.mem.write_obj(0xffu8, GuestAddress(STATUS + i)).unwrap();
            h.ring.submit(&[
                (HDR + 16 * i, 16, false),
                (BUF + i * u64::from(len), len, true),
                (STATUS + i, 1, true),
            ])
        })
        .collect()
}

/// 32 × 4 KiB reads posted at once against `bps=1M,burst_bytes=64K` on a
/// fake clock: returns how many had completed after each clock step of one
/// request's worth of tokens, and the throttle's byte count.
fn throttled_run(engine: IoEngine) -> (Vec<u16>, u64, u64) {
    let (_t, mut h) = direct_harness(engine, 4 * MIB);
    let t0: Nanos = 1_000_000_000;
    let clock = Arc::new(AtomicU64::new(t0));
    let polls = Arc::new(Mutex::new(Vec::new()));
    let latencies = Arc::new(AtomicU64::new(0));
    let limits = corral_blkthrottle::Limits {
        bps: Some(1 << 20),
        burst_bytes: Some(64 << 10),
        ..Default::default()
    };
    lock(&h.block).set_throttle(Some(Box::new(FakeClock {
        inner: corral_blkthrottle::Throttle::new(&limits, t0).unwrap(),
        clock: clock.clone(),
        polls: polls.clone(),
        latencies: latencies.clone(),
    })));
    post_reads(&mut h, 32, 4096);
    let mut done = Vec::new();
    h.process();
    done.push(h.ring.used_idx());
    // One 4 KiB request's worth of tokens at 1 MiB/s: 3.90625 ms.
    let step = 1_000_000_000u64 * 4096 / (1 << 20);
    for _ in 0..8 {
        clock.fetch_add(step, Ordering::Relaxed);
        let mut b = lock(&h.block);
        b.throttle_changed();
        b.wait_io();
        drop(b);
        done.push(h.ring.used_idx());
    }
    // Every completed read landed, whatever order it completed in.
    for i in 0..u64::from(h.ring.used_idx()) {
        let (head, len) = h.ring.used(i as u16);
        assert_eq!(len, 4097);
        let k = u64::from(head) / 3;
        assert_eq!(read_u8(&h.mem, STATUS + k), blk_status::OK);
        let mut got = vec![0u8; 4096];
        h.mem
            .read_slice(&mut got, GuestAddress(BUF + k * 4096))
            .unwrap();
        assert_eq!(got, disk_file_pattern(k as usize * 4096, 4096), "read {k}");
    }
    // Admission in ring order: each request polled until admitted, and the
    // polls are in the order the requests were posted (all 4 KiB reads).
    assert!(
        polls
            .lock()
            .unwrap()
            .iter()
            .all(|p| *p == ThrottleRequest::read(4096))
    );
    let st = lock(&h.block).throttle_stats();
    (done, st.read.bytes, latencies.load(Ordering::Relaxed))
}

#[test]
fn throttle_stays_exact_with_requests_in_flight() {
    let runs: Vec<_> = engines().into_iter().map(throttled_run).collect();
    for (done, bytes, latencies) in &runs {
        // The burst (64 KiB: 16 requests) at once, then exactly one per
        // step of the fake clock.
        let want: Vec<u16> = (0..9).map(|i| 16 + i).collect();
        assert_eq!(done, &want);
        // The throttle charged exactly what completed, once each.
        assert_eq!(*bytes, u64::from(done[8]) * 4096);
        assert_eq!(*latencies, u64::from(done[8]));
    }
    // Both engines account identically.
    assert!(runs.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn uring_keeps_requests_in_flight_and_reset_drains_them() {
    if !uring::supported() {
        eprintln!("skipping: no io_uring here");
        return;
    }
    let (_t, mut h) = direct_harness(IoEngine::Uring, 8 * MIB);
    post_reads(&mut h, 32, 64 << 10);
    lock(&h.block).process_queue();
    let in_flight = lock(&h.block).in_flight();
    // Direct reads wait for the host's disk: the pass did not.
    assert!(in_flight > 1, "{in_flight} in flight after one pass");
    let before = h.ring.used_idx();
    // A reset (the driver writes status 0) waits for every one of them and
    // forgets them: none lands in a used ring afterwards.
    h.w32(0x70, 0);
    assert_eq!(lock(&h.block).in_flight(), 0);
    let after = h.ring.used_idx();
    assert!(after <= 32);
    assert!(after >= before);
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(h.ring.used_idx(), after, "a completion after the reset");
    // Brought up again, the device serves normally.
    h.bring_up(0, 256);
    post_reads(&mut h, 4, 4096);
    h.process();
    assert_eq!(h.ring.used_idx(), 4);
}

#[test]
fn flush_completes_after_the_writes_before_it() {
    for engine in engines() {
        let (t, mut h) = direct_harness(engine, 8 * MIB);
        h.mem
            .write_slice(&[0x5a; 64 << 10], GuestAddress(BUF))
            .unwrap();
        for i in 0..16u64 {
            write_header(&h.mem, HDR + 16 * i, request::T_OUT, i * 128);
            h.ring.submit(&[
                (HDR + 16 * i, 16, false),
                (BUF, 64 << 10, false),
                (STATUS + i, 1, true),
            ]);
        }
        write_header(&h.mem, HDR + 16 * 16, request::T_FLUSH, 0);
        let flush = h
            .ring
            .submit(&[(HDR + 16 * 16, 16, false), (STATUS + 16, 1, true)]);
        h.process();
        assert_eq!(h.ring.used_idx(), 17);
        // The flush's used entry is the last: it started after every
        // write before it completed.
        assert_eq!(h.ring.used(16).0, u32::from(flush), "{engine}");
        for i in 0..=16 {
            assert_eq!(read_u8(&h.mem, STATUS + i), blk_status::OK);
        }
        let mut got = vec![0u8; 1 << 20];
        std::os::unix::fs::FileExt::read_exact_at(t.as_file(), &mut got, 0).unwrap();
        assert!(got.iter().all(|&b| b == 0x5a));
        let st = lock(&h.block).stats();
        assert_eq!(st.flush_ops.load(Ordering::Relaxed), 1);
        assert_eq!(st.write_bytes.load(Ordering::Relaxed), 1 << 20);
    }
}
