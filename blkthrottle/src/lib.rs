//! Exact token-bucket throttling of block requests, for corral's virtio-blk
//! devices: per-disk limits, throttle groups shared by several disks (served
//! fairly), exact wake-up instants, live limit changes and counters.
//!
//! The crate is pure policy: **time is an input**, a `u64` count of
//! nanoseconds ([`Nanos`]) on any monotonic clock the caller chooses
//! (`CLOCK_MONOTONIC` in the VMM, a fake clock in tests). Nothing here reads a
//! clock, sleeps or spawns.
//!
//! # Using it from a device
//!
//! ```
//! use corral_blkthrottle::{Decision, Limits, Request, Throttle, ThrottleGroup, DEFAULT_WEIGHT};
//!
//! let now = 0; // e.g. clock_gettime(CLOCK_MONOTONIC) in ns
//! let mut limits = Limits::default();
//! for (k, v) in [("bps", "10M"), ("iops", "500")] {
//!     assert!(limits.parse_kv(k, v)?); // from `--disk PATH,bps=10M,iops=500`
//! }
//! let mut disk = Throttle::new(&limits, now)?;
//! let class = ThrottleGroup::new("gold", &Limits::parse("bps=50M")?, now)?;
//! disk.join_group(&class, DEFAULT_WEIGHT, None)?;
//!
//! disk.note_enqueued();
//! match disk.poll(Request::read(4096), now) {
//!     Decision::Admit => { disk.note_dequeued(); /* submit the I/O */ }
//!     Decision::Wait { until, .. } => { /* arm the timerfd for `until`, poll again then */ }
//! }
//! # Ok::<(), corral_blkthrottle::LimitsError>(())
//! ```
//!
//! # The arithmetic, and why it is exact
//!
//! A bucket with rate `r` tokens/s and size `b` stores its level `L` in
//! *scaled* units of 10⁻⁹ token (an `i128`). Refilling over `dt` nanoseconds
//! adds `r · dt` scaled units — one integer multiplication (`u64 × u64`, which
//! always fits in `u128`), no division, so nothing is rounded and nothing
//! drifts however often or rarely the bucket is refilled: refilling at
//! `t₁` then `t₂` gives exactly the same level as refilling once at `t₂`,
//! because `min(cap, min(cap, L + r·a) + r·c) = min(cap, L + r·(a + c))`.
//!
//! The only division is for the wake-up instant: if `m` scaled units are
//! missing, the bucket has them after `⌈m / r⌉` ns. Rounding *that* up moves
//! only the instant the caller comes back, never the level, which stays an
//! exact function of time; and the instant returned is the earliest integer
//! nanosecond at which the request is admissible. One subtlety: when the
//! bucket becomes full at a fractional instant, the level at the next whole
//! nanosecond exceeds the size by less than `r` scaled units (under one
//! nanosecond of refill). That overshoot is kept for that one nanosecond,
//! so a request waiting for a *full* bucket does not lose the rounding on
//! every wait; after that the level is clamped to the size. The k-th token of an empty
//! bucket therefore arrives at exactly `⌈k · 10⁹ / r⌉` ns, so a backlogged
//! stream polled at the returned instants gets `b + ⌊r · T⌋` ops by time `T`
//! — the rate exactly. A caller that polls late (timer slack, a 1 ms tick)
//! loses nothing either, unless the bucket overflows meanwhile, which needs
//! the bucket to be nearly full with a request waiting: with the default size
//! (one second of rate) and 1 ms of lateness the loss is at most 0.1 % even
//! for a request as large as the bucket (and zero for requests of at most
//! `b − r·lateness`).
//!
//! A request touches up to four buckets (total and per-direction, bytes and
//! ops). Each bucket only gains tokens until charged, so the instant at which
//! *all* have the tokens is the maximum of the per-bucket instants, and it is
//! exact too. Admission charges all of them together.
//!
//! ## Admission rule and the burst bound
//!
//! A request of `n` units is admissible on a bucket with `o` one-time tokens
//! left when `L + o ≥ n`, or — if `n > b + o`, so it could never fit — when
//! the bucket is full (`L = b`). Charging takes the one-time tokens first and
//! may leave `L` negative (debt): the request is admitted, never deadlocked,
//! and the debt delays what follows. With `M` the largest request, for
//! **every** window `[t, t + T]` (both ends included) the units admitted
//! satisfy
//!
//! ```text
//!   admitted(t, t+T) ≤ r·(T + 1 ns) + O + max(b, M)
//! ```
//!
//! where `O` is the one-time burst. Proof: let `A = L + o`. Over the window
//! the units admitted equal `A(t⁻) − A((t+T)⁺)` plus the tokens refilled,
//! and refill is at most `r·T`. `A(t⁻) ≤ b + O + r·1 ns` (the sub-nanosecond
//! overshoot above). After any admission
//! `A ≥ 0` if the request fitted (`n ≤ A`), and `A = b + o − n ≥ b − M` if
//! it needed the debt rule (admitted at `L = b`); refill only raises `A`; so
//! `A((t+T)⁺) ≥ min(0, b − M)`. Subtracting gives the
//! bound. The property tests check it on random streams.
//!
//! ## Lateness, and why a bucket one request deep needs an on-time caller
//!
//! No admission rule can recover a late poll's loss on a bucket exactly one
//! request deep (`b = n = M`) without breaking the window bound: take two
//! admissions `i < j`; the bound over the window `[aᵢ, aⱼ]` gives
//! `(j − i + 1)·n ≤ r·(aⱼ − aᵢ + 1 ns) + n`, so `aⱼ − aᵢ ≥ (j − i)·n/r − 1 ns`:
//! every admission is at least `n/r` after the previous *actual* one, and a
//! poll late by `δ` pushes every later admission back by `δ`. (Admitting "at
//! the due instant in virtual time" would put two admissions closer than
//! `n/r` in real time and break the bound by `r·δ`.)
//!
//! More generally, **the bucket is the maximal rule under its bound**: for
//! requests of at most `b` units and no one-time burst, whenever it makes
//! a request of `n` units wait at `t`, admitting it at `t` would put more
//! than `b + r·(t − s)` units into some window `[s, t]`. So "charging
//! lateness to the next admission within what the bound allows" is what
//! it already does, to the last unit: nothing is left to give back. Proof:
//! let `c` be the last instant `≤ t` at which the level was clamped to the
//! size (the bucket starts full, so `c` exists; `c = 0` if it never
//! clamped), with `A[u, t]` the units admitted in `[u, t]`. No clamp after
//! `c` means the level at `t` is exactly `L(t) = b + r·(t − c) − A[c, t]`
//! (the sub-nanosecond overshoot above is `r·(⌈c⌉ − c)` and keeps this
//! exact). If no admission lies in `[c, t]`, `L(t) ≥ b ≥ n` and the request
//! is admitted. Otherwise let `s` be the first admission after `c`:
//! `A[s, t] = A[c, t]` and `t − s ≤ t − c`, so a refusal (`L(t) < n`) gives
//! `A[s, t] + n > b + r·(t − c) ≥ b + r·(t − s)`: the window `[s, t]` with
//! the request in it exceeds the bound. Every rule that keeps the bound
//! therefore waits at least as long after a late poll as the bucket does,
//! and where the bucket has room beyond the request, lateness up to its
//! headroom `(b − n)/r` costs nothing (the level keeps rising); only
//! beyond it do tokens overflow. `tests/maximal.rs` checks the maximality
//! on the fake clock for random rates, sizes, request streams and poll
//! lateness, down to buckets one op deep.
//!
//! So a one-request bucket gets its rate exactly when, and only when, it
//! is polled on the due nanosecond (`tests/maximal.rs`,
//! `one_request_bucket_on_time_is_exact`: the k-th request at
//! `⌈k·n·10⁹/r⌉` ns). [`Throttle::wait_slack`] tells the caller the
//! headroom for a waiting request, and [`Punctual`] plans the caller's
//! side of a *tight* wait (headroom under [`TIGHT_SLACK_NS`]): wake early
//! by the largest lateness of the last few wake-ups, with the thread's
//! priority raised for the last stretch where it can be, and wait the rest
//! on the clock, so the poll lands on the due nanosecond.
//!
//! ## The bound does not depend on when the caller polls
//!
//! Nothing in the proof of the window bound above refers to the instants
//! at which the caller polls: it uses only that an admission happens when
//! the admission rule holds at that instant, and that the level is an
//! exact function of time and of the charges. So waking early, spinning,
//! polling late, or polling at random instants all keep
//! `admitted(t, t+T) ≤ r·(T + 1 ns) + O + max(b, M)`; they change only
//! *which* admissible instants are used. And since each admission of a
//! one-request stream is `≥ n/r` after the previous one (above), with
//! equality exactly when the poll is on time, a backlogged one-request
//! stream loses, to the nanosecond, the sum of its polls' lateness past
//! the due instants (the sub-nanosecond rounding aside): what
//! [`Lateness::total_ns`] counts. `tests/punctual.rs` checks on the fake
//! clock, with random lateness injected into every wake-up, that the
//! bound holds, that the time lost is exactly that sum, and that the rate
//! is within ±0.1 % once the planner's margin covers the lateness (it
//! learns it within [`punctual::WINDOW`] wake-ups).
//!
//! # Groups
//!
//! See [`ThrottleGroup`]: shared buckets; start-time fair queuing by dominant
//! cost (bytes under a bytes limit, ops under an ops limit), weighted; grants
//! made on behalf of whichever member is first in line, so members polling on
//! their own timers (one device thread, or several VM threads) never depend on
//! each other's threads; a fairness window that lets a member run ahead of one
//! that has not yet picked up its grant only by a bounded amount, so members
//! polling on a coarse tick still split the group fairly *and* use all of its
//! rate; wake-up instants that are exact when the member is first in line and
//! a lower bound otherwise.
//!
//! A group may keep its buckets in memory shared by several processes (one
//! per VM): [`ThrottleGroup::new_shared`] and [`ThrottleGroup::attach`], see
//! [`page`]. The buckets are then the same exact buckets, as a word of
//! virtual time each, charged with compare-and-swap; fairness by start tags
//! applies across the processes too (each disk's tag in a slot of the page,
//! the same fairness-window rule), except that nobody grants on behalf of
//! another process: a member that stops polling holds the others back for
//! at most [`page::SLOT_STALE_NS`] past the instant it was told.
//!
//! # Limits
//!
//! [`Limits`] documents the keys, defaults (bucket size = one second of rate)
//! and the meaning of zero (unlimited).

