//! The launcher of VM processes. The daemon's threads run under a seccomp
//! filter that forbids `execve` (and a VM process must be free to set up its
//! own jail), so `corral serve` starts one small helper, `corral
//! vmm-launcher`, before it installs any filter. The helper forks and execs
//! each `corral vmm` with the VM's end of a socketpair as fd 3 (cloned into
//! a new pid namespace when its jail asks for one: [`super::spawn`]), reaps
//! its children and reports how they ended; it exits when the daemon's
//! socket closes (its VM processes live on or end by their own rules).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::nspool::NsPool;
use super::spawn::{SpawnOpts, VmChild, spawn_vm_process};
use super::wire;
use crate::util::{lock, wait_until};

/// The fd number of the socket in a child (`corral vmm --fd 3`, and the
/// launcher's own).
pub const CHILD_FD: i32 = 3;

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
enum LauncherReq {
    /// Start `corral vmm` for VM `name` with the passed socket; if `setsid`
    /// (it may outlive the daemon) in a process group of its own, with
    /// SIGHUP ignored (the daemon's session is kept: see `spawn`).
    Spawn {
        name: String,
        setsid: bool,
        /// For `ps`: the VM's control socket, if any.
        socket: Option<std::path::PathBuf>,
        /// As pid 1 of a new pid namespace (its jail asks for one):
        /// `spawn::spawn_vm_process`.
        #[serde(default)]
        pid_namespace: bool,
        /// Jailed: in a network, IPC and UTS namespace made ahead for it
        /// when one is ready (`nspool`).
        #[serde(default)]
        jailed: bool,
    },
    /// SIGKILL a VM process (only a child not yet reaped: no pid reuse).
    Kill { pid: u32 },
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
enum LauncherMsg {
    Spawned {
        pid: u32,
    },
    Failed {
        message: String,
    },
    /// A child ended: how (`exit status 1`, `killed by signal 9`).
    Exited {
        pid: u32,
        how: String,
    },
}

/// The daemon's handle on its launcher.
pub struct Launcher {
    sock: Mutex<Arc<OwnedFd>>,
    shared: Arc<LauncherShared>,
    reader: std::sync::Once,
}

#[derive(Default)]
struct LauncherShared {
    st: Mutex<LState>,
    cv: Condvar,
}

#[derive(Default)]
struct LState {
    replies: VecDeque<LauncherMsg>,
    exits: BTreeMap<u32, String>,
    gone: bool,
}

impl std::fmt::Debug for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launcher").finish_non_exhaustive()
    }
}

impl Launcher {
    /// Starts `exe vmm-launcher` (call before any seccomp filter or
    /// thread that must not be forked around exists).
    pub fn start(exe: &Path) -> std::io::Result<Arc<Launcher>> {
        let (ours, theirs) = wire::pair()?;
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("vmm-launcher");
        let child = spawn_with_fd(cmd, &theirs, false)?;
        drop(theirs);
        // The launcher is reaped by init when it ends after us; we never
        // wait for it (it ends when our socket closes).
        std::mem::forget(child);
        Ok(Arc::new(Launcher {
            sock: Mutex::new(Arc::new(ours)),
            shared: Arc::new(LauncherShared::default()),
            reader: std::sync::Once::new(),
        }))
    }

