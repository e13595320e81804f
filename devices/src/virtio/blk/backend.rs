//! File-backed raw disk: the I/O backend of virtio-blk.
//!
//! # Two engines over one file type
//!
//! The synchronous engine makes each request one `preadv`/`pwritev` whose
//! iovecs point straight into guest memory (host addresses obtained from
//! vm-memory, each segment checked to lie inside a guest memory region): no
//! copy in the VMM, one system call per request whatever its number of
//! segments. The io_uring engine (`uring.rs`) takes the same iovecs from
//! [`DiskFile::uring_iov`] and submits them instead, many at a time; what it
//! does not take (bounced requests, discard, write-zeroes) runs here.
//!
//! For a raw image in the host page cache a read or write is a `memcpy`
//! inside the kernel (~10 µs per 128 KiB here), which io_uring performs too
//! (inline in `io_uring_enter` or on an io-wq worker), so the engines are
//! close there; io_uring wins where the device's latency can be overlapped:
//! `direct` (O_DIRECT) disks at queue depth > 1, where the synchronous
//! `preadv` serialises the queue (BENCHMARKS.md, `blkbench --engines`).
//!
//! # O_DIRECT
//!
//! With `direct`, the file is opened `O_DIRECT`. A request whose file
//! offset, guest buffer addresses and lengths are all multiples of
//! [`DIRECT_ALIGN`] goes straight to the disk; any other request is bounced
//! through an aligned buffer (read-modify-write for a partial block on
//! writes). The capacity of a direct disk is rounded down to
//! [`DIRECT_ALIGN`] so an aligned access never passes the end of the file.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::ptr::NonNull;

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use super::request::Segment;

/// Sector size of the virtio-blk protocol.
pub const SECTOR_SIZE: u64 = 512;
/// Alignment of file offsets, buffer addresses and lengths for `O_DIRECT`
/// (a page: satisfies disks with 512-byte and 4 KiB logical blocks).
pub const DIRECT_ALIGN: usize = 4096;
/// Bounce buffer chunk.
const BOUNCE_CHUNK: usize = 1 << 20;
/// Iovecs per system call (Linux `UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

/// Errors opening a disk.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// Opening the backing file failed.
    #[error("cannot open disk {path}: {source}")]
    Open {
        /// Path of the file.
        path: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Finding the size failed.
    #[error("cannot size disk {path}: {source}")]
    Size {
        /// Path of the file.
        path: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
}

/// An owned, zeroed, `DIRECT_ALIGN`-aligned byte buffer.
struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf uniquely owns its heap allocation (like a Box<[u8]>).
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    fn new(len: usize) -> Self {
        let layout = Layout::from_size_align(len, DIRECT_ALIGN).expect("valid bounce layout");
        // SAFETY: `len` is a non-zero constant chunk size (BOUNCE_CHUNK), so
        // the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, len }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is a live allocation of `len` initialized (zeroed)
        // bytes owned by self; the &mut self borrow makes it exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, DIRECT_ALIGN).expect("valid bounce layout");
        // SAFETY: allocated in `new` with this very layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// Where the bytes of a bounced write come from.
enum Source<'a> {
    Guest(&'a GuestMemoryMmap, &'a [Segment]),
    Zeros,
}

/// A raw disk image (regular file or block device).
pub struct DiskFile {
    file: File,
    capacity: u64,
    read_only: bool,
    direct: bool,
    bounce: Option<AlignedBuf>,
    iov: Vec<libc::iovec>,
    /// The file system refused a non-blocking buffered write
    /// (`RWF_NOWAIT`: `EOPNOTSUPP`, e.g. ext4): inline writes block.
    nowait_unsupported: bool,
    /// The system call of [`DiskFile::write_inline`]'s non-blocking try
    /// (`pwritev2`; a test scripts `EAGAIN` and short writes through it).
    pwritev2: Pwritev2,
}

/// `pwritev2(fd, iov, iovcnt, offset, flags)`: bytes written, or -1 and
/// `errno`.
///
/// # Safety
///
/// As `pwritev2(2)`: `iovcnt` valid iovecs at `iov` over mapped memory.
pub(super) type Pwritev2 =
    unsafe fn(libc::c_int, *const libc::iovec, libc::c_int, libc::off_t, libc::c_int) -> isize;

/// The real `pwritev2`.
///
/// # Safety
///
/// As [`Pwritev2`].
unsafe fn sys_pwritev2(
    fd: libc::c_int,
    iov: *const libc::iovec,
    cnt: libc::c_int,
    off: libc::off_t,
    flags: libc::c_int,
) -> isize {
    // SAFETY: the caller's guarantee (valid iovecs over mapped memory).
    unsafe { libc::pwritev2(fd, iov, cnt, off, flags) }
}

/// What [`DiskFile::write_inline`] did.
#[derive(Debug)]
pub(super) enum Inline {
    /// The whole write is in the page cache.
    Done,
    /// The first `n` bytes (maybe 0) were written and the rest would block:
    /// `iov` now describes the rest, to be submitted to the ring at
    /// `offset + n`.
    Rest(u64),
    /// The write failed (the request's status is IOERR).
    Failed(io::Error),
}

// SAFETY: the only non-Send field is `iov`, a scratch vector that is empty
// between calls (cleared before each method returns); the raw pointers it
// briefly holds point into guest memory, which is shared with every thread.
unsafe impl Send for DiskFile {}

impl std::fmt::Debug for DiskFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskFile")
            .field("capacity", &self.capacity)
            .field("read_only", &self.read_only)
            .field("direct", &self.direct)
            .finish_non_exhaustive()
    }
}

fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

impl DiskFile {
    /// Opens `path` read-write (or read-only), optionally with `O_DIRECT`:
    /// a regular file or block device only, opened `O_NONBLOCK` so that a
    /// FIFO is refused at once instead of waiting for a writer. (The VMM
    /// opens disks itself, under its host-path policy, and uses
    /// [`DiskFile::from_file`].)
    pub fn open(path: &Path, read_only: bool, direct: bool) -> Result<Self, DiskError> {
        let mut oo = OpenOptions::new();
        oo.read(true).write(!read_only);
        let mut flags = libc::O_NONBLOCK | libc::O_NOCTTY;
        if direct {
            flags |= libc::O_DIRECT;
        }
        oo.custom_flags(flags);
        let open_err = |source| DiskError::Open {
            path: path.display().to_string(),
            source,
        };
        let file = oo.open(path).map_err(open_err)?;
        let ft = file.metadata().map_err(open_err)?.file_type();
        if !(ft.is_file() || std::os::unix::fs::FileTypeExt::is_block_device(&ft)) {
            return Err(open_err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file or block device",
            )));
        }
        // SAFETY: F_SETFL on an fd we own; only the status flags change.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
            return Err(open_err(io::Error::last_os_error()));
        }
        Self::from_file(file, read_only, direct).map_err(|source| DiskError::Size {
            path: path.display().to_string(),
            source,
        })
    }

    /// Wraps an open file (opened with `O_DIRECT` if `direct`).
    pub fn from_file(mut file: File, read_only: bool, direct: bool) -> io::Result<Self> {
        // SEEK_END also sizes block devices, whose metadata length is 0.
        let size = file.seek(SeekFrom::End(0))?;
        let unit = if direct {
            DIRECT_ALIGN as u64
        } else {
            SECTOR_SIZE
        };
        Ok(Self {
            file,
            capacity: size / unit * unit,
            read_only,
            direct,
            bounce: None,
            iov: Vec::new(),
            nowait_unsupported: false,
            pwritev2: sys_pwritev2,
        })
    }

    /// Usable size in bytes (a multiple of [`SECTOR_SIZE`]).
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Whether writes are refused.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// Whether the file is open with `O_DIRECT`.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Translates `segs` to host iovecs in `self.iov`; fails with `EFAULT` if
    /// any byte is outside guest memory. Returns whether all iovecs meet the
    /// `O_DIRECT` alignment.
    fn build_iov(&mut self, mem: &GuestMemoryMmap, segs: &[Segment]) -> io::Result<bool> {
        self.iov.clear();
        let mut aligned = true;
        for s in segs {
            for slice in GuestMemoryBackend::get_slices(mem, s.addr, s.len as usize) {
                let slice = slice.map_err(|_| {
                    self.iov.clear();
                    errno(libc::EFAULT)
                })?;
                let base = slice.ptr_guard_mut().as_ptr();
                aligned &= (base as usize).is_multiple_of(DIRECT_ALIGN)
                    && slice.len().is_multiple_of(DIRECT_ALIGN);
                self.iov.push(libc::iovec {
                    iov_base: base.cast(),
                    iov_len: slice.len(),
                });
            }
        }
        Ok(aligned)
    }

    /// `preadv`/`pwritev` of all of `self.iov` at `offset`, resuming after
    /// short transfers and `EINTR`. Clears `self.iov`.
    fn transfer_iov(&mut self, offset: u64, write: bool) -> io::Result<()> {
        let mut iov = std::mem::take(&mut self.iov);
        // SAFETY: every iovec was built by `build_iov` from a vm-memory
        // VolatileSlice inside a guest memory region, and `mem` (borrowed by
        // our caller) keeps the mapping alive during the call.
        let res = unsafe { transfer(self.file.as_raw_fd(), &mut iov, offset, write) };
        iov.clear();
        self.iov = iov;
        res
    }

    /// For the io_uring engine: the host iovecs of a read (or write) of
    /// `segs` at `offset` that can go to the file as they are — in range,
    /// writable if a write, within `IOV_MAX`, and aligned on a direct disk —
    /// or `None` (the request takes the synchronous path, which reports the
    /// error or bounces it). Every iovec lies inside a region of `mem`.
    pub(super) fn uring_iov(
        &mut self,
        mem: &GuestMemoryMmap,
        segs: &[Segment],
        offset: u64,
        write: bool,
    ) -> Option<Vec<libc::iovec>> {
        if write && self.read_only {
            return None;
        }
        self.check_range(offset, total_len(segs)).ok()?;
        let aligned = self.build_iov(mem, segs).ok()?;
        let ok = (!self.direct || (aligned && offset.is_multiple_of(DIRECT_ALIGN as u64)))
            && !self.iov.is_empty()
            && self.iov.len() <= IOV_MAX;
        if !ok {
            self.iov.clear();
            return None;
        }
        Some(std::mem::take(&mut self.iov))
    }

    /// Finishes a transfer of `iov` at `offset` of which the first `done`
    /// bytes completed (a short io_uring completion), synchronously.
    ///
    /// # Safety
    ///
    /// Every iovec must point into guest memory that stays mapped during the
    /// call (as [`DiskFile::uring_iov`] returns them, with the memory kept
    /// alive by the caller).
    pub(super) unsafe fn finish_short(
        &self,
        iov: &mut [libc::iovec],
        done: usize,
        offset: u64,
        write: bool,
    ) -> io::Result<()> {
        let mut start = 0;
        advance(iov, &mut start, done);
        // SAFETY: the caller's guarantee; `advance` keeps each iovec inside
        // its original range.
        unsafe {
            transfer(
                self.file.as_raw_fd(),
                &mut iov[start..],
                offset + done as u64,
                write,
            )
        }
    }

    /// The io_uring engine's write on a page-cache disk, tried on the device
    /// thread first: `pwritev2(RWF_NOWAIT)` of `iov` at `offset`. A buffered
    /// write the ring takes is punted to an io-wq worker on file systems
    /// without a non-blocking buffered-write path, a thread hand-off that
    /// costs more than the copy. Returns [`Inline::Rest`] for what would
    /// block (`EAGAIN`, or a short write's rest; `iov` is trimmed to it).
    ///
    /// Where the file system refuses `RWF_NOWAIT` for buffered writes
    /// (`EOPNOTSUPP`; ext4 on the kernels seen), the write is done here
    /// with a plain `pwritev`, exactly what the io-wq worker would do: the
    /// kernel serialises a ring's buffered writes to one file on one
    /// worker anyway (io-wq hashes them by inode), so only the hand-off is
    /// saved; the answer is remembered for the disk's life.
    ///
    /// # Safety
    ///
    /// Every iovec must point into guest memory that stays mapped during the
    /// call (as [`DiskFile::uring_iov`] returns them).
    pub(super) unsafe fn write_inline(
        &mut self,
        iov: &mut Vec<libc::iovec>,
        offset: u64,
    ) -> Inline {
        let fd = self.file.as_raw_fd();
        let mut done = 0u64;
        let mut start = 0;
        while !self.nowait_unsupported {
            while start < iov.len() && iov[start].iov_len == 0 {
                start += 1;
            }
            if start == iov.len() {
                return Inline::Done;
            }
            let Ok(off) = libc::off_t::try_from(offset + done) else {
                return Inline::Failed(errno(libc::EINVAL));
            };
            let cnt = (iov.len() - start).min(IOV_MAX) as libc::c_int;
            // SAFETY: `iov[start..start + cnt]` are valid iovecs over guest
            // memory the caller keeps mapped.
            let n =
                unsafe { (self.pwritev2)(fd, iov[start..].as_ptr(), cnt, off, libc::RWF_NOWAIT) };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EAGAIN) => break,
                    Some(libc::EOPNOTSUPP) => self.nowait_unsupported = true,
                    _ => return Inline::Failed(e),
                }
                continue;
            }
            if n == 0 {
                break;
            }
            done += n as u64;
            let before = start;
            advance(iov, &mut start, n as usize);
            // A short write: the next page would block (a full one goes on
            // with the next IOV_MAX iovecs).
            if start < iov.len() && (start - before) < cnt as usize {
                break;
            }
        }
        if self.nowait_unsupported {
            // SAFETY: as above; `advance` keeps each iovec inside its range.
            return match unsafe { transfer(fd, &mut iov[start..], offset + done, true) } {
                Ok(()) => Inline::Done,
                Err(e) => Inline::Failed(e),
            };
        }
        while start < iov.len() && iov[start].iov_len == 0 {
            start += 1;
        }
        if start == iov.len() {
            return Inline::Done;
        }
        iov.drain(..start);
        Inline::Rest(done)
    }

    /// Replaces the inline write's `pwritev2` (tests script its answers).
    #[cfg(test)]
    pub(super) fn set_pwritev2(&mut self, f: Pwritev2) {
        self.pwritev2 = f;
    }

    /// The file's descriptor (for io_uring submissions).
    pub(super) fn raw_fd(&self) -> std::os::fd::RawFd {
        self.file.as_raw_fd()
    }

    fn check_range(&self, offset: u64, len: u64) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.capacity => Ok(()),
            _ => Err(errno(libc::EINVAL)),
        }
    }

    /// Reads `len(segs)` bytes at `offset` into the guest buffers `segs`.
    pub fn read(&mut self, mem: &GuestMemoryMmap, segs: &[Segment], offset: u64) -> io::Result<()> {
        let len = total_len(segs);
        self.check_range(offset, len)?;
        let aligned = self.build_iov(mem, segs)?;
        if !self.direct || (aligned && offset.is_multiple_of(DIRECT_ALIGN as u64)) {
            return self.transfer_iov(offset, false);
        }
        self.iov.clear();
        self.read_bounced(mem, segs, offset, len)
    }

    /// Writes the guest buffers `segs` at `offset`.
    pub fn write(
        &mut self,
        mem: &GuestMemoryMmap,
        segs: &[Segment],
        offset: u64,
    ) -> io::Result<()> {
        if self.read_only {
            return Err(errno(libc::EROFS));
        }
        let len = total_len(segs);
        self.check_range(offset, len)?;
        let aligned = self.build_iov(mem, segs)?;
        if !self.direct || (aligned && offset.is_multiple_of(DIRECT_ALIGN as u64)) {
            return self.transfer_iov(offset, true);
        }
        self.iov.clear();
        self.write_bounced(Source::Guest(mem, segs), offset, len)
    }

    /// Makes all completed writes durable (`fdatasync`).
    pub fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
        let (Ok(off), Ok(l)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
            return Err(errno(libc::EINVAL));
        };
        // SAFETY: fallocate on our own fd with plain integer arguments.
        let r = unsafe { libc::fallocate(self.file.as_raw_fd(), mode, off, l) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// Deallocates a range (a hint: unsupported by the host file system is
    /// not an error). Reads of the range afterwards return zeroes on file
    /// systems that punch holes.
    pub fn discard(&mut self, offset: u64, len: u64) -> io::Result<()> {
        if self.read_only {
            return Err(errno(libc::EROFS));
        }
        self.check_range(offset, len)?;
        match self.fallocate(
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        ) {
            Err(e) if is_unsupported(&e) => Ok(()),
            r => r,
        }
    }

    /// Makes a range read back as zeroes: punches a hole if `unmap` is
    /// allowed, else `FALLOC_FL_ZERO_RANGE`, else writes zeroes.
    pub fn write_zeroes(&mut self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        if self.read_only {
            return Err(errno(libc::EROFS));
        }
        self.check_range(offset, len)?;
        if unmap {
            match self.fallocate(
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset,
                len,
            ) {
                Err(e) if is_unsupported(&e) => {}
                r => return r,
            }
        }
        match self.fallocate(
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        ) {
            Err(e) if is_unsupported(&e) => self.write_bounced(Source::Zeros, offset, len),
            r => r,
        }
    }

    fn pread_exact(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.file, buf, offset)
    }

    fn pwrite_all(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(&self.file, buf, offset)
    }

    /// Aligned chunk covering `[pos, end)` from `pos`: `(astart, aend)`.
    fn chunk(&self, pos: u64, end: u64) -> (u64, u64) {
        let a = if self.direct { DIRECT_ALIGN as u64 } else { 1 };
        let astart = pos / a * a;
        let aend = end.div_ceil(a) * a;
        (astart, aend.min(astart + BOUNCE_CHUNK as u64))
    }

    fn read_bounced(
        &mut self,
        mem: &GuestMemoryMmap,
        segs: &[Segment],
        offset: u64,
        len: u64,
    ) -> io::Result<()> {
        let end = offset + len;
        let mut pos = offset;
        let mut cursor = SegCursor::new(segs);
        while pos < end {
            let (astart, aend) = self.chunk(pos, end);
            let span = (aend - astart) as usize;
            let mut buf = std::mem::take(&mut self.bounce);
            let b = &mut buf
                .get_or_insert_with(|| AlignedBuf::new(BOUNCE_CHUNK))
                .as_mut_slice()[..span];
            let r = self.pread_exact(b, astart);
            let skip = (pos - astart) as usize;
            let n = (aend.min(end) - pos) as usize;
            let r = r.and_then(|()| cursor.copy_to_guest(mem, &b[skip..skip + n]));
            self.bounce = buf;
            r?;
            pos += n as u64;
        }
        Ok(())
    }

    fn write_bounced(&mut self, src: Source<'_>, offset: u64, len: u64) -> io::Result<()> {
        let end = offset + len;
        let mut pos = offset;
        let mut cursor = match &src {
            Source::Guest(_, segs) => SegCursor::new(segs),
            Source::Zeros => SegCursor::new(&[]),
        };
        let a = if self.direct { DIRECT_ALIGN } else { 1 };
        while pos < end {
            let (astart, aend) = self.chunk(pos, end);
            let span = (aend - astart) as usize;
            let skip = (pos - astart) as usize;
            let n = (aend.min(end) - pos) as usize;
            let mut buf = std::mem::take(&mut self.bounce);
            let b = &mut buf
                .get_or_insert_with(|| AlignedBuf::new(BOUNCE_CHUNK))
                .as_mut_slice()[..span];
            // Read-modify-write of a partial first or last block.
            let mut r = Ok(());
            if skip != 0 {
                r = self.pread_exact(&mut b[..a], astart);
            }
            if r.is_ok() && !(skip + n).is_multiple_of(a) {
                r = self.pread_exact(&mut b[span - a..], aend - a as u64);
            }
            let r = r
                .and_then(|()| match &src {
                    Source::Guest(mem, _) => cursor.copy_from_guest(mem, &mut b[skip..skip + n]),
                    Source::Zeros => {
                        b[skip..skip + n].fill(0);
                        Ok(())
                    }
                })
                .and_then(|()| self.pwrite_all(b, astart));
            self.bounce = buf;
            r?;
            pos += n as u64;
        }
        Ok(())
    }
}

