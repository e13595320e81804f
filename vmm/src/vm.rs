//! One VM: KVM fds, guest memory, boot payload, devices, vCPU threads and the
//! device thread; its lifecycle from start to a recorded exit reason.

use std::io::Cursor;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::thread::JoinHandleExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use corral_blkthrottle::{Limits, Throttle, ThrottleGroup};
use corral_devices::acpi_pm::{self, AcpiPm};
use corral_devices::bus::lock;
use corral_devices::virtio::blk::{Block, BlockOptions, DiskFile, DiskSpec};
use corral_devices::virtio::mmio::QUEUE_NOTIFY;
use corral_devices::virtio::{MMIO_WINDOW_SIZE, MmioTransport, VirtioDevice};
use corral_devices::{Bus, ConsoleLog, GuestLog, I8042, SerialDevice};
use corral_scheduler::gate::Gate;
use kvm_bindings::{
    KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY, kvm_pit_config, kvm_userspace_memory_region,
};
use kvm_ioctls::{IoEventAddress, Kvm, VcpuFd, VmFd};
use vm_memory::{Address, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use crate::hostfile::{HostFile, HostFileError, HostImage, Role};
use crate::seccomp::{ThreadKind, VmFaults};
use crate::vcpu::{self, VcpuStats};
use crate::{acpi, boot, cpuid, layout, loader, mptable};

/// Where the kernel comes from.
#[derive(Debug, Clone)]
pub enum KernelSource {
    /// A file on the host, opened with the caller's rights.
    Path(PathBuf),
    /// A file already opened (and locked) under a host-path policy.
    File(HostFile),
    /// An image in memory (the built-in probe guest).
    Bytes(Arc<[u8]>),
}

/// Everything needed to start one VM.
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// Name, for logs and thread names.
    pub name: String,
    /// Kernel image.
    pub kernel: KernelSource,
    /// Optional initrd.
    pub initrd: Option<HostImage>,
    /// Kernel command line.
    pub cmdline: String,
    /// Number of vCPUs.
    pub vcpus: u8,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// Copy console output to the host's stdout.
    pub console_stdout: bool,
    /// Feed the host's stdin to the guest's serial port.
    pub console_stdin: bool,
    /// Bytes of console output kept in memory.
    pub console_log_bytes: usize,
    /// The scheduler's gate for this VM (the `gate` CPU backend), if any.
    pub sched_gate: Option<Arc<Gate>>,
    /// virtio-blk disks, in order (vda, vdb, ...).
    pub disks: Vec<DiskConfig>,
    /// Give the guest ACPI tables (MADT, DSDT with the virtio-mmio devices,
    /// S5 power-off). Off: MP table and command-line announcement only.
    pub acpi: bool,
}

/// One virtio-blk disk of a VM.
#[derive(Debug, Clone)]
pub struct DiskConfig {
    /// Backing file and flags.
    pub spec: DiskSpec,
    /// The disk's own limits.
    pub limits: Limits,
    /// A shared limit (per class or named), if any, and this disk's weight in it.
    pub group: Option<(ThrottleGroup, u32)>,
    /// The backing file, already opened (and locked) under a host-path
    /// policy; `None`: [`crate::vm::start`] opens `spec.path` itself.
    pub file: Option<HostFile>,
}

impl DiskConfig {
    /// Parses the CLI form `PATH[,readonly][,direct][,id=NAME][,bps=N,...]`.
    pub fn parse(s: &str) -> Result<Self, VmError> {
        let spec = DiskSpec::parse(s).map_err(|e| VmError::Config(format!("--disk {s}: {e}")))?;
        let mut limits = Limits::default();
        for (k, v) in &spec.options {
            match limits.parse_kv(k, v) {
                Ok(true) => {}
                Ok(false) => {
                    return Err(VmError::Config(format!(
                        "--disk {s}: unknown option {k:?} (flags: readonly, direct; keys: id, bps, iops, rbps, wbps, riops, wiops, burst_bytes, burst_ops, onetime_bytes, onetime_ops)"
                    )));
                }
                Err(e) => return Err(VmError::Config(format!("--disk {s}: {e}"))),
            }
        }
        limits
            .validate()
            .map_err(|e| VmError::Config(format!("--disk {s}: {e}")))?;
        Ok(Self {
            spec,
            limits,
            group: None,
            file: None,
        })
    }

    /// The disk's name: its `id`, else `vda`, `vdb`, ... by position.
    pub fn name(&self, index: usize) -> String {
        self.spec.id.clone().unwrap_or_else(|| disk_name(index))
    }
}

/// `vda`, `vdb`, ..., `vdz`, `vdaa`, ...
pub fn disk_name(index: usize) -> String {
    let mut n = index;
    let mut s = Vec::new();
    loop {
        s.push(b'a' + (n % 26) as u8);
        if n < 26 {
            break;
        }
        n = n / 26 - 1;
    }
    s.reverse();
    format!("vd{}", String::from_utf8_lossy(&s))
}

/// IRQs (ISA pins, routed by the MP table and the ACPI DSDT alike) for
/// virtio-mmio devices: 4 is COM1, 8 the RTC, 13 the FPU.
pub const VIRTIO_IRQS: [u32; 9] = [5, 6, 7, 9, 10, 11, 12, 14, 15];

