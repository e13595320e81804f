//! The minimum slice: a VM unparked for its turn runs at least
//! `PolicyConfig::min_slice_ns` before VMs that wait can displace it. With
//! many VMs that each fill the host, one-tick turns are a park and an
//! unpark at every tick (each a kick or a wake of every vCPU); two-tick
//! turns halve them, and the shares do not move. (That a slice never parks
//! a running VM to let a VM in its slice go on is
//! `sim_iohog::a_light_io_hog_does_not_park_the_victim`: ranking the VMs
//! in their slice first parked the io victim 15 % of the time.)

use corral_scheduler::sim::{Pattern, SimConfig, SimReport, Simulator};
use corral_scheduler::{Capacity, ClassSpec, PolicyConfig};

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

/// 25 VMs of 4 spinning vCPUs on 2 CPUs, classes a:b = 2:1 (13 VMs in a,
/// 12 in b), 4-ms kicks, 10 s after 2 s: the scheduler benchmark's load.
fn many_big_vms(min_slice_ns: u64) -> (SimReport, f64) {
    let mut s = Simulator::new(
        Capacity::from_cpus(2),
        SimConfig {
            park_latency_ns: 4 * MS,
            policy: PolicyConfig {
                min_slice_ns,
                ..PolicyConfig::default()
            },
            ..SimConfig::default()
        },
    );
    s.create_class("a", ClassSpec::new(2)).unwrap();
    s.create_class("b", ClassSpec::new(1)).unwrap();
    for i in 0..25 {
        s.add_vm(if i % 2 == 0 { "a" } else { "b" }, 100, 4, Pattern::Hog)
            .unwrap();
    }
    s.run_for(2 * S);
    s.reset_counters();
    s.run_for(10 * S);
    let r = s.report();
    let parks: u64 = r.vms.iter().map(|v| v.parks).sum();
    // Parks per 10-ms tick.
    let per_tick = parks as f64 / 1000.0;
    (r, per_tick)
}

#[test]
fn two_tick_slices_halve_the_parks_and_keep_the_shares() {
    let (one, one_parks) = many_big_vms(10 * MS);
    let (two, two_parks) = many_big_vms(20 * MS);
    for (name, r, parks) in [("one-tick", &one, one_parks), ("two-tick", &two, two_parks)] {
        eprintln!(
            "{name} turns: a {:.1} % b {:.1} % (a's share {:.2} %), {parks:.2} parks a tick, longest wait {} ms",
            r.class_pct("a"),
            r.class_pct("b"),
            r.class_share("a"),
            r.vms.iter().map(|v| v.longest_starve_ns).max().unwrap_or(0) / MS
        );
    }
    assert!(one_parks > 0.9, "one-tick turns: {one_parks} parks a tick");
    assert!(
        two_parks < 0.55 * one_parks,
        "two-tick turns: {two_parks} parks a tick against {one_parks}"
    );
    // a:b = 2:1 of the host in both.
    for r in [&one, &two] {
        let share = r.class_share("a");
        assert!((share - 200.0 / 3.0).abs() < 2.0, "a's share {share} %");
        assert!(r.utilisation() > 0.99, "utilisation {}", r.utilisation());
    }
}
