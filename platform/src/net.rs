//! Listening sockets and the one HTTP server every eddy listener runs.
//!
//! [`serve`] is where the protections every listener needs live, so no listener forgets one:
//! a header-read deadline that also closes idle keep-alive connections (slowloris, and 1,000
//! idle sockets eating the fd limit), a deadline between the pieces of a request body, a cap on
//! open connections, Nagle off, a bounded drain on
//! shutdown, and on a loopback address the browser checks: a `Host` that is not loopback is
//! refused (DNS rebinding), and so is a state-changing request from a foreign `Origin`.

use std::{
    net::{IpAddr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::serve::{Listener, ListenerExt as _};
use axum::{
    body::Body,
    extract::Request,
    response::{IntoResponse, Response},
};
use http::{HeaderValue, Method, StatusCode, header};
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::graceful::GracefulShutdown,
    service::TowerToHyperService,
};
use tokio::{
    net::{TcpListener, TcpStream},
    sync::Semaphore,
};
use tokio_util::sync::CancellationToken;

/// Listens on `addr` (port 0: a free one) and says where.
pub fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), crate::Error> {
    let bound = bind_socket(addr, false).and_then(|socket| {
        let listener = listen(socket)?;
        let local = listener.local_addr()?;
        Ok((listener, local))
    });
    bound.map_err(|source| crate::Error::Bind { addr, source })
}

/// A socket bound to `addr` that does not listen yet: a conflict with a process already
/// listening there is reported at once, while connections only arrive after [`listen`]. With
/// `reuse_port`, `SO_REUSEPORT` is set first, so several processes can listen on one port (one
/// event-bus per core behind one address, without a proxy in front); the kernel gives a
/// listening process its share of new connections, ready or not, hence the split.
pub fn bind_socket(addr: SocketAddr, reuse_port: bool) -> std::io::Result<tokio::net::TcpSocket> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    if reuse_port {
        socket.set_reuseport(true)?;
    }
    socket.bind(addr)?;
    Ok(socket)
}

/// Starts listening on a bound socket.
pub fn listen(socket: tokio::net::TcpSocket) -> std::io::Result<TcpListener> {
    socket.listen(1024)
}

/// `listener` with Nagle's algorithm off on every accepted connection: a small answer (a 204, a
/// proxied response) leaves at once instead of waiting on the peer's delayed ACK.
pub fn no_delay(listener: TcpListener) -> impl Listener<Io = TcpStream, Addr = SocketAddr> {
    listener.tap_io(|stream| {
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY on an accepted connection");
        }
    })
}

/// Limits every listener of a process applies; flattened into each service's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Whether each request carries its peer's address ([`PeerAddr`] in its extensions): set
    /// by a service that reports it onward (the gateway's `X-Forwarded-For`), not a flag.
    #[arg(skip)]
    pub peer_addresses: bool,
    /// Longest wait for a request's headers, and for the next request on an idle keep-alive
    /// connection: an HTTP/1.1 connection with no request under way for this long (checked four
    /// times per timeout, so at most a quarter more) is closed.
    #[arg(long = "header-read-timeout", env = "EDDY_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub header_read_timeout: Duration,
    /// Longest wait for the next piece of a request body; a body that stalls longer fails.
    #[arg(long = "body-timeout", env = "EDDY_BODY_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub body_timeout: Duration,
    /// Most open connections per listener; further clients wait in the kernel's backlog.
    #[arg(
        long = "max-connections",
        env = "EDDY_MAX_CONNECTIONS",
        default_value_t = 4_096
    )]
    pub max_connections: usize,
    /// Longest wait on shutdown for what is in flight: requests on a listener, deliveries in
    /// the dispatcher.
    #[arg(long = "drain-timeout", env = "EDDY_DRAIN_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
}

impl Default for ServeArgs {
    fn default() -> Self {
        crate::flags::defaults()
    }
}

/// A pooled HTTP/1 client for eddy's own hops (the dispatcher to sinks, the gateway to function
/// instances): TCP_NODELAY, idle connections closed after `idle`, an optional connect timeout.
/// It follows no redirects: a sink or an instance cannot send eddy elsewhere.
pub fn pooled_client<B>(
    idle: Duration,
    connect_timeout: Option<Duration>,
) -> hyper_util::client::legacy::Client<hyper_util::client::legacy::connect::HttpConnector, B>
where
    B: http_body::Body + Send,
    B::Data: Send,
{
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(idle)
        .build(tcp_connector(connect_timeout))
}

