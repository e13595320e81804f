//! Link flags of the `corral` binary only.
//!
//! `-z pack-relative-relocs` (DT_RELR, glibc ≥ 2.36, lld or binutils ≥
//! 2.38): the static-pie's ~6950 `R_X86_64_RELATIVE` relocations are stored
//! as a bitmap of a few KiB instead of a 167 KiB `.rela.dyn` table that
//! every process start reads (and so maps, 64 KiB at a time). The binary
//! stays position-independent (ASLR). See ARCHITECTURE.md, "Static linking".
//!
//! Release builds: `--symbol-ordering-file boot-order.txt` (lld, rustc's
//! default linker on x86_64 Linux): the functions that `corral run`
//! executes from exec to the guest's first output (the list is written by
//! `scripts/boot-order`) are laid out together at the start of `.text`, so
//! start-up maps a few contiguous 64 KiB fault-around blocks of code
//! instead of hundreds scattered over 5 MiB. Symbols the list names that a
//! build no longer has are skipped. `CORRAL_LINK_MAP=PATH` also writes the
//! linker's map there (with mangled names), which `scripts/boot-order`
//! reads.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=boot-order.txt");
    println!("cargo:rerun-if-env-changed=CORRAL_LINK_MAP");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    if std::env::var("PROFILE").as_deref() == Ok("release") {
        let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
        println!(
            "cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={dir}/boot-order.txt,--no-warn-symbol-ordering"
        );
    }
    if let Ok(map) = std::env::var("CORRAL_LINK_MAP") {
        println!("cargo:rustc-link-arg-bins=-Wl,-Map={map},--no-demangle");
    }
}
