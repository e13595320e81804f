//! [`Throttle`]: the per-disk object the virtio-blk device talks to.

use crate::bucket::Limiter;
use crate::group::{ThrottleGroup, Waker, wake};
use crate::limits::{Limits, LimitsError};
use std::sync::Arc;

use crate::stats::{SharedStats, Stats};
use crate::{Nanos, OpKind, Request};

/// Answer to [`Throttle::poll`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Submit the request now; it has been charged to every bucket.
    Admit,
    /// Keep the request queued and poll again at `until` (absolute
    /// nanoseconds on the caller's clock, always > `now`), e.g. by arming a
    /// timerfd with `TFD_TIMER_ABSTIME` on `CLOCK_MONOTONIC`.
    Wait {
        /// The earliest instant the request can be admitted (exact for the
        /// disk's own buckets; a lower bound when another group member is
        /// ahead in line).
        until: Nanos,
        /// What the request is waiting for.
        cause: WaitCause,
    },
}

/// Why a request waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitCause {
    /// The disk's own limits.
    Disk,
    /// The group's limits or another member's turn.
    Group,
}

struct Membership {
    group: ThrottleGroup,
    id: u32,
    /// Its weight in the group (1..=10000).
    weight: u32,
    /// We have a request registered in the group (pending or granted).
    registered: bool,
}

/// Throttle state of one disk: its own buckets, its optional group
/// membership and its counters.
///
/// Owned by the device thread; all methods are cheap and allocation-free on
/// the request path. `poll` takes the group's mutex once when the disk is in a
/// group (uncontended when all members run on one thread).
///
/// The device keeps its own FIFO of requests and calls, for the request at
/// the head: [`Throttle::poll`]; on [`Decision::Admit`] it submits it and
/// polls the next one at the same `now`; on [`Decision::Wait`] it arms its
/// timer for `until` and polls the same request again when it fires (or
/// earlier after a limit change or a [`Waker`] call — polling early is always
/// harmless).
pub struct Throttle {
    limits: Limits,
    limiter: Limiter,
    group: Option<Membership>,
    /// First refusal of the current head request.
    waiting_since: Option<Nanos>,
    queue_depth: u64,
    stats: Arc<SharedStats>,
}

impl std::fmt::Debug for Throttle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Throttle")
            .field("limits", &self.limits)
            .field("group", &self.group.as_ref().map(|m| m.group.name()))
            .field("queue_depth", &self.queue_depth)
            .finish_non_exhaustive()
    }
}

impl Throttle {
    /// A disk throttle with `limits` (validated), buckets full at `now`.
    pub fn new(limits: &Limits, now: Nanos) -> Result<Throttle, LimitsError> {
        limits.validate()?;
        Ok(Throttle {
            limits: *limits,
            limiter: Limiter::new(limits, now),
            group: None,
            waiting_since: None,
            queue_depth: 0,
            stats: Arc::default(),
        })
    }

    /// The disk's own limits.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Changes the disk's own limits live. Tokens already earned are kept
    /// (clamped to the new sizes); the queue is untouched; removing a limit
    /// makes the head request admissible at once. The caller should re-poll
    /// its head request after this.
    pub fn set_limits(&mut self, limits: &Limits, now: Nanos) -> Result<(), LimitsError> {
        limits.validate()?;
        self.limits = *limits;
        self.limiter.set_limits(limits, now);
        Ok(())
    }

    /// Joins `group` with `weight` (1..=10000, [`crate::DEFAULT_WEIGHT`] = 100),
    /// leaving the current group if any (a pending head request is
    /// re-registered in the new group at the next poll). `waker` is called
    /// when this disk, waiting in the group, may be admissible earlier than
    /// it was told.
    pub fn join_group(
        &mut self,
        group: &ThrottleGroup,
        weight: u32,
        waker: Option<Waker>,
    ) -> Result<(), LimitsError> {
        crate::check_weight(weight)?;
        self.leave_group();
        let id = group.lock().join(weight, waker);
        group.add_queue_depth(self.queue_depth as i64);
        self.group = Some(Membership {
            group: group.clone(),
            id,
            weight,
            registered: false,
        });
        Ok(())
    }

    /// Changes this disk's weight in its group, live: its place in line
    /// (its virtual time) is kept, and its next requests advance it by
    /// their cost scaled by the new weight. In a group over a shared page
    /// the other processes' members see that through the start tags this
    /// disk publishes. Without a group: nothing to change.
    pub fn set_weight(&mut self, weight: u32) -> Result<(), LimitsError> {
        crate::check_weight(weight)?;
        if let Some(m) = &mut self.group {
            m.group.lock().set_weight(m.id, weight);
            m.weight = weight;
        }
        Ok(())
    }

    /// This disk's weight in its group, if it is in one.
    pub fn weight(&self) -> Option<u32> {
        self.group.as_ref().map(|m| m.weight)
    }

