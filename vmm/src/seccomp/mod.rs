//! Seccomp filters per thread kind, and what happens on a violation.
//!
//! corral runs four kinds of threads, each with its own allow-list
//! ([`ThreadKind`]; the lists and where each rule comes from are in
//! [`rules`]). Every thread installs its own filter when it starts (the
//! runtime kind on the main thread, before any other thread exists; the
//! tokio workers and the blocking pool inherit it). Filters stack: a vCPU
//! thread, created by a runtime thread, runs under the runtime filter *and*
//! its own, so the narrower one applies.
//!
//! A syscall outside the list does not kill the process (one daemon hosts
//! many VMs): the filter returns `SECCOMP_RET_TRAP`, and the `SIGSYS`
//! handler ([`on_sigsys`], async-signal-safe: atomics and `write(2)` only)
//! makes the syscall fail with `EPERM` through the signal's ucontext,
//! records the first violation in the thread's VM ([`VmFaults`]) and wakes
//! the VM's device thread. The VM then stops with an exit reason naming the
//! thread and the syscall number; its other threads are told to stop as for
//! any fatal exit, and the other VMs run on. A violation in a runtime or the
//! scheduler thread (which belong to no VM) is counted and reported on
//! stderr; the syscall fails with `EPERM`.
//!
//! The allow-lists are compiled by corral's own compiler ([`bpf`]: a
//! binary search over the syscall numbers, same verdicts as seccompiler's
//! linear chain, a tenth of the kernel's work to install) and installed
//! with seccompiler's `apply_filter`.
//!
//! The filters are process-wide policy: they are on once [`enable`] was
//! called (`corral run`, `corral serve`, unless `--no-seccomp`); library
//! users that never call it (benchmarks, in-process tests) run unfiltered.
//! The same filters serve a VM in its own process later: the kinds do not
//! depend on sharing a process.

// vmm-sys-util's `ioctl_*_nr!` macros generate undocumented `pub fn`s (the
// KVM ioctl numbers); the module's own items are documented.
#[allow(missing_docs)]
pub mod rules;

pub mod bpf;
#[cfg(test)]
mod equiv_tests;

use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};

use seccompiler::BpfProgram;

/// The kinds of threads, each with its own filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum ThreadKind {
    /// A vCPU thread: `KVM_RUN` and the emulation of port I/O and MMIO exits.
    Vcpu = 1,
    /// A VM's device thread: the event loop, virtio-blk I/O, throttle timers.
    Device = 2,
    /// The daemon's scheduler thread: CPU clocks, `/proc/stat`, kicks.
    Scheduler = 3,
    /// The main thread, tokio workers and the blocking pool: the API, VM
    /// creation and teardown.
    Runtime = 4,
}

impl ThreadKind {
    /// A short name, for exit reasons and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Vcpu => "vcpu",
            Self::Device => "device",
            Self::Scheduler => "scheduler",
            Self::Runtime => "runtime",
        }
    }

    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Vcpu,
            2 => Self::Device,
            3 => Self::Scheduler,
            4 => Self::Runtime,
            _ => return None,
        })
    }
}

/// Errors of building or installing a filter.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// The filter could not be built (a bug in the rules).
    #[error("building the {kind} seccomp filter: {msg}")]
    Build {
        /// Thread kind.
        kind: &'static str,
        /// What the compiler said.
        msg: String,
    },
    /// The kernel refused the filter or the signal handler.
    #[error("installing the {kind} seccomp filter: {msg}")]
    Install {
        /// Thread kind.
        kind: &'static str,
        /// Why.
        msg: String,
    },
}

static ENABLED: AtomicBool = AtomicBool::new(false);
/// Violations by threads that belong to no VM (runtime, scheduler).
static UNOWNED_VIOLATIONS: AtomicU64 = AtomicU64::new(0);

/// Turns the filters on for this process: installs the `SIGSYS` handler.
/// Threads started afterwards install their filters ([`install`]).
pub fn enable() -> Result<(), SeccompError> {
    install_sigsys_handler()?;
    install_panic_hook();
    ENABLED.store(true, Ordering::Release);
    Ok(())
}

