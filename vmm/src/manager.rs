//! The multi-VM manager: the one object the daemon's control plane talks to.
//!
//! A [`Manager`] hosts many VMs (each a [`VmHandle`] with its own threads),
//! keeps the resource classes and VM placement in a
//! [`corral_scheduler::Scheduler`] (whose model does validation and admission
//! control for classes), and answers snapshots for the REST API and metrics.
//!
//! It is synchronous and thread-safe: every method takes `&self`. Methods
//! that start or stop VMs ([`Manager::create_vm`], [`Manager::delete_vm`],
//! [`Manager::shutdown`]) block for milliseconds; async callers run them on a
//! blocking pool. Locks are never held while a VM starts or stops.
//!
//! Lock order: the manager's state, then the scheduler. The scheduler thread
//! (which ticks [`Manager::scheduler`]) must not take the manager's state
//! lock while holding the scheduler's; it gets its inputs from
//! [`Manager::sched_vms`] first.

mod lifecycle;
pub use lifecycle::MAX_SHUTDOWN_TIMEOUT;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use crate::util::lock;
use corral_devices::ConsoleLog;
use corral_scheduler::model::ErrorKind as ModelErrorKind;
use corral_scheduler::{
    Capacity, ClassSpec, ModelError, PolicyConfig, Scheduler, Stats, VmId, VmSpec,
};

use crate::cgroup::CgroupBackend;
use crate::cpusched::CpuScheduler;
use crate::handle::VmHandle;
use crate::hostfile::{HostFileError, HostImage, HostPolicy};
use crate::images::ImageBook;
use crate::vm::{ExitReason, KernelSource, VmConfig, VmError};
use corral_blkthrottle::ThrottleGroup;
use corral_scheduler::Gate;

/// The class of VMs created without one; it cannot be deleted.
pub const DEFAULT_CLASS: &str = "default";
/// Default kernel command line when a kernel file is given without one.
pub const DEFAULT_LINUX_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1";
/// Longest VM, disk or group name, in bytes.
pub const MAX_NAME_LEN: usize = 64;
/// Most disks per VM.
pub const MAX_DISKS: usize = 16;
/// Most vCPUs per VM accepted by the manager (KVM may allow fewer).
pub const MAX_VM_VCPUS: u32 = 254;
/// Most classes by default (`--max-classes`).
pub const DEFAULT_MAX_CLASSES: usize = 1024;

/// What kind of failure an error is; the API maps it to an HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Bad input (400).
    Invalid,
    /// Unknown VM, class or disk (404).
    NotFound,
    /// Conflicts with the current state: duplicate name, class in use (409).
    Conflict,
    /// Refused by admission control or resource limits (422).
    Refused,
    /// The host failed (500).
    Internal,
}

/// Errors of the manager.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    /// Bad input.
    #[error("{0}")]
    Invalid(String),
    /// Something named does not exist.
    #[error("{0}")]
    NotFound(String),
    /// Conflicts with the current state.
    #[error("{0}")]
    Conflict(String),
    /// Refused by admission control or a resource limit.
    #[error("{0}")]
    Refused(String),
    /// The scheduler model refused.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The VM could not be started.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// A kernel, initrd or disk is refused by the host-path policy, locked
    /// by another user, or cannot be opened.
    #[error(transparent)]
    HostFile(#[from] HostFileError),
    /// The manager is shutting down.
    #[error("the daemon is shutting down")]
    ShuttingDown,
}

impl ManagerError {
    /// The kind, for the HTTP status.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Invalid(_) => ErrorKind::Invalid,
            Self::NotFound(_) => ErrorKind::NotFound,
            Self::Conflict(_) => ErrorKind::Conflict,
            Self::Refused(_) => ErrorKind::Refused,
            Self::ShuttingDown => ErrorKind::Conflict,
            Self::Model(m) => match m.kind() {
                ModelErrorKind::Invalid => ErrorKind::Invalid,
                ModelErrorKind::NotFound => ErrorKind::NotFound,
                ModelErrorKind::Conflict => ErrorKind::Conflict,
                ModelErrorKind::Refused => ErrorKind::Refused,
            },
            Self::HostFile(h) => host_file_kind(h),
            Self::Vm(v) => match v {
                VmError::HostFile(h) => host_file_kind(h),
                VmError::Config(_) | VmError::Load(_) | VmError::Disk { .. } => ErrorKind::Invalid,
                VmError::NoSuchDisk(_) => ErrorKind::NotFound,
                VmError::Memory(_) => ErrorKind::Refused,
                VmError::Acpi(_) => ErrorKind::Invalid,
                VmError::Kvm { .. }
                | VmError::Boot(_)
                | VmError::MpTable(_)
                | VmError::Io { .. } => ErrorKind::Internal,
            },
        }
    }
}

impl ManagerError {
    /// A more specific API error code than the kind's, if any:
    /// `path_policy` (400) and `image_locked` (409).
    pub fn code(&self) -> Option<&'static str> {
        let h = match self {
            Self::HostFile(h) | Self::Vm(VmError::HostFile(h)) => h,
            _ => return None,
        };
        match h {
            HostFileError::Policy { .. } => Some("path_policy"),
            HostFileError::Locked { .. } => Some("image_locked"),
            HostFileError::Io { .. } => None,
        }
    }
}

fn host_file_kind(h: &HostFileError) -> ErrorKind {
    match h {
        HostFileError::Locked { .. } => ErrorKind::Conflict,
        HostFileError::Policy { .. } | HostFileError::Io { .. } => ErrorKind::Invalid,
    }
}

/// The default guest memory budget: host memory less what the host keeps,
/// at least 10 % of it or 1 GiB, whichever is larger.
pub fn default_memory_budget_mib(host_mib: u64) -> u64 {
    host_mib.saturating_sub((host_mib / 10).max(1024))
}

/// Throttle limits of a disk or an I/O group. `None` (or 0) = no limit.
/// Same meaning as `corral_blkthrottle::Limits`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoLimits {
    /// Total bytes per second.
    pub bps: Option<u64>,
    /// Total operations per second.
    pub iops: Option<u64>,
    /// Read bytes per second.
    pub rbps: Option<u64>,
    /// Write bytes per second.
    pub wbps: Option<u64>,
    /// Read operations per second.
    pub riops: Option<u64>,
    /// Write operations per second.
    pub wiops: Option<u64>,
    /// Bucket size of the byte buckets.
    pub burst_bytes: Option<u64>,
    /// Bucket size of the op buckets.
    pub burst_ops: Option<u64>,
}

impl IoLimits {
    /// Checks that every burst belongs to a rate of its unit.
    pub fn validate(&self) -> Result<(), ManagerError> {
        let nz = |v: Option<u64>| v.is_some_and(|x| x != 0);
        let bytes = nz(self.bps) || nz(self.rbps) || nz(self.wbps);
        let ops = nz(self.iops) || nz(self.riops) || nz(self.wiops);
        if nz(self.burst_bytes) && !bytes {
            return Err(ManagerError::Invalid(
                "burst_bytes is set but none of bps, rbps, wbps is".into(),
            ));
        }
        if nz(self.burst_ops) && !ops {
            return Err(ManagerError::Invalid(
                "burst_ops is set but none of iops, riops, wiops is".into(),
            ));
        }
        Ok(())
    }

