//! State that survives the daemon (issue 15, item 4): classes, VM
//! definitions and live changes are in `state.json` in the state directory
//! before the API answers; a daemon killed with SIGKILL and started again
//! on the directory has them back, its VMs stopped (`daemon_restarted`) and
//! `start` runs them. Killed during a stream of class changes, creates and
//! deletes, it comes back with what the API last answered or the change in
//! flight, nothing in between. A corrupt or unknown state file is refused (and
//! `--state-from-backup` loads the previous one); a write that fails
//! (disk full) answers 507 and changes nothing. Two daemons on one state
//! directory: `security_api::state_dir_is_locked`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use corral_tests::api::{Daemon, spin_vm, wait_until};
use serde_json::{Value, json};

fn state_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("corral-persist-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn start_on(dir: &Path, extra: &[&str]) -> Daemon {
    let mut args = vec!["--state-dir", dir.to_str().expect("utf-8")];
    args.extend_from_slice(extra);
    Daemon::start(&args)
}

fn kill9(mut d: Daemon) {
    d.child.kill().expect("SIGKILL");
    d.child.wait().expect("wait");
}

fn get(d: &Daemon, path: &str) -> Value {
    let r = d.req("GET", path, None);
    assert_eq!(r.status, 200, "GET {path}: {}", r.text());
    r.json()
}

fn ok(d: &Daemon, method: &str, path: &str, body: Value) -> Value {
    let r = d.req(method, path, Some(&body.to_string()));
    assert!(r.status / 100 == 2, "{method} {path}: {}", r.text());
    r.json()
}

