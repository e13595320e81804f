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
//!
//! `schedbench cost-modes [ROUNDS]` (not in the default run): the
//! scheduler thread's cost with 100 vCPUs through the daemon's manager,
//! VMs as threads (`--vm-mode thread`) and as VM processes (`--vm-mode
//! process`, unjailed: the jail does not change what the scheduler reads),
//! interleaved thread, process, thread, ... (default 2 rounds, 10 s each;
//! `CORRAL_SCHED_SECS` sets the window), with the clock reads per tick;
//! `CORRAL_HANDOVER_MS=0,5` runs each mode with each handover in turn.

use std::sync::Arc;
use std::time::{Duration, Instant};

use corral_scheduler::ClassSpec;
use corral_tests::vms::{Backend, Bench, Class, field, probe_elf};
use corral_vmm::cpusched::CpuScheduler;
use corral_vmm::manager::{
    ClassConfig, CpuBackend, Limits, Manager, ManagerConfig, VmProcesses, VmRequest,
};
use corral_vmm::vmproc::launcher::Launcher;

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

/// The scheduler thread's CPU over a window.
struct Cost {
    /// Percent of one CPU.
    pct: f64,
    /// µs per tick.
    us: f64,
    ticks: u64,
    /// Clock reads per tick.
    reads: f64,
    /// Gates parked and opened per tick.
    parks: f64,
    unparks: f64,
    /// Handovers per tick, the share of them that timed out, and their
    /// mean wait (ms).
    handovers: f64,
    timeouts: f64,
    handover_ms: f64,
}

impl std::fmt::Display for Cost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.3} % of one CPU, {} ticks, {:.1} us per tick, {:.2} clock reads per tick, \
             {:.2} parks and {:.2} unparks per tick, {:.2} handovers per tick \
             ({:.0} % timed out, {:.2} ms each)",
            self.pct,
            self.ticks,
            self.us,
            self.reads,
            self.parks,
            self.unparks,
            self.handovers,
            self.timeouts * 100.0,
            self.handover_ms
        )
    }
}

/// The scheduler thread's CPU over `window`.
fn self_cost(cpu: &CpuScheduler, window: Duration) -> Cost {
    let (t0, c0) = cpu.self_usage();
    let w0 = cpu.work();
    let start = Instant::now();
    std::thread::sleep(window);
    let (t1, c1) = cpu.self_usage();
    let w1 = cpu.work();
    let ticks = (t1 - t0).max(1);
    let per_tick = |a: u64, b: u64| (b - a) as f64 / ticks as f64;
    Cost {
        pct: (c1 - c0) as f64 * 100.0 / start.elapsed().as_nanos() as f64,
        us: (c1 - c0) as f64 / 1000.0 / ticks as f64,
        ticks,
        reads: per_tick(w0.clock_reads, w1.clock_reads),
        parks: per_tick(w0.parks, w1.parks),
        unparks: per_tick(w0.unparks, w1.unparks),
        handovers: per_tick(w0.handovers, w1.handovers),
        timeouts: (w1.handover_timeouts - w0.handover_timeouts) as f64
            / (w1.handovers - w0.handovers).max(1) as f64,
        handover_ms: (w1.handover_wait_ns - w0.handover_wait_ns) as f64
            / 1e6
            / (w1.handovers - w0.handovers).max(1) as f64,
    }
}

/// 25 spinning 4-vCPU probe VMs (classes a:b = 2:1) through the daemon's
/// manager, as threads or as VM processes; the scheduler thread's cost.
fn cost_through_manager(processes: bool, handover_ns: u64, window: Duration) -> Cost {
    let class = |shares| ClassConfig {
        cpu: ClassSpec::new(shares),
        io: Limits::default(),
    };
    let vm_processes = processes.then(|| VmProcesses {
        launcher: Launcher::start(&corral_tests::corral_bin()).expect("start the VM launcher"),
        seccomp: false,
        keep_running: false,
        jail: None,
        pid_namespace: false,
    });
    let mgr = Arc::new(
        Manager::new(ManagerConfig {
            builtin_kernel: Some(probe_elf()),
            cpu_backend: CpuBackend::Gate,
            initial_classes: vec![
                ("default".into(), ClassConfig::default()),
                ("a".into(), class(2)),
                ("b".into(), class(1)),
            ],
            vm_processes,
            policy: corral_scheduler::PolicyConfig {
                handover_ns,
                ..Default::default()
            },
            ..Default::default()
        })
        .expect("manager"),
    );
    for i in 0..25 {
        mgr.create_vm(VmRequest {
            name: Some(format!("cost{i}")),
            class: if i % 2 == 0 { "a" } else { "b" }.into(),
            vcpus: 4,
            memory_mib: 16,
            cmdline: Some(spin(60)),
            ..Default::default()
        })
        .expect("create VM");
    }
    std::thread::sleep(Duration::from_secs(1));
    let r = self_cost(mgr.cpu_scheduler(), window);
    mgr.shutdown();
    r
}

fn main() {
    let part = std::env::args().nth(1).unwrap_or_default();
    let want = |p: &str| part.is_empty() || part == p;
    if part == "cost-modes" {
        let rounds: u32 = std::env::args()
            .nth(2)
            .and_then(|r| r.parse().ok())
            .unwrap_or(2);
        let secs = std::env::var("CORRAL_SCHED_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(10);
        // CORRAL_HANDOVER_MS=A,B: each mode with each handover in turn.
        let handovers: Vec<u64> = std::env::var("CORRAL_HANDOVER_MS")
            .ok()
            .map(|v| {
                v.split(',')
                    .filter_map(|x| x.trim().parse::<f64>().ok())
                    .filter(|ms| (0.0..=10.0).contains(ms))
                    .map(|ms| (ms * 1e6) as u64)
                    .collect()
            })
            .filter(|v: &Vec<u64>| !v.is_empty())
            .unwrap_or(vec![corral_scheduler::PolicyConfig::default().handover_ns]);
        for round in 1..=rounds {
            for processes in [false, true] {
                for &h in &handovers {
                    let c = cost_through_manager(processes, h, Duration::from_secs(secs));
                    println!(
                        "round {round}: scheduler thread, 100 vCPUs (25 VMs x 4), {} mode, handover {} ms, {secs} s: {c}",
                        if processes { "process" } else { "thread" },
                        h as f64 / 1e6
                    );
                }
            }
        }
        return;
    }
    // 1. Scheduler thread cost.
    if want("cost") {
        let mut b = Bench::new(Backend::Gate);
        b.class("a", cls(2));
        b.class("b", cls(1));
        for i in 0..25 {
            b.launch(if i % 2 == 0 { "a" } else { "b" }, 4, 16, &spin(30));
        }
        std::thread::sleep(Duration::from_secs(1));
        let c = self_cost(b.cpu(), Duration::from_secs(10));
        println!("scheduler thread, 100 vCPUs (25 VMs x 4), 10 s: {c}");
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
