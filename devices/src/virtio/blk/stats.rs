//! Counters of one disk.

use std::sync::atomic::{AtomicU64, Ordering};

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

pub(super) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}
