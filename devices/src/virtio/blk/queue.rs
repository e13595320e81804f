//! Serving the request queue: popping chains, the throttle, notification
//! suppression, polling, and marking a broken queue NEEDS_RESET.

use std::num::Wrapping;
use std::sync::atomic::Ordering;

use virtio_queue::{QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::request::{self, Request, RequestType};
use super::stats::add;
use super::throttle::{
    Decision, Nanos, RequestThrottle, Step, TIGHT_SLACK_NS, ThrottleRequest, ThrottleTimer,
    monotonic_ns,
};
use super::{Active, BUDGET, Block, Engine, Waiting};
use crate::guest_log::GuestErrorKind;
use crate::virtio::int;
use corral_blkthrottle::WaitCause;

impl Block {
    /// Serves the request queue: the waiting request first, then the
    /// available ring, until it is empty, the throttle says wait, or the budget
    /// is spent (then the queue's eventfd is re-signalled to come back).
    pub fn process_queue(&mut self) {
        let used = self.serve();
        // The io_uring engine: one submit for the pass, and what completed
        // inline goes into the used ring with the rest.
        let reaped = self.submit_and_reap();
        if used || reaped {
            self.notify_used();
        }
    }

    /// One pass over the queue; true if the used ring may have changed.
    fn serve(&mut self) -> bool {
        let Some(act) = self.active.as_mut() else {
            return false;
        };
        if act.broken || !act.queue.ready() {
            return false;
        }
        let mut used_any = false;
        let now = if self.throttle.is_some() {
            monotonic_ns()
        } else {
            0
        };

        // The request the throttle held back, if any.
        if let Some(w) = act.waiting.take() {
            let g = self.throttle.as_mut();
            match admit(g, &self.timer, &w.req, now) {
                Some(until) => {
                    act.waiting = Some(w);
                    arm(&self.timer, until);
                    return false;
                }
                None => {
                    if let Some(g) = self.throttle.as_mut() {
                        g.note_dequeued();
                    }
                    // False: submitted to io_uring (reaped after the pass).
                    used_any |=
                        self.engine
                            .complete(act, self.throttle.as_deref_mut(), &w.req, w.taken_at);
                }
            }
        }

        let mut budget = BUDGET;
        'outer: loop {
            if !ring_sane(act, &self.engine) || !notifications_off(act, &self.engine) {
                return false;
            }
            loop {
                let head = match pop_head(act) {
                    Ok(Some(h)) => h,
                    Ok(None) => break,
                    Err(e) => {
                        break_ring(act, &self.engine, format_args!("cannot read the ring: {e}"));
                        return false;
                    }
                };
                budget -= 1;
                if budget == 0 {
                    // Let the other event sources run; come back soon.
                    let _ = self.queue_evts[0].write(1);
                }
                let parsed = request::parse(
                    &act.mem,
                    GuestAddress(act.queue.desc_table()),
                    act.queue.size(),
                    head,
                );
                let req = match parsed {
                    Ok(r) => r,
                    Err(m) => {
                        self.engine.malformed(act, m);
                        used_any = true;
                        if act.broken {
                            return false;
                        }
                        if budget == 0 {
                            break 'outer;
                        }
                        continue;
                    }
                };
                let taken_at = now;
                if let Some(until) = admit(self.throttle.as_mut(), &self.timer, &req, now) {
                    add(&self.engine.stats.throttled, 1);
                    if let Some(g) = self.throttle.as_mut() {
                        g.note_enqueued();
                    }
                    // Held back: nothing used yet, so no interrupt for it
                    // (one would wake a sleeping driver for nothing).
                    act.waiting = Some(Waiting { req, taken_at });
                    arm(&self.timer, until);
                    break 'outer;
                }
                used_any |= self
                    .engine
                    .complete(act, self.throttle.as_deref_mut(), &req, taken_at);
                if act.broken {
                    return false;
                }
                if budget == 0 {
                    break 'outer;
                }
            }
            match notifications_on(act, &self.engine) {
                Some(true) => continue,
                Some(false) => break,
                None => return false,
            }
        }
        used_any
    }

    /// Interrupts the guest for new used entries, unless it asked not to be.
    pub(super) fn notify_used(&mut self) {
        let Some(act) = self.active.as_mut() else {
            return;
        };
        if act.broken {
            return;
        }
        // Without EVENT_IDX, virtio-queue does not look at the driver's
        // VRING_AVAIL_F_NO_INTERRUPT flag; the spec says the device
        // should not interrupt then (a polling driver asked for none, and
        // each needless interrupt kicks its vCPU out of the guest).
        // The fence orders the used->idx store before the flag load: a
        // driver that clears the flag, fences and re-reads used->idx
        // before it sleeps (the probe's probe.wait=irq) is then either
        // seen here or sees the new index; without it the load could
        // pass the store and the interrupt be lost (virtio 1.2, 2.7.10).
        std::sync::atomic::fence(Ordering::SeqCst);
        let suppressed = !act.event_idx && avail_no_interrupt(&act.mem, act.queue.avail_ring());
        if !suppressed {
            match act.queue.needs_notification(&act.mem) {
                Ok(true) => act.interrupt.trigger(int::VRING),
                Ok(false) => {}
                Err(e) => break_ring(
                    act,
                    &self.engine,
                    format_args!("cannot read used_event: {e}"),
                ),
            }
        }
    }

    /// Serves the queue, then keeps polling the available ring for up to
    /// the poll window for more requests before going back to sleep. While
    /// it polls, `VRING_USED_F_NO_NOTIFY` stays set, so a driver that checks
    /// it (the probe does; Linux does) skips its notify: a driver that
    /// refills the ring as completions arrive is served with neither a
    /// guest exit nor a device thread wake-up per batch. When the window
    /// ends without work, notifications are re-enabled and the ring checked
    /// once more (a request published just before that check would
    /// otherwise wait for a notify that never comes).
    ///
    /// The window adapts ([`super::pollwin`]): a wait for work longer than
    /// the longest window shortens it, a shorter one lengthens it.
    pub fn process_queue_polling(&mut self) {
        self.poll.woken(monotonic_ns());
        loop {
            self.process_queue();
            let poll = self.poll.window();
            if poll == 0 {
                self.poll.gave_up(monotonic_ns(), false);
                return;
            }
            let Some(act) = self.active.as_mut() else {
                return;
            };
            if act.broken || act.waiting.is_some() || !act.queue.ready() {
                return;
            }
            if !notifications_off(act, &self.engine) {
                return;
            }
            let seen = Wrapping(act.queue.next_avail());
            let deadline = monotonic_ns().saturating_add(poll);
            let more = loop {
                // io_uring completions end the spin too: they are served
                // (and the guest told) by the next pass.
                if self
                    .engine
                    .uring
                    .as_mut()
                    .is_some_and(|u| u.has_completions())
                {
                    break true;
                }
                match act.queue.avail_idx(&act.mem, Ordering::Acquire) {
                    Ok(idx) if idx != seen => break true,
                    Ok(_) => {}
                    Err(e) => {
                        break_ring(act, &self.engine, format_args!("cannot read the ring: {e}"));
                        return;
                    }
                }
                if monotonic_ns() >= deadline {
                    break false;
                }
                std::hint::spin_loop();
            };
            if more {
                continue;
            }
            self.poll.gave_up(monotonic_ns(), true);
            match notifications_on(act, &self.engine) {
                // Work found by the re-check: a wake-up with no wait.
                Some(true) => {
                    self.poll.woken(monotonic_ns());
                    continue;
                }
                Some(false) | None => return,
            }
        }
    }
}

