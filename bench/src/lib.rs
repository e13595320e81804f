//! `corral bench`: benchmarks that follow the kernel lists' method — the
//! same guest job repeated, configurations interleaved (A B C A B C),
//! min / avg / max / sdev / spread per configuration and the difference as
//! a ratio — run in-process through the [`Manager`](corral_vmm::manager::Manager),
//! the daemon's own path.
//!
//! * `overhead`: the probe's CPU job and I/O job, and on hosts with hardware
//!   virtualisation a Linux guest's kernel compile ([`linux`]), with the
//!   manager off, with the CPU scheduler on (no contention) and with I/O
//!   limits far above need.
//! * `interference`: a victim VM's job alone, beside a CPU hog and beside an
//!   I/O hog, with equal classes and with shares 3:1 plus an I/O limit on
//!   the hog.
//! * `throttle`: achieved versus configured I/O rate over a grid of limits
//!   and burst sizes, and the cost of limits that are never hit.
//!
//! Each writes `report.md`, PNG plots and CSV samples into `--out` (default
//! `bench-out/<kind>-<UTC time>/`) and shows a progress bar on stderr.
//! `--quick` runs a short form (a smoke test, not a measurement).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

mod ab;
mod host;
mod interference;
mod linux;
mod overhead;
mod plot;
mod report;
mod rounds;
mod runner;
mod stats;
mod throttle;

/// An error of a benchmark run.
#[derive(Debug)]
pub struct BenchError(pub String);

impl std::fmt::Display for BenchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BenchError {}

/// `corral bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    kind: BenchKind,
}

#[derive(clap::Subcommand, Debug)]
enum BenchKind {
    /// The cost of the manager: the same job with the manager off (A), the
    /// CPU scheduler on (B) and I/O limits 100x above need (C), interleaved.
    Overhead(OverheadArgs),
    /// A victim VM's slowdown beside a CPU hog and an I/O hog, with equal
    /// classes and with shares 3:1 plus an I/O limit on the hog.
    Interference(InterferenceArgs),
    /// Achieved versus configured I/O rate over a grid of limits and bursts,
    /// and the cost of limits that are never hit.
    Throttle(ThrottleArgs),
    /// One command on two builds, interleaved: the ratio new/old with its
    /// 95 % interval (e.g. `ab old/corral new/corral --until PROBE-UP -- run`).
    Ab(ab::AbArgs),
}

/// Options every benchmark has.
#[derive(clap::Args, Debug, Clone)]
pub struct CommonArgs {
    /// Output directory (default: bench-out/<kind>-<UTC time>/).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// A short form with tiny jobs and few runs (a smoke test, not a
    /// measurement).
    #[arg(long)]
    pub quick: bool,
}

/// How the probe's virtio-blk driver waits for completions
/// (`probe.wait=`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeWait {
    /// Sleep in `hlt` until the used-ring interrupt (the probe's default).
    Irq,
    /// Spin on the used ring for the whole wait (the driver before
    /// session 4: a throttled job burns its vCPU).
    Poll,
}

impl ProbeWait {
    /// The probe's parameter value.
    pub fn param(self) -> &'static str {
        match self {
            Self::Irq => "irq",
            Self::Poll => "poll",
        }
    }
}

/// Which jobs `overhead` runs.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobKind {
    /// The probe's fixed integer job.
    Cpu,
    /// The probe's virtio-blk read job.
    Io,
    /// Both probe jobs.
    Both,
    /// Only the Linux kernel compile (an error if it cannot run here).
    Linux,
    /// Both probe jobs, and the Linux kernel compile where this host and the
    /// images allow it (not with --quick); the report says why not otherwise.
    All,
}

impl JobKind {
    /// Whether the Linux job is asked for.
    pub fn linux_selection(self) -> linux::Selection {
        match self {
            Self::Cpu | Self::Io | Self::Both => linux::Selection::NotSelected,
            Self::Linux => linux::Selection::Required,
            Self::All => linux::Selection::IfPossible,
        }
    }
}

