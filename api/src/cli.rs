//! The client commands: `corral vm|class|disk|top|status`.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::{Duration, Instant};

use clap::Subcommand;
use http_body_util::BodyExt;
use hyper::Method;

use crate::client::{Client, ClientError, seg};
use crate::dto;

/// `corral vm ...`.
#[derive(Subcommand, Debug)]
pub enum VmCmd {
    /// Create and start a VM (default guest: the built-in probe).
    Create {
        /// Name (default: assigned by the daemon).
        name: Option<String>,
        /// Class.
        #[arg(long)]
        class: Option<String>,
        /// Weight within the class (1..10000, default 100).
        #[arg(long)]
        weight: Option<u32>,
        /// vCPUs.
        #[arg(long)]
        vcpus: Option<u32>,
        /// Memory in MiB.
        #[arg(long)]
        memory: Option<u64>,
        /// Kernel file on the daemon's host.
        #[arg(long)]
        kernel: Option<String>,
        /// Initrd file on the daemon's host.
        #[arg(long)]
        initrd: Option<String>,
        /// Kernel command line (for the probe e.g. `probe.mode=spin probe.secs=30`).
        #[arg(long)]
        cmdline: Option<String>,
        /// A disk: `PATH[,readonly][,direct][,id=NAME][,bps=N,iops=N,...]`.
        #[arg(long)]
        disk: Vec<String>,
    },
    /// List VMs.
    #[command(alias = "ls")]
    List,
    /// Show one VM.
    Show {
        /// VM name.
        name: String,
    },
    /// Stop and delete VMs.
    #[command(alias = "delete")]
    Rm {
        /// VM names.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Pause a VM's vCPUs.
    Pause {
        /// VM name.
        name: String,
    },
    /// Resume a paused VM.
    Resume {
        /// VM name.
        name: String,
    },
    /// Move a VM to another class, live.
    Move {
        /// VM name.
        name: String,
        /// Target class.
        class: String,
        /// New weight within the class.
        #[arg(long)]
        weight: Option<u32>,
    },
    /// Print a VM's console output.
    Console {
        /// VM name.
        name: String,
        /// Only the last N lines.
        #[arg(long)]
        tail: Option<usize>,
        /// Keep printing new output until the VM stops (Ctrl-C to quit).
        #[arg(short, long)]
        follow: bool,
    },
}

/// `corral class ...`.
#[derive(Subcommand, Debug)]
pub enum ClassCmd {
    /// Create a class or change it (only the given settings change).
    Set {
        /// Class name.
        name: String,
        /// CPU shares (1..10000; default 100 for a new class).
        #[arg(long)]
        shares: Option<u32>,
        /// CPU cap in percent of one CPU, or `none`.
        #[arg(long)]
        cap: Option<String>,
        /// CPU reservation in percent of one CPU, or `none`.
        #[arg(long)]
        reservation: Option<String>,
        /// I/O group limits: `bps=N,iops=N,...` (empty = none).
        #[arg(long)]
        io: Option<String>,
    },
    /// List classes.
    #[command(alias = "ls")]
    List,
    /// Show one class.
    Show {
        /// Class name.
        name: String,
    },
    /// Delete an empty class.
    #[command(alias = "delete")]
    Rm {
        /// Class name.
        name: String,
    },
}

/// `corral disk ...`.
#[derive(Subcommand, Debug)]
pub enum DiskCmd {
    /// Change a disk's limits live: `corral disk limit VM DISK bps=10M iops=500`.
    Limit {
        /// VM name.
        vm: String,
        /// Disk id.
        disk: String,
        /// `key=value` limits (bps, iops, rbps, wbps, riops, wiops, burst_bytes, burst_ops); none = unlimited.
        limits: Vec<String>,
    },
}

/// Failure of a client command (message already formatted).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CliError(pub String);

impl From<ClientError> for CliError {
    fn from(e: ClientError) -> Self {
        CliError(e.to_string())
    }
}

type R = Result<(), CliError>;

fn print_json(v: &impl serde::Serialize) {
    match serde_json::to_string_pretty(v) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("corral: {e}"),
    }
}

