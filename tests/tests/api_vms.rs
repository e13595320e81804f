//! The daemon end to end over HTTP with real probe VMs: VM and class
//! lifecycle, class moves, console tail and streaming, error shapes, a
//! crashing guest, graceful shutdown, and the CLI as a client.

use std::time::{Duration, Instant};

use corral_tests::api::{Daemon, spin_vm, wait_until};
use corral_tests::{run_corral, text};
use serde_json::json;

const T: Duration = Duration::from_secs(30);

#[test]
fn vm_lifecycle_and_console() {
    let d = Daemon::start(&[]);
    let r = d.req("GET", "/v1/status", None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["vms"], 0);

    // Create: 201 with the VM, running.
    let r = d.req(
        "POST",
        "/v1/vms",
        Some(&spin_vm("web", "default", 2, 32, 20)),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    assert_eq!(v["name"], "web");
    assert_eq!(v["state"], "running");
    assert_eq!(v["class"], "default");
    assert_eq!(v["vcpus"], 2);
    assert_eq!(v["memory_mib"], 32);
    assert!(v["exit"].is_null());

    // Duplicate name: 409.
    d.req(
        "POST",
        "/v1/vms",
        Some(&spin_vm("web", "default", 1, 32, 1)),
    )
    .assert_error(409, "conflict");

    // Server-assigned name.
    let r = d.req("POST", "/v1/vms", Some(r#"{"memory_mib": 16}"#));
    assert_eq!(r.status, 201, "{}", r.text());
    let auto = r.json()["name"].as_str().unwrap().to_string();
    assert!(auto.starts_with("vm-"), "{auto}");

    // List and get.
    let r = d.req("GET", "/v1/vms", None);
    let names: Vec<String> = r
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_string())
        .collect();
    assert!(
        names.contains(&"web".to_string()) && names.contains(&auto),
        "{names:?}"
    );

    // Console: the probe reports progress; tail=N gives at most N lines.
    let tail = wait_until(T, || {
        let r = d.req("GET", "/v1/vms/web/console?tail=2", None);
        assert_eq!(r.status, 200);
        let t = r.text();
        t.contains("PROBE-PROGRESS").then_some(t)
    })
    .expect("probe progress on the console");
    assert!(tail.lines().count() <= 2, "{tail:?}");
    let all = d.req("GET", "/v1/vms/web/console", None).text();
    assert!(all.starts_with("PROBE-UP\n"), "{all}");

    // The VM uses CPU: its cpu_seconds grow.
    let cpu = |d: &Daemon| {
        d.req("GET", "/v1/vms/web", None).json()["cpu_seconds"]
            .as_f64()
            .unwrap()
    };
    let c0 = cpu(&d);
    std::thread::sleep(Duration::from_millis(500));
    assert!(cpu(&d) > c0, "cpu_seconds must grow while spinning");

    // Delete: 204, then 404.
    let r = d.req("DELETE", "/v1/vms/web", None);
    assert_eq!(r.status, 204, "{}", r.text());
    d.req("GET", "/v1/vms/web", None)
        .assert_error(404, "not_found");
    d.req("DELETE", "/v1/vms/web", None)
        .assert_error(404, "not_found");
    // The name is free again.
    let r = d.req(
        "POST",
        "/v1/vms",
        Some(&spin_vm("web", "default", 1, 32, 1)),
    );
    assert_eq!(r.status, 201, "{}", r.text());
}

#[test]
fn guest_shutdown_shows_in_state_and_stream_ends() {
    let d = Daemon::start(&[]);
    let body = json!({"name": "short", "memory_mib": 16, "cmdline": "probe.mode=spin probe.secs=1 probe.interval_ms=200"});
    let r = d.req("POST", "/v1/vms", Some(&body.to_string()));
    assert_eq!(r.status, 201, "{}", r.text());
    // Follow the console: it streams and ends when the guest shuts down.
    let mut c = d.conn();
    c.send("GET", "/v1/vms/short/console?follow=true", None);
    let t0 = Instant::now();
    let r = c.read_response(None);
    assert_eq!(r.status, 200);
    let t = r.text();
    assert!(t.contains("PROBE-DONE status=ok"), "{t}");
    assert!(t0.elapsed() < T);
    let v = wait_until(T, || {
        let v = d.req("GET", "/v1/vms/short", None).json();
        (v["state"] != "running").then_some(v)
    })
    .unwrap();
    assert_eq!(v["state"], "shutdown", "{v}");
    assert_eq!(v["exit"]["reason"], "guest_shutdown", "{v}");
    assert!(v["uptime_seconds"].is_null());
    assert!(
        v["cpu_seconds"].as_f64().unwrap() > 0.2,
        "CPU time kept after exit: {v}"
    );
}

/// A minimal ELF64 whose code is `ud2`: with no IDT, a triple fault.
fn crashing_elf() -> Vec<u8> {
    let mut f = vec![0u8; 0x1000 + 16];
    f[0..4].copy_from_slice(b"\x7fELF");
    f[4] = 2;
    f[5] = 1;
    f[6] = 1;
    f[16..18].copy_from_slice(&2u16.to_le_bytes());
    f[18..20].copy_from_slice(&62u16.to_le_bytes());
    f[20..24].copy_from_slice(&1u32.to_le_bytes());
    f[24..32].copy_from_slice(&0x10_0000u64.to_le_bytes());
    f[32..40].copy_from_slice(&64u64.to_le_bytes());
    f[52..54].copy_from_slice(&64u16.to_le_bytes());
    f[54..56].copy_from_slice(&56u16.to_le_bytes());
    f[56..58].copy_from_slice(&1u16.to_le_bytes());
    let ph = 64;
    f[ph..ph + 4].copy_from_slice(&1u32.to_le_bytes());
    f[ph + 4..ph + 8].copy_from_slice(&5u32.to_le_bytes());
    f[ph + 8..ph + 16].copy_from_slice(&0x1000u64.to_le_bytes());
    f[ph + 16..ph + 24].copy_from_slice(&0x10_0000u64.to_le_bytes());
    f[ph + 24..ph + 32].copy_from_slice(&0x10_0000u64.to_le_bytes());
    f[ph + 32..ph + 40].copy_from_slice(&16u64.to_le_bytes());
    f[ph + 40..ph + 48].copy_from_slice(&16u64.to_le_bytes());
    f[ph + 48..ph + 56].copy_from_slice(&0x1000u64.to_le_bytes());
    f[0x1000] = 0x0f;
    f[0x1001] = 0x0b;
    f
}

#[test]
fn crashing_guest_fails_alone() {
    let d = Daemon::start(&[]);
    let r = d.req(
        "POST",
        "/v1/vms",
        Some(&spin_vm("survivor", "default", 1, 32, 30)),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let p = std::env::temp_dir().join(format!("corral-api-crash-{}.elf", std::process::id()));
    std::fs::write(&p, crashing_elf()).unwrap();
    let body =
        json!({"name": "crash", "kernel": p.to_str().unwrap(), "vcpus": 2, "memory_mib": 16});
    let r = d.req("POST", "/v1/vms", Some(&body.to_string()));
    assert_eq!(r.status, 201, "{}", r.text());
    let v = wait_until(T, || {
        let v = d.req("GET", "/v1/vms/crash", None).json();
        (v["state"] != "running").then_some(v)
    })
    .unwrap();
    std::fs::remove_file(&p).ok();
    assert_eq!(v["state"], "failed", "{v}");
    assert_eq!(v["exit"]["reason"], "fatal", "{v}");
    assert!(
        v["exit"]["message"].as_str().unwrap().contains("rip="),
        "{v}"
    );
    // The daemon and the other VM are fine.
    let s = d.req("GET", "/v1/vms/survivor", None).json();
    assert_eq!(s["state"], "running", "{s}");
    assert_eq!(d.req("DELETE", "/v1/vms/crash", None).status, 204);
}

#[test]
fn classes_and_move() {
    let d = Daemon::start(&["--capacity", "200"]);
    let r = d.req(
        "POST",
        "/v1/classes",
        Some(r#"{"name":"gold","shares":300,"io":{"bps":10485760}}"#),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["io"]["bps"], 10485760);
    d.req("POST", "/v1/classes", Some(r#"{"name":"gold"}"#))
        .assert_error(409, "conflict");
    // PUT creates (201) then replaces (200).
    let r = d.req(
        "PUT",
        "/v1/classes/bronze",
        Some(r#"{"shares":100,"cap":50}"#),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let r = d.req(
        "PUT",
        "/v1/classes/bronze",
        Some(r#"{"shares":100,"cap":80}"#),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["cap"], 80);
    // PATCH: change shares, remove the cap with null.
    let r = d.req(
        "PATCH",
        "/v1/classes/bronze",
        Some(r#"{"shares":150,"cap":null}"#),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["shares"], 150);
    assert!(r.json()["cap"].is_null());
    // Admission control: reservations beyond capacity (200 %) are refused.
    let r = d.req("PATCH", "/v1/classes/gold", Some(r#"{"reservation":150}"#));
    assert_eq!(r.status, 200, "{}", r.text());
    d.req(
        "PATCH",
        "/v1/classes/bronze",
        Some(r#"{"reservation":100}"#),
    )
    .assert_error(422, "refused");
    d.req(
        "POST",
        "/v1/classes",
        Some(r#"{"name":"big","reservation":300}"#),
    )
    .assert_error(422, "refused");

    let r = d.req("POST", "/v1/vms", Some(&spin_vm("a", "gold", 1, 32, 30)));
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["class"], "gold");
    // In use: 409.
    d.req("DELETE", "/v1/classes/gold", None)
        .assert_error(409, "conflict");
    // Move live, with a weight.
    let r = d.req(
        "POST",
        "/v1/vms/a/move",
        Some(r#"{"class":"bronze","weight":200}"#),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["class"], "bronze");
    assert_eq!(r.json()["weight"], 200);
    assert_eq!(r.json()["state"], "running");
    let c = d.req("GET", "/v1/classes/bronze", None).json();
    assert_eq!(c["vms"], json!(["a"]));
    d.req("POST", "/v1/vms/a/move", Some(r#"{"class":"nope"}"#))
        .assert_error(404, "not_found");
    // Now gold is empty and can go.
    assert_eq!(d.req("DELETE", "/v1/classes/gold", None).status, 204);
    d.req("GET", "/v1/classes/gold", None)
        .assert_error(404, "not_found");
    // A VM in an unknown class: 404.
    d.req("POST", "/v1/vms", Some(&spin_vm("b", "gold", 1, 32, 1)))
        .assert_error(404, "not_found");
}

#[test]
fn error_shapes() {
    let d = Daemon::start(&["--max-vms", "2"]);
    // Malformed JSON, unknown fields, wrong types, bad values: 400.
    d.req("POST", "/v1/vms", Some("{not json"))
        .assert_error(400, "bad_request");
    d.req("POST", "/v1/vms", Some(""))
        .assert_error(400, "bad_request");
    let m = d
        .req("POST", "/v1/vms", Some(r#"{"name":"x","colour":"red"}"#))
        .assert_error(400, "bad_request");
    assert!(m.contains("colour"), "{m}");
    d.req("POST", "/v1/vms", Some(r#"{"vcpus":"two"}"#))
        .assert_error(400, "bad_request");
    d.req("POST", "/v1/vms", Some(r#"{"vcpus":-1}"#))
        .assert_error(400, "bad_request");
    d.req("POST", "/v1/vms", Some(r#"{"vcpus":0}"#))
        .assert_error(400, "bad_request");
    d.req("POST", "/v1/vms", Some(r#"{"memory_mib":1}"#))
        .assert_error(400, "bad_request");
    d.req("POST", "/v1/vms", Some(r#"{"name":"../etc"}"#))
        .assert_error(400, "bad_request");
    // A missing file beneath an image directory (the temp dir here) is a
    // plain 400; outside them the host-path policy answers (security_paths).
    let missing = std::env::temp_dir().join("corral-nonexistent");
    let body = json!({"kernel": missing.join("vmlinux")});
    d.req("POST", "/v1/vms", Some(&body.to_string()))
        .assert_error(400, "bad_request");
    let body = json!({"kernel": "/nonexistent/vmlinux"});
    d.req("POST", "/v1/vms", Some(&body.to_string()))
        .assert_error(400, "path_policy");
    d.req("POST", "/v1/classes", Some(r#"{"name":"c","shares":0}"#))
        .assert_error(400, "bad_request");
    d.req(
        "POST",
        "/v1/classes",
        Some(r#"{"name":"c","shares":10001}"#),
    )
    .assert_error(400, "bad_request");
    d.req(
        "POST",
        "/v1/classes",
        Some(r#"{"name":"c","io":{"burst_ops":5}}"#),
    )
    .assert_error(400, "bad_request");
    d.req("PATCH", "/v1/classes/default", Some(r#"{"sharez":5}"#))
        .assert_error(400, "bad_request");
    d.req("GET", "/v1/vms/x/console?tail=abc", None)
        .assert_error(400, "bad_request");
    // Too large a body: 413.
    let big = format!(r#"{{"name":"x","cmdline":"{}"}}"#, "a".repeat(100_000));
    d.req("POST", "/v1/vms", Some(&big))
        .assert_error(413, "payload_too_large");
    // Unknown things: 404.
    d.req("GET", "/v1/nothing", None)
        .assert_error(404, "not_found");
    d.req("GET", "/v1/vms/ghost", None)
        .assert_error(404, "not_found");
    d.req("GET", "/v1/vms/ghost/console", None)
        .assert_error(404, "not_found");
    d.req(
        "PATCH",
        "/v1/vms/ghost/disks/disk0",
        Some(r#"{"bps":1000}"#),
    )
    .assert_error(404, "not_found");
    d.req("GET", "/v1/classes/ghost", None)
        .assert_error(404, "not_found");
    d.req("DELETE", "/v1/classes/ghost", None)
        .assert_error(404, "not_found");
    // Wrong method: 405 in the same shape.
    d.req("PUT", "/v1/vms", Some("{}"))
        .assert_error(405, "method_not_allowed");

    // Disks: validated before anything starts.
    let body = json!({"memory_mib":16,"disks":[{"path": missing.join("disk.img")}]});
    d.req("POST", "/v1/vms", Some(&body.to_string()))
        .assert_error(400, "bad_request");
    let body = json!({"memory_mib":16,"disks":[{"path": "/dev/null", "limits":{"burst_bytes":5}}]});
    d.req("POST", "/v1/vms", Some(&body.to_string()))
        .assert_error(400, "bad_request");
    let body = json!({"memory_mib":16,"disks":[[1, 2]]});
    d.req("POST", "/v1/vms", Some(&body.to_string()))
        .assert_error(400, "bad_request");

    // Resource limit: at most 2 VMs -> 422.
    for n in ["v1", "v2"] {
        let r = d.req("POST", "/v1/vms", Some(&spin_vm(n, "default", 1, 16, 30)));
        assert_eq!(r.status, 201, "{}", r.text());
    }
    d.req(
        "POST",
        "/v1/vms",
        Some(&spin_vm("v3", "default", 1, 16, 30)),
    )
    .assert_error(422, "refused");
    d.req("POST", "/v1/vms/ghost/pause", None)
        .assert_error(404, "not_found");
    // A disk the VM does not have: 404; bad limits: 400.
    d.req(
        "PATCH",
        "/v1/vms/v1/disks/disk0",
        Some(r#"{"burst_ops":1}"#),
    )
    .assert_error(400, "bad_request");
    d.req("PATCH", "/v1/vms/v1/disks/disk0", Some(r#"{"bps":1000}"#))
        .assert_error(404, "not_found");
    d.req("PATCH", "/v1/vms/v1/disks/disk0", Some(r#"{"bps":"fast"}"#))
        .assert_error(400, "bad_request");
    // Still healthy.
    assert_eq!(d.req("GET", "/v1/status", None).json()["running_vms"], 2);
}

#[test]
fn sigterm_stops_all_vms_and_exits() {
    let mut d = Daemon::start(&[]);
    for n in ["s1", "s2", "s3"] {
        let r = d.req("POST", "/v1/vms", Some(&spin_vm(n, "default", 2, 16, 60)));
        assert_eq!(r.status, 201, "{}", r.text());
    }
    // A console stream open during shutdown must not hold the daemon up.
    let mut c = d.conn();
    c.send("GET", "/v1/vms/s1/console?follow=true", None);
    let t0 = Instant::now();
    let st = d
        .terminate(Duration::from_secs(10))
        .expect("daemon exits on SIGTERM");
    assert!(st.success(), "{st:?}");
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    assert!(!d.socket.exists(), "socket removed on exit");
}

#[test]
fn cli_drives_the_daemon() {
    let d = Daemon::start(&[]);
    let sock = d.socket.to_str().unwrap().to_string();
    let cli = |args: &[&str]| {
        let mut a = vec!["--socket", sock.as_str()];
        a.extend_from_slice(args);
        let o = run_corral(&a, T);
        let (out, err) = text(&o);
        (o.status.code(), out, err)
    };
    let (code, out, err) = cli(&["class", "set", "gold", "--shares", "300"]);
    assert_eq!(code, Some(0), "{out}{err}");
    let (code, _, err) = cli(&["class", "set", "gold", "--cap", "150"]);
    assert_eq!(code, Some(0), "{err}");
    let (code, out, err) = cli(&[
        "vm",
        "create",
        "c1",
        "--class",
        "gold",
        "--vcpus",
        "1",
        "--memory",
        "32",
        "--cmdline",
        "probe.mode=spin probe.secs=20",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.trim(), "c1");
    let (code, out, _) = cli(&["vm", "list"]);
    assert_eq!(code, Some(0));
    assert!(out.lines().next().unwrap().starts_with("NAME"), "{out}");
    assert!(out.contains("c1") && out.contains("gold"), "{out}");
    let (_, out, _) = cli(&["--json", "class", "list"]);
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let gold = j
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "gold")
        .unwrap();
    assert_eq!(gold["shares"], 300);
    assert_eq!(gold["cap"], 150);
    let (code, _, err) = cli(&["class", "set", "bronze", "--shares", "100"]);
    assert_eq!(code, Some(0), "{err}");
    let (code, out, err) = cli(&["vm", "move", "c1", "bronze"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("bronze"), "{out}");
    let (code, out, err) = cli(&["--json", "top", "--once", "--interval", "0.5"]);
    assert_eq!(code, Some(0), "{err}");
    let j: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let c1 = j["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "c1")
        .unwrap();
    assert!(c1["cpu_pct"].as_f64().unwrap() > 10.0, "{j}");
    let (code, out, _) = cli(&["top", "--once", "--interval", "0.2"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("CPU%") && out.contains("PROMISED%"), "{out}");
    // Errors come back as one clear line, exit 1.
    let (code, _, err) = cli(&["class", "rm", "bronze"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("still has 1 VM"), "{err}");
    let (code, _, err) = cli(&["disk", "limit", "c1", "disk0", "bps=10M"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no disk"), "{err}");
    let (code, out, err) = cli(&["vm", "rm", "c1"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.trim(), "c1");
    let (code, _, err) = cli(&["vm", "show", "c1"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no VM named"), "{err}");
}

#[test]
fn cli_without_daemon_says_so() {
    let o = run_corral(&["--socket", "/nonexistent/corral.sock", "vm", "list"], T);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1));
    assert!(err.contains("cannot reach the corral daemon"), "{err}");
    assert!(err.contains("corral serve"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
fn pause_resume_and_disk_limits() {
    let d = Daemon::start(&[]);
    let img = std::env::temp_dir().join(format!("corral-api-disk-{}.img", std::process::id()));
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let body = json!({
        "name": "io", "memory_mib": 32,
        "cmdline": "probe.mode=spin probe.secs=30 probe.interval_ms=500",
        "disks": [{"id": "data", "path": img.to_str().unwrap(), "limits": {"bps": 10485760, "iops": 500}}]
    });
    let r = d.req("POST", "/v1/vms", Some(&body.to_string()));
    assert_eq!(r.status, 201, "{}", r.text());
    let disk = &r.json()["disks"][0];
    assert_eq!(disk["id"], "data");
    assert_eq!(disk["limits"]["bps"], 10485760);
    assert_eq!(disk["capacity_bytes"], 1 << 20);
    // A live limit change answers once the device thread applied it.
    let t0 = Instant::now();
    let r = d.req(
        "PATCH",
        "/v1/vms/io/disks/data",
        Some(r#"{"iops":1000,"burst_ops":10}"#),
    );
    let took = t0.elapsed();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        took < Duration::from_millis(100),
        "limit change took {took:?}"
    );
    assert_eq!(r.json()["limits"], json!({"iops": 1000, "burst_ops": 10}));
    let v = d.req("GET", "/v1/vms/io", None).json();
    assert_eq!(
        v["disks"][0]["limits"],
        json!({"iops": 1000, "burst_ops": 10})
    );
    d.req("PATCH", "/v1/vms/io/disks/nope", Some(r#"{"iops":1}"#))
        .assert_error(404, "not_found");
    let m = d.req("GET", "/metrics", None).text();
    assert!(
        m.contains(r#"corral_disk_limit_ops_per_second{vm="io",disk="data",op="all"} 1000"#),
        "{m}"
    );
    // Every disk is in its class's I/O group, and says so.
    assert_eq!(v["disks"][0]["group"], "class:default", "{v}");
    // A disk cannot choose another group: an unknown field, 400.
    let body = json!({"memory_mib": 16, "disks": [{"path": img.to_str().unwrap(), "group": "g"}]});
    d.req("POST", "/v1/vms", Some(&body.to_string()))
        .assert_error(400, "bad_request");

    // Pause: the vCPUs stop using CPU; resume: they go on.
    let cpu = |d: &Daemon| {
        d.req("GET", "/v1/vms/io", None).json()["cpu_seconds"]
            .as_f64()
            .unwrap()
    };
    let r = d.req("POST", "/v1/vms/io/pause", None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["state"], "paused");
    std::thread::sleep(Duration::from_millis(200));
    let c0 = cpu(&d);
    std::thread::sleep(Duration::from_millis(500));
    let c1 = cpu(&d);
    assert!(c1 - c0 < 0.02, "a paused VM used {} s of CPU", c1 - c0);
    assert_eq!(
        d.req("POST", "/v1/vms/io/pause", None).status,
        200,
        "idempotent"
    );
    let r = d.req("POST", "/v1/vms/io/resume", None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["state"], "running");
    std::thread::sleep(Duration::from_millis(500));
    assert!(cpu(&d) > c1 + 0.05, "resumed VM runs again");
    // A stopped VM cannot be paused.
    let r = d.req(
        "POST",
        "/v1/vms",
        Some(r#"{"name":"done","memory_mib":16}"#),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    wait_until(T, || {
        (d.req("GET", "/v1/vms/done", None).json()["state"] == "shutdown").then_some(())
    })
    .expect("probe boot mode shuts down");
    d.req("POST", "/v1/vms/done/pause", None)
        .assert_error(409, "conflict");
    assert_eq!(d.req("DELETE", "/v1/vms/io", None).status, 204);
    std::fs::remove_file(&img).ok();
}
