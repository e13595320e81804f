//! The allow-lists, one per [`ThreadKind`].
//!
//! Where the rules come from: `strace -f -qq` of `corral run` (probe modes
//! `boot`, `spin`, `blk` read and verify with FLUSH, throttled and `direct`
//! disks) and of `corral serve` while the `api_vms`, `api_io`, `blk`, `boot`
//! and `acpi` test suites drove it (create, pause, resume, move, delete,
//! disk and class limits, console streams, metrics, SIGTERM), grouped per
//! thread by the names the threads give themselves (`prctl(PR_SET_NAME)`).
//! A few rules cover paths the traces do not always reach; each says so and
//! why (glibc's allocator, the panic and exit paths, error paths).
//! ARCHITECTURE.md ("Seccomp") has the table.
//!
//! Everything not listed traps (`SECCOMP_RET_TRAP`, see the module docs).

use seccompiler::BpfProgram;
use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iow_nr, ioctl_iowr_nr};

use super::ThreadKind;
pub use super::bpf::{ArgCheck, CompileError, Rule, Rules};

// The KVM ioctls corral issues (kernel `include/uapi/linux/kvm.h`).
const KVMIO: u32 = kvm_bindings::KVMIO;
ioctl_io_nr!(KVM_GET_API_VERSION, KVMIO, 0x00);
ioctl_io_nr!(KVM_CREATE_VM, KVMIO, 0x01);
ioctl_iowr_nr!(
    KVM_GET_MSR_INDEX_LIST,
    KVMIO,
    0x02,
    kvm_bindings::kvm_msr_list
);
ioctl_io_nr!(KVM_CHECK_EXTENSION, KVMIO, 0x03);
ioctl_io_nr!(KVM_GET_VCPU_MMAP_SIZE, KVMIO, 0x04);
ioctl_iowr_nr!(
    KVM_GET_SUPPORTED_CPUID,
    KVMIO,
    0x05,
    kvm_bindings::kvm_cpuid2
);
ioctl_io_nr!(KVM_CREATE_VCPU, KVMIO, 0x41);
ioctl_iow_nr!(
    KVM_SET_USER_MEMORY_REGION,
    KVMIO,
    0x46,
    kvm_bindings::kvm_userspace_memory_region
);
ioctl_io_nr!(KVM_SET_TSS_ADDR, KVMIO, 0x47);
ioctl_io_nr!(KVM_CREATE_IRQCHIP, KVMIO, 0x60);
ioctl_iow_nr!(KVM_IRQFD, KVMIO, 0x76, kvm_bindings::kvm_irqfd);
ioctl_iow_nr!(KVM_CREATE_PIT2, KVMIO, 0x77, kvm_bindings::kvm_pit_config);
ioctl_iow_nr!(KVM_IOEVENTFD, KVMIO, 0x79, kvm_bindings::kvm_ioeventfd);
ioctl_io_nr!(KVM_RUN, KVMIO, 0x80);
ioctl_ior_nr!(KVM_GET_REGS, KVMIO, 0x81, kvm_bindings::kvm_regs);
ioctl_iow_nr!(KVM_SET_REGS, KVMIO, 0x82, kvm_bindings::kvm_regs);
ioctl_ior_nr!(KVM_GET_SREGS, KVMIO, 0x83, kvm_bindings::kvm_sregs);
ioctl_iow_nr!(KVM_SET_SREGS, KVMIO, 0x84, kvm_bindings::kvm_sregs);
ioctl_iow_nr!(KVM_SET_MSRS, KVMIO, 0x89, kvm_bindings::kvm_msrs);
ioctl_iow_nr!(KVM_SET_FPU, KVMIO, 0x8d, kvm_bindings::kvm_fpu);
ioctl_ior_nr!(KVM_GET_LAPIC, KVMIO, 0x8e, kvm_bindings::kvm_lapic_state);
ioctl_iow_nr!(KVM_SET_LAPIC, KVMIO, 0x8f, kvm_bindings::kvm_lapic_state);
ioctl_iow_nr!(KVM_SET_CPUID2, KVMIO, 0x90, kvm_bindings::kvm_cpuid2);
ioctl_io_nr!(KVM_GET_TSC_KHZ, KVMIO, 0xa3);