/// `corral bench overhead`.
#[derive(clap::Args, Debug, Clone)]
pub struct OverheadArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Rounds (each runs every configuration once): a fixed number. Without
    /// it, rounds go on until every ratio's 95 % interval is within
    /// --target, or until --budget is spent (2 rounds with --quick).
    #[arg(long)]
    runs: Option<u32>,
    /// The 95 % interval half-width to reach, in percent.
    #[arg(long, default_value_t = 0.3)]
    target: f64,
    /// Time budget for the rounds (e.g. 15m, 1h; default 15m).
    #[arg(long, value_parser = stats::parse_duration)]
    budget: Option<std::time::Duration>,
    /// Guest seconds each probe job should take (the jobs are sized from a
    /// calibration run; longer jobs have less relative noise).
    #[arg(long, default_value_t = 2.0)]
    job_secs: f64,
    /// Guest jobs.
    #[arg(long, value_enum, default_value_t = JobKind::All)]
    job: JobKind,
    /// How the probe's io job waits for completions (`probe.wait=`).
    #[arg(long, value_enum, default_value_t = ProbeWait::Irq)]
    probe_wait: ProbeWait,
    /// How A and a candidate run: `sequential` (one after the other, A B C
    /// then C B A) or `parallel` (at the same time, each pinned to one of
    /// two CPUs, the CPUs swapped every round, with an A/A self-check).
    #[arg(long, value_enum, default_value_t = Layout::Sequential)]
    layout: Layout,
    #[command(flatten)]
    linux: linux::LinuxArgs,
}

/// How `overhead` runs A against a candidate configuration.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// One after the other on whatever CPU the host gives.
    Sequential,
    /// At the same time, A on one CPU and the candidate (with the manager's
    /// own threads) on the other, swapped every round.
    Parallel,
}

/// `corral bench interference`.
#[derive(clap::Args, Debug, Clone)]
pub struct InterferenceArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Rounds of the headline scenarios (alone, CPU hog 3:1, I/O hog 3:1 +
    /// limit, for each victim): a fixed number. Without it, each victim's
    /// rounds go on (at least 3) until its headline slowdowns' 95 %
    /// intervals are within --target, or until --budget is spent (1 round
    /// with --quick).
    #[arg(long)]
    runs: Option<u32>,
    /// Rounds (the first ones) that also run the comparison scenarios
    /// (manager off, equal classes) for the table.
    #[arg(long, default_value_t = 1)]
    compare_runs: u32,
    /// The slowdowns' 95 % interval half-width to reach, in percent.
    #[arg(long, default_value_t = 5.0)]
    target: f64,
    /// Time budget for the rounds (default 40m).
    #[arg(long, value_parser = stats::parse_duration)]
    budget: Option<std::time::Duration>,
    /// Seconds the victim's job takes alone (sized from a calibration run).
    #[arg(long, default_value_t = 10.0)]
    victim_secs: f64,
    /// How the probe's disk jobs (the io victim, the I/O hog) wait for
    /// completions; `poll` reproduces the figures before session 4.
    #[arg(long, value_enum, default_value_t = ProbeWait::Irq)]
    probe_wait: ProbeWait,
    /// An experiment: give every VM's vCPU and device threads a custom
    /// EEVDF slice of this many µs (Linux 6.12+ clamps it to 100..100000),
    /// to see how much of a slowdown is wake-up latency behind a CPU-bound
    /// thread's protected slice.
    #[arg(long)]
    slice_us: Option<u64>,
    /// The CPU backend of the manager that runs the shares scenarios
    /// (`gate` or `cgroup`), to compare them on the same host.
    #[arg(long, default_value = "gate", value_parser = parse_backend)]
    backend: corral_vmm::manager::CpuBackend,
    /// The gate's handover in ms (`corral serve --handover-ms`; 0 = off),
    /// to compare with and without it.
    #[arg(long, value_name = "MS", default_value_t = 5.0)]
    handover_ms: f64,
    /// The gate's minimum slice in ms (`corral serve --min-slice-ms`).
    #[arg(long, value_name = "MS", default_value_t = 20.0)]
    min_slice_ms: f64,
    /// Only these victims (`cpu`, `io`; default both).
    #[arg(long, value_delimiter = ',', value_parser = ["cpu", "io"])]
    victims: Vec<String>,
}

