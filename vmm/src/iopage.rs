//! A class's I/O group shared by the daemon and its VM processes: the
//! group's buckets ([`corral_blkthrottle::GroupPage`]) in one page of a
//! sealed memfd. The daemon creates it with the class's group
//! ([`IoPage::create`], the page's owner) and passes the fd to each VM
//! process of the class, which maps it ([`IoPage::from_fd`]) and attaches
//! its disks' group to it (`ThrottleGroup::attach`). See ARCHITECTURE.md,
//! "Block I/O", and `corral_blkthrottle::page` for what a VM process that
//! writes garbage into the page can and cannot do.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use corral_blkthrottle::{GROUP_PAGE_LEN, GroupPage, PageMem};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

/// The mapping's size: one page.
const LEN: usize = 4096;
const _: () = assert!(GROUP_PAGE_LEN <= LEN);

/// A mapping of one group page, unmapped on drop.
pub struct IoPage {
    ptr: NonNull<GroupPage>,
}

// SAFETY: the page is atomics only; the mapping is owned and unmapped once.
unsafe impl Send for IoPage {}
// SAFETY: as above: shared access goes through atomics.
unsafe impl Sync for IoPage {}

impl IoPage {
    /// A new sealed memfd of one page (zero-filled) and its mapping. The
    /// caller initialises it (`ThrottleGroup::new_shared`).
    pub fn create() -> io::Result<(Arc<IoPage>, OwnedFd)> {
        let fd = rustix::fs::memfd_create(
            "corral-iogroup",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )?;
        rustix::fs::ftruncate(&fd, LEN as u64)?;
        // No shrink (a VM process truncating it would SIGBUS the daemon and
        // its class-mates), no grow, no further seals.
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        let m = Self::map(&fd)?;
        Ok((Arc::new(m), fd))
    }

    /// Maps a group page received from the daemon; checks its size and
    /// seals (its contents are checked by `ThrottleGroup::attach`).
    pub fn from_fd(fd: &OwnedFd) -> io::Result<Arc<IoPage>> {
        let st = rustix::fs::fstat(fd)?;
        if (st.st_size as u64) < LEN as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("I/O group page: {} bytes, want {LEN}", st.st_size),
            ));
        }
        let seals = rustix::fs::fcntl_get_seals(fd)?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "I/O group page: not sealed against shrinking",
            ));
        }
        Ok(Arc::new(Self::map(fd)?))
    }

    fn map(fd: &impl AsFd) -> io::Result<IoPage> {
        // SAFETY: a fresh shared mapping of a file of at least LEN bytes
        // that cannot shrink (sealed), so the page stays backed.
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
        let ptr =
            NonNull::new(p.cast::<GroupPage>()).ok_or_else(|| io::Error::other("mmap: null"))?;
        Ok(IoPage { ptr })
    }
}

impl PageMem for IoPage {
    fn page(&self) -> &GroupPage {
        // SAFETY: the mapping is LEN ≥ size_of::<GroupPage>() bytes,
        // page-aligned (≥ its 16-byte alignment), readable and writable,
        // lives as long as `self`, and a GroupPage is atomics only (every
        // bit pattern valid, zero-filled at creation).
        unsafe { self.ptr.as_ref() }
    }
}

impl Drop for IoPage {
    fn drop(&mut self) {
        // SAFETY: our own mapping of LEN bytes; no reference into it
        // outlives `self` (`page` borrows `self`).
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), LEN) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_blkthrottle::{Limits, ThrottleGroup};

    #[test]
    fn two_mappings_of_one_memfd_are_one_group() {
        let l = Limits::parse("iops=10,burst_ops=2").unwrap();
        let (page, fd) = IoPage::create().unwrap();
        let owner = ThrottleGroup::new_shared("class:c", &l, 0, page).unwrap();
        let peer = ThrottleGroup::attach("class:c", &l, 0, IoPage::from_fd(&fd).unwrap()).unwrap();
        let mut a = corral_blkthrottle::Throttle::new(&Limits::UNLIMITED, 0).unwrap();
        a.join_group(&peer, 100, None).unwrap();
        let r = corral_blkthrottle::Request::read(512);
        assert_eq!(a.poll(r, 0), corral_blkthrottle::Decision::Admit);
        assert_eq!(a.poll(r, 0), corral_blkthrottle::Decision::Admit);
        assert!(matches!(
            a.poll(r, 0),
            corral_blkthrottle::Decision::Wait { .. }
        ));
        assert_eq!(owner.stats().read.ops, 2);
        // A file that is not a sealed page is refused.
        let f = rustix::fs::memfd_create("x", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&f, 4096).unwrap();
        assert!(IoPage::from_fd(&f).is_err());
    }
}
