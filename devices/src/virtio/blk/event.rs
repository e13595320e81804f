//! The device thread's view of a disk: its queue eventfd, throttle timer
//! and, on the io_uring engine, the ring's completion eventfd.

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};

use super::{Block, RING_TOKEN, TIMER_TOKEN};

impl MutEventSubscriber for Block {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        match events.data() {
            TIMER_TOKEN => {
                self.timer.drain();
                self.timer.fired(super::throttle::monotonic_ns());
                self.process_queue();
            }
            0 => {
                // Drain the notification; if the throttle holds a request,
                // process_queue returns at once (the timer resumes us).
                let _ = self.queue_evts[0].read();
                self.process_queue_polling();
            }
            RING_TOKEN => {
                if let Some(u) = self.engine.uring.as_ref() {
                    let _ = u.eventfd().read();
                }
                // Completes what finished, then serves (and polls) the queue:
                // a driver refills it as completions arrive. A wake-up for
                // completions already reaped does nothing.
                if self.reap() {
                    self.notify_used();
                    self.process_queue_polling();
                }
            }
            other => tracing::warn!("virtio-blk: unexpected event token {other}"),
        }
        // A tight wait that ended without an admission (reset, limit change)
        // leaves no boost behind.
        self.timer.settle();
    }

    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::with_data(&self.queue_evts[0], 0, EventSet::IN)) {
            tracing::error!("virtio-blk: cannot watch the queue eventfd: {e:?}");
        }
        if let Err(e) = ops.add(Events::with_data(&self.timer, TIMER_TOKEN, EventSet::IN)) {
            tracing::error!("virtio-blk: cannot watch the throttle timer: {e:?}");
        }
        if let Some(u) = self.engine.uring.as_ref()
            && let Err(e) = ops.add(Events::with_data(u.eventfd(), RING_TOKEN, EventSet::IN))
        {
            tracing::error!("virtio-blk: cannot watch the io_uring eventfd: {e:?}");
        }
    }
}
