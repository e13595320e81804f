//! `corral`: the daemon and its command-line client.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};

mod bench_exec;
mod cli;
mod client;
mod demo;
mod dto;
mod metrics;
mod run;
mod server;
mod term;
mod ui;

/// The built-in default guest: the probe, built from guest-images/probe.
pub(crate) use corral_probe::PROBE_ELF;

#[derive(Parser, Debug)]
#[command(
    name = "corral",
    version,
    about = "KVM resource manager: VMs by class shares, exact I/O limits, REST API"
)]
struct Cli {
    /// The daemon's Unix socket (client commands; also `serve`'s socket).
    #[arg(long, env = "CORRAL_SOCKET", value_name = "PATH", help_heading = cli::CLIENT_HEADING)]
    socket: Option<PathBuf>,
    /// The daemon's TCP URL, e.g. http://127.0.0.1:7070 (client commands).
    #[arg(
        long,
        env = "CORRAL_URL",
        conflicts_with = "socket",
        value_name = "URL",
        help_heading = cli::CLIENT_HEADING
    )]
    url: Option<String>,
    /// The daemon's token file, sent as the bearer token with --url (client
    /// commands; default /run/corral/token; also `serve`'s --token-file).
    #[arg(
        long,
        env = "CORRAL_TOKEN_FILE",
        value_name = "PATH",
        help_heading = cli::CLIENT_HEADING
    )]
    token_file: Option<PathBuf>,
    /// JSON output for scripts (client commands).
    #[arg(long, help_heading = cli::CLIENT_HEADING)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

impl Cli {
    /// The client options given before the command (or in the environment).
    fn client_opts(&self) -> cli::ClientOpts {
        cli::ClientOpts {
            socket: self.socket.clone(),
            url: self.url.clone(),
            token_file: self.token_file.clone(),
            json: self.json,
        }
    }
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run one VM in the foreground with its console on stdout.
    Run(run::RunArgs),
    /// Write the built-in probe guest's ELF image to a file.
    ExportProbe {
        /// Output file.
        path: PathBuf,
    },
    /// Run the daemon: many VMs, the REST API on a Unix socket (and TCP).
    Serve(ServeCmd),
    /// VMs: create, list, show, rm, pause, resume, move, console.
    Vm {
        #[command(subcommand)]
        cmd: cli::VmCmd,
        #[command(flatten)]
        opts: cli::ClientOpts,
    },
    /// Resource classes: set, list, show, rm.
    Class {
        #[command(subcommand)]
        cmd: cli::ClassCmd,
        #[command(flatten)]
        opts: cli::ClientOpts,
    },
    /// Disks: change limits live.
    Disk {
        #[command(subcommand)]
        cmd: cli::DiskCmd,
        #[command(flatten)]
        opts: cli::ClientOpts,
    },
    /// Live per-VM and per-class CPU and disk figures, refreshed every second.
    Top {
        #[command(flatten)]
        args: cli::top::TopArgs,
        #[command(flatten)]
        opts: cli::ClientOpts,
    },
    /// The daemon's status.
    Status {
        #[command(flatten)]
        opts: cli::ClientOpts,
    },
    /// Start a daemon, run VMs in two classes, show the figures, clean up.
    Demo(demo::DemoArgs),
    /// Benchmarks: overhead, interference, throttle (report, plots, CSV);
    /// runs `corral-bench`, see `corral bench --help`.
    #[command(disable_help_flag = true)]
    Bench {
        /// Arguments for `corral-bench`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
}

#[derive(clap::Args, Debug)]
struct ServeCmd {
    #[command(flatten)]
    args: server::ServeArgs,
}

/// `corral run` parsed on its own: building the whole command tree (every
/// subcommand of the daemon and the client) touches much of the binary, and
/// `corral run`'s start-up time and RSS are benchmark targets.
#[derive(Parser, Debug)]
#[command(
    name = "corral run",
    version,
    about = "Run one VM in the foreground with its console on stdout"
)]
struct RunCli {
    #[command(flatten)]
    args: run::RunArgs,
}

