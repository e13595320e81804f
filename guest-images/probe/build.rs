//! Builds the probe guest from source (guest-images/probe, with make + gcc)
//! and places it in OUT_DIR so that `corral-probe` embeds it (the default guest
//! of `corral` and the benchmarks' guest).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let probe_dir = manifest;
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("probe");
    println!("cargo:rerun-if-changed={}", probe_dir.display());
    println!("cargo:rerun-if-env-changed=CORRAL_PROBE_PREBUILT");
    // Developers may point at an already built probe ELF instead.
    if let Ok(p) = std::env::var("CORRAL_PROBE_PREBUILT") {
        println!("cargo:rustc-env=CORRAL_PROBE_ELF={p}");
        return;
    }
    let status = Command::new("make")
        .arg("-s")
        .arg("-C")
        .arg(&probe_dir)
        .arg(format!("O={}", out.display()))
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!(
            "building the probe guest failed ({s}); run `make -C {}` to see why (needs gcc, make, binutils)",
            probe_dir.display()
        ),
        Err(e) => panic!("cannot run make to build the probe guest: {e} (install make and gcc)"),
    }
    println!(
        "cargo:rustc-env=CORRAL_PROBE_ELF={}",
        out.join("probe.elf").display()
    );
}
