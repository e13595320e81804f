//! Per-VM uids for the daemon: [`UidPool`] hands out a uid of its
//! [`UidRange`] that no running process on the host has and no other VM
//! holds, for as long as the [`UidLease`] lives.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use super::error::JailError;
use super::spec::UidRange;
use crate::util::lock;

/// The uids of a range handed out to VM processes.
#[derive(Debug, Default)]
pub struct UidPool {
    range: UidRange,
    leased: Arc<Mutex<BTreeSet<u32>>>,
}

/// One VM's uid, held until the VM process has ended (then dropped).
#[derive(Debug)]
pub struct UidLease {
    uid: u32,
    leased: Arc<Mutex<BTreeSet<u32>>>,
}

impl UidLease {
    /// The uid (and gid).
    pub fn uid(&self) -> u32 {
        self.uid
    }
}

impl Drop for UidLease {
    fn drop(&mut self) {
        lock(&self.leased).remove(&self.uid);
    }
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
    /// A pool over `range` (checked).
    pub fn new(range: UidRange) -> Result<Self, JailError> {
        range.check()?;
        Ok(Self {
            range,
            leased: Arc::default(),
        })
    }

    /// The range.
    pub fn range(&self) -> UidRange {
        self.range
    }

    /// The lowest uid of the range that is neither leased nor in `busy`.
    pub fn take_excluding(&self, busy: &BTreeSet<u32>) -> Result<UidLease, JailError> {
        let mut leased = lock(&self.leased);
        let uid = (0..self.range.count)
            .filter_map(|i| self.range.get(i))
            .find(|u| !leased.contains(u) && !busy.contains(u))
            .ok_or_else(|| {
                JailError::Spec(format!(
                    "every uid of the range {}:{} is in use (one per VM process)",
                    self.range.base, self.range.count
                ))
            })?;
        leased.insert(uid);
        Ok(UidLease {
            uid,
            leased: self.leased.clone(),
        })
    }

    /// A uid no process on the host runs as and no lease holds.
    pub fn take(&self) -> Result<UidLease, JailError> {
        self.take_excluding(&uids_running(&self.range))
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
