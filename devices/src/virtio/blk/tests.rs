//! Unit tests of virtio-blk and the virtio-mmio transport, driven through
//! the MMIO registers and a hand-built split ring in guest memory.

use std::io::{Read, Seek, SeekFrom, Write};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::tempfile::TempFile;

use super::*;
use crate::bus::BusDevice;
use crate::virtio::status;
use crate::virtio::testing::*;

const MIB: usize = 1 << 20;
pub(super) const HDR: u64 = DATA_ADDR;
pub(super) const STATUS: u64 = DATA_ADDR + 0x100;
pub(super) const BUF: u64 = DATA_ADDR + 0x1000;

/// A temp disk of `size` bytes filled with a pattern (byte i = i * 7).
pub(super) fn disk_file(size: usize) -> (TempFile, std::path::PathBuf) {
    let dir = std::env::var_os("CARGO_TARGET_TMPDIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let t = TempFile::new_in(&dir).unwrap();
    let data: Vec<u8> = (0..size).map(|i| (i * 7) as u8).collect();
    t.as_file().write_all(&data).unwrap();
    let p = t.as_path().to_path_buf();
    (t, p)
}

fn harness_ro(ro: bool, direct: bool) -> (TempFile, Harness) {
    let (t, p) = disk_file(MIB);
    let disk = DiskFile::open(&p, ro, direct).unwrap();
    (t, Harness::new(disk, 4 * MIB, 0))
}

pub(super) fn harness() -> (TempFile, Harness) {
    harness_ro(false, false)
}

/// A writable 1 MiB disk on `engine`.
pub(super) fn harness_on(engine: IoEngine) -> (TempFile, Harness) {
    let (t, p) = disk_file(MIB);
    let disk = DiskFile::open(&p, false, false).unwrap();
    (t, Harness::with_engine(disk, 4 * MIB, 0, engine))
}

/// The engines to test: sync, and io_uring where the kernel has it.
pub(super) fn engines() -> Vec<IoEngine> {
    let mut v = vec![IoEngine::Sync];
    if uring::supported() {
        v.push(IoEngine::Uring);
    } else {
        eprintln!("io_uring unavailable here: sync engine only");
    }
    v
}

pub(super) fn file_bytes(t: &TempFile, off: u64, len: usize) -> Vec<u8> {
    let mut f = t.as_file();
    f.seek(SeekFrom::Start(off)).unwrap();
    let mut v = vec![0; len];
    f.read_exact(&mut v).unwrap();
    v
}

impl Harness {
    /// Submits header + data + status, processes, returns (status, used len).
    pub(super) fn req(&mut self, kind: u32, sector: u64, data: &[(u64, u32, bool)]) -> (u8, u32) {
        write_header(&self.mem, HDR, kind, sector);
        self.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        let mut bufs = vec![(HDR, 16, false)];
        bufs.extend_from_slice(data);
        bufs.push((STATUS, 1, true));
        self.raw(&bufs)
    }

    /// Submits a raw chain, processes, returns (byte at STATUS, used len).
    fn raw(&mut self, bufs: &[(u64, u32, bool)]) -> (u8, u32) {
        let before = self.ring.used_idx();
        let head = self.ring.submit(bufs);
        self.process();
        assert_eq!(
            self.ring.used_idx(),
            before.wrapping_add(1),
            "not completed"
        );
        let (id, len) = self.ring.used(before);
        assert_eq!(id, u32::from(head));
        (read_u8(&self.mem, STATUS), len)
    }

    fn stats(&self) -> Arc<BlockStats> {
        lock(&self.block).stats()
    }
}

use crate::bus::lock;

const OK: u8 = blk_status::OK;
pub(super) const IOERR: u8 = blk_status::IOERR;
const UNSUPP: u8 = blk_status::UNSUPP;

#[test]
fn read_write_roundtrip_lands_in_file() {
    for engine in engines() {
        let (t, mut h) = harness_on(engine);
        // Read 2 sectors at sector 3 into two buffers.
        let (s, len) = h.req(
            request::T_IN,
            3,
            &[(BUF, 512, true), (BUF + 0x2000, 512, true)],
        );
        assert_eq!((s, len), (OK, 1025));
        let mut got = vec![0u8; 512];
        h.mem
            .read_slice(&mut got, GuestAddress(BUF + 0x2000))
            .unwrap();
        assert_eq!(got, file_bytes(&t, 4 * 512, 512));

        // Write 1 KiB of 0xab at sector 10 from a buffer split in three.
        h.mem.write_slice(&[0xab; 1024], GuestAddress(BUF)).unwrap();
        let (s, len) = h.req(
            request::T_OUT,
            10,
            &[
                (BUF, 100, false),
                (BUF + 100, 412, false),
                (BUF + 512, 512, false),
            ],
        );
        assert_eq!((s, len), (OK, 1));
        assert_eq!(file_bytes(&t, 10 * 512, 1024), vec![0xab; 1024]);
        let st = h.stats();
        assert_eq!(st.read_ops.load(Ordering::Relaxed), 1);
        assert_eq!(st.write_bytes.load(Ordering::Relaxed), 1024);
        // The guest was interrupted.
        assert!(h.irq.read().unwrap() >= 1);
        assert_eq!(h.r32(0x60) & 1, 1);
        h.w32(0x64, 1);
        assert_eq!(h.r32(0x60), 0);
    }
}

#[test]
fn flush_is_fdatasync_and_ok() {
    for engine in engines() {
        let (t, mut h) = harness_on(engine);
        h.mem.write_slice(&[5; 512], GuestAddress(BUF)).unwrap();
        assert_eq!(h.req(request::T_OUT, 0, &[(BUF, 512, false)]).0, OK);
        assert_eq!(h.req(request::T_FLUSH, 0, &[]), (OK, 1));
        assert_eq!(h.stats().flush_ops.load(Ordering::Relaxed), 1);
        // The write went to the file (not a VMM-side cache).
        assert_eq!(file_bytes(&t, 0, 512), vec![5; 512]);
        // Flush with a data buffer is malformed.
        assert_eq!(h.req(request::T_FLUSH, 0, &[(BUF, 512, false)]).0, IOERR);
    }
}

#[test]
fn get_id_returns_20_byte_serial() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        h.mem.write_slice(&[0xee; 32], GuestAddress(BUF)).unwrap();
        let (s, len) = h.req(request::T_GET_ID, 0, &[(BUF, 32, true)]);
        assert_eq!((s, len), (OK, 21));
        let mut got = [0u8; 32];
        h.mem.read_slice(&mut got, GuestAddress(BUF)).unwrap();
        assert_eq!(&got[..20], b"corral-test-serial-x");
        assert_eq!(got[20], 0xee, "wrote past 20 bytes");
        // A short buffer gets a truncated id.
        let (s, len) = h.req(request::T_GET_ID, 0, &[(BUF, 4, true)]);
        assert_eq!((s, len), (OK, 5));
    }
}