/// Prints rows as an aligned table.
pub fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut w: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < w.len() {
                w[i] = w[i].max(c.chars().count());
            }
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<width$}  ", width = w[i]));
            }
        }
        println!("{}", s.trim_end());
    };
    line(header.iter().map(|h| h.to_string()).collect());
    for r in rows {
        line(r.clone());
    }
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or("-".into(), |v| v.to_string())
}

fn pct(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.1}"))
}

/// Parses a size with an optional K/M/G/T suffix (powers of 1024).
pub fn parse_size(key: &str, s: &str) -> Result<u64, CliError> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    if lower == "max" || lower == "unlimited" || lower == "none" {
        return Ok(0);
    }
    let digits = lower.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let suffix = &lower[digits.len()..];
    let mult: u64 = match suffix {
        "" | "b" => 1,
        "k" | "ki" | "kib" | "kb" => 1 << 10,
        "m" | "mi" | "mib" | "mb" => 1 << 20,
        "g" | "gi" | "gib" | "gb" => 1 << 30,
        "t" | "ti" | "tib" | "tb" => 1 << 40,
        _ => return Err(CliError(format!("{key}={s}: unknown suffix {suffix:?}"))),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|v| v.checked_mul(mult))
        .ok_or_else(|| CliError(format!("{key}={s}: not a number")))
}

/// Applies one `key=value` limit; `Ok(false)` if the key is not a limit key.
pub fn set_limit(l: &mut dto::Limits, key: &str, value: &str) -> Result<bool, CliError> {
    let v = Some(parse_size(key, value)?).filter(|v| *v != 0);
    let slot = match key {
        "bps" => &mut l.bps,
        "iops" => &mut l.iops,
        "rbps" => &mut l.rbps,
        "wbps" => &mut l.wbps,
        "riops" => &mut l.riops,
        "wiops" => &mut l.wiops,
        "burst_bytes" => &mut l.burst_bytes,
        "burst_ops" => &mut l.burst_ops,
        _ => return Ok(false),
    };
    *slot = v;
    Ok(true)
}

fn parse_limits<'a>(items: impl Iterator<Item = &'a str>) -> Result<dto::Limits, CliError> {
    let mut l = dto::Limits::default();
    for item in items.map(str::trim).filter(|i| !i.is_empty()) {
        let (k, v) = item
            .split_once('=')
            .ok_or_else(|| CliError(format!("expected key=value, got {item:?}")))?;
        if !set_limit(&mut l, k.trim(), v)? {
            return Err(CliError(format!(
                "unknown limit {k:?} (known: bps, iops, rbps, wbps, riops, wiops, burst_bytes, burst_ops)"
            )));
        }
    }
    Ok(l)
}

/// Parses `--disk PATH[,readonly][,direct][,id=..][,limits]`.
pub fn parse_disk(spec: &str) -> Result<dto::DiskCreate, CliError> {
    let mut d = dto::DiskCreate {
        id: None,
        path: String::new(),
        readonly: false,
        direct: false,
        limits: dto::Limits::default(),
    };
    for (i, item) in spec.split(',').map(str::trim).enumerate() {
        match item.split_once('=') {
            None if item == "readonly" || item == "ro" => d.readonly = true,
            None if item == "direct" => d.direct = true,
            None if i == 0 => d.path = item.to_string(),
            None => return Err(CliError(format!("--disk {spec}: unknown flag {item:?}"))),
            Some(("path", v)) => d.path = v.to_string(),
            Some(("id", v)) => d.id = Some(v.to_string()),
            Some((k, v)) => {
                if !set_limit(&mut d.limits, k, v)? {
                    return Err(CliError(format!("--disk {spec}: unknown key {k:?}")));
                }
            }
        }
    }
    if d.path.is_empty() {
        return Err(CliError(format!("--disk {spec}: no path")));
    }
    Ok(d)
}

