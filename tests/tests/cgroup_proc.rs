//! The `cgroup` CPU backend with VM processes (issues 15 and 13), through
//! the real `corral serve --vm-mode process --cpu-backend cgroup` and real
//! probe VMs: every thread of a VM's process is in its VM's group
//! (`/proc/PID/task/TID/cgroup`), shares 3:1 between two classes of
//! spinning VMs divide their CPU about 3:1 beside an outside busy loop, a
//! VM's own cap holds, a live class move moves the threads, and after
//! `kill -9` of the daemon the next one finds the VMs in the same groups,
//! removes the group of a VM that ended meanwhile, and applies a cap
//! change; a daemon on another state directory uses other groups.
//!
//! Skipped (with a message) where there is no cgroup cpu controller.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use corral_tests::api::{Daemon, KEEP_VMS, kill_vm_processes, spin_vm, wait_until};
use corral_vmm::cgroup::{detect, group_usage_ns, instance_name};
use corral_vmm::vmproc::adopt;
use serde_json::{Value, json};

const BACKEND: [&str; 2] = ["--cpu-backend", "cgroup"];

fn no_controller() -> bool {
    if detect().is_none() {
        eprintln!("SKIPPED: no cgroup cpu controller (v2 with 'cpu', or a v1 'cpu' hierarchy)");
        return true;
    }
    false
}

/// The group of VM `vm` in class path `class` of the daemon on `state_dir`.
fn vm_group(state_dir: &Path, class: &str, vm: &str) -> PathBuf {
    let (base, _) = detect().expect("a cpu controller");
    base.join(format!("corral-{}", instance_name(Some(state_dir))))
        .join(class)
        .join(vm)
}

/// The processes of VM `name` (its `corral vmm`, and the pid-namespace
/// child of a jailed one: both name its control socket).
fn vm_pids(state_dir: &Path, name: &str) -> Vec<i32> {
    let sock = adopt::control_socket(state_dir, name);
    let sock = format!("{} ", sock.to_string_lossy());
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains(" vmm ") && cmd.contains(&sock) {
            pids.push(pid);
        }
    }
    pids
}

/// The cpu controller's group of thread `tid` of `pid`, relative to the
/// controller's mount (`/corral-.../gold/g1`).
fn cpu_group_of(pid: i32, tid: &str) -> Option<String> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/cgroup")).ok()?;
    let v2 = matches!(detect(), Some((_, corral_vmm::cgroup::CgroupVersion::V2)));
    s.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, ctl, path) = (f.next()?, f.next()?, f.next()?);
        let hit = if v2 {
            ctl.is_empty()
        } else {
            ctl.split(',').any(|c| c == "cpu")
        };
        hit.then(|| path.to_string())
    })
}

/// Asserts that every thread of every process of VM `name` is in `group`;
/// returns how many threads there are.
fn assert_threads_in(state_dir: &Path, name: &str, group: &Path) -> usize {
    let (base, _) = detect().expect("a cpu controller");
    let want = format!("/{}", group.strip_prefix(&base).unwrap().display());
    let pids = vm_pids(state_dir, name);
    assert!(
        !pids.is_empty(),
        "VM {name} runs in no process of its own (threads of the daemon?)"
    );
    let mut n = 0;
    for pid in pids {
        for t in std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .flatten()
        {
            let tid = t.file_name().to_string_lossy().to_string();
            let Some(got) = cpu_group_of(pid, &tid) else {
                continue; // the thread ended meanwhile
            };
            assert_eq!(got, want, "thread {tid} of VM {name}'s process {pid}");
            n += 1;
        }
    }
    // vCPUs, the device thread and the main thread at least.
    assert!(n >= 3, "only {n} threads of VM {name} found");
    n
}

fn create(d: &Daemon, body: &str) {
    let r = d.req("POST", "/v1/vms", Some(body));
    assert_eq!(r.status, 201, "{}", r.text());
}

fn class(d: &Daemon, name: &str, shares: u32) {
    let r = d.req(
        "POST",
        "/v1/classes",
        Some(&json!({"name": name, "shares": shares}).to_string()),
    );
    assert_eq!(r.status, 201, "{}", r.text());
}

fn capped_spin(name: &str, class: &str, vcpus: u32, cap: u32) -> String {
    let mut b: Value = serde_json::from_str(&spin_vm(name, class, vcpus, 16, 60)).unwrap();
    b["cap"] = json!(cap);
    b.to_string()
}

