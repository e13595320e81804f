//! Per-thread accounting during a victim's run: the run time, the run-queue
//! wait and the number of times on a CPU (`/proc/self/task/TID/schedstat`)
//! of the victim's and the hog's vCPU and device threads, and of the CPU
//! scheduler's thread. Unlike wall-clock figures these hold on a loaded
//! host: a thread that waited to run was runnable and did not get a CPU,
//! whoever took it.

use std::collections::HashMap;

use corral_vmm::manager::Manager;

/// The threads accounted, in this order in [`Accounts::totals`].
pub(super) const ROLES: [&str; 5] = [
    "victim vCPU",
    "victim device",
    "hog vCPU",
    "hog device",
    "scheduler",
];
const VICTIM_VCPU: usize = 0;
const VICTIM_DEV: usize = 1;
const HOG_VCPU: usize = 2;
const HOG_DEV: usize = 3;
const SCHED: usize = 4;

/// One thread's `schedstat`: on-CPU ns, run-queue wait ns, times scheduled
/// in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Sched {
    pub(super) run_ns: u64,
    pub(super) wait_ns: u64,
    pub(super) slices: u64,
}

impl Sched {
    fn parse(s: &str) -> Option<Self> {
        let mut f = s.split_whitespace().map(|v| v.parse::<u64>().ok());
        Some(Self {
            run_ns: f.next()??,
            wait_ns: f.next()??,
            slices: f.next()??,
        })
    }

    fn of(tid: libc::pid_t) -> Option<Self> {
        Self::parse(&std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?)
    }

    fn minus(self, base: Self) -> Self {
        Self {
            run_ns: self.run_ns.saturating_sub(base.run_ns),
            wait_ns: self.wait_ns.saturating_sub(base.wait_ns),
            slices: self.slices.saturating_sub(base.slices),
        }
    }

    fn plus(self, o: Self) -> Self {
        Self {
            run_ns: self.run_ns + o.run_ns,
            wait_ns: self.wait_ns + o.wait_ns,
            slices: self.slices + o.slices,
        }
    }
}

/// `struct sched_attr` as of Linux 3.14 (`SCHED_ATTR_SIZE_VER0`).
#[repr(C)]
#[derive(Debug, Default)]
struct SchedAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    runtime: u64,
    deadline: u64,
    period: u64,
}

/// Gives thread `tid` (normal policy) a custom EEVDF slice of `ns` (Linux
/// 6.12 and later take `sched_runtime` as the slice of a normal task; the
/// kernel clamps it to 0.1..100 ms), keeping its nice. A thread with a
/// shorter slice than the one running preempts it on wake-up, and the
/// running one is protected for its slice only: an experiment knob for
/// the wake-up latency of I/O-bound VMs beside CPU-bound ones.
pub(super) fn set_slice(tid: libc::pid_t, ns: u64) -> std::io::Result<()> {
    // SAFETY: getpriority reads a thread's nice; no memory is passed.
    let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t) };
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        policy: libc::SCHED_OTHER as u32,
        nice,
        runtime: ns,
        ..Default::default()
    };
    // SAFETY: sched_setattr reads `size` bytes of a valid, initialised
    // struct sched_attr that outlives the call.
    let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, tid, &attr as *const SchedAttr, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The custom slice of thread `tid`, ns.
#[cfg(test)]
fn slice_of(tid: libc::pid_t) -> std::io::Result<u64> {
    let mut attr = SchedAttr::default();
    // SAFETY: sched_getattr writes at most `size` (the struct's) bytes into
    // `attr`, which lives across the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            tid,
            &mut attr as *mut SchedAttr,
            std::mem::size_of::<SchedAttr>() as u32,
            0,
        )
    };
    if rc == 0 {
        Ok(attr.runtime)
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The device thread of VM `name` (named `dev-NAME`, cut to the 15 bytes a
/// thread name holds): the newest such thread of this process.
fn device_tid(name: &str) -> Option<libc::pid_t> {
    let comm: String = format!("dev-{name}").chars().take(15).collect();
    threads_named(|c| c == comm).into_iter().max()
}

fn threads_named(f: impl Fn(&str) -> bool) -> Vec<libc::pid_t> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<libc::pid_t>().ok())
        .filter(|tid| {
            std::fs::read_to_string(format!("/proc/self/task/{tid}/comm"))
                .is_ok_and(|c| f(c.trim_end()))
        })
        .collect()
}

/// The accounting of one victim run. Threads that exist when it begins
/// count from their reading then; threads that start later (the victim's,
/// a restarted hog's) from zero. A thread that has exited keeps its last
/// reading.
pub(super) struct Accounts {
    /// (role, tid) -> (baseline, last reading).
    seen: HashMap<(usize, libc::pid_t), (Sched, Sched)>,
    begun: bool,
    victim: String,
    hog: Option<String>,
    /// The tids last looked up, to find the device threads again only when
    /// a VM was replaced.
    vcpus: [Vec<libc::pid_t>; 2],
    dev: [Option<libc::pid_t>; 2],
    /// A custom slice given to the VMs' vCPU and device threads when they
    /// are first seen (`--slice-us`).
    slice_ns: Option<u64>,
}

