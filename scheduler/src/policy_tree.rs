//! Entitlements in a class tree: water-filling level by level.
//!
//! Every class is bounded among its siblings by `hi = min(cap, demand of its
//! subtree)` (its own VMs' demand, each bounded by the VM's cap, plus its
//! children's `hi`) and `lo = min(effective reservation, hi)`. The capacity
//! is water-filled among the root classes by shares; each class's amount
//! is then water-filled among its children (by shares) and the VMs directly
//! in it (by weight), and so on down: shares divide the parent's portion at
//! every level, the way nested cgroups divide CPU by `cpu.weight`. A flat
//! set of classes is the one-level case. A cap or a spent cap budget holds
//! back the whole subtree.

use super::{Policy, Wf, water_fill};

impl Policy {
    /// Depth order, subtree vCPUs and effective reservations, after a sync.
    pub(super) fn sync_tree(&mut self) {
        let n = self.classes.len();
        if self.classes.iter().all(|c| c.parent.is_none()) {
            // Flat: every class is a root, in any order; no sums to make.
            self.tree_order.clear();
            self.tree_order.extend(0..n);
            for c in &mut self.classes {
                c.eff_res = c.spec.reserved_percent() as f64;
            }
            return;
        }
        let mut depth = vec![0usize; n];
        for (ci, d) in depth.iter_mut().enumerate() {
            let mut p = self.classes[ci].parent;
            // The model bounds depth; the guard only stops a corrupt cycle.
            while let Some(pi) = p
                && *d < n
            {
                *d += 1;
                p = self.classes[pi].parent;
            }
        }
        self.tree_order.clear();
        self.tree_order.extend(0..n);
        self.tree_order.sort_by_key(|&ci| depth[ci]);
        for c in &mut self.classes {
            c.eff_res = c.spec.reserved_percent() as f64;
        }
        let mut child_res = vec![0.0f64; n];
        for k in (0..n).rev() {
            let ci = self.tree_order[k];
            let c = &mut self.classes[ci];
            c.eff_res = c.eff_res.max(child_res[ci]);
            let (res, vcpus, parent) = (c.eff_res, c.vcpus, c.parent);
            if let Some(p) = parent {
                child_res[p] += res;
                self.classes[p].vcpus += vcpus;
            }
        }
    }

    /// Adds each class's subtree usage to its ancestors' (`used_ns` holds
    /// the class's own VMs' usage before).
    pub(super) fn add_subtree_usage(&mut self) {
        for k in (0..self.tree_order.len()).rev() {
            let ci = self.tree_order[k];
            if let Some(p) = self.classes[ci].parent {
                let used = self.classes[ci].used_ns;
                self.classes[p].used_ns += used;
            }
        }
    }

    /// Inherits "held back by a cap" and "cap budget spent" down the tree.
    pub(super) fn refresh_holds(&mut self) {
        for k in 0..self.tree_order.len() {
            let ci = self.tree_order[k];
            let (held, spent) = match self.classes[ci].parent {
                Some(p) => (self.classes[p].held, self.classes[p].spent),
                None => (false, false),
            };
            let c = &mut self.classes[ci];
            c.held = held || c.cap_bound;
            c.spent = spent || (c.spec.cap.is_some() && c.budget <= 0.0);
        }
    }

    /// Water-filling among the root classes, then level by level among
    /// each class's children and own VMs. See the [module docs](self).
    pub(super) fn compute_entitlements(&mut self) {
        let Policy {
            vms,
            classes,
            tree_order,
            items,
            shares,
            events,
            capacity_pct,
            claimed_pct,
            ..
        } = self;
        // Bottom-up: subtree demand and bounds.
        for c in classes.iter_mut() {
            // fold from +0.0: an empty class's sum() would be -0.0 (shown as "-0.0").
            c.sub_demand = vms[c.start..c.end]
                .iter()
                .fold(0.0, |a, v| a + v.capped_demand());
        }
        for k in (0..tree_order.len()).rev() {
            let ci = tree_order[k];
            let c = &mut classes[ci];
            c.hi = c
                .spec
                .cap
                .map_or(c.sub_demand, |cap| c.sub_demand.min(f64::from(cap)));
            c.lo = c.eff_res.min(c.hi);
            let (hi, parent) = (c.hi, c.parent);
            if let Some(p) = parent {
                classes[p].sub_demand += hi;
            }
        }
        // The roots share the capacity.
        items.clear();
        *claimed_pct = 0.0;
        for c in classes.iter().filter(|c| c.parent.is_none()) {
            *claimed_pct += c.lo;
            items.push(Wf {
                w: f64::from(c.spec.shares),
                lo: c.lo,
                hi: c.hi,
            });
        }
        water_fill(items, *capacity_pct, shares, events);
        for (c, &e) in classes
            .iter_mut()
            .filter(|c| c.parent.is_none())
            .zip(shares.iter())
        {
            c.ent = e;
        }
        // Top-down: each class's amount among its children and own VMs.
        for &ci in tree_order.iter() {
            let c = &classes[ci];
            let range = c.start..c.end;
            if range.is_empty() && c.children.is_empty() {
                continue;
            }
            items.clear();
            for &ch in &c.children {
                let ch = &classes[ch];
                items.push(Wf {
                    w: f64::from(ch.spec.shares),
                    lo: ch.lo,
                    hi: ch.hi,
                });
            }
            items.extend(vms[range.clone()].iter().map(|v| Wf {
                w: f64::from(v.weight),
                lo: 0.0,
                hi: v.capped_demand(),
            }));
            water_fill(items, c.ent, shares, events);
            let nch = c.children.len();
            for (j, &e) in shares[..nch].iter().enumerate() {
                let ch = classes[ci].children[j];
                classes[ch].ent = e;
            }
            for (v, &e) in vms[range].iter_mut().zip(shares[nch..].iter()) {
                v.ent = e;
                v.cap_bound = v.cap.is_some_and(|cap| {
                    let cap = f64::from(cap);
                    v.demand >= cap - 1e-9 && e >= cap - 1e-6
                });
            }
        }
        for c in classes.iter_mut() {
            c.cap_bound = c.spec.cap.is_some_and(|cap| {
                let cap = f64::from(cap);
                c.hi >= cap - 1e-9 && c.ent >= cap - 1e-6
            });
        }
    }
}
