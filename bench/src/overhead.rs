//! `corral bench overhead`: the cost of the manager. The same guest job N
//! times under A (manager off: CPU backend none, no disk limits), B (the
//! gate CPU scheduler on, one class, no contention) and C (disk limits 100x
//! above what the job achieves, CPU backend none), interleaved A B C A B C.
//! The jobs: the probe's CPU and I/O jobs, and where the host can run Linux
//! a guest kernel compile ([`super::linux`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use corral_vmm::manager::{CpuBackend, Limits, Manager};

use super::linux::{self, Plan};
use super::plot::{self, Panel, Series};
use super::report::{Csv, OutDir, Report, SUMMARY_HEADER, Table, summary_cells};
use super::rounds::{self, Next, Progress};
use super::runner::{self, Job, JobResult, Scratch};
use super::stats::{RatioCi, Summary, diff_pct};
use super::{BenchError, JobKind, Layout, OverheadArgs, Sizes};

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
    /// `--layout parallel`: the configuration an A run ran beside (`None`
    /// for the candidate's own runs and in the sequential layout).
    against: Option<&'static str>,
    /// `--layout parallel`: the CPU the run was pinned to.
    cpu: Option<usize>,
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
    let parallel = a.layout == Layout::Parallel;
    // The parallel layout's self-check: a second manager like A, run
    // beside A exactly as B and C are.
    let a2 = if parallel {
        Some(Config {
            key: "A2",
            what: "self-check: a second manager like A (CPU backend none, no disk limits), \
                   run beside A as B and C are",
            mgr: runner::new_manager(CpuBackend::None, builtin, &[])?,
            limited: false,
        })
    } else {
        None
    };
    // The two CPUs of the parallel layout, and the mask to restore after.
    let mask = runner::allowed_cpus()?;
    let cpus = if parallel {
        if mask.len() < 2 {
            return Err(BenchError(format!(
                "--layout parallel needs two CPUs; this process may use {mask:?}"
            )));
        }
        Some((mask[0], mask[1]))
    } else {
        None
    };

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
    let per_round = (jobs.len() * (configs.len() + usize::from(parallel))) as u64;
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
        for c in configs.iter().chain(&a2) {
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
    let off_cpu = AtomicUsize::new(0);
    let started = Instant::now();
    let mut run = 0;
    let mut active: Vec<usize> = (0..jobs.len()).collect();
    let names: Vec<&str> = jobs.iter().map(|(j, _)| *j).collect();
    let stop = loop {
        run += 1;
        if let Some((c0, c1)) = cpus {
            if run > fixed.unwrap_or(MIN_ROUNDS) {
                pb.inc_length((active.len() * 3) as u64);
            }
            // A on the first CPU in odd rounds, on the second in even ones;
            // the candidates in the order A2 B C, then C B A2.
            let (ca, cx) = if run % 2 == 1 { (c0, c1) } else { (c1, c0) };
            let mut partners: Vec<&Config> = a2.iter().chain(&configs[1..]).collect();
            if run % 2 == 0 {
                partners.reverse();
            }
            for &ji in &active {
                let (jname, job) = &jobs[ji];
                for x in partners.iter().copied() {
                    pb.set_message(format!("round {run}: job {jname}, A beside {}", x.key));
                    let (ra, rx) = run_beside(
                        &configs[0],
                        x,
                        jname,
                        job,
                        limits,
                        run,
                        (ca, cx),
                        timeout,
                        &off_cpu,
                    )?;
                    samples.push(ra);
                    samples.push(rx);
                    pb.inc(1);
                }
            }
        } else {
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
                        against: None,
                        cpu: None,
                        r,
                        sched_cpu_s: s1.saturating_sub(s0) as f64 / 1e9,
                        secs: t0.elapsed().as_secs_f64(),
                    });
                    pb.inc(1);
                }
            }
        }
        if let Some(n) = fixed {
            if run >= n {
                break format!("{n} rounds, as asked");
            }
            continue;
        }
        let progress: Vec<Progress> = names
            .iter()
            .map(|j| progress_of(&samples, j, parallel))
            .collect();
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
    for c in configs.iter().chain(&a2) {
        c.mgr.shutdown();
    }
    if parallel {
        runner::pin_process(&mask)?;
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
        "beside",
        "cpu",
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
            s.against.unwrap_or_default().into(),
            s.cpu.map(|c| c.to_string()).unwrap_or_default(),
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
    if let Some((c0, c1)) = cpus {
        rep.para(&format!(
            "Layout **parallel**: A runs at the same time as each candidate (A2, B, C in \
             turn), A pinned to one CPU and the candidate to the other (CPUs {c0} and {c1}; \
             A on CPU {c0} in odd rounds, on CPU {c1} in even ones), so both see the same \
             host slowdowns. Every other thread of the process — the gate scheduler's \
             thread of B, the harness's main thread — is pinned to the candidate's CPU: \
             the manager's cost falls on its side, never on A's. Each side's harness thread \
             pins itself before `create_vm`; the VM's vCPU and device threads inherit its \
             CPU ({} vCPU threads were found elsewhere and re-pinned). The disk is \
             attached read-only on both sides (the two VMs share its file). The io job's vCPU \
             and device thread share one CPU here (sequentially they spread over two): \
             that is another job than the sequential layout's. A2 is a second manager \
             like A: A2/A is the self-check, its interval must contain 1. A pair is two \
             consecutive rounds (A once on each CPU), of the geometric means of each \
             side's times, so a difference between the CPUs cancels. Caveat: on a loaded \
             host the two sides, threads of one process, share one scheduling group \
             (autogroup), whose share of each CPU shifts toward the busier side: what \
             the manager costs there is partly paid back, biasing B/A toward 1. The \
             process CPU seconds of a run cover both sides of its pair.",
            off_cpu.load(Ordering::Relaxed)
        ));
    }
    let mut t = Table::new(&["config", "what"]);
    for c in configs.iter().chain(&a2) {
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
        "Stopped after {stop}. {} on the guest-measured job time where the guest reports \
         one (the probe's jobs) and the host wall time otherwise; 95 % t-interval of the \
         log ratios.",
        if parallel {
            "Each ratio is over pairs of two consecutive rounds (A against the candidate it \
             ran beside, once with A on each CPU),"
        } else {
            "Each ratio is over pairs of runs of one round (B or C against A, back to back),"
        }
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
        let round_secs = progress_of(&samples, jname, parallel).round_secs;
        for &k in candidates(parallel) {
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
                if k == "A2" {
                    self_check(&r)
                } else {
                    r.verdict(&format!("{k} {}", short(k)), a.target)
                },
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

    rep.para(
        "Spread of single rounds (before any joining of rounds): the standard deviation of \
         the per-round log ratio, and the correlation of A's and the candidate's log times \
         (1: they slow down together; what the pairs cancel).",
    );
    let mut t = Table::new(&["job", "config", "rounds", "log-ratio sd", "correlation"]);
    for (jname, _) in &jobs {
        for &k in candidates(parallel) {
            if let Some((n, sd, corr)) = spread_of(&samples, jname, k) {
                t.row(vec![
                    jname.to_string(),
                    k.into(),
                    n.to_string(),
                    format!("{sd:.2} %"),
                    format!("{corr:.3}"),
                ]);
            }
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
        for c in configs.iter().chain(&a2) {
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
            for c in configs.iter().chain(&a2) {
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
                    .chain(&a2)
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

/// One pair of the parallel layout: A on CPU `ca` and candidate `x` on CPU
/// `cx`, started at the same time. Every thread of the process (the gate
/// scheduler's thread of B, the harness's main thread) is pinned to `cx`
/// first, so what the manager costs falls on the candidate's side, never on
/// A's; each side's harness thread pins itself before it creates its VM,
/// whose threads (vCPU, device) inherit that CPU. vCPU threads found on
/// another CPU are re-pinned and counted in `off`.
#[allow(clippy::too_many_arguments)]
fn run_beside(
    a: &Config,
    x: &Config,
    jname: &'static str,
    job: &Job,
    limits: Limits,
    run: u32,
    (ca, cx): (usize, usize),
    timeout: Duration,
    off: &AtomicUsize,
) -> Result<(Sample, Sample), BenchError> {
    runner::pin_process(&[cx])?;
    let job_of = |c: &Config| {
        if c.limited {
            job.clone().with_limits(limits)
        } else {
            job.clone()
        }
    };
    // Both sides create their VMs at once; who goes first alternates with
    // the round, as A's CPU does, so what one VM's start and teardown cost
    // the other (the two share one process and its address space) falls
    // on each side equally within a joined pair of rounds.
    let together = std::sync::Barrier::new(2);
    let side = |c: &Config, cpu: usize, name: String| -> Result<Sample, BenchError> {
        let pinned = runner::pin_thread(0, &[cpu]);
        together.wait();
        pinned.map_err(|e| BenchError(format!("pinning to CPU {cpu}: {e}")))?;
        // Read-only on both sides: the two VMs of a pair share the disk
        // file, which one writer would hold exclusively.
        let mut j = job_of(c);
        j.disk_read_only = true;
        let s0 = c.mgr.cpu_scheduler().self_usage().1;
        let t0 = Instant::now();
        let r = runner::run_job_with(&c.mgr, &name, "default", &j, timeout, |tids| {
            for &t in tids {
                if runner::pinned_cpu(t) != Some(cpu) {
                    off.fetch_add(1, Ordering::Relaxed);
                    let _ = runner::pin_thread(t, &[cpu]);
                }
            }
        })?;
        let s1 = c.mgr.cpu_scheduler().self_usage().1;
        Ok(Sample {
            job: jname,
            config: c.key,
            run,
            against: (c.key == "A").then_some(x.key),
            cpu: Some(cpu),
            r,
            sched_cpu_s: s1.saturating_sub(s0) as f64 / 1e9,
            secs: t0.elapsed().as_secs_f64(),
        })
    };
    let xkey = x.key.to_lowercase();
    let (ra, rx) = std::thread::scope(|s| {
        let sa = || side(a, ca, format!("{jname}-a-{xkey}-{run}"));
        let sx = || side(x, cx, format!("{jname}-{xkey}-{run}"));
        if run % 2 == 1 {
            let ha = s.spawn(sa);
            let hx = s.spawn(sx);
            (ha.join(), hx.join())
        } else {
            let hx = s.spawn(sx);
            let ha = s.spawn(sa);
            (ha.join(), hx.join())
        }
    });
    let panicked = |_| BenchError("a harness thread panicked".into());
    Ok((ra.map_err(panicked)??, rx.map_err(panicked)??))
}

fn short(key: &str) -> &'static str {
    match key {
        "A" => "(manager off)",
        "A2" => "(A again: self-check)",
        "B" => "(scheduler on)",
        _ => "(I/O limits 100x)",
    }
}

/// The (A, candidate) pairs of config `key` for `job`, by round: guest
/// seconds where every sample has them, else host wall seconds. In the
/// parallel layout an A run pairs with the candidate it ran beside.
fn pairs_of<'a>(samples: &'a [Sample], job: &str, key: &str) -> Vec<(&'a Sample, &'a Sample)> {
    let base = samples
        .iter()
        .filter(|s| s.job == job && s.config == "A" && s.against.is_none_or(|k| k == key));
    base.filter_map(|b| {
        samples
            .iter()
            .find(|c| c.job == job && c.config == key && c.run == b.run)
            .map(|c| (b, c))
    })
    .collect()
}

/// The figure the ratios are over: guest seconds where every sample of the
/// pairs has them, else host wall seconds.
fn metric_of(pairs: &[(&Sample, &Sample)]) -> impl Fn(&Sample) -> f64 + use<> {
    let guest = pairs
        .iter()
        .all(|(b, c)| b.r.guest_s.is_some() && c.r.guest_s.is_some());
    move |s: &Sample| {
        if guest {
            s.r.guest_s.unwrap_or(s.r.wall_s)
        } else {
            s.r.wall_s
        }
    }
}

/// The ratio of config `key` to A for `job` over the rounds that ran both.
/// In the parallel layout two consecutive rounds (A on one CPU, then on the
/// other) make one pair, of the geometric means of their A and candidate
/// times: a difference between the CPUs cancels inside the pair instead of
/// widening the interval.
fn ratio(samples: &[Sample], job: &str, key: &str) -> Option<RatioCi> {
    let pairs = pairs_of(samples, job, key);
    let m = metric_of(&pairs);
    let values: Vec<(f64, f64)> = if pairs.iter().any(|(b, _)| b.cpu.is_some()) {
        swapped_pairs(
            &pairs
                .iter()
                .map(|(b, c)| (b.run, b.cpu, m(b), m(c)))
                .collect::<Vec<_>>(),
        )
    } else {
        pairs.iter().map(|(b, c)| (m(b), m(c))).collect()
    };
    RatioCi::of(&values)
}

/// Pairs of the parallel layout, `(round, A's CPU, A, candidate)`, joined
/// two by two (rounds 1+2, 3+4, …, A's CPU differing) into the geometric
/// means of each side; a last round without its swapped partner is left out.
fn swapped_pairs(p: &[(u32, Option<usize>, f64, f64)]) -> Vec<(f64, f64)> {
    let mut p = p.to_vec();
    p.sort_by_key(|x| x.0);
    p.chunks_exact(2)
        .filter(|w| w[0].1 != w[1].1)
        .map(|w| ((w[0].2 * w[1].2).sqrt(), (w[0].3 * w[1].3).sqrt()))
        .collect()
}

/// The spread of the pairs of `key` for `job`: the standard deviation of
/// the per-pair log ratio (percent) and the correlation of A's and the
/// candidate's log times, over single rounds.
fn spread_of(samples: &[Sample], job: &str, key: &str) -> Option<(usize, f64, f64)> {
    let pairs = pairs_of(samples, job, key);
    let m = metric_of(&pairs);
    let logs: Vec<(f64, f64)> = pairs
        .iter()
        .map(|(b, c)| (m(b), m(c)))
        .filter(|(b, c)| *b > 0.0 && *c > 0.0)
        .map(|(b, c)| (b.ln(), c.ln()))
        .collect();
    let n = logs.len();
    if n < 3 {
        return None;
    }
    let mean = |f: &dyn Fn(&(f64, f64)) -> f64| logs.iter().map(f).sum::<f64>() / n as f64;
    let (ma, mc) = (mean(&|p| p.0), mean(&|p| p.1));
    let md = mc - ma;
    let var = |f: &dyn Fn(&(f64, f64)) -> f64| logs.iter().map(f).sum::<f64>() / (n - 1) as f64;
    let sd_d = var(&|p| (p.1 - p.0 - md).powi(2)).sqrt();
    let cov = var(&|p| (p.0 - ma) * (p.1 - mc));
    let (va, vc) = (var(&|p| (p.0 - ma).powi(2)), var(&|p| (p.1 - mc).powi(2)));
    let corr = if va > 0.0 && vc > 0.0 {
        cov / (va * vc).sqrt()
    } else {
        f64::NAN
    };
    Some((n, sd_d * 100.0, corr))
}

/// The candidates of a layout: B and C, and A2 in the parallel one.
fn candidates(parallel: bool) -> &'static [&'static str] {
    if parallel {
        &["B", "C", "A2"]
    } else {
        &["B", "C"]
    }
}

/// What the rounds so far gave for `job`: its rounds, the seconds a round
/// of it takes (A, B and C, or its three pairs), and its intervals.
fn progress_of(samples: &[Sample], job: &str, parallel: bool) -> Progress {
    let mean = |xs: Vec<f64>| {
        if xs.is_empty() {
            0.0
        } else {
            xs.iter().sum::<f64>() / xs.len() as f64
        }
    };
    let secs = |cfg: &str, against: Option<&str>| -> Vec<f64> {
        samples
            .iter()
            .filter(|s| s.job == job && s.config == cfg && s.against == against)
            .map(|s| s.secs)
            .collect()
    };
    let (rounds, round_secs) = if parallel {
        let keys = candidates(true);
        (
            secs("A", Some("B")).len() as u32,
            keys.iter().map(|k| mean(secs("A", Some(k)))).sum(),
        )
    } else {
        (
            secs("A", None).len() as u32,
            ["A", "B", "C"].map(|k| mean(secs(k, None))).iter().sum(),
        )
    };
    Progress {
        rounds,
        round_secs,
        ratios: candidates(parallel)
            .iter()
            .map(|k| ratio(samples, job, k))
            .collect(),
    }
}

/// The self-check's verdict on A2/A: its interval must contain 1.
fn self_check(r: &RatioCi) -> String {
    let half = r.half_width_pct();
    if r.lo_pct <= 0.0 && r.hi_pct >= 0.0 {
        format!(
            "self-check passes: A2/A {:+.2} % ± {half:.2} %, the interval contains 1",
            r.mean_pct
        )
    } else {
        format!(
            "self-check FAILS: A2/A {:+.2} % ± {half:.2} % (two identical configurations \
             differ: the layout is biased here, B's and C's figures are not to be trusted)",
            r.mean_pct
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swapped_rounds_cancel_a_cpu_difference() {
        // The second CPU is 10 % slower; the candidate costs 1 % wherever
        // it runs. Single rounds swing ±10 %, swapped pairs do not.
        let p: Vec<(u32, Option<usize>, f64, f64)> = (1..=6)
            .map(|run| {
                let a_on_1 = run % 2 == 0;
                let (fa, fx) = if a_on_1 { (1.1, 1.0) } else { (1.0, 1.1) };
                (run, Some(usize::from(a_on_1)), 2.0 * fa, 2.0 * 1.01 * fx)
            })
            .collect();
        let v = swapped_pairs(&p);
        assert_eq!(v.len(), 3);
        let r = RatioCi::of(&v).unwrap();
        assert!((r.mean_pct - 1.0).abs() < 1e-9, "{r:?}");
        assert!(r.half_width_pct() < 1e-9, "{r:?}");
        // Single rounds: the CPU difference is noise of ±10 %.
        let single: Vec<(f64, f64)> = p.iter().map(|x| (x.2, x.3)).collect();
        assert!(RatioCi::of(&single).unwrap().half_width_pct() > 5.0);
        // An odd last round is left out; out-of-order input is sorted.
        let mut q = p[..5].to_vec();
        q.reverse();
        assert_eq!(swapped_pairs(&q).len(), 2);
        // Two rounds on the same CPU are not a swapped pair.
        let same = [(1, Some(0), 1.0, 1.0), (2, Some(0), 1.0, 1.0)];
        assert!(swapped_pairs(&same).is_empty());
    }

    #[test]
    fn self_check_verdicts() {
        let ci = |lo: f64, hi: f64| RatioCi {
            n: 10,
            mean_pct: (lo + hi) / 2.0,
            lo_pct: lo,
            hi_pct: hi,
        };
        assert!(self_check(&ci(-0.2, 0.3)).starts_with("self-check passes"));
        assert!(self_check(&ci(0.1, 0.5)).starts_with("self-check FAILS"));
        assert!(self_check(&ci(-0.9, -0.1)).starts_with("self-check FAILS"));
    }
}