fn vm_rows(vms: &[dto::Vm]) -> Vec<Vec<String>> {
    vms.iter()
        .map(|v| {
            vec![
                v.name.clone(),
                v.state.clone(),
                v.class.clone(),
                v.vcpus.to_string(),
                v.memory_mib.to_string(),
                format!("{:.2}", v.cpu_seconds),
                v.uptime_seconds.map_or("-".into(), |u| format!("{u:.1}s")),
                v.kernel.clone().unwrap_or_else(|| "probe".into()),
            ]
        })
        .collect()
}

fn show_vm(v: &dto::Vm) {
    println!("name:      {}", v.name);
    println!("id:        {}", v.id);
    println!("state:     {}", v.state);
    if let Some(e) = &v.exit {
        println!("exit:      {} ({})", e.reason, e.message);
    }
    println!("class:     {} (weight {})", v.class, v.weight);
    println!("vcpus:     {}", v.vcpus);
    println!("memory:    {} MiB", v.memory_mib);
    println!(
        "kernel:    {}",
        v.kernel.as_deref().unwrap_or("built-in probe")
    );
    if let Some(i) = &v.initrd {
        println!("initrd:    {i}");
    }
    println!("cmdline:   {}", v.cmdline);
    if let Some(u) = v.uptime_seconds {
        println!("uptime:    {u:.1} s");
    }
    println!("cpu:       {:.3} s", v.cpu_seconds);
    if let Some(s) = &v.sched {
        println!(
            "scheduler: entitled {:.1}%, used {:.1}%, parked {} ({:.2} s, {} times)",
            s.entitlement_pct, s.used_pct, s.parked, s.parked_seconds, s.park_count
        );
    }
    let exits: Vec<String> = v
        .exits
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, n)| format!("{k}={n}"))
        .collect();
    println!("exits:     {}", exits.join(" "));
    for d in &v.disks {
        println!(
            "disk {}:   {}{}{} limits {}",
            d.id,
            d.path,
            if d.readonly { " ro" } else { "" },
            if d.direct { " direct" } else { "" },
            serde_json::to_string(&d.limits).unwrap_or_default()
        );
    }
}

