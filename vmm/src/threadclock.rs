//! Threads' CPU clocks, read by the daemon's scheduler and by a VM
//! process's own publisher: a thread of this process through its CPU clock,
//! a thread of another process (a VM process) through its `schedstat`.

use std::sync::{Arc, Mutex};

use crate::util::lock;

/// CPU time of thread `tid` in ns, through its per-thread CPU clock
/// (guest time included: KVM_RUN runs on the thread); a thread of another
/// process through its `schedstat`.
pub fn thread_cpu_ns(tid: libc::pid_t) -> Option<u64> {
    local_thread_cpu_ns(tid).or_else(|| other_process_thread_cpu_ns(tid))
}

/// CPU time of thread `tid` of this process in ns: one `clock_gettime` on
/// its CPU clock, `None` if it is not a thread of this process (gone). The
/// scheduler thread's reading for in-process VMs: unlike
/// [`thread_cpu_ns`] it never falls back to opening `/proc/TID/schedstat`
/// (a syscall more per tick for every thread of a stopping VM, and a tid
/// the kernel may have given to another process since).
pub fn local_thread_cpu_ns(tid: libc::pid_t) -> Option<u64> {
    // The kernel reads tid 0 as "the caller" (and !-1 is 0): a tid that is
    // not a real one reads nothing.
    if tid <= 0 {
        return None;
    }
    // The kernel's clock id for a thread's CPU clock: CPUCLOCK_PERTHREAD (4)
    // | CPUCLOCK_SCHED (2), with the bitwise-negated tid above bit 3 — what
    // glibc's pthread_getcpuclockid computes, without needing a pthread_t
    // whose lifetime we would have to track.
    let clock = ((!tid) << 3) | 6;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we pass; an invalid
    // clock (thread gone) returns an error, nothing else.
    let r = unsafe { libc::clock_gettime(clock, &mut ts) };
    (r == 0).then(|| ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

/// CPU time of a thread of another process (a VM process), whose CPU clock
/// this process cannot read (the kernel allows thread clocks only within
/// one thread group): the first field of `/proc/TID/schedstat` (run time in
/// ns), with the file kept open per thread (one `pread` per reading). An
/// interim until VM processes publish their usage in shared memory.
fn other_process_thread_cpu_ns(tid: libc::pid_t) -> Option<u64> {
    use std::collections::HashMap;
    use std::os::unix::fs::FileExt;
    use std::sync::LazyLock;
    static OPEN: LazyLock<Mutex<HashMap<libc::pid_t, Arc<std::fs::File>>>> =
        LazyLock::new(Mutex::default);
    let f = {
        let mut m = lock(&OPEN);
        match m.get(&tid) {
            Some(f) => f.clone(),
            None => {
                let f = Arc::new(std::fs::File::open(format!("/proc/{tid}/schedstat")).ok()?);
                if m.len() >= 4096 {
                    m.clear();
                }
                m.insert(tid, f.clone());
                f
            }
        }
    };
    let mut buf = [0u8; 96];
    let n = match f.read_at(&mut buf, 0) {
        Ok(n) if n > 0 => n,
        // The thread is gone (ESRCH): forget its file.
        _ => {
            lock(&OPEN).remove(&tid);
            return None;
        }
    };
    std::str::from_utf8(buf.get(..n)?)
        .ok()?
        .split_ascii_whitespace()
        .next()?
        .parse()
        .ok()
}

/// CPU time of the calling thread, in ns: one `clock_gettime`
/// (`CLOCK_THREAD_CPUTIME_ID`; by tid it took a `gettid` syscall more, and
/// the scheduler thread reads its own clock twice per tick).
pub fn own_thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we pass.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if r != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
