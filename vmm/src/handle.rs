//! A running VM as its owner sees it: [`VmHandle`] (exit reason, pause,
//! disks and their live limits, console, stop/join/release).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use corral_blkthrottle::{Limits, ThrottleGroup};
use corral_devices::ConsoleLog;
use kvm_ioctls::VmFd;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::control::{Claim, Control, DiskOp};
use crate::hostfile::HostFile;
use crate::shared::Shared;
use crate::shared::VcpuStats;
use crate::util::lock;
use crate::vm::{DiskStatus, ExitReason, VmError};

/// How long a disk's control message may wait for the device thread (which
/// applies it between two requests) before the caller gets
/// [`VmError::DeviceUnresponsive`].
pub const DEVICE_REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// A running VM.
pub struct VmHandle {
    pub(crate) name: String,
    pub(crate) shared: Arc<Shared>,
    pub(crate) threads: Mutex<Vec<JoinHandle<()>>>,
    pub(crate) console: Arc<ConsoleLog>,
    pub(crate) started: Instant,
    pub(crate) vcpu_tids: Vec<libc::pid_t>,
    pub(crate) device_tid: Option<libc::pid_t>,
    /// The VM's KVM fd until [`VmHandle::try_release`] closes it.
    pub(crate) vm_fd: Mutex<Option<Arc<VmFd>>>,
    pub(crate) mem: GuestMemoryMmap,
    pub(crate) released: AtomicBool,
    /// Kernel, initrd and disks: open (and locked) for the VM's life.
    pub(crate) files: Vec<HostFile>,
}

