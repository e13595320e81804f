//! virtio-blk (virtio 1.2, §5.2) on `virtio-queue`, file-backed.
//!
//! One request queue of [`QUEUE_SIZE`] entries, served on the VM's device
//! thread: the [`Block`] is an [`event_manager::MutEventSubscriber`] watching
//! its queue's notify eventfd and its throttle timer. Requests: `IN`, `OUT`,
//! `FLUSH` (fdatasync), `GET_ID`, `DISCARD` and `WRITE_ZEROES` (fallocate).
//! Features: `RO` (read-only disks), `FLUSH`, `SEG_MAX`, `BLK_SIZE`,
//! `DISCARD` and `WRITE_ZEROES` (writable disks), plus `VERSION_1`,
//! `RING_INDIRECT_DESC`, `RING_EVENT_IDX`.
//!
//! The guest is hostile: a malformed request gets `VIRTIO_BLK_S_IOERR`
//! (`S_UNSUPP` for an unknown type), a chain without a status byte is
//! returned with used length 0; all are counted in [`BlockStats`] and
//! reported through the device's rate-limited [`GuestLog`]. A queue that
//! cannot be processed (available index ahead by more than the queue size,
//! a ring virtio-queue refuses to iterate, a head beyond the table) puts the
//! device in `DEVICE_NEEDS_RESET`, and it serves nothing more until reset.
//! Files: `queue.rs` (serving the ring), `request.rs` and `chain.rs`
//! (parsing), `execute.rs` (doing it), `uring.rs` and `inflight.rs` (the io_uring engine: [`IoEngine`]),
//! `event.rs` (device thread),
//! `throttle.rs` (the throttle seam and its timer), `control.rs` (live
//! limits and groups), `stats.rs` (the counters the device publishes in
//! [`DiskCounters`], read by the API without the device's lock). Processing yields after [`BUDGET`] requests so
//! one busy disk cannot starve the VM's other devices on the device thread.

pub mod backend;
pub mod chain;
mod control;
mod event;
mod execute;
mod inflight;
mod pollwin;
mod queue;
pub mod request;
pub mod spec;
mod stats;
pub mod throttle;
pub mod uring;

use std::sync::Arc;

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

pub use backend::{DiskError, DiskFile, SECTOR_SIZE};
pub use queue::POLL_NS;
pub use request::{Malformed, ParseError, Request, RequestType, Segment};
pub use spec::{DiskSpec, DiskSpecError, IoEngine};
pub use stats::{BlockStats, BlockStatsSnapshot, DiskCounters};
pub use throttle::{RequestThrottle, ThrottleTimer};

use super::{ActivateError, Activation, Interrupt, VirtioDevice, device_type, features};
use crate::guest_log::GuestLog;
use throttle::Nanos;

/// Size of the request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Requests served per wake-up before yielding to other event sources.
pub const BUDGET: usize = 2 * QUEUE_SIZE as usize;

/// Feature bits (§5.2.3).
pub mod feature {
    /// `seg_max` is valid.
    pub const SEG_MAX: u64 = 1 << 2;
    /// The disk is read-only.
    pub const RO: u64 = 1 << 5;
    /// `blk_size` is valid.
    pub const BLK_SIZE: u64 = 1 << 6;
    /// Flush command.
    pub const FLUSH: u64 = 1 << 9;
    /// Discard command.
    pub const DISCARD: u64 = 1 << 13;
    /// Write zeroes command.
    pub const WRITE_ZEROES: u64 = 1 << 14;
}

/// Status byte values (§5.2.6).
pub mod blk_status {
    /// Success.
    pub const OK: u8 = 0;
    /// I/O error (also: malformed request, out of range, read-only).
    pub const IOERR: u8 = 1;
    /// Unsupported request.
    pub const UNSUPP: u8 = 2;
}

/// Write-zeroes flag: the device may deallocate.
const WZ_UNMAP: u32 = 1;
/// Largest discard / write-zeroes range, in sectors (1 GiB).
pub const MAX_DISCARD_SECTORS: u32 = 1 << 21;
/// Most ranges in one discard / write-zeroes request.
pub const MAX_DISCARD_SEG: u32 = 32;
/// Length of the config space we expose (through `write_zeroes_may_unmap`).
const CONFIG_LEN: usize = 60;
const TIMER_TOKEN: u32 = u32::MAX;
const RING_TOKEN: u32 = u32::MAX - 1;

