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
use crate::page::PageMem;
use crate::shared::{GroupBuckets, SlotId, SlotState};
use crate::stats::{AtomicHistogram, Stats};
use crate::{Nanos, OpKind, Request};

/// Called (outside any lock, possibly from another member's thread) when a
/// group member that is waiting may be admissible earlier than it was told:
/// after [`ThrottleGroup::set_limits`], when another member leaves or
/// withdraws its request, or when the group granted its request on its behalf
/// before the instant it was told (this happens when it was told to retry
/// because it had run ahead of the others). Typically writes to the device
/// thread's eventfd; the device then re-polls that disk's head request.
/// Without a waker everything still works; the disk just picks up at the
/// instant it was told.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// Default member weight (same scale as VM weights: 1..=10000, default 100).
pub const DEFAULT_WEIGHT: u32 = 100;

/// Checks a member weight: `1..=10000`.
pub fn check_weight(weight: u32) -> Result<u32, crate::LimitsError> {
    if (1..=10_000).contains(&weight) {
        Ok(weight)
    } else {
        Err(crate::LimitsError::InvalidWeight(weight))
    }
}

/// Default fairness window, in nanoseconds of the group's refill time: how
/// far (in weighted service) a member may run ahead of a backlogged member
/// that has not yet picked up its grant. See [`ThrottleGroup`].
pub const DEFAULT_FAIRNESS_WINDOW_NS: u64 = 2_000_000;

/// A granted request not picked up within this time no longer holds the
/// others back (its thread is stuck, or the request was dropped without
/// `cancel`).
const STALE_GRANT_NS: u64 = 50_000_000;

/// Picoseconds per nanosecond: virtual time is in picoseconds.
const PS: u128 = 1000;

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
        /// The instant the member was last told to poll again.
        told: Nanos,
        /// Whether it was refused at least once.
        refused: bool,
    },
    /// Granted and charged at `at`; the member picks it up at its next poll.
    /// `mask`: the group buckets the request touched.
    Granted { at: Nanos, mask: u8 },
}

struct Member {
    weight: u32,
    /// Virtual finish tag of its last granted request.
    finish: u128,
    state: State,
    waker: Option<Waker>,
    /// Its slot in a shared page (cross-process fairness).
    slot: Option<SlotId>,
}

/// The pure group scheduler: shared buckets plus start-time fair queuing over
/// the members' head-of-queue requests.
///
/// * Each member has a virtual time (picoseconds). A registered request gets
///   the start tag `max(finish, V − lag)`, where `V` is the start tag of the
///   last grant and `lag` is the fairness window plus twice the largest step
///   seen: a member that was idle gets at most a bounded head start, while a
///   backlogged member that is briefly between two requests loses nothing.
/// * A grant advances the member's finish tag by `cost × 100 / weight`, where
///   `cost` is the request's *dominant* cost: the largest, over the group
///   buckets it touches, of `units / rate`. Under a bytes limit that is
///   fairness in bytes, under an ops limit fairness in ops.
/// * Scheduling walks the pending requests in start-tag order and grants every
///   one whose buckets have the tokens *now*, reserving the buckets of any
///   request that has to wait: a later request that touches a reserved bucket
///   waits too (no starvation of large requests), a later request on disjoint
///   buckets (a read under `rbps` while a write waits for `wbps`) proceeds.
/// * Grants are made on behalf of whichever member is first in line, whatever
///   member's poll triggered the scheduling; the member picks its grant up at
///   its next poll. With exact timers that poll is at the very instant of the
///   grant (the member was told that instant); with a coarse tick, at the same
///   tick.
/// * A member holding a grant it has not picked up yet is still backlogged:
///   on each bucket, nobody may start a request whose start tag exceeds such a
///   member's finish tag by more than the fairness window `W`; they retry
///   `W/2` later (and are granted on behalf meanwhile when their turn comes).
///   This is what keeps the first member to poll on a coarse tick from taking
///   all the tokens of that tick. A grant not picked up within 50 ms stops
///   holding the others back.
pub(crate) struct GroupCore {
    limits: Limits,
    limiter: GroupBuckets,
    members: Vec<Option<Member>>,
    /// Scratch buffer for the scheduling order (kept to avoid allocation).
    order: Vec<u32>,
    vclock: u128,
    max_step: u128,
    /// Fairness window in picoseconds of virtual time.
    window: u128,
    seq: u64,
    stats: Stats,
    /// Slots of a shared page held by this core's members, a bit each.
    own_slots: u64,
}

