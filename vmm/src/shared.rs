//! The state shared by a VM's threads (vCPUs, device thread, the API's
//! [`crate::handle::VmHandle`]): the buses, the exit reason, the disks, and
//! the code that kicks vCPUs out of `KVM_RUN` and wakes the device thread.

use std::cell::Cell;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use corral_devices::acpi_pm::AcpiPm;
use corral_devices::virtio::blk::{Block, DiskCounters};
use corral_devices::{Bus, GuestLog, SerialDevice};
use corral_scheduler::gate::Gate;
use vmm_sys_util::eventfd::EventFd;

use crate::control::Control;
use crate::seccomp::{ThreadKind, VmFaults};
use crate::util::{kick_signal, lock};
use crate::vm::{DiskConfig, ExitReason, ThreadFault};

thread_local! {
    /// This thread's `kvm_run` area, for the kick signal handler.
    static KVM_RUN: Cell<*mut kvm_bindings::kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn on_kick(_: libc::c_int) {
    // Only touches a const-initialised thread-local (no allocation, no lock):
    // async-signal-safe.
    let p = KVM_RUN.with(|c| c.get());
    if !p.is_null() {
        // SAFETY: `p` is this thread's own mapped `kvm_run`, valid for as long
        // as the VcpuFd lives; the vCPU loop clears the pointer (drops its
        // [`KickTarget`]) before the VcpuFd is dropped. A volatile byte write
        // cannot tear.
        unsafe { std::ptr::addr_of_mut!((*p).immediate_exit).write_volatile(1) };
    }
}

/// Installs the kick signal handler (idempotent, process-wide).
pub fn install_kick_handler() -> std::io::Result<()> {
    static ONCE: std::sync::OnceLock<std::io::Result<()>> = std::sync::OnceLock::new();
    let r = ONCE.get_or_init(|| {
        // SAFETY: a zeroed sigaction is a valid starting point; we set a
        // handler that only does async-signal-safe work, and no SA_RESTART so
        // that KVM_RUN returns EINTR.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_kick as *const () as usize;
            sa.sa_flags = 0;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(kick_signal(), &sa, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    });
    match r {
        Ok(()) => Ok(()),
        Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
    }
}

/// While it lives, a kick of the calling thread sets `immediate_exit` in
/// its `kvm_run` area. Dropped (also by a panic) before the vCPU fd that
/// maps the area: a kick that lands after that finds no target.
pub(crate) struct KickTarget(());

impl KickTarget {
    /// Makes `run` (the calling thread's own mapped `kvm_run`) the target.
    pub(crate) fn set(run: *mut kvm_bindings::kvm_run) -> Self {
        KVM_RUN.with(|c| c.set(run));
        Self(())
    }
}

impl Drop for KickTarget {
    fn drop(&mut self) {
        KVM_RUN.with(|c| c.set(std::ptr::null_mut()));
    }
}

/// Exit counters of one vCPU, by reason.
#[derive(Debug, Default)]
pub struct VcpuStats {
    /// Port reads.
    pub io_in: AtomicU64,
    /// Port writes.
    pub io_out: AtomicU64,
    /// MMIO reads.
    pub mmio_read: AtomicU64,
    /// MMIO writes.
    pub mmio_write: AtomicU64,
    /// HLT exits (rare with the in-kernel irqchip).
    pub hlt: AtomicU64,
    /// Returns to user space because of a signal (kicks).
    pub interrupted: AtomicU64,
    /// Other exits.
    pub other: AtomicU64,
}

impl VcpuStats {
    /// (reason, count) pairs, for metrics.
    pub fn snapshot(&self) -> [(&'static str, u64); 7] {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        [
            ("io_in", l(&self.io_in)),
            ("io_out", l(&self.io_out)),
            ("mmio_read", l(&self.mmio_read)),
            ("mmio_write", l(&self.mmio_write)),
            ("hlt", l(&self.hlt)),
            ("interrupted", l(&self.interrupted)),
            ("other", l(&self.other)),
        ]
    }
}

/// A disk of a running VM.
pub(crate) struct AttachedDisk {
    /// Its name (the guest's serial, or `diskN`).
    pub(crate) name: String,
    pub(crate) config: DiskConfig,
    /// Size in bytes.
    pub(crate) capacity_bytes: u64,
    /// The I/O engine serving it (fixed when the device is built).
    pub(crate) engine: corral_devices::virtio::blk::IoEngine,
    /// The device; locked by the device thread (and the vCPU thread of an
    /// MMIO access) only, while it serves the disk.
    pub(crate) block: Arc<Mutex<Block>>,
    /// What the device publishes (counters, limits, group): what the
    /// API reads, without the device's lock.
    pub(crate) counters: Arc<DiskCounters>,
}

/// State shared by a VM's threads.
pub(crate) struct Shared {
    pub(crate) pio: Bus,
    pub(crate) mmio: Bus,
    pub(crate) vcpu_stats: Vec<Arc<VcpuStats>>,
    pub(crate) stopping: AtomicBool,
    pub(crate) exit: Mutex<Option<ExitReason>>,
    pub(crate) exit_cond: Condvar,
    /// pthread ids of the vCPU threads (until they are joined).
    pub(crate) vcpu_pthreads: Mutex<Vec<libc::pthread_t>>,
    /// Their kernel tids, for kicks (cleared with `vcpu_pthreads`).
    pub(crate) vcpu_kick_tids: Mutex<Vec<libc::pid_t>>,
    /// Wakes the device thread.
    pub(crate) wake: EventFd,
    /// Host pause/resume.
    pub(crate) pause_gate: Arc<Gate>,
    /// virtio-blk disks.
    pub(crate) disks: Vec<AttachedDisk>,
    /// The disks' guest-error counters (read without the device locks).
    pub(crate) guest_logs: Vec<Arc<GuestLog>>,
    /// Messages for the device thread.
    pub(crate) control: Mutex<std::sync::mpsc::Sender<Control>>,
    /// The scheduler's gate, if the VM is scheduled by the gate backend.
    pub(crate) sched_gate: Option<Arc<Gate>>,
    /// Seccomp violations of the VM's threads (written by the SIGSYS handler).
    pub(crate) faults: VmFaults,
    /// Thread names, for exit reasons: the device thread's.
    pub(crate) device_thread: String,
    /// The VM's name (its threads' `vm` log span; the test-only fault injection).
    pub(crate) name: String,
    /// COM1, for console input from the host (`VmHandle::console_input`).
    pub(crate) serial: Arc<Mutex<SerialDevice>>,
    /// The ACPI sleep and event registers (the power button), with ACPI.
    pub(crate) acpi_pm: Option<Arc<Mutex<AcpiPm>>>,
}

impl Shared {
    /// The gates a vCPU must pass before running.
    pub(crate) fn gates(&self) -> impl Iterator<Item = &Arc<Gate>> {
        std::iter::once(&self.pause_gate).chain(self.sched_gate.iter())
    }

    /// Holds the exit-reason lock (fault injection: a panic while holding
    /// it poisons it).
    #[cfg(debug_assertions)]
    pub(crate) fn lock_exit_for_test(&self) -> std::sync::MutexGuard<'_, Option<ExitReason>> {
        lock(&self.exit)
    }

    pub(crate) fn faults(&self) -> &VmFaults {
        &self.faults
    }

    /// Turns a seccomp violation recorded by the SIGSYS handler into the
    /// VM's exit reason (cheap when there is none: one atomic load).
    pub(crate) fn check_faults(&self) {
        if let Some(v) = self.faults.violation() {
            let thread = match v.kind {
                ThreadKind::Vcpu => format!("vcpu{}", v.index),
                _ => self.device_thread.clone(),
            };
            self.set_exit(ExitReason::ThreadFault {
                thread,
                kind: v.kind,
                vcpu: (v.kind == ThreadKind::Vcpu).then_some(v.index as u8),
                fault: ThreadFault::Seccomp { syscall: v.syscall },
            });
        }
    }

    pub(crate) fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Records the first exit reason and tells every thread to stop.
    pub(crate) fn set_exit(&self, reason: ExitReason) {
        {
            let mut g = lock(&self.exit);
            if g.is_none() {
                tracing::info!("VM exit: {reason}");
                *g = Some(reason);
            }
        }
        self.stopping.store(true, Ordering::Release);
        for g in self.gates() {
            g.shutdown();
        }
        self.kick_all();
        let _ = self.wake.write(1);
        self.exit_cond.notify_all();
    }

    /// Signals every vCPU thread: one `tgkill` each (and one `getpid`).
    /// `pthread_kill` took four syscalls per thread here (glibc 2.36 blocks
    /// and restores all signals around its `getpid` + `tgkill`), 16 per
    /// park of a 4-vCPU VM on the scheduler thread, a quarter of its
    /// syscalls per tick at 100 vCPUs. The pid is read each time, not
    /// cached: a VM process's jail forks into a pid namespace.
    pub(crate) fn kick_all(&self) {
        let sig = kick_signal();
        let tids = lock(&self.vcpu_kick_tids);
        if tids.is_empty() {
            return;
        }
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        for &t in tids.iter() {
            // SAFETY: tgkill takes plain integers. `t` is a thread of this
            // VM until it is joined (the list is cleared then); the kernel
            // only signals a thread of our own thread group, and the
            // handler does nothing on a thread without a `kvm_run`.
            unsafe { libc::syscall(libc::SYS_tgkill, pid, t, sig) };
        }
    }
}
impl Shared {
    pub(crate) fn wake_fd(&self) -> i32 {
        self.wake.as_raw_fd()
    }

    pub(crate) fn wake_device_thread(&self) {
        let _ = self.wake.write(1);
    }

    pub(crate) fn clear_wake(&self) {
        let _ = self.wake.read();
    }
}

#[allow(dead_code)]
fn _assert_send() {
    fn s<T: Send + Sync>() {}
    s::<Shared>();
}
