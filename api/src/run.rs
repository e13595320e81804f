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

impl RunArgs {
    /// `corral run`'s arguments without clap, for the common case: each
    /// option at most once (`--disk` any number of times), as `--NAME
    /// VALUE` or `--NAME=VALUE`, with values that do not start with `-` and
    /// parse. `None` for anything else (`--help`, `--version`, an unknown
    /// or repeated option, a bad number, `--`): the caller then parses with
    /// clap, which accepts the same and says what is wrong with the rest.
    /// Why: clap's parser is ~0.1 MiB of code and ~0.1 ms that `corral
    /// run`'s start-up (RSS and time to the guest's first output, both
    /// benchmark targets) spends on a handful of options.
    /// `parse_plain_agrees_with_clap` keeps the two in step.
    pub fn parse_plain(args: &[std::ffi::OsString]) -> Option<Self> {
        let mut a = Self {
            kernel: None,
            initrd: None,
            cmdline: None,
            vcpus: 1,
            memory: 128,
            disk: Vec::new(),
            no_acpi: false,
            no_seccomp: false,
        };
        let mut seen = [false; 7];
        let mut once = |i: usize| !std::mem::replace(&mut seen[i], true);
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let arg = arg.to_str()?;
            let (name, inline) = match arg.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (arg, None),
            };
            match name {
                "--no-acpi" if inline.is_none() && once(0) => a.no_acpi = true,
                "--no-seccomp" if inline.is_none() && once(1) => a.no_seccomp = true,
                "--kernel" | "--initrd" | "--cmdline" | "--vcpus" | "--memory" | "--disk" => {
                    let v = match inline {
                        Some(v) => v,
                        None => it.next()?.to_str()?,
                    };
                    if v.is_empty() || (inline.is_none() && v.starts_with('-')) {
                        return None;
                    }
                    match name {
                        "--kernel" if once(2) => a.kernel = Some(v.into()),
                        "--initrd" if once(3) => a.initrd = Some(v.into()),
                        "--cmdline" if once(4) => a.cmdline = Some(v.into()),
                        "--vcpus" if once(5) => a.vcpus = v.parse().ok()?,
                        "--memory" if once(6) => a.memory = v.parse().ok()?,
                        "--disk" => a.disk.push(v.into()),
                        _ => return None,
                    }
                }
                _ => return None,
            }
        }
        Some(a)
    }
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
        | ExitReason::ProcessGone { .. }
        | ExitReason::NotAdopted { .. }) => {
            eprintln!("corral: VM failed: {r}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::RunArgs;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        args: RunArgs,
    }

    fn both(line: &[&str]) -> (Option<String>, Option<String>) {
        let args: Vec<std::ffi::OsString> = line.iter().map(Into::into).collect();
        let plain = RunArgs::parse_plain(&args).map(|a| format!("{a:?}"));
        let clap = Cli::try_parse_from(std::iter::once("run".into()).chain(args))
            .ok()
            .map(|c| format!("{:?}", c.args));
        (plain, clap)
    }

    /// What the plain parser accepts, clap accepts with the same result;
    /// what it leaves to clap is either an error there or needs clap.
    #[test]
    fn parse_plain_agrees_with_clap() {
        let accepted: &[&[&str]] = &[
            &[],
            &["--vcpus", "2", "--memory", "64"],
            &["--vcpus=3", "--memory=+256", "--no-acpi", "--no-seccomp"],
            &["--cmdline", "probe.mode=spin probe.secs=2"],
            &["--cmdline=-x", "--kernel", "/k", "--initrd=/i"],
            &[
                "--disk",
                "a.img,readonly",
                "--disk=b.img,bps=1M",
                "--disk",
                "c",
            ],
        ];
        for line in accepted {
            let (plain, clap) = both(line);
            assert!(plain.is_some(), "{line:?}: not accepted");
            assert_eq!(plain, clap, "{line:?}");
        }
        let left_to_clap: &[&[&str]] = &[
            &["--help"],
            &["-h"],
            &["--version"],
            &["--vcpus"],
            &["--vcpus", "-1"],
            &["--vcpus", "x"],
            &["--vcpus", "4294967296"],
            &["--vcpus", "1", "--vcpus", "2"],
            &["--no-acpi", "--no-acpi"],
            &["--no-acpi=true"],
            &["--cmdline", "-x"],
            &["--cmdline="],
            &["--memory", "1", "extra"],
            &["--", "--vcpus", "1"],
            &["--vcpu", "1"],
        ];
        for line in left_to_clap {
            let (plain, _) = both(line);
            assert_eq!(plain, None, "{line:?}: should be left to clap");
        }
        // Where clap succeeds on a line left to it, it is for a reason the
        // plain parser does not handle (help and version exit in clap).
        assert!(both(&["--cmdline", "-x"]).1.is_none());
        assert!(both(&["--vcpus", "1", "--vcpus", "2"]).1.is_none());
    }
}
