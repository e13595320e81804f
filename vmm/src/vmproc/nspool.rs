//! Namespaces made ahead of a VM process's start ([`NsPool`]): a fresh
//! network, IPC and UTS namespace, each given to exactly one VM process,
//! which its spawner moves into (`setns`) between `clone` and `exec`.
//!
//! Why: making a network namespace is most of a jail's cost (on this
//! host's 6.18 kernel, `unshare(CLONE_NEWNET)` took a median 709 µs of the
//! jail's 841 µs for all five kinds, `/tmp/js/nscost.c`-style loop, 40
//! runs, quiet host; IPC 64 µs and UTS 10 µs more than a bare `unshare`).
//! A thread of the launcher makes the next set while no VM is starting
//! (`SCHED_IDLE`, and [`REFILL_AFTER`] after the last start), so a VM created at a human pace finds one ready and its
//! start does not wait for it. The isolation is the same as the VM
//! process's own `unshare`: the set was made new for it, nothing else ever
//! joined it (the launcher's fds are closed once the VM process has
//! exec'd), and the VM process checks that they are not its spawner's
//! (`jail::enter`). An empty pool is no error: the VM process then makes
//! its own, as before.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rustix::thread::UnshareFlags;

use crate::util::{lock, wait_until};

/// One set of namespaces, made for one VM process.
#[derive(Debug)]
pub struct Spare {
    /// The network namespace (only `lo`, down).
    pub net: OwnedFd,
    /// The IPC namespace.
    pub ipc: OwnedFd,
    /// The UTS namespace (the VM process sets its host name).
    pub uts: OwnedFd,
}

/// What the VM process is told (`corral vmm --jail-ns LIST`).
pub const SPARE_KINDS: &str = "net,ipc,uts";

#[derive(Default)]
struct Shared {
    st: Mutex<State>,
    cv: Condvar,
}

#[derive(Default)]
struct State {
    ready: Vec<Spare>,
    /// The maker failed (a host that refuses a kind): it has stopped.
    failed: bool,
    /// When a set was last taken: the next is made [`REFILL_AFTER`] later.
    last_take: Option<Instant>,
}

/// How long after a VM process's start the next set is made. Making one
/// while a VM starts delays that VM, even at `SCHED_IDLE` (the network
/// namespace's set-up holds its CPU in the kernel, and the VM's memory
/// registration and irqchip wait for RCU grace periods): refilled at once,
/// the pooled start was the slowest of `bootbench jail-ab 21` (loaded
/// host, median 14.1 ms against 9.1 ms without the pool). A VM starts in a
/// few ms; this leaves a loaded host's start time too.
pub const REFILL_AFTER: Duration = Duration::from_millis(250);

/// Spare namespace sets, refilled by a thread of their own.
pub struct NsPool {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for NsPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NsPool").finish_non_exhaustive()
    }
}

/// Makes one set in the calling thread: `unshare` of the three kinds
/// (per thread: the rest of the process keeps its namespaces), and fds of
/// them from `/proc/thread-self/ns`.
fn make() -> std::io::Result<Spare> {
    // SAFETY: network, IPC and UTS namespaces are per thread and touch no
    // state shared with the process's other threads (no CLONE_FS or
    // CLONE_FILES is unshared); this thread makes no socket and holds no
    // IPC object.
    unsafe {
        rustix::thread::unshare_unsafe(
            UnshareFlags::NEWNET | UnshareFlags::NEWIPC | UnshareFlags::NEWUTS,
        )
    }?;
    let open = |k: &str| -> std::io::Result<OwnedFd> {
        Ok(rustix::fs::open(
            format!("/proc/thread-self/ns/{k}"),
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )?)
    };
    Ok(Spare {
        net: open("net")?,
        ipc: open("ipc")?,
        uts: open("uts")?,
    })
}

impl NsPool {
    /// Starts the maker thread, which keeps `depth` sets ready.
    pub fn start(depth: usize) -> std::io::Result<NsPool> {
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        std::thread::Builder::new()
            .name("ns-maker".into())
            .spawn(move || {
                let param = libc::sched_param { sched_priority: 0 };
                // SAFETY: sets this thread's policy from a param we own.
                unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
                loop {
                    {
                        let mut st = lock(&s.st);
                        loop {
                            let quiet = st.last_take.map(|t| t.elapsed());
                            match quiet {
                                _ if st.ready.len() >= depth => {
                                    st = s.cv.wait(st).unwrap_or_else(|p| p.into_inner());
                                }
                                Some(q) if q < REFILL_AFTER => {
                                    st =
                                        s.cv.wait_timeout(st, REFILL_AFTER - q)
                                            .unwrap_or_else(|p| p.into_inner())
                                            .0;
                                }
                                _ => break,
                            }
                        }
                    }
                    match make() {
                        Ok(spare) => {
                            lock(&s.st).ready.push(spare);
                            s.cv.notify_all();
                        }
                        Err(e) => {
                            tracing::warn!(
                                "cannot make spare namespaces ({e}): each VM process makes its own"
                            );
                            lock(&s.st).failed = true;
                            s.cv.notify_all();
                            return;
                        }
                    }
                }
            })?;
        Ok(NsPool { shared })
    }

    /// A ready set, if any (the maker then makes the next).
    pub fn take(&self) -> Option<Spare> {
        let mut st = lock(&self.shared.st);
        st.last_take = Some(Instant::now());
        let spare = st.ready.pop();
        drop(st);
        self.shared.cv.notify_all();
        spare
    }

    /// A set, waiting up to `timeout` for one (`bootbench`: each run
    /// starts as a VM created at a human pace does, with one ready).
    pub fn take_wait(&self, timeout: Duration) -> Option<Spare> {
        let deadline = Instant::now() + timeout;
        let got = wait_until(&self.shared.st, &self.shared.cv, deadline, |st| {
            if let Some(s) = st.ready.pop() {
                st.last_take = Some(Instant::now());
                Some(Some(s))
            } else {
                st.failed.then_some(None)
            }
        })
        .flatten();
        if got.is_some() {
            self.shared.cv.notify_all();
        }
        got
    }
}
