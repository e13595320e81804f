//! Issue 14 item 2: a disk's control and counters through the API while its
//! device thread is stuck (the `dev-stall` fault: the device thread holds
//! the first disk's lock for 8 s from its start, as a device stuck in a
//! slow `preadv` would), and the typed errors of a disk-limit PATCH: 503 for a device
//! thread that does not answer, 409 for a stopped VM.
//!
//! The fault is injected through `CORRAL_FAULT` (a hook that exists only in
//! debug builds of corral: see `corral_vmm::seccomp::fault`).

use std::time::{Duration, Instant};

use corral_tests::api::{Daemon, wait_until};
use corral_tests::corral_bin;
use serde_json::json;

fn debug_build() -> bool {
    let debug = !corral_bin().to_string_lossy().contains("/release/");
    if !debug {
        eprintln!("skipped: the fault-injection hook exists only in debug builds");
    }
    debug
}

/// GET `path`; (status, body, how long it took).
fn timed_get(d: &Daemon, path: &str) -> (u16, String, Duration) {
    let t = Instant::now();
    let r = d.req("GET", path, None);
    (r.status, r.text(), t.elapsed())
}

#[test]
fn a_stalled_device_thread_blocks_no_read_and_a_patch_gets_503() {
    if !debug_build() {
        return;
    }
    let d = Daemon::start_with_env(&[], &[("CORRAL_FAULT", "dev-stall:stall")]);
    let img = d.dir.join("data.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let body = json!({
        "name": "stall", "memory_mib": 32,
        "cmdline": "probe.mode=spin probe.secs=30 probe.interval_ms=500",
        "disks": [{"id": "data", "path": img.to_str().unwrap(), "limits": {"iops": 1000}}]
    });
    let t = Instant::now();
    let r = d.req("POST", "/v1/vms", Some(&body.to_string()));
    let took = t.elapsed();
    assert_eq!(r.status, 201, "{}", r.text());
    // Its answer lists the disks' counters, read without the device's lock
    // (before, it waited for the stall to end).
    assert!(took < Duration::from_secs(4), "POST /v1/vms took {took:?}");
    // The device thread stalls for 8 s from its start (before the VM's
    // creation answers); leave it a moment to take the disk's lock.
    std::thread::sleep(Duration::from_millis(300));

    // Reads answer at once: they take no device lock (before, both waited
    // for the device: until the stall ended).
    let (status, text, took) = timed_get(&d, "/v1/vms/stall");
    assert_eq!(status, 200, "{text}");
    assert!(
        took < Duration::from_secs(2),
        "GET /v1/vms/stall took {took:?}"
    );
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["disks"][0]["limits"], json!({"iops": 1000}), "{v}");
    let (status, m, took) = timed_get(&d, "/metrics");
    assert_eq!(status, 200);
    assert!(took < Duration::from_secs(2), "GET /metrics took {took:?}");
    assert!(
        m.contains(r#"corral_disk_malformed_requests_total{vm="stall",disk="data"} 0"#),
        "{m}"
    );

    // A limit change waits for the device thread, which does not answer:
    // 503 after the bound (5 s), and nothing changed.
    let t = Instant::now();
    let r = d.req("PATCH", "/v1/vms/stall/disks/data", Some(r#"{"iops":50}"#));
    let took = t.elapsed();
    let msg = r.assert_error(503, "device_unresponsive");
    assert!(msg.contains("did not answer"), "{msg}");
    assert!(took >= Duration::from_millis(4500), "503 after {took:?}");
    let v = d.req("GET", "/v1/vms/stall", None).json();
    assert_eq!(v["disks"][0]["limits"], json!({"iops": 1000}), "{v}");

    // Once the stall is over, a change applies again.
    let r = wait_until(Duration::from_secs(15), || {
        let r = d.req(
            "PATCH",
            "/v1/vms/stall/disks/data",
            Some(r#"{"iops":2000}"#),
        );
        (r.status != 503).then_some(r)
    })
    .expect("the device thread answers again");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["limits"], json!({"iops": 2000}));

    // A stopped VM's disks cannot change: 409 with its own code.
    let r = d.req("POST", "/v1/vms/stall/stop", None);
    assert_eq!(r.status, 200, "{}", r.text());
    let r = d.req("PATCH", "/v1/vms/stall/disks/data", Some(r#"{"iops":10}"#));
    let msg = r.assert_error(409, "vm_stopped");
    assert!(msg.contains("has stopped"), "{msg}");
}