/// `ioctl(fd, request, ...)` allowed for exactly these requests (the
/// request's low 32 bits: the kernel takes it as an `unsigned int`).
fn ioctls(r: &mut Rules, requests: &[u64]) {
    let e = r.entry(libc::SYS_ioctl).or_default();
    for &req in requests {
        let new = vec![ArgCheck::eq(1, req as u32)];
        if !e.contains(&new) {
            e.push(new);
        }
    }
}

fn allow(r: &mut Rules, nrs: &[i64]) {
    for &n in nrs {
        r.insert(n, Vec::new());
    }
}

/// Every kind: what the Rust runtime and glibc do on any thread after it
/// started (the thread-start syscalls — rseq, set_robust_list,
/// sched_getaffinity, sigaltstack set-up — run before the thread installs
/// its filter).
fn common(r: &mut Rules) {
    // Memory: glibc malloc's per-thread arenas (mmap/mprotect/munmap seen on
    // every thread), trimming (madvise seen; brk trims the main arena when a
    // thread frees a block the main thread allocated, mremap grows a large
    // mmapped block: glibc malloc.c, not always in a trace).
    allow(
        r,
        &[
            libc::SYS_mmap,
            libc::SYS_munmap,
            libc::SYS_mprotect,
            libc::SYS_madvise,
            libc::SYS_brk,
            libc::SYS_mremap,
        ],
    );
    // Locks and condition variables (std Mutex/Condvar, the gates, channels).
    allow(r, &[libc::SYS_futex, libc::SYS_sched_yield]);
    // A signal (a kick, SIGTERM) that interrupts a timed futex wait or
    // clock_nanosleep makes the kernel resume it through restart_syscall
    // (trapped in the first `corral serve` runs under the filters: the
    // scheduler thread's sleep failed and it panicked).
    allow(r, &[libc::SYS_restart_syscall]);
    // Return from the kick (SIGRTMIN+1) and SIGSYS handlers; std and glibc
    // block signals around thread exit (seen on every thread's exit).
    allow(r, &[libc::SYS_rt_sigreturn, libc::SYS_rt_sigprocmask]);
    // Thread exit: std frees the alternate signal stack (sigaltstack +
    // munmap), glibc releases the stack (madvise) and calls exit. Not
    // exit_group: no VM thread may end the process.
    allow(r, &[libc::SYS_sigaltstack, libc::SYS_exit]);
    // Clocks: clock_gettime is a vDSO call for the monotonic and real-time
    // clocks; the syscall is its fallback (and the CPU-time clocks).
    allow(
        r,
        &[
            libc::SYS_clock_gettime,
            libc::SYS_clock_nanosleep,
            libc::SYS_nanosleep,
        ],
    );
    // Logs (tracing to stderr), console output to the host's stdout,
    // eventfd signalling (irqfds, wake-ups), the SIGSYS handler's report.
    allow(r, &[libc::SYS_write]);
    // std's thread ids (gettid), the kick's pthread_kill (getpid).
    allow(r, &[libc::SYS_gettid, libc::SYS_getpid]);
    // Closing fds that a thread drops (vCPU fd, epoll fd); std's debug
    // builds check an fd with fcntl(F_GETFD) before closing it (seen).
    allow(r, &[libc::SYS_close]);
    r.insert(
        libc::SYS_fcntl,
        vec![vec![ArgCheck::eq(1, libc::F_GETFD as u32)]],
    );
    // HashMap keys (std's RandomState, once per thread; seen on the device
    // thread).
    allow(r, &[libc::SYS_getrandom]);
}

/// `tgkill(tgid, tid, sig)` with the vCPU kick signal only: stopping or
/// parking a VM kicks its vCPUs (seen on vCPU threads for a guest reset and
/// on the scheduler thread for parks).
fn kicks(r: &mut Rules) {
    let sig = crate::util::kick_signal() as u32;
    r.insert(libc::SYS_tgkill, vec![vec![ArgCheck::eq(2, sig)]]);
}

fn vcpu(r: &mut Rules) {
    common(r);
    kicks(r);
    // KVM_RUN; the register dump of a fatal exit (error path, from the
    // code: vcpu.rs regs_summary).
    ioctls(r, &[KVM_RUN(), KVM_GET_REGS(), KVM_GET_SREGS()]);
    // A guest's virtio-mmio reset drains the queue eventfds and the
    // throttle timerfd and disarms it (seen: read EAGAIN, timerfd_settime),
    // and waits for the disk's io_uring requests in flight
    // (io_uring_enter with GETEVENTS; from blk/uring.rs `drain`).
    allow(
        r,
        &[
            libc::SYS_read,
            libc::SYS_timerfd_settime,
            libc::SYS_io_uring_enter,
        ],
    );
}

