//! The `cgroup` CPU backend: the same classes as the `gate` backend, applied
//! through Linux cgroups so the two can be compared on one workload.
//!
//! Layout: `<cpu controller>/corral-<instance>/<class>/<vm>/`, vCPU threads in
//! the VM's group; a child class's group is inside its parent's
//! (`.../<tenant>/<class>/<vm>/`), so nested groups divide CPU by weight at
//! every level, as the gate backend's class tree does. Class arguments are
//! paths from the root class, `/`-separated. Classes get their shares as `cpu.weight` (v2, 1..10000: the
//! same scale) or `cpu.shares` (v1, shares × 10, so 1..10000 → 10..100000),
//! their cap as `cpu.max` / `cpu.cfs_quota_us` over a 100 ms period; a VM's
//! weight inside its class becomes the weight of its own group, and its own
//! cap (if any) the `cpu.max` / `cpu.cfs_quota_us` of that group. cgroups have no
//! CPU *minimum*: reservations are enforced only by the gate backend (the
//! cgroup backend still honours them in admission control).
//!
//! Two placements ([`Placement`]), one per daemon:
//!
//! - [`Placement::Processes`] (`--vm-mode process`, the default): each VM is
//!   a process of its own, and the whole process goes into its VM's group
//!   (`cgroup.procs`): vCPU threads, the device thread (which does the VM's
//!   I/O work: the gate backend charges it to the VM too) and the small
//!   control, console and accept threads. Placement is race-free: the daemon
//!   writes the new process's pid into `cgroup.procs` after the launcher has
//!   spawned it and before it sends the VM's configuration (`Hello`), which
//!   the process waits for before it jails itself or starts any thread; every
//!   thread it starts later (and the child of its pid-namespace fork) is born
//!   in the group. Groups are ordinary domain groups in v2 (VM groups are the
//!   leaves: no process in a group with children, the v2 rule).
//! - [`Placement::Threads`] (`--vm-mode thread`): the VM's threads live in the
//!   daemon, so its vCPU and device threads are placed by tid. cgroup v2
//!   needs thread-granular placement (`cgroup.type = threaded`) for that; v1
//!   places thread ids directly in `tasks`.
//!
//! Instance names: a daemon with a state directory uses one derived from the
//! directory ([`instance_name`]), so a restarted daemon finds the groups its
//! VM processes are in, and two daemons on different state directories never
//! share a group.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Which cgroup interface is in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// Unified hierarchy.
    V2,
    /// Legacy `cpu` controller.
    V1,
}

/// Errors of the cgroup backend.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// No usable cpu controller.
    #[error(
        "no cgroup cpu controller found (looked for cgroup v2 with 'cpu' in cgroup.controllers and for a v1 'cpu' hierarchy)"
    )]
    NotFound,
    /// A file operation failed.
    #[error("cgroup {path}: {err}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        err: io::Error,
    },
    /// A name that cannot be a directory.
    #[error("invalid cgroup name {0:?}")]
    BadName(String),
    /// A v2 group without the cpu controller: its `cpu.weight` / `cpu.max`
    /// do not exist (creating them fails with EACCES, which is all the
    /// kernel says).
    #[error(
        "cgroup v2 group {0} has no cpu controller ('cpu' is not in its parent's cgroup.subtree_control; where v1 hierarchies hold the cpu controller, v2 cannot have it)"
    )]
    NoCpuController(String),
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> CgroupError + '_ {
    move |err| CgroupError::Io {
        path: path.display().to_string(),
        err,
    }
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    fs::write(path, value).map_err(io_at(path))
}

fn check_name(n: &str) -> Result<&str, CgroupError> {
    if n.is_empty()
        || n.len() > 200
        || n.starts_with('.')
        || !n
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(CgroupError::BadName(n.to_string()));
    }
    Ok(n)
}

/// Period used for caps.
pub const PERIOD_US: u64 = 100_000;

/// What a VM's group holds (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// The VM's threads in the daemon's process, placed by tid.
    Threads,
    /// The VM's whole process, placed by pid.
    Processes,
}

