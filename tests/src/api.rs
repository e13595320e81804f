//! Helpers for the REST API tests: start `corral serve` on a private socket
//! (and state directory), and a minimal blocking HTTP/1.1 client over the
//! Unix socket or TCP with the daemon's token (keep-alive, Content-Length
//! and chunked bodies).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `corral serve` process on a private socket; killed (SIGTERM, then
/// SIGKILL) when dropped.
pub struct Daemon {
    /// The process.
    pub child: Child,
    /// Its socket.
    pub socket: PathBuf,
    /// Its TCP address, with `--listen`.
    pub tcp: Option<std::net::SocketAddr>,
    /// Its bearer token file, with `--listen`.
    pub token_file: Option<PathBuf>,
    /// Its private directory (socket, state directory, token).
    pub dir: PathBuf,
    /// Its state directory.
    pub state_dir: PathBuf,
}

/// In [`Daemon::start`]'s arguments: the daemon's VMs outlive it (no
/// `--shutdown-vms-on-exit`); the test stops them (or a later daemon on
/// the same state directory does; [`kill_vm_processes`] is the last resort).
pub const KEEP_VMS: &str = "--test-keep-vms";

/// SIGKILLs every `corral vmm` process whose control socket is in
/// `state_dir` (VMs a test left running).
pub fn kill_vm_processes(state_dir: &Path) -> usize {
    let needle = state_dir.join("vms");
    let needle = needle.to_string_lossy();
    let mut n = 0;
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains(" vmm ") && cmd.contains(&*needle) {
            // SAFETY: kill(2) of a process we identified by its command line.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
            n += 1;
        }
    }
    n
}

impl Daemon {
    /// Starts a daemon with extra `serve` arguments and waits until its
    /// socket answers.
    pub fn start(extra: &[&str]) -> Self {
        Self::start_full(extra, &[], None)
    }

    /// [`Daemon::start`] with extra environment variables.
    pub fn start_with_env(extra: &[&str], env: &[(&str, &str)]) -> Self {
        Self::start_full(extra, env, None)
    }

    /// [`Daemon::start`], with the daemon's open-file limit (soft and hard)
    /// set to `fd_limit`.
    pub fn start_with(extra: &[&str], fd_limit: Option<u64>) -> Self {
        Self::start_full(extra, &[], fd_limit)
    }

