//! The daemon's view of one VM process: [`RemoteVm`], with the methods the
//! manager uses on an in-process [`crate::VmHandle`]. Requests go out on the
//! socket with an id; one reader thread per VM routes the replies, mirrors
//! the console output into a local [`ConsoleLog`] and records the exit (the
//! VM's own report, or the end of the socket: the process is gone).

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use corral_blkthrottle::{Limits, ThrottleGroup};
use corral_devices::ConsoleLog;
use corral_scheduler::Gate;

use super::hostids::{HostIds, host_ids};
use super::launcher::Launcher;
use super::proto::{FromVm, GroupSpec, Hello, Request, Response, Stats, Status, ToVm, VmSpec};
use super::wire;
use crate::hostfile::HostFile;
use crate::util::lock;
use crate::vm::{DiskStatus, ExitReason, VmError};

/// How long a request waits for its reply.
const REPLY_TIMEOUT: Duration = Duration::from_secs(8);
/// How long a new VM process may take to start its VM.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long counters are reused between reads (one snapshot of a VM reads
/// disks, exits and guest errors).
const STATS_TTL: Duration = Duration::from_millis(100);

struct Inner {
    sock: OwnedFd,
    pending: Mutex<HashMap<u64, mpsc::Sender<Response>>>,
    exit: Mutex<Option<ExitReason>>,
    exit_cond: Condvar,
    /// The socket reached its end: the process is gone (or closed it).
    gone: AtomicBool,
    /// Set as soon as the socket ends (before `gone`, which waits for the
    /// launcher's account): the kicks stop then, before its pid can be
    /// reused.
    closed: Arc<AtomicBool>,
    console: Arc<ConsoleLog>,
    /// The counters the VM process sent with its exit.
    last_stats: Mutex<Option<Stats>>,
}

/// A VM running in its own process, as the daemon sees it.
pub struct RemoteVm {
    name: String,
    /// Host ids (pid, outer pid, thread ids): see [`HostIds`].
    ids: HostIds,
    nonce: String,
    inner: Arc<Inner>,
    next_id: AtomicU64,
    started: Instant,
    files: Vec<HostFile>,
    paused: AtomicBool,
    reader: Mutex<Option<JoinHandle<()>>>,
    /// The owner side of the VM's scheduler gate, when the daemon got it
    /// back from a VM process it re-adopted ([`Self::set_sched_gate`]).
    sched_gate: Mutex<Option<Arc<Gate>>>,
    stats: Mutex<Option<(Instant, Stats)>>,
    launcher: Arc<Launcher>,
}

impl std::fmt::Debug for RemoteVm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteVm")
            .field("name", &self.name)
            .field("pid", &self.ids.pid)
            .finish_non_exhaustive()
    }
}

pub(super) fn wire_err(e: impl std::fmt::Display) -> VmError {
    VmError::Config(format!("VM process: {e}"))
}

/// Waits until `fd` is readable, up to `timeout`.
pub(super) fn readable(fd: BorrowedFd<'_>, timeout: Duration) -> bool {
    let mut p = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(&fd),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd for the duration of the call.
    let r = unsafe { libc::poll(&mut p, 1, ms) };
    r > 0
}

