//! `corral bench interference`: a victim VM's fixed job alone, then beside a
//! CPU hog (spinning on every vCPU) and beside an I/O hog (virtio-blk reads,
//! restarted whenever they end), with the host scheduler alone (manager
//! off), with equal classes under the gate scheduler, and with shares 3:1
//! in the victim's favour (plus an I/O limit on the I/O hog). The figure is
//! the victim's slowdown: its time over its time alone.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use corral_vmm::manager::{CpuBackend, IoLimits, Manager};

use super::host;
use super::plot::{self, Panel, Series};
use super::report::{Csv, OutDir, Report, Table};
use super::runner::{self, Hog, Job, Scratch, Vm};
use super::stats::Summary;
use super::{BenchError, InterferenceArgs, Sizes};

/// CPU sampling period for the plots.
const SAMPLE: Duration = Duration::from_millis(250);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HogKind {
    None,
    Cpu,
    Io,
}

#[derive(Debug, Clone, Copy)]
struct Scenario {
    key: &'static str,
    what: &'static str,
    hog: HogKind,
    /// Gate scheduler (else CPU backend none).
    gate: bool,
    victim_shares: u32,
    hog_limited: bool,
}

const SCENARIOS: [Scenario; 7] = [
    Scenario {
        key: "alone",
        what: "victim alone",
        hog: HogKind::None,
        gate: true,
        victim_shares: 1,
        hog_limited: false,
    },
    Scenario {
        key: "cpu-hog-off",
        what: "CPU hog, manager off (host scheduler only)",
        hog: HogKind::Cpu,
        gate: false,
        victim_shares: 1,
        hog_limited: false,
    },
    Scenario {
        key: "cpu-hog-1:1",
        what: "CPU hog, equal classes",
        hog: HogKind::Cpu,
        gate: true,
        victim_shares: 1,
        hog_limited: false,
    },
    Scenario {
        key: "cpu-hog-3:1",
        what: "CPU hog, shares 3:1 for the victim",
        hog: HogKind::Cpu,
        gate: true,
        victim_shares: 3,
        hog_limited: false,
    },
    Scenario {
        key: "io-hog-off",
        what: "I/O hog, manager off (host scheduler only)",
        hog: HogKind::Io,
        gate: false,
        victim_shares: 1,
        hog_limited: false,
    },
    Scenario {
        key: "io-hog-1:1",
        what: "I/O hog, equal classes",
        hog: HogKind::Io,
        gate: true,
        victim_shares: 1,
        hog_limited: false,
    },
    Scenario {
        key: "io-hog-3:1+limit",
        what: "I/O hog, shares 3:1 for the victim, I/O limit on the hog",
        hog: HogKind::Io,
        gate: true,
        victim_shares: 3,
        hog_limited: true,
    },
];

struct Cell {
    round: u32,
    job: &'static str,
    scn: Scenario,
    total_s: f64,
    guest_s: Option<f64>,
    victim_cpu_s: f64,
    hog_cpu_s: f64,
    hog_restarts: u64,
    /// (t s, victim % of one CPU, hog % of one CPU).
    timeline: Vec<(f64, f64, f64)>,
}