/// Counters and limits of one disk, for the API and metrics.
#[derive(Debug, Clone)]
pub struct DiskInfo {
    /// Name.
    pub name: String,
    /// Backing file.
    pub path: PathBuf,
    /// Read-only.
    pub read_only: bool,
    /// O_DIRECT.
    pub direct: bool,
    /// Size in bytes.
    pub capacity_bytes: u64,
    /// The disk's own limits.
    pub limits: Limits,
    /// Throttle counters (ops, bytes, throttled, latency), if a throttle is installed.
    pub stats: corral_blkthrottle::Stats,
    /// The throttle group the disk is in now, if any.
    pub group: Option<String>,
}

impl VmConfig {
    /// A configuration with defaults: 1 vCPU, 128 MiB, no console on stdout.
    pub fn new(name: impl Into<String>, kernel: KernelSource) -> Self {
        Self {
            name: name.into(),
            kernel,
            initrd: None,
            cmdline: String::new(),
            vcpus: 1,
            memory_mib: 128,
            console_stdout: false,
            console_stdin: false,
            console_log_bytes: 256 * 1024,
            sched_gate: None,
            disks: Vec::new(),
            acpi: true,
        }
    }
}

/// Why a VM stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitReason {
    /// The guest shut down or reset itself (i8042 reset, ACPI S5, KVM system event).
    GuestShutdown,
    /// Stopped on request from the host.
    Stopped,
    /// A fatal exit: triple fault, internal error, failed entry.
    Fatal {
        /// vCPU that hit it.
        vcpu: u8,
        /// What happened.
        reason: String,
        /// Register dump.
        registers: String,
    },
    /// One of the VM's threads failed: it panicked, or made a syscall that
    /// its seccomp filter forbids. The VM stops; other VMs go on.
    ThreadFault {
        /// The thread's name (`vcpu0`, `dev-NAME`).
        thread: String,
        /// Its kind.
        kind: ThreadKind,
        /// The vCPU, for a vCPU thread.
        vcpu: Option<u8>,
        /// What happened.
        fault: ThreadFault,
    },
}

/// How a VM's thread failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ThreadFault {
    /// It panicked (the message).
    Panic(String),
    /// It made syscall number `syscall` (x86-64), outside its filter.
    Seccomp {
        /// The syscall number.
        syscall: i32,
    },
    /// It could not install its seccomp filter.
    Setup(String),
}

impl std::fmt::Display for ExitReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::GuestShutdown => write!(f, "guest shut down"),
            Self::Stopped => write!(f, "stopped on request"),
            Self::Fatal {
                vcpu,
                reason,
                registers,
            } => write!(f, "vcpu{vcpu}: {reason} ({registers})"),
            Self::ThreadFault {
                thread,
                kind,
                fault,
                ..
            } => {
                let kind = kind.as_str();
                match fault {
                    ThreadFault::Panic(msg) => {
                        write!(f, "{thread} ({kind} thread) panicked: {msg}")
                    }
                    ThreadFault::Seccomp { syscall } => write!(
                        f,
                        "{thread} ({kind} thread) made syscall {syscall}, which its seccomp filter forbids"
                    ),
                    ThreadFault::Setup(msg) => write!(f, "{thread} ({kind} thread): {msg}"),
                }
            }
        }
    }
}