/// The TCP connector of eddy's clients: no Nagle delay, an optional connect timeout.
fn tcp_connector(
    connect_timeout: Option<Duration>,
) -> hyper_util::client::legacy::connect::HttpConnector {
    let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(connect_timeout);
    connector
}

/// A pooled client over HTTP and HTTPS (HTTP/1.1; certificates checked against the system's
/// CA roots, which `SSL_CERT_FILE` and `SSL_CERT_DIR` may point elsewhere). For sinks: plain
/// `http://` requests go through it as through [`pooled_client`].
pub fn pooled_tls_client<B>(
    idle: Duration,
    connect_timeout: Option<Duration>,
) -> Result<
    hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        B,
    >,
    crate::Error,
>
where
    B: http_body::Body + Send,
    B::Data: Send,
{
    let mut connector = tcp_connector(connect_timeout);
    // The TLS layer above it takes `https://`.
    connector.enforce_http(false);
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_platform_verifier(rustls::crypto::ring::default_provider())
        .map_err(crate::Error::Tls)?
        .https_or_http()
        .enable_http1()
        .wrap_connector(connector);
    Ok(
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_idle_timeout(idle)
            .build(connector),
    )
}

/// What a listener checks of browsers.
#[derive(Clone)]
pub enum Browsers {
    /// On loopback: refuse foreign `Host` values, and state-changing requests from a foreign
    /// `Origin` (the event-bus, the API, the dispatcher admin).
    SameOrigin,
    /// On loopback: refuse foreign `Host` values only (the gateway: functions answer CORS
    /// requests from any origin themselves, as Kyma's do).
    HostOnly,
    /// [`Browsers::HostOnly`], also taking the foreign hosts the predicate accepts (the hosts
    /// the user's APIRules name: a page cannot rebind a name it does not control).
    HostOnlyAnd(std::sync::Arc<dyn Fn(&str) -> bool + Send + Sync>),
}

impl std::fmt::Debug for Browsers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::SameOrigin => "SameOrigin",
            Self::HostOnly => "HostOnly",
            Self::HostOnlyAnd(_) => "HostOnlyAnd",
        })
    }
}

/// How often an HTTP/2 connection is pinged, and how long the answer may take.
const HTTP2_PING_INTERVAL: Duration = Duration::from_secs(20);

/// What a connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Http1,
    Http2,
}

/// The protocol that a connection's first bytes announce: HTTP/2's preface begins with `PRI`,
/// which is no HTTP/1.1 method; `None` while the bytes so far are a part of it. Pure.
fn protocol_of(first: &[u8]) -> Option<Protocol> {
    const PREFACE: &[u8] = b"PRI";
    let compared = first.len().min(PREFACE.len());
    if first.get(..compared) != PREFACE.get(..compared) {
        Some(Protocol::Http1)
    } else if compared == PREFACE.len() {
        Some(Protocol::Http2)
    } else {
        None
    }
}

