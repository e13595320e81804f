//! Property tests: entitlements (water-filling) and admission control.

use corral_scheduler::model::{Capacity, ClassSpec, Model, VmId, VmSpec};
use corral_scheduler::policy::entitlements;
use corral_scheduler::{Policy, PolicyConfig, VmUsage};
use proptest::prelude::*;

const EPS: f64 = 1e-6;

#[derive(Debug, Clone)]
struct Setup {
    cpus: u32,
    classes: Vec<(u32, Option<u32>, u32)>,
    vms: Vec<(usize, u32, u32, u32)>, // class, weight, vcpus, runnable
}

fn setup() -> impl Strategy<Value = Setup> {
    (1u32..=8)
        .prop_flat_map(|cpus| {
            let class = (1u32..=10_000, prop::option::of(1u32..=900), 0u32..=400);
            (
                Just(cpus),
                prop::collection::vec(class, 1..6),
                prop::collection::vec((0usize..6, 1u32..=10_000, 1u32..=4, 0u32..=4), 0..16),
            )
        })
        .prop_map(|(cpus, classes, vms)| Setup { cpus, classes, vms })
}

/// Builds the model, dropping reservations that admission control refuses.
fn build(s: &Setup) -> (Model, Vec<u32>) {
    let mut m = Model::new(Capacity::from_cpus(s.cpus));
    for (i, &(shares, cap, res)) in s.classes.iter().enumerate() {
        let res = cap.map_or(res, |c| res.min(c));
        let mut spec = ClassSpec::new(shares);
        spec.cap = cap;
        spec.reservation = Some(res);
        let name = format!("c{i}");
        if m.create_class(&name, spec).is_err() {
            spec.reservation = None;
            m.create_class(&name, spec).unwrap();
        }
    }
    let mut runnable = Vec::new();
    for (i, &(class, weight, vcpus, run)) in s.vms.iter().enumerate() {
        let class = format!("c{}", class % s.classes.len());
        m.add_vm(
            VmId(i as u64),
            VmSpec::new(class, vcpus).with_weight(weight),
        )
        .unwrap();
        runnable.push(run.min(vcpus));
    }
    (m, runnable)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Entitlements never exceed capacity, caps or what the runnable vCPUs
    /// can use; reservations are honoured up to demand; the whole capacity
    /// is handed out when demand allows (work conservation); VM
    /// entitlements add up to their class's.
    #[test]
    fn entitlement_invariants(s in setup()) {
        let (m, runnable) = build(&s);
        let e = entitlements(&m, |id, _| runnable[id.0 as usize]);
        let cap_total = m.capacity().percent() as f64;
        let mut total = 0.0;
        let mut wanted = 0.0;
        for (name, spec) in m.classes() {
            let got = e.classes[name];
            let demand: f64 = m
                .vms()
                .filter(|(_, v)| v.class == name)
                .map(|(id, _)| f64::from(runnable[id.0 as usize]) * 100.0)
                .sum();
            let hi = spec.cap.map_or(demand, |c| demand.min(f64::from(c)));
            prop_assert!(got <= hi + EPS, "{name}: {got} > {hi}");
            let lo = (spec.reserved_percent() as f64).min(hi);
            prop_assert!(got >= lo - EPS, "{name}: {got} < reserved {lo}");
            let vm_sum: f64 = m
                .vms()
                .filter(|(_, v)| v.class == name)
                .map(|(id, _)| e.vms[&id])
                .sum();
            prop_assert!((vm_sum - got).abs() < 1e-4, "{name}: VMs {vm_sum} != class {got}");
            total += got;
            wanted += hi;
        }
        for (id, v) in m.vms() {
            let ent = e.vms[&id];
            prop_assert!(ent >= 0.0);
            prop_assert!(ent <= f64::from(runnable[id.0 as usize]) * 100.0 + EPS);
            let _ = v;
        }
        prop_assert!(total <= cap_total + 1e-4);
        prop_assert!((total - wanted.min(cap_total)).abs() < 1e-4, "total {total} wanted {wanted}");
    }

    /// Raising a class's shares never lowers its entitlement.
    #[test]
    fn monotonic_in_shares(s in setup(), which in 0usize..6, extra in 1u32..5000) {
        let (m, runnable) = build(&s);
        let name = format!("c{}", which % s.classes.len());
        let before = entitlements(&m, |id, _| runnable[id.0 as usize]).classes[&name];
        let mut m2 = m.clone();
        let mut spec = *m2.class(&name).unwrap();
        spec.shares = (spec.shares + extra).min(10_000);
        m2.update_class(&name, spec).unwrap();
        let after = entitlements(&m2, |id, _| runnable[id.0 as usize]).classes[&name];
        prop_assert!(after >= before - 1e-6, "{before} -> {after}");
    }

    /// Admission control: whatever sequence of changes is attempted, the
    /// reserved total never exceeds capacity and refused changes leave the
    /// model untouched.
    #[test]
    fn admission_never_overcommits(
        cpus in 1u32..=8,
        ops in prop::collection::vec((0u8..4, 0usize..4, 0u32..=500, 1u32..=100), 1..40),
    ) {
        let mut m = Model::new(Capacity::from_cpus(cpus));
        for (op, class, res, cpus2) in ops {
            let name = format!("c{class}");
            let before = m.clone();
            let r = match op {
                0 => m.create_class(&name, ClassSpec::new(100).with_reservation(res)),
                1 => m.update_class(&name, ClassSpec::new(100).with_reservation(res)),
                2 => m.delete_class(&name).map(|_| ()),
                _ => m.set_capacity(Capacity::from_percent(u64::from(cpus2) * 10)),
            };
            if r.is_err() {
                prop_assert_eq!(before.generation(), m.generation());
                prop_assert_eq!(before.reserved_percent(), m.reserved_percent());
            }
            let sum: u64 = m.classes().map(|(_, c)| c.reserved_percent()).sum();
            prop_assert_eq!(sum, m.reserved_percent());
            prop_assert!(m.reserved_percent() <= m.capacity().percent());
        }
    }

    /// Ticks with arbitrary usage never park an idle VM of an uncapped
    /// class, and never park anybody while the VMs that want CPU cannot fill
    /// the host.
    #[test]
    fn no_needless_parking(
        s in setup(),
        ticks in prop::collection::vec(prop::collection::vec((0u64..30_000_000, any::<bool>()), 16), 1..20),
    ) {
        let (m, _) = build(&s);
        let mut p = Policy::new(PolicyConfig::default());
        let mut totals = vec![0u64; s.vms.len()];
        for (t, usage) in ticks.iter().enumerate() {
            let usages: Vec<VmUsage> = (0..s.vms.len())
                .map(|i| {
                    totals[i] += usage[i].0;
                    VmUsage::total(VmId(i as u64), totals[i], usage[i].1)
                })
                .collect();
            let out = p.tick(&m, t as u64 * 10_000_000, &usages);
            let vcpus_wanting: u32 = (0..s.vms.len())
                .filter(|&i| usage[i].1)
                .map(|i| m.vm(VmId(i as u64)).unwrap().vcpus)
                .sum();
            for d in out.vms() {
                let i = d.vm.0 as usize;
                let spec = m.vm(d.vm).unwrap();
                let capped = m.class(&spec.class).unwrap().cap.is_some();
                if capped {
                    continue;
                }
                if !usage[i].1 {
                    prop_assert!(d.should_run, "idle uncapped VM parked");
                }
                if u64::from(vcpus_wanting) * 100 <= m.capacity().percent() {
                    prop_assert!(d.should_run, "parked although the host has room");
                }
            }
        }
    }
}