/// Drops the first `n` bytes of `iov[*start..]`, moving `start` past the
/// iovecs used up.
fn advance(iov: &mut [libc::iovec], start: &mut usize, mut n: usize) {
    while n > 0 && *start < iov.len() {
        let v = &mut iov[*start];
        let k = n.min(v.iov_len);
        // Stays within the iovec's range (k <= iov_len).
        v.iov_base = v.iov_base.cast::<u8>().wrapping_add(k).cast();
        v.iov_len -= k;
        n -= k;
        if v.iov_len == 0 {
            *start += 1;
        }
    }
}

/// `preadv`/`pwritev` of all of `iov` at `offset` on `fd`, resuming after
/// short transfers and `EINTR`.
///
/// # Safety
///
/// Every iovec must describe memory that stays mapped for the call and that
/// no Rust reference aliases (guest memory).
unsafe fn transfer(
    fd: std::os::fd::RawFd,
    iov: &mut [libc::iovec],
    mut offset: u64,
    write: bool,
) -> io::Result<()> {
    let mut start = 0;
    loop {
        while start < iov.len() && iov[start].iov_len == 0 {
            start += 1;
        }
        if start == iov.len() {
            return Ok(());
        }
        let cnt = (iov.len() - start).min(IOV_MAX);
        let p = iov[start..].as_ptr();
        let Ok(off) = libc::off_t::try_from(offset) else {
            return Err(errno(libc::EINVAL));
        };
        // SAFETY: `iov[start..start + cnt]` are valid iovecs over memory the
        // caller keeps mapped; the kernel accesses only those ranges, which
        // never alias Rust objects of the VMM.
        let n = unsafe {
            if write {
                libc::pwritev(fd, p, cnt as libc::c_int, off)
            } else {
                libc::preadv(fd, p, cnt as libc::c_int, off)
            }
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        offset += n as u64;
        advance(iov, &mut start, n as usize);
    }
}

fn is_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::ENOTTY)
    ) || (e.raw_os_error() == Some(libc::EINVAL))
}

