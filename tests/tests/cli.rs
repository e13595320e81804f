//! The `corral` client through the real binary: help sections, host names
//! in `--listen`, `disk limit` merging, human `vm show`, `top`'s legend,
//! units and I/O columns, its class tree, and Ctrl-C in `top`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use corral_tests::api::{Daemon, spin_vm, wait_until};
use corral_tests::{corral_bin, run_corral, text};
use serde_json::json;

const T: Duration = Duration::from_secs(30);

/// Runs the client against `d`: (exit code, stdout, stderr).
fn cli(d: &Daemon, args: &[&str]) -> (Option<i32>, String, String) {
    let mut a = vec!["--socket", d.socket.to_str().unwrap()];
    a.extend_from_slice(args);
    let o = run_corral(&a, T);
    let (out, err) = text(&o);
    (o.status.code(), out, err)
}

/// The options listed under `heading` in a `--help` text.
fn section<'a>(help: &'a str, heading: &str) -> Vec<&'a str> {
    help.lines()
        .skip_while(|l| l.trim_end() != format!("{heading}:"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .collect()
}

#[test]
fn client_options_have_their_own_help_section_and_serve_has_none() {
    let help = |args: &[&str]| {
        let o = run_corral(args, T);
        assert!(o.status.success(), "{args:?}");
        text(&o).0
    };
    for args in [
        &["--help"][..],
        &["vm", "list", "--help"],
        &["top", "--help"],
    ] {
        let h = help(args);
        let client = section(&h, "Client options");
        for opt in ["--socket", "--url", "--json"] {
            assert!(
                client.iter().any(|l| l.contains(opt)),
                "{args:?}: {opt} not under Client options:\n{h}"
            );
        }
        let plain = section(&h, "Options").join("\n");
        assert!(
            !plain.contains("--json"),
            "{args:?}: --json among Options:\n{h}"
        );
    }
    let serve = help(&["serve", "--help"]);
    assert!(!serve.contains("--url"), "{serve}");
    assert!(!serve.contains("--json"), "{serve}");
    assert!(!serve.contains("Client options"), "{serve}");
    // Both places work: before the command and after it.
    let d = Daemon::start(&[]);
    let (code, out, err) = cli(&d, &["--json", "status"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.trim_start().starts_with('{'), "{out}");
    let o = run_corral(
        &[
            "vm",
            "list",
            "--json",
            "--socket",
            d.socket.to_str().unwrap(),
        ],
        T,
    );
    assert!(o.status.success(), "{:?}", text(&o));
    assert_eq!(text(&o).0.trim(), "[]");
}

#[test]
fn listen_takes_a_host_name() {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let listen = format!("localhost:{port}");
    let _d = Daemon::start(&["--listen", &listen]);
    let ok = wait_until(Duration::from_secs(10), || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
            .ok()?;
        let mut r = String::new();
        s.read_to_string(&mut r).ok()?;
        r.starts_with("HTTP/1.").then_some(r)
    })
    .expect("the daemon answers on localhost's address");
    assert!(
        !ok.starts_with("HTTP/1.0 5") && !ok.starts_with("HTTP/1.1 5"),
        "{ok}"
    );
    // A bad port is a usage error naming the option, not a panic.
    let o = run_corral(
        &[
            "serve",
            "--socket",
            "/tmp/corral-cli-unused.sock",
            "--listen",
            "localhost:http",
        ],
        T,
    );
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--listen") && err.contains("not a port number"),
        "{err}"
    );
}

fn img(name: &str) -> String {
    let p = std::env::temp_dir().join(format!("corral-cli-{}-{name}", std::process::id()));
    std::fs::File::create(&p)
        .and_then(|f| f.set_len(8 << 20))
        .unwrap();
    p.to_str().unwrap().to_string()
}

