//! The request guard, in front of every route: refuses Unix socket peers
//! that the SO_PEERCRED check refused, checks the TCP listener's bearer
//! token and Host header, refuses browser-style writes, reads the body
//! within the body timeout, and clips client input out of error messages.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::MAX_BODY_BYTES;
use super::error::{ApiError, clip, scrub};
use super::http::{ConnInfo, HttpLimits};

/// What the TCP listener demands of a request.
#[derive(Debug, Clone)]
pub struct TcpAuth {
    /// The bearer token.
    pub token: String,
    /// The accepted Host header values, lower case.
    pub hosts: Vec<String>,
}

impl TcpAuth {
    /// For a listener on `addr`: the Host may be that address, localhost,
    /// 127.0.0.1 or [::1] with its port, or one of `allow` (with the port,
    /// or as given if it has one).
    pub fn new(token: String, addr: SocketAddr, allow: &[String]) -> Self {
        let port = addr.port();
        let mut hosts = vec![
            addr.to_string(),
            format!("localhost:{port}"),
            format!("127.0.0.1:{port}"),
            format!("[::1]:{port}"),
        ];
        for a in allow {
            let a = a.to_ascii_lowercase();
            let has_port = a.rsplit_once(':').is_some_and(|(h, p)| {
                p.parse::<u16>().is_ok() && (!h.contains(':') || h.ends_with(']'))
            });
            if !has_port {
                hosts.push(format!("{a}:{port}"));
            }
            hosts.push(a);
        }
        let mut seen = std::collections::HashSet::new();
        hosts.retain(|h| seen.insert(h.clone()));
        Self { token, hosts }
    }

    /// The Host check, then the token (skipped for the dashboard's static
    /// files, which hold nothing and which a browser fetches without it).
    fn check(&self, method: &Method, path: &str, h: &HeaderMap) -> Result<(), ApiError> {
        self.check_host(h)?;
        let static_ui = matches!(*method, Method::GET | Method::HEAD)
            && matches!(path, "/ui" | "/ui/" | "/ui/app.js" | "/ui/style.css");
        if static_ui {
            return Ok(());
        }
        self.check_token(h)
    }

    fn check_host(&self, h: &HeaderMap) -> Result<(), ApiError> {
        let host = h
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| ApiError::forbidden("a Host header naming this daemon is required"))?;
        if !self.hosts.iter().any(|a| a.eq_ignore_ascii_case(host)) {
            return Err(ApiError::forbidden(format!(
                "Host {:?} is not this daemon's address; accepted: {} (add names with --allow-host)",
                clip(host),
                self.hosts.join(", ")
            )));
        }
        Ok(())
    }

    /// Whether `origin` is this daemon's own (the dashboard's requests).
    fn same_origin(&self, origin: &str) -> bool {
        origin
            .strip_prefix("http://")
            .is_some_and(|o| self.hosts.iter().any(|a| a.eq_ignore_ascii_case(o)))
    }

    fn check_token(&self, h: &HeaderMap) -> Result<(), ApiError> {
        let mut auth = h.get_all(header::AUTHORIZATION).iter();
        let given = match (auth.next(), auth.next()) {
            (Some(v), None) => v.to_str().ok().and_then(|v| {
                let (scheme, token) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
            }),
            _ => None,
        };
        match given {
            Some(t) if equal_in_constant_time(t.as_bytes(), self.token.as_bytes()) => Ok(()),
            Some(_) => Err(unauthorized("the bearer token is wrong")),
            None => Err(unauthorized(
                "the TCP API needs `Authorization: Bearer <token>`; the token is in the daemon's \
                 token file (--token-file; by default `token` beside its socket)",
            )),
        }
    }
}

fn unauthorized(msg: &str) -> ApiError {
    ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", msg)
}

/// `a == b`, in a time that depends only on the lengths.
pub fn equal_in_constant_time(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a
        .iter()
        .zip(b)
        .fold(0u8, |acc, (x, y)| std::hint::black_box(acc | (x ^ y)));
    std::hint::black_box(diff) == 0
}