/// How long the device thread keeps polling a queue after serving it, by
/// default; `CORRAL_BLK_POLL_US` overrides it (0 turns polling off).
///
/// Measured here (`blkbench --poll-ab`, interleaved pairs, guest time):
/// 2048 × 4 KiB reads at queue depth 4 take 0.61× the time with 200 µs of
/// polling (76 → 46 ms; the probe then notifies once for the whole job
/// instead of ~1000 times), 0.68× at depth 1, 0.78–0.89× for 128 KiB
/// requests. 50 µs is shorter than the driver's turnaround for a batch
/// (~100 µs of emulated guest code here) and gave only 0.85×. The spinning
/// is the VM's own CPU: the gate backend charges the device thread's CPU
/// time to the VM, and polling stops while its vCPUs are parked (nothing
/// new arrives, the window runs out) or a request waits for the throttle.
pub const POLL_NS: u64 = 200_000;

pub(super) fn poll_ns() -> u64 {
    static V: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        std::env::var("CORRAL_BLK_POLL_US")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(POLL_NS, |us| us.saturating_mul(1000))
    })
}

/// Whether the driver set VRING_AVAIL_F_NO_INTERRUPT in the available ring.
pub(super) fn avail_no_interrupt(mem: &GuestMemoryMmap, avail_ring: u64) -> bool {
    mem.read_obj::<u16>(GuestAddress(avail_ring))
        .map(|flags| u16::from_le(flags) & 1 != 0)
        .unwrap_or(false)
}