    /// The throttle crate's form.
    pub fn to_blk(&self) -> corral_blkthrottle::Limits {
        corral_blkthrottle::Limits {
            bps: self.bps,
            iops: self.iops,
            rbps: self.rbps,
            wbps: self.wbps,
            riops: self.riops,
            wiops: self.wiops,
            burst_bytes: self.burst_bytes,
            burst_ops: self.burst_ops,
            onetime_bytes: None,
            onetime_ops: None,
        }
    }

    /// True if no rate is limited.
    pub fn is_unlimited(&self) -> bool {
        [
            self.bps, self.iops, self.rbps, self.wbps, self.riops, self.wiops,
        ]
        .iter()
        .all(|v| v.unwrap_or(0) == 0)
    }
}

/// A class as the operator configures it: CPU settings plus the I/O limits
/// of the class's throttle group (shared by all disks of its VMs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClassConfig {
    /// CPU shares, cap, reservation.
    pub cpu: ClassSpec,
    /// Limits of the class's I/O group.
    pub io: IoLimits,
}

/// One disk of a VM, as requested.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskConfig {
    /// Name within the VM (`disk0`, `disk1`, ... when not given).
    pub id: String,
    /// Backing file or block device.
    pub path: PathBuf,
    /// Read-only.
    pub readonly: bool,
    /// O_DIRECT.
    pub direct: bool,
    /// The disk's own limits.
    pub limits: IoLimits,
}

/// A VM as requested.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmRequest {
    /// Unique name; assigned (`vm-N`) when `None`.
    pub name: Option<String>,
    /// Class name.
    pub class: String,
    /// Weight inside the class (1..=10000).
    pub weight: u32,
    /// The VM's own CPU cap, percent of one CPU (`None` = only its class's).
    pub cap: Option<u32>,
    /// vCPUs.
    pub vcpus: u32,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// Kernel file; `None` = the built-in probe guest.
    pub kernel: Option<PathBuf>,
    /// Initial ramdisk.
    pub initrd: Option<PathBuf>,
    /// Kernel command line; default depends on the kernel.
    pub cmdline: Option<String>,
    /// Disks.
    pub disks: Vec<DiskConfig>,
}

impl Default for VmRequest {
    fn default() -> Self {
        Self {
            name: None,
            class: "default".into(),
            weight: corral_scheduler::model::DEFAULT_WEIGHT,
            cap: None,
            vcpus: 1,
            memory_mib: 128,
            kernel: None,
            initrd: None,
            cmdline: None,
            disks: Vec::new(),
        }
    }
}

/// Settings of the manager.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// CPU capacity; `None` = the process's CPU affinity.
    pub capacity: Option<Capacity>,
    /// Scheduler tick and period.
    pub policy: PolicyConfig,
    /// Most VMs at once.
    pub max_vms: usize,
    /// Most vCPUs over all VMs.
    pub max_total_vcpus: u32,
    /// Most guest memory over all VMs, MiB; `None` =
    /// [`default_memory_budget_mib`] of the host's memory.
    pub memory_budget_mib: Option<u64>,
    /// Most classes.
    pub max_classes: usize,
    /// Which kernels, initrds and disks may be opened (the daemon: beneath
    /// its image directories; default: any, with the caller's rights).
    pub host_files: HostPolicy,
    /// The built-in guest image used when a VM names no kernel.
    pub builtin_kernel: Option<Arc<[u8]>>,
    /// Classes created at start (e.g. `default`).
    pub initial_classes: Vec<(String, ClassConfig)>,
    /// Console bytes kept per VM.
    pub console_log_bytes: usize,
    /// How CPU shares are enforced.
    pub cpu_backend: CpuBackend,
}

/// How the manager enforces CPU shares, caps and reservations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpuBackend {
    /// corral's scheduler thread parks and unparks VMs (default).
    #[default]
    Gate,
    /// Linux cgroups (cpu.weight / cpu.max, or cpu.shares / cfs quota);
    /// reservations are admission-checked but not enforced.
    Cgroup,
    /// Nothing: the host scheduler alone (for comparisons).
    None,
}

impl std::str::FromStr for CpuBackend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "gate" => Ok(Self::Gate),
            "cgroup" => Ok(Self::Cgroup),
            "none" => Ok(Self::None),
            o => Err(format!("unknown CPU backend {o:?} (gate, cgroup, none)")),
        }
    }
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self {
            capacity: None,
            policy: PolicyConfig::default(),
            max_vms: 256,
            max_total_vcpus: 1024,
            memory_budget_mib: None,
            max_classes: DEFAULT_MAX_CLASSES,
            host_files: HostPolicy::unrestricted(),
            builtin_kernel: None,
            initial_classes: vec![("default".into(), ClassConfig::default())],
            console_log_bytes: 256 * 1024,
            cpu_backend: CpuBackend::Gate,
        }
    }
}

/// Lifecycle state of a VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmState {
    /// vCPUs running (or runnable).
    Running,
    /// Paused by the operator.
    Paused,
    /// The guest shut itself down.
    Shutdown,
    /// Stopped by the host.
    Stopped,
    /// A fatal guest or VMM error stopped it.
    Failed,
}

impl VmState {
    /// Lower-case name, as the API shows it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Paused => "paused",
            Self::Shutdown => "shutdown",
            Self::Stopped => "stopped",
            Self::Failed => "failed",
        }
    }
}

/// Scheduler figures of one VM (present once the scheduler thread ticks).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SchedFigures {
    /// Entitlement, percent of one CPU.
    pub entitlement_pct: f64,
    /// Use, percent of one CPU, averaged over about one period.
    pub used_pct: f64,
    /// Currently parked.
    pub parked: bool,
    /// Total time parked.
    pub parked_secs: f64,
    /// Times parked.
    pub park_count: u64,
}

/// A disk as the manager holds it.
#[derive(Debug, Clone)]
pub struct DiskInfo {
    /// The configuration (limits are the current ones).
    pub config: DiskConfig,
    /// Size in bytes (0 if unknown).
    pub capacity_bytes: u64,
    /// Throttle counters, when the VM has the disk attached.
    pub stats: Option<corral_blkthrottle::Stats>,
    /// The I/O group the disk is in now (`class:<its VM's class>`), when
    /// the VM has the disk attached.
    pub group: Option<String>,
}

