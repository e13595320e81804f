//! The device's side of the io_uring engine: submitting what a pass over
//! the available ring queued, reaping completions into the used ring, and
//! draining everything in flight before a reset or drop (`uring.rs` has the
//! ring itself).

use super::Block;

impl Block {
    /// Submits the requests queued on the ring in one system call, then
    /// completes whatever finished already (page-cache hits complete inside
    /// the submit). True if used entries were added.
    pub(super) fn submit_and_reap(&mut self) -> bool {
        let Some(u) = self.engine.uring.as_mut() else {
            return false;
        };
        u.submit();
        self.reap()
    }

    /// Completes every request the ring finished; true if any.
    pub(super) fn reap(&mut self) -> bool {
        let Some(u) = self.engine.uring.as_mut() else {
            return false;
        };
        let mut done = std::mem::take(&mut self.engine.done);
        u.reap(&mut done);
        let any = !done.is_empty();
        match self.active.as_mut() {
            Some(act) => {
                for d in done.drain(..) {
                    self.engine
                        .complete_done(act, self.throttle.as_deref_mut(), d);
                }
            }
            // Not reachable: a reset drains the ring before the queue goes.
            None => done.clear(),
        }
        self.engine.done = done;
        any
    }

    /// Requests in flight on the io_uring engine (0 on the sync engine).
    pub fn in_flight(&self) -> usize {
        self.engine.uring.as_ref().map_or(0, |u| u.in_flight())
    }

    /// Blocks until every request in flight completed, and completes them
    /// (with the interrupt the guest asked for). For tests and benchmarks
    /// that drive the device by hand; the device thread never blocks here,
    /// it reaps on the ring's eventfd.
    pub fn wait_io(&mut self) {
        while self.in_flight() > 0 {
            if let Some(u) = self.engine.uring.as_mut() {
                u.wait_one();
            }
            if self.reap() {
                self.notify_used();
            }
        }
    }

    /// Waits for everything in flight and forgets it: the queue it belongs
    /// to is being reset (its completions must not reach the new ring) or
    /// the device dropped. Afterwards no request can touch guest memory.
    pub(super) fn drain_io(&mut self) {
        if let Some(u) = self.engine.uring.as_mut() {
            let mut done = Vec::new();
            u.drain(&mut done);
        }
    }
}
