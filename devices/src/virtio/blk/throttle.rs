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
    /// Changes the disk's weight in its group live, keeping its place
    /// there (nothing to do outside a group).
    fn set_weight(&mut self, weight: u32) -> Result<(), LimitsError>;
    /// The disk's own limits.
    fn limits(&self) -> Limits;
    /// The name of the group the disk is in, if any.
    fn group_name(&self) -> Option<String>;
    /// The disk's weight in its group, if it is in one.
    fn group_weight(&self) -> Option<u32>;
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
    fn set_weight(&mut self, weight: u32) -> Result<(), LimitsError> {
        corral_blkthrottle::Throttle::set_weight(self, weight)
    }
    fn limits(&self) -> Limits {
        corral_blkthrottle::Throttle::limits(self)
    }
    fn group_name(&self) -> Option<String> {
        self.group().map(|g| g.name().to_string())
    }
    fn group_weight(&self) -> Option<u32> {
        corral_blkthrottle::Throttle::weight(self)
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
/// times, with the planner of tight waits ([`Punctual`]) and the device
/// thread's priority boost for them.
///
/// The boost is `SCHED_FIFO` priority 1 for the calling thread, taken for
/// a tight wait and dropped at the admission or as soon as no tight wait is
/// in progress ([`ThrottleTimer::settle`]); the CPU time the thread uses
/// while boosted is reported to the planner, which suspends the boost when
/// it exceeds a quarter of the wall time. On a host whose CPUs are busy it
/// is what makes the wake-up punctual (measured in
/// `corral_blkthrottle::punctual`: 4.8 ms → 38 µs at p99). It needs
/// `CAP_SYS_NICE` or an `RLIMIT_RTPRIO` of at least 1; where the kernel
/// refuses (a jailed VM process without that limit, a cgroup with no
/// real-time runtime) the planner goes on without it, and
/// `CORRAL_BLK_RT=0` turns it off.
#[derive(Debug)]
pub struct ThrottleTimer {
    fd: OwnedFd,
    /// The instant it was last armed for, and for which step (cleared when
    /// it fires).
    armed: std::cell::Cell<(Nanos, Armed)>,
    punctual: std::cell::RefCell<Punctual>,
    /// The thread that holds the boost (0: none), since when (monotonic
    /// ns) and its CPU time then.
    boosted: std::cell::Cell<(libc::pid_t, Nanos, Nanos)>,
    /// Time spent waiting on the clock while boosted (not counted against
    /// the boost's budget: the planner's margin bounds it).
    spun: std::cell::Cell<Nanos>,
}

/// What the timer was last armed for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Armed {
    Nothing,
    /// A wait that is not tight, or an instant to re-poll.
    Plain,
    /// A tight wait's wake-up (its lateness is measured).
    Fine,
}

pub use corral_blkthrottle::punctual::{EARLY_MAX_NS, EARLY_MIN_NS, TIGHT_SLACK_NS};
pub use corral_blkthrottle::{Lateness, Punctual, Step};

/// Whether the device thread may boost itself for tight waits:
/// `CORRAL_BLK_RT=0` says no (read once).
fn boost_wanted() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("CORRAL_BLK_RT").map_or(true, |v| v != "0"))
}

/// Sets the calling thread's policy; false if the kernel refused.
fn set_policy(policy: libc::c_int, priority: libc::c_int) -> bool {
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param
    // that outlives the call.
    unsafe { libc::sched_setscheduler(0, policy, &param) == 0 }
}

