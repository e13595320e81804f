//! The virtio-mmio transport, version 2 (virtio 1.2, §4.2.2).
//!
//! One [`MmioTransport`] per device: a 4 KiB MMIO window, one IRQ, announced
//! to Linux as `virtio_mmio.device=4K@<base>:<irq>` on the kernel command line
//! (see [`MmioTransport::cmdline_arg`]).
//!
//! Every access is checked: registers are 32-bit wide at 32-bit aligned
//! offsets, config space accepts 1/2/4/8-byte accesses. Anything else (an
//! unknown offset, a wrong width, a write the current status forbids, a
//! feature the device did not offer, an invalid queue) is ignored and counted
//! in [`MmioStats`]; reads of such registers return 0.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::{Activation, Interrupt, VirtioDevice, features, status};
use crate::bus::{BusDevice, lock};
use crate::guest_log::{GuestErrorKind, GuestLog};

/// Size of the MMIO window of one device.
pub const MMIO_WINDOW_SIZE: u64 = 0x1000;

/// "virt" in little endian.
const MAGIC: u32 = 0x7472_6976;
/// Non-legacy virtio-mmio.
const VERSION: u32 = 2;
/// Vendor id reported to the guest ("CRRL"); drivers do not look at it.
const VENDOR_ID: u32 = 0x4c52_5243;

// Register offsets (§4.2.2).
const MAGIC_VALUE: u64 = 0x000;
const VERSION_REG: u64 = 0x004;
const DEVICE_ID: u64 = 0x008;
const VENDOR_ID_REG: u64 = 0x00c;
const DEVICE_FEATURES: u64 = 0x010;
const DEVICE_FEATURES_SEL: u64 = 0x014;
const DRIVER_FEATURES: u64 = 0x020;
const DRIVER_FEATURES_SEL: u64 = 0x024;
const QUEUE_SEL: u64 = 0x030;
const QUEUE_NUM_MAX: u64 = 0x034;
const QUEUE_NUM: u64 = 0x038;
const QUEUE_READY: u64 = 0x044;
/// Offset of `QueueNotify`, where the VMM registers the ioeventfds.
pub const QUEUE_NOTIFY: u64 = 0x050;
const INTERRUPT_STATUS: u64 = 0x060;
const INTERRUPT_ACK: u64 = 0x064;
const STATUS: u64 = 0x070;
const QUEUE_DESC_LOW: u64 = 0x080;
const QUEUE_DESC_HIGH: u64 = 0x084;
const QUEUE_DRIVER_LOW: u64 = 0x090;
const QUEUE_DRIVER_HIGH: u64 = 0x094;
const QUEUE_DEVICE_LOW: u64 = 0x0a0;
const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
const SHM_SEL: u64 = 0x0ac;
const SHM_LEN_LOW: u64 = 0x0b0;
const SHM_LEN_HIGH: u64 = 0x0b4;
const SHM_BASE_LOW: u64 = 0x0b8;
const SHM_BASE_HIGH: u64 = 0x0bc;
const CONFIG_GENERATION: u64 = 0x0fc;
const CONFIG: u64 = 0x100;

/// Counters of guest accesses the transport ignored. Shared (`Arc`) so the
/// VMM can export them without taking the device lock.
#[derive(Debug, Default)]
pub struct MmioStats {
    /// Reads of unknown registers or with a wrong width/alignment.
    pub bogus_reads: AtomicU64,
    /// Writes to unknown or read-only registers, with a wrong width, or
    /// forbidden in the current device status.
    pub bogus_writes: AtomicU64,
    /// `FEATURES_OK` refused: the driver accepted a feature that was not
    /// offered, or not `VIRTIO_F_VERSION_1`.
    pub refused_features: AtomicU64,
    /// `QueueReady` refused: size not a power of two or above the maximum,
    /// rings misaligned or outside guest memory.
    pub invalid_queues: AtomicU64,
    /// Successful activations (`DRIVER_OK`).
    pub activations: AtomicU64,
    /// Activations the device refused (the status then shows
    /// `DEVICE_NEEDS_RESET`).
    pub failed_activations: AtomicU64,
    /// Device resets (status 0).
    pub resets: AtomicU64,
    /// `QueueNotify` writes that came through an MMIO exit (no ioeventfd).
    pub mmio_notifies: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

#[derive(Clone, Copy, Debug)]
struct QueueRegs {
    max: u16,
    size: u16,
    ready: bool,
    desc: u64,
    avail: u64,
    used: u64,
}

impl QueueRegs {
    fn new(max: u16) -> Self {
        Self {
            max,
            size: max,
            ready: false,
            desc: 0,
            avail: 0,
            used: 0,
        }
    }

