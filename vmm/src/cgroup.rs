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
//! cgroup v2 needs thread-granular placement (`cgroup.type = threaded`) to put
//! the threads of one process into several groups; v1 places thread ids
//! directly in `tasks`.

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

/// A corral-owned subtree of the cpu controller.
#[derive(Debug)]
pub struct CgroupBackend {
    root: PathBuf,
    version: CgroupVersion,
}

impl CgroupBackend {
    /// Finds the cpu controller and creates `corral-<instance>` under it.
    pub fn new(instance: &str) -> Result<Self, CgroupError> {
        let instance = check_name(instance)?;
        let (base, version) = detect().ok_or(CgroupError::NotFound)?;
        let root = base.join(format!("corral-{instance}"));
        if !root.exists() {
            fs::create_dir(&root).map_err(io_at(&root))?;
        }
        if version == CgroupVersion::V2 {
            // Let the cpu controller reach our groups.
            let _ = write(&base.join("cgroup.subtree_control"), "+cpu");
            let _ = write(&root.join("cgroup.subtree_control"), "+cpu");
        }
        Ok(Self { root, version })
    }

    /// The interface in use.
    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// The backend's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn ensure_dir(&self, dir: &Path) -> Result<(), CgroupError> {
        if !dir.exists() {
            fs::create_dir(dir).map_err(io_at(dir))?;
            if self.version == CgroupVersion::V2 {
                write(&dir.join("cgroup.type"), "threaded")?;
                // Child classes and VM groups below need the controller.
                let _ = write(&dir.join("cgroup.subtree_control"), "+cpu");
            }
        }
        Ok(())
    }

    /// The group of a class given by its path from the root class,
    /// `/`-separated (`tenant-a/a-web`; a root class is just its name).
    fn class_dir(&self, class_path: &str) -> Result<PathBuf, CgroupError> {
        let mut dir = self.root.clone();
        for part in class_path.split('/') {
            dir.push(check_name(part)?);
        }
        Ok(dir)
    }

    fn set_weight(&self, dir: &Path, weight: u32) -> Result<(), CgroupError> {
        let w = weight.clamp(1, 10_000);
        match self.version {
            CgroupVersion::V2 => write(&dir.join("cpu.weight"), &w.to_string()),
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
                write(&dir.join("cpu.max"), &v)
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
        self.ensure_dir(&dir)?;
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
        let dir = self.class_dir(class)?.join(check_name(vm)?);
        self.ensure_dir(&dir)?;
        self.set_weight(&dir, weight)?;
        let file = match self.version {
            CgroupVersion::V2 => dir.join("cgroup.threads"),
            CgroupVersion::V1 => dir.join("tasks"),
        };
        for tid in tids {
            write(&file, &tid.to_string())?;
        }
        Ok(())
    }

    /// Sets or removes a VM's own cap on its group (`cpu.max` /
    /// `cpu.cfs_quota_us` over 100 ms), below its class's.
    pub fn set_vm_cap(
        &self,
        class: &str,
        vm: &str,
        cap_pct: Option<u32>,
    ) -> Result<(), CgroupError> {
        let dir = self.class_dir(class)?.join(check_name(vm)?);
        self.set_cap(&dir, cap_pct)
    }

    /// Removes a VM's group (its threads must have exited or moved).
    pub fn remove_vm(&self, class: &str, vm: &str) -> Result<(), CgroupError> {
        let dir = self.class_dir(class)?.join(check_name(vm)?);
        remove_dir_if_exists(&dir)
    }

    /// Removes a class group (its VM groups must be gone).
    pub fn remove_class(&self, class: &str) -> Result<(), CgroupError> {
        let dir = self.class_dir(class)?;
        remove_dir_if_exists(&dir)
    }

    /// Total CPU time consumed by a class group, in ns, if the controller reports it.
    pub fn class_usage_ns(&self, class: &str) -> Option<u64> {
        let dir = self.class_dir(class).ok()?;
        match self.version {
            CgroupVersion::V2 => {
                let s = fs::read_to_string(dir.join("cpu.stat")).ok()?;
                let us: u64 = s
                    .lines()
                    .find_map(|l| l.strip_prefix("usage_usec "))?
                    .trim()
                    .parse()
                    .ok()?;
                Some(us * 1000)
            }
            CgroupVersion::V1 => {
                // cpuacct may be a separate hierarchy; cpu.stat has no usage in v1.
                None
            }
        }
    }
}