    fn start_full(extra: &[&str], env: &[(&str, &str)], fd_limit: Option<u64>) -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("corral-api-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let socket = dir.join("corral.sock");
        let state = dir.join("state");
        let mut args = vec!["serve", "--socket", socket.to_str().expect("utf-8 path")];
        // A test that restarts a daemon on one state directory names it.
        if !extra.contains(&"--state-dir") {
            args.extend(["--state-dir", state.to_str().expect("utf-8 path")]);
        }
        // The tests' kernels and disks live in the temp dir and the guest
        // image caches: those are the image directories unless a test
        // names its own.
        let images = crate::workspace_root().join("guest-images");
        let tmp = std::env::temp_dir();
        if !extra.contains(&"--image-dir") {
            for d in [&tmp, &images] {
                args.extend(["--image-dir", d.to_str().expect("utf-8 path")]);
            }
        }
        // A test daemon stops its VMs when it exits, unless the test keeps
        // them for the next daemon (kill -9 never stops them).
        if extra.contains(&KEEP_VMS) {
            args.extend(extra.iter().filter(|a| **a != KEEP_VMS));
        } else {
            args.push("--shutdown-vms-on-exit");
            args.extend_from_slice(extra);
        }
        let state_dir = args
            .iter()
            .position(|a| *a == "--state-dir")
            .and_then(|i| args.get(i + 1))
            .map(PathBuf::from)
            .unwrap_or_else(|| state.clone());
        let mut cmd = Command::new(crate::corral_bin());
        cmd.args(&args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(n) = fd_limit {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit(2) is async-signal-safe; the closure touches
            // nothing but its own copy of `n`.
            unsafe {
                cmd.pre_exec(move || {
                    let r = libc::rlimit {
                        rlim_cur: n,
                        rlim_max: n,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn().expect("spawn corral serve");
        // The first line names the TCP address and the token file.
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(out);
            let mut line = String::new();
            let _ = r.read_line(&mut line);
            let _ = tx.send(line);
            let _ = std::io::copy(&mut r, &mut std::io::sink());
        });
        let line = rx.recv_timeout(Duration::from_secs(20)).unwrap_or_default();
        let tcp = line
            .split("http://")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|a| a.parse().ok());
        let token_file = line
            .split("(token in ")
            .nth(1)
            .and_then(|s| s.trim_end().strip_suffix(')'))
            .map(PathBuf::from);
        let d = Daemon {
            child,
            socket,
            tcp,
            token_file,
            dir,
            state_dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while UnixStream::connect(&d.socket).is_err() {
            assert!(Instant::now() < deadline, "corral serve did not come up");
            std::thread::sleep(Duration::from_millis(10));
        }
        d
    }

    /// The daemon's bearer token for TCP clients, if it wrote one (with
    /// `--listen`: to its token file, by default beside its socket).
    pub fn token(&self) -> Option<String> {
        let p = self
            .token_file
            .clone()
            .unwrap_or_else(|| self.dir.join("token"));
        std::fs::read_to_string(p)
            .ok()
            .map(|t| t.trim().to_string())
    }

    /// A path for a test's image file where this daemon may open it.
    pub fn image_path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// A new TCP connection that sends the token.
    pub fn tcp_conn(&self) -> Conn {
        let mut c = Conn::tcp(self.tcp.expect("the daemon has no TCP listener"));
        let token = self.token().expect("the daemon wrote no token");
        c.headers.push(format!("Authorization: Bearer {token}"));
        c
    }

    /// One request over TCP with the token, on a fresh connection.
    pub fn tcp_req(&self, method: &str, path: &str, body: Option<&str>) -> Resp {
        self.tcp_conn().req(method, path, body)
    }

    /// A new connection.
    pub fn conn(&self) -> Conn {
        Conn::new(&self.socket)
    }

    /// One request on a fresh connection.
    pub fn req(&self, method: &str, path: &str, body: Option<&str>) -> Resp {
        self.conn().req(method, path, body)
    }

    /// Sends SIGTERM and waits for the exit (up to `timeout`); returns the
    /// exit status, or None if it had to be killed.
    pub fn terminate(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        // SAFETY: kill(2) on our own child.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // A daemon the test killed itself (kill -9) leaves its VMs to the
        // next daemon on its state directory; one still running here is
        // stopped, and whatever VM processes it left with it.
        if let Ok(None) = self.child.try_wait() {
            self.terminate(Duration::from_secs(10));
            kill_vm_processes(&self.state_dir);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A response.
#[derive(Debug, Clone)]
pub struct Resp {
    /// Status code.
    pub status: u16,
    /// Headers, names lower-case.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: Vec<u8>,
}

impl Resp {
    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON (panics with the body if it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    /// A header.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Asserts the API error shape and code; returns the message.
    pub fn assert_error(&self, status: u16, code: &str) -> String {
        assert_eq!(self.status, status, "status; body: {}", self.text());
        let j = self.json();
        assert_eq!(j["error"]["code"].as_str(), Some(code), "error code in {j}");
        let msg = j["error"]["message"]
            .as_str()
            .unwrap_or_else(|| panic!("no error.message in {j}"));
        assert!(!msg.is_empty());
        msg.to_string()
    }
}

/// Called with each chunk of a streamed body; false stops reading.
pub type OnChunk<'a> = dyn FnMut(&[u8]) -> bool + 'a;

/// One keep-alive HTTP/1.1 connection over the Unix socket or TCP.
pub struct Conn {
    r: BufReader<Box<dyn Read + Send>>,
    w: Box<dyn Write + Send>,
    /// The Host header sent.
    pub host: String,
    /// Extra header lines sent with every request (`Name: value`).
    pub headers: Vec<String>,
}

impl Conn {
    /// Connects to a Unix socket.
    pub fn new(socket: &Path) -> Self {
        let s = UnixStream::connect(socket).expect("connect to corral");
        s.set_read_timeout(Some(Duration::from_secs(60))).ok();
        let w = s.try_clone().expect("clone stream");
        Conn {
            r: BufReader::new(Box::new(s)),
            w: Box::new(w),
            host: "localhost".into(),
            headers: Vec::new(),
        }
    }

    /// Connects over TCP (no token: see [`Daemon::tcp_conn`]).
    pub fn tcp(addr: std::net::SocketAddr) -> Self {
        let s = TcpStream::connect(addr).expect("connect to corral over TCP");
        s.set_read_timeout(Some(Duration::from_secs(60))).ok();
        let w = s.try_clone().expect("clone stream");
        Conn {
            r: BufReader::new(Box::new(s)),
            w: Box::new(w),
            host: addr.to_string(),
            headers: Vec::new(),
        }
    }

    /// Writes raw bytes.
    pub fn write_raw(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.w.write_all(b)
    }

    /// One read of what has arrived (0 at EOF or on an error).
    pub fn read_some(&mut self, buf: &mut [u8]) -> usize {
        self.r.read(buf).unwrap_or(0)
    }

    /// Reads until EOF or error (for a connection the daemon is expected to
    /// close); returns what came.
    pub fn read_to_end(&mut self) -> std::io::Result<Vec<u8>> {
        let mut v = Vec::new();
        self.r.read_to_end(&mut v).map(|_| v)
    }

    /// Sends a request and reads the whole response.
    pub fn req(&mut self, method: &str, path: &str, body: Option<&str>) -> Resp {
        self.send(method, path, body);
        self.read_response(None)
    }

    /// Sends a request.
    pub fn send(&mut self, method: &str, path: &str, body: Option<&str>) {
        self.send_with(method, path, &[], body);
    }

    /// Sends a request with extra headers (besides [`Conn::headers`]).
    pub fn send_with(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&str>,
    ) {
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\n", self.host);
        for h in &self.headers {
            head += &format!("{h}\r\n");
        }
        for (k, v) in headers {
            head += &format!("{k}: {v}\r\n");
        }
        if let Some(b) = body {
            head += &format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            );
        }
        head += "\r\n";
        self.w.write_all(head.as_bytes()).expect("write request");
        if let Some(b) = body {
            self.w.write_all(b.as_bytes()).expect("write body");
        }
    }

    /// Reads a response. With `on_chunk`, each chunk of a chunked body is
    /// passed to it as it arrives; returning false stops reading (the
    /// connection is then unusable).
    pub fn read_response(&mut self, mut on_chunk: Option<&mut OnChunk<'_>>) -> Resp {
        let mut line = String::new();
        self.r.read_line(&mut line).expect("status line");
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {line:?}"));
        let mut headers = Vec::new();
        loop {
            let mut h = String::new();
            self.r.read_line(&mut h).expect("header");
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
            }
        }
        let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
        let mut body = Vec::new();
        if status == 204 || status == 304 || (100..200).contains(&status) {
            // No body.
        } else if get("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
            loop {
                let mut sz = String::new();
                self.r.read_line(&mut sz).expect("chunk size");
                let n = usize::from_str_radix(sz.trim().split(';').next().unwrap_or(""), 16)
                    .unwrap_or_else(|_| panic!("bad chunk size {sz:?}"));
                let mut chunk = vec![0; n + 2];
                self.r.read_exact(&mut chunk).expect("chunk");
                chunk.truncate(n);
                if n == 0 {
                    break;
                }
                if let Some(f) = on_chunk.as_mut()
                    && !f(&chunk)
                {
                    body.extend_from_slice(&chunk);
                    return Resp {
                        status,
                        headers,
                        body,
                    };
                }
                body.extend_from_slice(&chunk);
            }
        } else if let Some(n) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
            body.resize(n, 0);
            self.r.read_exact(&mut body).expect("body");
        } else {
            self.r.read_to_end(&mut body).expect("body");
        }
        Resp {
            status,
            headers,
            body,
        }
    }
}

/// A probe VM body: `vcpus` spinning for `secs` seconds.
pub fn spin_vm(name: &str, class: &str, vcpus: u32, memory_mib: u64, secs: u32) -> String {
    serde_json::json!({
        "name": name,
        "class": class,
        "vcpus": vcpus,
        "memory_mib": memory_mib,
        "cmdline": format!("probe.mode=spin probe.secs={secs} probe.interval_ms=500"),
    })
    .to_string()
}

/// Polls `f` until it returns Some, up to `timeout`.
pub fn wait_until<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Percentile (0..=100) of sorted durations.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}