    /// Starts the thread that reads the launcher's answers (on first use:
    /// after the daemon's seccomp filter is in place, so that the thread
    /// inherits it).
    fn start_reader(&self) {
        self.reader.call_once(|| {
            let (sock, shared) = (lock(&self.sock).clone(), self.shared.clone());
            let r = std::thread::Builder::new()
                .name("launcher-rx".into())
                .spawn(move || {
                    loop {
                        match wire::recv::<LauncherMsg>(sock.as_fd()) {
                            Ok(Some((LauncherMsg::Exited { pid, how }, _))) => {
                                let mut st = lock(&shared.st);
                                st.exits.insert(pid, how);
                                // Bounded: old entries of processes nobody asked about.
                                while st.exits.len() > 4096 {
                                    st.exits.pop_first();
                                }
                                shared.cv.notify_all();
                            }
                            Ok(Some((m, _))) => {
                                lock(&shared.st).replies.push_back(m);
                                shared.cv.notify_all();
                            }
                            Ok(None) | Err(_) => {
                                lock(&shared.st).gone = true;
                                shared.cv.notify_all();
                                return;
                            }
                        }
                    }
                });
            if let Err(e) = r {
                tracing::error!("cannot start the launcher's reader thread: {e}");
                lock(&self.shared.st).gone = true;
            }
        });
    }

    /// Starts the VM process of `name` with `sock` as its socket, for the
    /// jail `jail` (as pid 1 of a new pid namespace if it asks for one, in
    /// namespaces made ahead for it if ready); returns its pid.
    pub fn spawn_vm(
        &self,
        name: &str,
        sock: OwnedFd,
        setsid: bool,
        socket: Option<&Path>,
        jail: Option<&super::proto::JailParams>,
    ) -> std::io::Result<u32> {
        self.start_reader();
        let s = lock(&self.sock);
        let req = LauncherReq::Spawn {
            name: name.to_string(),
            setsid,
            socket: socket.map(Path::to_path_buf),
            pid_namespace: jail.is_some_and(|j| j.pid_namespace),
            jailed: jail.is_some(),
        };
        wire::send(&**s, &req, &[sock.as_fd()]).map_err(std::io::Error::other)?;
        drop(sock);
        let deadline = Instant::now() + Duration::from_secs(10);
        wait_until(&self.shared.st, &self.shared.cv, deadline, |st| {
            loop {
                match st.replies.pop_front() {
                    Some(LauncherMsg::Spawned { pid }) => return Some(Ok(pid)),
                    Some(LauncherMsg::Failed { message }) => {
                        return Some(Err(std::io::Error::other(message)));
                    }
                    Some(LauncherMsg::Exited { .. }) => {}
                    None if st.gone => {
                        return Some(Err(std::io::Error::other(
                            "the VM process launcher has exited",
                        )));
                    }
                    None => return None,
                }
            }
        })
        .unwrap_or_else(|| {
            Err(std::io::Error::other(
                "the VM process launcher did not answer",
            ))
        })
    }

    /// SIGKILLs VM process `pid` if it is the launcher's live child.
    pub fn kill(&self, pid: u32) {
        let s = lock(&self.sock);
        let _ = wire::send(&**s, &LauncherReq::Kill { pid }, &[]);
    }

    /// How child `pid` ended, waiting up to `timeout` for the launcher to
    /// report it.
    pub fn exit_status(&self, pid: u32, timeout: Duration) -> Option<String> {
        self.start_reader();
        let deadline = Instant::now() + timeout;
        wait_until(&self.shared.st, &self.shared.cv, deadline, |st| {
            match st.exits.remove(&pid) {
                Some(h) => Some(Some(h)),
                None => st.gone.then_some(None),
            }
        })
        .flatten()
    }
}