/// The instance name of a daemon's groups (`corral-<instance>`): with a
/// state directory, `state-` and 16 hex digits of a hash (FNV-1a, fixed
/// here so that another build finds the same groups) of its absolute,
/// canonical path, so the VM processes that outlive a daemon are found by
/// the next one on that directory; without one, the daemon's pid (its VMs
/// end with it).
pub fn instance_name(state_dir: Option<&Path>) -> String {
    let Some(dir) = state_dir else {
        return std::process::id().to_string();
    };
    let dir = fs::canonicalize(dir)
        .or_else(|_| std::path::absolute(dir))
        .unwrap_or_else(|_| dir.to_path_buf());
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in std::os::unix::ffi::OsStrExt::as_bytes(dir.as_os_str()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("state-{h:016x}")
}

/// A corral-owned subtree of the cpu controller.
#[derive(Debug)]
pub struct CgroupBackend {
    root: PathBuf,
    version: CgroupVersion,
    placement: Placement,
}

impl CgroupBackend {
    /// Finds the cpu controller and creates `corral-<instance>` under it,
    /// for VMs placed by thread ([`Placement::Threads`]).
    pub fn new(instance: &str) -> Result<Self, CgroupError> {
        Self::open(instance, Placement::Threads)
    }

    /// Finds the cpu controller and creates (or finds, after a restart)
    /// `corral-<instance>` under it.
    pub fn open(instance: &str, placement: Placement) -> Result<Self, CgroupError> {
        let (base, version) = detect().ok_or(CgroupError::NotFound)?;
        Self::open_at(&base, version, instance, placement)
    }

    /// [`Self::open`] in the hierarchy mounted at `base` (its root, of
    /// `version`) rather than the one [`detect`] finds: a test's own
    /// cgroup2 mount, or a fake cgroupfs in a temp dir.
    ///
    /// v2 with [`Placement::Threads`]: a thread can move only within its
    /// process's threaded domain (`cgroup.threads` fails with EOPNOTSUPP
    /// across domains), so the calling process (the daemon, whose threads
    /// the VMs' are) moves into `corral-<instance>` first, which becomes
    /// the domain of the threaded class and VM groups below it.
    pub fn open_at(
        base: &Path,
        version: CgroupVersion,
        instance: &str,
        placement: Placement,
    ) -> Result<Self, CgroupError> {
        let instance = check_name(instance)?;
        let root = base.join(format!("corral-{instance}"));
        if !root.exists() {
            fs::create_dir(&root).map_err(io_at(&root))?;
        }
        if version == CgroupVersion::V2 {
            // Let the cpu controller reach our groups.
            let _ = write(&base.join("cgroup.subtree_control"), "+cpu");
            let _ = write(&root.join("cgroup.subtree_control"), "+cpu");
            if placement == Placement::Threads {
                write(&root.join("cgroup.procs"), &std::process::id().to_string())?;
            }
        }
        Ok(Self {
            root,
            version,
            placement,
        })
    }

    /// How VMs are placed.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The interface in use.
    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// The backend's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Creates group `dir` if it is missing; `leaf`: a VM's group, which
    /// holds tasks and no groups.
    fn ensure_dir(&self, dir: &Path, leaf: bool) -> Result<(), CgroupError> {
        if !dir.exists() {
            fs::create_dir(dir).map_err(io_at(dir))?;
            if self.version == CgroupVersion::V2 {
                match self.placement {
                    Placement::Threads => {
                        write(&dir.join("cgroup.type"), "threaded")?;
                        // Child classes and VM groups below need the controller.
                        let _ = write(&dir.join("cgroup.subtree_control"), "+cpu");
                    }
                    // A domain group with a controller enabled below it
                    // cannot hold processes: only class groups get it.
                    Placement::Processes if !leaf => {
                        let _ = write(&dir.join("cgroup.subtree_control"), "+cpu");
                    }
                    Placement::Processes => {}
                }
            }
        }
        Ok(())
    }

    /// The group of VM `vm` in class `class` (a path from the root class).
    pub fn vm_dir(&self, class: &str, vm: &str) -> Result<PathBuf, CgroupError> {
        Ok(self.class_dir(class)?.join(check_name(vm)?))
    }

    /// The group of a class given by its path from the root class,
    /// `/`-separated (`tenant-a/a-web`; a root class is just its name).
    pub fn class_dir(&self, class_path: &str) -> Result<PathBuf, CgroupError> {
        let mut dir = self.root.clone();
        for part in class_path.split('/') {
            dir.push(check_name(part)?);
        }
        Ok(dir)
    }

    /// v2: the cpu controller's file `name` of group `dir`, which exists
    /// only where the controller is enabled for the group.
    fn cpu_file(dir: &Path, name: &str) -> Result<PathBuf, CgroupError> {
        let f = dir.join(name);
        if f.exists() || !dir.join("cgroup.controllers").exists() {
            // (No cgroup.controllers: not a cgroupfs, e.g. a test's fake.)
            return Ok(f);
        }
        Err(CgroupError::NoCpuController(dir.display().to_string()))
    }

    fn set_weight(&self, dir: &Path, weight: u32) -> Result<(), CgroupError> {
        let w = weight.clamp(1, 10_000);
        match self.version {
            CgroupVersion::V2 => write(&Self::cpu_file(dir, "cpu.weight")?, &w.to_string()),
            CgroupVersion::V1 => write(&dir.join("cpu.shares"), &(u64::from(w) * 10).to_string()),
        }
    }

    fn set_cap(&self, dir: &Path, cap_pct: Option<u32>) -> Result<(), CgroupError> {
        let quota = cap_pct.map(|c| u64::from(c.max(1)) * PERIOD_US / 100);
        match self.version {
            CgroupVersion::V2 => {
                let v = match quota {
                    Some(q) => format!("{q} {PERIOD_US}"),
                    None => format!("max {PERIOD_US}"),
                };
                write(&Self::cpu_file(dir, "cpu.max")?, &v)
            }
            CgroupVersion::V1 => {
                write(&dir.join("cpu.cfs_period_us"), &PERIOD_US.to_string())?;
                let q = quota.map(|q| q as i64).unwrap_or(-1);
                write(&dir.join("cpu.cfs_quota_us"), &q.to_string())
            }
        }
    }

    /// Creates or updates a class group.
    pub fn set_class(
        &self,
        class: &str,
        shares: u32,
        cap_pct: Option<u32>,
    ) -> Result<(), CgroupError> {
        let dir = self.class_dir(class)?;
        self.ensure_dir(&dir, false)?;
        self.set_weight(&dir, shares)?;
        self.set_cap(&dir, cap_pct)
    }

    /// Places a VM's vCPU threads in its group under `class`, with `weight`.
    pub fn place_vm(
        &self,
        class: &str,
        vm: &str,
        weight: u32,
        tids: &[libc::pid_t],
    ) -> Result<(), CgroupError> {
        let dir = self.vm_dir(class, vm)?;
        self.ensure_dir(&dir, true)?;
        self.set_weight(&dir, weight)?;
        self.add_threads(&dir, tids)
    }

    /// The file of a group that lists (and takes) its threads:
    /// `cgroup.threads` in v2, `tasks` in v1.
    fn tasks_file(&self) -> &'static str {
        match self.version {
            CgroupVersion::V2 => "cgroup.threads",
            CgroupVersion::V1 => "tasks",
        }
    }

    /// Threads `tids` into group `dir` (`cgroup.threads` of a threaded v2
    /// group, v1's `tasks`).
    fn add_threads(&self, dir: &Path, tids: &[libc::pid_t]) -> Result<(), CgroupError> {
        let file = dir.join(self.tasks_file());
        for tid in tids {
            write(&file, &tid.to_string())?;
        }
        Ok(())
    }

    /// Makes VM `vm`'s group under `class` (or finds it) with `weight` and
    /// the VM's own `cap`, before anything runs in it.
    pub fn prepare_vm(
        &self,
        class: &str,
        vm: &str,
        weight: u32,
        cap_pct: Option<u32>,
    ) -> Result<PathBuf, CgroupError> {
        let dir = self.vm_dir(class, vm)?;
        self.ensure_dir(&dir, true)?;
        self.set_weight(&dir, weight)?;
        self.set_cap(&dir, cap_pct)?;
        Ok(dir)
    }

    /// Moves whole processes into VM `vm`'s group under `class` (made by
    /// [`Self::prepare_vm`]): each id is written to `cgroup.procs`, which
    /// moves the thread group that the id (a pid, or any thread's tid)
    /// belongs to, all its threads at once. Ids are the host's (this
    /// process's pid namespace).
    pub fn add_processes(
        &self,
        class: &str,
        vm: &str,
        ids: &[libc::pid_t],
    ) -> Result<(), CgroupError> {
        let file = self.vm_dir(class, vm)?.join("cgroup.procs");
        for id in ids {
            write(&file, &id.to_string())?;
        }
        Ok(())
    }

    /// Removes the groups below the root that `keep` does not name (class
    /// and VM groups of a daemon before a restart whose classes or VMs are
    /// gone), deepest first; a kept group, or one that holds a live task,
    /// stays. A group whose every task is exiting (a VM process killed
    /// while no daemon ran: its threads leave the group one by one, a vCPU
    /// or the VM's memory can take a while) is retried for up to
    /// [`BUSY_GROUP_WAIT`]. Returns how many were removed.
    pub fn prune(&self, keep: &std::collections::BTreeSet<PathBuf>) -> usize {
        /// One pass; returns whether a group it could not remove is dying.
        fn walk(
            dir: &Path,
            keep: &std::collections::BTreeSet<PathBuf>,
            tasks: &str,
            n: &mut usize,
        ) -> bool {
            let mut dying = false;
            if let Ok(entries) = fs::read_dir(dir) {
                for e in entries.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        let p = e.path();
                        dying |= walk(&p, keep, tasks, n);
                        if keep.contains(&p) {
                            continue;
                        }
                        match fs::remove_dir(&p) {
                            Ok(()) => *n += 1,
                            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                                dying |= group_is_exiting(&p, tasks);
                            }
                            Err(_) => {}
                        }
                    }
                }
            }
            dying
        }
        let tasks = self.tasks_file();
        let deadline = std::time::Instant::now() + BUSY_GROUP_WAIT;
        let mut n = 0;
        while walk(&self.root, keep, tasks, &mut n) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        n
    }

    /// Sets or removes a VM's own cap on its group (`cpu.max` /
    /// `cpu.cfs_quota_us` over 100 ms), below its class's.
    pub fn set_vm_cap(
        &self,
        class: &str,
        vm: &str,
        cap_pct: Option<u32>,
    ) -> Result<(), CgroupError> {
        let dir = self.vm_dir(class, vm)?;
        self.set_cap(&dir, cap_pct)
    }

    /// Removes a VM's group (its threads must have exited or moved). A VM
    /// process leaves its group a moment after the daemon sees it end (its
    /// socket closes before its tasks leave the cgroup, and a jailed one's
    /// outer process exits after its child), so a busy group is retried for
    /// up to [`BUSY_GROUP_WAIT`].
    pub fn remove_vm(&self, class: &str, vm: &str) -> Result<(), CgroupError> {
        let dir = self.vm_dir(class, vm)?;
        let deadline = std::time::Instant::now() + BUSY_GROUP_WAIT;
        loop {
            match remove_dir_if_exists(&dir) {
                Err(CgroupError::Io { err, .. })
                    if err.raw_os_error() == Some(libc::EBUSY)
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                r => return r,
            }
        }
    }

    /// Removes a class group (its VM groups must be gone).
    pub fn remove_class(&self, class: &str) -> Result<(), CgroupError> {
        let dir = self.class_dir(class)?;
        remove_dir_if_exists(&dir)
    }

    /// Total CPU time consumed by a class group, in ns, if the controller reports it.
    pub fn class_usage_ns(&self, class: &str) -> Option<u64> {
        group_usage_ns(&self.class_dir(class).ok()?)
    }
}

