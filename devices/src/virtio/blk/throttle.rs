//! The throttling seam of virtio-blk: a [`RequestThrottle`] asked before each
//! request, and the timerfd the device arms when the throttle says "wait".
//!
//! Protocol (matches [`corral_blkthrottle::Throttle`], which implements the
//! trait): for the request at the head of the queue the device calls
//! [`RequestThrottle::poll`]. On `Admit` it serves it and polls the next one. On
//! `Wait { until }` it keeps that request (it has already been popped from
//! the available ring; the ones behind it stay in the ring, in order), arms
//! its timer for `until` (absolute `CLOCK_MONOTONIC` nanoseconds) and stops
//! taking requests from that queue; guest notifications meanwhile are only
//! drained. When the timer fires — or when the VMM calls
//! [`Block::throttle_changed`](super::Block::throttle_changed) after a live limit
//! change — the head is polled again. A device reset drops the waiting
//! request and calls [`RequestThrottle::cancel`].

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

pub use corral_blkthrottle::{
    Decision, Limits, LimitsError, Nanos, OpKind, Request as ThrottleRequest, SharedStats,
    ThrottleGroup,
};

/// Asked before each request is served.
pub trait RequestThrottle: Send {
    /// May the head request `req` go at `now`?
    fn poll(&mut self, req: ThrottleRequest, now: Nanos) -> Decision;
    /// The waiting head request was dropped (device reset).
    fn cancel(&mut self);
    /// A request started waiting.
    fn note_enqueued(&mut self) {}
    /// A waiting request was admitted or dropped.
    fn note_dequeued(&mut self) {}
    /// For a request told to wait: how late after its `until` it may be
    /// polled without losing rate (see
    /// [`corral_blkthrottle::Throttle::wait_slack`]). Unlimited by default.
    fn wait_slack(&mut self, _req: ThrottleRequest, _now: Nanos) -> Nanos {
        Nanos::MAX
    }
    /// A request completed `ns` after the device took it from the ring.
    fn record_latency(&mut self, _kind: OpKind, _ns: Nanos) {}
    /// Replaces the disk's own limits live (earned tokens and the waiting
    /// request are kept); the device re-polls its head request afterwards.
    fn set_limits(&mut self, limits: &Limits, now: Nanos) -> Result<(), LimitsError>;
    /// Moves the disk into `group` with a weight, or out of any group.
    fn set_group(&mut self, group: Option<(&ThrottleGroup, u32)>) -> Result<(), LimitsError>;
    /// The disk's own limits.
    fn limits(&self) -> Limits;
    /// The name of the group the disk is in, if any.
    fn group_name(&self) -> Option<String>;
    /// Counts into `sink` from now on: the device's counters, which outlive
    /// a throttle. A throttle that keeps no counters ignores it.
    fn count_into(&mut self, _sink: Arc<SharedStats>) {}
}