/// Sum of segment lengths.
pub fn total_len(segs: &[Segment]) -> u64 {
    segs.iter().map(|s| u64::from(s.len)).sum()
}

/// A position inside a list of guest segments, for bounced copies (through
/// vm-memory's checked, safe accessors).
struct SegCursor<'a> {
    segs: &'a [Segment],
    idx: usize,
    off: u32,
}

impl<'a> SegCursor<'a> {
    fn new(segs: &'a [Segment]) -> Self {
        Self {
            segs,
            idx: 0,
            off: 0,
        }
    }

    /// Visits the next `len` bytes as (guest address, length) pieces.
    fn walk(
        &mut self,
        len: usize,
        mut f: impl FnMut(GuestAddress, usize, usize) -> io::Result<()>,
    ) -> io::Result<()> {
        let mut done = 0;
        while done < len {
            let s = self
                .segs
                .get(self.idx)
                .ok_or(io::ErrorKind::UnexpectedEof)?;
            let k = ((s.len - self.off) as usize).min(len - done);
            let addr = s
                .addr
                .0
                .checked_add(u64::from(self.off))
                .ok_or_else(|| errno(libc::EFAULT))?;
            f(GuestAddress(addr), done, k)?;
            done += k;
            self.off += k as u32;
            if self.off == s.len {
                self.idx += 1;
                self.off = 0;
            }
        }
        Ok(())
    }

    fn copy_to_guest(&mut self, mem: &GuestMemoryMmap, data: &[u8]) -> io::Result<()> {
        self.walk(data.len(), |addr, at, k| {
            mem.write_slice(&data[at..at + k], addr)
                .map_err(|_| errno(libc::EFAULT))
        })
    }

    fn copy_from_guest(&mut self, mem: &GuestMemoryMmap, data: &mut [u8]) -> io::Result<()> {
        self.walk(data.len(), |addr, at, k| {
            mem.read_slice(&mut data[at..at + k], addr)
                .map_err(|_| errno(libc::EFAULT))
        })
    }
}
