//! The simulator with an outside load (threads that are not corral's, served
//! by the host's per-thread fairness): shares, caps and reservations among
//! the VMs hold on the CPU that is left to them.

use corral_scheduler::model::{Capacity, ClassSpec};
use corral_scheduler::sim::{Pattern, SimConfig, Simulator};

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

fn sim(f: impl FnOnce(&mut SimConfig)) -> Simulator {
    let mut c = SimConfig {
        park_latency_ns: 4 * MS,
        // /proc/stat counts in 10 ms jiffies.
        stat_jiffy_ns: 10 * MS,
        ..SimConfig::default()
    };
    f(&mut c);
    Simulator::new(Capacity::from_cpus(2), c)
}

/// Issue 13's setup: gold (3) and bronze (1), one spinning 2-vCPU VM each,
/// beside one outside busy loop on 2 CPUs, over 10 s. Returns gold's share
/// of the VMs' CPU, the VMs' total and the outside loop's CPU (% of a CPU).
fn three_to_one_beside_a_loop(measure: bool) -> (f64, f64, f64) {
    let mut s = sim(|c| c.measure_outside = measure);
    s.create_class("gold", ClassSpec::new(3)).unwrap();
    s.create_class("bronze", ClassSpec::new(1)).unwrap();
    s.add_vm("gold", 100, 2, Pattern::Hog).unwrap();
    s.add_vm("bronze", 100, 2, Pattern::Hog).unwrap();
    s.set_outside_load(1);
    s.run_for(2 * S);
    s.reset_counters();
    s.run_for(10 * S);
    let r = s.report();
    let vms = r.class_pct("gold") + r.class_pct("bronze");
    let outside = r.outside_ns / r.window_ns as f64 * 100.0;
    (r.class_share("gold"), vms, outside)
}

#[test]
fn shares_hold_beside_an_outside_busy_loop() {
    let (gold, vms, outside) = three_to_one_beside_a_loop(true);
    eprintln!(
        "planning with the measured outside load: gold {gold:.2} % of the VMs' {vms:.1} % \
         (want 75 ± 2), outside loop {outside:.1} %"
    );
    assert!((gold - 75.0).abs() <= 2.0, "gold got {gold:.2} %");
    // The VMs still get the CPU that CFS leaves them (133 % when 2 vCPU
    // threads run beside the loop), less kick latency.
    assert!(vms >= 120.0, "VMs got {vms:.1} %");
}

/// The model reproduces the failure: planning with the nominal capacity,
/// gold's entitlement is out of its reach and its credit flows to bronze
/// (62-63 % on real VMs; 62.6 % in this model before the exclusion charge,
/// which bills the CPU the loop takes, seen as idle while the other VM
/// waits, to the VM that ran, and brings it to 72.5 %: still outside the
/// 75 ± 2 band the measurement keeps).
#[test]
fn without_the_outside_measurement_the_shares_break() {
    let (gold, vms, outside) = three_to_one_beside_a_loop(false);
    eprintln!(
        "planning with the nominal capacity: gold {gold:.2} % of the VMs' {vms:.1} %, \
         outside loop {outside:.1} %"
    );
    assert!(
        gold < 73.0,
        "gold got {gold:.2} %: the model no longer shows the bug"
    );
}

/// A cap and a reservation beside two outside loops.
#[test]
fn cap_and_reservation_beside_outside_load() {
    let mut s = sim(|_| ());
    s.create_class("capped", ClassSpec::new(100).with_cap(30))
        .unwrap();
    s.create_class("res", ClassSpec::new(1).with_reservation(80))
        .unwrap();
    s.create_class("x", ClassSpec::new(10)).unwrap();
    let capped = s.add_vm("capped", 100, 2, Pattern::Hog).unwrap();
    let res = s.add_vm("res", 100, 2, Pattern::Hog).unwrap();
    let x = s.add_vm("x", 100, 2, Pattern::Hog).unwrap();
    s.set_outside_load(1);
    s.run_for(2 * S);
    s.reset_counters();
    s.run_for(10 * S);
    let r = s.report();
    let (c, rv, xv) = (r.vm(capped).cpu_pct, r.vm(res).cpu_pct, r.vm(x).cpu_pct);
    let st = s.scheduler().stats();
    eprintln!(
        "capped {c:.1} % (cap 30), reserved {rv:.1} % (80), x {xv:.1} %; \
         available {:.1} % outside {:.1} % shortfall {:.3}",
        st.available_pct, st.outside_pct, st.shortfall_ratio
    );
    assert!(c <= 31.0, "cap exceeded: {c:.1}");
    assert!(rv >= 78.0, "reservation not honoured: {rv:.1}");
    assert_eq!(st.shortfall_ratio, 0.0);
}

/// Reservations the host cannot deliver beside the outside load: the
/// shortfall is reported, and the reserved classes split what there is.
#[test]
fn shortfall_is_reported_when_reservations_do_not_fit() {
    let mut s = sim(|_| ());
    s.create_class("a", ClassSpec::new(1).with_reservation(100))
        .unwrap();
    s.create_class("b", ClassSpec::new(1).with_reservation(100))
        .unwrap();
    let a = s.add_vm("a", 100, 2, Pattern::Hog).unwrap();
    let b = s.add_vm("b", 100, 2, Pattern::Hog).unwrap();
    s.run_for(S);
    assert_eq!(s.scheduler().stats().shortfall_ratio, 0.0);
    s.set_outside_load(2);
    s.run_for(3 * S);
    s.reset_counters();
    s.run_for(5 * S);
    let r = s.report();
    let st = s.scheduler().stats();
    eprintln!(
        "a {:.1} % b {:.1} %, available {:.1} % outside {:.1} %, shortfall {:.3}",
        r.vm(a).cpu_pct,
        r.vm(b).cpu_pct,
        st.available_pct,
        st.outside_pct,
        st.shortfall_ratio
    );
    assert!(st.shortfall_ratio > 0.2, "{}", st.shortfall_ratio);
    let ratio = r.vm(a).cpu_pct / r.vm(b).cpu_pct;
    assert!(
        (ratio - 1.0).abs() < 0.1,
        "equal reservations split {ratio:.2}"
    );
}
