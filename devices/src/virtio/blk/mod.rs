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
//! returned with used length 0; all are counted in [`BlockStats`]. A broken
//! ring (available index ahead by more than the queue size) puts the device
//! in `DEVICE_NEEDS_RESET`. Processing yields after [`BUDGET`] requests so
//! one busy disk cannot starve the VM's other devices on the device thread.

pub mod backend;
pub mod gate;
pub mod request;
pub mod spec;

use std::num::Wrapping;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

pub use backend::{DiskError, DiskFile, SECTOR_SIZE};
pub use gate::{GateTimer, RequestGate};
pub use request::{Malformed, ParseError, Request, RequestType, Segment};
pub use spec::{DiskSpec, DiskSpecError};

use super::{ActivateError, Activation, Interrupt, VirtioDevice, device_type, features, int};
use gate::{Decision, GateRequest, Nanos, OpKind, monotonic_ns};

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

/// Counters of one disk (atomics: read by the API without the device lock).
#[derive(Debug, Default)]
pub struct BlockStats {
    /// Completed `IN` requests.
    pub read_ops: AtomicU64,
    /// Bytes read.
    pub read_bytes: AtomicU64,
    /// Completed `OUT` requests.
    pub write_ops: AtomicU64,
    /// Bytes written.
    pub write_bytes: AtomicU64,
    /// Completed `FLUSH` requests.
    pub flush_ops: AtomicU64,
    /// Completed `GET_ID`, `DISCARD`, `WRITE_ZEROES` requests.
    pub other_ops: AtomicU64,
    /// Requests answered `VIRTIO_BLK_S_IOERR` (malformed ones included).
    pub io_errors: AtomicU64,
    /// Requests answered `VIRTIO_BLK_S_UNSUPP`.
    pub unsupported: AtomicU64,
    /// Malformed chains (bad layout, address outside memory, ...).
    pub malformed: AtomicU64,
    /// Chains without a status byte (returned with length 0).
    pub no_status: AtomicU64,
    /// Times a request had to wait for the gate.
    pub throttled: AtomicU64,
    /// Times the ring was found broken (device set `DEVICE_NEEDS_RESET`).
    pub broken_rings: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Options of a disk.
#[derive(Clone, Debug, Default)]
pub struct BlockOptions {
    /// Serial returned by `GET_ID` (truncated to 20 bytes).
    pub serial: String,
}

/// A request waiting for the gate.
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
}

/// A virtio-blk device.
pub struct Block {
    engine: Engine,
    avail_features: u64,
    config: [u8; CONFIG_LEN],
    queue_max: [u16; 1],
    queue_evts: [EventFd; 1],
    timer: GateTimer,
    gate: Option<Box<dyn RequestGate>>,
    active: Option<Active>,
    /// How long to keep polling the available ring after serving it (ns).
    poll_ns: u64,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block")
            .field("disk", &self.engine.disk)
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
}

impl Block {
    /// Opens the disk of a `--disk` spec.
    pub fn from_spec(spec: &DiskSpec) -> Result<Self, BlockError> {
        let disk = DiskFile::open(&spec.path, spec.read_only, spec.direct)?;
        let opts = BlockOptions {
            serial: spec.id.clone().unwrap_or_default(),
        };
        Self::new(disk, opts)
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

        Ok(Self {
            engine: Engine {
                disk,
                serial,
                acked: 0,
                stats: Arc::new(BlockStats::default()),
            },
            avail_features,
            config,
            queue_max: [QUEUE_SIZE],
            queue_evts: [EventFd::new(EFD_NONBLOCK).map_err(BlockError::Fd)?],
            timer: GateTimer::new().map_err(BlockError::Fd)?,
            gate: None,
            active: None,
            poll_ns: poll_ns(),
        })
    }

    /// Sets how long the device keeps polling the available ring after it
    /// served it, in ns (0: not at all; default [`POLL_NS`] or
    /// `CORRAL_BLK_POLL_US`).
    pub fn set_poll_ns(&mut self, ns: u64) {
        self.poll_ns = ns;
    }

    /// Counters of this disk.
    pub fn stats(&self) -> Arc<BlockStats> {
        self.engine.stats.clone()
    }

    /// Capacity in 512-byte sectors.
    pub fn capacity_sectors(&self) -> u64 {
        self.engine.disk.capacity() / SECTOR_SIZE
    }

