//! State that survives the daemon: classes (with their parents, caps,
//! reservations and I/O limits), VM definitions (the create request, with
//! the VM's current class, weight, cap and disk limits) and whether each VM
//! is meant to run, in `state.json` in the state directory.
//!
//! Every change the API makes goes through the wrappers here: they take the
//! [`Persist`] lock (so changes and their writes are serialized), make the
//! change in memory, write the whole state (temp file, fsync, link the old
//! file to `state.json.bak`, rename, fsync the directory) and, if the write
//! fails, undo the change and answer [`ManagerError::Storage`] (507).
//! Stopping and deleting are written first, then done (they cannot be
//! undone). Nothing here runs without a state directory.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{
    ClassConfig, ClassInfo, DiskInfo, Entry, Limits, Manager, ManagerError, State, VmInfo,
    VmRequest, VmRun, lock, validate_name,
};
use crate::handle::VmHandle;
use crate::vm::ExitReason;
use corral_scheduler::{ClassSpec, VmId};

#[cfg(test)]
mod compat_tests;
mod format;
use format::write_atomic;
pub use format::{
    BACKUP_FILE, STATE_FILE, STATE_VERSION, SavedClass, SavedProcess, SavedVm, StateFile,
    parse_state, read_state,
};

/// Where the state goes and which VMs are meant to run. Its lock is held
/// across each change and its write.
#[derive(Debug, Default)]
pub struct Persist {
    dir: Option<PathBuf>,
    wanted: BTreeSet<String>,
}

impl Persist {
    pub(super) fn new(dir: Option<PathBuf>) -> Self {
        Self {
            dir,
            wanted: BTreeSet::new(),
        }
    }
}

/// What [`Manager::restore`] loaded.
#[derive(Debug, Clone, Copy, Default)]
pub struct Restored {
    /// Classes.
    pub classes: usize,
    /// VM definitions.
    pub vms: usize,
    /// VMs started again (`--restart-vms`).
    pub started: usize,
    /// VM processes that outlived the last daemon, supervised again.
    pub adopted: usize,
}

impl Manager {
    /// The state as it is in memory (classes in tree order).
    fn snapshot(&self, st: &State, p: &Persist) -> StateFile {
        let all: Vec<SavedClass> = {
            let s = self.sched();
            s.model()
                .classes_with_parents()
                .map(|(name, spec, parent)| SavedClass {
                    name: name.to_string(),
                    parent: parent.map(str::to_string),
                    shares: spec.shares,
                    cap: spec.cap,
                    reservation: spec.reservation,
                    io: st.class_io.get(name).copied().unwrap_or_default(),
                })
                .collect()
        };
        let mut classes: Vec<SavedClass> = Vec::with_capacity(all.len());
        let mut placed = BTreeSet::new();
        loop {
            let before = classes.len();
            for c in &all {
                if !placed.contains(&c.name) && c.parent.as_ref().is_none_or(|p| placed.contains(p))
                {
                    placed.insert(c.name.clone());
                    classes.push(c.clone());
                }
            }
            if classes.len() == before {
                break;
            }
        }
        let vms = st
            .vms
            .values()
            .map(|e| {
                let r = &e.request;
                let cap = e.cap.load(Ordering::Relaxed);
                SavedVm {
                    name: e.name.clone(),
                    class: lock(&e.class).clone(),
                    weight: e.weight.load(Ordering::Relaxed),
                    cap: (cap > 0).then_some(cap),
                    vcpus: r.vcpus,
                    memory_mib: r.memory_mib,
                    kernel: r.kernel.clone(),
                    initrd: r.initrd.clone(),
                    cmdline: r.cmdline.clone(),
                    disks: lock(&e.disks).iter().map(|d| d.config.clone()).collect(),
                    running: p.wanted.contains(&e.name),
                    process: match e.handle.exit_reason() {
                        // Kept for a daemon that speaks its version.
                        Some(ExitReason::NotAdopted { pid, nonce, .. }) => {
                            Some(SavedProcess { pid, nonce })
                        }
                        Some(_) => None,
                        None => e.handle.remote().map(|r| SavedProcess {
                            pid: r.pid(),
                            nonce: r.nonce().to_string(),
                        }),
                    },
                }
            })
            .collect();
        StateFile {
            version: STATE_VERSION,
            classes,
            vms,
        }
    }

