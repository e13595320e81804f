//! Simulator scenarios at 1000 VMs: share accuracy per class, caps,
//! reservations, work conservation, no starvation, and the policy's cost.

use corral_scheduler::sim::{Pattern, SimConfig, SimReport, Simulator};
use corral_scheduler::{Capacity, ClassSpec};

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

fn config(latency: u64) -> SimConfig {
    SimConfig {
        step_ns: 2 * MS,
        park_latency_ns: latency,
        ..SimConfig::default()
    }
}

fn print_classes(r: &SimReport, classes: &[&str]) {
    for c in classes {
        println!("  {c:10} {:7.2}%", r.class_pct(c));
    }
    println!(
        "  util {:.4} wasted {:.5} policy {:.1} µs/tick (max {:.1} µs, debug build)",
        r.utilisation(),
        r.wasted_fraction(),
        r.policy_ns_per_tick() / 1e3,
        r.policy_ns_max as f64 / 1e3
    );
}

/// 1000 spinning 1-vCPU VMs on 64 CPUs in four classes: 3:1 shares, a cap
/// and a reservation, with varied weights inside each class. Class totals
/// match water-filling within 3 %; every VM gets at least 60 % of its own
/// share (weights included) over the window: a VM entitled to a few percent
/// runs one 10 ms tick every few hundred ms, so per-VM figures are quantised.
#[test]
fn thousand_hogs_shares_caps_reservations() {
    for latency in [0, 4 * MS] {
        let mut s = Simulator::new(Capacity::from_cpus(64), config(latency));
        s.create_class("a", ClassSpec::new(300)).unwrap();
        s.create_class("b", ClassSpec::new(100)).unwrap();
        s.create_class("capped", ClassSpec::new(1000).with_cap(800))
            .unwrap();
        s.create_class("reserved", ClassSpec::new(1).with_reservation(1200))
            .unwrap();
        let weight = |i: usize| 50 + (i as u32 / 4 % 8) * 50;
        let mut class_weight = [0u32; 4];
        for i in 0..1000 {
            class_weight[i % 4] += weight(i);
            let class = ["a", "b", "capped", "reserved"][i % 4];
            s.add_vm(class, weight(i), 1, Pattern::Hog).unwrap();
        }
        s.run_for(2 * S);
        s.reset_counters();
        s.run_for(6 * S);
        let r = s.report();
        println!("latency {latency}:");
        print_classes(&r, &["a", "b", "capped", "reserved"]);
        // reserved: 1200, capped: 800, a:b = 3:1 of the remaining 4400.
        let expected = [
            ("a", 3300.0),
            ("b", 1100.0),
            ("capped", 800.0),
            ("reserved", 1200.0),
        ];
        for (class, want) in expected {
            let got = r.class_pct(class);
            assert!(
                (got - want).abs() <= 0.03 * want,
                "{class}: got {got} want {want}"
            );
        }
        assert!(
            r.class_pct("capped") <= 808.0,
            "cap exceeded by more than 1 %"
        );
        assert!(r.wasted_fraction() < 1e-9);
        let mut worst: f64 = f64::INFINITY;
        for (i, v) in r.vms.iter().enumerate() {
            let ci = i % 4;
            let want = expected[ci].1 * f64::from(weight(i)) / f64::from(class_weight[ci]);
            worst = worst.min(v.cpu_pct / want);
            assert!(
                v.cpu_pct >= 0.6 * want,
                "vm {} ({}) got {:.3}% want {want:.3}%",
                v.id,
                v.class,
                v.cpu_pct
            );
        }
        println!("  worst VM got {:.2} of its share", worst);
    }
}

/// 1000 VMs of every pattern on 32 CPUs: the host stays busy (work
/// conservation), latency-sensitive VMs are served quickly, nobody starves.
#[test]
fn thousand_mixed_work_conservation() {
    let mut s = Simulator::new(Capacity::from_cpus(32), config(4 * MS));
    s.create_class("gold", ClassSpec::new(400)).unwrap();
    s.create_class("silver", ClassSpec::new(200)).unwrap();
    s.create_class("bronze", ClassSpec::new(100)).unwrap();
    s.create_class("web", ClassSpec::new(300).with_reservation(400))
        .unwrap();
    s.create_class("batch", ClassSpec::new(50).with_cap(800))
        .unwrap();
    let mut latency_vms = Vec::new();
    for i in 0..1000u32 {
        let (class, pattern) = match i % 10 {
            0 => ("gold", Pattern::Hog),
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
            6 => ("bronze", Pattern::Hog),
            7 => (
                "bronze",
                Pattern::Bursty {
                    on_ns: 40 * MS,
                    off_ns: 60 * MS,
                },
            ),
            8 => ("batch", Pattern::Hog),
            _ => ("bronze", Pattern::Idle),
        };
        let id = s
            .add_vm(class, 50 + (i % 7) * 50, 1 + i % 3, pattern)
            .unwrap();
        if class == "web" {
            latency_vms.push(id);
        }
    }
    s.run_for(S);
    s.reset_counters();
    // 24 s: the lowest-entitled VMs run one minimum slice (two ticks)
    // every ~12 s by design.
    s.run_for(24 * S);
    let r = s.report();
    print_classes(&r, &["gold", "silver", "bronze", "web", "batch"]);
    assert!(r.wasted_fraction() < 0.02, "wasted {}", r.wasted_fraction());
    assert!(r.utilisation() > 0.97, "utilisation {}", r.utilisation());
    assert!(
        r.class_pct("batch") <= 808.0,
        "cap exceeded by more than 1 %"
    );
    // Nobody who wanted CPU for a while went without. (How long a VM waits
    // between runs is its minimum slice, 20 ms, × vCPUs / entitlement: a
    // 3-vCPU VM entitled to 0.5 % of a CPU runs one slice every 12 s, by
    // design.)
    let mut longest = 0;
    for v in &r.vms {
        if v.wanted_ns > S {
            assert!(v.cpu_ns > 0.0, "vm {} wanted CPU and got none", v.id);
        }
        longest = longest.max(v.longest_starve_ns);
    }
    println!("  longest wait without CPU: {} ms", longest / MS);
    let mut p99s: Vec<u64> = latency_vms
        .iter()
        .filter_map(|&id| r.vm(id).latency_percentile(0.99))
        .collect();
    p99s.sort_unstable();
    let at = |q: f64| p99s[((p99s.len() - 1) as f64 * q) as usize];
    println!(
        "  web VMs' p99 request latency: median VM {} µs, 90th-percentile VM {} µs, worst VM {} µs",
        at(0.5) / 1000,
        at(0.9) / 1000,
        at(1.0) / 1000
    );
    assert!(at(0.5) <= 20 * MS, "median p99 {}", at(0.5));
    assert!(at(0.9) <= 50 * MS, "90th percentile p99 {}", at(0.9));
}