/// The guard of one listener.
#[derive(Debug, Clone, Default)]
pub struct Guard {
    /// The TCP listener's checks (None on the Unix socket).
    pub tcp: Option<TcpAuth>,
}

/// A request with a body: a non-zero Content-Length, or any Transfer-Encoding.
fn has_body(h: &HeaderMap) -> bool {
    h.contains_key(header::TRANSFER_ENCODING)
        || h.get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim() != "0")
}

fn is_json(v: Option<&HeaderValue>) -> bool {
    v.and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
}

/// Refuses what a web page could make a browser send: a write carrying an
/// Origin header other than the daemon's own (its dashboard), or a body that
/// is not JSON (form posts and `text/plain` need no CORS preflight).
fn check_browser_write(
    tcp: Option<&TcpAuth>,
    method: &Method,
    h: &HeaderMap,
) -> Result<(), ApiError> {
    let read = matches!(*method, Method::GET | Method::HEAD);
    if let Some(origin) = h.get(header::ORIGIN)
        && !read
    {
        let own = origin
            .to_str()
            .ok()
            .is_some_and(|o| tcp.is_some_and(|t| t.same_origin(o)));
        if !own {
            return Err(ApiError::forbidden(
                "cross-origin writes are refused: this request carries a foreign Origin header",
            ));
        }
    }
    if has_body(h) && !is_json(h.get(header::CONTENT_TYPE)) {
        return Err(ApiError::forbidden(
            "a request body must have Content-Type: application/json",
        ));
    }
    Ok(())
}

/// The middleware.
pub async fn check(State(g): State<Arc<Guard>>, req: Request, next: Next) -> Response {
    if let Some(why) = req
        .extensions()
        .get::<ConnInfo>()
        .and_then(|c| c.refused.clone())
    {
        let mut r = ApiError::forbidden(why).into_response();
        r.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return r;
    }
    if let Some(tcp) = &g.tcp
        && let Err(e) = tcp.check(req.method(), req.uri().path(), req.headers())
    {
        let mut r = e.into_response();
        if r.status() == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        return r;
    }
    if let Err(e) = check_browser_write(g.tcp.as_ref(), req.method(), req.headers()) {
        return e.into_response();
    }
    let limits = req
        .extensions()
        .get::<HttpLimits>()
        .copied()
        .unwrap_or_default();
    let (parts, body) = req.into_parts();
    let read = axum::body::to_bytes(body, MAX_BODY_BYTES);
    let bytes = match tokio::time::timeout(limits.body_timeout, read).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            return if too_large {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "payload_too_large",
                    format!("request body larger than {MAX_BODY_BYTES} bytes"),
                )
            } else {
                ApiError::bad_request(format!("cannot read the request body: {e}"))
            }
            .into_response();
        }
        Err(_) => {
            return ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                format!(
                    "the request body did not arrive within {} s",
                    limits.body_timeout.as_secs_f64()
                ),
            )
            .into_response();
        }
    };
    let inputs = client_inputs(&parts.uri, &bytes);
    let resp = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    if inputs.is_empty()
        || resp.status().is_success()
        || !is_json(resp.headers().get(header::CONTENT_TYPE))
    {
        return resp;
    }
    scrub_response(resp, &inputs).await
}

/// Rewrites an error response's message with [`scrub`].
async fn scrub_response(resp: Response, inputs: &[String]) -> Response {
    let (mut parts, body) = resp.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 1 << 20).await else {
        return (StatusCode::INTERNAL_SERVER_ERROR, "error body too large").into_response();
    };
    let mut v: serde_json::Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(_) => return Response::from_parts(parts, Body::from(bytes)),
    };
    if let Some(m) = v
        .pointer_mut("/error/message")
        .and_then(|m| m.as_str().map(str::to_string))
    {
        v["error"]["message"] = scrub(&m, inputs).into();
    }
    let out = serde_json::to_vec(&v).unwrap_or_default();
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(out))
}