/// Waits (at most `within`) for a connection's first bytes and reads its protocol from them
/// without consuming them; `None` when it closes or sends nothing in time.
async fn sniff(stream: &TcpStream, within: Duration) -> Option<Protocol> {
    let mut first = [0_u8; 3];
    let sniffing = async {
        loop {
            let read = stream.peek(&mut first).await.ok()?;
            if read == 0 {
                return None;
            }
            if let Some(protocol) = protocol_of(first.get(..read).unwrap_or_default()) {
                return Some(protocol);
            }
            // `P` or `PR` so far: the rest of the preface is on its way.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    tokio::time::timeout(within, sniffing).await.ok().flatten()
}

/// The most one HTTP/1.1 connection buffers of what it reads: a request's head must fit
/// (larger is answered 431, as Envoy refuses a head over 60 KiB), and a body streams through
/// it. hyper's own bound (408 KiB) let two hundred connections sending large bodies at once
/// take 80 MiB of buffers, more than the chart gives the gateway besides what it holds.
pub const HTTP1_MAX_BUFFER: usize = 64 * 1024;

/// Requests in flight at once on one HTTP/2 connection (each connection counts once against
/// `--max-connections`).
pub const HTTP2_MAX_STREAMS: u32 = 256;

/// Serves `service` (an [`axum::Router`], or a service that routes its hottest path itself) on
/// `listener` until `shutdown`, then lets in-flight requests finish for at most `drain`. Returns
/// once every connection is closed or the drain ran out.
pub async fn serve<S>(
    listener: TcpListener,
    service: S,
    limits: &ServeArgs,
    browsers: Browsers,
    shutdown: CancellationToken,
    drain: Duration,
) -> std::io::Result<()>
where
    S: tower::Service<Request, Response = Response, Error = std::convert::Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let local = listener.local_addr()?;
    let guard = Guard {
        service,
        port: local.port(),
        browsers: local.ip().is_loopback().then_some(browsers),
        body_timeout: limits.body_timeout,
        activity: None,
        peer: None,
    };
    // HTTP/1.1, and HTTP/2 over cleartext with prior knowledge: many requests in flight on one
    // connection share its reads and writes. Which one a connection speaks is read from its
    // first bytes (`sniff`) within the header timeout, so a client that connects and sends
    // nothing is let go as an idle HTTP/1.1 one is.
    let mut http = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // The header timeout is kept by each connection's watchdog (`closed_when_idle`), not by
    // hyper, whose timer is armed and dropped around every request's head.
    http.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .keep_alive(true)
        .max_buf_size(HTTP1_MAX_BUFFER);
    http.http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(HTTP2_MAX_STREAMS)
        // A peer that stops answering pings is gone: its connection is closed.
        .keep_alive_interval(Some(HTTP2_PING_INTERVAL))
        .keep_alive_timeout(HTTP2_PING_INTERVAL);
    let builders = Arc::new((http.clone().http1_only(), http.http2_only()));
    let header_read_timeout = limits.header_read_timeout;
    let connections = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut warned_full = false;
    loop {
        let permit = match connections.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                if !warned_full {
                    tracing::warn!(limit = limits.max_connections, %local, "connection limit reached; new clients wait");
                    warned_full = true;
                }
                tokio::select! {
                    permit = connections.clone().acquire_owned() => match permit {
                        Ok(permit) => permit,
                        Err(_) => break,
                    },
                    () = shutdown.cancelled() => break,
                }
            }
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of descriptors or a connection reset before accept: not fatal.
                    tracing::warn!(%error, %local, "accept failed");
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(100)) => continue,
                        () = shutdown.cancelled() => break,
                    }
                }
            },
            () = shutdown.cancelled() => break,
        };
        warned_full = false;
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY on an accepted connection");
        }
        let mut guard = guard.clone();
        guard.peer = limits.peer_addresses.then_some(peer);
        let (builders, watcher) = (builders.clone(), graceful.watcher());
        let stopping = shutdown.clone();
        tokio::spawn(async move {
            // A connection that has said nothing yet is not waited for at shutdown.
            let protocol = tokio::select! {
                protocol = sniff(&stream, header_read_timeout) => protocol,
                () = stopping.cancelled() => None,
            };
            let (builder, activity) = match protocol {
                Some(Protocol::Http1) => (&builders.0, Some(Arc::new(Activity::default()))),
                // HTTP/2 has its pings, and no head read between requests.
                Some(Protocol::Http2) => (&builders.1, None),
                None => return,
            };
            guard.activity.clone_from(&activity);
            let connection = watcher.watch(
                builder
                    .serve_connection(TokioIo::new(stream), TowerToHyperService::new(guard))
                    .into_owned(),
            );
            let ended = match activity {
                Some(activity) => tokio::select! {
                    ended = connection => ended,
                    () = closed_when_idle(&activity, header_read_timeout) => {
                        tracing::debug!(timeout = ?header_read_timeout, "closing a connection with no request under way");
                        Ok(())
                    }
                },
                None => connection.await,
            };
            if let Err(error) = ended {
                tracing::debug!(%error, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(drain) => {
            tracing::warn!(timeout = ?drain, %local, "drain timed out; dropping in-flight requests");
        }
    }
    Ok(())
}

/// The service every connection runs: the browser checks of a loopback listener and the body
/// stall timeout, then the listener's service. A plain service rather than an axum middleware,
/// which boxed and cloned per request and cost the event-bus a sixth of its throughput.
#[derive(Clone)]
struct Guard<S> {
    service: S,
    port: u16,
    /// `None`: not on loopback, no browser checks.
    browsers: Option<Browsers>,
    body_timeout: Duration,
    /// The connection's requests, for its idle watchdog (HTTP/1.1 only).
    activity: Option<Arc<Activity>>,
    /// The connection's peer, put on each request when the service asked for it.
    peer: Option<SocketAddr>,
}

/// The address of the client a request came from (directly: the TCP peer), in the request's
/// extensions where the listener's [`ServeArgs::peer_addresses`] asks for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerAddr(pub SocketAddr);

/// What an HTTP/1.1 connection's watchdog sees of it: how many times a request began or
/// finished, and how many are unfinished (their response not yet sent in full). A few atomic
/// counts per request, where hyper's own header timeout registered and removed a timer around
/// every request's head.
#[derive(Debug, Default)]
struct Activity {
    changes: AtomicU64,
    unfinished: AtomicUsize,
}

/// A request that is not finished: held by its response future, then by its response body
/// until the body is sent (or dropped with the connection).
struct Unfinished(Arc<Activity>);

impl Unfinished {
    fn begin(activity: &Arc<Activity>) -> Self {
        activity.changes.fetch_add(1, Ordering::Relaxed);
        activity.unfinished.fetch_add(1, Ordering::Relaxed);
        Self(activity.clone())
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        self.0.unfinished.fetch_sub(1, Ordering::Relaxed);
        self.0.changes.fetch_add(1, Ordering::Relaxed);
    }
}

/// Counts a connection's quiet checks: it is idle once `CHECKS` checks in a row, a quarter of the
/// header timeout apart, saw no request begin or finish and none unfinished, i.e. after between
/// one and one and a quarter header timeouts with nothing under way. Pure.
#[derive(Debug, Default)]
struct IdleWatch {
    seen: u64,
    quiet: u32,
}

impl IdleWatch {
    const CHECKS: u32 = 4;

    /// One check: whether the connection is now idle for the whole timeout.
    fn is_idle(&mut self, changes: u64, unfinished: usize) -> bool {
        if changes != self.seen || unfinished > 0 {
            self.seen = changes;
            self.quiet = 0;
            return false;
        }
        self.quiet += 1;
        self.quiet >= Self::CHECKS
    }
}

/// Returns once the connection has had no request under way for `timeout`: idle between
/// requests, or stuck in a request's head (slowloris). A request being served or a response
/// being sent, however long, keeps it open (the body has its own stall timeout).
async fn closed_when_idle(activity: &Activity, timeout: Duration) {
    let period = (timeout / IdleWatch::CHECKS).max(Duration::from_millis(1));
    let mut checks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut watch = IdleWatch::default();
    loop {
        checks.tick().await;
        let changes = activity.changes.load(Ordering::Relaxed);
        if watch.is_idle(changes, activity.unfinished.load(Ordering::Relaxed)) {
            return;
        }
    }
}

pin_project_lite::pin_project! {
    /// A response future that hands its request's [`Unfinished`] mark on to the response body.
    struct Watched<F> {
        #[pin]
        inner: F,
        unfinished: Option<Unfinished>,
    }
}

impl<F: Future<Output = Result<Response, std::convert::Infallible>>> Future for Watched<F> {
    type Output = Result<http::Response<Finishing<Body>>, std::convert::Infallible>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = self.project();
        let Ok(response) = std::task::ready!(this.inner.poll(cx));
        let unfinished = this.unfinished.take();
        std::task::Poll::Ready(Ok(response.map(|body| Finishing {
            body,
            _unfinished: unfinished,
        })))
    }
}

pin_project_lite::pin_project! {
    /// A response body that keeps its request unfinished until it is sent in full: hyper drops
    /// a body once its last frame is written.
    pub struct Finishing<B> {
        #[pin]
        body: B,
        _unfinished: Option<Unfinished>,
    }
}

impl<B: http_body::Body> http_body::Body for Finishing<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        self.project().body.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

impl<S> tower::Service<http::Request<hyper::body::Incoming>> for Guard<S>
where
    S: tower::Service<Request, Response = Response, Error = std::convert::Infallible>,
{
    type Response = http::Response<Finishing<Body>>;
    type Error = std::convert::Infallible;
    type Future = Watched<
        futures::future::Either<
            std::future::Ready<Result<Response, std::convert::Infallible>>,
            S::Future,
        >,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.service.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<hyper::body::Incoming>) -> Self::Future {
        let unfinished = self.activity.as_ref().map(Unfinished::begin);
        let mut request = request.map(|body| Body::new(StallTimeout::new(body, self.body_timeout)));
        if let Some(peer) = self.peer {
            request.extensions_mut().insert(PeerAddr(peer));
        }
        let inner = match self
            .browsers
            .as_ref()
            .map(|browsers| check_browser(&request, self.port, browsers))
        {
            Some(Err((status, message))) => {
                futures::future::Either::Left(std::future::ready(Ok(refuse(status, message))))
            }
            _ => futures::future::Either::Right(self.service.call(request)),
        };
        Watched { inner, unfinished }
    }
}