impl std::fmt::Debug for VmHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmHandle")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl VmHandle {
    /// The VM's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its kernel, initrd and disk files (open and locked while it lives).
    pub fn files(&self) -> &[HostFile] {
        &self.files
    }

    /// Console output.
    pub fn console(&self) -> Arc<ConsoleLog> {
        self.console.clone()
    }

    /// Time since start.
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// Why the VM stopped, if it did.
    pub fn exit_reason(&self) -> Option<ExitReason> {
        self.shared.check_faults();
        lock(&self.shared.exit).clone()
    }

    /// Pauses the guest: its vCPUs leave `KVM_RUN` and wait. Returns
    /// whether the VM was running (false if already paused).
    pub fn pause(&self) -> bool {
        self.shared.pause_gate.park()
    }

    /// Resumes a paused guest. Returns whether it was paused.
    pub fn resume(&self) -> bool {
        self.shared.pause_gate.unpark()
    }

    /// Whether the host paused the guest.
    pub fn is_paused(&self) -> bool {
        self.shared.pause_gate.is_parked()
    }

    /// pthread ids of the vCPU threads (for CPU clocks); empty once joined.
    pub fn vcpu_pthreads(&self) -> Vec<libc::pthread_t> {
        lock(&self.shared.vcpu_pthreads).clone()
    }

    /// Guest-caused errors by device and kind: (device, kind, count).
    pub fn guest_errors(&self) -> Vec<(String, &'static str, u64)> {
        let mut v = Vec::new();
        for log in &self.shared.guest_logs {
            for (kind, n) in log.snapshot() {
                v.push((log.device().to_string(), kind, n));
            }
        }
        v
    }

    /// The VM's disks with their limits and counters. Reads what each
    /// device publishes ([`corral_devices::virtio::blk::DiskCounters`]):
    /// never waits for a device, however busy its I/O.
    pub fn disks(&self) -> Vec<DiskStatus> {
        self.shared
            .disks
            .iter()
            .map(|d| DiskStatus {
                name: d.name.clone(),
                path: d.config.path.clone(),
                read_only: d.config.read_only,
                direct: d.config.direct,
                engine: d.engine,
                capacity_bytes: d.capacity_bytes,
                limits: d.counters.limits(),
                stats: d.counters.throttle_stats(),
                device: d.counters.device(),
                group: d.counters.group(),
                group_weight: d.counters.group_weight(),
            })
            .collect()
    }

    /// Sends a disk's control message to the device thread and waits (up to
    /// [`DEVICE_REPLY_TIMEOUT`]) for its answer.
    fn disk_control(&self, disk: &str, op: DiskOp) -> Result<(), VmError> {
        let index = self
            .shared
            .disks
            .iter()
            .position(|d| d.name == disk)
            .ok_or_else(|| VmError::NoSuchDisk(disk.to_string()))?;
        let stopped = || VmError::Stopped(self.name.clone());
        if self.shared.is_stopping() {
            return Err(stopped());
        }
        let (reply, rx) = std::sync::mpsc::channel();
        let claim = Claim::default();
        let msg = Control {
            disk: index,
            op,
            reply,
            claim: claim.clone(),
        };
        lock(&self.shared.control)
            .send(msg)
            .map_err(|_| stopped())?;
        self.shared.wake_device_thread();
        let mut answer = rx.recv_timeout(DEVICE_REPLY_TIMEOUT);
        if matches!(answer, Err(RecvTimeoutError::Timeout)) && !claim.withdraw() {
            // The device thread took it just now: it is being applied.
            answer = rx.recv_timeout(DEVICE_REPLY_TIMEOUT);
        }
        match answer {
            Ok(r) => r,
            // The device thread dropped the message: it ended (the VM
            // stopped) before serving it.
            Err(RecvTimeoutError::Disconnected) => Err(stopped()),
            Err(RecvTimeoutError::Timeout) if self.shared.is_stopping() => Err(stopped()),
            Err(RecvTimeoutError::Timeout) => Err(VmError::DeviceUnresponsive {
                vm: self.name.clone(),
                ms: DEVICE_REPLY_TIMEOUT.as_millis() as u64,
            }),
        }
    }

    /// Moves a disk into a throttle group (with its weight there), or out of
    /// any; applied by the device thread between two requests.
    pub fn set_disk_group(
        &self,
        disk: &str,
        group: Option<(ThrottleGroup, u32)>,
    ) -> Result<(), VmError> {
        self.disk_control(disk, DiskOp::Group(group))
    }

    /// Changes a disk's weight in its throttle group, keeping its place
    /// there; applied by the device thread between two requests.
    pub fn set_disk_weight(&self, disk: &str, weight: u32) -> Result<(), VmError> {
        self.disk_control(disk, DiskOp::Weight(weight))
    }

    /// Changes a disk's limits live. The device thread swaps them between two
    /// requests; queued requests and earned tokens are kept. Returns once
    /// applied: [`VmError::Stopped`] if the VM has stopped,
    /// [`VmError::DeviceUnresponsive`] if its device thread did not answer
    /// in time, [`VmError::Disk`] for limits the device refuses.
    pub fn set_disk_limits(&self, disk: &str, limits: Limits) -> Result<(), VmError> {
        self.disk_control(disk, DiskOp::Limits(limits))
    }

    /// Presses the VM's ACPI power button (the guest decides what to do;
    /// a guest that honours it powers off through S5). `false` when the VM
    /// has no ACPI (`--no-acpi`) or has stopped.
    pub fn press_power_button(&self) -> bool {
        match &self.shared.acpi_pm {
            Some(pm) if self.exit_reason().is_none() => {
                lock(pm).press_power_button();
                true
            }
            _ => false,
        }
    }

    /// Feeds bytes to the guest's serial port as if typed; returns how many
    /// fit in its receive FIFO (the rest is for the caller to send again
    /// once the guest has read some). 0 once the VM has stopped.
    pub fn console_input(&self, data: &[u8]) -> usize {
        if self.exit_reason().is_some() {
            return 0;
        }
        lock(&self.shared.serial).enqueue_input(data)
    }

    /// Asks the VM to stop; returns at once.
    pub fn stop(&self) {
        self.shared.set_exit(ExitReason::Stopped);
    }

    /// Waits for the VM to stop, up to `timeout` (forever if `None`).
    pub fn wait(&self, timeout: Option<Duration>) -> Option<ExitReason> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut g = lock(&self.shared.exit);
        while g.is_none() {
            match deadline {
                None => {
                    g = self
                        .shared
                        .exit_cond
                        .wait(g)
                        .unwrap_or_else(|p| p.into_inner())
                }
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return None;
                    }
                    g = self
                        .shared
                        .exit_cond
                        .wait_timeout(g, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
        g.clone()
    }

    /// Stops the VM if needed and joins all its threads.
    pub fn join(&self) -> ExitReason {
        if self.exit_reason().is_none() {
            self.stop();
        }
        let threads: Vec<_> = std::mem::take(&mut *lock(&self.threads));
        // Keep kicking until every thread is out (a kick can race with a
        // thread entering KVM_RUN only before `stopping` is visible). No
        // thread is joined before all have finished, so every pthread id we
        // signal is still valid.
        while !threads.iter().all(|t| t.is_finished()) {
            self.shared.kick_all();
            std::thread::sleep(Duration::from_millis(1));
        }
        lock(&self.shared.vcpu_pthreads).clear();
        lock(&self.shared.vcpu_kick_tids).clear();
        for t in threads {
            let _ = t.join();
        }
        lock(&self.shared.vcpu_pthreads).clear();
        lock(&self.shared.vcpu_kick_tids).clear();
        self.console.close();
        self.exit_reason().unwrap_or(ExitReason::Stopped)
    }

    /// Frees what a stopped VM holds, without waiting: once the VM has an
    /// exit reason and all its threads have finished, joins them, closes
    /// the KVM VM fd and gives the guest's RAM back to the host
    /// (`MADV_DONTNEED`; the mapping stays until the handle is dropped, so
    /// nothing can touch freed memory). Returns whether the VM is released
    /// (true again on later calls).
    pub fn try_release(&self) -> bool {
        if self.released.load(Ordering::Acquire) {
            return true;
        }
        if self.exit_reason().is_none() || !lock(&self.threads).iter().all(|t| t.is_finished()) {
            return false;
        }
        self.join();
        lock(&self.vm_fd).take();
        for region in self.mem.iter() {
            if let Ok(host) = self.mem.get_host_address(region.start_addr()) {
                // SAFETY: the region is a live anonymous mapping owned by
                // `self.mem`; every thread that used guest memory has been
                // joined and the VM fd is closed, so no one reads it again
                // (DONTNEED only zeroes the pages).
                unsafe {
                    libc::madvise(host.cast(), region.len() as usize, libc::MADV_DONTNEED);
                }
            }
        }
        self.released.store(true, Ordering::Release);
        true
    }

    /// Whether [`VmHandle::try_release`] has released the VM.
    pub fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// Linux thread ids of the vCPU threads (for CPU accounting and cgroups).
    pub fn vcpu_tids(&self) -> &[libc::pid_t] {
        &self.vcpu_tids
    }

    /// Kernel thread id of the device thread (serves the VM's I/O).
    pub fn device_tid(&self) -> Option<libc::pid_t> {
        self.device_tid
    }

    /// Exit counters per vCPU.
    pub fn vcpu_stats(&self) -> &[Arc<VcpuStats>] {
        &self.shared.vcpu_stats
    }

    /// Unclaimed port I/O and MMIO accesses: (pio reads, pio writes, mmio reads, mmio writes).
    pub fn unknown_accesses(&self) -> (u64, u64, u64, u64) {
        let p = self.shared.pio.stats();
        let m = self.shared.mmio.stats();
        let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        (
            l(&p.unknown_reads),
            l(&p.unknown_writes),
            l(&m.unknown_reads),
            l(&m.unknown_writes),
        )
    }
}

impl Drop for VmHandle {
    fn drop(&mut self) {
        self.join();
    }
}