#[test]
fn disk_limit_merges_unless_replace_and_vm_show_is_human() {
    let d = Daemon::start(&[]);
    let path = img("merge.img");
    // Reads held to 100 ops/s all along (riops is kept by every change
    // below): the 8 MiB job takes ~20 s, so the VM runs throughout (a
    // stopped VM's disks cannot change).
    let body = json!({
        "name": "dl", "memory_mib": 32,
        "cmdline": "probe.mode=blk probe.op=read probe.size=8M probe.bs=4K probe.qd=2",
        "disks": [{"id": "data", "path": path, "limits": {"riops": 100, "bps": 1048576}}]
    });
    let r = d.req("POST", "/v1/vms", Some(&body.to_string()));
    assert_eq!(r.status, 201, "{}", r.text());
    let limits = || d.req("GET", "/v1/vms/dl", None).json()["disks"][0]["limits"].clone();

    // Merge: iops=500 keeps bps and riops (it used to drop them).
    let (code, out, err) = cli(&d, &["disk", "limit", "dl", "data", "iops=500"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(limits(), json!({"bps": 1048576, "iops": 500, "riops": 100}));
    assert_eq!(
        out.trim(),
        "dl/data: limits bps 1.0 MiB/s, iops 500/s, riops 100/s",
        "{out}"
    );
    // KEY=none removes one limit and keeps the rest.
    let (code, _, err) = cli(
        &d,
        &["disk", "limit", "dl", "data", "bps=none,burst_ops=20"],
    );
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        limits(),
        json!({"iops": 500, "riops": 100, "burst_ops": 20})
    );
    // --replace: only what is given.
    let (code, out, err) = cli(
        &d,
        &[
            "disk",
            "limit",
            "--replace",
            "dl",
            "data",
            "wbps=2M",
            "riops=100",
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(limits(), json!({"wbps": 2097152, "riops": 100}));
    assert!(
        out.contains("wbps 2.0 MiB/s") && !out.contains("iops 500") && !out.contains("burst"),
        "{out}"
    );
    // JSON output stays JSON.
    let (_, out, _) = cli(&d, &["--json", "disk", "limit", "dl", "data", "rbps=1M"]);
    let j: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(
        j["limits"],
        json!({"wbps": 2097152, "riops": 100, "rbps": 1048576})
    );
    // An unknown disk names the ones there are.
    let (code, _, err) = cli(&d, &["disk", "limit", "dl", "nope", "iops=1"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no disk") && err.contains("data"), "{err}");

    // vm show: limits and disk stats in words and units, not JSON.
    wait_until(T, || {
        let v = d.req("GET", "/v1/vms/dl", None).json();
        (v["disks"][0]["stats"]["read_ops"].as_u64()? > 0).then_some(())
    })
    .expect("the disk served reads");
    let (code, out, err) = cli(&d, &["vm", "show", "dl"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(!out.contains('{'), "raw JSON in vm show:\n{out}");
    assert!(
        out.contains("disk data: ") && out.contains("8.0 MiB"),
        "{out}"
    );
    assert!(
        out.contains("limits:    rbps 1.0 MiB/s, wbps 2.0 MiB/s, riops 100/s"),
        "{out}"
    );
    let read = out
        .lines()
        .find(|l| l.trim_start().starts_with("read:"))
        .unwrap_or_else(|| panic!("no read line:\n{out}"));
    let n: u64 = read
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(
        n > 0 && read.contains("requests") && read.contains("iB"),
        "{read}"
    );
    assert!(out.contains("throttled: "), "{out}");
    let _ = std::fs::remove_file(&path);
}

#[test]
fn top_has_a_legend_units_io_columns_and_no_negative_zero() {
    let d = Daemon::start(&[]);
    let path = img("top.img");
    // An idle class (no VM: figures 0), a spinning VM, a VM reading.
    assert_eq!(
        cli(&d, &["class", "set", "idle", "--shares", "50"]).0,
        Some(0)
    );
    let r = d.req(
        "POST",
        "/v1/vms",
        Some(&spin_vm("spin", "default", 1, 16, 20)),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let body = json!({
        "name": "rd", "memory_mib": 32,
        "cmdline": "probe.mode=blk probe.op=read probe.size=8M probe.bs=4K probe.qd=4",
        "disks": [{"id": "data", "path": path, "limits": {"iops": 400, "burst_ops": 10}}]
    });
    let r = d.req("POST", "/v1/vms", Some(&body.to_string()));
    assert_eq!(r.status, 201, "{}", r.text());
    std::thread::sleep(Duration::from_millis(300));
    let (code, out, err) = cli(&d, &["top", "--once", "--interval", "1"]);
    assert_eq!(code, Some(0), "{err}");
    for h in [
        "CPU%",
        "ENT%",
        "PART%",
        "PROMISED%",
        "READ",
        "WRITE",
        "THROTTLED",
    ] {
        assert!(out.contains(h), "no column {h}:\n{out}");
    }
    for l in [
        "percent of one host CPU",
        "ms per second",
        "disk bytes per second",
    ] {
        assert!(out.contains(l), "legend lacks {l:?}:\n{out}");
    }
    assert!(!out.contains("-0.0"), "negative zero:\n{out}");
    let rd = out
        .lines()
        .find(|l| l.starts_with("rd "))
        .unwrap_or_else(|| panic!("no rd line:\n{out}"));
    assert!(rd.contains("iB/s") && rd.contains("ms/s"), "{rd}");
    let idle = out
        .lines()
        .find(|l| l.starts_with("idle "))
        .unwrap_or_else(|| panic!("no idle line:\n{out}"));
    assert!(idle.contains("0.0"), "{idle}");
    // JSON carries the I/O figures too: 400 ops/s of 4 KiB = 1.6 MB/s.
    let (_, out, _) = cli(&d, &["--json", "top", "--once", "--interval", "1"]);
    let j: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
    let rd = j["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "rd")
        .unwrap();
    let bps = rd["read_bytes_per_second"].as_f64().unwrap();
    assert!(
        bps > 400.0 * 4096.0 * 0.5 && bps < 400.0 * 4096.0 * 1.5,
        "{rd}"
    );
    assert!(
        rd["throttled_ms_per_second"].as_f64().unwrap() > 0.0,
        "{rd}"
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn ctrl_c_in_top_exits_130() {
    let d = Daemon::start(&[]);
    let mut child = Command::new(corral_bin())
        .args([
            "--socket",
            d.socket.to_str().unwrap(),
            "top",
            "--interval",
            "0.2",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn corral top");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let t0 = Instant::now();
    let mut line = String::new();
    while !line.contains("CLASS") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "top ended early");
        assert!(t0.elapsed() < T, "no sample from top");
    }
    // SAFETY: kill(2) on our own child.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGINT);
    }
    let status = wait_until(Duration::from_secs(10), || child.try_wait().ok().flatten())
        .expect("top exits on Ctrl-C");
    assert_eq!(status.code(), Some(130), "{status:?}");
}

#[test]
fn top_shows_the_class_tree() {
    let d = Daemon::start(&[]);
    for body in [
        json!({"name": "tenant-a", "shares": 1}),
        json!({"name": "tenant-b", "shares": 1}),
        json!({"name": "gold", "parent": "tenant-a", "shares": 3}),
        json!({"name": "bronze", "parent": "tenant-a", "shares": 1}),
    ] {
        let r = d.req("POST", "/v1/classes", Some(&body.to_string()));
        assert_eq!(r.status, 201, "{}", r.text());
    }
    let (code, out, err) = cli(&d, &["top", "--once", "--interval", "0.2"]);
    assert_eq!(code, Some(0), "{err}");
    let rows: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("CLASS "))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .collect();
    let pos = |p: &str| {
        rows.iter()
            .position(|l| l.starts_with(p))
            .unwrap_or_else(|| panic!("no row {p:?}:\n{out}"))
    };
    let (a, g, b, tb) = (
        pos("tenant-a "),
        pos("  gold "),
        pos("  bronze "),
        pos("tenant-b "),
    );
    assert!(a < g && a < b && g.max(b) < tb, "not in tree order:\n{out}");
    let (_, out, _) = cli(&d, &["--json", "top", "--once", "--interval", "0.2"]);
    let j: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
    let gold = j["classes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "gold")
        .unwrap();
    assert_eq!(gold["parent"], "tenant-a", "{gold}");
    assert_eq!(gold["depth"], 1, "{gold}");
}

#[test]
fn the_default_class_cannot_be_deleted() {
    let d = Daemon::start(&[]);
    let msg = d
        .req("DELETE", "/v1/classes/default", None)
        .assert_error(409, "conflict");
    assert!(msg.contains("cannot be deleted"), "{msg}");
    let (code, _, err) = cli(&d, &["class", "rm", "default"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("cannot be deleted"), "{err}");
    // Still there: a VM created without a class joins it.
    let r = d.req(
        "POST",
        "/v1/vms",
        Some(r#"{"name":"plain","memory_mib":16}"#),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["class"], "default");
}

#[test]
fn serve_socket_flag_wins_over_corral_socket() {
    let dir = std::env::temp_dir().join(format!("corral-cli-sock-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (flag, env) = (dir.join("flag.sock"), dir.join("env.sock"));
    let mut child = Command::new(corral_bin())
        .args(["serve", "--socket", flag.to_str().unwrap()])
        .env("CORRAL_SOCKET", &env)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn corral serve");
    let up = wait_until(Duration::from_secs(20), || flag.exists().then_some(()));
    let env_used = env.exists();
    // SAFETY: kill(2) on our own child.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(up.is_some() && !env_used, "serve --socket ignored");
}

/// The scheduler's timing flags are checked before anything starts: a
/// minimum slice longer than the period, a tick under 0.1 ms and a value
/// that is not a number are refused with a message naming the flags, and
/// no socket is created.
#[test]
fn serve_refuses_bad_scheduler_timing() {
    let dir = std::env::temp_dir().join(format!("corral-cli-timing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("t.sock");
    let state = dir.join("state");
    for (flags, want) in [
        (&["--min-slice-ms", "500"][..], "minimum slice"),
        (&["--tick-ms", "0.01"][..], "tick must be at least"),
        (
            &["--period-ms", "5", "--tick-ms", "10"][..],
            "accounting period",
        ),
        (&["--tick-ms=-3"][..], "--tick-ms -3"),
    ] {
        let mut args = vec![
            "serve",
            "--socket",
            sock.to_str().unwrap(),
            "--state-dir",
            state.to_str().unwrap(),
        ];
        args.extend_from_slice(flags);
        let o = run_corral(&args, T);
        let (_, err) = text(&o);
        assert!(!o.status.success(), "{flags:?} accepted: {err}");
        assert!(err.contains(want), "{flags:?}: {err}");
        assert!(!sock.exists(), "{flags:?}: a socket was made");
    }
    let o = run_corral(&["serve", "--socket", "/x", "--tick-ms", "ten"], T);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--tick-ms"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
