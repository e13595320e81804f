//! The lifecycle endpoints of a defined VM: `stop` (hard, keeping the
//! definition), `start`, `reboot`, `shutdown` (the ACPI power button, then a
//! hard stop after `timeout_seconds`) and console input (`POST` on the
//! console: text typed on the guest's serial port).

use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Request, State};
use axum::routing::post;
use serde::{Deserialize, Serialize};

use super::error::ApiError;
use super::json::{ApiJson, ApiPath};
use super::routes::{ApiResult, AppState, blocking};
use crate::dto;

/// Bytes of console input one request may carry.
pub const MAX_CONSOLE_INPUT: usize = 4096;
/// The graceful shutdown's default deadline.
pub const DEFAULT_SHUTDOWN_TIMEOUT_S: f64 = 30.0;

/// The body of `POST /v1/vms/{name}/shutdown` (optional).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Shutdown {
    /// Seconds the guest has to power off before a hard stop (0..=600).
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
}

/// The body of `POST /v1/vms/{name}/console`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleInput {
    /// Text to type (at most 4096 bytes of UTF-8).
    pub data: String,
}

/// The answer to console input.
#[derive(Debug, Serialize, Deserialize)]
pub struct ConsoleAccepted {
    /// Bytes the guest's receive FIFO took; send the rest again later.
    pub accepted: usize,
}

/// A JSON body where an empty body means the defaults (`POST .../shutdown`
/// with no body); otherwise parsed exactly as [`ApiJson`].
pub struct JsonOrDefault<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned + Default> FromRequest<S> for JsonOrDefault<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let (parts, body) = req.into_parts();
        let bytes = Bytes::from_request(Request::from_parts(parts.clone(), body), state)
            .await
            .map_err(|e| {
                ApiError::bad_request(format!("cannot read the request body: {}", e.body_text()))
            })?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self(T::default()));
        }
        let req = Request::from_parts(parts, Body::from(bytes));
        ApiJson::<T>::from_request(req, state)
            .await
            .map(|ApiJson(v)| Self(v))
    }
}

/// The routes, merged into the API router.
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/vms/{name}/stop", post(stop))
        .route("/v1/vms/{name}/start", post(start))
        .route("/v1/vms/{name}/reboot", post(reboot))
        .route("/v1/vms/{name}/shutdown", post(shutdown))
}

async fn stop(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<dto::Vm>> {
    let v = blocking(&s.mgr, move |m| m.stop_vm(&name)).await?;
    Ok(Json(v.into()))
}

async fn start(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<dto::Vm>> {
    let v = blocking(&s.mgr, move |m| m.start_vm(&name)).await?;
    Ok(Json(v.into()))
}

async fn reboot(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<dto::Vm>> {
    let v = blocking(&s.mgr, move |m| m.reboot_vm(&name)).await?;
    Ok(Json(v.into()))
}

/// VMs with a shutdown in progress: one background wait per VM at most, so
/// the waits are bounded by the number of VMs (not by how often a client
/// asks).
static SHUTTING_DOWN: std::sync::Mutex<std::collections::BTreeSet<String>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

fn shutting_down() -> std::sync::MutexGuard<'static, std::collections::BTreeSet<String>> {
    SHUTTING_DOWN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `POST /v1/vms/{name}/shutdown`: presses the power button and answers at
/// once (202, the VM as it is now); the daemon waits up to the timeout in
/// the background and stops the VM hard if the guest has not powered off by
/// then. Clients that want the outcome poll `GET /v1/vms/{name}` (`corral vm
/// shutdown` does). No request waits for the guest: a slow guest cannot tie
/// up the API's connections.
async fn shutdown(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    JsonOrDefault(body): JsonOrDefault<Shutdown>,
) -> ApiResult<(axum::http::StatusCode, Json<dto::Vm>)> {
    let secs = body.timeout_seconds.unwrap_or(DEFAULT_SHUTDOWN_TIMEOUT_S);
    let max = corral_vmm::manager::MAX_SHUTDOWN_TIMEOUT.as_secs_f64();
    if !(0.0..=max).contains(&secs) {
        return Err(ApiError::bad_request(format!(
            "timeout_seconds must be in 0..={max}"
        )));
    }
    let n = name.clone();
    let now = blocking(&s.mgr, move |m| m.get_vm(&n)).await?;
    if shutting_down().insert(name.clone()) {
        let mgr = s.mgr.clone();
        tokio::task::spawn_blocking(move || {
            if let Err(e) = mgr.shutdown_vm(&name, Duration::from_secs_f64(secs)) {
                tracing::warn!(vm = %name, "shutdown: {e}");
            }
            shutting_down().remove(&name);
        });
    }
    Ok((axum::http::StatusCode::ACCEPTED, Json(now.into())))
}

/// `POST /v1/vms/{name}/console`: types text on the guest's serial port.
pub async fn console_input(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    ApiJson(body): ApiJson<ConsoleInput>,
) -> ApiResult<Json<ConsoleAccepted>> {
    if body.data.len() > MAX_CONSOLE_INPUT {
        return Err(ApiError::bad_request(format!(
            "data must be at most {MAX_CONSOLE_INPUT} bytes, got {}",
            body.data.len()
        )));
    }
    let accepted = blocking(&s.mgr, move |m| {
        m.console_input(&name, body.data.as_bytes())
    })
    .await?;
    Ok(Json(ConsoleAccepted { accepted }))
}
