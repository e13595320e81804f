//! ACPI with a stock distribution kernel: the Debian cloud kernel (built
//! without CONFIG_X86_MPPARSE, so the MADT is its only way to find CPUs)
//! must list corral's tables in its early boot log and raise no ACPI
//! warning. The table bytes themselves are checked offline, with iasl and
//! acpiexec, by the unit tests in vmm/src/acpi/.
//!
//! On this project's development hosts (/sys/module/kvm_pvm) a stock kernel
//! runs ~100x slower; the table listing still appears within its first
//! minute or so. The full boot (all vCPUs, /dev/vda, power-off through S5)
//! runs only where the host can do it.

use std::process::Command;
use std::time::{Duration, Instant};

use corral_tests::{Running, corral_bin, host_is_pvm, linux_guest};

/// Lines of a boot log that report a problem with ACPI tables: ACPICA's
/// own error and warning prefixes, and any line about ACPI/APIC tables that
/// mentions a checksum, invalid data, a warning or a firmware bug.
fn acpi_problems(lines: &[String]) -> Vec<&String> {
    const ACPICA: [&str; 6] = [
        "ACPI BIOS Error",
        "ACPI BIOS Warning",
        "ACPI Error",
        "ACPI Warning",
        "ACPI Exception",
        "ACPI: [Firmware Bug]",
    ];
    const SUBJECT: [&str; 5] = ["ACPI", "APIC", "MADT", "DSDT", "FADT"];
    const TROUBLE: [&str; 6] = ["checksum", "invalid", "warning", "error", "bug", "corrupt"];
    const BENIGN: [&str; 2] = [
        // Printed on every x86 boot: early verification is off by default.
        "Early table checksum verification disabled",
        // "PCI: Using host bridge windows from ACPI; if necessary, use
        // "pci=nocrs" and report a bug": printed whenever ACPI PCI is set up.
        "and report a bug",
    ];
    lines
        .iter()
        .filter(|l| {
            if BENIGN.iter().any(|b| l.contains(b)) {
                return false;
            }
            let low = l.to_ascii_lowercase();
            ACPICA.iter().any(|p| l.contains(p))
                || (SUBJECT.iter().any(|s| l.contains(s))
                    && TROUBLE.iter().any(|t| low.contains(t)))
        })
        .collect()
}

#[test]
fn acpi_problem_filter() {
    let l = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let ok = l(&[
        "[    0.000000] ACPI: Early table checksum verification disabled",
        "[    0.000000] ACPI: RSDP 0x00000000000E0000 000024 (v02 CORRAL)",
        "[    0.000000] [Firmware Bug]: TSC_DEADLINE disabled due to Errata",
        "[    0.000000] ACPI: LAPIC_NMI (acpi_id[0xff] dfl dfl lint[0x1])",
        "[    0.300000] PCI: Using host bridge windows from ACPI; if necessary, use \"pci=nocrs\" and report a bug",
    ]);
    assert!(acpi_problems(&ok).is_empty());
    let bad = l(&[
        "[    0.000000] ACPI BIOS Warning (bug): Incorrect checksum in table [DSDT] - 0xE3, should be 0xE2 (20220331/tbprint-174)",
        "[    0.000000] ACPI Error: AE_NOT_FOUND, While resolving a named reference",
        "[    0.000000] ACPI: Invalid BIOS MADT, disabling ACPI",
        "[    0.000000] ACPI BIOS Error (bug): Failure creating named object",
    ]);
    assert_eq!(acpi_problems(&bad).len(), 4);
}

fn table_line<'a>(seen: &'a [String], sig: &str) -> Option<&'a String> {
    let needle = format!("ACPI: {sig} 0x");
    seen.iter().find(|l| l.contains(&needle))
}