    /// Leaves the current group, if any.
    pub fn leave_group(&mut self) {
        if let Some(m) = self.group.take() {
            let wakers = m.group.lock().leave(m.id);
            m.group.add_queue_depth(-(self.queue_depth as i64));
            wake(wakers);
        }
    }

    /// The group this disk belongs to.
    pub fn group(&self) -> Option<&ThrottleGroup> {
        self.group.as_ref().map(|m| &m.group)
    }

    /// May the head-of-queue request `req` go at `now`?
    ///
    /// Admits (and charges every bucket: the disk's and the group's) only if
    /// all of them have the tokens; otherwise returns when to ask again.
    /// Call it with the same request until it is admitted, or call
    /// [`Throttle::cancel`] if the request is dropped.
    pub fn poll(&mut self, req: Request, now: Nanos) -> Decision {
        let mask = self.limiter.mask(&req);
        let own = self.limiter.ready_at_mask(mask, &req, now);
        if own > now {
            // Only the disk's own limits can shrink its tokens (a live limit
            // change); do not hold the group's place meanwhile.
            if self.withdraw_from_group() {
                return self.admit(mask, req, now);
            }
            self.waiting_since.get_or_insert(now);
            return Decision::Wait {
                until: own,
                cause: WaitCause::Disk,
            };
        }
        if let Some(m) = &mut self.group {
            let (r, wakers) = m.group.lock().poll(m.id, req, now);
            wake(wakers);
            match r {
                Ok(()) => m.registered = false,
                Err(until) => {
                    m.registered = true;
                    self.waiting_since.get_or_insert(now);
                    return Decision::Wait {
                        until,
                        cause: WaitCause::Group,
                    };
                }
            }
        }
        self.admit(mask, req, now)
    }

    /// For a request that waits on the disk's own limits: how late after
    /// its `until` the caller may poll without losing rate (the binding
    /// bucket would overflow after that). Large when the bucket has room
    /// beyond the request, zero for a bucket exactly one request deep — the
    /// case where a caller whose timer fires late (lateness δ) loses
    /// `δ / (n / r)` of the rate and must wake early and wait on the clock
    /// instead. See the crate docs, "Lateness".
    pub fn wait_slack(&mut self, req: Request, now: Nanos) -> Nanos {
        let mask = self.limiter.mask(&req);
        self.limiter.slack_mask(mask, &req, now)
    }

    fn admit(&mut self, mask: u8, req: Request, now: Nanos) -> Decision {
        self.limiter.charge_mask(mask, &req, now);
        self.stats.admitted(
            req.kind,
            req.charged_bytes(),
            self.waiting_since.take(),
            now,
        );
        Decision::Admit
    }

    /// Withdraws a registered group request; true if it had been granted.
    fn withdraw_from_group(&mut self) -> bool {
        let Some(m) = &mut self.group else {
            return false;
        };
        if !m.registered {
            return false;
        }
        m.registered = false;
        let (granted, wakers) = m.group.lock().withdraw(m.id);
        wake(wakers);
        granted
    }

    /// The head request was dropped without being admitted (device reset,
    /// queue torn down): forget its wait and its place in the group. Tokens a
    /// group already granted to it are not returned.
    pub fn cancel(&mut self) {
        self.waiting_since = None;
        self.withdraw_from_group();
    }

    /// The device queued a request behind the throttle.
    pub fn note_enqueued(&mut self) {
        self.queue_depth += 1;
        self.stats.add_queue_depth(1);
        if let Some(m) = &self.group {
            m.group.add_queue_depth(1);
        }
    }

    /// The device took a request off its throttle queue (admitted or dropped).
    pub fn note_dequeued(&mut self) {
        if self.queue_depth > 0 {
            self.queue_depth -= 1;
            self.stats.add_queue_depth(-1);
            if let Some(m) = &self.group {
                m.group.add_queue_depth(-1);
            }
        }
    }

    /// Records a completed request's latency (typically guest submission to
    /// completion, throttle wait included) in this disk's histogram and its
    /// group's.
    pub fn record_latency(&mut self, kind: OpKind, ns: Nanos) {
        self.stats.observe_latency(kind, ns);
        if let Some(m) = &self.group {
            m.group.observe_latency(kind, ns);
        }
    }

    /// Snapshot of this disk's counters.
    pub fn stats(&self) -> Stats {
        self.stats.snapshot()
    }

    /// This disk's counters, shared: readable from any thread without
    /// locking the throttle (or the device that owns it).
    pub fn shared_stats(&self) -> Arc<SharedStats> {
        self.stats.clone()
    }

    /// Counts into `sink` from now on (e.g. the counters of the device,
    /// which outlive this throttle). The requests queued here move with
    /// the queue depth; what was counted before stays in the old sink.
    pub fn count_into(&mut self, sink: Arc<SharedStats>) {
        let q = self.queue_depth as i64;
        self.stats.add_queue_depth(-q);
        sink.add_queue_depth(q);
        self.stats = sink;
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        self.leave_group();
    }
}
