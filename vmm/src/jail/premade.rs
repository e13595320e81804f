//! Namespaces a VM process's spawner made for it ahead of time
//! (`vmproc::nspool`: a network, IPC and UTS namespace, moved into between
//! `clone` and `exec`; `corral vmm --jail-ns net,ipc,uts` says so).
//! [`crate::jail::enter`] does not make those kinds again, after checking
//! that each is not its spawner's own: a spawner that claimed a namespace
//! it did not make would otherwise leave the VM in the daemon's network.

use std::sync::OnceLock;

use super::error::{JailError, Step};
use super::spec::Namespaces;

static MADE: OnceLock<Namespaces> = OnceLock::new();

/// Records the kinds named by `list` (`net,ipc,uts`, comma-separated) as
/// made for this process by its spawner. Once per process, before
/// [`crate::jail::enter`].
pub fn spawned_in(list: &str) -> Result<(), JailError> {
    let mut ns = Namespaces {
        pid: false,
        ipc: false,
        net: false,
        uts: false,
    };
    for k in list.split(',') {
        match k {
            "net" => ns.net = true,
            "ipc" => ns.ipc = true,
            "uts" => ns.uts = true,
            other => {
                return Err(JailError::Spec(format!(
                    "--jail-ns: unknown namespace kind {other:?} (net, ipc, uts)"
                )));
            }
        }
    }
    MADE.set(ns)
        .map_err(|_| JailError::Spec("--jail-ns given twice".into()))
}

/// This process's parent as the host numbers it (`/proc/self/stat` of the
/// host's `/proc`: in a pid namespace `getppid` is 0).
fn parent() -> std::io::Result<u32> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok())
        .ok_or_else(|| std::io::Error::other("no ppid in /proc/self/stat"))
}

/// The kinds made for this process, each checked to be another namespace
/// than its parent's (`/proc/PID/ns/KIND` links differ). None made: all
/// false.
pub(super) fn checked() -> Result<Namespaces, JailError> {
    let Some(made) = MADE.get().copied() else {
        return Ok(Namespaces {
            pid: false,
            ipc: false,
            net: false,
            uts: false,
        });
    };
    let step = |k: &str| Step::Unshare(format!("{k} (made by the spawner)"));
    let ppid = parent().map_err(super::error::at(step("net, ipc, uts")))?;
    for (on, k) in [(made.net, "net"), (made.ipc, "ipc"), (made.uts, "uts")] {
        if !on {
            continue;
        }
        let ours = std::fs::read_link(format!("/proc/self/ns/{k}"));
        let theirs = std::fs::read_link(format!("/proc/{ppid}/ns/{k}"));
        match (ours, theirs) {
            (Ok(a), Ok(b)) if a != b => {}
            (Ok(_), Ok(_)) => {
                return Err(JailError::Step {
                    step: step(k),
                    source: std::io::Error::other("it is the spawner's own namespace"),
                });
            }
            (Err(e), _) | (_, Err(e)) => return Err(super::error::at(step(k))(e)),
        }
    }
    Ok(made)
}
