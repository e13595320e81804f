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

/// The pid of VM `name`'s process (its command line names its control
/// socket in `state_dir`).
fn vm_pid(state_dir: &Path, name: &str) -> Option<i32> {
    let sock = adopt::control_socket(state_dir, name);
    let sock = sock.to_string_lossy();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        (cmd.contains(" vmm ") && cmd.contains(&format!("{sock} "))).then_some(pid)
    })
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

/// Asks a VM process for its status on its control socket, as a daemon.
fn status_on_socket(path: &Path) -> corral_vmm::vmproc::proto::Status {
    let s = adopt::connect(path).expect("connect to the VM's control socket");
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
    for n in ["victim", "other"] {
        let r = d.req("POST", "/v1/vms", Some(&idle_vm(n, 60)));
        assert_eq!(r.status, 201, "{}", r.text());
    }
    let pid = vm_pid(&d.state_dir, "victim").expect("victim runs in a process of its own");
    let other = vm_pid(&d.state_dir, "other").expect("other runs in a process of its own");
    assert_ne!(pid, other);
    // SAFETY: kill(2) of the VM process found above.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
    let v = wait_until(Duration::from_secs(10), || {
        let v = get(&d, "/v1/vms/victim");
        (v["state"] == "failed").then_some(v)
    })
    .unwrap_or_else(|| panic!("victim not failed: {}", get(&d, "/v1/vms/victim")));
    assert_eq!(v["exit"]["reason"], "vm_process", "{v}");
    let msg = v["exit"]["message"].as_str().unwrap();
    assert!(
        msg.contains("signal 9") && msg.contains(&pid.to_string()),
        "{msg}"
    );
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
    // The failed VM's booking is given back.
    let st = wait_until(Duration::from_secs(5), || {
        let st = get(&d, "/v1/status");
        (st["memory_mib"] == 32).then_some(st)
    });
    assert!(st.is_some(), "{}", get(&d, "/v1/status"));
}

#[test]
fn vms_outlive_kill9_of_the_daemon_and_the_next_one_adopts_them() {
    let dir = std::env::temp_dir().join(format!("corral-vmproc-{}-adopt", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let sd = dir.to_str().unwrap();
    let mut d = Daemon::start(&["--state-dir", sd]);
    let r = d.req("POST", "/v1/vms", Some(&idle_vm("v", 120)));
    assert_eq!(r.status, 201, "{}", r.text());
    let pid = vm_pid(&dir, "v").expect("v runs in a process");
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    drop(d);
    // The VM runs on without a daemon, and says so.
    assert!(
        Path::new(&format!("/proc/{pid}")).exists(),
        "the VM died with the daemon"
    );
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
    assert_eq!(vm_pid(&dir, "v"), Some(pid), "the same process");
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
    let gone = wait_until(Duration::from_secs(10), || {
        (!Path::new(&format!("/proc/{pid}")).exists()).then_some(())
    });
    assert!(gone.is_some(), "stopped, yet its process is still there");
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_hundred_vms_are_readopted_after_a_restart() {
    const N: usize = 100;
    let dir = std::env::temp_dir().join(format!("corral-vmproc-{}-100", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
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
