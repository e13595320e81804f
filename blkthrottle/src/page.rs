//! A throttle group's buckets in memory shared by several processes: the
//! [`GroupPage`], and the limiter that admits against it.
//!
//! A class's I/O group must be one budget for the disks of all the class's
//! VMs, and with one process per VM those disks live in different
//! processes. The daemon (the page's *owner*) creates the page (a sealed
//! memfd in `corral-vmm`; any memory that holds a [`GroupPage`] here) and
//! passes it to each VM process (a *peer*), which attaches to it with
//! [`crate::ThrottleGroup::attach`]. Nothing on the request path leaves the
//! process: an admission is a few atomic loads and one compare-and-swap per
//! bucket. Nobody ever waits on a lock another process holds.
//!
//! # The buckets as virtual time
//!
//! A bucket of rate `r` and size `b` is one word `Z` (an `i128`, in the
//! crate's scaled units of 10⁻⁹ token): at time `t` (ns since the page's
//! epoch) its unclamped level is `X(t) = r·t − Z`, and its level is
//!
//! ```text
//!   E(t) = X(t)   if X(t) < b·10⁹ + r      (not full, or full for under 1 ns)
//!   E(t) = b·10⁹  otherwise
//! ```
//!
//! Charging `n` tokens at `t` stores `Z' = r·t − E(t) + n·10⁹`. This is the
//! generic cell rate algorithm in the crate's exact integer form, and it is
//! *the same bucket* as the crate's own: that bucket keeps the
//! sub-nanosecond overshoot for the one nanosecond after it fills (see the
//! crate docs), which is exactly the `+ r` of the first case, so for the same
//! requests at the same (non-decreasing) instants both give the same levels,
//! the same admissions and the same wake-up instants. The window bound of
//! the crate docs therefore holds for the sum of all handles' admissions.
//! One-time tokens are a second word per bucket, taken first.
//!
//! Time: each handle passes its own clock reading; a page-wide `latest`
//! word (raised with `fetch_max` before each charge, read before each
//! decision) makes every decision use `max(now, latest)`, so a handle whose
//! clock reading is a little older than another's charge (it was preempted
//! between reading the clock and polling) cannot backdate its charge. A
//! `latest` more than [`MAX_SKEW_NS`] ahead of the caller's clock is
//! ignored beyond that.
//!
//! A request charges its buckets one compare-and-swap each; if one fails
//! (another handle charged in between) the ones already charged are given
//! back (`Z −= n·10⁹`, exact in any encoding) and the decision is taken
//! again, at most [`CAS_TRIES`] times, after which the handle is told to
//! poll again [`RETRY_NS`] later: a peer that keeps writing the page can
//! slow its class down, never block a thread.
//!
//! # Fairness across processes
//!
//! Start-tag fairness spans the processes: the page holds [`SLOTS`] member
//! slots, one per disk of the group (claimed with a compare-and-swap of its
//! owner word when the disk joins, given back when it leaves, reclaimed by a
//! newcomer once it has not counted nor polled for [`SLOT_RECLAIM_NS`]). At
//! each poll a member publishes its head request's start tag (virtual time,
//! with the page-wide `vclock` the largest start tag granted so tags of all
//! processes are on one scale), the buckets it touches (none when it is not
//! backlogged), the instant it was told to poll again and the instant it
//! polled. The group core ([`crate::ThrottleGroup`]) then treats the other
//! processes' backlogged slots as it treats its own members holding a grant
//! not picked up: on each bucket, nobody starts a request whose tag is more
//! than the fairness window ahead of the smallest such tag; held back, it
//! retries half a window later. The smallest tag is never held back, so
//! there is no cycle of waits. Grants are not made on behalf of another
//! process (a handle cannot hand a request to another process's device),
//! so a slot stops counting when its member is [`SLOT_STALE_NS`] past the
//! instant it was told (or announced a poll more than [`SLOT_MAX_DUE_NS`]
//! after its last one, or polled more than [`MAX_SKEW_NS`] in the future,
//! i.e. garbage): a stalled or dead process holds the others back for at
//! most that long past its due instant, while the bucket fills for its
//! request. A disk finding no free slot is served first-come.
//!
//! Garbage in the slots can only reorder or hold back the class (as an
//! empty bucket can): tags, masks and instants are clamped when read, the
//! scans are bounded by [`SLOTS`], and the buckets, the only thing that
//! admits, are untouched by them.
//!
//! # Limits and their changes
//!
//! The owner writes the limits into the page under a sequence word (odd
//! while it writes) and re-encodes every bucket for the new rates, keeping
//! the tokens earned (clamped to the new sizes), as the in-process limiter does.
//! A handle reads them only when the sequence changed, and decides with the
//! limits of one even sequence value, re-checked after reading the buckets.
//!
//! # A peer that writes garbage
//!
//! Every field is an atomic of a fixed size, so any bit pattern is a value:
//! reading the page cannot fail or panic, invalid limits read as "no page
//! limit", a level more than [`MAX_DEBT_UNITS`] in debt reads as an empty
//! bucket. What a compromised peer *can* do is spoil its class's shared
//! budget: empty it (its class-mates wait, polled again at the instants
//! they are told, never blocked) or fill it. Against the latter, each
//! handle also charges its own admissions to a private bucket with the
//! limits its daemon gave it over its control channel (the *shadow*, a
//! plain in-process limiter the page cannot touch): whatever the page says,
//! **a handle admits at most what the group's limits allow its own disks
//! alone**, i.e. for every window `[t, t + T]` its own admissions satisfy
//! the crate's bound `r·(T + 1 ns) + O + max(b, M)`. The page is only ever
//! a further restriction. A page cannot reach another class (each class has
//! its own page) or the daemon, which only writes the limits and reads the
//! counters.

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

