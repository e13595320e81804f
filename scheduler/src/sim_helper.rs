//! A simulated VM's device thread: work the VM's I/O puts on it, served by
//! the host model like any thread but never parked, its CPU time charged to
//! the VM, and reported to the policy as a busy helper the way the VMM's
//! scheduler thread does (it ran at least 1/100 of a tick within the last
//! 3 ticks).

/// A thread counts as busy for this many ticks after it last ran.
const MEMORY_TICKS: u8 = 3;
/// It ran if it used at least 1/this of a tick.
const BUSY_FRACTION: f64 = 100.0;

#[derive(Debug, Clone)]
pub(super) struct Helper {
    /// Work queued on the thread, ns of CPU.
    pub(super) left: f64,
    /// CPU it used in the current tick, ns.
    ran_tick: f64,
    /// Ticks since it last ran (saturating).
    idle_ticks: u8,
}

impl Default for Helper {
    fn default() -> Self {
        Self {
            left: 0.0,
            ran_tick: 0.0,
            idle_ticks: MEMORY_TICKS,
        }
    }
}

impl Helper {
    /// Adds the thread's demand for a step of `step` ns to the host model's
    /// spinning count or its list of partial needs.
    pub(super) fn demand(&self, step: f64, spinning: &mut u64, partial: &mut Vec<f64>) {
        if self.left >= step {
            *spinning += 1;
        } else if self.left > 0.0 {
            partial.push(self.left);
        }
    }

    /// Runs the thread for at most `slice` ns; returns the CPU it used.
    pub(super) fn run(&mut self, slice: f64) -> f64 {
        let take = self.left.min(slice).max(0.0);
        self.left -= take;
        self.ran_tick += take;
        take
    }

    /// Ends a tick of `tick_ns`: 1 if the thread counts as busy, else 0.
    pub(super) fn end_tick(&mut self, tick_ns: u64) -> u32 {
        if self.ran_tick * BUSY_FRACTION >= tick_ns as f64 {
            self.idle_ticks = 0;
        } else {
            self.idle_ticks = self.idle_ticks.saturating_add(1);
        }
        self.ran_tick = 0.0;
        u32::from(self.idle_ticks < MEMORY_TICKS)
    }
}
