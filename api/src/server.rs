//! `corral serve`: the REST API (axum on tokio) over a Unix socket and,
//! optionally, a loopback TCP port.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, patch, post};
use axum::{Json, Router};
use corral_vmm::manager::{ErrorKind, Manager, ManagerError};
use serde::de::DeserializeOwned;
use tokio::sync::Semaphore;

use crate::dto;
use crate::metrics;

/// The spec, served at `/v1/openapi.yaml`.
pub static OPENAPI_YAML: &str = include_str!("../openapi.yaml");

/// Largest request body.
pub const MAX_BODY_BYTES: usize = 64 * 1024;
/// Most concurrent console followers.
pub const MAX_FOLLOWERS: usize = 64;

/// Shared state of the handlers.
#[derive(Clone)]
pub struct AppState {
    /// The manager.
    pub mgr: Arc<Manager>,
    followers: Arc<Semaphore>,
}

/// An API error: status plus `{"error":{"code","message"}}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    /// A new error.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }
}

impl From<ManagerError> for ApiError {
    fn from(e: ManagerError) -> Self {
        let (status, code) = match e.kind() {
            ErrorKind::Invalid => (StatusCode::BAD_REQUEST, "bad_request"),
            ErrorKind::NotFound => (StatusCode::NOT_FOUND, "not_found"),
            ErrorKind::Conflict => (StatusCode::CONFLICT, "conflict"),
            ErrorKind::Refused => (StatusCode::UNPROCESSABLE_ENTITY, "refused"),
            ErrorKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!("{e}");
        }
        Self::new(status, e.code().unwrap_or(code), e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = dto::ErrorBody {
            error: dto::ErrorDetail {
                code: self.code.to_string(),
                message: self.message,
            },
        };
        (self.status, Json(body)).into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// A JSON body parsed with our error shape (any content type is accepted;
/// unknown fields, wrong types and trailing data are 400).
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            let status = e.status();
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(
                    status,
                    "payload_too_large",
                    format!("request body larger than {MAX_BODY_BYTES} bytes"),
                )
            } else {
                ApiError::bad_request(format!("cannot read the request body: {}", e.body_text()))
            }
        })?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(ApiError::bad_request(
                "a JSON object is required as the request body",
            ));
        }
        let v: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
        if !v.is_object() {
            return Err(ApiError::bad_request(
                "the request body must be a JSON object",
            ));
        }
        serde_json::from_value(v)
            .map(ApiJson)
            .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
    }
}

/// Path parameters with our error shape.
pub struct ApiPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| ApiPath(p.0))
            .map_err(|e| ApiError::bad_request(format!("bad path: {}", e.body_text())))
    }
}

/// Query parameters with our error shape.
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| ApiQuery(q.0))
            .map_err(|e| ApiError::bad_request(format!("bad query: {}", e.body_text())))
    }
}

/// Runs a manager call on the blocking pool.
async fn blocking<T: Send + 'static>(
    mgr: &Arc<Manager>,
    f: impl FnOnce(&Manager) -> Result<T, ManagerError> + Send + 'static,
) -> ApiResult<T> {
    let m = mgr.clone();
    match tokio::task::spawn_blocking(move || f(&m)).await {
        Ok(r) => r.map_err(ApiError::from),
        Err(e) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("internal error: {e}"),
        )),
    }
}

/// The router.
pub fn router(mgr: Arc<Manager>) -> Router {
    let state = AppState {
        mgr,
        followers: Arc::new(Semaphore::new(MAX_FOLLOWERS)),
    };
    Router::new()
        .route("/v1/openapi.yaml", get(openapi))
        .route("/v1/status", get(status))
        .route("/v1/classes", get(list_classes).post(create_class))
        .route(
            "/v1/classes/{name}",
            get(get_class)
                .put(put_class)
                .patch(patch_class)
                .delete(delete_class),
        )
        .route("/v1/vms", get(list_vms).post(create_vm))
        .route(
            "/v1/vms/{name}",
            get(get_vm).patch(patch_vm).delete(delete_vm),
        )
        .route("/v1/vms/{name}/pause", post(pause_vm))
        .route("/v1/vms/{name}/resume", post(resume_vm))
        .route("/v1/vms/{name}/move", post(move_vm))
        .route("/v1/vms/{name}/disks/{disk}", patch(patch_disk))
        .route("/v1/vms/{name}/console", get(console))
        .route("/metrics", get(metrics_handler))
        .merge(crate::ui::router())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn(metrics::http::track))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "method not allowed on this endpoint",
    )
}