use portable_atomic::AtomicI128;
use thiserror::Error;

use crate::bucket::SCALE;
use crate::limits::{BucketConfig, Limits, LimitsError, NUM_BUCKETS, OPS_TOTAL};
use crate::stats::SharedStats;
use crate::{Nanos, Request};

/// The first word of a group page ("CGRPPAGE").
pub const GROUP_PAGE_MAGIC: u64 = 0x4547_4150_5052_4743;
/// Layout version of [`GroupPage`]; bumped on any change (2: the member
/// slots of cross-process fairness).
pub const GROUP_PAGE_VERSION: u64 = 2;
/// Bytes a [`GroupPage`] needs (it fits in one 4 KiB page).
pub const GROUP_PAGE_LEN: usize = std::mem::size_of::<GroupPage>();
const _: () = assert!(GROUP_PAGE_LEN <= 4096);

/// How far ahead of a caller's clock the page's `latest` time is believed.
pub const MAX_SKEW_NS: Nanos = 100_000_000;
/// Debt (in tokens) beyond which a bucket level is garbage: read as empty.
/// Debt comes from one request larger than its bucket; no virtio-blk
/// request comes near 4 GiB.
pub const MAX_DEBT_UNITS: u64 = 1 << 32;
/// Compare-and-swap attempts per decision.
pub const CAS_TRIES: usize = 64;
/// When the page cannot be decided on now (its limits are being rewritten,
/// or the compare-and-swaps kept failing), poll again this much later.
pub const RETRY_NS: Nanos = 50_000;

/// Member slots in a page: disks of the group (in any process) that take
/// part in its cross-process fairness. A disk that finds none free (nor
/// reclaimable) is served first-come against the others.
pub const SLOTS: usize = 64;
/// A slot whose member was due to poll more than this long ago stops
/// holding the others back (its process is stalled or dead). While it
/// holds them back the bucket fills for it; with a bucket of at least
/// this much of the rate (the default is a second) no rate is lost.
pub const SLOT_STALE_NS: Nanos = 10_000_000;
/// A member's announced next poll counts at most this far after its last
/// poll (a garbage or dead `due` cannot hold the others back for longer).
pub const SLOT_MAX_DUE_NS: Nanos = 1_000_000_000;
/// A slot not counting and not polled for this long may be taken by a new
/// member (its owner is gone; if it is not, it claims another at its next
/// poll).
pub const SLOT_RECLAIM_NS: Nanos = 1_000_000_000;

/// Number of words of [`Limits`] in the page.
const LIMIT_WORDS: usize = 10;

/// One bucket of a page.
#[repr(C)]
pub(crate) struct PageBucket {
    /// `r·t − level` (scaled units); see the module docs.
    pub(crate) z: AtomicI128,
    /// One-time tokens left.
    pub(crate) one_time: AtomicU64,
    _pad: AtomicU64,
}

/// One member's slot: its head request's start tag (virtual time, ps) and
/// buckets while it is backlogged, and when it polled and will poll.
#[repr(C)]
pub(crate) struct PageSlot {
    /// Start tag of the head request (or the finish tag of a grant not yet
    /// picked up): the member's place in line.
    pub(crate) tag: AtomicI128,
    /// 0 = free, else the owning member's claim token.
    pub(crate) owner: AtomicU64,
    /// Buckets of its head request; 0 = not backlogged.
    pub(crate) mask: AtomicU64,
    /// The instant it was told to poll again.
    pub(crate) due: AtomicU64,
    /// Its last poll.
    pub(crate) beat: AtomicU64,
}

