//! The HTTP/1.1 side of `corral serve`: an accept loop per listener with a
//! cap on its connections, the Unix socket's peer check (SO_PEERCRED), and
//! per-connection timeouts for reading a request head, staying idle between
//! requests and a client that stops reading (axum::serve has none of these).
//!
//! Timeouts are enforced by a watchdog per connection that looks at the
//! connection's I/O, not by hyper's `header_read_timeout`: hyper arms that
//! one as soon as a connection turns idle, so an idle keep-alive connection
//! and a slow request head could not have different limits.

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{Semaphore, watch};
use tower::ServiceExt;

/// Connection limits of one listener.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// From the first byte of a request head to its end.
    pub header_timeout: Duration,
    /// For reading a request body (enforced by the request guard).
    pub body_timeout: Duration,
    /// A keep-alive connection with no request.
    pub idle_timeout: Duration,
    /// A response write that makes no progress (the client does not read).
    pub write_timeout: Duration,
    /// Most open connections on the listener.
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            write_timeout: Duration::from_secs(30),
            max_connections: 256,
        }
    }
}

/// Who is on the other end of a connection; put in every request's
/// extensions.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    /// The peer.
    pub peer: Peer,
    /// Why this Unix socket peer may not use the API (None: it may).
    pub refused: Option<String>,
}

/// A connection's peer.
#[derive(Debug, Clone)]
pub enum Peer {
    /// A Unix socket peer, by SO_PEERCRED.
    Unix {
        /// Its uid.
        uid: u32,
    },
    /// A TCP peer.
    Tcp(IpAddr),
}

impl ConnInfo {
    /// The client, as the console follower limit counts them.
    pub fn client(&self) -> String {
        match &self.peer {
            Peer::Unix { uid, .. } => format!("uid {uid}"),
            Peer::Tcp(ip) => format!("TCP peer {ip}"),
        }
    }
}

/// Who may use the Unix socket: uid 0, the daemon's own uid, and the
/// members of `group` (primary or supplementary group of the peer).
#[derive(Debug, Clone, Copy)]
pub struct UnixPolicy {
    /// `--socket-group`.
    pub group: Option<u32>,
}

impl UnixPolicy {
    fn check(&self, s: &tokio::net::UnixStream) -> ConnInfo {
        let cred = match s.peer_cred() {
            Ok(c) => c,
            Err(e) => {
                return ConnInfo {
                    peer: Peer::Unix { uid: u32::MAX },
                    refused: Some(format!("cannot read the peer's credentials: {e}")),
                };
            }
        };
        let uid = cred.uid();
        // SAFETY: geteuid(2) cannot fail.
        let me = unsafe { libc::geteuid() };
        let member = self
            .group
            .is_some_and(|g| cred.gid() == g || peer_groups(s).contains(&g));
        let pid = cred.pid().unwrap_or(0);
        let refused = (!(uid == 0 || uid == me || member)).then(|| match self.group {
            Some(g) => format!(
                "uid {uid} (pid {pid}) may not use this socket: only root, uid {me} and \
                 members of group {g}"
            ),
            None => format!(
                "uid {uid} (pid {pid}) may not use this socket: only root and uid {me} \
                 (see --socket-group)"
            ),
        });
        ConnInfo {
            peer: Peer::Unix { uid },
            refused,
        }
    }
}

/// The peer's supplementary groups at connect time (SO_PEERGROUPS).
fn peer_groups(s: &tokio::net::UnixStream) -> Vec<u32> {
    use std::os::fd::AsRawFd;
    const SO_PEERGROUPS: libc::c_int = 59;
    let mut groups = vec![0u32; 256];
    let mut len = (groups.len() * 4) as libc::socklen_t;
    // SAFETY: getsockopt(2) writes at most `len` bytes into `groups`, which
    // has that many, and stores the length it wrote in `len`.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERGROUPS,
            groups.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Vec::new();
    }
    groups.truncate(len as usize / 4);
    groups
}

/// Logs at most one line per 10 s per call site.
pub struct RateLimitedLog {
    last: AtomicU64,
}

