//! The VM process (`corral vmm`): reads its configuration from the inherited
//! socket, starts exactly one VM ([`crate::builder::start`]) and serves the
//! protocol of [`super::proto`] until the VM ends. Plain threads, no async
//! runtime: the main thread reads requests, one thread pushes console
//! output, one waits for the VM's end.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use corral_blkthrottle::ThrottleGroup;
use corral_scheduler::Gate;

use super::proto::{
    CONSOLE_CHUNK, FromVm, Hello, PROTOCOL_VERSION, Request, Response, Stats, Status, ToVm,
    WireDisk,
};
use super::wire;
use crate::handle::VmHandle;
use crate::hostfile::{HostFile, HostImage};
use crate::util::lock;
use crate::vm::{KernelSource, VmConfig};

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

/// The daemon connection of a VM process: the current one (the inherited
/// socket, or one a re-adopting daemon opened), if any.
struct Link {
    conn: Mutex<Option<Arc<OwnedFd>>>,
    /// Console bytes sent so far on the current connection.
    console_next: AtomicU64,
}

impl Link {
    fn send(&self, msg: &FromVm) {
        let c = lock(&self.conn).clone();
        if let Some(c) = c
            && wire::send(&*c, msg, &[]).is_err()
        {
            // The daemon is gone; a later one reconnects (or never does).
            let mut g = lock(&self.conn);
            if g.as_ref().is_some_and(|x| Arc::ptr_eq(x, &c)) {
                *g = None;
            }
        }
    }
}