/// Runs it; returns the output directory and the report.
pub fn run(a: InterferenceArgs, builtin: &Arc<[u8]>) -> Result<(PathBuf, String), BenchError> {
    let quick = a.common.quick;
    let rounds = a.runs.unwrap_or(if quick { 1 } else { 3 }).max(1);
    let out = OutDir::create(a.common.out.as_deref(), "interference")?;
    let scratch = Scratch::new("interference")?;
    let sz = Sizes::new(quick);
    // Two host CPUs, so that a hog with as many vCPUs contends with the
    // victim on any host (and the scheduler's capacity is those two).
    let host_cpus = host::host_cpus();
    let ncpu = host::limit_cpus(2);
    let victim_disk = scratch.filled("victim.img", sz.disk_bytes)?;
    let hog_disk = scratch.filled("hog.img", sz.disk_bytes)?;
    let timeout = Duration::from_secs(if quick { 60 } else { 900 });
    let warmup = Duration::from_millis(if quick { 200 } else { 500 });

    let classes = [("victim", 1), ("hog", 1)];
    let gate = runner::new_manager(CpuBackend::Gate, builtin, &classes)?;
    let off = runner::new_manager(CpuBackend::None, builtin, &classes)?;

    let jobs: [(&'static str, Job); 2] = [
        ("cpu", Job::work(sz.cpu_units * 2, sz.unit_iters, ncpu)),
        (
            "io",
            Job::blk_read(&victim_disk, IoLimits::default(), sz.io_bytes, sz.io_bs, 4),
        ),
    ];

    let steps = 1 + u64::from(rounds) * (jobs.len() * SCENARIOS.len()) as u64;
    let pb = super::progress(steps);
    // Calibration: the I/O job alone gives the hog's limit (a quarter of
    // the rate the job reaches alone).
    pb.set_message("calibrating the I/O hog's limit");
    let cal = runner::run_job(&gate, "cal", "victim", &jobs[1].1, timeout)?;
    pb.inc(1);
    let secs = cal.guest_s.unwrap_or(cal.wall_s).max(1e-6);
    let iops = cal.num("requests").unwrap_or(0.0) / secs;
    let hog_limit = IoLimits {
        iops: Some(((iops / 4.0) as u64).max(50)),
        ..Default::default()
    };
    let cpu_hog = Job::spin(86_400, 1000, ncpu);
    let io_hog = |limits| Job::blk_read(&hog_disk, limits, sz.disk_bytes, sz.io_bs, 4);

    let mut cells = Vec::new();
    for round in 1..=rounds {
        for (jname, job) in &jobs {
            for scn in SCENARIOS {
                pb.set_message(format!(
                    "round {round}/{rounds}: victim {jname}, {}",
                    scn.key
                ));
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
                            IoLimits::default()
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
    }
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
        for (t, v, h) in &c.timeline {
            tl.push(vec![
                c.round.to_string(),
                c.job.into(),
                c.scn.key.into(),
                format!("{t:.3}"),
                format!("{v:.1}"),
                format!("{h:.1}"),
            ]);
        }
    }
    out.write("samples.csv", csv.text().as_bytes())?;
    out.write("timeline.csv", tl.text().as_bytes())?;

    // Report.
    let mut rep = Report::new("corral bench interference");
    rep.line(&super::host_lines(quick));
    rep.para(&format!(
        "Method: {rounds} round(s); each round runs every victim job in every scenario, in the \
         order listed. The victim and the hog are in classes `victim` and `hog` of one manager \
         (gate CPU backend), or of a manager with CPU backend none for the `-off` rows, all on \
         {ncpu} of the host's {host_cpus} CPUs (CPU affinity), so the hog contends with the \
         victim on any host. The hog \
         starts {} ms before the victim and is deleted when the victim's job ends. The CPU \
         hog spins on {ncpu} vCPU(s) (`{}`); the I/O hog reads its own {} MiB disk file in \
         4 KiB requests, 4 in flight, restarted whenever it finishes (`{}`); its limit in the \
         last scenario is iops={} (a quarter of the {:.0} IOPS the I/O job reached alone). \
         **total seconds** = host wall time from creating the victim to its `PROBE-DONE`; \
         **slowdown** = avg total seconds / avg total seconds alone. CPU figures are percent \
         of one host CPU, from the vCPU threads' CPU clocks.",
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
                match &alone {
                    Some(al) if scn.key != "alone" => format!("{:.2}x", s.avg / al.avg),
                    _ => "1.00x (base)".into(),
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
         read, power-off). A vCPU thread that waits on the gate or on the throttle uses no CPU; \
         the probe polls its virtio queue, so a throttled I/O guest still burns its vCPU."
    ));

    // Plots: CPU share over time, one figure per victim job, the first round.
    rep.h2("CPU use over time (round 1)");
    for (jname, _) in &jobs {
        let panels: Vec<Panel> = cells
            .iter()
            .filter(|c| c.round == 1 && c.job == *jname)
            .map(|c| {
                let mut series = vec![Series::line(
                    "victim",
                    c.timeline.iter().map(|&(t, v, _)| (t, v)).collect(),
                )];
                if c.scn.hog != HogKind::None {
                    series.push(Series::line(
                        "hog",
                        c.timeline.iter().map(|&(t, _, h)| (t, h)).collect(),
                    ));
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
            &format!("corral bench interference: victim job {jname}, CPU use every 250 ms"),
            &panels,
            4,
        )?;
        rep.para(&format!("![victim {jname}]({file})"));
    }
    rep.para(
        "Raw samples: `samples.csv` (one row per victim run), `timeline.csv` (CPU every 250 ms).",
    );
    out.write("report.md", rep.text().as_bytes())?;
    Ok((out.path.clone(), rep.text().to_string()))
}

fn set_shares(mgr: &Manager, victim: u32) -> Result<(), BenchError> {
    mgr.update_class("victim", |c| c.cpu.shares = victim)
        .map_err(|e| BenchError(format!("class victim: {e}")))?;
    Ok(())
}

type Measured = (f64, Option<f64>, f64, f64, Vec<(f64, f64, f64)>);

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
            s.add(now, v, hog_cpu());
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
    s.add(end.max(s.last.0), v_end, h_end);
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
    timeline: Vec<(f64, f64, f64)>,
}

impl Sampler {
    fn add(&mut self, now: Instant, v: u64, h: u64) {
        let (lt, lv, lh) = self.last;
        let dt = (now - lt).as_secs_f64();
        if dt > 0.1 {
            self.timeline.push((
                (now - self.t0).as_secs_f64(),
                v.saturating_sub(lv) as f64 / 1e9 / dt * 100.0,
                h.saturating_sub(lh) as f64 / 1e9 / dt * 100.0,
            ));
            self.last = (now, v, h);
        }
    }
}
