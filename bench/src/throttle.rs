//! `corral bench throttle`: achieved versus configured I/O rate over a grid
//! of limits and burst sizes (probe virtio-blk reads), and the cost of
//! limits that are never hit (100x above need versus none, interleaved).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use corral_vmm::manager::{CpuBackend, Limits};

use super::plot::{self, Panel, Series};
use super::report::{Csv, OutDir, Report, SUMMARY_HEADER, Table, summary_cells};
use super::runner::{self, Job, JobResult, Scratch};
use super::stats::{Summary, diff_pct};
use super::{BenchError, Sizes, ThrottleArgs};

const MIB: f64 = 1048576.0;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    Bps,
    Iops,
}

#[derive(Debug, Clone, Copy)]
struct Point {
    unit: Unit,
    /// Configured rate (bytes/s or ops/s).
    rate: u64,
    /// Bucket size (bytes or ops).
    burst: u64,
    burst_name: &'static str,
    /// Request size.
    bs: u64,
    /// Bytes the guest reads.
    size: u64,
}

/// A figure of a run.
type Metric = fn(&JobResult) -> Option<f64>;

struct Measured {
    p: Point,
    r: JobResult,
    /// Units (bytes or ops) the guest moved.
    units: f64,
    /// Guest seconds from first submit to last completion.
    secs: f64,
}

impl Measured {
    fn raw(&self) -> f64 {
        self.units / self.secs
    }
    /// The rate after the initial burst: the bucket starts full, so by time
    /// T a backlogged reader gets burst + rate * T units.
    fn steady(&self) -> f64 {
        (self.units - self.p.burst as f64).max(0.0) / self.secs
    }
    fn scale(&self) -> f64 {
        match self.p.unit {
            Unit::Bps => MIB,
            Unit::Iops => 1.0,
        }
    }
}

