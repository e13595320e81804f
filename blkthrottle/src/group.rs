//! Throttle groups: limits shared by several disks, served fairly.
//!
//! The scheduling core ([`GroupCore`]) is pure and single-threaded; the
//! shareable handle ([`ThrottleGroup`]) wraps it in `Arc<Mutex<..>>` so disks
//! of different VM threads can use one group.

use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::bucket::{Limiter, bits};
use crate::limits::{Limits, LimitsError, NUM_BUCKETS};
use crate::stats::{AtomicHistogram, Stats};
use crate::{Nanos, OpKind, Request};

/// Called (outside any lock) when a group member that is waiting may be
/// admissible earlier than it was told: after [`ThrottleGroup::set_limits`],
/// or when another member leaves or withdraws its request. Typically writes
/// to the device thread's eventfd so the disk re-polls.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// Default member weight (same scale as VM weights: 1..=10000, default 100).
pub const DEFAULT_WEIGHT: u32 = 100;

#[derive(Clone, Copy, Debug)]
enum State {
    /// No request registered.
    Idle,
    /// Head-of-queue request waiting for its turn and tokens.
    Pending {
        req: Request,
        /// Virtual start tag.
        start: u128,
        /// Registration order, breaks ties (round-robin among equals).
        seq: u64,
        /// When it was registered.
        since: Nanos,
        /// Earliest instant it may be granted, as of the last schedule.
        hint: Nanos,
        /// Whether it was refused at least once.
        refused: bool,
    },
    /// Granted and charged; the member picks it up at its next poll.
    Granted,
}

struct Member {
    weight: u32,
    /// Virtual finish tag of its last granted request.
    finish: u128,
    state: State,
    waker: Option<Waker>,
}

/// The pure group scheduler: shared buckets plus start-time fair queuing over
/// the members' head-of-queue requests.
///
/// * Each member has a virtual time. A registered request gets the start tag
///   `max(finish, V − lag)`, where `V` is the start tag of the last grant and
///   `lag` is twice the largest step seen (so a member that was idle gets at
///   most a bounded head start, while a backlogged member that is briefly
///   between two requests loses nothing).
/// * A grant advances the member's finish tag by `cost × 100 / weight`, where
///   `cost` is the request's *dominant* cost: the largest, over the group
///   buckets it touches, of `units / rate` (in picoseconds). Under a bytes
///   limit that is fairness in bytes, under an ops limit fairness in ops.
/// * Scheduling walks the pending requests in start-tag order and grants every
///   one whose buckets have the tokens *now*, reserving the buckets of any
///   request that has to wait: a later request that touches a reserved bucket
///   waits too (no starvation of large requests), a later request on disjoint
///   buckets (a read under `rbps` while a write waits for `wbps`) proceeds.
/// * Grants are made on behalf of whichever member is first in line,
///   whichever member's poll triggered the scheduling; the member picks its
///   grant up at its next poll. So members polling independently on their own
///   timers never wait for each other's threads.
pub(crate) struct GroupCore {
    limits: Limits,
    limiter: Limiter,
    members: Vec<Option<Member>>,
    /// Scratch buffer for the scheduling order (kept to avoid allocation).
    order: Vec<u32>,
    vclock: u128,
    max_step: u128,
    seq: u64,
    stats: Stats,
}

impl GroupCore {
    pub(crate) fn new(limits: &Limits, now: Nanos) -> GroupCore {
        GroupCore {
            limits: *limits,
            limiter: Limiter::new(limits, now),
            members: Vec::new(),
            order: Vec::new(),
            vclock: 0,
            max_step: 0,
            seq: 0,
            stats: Stats::default(),
        }
    }

    pub(crate) fn join(&mut self, weight: u32, waker: Option<Waker>) -> u32 {
        let m = Member {
            weight,
            // A newcomer starts level with the others.
            finish: self.vclock,
            state: State::Idle,
            waker,
        };
        let idx = match self.members.iter().position(Option::is_none) {
            Some(i) => {
                self.members[i] = Some(m);
                i
            }
            None => {
                self.members.push(Some(m));
                self.members.len() - 1
            }
        };
        let n = self.members.len();
        self.order.reserve(n.saturating_sub(self.order.len()));
        idx as u32
    }

    pub(crate) fn member_count(&self) -> usize {
        self.members.iter().flatten().count()
    }

    fn member(&mut self, id: u32) -> Option<&mut Member> {
        self.members.get_mut(id as usize).and_then(Option::as_mut)
    }