pin_project_lite::pin_project! {
    /// A request body that fails when it stalls: no piece for `timeout`. The timer is armed only
    /// while the body is not ready, so a body that arrives with its headers (nearly every one)
    /// costs no timer at all; a per-request timer cost the event-bus a third of its throughput.
    pub struct StallTimeout<B> {
        #[pin]
        body: B,
        #[pin]
        timer: Option<tokio::time::Sleep>,
        timeout: Duration,
    }
}

impl<B> StallTimeout<B> {
    /// Wraps `body`.
    pub fn new(body: B, timeout: Duration) -> Self {
        Self {
            body,
            timer: None,
            timeout,
        }
    }
}

/// A request body stalled past `--body-timeout`.
#[derive(Debug, thiserror::Error)]
#[error("the request body stalled for longer than the body timeout")]
pub struct BodyStalled;

impl<B> http_body::Body for StallTimeout<B>
where
    B: http_body::Body,
    B::Error: Into<axum::BoxError>,
{
    type Data = B::Data;
    type Error = axum::BoxError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        use std::task::Poll;
        let mut this = self.project();
        if let Poll::Ready(frame) = this.body.poll_frame(cx) {
            this.timer.set(None);
            return Poll::Ready(frame.map(|frame| frame.map_err(Into::into)));
        }
        if this.timer.is_none() {
            this.timer.set(Some(tokio::time::sleep(*this.timeout)));
        }
        let expired = this
            .timer
            .as_pin_mut()
            .is_some_and(|timer| std::future::Future::poll(timer, cx).is_ready());
        if expired {
            Poll::Ready(Some(Err(BodyStalled.into())))
        } else {
            Poll::Pending
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// Whether reading a body failed because it stalled (anywhere in the error's source chain).
pub fn is_stalled(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(error) = current {
        if error.is::<BodyStalled>() {
            return true;
        }
        current = error.source();
    }
    false
}

/// Why a body could not be read.
#[derive(Debug, PartialEq, Eq)]
pub enum BodyError {
    /// Over the limit.
    TooLarge,
    /// Stopped arriving for longer than `--body-timeout`.
    Stalled,
    /// Anything else: what failed.
    Unreadable(String),
}

/// Reads a whole body, at most `limit` bytes of it: every surface that reads a body (the
/// event-bus, the gateway, the dispatcher reading a reply) reads it here.
pub async fn read_limited<B>(body: B, limit: usize) -> Result<bytes::Bytes, BodyError>
where
    B: http_body::Body,
    B::Error: Into<axum::BoxError>,
{
    use http_body_util::BodyExt as _;
    match http_body_util::Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => Err(BodyError::TooLarge),
        Err(error) if is_stalled(error.as_ref()) => Err(BodyError::Stalled),
        Err(error) => Err(BodyError::Unreadable(error.to_string())),
    }
}

fn refuse(status: StatusCode, message: &str) -> Response {
    crate::errors::ErrorResponse::message(status, message).into_response()
}

/// A host name that means this machine's loopback interface.
fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        // `[::1]` or `[::1]:8080`
        Some(bracketed) => bracketed.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, port)| {
            if port.bytes().all(|b| b.is_ascii_digit()) {
                name
            } else {
                host
            }
        }),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .get(name.len().saturating_sub(".localhost".len())..)
            .is_some_and(|end| end.eq_ignore_ascii_case(".localhost"))
        || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The browser checks of a loopback listener. A request with no `Host` (HTTP/1.0) passes: DNS