    /// Builds the queue the registers describe, or says why it is invalid.
    fn build(&self, mem: &GuestMemoryMmap, event_idx: bool) -> Result<Queue, virtio_queue::Error> {
        let mut q = Queue::new(self.max)?;
        q.try_set_size(self.size)?;
        q.try_set_desc_table_address(GuestAddress(self.desc))?;
        q.try_set_avail_ring_address(GuestAddress(self.avail))?;
        q.try_set_used_ring_address(GuestAddress(self.used))?;
        q.set_event_idx(event_idx);
        q.set_ready(true);
        // Our own check rather than `Queue::is_valid`, which logs (through
        // the `log` crate, unlimited) on every refusal.
        let n = u64::from(self.size);
        let inside = |addr: u64, len: u64| {
            GuestMemoryBackend::check_range(mem, GuestAddress(addr), len as usize)
        };
        if !(inside(self.desc, 16 * n)
            && inside(self.avail, 6 + 2 * n)
            && inside(self.used, 6 + 8 * n))
        {
            return Err(virtio_queue::Error::InvalidChain);
        }
        Ok(q)
    }
}

/// Errors building a transport.
#[derive(Debug, thiserror::Error)]
pub enum MmioError {
    /// The device declares a queue maximum that is 0, above 32768 or not a
    /// power of two.
    #[error("device queue {0} has an invalid maximum size {1}")]
    QueueMax(usize, u16),
    /// The device has no queue or a notify eventfd is missing.
    #[error("device declares {queues} queues but {events} notify eventfds")]
    QueueEvents {
        /// Number of queues.
        queues: usize,
        /// Number of eventfds.
        events: usize,
    },
    /// Cloning a notify eventfd failed.
    #[error("cannot clone a queue notify eventfd: {0}")]
    Clone(#[source] std::io::Error),
}

/// The virtio-mmio register file of one device.
pub struct MmioTransport {
    device: Arc<Mutex<dyn VirtioDevice>>,
    mem: GuestMemoryMmap,
    interrupt: Arc<Interrupt>,
    notify: Vec<EventFd>,
    device_type: u32,
    avail_features: u64,
    acked_features: u64,
    device_features_sel: u32,
    driver_features_sel: u32,
    queue_sel: u32,
    queues: Vec<QueueRegs>,
    status: u32,
    config_generation: u32,
    /// Snapshot of the device's config space: guest reads never wait for
    /// the device lock (held during disk I/O on the device thread).
    config: Vec<u8>,
    stats: Arc<MmioStats>,
    log: Arc<GuestLog>,
}

impl std::fmt::Debug for MmioTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmioTransport")
            .field("device_type", &self.device_type)
            .field("status", &self.status)
            .field("acked_features", &self.acked_features)
            .finish_non_exhaustive()
    }
}

impl MmioTransport {
    /// A transport for `device`, whose interrupts are raised through `irqfd`
    /// (the VMM registers it with `KVM_IRQFD` on the device's GSI).
    pub fn new(
        mem: GuestMemoryMmap,
        device: Arc<Mutex<dyn VirtioDevice>>,
        irqfd: EventFd,
    ) -> Result<Self, MmioError> {
        let (device_type, avail_features, maxes, notify, config, log) = {
            let d = lock(&device);
            let maxes = d.queue_max_sizes().to_vec();
            let evts = d.queue_events();
            if evts.len() != maxes.len() || maxes.is_empty() {
                return Err(MmioError::QueueEvents {
                    queues: maxes.len(),
                    events: evts.len(),
                });
            }
            for (i, &m) in maxes.iter().enumerate() {
                if m == 0 || m > 32768 || !m.is_power_of_two() {
                    return Err(MmioError::QueueMax(i, m));
                }
            }
            let notify = evts
                .iter()
                .map(EventFd::try_clone)
                .collect::<Result<Vec<_>, _>>()
                .map_err(MmioError::Clone)?;
            let config = d.config_space().to_vec();
            let log = d.guest_log();
            (
                d.device_type(),
                d.avail_features(),
                maxes,
                notify,
                config,
                log,
            )
        };
        Ok(Self {
            device,
            mem,
            interrupt: Arc::new(Interrupt::new(irqfd)),
            notify,
            device_type,
            avail_features,
            acked_features: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            queue_sel: 0,
            queues: maxes.into_iter().map(QueueRegs::new).collect(),
            status: 0,
            config_generation: 0,
            config,
            stats: Arc::new(MmioStats::default()),
            log,
        })
    }

