//! The scheduling gate of a VM that runs in its own process: how a park
//! reaches its vCPU threads ([`KickMode`]), and how the daemon learns the
//! VM's CPU time without one syscall per vCPU thread ([`process_cpu_ns`],
//! [`spawn_cpu_publisher`]).
//!
//! The gate itself is [`corral_scheduler::Gate`]: the daemon creates it
//! with `Gate::new_shared()` and passes the memfd to the VM process, which
//! maps it with `Gate::from_fd()`. Measured side by side in
//! `corral-bench gate` (BENCHMARKS.md, "Cross-process gate").

use std::sync::Arc;
use std::time::Duration;

use corral_scheduler::Gate;

use crate::util::kick_signal;

/// Who kicks a VM process's vCPU threads out of `KVM_RUN` on a park.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KickMode {
    /// The daemon's scheduler thread signals each vCPU thread by host tid
    /// (`tgkill(vm pid, tid, SIGRTMIN+1)`; the VM process's handler sets
    /// `immediate_exit`, as in one process). The default: see
    /// ARCHITECTURE.md for the figures.
    #[default]
    Signal,
    /// A watcher thread in the VM process sleeps on the gate's futex word
    /// and kicks its own vCPU threads when it sees a park.
    Watcher,
}

impl std::str::FromStr for KickMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "signal" => Ok(Self::Signal),
            "watcher" => Ok(Self::Watcher),
            o => Err(format!("unknown kick mode {o:?} (signal, watcher)")),
        }
    }
}

/// Daemon side, [`KickMode::Signal`]: a kick callback for `gate.set_kick`
/// that signals the threads `tids` (host tids) of process `pid`. `tgkill`
/// with the VM's pid as the thread group can reach no thread of another
/// process, whatever tids the VM process reported; a thread that is gone
/// is skipped (ESRCH).
pub fn signal_kick(pid: libc::pid_t, tids: Vec<libc::pid_t>) -> impl Fn() + Send + Sync + 'static {
    let sig = kick_signal();
    move || {
        for &tid in &tids {
            // SAFETY: tgkill takes plain integers; the worst a wrong tid
            // can do is fail.
            unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, sig) };
        }
    }
}

/// VM process side: sets up `gate` (its peer side, from `Gate::from_fd`)
/// for `mode`. With [`KickMode::Watcher`] it starts the watcher thread,
/// which runs the kick the builder registered on the gate (`kick_all`);
/// with [`KickMode::Signal`] there is nothing to start.
pub fn start_vm_side(
    gate: &Arc<Gate>,
    mode: KickMode,
    vm: &str,
) -> std::io::Result<Option<std::thread::JoinHandle<()>>> {
    match mode {
        KickMode::Signal => Ok(None),
        KickMode::Watcher => gate.spawn_watcher(&format!("gate-{vm}")).map(Some),
    }
}