/// `corral vm ...`.
pub async fn vm(c: &Client, cmd: VmCmd, json: bool) -> R {
    match cmd {
        VmCmd::Create {
            name,
            class,
            weight,
            vcpus,
            memory,
            kernel,
            initrd,
            cmdline,
            disk,
        } => {
            let disks = disk
                .iter()
                .map(|d| parse_disk(d))
                .collect::<Result<Vec<_>, _>>()?;
            let body = dto::VmCreate {
                name,
                class,
                weight,
                vcpus,
                memory_mib: memory,
                kernel,
                initrd,
                cmdline,
                disks,
            };
            let v: dto::Vm = c.json(Method::POST, "/v1/vms", Some(&body)).await?;
            if json {
                print_json(&v);
            } else {
                println!("{}", v.name);
            }
        }
        VmCmd::List => {
            let vms: Vec<dto::Vm> = c.get("/v1/vms").await?;
            if json {
                print_json(&vms);
            } else {
                table(
                    &[
                        "NAME", "STATE", "CLASS", "VCPUS", "MEM_MIB", "CPU_S", "UPTIME", "KERNEL",
                    ],
                    &vm_rows(&vms),
                );
            }
        }
        VmCmd::Show { name } => {
            let v: dto::Vm = c.get(&format!("/v1/vms/{}", seg(&name))).await?;
            if json {
                print_json(&v);
            } else {
                show_vm(&v);
            }
        }
        VmCmd::Rm { names } => {
            let mut failed = None;
            for n in names {
                match c
                    .raw(Method::DELETE, &format!("/v1/vms/{}", seg(&n)), None)
                    .await
                {
                    Ok(_) => {
                        if !json {
                            println!("{n}");
                        }
                    }
                    Err(e) => {
                        eprintln!("corral: {n}: {e}");
                        failed = Some(CliError(format!("could not delete {n}")));
                    }
                }
            }
            if let Some(e) = failed {
                return Err(e);
            }
        }
        VmCmd::Pause { name } => action(c, &name, "pause", json).await?,
        VmCmd::Resume { name } => action(c, &name, "resume", json).await?,
        VmCmd::Move {
            name,
            class,
            weight,
        } => {
            let body = dto::MoveVm { class, weight };
            let v: dto::Vm = c
                .json(
                    Method::POST,
                    &format!("/v1/vms/{}/move", seg(&name)),
                    Some(&body),
                )
                .await?;
            if json {
                print_json(&v);
            } else {
                println!("{} is now in class {}", v.name, v.class);
            }
        }
        VmCmd::Console { name, tail, follow } => {
            let mut q = vec![];
            if let Some(t) = tail {
                q.push(format!("tail={t}"));
            }
            if follow {
                q.push("follow=true".into());
            }
            let path = format!("/v1/vms/{}/console?{}", seg(&name), q.join("&"));
            let mut body = c.stream(&path).await?;
            let mut out = std::io::stdout();
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| CliError(format!("console stream: {e}")))?;
                if let Some(data) = frame.data_ref() {
                    let _ = out.write_all(data);
                    let _ = out.flush();
                }
            }
        }
    }
    Ok(())
}

async fn action(c: &Client, name: &str, what: &str, json: bool) -> R {
    let v: dto::Vm = c
        .json(
            Method::POST,
            &format!("/v1/vms/{}/{what}", seg(name)),
            None::<&()>,
        )
        .await?;
    if json {
        print_json(&v);
    } else {
        println!("{} is {}", v.name, v.state);
    }
    Ok(())
}

fn class_rows(cs: &[dto::Class]) -> Vec<Vec<String>> {
    cs.iter()
        .map(|c| {
            vec![
                c.name.clone(),
                c.shares.to_string(),
                opt(c.cap),
                opt(c.reservation),
                c.vms.len().to_string(),
                format!("{:.2}", c.cpu_seconds),
                pct(c.entitlement_pct),
                {
                    let s = serde_json::to_string(&c.io).unwrap_or_default();
                    if s == "{}" { "-".into() } else { s }
                },
            ]
        })
        .collect()
}

fn pct_or_none(key: &str, s: &str) -> Result<Option<u32>, CliError> {
    if s.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    s.trim_end_matches('%')
        .parse::<u32>()
        .map(Some)
        .map_err(|_| CliError(format!("--{key} {s}: expected a percentage or `none`")))
}

