//! The messages between the daemon and a VM process (`corral vmm`), version
//! [`PROTOCOL_VERSION`]. Each message is one SOCK_SEQPACKET datagram holding
//! one JSON object ([`super::wire`]); the configuration message carries the
//! VM's open files as SCM_RIGHTS.
//!
//! The daemon sends [`Hello`] first, then [`ToVm`] requests. The VM process
//! answers [`FromVm::Started`] (or `StartFailed`), then a `Reply` per
//! request whose `id` is not 0, and pushes `Console` output and, once,
//! `Exited`. Unknown fields and unknown versions are refused.
//!
//! Every message begins with its version header (`"version"`, the first
//! key: [`super::wire`]), checked before anything else of the message is
//! decoded. Version 2 is version 1 of session 5 renumbered, whose messages
//! had changed under the same number (no `park`/`unpark`, a scheduler gate
//! fd in `Hello` and after `files`, class pages): a version-1 VM process a
//! new daemon finds after an upgrade is refused with both versions named
//! (and reported not adopted), never half-understood.
//!
//! The rule, since: any change to a message (a new request, a new field,
//! a new variant) bumps [`PROTOCOL_VERSION`], so that two ends that
//! decode each other's messages always agree on all of them. Version 3:
//! [`Request::SetDiskWeight`] (a VM's weight, which its disks have in
//! their class's I/O group, changes live) and [`WireDisk::group_weight`].
//! A VM process of version 2 that a version-3 daemon finds after an
//! upgrade is not adopted (left running, reported `not_adopted` naming
//! both versions), as version 1's.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::vm::ExitReason;
use corral_devices::virtio::blk::{BlockStatsSnapshot, IoEngine};

/// The protocol's version; either end refuses a message of any other
/// (the header [`super::wire::send`] writes first in every message).
pub const PROTOCOL_VERSION: u32 = 3;

/// Largest datagram either side sends or accepts.
pub const MAX_MESSAGE: usize = 256 * 1024;

/// Largest console chunk in one [`FromVm::Console`].
pub const CONSOLE_CHUNK: usize = 16 * 1024;

/// The configuration message, the first one on the socket; its files
/// travel as SCM_RIGHTS, indexed by the `fd` fields. On the wire
/// `{"version":3,"vm":{..}}`: the version header is where version 1's
/// `Hello` had its `version` field.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    /// The VM.
    pub vm: VmSpec,
}

/// One VM, as the daemon configured it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSpec {
    /// Name.
    pub name: String,
    /// Identity of this run (stored in the daemon's state, checked when a
    /// daemon re-adopts the process).
    pub nonce: String,
    /// vCPUs.
    pub vcpus: u8,
    /// Guest RAM, MiB.
    pub memory_mib: u64,
    /// Kernel command line.
    pub cmdline: String,
    /// Console bytes kept.
    pub console_log_bytes: usize,
    /// ACPI tables.
    pub acpi: bool,
    /// Kernel: an index into the passed files, or `None` for the built-in
    /// guest of the binary.
    pub kernel: Option<PassedFile>,
    /// Initrd.
    pub initrd: Option<PassedFile>,
    /// Disks, in order.
    pub disks: Vec<DiskSpec>,
    /// The daemon's `gate` backend: the index among the passed files of
    /// the scheduler gate's memfd (`Gate::new_shared`), which the VM
    /// process maps as its vCPUs' gate (`Gate::from_fd`) and keeps, to
    /// give it back with [`Request::Files`].
    pub sched_gate: Option<usize>,
    /// Install the seccomp filters.
    pub seccomp: bool,
    /// Listen here for a daemon that re-adopts the process (0600).
    pub control_socket: Option<PathBuf>,
    /// Jail the process ([`crate::jail`]) before it touches guest data;
    /// `None`: not jailed (`corral serve --no-jail`).
    #[serde(default)]
    pub jail: Option<JailParams>,
}

/// How a VM process jails itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JailParams {
    /// Its uid and gid (one per VM, from the daemon's `--jail-uids`).
    pub uid: u32,
    /// In a pid namespace of its own (the jail forks: the process the
    /// launcher started stays outside as the reaper).
    #[serde(default)]
    pub pid_namespace: bool,
}

