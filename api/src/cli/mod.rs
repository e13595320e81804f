//! The client commands: `corral vm|class|disk|top|status`, their options,
//! and the parsing of limits and disks (output formatting in [`table`],
//! `corral top` in [`top`]).

pub mod args;
pub mod attach;
pub mod parse;
pub mod table;
pub mod top;

use std::io::Write;

use http_body_util::BodyExt;
use hyper::Method;

use crate::client::{Client, ClientError, seg};
use crate::dto;
pub use args::{CLIENT_HEADING, ClassCmd, ClientOpts, DiskCmd, VmCmd};
use parse::pct_or_none;
use parse::{apply_limits, parse_disk, parse_limits};
pub use table::table;
use table::{opt, pct};
pub use top::{print_top, sample, top_sample};

/// Failure of a client command (message already formatted).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CliError(pub String);

impl From<ClientError> for CliError {
    fn from(e: ClientError) -> Self {
        CliError(e.to_string())
    }
}

pub(crate) type R = Result<(), CliError>;

fn print_json(v: &impl serde::Serialize) {
    match serde_json::to_string_pretty(v) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("corral: {e}"),
    }
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

/// `corral vm ...`.
pub async fn vm(c: &Client, cmd: VmCmd, json: bool) -> R {
    match cmd {
        VmCmd::Create {
            name,
            class,
            weight,
            cap,
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
                cap,
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
                table::show_vm(&v);
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
        VmCmd::Stop { names } => {
            for n in names {
                action(c, &n, "stop", json).await?;
            }
        }
        VmCmd::Start { names } => {
            for n in names {
                action(c, &n, "start", json).await?;
            }
        }
        VmCmd::Reboot { name } => action(c, &name, "reboot", json).await?,
        VmCmd::Shutdown { name, timeout } => {
            if !(0.0..=600.0).contains(&timeout) {
                return Err(CliError(format!(
                    "--timeout {timeout}: must be 0..=600 seconds"
                )));
            }
            let body = serde_json::json!({ "timeout_seconds": timeout });
            let _: dto::Vm = c
                .json(
                    Method::POST,
                    &format!("/v1/vms/{}/shutdown", seg(&name)),
                    Some(&body),
                )
                .await?;
            // The daemon answers at once and waits in the background: follow
            // the VM until its run has ended (the hard stop comes at the
            // timeout, so a little longer is plenty).
            let path = format!("/v1/vms/{}", seg(&name));
            let deadline =
                std::time::Instant::now() + std::time::Duration::from_secs_f64(timeout + 10.0);
            let v: dto::Vm = loop {
                let v: dto::Vm = c.get(&path).await?;
                if !matches!(v.state.as_str(), "running" | "paused")
                    || std::time::Instant::now() > deadline
                {
                    break v;
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            };
            if json {
                print_json(&v);
            } else if v.state == "shutdown" {
                println!("{} powered off", v.name);
            } else {
                println!("{} did not power off in {timeout} s: {}", v.name, v.state);
            }
        }
        VmCmd::Pause { name } => action(c, &name, "pause", json).await?,
        VmCmd::Resume { name } => action(c, &name, "resume", json).await?,
        VmCmd::Set { name, cap, weight } => {
            let body = dto::VmPatch {
                weight,
                cap: cap.map(|s| pct_or_none("cap", &s)).transpose()?,
            };
            let v: dto::Vm = c
                .json(
                    Method::PATCH,
                    &format!("/v1/vms/{}", seg(&name)),
                    Some(&body),
                )
                .await?;
            if json {
                print_json(&v);
            } else {
                if weight.is_some() {
                    println!("{}: weight {} in class {}", v.name, v.weight, v.class);
                }
                match v.cap {
                    Some(cap) => println!("{}: cap {cap}%", v.name),
                    None => println!("{}: no cap of its own", v.name),
                }
            }
        }
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
        VmCmd::Console {
            name, attach: true, ..
        } => attach::attach(c, &name).await?,
        VmCmd::Console {
            name, tail, follow, ..
        } => {
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
                    let s = table::limits(&c.io);
                    if s == "none" { "-".into() } else { s }
                },
            ]
        })
        .collect()
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
            parent,
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
                        parent: parent.clone(),
                        shares: shares.unwrap_or(corral_scheduler::model::DEFAULT_SHARES),
                        cap: patch.cap.flatten(),
                        reservation: patch.reservation.flatten(),
                        io: patch.io.unwrap_or_default(),
                    };
                    c.json(Method::POST, "/v1/classes", Some(&body)).await?
                }
                r => r?,
            };
            if parent.is_some() && cls.parent != parent {
                return Err(CliError(format!(
                    "class {name} already exists under {}; a class cannot move in the tree",
                    cls.parent.as_deref().unwrap_or("the root")
                )));
            }
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
        ClassCmd::Tree => {
            let cs: Vec<dto::Class> = c.get("/v1/classes").await?;
            if json {
                print_json(&cs);
            } else {
                print!("{}", class_tree(&cs));
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
        DiskCmd::Limit {
            vm,
            disk,
            limits,
            replace,
        } => {
            let items = limits.iter().flat_map(|s| s.split(','));
            let l = if replace {
                parse_limits(items)?
            } else {
                // Merge with what the disk has now.
                let v: dto::Vm = c.get(&format!("/v1/vms/{}", seg(&vm))).await?;
                let cur = v
                    .disks
                    .iter()
                    .find(|d| d.id == disk)
                    .ok_or_else(|| {
                        let ids: Vec<&str> = v.disks.iter().map(|d| d.id.as_str()).collect();
                        CliError(format!(
                            "VM {vm} has no disk {disk:?} (its disks: {})",
                            if ids.is_empty() {
                                "none".to_string()
                            } else {
                                ids.join(", ")
                            }
                        ))
                    })?
                    .limits;
                apply_limits(cur, items)?
            };
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
                println!("{vm}/{}: limits {}", d.id, table::limits(&d.limits));
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

/// The class tree as indented text: one line per class (shares, cap,
/// reservation, entitlement, VMs), children under their parent.
pub fn class_tree(classes: &[dto::Class]) -> String {
    fn walk(out: &mut String, all: &[dto::Class], c: &dto::Class, depth: usize) {
        let pct = |v: Option<u32>| v.map_or("-".to_string(), |v| format!("{v}%"));
        out.push_str(&format!(
            "{:indent$}{} shares {} cap {} resv {} ent {} vms [{}]\n",
            "",
            c.name,
            c.shares,
            pct(c.cap),
            pct(c.reservation),
            c.entitlement_pct
                .map_or("-".to_string(), |e| format!("{e:.1}%")),
            c.vms.join(", "),
            indent = depth * 2
        ));
        for child in all.iter().filter(|x| x.parent.as_deref() == Some(&c.name)) {
            walk(out, all, child, depth + 1);
        }
    }
    let mut out = String::new();
    let known = |p: &str| classes.iter().any(|c| c.name == p);
    for root in classes
        .iter()
        .filter(|c| c.parent.as_deref().is_none_or(|p| !known(p)))
    {
        walk(&mut out, classes, root, 0);
    }
    out
}