#[test]
fn unknown_type_is_unsupp() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        assert_eq!(h.req(0x1234, 0, &[]).0, UNSUPP);
        assert_eq!(h.req(2 /* SCSI */, 0, &[(BUF, 512, true)]).0, UNSUPP);
        assert_eq!(h.stats().unsupported.load(Ordering::Relaxed), 2);
    }
}

#[test]
fn looping_chain_is_bounded() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        write_header(&h.mem, HDR, request::T_IN, 0);
        // Header -> data -> data (itself) forever: virtio-queue stops after
        // queue-size descriptors; the length is then not sector-aligned.
        h.ring.write_desc(0, HDR, 16, F_NEXT, 1);
        h.ring.write_desc(1, STATUS, 513, F_NEXT | F_WRITE, 1);
        h.ring.publish(0);
        h.process();
        assert_eq!(h.ring.used_idx(), 1);
        assert_eq!(read_u8(&h.mem, STATUS + 512), IOERR);
        // A readable-only loop has no status byte: returned with length 0.
        h.ring.write_desc(2, HDR, 16, F_NEXT, 2);
        h.ring.publish(2);
        h.process();
        assert_eq!(h.ring.used_idx(), 2);
        assert_eq!(h.ring.used(1), (2, 0));
        assert_eq!(h.stats().no_status.load(Ordering::Relaxed), 1);
        // Next index past the table ends the chain.
        h.ring.write_desc(3, HDR, 16, F_NEXT, 999);
        h.ring.publish(3);
        h.process();
        assert_eq!(h.ring.used_idx(), 3);
        assert_eq!(h.ring.used(2), (3, 0));
    }
}

#[test]
fn overflowing_lengths_and_addresses() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        // Total chain length above 4 GiB (§2.7.5.2): the chain is invalid, and
        // its status byte is found all the same: IOERR with a used entry
        // (virtio-queue's iterator silently truncated such a chain, and the
        // request went without its status).
        write_header(&h.mem, HDR, request::T_IN, 0);
        let (s, len) = h.req(
            request::T_IN,
            0,
            &[(BUF, u32::MAX, true), (BUF, u32::MAX, true)],
        );
        assert_eq!((s, len), (IOERR, 1));
        // Address + length wraps around the 64-bit space.
        assert_eq!(
            h.req(request::T_IN, 0, &[(u64::MAX - 10, 512, true)]).0,
            IOERR
        );
        // Sector * 512 overflows.
        assert_eq!(h.req(request::T_IN, u64::MAX, &[(BUF, 512, true)]).0, IOERR);
        assert_eq!(
            h.req(request::T_OUT, u64::MAX / 512, &[(BUF, 512, false)])
                .0,
            IOERR
        );
    }
}

#[test]
fn addresses_outside_guest_memory() {
    for engine in engines() {
        let (t, mut h) = harness_on(engine);
        let outside = 4 * MIB as u64;
        assert_eq!(h.req(request::T_IN, 0, &[(outside, 512, true)]).0, IOERR);
        // Straddling the end of memory.
        assert_eq!(
            h.req(request::T_OUT, 0, &[(outside - 256, 512, false)]).0,
            IOERR
        );
        // Header outside memory.
        h.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        let (s, _) = h.raw(&[(outside, 16, false), (STATUS, 1, true)]);
        assert_eq!(s, IOERR);
        // Status outside memory: cannot be failed, returned with length 0.
        let before = h.ring.used_idx();
        h.ring.submit(&[(HDR, 16, false), (outside + 5, 1, true)]);
        h.process();
        assert_eq!(h.ring.used(before).1, 0);
        // Nothing reached the file.
        assert_eq!(file_bytes(&t, 0, 512), disk_file_pattern(0, 512));
        assert!(h.stats().malformed.load(Ordering::Relaxed) >= 3);
    }
}

pub(super) fn disk_file_pattern(off: usize, len: usize) -> Vec<u8> {
    (off..off + len).map(|i| (i * 7) as u8).collect()
}

#[test]
fn sector_past_the_end() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        let cap = lock(&h.block).capacity_sectors();
        assert_eq!(cap, 2048);
        assert_eq!(h.req(request::T_IN, cap - 1, &[(BUF, 512, true)]).0, OK);
        assert_eq!(h.req(request::T_IN, cap, &[(BUF, 512, true)]).0, IOERR);
        // Straddles the end.
        assert_eq!(h.req(request::T_IN, cap - 1, &[(BUF, 1024, true)]).0, IOERR);
        assert_eq!(
            h.req(request::T_OUT, cap - 1, &[(BUF, 1024, false)]).0,
            IOERR
        );
    }
}

