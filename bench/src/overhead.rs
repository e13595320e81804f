//! `corral bench overhead`: the cost of the manager. The same guest job N
//! times under A (manager off: CPU backend none, no disk limits), B (the
//! gate CPU scheduler on, one class, no contention) and C (disk limits 100x
//! above what the job achieves, CPU backend none), interleaved A B C A B C.
//! The jobs: the probe's CPU and I/O jobs, and where the host can run Linux
//! a guest kernel compile ([`super::linux`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use corral_vmm::manager::{CpuBackend, Limits, Manager};

use super::linux::{self, Plan};
use super::plot::{self, Panel, Series};
use super::report::{Csv, OutDir, Report, SUMMARY_HEADER, Table, summary_cells};
use super::rounds::{self, Next, Progress};
use super::runner::{self, Job, JobResult, Scratch};
use super::stats::{RatioCi, Summary, diff_pct};
use super::{BenchError, JobKind, OverheadArgs, Sizes};

struct Config {
    key: &'static str,
    what: &'static str,
    mgr: Arc<Manager>,
    limited: bool,
}

/// A figure of a sample.
type Metric = fn(&Sample) -> Option<f64>;

struct Sample {
    job: &'static str,
    config: &'static str,
    run: u32,
    r: JobResult,
    sched_cpu_s: f64,
    /// Seconds the whole run took (`run_job`: create, job, teardown).
    secs: f64,
}

