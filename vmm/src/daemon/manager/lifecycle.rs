//! A VM's life after `create`: stop (keeping the definition), start again,
//! reboot, a graceful shutdown through the ACPI power button with a
//! deadline, console input, and the reaping that gives a VM's resources back
//! once it has stopped, whatever stopped it (the host, the guest, a fault).
//!
//! A defined VM that is not running holds nothing but its definition, its
//! last figures and its console log: its threads are joined, its guest RAM
//! is returned to the host (`VmHandle::join`), its image locks are released,
//! it has left the scheduler and its cgroup, and it counts against neither
//! the memory budget nor `max_vms` (only against the bound on definitions).

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{Entry, Manager, ManagerError, VmInfo, lock};
use crate::vm::ExitReason;

/// Longest graceful shutdown a client may ask for.
pub const MAX_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(600);

impl Manager {
    /// Gives back what a stopped VM held: joins its threads (waiting for
    /// them if `wait`, else only when they have all finished), closes its
    /// KVM fd and returns its RAM (`VmHandle::try_release`), releases its
    /// image locks and takes it out of the scheduler and its cgroup.
    /// Idempotent; a no-op while the VM runs. Returns whether it is
    /// released.
    pub(super) fn release_entry(&self, e: &Entry, wait: bool) -> bool {
        if e.handle.exit_reason().is_none() {
            return false;
        }
        if e.reaped.load(Ordering::Acquire) {
            return true;
        }
        // Keep the last CPU figure before the threads are gone.
        e.cpu_ns(true);
        if wait {
            e.handle.join();
        }
        if !e.handle.try_release() || e.reaped.swap(true, Ordering::AcqRel) {
            return e.reaped.load(Ordering::Acquire);
        }
        self.cpu.detach(e.id);
        self.images.release(Some(&e.name), e.handle.files().iter());
        let _ = self.sched().remove_vm(e.id);
        if let Some(cg) = &self.cgroup {
            let _ = cg.remove_vm(&self.cg_path(&lock(&e.class)), &e.name);
        }
        tracing::info!(vm = %e.name, "VM stopped; its resources are released");
        true
    }

    /// Stops a VM at once (like pulling the plug) and keeps its definition;
    /// `start` runs it again. Stopping a stopped VM is not an error.
    pub(super) fn stop_vm_live(&self, name: &str) -> Result<VmInfo, ManagerError> {
        let e = self.entry(name)?;
        e.handle.stop();
        self.release_entry(&e, true);
        Ok(self.vm_info(&e, None))
    }

    /// Presses the VM's power button and waits up to `timeout` for the guest
    /// to power off; stops it hard if it has not by then. Returns the VM
    /// with how it ended (`shutdown` when the guest complied, `stopped`
    /// otherwise).
    pub(super) fn shutdown_vm_live(
        &self,
        name: &str,
        timeout: Duration,
    ) -> Result<VmInfo, ManagerError> {
        if timeout > MAX_SHUTDOWN_TIMEOUT {
            return Err(ManagerError::Invalid(format!(
                "timeout must be at most {} s",
                MAX_SHUTDOWN_TIMEOUT.as_secs()
            )));
        }
        let e = self.entry(name)?;
        if e.handle.exit_reason().is_some() {
            self.release_entry(&e, true);
            return Ok(self.vm_info(&e, None));
        }
        if e.handle.press_power_button() {
            tracing::info!(
                vm = name,
                timeout_s = timeout.as_secs_f64(),
                "power button pressed"
            );
            if e.handle.wait(Some(timeout)).is_none() {
                tracing::info!(
                    vm = name,
                    "the guest did not power off in time: stopping it"
                );
            }
        } else {
            tracing::info!(
                vm = name,
                "no ACPI power button (--no-acpi): stopping at once"
            );
        }
        e.handle.stop();
        self.release_entry(&e, true);
        Ok(self.vm_info(&e, None))
    }

    /// Runs a stopped VM again from its definition (same name, class,
    /// weight, cap, kernel, disks and limits): its files are opened and
    /// locked anew and its resources booked anew, under the same checks as
    /// `create`. 409 while it runs.
    pub(super) fn start_vm_live(&self, name: &str) -> Result<VmInfo, ManagerError> {
        let old = {
            let mut st = lock(&self.state);
            let e = st
                .vms
                .get(name)
                .cloned()
                .ok_or_else(|| ManagerError::NotFound(format!("no VM named {name:?}")))?;
            match e.handle.exit_reason() {
                None => return Err(ManagerError::Conflict(format!("VM {name:?} is running"))),
                // A second process would run the same VM beside it.
                Some(r @ ExitReason::NotAdopted { pid, .. })
                    if std::path::Path::new(&format!("/proc/{pid}")).exists() =>
                {
                    return Err(ManagerError::Conflict(format!("VM {name:?}: {r}")));
                }
                Some(_) => {}
            }
            st.vms.remove(name);
            e
        };
        self.release_entry(&old, true);
        let mut req = old.request.clone();
        req.name = Some(name.to_string());
        req.class = lock(&old.class).clone();
        req.weight = old.weight.load(Ordering::Relaxed);
        let cap = old.cap.load(Ordering::Relaxed);
        req.cap = (cap > 0).then_some(cap);
        // Disk limits changed live since the VM was created.
        for d in &mut req.disks {
            if let Some(now) = lock(&old.disks).iter().find(|x| x.config.id == d.id) {
                d.limits = now.config.limits;
            }
        }
        match self.create_vm_live(req) {
            Ok(info) => {
                tracing::info!(vm = name, "VM started again");
                Ok(info)
            }
            Err(err) => {
                // Keep the definition (and its last figures) on failure.
                let mut st = lock(&self.state);
                if !st.vms.contains_key(name) && !st.starting.contains_key(name) {
                    st.vms.insert(name.to_string(), old);
                }
                Err(err)
            }
        }
    }

    /// Stops a VM hard and starts it again from its definition.
    pub fn reboot_vm(&self, name: &str) -> Result<VmInfo, ManagerError> {
        self.stop_vm(name)?;
        self.start_vm(name)
    }

    /// Types `data` on the VM's serial console; returns how many bytes the
    /// guest's receive FIFO took (send the rest again later). 409 when the
    /// VM is not running.
    pub fn console_input(&self, name: &str, data: &[u8]) -> Result<usize, ManagerError> {
        let e = self.entry(name)?;
        if e.handle.exit_reason().is_some() {
            return Err(ManagerError::Conflict(format!(
                "VM {name:?} is not running"
            )));
        }
        Ok(e.handle.console_input(data))
    }
}
