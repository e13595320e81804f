//! VM processes (issue 15): each VM of `corral serve` is a `corral vmm`
//! process. kill -9 of one fails that VM alone, with the reason; kill -9 of
//! the daemon leaves the VMs running (unsupervised, and they say so), and
//! the next daemon re-adopts them, 100 of them in a few seconds.

use std::path::Path;
use std::time::{Duration, Instant};

use corral_tests::api::{Daemon, KEEP_VMS, wait_until};
use corral_vmm::vmproc::proto::{FromVm, Request, Response, ToVm};
use corral_vmm::vmproc::{adopt, wire};
use serde_json::{Value, json};

/// Whether process `pid` is gone: no `/proc` entry, or a zombie (a VM
/// process whose launcher exited is init's to reap).
fn gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(st) => st
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

/// The live `corral vmm` processes of VMs of `state_dir` (their command
/// lines name their control sockets there): one per VM (the launcher
/// clones it into its pid namespace, so there is no outer process).
fn vm_processes(state_dir: &Path) -> Vec<i32> {
    let vms = state_dir.join("vms");
    let vms = format!("{} ", vms.to_string_lossy());
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            let sock = cmd.split(" --socket ").nth(1)?;
            (cmd.contains(" vmm ") && sock.starts_with(vms.trim_end()) && !gone(pid)).then_some(pid)
        })
        .collect()
}

/// A live process of VM `name`'s (outer or inner), found by its command
/// line.
fn vm_pid(state_dir: &Path, name: &str) -> Option<i32> {
    let sock = adopt::control_socket(state_dir, name);
    let sock = format!("{} ", sock.to_string_lossy());
    vm_processes(state_dir).into_iter().find(|p| {
        std::fs::read(format!("/proc/{p}/cmdline"))
            .map(|c| format!("{} ", String::from_utf8_lossy(&c).replace('\0', " ")).contains(&sock))
            .unwrap_or(false)
    })
}

/// The host pid of VM `name`'s process, as the API reports it.
fn api_pid(d: &Daemon, name: &str) -> i32 {
    let v = get(d, &format!("/v1/vms/{name}"));
    v["pid"]
        .as_i64()
        .unwrap_or_else(|| panic!("no pid for {name}: {v}")) as i32
}

fn status_field(pid: i32, key: &str) -> Option<String> {
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    st.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
}

fn pid_namespaces() -> bool {
    corral_vmm::jail::probe(corral_vmm::jail::NsKind::Pid).is_ok()
}

fn kill9(pid: i32) {
    // SAFETY: kill(2) of a VM process of this test's daemon.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
}

fn idle_vm(name: &str, secs: u32) -> String {
    json!({"name": name, "memory_mib": 32,
        "cmdline": format!("probe.mode=echo probe.secs={secs}")})
    .to_string()
}

fn get(d: &Daemon, path: &str) -> Value {
    let r = d.req("GET", path, None);
    assert_eq!(r.status, 200, "GET {path}: {}", r.text());
    r.json()
}

/// An empty state directory of this test process, named `tag`.
fn fresh_state_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("corral-vmproc-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Asks a VM process for its status on its control socket, as a daemon.
fn status_on_socket(path: &Path) -> corral_vmm::vmproc::proto::Status {
    let s = adopt::connect(path).expect("connect to the VM's control socket");
    // An answer within 10 s, or the test fails here rather than hangs.
    let tv = libc::timeval {
        tv_sec: 10,
        tv_usec: 0,
    };
    // SAFETY: setsockopt reads the timeval we pass, which outlives the call.
    unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&s),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        );
    }
    wire::send(
        &s,
        &ToVm {
            id: 9,
            req: Request::Status,
        },
        &[],
    )
    .unwrap();
    loop {
        match wire::recv::<FromVm>(&s).unwrap().expect("an answer") {
            (
                FromVm::Reply {
                    id: 9,
                    resp: Response::Status(st),
                },
                _,
            ) => return st,
            _ => continue,
        }
    }
}