    /// Writes the state (less the VM `without`); a no-op without a state
    /// directory.
    fn save(&self, p: &Persist, without: Option<&str>) -> Result<(), ManagerError> {
        let Some(dir) = &p.dir else {
            return Ok(());
        };
        let mut file = self.snapshot(&lock(&self.state), p);
        if let Some(n) = without {
            file.vms.retain(|v| v.name != n);
        }
        let data = serde_json::to_vec_pretty(&file)
            .map_err(|e| ManagerError::Storage(format!("serializing the state: {e}")))?;
        write_atomic(dir, &data).map_err(|e| {
            tracing::error!(dir = %dir.display(), "writing the state file: {e}");
            ManagerError::Storage(format!(
                "the change was not made: writing {} failed: {e}",
                dir.join(STATE_FILE).display()
            ))
        })
    }

    /// Makes a change, writes it, and undoes it if the write fails.
    fn commit<T>(
        &self,
        p: &mut Persist,
        change: impl FnOnce(&Self, &mut Persist) -> Result<T, ManagerError>,
        undo: impl FnOnce(&Self, &mut Persist, &T),
    ) -> Result<T, ManagerError> {
        let v = change(self, p)?;
        if let Err(e) = self.save(p, None) {
            undo(self, p, &v);
            return Err(e);
        }
        Ok(v)
    }

    fn class_now(&self, name: &str) -> Option<(ClassConfig, Option<String>)> {
        let st = lock(&self.state);
        let s = self.sched();
        let cpu = *s.model().class(name)?;
        let parent = s.model().class_parent(name).map(str::to_string);
        let io = st.class_io.get(name).copied().unwrap_or_default();
        Some((ClassConfig { cpu, io }, parent))
    }

    fn restore_class(&self, name: &str, old: Option<(ClassConfig, Option<String>)>) {
        let r = match old {
            Some((cfg, parent)) => self
                .set_class_in_live(name, cfg, parent.as_deref())
                .map(|_| ()),
            None => self.delete_class_live(name),
        };
        if let Err(e) = r {
            tracing::error!(class = name, "undoing a change that was not saved: {e}");
        }
    }

    /// Creates a class under `parent` (a root class with `None`); 404 for
    /// an unknown parent, 400 past the depth limit (8).
    pub fn create_class_in(
        &self,
        name: &str,
        cfg: ClassConfig,
        parent: Option<&str>,
    ) -> Result<ClassInfo, ManagerError> {
        let mut p = lock(&self.persist);
        self.commit(
            &mut p,
            |m, _| m.create_class_in_live(name, cfg, parent),
            |m, _, _| m.restore_class(name, None),
        )
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
        let mut p = lock(&self.persist);
        let old = self.class_now(name);
        self.commit(
            &mut p,
            |m, _| m.set_class_in_live(name, cfg, parent),
            |m, _, _| m.restore_class(name, old),
        )
    }

    /// Changes a class with a function of its current configuration.
    pub fn update_class(
        &self,
        name: &str,
        f: impl FnOnce(&mut ClassConfig),
    ) -> Result<ClassInfo, ManagerError> {
        let mut p = lock(&self.persist);
        let old = self.class_now(name);
        self.commit(
            &mut p,
            |m, _| m.update_class_live(name, f),
            |m, _, _| m.restore_class(name, old),
        )
    }

    /// Deletes an empty class; 409 while VMs are in it.
    pub fn delete_class(&self, name: &str) -> Result<(), ManagerError> {
        let mut p = lock(&self.persist);
        let old = self.class_now(name);
        self.commit(
            &mut p,
            |m, _| m.delete_class_live(name),
            |m, _, _| {
                if let Some((cfg, parent)) = old
                    && let Err(e) = m.create_class_in_live(name, cfg, parent.as_deref())
                {
                    tracing::error!(class = name, "undoing a change that was not saved: {e}");
                }
            },
        )
    }

    /// Creates and starts a VM. Blocks while it starts (milliseconds).
    pub fn create_vm(&self, req: VmRequest) -> Result<VmInfo, ManagerError> {
        let mut p = lock(&self.persist);
        self.commit(
            &mut p,
            |m, p| {
                let info = m.create_vm_live(req)?;
                p.wanted.insert(info.name.clone());
                Ok(info)
            },
            |m, p, info| {
                p.wanted.remove(&info.name);
                let _ = m.delete_vm_live(&info.name);
            },
        )
    }

