//! Resource limits, the unprivileged identity, capabilities and
//! `no_new_privs`, and the check that nothing privileged is left.

use rustix::io::Errno;
use rustix::process::{Resource, Rlimit};
use rustix::thread::{CapabilitySet, CapabilitySets};

use super::error::{JailError, Step, at};
use super::spec::JailLimits;

fn set(resource: Resource, name: &'static str, v: Option<u64>) -> Result<(), JailError> {
    rustix::process::setrlimit(
        resource,
        Rlimit {
            current: v,
            maximum: v,
        },
    )
    .map_err(at(Step::Rlimit(name)))
}

/// Sets the limits, soft = hard, and `RLIMIT_CORE` to 0 (no core file of
/// guest memory), then the real-time ones ([`set_rt_limits`]). A write
/// past `RLIMIT_FSIZE` fails with EFBIG: SIGXFSZ is ignored, so that a
/// long log file on stderr cannot kill the VM.
pub(super) fn set_limits(l: &JailLimits) -> Result<(), JailError> {
    if l.fsize.is_some() {
        // SAFETY: SIG_IGN installs no handler; no code runs on the signal.
        unsafe {
            nix::sys::signal::signal(
                nix::sys::signal::Signal::SIGXFSZ,
                nix::sys::signal::SigHandler::SigIgn,
            )
        }
        .map_err(at(Step::Rlimit("RLIMIT_FSIZE")))?;
    }
    set(Resource::Nofile, "RLIMIT_NOFILE", Some(l.nofile))?;
    set(Resource::As, "RLIMIT_AS", l.address_space)?;
    set(Resource::Nproc, "RLIMIT_NPROC", Some(l.nproc))?;
    set(Resource::Fsize, "RLIMIT_FSIZE", l.fsize)?;
    set(Resource::Core, "RLIMIT_CORE", Some(0))?;
    set_rt_limits().map(drop)
}

/// `RLIMIT_RTPRIO` of a jailed VM process: its device threads may take
/// `SCHED_FIFO` priority 1 (the lowest) for a tight throttle wait
/// (`devices/src/virtio/blk/throttle.rs`), nothing higher.
pub const RTPRIO: u64 = 1;
/// `RLIMIT_RTTIME` soft limit (µs): CPU time a real-time thread may use
/// without blocking before the kernel sends SIGXCPU. A boosted device
/// thread blocks on its timer or spins at most `EARLY_MAX_NS` (1 ms)
/// before it is admitted and drops the boost: 200× that.
pub const RTTIME_SOFT_US: u64 = 200_000;
/// `RLIMIT_RTTIME` hard limit (µs): past it the kernel sends SIGKILL,
/// which no handler and no pid namespace can ignore.
pub const RTTIME_HARD_US: u64 = 1_000_000;