impl GroupCore {
    pub(crate) fn new(limits: &Limits, now: Nanos) -> GroupCore {
        GroupCore::with_buckets(limits, GroupBuckets::Local(Limiter::new(limits, now)))
    }

    /// A core over `limiter` (a shared page's buckets, see [`crate::page`]).
    pub(crate) fn with_buckets(limits: &Limits, limiter: GroupBuckets) -> GroupCore {
        GroupCore {
            limits: *limits,
            limiter,
            members: Vec::new(),
            order: Vec::new(),
            vclock: 0,
            max_step: 0,
            window: DEFAULT_FAIRNESS_WINDOW_NS as u128 * PS,
            seq: 0,
            stats: Stats::default(),
            own_slots: 0,
        }
    }

    pub(crate) fn join(&mut self, weight: u32, waker: Option<Waker>) -> u32 {
        let mut slot = None;
        if let GroupBuckets::Shared(s) = &self.limiter {
            self.vclock = self.vclock.max(s.vclock());
            slot = s.claim_slot(None);
            if let Some(id) = slot {
                self.own_slots |= 1 << id.index;
            }
        }
        let m = Member {
            weight,
            // A newcomer starts level with the others.
            finish: self.vclock,
            state: State::Idle,
            waker,
            slot,
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

    pub(crate) fn set_window(&mut self, ns: u64) {
        self.window = ns as u128 * PS;
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
        self.publish(None, 0);
        match prev {
            State::Granted { .. } => (true, Vec::new()),
            State::Idle => (false, Vec::new()),
            State::Pending { .. } => (false, self.waiting_wakers(Some(id))),
        }
    }

    pub(crate) fn leave(&mut self, id: u32) -> Vec<Waker> {
        let (_, wakers) = self.withdraw(id);
        if let Some(m) = self.members.get_mut(id as usize).and_then(Option::take)
            && let (Some(slot), GroupBuckets::Shared(s)) = (m.slot, &self.limiter)
        {
            s.release_slot(slot);
            self.own_slots &= !(1 << slot.index);
        }
        wakers
    }

    /// Writes the members' states into their slots of a shared page (a
    /// no-op in one process): `polling` just polled at `now`. A member
    /// whose slot was taken from it claims another when it polls.
    fn publish(&mut self, polling: Option<u32>, now: Nanos) {
        let GroupBuckets::Shared(s) = &self.limiter else {
            return;
        };
        for (i, m) in self.members.iter_mut().enumerate() {
            let Some(m) = m else { continue };
            let polled = polling == Some(i as u32);
            if m.slot.is_none() && polled {
                m.slot = s.claim_slot(Some(now));
                if let Some(id) = m.slot {
                    self.own_slots |= 1 << id.index;
                }
            }
            let Some(id) = m.slot else { continue };
            let (tag, mask, due) = match m.state {
                State::Idle => (m.finish, 0, now),
                State::Pending {
                    req, start, told, ..
                } => (start, s.mask(&req), told),
                State::Granted { at, mask } => (m.finish, mask, at),
            };
            let st = SlotState {
                tag,
                mask,
                due,
                beat: polled.then_some(now),
            };
            if !s.publish_slot(id, st) {
                self.own_slots &= !(1 << id.index);
                m.slot = None;
            }
        }
    }

    pub(crate) fn limits(&self) -> Limits {
        self.limits
    }

    pub(crate) fn set_limits(&mut self, limits: &Limits, now: Nanos) -> Vec<Waker> {
        self.limits = *limits;
        self.limiter.set_limits(limits, now);
        // Virtual times are in units of the old rates: start everyone level.
        // Pending requests keep their order (their sequence numbers). On a
        // shared page, level with the other processes' latest grant (a
        // reset to 0 would put these members far ahead of them in line).
        let base = match &self.limiter {
            GroupBuckets::Shared(s) => s.vclock(),
            GroupBuckets::Local(_) => 0,
        };
        self.max_step = 0;
        self.vclock = base;
        for m in self.members.iter_mut().flatten() {
            m.finish = base;
            if let State::Pending { start, .. } = &mut m.state {
                *start = base;
            }
        }
        self.waiting_wakers(None)
    }

    pub(crate) fn stats(&self) -> Stats {
        self.stats.clone()
    }

    /// May member `id` send `req` (its head-of-queue request) now? `Ok` means
    /// granted and charged; `Err(t)` means poll again at `t` (> `now`).
    /// Also returns the wakers of members granted on their behalf before the
    /// instant they were told (they would pick their grant up late): call
    /// them after releasing the lock. Usually empty (no allocation).
    ///
    /// A member must keep polling with the same request until it is granted,
    /// or [`GroupCore::withdraw`] it.
    pub(crate) fn poll(
        &mut self,
        id: u32,
        req: Request,
        now: Nanos,
    ) -> (Result<(), Nanos>, Vec<Waker>) {
        if let GroupBuckets::Shared(s) = &self.limiter {
            self.vclock = self.vclock.max(s.vclock());
        }
        let lag = self.max_step.saturating_mul(2).saturating_add(self.window);
        let floor = self.vclock.saturating_sub(lag);
        let seq = self.seq;
        let Some(m) = self.member(id) else {
            // Not a member (cannot happen through `Throttle`): no group limit.
            return (Ok(()), Vec::new());
        };
        match &mut m.state {
            State::Granted { .. } => {
                m.state = State::Idle;
                self.publish(Some(id), now);
                return (Ok(()), Vec::new());
            }
            State::Idle => {
                m.state = State::Pending {
                    req,
                    start: m.finish.max(floor),
                    seq,
                    since: now,
                    hint: now,
                    told: now,
                    refused: false,
                };
                self.seq += 1;
            }
            State::Pending { req: r, .. } => *r = req,
        }
        let wakers = self.schedule(id, now);
        let Some(m) = self.member(id) else {
            return (Ok(()), wakers);
        };
        let r = match &mut m.state {
            State::Pending {
                hint,
                told,
                refused,
                ..
            } => {
                *refused = true;
                *told = *hint;
                Err(*hint)
            }
            _ => {
                m.state = State::Idle;
                Ok(())
            }
        };
        self.publish(Some(id), now);
        (r, wakers)
    }

    /// Grants, in start-tag order, every pending request that may go now;
    /// leaves an up-to-date hint in `polling`'s state.
    fn schedule(&mut self, polling: u32, now: Nanos) -> Vec<Waker> {
        let mut wakers = Vec::new();
        let mut order = std::mem::take(&mut self.order);
        order.clear();
        // Lowest virtual time among members holding a grant they have not
        // picked up yet: they are backlogged too, their next request starts
        // at their finish tag.
        // Per bucket, since members on disjoint buckets do not compete.
        // Members of other processes sharing the page that are backlogged
        // count the same way: nobody here runs more than the window ahead
        // of their place in line (see `crate::page`, "Fairness").
        let mut min_granted = match &self.limiter {
            GroupBuckets::Shared(s) => s.remote_min(now, self.own_slots),
            GroupBuckets::Local(_) => [u128::MAX; NUM_BUCKETS],
        };
        for (i, m) in self.members.iter().enumerate() {
            match m {
                Some(Member {
                    state: State::Pending { .. },
                    ..
                }) => order.push(i as u32),
                Some(Member {
                    state: State::Granted { at, mask },
                    finish,
                    ..
                }) if now < at.saturating_add(STALE_GRANT_NS) => {
                    for b in bits(*mask) {
                        min_granted[b] = min_granted[b].min(*finish);
                    }
                }
                _ => {}
            }
        }
        let key = |m: &Option<Member>| match m {
            Some(Member {
                state: State::Pending { start, seq, .. },
                ..
            }) => (*start, *seq),
            _ => (u128::MAX, u64::MAX),
        };
        order.sort_unstable_by_key(|&i| key(&self.members[i as usize]));

        // When a member is too far ahead of one that has not picked up its
        // grant yet, it retries after half a window.
        let retry = now.saturating_add(((self.window / PS) as u64 / 2).max(1));
        // Buckets reserved by a request earlier in line that has to wait, and
        // the earliest instant that request may go.
        let mut blocked = 0u8;
        let mut until = [0 as Nanos; NUM_BUCKETS];
        let all = self.limiter.configured();
        let mut seen_polling = false;
        for &i in &order {
            if seen_polling && blocked == all {
                // Nothing further in line can go now, and nobody further
                // needs a hint.
                break;
            }
            seen_polling |= i == polling;
            let Some(m) = self.members[i as usize].as_mut() else {
                continue;
            };
            let State::Pending {
                req,
                start,
                since,
                refused,
                told,
                ref mut hint,
                ..
            } = m.state
            else {
                continue;
            };
            let mask = self.limiter.mask(&req);
            let conflict = mask & blocked;
            let in_window = bits(mask).all(|b| start <= min_granted[b].saturating_add(self.window));
            let fresh = mask & !blocked;
            if i != polling && fresh == 0 && (conflict != 0 || !in_window) {
                // Waits behind others on all its buckets: its hint is
                // computed when it polls; it reserves nothing new.
                continue;
            }
            // Charged here if it may go (atomically for a shared page).
            let ready = if conflict == 0 && in_window {
                self.limiter.try_admit_mask(mask, &req, now)
            } else {
                Err(self.limiter.ready_at_mask(mask, &req, now))
            };
            if ready.is_ok() {
                let step = self.limiter.cost_ps(mask, &req) * DEFAULT_WEIGHT as u128
                    / m.weight.max(1) as u128;
                m.finish = start.saturating_add(step);
                m.state = State::Granted { at: now, mask };
                if i != polling && refused && told > now {
                    // It sleeps until `told`: let it pick the grant up now.
                    wakers.extend(m.waker.clone());
                }
                for b in bits(mask) {
                    min_granted[b] = min_granted[b].min(m.finish);
                }
                self.vclock = self.vclock.max(start);
                if let GroupBuckets::Shared(s) = &self.limiter {
                    s.raise_vclock(start);
                }
                self.max_step = self.max_step.max(step);
                self.stats
                    .admitted(req.kind, req.charged_bytes(), refused.then_some(since), now);
                self.limiter.note_admitted(
                    req.kind,
                    req.charged_bytes(),
                    refused.then_some(since),
                    now,
                );
            } else {
                let ready = ready.err().unwrap_or(now);
                let mut h = bits(conflict).fold(ready, |h, b| h.max(until[b]));
                if !in_window {
                    h = h.max(retry);
                }
                *hint = h;
                for b in bits(fresh) {
                    until[b] = h;
                }
                blocked |= mask;
            }
        }
        self.order = order;
        wakers
    }
}

pub(crate) struct GroupShared {
    pub(crate) name: String,
    pub(crate) core: Mutex<GroupCore>,
    pub(crate) queue_depth: AtomicI64,
    pub(crate) latency: [AtomicHistogram; 3],
    /// The page of a group shared across processes: its counters are the
    /// group's (all processes').
    pub(crate) page: Option<Arc<dyn PageMem>>,
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
/// The fairness bound: two members that stay backlogged differ in weighted
/// service by at most the fairness window ([`DEFAULT_FAIRNESS_WINDOW_NS`] =
/// 2 ms of the group's rate) plus about one request of each; over 10 s with 8
/// members that is well under 1 %.
///
/// **Wake-ups.** Every `Wait` answer is a lower bound of the instant the
/// request can go; polling then either admits it or returns a later instant.
/// Members never depend on each other's threads to make progress (a member
/// first in line is granted by whichever member polls). On a shared page
/// ([`ThrottleGroup::attach`]) the members of other processes are in line
/// too, through their slots in the page; they are not granted on behalf,
/// and one that stops polling holds the others back for at most
/// [`crate::page::SLOT_STALE_NS`] past its told instant. After
/// [`ThrottleGroup::set_limits`] or when a member leaves, waiting members'
/// [`Waker`]s are called so they can re-poll earlier.
#[derive(Clone)]
pub struct ThrottleGroup {
    pub(crate) inner: Arc<GroupShared>,
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
                page: None,
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
        tracing::debug!(group = %self.inner.name, %limits, "throttle group limits changed");
        let wakers = self.lock().set_limits(limits, now);
        wake(wakers);
        Ok(())
    }

    /// Sets the fairness window (default [`DEFAULT_FAIRNESS_WINDOW_NS`], in
    /// nanoseconds of the group's refill time). Smaller is fairer over short
    /// intervals; it should exceed the members' timer granularity for the
    /// group to reach its full rate when they poll on a coarse tick.
    pub fn set_fairness_window(&self, ns: u64) {
        self.lock().set_window(ns);
    }

    /// Number of member disks.
    pub fn member_count(&self) -> usize {
        self.lock().member_count()
    }

    /// Snapshot of the group's counters: requests and bytes admitted through
    /// the group, requests that had to wait for the group and for how long,
    /// the sum of the members' queue depths and their latency histograms.
    pub fn stats(&self) -> Stats {
        if let Some(p) = &self.inner.page {
            return p.page().stats().snapshot();
        }
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
        if let Some(p) = &self.inner.page {
            p.page().stats().add_queue_depth(d);
        }
    }

    pub(crate) fn observe_latency(&self, kind: OpKind, ns: Nanos) {
        let i = match kind {
            OpKind::Read => 0,
            OpKind::Write => 1,
            OpKind::Other => 2,
        };
        self.inner.latency[i].observe(ns);
        if let Some(p) = &self.inner.page {
            p.page().stats().observe_latency(kind, ns);
        }
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

    fn poll(g: &mut GroupCore, id: u32, req: Request, now: Nanos) -> Result<(), Nanos> {
        g.poll(id, req, now).0
    }

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
        assert_eq!(poll(&mut g, a, r, 0), Ok(()));
        // b is now first in line (a's finish tag moved), token in 100 ms
        assert_eq!(poll(&mut g, b, r, 0), Err(S / 10));
        // a registers its next request: not its turn, told b's instant
        assert_eq!(poll(&mut g, a, r, 0), Err(S / 10));
        // at 100 ms a polls first: b is granted on its behalf, a waits again
        assert_eq!(poll(&mut g, a, r, S / 10), Err(2 * S / 10));
        assert_eq!(poll(&mut g, b, r, S / 10), Ok(()));
        // b is behind a now; told the earliest instant anything can change
        assert_eq!(poll(&mut g, b, r, S / 10), Err(2 * S / 10));
        assert_eq!(poll(&mut g, a, r, 2 * S / 10), Ok(()));
        assert_eq!(poll(&mut g, b, r, 2 * S / 10), Err(3 * S / 10));
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
        assert_eq!(poll(&mut g, a, Request::read(100), 0), Ok(()));
        assert_eq!(poll(&mut g, a, Request::read(100), 0), Err(S));
        // b's writes use other buckets: they go although a waits in front
        for _ in 0..10 {
            assert_eq!(poll(&mut g, b, Request::write(10), 0), Ok(()));
        }
    }

    #[test]
    fn big_request_is_not_starved_by_small_ones() {
        let l = Limits::parse("bps=1000,burst_bytes=1000").unwrap();
        let mut g = GroupCore::new(&l, 0);
        let small = g.join(DEFAULT_WEIGHT, None);
        let big = g.join(DEFAULT_WEIGHT, None);
        assert_eq!(poll(&mut g, small, Request::write(600), 0), Ok(()));
        // big (1000 B) is first in line now and needs a full bucket: 600 ms
        assert_eq!(poll(&mut g, big, Request::write(1000), 0), Err(600_000_000));
        // small would fit at 0 + 100 ms, but the bucket is reserved for big
        assert_eq!(
            poll(&mut g, small, Request::write(100), 100_000_000),
            Err(600_000_000)
        );
        assert_eq!(poll(&mut g, big, Request::write(1000), 600_000_000), Ok(()));
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
        assert_eq!(poll(&mut g, a, Request::other(), 0), Ok(()));
        assert!(poll(&mut g, a, Request::other(), 0).is_err());
        assert!(poll(&mut g, b, Request::other(), 0).is_err());
        let (granted, wakers) = g.withdraw(a);
        assert!(!granted);
        wake(wakers);
        assert_eq!(woke.load(Ordering::Relaxed), 1);
        wake(g.set_limits(&Limits::UNLIMITED, 0));
        assert_eq!(woke.load(Ordering::Relaxed), 2);
        assert_eq!(poll(&mut g, b, Request::other(), 0), Ok(()));
        assert!(g.leave(b).is_empty());
        assert_eq!(g.member_count(), 1);
    }
}