/// rebinding needs a browser, and browsers always send one.
fn check_browser(
    request: &Request,
    port: u16,
    browsers: &Browsers,
) -> Result<(), (StatusCode, &'static str)> {
    let headers = request.headers();
    // HTTP/2 carries the host in the URI (`:authority`), HTTP/1.1 in `Host`.
    let host = headers
        .get(header::HOST)
        .map(|host| host.to_str().unwrap_or_default())
        .or_else(|| {
            request
                .uri()
                .authority()
                .map(|authority| authority.as_str())
        });
    if let Some(host) = host
        && !is_loopback_host(host)
        && !matches!(browsers, Browsers::HostOnlyAnd(accepted) if accepted(host))
    {
        return Err((
            StatusCode::MISDIRECTED_REQUEST,
            "this server listens on loopback and answers only loopback host names",
        ));
    }
    let changes_state = !matches!(
        *request.method(),
        Method::GET | Method::HEAD | Method::OPTIONS
    );
    if matches!(browsers, Browsers::SameOrigin)
        && changes_state
        && let Some(origin) = headers.get(header::ORIGIN)
        && !is_own_origin(origin, port)
    {
        return Err((
            StatusCode::FORBIDDEN,
            "cross-origin requests may not change state here",
        ));
    }
    Ok(())
}