    pub(crate) fn set_weight(&mut self, id: u32, weight: u32) {
        if let Some(m) = self.member(id) {
            m.weight = weight;
        }
    }

    /// Wakers of all members that are waiting, except `except`.
    fn waiting_wakers(&self, except: Option<u32>) -> Vec<Waker> {
        self.members
            .iter()
            .enumerate()
            .filter(|(i, _)| Some(*i as u32) != except)
            .filter_map(|(_, m)| m.as_ref())
            .filter(|m| matches!(m.state, State::Pending { .. }))
            .filter_map(|m| m.waker.clone())
            .collect()
    }

    /// Drops the member's registered request. Returns whether it had already
    /// been granted (and charged), plus the wakers to call.
    pub(crate) fn withdraw(&mut self, id: u32) -> (bool, Vec<Waker>) {
        let Some(m) = self.member(id) else {
            return (false, Vec::new());
        };
        let prev = std::mem::replace(&mut m.state, State::Idle);
        match prev {
            State::Granted => (true, Vec::new()),
            State::Idle => (false, Vec::new()),
            State::Pending { .. } => (false, self.waiting_wakers(Some(id))),
        }
    }

    pub(crate) fn leave(&mut self, id: u32) -> Vec<Waker> {
        let (_, wakers) = self.withdraw(id);
        if let Some(slot) = self.members.get_mut(id as usize) {
            *slot = None;
        }
        wakers
    }

    pub(crate) fn limits(&self) -> Limits {
        self.limits
    }

    pub(crate) fn set_limits(&mut self, limits: &Limits, now: Nanos) -> Vec<Waker> {
        self.limits = *limits;
        self.limiter.set_limits(limits, now);
        self.max_step = 0;
        self.waiting_wakers(None)
    }

    pub(crate) fn stats(&self) -> Stats {
        self.stats.clone()
    }

    /// May member `id` send `req` (its head-of-queue request) now? `Ok` means
    /// granted and charged; `Err(t)` means poll again at `t` (> `now`).
    ///
    /// A member must keep polling with the same request until it is granted,
    /// or [`GroupCore::withdraw`] it.
    pub(crate) fn poll(&mut self, id: u32, req: Request, now: Nanos) -> Result<(), Nanos> {
        let lag = self.max_step.saturating_mul(2);
        let floor = self.vclock.saturating_sub(lag);
        let seq = self.seq;
        let Some(m) = self.member(id) else {
            // Not a member (cannot happen through `Throttle`): no group limit.
            return Ok(());
        };
        match &mut m.state {
            State::Granted => {
                m.state = State::Idle;
                return Ok(());
            }
            State::Idle => {
                m.state = State::Pending {
                    req,
                    start: m.finish.max(floor),
                    seq,
                    since: now,
                    hint: now,
                    refused: false,
                };
                self.seq += 1;
            }
            State::Pending { req: r, .. } => *r = req,
        }
        self.schedule(now);
        let Some(m) = self.member(id) else {
            return Ok(());
        };
        match &mut m.state {
            State::Pending { hint, refused, .. } => {
                *refused = true;
                Err(*hint)
            }
            _ => {
                m.state = State::Idle;
                Ok(())
            }
        }
    }

    fn schedule(&mut self, now: Nanos) {
        let mut order = std::mem::take(&mut self.order);
        order.clear();
        order.extend(
            self.members
                .iter()
                .enumerate()
                .filter(|(_, m)| {
                    matches!(
                        m,
                        Some(Member {
                            state: State::Pending { .. },
                            ..
                        })
                    )
                })
                .map(|(i, _)| i as u32),
        );
        let key = |m: &Option<Member>| match m {
            Some(Member {
                state: State::Pending { start, seq, .. },
                ..
            }) => (*start, *seq),
            _ => (u128::MAX, u64::MAX),
        };
        order.sort_unstable_by_key(|&i| key(&self.members[i as usize]));

        // Buckets reserved by a request earlier in line that has to wait, and
        // the earliest instant that request may go.
        let mut blocked = 0u8;
        let mut until = [0 as Nanos; NUM_BUCKETS];
        for &i in &order {
            let Some(m) = self.members[i as usize].as_mut() else {
                continue;
            };
            let State::Pending {
                req,
                start,
                since,
                refused,
                ref mut hint,
                ..
            } = m.state
            else {
                continue;
            };
            let mask = self.limiter.mask(&req);
            let ready = self.limiter.ready_at_mask(mask, &req, now);
            let conflict = mask & blocked;
            if conflict == 0 && ready <= now {
                self.limiter.charge(&req, now);
                let step = self.limiter.cost_ps(mask, &req) * DEFAULT_WEIGHT as u128
                    / m.weight.max(1) as u128;
                m.finish = start + step;
                m.state = State::Granted;
                self.vclock = self.vclock.max(start);
                self.max_step = self.max_step.max(step);
                self.stats
                    .admitted(req.kind, req.charged_bytes(), refused.then_some(since), now);
            } else {
                let h = bits(conflict).fold(ready, |h, b| h.max(until[b]));
                *hint = h;
                for b in bits(mask & !blocked) {
                    until[b] = h;
                }
                blocked |= mask;
            }
        }
        self.order = order;
    }
}