impl Accounts {
    /// Accounting for victim VM `victim` beside hog VM `hog`; takes the
    /// baselines of the threads that run now.
    pub(super) fn begin(
        mgr: &Manager,
        victim: &str,
        hog: Option<&str>,
        slice_ns: Option<u64>,
    ) -> Self {
        let mut a = Self {
            seen: HashMap::new(),
            begun: false,
            victim: victim.to_string(),
            hog: hog.map(str::to_string),
            vcpus: [Vec::new(), Vec::new()],
            dev: [None, None],
            slice_ns,
        };
        a.sample(mgr);
        a.begun = true;
        a
    }

    /// Reads every accounted thread.
    pub(super) fn sample(&mut self, mgr: &Manager) {
        let vms = mgr.sched_vms();
        let names = [Some(self.victim.clone()), self.hog.clone()];
        let mut tids: Vec<(usize, libc::pid_t)> = Vec::new();
        for (k, name) in names.iter().enumerate() {
            let Some(name) = name else { continue };
            let (vcpu_role, dev_role) = if k == 0 {
                (VICTIM_VCPU, VICTIM_DEV)
            } else {
                (HOG_VCPU, HOG_DEV)
            };
            let vcpus = vms
                .iter()
                .find(|v| v.name == *name)
                .map(|v| v.vcpu_tids.clone())
                .unwrap_or_default();
            if vcpus != self.vcpus[k] || self.dev[k].is_none() {
                self.dev[k] = device_tid(name);
                self.vcpus[k] = vcpus;
            }
            tids.extend(self.vcpus[k].iter().map(|t| (vcpu_role, *t)));
            tids.extend(self.dev[k].map(|t| (dev_role, t)));
        }
        if !self.begun {
            tids.extend(
                threads_named(|c| c == "cpusched")
                    .into_iter()
                    .map(|t| (SCHED, t)),
            );
        } else {
            let sched: Vec<_> = self
                .seen
                .keys()
                .filter(|(r, _)| *r == SCHED)
                .copied()
                .collect();
            tids.extend(sched);
        }
        for key in tids {
            let Some(now) = Sched::of(key.1) else {
                continue;
            };
            let begun = self.begun;
            let slice = self.slice_ns.filter(|_| key.0 != SCHED);
            let e = self.seen.entry(key).or_insert_with(|| {
                if let Some(ns) = slice
                    && let Err(e) = set_slice(key.1, ns)
                {
                    eprintln!("corral-bench: no custom slice for thread {}: {e}", key.1);
                }
                (if begun { Sched::default() } else { now }, now)
            });
            e.1 = now;
        }
    }

    /// Per role (in [`ROLES`] order): what its threads did since `begin`.
    pub(super) fn totals(&self) -> [Sched; 5] {
        let mut t = [Sched::default(); 5];
        for ((role, _), (base, last)) in &self.seen {
            if let Some(slot) = t.get_mut(*role) {
                *slot = slot.plus(last.minus(*base));
            }
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A custom slice set on a thread reads back (Linux 6.12+; older
    /// kernels refuse or ignore `sched_runtime` for normal tasks).
    #[test]
    fn sets_a_custom_slice() {
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() };
            let before = slice_of(tid);
            let set = set_slice(tid, 200_000);
            tx.send((before, set.map(|_| slice_of(tid)))).unwrap();
        });
        let (before, after) = rx.recv().unwrap();
        t.join().unwrap();
        match after {
            Ok(Ok(ns)) if before.as_ref().is_ok_and(|b| *b != 0) => assert_eq!(ns, 200_000),
            other => eprintln!("custom slices not supported here: {before:?} {other:?}"),
        }
    }

    #[test]
    fn parses_schedstat() {
        assert_eq!(
            Sched::parse("123456 789 42\n"),
            Some(Sched {
                run_ns: 123_456,
                wait_ns: 789,
                slices: 42
            })
        );
        assert_eq!(Sched::parse("1 2"), None);
        assert_eq!(Sched::parse("x 2 3"), None);
    }

    /// This thread's own reading grows while it spins, and a thread named
    /// like a VM's device thread is found by its name.
    #[test]
    fn reads_this_process_threads() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::Builder::new()
            .name("dev-victim-io-3-x".chars().take(15).collect())
            .spawn(move || {
                // SAFETY: gettid has no preconditions.
                tx.send(unsafe { libc::gettid() }).unwrap();
                let _ = stop_rx.recv();
            })
            .unwrap();
        let tid = rx.recv().unwrap();
        assert_eq!(device_tid("victim-io-3-x"), Some(tid));
        assert_eq!(device_tid("victim-io-4"), None);
        // SAFETY: gettid has no preconditions.
        let me = unsafe { libc::gettid() };
        // Spin until this thread has run 5 ms more (however loaded the
        // host, within 20 s of wall time).
        let a = Sched::of(me).unwrap();
        let t0 = std::time::Instant::now();
        let mut b = a;
        while b.minus(a).run_ns < 5_000_000 && t0.elapsed() < std::time::Duration::from_secs(20) {
            std::hint::spin_loop();
            b = Sched::of(me).unwrap();
        }
        assert!(b.minus(a).run_ns >= 5_000_000, "{a:?} {b:?}");
        assert!(b.slices >= a.slices);
        stop_tx.send(()).unwrap();
        t.join().unwrap();
    }
}