/// Options of a disk.
#[derive(Clone, Debug, Default)]
pub struct BlockOptions {
    /// Serial returned by `GET_ID` (truncated to 20 bytes).
    pub serial: String,
    /// I/O engine; `None`: [`IoEngine::auto_for`] the disk (uring for a
    /// `direct` disk where the kernel supports it, else sync).
    pub engine: Option<IoEngine>,
}

/// A request waiting for the throttle.
struct Waiting {
    req: Request,
    taken_at: Nanos,
}

struct Active {
    mem: GuestMemoryMmap,
    queue: Queue,
    interrupt: Arc<Interrupt>,
    event_idx: bool,
    broken: bool,
    waiting: Option<Waiting>,
}

/// Everything needed to execute a request, apart from the queue.
struct Engine {
    disk: DiskFile,
    serial: [u8; 20],
    acked: u64,
    stats: Arc<BlockStats>,
    log: Arc<GuestLog>,
    /// The io_uring engine's ring (`None`: the sync engine).
    uring: Option<uring::Uring>,
    /// Scratch list of reaped completions.
    done: Vec<uring::Done>,
}

/// A virtio-blk device.
pub struct Block {
    engine: Engine,
    avail_features: u64,
    config: [u8; CONFIG_LEN],
    queue_max: [u16; 1],
    queue_evts: [EventFd; 1],
    timer: ThrottleTimer,
    throttle: Option<Box<dyn RequestThrottle>>,
    /// What the device publishes for other threads.
    counters: Arc<DiskCounters>,
    active: Option<Active>,
    /// How long to keep polling the available ring after serving it: an
    /// adaptive window of at most [`POLL_NS`] or `CORRAL_BLK_POLL_US`.
    poll: pollwin::PollWindow,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block")
            .field("disk", &self.engine.disk)
            .field("engine", &self.engine())
            .field("active", &self.active.is_some())
            .finish_non_exhaustive()
    }
}

