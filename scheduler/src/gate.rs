//! The gate vCPU threads wait on while their VM is parked.
//!
//! One [`Gate`] per VM, shared (`Arc<Gate>`) between the scheduler thread,
//! which calls [`park`](Gate::park)/[`unpark`](Gate::unpark), and the VM's
//! vCPU threads, which check [`is_parked`](Gate::is_parked) (one atomic
//! load) before each `KVM_RUN` and block in
//! [`wait_while_parked`](Gate::wait_while_parked) (Mutex + Condvar, no
//! spinning) when it is set.
//!
//! # Enforcement is level-triggered
//!
//! The scheduler thread makes every gate match the policy's *current*
//! decision ([`VmDecision::should_run`](crate::VmDecision::should_run)) at
//! every tick: it parks a gate that is open while the decision is "don't
//! run", and opens one that is parked while the decision is "run". It does
//! not rely on [`TickOutput::changes`](crate::TickOutput::changes) alone: a
//! change is emitted once, and one that could not be applied (the VM was
//! added to the model but not attached to the scheduler thread yet) would
//! be lost for good. Attaching a VM applies the decision in force, under
//! the scheduler thread's lock, so no tick falls between the two.
//! `park`/`unpark` are idempotent, so re-applying a decision costs one
//! atomic load per VM and tick.
//!
//! # The kick
//!
//! A vCPU spinning inside `KVM_RUN` never looks at the gate, so parking must
//! kick it out. The VMM registers a callback with
//! [`set_kick`](Gate::set_kick); it is called (outside any gate lock) every
//! time the gate goes from unparked to parked. Race-free use with
//! `immediate_exit`:
//!
//! ```text
//! vCPU thread                               kick callback (scheduler thread)
//! loop {                                    (gate already marked parked)
//!     kvm_run.immediate_exit = 0;           for each vCPU:
//!     if gate.is_parked() {                     kvm_run.immediate_exit = 1;
//!         if gate.wait_while_parked()           pthread_kill(tid, SIGRTMIN+n);
//!             == WaitOutcome::Shutdown { break }
//!         continue;
//!     }
//!     vcpu.run()  // EINTR => loop again
//! }
//! ```
//!
//! Because `park` publishes the parked flag (SeqCst) *before* the kick sets
//! `immediate_exit`, and the vCPU clears `immediate_exit` *before* checking
//! the flag, either the vCPU sees the flag, or its `KVM_RUN` sees
//! `immediate_exit = 1` and returns at once: a park is never missed once
//! the gate is parked. (A kick is sent only on the open → parked
//! transition; there is no re-kick. The "lost kick" once seen in CI, a
//! capped VM running at 98 % while parked, matches the add/attach race
//! above: the issue reproduced it in 5 of 14 launches, all with 0 re-kicks,
//! since a re-kick keyed on a gate that was never parked.) [`waiting`](Gate::waiting)
//! counts the threads blocked on the gate, so the scheduler knows when a
//! parked VM is off the CPU for sure.
//!
//! # Shutdown
//!
//! [`shutdown`](Gate::shutdown) releases all current and future waiters for
//! good (they get [`WaitOutcome::Shutdown`]), so a VM being torn down never
//! leaves a vCPU thread stuck on a parked gate.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use crate::policy::Action;

/// Callback run when a gate gets parked.
pub type KickFn = Arc<dyn Fn() + Send + Sync>;

/// Why [`Gate::wait_while_parked`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitOutcome {
    /// The gate is (or was found) unparked: go on running the vCPU.
    Running,
    /// The gate was shut down: the vCPU thread should exit.
    Shutdown,
}

#[derive(Debug, Default)]
struct State {
    parked: bool,
    shutdown: bool,
}

/// A park/unpark gate for the vCPU threads of one VM. See the
/// [module docs](self).
pub struct Gate {
    parked: AtomicBool,
    shutdown: AtomicBool,
    state: Mutex<State>,
    cv: Condvar,
    kick: RwLock<Option<KickFn>>,
    parks: AtomicU64,
    /// Threads blocked in a wait right now.
    waiting: AtomicU64,
}

