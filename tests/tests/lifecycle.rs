//! A defined VM's lifecycle through the real daemon: stop keeps the
//! definition and gives back its memory booking, its `max_vms` slot and its
//! image locks; start runs it again from the definition; reboot; a graceful
//! shutdown through the ACPI power button that a guest honours (or a hard
//! stop at the deadline when it does not); console input, through the API
//! and through `corral vm console --attach`.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use corral_tests::api::{Daemon, spin_vm, wait_until};
use serde_json::json;

fn state(d: &Daemon, name: &str) -> String {
    d.req("GET", &format!("/v1/vms/{name}"), None).json()["state"]
        .as_str()
        .unwrap_or("?")
        .to_string()
}

fn post(d: &Daemon, path: &str, body: Option<&str>) -> corral_tests::api::Resp {
    d.req("POST", path, body)
}

fn console(d: &Daemon, name: &str) -> String {
    d.req("GET", &format!("/v1/vms/{name}/console"), None)
        .text()
}

#[test]
fn stop_keeps_the_definition_and_frees_what_it_booked() {
    let d = Daemon::start(&["--memory-budget", "128", "--max-vms", "2"]);
    for n in ["a", "b"] {
        let r = post(&d, "/v1/vms", Some(&spin_vm(n, "default", 1, 64, 120)));
        assert_eq!(r.status, 201, "{}", r.text());
    }
    // Full: the budget (and max-vms) refuse a third.
    let r = post(&d, "/v1/vms", Some(&spin_vm("c", "default", 1, 64, 120)));
    assert_eq!(r.status, 422, "{}", r.text());

    let r = post(&d, "/v1/vms/a/stop", None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["state"], "stopped");
    // Still defined, shown with its definition.
    let a = d.req("GET", "/v1/vms/a", None).json();
    assert_eq!(a["state"], "stopped");
    assert_eq!(a["memory_mib"], 64);
    let st = d.req("GET", "/v1/status", None).json();
    assert_eq!(st["memory_mib"], 64, "{st}");
    // Its booking is free: c fits now.
    let r = post(&d, "/v1/vms", Some(&spin_vm("c", "default", 1, 64, 120)));
    assert_eq!(r.status, 201, "{}", r.text());
    // Stopping again is fine; starting a stopped VM that does not fit is
    // refused and keeps it defined.
    assert_eq!(post(&d, "/v1/vms/a/stop", None).status, 200);
    let r = post(&d, "/v1/vms/a/start", None);
    assert_eq!(r.status, 422, "{}", r.text());
    assert_eq!(state(&d, "a"), "stopped");
    // A running VM cannot be started.
    post(&d, "/v1/vms/b/start", None).assert_error(409, "conflict");
    // Room again: a starts from its definition (a new boot).
    assert_eq!(d.req("DELETE", "/v1/vms/c", None).status, 204);
    let r = post(&d, "/v1/vms/a/start", None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["state"], "running");
    assert_eq!(r.json()["memory_mib"], 64);
    let up = wait_until(Duration::from_secs(20), || {
        console(&d, "a").contains("PROBE-PROGRESS").then_some(())
    });
    assert!(up.is_some(), "a did not run again: {}", console(&d, "a"));
    post(&d, "/v1/vms/ghost/stop", None).assert_error(404, "not_found");
}

#[test]
fn a_vm_that_stops_by_itself_gives_its_booking_back() {
    let d = Daemon::start(&["--memory-budget", "64"]);
    // The boot job ends at once (i8042 reset): state shutdown.
    let body = json!({"name": "short", "vcpus": 1, "memory_mib": 64}).to_string();
    assert_eq!(post(&d, "/v1/vms", Some(&body)).status, 201);
    let gone = wait_until(Duration::from_secs(20), || {
        (state(&d, "short") == "shutdown").then_some(())
    });
    assert!(gone.is_some(), "{}", state(&d, "short"));
    let r = post(&d, "/v1/vms", Some(&spin_vm("next", "default", 1, 64, 5)));
    assert_eq!(r.status, 201, "{}", r.text());
}