#[test]
fn write_to_read_only_disk() {
    let (t, mut h) = harness_ro(true, false);
    // RO offered, DISCARD / WRITE_ZEROES not.
    h.w32(0x14, 0);
    let f = h.r32(0x10);
    assert_ne!(u64::from(f) & feature::RO, 0);
    assert_eq!(u64::from(f) & (feature::DISCARD | feature::WRITE_ZEROES), 0);
    h.mem.write_slice(&[1; 512], GuestAddress(BUF)).unwrap();
    assert_eq!(h.req(request::T_OUT, 0, &[(BUF, 512, false)]).0, IOERR);
    assert_eq!(file_bytes(&t, 0, 512), disk_file_pattern(0, 512));
    assert_eq!(h.req(request::T_IN, 0, &[(BUF, 512, true)]).0, OK);
    assert_eq!(h.req(request::T_FLUSH, 0, &[]).0, OK);
    // Discard and write-zeroes were not negotiated.
    write_range(&h, BUF, 0, 1, 0);
    assert_eq!(h.req(request::T_DISCARD, 0, &[(BUF, 16, false)]).0, UNSUPP);
}

#[test]
fn wrong_size_or_direction_of_status_and_data() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        // IN whose data descriptor is device-readable.
        assert_eq!(h.req(request::T_IN, 0, &[(BUF, 512, false)]).0, IOERR);
        // OUT whose data descriptor is device-writable.
        assert_eq!(h.req(request::T_OUT, 0, &[(BUF, 512, true)]).0, IOERR);
        // Data not a multiple of 512.
        assert_eq!(h.req(request::T_IN, 0, &[(BUF, 100, true)]).0, IOERR);
        // Status descriptor of 2 bytes on a flush: one extra writable byte.
        write_header(&h.mem, HDR, request::T_FLUSH, 0);
        let (_, len) = h.raw(&[(HDR, 16, false), (STATUS - 1, 2, true)]);
        assert_eq!(len, 1);
        assert_eq!(read_u8(&h.mem, STATUS), IOERR);
        // Status descriptor device-readable: there is no status -> length 0.
        write_header(&h.mem, HDR, request::T_FLUSH, 0);
        let (_, len) = h.raw(&[(HDR, 16, false), (STATUS, 1, false)]);
        assert_eq!(len, 0);
        // Readable after writable.
        write_header(&h.mem, HDR, request::T_IN, 0);
        h.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        let (s, _) = h.raw(&[
            (HDR, 16, false),
            (BUF, 512, true),
            (BUF + 512, 8, false),
            (STATUS, 1, true),
        ]);
        assert_eq!(s, IOERR);
        // Short header (8 bytes).
        let (s, _) = h.raw(&[(HDR, 8, false), (STATUS, 1, true)]);
        assert_eq!(s, IOERR);
        // Header split across descriptors is fine (any layout).
        write_header(&h.mem, HDR, request::T_IN, 1);
        let (s, len) = h.raw(&[
            (HDR, 5, false),
            (HDR + 5, 11, false),
            (BUF, 512, true),
            (STATUS, 1, true),
        ]);
        assert_eq!((s, len), (OK, 513));
        // Data and status in one descriptor (any layout).
        write_header(&h.mem, HDR, request::T_IN, 1);
        let before = h.ring.used_idx();
        h.ring.submit(&[(HDR, 16, false), (BUF, 513, true)]);
        h.process();
        assert_eq!(h.ring.used(before).1, 513);
        assert_eq!(read_u8(&h.mem, BUF + 512), OK);
    }
}

#[test]
fn indirect_descriptors() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        let table = DATA_ADDR + 0x8000;
        write_header(&h.mem, HDR, request::T_IN, 2);
        h.ring.write_desc_at(table, 0, HDR, 16, F_NEXT, 1);
        h.ring
            .write_desc_at(table, 1, BUF, 512, F_NEXT | F_WRITE, 2);
        h.ring.write_desc_at(table, 2, STATUS, 1, F_WRITE, 0);
        h.ring.write_desc(0, table, 48, F_INDIRECT, 0);
        h.ring.publish(0);
        h.process();
        assert_eq!(h.ring.used(0), (0, 513));
        assert_eq!(read_u8(&h.mem, STATUS), OK);
        // An indirect table of bad length (not a multiple of 16).
        h.ring.write_desc(1, table, 47, F_INDIRECT, 0);
        h.ring.publish(1);
        h.process();
        assert_eq!(h.ring.used(1), (1, 0));
    }
}

fn write_range(h: &Harness, at: u64, sector: u64, num: u32, flags: u32) {
    h.mem.write_obj(sector.to_le(), GuestAddress(at)).unwrap();
    h.mem.write_obj(num.to_le(), GuestAddress(at + 8)).unwrap();
    h.mem
        .write_obj(flags.to_le(), GuestAddress(at + 12))
        .unwrap();
}

#[test]
fn discard_and_write_zeroes() {
    for engine in engines() {
        let (t, mut h) = harness_on(engine);
        // Write zeroes on sectors 8..16 (with and without unmap).
        write_range(&h, BUF, 8, 8, 0);
        write_range(&h, BUF + 16, 100, 1, 1);
        assert_eq!(h.req(request::T_WRITE_ZEROES, 0, &[(BUF, 32, false)]).0, OK);
        assert_eq!(file_bytes(&t, 8 * 512, 4096), vec![0; 4096]);
        assert_eq!(file_bytes(&t, 100 * 512, 512), vec![0; 512]);
        assert_eq!(
            file_bytes(&t, 16 * 512, 512),
            disk_file_pattern(16 * 512, 512)
        );
        // Discard reads back as zeroes on file systems that punch holes; either
        // way it succeeds.
        write_range(&h, BUF, 200, 8, 0);
        assert_eq!(h.req(request::T_DISCARD, 0, &[(BUF, 16, false)]).0, OK);
        // Discard with the unmap flag (reserved) -> UNSUPP.
        write_range(&h, BUF, 200, 8, 1);
        assert_eq!(h.req(request::T_DISCARD, 0, &[(BUF, 16, false)]).0, UNSUPP);
        // Past the end, with wrapping sector, too many sectors.
        write_range(&h, BUF, 2047, 2, 0);
        assert_eq!(
            h.req(request::T_WRITE_ZEROES, 0, &[(BUF, 16, false)]).0,
            IOERR
        );
        write_range(&h, BUF, u64::MAX, 1, 0);
        assert_eq!(h.req(request::T_DISCARD, 0, &[(BUF, 16, false)]).0, IOERR);
        write_range(&h, BUF, 0, u32::MAX, 0);
        assert_eq!(h.req(request::T_DISCARD, 0, &[(BUF, 16, false)]).0, IOERR);
        // Payload not a multiple of 16, or empty, or too many ranges.
        assert_eq!(h.req(request::T_DISCARD, 0, &[(BUF, 15, false)]).0, IOERR);
        assert_eq!(h.req(request::T_DISCARD, 0, &[]).0, IOERR);
        assert_eq!(
            h.req(
                request::T_DISCARD,
                0,
                &[(BUF, 16 * (MAX_DISCARD_SEG + 1), false)]
            )
            .0,
            IOERR
        );
        // A failed multi-range request changes nothing: second range invalid.
        write_range(&h, BUF, 300, 1, 0);
        write_range(&h, BUF + 16, 5000, 1, 0);
        assert_eq!(
            h.req(request::T_WRITE_ZEROES, 0, &[(BUF, 32, false)]).0,
            IOERR
        );
        assert_eq!(
            file_bytes(&t, 300 * 512, 512),
            disk_file_pattern(300 * 512, 512)
        );
    }
}

