//! [`Punctual`]: when a device should wake up for a *tight* wait, so that
//! its poll lands on the due nanosecond.
//!
//! A bucket about one request deep has no slack ([`crate::Throttle::wait_slack`]
//! is zero): a poll late by δ pushes every later admission back by δ, and no
//! admission rule that keeps the window bound can give it back (crate docs,
//! "Lateness"). The rate is then exactly as good as the caller's punctuality.
//! This is the caller's half, as policy with time as an input like the rest
//! of the crate, so that it is tested on a fake clock:
//!
//! - it keeps the timer's lateness (how long after the instant it was armed
//!   for the caller actually ran) over the last [`WINDOW`] wake-ups, and arms
//!   the timer that much early, with a margin ([`Punctual::margin`]): the
//!   maximum of the window × 5/4 + 20 µs, within [`EARLY_MIN_NS`] and a cap;
//! - the caller waits the last stretch on the clock ([`Step::Spin`]);
//! - where the caller can raise its thread's priority for the wait (a
//!   real-time policy: on a host whose CPUs are busy, the timer interrupt is
//!   on time but the woken thread waits for a CPU; measured below), it does
//!   so for the whole wait, from the refusal to the admission (the steps
//!   say `boost`). A sleeping thread costs nothing at any priority; what it
//!   does while boosted besides the wait (other devices' events on the same
//!   thread) is held to a budget: the caller reports the CPU time the
//!   thread used while boosted, less its waits on the clock (at most the
//!   margin per wait) ([`Punctual::boost_spent`]), and if that
//!   exceeds a quarter of the wall time of the last second or so
//!   ([`BOOST_CPU_SHARE`]), waits are not boosted for the next second
//!   ([`BOOST_BACKOFF_NS`]). (The kernel's real-time throttling,
//!   `sched_rt_runtime_us`, bounds it as a whole too.)
//!
//! Measured on this host (kvm_pvm, 2 CPUs; a timerfd armed every 12.5 ms as
//! for `bps=10M,burst_bytes=128K`, three busy loops beside it):
//!
//! | thread | wake-up lateness p50 / p99 / max | mean admission lateness |
//! |---|---|---|
//! | nice 0, no early wake | 17 µs / 4.8 ms / 16 ms | 228 µs (−1.8 % of the rate) |
//! | nice 0, 100 µs early + spin | 19 µs / 26 ms / 43 ms | 928 µs (the spin is preempted) |
//! | nice −10, 50 µs early + spin | 17 µs / 7.5 ms / 8.6 ms | 351 µs |
//! | `SCHED_FIFO` 1, 100 µs early + spin | 16 µs / 38 µs / 288 µs | 0.5 µs (−0.004 %) |
//!
//! Spinning at normal priority on a busy host makes things worse (the
//! scheduler takes the CPU from a thread that uses it), which is why the cap
//! is [`EARLY_MAX_NS`] without the boost and [`EARLY_MAX_BOOSTED_NS`] with
//! it. Boosting only the last stretch (a wake-up at normal priority a few
//! ms before the due instant, then a boosted one) was tried first and
//! measured worse on real VMs: on this host at load 9 the normal-priority
//! wake-up came up to 15 ms late, and the one-request job
//! (`bps=10M,burst_bytes=128K`, 127 waits) lost 13–15 ms to lateness, against
//! 1.4–2.2 ms with the whole wait boosted.
//!
//! What is left after this is lateness the margin did not cover: a wake-up
//! later than any of the last [`WINDOW`] (the host's own hypervisor taking
//! the CPU, say). [`Punctual::lateness`] counts it per admission, so a
//! figure off the rate can be told apart from an arithmetic error:
//! `tests/punctual.rs` checks on the fake clock that the time a one-request
//! stream loses is exactly the sum of these admission latenesses.

use crate::Nanos;

/// Waits whose slack ([`crate::Throttle::wait_slack`]) is shorter than this
/// are *tight*: a late poll would lose rate.
pub const TIGHT_SLACK_NS: Nanos = 2_000_000;
/// Least early margin.
pub const EARLY_MIN_NS: Nanos = 50_000;
/// Largest early margin when the caller's thread is not boosted: spinning
/// longer at normal priority on a busy host gets the thread preempted.
pub const EARLY_MAX_NS: Nanos = 1_000_000;
/// Largest early margin when the caller's thread is boosted for the wait.
pub const EARLY_MAX_BOOSTED_NS: Nanos = 4_000_000;
/// Most CPU time a boosted thread may use, as 1/this of the wall time it
/// was boosted for, before boosting is suspended.
pub const BOOST_CPU_SHARE: u64 = 4;
/// How long boosting is suspended when the budget is exceeded (ns).
pub const BOOST_BACKOFF_NS: Nanos = 1_000_000_000;
/// Wall time over which the budget is reckoned: the sums are halved when
/// they reach it, and judged once they hold a quarter of it.
pub const BOOST_BUDGET_SPAN_NS: Nanos = 1_000_000_000;
/// Wake-ups remembered for the margin.
pub const WINDOW: usize = 16;

