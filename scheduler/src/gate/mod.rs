//! The gate vCPU threads wait on while their VM is parked.
//!
//! One [`Gate`] per VM. Its state is a block of atomics in one page of
//! memory ([`shm`]): a futex word (parked, shut down, a transition
//! sequence) and counters. The scheduler calls
//! [`park`](Gate::park)/[`unpark`](Gate::unpark); the VM's vCPU threads
//! check [`is_parked`](Gate::is_parked) (one atomic load) before each
//! `KVM_RUN` and block in [`wait_while_parked`](Gate::wait_while_parked)
//! (a futex wait on the word, no spinning) when it is set.
//!
//! The same code serves two set-ups:
//!
//! * **In one process** ([`Gate::new`], `Arc<Gate>` shared between
//!   threads): the page is an anonymous mapping.
//! * **Across processes** (the daemon schedules, the VM runs in its own
//!   process): the daemon creates the gate with [`Gate::new_shared`], which
//!   returns a sealed memfd (no shrink, no grow, no new seals) that it
//!   passes to the VM process; that process maps it with
//!   [`Gate::from_fd`]. The futex is a shared one (no `FUTEX_PRIVATE_FLAG`),
//!   so a wake in the daemon reaches a waiter in the VM process.
//!
//! # Who may write what
//!
//! The side that created the gate is its *owner* (trusted: the daemon),
//! the side that mapped the fd its *peer* (untrusted: a VM process, which
//! can write anything into the page). The owner keeps its own copy of the
//! state word and never reads the shared one, nor waits on it; the peer's
//! counters ([`waiting`](Gate::waiting), the published CPU times of
//! [`read_cpu`](Gate::read_cpu)) are plain numbers it compares or clamps.
//! So the owner never panics or blocks on what a peer wrote. A peer that
//! ignores the gate escapes only the gate (the `cgroup` backend's
//! `cpu.max` is the fence that holds against a hostile VM process). The
//! table of fields is in [`shm`]. On the peer side `park`/`unpark` do
//! nothing (the decision is the owner's) and [`shutdown`](Gate::shutdown)
//! releases the peer's own waiters.
//!
//! # When the owner goes, and a new one comes ([`handover`])
//!
//! A VM process whose daemon died must not stay parked on a word nobody
//! will open: the peer [`release`](Gate::release)s the gate (its own
//! threads treat it as open, whatever the word says) and
//! [`resume`](Gate::resume)s obeying the word when a new daemon adopts it.
//! That daemon gets the memfd back from the VM process and maps it as the
//! owner again with [`Gate::reattach`]: it checks the fd as the peer does
//! (a sealed memfd of one page; an fd of another kind is refused, so a VM
//! process cannot hand it a file whose mapping could block or shrink),
//! takes nothing from the page but the transition sequence (any value is
//! a valid one), and starts open with a park count of 0.
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
//! atomic load per VM and tick (of the owner's own copy: a peer that
//! rewrites the shared word cannot make the owner skip a transition).
//!
//! # The kick
//!
//! A vCPU spinning inside `KVM_RUN` never looks at the gate, so parking must
//! kick it out. Callbacks registered with [`set_kick`](Gate::set_kick) run
//! on every transition from unparked to parked, outside any gate lock:
//!
//! * on the owner, by [`park`](Gate::park) itself (in one process: signal
//!   the vCPU threads; across processes: `tgkill(vm pid, host tid, sig)`
//!   from the daemon);
//! * on either side, by a *watcher* thread ([`spawn_watcher`](Gate::spawn_watcher))
//!   that sleeps on the futex word and calls the callback when it sees a
//!   new park (across processes: the VM process kicks itself).
//!
//! Race-free use with `immediate_exit`:
//!
//! ```text
//! vCPU thread                               kick callback
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
//! # Wake-ups
//!
//! A transition stores the new word, then wakes the futex only if a
//! waiter or watcher is counted (both SeqCst: a waiter counts itself
//! before it re-reads the word, so either the waker sees the count or the
//! waiter sees the new word). A peer that under-reports its waiters delays
//! only its own vCPUs; one that over-reports costs the owner one wake per
//! transition.
//!
//! # Shutdown
//!
//! [`shutdown`](Gate::shutdown) releases all current and future waiters for
//! good (they get [`WaitOutcome::Shutdown`]), so a VM being torn down never
//! leaves a vCPU thread stuck on a parked gate.

