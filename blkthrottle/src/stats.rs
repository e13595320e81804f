//! Counters and the latency histogram.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Nanos, OpKind};

/// Upper bounds of the latency histogram buckets, in nanoseconds: 1-2.5-5
/// steps per decade from 10 µs to 10 s. A last, implicit `+Inf` bucket
/// catches everything above.
pub const LATENCY_BOUNDS_NS: [u64; 19] = [
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
];

/// Number of histogram buckets including `+Inf`.
pub const LATENCY_BUCKETS: usize = LATENCY_BOUNDS_NS.len() + 1;

fn bucket_index(ns: Nanos) -> usize {
    LATENCY_BOUNDS_NS.partition_point(|&b| b < ns)
}

/// A fixed log-scale latency histogram (see [`LATENCY_BOUNDS_NS`]).
///
/// For Prometheus: [`Histogram::cumulative`] yields `(le_seconds, count)`
/// pairs ending with `(f64::INFINITY, count)`, plus [`Histogram::sum_seconds`]
/// and [`Histogram::count`]. `prometheus-client`'s `encode_histogram` wants
/// per-bucket (non-cumulative) counts: use [`Histogram::buckets`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Histogram {
    /// Per-bucket (non-cumulative) counts; the last one is `+Inf`.
    pub counts: [u64; LATENCY_BUCKETS],
    /// Sum of all observations, in nanoseconds.
    pub sum_ns: u64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&mut self, ns: Nanos) {
        self.counts[bucket_index(ns)] += 1;
        self.sum_ns = self.sum_ns.saturating_add(ns);
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Sum of observations in seconds.
    pub fn sum_seconds(&self) -> f64 {
        self.sum_ns as f64 / 1e9
    }

    /// `(upper_bound_seconds, count_in_bucket)`, non-cumulative, last bound
    /// `+Inf`.
    pub fn buckets(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        upper_bounds_seconds().zip(self.counts.iter().copied())
    }

    /// `(le_seconds, cumulative_count)`, last bound `+Inf` (whose count equals
    /// [`Histogram::count`]).
    pub fn cumulative(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        let mut acc = 0u64;
        self.buckets().map(move |(le, c)| {
            acc += c;
            (le, acc)
        })
    }

    /// Adds another histogram into this one.
    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts) {
            *a += b;
        }
        self.sum_ns = self.sum_ns.saturating_add(other.sum_ns);
    }
}

fn upper_bounds_seconds() -> impl Iterator<Item = f64> {
    LATENCY_BOUNDS_NS
        .iter()
        .map(|&b| b as f64 / 1e9)
        .chain(std::iter::once(f64::INFINITY))
}

/// Lock-free histogram for the group, fed from several threads (`repr(C)`:
/// it is part of a group's shared page, [`crate::GroupPage`]).
#[derive(Debug, Default)]
#[repr(C)]
pub(crate) struct AtomicHistogram {
    counts: [AtomicU64; LATENCY_BUCKETS],
    sum_ns: AtomicU64,
}

impl AtomicHistogram {
    pub(crate) fn observe(&self, ns: Nanos) {
        self.counts[bucket_index(ns)].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> Histogram {
        let mut h = Histogram::default();
        for (d, s) in h.counts.iter_mut().zip(&self.counts) {
            *d = s.load(Ordering::Relaxed);
        }
        h.sum_ns = self.sum_ns.load(Ordering::Relaxed);
        h
    }
}

/// Counters of one op kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpStats {
    /// Requests admitted.
    pub ops: u64,
    /// Bytes admitted (always 0 for [`OpKind::Other`]).
    pub bytes: u64,
    /// Latencies reported with `record_latency` for this kind.
    pub latency: Histogram,
}

/// A snapshot of the counters of a disk ([`crate::Throttle::stats`]) or a
/// group ([`crate::ThrottleGroup::stats`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Reads.
    pub read: OpStats,
    /// Writes.
    pub write: OpStats,
    /// Flush and other non-data requests.
    pub other: OpStats,
    /// Requests that had to wait at least once before admission.
    pub throttled_requests: u64,
    /// Sum over admitted requests of (admission − first refusal), ns.
    pub throttled_ns: u64,
    /// Requests currently queued (as reported by the caller with
    /// `note_enqueued` / `note_dequeued`); for a group, the sum over members.
    pub queue_depth: u64,
}

impl Stats {
    /// Counters of one kind.
    pub fn op(&self, kind: OpKind) -> &OpStats {
        match kind {
            OpKind::Read => &self.read,
            OpKind::Write => &self.write,
            OpKind::Other => &self.other,
        }
    }

    pub(crate) fn op_mut(&mut self, kind: OpKind) -> &mut OpStats {
        match kind {
            OpKind::Read => &mut self.read,
            OpKind::Write => &mut self.write,
            OpKind::Other => &mut self.other,
        }
    }

    /// Total admitted requests.
    pub fn total_ops(&self) -> u64 {
        self.read.ops + self.write.ops + self.other.ops
    }

    /// Total admitted bytes.
    pub fn total_bytes(&self) -> u64 {
        self.read.bytes + self.write.bytes + self.other.bytes
    }

    /// Time spent throttled, in seconds.
    pub fn throttled_seconds(&self) -> f64 {
        self.throttled_ns as f64 / 1e9
    }

