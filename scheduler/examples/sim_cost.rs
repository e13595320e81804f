//! Cost of the policy per tick at scale, and a summary of what the VMs got.
//!
//! `cargo run --release -p corral-scheduler --example sim_cost [VMS...]`
//! (default: 100 1000 5000). Each run simulates 10 s of a mixed workload
//! (hogs, bursty, mostly idle, latency-sensitive, partial hogs) on
//! VMS/16 host CPUs (at least 4) with a 4 ms kick latency, and reports the
//! wall-clock time spent in `Scheduler::tick` (the simulator's own host
//! model is not counted).

use corral_scheduler::sim::{Pattern, SimConfig, Simulator};
use corral_scheduler::{Capacity, ClassSpec};

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

fn run(vms: u32) {
    let cpus = (vms / 16).max(4);
    let config = SimConfig {
        step_ns: MS,
        park_latency_ns: 4 * MS,
        ..SimConfig::default()
    };
    let mut s = Simulator::new(Capacity::from_cpus(cpus), config);
    s.create_class("gold", ClassSpec::new(400)).unwrap();
    s.create_class("silver", ClassSpec::new(200)).unwrap();
    s.create_class("bronze", ClassSpec::new(100)).unwrap();
    s.create_class("web", ClassSpec::new(300).with_reservation(cpus * 10))
        .unwrap();
    s.create_class("batch", ClassSpec::new(50).with_cap(cpus * 25))
        .unwrap();
    for i in 0..vms {
        let (class, pattern) = match i % 10 {
            0 | 6 => ("gold", Pattern::Hog),
            1 => (
                "gold",
                Pattern::Bursty {
                    on_ns: 100 * MS,
                    off_ns: 300 * MS,
                },
            ),
            2 => ("silver", Pattern::PartialHog { busy_vcpus: 1 }),
            3 => (
                "silver",
                Pattern::MostlyIdle {
                    mean_gap_ns: 2 * S,
                    burst_ns: 30 * MS,
                },
            ),
            4 | 5 => (
                "web",
                Pattern::Latency {
                    interval_ns: 100 * MS,
                    work_ns: 2 * MS,
                },
            ),
            7 => (
                "bronze",
                Pattern::Bursty {
                    on_ns: 40 * MS,
                    off_ns: 60 * MS,
                },
            ),
            8 => ("batch", Pattern::Hog),
            _ => ("bronze", Pattern::Hog),
        };
        s.add_vm(class, 50 + (i % 7) * 50, 1 + i % 3, pattern)
            .unwrap();
    }
    s.run_for(S);
    s.reset_counters();
    s.run_for(10 * S);
    let r = s.report();
    println!(
        "{vms:6} VMs on {cpus:4} CPUs: {:8.1} µs per tick (max {:8.1} µs) over {} ticks; \
         host busy {:.2} %, idle-while-waiting {:.3} %",
        r.policy_ns_per_tick() / 1e3,
        r.policy_ns_max as f64 / 1e3,
        r.ticks,
        r.utilisation() * 100.0,
        r.wasted_fraction() * 100.0,
    );
    print!("        CPU per class (% of one CPU):");
    for c in ["gold", "silver", "bronze", "web", "batch"] {
        print!(" {c} {:.0}", r.class_pct(c));
    }
    println!(" (batch cap {}, web reservation {})", cpus * 25, cpus * 10);
    let mut p99: Vec<u64> = r
        .vms
        .iter()
        .filter(|v| v.class == "web")
        .filter_map(|v| v.latency_percentile(0.99))
        .collect();
    p99.sort_unstable();
    if !p99.is_empty() {
        println!(
            "        web request p99 latency: median VM {:.1} ms, 90th-percentile VM {:.1} ms",
            p99[p99.len() / 2] as f64 / 1e6,
            p99[p99.len() * 9 / 10] as f64 / 1e6
        );
    }
}

fn main() {
    let sizes: Vec<u32> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("VM count"))
        .collect();
    let sizes = if sizes.is_empty() {
        vec![100, 1000, 5000]
    } else {
        sizes
    };
    if cfg!(debug_assertions) {
        println!("(debug build: run with --release for meaningful timings)");
    }
    for n in sizes {
        run(n);
    }
}