/// Errors of VM configuration and start-up.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// A bad configuration value.
    #[error("{0}")]
    Config(String),
    /// /dev/kvm could not be opened or used.
    #[error("KVM: {what}: {err}")]
    Kvm {
        /// What failed.
        what: &'static str,
        /// Why.
        err: kvm_ioctls::Error,
    },
    /// Kernel/initrd/cmdline loading.
    #[error(transparent)]
    Load(#[from] loader::LoadError),
    /// Boot state.
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    /// MP table.
    #[error(transparent)]
    MpTable(#[from] mptable::MpTableError),
    /// ACPI tables.
    #[error(transparent)]
    Acpi(#[from] acpi::AcpiError),
    /// A kernel, initrd or disk file is refused, locked or cannot be opened.
    #[error(transparent)]
    HostFile(#[from] HostFileError),
    /// A disk cannot be opened or set up.
    #[error("disk {name}: {msg}")]
    Disk {
        /// Disk name.
        name: String,
        /// What went wrong.
        msg: String,
    },
    /// No such disk.
    #[error("no disk {0:?}")]
    NoSuchDisk(String),
    /// Guest memory allocation.
    #[error("cannot allocate guest memory: {0}")]
    Memory(String),
    /// Host resources (threads, eventfds, signals).
    #[error("{what}: {err}")]
    Io {
        /// What failed.
        what: &'static str,
        /// Why.
        err: std::io::Error,
    },
}

fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |err| VmError::Kvm { what, err }
}

fn io_err(what: &'static str) -> impl FnOnce(std::io::Error) -> VmError {
    move |err| VmError::Io { what, err }
}

/// Host memory in MiB (MemTotal).
pub fn host_memory_mib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

/// The largest vCPU count this host's KVM allows for one VM (also bounded by
/// what the MP table can describe).
pub fn max_vcpus(kvm: &Kvm) -> usize {
    kvm.get_max_vcpus().min(mptable::MAX_CPUS as usize)
}

/// The files of a VM, open and locked (see [`crate::hostfile`]).
pub struct OpenFiles {
    /// The kernel, unless it is built in.
    pub kernel: Option<HostFile>,
    /// The initrd.
    pub initrd: Option<HostFile>,
    /// The disks, in order.
    pub disks: Vec<HostFile>,
}

impl OpenFiles {
    fn all(&self) -> impl Iterator<Item = &HostFile> {
        self.kernel
            .iter()
            .chain(self.initrd.iter())
            .chain(self.disks.iter())
    }
}

/// Opens (or takes the already open) kernel, initrd and disks: never waits
/// on a FIFO, checks the file types on the opened fds, takes the image
/// locks.
pub fn open_files(cfg: &VmConfig) -> Result<OpenFiles, VmError> {
    let kernel = match &cfg.kernel {
        KernelSource::Path(p) => Some(HostImage::Path(p.clone()).open(Role::Kernel)?),
        KernelSource::File(f) => Some(f.clone()),
        KernelSource::Bytes(_) => None,
    };
    let initrd = match &cfg.initrd {
        Some(i) => Some(i.open(Role::Initrd)?),
        None => None,
    };
    let mut disks = Vec::new();
    for d in &cfg.disks {
        disks.push(match &d.file {
            Some(f) => f.clone(),
            None => HostImage::Path(d.spec.path.clone()).open(Role::Disk {
                writable: !d.spec.read_only,
                direct: d.spec.direct,
            })?,
        });
    }
    Ok(OpenFiles {
        kernel,
        initrd,
        disks,
    })
}

/// Checks a configuration without creating anything; the checks a user
/// expects before anything starts. Opens (and so locks, until they are
/// dropped) its files.
pub fn validate(cfg: &VmConfig, kvm: &Kvm) -> Result<OpenFiles, VmError> {
    let files = open_files(cfg)?;
    check(cfg, &files, kvm)?;
    Ok(files)
}

fn check(cfg: &VmConfig, files: &OpenFiles, kvm: &Kvm) -> Result<(), VmError> {
    if cfg.vcpus == 0 {
        return Err(VmError::Config("a VM needs at least 1 vCPU".into()));
    }
    let max = max_vcpus(kvm);
    if usize::from(cfg.vcpus) > max {
        return Err(VmError::Config(format!(
            "{} vCPUs requested, but KVM on this host allows at most {max} per VM",
            cfg.vcpus
        )));
    }
    if cfg.memory_mib < layout::MIN_MEMORY_MIB {
        return Err(VmError::Config(format!(
            "{} MiB of memory is too small; the minimum is {} MiB",
            cfg.memory_mib,
            layout::MIN_MEMORY_MIB
        )));
    }
    if let Some(host) = host_memory_mib()
        && cfg.memory_mib > host
    {
        return Err(VmError::Config(format!(
            "{} MiB of memory requested, but the host has only {host} MiB",
            cfg.memory_mib
        )));
    }
    if cfg.cmdline.len() > layout::CMDLINE_MAX || cfg.cmdline.contains('\0') {
        return Err(VmError::Config(format!(
            "the kernel command line must be at most {} bytes without NUL",
            layout::CMDLINE_MAX
        )));
    }
    match (&files.kernel, &cfg.kernel) {
        (Some(k), _) => {
            let path = k.path().display().to_string();
            let mut f = k
                .try_clone_file()
                .map_err(|err| loader::LoadError::KernelIo {
                    path: path.clone(),
                    err,
                })?;
            loader::probe_kernel(&mut f, &path)?;
        }
        (None, KernelSource::Bytes(b)) => {
            loader::probe_kernel(&mut Cursor::new(&b[..]), "built-in probe")?;
        }
        (None, _) => return Err(VmError::Config("the kernel is not open".into())),
    }
    if cfg.disks.len() > VIRTIO_IRQS.len() {
        return Err(VmError::Config(format!(
            "{} disks requested; at most {} per VM",
            cfg.disks.len(),
            VIRTIO_IRQS.len()
        )));
    }
    let mut names = std::collections::HashSet::new();
    for (i, d) in cfg.disks.iter().enumerate() {
        let name = d.name(i);
        if !names.insert(name.clone()) {
            return Err(VmError::Config(format!("two disks are named {name:?}")));
        }
    }
    if let Some(f) = &files.initrd
        && f.len() >= cfg.memory_mib << 20
    {
        return Err(VmError::Config(format!(
            "initrd {} ({} bytes) is larger than guest memory",
            f.path().display(),
            f.len()
        )));
    }
    Ok(())
}

/// State shared by a VM's threads.
pub(crate) struct Shared {
    pub(crate) pio: Bus,
    pub(crate) mmio: Bus,
    pub(crate) vcpu_stats: Vec<Arc<VcpuStats>>,
    stopping: AtomicBool,
    exit: Mutex<Option<ExitReason>>,
    exit_cond: Condvar,
    /// pthread ids of the vCPU threads, for kicks.
    vcpu_pthreads: Mutex<Vec<libc::pthread_t>>,
    /// Wakes the device thread.
    wake: EventFd,
    /// Host pause/resume.
    pause_gate: Arc<Gate>,
    /// virtio-blk disks: (name, config, device).
    pub(crate) disks: Vec<(String, DiskConfig, Arc<Mutex<Block>>)>,
    /// The disks' guest-error counters (read without the device locks).
    guest_logs: Vec<Arc<GuestLog>>,
    /// Messages for the device thread.
    pub(crate) control: Mutex<std::sync::mpsc::Sender<crate::devthread::Control>>,
    /// The scheduler's gate, if the VM is scheduled by the gate backend.
    sched_gate: Option<Arc<Gate>>,
    /// Seccomp violations of the VM's threads (written by the SIGSYS handler).
    faults: VmFaults,
    /// Thread names, for exit reasons: the device thread's.
    device_thread: String,
    /// The VM's name (for the test-only fault injection).
    #[cfg(debug_assertions)]
    pub(crate) name: String,
    /// COM1, for console input from the host (`VmHandle::console_input`).
    serial: Arc<Mutex<SerialDevice>>,
    /// The ACPI sleep and event registers (the power button), with ACPI.
    acpi_pm: Option<Arc<Mutex<AcpiPm>>>,
}

impl Shared {
    /// The gates a vCPU must pass before running.
    pub(crate) fn gates(&self) -> impl Iterator<Item = &Arc<Gate>> {
        std::iter::once(&self.pause_gate).chain(self.sched_gate.iter())
    }

    /// Holds the exit-reason lock (fault injection: a panic while holding
    /// it poisons it).
    #[cfg(debug_assertions)]
    pub(crate) fn lock_exit_for_test(&self) -> std::sync::MutexGuard<'_, Option<ExitReason>> {
        lock(&self.exit)
    }

    pub(crate) fn faults(&self) -> &VmFaults {
        &self.faults
    }

    /// Turns a seccomp violation recorded by the SIGSYS handler into the
    /// VM's exit reason (cheap when there is none: one atomic load).
    pub(crate) fn check_faults(&self) {
        if let Some(v) = self.faults.violation() {
            let thread = match v.kind {
                ThreadKind::Vcpu => format!("vcpu{}", v.index),
                _ => self.device_thread.clone(),
            };
            self.set_exit(ExitReason::ThreadFault {
                thread,
                kind: v.kind,
                vcpu: (v.kind == ThreadKind::Vcpu).then_some(v.index as u8),
                fault: ThreadFault::Seccomp { syscall: v.syscall },
            });
        }
    }

    pub(crate) fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Records the first exit reason and tells every thread to stop.
    pub(crate) fn set_exit(&self, reason: ExitReason) {
        {
            let mut g = lock(&self.exit);
            if g.is_none() {
                tracing::info!("VM exit: {reason}");
                *g = Some(reason);
            }
        }
        self.stopping.store(true, Ordering::Release);
        for g in self.gates() {
            g.shutdown();
        }
        self.kick_all();
        let _ = self.wake.write(1);
        self.exit_cond.notify_all();
    }

    fn kick_all(&self) {
        let sig = vcpu::kick_signal();
        for t in lock(&self.vcpu_pthreads).iter() {
            // SAFETY: `t` is a live thread of this VM: it is only removed
            // from the list after being joined (see `VmHandle::join`).
            unsafe {
                libc::pthread_kill(*t, sig);
            }
        }
    }
}

/// A running VM.
pub struct VmHandle {
    name: String,
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    console: Arc<ConsoleLog>,
    started: Instant,
    vcpu_tids: Vec<libc::pid_t>,
    device_tid: Option<libc::pid_t>,
    /// The VM's KVM fd until [`VmHandle::try_release`] closes it.
    vm_fd: Mutex<Option<Arc<VmFd>>>,
    mem: GuestMemoryMmap,
    released: AtomicBool,
    /// Kernel, initrd and disks: open (and locked) for the VM's life.
    files: Vec<HostFile>,
}

impl std::fmt::Debug for VmHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmHandle")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl VmHandle {
    /// The VM's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its kernel, initrd and disk files (open and locked while it lives).
    pub fn files(&self) -> &[HostFile] {
        &self.files
    }

    /// Console output.
    pub fn console(&self) -> Arc<ConsoleLog> {
        self.console.clone()
    }

    /// Time since start.
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// Why the VM stopped, if it did.
    pub fn exit_reason(&self) -> Option<ExitReason> {
        self.shared.check_faults();
        lock(&self.shared.exit).clone()
    }

    /// Pauses the guest: its vCPUs leave `KVM_RUN` and wait. Returns
    /// whether the VM was running (false if already paused).
    pub fn pause(&self) -> bool {
        self.shared.pause_gate.park()
    }

    /// Resumes a paused guest. Returns whether it was paused.
    pub fn resume(&self) -> bool {
        self.shared.pause_gate.unpark()
    }

    /// Whether the host paused the guest.
    pub fn is_paused(&self) -> bool {
        self.shared.pause_gate.is_parked()
    }

    /// pthread ids of the vCPU threads (for CPU clocks); empty once joined.
    pub fn vcpu_pthreads(&self) -> Vec<libc::pthread_t> {
        lock(&self.shared.vcpu_pthreads).clone()
    }

    /// Guest-caused errors by device and kind: (device, kind, count).
    pub fn guest_errors(&self) -> Vec<(String, &'static str, u64)> {
        let mut v = Vec::new();
        for log in &self.shared.guest_logs {
            for (kind, n) in log.snapshot() {
                v.push((log.device().to_string(), kind, n));
            }
        }
        v
    }

    /// The VM's disks with their limits and counters.
    pub fn disks(&self) -> Vec<DiskInfo> {
        self.shared
            .disks
            .iter()
            .map(|(name, d, block)| {
                let mut b = lock(block);
                let capacity_bytes = b.capacity_sectors() * 512;
                let (stats, limits, group) = match b
                    .gate_mut()
                    .and_then(|g| g.as_any_mut().downcast_mut::<Throttle>())
                {
                    Some(t) => (
                        t.stats(),
                        t.limits(),
                        t.group().map(|g| g.name().to_string()),
                    ),
                    None => (
                        corral_blkthrottle::Stats::default(),
                        Limits::default(),
                        None,
                    ),
                };
                DiskInfo {
                    name: name.clone(),
                    path: d.spec.path.clone(),
                    read_only: d.spec.read_only,
                    direct: d.spec.direct,
                    capacity_bytes,
                    limits,
                    stats,
                    group,
                }
            })
            .collect()
    }

    /// Sends a disk's control message to the device thread and waits (up to
    /// 5 s) for its answer.
    fn disk_control(
        &self,
        disk: &str,
        make: impl FnOnce(
            usize,
            std::sync::mpsc::Sender<Result<(), VmError>>,
        ) -> crate::devthread::Control,
    ) -> Result<(), VmError> {
        let index = self
            .shared
            .disks
            .iter()
            .position(|(n, _, _)| n == disk)
            .ok_or_else(|| VmError::NoSuchDisk(disk.to_string()))?;
        let (tx, rx) = std::sync::mpsc::channel();
        lock(&self.shared.control)
            .send(make(index, tx))
            .map_err(|_| VmError::Config("the VM has stopped".into()))?;
        self.shared.wake_device_thread();
        rx.recv_timeout(Duration::from_secs(5))
            .map_err(|_| VmError::Config("the VM's device thread did not answer".into()))?
    }

    /// Moves a disk into a throttle group (with its weight there), or out of
    /// any; applied by the device thread between two requests.
    pub fn set_disk_group(
        &self,
        disk: &str,
        group: Option<(ThrottleGroup, u32)>,
    ) -> Result<(), VmError> {
        self.disk_control(disk, |disk, reply| crate::devthread::Control::SetGroup {
            disk,
            group,
            reply,
        })
    }

    /// Changes a disk's limits live. The device thread swaps them between two
    /// requests; queued requests and earned tokens are kept. Returns once applied.
    pub fn set_disk_limits(&self, disk: &str, limits: Limits) -> Result<(), VmError> {
        limits
            .validate()
            .map_err(|e| VmError::Config(e.to_string()))?;
        self.disk_control(disk, |disk, reply| crate::devthread::Control::SetLimits {
            disk,
            limits,
            reply,
        })
    }

    /// Presses the VM's ACPI power button (the guest decides what to do;
    /// a guest that honours it powers off through S5). `false` when the VM
    /// has no ACPI (`--no-acpi`) or has stopped.
    pub fn press_power_button(&self) -> bool {
        match &self.shared.acpi_pm {
            Some(pm) if self.exit_reason().is_none() => {
                lock(pm).press_power_button();
                true
            }
            _ => false,
        }
    }

    /// Feeds bytes to the guest's serial port as if typed; returns how many
    /// fit in its receive FIFO (the rest is for the caller to send again
    /// once the guest has read some). 0 once the VM has stopped.
    pub fn console_input(&self, data: &[u8]) -> usize {
        if self.exit_reason().is_some() {
            return 0;
        }
        lock(&self.shared.serial).enqueue_input(data)
    }

    /// Asks the VM to stop; returns at once.
    pub fn stop(&self) {
        self.shared.set_exit(ExitReason::Stopped);
    }

    /// Waits for the VM to stop, up to `timeout` (forever if `None`).
    pub fn wait(&self, timeout: Option<Duration>) -> Option<ExitReason> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut g = lock(&self.shared.exit);
        while g.is_none() {
            match deadline {
                None => {
                    g = self
                        .shared
                        .exit_cond
                        .wait(g)
                        .unwrap_or_else(|p| p.into_inner())
                }
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return None;
                    }
                    g = self
                        .shared
                        .exit_cond
                        .wait_timeout(g, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
        g.clone()
    }

    /// Stops the VM if needed and joins all its threads.
    pub fn join(&self) -> ExitReason {
        if self.exit_reason().is_none() {
            self.stop();
        }
        let threads: Vec<_> = std::mem::take(&mut *lock(&self.threads));
        // Keep kicking until every thread is out (a kick can race with a
        // thread entering KVM_RUN only before `stopping` is visible). No
        // thread is joined before all have finished, so every pthread id we
        // signal is still valid.
        while !threads.iter().all(|t| t.is_finished()) {
            self.shared.kick_all();
            std::thread::sleep(Duration::from_millis(1));
        }
        lock(&self.shared.vcpu_pthreads).clear();
        for t in threads {
            let _ = t.join();
        }
        lock(&self.shared.vcpu_pthreads).clear();
        self.console.close();
        self.exit_reason().unwrap_or(ExitReason::Stopped)
    }

    /// Frees what a stopped VM holds, without waiting: once the VM has an
    /// exit reason and all its threads have finished, joins them, closes
    /// the KVM VM fd and gives the guest's RAM back to the host
    /// (`MADV_DONTNEED`; the mapping stays until the handle is dropped, so
    /// nothing can touch freed memory). Returns whether the VM is released
    /// (true again on later calls).
    pub fn try_release(&self) -> bool {
        if self.released.load(Ordering::Acquire) {
            return true;
        }
        if self.exit_reason().is_none() || !lock(&self.threads).iter().all(|t| t.is_finished()) {
            return false;
        }
        self.join();
        lock(&self.vm_fd).take();
        for region in self.mem.iter() {
            if let Ok(host) = self.mem.get_host_address(region.start_addr()) {
                // SAFETY: the region is a live anonymous mapping owned by
                // `self.mem`; every thread that used guest memory has been
                // joined and the VM fd is closed, so no one reads it again
                // (DONTNEED only zeroes the pages).
                unsafe {
                    libc::madvise(host.cast(), region.len() as usize, libc::MADV_DONTNEED);
                }
            }
        }
        self.released.store(true, Ordering::Release);
        true
    }

    /// Whether [`VmHandle::try_release`] has released the VM.
    pub fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// Linux thread ids of the vCPU threads (for CPU accounting and cgroups).
    pub fn vcpu_tids(&self) -> &[libc::pid_t] {
        &self.vcpu_tids
    }

    /// Kernel thread id of the device thread (serves the VM's I/O).
    pub fn device_tid(&self) -> Option<libc::pid_t> {
        self.device_tid
    }

    /// Exit counters per vCPU.
    pub fn vcpu_stats(&self) -> &[Arc<VcpuStats>] {
        &self.shared.vcpu_stats
    }

    /// Unclaimed port I/O and MMIO accesses: (pio reads, pio writes, mmio reads, mmio writes).
    pub fn unknown_accesses(&self) -> (u64, u64, u64, u64) {
        let p = self.shared.pio.stats();
        let m = self.shared.mmio.stats();
        let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        (
            l(&p.unknown_reads),
            l(&p.unknown_writes),
            l(&m.unknown_reads),
            l(&m.unknown_writes),
        )
    }
}

impl Drop for VmHandle {
    fn drop(&mut self) {
        self.join();
    }
}

fn dup_stdout() -> Option<OwnedFd> {
    // SAFETY: dup of fd 1 returns a new descriptor we own, or -1.
    let fd = unsafe { libc::dup(libc::STDOUT_FILENO) };
    // SAFETY: `fd` is a fresh descriptor owned by nobody else.
    (fd >= 0).then(|| unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Creates and starts a VM.
pub fn start(cfg: &VmConfig) -> Result<VmHandle, VmError> {
    let kvm = Kvm::new().map_err(kvm_err("cannot open /dev/kvm"))?;
    let files = validate(cfg, &kvm)?;
    vcpu::install_kick_handler().map_err(io_err("installing the vCPU kick signal handler"))?;

    let vm = kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?;
    // Guest memory.
    let mem_bytes = cfg.memory_mib << 20;
    let ranges: Vec<(GuestAddress, usize)> = layout::ram_ranges(mem_bytes)
        .into_iter()
        .map(|(s, l)| (GuestAddress(s), l as usize))
        .collect();
    let mem =
        GuestMemoryMmap::<()>::from_ranges(&ranges).map_err(|e| VmError::Memory(e.to_string()))?;
    let mut regions = Vec::new();
    for (slot, region) in mem.iter().enumerate() {
        let host = mem
            .get_host_address(region.start_addr())
            .map_err(|e| VmError::Memory(e.to_string()))?;
        regions.push(kvm_userspace_memory_region {
            slot: slot as u32,
            flags: 0,
            guest_phys_addr: region.start_addr().raw_value(),
            memory_size: region.len(),
            userspace_addr: host as u64,
        });
    }
    for r in regions {
        // SAFETY: the region is a live mapping owned by `mem`, which the
        // returned VmHandle keeps alive for as long as the VM fd exists (on
        // error both are dropped, the VM fd first).
        unsafe { vm.set_user_memory_region(r) }.map_err(kvm_err("KVM_SET_USER_MEMORY_REGION"))?;
    }
    // The in-kernel irqchip comes after the memory slots: once it exists,
    // every slot change waits for an SRCU grace period (measured 4-8 ms on
    // nested KVM, against 0.05 ms before it).
    vm.set_tss_address(0xfffb_d000)
        .map_err(kvm_err("KVM_SET_TSS_ADDR"))?;
    vm.create_irq_chip()
        .map_err(kvm_err("KVM_CREATE_IRQCHIP"))?;
    vm.create_pit2(kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    })
    .map_err(kvm_err("KVM_CREATE_PIT2"))?;

    let vm = Arc::new(vm);

    // Boot payload.
    // The files opened and checked above: nothing can swap them now.
    let loaded = match (&files.kernel, &cfg.kernel) {
        (Some(k), _) => {
            let path = k.path().display().to_string();
            let mut f = k
                .try_clone_file()
                .map_err(|err| loader::LoadError::KernelIo {
                    path: path.clone(),
                    err,
                })?;
            loader::load_kernel(&mem, &mut f, &path)?
        }
        (None, KernelSource::Bytes(b)) => {
            loader::load_kernel(&mem, &mut Cursor::new(&b[..]), "built-in probe")?
        }
        (None, _) => return Err(VmError::Config("the kernel is not open".into())),
    };
    let initrd = match &files.initrd {
        Some(f) => Some(loader::load_initrd(
            &mem,
            f.file(),
            &f.path().display().to_string(),
            loader::initrd_addr_max(&loaded),
            loaded.kernel_end,
        )?),
        None => None,
    };
    // virtio-mmio disks: a 4 KiB window and an ISA IRQ each, announced on
    // the command line (for kernels that read it, and the probe) and in the
    // ACPI DSDT.
    let mut cmdline = cfg.cmdline.clone();
    let mut windows = Vec::new();
    let mut blocks = Vec::new();
    for (i, d) in cfg.disks.iter().enumerate() {
        let name = d.name(i);
        let irq = VIRTIO_IRQS[i];
        let base = layout::VIRTIO_MMIO_BASE + i as u64 * MMIO_WINDOW_SIZE;
        let disk_err = |e: &dyn std::fmt::Display| VmError::Disk {
            name: name.clone(),
            msg: e.to_string(),
        };
        let file = files
            .disks
            .get(i)
            .ok_or_else(|| disk_err(&"not open"))?
            .try_clone_file()
            .map_err(|e| disk_err(&e))?;
        let disk = DiskFile::from_file(file, d.spec.read_only, d.spec.direct)
            .map_err(|e| disk_err(&format!("{}: {e}", d.spec.path.display())))?;
        let mut block = Block::new(
            disk,
            BlockOptions {
                serial: d.spec.id.clone().unwrap_or_default(),
            },
        )
        .map_err(|e| disk_err(&e))?;
        let log = Arc::new(GuestLog::new(name.clone()));
        log.set_vm(&cfg.name);
        block.set_guest_log(log);
        let now = corral_devices::virtio::blk::gate::monotonic_ns();
        if !d.limits.is_unlimited() || d.group.is_some() {
            let mut t = Throttle::new(&d.limits, now).map_err(|e| VmError::Disk {
                name: name.clone(),
                msg: e.to_string(),
            })?;
            if let Some((g, w)) = &d.group {
                t.join_group(g, *w, None).map_err(|e| VmError::Disk {
                    name: name.clone(),
                    msg: e.to_string(),
                })?;
            }
            block.set_gate(Some(Box::new(t)));
        }
        if !cmdline.is_empty() {
            cmdline.push(' ');
        }
        cmdline.push_str(&MmioTransport::cmdline_arg(base, irq));
        windows.push(acpi::VirtioMmioWindow {
            base,
            size: MMIO_WINDOW_SIZE as u32,
            irq,
        });
        blocks.push((name, d.clone(), base, irq, Arc::new(Mutex::new(block))));
    }
    if cmdline.len() > layout::CMDLINE_MAX {
        return Err(VmError::Config(
            "the kernel command line with the virtio-mmio announcements is too long".into(),
        ));
    }
    loader::write_cmdline(&mem, &cmdline)?;
    mptable::write(&mem, cfg.vcpus)?;
    let rsdp = if cfg.acpi {
        Some(acpi::write(
            &mem,
            &acpi::AcpiParams {
                cpus: cfg.vcpus,
                virtio_mmio: windows,
                serial: true,
            },
        )?)
    } else {
        None
    };
    loader::write_boot_params(&mem, mem_bytes, &loaded, cmdline.len(), initrd, rsdp)?;
    boot::write_tables(&mem)?;

    // Devices.
    let console = ConsoleLog::new(cfg.console_log_bytes);
    let serial_irq = EventFd::new(EFD_NONBLOCK).map_err(io_err("eventfd"))?;
    vm.register_irqfd(&serial_irq, 4)
        .map_err(kvm_err("KVM_IRQFD (serial)"))?;
    let out_fd = if cfg.console_stdout {
        dup_stdout()
    } else {
        None
    };
    let serial = Arc::new(Mutex::new(SerialDevice::new(
        serial_irq,
        out_fd,
        console.clone(),
    )));
    let wake = EventFd::new(EFD_NONBLOCK).map_err(io_err("eventfd"))?;
    let wake_fd = wake.as_raw_fd();
    let mut pio = Bus::new();
    pio.insert(0x3f8, 8, serial.clone())
        .map_err(|e| VmError::Config(e.to_string()))?;
    let mut mmio = Bus::new();
    let mut disks = Vec::new();
    for (name, d, base, irq, block) in blocks {
        let dev_err = |msg: String| VmError::Disk {
            name: name.clone(),
            msg,
        };
        let irqfd = EventFd::new(EFD_NONBLOCK).map_err(io_err("eventfd"))?;
        vm.register_irqfd(&irqfd, irq)
            .map_err(kvm_err("KVM_IRQFD (virtio)"))?;
        let dev: Arc<Mutex<dyn VirtioDevice>> = block.clone();
        let transport =
            MmioTransport::new(mem.clone(), dev, irqfd).map_err(|e| dev_err(e.to_string()))?;
        for (q, evt) in transport.queue_events().iter().enumerate() {
            vm.register_ioevent(evt, &IoEventAddress::Mmio(base + QUEUE_NOTIFY), q as u32)
                .map_err(kvm_err("KVM_IOEVENTFD"))?;
        }
        mmio.insert(base, MMIO_WINDOW_SIZE, Arc::new(Mutex::new(transport)))
            .map_err(|e| dev_err(e.to_string()))?;
        disks.push((name, d, block));
    }

    let shared_slot: Arc<Mutex<Option<std::sync::Weak<Shared>>>> = Arc::new(Mutex::new(None));
    let reset_target = shared_slot.clone();
    let i8042 = I8042::new(Box::new(move || {
        if let Some(s) = lock(&reset_target).as_ref().and_then(|w| w.upgrade()) {
            s.set_exit(ExitReason::GuestShutdown);
        }
    }));
    pio.insert(0x60, 5, Arc::new(Mutex::new(i8042)))
        .map_err(|e| VmError::Config(e.to_string()))?;
    let mut acpi_dev = None;
    if cfg.acpi {
        let pm_target = shared_slot.clone();
        // The power button's event device interrupt (see acpi::GED_IRQ).
        let ged_irq = EventFd::new(EFD_NONBLOCK).map_err(io_err("eventfd"))?;
        vm.register_irqfd(&ged_irq, crate::acpi::GED_IRQ)
            .map_err(kvm_err("KVM_IRQFD (GED)"))?;
        let pm = AcpiPm::with_events(
            Box::new(move || {
                if let Some(s) = lock(&pm_target).as_ref().and_then(|w| w.upgrade()) {
                    // S5 is a clean stop, like the i8042 reset.
                    s.set_exit(ExitReason::GuestShutdown);
                }
            }),
            Box::new(move || {
                let _ = ged_irq.write(1);
            }),
        );
        let pm = Arc::new(Mutex::new(pm));
        pio.insert(
            u64::from(acpi_pm::PORT_BASE),
            u64::from(acpi_pm::PORT_LEN),
            pm.clone(),
        )
        .map_err(|e| VmError::Config(e.to_string()))?;
        acpi_dev = Some(pm);
    }

    let (control_tx, control_rx) = std::sync::mpsc::channel();
    let shared = Arc::new(Shared {
        pio,
        mmio,
        vcpu_stats: (0..cfg.vcpus)
            .map(|_| Arc::new(VcpuStats::default()))
            .collect(),
        stopping: AtomicBool::new(false),
        exit: Mutex::new(None),
        exit_cond: Condvar::new(),
        vcpu_pthreads: Mutex::new(Vec::new()),
        wake,
        pause_gate: Arc::new(Gate::new()),
        sched_gate: cfg.sched_gate.clone(),
        guest_logs: disks.iter().map(|(_, _, b)| lock(b).guest_log()).collect(),
        disks,
        control: Mutex::new(control_tx),
        faults: VmFaults::new(wake_fd),
        device_thread: format!("dev-{}", cfg.name),
        #[cfg(debug_assertions)]
        name: cfg.name.clone(),
        serial: serial.clone(),
        acpi_pm: acpi_dev,
    });
    *lock(&shared_slot) = Some(Arc::downgrade(&shared));
    for g in shared.gates() {
        let w = Arc::downgrade(&shared);
        g.set_kick(move || {
            if let Some(s) = w.upgrade() {
                s.kick_all();
            }
        });
    }

    // vCPUs.
    let supported = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("KVM_GET_SUPPORTED_CPUID"))?;
    let mut vcpus: Vec<VcpuFd> = Vec::with_capacity(cfg.vcpus.into());
    let mut tsc_khz = None;
    for i in 0..cfg.vcpus {
        let v = vm
            .create_vcpu(u64::from(i))
            .map_err(kvm_err("KVM_CREATE_VCPU"))?;
        if i == 0 {
            tsc_khz = v.get_tsc_khz().ok().filter(|k| *k > 0);
        }
        let mut c = supported.clone();
        cpuid::fixup(&mut c, i, cfg.vcpus, tsc_khz);
        v.set_cpuid2(&c).map_err(kvm_err("KVM_SET_CPUID2"))?;
        boot::setup_common(&v)?;
        if i == 0 {
            boot::setup_boot_cpu(&v, loaded.entry)?;
        }
        vcpus.push(v);
    }

    let mut threads = Vec::new();
    let mut vcpu_tids = vec![0; cfg.vcpus.into()];
    for (i, v) in vcpus.into_iter().enumerate() {
        let (tx, rx) = std::sync::mpsc::channel();
        let t = crate::vmthread::spawn(
            format!("vcpu{i}"),
            ThreadKind::Vcpu,
            i as u16,
            shared.clone(),
            tx,
            move |sh| vcpu::run(v, i as u8, sh),
        );
        match t {
            Ok(t) => {
                lock(&shared.vcpu_pthreads).push(t.as_pthread_t());
                threads.push(t);
                // Each thread sends its tid first thing.
                if let Ok(tid) = rx.recv() {
                    vcpu_tids[i] = tid;
                }
            }
            Err(e) => {
                shared.set_exit(ExitReason::Stopped);
                for t in threads {
                    let _ = t.join();
                }
                return Err(VmError::Io {
                    what: "spawning a vCPU thread",
                    err: e,
                });
            }
        }
    }

    // Device thread: host stdin to the serial port, wake-ups.
    let stdin = cfg.console_stdin;
    let (dtid_tx, dtid_rx) = std::sync::mpsc::channel();
    let dev = crate::vmthread::spawn(
        shared.device_thread.clone(),
        ThreadKind::Device,
        0,
        shared.clone(),
        dtid_tx,
        move |sh| crate::devthread::run(sh, serial, stdin, control_rx),
    )
    .map_err(io_err("spawning the device thread"))?;
    threads.push(dev);
    let device_tid = dtid_rx.recv().ok();

    Ok(VmHandle {
        name: cfg.name.clone(),
        shared,
        threads: Mutex::new(threads),
        console,
        started: Instant::now(),
        vcpu_tids,
        device_tid,
        vm_fd: Mutex::new(Some(vm)),
        mem,
        released: AtomicBool::new(false),
        files: files.all().cloned().collect(),
    })
}

impl Shared {
    pub(crate) fn wake_fd(&self) -> i32 {
        self.wake.as_raw_fd()
    }

    pub(crate) fn wake_device_thread(&self) {
        let _ = self.wake.write(1);
    }

    pub(crate) fn clear_wake(&self) {
        let _ = self.wake.read();
    }
}

#[allow(dead_code)]
fn _assert_send() {
    fn s<T: Send + Sync>() {}
    s::<Shared>();
}
