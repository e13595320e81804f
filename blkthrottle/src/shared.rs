//! The limiter of a throttle group whose buckets are in a [`GroupPage`]
//! shared by several processes (see [`crate::page`] for the algorithm, the
//! garbage bound and who writes what), and the group handles over one.

use std::sync::atomic::{AtomicI64, AtomicU32, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use portable_atomic::AtomicI128;

use crate::bucket::{Limiter, SCALE, bits};
use crate::group::{GroupCore, GroupShared, ThrottleGroup};
use crate::limits::{BucketConfig, Limits, NUM_BUCKETS};
use crate::page::{
    CAS_TRIES, GROUP_PAGE_MAGIC, GROUP_PAGE_VERSION, GroupPage, MAX_SKEW_NS, PageError, PageMem,
    RETRY_NS, SLOT_RECLAIM_NS, SLOTS, level, need, threshold, wait_ns,
};
use crate::{Nanos, OpKind, Request};

/// The limiter of a group whose buckets are in a [`GroupPage`].
pub(crate) struct SharedLimiter {
    mem: Arc<dyn PageMem>,
    owner: bool,
    /// The handle's own admissions against the trusted limits.
    shadow: Limiter,
    /// The page's limits as of `seq`.
    seq: u64,
    cfgs: [Option<BucketConfig>; NUM_BUCKETS],
    page_configured: u8,
    epoch: Nanos,
}

/// Claim tokens of this process's members: the process id and a counter,
/// so two members (of any processes) never hold the same token.
static NEXT_TOKEN: AtomicU32 = AtomicU32::new(1);

fn new_token() -> u64 {
    let n = NEXT_TOKEN.fetch_add(1, SeqCst);
    ((std::process::id() as u64) << 32 | n as u64).max(1)
}

/// A member's slot in the page: its index and claim token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SlotId {
    pub(crate) index: usize,
    pub(crate) token: u64,
}

/// What a member publishes in its slot.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SlotState {
    /// Its place in line (virtual time, ps).
    pub(crate) tag: u128,
    /// Buckets of its head request; 0 = not backlogged.
    pub(crate) mask: u8,
    /// When it will poll next.
    pub(crate) due: Nanos,
    /// When it polled, if it just did.
    pub(crate) beat: Option<Nanos>,
}

/// One bucket as read for a decision.
#[derive(Clone, Copy)]
struct Seen {
    i: usize,
    cfg: BucketConfig,
    z: i128,
    /// One-time tokens as read (what the compare-and-swap expects).
    ot_raw: u64,
    /// The same, clamped to the configured amount.
    ot: u64,
    level: i128,
    n: u64,
}

impl SharedLimiter {
    fn check(mem: &dyn PageMem) -> Result<(), PageError> {
        if !AtomicI128::is_lock_free() {
            return Err(PageError::NotLockFree);
        }
        let p = mem.page();
        let m = p.magic.load(SeqCst);
        if m != GROUP_PAGE_MAGIC {
            return Err(PageError::BadMagic(m));
        }
        let v = p.version.load(SeqCst);
        if v != GROUP_PAGE_VERSION {
            return Err(PageError::BadVersion(v));
        }
        Ok(())
    }

    /// The owner: initialises the page with `limits`, buckets full at `now`.
    pub(crate) fn create(
        mem: Arc<dyn PageMem>,
        limits: &Limits,
        now: Nanos,
    ) -> Result<SharedLimiter, PageError> {
        limits.validate()?;
        if !AtomicI128::is_lock_free() {
            return Err(PageError::NotLockFree);
        }
        let p = mem.page();
        p.seq.store(1, SeqCst);
        p.epoch.store(now, SeqCst);
        p.latest.store(now, SeqCst);
        p.write_limits(limits);
        let cfgs = limits.buckets();
        for (b, cfg) in p.buckets.iter().zip(&cfgs) {
            let (z, ot) = cfg.map_or((0, 0), |c| (-(c.size as i128 * SCALE), c.one_time));
            b.z.store(z, SeqCst);
            b.one_time.store(ot, SeqCst);
        }
        p.vclock.store(0, SeqCst);
        p.slots_hi.store(0, SeqCst);
        for sl in &p.slots {
            sl.mask.store(0, SeqCst);
            sl.owner.store(0, SeqCst);
        }
        p.version.store(GROUP_PAGE_VERSION, SeqCst);
        p.magic.store(GROUP_PAGE_MAGIC, SeqCst);
        p.seq.store(2, SeqCst);
        let mut s = SharedLimiter::new(mem, true, limits, now, now);
        s.refresh();
        Ok(s)
    }