impl PageSlot {
    const fn new() -> PageSlot {
        PageSlot {
            tag: AtomicI128::new(0),
            owner: AtomicU64::new(0),
            mask: AtomicU64::new(0),
            due: AtomicU64::new(0),
            beat: AtomicU64::new(0),
        }
    }

    /// Whether it holds the others back at `now`: backlogged, and its
    /// member polled recently and is not overdue by more than
    /// [`SLOT_STALE_NS`]. Its buckets, or 0.
    pub(crate) fn counts(&self, now: Nanos) -> u8 {
        let mask = self.mask.load(SeqCst);
        if mask == 0 {
            return 0;
        }
        let beat = self.beat.load(SeqCst);
        if beat > now.saturating_add(MAX_SKEW_NS) {
            // A poll in the future is garbage: it would count for ever.
            return 0;
        }
        let due = self
            .due
            .load(SeqCst)
            .max(beat)
            .min(beat.saturating_add(SLOT_MAX_DUE_NS));
        if now > due.saturating_add(SLOT_STALE_NS) {
            return 0;
        }
        (mask & 0xff) as u8
    }
}

/// The shared state of one throttle group. `repr(C)`, atomics only: any
/// bit pattern is a valid value (see the module docs for who writes what).
///
/// | field | written by |
/// |---|---|
/// | `magic`, `version`, `epoch` | owner, at creation |
/// | `seq`, `limits` | owner |
/// | `latest`, buckets | every handle (the owner re-encodes the buckets on a limit change) |
/// | `vclock`, `slots_hi`, `slots` | every handle (each member its own slot) |
/// | `stats` | every handle; read by the owner |
#[repr(C)]
pub struct GroupPage {
    pub(crate) magic: AtomicU64,
    pub(crate) version: AtomicU64,
    /// Odd while the owner rewrites `limits`.
    pub(crate) seq: AtomicU64,
    /// The clock reading `t = 0` of the buckets.
    pub(crate) epoch: AtomicU64,
    /// The latest clock reading a decision used.
    pub(crate) latest: AtomicU64,
    /// bps, rbps, wbps, iops, riops, wiops, burst_bytes, burst_ops,
    /// onetime_bytes, onetime_ops; 0 = unset.
    pub(crate) limits: [AtomicU64; LIMIT_WORDS],
    pub(crate) buckets: [PageBucket; NUM_BUCKETS],
    /// The group's counters, summed over all processes.
    pub(crate) stats: SharedStats,
    /// The largest start tag granted (virtual time, ps), all processes.
    pub(crate) vclock: AtomicI128,
    /// One past the highest slot ever claimed (bounds the scans).
    pub(crate) slots_hi: AtomicU64,
    /// The members' slots (cross-process fairness, see the module docs).
    pub(crate) slots: [PageSlot; SLOTS],
}

impl Default for GroupPage {
    fn default() -> Self {
        GroupPage::new()
    }
}

impl GroupPage {
    /// A zeroed page (not yet initialised by an owner), e.g. on the heap
    /// for a group shared by threads, or in tests.
    pub fn new() -> GroupPage {
        GroupPage {
            magic: AtomicU64::new(0),
            version: AtomicU64::new(0),
            seq: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            latest: AtomicU64::new(0),
            limits: [const { AtomicU64::new(0) }; LIMIT_WORDS],
            buckets: [const {
                PageBucket {
                    z: AtomicI128::new(0),
                    one_time: AtomicU64::new(0),
                    _pad: AtomicU64::new(0),
                }
            }; NUM_BUCKETS],
            stats: SharedStats::default(),
            vclock: AtomicI128::new(0),
            slots_hi: AtomicU64::new(0),
            slots: [const { PageSlot::new() }; SLOTS],
        }
    }

    /// The group's counters (all processes), for the owner.
    pub(crate) fn stats(&self) -> &SharedStats {
        &self.stats
    }

    pub(crate) fn write_limits(&self, l: &Limits) {
        let v = [
            l.bps,
            l.rbps,
            l.wbps,
            l.iops,
            l.riops,
            l.wiops,
            l.burst_bytes,
            l.burst_ops,
            l.onetime_bytes,
            l.onetime_ops,
        ];
        for (w, x) in self.limits.iter().zip(v) {
            w.store(x.unwrap_or(0), SeqCst);
        }
    }