fn main() -> ExitCode {
    corral_vmm::boottrace::step("main");
    match std::env::var("CORRAL_LOG") {
        Ok(_) => tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("CORRAL_LOG")
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            )
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        Err(_) => tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
    // The daemon's internal commands: parsed by hand, without the command
    // tree (a VM process's start-up time and RSS are benchmark targets).
    match std::env::args_os().nth(1) {
        Some(a) if a == "vmm" => return vmm_process(),
        Some(a) if a == "vmm-launcher" => {
            return ExitCode::from(
                corral_vmm::vmproc::launcher::launcher_main().clamp(0, 255) as u8
            );
        }
        _ => {}
    }
    if std::env::args_os().nth(1).is_some_and(|a| a == "run") {
        let rest: Vec<std::ffi::OsString> = std::env::args_os().skip(2).collect();
        let args = run::RunArgs::parse_plain(&rest).unwrap_or_else(|| {
            RunCli::parse_from(std::iter::once("corral run".into()).chain(rest)).args
        });
        corral_vmm::boottrace::step("args");
        return run::run(args);
    }
    let cli = Cli::parse();
    let outer = cli.client_opts();
    let builtin = || Arc::<[u8]>::from(PROBE_ELF);
    let fail = |msg: String| {
        eprintln!("corral: {msg}");
        ExitCode::from(1)
    };
    match cli.cmd {
        Cmd::Run(a) => run::run(a),
        Cmd::ExportProbe { path } => match std::fs::write(&path, PROBE_ELF) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("corral: cannot write {}: {e}", path.display());
                ExitCode::from(2)
            }
        },
        Cmd::Serve(s) => {
            let mut args = s.args;
            // `corral --socket P serve` or CORRAL_SOCKET, unless serve's own
            // --socket names another path.
            if let Some(p) = cli.socket
                && args.socket == std::path::Path::new(client::DEFAULT_SOCKET)
            {
                args.socket = p;
            }
            if let Some(p) = cli.token_file {
                args.api.token_file = Some(p);
            }
            match server::serve(args, builtin()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(e.to_string()),
            }
        }
        Cmd::Demo(a) => match demo::demo(a, builtin()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(e.to_string()),
        },
        Cmd::Bench { args } => bench_exec::exec(args),
        cmd => {
            // Die quietly of SIGPIPE, as other command-line tools do, when
            // the reader of our output goes away (`corral vm list | head -1`):
            // Rust ignores it, and println! then panics on EPIPE.
            // SAFETY: signal(2) restoring the default action, before any
            // thread is started.
            unsafe {
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            }
            let opts = match &cmd {
                Cmd::Vm { opts, .. }
                | Cmd::Class { opts, .. }
                | Cmd::Disk { opts, .. }
                | Cmd::Top { opts, .. }
                | Cmd::Status { opts } => opts.clone().or(outer),
                _ => outer,
            };
            let client = match opts.client() {
                Ok(c) => c,
                Err(e) => return fail(e.to_string()),
            };
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => return fail(format!("tokio runtime: {e}")),
            };
            let json = opts.json;
            let r = rt.block_on(async {
                // Err(None): interrupted by Ctrl-C.
                match cmd {
                    Cmd::Vm { cmd, .. } => cli::vm(&client, cmd, json).await.map_err(Some),
                    Cmd::Class { cmd, .. } => cli::class(&client, cmd, json).await.map_err(Some),
                    Cmd::Disk { cmd, .. } => cli::disk(&client, cmd, json).await.map_err(Some),
                    Cmd::Top { args, .. } => match cli::top::top(&client, args, json).await {
                        Ok(cli::top::TopEnd::Interrupted) => Err(None),
                        Ok(cli::top::TopEnd::Done) => Ok(()),
                        Err(e) => Err(Some(e)),
                    },
                    Cmd::Status { .. } => cli::status(&client, json).await.map_err(Some),
                    _ => Ok(()),
                }
            });
            match r {
                Ok(()) => ExitCode::SUCCESS,
                Err(Some(e)) => fail(e.to_string()),
                // The status of a command ended by SIGINT, as shells report it.
                Err(None) => ExitCode::from(130),
            }
        }
    }
}

/// `corral vmm --fd N [--name NAME]`: one VM in this process, configured
/// and controlled by the daemon over the inherited socket `N` (internal:
/// `corral serve` starts it; see ARCHITECTURE.md, "VM processes").
fn vmm_process() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(2).collect();
    let fd = args
        .iter()
        .position(|a| a == "--fd")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse::<i32>().ok())
        .filter(|&fd| fd > 2);
    let Some(fd) = fd else {
        eprintln!("corral vmm: internal command of `corral serve`; usage: corral vmm --fd N");
        return ExitCode::from(2);
    };
    // Namespaces the launcher made for this process ahead of time (its jail
    // checks them and does not make them again).
    if let Some(list) = args
        .iter()
        .position(|a| a == "--jail-ns")
        .and_then(|i| args.get(i + 1))
        && let Err(e) = corral_vmm::jail::spawned_in(list)
    {
        eprintln!("corral vmm: {e}");
        return ExitCode::from(2);
    }
    // SAFETY: the launcher set up fd `fd` for this process as its socket to
    // the daemon; nothing else in this process owns it.
    let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    match corral_vmm::vmproc::server::run(sock, Arc::<[u8]>::from(PROBE_ELF)) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("corral vmm: {e}");
            ExitCode::from(1)
        }
    }
}