#![forbid(unsafe_code)]

mod bucket;
mod group;
mod limits;
pub mod page;
pub mod punctual;
mod shared;
mod stats;
mod throttle;

pub use group::{DEFAULT_FAIRNESS_WINDOW_NS, DEFAULT_WEIGHT, ThrottleGroup, Waker, check_weight};
pub use limits::{Limits, LimitsError};
pub use page::{GROUP_PAGE_LEN, GroupPage, PageError, PageMem};
pub use punctual::{Lateness, Punctual, Step, TIGHT_SLACK_NS};
pub use stats::{Histogram, LATENCY_BOUNDS_NS, LATENCY_BUCKETS, OpStats, SharedStats, Stats};
pub use throttle::{Decision, Throttle, WaitCause};

/// Nanoseconds on the caller's monotonic clock.
pub type Nanos = u64;

/// Kind of a block request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Data read (`VIRTIO_BLK_T_IN`).
    Read,
    /// Data write (`VIRTIO_BLK_T_OUT`).
    Write,
    /// Anything else (flush, discard, write-zeroes, get-id): one op in the
    /// total and write ops buckets, zero bytes.
    Other,
}

/// A request as the throttle sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// What it does.
    pub kind: OpKind,
    /// Data bytes; ignored (counted as 0) for [`OpKind::Other`].
    pub bytes: u64,
}

impl Request {
    /// A read of `bytes`.
    pub fn read(bytes: u64) -> Request {
        Request {
            kind: OpKind::Read,
            bytes,
        }
    }

    /// A write of `bytes`.
    pub fn write(bytes: u64) -> Request {
        Request {
            kind: OpKind::Write,
            bytes,
        }
    }

    /// A flush or other non-data request.
    pub fn other() -> Request {
        Request {
            kind: OpKind::Other,
            bytes: 0,
        }
    }

    /// Bytes charged to bytes buckets.
    pub fn charged_bytes(&self) -> u64 {
        match self.kind {
            OpKind::Other => 0,
            _ => self.bytes,
        }
    }
}
