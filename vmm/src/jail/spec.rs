//! What a jail is made of: [`JailSpec`] (the files, the identity, the
//! namespaces, the limits) and the checks made on it before any step runs.

use std::os::fd::BorrowedFd;
use std::path::PathBuf;

use super::error::JailError;

/// The default range of per-VM uids (and gids, the same numbers):
/// `0xC000_0000 ..= 0xC000_FFFF`. Above every range systemd assigns
/// (dynamic users end at 65519, container ranges at 0x7FFF_FFFF) and below
/// the reserved `u32::MAX - 1` ("nobody" in some setups is 65534, far
/// below), so a jailed VM shares its uid with nothing else on the host.
pub const DEFAULT_UID_BASE: u32 = 0xC000_0000;
/// The number of uids in the default range.
pub const DEFAULT_UID_COUNT: u32 = 0x1_0000;

/// A range of uids for jailed VM processes, one per running VM: the uid
/// is also the gid. One uid per VM means `RLIMIT_NPROC` counts that VM's
/// threads alone, and no VM process can signal, ptrace or read the files
/// of another (their uids differ, and their pid namespaces hide them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UidRange {
    /// The first uid.
    pub base: u32,
    /// How many.
    pub count: u32,
}

impl Default for UidRange {
    fn default() -> Self {
        Self {
            base: DEFAULT_UID_BASE,
            count: DEFAULT_UID_COUNT,
        }
    }
}

impl UidRange {
    /// Parses `BASE:COUNT` (the `serve` option's form).
    pub fn parse(s: &str) -> Result<Self, JailError> {
        let bad = || JailError::Spec(format!("uid range {s:?}: expected BASE:COUNT"));
        let (b, c) = s.split_once(':').ok_or_else(bad)?;
        let r = Self {
            base: b.trim().parse().map_err(|_| bad())?,
            count: c.trim().parse().map_err(|_| bad())?,
        };
        r.check()?;
        Ok(r)
    }

    /// Refuses an empty range, one that holds uid 0, or one reaching
    /// `u32::MAX` (`(uid_t)-1` means "unchanged" to `setresuid`).
    pub fn check(&self) -> Result<(), JailError> {
        if self.count == 0 || self.base == 0 {
            return Err(JailError::Spec(format!(
                "uid range {}:{} must be non-empty and must not hold uid 0",
                self.base, self.count
            )));
        }
        match self.base.checked_add(self.count) {
            Some(end) if end < u32::MAX => Ok(()),
            _ => Err(JailError::Spec(format!(
                "uid range {}:{} reaches 4294967295, which setresuid reads as \"unchanged\"",
                self.base, self.count
            ))),
        }
    }

    /// The uid of slot `i`, if in range.
    pub fn get(&self, i: u32) -> Option<u32> {
        (i < self.count).then(|| self.base + i)
    }

    /// Whether `uid` is in the range.
    pub fn contains(&self, uid: u32) -> bool {
        uid >= self.base && uid - self.base < self.count
    }
}

/// One file of the VM (kernel, initrd, disk image), already open: it is
/// bind-mounted from its fd to `/NAME` in the private root.
#[derive(Debug, Clone)]
pub struct JailFile<'a> {
    /// Its name in the private root (one path component).
    pub name: String,
    /// The open file (the VM keeps using this fd; the mount is what the
    /// jailed process can reach by path).
    pub fd: BorrowedFd<'a>,
    /// Mounted read-only (a read-only disk, the kernel, the initrd).
    pub read_only: bool,
}

/// The namespaces a jail creates besides the mount namespace (always new).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Namespaces {
    /// A pid namespace: the VM process is its pid 1 (see
    /// [`crate::jail::enter`] for the fork this needs).
    pub pid: bool,
    /// System V IPC and POSIX message queues.
    pub ipc: bool,
    /// A network namespace with only a loopback device, down.
    pub net: bool,
    /// Host and domain name.
    pub uts: bool,
}

