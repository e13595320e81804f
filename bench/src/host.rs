//! Facts about the host the benchmarks run on, and the few knobs they turn
//! on it (CPU affinity). Every benchmark module and the Linux job read these
//! here, so no module has to import the runner for them.

use std::path::Path;

/// Whether KVM on this host is kvm_pvm (guests run in the instruction
/// emulator, ~1 µs per guest instruction; no full Linux guest).
pub fn host_is_pvm() -> bool {
    Path::new("/sys/module/kvm_pvm").exists()
}

/// CPUs this process may run on.
pub fn host_cpus() -> u32 {
    std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1)
}

/// Restricts this thread (and so the threads it starts later: VMs, the
/// scheduler) to at most `n` of the CPUs it may run on. Returns the CPUs it
/// may run on afterwards.
pub fn limit_cpus(n: u32) -> u32 {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `set` is a valid cpu_set_t of `size` bytes; pid 0 = this thread.
    if unsafe { libc::sched_getaffinity(0, size, &mut set) } != 0 {
        return host_cpus();
    }
    // SAFETY: as above.
    let mut keep: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let mut kept = 0;
    for cpu in 0..libc::CPU_SETSIZE as usize {
        if kept == n {
            break;
        }
        // SAFETY: `cpu` < CPU_SETSIZE, the sets are valid cpu_set_t values.
        if unsafe { libc::CPU_ISSET(cpu, &set) } {
            // SAFETY: as above.
            unsafe { libc::CPU_SET(cpu, &mut keep) };
            kept += 1;
        }
    }
    // SAFETY: `keep` is a valid cpu_set_t of `size` bytes.
    if kept > 0 && unsafe { libc::sched_setaffinity(0, size, &keep) } == 0 {
        kept
    } else {
        host_cpus()
    }
}

/// CPU time (user + system) of this whole process, in seconds.
pub fn process_cpu_s() -> f64 {
    // SAFETY: getrusage writes into the struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is always valid.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}
