//! The device thread of a VM: an event loop (event-manager) over the host's
//! stdin and the VM's wake-up eventfd. Later: virtio queue notifications,
//! throttle timers, control messages.

use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};

use corral_devices::SerialDevice;
use corral_devices::bus::lock;
use event_manager::{EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};

use crate::vm::Shared;

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

struct Wake {
    shared: Arc<Shared>,
    fd: RawFd,
}

impl MutEventSubscriber for Wake {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        self.shared.clear_wake();
    }

    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new_raw(self.fd, EventSet::IN)) {
            tracing::error!("device thread cannot watch its wake-up fd: {e}");
        }
    }
}

pub(crate) fn run(shared: Arc<Shared>, serial: Arc<Mutex<SerialDevice>>, stdin: bool) {
    let mut em = match EventManager::<Arc<Mutex<dyn MutEventSubscriber + Send>>>::new() {
        Ok(em) => em,
        Err(e) => {
            tracing::error!("device thread: cannot create the event loop: {e:?}");
            return;
        }
    };
    let fd = shared.wake_fd();
    em.add_subscriber(Arc::new(Mutex::new(Wake {
        shared: shared.clone(),
        fd,
    })));
    if stdin {
        em.add_subscriber(Arc::new(Mutex::new(Stdin { serial })));
    }
    while !shared.is_stopping() {
        if let Err(e) = em.run_with_timeout(100) {
            tracing::error!("device thread: event loop failed: {e:?}");
            break;
        }
    }
}
