//! The gate's shared block: its layout, the mapping that holds it (a sealed
//! memfd shared with a VM process, or an anonymous mapping for a gate used
//! inside one process) and the futex calls on its state word.
//!
//! Which side writes which field (the *owner* created the gate, the *peer*
//! got it with [`Gate::from_fd`](super::Gate::from_fd); for a gate used
//! inside one process the owner does both):
//!
//! | field | written by | read by the owner? |
//! |---|---|---|
//! | `magic`, `version` | owner, once | no |
//! | `state` (futex word) | owner; the peer only ORs in `SHUTDOWN` | never: the owner keeps its own copy |
//! | `parks` | owner | no (own copy) |
//! | `waiting`, `watchers` | peer | yes: untrusted counts, only compared or used to skip a wake |
//! | `cpu_vcpus`, `cpu_seq`, `cpu_ns` | peer | yes: untrusted, the reader clamps them |
//!
//! Everything is an atomic of a fixed size, so any bit pattern the peer
//! writes is a valid value: the owner never panics or blocks on what it
//! reads, and never waits on the futex of a shared gate (its waits, used
//! only in-process and in tests, take their decision from its own copy).

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use rustix::thread::futex;

/// "CGAT": the first word of a gate block.
pub(super) const MAGIC: u32 = 0x4347_4154;
/// Layout version; bumped on any change of [`Block`].
pub(super) const VERSION: u32 = 1;

/// State word bits: parked.
pub(super) const PARKED: u32 = 1;
/// State word bits: shut down.
pub(super) const SHUTDOWN: u32 = 2;
/// State word: the transition sequence counts in the bits above these two
/// (so every transition changes the word, and a watcher sees each park).
pub(super) const SEQ: u32 = 4;

/// vCPUs whose CPU time the block can publish (corral's limit is 254).
pub const MAX_PUBLISHED_VCPUS: usize = 256;

/// The shared block, at offset 0 of the mapping. See the module docs for
/// who writes what.
#[repr(C)]
pub(super) struct Block {
    pub(super) magic: AtomicU32,
    pub(super) version: AtomicU32,
    /// The futex word: [`PARKED`] | [`SHUTDOWN`] | sequence × [`SEQ`].
    pub(super) state: AtomicU32,
    /// vCPU threads blocked in a wait.
    pub(super) waiting: AtomicU32,
    /// Watcher threads blocked on the word.
    pub(super) watchers: AtomicU32,
    /// How many `cpu_ns` slots the peer publishes.
    pub(super) cpu_vcpus: AtomicU32,
    /// Park transitions.
    pub(super) parks: AtomicU64,
    /// Bumped by the peer after each publication of `cpu_ns`.
    pub(super) cpu_seq: AtomicU64,
    _pad: [u64; 4],
    /// Cumulative CPU time of each vCPU thread, ns.
    pub(super) cpu_ns: [AtomicU64; MAX_PUBLISHED_VCPUS],
}

/// The size of the mapping: one page.
pub(super) const LEN: usize = 4096;
const _: () = assert!(std::mem::size_of::<Block>() <= LEN);

/// A mapping of one [`Block`], unmapped on drop.
pub(super) struct Mapping {
    ptr: NonNull<Block>,
}

// SAFETY: the block is atomics only; the mapping is owned and unmapped once.
unsafe impl Send for Mapping {}
// SAFETY: as above: shared access goes through atomics.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// An anonymous shared mapping (a gate used inside one process).
    pub(super) fn anonymous() -> io::Result<Self> {
        // SAFETY: a fresh mapping at an address the kernel picks; nothing
        // else refers to it.
        let p = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                LEN,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
            )
        }?;
        Self::from_ptr(p)
    }

    /// A new sealed memfd of one page and its mapping.
    pub(super) fn memfd() -> io::Result<(Self, OwnedFd)> {
        let fd = rustix::fs::memfd_create(
            "corral-gate",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )?;
        rustix::fs::ftruncate(&fd, LEN as u64)?;
        // No shrink (a peer truncating the file would SIGBUS the owner), no
        // grow, no further seals (a write seal would fail on our mapping
        // anyway, but nobody gets to try).
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        let m = Self::map_fd(&fd)?;
        Ok((m, fd))
    }

    /// Maps a gate memfd received from the owner; checks its size and seals.
    pub(super) fn from_fd(fd: &OwnedFd) -> io::Result<Self> {
        let st = rustix::fs::fstat(fd)?;
        if (st.st_size as u64) < LEN as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("gate fd: {} bytes, want {LEN}", st.st_size),
            ));
        }
        let seals = rustix::fs::fcntl_get_seals(fd)?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "gate fd: not sealed against shrinking",
            ));
        }
        Self::map_fd(fd)
    }

    fn map_fd(fd: &impl AsFd) -> io::Result<Self> {
        // SAFETY: a fresh shared mapping of a file of at least LEN bytes
        // that cannot shrink (sealed), so every page stays backed.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                LEN,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }?;
        Self::from_ptr(p)
    }

    fn from_ptr(p: *mut std::ffi::c_void) -> io::Result<Self> {
        let ptr = NonNull::new(p.cast::<Block>()).ok_or_else(|| io::Error::other("mmap: null"))?;
        Ok(Self { ptr })
    }

    pub(super) fn block(&self) -> &Block {
        // SAFETY: the mapping is LEN bytes, page-aligned, readable and
        // writable, lives as long as `self`, and holds only atomics (every
        // bit pattern is valid, zero-filled at creation).
        unsafe { self.ptr.as_ref() }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping of LEN bytes; no reference into it
        // outlives `self` (`block` borrows `self`).
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), LEN) };
    }
}

/// Sleeps while `word` holds `val` (shared futex: the word may be mapped in
/// two processes). Returns at once if it does not, on a wake, a signal or
/// the timeout.
pub(super) fn wait(word: &AtomicU32, val: u32, timeout_ns: Option<u64>) {
    let ts = timeout_ns.map(|ns| futex::Timespec {
        tv_sec: (ns / 1_000_000_000) as _,
        tv_nsec: (ns % 1_000_000_000) as _,
    });
    let _ = futex::wait(word, futex::Flags::empty(), val, ts.as_ref());
}

/// Wakes every thread sleeping on `word`, in any process.
pub(super) fn wake_all(word: &AtomicU32) {
    let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
}
