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

/// The interference benchmark's victims (`corral-bench interference`).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Victim {
    /// 2 vCPUs spinning (the cpu job).
    Cpu,
    /// 1 vCPU, 4 reads in flight, no limit (the io job).
    Io,
}

/// The probe's disk job: `vcpu_ns` of the guest and `helper_ns` of the
/// device thread per 4 KiB read, `latency_ns` between them.
const IO_VCPU_NS: u64 = 20 * US;
const IO_HELPER_NS: u64 = 10 * US;
const IO_LATENCY_NS: u64 = 300 * US;

/// One run: the victim's work rate (CPU for the cpu victim, reads for the
/// io victim), its parks, and what the policy counted the hog at.
#[derive(Debug)]
struct Interference {
    /// CPU % (cpu victim) or reads per second (io victim).
    rate: f64,
    victim_parked: f64,
    victim_parks: u64,
    hog_pct: f64,
    hog_demand_pct: f64,
}

/// The victim (shares 3) alone (`hog_iops` `None`) or beside the limited
/// I/O hog (shares 1; 1 vCPU, 4 reads in flight, `hog_iops` a second, a
/// bucket of one second), on 2 CPUs with a 4 ms kick, over 10 s after 2 s.
/// Steps of 10 µs, so that a read's stages take steps of their own.
fn interference(victim: Victim, hog_iops: Option<u64>, loops: u32) -> Interference {
    let mut s = Simulator::new(
        Capacity::from_cpus(2),
        SimConfig {
            step_ns: 10 * US,
            park_latency_ns: 4 * MS,
            stat_jiffy_ns: 10 * MS,
            ..SimConfig::default()
        },
    );
    s.create_class("victim", ClassSpec::new(3)).unwrap();
    s.create_class("hog", ClassSpec::new(1)).unwrap();
    let io = |interval_ns: u64, burst: u32| Pattern::IoLoop {
        queue_depth: 4,
        interval_ns,
        burst,
        vcpu_ns: IO_VCPU_NS,
        helper_ns: IO_HELPER_NS,
        latency_ns: IO_LATENCY_NS,
    };
    // The hog runs first; the victim boots beside it.
    let hog = hog_iops.map(|iops| s.add_vm("hog", 100, 1, io(S / iops, iops as u32)).unwrap());
    s.set_outside_load(loops);
    s.run_for(2 * S);
    let v = match victim {
        Victim::Cpu => s.add_vm("victim", 100, 2, Pattern::Hog),
        Victim::Io => s.add_vm("victim", 100, 1, io(0, 0)),
    }
    .unwrap();
    s.reset_counters();
    s.run_for(10 * S);
    let r = s.report();
    let vr = r.vm(v);
    let secs = r.window_ns as f64 / S as f64;
    let run = Interference {
        rate: match victim {
            Victim::Cpu => vr.cpu_pct,
            Victim::Io => vr.latencies_ns.len() as f64 / secs,
        },
        victim_parked: vr.parked_wanting_ns as f64 / r.window_ns as f64,
        victim_parks: vr.parks,
        hog_pct: hog.map_or(0.0, |h| r.vm(h).cpu_pct),
        hog_demand_pct: hog.map_or(0.0, |h| r.vm(h).demand_pct),
    };
    eprintln!("{victim:?} victim, hog {hog_iops:?} IOPS, {loops} loop(s): {run:?}");
    run
}

/// The interference benchmark's I/O-hog goal (slowdown ≤ 1.50× with shares
/// 3:1 and a limit on the hog) for both victims, with the hog at a quarter
/// of the io job's rate alone (as the benchmark) and at two thirds of it,
/// on an idle host and beside a busy loop. The hog uses a part of a CPU;
/// the victim must not be parked for its turns, and the hog must be counted
/// near what it uses. Before the max-min light rule, the io victim beside
/// the heavier hog and the loop was parked 17.1 % of the time (107 parks),
/// the hog counted at 147 % while using 25 %, slowdown 1.231.
#[test]
fn victims_beside_a_limited_io_hog() {
    let io_alone = interference(Victim::Io, None, 0).rate;
    for loops in [0, 1] {
        for victim in [Victim::Cpu, Victim::Io] {
            let alone = interference(victim, None, loops);
            for iops in [(io_alone / 4.0) as u64, (io_alone * 2.0 / 3.0) as u64] {
                let beside = interference(victim, Some(iops), loops);
                let slowdown = alone.rate / beside.rate;
                let what = format!("{victim:?} victim, hog {iops} IOPS, {loops} loop(s)");
                eprintln!("{what}: slowdown {slowdown:.3}");
                assert!(
                    beside.victim_parked < 0.02,
                    "{what}: victim parked {:.1} % of the time ({} parks)",
                    beside.victim_parked * 100.0,
                    beside.victim_parks
                );
                assert!(
                    beside.hog_demand_pct < 2.0 * beside.hog_pct + 20.0,
                    "{what}: hog counted at {:.1} % while using {:.1} %",
                    beside.hog_demand_pct,
                    beside.hog_pct
                );
                assert!(slowdown <= 1.20, "{what}: slowdown {slowdown:.3}");
            }
        }
    }
}