    /// Installs (or removes) the throttling gate. A request waiting for the
    /// old gate is re-polled against the new one.
    pub fn set_gate(&mut self, gate: Option<Box<dyn RequestGate>>) {
        if let (Some(old), Some(a)) = (self.gate.as_mut(), self.active.as_ref())
            && a.waiting.is_some()
        {
            old.cancel();
            old.note_dequeued();
        }
        self.gate = gate;
        if let Some(a) = self.active.as_ref()
            && a.waiting.is_some()
            && let Some(g) = self.gate.as_mut()
        {
            g.note_enqueued();
        }
        self.gate_changed();
    }

    /// The gate, e.g. to change limits (downcast with
    /// [`RequestGate::as_any_mut`]); call [`Block::gate_changed`] afterwards.
    pub fn gate_mut(&mut self) -> Option<&mut (dyn RequestGate + 'static)> {
        self.gate.as_deref_mut()
    }

    /// Re-polls a waiting request now (after a live limit change) and
    /// resumes the queue if it is admitted.
    pub fn gate_changed(&mut self) {
        self.process_queue();
    }

    /// The throttle timer (registered by [`Block`]'s subscriber `init`).
    pub fn timer(&self) -> &GateTimer {
        &self.timer
    }

    /// Serves the request queue: the waiting request first, then the
    /// available ring, until it is empty, the gate says wait, or the budget
    /// is spent (then the queue's eventfd is re-signalled to come back).
    pub fn process_queue(&mut self) {
        let Some(act) = self.active.as_mut() else {
            return;
        };
        if act.broken || !act.queue.ready() {
            return;
        }
        let mut used_any = false;
        let now = if self.gate.is_some() {
            monotonic_ns()
        } else {
            0
        };

        // The request the gate held back, if any.
        if let Some(w) = act.waiting.take() {
            let g = self.gate.as_mut();
            match admit(g, &w.req, now) {
                Some(until) => {
                    act.waiting = Some(w);
                    arm(&self.timer, until);
                    return;
                }
                None => {
                    if let Some(g) = self.gate.as_mut() {
                        g.note_dequeued();
                    }
                    self.engine
                        .complete(act, self.gate.as_deref_mut(), &w.req, w.taken_at);
                    used_any = true;
                }
            }
        }

        let mut budget = BUDGET;
        'outer: loop {
            if !ring_sane(act, &self.engine.stats) {
                return;
            }
            if !notifications_off(act, &self.engine.stats) {
                return;
            }
            while let Some(chain) = act.queue.pop_descriptor_chain(&act.mem) {
                used_any = true;
                budget -= 1;
                if budget == 0 {
                    // Let the other event sources run; come back soon.
                    let _ = self.queue_evts[0].write(1);
                }
                let req = match request::parse(chain, &act.mem) {
                    Ok(r) => r,
                    Err(m) => {
                        self.engine.malformed(act, m);
                        if budget == 0 {
                            break 'outer;
                        }
                        continue;
                    }
                };
                let taken_at = now;
                if let Some(until) = admit(self.gate.as_mut(), &req, now) {
                    add(&self.engine.stats.throttled, 1);
                    if let Some(g) = self.gate.as_mut() {
                        g.note_enqueued();
                    }
                    act.waiting = Some(Waiting { req, taken_at });
                    arm(&self.timer, until);
                    break 'outer;
                }
                self.engine
                    .complete(act, self.gate.as_deref_mut(), &req, taken_at);
                if budget == 0 {
                    break 'outer;
                }
            }
            match notifications_on(act, &self.engine.stats) {
                Some(true) => continue,
                Some(false) => break,
                None => return,
            }
        }
        if used_any {
            // Without EVENT_IDX, virtio-queue does not look at the driver's
            // VRING_AVAIL_F_NO_INTERRUPT flag; the spec says the device
            // should not interrupt then (a polling driver asked for none, and
            // each needless interrupt kicks its vCPU out of the guest).
            let suppressed = !act.event_idx && avail_no_interrupt(&act.mem, act.queue.avail_ring());
            if !suppressed {
                match act.queue.needs_notification(&act.mem) {
                    Ok(true) => act.interrupt.trigger(int::VRING),
                    Ok(false) => {}
                    Err(_) => break_ring(act, &self.engine.stats),
                }
            }
        }
    }

    /// Serves the queue, then keeps polling the available ring for up to
    /// the poll window for more requests before going back to sleep. While
    /// it polls, `VRING_USED_F_NO_NOTIFY` stays set, so a driver that checks
    /// it (the probe does; Linux does) skips its notify: a driver that
    /// refills the ring as completions arrive is served with neither a
    /// guest exit nor a device thread wake-up per batch. When the window
    /// ends without work, notifications are re-enabled and the ring checked
    /// once more (a request published just before that check would
    /// otherwise wait for a notify that never comes).
    pub fn process_queue_polling(&mut self) {
        let poll = self.poll_ns;
        if poll == 0 {
            self.process_queue();
            return;
        }
        loop {
            self.process_queue();
            let Some(act) = self.active.as_mut() else {
                return;
            };
            if act.broken || act.waiting.is_some() || !act.queue.ready() {
                return;
            }
            if !notifications_off(act, &self.engine.stats) {
                return;
            }
            let seen = Wrapping(act.queue.next_avail());
            let deadline = monotonic_ns().saturating_add(poll);
            let more = loop {
                match act.queue.avail_idx(&act.mem, Ordering::Acquire) {
                    Ok(idx) if idx != seen => break true,
                    Ok(_) => {}
                    Err(_) => {
                        break_ring(act, &self.engine.stats);
                        return;
                    }
                }
                if monotonic_ns() >= deadline {
                    break false;
                }
                std::hint::spin_loop();
            };
            if more {
                continue;
            }
            match notifications_on(act, &self.engine.stats) {
                Some(true) => continue,
                Some(false) | None => return,
            }
        }
    }
}

