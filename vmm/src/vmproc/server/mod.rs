//! The VM process (`corral vmm`): reads its configuration from the inherited
//! socket, starts exactly one VM ([`crate::builder::start`]) and serves the
//! protocol of [`super::proto`] until the VM ends. Plain threads, no async
//! runtime: the main thread starts the VM and waits for its end, a
//! `control` thread per daemon connection answers requests, one thread
//! pushes console output, one accepts connections on the control socket.
//!
//! The start-up is here ([`run`]); the configuration in [`config`], the
//! requests in [`requests`], the connections and the daemon's loss in
//! [`connection`], the status and counters in [`status`], the console in
//! [`console`], the exit record in [`exit`].

mod config;
mod connection;
mod console;
mod exit;
mod requests;
mod status;

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use corral_blkthrottle::ThrottleGroup;
use corral_scheduler::Gate;

use super::proto::{FromVm, Hello};
use super::wire;
use crate::handle::VmHandle;
use connection::Link;

/// Errors before the VM runs.
#[derive(Debug, thiserror::Error)]
pub enum VmProcessError {
    /// The socket or the protocol.
    #[error(transparent)]
    Wire(#[from] wire::WireError),
    /// The configuration.
    #[error("{0}")]
    Config(String),
}

/// One VM process.
struct VmProcess {
    handle: VmHandle,
    nonce: String,
    /// The peer side of the daemon's scheduler gate, and its memfd (kept
    /// for a daemon that re-adopts the process: [`crate::vmproc::proto::Request::Files`]).
    sched_gate: Option<(Arc<Gate>, OwnedFd)>,
    groups: Mutex<BTreeMap<String, ThrottleGroup>>,
    link: Link,
    supervised: AtomicBool,
    /// Where a later daemon finds the process (`NAME.sock` in the state
    /// directory's `vms/`), if it outlives its daemon.
    control_socket: Option<std::path::PathBuf>,
}

/// Tells the daemon why the VM cannot start (`StartFailed`) and returns
/// that as the error: every failure before `Started` ends here.
fn start_failed(sock: &OwnedFd, why: impl std::fmt::Display) -> VmProcessError {
    let message = why.to_string();
    let _ = wire::send(
        sock,
        &FromVm::StartFailed {
            message: message.clone(),
        },
        &[],
    );
    VmProcessError::Config(message)
}

/// Runs the VM process on `sock` (the daemon's end of a socketpair was
/// inherited as `sock`); `builtin` is the binary's built-in guest. Returns
/// when the VM has ended, with the exit status for the process.
pub fn run(sock: OwnedFd, builtin: Arc<[u8]>) -> Result<i32, VmProcessError> {
    let (hello, fds): (Hello, Vec<OwnedFd>) = match wire::recv(&sock) {
        Ok(Some(m)) => m,
        Ok(None) => {
            return Err(VmProcessError::Config(
                "the daemon closed the socket".into(),
            ));
        }
        // Another version's daemon: told in the framing it reads, before
        // anything of its configuration is looked at.
        Err(wire::WireError::Version { ours, theirs }) => {
            let message = format!(
                "the daemon speaks protocol version {theirs}; this corral vmm speaks version {ours}"
            );
            wire::refuse(
                &sock,
                theirs,
                &FromVm::StartFailed {
                    message: message.clone(),
                },
            );
            return Err(VmProcessError::Config(message));
        }
        Err(e) => return Err(e.into()),
    };
    crate::boottrace::step("vmm-hello");
    let spec = hello.vm;
    let config::Configured {
        cfg,
        groups,
        sched_gate,
    } = config::configure(&spec, fds, builtin, &sock)?;
    // The control socket and the exit record are the process's only paths
    // on the host: made before the jail, used by fd after it.
    // Test-only: a VM process slow to get here (its daemon may die first).
    #[cfg(debug_assertions)]
    if crate::seccomp::fault::injected("vmproc-slow-start", &spec.name) {
        std::thread::sleep(std::time::Duration::from_secs(3));
    }
    let listener = match &spec.control_socket {
        Some(path) => match wire::listen(path).inspect(|_| {
            let _ = std::fs::remove_file(path.with_extension("exit"));
        }) {
            Ok(l) => Some(l),
            Err(e) => {
                return Err(start_failed(
                    &sock,
                    format!("control socket {}: {e}", path.display()),
                ));
            }
        },
        None => None,
    };
    // The threads of this process that must wake on time beside busy vCPUs
    // and outside loads (the device thread) are started by this thread and
    // inherit its nice, which only a privileged process can lower: take nice -10
    // now, before the jail drops the privilege. The vCPU threads go back to
    // nice 0 as they start (`vmthread::spawn`), so the guest's own work
    // competes with the host's at the normal weight.
    crate::util::raise_priority();
    crate::boottrace::step("vmm-config");
    let mut exit_file = None;
    let kvm = match &spec.jail {
        Some(j) => {
            exit_file = spec
                .control_socket
                .as_ref()
                .and_then(|p| exit::open_exit_record(&p.with_extension("exit")));
            // With a pid namespace this process is pid 1 of it (the
            // launcher cloned it there: `vmproc::spawn`; otherwise the jail
            // forks) and reports its namespace's ids, which the daemon maps
            // to the host's (`vmproc::hostids`).
            let ns = crate::jail::Namespaces {
                pid: j.pid_namespace,
                ..Default::default()
            };
            match crate::jail::enter_vm(&cfg, j.uid, ns) {
                Ok(k) => Some(k),
                Err(e) => return Err(start_failed(&sock, e)),
            }
        }
        None => None,
    };
    if spec.seccomp {
        crate::seccomp::enable()
            .and_then(|()| crate::seccomp::check_all())
            .and_then(|()| crate::seccomp::install(crate::seccomp::ThreadKind::Runtime))
            .map_err(|e| start_failed(&sock, e))?;
    }
    crate::boottrace::step("runtime-seccomp");
    let started = match &kvm {
        Some(k) => crate::builder::start_with_kvm(&cfg, k),
        None => crate::builder::start(&cfg),
    };
    let handle = started.map_err(|e| start_failed(&sock, e))?;
    let sock = Arc::new(sock);
    let vm = Arc::new(VmProcess {
        handle,
        nonce: spec.nonce.clone(),
        sched_gate,
        groups: Mutex::new(groups),
        link: Link {
            conn: Mutex::new(Some(sock.clone())),
            console_next: AtomicU64::new(0),
        },
        supervised: AtomicBool::new(true),
        control_socket: spec.control_socket.clone(),
    });
    // A daemon that died before it heard `Started` never recorded this
    // VM: there is nobody to adopt it, and the next daemon may have looked
    // for strays before the control socket existed. Stop rather than run
    // on as an orphan. (One that dies after hearing it finds the socket
    // bound, which was done first: it adopts the VM or stops it as a stray.)
    if wire::send(&*sock, &FromVm::Started(vm.status()), &[]).is_err() {
        tracing::warn!(
            vm = vm.handle.name(),
            "the daemon went away before the VM was started: stopping it"
        );
        vm.handle.stop();
        vm.handle.join();
        if let Some(path) = &vm.control_socket {
            let _ = std::fs::remove_file(path);
        }
        return Ok(0);
    }
    if let Some(l) = listener {
        let vm = vm.clone();
        std::thread::Builder::new()
            .name("accept".into())
            .spawn(move || vm.accept_loop(l))
            .map_err(|e| VmProcessError::Config(format!("accept thread: {e}")))?;
    }
    let pump = {
        let vm = vm.clone();
        std::thread::Builder::new()
            .name("console".into())
            .spawn(move || vm.pump_console())
            .map_err(|e| VmProcessError::Config(format!("console thread: {e}")))?
    };
    {
        let vm = vm.clone();
        std::thread::Builder::new()
            .name("control".into())
            .spawn(move || vm.serve_connection(sock))
            .map_err(|e| VmProcessError::Config(format!("control thread: {e}")))?;
    }
    // The VM's end: every thread joined, the console closed and pushed out,
    // then the reason, then exit.
    vm.handle.wait(None);
    let reason = vm.handle.join();
    let _ = pump.join();
    vm.record_exit(&reason, exit_file.as_ref());
    vm.link.send(&FromVm::Exited {
        reason,
        stats: Box::new(vm.stats()),
    });
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A daemon of version 1 (its `Hello` begins with `version: 1`) is
    /// told why in its own framing (a `StartFailed` without a header,
    /// naming both versions), and nothing of its configuration is used.
    #[test]
    fn a_version_1_daemon_is_refused_in_its_framing() {
        let (daemon, vm) = wire::pair().unwrap();
        rustix::net::send(
            &daemon,
            br#"{"version":1,"vm":{"name":"x","park":true}}"#,
            rustix::net::SendFlags::empty(),
        )
        .unwrap();
        let e = run(vm, Arc::from(&b""[..])).unwrap_err().to_string();
        assert!(e.contains("version 1") && e.contains("version 3"), "{e}");
        let mut buf = [0u8; 1024];
        let n = rustix::net::recv(&daemon, &mut buf, rustix::net::RecvFlags::empty())
            .unwrap()
            .0;
        let v: serde_json::Value = serde_json::from_slice(&buf[..n]).unwrap();
        assert!(v.get("version").is_none(), "{v}");
        let m = v["start_failed"]["message"].as_str().unwrap();
        assert!(m.contains("version 1") && m.contains("version 3"), "{m}");
    }
}