/// Snapshot of one VM.
#[derive(Debug, Clone)]
pub struct VmInfo {
    /// Name (the API's id).
    pub name: String,
    /// Numeric id (the scheduler's).
    pub id: u64,
    /// State.
    pub state: VmState,
    /// Exit reason when stopped.
    pub exit: Option<ExitReason>,
    /// Class.
    pub class: String,
    /// Weight in the class.
    pub weight: u32,
    /// The VM's own CPU cap, percent of one CPU.
    pub cap: Option<u32>,
    /// vCPUs.
    pub vcpus: u32,
    /// Memory, MiB.
    pub memory_mib: u64,
    /// Kernel file (`None` = built-in probe).
    pub kernel: Option<PathBuf>,
    /// Initrd.
    pub initrd: Option<PathBuf>,
    /// Command line in use.
    pub cmdline: String,
    /// Disks.
    pub disks: Vec<DiskInfo>,
    /// Creation time.
    pub created: SystemTime,
    /// Time since start while running; `None` once stopped.
    pub uptime: Option<Duration>,
    /// CPU time of all its vCPU threads.
    pub cpu_secs: f64,
    /// vCPU exits by reason, summed over vCPUs.
    pub exits: Vec<(&'static str, u64)>,
    /// Guest-caused device errors: (device, kind, count).
    pub guest_errors: Vec<(String, &'static str, u64)>,
    /// Scheduler figures, when the scheduler runs.
    pub sched: Option<SchedFigures>,
}

/// Snapshot of one class.
#[derive(Debug, Clone)]
pub struct ClassInfo {
    /// Name.
    pub name: String,
    /// Parent class, for a class in a tree.
    pub parent: Option<String>,
    /// Child classes, by name.
    pub children: Vec<String>,
    /// Configuration.
    pub config: ClassConfig,
    /// VMs in it.
    pub vms: Vec<String>,
    /// CPU time of its current VMs.
    pub cpu_secs: f64,
    /// Entitlement and use (percent of one CPU) when the scheduler runs.
    pub entitlement_pct: Option<f64>,
    /// Use, percent of one CPU, when the scheduler runs.
    pub used_pct: Option<f64>,
}

/// Host-wide figures.
#[derive(Debug, Clone)]
pub struct HostInfo {
    /// CPU capacity, percent of one CPU.
    pub capacity_pct: u64,
    /// Sum of reservations.
    pub reserved_pct: u64,
    /// VMs hosted (any state).
    pub vms: usize,
    /// VMs running.
    pub running_vms: usize,
    /// Most VMs.
    pub max_vms: usize,
    /// Guest memory in use, MiB.
    pub memory_mib: u64,
    /// Guest memory budget, MiB.
    pub memory_budget_mib: u64,
    /// vCPUs in use.
    pub vcpus: u32,
    /// Scheduler ticks so far (0 = no scheduler thread running).
    pub sched_ticks: u64,
    /// CPU the scheduler plans with: capacity less steal and the load of
    /// other processes, percent of one CPU.
    pub available_pct: f64,
    /// CPU used by everything but corral's VMs (averaged), percent.
    pub outside_pct: f64,
    /// CPU lost to steal, percent.
    pub steal_pct: f64,
    /// Fraction of the reservations claimed now that the available CPU
    /// cannot deliver (0 = all honoured).
    pub shortfall_ratio: f64,
}

/// What the scheduler thread needs of one VM.
#[derive(Debug, Clone)]
pub struct SchedVm {
    /// Scheduler id.
    pub id: VmId,
    /// Name.
    pub name: String,
    /// Class.
    pub class: String,
    /// Weight.
    pub weight: u32,
    /// Linux thread ids of the vCPU threads.
    pub vcpu_tids: Vec<libc::pid_t>,
    /// Whether its vCPU threads still run.
    pub running: bool,
}

/// A VM's console log and whether the VM still runs.
pub struct ConsoleWatch {
    /// The log.
    pub log: Arc<ConsoleLog>,
    entry: Arc<Entry>,
}

impl ConsoleWatch {
    /// Whether the VM stopped (no more output will come).
    pub fn finished(&self) -> bool {
        self.entry.handle.exit_reason().is_some()
    }
}

/// One hosted VM.
struct Entry {
    id: VmId,
    name: String,
    request: VmRequest,
    cmdline: String,
    handle: VmHandle,
    created: SystemTime,
    class: Mutex<String>,
    weight: AtomicU32,
    /// The VM's own cap, percent of one CPU; 0 = none.
    cap: AtomicU32,
    disks: Mutex<Vec<DiskInfo>>,
    /// Last CPU time read per vCPU thread (kept once the thread is gone).
    cpu_ns: Mutex<Vec<u64>>,
    /// Its resources were given back after it stopped ([`Manager::reap`]).
    reaped: std::sync::atomic::AtomicBool,
}

impl Entry {
    fn state(&self) -> (VmState, Option<ExitReason>) {
        match self.handle.exit_reason() {
            None if self.handle.is_paused() => (VmState::Paused, None),
            None => (VmState::Running, None),
            Some(r) => {
                let s = match r {
                    ExitReason::GuestShutdown => VmState::Shutdown,
                    ExitReason::Stopped => VmState::Stopped,
                    ExitReason::Fatal { .. } | ExitReason::ThreadFault { .. } => VmState::Failed,
                };
                (s, Some(r))
            }
        }
    }

    /// The disks with the VMM's live counters.
    fn disks_now(&self) -> Vec<DiskInfo> {
        let mut disks = lock(&self.disks).clone();
        if disks.is_empty() {
            return disks;
        }
        for live in self.handle.disks() {
            if let Some(d) = disks.iter_mut().find(|d| d.config.id == live.name) {
                d.capacity_bytes = live.capacity_bytes;
                d.stats = Some(live.stats);
                d.group = live.group;
            }
        }
        disks
    }

    /// CPU time of the vCPU threads, in ns.
    fn cpu_ns(&self, running: bool) -> u64 {
        let mut cache = lock(&self.cpu_ns);
        if running {
            for (i, tid) in self.handle.vcpu_tids().iter().enumerate() {
                if let (Some(ns), Some(slot)) = (thread_cpu_ns(*tid), cache.get_mut(i)) {
                    *slot = (*slot).max(ns);
                }
            }
        }
        cache.iter().sum()
    }
}

#[derive(Default)]
struct State {
    vms: BTreeMap<String, Arc<Entry>>,
    /// Names of VMs being started (reserved).
    starting: BTreeMap<String, (VmId, u32, u64)>,
    class_io: BTreeMap<String, IoLimits>,
    /// Each class's I/O group: one throttle group shared by all disks of the
    /// class's VMs, with the class's `io` limits.
    class_groups: BTreeMap<String, ThrottleGroup>,
    next_id: u64,
    shutting_down: bool,
}

/// The multi-VM manager. See the [module docs](self).
pub struct Manager {
    state: Mutex<State>,
    sched: Arc<Mutex<Scheduler>>,
    /// The gate backend's scheduler thread (ticks only with `CpuBackend::Gate`).
    cpu: Arc<CpuScheduler>,
    /// The cgroup backend, with `CpuBackend::Cgroup`.
    cgroup: Option<CgroupBackend>,
    cfg: ManagerConfig,
    memory_budget_mib: u64,
    /// Which VM holds which image (for the 409's message).
    images: ImageBook,
}

impl std::fmt::Debug for Manager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Manager").finish_non_exhaustive()
    }
}

pub use crate::cpusched::thread_cpu_ns;

/// The threads whose CPU time is a VM's: its vCPUs and its device thread
/// (which serves its I/O), for the cgroup backend.
fn vm_threads(h: &VmHandle) -> Vec<libc::pid_t> {
    let mut t = h.vcpu_tids().to_vec();
    t.extend(h.device_tid());
    t
}