/// A file passed with the configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PassedFile {
    /// Index in the SCM_RIGHTS list.
    pub fd: usize,
    /// The path it was opened at (for messages).
    pub path: PathBuf,
}

/// One disk.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskSpec {
    /// Name within the VM.
    pub id: String,
    /// Its open file.
    pub file: PassedFile,
    /// Read-only.
    pub read_only: bool,
    /// O_DIRECT.
    pub direct: bool,
    /// Its own limits.
    pub limits: WireLimits,
    /// Its throttle group.
    pub group: Option<GroupSpec>,
    /// I/O engine (`sync`, `uring`); `None`: the default.
    pub engine: Option<String>,
}

/// An engine's name on the wire.
pub fn engine_name(e: IoEngine) -> String {
    e.as_str().to_string()
}

/// The engine of a name on the wire (an unknown one: the default).
pub fn engine_of(s: &str) -> Option<IoEngine> {
    match s {
        "sync" => Some(IoEngine::Sync),
        "uring" => Some(IoEngine::Uring),
        _ => None,
    }
}

/// A throttle group of the VM process, by name, with its limits and the
/// disk's weight in it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupSpec {
    /// Name (`class:NAME`).
    pub name: String,
    /// Limits (the VM process's own disks never get more than these allow
    /// them, whatever the group's page holds).
    pub limits: WireLimits,
    /// The disk's weight.
    pub weight: u32,
    /// The group's shared page (`crate::iopage`), as an index into this
    /// message's SCM_RIGHTS files: the group's buckets are then the ones
    /// the daemon and every VM process of the class share. `None`: a group
    /// of this process alone.
    #[serde(default)]
    pub page: Option<usize>,
}

/// [`corral_blkthrottle::Limits`] on the wire.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct WireLimits {
    pub bps: Option<u64>,
    pub rbps: Option<u64>,
    pub wbps: Option<u64>,
    pub iops: Option<u64>,
    pub riops: Option<u64>,
    pub wiops: Option<u64>,
    pub burst_bytes: Option<u64>,
    pub burst_ops: Option<u64>,
    pub onetime_bytes: Option<u64>,
    pub onetime_ops: Option<u64>,
}

impl From<corral_blkthrottle::Limits> for WireLimits {
    fn from(l: corral_blkthrottle::Limits) -> Self {
        WireLimits {
            bps: l.bps,
            rbps: l.rbps,
            wbps: l.wbps,
            iops: l.iops,
            riops: l.riops,
            wiops: l.wiops,
            burst_bytes: l.burst_bytes,
            burst_ops: l.burst_ops,
            onetime_bytes: l.onetime_bytes,
            onetime_ops: l.onetime_ops,
        }
    }
}

impl From<WireLimits> for corral_blkthrottle::Limits {
    fn from(l: WireLimits) -> Self {
        corral_blkthrottle::Limits {
            bps: l.bps,
            rbps: l.rbps,
            wbps: l.wbps,
            iops: l.iops,
            riops: l.riops,
            wiops: l.wiops,
            burst_bytes: l.burst_bytes,
            burst_ops: l.burst_ops,
            onetime_bytes: l.onetime_bytes,
            onetime_ops: l.onetime_ops,
        }
    }
}

/// A request from the daemon. `id` 0: no reply wanted.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToVm {
    /// Matches the reply.
    pub id: u64,
    /// What.
    pub req: Request,
}

