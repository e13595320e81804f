//! The VM process's jail (issue 15 item 2), applied by `jail-check`
//! (`tests/src/bin/jail-check.rs`) to itself and checked from inside (its
//! `FACT` lines) and from the host (`/proc/PID` of the jailed process):
//! the private root holds only the VM's files and `/dev/kvm`, the host's
//! files, `/proc` and network are out of reach, no privilege is left, the
//! limits are set, and the probe guest still boots and does disk I/O
//! through the vmm library with seccomp on. A failing step stops the
//! start with an error naming it.
//!
//! Needs root (the jail drops from root). A namespace kind this host does
//! not permit is probed first (`jail::probe`); the test then says so and
//! leaves only that part out.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use corral_vmm::jail::{self, JailLimits, NsKind, RTPRIO, RTTIME_HARD_US, RTTIME_SOFT_US};

const EROFS: &str = "30";
const ENOENT: &str = "2";
const EACCES: &str = "13";
const EPERM: &str = "1";

/// Whether the jail can give its process `RLIMIT_RTPRIO` 1: this process's
/// hard limit is at least 1 (the jail lowers it), or it may raise it
/// (`CAP_SYS_RESOURCE`, which a container's root may lack, as here).
fn rt_raisable() -> bool {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_RTPRIO, &mut rl) }, 0);
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .unwrap();
    // CAP_SYS_RESOURCE is capability 24.
    rl.rlim_max == libc::RLIM_INFINITY || rl.rlim_max >= RTPRIO || eff & (1 << 24) != 0
}

fn jail_check() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_jail-check"))
}

/// Root, and the namespace kinds not permitted here (each said once).
fn host() -> Option<Vec<&'static str>> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP: the jail drops privileges from root; this test runs as a user");
        return None;
    }
    let mut off = Vec::new();
    for (k, r) in jail::probe_all() {
        if let Err(e) = r {
            if k == NsKind::Mount {
                eprintln!("SKIP: this host permits no mount namespace ({e}): no jail to test");
                return None;
            }
            eprintln!(
                "SKIP part: this host permits no {} namespace ({e}); that part is left out",
                k.as_str()
            );
            off.push(k.as_str());
        }
    }
    Some(off)
}