/// How long the device thread keeps polling a queue after serving it, by
/// default; `CORRAL_BLK_POLL_US` overrides it (0 turns polling off).
///
/// Measured here (`blkbench --poll-ab`, interleaved pairs, guest time):
/// 2048 × 4 KiB reads at queue depth 4 take 0.61× the time with 200 µs of
/// polling (76 → 46 ms; the probe then notifies once for the whole job
/// instead of ~1000 times), 0.68× at depth 1, 0.78–0.89× for 128 KiB
/// requests. 50 µs is shorter than the driver's turnaround for a batch
/// (~100 µs of emulated guest code here) and gave only 0.85×. The spinning
/// is the VM's own CPU: the gate backend charges the device thread's CPU
/// time to the VM, and polling stops while its vCPUs are parked (nothing
/// new arrives, the window runs out) or a request waits for the throttle.
pub const POLL_NS: u64 = 200_000;

fn poll_ns() -> u64 {
    static V: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        std::env::var("CORRAL_BLK_POLL_US")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(POLL_NS, |us| us.saturating_mul(1000))
    })
}

/// Whether the driver set VRING_AVAIL_F_NO_INTERRUPT in the available ring.
fn avail_no_interrupt(mem: &GuestMemoryMmap, avail_ring: u64) -> bool {
    mem.read_obj::<u16>(GuestAddress(avail_ring))
        .map(|flags| u16::from_le(flags) & 1 != 0)
        .unwrap_or(false)
}

/// Asks the gate; `Some(until)` if the request must wait.
fn admit(gate: Option<&mut Box<dyn RequestGate>>, req: &Request, now: Nanos) -> Option<Nanos> {
    let g = gate?;
    let gr = match req.kind {
        RequestType::In => GateRequest::read(req.data_len),
        RequestType::Out => GateRequest::write(req.data_len),
        _ => GateRequest::other(),
    };
    match g.poll(gr, now) {
        Decision::Admit => None,
        Decision::Wait { until, .. } => Some(until),
    }
}

fn arm(timer: &GateTimer, until: Nanos) {
    if let Err(e) = timer.arm_at(until) {
        tracing::error!("virtio-blk: cannot arm the throttle timer: {e}");
    }
}

/// Tells the driver it need not notify (the device is serving or polling
/// the ring); false if the ring is broken (and now marked so).
fn notifications_off(act: &mut Active, stats: &BlockStats) -> bool {
    let ok = act.queue.disable_notification(&act.mem).is_ok();
    if !ok {
        break_ring(act, stats);
    }
    ok
}

/// Asks the driver to notify again; `Some(true)` if requests arrived in
/// the meantime (serve them before sleeping), `None` if the ring is broken
/// (and now marked so).
fn notifications_on(act: &mut Active, stats: &BlockStats) -> Option<bool> {
    let r = act.queue.enable_notification(&act.mem).ok();
    if r.is_none() {
        break_ring(act, stats);
    }
    r
}