    pub(crate) fn read_limits(&self) -> Limits {
        let w = |i: usize| Some(self.limits[i].load(SeqCst)).filter(|&x| x != 0);
        Limits {
            bps: w(0),
            rbps: w(1),
            wbps: w(2),
            iops: w(3),
            riops: w(4),
            wiops: w(5),
            burst_bytes: w(6),
            burst_ops: w(7),
            onetime_bytes: w(8),
            onetime_ops: w(9),
        }
    }

    /// Garbage bytes into every field (tests of what a peer can do).
    #[doc(hidden)]
    pub fn scribble(&self, mut seed: u64) {
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        self.seq.store(next(), SeqCst);
        self.latest.store(next(), SeqCst);
        self.epoch.store(next(), SeqCst);
        for w in &self.limits {
            w.store(next() >> (next() % 64), SeqCst);
        }
        for b in &self.buckets {
            b.z.store(
                ((next() as i128) << 64 | next() as i128) >> (next() % 128),
                SeqCst,
            );
            b.one_time.store(next() >> (next() % 64), SeqCst);
        }
        self.scribble_slots(next(), 0);
    }

    /// Garbage into the fairness state only: the virtual clock and every
    /// slot, their instants often within 2 s of `around` (tests of what a
    /// peer can do).
    #[doc(hidden)]
    pub fn scribble_slots(&self, mut seed: u64, around: Nanos) {
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let wide = |a: u64, b: u64, c: u64| ((a as i128) << 64 | b as i128) >> (c % 128);
        self.vclock.store(wide(next(), next(), next()), SeqCst);
        self.slots_hi.store(next() >> (next() % 64), SeqCst);
        for s in &self.slots {
            s.tag.store(wide(next(), next(), next()), SeqCst);
            s.owner.store(next() >> (next() % 64), SeqCst);
            s.mask.store(next() >> (next() % 64), SeqCst);
            let mut instant = || {
                let x = next();
                if x & 1 == 0 {
                    around
                        .wrapping_add(x % 4_000_000_000)
                        .wrapping_sub(2_000_000_000)
                } else {
                    x >> (x % 64)
                }
            };
            let (due, beat) = (instant(), instant());
            s.due.store(due, SeqCst);
            s.beat.store(beat, SeqCst);
        }
    }
}

/// What [`crate::ThrottleGroup::attach`] or `new_shared` refuse.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PageError {
    /// The limits are invalid.
    #[error(transparent)]
    Limits(#[from] LimitsError),
    /// The memory does not hold a group page.
    #[error("not a throttle group page (magic {0:#x})")]
    BadMagic(u64),
    /// A page of another layout version.
    #[error("throttle group page version {0}, this build knows {GROUP_PAGE_VERSION}")]
    BadVersion(u64),
    /// This CPU has no lock-free 128-bit compare-and-swap (`cmpxchg16b`):
    /// the page's atomics would not be atomic across processes.
    #[error("no lock-free 128-bit atomics on this CPU: a group cannot be shared across processes")]
    NotLockFree,
}

/// Memory holding a [`GroupPage`]: a mapping shared with other processes,
/// or a plain `GroupPage` (e.g. `Arc<GroupPage>`) for threads and tests.
pub trait PageMem: Send + Sync {
    /// The page.
    fn page(&self) -> &GroupPage;
}

impl PageMem for GroupPage {
    fn page(&self) -> &GroupPage {
        self
    }
}

/// Units a request takes from bucket `i`.
pub(crate) fn need(i: usize, req: &Request) -> u64 {
    if i < OPS_TOTAL {
        req.charged_bytes()
    } else {
        1
    }
}

/// A bucket's level at `t` (ns since the epoch) from its word `z`.
pub(crate) fn level(cfg: &BucketConfig, z: i128, t: u64) -> i128 {
    let rate = cfg.rate as i128;
    let cap = cfg.size as i128 * SCALE;
    let x = (rate * t as i128).saturating_sub(z);
    if x >= cap.saturating_add(rate) {
        cap
    } else if x < -(cap + MAX_DEBT_UNITS as i128 * SCALE) {
        0
    } else {
        x
    }
}

/// Scaled level needed for `n` units with `ot` one-time tokens left (as
/// the in-process bucket: `n`, or a full bucket if it can never hold
/// them).
pub(crate) fn threshold(cfg: &BucketConfig, ot: u64, n: u64) -> i128 {
    let ot = ot as i128;
    (n as i128).min(cfg.size as i128 + ot) - ot
}

/// Ns until `level` reaches `need` (scaled) at `rate`; 0 if it has.
pub(crate) fn wait_ns(rate: u64, level: i128, need: i128) -> Nanos {
    if level >= need {
        return 0;
    }
    let missing = (need - level) as u128;
    u64::try_from(missing.div_ceil(rate as u128)).unwrap_or(u64::MAX)
}