#[test]
fn stop_releases_the_image_lock_and_start_takes_it_again() {
    let d = Daemon::start(&[]);
    let img = d.image_path("shared.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let vm = |name: &str| {
        json!({
            "name": name, "vcpus": 1, "memory_mib": 32,
            "cmdline": "probe.mode=spin probe.secs=120",
            "disks": [{"id": "d", "path": img.to_str().unwrap()}],
        })
        .to_string()
    };
    assert_eq!(post(&d, "/v1/vms", Some(&vm("one"))).status, 201);
    let r = post(&d, "/v1/vms", Some(&vm("two")));
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(post(&d, "/v1/vms/one/stop", None).status, 200);
    assert_eq!(post(&d, "/v1/vms", Some(&vm("two"))).status, 201);
    // one's image is now two's: starting one is a conflict naming two.
    let r = post(&d, "/v1/vms/one/start", None);
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(r.text().contains("two"), "{}", r.text());
    assert_eq!(state(&d, "one"), "stopped");
}

#[test]
fn reboot_boots_the_guest_again() {
    let d = Daemon::start(&[]);
    assert_eq!(
        post(&d, "/v1/vms", Some(&spin_vm("r", "default", 1, 32, 120))).status,
        201
    );
    let id0 = d.req("GET", "/v1/vms/r", None).json()["id"].clone();
    let r = post(&d, "/v1/vms/r/reboot", None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["state"], "running");
    assert_ne!(r.json()["id"], id0, "a new run");
    let up = wait_until(Duration::from_secs(20), || {
        console(&d, "r").contains("PROBE-UP").then_some(())
    });
    assert!(up.is_some(), "{}", console(&d, "r"));
}

