//! What the calling thread holds now, read with syscalls only (a jailed
//! process has no `/proc`): for a VM process to report its jail, and for
//! the tests to check it from inside.

use rustix::process::Resource;
use rustix::thread::CapabilitySet;

/// The credentials, capabilities and limits of the calling thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JailStatus {
    /// Real and effective uid.
    pub uid: (u32, u32),
    /// Real and effective gid.
    pub gid: (u32, u32),
    /// Supplementary groups.
    pub groups: usize,
    /// Effective, permitted and inheritable capabilities (bit masks).
    pub caps: (u64, u64, u64),
    /// Capabilities left in the bounding set (bit mask).
    pub bounding: u64,
    /// Capabilities in the ambient set (bit mask).
    pub ambient: u64,
    /// `no_new_privs`.
    pub no_new_privs: bool,
    /// The pid, as this process's pid namespace numbers it.
    pub pid: i32,
    /// Hard limits: `RLIMIT_NOFILE`, `RLIMIT_AS`, `RLIMIT_NPROC`,
    /// `RLIMIT_FSIZE`, `RLIMIT_CORE` (`None`: unlimited).
    pub limits: [Option<u64>; 5],
    /// `RLIMIT_RTPRIO` (hard), `RLIMIT_RTTIME` soft and hard (µs).
    pub rt_limits: [Option<u64>; 3],
}

impl JailStatus {
    /// Reads it.
    pub fn current() -> Self {
        let caps = rustix::thread::capabilities(None).ok();
        let mut bounding = 0;
        let mut ambient = 0;
        for c in 0..64u32 {
            let cap = CapabilitySet::from_bits_retain(1 << c);
            if rustix::thread::capability_is_in_bounding_set(cap).unwrap_or(false) {
                bounding |= 1 << c;
            }
            if rustix::thread::capability_is_in_ambient_set(cap).unwrap_or(false) {
                ambient |= 1 << c;
            }
        }
        let hard = |r| rustix::process::getrlimit(r).maximum;
        Self {
            uid: (
                rustix::process::getuid().as_raw(),
                rustix::process::geteuid().as_raw(),
            ),
            gid: (
                rustix::process::getgid().as_raw(),
                rustix::process::getegid().as_raw(),
            ),
            groups: rustix::process::getgroups().map_or(usize::MAX, |g| g.len()),
            caps: caps.map_or((u64::MAX, u64::MAX, u64::MAX), |c| {
                (c.effective.bits(), c.permitted.bits(), c.inheritable.bits())
            }),
            bounding,
            ambient,
            no_new_privs: rustix::thread::no_new_privs().unwrap_or(false),
            pid: rustix::process::getpid().as_raw_nonzero().get(),
            limits: [
                hard(Resource::Nofile),
                hard(Resource::As),
                hard(Resource::Nproc),
                hard(Resource::Fsize),
                hard(Resource::Core),
            ],
            rt_limits: [
                hard(Resource::Rtprio),
                rustix::process::getrlimit(Resource::Rttime).current,
                hard(Resource::Rttime),
            ],
        }
    }
}
