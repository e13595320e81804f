//! One run of a VM as the manager holds it: in the daemon's process
//! ([`VmHandle`]: `corral run`, library users, `--vm-mode thread`) or in a
//! VM process of its own ([`RemoteVm`]: `corral serve`'s default). The
//! methods are those the manager uses; each forwards to the one kind.

use std::sync::Arc;
use std::time::Duration;

use corral_blkthrottle::{Limits, ThrottleGroup};
use corral_devices::ConsoleLog;

use crate::handle::VmHandle;
use crate::hostfile::HostFile;
use crate::vm::{DiskStatus, ExitReason, VmError};
use crate::vmproc::launcher::Launcher;
use crate::vmproc::remote::RemoteVm;

/// How the daemon runs VMs in processes of their own.
#[derive(Debug, Clone)]
pub struct VmProcesses {
    /// Starts the VM processes.
    pub launcher: Arc<Launcher>,
    /// The VM processes install their seccomp filters.
    pub seccomp: bool,
    /// The VMs outlive the daemon (its exit, SIGTERM, kill -9): a daemon
    /// started later on the state directory re-adopts them. Off
    /// (`--shutdown-vms-on-exit`): the daemon stops them when it exits.
    pub keep_running: bool,
    /// Jail each VM process ([`crate::jail`]) with a uid of its own from
    /// this pool; `None`: not jailed (`--no-jail`).
    pub jail: Option<Arc<crate::jail::UidPool>>,
    /// A jailed VM process runs in a pid namespace of its own (`serve`
    /// sets this where the host allows one). The daemon then addresses it
    /// by host ids only ([`crate::vmproc::hostids`]).
    pub pid_namespace: bool,
}

/// A VM's run: threads of this process, or a process of its own.
#[derive(Debug)]
pub enum VmRun {
    /// In this process.
    Local(VmHandle),
    /// In a VM process.
    Remote(Arc<RemoteVm>),
}

macro_rules! each {
    ($self:ident, $h:ident => $e:expr) => {
        match $self {
            VmRun::Local($h) => $e,
            VmRun::Remote($h) => $e,
        }
    };
}

impl VmRun {
    /// Why it stopped, if it did.
    pub fn exit_reason(&self) -> Option<ExitReason> {
        each!(self, h => h.exit_reason())
    }
    /// Paused by the host.
    pub fn is_paused(&self) -> bool {
        each!(self, h => h.is_paused())
    }
    /// Pauses the guest.
    pub fn pause(&self) -> bool {
        each!(self, h => h.pause())
    }
    /// Resumes it.
    pub fn resume(&self) -> bool {
        each!(self, h => h.resume())
    }
    /// Asks it to stop.
    pub fn stop(&self) {
        each!(self, h => h.stop())
    }
    /// Stops it and waits for its end.
    pub fn join(&self) -> ExitReason {
        each!(self, h => h.join())
    }
    /// Frees what a stopped VM holds, without waiting.
    pub fn try_release(&self) -> bool {
        each!(self, h => h.try_release())
    }
    /// Waits for its end.
    pub fn wait(&self, timeout: Option<Duration>) -> Option<ExitReason> {
        each!(self, h => h.wait(timeout))
    }
    /// vCPU thread ids.
    pub fn vcpu_tids(&self) -> &[libc::pid_t] {
        each!(self, h => h.vcpu_tids())
    }
    /// Device thread id.
    pub fn device_tid(&self) -> Option<libc::pid_t> {
        each!(self, h => h.device_tid())
    }
    /// Its files (held open and locked by the daemon).
    pub fn files(&self) -> &[HostFile] {
        each!(self, h => h.files())
    }
    /// Console output.
    pub fn console(&self) -> Arc<ConsoleLog> {
        each!(self, h => h.console())
    }
    /// Time since start.
    pub fn uptime(&self) -> Duration {
        each!(self, h => h.uptime())
    }
    /// Disks with limits and counters.
    pub fn disks(&self) -> Vec<DiskStatus> {
        each!(self, h => h.disks())
    }
    /// A disk's limits, live.
    pub fn set_disk_limits(&self, disk: &str, limits: Limits) -> Result<(), VmError> {
        each!(self, h => h.set_disk_limits(disk, limits))
    }
    /// Moves a disk to a group; a VM process attaches to the group's shared
    /// `page` (an in-process VM uses the daemon's group object itself).
    pub fn set_disk_group(
        &self,
        disk: &str,
        group: Option<(ThrottleGroup, u32)>,
        page: Option<&std::os::fd::OwnedFd>,
    ) -> Result<(), VmError> {
        match self {
            VmRun::Local(h) => h.set_disk_group(disk, group),
            VmRun::Remote(h) => h.set_disk_group(disk, group, page),
        }
    }
    /// A disk's weight in its group, live (its place in line is kept).
    pub fn set_disk_weight(&self, disk: &str, weight: u32) -> Result<(), VmError> {
        each!(self, h => h.set_disk_weight(disk, weight))
    }
    /// A group's limits changed: an in-process VM shares the daemon's
    /// group object (nothing to do); a VM process's handle of the group
    /// takes them as its own bound (the group's shared page has them).
    pub fn set_group_limits(&self, name: &str, limits: Limits) -> Result<(), VmError> {
        match self {
            VmRun::Local(_) => Ok(()),
            VmRun::Remote(h) => h.set_group_limits(name, limits),
        }
    }
    /// ACPI power button.
    pub fn press_power_button(&self) -> bool {
        each!(self, h => h.press_power_button())
    }
    /// Console input.
    pub fn console_input(&self, data: &[u8]) -> usize {
        each!(self, h => h.console_input(data))
    }
    /// Guest-caused errors.
    pub fn guest_errors(&self) -> Vec<(String, &'static str, u64)> {
        each!(self, h => h.guest_errors())
    }
    /// vCPU exits by kind, summed over the vCPUs.
    pub fn exit_counts(&self) -> Vec<(&'static str, u64)> {
        match self {
            VmRun::Local(h) => {
                let mut v: Vec<(&'static str, u64)> = Vec::new();
                for s in h.vcpu_stats() {
                    for (k, n) in s.snapshot() {
                        match v.iter_mut().find(|(x, _)| *x == k) {
                            Some(e) => e.1 += n,
                            None => v.push((k, n)),
                        }
                    }
                }
                v
            }
            VmRun::Remote(h) => h.exit_counts(),
        }
    }
    /// The VM process, if the VM runs in one.
    pub fn remote(&self) -> Option<&Arc<RemoteVm>> {
        match self {
            VmRun::Local(_) => None,
            VmRun::Remote(h) => Some(h),
        }
    }
}
