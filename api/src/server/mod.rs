//! `corral serve`: the REST API (axum on tokio) over a Unix socket and,
//! optionally, a loopback TCP port with a bearer token.
//!
//! Files: `routes.rs` (the handlers), `json.rs` (extractors), `error.rs`
//! (error shape, clipping client input), `guard.rs` (auth and browser
//! checks), `http.rs` (accept loops, connection limits and timeouts),
//! `followers.rs` (console stream limits), `lifecycle.rs` (state lock,
//! socket, token file), `args.rs` (the options of these).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use corral_vmm::manager::{Manager, ManagerError};

mod args;
mod error;
mod followers;
mod guard;
mod http;
mod json;
mod lifecycle;
mod routes;
pub mod vm_lifecycle;

pub use args::ApiArgs;
pub use http::HttpLimits;
pub use lifecycle::bind_unix;
pub use routes::router;

/// The spec, served at `/v1/openapi.yaml`.
pub static OPENAPI_YAML: &str = include_str!("../../openapi.yaml");

/// Largest request body.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Options of `corral serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Unix socket to listen on (mode 0600; see --socket-group).
    #[arg(long, default_value = crate::client::DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Also listen on this TCP address: HOST:PORT, the host a name
    /// (`localhost:7070`) or an address (`127.0.0.1:7070`, `[::1]:7070`);
    /// requests there need the bearer token of --token-file.
    #[arg(long, value_name = "HOST:PORT", value_parser = parse_listen)]
    pub listen: Option<SocketAddr>,
    /// Allow a non-loopback --listen address (plain HTTP: the token and
    /// everything else travel unencrypted).
    #[arg(long)]
    pub allow_remote: bool,
    /// Most VMs at once.
    #[arg(long, default_value_t = 256)]
    pub max_vms: usize,
    /// CPU capacity in percent of one CPU (default: the CPU affinity mask).
    #[arg(long)]
    pub capacity: Option<u64>,
    /// Guest memory budget in MiB (default: host memory less 10 % of it
    /// or 1 GiB, whichever is larger).
    #[arg(long)]
    pub memory_budget: Option<u64>,
    /// Most classes.
    #[arg(long, default_value_t = corral_vmm::manager::DEFAULT_MAX_CLASSES)]
    pub max_classes: usize,
    /// The gate backend's tick, in ms: how often the scheduler thread reads
    /// the VMs' CPU use and parks or unparks them (default 10; 0.1 is the
    /// least). Finer ticks suit hosts whose kicks take microseconds (VMX);
    /// on nested kvm_pvm a kick takes ~4 ms.
    #[arg(long, value_name = "MS", default_value_t = 10.0)]
    pub tick_ms: f64,
    /// The accounting period, in ms: an idle VM keeps at most one period of
    /// its entitlement as credit (default 100; at least one tick).
    #[arg(long, value_name = "MS", default_value_t = 100.0)]
    pub period_ms: f64,
    /// The minimum slice, in ms: a VM unparked for its turn runs at least
    /// this long before VMs that wait can displace it (default 20, two
    /// ticks; at most one period; a value up to one tick gives one-tick
    /// turns). Each turn costs a kick and a wake of every vCPU of two VMs.
    #[arg(long, value_name = "MS", default_value_t = 20.0)]
    pub min_slice_ms: f64,
    /// The handover, in ms: at a tick that parks one VM and unparks
    /// another, if either is an I/O VM, the incoming VM's vCPUs start once
    /// the outgoing VM's are off the CPU, or after this long (default 5; at
    /// most one tick; 0 starts them at once, beside the outgoing ones until
    /// their kick lands).
    #[arg(long, value_name = "MS", default_value_t = 5.0)]
    pub handover_ms: f64,
    /// A directory whose files clients may use as kernels, initrds and
    /// disks (repeatable; created 0700 if missing). Nothing outside them is
    /// opened, and no symbolic link is followed beneath them.
    #[arg(long, value_name = "DIR", default_value = corral_vmm::hostfile::DEFAULT_IMAGE_DIR)]
    pub image_dir: Vec<PathBuf>,
    /// Accept block devices (beneath the image directories) as disks.
    #[arg(long)]
    pub allow_block_devices: bool,
    /// How CPU shares are enforced: `gate` (corral's scheduler thread),
    /// `cgroup` (Linux cgroups), or `none` (host scheduler only).
    #[arg(long, default_value = "gate")]
    pub cpu_backend: corral_vmm::manager::CpuBackend,
    /// No seccomp filters (for debugging). By default every thread runs
    /// under the filter of its kind (vCPU, device, scheduler, runtime), and
    /// a VM's thread that breaks its filter fails that VM only.
    #[arg(long)]
    pub no_seccomp: bool,
    /// Where VMs run: `process` (each in a `corral vmm` process of its
    /// own, supervised by the daemon) or `thread` (threads of the daemon;
    /// class I/O groups are shared by the disks of every VM of a class only
    /// here). The `cgroup` CPU backend runs VMs as threads.
    #[arg(long, default_value = "process", value_parser = ["process", "thread"])]
    pub vm_mode: String,
    /// Stop every VM when the daemon exits (SIGTERM, SIGINT). Without it
    /// the VM processes keep running (also through kill -9 of the daemon)
    /// and the next daemon on the state directory re-adopts them.
    #[arg(long)]
    pub shutdown_vms_on_exit: bool,
    /// The uids of jailed VM processes, `BASE:COUNT`: each VM process runs
    /// as a uid (and gid) of its own from this range, one no process on the
    /// host runs as (see README, "The VM process's jail").
    #[arg(long, default_value = "3221225472:65536", value_parser = parse_uid_range)]
    pub jail_uids: corral_vmm::jail::UidRange,
    /// Do not jail the VM processes (for debugging): they run as root with
    /// the daemon's view of the host.
    #[arg(long)]
    pub no_jail: bool,
    /// Start again the VMs of the state file that were running (created
    /// or started and not stopped) when the daemon last ran. Off: every VM
    /// is reloaded stopped and `start` runs it.
    #[arg(long)]
    pub restart_vms: bool,
    /// Load `state.json.bak` (the state before the last change) because
    /// `state.json` is corrupt or unreadable; the bad file is kept as
    /// `state.json.rejected`.
    #[arg(long)]
    pub state_from_backup: bool,
    /// Access control and HTTP limits.
    #[command(flatten)]
    pub api: ApiArgs,
}

