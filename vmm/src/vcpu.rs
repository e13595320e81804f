//! vCPU threads: the `KVM_RUN` loop and exit dispatch. The kick that gets a
//! vCPU out of the guest (a signal plus `immediate_exit`) is in
//! [`crate::shared`].

use std::sync::Arc;
use std::sync::atomic::Ordering;

use corral_scheduler::gate::WaitOutcome;
use kvm_ioctls::{VcpuExit, VcpuFd};

pub use crate::shared::VcpuStats;
use crate::shared::{KickTarget, Shared};
use crate::vm::ExitReason;

fn regs_summary(vcpu: &VcpuFd) -> String {
    let mut s = String::new();
    if let Ok(r) = vcpu.get_regs() {
        s += &format!(
            "rip={:#x} rsp={:#x} rflags={:#x} rax={:#x} rbx={:#x} rcx={:#x} rdx={:#x} rsi={:#x} rdi={:#x}",
            r.rip, r.rsp, r.rflags, r.rax, r.rbx, r.rcx, r.rdx, r.rsi, r.rdi
        );
    }
    if let Ok(sr) = vcpu.get_sregs() {
        s += &format!(
            " cr0={:#x} cr2={:#x} cr3={:#x} cr4={:#x} efer={:#x} cs={:#x}",
            sr.cr0, sr.cr2, sr.cr3, sr.cr4, sr.efer, sr.cs.selector
        );
    }
    s
}

/// The element size of the current `KVM_EXIT_IO`.
fn io_size(run: *const kvm_bindings::kvm_run) -> usize {
    // SAFETY: `run` is this vCPU's mapped `kvm_run`, and the exit reason
    // is KVM_EXIT_IO, so the kernel filled the `io` member; a raw read of
    // one byte that no live reference covers (the exit's data slice lies
    // at `data_offset`, past the struct).
    usize::from(unsafe { std::ptr::addr_of!((*run).__bindgen_anon_1.io.size).read() })
}

