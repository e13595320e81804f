//! Small helpers used by several of the VMM's modules.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// Locks `m`, recovering the data of a poisoned mutex: a thread of a VM that
/// panicked while holding a device's lock fails that VM (see
/// [`crate::vmthread`]), and the API must still be able to read it.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Waits on `cv` with `m` locked until `done` gives an outcome (it is
/// asked first, then after every wake-up) or `deadline` passes (`None`).
/// The lock is released before this returns.
pub fn wait_until<T, R>(
    m: &Mutex<T>,
    cv: &Condvar,
    deadline: Instant,
    mut done: impl FnMut(&mut T) -> Option<R>,
) -> Option<R> {
    let mut st = lock(m);
    loop {
        if let Some(r) = done(&mut st) {
            return Some(r);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        st = cv
            .wait_timeout(st, deadline - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of the disk throttles (the
/// same clock the devices' throttle seam reads).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// The real-time signal used to kick vCPU threads out of `KVM_RUN` (its
/// handler is in `shared.rs`; the seccomp filters allow sending it).
pub fn kick_signal() -> libc::c_int {
    libc::SIGRTMIN() + 1
}

/// Gives the calling thread nice -10 (best effort; needs privileges). Used
/// by the threads that do little CPU work but must wake on time: a VM's
/// device thread and the CPU scheduler's thread.
pub fn raise_priority() {
    // SAFETY: setpriority on our own thread id; failure is harmless.
    unsafe {
        let tid = libc::gettid();
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, -10);
    }
}

/// Gives the calling thread nice 0 (raising a thread's nice needs no
/// privilege). A vCPU thread starts with it: it inherits its creator's
/// nice, and a creator may have raised its own priority.
pub fn normal_priority() {
    // SAFETY: setpriority on our own thread id; failure is harmless.
    unsafe {
        let tid = libc::gettid();
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_recovers_a_poisoned_mutex() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poison");
        })
        .join();
        assert!(m.is_poisoned());
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 2);
    }

    #[test]
    fn monotonic_ns_matches_the_devices_clock() {
        let a = corral_devices::virtio::blk::throttle::monotonic_ns();
        let b = monotonic_ns();
        let c = corral_devices::virtio::blk::throttle::monotonic_ns();
        assert!(a <= b && b <= c, "{a} {b} {c}");
    }
}
