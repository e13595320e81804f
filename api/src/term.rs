//! Terminal handling for `corral run`: stdin without line buffering or echo
//! (the guest echoes), restored on exit; SIGINT/SIGTERM as a stop request.

use std::sync::atomic::{AtomicI32, Ordering};

/// Restores the terminal's settings when dropped.
pub struct RawStdin {
    saved: Option<libc::termios>,
}

impl RawStdin {
    /// Turns off canonical mode and echo if stdin is a terminal. Ctrl-C still
    /// reaches corral (ISIG stays on) and stops the VM.
    pub fn enable() -> Self {
        // SAFETY: isatty/tcgetattr/tcsetattr on fd 0 with a valid termios buffer.
        unsafe {
            if libc::isatty(libc::STDIN_FILENO) != 1 {
                return Self { saved: None };
            }
            let mut t: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(libc::STDIN_FILENO, &mut t) != 0 {
                return Self { saved: None };
            }
            let saved = t;
            t.c_lflag &= !(libc::ICANON | libc::ECHO);
            libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &t);
            Self { saved: Some(saved) }
        }
    }
}

impl Drop for RawStdin {
    fn drop(&mut self) {
        if let Some(t) = self.saved {
            // SAFETY: restoring settings read earlier from the same fd.
            unsafe {
                libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &t);
            }
        }
    }
}

static PENDING: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    PENDING.store(sig, Ordering::SeqCst);
}

/// A pending termination signal, polled by the main loop.
pub struct StopSignal;

impl StopSignal {
    /// The signal received since the last call, if any.
    pub fn take(&self) -> Option<i32> {
        match PENDING.swap(0, Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }
}

/// Catches SIGINT, SIGTERM and SIGHUP.
pub fn on_terminate_signal() -> StopSignal {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores into an atomic (async-signal-safe).
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
    StopSignal
}
