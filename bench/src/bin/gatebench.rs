//! The cross-process gate: the two ways a park reaches the vCPU threads of a
//! VM process, side by side, and the cost of reading a VM's CPU time.
//!
//! ```sh
//! cargo build -p corral-bench --bin gatebench
//! target/x86_64-unknown-linux-gnu/debug/gatebench [--vcpus 2] [--rounds 40] [--blocks 5]
//! ```
//!
//! The "daemon" (this process) owns a shared gate; a "VM process" (this
//! binary re-run with the gate's memfd) runs `--vcpus` simulated vCPUs:
//! threads that spin without looking at the gate (like a guest inside
//! `KVM_RUN`) until the kick signal's handler sets their flag (as it sets
//! `immediate_exit`), then wait on the gate. Modes, in alternating blocks
//! of `--rounds` parks each:
//!
//! * `signal`: the daemon's park calls `tgkill(pid, tid, SIGRTMIN+1)` for
//!   each vCPU thread ([`corral_vmm::vmgate::signal_kick`]);
//! * `watcher`: the VM process's watcher thread wakes on the futex word
//!   and signals its own vCPU threads.
//!
//! Per park: the latency from the park to the last vCPU blocked on the
//! gate (off the CPU), the daemon's CPU time in `park()`, and the CPU time
//! of the VM process's watcher thread (its wake-ups for parks and unparks;
//! the signal handling on the vCPU threads is the same in both modes). Then: the
//! daemon's cost of one VM's CPU-time sample, per-thread clocks versus the
//! process clock plus the page.

use std::io::{BufRead, BufReader, Lines};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use corral_scheduler::Gate;
use corral_vmm::cpusched::{own_thread_cpu_ns, thread_cpu_ns};
use corral_vmm::vmgate::{ThreadRunTime, process_cpu_ns, signal_kick};

const PEER: &str = "CORRAL_GATEBENCH_PEER";
const FD: &str = "CORRAL_GATEBENCH_FD";

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn kick_signal() -> i32 {
    libc::SIGRTMIN() + 1
}

fn main() {
    if let Ok(mode) = std::env::var(PEER) {
        peer(&mode, arg("--vcpus", 2));
        return;
    }
    let vcpus = arg("--vcpus", 2);
    let rounds = arg("--rounds", 40);
    let blocks = arg("--blocks", 5);
    let modes = [Mode::InProcess, Mode::Signal, Mode::Watcher];
    let mut res = [Stats::default(), Stats::default(), Stats::default()];
    let mut sample_cost = (Vec::new(), Vec::new(), Vec::new());
    for b in 0..blocks {
        for k in 0..modes.len() {
            // Rotate which mode goes first in a block.
            let i = (k + b) % modes.len();
            run_block(modes[i], vcpus, rounds, &mut res[i], &mut sample_cost);
        }
    }
    println!("gatebench: {vcpus} simulated vCPUs, {blocks} blocks x {rounds} parks per mode");
    for (m, s) in modes.iter().zip(&mut res) {
        s.lat.sort_unstable();
        s.park_cpu.sort_unstable();
        println!(
            "{:10} park->off median {:7.1} us  p90 {:8.1} us  max {:8.1} us | daemon CPU per park median {:5.2} us | watcher CPU per park {:5.2} us | missed {}",
            m.name(),
            pct(&s.lat, 50) / 1e3,
            pct(&s.lat, 90) / 1e3,
            s.lat.last().copied().unwrap_or(0) as f64 / 1e3,
            pct(&s.park_cpu, 50) / 1e3,
            s.other_cpu as f64 / s.parks.max(1) as f64 / 1e3,
            s.missed,
        );
    }
    let cpu = |s: &Stats| pct(&s.park_cpu, 50) + s.other_cpu as f64 / s.parks.max(1) as f64;
    let [today, sig, wat] = &res;
    for (name, a, b) in [
        ("signal/in-process", sig, today),
        ("watcher/in-process", wat, today),
        ("watcher/signal", wat, sig),
    ] {
        println!(
            "ratio {name:18}: latency median {:.2}x, p90 {:.2}x; CPU per park (daemon + watcher) {:.2}x",
            pct(&a.lat, 50) / pct(&b.lat, 50).max(1.0),
            pct(&a.lat, 90) / pct(&b.lat, 90).max(1.0),
            cpu(a) / cpu(b).max(1.0)
        );
    }
    let (mut clocks, mut schedstat, mut process) = sample_cost;
    clocks.sort_unstable();
    schedstat.sort_unstable();
    process.sort_unstable();
    println!(
        "CPU-time sample of one {vcpus}-vCPU VM (daemon side): thread clocks in-process {:.2} us; VM process: schedstat pread per vCPU {:.2} us, process clock + page {:.2} us",
        pct(&clocks, 50) / 1e3,
        pct(&schedstat, 50) / 1e3,
        pct(&process, 50) / 1e3,
    );
    publisher_cost(vcpus);
}