/// Runs vCPU `index` until the VM stops. Returns when the VM's exit reason is set.
pub(crate) fn run(mut vcpu: VcpuFd, index: u8, shared: Arc<Shared>) {
    let stats = shared.vcpu_stats[index as usize].clone();
    let run_ptr: *mut kvm_bindings::kvm_run = vcpu.get_kvm_run();
    // Cleared when this function ends, also by a panic: the guard is a
    // local, dropped before the `vcpu` parameter (which unmaps `kvm_run`).
    // A kick that lands after that (the VM's stop kicks every vCPU thread,
    // this one included) must find no target.
    let _clear = KickTarget::set(run_ptr);
    let fatal = |vcpu: &VcpuFd, what: String| {
        let regs = regs_summary(vcpu);
        tracing::error!(vcpu = index, "{what}; {regs}");
        shared.set_exit(ExitReason::Fatal {
            vcpu: index,
            reason: what,
            registers: regs,
        });
    };
    #[cfg(debug_assertions)]
    let mut inject = fault_injection::Vcpu::new(&shared.name, index);
    // Boot tracing: the first entry and the guest's first serial byte.
    let mut first_run = true;
    let mut first_out = true;
    loop {
        // A seccomp violation recorded by the SIGSYS handler stops the VM.
        shared.check_faults();
        if shared.is_stopping() {
            break;
        }
        #[cfg(debug_assertions)]
        inject.maybe(&shared);
        // Parked by the scheduler or paused by the host: wait on the gate
        // (no spinning). A park kicks us out of KVM_RUN first.
        let mut parked = false;
        for gate in shared.gates() {
            if gate.is_parked() {
                parked = true;
                if gate.wait_while_parked() == WaitOutcome::Shutdown {
                    break;
                }
            }
        }
        if parked {
            continue;
        }
        if first_run {
            first_run = false;
            crate::boottrace::step("kvm-run");
        }
        let exit = vcpu.run();
        match exit {
            // `data` holds `count` elements of `size` bytes (string I/O,
            // `rep insb/outsb`, has count > 1): one device access each.
            Ok(VcpuExit::IoOut(port, data)) => {
                stats.io_out.fetch_add(1, Ordering::Relaxed);
                if first_out && port == 0x3f8 {
                    first_out = false;
                    crate::boottrace::step("serial-byte");
                }
                shared
                    .pio
                    .write_elems(u64::from(port), data, io_size(run_ptr));
            }
            Ok(VcpuExit::IoIn(port, data)) => {
                stats.io_in.fetch_add(1, Ordering::Relaxed);
                shared
                    .pio
                    .read_elems(u64::from(port), data, io_size(run_ptr));
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                stats.mmio_write.fetch_add(1, Ordering::Relaxed);
                shared.mmio.write(addr, data);
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                stats.mmio_read.fetch_add(1, Ordering::Relaxed);
                shared.mmio.read(addr, data);
            }
            Ok(VcpuExit::Hlt) => {
                stats.hlt.fetch_add(1, Ordering::Relaxed);
            }
            Ok(VcpuExit::IrqWindowOpen) | Ok(VcpuExit::Intr) => {
                stats.other.fetch_add(1, Ordering::Relaxed);
            }
            Ok(VcpuExit::Shutdown) => {
                fatal(&vcpu, "triple fault (KVM_EXIT_SHUTDOWN)".into());
                break;
            }
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                stats.other.fetch_add(1, Ordering::Relaxed);
                match kind {
                    kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN
                    | kvm_bindings::KVM_SYSTEM_EVENT_RESET => {
                        shared.set_exit(ExitReason::GuestShutdown);
                    }
                    other => {
                        fatal(&vcpu, format!("system event {other} (guest crash)"));
                    }
                }
                break;
            }
            Ok(VcpuExit::FailEntry(reason, cpu)) => {
                fatal(
                    &vcpu,
                    format!("KVM entry failed: hardware reason {reason:#x} on host cpu {cpu}"),
                );
                break;
            }
            Ok(VcpuExit::InternalError) => {
                // SAFETY: reading a plain-old-data union member that the
                // kernel filled for KVM_EXIT_INTERNAL_ERROR.
                let sub = unsafe { (*run_ptr).__bindgen_anon_1.internal.suberror };
                fatal(&vcpu, format!("KVM internal error (suberror {sub})"));
                break;
            }
            Ok(other) => {
                stats.other.fetch_add(1, Ordering::Relaxed);
                let what = format!("unhandled exit {other:?}");
                fatal(&vcpu, what);
                break;
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                stats.interrupted.fetch_add(1, Ordering::Relaxed);
                vcpu.set_kvm_immediate_exit(0);
            }
            Err(e) => {
                fatal(&vcpu, format!("KVM_RUN failed: {e}"));
                break;
            }
        }
    }
    drop(_clear);
    drop(vcpu);
}

/// Test-only faults on a vCPU thread (debug builds; see
/// [`crate::seccomp::fault`]): `vcpu-panic:VM` panics vCPU 0 while it holds
/// the VM's exit-reason lock (so the lock is poisoned, and must be
/// recovered by everyone after), `vcpu-syscall:VM` makes vCPU 0 call a
/// syscall outside its filter. Both fire once the guest has run for 1 s.
#[cfg(debug_assertions)]
mod fault_injection {
    use std::time::{Duration, Instant};

    use crate::seccomp::fault;
    use crate::shared::Shared;

    pub(super) struct Vcpu {
        panic: bool,
        syscall: bool,
        at: Instant,
    }

    impl Vcpu {
        pub(super) fn new(vm: &str, index: u8) -> Self {
            Self {
                panic: index == 0 && fault::injected("vcpu-panic", vm),
                syscall: index == 0 && fault::injected("vcpu-syscall", vm),
                at: Instant::now() + Duration::from_millis(1000),
            }
        }

        pub(super) fn maybe(&mut self, shared: &Shared) {
            if !(self.panic || self.syscall) || Instant::now() < self.at {
                return;
            }
            if std::mem::take(&mut self.syscall) {
                let r = fault::forbidden_syscall();
                tracing::warn!("fault injection: forbidden syscall returned {r}");
            }
            if std::mem::take(&mut self.panic) {
                let _held = shared.lock_exit_for_test();
                panic!("fault injection: vcpu-panic");
            }
        }
    }
}
