//! The client commands' arguments: the client options and the `vm`,
//! `class` and `disk` subcommands.

use std::path::PathBuf;

use clap::Subcommand;

use crate::client::{Client, ClientError};

/// The heading of the client options in `--help`.
pub const CLIENT_HEADING: &str = "Client options";

/// Where the daemon is, and how to print: options of every client command,
/// accepted after the command (`corral vm list --json`) and, for the
/// commands with subcommands, anywhere after it. The same options before
/// the command (`corral --json vm list`) are the top level's.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ClientOpts {
    /// The daemon's Unix socket [default: /run/corral/corral.sock; env: CORRAL_SOCKET].
    #[arg(long, global = true, value_name = "PATH", help_heading = CLIENT_HEADING)]
    pub socket: Option<PathBuf>,
    /// The daemon's TCP URL, e.g. http://127.0.0.1:7070 [env: CORRAL_URL].
    #[arg(long, global = true, value_name = "URL", help_heading = CLIENT_HEADING)]
    pub url: Option<String>,
    /// The daemon's token file for --url [default: /run/corral/token; env: CORRAL_TOKEN_FILE].
    #[arg(long, global = true, value_name = "PATH", help_heading = CLIENT_HEADING)]
    pub token_file: Option<PathBuf>,
    /// JSON output for scripts.
    #[arg(long, global = true, help_heading = CLIENT_HEADING)]
    pub json: bool,
}

impl ClientOpts {
    /// These options where given, else `outer`'s (the ones before the
    /// command, or the environment); `--json` in either place counts.
    pub fn or(self, outer: ClientOpts) -> ClientOpts {
        let json = self.json || outer.json;
        let token_file = self.token_file.clone().or(outer.token_file.clone());
        if self.socket.is_some() || self.url.is_some() {
            ClientOpts {
                json,
                token_file,
                ..self
            }
        } else {
            ClientOpts {
                json,
                token_file,
                ..outer
            }
        }
    }

    /// The client for these options.
    pub fn client(&self) -> Result<Client, ClientError> {
        if self.socket.is_some() && self.url.is_some() {
            return Err(ClientError::Usage(
                "--socket and --url name two daemons: give one".into(),
            ));
        }
        Client::from_args(
            self.socket.clone(),
            self.url.clone(),
            self.token_file.clone(),
        )
    }
}

/// `corral vm ...`.
#[derive(Subcommand, Debug)]
pub enum VmCmd {
    /// Create and start a VM (default guest: the built-in probe).
    Create {
        /// Name (default: assigned by the daemon).
        name: Option<String>,
        /// Class.
        #[arg(long)]
        class: Option<String>,
        /// Weight within the class (1..10000, default 100).
        #[arg(long)]
        weight: Option<u32>,
        /// The VM's own CPU cap in percent of one CPU (on top of its
        /// class's cap).
        #[arg(long)]
        cap: Option<u32>,
        /// vCPUs.
        #[arg(long)]
        vcpus: Option<u32>,
        /// Memory in MiB.
        #[arg(long)]
        memory: Option<u64>,
        /// Kernel file on the daemon's host.
        #[arg(long)]
        kernel: Option<String>,
        /// Initrd file on the daemon's host.
        #[arg(long)]
        initrd: Option<String>,
        /// Kernel command line (for the probe e.g. `probe.mode=spin probe.secs=30`).
        #[arg(long)]
        cmdline: Option<String>,
        /// A disk: `PATH[,readonly][,direct][,id=NAME][,bps=N,iops=N,...]`.
        #[arg(long)]
        disk: Vec<String>,
    },
    /// List VMs.
    #[command(alias = "ls")]
    List,
    /// Show one VM.
    Show {
        /// VM name.
        name: String,
    },
    /// Stop and delete VMs.
    #[command(alias = "delete")]
    Rm {
        /// VM names.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Stop VMs at once (like pulling the plug), keeping their definitions.
    Stop {
        /// VM names.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Start stopped VMs again from their definitions.
    Start {
        /// VM names.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Stop a VM hard and start it again.
    Reboot {
        /// VM name.
        name: String,
    },
    /// Press a VM's ACPI power button and wait for it to power off; stop it
    /// hard when the timeout passes.
    Shutdown {
        /// VM name.
        name: String,
        /// Seconds the guest has to power off (0..=600).
        #[arg(long, default_value_t = 30.0)]
        timeout: f64,
    },
    /// Pause a VM's vCPUs.
    Pause {
        /// VM name.
        name: String,
    },
    /// Resume a paused VM.
    Resume {
        /// VM name.
        name: String,
    },
    /// Change a VM's settings, live.
    Set {
        /// VM name.
        name: String,
        /// The VM's own CPU cap in percent of one CPU, or `none`.
        #[arg(long)]
        cap: Option<String>,
        /// Its weight in its class (1..=10000): its share of the class's
        /// CPU and of the class's I/O.
        #[arg(long)]
        weight: Option<u32>,
    },
    /// Move a VM to another class, live.
    Move {
        /// VM name.
        name: String,
        /// Target class.
        class: String,
        /// New weight within the class.
        #[arg(long)]
        weight: Option<u32>,
    },
    /// Print a VM's console output.
    Console {
        /// VM name.
        name: String,
        /// Only the last N lines.
        #[arg(long)]
        tail: Option<usize>,
        /// Keep printing new output until the VM stops (Ctrl-C to quit).
        #[arg(short, long)]
        follow: bool,
        /// Interactive: also send what you type to the guest (raw terminal;
        /// Ctrl-] detaches).
        #[arg(long, conflicts_with_all = ["tail", "follow"])]
        attach: bool,
    },
}

/// `corral class ...`.
#[derive(Subcommand, Debug)]
pub enum ClassCmd {
    /// Create a class or change it (only the given settings change).
    Set {
        /// Class name.
        name: String,
        /// CPU shares (1..10000; default 100 for a new class).
        #[arg(long)]
        shares: Option<u32>,
        /// CPU cap in percent of one CPU, or `none`.
        #[arg(long)]
        cap: Option<String>,
        /// CPU reservation in percent of one CPU, or `none`.
        #[arg(long)]
        reservation: Option<String>,
        /// I/O group limits: `bps=N,iops=N,...` (empty = none).
        #[arg(long)]
        io: Option<String>,
        /// Parent class, for a new class (a class cannot move in the tree).
        #[arg(long)]
        parent: Option<String>,
    },
    /// List classes.
    #[command(alias = "ls")]
    List,
    /// Show the class tree: each class under its parent, with its VMs.
    Tree,
    /// Show one class.
    Show {
        /// Class name.
        name: String,
    },
    /// Delete an empty class.
    #[command(alias = "delete")]
    Rm {
        /// Class name.
        name: String,
    },
}

/// `corral disk ...`.
#[derive(Subcommand, Debug)]
pub enum DiskCmd {
    /// Change a disk's limits live: `corral disk limit VM DISK bps=10M iops=500`.
    ///
    /// The given limits change and the others stay (`iops=500` keeps a
    /// `bps` limit); `KEY=none` or `KEY=0` removes one. With `--replace`
    /// the given limits are all the disk keeps.
    Limit {
        /// VM name.
        vm: String,
        /// Disk id.
        disk: String,
        /// `key=value` limits (bps, iops, rbps, wbps, riops, wiops, burst_bytes, burst_ops; sizes take K/M/G suffixes); none = unlimited.
        limits: Vec<String>,
        /// Replace all limits with the given ones (none given: unlimited).
        #[arg(long)]
        replace: bool,
    },
}
