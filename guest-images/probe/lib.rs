//! The probe guest, built from this folder's C and assembly by `build.rs`
//! (make + gcc) and embedded as bytes: `corral run` without `--kernel`, the
//! daemon's default guest and the benchmarks all boot it.
//!
//! Its own crate so that both the `corral` binary and `corral-bench` embed
//! the same image without either linking the other.

/// The probe guest's ELF image (x86_64, integer-only; see README.md here).
pub static PROBE_ELF: &[u8] = include_bytes!(env!("CORRAL_PROBE_ELF"));
