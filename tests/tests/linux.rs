//! The Debian cloud kernel, built from packages by guest-images/linux/build.sh.
//!
//! On this project's development hosts (/sys/module/kvm_pvm: nested,
//! software-assisted KVM) a stock kernel runs ~100x slower and only reaches
//! its early boot messages; the banner test runs everywhere, the full boot
//! only where the host can do it.

use std::time::{Duration, Instant};

use corral_tests::{Running, host_is_pvm, linux_guest};

#[test]
fn debian_kernel_prints_its_banner() {
    let (kernel, _initrd, _disk) = linux_guest();
    let t0 = Instant::now();
    let mut r = Running::start(&[
        "run",
        "--kernel",
        kernel.to_str().unwrap(),
        "--memory",
        "512",
        "--cmdline",
        "console=ttyS0 earlyprintk=ttyS0 reboot=k panic=-1",
    ]);
    let line = r.wait_for("Linux version", Duration::from_secs(240));
    assert!(
        line.is_some(),
        "no 'Linux version' on the serial console in 240 s; saw:\n{}",
        r.seen.join("\n")
    );
    eprintln!(
        "Linux banner after {:.1} s: {}",
        t0.elapsed().as_secs_f64(),
        line.unwrap()
    );
}

#[test]
fn debian_guest_boots_to_init_marker() {
    if host_is_pvm() {
        eprintln!(
            "SKIPPED debian_guest_boots_to_init_marker: /sys/module/kvm_pvm is present; this host \
             runs stock Linux kernels ~100x slower under software-assisted nested KVM and they \
             cannot reach userspace here. The test runs on hosts with VMX/SVM."
        );
        return;
    }
    let (kernel, initrd, _disk) = linux_guest();
    let mut r = Running::start(&[
        "run",
        "--kernel",
        kernel.to_str().unwrap(),
        "--initrd",
        initrd.to_str().unwrap(),
        "--vcpus",
        "2",
        "--memory",
        "512",
        "--cmdline",
        "console=ttyS0 reboot=k panic=-1",
    ]);
    let marker = r.wait_for("CORRAL-LINUX-DONE", Duration::from_secs(120));
    assert!(marker.is_some(), "no init marker:\n{}", r.seen.join("\n"));
    assert!(
        r.seen.iter().any(|l| l.contains("CORRAL-LINUX-CPUS n=2")),
        "{}",
        r.seen.join("\n")
    );
}