/// Spawns `cmd` with `fd` as its fd [`CHILD_FD`] (every other fd of ours
/// is close-on-exec) and stdin from `/dev/null`. With `own_group` (a VM
/// that may outlive the daemon) the child gets a process group of its own
/// (no signal to the daemon's group reaches it) and ignores SIGHUP (a
/// closing terminal), but stays in the daemon's session: a new session
/// would be a new scheduler autogroup (`kernel.sched_autogroup_enabled`),
/// which CFS weighs as one task against everything else, and the shares
/// would no longer hold beside an outside load (3:1 became 71:29 with a
/// busy loop).
fn spawn_with_fd(
    mut cmd: std::process::Command,
    fd: &OwnedFd,
    own_group: bool,
) -> std::io::Result<std::process::Child> {
    let raw = fd.as_raw_fd();
    if raw == CHILD_FD {
        // dup2 onto itself keeps close-on-exec: clear it (in the parent,
        // whose copy closes when `fd` is dropped after the spawn).
        rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::empty())?;
    }
    cmd.stdin(std::process::Stdio::null());
    // SAFETY: only async-signal-safe calls between fork and exec: dup2 of
    // an fd we own onto CHILD_FD (clearing close-on-exec), setpgid, signal.
    unsafe {
        cmd.pre_exec(move || {
            if raw != CHILD_FD && libc::dup2(raw, CHILD_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if own_group {
                if libc::setpgid(0, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::signal(libc::SIGHUP, libc::SIG_IGN);
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// The launcher process (`corral vmm-launcher`): serves the daemon on fd
/// [`CHILD_FD`] until it closes.
pub fn launcher_main() -> i32 {
    // SAFETY: fd 3 was set up by `Launcher::start` for this process alone.
    let sock: Arc<OwnedFd> = Arc::new(unsafe { std::os::fd::FromRawFd::from_raw_fd(CHILD_FD) });
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("corral vmm-launcher: {e}");
            return 2;
        }
    };
    let children: Arc<Mutex<BTreeMap<u32, VmChild>>> = Arc::default();
    let mut pool: Option<NsPool> = None;
    {
        let (children, sock) = (children.clone(), sock.clone());
        let _ = std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(Duration::from_millis(20));
                    let mut ended = Vec::new();
                    {
                        let mut c = lock(&children);
                        let pids: BTreeSet<u32> = c.keys().copied().collect();
                        for pid in pids {
                            if let Some(ch) = c.get_mut(&pid)
                                && let Ok(Some(how)) = ch.try_wait()
                            {
                                ended.push((pid, how));
                                c.remove(&pid);
                            }
                        }
                    }
                    for (pid, how) in ended {
                        let _ = wire::send(&*sock, &LauncherMsg::Exited { pid, how }, &[]);
                    }
                }
            });
    }
    loop {
        let (req, mut fds) = match wire::recv::<LauncherReq>(sock.as_fd()) {
            Ok(Some(m)) => m,
            Ok(None) => return 0,
            Err(e) => {
                eprintln!("corral vmm-launcher: {e}");
                return 2;
            }
        };
        match req {
            LauncherReq::Spawn {
                name,
                setsid,
                socket,
                pid_namespace,
                jailed,
            } => {
                let reply = match fds.pop() {
                    None => LauncherMsg::Failed {
                        message: "no socket passed".into(),
                    },
                    Some(vm_sock) => {
                        // Started at the first jailed VM: a daemon without
                        // the jail makes no spare namespaces.
                        if jailed && pool.is_none() {
                            pool = NsPool::start(2)
                                .inspect_err(|e| {
                                    eprintln!("corral vmm-launcher: namespace pool: {e}")
                                })
                                .ok();
                        }
                        let spare = pool.as_ref().filter(|_| jailed).and_then(NsPool::take);
                        let opts = SpawnOpts {
                            own_group: setsid,
                            pid_namespace,
                            namespaces: spare.as_ref(),
                            stderr: None,
                        };
                        match spawn_vm_process(&exe, &vm_sock, &name, socket.as_deref(), opts) {
                            Ok(ch) => {
                                let pid = ch.id();
                                lock(&children).insert(pid, ch);
                                LauncherMsg::Spawned { pid }
                            }
                            Err(e) => LauncherMsg::Failed {
                                message: format!("starting corral vmm: {e}"),
                            },
                        }
                    }
                };
                if wire::send(&*sock, &reply, &[]).is_err() {
                    return 0;
                }
            }
            LauncherReq::Kill { pid } => {
                if let Some(ch) = lock(&children).get_mut(&pid) {
                    ch.kill();
                }
            }
        }
    }
}
