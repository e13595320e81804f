//! A restarted daemon takes over the VM processes that outlived the last
//! one ([`adopt`]): by the control socket each left in the state
//! directory, checking that the process is the run the state file names
//! (name and nonce), getting its files back (the same open files, so the
//! same image locks) and its scheduler gate (the daemon maps it as the
//! owner again, before the process obeys it), and having its output sent
//! from the start of what it kept.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::launcher::Launcher;
use super::proto::{ExitRecord, FromVm, Request, Response, Status, ToVm};
use super::remote::{RemoteVm, readable};
use super::wire;
use crate::hostfile::HostFile;
use crate::vm::ExitReason;

/// The control socket of VM `name` in state directory `dir`.
pub fn control_socket(dir: &Path, name: &str) -> PathBuf {
    dir.join("vms").join(format!("{name}.sock"))
}

/// Longest path of a Unix socket (`sun_path` less its NUL).
pub const MAX_SOCKET_PATH: usize = 107;

pub use super::wire::connect;

/// Requests sent at once (pipelined: one round trip, which on a loaded
/// host is one wake-up of each side rather than one per request) and their
/// answers with their files, by id; before the reader thread runs.
/// A VM process of another protocol version (its answer's header says
/// which, or has none: version 1) is [`wire::WireError::Version`].
fn ask_all(
    sock: &OwnedFd,
    reqs: Vec<(u64, Request)>,
) -> Result<BTreeMap<u64, (Response, Vec<OwnedFd>)>, wire::WireError> {
    let n = reqs.len();
    let ids: Vec<u64> = reqs.iter().map(|(id, _)| *id).collect();
    for (id, req) in reqs {
        wire::send(sock, &ToVm { id, req }, &[])?;
    }
    let mut out = BTreeMap::new();
    let lost = |why: &str| wire::WireError::Io(std::io::Error::other(why.to_string()));
    while out.len() < n {
        // As long as any request (a loaded host, and up to eight adoptions
        // at once).
        if !readable(sock.as_fd(), Duration::from_secs(8)) {
            return Err(lost("no answer"));
        }
        match wire::recv::<FromVm>(sock)? {
            Some((FromVm::Reply { id, resp }, fds)) if ids.contains(&id) => {
                out.insert(id, (resp, fds));
            }
            Some(_) => {}
            None => return Err(lost("the VM process closed the connection")),
        }
    }
    Ok(out)
}

/// How an adoption ended.
#[derive(Debug)]
pub enum Adopted {
    /// The process runs the VM: the daemon supervises it again.
    Running(Arc<RemoteVm>, Vec<HostFile>),
    /// No process (or another run): how the VM ended, if known.
    Gone(ExitReason),
    /// The process runs the VM but speaks another protocol version: not
    /// adopted ([`ExitReason::NotAdopted`], naming both versions). It runs
    /// on unsupervised; its control socket is left alone, and the state
    /// keeps its record for a daemon of its version.
    Refused(ExitReason),
}

/// Re-adopts VM `name`, run `nonce` (pid `pid` when last seen), from state
/// directory `dir`.
pub fn adopt(
    dir: &Path,
    name: &str,
    nonce: &str,
    pid: u32,
    console_bytes: usize,
    launcher: &Arc<Launcher>,
) -> Adopted {
    let path = control_socket(dir, name);
    let gone = |how: String| {
        // The record it left when it ended, if it is this run's.
        let rec = std::fs::read(path.with_extension("exit"))
            .ok()
            .and_then(|d| serde_json::from_slice::<ExitRecord>(&d).ok())
            .filter(|r| r.name == name && r.nonce == nonce);
        let _ = std::fs::remove_file(path.with_extension("exit"));
        Adopted::Gone(match rec {
            Some(r) => r.reason,
            None => ExitReason::ProcessGone { pid, how },
        })
    };
    let sock = match connect(&path) {
        Ok(s) => s,
        Err(e) => {
            if e.kind() == std::io::ErrorKind::ConnectionRefused {
                let _ = std::fs::remove_file(&path);
            }
            return gone(format!("not running when the daemon started ({e})"));
        }
    };
    // Its status and its files in one round trip (the files are dropped
    // if it is another run).
    let mut answers = match ask_all(&sock, vec![(1, Request::Status), (2, Request::Files)]) {
        Ok(a) => a,
        // Before any of its answer is read: nothing of it is believed.
        Err(wire::WireError::Version { ours, theirs }) => {
            let why = format!(
                "it speaks VM-process protocol version {theirs}; this daemon speaks version {ours}. \
                 It runs on unsupervised (its shares are not enforced, its last limits hold) \
                 until a daemon of its version adopts it, or it is stopped from the guest or killed"
            );
            tracing::warn!(vm = name, pid, "its VM process is not adopted: {why}");
            return Adopted::Refused(ExitReason::NotAdopted {
                pid,
                nonce: nonce.to_string(),
                why,
            });
        }
        Err(_) => return gone("its control socket does not answer".into()),
    };
    let status: Status = match answers.remove(&1) {
        Some((Response::Status(s), _)) => s,
        _ => return gone("its control socket does not answer".into()),
    };
    if status.name != name || status.nonce != nonce {
        tracing::warn!(
            vm = name,
            "the process on {} is another run ({} {}): not adopted",
            path.display(),
            status.name,
            status.nonce
        );
        return gone("another process holds its control socket".into());
    }
    // The files, then the scheduler gate's memfd if it has one: re-attached
    // as the owner before `Adopt`, so the VM process, open while
    // unsupervised, resumes on an open gate, and the scheduler parks it
    // when it attaches. An fd that is not a gate page is refused.
    let (files, gate): (Vec<HostFile>, _) = match answers.remove(&2) {
        Some((Response::Files(paths), mut fds))
            if matches!(fds.len().checked_sub(paths.len()), Some(0 | 1)) =>
        {
            let gate = (fds.len() > paths.len()).then(|| fds.pop()).flatten();
            let files = paths
                .into_iter()
                .zip(fds)
                .filter_map(|(p, fd)| HostFile::from_passed(std::fs::File::from(fd), p).ok())
                .collect();
            let gate = gate.and_then(|fd| {
                corral_scheduler::Gate::reattach(fd)
                    .map_err(|e| tracing::warn!(vm = name, "its scheduler gate: {e}"))
                    .ok()
            });
            (files, gate)
        }
        _ => (Vec::new(), None),
    };
    // The process that listens on the socket (the kernel says which: the
    // VM process made it before its jail, so with a pid namespace this is
    // the outer process), not the pid it reports or the state file's.
    let outer = match wire::peer_pid(&sock) {
        Ok(p) => p,
        Err(e) => return gone(format!("its control socket has no peer process ({e})")),
    };
    let vm = match RemoteVm::attach(
        sock,
        status,
        outer,
        files.clone(),
        launcher.clone(),
        console_bytes,
    ) {
        Ok(vm) => Arc::new(vm),
        Err(e) => return gone(format!("not adopted: {e}")),
    };
    let sched_gate = gate.is_some();
    if let Some(g) = gate {
        vm.set_sched_gate(g);
    }
    // Not waited for: it cannot be refused, and a process that ends
    // before it takes it is seen ending by the reader thread (its exit, or
    // the socket's end). Waiting was one more round trip per VM, through
    // the reader thread. (A park the scheduler makes before the process
    // takes it is kicked again by the process: `Gate::resume`.)
    vm.tell(Request::Adopt {
        console_from: 0,
        sched_gate,
    });
    Adopted::Running(vm, files)
}

