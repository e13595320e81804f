//! Tight throttle waits on the device: the thread is boosted to
//! `SCHED_FIFO` while a request of a one-request bucket waits, and back to
//! `SCHED_OTHER` (its nice kept) once it is admitted or dropped.

use std::os::fd::AsRawFd;

use corral_blkthrottle::{Limits, Throttle};

use super::tests::{BUF, HDR, STATUS, harness};
use super::throttle::monotonic_ns;
use super::*;
use crate::bus::lock;
use crate::virtio::testing::write_header;

fn policy() -> libc::c_int {
    // SAFETY: queries the calling thread's policy; no memory is passed.
    unsafe { libc::sched_getscheduler(0) }
}

fn nice() -> libc::c_int {
    // SAFETY: reads the calling thread's nice value; no memory is passed.
    unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) }
}

/// Whether this process may take `SCHED_FIFO` at all (root, not in a cgroup
/// without real-time runtime): tried on a thread of its own.
fn fifo_allowed() -> bool {
    std::thread::spawn(|| {
        let p = libc::sched_param { sched_priority: 1 };
        // SAFETY: pid 0 is this short-lived thread; `p` outlives the call.
        unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &p) == 0 }
    })
    .join()
    .unwrap_or(false)
}

#[test]
fn a_tight_wait_boosts_the_thread_until_admission_or_reset() {
    // A fresh thread: the test harness's own may carry another priority.
    std::thread::spawn(|| {
        let fifo = fifo_allowed();
        let before = nice();
        let (_t, mut h) = harness();
        // 4 KiB at 200 KiB/s, a bucket of one request: 20 ms per request.
        let l = Limits::parse("bps=204800,burst_bytes=4096").unwrap();
        let t = Throttle::new(&l, monotonic_ns()).unwrap();
        lock(&h.block).set_throttle(Some(Box::new(t)));
        for i in 0..3 {
            write_header(&h.mem, HDR + 32 * i, request::T_IN, 0);
            h.ring.submit(&[
                (HDR + 32 * i, 16, false),
                (BUF, 4096, true),
                (STATUS + i, 1, true),
            ]);
        }
        h.process();
        assert_eq!(h.ring.used_idx(), 1, "the second waits");
        let boosted = if fifo {
            libc::SCHED_FIFO
        } else {
            libc::SCHED_OTHER
        };
        assert_eq!(policy(), boosted, "while the second waits");
        // The timer (armed early by the margin) fires; the rest is waited
        // on the clock and the request admitted on its due instant.
        let fd = lock(&h.block).timer().as_raw_fd();
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polling one valid fd we own, with a timeout.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 1000) }, 1, "timer");
        {
            let mut b = lock(&h.block);
            b.timer().drain();
            b.timer().fired(monotonic_ns());
            b.process_queue();
            b.wait_io();
            assert_eq!(b.timer().lateness().count, 1);
        }
        assert_eq!(h.ring.used_idx(), 2);
        // The third waits now, boosted again.
        assert_eq!(policy(), boosted, "while the third waits");
        // A reset drops it, and the boost with it.
        h.w32(0x70, 0);
        assert_eq!(policy(), libc::SCHED_OTHER, "after the reset");
        assert_eq!(nice(), before, "the nice value is kept");
    })
    .join()
    .unwrap();
}
