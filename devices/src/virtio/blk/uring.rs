//! The io_uring engine of virtio-blk (`engine=uring`).
//!
//! Reads and writes become `IORING_OP_READV`/`WRITEV` whose iovecs point
//! straight into guest memory (built and bounds-checked by
//! [`DiskFile::uring_iov`], exactly as the synchronous path builds its own),
//! FLUSH becomes `IORING_OP_FSYNC` (`DATASYNC`) with `IOSQE_IO_DRAIN`: the
//! kernel starts it only after every request submitted before it completed,
//! so it covers every write the guest saw complete and every write still in
//! flight. Up to [`QUEUE_SIZE`] requests are in flight per disk.
//!
//! Requests the engine does not take run on the synchronous path as before:
//! unaligned requests of a direct disk (bounced), `GET_ID`, `DISCARD`,
//! `WRITE_ZEROES`, refused requests (out of range, read-only), and a request
//! arriving while all slots are busy (only a guest that re-posts heads in
//! flight gets there).
//!
//! Completions: the ring has an eventfd registered ([`Uring::eventfd`]),
//! watched by the device thread's event loop next to the queue's notify
//! eventfd. After each pass over the available ring the device submits
//! everything it queued in one `io_uring_enter` and reaps what completed
//! inline (page-cache hits), so a cached read costs no extra wake-up; the
//! polling window of `queue.rs` also reaps. The throttle is asked at
//! admission, in ring order, exactly as with the sync engine; a completion
//! only records latency, so completion order cannot change the accounting.
//!
//! Guest memory: each in-flight slot holds a clone of the guest memory (its
//! regions are reference counted: the mapping outlives the I/O whatever
//! happens), and a device reset, a new activation and dropping the device
//! all wait for every request in flight first ([`Uring::drain`]), so no
//! completion writes into memory the guest was given back or that was
//! remapped, and none lands in the used ring of a reset queue.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::OnceLock;

use io_uring::register::{Probe, Restriction};
use io_uring::{IoUring, opcode, squeue, types};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::QUEUE_SIZE;
use super::request::{Request, RequestType};
use super::throttle::Nanos;

/// Whether io_uring can be used here: a ring can be set up (not refused by
/// `kernel.io_uring_disabled`, seccomp or an old kernel), it supports
/// `READV`, `WRITEV` and `FSYNC`, and a restricted ring can be built (5.10).
/// Probed once per process.
pub fn supported() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| match probe() {
        Ok(()) => true,
        Err(e) => {
            tracing::info!("virtio-blk: io_uring unavailable ({e}); disks use the sync engine");
            false
        }
    })
}

fn probe() -> io::Result<()> {
    let ring = IoUring::new(2)?;
    let mut p = Probe::new();
    ring.submitter().register_probe(&mut p)?;
    for (name, op) in [
        ("READV", opcode::Readv::CODE),
        ("WRITEV", opcode::Writev::CODE),
        ("FSYNC", opcode::Fsync::CODE),
    ] {
        if !p.is_supported(op) {
            return Err(io::Error::other(format!("opcode {name} not supported")));
        }
    }
    drop(ring);
    Uring::new().map(drop)
}

/// A request in flight.
pub(super) struct Slot {
    /// The request (head, kind, status byte, lengths).
    pub req: Request,
    /// When the device took it from the ring (for the throttle's latency).
    pub taken_at: Nanos,
    /// File offset (of what is left to transfer).
    pub offset: u64,
    /// Bytes of the request written before it was submitted (the inline
    /// try's short write; `iov` and `offset` describe the rest).
    pub pre: u64,
    /// Host iovecs into guest memory (empty for FLUSH); the kernel reads
    /// them while the request is in flight, so they live here until then.
    pub iov: Vec<libc::iovec>,
    /// Keeps the guest memory the iovecs point into mapped (never read).
    pub _mem: GuestMemoryMmap,
}

// SAFETY: the raw pointers in `iov` point into guest memory, which is
// shared with every thread of the VMM and kept mapped by `mem`; nothing
// dereferences them in Rust.
unsafe impl Send for Slot {}

/// A completed request and the kernel's result (bytes, or `-errno`).
pub(super) struct Done {
    /// The request.
    pub slot: Slot,
    /// `cqe.res`.
    pub res: i32,
}

/// The ring of one disk.
pub struct Uring {
    ring: IoUring,
    efd: EventFd,
    slots: Vec<Option<Slot>>,
    free: Vec<u32>,
    queued: usize,
}