/// Runs it; returns the output directory and the report.
pub fn run(a: ThrottleArgs, builtin: &Arc<[u8]>) -> Result<(PathBuf, String), BenchError> {
    let quick = a.common.quick;
    let pairs = a.pairs.unwrap_or(if quick { 2 } else { 6 }).max(1);
    let out = OutDir::create(a.common.out.as_deref(), "throttle")?;
    let scratch = Scratch::new("throttle")?;
    let sz = Sizes::new(quick);
    let timeout = Duration::from_secs(if quick { 60 } else { 600 });
    // Steady-state seconds each grid point should take after its burst.
    let steady_s: f64 = if quick { 0.5 } else { 3.0 };
    let (bps_rates, iops_rates): (&[u64], &[u64]) = if quick {
        (&[10], &[500])
    } else {
        (&[5, 10, 20], &[200, 500, 1000])
    };
    let bursts: [(&str, f64); 2] = [("small (0.1 s)", 0.1), ("large (2 s)", 2.0)];

    let mut grid = Vec::new();
    for &m in bps_rates {
        let rate = m << 20;
        let bs = 64 << 10;
        for (bname, bsecs) in bursts {
            let burst = ((rate as f64 * bsecs) as u64).max(bs);
            let size = round_up((rate as f64 * steady_s) as u64 + burst, bs);
            grid.push(Point {
                unit: Unit::Bps,
                rate,
                burst,
                burst_name: bname,
                bs,
                size,
            });
        }
    }
    for &rate in iops_rates {
        let bs = 4096;
        for (bname, bsecs) in bursts {
            let burst = ((rate as f64 * bsecs) as u64).max(1);
            let size = ((rate as f64 * steady_s) as u64 + burst) * bs;
            grid.push(Point {
                unit: Unit::Iops,
                rate,
                burst,
                burst_name: bname,
                bs,
                size,
            });
        }
    }
    let grid_disk_bytes = round_up(
        grid.iter().map(|p| p.size).max().unwrap_or(1 << 20),
        1 << 20,
    );
    let grid_disk = scratch.sparse("grid.img", grid_disk_bytes)?;
    let disk = scratch.filled("disk0.img", sz.disk_bytes)?;
    let mgr = runner::new_manager(CpuBackend::None, builtin, &[])?;

    let steps = grid.len() as u64 + 1 + 2 * u64::from(pairs);
    let pb = super::progress(steps);
    let mut measured = Vec::new();
    for (i, p) in grid.iter().enumerate() {
        pb.set_message(format!(
            "{} {} {}",
            match p.unit {
                Unit::Bps => format!("bps {} MiB/s", p.rate >> 20),
                Unit::Iops => format!("iops {}", p.rate),
            },
            "burst",
            p.burst_name
        ));
        let limits = match p.unit {
            Unit::Bps => Limits {
                bps: Some(p.rate),
                burst_bytes: Some(p.burst),
                ..Default::default()
            },
            Unit::Iops => Limits {
                iops: Some(p.rate),
                burst_ops: Some(p.burst),
                ..Default::default()
            },
        };
        let job = Job::blk_read(&grid_disk, limits, p.size, p.bs, 4);
        let r = runner::run_job(&mgr, &format!("grid-{i}"), "default", &job, timeout)?;
        let secs = r
            .guest_s
            .ok_or_else(|| BenchError(format!("no us= in {:?}", r.result)))?;
        let units = match p.unit {
            Unit::Bps => r.num("bytes").unwrap_or(0.0),
            Unit::Iops => r.num("requests").unwrap_or(0.0),
        };
        measured.push(Measured {
            p: *p,
            r,
            units,
            secs: secs.max(1e-6),
        });
        pb.inc(1);
    }

    // Limits never hit: 100x what the job reaches unthrottled, against none.
    pb.set_message("calibrating the never-hit limits");
    let io_job = Job::blk_read(&disk, Limits::default(), sz.io_bytes, sz.io_bs, 4);
    let cal = runner::run_job(&mgr, "cal", "default", &io_job, timeout)?;
    pb.inc(1);
    let csecs = cal.guest_s.unwrap_or(cal.wall_s).max(1e-6);
    let big = Limits {
        bps: Some(((cal.num("bytes").unwrap_or(0.0) / csecs * 100.0) as u64).max(1 << 20)),
        iops: Some(((cal.num("requests").unwrap_or(0.0) / csecs * 100.0) as u64).max(100)),
        ..Default::default()
    };
    let mut pair_samples: Vec<(&'static str, u32, JobResult)> = Vec::new();
    for i in 1..=pairs {
        for (key, limits) in [("none", Limits::default()), ("100x", big)] {
            pb.set_message(format!("never-hit limits: pair {i}/{pairs}, {key}"));
            let r = runner::run_job(
                &mgr,
                &format!("pair-{i}-{}", if key == "none" { "a" } else { "b" }),
                "default",
                &io_job.clone().with_limits(limits),
                timeout,
            )?;
            pair_samples.push((key, i, r));
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    mgr.shutdown();

    // Raw samples.
    let mut csv = Csv::new(&[
        "kind",
        "configured",
        "burst",
        "bs",
        "bytes",
        "requests",
        "guest_s",
        "total_s",
        "achieved_raw",
        "achieved_steady",
        "result",
    ]);
    for m in &measured {
        csv.push(vec![
            kind_name(m.p.unit).into(),
            m.p.rate.to_string(),
            m.p.burst.to_string(),
            m.p.bs.to_string(),
            m.r.num("bytes").unwrap_or(0.0).to_string(),
            m.r.num("requests").unwrap_or(0.0).to_string(),
            format!("{:.6}", m.secs),
            format!("{:.6}", m.r.wall_s),
            format!("{:.3}", m.raw()),
            format!("{:.3}", m.steady()),
            m.r.result.clone(),
        ]);
    }
    out.write("samples.csv", csv.text().as_bytes())?;
    let mut pcsv = Csv::new(&[
        "limits",
        "pair",
        "total_s",
        "guest_s",
        "vm_cpu_s",
        "process_cpu_s",
        "result",
    ]);
    for (k, i, r) in &pair_samples {
        pcsv.push(vec![
            k.to_string(),
            i.to_string(),
            format!("{:.6}", r.wall_s),
            r.guest_s.map(|g| format!("{g:.6}")).unwrap_or_default(),
            format!("{:.6}", r.vm_cpu_s),
            format!("{:.6}", r.proc_cpu_s),
            r.result.clone(),
        ]);
    }
    out.write("never-hit.csv", pcsv.text().as_bytes())?;

    // Report.
    let mut rep = Report::new("corral bench throttle");
    rep.line(&super::host_lines(quick));
    rep.para(&format!(
        "Method: one probe guest per grid point reads a sparse disk file through virtio-blk \
         (4 requests in flight; 64 KiB requests under a bps limit, 4 KiB under an iops \
         limit), about {steady_s} s of data at the configured rate plus the burst. \
         **raw** = units moved / guest time (first submit to last completion), which counts \
         the initial burst: the token bucket starts full. **steady** = (units − burst) / guest \
         time: the rate after the burst, which is what the limit promises. The ratio column \
         is steady / configured."
    ));
    rep.h2("Achieved versus configured rate");
    let mut t = Table::new(&[
        "limit",
        "configured",
        "burst",
        "moved",
        "guest s",
        "raw",
        "steady",
        "steady / configured",
    ]);
    for m in &measured {
        let (unit, moved) = match m.p.unit {
            Unit::Bps => ("MiB/s", format!("{:.1} MiB", m.units / MIB)),
            Unit::Iops => ("IOPS", format!("{:.0} ops", m.units)),
        };
        let burst = match m.p.unit {
            Unit::Bps => format!("{} = {:.1} MiB", m.p.burst_name, m.p.burst as f64 / MIB),
            Unit::Iops => format!("{} = {} ops", m.p.burst_name, m.p.burst),
        };
        t.row(vec![
            kind_name(m.p.unit).into(),
            format!("{:.1} {unit}", m.p.rate as f64 / m.scale()),
            burst,
            moved,
            format!("{:.3}", m.secs),
            format!("{:.2} {unit}", m.raw() / m.scale()),
            format!("{:.2} {unit}", m.steady() / m.scale()),
            format!("{:.4}", m.steady() / m.p.rate as f64),
        ]);
    }
    rep.table(&t);

    rep.h2("Limits never hit");
    rep.para(&format!(
        "The I/O job `{}` on a {} MiB filled file, {pairs} interleaved pairs: no limit, then \
         bps={} iops={} (100x what a calibration run reached). Same manager (CPU backend \
         none) for both.",
        io_job.cmdline,
        sz.disk_bytes >> 20,
        big.bps.unwrap_or(0),
        big.iops.unwrap_or(0)
    ));
    let metrics: [(&str, Metric); 3] = [
        ("total seconds (host wall, create → PROBE-DONE)", |r| {
            Some(r.wall_s)
        }),
        ("guest seconds (guest-measured I/O time)", |r| r.guest_s),
        ("process CPU seconds (all of corral's threads)", |r| {
            Some(r.proc_cpu_s)
        }),
    ];
    for (mname, f) in metrics {
        rep.line(&format!("### {mname}"));
        rep.blank();
        let mut header = vec!["limits"];
        header.extend(SUMMARY_HEADER);
        let mut t = Table::new(&header);
        let sum = |k: &str| {
            Summary::of(
                &pair_samples
                    .iter()
                    .filter(|(kk, _, _)| *kk == k)
                    .filter_map(|(_, _, r)| f(r))
                    .collect::<Vec<_>>(),
            )
        };
        let base = sum("none");
        for k in ["none", "100x"] {
            if let Some(s) = sum(k) {
                let mut row = vec![k.to_string()];
                row.extend(summary_cells(
                    &s,
                    if k == "none" { None } else { base.as_ref() },
                ));
                t.row(row);
            }
        }
        rep.table(&t);
        if let (Some(b), Some(s)) = (base, sum("100x")) {
            rep.para(&format!(
                "Difference of the averages: {:+.2}% (spread of the runs without limits: {:.1}%).",
                diff_pct(s.avg, b.avg),
                b.spread() * 100.0
            ));
        }
    }

    // Plot: achieved vs configured, one panel per limit kind.
    let mut panels = Vec::new();
    for unit in [Unit::Bps, Unit::Iops] {
        let ms: Vec<&Measured> = measured.iter().filter(|m| m.p.unit == unit).collect();
        if ms.is_empty() {
            continue;
        }
        let scale = ms[0].scale();
        let xs: Vec<f64> = ms.iter().map(|m| m.p.rate as f64 / scale).collect();
        let mut series = vec![
            Series::line(
                "configured",
                [0.0, xs.iter().copied().fold(0.0, f64::max) * 1.05]
                    .iter()
                    .map(|&x| (x, x))
                    .collect(),
            )
            .colored(plotters::style::RGBColor(0x60, 0x60, 0x60)),
        ];
        for (bname, _) in bursts {
            let pts = |f: fn(&Measured) -> f64| -> Vec<(f64, f64)> {
                ms.iter()
                    .filter(|m| m.p.burst_name == bname)
                    .map(|m| (m.p.rate as f64 / scale, f(m) / scale))
                    .collect()
            };
            series.push(Series::marked(
                format!("steady, burst {bname}"),
                pts(Measured::steady),
            ));
            series.push(Series::marked(
                format!("raw, burst {bname}"),
                pts(Measured::raw),
            ));
        }
        let u = if unit == Unit::Bps { "MiB/s" } else { "IOPS" };
        panels.push(Panel {
            legend_left: true,
            ..Panel::new(
                format!("{} limit: achieved vs configured", kind_name(unit)),
                format!("configured, {u}"),
                format!("achieved, {u}"),
                series,
            )
        });
    }
    plot::draw(
        &out.join("throttle.png"),
        "corral bench throttle",
        &panels,
        2,
    )?;
    rep.h2("Plot");
    rep.para("![achieved vs configured](throttle.png)");
    rep.para("Raw samples: `samples.csv` (grid), `never-hit.csv` (pairs).");
    out.write("report.md", rep.text().as_bytes())?;
    Ok((out.path.clone(), rep.text().to_string()))
}

fn kind_name(u: Unit) -> &'static str {
    match u {
        Unit::Bps => "bps",
        Unit::Iops => "iops",
    }
}

fn round_up(x: u64, m: u64) -> u64 {
    x.div_ceil(m) * m
}