/// Asks the throttle; `Some(at)` if the request must wait, `at` being when
/// (and for which step) to arm the timer. For a *tight* wait (the throttle's slack is shorter
/// than [`TIGHT_SLACK_NS`]: a bucket about one request deep, where a late
/// poll loses rate that no admission rule may give back — see the
/// `corral-blkthrottle` docs, "Lateness") the timer's planner
/// ([`corral_blkthrottle::Punctual`]) says when to wake (early by the
/// timer's recent lateness) and whether to boost the device thread for the
/// wait, and the last stretch (at most the planner's margin) is waited on
/// the clock, so the request goes on its due nanosecond.
fn admit(
    throttle: Option<&mut Box<dyn RequestThrottle>>,
    timer: &ThrottleTimer,
    req: &Request,
    now: Nanos,
) -> Option<Arm> {
    let g = throttle?;
    let gr = match req.kind {
        RequestType::In => ThrottleRequest::read(req.data_len),
        RequestType::Out => ThrottleRequest::write(req.data_len),
        _ => ThrottleRequest::other(),
    };
    let mut now = now;
    // At most one wait on the clock: the throttle's instants are exact.
    for _ in 0..2 {
        let until = match g.poll(gr, now) {
            Decision::Admit => {
                timer.admitted(now);
                return None;
            }
            Decision::Wait { until, cause } => {
                if cause != WaitCause::Disk || g.wait_slack(gr, now) >= TIGHT_SLACK_NS {
                    timer.not_tight();
                    return Some(Arm::Plain(until));
                }
                until
            }
        };
        match timer.plan(now, until) {
            Step::Fine { at, boost } => {
                if boost {
                    timer.boost();
                }
                return Some(Arm::Fine(at));
            }
            Step::Spin { until, boost } => {
                if boost {
                    timer.boost();
                }
                timer.spin_until(until);
            }
        }
        now = monotonic_ns();
    }
    Some(Arm::Plain(now))
}

/// When and why to arm the throttle timer.
#[derive(Clone, Copy, Debug)]
enum Arm {
    Plain(Nanos),
    Fine(Nanos),
}

fn arm(timer: &ThrottleTimer, at: Arm) {
    let r = match at {
        Arm::Plain(t) => timer.arm_at(t),
        Arm::Fine(t) => timer.arm_fine(t),
    };
    if let Err(e) = r {
        tracing::error!("virtio-blk: cannot arm the throttle timer: {e}");
    }
}

/// The head of the next available chain, if any. Through `iter()`, not
/// `pop_descriptor_chain`: the latter logs (through the `log` crate, per
/// call, unlimited) when the queue cannot be iterated, e.g. an available
/// ring at address 0, and returns `None` as if the ring were empty.
fn pop_head(act: &mut Active) -> Result<Option<u16>, virtio_queue::Error> {
    let size = act.queue.size();
    let Some(chain) = act.queue.iter(&act.mem)?.next() else {
        return Ok(None);
    };
    let head = chain.head_index();
    // A head beyond the table cannot be answered: add_used refuses it.
    if head >= size {
        return Err(virtio_queue::Error::InvalidDescriptorIndex);
    }
    Ok(Some(head))
}

/// Tells the driver it need not notify (the device is serving or polling
/// the ring); false if the ring is broken (and now marked so).
pub(super) fn notifications_off(act: &mut Active, eng: &Engine) -> bool {
    match act.queue.disable_notification(&act.mem) {
        Ok(()) => true,
        Err(e) => {
            break_ring(act, eng, format_args!("cannot set the used flags: {e}"));
            false
        }
    }
}

/// Asks the driver to notify again; `Some(true)` if requests arrived in
/// the meantime (serve them before sleeping), `None` if the ring is broken
/// (and now marked so).
pub(super) fn notifications_on(act: &mut Active, eng: &Engine) -> Option<bool> {
    match act.queue.enable_notification(&act.mem) {
        Ok(more) => Some(more),
        Err(e) => {
            break_ring(act, eng, format_args!("cannot enable notifications: {e}"));
            None
        }
    }
}

/// The queue cannot be processed: the device goes `DEVICE_NEEDS_RESET`
/// (with a configuration change interrupt, §2.1.2) and serves nothing
/// until the driver resets it; a notification meanwhile is a no-op.
pub(super) fn break_ring(act: &mut Active, eng: &Engine, why: std::fmt::Arguments<'_>) {
    if act.broken {
        return;
    }
    act.broken = true;
    add(&eng.stats.broken_rings, 1);
    eng.log.report(
        GuestErrorKind::BrokenRing,
        format_args!("virtio-blk: {why}; device needs reset"),
    );
    act.interrupt.set_needs_reset();
}

/// The driver may not make more than queue-size buffers available at once
/// (§2.7.13.3); more means a corrupt or hostile ring.
fn ring_sane(act: &mut Active, eng: &Engine) -> bool {
    match act.queue.avail_idx(&act.mem, Ordering::Acquire) {
        Ok(idx) => {
            let ahead = (idx - Wrapping(act.queue.next_avail())).0;
            if ahead <= act.queue.size() {
                return true;
            }
            break_ring(
                act,
                eng,
                format_args!(
                    "available index {ahead} entries ahead of a {}-entry queue",
                    act.queue.size()
                ),
            );
            false
        }
        Err(e) => {
            break_ring(
                act,
                eng,
                format_args!("cannot read the available index: {e}"),
            );
            false
        }
    }
}
