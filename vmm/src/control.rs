//! Messages from the API (through [`crate::handle::VmHandle`]) to a VM's
//! device thread, which owns the disks between two requests.

use std::sync::mpsc::Sender;

use corral_blkthrottle::{Limits, ThrottleGroup};

use crate::vm::VmError;

/// Messages to a VM's device thread.
pub(crate) enum Control {
    /// Replace a disk's limits (keeping its queue and earned tokens).
    SetLimits {
        disk: usize,
        limits: Limits,
        reply: Sender<Result<(), VmError>>,
    },
    /// Move a disk into a throttle group (or out of any).
    SetGroup {
        disk: usize,
        group: Option<(ThrottleGroup, u32)>,
        reply: Sender<Result<(), VmError>>,
    },
}
