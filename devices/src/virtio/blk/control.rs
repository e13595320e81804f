//! The disk's control API, called on the device thread between two
//! requests: its throttle ([`Block::set_limits`], [`Block::set_group`], or
//! any [`RequestThrottle`] through [`Block::set_throttle`]) and the counters
//! it publishes ([`Block::counters`]).

use std::sync::Arc;

use corral_blkthrottle::{Limits, LimitsError, Stats, Throttle, ThrottleGroup};

use super::throttle::{RequestThrottle, monotonic_ns};
use super::{Block, DiskCounters};

impl Block {
    /// What this disk publishes for other threads: its counters and its
    /// throttle's, its limits and group. Reading them never locks the device.
    pub fn counters(&self) -> Arc<DiskCounters> {
        self.counters.clone()
    }

    /// The throttle's counters (admitted requests and bytes, waits,
    /// latency); zero while the disk never had a throttle.
    pub fn throttle_stats(&self) -> Stats {
        self.counters.throttle_stats()
    }

    /// Installs (or removes) the throttle. A request waiting for the
    /// old throttle is re-polled against the new one. The new throttle
    /// counts into the disk's counters, so they do not go back.
    pub fn set_throttle(&mut self, throttle: Option<Box<dyn RequestThrottle>>) {
        if let (Some(old), Some(a)) = (self.throttle.as_mut(), self.active.as_ref())
            && a.waiting.is_some()
        {
            old.cancel();
            old.note_dequeued();
        }
        self.throttle = throttle;
        if let Some(t) = self.throttle.as_mut() {
            t.count_into(self.counters.throttle_sink());
        }
        if let Some(a) = self.active.as_ref()
            && a.waiting.is_some()
            && let Some(g) = self.throttle.as_mut()
        {
            g.note_enqueued();
        }
        self.publish();
        self.throttle_changed();
    }

    /// Replaces the disk's own limits live: queued requests and earned
    /// tokens are kept, a waiting request is re-polled at once. A disk
    /// without a throttle gets one (unless `limits` is unlimited).
    pub fn set_limits(&mut self, limits: &Limits) -> Result<(), LimitsError> {
        limits.validate()?;
        let now = monotonic_ns();
        match self.throttle.as_mut() {
            Some(t) => t.set_limits(limits, now)?,
            None if limits.is_unlimited() => return Ok(()),
            None => {
                let t = Throttle::new(limits, now)?;
                self.set_throttle(Some(Box::new(t)));
                return Ok(());
            }
        }
        self.publish();
        self.throttle_changed();
        Ok(())
    }

    /// Moves the disk into `group` with `weight` (its share there), or out
    /// of any group. A disk without a throttle gets an unlimited one in the
    /// group.
    pub fn set_group(&mut self, group: Option<(&ThrottleGroup, u32)>) -> Result<(), LimitsError> {
        match self.throttle.as_mut() {
            Some(t) => t.set_group(group)?,
            None => {
                let Some((g, weight)) = group else {
                    return Ok(());
                };
                let mut t = Throttle::new(&Limits::default(), monotonic_ns())?;
                t.join_group(g, weight, None)?;
                self.set_throttle(Some(Box::new(t)));
                return Ok(());
            }
        }
        self.publish();
        self.throttle_changed();
        Ok(())
    }

    /// Changes the disk's weight in its group live (its place in line is
    /// kept; its next requests are served at the new weight). Nothing to
    /// do for a disk in no group.
    pub fn set_group_weight(&mut self, weight: u32) -> Result<(), LimitsError> {
        match self.throttle.as_mut() {
            Some(t) => t.set_weight(weight)?,
            None => {
                corral_blkthrottle::check_weight(weight)?;
            }
        }
        self.publish();
        Ok(())
    }

    /// Re-polls a waiting request now (after a live limit change) and
    /// resumes the queue if it is admitted.
    pub fn throttle_changed(&mut self) {
        self.process_queue();
    }

    /// Publishes the throttle's settings in the disk's counters.
    fn publish(&self) {
        let (limits, group, weight) = match &self.throttle {
            Some(t) => (t.limits(), t.group_name(), t.group_weight()),
            None => (Limits::default(), None, None),
        };
        self.counters.publish(limits, group, weight);
    }
}