impl Default for Namespaces {
    fn default() -> Self {
        Self {
            pid: true,
            ipc: true,
            net: true,
            uts: true,
        }
    }
}

/// Resource limits, each set as both the soft and the hard limit (the
/// jailed process cannot raise them again).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JailLimits {
    /// `RLIMIT_NOFILE`: the highest fd number + 1.
    pub nofile: u64,
    /// `RLIMIT_AS` in bytes (`None`: unlimited).
    pub address_space: Option<u64>,
    /// `RLIMIT_NPROC`: tasks (threads count) of the VM's uid.
    pub nproc: u64,
    /// `RLIMIT_FSIZE` in bytes (`None`: unlimited).
    pub fsize: Option<u64>,
}

/// Address space a VM process needs beyond guest RAM. Measured (`corral
/// run`, probe `spin`, 128 MiB): VmSize = guest + 155 MiB with 1 vCPU
/// (peak + 213 MiB: code, glibc's malloc arenas of 64 MiB reserved each,
/// thread stacks), + 64 MiB per further vCPU. A jailed `corral vmm` of
/// `corral serve` (128 MiB, 2 vCPUs, its control and console threads):
/// VmSize guest + 415 MiB, peak + 479 MiB. 1 GiB leaves twice that; the
/// limit is there against a runaway (a guest-driven allocation), not to
/// be tight.
pub const AS_MARGIN: u64 = 1 << 30;
/// Address space per vCPU thread: its malloc arena (64 MiB reserved), its
/// stack (2 MiB) and its `kvm_run` mapping, rounded up.
pub const AS_PER_VCPU: u64 = 80 << 20;

impl JailLimits {
    /// Limits sized for a VM: address space = guest RAM + [`AS_MARGIN`] +
    /// [`AS_PER_VCPU`] per vCPU; fds = 128 + 4 per vCPU + 8 per disk (a
    /// vCPU fd; a disk's file, ioeventfd, irqfd, timerfd and its ring; the
    /// base: the VM and KVM fds, eventfds, the control sockets and their
    /// connections); tasks = vCPUs + 16 (device, main and control
    /// threads, the outer process of a pid namespace); the largest file it
    /// may write = the largest writable image, at least 1 GiB (its stderr
    /// may be a daemon's log file: a write past the limit fails with
    /// EFBIG, SIGXFSZ is ignored in the jail, so it never kills the VM).
    pub fn for_vm(memory_mib: u64, vcpus: u32, disks: u32, largest_writable: u64) -> Self {
        Self {
            nofile: 128 + 4 * u64::from(vcpus) + 8 * u64::from(disks),
            address_space: Some(
                (memory_mib << 20)
                    .saturating_add(AS_MARGIN)
                    .saturating_add(AS_PER_VCPU * u64::from(vcpus)),
            ),
            nproc: u64::from(vcpus) + 16,
            fsize: Some(largest_writable.max(1 << 30)),
        }
    }
}

/// Everything a jail is built from. The caller opened the files; `enter`
/// opens `/dev/kvm` itself (it must be a character device).
#[derive(Debug, Clone)]
pub struct JailSpec<'a> {
    /// The host name in the new UTS namespace (at most 64 bytes).
    pub hostname: String,
    /// The VM's files, mounted at `/NAME` in the private root.
    pub files: Vec<JailFile<'a>>,
    /// The KVM device, opened before privileges are dropped and mounted at
    /// `/dev/kvm` (default `/dev/kvm`).
    pub kvm_path: PathBuf,
    /// An existing directory the private root (a tmpfs) is mounted on
    /// before `pivot_root`; hidden only inside the new mount namespace
    /// (default `/tmp`).
    pub staging: PathBuf,
    /// The unprivileged uid (also used for `setresuid`).
    pub uid: u32,
    /// The unprivileged gid.
    pub gid: u32,
    /// Namespaces besides the mount namespace.
    pub namespaces: Namespaces,
    /// Resource limits.
    pub limits: JailLimits,
}

