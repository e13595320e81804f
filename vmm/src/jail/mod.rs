//! The jail a VM process applies to itself before it touches guest data
//! (issue 15, item 2; the shape of Firecracker's jailer, done in-process).
//!
//! [`enter`] runs these steps, in order, and fails closed: the first step
//! that fails returns a [`JailError`] naming it ([`Step`]), and the caller
//! must not start the VM (the process is half-jailed by then: it exits).
//!
//! 1. The spec is checked ([`JailSpec::check`]): an unprivileged uid and
//!    gid (not 0, not `u32::MAX`), file names of one component.
//! 2. The process must have exactly one thread (namespaces, credentials
//!    and capabilities change for the calling thread only).
//! 3. `/dev/kvm` is opened (a character device, or the step fails).
//! 4. Each file's mount is cloned from its open fd (`open_tree`), and the
//!    KVM device's; see [`mounts`] for why this comes before `unshare`.
//! 5. `unshare` of the mount, IPC, UTS, network and pid namespaces (those
//!    the spec asks for; mount always), less those the spawner made for
//!    this process ([`spawned_in`]: checked not to be the spawner's own).
//! 6. With a pid namespace: nothing, if the process is pid 1 of one
//!    already (its spawner cloned it there: `vmproc::spawn`, as the
//!    daemon's launcher does); otherwise one `fork` ([`pidns`]). The child
//!    goes on as pid 1 of the new namespace; the parent never returns from `enter`:
//!    it drops its privileges like the child and confines itself (no
//!    core, its standard fds and one pipe, a seccomp filter of a dozen
//!    syscalls: [`reaper`],
//!    [`OUTER_SYSCALLS`]), waits for the child, forwards termination
//!    signals, and exits as the child did.
//! 7. Mount propagation made private (recursively, from `/`).
//! 8. A tmpfs on `spec.staging` becomes the private root: the files at
//!    `/NAME` (read-only, `nosuid,nodev,noexec` where the spec says
//!    read-only; `nosuid,nodev,noexec` always), `/dev/kvm`; the tmpfs is
//!    remounted read-only; `pivot_root` into it; the old root detached.
//! 9. The host name (UTS namespace).
//! 10. Resource limits, soft = hard: `RLIMIT_NOFILE`, `RLIMIT_AS`,
//!     `RLIMIT_NPROC`, `RLIMIT_FSIZE`, `RLIMIT_CORE` = 0, `RLIMIT_RTPRIO`
//!     = 1 (where the spawner may raise it); `RLIMIT_RTTIME` soft 200 ms,
//!     hard 1 s.
//! 11. Capabilities dropped from the bounding and ambient sets, the
//!     supplementary groups emptied, `setresgid`, `setresuid` (real,
//!     effective, saved), the capability sets cleared, `no_new_privs`.
//! 12. The parent-death signal set again (the uid change clears it).
//! 13. Checked: ids, no groups, no capability in any set, `no_new_privs`,
//!     and `setresuid(0)` fails.
//!
//! What the spawner does: start the VM process with its files open (the
//! kernel, initrd and disks it opened and locked under its host-path
//! policy), and nothing else. The process calls `enter` first thing,
//! before any thread (a tokio runtime, the VM's threads) exists, then
//! installs its seccomp filters and starts the VM with
//! [`crate::builder::start_with_kvm`] on [`Jailed::kvm`]. The pid the
//! spawner holds is the outer process's (the reaper's); killing it with
//! SIGKILL kills the VM too (parent-death signal). Thread ids the VM
//! process reports (`gettid`) are its own namespace's: the daemon must not
//! use them as host tids (`/proc/PID/task` of the VM process, seen from the
//! host, lists the host tids).
//!
//! Pid 1 of a namespace ignores every signal it has no handler for, even
//! from its parent (SIGKILL and SIGSTOP excepted): a VM process that
//! wants SIGTERM to stop it installs a handler.

mod creds;
mod error;
mod forvm;
mod mounts;
mod pidns;
mod premade;
mod probe;
pub mod reaper;
mod spec;
mod status;
mod uids;

use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::{FileType, Mode, OFlags};
use rustix::thread::UnshareFlags;

pub use creds::{RTPRIO, RTTIME_HARD_US, RTTIME_SOFT_US};
pub use error::{JailError, Step};
pub use forvm::{HostView, enter_vm, host_view};
pub use premade::spawned_in;
pub use probe::{NsKind, probe, probe_all, probe_together};
pub use reaper::ALLOWED as OUTER_SYSCALLS;
pub use spec::{
    AS_MARGIN, AS_PER_VCPU, DEFAULT_UID_BASE, DEFAULT_UID_COUNT, JailFile, JailLimits, JailSpec,
    Namespaces, UidRange,
};
pub use status::JailStatus;
pub use uids::{UidLease, UidPool, uids_running};

use error::at;

/// A jailed process: what [`enter`] returns (in the process that runs the
/// VM).
#[derive(Debug)]
pub struct Jailed {
    kvm: OwnedFd,
    /// Whether this process is pid 1 of its own pid namespace.
    pub pid_namespace: bool,
    /// The namespaces made (mount always).
    pub namespaces: Namespaces,
}

