//! The JSON shapes of the REST API (see `api/openapi.yaml`), shared by the
//! server and the CLI client. Request bodies reject unknown fields.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::UNIX_EPOCH;

use corral_scheduler::ClassSpec;
use corral_vmm::ExitReason;
use corral_vmm::manager::{ClassConfig, ClassInfo, DiskInfo, HostInfo, VmInfo, VmRequest};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};

/// `{"error": {"code", "message"}}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// Code and message of an error.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Machine-readable code.
    pub code: String,
    /// Human-readable message.
    pub message: String,
}

/// Throttle limits; absent, `null` or `0` = no limit: the throttle crate's
/// own type (its `serde` form is the spec's `Limits`).
pub use corral_vmm::manager::Limits;

/// Deserializes a struct only from a JSON object (serde's derived
/// deserializers also accept arrays, which the API must refuse).
fn object<'de, D: Deserializer<'de>, T: DeserializeOwned>(d: D) -> Result<T, D::Error> {
    let m = serde_json::Map::deserialize(d)?;
    serde_json::from_value(serde_json::Value::Object(m)).map_err(serde::de::Error::custom)
}

fn opt_object<'de, D: Deserializer<'de>, T: DeserializeOwned>(d: D) -> Result<Option<T>, D::Error> {
    // Absent = keep (via `default`); `null` is refused like any non-object.
    let m = serde_json::Map::deserialize(d)?;
    serde_json::from_value(serde_json::Value::Object(m))
        .map(Some)
        .map_err(serde::de::Error::custom)
}

fn objects<'de, D: Deserializer<'de>, T: DeserializeOwned>(d: D) -> Result<Vec<T>, D::Error> {
    Vec::<serde_json::Map<String, serde_json::Value>>::deserialize(d)?
        .into_iter()
        .map(|m| serde_json::from_value(serde_json::Value::Object(m)))
        .collect::<Result<_, _>>()
        .map_err(serde::de::Error::custom)
}

fn default_shares() -> u32 {
    corral_scheduler::model::DEFAULT_SHARES
}

/// `POST /v1/classes`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassCreate {
    pub name: String,
    /// Parent class (the new class divides its portion with its siblings).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    #[serde(default = "default_shares")]
    pub shares: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cap: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation: Option<u32>,
    #[serde(default, deserialize_with = "object")]
    pub io: Limits,
}

/// `PUT /v1/classes/{name}`: the whole class.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassPut {
    /// Parent class when the PUT creates the class; an existing class keeps
    /// its parent (another one is a 409).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    #[serde(default = "default_shares")]
    pub shares: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cap: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation: Option<u32>,
    #[serde(default, deserialize_with = "object")]
    pub io: Limits,
}

impl ClassPut {
    /// The manager's form.
    pub fn config(&self) -> ClassConfig {
        ClassConfig {
            cpu: ClassSpec {
                shares: self.shares,
                cap: self.cap,
                reservation: self.reservation.filter(|r| *r != 0),
            },
            io: self.io,
        }
    }
}

fn double<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Ok(Some(Option::deserialize(d)?))
}

/// `PATCH /v1/classes/{name}`: absent fields are kept; `null` removes a cap
/// or reservation.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassPatch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shares: Option<u32>,
    #[serde(
        default,
        deserialize_with = "double",
        skip_serializing_if = "Option::is_none"
    )]
    pub cap: Option<Option<u32>>,
    #[serde(
        default,
        deserialize_with = "double",
        skip_serializing_if = "Option::is_none"
    )]
    pub reservation: Option<Option<u32>>,
    #[serde(
        default,
        deserialize_with = "opt_object",
        skip_serializing_if = "Option::is_none"
    )]
    pub io: Option<Limits>,
}

impl ClassPatch {
    /// Applies the patch.
    pub fn apply(&self, c: &mut ClassConfig) {
        if let Some(s) = self.shares {
            c.cpu.shares = s;
        }
        if let Some(cap) = self.cap {
            c.cpu.cap = cap;
        }
        if let Some(r) = self.reservation {
            c.cpu.reservation = r.filter(|r| *r != 0);
        }
        if let Some(io) = self.io {
            c.io = io;
        }
    }
}

