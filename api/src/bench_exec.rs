//! `corral bench ...`: the benchmarks live in their own binary,
//! `corral-bench` (crate `bench/`), so that `corral` links no plotting or
//! progress-bar code. This finds it beside the running `corral` (the way
//! cargo and the installers place them), else on `PATH`, and execs it with
//! the remaining arguments.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

/// The `corral-bench` binary to run.
fn bench_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("CORRAL_BENCH_BIN") {
        return PathBuf::from(p);
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("corral-bench")))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("corral-bench"))
}

/// Replaces this process with `corral-bench ARGS`; returns only on failure.
pub fn exec(args: Vec<OsString>) -> ExitCode {
    let bin = bench_binary();
    let err = Command::new(&bin).args(args).exec();
    eprintln!(
        "corral: cannot run {}: {err} (build it with `cargo build -p corral-bench`; it is installed beside `corral`)",
        bin.display()
    );
    ExitCode::from(2)
}
