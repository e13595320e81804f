//! The shared gate across two processes: this test binary runs the owner
//! (the daemon's side) and re-runs itself as the peer (a VM process) with
//! the gate's memfd inherited. `harness = false`: the scenarios run one
//! after another, so no other test's child inherits the fd.
//!
//! Scenarios: a park blocks the peer's waiter, an unpark wakes it, a
//! shutdown releases it; a kick reaches a thread of the peer both ways
//! (the owner signals the peer's thread by tid; the peer's watcher kicks
//! it); a hostile peer (garbage in the page, truncation) neither hangs nor
//! panics the owner.

use std::io::{BufRead, BufReader, Lines};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use corral_scheduler::{CpuClamp, Gate, WaitOutcome};

const ROLE: &str = "CORRAL_GATE_XPROC_ROLE";
const FD: &str = "CORRAL_GATE_XPROC_FD";
const LIMIT: Duration = Duration::from_secs(10);
/// A woken peer answers within this (generous for a loaded host).
const WOKEN: Duration = Duration::from_secs(3);

fn main() {
    if let Ok(role) = std::env::var(ROLE) {
        peer(&role);
        return;
    }
    let scenarios: [(&str, fn()); 6] = [
        (
            "park_blocks_the_peers_waiter_and_unpark_wakes_it",
            park_blocks_and_unpark_wakes,
        ),
        ("shutdown_releases_the_peers_waiter", shutdown_releases),
        ("a_signal_kick_by_tid_reaches_a_peer_thread", signal_kick),
        ("the_peers_watcher_kicks_its_own_thread", watcher_kick),
        (
            "a_hostile_peer_neither_hangs_nor_panics_the_owner",
            hostile_peer,
        ),
        ("published_cpu_crosses_the_processes", published_cpu),
    ];
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    for (name, f) in scenarios {
        if !filter.is_empty() && !filter.iter().any(|p| name.contains(p.as_str())) {
            continue;
        }
        let t0 = Instant::now();
        f();
        println!(
            "test {name} ... ok ({:.0} ms)",
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
}

/// The peer process.
struct Peer {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Peer {
    fn spawn(role: &str, fd: &OwnedFd) -> Peer {
        // dup clears close-on-exec: the copy is what the child inherits.
        let inherit = rustix::io::dup(fd).unwrap();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env(ROLE, role)
            .env(FD, inherit.as_raw_fd().to_string())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        drop(inherit);
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Peer { child, lines }
    }

    /// The next line the peer prints (it prints a few short lines).
    fn line(&mut self) -> String {
        match self.lines.next() {
            Some(Ok(l)) => l,
            other => panic!("peer ended without a line: {other:?}"),
        }
    }

    fn exited_within(&mut self, d: Duration) -> Option<std::process::ExitStatus> {
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            if t0.elapsed() > d {
                return None;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < LIMIT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn park_blocks_and_unpark_wakes() {
    let (gate, fd) = Gate::new_shared().unwrap();
    gate.park();
    let mut p = Peer::spawn("wait", &fd);
    wait_for("the peer's waiter", || gate.waiting() == 1);
    assert!(
        p.exited_within(Duration::from_millis(100)).is_none(),
        "the peer's waiter returned while parked"
    );
    let t0 = Instant::now();
    assert!(gate.unpark());
    assert_eq!(p.line(), "Running");
    // A lost wake shows as the peer's 10 s timeout.
    assert!(t0.elapsed() < WOKEN, "woken after {:?}", t0.elapsed());
    assert!(p.exited_within(LIMIT).is_some_and(|s| s.success()));
    assert_eq!(gate.waiting(), 0);
}

fn shutdown_releases() {
    let (gate, fd) = Gate::new_shared().unwrap();
    gate.park();
    let mut p = Peer::spawn("wait", &fd);
    wait_for("the peer's waiter", || gate.waiting() == 1);
    let t0 = Instant::now();
    gate.shutdown();
    assert_eq!(p.line(), "Shutdown");
    assert!(t0.elapsed() < WOKEN, "released after {:?}", t0.elapsed());
    assert!(p.exited_within(LIMIT).is_some_and(|s| s.success()));
}

/// The kick signal of the VMM (SIGRTMIN+1).
fn kick_signal() -> i32 {
    libc::SIGRTMIN() + 1
}

fn signal_kick() {
    let (gate, fd) = Gate::new_shared().unwrap();
    let mut p = Peer::spawn("spin", &fd);
    let tid: i32 = p.line().parse().unwrap();
    let pid = p.child.id() as i32;
    gate.set_kick(move || {
        // SAFETY: tgkill with the peer's pid as thread group: it can only
        // reach a thread of that process.
        unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, kick_signal()) };
    });
    gate.park();
    assert_eq!(p.line(), "kicked");
    wait_for("the kicked thread to wait", || gate.waiting() == 1);
    gate.unpark();
    assert!(p.exited_within(LIMIT).is_some_and(|s| s.success()));
}

fn watcher_kick() {
    let (gate, fd) = Gate::new_shared().unwrap();
    let mut p = Peer::spawn("spin-watch", &fd);
    let _tid = p.line();
    assert!(gate.park(), "no kick registered on the owner");
    assert_eq!(p.line(), "kicked");
    wait_for("the kicked thread to wait", || gate.waiting() == 1);
    gate.unpark();
    assert!(p.exited_within(LIMIT).is_some_and(|s| s.success()));
}

fn hostile_peer() {
    let (gate, fd) = Gate::new_shared().unwrap();
    let mut p = Peer::spawn("hostile", &fd);
    assert_eq!(p.line(), "truncate refused");
    // The peer scribbles for ~300 ms: every owner call returns, the owner's
    // view follows its own decisions only.
    let t0 = Instant::now();
    let mut clamp = CpuClamp::new(4, 0, &[0; 4]);
    let mut out = [0u64; 4];
    let mut rounds = 0u64;
    while t0.elapsed() < Duration::from_millis(300) {
        assert!(gate.park());
        assert!(gate.is_parked());
        assert_eq!(
            gate.wait_while_parked_timeout(Duration::from_micros(200)),
            None
        );
        let _ = gate.waiting();
        let (n, _) = gate.read_cpu(&mut out);
        let now = t0.elapsed().as_nanos() as u64;
        let c = clamp.update(now, &out[..n]);
        assert!(
            c.iter().all(|v| *v <= now),
            "clamped beyond wall time: {c:?}"
        );
        assert!(gate.unpark());
        assert_eq!(gate.wait_while_parked(), WaitOutcome::Running);
        rounds += 1;
    }
    assert!(rounds > 10, "{rounds} rounds");
    gate.shutdown();
    assert!(gate.is_shutdown() && !gate.park());
    assert!(p.exited_within(LIMIT).is_some_and(|s| s.success()));
}

fn published_cpu() {
    let (gate, fd) = Gate::new_shared().unwrap();
    let mut p = Peer::spawn("publish", &fd);
    assert_eq!(p.line(), "published");
    let mut out = [0u64; 8];
    let (n, seq) = gate.read_cpu(&mut out);
    assert_eq!((n, seq), (3, 1));
    assert_eq!(&out[..3], &[10, 20, 30]);
    assert!(p.exited_within(LIMIT).is_some_and(|s| s.success()));
}

// ---- the peer side ----

static KICKED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_kick(_: libc::c_int) {
    KICKED.store(true, Ordering::SeqCst);
}

fn install_kick_handler() {
    // SAFETY: a zeroed sigaction with a handler that only stores an atomic
    // (async-signal-safe).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_kick as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(kick_signal(), &sa, std::ptr::null_mut()), 0);
    }
}

fn inherited_fd() -> OwnedFd {
    let n: i32 = std::env::var(FD).unwrap().parse().unwrap();
    // SAFETY: the parent passed us this fd (inherited across exec); nothing
    // else in this process owns it.
    unsafe { OwnedFd::from_raw_fd(n) }
}

fn peer(role: &str) {
    let fd = inherited_fd();
    match role {
        "wait" => {
            let gate = Gate::from_fd(fd).unwrap();
            match gate.wait_while_parked_timeout(LIMIT) {
                Some(o) => println!("{o:?}"),
                None => println!("still parked after {LIMIT:?}"),
            }
        }
        "spin" | "spin-watch" => {
            install_kick_handler();
            let gate = Gate::from_fd(fd).unwrap();
            let _watcher = (role == "spin-watch").then(|| {
                // SAFETY: pthread_self has no preconditions.
                let me = unsafe { libc::pthread_self() } as usize;
                gate.set_kick(move || {
                    // SAFETY: `me` is this process's main thread, alive
                    // until the process exits.
                    unsafe { libc::pthread_kill(me as libc::pthread_t, kick_signal()) };
                });
                gate.spawn_watcher("watch").unwrap()
            });
            // SAFETY: gettid has no preconditions.
            println!("{}", unsafe { libc::gettid() });
            // A "vCPU": spins (like a guest in KVM_RUN, never looking at
            // the gate) until kicked, then waits on the gate.
            let t0 = Instant::now();
            while !KICKED.load(Ordering::SeqCst) {
                std::hint::spin_loop();
                if t0.elapsed() > LIMIT {
                    println!("not kicked");
                    std::process::exit(1);
                }
            }
            println!("kicked");
            assert_eq!(gate.wait_while_parked(), WaitOutcome::Running);
        }
        "hostile" => hostile(fd),
        "publish" => {
            let gate = Gate::from_fd(fd).unwrap();
            gate.publish_cpu(&[10, 20, 30]);
            println!("published");
        }
        other => panic!("unknown role {other}"),
    }
}

/// Maps the page itself and writes garbage into every word for 300 ms.
fn hostile(fd: OwnedFd) {
    if rustix::fs::ftruncate(&fd, 0).is_err() && rustix::fs::ftruncate(&fd, 1 << 20).is_err() {
        println!("truncate refused");
    } else {
        println!("truncate allowed");
    }
    // SAFETY: a fresh shared mapping of the 4 KiB page; we only write
    // through atomics.
    let p = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            4096,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::SHARED,
            &fd,
            0,
        )
    }
    .unwrap();
    // SAFETY: 1024 u32 words of the mapping above, alive until exit.
    let words: &[AtomicU32] = unsafe { std::slice::from_raw_parts(p.cast(), 1024) };
    let t0 = Instant::now();
    let mut x = 0x9e37_79b9u32;
    while t0.elapsed() < Duration::from_millis(300) {
        for w in words.iter() {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            w.store(x, Ordering::Relaxed);
        }
        // Wake the owner's sleepers, whatever they wait for.
        let _ =
            rustix::thread::futex::wake(&words[2], rustix::thread::futex::Flags::empty(), u32::MAX);
    }
}