struct GroupShared {
    name: String,
    core: Mutex<GroupCore>,
    queue_depth: AtomicI64,
    latency: [AtomicHistogram; 3],
}

/// A named set of limits shared by several disks (all disks of a VM, or of
/// a class), served fairly among them.
///
/// Cheap to clone (an `Arc`); `Send + Sync`. Disks join with
/// [`crate::Throttle::join_group`] and then simply [`crate::Throttle::poll`]:
/// the disk's own limits and the group's are checked together.
///
/// **Fairness.** Among members that keep a request pending, service is split
/// in proportion to their weights, where a request's size is measured in the
/// group bucket it loads most (bytes under a bytes limit, ops under an ops
/// limit; the larger of `bytes/bps` and `1/iops` when both exist). Disks with
/// 4 KiB and 64 KiB requests under a `bps` limit get the same bytes/s; under
/// an `iops` limit the same ops/s. A member held back by its own disk limit
/// takes only what that allows; the others share the rest (max-min fairness).
///
/// **Wake-ups.** Every `Wait` answer is a lower bound of the instant the
/// request can go; polling then either admits it or returns a later instant.
/// Members never depend on each other's threads to make progress (a member
/// first in line is granted by whichever member polls). After
/// [`ThrottleGroup::set_limits`] or when a member leaves, waiting members'
/// [`Waker`]s are called so they can re-poll earlier.
#[derive(Clone)]
pub struct ThrottleGroup {
    inner: Arc<GroupShared>,
}

impl fmt::Debug for ThrottleGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThrottleGroup")
            .field("name", &self.inner.name)
            .field("limits", &self.limits())
            .finish_non_exhaustive()
    }
}

impl ThrottleGroup {
    /// Creates a group with `limits`, its buckets full at `now`.
    pub fn new(
        name: impl Into<String>,
        limits: &Limits,
        now: Nanos,
    ) -> Result<ThrottleGroup, LimitsError> {
        limits.validate()?;
        Ok(ThrottleGroup {
            inner: Arc::new(GroupShared {
                name: name.into(),
                core: Mutex::new(GroupCore::new(limits, now)),
                queue_depth: AtomicI64::new(0),
                latency: Default::default(),
            }),
        })
    }

    /// The group's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, GroupCore> {
        // The core keeps no invariant that a panic elsewhere could break
        // half-way in a way worse than a lost request: carry on.
        self.inner.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Current limits.
    pub fn limits(&self) -> Limits {
        self.lock().limits()
    }

    /// Changes the limits live: tokens already earned are kept (clamped to the
    /// new sizes), pending requests keep their place, removed limits release
    /// waiting requests at once. Waiting members' wakers are called.
    pub fn set_limits(&self, limits: &Limits, now: Nanos) -> Result<(), LimitsError> {
        limits.validate()?;
        let wakers = self.lock().set_limits(limits, now);
        wake(wakers);
        Ok(())
    }

    /// Number of member disks.
    pub fn member_count(&self) -> usize {
        self.lock().member_count()
    }

    /// Snapshot of the group's counters: requests and bytes admitted through
    /// the group, requests that had to wait for the group and for how long,
    /// the sum of the members' queue depths and their latency histograms.
    pub fn stats(&self) -> Stats {
        let mut s = self.lock().stats();
        s.queue_depth = self.inner.queue_depth.load(Ordering::Relaxed).max(0) as u64;
        s.read.latency = self.inner.latency[0].snapshot();
        s.write.latency = self.inner.latency[1].snapshot();
        s.other.latency = self.inner.latency[2].snapshot();
        s
    }

    /// Whether two handles refer to the same group.
    pub fn ptr_eq(&self, other: &ThrottleGroup) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    pub(crate) fn add_queue_depth(&self, d: i64) {
        self.inner.queue_depth.fetch_add(d, Ordering::Relaxed);
    }