#[test]
fn shutdown_presses_the_power_button_then_stops_hard() {
    let d = Daemon::start(&[]);
    let honours = json!({
        "name": "polite", "vcpus": 1, "memory_mib": 32,
        "cmdline": "probe.mode=spin probe.secs=120 probe.pwrbtn=1",
    })
    .to_string();
    assert_eq!(post(&d, "/v1/vms", Some(&honours)).status, 201);
    assert_eq!(
        post(&d, "/v1/vms", Some(&spin_vm("deaf", "default", 1, 32, 120))).status,
        201
    );
    for n in ["polite", "deaf"] {
        let up = wait_until(Duration::from_secs(20), || {
            console(&d, n).contains("PROBE-PROGRESS").then_some(())
        });
        assert!(up.is_some(), "{n}: {}", console(&d, n));
    }
    // The request answers at once (202); the guest that honours the button
    // powers off (S5) well before the deadline.
    let ended = |name: &str, timeout: Duration| {
        wait_until(timeout, || {
            let s = state(&d, name);
            (s != "running").then_some(s)
        })
    };
    let t0 = Instant::now();
    let r = post(
        &d,
        "/v1/vms/polite/shutdown",
        Some(r#"{"timeout_seconds": 20}"#),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert_eq!(
        ended("polite", Duration::from_secs(10)).as_deref(),
        Some("shutdown")
    );
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert!(console(&d, "polite").contains("PROBE-POWER-BUTTON"));
    // The one that ignores it is stopped hard at the deadline (and asking
    // again meanwhile starts no second wait).
    let t0 = Instant::now();
    let r = post(
        &d,
        "/v1/vms/deaf/shutdown",
        Some(r#"{"timeout_seconds": 1}"#),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    assert_eq!(r.json()["state"], "running");
    assert_eq!(post(&d, "/v1/vms/deaf/shutdown", None).status, 202);
    assert_eq!(
        ended("deaf", Duration::from_secs(10)).as_deref(),
        Some("stopped")
    );
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(8),
        "{took:?}"
    );
    // The CLI waits for the outcome.
    assert_eq!(post(&d, "/v1/vms/polite/start", None).status, 200);
    let up = wait_until(Duration::from_secs(20), || {
        console(&d, "polite")
            .contains("PROBE-PROGRESS")
            .then_some(())
    });
    assert!(up.is_some());
    let o = Command::new(corral_tests::corral_bin())
        .args(["vm", "shutdown", "polite", "--timeout", "20", "--socket"])
        .arg(&d.socket)
        .output()
        .expect("corral vm shutdown");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("polite powered off"),
        "{out}"
    );
    // Bad deadlines are refused; the definition can start again.
    post(
        &d,
        "/v1/vms/deaf/shutdown",
        Some(r#"{"timeout_seconds": 9999}"#),
    )
    .assert_error(400, "bad_request");
    post(&d, "/v1/vms/deaf/shutdown", Some(r#"{"timeout": 1}"#)).assert_error(400, "bad_request");
    post(&d, "/v1/vms/ghost/shutdown", None).assert_error(404, "not_found");
    assert_eq!(post(&d, "/v1/vms/deaf/start", None).status, 200);
}

fn echo_vm(d: &Daemon, name: &str) {
    let body = json!({
        "name": name, "vcpus": 1, "memory_mib": 32,
        "cmdline": "probe.mode=echo probe.secs=60",
    })
    .to_string();
    assert_eq!(post(d, "/v1/vms", Some(&body)).status, 201);
    let ready = wait_until(Duration::from_secs(20), || {
        console(d, name).contains("PROBE-ECHO-READY").then_some(())
    });
    assert!(ready.is_some(), "{}", console(d, name));
}

#[test]
fn console_input_reaches_the_guest() {
    let d = Daemon::start(&[]);
    echo_vm(&d, "echo");
    let r = post(
        &d,
        "/v1/vms/echo/console",
        Some(r#"{"data": "hello corral\n"}"#),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["accepted"], 13);
    let echoed = wait_until(Duration::from_secs(10), || {
        console(&d, "echo")
            .contains("PROBE-ECHO hello corral")
            .then_some(())
    });
    assert!(echoed.is_some(), "{}", console(&d, "echo"));
    // Bounded, typed, and only for running VMs.
    let big = json!({ "data": "x".repeat(5000) }).to_string();
    post(&d, "/v1/vms/echo/console", Some(&big)).assert_error(400, "bad_request");
    post(&d, "/v1/vms/echo/console", Some(r#"{"text": "x"}"#)).assert_error(400, "bad_request");
    assert_eq!(post(&d, "/v1/vms/echo/stop", None).status, 200);
    post(&d, "/v1/vms/echo/console", Some(r#"{"data": "x"}"#)).assert_error(409, "conflict");
}

#[test]
fn console_attach_sends_what_is_typed() {
    let d = Daemon::start(&[]);
    echo_vm(&d, "tty");
    let mut child = Command::new(corral_tests::corral_bin())
        .args(["vm", "console", "tty", "--attach", "--socket"])
        .arg(&d.socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("corral vm console --attach");
    let mut stdin = child.stdin.take().unwrap();
    // What the attached client prints, read as it comes.
    let shown = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut stdout = child.stdout.take().unwrap();
    let sink = shown.clone();
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = std::io::Read::read(&mut stdout, &mut buf) {
            if n == 0 {
                break;
            }
            sink.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    let saw = |what: &str| String::from_utf8_lossy(&shown.lock().unwrap()).contains(what);
    stdin.write_all(b"typed line\n").unwrap();
    let echoed = wait_until(Duration::from_secs(10), || {
        saw("PROBE-ECHO typed line").then_some(())
    });
    assert!(
        echoed.is_some(),
        "the attached console does not show the guest's answer; the VM's console: {}",
        console(&d, "tty")
    );
    // Ctrl-] detaches: the client exits 0 and the VM goes on.
    stdin.write_all(&[0x1d]).unwrap();
    drop(stdin);
    let done = wait_until(Duration::from_secs(10), || child.try_wait().ok().flatten());
    let status = done.unwrap_or_else(|| {
        let _ = child.kill();
        panic!("--attach did not detach");
    });
    let out = child.wait_with_output().unwrap();
    let _ = reader.join();
    assert!(status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(state(&d, "tty"), "running");
}