/// CPU time used by the tasks of group `dir`, in ns: `usage_usec` of its
/// `cpu.stat` in v2 (the whole subtree, since it was made); in v1, whose
/// `cpu` controller counts no usage (`cpuacct` may be another hierarchy),
/// the run time of the threads now in the group and the groups below it
/// (`tasks`, then the first field of each `/proc/TID/schedstat`), which is
/// a thread's whole life, wherever it ran: compare two readings of
/// threads that stay in one group.
pub fn group_usage_ns(dir: &Path) -> Option<u64> {
    if let Ok(s) = fs::read_to_string(dir.join("cpu.stat"))
        && let Some(us) = s.lines().find_map(|l| l.strip_prefix("usage_usec "))
    {
        return us.trim().parse::<u64>().ok().map(|us| us * 1000);
    }
    let tasks = fs::read_to_string(dir.join("tasks")).ok()?;
    let mut ns = 0u64;
    for tid in tasks.lines() {
        let Ok(s) = fs::read_to_string(format!("/proc/{}/schedstat", tid.trim())) else {
            continue;
        };
        ns += s
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    for e in fs::read_dir(dir).ok()?.flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            ns += group_usage_ns(&e.path()).unwrap_or(0);
        }
    }
    Some(ns)
}

/// How long a VM's group that is still busy (its process has not left it
/// yet) is retried before it is left for the next daemon's prune: 200 ms
/// was too short on a loaded 2-CPU host (the group outlived a daemon's exit
/// in `cgroup_proc::groups_survive_a_daemon_kill9_and_stale_ones_are_removed`).
const BUSY_GROUP_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

