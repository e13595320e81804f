//! CPU scheduler figures on real VMs (release build):
//!
//! ```sh
//! cargo build --release -p corral-api -p corral-bench
//! target/x86_64-unknown-linux-gnu/release/schedbench
//! ```
//!
//! 1. the scheduler thread's own CPU use with 100 vCPUs (25 VMs × 4);
//! 2. shares 3:1, 2 spinning vCPUs per VM, 10 s, gate and cgroup backends;
//! 3. overhead: a fixed job alone, gate on versus off, 5 interleaved pairs.

use std::time::{Duration, Instant};

use corral_tests::vms::{Backend, Bench, Class, field};

fn spin(s: u64) -> String {
    format!("probe.mode=spin probe.secs={s} probe.interval_ms=1000")
}

fn cls(shares: u32) -> Class {
    Class {
        shares,
        cap: None,
        reservation: None,
    }
}

fn main() {
    let part = std::env::args().nth(1).unwrap_or_default();
    let want = |p: &str| part.is_empty() || part == p;
    // 1. Scheduler thread cost.
    if want("cost") {
        let mut b = Bench::new(Backend::Gate);
        b.class("a", cls(2));
        b.class("b", cls(1));
        for i in 0..25 {
            b.launch(if i % 2 == 0 { "a" } else { "b" }, 4, 16, &spin(30));
        }
        std::thread::sleep(Duration::from_secs(1));
        let (t0, c0) = b.cpu().self_usage();
        let w0 = Instant::now();
        std::thread::sleep(Duration::from_secs(10));
        let (t1, c1) = b.cpu().self_usage();
        let pct = (c1 - c0) as f64 * 100.0 / w0.elapsed().as_nanos() as f64;
        println!(
            "scheduler thread, 100 vCPUs (25 VMs x 4), 10 s: {pct:.3} % of one CPU, {} ticks, {:.1} us per tick",
            t1 - t0,
            (c1 - c0) as f64 / 1000.0 / (t1 - t0).max(1) as f64
        );
    }
    // 2. Shares 3:1.
    for backend in [Backend::Gate, Backend::Cgroup] {
        if !want("shares") {
            break;
        }
        let mut b = Bench::new(backend);
        b.class("a", cls(3));
        b.class("b", cls(1));
        b.launch("a", 2, 32, &spin(20));
        b.launch("b", 2, 32, &spin(20));
        let u = b.measure(Duration::from_millis(1500), Duration::from_secs(10));
        println!(
            "shares 3:1, {backend:?}, 10 s: A {:.1} % B {:.1} % of one CPU -> A's share {:.2} %",
            u[0],
            u[1],
            u[0] * 100.0 / (u[0] + u[1])
        );
    }
    if !want("overhead") {
        return;
    }
    // 3. Overhead of the gate on an uncontended job.
    let work = "probe.mode=work probe.units=100 probe.unit_iters=5000";
    let job = |backend: Backend| -> f64 {
        let mut b = Bench::new(backend);
        b.class("j", cls(1));
        let t0 = Instant::now();
        let i = b.launch("j", 2, 32, work);
        let out = b.wait(i, Duration::from_secs(300));
        let wall = t0.elapsed().as_secs_f64();
        let line = out
            .lines()
            .find(|l| l.starts_with("PROBE-RESULT mode=work"))
            .expect("work result");
        let _guest: f64 = field(line, "ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        wall
    };
    job(Backend::None);
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        off.push(job(Backend::None));
        on.push(job(Backend::Gate));
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (a, b) = (mean(&off), mean(&on));
    println!(
        "fixed job alone, 5 interleaved pairs: gate off {a:.3} s (min {:.3} max {:.3}), gate on {b:.3} s (min {:.3} max {:.3}); difference {:+.2} %",
        off.iter().cloned().fold(f64::MAX, f64::min),
        off.iter().cloned().fold(0.0, f64::max),
        on.iter().cloned().fold(f64::MAX, f64::min),
        on.iter().cloned().fold(0.0, f64::max),
        (b - a) / a * 100.0
    );
}
