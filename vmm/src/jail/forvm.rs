//! A jail for one VM's configuration ([`JailSpec::for_vm`]), and how the
//! daemon finds a jailed VM process's threads from the host
//! ([`host_view`]).

use std::collections::BTreeMap;

use super::error::JailError;
use super::spec::{JailFile, JailLimits, JailSpec};
use crate::hostfile::HostImage;
use crate::vm::{KernelSource, VmConfig};

impl<'a> JailSpec<'a> {
    /// The jail of the VM `cfg`: its kernel at `/kernel`, its initrd at
    /// `/initrd`, disk `NAME` at `/NAME` (`/disk-NAME` for a disk named
    /// `kernel`, `initrd` or `dev`; read-only as configured),
    /// host name = the VM's name (up to 64 bytes), limits sized by
    /// [`JailLimits::for_vm`]. Every file must be open already (a path
    /// cannot be opened once jailed): a `Path` kernel, initrd or disk is
    /// refused.
    pub fn for_vm(cfg: &'a VmConfig, uid: u32, gid: u32) -> Result<Self, JailError> {
        let not_open = |what: String| {
            JailError::Spec(format!(
                "{what} is given by path; a jailed VM needs its files opened before the jail"
            ))
        };
        let mut files = Vec::new();
        match &cfg.kernel {
            KernelSource::File(f) => files.push(JailFile {
                name: "kernel".into(),
                fd: std::os::fd::AsFd::as_fd(f.file()),
                read_only: true,
            }),
            KernelSource::Bytes(_) => {}
            KernelSource::Path(p) => return Err(not_open(format!("the kernel {}", p.display()))),
        }
        match &cfg.initrd {
            Some(HostImage::File(f)) => files.push(JailFile {
                name: "initrd".into(),
                fd: std::os::fd::AsFd::as_fd(f.file()),
                read_only: true,
            }),
            Some(HostImage::Path(p)) => {
                return Err(not_open(format!("the initrd {}", p.display())));
            }
            None => {}
        }
        let mut largest_writable = 0;
        for (i, d) in cfg.disks.iter().enumerate() {
            let Some(f) = &d.file else {
                return Err(not_open(format!("disk {}", d.path.display())));
            };
            if !d.read_only {
                largest_writable = largest_writable.max(f.len());
            }
            files.push(JailFile {
                name: match d.name(i) {
                    n if ["kernel", "initrd", "dev"].contains(&n.as_str()) => format!("disk-{n}"),
                    n => n,
                },
                fd: std::os::fd::AsFd::as_fd(f.file()),
                read_only: d.read_only,
            });
        }
        let mut hostname: String = cfg.name.chars().take(64).collect();
        while hostname.len() > 64 {
            hostname.pop();
        }
        let mut spec = JailSpec::new(hostname, uid, gid);
        spec.files = files;
        spec.limits = JailLimits::for_vm(
            cfg.memory_mib,
            u32::from(cfg.vcpus),
            cfg.disks.len() as u32,
            largest_writable,
        );
        Ok(spec)
    }
}

/// What a VM process does before it starts its VM: jails itself for `cfg`
/// ([`JailSpec::for_vm`], uid = gid = `uid`, these namespaces) and returns
/// the KVM device to start it on ([`crate::builder::start_with_kvm`]).
/// With a pid namespace this forks, and returns in the child only (see
/// [`super::enter`]).
pub fn enter_vm(
    cfg: &VmConfig,
    uid: u32,
    namespaces: super::spec::Namespaces,
) -> Result<kvm_ioctls::Kvm, JailError> {
    let mut spec = JailSpec::for_vm(cfg, uid, uid)?;
    spec.namespaces = namespaces;
    Ok(super::enter(&spec)?.kvm())
}

/// A jailed VM process seen from the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostView {
    /// Its pid in the host's namespace.
    pub pid: u32,
    /// Its threads: namespace tid → host tid.
    pub tids: BTreeMap<u32, u32>,
}

impl HostView {
    /// The host tid of the thread the process knows as `ns_tid` (what its
    /// `gettid` returned, e.g. the vCPU tids it reports).
    pub fn host_tid(&self, ns_tid: u32) -> Option<u32> {
        self.tids.get(&ns_tid).copied()
    }
}

fn nspid(status: &str) -> Option<(u32, u32)> {
    let v: Vec<u32> = status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    Some((*v.first()?, *v.last()?))
}

/// The jailed process behind the outer process `outer` (the pid its
/// spawner holds): with a pid namespace, `outer`'s only child; without,
/// `outer` itself. Reads `/proc` of the host, so the daemon calls it, not
/// the jailed process; thread ids reported from inside a pid namespace are
/// that namespace's, and the daemon maps them here before it signals a
/// thread or reads its `/proc/TID` files.
pub fn host_view(outer: u32) -> std::io::Result<HostView> {
    let pid = match child_of(outer)? {
        Some(c) => c,
        None => outer,
    };
    let mut tids = BTreeMap::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let e = e?;
        let Ok(st) = std::fs::read_to_string(e.path().join("status")) else {
            continue; // the thread ended meanwhile
        };
        if let Some((host, ns)) = nspid(&st) {
            tids.insert(ns, host);
        }
    }
    Ok(HostView { pid, tids })
}

/// The first child of `outer`: from `/proc/PID/task/PID/children`, or,
/// on a kernel without it (`CONFIG_PROC_CHILDREN`), the process whose
/// `PPid` is `outer`.
fn child_of(outer: u32) -> std::io::Result<Option<u32>> {
    match std::fs::read_to_string(format!("/proc/{outer}/task/{outer}/children")) {
        Ok(children) => match children.split_whitespace().next() {
            Some(c) => c
                .parse()
                .map(Some)
                .map_err(|_| std::io::Error::other(format!("bad child pid {c:?}"))),
            None => Ok(None),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // No such file: the process is gone, or the kernel lacks it.
            std::fs::metadata(format!("/proc/{outer}"))?;
            let ppid = format!("{outer}");
            Ok(std::fs::read_dir("/proc")?.flatten().find_map(|e| {
                let pid: u32 = e.file_name().to_str()?.parse().ok()?;
                let st = std::fs::read_to_string(e.path().join("status")).ok()?;
                let pp = st.lines().find_map(|l| l.strip_prefix("PPid:"))?.trim();
                (pp == ppid).then_some(pid)
            }))
        }
        Err(e) => Err(e),
    }
}