#[test]
fn o_direct_aligned_and_bounced() {
    let (t, p) = disk_file(MIB);
    let disk = match DiskFile::open(&p, false, true) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping: O_DIRECT not supported here: {e}");
            return;
        }
    };
    let mut h = Harness::new(disk, 4 * MIB, 0);
    // Aligned: straight preadv.
    assert_eq!(h.req(request::T_IN, 8, &[(BUF, 4096, true)]).0, OK);
    let mut got = vec![0u8; 4096];
    h.mem.read_slice(&mut got, GuestAddress(BUF)).unwrap();
    assert_eq!(got, disk_file_pattern(4096, 4096));
    // Unaligned buffer and offset: bounced read.
    assert_eq!(
        h.req(
            request::T_IN,
            3,
            &[(BUF + 512, 1024, true), (BUF + 8192 + 7, 512, true)]
        )
        .0,
        OK
    );
    h.mem
        .read_slice(&mut got[..1024], GuestAddress(BUF + 512))
        .unwrap();
    assert_eq!(&got[..1024], &disk_file_pattern(3 * 512, 1024)[..]);
    h.mem
        .read_slice(&mut got[..512], GuestAddress(BUF + 8192 + 7))
        .unwrap();
    assert_eq!(&got[..512], &disk_file_pattern(5 * 512, 512)[..]);
    // Unaligned write: read-modify-write keeps the neighbours.
    h.mem
        .write_slice(&[0x5a; 512], GuestAddress(BUF + 3))
        .unwrap();
    assert_eq!(h.req(request::T_OUT, 9, &[(BUF + 3, 512, false)]).0, OK);
    assert_eq!(file_bytes(&t, 9 * 512, 512), vec![0x5a; 512]);
    assert_eq!(
        file_bytes(&t, 8 * 512, 512),
        disk_file_pattern(8 * 512, 512)
    );
    assert_eq!(
        file_bytes(&t, 10 * 512, 512),
        disk_file_pattern(10 * 512, 512)
    );
    // Aligned write.
    h.mem.write_slice(&[0x6b; 4096], GuestAddress(BUF)).unwrap();
    assert_eq!(h.req(request::T_OUT, 16, &[(BUF, 4096, false)]).0, OK);
    assert_eq!(file_bytes(&t, 16 * 512, 4096), vec![0x6b; 4096]);
    // Write zeroes through the fallback path keeps working too.
    write_range(&h, BUF, 1, 1, 0);
    assert_eq!(h.req(request::T_WRITE_ZEROES, 0, &[(BUF, 16, false)]).0, OK);
    assert_eq!(file_bytes(&t, 512, 512), vec![0; 512]);
}

#[test]
fn queue_size_and_address_validation() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        let stats = h.transport.stats();
        let setup = |h: &mut Harness, size: u32, desc: u64, avail: u64, used: u64| -> u32 {
            h.w32(0x70, 0);
            h.w32(0x70, status::ACKNOWLEDGE);
            h.w32(0x70, status::ACKNOWLEDGE | status::DRIVER);
            h.w32(0x24, 1);
            h.w32(0x20, 1); // VERSION_1
            h.w32(
                0x70,
                status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
            );
            h.w32(0x30, 0);
            h.w32(0x38, size);
            h.w32(0x80, desc as u32);
            h.w32(0x84, (desc >> 32) as u32);
            h.w32(0x90, avail as u32);
            h.w32(0x94, (avail >> 32) as u32);
            h.w32(0xa0, used as u32);
            h.w32(0xa4, (used >> 32) as u32);
            h.w32(0x44, 1);
            h.r32(0x44)
        };
        assert_eq!(h.r32(0x34), 256); // QueueNumMax
        assert_eq!(setup(&mut h, 100, DESC_ADDR, AVAIL_ADDR, USED_ADDR), 0);
        assert_eq!(setup(&mut h, 512, DESC_ADDR, AVAIL_ADDR, USED_ADDR), 0);
        assert_eq!(setup(&mut h, 0, DESC_ADDR, AVAIL_ADDR, USED_ADDR), 0);
        assert_eq!(setup(&mut h, 0x1_0000, DESC_ADDR, AVAIL_ADDR, USED_ADDR), 0);
        assert_eq!(setup(&mut h, 256, DESC_ADDR + 8, AVAIL_ADDR, USED_ADDR), 0);
        assert_eq!(setup(&mut h, 256, DESC_ADDR, AVAIL_ADDR + 1, USED_ADDR), 0);
        assert_eq!(setup(&mut h, 256, DESC_ADDR, AVAIL_ADDR, USED_ADDR + 2), 0);
        let end = 4 * MIB as u64;
        assert_eq!(setup(&mut h, 256, end - 16, AVAIL_ADDR, USED_ADDR), 0);
        assert_eq!(setup(&mut h, 256, DESC_ADDR, 1 << 40, USED_ADDR), 0);
        assert_eq!(setup(&mut h, 256, DESC_ADDR, AVAIL_ADDR, u64::MAX - 3), 0);
        assert_eq!(stats.invalid_queues.load(Ordering::Relaxed), 10);
        // DRIVER_OK with no ready queue: the device refuses, NEEDS_RESET shows.
        h.w32(
            0x70,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK,
        );
        assert_ne!(h.r32(0x70) & status::DEVICE_NEEDS_RESET, 0);
        assert_eq!(stats.failed_activations.load(Ordering::Relaxed), 1);
        // A valid size 16 queue works.
        assert_eq!(setup(&mut h, 16, DESC_ADDR, AVAIL_ADDR, USED_ADDR), 1);
        // Queue registers cannot change while the queue is enabled.
        h.w32(0x38, 32);
        assert_eq!(stats.bogus_writes.load(Ordering::Relaxed), 1);
        h.w32(
            0x70,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK,
        );
        assert_eq!(h.r32(0x70) & status::DEVICE_NEEDS_RESET, 0);
        h.ring = TestRing::new(h.mem.clone(), 16);
        assert_eq!(h.req(request::T_IN, 0, &[(BUF, 512, true)]).0, OK);
    }
}