impl std::fmt::Debug for Uring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uring")
            .field("in_flight", &self.in_flight())
            .finish_non_exhaustive()
    }
}

impl Uring {
    /// A ring for [`QUEUE_SIZE`] requests with its completion eventfd.
    ///
    /// The disk's fd is not registered with the ring (`IORING_REGISTER_FILES`
    /// would spare an fd lookup per request): a registered file is held by
    /// the ring, whose teardown after the process exits runs later in a
    /// kernel worker, so the disk's image lock (an OFD lock, released when
    /// the last reference to the open file goes) outlived the VM process by
    /// up to 23 ms here, and an immediate restart of the VM (`corral vm
    /// reboot`, a daemon's stop and start, `corral run` back to back) was
    /// refused with `image_locked`. Requests by fd hold the file only while
    /// in flight, and a process's exit cancels and waits for its own
    /// (`tests/tests/blk.rs`, `the_image_lock_is_free_as_soon_as_a_uring_vm_exits`).
    pub fn new() -> io::Result<Self> {
        let n = u32::from(QUEUE_SIZE);
        // Created disabled so that it is restricted before any use: seccomp
        // does not see the operations inside io_uring_enter, so the ring
        // itself allows only what the engine submits (READV, WRITEV, FSYNC,
        // the IO_DRAIN flag) and, once enabled, no further registration. A
        // device thread that io_uring_enter is allowed to can do no more
        // through it than preadv/pwritev/fdatasync on its disks.
        let ring = IoUring::builder()
            .setup_cqsize(2 * n)
            .setup_r_disabled()
            .build(n)?;
        let efd = EventFd::new(EFD_NONBLOCK)?;
        let sub = ring.submitter();
        sub.register_eventfd(efd.as_raw_fd())?;
        // Registered buffers are not used either: they would pin all of
        // guest memory for the ring's life, counted against RLIMIT_MEMLOCK,
        // and a vectored request cannot use them.
        let flags = squeue::Flags::IO_DRAIN.bits();
        sub.register_restrictions(&mut [
            Restriction::sqe_op(opcode::Readv::CODE),
            Restriction::sqe_op(opcode::Writev::CODE),
            Restriction::sqe_op(opcode::Fsync::CODE),
            Restriction::sqe_flags_allowed(flags),
        ])?;
        sub.register_enable_rings()?;
        Ok(Self {
            ring,
            efd,
            slots: (0..n).map(|_| None).collect(),
            free: (0..n).rev().collect(),
            queued: 0,
        })
    }

    /// Signalled when completions arrive.
    pub fn eventfd(&self) -> &EventFd {
        &self.efd
    }

    /// Requests queued or in flight.
    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Queues a read, write or flush of `slot` on `fd` (submitted by
    /// [`Uring::submit`]); gives the slot back if every slot is busy (the
    /// caller runs the request synchronously), `None` once queued.
    pub(super) fn push(&mut self, fd: RawFd, slot: Slot) -> Option<Slot> {
        let Some(idx) = self.free.pop() else {
            return Some(slot);
        };
        if self.ring.submission().is_full() {
            // Cannot happen (as many SQ entries as slots); stay safe.
            if let Err(e) = self.ring.submit() {
                tracing::warn!("virtio-blk: io_uring submit failed: {e}");
            }
            if self.ring.submission().is_full() {
                self.free.push(idx);
                return Some(slot);
            }
        }
        let iovp = slot.iov.as_ptr();
        let niov = slot.iov.len() as u32; // <= IOV_MAX (uring_iov)
        let file = types::Fd(fd);
        let entry = match slot.req.kind {
            RequestType::In => opcode::Readv::new(file, iovp, niov)
                .offset(slot.offset)
                .build(),
            RequestType::Out => opcode::Writev::new(file, iovp, niov)
                .offset(slot.offset)
                .build(),
            _ => opcode::Fsync::new(file)
                .flags(types::FsyncFlags::DATASYNC)
                .build()
                .flags(squeue::Flags::IO_DRAIN),
        }
        .user_data(u64::from(idx));
        // SAFETY: the entry's iovec array (a Vec's heap buffer: moving the
        // Slot into `slots` right after does not move it) and the guest memory its
        // iovecs point into (kept mapped by the slot's `mem`) stay valid
        // until the completion is reaped, which frees the slot; the fd is
        // the disk's, open for the device's lifetime, and the device drains
        // the ring before it is dropped.
        let pushed = unsafe { self.ring.submission().push(&entry) };
        if pushed.is_err() {
            self.free.push(idx);
            return Some(slot);
        }
        self.slots[idx as usize] = Some(slot);
        self.queued += 1;
        None
    }

    /// Submits what was queued (one `io_uring_enter`).
    pub fn submit(&mut self) {
        if self.queued == 0 {
            return;
        }
        loop {
            match self.ring.submit() {
                // The kernel stops at an entry it refuses (answering it
                // with an error completion): go on with the rest.
                Ok(n) if n > 0 && !self.ring.submission().is_empty() => continue,
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EAGAIN/EBUSY: the kernel is short of memory or the
                    // CQ is full; entries stay queued for the next submit.
                    tracing::warn!("virtio-blk: io_uring submit failed: {e}");
                    return;
                }
            }
        }
        self.queued = self.ring.submission().len();
        // The completions posted inside the submit (page-cache hits) are
        // reaped by the caller right away; clear their eventfd signal first
        // (a completion posted after this read signals it again), so the
        // device thread does not wake for them a second time. Nothing
        // there (O_DIRECT: the requests complete later): no read, which
        // was one system call per pass.
        if !self.ring.completion().is_empty() {
            let _ = self.efd.read();
        }
    }

