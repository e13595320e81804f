//! Virtio devices over the virtio-mmio transport (virtio 1.2, §4.2.2,
//! "version 2" register layout).
//!
//! # Threads and locks
//!
//! A virtio device of a VM is two objects:
//!
//! * the [`MmioTransport`] (a [`BusDevice`](crate::BusDevice)), reached by the
//!   vCPU threads on MMIO exits. It holds the register file: feature
//!   negotiation, queue configuration, the status, and validates all of them;
//! * the device model itself (e.g. [`blk::Block`]), an
//!   [`event_manager::MutEventSubscriber`] on the VM's device thread. It
//!   watches one notify [`EventFd`] per queue
//!   (the VMM registers each as an ioeventfd on `QueueNotify`) and serves the
//!   requests.
//!
//! The transport holds an `Arc<Mutex<device>>` and takes the device's lock
//! only to read/write config space, activate (on `DRIVER_OK`) and reset
//! (status 0): rare events. The hot MMIO registers (`InterruptStatus`,
//! `InterruptACK`, `QueueNotify` without ioeventfd) take only the transport's
//! lock, which the device thread never takes, so a vCPU never waits for disk
//! I/O in progress. Lock order: transport, then device.
//!
//! Interrupts: the device sets a bit in the shared [`Interrupt`] status and
//! writes the irqfd; the guest reads `InterruptStatus` and acks through the
//! transport.

pub mod blk;
#[cfg(any(test, feature = "test-utils"))]
pub mod fuzz_targets;
pub mod mmio;
#[cfg(any(test, feature = "test-utils"))]
pub mod testing;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use virtio_queue::Queue;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

pub use mmio::{MMIO_WINDOW_SIZE, MmioStats, MmioTransport};

/// Device status bits (§2.1).
pub mod status {
    /// The guest has noticed the device.
    pub const ACKNOWLEDGE: u32 = 1;
    /// The guest knows how to drive the device.
    pub const DRIVER: u32 = 2;
    /// The driver is set up and ready to drive the device.
    pub const DRIVER_OK: u32 = 4;
    /// Feature negotiation is complete.
    pub const FEATURES_OK: u32 = 8;
    /// The device hit an error it cannot recover from.
    pub const DEVICE_NEEDS_RESET: u32 = 64;
    /// The driver gave up on the device.
    pub const FAILED: u32 = 128;
}

/// Feature bits of the transport and rings (§6).
pub mod features {
    /// Indirect descriptor tables (§2.7.5.3).
    pub const RING_INDIRECT_DESC: u64 = 1 << 28;
    /// `used_event` / `avail_event` notification suppression (§2.7.7, §2.7.10).
    pub const RING_EVENT_IDX: u64 = 1 << 29;
    /// Virtio 1.x (non-legacy) device.
    pub const VERSION_1: u64 = 1 << 32;
}

/// Interrupt status bits (§4.2.2, `InterruptStatus`).
pub mod int {
    /// A used buffer notification.
    pub const VRING: u32 = 1;
    /// A configuration change notification.
    pub const CONFIG: u32 = 2;
}

/// Device type ids (§5).
pub mod device_type {
    /// Block device.
    pub const BLOCK: u32 = 2;
}

/// The interrupt line of one virtio-mmio device: the `InterruptStatus`
/// register, shared by the transport (guest reads and acks) and the device
/// (sets bits), plus the irqfd that raises the guest IRQ.
#[derive(Debug)]
pub struct Interrupt {
    status: AtomicU32,
    needs_reset: AtomicBool,
    irqfd: EventFd,
}

impl Interrupt {
    /// An interrupt raised by writing `irqfd` (registered by the VMM with
    /// `KVM_IRQFD` on the device's GSI).
    pub fn new(irqfd: EventFd) -> Self {
        Self {
            status: AtomicU32::new(0),
            needs_reset: AtomicBool::new(false),
            irqfd,
        }
    }

    /// The current `InterruptStatus`.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::Acquire)
    }

    /// Sets `bits` and raises the IRQ.
    pub fn trigger(&self, bits: u32) {
        self.status.fetch_or(bits, Ordering::AcqRel);
        if let Err(e) = self.irqfd.write(1) {
            tracing::warn!("virtio: cannot signal irqfd: {e}");
        }
    }

    /// Clears `bits` (the guest's `InterruptACK`).
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::AcqRel);
    }

    /// The device hit an unrecoverable error (e.g. a broken ring): the
    /// transport reports `DEVICE_NEEDS_RESET` in the status until the
    /// driver resets the device, and a configuration interrupt is raised
    /// (§2.1.2).
    pub fn set_needs_reset(&self) {
        if !self.needs_reset.swap(true, Ordering::AcqRel) {
            self.trigger(int::CONFIG);
        }
    }

    /// Whether [`Interrupt::set_needs_reset`] was called since the last reset.
    pub fn needs_reset(&self) -> bool {
        self.needs_reset.load(Ordering::Acquire)
    }

    fn clear(&self) {
        self.status.store(0, Ordering::Release);
        self.needs_reset.store(false, Ordering::Release);
    }
}

/// What a device receives when the driver sets `DRIVER_OK`.
#[derive(Debug)]
pub struct Activation {
    /// Guest memory (clone of the VM's mapping).
    pub mem: GuestMemoryMmap,
    /// One queue per [`VirtioDevice::queue_max_sizes`] entry, validated
    /// against `mem`; a queue the driver did not enable has `ready() == false`.
    pub queues: Vec<Queue>,
    /// Features the driver accepted (a subset of the offered ones).
    pub acked_features: u64,
    /// The device's interrupt.
    pub interrupt: std::sync::Arc<Interrupt>,
}

/// Why a device refused activation.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    /// A queue the device needs is not enabled.
    #[error("queue {0} is required but not ready")]
    QueueNotReady(usize),
    /// Anything else.
    #[error("{0}")]
    Other(String),
}

/// A virtio device model behind an [`MmioTransport`].
pub trait VirtioDevice: Send {
    /// Virtio device id ([`device_type`]).
    fn device_type(&self) -> u32;
    /// Features offered to the driver (device-specific and transport bits).
    fn avail_features(&self) -> u64;
    /// Maximum size of each queue (powers of two); its length is the number
    /// of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// The per-queue notify eventfds, created with the device and alive as
    /// long as it (the VMM registers them as ioeventfds).
    fn queue_events(&self) -> &[EventFd];
    /// The device's guest-error counters and rate-limited log (shared with
    /// its transport).
    fn guest_log(&self) -> std::sync::Arc<crate::guest_log::GuestLog>;
    /// The device configuration space (snapshotted by the transport at
    /// creation and on [`MmioTransport::config_changed`]).
    fn config_space(&self) -> &[u8];
    /// A config space write by the driver; returns false if refused
    /// (counted by the transport).
    fn write_config(&mut self, offset: u64, data: &[u8]) -> bool;
    /// Starts serving queues (the driver set `DRIVER_OK`).
    fn activate(&mut self, act: Activation) -> Result<(), ActivateError>;
    /// Stops serving and forgets all queue state (status 0 written). After
    /// `reset` the device can be activated again.
    fn reset(&mut self);
}