/// `Origin: http://127.0.0.1:<port>` (or localhost / [::1]) of this very listener.
fn is_own_origin(origin: &HeaderValue, port: u16) -> bool {
    let Ok(origin) = origin.to_str() else {
        return false;
    };
    let Ok(url) = url::Url::parse(origin) else {
        return false;
    };
    url.scheme() == "http"
        && url.port_or_known_default() == Some(port)
        && url.host_str().is_some_and(is_loopback_host)
}

/// Raises the soft limit on open files to the hard limit, so the connection caps (not the fd
/// limit) decide when a listener stops accepting. Returns the limit in force.
pub fn raise_fd_limit() -> Option<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).ok()?;
    if soft < hard
        && let Err(error) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
    {
        tracing::debug!(%error, "cannot raise the open-file limit");
        return Some(soft);
    }
    Some(hard)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::Router;

    #[tokio::test]
    async fn a_port_is_shared_only_when_every_listener_asks() {
        let bind = |addr, reuse_port| listen(bind_socket(addr, reuse_port)?);
        let first = bind(SocketAddr::from(([127, 0, 0, 1], 0)), true).unwrap();
        let addr = first.local_addr().unwrap();
        let second = bind(addr, true).expect("a second listener shares the port");
        assert_eq!(second.local_addr().unwrap(), addr);
        let error = bind(addr, false).expect_err("a listener that did not ask is refused");
        assert_eq!(error.kind(), std::io::ErrorKind::AddrInUse);
    }

    #[test]
    fn a_connection_is_idle_after_four_quiet_checks_in_a_row() {
        let mut watch = IdleWatch::default();
        // Nothing ever happened: idle at the fourth check.
        assert!(!watch.is_idle(0, 0));
        assert!(!watch.is_idle(0, 0));
        assert!(!watch.is_idle(0, 0));
        assert!(watch.is_idle(0, 0));

        let mut watch = IdleWatch::default();
        assert!(!watch.is_idle(0, 0));
        assert!(!watch.is_idle(0, 0));
        assert!(!watch.is_idle(0, 0));
        // A request began: the count starts over, and runs on only once it finished.
        assert!(!watch.is_idle(1, 1));
        for _ in 0..10 {
            assert!(!watch.is_idle(1, 1), "a request under way keeps it open");
        }
        assert!(!watch.is_idle(2, 0), "it finished since the last check");
        assert!(!watch.is_idle(2, 0));
        assert!(!watch.is_idle(2, 0));
        assert!(!watch.is_idle(2, 0));
        assert!(watch.is_idle(2, 0));
    }

    /// Serves `router` on `listener` with `limits` until the returned token is cancelled.
    fn serve_in_background(
        listener: TcpListener,
        router: Router,
        limits: ServeArgs,
    ) -> CancellationToken {
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            serve(
                listener,
                router,
                &limits,
                Browsers::SameOrigin,
                stop,
                Duration::from_secs(1),
            )
            .await
        });
        shutdown
    }

    /// Serves a router whose handlers take longer than the header timeout, on loopback.
    async fn slow_server(header_read_timeout: Duration) -> (SocketAddr, CancellationToken) {
        use axum::routing::get;
        let router = Router::new()
            .route(
                "/slow",
                get(async move || {
                    tokio::time::sleep(header_read_timeout * 3).await;
                    "done"
                }),
            )
            .route(
                "/stream",
                get(async move || {
                    let chunks = futures::stream::unfold(0, move |sent| async move {
                        if sent == 3 {
                            return None;
                        }
                        tokio::time::sleep(header_read_timeout).await;
                        Some((
                            Ok::<_, std::convert::Infallible>(format!("{sent}")),
                            sent + 1,
                        ))
                    });
                    Body::from_stream(chunks)
                }),
            );
        let (listener, _) = bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = ServeArgs {
            header_read_timeout,
            body_timeout: Duration::from_secs(30),
            max_connections: 16,
            ..ServeArgs::default()
        };
        (addr, serve_in_background(listener, router, limits))
    }

    /// One HTTP/2 connection carries at most [`HTTP2_MAX_STREAMS`] requests at once, and counts
    /// once against `--max-connections`: with a limit of two connections, 300 requests held on
    /// one HTTP/2 connection leave room for an HTTP/1.1 request on a second.
    #[tokio::test]
    async fn an_http2_connection_carries_256_requests_and_counts_as_one_connection() {
        use axum::routing::get;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let inside = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let release = CancellationToken::new();
        let router = Router::new().route(
            "/held",
            get({
                let (inside, peak, release) = (inside.clone(), peak.clone(), release.clone());
                async move || {
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(now, Ordering::SeqCst);
                    release.cancelled().await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    "released"
                }
            }),
        );
        let (listener, _) = bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = ServeArgs {
            header_read_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_connections: 2,
            ..ServeArgs::default()
        };
        let shutdown = serve_in_background(listener, router, limits);

        // One HTTP/2 connection, 300 requests.
        let stream = TcpStream::connect(addr).await.unwrap();
        let (sender, connection) = hyper::client::conn::http2::handshake(
            TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(stream),
        )
        .await
        .unwrap();
        tokio::spawn(connection);
        let requests: Vec<_> = (0..300)
            .map(|_| {
                let mut sender = sender.clone();
                tokio::spawn(async move {
                    let request = http::Request::get(format!("http://{addr}/held"))
                        .body(axum::body::Body::empty())
                        .unwrap();
                    sender.send_request(request).await.map(|r| r.status())
                })
            })
            .collect();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while inside.load(Ordering::SeqCst) < HTTP2_MAX_STREAMS as usize {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} of 300 requests reached the handler",
                inside.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        // A second connection is still let in: the first counted once, not 256 times.
        let mut plain = TcpStream::connect(addr).await.unwrap();
        {
            use tokio::io::AsyncWriteExt as _;
            plain
                .write_all(b"GET /held HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
                .await
                .unwrap();
        }
        while inside.load(Ordering::SeqCst) < HTTP2_MAX_STREAMS as usize + 1 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the HTTP/1.1 request on a second connection never reached the handler"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        release.cancel();
        for request in requests {
            assert_eq!(request.await.unwrap().unwrap(), http::StatusCode::OK);
        }
        assert!(read_response(&mut plain).await.ends_with("released"));
        assert_eq!(
            peak.load(Ordering::SeqCst),
            HTTP2_MAX_STREAMS as usize + 1,
            "256 streams of the HTTP/2 connection at once, plus the HTTP/1.1 request"
        );
        shutdown.cancel();
    }

    /// Reads one HTTP/1.1 response off `stream` (chunked or not) and returns it whole.
    async fn read_response(stream: &mut TcpStream) -> String {
        use tokio::io::AsyncReadExt as _;
        let mut answer = Vec::new();
        let mut buffer = [0_u8; 1024];
        loop {
            let text = String::from_utf8_lossy(&answer).into_owned();
            let complete = match text.split_once("\r\n\r\n") {
                Some((head, body)) if head.contains("transfer-encoding: chunked") => {
                    body.ends_with("0\r\n\r\n")
                }
                Some((head, body)) => head
                    .lines()
                    .find_map(|line| line.strip_prefix("content-length: "))
                    .and_then(|length| length.trim().parse::<usize>().ok())
                    .is_some_and(|length| body.len() >= length),
                None => false,
            };
            if complete {
                return text;
            }
            let read = stream.read(&mut buffer).await.unwrap();
            assert!(read > 0, "the connection closed mid-response: {text:?}");
            answer.extend_from_slice(&buffer[..read]);
        }
    }

    #[tokio::test]
    async fn requests_and_responses_outlast_the_header_timeout_and_idle_connections_do_not() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let timeout = Duration::from_millis(200);
        let (addr, shutdown) = slow_server(timeout).await;
        let mut stream = TcpStream::connect(addr).await.unwrap();

        // A handler busy for three header timeouts is answered on the same connection.
        stream
            .write_all(b"GET /slow HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            .await
            .unwrap();
        let answer = read_response(&mut stream).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("done"), "{answer}");

        // So is a response whose body takes three header timeouts to send.
        stream
            .write_all(b"GET /stream HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            .await
            .unwrap();
        let answer = read_response(&mut stream).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(
            answer.contains("\r\n0\r\n") && answer.contains("\r\n2\r\n"),
            "{answer}"
        );

        // Then nothing: the idle connection is closed.
        let mut rest = Vec::new();
        let closed =
            tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut rest)).await;
        assert!(closed.is_ok(), "an idle keep-alive connection is closed");
        assert!(rest.is_empty(), "{rest:?}");

        // As is one stuck halfway through a request's head.
        let mut stuck = TcpStream::connect(addr).await.unwrap();
        stuck
            .write_all(b"POST /slow HTTP/1.1\r\nhost: 127.0")
            .await
            .unwrap();
        let closed =
            tokio::time::timeout(Duration::from_secs(20), stuck.read_to_end(&mut rest)).await;
        assert!(
            closed.is_ok(),
            "a connection stuck in a request's head is closed"
        );
        shutdown.cancel();
    }

    #[test]
    fn loopback_hosts() {
        for host in [
            "localhost",
            "localhost:8080",
            "LOCALHOST",
            "app.localhost:1",
            "127.0.0.1",
            "127.0.0.1:8081",
            "127.1.2.3:9",
            "[::1]",
            "[::1]:8080",
        ] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:8080",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
            "10.0.0.1:80",
            "[::2]:80",
            "",
        ] {
            assert!(!is_loopback_host(host), "{host}");
        }
    }

    #[test]
    fn the_first_bytes_say_the_protocol() {
        assert_eq!(protocol_of(b"GET / HTTP/1.1"), Some(Protocol::Http1));
        assert_eq!(protocol_of(b"POST"), Some(Protocol::Http1));
        assert_eq!(protocol_of(b"PUT"), Some(Protocol::Http1));
        assert_eq!(protocol_of(b"PATCH"), Some(Protocol::Http1));
        assert_eq!(protocol_of(b"PRI * HTTP/2.0"), Some(Protocol::Http2));
        assert_eq!(protocol_of(b"P"), None);
        assert_eq!(protocol_of(b"PR"), None);
        assert_eq!(protocol_of(b"PRO"), Some(Protocol::Http1));
    }

    #[test]
    fn a_foreign_host_is_refused_over_http1_and_http2() {
        let request = |uri: &str, host: Option<&str>| {
            let mut builder = http::Request::builder().method(Method::POST).uri(uri);
            if let Some(host) = host {
                builder = builder.header(header::HOST, host);
            }
            builder.body(Body::empty()).unwrap()
        };
        let check = |request: &Request| check_browser(request, 8081, &Browsers::SameOrigin);
        // HTTP/1.1: the Host header.
        assert!(check(&request("/publish", Some("127.0.0.1:8081"))).is_ok());
        assert!(check(&request("/publish", Some("evil.example:8081"))).is_err());
        // HTTP/2: the URI's authority, with no Host header.
        assert!(check(&request("http://127.0.0.1:8081/publish", None)).is_ok());
        assert_eq!(
            check(&request("http://evil.example:8081/publish", None)).map_err(|(status, _)| status),
            Err(StatusCode::MISDIRECTED_REQUEST)
        );
    }

    #[test]
    fn own_origins() {
        let origin = |text: &str| HeaderValue::from_str(text).unwrap();
        assert!(is_own_origin(&origin("http://127.0.0.1:8082"), 8082));
        assert!(is_own_origin(&origin("http://localhost:8082"), 8082));
        assert!(!is_own_origin(&origin("http://localhost:8080"), 8082));
        assert!(!is_own_origin(&origin("http://evil.example:8082"), 8082));
        assert!(!is_own_origin(&origin("null"), 8082));
    }
}