impl fmt::Debug for Gate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gate")
            .field("parked", &self.is_parked())
            .field("shutdown", &self.is_shutdown())
            .field("parks", &self.park_count())
            .finish()
    }
}

impl Default for Gate {
    fn default() -> Self {
        Self::new()
    }
}

impl Gate {
    /// A new, unparked gate without kick callback.
    pub fn new() -> Self {
        Gate {
            parked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            kick: RwLock::new(None),
            parks: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is two bools: a panic elsewhere cannot leave it torn.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Parks the gate. On a transition from unparked (and not shut down) it
    /// calls the kick callback and returns `true`; otherwise it does nothing
    /// and returns `false`.
    pub fn park(&self) -> bool {
        {
            let mut st = self.lock();
            if st.parked || st.shutdown {
                return false;
            }
            st.parked = true;
            self.parked.store(true, Ordering::SeqCst);
        }
        self.parks.fetch_add(1, Ordering::Relaxed);
        let kick = self.kick.read().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(kick) = kick {
            kick();
        }
        true
    }

    /// Unparks the gate and wakes all waiters. Returns `true` if it was
    /// parked.
    pub fn unpark(&self) -> bool {
        let was = {
            let mut st = self.lock();
            let was = st.parked;
            st.parked = false;
            self.parked.store(false, Ordering::SeqCst);
            was
        };
        if was {
            self.cv.notify_all();
        }
        was
    }

    /// Applies a policy [`Action`]; returns whether the state changed.
    pub fn apply(&self, action: Action) -> bool {
        match action {
            Action::Park => self.park(),
            Action::Unpark => self.unpark(),
        }
    }

    /// Cheap check for the vCPU loop (one SeqCst atomic load).
    #[inline]
    pub fn is_parked(&self) -> bool {
        self.parked.load(Ordering::SeqCst)
    }

    /// Blocks the calling thread while the gate is parked (returns at once
    /// if it is not). No spinning: waits on a condition variable.
    pub fn wait_while_parked(&self) -> WaitOutcome {
        let mut st = self.lock();
        if st.parked && !st.shutdown {
            self.waiting.fetch_add(1, Ordering::SeqCst);
            while st.parked && !st.shutdown {
                st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        }
        if st.shutdown {
            WaitOutcome::Shutdown
        } else {
            WaitOutcome::Running
        }
    }

    /// How many threads are blocked on the gate right now (for a VM: vCPUs
    /// that are parked and off the CPU for sure).
    pub fn waiting(&self) -> u64 {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Like [`wait_while_parked`](Self::wait_while_parked) but gives up
    /// after `timeout`; returns `None` if still parked then.
    pub fn wait_while_parked_timeout(&self, timeout: Duration) -> Option<WaitOutcome> {
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        while st.parked && !st.shutdown {
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Some(if st.shutdown {
            WaitOutcome::Shutdown
        } else {
            WaitOutcome::Running
        })
    }

    /// Shuts the gate down for good: wakes every waiter with
    /// [`WaitOutcome::Shutdown`], makes future waits return at once, and
    /// ignores later [`park`](Self::park) calls.
    pub fn shutdown(&self) {
        {
            let mut st = self.lock();
            st.shutdown = true;
            st.parked = false;
            self.shutdown.store(true, Ordering::SeqCst);
            self.parked.store(false, Ordering::SeqCst);
        }
        self.cv.notify_all();
    }

    /// Whether [`shutdown`](Self::shutdown) was called.
    pub fn is_shutdown(&self) -> bool {
        self.shutdown.load(Ordering::SeqCst)
    }

    /// Registers the callback run on every park transition (replacing any
    /// previous one). It runs on the thread that parks (the scheduler
    /// thread), outside the gate's locks; it must be quick and must not
    /// block on the vCPU threads.
    pub fn set_kick(&self, kick: impl Fn() + Send + Sync + 'static) {
        *self.kick.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(kick));
    }

    /// Removes the kick callback.
    pub fn clear_kick(&self) {
        *self.kick.write().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// How many times the gate went from unparked to parked.
    pub fn park_count(&self) -> u64 {
        self.parks.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::thread;

    #[test]
    fn park_unpark_transitions() {
        let g = Gate::new();
        assert!(!g.is_parked());
        assert_eq!(g.wait_while_parked(), WaitOutcome::Running);
        assert!(g.park());
        assert!(!g.park());
        assert!(g.is_parked());
        assert_eq!(g.wait_while_parked_timeout(Duration::from_millis(5)), None);
        assert!(g.unpark());
        assert!(!g.unpark());
        assert!(g.apply(Action::Park));
        assert!(g.apply(Action::Unpark));
        assert_eq!(g.park_count(), 2);
    }

    #[test]
    fn kick_runs_once_per_park() {
        let g = Gate::new();
        let kicks = Arc::new(AtomicUsize::new(0));
        let k = kicks.clone();
        g.set_kick(move || {
            k.fetch_add(1, Ordering::SeqCst);
        });
        g.park();
        g.park();
        g.unpark();
        g.park();
        assert_eq!(kicks.load(Ordering::SeqCst), 2);
        g.clear_kick();
        g.unpark();
        g.park();
        assert_eq!(kicks.load(Ordering::SeqCst), 2);
    }

    /// Simulated vCPU threads: spin "running" while unparked, block on the
    /// gate while parked. Parking stops all progress; unparking resumes it.
    #[test]
    fn threads_stop_while_parked_and_resume() {
        let gate = Arc::new(Gate::new());
        let progress = Arc::new(AtomicU64::new(0));
        let kicked = Arc::new(AtomicUsize::new(0));
        {
            let k = kicked.clone();
            gate.set_kick(move || {
                k.fetch_add(1, Ordering::SeqCst);
            });
        }
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let gate = gate.clone();
                let progress = progress.clone();
                thread::spawn(move || {
                    loop {
                        if gate.is_parked() {
                            if gate.wait_while_parked() == WaitOutcome::Shutdown {
                                return;
                            }
                            continue;
                        }
                        if gate.is_shutdown() {
                            return;
                        }
                        progress.fetch_add(1, Ordering::Relaxed);
                        thread::yield_now();
                    }
                })
            })
            .collect();

        let wait_progress = |from: u64| {
            let t0 = Instant::now();
            while progress.load(Ordering::Relaxed) <= from + 100 {
                assert!(t0.elapsed() < Duration::from_secs(10), "no progress");
                thread::yield_now();
            }
        };
        wait_progress(0);
        for _ in 0..3 {
            gate.park();
            // Let in-flight iterations finish, then check progress froze.
            thread::sleep(Duration::from_millis(20));
            let frozen = progress.load(Ordering::Relaxed);
            thread::sleep(Duration::from_millis(30));
            assert_eq!(progress.load(Ordering::Relaxed), frozen, "ran while parked");
            gate.unpark();
            wait_progress(frozen);
        }
        assert_eq!(kicked.load(Ordering::SeqCst), 3);

        // Shutdown releases threads blocked on a parked gate.
        gate.park();
        thread::sleep(Duration::from_millis(20));
        gate.shutdown();
        assert!(!gate.park(), "park after shutdown is ignored");
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(gate.wait_while_parked(), WaitOutcome::Shutdown);
    }

    #[test]
    fn timeout_wait_sees_unpark_from_other_thread() {
        let gate = Arc::new(Gate::new());
        gate.park();
        let g = gate.clone();
        let t = thread::spawn(move || g.wait_while_parked_timeout(Duration::from_secs(10)));
        thread::sleep(Duration::from_millis(10));
        gate.unpark();
        assert_eq!(t.join().unwrap(), Some(WaitOutcome::Running));
    }
}