impl RateLimitedLog {
    /// A new limiter.
    pub const fn new() -> Self {
        Self {
            last: AtomicU64::new(0),
        }
    }

    /// Whether to log now.
    pub fn ready(&self) -> bool {
        static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        let now = START.get_or_init(Instant::now).elapsed().as_secs() + 10;
        let last = self.last.load(Ordering::Relaxed);
        now >= last + 10
            && self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

static ACCEPT_LOG: RateLimitedLog = RateLimitedLog::new();
static REFUSED_LOG: RateLimitedLog = RateLimitedLog::new();

/// A listener of the accept loop.
pub enum Listener {
    /// The Unix socket, with who may use it.
    Unix(tokio::net::UnixListener, UnixPolicy),
    /// A TCP port.
    Tcp(tokio::net::TcpListener),
}

/// Serves `app` on `listener` until `stop` turns true; then asks open
/// connections to close after their current request.
pub async fn serve_listener(
    listener: Listener,
    app: Router,
    limits: HttpLimits,
    stop: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut stop_accept = stop.clone();
    let mut conns = tokio::task::JoinSet::new();
    loop {
        // A slot first: at the cap, new connections wait in the kernel's
        // backlog and take no descriptor of ours.
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => match s { Ok(s) => s, Err(_) => break },
            _ = stop_accept.wait_for(|v| *v) => break,
        };
        let accepted = tokio::select! {
            a = accept(&listener) => a,
            _ = stop_accept.wait_for(|v| *v) => break,
        };
        match accepted {
            Ok(Accepted::Unix(s, info)) => {
                if let Some(why) = &info.refused
                    && REFUSED_LOG.ready()
                {
                    tracing::warn!("refusing a Unix socket client: {why}");
                }
                conns.spawn(serve_conn(s, info, app.clone(), limits, stop.clone(), slot));
            }
            Ok(Accepted::Tcp(s, info)) => {
                let _ = s.set_nodelay(true);
                conns.spawn(serve_conn(s, info, app.clone(), limits, stop.clone(), slot));
            }
            Err(e) => {
                drop(slot);
                // Out of descriptors or memory: wait instead of spinning;
                // an error of one connection (it was reset) is not ours.
                let ours = matches!(
                    e.raw_os_error(),
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                );
                if ACCEPT_LOG.ready() {
                    tracing::warn!("accept: {e}");
                }
                if ours {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        while conns.try_join_next().is_some() {}
    }
    while conns.join_next().await.is_some() {}
}

enum Accepted {
    Unix(tokio::net::UnixStream, ConnInfo),
    Tcp(tokio::net::TcpStream, ConnInfo),
}

async fn accept(l: &Listener) -> std::io::Result<Accepted> {
    match l {
        Listener::Unix(l, policy) => {
            let (s, _) = l.accept().await?;
            let info = policy.check(&s);
            Ok(Accepted::Unix(s, info))
        }
        Listener::Tcp(l) => {
            let (s, addr) = l.accept().await?;
            let info = ConnInfo {
                peer: Peer::Tcp(addr.ip()),
                refused: None,
            };
            Ok(Accepted::Tcp(s, info))
        }
    }
}

/// What the watchdog knows of a connection, in ms since it was accepted
/// (`NONE`: not set).
struct Activity {
    start: Instant,
    /// The last byte read or written, or the end of the last response.
    last_io: AtomicU64,
    /// The first byte of a request head not yet complete.
    head_since: AtomicU64,
    /// Since when a write has been waiting for the client to read.
    write_stalled: AtomicU64,
    /// Requests being answered.
    inflight: AtomicU64,
}

const NONE: u64 = u64::MAX;

impl Activity {
    fn now(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Why the connection is to be closed now, if it is.
    fn expired(&self, l: &HttpLimits) -> Option<&'static str> {
        let now = self.now();
        let over = |since: u64, d: Duration| {
            since != NONE && now.saturating_sub(since) > d.as_millis() as u64
        };
        if over(self.write_stalled.load(Ordering::Relaxed), l.write_timeout) {
            return Some("the client does not read its response");
        }
        if self.inflight.load(Ordering::Relaxed) > 0 {
            return None;
        }
        let head = self.head_since.load(Ordering::Relaxed);
        if head != NONE {
            return over(head, l.header_timeout).then_some("request head not complete in time");
        }
        over(self.last_io.load(Ordering::Relaxed), l.idle_timeout).then_some("idle")
    }
}

/// A stream that reports its reads and writes to the watchdog.
struct Tracked<S> {
    inner: S,
    act: Arc<Activity>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Tracked<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            let a = &self.act;
            let now = a.now();
            a.last_io.store(now, Ordering::Relaxed);
            if a.inflight.load(Ordering::Relaxed) == 0 {
                let _ =
                    a.head_since
                        .compare_exchange(NONE, now, Ordering::Relaxed, Ordering::Relaxed);
            }
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tracked<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.note_write(&r);
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.note_write(&r);
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        let n = match &r {
            Poll::Pending => Poll::Pending,
            Poll::Ready(_) => Poll::Ready(Ok(0)),
        };
        self.note_write(&n);
        r
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<S> Tracked<S> {
    /// Notes a write's result: pending starts a stall, bytes written are
    /// activity. (A flush that had nothing to do is neither: hyper flushes
    /// whenever its connection is polled.)
    fn note_write(&self, r: &Poll<std::io::Result<usize>>) {
        let a = &self.act;
        let now = a.now();
        match r {
            Poll::Pending => {
                let _ = a.write_stalled.compare_exchange(
                    NONE,
                    now,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
            Poll::Ready(Ok(n)) => {
                a.write_stalled.store(NONE, Ordering::Relaxed);
                if *n > 0 {
                    a.last_io.store(now, Ordering::Relaxed);
                }
            }
            Poll::Ready(Err(_)) => a.write_stalled.store(NONE, Ordering::Relaxed),
        }
    }
}

/// A response body that ends its request's [`InFlight`] when it has sent
/// its last frame (hyper may keep a finished body until the connection's
/// next request) or is dropped.
struct Tracking {
    inner: Body,
    guard: Option<InFlight>,
}

impl http_body::Body for Tracking {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(r, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.guard = None;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Counts a request as in flight until its response is sent.
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let a = &self.0;
        a.last_io.store(a.now(), Ordering::Relaxed);
        a.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn serve_conn<S>(
    stream: S,
    info: ConnInfo,
    app: Router,
    limits: HttpLimits,
    mut stop: watch::Receiver<bool>,
    _slot: tokio::sync::OwnedSemaphorePermit,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let act = Arc::new(Activity {
        start: Instant::now(),
        last_io: AtomicU64::new(0),
        head_since: AtomicU64::new(NONE),
        write_stalled: AtomicU64::new(NONE),
        inflight: AtomicU64::new(0),
    });
    let io = TokioIo::new(Tracked {
        inner: stream,
        act: act.clone(),
    });
    let a = act.clone();
    let svc = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        a.inflight.fetch_add(1, Ordering::Relaxed);
        a.head_since.store(NONE, Ordering::Relaxed);
        let guard = InFlight(a.clone());
        req.extensions_mut().insert(info.clone());
        req.extensions_mut().insert(limits);
        let app = app.clone();
        async move {
            let resp = app
                .oneshot(req.map(Body::new))
                .await
                .unwrap_or_else(|e| match e {});
            Ok::<_, std::convert::Infallible>(resp.map(move |b| {
                // An empty body may never be polled: the request is over.
                let guard = (!http_body::Body::is_end_stream(&b)).then_some(guard);
                Body::new(Tracking { inner: b, guard })
            }))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .max_buf_size(64 * 1024)
        .serve_connection(io, svc);
    tokio::pin!(conn);
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut stopping = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!("connection: {e}");
                }
                return;
            }
            _ = tick.tick() => {
                if let Some(why) = act.expired(&limits) {
                    tracing::debug!("closing a connection: {why}");
                    return;
                }
            }
            _ = stop.wait_for(|v| *v), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}
