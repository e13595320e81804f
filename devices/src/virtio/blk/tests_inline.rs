//! The io_uring engine's inline try of page-cache writes
//! (`DiskFile::write_inline`): a scripted `pwritev2` answers `EAGAIN`, a
//! short write, `EOPNOTSUPP` or an error, and the request must still land
//! exactly once, complete in the pass where it was written inline, and be
//! covered by a later FLUSH.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use vm_memory::{Bytes, GuestAddress};

use super::tests::{BUF, disk_file};
use super::*;
use crate::bus::lock;
use crate::virtio::testing::*;

const MIB: usize = 1 << 20;
const HDR: u64 = DATA_ADDR + 0x400;
const STATUS: u64 = DATA_ADDR + 0x800;

/// One scripted answer of the inline `pwritev2`.
#[derive(Clone, Copy, Debug)]
enum Answer {
    /// The real write, whole.
    Full,
    /// The first `n` bytes only, really written.
    Short(usize),
    /// -1 with this errno, nothing written.
    Errno(i32),
}

thread_local! {
    /// Answers still to give (empty: `Full`), and the calls seen.
    static SCRIPT: RefCell<(VecDeque<Answer>, Vec<libc::c_int>)> =
        const { RefCell::new((VecDeque::new(), Vec::new())) };
}

/// The scripted `pwritev2` (the harness drives the device on this thread).
///
/// # Safety
///
/// As `pwritev2(2)`.
unsafe fn scripted(
    fd: libc::c_int,
    iov: *const libc::iovec,
    cnt: libc::c_int,
    off: libc::off_t,
    flags: libc::c_int,
) -> isize {
    let a = SCRIPT.with(|s| {
        let mut s = s.borrow_mut();
        s.1.push(flags);
        s.0.pop_front().unwrap_or(Answer::Full)
    });
    match a {
        // SAFETY: the caller's iovecs, passed on.
        Answer::Full => unsafe { libc::pwritev(fd, iov, cnt, off) },
        Answer::Short(n) => {
            // SAFETY: the caller's `cnt` iovecs at `iov`.
            let v = unsafe { std::slice::from_raw_parts(iov, cnt as usize) };
            let mut left = n;
            let mut short = Vec::new();
            for x in v {
                if left == 0 {
                    break;
                }
                let k = left.min(x.iov_len);
                short.push(libc::iovec {
                    iov_base: x.iov_base,
                    iov_len: k,
                });
                left -= k;
            }
            // SAFETY: sub-ranges of the caller's iovecs.
            unsafe { libc::pwritev(fd, short.as_ptr(), short.len() as libc::c_int, off) }
        }
        Answer::Errno(e) => {
            // SAFETY: this thread's errno.
            unsafe { *libc::__errno_location() = e };
            -1
        }
    }
}

/// A page-cache disk on the io_uring engine whose inline write answers
/// `script` (then writes whole); the calls of an earlier test are cleared.
fn scripted_harness(script: &[Answer]) -> Option<(vmm_sys_util::tempfile::TempFile, Harness)> {
    if !uring::supported() {
        eprintln!("skipping: no io_uring here");
        return None;
    }
    SCRIPT.with(|s| *s.borrow_mut() = (script.iter().copied().collect(), Vec::new()));
    let (t, p) = disk_file(4 * MIB);
    let mut disk = DiskFile::open(&p, false, false).unwrap();
    disk.set_pwritev2(scripted);
    Some((t, Harness::with_engine(disk, 8 * MIB, 0, IoEngine::Uring)))
}

fn calls() -> Vec<libc::c_int> {
    SCRIPT.with(|s| s.borrow().1.clone())
}

/// Posts a write of `segs` (lengths; consecutive guest buffers from
/// `BUF + buf`) at `sector` as request `i`; returns its head.
fn post_write(h: &mut Harness, i: u64, sector: u64, buf: u64, segs: &[u32]) -> u16 {
    write_header(&h.mem, HDR + 16 * i, request::T_OUT, sector);
    h.mem.write_obj(0xffu8, GuestAddress(STATUS + i)).unwrap();
    let mut chain = vec![(HDR + 16 * i, 16, false)];
    let mut at = BUF + buf;
    for &l in segs {
        chain.push((at, l, false));
        at += u64::from(l);
    }
    chain.push((STATUS + i, 1, true));
    h.ring.submit(&chain)
}