impl RemoteVm {
    /// Starts a VM process through `launcher` for `vm`, passing `files`
    /// (the indices of `vm`'s `PassedFile`s); returns once its VM runs.
    /// `keep` are the daemon's own handles of those files (their locks).
    /// `spawned` runs with the new process's (host) pid before it gets its
    /// configuration, so before it has started a thread or run a guest
    /// instruction (the cgroup backend places it there); an error kills it.
    pub fn start(
        launcher: &Arc<Launcher>,
        vm: VmSpec,
        files: &[BorrowedFd<'_>],
        keep: Vec<HostFile>,
        setsid: bool,
        spawned: &dyn Fn(u32) -> Result<(), VmError>,
    ) -> Result<RemoteVm, VmError> {
        let (ours, theirs) = wire::pair().map_err(wire_err)?;
        let name = vm.name.clone();
        let console_bytes = vm.console_log_bytes;
        let pid = launcher
            .spawn_vm(
                &name,
                theirs,
                setsid,
                vm.control_socket.as_deref(),
                vm.jail.as_ref(),
            )
            .map_err(wire_err)?;
        let fail = |e: VmError| {
            launcher.kill(pid);
            e
        };
        spawned(pid).map_err(fail)?;
        let hello = Hello { vm };
        wire::send(&ours, &hello, files).map_err(|e| fail(wire_err(e)))?;
        if !readable(ours.as_fd(), START_TIMEOUT) {
            return Err(fail(wire_err(
                "the VM process did not start its VM in time",
            )));
        }
        let status = match wire::recv::<FromVm>(&ours) {
            Ok(Some((FromVm::Started(s), _))) => s,
            Ok(Some((FromVm::StartFailed { message }, _))) => {
                return Err(VmError::Config(message));
            }
            Ok(Some(_)) => return Err(fail(wire_err("unexpected first message"))),
            Ok(None) => {
                let how = launcher
                    .exit_status(pid, Duration::from_secs(1))
                    .unwrap_or_else(|| "no status".into());
                return Err(wire_err(format!("the VM process ended at start ({how})")));
            }
            // A VM process of another version (its binary is not the
            // daemon's): it said so in its first message's header, or by
            // having none (version 1).
            Err(wire::WireError::Version { ours, theirs }) => {
                return Err(fail(VmError::Config(format!(
                    "the VM process speaks protocol version {theirs}; this daemon speaks version {ours}"
                ))));
            }
            Err(e) => return Err(fail(wire_err(e))),
        };
        Self::attach(ours, status, pid, keep, launcher.clone(), console_bytes).map_err(fail)
    }

    /// The daemon's side of a running VM process on `sock`, started as
    /// `outer` (the launcher's child, or the peer of its control socket):
    /// its host ids are found first ([`host_ids`]); a process whose threads
    /// are not where it says is refused.
    pub(super) fn attach(
        sock: OwnedFd,
        status: Status,
        outer: u32,
        files: Vec<HostFile>,
        launcher: Arc<Launcher>,
        console_bytes: usize,
    ) -> Result<RemoteVm, VmError> {
        let ids = host_ids(outer, &status)
            .map_err(|e| wire_err(format!("the host ids of process {outer}: {e}")))?;
        let inner = Arc::new(Inner {
            sock,
            pending: Mutex::new(HashMap::new()),
            exit: Mutex::new(status.exit.clone()),
            exit_cond: Condvar::new(),
            gone: AtomicBool::new(false),
            closed: Arc::new(AtomicBool::new(false)),
            console: ConsoleLog::new(console_bytes),
            last_stats: Mutex::new(None),
        });
        let reader = {
            let inner = inner.clone();
            let name = status.name.clone();
            let (pid, outer) = (ids.pid, ids.outer);
            let launcher = launcher.clone();
            std::thread::Builder::new()
                .name(format!("vmproc-{pid}"))
                .spawn(move || read_loop(&inner, &name, pid, outer, &launcher))
                .ok()
        };
        Ok(RemoteVm {
            name: status.name,
            ids,
            nonce: status.nonce,
            inner,
            next_id: AtomicU64::new(1),
            started: Instant::now() - Duration::from_secs_f64(status.uptime_secs.max(0.0)),
            files,
            paused: AtomicBool::new(status.paused),
            reader: Mutex::new(reader),
            sched_gate: Mutex::new(None),
            stats: Mutex::new(None),
            launcher,
        })
    }

    /// The host pid of the process that runs the VM (with a pid namespace,
    /// the jail's outer process's child).
    pub fn pid(&self) -> u32 {
        self.ids.pid
    }

    /// Its host ids: pid, the outer process, the vCPU and device threads.
    pub fn host_ids(&self) -> &HostIds {
        &self.ids
    }

    /// The run's identity.
    pub fn nonce(&self) -> &str {
        &self.nonce
    }

    pub(super) fn call(&self, req: Request) -> Result<Response, VmError> {
        self.call_with(req, &[])
    }

    /// [`Self::call`] with files passed as SCM_RIGHTS.
    fn call_with(
        &self,
        req: Request,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<Response, VmError> {
        if self.inner.gone.load(Ordering::Acquire) {
            return Err(VmError::Config("the VM's process has ended".into()));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        lock(&self.inner.pending).insert(id, tx);
        if let Err(e) = wire::send(&self.inner.sock, &ToVm { id, req }, fds) {
            lock(&self.inner.pending).remove(&id);
            return Err(wire_err(e));
        }
        let r = rx.recv_timeout(REPLY_TIMEOUT);
        lock(&self.inner.pending).remove(&id);
        match r {
            Ok(Response::Error { message, kind }) => Err(kind.error(&self.name, message)),
            Ok(r) => Ok(r),
            Err(_) if self.inner.gone.load(Ordering::Acquire) => {
                Err(VmError::Stopped(self.name.clone()))
            }
            Err(_) => Err(VmError::DeviceUnresponsive {
                vm: self.name.clone(),
                ms: REPLY_TIMEOUT.as_millis() as u64,
            }),
        }
    }

    /// Sends without waiting for an answer.
    pub(super) fn tell(&self, req: Request) {
        let _ = wire::send(&self.inner.sock, &ToVm { id: 0, req }, &[]);
    }

    /// The VM's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Files the daemon keeps open for the VM (their locks).
    pub fn files(&self) -> &[HostFile] {
        &self.files
    }

    /// Console output (the daemon's mirror).
    pub fn console(&self) -> Arc<ConsoleLog> {
        self.inner.console.clone()
    }

    /// Time since start.
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// Why the VM stopped, if it did (a stop asked for counts at once, as
    /// for an in-process VM).
    pub fn exit_reason(&self) -> Option<ExitReason> {
        lock(&self.inner.exit).clone()
    }

    /// Pauses the guest.
    pub fn pause(&self) -> bool {
        let r = matches!(self.call(Request::Pause), Ok(Response::Bool(true)));
        if r {
            self.paused.store(true, Ordering::Relaxed);
        }
        r
    }

    /// Resumes it.
    pub fn resume(&self) -> bool {
        let r = matches!(self.call(Request::Resume), Ok(Response::Bool(true)));
        if r {
            self.paused.store(false, Ordering::Relaxed);
        }
        r
    }

    /// Paused by the host.
    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::Relaxed)
    }

    /// The VM process's own status.
    pub fn status(&self) -> Result<Status, VmError> {
        match self.call(Request::Status)? {
            Response::Status(s) => Ok(s),
            _ => Err(wire_err("unexpected answer")),
        }
    }

    fn stats(&self) -> Stats {
        if let Some(s) = &*lock(&self.inner.last_stats) {
            return s.clone();
        }
        let mut c = lock(&self.stats);
        if let Some((at, s)) = &*c
            && at.elapsed() < STATS_TTL
        {
            return s.clone();
        }
        let fresh = match self.call(Request::Stats) {
            Ok(Response::Stats(s)) => *s,
            // A VM that ended keeps its last figures.
            _ => return c.as_ref().map(|x| x.1.clone()).unwrap_or_default(),
        };
        *c = Some((Instant::now(), fresh.clone()));
        fresh
    }

    /// The disks with their limits and counters.
    pub fn disks(&self) -> Vec<DiskStatus> {
        self.stats()
            .disks
            .iter()
            .map(|d| DiskStatus {
                name: d.name.clone(),
                path: d.path.clone(),
                read_only: d.read_only,
                direct: d.direct,
                capacity_bytes: d.capacity_bytes,
                limits: d.limits.into(),
                stats: (&d.stats).into(),
                device: d.device,
                engine: super::proto::engine_of(&d.engine)
                    .unwrap_or(corral_devices::virtio::blk::IoEngine::Sync),
                group: d.group.clone(),
                group_weight: d.group_weight,
            })
            .collect()
    }

    /// vCPU exits by kind, summed over the vCPUs.
    pub fn exit_counts(&self) -> Vec<(&'static str, u64)> {
        let known = crate::shared::VcpuStats::default().snapshot();
        self.stats()
            .exits
            .iter()
            .filter_map(|(k, v)| known.iter().find(|(n, _)| n == k).map(|(n, _)| (*n, *v)))
            .collect()
    }

    /// Guest-caused errors: (device, kind, count).
    pub fn guest_errors(&self) -> Vec<(String, &'static str, u64)> {
        use corral_devices::GuestErrorKind;
        self.stats()
            .guest_errors
            .iter()
            .filter_map(|(d, k, n)| {
                GuestErrorKind::ALL
                    .iter()
                    .find(|x| x.as_str() == k)
                    .map(|x| (d.clone(), x.as_str(), *n))
            })
            .collect()
    }

    /// Unclaimed accesses.
    pub fn unknown_accesses(&self) -> (u64, u64, u64, u64) {
        self.stats().unknown_accesses
    }

    /// Moves a disk into a group of the VM process with `group`'s name and
    /// limits, over the group's shared page `page` if it has one (else a
    /// group of the VM process alone).
    pub fn set_disk_group(
        &self,
        disk: &str,
        group: Option<(ThrottleGroup, u32)>,
        page: Option<&std::os::fd::OwnedFd>,
    ) -> Result<(), VmError> {
        use std::os::fd::AsFd;
        let group = group.map(|(g, weight)| GroupSpec {
            name: g.name().to_string(),
            limits: g.limits().into(),
            weight,
            page: page.map(|_| 0),
        });
        let fds: Vec<_> = page.iter().map(|f| f.as_fd()).collect();
        self.call_with(
            Request::SetDiskGroup {
                disk: disk.to_string(),
                group,
            },
            &fds,
        )
        .map(drop)
    }

    /// Changes a disk's weight in its group, keeping its place there.
    pub fn set_disk_weight(&self, disk: &str, weight: u32) -> Result<(), VmError> {
        self.call(Request::SetDiskWeight {
            disk: disk.to_string(),
            weight,
        })
        .map(drop)
    }

    /// Changes the limits of the VM process's group `name`.
    pub fn set_group_limits(&self, name: &str, limits: Limits) -> Result<(), VmError> {
        self.call(Request::SetGroupLimits {
            name: name.to_string(),
            limits: limits.into(),
        })
        .map(drop)
    }

    /// A disk's limits, live.
    pub fn set_disk_limits(&self, disk: &str, limits: Limits) -> Result<(), VmError> {
        limits
            .validate()
            .map_err(|e| VmError::Config(e.to_string()))?;
        self.call(Request::SetDiskLimits {
            disk: disk.to_string(),
            limits: limits.into(),
        })
        .map(drop)
    }

    /// The ACPI power button.
    pub fn press_power_button(&self) -> bool {
        self.exit_reason().is_none()
            && matches!(self.call(Request::PowerButton), Ok(Response::Bool(true)))
    }

    /// Console input; bytes taken.
    pub fn console_input(&self, data: &[u8]) -> usize {
        if self.exit_reason().is_some() {
            return 0;
        }
        match self.call(Request::ConsoleInput {
            data: data.to_vec(),
        }) {
            Ok(Response::Count(n)) => n.min(data.len()),
            _ => 0,
        }
    }

    /// Asks the VM to stop; returns at once.
    pub fn stop(&self) {
        {
            let mut g = lock(&self.inner.exit);
            if g.is_none() {
                *g = Some(ExitReason::Stopped);
            }
        }
        self.inner.exit_cond.notify_all();
        self.tell(Request::Stop);
    }

    /// Waits for the VM to stop, up to `timeout` (forever if `None`).
    pub fn wait(&self, timeout: Option<Duration>) -> Option<ExitReason> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut g = lock(&self.inner.exit);
        while g.is_none() {
            let wait = match deadline {
                None => Duration::from_secs(3600),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return None;
                    }
                    d - now
                }
            };
            g = self
                .inner
                .exit_cond
                .wait_timeout(g, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        g.clone()
    }

