//! Test helpers: a minimal split-ring *driver* writing descriptor tables and
//! rings into a `GuestMemoryMmap`, and a harness that brings a virtio-blk
//! device up through its MMIO registers like Linux does. Used by the unit
//! tests, the micro-benchmark and the fuzz target (feature `test-utils`).

use std::sync::{Arc, Mutex};

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::blk::{Block, BlockOptions, DiskFile, IoEngine};
use super::{MmioTransport, VirtioDevice, status};
use crate::bus::{BusDevice, lock};

/// Descriptor flag: the chain continues at `next`.
pub const F_NEXT: u16 = 1;
/// Descriptor flag: device-writable.
pub const F_WRITE: u16 = 2;
/// Descriptor flag: the buffer is an indirect descriptor table.
pub const F_INDIRECT: u16 = 4;

/// Guest address of the descriptor table in [`Harness`] memory.
pub const DESC_ADDR: u64 = 0x1000;
/// Guest address of the available ring.
pub const AVAIL_ADDR: u64 = 0x3000;
/// Guest address of the used ring.
pub const USED_ADDR: u64 = 0x4000;
/// First guest address free for data buffers.
pub const DATA_ADDR: u64 = 0x10000;

/// The driver side of a split virtqueue in guest memory.
#[derive(Debug)]
pub struct TestRing {
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// Queue size.
    pub size: u16,
    next_desc: u16,
    avail_idx: u16,
}

impl TestRing {
    /// A ring of `size` entries at [`DESC_ADDR`], [`AVAIL_ADDR`], [`USED_ADDR`].
    pub fn new(mem: GuestMemoryMmap, size: u16) -> Self {
        Self {
            mem,
            size,
            next_desc: 0,
            avail_idx: 0,
        }
    }

    /// Writes descriptor `i` of the table at `table`.
    pub fn write_desc_at(&self, table: u64, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let base = GuestAddress(table + 16 * u64::from(i));
        let m = &self.mem;
        m.write_obj(addr.to_le(), base).unwrap();
        m.write_obj(len.to_le(), GuestAddress(base.0 + 8)).unwrap();
        m.write_obj(flags.to_le(), GuestAddress(base.0 + 12))
            .unwrap();
        m.write_obj(next.to_le(), GuestAddress(base.0 + 14))
            .unwrap();
    }

    /// Writes descriptor `i` of the queue's table.
    pub fn write_desc(&self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        self.write_desc_at(DESC_ADDR, i, addr, len, flags, next);
    }

    /// Writes a chain of `(addr, len, device_writable)` buffers into free
    /// descriptors and returns its head (not yet published).
    pub fn add_chain(&mut self, bufs: &[(u64, u32, bool)]) -> u16 {
        let n = bufs.len() as u16;
        let head = self.next_desc;
        for (k, &(addr, len, w)) in bufs.iter().enumerate() {
            let i = (head + k as u16) % self.size;
            let next = (i + 1) % self.size;
            let mut flags = if w { F_WRITE } else { 0 };
            if (k as u16) + 1 < n {
                flags |= F_NEXT;
            }
            self.write_desc(i, addr, len, flags, next);
        }
        self.next_desc = (head + n) % self.size;
        head
    }

    /// Makes `head` available and bumps the available index.
    pub fn publish(&mut self, head: u16) {
        let slot = u64::from(self.avail_idx % self.size);
        self.mem
            .write_obj(head.to_le(), GuestAddress(AVAIL_ADDR + 4 + 2 * slot))
            .unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.set_avail_idx(self.avail_idx);
    }

    /// Writes the available ring index directly (for hostile tests).
    pub fn set_avail_idx(&self, idx: u16) {
        self.mem
            .write_obj(idx.to_le(), GuestAddress(AVAIL_ADDR + 2))
            .unwrap();
    }

    /// Adds and publishes a chain; returns its head.
    pub fn submit(&mut self, bufs: &[(u64, u32, bool)]) -> u16 {
        let h = self.add_chain(bufs);
        self.publish(h);
        h
    }

    /// The used ring index.
    pub fn used_idx(&self) -> u16 {
        u16::from_le(self.mem.read_obj(GuestAddress(USED_ADDR + 2)).unwrap())
    }

    /// Used ring element `i`: (descriptor id, length).
    pub fn used(&self, i: u16) -> (u32, u32) {
        let base = USED_ADDR + 4 + 8 * u64::from(i % self.size);
        let id: u32 = self.mem.read_obj(GuestAddress(base)).unwrap();
        let len: u32 = self.mem.read_obj(GuestAddress(base + 4)).unwrap();
        (u32::from_le(id), u32::from_le(len))
    }
}