impl Drop for CgroupBackend {
    fn drop(&mut self) {
        // Best effort: groups still holding threads stay until those exit.
        remove_groups(&self.root);
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
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(check_name("gold").is_ok());
        assert!(check_name("vm-1_a.b").is_ok());
        for bad in ["", "..", ".x", "a/b", "a b", "ü"] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn classes_and_threads_in_real_cgroups() {
        if unsafe_is_root() && detect().is_some() {
            let b = CgroupBackend::new(&format!("test{}", std::process::id())).unwrap();
            b.set_class("gold", 300, Some(150)).unwrap();
            b.set_class("gold", 300, None).unwrap();
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() };
            let (tx, rx) = std::sync::mpsc::channel();
            let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
            let t = std::thread::spawn(move || {
                // SAFETY: as above.
                tx.send(unsafe { libc::gettid() }).unwrap();
                let _ = done_rx.recv();
            });
            let child = rx.recv().unwrap();
            assert_ne!(child, tid);
            b.place_vm("gold", "vm1", 100, &[child]).unwrap();
            let file = match b.version() {
                CgroupVersion::V2 => "cgroup.threads",
                CgroupVersion::V1 => "tasks",
            };
            let listed = fs::read_to_string(b.root().join("gold/vm1").join(file)).unwrap();
            assert!(listed.lines().any(|l| l.trim() == child.to_string()));
            // A VM's own cap: 30 % of a CPU = 30 ms per 100 ms period.
            b.set_vm_cap("gold", "vm1", Some(30)).unwrap();
            let quota = |dir: &str| match b.version() {
                CgroupVersion::V2 => fs::read_to_string(b.root().join(dir).join("cpu.max"))
                    .unwrap()
                    .trim()
                    .to_string(),
                CgroupVersion::V1 => {
                    fs::read_to_string(b.root().join(dir).join("cpu.cfs_quota_us"))
                        .unwrap()
                        .trim()
                        .to_string()
                }
            };
            let want = match b.version() {
                CgroupVersion::V2 => ("30000 100000", "max 100000"),
                CgroupVersion::V1 => ("30000", "-1"),
            };
            assert_eq!(quota("gold/vm1"), want.0);
            b.set_vm_cap("gold", "vm1", None).unwrap();
            assert_eq!(quota("gold/vm1"), want.1);
            // A child class is a group inside its parent's.
            b.set_class("gold/gold-web", 200, Some(50)).unwrap();
            b.place_vm("gold/gold-web", "vm2", 100, &[child]).unwrap();
            let listed = fs::read_to_string(b.root().join("gold/gold-web/vm2").join(file)).unwrap();
            assert!(listed.lines().any(|l| l.trim() == child.to_string()));
            assert!(b.set_class("gold/../x", 1, None).is_err());
            b.place_vm("gold", "vm1", 100, &[child]).unwrap();
            b.remove_vm("gold/gold-web", "vm2").unwrap();
            b.remove_class("gold/gold-web").unwrap();
            done_tx.send(()).unwrap();
            t.join().unwrap();
            b.remove_vm("gold", "vm1").unwrap();
            b.remove_class("gold").unwrap();
            assert!(b.set_class("a/b", 1, None).is_err());
        } else {
            eprintln!("SKIPPED: needs root and a cgroup cpu controller");
        }
    }

    fn unsafe_is_root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }
}
