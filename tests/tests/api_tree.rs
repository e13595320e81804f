//! Hierarchical classes through the REST API and the CLI (issue 13): a
//! class may have a parent, GET and `corral class tree` show the tree, the
//! metrics carry a `parent` label, admission control checks reservations
//! down the tree, and the depth limit, unknown parents, moves in the tree
//! and deleting a parent with children are refused with the right status.

use std::time::Duration;

use corral_tests::api::Daemon;
use corral_tests::{run_corral, text};
use serde_json::json;

const T: Duration = Duration::from_secs(30);

fn post_class(d: &Daemon, body: serde_json::Value) -> corral_tests::api::Resp {
    d.req("POST", "/v1/classes", Some(&body.to_string()))
}

#[test]
fn class_tree_over_rest() {
    let d = Daemon::start(&[]);
    assert_eq!(post_class(&d, json!({"name": "tenant-a"})).status, 201);
    assert_eq!(post_class(&d, json!({"name": "tenant-b"})).status, 201);
    let r = post_class(
        &d,
        json!({"name": "a-gold", "parent": "tenant-a", "shares": 300}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["parent"], "tenant-a");
    let r = d.req(
        "PUT",
        "/v1/classes/a-bronze",
        Some(r#"{"parent":"tenant-a","shares":100,"reservation":50}"#),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let a = d.req("GET", "/v1/classes/tenant-a", None).json();
    assert!(a["parent"].is_null());
    assert_eq!(a["children"], json!(["a-bronze", "a-gold"]));
    // Reservations add up down the tree: tenant-a's children reserve 50,
    // so a cap of 40 on tenant-a is refused, and so is a sibling tree that
    // would reserve past the capacity.
    d.req("PATCH", "/v1/classes/tenant-a", Some(r#"{"cap":40}"#))
        .assert_error(400, "bad_request");
    let cap = d.req("GET", "/v1/status", None).json()["capacity_pct"]
        .as_u64()
        .unwrap();
    post_class(
        &d,
        json!({"name": "b-big", "parent": "tenant-b", "reservation": cap - 49}),
    )
    .assert_error(422, "refused");
    // Refusals.
    post_class(&d, json!({"name": "orphan", "parent": "nosuch"})).assert_error(404, "not_found");
    d.req(
        "PUT",
        "/v1/classes/a-gold",
        Some(r#"{"parent":"tenant-b"}"#),
    )
    .assert_error(409, "conflict");
    d.req("DELETE", "/v1/classes/tenant-a", None)
        .assert_error(409, "conflict");
    let mut parent = "tenant-b".to_string();
    for depth in 2..=8 {
        let name = format!("b{depth}");
        let r = post_class(&d, json!({"name": name, "parent": parent}));
        assert_eq!(r.status, 201, "depth {depth}: {}", r.text());
        parent = name;
    }
    post_class(&d, json!({"name": "b9", "parent": parent})).assert_error(400, "bad_request");
    // Metrics: one info series per class with its parent.
    let m = d.req("GET", "/metrics", None).text();
    assert!(
        m.lines().any(|l| l.starts_with("corral_class_info{")
            && l.contains(r#"class="a-gold""#)
            && l.contains(r#"parent="tenant-a""#)),
        "{m}"
    );
    // Leaves first, then the parent.
    for c in ["a-gold", "a-bronze", "tenant-a"] {
        assert_eq!(
            d.req("DELETE", &format!("/v1/classes/{c}"), None).status,
            204
        );
    }
}

#[test]
fn class_tree_from_the_cli() {
    let d = Daemon::start(&[]);
    let sock = d.socket.to_str().unwrap().to_string();
    let cli = |args: &[&str]| {
        let mut a = vec!["--socket", sock.as_str()];
        a.extend_from_slice(args);
        let o = run_corral(&a, T);
        let (out, err) = text(&o);
        (o.status.code(), out, err)
    };
    for args in [
        &["class", "set", "tenant-a"][..],
        &[
            "class", "set", "a-web", "--parent", "tenant-a", "--shares", "300",
        ],
        &[
            "class", "set", "a-batch", "--parent", "tenant-a", "--cap", "50",
        ],
    ] {
        let (code, out, err) = cli(args);
        assert_eq!(code, Some(0), "{args:?}: {out}{err}");
    }
    let (code, out, err) = cli(&["class", "tree"]);
    assert_eq!(code, Some(0), "{err}");
    let line = |name: &str| {
        out.lines()
            .find(|l| l.trim_start().starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name} in:\n{out}"))
            .to_string()
    };
    let indent = |l: &str| l.len() - l.trim_start().len();
    assert_eq!(indent(&line("tenant-a")), 0, "{out}");
    assert_eq!(indent(&line("a-web")), 2, "{out}");
    assert!(line("a-web").contains("shares 300"), "{out}");
    assert!(line("a-batch").contains("cap 50%"), "{out}");
    assert_eq!(indent(&line("default")), 0, "{out}");
    let (code, _, err) = cli(&["class", "set", "a-web", "--parent", "default"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("cannot move"), "{err}");
}