impl RequestThrottle for corral_blkthrottle::Throttle {
    fn poll(&mut self, req: ThrottleRequest, now: Nanos) -> Decision {
        corral_blkthrottle::Throttle::poll(self, req, now)
    }
    fn cancel(&mut self) {
        corral_blkthrottle::Throttle::cancel(self)
    }
    fn note_enqueued(&mut self) {
        corral_blkthrottle::Throttle::note_enqueued(self)
    }
    fn note_dequeued(&mut self) {
        corral_blkthrottle::Throttle::note_dequeued(self)
    }
    fn record_latency(&mut self, kind: OpKind, ns: Nanos) {
        corral_blkthrottle::Throttle::record_latency(self, kind, ns)
    }
    fn wait_slack(&mut self, req: ThrottleRequest, now: Nanos) -> Nanos {
        corral_blkthrottle::Throttle::wait_slack(self, req, now)
    }
    fn set_limits(&mut self, limits: &Limits, now: Nanos) -> Result<(), LimitsError> {
        corral_blkthrottle::Throttle::set_limits(self, limits, now)
    }
    fn set_group(&mut self, group: Option<(&ThrottleGroup, u32)>) -> Result<(), LimitsError> {
        match group {
            Some((g, weight)) => self.join_group(g, weight, None),
            None => {
                self.leave_group();
                Ok(())
            }
        }
    }
    fn limits(&self) -> Limits {
        corral_blkthrottle::Throttle::limits(self)
    }
    fn group_name(&self) -> Option<String> {
        self.group().map(|g| g.name().to_string())
    }
    fn count_into(&mut self, sink: Arc<SharedStats>) {
        corral_blkthrottle::Throttle::count_into(self, sink)
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds (the clock of [`Nanos`]).
pub fn monotonic_ns() -> Nanos {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// A non-blocking one-shot timerfd on `CLOCK_MONOTONIC`, armed at absolute
/// times.
#[derive(Debug)]
pub struct ThrottleTimer {
    fd: OwnedFd,
    /// The instant it was last armed for (0 = not armed since it fired).
    armed_for: std::cell::Cell<Nanos>,
    /// How late it fires, a decaying maximum of what was seen (ns).
    late: std::cell::Cell<Nanos>,
}

/// Waits whose throttle slack ([`RequestThrottle::wait_slack`]) is shorter than
/// this are *tight*: a late poll would lose rate, so the device wakes early
/// and waits the last stretch on the clock.
pub const TIGHT_SLACK_NS: Nanos = 2_000_000;
/// Bounds of how early a tight wait's timer is armed (the timer's measured
/// lateness plus a margin, within these).
pub const EARLY_MIN_NS: Nanos = 50_000;
/// See [`EARLY_MIN_NS`]: at most this much is spent on the clock per wait.
pub const EARLY_MAX_NS: Nanos = 1_000_000;

impl ThrottleTimer {
    /// A disarmed timer.
    pub fn new() -> io::Result<Self> {
        // SAFETY: plain syscall; the result is checked below.
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self {
            fd,
            armed_for: std::cell::Cell::new(0),
            late: std::cell::Cell::new(EARLY_MIN_NS),
        })
    }

    /// Notes that the timer fired and was read at `now`: updates the
    /// lateness estimate (a maximum that decays by 1/8 per expiry, so one
    /// slow wake-up widens the margin for a while, not for ever).
    pub fn fired(&self, now: Nanos) {
        let at = self.armed_for.replace(0);
        if at == 0 {
            return;
        }
        let late = now.saturating_sub(at).min(EARLY_MAX_NS);
        let decayed = self.late.get() - self.late.get() / 8;
        self.late.set(decayed.max(late));
    }

    /// How early to arm for a tight wait: the lateness seen, plus a margin.
    pub fn early_ns(&self) -> Nanos {
        (self.late.get() + self.late.get() / 2).clamp(EARLY_MIN_NS, EARLY_MAX_NS)
    }

    fn set(&self, at: Nanos, flags: libc::c_int) -> io::Result<()> {
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: (at / 1_000_000_000) as libc::time_t,
                tv_nsec: (at % 1_000_000_000) as libc::c_long,
            },
        };
        // SAFETY: valid fd and itimerspec; old value not requested.
        let r = unsafe {
            libc::timerfd_settime(self.fd.as_raw_fd(), flags, &spec, std::ptr::null_mut())
        };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// Fires at `at` (`CLOCK_MONOTONIC` ns); a time in the past fires at once.
    pub fn arm_at(&self, at: Nanos) -> io::Result<()> {
        self.armed_for.set(at.max(1));
        // it_value 0 would disarm: fire "now" instead.
        self.set(at.max(1), libc::TFD_TIMER_ABSTIME)
    }

    /// Cancels a pending expiry.
    pub fn disarm(&self) -> io::Result<()> {
        self.set(0, 0)
    }

    /// Consumes expirations (never blocks).
    pub fn drain(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into our buffer; non-blocking fd.
        let _ = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
    }
}

impl AsRawFd for ThrottleTimer {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