    /// Counts an admitted request that had waited since `waited_since`
    /// (`None`: admitted on first try).
    pub(crate) fn admitted(
        &mut self,
        kind: OpKind,
        bytes: u64,
        waited_since: Option<Nanos>,
        now: Nanos,
    ) {
        let o = self.op_mut(kind);
        o.ops += 1;
        o.bytes = o.bytes.saturating_add(bytes);
        if let Some(t0) = waited_since {
            self.throttled_requests += 1;
            self.throttled_ns = self.throttled_ns.saturating_add(now.saturating_sub(t0));
        }
    }
}

/// Counters of one op kind, as atomics.
#[derive(Debug, Default)]
#[repr(C)]
struct AtomicOpStats {
    ops: AtomicU64,
    bytes: AtomicU64,
    latency: AtomicHistogram,
}

impl AtomicOpStats {
    fn snapshot(&self) -> OpStats {
        OpStats {
            ops: self.ops.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            latency: self.latency.snapshot(),
        }
    }
}

/// A disk's counters as atomics: written by its [`crate::Throttle`] (on the
/// device's thread), read by any thread without a lock
/// ([`SharedStats::snapshot`]). A device can keep one for the disk's life
/// and hand it to each throttle it installs ([`crate::Throttle::count_into`]),
/// so the disk's counters never go back when its throttle is replaced.
///
/// A snapshot reads the fields one by one: taken while requests are
/// admitted it may count a request's op and not yet its bytes.
///
/// `repr(C)` and atomics only: a shared group keeps one in its page
/// ([`crate::GroupPage`]), where any bit pattern is a valid value.
#[derive(Debug, Default)]
#[repr(C)]
pub struct SharedStats {
    read: AtomicOpStats,
    write: AtomicOpStats,
    other: AtomicOpStats,
    throttled_requests: AtomicU64,
    throttled_ns: AtomicU64,
    queue_depth: AtomicU64,
}

impl SharedStats {
    /// The counters now.
    pub fn snapshot(&self) -> Stats {
        Stats {
            read: self.read.snapshot(),
            write: self.write.snapshot(),
            other: self.other.snapshot(),
            throttled_requests: self.throttled_requests.load(Ordering::Relaxed),
            throttled_ns: self.throttled_ns.load(Ordering::Relaxed),
            queue_depth: self.queue_depth.load(Ordering::Relaxed),
        }
    }

    fn op(&self, kind: OpKind) -> &AtomicOpStats {
        match kind {
            OpKind::Read => &self.read,
            OpKind::Write => &self.write,
            OpKind::Other => &self.other,
        }
    }

    /// Counts an admitted request (see [`Stats::admitted`]).
    pub(crate) fn admitted(
        &self,
        kind: OpKind,
        bytes: u64,
        waited_since: Option<Nanos>,
        now: Nanos,
    ) {
        let o = self.op(kind);
        o.ops.fetch_add(1, Ordering::Relaxed);
        o.bytes.fetch_add(bytes, Ordering::Relaxed);
        if let Some(t0) = waited_since {
            self.throttled_requests.fetch_add(1, Ordering::Relaxed);
            self.throttled_ns
                .fetch_add(now.saturating_sub(t0), Ordering::Relaxed);
        }
    }

    pub(crate) fn observe_latency(&self, kind: OpKind, ns: Nanos) {
        self.op(kind).latency.observe(ns);
    }

    /// Adds `d` (may be negative) to the queue depth, which the owning
    /// throttle keeps non-negative.
    pub(crate) fn add_queue_depth(&self, d: i64) {
        if d >= 0 {
            self.queue_depth.fetch_add(d as u64, Ordering::Relaxed);
        } else {
            let _ = self
                .queue_depth
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |q| {
                    Some(q.saturating_sub(d.unsigned_abs()))
                });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets() {
        let mut h = Histogram::default();
        h.observe(0);
        h.observe(10_000); // le 10 µs (inclusive)
        h.observe(10_001);
        h.observe(10_000_000_000);
        h.observe(10_000_000_001);
        assert_eq!(h.count(), 5);
        let c: Vec<_> = h.cumulative().collect();
        assert_eq!(c.len(), LATENCY_BUCKETS);
        assert_eq!(c[0], (1e-5, 2));
        assert_eq!(c[1], (2.5e-5, 3));
        assert_eq!(c[LATENCY_BUCKETS - 2], (10.0, 4));
        assert_eq!(c[LATENCY_BUCKETS - 1], (f64::INFINITY, 5));
        assert!((h.sum_seconds() - 20.000020002).abs() < 1e-9);
        let mut m = h.clone();
        m.merge(&h);
        assert_eq!(m.count(), 10);
        let a = AtomicHistogram::default();
        a.observe(10_001);
        assert_eq!(a.snapshot().counts[1], 1);
    }

    #[test]
    fn shared_stats_snapshot_matches_what_was_counted() {
        let s = SharedStats::default();
        s.admitted(OpKind::Read, 4096, None, 10);
        s.admitted(OpKind::Write, 512, Some(5), 30);
        s.observe_latency(OpKind::Read, 20_000);
        s.add_queue_depth(2);
        s.add_queue_depth(-3);
        let mut want = Stats::default();
        want.admitted(OpKind::Read, 4096, None, 10);
        want.admitted(OpKind::Write, 512, Some(5), 30);
        want.read.latency.observe(20_000);
        assert_eq!(s.snapshot(), want);
    }
}