/// Creates a class's I/O group or changes its limits live (tokens earned
/// and waiting requests are kept).
fn set_class_group(st: &mut State, class: &str, io: &IoLimits) -> Result<(), ManagerError> {
    let now = crate::util::monotonic_ns();
    let limits = io.to_blk();
    match st.class_groups.get(class) {
        Some(g) => g
            .set_limits(&limits, now)
            .map_err(|e| ManagerError::Invalid(format!("class {class:?} io: {e}")))?,
        None => {
            let g = ThrottleGroup::new(format!("class:{class}"), &limits, now)
                .map_err(|e| ManagerError::Invalid(format!("class {class:?} io: {e}")))?;
            st.class_groups.insert(class.to_string(), g);
        }
    }
    Ok(())
}

/// Checks a VM, disk or group name: the same rule as class names
/// ([`corral_scheduler::model::name_problem`]).
pub fn validate_name(what: &str, name: &str) -> Result<(), ManagerError> {
    match corral_scheduler::model::name_problem(name) {
        Some(why) => Err(ManagerError::Invalid(format!(
            "invalid {what} {name:?}: {why}"
        ))),
        None => Ok(()),
    }
}

impl Manager {
    /// A manager with its initial classes.
    pub fn new(cfg: ManagerConfig) -> Result<Self, ManagerError> {
        let capacity = match cfg.capacity {
            Some(c) => c,
            None => Capacity::from_affinity().unwrap_or(Capacity::from_cpus(1)),
        };
        if capacity.percent() == 0 {
            return Err(ManagerError::Invalid("capacity must be positive".into()));
        }
        let mut sched = Scheduler::new(capacity, cfg.policy)
            .map_err(|e| ManagerError::Invalid(e.to_string()))?;
        let mut state = State {
            next_id: 1,
            ..Default::default()
        };
        for (name, c) in &cfg.initial_classes {
            c.io.validate()?;
            sched.create_class(name, c.cpu)?;
            state.class_io.insert(name.clone(), c.io);
            set_class_group(&mut state, name, &c.io)?;
        }
        let memory_budget_mib = cfg
            .memory_budget_mib
            .or_else(|| crate::vm::host_memory_mib().map(default_memory_budget_mib))
            .unwrap_or(u64::MAX);
        let cgroup = match cfg.cpu_backend {
            CpuBackend::Cgroup => {
                let cg = CgroupBackend::new(&std::process::id().to_string())
                    .map_err(|e| ManagerError::Invalid(format!("cgroup backend: {e}")))?;
                for (name, c) in &cfg.initial_classes {
                    cg.set_class(name, c.cpu.shares, c.cpu.cap)
                        .map_err(|e| ManagerError::Invalid(format!("cgroup backend: {e}")))?;
                }
                Some(cg)
            }
            _ => None,
        };
        let sched = Arc::new(Mutex::new(sched));
        let cpu = CpuScheduler::new(sched.clone());
        if cfg.cpu_backend == CpuBackend::Gate {
            cpu.start()
                .map_err(|e| ManagerError::Invalid(format!("scheduler thread: {e}")))?;
        }
        Ok(Self {
            state: Mutex::new(state),
            sched,
            cpu,
            cgroup,
            cfg,
            memory_budget_mib,
            images: ImageBook::default(),
        })
    }

    /// The scheduler (model + policy) that the scheduler thread ticks.
    pub fn scheduler(&self) -> &Arc<Mutex<Scheduler>> {
        &self.sched
    }