/// What the daemon asks.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Request {
    /// [`Response::Status`].
    Status,
    /// [`Response::Stats`].
    Stats,
    /// A disk's own limits, live.
    SetDiskLimits {
        /// Disk.
        disk: String,
        /// New limits.
        limits: WireLimits,
    },
    /// Moves a disk into a group (created with these limits if the process
    /// has none of that name) or out of any.
    SetDiskGroup {
        /// Disk.
        disk: String,
        /// Group.
        group: Option<GroupSpec>,
    },
    /// Changes a disk's weight in its group (its VM's weight changed),
    /// keeping its place in line there; nothing to do for a disk in no
    /// group. Since version 3.
    SetDiskWeight {
        /// Disk.
        disk: String,
        /// New weight, 1..=10000.
        weight: u32,
    },
    /// Changes the limits of the process's group of that name, if any.
    SetGroupLimits {
        /// Group.
        name: String,
        /// Limits.
        limits: WireLimits,
    },
    /// Pauses the guest ([`Response::Bool`]: it was running).
    Pause,
    /// Resumes it ([`Response::Bool`]: it was paused).
    Resume,
    /// Stops the VM.
    Stop,
    /// ACPI power button ([`Response::Bool`]).
    PowerButton,
    /// Types on the serial console ([`Response::Count`]: bytes taken).
    ConsoleInput {
        /// Bytes.
        data: Vec<u8>,
    },
    /// Sends console output again from this offset (a daemon that
    /// re-adopts the process).
    ConsoleFrom {
        /// Absolute offset.
        offset: u64,
    },
    /// The VM process's files (kernel, initrd, disks) as SCM_RIGHTS, with
    /// [`Response::Files`] (their paths): a daemon that re-adopts the
    /// process books their images again (the same open files: the same
    /// locks). After them, one more fd if the process has a scheduler
    /// gate: its memfd, which the daemon maps as the gate's owner again
    /// (`Gate::reattach`) before `Adopt`.
    Files,
    /// The daemon on this connection supervises the process from now on:
    /// output and the exit go to it, console output from `console_from`.
    Adopt {
        /// Absolute console offset to send from.
        console_from: u64,
        /// The daemon owns the scheduler gate again (it re-attached the
        /// memfd that came with [`Request::Files`]): obey it (it was open while
        /// unsupervised). Without, it stays open.
        #[serde(default)]
        sched_gate: bool,
    },
}

/// An answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Response {
    /// Done.
    Ok,
    /// Refused or failed.
    Error {
        /// Why.
        message: String,
        /// What kind of failure, for the API's status.
        #[serde(default)]
        kind: ErrorKind,
    },
    /// Yes or no.
    Bool(bool),
    /// A count.
    Count(usize),
    /// The VM's state.
    Status(Status),
    /// Its counters.
    Stats(Box<Stats>),
    /// The paths of the files passed with this answer, in order.
    Files(Vec<PathBuf>),
}

/// What a VM process that ended leaves beside its control socket
/// (`NAME.exit`), for a daemon that was not there to hear it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExitRecord {
    /// VM name.
    pub name: String,
    /// The run's identity.
    pub nonce: String,
    /// Why it ended.
    pub reason: ExitReason,
}

/// The kinds of [`crate::vm::VmError`] the API answers differently.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Anything else (a bad request).
    #[default]
    Other,
    /// No such disk (404).
    NoSuchDisk,
    /// The VM has stopped (409).
    Stopped,
    /// The device thread did not answer in time (503), after `ms`.
    DeviceUnresponsive,
}

impl ErrorKind {
    /// The kind of `e`.
    pub fn of(e: &crate::vm::VmError) -> Self {
        use crate::vm::VmError;
        match e {
            VmError::NoSuchDisk(_) => Self::NoSuchDisk,
            VmError::Stopped(_) => Self::Stopped,
            VmError::DeviceUnresponsive { .. } => Self::DeviceUnresponsive,
            _ => Self::Other,
        }
    }

    /// The error for VM `vm` with `message`.
    pub fn error(self, vm: &str, message: String) -> crate::vm::VmError {
        use crate::vm::VmError;
        match self {
            Self::Other => VmError::Config(message),
            Self::NoSuchDisk => VmError::NoSuchDisk(message),
            Self::Stopped => VmError::Stopped(vm.to_string()),
            Self::DeviceUnresponsive => VmError::DeviceUnresponsive {
                vm: vm.to_string(),
                ms: 5000,
            },
        }
    }
}