fn device(r: &mut Rules) {
    common(r);
    // The event loop: its epoll fd (EventManager::new, at thread start),
    // waits, adds/removes subscribers (stdin at EOF); the thread's nice
    // -10 (setpriority, at thread start).
    allow(
        r,
        &[
            libc::SYS_epoll_create1,
            libc::SYS_epoll_wait,
            libc::SYS_epoll_ctl,
            libc::SYS_setpriority,
        ],
    );
    // eventfds, timerfds and host stdin (read), irqfds (write, in common).
    allow(r, &[libc::SYS_read]);
    // virtio-blk: vectored I/O straight into guest memory, FLUSH, DISCARD and
    // WRITE_ZEROES (fallocate; from devices/src/virtio/blk/backend.rs),
    // the io_uring engine's inline try of a page-cache write (pwritev2 with
    // RWF_NOWAIT, backend.rs `write_inline`), throttle timers.
    allow(
        r,
        &[
            libc::SYS_preadv,
            libc::SYS_pwritev,
            libc::SYS_pwritev2,
            libc::SYS_fdatasync,
            libc::SYS_fallocate,
            libc::SYS_timerfd_settime,
        ],
    );
    // The io_uring engine: submitting and reaping (io_uring_enter only; the
    // rings are set up and their eventfds registered by the runtime thread
    // that builds the VM, so io_uring_setup and io_uring_register stay
    // denied here).
    allow(r, &[libc::SYS_io_uring_enter]);
    // Live limit changes wake a throttled request: the gate re-polls.
    kicks(r);
    // Tight throttle waits boost the thread itself (pid 0) to SCHED_FIFO
    // and back to SCHED_OTHER (devices/src/virtio/blk/throttle.rs).
    let me = |policy: libc::c_int| vec![ArgCheck::eq(0, 0), ArgCheck::eq(1, policy as u32)];
    r.insert(
        libc::SYS_sched_setscheduler,
        vec![me(libc::SCHED_FIFO), me(libc::SCHED_OTHER)],
    );
}

fn scheduler(r: &mut Rules) {
    common(r);
    // Parks kick vCPUs (tgkill with the kick signal only).
    kicks(r);
    // /proc/stat every 4 ticks (idle and steal time): open read-only only
    // (no O_WRONLY/O_RDWR, O_CREAT, O_TRUNC, O_APPEND), read, close.
    let ro_mask = (libc::O_ACCMODE | libc::O_CREAT | libc::O_TRUNC | libc::O_APPEND) as u32;
    r.insert(
        libc::SYS_openat,
        vec![vec![ArgCheck::masked_eq(2, ro_mask, 0)]],
    );
    allow(r, &[libc::SYS_read]);
    // A VM process's vCPU run times: /proc/<pid>/task/<tid>/schedstat,
    // opened at attach and re-read in place (vmgate::ThreadRunTime).
    allow(r, &[libc::SYS_pread64]);
}