#[test]
fn bogus_mmio_accesses_are_ignored_and_counted() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        let stats = h.transport.stats();
        assert_eq!(h.r32(0x000), 0x7472_6976);
        assert_eq!(h.r32(0x004), 2);
        assert_eq!(h.r32(0x008), 2);
        // Unknown register, unaligned, wrong width.
        assert_eq!(h.r32(0x0d0), 0);
        assert_eq!(h.r32(0x002), 0);
        let mut b = [0u8; 2];
        h.transport.read(0x70, &mut b);
        assert_eq!(b, [0, 0]);
        let mut b8 = [0u8; 8];
        h.transport.read(0x0, &mut b8);
        assert_eq!(stats.bogus_reads.load(Ordering::Relaxed), 4);
        // Writes to read-only / unknown registers, bad widths, out of range.
        h.w32(0x000, 1);
        h.w32(0x034, 1);
        h.w32(0x0d0, 1);
        h.w32(0x071, 1);
        h.transport.write(0x70, &[1]);
        h.transport.write(0x100, &[1, 2, 3]);
        h.transport.write(0x108, &[1, 2, 3, 4]); // config is read-only
        h.w32(0x50, 7); // notify of a nonexistent queue
        h.w32(0x38, 8); // queue config after DRIVER_OK
        h.w32(0x20, 0xffff_ffff); // features after FEATURES_OK
        h.w32(0x70, status::ACKNOWLEDGE); // clearing status bits
        h.w32(0x70, 0x4f | status::DEVICE_NEEDS_RESET);
        h.transport.write(0xfff, &[0; 8]);
        assert_eq!(stats.bogus_writes.load(Ordering::Relaxed), 13);
        // The device still works.
        assert_eq!(h.req(request::T_IN, 0, &[(BUF, 512, true)]).0, OK);
    }
}

#[test]
fn feature_negotiation() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        let stats = h.transport.stats();
        let try_feats = |h: &mut Harness, f: u64| -> bool {
            h.w32(0x70, 0);
            h.w32(0x70, status::ACKNOWLEDGE);
            h.w32(0x70, status::ACKNOWLEDGE | status::DRIVER);
            h.w32(0x24, 0);
            h.w32(0x20, f as u32);
            h.w32(0x24, 1);
            h.w32(0x20, (f >> 32) as u32);
            h.w32(0x24, 2);
            h.w32(0x20, 0);
            h.w32(
                0x70,
                status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
            );
            h.r32(0x70) & status::FEATURES_OK != 0
        };
        // Device features pages 0 and 1; page 2 is zero.
        h.w32(0x14, 1);
        assert_eq!(h.r32(0x10), 1);
        h.w32(0x14, 2);
        assert_eq!(h.r32(0x10), 0);
        assert!(try_feats(&mut h, features::VERSION_1 | feature::FLUSH));
        assert!(!try_feats(&mut h, feature::FLUSH), "VERSION_1 is required");
        assert!(
            !try_feats(&mut h, features::VERSION_1 | (1 << 12)),
            "MQ was not offered"
        );
        assert!(
            !try_feats(&mut h, features::VERSION_1 | (1 << 40)),
            "bit 40 was not offered"
        );
        assert_eq!(stats.refused_features.load(Ordering::Relaxed), 3);
        // Features can't be acked before DRIVER.
        h.w32(0x70, 0);
        h.w32(0x20, 1);
        assert!(stats.bogus_writes.load(Ordering::Relaxed) >= 1);
    }
}

#[test]
fn config_space_reads() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        let rd = |h: &mut Harness, off: u64, n: usize| -> u64 {
            let mut b = [0u8; 8];
            h.transport.read(0x100 + off, &mut b[..n]);
            u64::from_le_bytes(b)
        };
        assert_eq!(rd(&mut h, 0, 8), 2048); // capacity
        assert_eq!(rd(&mut h, 0, 4), 2048);
        assert_eq!(rd(&mut h, 1, 1), 8); // byte 1 of 2048
        assert_eq!(rd(&mut h, 1, 2), 8);
        assert_eq!(rd(&mut h, 12, 4), 254); // seg_max
        assert_eq!(rd(&mut h, 20, 4), 512); // blk_size
        assert_eq!(rd(&mut h, 20, 2), 512);
        assert_eq!(rd(&mut h, 36, 4), u64::from(MAX_DISCARD_SECTORS));
        assert_eq!(rd(&mut h, 56, 1), 1);
        // Partly and fully out of range.
        assert_eq!(rd(&mut h, 58, 4), 0);
        assert_eq!(rd(&mut h, 0x200, 4), 0);
        assert_eq!(rd(&mut h, 0xeff, 1), 0);
        assert_eq!(h.r32(0xfc), 0); // config generation
    }
}