fn post_flush(h: &mut Harness, i: u64) -> u16 {
    write_header(&h.mem, HDR + 16 * i, request::T_FLUSH, 0);
    h.mem.write_obj(0xffu8, GuestAddress(STATUS + i)).unwrap();
    h.ring
        .submit(&[(HDR + 16 * i, 16, false), (STATUS + i, 1, true)])
}

/// Distinct guest data: byte k of the buffer area is `k * 13 + 5`.
fn fill(h: &Harness, len: usize) -> Vec<u8> {
    let data: Vec<u8> = (0..len).map(|k| (k * 13 + 5) as u8).collect();
    h.mem.write_slice(&data, GuestAddress(BUF)).unwrap();
    data
}

fn file_at(t: &vmm_sys_util::tempfile::TempFile, off: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    std::os::unix::fs::FileExt::read_exact_at(t.as_file(), &mut v, off).unwrap();
    v
}

#[test]
fn a_write_that_does_not_block_completes_in_the_pass() {
    let Some((t, mut h)) = scripted_harness(&[]) else {
        return;
    };
    let data = fill(&h, 64 << 10);
    for i in 0..4 {
        post_write(&mut h, i, i * 32, i * 16384, &[16384]);
    }
    // One pass, no reaping: the writes are done and used already.
    lock(&h.block).process_queue();
    assert_eq!(h.ring.used_idx(), 4);
    assert_eq!(lock(&h.block).in_flight(), 0);
    assert_eq!(calls(), vec![libc::RWF_NOWAIT; 4]);
    for i in 0..4 {
        assert_eq!(read_u8(&h.mem, STATUS + i), blk_status::OK);
    }
    assert_eq!(file_at(&t, 0, 64 << 10), data);
    let st = lock(&h.block).stats();
    assert_eq!(st.write_ops.load(Ordering::Relaxed), 4);
    assert_eq!(st.write_bytes.load(Ordering::Relaxed), 64 << 10);
}

#[test]
fn a_write_that_would_block_goes_to_the_ring() {
    let Some((t, mut h)) = scripted_harness(&[Answer::Errno(libc::EAGAIN)]) else {
        return;
    };
    let data = fill(&h, 16384);
    post_write(&mut h, 0, 8, 0, &[4096, 12288]);
    h.process();
    // The script wrote nothing: the ring did.
    assert_eq!(calls().len(), 1);
    assert_eq!(h.ring.used_idx(), 1);
    assert_eq!(h.ring.used(0).1, 1);
    assert_eq!(read_u8(&h.mem, STATUS), blk_status::OK);
    assert_eq!(file_at(&t, 4096, 16384), data);
    let st = lock(&h.block).stats();
    assert_eq!(st.write_ops.load(Ordering::Relaxed), 1);
    assert_eq!(st.write_bytes.load(Ordering::Relaxed), 16384);
}

#[test]
fn a_short_inline_write_sends_only_its_rest_to_the_ring() {
    // Cut inside the second of three segments, and at a segment's end.
    for cut in [5000, 4096, 1] {
        let Some((t, mut h)) = scripted_harness(&[Answer::Short(cut)]) else {
            return;
        };
        // The file's bytes where the write goes differ from the data: a
        // rest written at the wrong offset or from the wrong buffer shows.
        let data = fill(&h, 16384);
        post_write(&mut h, 0, 16, 0, &[4096, 4096, 8192]);
        h.process();
        assert_eq!(calls().len(), 1, "cut {cut}");
        assert_eq!(read_u8(&h.mem, STATUS), blk_status::OK, "cut {cut}");
        assert_eq!(file_at(&t, 8192, 16384), data, "cut {cut}");
        // Counted once, whole.
        let st = lock(&h.block).stats();
        assert_eq!(st.write_ops.load(Ordering::Relaxed), 1);
        assert_eq!(st.write_bytes.load(Ordering::Relaxed), 16384);
        assert_eq!(st.io_errors.load(Ordering::Relaxed), 0);
    }
}

