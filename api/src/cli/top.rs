//! `corral top`: per-VM and per-class CPU and disk figures over an
//! interval, from two snapshots of the API, with a legend of units.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::{Duration, Instant};

use super::CliError;
use super::table::{num1, opt, pct, rate, table};
use crate::client::Client;
use crate::dto;

/// Options of `corral top`.
#[derive(clap::Args, Debug, Clone)]
pub struct TopArgs {
    /// Print one sample and exit.
    #[arg(long)]
    pub once: bool,
    /// Seconds between samples.
    #[arg(long, default_value_t = 1.0)]
    pub interval: f64,
}

/// How `corral top` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopEnd {
    /// `--once` printed its sample.
    Done,
    /// Ctrl-C (the command exits 130, as after SIGINT).
    Interrupted,
}

/// One sample of the figures `top` shows.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TopSample {
    /// Seconds between the two snapshots.
    pub interval_seconds: f64,
    /// Per VM.
    pub vms: Vec<TopVm>,
    /// Per class.
    pub classes: Vec<TopClass>,
}

/// A VM's line in `top`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TopVm {
    pub name: String,
    pub class: String,
    pub state: String,
    pub vcpus: u32,
    /// CPU used over the interval, percent of one host CPU.
    pub cpu_pct: f64,
    /// Its part of all CPU used by VMs, percent.
    pub share_pct: f64,
    /// Entitlement, percent of one host CPU.
    pub entitlement_pct: Option<f64>,
    pub parked: Option<bool>,
    pub cpu_seconds: f64,
    /// Bytes read per second over the interval, all disks.
    pub read_bytes_per_second: f64,
    /// Bytes written per second over the interval, all disks.
    pub write_bytes_per_second: f64,
    /// Milliseconds its disk requests waited for tokens, per second.
    pub throttled_ms_per_second: f64,
}

/// A class's line in `top`. Classes come in tree order (each class
/// followed by its children); the figures of a class include its
/// descendants' VMs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TopClass {
    pub name: String,
    /// Its parent class, `None` at the top of the tree.
    pub parent: Option<String>,
    /// Levels below the top (0 for a root class).
    pub depth: usize,
    pub shares: u32,
    /// VMs in the class and its descendants.
    pub vms: usize,
    /// CPU used over the interval by the class and its descendants,
    /// percent of one host CPU.
    pub cpu_pct: f64,
    /// Its part of all CPU used by VMs, percent.
    pub share_pct: f64,
    /// Part of the VMs' CPU the shares promise, percent: the parent's part
    /// (all of it at the top) divided by shares among the sibling classes
    /// with running VMs in their subtree.
    pub expected_pct: f64,
    /// Entitlement, percent of one host CPU.
    pub entitlement_pct: Option<f64>,
}

/// A VM's disk totals: (read bytes, written bytes, throttled seconds).
fn io_totals(v: &dto::Vm) -> (u64, u64, f64) {
    v.disks
        .iter()
        .filter_map(|d| d.stats.as_ref())
        .fold((0, 0, 0.0), |(r, w, t), s| {
            (r + s.read_bytes, w + s.write_bytes, t + s.throttled_seconds)
        })
}

/// Computes a `top` sample from two VM snapshots.
pub fn top_sample(
    before: &[dto::Vm],
    after: &[dto::Vm],
    classes: &[dto::Class],
    dt: f64,
) -> TopSample {
    let prev: BTreeMap<&str, (f64, (u64, u64, f64))> = before
        .iter()
        .map(|v| (v.name.as_str(), (v.cpu_seconds, io_totals(v))))
        .collect();
    let per_s = |d: f64| if dt > 0.0 { (d / dt).max(0.0) } else { 0.0 };
    let mut vms: Vec<TopVm> = after
        .iter()
        .map(|v| {
            let io = io_totals(v);
            let (cpu0, io0) = prev
                .get(v.name.as_str())
                .copied()
                .unwrap_or((v.cpu_seconds, io));
            TopVm {
                name: v.name.clone(),
                class: v.class.clone(),
                state: v.state.clone(),
                vcpus: v.vcpus,
                cpu_pct: per_s(v.cpu_seconds - cpu0) * 100.0,
                share_pct: 0.0,
                entitlement_pct: v.sched.as_ref().map(|s| s.entitlement_pct),
                parked: v.sched.as_ref().map(|s| s.parked),
                cpu_seconds: v.cpu_seconds,
                read_bytes_per_second: per_s(io.0.saturating_sub(io0.0) as f64),
                write_bytes_per_second: per_s(io.1.saturating_sub(io0.1) as f64),
                throttled_ms_per_second: per_s(io.2 - io0.2) * 1000.0,
            }
        })
        .collect();
    let total: f64 = vms.iter().map(|v| v.cpu_pct).sum();
    let part = |x: f64| if total > 0.0 { x / total * 100.0 } else { 0.0 };
    for v in &mut vms {
        v.share_pct = part(v.cpu_pct);
    }
    let classes = class_rows(classes, &vms, part);
    TopSample {
        interval_seconds: dt,
        vms,
        classes,
    }
}