/// The calling thread's CPU time (ns).
fn thread_cpu_ns() -> Nanos {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

fn gettid() -> libc::pid_t {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }
}

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
            armed: std::cell::Cell::new((0, Armed::Nothing)),
            punctual: std::cell::RefCell::new(Punctual::new(boost_wanted())),
            boosted: std::cell::Cell::new((0, 0, 0)),
            spun: std::cell::Cell::new(0),
        })
    }

    /// Notes that the timer fired and was read at `now`: a tight wait's
    /// wake-up is reported to the planner (how late it was).
    pub fn fired(&self, now: Nanos) {
        let (at, armed) = self.armed.replace((0, Armed::Nothing));
        if armed == Armed::Fine {
            self.punctual.borrow_mut().woke(at, now);
        }
    }

    /// The planner's next step for a tight wait due at `until`.
    pub fn plan(&self, now: Nanos, until: Nanos) -> Step {
        self.punctual.borrow_mut().plan(now, until)
    }

    /// The head request was admitted at `now`: a tight wait's lateness is
    /// counted, and the boost dropped.
    pub fn admitted(&self, now: Nanos) {
        self.punctual.borrow_mut().admitted(now);
        self.unboost();
    }

    /// The wait in progress is not (or no longer) a tight one.
    pub fn not_tight(&self) {
        self.punctual.borrow_mut().abandon();
        self.unboost();
    }

    /// Drops the boost if no tight wait is in progress (the request was
    /// dropped by a reset, say). Call on the device thread.
    pub fn settle(&self) {
        if self.boosted.get().0 != 0 && !self.punctual.borrow().waiting() {
            self.unboost();
        }
    }

    /// Raises the calling thread to `SCHED_FIFO` 1 for a tight wait (once;
    /// if the kernel refuses, the planner stops asking).
    pub fn boost(&self) {
        if self.boosted.get().0 != 0 || !self.punctual.borrow().boost() {
            return;
        }
        if set_policy(libc::SCHED_FIFO, 1) {
            self.boosted
                .set((gettid(), monotonic_ns(), thread_cpu_ns()));
        } else {
            let e = io::Error::last_os_error();
            tracing::debug!("virtio-blk: no real-time priority for tight throttle waits: {e}");
            self.punctual.borrow_mut().set_boost(false);
        }
    }

    /// Back to `SCHED_OTHER` (the nice value is kept), if this thread holds
    /// the boost; the CPU time it used meanwhile goes to the planner's
    /// budget.
    fn unboost(&self) {
        let (tid, since, cpu) = self.boosted.get();
        if tid != 0 && tid == gettid() {
            set_policy(libc::SCHED_OTHER, 0);
            self.boosted.set((0, 0, 0));
            let now = monotonic_ns();
            let used = thread_cpu_ns()
                .saturating_sub(cpu)
                .saturating_sub(self.spun.replace(0));
            let mut p = self.punctual.borrow_mut();
            let was = p.suspended(now);
            p.boost_spent(now, used, now.saturating_sub(since));
            if !was && p.suspended(now) {
                // At most once a second (the suspension's length).
                tracing::debug!("virtio-blk: throttle boost suspended: over its CPU budget");
            }
        }
    }

    /// Waits on the clock until `until` (the last stretch of a tight wait).
    pub fn spin_until(&self, until: Nanos) {
        let start = monotonic_ns();
        let mut now = start;
        while now < until {
            std::hint::spin_loop();
            now = monotonic_ns();
        }
        if self.boosted.get().0 != 0 {
            self.spun.set(self.spun.get() + (now - start));
        }
    }

    /// Admission lateness of the tight waits so far.
    pub fn lateness(&self) -> Lateness {
        self.punctual.borrow().lateness()
    }

    /// Arms for the wake-up of a tight wait at `at`.
    pub fn arm_fine(&self, at: Nanos) -> io::Result<()> {
        self.arm(at, Armed::Fine)
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
        self.arm(at, Armed::Plain)
    }

    fn arm(&self, at: Nanos, kind: Armed) -> io::Result<()> {
        // it_value 0 would disarm: fire "now" instead.
        let at = at.max(1);
        self.armed.set((at, kind));
        self.set(at, libc::TFD_TIMER_ABSTIME)
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

impl Drop for ThrottleTimer {
    fn drop(&mut self) {
        let l = self.lateness();
        if l.count > 0 {
            tracing::debug!(
                "virtio-blk: tight throttle waits: {} admissions, lateness total {} us, max {} us, \
                 <=1us/10us/100us/1ms/more {:?}",
                l.count,
                l.total_ns / 1000,
                l.max_ns / 1000,
                l.histogram
            );
        }
        self.unboost();
    }
}

impl AsRawFd for ThrottleTimer {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
