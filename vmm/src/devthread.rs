//! The device thread of a VM: an event loop (event-manager) over the host's
//! stdin, the virtio-blk queue notifications and throttle timers (each disk is
//! a subscriber), and the VM's wake-up eventfd, which carries control messages
//! (live limit changes) from the API.

use std::os::fd::RawFd;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};

use corral_blkthrottle::LimitsError;
use corral_devices::SerialDevice;
use corral_devices::virtio::blk::Block;
use event_manager::{EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};

use crate::control::{Control, DiskOp};
use crate::shared::Shared;
use crate::util::{lock, raise_priority};
use crate::vm::VmError;

struct Stdin {
    serial: Arc<Mutex<SerialDevice>>,
}

impl MutEventSubscriber for Stdin {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let mut buf = [0u8; 64];
        // SAFETY: reading into a stack buffer of the given length from fd 0.
        let n = unsafe { libc::read(libc::STDIN_FILENO, buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 || events.event_set().contains(EventSet::HANG_UP) {
            if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                return;
            }
            // EOF or error: stop watching stdin.
            let _ = ops.remove(Events::empty_raw(libc::STDIN_FILENO));
            return;
        }
        lock(&self.serial).enqueue_input(&buf[..n as usize]);
    }

    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new_raw(libc::STDIN_FILENO, EventSet::IN)) {
            tracing::debug!("not reading stdin: {e}");
        }
    }
}

/// A disk's queue notifications and throttle timers, handled inside the
/// disk's `disk = NAME` log span (the device logs without knowing its name).
struct DiskEvents {
    span: tracing::Span,
    block: Arc<Mutex<Block>>,
}

impl MutEventSubscriber for DiskEvents {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let _span = self.span.enter();
        lock(&self.block).process(events, ops);
    }

    fn init(&mut self, ops: &mut EventOps) {
        let _span = self.span.enter();
        lock(&self.block).init(ops);
    }
}

struct Wake {
    shared: Arc<Shared>,
    fd: RawFd,
    control: Receiver<Control>,
}

impl Wake {
    /// Applies a disk's control message to its device, inside the disk's
    /// log span.
    fn with_disk(
        &self,
        disk: usize,
        f: impl FnOnce(&mut Block) -> Result<(), LimitsError>,
    ) -> Result<(), VmError> {
        let d = self
            .shared
            .disks
            .get(disk)
            .ok_or_else(|| VmError::NoSuchDisk(disk.to_string()))?;
        let _span = tracing::error_span!("disk", disk = %d.name).entered();
        f(&mut lock(&d.block)).map_err(|e| VmError::Disk {
            name: d.name.clone(),
            msg: e.to_string(),
        })
    }
}

impl MutEventSubscriber for Wake {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        self.shared.clear_wake();
        while let Ok(msg) = self.control.try_recv() {
            // A message whose sender gave up waiting is not applied.
            if !msg.claim.take() {
                continue;
            }
            let r = self.with_disk(msg.disk, |b| match &msg.op {
                DiskOp::Limits(limits) => b.set_limits(limits),
                DiskOp::Group(group) => b.set_group(group.as_ref().map(|(g, w)| (g, *w))),
                DiskOp::Weight(w) => b.set_group_weight(*w),
            });
            let _ = msg.reply.send(r);
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new_raw(self.fd, EventSet::IN)) {
            tracing::error!("device thread cannot watch its wake-up fd: {e}");
        }
    }
}

pub(crate) fn run(
    shared: Arc<Shared>,
    serial: Arc<Mutex<SerialDevice>>,
    stdin: bool,
    control: Receiver<Control>,
) {
    let mut em = match EventManager::<Arc<Mutex<dyn MutEventSubscriber + Send>>>::new() {
        Ok(em) => em,
        Err(e) => {
            tracing::error!("device thread: cannot create the event loop: {e:?}");
            return;
        }
    };
    // The device thread does little CPU work but must wake on time (throttle
    // timers, queue notifications) even when vCPU threads keep the host's
    // CPUs busy: give it a higher CFS weight (best effort; needs privileges).
    raise_priority();
    let fd = shared.wake_fd();
    em.add_subscriber(Arc::new(Mutex::new(Wake {
        shared: shared.clone(),
        fd,
        control,
    })));
    for d in &shared.disks {
        em.add_subscriber(Arc::new(Mutex::new(DiskEvents {
            span: tracing::error_span!("disk", disk = %d.name),
            block: d.block.clone(),
        })));
    }
    if stdin {
        em.add_subscriber(Arc::new(Mutex::new(Stdin { serial })));
    }
    #[cfg(debug_assertions)]
    let (mut inject_panic, mut inject_syscall) = (
        crate::seccomp::fault::injected("dev-panic", &shared.name),
        crate::seccomp::fault::injected("dev-syscall", &shared.name),
    );
    // Test-only (debug builds): the device thread stalls from its start,
    // holding the first disk's lock (see `stall`).
    #[cfg(debug_assertions)]
    if crate::seccomp::fault::injected("dev-stall", &shared.name) {
        stall(&shared);
    }
    #[cfg(debug_assertions)]
    let inject_at = std::time::Instant::now() + std::time::Duration::from_millis(1000);
    loop {
        // A seccomp violation recorded by the SIGSYS handler (of any of the
        // VM's threads: it writes our wake-up fd) stops the VM.
        shared.check_faults();
        if shared.is_stopping() {
            break;
        }
        // Test-only faults (debug builds; see crate::seccomp::fault): a
        // panic while holding the first disk's lock (a thread that locks it
        // must recover the poisoned lock), or a syscall outside the filter.
        #[cfg(debug_assertions)]
        if std::time::Instant::now() >= inject_at {
            if std::mem::take(&mut inject_syscall) {
                let r = crate::seccomp::fault::forbidden_syscall();
                tracing::warn!("fault injection: forbidden syscall returned {r}");
            }
            if std::mem::take(&mut inject_panic) {
                let _held = shared.disks.first().map(|d| lock(&d.block));
                panic!("fault injection: dev-panic");
            }
        }
        if let Err(e) = em.run_with_timeout(100) {
            tracing::error!("device thread: event loop failed: {e:?}");
            break;
        }
    }
}

/// How long the `dev-stall` fault holds the device thread.
#[cfg(debug_assertions)]
const STALL: std::time::Duration = std::time::Duration::from_secs(8);

/// The `dev-stall` fault: holds the first disk's lock for [`STALL`] (or
/// until the VM stops) without serving anything, as a device stuck in a
/// slow `preadv` would: the API must still answer, and a control message
/// times out.
#[cfg(debug_assertions)]
fn stall(shared: &Shared) {
    tracing::warn!("fault injection: the device thread stalls for {STALL:?}");
    let _held = shared.disks.first().map(|d| lock(&d.block));
    let end = std::time::Instant::now() + STALL;
    while std::time::Instant::now() < end && !shared.is_stopping() {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
