//! Simulator scenarios with a handful of VMs: the expected results of the
//! issue (shares 3:1, caps, reservations, starvation-free jobs, work
//! conservation), also with kick latency.

use corral_scheduler::sim::{Pattern, SimConfig, Simulator};
use corral_scheduler::{Capacity, ClassSpec};

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

fn sim(cpus: u32) -> Simulator {
    Simulator::new(Capacity::from_cpus(cpus), SimConfig::default())
}

fn sim_with(cpus: u32, f: impl FnOnce(&mut SimConfig)) -> Simulator {
    let mut c = SimConfig::default();
    f(&mut c);
    Simulator::new(Capacity::from_cpus(cpus), c)
}

/// A (shares 3) vs B (shares 1), 2 vCPUs each spinning on 2 CPUs: A gets
/// 75 % ± 2 % of the host over 10 s. Also with a 4 ms kick latency and with
/// a bool-only demand signal.
#[test]
fn shares_three_to_one() {
    for (latency, exact) in [(0, true), (4 * MS, true), (4 * MS, false)] {
        let mut s = sim_with(2, |c| {
            c.park_latency_ns = latency;
            c.exact_runnable = exact;
        });
        s.create_class("a", ClassSpec::new(3)).unwrap();
        s.create_class("b", ClassSpec::new(1)).unwrap();
        let a = s.add_vm("a", 100, 2, Pattern::Hog).unwrap();
        let b = s.add_vm("b", 100, 2, Pattern::Hog).unwrap();
        s.run_for(10 * S);
        let r = s.report();
        let share_a = r.vm(a).cpu_pct / 200.0;
        let share_b = r.vm(b).cpu_pct / 200.0;
        println!(
            "latency {latency}: A {share_a:.4} B {share_b:.4} util {:.4}",
            r.utilisation()
        );
        assert!((share_a - 0.75).abs() <= 0.02, "A got {share_a}");
        assert!(r.utilisation() > 0.999, "host idle: {}", r.utilisation());
        assert!(r.wasted_fraction() < 1e-9);
    }
}

/// Weights inside a class split the class's share.
#[test]
fn weights_inside_a_class() {
    let mut s = sim(4);
    s.create_class("a", ClassSpec::new(100)).unwrap();
    s.create_class("b", ClassSpec::new(100)).unwrap();
    let a1 = s.add_vm("a", 100, 4, Pattern::Hog).unwrap();
    let a2 = s.add_vm("a", 300, 4, Pattern::Hog).unwrap();
    let b = s.add_vm("b", 100, 4, Pattern::Hog).unwrap();
    s.run_for(5 * S);
    let r = s.report();
    println!(
        "a1 {:.1} a2 {:.1} b {:.1}",
        r.vm(a1).cpu_pct,
        r.vm(a2).cpu_pct,
        r.vm(b).cpu_pct
    );
    assert!((r.vm(b).cpu_pct - 200.0).abs() < 4.0);
    assert!((r.vm(a1).cpu_pct - 50.0).abs() < 4.0);
    assert!((r.vm(a2).cpu_pct - 150.0).abs() < 4.0);
}