    /// Whether completions are waiting to be reaped.
    pub fn has_completions(&mut self) -> bool {
        !self.ring.completion().is_empty()
    }

    /// Moves every completion into `out`, freeing its slot.
    pub(super) fn reap(&mut self, out: &mut Vec<Done>) {
        for cqe in self.ring.completion() {
            let idx = cqe.user_data() as usize;
            if let Some(slot) = self.slots.get_mut(idx).and_then(Option::take) {
                self.free.push(idx as u32);
                out.push(Done {
                    slot,
                    res: cqe.result(),
                });
            }
        }
    }

    /// Submits what is queued and waits for at least one completion.
    pub fn wait_one(&mut self) {
        if self.in_flight() == 0 {
            return;
        }
        if let Err(e) = self.ring.submit_and_wait(1)
            && e.kind() != io::ErrorKind::Interrupted
        {
            tracing::warn!("virtio-blk: io_uring wait failed: {e}");
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        self.queued = self.ring.submission().len();
        let _ = self.efd.read();
    }

    /// Waits for every request in flight to complete and returns them
    /// (a device reset or drop: nothing may write into guest memory after).
    pub(super) fn drain(&mut self, out: &mut Vec<Done>) {
        let _ = self.efd.read();
        while self.in_flight() > 0 {
            self.reap(out);
            if self.in_flight() == 0 {
                break;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Cannot wait in the kernel (EBUSY, ENOMEM): poll the
                    // completion ring instead of giving up on the I/O.
                    tracing::warn!("virtio-blk: io_uring wait failed: {e}");
                    std::thread::sleep(std::time::Duration::from_micros(100));
                }
            }
            self.queued = self.ring.submission().len();
        }
        let _ = self.efd.read();
    }
}

impl Drop for Uring {
    fn drop(&mut self) {
        // Closing the ring would let the kernel finish requests in flight on
        // its own, into memory this process may have unmapped by then.
        let mut done = Vec::new();
        self.drain(&mut done);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ring refuses every operation but the engine's three: seccomp
    /// cannot filter what goes through io_uring_enter.
    #[test]
    fn ring_allows_only_the_engines_operations() {
        if !supported() {
            eprintln!("skipping: no io_uring here");
            return;
        }
        let mut u = Uring::new().unwrap();
        let path = c"/etc/hostname";
        let ops = [
            opcode::Nop::new().build(),
            opcode::OpenAt::new(types::Fd(libc::AT_FDCWD), path.as_ptr()).build(),
            opcode::Socket::new(libc::AF_INET, libc::SOCK_STREAM, 0).build(),
        ];
        for op in &ops {
            // SAFETY: the entries point at a static C string only.
            unsafe { u.ring.submission().push(op) }.unwrap();
            u.ring.submit_and_wait(1).unwrap();
            let res: Vec<i32> = u.ring.completion().map(|c| c.result()).collect();
            assert_eq!(res, [-libc::EACCES], "{op:?}");
        }
        // No registration once enabled either.
        assert!(u.ring.submitter().register_files(&[0]).is_err());
    }
}