#[test]
fn debian_kernel_lists_acpi_tables() {
    let (kernel, _initrd, _disk) = linux_guest();
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(240);
    let mut r = Running::start(&[
        "run",
        "--kernel",
        kernel.to_str().unwrap(),
        "--vcpus",
        "2",
        "--memory",
        "512",
        "--cmdline",
        "console=ttyS0 earlyprintk=ttyS0 reboot=k panic=-1",
    ]);
    // The kernel prints the RSDP, then every table in XSDT order, the DSDT
    // right after the FADT.
    for sig in ["RSDP", "XSDT", "FACP", "DSDT", "APIC"] {
        let left = deadline.saturating_duration_since(Instant::now());
        let hit = r.wait_for(&format!("ACPI: {sig} 0x"), left);
        assert!(
            hit.is_some(),
            "no 'ACPI: {sig}' line within 240 s; saw:\n{}",
            r.seen.join("\n")
        );
        eprintln!(
            "{sig} after {:.1} s: {}",
            t0.elapsed().as_secs_f64(),
            hit.unwrap().trim()
        );
    }
    // The MADT parsed: both vCPUs are possible CPUs (this kernel has no MP
    // table parser, so they can only come from the MADT). Printed shortly
    // after the table listing, still in setup_arch.
    let cpus = r.wait_for("smpboot: Allowing", Duration::from_secs(120));
    assert!(
        cpus.as_deref()
            .is_some_and(|l| l.contains("Allowing 2 CPUs")),
        "expected 'smpboot: Allowing 2 CPUs', got {cpus:?}; saw:\n{}",
        r.seen.join("\n")
    );
    // The DSDT is interpreted later (acpi_early_init). Required where the
    // host is fast; on kvm_pvm hosts it is waited for a while but the
    // DSDT's interpretation is covered offline by acpiexec.
    let aml_wait = if host_is_pvm() { 90 } else { 60 };
    let aml = r.wait_for(
        "ACPI AML tables successfully",
        Duration::from_secs(aml_wait),
    );
    match &aml {
        Some(l) => eprintln!(
            "AML loaded after {:.1} s: {}",
            t0.elapsed().as_secs_f64(),
            l.trim()
        ),
        None if host_is_pvm() => eprintln!(
            "note: the kernel did not reach AML loading within {aml_wait} s more on this \
             kvm_pvm host; checked the table listing and the MADT only"
        ),
        None => panic!(
            "no 'ACPI: 1 ACPI AML tables successfully acquired and loaded'; saw:\n{}",
            r.seen.join("\n")
        ),
    }

    for sig in ["RSDP", "XSDT", "FACP", "DSDT", "APIC"] {
        let l = table_line(&r.seen, sig).unwrap();
        assert!(l.contains("CORRAL"), "{sig} is not ours: {l}");
    }
    assert!(
        table_line(&r.seen, "RSDP")
            .unwrap()
            .contains("0x00000000000E0000"),
        "RSDP not at 0xe0000"
    );
    let bad = acpi_problems(&r.seen);
    assert!(
        bad.is_empty(),
        "ACPI problems in the boot log:\n{}\n\nfull log:\n{}",
        bad.iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        r.seen.join("\n")
    );
}

#[test]
fn debian_guest_acpi_full_boot() {
    if host_is_pvm() {
        eprintln!(
            "SKIPPED debian_guest_acpi_full_boot: /sys/module/kvm_pvm is present; this host \
             runs stock Linux kernels ~100x slower under software-assisted nested KVM and they \
             cannot reach userspace here. The test runs on hosts with VMX/SVM."
        );
        return;
    }
    let help = Command::new(corral_bin())
        .args(["run", "--help"])
        .output()
        .expect("corral run --help");
    assert!(
        String::from_utf8_lossy(&help.stdout).contains("--disk"),
        "`corral run` has no --disk option yet (virtio-blk issue): cannot check /dev/vda"
    );
    let (kernel, initrd, disk) = linux_guest();
    let mut r = Running::start(&[
        "run",
        "--kernel",
        kernel.to_str().unwrap(),
        "--initrd",
        initrd.to_str().unwrap(),
        "--disk",
        disk.to_str().unwrap(),
        "--vcpus",
        "2",
        "--memory",
        "512",
        "--cmdline",
        "console=ttyS0 reboot=k panic=-1 corral.halt=poweroff",
    ]);
    let done = r.wait_for("CORRAL-LINUX-DONE", Duration::from_secs(120));
    assert!(done.is_some(), "no init marker:\n{}", r.seen.join("\n"));
    let has = |s: &str| r.seen.iter().any(|l| l.contains(s));
    assert!(has("CORRAL-LINUX-CPUS n=2"), "{}", r.seen.join("\n"));
    assert!(has("CORRAL-LINUX-VDA present"), "{}", r.seen.join("\n"));
    // Power-off through ACPI S5 is a clean stop: `corral run` exits 0.
    let t = Instant::now();
    let status = loop {
        if let Some(s) = r.child.try_wait().expect("wait") {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the VM did not stop after poweroff:\n{}",
            r.seen.join("\n")
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "corral run: {status}");
    assert!(has("corral-init: halt=poweroff"), "{}", r.seen.join("\n"));
    let bad = acpi_problems(&r.seen);
    assert!(bad.is_empty(), "ACPI problems: {bad:?}");
}