/// A cap of 50 % on B: B stays at or below 51 % while A takes the rest; with
/// B idle A gets the whole host; with a cap on A, A gets only its cap even
/// on an idle host.
#[test]
fn caps() {
    for latency in [0, 4 * MS] {
        let mut s = sim_with(2, |c| c.park_latency_ns = latency);
        s.create_class("a", ClassSpec::new(3)).unwrap();
        s.create_class("b", ClassSpec::new(1).with_cap(50)).unwrap();
        let a = s.add_vm("a", 100, 2, Pattern::Hog).unwrap();
        let b = s.add_vm("b", 100, 2, Pattern::Hog).unwrap();
        s.run_for(10 * S);
        let r = s.report();
        println!(
            "latency {latency}: A {:.2} B {:.2}",
            r.vm(a).cpu_pct,
            r.vm(b).cpu_pct
        );
        assert!(r.vm(b).cpu_pct <= 51.0, "B got {}", r.vm(b).cpu_pct);
        assert!(r.vm(b).cpu_pct >= 48.0, "B got {}", r.vm(b).cpu_pct);
        assert!(r.vm(a).cpu_pct >= 148.0, "A got {}", r.vm(a).cpu_pct);
    }

    // B idle: A alone gets everything.
    let mut s = sim(2);
    s.create_class("a", ClassSpec::new(3)).unwrap();
    s.create_class("b", ClassSpec::new(1).with_cap(50)).unwrap();
    let a = s.add_vm("a", 100, 2, Pattern::Hog).unwrap();
    s.add_vm("b", 100, 2, Pattern::Idle).unwrap();
    s.run_for(5 * S);
    let r = s.report();
    assert!(r.vm(a).cpu_pct >= 199.0, "A got {}", r.vm(a).cpu_pct);

    // A capped at 120 % on an otherwise idle host: A gets its cap only.
    for latency in [0, 4 * MS] {
        let mut s = sim_with(2, |c| c.park_latency_ns = latency);
        s.create_class("a", ClassSpec::new(3).with_cap(120))
            .unwrap();
        s.create_class("b", ClassSpec::new(1)).unwrap();
        let a = s.add_vm("a", 100, 2, Pattern::Hog).unwrap();
        s.add_vm("b", 100, 2, Pattern::Idle).unwrap();
        s.run_for(10 * S);
        let r = s.report();
        println!("capped alone, latency {latency}: A {:.2}", r.vm(a).cpu_pct);
        assert!(r.vm(a).cpu_pct <= 121.0, "A got {}", r.vm(a).cpu_pct);
        assert!(r.vm(a).cpu_pct >= 118.0, "A got {}", r.vm(a).cpu_pct);
    }
}

/// A class with a 100 % reservation and tiny shares gets at least 100 %
/// under contention from two classes with far larger shares.
#[test]
fn reservation_holds_under_contention() {
    for latency in [0, 4 * MS] {
        let mut s = sim_with(2, |c| c.park_latency_ns = latency);
        s.create_class("r", ClassSpec::new(1).with_reservation(100))
            .unwrap();
        s.create_class("x", ClassSpec::new(1000)).unwrap();
        s.create_class("y", ClassSpec::new(1000)).unwrap();
        let r_vm = s.add_vm("r", 100, 2, Pattern::Hog).unwrap();
        let x = s.add_vm("x", 100, 2, Pattern::Hog).unwrap();
        let y = s.add_vm("y", 100, 2, Pattern::Hog).unwrap();
        s.run_for(10 * S);
        let r = s.report();
        println!(
            "latency {latency}: R {:.2} X {:.2} Y {:.2}",
            r.vm(r_vm).cpu_pct,
            r.vm(x).cpu_pct,
            r.vm(y).cpu_pct
        );
        assert!(r.vm(r_vm).cpu_pct >= 99.5, "R got {}", r.vm(r_vm).cpu_pct);
        assert!((r.vm(x).cpu_pct - r.vm(y).cpu_pct).abs() < 3.0);
    }
}

/// The classic starvation scenario: a fixed job (shares 3) beside a hog
/// (shares 1) on 2 CPUs finishes within solo time / 0.75 + 3 %.
#[test]
fn job_beside_hog_is_not_starved() {
    let work = 2 * S; // per vCPU
    let solo = {
        let mut s = sim(2);
        s.create_class("job", ClassSpec::new(3)).unwrap();
        let j = s
            .add_vm("job", 100, 2, Pattern::Job { work_ns: work })
            .unwrap();
        s.run_for(3 * S);
        s.report().vm(j).job_done_ns.expect("solo job finished")
    };
    for latency in [0, 4 * MS] {
        let mut s = sim_with(2, |c| c.park_latency_ns = latency);
        s.create_class("job", ClassSpec::new(3)).unwrap();
        s.create_class("hog", ClassSpec::new(1)).unwrap();
        s.add_vm("hog", 100, 2, Pattern::Hog).unwrap();
        let j = s
            .add_vm("job", 100, 2, Pattern::Job { work_ns: work })
            .unwrap();
        s.run_for(4 * S);
        let done = s.report().vm(j).job_done_ns.expect("job finished");
        let bound = solo as f64 / 0.75 * 1.03;
        println!(
            "latency {latency}: solo {solo} with hog {done} ratio {:.4}",
            done as f64 / solo as f64
        );
        assert!((done as f64) <= bound, "job took {done} ns, bound {bound}");
    }
}