#[test]
fn kill9_of_a_vm_process_fails_that_vm_only() {
    let d = Daemon::start(&[]);
    let pid_ns = pid_namespaces();
    for n in ["victim", "boxed", "other"] {
        let r = d.req("POST", "/v1/vms", Some(&idle_vm(n, 60)));
        assert_eq!(r.status, 201, "{}", r.text());
    }
    let pid = api_pid(&d, "victim");
    let other = api_pid(&d, "other");
    assert_ne!(pid, other);
    if pid_ns {
        // The API's pid is the host's; the VM process is pid 1 inside.
        assert_eq!(status_field(pid, "NSpid").unwrap(), format!("{pid} 1"));
    } else {
        eprintln!("SKIP (part): this host refuses a pid namespace");
    }
    kill9(pid);
    let v = wait_until(Duration::from_secs(10), || {
        let v = get(&d, "/v1/vms/victim");
        (v["state"] == "failed").then_some(v)
    })
    .unwrap_or_else(|| panic!("victim not failed: {}", get(&d, "/v1/vms/victim")));
    assert_eq!(v["exit"]["reason"], "vm_process", "{v}");
    assert!(v["pid"].is_null(), "{v}");
    let msg = v["exit"]["message"].as_str().unwrap();
    assert!(
        msg.contains("signal 9") && msg.contains(&pid.to_string()),
        "{msg}"
    );
    let mut left = 2;
    if pid_ns {
        // No outer process: the launcher cloned the VM process into its
        // pid namespace (`vmproc::spawn`), so its parent is the launcher,
        // not another `corral vmm`, and SIGKILL of the pid the API reports
        // ends that VM alone.
        let inner = api_pid(&d, "boxed");
        let parent: i32 = status_field(inner, "PPid").unwrap().parse().unwrap();
        let procs = vm_processes(&d.state_dir);
        assert!(
            procs.contains(&inner) && !procs.contains(&parent),
            "{procs:?}: the parent {parent} of {inner} is a VM process"
        );
        kill9(inner);
        let v = wait_until(Duration::from_secs(10), || {
            let v = get(&d, "/v1/vms/boxed");
            (v["state"] == "failed").then_some(v)
        })
        .unwrap_or_else(|| panic!("boxed not failed: {}", get(&d, "/v1/vms/boxed")));
        assert!(
            v["exit"]["message"].as_str().unwrap().contains("signal 9"),
            "{v}"
        );
        assert!(
            wait_until(Duration::from_secs(5), || gone(inner).then_some(())).is_some(),
            "the VM process {inner} outlived its SIGKILL"
        );
        left = 1;
    }
    // The other VM goes on, and answers.
    let o = get(&d, "/v1/vms/other");
    assert_eq!(o["state"], "running", "{o}");
    let r = d.req("POST", "/v1/vms/other/console", Some(r#"{"data":"hi\n"}"#));
    assert!(r.status / 100 == 2, "{}", r.text());
    let echoed = wait_until(Duration::from_secs(10), || {
        d.req("GET", "/v1/vms/other/console", None)
            .text()
            .contains("PROBE-ECHO hi")
            .then_some(())
    });
    assert!(echoed.is_some(), "the other VM stopped answering");
    // The failed VMs' bookings are given back.
    let st = wait_until(Duration::from_secs(5), || {
        let st = get(&d, "/v1/status");
        (st["memory_mib"] == 32 * left).then_some(st)
    });
    assert!(st.is_some(), "{}", get(&d, "/v1/status"));
}

/// kill -9 of the daemon: the VM runs on, says it is unsupervised, and
/// the next daemon re-adopts it. (This failed 1 run in 3 in session 9:
/// see `a_vm_printing_when_its_daemon_dies_knows_it_is_unsupervised`.)
#[test]
fn vms_outlive_kill9_of_the_daemon_and_the_next_one_adopts_them() {
    let dir = fresh_state_dir("adopt");
    let sd = dir.to_str().unwrap();
    let mut d = Daemon::start(&["--state-dir", sd]);
    let r = d.req("POST", "/v1/vms", Some(&idle_vm("v", 120)));
    assert_eq!(r.status, 201, "{}", r.text());
    let pid = api_pid(&d, "v");
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    drop(d);
    // The VM runs on without a daemon, and says so.
    assert!(!gone(pid), "the VM died with the daemon");
    let sock = adopt::control_socket(&dir, "v");
    let st = wait_until(Duration::from_secs(5), || {
        let st = status_on_socket(&sock);
        st.unsupervised.then_some(st)
    })
    .expect("the VM process reports that it is unsupervised");
    assert_eq!(st.name, "v");
    assert!(st.exit.is_none(), "{st:?}");
    // The next daemon re-adopts it: running, its console (from before the
    // restart) there, and it obeys.
    let d = Daemon::start(&["--state-dir", sd]);
    let v = get(&d, "/v1/vms/v");
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(v["pid"], pid, "the same process: {v}");
    let con = wait_until(Duration::from_secs(5), || {
        let c = d.req("GET", "/v1/vms/v/console", None).text();
        c.contains("PROBE-UP").then_some(c)
    });
    assert!(con.is_some(), "console not resent");
    assert!(
        !status_on_socket(&sock).unsupervised,
        "adopted, yet unsupervised"
    );
    let r = d.req("POST", "/v1/vms/v/console", Some(r#"{"data":"again\n"}"#));
    assert!(r.status / 100 == 2, "{}", r.text());
    let echoed = wait_until(Duration::from_secs(10), || {
        d.req("GET", "/v1/vms/v/console", None)
            .text()
            .contains("PROBE-ECHO again")
            .then_some(())
    });
    assert!(
        echoed.is_some(),
        "the adopted VM's console input does not reach it"
    );
    let r = d.req("POST", "/v1/vms/v/stop", Some("{}"));
    assert_eq!(r.status, 200, "{}", r.text());
    let ended = wait_until(Duration::from_secs(10), || gone(pid).then_some(()));
    assert!(ended.is_some(), "stopped, yet its process is still there");
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_hundred_vms_are_readopted_after_a_restart() {
    const N: usize = 100;
    let dir = fresh_state_dir("100");
    let sd = dir.to_str().unwrap();
    let d = Daemon::start(&["--state-dir", sd, KEEP_VMS, "--memory-budget", "8192"]);
    let mut c = d.conn();
    let t0 = Instant::now();
    for i in 0..N {
        let r = c.req("POST", "/v1/vms", Some(&idle_vm(&format!("h{i:03}"), 300)));
        assert_eq!(r.status, 201, "VM {i}: {}", r.text());
    }
    eprintln!("created {N} VM processes in {:?}", t0.elapsed());
    drop(c);
    // SIGTERM without --shutdown-vms-on-exit: the VMs stay.
    let mut d = d;
    d.terminate(Duration::from_secs(20));
    drop(d);
    let t1 = Instant::now();
    let d = Daemon::start(&["--state-dir", sd, "--memory-budget", "8192"]);
    let up = t1.elapsed();
    let st = get(&d, "/v1/status");
    eprintln!("restart with {N} VM processes re-adopted: {up:?} to the API answering");
    assert_eq!(st["running_vms"], N, "{st}");
    let vms = get(&d, "/v1/vms");
    let running = vms
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["state"] == "running")
        .count();
    assert_eq!(running, N, "{vms}");
    drop(d);
    // --shutdown-vms-on-exit (the tests' default) stopped them all.
    let left = wait_until(Duration::from_secs(20), || {
        (0..N)
            .all(|i| vm_pid(&dir, &format!("h{i:03}")).is_none())
            .then_some(())
    });
    assert!(
        left.is_some(),
        "VM processes left after the daemon stopped them"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// After a daemon restart on `dir`: every VM process of the state
/// directory belongs to a VM the daemon reports running (its pid, or that
/// pid's outer process), and every VM reported running has its process.
/// Strays (stopped by the new daemon) get a few seconds to end. Returns
/// the VMs by name with their states.
fn consistent(d: &Daemon, dir: &Path, why: &str) -> std::collections::BTreeMap<String, String> {
    let vms = get(d, "/v1/vms");
    let mut owned = Vec::new();
    let mut states = std::collections::BTreeMap::new();
    for v in vms.as_array().unwrap() {
        let name = v["name"].as_str().unwrap().to_string();
        let state = v["state"].as_str().unwrap().to_string();
        if state == "running" {
            let pid = v["pid"]
                .as_i64()
                .unwrap_or_else(|| panic!("{why}: running without a pid: {v}"))
                as i32;
            assert!(
                !gone(pid),
                "{why}: {name} reported running, its process {pid} is gone"
            );
            owned.push(pid);
            if let Some(pp) = status_field(pid, "PPid").and_then(|p| p.parse().ok()) {
                owned.push(pp);
            }
        }
        states.insert(name, state);
    }
    let orphans = wait_until(Duration::from_secs(10), || {
        let left: Vec<i32> = vm_processes(dir)
            .into_iter()
            .filter(|p| !owned.contains(p))
            .collect();
        left.is_empty().then_some(())
    });
    assert!(
        orphans.is_some(),
        "{why}: VM processes the daemon does not know: {:?} (known {owned:?}, VMs {states:?})",
        vm_processes(dir)
            .into_iter()
            .filter(|p| !owned.contains(p))
            .collect::<Vec<_>>()
    );
    states
}

#[test]
fn kill9_of_the_daemon_during_a_create_or_a_delete_leaves_no_orphan_and_no_ghost() {
    let dir = fresh_state_dir("crash");
    let sd = dir.to_str().unwrap();
    // A VM that stays throughout, so that every restart also re-adopts.
    let mut d = Daemon::start(&["--state-dir", sd]);
    let r = d.req("POST", "/v1/vms", Some(&idle_vm("keep", 300)));
    assert_eq!(r.status, 201, "{}", r.text());
    // kill -9 at several points of a create, then of a delete: before the
    // VM process exists, while it starts, around the state write, after
    // the answer. The create and the delete take ~50-150 ms here.
    for (i, delay_ms) in [0u64, 15, 40, 80, 160].into_iter().enumerate() {
        for op in ["create", "delete"] {
            let name = format!("c{i}");
            let (method, path, body) = match op {
                "create" => ("POST", "/v1/vms".to_string(), Some(idle_vm(&name, 300))),
                _ => ("DELETE", format!("/v1/vms/{name}"), None),
            };
            let mut conn = d.conn();
            let t = std::thread::spawn(move || conn.req(method, &path, body.as_deref()).status);
            std::thread::sleep(Duration::from_millis(delay_ms));
            d.child.kill().unwrap();
            d.child.wait().unwrap();
            // 0: no answer (the request's reader panics on the cut connection).
            let answered = t.join().unwrap_or(0);
            drop(d);
            d = Daemon::start(&["--state-dir", sd]);
            let why =
                format!("kill -9 {delay_ms} ms into the {op} of {name} (answered {answered})");
            let states = consistent(&d, &dir, &why);
            assert_eq!(
                states.get("keep").map(String::as_str),
                Some("running"),
                "{why}: {states:?}"
            );
            let st = states.get(&name).map(String::as_str);
            match op {
                // Created and adopted, or not there at all.
                "create" => {
                    assert!(
                        matches!(st, None | Some("running")),
                        "{why}: {name} is {st:?}"
                    );
                    if answered == 201 {
                        assert_eq!(st, Some("running"), "{why}: answered, then lost");
                    }
                    if st.is_none() {
                        // The next round deletes it: make it again.
                        let r = d.req("POST", "/v1/vms", Some(&idle_vm(&name, 300)));
                        assert_eq!(r.status, 201, "{why}: {}", r.text());
                    }
                }
                // Deleted (its process gone), or still there and running.
                _ => {
                    assert!(
                        matches!(st, None | Some("running")),
                        "{why}: {name} is {st:?}"
                    );
                    if answered / 100 == 2 {
                        assert_eq!(st, None, "{why}: answered, yet still there");
                    }
                }
            }
        }
    }
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_vm_process_whose_daemon_died_before_it_started_does_not_run_on() {
    let dir = fresh_state_dir("late");
    let sd = dir.to_str().unwrap();
    // The VM process of "late" is slow to make its control socket: the
    // daemon dies after it sent the configuration, before the socket
    // exists, and the next daemon finds no socket to stop.
    let mut d = Daemon::start_with_env(
        &["--state-dir", sd],
        &[("CORRAL_FAULT", "vmproc-slow-start:late")],
    );
    let mut conn = d.conn();
    let t = std::thread::spawn(move || {
        conn.req("POST", "/v1/vms", Some(&idle_vm("late", 300)))
            .status
    });
    let pid = wait_until(Duration::from_secs(10), || vm_pid(&dir, "late"))
        .expect("the VM process of late was started");
    std::thread::sleep(Duration::from_millis(300));
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    assert_eq!(t.join().unwrap_or(0), 0, "answered before it could have");
    drop(d);
    let d = Daemon::start(&["--state-dir", sd]);
    let r = d.req("GET", "/v1/vms/late", None);
    assert_eq!(r.status, 404, "{}", r.text());
    // Once it gets on, it finds its daemon gone before it could report:
    // it stops instead of running on unknown (it used to run on).
    let ended = wait_until(Duration::from_secs(20), || {
        (gone(pid) && vm_pid(&dir, "late").is_none()).then_some(())
    });
    assert!(
        ended.is_some(),
        "an orphan VM process: {:?}",
        vm_processes(&dir)
    );
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A VM process whose console is busy when its daemon dies still notices
/// that it is unsupervised. The console pump's send to the dead daemon
/// used to fail first and drop the daemon link, and the control thread,
/// which then found no link to drop, took the end of its connection for a
/// status query's and left the process "supervised" (its gate not
/// released) until a daemon adopted it: the cause of the kill -9 test's
/// intermittent failure (session 9). Here the VMs print every millisecond
/// and their control threads are made slow to act on the daemon's end
/// (`vmproc-slow-lost-daemon`), so the pump always fails first.
#[test]
fn a_vm_printing_when_its_daemon_dies_knows_it_is_unsupervised() {
    const N: usize = 2;
    let dir = fresh_state_dir("busy");
    let sd = dir.to_str().unwrap();
    let faults: Vec<String> = (0..N)
        .map(|i| format!("vmproc-slow-lost-daemon:b{i}"))
        .collect();
    let mut d =
        Daemon::start_with_env(&["--state-dir", sd], &[("CORRAL_FAULT", &faults.join(","))]);
    let mut pids = Vec::new();
    for i in 0..N {
        let spec = json!({"name": format!("b{i}"), "memory_mib": 32, "vcpus": 1,
            "cmdline": "probe.mode=spin probe.secs=60 probe.interval_ms=1"})
        .to_string();
        let r = d.req("POST", "/v1/vms", Some(&spec));
        assert_eq!(r.status, 201, "{}", r.text());
        pids.push(api_pid(&d, &format!("b{i}")));
    }
    for i in 0..N {
        let printing = wait_until(Duration::from_secs(10), || {
            d.req("GET", &format!("/v1/vms/b{i}/console"), None)
                .text()
                .contains("PROBE-PROGRESS")
                .then_some(())
        });
        assert!(printing.is_some(), "b{i} prints no progress");
    }
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    drop(d);
    let mut stuck = Vec::new();
    for i in 0..N {
        let sock = adopt::control_socket(&dir, &format!("b{i}"));
        let st = wait_until(Duration::from_secs(5), || {
            let st = status_on_socket(&sock);
            st.unsupervised.then_some(st)
        });
        if st.is_none() {
            stuck.push(format!("b{i}"));
        }
    }
    for &p in &pids {
        kill9(p);
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        stuck.is_empty(),
        "still supervised 5 s after their daemon's kill -9: {stuck:?}"
    );
}