/// CPU each group used over `window`, in seconds.
fn usage(groups: &[&Path], window: Duration) -> Vec<f64> {
    let read = || -> Vec<u64> {
        groups
            .iter()
            .map(|g| group_usage_ns(g).expect("group usage"))
            .collect()
    };
    let a = read();
    let t0 = Instant::now();
    std::thread::sleep(window);
    let b = read();
    let secs = t0.elapsed().as_secs_f64();
    a.iter()
        .zip(b)
        .map(|(a, b)| b.saturating_sub(*a) as f64 / 1e9 / secs)
        .collect()
}

/// An outside busy loop (not corral's), ended when dropped.
struct BusyLoop(std::process::Child);

impl BusyLoop {
    fn start(secs: u32) -> Self {
        BusyLoop(
            std::process::Command::new("timeout")
                .args([&secs.to_string(), "sh", "-c", "while :; do :; done"])
                .spawn()
                .expect("start a busy loop"),
        )
    }
}

impl Drop for BusyLoop {
    fn drop(&mut self) {
        // SIGTERM, which `timeout` passes on to the loop (SIGKILL would
        // leave the loop running without it).
        // SAFETY: kill(2) of our own child.
        unsafe {
            libc::kill(self.0.id() as i32, libc::SIGTERM);
        }
        let _ = self.0.wait();
    }
}