/// The long pieces of client input an error message might repeat: the
/// decoded path segments and query, and the JSON body's keys and strings.
fn client_inputs(uri: &axum::http::Uri, body: &Bytes) -> Vec<String> {
    let mut out = Vec::new();
    let mut add = |s: String| {
        if s.len() > super::error::MAX_QUOTE {
            out.push(s);
        }
    };
    let path = uri.path();
    add(percent_decode(path));
    for seg in path.split('/') {
        add(percent_decode(seg));
    }
    if let Some(q) = uri.query() {
        for kv in q.split('&') {
            for p in kv.split('=') {
                add(percent_decode(&p.replace('+', " ")));
            }
        }
    }
    if !body.is_empty() {
        match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(v) => json_strings(&v, &mut add),
            Err(_) => add(String::from_utf8_lossy(body).into_owned()),
        }
    }
    out
}

fn json_strings(v: &serde_json::Value, add: &mut impl FnMut(String)) {
    match v {
        serde_json::Value::String(s) => add(s.clone()),
        serde_json::Value::Array(a) => a.iter().for_each(|x| json_strings(x, add)),
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                add(k.clone());
                json_strings(x, add);
            }
        }
        _ => {}
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%'
            && let (Some(h), Some(l)) = (
                b.get(i + 1).and_then(|&c| hex(c)),
                b.get(i + 2).and_then(|&c| hex(c)),
            )
        {
            out.push((h * 16 + l) as u8);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_by_content_and_length() {
        assert!(equal_in_constant_time(b"abc", b"abc"));
        assert!(!equal_in_constant_time(b"abc", b"abd"));
        assert!(!equal_in_constant_time(b"abc", b"abcd"));
    }

    #[test]
    fn hosts_with_and_without_ports() {
        let a = TcpAuth::new(
            "t".into(),
            "127.0.0.1:7070".parse().unwrap(),
            &["corral.example".into(), "box:80".into()],
        );
        let ok = |h: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::HOST, h.parse().unwrap());
            m.insert(header::AUTHORIZATION, "Bearer t".parse().unwrap());
            a.check(&Method::GET, "/v1/vms", &m).is_ok()
        };
        for h in [
            "127.0.0.1:7070",
            "localhost:7070",
            "[::1]:7070",
            "corral.example:7070",
            "box:80",
            "LOCALHOST:7070",
        ] {
            assert!(ok(h), "{h}");
        }
        for h in [
            "evil.example.com",
            "localhost",
            "127.0.0.1:7071",
            "box:7070",
            "evil:7070",
        ] {
            assert!(!ok(h), "{h}");
        }
    }

    #[test]
    fn origins_and_the_static_dashboard() {
        let a = TcpAuth::new("t".into(), "127.0.0.1:7070".parse().unwrap(), &[]);
        let with = |k: header::HeaderName, v: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::HOST, "localhost:7070".parse().unwrap());
            m.insert(k, v.parse().unwrap());
            m
        };
        let own = with(header::ORIGIN, "http://localhost:7070");
        let evil = with(header::ORIGIN, "http://evil.example.com");
        assert!(check_browser_write(Some(&a), &Method::PATCH, &own).is_ok());
        assert!(check_browser_write(Some(&a), &Method::PATCH, &evil).is_err());
        assert!(check_browser_write(None, &Method::PATCH, &own).is_err());
        assert!(check_browser_write(Some(&a), &Method::GET, &evil).is_ok());
        let no_token = with(header::ACCEPT, "*/*");
        assert!(a.check(&Method::GET, "/ui", &no_token).is_ok());
        assert!(a.check(&Method::GET, "/ui/app.js", &no_token).is_ok());
        assert!(a.check(&Method::GET, "/v1/vms", &no_token).is_err());
        assert!(a.check(&Method::POST, "/ui", &no_token).is_err());
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("a%20b%zz%4"), "a b%zz%4");
    }
}
