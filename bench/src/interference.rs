//! `corral bench interference`: a victim VM's fixed job alone, then beside a
//! CPU hog (spinning on every vCPU) and beside an I/O hog (virtio-blk reads,
//! long enough to outlast the victim, restarted if they end), with the host
//! scheduler alone (manager off), with equal classes under the gate
//! scheduler, and with shares 3:1 in the victim's favour (plus an I/O limit
//! on the I/O hog). The figure is the victim's slowdown: its time over its
//! time alone in the same round.
//!
//! Method: the headline scenarios (the goals: CPU hog 3:1, I/O hog 3:1 +
//! limit, each with its paired run alone) are repeated, interleaved, until
//! each victim's headline 95 % intervals are within `--target` (that victim
//! then stops; the rounds left go to the one that swings) or `--budget` is
//! spent ([`super::rounds`]); the comparison scenarios (off, 1:1) run in the first
//! `--compare-runs` rounds only, for the table.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use corral_vmm::manager::{CpuBackend, Limits, Manager};

use super::host;
use super::report::{OutDir, Report};
use super::runner::{self, Hog, Job, JobResult, Scratch, Vm};
use super::{BenchError, InterferenceArgs, Sizes};

/// CPU sampling period for the plots.
const SAMPLE: Duration = Duration::from_millis(50);
/// Adaptive rounds: at least this many per victim.
const MIN_ROUNDS: u32 = 3;
mod gatelog;
mod output;
mod scenarios;
mod threads;
use super::rounds::{self, Next, Progress};
use gatelog::GateSample;
use scenarios::{Cell, GOALS, HogKind, Point, SCENARIOS, Scenario, slowdown};