/// `corral class ...`.
pub async fn class(c: &Client, cmd: ClassCmd, json: bool) -> R {
    match cmd {
        ClassCmd::Set {
            name,
            shares,
            cap,
            reservation,
            io,
        } => {
            let patch = dto::ClassPatch {
                shares,
                cap: cap.map(|s| pct_or_none("cap", &s)).transpose()?,
                reservation: reservation
                    .map(|s| pct_or_none("reservation", &s))
                    .transpose()?,
                io: io.map(|s| parse_limits(s.split(','))).transpose()?,
            };
            let path = format!("/v1/classes/{}", seg(&name));
            let r: Result<dto::Class, _> = c.json(Method::PATCH, &path, Some(&patch)).await;
            let cls = match r {
                Err(ClientError::Api { status, .. }) if status == hyper::StatusCode::NOT_FOUND => {
                    let body = dto::ClassCreate {
                        name: name.clone(),
                        shares: shares.unwrap_or(corral_scheduler::model::DEFAULT_SHARES),
                        cap: patch.cap.flatten(),
                        reservation: patch.reservation.flatten(),
                        io: patch.io.unwrap_or_default(),
                    };
                    c.json(Method::POST, "/v1/classes", Some(&body)).await?
                }
                r => r?,
            };
            if json {
                print_json(&cls);
            } else {
                table(
                    &[
                        "CLASS", "SHARES", "CAP%", "RESV%", "VMS", "CPU_S", "ENT%", "IO",
                    ],
                    &class_rows(std::slice::from_ref(&cls)),
                );
            }
        }
        ClassCmd::List => {
            let cs: Vec<dto::Class> = c.get("/v1/classes").await?;
            if json {
                print_json(&cs);
            } else {
                table(
                    &[
                        "CLASS", "SHARES", "CAP%", "RESV%", "VMS", "CPU_S", "ENT%", "IO",
                    ],
                    &class_rows(&cs),
                );
            }
        }
        ClassCmd::Show { name } => {
            let cls: dto::Class = c.get(&format!("/v1/classes/{}", seg(&name))).await?;
            if json {
                print_json(&cls);
            } else {
                table(
                    &[
                        "CLASS", "SHARES", "CAP%", "RESV%", "VMS", "CPU_S", "ENT%", "IO",
                    ],
                    &class_rows(std::slice::from_ref(&cls)),
                );
                if !cls.vms.is_empty() {
                    println!("vms: {}", cls.vms.join(" "));
                }
            }
        }
        ClassCmd::Rm { name } => {
            c.raw(Method::DELETE, &format!("/v1/classes/{}", seg(&name)), None)
                .await?;
            if !json {
                println!("{name}");
            }
        }
    }
    Ok(())
}

/// `corral disk ...`.
pub async fn disk(c: &Client, cmd: DiskCmd, json: bool) -> R {
    match cmd {
        DiskCmd::Limit { vm, disk, limits } => {
            let l = parse_limits(limits.iter().flat_map(|s| s.split(',')))?;
            let d: dto::Disk = c
                .json(
                    Method::PATCH,
                    &format!("/v1/vms/{}/disks/{}", seg(&vm), seg(&disk)),
                    Some(&l),
                )
                .await?;
            if json {
                print_json(&d);
            } else {
                println!(
                    "{vm}/{}: {}",
                    d.id,
                    serde_json::to_string(&d.limits).unwrap_or_default()
                );
            }
        }
    }
    Ok(())
}

/// `corral status`.
pub async fn status(c: &Client, json: bool) -> R {
    let s: dto::Status = c.get("/v1/status").await?;
    if json {
        print_json(&s);
    } else {
        println!("corral {} at {}", s.version, c.target());
        println!(
            "capacity {}% ({} reserved), {} VMs ({} running, max {}), {} vCPUs, {} / {} MiB guest memory",
            s.capacity_pct,
            s.reserved_pct,
            s.vms,
            s.running_vms,
            s.max_vms,
            s.vcpus,
            s.memory_mib,
            s.memory_budget_mib
        );
        println!(
            "scheduler: {}",
            if s.scheduler_ticks > 0 {
                format!("{} ticks", s.scheduler_ticks)
            } else {
                "not running (shares are not enforced)".into()
            }
        );
    }
    Ok(())
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
    pub entitlement_pct: Option<f64>,
    pub parked: Option<bool>,
    pub cpu_seconds: f64,
}

/// A class's line in `top`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TopClass {
    pub name: String,
    pub shares: u32,
    pub vms: usize,
    pub cpu_pct: f64,
    pub share_pct: f64,
    /// Share of CPU the shares promise among the classes with running VMs, percent.
    pub expected_pct: f64,
    pub entitlement_pct: Option<f64>,
}