/// The CPU time of every thread of process `pid` in ns: one
/// `clock_gettime` on the process's CPU clock, kept by the kernel (so a VM
/// process cannot misreport it). Guest time is included.
pub fn process_cpu_ns(pid: libc::pid_t) -> Option<u64> {
    // The kernel reads pid 0 as "the caller" (and !-1 is 0).
    if pid <= 0 {
        return None;
    }
    // CPUCLOCK_SCHED (2) of the process (no CPUCLOCK_PERTHREAD bit), with
    // the bitwise-negated pid above bit 3: clock_getcpuclockid's value.
    let clock = ((!pid) << 3) | 2;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we pass; an invalid
    // clock (process gone) returns an error.
    let r = unsafe { libc::clock_gettime(clock, &mut ts) };
    (r == 0).then(|| ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

/// The run time of one thread of another process, in ns, read from
/// `/proc/<pid>/task/<tid>/schedstat` (its first field, the scheduler's
/// `sum_exec_runtime`; guest time included). Thread CPU clocks
/// (`clock_gettime` by tid) work only within the caller's own thread group,
/// so the daemon cannot use them on a VM process's vCPU threads. The file
/// stays open: one `pread` per reading. Kept by the kernel, so trusted.
#[derive(Debug)]
pub struct ThreadRunTime {
    file: std::fs::File,
}

impl ThreadRunTime {
    /// Opens the schedstat file of thread `tid` of process `pid`.
    pub fn open(pid: libc::pid_t, tid: libc::pid_t) -> std::io::Result<Self> {
        let file = std::fs::File::open(format!("/proc/{pid}/task/{tid}/schedstat"))?;
        Ok(Self { file })
    }

    /// The thread's run time so far, ns (`None` once it is gone).
    pub fn read_ns(&self) -> Option<u64> {
        use std::os::unix::fs::FileExt;
        let mut buf = [0u8; 96];
        let n = self.file.read_at(&mut buf, 0).ok()?;
        let text = std::str::from_utf8(buf.get(..n)?).ok()?;
        text.split_ascii_whitespace().next()?.parse().ok()
    }
}

/// VM process side: a thread that publishes the CPU time of the vCPU
/// threads `tids` (this process's own tids) in `gate` every `period`, until
/// the gate is shut down. The daemon then reads the page instead of one
/// thread clock per vCPU. Measured: ~40 µs of the VM process's CPU per
/// publication here (the wake-up dominates), against the daemon's 0.7 µs
/// for four thread clocks; so it is only for a VM process whose host tids
/// the daemon does not know (`CpuScheduler::attach_process` with no tids).
pub fn spawn_cpu_publisher(
    gate: Arc<Gate>,
    tids: Vec<libc::pid_t>,
    period: Duration,
    name: &str,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let mut ns = vec![0u64; tids.len()];
            while !gate.is_shutdown() {
                for (n, tid) in ns.iter_mut().zip(&tids) {
                    if let Some(v) = crate::threadclock::thread_cpu_ns(*tid) {
                        *n = v;
                    }
                }
                gate.publish_cpu(&ns);
                std::thread::sleep(period);
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_clock_counts_every_thread() {
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        let a = process_cpu_ns(pid).unwrap();
        let spin = || {
            let t = crate::threadclock::own_thread_cpu_ns();
            while crate::threadclock::own_thread_cpu_ns() < t + 20_000_000 {
                std::hint::spin_loop();
            }
        };
        let t = std::thread::spawn(spin);
        spin();
        t.join().unwrap();
        let b = process_cpu_ns(pid).unwrap();
        assert!(b >= a + 40_000_000, "two threads of 20 ms: {} ns", b - a);
        assert_eq!(process_cpu_ns(-1), None);
    }

    #[test]
    fn the_publisher_publishes_the_threads_clocks() {
        let gate = Arc::new(Gate::new());
        // SAFETY: gettid has no preconditions.
        let me = unsafe { libc::gettid() };
        let p = spawn_cpu_publisher(gate.clone(), vec![me, me], Duration::from_millis(1), "pub")
            .unwrap();
        let mut out = [0u64; 4];
        let t0 = std::time::Instant::now();
        while gate.read_cpu(&mut out).1 < 2 {
            assert!(t0.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(gate.read_cpu(&mut out).0, 2);
        assert!(out[0] > 0 && out[1] > 0);
        gate.shutdown();
        p.join().unwrap();
    }

    #[test]
    fn schedstat_follows_a_thread_of_another_process() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .unwrap();
        let pid = child.id() as libc::pid_t;
        let t = ThreadRunTime::open(pid, pid).unwrap();
        let a = t.read_ns().unwrap();
        let t0 = std::time::Instant::now();
        while t.read_ns().unwrap() < a + 5_000_000 {
            assert!(t0.elapsed() < Duration::from_secs(10), "no run time");
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(ThreadRunTime::open(pid, pid).is_err() || t.read_ns().is_none());
    }

    #[test]
    fn kick_mode_parses() {
        assert_eq!("signal".parse(), Ok(KickMode::Signal));
        assert_eq!("watcher".parse(), Ok(KickMode::Watcher));
        assert!("x".parse::<KickMode>().is_err());
    }
}
