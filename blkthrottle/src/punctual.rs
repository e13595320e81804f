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
//!   on time but the woken thread waits for a CPU; measured below), the wait
//!   runs in two stages, so that the thread is boosted only for the last
//!   lead + margin before the due instant and never for more than half of
//!   a wait ([`BOOST_SHARE`]): a [`Step::Coarse`] sleep at normal priority,
//!   then a [`Step::Fine`] one boosted, then the spin, still boosted; the
//!   caller drops the boost as soon as the request is admitted. Fine
//!   wake-ups are sampled for the margin, coarse ones for the lead
//!   ([`Punctual::lead`]: the same rule, at least [`BOOST_LEAD_NS`]).
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
//! is [`EARLY_MAX_NS`] without the boost and [`EARLY_MAX_BOOSTED_NS`] with it.
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
/// Largest early margin when the caller cannot boost its thread: spinning
/// longer at normal priority on a busy host gets the thread preempted.
pub const EARLY_MAX_NS: Nanos = 1_000_000;
/// Largest early margin when the caller's thread is boosted for the wait.
pub const EARLY_MAX_BOOSTED_NS: Nanos = 4_000_000;
/// Least time between the coarse wake-up and the fine one (the boost
/// starts at the coarse one).
pub const BOOST_LEAD_NS: Nanos = 1_000_000;
/// Only waits at least this many times lead + margin long are
/// boosted: the boost then lasts at most that (plus the lateness), so for at
/// most about half of the wait, and of the thread's wall time. (What the
/// thread does while boosted is bounded as a whole by the kernel's
/// real-time throttling, `sched_rt_runtime_us`.)
pub const BOOST_SHARE: Nanos = 2;
/// Largest lead of the coarse wake-up.
pub const BOOST_LEAD_MAX_NS: Nanos = 4_000_000;
/// Wake-ups remembered for the margin.
pub const WINDOW: usize = 16;

/// The largest of the last [`WINDOW`] samples.
#[derive(Clone, Debug, Default)]
struct MaxWindow {
    samples: [Nanos; WINDOW],
    filled: usize,
    next: usize,
}

impl MaxWindow {
    fn add(&mut self, late: Nanos) {
        if let Some(s) = self.samples.get_mut(self.next) {
            *s = late.min(EARLY_MAX_BOOSTED_NS.max(BOOST_LEAD_MAX_NS));
        }
        self.next = (self.next + 1) % WINDOW;
        self.filled = (self.filled + 1).min(WINDOW);
    }

    /// The largest sample × 5/4 + 20 µs (20 µs with none).
    fn margin(&self) -> Nanos {
        let worst = self.samples.iter().take(self.filled).copied().max();
        let worst = worst.unwrap_or(0);
        worst + worst / 4 + 20_000
    }
}

/// What to do for a tight wait, from [`Punctual::plan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Arm the timer for `at`, sleep at normal priority, report the
    /// wake-up with [`Punctual::woke_coarse`], and plan again.
    Coarse {
        /// Absolute instant.
        at: Nanos,
    },
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
        self.histogram[i] += 1;
    }
}

/// The caller's side of a tight wait: when to wake, and how late it was.
/// See the module docs.
#[derive(Clone, Debug)]
pub struct Punctual {
    /// Lateness of the fine (boosted) wake-ups.
    fine: MaxWindow,
    /// Lateness of the coarse ones (normal priority).
    coarse: MaxWindow,
    boost: bool,
    /// The due instant of the wait in progress, and when it started.
    due: Option<(Nanos, Nanos)>,
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
            fine: MaxWindow::default(),
            coarse: MaxWindow::default(),
            boost,
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

    /// The largest early margin of a boosted wait, if the caller can
    /// boost, or of one that is not.
    pub fn cap(&self) -> Nanos {
        if self.boost {
            EARLY_MAX_BOOSTED_NS
        } else {
            EARLY_MAX_NS
        }
    }

