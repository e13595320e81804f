//! The VM-process protocol's version across a daemon restart (issue 15): a
//! daemon that finds, on a VM's control socket, a VM process that speaks
//! protocol version 1 (the build before the version header) does not adopt
//! it. It reports the VM `failed` with `exit.reason = "not_adopted"` and
//! both versions named, leaves the process running (it is not a stray),
//! refuses to start a second process for the VM while it runs, and keeps
//! its record in the state file for a daemon of its version. The daemon
//! before this change adopted it: the VM showed `running`, its shares
//! silently not enforced (no scheduler gate came back).

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use corral_tests::api::{Daemon, KEEP_VMS, wait_until};
use corral_vmm::vmproc::{adopt, wire};
use serde_json::{Value, json};

const FAKE_ENV: &str = "CORRAL_FAKE_V1_VM_SOCKET";

/// Sends one datagram.
fn send(fd: &OwnedFd, v: &Value) {
    let b = v.to_string();
    // SAFETY: send(2) of a buffer that outlives the call on our own socket.
    unsafe {
        libc::send(
            fd.as_raw_fd(),
            b.as_ptr().cast(),
            b.len(),
            libc::MSG_NOSIGNAL,
        );
    }
}

/// One connection to the fake VM process, answered as a version-1 VM
/// process answers: version 1's messages have no header, and it refused a
/// message with one (`version` was an unknown field of its `ToVm`).
fn serve_v1(c: OwnedFd) {
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        // SAFETY: recv(2) into our buffer, at most its length.
        let n = unsafe { libc::recv(c.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        let Ok(n) = usize::try_from(n) else { return };
        if n == 0 {
            return;
        }
        let Ok(m) = serde_json::from_slice::<Value>(buf.get(..n).unwrap_or_default()) else {
            continue;
        };
        if m.get("version").is_some() {
            send(
                &c,
                &json!({"reply": {"id": 0, "resp": {"error": {
                    "message": "VM process protocol: unknown field `version`, expected `id` or `req`",
                    "kind": "other"}}}}),
            );
            continue;
        }
        let id = m["id"].as_u64().unwrap_or(0);
        let resp = match m["req"].as_str() {
            Some("status") => json!({"status": {
                "name": "old", "nonce": "v1-run", "pid": std::process::id(),
                "paused": false, "parked": false, "unsupervised": true, "exit": null,
                "vcpu_tids": [], "device_tid": null, "uptime_secs": 5.0}}),
            Some("files") => json!({"files": []}),
            Some("stop") => std::process::exit(0),
            _ => json!("ok"),
        };
        if id != 0 {
            send(&c, &json!({"reply": {"id": id, "resp": resp}}));
        }
    }
}

/// The fake version-1 VM process (a child of the test below, which runs
/// this binary again for it): listens on the socket named by the
/// environment until it is killed.
#[test]
#[ignore = "the fake VM process of a_vm_process_of_protocol_version_1_is_not_adopted (run by it)"]
fn fake_v1_vm_process() {
    let Some(path) = std::env::var_os(FAKE_ENV) else {
        return;
    };
    let l = wire::listen(Path::new(&path)).expect("listen");
    loop {
        // SAFETY: accept(2) on our listening socket; the fd it returns is
        // new and ours.
        let c = unsafe { libc::accept(l.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut()) };
        if c < 0 {
            continue;
        }
        // SAFETY: `c` is a new fd that nothing else owns.
        let c = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(c) };
        std::thread::spawn(move || serve_v1(c));
    }
}

#[test]
fn a_vm_process_of_protocol_version_1_is_not_adopted() {
    let dir = std::env::temp_dir().join(format!("corral-vmproc-v1-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("vms")).unwrap();
    for p in [&dir, &dir.join("vms")] {
        std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    }
    let sock = adopt::control_socket(&dir, "old");
    let mut fake = Command::new(std::env::current_exe().unwrap())
        .args([
            "fake_v1_vm_process",
            "--exact",
            "--ignored",
            "--test-threads=1",
        ])
        .env(FAKE_ENV, &sock)
        .stdout(Stdio::null())
        .spawn()
        .expect("the fake VM process");
    let up = wait_until(Duration::from_secs(10), || sock.exists().then_some(()));
    assert!(up.is_some(), "the fake VM process did not bind its socket");
    let state = json!({
        "version": 1,
        "classes": [{"name": "default", "parent": null, "shares": 100, "cap": null,
                     "reservation": null, "io": {}}],
        "vms": [{"name": "old", "class": "default", "weight": 100, "cap": null, "vcpus": 1,
                 "memory_mib": 32, "kernel": null, "initrd": null, "cmdline": null,
                 "disks": [], "running": true,
                 "process": {"pid": fake.id(), "nonce": "v1-run"}}]
    });
    std::fs::File::create(dir.join("state.json"))
        .and_then(|mut f| f.write_all(state.to_string().as_bytes()))
        .unwrap();
    let d = Daemon::start(&["--state-dir", dir.to_str().unwrap(), KEEP_VMS]);
    let r = d.req("GET", "/v1/vms/old", None);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(
        v["state"], "failed",
        "a version-1 VM process was adopted: {v}"
    );
    assert_eq!(v["exit"]["reason"], "not_adopted", "{v}");
    let msg = v["exit"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("version 1") && msg.contains("version 3"),
        "the reason names both versions: {msg}"
    );
    // Left running: not stopped as a stray, not killed.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        fake.try_wait().unwrap().is_none(),
        "the VM process was stopped"
    );
    // No second process for the VM while it runs.
    let r = d.req("POST", "/v1/vms/old/start", None);
    assert_eq!(
        r.status,
        409,
        "start beside the running process: {}",
        r.text()
    );
    // The state keeps its record, for a daemon of its version.
    let saved: Value =
        serde_json::from_slice(&std::fs::read(dir.join("state.json")).unwrap()).unwrap();
    assert_eq!(saved["vms"][0]["process"]["pid"], fake.id(), "{saved}");
    drop(d);
    let _ = fake.kill();
    let _ = fake.wait();
    let _ = std::fs::remove_dir_all(&dir);
}