/// One VM process.
struct VmProcess {
    handle: VmHandle,
    nonce: String,
    /// The peer side of the daemon's scheduler gate, and its memfd (kept
    /// for a daemon that re-adopts the process: [`Request::Files`]).
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
    let (hello, fds): (Hello, Vec<OwnedFd>) = wire::recv(&sock)?
        .ok_or_else(|| VmProcessError::Config("the daemon closed the socket".into()))?;
    if hello.version != PROTOCOL_VERSION {
        return Err(start_failed(
            &sock,
            format!(
                "protocol version {} is not supported: this corral vmm speaks version {PROTOCOL_VERSION}",
                hello.version
            ),
        ));
    }
    let spec = hello.vm;
    let mut fds: Vec<Option<OwnedFd>> = fds.into_iter().map(Some).collect();
    // The class groups' shared pages, by index.
    let mut pages: BTreeMap<usize, OwnedFd> = spec
        .disks
        .iter()
        .filter_map(|d| d.group.as_ref()?.page)
        .filter_map(|i| Some((i, fds.get_mut(i)?.take()?)))
        .collect();
    let mut take_fd = |i: usize| {
        fds.get_mut(i)
            .and_then(Option::take)
            .ok_or_else(|| start_failed(&sock, format!("file {i} was not passed")))
    };
    let mut take = |f: &super::proto::PassedFile| -> Result<HostFile, VmProcessError> {
        HostFile::from_passed(std::fs::File::from(take_fd(f.fd)?), f.path.clone())
            .map_err(|e| start_failed(&sock, e))
    };
    let kernel = match &spec.kernel {
        Some(f) => KernelSource::File(take(f)?),
        None => KernelSource::Bytes(builtin),
    };
    let mut cfg = VmConfig::new(&spec.name, kernel);
    cfg.initrd = match &spec.initrd {
        Some(f) => Some(HostImage::File(take(f)?)),
        None => None,
    };
    cfg.cmdline = spec.cmdline.clone();
    cfg.vcpus = spec.vcpus;
    cfg.memory_mib = spec.memory_mib;
    cfg.console_log_bytes = spec.console_log_bytes;
    cfg.acpi = spec.acpi;
    let now = crate::util::monotonic_ns();
    let mut groups = BTreeMap::new();
    for d in &spec.disks {
        let group = match &d.group {
            Some(g) => {
                let page = g.page.and_then(|i| pages.remove(&i));
                let x = group_for(&mut groups, g, now, page).map_err(|e| start_failed(&sock, e))?;
                Some((x, g.weight))
            }
            None => None,
        };
        cfg.disks.push(crate::vm::DiskConfig {
            id: Some(d.id.clone()),
            path: d.file.path.clone(),
            read_only: d.read_only,
            direct: d.direct,
            limits: d.limits.into(),
            group,
            file: Some(take(&d.file)?),
            engine: d.engine.as_deref().and_then(super::proto::engine_of),
        });
    }
    // The daemon's scheduler gate: its page is shared with the daemon,
    // which parks and unparks it and kicks the vCPU threads by host tid.
    let sched_gate = match spec.sched_gate {
        Some(i) => Some(peer_gate(take_fd(i)?).map_err(|e| start_failed(&sock, e))?),
        None => None,
    };
    cfg.sched_gate = sched_gate.as_ref().map(|(g, _)| g.clone());
    // The control socket and the exit record are the process's only paths
    // on the host: made before the jail, used by fd after it.
    // Test-only: a VM process slow to get here (its daemon may die first).
    #[cfg(debug_assertions)]
    if crate::seccomp::fault::injected("vmproc-slow-start", &spec.name) {
        std::thread::sleep(Duration::from_secs(3));
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
    let mut exit_file = None;
    let kvm = match &spec.jail {
        Some(j) => {
            exit_file = spec
                .control_socket
                .as_ref()
                .and_then(|p| open_exit_record(&p.with_extension("exit")));
            // With a pid namespace the jail forks: this process stays
            // outside as the reaper, the child runs the VM as pid 1 and
            // reports its namespace's ids, which the daemon maps to the
            // host's (`vmproc::hostids`).
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
    if let Some(path) = &vm.control_socket {
        // For a daemon that is not there to hear it: written before the
        // socket goes, so a daemon that finds no socket finds this.
        let rec = super::proto::ExitRecord {
            name: vm.handle.name().to_string(),
            nonce: vm.nonce.clone(),
            reason: reason.clone(),
        };
        if let Ok(data) = serde_json::to_vec(&rec) {
            match &exit_file {
                // Jailed: the path is out of reach; the file was opened
                // before the jail. The socket stays (a daemon that finds
                // it refusing connections removes it and reads this).
                Some(f) => {
                    use std::io::Write;
                    let _ = (&*f).write_all(&data);
                }
                None => {
                    let _ = std::fs::write(path.with_extension("exit"), data);
                }
            }
        }
        let _ = std::fs::remove_file(path);
    }
    vm.link.send(&FromVm::Exited {
        reason,
        stats: Box::new(vm.stats()),
    });
    Ok(0)
}

/// The peer side of the scheduler gate whose memfd the daemon passed, and
/// a copy of the fd (for the next daemon).
fn peer_gate(fd: OwnedFd) -> std::io::Result<(Arc<Gate>, OwnedFd)> {
    let kept = fd.try_clone()?;
    Ok((Gate::from_fd(fd)?, kept))
}

/// The exit record's file, created empty (0600) before the jail: a jailed
/// process writes its record through this fd when its VM ends.
fn open_exit_record(path: &std::path::Path) -> Option<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| tracing::warn!(path = %path.display(), "exit record: {e}"))
        .ok()
}

/// The process's throttle group `g.name`: attached to the shared page
/// passed with the message (`g.page`, its file here as `page`; a page replaces
/// the process's group of that name, e.g. for a daemon that re-adopted the
/// process), else the group of that name the process has, else a new group
/// of this process alone with `g.limits`.
fn group_for(
    groups: &mut BTreeMap<String, ThrottleGroup>,
    g: &super::proto::GroupSpec,
    now: u64,
    page: Option<OwnedFd>,
) -> Result<ThrottleGroup, VmProcessError> {
    let bad = |e: String| VmProcessError::Config(format!("group {}: {e}", g.name));
    let x = match page {
        Some(fd) => {
            let p = crate::iopage::IoPage::from_fd(&fd).map_err(|e| bad(e.to_string()))?;
            ThrottleGroup::attach(g.name.clone(), &g.limits.into(), now, p)
                .map_err(|e| bad(e.to_string()))?
        }
        None => {
            if let Some(x) = groups.get(&g.name) {
                return Ok(x.clone());
            }
            ThrottleGroup::new(g.name.clone(), &g.limits.into(), now)
                .map_err(|e| bad(e.to_string()))?
        }
    };
    groups.insert(g.name.clone(), x.clone());
    Ok(x)
}

impl VmProcess {
    fn status(&self) -> Status {
        let h = &self.handle;
        Status {
            name: h.name().to_string(),
            nonce: self.nonce.clone(),
            pid: std::process::id(),
            paused: h.is_paused(),
            parked: self.sched_gate.as_ref().is_some_and(|(g, _)| g.is_parked()),
            unsupervised: !self.supervised.load(Ordering::Acquire),
            exit: h.exit_reason(),
            vcpu_tids: h.vcpu_tids().to_vec(),
            device_tid: h.device_tid(),
            uptime_secs: h.uptime().as_secs_f64(),
        }
    }

