//! `corral run`: the built-in probe guest boots and shuts down; bad arguments
//! are refused before anything starts; fatal guest exits are reported.

use std::time::Duration;

use corral_tests::{Running, run_corral, text};

const T: Duration = Duration::from_secs(30);

fn boots_with(vcpus: u32) {
    let n = vcpus.to_string();
    let o = run_corral(&["run", "--vcpus", &n], T);
    let (out, err) = text(&o);
    assert!(
        o.status.success(),
        "exit {:?}\nstdout:\n{out}\nstderr:\n{err}",
        o.status
    );
    assert!(
        out.starts_with("PROBE-UP\n"),
        "first line must be PROBE-UP:\n{out}"
    );
    for id in 0..vcpus {
        assert!(
            out.lines()
                .any(|l| l.starts_with(&format!("PROBE-CPU id={id} ")) && l.ends_with(" up")),
            "vCPU {id} did not report up:\n{out}"
        );
    }
    assert!(
        out.contains(&format!("PROBE-CPUS online={vcpus} expected={vcpus}")),
        "{out}"
    );
    assert!(out.contains("PROBE-DONE status=ok"), "{out}");
}

#[test]
fn probe_boots_with_one_vcpu() {
    boots_with(1);
}

#[test]
fn probe_boots_with_two_vcpus() {
    boots_with(2);
}

#[test]
fn probe_boots_with_eight_vcpus() {
    boots_with(8);
}

fn refused(args: &[&str], expect: &str) {
    let o = run_corral(args, T);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {out}{err}");
    assert!(out.is_empty(), "{args:?} started a guest: {out}");
    assert!(
        err.contains(expect),
        "{args:?}: expected {expect:?} in {err:?}"
    );
    assert_eq!(
        err.trim().lines().count(),
        1,
        "one-line error expected: {err}"
    );
}

