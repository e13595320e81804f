//! A shared gate that outlives its owner: the peer opens it for itself
//! when the owner is gone ([`Gate::release`]) and obeys it again once a
//! new owner is there ([`Gate::resume`]); the new owner maps the memfd the
//! peer kept ([`Gate::reattach`]).
//!
//! In corral the owner is the daemon and the peer a VM process: a VM
//! process whose daemon died opens its gate (its vCPUs run, unsupervised),
//! and a restarted daemon gets the memfd back in the adopt handshake,
//! becomes the owner again, and only then tells the VM process to resume.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::shm::{self, LEN, Mapping, PARKED, SEQ, SHUTDOWN};
use super::{Gate, Side};
use rustix::fs::SealFlags;

impl Gate {
    /// The owner side of a gate whose memfd another process kept (the
    /// peer, which got it from an owner that is gone): for a daemon that
    /// re-adopts a VM process. The fd comes from the untrusted peer, so it
    /// must be what [`new_shared`](Self::new_shared) makes: a regular
    /// file of exactly one page, sealed against shrinking and growing (only
    /// memfds take seals; a pipe, a socket, a file on disk or an unsealed
    /// memfd is refused, so no mapping that could block or shrink under
    /// the owner), with the gate's magic and version. Of the page's state
    /// it takes only the transition sequence (so a watcher on the peer side
    /// sees the next park as new; any value is a valid one); it starts
    /// open, and its park count at 0.
    pub fn reattach(fd: OwnedFd) -> io::Result<Arc<Gate>> {
        let bad = |what: String| io::Error::new(io::ErrorKind::InvalidInput, what);
        let st = rustix::fs::fstat(&fd)?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(bad("gate fd: not a regular file".into()));
        }
        if st.st_size as u64 != LEN as u64 {
            return Err(bad(format!("gate fd: {} bytes, want {LEN}", st.st_size)));
        }
        let seals = rustix::fs::fcntl_get_seals(&fd)
            .map_err(|e| bad(format!("gate fd: not a sealed memfd ({e})")))?;
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
            return Err(bad(
                "gate fd: not sealed against shrinking and growing".into()
            ));
        }
        let map = Mapping::from_fd(&fd)?;
        let b = map.block();
        let (magic, version) = (
            b.magic.load(Ordering::SeqCst),
            b.version.load(Ordering::SeqCst),
        );
        if magic != shm::MAGIC || version != shm::VERSION {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("gate fd: magic {magic:#x} version {version}: not a gate"),
            ));
        }
        let seq = b.state.load(Ordering::SeqCst) & !(PARKED | SHUTDOWN);
        let gate = Gate::with_map(map, Side::Owner, true);
        let open = seq.wrapping_add(SEQ);
        gate.mine.store(open, Ordering::SeqCst);
        gate.block().state.store(open, Ordering::SeqCst);
        gate.wake();
        Ok(Arc::new(gate))
    }

    /// Peer: the owner is gone (in corral: the daemon's connection
    /// closed). This process's threads treat the gate as open from now
    /// on, whatever the word says, and its waiters return at once; a no-op
    /// on the owner. Undone by [`resume`](Self::resume).
    pub fn release(&self) {
        if self.side != Side::Peer {
            return;
        }
        self.released.store(true, Ordering::SeqCst);
        // Change the word too: a waiter between its read of the word and
        // its futex wait then returns at once instead of sleeping on.
        self.block().state.fetch_add(SEQ, Ordering::SeqCst);
        shm::wake_all(&self.block().state);
    }

    /// Peer: a new owner has the gate ([`reattach`](Self::reattach)):
    /// obey the word again. If it says parked, runs the kick callback: a
    /// park the owner made while this side was released kicked threads
    /// that did not look at the word. A no-op on the owner, or when not
    /// released.
    pub fn resume(&self) {
        if self.side != Side::Peer {
            return;
        }
        if self.released.swap(false, Ordering::SeqCst) && self.is_parked() {
            self.run_kick();
        }
    }

    /// Peer: whether [`release`](Self::release) is in force.
    pub fn is_released(&self) -> bool {
        self.released.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::WaitOutcome;
    use std::os::fd::{AsFd, FromRawFd};
    use std::sync::atomic::{AtomicU32, AtomicUsize};
    use std::time::{Duration, Instant};

    fn dup(fd: &OwnedFd) -> OwnedFd {
        fd.as_fd().try_clone_to_owned().unwrap()
    }

    /// A peer thread blocked on a parked gate whose owner is gone is
    /// released; a new owner re-attaches (open), and parks and unparks the
    /// peer again once it resumes.
    #[test]
    fn a_new_owner_takes_the_gate_back_from_a_released_peer() {
        let (old, fd) = Gate::new_shared().unwrap();
        let kept = dup(&fd);
        let peer = Gate::from_fd(fd).unwrap();
        assert!(old.park());
        let p = peer.clone();
        let waiter = std::thread::spawn(move || p.wait_while_parked());
        let t0 = Instant::now();
        while peer.waiting() == 0 {
            assert!(t0.elapsed() < Duration::from_secs(10), "no waiter");
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(old); // the daemon dies with the gate parked
        peer.release();
        assert_eq!(waiter.join().unwrap(), WaitOutcome::Running);
        assert!(!peer.is_parked() && peer.is_released());

        let new = Gate::reattach(kept).unwrap();
        assert_eq!(new.side(), Side::Owner);
        assert!(!new.is_parked(), "a re-attached gate starts open");
        assert_eq!(new.park_count(), 0);
        // Parked while the peer is still released: the peer runs on.
        assert!(new.park());
        assert!(!peer.is_parked());
        assert_eq!(
            peer.wait_while_parked_timeout(Duration::from_millis(5)),
            Some(WaitOutcome::Running)
        );
        peer.resume();
        assert!(peer.is_parked() && !peer.is_released());
        let p = peer.clone();
        let waiter = std::thread::spawn(move || p.wait_while_parked());
        std::thread::sleep(Duration::from_millis(30));
        assert!(!waiter.is_finished(), "a resumed peer obeys the new owner");
        assert!(new.unpark());
        assert_eq!(waiter.join().unwrap(), WaitOutcome::Running);
    }

    /// `resume` kicks the peer's threads when the word is parked (the
    /// owner's kick of that park reached threads that ignored it), and
    /// not otherwise; `release` and `resume` do nothing on an owner.
    #[test]
    fn resume_kicks_for_a_park_made_while_released() {
        let (owner, fd) = Gate::new_shared().unwrap();
        let peer = Gate::from_fd(fd).unwrap();
        let kicks = Arc::new(AtomicUsize::new(0));
        let k = kicks.clone();
        peer.set_kick(move || {
            k.fetch_add(1, Ordering::SeqCst);
        });
        peer.release();
        peer.resume();
        assert_eq!(kicks.load(Ordering::SeqCst), 0, "open: nothing to kick");
        peer.release();
        owner.park();
        peer.resume();
        assert_eq!(kicks.load(Ordering::SeqCst), 1);
        peer.resume();
        assert_eq!(kicks.load(Ordering::SeqCst), 1, "once per release");
        owner.release();
        assert!(owner.is_parked() && !owner.is_released());
    }

    /// Whatever the peer wrote into the page, a re-attached owner starts
    /// open and decides alone; the word's sequence moves on.
    #[test]
    fn reattach_takes_nothing_but_the_sequence_from_the_page() {
        let (old, fd) = Gate::new_shared().unwrap();
        let kept = dup(&fd);
        let peer = Gate::from_fd(fd).unwrap();
        old.park();
        let before = old.block().state.load(Ordering::SeqCst);
        drop(old);
        for word in [u32::MAX, before] {
            peer.block().state.store(word, Ordering::SeqCst);
            peer.block().waiting.store(u32::MAX, Ordering::SeqCst);
            let new = Gate::reattach(dup(&kept)).unwrap();
            assert!(!new.is_parked() && !new.is_shutdown());
            let s = peer.block().state.load(Ordering::SeqCst);
            assert_eq!(s & (PARKED | SHUTDOWN), 0, "{s:#x}");
            assert_eq!(s, (word & !(PARKED | SHUTDOWN)).wrapping_add(SEQ));
            assert!(new.park());
            assert!(new.is_parked());
        }
    }

    fn memfd(len: u64, seals: SealFlags) -> OwnedFd {
        let fd = rustix::fs::memfd_create(
            "t",
            rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
        )
        .unwrap();
        rustix::fs::ftruncate(&fd, len).unwrap();
        if !seals.is_empty() {
            rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
        }
        fd
    }

    /// What a VM process may hand a re-adopting daemon instead of its gate
    /// is refused with an error, never mapped: a pipe, a file on disk, an
    /// unsealed memfd (it could shrink it under the daemon: SIGBUS), one
    /// of another size, and a sealed page that is not a gate.
    #[test]
    fn reattach_refuses_what_is_not_a_sealed_gate_page() {
        let mut fds = [0i32; 2];
        // SAFETY: pipe writes two fds into the array.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the fds pipe just made; each is owned once.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        drop(w);
        let file: OwnedFd = std::fs::File::open("/proc/self/exe").unwrap().into();
        let sealed = SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL;
        let cases = [
            ("a pipe", r),
            ("a file on disk", file),
            ("an unsealed memfd", memfd(LEN as u64, SealFlags::empty())),
            ("a grow-only seal", memfd(LEN as u64, SealFlags::SHRINK)),
            ("two pages", memfd(2 * LEN as u64, sealed)),
            ("a zeroed page", memfd(LEN as u64, sealed)),
        ];
        for (what, fd) in cases {
            assert!(Gate::reattach(fd).is_err(), "{what} was taken for a gate");
        }
        // The real thing is taken.
        let (_g, fd) = Gate::new_shared().unwrap();
        assert!(Gate::reattach(fd).is_ok());
    }

    /// A waiter that read the word just before `release` does not sleep
    /// on: the release changes the word as well as waking.
    #[test]
    fn release_changes_the_word() {
        let (owner, fd) = Gate::new_shared().unwrap();
        let peer = Gate::from_fd(fd).unwrap();
        owner.park();
        let word: &AtomicU32 = &peer.block().state;
        let before = word.load(Ordering::SeqCst);
        peer.release();
        assert_ne!(word.load(Ordering::SeqCst), before);
        assert!(owner.is_parked(), "the owner's decision is its own");
    }
}
