//! The control plane's API as an outside user attacks it (issue 11): each
//! test reproduces one exploit against the real daemon, with the client
//! running as `nobody` where the uid matters, and checks that it now fails
//! safely.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use corral_tests::api::{Conn, Daemon, spin_vm, wait_until};
use corral_tests::{corral_bin, run_corral, text};
use serde_json::json;

/// `cmd args` as uid nobody, gid nogroup (or `gid`), with `groups`.
fn as_nobody(gid: &str, groups: Option<&str>, cmd: &str, args: &[&str]) -> Output {
    let regid = format!("--regid={gid}");
    let mut a = vec!["--reuid=nobody", regid.as_str()];
    let g;
    match groups {
        Some(list) => {
            g = format!("--groups={list}");
            a.push(&g);
        }
        None => a.push("--clear-groups"),
    }
    a.push(cmd);
    a.extend_from_slice(args);
    Command::new("setpriv")
        .args(&a)
        .stdin(Stdio::null())
        .output()
        .expect("run setpriv (util-linux)")
}

/// curl as nobody: (HTTP status, body); status 0 if no answer came.
fn curl_as_nobody(gid: &str, groups: Option<&str>, args: &[&str]) -> (u16, String) {
    let mut a = vec!["-s", "--max-time", "10", "-w", "\n%{http_code}"];
    a.extend_from_slice(args);
    let o = as_nobody(gid, groups, "curl", &a);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let (body, code) = out.rsplit_once('\n').unwrap_or(("", &out));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

fn error_code(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
        .unwrap_or_else(|| format!("<not an API error: {body}>"))
}

/// The issue's exploit: a VM whose initrd is /etc/shadow, created by
/// `nobody` over the loopback TCP port. Now 401 without the token, and
/// nobody cannot read the token file.
#[test]
fn tcp_needs_the_bearer_token() {
    let d = Daemon::start(&["--listen", "127.0.0.1:0"]);
    let addr = d.tcp.expect("the daemon printed its TCP address");
    let url = format!("http://{addr}/v1/vms");
    let body = json!({"name": "leak", "initrd": "/etc/shadow", "memory_mib": 32,
                      "cmdline": "probe.mode=boot"})
    .to_string();
    let post = [
        "-X",
        "POST",
        "-H",
        "Content-Type: application/json",
        "-d",
        &body,
    ];
    let mut args = post.to_vec();
    args.push(&url);
    let (status, out) = curl_as_nobody("nogroup", None, &args);
    assert_eq!(status, 401, "nobody's create without a token: {out}");
    assert_eq!(error_code(&out), "unauthorized");
    // A wrong token: 401 as well.
    let mut args = post.to_vec();
    args.extend_from_slice(&["-H", "Authorization: Bearer 0123456789abcdef", &url]);
    assert_eq!(curl_as_nobody("nogroup", None, &args).0, 401);
    // The token file is root's alone, and long enough.
    let tf = d.token_file.clone().expect("token file");
    let meta = std::fs::metadata(&tf).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let token = d.token().expect("token");
    assert!(token.len() >= 64, "token {token:?}");
    let o = as_nobody("nogroup", None, "cat", &[tf.to_str().unwrap()]);
    assert!(!o.status.success(), "nobody read the token file");
    // No VM was made; with the token (as root) the API works.
    let r = d.tcp_req("GET", "/v1/vms", None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json().as_array().map(Vec::len), Some(0));
    // The CLI reads the token file by itself.
    let u = format!("http://{addr}");
    let o = run_corral(
        &[
            "--url",
            &u,
            "--token-file",
            tf.to_str().unwrap(),
            "class",
            "list",
        ],
        Duration::from_secs(10),
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "corral --url: {out} {err}");
    assert!(out.contains("default"), "{out}");
    // As nobody it cannot, and says why.
    let o = as_nobody(
        "nogroup",
        None,
        corral_bin().to_str().unwrap(),
        &[
            "--url",
            &u,
            "--token-file",
            tf.to_str().unwrap(),
            "class",
            "list",
        ],
    );
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("token"), "{err}");
}

