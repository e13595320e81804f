//! What the manager is asked for (VM requests, classes, disks, limits,
//! its configuration) and what it answers (snapshots of VMs, classes and the
//! host).

use super::*;
pub use corral_devices::virtio::blk::IoEngine;

/// The default guest memory budget: host memory less what the host keeps,
/// at least 10 % of it or 1 GiB, whichever is larger.
pub fn default_memory_budget_mib(host_mib: u64) -> u64 {
    host_mib.saturating_sub((host_mib / 10).max(1024))
}

/// Throttle limits of a disk or an I/O group: the throttle crate's own type,
/// also the REST API's and the state file's form (its `serde` feature).
pub use corral_blkthrottle::Limits;

/// A limits set that does not make sense (a burst without a rate) is the
/// client's error.
impl From<corral_blkthrottle::LimitsError> for ManagerError {
    fn from(e: corral_blkthrottle::LimitsError) -> Self {
        ManagerError::Invalid(e.to_string())
    }
}

/// A class as the operator configures it: CPU settings plus the I/O limits
/// of the class's throttle group (shared by all disks of its VMs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClassConfig {
    /// CPU shares, cap, reservation.
    pub cpu: ClassSpec,
    /// Limits of the class's I/O group.
    pub io: Limits,
}

/// One disk of a VM, as a client requests it: also the JSON form of a disk
/// in `POST /v1/vms` (the spec's `DiskCreate`) and in the state file (the
/// VMM's own form, with the opened file and the throttle group, is
/// [`crate::vm::DiskConfig`]). Unknown keys are refused; `limits` must be an
/// object.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskRequest {
    /// Name within the VM ([`crate::vm::disk_name`], `disk0`, `disk1`, ...
    /// when empty or absent).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub id: String,
    /// Backing file or block device.
    pub path: PathBuf,
    /// Read-only; `readonly` on the wire and in the state file.
    #[serde(default, rename = "readonly")]
    pub read_only: bool,
    /// O_DIRECT.
    #[serde(default)]
    pub direct: bool,
    /// I/O engine, `sync` or `uring`; `None` (absent or null): io_uring
    /// where the kernel supports it, else sync.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "engine_ser",
        deserialize_with = "engine_de"
    )]
    pub engine: Option<IoEngine>,
    /// The disk's own limits.
    #[serde(default, deserialize_with = "limits_object")]
    pub limits: Limits,
}

fn engine_ser<S: serde::Serializer>(e: &Option<IoEngine>, s: S) -> Result<S::Ok, S::Error> {
    match e {
        Some(e) => s.serialize_str(e.as_str()),
        None => s.serialize_none(),
    }
}

fn engine_de<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<IoEngine>, D::Error> {
    use serde::Deserialize;
    Option::<String>::deserialize(d)?
        .map(|s| s.parse().map_err(serde::de::Error::custom))
        .transpose()
}

/// Limits only from a JSON object (serde's derived deserializers also take
/// an array of the fields in order, which neither the API nor the state file
/// means).
fn limits_object<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Limits, D::Error> {
    use serde::Deserialize;
    let m = serde_json::Map::deserialize(d)?;
    serde_json::from_value(serde_json::Value::Object(m)).map_err(serde::de::Error::custom)
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
    pub disks: Vec<DiskRequest>,
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
    /// Where classes and VM definitions are persisted (`state.json` in
    /// it); `None` = nowhere (`corral run`, library users).
    pub state_dir: Option<PathBuf>,
    /// Run each VM in a process of its own (`corral serve`); `None`: as
    /// threads of this process.
    pub vm_processes: Option<super::VmProcesses>,
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
            state_dir: None,
            vm_processes: None,
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
    pub config: DiskRequest,
    /// Size in bytes (0 if unknown).
    pub capacity_bytes: u64,
    /// Throttle counters, when the VM has the disk attached.
    pub stats: Option<corral_blkthrottle::Stats>,
    /// The I/O group the disk is in now (`class:<its VM's class>`), when
    /// the VM has the disk attached.
    pub group: Option<String>,
    /// The disk's weight in that group (its VM's weight), when the VM has
    /// the disk attached.
    pub group_weight: Option<u32>,
    /// The engine serving the disk, when the VM has it attached.
    pub engine: Option<IoEngine>,
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
    /// The host pid of its VM process, while one runs it (process mode;
    /// with a pid namespace, the process that runs the VM, not the outer
    /// one).
    pub pid: Option<u32>,
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
    pub(super) entry: Arc<Entry>,
}

impl ConsoleWatch {
    /// Whether the VM stopped (no more output will come).
    pub fn finished(&self) -> bool {
        self.entry.handle.exit_reason().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_need_a_rate_for_each_burst() {
        let ok = Limits {
            bps: Some(1 << 20),
            burst_bytes: Some(1 << 16),
            riops: Some(100),
            burst_ops: Some(10),
            ..Limits::default()
        };
        ok.validate().unwrap();
        assert!(!ok.is_unlimited());
        for bad in [
            Limits {
                burst_bytes: Some(1),
                iops: Some(5),
                ..Limits::default()
            },
            Limits {
                burst_ops: Some(1),
                wbps: Some(5),
                ..Limits::default()
            },
            // A zero rate is no rate.
            Limits {
                burst_ops: Some(1),
                iops: Some(0),
                ..Limits::default()
            },
        ] {
            let e = ManagerError::from(bad.validate().unwrap_err());
            assert_eq!(e.kind(), ErrorKind::Invalid, "{bad:?}");
            assert!(e.to_string().contains("burst"), "{e}");
        }
    }

    #[test]
    fn the_default_budget_keeps_a_tenth_or_a_gib_for_the_host() {
        assert_eq!(default_memory_budget_mib(4096), 3072);
        assert_eq!(default_memory_budget_mib(65536), 65536 - 6553);
        assert_eq!(default_memory_budget_mib(512), 0);
    }

    #[test]
    fn cpu_backends_parse() {
        for (s, b) in [
            ("gate", CpuBackend::Gate),
            ("cgroup", CpuBackend::Cgroup),
            ("none", CpuBackend::None),
        ] {
            assert_eq!(s.parse::<CpuBackend>(), Ok(b));
        }
        assert!("fast".parse::<CpuBackend>().is_err());
    }
}
