//! The probe's wait for virtio-blk completions (`probe.wait=`): with `irq`
//! (the default) a throttled job sleeps in `hlt` until the used-ring
//! interrupt, so its vCPU is idle while the throttle holds a request back;
//! with `poll` (the old driver) it spins for the whole wait. Both VMs run
//! side by side under the daemon, and the figure is the daemon's per-VM CPU
//! (`cpu_seconds` of `GET /v1/vms/{name}`: its vCPU threads' CPU time).

use std::time::{Duration, Instant};

use corral_tests::api::{Daemon, wait_until};
use serde_json::json;

fn cpu_seconds(d: &Daemon, vm: &str) -> f64 {
    let r = d.req("GET", &format!("/v1/vms/{vm}"), None);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["cpu_seconds"].as_f64().expect("cpu_seconds")
}

fn disk_ops(d: &Daemon, vm: &str) -> f64 {
    let m = d.req("GET", "/metrics", None).text();
    let key = format!(r#"corral_disk_ops_total{{vm="{vm}",disk="data",op="read"}}"#);
    m.lines()
        .find(|l| l.starts_with(&key))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

fn console(d: &Daemon, vm: &str) -> String {
    d.req("GET", &format!("/v1/vms/{vm}/console?tail=40"), None)
        .text()
}

#[test]
fn a_throttled_job_sleeps_instead_of_spinning() {
    let d = Daemon::start(&[]);
    let dir = std::env::temp_dir().join(format!("corral-blk-wait-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // 100 ops/s per VM, a bucket one request deep: 4 KiB reads at queue
    // depth 1 wait ~10 ms each, nearly all of it held back by the throttle.
    // 600 requests: ~6 s, of which up to 4.5 s are measured.
    let job = "probe.mode=blk probe.op=read probe.size=2400K probe.bs=4K probe.qd=1";
    for wait in ["irq", "poll"] {
        let r = d.req(
            "POST",
            "/v1/classes",
            Some(
                &json!({"name": format!("c{wait}"), "shares": 100,
                         "io": {"iops": 100, "burst_ops": 1}})
                .to_string(),
            ),
        );
        assert_eq!(r.status, 201, "{}", r.text());
        let p = dir.join(format!("{wait}.img"));
        std::fs::File::create(&p)
            .unwrap()
            .set_len(16 << 20)
            .unwrap();
        let body = json!({
            "name": wait, "class": format!("c{wait}"), "memory_mib": 64,
            "cmdline": format!("{job} probe.wait={wait}"),
            "disks": [{"id": "data", "path": p.to_str().unwrap()}]
        });
        let r = d.req("POST", "/v1/vms", Some(&body.to_string()));
        assert_eq!(r.status, 201, "{}", r.text());
    }
    wait_until(Duration::from_secs(30), || {
        (disk_ops(&d, "irq") >= 20.0 && disk_ops(&d, "poll") >= 20.0).then_some(())
    })
    .expect("both VMs reading");
    // Up to three windows of 1.5 s, each judged on its own with the same
    // bounds: one episode of heavy outside load (the sleep and wake-up of
    // a vCPU costs ~0.5-1 ms here, more while the host is swamped) must
    // not decide the test, a driver that spins fails all three.
    let mut last = String::new();
    let mut passed = false;
    for _ in 0..3 {
        let (i0, p0, o0, t0) = (
            cpu_seconds(&d, "irq"),
            cpu_seconds(&d, "poll"),
            disk_ops(&d, "irq"),
            Instant::now(),
        );
        std::thread::sleep(Duration::from_millis(1500));
        let (i1, p1, o1) = (
            cpu_seconds(&d, "irq"),
            cpu_seconds(&d, "poll"),
            disk_ops(&d, "irq"),
        );
        let el = t0.elapsed().as_secs_f64();
        let (irq_pct, poll_pct) = ((i1 - i0) / el * 100.0, (p1 - p0) / el * 100.0);
        let rate = (o1 - o0) / el;
        eprintln!(
            "vCPU use over {el:.2} s of a job throttled to 100 ops/s: probe.wait=irq {irq_pct:.1} %, \
             probe.wait=poll {poll_pct:.1} % (irq VM at {rate:.0} ops/s)"
        );
        // The job really was throttled (and still running) while measured.
        assert!(rate > 20.0 && rate < 110.0, "irq VM at {rate:.0} ops/s");
        // Measured here: irq 2-3 % on a host at load 10 (the poll VM got
        // 15 % of a CPU there, ~100 % on a quiet host); the old driver
        // spins, so both VMs would use the same.
        if irq_pct < 8.0 && poll_pct > 2.5 * irq_pct {
            passed = true;
            break;
        }
        last = format!(
            "the sleeping VM used {irq_pct:.1} % of a CPU, the polling one {poll_pct:.1} % \
             (bounds: < 8 %, and poll > 2.5x irq)"
        );
    }
    assert!(passed, "in three windows; the last: {last}");
    // Both jobs finish correctly; the irq VM slept on interrupts.
    let line = |vm: &str| {
        wait_until(Duration::from_secs(60), || {
            let c = console(&d, vm);
            let whole = &c[..c.rfind('\n').map_or(0, |i| i + 1)];
            whole
                .lines()
                .find(|l| l.starts_with("PROBE-RESULT mode=blk"))
                .map(str::to_string)
        })
        .unwrap_or_else(|| panic!("{vm}: no result:\n{}", console(&d, vm)))
    };
    let (li, lp) = (line("irq"), line("poll"));
    let num = |l: &str, k: &str| -> u64 {
        corral_tests::vms::field(l, k)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {k}= in {l}"))
    };
    for l in [&li, &lp] {
        assert_eq!(num(l, "errors"), 0, "{l}");
        assert_eq!(num(l, "requests"), 600, "{l}");
    }
    assert!(num(&li, "irqs") >= 300, "{li}");
    assert_eq!(num(&lp, "sleeps"), 0, "{lp}");
    for vm in ["irq", "poll"] {
        d.req("DELETE", &format!("/v1/vms/{vm}"), None);
    }
    std::fs::remove_dir_all(&dir).ok();
}