    /// Runs a stopped VM again from its definition (same name, class,
    /// weight, cap, kernel, disks and limits): its files are opened and
    /// locked anew and its resources booked anew, under the same checks as
    /// `create`. 409 while it runs.
    pub fn start_vm(&self, name: &str) -> Result<VmInfo, ManagerError> {
        let mut p = lock(&self.persist);
        let was = p.wanted.contains(name);
        self.commit(
            &mut p,
            |m, p| {
                let info = m.start_vm_live(name)?;
                p.wanted.insert(name.to_string());
                Ok(info)
            },
            |m, p, _| {
                if !was {
                    p.wanted.remove(name);
                }
                let _ = m.stop_vm_live(name);
            },
        )
    }

    /// Records that `name` is no longer meant to run (written first: a stop
    /// cannot be undone).
    fn save_not_wanted(&self, p: &mut Persist, name: &str) -> Result<(), ManagerError> {
        self.entry(name)?;
        if p.wanted.remove(name)
            && let Err(e) = self.save(p, None)
        {
            p.wanted.insert(name.to_string());
            return Err(e);
        }
        Ok(())
    }

    /// Stops a VM at once (like pulling the plug) and keeps its definition;
    /// `start` runs it again. Stopping a stopped VM is not an error.
    pub fn stop_vm(&self, name: &str) -> Result<VmInfo, ManagerError> {
        let mut p = lock(&self.persist);
        self.save_not_wanted(&mut p, name)?;
        self.stop_vm_live(name)
    }

    /// Presses the VM's power button and waits up to `timeout` for the guest
    /// to power off; stops it hard if it has not by then. Returns the VM
    /// with how it ended (`shutdown` when the guest complied, `stopped`
    /// otherwise).
    pub fn shutdown_vm(&self, name: &str, timeout: Duration) -> Result<VmInfo, ManagerError> {
        if timeout > super::MAX_SHUTDOWN_TIMEOUT {
            return Err(ManagerError::Invalid(format!(
                "timeout must be at most {} s",
                super::MAX_SHUTDOWN_TIMEOUT.as_secs()
            )));
        }
        // Not held while the guest takes its time.
        self.save_not_wanted(&mut lock(&self.persist), name)?;
        self.shutdown_vm_live(name, timeout)
    }

    /// Stops a VM, frees it and returns its last snapshot. Blocks until its
    /// threads are gone.
    pub fn delete_vm(&self, name: &str) -> Result<VmInfo, ManagerError> {
        let mut p = lock(&self.persist);
        self.entry(name)?;
        let was = p.wanted.remove(name);
        if let Err(e) = self.save(&p, Some(name)) {
            if was {
                p.wanted.insert(name.to_string());
            }
            return Err(e);
        }
        self.delete_vm_live(name)
    }

    /// Sets or removes a VM's own CPU cap (percent of one CPU), live: the
    /// gate backend's policy and the cgroup backend (`cpu.max` of the VM's
    /// group) apply it from their next tick / at once.
    pub fn set_vm_cap(&self, name: &str, cap: Option<u32>) -> Result<VmInfo, ManagerError> {
        let mut p = lock(&self.persist);
        let old = self.entry(name)?.cap.load(Ordering::Relaxed);
        self.commit(
            &mut p,
            |m, _| m.set_vm_cap_live(name, cap),
            |m, _, _| {
                let _ = m.set_vm_cap_live(name, (old > 0).then_some(old));
            },
        )
    }

    /// Sets a VM's weight in its class, live: its share of the class's CPU
    /// and of the class's I/O group (its disks keep their place there). A
    /// move to its own class with the new weight.
    pub fn set_vm_weight(&self, name: &str, weight: u32) -> Result<VmInfo, ManagerError> {
        let class = lock(&self.entry(name)?.class).clone();
        self.move_vm(name, &class, Some(weight))
    }

    /// Moves a VM to another class (live), optionally with a new weight.
    pub fn move_vm(
        &self,
        name: &str,
        class: &str,
        weight: Option<u32>,
    ) -> Result<VmInfo, ManagerError> {
        let mut p = lock(&self.persist);
        let e = self.entry(name)?;
        let (old_class, old_weight) = (lock(&e.class).clone(), e.weight.load(Ordering::Relaxed));
        self.commit(
            &mut p,
            |m, _| m.move_vm_live(name, class, weight),
            |m, _, _| {
                let _ = m.move_vm_live(name, &old_class, Some(old_weight));
            },
        )
    }

