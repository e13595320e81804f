//! Messages from the API (through [`crate::handle::VmHandle`]) to a VM's
//! device thread, which owns the disks between two requests.
//!
//! A message is applied at most once and only if the sender still waits
//! for it: the sender that gives up (the device thread did not answer in
//! time) withdraws the message first, so a late device thread skips it
//! and "did not answer" means "nothing changed".

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::Sender;

use corral_blkthrottle::{Limits, ThrottleGroup};

use crate::vm::VmError;

/// What to do to a disk.
pub(crate) enum DiskOp {
    /// Replace its limits (keeping its queue and earned tokens).
    Limits(Limits),
    /// Move it into a throttle group (or out of any).
    Group(Option<(ThrottleGroup, u32)>),
    /// Change its weight in its group, keeping its place there.
    Weight(u32),
}

/// A message to a VM's device thread: an operation on one of its disks.
pub(crate) struct Control {
    /// Index of the disk in [`crate::shared::Shared::disks`].
    pub(crate) disk: usize,
    pub(crate) op: DiskOp,
    pub(crate) reply: Sender<Result<(), VmError>>,
    pub(crate) claim: Claim,
}

const PENDING: u8 = 0;
const TAKEN: u8 = 1;
const WITHDRAWN: u8 = 2;

/// Who gets a message: the device thread (which takes it to apply it) or
/// the sender (which withdraws it when it stops waiting). Exactly one wins.
#[derive(Clone, Default)]
pub(crate) struct Claim(Arc<AtomicU8>);

impl Claim {
    /// The device thread's side: true if it may apply the message.
    pub(crate) fn take(&self) -> bool {
        self.swap_from_pending(TAKEN)
    }

    /// The sender's side: true if the message will never be applied.
    pub(crate) fn withdraw(&self) -> bool {
        self.swap_from_pending(WITHDRAWN)
    }

    fn swap_from_pending(&self, to: u8) -> bool {
        self.0
            .compare_exchange(PENDING, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::Claim;

    #[test]
    fn a_message_is_taken_or_withdrawn_never_both() {
        let c = Claim::default();
        assert!(c.take());
        assert!(!c.withdraw());
        let c = Claim::default();
        assert!(c.withdraw());
        assert!(!c.clone().take());
    }
}