    fn sched(&self) -> MutexGuard<'_, Scheduler> {
        lock(&self.sched)
    }

    /// VMs with what the scheduler thread needs (ids, classes, vCPU tids).
    pub fn sched_vms(&self) -> Vec<SchedVm> {
        let st = lock(&self.state);
        st.vms
            .values()
            .map(|e| SchedVm {
                id: e.id,
                name: e.name.clone(),
                class: lock(&e.class).clone(),
                weight: e.weight.load(Ordering::Relaxed),
                vcpu_tids: e.handle.vcpu_tids().to_vec(),
                running: e.handle.exit_reason().is_none(),
            })
            .collect()
    }

    // ---- classes ----

    /// One class with its scheduler figures, without a snapshot of every
    /// class's (that made each class change O(classes)).
    fn one_class_info(&self, st: &State, name: &str) -> Option<ClassInfo> {
        let (ticks, cs) = self.sched().class_stats(name);
        self.class_info(st, (ticks > 0).then_some(cs.as_ref()).flatten(), name)
    }

    fn class_info(
        &self,
        st: &State,
        cs: Option<&corral_scheduler::ClassStats>,
        name: &str,
    ) -> Option<ClassInfo> {
        let s = self.sched();
        let spec = *s.model().class(name)?;
        let parent = s.model().class_parent(name).map(str::to_owned);
        let children = s.model().class_children(name).map(str::to_owned).collect();
        drop(s);
        let vms: Vec<Arc<Entry>> = st
            .vms
            .values()
            .filter(|e| *lock(&e.class) == name)
            .cloned()
            .collect();
        let cpu_ns: u64 = vms
            .iter()
            .map(|e| e.cpu_ns(e.handle.exit_reason().is_none()))
            .sum();
        Some(ClassInfo {
            name: name.to_string(),
            parent,
            children,
            config: ClassConfig {
                cpu: spec,
                io: st.class_io.get(name).copied().unwrap_or_default(),
            },
            vms: vms.iter().map(|e| e.name.clone()).collect(),
            cpu_secs: cpu_ns as f64 / 1e9,
            entitlement_pct: cs.map(|c| c.entitlement_pct),
            used_pct: cs.map(|c| c.used_pct),
        })
    }

    /// All classes.
    pub fn list_classes(&self) -> Vec<ClassInfo> {
        let st = lock(&self.state);
        let stats = self.sched().stats();
        let names: Vec<String> = self
            .sched()
            .model()
            .classes()
            .map(|(n, _)| n.to_string())
            .collect();
        // stats.classes is sorted by name, as the model's classes are.
        let find = |n: &str| {
            (stats.ticks > 0)
                .then(|| {
                    stats
                        .classes
                        .binary_search_by(|c| c.name.as_str().cmp(n))
                        .ok()
                        .and_then(|i| stats.classes.get(i))
                })
                .flatten()
        };
        names
            .iter()
            .filter_map(|n| self.class_info(&st, find(n), n))
            .collect()
    }

    /// One class.
    pub fn get_class(&self, name: &str) -> Result<ClassInfo, ManagerError> {
        let st = lock(&self.state);
        self.one_class_info(&st, name)
            .ok_or_else(|| ManagerError::NotFound(format!("no class named {name:?}")))
    }

    /// Creates a class; 409 if it exists, 422 if admission control refuses.
    pub fn create_class(&self, name: &str, cfg: ClassConfig) -> Result<ClassInfo, ManagerError> {
        self.create_class_in(name, cfg, None)
    }

    /// Creates a class under `parent` (a root class with `None`); 404 for
    /// an unknown parent, 400 past the depth limit (8).
    pub fn create_class_in(
        &self,
        name: &str,
        cfg: ClassConfig,
        parent: Option<&str>,
    ) -> Result<ClassInfo, ManagerError> {
        cfg.io.validate()?;
        let mut st = lock(&self.state);
        self.check_class_count(&st, name)?;
        self.sched().create_class_in(name, cfg.cpu, parent)?;
        self.cgroup_class(name, &cfg);
        st.class_io.insert(name.to_string(), cfg.io);
        set_class_group(&mut st, name, &cfg.io)?;
        self.one_class_info(&st, name)
            .ok_or_else(|| ManagerError::NotFound(format!("no class named {name:?}")))
    }

    /// Creates or replaces a class; returns whether it was created.
    pub fn set_class(
        &self,
        name: &str,
        cfg: ClassConfig,
    ) -> Result<(bool, ClassInfo), ManagerError> {
        self.set_class_in(name, cfg, None)
    }

    /// Creates (under `parent`) or replaces a class; an existing class keeps
    /// its parent (naming another one is a 409). Returns whether it was
    /// created.
    pub fn set_class_in(
        &self,
        name: &str,
        cfg: ClassConfig,
        parent: Option<&str>,
    ) -> Result<(bool, ClassInfo), ManagerError> {
        cfg.io.validate()?;
        let mut st = lock(&self.state);
        self.check_class_count(&st, name)?;
        let created = self.sched().set_class_in(name, cfg.cpu, parent)?;
        self.cgroup_class(name, &cfg);
        st.class_io.insert(name.to_string(), cfg.io);
        set_class_group(&mut st, name, &cfg.io)?;
        let info = self
            .one_class_info(&st, name)
            .ok_or_else(|| ManagerError::NotFound(format!("no class named {name:?}")))?;
        Ok((created, info))
    }

    /// Changes a class with a function of its current configuration.
    pub fn update_class(
        &self,
        name: &str,
        f: impl FnOnce(&mut ClassConfig),
    ) -> Result<ClassInfo, ManagerError> {
        let mut st = lock(&self.state);
        let cpu = *self
            .sched()
            .model()
            .class(name)
            .ok_or_else(|| ManagerError::NotFound(format!("no class named {name:?}")))?;
        let mut cfg = ClassConfig {
            cpu,
            io: st.class_io.get(name).copied().unwrap_or_default(),
        };
        f(&mut cfg);
        cfg.io.validate()?;
        self.sched().update_class(name, cfg.cpu)?;
        self.cgroup_class(name, &cfg);
        st.class_io.insert(name.to_string(), cfg.io);
        set_class_group(&mut st, name, &cfg.io)?;
        self.one_class_info(&st, name)
            .ok_or_else(|| ManagerError::NotFound(format!("no class named {name:?}")))
    }

    /// Deletes an empty class; 409 while VMs are in it.
    pub fn delete_class(&self, name: &str) -> Result<(), ManagerError> {
        if name == DEFAULT_CLASS {
            self.get_class(name)?;
            return Err(ManagerError::Conflict(format!(
                "class {DEFAULT_CLASS:?} cannot be deleted: VMs created without a class join it \
                 (change its shares, cap or reservation instead)"
            )));
        }
        let mut st = lock(&self.state);
        // VMs being started are already in the scheduler's model, so a class
        // they are joining counts as in use.
        let path = self.cg_path(name);
        self.sched().delete_class(name)?;
        if let Some(cg) = &self.cgroup
            && let Err(e) = cg.remove_class(&path)
        {
            tracing::warn!(class = name, "cgroup backend: {e}");
        }
        st.class_io.remove(name);
        st.class_groups.remove(name);
        Ok(())
    }

    /// 422 if a new class `name` would exceed `max_classes` (every class
    /// has an entry in `class_io`).
    fn check_class_count(&self, st: &State, name: &str) -> Result<(), ManagerError> {
        if !st.class_io.contains_key(name) && st.class_io.len() >= self.cfg.max_classes {
            return Err(ManagerError::Refused(format!(
                "this daemon has at most {} classes (--max-classes)",
                self.cfg.max_classes
            )));
        }
        Ok(())
    }

    /// Mirrors a class into the cgroup backend (when it is the one in use).
    fn cgroup_class(&self, name: &str, cfg: &ClassConfig) {
        if let Some(cg) = &self.cgroup
            && let Err(e) = cg.set_class(&self.cg_path(name), cfg.cpu.shares, cfg.cpu.cap)
        {
            tracing::warn!(class = name, "cgroup backend: {e}");
        }
    }

    /// A class's group for the cgroup backend: its path from the root
    /// class, `/`-separated (nested groups). Takes the scheduler's lock.
    fn cg_path(&self, class: &str) -> String {
        let s = self.sched();
        let path = s.model().class_path(class);
        if path.is_empty() {
            class.to_string()
        } else {
            path.join("/")
        }
    }

    /// The gate backend's scheduler service.
    pub fn cpu_scheduler(&self) -> &Arc<CpuScheduler> {
        &self.cpu
    }

    /// The CPU backend in use.
    pub fn cpu_backend(&self) -> CpuBackend {
        self.cfg.cpu_backend
    }

    // ---- VMs ----

    fn vm_info(&self, e: &Entry, stats: Option<&Stats>) -> VmInfo {
        let (state, exit) = e.state();
        let running = exit.is_none();
        let mut exits: BTreeMap<&'static str, u64> = BTreeMap::new();
        for s in e.handle.vcpu_stats() {
            for (k, v) in s.snapshot() {
                *exits.entry(k).or_default() += v;
            }
        }
        let sched_cpu_ns = stats
            .and_then(|s| s.vms.iter().find(|v| v.vm == e.id))
            .map_or(0, |v| v.cpu_ns);
        let sched = stats.filter(|s| s.ticks > 0).and_then(|s| {
            s.vms.iter().find(|v| v.vm == e.id).map(|v| SchedFigures {
                entitlement_pct: v.entitlement_pct,
                used_pct: v.used_pct,
                parked: v.parked,
                parked_secs: v.parked_ns as f64 / 1e9,
                park_count: v.park_count,
            })
        });
        VmInfo {
            name: e.name.clone(),
            id: e.id.0,
            state,
            exit,
            class: lock(&e.class).clone(),
            weight: e.weight.load(Ordering::Relaxed),
            cap: Some(e.cap.load(Ordering::Relaxed)).filter(|&c| c > 0),
            vcpus: e.request.vcpus,
            memory_mib: e.request.memory_mib,
            kernel: e.request.kernel.clone(),
            initrd: e.request.initrd.clone(),
            cmdline: e.cmdline.clone(),
            disks: e.disks_now(),
            created: e.created,
            uptime: running.then(|| e.handle.uptime()),
            cpu_secs: e.cpu_ns(running).max(sched_cpu_ns) as f64 / 1e9,
            exits: exits.into_iter().collect(),
            guest_errors: e.handle.guest_errors(),
            sched,
        }
    }

    fn entry(&self, name: &str) -> Result<Arc<Entry>, ManagerError> {
        lock(&self.state)
            .vms
            .get(name)
            .cloned()
            .ok_or_else(|| ManagerError::NotFound(format!("no VM named {name:?}")))
    }

    /// All VMs, by name.
    pub fn list_vms(&self) -> Vec<VmInfo> {
        let entries: Vec<Arc<Entry>> = lock(&self.state).vms.values().cloned().collect();
        let stats = self.sched().stats();
        entries
            .iter()
            .map(|e| self.vm_info(e, Some(&stats)))
            .collect()
    }

    /// One VM.
    pub fn get_vm(&self, name: &str) -> Result<VmInfo, ManagerError> {
        let e = self.entry(name)?;
        let stats = self.sched().stats();
        Ok(self.vm_info(&e, Some(&stats)))
    }

    /// A VM's console log.
    pub fn console(&self, name: &str) -> Result<Arc<ConsoleLog>, ManagerError> {
        Ok(self.entry(name)?.handle.console())
    }

    /// A VM's console plus a way to tell when the VM stopped (for
    /// streaming: the log is closed only when the VM is freed).
    pub fn console_watch(&self, name: &str) -> Result<ConsoleWatch, ManagerError> {
        let entry = self.entry(name)?;
        Ok(ConsoleWatch {
            log: entry.handle.console(),
            entry,
        })
    }

    /// Reads the CPU time of every running VM's vCPU threads, so that the
    /// figure survives the threads (call it every second or so).
    pub fn sample_cpu(&self) {
        let entries: Vec<Arc<Entry>> = lock(&self.state).vms.values().cloned().collect();
        for e in entries {
            if e.handle.exit_reason().is_none() {
                e.cpu_ns(true);
            }
        }
        self.reap();
    }

    /// Releases the resources of every VM that has stopped on its own (guest
    /// shutdown, a fatal exit, a panicked thread, a seccomp violation):
    /// joins its threads, closes its KVM fd, gives its RAM back, releases
    /// its image locks and takes it out of the scheduler and its cgroup.
    /// Never blocks: a VM whose threads are still finishing is released on
    /// a later call. The daemon calls it twice a second (with
    /// [`Manager::sample_cpu`]).
    pub fn reap(&self) {
        let entries: Vec<Arc<Entry>> = lock(&self.state).vms.values().cloned().collect();
        for e in entries {
            self.release_entry(&e, false);
        }
    }

    fn validate_request(&self, req: &mut VmRequest) -> Result<(), ManagerError> {
        if let Some(n) = &req.name {
            validate_name("VM name", n)?;
        }
        if req.vcpus == 0 || req.vcpus > MAX_VM_VCPUS {
            return Err(ManagerError::Invalid(format!(
                "vcpus must be in 1..={MAX_VM_VCPUS}, got {}",
                req.vcpus
            )));
        }
        if !(corral_scheduler::model::MIN_WEIGHT..=corral_scheduler::model::MAX_WEIGHT)
            .contains(&req.weight)
        {
            return Err(ManagerError::Invalid(format!(
                "weight must be in 1..=10000, got {}",
                req.weight
            )));
        }
        if req.memory_mib < crate::layout::MIN_MEMORY_MIB {
            return Err(ManagerError::Invalid(format!(
                "{} MiB of memory is too small; the minimum is {} MiB",
                req.memory_mib,
                crate::layout::MIN_MEMORY_MIB
            )));
        }
        if req.kernel.is_none() && self.cfg.builtin_kernel.is_none() {
            return Err(ManagerError::Invalid(
                "no kernel given and this daemon has no built-in guest".into(),
            ));
        }
        if req.disks.len() > MAX_DISKS {
            return Err(ManagerError::Invalid(format!(
                "at most {MAX_DISKS} disks per VM"
            )));
        }
        let mut ids = BTreeSet::new();
        for (i, d) in req.disks.iter_mut().enumerate() {
            if d.id.is_empty() {
                d.id = format!("disk{i}");
            }
            validate_name("disk id", &d.id)?;
            if !ids.insert(d.id.clone()) {
                return Err(ManagerError::Invalid(format!(
                    "two disks are named {:?}",
                    d.id
                )));
            }
            d.limits.validate()?;
            // The file itself is opened and checked when the VM starts
            // (hostfile: the path policy, file type and lock, on the fd).
        }
        Ok(())
    }

    /// Creates and starts a VM. Blocks while it starts (milliseconds).
    pub fn create_vm(&self, mut req: VmRequest) -> Result<VmInfo, ManagerError> {
        self.validate_request(&mut req)?;
        self.reap();
        // Open (never waiting), check and lock every file first: a refused
        // file is a 400 (or a 409) whatever else is booked.
        let files = self.open_files(&req)?;
        // Reserve the name, the id, the resources and the scheduler slot.
        let booked = (|| {
            let mut st = lock(&self.state);
            if st.shutting_down {
                return Err(ManagerError::ShuttingDown);
            }
            let id = VmId(st.next_id);
            let name = match &req.name {
                Some(n) => n.clone(),
                None => {
                    let mut n = st.next_id;
                    while st.vms.contains_key(&format!("vm-{n}"))
                        || st.starting.contains_key(&format!("vm-{n}"))
                    {
                        n += 1;
                    }
                    format!("vm-{n}")
                }
            };
            if st.vms.contains_key(&name) || st.starting.contains_key(&name) {
                return Err(ManagerError::Conflict(format!(
                    "a VM named {name:?} already exists"
                )));
            }
            let live = st
                .vms
                .values()
                .filter(|e| e.handle.exit_reason().is_none())
                .count();
            if live + st.starting.len() >= self.cfg.max_vms {
                return Err(ManagerError::Refused(format!(
                    "this daemon runs at most {} VMs",
                    self.cfg.max_vms
                )));
            }
            // Stopped VMs book no resources but are objects all the same.
            let defined_max = self.cfg.max_vms.saturating_mul(4);
            if st.vms.len() + st.starting.len() >= defined_max {
                return Err(ManagerError::Refused(format!(
                    "this daemon keeps at most {defined_max} VM definitions (4 x --max-vms); delete stopped VMs"
                )));
            }
            let (vcpus, mem) = Self::usage(&st);
            if vcpus + req.vcpus > self.cfg.max_total_vcpus {
                return Err(ManagerError::Refused(format!(
                    "{} more vCPUs would exceed the daemon's limit of {} ({} in use)",
                    req.vcpus, self.cfg.max_total_vcpus, vcpus
                )));
            }
            if mem.saturating_add(req.memory_mib) > self.memory_budget_mib {
                return Err(ManagerError::Refused(format!(
                    "{} MiB more guest memory would exceed the budget of {} MiB ({} MiB in use)",
                    req.memory_mib, self.memory_budget_mib, mem
                )));
            }
            self.sched().add_vm(
                id,
                VmSpec {
                    cap: req.cap,
                    ..VmSpec::new(req.class.clone(), req.vcpus).with_weight(req.weight)
                },
            )?;
            st.next_id += 1;
            st.starting
                .insert(name.clone(), (id, req.vcpus, req.memory_mib));
            let group = st.class_groups.get(&req.class).cloned();
            Ok((id, name, group))
        })();
        let (id, name, group) = match booked {
            Ok(b) => b,
            Err(e) => {
                self.images.release(None, files.all());
                return Err(e);
            }
        };
        self.images.book(&name, files.all());
        let result = self.launch(id, &name, &req, group, &files);
        if result.is_err() {
            self.images.release(Some(&name), files.all());
        }
        let mut st = lock(&self.state);
        st.starting.remove(&name);
        match result {
            Ok((handle, cmdline)) => {
                let n = usize::from(req.vcpus as u8);
                let entry = Arc::new(Entry {
                    id,
                    name: name.clone(),
                    cmdline,
                    handle,
                    created: SystemTime::now(),
                    class: Mutex::new(req.class.clone()),
                    weight: AtomicU32::new(req.weight),
                    cap: AtomicU32::new(req.cap.unwrap_or(0)),
                    disks: Mutex::new(
                        req.disks
                            .iter()
                            .map(|d| DiskInfo {
                                config: d.clone(),
                                capacity_bytes: 0,
                                stats: None,
                                group: None,
                            })
                            .collect(),
                    ),
                    cpu_ns: Mutex::new(vec![0; n]),
                    reaped: std::sync::atomic::AtomicBool::new(false),
                    request: req,
                });
                st.vms.insert(name, entry.clone());
                drop(st);
                let stats = self.sched().stats();
                Ok(self.vm_info(&entry, Some(&stats)))
            }
            Err(e) => {
                let _ = self.sched().remove_vm(id);
                Err(e)
            }
        }
    }

    /// vCPUs and guest memory in use. A VM that has stopped (shut down,
    /// stopped, failed) holds neither: its threads are joined and its RAM
    /// given back ([`Manager::reap`]), though it stays listed until deleted.
    fn usage(st: &State) -> (u32, u64) {
        let mut vcpus = 0;
        let mut mem = 0;
        for e in st.vms.values().filter(|e| e.handle.exit_reason().is_none()) {
            vcpus += e.request.vcpus;
            mem += e.request.memory_mib;
        }
        for (_, v, m) in st.starting.values() {
            vcpus += v;
            mem += m;
        }
        (vcpus, mem)
    }

    fn launch(
        &self,
        id: VmId,
        name: &str,
        req: &VmRequest,
        class_group: Option<ThrottleGroup>,
        files: &crate::images::VmFiles,
    ) -> Result<(VmHandle, String), ManagerError> {
        let vcpus = u8::try_from(req.vcpus)
            .map_err(|_| ManagerError::Invalid(format!("too many vCPUs: {}", req.vcpus)))?;
        if req.kernel.is_none() && self.cfg.builtin_kernel.is_none() {
            return Err(ManagerError::Invalid(
                "no kernel given and this daemon has no built-in guest".into(),
            ));
        }
        self.start_opened(id, name, req, class_group, files, vcpus)
    }

    /// Opens a VM's kernel, initrd and disks under the host-path policy.
    fn open_files(&self, req: &VmRequest) -> Result<crate::images::VmFiles, ManagerError> {
        let disks: Vec<_> = req
            .disks
            .iter()
            .map(|d| (d.path.as_path(), d.readonly, d.direct))
            .collect();
        Ok(self.images.open_vm(
            &self.cfg.host_files,
            req.kernel.as_deref(),
            req.initrd.as_deref(),
            &disks,
        )?)
    }

    fn start_opened(
        &self,
        id: VmId,
        name: &str,
        req: &VmRequest,
        class_group: Option<ThrottleGroup>,
        files: &crate::images::VmFiles,
        vcpus: u8,
    ) -> Result<(VmHandle, String), ManagerError> {
        let (kernel, default_cmdline) = match (&files.kernel, &self.cfg.builtin_kernel) {
            (Some(f), _) => (KernelSource::File(f.clone()), DEFAULT_LINUX_CMDLINE),
            (None, Some(b)) => (KernelSource::Bytes(b.clone()), ""),
            (None, None) => {
                return Err(ManagerError::Invalid(
                    "no kernel given and this daemon has no built-in guest".into(),
                ));
            }
        };
        let mut cfg = VmConfig::new(name, kernel);
        cfg.initrd = files.initrd.clone().map(HostImage::File);
        cfg.cmdline = req
            .cmdline
            .clone()
            .unwrap_or_else(|| default_cmdline.to_string());
        cfg.vcpus = vcpus;
        cfg.memory_mib = req.memory_mib;
        cfg.console_log_bytes = self.cfg.console_log_bytes;
        cfg.disks = req
            .disks
            .iter()
            .zip(&files.disks)
            .map(|(d, f)| crate::vm::DiskConfig {
                spec: corral_devices::virtio::blk::DiskSpec {
                    path: d.path.clone(),
                    read_only: d.readonly,
                    direct: d.direct,
                    id: Some(d.id.clone()),
                    options: Vec::new(),
                },
                limits: d.limits.to_blk(),
                // Every disk is in its class's I/O group (unlimited until the
                // class gets `io` limits), so class limits apply live.
                group: class_group
                    .clone()
                    .map(|g| (g, corral_blkthrottle::DEFAULT_WEIGHT)),
                file: Some(f.clone()),
            })
            .collect();
        let gate = Arc::new(Gate::new());
        if self.cfg.cpu_backend == CpuBackend::Gate {
            cfg.sched_gate = Some(gate.clone());
        }
        let handle = crate::builder::start(&cfg)?;
        match self.cfg.cpu_backend {
            CpuBackend::Gate => self.cpu.attach(
                id,
                gate,
                handle.vcpu_tids().to_vec(),
                handle.device_tid().into_iter().collect(),
            ),
            CpuBackend::Cgroup => {
                if let Some(cg) = &self.cgroup
                    && let Err(e) = cg
                        .place_vm(
                            &self.cg_path(&req.class),
                            name,
                            req.weight,
                            &vm_threads(&handle),
                        )
                        .and_then(|()| cg.set_vm_cap(&self.cg_path(&req.class), name, req.cap))
                {
                    handle.stop();
                    handle.join();
                    return Err(ManagerError::Invalid(format!("cgroup backend: {e}")));
                }
            }
            CpuBackend::None => {}
        }
        tracing::info!(
            vm = name,
            vcpus = req.vcpus,
            memory_mib = req.memory_mib,
            "VM started"
        );
        Ok((handle, cfg.cmdline))
    }

    /// Stops a VM, frees it and returns its last snapshot. Blocks until its
    /// threads are gone.
    pub fn delete_vm(&self, name: &str) -> Result<VmInfo, ManagerError> {
        let e = lock(&self.state)
            .vms
            .remove(name)
            .ok_or_else(|| ManagerError::NotFound(format!("no VM named {name:?}")))?;
        e.handle.stop();
        // Unlocked now, even if a console follower still holds the entry.
        self.release_entry(&e, true);
        tracing::info!(vm = name, "VM deleted");
        Ok(self.vm_info(&e, None))
    }

    /// Sets or removes a VM's own CPU cap (percent of one CPU), live: the
    /// gate backend's policy and the cgroup backend (`cpu.max` of the VM's
    /// group) apply it from their next tick / at once.
    pub fn set_vm_cap(&self, name: &str, cap: Option<u32>) -> Result<VmInfo, ManagerError> {
        let e = {
            let st = lock(&self.state);
            let e = st
                .vms
                .get(name)
                .cloned()
                .ok_or_else(|| ManagerError::NotFound(format!("no VM named {name:?}")))?;
            self.sched().set_vm_cap(e.id, cap)?;
            e.cap.store(cap.unwrap_or(0), Ordering::Relaxed);
            if let Some(cg) = &self.cgroup
                && let Err(err) = cg.set_vm_cap(&self.cg_path(&lock(&e.class)), &e.name, cap)
            {
                tracing::warn!(vm = name, "cgroup backend: {err}");
            }
            e
        };
        tracing::info!(vm = name, cap = ?cap, "VM cap set");
        let stats = self.sched().stats();
        Ok(self.vm_info(&e, Some(&stats)))
    }

    /// Pauses a VM's vCPUs (idempotent); 409 if it has stopped.
    pub fn pause_vm(&self, name: &str) -> Result<VmInfo, ManagerError> {
        let e = self.entry(name)?;
        if e.handle.exit_reason().is_some() {
            return Err(ManagerError::Conflict(format!(
                "VM {name:?} has stopped; only a running VM can be paused"
            )));
        }
        if e.handle.pause() {
            tracing::info!(vm = name, "VM paused");
        }
        let stats = self.sched().stats();
        Ok(self.vm_info(&e, Some(&stats)))
    }

    /// Resumes a paused VM (idempotent); 409 if it has stopped.
    pub fn resume_vm(&self, name: &str) -> Result<VmInfo, ManagerError> {
        let e = self.entry(name)?;
        if e.handle.exit_reason().is_some() {
            return Err(ManagerError::Conflict(format!(
                "VM {name:?} has stopped; it cannot be resumed"
            )));
        }
        if e.handle.resume() {
            tracing::info!(vm = name, "VM resumed");
        }
        let stats = self.sched().stats();
        Ok(self.vm_info(&e, Some(&stats)))
    }

    /// Moves a VM to another class (live), optionally with a new weight.
    pub fn move_vm(
        &self,
        name: &str,
        class: &str,
        weight: Option<u32>,
    ) -> Result<VmInfo, ManagerError> {
        let e = {
            let st = lock(&self.state);
            let e = st
                .vms
                .get(name)
                .cloned()
                .ok_or_else(|| ManagerError::NotFound(format!("no VM named {name:?}")))?;
            let mut s = self.sched();
            if s.model().class(class).is_none() {
                return Err(ManagerError::NotFound(format!("no class named {class:?}")));
            }
            if let Some(w) = weight {
                // Validate before changing anything.
                if !(corral_scheduler::model::MIN_WEIGHT..=corral_scheduler::model::MAX_WEIGHT)
                    .contains(&w)
                {
                    return Err(ManagerError::Invalid(format!(
                        "weight must be in 1..=10000, got {w}"
                    )));
                }
            }
            s.move_vm(e.id, class)?;
            if let Some(w) = weight {
                s.set_vm_weight(e.id, w)?;
                e.weight.store(w, Ordering::Relaxed);
            }
            drop(s);
            if let Some(cg) = &self.cgroup {
                let old = lock(&e.class).clone();
                let w = e.weight.load(Ordering::Relaxed);
                let cap = Some(e.cap.load(Ordering::Relaxed)).filter(|&c| c > 0);
                if let Err(err) = cg
                    .place_vm(&self.cg_path(class), &e.name, w, &vm_threads(&e.handle))
                    .and_then(|()| cg.set_vm_cap(&self.cg_path(class), &e.name, cap))
                {
                    tracing::warn!(vm = name, "cgroup backend: {err}");
                } else {
                    let _ = cg.remove_vm(&self.cg_path(&old), &e.name);
                }
            }
            *lock(&e.class) = class.to_string();
            let group = st.class_groups.get(class).cloned();
            (e, group)
        };
        let (e, group) = e;
        if e.handle.exit_reason().is_none() {
            for d in e.handle.disks() {
                if let Err(err) = e.handle.set_disk_group(
                    &d.name,
                    group
                        .clone()
                        .map(|g| (g, corral_blkthrottle::DEFAULT_WEIGHT)),
                ) {
                    tracing::warn!(
                        vm = name,
                        disk = d.name,
                        "moving to the class's I/O group: {err}"
                    );
                }
            }
        }
        tracing::info!(vm = name, class, "VM moved");
        let stats = self.sched().stats();
        Ok(self.vm_info(&e, Some(&stats)))
    }

    /// Changes a disk's limits live.
    pub fn set_disk_limits(
        &self,
        name: &str,
        disk: &str,
        limits: IoLimits,
    ) -> Result<DiskInfo, ManagerError> {
        limits.validate()?;
        let e = self.entry(name)?;
        if !lock(&e.disks).iter().any(|d| d.config.id == disk) {
            return Err(ManagerError::NotFound(format!(
                "VM {name:?} has no disk {disk:?}"
            )));
        }
        if e.handle.exit_reason().is_some() {
            return Err(ManagerError::Conflict(format!(
                "VM {name:?} has stopped; its disks cannot change"
            )));
        }
        // The device thread swaps the limits between two requests and
        // answers once applied.
        e.handle.set_disk_limits(disk, limits.to_blk())?;
        {
            let mut disks = lock(&e.disks);
            if let Some(d) = disks.iter_mut().find(|d| d.config.id == disk) {
                d.config.limits = limits;
            }
        }
        tracing::info!(vm = name, disk, "disk limits changed");
        e.disks_now()
            .into_iter()
            .find(|d| d.config.id == disk)
            .ok_or_else(|| ManagerError::NotFound(format!("VM {name:?} has no disk {disk:?}")))
    }

    /// Each class's I/O group counters (ops, bytes, throttling, latency).
    pub fn class_io_stats(&self) -> Vec<(String, corral_blkthrottle::Stats)> {
        lock(&self.state)
            .class_groups
            .iter()
            .map(|(c, g)| (c.clone(), g.stats()))
            .collect()
    }

    /// Host-wide figures.
    pub fn host(&self) -> HostInfo {
        let st = lock(&self.state);
        let (vcpus, memory_mib) = Self::usage(&st);
        let running = st
            .vms
            .values()
            .filter(|e| e.handle.exit_reason().is_none())
            .count();
        let vms = st.vms.len();
        drop(st);
        let s = self.sched();
        let stats = s.stats();
        HostInfo {
            capacity_pct: s.model().capacity().percent(),
            reserved_pct: s.model().reserved_percent(),
            vms,
            running_vms: running,
            max_vms: self.cfg.max_vms,
            memory_mib,
            memory_budget_mib: self.memory_budget_mib,
            vcpus,
            sched_ticks: stats.ticks,
            available_pct: stats.available_pct,
            outside_pct: stats.outside_pct,
            steal_pct: stats.steal_pct,
            shortfall_ratio: stats.shortfall_ratio,
        }
    }

    /// Stops every VM and refuses new ones. Blocks until all threads are
    /// gone.
    pub fn shutdown(&self) {
        let entries: Vec<Arc<Entry>> = {
            let mut st = lock(&self.state);
            st.shutting_down = true;
            std::mem::take(&mut st.vms).into_values().collect()
        };
        for e in &entries {
            e.handle.stop();
        }
        for e in &entries {
            self.cpu.detach(e.id);
            e.handle.join();
            self.images.release(Some(&e.name), e.handle.files().iter());
            let _ = self.sched().remove_vm(e.id);
            if let Some(cg) = &self.cgroup {
                let _ = cg.remove_vm(&self.cg_path(&lock(&e.class)), &e.name);
            }
        }
        self.cpu.shutdown();
        if !entries.is_empty() {
            tracing::info!(vms = entries.len(), "all VMs stopped");
        }
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        self.shutdown();
    }
}
