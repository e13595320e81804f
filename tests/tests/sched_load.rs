//! Real VMs beside a load that is not corral's (issue 13): shares, a cap
//! and a reservation must hold on the CPU that the host's scheduler leaves
//! to the VMs, and a park decided before a VM is attached must hold.
//!
//! Each test starts its own outside busy loop (`sh -c 'while :; do :; done'`,
//! killed when the test ends, after at most [`LOOP_SECS`] s, or with the
//! test process) and prints what it measured, what it expected and the
//! bounds, so that a run on a quiet host explains itself. These are CPU
//! timing tests: they need the host to themselves (tests in this file run
//! one at a time).

use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use corral_scheduler::{Gate, VmId, VmSpec};
use corral_tests::vms::{Backend, Bench, Class, Vm, probe_elf};
use corral_vmm::{KernelSource, VmConfig};

static HOST: Mutex<()> = Mutex::new(());

/// The longest an outside loop may run.
const LOOP_SECS: u64 = 60;

/// Window of the share measurements (the goal is over 10 s).
const WINDOW: Duration = Duration::from_secs(10);
/// Warm-up: VMs booted and the outside-load average settled (τ = 1 s).
const WARMUP: Duration = Duration::from_millis(3000);

fn host_cpus() -> f64 {
    corral_scheduler::Capacity::from_affinity()
        .unwrap()
        .percent() as f64
}

fn spin(s: u64) -> String {
    format!("probe.mode=spin probe.secs={s} probe.interval_ms=1000")
}

fn class(shares: u32, cap: Option<u32>, reservation: Option<u32>) -> Class {
    Class {
        shares,
        cap,
        reservation,
    }
}

/// One busy loop outside corral, bounded in time.
struct OutsideLoop {
    child: Child,
    started: Instant,
    cpu0: u64,
}

impl OutsideLoop {
    fn start() -> Self {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "while :; do :; done"]);
        // SAFETY: the closure runs in the child between fork and exec and
        // only calls prctl, which is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                // Dies with the test process, whatever ends it.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd.spawn().expect("start the outside busy loop");
        let pid = child.id();
        // Bounded in time even if the test hangs.
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(LOOP_SECS));
            // SAFETY: kill has no memory preconditions; at worst the pid is
            // gone (ESRCH) or was our loop.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        });
        let mut l = OutsideLoop {
            child,
            started: Instant::now(),
            cpu0: 0,
        };
        l.cpu0 = l.cpu_ns();
        l
    }

    /// CPU time of the loop so far, ns (utime + stime from /proc/PID/stat).
    fn cpu_ns(&self) -> u64 {
        let s =
            std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap_or_default();
        let after = s.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<u64> = after
            .split_whitespace()
            .skip(11)
            .take(2)
            .filter_map(|x| x.parse().ok())
            .collect();
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
        f.iter().sum::<u64>() * 1_000_000_000 / hz
    }

    /// CPU the loop used since it started, percent of one CPU.
    fn pct(&self) -> f64 {
        (self.cpu_ns() - self.cpu0) as f64 * 100.0 / self.started.elapsed().as_nanos() as f64
    }
}

