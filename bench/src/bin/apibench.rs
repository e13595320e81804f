//! API latency benchmark: with N probe VMs running (default 50, 32 MiB, 1
//! vCPU spinning), measures p50/p99 of `GET /metrics` and of a live limit
//! change (`PATCH /v1/classes/{name}` with new shares and I/O group limits;
//! and a disk's limits, `PATCH /v1/vms/{name}/disks/{disk}`, applied by the
//! VM's device thread), over one keep-alive connection. Each VM has one
//! read-only 1 MiB virtio-blk disk.
//!
//! Usage: apibench [VMS] [REQUESTS]   (needs the `corral` binary next to it
//! or in CORRAL_BIN)

use std::time::{Duration, Instant};

use corral_tests::api::{Daemon, percentile, spin_vm};

fn measure(name: &str, n: usize, mut f: impl FnMut(usize) -> u16, want: u16) {
    let mut t = Vec::with_capacity(n);
    for i in 0..n {
        let t0 = Instant::now();
        let status = f(i);
        t.push(t0.elapsed());
        assert_eq!(status, want, "{name}: request {i}");
    }
    t.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "{name:<44} n={n:<5} p50={:>8.0} us  p99={:>8.0} us  max={:>8.0} us",
        us(percentile(&t, 50.0)),
        us(percentile(&t, 99.0)),
        us(*t.last().unwrap_or(&Duration::ZERO)),
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let vms: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(50);
    let n: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1000);
    let d = Daemon::start(&[]);
    let mut c = d.conn();
    let r = c.req(
        "POST",
        "/v1/classes",
        Some(r#"{"name":"bench","shares":100}"#),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let img = std::env::temp_dir().join(format!("corral-apibench-{}.img", std::process::id()));
    std::fs::write(&img, vec![0u8; 1 << 20]).expect("disk image");
    for i in 0..vms {
        let class = if i % 2 == 0 { "default" } else { "bench" };
        let mut body: serde_json::Value =
            serde_json::from_str(&spin_vm(&format!("b{i:03}"), class, 1, 32, 600)).unwrap();
        body["disks"] = serde_json::json!([{"id": "d0", "path": img.to_str().unwrap(), "readonly": true, "limits": {"bps": 10485760}}]);
        let r = c.req("POST", "/v1/vms", Some(&body.to_string()));
        assert_eq!(r.status, 201, "VM {i}: {}", r.text());
    }
    std::thread::sleep(Duration::from_millis(500));
    let st = c.req("GET", "/v1/status", None).json();
    println!(
        "corral API benchmark: {} VMs running ({} vCPUs, {} MiB), {} host CPUs, 1 keep-alive connection",
        st["running_vms"],
        st["vcpus"],
        st["memory_mib"],
        st["capacity_pct"].as_u64().unwrap_or(0) / 100
    );
    let m = c.req("GET", "/metrics", None);
    println!(
        "GET /metrics body: {} bytes, {} lines",
        m.body.len(),
        m.text().lines().count()
    );
    measure(
        "GET /metrics",
        n,
        |_| c.req("GET", "/metrics", None).status,
        200,
    );
    measure(
        "PATCH /v1/classes/bench (shares + io limits)",
        n,
        |i| {
            let body = format!(
                r#"{{"shares":{},"io":{{"bps":{},"iops":500}}}}"#,
                100 + i % 50,
                10_485_760 + i
            );
            c.req("PATCH", "/v1/classes/bench", Some(&body)).status
        },
        200,
    );
    if vms == 0 {
        std::fs::remove_file(&img).ok();
        return;
    }
    measure(
        "PATCH /v1/vms/b000/disks/d0 (live disk limit)",
        n,
        |i| {
            let body = format!(r#"{{"bps":{},"iops":500}}"#, 10_485_760 + i);
            c.req("PATCH", "/v1/vms/b000/disks/d0", Some(&body)).status
        },
        200,
    );
    measure(
        "GET /v1/vms",
        n / 4,
        |_| c.req("GET", "/v1/vms", None).status,
        200,
    );
    measure(
        "GET /v1/vms/b000",
        n,
        |_| c.req("GET", "/v1/vms/b000", None).status,
        200,
    );
    std::fs::remove_file(&img).ok();
}