    /// A peer: the page must have been created; `limits` are the trusted
    /// ones (the shadow's).
    pub(crate) fn attach(
        mem: Arc<dyn PageMem>,
        limits: &Limits,
        now: Nanos,
    ) -> Result<SharedLimiter, PageError> {
        limits.validate()?;
        Self::check(&*mem)?;
        let epoch = mem.page().epoch.load(SeqCst);
        let mut s = SharedLimiter::new(mem, false, limits, now, epoch);
        s.refresh();
        Ok(s)
    }

    fn new(
        mem: Arc<dyn PageMem>,
        owner: bool,
        limits: &Limits,
        now: Nanos,
        epoch: Nanos,
    ) -> SharedLimiter {
        SharedLimiter {
            mem,
            owner,
            shadow: Limiter::new(limits, now),
            seq: u64::MAX,
            cfgs: [None; NUM_BUCKETS],
            page_configured: 0,
            epoch,
        }
    }

    fn page(&self) -> &GroupPage {
        self.mem.page()
    }

    pub(crate) fn mem(&self) -> &Arc<dyn PageMem> {
        &self.mem
    }

    /// Re-reads the page's limits if they changed. False while the owner
    /// rewrites them (an odd sequence, for a bounded spin).
    fn refresh(&mut self) -> bool {
        for _ in 0..100 {
            let s1 = self.page().seq.load(SeqCst);
            if s1 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            if s1 == self.seq {
                return true;
            }
            let l = self.page().read_limits();
            if self.page().seq.load(SeqCst) != s1 {
                continue;
            }
            // Invalid limits (only a peer's garbage): no page limit; the
            // shadow still holds.
            self.cfgs = if l.validate().is_ok() {
                l.buckets()
            } else {
                [None; NUM_BUCKETS]
            };
            self.page_configured = self
                .cfgs
                .iter()
                .enumerate()
                .filter(|(_, c)| c.is_some())
                .fold(0, |m, (i, _)| m | 1 << i);
            self.seq = s1;
            return true;
        }
        false
    }

    /// The decision instant: `max(now, latest)` (bounded), published.
    /// Returns it and its offset from the epoch.
    fn time(&self, now: Nanos) -> (Nanos, u64) {
        let prev = self.page().latest.fetch_max(now, SeqCst);
        let t = now.max(prev.min(now.saturating_add(MAX_SKEW_NS)));
        (t, t.saturating_sub(self.epoch).min(1 << 62))
    }

    pub(crate) fn configured(&self) -> u8 {
        self.shadow.configured() | self.page_configured
    }

    pub(crate) fn mask(&self, req: &Request) -> u8 {
        crate::bucket::touch_mask(req) & self.configured()
    }

    /// Reads the page's buckets in `mask` at `t`: the buckets and the
    /// earliest instant all admit `req` (`t` if they do now).
    fn read(
        &self,
        mask: u8,
        req: &Request,
        t: Nanos,
        trel: u64,
    ) -> ([Option<Seen>; NUM_BUCKETS], Nanos) {
        let mut seen = [None; NUM_BUCKETS];
        let mut ready = t;
        for i in bits(mask & self.page_configured) {
            let Some(cfg) = self.cfgs[i] else { continue };
            let b = &self.page().buckets[i];
            let z = b.z.load(SeqCst);
            let ot_raw = b.one_time.load(SeqCst);
            let ot = ot_raw.min(cfg.one_time);
            let n = need(i, req);
            let lv = level(&cfg, z, trel);
            let w = wait_ns(cfg.rate, lv, threshold(&cfg, ot, n) * SCALE);
            ready = ready.max(t.saturating_add(w));
            seen[i] = Some(Seen {
                i,
                cfg,
                z,
                ot_raw,
                ot,
                level: lv,
                n,
            });
        }
        (seen, ready)
    }

    /// Earliest instant at which `req` is admissible (`now` if it is).
    pub(crate) fn ready_at_mask(&mut self, mask: u8, req: &Request, now: Nanos) -> Nanos {
        let own = self
            .shadow
            .ready_at_mask(mask & self.shadow.configured(), req, now);
        if !self.refresh() {
            return own.max(now.saturating_add(RETRY_NS));
        }
        let (t, trel) = self.time(now);
        let (_, ready) = self.read(mask, req, t, trel);
        own.max(if ready > t { ready } else { now })
    }