impl Drop for OutsideLoop {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Prints the scheduler's view of the host and of each VM.
fn print_scheduler(b: &Bench) {
    let st = b.cpu().with(|s| s.stats());
    eprintln!(
        "  scheduler: capacity {} %, planned with {:.1} % (outside load {:.1} %, steal {:.1} %), \
         reservations claimed {:.1} %, shortfall {:.3}",
        st.capacity_pct,
        st.available_pct,
        st.outside_pct,
        st.steal_pct,
        st.claimed_reservations_pct,
        st.shortfall_ratio
    );
    for v in st.vms {
        eprintln!(
            "  vm{} ({}) entitled {:.1} % used {:.1} % parked {:.2} s ({} times)",
            v.vm.0,
            v.class,
            v.entitlement_pct,
            v.used_pct,
            v.parked_ns as f64 / 1e9,
            v.park_count
        );
    }
}

/// Gold (3) and bronze (1), one spinning 2-vCPU VM each, beside one outside
/// loop: gold's share of the CPU the two VMs got, over [`WINDOW`].
fn three_to_one_beside_a_loop(backend: Backend) -> f64 {
    let _g = HOST.lock().unwrap_or_else(|p| p.into_inner());
    let outside = OutsideLoop::start();
    let mut b = Bench::new(backend);
    b.class("gold", class(3, None, None));
    b.class("bronze", class(1, None, None));
    let secs = (WARMUP + WINDOW).as_secs() + 10;
    b.launch("gold", 2, 32, &spin(secs));
    b.launch("bronze", 2, 32, &spin(secs));
    let u = b.measure(WARMUP, WINDOW);
    let share = u[0] * 100.0 / (u[0] + u[1]);
    eprintln!(
        "{backend:?} backend, shares 3:1 beside one outside busy loop on a {:.0} % host, {:?}:\n  \
         gold {:.1} % bronze {:.1} % of one CPU (VMs together {:.1} %), outside loop {:.1} %\n  \
         gold's share of the VMs' CPU: {share:.2} % (expected 75, bound 75 ± 2; \
         before issue 13: 62-63 %)",
        host_cpus(),
        WINDOW,
        u[0],
        u[1],
        u[0] + u[1],
        outside.pct()
    );
    if backend == Backend::Gate {
        print_scheduler(&b);
    }
    share
}

#[test]
fn gate_shares_3_to_1_hold_beside_an_outside_busy_loop() {
    let share = three_to_one_beside_a_loop(Backend::Gate);
    assert!(
        (share - 75.0).abs() <= 2.0,
        "gold got {share:.2} % of the VMs' CPU, want 75 ± 2"
    );
}

/// The same setup under the cgroup backend, side by side with the gate
/// (cgroup weights apply inside corral's own group, so CFS keeps the ratio
/// among the VMs; the outside loop gets its share of the host either way).
#[test]
fn cgroup_shares_3_to_1_beside_an_outside_busy_loop_for_comparison() {
    if corral_vmm::cgroup::detect().is_none() {
        eprintln!("SKIPPED: no cgroup cpu controller on this host");
        return;
    }
    let share = three_to_one_beside_a_loop(Backend::Cgroup);
    assert!(
        (share - 75.0).abs() <= 5.0,
        "cgroup backend: gold got {share:.2} %, want 75 ± 5"
    );
}

#[test]
fn gate_cap_holds_beside_an_outside_busy_loop() {
    let _g = HOST.lock().unwrap_or_else(|p| p.into_inner());
    let outside = OutsideLoop::start();
    let mut b = Bench::new(Backend::Gate);
    b.class("free", class(1, None, None));
    b.class("capped", class(1, Some(50), None));
    let secs = (WARMUP + WINDOW).as_secs() + 10;
    b.launch("free", 2, 32, &spin(secs));
    b.launch("capped", 2, 32, &spin(secs));
    let u = b.measure(WARMUP, WINDOW);
    eprintln!(
        "gate backend, cap 50 beside one outside busy loop, {WINDOW:?}:\n  \
         capped VM {:.1} % of one CPU (bound <= 51), uncapped VM {:.1} %, outside loop {:.1} %",
        u[1],
        u[0],
        outside.pct()
    );
    print_scheduler(&b);
    assert!(u[1] <= 51.0, "capped VM used {:.1} % with a 50 % cap", u[1]);
    assert!(
        u[1] >= 40.0,
        "capped VM got only {:.1} % of its 50 % cap",
        u[1]
    );
}

/// A VM's own cap (issue 13 item 3) beside an uncapped VM of the same
/// class and an outside loop, under `backend`; returns the capped VM's CPU.
fn vm_cap_beside_a_loop(backend: Backend) -> f64 {
    let _g = HOST.lock().unwrap_or_else(|p| p.into_inner());
    let outside = OutsideLoop::start();
    let mut b = Bench::new(backend);
    b.class("c", class(1, None, None));
    let secs = (WARMUP + WINDOW).as_secs() + 10;
    let capped = b.launch("c", 2, 32, &spin(secs));
    b.launch("c", 2, 32, &spin(secs));
    b.set_vm_cap(capped, Some(40));
    let u = b.measure(WARMUP, WINDOW);
    eprintln!(
        "{backend:?} backend, a VM's own cap of 40 beside an uncapped VM of its class and one \
         outside busy loop, {WINDOW:?}:\n  capped VM {:.1} % of one CPU (bound 35..=41), \
         uncapped VM {:.1} %, outside loop {:.1} %",
        u[0],
        u[1],
        outside.pct()
    );
    if backend == Backend::Gate {
        print_scheduler(&b);
    }
    u[0]
}

#[test]
fn gate_vm_cap_holds_beside_an_outside_busy_loop() {
    let u = vm_cap_beside_a_loop(Backend::Gate);
    assert!((35.0..=41.0).contains(&u), "capped VM used {u:.1} %");
}

#[test]
fn cgroup_vm_cap_holds_beside_an_outside_busy_loop() {
    if corral_vmm::cgroup::detect().is_none() {
        eprintln!("SKIPPED: no cgroup cpu controller on this host");
        return;
    }
    let u = vm_cap_beside_a_loop(Backend::Cgroup);
    assert!((35.0..=41.0).contains(&u), "capped VM used {u:.1} %");
}

#[test]
fn gate_reservation_holds_beside_an_outside_busy_loop() {
    let _g = HOST.lock().unwrap_or_else(|p| p.into_inner());
    let outside = OutsideLoop::start();
    let mut b = Bench::new(Backend::Gate);
    b.class("res", class(1, None, Some(100)));
    b.class("x", class(10, None, None));
    b.class("y", class(10, None, None));
    let secs = (WARMUP + WINDOW).as_secs() + 10;
    b.launch("res", 2, 32, &spin(secs));
    b.launch("x", 2, 32, &spin(secs));
    b.launch("y", 2, 32, &spin(secs));
    let u = b.measure(WARMUP, WINDOW);
    let st = b.cpu().with(|s| s.stats());
    eprintln!(
        "gate backend, reservation 100 (shares 1) beside classes of shares 10 and 10 and one \
         outside busy loop, {WINDOW:?}:\n  reserved VM {:.1} % of one CPU (expected 100, bound \
         >= 95), others {:.1} % and {:.1} %, outside loop {:.1} %; shortfall {:.3} (expected 0)",
        u[0],
        u[1],
        u[2],
        outside.pct(),
        st.shortfall_ratio
    );
    print_scheduler(&b);
    assert!(u[0] >= 95.0, "reserved VM got {:.1} % of one CPU", u[0]);
    assert_eq!(st.shortfall_ratio, 0.0, "a 100 % reservation fits");
}

/// The add/attach race on a real VM. Class "capped" (10 %) already has a
/// spinning 2-vCPU VM that keeps its cap budget spent, so the policy parks
/// every VM of the class, a new one too. The new VM's vCPUs run before it
/// is attached (as between `builder::start` and `attach`); it is attached while
/// the policy's decision for it is "parked". Before the fix that park was
/// never applied (the policy emits changes only, and the VM then kept the
/// budget spent): it ran at ~100 % for good, the class far above its cap.
#[test]
fn gate_cap_holds_when_a_vm_is_attached_after_its_park() {
    let _g = HOST.lock().unwrap_or_else(|p| p.into_inner());
    let mut b = Bench::new(Backend::Gate);
    b.class("capped", class(1, Some(10), None));
    b.launch("capped", 2, 32, &spin(30));
    // The new VM, running before the scheduler knows its threads.
    let id = VmId(1000);
    let gate = Arc::new(Gate::new());
    let mut cfg = VmConfig::new("race", KernelSource::Bytes(probe_elf()));
    cfg.vcpus = 1;
    cfg.memory_mib = 32;
    cfg.cmdline = spin(30);
    cfg.sched_gate = Some(gate.clone());
    let handle = corral_vmm::start(&cfg).expect("start VM");
    b.cpu()
        .with(|s| s.add_vm(id, VmSpec::new("capped", 1)))
        .expect("admit VM");
    // Wait for a tick that parks it with the class budget well spent (the
    // decision then holds for several ticks), and attach right then.
    let t0 = Instant::now();
    let budget_ms = loop {
        let (parked, budget) = b.cpu().with(|s| {
            let st = s.stats();
            (s.is_parked(id), st.classes[0].cap_budget_ns.unwrap_or(0))
        });
        if parked == Some(true) && budget < -5_000_000 {
            break budget as f64 / 1e6;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "precondition: the policy never parked the new VM with the cap budget spent"
        );
        std::thread::sleep(Duration::from_micros(200));
    };
    b.cpu().attach(
        id,
        gate.clone(),
        handle.vcpu_tids().to_vec(),
        handle.device_tid().into_iter().collect(),
    );
    b.vms.push(Vm {
        handle,
        id,
        class: "capped".into(),
    });
    let window = Duration::from_secs(4);
    let u = b.measure(Duration::from_millis(500), window);
    let class = u[0] + u[1];
    eprintln!(
        "gate backend, a VM attached while its park was in force (class budget {budget_ms:.1} ms):\n  \
         class capped at 10 %: {class:.1} % of one CPU over {window:?} (old VM {:.1} %, new VM \
         {:.1} %; bound <= 13; before the fix the new VM ran at ~100 %), new VM's gate parks {}",
        u[0],
        u[1],
        gate.park_count()
    );
    print_scheduler(&b);
    assert!(class <= 13.0, "class capped at 10 % used {class:.1} %");
}

/// Two tenants 1:1, tenant-a's children 3:1, tenant-b's two VMs directly in
/// it; all four 2-vCPU VMs spin. Targets: 50/50 between the tenants and
/// 37.5/12.5 inside tenant-a, of the CPU the VMs got; returns the shares
/// (a-gold, a-bronze, tenant-b).
fn two_level_tree(backend: Backend) -> (f64, f64, f64) {
    let _g = HOST.lock().unwrap_or_else(|p| p.into_inner());
    let mut b = Bench::new(backend);
    b.class("tenant-a", class(100, None, None));
    b.class("tenant-b", class(100, None, None));
    b.class_in("a-gold", "tenant-a", class(300, None, None));
    b.class_in("a-bronze", "tenant-a", class(100, None, None));
    let secs = (WARMUP + WINDOW).as_secs() + 10;
    for c in ["a-gold", "a-bronze", "tenant-b", "tenant-b"] {
        b.launch(c, 2, 32, &spin(secs));
    }
    let u = b.measure(WARMUP, WINDOW);
    let total: f64 = u.iter().sum();
    let share = |x: f64| x * 100.0 / total;
    let (g, br, t) = (share(u[0]), share(u[1]), share(u[2] + u[3]));
    eprintln!(
        "{backend:?} backend, two-level class tree on a {:.0} % host, {WINDOW:?}:\n  tenant-a \
         {:.2} % (a-gold {g:.2} %, a-bronze {br:.2} %), tenant-b {t:.2} % of the VMs' {total:.1} %\n  \
         expected 50 (37.5, 12.5) and 50",
        host_cpus(),
        g + br
    );
    if backend == Backend::Gate {
        print_scheduler(&b);
    }
    (g, br, t)
}

/// Each share within `bound` points of its target.
fn check_tree((g, br, t): (f64, f64, f64), bound: f64) {
    eprintln!("  bound ± {bound} points each");
    assert!((g + br - 50.0).abs() <= bound, "tenant-a {:.2}", g + br);
    assert!((t - 50.0).abs() <= bound, "tenant-b {t:.2}");
    assert!((g - 37.5).abs() <= bound, "a-gold {g:.2}");
    assert!((br - 12.5).abs() <= bound, "a-bronze {br:.2}");
}

#[test]
fn gate_two_level_class_tree() {
    check_tree(two_level_tree(Backend::Gate), 2.0);
}

/// The same tree as nested cgroups, for comparison. The split is the
/// kernel's (CFS group weights), not corral's policy, so the bound is the
/// one of the other comparison test (± 5 points), not the gate's ± 2: on a
/// quiet host CFS lands within ± 1.4 points of every target (tenant-a
/// 48.9–50.3 %, a-gold 36.1–38.0 % in six runs), but in the CI run of stop 25
/// it gave tenant-a 46.54 % while the gate's tree passed in the same run.
/// ± 5 still fails on a tree that is not nested (flat, tenant-a would get
/// 66.7 %).
#[test]
fn cgroup_two_level_class_tree_for_comparison() {
    if corral_vmm::cgroup::detect().is_none() {
        eprintln!("SKIPPED: no cgroup cpu controller on this host");
        return;
    }
    check_tree(two_level_tree(Backend::Cgroup), 5.0);
}
