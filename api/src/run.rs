//! `corral run`: one VM in the foreground with its console on the terminal.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use corral_vmm::{ExitReason, KernelSource, VmConfig};

use crate::{PROBE_ELF, term};

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Kernel image (ELF vmlinux or bzImage); default: the built-in probe guest.
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Initial ramdisk.
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Kernel command line (default: `console=ttyS0` for a kernel, empty for the probe).
    #[arg(long)]
    cmdline: Option<String>,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    vcpus: u32,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 128)]
    memory: u64,
    /// A virtio-blk disk (repeatable): `PATH[,readonly][,direct][,id=NAME]`
    /// with optional limits `bps=N,iops=N,burst_bytes=N,burst_ops=N,
    /// rbps=..,wbps=..,riops=..,wiops=..,onetime_bytes=..,onetime_ops=..`
    /// (byte values take K/M/G suffixes, powers of 1024).
    #[arg(long, value_name = "SPEC")]
    disk: Vec<String>,
    /// No ACPI tables: the guest finds CPUs through the MP table and virtio
    /// devices through `virtio_mmio.device=` on the command line only.
    #[arg(long)]
    no_acpi: bool,
    /// No seccomp filters (for debugging: e.g. under a tool that makes
    /// syscalls of its own in corral's threads).
    #[arg(long)]
    no_seccomp: bool,
}

/// Runs it.
pub fn run(a: RunArgs) -> ExitCode {
    let fail = |msg: String| {
        eprintln!("corral: {msg}");
        ExitCode::from(2)
    };
    let vcpus = match u8::try_from(a.vcpus) {
        Ok(v) => v,
        Err(_) => {
            return fail(format!(
                "{} vCPUs is more than corral supports per VM (254)",
                a.vcpus
            ));
        }
    };
    let (kernel, default_cmdline) = match a.kernel {
        Some(p) => (KernelSource::Path(p), "console=ttyS0 reboot=k panic=-1"),
        None => (KernelSource::Bytes(Arc::from(PROBE_ELF)), ""),
    };
    let mut cfg = VmConfig::new("run", kernel);
    cfg.initrd = a.initrd.map(corral_vmm::hostfile::HostImage::Path);
    cfg.cmdline = a.cmdline.unwrap_or_else(|| default_cmdline.to_string());
    cfg.vcpus = vcpus;
    cfg.memory_mib = a.memory;
    cfg.console_stdout = true;
    cfg.console_stdin = true;
    cfg.acpi = !a.no_acpi;
    for d in &a.disk {
        match corral_vmm::vm::DiskConfig::parse(d) {
            Ok(d) => cfg.disks.push(d),
            Err(e) => return fail(e.to_string()),
        }
    }

    let _raw = term::RawStdin::enable();
    // This (main) thread's filter is the runtime's; the VM's threads
    // inherit it and narrow it with their own.
    if !a.no_seccomp
        && let Err(e) = corral_vmm::seccomp::enable()
            .and_then(|()| corral_vmm::seccomp::check_all())
            .inspect(|()| corral_vmm::boottrace::step("seccomp-compile"))
            .and_then(|()| corral_vmm::seccomp::install(corral_vmm::seccomp::ThreadKind::Runtime))
    {
        return fail(e.to_string());
    }
    corral_vmm::boottrace::step("runtime-seccomp");
    let vm = match corral_vmm::start(&cfg) {
        Ok(vm) => vm,
        Err(e) => return fail(e.to_string()),
    };
    let stop = term::on_terminate_signal();
    loop {
        if vm
            .wait(Some(std::time::Duration::from_millis(50)))
            .is_some()
        {
            break;
        }
        if let Some(sig) = stop.take() {
            eprintln!("corral: stopping the VM on signal {sig}");
            vm.stop();
        }
    }
    let reason = vm.join();
    drop(_raw);
    match reason {
        ExitReason::GuestShutdown => ExitCode::SUCCESS,
        ExitReason::Stopped | ExitReason::DaemonRestarted => {
            eprintln!("corral: VM stopped before the guest shut down");
            ExitCode::from(1)
        }
        r @ (ExitReason::Fatal { .. }
        | ExitReason::ThreadFault { .. }
        | ExitReason::ProcessGone { .. }) => {
            eprintln!("corral: VM failed: {r}");
            ExitCode::from(1)
        }
    }
}
