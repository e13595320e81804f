//! The manager's errors and their kinds (the API maps a kind to an HTTP
//! status).

use super::*;

/// What kind of failure an error is; the API maps it to an HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Bad input (400).
    Invalid,
    /// Unknown VM, class or disk (404).
    NotFound,
    /// Conflicts with the current state: duplicate name, class in use (409).
    Conflict,
    /// Refused by admission control or resource limits (422).
    Refused,
    /// The host failed (500).
    Internal,
    /// The change could not be written to the state directory (507); it
    /// was not made.
    Storage,
    /// A VM's thread did not answer in time (503); try again.
    Unavailable,
}

/// Errors of the manager.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    /// Bad input.
    #[error("{0}")]
    Invalid(String),
    /// Something named does not exist.
    #[error("{0}")]
    NotFound(String),
    /// Conflicts with the current state.
    #[error("{0}")]
    Conflict(String),
    /// Refused by admission control or a resource limit.
    #[error("{0}")]
    Refused(String),
    /// The scheduler model refused.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The VM could not be started.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// A kernel, initrd or disk is refused by the host-path policy, locked
    /// by another user, or cannot be opened.
    #[error(transparent)]
    HostFile(#[from] HostFileError),
    /// The manager is shutting down.
    #[error("the daemon is shutting down")]
    ShuttingDown,
    /// The state file could not be written; nothing was changed.
    #[error("{0}")]
    Storage(String),
}

impl ManagerError {
    /// The kind, for the HTTP status.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Invalid(_) => ErrorKind::Invalid,
            Self::NotFound(_) => ErrorKind::NotFound,
            Self::Conflict(_) => ErrorKind::Conflict,
            Self::Refused(_) => ErrorKind::Refused,
            Self::ShuttingDown => ErrorKind::Conflict,
            Self::Storage(_) => ErrorKind::Storage,
            Self::Model(m) => match m.kind() {
                ModelErrorKind::Invalid => ErrorKind::Invalid,
                ModelErrorKind::NotFound => ErrorKind::NotFound,
                ModelErrorKind::Conflict => ErrorKind::Conflict,
                ModelErrorKind::Refused => ErrorKind::Refused,
            },
            Self::HostFile(h) => host_file_kind(h),
            Self::Vm(v) => match v {
                VmError::HostFile(h) => host_file_kind(h),
                VmError::Config(_) | VmError::Load(_) | VmError::Disk { .. } => ErrorKind::Invalid,
                VmError::NoSuchDisk(_) => ErrorKind::NotFound,
                VmError::Stopped(_) => ErrorKind::Conflict,
                VmError::DeviceUnresponsive { .. } => ErrorKind::Unavailable,
                VmError::Memory(_) => ErrorKind::Refused,
                VmError::Acpi(_) => ErrorKind::Invalid,
                VmError::Kvm { .. }
                | VmError::Boot(_)
                | VmError::MpTable(_)
                | VmError::Io { .. } => ErrorKind::Internal,
            },
        }
    }
}

impl ManagerError {
    /// A more specific API error code than the kind's, if any:
    /// `path_policy` (400), `image_locked` (409), `vm_stopped` (409: a
    /// change to a stopped VM's disks) and `device_unresponsive` (503).
    pub fn code(&self) -> Option<&'static str> {
        let h = match self {
            Self::HostFile(h) | Self::Vm(VmError::HostFile(h)) => h,
            Self::Vm(VmError::Stopped(_)) => return Some("vm_stopped"),
            Self::Vm(VmError::DeviceUnresponsive { .. }) => return Some("device_unresponsive"),
            _ => return None,
        };
        match h {
            HostFileError::Policy { .. } => Some("path_policy"),
            HostFileError::Locked { .. } => Some("image_locked"),
            HostFileError::Io { .. } => None,
        }
    }
}

fn host_file_kind(h: &HostFileError) -> ErrorKind {
    match h {
        HostFileError::Locked { .. } => ErrorKind::Conflict,
        HostFileError::Policy { .. } | HostFileError::Io { .. } => ErrorKind::Invalid,
    }
}