/// Whether [`enable`] was called.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Acquire)
}

/// Violations by runtime and scheduler threads so far.
pub fn unowned_violations() -> u64 {
    UNOWNED_VIOLATIONS.load(Ordering::Relaxed)
}

fn program(kind: ThreadKind) -> Result<&'static BpfProgram, SeccompError> {
    static PROGS: [OnceLock<Result<BpfProgram, String>>; 4] = [
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
    ];
    let slot = &PROGS[kind as usize - 1];
    slot.get_or_init(|| rules::compile(kind).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|msg| SeccompError::Build {
            kind: kind.as_str(),
            msg: msg.clone(),
        })
}

/// Installs the filter of `kind` on the calling thread, if filters are
/// enabled. Fails closed: the caller must not go on running guest code if
/// this fails.
pub fn install(kind: ThreadKind) -> Result<(), SeccompError> {
    if !enabled() {
        return Ok(());
    }
    let prog = program(kind)?;
    THREAD_KIND.with(|c| c.set(kind as u8));
    if kind != ThreadKind::Runtime {
        block_process_signals(kind)?;
    }
    seccompiler::apply_filter(prog).map_err(|e| SeccompError::Install {
        kind: kind.as_str(),
        msg: e.to_string(),
    })
}

/// Blocks, on the calling thread, every signal but the vCPU kick, SIGSYS
/// and the synchronous faults: a process-directed signal (SIGTERM, SIGINT,
/// ...) then goes to a runtime thread, whose handlers may make syscalls
/// that narrower filters forbid (measured: tokio's SIGTERM handler, run on
/// the scheduler thread, had its `sendto` trapped, and the daemon never
/// shut down).
fn block_process_signals(kind: ThreadKind) -> Result<(), SeccompError> {
    // SAFETY: sigset_t is plain data, filled by sigfillset/sigdelset;
    // pthread_sigmask only changes the calling thread's mask.
    let r = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        for sig in [
            crate::util::kick_signal(),
            libc::SIGSYS,
            libc::SIGSEGV,
            libc::SIGBUS,
            libc::SIGILL,
            libc::SIGFPE,
            libc::SIGTRAP,
            libc::SIGABRT,
        ] {
            libc::sigdelset(&mut set, sig);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut())
    };
    if r != 0 {
        return Err(SeccompError::Install {
            kind: kind.as_str(),
            msg: format!("blocking signals: {}", std::io::Error::from_raw_os_error(r)),
        });
    }
    Ok(())
}

/// Builds every filter (so that a bug in a rule shows at start-up, not when
/// the first VM starts).
pub fn check_all() -> Result<(), SeccompError> {
    for k in [
        ThreadKind::Vcpu,
        ThreadKind::Device,
        ThreadKind::Scheduler,
        ThreadKind::Runtime,
    ] {
        program(k)?;
    }
    Ok(())
}

/// A VM's record of the first fault of one of its threads, written by the
/// `SIGSYS` handler (lock-free) and read by the VM's threads and the API.
#[derive(Debug)]
pub struct VmFaults {
    /// 0: none. Else `1 << 63 | kind << 48 | thread index << 32 | syscall nr`.
    first: AtomicU64,
    /// The VM's device thread's wake-up eventfd (written by the handler).
    wake_fd: AtomicI32,
}

/// A recorded seccomp violation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Violation {
    /// Kind of the thread that made the syscall.
    pub kind: ThreadKind,
    /// The thread's index within its kind (vCPU number; 0 for the device thread).
    pub index: u16,
    /// The syscall number (x86-64).
    pub syscall: i32,
}

impl VmFaults {
    /// No fault yet; `wake_fd` is written (8 bytes) when one is recorded.
    pub fn new(wake_fd: i32) -> Self {
        Self {
            first: AtomicU64::new(0),
            wake_fd: AtomicI32::new(wake_fd),
        }
    }

