//! The VM process's daemon connections: the current one ([`Link`], where
//! output and the exit go), each connection's request loop, the loss of
//! the daemon (the VM goes on unsupervised, its gate open) and the control
//! socket's accept loop, where a later daemon re-adopts the process.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::VmProcess;
use crate::util::lock;
use crate::vmproc::proto::{FromVm, Response, ToVm};
use crate::vmproc::wire;

/// The daemon connection of a VM process: the current one (the inherited
/// socket, or one a re-adopting daemon opened), if any.
pub(super) struct Link {
    pub(super) conn: Mutex<Option<Arc<OwnedFd>>>,
    /// Console bytes sent so far on the current connection.
    pub(super) console_next: AtomicU64,
}

impl Link {
    /// Sends `msg` to the current daemon, if any. A failed send (the
    /// daemon is gone) leaves the link as it is: the connection's own
    /// thread sees its end and drops it, with everything that losing the
    /// daemon means ([`VmProcess::lost_daemon`]). Dropping it here, as
    /// this once did, made that thread take the end of the supervising
    /// connection for a status query's, and a VM whose console was busy
    /// when its daemon died went on "supervised", its gate not released.
    pub(super) fn send(&self, msg: &FromVm) {
        let c = lock(&self.conn).clone();
        if let Some(c) = c {
            let _ = wire::send(&*c, msg, &[]);
        }
    }

    /// Drops the link if `sock` is its current connection; whether it was.
    pub(super) fn drop_if_current(&self, sock: &Arc<OwnedFd>) -> bool {
        let mut g = lock(&self.conn);
        if g.as_ref().is_some_and(|x| Arc::ptr_eq(x, sock)) {
            *g = None;
            true
        } else {
            false
        }
    }
}

impl VmProcess {
    /// Reads requests from one daemon connection until it closes.
    pub(super) fn serve_connection(&self, sock: Arc<OwnedFd>) {
        loop {
            match wire::recv::<ToVm>(sock.as_fd()) {
                Ok(Some((m, fds))) => {
                    let (resp, fds) = self.answer(m.req, fds, &sock);
                    if m.id != 0
                        && let Err(e) = wire::send(&*sock, &FromVm::Reply { id: m.id, resp }, &fds)
                    {
                        tracing::warn!(vm = self.handle.name(), "reply: {e}");
                        break;
                    }
                }
                Ok(None) => break,
                // A daemon of another version (one that re-adopts the
                // process after an up- or downgrade): refused in the
                // framing it reads, and the connection closed; the process
                // goes on as it was (unsupervised, if it was).
                Err(wire::WireError::Version { ours, theirs }) => {
                    let message = format!(
                        "this VM process speaks protocol version {ours}; the daemon speaks version {theirs}: not adopted"
                    );
                    tracing::warn!(vm = self.handle.name(), "{message}");
                    wire::refuse(
                        &*sock,
                        theirs,
                        &FromVm::Reply {
                            id: 0,
                            resp: Response::Error {
                                message,
                                kind: Default::default(),
                            },
                        },
                    );
                    break;
                }
                Err(e) => {
                    tracing::warn!(vm = self.handle.name(), "bad request: {e}");
                    let _ = wire::send(
                        &*sock,
                        &FromVm::Reply {
                            id: 0,
                            resp: Response::Error {
                                message: e.to_string(),
                                kind: Default::default(),
                            },
                        },
                        &[],
                    );
                }
            }
        }
        // Test-only: a control thread slow to see its daemon's end, while
        // the console pump's sends to the dead daemon fail first.
        #[cfg(debug_assertions)]
        if crate::seccomp::fault::injected("vmproc-slow-lost-daemon", self.handle.name()) {
            std::thread::sleep(Duration::from_millis(500));
        }
        self.lost_daemon(&sock);
    }

    /// The daemon's connection closed: the daemon is gone. The VM keeps
    /// running with its last limits; its shares are not enforced (the gate
    /// opens) until a daemon re-adopts it.
    fn lost_daemon(&self, sock: &Arc<OwnedFd>) {
        if !self.link.drop_if_current(sock) {
            // Not the supervising connection (a status query, or a daemon
            // that never adopted the process).
            return;
        }
        self.supervised.store(false, Ordering::Relaxed);
        // Nobody opens the shared word now: the vCPUs ignore it (and any
        // that waits on it goes on) until a daemon re-adopts the process.
        if let Some((g, _)) = &self.sched_gate {
            g.release();
        }
        tracing::warn!(
            vm = self.handle.name(),
            "the daemon's connection closed; the VM keeps running unsupervised"
        );
        if !self.keeps_running_alone() {
            self.handle.stop();
        }
    }

    /// Whether the VM outlives its daemon (it listens for a new one).
    fn keeps_running_alone(&self) -> bool {
        self.control_socket.is_some()
    }

    /// Accepts daemons that re-adopt the VM on its control socket; each
    /// connection is served on a thread of its own, and becomes the one
    /// that output goes to once it sends `Adopt`.
    pub(super) fn accept_loop(self: Arc<Self>, listener: OwnedFd) {
        loop {
            let c = match rustix::net::accept_with(&listener, rustix::net::SocketFlags::CLOEXEC) {
                Ok(c) => Arc::new(c),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    tracing::warn!(vm = self.handle.name(), "control socket: {e}");
                    return;
                }
            };
            // A thread per connection; one that cannot be had now (the
            // jail's RLIMIT_NPROC, while the threads of connections just
            // closed are still ending) is retried for a while rather than
            // dropping the daemon's connection unanswered.
            let mut tries = 0;
            loop {
                let (vm, c) = (self.clone(), c.clone());
                match std::thread::Builder::new()
                    .name("control".into())
                    .spawn(move || vm.serve_connection(c))
                {
                    Ok(_) => break,
                    Err(e) if tries < 100 => {
                        tries += 1;
                        if tries == 1 {
                            tracing::warn!(
                                vm = self.handle.name(),
                                "control thread: {e}; retrying"
                            );
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => {
                        tracing::warn!(
                            vm = self.handle.name(),
                            "control thread: {e}; connection dropped"
                        );
                        break;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A send that fails because the daemon is gone does not drop the
    /// link: the connection's thread must still find it its own, or it
    /// does not mark the VM unsupervised (the session-9 bug).
    #[test]
    fn a_failed_send_leaves_the_link_to_its_connection() {
        let (daemon, vm) = wire::pair().unwrap();
        let vm = Arc::new(vm);
        let link = Link {
            conn: Mutex::new(Some(vm.clone())),
            console_next: AtomicU64::new(0),
        };
        drop(daemon);
        link.send(&FromVm::Console {
            offset: 0,
            data: b"late output".to_vec(),
        });
        assert!(
            link.drop_if_current(&vm),
            "the dead connection lost its link"
        );
        assert!(!link.drop_if_current(&vm), "dropped twice");
        let (_d2, other) = wire::pair().unwrap();
        *lock(&link.conn) = Some(vm.clone());
        assert!(!link.drop_if_current(&Arc::new(other)));
    }
}