    /// The kernel command line argument announcing a device at `base` with
    /// interrupt `irq`: `virtio_mmio.device=4K@0x<base>:<irq>`.
    pub fn cmdline_arg(base: u64, irq: u32) -> String {
        format!("virtio_mmio.device=4K@{base:#x}:{irq}")
    }

    /// The per-queue notify eventfds (clones of the device's): register
    /// queue `i`'s with `KVM_IOEVENTFD` at `base + QUEUE_NOTIFY`, datamatch
    /// `i as u32`.
    pub fn queue_events(&self) -> &[EventFd] {
        &self.notify
    }

    /// Re-reads the device's config space after the device changed it
    /// (e.g. a resize): bumps `ConfigGeneration` and raises a configuration
    /// change interrupt (§2.5.1, §4.2.2).
    pub fn config_changed(&mut self) {
        self.config = lock(&self.device).config_space().to_vec();
        self.config_generation = self.config_generation.wrapping_add(1);
        if self.status & status::DRIVER_OK != 0 {
            self.interrupt.trigger(super::int::CONFIG);
        }
    }

    /// Counters of ignored accesses.
    pub fn stats(&self) -> Arc<MmioStats> {
        self.stats.clone()
    }

    /// The device's interrupt (status register and irqfd).
    pub fn interrupt(&self) -> Arc<Interrupt> {
        self.interrupt.clone()
    }

    /// Current device status register as the guest sees it.
    pub fn status(&self) -> u32 {
        let nr = if self.interrupt.needs_reset() {
            status::DEVICE_NEEDS_RESET
        } else {
            0
        };
        self.status | nr
    }

    /// Features the driver accepted.
    pub fn acked_features(&self) -> u64 {
        self.acked_features
    }