/// Writes a 16-byte virtio-blk request header at `addr`.
pub fn write_header(mem: &GuestMemoryMmap, addr: u64, kind: u32, sector: u64) {
    mem.write_obj(kind.to_le(), GuestAddress(addr)).unwrap();
    mem.write_obj(0u32, GuestAddress(addr + 4)).unwrap();
    mem.write_obj(sector.to_le(), GuestAddress(addr + 8))
        .unwrap();
}

/// Reads one byte of guest memory.
pub fn read_u8(mem: &GuestMemoryMmap, addr: u64) -> u8 {
    mem.read_obj(GuestAddress(addr)).unwrap()
}

/// A block device behind its MMIO transport, with a ring set up.
pub struct Harness {
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// The driver side of queue 0.
    pub ring: TestRing,
    /// The transport (as the vCPU threads see it).
    pub transport: MmioTransport,
    /// The device (as the device thread sees it).
    pub block: Arc<Mutex<Block>>,
    /// The irqfd the transport signals.
    pub irq: EventFd,
}

impl Harness {
    /// Guest memory of `mem_size` bytes at 0 and a device serving `disk`,
    /// brought up with every offered feature except those in `drop_features`.
    pub fn new(disk: DiskFile, mem_size: usize, drop_features: u64) -> Self {
        Self::with_engine(disk, mem_size, drop_features, IoEngine::auto())
    }

    /// [`Harness::new`] on the given I/O engine.
    pub fn with_engine(
        disk: DiskFile,
        mem_size: usize,
        drop_features: u64,
        engine: IoEngine,
    ) -> Self {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), mem_size)]).unwrap();
        let block = Arc::new(Mutex::new(
            Block::new(
                disk,
                BlockOptions {
                    serial: "corral-test-serial-xyz".into(),
                    engine: Some(engine),
                },
            )
            .unwrap(),
        ));
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let dev: Arc<Mutex<dyn VirtioDevice>> = block.clone();
        let transport = MmioTransport::new(mem.clone(), dev, irq.try_clone().unwrap()).unwrap();
        let mut h = Self {
            ring: TestRing::new(mem.clone(), 256),
            mem,
            transport,
            block,
            irq,
        };
        h.bring_up(drop_features, 256);
        h
    }

    /// 32-bit register read.
    pub fn r32(&mut self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.transport.read(off, &mut b);
        u32::from_le_bytes(b)
    }

    /// 32-bit register write.
    pub fn w32(&mut self, off: u64, v: u32) {
        self.transport.write(off, &v.to_le_bytes());
    }

    /// Resets the device and runs the Linux probe sequence (§3.1.1).
    pub fn bring_up(&mut self, drop_features: u64, qsize: u16) {
        self.w32(0x70, 0);
        self.w32(0x70, status::ACKNOWLEDGE);
        self.w32(0x70, status::ACKNOWLEDGE | status::DRIVER);
        self.w32(0x14, 0);
        let lo = self.r32(0x10);
        self.w32(0x14, 1);
        let hi = self.r32(0x10);
        let feats = ((u64::from(hi) << 32) | u64::from(lo)) & !drop_features;
        self.w32(0x24, 0);
        self.w32(0x20, feats as u32);
        self.w32(0x24, 1);
        self.w32(0x20, (feats >> 32) as u32);
        let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK;
        self.w32(0x70, s);
        assert_ne!(self.r32(0x70) & status::FEATURES_OK, 0, "features refused");
        self.w32(0x30, 0);
        self.w32(0x38, u32::from(qsize));
        self.w32(0x80, DESC_ADDR as u32);
        self.w32(0x84, 0);
        self.w32(0x90, AVAIL_ADDR as u32);
        self.w32(0x94, 0);
        self.w32(0xa0, USED_ADDR as u32);
        self.w32(0xa4, 0);
        self.w32(0x44, 1);
        assert_eq!(self.r32(0x44), 1, "queue refused");
        self.w32(0x70, s | status::DRIVER_OK);
        self.ring = TestRing::new(self.mem.clone(), qsize);
    }

    /// Runs the device's queue processing (what the device thread does on
    /// a notification), then waits for what the io_uring engine has in
    /// flight (what the device thread does on the ring's eventfd).
    pub fn process(&self) {
        let mut b = lock(&self.block);
        b.process_queue();
        b.wait_io();
    }
}

