//! Counters of one disk: the device's own ([`BlockStats`]) and its
//! throttle's, published together in [`DiskCounters`] for readers on other
//! threads.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use corral_blkthrottle::{Limits, SharedStats, Stats};

/// Counters of one disk (atomics: read by the API without the device lock).
#[derive(Debug, Default)]
pub struct BlockStats {
    /// Completed `IN` requests.
    pub read_ops: AtomicU64,
    /// Bytes read.
    pub read_bytes: AtomicU64,
    /// Completed `OUT` requests.
    pub write_ops: AtomicU64,
    /// Bytes written.
    pub write_bytes: AtomicU64,
    /// Completed `FLUSH` requests.
    pub flush_ops: AtomicU64,
    /// Completed `GET_ID`, `DISCARD`, `WRITE_ZEROES` requests.
    pub other_ops: AtomicU64,
    /// Requests answered `VIRTIO_BLK_S_IOERR` (malformed ones included).
    pub io_errors: AtomicU64,
    /// Requests answered `VIRTIO_BLK_S_UNSUPP`.
    pub unsupported: AtomicU64,
    /// Malformed chains (bad layout, address outside memory, ...).
    pub malformed: AtomicU64,
    /// Chains without a status byte (returned with length 0).
    pub no_status: AtomicU64,
    /// Times a request had to wait for the throttle.
    pub throttled: AtomicU64,
    /// Times the ring was found broken (device set `DEVICE_NEEDS_RESET`).
    pub broken_rings: AtomicU64,
}

/// A snapshot of [`BlockStats`]; with the `serde` feature also the VM
/// process protocol's form of a disk's device counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(deny_unknown_fields)
)]
pub struct BlockStatsSnapshot {
    /// Completed `IN` requests.
    pub read_ops: u64,
    /// Bytes read.
    pub read_bytes: u64,
    /// Completed `OUT` requests.
    pub write_ops: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// Completed `FLUSH` requests.
    pub flush_ops: u64,
    /// Completed `GET_ID`, `DISCARD`, `WRITE_ZEROES` requests.
    pub other_ops: u64,
    /// Requests answered `VIRTIO_BLK_S_IOERR` (malformed ones included).
    pub io_errors: u64,
    /// Requests answered `VIRTIO_BLK_S_UNSUPP`.
    pub unsupported: u64,
    /// Malformed chains.
    pub malformed: u64,
    /// Chains without a status byte.
    pub no_status: u64,
    /// Times a request had to wait for the throttle.
    pub throttled: u64,
    /// Times the ring was found broken.
    pub broken_rings: u64,
}

impl BlockStats {
    /// The counters now (read one by one, without a lock).
    pub fn snapshot(&self) -> BlockStatsSnapshot {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        BlockStatsSnapshot {
            read_ops: l(&self.read_ops),
            read_bytes: l(&self.read_bytes),
            write_ops: l(&self.write_ops),
            write_bytes: l(&self.write_bytes),
            flush_ops: l(&self.flush_ops),
            other_ops: l(&self.other_ops),
            io_errors: l(&self.io_errors),
            unsupported: l(&self.unsupported),
            malformed: l(&self.malformed),
            no_status: l(&self.no_status),
            throttled: l(&self.throttled),
            broken_rings: l(&self.broken_rings),
        }
    }
}

/// The throttle settings a disk has now, as published by its device.
#[derive(Clone, Debug, Default)]
struct Settings {
    limits: Limits,
    group: Option<String>,
    weight: Option<u32>,
}

/// Everything a disk publishes for the API, shared by its device
/// ([`Block::counters`](super::Block::counters)): the device's counters,
/// its throttle's counters (admitted requests and bytes, waits, latency)
/// and its throttle settings. Reading them never touches the device, so
/// readers do not wait for the device's I/O; the device writes the
/// counters as atomics and the settings only when they change.
#[derive(Debug, Default)]
pub struct DiskCounters {
    device: Arc<BlockStats>,
    throttle: Arc<SharedStats>,
    settings: Mutex<Settings>,
}

impl DiskCounters {
    pub(super) fn new(device: Arc<BlockStats>) -> Self {
        Self {
            device,
            ..Self::default()
        }
    }

    /// The device's counters (requests completed, errors, broken rings).
    pub fn device(&self) -> BlockStatsSnapshot {
        self.device.snapshot()
    }

    /// The throttle's counters (zero while the disk never had a throttle).
    pub fn throttle_stats(&self) -> Stats {
        self.throttle.snapshot()
    }

    /// The disk's own limits now.
    pub fn limits(&self) -> Limits {
        self.settings().limits
    }

    /// The name of the throttle group the disk is in now, if any.
    pub fn group(&self) -> Option<String> {
        self.settings().group
    }

    /// The disk's weight in that group, if it is in one.
    pub fn group_weight(&self) -> Option<u32> {
        self.settings().weight
    }

    /// The sink the device's throttles count into.
    pub(super) fn throttle_sink(&self) -> Arc<SharedStats> {
        self.throttle.clone()
    }

    pub(super) fn publish(&self, limits: Limits, group: Option<String>, weight: Option<u32>) {
        *self.lock_settings() = Settings {
            limits,
            group,
            weight,
        };
    }

    fn settings(&self) -> Settings {
        self.lock_settings().clone()
    }

    /// Held only to copy the settings in or out, never across I/O.
    fn lock_settings(&self) -> std::sync::MutexGuard<'_, Settings> {
        self.settings.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub(super) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}
