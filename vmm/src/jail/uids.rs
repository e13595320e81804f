//! Per-VM uids for the daemon: [`UidPool`] hands out a uid of its
//! [`UidRange`] that no running process on the host has and no other VM
//! holds, for as long as the [`UidLease`] lives.
//!
//! Several daemons on one host (each with its own state directory) share
//! the default range, so a lease is also a host-wide lock: an OFD write
//! lock on byte `uid` of [`UID_LOCK_FILE`], held until the lease ends (by
//! then the VM process runs as the uid, and the `/proc` scan of every
//! other daemon sees it). The scan is made after the lock is taken, so a
//! uid whose lease another daemon has just given up to its running VM
//! process is seen busy. Without this, two daemons that created VMs at
//! once could both pick the lowest free uid, and their VMs would share
//! it: its `RLIMIT_NPROC`, and the right to signal each other.

use std::collections::BTreeSet;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::{Arc, Mutex};

use super::error::JailError;
use super::spec::UidRange;
use crate::util::lock;

/// The host-wide lock file of the uid leases (byte `uid` locked while a
/// daemon leases `uid`).
pub const UID_LOCK_FILE: &str = "/run/corral/jail-uids.lock";

/// The uids of a range handed out to VM processes.
#[derive(Debug, Default)]
pub struct UidPool {
    range: UidRange,
    leased: Arc<Mutex<BTreeSet<u32>>>,
    /// [`UID_LOCK_FILE`], if it could be opened.
    host_lock: Option<Arc<std::fs::File>>,
}

/// One VM's uid, held until the VM process has ended (then dropped).
#[derive(Debug)]
pub struct UidLease {
    uid: u32,
    leased: Arc<Mutex<BTreeSet<u32>>>,
    host_lock: Option<Arc<std::fs::File>>,
}

impl UidLease {
    /// The uid (and gid).
    pub fn uid(&self) -> u32 {
        self.uid
    }
}

impl Drop for UidLease {
    fn drop(&mut self) {
        if let Some(f) = &self.host_lock {
            let _ = byte_lock(&**f, self.uid, false);
        }
        lock(&self.leased).remove(&self.uid);
    }
}

