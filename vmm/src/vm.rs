//! One VM: its configuration ([`VmConfig`], [`DiskConfig`]) and its disks' status ([`DiskStatus`]), why it stopped
//! ([`ExitReason`]), its errors, and the checks made before anything is
//! created ([`validate`]). [`crate::builder::start`] builds and starts it;
//! [`crate::handle::VmHandle`] is the running VM.

use std::io::Cursor;
use std::path::PathBuf;
use std::sync::Arc;

use corral_blkthrottle::{Limits, ThrottleGroup};
use corral_devices::virtio::blk::{BlockStatsSnapshot, DiskSpec, IoEngine};
use corral_scheduler::gate::Gate;
use kvm_ioctls::Kvm;

use crate::hostfile::{HostFile, HostFileError, HostImage, Role};
use crate::seccomp::ThreadKind;
use crate::{acpi, boot, layout, loader, mptable};

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
    /// virtio-blk disks, in order (the guest's vda, vdb, ...).
    pub disks: Vec<DiskConfig>,
    /// Give the guest ACPI tables (MADT, DSDT with the virtio-mmio devices,
    /// S5 power-off). Off: MP table and command-line announcement only.
    pub acpi: bool,
}

/// One virtio-blk disk of a VM: the one disk configuration type of the
/// VMM. The CLI's `--disk` grammar is parsed by the devices' `DiskSpec`
/// ([`DiskConfig::parse`]); the daemon's requests are
/// [`crate::daemon::manager::DiskRequest`]s, which name their disks and carry the
/// API's limits.
#[derive(Debug, Clone)]
pub struct DiskConfig {
    /// Name within the VM, also its serial number; `None`: `disk0`,
    /// `disk1`, ... by position ([`disk_name`]), and no serial.
    pub id: Option<String>,
    /// Backing file or block device.
    pub path: PathBuf,
    /// Refuse writes.
    pub read_only: bool,
    /// Open with `O_DIRECT`.
    pub direct: bool,
    /// I/O engine (`engine=`); `None`: io_uring where the kernel supports
    /// it, else sync.
    pub engine: Option<IoEngine>,
    /// The disk's own limits.
    pub limits: Limits,
    /// A shared limit (per class or named), if any, and this disk's weight in it.
    pub group: Option<(ThrottleGroup, u32)>,
    /// The backing file, already opened (and locked) under a host-path
    /// policy; `None`: [`crate::builder::start`] opens `path` itself.
    pub file: Option<HostFile>,
}

impl DiskConfig {
    /// Parses the CLI form `PATH[,readonly][,direct][,id=NAME][,bps=N,...]`.
    pub fn parse(s: &str) -> Result<Self, VmError> {
        let spec = DiskSpec::parse(s).map_err(|e| VmError::Config(format!("--disk {s}: {e}")))?;
        Ok(Self {
            id: spec.id,
            path: spec.path,
            read_only: spec.read_only,
            direct: spec.direct,
            engine: spec.engine,
            limits: spec.limits,
            group: None,
            file: None,
        })
    }

    /// The disk's name: its `id`, else [`disk_name`] of its position.
    pub fn name(&self, index: usize) -> String {
        self.id.clone().unwrap_or_else(|| disk_name(index))
    }
}

/// The default name of the disk at `index` (0-based) when it is given no
/// id: `disk0`, `disk1`, ..., in `corral run` and in the manager alike (the
/// manager stores it as the disk's id, so state files name every disk).
pub fn disk_name(index: usize) -> String {
    format!("disk{index}")
}

/// IRQs (ISA pins, routed by the MP table and the ACPI DSDT alike) for
/// virtio-mmio devices: 4 is COM1, 8 the RTC, 13 the FPU.
pub const VIRTIO_IRQS: [u32; 9] = [5, 6, 7, 9, 10, 11, 12, 14, 15];

/// Most disks per VM: one virtio-mmio device, so one IRQ of
/// [`VIRTIO_IRQS`], each. The manager and `api/openapi.yaml` (`maxItems` of
/// a VM's `disks`) use this figure; a test checks the spec.
pub const MAX_DISKS: usize = VIRTIO_IRQS.len();

/// Counters and limits of one disk of a running VM, for the API and metrics.
#[derive(Debug, Clone)]
pub struct DiskStatus {
    /// Name.
    pub name: String,
    /// Backing file.
    pub path: PathBuf,
    /// Read-only.
    pub read_only: bool,
    /// O_DIRECT.
    pub direct: bool,
    /// The engine serving it (the requested one, or the default chosen).
    pub engine: IoEngine,
    /// Size in bytes.
    pub capacity_bytes: u64,
    /// The disk's own limits.
    pub limits: Limits,
    /// Throttle counters (ops, bytes, throttled, latency); zero while the
    /// disk never had a throttle.
    pub stats: corral_blkthrottle::Stats,
    /// The device's counters (completed requests, I/O errors, malformed
    /// requests, broken rings, ...).
    pub device: BlockStatsSnapshot,
    /// The throttle group the disk is in now, if any.
    pub group: Option<String>,
    /// The disk's weight in that group (its VM's weight), if it is in one.
    pub group_weight: Option<u32>,
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
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExitReason {
    /// The guest shut down or reset itself (i8042 reset, ACPI S5, KVM system event).
    GuestShutdown,
    /// Stopped on request from the host.
    Stopped,
    /// Defined in the daemon's state file but not run since the daemon
    /// (re)started: `start` runs it.
    DaemonRestarted,
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
    /// The VM's process (`corral vmm`) ended without reporting how the VM
    /// ended: killed, or crashed.
    ProcessGone {
        /// Its pid.
        pid: u32,
        /// How it ended, if known (`killed by signal 9`).
        how: String,
    },
    /// A restarted daemon found the VM's process running but did not adopt
    /// it (it speaks another version of the VM-process protocol): the
    /// process runs on unsupervised, its shares not enforced, its last
    /// limits holding, until a daemon that speaks its version adopts it.
    NotAdopted {
        /// Its pid (as the state file recorded it).
        pid: u32,
        /// Its run's identity (kept in the state file for that daemon).
        nonce: String,
        /// Why (both protocol versions).
        why: String,
    },
}

/// How a VM's thread failed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
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
            Self::DaemonRestarted => write!(
                f,
                "not running since the daemon restarted (its definition was reloaded from the \
                 state directory); start runs it again"
            ),
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
            Self::ProcessGone { pid, how } => {
                write!(
                    f,
                    "the VM's process (pid {pid}) ended without the VM stopping: {how}"
                )
            }
            Self::NotAdopted { pid, why, .. } => {
                write!(
                    f,
                    "the VM's process (pid {pid}) runs but was not adopted: {why}"
                )
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
    /// The VM has stopped: its disks cannot change (HTTP 409).
    #[error("VM {0:?} has stopped; its disks cannot change")]
    Stopped(String),
    /// The VM's device thread did not answer a control message in time
    /// (HTTP 503); the change may still apply later.
    #[error("VM {vm:?}: its device thread did not answer within {ms} ms")]
    DeviceUnresponsive {
        /// The VM.
        vm: String,
        /// How long the caller waited.
        ms: u64,
    },
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
    pub(crate) fn all(&self) -> impl Iterator<Item = &HostFile> {
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
            None => HostImage::Path(d.path.clone()).open(Role::Disk {
                writable: !d.read_only,
                direct: d.direct,
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
    if cfg.disks.len() > MAX_DISKS {
        return Err(VmError::Config(format!(
            "{} disks requested; at most {MAX_DISKS} per VM",
            cfg.disks.len(),
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