    fn stats(&self) -> Stats {
        let h = &self.handle;
        let mut exits: BTreeMap<&'static str, u64> = BTreeMap::new();
        for s in h.vcpu_stats() {
            for (k, v) in s.snapshot() {
                *exits.entry(k).or_default() += v;
            }
        }
        Stats {
            disks: h
                .disks()
                .into_iter()
                .map(|d| WireDisk {
                    name: d.name,
                    path: d.path,
                    read_only: d.read_only,
                    direct: d.direct,
                    capacity_bytes: d.capacity_bytes,
                    limits: d.limits.into(),
                    group: d.group,
                    stats: (&d.stats).into(),
                    device: d.device,
                    engine: super::proto::engine_name(d.engine),
                })
                .collect(),
            exits: exits.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            guest_errors: h
                .guest_errors()
                .into_iter()
                .map(|(d, k, n)| (d, k.to_string(), n))
                .collect(),
            unknown_accesses: h.unknown_accesses(),
        }
    }

    /// Answers one request (`fds`: the files passed with it).
    fn handle(&self, req: Request, mut fds: Vec<Option<OwnedFd>>) -> Response {
        let h = &self.handle;
        let done = |r: Result<(), crate::vm::VmError>| match r {
            Ok(()) => Response::Ok,
            Err(e) => Response::Error {
                kind: super::proto::ErrorKind::of(&e),
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
    fn answer(
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

    /// Reads requests from one daemon connection until it closes.
    fn serve_connection(&self, sock: Arc<OwnedFd>) {
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
        self.lost_daemon(&sock);
    }

    /// The daemon's connection closed: the daemon is gone. The VM keeps
    /// running with its last limits; its shares are not enforced (the gate
    /// opens) until a daemon re-adopts it.
    fn lost_daemon(&self, sock: &Arc<OwnedFd>) {
        {
            let mut g = lock(&self.link.conn);
            if g.as_ref().is_some_and(|x| Arc::ptr_eq(x, sock)) {
                *g = None;
            } else {
                // Not the supervising connection (a status query, or a
                // daemon that never adopted the process).
                return;
            }
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
    fn accept_loop(self: Arc<Self>, listener: OwnedFd) {
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

    /// Pushes console output to the current daemon, from the offset it
    /// asked for; ends when the log is closed and everything is sent.
    fn pump_console(&self) {
        let log = self.handle.console();
        loop {
            if lock(&self.link.conn).is_none() {
                // Nobody to send to: the log keeps the output for a daemon
                // that re-adopts the process.
                if log.read_from(u64::MAX, Duration::ZERO).2 {
                    return;
                }
                std::thread::sleep(Duration::from_millis(200));
                continue;
            }
            let from = self.link.console_next.load(Ordering::Acquire);
            let (data, next, closed) = log.read_from(from, Duration::from_millis(250));
            let start = next - data.len() as u64;
            {
                for (i, chunk) in data.chunks(CONSOLE_CHUNK).enumerate() {
                    self.link.send(&FromVm::Console {
                        offset: start + (i * CONSOLE_CHUNK) as u64,
                        data: chunk.to_vec(),
                    });
                }
                // Only if no daemon asked for another offset meanwhile.
                let _ = self.link.console_next.compare_exchange(
                    from,
                    next,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
            if closed && data.is_empty() {
                return;
            }
        }
    }
}
