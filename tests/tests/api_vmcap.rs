//! Per-VM CPU caps through the REST API and the CLI (issue 13): set at
//! create, shown by GET, changed and removed live with PATCH, refused when
//! invalid; the scheduler enforces the VM's cap (its entitlement never
//! exceeds it).

use std::time::Duration;

use corral_tests::api::{Daemon, spin_vm, wait_until};
use corral_tests::{run_corral, text};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(30);

fn entitlement(d: &Daemon, vm: &str) -> Option<f64> {
    d.req("GET", &format!("/v1/vms/{vm}"), None).json()["sched"]["entitlement_pct"].as_f64()
}

#[test]
fn vm_cap_over_rest() {
    let d = Daemon::start(&[]);
    let mut body: Value = serde_json::from_str(&spin_vm("capped", "default", 2, 16, 30)).unwrap();
    body["cap"] = json!(40);
    let r = d.req("POST", "/v1/vms", Some(&body.to_string()));
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["cap"], 40);
    assert_eq!(d.req("GET", "/v1/vms/capped", None).json()["cap"], 40);
    // Two spinning vCPUs on an otherwise idle daemon: entitled to the cap.
    let e = wait_until(Duration::from_secs(10), || {
        entitlement(&d, "capped").filter(|e| *e > 0.0)
    })
    .expect("an entitlement");
    assert!(e <= 40.0 + 1e-6, "entitled to {e} % with a 40 % cap");

    // Live change, then removal; absent fields are kept.
    let r = d.req("PATCH", "/v1/vms/capped", Some(r#"{"cap":25}"#));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["cap"], 25);
    let e = wait_until(Duration::from_secs(10), || {
        entitlement(&d, "capped").filter(|e| *e <= 25.0 + 1e-6)
    });
    assert!(e.is_some(), "entitlement did not follow the new cap");
    assert_eq!(
        d.req("PATCH", "/v1/vms/capped", Some("{}")).json()["cap"],
        25
    );
    let r = d.req("PATCH", "/v1/vms/capped", Some(r#"{"cap":null}"#));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.json()["cap"].is_null());

    // Invalid values and unknown VMs.
    d.req("PATCH", "/v1/vms/capped", Some(r#"{"cap":0}"#))
        .assert_error(400, "bad_request");
    d.req("PATCH", "/v1/vms/capped", Some(r#"{"cap":-1}"#))
        .assert_error(400, "bad_request");
    d.req("PATCH", "/v1/vms/capped", Some(r#"{"weight":0}"#))
        .assert_error(400, "bad_request");
    d.req("PATCH", "/v1/vms/capped", Some(r#"{"class":"default"}"#))
        .assert_error(400, "bad_request");
    d.req("PATCH", "/v1/vms/nosuch", Some(r#"{"cap":10}"#))
        .assert_error(404, "not_found");
    body["name"] = json!("zero");
    body["cap"] = json!(0);
    d.req("POST", "/v1/vms", Some(&body.to_string()))
        .assert_error(400, "bad_request");
    assert_eq!(d.req("GET", "/v1/vms/zero", None).status, 404);
}

#[test]
fn vm_cap_from_the_cli() {
    let d = Daemon::start(&[]);
    let sock = d.socket.to_str().unwrap().to_string();
    let cli = |args: &[&str]| {
        let mut a = vec!["--socket", sock.as_str()];
        a.extend_from_slice(args);
        let o = run_corral(&a, T);
        let (out, err) = text(&o);
        (o.status.code(), out, err)
    };
    let (code, out, err) = cli(&[
        "vm",
        "create",
        "c1",
        "--cap",
        "30",
        "--memory",
        "16",
        "--cmdline",
        "probe.mode=spin probe.secs=30",
    ]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(d.req("GET", "/v1/vms/c1", None).json()["cap"], 30);
    let (code, out, err) = cli(&["vm", "set", "c1", "--cap", "60%"]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("60"), "{out}");
    assert_eq!(d.req("GET", "/v1/vms/c1", None).json()["cap"], 60);
    let (code, out, err) = cli(&["vm", "set", "c1", "--cap", "none"]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(d.req("GET", "/v1/vms/c1", None).json()["cap"].is_null());
    let (code, _, err) = cli(&["vm", "set", "c1", "--cap", "lots"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("--cap"), "{err}");
    // The weight in its class too (CPU and I/O), live; the cap is kept.
    let (code, out, err) = cli(&["vm", "set", "c1", "--weight", "250", "--cap", "40"]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("weight 250"), "{out}");
    let v = d.req("GET", "/v1/vms/c1", None).json();
    assert_eq!(
        (v["weight"].clone(), v["cap"].clone()),
        (250.into(), 40.into())
    );
    let (code, _, _) = cli(&["vm", "set", "c1", "--weight", "0"]);
    assert_ne!(code, Some(0));
    assert_eq!(d.req("GET", "/v1/vms/c1", None).json()["weight"], 250);
}
