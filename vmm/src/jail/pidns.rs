//! The pid namespace: `unshare(CLONE_NEWPID)` applies to the caller's
//! children only, so [`crate::jail::enter`] forks once. The child goes on
//! as pid 1 of the new namespace and runs the VM; the parent stays in the
//! host's pid namespace as the process the daemon started (and knows by
//! pid): it closes every fd but the standard three, drops its privileges
//! like the child, forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and
//! SIGUSR2 to the child, and exits as the child did (same code, or the
//! same signal raised on itself). It never returns.
//!
//! The child dies with its parent (`PR_SET_PDEATHSIG` = SIGKILL, set again
//! after the uid change, which clears it); a pipe whose write end only
//! the parent holds tells the child whether the parent died before that.
//!
//! The parent is confined once its privileges are dropped (no core, a
//! seccomp filter that allows its loop only): see [`super::reaper`].

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::sys::signal::{SigHandler, SigSet, SigmaskHow, Signal};
use nix::sys::wait::{WaitPidFlag, WaitStatus};
use nix::unistd::{ForkResult, Pid};

use super::creds;
use super::error::{JailError, Step, at};

/// Signals the parent forwards to the child.
const FORWARDED: [Signal; 6] = [
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
];

/// The child's end of the parent-alive pipe.
pub(super) struct ParentLink {
    read: OwnedFd,
}

impl ParentLink {
    /// Sets the parent-death signal and checks that the parent is still
    /// there (its end of the pipe is open).
    pub(super) fn arm(&self) -> Result<(), JailError> {
        rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
            .map_err(at(Step::ParentDeathSignal))?;
        let mut fds = [rustix::event::PollFd::new(
            &self.read,
            rustix::event::PollFlags::IN,
        )];
        let zero = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        rustix::event::poll(&mut fds, Some(&zero)).map_err(at(Step::ParentDeathSignal))?;
        if fds[0].revents().contains(rustix::event::PollFlags::HUP) {
            return Err(JailError::Step {
                step: Step::ParentDeathSignal,
                source: std::io::Error::other("the parent process died"),
            });
        }
        Ok(())
    }
}

/// Forks. In the child (pid 1 of the new namespace): returns its link to
/// the parent, with the signal mask restored and the parent-death signal
/// set. In the parent: never returns.
pub(super) fn fork(uid: u32, gid: u32) -> Result<ParentLink, JailError> {
    let (read, write) =
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(at(Step::Fork))?;
    let mut mask = SigSet::empty();
    for s in FORWARDED {
        mask.add(s);
    }
    mask.add(Signal::SIGCHLD);
    // Blocked before the fork, so that a signal sent to the parent in the
    // window after it is forwarded, not acted on.
    let old = mask
        .thread_swap_mask(SigmaskHow::SIG_BLOCK)
        .map_err(at(Step::BlockSignals))?;
    // SAFETY: `enter` checked that the process has one thread, so the
    // child is a full copy with no lock held by a vanished thread.
    match unsafe { nix::unistd::fork() }.map_err(at(Step::Fork))? {
        ForkResult::Parent { child } => {
            drop(read);
            reaper(child, write, mask, uid, gid)
        }
        ForkResult::Child => {
            drop(write);
            old.thread_set_mask().map_err(at(Step::BlockSignals))?;
            let link = ParentLink { read };
            link.arm()?;
            Ok(link)
        }
    }
}

/// The parent: wait for the child, forward signals, exit as it did.
fn reaper(child: Pid, keep: OwnedFd, mask: SigSet, uid: u32, gid: u32) -> ! {
    let k = keep.as_fd().as_raw_fd() as u32;
    // SAFETY: close_range closes fds this process owns, none of which is
    // used again: every fd above 2 but `keep`, whose OwnedFd stays alive.
    unsafe {
        if k > 3 {
            libc::close_range(3, k - 1, 0);
        }
        libc::close_range(k + 1, u32::MAX, 0);
    }
    // Whatever root and cwd the parent had, the child's pivot_root moves
    // both to the private root (they point at the old root).
    let _ = rustix::process::chdir("/");
    // Built before the drop: building allocates, the confined loop does not.
    let confined = super::reaper::filter().and_then(|prog| {
        creds::drop_privileges(uid, gid).map_err(|e| e.to_string())?;
        super::reaper::confine(&prog, u64::from(k))
    });
    if let Err(e) = confined {
        eprintln!("corral: jail: the outer process could not confine itself: {e}");
        let _ = nix::sys::signal::kill(child, Signal::SIGKILL);
    }
    loop {
        let sig = match mask.wait() {
            Ok(s) => s,
            Err(_) => continue,
        };
        if sig != Signal::SIGCHLD {
            let _ = nix::sys::signal::kill(child, sig);
            continue;
        }
        match nix::sys::wait::waitpid(child, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(_, code)) => super::hard_exit(code),
            Ok(WaitStatus::Signaled(_, sig, _)) => die_by(sig),
            Ok(_) => {}
            Err(nix::errno::Errno::ECHILD) => super::hard_exit(1),
            Err(_) => {}
        }
    }
}

/// Ends the parent by `sig`, as the child ended (no core: RLIMIT_CORE is
/// the host's here, but the parent holds nothing worth a core).
fn die_by(sig: Signal) -> ! {
    let _ = rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable);
    // SAFETY: restoring the default action of a signal has no memory
    // effects; the process is about to end.
    let _ = unsafe { nix::sys::signal::signal(sig, SigHandler::SigDfl) };
    let mut one = SigSet::empty();
    one.add(sig);
    let _ = one.thread_unblock();
    let _ = nix::sys::signal::raise(sig);
    super::hard_exit(128 + sig as i32)
}
