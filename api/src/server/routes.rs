//! The REST routes and their handlers.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, patch, post};
use axum::{Extension, Json, Router};
use corral_vmm::manager::{Manager, ManagerError};

use super::error::ApiError;
use super::followers::Followers;
use super::http::ConnInfo;
use super::json::{ApiJson, ApiPath, ApiQuery};
use super::{MAX_BODY_BYTES, OPENAPI_YAML};
use crate::dto;
use crate::metrics;

/// Shared state of the handlers.
#[derive(Clone)]
pub struct AppState {
    /// The manager.
    pub mgr: Arc<Manager>,
    followers: Arc<Followers>,
}

pub(super) type ApiResult<T> = Result<T, ApiError>;

/// Runs a manager call on the blocking pool.
pub(super) async fn blocking<T: Send + 'static>(
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
        followers: Arc::new(Followers::default()),
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
        .route(
            "/v1/vms/{name}/console",
            get(console).post(super::vm_lifecycle::console_input),
        )
        .merge(super::vm_lifecycle::router())
        .route("/metrics", get(metrics_handler))
        .merge(crate::ui::router())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
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
    let v = blocking(&s.mgr, move |m| {
        if let Some(w) = body.weight {
            m.set_vm_weight(&id, w)?;
        }
        match body.cap {
            Some(cap) => m.set_vm_cap(&id, cap),
            None => m.get_vm(&id),
        }
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
    let d = blocking(&s.mgr, move |m| m.set_disk_limits(&id, &disk, body)).await?;
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
    conn: Option<Extension<ConnInfo>>,
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
    let client = conn.map_or_else(|| "in-process".to_string(), |c| c.0.client());
    let permit = s.followers.acquire(&client)?;
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
