//! Boot-step timestamps: with `CORRAL_BOOT_TRACE` set in the environment,
//! each step of a VM's start-up prints `corral-boot-step NAME NS` on stderr,
//! `NS` being `CLOCK_MONOTONIC` in nanoseconds, so a harness that reads the
//! same clock before it spawns the process gets the offset of every step
//! from process start (`bootbench --steps`). Without the variable a step is
//! one relaxed atomic load.

use std::sync::atomic::{AtomicU8, Ordering};

use crate::util::monotonic_ns;

/// 0: not yet looked up, 1: off, 2: on.
static STATE: AtomicU8 = AtomicU8::new(0);

fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let on = std::env::var_os("CORRAL_BOOT_TRACE").is_some();
            STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
    }
}

/// Records that start-up step `name` is done (when tracing is on).
pub fn step(name: &str) {
    if enabled() {
        eprintln!("corral-boot-step {name} {}", monotonic_ns());
    }
}

/// Looks the variable up now, on a thread whose seccomp filter still allows
/// reading the environment (it is only memory, but this keeps the first
/// `step` on a vCPU thread free of surprises).
pub fn init() {
    let _ = enabled();
}
