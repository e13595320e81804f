//! A VM process started as the daemon starts one: `corral vmm --fd 3` with
//! the VM's end of a socketpair, its configuration sent as the daemon's
//! `Hello` (the built-in probe, seccomp on, a scheduler gate, jailed or
//! not), and `PROBE-UP` read from the console messages it sends back.
//! The daemon's launcher forks and execs it the same way (`vmproc::launcher`).

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Instant;

use corral_vmm::vmproc::proto::{FromVm, Hello, JailParams, PROTOCOL_VERSION, VmSpec};
use corral_vmm::vmproc::wire;

/// The fd the VM process expects its socket on.
const CHILD_FD: i32 = corral_vmm::vmproc::launcher::CHILD_FD;

/// A uid for jailed run `n`: one of the top 64 of the daemon's default pool
/// (`jail::DEFAULT_UID_BASE`), which a daemon leases from the bottom. A uid
/// per run, as the daemon leases one per VM: with one uid for all runs, a
/// killed VM process that had not yet been torn down still counted against
/// the next one's `RLIMIT_NPROC`, and its control thread got EAGAIN.
fn bench_uid(n: usize) -> u32 {
    corral_vmm::jail::DEFAULT_UID_BASE + corral_vmm::jail::DEFAULT_UID_COUNT - 1 - (n % 64) as u32
}

/// One VM process to `PROBE-UP`: (ms from the spawn, RSS KiB then).
pub fn one(vcpus: u8, memory_mib: u64, jailed: bool, n: usize) -> (f64, u64) {
    let (ours, theirs) = wire::pair().expect("socketpair");
    let raw = theirs.as_raw_fd();
    let mut cmd = Command::new(corral_tests::corral_bin());
    cmd.args(["vmm", "--fd", &CHILD_FD.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    // SAFETY: between fork and exec only dup2 (async-signal-safe) of an fd
    // this process owns onto CHILD_FD, which clears close-on-exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(raw, CHILD_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    assert_ne!(raw, CHILD_FD, "the socketpair landed on fd 3");
    let spec = VmSpec {
        name: format!("bootbench{n}"),
        nonce: format!("{:016x}", n),
        vcpus,
        memory_mib,
        cmdline: "probe.mode=spin probe.secs=2".into(),
        console_log_bytes: 256 * 1024,
        acpi: true,
        kernel: None,
        initrd: None,
        disks: Vec::new(),
        // The daemon's gate: a shared page, its memfd the only file passed.
        sched_gate: Some(0),
        seccomp: true,
        control_socket: None,
        // As the daemon does where the host has pid namespaces: the jail
        // forks, the VM runs in the child, the started process reaps it.
        jail: jailed.then(|| JailParams {
            uid: bench_uid(n),
            pid_namespace: true,
        }),
    };
    let (_gate, gate_fd) = corral_scheduler::Gate::new_shared().expect("scheduler gate");
    let t0 = Instant::now();
    let mut child = cmd.spawn().expect("spawn corral vmm");
    drop(theirs);
    wire::send(
        &ours,
        &Hello {
            version: PROTOCOL_VERSION,
            vm: spec,
        },
        &[gate_fd.as_fd()],
    )
    .expect("send the configuration");
    let up = wait_probe_up(&ours).unwrap_or_else(|e| {
        let _ = child.kill();
        panic!("corral vmm: {e}")
    });
    let ms = (up - t0).as_secs_f64() * 1e3;
    // The VM's process: the started one, or (pid namespace) its child.
    let inner = children(child.id());
    let vm_pid = inner.first().copied().unwrap_or(child.id());
    let rss = super::rss_kib(vm_pid).unwrap_or(0);
    if std::env::var_os("BOOTBENCH_SMAPS").is_some() {
        super::print_smaps(vm_pid);
    }
    let inner_pids = inner.clone();
    for pid in inner {
        // SAFETY: kill(2) of a child of our child, still unreaped by it
        // (it reaps only when the VM ends, which SIGKILL of the outer does
        // not wait for).
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    let _ = child.kill();
    let _ = child.wait();
    // The next run starts once this VM's processes are gone (or zombies),
    // so runs do not overlap their teardown.
    for pid in children_gone_wait(&inner_pids) {
        eprintln!("bootbench: VM process {pid} still there after 2 s");
    }
    (ms, rss)
}

/// Waits up to 2 s until every pid is gone or a zombie; returns those left.
fn children_gone_wait(pids: &[u32]) -> Vec<u32> {
    let alive = |p: &u32| {
        std::fs::read_to_string(format!("/proc/{p}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit(')')
                    .next()
                    .map(|r| r.trim_start().starts_with('Z'))
                    .map(|z| !z)
            })
            .unwrap_or(false)
    };
    for _ in 0..200 {
        if !pids.iter().any(alive) {
            return Vec::new();
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    pids.iter().copied().filter(alive).collect()
}

/// Reads the VM process's messages until its console shows `PROBE-UP`:
/// the instant it arrived.
fn wait_probe_up(sock: &OwnedFd) -> Result<Instant, String> {
    let mut console = Vec::new();
    for _ in 0..10_000 {
        let msg: Option<(FromVm, Vec<OwnedFd>)> = wire::recv(sock).map_err(|e| e.to_string())?;
        match msg {
            None => return Err("closed its socket before PROBE-UP".into()),
            Some((FromVm::StartFailed { message }, _)) => return Err(message),
            Some((FromVm::Exited { reason, .. }, _)) => {
                return Err(format!("exited before PROBE-UP: {reason:?}"));
            }
            Some((FromVm::Console { data, .. }, _)) => {
                console.extend_from_slice(&data);
                if console.windows(8).any(|w| w == b"PROBE-UP") {
                    return Ok(Instant::now());
                }
                if console.len() > 1 << 20 {
                    return Err("1 MiB of console output without PROBE-UP".into());
                }
            }
            Some(_) => {}
        }
    }
    Err("10000 messages without PROBE-UP".into())
}

/// The children of `pid` (`/proc/PID/task/PID/children`).
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}