/// Computes a `top` sample from two VM snapshots.
pub fn top_sample(
    before: &[dto::Vm],
    after: &[dto::Vm],
    classes: &[dto::Class],
    dt: f64,
) -> TopSample {
    let prev: BTreeMap<&str, f64> = before
        .iter()
        .map(|v| (v.name.as_str(), v.cpu_seconds))
        .collect();
    let mut vms: Vec<TopVm> = after
        .iter()
        .map(|v| {
            let d = (v.cpu_seconds - prev.get(v.name.as_str()).copied().unwrap_or(v.cpu_seconds))
                .max(0.0);
            TopVm {
                name: v.name.clone(),
                class: v.class.clone(),
                state: v.state.clone(),
                vcpus: v.vcpus,
                cpu_pct: if dt > 0.0 { d / dt * 100.0 } else { 0.0 },
                share_pct: 0.0,
                entitlement_pct: v.sched.as_ref().map(|s| s.entitlement_pct),
                parked: v.sched.as_ref().map(|s| s.parked),
                cpu_seconds: v.cpu_seconds,
            }
        })
        .collect();
    let total: f64 = vms.iter().map(|v| v.cpu_pct).sum();
    for v in &mut vms {
        v.share_pct = if total > 0.0 {
            v.cpu_pct / total * 100.0
        } else {
            0.0
        };
    }
    let active_shares: u32 = classes
        .iter()
        .filter(|c| {
            vms.iter()
                .any(|v| v.class == c.name && v.state == "running")
        })
        .map(|c| c.shares)
        .sum();
    let classes = classes
        .iter()
        .map(|c| {
            let mine: Vec<&TopVm> = vms.iter().filter(|v| v.class == c.name).collect();
            let cpu: f64 = mine.iter().map(|v| v.cpu_pct).sum();
            let running = mine.iter().any(|v| v.state == "running");
            TopClass {
                name: c.name.clone(),
                shares: c.shares,
                vms: mine.len(),
                cpu_pct: cpu,
                share_pct: if total > 0.0 {
                    cpu / total * 100.0
                } else {
                    0.0
                },
                expected_pct: if running && active_shares > 0 {
                    f64::from(c.shares) / f64::from(active_shares) * 100.0
                } else {
                    0.0
                },
                entitlement_pct: c.entitlement_pct,
            }
        })
        .collect();
    TopSample {
        interval_seconds: dt,
        vms,
        classes,
    }
}

/// Prints a `top` sample as tables.
pub fn print_top(s: &TopSample) {
    table(
        &[
            "VM", "CLASS", "STATE", "VCPUS", "CPU%", "SHARE%", "ENT%", "PARKED", "CPU_S",
        ],
        &s.vms
            .iter()
            .map(|v| {
                vec![
                    v.name.clone(),
                    v.class.clone(),
                    v.state.clone(),
                    v.vcpus.to_string(),
                    format!("{:.1}", v.cpu_pct),
                    format!("{:.1}", v.share_pct),
                    pct(v.entitlement_pct),
                    opt(v.parked),
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
            "SHARE%",
            "EXPECTED%",
            "ENT%",
        ],
        &s.classes
            .iter()
            .map(|c| {
                vec![
                    c.name.clone(),
                    c.shares.to_string(),
                    c.vms.to_string(),
                    format!("{:.1}", c.cpu_pct),
                    format!("{:.1}", c.share_pct),
                    format!("{:.1}", c.expected_pct),
                    pct(c.entitlement_pct),
                ]
            })
            .collect::<Vec<_>>(),
    );
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

/// `corral top`.
pub async fn top(c: &Client, once: bool, interval: f64, json: bool) -> R {
    let interval = Duration::from_secs_f64(interval.clamp(0.1, 3600.0));
    let mut before: Vec<dto::Vm> = c.get("/v1/vms").await?;
    let mut t0 = Instant::now();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
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
                    "corral top — {} — every {:.1} s, Ctrl-C to quit\n",
                    c.target(),
                    interval.as_secs_f64()
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
