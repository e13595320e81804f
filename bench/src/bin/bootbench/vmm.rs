//! A VM process started as the daemon starts one: `corral vmm --fd 3` with
//! the VM's end of a socketpair, its configuration sent as the daemon's
//! `Hello` (the built-in probe, seccomp on, a scheduler gate, jailed or
//! not), and `PROBE-UP` read from the console messages it sends back.
//! It is started by the function the daemon's launcher uses
//! (`vmproc::spawn::spawn_vm_process`: jailed, cloned into a new pid
//! namespace), so the bench times the daemon's start.

use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::time::Instant;

use corral_vmm::vmproc::nspool::NsPool;
use corral_vmm::vmproc::proto::{FromVm, Hello, JailParams, VmSpec};
use corral_vmm::vmproc::spawn::{SpawnOpts, spawn_vm_process};
use corral_vmm::vmproc::wire;

/// A uid for jailed run `n`: one of the top 64 of the daemon's default pool
/// (`jail::DEFAULT_UID_BASE`), which a daemon leases from the bottom. A uid
/// per run, as the daemon leases one per VM: with one uid for all runs, a
/// killed VM process that had not yet been torn down still counted against
/// the next one's `RLIMIT_NPROC`, and its control thread got EAGAIN.
fn bench_uid(n: usize) -> u32 {
    corral_vmm::jail::DEFAULT_UID_BASE + corral_vmm::jail::DEFAULT_UID_COUNT - 1 - (n % 64) as u32
}

/// One VM process to `PROBE-UP`: (ms from the spawn, RSS KiB then, the
/// start-up steps with `BOOTBENCH_STEPS`). Started by the launcher's own
/// function (`vmproc::spawn::spawn_vm_process`), with the jail the daemon
/// asks for where the host has pid namespaces.
pub fn one(vcpus: u8, memory_mib: u64, jailed: bool, n: usize) -> (f64, u64, super::Steps) {
    let how = if jailed { Start::Daemon } else { Start::Plain };
    one_as(vcpus, memory_mib, how, n)
}

/// How a VM process is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// Not jailed.
    Plain,
    /// Jailed, as the daemon's launcher starts it: cloned into its pid
    /// namespace, in a network, IPC and UTS namespace made ahead.
    Daemon,
    /// Jailed, cloned into its pid namespace, making its other namespaces
    /// itself (no pool).
    CloneOnly,
    /// Jailed, the jail forking for its pid namespace and making all of
    /// them (the start before session 6).
    Fork,
}

/// The spare namespaces of the bench's jailed runs (the launcher keeps
/// such a pool: `vmproc::nspool`).
fn pool() -> &'static NsPool {
    static POOL: std::sync::OnceLock<NsPool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| NsPool::start(2).expect("namespace pool"))
}

/// [`one`], started `how`.
fn one_as(vcpus: u8, memory_mib: u64, how: Start, n: usize) -> (f64, u64, super::Steps) {
    let jailed = how != Start::Plain;
    let (ours, theirs) = wire::pair().expect("socketpair");
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
        // As the daemon does where the host has pid namespaces.
        jail: jailed.then(|| JailParams {
            uid: bench_uid(n),
            pid_namespace: true,
        }),
    };
    // A daemon whose VMs are created a few ms apart or more finds a spare
    // set ready; the bench waits for it so that each run does (the maker
    // runs between runs, while nothing is timed).
    let spare = (how == Start::Daemon)
        .then(|| pool().take_wait(std::time::Duration::from_secs(2)))
        .flatten();
    assert!(
        how != Start::Daemon || spare.is_some(),
        "no spare namespaces within 2 s"
    );
    let steps_on = std::env::var_os("BOOTBENCH_STEPS").is_some();
    if steps_on {
        // SAFETY: no other thread of bootbench reads or writes the
        // environment meanwhile (the modes run one after the other; the
        // step readers do not touch it).
        unsafe { std::env::set_var("CORRAL_BOOT_TRACE", "1") };
    }
    let trace = steps_on.then(trace_pipe);
    let (_gate, gate_fd) = corral_scheduler::Gate::new_shared().expect("scheduler gate");
    let exe = corral_tests::corral_bin();
    let m0 = super::monotonic_ns();
    let t0 = Instant::now();
    let opts = SpawnOpts {
        own_group: false,
        pid_namespace: how != Start::Fork && spec.jail.is_some_and(|j| j.pid_namespace),
        namespaces: spare.as_ref(),
        stderr: trace.as_ref().map(|(_, w)| w.as_fd()),
    };
    let name = spec.name.clone();
    let mut child =
        spawn_vm_process(exe.as_ref(), &theirs, &name, None, opts).expect("spawn corral vmm");
    drop(spare);
    drop(theirs);
    let reader = trace.map(|(r, w)| {
        drop(w);
        std::thread::spawn(move || read_steps(r, m0))
    });
    wire::send(&ours, &Hello { vm: spec }, &[gate_fd.as_fd()]).expect("send the configuration");
    let up = wait_probe_up(&ours).unwrap_or_else(|e| {
        child.kill();
        panic!("corral vmm: {e}")
    });
    let ms = (up - t0).as_secs_f64() * 1e3;
    let up_us = super::monotonic_ns().saturating_sub(m0) as f64 / 1e3;
    // The VM's process: the started one, or (a jail that forked) its child.
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
    child.kill();
    let _ = child.wait();
    // The next run starts once this VM's processes are gone (or zombies),
    // so runs do not overlap their teardown.
    for pid in children_gone_wait(&inner_pids) {
        eprintln!("bootbench: VM process {pid} still there after 2 s");
    }
    let mut steps = reader.and_then(|r| r.join().ok()).unwrap_or_default();
    if steps_on {
        steps.push(("PROBE-UP-seen".into(), up_us));
    }
    (ms, rss, steps)
}