#[test]
fn reset_and_reactivation() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        assert_eq!(h.req(request::T_IN, 0, &[(BUF, 512, true)]).0, OK);
        h.w32(0x60 + 4, 1);
        h.w32(0x70, 0);
        assert_eq!(h.r32(0x70), 0);
        assert_eq!(h.r32(0x44), 0);
        // Not active: notifications are ignored.
        h.ring = TestRing::new(h.mem.clone(), 256);
        h.mem.write_obj(0u16, GuestAddress(USED_ADDR + 2)).unwrap();
        h.ring.submit(&[(HDR, 16, false), (STATUS, 1, true)]);
        h.process();
        assert_eq!(h.ring.used_idx(), 0);
        // Bring up again (smaller queue, different features) and serve.
        h.mem
            .write_slice(&[0; 0x1000], GuestAddress(AVAIL_ADDR))
            .unwrap();
        h.mem
            .write_slice(&[0; 0x1000], GuestAddress(USED_ADDR))
            .unwrap();
        h.bring_up(features::RING_EVENT_IDX, 64);
        assert_eq!(h.req(request::T_IN, 1, &[(BUF, 512, true)]).0, OK);
        assert_eq!(h.req(request::T_FLUSH, 0, &[]).0, OK);
        assert_eq!(h.transport.stats().activations.load(Ordering::Relaxed), 2);
    }
}

#[test]
fn broken_ring_needs_reset_and_other_devices_continue() {
    let (_t1, mut h1) = harness();
    let (_t2, mut h2) = harness();
    // Available index far ahead of what the queue can hold.
    h1.ring.set_avail_idx(1000);
    h1.process();
    assert_ne!(h1.r32(0x70) & status::DEVICE_NEEDS_RESET, 0);
    assert_eq!(h1.r32(0x60) & 2, 2, "config interrupt");
    assert_eq!(h1.ring.used_idx(), 0);
    // Nothing more happens until reset.
    h1.process();
    assert_eq!(
        lock(&h1.block).stats().broken_rings.load(Ordering::Relaxed),
        1
    );
    // The other disk is unaffected.
    assert_eq!(h2.req(request::T_IN, 0, &[(BUF, 512, true)]).0, OK);
    // Reset heals the first.
    h1.mem
        .write_slice(&[0; 0x1000], GuestAddress(AVAIL_ADDR))
        .unwrap();
    h1.bring_up(0, 256);
    assert_eq!(h1.r32(0x70) & status::DEVICE_NEEDS_RESET, 0);
    assert_eq!(h1.req(request::T_IN, 0, &[(BUF, 512, true)]).0, OK);
}

#[test]
fn budget_yields_and_rekicks() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        let evt = lock(&h.block).queue_events()[0].try_clone().unwrap();
        let _ = evt.read();
        // Many bad requests (no status) are all returned; the device processes
        // at most BUDGET per call and re-signals itself.
        write_header(&h.mem, HDR, request::T_FLUSH, 0);
        for _ in 0..256 {
            h.ring.submit(&[(HDR, 16, false), (STATUS, 1, true)]);
        }
        h.process();
        assert_eq!(h.ring.used_idx(), 256);
    }
}

/// While the device polls the ring after a batch, `VRING_USED_F_NO_NOTIFY`
/// is set (a driver need not notify) and a request published meanwhile is
/// served without a notification; when the window ends idle, notifications
/// are on again.
#[test]
fn polling_serves_without_notifications_and_reenables_them() {
    // Without EVENT_IDX, as the probe drives it: the flag is the protocol.
    let (_t, p) = disk_file(MIB);
    let disk = DiskFile::open(&p, false, false).unwrap();
    let mut h = Harness::new(disk, 4 * MIB, crate::virtio::features::RING_EVENT_IDX);
    let used_flags = |m: &vm_memory::GuestMemoryMmap| -> u16 {
        m.read_obj::<u16>(GuestAddress(USED_ADDR)).unwrap()
    };
    write_header(&h.mem, HDR, request::T_FLUSH, 0);
    h.ring.submit(&[(HDR, 16, false), (STATUS, 1, true)]);
    // The second request is written now and published by another thread
    // while the device polls.
    let head2 = h.ring.add_chain(&[(HDR, 16, false), (STATUS + 8, 1, true)]);
    let mem = h.mem.clone();
    let driver = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(20));
        let flag_while_polling = used_flags(&mem);
        mem.write_obj(head2.to_le(), GuestAddress(AVAIL_ADDR + 4 + 2))
            .unwrap();
        mem.write_obj(2u16.to_le(), GuestAddress(AVAIL_ADDR + 2))
            .unwrap();
        flag_while_polling
    });
    let t0 = std::time::Instant::now();
    {
        let mut b = lock(&h.block);
        b.set_poll_ns(200_000_000);
        b.process_queue_polling();
    }
    let took = t0.elapsed();
    let flag_while_polling = driver.join().unwrap();
    assert_eq!(flag_while_polling & 1, 1, "NO_NOTIFY not set while polling");
    assert_eq!(
        h.ring.used_idx(),
        2,
        "request published while polling not served"
    );
    assert_eq!(used_flags(&h.mem) & 1, 0, "notifications not re-enabled");
    // Served within the window, then one idle window (200 ms) to return.
    assert!(took >= std::time::Duration::from_millis(200), "{took:?}");
}

#[test]
fn mmio_notify_signals_queue_eventfd() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        let evt = lock(&h.block).queue_events()[0].try_clone().unwrap();
        let _ = evt.read();
        h.w32(0x50, 0);
        assert_eq!(evt.read().unwrap(), 1);
        assert_eq!(h.transport.stats().mmio_notifies.load(Ordering::Relaxed), 1);
    }
}