/// What to do for a tight wait, from [`Punctual::plan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Boost the thread if `boost`, arm the timer for `at`, sleep, report
    /// the wake-up with [`Punctual::woke`], and plan again.
    Fine {
        /// Absolute instant.
        at: Nanos,
        /// Raise the thread's priority first.
        boost: bool,
    },
    /// Boost the thread if `boost`, wait on the clock until `until`, poll.
    Spin {
        /// The due instant.
        until: Nanos,
        /// Raise the thread's priority first.
        boost: bool,
    },
}

/// Admission lateness of tight waits: how long after its due instant each
/// such request was admitted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lateness {
    /// Tight admissions.
    pub count: u64,
    /// Sum of their lateness (ns): the time a one-request stream lost.
    pub total_ns: u64,
    /// The largest (ns).
    pub max_ns: u64,
    /// How many were at most 1 µs, 10 µs, 100 µs, 1 ms late, and later.
    pub histogram: [u64; 5],
}

impl Lateness {
    fn add(&mut self, ns: Nanos) {
        self.count += 1;
        self.total_ns = self.total_ns.saturating_add(ns);
        self.max_ns = self.max_ns.max(ns);
        let i = [1_000, 10_000, 100_000, 1_000_000]
            .iter()
            .position(|&b| ns <= b)
            .unwrap_or(4);
        if let Some(h) = self.histogram.get_mut(i) {
            *h += 1;
        }
    }
}

/// The caller's side of a tight wait: when to wake, whether boosted, and
/// how late it was. See the module docs.
#[derive(Clone, Debug)]
pub struct Punctual {
    /// Lateness of the last [`WINDOW`] wake-ups.
    samples: [Nanos; WINDOW],
    filled: usize,
    next: usize,
    boost: bool,
    /// Boosting is suspended before this instant (budget exceeded).
    suspended_until: Nanos,
    /// CPU and wall time while boosted, over about the last
    /// [`BOOST_BUDGET_SPAN_NS`].
    boost_cpu: Nanos,
    boost_wall: Nanos,
    /// The due instant of the wait in progress.
    due: Option<Nanos>,
    lateness: Lateness,
}

impl Default for Punctual {
    fn default() -> Self {
        Self::new(false)
    }
}

impl Punctual {
    /// A planner for a caller that can (`boost`) or cannot raise its
    /// thread's priority for a wait.
    pub fn new(boost: bool) -> Punctual {
        Punctual {
            samples: [0; WINDOW],
            filled: 0,
            next: 0,
            boost,
            suspended_until: 0,
            boost_cpu: 0,
            boost_wall: 0,
            due: None,
            lateness: Lateness::default(),
        }
    }

    /// The caller found out it cannot boost after all (the kernel refused).
    pub fn set_boost(&mut self, boost: bool) {
        self.boost = boost;
    }

    /// Whether waits are planned with the boost.
    pub fn boost(&self) -> bool {
        self.boost
    }

    /// The largest early margin: [`EARLY_MAX_BOOSTED_NS`] if the caller can
    /// boost, [`EARLY_MAX_NS`] if not.
    pub fn cap(&self) -> Nanos {
        if self.boost {
            EARLY_MAX_BOOSTED_NS
        } else {
            EARLY_MAX_NS
        }
    }

    /// How early to wake before a due instant: the largest lateness of the
    /// last [`WINDOW`] wake-ups × 5/4 + 20 µs, within
    /// [`EARLY_MIN_NS`]..=[`Self::cap`].
    pub fn margin(&self) -> Nanos {
        self.margin_within(self.cap())
    }

    fn margin_within(&self, cap: Nanos) -> Nanos {
        let worst = self.samples.iter().take(self.filled).copied().max();
        let worst = worst.unwrap_or(0);
        (worst + worst / 4 + 20_000).clamp(EARLY_MIN_NS, cap)
    }

    /// The next step of a tight wait for a request due at `until`, at
    /// `now`.
    pub fn plan(&mut self, now: Nanos, until: Nanos) -> Step {
        self.due = Some(until);
        let boost = self.boost && now >= self.suspended_until;
        let m = self.margin_within(if boost {
            EARLY_MAX_BOOSTED_NS
        } else {
            EARLY_MAX_NS
        });
        if until > now.saturating_add(m) {
            Step::Fine {
                at: until - m,
                boost,
            }
        } else {
            Step::Spin { until, boost }
        }
    }

    /// A wake-up armed for `armed_for` ran at `now`.
    pub fn woke(&mut self, armed_for: Nanos, now: Nanos) {
        let late = now.saturating_sub(armed_for).min(EARLY_MAX_BOOSTED_NS);
        if let Some(s) = self.samples.get_mut(self.next) {
            *s = late;
        }
        self.next = (self.next + 1) % WINDOW;
        self.filled = (self.filled + 1).min(WINDOW);
    }