impl<'a> JailSpec<'a> {
    /// A spec with the defaults: `/dev/kvm`, staging on `/tmp`, every
    /// namespace, the limits of a 128 MiB 1-vCPU VM.
    pub fn new(hostname: impl Into<String>, uid: u32, gid: u32) -> Self {
        Self {
            hostname: hostname.into(),
            files: Vec::new(),
            kvm_path: PathBuf::from("/dev/kvm"),
            staging: PathBuf::from("/tmp"),
            uid,
            gid,
            namespaces: Namespaces::default(),
            limits: JailLimits::for_vm(128, 1, 0, 0),
        }
    }

    /// Checks the spec before any step runs.
    pub fn check(&self) -> Result<(), JailError> {
        for (what, id) in [("uid", self.uid), ("gid", self.gid)] {
            if id == 0 || id == u32::MAX {
                return Err(JailError::Spec(format!(
                    "{what} {id} is not an unprivileged id (0 is root; 4294967295 means \
                     \"unchanged\" to setresuid)"
                )));
            }
        }
        if self.hostname.is_empty() || self.hostname.len() > 64 {
            return Err(JailError::Spec(format!(
                "host name {:?} must be 1..=64 bytes",
                self.hostname
            )));
        }
        let mut seen = std::collections::HashSet::new();
        for f in &self.files {
            let n = f.name.as_str();
            if n.is_empty()
                || n == "."
                || n == ".."
                || n == "dev"
                || n.contains('/')
                || n.contains('\0')
                || n.len() > 200
            {
                return Err(JailError::Spec(format!(
                    "file name {n:?} must be one path component other than ., .. and dev"
                )));
            }
            if !seen.insert(n) {
                return Err(JailError::Spec(format!("two files are named {n:?}")));
            }
        }
        if self.limits.nofile < 16 || self.limits.nproc < 2 {
            return Err(JailError::Spec(format!(
                "limits too small to run a VM: nofile {} (at least 16), nproc {} (at least 2)",
                self.limits.nofile, self.limits.nproc
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uid_ranges_refuse_root_and_the_unchanged_id() {
        assert_eq!(
            UidRange::parse("100000:10").unwrap(),
            UidRange {
                base: 100000,
                count: 10
            }
        );
        for bad in ["0:10", "5:0", "4294967290:5", "4294967295:1", "x:1", "10"] {
            assert!(UidRange::parse(bad).is_err(), "{bad}");
        }
        let r = UidRange::default();
        assert!(r.check().is_ok());
        assert_eq!(r.get(0), Some(DEFAULT_UID_BASE));
        assert_eq!(r.get(DEFAULT_UID_COUNT), None);
        assert!(r.contains(DEFAULT_UID_BASE + 5) && !r.contains(DEFAULT_UID_BASE - 1));
    }

    #[test]
    fn specs_refuse_privileged_ids_and_bad_names() {
        assert!(JailSpec::new("vm", 1000, 1000).check().is_ok());
        for (u, g) in [(0, 1000), (1000, 0), (u32::MAX, 1000), (1000, u32::MAX)] {
            assert!(JailSpec::new("vm", u, g).check().is_err(), "{u} {g}");
        }
        let f = std::fs::File::open("/dev/null").unwrap();
        for name in ["", ".", "..", "dev", "a/b"] {
            let mut s = JailSpec::new("vm", 1000, 1000);
            s.files.push(JailFile {
                name: name.into(),
                fd: std::os::fd::AsFd::as_fd(&f),
                read_only: true,
            });
            assert!(s.check().is_err(), "{name:?}");
        }
        let mut s = JailSpec::new("vm", 1000, 1000);
        for _ in 0..2 {
            s.files.push(JailFile {
                name: "disk".into(),
                fd: std::os::fd::AsFd::as_fd(&f),
                read_only: true,
            });
        }
        assert!(s.check().is_err());
    }
}
