//! `corral top`'s class tree: order, indentation, subtree sums and the
//! part each class's shares promise at every level.

use super::*;

fn class(name: &str, parent: Option<&str>, shares: u32) -> dto::Class {
    dto::Class {
        name: name.into(),
        parent: parent.map(str::to_string),
        children: Vec::new(),
        shares,
        cap: None,
        reservation: None,
        io: dto::Limits::default(),
        vms: Vec::new(),
        cpu_seconds: 0.0,
        entitlement_pct: None,
        used_pct: None,
    }
}

fn vm(name: &str, class: &str, cpu_pct: f64, state: &str) -> TopVm {
    TopVm {
        name: name.into(),
        class: class.into(),
        state: state.into(),
        vcpus: 1,
        cpu_pct,
        share_pct: 0.0,
        entitlement_pct: None,
        parked: None,
        cpu_seconds: 0.0,
        read_bytes_per_second: 0.0,
        write_bytes_per_second: 0.0,
        throttled_ms_per_second: 0.0,
    }
}

/// Two tenants 1:1, one tenant's children 3:1 (issue 13's two-level tree),
/// listed children first to show the order is the tree's, not the API's.
#[test]
fn two_level_tree() {
    let classes = [
        class("gold", Some("tenant-a"), 3),
        class("tenant-a", None, 1),
        class("bronze", Some("tenant-a"), 1),
        class("tenant-b", None, 1),
        class("idle", Some("tenant-b"), 5),
        class("default", None, 100),
    ];
    let vms = [
        vm("g", "gold", 75.0, "running"),
        vm("b", "bronze", 25.0, "running"),
        vm("t", "tenant-b", 100.0, "running"),
        vm("off", "idle", 0.0, "stopped"),
    ];
    let rows = class_rows(&classes, &vms, |x| x / 2.0);
    let got: Vec<(&str, usize, usize, f64, f64)> = rows
        .iter()
        .map(|r| {
            (
                r.name.as_str(),
                r.depth,
                r.vms,
                r.cpu_pct,
                (r.expected_pct * 10.0).round() / 10.0,
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("tenant-a", 0, 2, 100.0, 50.0),
            ("gold", 1, 1, 75.0, 37.5),
            ("bronze", 1, 1, 25.0, 12.5),
            ("tenant-b", 0, 2, 100.0, 50.0),
            ("idle", 1, 1, 0.0, 0.0),
            ("default", 0, 0, 0.0, 0.0),
        ]
    );
    assert_eq!(rows[1].parent.as_deref(), Some("tenant-a"));
    assert_eq!(rows[0].parent, None);
    assert_eq!(rows[1].share_pct, 37.5); // part() of the subtree's CPU
}

/// A class whose parent is not listed (the demo shows a subset) is a root;
/// a corrupt self-parent does not loop.
#[test]
fn unknown_parent_is_a_root() {
    let classes = [
        class("gold", Some("hidden"), 3),
        class("bronze", Some("hidden"), 1),
        class("loop", Some("loop"), 1),
    ];
    let vms = [
        vm("g", "gold", 10.0, "running"),
        vm("b", "bronze", 10.0, "running"),
    ];
    let rows = class_rows(&classes, &vms, |x| x);
    let names: Vec<(&str, usize, f64)> = rows
        .iter()
        .map(|r| (r.name.as_str(), r.depth, r.expected_pct))
        .collect();
    assert_eq!(names, [("gold", 0, 75.0), ("bronze", 0, 25.0)]);
}

#[test]
fn printed_tree_is_indented() {
    let classes = [
        class("tenant-a", None, 1),
        class("gold", Some("tenant-a"), 3),
        class("deep", Some("gold"), 1),
    ];
    let rows = class_rows(&classes, &[], |x| x);
    let cells: Vec<String> = rows.iter().map(class_cell).collect();
    assert_eq!(cells, ["tenant-a", "  gold", "    deep"]);
}