/// What a VM process says about itself.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Status {
    /// VM name.
    pub name: String,
    /// Identity of the run.
    pub nonce: String,
    /// Process id.
    pub pid: u32,
    /// Paused by the host.
    pub paused: bool,
    /// The scheduler gate is parked.
    pub parked: bool,
    /// No daemon supervises the process: shares are not enforced, the last
    /// limits hold.
    pub unsupervised: bool,
    /// Why it stopped, if it did.
    pub exit: Option<ExitReason>,
    /// vCPU thread ids.
    pub vcpu_tids: Vec<i32>,
    /// Device thread id.
    pub device_tid: Option<i32>,
    /// Seconds since the VM started.
    pub uptime_secs: f64,
}

/// Counters of a VM process.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stats {
    /// Per disk.
    pub disks: Vec<WireDisk>,
    /// vCPU exits by kind, summed.
    pub exits: Vec<(String, u64)>,
    /// Guest-caused errors: (device, kind, count).
    pub guest_errors: Vec<(String, String, u64)>,
    /// Unclaimed accesses: pio reads, pio writes, mmio reads, mmio writes.
    pub unknown_accesses: (u64, u64, u64, u64),
}

/// One disk's status.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct WireDisk {
    pub name: String,
    pub path: PathBuf,
    pub read_only: bool,
    pub direct: bool,
    pub capacity_bytes: u64,
    pub limits: WireLimits,
    pub group: Option<String>,
    /// The disk's weight in `group` (since version 3).
    pub group_weight: Option<u32>,
    pub stats: WireStats,
    pub device: BlockStatsSnapshot,
    pub engine: String,
}

/// [`corral_blkthrottle::Stats`] on the wire.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct WireStats {
    pub read: WireOp,
    pub write: WireOp,
    pub other: WireOp,
    pub throttled_requests: u64,
    pub throttled_ns: u64,
    pub queue_depth: u64,
}

/// One op kind's counters.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct WireOp {
    pub ops: u64,
    pub bytes: u64,
    pub latency_counts: Vec<u64>,
    pub latency_sum_ns: u64,
}

impl From<&corral_blkthrottle::OpStats> for WireOp {
    fn from(o: &corral_blkthrottle::OpStats) -> Self {
        WireOp {
            ops: o.ops,
            bytes: o.bytes,
            latency_counts: o.latency.counts.to_vec(),
            latency_sum_ns: o.latency.sum_ns,
        }
    }
}

impl From<&WireOp> for corral_blkthrottle::OpStats {
    fn from(o: &WireOp) -> Self {
        let mut s = corral_blkthrottle::OpStats {
            ops: o.ops,
            bytes: o.bytes,
            ..Default::default()
        };
        for (d, v) in s.latency.counts.iter_mut().zip(&o.latency_counts) {
            *d = *v;
        }
        s.latency.sum_ns = o.latency_sum_ns;
        s
    }
}

impl From<&corral_blkthrottle::Stats> for WireStats {
    fn from(s: &corral_blkthrottle::Stats) -> Self {
        WireStats {
            read: (&s.read).into(),
            write: (&s.write).into(),
            other: (&s.other).into(),
            throttled_requests: s.throttled_requests,
            throttled_ns: s.throttled_ns,
            queue_depth: s.queue_depth,
        }
    }
}

impl From<&WireStats> for corral_blkthrottle::Stats {
    fn from(s: &WireStats) -> Self {
        corral_blkthrottle::Stats {
            read: (&s.read).into(),
            write: (&s.write).into(),
            other: (&s.other).into(),
            throttled_requests: s.throttled_requests,
            throttled_ns: s.throttled_ns,
            queue_depth: s.queue_depth,
        }
    }
}

/// What a VM process sends.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum FromVm {
    /// The VM runs.
    Started(Status),
    /// It could not start (the process exits).
    StartFailed {
        /// Why.
        message: String,
    },
    /// The answer to request `id`.
    Reply {
        /// The request's id.
        id: u64,
        /// The answer.
        resp: Response,
    },
    /// Console output from absolute offset `offset`.
    Console {
        /// Offset of the first byte.
        offset: u64,
        /// Bytes.
        data: Vec<u8>,
    },
    /// The VM ended (the process exits after this).
    Exited {
        /// Why.
        reason: ExitReason,
        /// The last counters.
        stats: Box<Stats>,
    },
}