/// `corral serve` that is expected to refuse: its exit status and stderr.
fn refused(dir: &Path, extra: &[&str]) -> String {
    let sock = dir.with_extension("sock");
    let out = Command::new(corral_tests::corral_bin())
        .args(["serve", "--socket", sock.to_str().unwrap()])
        .args(["--state-dir", dir.to_str().unwrap()])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut child = out;
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("corral serve did not refuse the state file");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn disk(tag: &str) -> String {
    let p = std::env::temp_dir().join(format!("corral-persist-{}-{tag}.img", std::process::id()));
    std::fs::File::create(&p).unwrap().set_len(4 << 20).unwrap();
    p.to_str().unwrap().to_string()
}

/// A class tree and VMs with disks and limits, changed live, then SIGKILL.
fn populate(d: &Daemon, img: &str) {
    ok(
        d,
        "POST",
        "/v1/classes",
        json!({"name": "gold", "shares": 300, "cap": 150,
        "io": {"iops": 1000, "burst_ops": 50}}),
    );
    ok(
        d,
        "POST",
        "/v1/classes",
        json!({"name": "gold-a", "parent": "gold", "shares": 200,
        "reservation": 20}),
    );
    ok(
        d,
        "POST",
        "/v1/classes",
        json!({"name": "silver", "shares": 100}),
    );
    let v1 = json!({"name": "v1", "class": "gold-a", "weight": 200, "cap": 50, "memory_mib": 64,
        "cmdline": "probe.mode=spin probe.secs=120 probe.interval_ms=500",
        "disks": [{"id": "data", "path": img, "limits": {"iops": 500}}]});
    ok(d, "POST", "/v1/vms", v1);
    let r = d.req(
        "POST",
        "/v1/vms",
        Some(&spin_vm("v2", "silver", 1, 64, 120)),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    ok(d, "POST", "/v1/vms/v2/stop", json!({}));
    // Live changes after create.
    ok(d, "PATCH", "/v1/vms/v1/disks/data", json!({"iops": 700}));
    ok(
        d,
        "POST",
        "/v1/vms/v1/move",
        json!({"class": "gold", "weight": 300}),
    );
    ok(d, "PATCH", "/v1/vms/v1", json!({"cap": 60}));
    ok(d, "PATCH", "/v1/classes/silver", json!({"shares": 150}));
}

#[test]
fn classes_and_vms_survive_kill9_of_the_daemon() {
    let dir = state_dir("kill9");
    let img = disk("kill9");
    let d = start_on(&dir, &[]);
    populate(&d, &img);
    kill9(d);
    assert!(dir.join("state.json.bak").exists(), "no backup file");

    let d = start_on(&dir, &[]);
    let gold = get(&d, "/v1/classes/gold");
    assert_eq!(
        (gold["shares"].as_u64(), gold["cap"].as_u64()),
        (Some(300), Some(150))
    );
    assert_eq!(gold["io"]["iops"], 1000, "{gold}");
    assert_eq!(gold["io"]["burst_ops"], 50, "{gold}");
    let a = get(&d, "/v1/classes/gold-a");
    assert_eq!(a["parent"], "gold", "{a}");
    assert_eq!(a["reservation"], 20, "{a}");
    assert_eq!(get(&d, "/v1/classes/silver")["shares"], 150);
    // kill -9 of the daemon did not stop v1: its VM process ran on, and
    // the new daemon re-adopted it (issue 15).
    let v1 = get(&d, "/v1/vms/v1");
    assert_eq!(v1["state"], "running", "{v1}");
    assert_eq!(v1["class"], "gold", "{v1}");
    assert_eq!(v1["weight"], 300, "{v1}");
    assert_eq!(v1["cap"], 60, "{v1}");
    assert_eq!(v1["disks"][0]["limits"]["iops"], 700, "{v1}");
    let v2 = get(&d, "/v1/vms/v2");
    assert_eq!(v2["state"], "stopped", "{v2}");
    assert_eq!(v2["exit"]["reason"], "daemon_restarted", "{v2}");
    assert!(
        v2["exit"]["message"].as_str().unwrap().contains("start"),
        "{v2}"
    );
    // The re-adopted VM obeys the new daemon; start runs it again, with
    // its current settings.
    ok(&d, "POST", "/v1/vms/v1/stop", json!({}));
    assert_eq!(get(&d, "/v1/vms/v1")["state"], "stopped");
    let r = ok(&d, "POST", "/v1/vms/v1/start", json!({}));
    assert_eq!(r["state"], "running", "{r}");
    assert_eq!(r["cap"], 60, "{r}");
    assert_eq!(r["disks"][0]["limits"]["iops"], 700, "{r}");
    let up = wait_until(Duration::from_secs(20), || {
        d.req("GET", "/v1/vms/v1/console", None)
            .text()
            .contains("PROBE-PROGRESS")
            .then_some(())
    });
    assert!(up.is_some(), "v1 did not run after the restart");
    // Delete is persisted too.
    assert_eq!(d.req("DELETE", "/v1/vms/v2", None).status, 204);
    assert_eq!(d.req("DELETE", "/v1/classes/silver", None).status, 204);
    kill9(d);
    let d = start_on(&dir, &["--restart-vms"]);
    assert_eq!(d.req("GET", "/v1/vms/v2", None).status, 404);
    assert_eq!(d.req("GET", "/v1/classes/silver", None).status, 404);
    // --restart-vms: v1 was running, so it runs again.
    assert_eq!(get(&d, "/v1/vms/v1")["state"], "running");
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&img);
}

#[test]
fn a_corrupt_or_unknown_state_file_is_refused_and_the_backup_loads() {
    let dir = state_dir("corrupt");
    let d = start_on(&dir, &[]);
    ok(
        &d,
        "POST",
        "/v1/classes",
        json!({"name": "one", "shares": 100}),
    );
    ok(
        &d,
        "POST",
        "/v1/classes",
        json!({"name": "two", "shares": 200}),
    );
    kill9(d);
    let good = std::fs::read(dir.join("state.json")).unwrap();

    // Torn / garbage.
    std::fs::write(dir.join("state.json"), &good[..good.len() / 2]).unwrap();
    let err = refused(&dir, &[]);
    assert!(
        err.contains("state.json") && err.contains("not valid JSON"),
        "{err}"
    );
    assert!(err.contains("--state-from-backup"), "{err}");
    // Valid JSON, wrong content: never half-loaded.
    let mut v: Value = serde_json::from_slice(&good).unwrap();
    v["vms"] = json!([{"name": "x", "class": "nowhere"}]);
    std::fs::write(dir.join("state.json"), v.to_string()).unwrap();
    let err = refused(&dir, &[]);
    assert!(err.contains("not a corral state file"), "{err}");
    // Unknown version.
    let mut v: Value = serde_json::from_slice(&good).unwrap();
    v["version"] = json!(99);
    std::fs::write(dir.join("state.json"), v.to_string()).unwrap();
    let err = refused(&dir, &[]);
    assert!(err.contains("unknown format version 99"), "{err}");

    // The backup is the state before the last change: class one only.
    let d = start_on(&dir, &["--state-from-backup"]);
    assert_eq!(d.req("GET", "/v1/classes/one", None).status, 200);
    assert_eq!(d.req("GET", "/v1/classes/two", None).status, 404);
    assert!(dir.join("state.json.rejected").exists());
    drop(d);
    // And it was written back as the state.
    let d = start_on(&dir, &[]);
    assert_eq!(d.req("GET", "/v1/classes/one", None).status, 200);
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

struct Tmpfs(PathBuf);

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_full_disk_fails_the_request_with_507_and_changes_nothing() {
    let dir = state_dir("full");
    std::fs::create_dir_all(&dir).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"])
        .arg(&dir)
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        eprintln!(
            "SKIPPED: cannot mount a tmpfs on {} (not root?)",
            dir.display()
        );
        return;
    }
    let _mnt = Tmpfs(dir.clone());
    let state = dir.join("state");
    let d = start_on(&state, &[]);
    ok(
        &d,
        "POST",
        "/v1/classes",
        json!({"name": "kept", "shares": 100}),
    );
    let r = d.req("POST", "/v1/vms", Some(&spin_vm("vm", "kept", 1, 64, 120)));
    assert_eq!(r.status, 201, "{}", r.text());
    // Fill the file system.
    let filler = dir.join("filler");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&filler).unwrap();
        let block = vec![0u8; 4096];
        while f.write_all(&block).is_ok() {}
    }
    // The settings of every class (not its live figures).
    let classes = |d: &Daemon| -> Vec<Value> {
        get(d, "/v1/classes")
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                json!([
                    c["name"],
                    c["parent"],
                    c["shares"],
                    c["cap"],
                    c["reservation"],
                    c["io"],
                    c["vms"]
                ])
            })
            .collect()
    };
    let before = classes(&d);
    let r = d.req(
        "POST",
        "/v1/classes",
        Some(r#"{"name":"lost","shares":100}"#),
    );
    let msg = r.assert_error(507, "state_not_saved");
    assert!(msg.contains("state.json"), "{msg}");
    assert_eq!(d.req("GET", "/v1/classes/lost", None).status, 404);
    d.req("PATCH", "/v1/classes/kept", Some(r#"{"shares":900}"#))
        .assert_error(507, "state_not_saved");
    d.req("PATCH", "/v1/vms/vm", Some(r#"{"cap":30}"#))
        .assert_error(507, "state_not_saved");
    d.req("DELETE", "/v1/vms/vm", None)
        .assert_error(507, "state_not_saved");
    d.req("POST", "/v1/vms/vm/stop", None)
        .assert_error(507, "state_not_saved");
    // Nothing changed in memory.
    assert_eq!(classes(&d), before);
    let vm = get(&d, "/v1/vms/vm");
    assert_eq!(
        (vm["state"].as_str(), vm["cap"].as_u64()),
        (Some("running"), None),
        "{vm}"
    );
    // Space again: the change goes through, and the file is the last good
    // one in between (a restart shows what the API answered).
    std::fs::remove_file(&filler).unwrap();
    ok(&d, "PATCH", "/v1/classes/kept", json!({"shares": 900}));
    kill9(d);
    let d = start_on(&state, &[]);
    assert_eq!(get(&d, "/v1/classes/kept")["shares"], 900);
    assert_eq!(d.req("GET", "/v1/classes/lost", None).status, 404);
    assert!(get(&d, "/v1/vms/vm")["cap"].is_null());
}

#[test]
fn kill9_during_changes_leaves_the_last_answered_state_or_the_one_in_flight() {
    use std::collections::BTreeSet;
    use std::sync::Mutex;
    let dir = state_dir("inflight");
    let d = start_on(&dir, &[]);
    ok(&d, "POST", "/v1/classes", json!({"name": "c", "shares": 1}));
    // What the API answered: the class's shares, the VMs created and not
    // deleted; and the one change in flight when the daemon died.
    let acked = Mutex::new((1u64, BTreeSet::<String>::new()));
    let inflight = Mutex::new(String::new());
    std::thread::scope(|s| {
        s.spawn(|| {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                for i in 2u64.. {
                    *inflight.lock().unwrap() = format!("shares {i}");
                    let body = json!({"shares": i}).to_string();
                    if d.req("PATCH", "/v1/classes/c", Some(&body)).status != 200 {
                        return;
                    }
                    acked.lock().unwrap().0 = i;
                    let name = format!("t{i}");
                    *inflight.lock().unwrap() = format!("create {name}");
                    let r = d.req("POST", "/v1/vms", Some(&spin_vm(&name, "c", 1, 16, 30)));
                    if r.status != 201 {
                        return;
                    }
                    acked.lock().unwrap().1.insert(name);
                    if i % 3 == 0 {
                        let old = format!("t{}", i - 1);
                        *inflight.lock().unwrap() = format!("delete {old}");
                        if d.req("DELETE", &format!("/v1/vms/{old}"), None).status != 204 {
                            return;
                        }
                        acked.lock().unwrap().1.remove(&old);
                    }
                }
            }));
            drop(result); // the daemon died under a request
        });
        std::thread::sleep(Duration::from_millis(700));
        // SAFETY: kill(2) on our own child.
        unsafe {
            libc::kill(d.child.id() as i32, libc::SIGKILL);
        }
    });
    drop(d);
    let (shares, vms) = acked.into_inner().unwrap();
    let inflight = inflight.into_inner().unwrap();
    assert!(shares > 3, "too few changes before the kill ({shares})");
    let d = start_on(&dir, &[]);
    let got = get(&d, "/v1/classes/c")["shares"].as_u64().unwrap();
    let listed: BTreeSet<String> = get(&d, "/v1/vms")
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_string())
        .collect();
    let diff: Vec<&String> = listed.symmetric_difference(&vms).collect();
    match inflight.split_once(' ') {
        Some(("shares", n)) => {
            assert!(
                got == shares || got.to_string() == n,
                "{got} vs {shares}/{n}"
            );
            assert!(diff.is_empty(), "{diff:?} (in flight: {inflight})");
        }
        Some((_, name)) => {
            assert_eq!(got, shares);
            assert!(
                diff.iter().all(|n| *n == name),
                "{diff:?} (in flight: {inflight})"
            );
        }
        None => panic!("nothing was in flight"),
    }
    eprintln!(
        "killed during {inflight:?}: shares {got}, {} VMs",
        listed.len()
    );
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}