    /// Admits and charges `req` if the shadow and the page have the tokens,
    /// else the instant to poll again (> `now`).
    pub(crate) fn try_admit_mask(
        &mut self,
        mask: u8,
        req: &Request,
        now: Nanos,
    ) -> Result<(), Nanos> {
        let smask = mask & self.shadow.configured();
        if self.shadow.ready_at_mask(smask, req, now) > now {
            // The page's instant too, if later.
            return Err(self.ready_at_mask(mask, req, now));
        }
        for _ in 0..CAS_TRIES {
            if !self.refresh() {
                break;
            }
            let seq = self.seq;
            let (t, trel) = self.time(now);
            let (seen, ready) = self.read(mask, req, t, trel);
            if ready > t {
                return Err(ready);
            }
            if self.page().seq.load(SeqCst) != seq {
                continue;
            }
            if self.charge(&seen, trel) {
                self.shadow.charge_mask(smask, req, now);
                return Ok(());
            }
        }
        Err(now.saturating_add(RETRY_NS))
    }

    /// Charges every bucket in `seen` if none changed since it was read;
    /// false (and nothing charged) otherwise.
    fn charge(&self, seen: &[Option<Seen>; NUM_BUCKETS], trel: u64) -> bool {
        let p = self.page();
        let mut done: [(usize, u64, i128); NUM_BUCKETS] = [(0, 0, 0); NUM_BUCKETS];
        let mut k = 0;
        let mut ok = true;
        for s in seen.iter().flatten() {
            let b = &p.buckets[s.i];
            let take = s.n.min(s.ot);
            if take > 0
                && b.one_time
                    .compare_exchange(s.ot_raw, s.ot - take, SeqCst, SeqCst)
                    .is_err()
            {
                ok = false;
                break;
            }
            let c = (s.n - take) as i128 * SCALE;
            let rt = s.cfg.rate as i128 * trel as i128;
            let z = rt.saturating_sub(s.level).saturating_add(c);
            if b.z.compare_exchange(s.z, z, SeqCst, SeqCst).is_err() {
                if take > 0 {
                    b.one_time.fetch_add(take, SeqCst);
                }
                ok = false;
                break;
            }
            // What this charge added to `z` beyond the level change the
            // refill explains: given back as `z − c` if a later bucket fails.
            done[k] = (s.i, take, c);
            k += 1;
        }
        if !ok {
            for &(i, take, c) in &done[..k] {
                let b = &p.buckets[i];
                b.z.fetch_sub(c, SeqCst);
                if take > 0 {
                    b.one_time.fetch_add(take, SeqCst);
                }
            }
        }
        ok
    }

    pub(crate) fn cost_ps(&self, mask: u8, req: &Request) -> u128 {
        let page = bits(mask & self.page_configured)
            .filter_map(|i| {
                self.cfgs[i]
                    .map(|c| (need(i, req) as u128 * 1_000_000_000_000).div_ceil(c.rate as u128))
            })
            .max()
            .unwrap_or(0);
        page.max(self.shadow.cost_ps(mask & self.shadow.configured(), req))
    }

    /// New limits: the shadow's; the owner also rewrites the page (tokens
    /// earned are kept, clamped to the new sizes).
    pub(crate) fn set_limits(&mut self, limits: &Limits, now: Nanos) {
        self.shadow.set_limits(limits, now);
        if self.owner {
            self.rewrite(limits, now);
        }
    }

    fn rewrite(&mut self, limits: &Limits, now: Nanos) {
        self.refresh();
        let old = self.cfgs;
        let new = limits.buckets();
        let p = self.mem.page();
        let s = p.seq.load(SeqCst) & !1;
        p.seq.store(s.wrapping_add(1), SeqCst);
        p.write_limits(limits);
        let (_, trel) = self.time(now);
        for (i, b) in p.buckets.iter().enumerate() {
            let Some(n) = new[i] else { continue };
            let ncap = n.size as i128 * SCALE;
            let nrt = n.rate as i128 * trel as i128;
            let Some(o) = old[i] else {
                // A new bucket starts full.
                b.z.store(nrt - ncap, SeqCst);
                b.one_time.store(n.one_time, SeqCst);
                continue;
            };
            for k in 0..CAS_TRIES {
                let z = b.z.load(SeqCst);
                let lv = level(&o, z, trel).min(ncap);
                let nz = nrt.saturating_sub(lv);
                if k + 1 == CAS_TRIES {
                    b.z.store(nz, SeqCst);
                } else if b.z.compare_exchange(z, nz, SeqCst, SeqCst).is_ok() {
                    break;
                }
            }
            let _ = b.one_time.fetch_min(n.one_time, SeqCst);
        }
        p.seq.store(s.wrapping_add(2), SeqCst);
        self.refresh();
    }

