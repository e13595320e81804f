//! Per-VM caps (issue 13 item 3) in the simulator: a VM's own cap holds on
//! an idle host and under contention, on top of its class's cap, beside an
//! outside load, and changes live; what a capped VM cannot use goes to the
//! others.

use corral_scheduler::model::{Capacity, ClassSpec, VmId};
use corral_scheduler::sim::{Pattern, SimConfig, SimReport, Simulator};

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

fn sim(cpus: u32) -> Simulator {
    Simulator::new(
        Capacity::from_cpus(cpus),
        SimConfig {
            park_latency_ns: 4 * MS,
            stat_jiffy_ns: 10 * MS,
            ..SimConfig::default()
        },
    )
}

fn window(s: &mut Simulator, secs: u64) -> SimReport {
    s.run_for(S);
    s.reset_counters();
    s.run_for(secs * S);
    s.report()
}

fn cap(s: &mut Simulator, id: VmId, cap: Option<u32>) {
    s.scheduler_mut().set_vm_cap(id, cap).unwrap();
}

#[test]
fn a_vm_cap_holds_on_an_idle_host_and_the_rest_goes_to_the_others() {
    let mut s = sim(2);
    s.create_class("c", ClassSpec::new(100)).unwrap();
    let a = s.add_vm("c", 100, 2, Pattern::Hog).unwrap();
    cap(&mut s, a, Some(30));
    let r = window(&mut s, 10);
    eprintln!("alone, cap 30: {:.2} %", r.vm(a).cpu_pct);
    assert!((r.vm(a).cpu_pct - 30.0).abs() <= 1.0, "{}", r.vm(a).cpu_pct);

    let b = s.add_vm("c", 100, 2, Pattern::Hog).unwrap();
    let r = window(&mut s, 10);
    eprintln!(
        "beside an uncapped VM of the same class: capped {:.2} % (cap 30), other {:.2} %",
        r.vm(a).cpu_pct,
        r.vm(b).cpu_pct
    );
    assert!(r.vm(a).cpu_pct <= 31.0 && r.vm(a).cpu_pct >= 28.0);
    assert!(
        r.vm(b).cpu_pct >= 165.0,
        "work conservation: {}",
        r.vm(b).cpu_pct
    );
}

#[test]
fn vm_and_class_caps_combine() {
    let mut s = sim(2);
    s.create_class("c", ClassSpec::new(100).with_cap(100))
        .unwrap();
    let a = s.add_vm("c", 100, 2, Pattern::Hog).unwrap();
    let b = s.add_vm("c", 100, 2, Pattern::Hog).unwrap();
    cap(&mut s, a, Some(20));
    let r = window(&mut s, 10);
    eprintln!(
        "class cap 100: VM cap 20 -> {:.2} %, other VM {:.2} %",
        r.vm(a).cpu_pct,
        r.vm(b).cpu_pct
    );
    assert!(r.vm(a).cpu_pct <= 21.0, "{}", r.vm(a).cpu_pct);
    assert!((r.vm(a).cpu_pct + r.vm(b).cpu_pct) <= 101.0);
    assert!(r.vm(b).cpu_pct >= 75.0, "{}", r.vm(b).cpu_pct);
}

#[test]
fn a_vm_cap_changes_live_and_holds_beside_an_outside_load() {
    let mut s = sim(2);
    s.create_class("gold", ClassSpec::new(300)).unwrap();
    s.create_class("bronze", ClassSpec::new(100)).unwrap();
    let g = s.add_vm("gold", 100, 2, Pattern::Hog).unwrap();
    let b = s.add_vm("bronze", 100, 2, Pattern::Hog).unwrap();
    s.set_outside_load(1);
    cap(&mut s, g, Some(50));
    let r = window(&mut s, 10);
    eprintln!(
        "beside a busy loop, gold capped at 50: {:.2} %, bronze {:.2} %",
        r.vm(g).cpu_pct,
        r.vm(b).cpu_pct
    );
    assert!(r.vm(g).cpu_pct <= 51.0 && r.vm(g).cpu_pct >= 45.0);
    assert!(r.vm(b).cpu_pct > r.vm(g).cpu_pct, "bronze gets the rest");
    cap(&mut s, g, None);
    let r = window(&mut s, 10);
    let share = r.class_share("gold");
    eprintln!("cap removed: gold's share {share:.2} %");
    assert!((share - 75.0).abs() <= 2.0, "{share}");
    assert!(s.scheduler().stats().vms.iter().all(|v| v.cap.is_none()));
}
