//! Hierarchical classes in the simulator (issue 13 item 2): shares divide
//! the parent's portion at every level; caps and reservations apply at any
//! level; an outside load does not change the division.

use corral_scheduler::model::{Capacity, ClassSpec};
use corral_scheduler::sim::{Pattern, SimConfig, SimReport, Simulator};

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

fn sim() -> Simulator {
    Simulator::new(
        Capacity::from_cpus(2),
        SimConfig {
            park_latency_ns: 4 * MS,
            stat_jiffy_ns: 10 * MS,
            ..SimConfig::default()
        },
    )
}

/// Two tenants 1:1; tenant-a's children gold and bronze 3:1; tenant-b's
/// two VMs directly in it; all four 2-vCPU VMs spin.
fn two_tenants(s: &mut Simulator) {
    s.create_class("tenant-a", ClassSpec::new(100)).unwrap();
    s.create_class("tenant-b", ClassSpec::new(100)).unwrap();
    s.create_class_in("a-gold", ClassSpec::new(300), "tenant-a")
        .unwrap();
    s.create_class_in("a-bronze", ClassSpec::new(100), "tenant-a")
        .unwrap();
    for class in ["a-gold", "a-bronze", "tenant-b", "tenant-b"] {
        s.add_vm(class, 100, 2, Pattern::Hog).unwrap();
    }
}

fn window(s: &mut Simulator) -> SimReport {
    s.run_for(2 * S);
    s.reset_counters();
    s.run_for(10 * S);
    s.report()
}

fn print_and_check(r: &SimReport, what: &str) {
    let (g, b, t) = (
        r.class_share("a-gold"),
        r.class_share("a-bronze"),
        r.class_share("tenant-b"),
    );
    eprintln!(
        "{what}: tenant-a {:.2} % (gold {g:.2} %, bronze {b:.2} %), tenant-b {t:.2} % of the \
         VMs' CPU; targets 50 (37.5, 12.5) and 50, bound ± 2",
        g + b
    );
    assert!((g + b - 50.0).abs() <= 2.0, "tenant-a {}", g + b);
    assert!((t - 50.0).abs() <= 2.0, "tenant-b {t}");
    assert!((g - 37.5).abs() <= 2.0, "gold {g}");
    assert!((b - 12.5).abs() <= 2.0, "bronze {b}");
}

#[test]
fn two_level_tree_divides_at_every_level() {
    let mut s = sim();
    two_tenants(&mut s);
    let r = window(&mut s);
    print_and_check(&r, "two-level tree");
    let st = s.scheduler().stats();
    let gold = st.classes.iter().find(|c| c.name == "a-gold").unwrap();
    assert_eq!(gold.parent.as_deref(), Some("tenant-a"));
}

#[test]
fn two_level_tree_beside_an_outside_busy_loop() {
    let mut s = sim();
    two_tenants(&mut s);
    s.set_outside_load(1);
    let r = window(&mut s);
    print_and_check(&r, "two-level tree beside a busy loop");
}

#[test]
fn caps_and_reservations_at_inner_levels() {
    let mut s = sim();
    // tenant-a capped at 60 % as a whole; tenant-b's child reserves a CPU.
    s.create_class("tenant-a", ClassSpec::new(10_000).with_cap(60))
        .unwrap();
    s.create_class("tenant-b", ClassSpec::new(1)).unwrap();
    s.create_class_in("a-gold", ClassSpec::new(300), "tenant-a")
        .unwrap();
    s.create_class_in("a-bronze", ClassSpec::new(100), "tenant-a")
        .unwrap();
    s.create_class("other", ClassSpec::new(100)).unwrap();
    s.create_class_in("b-res", ClassSpec::new(1).with_reservation(100), "tenant-b")
        .unwrap();
    let g = s.add_vm("a-gold", 100, 2, Pattern::Hog).unwrap();
    let b = s.add_vm("a-bronze", 100, 2, Pattern::Hog).unwrap();
    let res = s.add_vm("b-res", 100, 2, Pattern::Hog).unwrap();
    let o = s.add_vm("other", 100, 2, Pattern::Hog).unwrap();
    let r = window(&mut s);
    let (g, b, res, o) = (
        r.vm(g).cpu_pct,
        r.vm(b).cpu_pct,
        r.vm(res).cpu_pct,
        r.vm(o).cpu_pct,
    );
    eprintln!(
        "tenant-a capped at 60: gold {g:.1} % bronze {b:.1} % (45 / 15); tenant-b's child \
         reserving 100 under shares 1 against 10000 and 100: {res:.1} %; other {o:.1} % (40)"
    );
    assert!(g + b <= 61.0, "tenant-a {}", g + b);
    assert!(
        (g / (g + b) - 0.75).abs() < 0.03,
        "gold's part {}",
        g / (g + b)
    );
    assert!(res >= 97.0, "reservation under a parent: {res:.1}");
    assert!(o >= 35.0, "the rest goes to the other class: {o:.1}");
}

/// A VM moves live between classes at different levels of the tree; its
/// new place's shares apply from then on.
#[test]
fn a_vm_moves_between_levels_of_the_tree() {
    let mut s = sim();
    two_tenants(&mut s);
    let r = window(&mut s);
    print_and_check(&r, "before the move");
    // Move one of tenant-b's VMs into a-bronze: the tenants still split
    // 1:1 and gold:bronze 3:1; bronze's two VMs share its 12.5 %.
    let moved = r
        .vms
        .iter()
        .filter(|v| v.class == "tenant-b")
        .map(|v| v.id)
        .next()
        .unwrap();
    s.scheduler_mut().move_vm(moved, "a-bronze").unwrap();
    let r = window(&mut s);
    let (g, b, t) = (
        r.class_share("a-gold"),
        r.class_share("a-bronze"),
        r.class_share("tenant-b"),
    );
    eprintln!(
        "after moving a VM from tenant-b into a-bronze: gold {g:.2} % bronze {b:.2} % \
         (two VMs), tenant-b {t:.2} % (one VM); targets 37.5, 12.5, 50"
    );
    assert!((g - 37.5).abs() <= 2.0 && (b - 12.5).abs() <= 2.0 && (t - 50.0).abs() <= 2.0);
    assert_eq!(r.vm(moved).class, "a-bronze");
}