    /// Claims a slot for a new member: a free one, else one whose member
    /// neither counts nor polled for [`SLOT_RECLAIM_NS`] (its process is
    /// gone). `None` if all are taken: the member is then served
    /// first-come against the others.
    pub(crate) fn claim_slot(&self, now: Option<Nanos>) -> Option<SlotId> {
        let p = self.page();
        let now = now.unwrap_or_else(|| p.latest.load(SeqCst));
        let token = new_token();
        for reclaim in [false, true] {
            for (index, sl) in p.slots.iter().enumerate() {
                let o = sl.owner.load(SeqCst);
                let take = if reclaim {
                    o != 0
                        && sl.counts(now) == 0
                        && now > sl.beat.load(SeqCst).saturating_add(SLOT_RECLAIM_NS)
                } else {
                    o == 0
                };
                if take && sl.owner.compare_exchange(o, token, SeqCst, SeqCst).is_ok() {
                    sl.mask.store(0, SeqCst);
                    sl.beat.store(now, SeqCst);
                    sl.due.store(now, SeqCst);
                    p.slots_hi.fetch_max(index as u64 + 1, SeqCst);
                    return Some(SlotId { index, token });
                }
            }
        }
        None
    }

    /// Gives a slot back (the member leaves the group).
    pub(crate) fn release_slot(&self, id: SlotId) {
        let Some(sl) = self.page().slots.get(id.index) else {
            return;
        };
        if sl.owner.load(SeqCst) == id.token {
            sl.mask.store(0, SeqCst);
        }
        let _ = sl.owner.compare_exchange(id.token, 0, SeqCst, SeqCst);
    }

    /// Writes a member's state into its slot; false if the slot is no
    /// longer its own (reclaimed, or garbage in its owner word).
    pub(crate) fn publish_slot(&self, id: SlotId, st: SlotState) -> bool {
        let Some(sl) = self.page().slots.get(id.index) else {
            return false;
        };
        if sl.owner.load(SeqCst) != id.token {
            return false;
        }
        sl.tag.store(st.tag.min(i128::MAX as u128) as i128, SeqCst);
        sl.due.store(st.due, SeqCst);
        if let Some(b) = st.beat {
            sl.beat.store(b, SeqCst);
        }
        sl.mask.store(st.mask as u64, SeqCst);
        // Raised again in case a peer lowered it.
        self.page().slots_hi.fetch_max(id.index as u64 + 1, SeqCst);
        true
    }

    /// Per bucket, the smallest tag among the slots that hold the others
    /// back at `now` (backlogged, polled recently, not overdue), except those in
    /// `own` (a bit per slot index: this process's members, which the
    /// group core orders itself). `u128::MAX` where none.
    pub(crate) fn remote_min(&self, now: Nanos, own: u64) -> [u128; NUM_BUCKETS] {
        let mut min = [u128::MAX; NUM_BUCKETS];
        let p = self.page();
        let hi = usize::try_from(p.slots_hi.load(SeqCst)).map_or(SLOTS, |h| h.min(SLOTS));
        let all = (1u8 << NUM_BUCKETS) - 1;
        for (i, sl) in p.slots[..hi].iter().enumerate() {
            if own >> i & 1 == 1 {
                continue;
            }
            let mask = sl.counts(now) & all;
            if mask == 0 {
                continue;
            }
            let tag = sl.tag.load(SeqCst).max(0) as u128;
            for b in bits(mask) {
                min[b] = min[b].min(tag);
            }
        }
        min
    }

    /// The largest start tag granted in any process.
    pub(crate) fn vclock(&self) -> u128 {
        self.page().vclock.load(SeqCst).max(0) as u128
    }

    /// Publishes a granted start tag.
    pub(crate) fn raise_vclock(&self, v: u128) {
        self.page()
            .vclock
            .fetch_max(v.min(i128::MAX as u128) as i128, SeqCst);
    }