use std::fmt;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::policy::Action;

pub mod cpu;
mod handover;
pub mod shm;

use shm::{Block, Mapping, PARKED, SEQ, SHUTDOWN};

pub use cpu::{CpuClamp, MAX_PUBLISHED_VCPUS};

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

/// Which side of a gate this handle is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Created the gate ([`Gate::new`], [`Gate::new_shared`]): decides.
    Owner,
    /// Mapped it from an fd ([`Gate::from_fd`]): waits, publishes.
    Peer,
}

/// A park/unpark gate for the vCPU threads of one VM. See the
/// [module docs](self).
pub struct Gate {
    map: Mapping,
    side: Side,
    /// The page is a memfd shared with another process.
    shared: bool,
    /// The owner's copy of the state word (the shared one may be rewritten
    /// by the peer; the owner never reads it).
    mine: AtomicU32,
    /// The owner's park count.
    parks: AtomicU64,
    /// Peer: this process shut the gate down (its own threads stop).
    local_shutdown: AtomicBool,
    /// Peer: the owner is gone, so this process opened the gate for its
    /// own threads ([`release`](Gate::release)) until a new owner
    /// [`resume`](Gate::resume)s it.
    released: AtomicBool,
    /// Serialises the owner's transitions (word update and store).
    transition: Mutex<()>,
    kick: RwLock<Option<KickFn>>,
}

