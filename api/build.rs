//! Link flags of the `corral` binary only.
//!
//! `-z pack-relative-relocs` (DT_RELR, glibc ≥ 2.36, lld or binutils ≥
//! 2.38): the static-pie's ~6950 `R_X86_64_RELATIVE` relocations are stored
//! as a bitmap of a few KiB instead of a 167 KiB `.rela.dyn` table that
//! every process start reads (and so maps, 64 KiB at a time). The binary
//! stays position-independent (ASLR). See ARCHITECTURE.md, "Static linking".
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}