impl Jailed {
    /// The KVM device, opened before the privileges were dropped.
    pub fn kvm_fd(&self) -> &OwnedFd {
        &self.kvm
    }

    /// The KVM device as a [`kvm_ioctls::Kvm`], for
    /// [`crate::builder::start_with_kvm`].
    pub fn kvm(self) -> kvm_ioctls::Kvm {
        use std::os::fd::{FromRawFd, IntoRawFd};
        // SAFETY: the fd is an open /dev/kvm (checked a character device
        // when opened), owned by us and handed over whole.
        unsafe { kvm_ioctls::Kvm::from_raw_fd(self.kvm.into_raw_fd()) }
    }
}

/// `_exit`: ends the process at once, without running exit handlers or
/// flushing stdio buffers that a fork duplicated.
pub(crate) fn hard_exit(code: i32) -> ! {
    // SAFETY: _exit takes any status and does not return; nothing of this
    // process is used after it.
    unsafe { libc::_exit(code) }
}

fn count_threads() -> Result<usize, JailError> {
    let n = std::fs::read_dir("/proc/self/task")
        .map_err(at(Step::CountThreads))?
        .count();
    Ok(n)
}

fn open_kvm(spec: &JailSpec<'_>) -> Result<OwnedFd, JailError> {
    let step = || Step::OpenKvm(spec.kvm_path.display().to_string());
    let fd = rustix::fs::open(
        &spec.kvm_path,
        OFlags::RDWR | OFlags::CLOEXEC | OFlags::NOFOLLOW,
        Mode::empty(),
    )
    .map_err(at(step()))?;
    let st = rustix::fs::fstat(&fd).map_err(at(step()))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::CharacterDevice {
        return Err(JailError::Step {
            step: step(),
            source: std::io::Error::other("not a character device"),
        });
    }
    Ok(fd)
}

fn unshare_flags(ns: &Namespaces, new_pid: bool) -> (UnshareFlags, String) {
    let mut f = UnshareFlags::NEWNS;
    let mut names = vec!["mount"];
    for (on, flag, name) in [
        (ns.ipc, UnshareFlags::NEWIPC, "ipc"),
        (ns.uts, UnshareFlags::NEWUTS, "uts"),
        (ns.net, UnshareFlags::NEWNET, "net"),
        (ns.pid && new_pid, UnshareFlags::NEWPID, "pid"),
    ] {
        if on {
            f |= flag;
            names.push(name);
        }
    }
    (f, names.join(", "))
}

/// Whether this process is pid 1 of its pid namespace: its spawner cloned
/// it into a new one (`vmproc::spawn`), so the jail has a pid namespace
/// without a fork. (Pid 1 of the host's namespace is init, never a VM
/// process.)
fn is_pid_namespace_init() -> bool {
    rustix::process::getpid().is_init()
}

/// Jails the calling process (see the module docs for the steps). With a
/// pid namespace this forks, unless the process is pid 1 of one already
/// (started by `vmproc::spawn` with `CLONE_NEWPID`): `enter` then returns
/// in the child only, which is pid 1 of the new namespace; the parent
/// waits for it and exits with its status.
pub fn enter(spec: &JailSpec<'_>) -> Result<Jailed, JailError> {
    use crate::boottrace::step;
    spec.check()?;
    match count_threads()? {
        1 => {}
        n => return Err(JailError::Threads(n)),
    }
    let kvm = open_kvm(spec)?;
    let trees = mounts::clone_trees(&spec.files, kvm.as_fd())?;
    step("jail-open");
    let fork = spec.namespaces.pid && !is_pid_namespace_init();
    // Kinds the spawner made for this process (checked not to be its
    // own) are not made again.
    let made = premade::checked()?;
    let make = Namespaces {
        pid: spec.namespaces.pid,
        ipc: spec.namespaces.ipc && !made.ipc,
        net: spec.namespaces.net && !made.net,
        uts: spec.namespaces.uts && !made.uts,
    };
    let (flags, names) = unshare_flags(&make, fork);
    // SAFETY: the process has one thread (checked above), and no file
    // table or fs state is shared with another process through CLONE_FILES
    // or CLONE_FS that would be surprised by the new namespaces.
    unsafe { rustix::thread::unshare_unsafe(flags) }.map_err(at(Step::Unshare(names)))?;
    step("jail-unshare");
    let link = if fork {
        let l = pidns::fork(spec.uid, spec.gid)?;
        step("jail-fork");
        Some(l)
    } else {
        None
    };
    mounts::make_private()?;
    step("jail-private");
    mounts::build_root(&spec.staging, trees)?;
    step("jail-root");
    if spec.namespaces.uts {
        rustix::system::sethostname(spec.hostname.as_bytes()).map_err(at(Step::Hostname))?;
    }
    creds::set_limits(&spec.limits)?;
    step("jail-limits");
    creds::drop_privileges(spec.uid, spec.gid)?;
    step("jail-drop");
    if let Some(l) = &link {
        l.arm()?;
    }
    creds::verify(spec.uid, spec.gid)?;
    step("jail-verify");
    tracing::debug!(uid = spec.uid, namespaces = %unshare_flags(&spec.namespaces, true).1, "jailed");
    Ok(Jailed {
        kvm,
        pid_namespace: spec.namespaces.pid,
        namespaces: spec.namespaces,
    })
}