impl CgroupBackend {
    /// Removes every group of this instance that holds no task (and the
    /// root, if all are gone): at the daemon's exit. Groups of VM processes
    /// that outlive the daemon stay, with their class groups above them.
    pub fn remove_empty(&self) {
        remove_groups(&self.root);
    }
}

impl Drop for CgroupBackend {
    fn drop(&mut self) {
        // Best effort: groups still holding threads stay until those exit.
        self.remove_empty();
    }
}

/// Removes a group and the groups below it, deepest first (best effort).
fn remove_groups(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten().filter(|e| e.path().is_dir()) {
            remove_groups(&e.path());
        }
    }
    let _ = fs::remove_dir(dir);
}

fn remove_dir_if_exists(dir: &Path) -> Result<(), CgroupError> {
    match fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(CgroupError::Io {
            path: dir.display().to_string(),
            err: e,
        }),
    }
}

/// Whether every task a group lists (`tasks`: `cgroup.threads` or v1's
/// `tasks`) is exiting (`PF_EXITING` in `/proc/TID/stat`'s flags, set at
/// the start of `do_exit`; zombies keep it) or gone, and it lists one: a
/// group that will be empty soon. A task of another pid namespace's view,
/// or one whose stat cannot be read, counts as exiting only if gone.
fn group_is_exiting(dir: &Path, tasks: &str) -> bool {
    let Ok(list) = fs::read_to_string(dir.join(tasks)) else {
        return false;
    };
    let mut any = false;
    for tid in list.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
        any = true;
        match task_is_exiting(tid) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Ok(true) => {}
            _ => return false,
        }
    }
    any
}

