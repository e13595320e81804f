//! The VM process's configuration: the daemon's [`VmSpec`] and the files
//! passed with it become the [`VmConfig`] this process runs, with its
//! throttle groups (over the class pages it was given) and the peer side of
//! the daemon's scheduler gate.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use corral_blkthrottle::ThrottleGroup;
use corral_scheduler::Gate;

use super::{VmProcessError, start_failed};
use crate::hostfile::{HostFile, HostImage};
use crate::vm::{KernelSource, VmConfig};
use crate::vmproc::proto::{GroupSpec, PassedFile, VmSpec};

/// What [`configure`] made of the daemon's configuration.
pub(super) struct Configured {
    /// The VM.
    pub cfg: VmConfig,
    /// Its throttle groups, by name.
    pub groups: BTreeMap<String, ThrottleGroup>,
    /// The peer side of the daemon's scheduler gate and its memfd.
    pub sched_gate: Option<(Arc<Gate>, OwnedFd)>,
}

/// The VM of `spec`, over the files `fds` that came with it (`builtin`:
/// the binary's built-in guest). Every failure is told to the daemon on
/// `sock` (`StartFailed`).
pub(super) fn configure(
    spec: &VmSpec,
    fds: Vec<OwnedFd>,
    builtin: Arc<[u8]>,
    sock: &OwnedFd,
) -> Result<Configured, VmProcessError> {
    let mut fds: Vec<Option<OwnedFd>> = fds.into_iter().map(Some).collect();
    // The class groups' shared pages, by index.
    let mut pages: BTreeMap<usize, OwnedFd> = spec
        .disks
        .iter()
        .filter_map(|d| d.group.as_ref()?.page)
        .filter_map(|i| Some((i, fds.get_mut(i)?.take()?)))
        .collect();
    let mut take_fd = |i: usize| {
        fds.get_mut(i)
            .and_then(Option::take)
            .ok_or_else(|| start_failed(sock, format!("file {i} was not passed")))
    };
    let mut take = |f: &PassedFile| -> Result<HostFile, VmProcessError> {
        HostFile::from_passed(std::fs::File::from(take_fd(f.fd)?), f.path.clone())
            .map_err(|e| start_failed(sock, e))
    };
    let kernel = match &spec.kernel {
        Some(f) => KernelSource::File(take(f)?),
        None => KernelSource::Bytes(builtin),
    };
    let mut cfg = VmConfig::new(&spec.name, kernel);
    cfg.initrd = match &spec.initrd {
        Some(f) => Some(HostImage::File(take(f)?)),
        None => None,
    };
    cfg.cmdline = spec.cmdline.clone();
    cfg.vcpus = spec.vcpus;
    cfg.memory_mib = spec.memory_mib;
    cfg.console_log_bytes = spec.console_log_bytes;
    cfg.acpi = spec.acpi;
    let now = crate::util::monotonic_ns();
    let mut groups = BTreeMap::new();
    for d in &spec.disks {
        let group = match &d.group {
            Some(g) => {
                let page = g.page.and_then(|i| pages.remove(&i));
                let x = group_for(&mut groups, g, now, page).map_err(|e| start_failed(sock, e))?;
                Some((x, g.weight))
            }
            None => None,
        };
        cfg.disks.push(crate::vm::DiskConfig {
            id: Some(d.id.clone()),
            path: d.file.path.clone(),
            read_only: d.read_only,
            direct: d.direct,
            limits: d.limits.into(),
            group,
            file: Some(take(&d.file)?),
            engine: d
                .engine
                .as_deref()
                .and_then(crate::vmproc::proto::engine_of),
        });
    }
    // The daemon's scheduler gate: its page is shared with the daemon,
    // which parks and unparks it and kicks the vCPU threads by host tid.
    let sched_gate = match spec.sched_gate {
        Some(i) => Some(peer_gate(take_fd(i)?).map_err(|e| start_failed(sock, e))?),
        None => None,
    };
    cfg.sched_gate = sched_gate.as_ref().map(|(g, _)| g.clone());
    Ok(Configured {
        cfg,
        groups,
        sched_gate,
    })
}

/// The peer side of the scheduler gate whose memfd the daemon passed, and
/// a copy of the fd (for the next daemon).
fn peer_gate(fd: OwnedFd) -> std::io::Result<(Arc<Gate>, OwnedFd)> {
    let kept = fd.try_clone()?;
    Ok((Gate::from_fd(fd)?, kept))
}

/// The process's throttle group `g.name`: attached to the shared page
/// passed with the message (`g.page`, its file here as `page`; a page replaces
/// the process's group of that name, e.g. for a daemon that re-adopted the
/// process), else the group of that name the process has, else a new group
/// of this process alone with `g.limits`.
pub(super) fn group_for(
    groups: &mut BTreeMap<String, ThrottleGroup>,
    g: &GroupSpec,
    now: u64,
    page: Option<OwnedFd>,
) -> Result<ThrottleGroup, VmProcessError> {
    let bad = |e: String| VmProcessError::Config(format!("group {}: {e}", g.name));
    let x = match page {
        Some(fd) => {
            let p = crate::iopage::IoPage::from_fd(&fd).map_err(|e| bad(e.to_string()))?;
            ThrottleGroup::attach(g.name.clone(), &g.limits.into(), now, p)
                .map_err(|e| bad(e.to_string()))?
        }
        None => {
            if let Some(x) = groups.get(&g.name) {
                return Ok(x.clone());
            }
            ThrottleGroup::new(g.name.clone(), &g.limits.into(), now)
                .map_err(|e| bad(e.to_string()))?
        }
    };
    groups.insert(g.name.clone(), x.clone());
    Ok(x)
}
