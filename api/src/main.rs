//! `corral`: the daemon and its command-line client.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use corral_vmm::{ExitReason, KernelSource, VmConfig};

mod term;

/// The built-in default guest: the probe, built from guest-images/probe.
static PROBE_ELF: &[u8] = include_bytes!(env!("CORRAL_PROBE_ELF"));

#[derive(Parser, Debug)]
#[command(
    name = "corral",
    version,
    about = "KVM resource manager: VMs by class shares, exact I/O limits, REST API"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run one VM in the foreground with its console on stdout.
    Run(RunArgs),
    /// Write the built-in probe guest's ELF image to a file.
    ExportProbe {
        /// Output file.
        path: PathBuf,
    },
}

#[derive(clap::Args, Debug)]
struct RunArgs {
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
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CORRAL_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run(a) => run(a),
        Cmd::ExportProbe { path } => match std::fs::write(&path, PROBE_ELF) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("corral: cannot write {}: {e}", path.display());
                ExitCode::from(2)
            }
        },
    }
}

fn run(a: RunArgs) -> ExitCode {
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
    cfg.initrd = a.initrd;
    cfg.cmdline = a.cmdline.unwrap_or_else(|| default_cmdline.to_string());
    cfg.vcpus = vcpus;
    cfg.memory_mib = a.memory;
    cfg.console_stdout = true;
    cfg.console_stdin = true;

    let _raw = term::RawStdin::enable();
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
        ExitReason::Stopped => {
            eprintln!("corral: VM stopped before the guest shut down");
            ExitCode::from(1)
        }
        r @ ExitReason::Fatal { .. } => {
            eprintln!("corral: VM failed: {r}");
            ExitCode::from(1)
        }
    }
}
