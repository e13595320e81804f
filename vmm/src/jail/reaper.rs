//! What the outer process of a pid-namespaced jail may do ([`confine`]).
//!
//! The outer process is the one its spawner started and knows by pid; it
//! stays in the host's pid namespace, so it can see and signal host
//! processes that the jailed child cannot. It keeps nothing a guest could
//! use: its fds are closed but the standard three and the parent-alive
//! pipe, it runs as the VM's uid with no capability and `no_new_privs`
//! (`creds::drop_privileges`, as the child), no core dumps, and under a
//! seccomp filter that allows only what its loop needs, killing the
//! process (and so, by the parent-death signal, the VM) on anything else:
//!
//! - `rt_sigtimedwait` (waiting for a signal), `wait4` (reaping the child),
//!   `kill` (forwarding a signal: as the VM's uid, without capabilities,
//!   it reaches only its own child and itself), `tgkill`, `getpid`,
//!   `gettid` (raising the child's fatal signal on itself);
//! - `rt_sigprocmask`, `rt_sigaction`, `prctl(PR_SET_DUMPABLE)`,
//!   `restart_syscall`, `exit`, `exit_group` (ending as the child did).
//!
//! No `read`, `write`, `open`, `mmap`, `socket`, `fork` or `execve`: the
//! loop allocates nothing and touches no file.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// The syscalls the outer process makes once confined (see the module
/// docs), each with the reason.
pub const ALLOWED: [(i64, &str); 11] = [
    (
        libc::SYS_rt_sigtimedwait,
        "sigwait for the forwarded signals and SIGCHLD",
    ),
    (libc::SYS_wait4, "waitpid of the jailed child"),
    (libc::SYS_kill, "forwarding a signal to the child"),
    (libc::SYS_tgkill, "raise: ending by the child's signal"),
    (libc::SYS_getpid, "raise"),
    (libc::SYS_gettid, "raise"),
    (
        libc::SYS_rt_sigprocmask,
        "unblocking the child's signal before raising it",
    ),
    (
        libc::SYS_rt_sigaction,
        "the default action of the child's signal",
    ),
    (libc::SYS_restart_syscall, "an interrupted wait"),
    (libc::SYS_exit, "ending"),
    (libc::SYS_exit_group, "ending with the child's code"),
];

/// The outer process's filter: [`ALLOWED`], `prctl(PR_SET_DUMPABLE, ..)`;
/// anything else kills the process.
pub fn filter() -> Result<BpfProgram, String> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        ALLOWED.iter().map(|(nr, _)| (*nr, Vec::new())).collect();
    let dumpable = SeccompCondition::new(
        0,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        libc::PR_SET_DUMPABLE as u64,
    )
    .and_then(|c| SeccompRule::new(vec![c]))
    .map_err(|e| e.to_string())?;
    rules.insert(libc::SYS_prctl, vec![dumpable]);
    SeccompFilter::new(
        rules,
        SeccompAction::KillProcess,
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .and_then(TryInto::try_into)
    .map_err(|e| e.to_string())
}

/// Confines the calling (outer) process once its privileges are dropped
/// (`no_new_privs` is set): `RLIMIT_NOFILE` to the fds it holds
/// (`max_fd + 1`), `RLIMIT_CORE` 0, then the filter. `prog` was built by
/// [`filter`] before (building allocates).
pub(super) fn confine(prog: &BpfProgram, max_fd: u64) -> Result<(), String> {
    use rustix::process::{Resource, Rlimit, setrlimit};
    for (r, v) in [(Resource::Nofile, max_fd + 1), (Resource::Core, 0)] {
        setrlimit(
            r,
            Rlimit {
                current: Some(v),
                maximum: Some(v),
            },
        )
        .map_err(|e| format!("setrlimit {r:?}: {e}"))?;
    }
    seccompiler::apply_filter(prog).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_outer_filter_builds() {
        assert!(!super::filter().unwrap().is_empty());
    }
}
