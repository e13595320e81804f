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

mod cgplace;
mod classes;
mod error;
mod io;
mod launch;
mod lifecycle;
mod model;
mod readopt;
mod run;
pub mod state;
mod vms;

pub use error::{ErrorKind, ManagerError};
pub use lifecycle::MAX_SHUTDOWN_TIMEOUT;
pub use model::*;
pub use run::{VmProcesses, VmRun};

use io::set_class_group;

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

use crate::daemon::cgroup::CgroupBackend;
use crate::daemon::cpusched::CpuScheduler;
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
/// Most disks per VM (one IRQ of the VMM's pool each).
pub use crate::vm::MAX_DISKS;
/// Most vCPUs per VM accepted by the manager (KVM may allow fewer).
pub const MAX_VM_VCPUS: u32 = 254;
/// Most classes by default (`--max-classes`).
pub const DEFAULT_MAX_CLASSES: usize = 1024;

/// One hosted VM.
struct Entry {
    id: VmId,
    name: String,
    request: VmRequest,
    cmdline: String,
    handle: VmRun,
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
    /// A VM entry for `request` (already validated), run by `handle`;
    /// `reaped` when the handle holds nothing to give back (a definition
    /// reloaded after a restart).
    fn new(
        id: VmId,
        name: String,
        cmdline: String,
        handle: VmRun,
        request: VmRequest,
        reaped: bool,
    ) -> Self {
        Entry {
            id,
            name,
            cmdline,
            handle,
            created: SystemTime::now(),
            class: Mutex::new(request.class.clone()),
            weight: AtomicU32::new(request.weight),
            cap: AtomicU32::new(request.cap.unwrap_or(0)),
            disks: Mutex::new(
                request
                    .disks
                    .iter()
                    .map(|d| DiskInfo {
                        config: d.clone(),
                        capacity_bytes: 0,
                        stats: None,
                        group: None,
                        group_weight: None,
                        engine: None,
                    })
                    .collect(),
            ),
            cpu_ns: Mutex::new(vec![0; request.vcpus as usize]),
            reaped: std::sync::atomic::AtomicBool::new(reaped),
            request,
        }
    }

    fn state(&self) -> (VmState, Option<ExitReason>) {
        match self.handle.exit_reason() {
            None if self.handle.is_paused() => (VmState::Paused, None),
            None => (VmState::Running, None),
            Some(r) => {
                let s = match r {
                    ExitReason::GuestShutdown => VmState::Shutdown,
                    ExitReason::Stopped | ExitReason::DaemonRestarted => VmState::Stopped,
                    ExitReason::Fatal { .. }
                    | ExitReason::ThreadFault { .. }
                    | ExitReason::ProcessGone { .. }
                    | ExitReason::NotAdopted { .. } => VmState::Failed,
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
                d.group_weight = live.group_weight;
                d.engine = Some(live.engine);
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
    class_io: BTreeMap<String, Limits>,
    /// Each class's I/O group: one throttle group shared by all disks of the
    /// class's VMs, with the class's `io` limits.
    class_groups: BTreeMap<String, ThrottleGroup>,
    /// The shared page of each class group (VM processes: `io::set_class_group`).
    class_pages: BTreeMap<String, Arc<std::os::fd::OwnedFd>>,
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
    /// The state file and which VMs are meant to run; held across every
    /// change the API makes, and its write ([`state`]).
    persist: Mutex<state::Persist>,
}

impl std::fmt::Debug for Manager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Manager").finish_non_exhaustive()
    }
}

pub use crate::threadclock::thread_cpu_ns;

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
            set_class_group(&mut state, name, &c.io, cfg.vm_processes.is_some())?;
        }
        let memory_budget_mib = cfg
            .memory_budget_mib
            .or_else(|| crate::vm::host_memory_mib().map(default_memory_budget_mib))
            .unwrap_or(u64::MAX);
        let cgroup = match cfg.cpu_backend {
            CpuBackend::Cgroup => {
                // Named after the state directory, so the next daemon on it
                // finds the groups of the VM processes that outlive this one.
                let placement = match cfg.vm_processes {
                    Some(_) => crate::daemon::cgroup::Placement::Processes,
                    None => crate::daemon::cgroup::Placement::Threads,
                };
                let instance = crate::daemon::cgroup::instance_name(cfg.state_dir.as_deref());
                let cg = CgroupBackend::open(&instance, placement)
                    .map_err(|e| ManagerError::Invalid(format!("cgroup backend: {e}")))?;
                tracing::info!(root = %cg.root().display(), ?placement, "cgroup backend");
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
            memory_budget_mib,
            images: ImageBook::default(),
            persist: Mutex::new(state::Persist::new(cfg.state_dir.clone())),
            cfg,
        })
    }

    /// The scheduler (model + policy) that the scheduler thread ticks.
    pub fn scheduler(&self) -> &Arc<Mutex<Scheduler>> {
        &self.sched
    }

    pub(super) fn sched(&self) -> MutexGuard<'_, Scheduler> {
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
        // VM processes that outlive the daemon are left as they are (their
        // files, locks and groups are theirs); the next daemon adopts them.
        let keep = self
            .cfg
            .vm_processes
            .as_ref()
            .is_some_and(|p| p.keep_running);
        let (left, entries): (Vec<_>, Vec<_>) = entries
            .into_iter()
            .partition(|e| keep && e.handle.remote().is_some() && e.handle.exit_reason().is_none());
        for e in &left {
            self.cpu.detach(e.id);
        }
        if !left.is_empty() {
            tracing::info!(
                vms = left.len(),
                "VM processes left running for the next daemon"
            );
        }
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
        // The daemon's process may end without dropping the manager (an
        // API task still holds it): the empty groups go now.
        if let Some(cg) = &self.cgroup {
            cg.remove_empty();
        }
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

/// A manager for unit tests: no KVM, no scheduler thread, no cgroups; 2
/// CPUs; a built-in guest that is never started (every test is refused
/// before a VM starts).
#[cfg(test)]
pub(super) fn test_manager(f: impl FnOnce(&mut ManagerConfig)) -> Manager {
    let mut cfg = ManagerConfig {
        capacity: Some(Capacity::from_cpus(2)),
        cpu_backend: CpuBackend::None,
        memory_budget_mib: Some(1024),
        builtin_kernel: Some(Arc::from(&b"not a kernel"[..])),
        ..ManagerConfig::default()
    };
    f(&mut cfg);
    Manager::new(cfg).expect("Manager::new needs no KVM")
}
