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
    vm_caps: Vec<Option<u32>>,
}

fn setup() -> impl Strategy<Value = Setup> {
    (1u32..=8)
        .prop_flat_map(|cpus| {
            let class = (1u32..=10_000, prop::option::of(1u32..=900), 0u32..=400);
            (
                Just(cpus),
                prop::collection::vec(class, 1..6),
                prop::collection::vec((0usize..6, 1u32..=10_000, 1u32..=4, 0u32..=4), 0..16),
                prop::collection::vec(prop::option::weighted(0.3, 1u32..=300), 16),
            )
        })
        .prop_map(|(cpus, classes, vms, vm_caps)| Setup {
            cpus,
            classes,
            vms,
            vm_caps,
        })
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
        let mut spec = VmSpec::new(class, vcpus).with_weight(weight);
        spec.cap = s.vm_caps[i];
        m.add_vm(VmId(i as u64), spec).unwrap();
        runnable.push(run.min(vcpus));
    }
    (m, runnable)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Entitlements never exceed capacity, class or VM caps, or what the
    /// runnable vCPUs can use; reservations are honoured up to demand; the whole capacity
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
                .map(|(id, v)| {
                    let d = f64::from(runnable[id.0 as usize]) * 100.0;
                    v.cap.map_or(d, |c| d.min(f64::from(c)))
                })
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
            if let Some(c) = v.cap {
                prop_assert!(ent <= f64::from(c) + EPS, "VM {id}: {ent} > its cap {c}");
            }
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
                let capped = m.class(&spec.class).unwrap().cap.is_some() || spec.cap.is_some();
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

    /// Whatever outside load and steal are measured, the policy plans with
    /// nominal less what they take (never below a quarter of it), hands out
    /// no more than that, and reports a shortfall exactly when the claimed
    /// reservations do not fit.
    #[test]
    fn outside_load_bounds_the_plan(
        s in setup(),
        samples in prop::collection::vec((0.0f64..900.0, 0.0f64..100.0, 1u64..200_000_000), 1..10),
    ) {
        let (m, runnable) = build(&s);
        let mut p = Policy::new(PolicyConfig::default());
        let nominal = m.capacity().percent() as f64;
        let mut t = 0;
        for (outside, steal, interval) in samples {
            p.set_measured_outside(Some(outside), interval);
            p.set_measured_steal(Some(steal));
            let usages: Vec<VmUsage> = (0..s.vms.len())
                .map(|i| {
                    VmUsage::total(VmId(i as u64), t, true)
                        .with_runnable_vcpus(runnable[i])
                })
                .collect();
            p.tick(&m, t, &usages);
            t += 10_000_000;
            let st = p.stats();
            let h = p.host_load();
            prop_assert!(st.available_pct >= nominal / 4.0 - EPS);
            prop_assert!(st.available_pct <= nominal + EPS);
            prop_assert!((h.available_pct() - st.available_pct).abs() <= 1.0 + EPS);
            let taken = h.outside_pct() + h.steal_pct();
            prop_assert!(h.available_pct() >= nominal - taken - EPS);
            let handed: f64 = st.classes.iter().map(|c| c.entitlement_pct).sum();
            prop_assert!(handed <= st.available_pct + 1e-4, "{handed} > {}", st.available_pct);
            let short = st.claimed_reservations_pct > st.available_pct + EPS;
            prop_assert_eq!(st.shortfall_ratio > 0.0, short);
        }
    }

    /// Admission control down a class tree: whatever classes are created,
    /// updated and deleted (under random parents), the reserved total is
    /// the roots' effective reservations recomputed from scratch, it never
    /// exceeds capacity, no capped class holds more than its cap for its
    /// children, and refused changes leave the model untouched.
    #[test]
    fn tree_admission_matches_a_recomputation(
        cpus in 1u32..=4,
        ops in prop::collection::vec(
            (0u8..3, 0usize..8, 0usize..9, 0u32..=300, prop::option::of(1u32..=400)),
            1..40,
        ),
    ) {
        fn eff(m: &Model, name: &str) -> u64 {
            let own = m.class(name).map_or(0, |c| c.reserved_percent());
            let kids: u64 = m.class_children(name).map(|c| eff(m, c)).sum();
            own.max(kids)
        }
        let mut m = Model::new(Capacity::from_cpus(cpus));
        for (op, class, parent, res, cap) in ops {
            let name = format!("c{class}");
            let parent = (parent < 8).then(|| format!("c{parent}"));
            let mut spec = ClassSpec::new(100).with_reservation(res);
            spec.cap = cap;
            let before = m.clone();
            let r = match op {
                0 => m.create_class_in(&name, spec, parent.as_deref()),
                1 => m.update_class(&name, spec),
                _ => m.delete_class(&name).map(|_| ()),
            };
            if r.is_err() {
                prop_assert_eq!(before.generation(), m.generation());
                prop_assert_eq!(before.reserved_percent(), m.reserved_percent());
            }
            let roots: u64 = m
                .classes()
                .filter(|(n, _)| m.class_parent(n).is_none())
                .map(|(n, _)| eff(&m, n))
                .sum();
            prop_assert_eq!(roots, m.reserved_percent());
            prop_assert!(m.reserved_percent() <= m.capacity().percent());
            for (n, c) in m.classes() {
                prop_assert_eq!(m.class_reserved_percent(n), Some(eff(&m, n)));
                if let Some(cap) = c.cap {
                    prop_assert!(eff(&m, n) <= u64::from(cap), "{n}: {} > cap {cap}", eff(&m, n));
                }
            }
        }
    }

    /// Entitlements in a random class tree: every class gets what its
    /// children and own VMs get together (when it can use it), never more
    /// than its cap or its subtree's demand, at least its reservation up to
    /// that demand; the roots hand out min(capacity, demand).
    #[test]
    fn tree_entitlement_invariants(
        cpus in 1u32..=4,
        classes in prop::collection::vec(
            (0usize..8, 1u32..=1000, prop::option::of(1u32..=300), 0u32..=100),
            1..8,
        ),
        vms in prop::collection::vec((0usize..8, 1u32..=1000, 1u32..=2, 0u32..=2), 0..12),
    ) {
        let mut m = Model::new(Capacity::from_cpus(cpus));
        for (i, &(parent, shares, cap, res)) in classes.iter().enumerate() {
            // Parents are earlier classes, so the tree has no cycle.
            let parent = (parent < i).then(|| format!("c{parent}"));
            let mut spec = ClassSpec::new(shares).with_reservation(res);
            spec.cap = cap;
            let name = format!("c{i}");
            if m.create_class_in(&name, spec, parent.as_deref()).is_err() {
                spec.reservation = None;
                spec.cap = None;
                m.create_class_in(&name, spec, parent.as_deref()).unwrap();
            }
        }
        let mut runnable = Vec::new();
        for (i, &(class, weight, vcpus, run)) in vms.iter().enumerate() {
            let class = format!("c{}", class % classes.len());
            m.add_vm(VmId(i as u64), VmSpec::new(class, vcpus).with_weight(weight))
                .unwrap();
            runnable.push(run.min(vcpus));
        }
        let e = entitlements(&m, |id, _| runnable[id.0 as usize]);
        fn demand(m: &Model, name: &str, runnable: &[u32]) -> f64 {
            let own: f64 = m
                .vms()
                .filter(|(_, v)| v.class == name)
                .map(|(id, _)| f64::from(runnable[id.0 as usize]) * 100.0)
                .sum();
            let kids: f64 = m.class_children(name).map(|c| demand(m, c, runnable)).sum();
            let d = own + kids;
            m.class(name).unwrap().cap.map_or(d, |c| d.min(f64::from(c)))
        }
        let mut roots = (0.0, 0.0);
        for (name, spec) in m.classes() {
            let got = e.classes[name];
            let hi = demand(&m, name, &runnable);
            prop_assert!(got <= hi + 1e-4, "{name}: {got} > {hi}");
            if let Some(c) = spec.cap {
                prop_assert!(got <= f64::from(c) + 1e-4);
            }
            let below: f64 = m.class_children(name).map(|c| e.classes[c]).sum::<f64>()
                + m.vms().filter(|(_, v)| v.class == name).map(|(id, _)| e.vms[&id]).sum::<f64>();
            prop_assert!((below - got).abs() < 1e-3, "{name}: {below} below, {got} given");
            if m.class_parent(name).is_none() {
                roots.0 += got;
                roots.1 += hi;
                let lo = (m.class_reserved_percent(name).unwrap() as f64).min(hi);
                prop_assert!(got >= lo - 1e-4, "{name}: {got} < reserved {lo}");
            }
        }
        let cap_total = m.capacity().percent() as f64;
        prop_assert!((roots.0 - roots.1.min(cap_total)).abs() < 1e-3, "{roots:?}");
    }
}