/// The VM side of the page: what `spawn_cpu_publisher` costs, every 10 ms
/// with `vcpus` thread clocks (the process clock's growth over 1 s while
/// every other thread here sleeps).
fn publisher_cost(vcpus: usize) {
    let gate = Arc::new(Gate::new());
    // SAFETY: gettid and getpid have no preconditions.
    let (me, pid) = unsafe { (libc::gettid(), libc::getpid()) };
    let p = corral_vmm::vmgate::spawn_cpu_publisher(
        gate.clone(),
        vec![me; vcpus],
        Duration::from_millis(10),
        "publisher",
    )
    .expect("publisher");
    std::thread::sleep(Duration::from_millis(50));
    let (c0, t0) = (process_cpu_ns(pid).unwrap_or(0), Instant::now());
    let (_, s0) = gate.read_cpu(&mut []);
    std::thread::sleep(Duration::from_secs(1));
    let (c1, el) = (process_cpu_ns(pid).unwrap_or(0), t0.elapsed());
    let (_, s1) = gate.read_cpu(&mut []);
    gate.shutdown();
    let _ = p.join();
    let n = (s1 - s0).max(1);
    println!(
        "publisher (VM side, {vcpus} vCPU clocks every 10 ms): {:.2} us per publication, {:.3} % of a CPU ({n} publications)",
        (c1 - c0) as f64 / n as f64 / 1e3,
        (c1 - c0) as f64 * 100.0 / el.as_nanos() as f64
    );
}

/// Where the vCPUs run and who kicks them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Today: vCPU threads in the daemon's process, `pthread_kill` from
    /// the park (`Gate::new`).
    InProcess,
    /// A VM process; the daemon's park signals its vCPU threads by tid.
    Signal,
    /// A VM process; its watcher thread kicks its vCPU threads.
    Watcher,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::InProcess => "in-process",
            Mode::Signal => "signal",
            Mode::Watcher => "watcher",
        }
    }
}

#[derive(Default)]
struct Stats {
    lat: Vec<u64>,
    park_cpu: Vec<u64>,
    other_cpu: u64,
    parks: u64,
    missed: u64,
}

fn pct(v: &[u64], p: usize) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v[(v.len() - 1) * p / 100] as f64
}

/// The simulated VM: a child process, or threads of this one.
struct Peer {
    child: Option<Child>,
    lines: Box<dyn Iterator<Item = String>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// In-process: the watcher CPU figure (none: stays 0).
    tids: Vec<i32>,
}

impl Peer {
    fn line(&mut self) -> String {
        match self.lines.next() {
            Some(l) => l,
            None => panic!("the simulated VM ended"),
        }
    }

