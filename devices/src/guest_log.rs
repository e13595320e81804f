//! Guest-caused warnings: counted per kind, logged rate-limited.
//!
//! A hostile guest can make a device misbehave on every request or
//! register write, millions of times a second. Every warning a guest can
//! cause therefore goes through the [`GuestLog`] of its device (one per
//! device of a VM): each event is counted (atomics, read by `/metrics`
//! without touching the device), and at most [`BURST`] lines per
//! [`INTERVAL`] are written; the rest are counted as suppressed and
//! reported in one line when the next interval starts.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Lines logged per device and interval before suppression.
pub const BURST: u32 = 5;
/// The rate limiter's interval.
pub const INTERVAL: Duration = Duration::from_secs(10);

/// What the guest did wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum GuestErrorKind {
    /// A descriptor chain that is not a valid request (answered IOERR).
    MalformedRequest,
    /// A chain without a writable status byte (returned with length 0).
    NoStatus,
    /// A sector range outside the disk (answered IOERR).
    OutOfRange,
    /// A write-type request to a read-only disk (answered IOERR).
    ReadOnly,
    /// An unknown or not negotiated request type (answered UNSUPP).
    Unsupported,
    /// Host I/O failed for a guest request (answered IOERR).
    HostIo,
    /// A queue the device cannot process (the device went NEEDS_RESET).
    BrokenRing,
    /// `QueueReady` refused (bad size or ring addresses).
    InvalidQueue,
    /// An access to an unknown register, with a bad width, or one the
    /// current status forbids.
    BadRegister,
    /// `FEATURES_OK` refused.
    RefusedFeatures,
    /// `DRIVER_OK` refused (the device went NEEDS_RESET).
    FailedActivation,
}

impl GuestErrorKind {
    /// Every kind, in index order.
    pub const ALL: [GuestErrorKind; 11] = [
        Self::MalformedRequest,
        Self::NoStatus,
        Self::OutOfRange,
        Self::ReadOnly,
        Self::Unsupported,
        Self::HostIo,
        Self::BrokenRing,
        Self::InvalidQueue,
        Self::BadRegister,
        Self::RefusedFeatures,
        Self::FailedActivation,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::MalformedRequest => "malformed_request",
            Self::NoStatus => "no_status",
            Self::OutOfRange => "out_of_range",
            Self::ReadOnly => "read_only",
            Self::Unsupported => "unsupported",
            Self::HostIo => "host_io",
            Self::BrokenRing => "broken_ring",
            Self::InvalidQueue => "invalid_queue",
            Self::BadRegister => "bad_register",
            Self::RefusedFeatures => "refused_features",
            Self::FailedActivation => "failed_activation",
        }
    }
}

#[derive(Debug, Default)]
struct Limiter {
    window_start: Option<Instant>,
    printed: u32,
    suppressed: u64,
}

/// The guest-error counters and rate-limited log of one device.
#[derive(Debug)]
pub struct GuestLog {
    vm: OnceLock<String>,
    device: String,
    counts: [AtomicU64; GuestErrorKind::ALL.len()],
    limiter: Mutex<Limiter>,
}

impl GuestLog {
    /// The log of device `device` (its VM is named later, [`GuestLog::set_vm`]).
    pub fn new(device: impl Into<String>) -> Self {
        Self {
            vm: OnceLock::new(),
            device: device.into(),
            counts: Default::default(),
            limiter: Mutex::new(Limiter::default()),
        }
    }

    /// Names the VM in the log lines (first call wins).
    pub fn set_vm(&self, vm: &str) {
        let _ = self.vm.set(vm.to_string());
    }

    /// The device's name.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Counts one event of `kind` and logs `msg` unless the limit for this
    /// interval is reached.
    pub fn report(&self, kind: GuestErrorKind, msg: std::fmt::Arguments<'_>) {
        self.counts[kind as usize].fetch_add(1, Ordering::Relaxed);
        self.report_at(kind, msg, Instant::now());
    }

    fn report_at(&self, kind: GuestErrorKind, msg: std::fmt::Arguments<'_>, now: Instant) {
        let vm = self.vm.get().map_or("", String::as_str);
        let mut l = self.limiter.lock().unwrap_or_else(|p| p.into_inner());
        let expired = l
            .window_start
            .is_none_or(|s| now.saturating_duration_since(s) >= INTERVAL);
        if expired {
            if l.suppressed > 0 {
                tracing::warn!(
                    vm,
                    device = %self.device,
                    "suppressed {} guest-caused messages in the last {}s",
                    l.suppressed,
                    INTERVAL.as_secs()
                );
            }
            *l = Limiter {
                window_start: Some(now),
                printed: 0,
                suppressed: 0,
            };
        }
        if l.printed < BURST {
            l.printed += 1;
            drop(l);
            tracing::warn!(vm, device = %self.device, kind = kind.as_str(), "{msg}");
        } else {
            l.suppressed += 1;
        }
    }

    /// Events of `kind` so far.
    pub fn count(&self, kind: GuestErrorKind) -> u64 {
        self.counts[kind as usize].load(Ordering::Relaxed)
    }

    /// (kind, count) for every kind.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        GuestErrorKind::ALL
            .iter()
            .map(|k| (k.as_str(), self.count(*k)))
            .collect()
    }

    /// Messages suppressed in the current interval (for tests).
    pub fn suppressed(&self) -> u64 {
        self.limiter
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .suppressed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_every_event_and_limits_lines() {
        let log = GuestLog::new("vda");
        let t0 = Instant::now();
        for _ in 0..1000 {
            log.counts[GuestErrorKind::BrokenRing as usize].fetch_add(1, Ordering::Relaxed);
            log.report_at(GuestErrorKind::BrokenRing, format_args!("x"), t0);
        }
        assert_eq!(log.count(GuestErrorKind::BrokenRing), 1000);
        assert_eq!(log.suppressed(), 1000 - u64::from(BURST));
        // The next interval starts afresh.
        log.report_at(GuestErrorKind::NoStatus, format_args!("y"), t0 + INTERVAL);
        assert_eq!(log.suppressed(), 0);
        let snap = log.snapshot();
        assert_eq!(snap.len(), GuestErrorKind::ALL.len());
        assert!(snap.contains(&("broken_ring", 1000)));
        for (i, k) in GuestErrorKind::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i);
        }
    }
}