/// Runs it; returns the output directory and the report.
pub fn run(a: OverheadArgs, builtin: &Arc<[u8]>) -> Result<(PathBuf, String), BenchError> {
    let quick = a.common.quick;
    // Options first: nothing is created before they pass.
    let linux_plan = linux::plan(
        &a.linux,
        a.job.linux_selection(),
        &linux::Host::detect(),
        quick,
    )?;
    if !(a.target > 0.0 && a.target.is_finite()) {
        return Err(BenchError(format!(
            "--target {} must be a positive percentage",
            a.target
        )));
    }
    if !(a.job_secs > 0.0 && a.job_secs <= 600.0) {
        return Err(BenchError(format!(
            "--job-secs {} must be in (0, 600]",
            a.job_secs
        )));
    }
    // Fixed rounds (--runs, or 2 with --quick), else adaptive: at least
    // MIN_ROUNDS, then each job until its intervals are within --target
    // (a settled job stops: the rounds left go to the one that swings), or
    // until the budget is spent.
    const MIN_ROUNDS: u32 = 5;
    let fixed = a.runs.map(|r| r.max(1)).or(quick.then_some(2));
    let budget = a.budget.unwrap_or(Duration::from_secs(15 * 60));
    let out = OutDir::create(a.common.out.as_deref(), "overhead")?;
    let scratch = Scratch::new("overhead")?;
    let sz = Sizes::new(quick);
    // Room for an I/O job of --job-secs (4 KiB requests at ~22 µs on
    // kvm_pvm: ~0.2 GB/s) without re-reading.
    let disk_bytes = if quick {
        sz.disk_bytes
    } else {
        sz.disk_bytes.max(768 << 20)
    };
    let disk = scratch.filled("disk0.img", disk_bytes)?;
    let timeout = Duration::from_secs(if quick { 60 } else { 600 });

    let configs = [
        Config {
            key: "A",
            what: "manager off: CPU backend none, no disk limits",
            mgr: runner::new_manager(CpuBackend::None, builtin, &[])?,
            limited: false,
        },
        Config {
            key: "B",
            what: "scheduler on: gate CPU backend, one class, no contention",
            mgr: runner::new_manager(CpuBackend::Gate, builtin, &[])?,
            limited: false,
        },
        Config {
            key: "C",
            what: "disk limits 100x above need (bps and iops), CPU backend none",
            mgr: runner::new_manager(CpuBackend::None, builtin, &[])?,
            limited: true,
        },
    ];

    let mut cpu_job = Job::work(sz.cpu_units, sz.unit_iters, 1).with_disk(&disk, Limits::default());
    let mut io_job =
        Job::blk_read(&disk, Limits::default(), sz.io_bytes, sz.io_bs, 4).with_wait(a.probe_wait);
    // Size the probe jobs to --job-secs of guest time from one run each on
    // A; the io run also gives C's limits.
    let mut sizing = Vec::new();
    let mut io_cal = None;
    if !quick {
        let base = &configs[0].mgr;
        let cal = runner::run_job(base, "size-cpu", "default", &cpu_job, timeout)?;
        let per_unit = cal.guest_s.unwrap_or(cal.wall_s) / sz.cpu_units as f64;
        let units = ((a.job_secs / per_unit.max(1e-9)).ceil() as u64).clamp(1, 100_000_000);
        cpu_job = Job::work(units, sz.unit_iters, 1).with_disk(&disk, Limits::default());
        sizing.push(format!("cpu: {units} units of {} rounds", sz.unit_iters));
        let cal = runner::run_job(base, "size-io", "default", &io_job, timeout)?;
        let per_byte = cal.guest_s.unwrap_or(cal.wall_s) / sz.io_bytes as f64;
        let bytes = ((a.job_secs / per_byte.max(1e-15)) as u64 / sz.io_bs * sz.io_bs)
            .clamp(sz.io_bs, disk_bytes / sz.io_bs * sz.io_bs);
        io_job =
            Job::blk_read(&disk, Limits::default(), bytes, sz.io_bs, 4).with_wait(a.probe_wait);
        sizing.push(format!(
            "io: {} MiB in {} KiB reads",
            bytes >> 20,
            sz.io_bs >> 10
        ));
        io_cal = Some(cal);
    }
    let mut jobs: Vec<(&'static str, Job)> = match a.job {
        JobKind::Cpu => vec![("cpu", cpu_job)],
        JobKind::Io => vec![("io", io_job.clone())],
        JobKind::Both | JobKind::All => vec![("cpu", cpu_job), ("io", io_job.clone())],
        JobKind::Linux => Vec::new(),
    };
    if let Plan::Run(lj) = &linux_plan {
        jobs.push(("linux", Job::kbuild(lj)));
    }

    // Warm-up: one discarded run of each job on each configuration; the
    // sizing run of the I/O job on A (a run of it with --quick) calibrates
    // C's limits (for every job: the Linux job's reads need far less than
    // the probe's read rate).
    let per_round = (jobs.len() * configs.len()) as u64;
    let total = per_round * (u64::from(fixed.unwrap_or(MIN_ROUNDS)) + 1) + 1;
    let pb = super::progress(total);
    let cal = match io_cal {
        Some(c) => c,
        None => {
            pb.set_message("calibrating the I/O limits");
            runner::run_job(&configs[0].mgr, "cal", "default", &io_job, timeout)?
        }
    };
    pb.inc(1);
    let secs = cal.guest_s.unwrap_or(cal.wall_s).max(1e-6);
    let bps = cal.num("bytes").unwrap_or(0.0) / secs;
    let iops = cal.num("requests").unwrap_or(0.0) / secs;
    let limits = Limits {
        bps: Some(((bps * 100.0) as u64).max(1 << 20)),
        iops: Some(((iops * 100.0) as u64).max(100)),
        ..Default::default()
    };
    for (jname, job) in &jobs {
        for c in &configs {
            pb.set_message(format!("warm-up: job {jname}, config {}", c.key));
            let j = if c.limited {
                job.clone().with_limits(limits)
            } else {
                job.clone()
            };
            runner::run_job(
                &c.mgr,
                &format!("warm-{jname}-{}", c.key),
                "default",
                &j,
                timeout,
            )?;
            pb.inc(1);
        }
    }

    let mut samples = Vec::new();
    let started = Instant::now();
    let mut run = 0;
    let mut active: Vec<usize> = (0..jobs.len()).collect();
    let names: Vec<&str> = jobs.iter().map(|(j, _)| *j).collect();
    let stop = loop {
        run += 1;
        // A B C, then C B A: what a run leaves for the next one (caches,
        // frequency) falls on each side equally.
        let order: Vec<&Config> = if run % 2 == 1 {
            configs.iter().collect()
        } else {
            configs.iter().rev().collect()
        };
        if run > fixed.unwrap_or(MIN_ROUNDS) {
            pb.inc_length((active.len() * configs.len()) as u64);
        }
        for &ji in &active {
            let (jname, job) = &jobs[ji];
            for c in order.iter().copied() {
                pb.set_message(format!("round {run}: job {jname}, config {}", c.key));
                let j = if c.limited {
                    job.clone().with_limits(limits)
                } else {
                    job.clone()
                };
                let s0 = c.mgr.cpu_scheduler().self_usage().1;
                let t0 = Instant::now();
                let r = runner::run_job(
                    &c.mgr,
                    &format!("{jname}-{}-{run}", c.key.to_lowercase()),
                    "default",
                    &j,
                    timeout,
                )?;
                let s1 = c.mgr.cpu_scheduler().self_usage().1;
                samples.push(Sample {
                    job: jname,
                    config: c.key,
                    run,
                    r,
                    sched_cpu_s: s1.saturating_sub(s0) as f64 / 1e9,
                    secs: t0.elapsed().as_secs_f64(),
                });
                pb.inc(1);
            }
        }
        if let Some(n) = fixed {
            if run >= n {
                break format!("{n} rounds, as asked");
            }
            continue;
        }
        let progress: Vec<Progress> = names.iter().map(|j| progress_of(&samples, j)).collect();
        let elapsed = started.elapsed().as_secs_f64();
        match rounds::next(
            &progress,
            elapsed,
            budget.as_secs_f64(),
            MIN_ROUNDS,
            a.target,
        ) {
            Next::Run(v) => active = v,
            Next::Settled => {
                break format!(
                    "{}: every 95 % interval within ±{} % ({elapsed:.0} s)",
                    rounds::describe(&names, &progress),
                    a.target
                );
            }
            Next::BudgetSpent => {
                let widest = progress
                    .iter()
                    .flat_map(|p| &p.ratios)
                    .map(|r| r.map_or(f64::INFINITY, |r| r.half_width_pct()))
                    .fold(0.0, f64::max);
                break format!(
                    "{}: the budget of {:.0} s is spent; the widest 95 % interval is \
                     ±{widest:.2} % (wanted ±{} %; the Verdict table says how many more \
                     rounds each would take)",
                    rounds::describe(&names, &progress),
                    budget.as_secs_f64(),
                    a.target
                );
            }
        }
    };
    pb.finish_and_clear();
    for c in &configs {
        c.mgr.shutdown();
    }

    // Raw samples.
    let mut csv = Csv::new(&[
        "job",
        "config",
        "run",
        "total_s",
        "guest_s",
        "vm_cpu_s",
        "process_cpu_s",
        "sched_thread_cpu_s",
        "result",
        "disk_read_bytes",
    ]);
    for s in &samples {
        csv.push(vec![
            s.job.into(),
            s.config.into(),
            s.run.to_string(),
            format!("{:.6}", s.r.wall_s),
            s.r.guest_s.map(|g| format!("{g:.6}")).unwrap_or_default(),
            format!("{:.6}", s.r.vm_cpu_s),
            format!("{:.6}", s.r.proc_cpu_s),
            format!("{:.6}", s.sched_cpu_s),
            s.r.result.clone(),
            s.r.disk_read
                .map(|(b, _)| b.to_string())
                .unwrap_or_default(),
        ]);
    }
    out.write("samples.csv", csv.text().as_bytes())?;

    // Report.
    let mut rep = Report::new("corral bench overhead");
    rep.line(&super::host_lines(quick));
    rep.para(
        "Method: the same guest job once per configuration per round (after one discarded \
         warm-up run each), configurations interleaved A B C, then C B A; each configuration is its own \
         manager, created once. **total seconds** = host wall time from `create_vm` to the \
         guest's `PROBE-DONE` line (boot, job, report; `KBUILD-RESULT` for the Linux job); \
         **CPU seconds** = CPU time of the VM's \
         vCPU threads (the `sys` analogue: guest time runs on them); **process CPU seconds** = \
         CPU time of the whole corral process from before `create_vm` to after `delete_vm` \
         (vCPU threads plus the device thread, the gate scheduler's tick thread of B — which \
         ticks during every run, so it is in every configuration's figure — and the harness); \
         **guest seconds** = the job's time as the guest measured it (the probe's `us=`, \
         the Linux job's `ms=`).",
    );
    let mut t = Table::new(&["config", "what"]);
    for c in &configs {
        t.row(vec![c.key.into(), c.what.into()]);
    }
    rep.table(&t);
    rep.para(&format!(
        "C's limits, from a calibration run of the I/O job on A ({:.1} MiB/s, {:.0} IOPS): \
         bps={} ({:.0} MiB/s), iops={}.",
        bps / 1048576.0,
        iops,
        limits.bps.unwrap_or(0),
        limits.bps.unwrap_or(0) as f64 / 1048576.0,
        limits.iops.unwrap_or(0)
    ));
    match &linux_plan {
        Plan::Run(lj) => rep.para(&lj.describe()),
        Plan::Skip(why) => rep.para(&format!("**{why}**")),
    }
    if !sizing.is_empty() {
        rep.para(&format!(
            "Jobs sized to {} guest seconds each: {}.",
            a.job_secs,
            sizing.join("; ")
        ));
    }

    rep.h2("Verdict");
    rep.para(&format!(
        "Stopped after {stop}. Each ratio is over pairs of runs of one round (B or C against \
         A, back to back), on the guest-measured job time where the guest reports one (the \
         probe's jobs) and the host wall time otherwise; 95 % t-interval of the log ratios."
    ));
    let mut t = Table::new(&[
        "job",
        "config",
        "pairs",
        "vs A",
        "95 % interval",
        "verdict",
        "rounds still needed",
    ]);
    for (jname, _) in &jobs {
        let round_secs = progress_of(&samples, jname).round_secs;
        for k in ["B", "C"] {
            let Some(r) = ratio(&samples, jname, k) else {
                t.row(vec![
                    jname.to_string(),
                    k.into(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                    "too few runs".into(),
                    "-".into(),
                ]);
                continue;
            };
            t.row(vec![
                jname.to_string(),
                k.into(),
                r.n.to_string(),
                format!("{:+.2}%", r.mean_pct),
                format!("{:+.2} … {:+.2}%", r.lo_pct, r.hi_pct),
                r.verdict(&format!("{k} {}", short(k)), a.target),
                rounds::more_rounds(&r, a.target, round_secs).map_or_else(
                    || "-".into(),
                    |(more, min)| {
                        format!(
                            "~{more} more for ±{} % at this spread (~{min:.0} min)",
                            a.target
                        )
                    },
                ),
            ]);
        }
    }
    rep.table(&t);

    let metrics: [(&str, Metric); 4] = [
        (
            "total seconds (host wall, create → PROBE-DONE / KBUILD-RESULT)",
            |s| Some(s.r.wall_s),
        ),
        ("CPU seconds (the VM's vCPU threads)", |s| {
            Some(s.r.vm_cpu_s)
        }),
        ("process CPU seconds (all of corral's threads)", |s| {
            Some(s.r.proc_cpu_s)
        }),
        ("guest seconds (guest-measured job time)", |s| s.r.guest_s),
    ];
    let summary = |job: &str, config: &str, f: Metric| {
        let xs: Vec<f64> = samples
            .iter()
            .filter(|s| s.job == job && s.config == config)
            .filter_map(f)
            .collect();
        Summary::of(&xs)
    };

    rep.h2("Summary");
    let mut t = Table::new(&[
        "job",
        "config",
        "total s (avg)",
        "vs A",
        "CPU s (avg)",
        "vs A",
        "process CPU s (avg)",
        "vs A",
    ]);
    for (jname, _) in &jobs {
        let base: Vec<Option<Summary>> = metrics[..3]
            .iter()
            .map(|(_, f)| summary(jname, "A", *f))
            .collect();
        for c in &configs {
            let mut row = vec![jname.to_string(), c.key.to_string()];
            for (i, (_, f)) in metrics[..3].iter().enumerate() {
                match (summary(jname, c.key, *f), &base[i]) {
                    (Some(s), Some(b)) => {
                        row.push(format!("{:.3}", s.avg));
                        row.push(if c.key == "A" {
                            "base".into()
                        } else {
                            format!("{:+.2}%", diff_pct(s.avg, b.avg))
                        });
                    }
                    _ => row.extend(["-".to_string(), "-".to_string()]),
                }
            }
            t.row(row);
        }
    }
    rep.table(&t);

    for (jname, job) in &jobs {
        rep.h2(&format!("Job `{jname}`: `{}`", job.cmdline));
        for (mname, f) in &metrics {
            rep.line(&format!("### {mname}"));
            rep.blank();
            let mut header = vec!["config"];
            header.extend(SUMMARY_HEADER);
            let mut t = Table::new(&header);
            let base = summary(jname, "A", *f);
            for c in &configs {
                if let Some(s) = summary(jname, c.key, *f) {
                    let mut row = vec![c.key.to_string()];
                    row.extend(summary_cells(
                        &s,
                        if c.key == "A" { None } else { base.as_ref() },
                    ));
                    t.row(row);
                }
            }
            rep.table(&t);
        }
        let sched: Vec<f64> = samples
            .iter()
            .filter(|s| s.job == *jname && s.config == "B")
            .map(|s| s.sched_cpu_s)
            .collect();
        if let Some(s) = Summary::of(&sched) {
            rep.para(&format!(
                "The gate scheduler's tick thread used {:.4} s of CPU per run of B on average \
                 (min {:.4}, max {:.4}).",
                s.avg, s.min, s.max
            ));
        }
        if *jname == "linux" {
            let (mut bytes, mut rate) = (Vec::new(), Vec::new());
            for s in samples.iter().filter(|s| s.job == *jname) {
                if let Some((b, _)) = s.r.disk_read {
                    bytes.push(b as f64 / 1048576.0);
                    rate.push(b as f64 / 1048576.0 / s.r.wall_s.max(1e-9));
                }
            }
            if let (Some(b), Some(r)) = (Summary::of(&bytes), Summary::of(&rate)) {
                rep.para(&format!(
                    "The Linux guest read {:.0} MiB from its root disk per run on average \
                     ({:.1} MiB/s over the run, at most {:.1}); C's limit is {:.0} MiB/s.",
                    b.avg,
                    r.avg,
                    r.max,
                    limits.bps.unwrap_or(0) as f64 / 1048576.0
                ));
            }
        }
    }

    // Plot: total seconds per run, one panel per job.
    let panels: Vec<Panel> = jobs
        .iter()
        .map(|(jname, _)| Panel {
            x_integer: true,
            x_from_zero: false,
            ..Panel::new(
                format!("job {jname}: total seconds per run"),
                "run",
                "seconds (create → done)",
                configs
                    .iter()
                    .map(|c| {
                        Series::marked(
                            format!("{} {}", c.key, short(c.key)),
                            samples
                                .iter()
                                .filter(|s| s.job == *jname && s.config == c.key)
                                .map(|s| (f64::from(s.run), s.r.wall_s))
                                .collect(),
                        )
                    })
                    .collect(),
            )
        })
        .collect();
    plot::draw(
        &out.join("overhead.png"),
        "corral bench overhead",
        &panels,
        panels.len(),
    )?;
    rep.h2("Plot");
    rep.para("![total seconds per run](overhead.png)");
    rep.para("Raw samples: `samples.csv`.");
    out.write("report.md", rep.text().as_bytes())?;
    Ok((out.path.clone(), rep.text().to_string()))
}

fn short(key: &str) -> &'static str {
    match key {
        "A" => "(manager off)",
        "B" => "(scheduler on)",
        _ => "(I/O limits 100x)",
    }
}