fn images(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("corral-jail-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let st = Command::new(corral_tests::corral_bin())
        .arg("export-probe")
        .arg(d.join("probe.elf"))
        .status()
        .expect("corral export-probe");
    assert!(st.success());
    for n in ["ro.img", "rw.img", "other.img"] {
        let f = std::fs::File::create(d.join(n)).unwrap();
        f.set_len(4 << 20).unwrap();
    }
    // World-writable on the host: a write refused inside is refused by the
    // read-only mount, not by the file's mode.
    for n in ["probe.elf", "ro.img", "rw.img", "other.img"] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(d.join(n), std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    d
}

struct Jailed {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Jailed {
    fn spawn(dir: &Path, args: &[&str], off: &[&str]) -> Self {
        let mut cmd = Command::new(jail_check());
        cmd.arg(dir).args(args);
        for k in off {
            cmd.args(["--no-ns", k]);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn jail-check");
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().take(2000) {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = (&mut err).take(1 << 16).read_to_end(&mut v);
            eprint!("{}", String::from_utf8_lossy(&v));
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    fn wait_for(&mut self, prefix: &str, timeout: Duration) -> Option<String> {
        let end = Instant::now() + timeout;
        while let Some(left) = end.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.starts_with(prefix) {
                        return Some(l);
                    }
                }
                Err(_) => return None,
            }
        }
        None
    }

    fn finish(&mut self, timeout: Duration) -> Option<i32> {
        let end = Instant::now() + timeout;
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(1)) {
            self.seen.push(l);
            if Instant::now() > end {
                break;
            }
        }
        while Instant::now() < end {
            if let Ok(Some(st)) = self.child.try_wait() {
                return st.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        None
    }

    fn facts(&self) -> HashMap<String, String> {
        self.seen
            .iter()
            .filter_map(|l| l.strip_prefix("FACT "))
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn output(&self) -> String {
        self.seen.join("\n")
    }
}

impl Drop for Jailed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The pid, in the host's namespace, of `outer`'s child (the jailed pid 1),
/// or `outer` itself when there is no pid namespace.
fn inner_pid(outer: u32, pid_ns: bool) -> u32 {
    if !pid_ns {
        return outer;
    }
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(st) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        if status_field(&st, "PPid") == outer.to_string() {
            return pid;
        }
    }
    panic!("no child of the outer jail process {outer}");
}

fn status_field(status: &str, key: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[test]
fn jailed_vm_process_holds_only_its_files_and_no_privilege_and_still_boots() {
    let Some(off) = host() else { return };
    let pid_ns = !off.contains(&"pid");
    let dir = images("in");
    // The host's loopback answers; from the jail's network namespace it
    // must not be reachable.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    assert!(std::net::TcpStream::connect(listener.local_addr().unwrap()).is_ok());
    let uid = 3_221_225_700u32;
    let uids = uid.to_string();
    let mut j = Jailed::spawn(
        &dir,
        &[
            "--uid", &uids, "--gid", &uids, "--port", &port, "--wait", "--boot",
        ],
        &off,
    );
    j.wait_for("JAIL-IN", Duration::from_secs(20))
        .unwrap_or_else(|| panic!("not jailed:\n{}", j.output()));

    // From the host, while it waits.
    let pid = inner_pid(j.child.id(), pid_ns);
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let u = format!("{uid} {uid} {uid} {uid}");
    assert_eq!(status_field(&st, "Uid"), u, "{st}");
    assert_eq!(status_field(&st, "Gid"), u, "{st}");
    assert_eq!(status_field(&st, "Groups"), "", "{st}");
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(status_field(&st, cap), "0000000000000000", "{cap}: {st}");
    }
    assert_eq!(status_field(&st, "NoNewPrivs"), "1", "{st}");
    if pid_ns {
        let nspid = status_field(&st, "NSpid");
        assert_eq!(
            nspid,
            format!("{pid} 1"),
            "pid 1 of its own namespace: {st}"
        );
    }
    let mut kinds = vec!["mnt"];
    kinds.extend(
        ["pid_for_children", "ipc", "net", "uts"]
            .iter()
            .filter(|k| !off.contains(&k.trim_end_matches("_for_children"))),
    );
    for ns in kinds {
        let ours = std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap();
        let theirs = std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).unwrap();
        assert_ne!(ours, theirs, "{ns} namespace shared with the host");
    }
    let mut root: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/root"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    root.sort();
    assert_eq!(root, ["dev", "probe.elf", "ro.img", "rw.img"]);
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let core = limits
        .lines()
        .find(|l| l.starts_with("Max core file size"))
        .unwrap();
    assert!(
        core.split_whitespace().filter(|w| *w == "0").count() == 2,
        "{core}"
    );
    // Real-time: priority 1 at most (where this host lets the jail raise
    // it), and a bound on real-time CPU time without blocking.
    let row = |name: &str| -> Vec<String> {
        let l = limits.lines().find(|l| l.starts_with(name)).unwrap();
        l[name.len()..]
            .split_whitespace()
            .map(String::from)
            .collect()
    };
    let rtprio = if rt_raisable() { RTPRIO } else { 0 }.to_string();
    assert_eq!(row("Max realtime priority")[..2], [rtprio.clone(), rtprio]);
    assert_eq!(
        row("Max realtime timeout")[..2],
        [RTTIME_SOFT_US.to_string(), RTTIME_HARD_US.to_string()]
    );

    j.child.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
    j.wait_for("BOOT-EXIT", Duration::from_secs(60))
        .unwrap_or_else(|| panic!("no boot:\n{}", j.output()));
    assert_eq!(j.finish(Duration::from_secs(10)), Some(0), "{}", j.output());
    let f = j.facts();
    let out = j.output();
    let fact = |k: &str| {
        f.get(k)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("no {k}:\n{out}"))
    };

    // Inside: only its files and /dev/kvm.
    assert_eq!(fact("root"), "dev,probe.elf,ro.img,rw.img");
    assert_eq!(fact("dev"), "kvm");
    // The host's files, /proc, the images' own directory and another VM's
    // image beside them: not there.
    for k in ["shadow", "proc", "hostdir", "other"] {
        assert_eq!(fact(k), ENOENT, "{k}");
    }
    let ids = format!("{uid},{uid}");
    assert_eq!(fact("uid"), ids);
    assert_eq!(fact("gid"), ids);
    assert_eq!(fact("groups"), "0");
    assert_eq!(fact("caps"), "0,0,0");
    assert_eq!(fact("bounding"), "0");
    assert_eq!(fact("ambient"), "0");
    assert_eq!(fact("nnp"), "1");
    if pid_ns {
        assert_eq!(fact("pid"), "1");
    }
    let l = JailLimits::for_vm(64, 1, 2, 4 << 20);
    let want = format!(
        "{},{},{},{},0",
        l.nofile,
        l.address_space.unwrap(),
        l.nproc,
        l.fsize.unwrap()
    );
    assert_eq!(fact("limits"), want);
    let rt = if rt_raisable() { RTPRIO } else { 0 };
    assert_eq!(
        fact("rt_limits"),
        format!("{rt},{RTTIME_SOFT_US},{RTTIME_HARD_US}")
    );
    // A device thread can take SCHED_FIFO 1 for a tight throttle wait where
    // the jail could give it RLIMIT_RTPRIO; never a higher priority.
    assert_eq!(fact("fifo1"), if rt_raisable() { "ok" } else { EPERM });
    assert_eq!(fact("fifo2"), EPERM);
    // Read-only images refuse writes by the mount (the files are 0666).
    assert_eq!(fact("ro_write"), EROFS);
    assert_eq!(fact("kernel_write"), EROFS);
    assert_eq!(fact("rw_write"), "ok");
    // /dev/kvm cannot be opened again by the jailed uid (root:kvm 0660)...
    assert_eq!(fact("kvm_reopen"), EACCES);
    // ...and nothing can be created in the root.
    assert_eq!(fact("mkdir_root"), EROFS);
    if !off.contains(&"net") {
        assert_ne!(fact("tcp"), "ok", "the host's loopback is reachable");
    }
    if !off.contains(&"uts") {
        assert_eq!(fact("hostname"), "jail-check");
    }
    // ...and KVM works through the kept fd: the probe boots and writes and
    // verifies the writable disk, under the seccomp filters.
    for want in ["GUEST PROBE-UP", "GUEST PROBE-DONE status=ok"] {
        assert!(out.lines().any(|l| l == want), "{want}:\n{out}");
    }
    let r = out
        .lines()
        .find(|l| l.starts_with("GUEST PROBE-RESULT mode=blk disk=1 op=verify"))
        .unwrap_or_else(|| panic!("no blk result:\n{out}"));
    assert!(
        r.contains(" errors=0 ") && r.contains(" mismatches=0"),
        "{r}"
    );
    assert!(out.contains("BOOT-EXIT guest shut down"), "{out}");
    // The disks' io_uring engine works jailed too, where the host allows it.
    let engines = out
        .lines()
        .find_map(|l| l.strip_prefix("VM-ENGINES "))
        .unwrap_or_else(|| panic!("no engines:\n{out}"));
    if std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled").is_ok_and(|v| v.trim() == "0")
    {
        assert_eq!(engines, "Uring,Uring");
    }
    // The guest's writes reached the host's file.
    let written = std::fs::read(dir.join("rw.img")).unwrap();
    assert!(written[..1 << 20].iter().any(|&b| b != 0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_failing_step_stops_the_start_with_its_name() {
    let Some(off) = host() else { return };
    let dir = images("fail");
    let other = dir.join("other.img");
    let missing = dir.join("no-such-dir");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--uid", "0"], "uid 0 is not an unprivileged id"),
        (
            vec!["--gid", "4294967295"],
            "gid 4294967295 is not an unprivileged id",
        ),
        (
            vec!["--kvm", "/nonexistent/kvm"],
            "opening the KVM device /nonexistent/kvm: No such file or directory",
        ),
        (
            vec!["--kvm", other.to_str().unwrap()],
            "not a character device",
        ),
        (vec!["--thread"], "the process has 2 threads"),
        // After the fork (in the jailed child): the outer process exits
        // with the child's status.
        (
            vec!["--staging", missing.to_str().unwrap()],
            "mounting the private root (tmpfs) on",
        ),
    ];
    for (i, (args, want)) in cases.into_iter().enumerate() {
        let uid = (3_221_225_800 + i as u32).to_string();
        let mut a = vec!["--boot"];
        for id in ["--uid", "--gid"] {
            if !args.contains(&id) {
                a.extend([id, uid.as_str()]);
            }
        }
        a.extend(args.iter().copied());
        let mut j = Jailed::spawn(&dir, &a, &off);
        let code = j.finish(Duration::from_secs(20));
        let out = j.output();
        let err = out
            .lines()
            .find(|l| l.starts_with("JAIL-ERROR "))
            .unwrap_or_else(|| panic!("{args:?}: no JAIL-ERROR:\n{out}"));
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(code, Some(3), "{args:?}:\n{out}");
        assert!(
            !out.contains("JAIL-IN") && !out.contains("GUEST"),
            "{args:?} started:\n{out}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn killing_the_outer_process_kills_the_jailed_vm_process() {
    let Some(off) = host() else { return };
    if off.contains(&"pid") {
        eprintln!("SKIP: no pid namespace here, so no outer process");
        return;
    }
    let dir = images("kill");
    let uid = "3221225900";
    let mut j = Jailed::spawn(&dir, &["--uid", uid, "--gid", uid, "--wait"], &off);
    j.wait_for("JAIL-IN", Duration::from_secs(20))
        .unwrap_or_else(|| panic!("not jailed:\n{}", j.output()));
    let outer = j.child.id();
    let inner = inner_pid(outer, true);
    assert_ne!(inner, outer);
    j.child.kill().unwrap();
    let _ = j.child.wait();
    let gone = corral_tests::api::wait_until(Duration::from_secs(5), || {
        (!Path::new(&format!("/proc/{inner}")).exists()).then_some(())
    });
    assert!(
        gone.is_some(),
        "the jailed process {inner} outlived its outer process"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn for_vm_jails_a_vm_config_and_the_host_finds_its_threads() {
    let Some(off) = host() else { return };
    let pid_ns = !off.contains(&"pid");
    let dir = images("forvm");
    let uid = "3221226000";
    let mut j = Jailed::spawn(
        &dir,
        &[
            "--uid",
            uid,
            "--gid",
            uid,
            "--for-vm",
            "--wait",
            "--boot",
            "--cmdline",
            "probe.mode=echo probe.secs=3",
        ],
        &off,
    );
    j.wait_for("JAIL-IN", Duration::from_secs(20))
        .unwrap_or_else(|| panic!("not jailed:\n{}", j.output()));
    let outer = j.child.id();
    let view = jail::host_view(outer).unwrap();
    assert_eq!(view.pid, inner_pid(outer, pid_ns));
    if pid_ns {
        assert_eq!(view.host_tid(1), Some(view.pid), "{view:?}");
    }
    j.child.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
    let tids = j
        .wait_for("VM-TIDS ", Duration::from_secs(30))
        .unwrap_or_else(|| panic!("no VM:\n{}", j.output()));
    // The tids the VM process reports are its namespace's; host_view maps
    // them to the host's, whose /proc names the VM's threads.
    let view = jail::host_view(outer).unwrap();
    let names: Vec<String> = tids["VM-TIDS ".len()..]
        .split(',')
        .map(|t| {
            let host = view
                .host_tid(t.parse().unwrap())
                .unwrap_or_else(|| panic!("tid {t} not in {view:?}"));
            std::fs::read_to_string(format!("/proc/{}/task/{host}/comm", view.pid))
                .unwrap()
                .trim()
                .to_string()
        })
        .collect();
    assert_eq!(names, ["vcpu0", "dev-jail-check"]);
    j.wait_for("BOOT-EXIT", Duration::from_secs(60))
        .unwrap_or_else(|| panic!("no exit:\n{}", j.output()));
    assert_eq!(j.finish(Duration::from_secs(10)), Some(0), "{}", j.output());
    let f = j.facts();
    assert_eq!(f["root"], "dev,disk0,disk1,kernel");
    assert_eq!(
        f["ro_write"], ENOENT,
        "the files are named disk0, disk1, kernel"
    );
    let out = j.output();
    assert!(out.contains("GUEST PROBE-UP"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}
