//! The interference benchmark's output: raw CSVs, the report's tables
//! (slowdowns, per-thread accounting, goals) and the CPU plots.

use super::super::plot::{self, Panel, Series};
use super::super::report::{Csv, OutDir, Report, Table};
use super::super::rounds::{self, Progress};
use super::super::runner::Job;
use super::super::stats::Summary;
use super::super::{BenchError, ProbeWait};
use super::scenarios::{Cell, GOALS, HogKind, Point, SCENARIOS, slowdown};
use super::threads::ROLES;

/// What a run collected.
pub(super) struct Run<'a> {
    pub(super) jobs: &'a [(&'static str, Job)],
    pub(super) cells: &'a [Cell],
    pub(super) progress: &'a [Progress],
    pub(super) target: f64,
    pub(super) probe_wait: ProbeWait,
    /// Whether the shares scenarios ran on the gate backend (the gate
    /// accounting has figures only then).
    pub(super) gate: bool,
}

/// Writes the CSVs and plots into `out` and the tables into `rep`.
pub(super) fn write(rep: &mut Report, out: &OutDir, r: &Run<'_>) -> Result<(), BenchError> {
    csvs(out, r.cells)?;
    let mut t = Table::new(&["victim job", "command line", "vCPUs"]);
    for (jname, job) in r.jobs {
        t.row(vec![
            jname.to_string(),
            format!("`{}`", job.cmdline),
            job.vcpus.to_string(),
        ]);
    }
    rep.table(&t);
    slowdowns(rep, r);
    let restarts: u64 = r.cells.iter().map(|c| c.hog_restarts).sum();
    rep.para(&format!(
        "The I/O hog was restarted {restarts} time(s) in all (each restart is a new VM: boot, \
         read, power-off). A vCPU thread that waits on the gate or on the throttle uses no CPU. \
         The probe's disk jobs ran with `probe.wait={}`: {}",
        r.probe_wait.param(),
        match r.probe_wait {
            ProbeWait::Irq => {
                "a wait sleeps in `hlt` until the used-ring interrupt, so a throttled I/O \
                 guest leaves its vCPU idle."
            }
            ProbeWait::Poll => {
                "the driver spins on its used ring, so a throttled I/O guest burns its \
                 vCPU (the behaviour before session 4)."
            }
        }
    ));
    accounting(rep, r);
    if r.gate {
        gate_accounting(rep, r);
    }
    goals(rep, r);
    plots(rep, out, r)?;
    rep.para(
        "Raw samples: `samples.csv` (one row per victim run, with the threads' schedstat), \
         `timeline.csv` (CPU used and entitled every 50 ms).",
    );
    Ok(())
}

fn csvs(out: &OutDir, cells: &[Cell]) -> Result<(), BenchError> {
    let mut header: Vec<String> = [
        "round",
        "victim_job",
        "scenario",
        "total_s",
        "guest_s",
        "victim_cpu_s",
        "hog_cpu_s",
        "hog_restarts",
        "cell_s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for role in ROLES {
        let r = role.replace(' ', "_").replace("vCPU", "vcpu");
        header.extend([
            format!("{r}_run_s"),
            format!("{r}_wait_s"),
            format!("{r}_slices"),
        ]);
    }
    header.extend(GATE_COLUMNS.iter().map(|s| s.to_string()));
    let h: Vec<&str> = header.iter().map(String::as_str).collect();
    let mut csv = Csv::new(&h);
    let mut tl = Csv::new(&[
        "round",
        "victim_job",
        "scenario",
        "t_s",
        "victim_cpu_pct",
        "hog_cpu_pct",
        "victim_entitlement_pct",
        "hog_entitlement_pct",
        "available_pct",
        "outside_pct",
        "victim_parked",
        "victim_demand_pct",
        "hog_demand_pct",
    ]);
    for c in cells {
        let mut row = vec![
            c.round.to_string(),
            c.job.into(),
            c.scn.key.into(),
            format!("{:.6}", c.total_s),
            c.guest_s.map(|g| format!("{g:.6}")).unwrap_or_default(),
            format!("{:.6}", c.victim_cpu_s),
            format!("{:.6}", c.hog_cpu_s),
            c.hog_restarts.to_string(),
            format!("{:.3}", c.secs),
        ];
        for t in &c.threads {
            row.extend([
                format!("{:.6}", t.run_ns as f64 / 1e9),
                format!("{:.6}", t.wait_ns as f64 / 1e9),
                t.slices.to_string(),
            ]);
        }
        let g = &c.gate;
        row.extend([
            format!("{:.3}", g.victim_parked_s),
            g.victim_parks.to_string(),
            format!("{:.3}", g.hog_parked_s),
            g.hog_parks.to_string(),
            format!("{:.1}", g.available_pct),
            format!("{:.1}", g.outside_pct),
            format!("{:.1}", g.victim_demand_pct),
            format!("{:.1}", g.hog_demand_pct),
        ]);
        csv.push(row);
        for p in &c.timeline {
            let opt = |v: Option<f64>| v.map(|v| format!("{v:.1}")).unwrap_or_default();
            let g = |f: fn(&super::gatelog::GateSample) -> f64| {
                opt(p.gate.as_ref().filter(|_| c.scn.gate).map(f))
            };
            tl.push(vec![
                c.round.to_string(),
                c.job.into(),
                c.scn.key.into(),
                format!("{:.3}", p.t),
                format!("{:.1}", p.victim),
                format!("{:.1}", p.hog),
                opt(p.victim_ent),
                opt(p.hog_ent),
                g(|g| g.available_pct),
                g(|g| g.outside_pct),
                g(|g| f64::from(u8::from(g.victim_parked))),
                g(|g| g.victim_demand_pct),
                g(|g| g.hog_demand_pct),
            ]);
        }
    }
    out.write("samples.csv", csv.text().as_bytes())?;
    out.write("timeline.csv", tl.text().as_bytes())?;
    Ok(())
}