/// `--listen HOST:PORT`: an address as is; a name resolved, its first
/// IPv4 address preferred (`localhost` is 127.0.0.1 without asking the
/// resolver, as RFC 6761 has it).
pub fn parse_listen(s: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    let (host, port) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("{s}: expected HOST:PORT, e.g. localhost:7070"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("{s}: {port:?} is not a port number"))?;
    if host.eq_ignore_ascii_case("localhost") {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    let addrs: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
        .map_err(|e| format!("{s}: cannot resolve {host:?}: {e}"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("{s}: {host:?} has no address"))
}

/// Errors of `corral serve`.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Bad option.
    #[error("{0}")]
    Config(String),
    /// Socket setup.
    #[error("{what}: {err}")]
    Io {
        /// What failed.
        what: String,
        /// Why.
        err: std::io::Error,
    },
    /// Manager setup.
    #[error(transparent)]
    Manager(#[from] ManagerError),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ServeError {
    let what = what.into();
    move |err| ServeError::Io { what, err }
}

/// Serves `router` on the Unix socket only (root and the daemon's uid may
/// use it), with the default limits, until `shutdown` resolves; then lets
/// open requests finish for up to 5 s. (`corral demo`'s in-process daemon.)
pub async fn serve_on(
    router: Router,
    unix: tokio::net::UnixListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let (tx, rx) = tokio::sync::watch::channel(false);
    let app = guarded(router, guard::Guard::default());
    let l = http::Listener::Unix(unix, http::UnixPolicy { group: None });
    let task = tokio::spawn(http::serve_listener(l, app, HttpLimits::default(), rx));
    shutdown.await;
    let _ = tx.send(true);
    if tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .is_err()
    {
        tracing::warn!("some connections did not close within 5 s; exiting anyway");
    }
}

fn guarded(router: Router, g: guard::Guard) -> Router {
    router
        .layer(axum::middleware::from_fn_with_state(
            Arc::new(g),
            guard::check,
        ))
        // Outside the guard, so refused requests (401, 403) are counted too.
        .layer(axum::middleware::from_fn(crate::metrics::http::track))
}

/// Samples the VMs' CPU time twice a second, so that the figure of a VM
/// whose guest stops on its own is kept (to within half a second).
pub fn spawn_cpu_sampler(mgr: Arc<Manager>) {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_millis(500));
        loop {
            every.tick().await;
            let m = mgr.clone();
            let _ = tokio::task::spawn_blocking(move || m.sample_cpu()).await;
        }
    });
}

