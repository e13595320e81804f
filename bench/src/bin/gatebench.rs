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
use corral_vmm::vmgate::{KickMode, process_cpu_ns, signal_kick};

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
    let mut res = [Stats::default(), Stats::default()];
    let mut sample_cost = (Vec::new(), Vec::new());
    for b in 0..blocks {
        for i in 0..2 {
            // Alternate which mode goes first in a block.
            let i = if b % 2 == 0 { i } else { 1 - i };
            let mode = if i == 0 {
                KickMode::Signal
            } else {
                KickMode::Watcher
            };
            run_block(mode, vcpus, rounds, &mut res[i], &mut sample_cost);
        }
    }
    println!("gatebench: {vcpus} simulated vCPUs, {blocks} blocks x {rounds} parks per mode");
    for (name, s) in ["signal", "watcher"].iter().zip(&mut res) {
        s.lat.sort_unstable();
        s.park_cpu.sort_unstable();
        println!(
            "{name:8} park->off median {:7.1} us  p90 {:7.1} us  max {:8.1} us | daemon CPU per park median {:5.2} us | VM-side watcher CPU per park {:5.2} us | missed {}",
            pct(&s.lat, 50) / 1e3,
            pct(&s.lat, 90) / 1e3,
            s.lat.last().copied().unwrap_or(0) as f64 / 1e3,
            pct(&s.park_cpu, 50) / 1e3,
            s.other_cpu as f64 / s.parks.max(1) as f64 / 1e3,
            s.missed,
        );
    }
    let (sig, wat) = (&res[0], &res[1]);
    println!(
        "ratio watcher/signal: latency median {:.2}x, p90 {:.2}x; daemon+VM-side CPU per park {:.2}x",
        pct(&wat.lat, 50) / pct(&sig.lat, 50).max(1.0),
        pct(&wat.lat, 90) / pct(&sig.lat, 90).max(1.0),
        (pct(&wat.park_cpu, 50) + wat.other_cpu as f64 / wat.parks.max(1) as f64)
            / (pct(&sig.park_cpu, 50) + sig.other_cpu as f64 / sig.parks.max(1) as f64).max(1.0)
    );
    let (mut threads, mut process) = sample_cost;
    threads.sort_unstable();
    process.sort_unstable();
    println!(
        "CPU-time sample of one {vcpus}-vCPU VM (daemon side): per-thread clocks {:.2} us, process clock + page {:.2} us ({:.2}x)",
        pct(&threads, 50) / 1e3,
        pct(&process, 50) / 1e3,
        pct(&threads, 50) / pct(&process, 50).max(1.0)
    );
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

struct Peer {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Peer {
    fn line(&mut self) -> String {
        match self.lines.next() {
            Some(Ok(l)) => l,
            other => panic!("VM process ended: {other:?}"),
        }
    }
}

fn run_block(
    mode: KickMode,
    vcpus: usize,
    rounds: usize,
    s: &mut Stats,
    cost: &mut (Vec<u64>, Vec<u64>),
) {
    let (gate, fd) = Gate::new_shared().expect("shared gate");
    let inherit = rustix_dup(&fd);
    let mut child = Command::new(std::env::current_exe().expect("own path"))
        .env(
            PEER,
            if mode == KickMode::Signal {
                "signal"
            } else {
                "watcher"
            },
        )
        .env(FD, inherit.as_raw_fd().to_string())
        .args(["--vcpus", &vcpus.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("VM process");
    drop(inherit);
    let lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut p = Peer { child, lines };
    let tids: Vec<i32> = p
        .line()
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    let pid = p.child.id() as i32;
    if mode == KickMode::Signal {
        gate.set_kick(signal_kick(pid, tids.clone()));
    }
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
            for t in &tids {
                std::hint::black_box(thread_cpu_ns(*t));
            }
        }
        let b = own_thread_cpu_ns();
        for _ in 0..100 {
            std::hint::black_box(process_cpu_ns(pid));
            std::hint::black_box(gate.read_cpu(&mut buf));
        }
        let c = own_thread_cpu_ns();
        cost.0.push((b - a) / 100);
        cost.1.push((c - b) / 100);
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
    let l = p.line();
    s.other_cpu += l
        .strip_prefix("other_cpu ")
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    let _ = p.child.wait();
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

fn peer(mode: &str, vcpus: usize) {
    // SAFETY: a zeroed sigaction with a handler that stores a const-init
    // thread-local atomic (async-signal-safe); no SA_RESTART.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_kick as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(kick_signal(), &sa, std::ptr::null_mut());
    }
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
                vcpu(&gate, &out);
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
fn vcpu(gate: &Gate, out: &Mutex<std::io::Stdout>) {
    let stop = Instant::now() + Duration::from_secs(120);
    loop {
        KICKED.with(|k| k.store(false, Ordering::SeqCst)); // immediate_exit = 0
        if gate.is_shutdown() {
            return;
        }
        if gate.is_parked() {
            let t = monotonic_ns();
            {
                use std::io::Write;
                let mut o = out.lock().unwrap_or_else(|e| e.into_inner());
                let _ = writeln!(o, "off {t}");
                let _ = o.flush();
            }
            if gate.wait_while_parked() == corral_scheduler::WaitOutcome::Shutdown {
                return;
            }
            {
                use std::io::Write;
                let mut o = out.lock().unwrap_or_else(|e| e.into_inner());
                let _ = writeln!(o, "on");
                let _ = o.flush();
            }
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