    pub(crate) fn observe_latency(&self, kind: OpKind, ns: Nanos) {
        let i = match kind {
            OpKind::Read => 0,
            OpKind::Write => 1,
            OpKind::Other => 2,
        };
        self.inner.latency[i].observe(ns);
    }
}

pub(crate) fn wake(wakers: Vec<Waker>) {
    for w in wakers {
        w();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn iops(n: u64) -> Limits {
        Limits {
            iops: Some(n),
            burst_ops: Some(1),
            ..Default::default()
        }
    }

    #[test]
    fn round_robin_equal_requests() {
        let mut g = GroupCore::new(&iops(10), 0);
        let a = g.join(DEFAULT_WEIGHT, None);
        let b = g.join(DEFAULT_WEIGHT, None);
        let r = Request::read(1);
        assert_eq!(g.poll(a, r, 0), Ok(()));
        // b is now first in line (a's finish tag moved), token in 100 ms
        assert_eq!(g.poll(b, r, 0), Err(S / 10));
        // a registers its next request: not its turn, told b's instant
        assert_eq!(g.poll(a, r, 0), Err(S / 10));
        // at 100 ms a polls first: b is granted on its behalf, a waits again
        assert_eq!(g.poll(a, r, S / 10), Err(2 * S / 10));
        assert_eq!(g.poll(b, r, S / 10), Ok(()));
        // b is behind a now; told the earliest instant anything can change
        assert_eq!(g.poll(b, r, S / 10), Err(2 * S / 10));
        assert_eq!(g.poll(a, r, 2 * S / 10), Ok(()));
        assert_eq!(g.poll(b, r, 2 * S / 10), Err(3 * S / 10));
        let st = g.stats();
        assert_eq!(st.read.ops, 3);
        assert_eq!(st.throttled_requests, 2);
        assert_eq!(st.throttled_ns, 3 * S / 10);
    }

    #[test]
    fn disjoint_buckets_do_not_block() {
        let l = Limits::parse("rbps=100,wbps=1000000,burst_bytes=100").unwrap();
        let mut g = GroupCore::new(&l, 0);
        let a = g.join(DEFAULT_WEIGHT, None);
        let b = g.join(DEFAULT_WEIGHT, None);
        assert_eq!(g.poll(a, Request::read(100), 0), Ok(()));
        assert_eq!(g.poll(a, Request::read(100), 0), Err(S));
        // b's writes use other buckets: they go although a waits in front
        for _ in 0..10 {
            assert_eq!(g.poll(b, Request::write(10), 0), Ok(()));
        }
    }

    #[test]
    fn big_request_is_not_starved_by_small_ones() {
        let l = Limits::parse("bps=1000,burst_bytes=1000").unwrap();
        let mut g = GroupCore::new(&l, 0);
        let small = g.join(DEFAULT_WEIGHT, None);
        let big = g.join(DEFAULT_WEIGHT, None);
        assert_eq!(g.poll(small, Request::write(600), 0), Ok(()));
        // big (1000 B) is first in line now and needs a full bucket: 600 ms
        assert_eq!(g.poll(big, Request::write(1000), 0), Err(600_000_000));
        // small would fit at 0 + 100 ms, but the bucket is reserved for big
        assert_eq!(
            g.poll(small, Request::write(100), 100_000_000),
            Err(600_000_000)
        );
        assert_eq!(g.poll(big, Request::write(1000), 600_000_000), Ok(()));
    }

    #[test]
    fn withdraw_and_leave_wake_waiters() {
        use std::sync::atomic::AtomicUsize;
        let woke = Arc::new(AtomicUsize::new(0));
        let w = woke.clone();
        let waker: Waker = Arc::new(move || {
            w.fetch_add(1, Ordering::Relaxed);
        });
        let mut g = GroupCore::new(&iops(1), 0);
        let a = g.join(DEFAULT_WEIGHT, None);
        let b = g.join(DEFAULT_WEIGHT, Some(waker));
        assert_eq!(g.poll(a, Request::other(), 0), Ok(()));
        assert!(g.poll(a, Request::other(), 0).is_err());
        assert!(g.poll(b, Request::other(), 0).is_err());
        let (granted, wakers) = g.withdraw(a);
        assert!(!granted);
        wake(wakers);
        assert_eq!(woke.load(Ordering::Relaxed), 1);
        wake(g.set_limits(&Limits::UNLIMITED, 0));
        assert_eq!(woke.load(Ordering::Relaxed), 2);
        assert_eq!(g.poll(b, Request::other(), 0), Ok(()));
        assert!(g.leave(b).is_empty());
        assert_eq!(g.member_count(), 1);
    }
}
