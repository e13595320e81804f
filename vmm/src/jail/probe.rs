//! What this host permits: each namespace kind tried in a throw-away child
//! process, so a caller (a test, the daemon at start-up) knows which part
//! of a jail cannot be had here, and why, before a VM fails on it.

use nix::sys::wait::WaitStatus;
use nix::unistd::ForkResult;
use rustix::thread::UnshareFlags;

/// A namespace kind a jail uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NsKind {
    /// Mount.
    Mount,
    /// Pid (and forking its first process).
    Pid,
    /// IPC.
    Ipc,
    /// Network.
    Net,
    /// UTS.
    Uts,
}

impl NsKind {
    /// Every kind.
    pub const ALL: [NsKind; 5] = [Self::Mount, Self::Pid, Self::Ipc, Self::Net, Self::Uts];

    /// Its name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Mount => "mount",
            Self::Pid => "pid",
            Self::Ipc => "ipc",
            Self::Net => "net",
            Self::Uts => "uts",
        }
    }

    pub(super) fn flag(self) -> UnshareFlags {
        match self {
            Self::Mount => UnshareFlags::NEWNS,
            Self::Pid => UnshareFlags::NEWPID,
            Self::Ipc => UnshareFlags::NEWIPC,
            Self::Net => UnshareFlags::NEWNET,
            Self::Uts => UnshareFlags::NEWUTS,
        }
    }
}

/// Tries `unshare` of `kind` in a child process (and, for a pid namespace,
/// forks its first process there). `Err` holds the errno that refused it.
/// Safe to call from a process with threads: the child makes only raw
/// syscalls before `_exit`.
pub fn probe(kind: NsKind) -> Result<(), std::io::Error> {
    probe_together(&[kind])
}

/// Tries every kind of `kinds` at once, in one child (one `unshare` of
/// them all): one fork for a start-up check instead of one per kind
/// (each waits for its child to be scheduled: 185-651 ms apiece in one
/// restart on the loaded host, beside 100 VM processes). `Err` names no kind: probe them one by
/// one ([`probe`]) to find which.
pub fn probe_together(kinds: &[NsKind]) -> Result<(), std::io::Error> {
    let flags = kinds
        .iter()
        .fold(UnshareFlags::empty(), |f, k| f | k.flag());
    let pid = kinds.contains(&NsKind::Pid);
    // SAFETY: the child calls only async-signal-safe functions (raw
    // syscalls through rustix, fork, waitpid, _exit) and never returns.
    match unsafe { nix::unistd::fork() }? {
        ForkResult::Child => {
            // SAFETY: the child is single-threaded and owns its namespaces;
            // nothing else in it runs before _exit.
            let code = match unsafe { rustix::thread::unshare_unsafe(flags) } {
                Err(e) => e.raw_os_error(),
                Ok(()) if pid => first_process(),
                Ok(()) => 0,
            };
            super::hard_exit(code)
        }
        ForkResult::Parent { child } => match nix::sys::wait::waitpid(child, None)? {
            WaitStatus::Exited(_, 0) => Ok(()),
            WaitStatus::Exited(_, code) => Err(std::io::Error::from_raw_os_error(code)),
            other => Err(std::io::Error::other(format!("probe child: {other:?}"))),
        },
    }
}

/// In a child that unshared its pid namespace: forks pid 1 there.
fn first_process() -> i32 {
    // SAFETY: as in `probe`: a single-threaded child, raw syscalls only.
    match unsafe { nix::unistd::fork() } {
        Err(e) => e as i32,
        Ok(ForkResult::Child) => super::hard_exit(i32::from(
            rustix::process::getpid().as_raw_nonzero().get() != 1,
        )),
        Ok(ForkResult::Parent { child }) => match nix::sys::wait::waitpid(child, None) {
            Ok(WaitStatus::Exited(_, 0)) => 0,
            Ok(_) => libc::EINVAL,
            Err(e) => e as i32,
        },
    }
}

/// Every kind's probe.
pub fn probe_all() -> Vec<(NsKind, Result<(), std::io::Error>)> {
    NsKind::ALL.iter().map(|&k| (k, probe(k))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_together_agrees_with_one_by_one() {
        let each = NsKind::ALL.iter().all(|&k| probe(k).is_ok());
        assert_eq!(probe_together(&NsKind::ALL).is_ok(), each);
        if each {
            assert!(probe_together(&[NsKind::Pid, NsKind::Net]).is_ok());
        }
    }
}