#[test]
fn vm_processes_run_in_their_groups_with_shares_caps_and_moves() {
    if no_controller() {
        return;
    }
    let d = Daemon::start(&BACKEND);
    let sd = d.state_dir.clone();
    class(&d, "gold", 3);
    class(&d, "bronze", 1);
    create(&d, &spin_vm("g1", "gold", 2, 16, 60));
    create(&d, &spin_vm("b1", "bronze", 2, 16, 60));
    let (g1, b1, c1) = (
        vm_group(&sd, "gold", "g1"),
        vm_group(&sd, "bronze", "b1"),
        vm_group(&sd, "default", "c1"),
    );
    for (vm, g) in [("g1", &g1), ("b1", &b1)] {
        assert_threads_in(&sd, vm, g);
    }

    // Shares 3:1 beside an outside busy loop: the weights apply inside
    // corral's group, whatever the loop takes.
    let busy = BusyLoop::start(20);
    std::thread::sleep(Duration::from_secs(1));
    let u = usage(&[&g1, &b1], Duration::from_secs(4));
    drop(busy);
    let gold = u[0] / (u[0] + u[1]);
    eprintln!(
        "cgroup backend, VM processes, beside a busy loop: gold {:.3} bronze {:.3} CPUs; gold's part {:.1} %",
        u[0],
        u[1],
        gold * 100.0
    );
    assert!(
        u[0] + u[1] > 0.02,
        "the spinning VMs got {:.3} CPUs",
        u[0] + u[1]
    );
    // 75 % expected; 50 % is what equal weights (one shared group) give.
    assert!(
        (0.62..=0.90).contains(&gold),
        "gold got {:.1} % of the two VMs' CPU with shares 3:1",
        gold * 100.0
    );

    // A VM's own cap is its group's quota (20 % = 20 ms per 100 ms), and
    // holds for a VM of the default class, whose weight (100) is 33 times
    // the two others' together.
    create(&d, &capped_spin("c1", "default", 1, 20));
    assert_threads_in(&sd, "c1", &c1);
    let quota = match detect().unwrap().1 {
        corral_vmm::cgroup::CgroupVersion::V2 => std::fs::read_to_string(c1.join("cpu.max")),
        corral_vmm::cgroup::CgroupVersion::V1 => {
            std::fs::read_to_string(c1.join("cpu.cfs_quota_us"))
        }
    }
    .unwrap();
    assert!(quota.trim().starts_with("20000"), "c1's quota: {quota}");
    std::thread::sleep(Duration::from_millis(300));
    let u = usage(&[&c1], Duration::from_secs(2));
    eprintln!("c1, capped at 20 %: {:.1} %", u[0] * 100.0);
    // A period of slack at the window's edges.
    assert!(
        u[0] <= 0.27,
        "c1, capped at 20 %, used {:.1} %",
        u[0] * 100.0
    );

    // A live move takes every thread along; the old group goes.
    let r = d.req(
        "POST",
        "/v1/vms/b1/move",
        Some(r#"{"class":"gold","weight":50}"#),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let moved = vm_group(&sd, "gold", "b1");
    assert_threads_in(&sd, "b1", &moved);
    assert!(!b1.exists(), "b1's old group is still there");
    let weight = std::fs::read_to_string(moved.join("cpu.weight"))
        .or_else(|_| std::fs::read_to_string(moved.join("cpu.shares")))
        .unwrap();
    assert!(
        matches!(weight.trim(), "50" | "500"),
        "b1's weight in its new group: {weight}"
    );

    // A class's cap, live, on its group (above the VMs' groups).
    let r = d.req("PATCH", "/v1/classes/gold", Some(r#"{"cap":50}"#));
    assert_eq!(r.status, 200, "{}", r.text());
    let gold_dir = moved.parent().unwrap();
    let q = std::fs::read_to_string(gold_dir.join("cpu.max"))
        .or_else(|_| std::fs::read_to_string(gold_dir.join("cpu.cfs_quota_us")))
        .unwrap();
    assert!(q.trim().starts_with("50000"), "gold's quota: {q}");

    // A deleted VM's group goes with it.
    let r = d.req("DELETE", "/v1/vms/c1", None);
    assert!(r.status / 100 == 2, "{}", r.text());
    let gone = wait_until(Duration::from_secs(5), || (!c1.exists()).then_some(()));
    assert!(gone.is_some(), "c1's group outlived the VM");
}

#[test]
fn groups_survive_a_daemon_kill9_and_stale_ones_are_removed() {
    if no_controller() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("corral-cgproc-{}-restart", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let sd = dir.to_str().unwrap();
    let mut d = Daemon::start(&[BACKEND[0], BACKEND[1], "--state-dir", sd, KEEP_VMS]);
    class(&d, "gold", 3);
    create(&d, &spin_vm("v1", "gold", 2, 16, 60));
    create(&d, &spin_vm("v2", "gold", 1, 16, 60));
    let (v1, v2) = (vm_group(&dir, "gold", "v1"), vm_group(&dir, "gold", "v2"));
    assert_threads_in(&dir, "v1", &v1);
    assert_threads_in(&dir, "v2", &v2);

    // A daemon on another state directory: the same class and VM names,
    // other groups, and its end leaves this one's alone.
    {
        let other = Daemon::start(&BACKEND);
        class(&other, "gold", 1);
        create(&other, &spin_vm("v1", "gold", 1, 16, 60));
        let theirs = vm_group(&other.state_dir, "gold", "v1");
        assert_ne!(theirs, v1);
        assert_threads_in(&other.state_dir, "v1", &theirs);
    }
    assert!(
        v1.exists(),
        "another daemon's exit removed this one's group"
    );

    // kill -9 of the daemon; v2 ends while no daemon runs.
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    drop(d);
    for pid in vm_pids(&dir, "v2") {
        // SAFETY: kill(2) of v2's process, found by its command line.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }
    let ended = wait_until(Duration::from_secs(5), || {
        vm_pids(&dir, "v2").is_empty().then_some(())
    });
    assert!(ended.is_some(), "v2's process did not end");

    let d = Daemon::start(&[BACKEND[0], BACKEND[1], "--state-dir", sd]);
    let v = d.req("GET", "/v1/vms/v1", None).json();
    assert_eq!(v["state"], "running", "{v}");
    // Found in the same group, every thread (the control thread of the
    // new daemon's connection too).
    assert_threads_in(&dir, "v1", &v1);
    // The group of the VM that ended meanwhile is gone.
    assert!(!v2.exists(), "v2's stale group is still there");
    // A cap change applies to the re-adopted VM's group, and holds.
    let r = d.req("PATCH", "/v1/vms/v1", Some(r#"{"cap":15}"#));
    assert_eq!(r.status, 200, "{}", r.text());
    let q = std::fs::read_to_string(v1.join("cpu.max"))
        .or_else(|_| std::fs::read_to_string(v1.join("cpu.cfs_quota_us")))
        .unwrap();
    assert!(
        q.trim().starts_with("15000"),
        "v1's quota after the restart: {q}"
    );
    std::thread::sleep(Duration::from_millis(300));
    let u = usage(&[&v1], Duration::from_secs(2));
    assert!(
        u[0] <= 0.23,
        "v1, capped at 15 %, used {:.1} %",
        u[0] * 100.0
    );
    // The daemon's exit (it stops its VMs) leaves no group behind.
    drop(d);
    kill_vm_processes(&dir);
    let root = v1.parent().and_then(Path::parent).unwrap().to_path_buf();
    let clean = wait_until(Duration::from_secs(5), || (!root.exists()).then_some(()));
    assert!(clean.is_some(), "{} outlived the daemon", root.display());
    let _ = std::fs::remove_dir_all(&dir);
}