    /// How early to wake before a due instant: the largest lateness of the
    /// last [`WINDOW`] fine wake-ups × 5/4 + 20 µs, within
    /// [`EARLY_MIN_NS`]..=[`Self::cap`].
    pub fn margin(&self) -> Nanos {
        self.margin_within(self.cap())
    }

    fn margin_within(&self, cap: Nanos) -> Nanos {
        self.fine.margin().clamp(EARLY_MIN_NS, cap)
    }

    /// How long before the fine wake-up the coarse one is planned: the same
    /// rule over the coarse wake-ups, within
    /// [`BOOST_LEAD_NS`]..=[`BOOST_LEAD_MAX_NS`].
    pub fn lead(&self) -> Nanos {
        self.coarse
            .margin()
            .clamp(BOOST_LEAD_NS, BOOST_LEAD_MAX_NS)
    }

    /// The next step of a tight wait for a request due at `until`, at
    /// `now`. A new `until` starts a new wait (the previous one's request
    /// was admitted, dropped, or its limits changed).
    pub fn plan(&mut self, now: Nanos, until: Nanos) -> Step {
        let since = match self.due {
            Some((d, s)) if d == until => s,
            _ => now,
        };
        self.due = Some((until, since));
        let boosted = self.margin_within(EARLY_MAX_BOOSTED_NS);
        let lead = self.lead();
        let boost =
            self.boost && until.saturating_sub(since) >= BOOST_SHARE * (lead + boosted);
        let m = if boost {
            boosted
        } else {
            self.margin_within(EARLY_MAX_NS)
        };
        if boost && until > now.saturating_add(m + lead) {
            Step::Coarse {
                at: until - m - lead,
            }
        } else if until > now.saturating_add(m) {
            Step::Fine {
                at: until - m,
                boost,
            }
        } else {
            Step::Spin { until, boost }
        }
    }

    /// A fine wake-up armed for `armed_for` ran at `now`.
    pub fn woke(&mut self, armed_for: Nanos, now: Nanos) {
        self.fine.add(now.saturating_sub(armed_for));
    }

    /// A coarse wake-up armed for `armed_for` ran at `now`.
    pub fn woke_coarse(&mut self, armed_for: Nanos, now: Nanos) {
        self.coarse.add(now.saturating_sub(armed_for));
    }

    /// The request of the wait in progress was admitted at `now`: its
    /// lateness is counted. A no-op without a tight wait in progress.
    pub fn admitted(&mut self, now: Nanos) {
        if let Some((due, _)) = self.due.take() {
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
    fn a_long_wait_goes_coarse_fine_spin_and_a_short_one_is_not_boosted() {
        let mut p = Punctual::new(true);
        let m = p.margin();
        let due = 12_500_000;
        assert_eq!(
            p.plan(0, due),
            Step::Coarse {
                at: due - m - BOOST_LEAD_NS
            }
        );
        assert_eq!(
            p.plan(due - m - BOOST_LEAD_NS, due),
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
        // A wait shorter than BOOST_SHARE × (lead + margin): not boosted.
        let due2 = due + 2 * MS;
        assert_eq!(
            p.plan(due, due2),
            Step::Fine {
                at: due2 - m,
                boost: false
            }
        );
        assert_eq!(
            p.plan(due2 - 1, due2),
            Step::Spin {
                until: due2,
                boost: false
            }
        );
        p.abandon();
        p.admitted(due2 + 10);
        assert_eq!(p.lateness().count, 1);
    }

    #[test]
    fn lateness_histogram() {
        let mut p = Punctual::new(false);
        for (i, late) in [0, 5_000, 50_000, 500_000, 5_000_000].into_iter().enumerate() {
            p.plan(i as u64 * 10 * MS, (i as u64 + 1) * 10 * MS);
            p.admitted((i as u64 + 1) * 10 * MS + late);
        }
        let l = p.lateness();
        assert_eq!(l.histogram, [1, 1, 1, 1, 1]);
        assert_eq!(l.max_ns, 5_000_000);
        assert_eq!(l.total_ns, 5_555_000);
    }
}
