//! A handle of a VM that is defined but has not run in this process.

use std::os::fd::AsRawFd;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use corral_devices::{Bus, ConsoleLog, SerialDevice};
use corral_scheduler::gate::Gate;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use crate::handle::VmHandle;
use crate::seccomp::VmFaults;
use crate::shared::Shared;
use crate::vm::{ExitReason, VmError};

fn eventfd() -> Result<EventFd, VmError> {
    EventFd::new(EFD_NONBLOCK).map_err(|err| VmError::Io {
        what: "eventfd",
        err,
    })
}

impl VmHandle {
    /// A handle of a VM that is defined but has never run in this process
    /// (reloaded from the daemon's state): it has stopped with `reason`,
    /// holds no threads, memory, KVM fd or files, and `start` replaces it.
    pub fn defined(name: &str, reason: ExitReason) -> Result<VmHandle, VmError> {
        let console = ConsoleLog::new(4096);
        console.close();
        let wake = eventfd()?;
        let serial_irq = eventfd()?;
        let (control_tx, _) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared {
            pio: Bus::new(),
            mmio: Bus::new(),
            vcpu_stats: Vec::new(),
            stopping: AtomicBool::new(true),
            exit: Mutex::new(Some(reason)),
            exit_cond: Condvar::new(),
            vcpu_pthreads: Mutex::new(Vec::new()),
            vcpu_kick_tids: Mutex::new(Vec::new()),
            faults: VmFaults::new(wake.as_raw_fd()),
            wake,
            pause_gate: Arc::new(Gate::new()),
            sched_gate: None,
            guest_logs: Vec::new(),
            disks: Vec::new(),
            control: Mutex::new(control_tx),
            device_thread: format!("dev-{name}"),
            name: name.to_string(),
            serial: Arc::new(Mutex::new(SerialDevice::new(
                serial_irq,
                None,
                console.clone(),
            ))),
            acpi_pm: None,
        });
        Ok(VmHandle {
            name: name.to_string(),
            shared,
            threads: Mutex::new(Vec::new()),
            console,
            started: Instant::now(),
            vcpu_tids: Vec::new(),
            device_tid: None,
            vm_fd: Mutex::new(None),
            mem: GuestMemoryMmap::new(),
            released: AtomicBool::new(true),
            files: Vec::new(),
        })
    }
}
