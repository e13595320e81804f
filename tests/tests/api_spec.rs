//! Every operation in `api/openapi.yaml` exists on a running daemon and
//! answers with a documented status and a body of the documented shape; the
//! daemon serves the same spec; /metrics is valid exposition text with the
//! documented metric names.

use std::collections::BTreeSet;

use corral_tests::api::{Daemon, spin_vm};
use corral_tests::workspace_root;
use serde_json::{Value, json};

fn spec() -> Value {
    let text = std::fs::read_to_string(workspace_root().join("api/openapi.yaml")).unwrap();
    let y: serde_yaml::Value = serde_yaml::from_str(&text).expect("openapi.yaml parses");
    serde_json::to_value(y).expect("YAML to JSON")
}

fn resolve<'a>(spec: &'a Value, v: &'a Value) -> &'a Value {
    match v.get("$ref").and_then(Value::as_str) {
        Some(r) => {
            let p = r.strip_prefix("#/").expect("local $ref");
            let mut cur = spec;
            for part in p.split('/') {
                cur = &cur[part];
            }
            assert!(!cur.is_null(), "dangling $ref {r}");
            resolve(spec, cur)
        }
        None => v,
    }
}

/// Checks `v` against an OpenAPI 3.0 schema (the subset the spec uses:
/// type, nullable, required, properties, additionalProperties, items, enum,
/// allOf, minimum, maximum). Returns the errors.
fn validate(spec: &Value, schema: &Value, v: &Value, at: &str, errs: &mut Vec<String>) {
    let s = resolve(spec, schema);
    if v.is_null() {
        if s["nullable"] != json!(true) {
            errs.push(format!("{at}: null but not nullable"));
        }
        return;
    }
    if let Some(all) = s["allOf"].as_array() {
        for sub in all {
            validate(spec, sub, v, at, errs);
        }
    }
    if let Some(en) = s["enum"].as_array()
        && !en.contains(v)
    {
        errs.push(format!("{at}: {v} not in {en:?}"));
    }
    let ty = s["type"].as_str();
    let ok = match ty {
        None => true,
        Some("object") => v.is_object(),
        Some("array") => v.is_array(),
        Some("string") => v.is_string(),
        Some("integer") => v.is_i64() || v.is_u64(),
        Some("number") => v.is_number(),
        Some("boolean") => v.is_boolean(),
        Some(t) => {
            errs.push(format!("{at}: unknown type {t}"));
            true
        }
    };
    if !ok {
        errs.push(format!("{at}: expected {ty:?}, got {v}"));
        return;
    }
    if let Some(min) = s["minimum"].as_f64()
        && v.as_f64().is_some_and(|x| x < min)
    {
        errs.push(format!("{at}: {v} < minimum {min}"));
    }
    if let Some(max) = s["maximum"].as_f64()
        && v.as_f64().is_some_and(|x| x > max)
    {
        errs.push(format!("{at}: {v} > maximum {max}"));
    }
    if let Some(o) = v.as_object() {
        for r in s["required"].as_array().into_iter().flatten() {
            let k = r.as_str().unwrap();
            if !o.contains_key(k) {
                errs.push(format!("{at}: missing required {k}"));
            }
        }
        let props = s["properties"].as_object();
        for (k, val) in o {
            match props.and_then(|p| p.get(k)) {
                Some(ps) => validate(spec, ps, val, &format!("{at}.{k}"), errs),
                None => match &s["additionalProperties"] {
                    Value::Bool(false) => errs.push(format!("{at}: unexpected property {k}")),
                    Value::Object(_) => validate(
                        spec,
                        &s["additionalProperties"],
                        val,
                        &format!("{at}.{k}"),
                        errs,
                    ),
                    _ => {
                        if props.is_some() {
                            errs.push(format!("{at}: undocumented property {k}"));
                        }
                    }
                },
            }
        }
    }
    if let Some(a) = v.as_array() {
        for (i, item) in a.iter().enumerate() {
            validate(spec, &s["items"], item, &format!("{at}[{i}]"), errs);
        }
    }
}