/// The runtime threads create the other kinds, whose filters stack on the
/// inherited runtime filter: so it allows everything they do (KVM_RUN
/// included), plus what the API and VM creation need.
fn runtime(r: &mut Rules) {
    vcpu(r);
    device(r);
    scheduler(r);
    // Creating VMs: /dev/kvm, the KVM ioctls of vm.rs/boot.rs/cpuid.rs,
    // terminal modes of `corral run` (TCGETS/TCSETS*), FIONBIO/FIOCLEX of
    // tokio and std.
    ioctls(
        r,
        &[
            KVM_GET_API_VERSION(),
            KVM_CREATE_VM(),
            KVM_GET_MSR_INDEX_LIST(),
            KVM_CHECK_EXTENSION(),
            KVM_GET_VCPU_MMAP_SIZE(),
            KVM_GET_SUPPORTED_CPUID(),
            KVM_CREATE_VCPU(),
            KVM_SET_USER_MEMORY_REGION(),
            KVM_SET_TSS_ADDR(),
            KVM_CREATE_IRQCHIP(),
            KVM_IRQFD(),
            KVM_CREATE_PIT2(),
            KVM_IOEVENTFD(),
            KVM_GET_REGS(),
            KVM_SET_REGS(),
            KVM_GET_SREGS(),
            KVM_SET_SREGS(),
            KVM_SET_MSRS(),
            KVM_SET_FPU(),
            KVM_GET_LAPIC(),
            KVM_SET_LAPIC(),
            KVM_SET_CPUID2(),
            KVM_GET_TSC_KHZ(),
            libc::TCGETS,
            libc::TCSETS,
            libc::TCSETSW,
            libc::TCSETSF,
            libc::TIOCGWINSZ,
            libc::FIONBIO,
            libc::FIOCLEX,
        ],
    );
    // What the other kinds restrict by argument, the runtime needs in full
    // (fcntl F_DUPFD/F_SETFL for sockets, openat of any file): `allow`
    // below replaces their conditional rules.
    // Threads: vCPU and device threads, tokio's blocking pool (glibc's
    // pthread_create uses clone3; clone is its fallback). A new thread
    // starts under this filter (rseq, set_robust_list, sched_getaffinity,
    // prctl(PR_SET_NAME), sigaltstack; glibc reads
    // /sys/devices/system/cpu/online for its first arena) before it
    // installs its own; installing it is prctl(PR_SET_NO_NEW_PRIVS) and
    // seccomp(SECCOMP_SET_MODE_FILTER).
    allow(
        r,
        &[
            libc::SYS_clone3,
            libc::SYS_clone,
            libc::SYS_rseq,
            libc::SYS_set_robust_list,
        ],
    );
    // A VM's scheduling gate shared with its VM process: a sealed memfd
    // (Gate::new_shared; ftruncate and fcntl(F_ADD_SEALS) are below).
    allow(r, &[libc::SYS_memfd_create]);
    // Files: kernels, initrds, disk images, /proc, /sys (cgroups), the
    // state of the API socket's directory.
    allow(
        r,
        &[
            libc::SYS_openat,
            // hostfile.rs opens images beneath the image directories with
            // openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) (seen: trapped
            // before this rule, every VM create failed).
            libc::SYS_openat2,
            libc::SYS_read,
            libc::SYS_pread64,
            libc::SYS_readv,
            libc::SYS_writev,
            libc::SYS_lseek,
            libc::SYS_statx,
            libc::SYS_newfstatat,
            libc::SYS_fstat,
            libc::SYS_readlink,
            libc::SYS_flock,
            libc::SYS_ftruncate,
            libc::SYS_fsync,
            libc::SYS_fdatasync,
            libc::SYS_getdents64,
            libc::SYS_mkdir,
            libc::SYS_mkdirat,
            libc::SYS_unlink,
            libc::SYS_unlinkat,
            libc::SYS_rmdir,
            libc::SYS_rename,
            // The state file: its backup is a hard link, renamed into place.
            libc::SYS_renameat,
            libc::SYS_renameat2,
            libc::SYS_link,
            libc::SYS_linkat,
            libc::SYS_chmod,
            libc::SYS_fchmod,
            libc::SYS_fchmodat,
            // `serve --socket-group`: the socket is chgrp'd to the group
            // (seen: lchown trapped, the daemon refused to start).
            libc::SYS_lchown,
            libc::SYS_fchownat,
            libc::SYS_dup,
            libc::SYS_dup3,
            libc::SYS_pipe2,
            libc::SYS_fcntl,
        ],
    );
    // fds for devices and the event loops: eventfds (irqfds, ioeventfds,
    // wake-ups), timerfds (throttles), epoll (tokio, the device threads).
    allow(
        r,
        &[
            libc::SYS_eventfd2,
            libc::SYS_timerfd_create,
            libc::SYS_timerfd_settime,
            libc::SYS_epoll_create1,
            libc::SYS_epoll_ctl,
            libc::SYS_epoll_wait,
            libc::SYS_epoll_pwait,
            libc::SYS_poll,
            libc::SYS_ppoll,
        ],
    );
    // The io_uring engine of virtio-blk: building a VM sets up each disk's
    // ring (after a probe ring at the first disk) and registers its
    // completion eventfd and the probe (blk/uring.rs); dropping a VM waits
    // for its requests in flight (io_uring_enter, from the device rules).
    allow(r, &[libc::SYS_io_uring_setup, libc::SYS_io_uring_register]);
    // The API: Unix and TCP sockets.
    allow(
        r,
        &[
            libc::SYS_socket,
            libc::SYS_socketpair,
            libc::SYS_bind,
            libc::SYS_listen,
            libc::SYS_accept4,
            libc::SYS_connect,
            libc::SYS_getsockname,
            libc::SYS_getpeername,
            libc::SYS_getsockopt,
            libc::SYS_setsockopt,
            libc::SYS_sendto,
            libc::SYS_recvfrom,
            libc::SYS_sendmsg,
            libc::SYS_recvmsg,
            libc::SYS_shutdown,
        ],
    );
    // The default panic hook (runtime threads keep it): getcwd for short
    // backtrace paths.
    allow(r, &[libc::SYS_getcwd]);
    // Signals: tokio's SIGINT/SIGTERM handling, the kick and SIGSYS
    // handlers; process exit.
    allow(
        r,
        &[
            libc::SYS_rt_sigaction,
            libc::SYS_exit_group,
            libc::SYS_prctl,
            libc::SYS_sched_getaffinity,
            libc::SYS_setpriority,
            libc::SYS_getuid,
            libc::SYS_geteuid,
            libc::SYS_prlimit64,
            libc::SYS_uname,
            libc::SYS_sysinfo,
            libc::SYS_wait4,
            libc::SYS_seccomp,
        ],
    );
}

