//! How long the device thread polls the available ring after serving it:
//! an adaptive window, the rule of KVM's halt polling. What decides is how
//! long the device then waited for work: a wait longer than the longest
//! window means no poll would have paid, and halves the window (down to
//! none); a wait within the longest window means a longer poll would have
//! caught the work, and grows it (doubling, up to the longest). A poll that
//! finds work keeps the window, and so does a poll that runs out when the
//! work turns up at once (the re-check after notifications are re-enabled).
//!
//! A first version halved the window at every poll that ran out, and grew
//! it only on a notification soon after: the probe's 4 KiB qd-4 job, whose
//! refills often land just past the window and are found by the re-check
//! (no notification, no growth), went from 47.4 to 67.4 ms (blkbench,
//! release, quiet host; with this rule see BENCHMARKS.md).
//!
//! Why: alone, the probe's driver refills its ring within ~100 µs and a
//! fixed 200 µs poll took a 4 KiB qd-4 job to 0.61× the time (see
//! [`POLL_NS`](super::queue::POLL_NS)). Beside a CPU hog on a 2-CPU host
//! the vCPU that would refill the ring is often waiting for a CPU, so the
//! polls run out: the device thread (nice −10) spun 200 µs per batch,
//! 1.87 s of CPU per 127 MiB against 0.25 s with polling off (interference
//! benchmark, schedstat per thread), CPU charged to the victim VM and taken
//! from its own vCPU.

use super::throttle::Nanos;

/// Windows shorter than this are not worth a poll: the window drops to 0.
const MIN_NS: u64 = 10_000;
/// Where a window grows from after it dropped to 0.
const START_NS: u64 = 25_000;

/// The adaptive poll window of one queue.
#[derive(Debug, Clone)]
pub(super) struct PollWindow {
    max: u64,
    cur: u64,
    /// When the device last stopped polling (or served without polling).
    gave_up_at: Option<Nanos>,
}

impl PollWindow {
    /// A window that starts at, and never exceeds, `max` ns (0: never poll).
    pub(super) fn new(max: u64) -> Self {
        Self {
            max,
            cur: max,
            gave_up_at: None,
        }
    }

    /// How long to poll now, ns.
    pub(super) fn window(&self) -> u64 {
        self.cur
    }

    /// The device was woken (a notification, a timer, a completion, or
    /// work found by the re-check) at `now`: a wait within the longest
    /// window grows the window (a longer poll would have caught it), a
    /// longer one shrinks it (no poll would have).
    pub(super) fn woken(&mut self, now: Nanos) {
        let Some(t) = self.gave_up_at.take() else {
            return;
        };
        if self.max == 0 {
            return;
        }
        if now.saturating_sub(t) <= self.max {
            self.cur = self.cur.saturating_mul(2).max(START_NS).min(self.max);
        } else {
            self.cur /= 2;
            if self.cur < MIN_NS {
                self.cur = 0;
            }
        }
    }

    /// The device stopped polling at `now`: a poll ran out without work
    /// (`polled`), or (window 0) it served the queue without polling. The
    /// next wake-up decides what the window becomes.
    pub(super) fn gave_up(&mut self, now: Nanos, polled: bool) {
        let _ = polled;
        self.gave_up_at = Some(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misses_shrink_it_and_quick_wakes_grow_it() {
        let mut w = PollWindow::new(200_000);
        assert_eq!(w.window(), 200_000);
        // Misses, each followed by a wake long after (a descheduled vCPU).
        let mut t = 0;
        let mut seen = Vec::new();
        for _ in 0..6 {
            seen.push(w.window());
            let polled = w.window() > 0;
            t += w.window();
            w.gave_up(t, polled);
            t += 5_000_000;
            w.woken(t);
        }
        assert_eq!(seen, [200_000, 100_000, 50_000, 25_000, 12_500, 0]);
        // Wakes soon after giving up: back up, doubling, to the maximum.
        let mut seen = Vec::new();
        for _ in 0..5 {
            // Served without polling (the window is 0 to begin with).
            w.gave_up(t, false);
            t += 50_000;
            w.woken(t);
            seen.push(w.window());
        }
        assert_eq!(seen, [25_000, 50_000, 100_000, 200_000, 200_000]);
    }

    #[test]
    fn hits_keep_it_and_zero_never_polls() {
        let mut w = PollWindow::new(200_000);
        for i in 0..100 {
            // A poll that finds work: no give-up; the next wake is a
            // notification after the device went back to sleep much later.
            w.woken(i * 1_000_000);
        }
        assert_eq!(w.window(), 200_000);
        let mut z = PollWindow::new(0);
        z.gave_up(0, false);
        z.woken(1);
        assert_eq!(z.window(), 0);
    }

    /// Beside a CPU hog: every poll runs out and the refill comes 1 ms
    /// later. The spinning over 1000 batches stays within a few windows,
    /// where a fixed window spins for every batch (200 ms).
    #[test]
    fn a_starved_driver_costs_a_few_windows_not_one_per_batch() {
        let mut w = PollWindow::new(200_000);
        let (mut t, mut spun) = (0u64, 0u64);
        for _ in 0..1000 {
            let p = w.window();
            spun += p;
            t += p;
            w.gave_up(t, p > 0);
            t += 1_000_000;
            w.woken(t);
        }
        assert!(spun <= 400_000, "{spun}");
    }

    /// Polls that run out with the work found at once by the re-check (no
    /// long wait in between) keep the window: the first rule halved it at
    /// each of them and the 4 KiB qd-4 job lost most of polling's gain.
    #[test]
    fn misses_caught_by_the_recheck_keep_the_window() {
        let mut w = PollWindow::new(200_000);
        let mut t = 0;
        for _ in 0..50 {
            t += w.window();
            w.gave_up(t, true);
            t += 2_000;
            w.woken(t);
        }
        assert_eq!(w.window(), 200_000);
        // Two misses in a row with no wake-up between them (the old
        // re-check path) do not shrink it either.
        w.gave_up(t, true);
        w.gave_up(t + 1, true);
        assert_eq!(w.window(), 200_000);
    }
}