/// A class.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Class {
    pub name: String,
    pub parent: Option<String>,
    pub children: Vec<String>,
    pub shares: u32,
    pub cap: Option<u32>,
    pub reservation: Option<u32>,
    pub io: Limits,
    pub vms: Vec<String>,
    pub cpu_seconds: f64,
    pub entitlement_pct: Option<f64>,
    pub used_pct: Option<f64>,
}

impl From<ClassInfo> for Class {
    fn from(c: ClassInfo) -> Self {
        Class {
            name: c.name,
            parent: c.parent,
            children: c.children,
            shares: c.config.cpu.shares,
            cap: c.config.cpu.cap,
            reservation: c.config.cpu.reservation,
            io: c.config.io,
            vms: c.vms,
            cpu_seconds: c.cpu_secs,
            entitlement_pct: c.entitlement_pct,
            used_pct: c.used_pct,
        }
    }
}

/// A disk in `POST /v1/vms` (the spec's `DiskCreate`): the manager's request
/// type, which is also its JSON form.
pub use corral_vmm::manager::DiskRequest;

/// `POST /v1/vms`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmCreate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
    /// The VM's own CPU cap, percent of one CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cap: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
    #[serde(
        default,
        deserialize_with = "objects",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub disks: Vec<DiskRequest>,
}

impl VmCreate {
    /// The manager's form.
    pub fn request(self) -> VmRequest {
        let d = VmRequest::default();
        VmRequest {
            name: self.name,
            class: self.class.unwrap_or(d.class),
            weight: self.weight.unwrap_or(d.weight),
            cap: self.cap,
            vcpus: self.vcpus.unwrap_or(d.vcpus),
            memory_mib: self.memory_mib.unwrap_or(d.memory_mib),
            kernel: self.kernel.map(PathBuf::from),
            initrd: self.initrd.map(PathBuf::from),
            cmdline: self.cmdline,
            disks: self.disks,
        }
    }
}

/// `PATCH /v1/vms/{id}`: absent fields are kept; `"cap": null` removes the
/// VM's own cap.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmPatch {
    /// The VM's weight in its class (CPU and the class's I/O group).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
    #[serde(
        default,
        deserialize_with = "double",
        skip_serializing_if = "Option::is_none"
    )]
    pub cap: Option<Option<u32>>,
}

/// `POST /v1/vms/{id}/move`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoveVm {
    pub class: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
}

/// I/O counters of a disk.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DiskStats {
    pub read_ops: u64,
    pub read_bytes: u64,
    pub write_ops: u64,
    pub write_bytes: u64,
    pub other_ops: u64,
    pub throttled_requests: u64,
    pub throttled_seconds: f64,
    pub queue_depth: u64,
}

/// A disk of a VM.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Disk {
    pub id: String,
    pub path: String,
    /// `readonly` on the wire, as in the spec.
    #[serde(rename = "readonly")]
    pub read_only: bool,
    pub direct: bool,
    pub engine: Option<String>,
    pub limits: Limits,
    pub group: Option<String>,
    /// The disk's weight in `group`: its VM's weight.
    pub group_weight: Option<u32>,
    pub capacity_bytes: u64,
    pub stats: Option<DiskStats>,
}

impl From<DiskInfo> for Disk {
    fn from(d: DiskInfo) -> Self {
        let c = d.config;
        Disk {
            id: c.id,
            path: c.path.display().to_string(),
            read_only: c.read_only,
            direct: c.direct,
            engine: d.engine.or(c.engine).map(|e| e.to_string()),
            limits: c.limits,
            group: d.group,
            group_weight: d.group_weight,
            capacity_bytes: d.capacity_bytes,
            stats: d.stats.map(|s| DiskStats {
                read_ops: s.read.ops,
                read_bytes: s.read.bytes,
                write_ops: s.write.ops,
                write_bytes: s.write.bytes,
                other_ops: s.other.ops,
                throttled_requests: s.throttled_requests,
                throttled_seconds: s.throttled_seconds(),
                queue_depth: s.queue_depth,
            }),
        }
    }
}

/// Why a VM stopped.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmExit {
    /// `guest_shutdown`, `stopped` or `fatal`.
    pub reason: String,
    pub message: String,
    pub vcpu: Option<u8>,
}

/// Scheduler figures of a VM.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmSched {
    pub entitlement_pct: f64,
    pub used_pct: f64,
    pub parked: bool,
    pub parked_seconds: f64,
    pub park_count: u64,
}

