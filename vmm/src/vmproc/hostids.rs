//! A VM process's ids as the host numbers them ([`host_ids`]). A jailed
//! VM process runs in a pid namespace of its own: the pid and thread ids it
//! reports (`getpid`, `gettid`) are that namespace's (it is pid 1). The
//! launcher clones it into that namespace (`vmproc::spawn`), so the
//! process it started is the one that runs the VM; a jail that forks
//! itself (`jail::enter` in a process that is not pid 1) leaves an outer
//! process in between, whose child runs the VM. The daemon signals threads (`tgkill`), reads their
//! `/proc/TID` files, places them in cgroups and records the pid for the
//! next daemon by host ids only: each goes through here once, when the
//! daemon attaches to the process (at start, and when it re-adopts it).

use super::proto::Status;

/// A VM process seen from the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostIds {
    /// The process its launcher started, which the launcher reaps and
    /// kills: the VM process, or the outer process of a jail that forked
    /// (SIGKILL of it ends the VM too).
    pub outer: u32,
    /// The process that runs the VM (its vCPU and device threads), in the
    /// host's pid namespace: what the API and the state file report.
    pub pid: u32,
    /// The vCPU threads' host tids, in vCPU order.
    pub vcpu_tids: Vec<libc::pid_t>,
    /// The device thread's host tid.
    pub device_tid: Option<libc::pid_t>,
}

/// The host ids of the VM process behind `outer` (the pid its launcher
/// reported, or the peer of its control socket), from what it `reported`
/// about itself. Only `/proc` is believed: the process that runs the VM is
/// `outer`'s child (or `outer`), and a reported thread id counts only if it
/// is one of that process's threads (`NSpid` of `/proc/PID/task/*/status`),
/// so a VM process that lies can name none but its own threads. A reported
/// thread that is not there is left out, not an error: a VM whose guest
/// fails at once (a vCPU fault) has ended its threads by the time the
/// daemon looks, and must still be created to show `failed`. Fails only if
/// the process itself is not found.
pub fn host_ids(outer: u32, reported: &Status) -> std::io::Result<HostIds> {
    let view = crate::jail::host_view(outer)?;
    let map = |t: libc::pid_t| -> Option<libc::pid_t> {
        let h = u32::try_from(t)
            .ok()
            .and_then(|t| view.host_tid(t))
            .and_then(|h| libc::pid_t::try_from(h).ok())
            // 0 and below are never a thread (0 would name the caller).
            .filter(|&h| h > 0);
        if h.is_none() {
            tracing::debug!(
                tid = t,
                pid = view.pid,
                "a thread the VM process reported is not one of its own (gone, or never was)"
            );
        }
        h
    };
    Ok(HostIds {
        outer,
        pid: view.pid,
        vcpu_tids: reported.vcpu_tids.iter().filter_map(|&t| map(t)).collect(),
        device_tid: reported.device_tid.and_then(map),
    })
}