    /// Changes a disk's limits live.
    pub fn set_disk_limits(
        &self,
        name: &str,
        disk: &str,
        limits: Limits,
    ) -> Result<DiskInfo, ManagerError> {
        let mut p = lock(&self.persist);
        let old = lock(&self.entry(name)?.disks)
            .iter()
            .find(|d| d.config.id == disk)
            .map(|d| d.config.limits);
        self.commit(
            &mut p,
            |m, _| m.set_disk_limits_live(name, disk, limits),
            |m, _, _| {
                if let Some(old) = old {
                    let _ = m.set_disk_limits_live(name, disk, old);
                }
            },
        )
    }

    /// Loads a state file into a manager that has just been made: classes
    /// in tree order, then every VM definition, stopped (exit reason
    /// `daemon_restarted`); with `restart`, starts those meant to run.
    /// Checks every class and VM before it loads any; an error means the
    /// daemon must not serve this manager. Writes the state once loaded.
    pub fn restore(&self, file: &StateFile, restart: bool) -> Result<Restored, ManagerError> {
        let mut p = lock(&self.persist);
        let bad = |what: String| ManagerError::Invalid(format!("state file: {what}"));
        let mut names = BTreeSet::new();
        for c in &file.classes {
            validate_name("class name", &c.name).map_err(|e| bad(e.to_string()))?;
            if let Some(parent) = &c.parent
                && !names.contains(parent)
            {
                return Err(bad(format!(
                    "class {:?} comes before its parent {parent:?}",
                    c.name
                )));
            }
            if !names.insert(c.name.clone()) {
                return Err(bad(format!("class {:?} appears twice", c.name)));
            }
            let cpu = ClassSpec {
                shares: c.shares,
                cap: c.cap,
                reservation: c.reservation,
            };
            cpu.validate()
                .map_err(|e| bad(format!("class {:?}: {e}", c.name)))?;
            c.io.validate()
                .map_err(|e| bad(format!("class {:?}: {e}", c.name)))?;
        }
        let mut vms = BTreeSet::new();
        let mut reqs = Vec::with_capacity(file.vms.len());
        for v in &file.vms {
            if !names.contains(&v.class) {
                return Err(bad(format!(
                    "VM {:?} is in unknown class {:?}",
                    v.name, v.class
                )));
            }
            if !vms.insert(v.name.clone()) {
                return Err(bad(format!("VM {:?} appears twice", v.name)));
            }
            let mut req = v.request();
            self.validate_request(&mut req)
                .map_err(|e| bad(format!("VM {:?}: {e}", v.name)))?;
            reqs.push((v, req));
        }
        if reqs.len() > self.cfg.max_vms.saturating_mul(4) {
            return Err(bad(format!(
                "{} VMs, more than this daemon keeps (4 x --max-vms)",
                reqs.len()
            )));
        }
        for c in &file.classes {
            let cfg = ClassConfig {
                cpu: ClassSpec {
                    shares: c.shares,
                    cap: c.cap,
                    reservation: c.reservation,
                },
                io: c.io,
            };
            self.set_class_in_live(&c.name, cfg, c.parent.as_deref())
                .map_err(|e| bad(format!("class {:?}: {e}", c.name)))?;
        }
        {
            let mut st = lock(&self.state);
            for (v, req) in reqs {
                let handle = VmHandle::defined(&v.name, ExitReason::DaemonRestarted)?;
                let cmdline = req.cmdline.clone().unwrap_or_default();
                let entry = Entry::new(
                    VmId(st.next_id),
                    v.name.clone(),
                    cmdline,
                    VmRun::Local(handle),
                    req,
                    true,
                );
                st.next_id += 1;
                st.vms.insert(v.name.clone(), Arc::new(entry));
            }
        }
        p.wanted = file
            .vms
            .iter()
            .filter(|v| v.running)
            .map(|v| v.name.clone())
            .collect();
        let adopted = self.readopt(file);
        // The cgroup groups of VMs that ended while no daemon ran.
        self.cg_prune();
        let mut started = 0;
        if restart {
            for name in p.wanted.clone() {
                if adopted.contains(&name) {
                    continue;
                }
                match self.start_vm_live(&name) {
                    Ok(_) => started += 1,
                    Err(e) => tracing::warn!(vm = name, "--restart-vms: not started: {e}"),
                }
            }
        }
        self.save(&p, None)?;
        Ok(Restored {
            classes: file.classes.len(),
            vms: file.vms.len(),
            started,
            adopted: adopted.len(),
        })
    }
}