    fn selected_queue(&mut self) -> Option<&mut QueueRegs> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    fn read_reg(&mut self, offset: u64) -> Option<u32> {
        let v = match offset {
            MAGIC_VALUE => MAGIC,
            VERSION_REG => VERSION,
            DEVICE_ID => self.device_type,
            VENDOR_ID_REG => VENDOR_ID,
            DEVICE_FEATURES => match self.device_features_sel {
                0 => self.avail_features as u32,
                1 => (self.avail_features >> 32) as u32,
                _ => 0,
            },
            QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| u32::from(q.max)),
            QUEUE_READY => self.selected_queue().map_or(0, |q| u32::from(q.ready)),
            INTERRUPT_STATUS => self.interrupt.status(),
            STATUS => self.status(),
            // No shared memory regions: length -1 means "no such region".
            SHM_LEN_LOW | SHM_LEN_HIGH | SHM_BASE_LOW | SHM_BASE_HIGH => u32::MAX,
            CONFIG_GENERATION => self.config_generation,
            _ => return None,
        };
        Some(v)
    }

    /// Queue configuration may change only before `DRIVER_OK` and while the
    /// selected queue is not enabled (§4.2.2.2, §4.2.3.2).
    fn queue_writable(&mut self) -> Option<&mut QueueRegs> {
        if self.status & status::DRIVER_OK != 0 {
            return None;
        }
        self.selected_queue().filter(|q| !q.ready)
    }

    fn write_reg(&mut self, offset: u64, v: u32) -> bool {
        fn set_lo(r: &mut u64, v: u32) {
            *r = (*r & !0xffff_ffff) | u64::from(v);
        }
        fn set_hi(r: &mut u64, v: u32) {
            *r = (*r & 0xffff_ffff) | (u64::from(v) << 32);
        }
        match offset {
            DEVICE_FEATURES_SEL => self.device_features_sel = v,
            DRIVER_FEATURES_SEL => self.driver_features_sel = v,
            DRIVER_FEATURES => {
                // Only between DRIVER and FEATURES_OK (§3.1.1).
                let s = self.status;
                if s & status::DRIVER == 0 || s & status::FEATURES_OK != 0 {
                    return false;
                }
                match self.driver_features_sel {
                    0 => set_lo(&mut self.acked_features, v),
                    1 => set_hi(&mut self.acked_features, v),
                    // No feature bits above 63: only 0 is a valid value.
                    _ => return v == 0,
                }
            }
            QUEUE_SEL => self.queue_sel = v,
            QUEUE_NUM => match self.queue_writable() {
                // Validated when the queue is enabled.
                Some(q) => q.size = v.try_into().unwrap_or(0),
                None => return false,
            },
            QUEUE_DESC_LOW | QUEUE_DESC_HIGH | QUEUE_DRIVER_LOW | QUEUE_DRIVER_HIGH
            | QUEUE_DEVICE_LOW | QUEUE_DEVICE_HIGH => {
                let Some(q) = self.queue_writable() else {
                    return false;
                };
                match offset {
                    QUEUE_DESC_LOW => set_lo(&mut q.desc, v),
                    QUEUE_DESC_HIGH => set_hi(&mut q.desc, v),
                    QUEUE_DRIVER_LOW => set_lo(&mut q.avail, v),
                    QUEUE_DRIVER_HIGH => set_hi(&mut q.avail, v),
                    QUEUE_DEVICE_LOW => set_lo(&mut q.used, v),
                    _ => set_hi(&mut q.used, v),
                }
            }
            QUEUE_READY => {
                if self.status & status::DRIVER_OK != 0 {
                    return false;
                }
                let mem = self.mem.clone();
                let stats = self.stats.clone();
                let log = self.log.clone();
                let sel = self.queue_sel;
                let Some(q) = self.selected_queue() else {
                    return false;
                };
                match v {
                    0 => q.ready = false,
                    1 => match q.build(&mem, false) {
                        Ok(_) => q.ready = true,
                        Err(e) => {
                            // Counted here, not as a bogus write; QueueReady
                            // reads back 0 so the driver sees the refusal.
                            bump(&stats.invalid_queues);
                            log.report(
                                GuestErrorKind::InvalidQueue,
                                format_args!(
                                    "virtio-mmio: refusing queue {sel} (size {}, desc {:#x}, avail {:#x}, used {:#x}): {e}",
                                    q.size, q.desc, q.avail, q.used
                                ),
                            );
                        }
                    },
                    _ => return false,
                }
            }
            QUEUE_NOTIFY => {
                bump(&self.stats.mmio_notifies);
                // Without VIRTIO_F_NOTIFICATION_DATA the value is the index.
                match self.notify.get(v as usize) {
                    Some(evt) => {
                        if let Err(e) = evt.write(1) {
                            tracing::warn!("virtio-mmio: cannot signal queue {v}: {e}");
                        }
                    }
                    None => return false,
                }
            }
            INTERRUPT_ACK => self.interrupt.ack(v),
            STATUS => return self.write_status(v),
            SHM_SEL => {}
            _ => return false,
        }
        true
    }

    fn write_status(&mut self, v: u32) -> bool {
        if v == 0 {
            self.reset();
            return true;
        }
        let old = self.status;
        // The driver only ever sets bits (§2.1.1); it cannot set
        // DEVICE_NEEDS_RESET (nor any undefined bit); once DRIVER_OK is set
        // only FAILED may follow.
        // (The mmio_transport fuzz target found undefined bits, 0xfeec1513,
        // taken as they were.)
        const DEFINED: u32 = status::ACKNOWLEDGE
            | status::DRIVER
            | status::DRIVER_OK
            | status::FEATURES_OK
            | status::FAILED;
        if v & old != old || v & !DEFINED != 0 {
            return false;
        }
        let new = v & !old;
        if new & status::DRIVER != 0 && v & status::ACKNOWLEDGE == 0 {
            return false;
        }
        if new & status::FEATURES_OK != 0 {
            if v & status::DRIVER == 0 || v & status::DRIVER_OK != 0 {
                return false;
            }
            let acked = self.acked_features;
            if acked & !self.avail_features != 0 || acked & features::VERSION_1 == 0 {
                // Leave FEATURES_OK clear: the driver reads the status back
                // and gives up (§3.1.1 step 6).
                bump(&self.stats.refused_features);
                self.log.report(
                    GuestErrorKind::RefusedFeatures,
                    format_args!(
                        "virtio-mmio: refusing features {acked:#x} (offered {:#x})",
                        self.avail_features
                    ),
                );
                self.status = v & !status::FEATURES_OK;
                return true;
            }
        }
        if new & status::DRIVER_OK != 0 {
            if v & status::FEATURES_OK == 0 {
                return false;
            }
            self.status = v;
            self.activate();
            return true;
        }
        self.status = v;
        true
    }

    fn activate(&mut self) {
        let event_idx = self.acked_features & features::RING_EVENT_IDX != 0;
        let mut queues = Vec::with_capacity(self.queues.len());
        for regs in &self.queues {
            let q = if regs.ready {
                match regs.build(&self.mem, event_idx) {
                    Ok(q) => q,
                    Err(_) => {
                        // Validated at QueueReady; the memory cannot shrink.
                        self.fail_activation("queue became invalid");
                        return;
                    }
                }
            } else {
                // Not enabled by the driver: never processed.
                match Queue::new(regs.max) {
                    Ok(q) => q,
                    Err(_) => {
                        self.fail_activation("bad queue maximum");
                        return;
                    }
                }
            };
            queues.push(q);
        }
        let act = Activation {
            mem: self.mem.clone(),
            queues,
            acked_features: self.acked_features,
            interrupt: self.interrupt.clone(),
        };
        let res = lock(&self.device).activate(act);
        match res {
            Ok(()) => {
                bump(&self.stats.activations);
                // Pick up buffers made available before DRIVER_OK.
                for (evt, regs) in self.notify.iter().zip(&self.queues) {
                    if regs.ready {
                        let _ = evt.write(1);
                    }
                }
            }
            Err(e) => self.fail_activation(&e.to_string()),
        }
    }

    fn fail_activation(&mut self, why: &str) {
        bump(&self.stats.failed_activations);
        self.log.report(
            GuestErrorKind::FailedActivation,
            format_args!("virtio-mmio: activation failed: {why}"),
        );
        self.interrupt.set_needs_reset();
    }

    fn reset(&mut self) {
        lock(&self.device).reset();
        bump(&self.stats.resets);
        self.interrupt.clear();
        self.status = 0;
        self.acked_features = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.queue_sel = 0;
        for q in &mut self.queues {
            *q = QueueRegs::new(q.max);
        }
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG {
            data.fill(0);
            let cfg = &self.config;
            if !matches!(data.len(), 1 | 2 | 4 | 8) {
                bump(&self.stats.bogus_reads);
                self.log.report(
                    GuestErrorKind::BadRegister,
                    format_args!("virtio-mmio: ignored {}-byte config read", data.len()),
                );
                return;
            }
            let start = (offset - CONFIG) as usize;
            if let Some(src) = cfg.get(start..) {
                let n = src.len().min(data.len());
                data[..n].copy_from_slice(&src[..n]);
            }
            return;
        }
        let v = if data.len() == 4 && offset.is_multiple_of(4) {
            self.read_reg(offset)
        } else {
            None
        };
        match v {
            Some(v) => data.copy_from_slice(&v.to_le_bytes()),
            None => {
                bump(&self.stats.bogus_reads);
                self.log.report(
                    GuestErrorKind::BadRegister,
                    format_args!(
                        "virtio-mmio: ignored read at {offset:#x} ({} bytes)",
                        data.len()
                    ),
                );
                data.fill(0);
            }
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let ok = if offset >= CONFIG {
            matches!(data.len(), 1 | 2 | 4 | 8)
                && lock(&self.device).write_config(offset - CONFIG, data)
        } else if let (Ok(b), 0) = (<[u8; 4]>::try_from(data), offset & 3) {
            self.write_reg(offset, u32::from_le_bytes(b))
        } else {
            false
        };
        if !ok {
            bump(&self.stats.bogus_writes);
            self.log.report(
                GuestErrorKind::BadRegister,
                format_args!(
                    "virtio-mmio: ignored write at {offset:#x} ({} bytes)",
                    data.len()
                ),
            );
        }
    }
}