#[test]
fn event_idx_suppresses_interrupts() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        let _ = h.irq.read();
        // used_event (after the avail ring) = 5: no interrupt until the 6th
        // used entry.
        let used_event = AVAIL_ADDR + 4 + 2 * 256;
        h.mem.write_obj(5u16, GuestAddress(used_event)).unwrap();
        for _ in 0..5 {
            assert_eq!(h.req(request::T_FLUSH, 0, &[]).0, OK);
        }
        assert!(h.irq.read().is_err(), "interrupted too early");
        assert_eq!(h.req(request::T_FLUSH, 0, &[]).0, OK);
        assert_eq!(h.irq.read().unwrap(), 1);
        // avail_event was published so the driver knows where to notify.
        let avail_event = USED_ADDR + 4 + 8 * 256;
        let v: u16 = h.mem.read_obj(GuestAddress(avail_event)).unwrap();
        assert_eq!(v, 6);
    }
}

/// A throttle that refuses the first `refuse` polls, then admits; logs polls.
struct FakeThrottle {
    refuse: usize,
    polls: Arc<Mutex<Vec<throttle::ThrottleRequest>>>,
    cancelled: Arc<Mutex<usize>>,
}

impl RequestThrottle for FakeThrottle {
    fn poll(&mut self, req: throttle::ThrottleRequest, now: throttle::Nanos) -> throttle::Decision {
        self.polls.lock().unwrap().push(req);
        if self.refuse > 0 {
            self.refuse -= 1;
            throttle::Decision::Wait {
                until: now + 1_000_000,
                cause: corral_blkthrottle::WaitCause::Disk,
            }
        } else {
            throttle::Decision::Admit
        }
    }
    fn cancel(&mut self) {
        *self.cancelled.lock().unwrap() += 1;
    }
    fn set_limits(
        &mut self,
        _: &throttle::Limits,
        _: throttle::Nanos,
    ) -> Result<(), throttle::LimitsError> {
        Ok(())
    }
    fn set_group(
        &mut self,
        _: Option<(&throttle::ThrottleGroup, u32)>,
    ) -> Result<(), throttle::LimitsError> {
        Ok(())
    }
    fn set_weight(&mut self, _: u32) -> Result<(), throttle::LimitsError> {
        Ok(())
    }
    fn limits(&self) -> throttle::Limits {
        throttle::Limits::default()
    }
    fn group_name(&self) -> Option<String> {
        None
    }
    fn group_weight(&self) -> Option<u32> {
        None
    }
}

#[test]
fn throttle_holds_requests_in_order_and_arms_timer() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        let polls = Arc::new(Mutex::new(Vec::new()));
        let cancelled = Arc::new(Mutex::new(0));
        lock(&h.block).set_throttle(Some(Box::new(FakeThrottle {
            refuse: 2,
            polls: polls.clone(),
            cancelled: cancelled.clone(),
        })));
        write_header(&h.mem, HDR, request::T_IN, 0);
        write_header(&h.mem, HDR + 32, request::T_OUT, 0);
        h.ring
            .submit(&[(HDR, 16, false), (BUF, 4096, true), (STATUS, 1, true)]);
        h.ring.submit(&[
            (HDR + 32, 16, false),
            (BUF, 512, false),
            (STATUS + 1, 1, true),
        ]);
        h.process();
        assert_eq!(h.ring.used_idx(), 0, "held by the throttle");
        // A notification while waiting does not bypass the throttle.
        h.process();
        assert_eq!(h.ring.used_idx(), 0);
        // The timer was armed (1 ms ahead): wait for it and "fire".
        let fd = lock(&h.block).timer().as_raw_fd();
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polling one valid fd we own, with a timeout.
        let n = unsafe { libc::poll(&mut pfd, 1, 1000) };
        assert_eq!(n, 1, "timer did not fire");
        {
            let mut b = lock(&h.block);
            b.timer().drain();
            b.process_queue();
            b.wait_io();
        }
        // Both completed (admitted in order, see the polls; io_uring may
        // complete them in either order).
        assert_eq!(h.ring.used_idx(), 2);
        let mut heads = [h.ring.used(0).0, h.ring.used(1).0];
        if engine == IoEngine::Sync {
            assert_eq!(heads, [0, 3], "the sync engine completes in order");
        }
        heads.sort();
        assert_eq!(heads, [0, 3]);
        let p = polls.lock().unwrap();
        assert_eq!(p.len(), 4);
        assert_eq!(p[0], throttle::ThrottleRequest::read(4096));
        assert_eq!(p[3], throttle::ThrottleRequest::write(512));
        assert_eq!(h.stats().throttled.load(Ordering::Relaxed), 1);
        drop(p);
        // A reset while a request waits cancels it at the throttle.
        lock(&h.block).set_throttle(Some(Box::new(FakeThrottle {
            refuse: 1,
            polls: polls.clone(),
            cancelled: cancelled.clone(),
        })));
        h.ring
            .submit(&[(HDR, 16, false), (BUF, 4096, true), (STATUS, 1, true)]);
        h.process();
        assert_eq!(h.ring.used_idx(), 2);
        h.w32(0x70, 0);
        assert_eq!(*cancelled.lock().unwrap(), 1);
    }
}

use std::os::fd::AsRawFd;

#[test]
fn subscriber_serves_notifications_on_the_event_loop() {
    use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
    let (_t, mut h) = harness();
    let mut em = EventManager::<Arc<Mutex<dyn MutEventSubscriber + Send>>>::new().unwrap();
    em.add_subscriber(h.block.clone());
    write_header(&h.mem, HDR, request::T_IN, 0);
    h.ring
        .submit(&[(HDR, 16, false), (BUF, 512, true), (STATUS, 1, true)]);
    // The guest notifies (the VMM's ioeventfd would do the same write).
    h.w32(0x50, 0);
    em.run_with_timeout(1000).unwrap();
    assert_eq!(h.ring.used_idx(), 1);
    assert_eq!(read_u8(&h.mem, STATUS), OK);
}