/// A VM.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Vm {
    pub name: String,
    pub id: u64,
    pub state: String,
    pub exit: Option<VmExit>,
    pub class: String,
    pub weight: u32,
    pub cap: Option<u32>,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub kernel: Option<String>,
    pub initrd: Option<String>,
    pub cmdline: String,
    pub disks: Vec<Disk>,
    pub created_at: u64,
    pub uptime_seconds: Option<f64>,
    pub cpu_seconds: f64,
    pub pid: Option<u32>,
    pub exits: BTreeMap<String, u64>,
    pub sched: Option<VmSched>,
}

impl From<VmInfo> for Vm {
    fn from(v: VmInfo) -> Self {
        Vm {
            name: v.name,
            id: v.id,
            state: v.state.as_str().to_string(),
            exit: v.exit.map(|e| match e {
                ExitReason::GuestShutdown => VmExit {
                    reason: "guest_shutdown".into(),
                    message: e.to_string(),
                    vcpu: None,
                },
                ExitReason::Stopped => VmExit {
                    reason: "stopped".into(),
                    message: e.to_string(),
                    vcpu: None,
                },
                ExitReason::DaemonRestarted => VmExit {
                    reason: "daemon_restarted".into(),
                    message: e.to_string(),
                    vcpu: None,
                },
                ExitReason::Fatal { vcpu, .. } => VmExit {
                    reason: "fatal".into(),
                    message: e.to_string(),
                    vcpu: Some(vcpu),
                },
                ExitReason::ThreadFault {
                    vcpu, ref fault, ..
                } => VmExit {
                    reason: match fault {
                        corral_vmm::ThreadFault::Panic(_) => "panic",
                        corral_vmm::ThreadFault::Seccomp { .. } => "seccomp",
                        corral_vmm::ThreadFault::Setup(_) => "fatal",
                    }
                    .into(),
                    message: e.to_string(),
                    vcpu,
                },
                ExitReason::ProcessGone { .. } => VmExit {
                    reason: "vm_process".into(),
                    message: e.to_string(),
                    vcpu: None,
                },
                ExitReason::NotAdopted { .. } => VmExit {
                    reason: "not_adopted".into(),
                    message: e.to_string(),
                    vcpu: None,
                },
            }),
            class: v.class,
            weight: v.weight,
            cap: v.cap,
            vcpus: v.vcpus,
            memory_mib: v.memory_mib,
            kernel: v.kernel.map(|p| p.display().to_string()),
            initrd: v.initrd.map(|p| p.display().to_string()),
            cmdline: v.cmdline,
            disks: v.disks.into_iter().map(Disk::from).collect(),
            created_at: v
                .created
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            uptime_seconds: v.uptime.map(|d| d.as_secs_f64()),
            cpu_seconds: v.cpu_secs,
            pid: v.pid,
            exits: v
                .exits
                .into_iter()
                .map(|(k, n)| (k.to_string(), n))
                .collect(),
            sched: v.sched.map(|s| VmSched {
                entitlement_pct: s.entitlement_pct,
                used_pct: s.used_pct,
                parked: s.parked,
                parked_seconds: s.parked_secs,
                park_count: s.park_count,
            }),
        }
    }
}

/// `GET /v1/status`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    pub version: String,
    pub capacity_pct: u64,
    pub reserved_pct: u64,
    pub vms: usize,
    pub running_vms: usize,
    pub max_vms: usize,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub memory_budget_mib: u64,
    pub scheduler_ticks: u64,
    pub available_pct: f64,
    pub outside_pct: f64,
    pub steal_pct: f64,
    pub capacity_shortfall_ratio: f64,
}

impl From<HostInfo> for Status {
    fn from(h: HostInfo) -> Self {
        Status {
            version: env!("CARGO_PKG_VERSION").to_string(),
            capacity_pct: h.capacity_pct,
            reserved_pct: h.reserved_pct,
            vms: h.vms,
            running_vms: h.running_vms,
            max_vms: h.max_vms,
            vcpus: h.vcpus,
            memory_mib: h.memory_mib,
            memory_budget_mib: h.memory_budget_mib,
            scheduler_ticks: h.sched_ticks,
            available_pct: h.available_pct,
            outside_pct: h.outside_pct,
            steal_pct: h.steal_pct,
            capacity_shortfall_ratio: h.shortfall_ratio,
        }
    }
}
