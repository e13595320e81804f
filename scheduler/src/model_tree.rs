//! Reservations in a class tree.
//!
//! A class's *effective* reservation is its own reservation, or the sum of
//! its children's effective reservations if that is more: a parent must be
//! able to give each child what it reserves. The host-wide reserved total
//! is the sum over the root classes, checked against capacity; a capped
//! class's effective reservation may not exceed its cap (its children could
//! not get it). Admission control checks this down the whole tree on every
//! class change.

use std::collections::BTreeMap;

use super::{ClassEntry, ModelError};

/// Effective reservation of `name` (percent), `None` if unknown. O(1): each
/// class keeps its children's effective total.
pub(super) fn effective(classes: &BTreeMap<String, ClassEntry>, name: &str) -> Option<u64> {
    classes.get(name).map(eff)
}

fn eff(c: &ClassEntry) -> u64 {
    c.spec.reserved_percent().max(c.child_res)
}

/// What a change of one class's reservation does to the tree.
pub(super) struct Change {
    /// The host-wide reserved total after it.
    pub total: u64,
    /// New children's totals of its ancestors, nearest first.
    pub ancestors: Vec<(String, u64)>,
}

/// Checks giving `name` (under `parent`) its own reservation `own` and cap
/// `cap`, with `child_res` reserved by its children; walks up to the root
/// (at most the depth limit): every capped ancestor must still hold its
/// children's reservations, and the roots' total is `reserved` adjusted.
pub(super) fn admit(
    classes: &BTreeMap<String, ClassEntry>,
    reserved: u64,
    name: &str,
    own: u64,
    cap: Option<u32>,
    parent: Option<&str>,
) -> Result<Change, ModelError> {
    let existing = classes.get(name);
    let child_res = existing.map_or(0, |c| c.child_res);
    let mut old = existing.map_or(0, eff);
    let mut new = own.max(child_res);
    if let Some(cap) = cap
        && new > u64::from(cap)
    {
        return Err(above_cap(new, cap));
    }
    let mut ancestors = Vec::new();
    let mut cur = parent;
    while let Some(p) = cur {
        let Some(a) = classes.get(p) else {
            return Err(ModelError::UnknownParent(p.to_owned()));
        };
        let a_child = (a.child_res + new).saturating_sub(old);
        let (a_old, a_new) = (eff(a), a.spec.reserved_percent().max(a_child));
        if let Some(cap) = a.spec.cap
            && a_new > u64::from(cap)
        {
            return Err(above_cap(a_new, cap));
        }
        ancestors.push((p.to_owned(), a_child));
        (old, new) = (a_old, a_new);
        cur = a.parent.as_deref();
    }
    Ok(Change {
        total: (reserved + new).saturating_sub(old),
        ancestors,
    })
}

fn above_cap(reservation: u64, cap: u32) -> ModelError {
    ModelError::ReservationAboveCap {
        reservation: u32::try_from(reservation).unwrap_or(u32::MAX),
        cap,
    }
}

/// Applies the ancestors' new children's totals of a [`Change`].
pub(super) fn apply(classes: &mut BTreeMap<String, ClassEntry>, change: &Change) {
    for (name, child_res) in &change.ancestors {
        if let Some(a) = classes.get_mut(name) {
            a.child_res = *child_res;
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::model::{Capacity, ClassSpec, ErrorKind, MAX_DEPTH, Model, ModelError};

    #[test]
    fn reservations_add_up_down_the_tree() {
        let mut m = Model::new(Capacity::from_cpus(2));
        m.create_class("tenant-a", ClassSpec::new(100)).unwrap();
        m.create_class_in(
            "a-web",
            ClassSpec::new(300).with_reservation(60),
            Some("tenant-a"),
        )
        .unwrap();
        m.create_class_in(
            "a-batch",
            ClassSpec::new(100).with_reservation(40),
            Some("tenant-a"),
        )
        .unwrap();
        assert_eq!(m.reserved_percent(), 100);
        assert_eq!(m.class_reserved_percent("tenant-a"), Some(100));
        // The parent's own reservation covers its children's.
        m.update_class("tenant-a", ClassSpec::new(100).with_reservation(150))
            .unwrap();
        assert_eq!(m.reserved_percent(), 150);
        let e = m
            .create_class("b", ClassSpec::new(1).with_reservation(60))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Refused, "{e}");
        // A cap below what the children reserve is refused.
        let e = m
            .update_class("tenant-a", ClassSpec::new(100).with_cap(90))
            .unwrap_err();
        assert!(
            matches!(
                e,
                ModelError::ReservationAboveCap {
                    reservation: 100,
                    cap: 90
                }
            ),
            "{e}"
        );
        // Children and VMs keep a class alive; deleting leaves first works.
        assert!(matches!(
            m.delete_class("tenant-a"),
            Err(ModelError::ClassHasChildren { children: 2, .. })
        ));
        m.delete_class("a-web").unwrap();
        m.update_class("tenant-a", ClassSpec::new(100)).unwrap();
        assert_eq!(m.reserved_percent(), 40);
        assert_eq!(m.class_path("a-batch"), vec!["tenant-a", "a-batch"]);
        assert_eq!(m.class_parent("a-batch"), Some("tenant-a"));
        assert_eq!(
            m.class_children("tenant-a").collect::<Vec<_>>(),
            vec!["a-batch"]
        );
    }

    #[test]
    fn parents_exist_depth_is_bounded_and_classes_do_not_move() {
        let mut m = Model::new(Capacity::from_cpus(2));
        assert_eq!(
            m.create_class_in("x", ClassSpec::new(1), Some("nope")),
            Err(ModelError::UnknownParent("nope".into()))
        );
        let mut parent: Option<String> = None;
        for d in 1..=MAX_DEPTH {
            let name = format!("l{d}");
            m.create_class_in(&name, ClassSpec::new(1), parent.as_deref())
                .unwrap();
            assert_eq!(m.class_depth(&name), Some(d));
            parent = Some(name);
        }
        let e = m
            .create_class_in("deep", ClassSpec::new(1), parent.as_deref())
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
        assert!(matches!(
            m.set_class_in("l3", ClassSpec::new(5), Some("l1")),
            Err(ModelError::ParentChange(_))
        ));
        // Same parent, or none named: an update that keeps it.
        assert_eq!(
            m.set_class_in("l3", ClassSpec::new(5), Some("l2")),
            Ok(false)
        );
        assert_eq!(m.set_class_in("l3", ClassSpec::new(6), None), Ok(false));
        assert_eq!(m.class_parent("l3"), Some("l2"));
    }
}