fn break_ring(act: &mut Active, stats: &BlockStats) {
    act.broken = true;
    add(&stats.broken_rings, 1);
    tracing::warn!("virtio-blk: broken ring, device needs reset");
    act.interrupt.set_needs_reset();
}

/// The driver may not make more than queue-size buffers available at once
/// (§2.7.13.3); more means a corrupt or hostile ring.
fn ring_sane(act: &mut Active, stats: &BlockStats) -> bool {
    let ok = match act.queue.avail_idx(&act.mem, Ordering::Acquire) {
        Ok(idx) => (idx - Wrapping(act.queue.next_avail())).0 <= act.queue.size(),
        Err(_) => false,
    };
    if !ok {
        break_ring(act, stats);
    }
    ok
}

impl Engine {
    fn finish(&self, act: &mut Active, head: u16, status: Option<(GuestAddress, u8)>, len: u32) {
        if let Some((addr, s)) = status
            && act.mem.write_obj(s, addr).is_err()
        {
            // Checked at parse time; cannot happen.
            add(&self.stats.no_status, 1);
        }
        if act.queue.add_used(&act.mem, head, len).is_err() {
            break_ring(act, &self.stats);
        }
    }

    fn malformed(&self, act: &mut Active, m: Malformed) {
        tracing::debug!("virtio-blk: malformed request: {}", m.error);
        match m.status {
            Some(addr) => {
                add(&self.stats.malformed, 1);
                add(&self.stats.io_errors, 1);
                self.finish(act, m.head, Some((addr, blk_status::IOERR)), 1);
            }
            None => {
                add(&self.stats.no_status, 1);
                self.finish(act, m.head, None, 0);
            }
        }
    }