    /// Waits for the process to be gone, up to `timeout`.
    fn wait_gone(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut g = lock(&self.inner.exit);
        while !self.inner.gone.load(Ordering::Acquire) {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            g = self
                .inner
                .exit_cond
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        drop(g);
        true
    }

    /// Stops the VM and waits for its process to end (SIGKILL after 10 s).
    pub fn join(&self) -> ExitReason {
        if self.exit_reason().is_none() || !self.inner.gone.load(Ordering::Acquire) {
            self.stop();
        }
        if !self.wait_gone(Duration::from_secs(10)) {
            tracing::warn!(vm = %self.name, pid = self.ids.pid, "the VM process did not exit: killing it");
            self.launcher.kill(self.ids.outer);
            self.wait_gone(Duration::from_secs(5));
        }
        if let Some(t) = lock(&self.reader).take() {
            let _ = t.join();
        }
        self.exit_reason().unwrap_or(ExitReason::Stopped)
    }

    /// Whether the process has ended (its resources are the kernel's to
    /// free); joins its reader then.
    pub fn try_release(&self) -> bool {
        if self.exit_reason().is_none() || !self.inner.gone.load(Ordering::Acquire) {
            return false;
        }
        self.join();
        true
    }

    /// The vCPU threads' host tids (mapped from the VM process's pid
    /// namespace: [`HostIds`]), for kicks, `/proc/TID` reads and cgroups.
    pub fn vcpu_tids(&self) -> &[libc::pid_t] {
        &self.ids.vcpu_tids
    }

    /// The device thread's host tid.
    pub fn device_tid(&self) -> Option<libc::pid_t> {
        self.ids.device_tid
    }

    /// The kick of the scheduler gate's park ([`crate::vmgate::KickMode::Signal`]):
    /// the daemon signals the vCPU threads by host tid ([`Self::host_ids`]),
    /// until the VM process's socket ends (its pid may be reused after
    /// that).
    pub fn gate_kick(&self) -> impl Fn() + Send + Sync + 'static {
        let kick =
            crate::vmgate::signal_kick(self.ids.pid as libc::pid_t, self.ids.vcpu_tids.clone());
        let closed = self.inner.closed.clone();
        move || {
            if !closed.load(Ordering::Acquire) {
                kick();
            }
        }
    }

