//! The shared scheduler gate through `corral serve` (issue 15): a VM
//! process is parked by the daemon's scheduler thread on a word in memory
//! both map, kicked by host tid, with no relay thread in the daemon; when
//! the daemon dies (kill -9) a parked VM process opens its gate itself and
//! runs free, unsupervised; a daemon that re-adopts it owns the gate again
//! and caps it.
//!
//! CPU rates come from the kernel's clock of the VM process, beside the
//! API's `cpu_seconds`; the free-running rate is compared with a busy loop
//! measured in the same window (the host is shared and loaded), and the
//! bounds are generous: a cap of 30 % against at most 40 %. On a loaded
//! host a free thread may get little more than a 10 % cap, so whether the
//! VM is held is read off its spinning vCPU thread's state as well: a
//! parked one sleeps on the gate, a free one is always runnable, whatever
//! CPU the host gives it.

use std::path::Path;
use std::time::{Duration, Instant};

use corral_tests::api::{Daemon, wait_until};
use corral_vmm::vmgate::process_cpu_ns;
use corral_vmm::vmproc::proto::{FromVm, Request, Response, Status, ToVm};
use corral_vmm::vmproc::{adopt, wire};
use serde_json::{Value, json};

/// One test at a time: each measures CPU rates.
static HOST: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn get(d: &Daemon, path: &str) -> Value {
    let r = d.req("GET", path, None);
    assert_eq!(r.status, 200, "GET {path}: {}", r.text());
    r.json()
}

/// A class `name` with a cap of `cap` %, and one 1-vCPU spinning VM `vm`
/// in it; waits until the guest spins.
fn capped_spinner(d: &Daemon, class: &str, cap: u32, vm: &str) {
    let body = json!({"name": class, "shares": 100, "cap": cap}).to_string();
    let r = d.req("POST", "/v1/classes", Some(&body));
    assert_eq!(r.status, 201, "{}", r.text());
    let body = json!({"name": vm, "class": class, "vcpus": 1, "memory_mib": 16,
        "cmdline": "probe.mode=spin probe.secs=120 probe.interval_ms=500"});
    let r = d.req("POST", "/v1/vms", Some(&body.to_string()));
    assert_eq!(r.status, 201, "{}", r.text());
    let spun = wait_until(Duration::from_secs(20), || {
        let v = get(d, &format!("/v1/vms/{vm}"));
        (v["cpu_seconds"].as_f64().unwrap_or(0.0) > 0.05).then_some(())
    });
    assert!(spun.is_some(), "the guest does not spin");
}

/// VM `name`'s process as the host sees it (found by its command line,
/// which names its control socket in `state_dir`; with a pid namespace
/// the process that runs the VM is the outer one's child).
fn vm_view(state_dir: &Path, name: &str) -> corral_vmm::jail::HostView {
    let sock = adopt::control_socket(state_dir, name);
    let sock = sock.to_string_lossy();
    let found = std::fs::read_dir("/proc")
        .ok()
        .into_iter()
        .flatten()
        .flatten()
        .find_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            (cmd.contains(" vmm ") && cmd.contains(&format!("{sock} "))).then_some(pid)
        });
    let pid = found.unwrap_or_else(|| panic!("VM {name} runs in no process of its own"));
    corral_vmm::jail::host_view(pid).expect("the VM process's host view")
}

/// The host pid of VM `name`'s process.
fn vm_pid(state_dir: &Path, name: &str) -> i32 {
    vm_view(state_dir, name).pid as i32
}

/// The names of the threads of process `pid`.
fn threads(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("the daemon's threads")
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect()
}

/// A daemon in process mode holds no relay thread: the gate is shared.
fn assert_no_relay(d: &Daemon) {
    let names = threads(d.child.id());
    assert!(
        names.iter().any(|n| n.starts_with("vmproc-")),
        "no VM process reader thread: not in process mode? {names:?}"
    );
    assert!(
        !names.iter().any(|n| n.starts_with("relay-")),
        "a relay thread carries the gate: {names:?}"
    );
}