impl fmt::Debug for Gate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gate")
            .field("side", &self.side)
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
    fn with_map(map: Mapping, side: Side, shared: bool) -> Self {
        if side == Side::Owner {
            let b = map.block();
            b.magic.store(shm::MAGIC, Ordering::SeqCst);
            b.version.store(shm::VERSION, Ordering::SeqCst);
        }
        Gate {
            map,
            side,
            shared,
            mine: AtomicU32::new(0),
            parks: AtomicU64::new(0),
            local_shutdown: AtomicBool::new(false),
            released: AtomicBool::new(false),
            transition: Mutex::new(()),
            kick: RwLock::new(None),
        }
    }

    /// A new, unparked gate for use inside this process, without kick
    /// callback. Its page is an anonymous mapping (panics only if the
    /// kernel cannot map one page, as an allocation would abort).
    pub fn new() -> Self {
        let map = Mapping::anonymous()
            .unwrap_or_else(|e| panic!("gate: cannot map its page of memory: {e}"));
        Self::with_map(map, Side::Owner, false)
    }

    /// A new, unparked gate to share with another process: this side is
    /// the owner; pass the returned memfd (close-on-exec, sealed against
    /// shrinking and growing) to the other process, which maps it with
    /// [`from_fd`](Self::from_fd). The fd may be closed once sent.
    pub fn new_shared() -> io::Result<(Arc<Gate>, OwnedFd)> {
        let (map, fd) = Mapping::memfd()?;
        Ok((Arc::new(Self::with_map(map, Side::Owner, true)), fd))
    }

    /// The peer side of a gate created by [`new_shared`](Self::new_shared)
    /// in another process. Checks the fd's size and seals, and the block's
    /// magic and version.
    pub fn from_fd(fd: OwnedFd) -> io::Result<Arc<Gate>> {
        let map = Mapping::from_fd(&fd)?;
        let b = map.block();
        let (magic, version) = (
            b.magic.load(Ordering::SeqCst),
            b.version.load(Ordering::SeqCst),
        );
        if magic != shm::MAGIC || version != shm::VERSION {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "gate fd: magic {magic:#x} version {version}, want {:#x} version {}",
                    shm::MAGIC,
                    shm::VERSION
                ),
            ));
        }
        Ok(Arc::new(Self::with_map(map, Side::Peer, true)))
    }

    /// Which side of the gate this handle is.
    pub fn side(&self) -> Side {
        self.side
    }

    /// Whether the page is shared with another process.
    pub fn is_shared(&self) -> bool {
        self.shared
    }

    fn block(&self) -> &Block {
        self.map.block()
    }

    /// The state this side acts on: the owner's own copy, or (peer) the
    /// shared word plus this process's shutdown, and never parked while
    /// released.
    fn current(&self) -> u32 {
        match self.side {
            Side::Owner => self.mine.load(Ordering::SeqCst),
            Side::Peer => {
                let local = if self.local_shutdown.load(Ordering::SeqCst) {
                    SHUTDOWN
                } else {
                    0
                };
                let s = self.block().state.load(Ordering::SeqCst) | local;
                if self.released.load(Ordering::SeqCst) {
                    s & !PARKED
                } else {
                    s
                }
            }
        }
    }

    /// Owner: applies `f` to the state word; `None` leaves it alone.
    /// Returns the old word if it changed.
    fn transition(&self, f: impl Fn(u32) -> Option<u32>) -> Option<u32> {
        if self.side != Side::Owner {
            return None;
        }
        let _t = self.transition.lock().unwrap_or_else(|e| e.into_inner());
        let old = self.mine.load(Ordering::SeqCst);
        let new = f(old)?.wrapping_add(SEQ);
        self.mine.store(new, Ordering::SeqCst);
        self.block().state.store(new, Ordering::SeqCst);
        Some(old)
    }

    /// Wakes the futex sleepers if any is counted.
    fn wake(&self) {
        let b = self.block();
        if b.waiting.load(Ordering::SeqCst) != 0 || b.watchers.load(Ordering::SeqCst) != 0 {
            shm::wake_all(&b.state);
        }
    }

    fn run_kick(&self) {
        let kick = self.kick.read().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(kick) = kick {
            kick();
        }
    }

    /// Parks the gate. On a transition from unparked (and not shut down) it
    /// calls the kick callback and returns `true`; otherwise it does nothing
    /// and returns `false`. A no-op on the peer side.
    pub fn park(&self) -> bool {
        let changed = self.transition(|s| (s & (PARKED | SHUTDOWN) == 0).then_some(s | PARKED));
        if changed.is_none() {
            return false;
        }
        let parks = self.parks.fetch_add(1, Ordering::Relaxed) + 1;
        self.block().parks.store(parks, Ordering::Relaxed);
        self.wake(); // for watchers
        self.run_kick();
        true
    }

    /// Unparks the gate and wakes all waiters. Returns `true` if it was
    /// parked. A no-op on the peer side.
    pub fn unpark(&self) -> bool {
        let changed = self.transition(|s| (s & PARKED != 0).then_some(s & !PARKED));
        if changed.is_some() {
            self.wake();
        }
        changed.is_some()
    }

    /// Applies a policy [`Action`]; returns whether the state changed.
    pub fn apply(&self, action: Action) -> bool {
        match action {
            Action::Park => self.park(),
            Action::Unpark => self.unpark(),
        }
    }

    /// Cheap check for the vCPU loop (one or two SeqCst atomic loads).
    #[inline]
    pub fn is_parked(&self) -> bool {
        let s = self.current();
        s & PARKED != 0 && s & SHUTDOWN == 0
    }

    /// Blocks the calling thread while the gate is parked (returns at once
    /// if it is not). No spinning: sleeps on the futex word.
    pub fn wait_while_parked(&self) -> WaitOutcome {
        self.wait_until(None).unwrap_or(WaitOutcome::Running)
    }

    /// Like [`wait_while_parked`](Self::wait_while_parked) but gives up
    /// after `timeout`; returns `None` if still parked then.
    pub fn wait_while_parked_timeout(&self, timeout: Duration) -> Option<WaitOutcome> {
        self.wait_until(Some(Instant::now() + timeout))
    }

    fn wait_until(&self, deadline: Option<Instant>) -> Option<WaitOutcome> {
        let b = self.block();
        let mut counted = false;
        let out = loop {
            // The shared word first, then the decision: a transition stores
            // the owner's copy before the shared word, so a word read
            // before the transition makes the futex wait return at once.
            let word = b.state.load(Ordering::SeqCst);
            let s = self.current();
            if s & SHUTDOWN != 0 {
                break Some(WaitOutcome::Shutdown);
            }
            if s & PARKED == 0 {
                break Some(WaitOutcome::Running);
            }
            if !counted {
                // Count ourselves, then read again (see "Wake-ups").
                b.waiting.fetch_add(1, Ordering::SeqCst);
                counted = true;
                continue;
            }
            let left = match deadline {
                None => None,
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left.as_nanos() as u64),
                    _ => break None,
                },
            };
            shm::wait(&b.state, word, left);
        };
        if counted {
            b.waiting.fetch_sub(1, Ordering::SeqCst);
        }
        out
    }

    /// How many threads are blocked on the gate right now (for a VM: vCPUs
    /// that are parked and off the CPU for sure). On the owner of a shared
    /// gate this is the peer's count: untrusted, compare it only.
    pub fn waiting(&self) -> u64 {
        u64::from(self.block().waiting.load(Ordering::SeqCst))
    }

    /// Shuts the gate down for good: wakes every waiter with
    /// [`WaitOutcome::Shutdown`], makes future waits return at once, and
    /// ignores later [`park`](Self::park) calls. On the peer side it
    /// releases this process's waiters (the VM stopping itself) and marks
    /// the shared word shut down for them.
    pub fn shutdown(&self) {
        match self.side {
            Side::Owner => {
                self.transition(|s| {
                    (s & SHUTDOWN == 0 || s & PARKED != 0).then_some((s | SHUTDOWN) & !PARKED)
                });
            }
            Side::Peer => {
                self.local_shutdown.store(true, Ordering::SeqCst);
                self.block().state.fetch_or(SHUTDOWN, Ordering::SeqCst);
            }
        }
        shm::wake_all(&self.block().state);
    }

    /// Whether [`shutdown`](Self::shutdown) was called (on either side, as
    /// this side sees it).
    pub fn is_shutdown(&self) -> bool {
        self.current() & SHUTDOWN != 0
    }

    /// Registers the callback run on every park transition (replacing any
    /// previous one). It runs on the thread that parks (the scheduler
    /// thread) or on the gate's watcher, outside the gate's locks; it must
    /// be quick and must not block on the vCPU threads.
    pub fn set_kick(&self, kick: impl Fn() + Send + Sync + 'static) {
        *self.kick.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(kick));
    }

    /// Removes the kick callback.
    pub fn clear_kick(&self) {
        *self.kick.write().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// How many times the gate went from unparked to parked (the peer reads
    /// the owner's published count).
    pub fn park_count(&self) -> u64 {
        match self.side {
            Side::Owner => self.parks.load(Ordering::Relaxed),
            Side::Peer => self.block().parks.load(Ordering::Relaxed),
        }
    }

    /// Starts a watcher thread (named `name`) that sleeps on the futex word
    /// and runs the kick callback each time it sees the gate newly parked;
    /// it ends when the gate is shut down. This is the "VM process kicks
    /// itself" choice: the owner then registers no kick.
    pub fn spawn_watcher(self: &Arc<Self>, name: &str) -> io::Result<std::thread::JoinHandle<()>> {
        let me = self.clone();
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || me.watch())
    }

    fn watch(&self) {
        let b = self.block();
        b.watchers.fetch_add(1, Ordering::SeqCst);
        // The sequence of the park last kicked (none yet).
        let mut kicked: Option<u32> = None;
        loop {
            let word = b.state.load(Ordering::SeqCst);
            let s = self.current();
            if s & SHUTDOWN != 0 {
                break;
            }
            if s & PARKED != 0 && kicked != Some(s / SEQ) {
                kicked = Some(s / SEQ);
                self.run_kick();
            }
            shm::wait(&b.state, word, None);
        }
        b.watchers.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