/// One request per operation: (method, spec path, concrete path, body).
fn cases() -> Vec<(&'static str, &'static str, String, Option<String>)> {
    let vm = "/v1/vms/specvm";
    vec![
        ("get", "/v1/status", "/v1/status".into(), None),
        ("get", "/v1/openapi.yaml", "/v1/openapi.yaml".into(), None),
        ("get", "/metrics", "/metrics".into(), None),
        ("get", "/ui", "/ui".into(), None),
        ("get", "/v1/classes", "/v1/classes".into(), None),
        (
            "post",
            "/v1/classes",
            "/v1/classes".into(),
            Some(r#"{"name":"specc","shares":200,"io":{"iops":100,"burst_ops":10}}"#.into()),
        ),
        (
            "get",
            "/v1/classes/{name}",
            "/v1/classes/specc".into(),
            None,
        ),
        (
            "put",
            "/v1/classes/{name}",
            "/v1/classes/specc".into(),
            Some(r#"{"shares":300,"cap":150}"#.into()),
        ),
        (
            "patch",
            "/v1/classes/{name}",
            "/v1/classes/specc".into(),
            Some(r#"{"reservation":50}"#.into()),
        ),
        (
            "post",
            "/v1/vms",
            "/v1/vms".into(),
            Some(spin_vm("specvm", "specc", 1, 16, 30)),
        ),
        ("get", "/v1/vms", "/v1/vms".into(), None),
        ("get", "/v1/vms/{name}", vm.into(), None),
        (
            "patch",
            "/v1/vms/{name}",
            vm.into(),
            Some(r#"{"cap":50}"#.into()),
        ),
        ("post", "/v1/vms/{name}/pause", format!("{vm}/pause"), None),
        (
            "post",
            "/v1/vms/{name}/resume",
            format!("{vm}/resume"),
            None,
        ),
        (
            "post",
            "/v1/vms/{name}/move",
            format!("{vm}/move"),
            Some(r#"{"class":"default"}"#.into()),
        ),
        (
            "patch",
            "/v1/vms/{name}/disks/{disk}",
            format!("{vm}/disks/disk0"),
            Some(r#"{"bps":1048576}"#.into()),
        ),
        (
            "get",
            "/v1/vms/{name}/console",
            format!("{vm}/console?tail=5"),
            None,
        ),
        (
            "post",
            "/v1/vms/{name}/console",
            format!("{vm}/console"),
            Some(r#"{"data":"x"}"#.into()),
        ),
        (
            "post",
            "/v1/vms/{name}/reboot",
            format!("{vm}/reboot"),
            None,
        ),
        (
            "post",
            "/v1/vms/{name}/shutdown",
            format!("{vm}/shutdown"),
            Some(r#"{"timeout_seconds":0}"#.into()),
        ),
        ("post", "/v1/vms/{name}/stop", format!("{vm}/stop"), None),
        ("post", "/v1/vms/{name}/start", format!("{vm}/start"), None),
        ("delete", "/v1/vms/{name}", vm.into(), None),
        (
            "delete",
            "/v1/classes/{name}",
            "/v1/classes/specc".into(),
            None,
        ),
    ]
}

#[test]
fn every_operation_exists_and_answers_as_documented() {
    let spec = spec();
    let paths = spec["paths"].as_object().expect("paths");
    // The test covers exactly the spec's operations.
    let in_spec: BTreeSet<(String, String)> = paths
        .iter()
        .flat_map(|(p, item)| {
            item.as_object()
                .unwrap()
                .keys()
                .filter(|m| ["get", "post", "put", "patch", "delete"].contains(&m.as_str()))
                .map(move |m| (m.clone(), p.clone()))
        })
        .collect();
    let tested: BTreeSet<(String, String)> = cases()
        .iter()
        .map(|(m, p, _, _)| (m.to_string(), p.to_string()))
        .collect();
    assert_eq!(in_spec, tested, "spec operations vs tested operations");

    let d = Daemon::start(&[]);
    let mut errs = Vec::new();
    for (method, spec_path, path, body) in cases() {
        let op = &paths[spec_path][method];
        let r = d.req(&method.to_uppercase(), &path, body.as_deref());
        let what = format!("{} {path} -> {}", method.to_uppercase(), r.status);
        let Some(resp) = op["responses"].get(r.status.to_string()) else {
            errs.push(format!("{what}: status not documented; body {}", r.text()));
            continue;
        };
        let resp = resolve(&spec, resp);
        let Some(content) = resp["content"].as_object() else {
            if !r.body.is_empty() {
                errs.push(format!("{what}: body where none is documented"));
            }
            continue;
        };
        // The documented media type the response has (some operations
        // document several, chosen by `Accept`).
        let got = r.header("content-type").unwrap_or("");
        let Some((ctype, media)) = content.iter().find(|(c, _)| got.starts_with(c.as_str())) else {
            let documented: Vec<&String> = content.keys().collect();
            errs.push(format!(
                "{what}: content-type {got:?}, documented {documented:?}"
            ));
            continue;
        };
        if ctype == "application/json" {
            let v = r.json();
            validate(&spec, &media["schema"], &v, &what, &mut errs);
        }
        eprintln!("ok: {what}");
    }
    assert!(errs.is_empty(), "{}", errs.join("\n"));
}

#[test]
fn served_spec_is_the_file() {
    let d = Daemon::start(&[]);
    let r = d.req("GET", "/v1/openapi.yaml", None);
    assert_eq!(r.status, 200);
    let file = std::fs::read_to_string(workspace_root().join("api/openapi.yaml")).unwrap();
    assert_eq!(r.text(), file);
}

#[test]
fn metrics_are_valid_exposition() {
    let d = Daemon::start(&[]);
    let r = d.req(
        "POST",
        "/v1/vms",
        Some(&spin_vm("m1", "default", 2, 16, 30)),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    std::thread::sleep(std::time::Duration::from_millis(300));
    let r = d.req("GET", "/metrics", None);
    assert_eq!(r.status, 200);
    let t = r.text();
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("text/plain; version=0.0.4")),
        "text format by default"
    );
    let mut families = BTreeSet::new();
    for line in t.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            let name = it.next().unwrap();
            let ty = it.next().unwrap();
            assert!(
                name.starts_with("corral_") || name.starts_with("process_"),
                "{line}"
            );
            assert!(["counter", "gauge", "histogram"].contains(&ty), "{line}");
            // Text 0.0.4 names a counter by its sample (`x_total`).
            let fam = match ty {
                "counter" => name.strip_suffix("_total").expect("counter _total"),
                _ => name,
            };
            families.insert(fam.to_string());
        } else if !line.starts_with('#') && !line.is_empty() {
            let (name_labels, value) = line.rsplit_once(' ').unwrap();
            value
                .parse::<f64>()
                .unwrap_or_else(|_| panic!("bad value: {line}"));
            assert!(
                name_labels.starts_with("corral_") || name_labels.starts_with("process_"),
                "{line}"
            );
        }
    }
    for f in [
        "corral_vm_cpu_seconds",
        "corral_vm_exits",
        "corral_vm_up",
        "corral_class_cpu_seconds",
        "corral_class_shares",
        "corral_cpu_capacity_ratio",
        "corral_build_info",
    ] {
        assert!(families.contains(f), "missing family {f} in\n{t}");
    }
    let cpu_line = t
        .lines()
        .find(|l| l.starts_with("corral_vm_cpu_seconds_total{") && l.contains("vm=\"m1\""))
        .expect("cpu line for m1");
    assert!(cpu_line.contains("class=\"default\""), "{cpu_line}");
    let v: f64 = cpu_line.rsplit_once(' ').unwrap().1.parse().unwrap();
    assert!(v > 0.0, "{cpu_line}");
    assert!(
        t.lines()
            .any(|l| l.starts_with("corral_vm_exits_total{") && l.contains("reason=\"io_out\"")),
        "{t}"
    );
    // Every metric named in the spec's /metrics description exists.
    let spec = spec();
    let desc = spec["paths"]["/metrics"]["get"]["description"]
        .as_str()
        .unwrap();
    for word in desc.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if word.starts_with("corral_")
            && !word.contains("entitlement")
            && !word.contains("used")
            && !word.contains("park")
        {
            let fam = word.trim_end_matches("_total");
            let fam = if word.ends_with("_total") {
                fam.to_string()
            } else {
                word.to_string()
            };
            assert!(
                families.contains(&fam),
                "{word} documented but not exported"
            );
        }
    }
}

/// The spec's figures and shapes are the code's: a VM's `disks` allow
/// `MAX_DISKS` items (one IRQ each), and `Limits` has exactly the keys of
/// the one limits type.
#[test]
fn spec_limits_are_the_codes() {
    let spec = spec();
    let schemas = &spec["components"]["schemas"];
    assert_eq!(
        schemas["VmCreate"]["properties"]["disks"]["maxItems"],
        json!(corral_vmm::vm::MAX_DISKS),
        "maxItems of VmCreate.disks"
    );
    assert_eq!(corral_vmm::manager::MAX_DISKS, corral_vmm::vm::MAX_DISKS);
    assert_eq!(corral_vmm::vm::MAX_DISKS, corral_vmm::vm::VIRTIO_IRQS.len());
    let all = corral_vmm::manager::Limits::parse(
        "bps=1,rbps=1,wbps=1,iops=1,riops=1,wiops=1,burst_bytes=1,burst_ops=1,\
         onetime_bytes=1,onetime_ops=1",
    )
    .unwrap();
    let keys: BTreeSet<String> = serde_json::to_value(all)
        .unwrap()
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let documented: BTreeSet<String> = schemas["Limits"]["properties"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    assert_eq!(keys, documented);
}
