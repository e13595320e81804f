//! A small HTTP/1.1 client of the API over the Unix socket or TCP (hyper).

use std::path::PathBuf;

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::dto;

/// Where the daemon listens by default.
pub const DEFAULT_SOCKET: &str = "/run/corral/corral.sock";
/// Where the daemon writes its TCP token by default (beside the socket).
pub const DEFAULT_TOKEN_FILE: &str = "/run/corral/token";

/// Where to reach the daemon.
#[derive(Debug, Clone)]
pub enum Target {
    /// A Unix socket.
    Unix(PathBuf),
    /// `host:port` over TCP.
    Tcp(String),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unix(p) => write!(f, "{}", p.display()),
            Self::Tcp(a) => write!(f, "http://{a}"),
        }
    }
}

/// Client errors.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon could not be reached.
    #[error(
        "cannot reach the corral daemon at {target}: {err} (is `corral serve` running? see --socket / --url)"
    )]
    Connect {
        /// Where.
        target: String,
        /// Why.
        err: std::io::Error,
    },
    /// HTTP failure.
    #[error("talking to the daemon: {0}")]
    Http(String),
    /// The API answered with an error.
    #[error("{message} ({status}, {code})")]
    Api {
        /// HTTP status.
        status: StatusCode,
        /// Error code.
        code: String,
        /// Message.
        message: String,
    },
    /// Bad `--url`.
    #[error("{0}")]
    Usage(String),
}

/// The API client.
#[derive(Debug, Clone)]
pub struct Client {
    target: Target,
    /// The bearer token sent over TCP.
    token: Option<String>,
}

/// The body of a streaming response.
pub type Incoming = hyper::body::Incoming;

impl Client {
    /// A client of `target`.
    pub fn new(target: Target) -> Self {
        Self {
            target,
            token: None,
        }
    }

    /// From `--socket` / `--url` / `--token-file` (read for `--url` only;
    /// default [`DEFAULT_TOKEN_FILE`]).
    pub fn from_args(
        socket: Option<PathBuf>,
        url: Option<String>,
        token_file: Option<PathBuf>,
    ) -> Result<Self, ClientError> {
        if let Some(u) = url {
            let rest = u.strip_prefix("http://").ok_or_else(|| {
                ClientError::Usage(format!("--url {u}: only http://HOST:PORT is supported"))
            })?;
            let hostport = rest.trim_end_matches('/');
            if hostport.is_empty() || hostport.contains('/') {
                return Err(ClientError::Usage(format!(
                    "--url {u}: expected http://HOST:PORT"
                )));
            }
            let path = token_file.unwrap_or_else(|| PathBuf::from(DEFAULT_TOKEN_FILE));
            let token = std::fs::read_to_string(&path).map_err(|e| {
                ClientError::Usage(format!(
                    "cannot read the daemon's token from {}: {e} (the TCP API needs it; \
                     see --token-file / CORRAL_TOKEN_FILE)",
                    path.display()
                ))
            })?;
            return Ok(Self {
                target: Target::Tcp(hostport.to_string()),
                token: Some(token.trim().to_string()),
            });
        }
        Ok(Self::new(Target::Unix(
            socket.unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET)),
        )))
    }

    /// The target.
    pub fn target(&self) -> &Target {
        &self.target
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<hyper::Response<Incoming>, ClientError> {
        let connect_err = |err| ClientError::Connect {
            target: self.target.to_string(),
            err,
        };
        let host = match &self.target {
            Target::Unix(_) => "localhost".to_string(),
            Target::Tcp(a) => a.clone(),
        };
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, host);
        if body.is_some() {
            req = req.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        if let (Target::Tcp(_), Some(t)) = (&self.target, &self.token) {
            req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| ClientError::Http(e.to_string()))?;
        macro_rules! go {
            ($stream:expr) => {{
                let (mut sender, conn) =
                    hyper::client::conn::http1::handshake(TokioIo::new($stream))
                        .await
                        .map_err(|e| ClientError::Http(e.to_string()))?;
                tokio::spawn(async move {
                    let _ = conn.await;
                });
                sender
                    .send_request(req)
                    .await
                    .map_err(|e| ClientError::Http(e.to_string()))
            }};
        }
        match &self.target {
            Target::Unix(p) => {
                let s = tokio::net::UnixStream::connect(p)
                    .await
                    .map_err(connect_err)?;
                go!(s)
            }
            Target::Tcp(a) => {
                let s = tokio::net::TcpStream::connect(a.as_str())
                    .await
                    .map_err(connect_err)?;
                go!(s)
            }
        }
    }

    /// A request; returns the status and the whole body; API errors become
    /// `ClientError::Api`.
    pub async fn raw(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), ClientError> {
        let resp = self.send(method, path, body).await?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| ClientError::Http(e.to_string()))?
            .to_bytes();
        if !status.is_success() {
            return Err(match serde_json::from_slice::<dto::ErrorBody>(&bytes) {
                Ok(e) => ClientError::Api {
                    status,
                    code: e.error.code,
                    message: e.error.message,
                },
                Err(_) => ClientError::Api {
                    status,
                    code: "http".into(),
                    message: String::from_utf8_lossy(&bytes).into_owned(),
                },
            });
        }
        Ok((status, bytes))
    }

    /// A request with a streaming body.
    pub async fn stream(&self, path: &str) -> Result<Incoming, ClientError> {
        let resp = self.send(Method::GET, path, None).await?;
        let status = resp.status();
        if !status.is_success() {
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| ClientError::Http(e.to_string()))?
                .to_bytes();
            let e: Option<dto::ErrorBody> = serde_json::from_slice(&bytes).ok();
            return Err(ClientError::Api {
                status,
                code: e.as_ref().map_or("http".into(), |e| e.error.code.clone()),
                message: e.map_or_else(
                    || String::from_utf8_lossy(&bytes).into_owned(),
                    |e| e.error.message,
                ),
            });
        }
        Ok(resp.into_body())
    }

    /// A JSON request and response.
    pub async fn json<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&impl Serialize>,
    ) -> Result<T, ClientError> {
        let body = match body {
            Some(b) => Some(serde_json::to_vec(b).map_err(|e| ClientError::Http(e.to_string()))?),
            None => None,
        };
        let (_, bytes) = self.raw(method, path, body).await?;
        serde_json::from_slice(&bytes)
            .map_err(|e| ClientError::Http(format!("unexpected answer from the daemon: {e}")))
    }

    /// GET returning JSON.
    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, ClientError> {
        self.json(Method::GET, path, None::<&()>).await
    }
}

/// Percent-encodes a path segment (names are restricted, but be safe).
pub fn seg(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