/// The class rows in tree order (depth first, siblings in the API's
/// order). A class whose parent is not in `classes` (the demo shows a
/// subset) is a root.
fn class_rows(classes: &[dto::Class], vms: &[TopVm], part: impl Fn(f64) -> f64) -> Vec<TopClass> {
    let n = classes.len();
    let idx = |name: &str| classes.iter().position(|c| c.name == name);
    let parent: Vec<Option<usize>> = classes
        .iter()
        .map(|c| c.parent.as_deref().and_then(idx))
        .collect();
    // Whether class `i` is `a` or below it (bounded: the model limits the
    // depth; the bound only stops a corrupt cycle).
    let within = |mut i: usize, a: usize| {
        for _ in 0..=n {
            if i == a {
                return true;
            }
            match parent.get(i).copied().flatten() {
                Some(p) => i = p,
                None => return false,
            }
        }
        false
    };
    let vm_class: Vec<Option<usize>> = vms.iter().map(|v| idx(&v.class)).collect();
    let subtree = |a: usize| {
        vms.iter()
            .zip(&vm_class)
            .filter(move |(_, c)| c.is_some_and(|c| within(c, a)))
            .map(|(v, _)| v)
    };
    let active: Vec<bool> = (0..n)
        .map(|a| subtree(a).any(|v| v.state == "running"))
        .collect();
    // The children of `p` with the part each is promised of `portion`.
    let children = |p: Option<usize>, portion: f64| -> Vec<(usize, f64)> {
        let kids: Vec<usize> = (0..n).filter(|&i| parent[i] == p).collect();
        let active_shares: u32 = kids
            .iter()
            .filter(|&&i| active[i])
            .map(|&i| classes[i].shares)
            .sum();
        kids.into_iter()
            .map(|i| {
                let e = if active[i] && active_shares > 0 {
                    portion * f64::from(classes[i].shares) / f64::from(active_shares)
                } else {
                    0.0
                };
                (i, e)
            })
            .collect()
    };
    let mut rows = Vec::with_capacity(n);
    let mut stack: Vec<(usize, usize, f64)> = children(None, 100.0)
        .into_iter()
        .rev()
        .map(|(i, e)| (i, 0, e))
        .collect();
    while let Some((i, depth, expected)) = stack.pop() {
        let c = &classes[i];
        let cpu: f64 = subtree(i).map(|v| v.cpu_pct).sum();
        rows.push(TopClass {
            name: c.name.clone(),
            parent: parent[i].map(|p| classes[p].name.clone()),
            depth,
            shares: c.shares,
            vms: subtree(i).count(),
            cpu_pct: cpu,
            share_pct: part(cpu),
            expected_pct: expected,
            entitlement_pct: c.entitlement_pct,
        });
        if depth < n {
            stack.extend(
                children(Some(i), expected)
                    .into_iter()
                    .rev()
                    .map(|(k, e)| (k, depth + 1, e)),
            );
        }
    }
    rows
}

/// A class's CLASS cell: its name, two spaces in per level.
fn class_cell(c: &TopClass) -> String {
    format!("{:indent$}{}", "", c.name, indent = 2 * c.depth)
}

/// What the columns mean, printed under the tables.
pub const LEGEND: &str = "\
CPU%, ENT%   percent of one host CPU (100 = one CPU, 200 = two): used over the
             interval, and what the scheduler entitles it to (- = no scheduler)
PART%        its part of all the CPU the VMs used over the interval
PROMISED%    the part its class's shares promise: its parent's part divided by
             shares among the sibling classes with running VMs