#[test]
fn a_file_system_without_nowait_writes_inline_and_is_asked_once() {
    let Some((t, mut h)) = scripted_harness(&[Answer::Errno(libc::EOPNOTSUPP)]) else {
        return;
    };
    let data = fill(&h, 48 << 10);
    for i in 0..3 {
        post_write(&mut h, i, i * 32, i * 16384, &[16384]);
    }
    lock(&h.block).process_queue();
    // Written by blocking pwritev on the device thread, in the pass.
    assert_eq!(h.ring.used_idx(), 3);
    assert_eq!(lock(&h.block).in_flight(), 0);
    assert_eq!(calls().len(), 1, "the refusal is remembered");
    assert_eq!(file_at(&t, 0, 48 << 10), data);
}

#[test]
fn an_inline_write_error_fails_only_its_request() {
    let Some((t, mut h)) = scripted_harness(&[Answer::Errno(libc::EIO)]) else {
        return;
    };
    let before = file_at(&t, 0, 8192);
    let data = fill(&h, 8192);
    post_write(&mut h, 0, 0, 0, &[4096]);
    post_write(&mut h, 1, 8, 4096, &[4096]);
    h.process();
    assert_eq!(h.ring.used_idx(), 2);
    assert_eq!(read_u8(&h.mem, STATUS), blk_status::IOERR);
    assert_eq!(read_u8(&h.mem, STATUS + 1), blk_status::OK);
    assert_eq!(file_at(&t, 0, 4096), before[..4096]);
    assert_eq!(file_at(&t, 4096, 4096), data[4096..]);
    let st = lock(&h.block).stats();
    assert_eq!(st.io_errors.load(Ordering::Relaxed), 1);
    assert_eq!(st.write_ops.load(Ordering::Relaxed), 1);
}

#[test]
fn a_flush_completes_after_inline_and_ring_writes_before_it() {
    // Write 0 would block (the ring takes it), 1 is short (its rest goes to
    // the ring), 2 and 3 are inline; then FLUSH, then a write after it.
    let script = [
        Answer::Errno(libc::EAGAIN),
        Answer::Short(100),
        Answer::Full,
        Answer::Full,
    ];
    let Some((t, mut h)) = scripted_harness(&script) else {
        return;
    };
    let data = fill(&h, 5 * 65536);
    for i in 0..4 {
        post_write(&mut h, i, i * 128, i * 65536, &[65536]);
    }
    let flush = post_flush(&mut h, 4);
    post_write(&mut h, 5, 4 * 128, 4 * 65536, &[65536]);
    lock(&h.block).process_queue();
    // The flush waits for both writes on the ring, so it is not used
    // before them (it may be used after the write posted after it).
    let order: Vec<u32> = (0..h.ring.used_idx()).map(|i| h.ring.used(i).0).collect();
    if let Some(at) = order.iter().position(|&hd| hd == u32::from(flush)) {
        assert!(at >= 4, "flush used before the writes before it: {order:?}");
    }
    h.process();
    assert_eq!(h.ring.used_idx(), 6);
    let order: Vec<u32> = (0..6).map(|i| h.ring.used(i).0).collect();
    let at = order.iter().position(|&hd| hd == u32::from(flush)).unwrap();
    let before: Vec<u32> = order[..at].to_vec();
    for i in 0..4u32 {
        // Heads: three descriptors per write.
        assert!(
            before.contains(&(3 * i)),
            "write {i} after the flush: {order:?}"
        );
    }
    for i in 0..6 {
        assert_eq!(read_u8(&h.mem, STATUS + i), blk_status::OK);
    }
    assert_eq!(file_at(&t, 0, 5 * 65536), data);
    let st = lock(&h.block).stats();
    assert_eq!(st.flush_ops.load(Ordering::Relaxed), 1);
    assert_eq!(st.write_bytes.load(Ordering::Relaxed), 5 * 65536);
}