/// Waits for SIGINT or SIGTERM. The handlers are installed when this is
/// called, not when the future is first polled: a signal that comes right
/// after start-up is caught, not fatal.
pub fn terminate_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    async move {
        let (mut term, mut int) = match (term, int) {
            (Ok(t), Ok(i)) => (t, i),
            (Err(e), _) | (_, Err(e)) => {
                tracing::error!("cannot catch SIGTERM/SIGINT: {e}");
                std::future::pending::<()>().await;
                return;
            }
        };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
    }
}

/// The token file's default place: `token` beside the socket.
pub fn default_token_file(socket: &Path) -> PathBuf {
    socket
        .parent()
        .unwrap_or_else(|| Path::new(""))
        .join("token")
}

/// The policy's timing from `--tick-ms`, `--period-ms`, `--min-slice-ms`
/// and `--handover-ms`, checked ([`corral_scheduler::PolicyConfig::validate`]).
fn policy_config(
    tick_ms: f64,
    period_ms: f64,
    min_slice_ms: f64,
    handover_ms: f64,
) -> Result<corral_scheduler::PolicyConfig, ServeError> {
    let ns = |flag: &str, ms: f64| {
        if ms.is_finite() && (0.0..=3_600_000.0).contains(&ms) {
            Ok((ms * 1e6).round() as u64)
        } else {
            Err(ServeError::Config(format!(
                "{flag} {ms}: give milliseconds between 0 and 3600000"
            )))
        }
    };
    let cfg = corral_scheduler::PolicyConfig {
        tick_ns: ns("--tick-ms", tick_ms)?,
        period_ns: ns("--period-ms", period_ms)?,
        min_slice_ns: ns("--min-slice-ms", min_slice_ms)?,
        handover_ns: ns("--handover-ms", handover_ms)?,
    };
    cfg.validate().map_err(|e| {
        ServeError::Config(format!(
            "--tick-ms/--period-ms/--min-slice-ms/--handover-ms: {e}"
        ))
    })?;
    Ok(cfg)
}

