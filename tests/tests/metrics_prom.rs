//! `/metrics` checked by the real tools: `promtool check metrics` and the
//! Python client's parsers on a live scrape, and a real Prometheus server
//! (Debian's `prometheus` package) that scrapes the daemon and answers a
//! query for a corral series. Each test says why and skips when its tool
//! is missing (`scripts/test` installs them).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use corral_tests::api::{Daemon, Resp, spin_vm, wait_until};
use serde_json::json;

const PROMTOOL: &str = "/usr/bin/promtool";
const PROMETHEUS: &str = "/usr/bin/prometheus";
const PYTHON: &str = "/usr/bin/python3";

fn temp_dir(what: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("corral-{what}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn scrape(d: &Daemon, accept: Option<&str>) -> Resp {
    let mut c = d.conn();
    let headers: Vec<(&str, &str)> = accept.map(|a| ("Accept", a)).into_iter().collect();
    c.send_with("GET", "/metrics", &headers, None);
    let r = c.read_response(None);
    assert_eq!(r.status, 200, "{}", r.text());
    r
}

/// A daemon with what every family needs: a class with CPU cap and I/O
/// limits (its throttle group), a VM in it reading a disk that has its own
/// limits, and a spinning VM in `default`; returns once the disk has
/// served requests (so the latency histograms exist).
fn busy_daemon(dir: &Path, extra: &[&str]) -> Daemon {
    let d = Daemon::start(extra);
    let img = dir.join("data.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(16 << 20))
        .expect("disk image");
    let r = d.req(
        "POST",
        "/v1/classes",
        Some(r#"{"name":"gold","shares":300,"cap":150,"reservation":10,"io":{"iops":2000,"bps":50000000,"burst_ops":50}}"#),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let body = json!({
        "name": "io1", "class": "gold", "memory_mib": 32,
        "cmdline": "probe.mode=blk probe.op=read probe.size=4M probe.bs=4K probe.qd=4",
        "disks": [{"id": "data", "path": img.to_str().unwrap(),
                   "limits": {"iops": 1500, "rbps": 20000000, "burst_bytes": 1048576}}]
    });
    let r = d.req("POST", "/v1/vms", Some(&body.to_string()));
    assert_eq!(r.status, 201, "{}", r.text());
    let r = d.req(
        "POST",
        "/v1/vms",
        Some(&spin_vm("spin1", "default", 1, 16, 30)),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    // A 404 and a 400, so the API request families have error codes too.
    d.req("GET", "/v1/vms/nope", None);
    d.req("POST", "/v1/vms", Some("{"));
    wait_until(Duration::from_secs(30), || {
        let t = scrape(&d, None).text();
        t.lines()
            .any(|l| {
                l.starts_with("corral_disk_request_duration_seconds_count{")
                    && l.contains(r#"vm="io1""#)
                    && !l.ends_with(" 0")
            })
            .then_some(())
    })
    .expect("the disk served requests");
    d
}

/// Runs `cmd` with `input` on stdin; (success, stdout + stderr).
fn pipe(cmd: &mut Command, input: &[u8]) -> (bool, String) {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input)
        .expect("write stdin");
    let out = child.wait_with_output().expect("wait");
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text += &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// The series of a scrape (sample lines without their values), in order.
fn series(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.rsplit_once(' ').map(|(s, _)| s))
        .collect()
}

fn check_common(text: &str, what: &str) {
    assert!(!text.contains(r#"le="inf""#), "{what}: le=\"inf\"\n{text}");
    assert!(text.contains(r#"le="+Inf""#), "{what}: no +Inf bucket");
    assert!(!text.contains("_percent"), "{what}: a _percent family");
    assert!(
        !text.contains("corral_disk_limit{"),
        "{what}: mixed-unit family"
    );
    let mut help = std::collections::BTreeSet::new();
    let mut typed = std::collections::BTreeSet::new();
    for line in text.lines() {
        if let Some(r) = line.strip_prefix("# HELP ") {
            help.insert(r.split(' ').next().unwrap_or("").to_string());
        } else if let Some(r) = line.strip_prefix("# TYPE ") {
            typed.insert(r.split(' ').next().unwrap_or("").to_string());
        } else if !line.starts_with('#') && !line.is_empty() {
            let (_, v) = line.rsplit_once(' ').expect("sample line");
            let v: f64 = v
                .parse()
                .unwrap_or_else(|_| panic!("{what}: bad value {line}"));
            assert!(v.is_finite(), "{what}: {line}");
            assert!(v == 0.0 || v.abs() >= 1e-9, "{what}: residue {line}");
            assert!(!v.is_sign_negative(), "{what}: negative {line}");
        }
    }
    assert_eq!(help, typed, "{what}: HELP and TYPE for every family");
    for f in [
        "corral_build_info",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
        "corral_disk_limit_bytes_per_second",
        "corral_disk_limit_ops_per_second",
        "corral_class_cpu_cap_ratio",
        "corral_group_request_duration_seconds",
        "corral_api_request_duration_seconds",
    ] {
        assert!(typed.contains(f), "{what}: no family {f}");
    }
    for s in [
        r#"corral_disk_limit_ops_per_second{vm="io1",disk="data",op="all"} 1500"#,
        r#"corral_disk_limit_bytes_per_second{vm="io1",disk="data",op="read"} 20000000"#,
        r#"corral_class_io_limit_ops_per_second{class="gold",op="all"} 2000"#,
        r#"corral_class_cpu_cap_ratio{class="gold"} 1.5"#,
        r#"corral_disk_malformed_requests_total{vm="io1",disk="data"} 0"#,
        r#"corral_disk_broken_rings_total{vm="io1",disk="data"} 0"#,
        r#"corral_disk_device_requests_total{vm="io1",disk="data",op="read"} "#,
        r#"corral_api_requests_total{route="/v1/vms/{name}",method="GET",code="404"} "#,
        r#"corral_api_requests_total{route="/v1/vms",method="POST",code="400"} 1"#,
    ] {
        assert!(text.contains(s), "{what}: no {s}\n{text}");
    }
}

#[test]
fn promtool_and_the_python_parsers_accept_a_live_scrape() {
    let dir = temp_dir("promtool");
    let d = busy_daemon(&dir, &[]);

    // Text 0.0.4 by default.
    let a = scrape(&d, None);
    assert_eq!(
        a.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    let text = a.text();
    assert!(!text.contains("# EOF"));
    check_common(&text, "text 0.0.4");
    // Series order is the same on every scrape.
    let b = scrape(&d, None).text();
    assert_eq!(series(&text), series(&b), "series order changed");

    // OpenMetrics on request, with the Accept header Prometheus sends.
    let om = scrape(
        &d,
        Some(
            "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
             version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
        ),
    );
    assert_eq!(
        om.header("content-type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    let om = om.text();
    assert!(om.ends_with("# EOF\n"), "OpenMetrics terminator");
    check_common(&om, "OpenMetrics");
    assert_eq!(series(&om), series(&scrape_om(&d)), "series order changed");

    if Path::new(PROMTOOL).exists() {
        // promtool 2.42 lints the text format only (it reads OpenMetrics'
        // counter families as untyped); the Prometheus server test below
        // parses OpenMetrics.
        let (ok, out) = pipe(
            Command::new(PROMTOOL).args(["check", "metrics"]),
            text.as_bytes(),
        );
        assert!(
            ok && out.trim().is_empty(),
            "promtool check metrics:\n{out}"
        );
    } else {
        eprintln!("SKIP promtool check: {PROMTOOL} missing (apt-get install prometheus)");
    }

    let py = "import sys\n\
              from prometheus_client.openmetrics.parser import text_string_to_metric_families as om\n\
              from prometheus_client.parser import text_string_to_metric_families as txt\n\
              data = sys.stdin.read().split('\\0')\n\
              a = sum(len(f.samples) for f in txt(data[0]))\n\
              b = sum(len(f.samples) for f in om(data[1]))\n\
              print(a, b)\n";
    let has_client = Command::new(PYTHON)
        .args(["-c", "import prometheus_client"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if has_client {
        let input = format!("{text}\0{om}");
        let (ok, out) = pipe(Command::new(PYTHON).args(["-c", py]), input.as_bytes());
        assert!(ok, "python prometheus_client parsers:\n{out}");
        let counts: Vec<usize> = out
            .split_whitespace()
            .filter_map(|n| n.parse().ok())
            .collect();
        assert!(counts.len() == 2 && counts.iter().all(|n| *n > 50), "{out}");
    } else {
        eprintln!(
            "SKIP python parser check: {PYTHON} has no prometheus_client \
             (apt-get install python3-prometheus-client)"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn scrape_om(d: &Daemon) -> String {
    scrape(d, Some("application/openmetrics-text")).text()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// GET over TCP (HTTP/1.0, so the body ends at EOF); (status, body).
fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let (head, body) = buf.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_string()))
}

/// Percent-encodes a PromQL query for a URL.
fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus server; killed when dropped.
struct Prometheus(Child);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn query(port: u16, q: &str) -> Option<Vec<serde_json::Value>> {
    let (status, body) = http_get(port, &format!("/api/v1/query?query={}", urlencode(q)))?;
    if status != 200 {
        return None;
    }
    let j: serde_json::Value = serde_json::from_str(&body).ok()?;
    j["data"]["result"].as_array().cloned()
}

#[test]
fn a_real_prometheus_scrapes_the_daemon_and_answers_a_query() {
    if !Path::new(PROMETHEUS).exists() {
        eprintln!("SKIP: {PROMETHEUS} missing (apt-get install prometheus; scripts/test does)");
        return;
    }
    let dir = temp_dir("prometheus");
    let api_port = free_port();
    let listen = format!("127.0.0.1:{api_port}");
    let d = busy_daemon(&dir, &["--listen", &listen]);
    let config = dir.join("prometheus.yml");
    // A request without the token: refused, and counted.
    let (status, _) = http_get(api_port, "/v1/vms").expect("daemon on TCP");
    assert_eq!(status, 401);
    // The TCP API needs the daemon's bearer token.
    let token = d.token_file.clone().expect("the daemon's token file");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
             scrape_configs:\n  - job_name: corral\n    static_configs:\n      \
             - targets: ['{listen}']\n    authorization:\n      credentials_file: {}\n",
            token.display()
        ),
    )
    .expect("config");
    let web_port = free_port();
    let log = std::fs::File::create(dir.join("prometheus.log")).expect("log file");
    let child = Command::new(PROMETHEUS)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{web_port}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn prometheus");
    let prom = Prometheus(child);
    let log_tail = || {
        let l = std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default();
        let lines: Vec<&str> = l.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    };

    // The target is up (the scrape parsed), and a corral series with the
    // VM's labels comes back through the query API.
    let up = wait_until(Duration::from_secs(60), || {
        let r = query(web_port, r#"up{job="corral"}"#)?;
        (r.first()?["value"][1] == "1").then_some(())
    });
    assert!(
        up.is_some(),
        "target never up; prometheus log:\n{}",
        log_tail()
    );
    let (_, targets) = http_get(web_port, "/api/v1/targets").expect("targets");
    let t: serde_json::Value = serde_json::from_str(&targets).expect("targets JSON");
    let target = &t["data"]["activeTargets"][0];
    assert_eq!(target["health"], "up", "{target}");
    assert_eq!(target["lastError"], "", "{target}");
    let q = r#"corral_vm_cpu_seconds_total{job="corral",vm="spin1",class="default"}"#;
    let v = wait_until(Duration::from_secs(20), || {
        let r = query(web_port, q)?;
        let v: f64 = r.first()?["value"][1].as_str()?.parse().ok()?;
        (v > 0.0).then_some(v)
    });
    assert!(v.is_some(), "no {q}; prometheus log:\n{}", log_tail());
    let r = query(web_port, "corral_build_info").expect("build info");
    assert_eq!(
        r.first().map(|s| s["value"][1].clone()),
        Some(json!("1")),
        "{r:?}"
    );
    assert_eq!(
        r.first().map(|s| s["metric"]["version"].clone()),
        Some(json!(env!("CARGO_PKG_VERSION")))
    );
    // The refused request is in the API request counts.
    let r = query(
        web_port,
        r#"corral_api_requests_total{route="/v1/vms",method="GET",code="401"}"#,
    )
    .expect("401 query");
    assert_eq!(
        r.first().map(|s| s["value"][1].clone()),
        Some(json!("1")),
        "{r:?}"
    );
    // A histogram made it through: its +Inf bucket is queryable.
    let r = query(
        web_port,
        r#"corral_disk_request_duration_seconds_bucket{vm="io1",op="read",le="+Inf"}"#,
    )
    .expect("bucket query");
    assert!(!r.is_empty(), "no +Inf bucket in Prometheus");
    // The device's own counters (BlockStats) are there, with their labels:
    // the reads the guest's job completed, and no I/O error.
    let q = r#"corral_disk_device_requests_total{job="corral",vm="io1",disk="data",op="read"}"#;
    let v = wait_until(Duration::from_secs(20), || {
        let r = query(web_port, q)?;
        let v: f64 = r.first()?["value"][1].as_str()?.parse().ok()?;
        (v > 0.0).then_some(v)
    });
    assert!(v.is_some(), "no {q}; prometheus log:\n{}", log_tail());
    let r = query(
        web_port,
        r#"corral_disk_io_errors_total{vm="io1",disk="data"}"#,
    )
    .expect("io errors query");
    assert_eq!(
        r.first().map(|s| s["value"][1].clone()),
        Some(json!("0")),
        "{r:?}"
    );
    drop(prom);
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}
