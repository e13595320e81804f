//! `corral demo`: a daemon in this process on a private socket, two classes
//! with different shares, one spinning probe VM in each, live figures for a
//! few seconds, a summary, and clean-up.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::Method;

use crate::cli::{self, CliError, print_top};
use crate::client::{Client, Target};
use crate::dto;
use crate::server;

/// Options of `corral demo`.
#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Seconds of measurement.
    #[arg(long, default_value_t = 6)]
    pub secs: u64,
    /// vCPUs per VM.
    #[arg(long, default_value_t = 2)]
    pub vcpus: u32,
    /// Shares of the gold class.
    #[arg(long, default_value_t = 3)]
    pub gold: u32,
    /// Shares of the bronze class.
    #[arg(long, default_value_t = 1)]
    pub bronze: u32,
}

/// Runs the demo.
pub fn demo(args: DemoArgs, builtin: Arc<[u8]>) -> Result<(), CliError> {
    let mgr = Arc::new(
        corral_vmm::manager::Manager::new(corral_vmm::manager::ManagerConfig {
            builtin_kernel: Some(builtin),
            ..Default::default()
        })
        .map_err(|e| CliError(e.to_string()))?,
    );
    let dir = std::env::temp_dir().join(format!("corral-demo-{}", std::process::id()));
    let socket = dir.join("corral.sock");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| CliError(format!("tokio runtime: {e}")))?;
    let r = rt.block_on(async {
        let (unix, _bound) =
            server::bind_unix(&socket, None).map_err(|e| CliError(e.to_string()))?;
        server::spawn_cpu_sampler(mgr.clone());
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let srv = tokio::spawn(server::serve_on(
            server::router(mgr.clone()),
            unix,
            async move {
                let _ = stop_rx.await;
            },
        ));
        let client = Client::new(Target::Unix(socket.clone()));
        let r = tokio::select! {
            r = run(&client, &args) => r,
            _ = tokio::signal::ctrl_c() => {
                println!("\ninterrupted");
                Ok(())
            }
        };
        println!("\ncleaning up: deleting the VMs and classes");
        for name in ["gold-1", "bronze-1"] {
            let _ = client
                .raw(Method::DELETE, &format!("/v1/vms/{name}"), None)
                .await;
        }
        for name in ["gold", "bronze"] {
            let _ = client
                .raw(Method::DELETE, &format!("/v1/classes/{name}"), None)
                .await;
        }
        let _ = stop_tx.send(());
        let _ = srv.await;
        r
    });
    let m = mgr.clone();
    m.shutdown();
    let _ = std::fs::remove_file(&socket);
    let _ = std::fs::remove_dir(&dir);
    r
}

async fn run(c: &Client, a: &DemoArgs) -> Result<(), CliError> {
    let status: dto::Status = c.get("/v1/status").await?;
    println!(
        "corral demo: an in-process daemon ({}), host capacity {}% of one CPU",
        c.target(),
        status.capacity_pct
    );
    for (name, shares) in [("gold", a.gold), ("bronze", a.bronze)] {
        let body = dto::ClassPut {
            parent: None,
            shares,
            cap: None,
            reservation: None,
            io: dto::Limits::default(),
        };
        let cls: dto::Class = c
            .json(Method::PUT, &format!("/v1/classes/{name}"), Some(&body))
            .await?;
        println!("  class {:<7} shares {}", cls.name, cls.shares);
    }
    let spin_secs = a.secs + 30;
    for (name, class) in [("gold-1", "gold"), ("bronze-1", "bronze")] {
        let body = dto::VmCreate {
            name: Some(name.into()),
            class: Some(class.into()),
            vcpus: Some(a.vcpus),
            memory_mib: Some(32),
            cmdline: Some(format!(
                "probe.mode=spin probe.secs={spin_secs} probe.interval_ms=1000"
            )),
            ..Default::default()
        };
        let v: dto::Vm = c.json(Method::POST, "/v1/vms", Some(&body)).await?;
        println!(
            "  vm    {:<9} class {:<7} {} vCPUs, {} MiB, built-in probe `{}`",
            v.name, v.class, v.vcpus, v.memory_mib, v.cmdline
        );
    }
    // Let both guests boot before measuring.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let start: Vec<dto::Vm> = c.get("/v1/vms").await?;
    let t_start = Instant::now();
    println!("\nlive CPU use (percent of one host CPU, share of what the VMs used):");
    for i in 1..=a.secs {
        let s = cli::sample(c, Duration::from_secs(1)).await?;
        let mut line = format!("  t={i:>2}s");
        for v in &s.vms {
            line.push_str(&format!(
                "   {:<9} {:>6.1}% ({:>4.1}%)",
                v.name, v.cpu_pct, v.share_pct
            ));
        }
        println!("{line}");
    }
    let end: Vec<dto::Vm> = c.get("/v1/vms").await?;
    let classes: Vec<dto::Class> = c.get("/v1/classes").await?;
    let classes: Vec<dto::Class> = classes
        .into_iter()
        .filter(|c| c.name == "gold" || c.name == "bronze")
        .collect();
    let s = cli::top_sample(&start, &end, &classes, t_start.elapsed().as_secs_f64());
    println!("\nsummary over {:.1} s:\n", s.interval_seconds);
    print_top(&s);
    println!();
    for cl in &s.classes {
        println!(
            "  {:<7} got {:>5.1}% of the CPU the VMs used; its shares promise {:>5.1}% ({:+.1} points)",
            cl.name,
            cl.share_pct,
            cl.expected_pct,
            cl.share_pct - cl.expected_pct
        );
    }
    let status: dto::Status = c.get("/v1/status").await?;
    if status.scheduler_ticks == 0 {
        println!(
            "\n  note: the CPU scheduler thread is not running in this build, so shares are not\n  \
             enforced yet and the host kernel splits the CPU evenly between the vCPU threads."
        );
    }
    let tail = c
        .raw(Method::GET, "/v1/vms/gold-1/console?tail=2", None)
        .await?
        .1;
    println!(
        "\n  gold-1 console (last 2 lines):\n    {}",
        String::from_utf8_lossy(&tail)
            .trim_end()
            .replace('\n', "\n    ")
    );
    Ok(())
}