/// `fcntl(F_OFD_SETLK)` of byte `at` of `f`: a write lock, or unlocked;
/// never waits (`EAGAIN`: another open file holds it).
fn byte_lock(f: &impl AsFd, at: u32, on: bool) -> std::io::Result<()> {
    // SAFETY: `flock` is a plain C struct; all-zero is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = if on { libc::F_WRLCK } else { libc::F_UNLCK } as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = libc::off_t::from(at);
    fl.l_len = 1;
    // SAFETY: F_OFD_SETLK reads the `flock` we pass, which outlives the
    // call; the fd is valid for the borrow. l_pid is 0, as OFD locks need.
    let r = unsafe { libc::fcntl(f.as_fd().as_raw_fd(), libc::F_OFD_SETLK, &fl) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Opens (creating) the host-wide lock file at `path`, 0600.
fn open_lock_file(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if let Some(d) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(d)?;
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// The real uids of the host's processes that fall in `range` (from
/// `/proc/*/status`): VM processes of a previous daemon, re-adopted or not.
pub fn uids_running(range: &UidRange) -> BTreeSet<u32> {
    let mut out = BTreeSet::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let name = e.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(st) = std::fs::read_to_string(e.path().join("status")) else {
            continue;
        };
        let uid = st
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u32>().ok());
        if let Some(u) = uid
            && range.contains(u)
        {
            out.insert(u);
        }
    }
    out
}

impl UidPool {
    /// A pool over `range` (checked), leasing host-wide through
    /// [`UID_LOCK_FILE`] (where it cannot be made, within this daemon
    /// only, which is logged).
    pub fn new(range: UidRange) -> Result<Self, JailError> {
        Self::with_lock_file(range, std::path::Path::new(UID_LOCK_FILE))
    }

    /// [`UidPool::new`] with another lock file.
    pub fn with_lock_file(range: UidRange, path: &std::path::Path) -> Result<Self, JailError> {
        range.check()?;
        let host_lock = match open_lock_file(path) {
            Ok(f) => Some(Arc::new(f)),
            Err(e) => {
                tracing::warn!(
                    "uid leases are not host-wide ({}: {e}): two daemons could pick one uid",
                    path.display()
                );
                None
            }
        };
        Ok(Self {
            range,
            leased: Arc::default(),
            host_lock,
        })
    }

    /// The range.
    pub fn range(&self) -> UidRange {
        self.range
    }

    fn exhausted(&self) -> JailError {
        JailError::Spec(format!(
            "every uid of the range {}:{} is in use (one per VM process)",
            self.range.base, self.range.count
        ))
    }

    /// The lowest uid of the range that is neither leased (here or, with
    /// the lock file, by another daemon) nor in `busy`.
    pub fn take_excluding(&self, busy: &BTreeSet<u32>) -> Result<UidLease, JailError> {
        self.take_with(|_| busy.clone(), busy.clone())
    }

    /// Takes the lowest uid that no lease holds and that `scan` (made
    /// after the uid's host lock is taken) does not report busy; `busy`
    /// are known busy already.
    fn take_with(
        &self,
        scan: impl Fn(&UidRange) -> BTreeSet<u32>,
        mut busy: BTreeSet<u32>,
    ) -> Result<UidLease, JailError> {
        let mut leased = lock(&self.leased);
        let mut from = 0;
        loop {
            let (i, uid) = (from..self.range.count)
                .filter_map(|i| Some((i, self.range.get(i)?)))
                .find(|(_, u)| !leased.contains(u) && !busy.contains(u))
                .ok_or_else(|| self.exhausted())?;
            from = i + 1;
            if let Some(f) = &self.host_lock {
                if byte_lock(&**f, uid, true).is_err() {
                    continue; // another daemon leases it
                }
                busy = scan(&self.range);
                if busy.contains(&uid) {
                    let _ = byte_lock(&**f, uid, false);
                    continue;
                }
            }
            leased.insert(uid);
            return Ok(UidLease {
                uid,
                leased: self.leased.clone(),
                host_lock: self.host_lock.clone(),
            });
        }
    }

    /// A uid no process on the host runs as and no lease holds.
    pub fn take(&self) -> Result<UidLease, JailError> {
        self.take_with(uids_running, uids_running(&self.range))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_unique_and_come_back() {
        let p = UidPool::new(UidRange {
            base: 5000,
            count: 3,
        })
        .unwrap();
        let busy = BTreeSet::from([5000]);
        let a = p.take_excluding(&busy).unwrap();
        let b = p.take_excluding(&busy).unwrap();
        assert_eq!((a.uid(), b.uid()), (5001, 5002));
        assert!(p.take_excluding(&busy).is_err(), "range exhausted");
        drop(a);
        assert_eq!(p.take_excluding(&busy).unwrap().uid(), 5001);
        assert!(UidPool::new(UidRange { base: 0, count: 3 }).is_err());
    }

    #[test]
    fn two_pools_on_one_lock_file_never_lease_one_uid() {
        let f = std::env::temp_dir().join(format!("corral-uids-{}.lock", std::process::id()));
        let r = UidRange {
            base: 7000,
            count: 3,
        };
        let (a, b) = (
            UidPool::with_lock_file(r, &f).unwrap(),
            UidPool::with_lock_file(r, &f).unwrap(),
        );
        let none = BTreeSet::new();
        let x = a.take_excluding(&none).unwrap();
        let y = b.take_excluding(&none).unwrap();
        assert_eq!(
            (x.uid(), y.uid()),
            (7000, 7001),
            "the second daemon took a leased uid"
        );
        drop(x);
        assert_eq!(b.take_excluding(&none).unwrap().uid(), 7000, "given back");
        let _ = std::fs::remove_file(&f);
    }

    #[test]
    fn running_uids_are_found() {
        use std::os::unix::process::CommandExt;
        let me = rustix::process::getuid().as_raw();
        // As root: a child running as a uid of the range; else our own uid.
        let uid = if me == 0 { 3_221_226_100 } else { me };
        let r = UidRange {
            base: uid,
            count: 1,
        };
        let mut child = (me == 0).then(|| {
            std::process::Command::new("sleep")
                .arg("5")
                .uid(uid)
                .gid(uid)
                .spawn()
                .unwrap()
        });
        let found = (0..100).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            uids_running(&r).contains(&uid)
        });
        if let Some(c) = child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
        assert!(found, "uid {uid} not seen running");
        assert!(
            !uids_running(&UidRange {
                base: 3_221_226_200,
                count: 1
            })
            .contains(&3_221_226_200)
        );
    }
}