/// The ratio of config `key` to A for `job` over the rounds that ran both:
/// guest seconds where every sample has them, else host wall seconds.
fn ratio(samples: &[Sample], job: &str, key: &str) -> Option<RatioCi> {
    let of = |cfg: &str| -> Vec<&Sample> {
        samples
            .iter()
            .filter(|s| s.job == job && s.config == cfg)
            .collect()
    };
    let (base, cand) = (of("A"), of(key));
    let guest = base.iter().chain(&cand).all(|s| s.r.guest_s.is_some());
    let metric = |s: &Sample| {
        if guest {
            s.r.guest_s.unwrap_or(s.r.wall_s)
        } else {
            s.r.wall_s
        }
    };
    let pairs: Vec<(f64, f64)> = base
        .iter()
        .filter_map(|b| {
            cand.iter()
                .find(|c| c.run == b.run)
                .map(|c| (metric(b), metric(c)))
        })
        .collect();
    RatioCi::of(&pairs)
}

/// What the rounds so far gave for `job`: its rounds, the seconds a round
/// of it takes (A, B and C), and its B/A and C/A intervals.
fn progress_of(samples: &[Sample], job: &str) -> Progress {
    let of = |cfg: &str| -> Vec<f64> {
        samples
            .iter()
            .filter(|s| s.job == job && s.config == cfg)
            .map(|s| s.secs)
            .collect()
    };
    let mean = |xs: Vec<f64>| {
        if xs.is_empty() {
            0.0
        } else {
            xs.iter().sum::<f64>() / xs.len() as f64
        }
    };
    Progress {
        rounds: of("A").len() as u32,
        round_secs: ["A", "B", "C"].map(|k| mean(of(k))).iter().sum(),
        ratios: ["B", "C"].map(|k| ratio(samples, job, k)).to_vec(),
    }
}
