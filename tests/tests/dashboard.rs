//! The dashboard at `/ui`, in a real browser: Debian's chromium, driven
//! headless through chromedriver (the W3C WebDriver protocol, spoken here
//! over plain HTTP). The page is loaded against a daemon with two classes
//! and VMs; the numbers it shows are checked against the API; a class's
//! shares are changed through the page's form; a screenshot is saved
//! (`target/ci-artifacts/dashboard.png`, printed).
//!
//! Skipped, with a message, where chromium or chromedriver is missing;
//! `.ci/run` and the README's test command install them.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use corral_tests::api::{Daemon, spin_vm, wait_until};
use serde_json::{Value, json};

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// A free loopback TCP port.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// One HTTP/1.1 request on a fresh TCP connection; returns the status and
/// the body (read by its Content-Length, or chunked: chromedriver keeps the
/// connection open whatever the request asks).
fn http(port: u16, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
    let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).ok();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    (&s).write_all(req.as_bytes()).expect("send");
    let mut r = BufReader::new(s.take(64 << 20));
    let mut status_line = String::new();
    r.read_line(&mut status_line).expect("status line");
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let (mut len, mut chunked) = (None, false);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).expect("header") == 0 || line == "\r\n" {
            break;
        }
        let l = line.to_ascii_lowercase();
        if let Some(v) = l.strip_prefix("content-length:") {
            len = v.trim().parse::<usize>().ok();
        }
        if l.starts_with("transfer-encoding:") && l.contains("chunked") {
            chunked = true;
        }
    }
    let mut out = Vec::new();
    if chunked {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).expect("chunk size");
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk).expect("chunk");
            out.extend_from_slice(&chunk[..n]);
        }
    } else if let Some(n) = len {
        out.resize(n, 0);
        r.read_exact(&mut out).expect("body");
    } else {
        r.read_to_end(&mut out).expect("body");
    }
    (status, String::from_utf8_lossy(&out).into_owned())
}

/// chromedriver and everything it started (its process group), killed when
/// dropped, also when a test fails half-way.
struct Driver(Child);

impl Drop for Driver {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.0.id()) {
            // SAFETY: plain syscall; a negative pid names the process group
            // this test created for chromedriver.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
        }
        let _ = self.0.wait();
    }
}

/// A chromedriver process and one browser session in it.
struct Browser {
    driver: Driver,
    port: u16,
    session: String,
}

impl Browser {
    fn start(profile: &Path) -> Self {
        let port = free_port();
        // Its own process group, so that the browser it starts goes with it
        // whatever way the test ends (see Driver's Drop).
        let driver = Driver(
            Command::new(CHROMEDRIVER)
                .arg(format!("--port={port}"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .process_group(0)
                .spawn()
                .expect("spawn chromedriver"),
        );
        let up = wait_until(Duration::from_secs(20), || {
            TcpStream::connect(("127.0.0.1", port)).ok()
        });
        assert!(up.is_some(), "chromedriver did not come up");
        // The flags this machine needs (no network beyond loopback, root).
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--window-size=1280,1000",
            &format!("--user-data-dir={}", profile.display()),
        ];
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": CHROMIUM, "args": args},
        }}});
        let (st, body) = http(port, "POST", "/session", Some(&caps));
        assert_eq!(st, 200, "new WebDriver session: {body}");
        let v: Value = serde_json::from_str(&body).expect("session JSON");
        let session = v["value"]["sessionId"]
            .as_str()
            .expect("sessionId")
            .to_string();
        Browser {
            driver,
            port,
            session,
        }
    }

    fn cmd(&self, method: &str, what: &str, body: Option<Value>) -> Value {
        let path = format!("/session/{}/{what}", self.session);
        let (st, text) = http(self.port, method, &path, body.as_ref());
        assert_eq!(st, 200, "WebDriver {method} {what}: {text}");
        serde_json::from_str::<Value>(&text).expect("WebDriver JSON")["value"].take()
    }

    fn goto(&self, url: &str) {
        self.cmd("POST", "url", Some(json!({ "url": url })));
    }

    /// Runs `script` (a function body) in the page and returns its value.
    fn js(&self, script: &str) -> Value {
        self.cmd(
            "POST",
            "execute/sync",
            Some(json!({"script": script, "args": []})),
        )
    }

    /// Clicks the element matching a CSS selector (a real pointer click).
    fn click(&self, css: &str) {
        let el = self.cmd(
            "POST",
            "element",
            Some(json!({"using": "css selector", "value": css})),
        );
        let id = el
            .as_object()
            .and_then(|o| o.values().next())
            .and_then(|v| v.as_str())
            .unwrap_or_else(|| panic!("no element {css}: {el}"))
            .to_string();
        self.cmd("POST", &format!("element/{id}/click"), Some(json!({})));
    }

    fn screenshot(&self, to: &Path) {
        let b64 = self.cmd("GET", "screenshot", None);
        let png = base64_decode(b64.as_str().expect("screenshot data"));
        std::fs::write(to, png).expect("write screenshot");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = http(
            self.port,
            "DELETE",
            &format!("/session/{}", self.session),
            None,
        );
        let _ = &self.driver; // killed with its group when dropped
    }
}

fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for v in s.bytes().filter_map(val) {
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

fn artifacts_dir() -> PathBuf {
    let d = std::env::var_os("CORRAL_ARTIFACTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| corral_tests::workspace_root().join("target/ci-artifacts"));
    std::fs::create_dir_all(&d).expect("artifacts dir");
    d
}

/// The page's value of `field` in the row `row_attr=name` of `table`.
fn shown(b: &Browser, table: &str, row_attr: &str, name: &str, field: &str) -> Option<String> {
    let v = b.js(&format!(
        "const r = document.querySelector('#{table} tr[data-{row_attr}=\"{name}\"] [data-field=\"{field}\"]'); \
         return r ? r.textContent : null;"
    ));
    v.as_str().map(str::to_string)
}

#[test]
fn dashboard_assets_are_served_with_a_strict_policy() {
    let d = Daemon::start(&[]);
    let r = d.req("GET", "/ui", None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("text/html")),
        "{:?}",
        r.header("content-type")
    );
    let csp = r.header("content-security-policy").unwrap_or_default();
    assert!(
        csp.contains("default-src 'none'") && csp.contains("frame-ancestors 'none'"),
        "{csp}"
    );
    assert!(r.text().contains("/ui/app.js"));
    for (path, ty) in [
        ("/ui/app.js", "text/javascript"),
        ("/ui/style.css", "text/css"),
    ] {
        let r = d.req("GET", path, None);
        assert_eq!(r.status, 200, "{path}");
        assert!(
            r.header("content-type").is_some_and(|c| c.starts_with(ty)),
            "{path}"
        );
    }
    assert_eq!(d.req("GET", "/ui/nope.js", None).status, 404);
}

#[test]
fn dashboard_in_chromium_shows_the_api_and_edits_a_class() {
    for bin in [CHROMIUM, CHROMEDRIVER] {
        if !Path::new(bin).exists() {
            eprintln!(
                "SKIP: {bin} is missing (Debian packages chromium and chromium-driver; .ci/run installs them)"
            );
            return;
        }
    }
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let d = Daemon::start(&["--listen", &listen]);
    for (name, shares) in [("gold", 3), ("bronze", 1)] {
        let body = json!({"name": name, "shares": shares}).to_string();
        let r = d.req("POST", "/v1/classes", Some(&body));
        assert_eq!(r.status, 201, "{}", r.text());
    }
    for (vm, class) in [("web", "gold"), ("batch", "bronze")] {
        let r = d.req("POST", "/v1/vms", Some(&spin_vm(vm, class, 1, 32, 60)));
        assert_eq!(r.status, 201, "{}", r.text());
    }
    // A VM reading its disk under a limit, for the disk table.
    let img = d.image_path("ui-disk.img");
    std::fs::write(&img, vec![0u8; 32 << 20]).expect("disk image");
    let io_vm = json!({
        "name": "reader", "class": "bronze", "vcpus": 1, "memory_mib": 32,
        "cmdline": "probe.mode=blk probe.op=read probe.bs=64K",
        "disks": [{"id": "data", "path": img.to_str().expect("utf-8 path"), "readonly": true,
                   "limits": {"bps": 2_000_000}}],
    });
    let r = d.req("POST", "/v1/vms", Some(&io_vm.to_string()));
    assert_eq!(r.status, 201, "{}", r.text());
    let profile = std::env::temp_dir().join(format!("corral-ui-profile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&profile);
    let b = Browser::start(&profile);
    let fragment = d.token().map(|t| format!("#token={t}")).unwrap_or_default();
    b.goto(&format!("http://{listen}/ui{fragment}"));
    let refreshed = wait_until(Duration::from_secs(30), || {
        let n = b.js("return Number(document.body.dataset.refreshes || 0);");
        (n.as_u64().unwrap_or(0) >= 3).then_some(())
    });
    let conn = b.js("return document.getElementById('conn').textContent;");
    assert!(
        refreshed.is_some(),
        "the page did not refresh from the API: {conn}"
    );
    // The token left the address bar once read.
    let url = b.cmd("GET", "url", None);
    assert!(!url.as_str().unwrap_or("").contains("token="), "{url}");

    // Classes and VMs as the API has them.
    let classes = d.req("GET", "/v1/classes", None).json();
    for c in classes.as_array().expect("classes") {
        let name = c["name"].as_str().expect("name");
        assert_eq!(
            shown(&b, "classes", "class", name, "shares"),
            Some(c["shares"].to_string()),
            "{name}"
        );
        assert_eq!(
            shown(&b, "classes", "class", name, "vms"),
            Some(c["vms"].as_array().map_or(0, Vec::len).to_string()),
            "{name}"
        );
    }
    let vms = d.req("GET", "/v1/vms", None).json();
    for v in vms.as_array().expect("vms") {
        let name = v["name"].as_str().expect("name");
        assert_eq!(
            shown(&b, "vms", "vm", name, "class").as_deref(),
            v["class"].as_str(),
            "{name}"
        );
        assert_eq!(
            shown(&b, "vms", "vm", name, "vcpus"),
            Some(v["vcpus"].to_string())
        );
    }
    // The disk's limit as the API has it, and a rate at or under it.
    assert_eq!(
        shown(&b, "disks", "disk", "reader/data", "limit-mbps").as_deref(),
        Some("2.00")
    );
    let rate = wait_until(Duration::from_secs(10), || {
        shown(&b, "disks", "disk", "reader/data", "mbps")?
            .parse::<f64>()
            .ok()
            .filter(|r| *r > 0.0)
    });
    assert!(
        rate.is_some_and(|r| r <= 2.0 * 1.1),
        "disk rate shown: {rate:?}"
    );
    // The share promise of the two running classes: 3:1.
    assert_eq!(
        shown(&b, "classes", "class", "gold", "promise").as_deref(),
        Some("75.0 %")
    );
    assert_eq!(
        shown(&b, "classes", "class", "bronze", "promise").as_deref(),
        Some("25.0 %")
    );

    // Change gold's shares through the page's form.
    b.click("button[data-edit-class=\"gold\"]");
    b.js(
        "const f = document.getElementById('edit-class-form'); f.shares.value = '5'; return null;",
    );
    b.click("#edit-class-save");
    let changed = wait_until(Duration::from_secs(10), || {
        let c = d.req("GET", "/v1/classes/gold", None).json();
        (c["shares"] == 5).then_some(())
    });
    let err = b.js("return document.getElementById('edit-class-error').textContent;");
    assert!(
        changed.is_some(),
        "the page's edit did not reach the API: {err}"
    );
    let shown_now = wait_until(Duration::from_secs(10), || {
        (shown(&b, "classes", "class", "gold", "shares").as_deref() == Some("5")).then_some(())
    });
    assert!(shown_now.is_some(), "the page does not show the new shares");

    // A few seconds of history in the chart, then the screenshot.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(200));
    }
    let png = artifacts_dir().join("dashboard.png");
    b.screenshot(&png);
    let len = std::fs::metadata(&png).map(|m| m.len()).unwrap_or(0);
    assert!(len > 10_000, "screenshot is {len} bytes");
    println!("dashboard screenshot: {}", png.display());
    drop(b);
    let _ = std::fs::remove_dir_all(&profile);
}