/// DNS rebinding and CSRF: a foreign Host header, a cross-origin write and
/// a `text/plain` post are refused even with the token.
#[test]
fn browser_requests_are_refused() {
    let d = Daemon::start(&["--listen", "127.0.0.1:0", "--allow-host", "corral.test"]);
    let mut c = d.tcp_conn();
    c.host = "evil.example.com".into();
    let r = c.req("GET", "/v1/status", None);
    assert_eq!(r.status, 403, "foreign Host: {}", r.text());
    assert!(r.text().contains("--allow-host"), "{}", r.text());
    let mut c = d.tcp_conn();
    c.host = format!("corral.test:{}", d.tcp.unwrap().port());
    assert_eq!(c.req("GET", "/v1/status", None).status, 200);
    let mut c = d.tcp_conn();
    c.host = "localhost".into(); // without the port
    assert_eq!(c.req("GET", "/v1/status", None).status, 403);

    // A cross-origin JSON write.
    let mut c = d.tcp_conn();
    c.headers.push("Origin: http://evil.example.com".into());
    let r = c.req(
        "POST",
        "/v1/classes",
        Some(r#"{"name":"csrf","shares":10}"#),
    );
    r.assert_error(403, "forbidden");
    // A reading request with an Origin is fine (a page cannot read it back).
    let mut c = d.tcp_conn();
    c.headers.push("Origin: http://evil.example.com".into());
    assert_eq!(c.req("GET", "/v1/status", None).status, 200);

    // The issue's form: a text/plain POST, which needs no CORS preflight.
    let body = r#"{"name":"csrf","shares":10}"#;
    let mut c = d.tcp_conn();
    let raw = format!(
        "POST /v1/classes HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\n\
         Content-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
        d.tcp.unwrap(),
        d.token().unwrap(),
        body.len()
    );
    c.write_raw(raw.as_bytes()).unwrap();
    let r = c.read_response(None);
    let msg = r.assert_error(403, "forbidden");
    assert!(msg.contains("application/json"), "{msg}");
    // The same over the Unix socket.
    let mut c = d.conn();
    let raw = format!(
        "POST /v1/classes HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/plain\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    c.write_raw(raw.as_bytes()).unwrap();
    c.read_response(None).assert_error(403, "forbidden");
    // No class was made.
    d.req("GET", "/v1/classes/csrf", None)
        .assert_error(404, "not_found");
}

/// The Unix socket checks its peer (SO_PEERCRED), so a socket whose mode
/// was widened by mistake still serves root only; `--socket-group` lets a
/// group in (primary or supplementary), and no one else.
#[test]
fn unix_socket_checks_the_peer() {
    let d = Daemon::start(&[]);
    let sock = d.socket.to_str().unwrap().to_string();
    let mode = std::fs::metadata(&d.socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    std::fs::set_permissions(&d.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (status, out) = curl_as_nobody(
        "nogroup",
        None,
        &["--unix-socket", &sock, "http://localhost/v1/status"],
    );
    assert_eq!(status, 403, "nobody on a 0666 socket: {out}");
    assert_eq!(error_code(&out), "forbidden");
    assert!(out.contains("uid 65534"), "{out}");
    drop(d);

    let d = Daemon::start(&["--socket-group", "nogroup"]);
    let sock = d.socket.to_str().unwrap().to_string();
    let meta = std::fs::metadata(&d.socket).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    assert_eq!(meta.gid(), 65534);
    let url = ["--unix-socket", sock.as_str(), "http://localhost/v1/status"];
    assert_eq!(
        curl_as_nobody("nogroup", None, &url).0,
        200,
        "primary group"
    );
    assert_eq!(
        curl_as_nobody("12345", Some("nogroup"), &url).0,
        200,
        "supplementary group"
    );
    assert_eq!(curl_as_nobody("12345", None, &url).0, 0, "not a member");
    // Widened by mistake again: a non-member gets 403, not the API.
    std::fs::set_permissions(&d.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (status, out) = curl_as_nobody("12345", None, &url);
    assert_eq!(status, 403, "{out}");
}

fn serve_once(args: &[&str]) -> (bool, String) {
    let mut a = vec!["serve"];
    a.extend_from_slice(args);
    let o = run_corral(&a, Duration::from_secs(20));
    let (_, err) = text(&o);
    (o.status.success(), err)
}

/// A second daemon on a live socket refuses and leaves it alone; a regular
/// file at the socket path is never deleted; a stale socket is replaced.
#[test]
fn socket_lifecycle_never_deletes_what_is_not_ours() {
    let d = Daemon::start(&[]);
    let sock = d.socket.to_str().unwrap();
    let other = d.dir.join("state2");
    let (ok, err) = serve_once(&["--socket", sock, "--state-dir", other.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("already listening"), "{err}");
    assert!(d.socket.exists(), "the live socket was deleted");
    assert_eq!(d.req("GET", "/v1/status", None).status, 200);

    let file = d.dir.join("precious.txt");
    std::fs::write(&file, "keep me").unwrap();
    let (ok, err) = serve_once(&[
        "--socket",
        file.to_str().unwrap(),
        "--state-dir",
        other.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(
        std::fs::read_to_string(&file).ok().as_deref(),
        Some("keep me")
    );

    // A stale socket (its daemon died) is replaced.
    let stale = d.dir.join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let mut r = corral_tests::Running::start(&[
        "serve",
        "--socket",
        stale.to_str().unwrap(),
        "--state-dir",
        other.to_str().unwrap(),
    ]);
    assert!(
        r.wait_for("listening on", Duration::from_secs(20))
            .is_some(),
        "did not start on a stale socket"
    );
    assert!(UnixStream::connect(&stale).is_ok());
    r.signal(libc::SIGTERM);
    let _ = r.child.wait();
    assert!(!stale.exists(), "its own socket is removed at exit");
}

/// One daemon per state directory: the second one names the first's pid.
#[test]
fn state_dir_is_locked() {
    let d = Daemon::start(&[]);
    let state = d.dir.join("state");
    let sock2 = d.dir.join("second.sock");
    let (ok, err) = serve_once(&[
        "--socket",
        sock2.to_str().unwrap(),
        "--state-dir",
        state.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(
        err.contains(&format!("in use by corral pid {}", d.child.id())),
        "{err}"
    );
    assert!(!sock2.exists(), "the refused daemon made a socket");
    let mode = std::fs::metadata(&state).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700);
}

/// Reads from `s` until EOF; Ok(bytes) if the daemon closed the connection
/// within `within`, Err if it was still open.
fn closed_within(s: &mut UnixStream, within: Duration) -> Result<Vec<u8>, String> {
    s.set_read_timeout(Some(within)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Ok(got),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(got),
            Err(e) => {
                return Err(format!(
                    "still open after {within:?} ({e}); got {:?}",
                    String::from_utf8_lossy(&got)
                ));
            }
        }
    }
}

/// A partial request head, a partial body and an idle keep-alive
/// connection are all closed after their timeouts; a client that keeps
/// its connection busy is not.
#[test]
fn slow_and_idle_connections_time_out() {
    let d = Daemon::start(&[
        "--header-timeout",
        "1",
        "--body-timeout",
        "1",
        "--idle-timeout",
        "2",
    ]);
    let t0 = Instant::now();
    let mut head = UnixStream::connect(&d.socket).unwrap();
    head.write_all(b"GET /v1/status HTTP/1.1\r\nHo").unwrap();
    let mut body = UnixStream::connect(&d.socket).unwrap();
    body.write_all(
        b"POST /v1/classes HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"name\":",
    )
    .unwrap();
    let mut idle = UnixStream::connect(&d.socket).unwrap();
    idle.write_all(b"GET /v1/status HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();

    let got = closed_within(&mut head, Duration::from_secs(6)).expect("partial head");
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    let _ = got;
    let got = closed_within(&mut body, Duration::from_secs(6)).expect("partial body");
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    // The idle one got its answer, then was closed after 2 s of silence.
    let got = closed_within(&mut idle, Duration::from_secs(6)).expect("idle keep-alive");
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"));
    assert!(t0.elapsed() < Duration::from_secs(6), "{:?}", t0.elapsed());
    // A connection used every 0.7 s stays open past every timeout.
    let mut busy = d.conn();
    for _ in 0..5 {
        assert_eq!(busy.req("GET", "/v1/status", None).status, 200);
        std::thread::sleep(Duration::from_millis(700));
    }
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// A GET over a fresh Unix connection, failing after `within`.
fn unix_status(socket: &Path, within: Duration) -> Result<u16, String> {
    let mut s = UnixStream::connect(socket).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(within)).unwrap();
    s.write_all(b"GET /v1/status HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .map_err(|e| format!("write: {e}"))?;
    let mut got = Vec::new();
    s.read_to_end(&mut got)
        .map_err(|e| format!("no answer within {within:?}: {e}"))?;
    let t = String::from_utf8_lossy(&got);
    t.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("bad answer {t:?}"))
}

/// Idle TCP connections against a daemon with 512 descriptors, as many as
/// connect: the TCP listener takes at most --max-connections (256) of them
/// and leaves the rest in the kernel's backlog, so the Unix socket still
/// answers. (Before, the flood took every descriptor.)
#[test]
fn tcp_flood_leaves_the_unix_socket_usable() {
    let d = Daemon::start_with(&["--listen", "127.0.0.1:0"], Some(512));
    let addr = d.tcp.unwrap();
    let mut flood = Vec::new();
    // Connect as fast as possible; a connect that times out found the
    // backlog full (the daemon stopped accepting, or is behind): stop after
    // three in a row.
    let mut misses = 0;
    for _ in 0..700 {
        match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Ok(s) => {
                flood.push(s);
                misses = 0;
            }
            Err(_) if misses < 2 => misses += 1,
            Err(_) => break,
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let fds = open_fds(d.child.id());
    assert_eq!(unix_status(&d.socket, Duration::from_secs(5)), Ok(200));
    assert!(fds < 400, "the daemon holds {fds} descriptors");
    // The flood reached the cap (what is over it waits in the backlog).
    assert!(
        flood.len() >= 256,
        "only {} connections opened",
        flood.len()
    );
    drop(flood);
    let ok = wait_until(Duration::from_secs(10), || {
        (std::net::TcpStream::connect(addr).is_ok()
            && d.tcp_req("GET", "/v1/status", None).status == 200)
            .then_some(())
    });
    assert!(ok.is_some(), "TCP did not recover after the flood");
}

/// 64 console followers that never read, all from one client, leave room
/// for everyone else.
#[test]
fn non_reading_followers_do_not_lock_others_out() {
    let d = Daemon::start(&["--listen", "127.0.0.1:0"]);
    let r = d.req(
        "POST",
        "/v1/vms",
        Some(&spin_vm("chatty", "default", 1, 32, 30)),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let mut held = Vec::new();
    let (mut ok, mut refused) = (0, 0);
    for _ in 0..64 {
        let mut c = d.tcp_conn();
        c.send("GET", "/v1/vms/chatty/console?follow=true", None);
        // Only the status line: the stream itself is never read.
        let mut line = [0u8; 12];
        let mut got = 0;
        while got < 12 {
            let n = c.read_some(&mut line[got..]);
            assert!(n > 0, "connection closed");
            got += n;
        }
        match &line[9..12] {
            b"200" => ok += 1,
            b"429" => refused += 1,
            s => panic!("status {:?}", String::from_utf8_lossy(s)),
        }
        held.push(c);
    }
    assert!(ok <= 16, "{ok} streams for one client");
    assert_eq!(ok + refused, 64);
    // Another client (root on the Unix socket) can still follow.
    let mut c = d.conn();
    c.send("GET", "/v1/vms/chatty/console?follow=true", None);
    let mut first = None;
    let r = c.read_response(Some(&mut |chunk: &[u8]| {
        first = Some(chunk.to_vec());
        false
    }));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(first.is_some());
}

/// Every error message quotes at most 64 bytes of what the client sent.
#[test]
fn error_messages_quote_at_most_64_bytes() {
    let d = Daemon::start(&[]);
    let long = "x".repeat(10_000);
    let spaced = format!("/tmp/{}", "y y ".repeat(2_500));
    let cases: Vec<(&str, String, Option<String>)> = vec![
        (
            "POST",
            "/v1/classes".into(),
            Some(json!({"name": long, "shares": 1}).to_string()),
        ),
        (
            "POST",
            "/v1/classes".into(),
            Some(format!(r#"{{"name":"a","{long}":1}}"#)),
        ),
        (
            "POST",
            "/v1/classes".into(),
            Some(json!({"name": "a", "shares": long}).to_string()),
        ),
        (
            "PUT",
            format!("/v1/classes/{long}"),
            Some(r#"{"shares":1}"#.into()),
        ),
        ("GET", format!("/v1/vms/{long}"), None),
        ("GET", format!("/v1/vms/a/console?{long}=1"), None),
        (
            "POST",
            "/v1/vms".into(),
            Some(
                json!({"name": "v", "memory_mib": 32,
            "disks": [{"id": "d", "path": spaced}]})
                .to_string(),
            ),
        ),
        (
            "POST",
            "/v1/vms".into(),
            Some(
                json!({"name": "v", "memory_mib": 32,
            "kernel": format!("/nonexistent/{long}")})
                .to_string(),
            ),
        ),
    ];
    for (m, p, b) in cases {
        let r = d.req(m, &p, b.as_deref());
        assert!(
            r.status >= 400,
            "{m} {}: {}",
            &p[..p.len().min(40)],
            r.status
        );
        let msg = r.json()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(!msg.is_empty(), "{}", r.text());
        assert!(
            !msg.contains(&"x".repeat(65)) && !msg.contains(&"y y ".repeat(17)) && msg.len() < 600,
            "{m} {}: {} bytes: {msg}",
            &p[..p.len().min(40)],
            msg.len()
        );
    }
}

/// Duplicate JSON keys, at the top or nested, are 400 (serde keeps the last).
#[test]
fn duplicate_json_keys_are_refused() {
    let d = Daemon::start(&[]);
    let r = d.req(
        "POST",
        "/v1/classes",
        Some(r#"{"name":"a","shares":1,"shares":9000}"#),
    );
    let msg = r.assert_error(400, "bad_request");
    assert!(msg.contains("duplicate key"), "{msg}");
    let r = d.req(
        "POST",
        "/v1/classes",
        Some(r#"{"name":"b","io":{"iops":100,"iops":100000}}"#),
    );
    r.assert_error(400, "bad_request");
    d.req("GET", "/v1/classes/a", None)
        .assert_error(404, "not_found");
    assert_eq!(
        d.req("POST", "/v1/classes", Some(r#"{"name":"a","shares":1}"#))
            .status,
        201
    );
}

/// SIGTERM stops the daemon and its VMs within seconds even while 130
/// requests are stuck opening a FIFO (they filled the blocking pool that
/// the old shutdown waited in).
#[test]
fn sigterm_stops_the_daemon_despite_stuck_requests() {
    let mut d = Daemon::start(&["--shutdown-timeout", "3"]);
    let r = d.req(
        "POST",
        "/v1/vms",
        Some(&spin_vm("live", "default", 1, 32, 60)),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let fifo = d.dir.join("kernel.fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo(3) with a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let body = json!({"memory_mib": 32, "kernel": fifo}).to_string();
    let mut stuck: Vec<Conn> = Vec::new();
    for _ in 0..130 {
        let mut c = d.conn();
        c.send("POST", "/v1/vms", Some(&body));
        stuck.push(c);
    }
    std::thread::sleep(Duration::from_millis(1500));
    let t0 = Instant::now();
    let st = d.terminate(Duration::from_secs(15));
    let took = t0.elapsed();
    let st = st.expect("the daemon ignored SIGTERM for 15 s");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(st.success(), "exit {st:?}: the VMs did not stop cleanly");
    assert!(!d.socket.exists(), "socket left behind");
}

/// `corral vm list | head -0`: the CLI dies quietly of the broken pipe.
#[test]
fn cli_does_not_panic_on_a_broken_pipe() {
    let d = Daemon::start(&[]);
    for i in 0..3 {
        let r = d.req(
            "POST",
            "/v1/classes",
            Some(&format!(r#"{{"name":"c{i}","shares":1}}"#)),
        );
        assert_eq!(r.status, 201);
    }
    let mut fds = [0; 2];
    // SAFETY: pipe(2) into a 2-element array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: the read end is ours and closed once, here.
    unsafe { libc::close(fds[0]) };
    // SAFETY: fds[1] is a fresh descriptor this test owns.
    let w = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fds[1]) };
    let o = Command::new(corral_bin())
        .args(["--socket", d.socket.to_str().unwrap(), "class", "list"])
        .stdout(w)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "{err}");
    use std::os::unix::process::ExitStatusExt;
    assert!(o.status.code() != Some(101), "exit {:?}: {err}", o.status);
    assert!(
        o.status.success() || o.status.signal() == Some(libc::SIGPIPE),
        "{:?}",
        o.status
    );
}

/// A client that asks and never reads (here: 100 pipelined requests for the
/// 40 KiB spec) is dropped once the daemon's writes have waited
/// --write-timeout; before, the connection and its buffers stayed forever.
/// Console followers that stop reading are dropped the same way.
#[test]
fn a_client_that_does_not_read_is_dropped() {
    let d = Daemon::start(&["--write-timeout", "1"]);
    let spec_len = d.req("GET", "/v1/openapi.yaml", None).body.len();
    let mut s = UnixStream::connect(&d.socket).unwrap();
    let one = "GET /v1/openapi.yaml HTTP/1.1\r\nHost: localhost\r\n\r\n";
    s.write_all(one.repeat(100).as_bytes()).unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let got = closed_within(&mut s, Duration::from_secs(5)).expect("the stalled connection");
    assert!(
        got.len() < 50 * spec_len,
        "{} bytes of {} came: the connection was not cut",
        got.len(),
        100 * spec_len
    );
    // The daemon itself is fine.
    assert_eq!(d.req("GET", "/v1/status", None).status, 200);
}
