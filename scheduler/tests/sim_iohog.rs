//! The interference benchmark's I/O-hog case in the simulator: a CPU-bound
//! victim (shares 3) beside a throttled I/O hog (shares 1) whose device
//! thread is charged to it, reported as a busy helper and never parked.
//! The hog uses a fraction of a CPU; the victim must not be parked for it.

use corral_scheduler::model::{Capacity, ClassSpec};
use corral_scheduler::sim::{Pattern, SimConfig, Simulator};

const US: u64 = 1_000;
const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

struct Run {
    victim_pct: f64,
    hog_pct: f64,
    outside_pct: f64,
    /// Fraction of the window the victim was parked while it wanted CPU.
    victim_parked: f64,
    victim_ent: f64,
}

/// A 2-vCPU victim spinning, beside a 1-vCPU hog admitted `iops` requests a
/// second, each `work_us` of its vCPU and as much of its device thread, on
/// 2 CPUs beside `loops` outside busy loops, over 10 s after 2 s.
fn victim_beside_io_hog(loops: u32, iops: u64, work_us: u64) -> Run {
    let mut s = Simulator::new(
        Capacity::from_cpus(2),
        SimConfig {
            park_latency_ns: 4 * MS,
            stat_jiffy_ns: 10 * MS,
            ..SimConfig::default()
        },
    );
    s.create_class("victim", ClassSpec::new(3)).unwrap();
    s.create_class("hog", ClassSpec::new(1)).unwrap();
    let victim = s.add_vm("victim", 100, 2, Pattern::Hog).unwrap();
    let hog = s
        .add_vm(
            "hog",
            100,
            1,
            Pattern::Throttled {
                interval_ns: S / iops,
                vcpu_ns: work_us * US,
                helper_ns: work_us * US,
            },
        )
        .unwrap();
    s.set_outside_load(loops);
    s.run_for(2 * S);
    s.reset_counters();
    s.run_for(10 * S);
    let r = s.report();
    let v = r.vm(victim);
    let run = Run {
        victim_pct: v.cpu_pct,
        hog_pct: r.vm(hog).cpu_pct,
        outside_pct: r.outside_ns / r.window_ns as f64 * 100.0,
        victim_parked: v.parked_wanting_ns as f64 / r.window_ns as f64,
        victim_ent: v.entitlement_pct,
    };
    eprintln!(
        "{loops} loop(s), hog {iops} IOPS x {work_us} us: victim {:.1} % (entitled {:.1}, \
         parked {:.1} % of the time), hog {:.1} %, outside {:.1} %",
        run.victim_pct,
        run.victim_ent,
        run.victim_parked * 100.0,
        run.hog_pct,
        run.outside_pct
    );
    run
}

/// The hog uses ~30 % of a CPU (vCPU and device thread), far below what its
/// threads could get; the victim gets the rest of what the host leaves the
/// VMs. Counting the hog's usage as contended (its two threads each "got"
/// the fair share of four) made its demand a full 200 %, and while it ranked
/// first the victim was parked behind it.
#[test]
fn a_light_io_hog_does_not_park_the_victim() {
    for loops in [0, 1] {
        let r = victim_beside_io_hog(loops, 5000, 30);
        assert!(
            r.victim_parked < 0.05,
            "victim parked {:.1} % of the time",
            r.victim_parked * 100.0
        );
        // What the host leaves it: beside no loop all but the hog's use;
        // beside one loop CFS splits the rest among three spinning threads.
        let free = if loops == 0 {
            200.0 - r.hog_pct
        } else {
            (200.0 - r.hog_pct) * 2.0 / 3.0
        };
        assert!(
            r.victim_pct >= 0.9 * free,
            "victim {:.1} % of the {free:.1} % it could get",
            r.victim_pct
        );
    }
}