/// Mixed workloads: no CPU is left idle while an uncapped VM waits parked
/// (beyond a small tolerance), and nobody starves.
#[test]
fn work_conservation_and_no_starvation_mixed() {
    let mut s = sim_with(4, |c| c.park_latency_ns = 2 * MS);
    s.create_class("gold", ClassSpec::new(400)).unwrap();
    s.create_class("silver", ClassSpec::new(200)).unwrap();
    s.create_class("bronze", ClassSpec::new(100)).unwrap();
    let mut ids = Vec::new();
    for (class, pattern) in [
        ("gold", Pattern::Hog),
        (
            "gold",
            Pattern::Bursty {
                on_ns: 50 * MS,
                off_ns: 150 * MS,
            },
        ),
        ("silver", Pattern::PartialHog { busy_vcpus: 1 }),
        (
            "silver",
            Pattern::Latency {
                interval_ns: 20 * MS,
                work_ns: 2 * MS,
            },
        ),
        (
            "silver",
            Pattern::MostlyIdle {
                mean_gap_ns: 300 * MS,
                burst_ns: 20 * MS,
            },
        ),
        ("bronze", Pattern::Hog),
        (
            "bronze",
            Pattern::Bursty {
                on_ns: 200 * MS,
                off_ns: 100 * MS,
            },
        ),
        ("bronze", Pattern::Hog),
        (
            "bronze",
            Pattern::Latency {
                interval_ns: 50 * MS,
                work_ns: MS,
            },
        ),
        ("gold", Pattern::Job { work_ns: 3 * S }),
    ] {
        ids.push(s.add_vm(class, 100, 2, pattern).unwrap());
    }
    s.run_for(10 * S);
    let r = s.report();
    println!(
        "util {:.4} wasted {:.5} gold {:.1} silver {:.1} bronze {:.1}",
        r.utilisation(),
        r.wasted_fraction(),
        r.class_pct("gold"),
        r.class_pct("silver"),
        r.class_pct("bronze")
    );
    for v in &r.vms {
        println!(
            "  vm {} {:6} cpu {:6.1}% starve {:4} ms p99 {:?}",
            v.id,
            v.class,
            v.cpu_pct,
            v.longest_starve_ns / MS,
            v.latency_percentile(0.99).map(|l| l / 1000)
        );
    }
    // Small and churny on purpose (4 CPUs, VMs starting and stopping every
    // few ms): a VM that goes idle mid-tick leaves its CPU idle until the
    // next tick admits another, so allow 2 % here (0 % at 1000 VMs).
    assert!(r.wasted_fraction() < 0.02, "wasted {}", r.wasted_fraction());
    assert!(r.utilisation() > 0.97, "utilisation {}", r.utilisation());
    for v in &r.vms {
        assert!(
            v.longest_starve_ns <= 1500 * MS,
            "vm {} starved {} ms",
            v.id,
            v.longest_starve_ns / MS
        );
        if v.wanted_ns > 0 {
            assert!(v.cpu_ns > 0.0, "vm {} got nothing", v.id);
        }
    }
    // Latency-sensitive VMs with little usage are served promptly.
    for &id in &[ids[3], ids[8]] {
        let p99 = r.vm(id).latency_percentile(0.99).unwrap();
        assert!(p99 <= 60 * MS, "vm {id} p99 {p99}");
    }
}

/// Ten hog VMs with different shares each get their proportional share
/// (± 10 % relative): nobody is starved, nobody is favoured.
#[test]
fn ten_vms_proportional() {
    for latency in [0, 4 * MS] {
        ten_vms_proportional_with(latency);
    }
}

