//! Helpers for corral's end-to-end tests: find the `corral` binary, run it,
//! read what the guest printed.

pub mod api;
pub mod vms;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// The `corral` binary next to the test executable (target/<profile>/corral).
/// The README's test command builds it first.
pub fn corral_bin() -> PathBuf {
    if let Ok(p) = std::env::var("CORRAL_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> or target/<profile>/<bin> -> target/<profile>/corral
    let dir = exe.parent().expect("executable has a directory");
    let dir = if dir.ends_with("deps") {
        dir.parent().expect("deps has a parent")
    } else {
        dir
    };
    let bin = dir.join("corral");
    assert!(
        bin.exists(),
        "{} not found: build it first with `cargo build -p corral-api` (the README's test command does)",
        bin.display()
    );
    bin
}

/// Runs `corral` with `args` to completion (with a timeout), capturing output.
pub fn run_corral(args: &[&str], timeout: Duration) -> Output {
    let mut child = Command::new(corral_bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn corral");
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let to = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let te = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("corral {args:?} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Output {
        status,
        stdout: to.join().unwrap_or_default(),
        stderr: te.join().unwrap_or_default(),
    }
}

/// A running `corral` whose stdout is read line by line.
pub struct Running {
    /// The process.
    pub child: Child,
    lines: mpsc::Receiver<String>,
    /// Every line seen so far.
    pub seen: Vec<String>,
}

impl Running {
    /// Starts `corral` with `args`.
    pub fn start(args: &[&str]) -> Self {
        let mut child = Command::new(corral_bin())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn corral");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).split(b'\n') {
                let Ok(line) = line else { break };
                if tx
                    .send(String::from_utf8_lossy(&line).into_owned())
                    .is_err()
                {
                    break;
                }
            }
        });
        Self {
            child,
            lines: rx,
            seen: Vec::new(),
        }
    }

    /// Waits for a line containing `needle`; returns it, or None on timeout/EOF.
    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    let hit = l.contains(needle);
                    self.seen.push(l.clone());
                    if hit {
                        return Some(l);
                    }
                }
                Err(_) => return None,
            }
        }
    }

    /// Sends a signal to the process.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether this host's KVM is kvm_pvm (nested, software-assisted): stock
/// Linux kernels only reach their early boot messages here.
pub fn host_is_pvm() -> bool {
    Path::new("/sys/module/kvm_pvm").exists()
}

/// Builds (or takes from cache) the Debian guest; returns (kernel, initrd, disk).
pub fn linux_guest() -> (PathBuf, PathBuf, PathBuf) {
    let script = workspace_root().join("guest-images/linux/build.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .expect("run guest-images/linux/build.sh");
    assert!(
        out.status.success(),
        "guest-images/linux/build.sh failed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let get = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .map(PathBuf::from)
            .unwrap_or_else(|| panic!("build.sh printed no {k}=: {text}"))
    };
    (get("KERNEL"), get("INITRD"), get("DISK"))
}

/// Text of an output's stdout and stderr.
pub fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}
