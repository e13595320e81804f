//! The daemon's requests, answered: [`VmProcess::answer`] (with the files
//! that go with an answer) and [`VmProcess::handle`] (the VM's own).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::VmProcess;
use super::config::group_for;
use crate::util::lock;
use crate::vmproc::proto::{ErrorKind, Request, Response};

impl VmProcess {
    /// Answers one request (`fds`: the files passed with it).
    fn handle(&self, req: Request, mut fds: Vec<Option<OwnedFd>>) -> Response {
        let h = &self.handle;
        let done = |r: Result<(), crate::vm::VmError>| match r {
            Ok(()) => Response::Ok,
            Err(e) => Response::Error {
                kind: ErrorKind::of(&e),
                message: match &e {
                    crate::vm::VmError::NoSuchDisk(d) => d.clone(),
                    e => e.to_string(),
                },
            },
        };
        match req {
            Request::Status => Response::Status(self.status()),
            Request::Stats => Response::Stats(Box::new(self.stats())),
            Request::SetDiskLimits { disk, limits } => {
                done(h.set_disk_limits(&disk, limits.into()))
            }
            Request::SetDiskGroup { disk, group } => {
                let g = match &group {
                    Some(g) => {
                        let now = crate::util::monotonic_ns();
                        let page = g.page.and_then(|i| fds.get_mut(i)?.take());
                        match group_for(&mut lock(&self.groups), g, now, page) {
                            Ok(x) => Some((x, g.weight)),
                            Err(e) => {
                                return Response::Error {
                                    message: e.to_string(),
                                    kind: Default::default(),
                                };
                            }
                        }
                    }
                    None => None,
                };
                done(h.set_disk_group(&disk, g))
            }
            Request::SetDiskWeight { disk, weight } => done(h.set_disk_weight(&disk, weight)),
            Request::SetGroupLimits { name, limits } => {
                let g = lock(&self.groups).get(&name).cloned();
                match g {
                    Some(g) => done(
                        g.set_limits(&limits.into(), crate::util::monotonic_ns())
                            .map_err(|e| crate::vm::VmError::Config(e.to_string())),
                    ),
                    None => Response::Ok,
                }
            }
            Request::Pause => Response::Bool(h.pause()),
            Request::Resume => Response::Bool(h.resume()),
            Request::Stop => {
                h.stop();
                Response::Ok
            }
            Request::PowerButton => Response::Bool(h.press_power_button()),
            Request::ConsoleInput { data } => Response::Count(h.console_input(&data)),
            Request::ConsoleFrom { offset } => {
                self.link.console_next.store(offset, Ordering::Release);
                Response::Ok
            }
            // Answered by `serve_connection` (they need the connection).
            Request::Files | Request::Adopt { .. } => Response::Error {
                message: "not here".into(),
                kind: Default::default(),
            },
        }
    }

    /// Answers one request (with the files `fds` that came with it) on
    /// daemon connection `sock`, with the files that go with the answer
    /// (those of the VM, its scheduler gate).
    pub(super) fn answer(
        &self,
        req: Request,
        fds: Vec<OwnedFd>,
        sock: &Arc<OwnedFd>,
    ) -> (Response, Vec<BorrowedFd<'_>>) {
        match req {
            Request::Files => {
                let files = self.handle.files();
                let paths = files.iter().map(|f| f.path().to_path_buf()).collect();
                // The gate's memfd after the files (no round trip more for a
                // re-adopting daemon).
                let fds = files.iter().map(|f| f.file().as_fd());
                let gate = self.sched_gate.as_ref().map(|(_, fd)| fd.as_fd());
                (Response::Files(paths), fds.chain(gate).collect())
            }
            Request::Adopt {
                console_from,
                sched_gate,
            } => {
                // Supervised before any output goes to the new daemon: one
                // that has seen output sees this.
                self.supervised.store(true, Ordering::Release);
                self.link
                    .console_next
                    .store(console_from, Ordering::Release);
                *lock(&self.link.conn) = Some(sock.clone());
                // The daemon owns the gate again (it re-attached it before
                // this): the word holds from now on.
                if let Some((g, _)) = self.sched_gate.as_ref().filter(|_| sched_gate) {
                    g.resume();
                }
                tracing::info!(vm = self.handle.name(), "re-adopted by a daemon");
                (Response::Ok, Vec::new())
            }
            req => (
                self.handle(req, fds.into_iter().map(Some).collect()),
                Vec::new(),
            ),
        }
    }
}