#[test]
fn bad_arguments_are_refused_before_start() {
    let dir = std::env::temp_dir().join(format!("corral-badargs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let junk = dir.join("junk");
    std::fs::write(&junk, b"this is not a kernel").unwrap();
    let empty = dir.join("empty");
    std::fs::write(&empty, b"").unwrap();
    let arm = dir.join("arm");
    let mut elf = vec![0u8; 64];
    elf[0..4].copy_from_slice(b"\x7fELF");
    elf[4] = 2;
    elf[5] = 1;
    elf[16] = 2;
    elf[18] = 183; // aarch64
    std::fs::write(&arm, elf).unwrap();

    refused(&["run", "--kernel", "/nonexistent/vmlinux"], "No such file");
    refused(
        &["run", "--kernel", junk.to_str().unwrap()],
        "not a bootable x86-64 kernel",
    );
    refused(
        &["run", "--kernel", empty.to_str().unwrap()],
        "not a bootable x86-64 kernel",
    );
    refused(
        &["run", "--kernel", arm.to_str().unwrap()],
        "not for x86-64",
    );
    refused(
        &["run", "--kernel", dir.to_str().unwrap()],
        "is a directory",
    );
    refused(
        &["run", "--initrd", "/nonexistent/initrd"],
        "cannot read initrd",
    );
    refused(&["run", "--vcpus", "0"], "at least 1 vCPU");
    refused(&["run", "--vcpus", "100000"], "more than corral supports");
    refused(
        &["run", "--vcpus", "255"],
        "KVM on this host allows at most",
    );
    refused(&["run", "--memory", "1"], "too small");
    refused(&["run", "--memory", "0"], "too small");
    refused(&["run", "--memory", "100000000"], "the host has only");
    let long = "x".repeat(70_000);
    refused(&["run", "--cmdline", &long], "command line");
    // clap's own errors (not a number) also exit 2 before starting.
    let o = run_corral(&["run", "--vcpus", "two"], T);
    assert_eq!(o.status.code(), Some(2));
    assert!(o.stdout.is_empty());
    std::fs::remove_dir_all(&dir).ok();
}

/// A minimal ELF64 whose code is `ud2`: with no IDT the #UD escalates to a
/// triple fault.
fn crashing_elf() -> Vec<u8> {
    let mut f = vec![0u8; 0x1000 + 16];
    f[0..4].copy_from_slice(b"\x7fELF");
    f[4] = 2; // 64-bit
    f[5] = 1; // little endian
    f[6] = 1; // version
    f[16..18].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    f[18..20].copy_from_slice(&62u16.to_le_bytes()); // x86-64
    f[20..24].copy_from_slice(&1u32.to_le_bytes());
    f[24..32].copy_from_slice(&0x10_0000u64.to_le_bytes()); // entry
    f[32..40].copy_from_slice(&64u64.to_le_bytes()); // phoff
    f[52..54].copy_from_slice(&64u16.to_le_bytes()); // ehsize
    f[54..56].copy_from_slice(&56u16.to_le_bytes()); // phentsize
    f[56..58].copy_from_slice(&1u16.to_le_bytes()); // phnum
    let ph = 64;
    f[ph..ph + 4].copy_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    f[ph + 4..ph + 8].copy_from_slice(&5u32.to_le_bytes()); // R+X
    f[ph + 8..ph + 16].copy_from_slice(&0x1000u64.to_le_bytes()); // offset
    f[ph + 16..ph + 24].copy_from_slice(&0x10_0000u64.to_le_bytes()); // vaddr
    f[ph + 24..ph + 32].copy_from_slice(&0x10_0000u64.to_le_bytes()); // paddr
    f[ph + 32..ph + 40].copy_from_slice(&16u64.to_le_bytes()); // filesz
    f[ph + 40..ph + 48].copy_from_slice(&16u64.to_le_bytes()); // memsz
    f[ph + 48..ph + 56].copy_from_slice(&0x1000u64.to_le_bytes()); // align
    f[0x1000] = 0x0f; // ud2
    f[0x1001] = 0x0b;
    f
}

#[test]
fn triple_fault_is_reported_not_a_panic() {
    let p = std::env::temp_dir().join(format!("corral-crash-{}.elf", std::process::id()));
    std::fs::write(&p, crashing_elf()).unwrap();
    let o = run_corral(&["run", "--kernel", p.to_str().unwrap(), "--vcpus", "2"], T);
    let (out, err) = text(&o);
    std::fs::remove_file(&p).ok();
    assert_eq!(o.status.code(), Some(1), "{out}{err}");
    assert!(err.contains("VM failed"), "{err}");
    assert!(
        err.contains("triple fault") || err.contains("internal error"),
        "{err}"
    );
    assert!(
        err.contains("rip=0x10"),
        "registers must be reported: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// Issue 14 item 8: the vCPU thread's log line of the fatal exit names its
/// VM (the thread runs in the VM's `vm` span).
#[test]
fn vcpu_log_lines_name_their_vm() {
    let p = std::env::temp_dir().join(format!("corral-crash-span-{}.elf", std::process::id()));
    std::fs::write(&p, crashing_elf()).unwrap();
    let o = run_corral(&["run", "--kernel", p.to_str().unwrap()], T);
    let (out, err) = text(&o);
    std::fs::remove_file(&p).ok();
    assert_eq!(o.status.code(), Some(1), "{out}{err}");
    let line = err
        .lines()
        .find(|l| l.contains("rip=0x10") && l.contains("ERROR"))
        .unwrap_or_else(|| panic!("no vCPU error line: {err}"));
    assert!(line.contains("vm{vm=run}"), "{line}");
}

#[test]
fn stop_on_request_with_sigterm() {
    let mut r = Running::start(&[
        "run",
        "--vcpus",
        "2",
        "--cmdline",
        "probe.mode=spin probe.secs=60 probe.interval_ms=100",
    ]);
    assert!(r.wait_for("PROBE-PROGRESS", T).is_some(), "{:?}", r.seen);
    r.signal(libc::SIGTERM);
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(s) = r.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(status.code(), Some(1));
}