/// Whether `key` is repeated by the adaptive rounds (the run alone and the
/// goals' scenarios).
fn headline(key: &str) -> bool {
    key == "alone" || GOALS.iter().any(|(k, _)| *k == key)
}

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
    // The victim and the I/O hog read sparse files (holes read as zeros: no
    // storage in the way, and room for a job of --victim-secs at any speed).
    let file_bytes: u64 = if quick { sz.disk_bytes } else { 16 << 30 };
    let victim_disk = scratch.sparse("victim.img", file_bytes)?;
    let hog_disk = scratch.sparse("hog.img", file_bytes)?;
    let timeout = Duration::from_secs(if quick { 60 } else { 900 });
    let warmup = Duration::from_millis(if quick { 200 } else { 500 });
    let slice_ns = a.slice_us.map(|us| us.saturating_mul(1000));

    let classes = [("victim", 1), ("hog", 1)];
    // Milliseconds of a flag, as ns: the checks of the bounds between the
    // settings are `PolicyConfig::validate`'s.
    let ns = |flag: &str, ms: f64| {
        if ms.is_finite() && (0.0..=1000.0).contains(&ms) {
            Ok((ms * 1e6).round() as u64)
        } else {
            Err(BenchError(format!("{flag} {ms}: give 0 to 1000 ms")))
        }
    };
    let policy = corral_scheduler::PolicyConfig {
        handover_ns: ns("--handover-ms", a.handover_ms)?,
        min_slice_ns: ns("--min-slice-ms", a.min_slice_ms)?,
        ..Default::default()
    };
    policy
        .validate()
        .map_err(|e| BenchError(format!("--handover-ms/--min-slice-ms: {e}")))?;
    let gate = runner::new_manager_with(a.backend, builtin, &classes, policy)?;
    let off = runner::new_manager(CpuBackend::None, builtin, &classes)?;

    let pb = super::progress(if quick { 3 } else { 8 });
    let cpu_job = |units: u64| Job::work(units, sz.unit_iters, ncpu);
    let io_job = |bytes: u64| {
        Job::blk_read(&victim_disk, Limits::default(), bytes, sz.io_bs, 4).with_wait(a.probe_wait)
    };
    // Size the victim's jobs to --victim-secs alone (the seeds' make took
    // 13 s alone; a job of a fraction of a second gives a handful of CPU
    // samples and swings with every hiccup of the host). Each calibration
    // run predicts the next size until one lands in [1, 1.2] x: the first
    // read of a sparse file's range allocates its page-cache pages and is
    // slower than every later read, so one short run undersized the io
    // victim (7.0 s alone instead of 10 in the last quiet-host run).
    let (units, _) = if quick {
        (sz.cpu_units * 2, None)
    } else {
        size_job(
            &gate,
            "size-cpu",
            &cpu_job,
            sz.cpu_units * 2,
            1,
            100_000_000,
            a.victim_secs,
            timeout,
            &pb,
        )?
    };
    let max_io = file_bytes / sz.io_bs * sz.io_bs;
    let (io_bytes, io_cal) = if quick {
        (sz.io_bytes, None)
    } else {
        size_job(
            &gate,
            "size-io",
            &io_job,
            sz.io_bytes,
            sz.io_bs,
            max_io,
            a.victim_secs,
            timeout,
            &pb,
        )?
    };
    let jobs: [(&'static str, Job); 2] = [("cpu", cpu_job(units)), ("io", io_job(io_bytes))];
    let sizing = if quick {
        String::new()
    } else {
        format!(
            "Victim jobs sized to at least {} s alone by calibration runs (each predicting the \
             next size until one took 1 to 1.2 times that): cpu {units} units, io {} MiB. ",
            a.victim_secs,
            io_bytes >> 20
        )
    };
    // The I/O hog's limit: a quarter of the rate the io job reaches alone
    // (from the last calibration run, at the final size).
    let cal = match io_cal {
        Some(c) => c,
        None => {
            pb.set_message("calibrating the I/O hog's limit");
            runner::run_job(&gate, "cal", "victim", &jobs[1].1, timeout)?
        }
    };
    pb.inc(1);
    let secs = cal.guest_s.unwrap_or(cal.wall_s).max(1e-6);
    let iops = cal.num("requests").unwrap_or(0.0) / secs;
    let hog_limit = Limits {
        iops: Some(((iops / 4.0) as u64).max(50)),
        ..Default::default()
    };
    // The I/O hog reads three times what the victim reads (at most 6 GiB):
    // it outlasts the victim's run even unthrottled, where it was restarted
    // ~15 times a run (a new VM each time: boot, its threads, a new VM for
    // the scheduler) with the 64 MiB it read before. Its range is read once
    // here so that every run finds it in the page cache.
    let hog_bytes = if quick {
        sz.disk_bytes
    } else {
        (io_bytes.saturating_mul(3)).min(6 << 30).min(max_io)
    };
    pb.set_message("reading the I/O hog's file into the page cache");
    runner::warm(&hog_disk, hog_bytes)?;
    let cpu_hog = Job::spin(86_400, 1000, ncpu);
    let io_hog =
        |limits| Job::blk_read(&hog_disk, limits, hog_bytes, sz.io_bs, 4).with_wait(a.probe_wait);

    let mut cells: Vec<Cell> = Vec::new();
    let started = Instant::now();
    let mut round = 0;
    // The victims asked for (`--victims`): only these run, and only their
    // intervals decide when the rounds stop. Before, the stop rule saw every
    // victim, so from the second round on the ones not asked for ran too
    // (and took most of the budget while they settled).
    let selected: Vec<usize> = (0..jobs.len())
        .filter(|&i| a.victims.is_empty() || a.victims.iter().any(|v| v == jobs[i].0))
        .collect();
    let names: Vec<&str> = selected.iter().map(|&i| jobs[i].0).collect();
    let all_names = jobs.each_ref().map(|(j, _)| *j);
    let mut active = selected.clone();
    let stop = loop {
        round += 1;
        let compare = round <= a.compare_runs;
        // Scenarios in order, then in reverse (and the victims too): a slow
        // stretch of the host falls on every scenario alike.
        let mut order: Vec<Scenario> = SCENARIOS
            .iter()
            .filter(|s| compare || headline(s.key))
            .copied()
            .collect();
        let mut victims = active.clone();
        if round % 2 == 0 {
            order.reverse();
            victims.reverse();
        }
        for &ji in &victims {
            let (jname, job) = &jobs[ji];
            for (idx, scn) in order.iter().copied().enumerate() {
                if pb.position() + 1 >= pb.length().unwrap_or(0) {
                    pb.inc_length(order.len() as u64);
                }
                pb.set_message(format!("round {round}: victim {jname}, {}", scn.key));
                let name = format!(
                    "v{round}-{jname}-{idx}-{}",
                    scn.key.replace(':', "to").replace('+', "-")
                );
                cells.push(cell(
                    if scn.gate { &gate } else { &off },
                    &name,
                    (round, jname, job),
                    scn,
                    (&cpu_hog, &io_hog(hog_limit), &io_hog(Limits::default())),
                    (warmup, timeout, slice_ns),
                )?);
                pb.inc(1);
            }
        }
        if let Some(n) = fixed {
            if round >= n {
                break format!("{n} round(s), as asked");
            }
            continue;
        }
        let progress: Vec<Progress> = all_names.iter().map(|j| progress_of(&cells, j)).collect();
        let elapsed = started.elapsed().as_secs_f64();
        let mine: Vec<Progress> = selected.iter().map(|&i| progress[i].clone()).collect();
        match rounds::next_selected(
            &selected,
            &progress,
            elapsed,
            budget.as_secs_f64(),
            MIN_ROUNDS,
            a.target,
        ) {
            Next::Run(v) => active = v,
            Next::Settled => {
                break format!(
                    "{}: every headline slowdown's 95 % interval within ±{} % ({elapsed:.0} s)",
                    rounds::describe(&names, &mine),
                    a.target
                );
            }
            Next::BudgetSpent => {
                let widest = mine
                    .iter()
                    .flat_map(|p| &p.ratios)
                    .map(|r| r.map_or(f64::INFINITY, |r| r.half_width_pct()))
                    .fold(0.0, f64::max);
                break format!(
                    "{}: the budget of {:.0} s is spent; the widest headline 95 % interval is \
                     ±{widest:.1} % (wanted ±{} %; the Goals table says how many more rounds \
                     each would take)",
                    rounds::describe(&names, &mine),
                    budget.as_secs_f64(),
                    a.target
                );
            }
        }
    };
    set_shares(&gate, 1)?;
    pb.finish_and_clear();
    gate.shutdown();
    off.shutdown();

    let mut rep = Report::new("corral bench interference");
    rep.line(&super::host_lines(quick));
    let backend = match a.backend {
        CpuBackend::Gate => "gate",
        CpuBackend::Cgroup => "cgroup",
        CpuBackend::None => "none",
    };
    let backend = match a.backend {
        CpuBackend::Gate => format!(
            "{backend}, handover {} ms, minimum slice {} ms",
            a.handover_ms, a.min_slice_ms
        ),
        _ => backend.to_string(),
    };
    rep.para(&format!(
        "Method: headline rounds ({stop}). A victim's round runs it alone and beside each hog \
         with shares 3:1 (the goals' scenarios), in the order listed, then in reverse in the \
         next round; a victim stops once its headline intervals are within ±{} % (at least {} \
         rounds), or all stop at the budget. The first {} round(s) also run the comparison \
         scenarios (manager off, equal classes). {sizing}The victim and the hog are in classes \
         `victim` and `hog` of one manager ({backend} CPU backend), or of a manager with CPU backend \
         none for the `-off` rows, all on {ncpu} of the host's {host_cpus} CPUs (CPU \
         affinity), so the hog contends with the victim on any host. The hog starts {} ms \
         before the victim and is deleted when the victim's job ends. The CPU hog spins on \
         {ncpu} vCPU(s) (`{}`); the I/O hog reads {} MiB of its own sparse file (in the page \
         cache) in 4 KiB requests, 4 in flight, restarted if it finishes (`{}`); its limit in \
         the last scenario is iops={} (a quarter of the {:.0} IOPS the io job reached alone). \
         **total seconds** = host wall time from creating the victim to its `PROBE-DONE`; \
         **slowdown** = the geometric mean over rounds of total seconds / total seconds alone \
         in the same round, with its 95 % t-interval. CPU figures are percent of one host \
         CPU, from the vCPU threads' CPU clocks, sampled every 50 ms.",
        a.target,
        if fixed.is_some() { 1 } else { MIN_ROUNDS },
        a.compare_runs.min(round),
        warmup.as_millis(),
        cpu_hog.cmdline,
        hog_bytes >> 20,
        io_hog(hog_limit).cmdline,
        hog_limit.iops.unwrap_or(0),
        iops
    ));
    if let Some(us) = a.slice_us {
        rep.para(&format!(
            "**--slice-us {us}**: every VM's vCPU and device threads ran with a custom EEVDF \
             slice of {us} µs (set when the harness first saw each thread)."
        ));
    }
    let progress: Vec<Progress> = jobs.iter().map(|(j, _)| progress_of(&cells, j)).collect();
    output::write(
        &mut rep,
        &out,
        &output::Run {
            jobs: &jobs,
            cells: &cells,
            progress: &progress,
            target: a.target,
            probe_wait: a.probe_wait,
            gate: a.backend == CpuBackend::Gate,
        },
    )?;
    out.write("report.md", rep.text().as_bytes())?;
    Ok((out.path.clone(), rep.text().to_string()))
}

/// What the rounds so far gave for victim `job`.
fn progress_of(cells: &[Cell], job: &str) -> Progress {
    let (goal, _) = GOALS[0];
    let rounds = cells
        .iter()
        .filter(|c| c.job == job && c.scn.key == goal)
        .count() as u32;
    let round_secs = SCENARIOS
        .iter()
        .filter(|s| headline(s.key))
        .map(|s| {
            let xs: Vec<f64> = cells
                .iter()
                .filter(|c| c.job == job && c.scn.key == s.key)
                .map(|c| c.secs)
                .collect();
            if xs.is_empty() {
                0.0
            } else {
                xs.iter().sum::<f64>() / xs.len() as f64
            }
        })
        .sum();
    Progress {
        rounds,
        round_secs,
        ratios: GOALS.iter().map(|(k, _)| slowdown(cells, job, k)).collect(),
    }
}

/// Sizes a job to at least `secs` of host wall time alone: runs it at
/// `size`, then at the size that run predicts for 1.1 × `secs`, until a run
/// lands in [1, 1.2] × `secs` (at most four runs). Returns the size and the
/// last run (at that size).
#[allow(clippy::too_many_arguments)]
fn size_job(
    mgr: &Arc<Manager>,
    name: &str,
    job: &dyn Fn(u64) -> Job,
    mut size: u64,
    step: u64,
    max: u64,
    secs: f64,
    timeout: Duration,
    pb: &indicatif::ProgressBar,
) -> Result<(u64, Option<JobResult>), BenchError> {
    for i in 0..4 {
        pb.set_message(format!("sizing the victim jobs ({name}, run {})", i + 1));
        let r = runner::run_job(mgr, &format!("{name}-{i}"), "victim", &job(size), timeout)?;
        pb.inc(1);
        let next =
            ((size as f64 * 1.1 * secs / r.wall_s.max(1e-6)) as u64 / step * step).clamp(step, max);
        if (secs..=1.2 * secs).contains(&r.wall_s) || next == size || i == 3 {
            return Ok((size, Some(r)));
        }
        size = next;
    }
    Ok((size, None))
}

fn set_shares(mgr: &Manager, victim: u32) -> Result<(), BenchError> {
    mgr.update_class("victim", |c| c.cpu.shares = victim)
        .map_err(|e| BenchError(format!("class victim: {e}")))?;
    Ok(())
}

/// One victim run in one scenario: the hog started, warmed up, the victim
/// measured, the hog stopped.
fn cell(
    mgr: &Arc<Manager>,
    name: &str,
    (round, jname, job): (u32, &'static str, &Job),
    scn: Scenario,
    (cpu_hog, io_hog_limited, io_hog): (&Job, &Job, &Job),
    (warmup, timeout, slice_ns): (Duration, Duration, Option<u64>),
) -> Result<Cell, BenchError> {
    let t0 = Instant::now();
    set_shares(mgr, scn.victim_shares)?;
    let hog_job = match scn.hog {
        HogKind::None => None,
        HogKind::Cpu => Some(cpu_hog),
        HogKind::Io if scn.hog_limited => Some(io_hog_limited),
        HogKind::Io => Some(io_hog),
    };
    let hog = hog_job
        .map(|j| Hog::start(mgr, "hog", "hog", j))
        .transpose()?;
    if hog.is_some() {
        std::thread::sleep(warmup);
    }
    let r = measure(mgr, name, job, hog.as_ref(), timeout, slice_ns);
    let hog_restarts = match hog {
        Some(h) => h.stop()?,
        None => 0,
    };
    let m = r?;
    Ok(Cell {
        round,
        job: jname,
        scn,
        total_s: m.total_s,
        guest_s: m.guest_s,
        victim_cpu_s: m.victim_cpu_s,
        hog_cpu_s: m.hog_cpu_s,
        hog_restarts,
        timeline: m.timeline,
        threads: m.threads,
        gate: m.gate,
        secs: t0.elapsed().as_secs_f64(),
    })
}

struct Measured {
    total_s: f64,
    guest_s: Option<f64>,
    victim_cpu_s: f64,
    hog_cpu_s: f64,
    timeline: Vec<Point>,
    threads: [threads::Sched; 5],
    gate: gatelog::GateTotals,
}

/// The scheduler's entitlement of a class now, percent of one CPU.
fn entitlement(mgr: &Manager, class: &str) -> Option<f64> {
    mgr.get_class(class).ok().and_then(|c| c.entitlement_pct)
}

/// Runs the victim to completion, sampling its and the hog's CPU time and
/// the threads' schedstat.
fn measure(
    mgr: &Arc<Manager>,
    name: &str,
    job: &Job,
    hog: Option<&Hog>,
    timeout: Duration,
    slice_ns: Option<u64>,
) -> Result<Measured, BenchError> {
    let hog_cpu = || hog.map_or(0, Hog::cpu_ns);
    let h_start = hog_cpu();
    let mut acc = threads::Accounts::begin(mgr, name, hog.map(|_| "hog"), slice_ns);
    let mut glog = gatelog::GateLog::begin(mgr, name, hog.map(|_| "hog"));
    let mut vm = Vm::start(mgr, name, "victim", job)?;
    let t0 = vm.t0;
    acc.sample(mgr);
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
            let g = glog.sample(mgr);
            s.add(now, v, hog_cpu(), mgr, g);
            acc.sample(mgr);
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
    acc.sample(mgr);
    let g_end = glog.sample(mgr);
    vm.wait_stopped(Duration::from_secs(5));
    vm.pump(Duration::ZERO);
    let v_end = vm.cpu_ns();
    s.add(end.max(s.last.0), v_end, h_end, mgr, g_end);
    vm.check_ok()?;
    let guest_s = vm
        .result_line()
        .and_then(|l| runner::field(l, "us"))
        .and_then(|v| v.parse::<f64>().ok())
        .map(|us| us / 1e6);
    Ok(Measured {
        total_s: (end - t0).as_secs_f64(),
        guest_s,
        victim_cpu_s: v_end as f64 / 1e9,
        hog_cpu_s: h_end.saturating_sub(h_start) as f64 / 1e9,
        timeline: s.timeline,
        threads: acc.totals(),
        gate: glog.totals(),
    })
}

/// Turns cumulative CPU readings into percent-of-one-CPU samples.
struct Sampler {
    t0: Instant,
    /// (time, victim ns, hog ns) of the last reading.
    last: (Instant, u64, u64),
    timeline: Vec<Point>,
}

impl Sampler {
    fn add(&mut self, now: Instant, v: u64, h: u64, mgr: &Manager, g: Option<GateSample>) {
        let (lt, lv, lh) = self.last;
        let dt = (now - lt).as_secs_f64();
        if dt > 0.02 {
            self.timeline.push(Point {
                t: (now - self.t0).as_secs_f64(),
                victim: v.saturating_sub(lv) as f64 / 1e9 / dt * 100.0,
                hog: h.saturating_sub(lh) as f64 / 1e9 / dt * 100.0,
                victim_ent: entitlement(mgr, "victim"),
                hog_ent: entitlement(mgr, "hog"),
                gate: g,
            });
            self.last = (now, v, h);
        }
    }
}
