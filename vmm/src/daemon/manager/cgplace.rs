//! The `cgroup` CPU backend as the manager drives it ([`crate::daemon::cgroup`]):
//! where a VM goes when it starts, moves or is re-adopted, and the groups a
//! restarted daemon removes.
//!
//! - A VM in a process of its own: its group is made (weight, its own cap)
//!   before the process exists, and the daemon writes the process's pid into
//!   the group's `cgroup.procs` between the launcher's spawn and the VM's
//!   configuration ([`crate::vmproc::remote::RemoteVm::start`]'s `spawned`),
//!   so every thread it starts is born in the group. A live move writes its
//!   pid and thread ids (the host's) to the new group's `cgroup.procs`,
//!   which moves each thread group they belong to (the pid-namespace child
//!   of a jailed VM process too), then removes the old group.
//! - A VM in the daemon (`--vm-mode thread`): its vCPU and device threads by
//!   tid, after it started.
//! - After a restart the groups are found by path (the instance name comes
//!   from the state directory, [`crate::daemon::cgroup::instance_name`]): each
//!   re-adopted VM's group gets its weight and cap again and its process is
//!   written again (a no-op when it is there); then every group that no
//!   class and no running VM names is removed ([`Manager::cg_prune`]).

use std::collections::BTreeSet;

use super::*;
use crate::daemon::cgroup::CgroupError;
use crate::vmproc::remote::RemoteVm;

/// The threads whose CPU time is a VM's: its vCPUs and its device thread
/// (which serves its I/O), for the cgroup backend.
fn vm_threads(h: &VmRun) -> Vec<libc::pid_t> {
    let mut t = h.vcpu_tids().to_vec();
    t.extend(h.device_tid());
    t
}

/// Host ids that reach every process of a VM process
/// ([`crate::vmproc::hostids::HostIds`]): the launcher's child (the jail's
/// outer process, with a pid namespace), the process that runs the VM, and
/// its threads; `cgroup.procs` moves the whole thread group of each. Never
/// 0 or 1 (a pid that is not the host's must not move the host's init).
fn process_ids(vm: &RemoteVm) -> Vec<libc::pid_t> {
    let ids = vm.host_ids();
    let mut out: Vec<libc::pid_t> = [ids.outer, ids.pid]
        .into_iter()
        .filter_map(|p| libc::pid_t::try_from(p).ok())
        .collect();
    out.extend(&ids.vcpu_tids);
    out.extend(ids.device_tid);
    out.retain(|&i| i > 1);
    out.dedup();
    out
}

/// VM process `vm` (running) in VM `name`'s group under class path `path`.
fn place_process(
    cg: &CgroupBackend,
    path: &str,
    name: &str,
    weight: u32,
    cap: Option<u32>,
    vm: &RemoteVm,
) -> Result<(), CgroupError> {
    cg.prepare_vm(path, name, weight, cap)?;
    cg.add_processes(path, name, &process_ids(vm))
}

pub(super) fn cg_err(e: CgroupError) -> ManagerError {
    ManagerError::Invalid(format!("cgroup backend: {e}"))
}

impl Manager {
    /// With the cgroup backend: makes the group of VM `name` of `class` for
    /// a VM process about to start (before it exists, so its weight and cap
    /// hold from its first instruction); returns its class path.
    pub(super) fn cg_prepare(
        &self,
        class: &str,
        name: &str,
        weight: u32,
        cap: Option<u32>,
    ) -> Result<Option<String>, ManagerError> {
        let Some(cg) = &self.cgroup else {
            return Ok(None);
        };
        let path = self.cg_path(class);
        cg.prepare_vm(&path, name, weight, cap).map_err(cg_err)?;
        Ok(Some(path))
    }

    /// With the cgroup backend: moves VM process `pid` into the group made
    /// by [`Self::cg_prepare`] (`path` is what it returned).
    pub(super) fn cg_add_process(
        &self,
        path: Option<&str>,
        name: &str,
        pid: u32,
    ) -> Result<(), VmError> {
        let (Some(cg), Some(path)) = (&self.cgroup, path) else {
            return Ok(());
        };
        let pid = libc::pid_t::try_from(pid)
            .map_err(|_| VmError::Config(format!("VM process pid {pid} out of range")))?;
        cg.add_processes(path, name, &[pid])
            .map_err(|e| VmError::Config(format!("cgroup backend: {e}")))
    }

    /// With the cgroup backend: places running VM `name` in its group under
    /// class path `path` with `weight` and its own `cap` (a start in the
    /// daemon, a live move, a re-adoption).
    pub(super) fn cg_place(
        &self,
        path: &str,
        name: &str,
        weight: u32,
        cap: Option<u32>,
        run: &VmRun,
    ) -> Result<(), CgroupError> {
        let Some(cg) = &self.cgroup else {
            return Ok(());
        };
        match run {
            VmRun::Local(_) => cg
                .place_vm(path, name, weight, &vm_threads(run))
                .and_then(|()| cg.set_vm_cap(path, name, cap)),
            VmRun::Remote(vm) => place_process(cg, path, name, weight, cap, vm),
        }
    }

    /// A re-adopted VM process back in its group (see the module docs).
    pub(super) fn cg_readopt(&self, name: &str, req: &VmRequest, vm: &RemoteVm) {
        let Some(cg) = &self.cgroup else {
            return;
        };
        let path = self.cg_path(&req.class);
        match place_process(cg, &path, name, req.weight, req.cap, vm) {
            Ok(()) => tracing::info!(vm = name, group = path, "re-adopted VM in its cgroup"),
            Err(e) => tracing::warn!(vm = name, "cgroup backend: re-adopted VM not placed: {e}"),
        }
    }

    /// After a restart: removes the groups of the last daemon that no class
    /// and no running VM of this one names (VMs that ended while no daemon
    /// ran, classes that are gone). A group that still holds a task stays
    /// (a stray VM process being stopped): the next prune, or the daemon's
    /// exit, removes it.
    pub(super) fn cg_prune(&self) {
        let Some(cg) = &self.cgroup else {
            return;
        };
        let running: Vec<(String, String)> = lock(&self.state)
            .vms
            .values()
            .filter(|e| e.handle.exit_reason().is_none())
            .map(|e| (lock(&e.class).clone(), e.name.clone()))
            .collect();
        let classes: Vec<String> = self
            .sched()
            .model()
            .classes()
            .map(|(n, _)| n.to_string())
            .collect();
        let mut keep = BTreeSet::new();
        for c in &classes {
            if let Ok(d) = cg.class_dir(&self.cg_path(c)) {
                keep.insert(d);
            }
        }
        for (class, vm) in &running {
            if let Ok(d) = cg.vm_dir(&self.cg_path(class), vm) {
                keep.insert(d);
            }
        }
        let removed = cg.prune(&keep);
        if removed > 0 {
            tracing::info!(
                removed,
                root = %cg.root().display(),
                "cgroup backend: stale groups of the last daemon removed"
            );
        }
    }
}