    /// The thread was boosted for `wall` ns up to `now` and used `cpu` ns
    /// of CPU meanwhile (besides its waits on the clock, which the margin
    /// bounds: the caller leaves them out). If boosted threads used more than
    /// 1/[`BOOST_CPU_SHARE`] of their wall time lately, boosting is
    /// suspended for [`BOOST_BACKOFF_NS`].
    pub fn boost_spent(&mut self, now: Nanos, cpu: Nanos, wall: Nanos) {
        self.boost_cpu = self.boost_cpu.saturating_add(cpu.min(wall));
        self.boost_wall = self.boost_wall.saturating_add(wall);
        if self.boost_wall >= BOOST_BUDGET_SPAN_NS / 4
            && self.boost_cpu > self.boost_wall / BOOST_CPU_SHARE
        {
            self.suspended_until = now.saturating_add(BOOST_BACKOFF_NS);
            self.boost_cpu = 0;
            self.boost_wall = 0;
        }
        if self.boost_wall >= BOOST_BUDGET_SPAN_NS {
            self.boost_cpu /= 2;
            self.boost_wall /= 2;
        }
    }

    /// Whether boosting is suspended at `now` (over its budget lately).
    pub fn suspended(&self, now: Nanos) -> bool {
        now < self.suspended_until
    }

    /// The request of the wait in progress was admitted at `now`: its
    /// lateness is counted. A no-op without a tight wait in progress.
    pub fn admitted(&mut self, now: Nanos) {
        if let Some(due) = self.due.take() {
            self.lateness.add(now.saturating_sub(due));
        }
    }

    /// The wait in progress ended without a tight admission (the request
    /// was dropped, or is no longer tight after a limit change).
    pub fn abandon(&mut self) {
        self.due = None;
    }

    /// Whether a tight wait is in progress.
    pub fn waiting(&self) -> bool {
        self.due.is_some()
    }

    /// Admission lateness so far.
    pub fn lateness(&self) -> Lateness {
        self.lateness
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn margin_follows_the_window_maximum() {
        let mut p = Punctual::new(true);
        assert_eq!(p.margin(), EARLY_MIN_NS);
        p.woke(0, 2 * MS);
        assert_eq!(p.margin(), 2 * MS + MS / 2 + 20_000);
        for _ in 0..WINDOW - 1 {
            p.woke(0, 10_000);
        }
        assert_eq!(p.margin(), 2 * MS + MS / 2 + 20_000);
        p.woke(0, 10_000);
        assert_eq!(p.margin(), EARLY_MIN_NS);
        p.woke(0, 100 * MS);
        assert_eq!(p.margin(), EARLY_MAX_BOOSTED_NS);
        p.set_boost(false);
        assert_eq!(p.margin(), EARLY_MAX_NS);
    }

    #[test]
    fn a_wait_is_fine_then_spin_and_boosted_within_the_budget() {
        let mut p = Punctual::new(true);
        let m = p.margin();
        let due = 12_500_000;
        assert_eq!(
            p.plan(0, due),
            Step::Fine {
                at: due - m,
                boost: true
            }
        );
        assert_eq!(
            p.plan(due - m, due),
            Step::Spin {
                until: due,
                boost: true
            }
        );
        p.admitted(due + 3);
        assert_eq!(p.lateness().total_ns, 3);
        // A boosted thread that mostly sleeps is within the budget...
        let mut now = due;
        for _ in 0..100 {
            now += 12_500_000;
            p.boost_spent(now, 100_000, 12_500_000);
        }
        let step = p.plan(now, now + 10 * MS);
        assert!(matches!(step, Step::Fine { boost: true, .. }), "{step:?}");
        // ...one that works a third of the time is not, for a second.
        for _ in 0..200 {
            now += 12_500_000;
            p.boost_spent(now, 4_200_000, 12_500_000);
            if !matches!(p.plan(now, now + 10 * MS), Step::Fine { boost: true, .. }) {
                break;
            }
        }
        let step = p.plan(now, now + 10 * MS);
        assert!(matches!(step, Step::Fine { boost: false, .. }), "{step:?}");
        let later = now + BOOST_BACKOFF_NS;
        let step = p.plan(later, later + 10 * MS);
        assert!(matches!(step, Step::Fine { boost: true, .. }), "{step:?}");
        p.abandon();
        p.admitted(later + 10);
        assert_eq!(p.lateness().count, 1);
    }

    #[test]
    fn lateness_histogram() {
        let mut p = Punctual::new(false);
        for (i, late) in [0, 5_000, 50_000, 500_000, 5_000_000]
            .into_iter()
            .enumerate()
        {
            p.plan(i as u64 * 10 * MS, (i as u64 + 1) * 10 * MS);
            p.admitted((i as u64 + 1) * 10 * MS + late);
        }
        let l = p.lateness();
        assert_eq!(l.histogram, [1, 1, 1, 1, 1]);
        assert_eq!(l.max_ns, 5_000_000);
        assert_eq!(l.total_ns, 5_555_000);
    }
}
