//! API request metrics: an axum middleware that counts every request and
//! times it (to the response's head) by route template, method and status
//! code. The route is the matched template (`/v1/vms/{name}`), never the
//! raw path, so the number of series stays bounded whatever clients send.

use std::collections::BTreeMap;
use std::sync::{LazyLock, Mutex, PoisonError};
use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use prometheus_client::metrics::histogram::Histogram;

use super::expo::{Fam, Reg, l};

/// Latency bucket bounds, seconds.
const BOUNDS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// (route, method, code).
type Key = (String, &'static str, u16);

struct Series {
    count: u64,
    duration: Histogram,
}

/// Process-wide: one daemon per process, and the middleware must not need
/// the router's state.
static REQUESTS: LazyLock<Mutex<BTreeMap<Key, Series>>> = LazyLock::new(Mutex::default);

/// A bounded method label.
fn method_label(m: &axum::http::Method) -> &'static str {
    use axum::http::Method;
    match *m {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

/// Records one request.
pub fn record(route: String, method: &'static str, code: u16, secs: f64) {
    let mut map = REQUESTS.lock().unwrap_or_else(PoisonError::into_inner);
    let s = map.entry((route, method, code)).or_insert_with(|| Series {
        count: 0,
        duration: Histogram::new(BOUNDS.iter().copied()),
    });
    s.count += 1;
    s.duration.observe(secs);
}

/// The middleware (`axum::middleware::from_fn(track)`).
pub async fn track(req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let method = method_label(req.method());
    let t0 = Instant::now();
    let resp = next.run(req).await;
    record(
        route,
        method,
        resp.status().as_u16(),
        t0.elapsed().as_secs_f64(),
    );
    resp
}

/// Registers the `corral_api_*` families.
pub fn register(r: &mut Reg) {
    let count = r.counts(
        "corral_api_requests",
        "API requests answered, by route template, method and status code",
    );
    let dur: Fam<Histogram> = r.family(
        "corral_api_request_duration_seconds",
        "Time from a request's arrival to its response head, by route template, method and status code",
    );
    let map = REQUESTS.lock().unwrap_or_else(PoisonError::into_inner);
    for ((route, method, code), s) in map.iter() {
        let labels = l(&[
            ("route", route),
            ("method", method),
            ("code", &code.to_string()),
        ]);
        count.set(labels.clone(), s.count);
        dur.put(labels, s.duration.clone());
    }
}