    fn process(gate_fd: &OwnedFd, mode: Mode, vcpus: usize) -> Peer {
        let inherit = rustix_dup(gate_fd);
        let mut child = Command::new(std::env::current_exe().expect("own path"))
            .env(PEER, mode.name())
            .env(FD, inherit.as_raw_fd().to_string())
            .args(["--vcpus", &vcpus.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .expect("VM process");
        drop(inherit);
        let out: ChildStdout = child.stdout.take().expect("stdout");
        let lines: Lines<BufReader<ChildStdout>> = BufReader::new(out).lines();
        let mut p = Peer {
            child: Some(child),
            lines: Box::new(lines.map_while(Result::ok)),
            threads: Vec::new(),
            tids: Vec::new(),
        };
        p.tids = p
            .line()
            .split_whitespace()
            .skip(1)
            .filter_map(|t| t.parse().ok())
            .collect();
        p
    }

    fn threads(gate: &Arc<Gate>, vcpus: usize) -> Peer {
        install_handler();
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let (idt, idr) = std::sync::mpsc::channel();
        let threads = (0..vcpus)
            .map(|_| {
                let (gate, tx, idt) = (gate.clone(), tx.clone(), idt.clone());
                std::thread::spawn(move || {
                    // SAFETY: gettid and pthread_self have no preconditions.
                    let _ = idt.send(unsafe { (libc::gettid(), libc::pthread_self() as usize) });
                    vcpu(&gate, &|l: &str| {
                        let _ = tx.send(l.to_string());
                    });
                })
            })
            .collect();
        let ids: Vec<(i32, usize)> = (0..vcpus).filter_map(|_| idr.recv().ok()).collect();
        let pts: Vec<usize> = ids.iter().map(|(_, p)| *p).collect();
        // Today's kick: the builder's `kick_all` (pthread_kill).
        gate.set_kick(move || {
            for p in &pts {
                // SAFETY: the threads live until the gate is shut down.
                unsafe { libc::pthread_kill(*p as libc::pthread_t, kick_signal()) };
            }
        });
        Peer {
            child: None,
            lines: Box::new(rx.into_iter()),
            threads,
            tids: ids.iter().map(|(t, _)| *t).collect(),
        }
    }
}

fn run_block(
    mode: Mode,
    vcpus: usize,
    rounds: usize,
    s: &mut Stats,
    cost: &mut (Vec<u64>, Vec<u64>, Vec<u64>),
) {
    let (gate, fd) = Gate::new_shared().expect("shared gate");
    let (gate, mut p) = if mode == Mode::InProcess {
        let g = Arc::new(Gate::new());
        let p = Peer::threads(&g, vcpus);
        (g, p)
    } else {
        let p = Peer::process(&fd, mode, vcpus);
        (gate, p)
    };
    let tids = p.tids.clone();
    // SAFETY: getpid has no preconditions.
    let pid = p
        .child
        .as_ref()
        .map_or(unsafe { libc::getpid() }, |c| c.id() as i32);
    if mode == Mode::Signal {
        gate.set_kick(signal_kick(pid, tids.clone()));
    }
    // Another process's threads: schedstat (thread clocks stay in-process).
    let runs: Vec<ThreadRunTime> = tids
        .iter()
        .filter_map(|t| ThreadRunTime::open(pid, *t).ok())
        .collect();
    for r in 0..rounds {
        std::thread::sleep(Duration::from_millis(3));
        let c0 = own_thread_cpu_ns();
        let t0 = monotonic_ns();
        gate.park();
        let c1 = own_thread_cpu_ns();
        let mut off = 0;
        for _ in 0..vcpus {
            let l = p.line();
            if std::env::var_os("GATEBENCH_DEBUG").is_some() {
                eprintln!("{mode:?}: {l}");
            }
            let mut it = l.split_whitespace();
            match (it.next(), it.next().and_then(|v| v.parse::<u64>().ok())) {
                (Some("off"), Some(t)) => off = off.max(t),
                _ => s.missed += 1,
            }
        }
        s.lat.push(off.saturating_sub(t0));
        s.park_cpu.push(c1 - c0);
        s.parks += 1;
        // The sampling cost, while the vCPUs are parked (quiet).
        let mut buf = vec![0u64; vcpus];
        let a = own_thread_cpu_ns();
        for _ in 0..100 {
            if mode == Mode::InProcess {
                for t in &tids {
                    std::hint::black_box(thread_cpu_ns(*t));
                }
            } else {
                for t in &runs {
                    std::hint::black_box(t.read_ns());
                }
            }
        }
        let b = own_thread_cpu_ns();
        for _ in 0..100 {
            std::hint::black_box(process_cpu_ns(pid));
            std::hint::black_box(gate.read_cpu(&mut buf));
        }
        let c = own_thread_cpu_ns();
        if mode == Mode::InProcess {
            cost.0.push((b - a) / 100);
        } else {
            cost.1.push((b - a) / 100);
            cost.2.push((c - b) / 100);
        }
        // The last park stays: the shutdown releases the waiting vCPUs.
        if r + 1 < rounds {
            gate.unpark();
            // Every vCPU runs again before the next park.
            for _ in 0..vcpus {
                if p.line() != "on" {
                    s.missed += 1;
                }
            }
        }
    }
    gate.shutdown();
    if let Some(mut c) = p.child.take() {
        let l = p.line();
        s.other_cpu += l
            .strip_prefix("other_cpu ")
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        let _ = c.wait();
    }
    for t in p.threads.drain(..) {
        let _ = t.join();
    }
}

fn rustix_dup(fd: &OwnedFd) -> OwnedFd {
    // SAFETY: dup of an fd we own; the new fd (close-on-exec cleared) is
    // owned by the returned OwnedFd.
    unsafe { OwnedFd::from_raw_fd(libc::dup(fd.as_raw_fd())) }
}

// ---- the VM process ----

thread_local! {
    static KICKED: AtomicBool = const { AtomicBool::new(false) };
}

extern "C" fn on_kick(_: libc::c_int) {
    KICKED.with(|k| k.store(true, Ordering::SeqCst));
}

fn install_handler() {
    // SAFETY: a zeroed sigaction with a handler that stores a const-init
    // thread-local atomic (async-signal-safe); no SA_RESTART.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_kick as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(kick_signal(), &sa, std::ptr::null_mut());
    }
}

fn peer(mode: &str, vcpus: usize) {
    install_handler();
    let n: i32 = std::env::var(FD)
        .ok()
        .and_then(|v| v.parse().ok())
        .expect("fd");
    // SAFETY: the daemon passed us this fd; nothing else owns it.
    let gate = Gate::from_fd(unsafe { OwnedFd::from_raw_fd(n) }).expect("gate");
    let out = Arc::new(Mutex::new(std::io::stdout()));
    let watcher_cpu = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (tx, rx) = std::sync::mpsc::channel();
    let threads: Vec<_> = (0..vcpus)
        .map(|_| {
            let (gate, out, tx) = (gate.clone(), out.clone(), tx.clone());
            std::thread::spawn(move || {
                // SAFETY: gettid and pthread_self have no preconditions.
                let _ = tx.send(unsafe { (libc::gettid(), libc::pthread_self() as usize) });
                vcpu(&gate, &|l: &str| {
                    use std::io::Write;
                    let mut o = out.lock().unwrap_or_else(|e| e.into_inner());
                    let _ = writeln!(o, "{l}");
                    let _ = o.flush();
                });
            })
        })
        .collect();
    let ids: Vec<(i32, usize)> = (0..vcpus).filter_map(|_| rx.recv().ok()).collect();
    let watcher = (mode == "watcher").then(|| {
        let pts: Vec<usize> = ids.iter().map(|(_, p)| *p).collect();
        let w_cpu = watcher_cpu.clone();
        gate.set_kick(move || {
            // The watcher's own CPU so far (it runs this kick).
            w_cpu.store(own_thread_cpu_ns(), Ordering::Relaxed);
            for p in &pts {
                // SAFETY: the vCPU threads live until the gate is shut
                // down, and the watcher ends then too.
                unsafe { libc::pthread_kill(*p as libc::pthread_t, kick_signal()) };
            }
        });
        gate.spawn_watcher("watcher").expect("watcher")
    });
    {
        use std::io::Write;
        let mut o = out.lock().unwrap_or_else(|e| e.into_inner());
        let tids: Vec<String> = ids.iter().map(|(t, _)| t.to_string()).collect();
        let _ = writeln!(o, "tids {}", tids.join(" "));
        let _ = o.flush();
    }
    for t in threads {
        let _ = t.join();
    }
    if let Some(w) = watcher {
        let _ = w.join();
    }
    println!("other_cpu {}", watcher_cpu.load(Ordering::Relaxed));
}

/// A simulated vCPU: spins like a guest (never looking at the gate) until
/// kicked, then reports when it is off the CPU and waits.
fn vcpu(gate: &Gate, say: &dyn Fn(&str)) {
    let stop = Instant::now() + Duration::from_secs(120);
    loop {
        KICKED.with(|k| k.store(false, Ordering::SeqCst)); // immediate_exit = 0
        if gate.is_shutdown() {
            return;
        }
        if gate.is_parked() {
            say(&format!("off {}", monotonic_ns()));
            if gate.wait_while_parked() == corral_scheduler::WaitOutcome::Shutdown {
                return;
            }
            say("on");
            continue;
        }
        // "KVM_RUN": until a kick.
        while !KICKED.with(|k| k.load(Ordering::SeqCst)) {
            std::hint::spin_loop();
            if Instant::now() > stop {
                return;
            }
        }
    }
}