    /// The first violation, if any.
    pub fn violation(&self) -> Option<Violation> {
        let v = self.first.load(Ordering::Acquire);
        if v == 0 {
            return None;
        }
        Some(Violation {
            kind: ThreadKind::from_u8((v >> 48) as u8 & 0x7f)?,
            index: (v >> 32) as u16,
            syscall: v as u32 as i32,
        })
    }

    /// Records a violation (the first one wins) and wakes the device
    /// thread. Async-signal-safe.
    fn record(&self, kind: u8, index: u16, syscall: i32) {
        let v =
            1u64 << 63 | u64::from(kind) << 48 | u64::from(index) << 32 | u64::from(syscall as u32);
        let _ = self
            .first
            .compare_exchange(0, v, Ordering::AcqRel, Ordering::Acquire);
        let fd = self.wake_fd.load(Ordering::Relaxed);
        if fd >= 0 {
            let one = 1u64;
            // SAFETY: write(2) of 8 bytes from a local; async-signal-safe.
            // The fd is the VM's eventfd, which outlives its threads.
            unsafe { libc::write(fd, (&raw const one).cast(), 8) };
        }
    }
}

thread_local! {
    /// The VM the calling thread works for (null: none), set by [`VmThreadGuard`].
    static THREAD_VM: Cell<*const VmFaults> = const { Cell::new(std::ptr::null()) };
    /// The calling thread's kind (0: not set) and index within its kind.
    static THREAD_KIND: Cell<u8> = const { Cell::new(0) };
    static THREAD_INDEX: Cell<u16> = const { Cell::new(0) };
}