/// Percent of one CPU that process `pid` used over `window` (the
/// kernel's clock of the whole process).
fn cpu_pct(pid: i32, window: Duration) -> f64 {
    let c0 = process_cpu_ns(pid).expect("the VM process's CPU clock");
    let t0 = Instant::now();
    std::thread::sleep(window);
    let c1 = process_cpu_ns(pid).expect("the VM process's CPU clock");
    (c1 - c0) as f64 / t0.elapsed().as_nanos() as f64 * 100.0
}

/// The fraction of `window` that thread `tid` of `pid` was runnable
/// (state `R` in its `/proc` stat, sampled every 5 ms).
fn runnable_fraction(pid: i32, tid: i32, window: Duration) -> f64 {
    let path = format!("/proc/{pid}/task/{tid}/stat");
    let (mut n, mut r) = (0u32, 0u32);
    let t0 = Instant::now();
    while t0.elapsed() < window {
        let st = std::fs::read_to_string(&path).expect("the vCPU thread's stat");
        // `pid (comm) S ...`: the state follows the last ')'.
        let state = st
            .rsplit(')')
            .next()
            .and_then(|x| x.split_whitespace().next());
        n += 1;
        r += u32::from(state == Some("R"));
        std::thread::sleep(Duration::from_millis(5));
    }
    f64::from(r) / f64::from(n.max(1))
}

/// A busy loop beside `f`: what a free-running thread gets on this host
/// right now, percent of one CPU.
fn beside_a_loop<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let mut spin = std::process::Command::new("sh")
        .args(["-c", "while :; do :; done"])
        .spawn()
        .expect("sh");
    let pid = spin.id() as i32;
    let c0 = process_cpu_ns(pid).unwrap_or(0);
    let t0 = Instant::now();
    let out = f();
    let c1 = process_cpu_ns(pid).unwrap_or(0);
    let pct = c1.saturating_sub(c0) as f64 / t0.elapsed().as_nanos() as f64 * 100.0;
    let _ = spin.kill();
    let _ = spin.wait();
    (out, pct)
}

/// Asks a VM process for its status on its control socket, as a daemon.
fn status_on_socket(path: &Path) -> Status {
    let s = adopt::connect(path).expect("connect to the VM's control socket");
    let req = ToVm {
        id: 9,
        req: Request::Status,
    };
    wire::send(&s, &req, &[]).expect("send");
    loop {
        if let (
            FromVm::Reply {
                id: 9,
                resp: Response::Status(st),
            },
            _,
        ) = wire::recv::<FromVm>(&s).expect("recv").expect("an answer")
        {
            return st;
        }
    }
}

#[test]
fn a_capped_vm_process_is_held_by_the_shared_gate_without_a_relay_thread() {
    let _g = HOST.lock().unwrap_or_else(|p| p.into_inner());
    let d = Daemon::start(&[]);
    capped_spinner(&d, "capped", 30, "c");
    let pid = vm_pid(&d.state_dir, "c");
    // Let the credit the VM had at the start run out.
    std::thread::sleep(Duration::from_millis(1500));
    let api = || get(&d, "/v1/vms/c")["cpu_seconds"].as_f64().unwrap();
    let (a0, t0) = (api(), Instant::now());
    let kernel = cpu_pct(pid, Duration::from_secs(3));
    let from_api = (api() - a0) / t0.elapsed().as_secs_f64() * 100.0;
    let v = get(&d, "/v1/vms/c");
    eprintln!(
        "cap 30 %: API {from_api:.1} %, kernel {kernel:.1} %, parked {} times",
        v["sched"]["park_count"]
    );
    assert!(from_api <= 40.0, "API: {from_api:.1} % with a 30 % cap");
    assert!(kernel <= 40.0, "kernel: {kernel:.1} % with a 30 % cap");
    assert!(from_api > 3.0, "the capped VM hardly runs: {from_api:.1} %");
    assert!(v["sched"]["park_count"].as_u64().unwrap_or(0) > 0, "{v}");
    assert_no_relay(&d);
}

