//! `corral bench interference`: a victim VM's fixed job alone, then beside a
//! CPU hog (spinning on every vCPU) and beside an I/O hog (virtio-blk reads,
//! restarted whenever they end), with the host scheduler alone (manager
//! off), with equal classes under the gate scheduler, and with shares 3:1
//! in the victim's favour (plus an I/O limit on the I/O hog). The figure is
//! the victim's slowdown: its time over its time alone.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use corral_vmm::manager::{CpuBackend, Limits, Manager};

use super::host;
use super::plot::{self, Panel, Series};
use super::report::{Csv, OutDir, Report, Table};
use super::runner::{self, Hog, Job, Scratch, Vm};
use super::stats::Summary;
use super::{BenchError, InterferenceArgs, Sizes};

/// CPU sampling period for the plots.
const SAMPLE: Duration = Duration::from_millis(50);
/// Adaptive rounds: at least this many.
const MIN_ROUNDS: u32 = 3;
mod scenarios;
use scenarios::{Cell, GOALS, HogKind, Point, SCENARIOS, Scenario, slowdown};

/// Runs it; returns the output directory and the report.
pub fn run(a: InterferenceArgs, builtin: &Arc<[u8]>) -> Result<(PathBuf, String), BenchError> {
    let quick = a.common.quick;
    if !(a.target > 0.0 && a.target.is_finite()) {
        return Err(BenchError(format!(
            "--target {} must be a positive percentage",
            a.target
        )));
    }
    if !(a.victim_secs > 0.0 && a.victim_secs <= 3600.0) {
        return Err(BenchError(format!(
            "--victim-secs {} must be in (0, 3600]",
            a.victim_secs
        )));
    }
    let fixed = a.runs.map(|r| r.max(1)).or(quick.then_some(1));
    let budget = a.budget.unwrap_or(Duration::from_secs(40 * 60));
    let out = OutDir::create(a.common.out.as_deref(), "interference")?;
    let scratch = Scratch::new("interference")?;
    let sz = Sizes::new(quick);
    // Two host CPUs, so that a hog with as many vCPUs contends with the
    // victim on any host (and the scheduler's capacity is those two).
    let host_cpus = host::host_cpus();
    let ncpu = host::limit_cpus(2);
    // The victim reads a sparse file (holes read as zeros: no storage in
    // the way, and room for a job of --victim-secs at any speed).
    let victim_bytes: u64 = if quick { sz.disk_bytes } else { 16 << 30 };
    let victim_disk = scratch.sparse("victim.img", victim_bytes)?;
    let hog_disk = scratch.filled("hog.img", sz.disk_bytes)?;
    let timeout = Duration::from_secs(if quick { 60 } else { 900 });
    let warmup = Duration::from_millis(if quick { 200 } else { 500 });

    let classes = [("victim", 1), ("hog", 1)];
    let gate = runner::new_manager(CpuBackend::Gate, builtin, &classes)?;
    let off = runner::new_manager(CpuBackend::None, builtin, &classes)?;

    let mut jobs: [(&'static str, Job); 2] = [
        ("cpu", Job::work(sz.cpu_units * 2, sz.unit_iters, ncpu)),
        (
            "io",
            Job::blk_read(&victim_disk, Limits::default(), sz.io_bytes, sz.io_bs, 4)
                .with_wait(a.probe_wait),
        ),
    ];
    // Size the victim's jobs to --victim-secs alone (the seeds' make took
    // 13 s alone; a job of a fraction of a second gives a handful of CPU
    // samples and swings with every hiccup of the host).
    let mut sizing = String::new();
    if !quick {
        let cal = runner::run_job(&gate, "size-cpu", "victim", &jobs[0].1, timeout)?;
        let per_unit = cal.wall_s / (sz.cpu_units * 2) as f64;
        let units = ((a.victim_secs / per_unit.max(1e-9)).ceil() as u64).clamp(1, 100_000_000);
        jobs[0].1 = Job::work(units, sz.unit_iters, ncpu);
        let cal = runner::run_job(&gate, "size-io", "victim", &jobs[1].1, timeout)?;
        let per_byte = cal.wall_s / sz.io_bytes as f64;
        let bytes = ((a.victim_secs / per_byte.max(1e-15)) as u64 / sz.io_bs * sz.io_bs)
            .clamp(sz.io_bs, victim_bytes / sz.io_bs * sz.io_bs);
        jobs[1].1 = Job::blk_read(&victim_disk, Limits::default(), bytes, sz.io_bs, 4)
            .with_wait(a.probe_wait);
        sizing = format!(
            "Victim jobs sized to about {} s alone from one calibration run each: cpu {units} \
             units, io {} MiB. ",
            a.victim_secs,
            bytes >> 20
        );
    }

    let per_round = (jobs.len() * SCENARIOS.len()) as u64;
    let steps = 1 + u64::from(fixed.unwrap_or(MIN_ROUNDS)) * per_round;
    let pb = super::progress(steps);
    // Calibration: the I/O job alone gives the hog's limit (a quarter of
    // the rate the job reaches alone).
    pb.set_message("calibrating the I/O hog's limit");
    let cal = runner::run_job(&gate, "cal", "victim", &jobs[1].1, timeout)?;
    pb.inc(1);
    let secs = cal.guest_s.unwrap_or(cal.wall_s).max(1e-6);
    let iops = cal.num("requests").unwrap_or(0.0) / secs;
    let hog_limit = Limits {
        iops: Some(((iops / 4.0) as u64).max(50)),
        ..Default::default()
    };
    let cpu_hog = Job::spin(86_400, 1000, ncpu);
    let io_hog = |limits| {
        Job::blk_read(&hog_disk, limits, sz.disk_bytes, sz.io_bs, 4).with_wait(a.probe_wait)
    };

    let mut cells = Vec::new();
    let started = Instant::now();
    let mut round = 0;
    let stop = loop {
        round += 1;
        if round > fixed.unwrap_or(MIN_ROUNDS) {
            pb.inc_length(per_round);
        }
        // Scenarios in order, then in reverse: a slow stretch of the host
        // falls on every scenario alike.
        let order: Vec<Scenario> = if round % 2 == 1 {
            SCENARIOS.to_vec()
        } else {
            SCENARIOS.iter().rev().copied().collect()
        };
        for (jname, job) in &jobs {
            for scn in order.iter().copied() {
                pb.set_message(format!("round {round}: victim {jname}, {}", scn.key));
                let mgr = if scn.gate { &gate } else { &off };
                set_shares(mgr, scn.victim_shares)?;
                let hog = match scn.hog {
                    HogKind::None => None,
                    HogKind::Cpu => Some(Hog::start(mgr, "hog", "hog", &cpu_hog)?),
                    HogKind::Io => Some(Hog::start(
                        mgr,
                        "hog",
                        "hog",
                        &io_hog(if scn.hog_limited {
                            hog_limit
                        } else {
                            Limits::default()
                        }),
                    )?),
                };
                if hog.is_some() {
                    std::thread::sleep(warmup);
                }
                let name = format!(
                    "victim-{jname}-{round}-{}",
                    scn.key.replace(':', "to").replace('+', "-")
                );
                let r = measure(mgr, &name, job, hog.as_ref(), timeout);
                let hog_restarts = match hog {
                    Some(h) => h.stop()?,
                    None => 0,
                };
                let (total_s, guest_s, victim_cpu_s, hog_cpu_s, timeline) = r?;
                cells.push(Cell {
                    round,
                    job: jname,
                    scn,
                    total_s,
                    guest_s,
                    victim_cpu_s,
                    hog_cpu_s,
                    hog_restarts,
                    timeline,
                });
                pb.inc(1);
            }
        }
        if let Some(n) = fixed {
            if round >= n {
                break format!("{n} round(s), as asked");
            }
            continue;
        }
        if round < MIN_ROUNDS {
            continue;
        }
        let widest = jobs
            .iter()
            .flat_map(|(j, _)| {
                SCENARIOS
                    .iter()
                    .filter(|s| s.key != "alone")
                    .map(|s| slowdown(&cells, j, s.key))
            })
            .map(|r| r.map_or(f64::INFINITY, |r| r.half_width_pct()))
            .fold(0.0, f64::max);
        if widest <= a.target {
            break format!(
                "{round} rounds: every slowdown's 95 % interval within ±{} % ({:.0} s)",
                a.target,
                started.elapsed().as_secs_f64()
            );
        }
        let per = started.elapsed() / round;
        if started.elapsed() + per > budget {
            let more = super::stats::pairs_needed(round as usize, widest, a.target).map_or_else(
                String::new,
                |n| {
                    format!(
                        "; at this spread ±{} % would take about {n} rounds (~{:.0} min)",
                        a.target,
                        per.as_secs_f64() * n as f64 / 60.0
                    )
                },
            );
            break format!(
                "{round} rounds: the budget of {:.0} s is spent; the widest 95 % interval is ±{widest:.1} % (wanted ±{} %){more}",
                budget.as_secs_f64(),
                a.target
            );
        }
    };
    let rounds = round;
    set_shares(&gate, 1)?;
    pb.finish_and_clear();
    gate.shutdown();
    off.shutdown();

    // Raw samples.
    let mut csv = Csv::new(&[
        "round",
        "victim_job",
        "scenario",
        "total_s",
        "guest_s",
        "victim_cpu_s",
        "hog_cpu_s",
        "hog_restarts",
    ]);
    let mut tl = Csv::new(&[
        "round",
        "victim_job",
        "scenario",
        "t_s",
        "victim_cpu_pct",
        "hog_cpu_pct",
        "victim_entitlement_pct",
        "hog_entitlement_pct",
    ]);
    for c in &cells {
        csv.push(vec![
            c.round.to_string(),
            c.job.into(),
            c.scn.key.into(),
            format!("{:.6}", c.total_s),
            c.guest_s.map(|g| format!("{g:.6}")).unwrap_or_default(),
            format!("{:.6}", c.victim_cpu_s),
            format!("{:.6}", c.hog_cpu_s),
            c.hog_restarts.to_string(),
        ]);
        for p in &c.timeline {
            let opt = |v: Option<f64>| v.map(|v| format!("{v:.1}")).unwrap_or_default();
            tl.push(vec![
                c.round.to_string(),
                c.job.into(),
                c.scn.key.into(),
                format!("{:.3}", p.t),
                format!("{:.1}", p.victim),
                format!("{:.1}", p.hog),
                opt(p.victim_ent),
                opt(p.hog_ent),
            ]);
        }
    }
    out.write("samples.csv", csv.text().as_bytes())?;
    out.write("timeline.csv", tl.text().as_bytes())?;

    // Report.
    let mut rep = Report::new("corral bench interference");
    rep.line(&super::host_lines(quick));
    rep.para(&format!(
        "Method: {rounds} round(s) ({stop}); each round runs every victim job in every scenario, \
         in the order listed, then in reverse in the next round. {sizing} The victim and the hog are in classes `victim` and `hog` of one manager \
         (gate CPU backend), or of a manager with CPU backend none for the `-off` rows, all on \
         {ncpu} of the host's {host_cpus} CPUs (CPU affinity), so the hog contends with the \
         victim on any host. The hog \
         starts {} ms before the victim and is deleted when the victim's job ends. The CPU \
         hog spins on {ncpu} vCPU(s) (`{}`); the I/O hog reads its own {} MiB disk file in \
         4 KiB requests, 4 in flight, restarted whenever it finishes (`{}`); its limit in the \
         last scenario is iops={} (a quarter of the {:.0} IOPS the I/O job reached alone). \
         **total seconds** = host wall time from creating the victim to its `PROBE-DONE`; \
         **slowdown** = the geometric mean over rounds of total seconds / total seconds alone \
         in the same round, with its 95 % t-interval. CPU figures are percent of one host \
         CPU, from the vCPU threads' CPU clocks, sampled every 50 ms.",
        warmup.as_millis(),
        cpu_hog.cmdline,
        sz.disk_bytes >> 20,
        io_hog(hog_limit).cmdline,
        hog_limit.iops.unwrap_or(0),
        iops
    ));
    let mut t = Table::new(&["victim job", "command line", "vCPUs"]);
    for (jname, job) in &jobs {
        t.row(vec![
            jname.to_string(),
            format!("`{}`", job.cmdline),
            job.vcpus.to_string(),
        ]);
    }
    rep.table(&t);

    rep.h2("Victim slowdown");
    let mut t = Table::new(&[
        "victim job",
        "scenario",
        "n",
        "total s min",
        "total s avg",
        "total s max",
        "sdev",
        "spread",
        "slowdown",
        "95 % interval",
        "guest s avg",
        "victim CPU %",
        "hog CPU %",
    ]);
    for (jname, _) in &jobs {
        let of = |k: &str| -> Vec<&Cell> {
            cells
                .iter()
                .filter(|c| c.job == *jname && c.scn.key == k)
                .collect()
        };
        let alone = Summary::of(&of("alone").iter().map(|c| c.total_s).collect::<Vec<_>>());
        for scn in SCENARIOS {
            let cs = of(scn.key);
            let Some(s) = Summary::of(&cs.iter().map(|c| c.total_s).collect::<Vec<_>>()) else {
                continue;
            };
            let guest: Vec<f64> = cs.iter().filter_map(|c| c.guest_s).collect();
            let wall: f64 = cs.iter().map(|c| c.total_s).sum();
            let vcpu: f64 = cs.iter().map(|c| c.victim_cpu_s).sum();
            let hcpu: f64 = cs.iter().map(|c| c.hog_cpu_s).sum();
            t.row(vec![
                jname.to_string(),
                scn.what.to_string(),
                s.n.to_string(),
                format!("{:.3}", s.min),
                format!("{:.3}", s.avg),
                format!("{:.3}", s.max),
                format!("{:.3}", s.sdev),
                format!("{:.1}%", s.spread() * 100.0),
                match (&alone, slowdown(&cells, jname, scn.key)) {
                    (_, Some(r)) if scn.key != "alone" => {
                        format!("{:.3}x", 1.0 + r.mean_pct / 100.0)
                    }
                    (Some(al), None) if scn.key != "alone" => format!("{:.2}x", s.avg / al.avg),
                    _ => "1.00x (base)".into(),
                },
                match slowdown(&cells, jname, scn.key) {
                    Some(r) if scn.key != "alone" => format!(
                        "{:.3}x … {:.3}x (±{:.1} %)",
                        1.0 + r.lo_pct / 100.0,
                        1.0 + r.hi_pct / 100.0,
                        r.half_width_pct()
                    ),
                    _ => "-".into(),
                },
                Summary::of(&guest).map_or("-".into(), |g| format!("{:.3}", g.avg)),
                format!("{:.0}", vcpu / wall * 100.0),
                if scn.hog == HogKind::None {
                    "-".into()
                } else {
                    format!("{:.0}", hcpu / wall * 100.0)
                },
            ]);
        }
    }
    rep.table(&t);
    let restarts: u64 = cells.iter().map(|c| c.hog_restarts).sum();
    rep.para(&format!(
        "The I/O hog was restarted {restarts} time(s) in all (each restart is a new VM: boot, \
         read, power-off). A vCPU thread that waits on the gate or on the throttle uses no CPU. \
         The probe's disk jobs ran with `probe.wait={}`: {}",
        a.probe_wait.param(),
        match a.probe_wait {
            super::ProbeWait::Irq => {
                "a wait sleeps in `hlt` until the used-ring interrupt, so a throttled I/O \
                 guest leaves its vCPU idle."
            }
            super::ProbeWait::Poll => {
                "the driver spins on its used ring, so a throttled I/O guest burns its \
                 vCPU (the behaviour before session 4)."
            }
        }
    ));
    rep.h2("Goals");
    let mut t = Table::new(&["victim job", "scenario", "goal", "verdict"]);
    for (jname, _) in &jobs {
        for (key, limit) in GOALS {
            let Some(scn) = SCENARIOS.iter().find(|s| s.key == key) else {
                continue;
            };
            t.row(vec![
                jname.to_string(),
                scn.what.to_string(),
                format!("≤ {limit:.2}×, 95 % interval ±{} %", a.target),
                slowdown(&cells, jname, key).map_or_else(
                    || "no interval (fewer than 2 rounds)".into(),
                    |r| r.goal_verdict(limit, a.target),
                ),
            ]);
        }
    }
    rep.table(&t);

    // Plots: CPU share over time, one figure per victim job, the first round.
    rep.h2("CPU use over time (round 1)");
    for (jname, _) in &jobs {
        let panels: Vec<Panel> = cells
            .iter()
            .filter(|c| c.round == 1 && c.job == *jname)
            .map(|c| {
                let pts = |f: fn(&Point) -> Option<f64>| -> Vec<(f64, f64)> {
                    c.timeline
                        .iter()
                        .filter_map(|p| f(p).map(|v| (p.t, v)))
                        .collect()
                };
                let mut series = vec![Series::line("victim used", pts(|p| Some(p.victim)))];
                if c.scn.gate {
                    series.push(Series::line("victim entitled", pts(|p| p.victim_ent)));
                }
                if c.scn.hog != HogKind::None {
                    series.push(Series::line("hog used", pts(|p| Some(p.hog))));
                    if c.scn.gate {
                        series.push(Series::line("hog entitled", pts(|p| p.hog_ent)));
                    }
                }
                Panel::new(
                    c.scn.what,
                    "seconds since the victim started",
                    "CPU, % of one host CPU",
                    series,
                )
            })
            .collect();
        let file = format!("interference-{jname}.png");
        plot::draw(
            &out.join(&file),
            &format!(
                "corral bench interference: victim job {jname}, CPU used and entitled per class, every 50 ms"
            ),
            &panels,
            4,
        )?;
        rep.para(&format!("![victim {jname}]({file})"));
    }
    rep.para(
        "Raw samples: `samples.csv` (one row per victim run), `timeline.csv` (CPU used and entitled every 50 ms).",
    );
    out.write("report.md", rep.text().as_bytes())?;
    Ok((out.path.clone(), rep.text().to_string()))
}

fn set_shares(mgr: &Manager, victim: u32) -> Result<(), BenchError> {
    mgr.update_class("victim", |c| c.cpu.shares = victim)
        .map_err(|e| BenchError(format!("class victim: {e}")))?;
    Ok(())
}

type Measured = (f64, Option<f64>, f64, f64, Vec<Point>);

/// The scheduler's entitlement of a class now, percent of one CPU.
fn entitlement(mgr: &Manager, class: &str) -> Option<f64> {
    mgr.get_class(class).ok().and_then(|c| c.entitlement_pct)
}

/// Runs the victim to completion, sampling its and the hog's CPU time.
fn measure(
    mgr: &Arc<Manager>,
    name: &str,
    job: &Job,
    hog: Option<&Hog>,
    timeout: Duration,
) -> Result<Measured, BenchError> {
    let hog_cpu = || hog.map_or(0, Hog::cpu_ns);
    let h_start = hog_cpu();
    let mut vm = Vm::start(mgr, name, "victim", job)?;
    let t0 = vm.t0;
    let mut next = t0 + SAMPLE;
    let mut s = Sampler {
        t0,
        last: (t0, 0, h_start),
        timeline: Vec::new(),
    };
    loop {
        let now = Instant::now();
        let wait = next
            .saturating_duration_since(now)
            .min(Duration::from_millis(5));
        let done = vm.pump(wait);
        let v = vm.cpu_ns();
        let now = Instant::now();
        if now >= next {
            s.add(now, v, hog_cpu(), mgr);
            next += SAMPLE;
        }
        if done {
            break;
        }
        if now - t0 > timeout {
            return Err(BenchError(format!(
                "victim {name} did not finish within {timeout:?}"
            )));
        }
    }
    let end = vm.done_at.unwrap_or_else(Instant::now);
    let h_end = hog_cpu();
    vm.wait_stopped(Duration::from_secs(5));
    vm.pump(Duration::ZERO);
    let v_end = vm.cpu_ns();
    s.add(end.max(s.last.0), v_end, h_end, mgr);
    let timeline = s.timeline;
    vm.check_ok()?;
    let guest_s = vm
        .result_line()
        .and_then(|l| runner::field(l, "us"))
        .and_then(|v| v.parse::<f64>().ok())
        .map(|us| us / 1e6);
    Ok((
        (end - t0).as_secs_f64(),
        guest_s,
        v_end as f64 / 1e9,
        h_end.saturating_sub(h_start) as f64 / 1e9,
        timeline,
    ))
}

/// Turns cumulative CPU readings into percent-of-one-CPU samples.
struct Sampler {
    t0: Instant,
    /// (time, victim ns, hog ns) of the last reading.
    last: (Instant, u64, u64),
    timeline: Vec<Point>,
}

impl Sampler {
    fn add(&mut self, now: Instant, v: u64, h: u64, mgr: &Manager) {
        let (lt, lv, lh) = self.last;
        let dt = (now - lt).as_secs_f64();
        if dt > 0.02 {
            self.timeline.push(Point {
                t: (now - self.t0).as_secs_f64(),
                victim: v.saturating_sub(lv) as f64 / 1e9 / dt * 100.0,
                hog: h.saturating_sub(lh) as f64 / 1e9 / dt * 100.0,
                victim_ent: entitlement(mgr, "victim"),
                hog_ent: entitlement(mgr, "hog"),
            });
            self.last = (now, v, h);
        }
    }
}
