//! 50 probe VMs of 32 MiB running at once under one daemon, on a 2-CPU host.

use std::time::{Duration, Instant};

use corral_tests::api::{Daemon, spin_vm, wait_until};

#[test]
fn fifty_probe_vms_at_once() {
    const N: usize = 50;
    let d = Daemon::start(&[]);
    let mut c = d.conn();
    let t0 = Instant::now();
    for i in 0..N {
        let r = c.req(
            "POST",
            "/v1/vms",
            Some(&spin_vm(&format!("p{i:02}"), "default", 1, 32, 15)),
        );
        assert_eq!(r.status, 201, "VM {i}: {}", r.text());
    }
    let created = t0.elapsed();
    eprintln!("created {N} VMs in {created:?}");
    // All of them run at once and make progress.
    let st = c.req("GET", "/v1/status", None).json();
    assert_eq!(st["running_vms"], N, "{st}");
    assert_eq!(st["memory_mib"], (N * 32) as u64, "{st}");
    let all_up = wait_until(Duration::from_secs(30), || {
        let vms = c.req("GET", "/v1/vms", None).json();
        let vms = vms.as_array().unwrap().clone();
        let progressing = vms
            .iter()
            .filter(|v| v["state"] == "running" && v["cpu_seconds"].as_f64().unwrap_or(0.0) > 0.01)
            .count();
        (progressing == N).then_some(())
    });
    assert!(all_up.is_some(), "not all {N} VMs made progress");
    for i in [0, N / 2, N - 1] {
        let con = c
            .req("GET", &format!("/v1/vms/p{i:02}/console"), None)
            .text();
        assert!(con.contains("PROBE-UP"), "p{i:02}: {con}");
    }
    // Metrics cover all of them.
    let m = c.req("GET", "/metrics", None).text();
    let lines = m
        .lines()
        .filter(|l| l.starts_with("corral_vm_cpu_seconds_total{"))
        .count();
    assert_eq!(lines, N);
    // Delete them all.
    let t1 = Instant::now();
    for i in 0..N {
        assert_eq!(
            c.req("DELETE", &format!("/v1/vms/p{i:02}"), None).status,
            204
        );
    }
    eprintln!("deleted {N} VMs in {:?}", t1.elapsed());
    assert_eq!(c.req("GET", "/v1/status", None).json()["vms"], 0);
}
