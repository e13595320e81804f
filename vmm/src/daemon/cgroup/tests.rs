//! The cgroup backend in real cgroups (as root, where a cpu controller exists).

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
            CgroupVersion::V1 => fs::read_to_string(b.root().join(dir).join("cpu.cfs_quota_us"))
                .unwrap()
                .trim()
                .to_string(),
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

#[test]
fn instance_names_follow_the_state_directory() {
    let a = std::env::temp_dir().join(format!("corral-cg-inst-{}", std::process::id()));
    fs::create_dir_all(a.join("x")).unwrap();
    let n = instance_name(Some(&a));
    assert!(n.starts_with("state-") && n.len() == 6 + 16, "{n}");
    assert!(check_name(&n).is_ok());
    // The same directory by another spelling: the same groups.
    assert_eq!(instance_name(Some(&a.join("x/.."))), n);
    assert_eq!(instance_name(Some(&a.join("."))), n);
    assert_ne!(instance_name(Some(&a.join("x"))), n);
    assert_eq!(instance_name(None), std::process::id().to_string());
    fs::remove_dir_all(&a).unwrap();
}

#[test]
fn whole_processes_in_real_cgroups() {
    if !(unsafe_is_root() && detect().is_some()) {
        eprintln!("SKIPPED: needs root and a cgroup cpu controller");
        return;
    }
    let b = CgroupBackend::open(
        &format!("ptest{}", std::process::id()),
        Placement::Processes,
    )
    .unwrap();
    b.set_class("gold", 300, None).unwrap();
    b.set_class("bronze", 100, None).unwrap();
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let group_of = |pid: libc::pid_t| {
        let s = fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        s.lines()
            .find_map(|l| {
                let mut f = l.splitn(3, ':');
                let (_, ctl, path) = (f.next()?, f.next()?, f.next()?);
                let hit = match b.version() {
                    CgroupVersion::V2 => ctl.is_empty(),
                    CgroupVersion::V1 => ctl.split(',').any(|c| c == "cpu"),
                };
                hit.then(|| path.to_string())
            })
            .unwrap()
    };
    let dir = b.prepare_vm("gold", "vm1", 100, Some(40)).unwrap();
    b.add_processes("gold", "vm1", &[pid]).unwrap();
    assert!(group_of(pid).ends_with("/gold/vm1"), "{}", group_of(pid));
    // A move: the process, then the old group removed.
    b.prepare_vm("bronze", "vm1", 100, None).unwrap();
    b.add_processes("bronze", "vm1", &[pid]).unwrap();
    assert!(group_of(pid).ends_with("/bronze/vm1"));
    b.remove_vm("gold", "vm1").unwrap();
    assert!(!dir.exists());
    // Prune keeps what is named and what holds a task.
    b.prepare_vm("gold", "stale", 100, None).unwrap();
    let keep: std::collections::BTreeSet<PathBuf> =
        [b.class_dir("gold").unwrap()].into_iter().collect();
    assert_eq!(b.prune(&keep), 1, "only gold/stale is empty and unnamed");
    assert!(b.vm_dir("bronze", "vm1").unwrap().exists());
    assert!(b.class_dir("gold").unwrap().exists());
    assert!(!b.vm_dir("gold", "stale").unwrap().exists());
    let _ = child.kill();
    let _ = child.wait();
    b.remove_vm("bronze", "vm1").unwrap();
    drop(b);
}

fn unsafe_is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}