CLASS        children are indented under their parent; a class's figures
             include its descendants'
READ, WRITE  disk bytes per second over the interval, all of the VM's disks
THROTTLED    time its disk requests waited for tokens, ms per second
             (more than 1000 when several requests wait at once)
CPU_S        CPU seconds used since the VM started";

/// Prints a `top` sample as tables and the legend.
pub fn print_top(s: &TopSample) {
    table(
        &[
            "VM",
            "CLASS",
            "STATE",
            "VCPUS",
            "CPU%",
            "ENT%",
            "PART%",
            "PARKED",
            "READ",
            "WRITE",
            "THROTTLED",
            "CPU_S",
        ],
        &s.vms
            .iter()
            .map(|v| {
                vec![
                    v.name.clone(),
                    v.class.clone(),
                    v.state.clone(),
                    v.vcpus.to_string(),
                    num1(v.cpu_pct),
                    pct(v.entitlement_pct),
                    num1(v.share_pct),
                    opt(v.parked),
                    rate(v.read_bytes_per_second),
                    rate(v.write_bytes_per_second),
                    format!("{} ms/s", num1(v.throttled_ms_per_second)),
                    format!("{:.2}", v.cpu_seconds),
                ]
            })
            .collect::<Vec<_>>(),
    );
    println!();
    table(
        &[
            "CLASS",
            "SHARES",
            "VMS",
            "CPU%",
            "ENT%",
            "PART%",
            "PROMISED%",
        ],
        &s.classes
            .iter()
            .map(|c| {
                vec![
                    class_cell(c),
                    c.shares.to_string(),
                    c.vms.to_string(),
                    num1(c.cpu_pct),
                    pct(c.entitlement_pct),
                    num1(c.share_pct),
                    num1(c.expected_pct),
                ]
            })
            .collect::<Vec<_>>(),
    );
    println!("\n{LEGEND}");
}

/// Takes two snapshots `interval` apart.
pub async fn sample(c: &Client, interval: Duration) -> Result<TopSample, CliError> {
    let t0 = Instant::now();
    let before: Vec<dto::Vm> = c.get("/v1/vms").await?;
    tokio::time::sleep(interval.saturating_sub(t0.elapsed())).await;
    let t1 = Instant::now();
    let after: Vec<dto::Vm> = c.get("/v1/vms").await?;
    let classes: Vec<dto::Class> = c.get("/v1/classes").await?;
    Ok(top_sample(
        &before,
        &after,
        &classes,
        (t1 - t0).as_secs_f64(),
    ))
}

async fn run(c: &Client, once: bool, interval: Duration, json: bool) -> Result<(), CliError> {
    let mut before: Vec<dto::Vm> = c.get("/v1/vms").await?;
    let mut t0 = Instant::now();
    loop {
        tokio::time::sleep(interval).await;
        let after: Vec<dto::Vm> = c.get("/v1/vms").await?;
        let t1 = Instant::now();
        let classes: Vec<dto::Class> = c.get("/v1/classes").await?;
        let s = top_sample(&before, &after, &classes, (t1 - t0).as_secs_f64());
        if json {
            match serde_json::to_string(&s) {
                Ok(j) => println!("{j}"),
                Err(e) => return Err(CliError(e.to_string())),
            }
        } else {
            if !once {
                // Clear the screen and go home.
                print!("\x1b[2J\x1b[H");
                println!(
                    "corral top — {} — every {} s, Ctrl-C to quit\n",
                    c.target(),
                    num1(interval.as_secs_f64())
                );
            }
            print_top(&s);
        }
        let _ = std::io::stdout().flush();
        if once {
            return Ok(());
        }
        before = after;
        t0 = t1;
    }
}

/// `corral top`: samples until `--once` is done or Ctrl-C.
pub async fn top(c: &Client, a: TopArgs, json: bool) -> Result<TopEnd, CliError> {
    let interval = Duration::from_secs_f64(a.interval.clamp(0.1, 3600.0));
    tokio::select! {
        r = run(c, a.once, interval, json) => r.map(|()| TopEnd::Done),
        _ = tokio::signal::ctrl_c() => Ok(TopEnd::Interrupted),
    }
}

#[cfg(test)]
#[path = "top_tests.rs"]
mod tests;
