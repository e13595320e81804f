//! The device thread of a VM: an event loop (event-manager) over the host's
//! stdin, the virtio-blk queue notifications and throttle timers (each disk is
//! a subscriber), and the VM's wake-up eventfd, which carries control messages
//! (live limit changes) from the API.

use std::os::fd::RawFd;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};

use corral_blkthrottle::{Limits, Throttle, ThrottleGroup};
use corral_devices::SerialDevice;
use corral_devices::virtio::blk::Block;
use event_manager::{EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};

use crate::control::Control;
use crate::shared::Shared;
use crate::util::{lock, monotonic_ns, raise_priority};
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
    fn set_limits(&self, disk: usize, limits: Limits) -> Result<(), VmError> {
        let (name, _, block) = self
            .shared
            .disks
            .get(disk)
            .ok_or_else(|| VmError::NoSuchDisk(disk.to_string()))?;
        let _span = tracing::error_span!("disk", disk = %name).entered();
        let mut b = lock(block);
        let now = monotonic_ns();
        let err = |msg: String| VmError::Disk {
            name: name.clone(),
            msg,
        };
        match b
            .throttle_mut()
            .and_then(|g| g.as_any_mut().downcast_mut::<Throttle>())
        {
            Some(t) => t.set_limits(&limits, now).map_err(|e| err(e.to_string()))?,
            None => {
                if limits.is_unlimited() {
                    return Ok(());
                }
                let t = Throttle::new(&limits, now).map_err(|e| err(e.to_string()))?;
                // set_throttle re-polls a waiting request against the new throttle.
                b.set_throttle(Some(Box::new(t)));
                return Ok(());
            }
        }
        b.throttle_changed();
        Ok(())
    }
}

impl Wake {
    fn set_group(&self, disk: usize, group: Option<(ThrottleGroup, u32)>) -> Result<(), VmError> {
        let (name, _, block) = self
            .shared
            .disks
            .get(disk)
            .ok_or_else(|| VmError::NoSuchDisk(disk.to_string()))?;
        let _span = tracing::error_span!("disk", disk = %name).entered();
        let err = |msg: String| VmError::Disk {
            name: name.clone(),
            msg,
        };
        let mut b = lock(block);
        let now = monotonic_ns();
        if let Some(t) = b
            .throttle_mut()
            .and_then(|g| g.as_any_mut().downcast_mut::<Throttle>())
        {
            match &group {
                Some((g, w)) => t.join_group(g, *w, None).map_err(|e| err(e.to_string()))?,
                None => t.leave_group(),
            }
            b.throttle_changed();
            return Ok(());
        }
        if let Some((g, w)) = group {
            let mut t = Throttle::new(&Limits::default(), now).map_err(|e| err(e.to_string()))?;
            t.join_group(&g, w, None).map_err(|e| err(e.to_string()))?;
            b.set_throttle(Some(Box::new(t)));
        }
        Ok(())
    }
}

impl MutEventSubscriber for Wake {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        self.shared.clear_wake();
        while let Ok(msg) = self.control.try_recv() {
            match msg {
                Control::SetLimits {
                    disk,
                    limits,
                    reply,
                } => {
                    let r = self.set_limits(disk, limits);
                    let _ = reply.send(r);
                }
                Control::SetGroup { disk, group, reply } => {
                    let r = self.set_group(disk, group);
                    let _ = reply.send(r);
                }
            }
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
    for (name, _, block) in &shared.disks {
        em.add_subscriber(Arc::new(Mutex::new(DiskEvents {
            span: tracing::error_span!("disk", disk = %name),
            block: block.clone(),
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
        // panic while holding the first disk's lock (which the API takes
        // for the VM's disk counters: it must recover the poisoned lock),
        // or a syscall outside the filter.
        #[cfg(debug_assertions)]
        if std::time::Instant::now() >= inject_at {
            if std::mem::take(&mut inject_syscall) {
                let r = crate::seccomp::fault::forbidden_syscall();
                tracing::warn!("fault injection: forbidden syscall returned {r}");
            }
            if std::mem::take(&mut inject_panic) {
                let _held = shared.disks.first().map(|(_, _, b)| lock(b));
                panic!("fault injection: dev-panic");
            }
        }
        if let Err(e) = em.run_with_timeout(100) {
            tracing::error!("device thread: event loop failed: {e:?}");
            break;
        }
    }
}