    /// Records the owner side of the scheduler gate that a re-adopted VM
    /// process gave back (`Gate::reattach`).
    pub(super) fn set_sched_gate(&self, gate: Arc<Gate>) {
        *lock(&self.sched_gate) = Some(gate);
    }

    /// The scheduler gate a re-adopted VM process gave back, if any.
    pub fn take_sched_gate(&self) -> Option<Arc<Gate>> {
        lock(&self.sched_gate).take()
    }

    /// Lets the VM process go without stopping it: closes the connection
    /// (the process keeps running unsupervised, or another daemon adopts it).
    pub fn forget(&self) {
        let _ = rustix::net::shutdown(&self.inner.sock, rustix::net::Shutdown::Both);
    }
}

/// The reader thread of one VM process (host pid `pid`, started as
/// `outer`, whose end the launcher reports).
fn read_loop(inner: &Inner, name: &str, pid: u32, outer: u32, launcher: &Launcher) {
    let mut console_total: u64 = 0;
    loop {
        match wire::recv::<FromVm>(inner.sock.as_fd()) {
            Ok(Some((FromVm::Reply { id, resp }, _))) => {
                if let Some(tx) = lock(&inner.pending).remove(&id) {
                    let _ = tx.send(resp);
                }
            }
            Ok(Some((FromVm::Console { offset, data }, _))) => {
                // Skip what the mirror already holds (a resend).
                let skip = console_total.saturating_sub(offset) as usize;
                if let Some(rest) = data.get(skip..) {
                    inner.console.append(rest);
                    console_total = console_total.max(offset) + rest.len() as u64;
                }
            }
            Ok(Some((FromVm::Exited { reason, stats }, _))) => {
                *lock(&inner.last_stats) = Some(*stats);
                let mut g = lock(&inner.exit);
                if g.is_none() {
                    *g = Some(reason);
                }
                drop(g);
                inner.exit_cond.notify_all();
            }
            Ok(Some((FromVm::Started(_) | FromVm::StartFailed { .. }, _))) => {}
            Ok(None) => break,
            // The process ended with requests unread.
            Err(wire::WireError::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(wire::WireError::Decode(e)) => {
                tracing::warn!(vm = name, pid, "VM process sent a bad message: {e}");
            }
            Err(e) => {
                tracing::warn!(vm = name, pid, "VM process socket: {e}");
                break;
            }
        }
    }
    // The process is gone (its end of the socket closed with it).
    inner.closed.store(true, Ordering::Release);
    let missing = lock(&inner.exit).is_none();
    if missing {
        let how = launcher
            .exit_status(outer, Duration::from_millis(500))
            .unwrap_or_else(|| "how is unknown".into());
        tracing::warn!(vm = name, pid, "the VM process ended: {how}");
        let mut g = lock(&inner.exit);
        if g.is_none() {
            *g = Some(ExitReason::ProcessGone { pid, how });
        }
    }
    inner.gone.store(true, Ordering::Release);
    inner.console.close();
    lock(&inner.pending).clear();
    let _g = lock(&inner.exit);
    inner.exit_cond.notify_all();
}