async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/yaml; charset=utf-8")],
        OPENAPI_YAML,
    )
        .into_response()
}

async fn status(State(s): State<AppState>) -> ApiResult<Json<dto::Status>> {
    let h = blocking(&s.mgr, |m| Ok(m.host())).await?;
    Ok(Json(h.into()))
}

async fn list_classes(State(s): State<AppState>) -> ApiResult<Json<Vec<dto::Class>>> {
    let v = blocking(&s.mgr, |m| Ok(m.list_classes())).await?;
    Ok(Json(v.into_iter().map(dto::Class::from).collect()))
}

async fn create_class(
    State(s): State<AppState>,
    ApiJson(body): ApiJson<dto::ClassCreate>,
) -> ApiResult<(StatusCode, Json<dto::Class>)> {
    let put = dto::ClassPut {
        parent: body.parent,
        shares: body.shares,
        cap: body.cap,
        reservation: body.reservation,
        io: body.io,
    };
    let name = body.name;
    let c = blocking(&s.mgr, move |m| {
        m.create_class_in(&name, put.config(), put.parent.as_deref())
    })
    .await?;
    Ok((StatusCode::CREATED, Json(c.into())))
}

async fn get_class(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<dto::Class>> {
    let c = blocking(&s.mgr, move |m| m.get_class(&name)).await?;
    Ok(Json(c.into()))
}

async fn put_class(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    ApiJson(body): ApiJson<dto::ClassPut>,
) -> ApiResult<(StatusCode, Json<dto::Class>)> {
    let (created, c) = blocking(&s.mgr, move |m| {
        m.set_class_in(&name, body.config(), body.parent.as_deref())
    })
    .await?;
    let code = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((code, Json(c.into())))
}

async fn patch_class(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    ApiJson(body): ApiJson<dto::ClassPatch>,
) -> ApiResult<Json<dto::Class>> {
    let c = blocking(&s.mgr, move |m| m.update_class(&name, |c| body.apply(c))).await?;
    Ok(Json(c.into()))
}

async fn delete_class(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<StatusCode> {
    blocking(&s.mgr, move |m| m.delete_class(&name)).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn list_vms(State(s): State<AppState>) -> ApiResult<Json<Vec<dto::Vm>>> {
    let v = blocking(&s.mgr, |m| Ok(m.list_vms())).await?;
    Ok(Json(v.into_iter().map(dto::Vm::from).collect()))
}

async fn create_vm(
    State(s): State<AppState>,
    ApiJson(body): ApiJson<dto::VmCreate>,
) -> ApiResult<(StatusCode, Json<dto::Vm>)> {
    let v = blocking(&s.mgr, move |m| m.create_vm(body.request())).await?;
    Ok((StatusCode::CREATED, Json(v.into())))
}

async fn get_vm(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<dto::Vm>> {
    let v = blocking(&s.mgr, move |m| m.get_vm(&id)).await?;
    Ok(Json(v.into()))
}

async fn delete_vm(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<StatusCode> {
    blocking(&s.mgr, move |m| m.delete_vm(&id)).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn pause_vm(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<dto::Vm>> {
    let v = blocking(&s.mgr, move |m| m.pause_vm(&id)).await?;
    Ok(Json(v.into()))
}

async fn resume_vm(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<dto::Vm>> {
    let v = blocking(&s.mgr, move |m| m.resume_vm(&id)).await?;
    Ok(Json(v.into()))
}

async fn patch_vm(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<dto::VmPatch>,
) -> ApiResult<Json<dto::Vm>> {
    let v = blocking(&s.mgr, move |m| match body.cap {
        Some(cap) => m.set_vm_cap(&id, cap),
        None => m.get_vm(&id),
    })
    .await?;
    Ok(Json(v.into()))
}

async fn move_vm(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<dto::MoveVm>,
) -> ApiResult<Json<dto::Vm>> {
    let v = blocking(&s.mgr, move |m| m.move_vm(&id, &body.class, body.weight)).await?;
    Ok(Json(v.into()))
}

async fn patch_disk(
    State(s): State<AppState>,
    ApiPath((id, disk)): ApiPath<(String, String)>,
    ApiJson(body): ApiJson<dto::Limits>,
) -> ApiResult<Json<dto::Disk>> {
    let d = blocking(&s.mgr, move |m| m.set_disk_limits(&id, &disk, body.into())).await?;
    Ok(Json(d.into()))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ConsoleQuery {
    tail: Option<u32>,
    #[serde(default)]
    follow: bool,
}

/// The last `n` lines of `data`.
fn last_lines(data: &[u8], n: usize) -> &[u8] {
    if n == 0 {
        return &[];
    }
    let body = data.strip_suffix(b"\n").unwrap_or(data);
    let mut seen = 0;
    for (i, b) in body.iter().enumerate().rev() {
        if *b == b'\n' {
            seen += 1;
            if seen == n {
                return &data[i + 1..];
            }
        }
    }
    data
}

async fn console(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<ConsoleQuery>,
) -> ApiResult<Response> {
    let watch = blocking(&s.mgr, move |m| m.console_watch(&id)).await?;
    let log = watch.log.clone();
    // Everything kept, and the offset after it, in one consistent read.
    let (data, offset, closed) = log.read_from(0, Duration::ZERO);
    let closed = closed || watch.finished();
    let head = match q.tail {
        Some(n) => last_lines(&data, n as usize).to_vec(),
        None => data,
    };
    let text = [(header::CONTENT_TYPE, "text/plain; charset=utf-8")];
    if !q.follow || closed {
        return Ok((text, head).into_response());
    }
    let permit = s.followers.clone().try_acquire_owned().map_err(|_| {
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_requests",
            format!("at most {MAX_FOLLOWERS} console streams at once"),
        )
    })?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        if !head.is_empty() && tx.blocking_send(Ok(Bytes::from(head))).is_err() {
            return;
        }
        let mut off = offset;
        loop {
            // Checked before the read, so output written before the stop is
            // still sent by this last round.
            let finished = watch.finished();
            let (chunk, next, closed) = log.read_from(off, Duration::from_millis(250));
            off = next;
            if !chunk.is_empty() && tx.blocking_send(Ok(Bytes::from(chunk))).is_err() {
                return;
            }
            if (closed || finished) && log.total() <= off {
                return;
            }
            if tx.is_closed() {
                return;
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    Ok((text, Body::from_stream(stream)).into_response())
}

async fn metrics_handler(
    State(s): State<AppState>,
    headers: axum::http::HeaderMap,
) -> ApiResult<Response> {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let format = metrics::expo::Format::negotiate(accept);
    let text = blocking(&s.mgr, move |m| Ok(metrics::render(m, format))).await?;
    Ok(([(header::CONTENT_TYPE, format.content_type())], text).into_response())
}

/// Options of `corral serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Unix socket to listen on (mode 0600).
    #[arg(long, default_value = crate::client::DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Also listen on this TCP address: HOST:PORT, the host a name
    /// (`localhost:7070`) or an address (`127.0.0.1:7070`, `[::1]:7070`).
    #[arg(long, value_name = "HOST:PORT", value_parser = parse_listen)]
    pub listen: Option<SocketAddr>,
    /// Allow a non-loopback --listen address (the API has no authentication).
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

/// Binds the Unix socket: refuses if a daemon answers there, removes a stale
/// socket file, creates the directory, sets mode 0600.
pub fn bind_unix(path: &FsPath) -> Result<tokio::net::UnixListener, ServeError> {
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(ServeError::Config(format!(
            "a daemon is already listening on {}",
            path.display()
        )));
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if meta.file_type().is_socket() {
            std::fs::remove_file(path).map_err(io(format!("removing {}", path.display())))?;
        } else {
            return Err(ServeError::Config(format!(
                "{} exists and is not a socket",
                path.display()
            )));
        }
    }
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    }
    let l =
        tokio::net::UnixListener::bind(path).map_err(io(format!("binding {}", path.display())))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(io(format!("chmod 0600 {}", path.display())))?;
    Ok(l)
}

/// Serves `router` on the given listeners until `shutdown` resolves; then
/// lets open requests finish for up to 5 s.
pub async fn serve_on(
    router: Router,
    unix: tokio::net::UnixListener,
    tcp: Option<tokio::net::TcpListener>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let (tx, rx) = tokio::sync::watch::channel(false);
    let wait = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|v| *v).await;
    };
    let u = axum::serve(unix, router.clone()).with_graceful_shutdown(wait(rx.clone()));
    let unix_task = tokio::spawn(async move {
        if let Err(e) = u.await {
            tracing::error!("unix socket server: {e}");
        }
    });
    let tcp_task = tcp.map(|l| {
        let t = axum::serve(l, router).with_graceful_shutdown(wait(rx.clone()));
        tokio::spawn(async move {
            if let Err(e) = t.await {
                tracing::error!("TCP server: {e}");
            }
        })
    });
    shutdown.await;
    let _ = tx.send(true);
    let all = async {
        let _ = unix_task.await;
        if let Some(t) = tcp_task {
            let _ = t.await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(5), all)
        .await
        .is_err()
    {
        tracing::warn!("some connections did not close within 5 s; exiting anyway");
    }
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

/// Waits for SIGINT or SIGTERM.
pub async fn terminate_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("cannot catch SIGTERM: {e}");
            std::future::pending::<()>().await;
            return;
        }
    };
    let mut int = match signal(SignalKind::interrupt()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("cannot catch SIGINT: {e}");
            std::future::pending::<()>().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
}

/// `corral serve`.
pub fn serve(args: ServeArgs, builtin: Arc<[u8]>) -> Result<(), ServeError> {
    if let Some(addr) = args.listen
        && !addr.ip().is_loopback()
        && !args.allow_remote
    {
        return Err(ServeError::Config(format!(
            "--listen {addr} is not a loopback address; the API has no authentication, \
             pass --allow-remote to listen there anyway"
        )));
    }
    let host_files =
        corral_vmm::hostfile::HostPolicy::beneath(&args.image_dir, args.allow_block_devices)
            .map_err(io("--image-dir"))?;
    let cfg = corral_vmm::manager::ManagerConfig {
        capacity: args.capacity.map(corral_scheduler::Capacity::from_percent),
        max_vms: args.max_vms,
        memory_budget_mib: args.memory_budget,
        max_classes: args.max_classes,
        host_files,
        builtin_kernel: Some(builtin),
        cpu_backend: args.cpu_backend,
        ..Default::default()
    };
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
    let mgr = Arc::new(Manager::new(cfg)?);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(128)
        .enable_all()
        .build()
        .map_err(io("starting the tokio runtime"))?;
    let r = rt.block_on(async {
        let unix = bind_unix(&args.socket)?;
        let tcp = match args.listen {
            Some(a) => Some(
                tokio::net::TcpListener::bind(a)
                    .await
                    .map_err(io(format!("binding {a}")))?,
            ),
            None => None,
        };
        let tcp_addr = tcp.as_ref().and_then(|l| l.local_addr().ok());
        // One line on stdout for scripts and tests.
        match tcp_addr {
            Some(a) => println!(
                "corral: listening on {} and http://{a}",
                args.socket.display()
            ),
            None => println!("corral: listening on {}", args.socket.display()),
        }
        spawn_cpu_sampler(mgr.clone());
        let m = mgr.clone();
        let shutdown = async move {
            terminate_signal().await;
            let _ = tokio::task::spawn_blocking(move || m.shutdown()).await;
        };
        serve_on(router(mgr.clone()), unix, tcp, shutdown).await;
        Ok::<(), ServeError>(())
    });
    let _ = std::fs::remove_file(&args.socket);
    mgr.shutdown();
    rt.shutdown_timeout(Duration::from_secs(1));
    r
}