#[test]
fn a_vm_parked_when_its_daemon_dies_runs_free_and_is_capped_again_once_readopted() {
    let _g = HOST.lock().unwrap_or_else(|p| p.into_inner());
    let dir = std::env::temp_dir().join(format!("corral-gate-serve-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let sd = dir.to_str().unwrap();
    let mut d = Daemon::start(&["--state-dir", sd]);
    capped_spinner(&d, "small", 10, "p");
    let view = vm_view(&dir, "p");
    let pid = view.pid as i32;
    let sock = adopt::control_socket(&dir, "p");
    // The tid it reports is its pid namespace's.
    let ns_tid = status_on_socket(&sock).vcpu_tids[0] as u32;
    let vcpu = view.host_tid(ns_tid).expect("the vCPU thread's host tid") as i32;
    std::thread::sleep(Duration::from_millis(1000));
    let capped = cpu_pct(pid, Duration::from_secs(2));
    let capped_r = runnable_fraction(pid, vcpu, Duration::from_secs(1));
    // kill -9 while the gate is parked (most of the time under a 10 % cap).
    let parked = wait_until(Duration::from_secs(10), || {
        get(&d, "/v1/vms/p")["sched"]["parked"]
            .as_bool()
            .unwrap_or(false)
            .then_some(())
    });
    assert!(parked.is_some(), "never parked under a 10 % cap");
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    drop(d);

    // It opens its own gate and says it is unsupervised.
    let st = wait_until(Duration::from_secs(5), || {
        let st = status_on_socket(&sock);
        st.unsupervised.then_some(st)
    })
    .expect("the VM process reports that it is unsupervised");
    assert!(!st.parked, "unsupervised, yet parked: {st:?}");
    let free_r = runnable_fraction(pid, vcpu, Duration::from_secs(1));
    let (free, busy_loop) = beside_a_loop(|| cpu_pct(pid, Duration::from_secs(2)));
    eprintln!(
        "cap 10 %: capped {capped:.1} % (vCPU runnable {:.0} % of the time); daemon killed: \
         {free:.1} % beside a loop's {busy_loop:.1} % (runnable {:.0} %)",
        capped_r * 100.0,
        free_r * 100.0
    );
    assert!(capped <= 20.0, "capped at 10 %, used {capped:.1} %");
    assert!(capped_r <= 0.5, "capped at 10 %, runnable {capped_r:.2}");
    assert!(
        free_r >= 0.8,
        "without its daemon the vCPU should never wait: runnable {free_r:.2}"
    );
    assert!(
        free >= 0.5 * busy_loop,
        "without its daemon the VM should run free: {free:.1} % beside a loop's {busy_loop:.1} %"
    );

    // A new daemon re-adopts it and owns its gate: capped again.
    let d = Daemon::start(&["--state-dir", sd]);
    assert_eq!(get(&d, "/v1/vms/p")["state"], "running");
    assert!(
        !status_on_socket(&sock).unsupervised,
        "adopted, yet unsupervised"
    );
    std::thread::sleep(Duration::from_millis(1000));
    let again = cpu_pct(pid, Duration::from_secs(2));
    let again_r = runnable_fraction(pid, vcpu, Duration::from_secs(1));
    eprintln!(
        "re-adopted: {again:.1} % (runnable {:.0} %; free {free:.1} %)",
        again_r * 100.0
    );
    assert!(
        again <= 20.0,
        "re-adopted under a 10 % cap, used {again:.1} %"
    );
    assert!(
        again_r <= 0.5,
        "re-adopted under a 10 % cap, runnable {again_r:.2}"
    );
    assert_no_relay(&d);
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}