/// VM processes in `dir` that no VM of the state file names (a create
/// whose answer the last daemon did not live to give, a delete it did
/// not finish): stopped, since the state does not have them.
pub fn stop_strays(dir: &Path, known: &[String]) -> usize {
    let Ok(rd) = std::fs::read_dir(dir.join("vms")) else {
        return 0;
    };
    let mut n = 0;
    for e in rd.flatten() {
        let p = e.path();
        let Some(stem) = p.file_stem().and_then(|s| s.to_str()).map(str::to_string) else {
            continue;
        };
        if known.contains(&stem) {
            continue;
        }
        match p.extension().and_then(|x| x.to_str()) {
            Some("sock") => match connect(&p) {
                Ok(s) => {
                    tracing::warn!(
                        vm = stem,
                        "a VM process the state does not know: stopping it"
                    );
                    let _ = wire::send(
                        &s,
                        &ToVm {
                            id: 0,
                            req: Request::Stop,
                        },
                        &[],
                    );
                    n += 1;
                }
                Err(_) => {
                    let _ = std::fs::remove_file(&p);
                }
            },
            Some("exit") => {
                let _ = std::fs::remove_file(&p);
            }
            _ => {}
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A VM process of version 1 answers the re-adopting daemon's first
    /// request (which it cannot read: `version` is no field of its `ToVm`)
    /// with an error reply without a header, then answers `status` and
    /// `files`: the daemon stops at the first answer's header, a typed
    /// error naming both versions, and believes none of it.
    #[test]
    fn a_version_1_vm_process_is_refused_at_its_first_answer() {
        let (daemon, vm) = wire::pair().unwrap();
        let fake = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            for _ in 0..2 {
                let _ = rustix::net::recv(&vm, &mut buf, rustix::net::RecvFlags::empty());
            }
            for m in [
                r#"{"reply":{"id":0,"resp":{"error":{"message":"VM process protocol: unknown field `version`","kind":"other"}}}}"#,
                r#"{"reply":{"id":1,"resp":{"status":{"name":"a","nonce":"n","pid":1,"paused":false,"parked":false,"unsupervised":true,"exit":null,"vcpu_tids":[],"device_tid":null,"uptime_secs":1.0}}}}"#,
                r#"{"reply":{"id":2,"resp":{"files":[]}}}"#,
            ] {
                let _ = rustix::net::send(&vm, m.as_bytes(), rustix::net::SendFlags::empty());
            }
            vm
        });
        let r = ask_all(&daemon, vec![(1, Request::Status), (2, Request::Files)]);
        assert!(
            matches!(r, Err(wire::WireError::Version { ours: 3, theirs: 1 })),
            "{:?}",
            r.map(|m| m.len())
        );
        drop(fake.join());
    }

    /// A VM process of version 2 (before `set_disk_weight`) answers in
    /// its own framing, the header first: refused by it, naming both.
    #[test]
    fn a_version_2_vm_process_is_refused_by_its_header() {
        let (daemon, vm) = wire::pair().unwrap();
        let fake = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            let _ = rustix::net::recv(&vm, &mut buf, rustix::net::RecvFlags::empty());
            let m = r#"{"version":2,"reply":{"id":1,"resp":{"files":[]}}}"#;
            let _ = rustix::net::send(&vm, m.as_bytes(), rustix::net::SendFlags::empty());
            vm
        });
        let r = ask_all(&daemon, vec![(1, Request::Files)]);
        assert!(
            matches!(r, Err(wire::WireError::Version { ours: 3, theirs: 2 })),
            "{:?}",
            r.map(|m| m.len())
        );
        drop(fake.join());
    }
}
