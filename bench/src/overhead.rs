//! `corral bench overhead`: the cost of the manager. The same guest job N
//! times under A (manager off: CPU backend none, no disk limits), B (the
//! gate CPU scheduler on, one class, no contention) and C (disk limits 100x
//! above what the job achieves, CPU backend none), interleaved A B C A B C.
//! The jobs: the probe's CPU and I/O jobs, and where the host can run Linux
//! a guest kernel compile ([`super::linux`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use corral_vmm::manager::{CpuBackend, IoLimits, Manager};

use super::linux::{self, Plan};
use super::plot::{self, Panel, Series};
use super::report::{Csv, OutDir, Report, SUMMARY_HEADER, Table, summary_cells};
use super::runner::{self, Job, JobResult, Scratch};
use super::stats::{Summary, diff_pct};
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
    let runs = a.runs.unwrap_or(if quick { 2 } else { 5 }).max(1);
    let out = OutDir::create(a.common.out.as_deref(), "overhead")?;
    let scratch = Scratch::new("overhead")?;
    let sz = Sizes::new(quick);
    let disk = scratch.filled("disk0.img", sz.disk_bytes)?;
    let timeout = Duration::from_secs(if quick { 60 } else { 600 });

    let cpu_job = Job::work(sz.cpu_units, sz.unit_iters, 1).with_disk(&disk, IoLimits::default());
    let io_job = Job::blk_read(&disk, IoLimits::default(), sz.io_bytes, sz.io_bs, 4);
    let mut jobs: Vec<(&'static str, Job)> = match a.job {
        JobKind::Cpu => vec![("cpu", cpu_job)],
        JobKind::Io => vec![("io", io_job.clone())],
        JobKind::Both | JobKind::All => vec![("cpu", cpu_job), ("io", io_job.clone())],
        JobKind::Linux => Vec::new(),
    };
    if let Plan::Run(lj) = &linux_plan {
        jobs.push(("linux", Job::kbuild(lj)));
    }

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

    // Warm-up: one discarded run of each job on each configuration; a run of
    // the I/O job on A calibrates C's limits (for every job: the Linux job's
    // reads need far less than the probe's read rate).
    let total = (jobs.len() * configs.len()) as u64 * (u64::from(runs) + 1) + 1;
    let pb = super::progress(total);
    pb.set_message("calibrating the I/O limits");
    let cal = runner::run_job(&configs[0].mgr, "cal", "default", &io_job, timeout)?;
    pb.inc(1);
    let secs = cal.guest_s.unwrap_or(cal.wall_s).max(1e-6);
    let bps = cal.num("bytes").unwrap_or(0.0) / secs;
    let iops = cal.num("requests").unwrap_or(0.0) / secs;
    let limits = IoLimits {
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
    for run in 1..=runs {
        for (jname, job) in &jobs {
            for c in &configs {
                pb.set_message(format!("run {run}/{runs}: job {jname}, config {}", c.key));
                let j = if c.limited {
                    job.clone().with_limits(limits)
                } else {
                    job.clone()
                };
                let s0 = c.mgr.cpu_scheduler().self_usage().1;
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
                });
                pb.inc(1);
            }
        }
    }
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
    rep.para(&format!(
        "Method: the same guest job {runs} times per configuration (after one discarded warm-up \
         run each), configurations interleaved A B C A B C; each configuration is its own \
         manager, created once. **total seconds** = host wall time from `create_vm` to the \
         guest's `PROBE-DONE` line (boot, job, report; `KBUILD-RESULT` for the Linux job); \
         **CPU seconds** = CPU time of the VM's \
         vCPU threads (the `sys` analogue: guest time runs on them); **process CPU seconds** = \
         CPU time of the whole corral process from before `create_vm` to after `delete_vm` \
         (vCPU threads plus the device thread, the gate scheduler's tick thread of B — which \
         ticks during every run, so it is in every configuration's figure — and the harness); \
         **guest seconds** = the job's time as the guest measured it (the probe's `us=`, \
         the Linux job's `ms=`)."
    ));
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
