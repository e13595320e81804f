//! Starting one of a VM's threads (vCPU or device): it installs the seccomp
//! filter of its kind first, records its faults in the VM's slot, and a
//! panic in it fails the VM, not the process. It runs inside the VM's
//! `vm = NAME` log span.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::thread::JoinHandle;

use crate::seccomp::{self, ThreadKind, VmThreadGuard};
use crate::shared::Shared;
use crate::vm::{ExitReason, ThreadFault};

/// Spawns thread `name`, the `index`-th of `kind` in the VM. It installs
/// its filter, then sends its kernel tid on `tid` (fails closed: the VM
/// fails if the filter cannot be installed), then runs `body`. A panic in `body` is caught and
/// becomes the VM's exit reason; every other thread of the VM is then told
/// to stop, as for any fatal exit.
pub(crate) fn spawn(
    name: String,
    kind: ThreadKind,
    index: u16,
    shared: Arc<Shared>,
    tid: Sender<libc::pid_t>,
    body: impl FnOnce(Arc<Shared>) + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            // Every log line of the thread says which VM it is about.
            let _span = tracing::error_span!("vm", vm = %shared.name).entered();
            // SAFETY: `shared` (and so its `faults`) lives until the end of
            // this closure, after the guard is dropped.
            let guard = unsafe { VmThreadGuard::enter(shared.faults(), kind, index) };
            // glibc gives a thread its malloc arena at its first allocation
            // (and may read /sys/devices/system/cpu/online then): do it
            // now, under the inherited runtime filter, not under ours.
            drop(std::hint::black_box(Box::new([0u8; 64])));
            let fail = |fault: ThreadFault| {
                shared.set_exit(ExitReason::ThreadFault {
                    thread: name.clone(),
                    kind,
                    vcpu: (kind == ThreadKind::Vcpu).then_some(index as u8),
                    fault,
                });
            };
            if kind == ThreadKind::Vcpu {
                // A vCPU runs at nice 0 even when its creator took a higher
                // priority (a `corral vmm` process's main thread does).
                crate::util::normal_priority();
            }
            let installed = seccomp::install(kind);
            crate::boottrace::step(match kind {
                ThreadKind::Vcpu => "vcpu-seccomp",
                _ => "thread-seccomp",
            });
            // The tid goes back once the filter is in place: when `start`
            // returns, every thread of the VM runs under its filter.
            // SAFETY: gettid has no preconditions.
            let _ = tid.send(unsafe { libc::gettid() });
            drop(tid);
            if let Err(e) = installed {
                tracing::error!(thread = name, "{e}");
                fail(ThreadFault::Setup(e.to_string()));
                drop(guard);
                return;
            }
            let sh = shared.clone();
            let r = catch_unwind(AssertUnwindSafe(move || body(sh)));
            if let Err(payload) = r {
                let msg = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(a non-string panic payload)".into());
                fail(ThreadFault::Panic(msg));
            }
            shared.check_faults();
            drop(guard);
        })
}