/// A close-on-exec pipe (read end, write end) for the VM process's stderr.
fn trace_pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array we own.
    let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(r, 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: both fds were just made and are owned by nobody else.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// The boot-trace lines on the VM process's stderr, as offsets from `m0`
/// (µs); other lines are passed on to ours.
fn read_steps(r: OwnedFd, m0: u64) -> super::Steps {
    use std::io::BufRead;
    let mut steps = super::Steps::new();
    for line in std::io::BufReader::new(std::fs::File::from(r))
        .lines()
        .take(1000)
    {
        let Ok(line) = line else { break };
        let mut f = line.split_whitespace();
        if f.next() == Some("corral-boot-step")
            && let (Some(name), Some(Ok(ns))) = (f.next(), f.next().map(str::parse::<u64>))
        {
            steps.push((name.to_string(), ns.saturating_sub(m0) as f64 / 1e3));
        } else {
            eprintln!("{line}");
        }
    }
    steps
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

/// `bootbench jail-ab [ROUNDS] [VCPUS] [MEMORY_MIB]`: `corral run`, and the
/// jailed `corral vmm` started as the daemon starts it, against the same
/// jail without the namespace pool, and reached by the jail's own fork (as
/// before session 6), interleaved (order reversed every other round); with
/// `BOOTBENCH_STEPS=1` each one's start-up steps.
pub fn jail_ab(rounds: usize, vcpus: u8, memory_mib: u64) {
    const NAMES: [&str; 4] = [
        "corral run",
        "jailed (daemon)",
        "jailed, no pool",
        "jailed, fork",
    ];
    const HOW: [Start; 4] = [Start::Plain, Start::Daemon, Start::CloneOnly, Start::Fork];
    let once = |w: usize, n: usize| match w {
        0 => super::one(&vcpus.to_string(), &memory_mib.to_string()),
        _ => one_as(vcpus, memory_mib, HOW[w], n),
    };
    println!("jail a/b: {vcpus} vCPU, {memory_mib} MiB, {rounds} rounds after 1 warm-up");
    for w in 0..4 {
        once(w, 0);
    }
    let mut t: [Vec<f64>; 4] = Default::default();
    let mut steps: [Vec<super::Steps>; 4] = Default::default();
    for i in 0..rounds {
        let order: [usize; 4] = if i % 2 == 0 {
            [0, 1, 2, 3]
        } else {
            [3, 2, 1, 0]
        };
        let mut line = format!("round {:2}:", i + 1);
        for w in order {
            let (ms, _, st) = once(w, i + 1);
            t[w].push(ms);
            steps[w].push(st);
        }
        for (w, v) in t.iter().enumerate() {
            line += &format!("  {} {:6.2}", ["run", "daemon", "nopool", "fork"][w], v[i]);
        }
        println!("{line}");
    }
    let med = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let ratio = |a: usize, b: usize| {
        let r: Vec<f64> = t[a].iter().zip(&t[b]).map(|(x, y)| x / y).collect();
        med(&r)
    };
    for w in 0..4 {
        println!(
            "{:16} median {:.2} ms, min {:.2} ms; / corral run: {:.2}x (median of per-round ratios)",
            NAMES[w],
            med(&t[w]),
            t[w].iter().copied().fold(f64::INFINITY, f64::min),
            ratio(w, 0)
        );
    }
    println!(
        "daemon / fork: {:.3}x, no pool / fork: {:.3}x (medians of per-round ratios)",
        ratio(1, 3),
        ratio(2, 3)
    );
    if std::env::var_os("BOOTBENCH_STEPS").is_some() {
        for w in 0..4 {
            println!("{}:", NAMES[w]);
            super::print_steps(&steps[w]);
        }
    }
}