/// The rules of `kind`.
pub fn rules(kind: ThreadKind) -> Rules {
    let mut r = Rules::new();
    match kind {
        ThreadKind::Vcpu => vcpu(&mut r),
        ThreadKind::Device => device(&mut r),
        ThreadKind::Scheduler => scheduler(&mut r),
        ThreadKind::Runtime => runtime(&mut r),
    }
    r
}

/// Compiles the filter of `kind` (mismatch: trap; match: allow) with
/// corral's search-tree compiler ([`super::bpf`]).
pub fn compile(kind: ThreadKind) -> Result<BpfProgram, CompileError> {
    super::bpf::compile(&rules(kind))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_filter_builds() {
        for k in [
            ThreadKind::Vcpu,
            ThreadKind::Device,
            ThreadKind::Scheduler,
            ThreadKind::Runtime,
        ] {
            let p = compile(k).unwrap_or_else(|e| panic!("{k:?}: {e}"));
            assert!(!p.is_empty());
        }
    }

    #[test]
    fn kvm_ioctl_numbers_match_the_kernel() {
        // Values from strace -X raw of `corral run`.
        assert_eq!(KVM_RUN(), 0xae80);
        assert_eq!(KVM_CREATE_VM(), 0xae01);
        assert_eq!(KVM_GET_REGS(), 0x8090_ae81);
        assert_eq!(KVM_SET_USER_MEMORY_REGION(), 0x4020_ae46);
        assert_eq!(KVM_IRQFD(), 0x4020_ae76);
    }

    #[test]
    fn runtime_allows_what_the_kinds_it_creates_allow() {
        // Filters stack: a vCPU thread runs under the runtime's and its own.
        let rt = rules(ThreadKind::Runtime);
        for k in [ThreadKind::Vcpu, ThreadKind::Device, ThreadKind::Scheduler] {
            for (nr, conds) in rules(k) {
                let have = rt
                    .get(&nr)
                    .unwrap_or_else(|| panic!("runtime lacks {nr} of {k:?}"));
                assert!(
                    have.is_empty() || conds.iter().all(|c| have.contains(c)),
                    "runtime narrows syscall {nr} of {k:?}"
                );
            }
        }
    }

    #[test]
    fn vm_threads_cannot_create_threads_open_files_or_sockets() {
        for k in [ThreadKind::Vcpu, ThreadKind::Device] {
            let r = rules(k);
            for nr in [
                libc::SYS_clone,
                libc::SYS_clone3,
                libc::SYS_openat,
                libc::SYS_socket,
                libc::SYS_execve,
                libc::SYS_exit_group,
                // A new or re-registered ring would escape the allow-lists
                // (seccomp does not see io_uring's operations).
                libc::SYS_io_uring_setup,
                libc::SYS_io_uring_register,
            ] {
                assert!(!r.contains_key(&nr), "{k:?} allows syscall {nr}");
            }
        }
    }
}