fn parse_backend(s: &str) -> Result<corral_vmm::manager::CpuBackend, String> {
    match s.parse()? {
        corral_vmm::manager::CpuBackend::None => {
            Err("the shares scenarios need a CPU backend (gate or cgroup)".into())
        }
        b => Ok(b),
    }
}

/// `corral bench throttle`.
#[derive(clap::Args, Debug, Clone)]
pub struct ThrottleArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Interleaved pairs (limit 100x above need / no limit) for the cost of
    /// limits never hit (default 6; 2 with --quick).
    #[arg(long)]
    pairs: Option<u32>,
}

/// Runs a benchmark.
pub fn bench(args: BenchArgs, builtin: Arc<[u8]>) -> Result<(), BenchError> {
    let (dir, text) = match args.kind {
        BenchKind::Overhead(a) => overhead::run(a, &builtin)?,
        BenchKind::Interference(a) => interference::run(a, &builtin)?,
        BenchKind::Throttle(a) => throttle::run(a, &builtin)?,
        BenchKind::Ab(a) => {
            println!("{}", ab::run(&a)?);
            return Ok(());
        }
    };
    println!("{text}");
    println!("report, plots and samples: {}", dir.display());
    Ok(())
}

/// Job sizes for this host: small on kvm_pvm hosts, where guest code is
/// emulated at ~1 µs per instruction.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    /// Work units of the CPU job.
    pub cpu_units: u64,
    /// Rounds per unit.
    pub unit_iters: u64,
    /// Bytes the I/O job reads.
    pub io_bytes: u64,
    /// Bytes per request of the I/O job.
    pub io_bs: u64,
    /// Size of the I/O job's disk file.
    pub disk_bytes: u64,
}

impl Sizes {
    pub fn new(quick: bool) -> Self {
        let pvm = host::host_is_pvm();
        let (cpu_units, unit_iters) = match (pvm, quick) {
            // ~135 ms per unit of 20000 rounds on a kvm_pvm host.
            (true, false) => (16, 20_000),
            (true, true) => (2, 10_000),
            // ~1 ms per unit of 450000 rounds natively.
            (false, false) => (2000, 450_000),
            (false, true) => (100, 450_000),
        };
        let (io_bytes, disk_bytes) = if quick {
            (4 << 20, 8 << 20)
        } else {
            (64 << 20, 64 << 20)
        };
        Self {
            cpu_units,
            unit_iters,
            io_bytes,
            io_bs: 4096,
            disk_bytes,
        }
    }
}

/// A progress bar on stderr (hidden when stderr is not a terminal).
pub(crate) fn progress(len: u64) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:32} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.enable_steady_tick(Duration::from_millis(200));
    pb
}

/// The lines about the host and the run that every report starts with.
pub(crate) fn host_lines(quick: bool) -> String {
    let pvm = host::host_is_pvm();
    let mut s = format!(
        "- host: {} CPUs available to corral, KVM {}\n- corral {} ({} build), {} UTC\n",
        host::host_cpus(),
        if pvm {
            "kvm_pvm (guest code runs in KVM's instruction emulator, ~1 µs per instruction)"
        } else {
            "with hardware virtualisation"
        },
        env!("CARGO_PKG_VERSION"),
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        report::utc_stamp(),
    );
    if quick {
        s.push_str("- **--quick**: tiny jobs and few runs; a smoke test, not a measurement\n");
    }
    s.push_str(
        "- absolute times on a shared machine are noise; the ratios measured within one run are the figure\n",
    );
    s
}