fn ten_vms_proportional_with(latency: u64) {
    let mut s = sim_with(4, |c| c.park_latency_ns = latency);
    let shares = [1u32, 2, 3, 5, 8, 13, 21, 34, 55, 89];
    let mut ids = Vec::new();
    for (i, &sh) in shares.iter().enumerate() {
        let name = format!("c{i}");
        s.create_class(&name, ClassSpec::new(sh)).unwrap();
        ids.push(s.add_vm(&name, 100, 1, Pattern::Hog).unwrap());
    }
    s.run_for(20 * S);
    let r = s.report();
    // Expected by water-filling: each VM is limited to 100 % (1 vCPU);
    // what the biggest cannot use is spread over the others by shares.
    let mut expected = vec![0.0; shares.len()];
    let mut open: Vec<usize> = (0..shares.len()).collect();
    let mut left = 400.0;
    loop {
        let w: f64 = open.iter().map(|&i| f64::from(shares[i])).sum();
        let full: Vec<usize> = open
            .iter()
            .copied()
            .filter(|&i| left * f64::from(shares[i]) / w >= 100.0)
            .collect();
        if full.is_empty() {
            for &i in &open {
                expected[i] = left * f64::from(shares[i]) / w;
            }
            break;
        }
        for &i in &full {
            expected[i] = 100.0;
            left -= 100.0;
        }
        open.retain(|i| !full.contains(i));
    }
    for (i, &id) in ids.iter().enumerate() {
        let got = r.vm(id).cpu_pct;
        println!(
            "latency {latency} shares {:3}: got {got:6.2}% expected {:6.2}%",
            shares[i], expected[i]
        );
        if latency == 0 {
            assert!(
                (got - expected[i]).abs() <= 0.02 * expected[i] + 0.2,
                "shares {} got {got} expected {}",
                shares[i],
                expected[i]
            );
        } else {
            // With a 4 ms kick latency every swap briefly runs one vCPU too
            // many, which costs the two VMs entitled to a full CPU (they can
            // never catch up) ~8 %. The rest is shared by shares.
            assert!(got >= 0.9 * expected[i], "shares {} got {got}", shares[i]);
        }
    }
    if latency > 0 {
        let ratios: Vec<f64> = ids[..8]
            .iter()
            .zip(&expected)
            .map(|(&id, e)| r.vm(id).cpu_pct / e)
            .collect();
        let (lo, hi) = ratios
            .iter()
            .fold((f64::MAX, 0.0_f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        assert!(hi / lo < 1.1, "not proportional: {ratios:?}");
    }
    assert!(r.wasted_fraction() < 1e-9);
}

/// Everything changeable live: shares changes, VM moves, caps added while
/// running take effect.
#[test]
fn live_changes_take_effect() {
    let mut s = sim(2);
    s.create_class("a", ClassSpec::new(1)).unwrap();
    s.create_class("b", ClassSpec::new(1)).unwrap();
    let a = s.add_vm("a", 100, 2, Pattern::Hog).unwrap();
    let b = s.add_vm("b", 100, 2, Pattern::Hog).unwrap();
    s.run_for(2 * S);
    s.reset_counters();
    s.run_for(2 * S);
    let r = s.report();
    assert!((r.vm(a).cpu_pct - 100.0).abs() < 3.0);

    s.scheduler_mut()
        .update_class("a", ClassSpec::new(3))
        .unwrap();
    s.run_for(S);
    s.reset_counters();
    s.run_for(4 * S);
    let r = s.report();
    assert!((r.vm(a).cpu_pct - 150.0).abs() < 4.0, "{}", r.vm(a).cpu_pct);

    // Move B into A's class: now equal weights in one class.
    s.scheduler_mut().move_vm(b, "a").unwrap();
    s.run_for(S);
    s.reset_counters();
    s.run_for(4 * S);
    let r = s.report();
    assert!((r.vm(a).cpu_pct - 100.0).abs() < 4.0, "{}", r.vm(a).cpu_pct);
    assert_eq!(r.vm(b).class, "a");

    // Cap class "a" at 60 %.
    s.scheduler_mut()
        .update_class("a", ClassSpec::new(3).with_cap(60))
        .unwrap();
    s.run_for(S);
    s.reset_counters();
    s.run_for(4 * S);
    let r = s.report();
    assert!(r.class_pct("a") <= 61.0, "{}", r.class_pct("a"));
    assert!(r.class_pct("a") >= 57.0, "{}", r.class_pct("a"));
    assert!(s.scheduler_mut().delete_class("b").is_ok());
}