/// Errors creating a block device.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// Opening the disk failed.
    #[error(transparent)]
    Disk(#[from] DiskError),
    /// Creating an eventfd or timerfd failed.
    #[error("cannot create block device fds: {0}")]
    Fd(#[source] std::io::Error),
    /// `engine=uring` was asked for and the ring cannot be set up.
    #[error("cannot set up io_uring for the disk (use engine=sync): {0}")]
    Uring(#[source] std::io::Error),
}

impl Block {
    /// Opens the disk of a `--disk` spec.
    pub fn from_spec(spec: &DiskSpec) -> Result<Self, BlockError> {
        let disk = DiskFile::open(&spec.path, spec.read_only, spec.direct)?;
        let opts = BlockOptions {
            serial: spec.id.clone().unwrap_or_default(),
            engine: spec.engine,
        };
        let mut b = Self::new(disk, opts)?;
        if let Some(id) = &spec.id {
            b.set_guest_log(Arc::new(GuestLog::new(id.clone())));
        }
        Ok(b)
    }

    /// A device serving `disk`.
    pub fn new(disk: DiskFile, opts: BlockOptions) -> Result<Self, BlockError> {
        let mut avail_features = features::VERSION_1
            | features::RING_INDIRECT_DESC
            | features::RING_EVENT_IDX
            | feature::SEG_MAX
            | feature::BLK_SIZE
            | feature::FLUSH;
        if disk.read_only() {
            avail_features |= feature::RO;
        } else {
            avail_features |= feature::DISCARD | feature::WRITE_ZEROES;
        }
        let mut serial = [0u8; 20];
        let n = opts.serial.len().min(20);
        serial[..n].copy_from_slice(&opts.serial.as_bytes()[..n]);

        let mut config = [0u8; CONFIG_LEN];
        let mut put =
            |off: usize, bytes: &[u8]| config[off..off + bytes.len()].copy_from_slice(bytes);
        put(0, &(disk.capacity() / SECTOR_SIZE).to_le_bytes());
        // seg_max: leave room for the header and status descriptors.
        put(12, &u32::from(QUEUE_SIZE - 2).to_le_bytes());
        put(20, &(SECTOR_SIZE as u32).to_le_bytes());
        put(34, &1u16.to_le_bytes()); // num_queues
        put(36, &MAX_DISCARD_SECTORS.to_le_bytes());
        put(40, &MAX_DISCARD_SEG.to_le_bytes());
        put(44, &8u32.to_le_bytes()); // discard_sector_alignment: 4 KiB
        put(48, &MAX_DISCARD_SECTORS.to_le_bytes());
        put(52, &MAX_DISCARD_SEG.to_le_bytes());
        put(56, &[1]); // write_zeroes_may_unmap

        let direct = disk.direct();
        let uring = match opts.engine.unwrap_or_else(|| IoEngine::auto_for(direct)) {
            IoEngine::Sync => None,
            IoEngine::Uring => match uring::Uring::new() {
                Ok(u) => Some(u),
                Err(e) if opts.engine.is_some() => return Err(BlockError::Uring(e)),
                Err(e) => {
                    tracing::info!("virtio-blk: io_uring set-up failed ({e}); sync engine");
                    None
                }
            },
        };
        let stats = Arc::new(BlockStats::default());
        Ok(Self {
            counters: Arc::new(DiskCounters::new(stats.clone())),
            engine: Engine {
                disk,
                serial,
                acked: 0,
                stats,
                log: Arc::new(GuestLog::new("virtio-blk")),
                uring,
                done: Vec::new(),
            },
            avail_features,
            config,
            queue_max: [QUEUE_SIZE],
            queue_evts: [EventFd::new(EFD_NONBLOCK).map_err(BlockError::Fd)?],
            timer: ThrottleTimer::new().map_err(BlockError::Fd)?,
            throttle: None,
            active: None,
            poll: pollwin::PollWindow::new(queue::poll_ns()),
        })
    }

    /// Sets the longest the device keeps polling the available ring after
    /// it served it, in ns (0: not at all; default [`POLL_NS`] or
    /// `CORRAL_BLK_POLL_US`); the window adapts below it (`pollwin.rs`).
    pub fn set_poll_ns(&mut self, ns: u64) {
        self.poll = pollwin::PollWindow::new(ns);
    }

    /// Replaces the device's guest-error log (named after its VM and disk
    /// by the VMM; the transport shares it).
    pub fn set_guest_log(&mut self, log: Arc<GuestLog>) {
        self.engine.log = log;
    }

    /// Whether the device stopped serving its queue until the driver
    /// resets it (`DEVICE_NEEDS_RESET`).
    pub fn needs_reset(&self) -> bool {
        self.active.as_ref().is_some_and(|a| a.broken)
    }

    /// The engine serving this disk.
    pub fn engine(&self) -> IoEngine {
        if self.engine.uring.is_some() {
            IoEngine::Uring
        } else {
            IoEngine::Sync
        }
    }

    /// Counters of this disk.
    pub fn stats(&self) -> Arc<BlockStats> {
        self.engine.stats.clone()
    }

    /// Capacity in 512-byte sectors.
    pub fn capacity_sectors(&self) -> u64 {
        self.engine.disk.capacity() / SECTOR_SIZE
    }

    /// The throttle timer (registered by [`Block`]'s subscriber `init`).
    pub fn timer(&self) -> &ThrottleTimer {
        &self.timer
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        device_type::BLOCK
    }

    fn avail_features(&self) -> u64 {
        self.avail_features
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_max
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.queue_evts
    }

    fn config_space(&self) -> &[u8] {
        &self.config
    }

    fn guest_log(&self) -> Arc<GuestLog> {
        self.engine.log.clone()
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) -> bool {
        // No writable field (CONFIG_WCE is not offered).
        false
    }

    fn activate(&mut self, act: Activation) -> Result<(), ActivateError> {
        let Some(queue) = act.queues.into_iter().next().filter(|q| q.ready()) else {
            return Err(ActivateError::QueueNotReady(0));
        };
        self.reset();
        self.engine.acked = act.acked_features;
        self.active = Some(Active {
            mem: act.mem,
            queue,
            interrupt: act.interrupt,
            event_idx: act.acked_features & features::RING_EVENT_IDX != 0,
            broken: false,
            waiting: None,
        });
        tracing::debug!(
            "virtio-blk: activated, features {:#x}, event_idx {}",
            act.acked_features,
            self.active.as_ref().is_some_and(|a| a.event_idx)
        );
        Ok(())
    }

    fn reset(&mut self) {
        // Nothing in flight may complete into the memory or the used ring
        // of the queue being reset.
        self.drain_io();
        if let Some(a) = self.active.take()
            && a.waiting.is_some()
            && let Some(g) = self.throttle.as_mut()
        {
            g.cancel();
            g.note_dequeued();
        }
        let _ = self.timer.disarm();
        self.timer.drain();
        // No tight wait any more (the device thread drops its boost at its
        // next event: this may be a vCPU thread).
        self.timer.not_tight();
        let _ = self.queue_evts[0].read();
        self.engine.acked = 0;
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_control;
#[cfg(test)]
mod tests_hostile;
#[cfg(test)]
mod tests_inline;
#[cfg(test)]
mod tests_punctual;
#[cfg(test)]
mod tests_uring;