/// Micro-benchmark: reads and writes through the device code (parsing,
/// `preadv`/`pwritev` into guest memory, used ring) from a file in the page
/// cache, at queue depth 4, against a bare `pread`/`pwrite` loop of the same
/// sizes (the kernel's copy alone). The difference is the device's cost.
/// `cargo test -p corral-devices --release -- --ignored bench_read_32m --nocapture`
/// Reads (or writes) `nreq` consecutive requests of `req` bytes through the
/// device at queue depth 4, like the guest benchmark: four chains, then one
/// processing pass, and again.
fn qd4_job(h: &mut Harness, read: bool, nreq: usize, req: u32) {
    let kind = if read { request::T_IN } else { request::T_OUT };
    let mut done = 0;
    while done < nreq {
        for k in 0..4 {
            let i = done + k;
            let hdr = HDR + 32 * k as u64;
            write_header(&h.mem, hdr, kind, (i as u64 * u64::from(req)) / 512);
            let buf = 8 * MIB as u64 + k as u64 * u64::from(req);
            h.ring.submit(&[
                (hdr, 16, false),
                (buf, req, read),
                (STATUS + k as u64, 1, true),
            ]);
        }
        h.process();
        done += 4;
    }
}

/// The CPU cost of a throttle whose limits are never hit, per request, on
/// the device path alone (no VM, so no guest noise): 4 KiB and 128 KiB
/// reads at queue depth 4 through the device, without a throttle and with a
/// `Throttle` 100x above need, in interleaved rounds; best of each.
/// `cargo test -p corral-devices --release -- --ignored bench_throttle_cost --nocapture`
#[test]
#[ignore]
fn bench_throttle_cost() {
    const DISK: usize = 32 * MIB;
    let (t, p) = disk_file(DISK);
    let _ = file_bytes(&t, 0, DISK);
    let limits = corral_blkthrottle::Limits::parse("bps=400G,iops=10000000").unwrap();
    for (name, total, req) in [
        ("read 8 MiB / 4 KiB", 8 * MIB, 4096u32),
        ("read 32 MiB / 128 KiB", DISK, 128 * 1024),
    ] {
        let nreq = total / req as usize;
        let mut best = [f64::MAX; 2];
        for round in 0..30 {
            for which in [round % 2, 1 - round % 2] {
                let disk = DiskFile::open(&p, true, false).unwrap();
                let mut h = Harness::new(disk, 64 * MIB, 0);
                if which == 1 {
                    let now = throttle::monotonic_ns();
                    let th = corral_blkthrottle::Throttle::new(&limits, now).unwrap();
                    lock(&h.block).set_throttle(Some(Box::new(th)));
                }
                let start = std::time::Instant::now();
                qd4_job(&mut h, true, nreq, req);
                assert_eq!(h.ring.used_idx(), nreq as u16);
                best[which] = best[which].min(start.elapsed().as_secs_f64());
            }
        }
        let per = |x: f64| x / nreq as f64 * 1e6;
        println!(
            "{name}: no limit {:.3} us/req, limit 100x above need {:.3} us/req: throttle +{:.3} us/req ({:+.2} %)",
            per(best[0]),
            per(best[1]),
            per(best[1]) - per(best[0]),
            (best[1] / best[0] - 1.0) * 100.0
        );
    }
}

#[test]
#[ignore]
fn bench_read_32m() {
    use std::os::unix::fs::FileExt;
    const DISK: usize = 32 * MIB;
    let (t, p) = disk_file(DISK);
    let _ = file_bytes(&t, 0, DISK); // warm the page cache
    let cases: [(&str, bool, usize, u32); 4] = [
        ("read 32 MiB / 128 KiB", true, DISK, 128 * 1024),
        ("write 32 MiB / 128 KiB", false, DISK, 128 * 1024),
        ("read 8 MiB / 4 KiB", true, 8 * MIB, 4096),
        ("write 8 MiB / 4 KiB", false, 8 * MIB, 4096),
    ];
    for (name, read, total, req) in cases {
        let disk = DiskFile::open(&p, false, false).unwrap();
        let mut h = Harness::new(disk, 64 * MIB, 0);
        let nreq = total / req as usize;
        let mut best = f64::MAX;
        for _ in 0..5 {
            let start = std::time::Instant::now();
            qd4_job(&mut h, read, nreq, req);
            best = best.min(start.elapsed().as_secs_f64());
        }
        assert_eq!(h.ring.used_idx(), (5 * nreq) as u16);
        // Baseline: the bare system calls.
        let mut buf = vec![0u8; req as usize];
        let mut base = f64::MAX;
        for _ in 0..5 {
            let start = std::time::Instant::now();
            for i in 0..nreq {
                let off = (i * req as usize) as u64;
                if read {
                    t.as_file().read_exact_at(&mut buf, off).unwrap();
                } else {
                    t.as_file().write_all_at(&buf, off).unwrap();
                }
            }
            base = base.min(start.elapsed().as_secs_f64());
        }
        println!(
            "{name}: device {:.2} ms ({:.2} us/req, {:.2} GB/s); bare syscalls {:.2} ms ({:.2} us/req); device overhead {:.2} us/req",
            best * 1e3,
            best / nreq as f64 * 1e6,
            total as f64 / best / 1e9,
            base * 1e3,
            base / nreq as f64 * 1e6,
            (best - base) / nreq as f64 * 1e6,
        );
    }
}

/// The fuzz target's logic on stable: random inputs for a bounded time
/// (`CORRAL_FUZZ_SECS`, default 2 s; CI uses 30).
#[test]
fn fuzz_smoke_stable() {
    let secs: f64 = std::env::var("CORRAL_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
    let seed = std::env::var("CORRAL_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed);
    // The time is shared by the three targets of devices/fuzz.
    use crate::virtio::{fuzz_targets, testing::fuzz};
    let each = secs / 3.0;
    for (name, target) in [
        ("blk_request", fuzz::run as fn(&[u8])),
        ("mmio_transport", fuzz_targets::mmio),
        ("blk_device", fuzz_targets::device),
    ] {
        let t0 = std::time::Instant::now();
        let n = fuzz::smoke_with(target, seed, each, 200);
        let s = t0.elapsed().as_secs_f64();
        eprintln!(
            "fuzz_smoke_stable: {name}: {n} inputs in {s:.1} s ({:.0}/s, seed {seed:#x})",
            n as f64 / s
        );
    }
}
