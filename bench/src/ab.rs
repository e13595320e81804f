//! `corral-bench ab OLD NEW -- ARGS...`: one command run on two builds,
//! interleaved (old new, new old, ...), and the ratio new/old with its 95 %
//! interval, so that a performance change is quoted as measured side by side
//! in one run on the same noisy machine.
//!
//! What is measured per run: the host wall time from spawn to exit, or to
//! the first output line that starts with `--until` (then the process is
//! killed: `--until PROBE-UP` is the boot benchmark); or, with `--field
//! KEY`, the number after `KEY=` on the first line containing `--marker`
//! (default `PROBE-RESULT`), e.g. the guest-measured `us=` of a disk job.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::BenchError;
use super::stats::{RatioCi, Summary, parse_duration};

/// `corral-bench ab`.
#[derive(clap::Args, Debug, Clone)]
pub struct AbArgs {
    /// The old build's binary (e.g. a copy of today's `corral`).
    pub old: PathBuf,
    /// The new build's binary.
    pub new: PathBuf,
    /// Pairs of runs: a fixed number. Without it, pairs go on until the
    /// interval is within --target or --budget is spent (at least 5).
    #[arg(long)]
    pub pairs: Option<u32>,
    /// The 95 % interval half-width to reach, in percent.
    #[arg(long, default_value_t = 0.5)]
    pub target: f64,
    /// Time budget (e.g. 90s, 5m).
    #[arg(long, value_parser = parse_duration, default_value = "5m")]
    pub budget: Duration,
    /// Stop the clock (and the process) at the first stdout line starting
    /// with this, e.g. PROBE-UP.
    #[arg(long)]
    pub until: Option<String>,
    /// Measure the number after FIELD= on the --marker line instead of time.
    #[arg(long)]
    pub field: Option<String>,
    /// The line that carries --field.
    #[arg(long, default_value = "PROBE-RESULT")]
    pub marker: String,
    /// Longest a single run may take.
    #[arg(long, value_parser = parse_duration, default_value = "120s")]
    pub timeout: Duration,
    /// The arguments for both binaries (after `--`).
    #[arg(last = true, required = true)]
    pub args: Vec<OsString>,
}

/// One run: the figure, or why there is none.
fn run_once(bin: &PathBuf, a: &AbArgs) -> Result<f64, BenchError> {
    let t0 = Instant::now();
    let mut child = Command::new(bin)
        .args(&a.args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| BenchError(format!("cannot run {}: {e}", bin.display())))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| BenchError("no stdout".into()))?;
    let mut figure = None;
    let mut lines = BufReader::new(stdout).lines();
    // Bounded: a run that prints without end is stopped by the line count.
    for _ in 0..1_000_000 {
        let Some(Ok(line)) = lines.next() else { break };
        if t0.elapsed() > a.timeout {
            break;
        }
        if let Some(u) = &a.until {
            if line.starts_with(u.as_str()) {
                figure = Some(t0.elapsed().as_secs_f64());
                let _ = child.kill();
                break;
            }
        } else if let Some(f) = &a.field
            && line.contains(a.marker.as_str())
            && figure.is_none()
        {
            figure = super::runner::field(&line, f).and_then(|v| v.parse::<f64>().ok());
        }
    }
    let status = child.wait().map_err(|e| BenchError(format!("wait: {e}")))?;
    if a.until.is_none() && a.field.is_none() {
        if !status.success() {
            return Err(BenchError(format!(
                "{} exited with {status}",
                bin.display()
            )));
        }
        figure = Some(t0.elapsed().as_secs_f64());
    }
    figure.ok_or_else(|| {
        BenchError(format!(
            "{}: no figure in the output (--until/--field/--marker; exit {status})",
            bin.display()
        ))
    })
}

/// Runs it; returns the report.
pub fn run(a: &AbArgs) -> Result<String, BenchError> {
    if !(a.target > 0.0 && a.target.is_finite()) {
        return Err(BenchError(format!(
            "--target {} must be positive",
            a.target
        )));
    }
    for b in [&a.old, &a.new] {
        if !b.is_file() {
            return Err(BenchError(format!("{} is not a file", b.display())));
        }
    }
    // One discarded run each: page cache, CPU frequency.
    run_once(&a.old, a)?;
    run_once(&a.new, a)?;
    let started = Instant::now();
    let mut pairs = Vec::new();
    let stop = loop {
        let i = pairs.len();
        let (old, new) = if i % 2 == 0 {
            let o = run_once(&a.old, a)?;
            (o, run_once(&a.new, a)?)
        } else {
            let n = run_once(&a.new, a)?;
            (run_once(&a.old, a)?, n)
        };
        pairs.push((old, new));
        let n = pairs.len() as u32;
        if let Some(p) = a.pairs {
            if n >= p {
                break format!("{n} pairs, as asked");
            }
            continue;
        }
        if n < 5 {
            continue;
        }
        let half = RatioCi::of(&pairs).map_or(f64::INFINITY, |r| r.half_width_pct());
        if half <= a.target {
            break format!("{n} pairs: the 95 % interval is within ±{} %", a.target);
        }
        if started.elapsed() + started.elapsed() / n > a.budget {
            break format!(
                "{n} pairs: the budget of {:.0} s is spent (interval ±{half:.2} %)",
                a.budget.as_secs_f64()
            );
        }
    };
    let olds: Vec<f64> = pairs.iter().map(|p| p.0).collect();
    let news: Vec<f64> = pairs.iter().map(|p| p.1).collect();
    let what = match (&a.until, &a.field) {
        (Some(u), _) => format!("seconds from spawn to the first line starting with {u:?}"),
        (None, Some(f)) => format!("{f}= on the {:?} line", a.marker),
        (None, None) => "seconds from spawn to exit".to_string(),
    };
    let mut out = format!(
        "# corral-bench ab\n\n- old: {}\n- new: {}\n- args: {}\n- figure: {what}\n- {stop}; order alternating (old new, new old, ...)\n\n",
        a.old.display(),
        a.new.display(),
        a.args
            .iter()
            .map(|s| s.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" "),
    );
    out.push_str(
        "| build | n | min | avg | max | sdev | spread |\n|---|---|---|---|---|---|---|\n",
    );
    for (name, xs) in [("old", &olds), ("new", &news)] {
        if let Some(s) = Summary::of(xs) {
            out.push_str(&format!(
                "| {name} | {} | {:.6} | {:.6} | {:.6} | {:.6} | {:.1} % |\n",
                s.n,
                s.min,
                s.avg,
                s.max,
                s.sdev,
                s.spread() * 100.0
            ));
        }
    }
    match RatioCi::of(&pairs) {
        Some(r) => out.push_str(&format!(
            "\nnew / old: {:+.2} % (95 % interval {:+.2} … {:+.2} %, {} pairs): {}\n",
            r.mean_pct,
            r.lo_pct,
            r.hi_pct,
            r.n,
            r.verdict("new", a.target)
        )),
        None => out.push_str("\ntoo few pairs for a ratio\n"),
    }
    Ok(out)
}
