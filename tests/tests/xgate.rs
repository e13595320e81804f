//! A real VM parked from another process through a shared gate: this test
//! binary is the daemon's side and re-runs itself as a VM process that boots
//! the probe guest (one spinning vCPU) with `Gate::from_fd` as its
//! scheduling gate. For each kick mode (the daemon signals the vCPU thread
//! by host tid; the VM process's watcher kicks it): a park gets the vCPU
//! out of `KVM_RUN` and onto the gate (its thread clock stops), an unpark
//! lets it run again, a shutdown of the gate ends the VM process.
//! `harness = false`: one scenario after the other, so that no other
//! test's child inherits the gate's fd.

use std::io::{BufRead, BufReader, Lines};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use corral_scheduler::Gate;
use corral_vmm::vmgate::{KickMode, ThreadRunTime, signal_kick, start_vm_side};
use corral_vmm::{KernelSource, VmConfig};

const ROLE: &str = "CORRAL_XGATE_ROLE";
const FD: &str = "CORRAL_XGATE_FD";
const LIMIT: Duration = Duration::from_secs(10);

fn main() {
    if let Ok(role) = std::env::var(ROLE) {
        vm_process(&role);
        return;
    }
    for (name, mode) in [
        ("a_signal_by_tid_parks_a_vm_process", KickMode::Signal),
        ("the_vm_process_watcher_parks_it", KickMode::Watcher),
    ] {
        let t0 = Instant::now();
        park_a_vm_process(mode);
        println!(
            "test {name} ... ok ({:.0} ms)",
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
}

struct VmProcess {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Drop for VmProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn park_a_vm_process(mode: KickMode) {
    let (gate, fd) = Gate::new_shared().expect("shared gate");
    // dup clears close-on-exec: the copy is what the child inherits.
    // SAFETY: dup of an fd we own; the new fd is owned by `inherit`.
    let inherit = unsafe { OwnedFd::from_raw_fd(libc::dup(fd.as_raw_fd())) };
    let mut child = Command::new(std::env::current_exe().expect("own path"))
        .env(
            ROLE,
            if mode == KickMode::Signal {
                "signal"
            } else {
                "watcher"
            },
        )
        .env(FD, inherit.as_raw_fd().to_string())
        .stdout(Stdio::piped())
        .spawn()
        .expect("VM process");
    drop(inherit);
    let lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut vm = VmProcess { child, lines };
    let line = vm.lines.next().expect("VM process output").expect("line");
    let tid: libc::pid_t = line
        .strip_prefix("vcpu ")
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("VM process said {line:?}"));
    let pid = vm.child.id() as libc::pid_t;
    if mode == KickMode::Signal {
        gate.set_kick(signal_kick(pid, vec![tid]));
    }
    // Thread CPU clocks do not reach another process: schedstat does.
    let run = ThreadRunTime::open(pid, tid).expect("the vCPU thread's schedstat");
    let clock = || run.read_ns().expect("the vCPU thread's run time");
    // The guest spins: its vCPU thread uses CPU.
    let c0 = clock();
    wait_for("the guest to spin", LIMIT, || clock() > c0 + 20_000_000);

    for round in 0..3 {
        assert!(gate.park());
        wait_for("the vCPU on the gate", Duration::from_secs(2), || {
            gate.waiting() == 1
        });
        let frozen = clock();
        std::thread::sleep(Duration::from_millis(150));
        let moved = clock() - frozen;
        assert!(
            moved < 2_000_000,
            "{mode:?} round {round}: the parked vCPU ran {moved} ns in 150 ms"
        );
        assert!(gate.unpark());
        let c = clock();
        wait_for("the vCPU to run again", LIMIT, || clock() > c + 10_000_000);
    }
    gate.shutdown();
    let t0 = Instant::now();
    loop {
        if let Some(st) = vm.child.try_wait().expect("wait") {
            assert!(st.success(), "VM process: {st}");
            break;
        }
        assert!(t0.elapsed() < LIMIT, "the VM process outlived its gate");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The VM process: boots the probe guest with the inherited gate as its
/// scheduling gate; ends when the gate is shut down.
fn vm_process(role: &str) {
    let n: i32 = std::env::var(FD)
        .ok()
        .and_then(|v| v.parse().ok())
        .expect("fd");
    // SAFETY: the parent passed us this fd; nothing else here owns it.
    let gate: Arc<Gate> = Gate::from_fd(unsafe { OwnedFd::from_raw_fd(n) }).expect("gate");
    let mut cfg = VmConfig::new("xgate", KernelSource::Bytes(corral_tests::vms::probe_elf()));
    cfg.vcpus = 1;
    cfg.memory_mib = 16;
    // No console line (an I/O exit would pass by the gate) within the
    // test: only a kick gets the vCPU out of KVM_RUN.
    cfg.cmdline = "probe.mode=spin probe.secs=60 probe.interval_ms=30000".into();
    cfg.sched_gate = Some(gate.clone());
    let handle = corral_vmm::start(&cfg).expect("start VM");
    let mode = if role == "watcher" {
        KickMode::Watcher
    } else {
        KickMode::Signal
    };
    // The builder registered its kick_all on the gate; the watcher runs it.
    let watcher = start_vm_side(&gate, mode, "xgate").expect("watcher");
    println!("vcpu {}", handle.vcpu_tids()[0]);
    while !gate.is_shutdown() {
        std::thread::sleep(Duration::from_millis(5));
    }
    handle.stop();
    handle.join();
    if let Some(w) = watcher {
        let _ = w.join();
    }
}