    /// Counts an admission in the page's counters.
    pub(crate) fn note_admitted(&self, kind: OpKind, bytes: u64, since: Option<Nanos>, now: Nanos) {
        self.page().stats.admitted(kind, bytes, since, now);
    }
}

/// The buckets of a group: its own, or a shared page's.
// The in-process variant is the common one and the hot path: kept inline.
#[allow(clippy::large_enum_variant)]
pub(crate) enum GroupBuckets {
    /// One process.
    Local(Limiter),
    /// In a [`GroupPage`].
    Shared(Box<SharedLimiter>),
}

impl GroupBuckets {
    pub(crate) fn configured(&self) -> u8 {
        match self {
            Self::Local(l) => l.configured(),
            Self::Shared(s) => s.configured(),
        }
    }

    pub(crate) fn mask(&self, req: &Request) -> u8 {
        match self {
            Self::Local(l) => l.mask(req),
            Self::Shared(s) => s.mask(req),
        }
    }

    pub(crate) fn ready_at_mask(&mut self, mask: u8, req: &Request, now: Nanos) -> Nanos {
        match self {
            Self::Local(l) => l.ready_at_mask(mask, req, now),
            Self::Shared(s) => s.ready_at_mask(mask, req, now),
        }
    }

    pub(crate) fn try_admit_mask(
        &mut self,
        mask: u8,
        req: &Request,
        now: Nanos,
    ) -> Result<(), Nanos> {
        match self {
            Self::Local(l) => {
                let t = l.ready_at_mask(mask, req, now);
                if t > now {
                    return Err(t);
                }
                l.charge_mask(mask, req, now);
                Ok(())
            }
            Self::Shared(s) => s.try_admit_mask(mask, req, now),
        }
    }

    pub(crate) fn cost_ps(&self, mask: u8, req: &Request) -> u128 {
        match self {
            Self::Local(l) => l.cost_ps(mask, req),
            Self::Shared(s) => s.cost_ps(mask, req),
        }
    }

    pub(crate) fn set_limits(&mut self, limits: &Limits, now: Nanos) {
        match self {
            Self::Local(l) => l.set_limits(limits, now),
            Self::Shared(s) => s.set_limits(limits, now),
        }
    }

    pub(crate) fn note_admitted(&self, kind: OpKind, bytes: u64, since: Option<Nanos>, now: Nanos) {
        if let Self::Shared(s) = self {
            s.note_admitted(kind, bytes, since, now);
        }
    }
}

impl ThrottleGroup {
    fn over_page(name: String, limits: &Limits, s: SharedLimiter) -> ThrottleGroup {
        let page = s.mem().clone();
        ThrottleGroup {
            inner: Arc::new(GroupShared {
                name,
                core: Mutex::new(GroupCore::with_buckets(
                    limits,
                    GroupBuckets::Shared(Box::new(s)),
                )),
                queue_depth: AtomicI64::new(0),
                latency: Default::default(),
                page: Some(page),
            }),
        }
    }

    /// Creates a group whose buckets live in `mem` (the page's *owner*, e.g.
    /// the daemon): initialises the page with `limits`, buckets full at
    /// `now`. Other processes share the group by attaching to the same
    /// memory ([`ThrottleGroup::attach`]); [`ThrottleGroup::set_limits`] on
    /// this handle changes the limits for all of them, and
    /// [`ThrottleGroup::stats`] counts all of them. See [`crate::page`].
    pub fn new_shared(
        name: impl Into<String>,
        limits: &Limits,
        now: Nanos,
        mem: Arc<dyn PageMem>,
    ) -> Result<ThrottleGroup, PageError> {
        let s = SharedLimiter::create(mem, limits, now)?;
        Ok(Self::over_page(name.into(), limits, s))
    }

    /// Joins the group whose page another handle created (a *peer*, e.g. a
    /// VM process). `limits` are the group's limits as the peer's daemon
    /// told it: its own disks never get more than those allow them alone,
    /// whatever the page holds; [`ThrottleGroup::set_limits`] on a peer
    /// changes only that bound (the page's limits are the owner's).
    pub fn attach(
        name: impl Into<String>,
        limits: &Limits,
        now: Nanos,
        mem: Arc<dyn PageMem>,
    ) -> Result<ThrottleGroup, PageError> {
        let s = SharedLimiter::attach(mem, limits, now)?;
        Ok(Self::over_page(name.into(), limits, s))
    }

    /// Whether the group's buckets are in a shared page.
    pub fn is_shared(&self) -> bool {
        self.inner.page.is_some()
    }
}
