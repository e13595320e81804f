//! The manager's book of open images: which VM holds which file (by device
//! and inode), for the 409 that names the holder. The OFD locks themselves
//! (see [`crate::hostfile`]) are what excludes; this map only explains.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

use crate::util::lock;

use crate::hostfile::{HostFile, HostFileError, HostPolicy, Role};

/// A VM's files, open and locked.
#[derive(Debug, Default)]
pub(crate) struct VmFiles {
    pub(crate) kernel: Option<HostFile>,
    pub(crate) initrd: Option<HostFile>,
    pub(crate) disks: Vec<HostFile>,
}

impl VmFiles {
    pub(crate) fn all(&self) -> impl Iterator<Item = &HostFile> {
        self.kernel
            .iter()
            .chain(self.initrd.iter())
            .chain(self.disks.iter())
    }
}

/// (device, inode) → the VMs that hold the image.
#[derive(Debug, Default)]
pub(crate) struct ImageBook {
    holders: Mutex<HashMap<(u64, u64), Vec<String>>>,
}

impl ImageBook {
    /// Opens one file; a lock conflict names the holder when it is one of
    /// ours.
    fn open(
        &self,
        policy: &HostPolicy,
        path: &Path,
        role: Role,
    ) -> Result<HostFile, HostFileError> {
        match policy.open(path, role) {
            Err(HostFileError::Locked {
                role,
                path,
                wanted,
                holder: None,
                key,
            }) => {
                let holder = lock(&self.holders)
                    .get(&key)
                    .and_then(|v| v.first().cloned());
                Err(HostFileError::Locked {
                    role,
                    path,
                    wanted,
                    holder,
                    key,
                })
            }
            r => r,
        }
    }

    /// Opens a VM's kernel, initrd and disks under `policy`. On any error,
    /// what was opened is released again.
    pub(crate) fn open_vm(
        &self,
        policy: &HostPolicy,
        kernel: Option<&Path>,
        initrd: Option<&Path>,
        disks: &[(&Path, bool, bool)],
    ) -> Result<VmFiles, HostFileError> {
        let mut files = VmFiles::default();
        let r = (|| {
            if let Some(k) = kernel {
                files.kernel = Some(self.open(policy, k, Role::Kernel)?);
            }
            if let Some(i) = initrd {
                files.initrd = Some(self.open(policy, i, Role::Initrd)?);
            }
            for (p, read_only, direct) in disks {
                let role = Role::Disk {
                    writable: !read_only,
                    direct: *direct,
                };
                files.disks.push(self.open(policy, p, role)?);
            }
            Ok(())
        })();
        match r {
            Ok(()) => Ok(files),
            Err(e) => {
                self.release(None, files.all());
                Err(e)
            }
        }
    }

    /// Records that VM `vm` holds these (already locked) files.
    pub(crate) fn book<'a>(&self, vm: &str, files: impl Iterator<Item = &'a HostFile>) {
        let mut h = lock(&self.holders);
        for f in files {
            h.entry(f.key()).or_default().push(vm.to_string());
        }
    }

    /// Unlocks files and forgets that VM `vm` (if booked) holds them.
    pub(crate) fn release<'a>(&self, vm: Option<&str>, files: impl Iterator<Item = &'a HostFile>) {
        let mut h = lock(&self.holders);
        for f in files {
            f.unlock();
            let Some(vm) = vm else { continue };
            if let Some(v) = h.get_mut(&f.key()) {
                if let Some(i) = v.iter().position(|n| n == vm) {
                    v.remove(i);
                }
                if v.is_empty() {
                    h.remove(&f.key());
                }
            }
        }
    }
}