/// Fuzzing of virtio-blk request parsing and execution: the input becomes a
/// queue configuration, a descriptor table, an available ring, request
/// headers and data in guest memory, and a few MMIO writes. Shared by the
/// `cargo fuzz` target (`devices/fuzz`) and the stable smoke test.
pub mod fuzz {
    use std::cell::RefCell;

    use vm_memory::{Bytes, GuestAddress};

    use super::*;
    use crate::virtio::blk::request;
    use crate::virtio::features;

    /// Guest memory size of the fuzz harness.
    pub const MEM_SIZE: usize = 2 << 20;
    const TYPES: [u32; 8] = [
        request::T_IN,
        request::T_OUT,
        request::T_FLUSH,
        request::T_GET_ID,
        request::T_DISCARD,
        request::T_WRITE_ZEROES,
        2,
        0xdead_beef,
    ];

    /// Fuzz input read front to back; zeros once it runs out.
    pub(crate) struct Input<'a>(pub(crate) &'a [u8]);

    impl Input<'_> {
        pub(crate) fn is_empty(&self) -> bool {
            self.0.is_empty()
        }
        fn bytes<const N: usize>(&mut self) -> [u8; N] {
            let mut b = [0u8; N];
            let n = N.min(self.0.len());
            b[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            b
        }
        pub(crate) fn u8(&mut self) -> u8 {
            self.bytes::<1>()[0]
        }
        pub(crate) fn u16(&mut self) -> u16 {
            u16::from_le_bytes(self.bytes())
        }
        pub(crate) fn u32(&mut self) -> u32 {
            u32::from_le_bytes(self.bytes())
        }
        pub(crate) fn u64(&mut self) -> u64 {
            u64::from_le_bytes(self.bytes())
        }
    }

    pub(crate) struct State {
        pub(crate) _file: vmm_sys_util::tempfile::TempFile,
        pub(crate) h: Harness,
    }

    thread_local! {
        static STATE: RefCell<[Option<State>; 2]> = const { RefCell::new([None, None]) };
    }

    /// The engine an input runs on: both, by the parity of its length (so
    /// the fuzzer explores each, and a crash reproduces on its engine; the
    /// sync engine where io_uring is unavailable).
    pub(crate) fn engine_of(data: &[u8]) -> IoEngine {
        if data.len().is_multiple_of(2) && crate::virtio::blk::uring::supported() {
            IoEngine::Uring
        } else {
            IoEngine::Sync
        }
    }

    pub(crate) fn new_state(engine: IoEngine) -> State {
        // tmpfs when available: FLUSH (fdatasync) is then cheap.
        let dir = ["/dev/shm", "/tmp"]
            .iter()
            .map(std::path::Path::new)
            .find(|p| p.is_dir())
            .map(|p| p.to_path_buf())
            .unwrap_or_else(std::env::temp_dir);
        let file = vmm_sys_util::tempfile::TempFile::new_in(&dir).expect("temp disk");
        file.as_file().set_len(1 << 20).expect("size temp disk");
        let disk = DiskFile::open(file.as_path(), false, false).expect("open temp disk");
        State {
            h: Harness::with_engine(disk, MEM_SIZE, 0, engine),
            _file: file,
        }
    }

    /// Runs one fuzz input. Panics only on a bug.
    pub fn run(data: &[u8]) {
        STATE.with(|s| {
            let engine = engine_of(data);
            let mut s = s.borrow_mut();
            let st =
                s[usize::from(engine == IoEngine::Uring)].get_or_insert_with(|| new_state(engine));
            run_on(&mut st.h, data);
        });
    }

    fn run_on(h: &mut Harness, data: &[u8]) {
        let mut u = Input(data);
        let cfg = u.u8();
        let qsize = 1u16 << (cfg % 9);
        let drop = if cfg & 0x10 != 0 {
            features::RING_EVENT_IDX
        } else {
            0
        } | if cfg & 0x20 != 0 {
            features::RING_INDIRECT_DESC
        } else {
            0
        };
        // Fresh rings for every input.
        h.mem
            .write_slice(&[0u8; 0x2000], GuestAddress(AVAIL_ADDR))
            .unwrap();
        h.bring_up(drop, qsize);

        // Request headers at DATA_ADDR + i * 0x200 (mostly valid types).
        for i in 0..8u64 {
            let t = u.u8();
            let kind = if t & 0x80 != 0 {
                u.u32()
            } else {
                TYPES[usize::from(t) % TYPES.len()]
            };
            let sector = match u.u8() % 4 {
                0 => u64::from(u.u8()),
                1 => u64::from(u.u16()),
                2 => 2048 - u64::from(u.u8() % 8),
                _ => u.u64(),
            };
            write_header(&h.mem, DATA_ADDR + i * 0x200, kind, sector);
        }
        // The descriptor table.
        let ndesc = u16::from(u.u8() % 32) + 1;
        for i in 0..ndesc {
            let mode = u.u8();
            let addr = match mode >> 6 {
                0 => DATA_ADDR + u64::from(u.u8() % 8) * 0x200,
                1 => DATA_ADDR + 0x1000 + u64::from(u.u16()) * 8,
                2 => MEM_SIZE as u64 - u64::from(u.u16()),
                _ => u.u64(),
            };
            let len = match (mode >> 3) & 3 {
                0 => 16,
                1 => 1,
                2 => u32::from(u.u16()),
                _ => u.u32(),
            };
            let next = u16::from(u.u8()) % (qsize.saturating_mul(2).max(2));
            h.ring
                .write_desc(i % qsize, addr, len, u16::from(mode & 7), next);
        }
        // Indirect tables / discard ranges / anything: raw bytes.
        let nraw = usize::from(u.u8()) * 4;
        let raw: Vec<u8> = (0..nraw).map(|_| u.u8()).collect();
        h.mem
            .write_slice(&raw, GuestAddress(DATA_ADDR + 0x1000))
            .unwrap();
        // The available ring.
        let nheads = u16::from(u.u8() % 8) + 1;
        for j in 0..nheads {
            let head = u16::from(u.u8()) % (qsize + 2);
            let slot = u64::from(j % qsize);
            h.mem
                .write_obj(head, GuestAddress(AVAIL_ADDR + 4 + 2 * slot))
                .unwrap();
        }
        let idx = if u.u8() & 0xf0 == 0 { u.u16() } else { nheads };
        h.ring.set_avail_idx(idx);
        if u.u8() & 1 != 0 {
            // used_event
            let ue = AVAIL_ADDR + 4 + 2 * u64::from(qsize);
            h.mem.write_obj(u.u16(), GuestAddress(ue)).unwrap();
        }
        h.process();
        // At most the budget per pass. Not "at most the queue size": a read
        // whose data buffer is the available ring publishes more requests
        // mid-pass, as a driver may (the fuzzer found 257 on a 256 queue).
        let used = usize::from(h.ring.used_idx());
        let budget = crate::virtio::blk::BUDGET;
        assert!(used <= budget, "used {used} > budget {budget}");
        // A few MMIO accesses, then process again (reset, re-notify, ...).
        for _ in 0..(u.u8() % 4) {
            let off = u64::from(u.u16() % 0x140) & !3;
            let v = u.u32();
            h.w32(off, v);
            let _ = h.r32(off);
        }
        h.process();
    }

    /// A deterministic pseudo-random input generator (SplitMix64) for the
    /// stable smoke run.
    #[derive(Debug)]
    pub struct Gen(u64);

    impl Gen {
        /// Seeded generator.
        pub fn new(seed: u64) -> Self {
            Self(seed)
        }

        /// Next 64 random bits.
        pub fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        /// A random input of 0..=1024 bytes.
        pub fn input(&mut self, buf: &mut Vec<u8>) {
            let len = (self.next_u64() % 1025) as usize;
            buf.clear();
            while buf.len() < len {
                buf.extend_from_slice(&self.next_u64().to_le_bytes());
            }
            buf.truncate(len);
        }
    }

    /// Runs random inputs through [`run`] for `secs` seconds (at least
    /// `min_iters`); returns the number of inputs run.
    pub fn smoke(seed: u64, secs: f64, min_iters: u64) -> u64 {
        smoke_with(run, seed, secs, min_iters)
    }

    /// Runs random inputs through `target` for `secs` seconds (at least
    /// `min_iters`); returns the number of inputs run.
    pub fn smoke_with(target: fn(&[u8]), seed: u64, secs: f64, min_iters: u64) -> u64 {
        let mut g = Gen::new(seed);
        let mut buf = Vec::new();
        let start = std::time::Instant::now();
        let mut n = 0;
        while n < min_iters || start.elapsed().as_secs_f64() < secs {
            g.input(&mut buf);
            target(&buf);
            n += 1;
        }
        n
    }
}