    /// Executes `req` and puts it in the used ring.
    fn complete(
        &mut self,
        act: &mut Active,
        gate: Option<&mut (dyn RequestGate + 'static)>,
        req: &Request,
        taken_at: Nanos,
    ) {
        let (status, written) = self.execute(&act.mem, req);
        match status {
            blk_status::OK => {}
            blk_status::UNSUPP => add(&self.stats.unsupported, 1),
            _ => add(&self.stats.io_errors, 1),
        }
        // Used length: bytes written into the chain, status included.
        let len = u32::try_from(written).map_or(u32::MAX, |w| w.saturating_add(1));
        self.finish(act, req.head, Some((req.status, status)), len);
        if let Some(g) = gate {
            let kind = match req.kind {
                RequestType::In => OpKind::Read,
                RequestType::Out => OpKind::Write,
                _ => OpKind::Other,
            };
            g.record_latency(kind, monotonic_ns().saturating_sub(taken_at));
        }
    }

    /// Byte offset of a range of `len` bytes at `sector`, if inside the disk.
    fn range(&self, sector: u64, len: u64) -> Option<u64> {
        let off = sector.checked_mul(SECTOR_SIZE)?;
        (off.checked_add(len)? <= self.disk.capacity()).then_some(off)
    }

    /// Returns (status, bytes written to guest data buffers).
    fn execute(&mut self, mem: &GuestMemoryMmap, req: &Request) -> (u8, u64) {
        let st = self.stats.clone();
        match req.kind {
            RequestType::In => {
                let Some(off) = self.range(req.sector, req.data_len) else {
                    return (blk_status::IOERR, 0);
                };
                match self.disk.read(mem, &req.data, off) {
                    Ok(()) => {
                        add(&st.read_ops, 1);
                        add(&st.read_bytes, req.data_len);
                        (blk_status::OK, req.data_len)
                    }
                    Err(e) => {
                        tracing::debug!("virtio-blk: read at {off:#x} failed: {e}");
                        (blk_status::IOERR, 0)
                    }
                }
            }
            RequestType::Out => {
                if self.disk.read_only() {
                    return (blk_status::IOERR, 0);
                }
                let Some(off) = self.range(req.sector, req.data_len) else {
                    return (blk_status::IOERR, 0);
                };
                match self.disk.write(mem, &req.data, off) {
                    Ok(()) => {
                        add(&st.write_ops, 1);
                        add(&st.write_bytes, req.data_len);
                        (blk_status::OK, 0)
                    }
                    Err(e) => {
                        tracing::debug!("virtio-blk: write at {off:#x} failed: {e}");
                        (blk_status::IOERR, 0)
                    }
                }
            }
            RequestType::Flush => match self.disk.flush() {
                Ok(()) => {
                    add(&st.flush_ops, 1);
                    (blk_status::OK, 0)
                }
                Err(e) => {
                    tracing::warn!("virtio-blk: fdatasync failed: {e}");
                    (blk_status::IOERR, 0)
                }
            },
            RequestType::GetId => {
                let n = req.data_len.min(20) as usize;
                let mut cursor = 0usize;
                for s in &req.data {
                    if cursor >= n {
                        break;
                    }
                    let k = (s.len as usize).min(n - cursor);
                    if mem
                        .write_slice(&self.serial[cursor..cursor + k], s.addr)
                        .is_err()
                    {
                        return (blk_status::IOERR, cursor as u64);
                    }
                    cursor += k;
                }
                add(&st.other_ops, 1);
                (blk_status::OK, n as u64)
            }
            RequestType::Discard | RequestType::WriteZeroes => {
                let wz = req.kind == RequestType::WriteZeroes;
                let bit = if wz {
                    feature::WRITE_ZEROES
                } else {
                    feature::DISCARD
                };
                if self.acked & bit == 0 {
                    return (blk_status::UNSUPP, 0);
                }
                if self.disk.read_only() {
                    return (blk_status::IOERR, 0);
                }
                let status = self.ranges(mem, req, wz);
                if status == blk_status::OK {
                    add(&st.other_ops, 1);
                }
                (status, 0)
            }
            RequestType::Unsupported(_) => (blk_status::UNSUPP, 0),
        }
    }

    /// Discard / write-zeroes: validates every range first, then applies.
    fn ranges(&mut self, mem: &GuestMemoryMmap, req: &Request, wz: bool) -> u8 {
        let count = req.data_len / request::RANGE_LEN;
        if count == 0 || count > u64::from(MAX_DISCARD_SEG) {
            return blk_status::IOERR;
        }
        let mut raw = vec![0u8; req.data_len as usize];
        let mut at = 0;
        for s in &req.data {
            let k = s.len as usize;
            if mem.read_slice(&mut raw[at..at + k], s.addr).is_err() {
                return blk_status::IOERR;
            }
            at += k;
        }
        let mut ranges = Vec::with_capacity(count as usize);
        for r in raw.chunks_exact(request::RANGE_LEN as usize) {
            let sector = u64::from_le_bytes(r[0..8].try_into().unwrap());
            let num = u32::from_le_bytes(r[8..12].try_into().unwrap());
            let flags = u32::from_le_bytes(r[12..16].try_into().unwrap());
            let allowed = if wz { WZ_UNMAP } else { 0 };
            if flags & !allowed != 0 {
                return blk_status::UNSUPP;
            }
            if num > MAX_DISCARD_SECTORS {
                return blk_status::IOERR;
            }
            let len = u64::from(num) * SECTOR_SIZE;
            let Some(off) = self.range(sector, len) else {
                return blk_status::IOERR;
            };
            ranges.push((off, len, flags & WZ_UNMAP != 0));
        }
        for (off, len, unmap) in ranges {
            let r = if wz {
                self.disk.write_zeroes(off, len, unmap)
            } else {
                self.disk.discard(off, len)
            };
            if let Err(e) = r {
                tracing::debug!("virtio-blk: discard/write-zeroes failed: {e}");
                return blk_status::IOERR;
            }
        }
        blk_status::OK
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
        if let Some(a) = self.active.take()
            && a.waiting.is_some()
            && let Some(g) = self.gate.as_mut()
        {
            g.cancel();
            g.note_dequeued();
        }
        let _ = self.timer.disarm();
        self.timer.drain();
        let _ = self.queue_evts[0].read();
        self.engine.acked = 0;
    }
}

impl MutEventSubscriber for Block {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        match events.data() {
            TIMER_TOKEN => {
                self.timer.drain();
                self.process_queue();
            }
            0 => {
                // Drain the notification; if the gate holds a request,
                // process_queue returns at once (the timer resumes us).
                let _ = self.queue_evts[0].read();
                self.process_queue_polling();
            }
            other => tracing::warn!("virtio-blk: unexpected event token {other}"),
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::with_data(&self.queue_evts[0], 0, EventSet::IN)) {
            tracing::error!("virtio-blk: cannot watch the queue eventfd: {e:?}");
        }
        if let Err(e) = ops.add(Events::with_data(&self.timer, TIMER_TOKEN, EventSet::IN)) {
            tracing::error!("virtio-blk: cannot watch the throttle timer: {e:?}");
        }
    }
}

#[cfg(test)]
mod tests;
