//! The jail's errors: each names the step that failed ([`Step`]), so a VM
//! that does not start says why.

/// The steps of [`crate::jail::enter`], in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Counting the process's threads (it must have one).
    CountThreads,
    /// Opening the KVM device.
    OpenKvm(String),
    /// Cloning a file's mount (`open_tree`) from its fd, before unsharing.
    CloneMount(String),
    /// Blocking signals around the fork.
    BlockSignals,
    /// `unshare` of the namespaces (their names).
    Unshare(String),
    /// Forking the pid namespace's first process.
    Fork,
    /// Setting the parent-death signal.
    ParentDeathSignal,
    /// Making every mount private (no propagation to or from the host).
    PrivatePropagation,
    /// Mounting the private root (tmpfs) on the staging directory.
    MountRoot(String),
    /// Creating a mount point in the private root.
    MountPoint(String),
    /// Attaching a file's mount in the private root (`move_mount`).
    AttachMount(String),
    /// Remounting a file's mount with its flags (read-only, nosuid, ...).
    RemountFile(String),
    /// Remounting the private root read-only.
    RemountRoot,
    /// `pivot_root` into the private root.
    PivotRoot,
    /// Detaching the old root.
    DetachOldRoot,
    /// Setting the host name.
    Hostname,
    /// Setting one resource limit (its name).
    Rlimit(&'static str),
    /// Dropping a capability from the bounding set (its number).
    BoundingSet(u32),
    /// Clearing the ambient capabilities.
    AmbientCaps,
    /// Emptying the supplementary groups.
    Groups,
    /// `setresgid`.
    SetGid(u32),
    /// `setresuid`.
    SetUid(u32),
    /// Clearing the effective, permitted and inheritable capabilities.
    Capabilities,
    /// `PR_SET_NO_NEW_PRIVS`.
    NoNewPrivs,
    /// Checking the result (a privilege still held).
    Verify,
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::CountThreads => write!(f, "counting the process's threads"),
            Self::OpenKvm(p) => write!(f, "opening the KVM device {p}"),
            Self::CloneMount(n) => write!(f, "cloning the mount of file {n} (open_tree)"),
            Self::BlockSignals => write!(f, "blocking signals"),
            Self::Unshare(ns) => write!(f, "unsharing the {ns} namespaces"),
            Self::Fork => write!(f, "forking the pid namespace's first process"),
            Self::ParentDeathSignal => write!(f, "setting the parent-death signal"),
            Self::PrivatePropagation => write!(f, "making mount propagation private"),
            Self::MountRoot(d) => write!(f, "mounting the private root (tmpfs) on {d}"),
            Self::MountPoint(n) => write!(f, "creating the mount point {n}"),
            Self::AttachMount(n) => write!(f, "attaching file {n} in the private root"),
            Self::RemountFile(n) => write!(f, "remounting file {n} with its flags"),
            Self::RemountRoot => write!(f, "remounting the private root read-only"),
            Self::PivotRoot => write!(f, "pivot_root into the private root"),
            Self::DetachOldRoot => write!(f, "detaching the old root"),
            Self::Hostname => write!(f, "setting the host name"),
            Self::Rlimit(r) => write!(f, "setting {r}"),
            Self::BoundingSet(c) => write!(f, "dropping capability {c} from the bounding set"),
            Self::AmbientCaps => write!(f, "clearing the ambient capabilities"),
            Self::Groups => write!(f, "emptying the supplementary groups"),
            Self::SetGid(g) => write!(f, "setresgid({g})"),
            Self::SetUid(u) => write!(f, "setresuid({u})"),
            Self::Capabilities => write!(f, "clearing the capabilities"),
            Self::NoNewPrivs => write!(f, "setting no_new_privs"),
            Self::Verify => write!(f, "checking the dropped privileges"),
        }
    }
}

/// Why a jail could not be set up. The VM must not start.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    /// The spec is refused before any step runs.
    #[error("jail: bad spec: {0}")]
    Spec(String),
    /// The process has other threads: namespaces, credentials and
    /// capabilities would change for the calling thread only.
    #[error(
        "jail: the process has {0} threads; the jail must be entered while it has one (before \
         any runtime or VM thread starts)"
    )]
    Threads(usize),
    /// A step failed.
    #[error("jail: {step}: {source}")]
    Step {
        /// Which.
        step: Step,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A privilege is still held after the steps that drop it.
    #[error("jail: still held after dropping it: {0}")]
    Verify(String),
}

impl JailError {
    /// The step that failed, if a step did.
    pub fn step(&self) -> Option<&Step> {
        match self {
            Self::Step { step, .. } => Some(step),
            _ => None,
        }
    }
}

/// Maps an errno-style error to a [`JailError::Step`].
pub(crate) fn at<E: Into<std::io::Error>>(step: Step) -> impl FnOnce(E) -> JailError {
    move |e| JailError::Step {
        step,
        source: e.into(),
    }
}
