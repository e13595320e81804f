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
}

impl Accounts {
    /// Accounting for victim VM `victim` beside hog VM `hog`; takes the
    /// baselines of the threads that run now.
    pub(super) fn begin(mgr: &Manager, victim: &str, hog: Option<&str>) -> Self {
        let mut a = Self {
            seen: HashMap::new(),
            begun: false,
            victim: victim.to_string(),
            hog: hog.map(str::to_string),
            vcpus: [Vec::new(), Vec::new()],
            dev: [None, None],
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
            let e = self
                .seen
                .entry(key)
                .or_insert_with(|| (if begun { Sched::default() } else { now }, now));
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