fn of<'a>(cells: &'a [Cell], job: &str, key: &str) -> Vec<&'a Cell> {
    cells
        .iter()
        .filter(|c| c.job == job && c.scn.key == key)
        .collect()
}

fn slowdowns(rep: &mut Report, r: &Run<'_>) {
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
    for (jname, _) in r.jobs {
        let alone = Summary::of(
            &of(r.cells, jname, "alone")
                .iter()
                .map(|c| c.total_s)
                .collect::<Vec<_>>(),
        );
        for scn in SCENARIOS {
            let cs = of(r.cells, jname, scn.key);
            let Some(s) = Summary::of(&cs.iter().map(|c| c.total_s).collect::<Vec<_>>()) else {
                continue;
            };
            let guest: Vec<f64> = cs.iter().filter_map(|c| c.guest_s).collect();
            let wall: f64 = cs.iter().map(|c| c.total_s).sum();
            let vcpu: f64 = cs.iter().map(|c| c.victim_cpu_s).sum();
            let hcpu: f64 = cs.iter().map(|c| c.hog_cpu_s).sum();
            let ci = slowdown(r.cells, jname, scn.key);
            t.row(vec![
                jname.to_string(),
                scn.what.to_string(),
                s.n.to_string(),
                format!("{:.3}", s.min),
                format!("{:.3}", s.avg),
                format!("{:.3}", s.max),
                format!("{:.3}", s.sdev),
                format!("{:.1}%", s.spread() * 100.0),
                match (&alone, ci) {
                    (_, Some(r)) if scn.key != "alone" => {
                        format!("{:.3}x", 1.0 + r.mean_pct / 100.0)
                    }
                    (Some(al), None) if scn.key != "alone" => format!("{:.2}x", s.avg / al.avg),
                    _ => "1.00x (base)".into(),
                },
                match ci {
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
}

/// The gate's columns of `samples.csv`.
const GATE_COLUMNS: [&str; 8] = [
    "victim_parked_s",
    "victim_parks",
    "hog_parked_s",
    "hog_parks",
    "available_pct",
    "outside_pct",
    "victim_demand_pct",
    "hog_demand_pct",
];

/// Per gate scenario: the mean per victim run of the time the policy kept
/// each VM parked, how often, the capacity it planned with and the demand
/// it counted each VM as.
fn gate_accounting(rep: &mut Report, r: &Run<'_>) {
    rep.h2("Gate accounting");
    rep.para(
        "Mean per victim run, from the scheduler's statistics every 50 ms (gate scenarios): \
         seconds parked and parks of the victim and of the hog, the capacity the policy \
         planned with (nominal less steal and the measured outside load), the outside load, \
         and the demand it counted each VM as (what admission adds up).",
    );
    let mut t = Table::new(&[
        "victim job",
        "scenario",
        "victim parked s / parks",
        "hog parked s / parks",
        "planned capacity %",
        "outside %",
        "victim demand %",
        "hog demand %",
    ]);
    for (jname, _) in r.jobs {
        for scn in SCENARIOS.iter().filter(|s| s.gate) {
            let cs = of(r.cells, jname, scn.key);
            if cs.is_empty() {
                continue;
            }
            let n = cs.len() as f64;
            let mean = |f: fn(&super::gatelog::GateTotals) -> f64| {
                cs.iter().map(|c| f(&c.gate)).sum::<f64>() / n
            };
            t.row(vec![
                jname.to_string(),
                scn.key.to_string(),
                format!(
                    "{:.2} / {:.0}",
                    mean(|g| g.victim_parked_s),
                    mean(|g| g.victim_parks as f64)
                ),
                if scn.hog == HogKind::None {
                    "-".into()
                } else {
                    format!(
                        "{:.2} / {:.0}",
                        mean(|g| g.hog_parked_s),
                        mean(|g| g.hog_parks as f64)
                    )
                },
                format!("{:.1}", mean(|g| g.available_pct)),
                format!("{:.1}", mean(|g| g.outside_pct)),
                format!("{:.1}", mean(|g| g.victim_demand_pct)),
                if scn.hog == HogKind::None {
                    "-".into()
                } else {
                    format!("{:.1}", mean(|g| g.hog_demand_pct))
                },
            ]);
        }
    }
    rep.table(&t);
}

/// Per scenario: the mean per victim run of each thread kind's run and
/// run-queue wait seconds, and how often the device threads got a CPU.
fn accounting(rep: &mut Report, r: &Run<'_>) {
    rep.h2("Per-thread accounting");
    rep.para(
        "Mean per victim run, from `/proc/self/task/TID/schedstat` of each thread between the \
         victim's creation and its `PROBE-DONE`: seconds on a CPU / seconds runnable but \
         waiting for one (a thread parked by the gate or asleep waits for nothing). Wait \
         times hold on a loaded host where wall-clock figures do not. **on-CPU /s** = times \
         the thread was scheduled in per second of the victim's run (a device thread's \
         wake-ups).",
    );
    let mut header = vec!["victim job", "scenario"];
    header.extend(ROLES.iter().map(|r| match *r {
        "victim vCPU" => "victim vCPU run / wait s",
        "victim device" => "victim device run / wait s",
        "hog vCPU" => "hog vCPU run / wait s",
        "hog device" => "hog device run / wait s",
        _ => "scheduler run / wait s",
    }));
    header.extend(["victim device on-CPU /s", "hog device on-CPU /s"]);
    let mut t = Table::new(&header);
    for (jname, _) in r.jobs {
        for scn in SCENARIOS {
            let cs = of(r.cells, jname, scn.key);
            if cs.is_empty() {
                continue;
            }
            let n = cs.len() as f64;
            let wall: f64 = cs.iter().map(|c| c.total_s).sum();
            let sum = |i: usize, f: fn(&super::threads::Sched) -> u64| -> f64 {
                cs.iter().map(|c| f(&c.threads[i]) as f64).sum::<f64>()
            };
            let mut row = vec![jname.to_string(), scn.key.to_string()];
            for i in 0..ROLES.len() {
                row.push(format!(
                    "{:.2} / {:.2}",
                    sum(i, |s| s.run_ns) / 1e9 / n,
                    sum(i, |s| s.wait_ns) / 1e9 / n
                ));
            }
            for i in [1, 3] {
                row.push(if i == 3 && scn.hog == HogKind::None {
                    "-".into()
                } else {
                    format!("{:.0}", sum(i, |s| s.slices) / wall.max(1e-9))
                });
            }
            t.row(row);
        }
    }
    rep.table(&t);
}

fn goals(rep: &mut Report, r: &Run<'_>) {
    rep.h2("Goals");
    let mut t = Table::new(&[
        "victim job",
        "scenario",
        "goal",
        "rounds",
        "verdict",
        "rounds still needed",
    ]);
    for ((jname, _), p) in r.jobs.iter().zip(r.progress) {
        if p.rounds == 0 {
            // A victim not asked for (`--victims`).
            continue;
        }
        for (key, limit) in GOALS {
            let Some(scn) = SCENARIOS.iter().find(|s| s.key == key) else {
                continue;
            };
            let ci = slowdown(r.cells, jname, key);
            t.row(vec![
                jname.to_string(),
                scn.what.to_string(),
                format!("≤ {limit:.2}×, 95 % interval ±{} %", r.target),
                p.rounds.to_string(),
                ci.map_or_else(
                    || "no interval (fewer than 2 rounds)".into(),
                    |c| c.goal_verdict(limit, r.target),
                ),
                ci.and_then(|c| rounds::more_rounds(&c, r.target, p.round_secs))
                    .map_or_else(
                        || "-".into(),
                        |(more, min)| {
                            format!(
                                "~{more} more for ±{} % at this spread (~{min:.0} min)",
                                r.target
                            )
                        },
                    ),
            ]);
        }
    }
    rep.table(&t);
}

/// CPU share over time, one figure per victim job, the first round.
fn plots(rep: &mut Report, out: &OutDir, r: &Run<'_>) -> Result<(), BenchError> {
    rep.h2("CPU use over time (round 1)");
    for (jname, _) in r.jobs {
        let panels: Vec<Panel> = r
            .cells
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
    Ok(())
}