/// `corral serve`.
pub fn serve(args: ServeArgs, builtin: Arc<[u8]>) -> Result<(), ServeError> {
    if let Some(addr) = args.listen
        && !addr.ip().is_loopback()
        && !args.allow_remote
    {
        return Err(ServeError::Config(format!(
            "--listen {addr} is not a loopback address; the API is plain HTTP (the bearer token \
             would cross the network in clear text): pass --allow-remote to listen there anyway"
        )));
    }
    let policy = policy_config(
        args.tick_ms,
        args.period_ms,
        args.min_slice_ms,
        args.handover_ms,
    )?;
    // Start-up phases, logged once the state is reloaded (re-adoption
    // profiling: what a restart with many VM processes spends where).
    let t0 = std::time::Instant::now();
    let mut phases: Vec<(&str, Duration)> = Vec::new();
    let mut phase = |name, since: &mut std::time::Instant| {
        phases.push((name, since.elapsed()));
        *since = std::time::Instant::now();
    };
    let mut since = t0;
    // The lock first: a second daemon on this state directory stops here,
    // before it touches any socket.
    let _lock = lifecycle::lock_state_dir(&args.api.state_dir)?;
    let group = args
        .api
        .socket_group
        .as_deref()
        .map(lifecycle::resolve_group)
        .transpose()?;
    lifecycle::raise_fd_limit();
    let host_files =
        corral_vmm::hostfile::HostPolicy::beneath(&args.image_dir, args.allow_block_devices)
            .map_err(io("--image-dir"))?;
    let state = load_state(&args.api.state_dir, args.state_from_backup)?;
    phase("state file", &mut since);
    let cfg = corral_vmm::manager::ManagerConfig {
        capacity: args.capacity.map(corral_scheduler::Capacity::from_percent),
        max_vms: args.max_vms,
        memory_budget_mib: args.memory_budget,
        max_classes: args.max_classes,
        host_files,
        builtin_kernel: Some(builtin),
        cpu_backend: args.cpu_backend,
        state_dir: Some(args.api.state_dir.clone()),
        policy,
        ..Default::default()
    };
    // The launcher of VM processes before any filter: it execs `corral vmm`.
    let vm_processes = if args.vm_mode == "process" {
        let exe = std::env::current_exe().map_err(io("finding the corral binary"))?;
        let pid_namespace = !args.no_jail && check_jail_namespaces()?;
        phase("jail probes", &mut since);
        Some(corral_vmm::manager::VmProcesses {
            launcher: corral_vmm::vmproc::launcher::Launcher::start(&exe)
                .map_err(io("starting the VM process launcher"))?,
            seccomp: !args.no_seccomp,
            keep_running: !args.shutdown_vms_on_exit,
            jail: if args.no_jail {
                None
            } else {
                Some(std::sync::Arc::new(
                    corral_vmm::jail::UidPool::new(args.jail_uids)
                        .map_err(|e| ServeError::Config(e.to_string()))?,
                ))
            },
            pid_namespace,
        })
    } else {
        None
    };
    let cfg = corral_vmm::manager::ManagerConfig {
        vm_processes,
        ..cfg
    };
    phase("launcher", &mut since);
    // The runtime filter on the main thread before any other thread exists:
    // the scheduler thread, tokio's workers and blocking pool inherit it
    // (the scheduler and the VMs' threads narrow it with their own).
    if !args.no_seccomp {
        use corral_vmm::seccomp;
        seccomp::enable()
            .and_then(|()| seccomp::check_all())
            .and_then(|()| seccomp::install(seccomp::ThreadKind::Runtime))
            .map_err(|e| ServeError::Config(e.to_string()))?;
    }
    phase("seccomp", &mut since);
    let mgr = Arc::new(Manager::new(cfg)?);
    phase("manager", &mut since);
    if let Some(state) = &state {
        let r = mgr.restore(state, args.restart_vms).map_err(|e| {
            ServeError::Config(format!(
                "{} in {}: {e}; {}",
                corral_vmm::manager::state::STATE_FILE,
                args.api.state_dir.display(),
                BACKUP_HINT
            ))
        })?;
        phase("restore", &mut since);
        tracing::info!(
            classes = r.classes,
            vms = r.vms,
            started = r.started,
            adopted = r.adopted,
            "state reloaded: VM processes still running are re-adopted; the other VMs are \
             stopped unless --restart-vms started them"
        );
    }
    let phases: Vec<String> = phases
        .iter()
        .map(|(n, d)| format!("{n} {:.1} ms", d.as_secs_f64() * 1e3))
        .collect();
    tracing::info!(
        total_ms = t0.elapsed().as_secs_f64() * 1e3,
        "start-up: {}",
        phases.join(", ")
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(128)
        .enable_all()
        .build()
        .map_err(io("starting the tokio runtime"))?;
    let r = rt.block_on(run(&args, group, mgr.clone()));
    rt.shutdown_timeout(Duration::from_secs(1));
    match r {
        Ok(true) => Ok(()),
        Ok(false) => {
            // The VMs did not stop in time (a stuck thread of the manager):
            // leave now, without running the manager's destructor, which
            // would wait for them again.
            eprintln!(
                "corral: the VMs did not stop within --shutdown-timeout {} s; exiting anyway",
                args.api.shutdown_timeout.as_secs_f64()
            );
            std::process::exit(1);
        }
        Err(e) => Err(e),
    }
}

const BACKUP_HINT: &str = "corral serve --state-from-backup loads state.json.bak (the state \
    before the last change), or move the file away to start with no state";

/// Reads the state file (the backup with `from_backup`, keeping the bad
/// file as `state.json.rejected`); refuses a file it cannot load whole.
fn load_state(
    dir: &std::path::Path,
    from_backup: bool,
) -> Result<Option<corral_vmm::manager::state::StateFile>, ServeError> {
    use corral_vmm::manager::state::{STATE_FILE, read_state};
    match read_state(dir, from_backup) {
        Ok(s) if from_backup => {
            tracing::warn!(
                "--state-from-backup: loading {}/state.json.bak; {STATE_FILE} is kept as \
                 state.json.rejected",
                dir.display()
            );
            let _ = std::fs::rename(dir.join(STATE_FILE), dir.join("state.json.rejected"));
            Ok(s)
        }
        Ok(s) => Ok(s),
        Err(e) if from_backup => Err(ServeError::Config(format!(
            "cannot load the backup state file: {e}"
        ))),
        Err(e) => Err(ServeError::Config(format!(
            "refusing to start: the state file cannot be loaded: {e}; {BACKUP_HINT}"
        ))),
    }
}

/// Serves until SIGTERM/SIGINT; Ok(false) if the VMs did not stop within
/// the shutdown timeout.
async fn run(args: &ServeArgs, group: Option<u32>, mgr: Arc<Manager>) -> Result<bool, ServeError> {
    let signalled = terminate_signal();
    let (unix, _bound) = bind_unix(&args.socket, group)?;
    let tcp = match args.listen {
        Some(a) => Some(
            tokio::net::TcpListener::bind(a)
                .await
                .map_err(io(format!("binding {a}")))?,
        ),
        None => None,
    };
    let limits = args.api.limits();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let app = router(mgr.clone());
    let mut tasks = vec![tokio::spawn(http::serve_listener(
        http::Listener::Unix(unix, http::UnixPolicy { group }),
        guarded(app.clone(), guard::Guard::default()),
        limits,
        stop_rx.clone(),
    ))];
    let mut _token = None;
    if let Some(l) = tcp {
        let addr = l.local_addr().map_err(io("the TCP listener's address"))?;
        let token = lifecycle::new_token()?;
        let path = args
            .api
            .token_file
            .clone()
            .unwrap_or_else(|| default_token_file(&args.socket));
        _token = Some(lifecycle::TokenFile::write(&path, &token)?);
        let auth = guard::TcpAuth::new(token, addr, &args.api.allow_host);
        tasks.push(tokio::spawn(http::serve_listener(
            http::Listener::Tcp(l),
            guarded(app, guard::Guard { tcp: Some(auth) }),
            limits,
            stop_rx,
        )));
        // One line on stdout for scripts and tests.
        println!(
            "corral: listening on {} and http://{addr} (token in {})",
            args.socket.display(),
            path.display()
        );
    } else {
        println!("corral: listening on {}", args.socket.display());
    }
    spawn_cpu_sampler(mgr.clone());
    signalled.await;
    let _ = stop_tx.send(true);
    // The VMs are stopped on a thread of their own: the blocking pool may
    // be full of requests that are stuck.
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let m = mgr.clone();
    std::thread::Builder::new()
        .name("corral-shutdown".into())
        .spawn(move || {
            m.shutdown();
            let _ = done_tx.send(());
        })
        .map_err(io("starting the shutdown thread"))?;
    let deadline = tokio::time::Instant::now() + args.api.shutdown_timeout;
    let stopped = tokio::time::timeout_at(deadline, done_rx).await.is_ok();
    // Open requests may finish for what is left of the timeout, at most 5 s.
    let drain = deadline.min(tokio::time::Instant::now() + Duration::from_secs(5));
    let all = futures_util::future::join_all(tasks);
    if tokio::time::timeout_at(drain, all).await.is_err() {
        tracing::warn!("some connections did not close in time; exiting anyway");
    }
    Ok(stopped)
}

/// The namespaces a VM process's jail makes, tried at start-up: a host
/// that refuses a mount, IPC, network or UTS namespace stops the daemon
/// here with the reason, not every VM at its start. The pid namespace is
/// used where the host allows one (`true`); where it does not (a container
/// without the privilege), the VM processes run in the daemon's, which is
/// logged.
fn check_jail_namespaces() -> Result<bool, ServeError> {
    use corral_vmm::jail::NsKind;
    // All at once first (one child); one by one only to name what fails.
    if corral_vmm::jail::probe_together(&NsKind::ALL).is_ok() {
        return Ok(true);
    }
    for k in [NsKind::Mount, NsKind::Ipc, NsKind::Net, NsKind::Uts] {
        let t = std::time::Instant::now();
        let r = corral_vmm::jail::probe(k);
        tracing::debug!(
            ms = t.elapsed().as_secs_f64() * 1e3,
            "jail probe: {}",
            k.as_str()
        );
        if let Err(e) = r {
            return Err(ServeError::Config(format!(
                "the VM processes' jail needs a {} namespace, which this host refuses ({e}); \
                 --no-jail runs them unjailed",
                k.as_str()
            )));
        }
    }
    match corral_vmm::jail::probe(NsKind::Pid) {
        Ok(()) => Ok(true),
        Err(e) => {
            tracing::warn!(
                "this host refuses a pid namespace ({e}): the VM processes run in the daemon's"
            );
            Ok(false)
        }
    }
}

fn parse_uid_range(s: &str) -> Result<corral_vmm::jail::UidRange, String> {
    corral_vmm::jail::UidRange::parse(s).map_err(|e| e.to_string())
}