/// Whether task `tid` has `PF_EXITING` in the flags of `/proc/TID/stat`
/// (false if they cannot be parsed).
fn task_is_exiting(tid: u32) -> io::Result<bool> {
    const PF_EXITING: u64 = 0x4;
    let stat = fs::read_to_string(format!("/proc/{tid}/stat"))?;
    // Field 9 (flags), counted after the command's closing parenthesis.
    let flags = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(6))
        .and_then(|f| f.parse::<u64>().ok());
    Ok(flags.is_some_and(|f| f & PF_EXITING != 0))
}

/// Finds the cpu controller: v2 where `cgroup.controllers` lists `cpu`, else v1.
pub fn detect() -> Option<(PathBuf, CgroupVersion)> {
    let mounts = fs::read_to_string("/proc/self/mounts").ok()?;
    let mut v1 = None;
    let mut v2 = None;
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 {
            continue;
        }
        match f[2] {
            "cgroup2" => {
                let p = PathBuf::from(f[1]);
                let ctl = fs::read_to_string(p.join("cgroup.controllers")).unwrap_or_default();
                if ctl.split_whitespace().any(|c| c == "cpu") {
                    v2 = Some(p);
                }
            }
            "cgroup" if f[3].split(',').any(|o| o == "cpu") => v1 = Some(PathBuf::from(f[1])),
            _ => {}
        }
    }
    v2.map(|p| (p, CgroupVersion::V2))
        .or(v1.map(|p| (p, CgroupVersion::V1)))
}

#[cfg(test)]
mod tests;