/// While alive, faults of the calling thread are recorded in a VM's
/// [`VmFaults`]. The caller keeps the `VmFaults` alive for longer than the
/// guard (it is part of the VM's shared state, which the thread holds).
pub struct VmThreadGuard {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl VmThreadGuard {
    /// Marks the calling thread as `kind` number `index` of the VM whose
    /// faults are `faults`.
    ///
    /// # Safety
    ///
    /// `faults` must stay valid until the guard is dropped (on this thread).
    pub unsafe fn enter(faults: *const VmFaults, kind: ThreadKind, index: u16) -> Self {
        THREAD_VM.with(|c| c.set(faults));
        THREAD_KIND.with(|c| c.set(kind as u8));
        THREAD_INDEX.with(|c| c.set(index));
        Self {
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for VmThreadGuard {
    fn drop(&mut self) {
        THREAD_VM.with(|c| c.set(std::ptr::null()));
    }
}

/// The calling thread's kind, if it installed a filter or entered a VM.
pub fn current_kind() -> Option<ThreadKind> {
    ThreadKind::from_u8(THREAD_KIND.with(|c| c.get()))
}

/// Offset of `si_syscall` in the kernel's `siginfo_t` for SIGSYS on x86-64:
/// three ints (signo, errno, code), padding to 16, then `_sigsys`:
/// `void *_call_addr; int _syscall; unsigned int _arch;`.
const SI_SYSCALL_OFFSET: usize = 24;

extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // Everything here is async-signal-safe: const thread-locals, atomics,
    // write(2). No allocation, no lock.
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers;
    // the offset is the kernel ABI of `_sigsys` on x86-64.
    let nr = unsafe {
        info.cast::<u8>()
            .add(SI_SYSCALL_OFFSET)
            .cast::<i32>()
            .read_unaligned()
    };
    // SAFETY: for SA_SIGINFO the third argument is this thread's ucontext;
    // setting RAX sets the trapped syscall's return value.
    unsafe {
        let uc = ctx.cast::<libc::ucontext_t>();
        (*uc).uc_mcontext.gregs[libc::REG_RAX as usize] = -(libc::EPERM as i64);
    }
    let vm = THREAD_VM.with(|c| c.get());
    let kind = THREAD_KIND.with(|c| c.get());
    if !vm.is_null() {
        let index = THREAD_INDEX.with(|c| c.get());
        // SAFETY: `vm` is valid while the thread's guard lives (see `enter`).
        unsafe { (*vm).record(kind, index, nr) };
        return;
    }
    UNOWNED_VIOLATIONS.fetch_add(1, Ordering::Relaxed);
    let mut buf = [0u8; 112];
    let mut n = 0;
    let mut put = |s: &[u8]| {
        for &b in s {
            if n < buf.len() {
                buf[n] = b;
                n += 1;
            }
        }
    };
    put(b"corral: seccomp: a ");
    // A thread that set no kind inherited the runtime filter (tokio's
    // workers and blocking pool).
    put(ThreadKind::from_u8(kind)
        .map_or("runtime", |k| k.as_str())
        .as_bytes());
    put(b" thread made syscall ");
    let mut digits = [0u8; 12];
    let mut d = digits.len();
    let mut v = i64::from(nr).unsigned_abs();
    loop {
        d -= 1;
        digits[d] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 || d == 0 {
            break;
        }
    }
    put(&digits[d..]);
    put(b", outside its filter; it failed with EPERM\n");
    // SAFETY: write(2) to stderr from a stack buffer; async-signal-safe.
    unsafe { libc::write(libc::STDERR_FILENO, buf.as_ptr().cast(), n) };
}

fn install_sigsys_handler() -> Result<(), SeccompError> {
    static ONCE: OnceLock<Result<(), String>> = OnceLock::new();
    ONCE.get_or_init(|| {
        // SAFETY: a zeroed sigaction is valid; the handler is
        // async-signal-safe (see on_sigsys). SA_SIGINFO for si_syscall and
        // the ucontext; SA_NODEFER is not set, so SIGSYS is blocked while
        // the handler runs.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigsys as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error().to_string());
            }
        }
        Ok(())
    })
    .clone()
    .map_err(|msg| SeccompError::Install {
        kind: "SIGSYS handler",
        msg,
    })
}

/// Test-only fault injection (debug builds only; absent from release
/// builds): `CORRAL_FAULT=WHAT:VMNAME[,WHAT:VMNAME...]` with `WHAT` one of
/// `vcpu-panic`, `dev-panic`, `vcpu-syscall`, `dev-syscall`,
/// `vmproc-slow-start` (a VM process waits 3 s before its control socket),
/// `vmproc-slow-lost-daemon` (its control thread takes 500 ms to act on
/// its daemon's end).
#[cfg(debug_assertions)]
pub mod fault {
    /// Whether `what` is injected for VM `vm`.
    pub fn injected(what: &str, vm: &str) -> bool {
        std::env::var("CORRAL_FAULT").is_ok_and(|v| {
            v.split(',').any(|f| {
                f.split_once(':')
                    .is_some_and(|(w, name)| w == what && name == vm)
            })
        })
    }

    /// A syscall that no VM thread's filter allows: `socket(AF_INET,
    /// SOCK_STREAM, 0)` (41), the first step of an escape that phones home.
    pub fn forbidden_syscall() -> i64 {
        // SAFETY: socket(2) has no memory arguments; a returned fd is closed.
        let r = unsafe { libc::syscall(libc::SYS_socket, libc::AF_INET, libc::SOCK_STREAM, 0) };
        if r >= 0 {
            // SAFETY: closing the fd we just got.
            unsafe { libc::close(r as i32) };
        }
        r
    }
}

/// Installs (once) a panic hook that reports a panic of a vCPU, device or
/// scheduler thread as one log line, without the backtrace that the
/// default hook would symbolise (that opens and maps the executable and
/// reads the working directory: syscalls those filters forbid). Runtime
/// threads keep the default hook.
fn install_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let narrow = matches!(
                current_kind(),
                Some(ThreadKind::Vcpu | ThreadKind::Device | ThreadKind::Scheduler)
            );
            if !narrow {
                prev(info);
                return;
            }
            let t = std::thread::current();
            let loc = info
                .location()
                .map(|l| format!("{}:{}", l.file(), l.line()))
                .unwrap_or_default();
            let msg = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(thread = t.name().unwrap_or("?"), "panicked at {loc}: {msg}");
        }));
    });
}
