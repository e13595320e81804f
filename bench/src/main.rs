//! `corral-bench`: the benchmarks of the kernel lists' method (the same job
//! repeated, configurations interleaved, ratios measured in one run), kept
//! out of the shipped `corral` binary so that its size, start-up time and RSS
//! carry no plotting or progress-bar code. `corral bench ...` execs this.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "corral-bench",
    version,
    about = "corral's benchmarks: overhead, interference, throttle (report, plots, CSV)"
)]
struct Cli {
    #[command(flatten)]
    args: corral_bench::BenchArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match corral_bench::bench(cli.args, Arc::from(corral_probe::PROBE_ELF)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("corral-bench: {e}");
            ExitCode::from(1)
        }
    }
}