/// Sets `RLIMIT_RTTIME` (soft [`RTTIME_SOFT_US`], hard [`RTTIME_HARD_US`])
/// and `RLIMIT_RTPRIO` = [`RTPRIO`] (soft = hard). Raising the hard
/// `RLIMIT_RTPRIO` from 0 needs `CAP_SYS_RESOURCE`; a host that withheld it
/// from the spawner (a container) keeps the inherited limit, with a
/// warning: the VM runs, its throttle waits go without the boost. Returns
/// whether `RLIMIT_RTPRIO` is [`RTPRIO`].
pub(super) fn set_rt_limits() -> Result<bool, JailError> {
    rustix::process::setrlimit(
        Resource::Rttime,
        Rlimit {
            current: Some(RTTIME_SOFT_US),
            maximum: Some(RTTIME_HARD_US),
        },
    )
    .map_err(at(Step::Rlimit("RLIMIT_RTTIME")))?;
    let had = rustix::process::getrlimit(Resource::Rtprio);
    match set(Resource::Rtprio, "RLIMIT_RTPRIO", Some(RTPRIO)) {
        Ok(()) => Ok(true),
        Err(_) if had.maximum.is_some_and(|m| m < RTPRIO) => {
            tracing::warn!(
                "jail: cannot raise RLIMIT_RTPRIO to {RTPRIO} (hard limit {:?}, no \
                 CAP_SYS_RESOURCE): tight throttle waits will not be boosted",
                had.maximum
            );
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// Calls `f` with each capability number from 0 up until it answers
/// EINVAL, the kernel's "no such capability" (past 40 on this host's 6.18),
/// and returns how many numbers the kernel knows. One call per number: no
/// separate query of the last one first.
fn each_cap(
    mut f: impl FnMut(CapabilitySet) -> rustix::io::Result<()>,
    step: impl Fn(u32) -> Step,
) -> Result<u32, JailError> {
    for c in 0..64u32 {
        match f(CapabilitySet::from_bits_retain(1 << c)) {
            Ok(()) => {}
            Err(Errno::INVAL) if c > 0 => return Ok(c),
            Err(e) => return Err(at(step(c))(e)),
        }
    }
    Ok(64)
}

/// Drops the bounding and ambient sets (which needs CAP_SETPCAP, so
/// first), the supplementary groups, then gid and uid (real, effective and
/// saved: no way back), clears the capability sets and sets
/// `no_new_privs`. The process must have one thread: these calls change
/// the calling thread's credentials only.
pub(super) fn drop_privileges(uid: u32, gid: u32) -> Result<(), JailError> {
    // PR_CAPBSET_DROP of a capability not in the set succeeds: each number
    // is dropped without reading it first (41 prctl calls, not 121).
    each_cap(
        rustix::thread::remove_capability_from_bounding_set,
        Step::BoundingSet,
    )?;
    rustix::thread::clear_ambient_capability_set().map_err(at(Step::AmbientCaps))?;
    rustix::thread::set_thread_groups(&[]).map_err(at(Step::Groups))?;
    // `JailSpec::check` refused 0 and u32::MAX ("unchanged").
    let (u, g) = (
        rustix::process::Uid::from_raw(uid),
        rustix::process::Gid::from_raw(gid),
    );
    rustix::thread::set_thread_res_gid(g, g, g).map_err(at(Step::SetGid(gid)))?;
    rustix::thread::set_thread_res_uid(u, u, u).map_err(at(Step::SetUid(uid)))?;
    // A uid change from 0 clears the permitted and effective sets already;
    // clear all three explicitly, whatever the securebits were.
    rustix::thread::set_capabilities(
        None,
        CapabilitySets {
            effective: CapabilitySet::empty(),
            permitted: CapabilitySet::empty(),
            inheritable: CapabilitySet::empty(),
        },
    )
    .map_err(at(Step::Capabilities))?;
    rustix::thread::set_no_new_privs(true).map_err(at(Step::NoNewPrivs))
}

/// Checks that the drop took: the ids, no groups, no capability in any
/// set, `no_new_privs`, and that uid 0 cannot be taken back.
pub(super) fn verify(uid: u32, gid: u32) -> Result<(), JailError> {
    let bad = |what: String| Err(JailError::Verify(what));
    let ids = (
        rustix::process::getuid().as_raw(),
        rustix::process::geteuid().as_raw(),
        rustix::process::getgid().as_raw(),
        rustix::process::getegid().as_raw(),
    );
    if ids != (uid, uid, gid, gid) {
        return bad(format!("ids (uid, euid, gid, egid) are {ids:?}"));
    }
    match rustix::process::getgroups() {
        Ok(g) if g.is_empty() => {}
        Ok(g) => return bad(format!("{} supplementary groups", g.len())),
        Err(e) => return Err(at(Step::Verify)(e)),
    }
    let c = rustix::thread::capabilities(None).map_err(at(Step::Verify))?;
    if !(c.effective.is_empty() && c.permitted.is_empty() && c.inheritable.is_empty()) {
        return bad(format!("capabilities {c:?}"));
    }
    let in_set = |what: &'static str, cap: CapabilitySet, v: bool| match v {
        false => Ok(()),
        true => Err(JailError::Verify(format!(
            "capability {} in the {what} set",
            cap.bits().trailing_zeros()
        ))),
    };
    let mut bad_cap = None;
    let known = each_cap(
        |cap| {
            let v = rustix::thread::capability_is_in_bounding_set(cap)?;
            if let Err(e) = in_set("bounding", cap, v) {
                bad_cap.get_or_insert(e);
            }
            Ok(())
        },
        |_| Step::Verify,
    )?;
    if let Some(e) = bad_cap {
        return Err(e);
    }
    for n in 0..known {
        let cap = CapabilitySet::from_bits_retain(1 << n);
        let v = rustix::thread::capability_is_in_ambient_set(cap).map_err(at(Step::Verify))?;
        in_set("ambient", cap, v)?;
    }
    if !rustix::thread::no_new_privs().map_err(at(Step::Verify))? {
        return bad("no_new_privs is not set".into());
    }
    // The saved uid is checked by trying to take root back.
    let root = rustix::process::Uid::ROOT;
    if rustix::thread::set_thread_res_uid(root, root, root).is_ok() {
        return bad("setresuid(0) succeeded".into());
    }
    Ok(())
}
