//! The local gateway (docs/functions.md): `ANY /{namespace}/{function}/{rest...}` goes to the
//! least-loaded ready instance of the function, with the rest of the path and the query kept.
//! A function scaled to zero gets an instance started and the request is held until it is ready.
//! A request whose instance refused the connection (it just died) is sent to another one.
//! A request for a host an APIRule names is routed by that APIRule's rules (crate::apirules).

use std::{
    collections::HashMap,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Body,
    extract::{Request, State},
    http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri, header},
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use eddy_model::resources::{is_dns1035_label, is_dns1123_label};
use eddy_platform::{
    errors::ErrorResponse,
    net::{BodyError, read_limited},
    traces,
};
use http_body_util::Full;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use tracing::Instrument as _;

use super::pool::{Access, INSTANCE_SECRET_HEADER, Lease, Pool};
use crate::{
    apirules::{Chosen, Exposure, Exposures},
    function_metrics::FunctionMetrics,
};

/// Longest a request body may take to arrive (a slow client holds no instance meanwhile).
const BODY_TIMEOUT: Duration = Duration::from_secs(60);

/// Pools by (namespace, name).
pub type Pools = Arc<parking_lot::RwLock<HashMap<(String, String), Arc<Pool>>>>;

/// The gateway's state.
pub struct Gateway {
    pools: Pools,
    /// Every function's series, served at `/metrics`.
    metrics: Arc<FunctionMetrics>,
    /// The platform's own token (the dispatcher's), accepted by every function.
    bypass: Option<eddy_platform::auth::Tokens>,
    client: Client<HttpConnector, Full<Bytes>>,
    /// The APIRules it honours.
    exposures: Arc<Exposures>,
    activation_timeout: Duration,
    request_timeout: Duration,
    max_body: usize,
}

impl Gateway {
    /// A gateway over `pools`.
    pub fn new(
        pools: Pools,
        metrics: Arc<FunctionMetrics>,
        activation_timeout: Duration,
        request_timeout: Duration,
        max_body: usize,
    ) -> Self {
        let client = eddy_platform::net::pooled_client(
            Duration::from_secs(30),
            Some(Duration::from_secs(2)),
        );
        Self {
            pools,
            metrics,
            bypass: None,
            client,
            exposures: Arc::new(Exposures::new("localhost")),
            activation_timeout,
            request_timeout,
            max_body,
        }
    }
}

impl Gateway {
    /// Honours the APIRules in `exposures`.
    pub fn with_exposures(mut self, exposures: Arc<Exposures>) -> Self {
        self.exposures = exposures;
        self
    }

    /// Accepts `token` for every function, whatever its access (the dispatcher delivers with it).
    pub fn with_bypass_token(mut self, token: Option<&str>) -> Self {
        self.bypass = token.and_then(|token| {
            eddy_platform::auth::Tokens::load(&[token.to_owned()], None)
                .ok()
                .flatten()
        });
        self
    }
}

/// The gateway router.
pub fn router(gateway: Arc<Gateway>) -> Router {
    with_call_traces(
        Router::new()
            .route("/metrics", axum::routing::get(metrics))
            .fallback(proxy)
            .with_state(gateway),
    )
}

/// Every function's series, as Prometheus text (no function is named `/metrics`: a function
/// path has two segments).
async fn metrics(State(gateway): State<Arc<Gateway>>) -> Response {
    metrics_text(gateway.metrics.encode())
}

/// The `/metrics` answer of a gateway.
pub(crate) fn metrics_text(text: String) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// With traces on, every call to a function is a server span that continues the caller's
/// trace, and the function's spans are its children. Without, the router is left as it is.
pub(crate) fn with_call_traces(router: Router) -> Router {
    if traces::enabled() {
        router.layer(axum::middleware::from_fn(trace_call))
    } else {
        router
    }
}

async fn trace_call(request: Request, next: axum::middleware::Next) -> Response {
    let Some((namespace, function, _)) = route(request.uri().path()) else {
        return next.run(request).await;
    };
    let span = tracing::info_span!(
        target: traces::TARGET,
        "call",
        otel.kind = "server",
        eddy.namespace = namespace,
        eddy.function = function,
        http.request.method = %request.method(),
        http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    traces::serve_request(span, request, async |request| next.run(request).await).await
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    ErrorResponse::message(status, message).into_response()
}

/// Splits `/{namespace}/{function}/{rest}` (raw, still percent-encoded) into its parts.
pub fn route(path: &str) -> Option<(&str, &str, &str)> {
    let path = path.strip_prefix('/')?;
    let (namespace, after) = path.split_once('/')?;
    let (function, rest) = match after.find('/') {
        Some(slash) => (&after[..slash], &after[slash..]),
        None => (after, "/"),
    };
    (is_dns1123_label(namespace) && is_dns1035_label(function))
        .then_some((namespace, function, rest))
}

/// Headers that belong to one connection and are not forwarded.
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];

pub(crate) fn forward_headers(headers: &mut HeaderMap) {
    if let Some(listed) = headers
        .get(header::CONNECTION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
    {
        for name in listed.split(',') {
            if let Ok(name) = HeaderName::from_bytes(name.trim().as_bytes()) {
                headers.remove(name);
            }
        }
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
    headers.remove(header::TRANSFER_ENCODING);
}

async fn proxy(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    let exposure = gateway.exposures.by_host(request.headers(), request.uri());
    if let Some(answer) = exposure
        .as_ref()
        .and_then(|exposure| exposure.preflight(request.method(), request.headers()))
    {
        return answer;
    }
    let origin = exposure
        .as_ref()
        .and_then(|_| request.headers().get(header::ORIGIN).cloned());
    let (pool, call) = match find_function(&gateway, exposure.as_ref(), &request) {
        Ok(found) => found,
        Err(refused) => {
            let mut refused = refused.into_response();
            if let Some(exposure) = &exposure {
                exposure.cors_answer(origin.as_ref(), refused.headers_mut());
            }
            return refused;
        }
    };
    // Every line logged while serving this call names the function once, here.
    let span = tracing::info_span!("call", namespace = %call.namespace, function = %call.function);
    let started = Instant::now();
    let response = async {
        if let Some(verifier) = &call.jwt
            && let Err(refused) =
                check_jwt(verifier, request.headers(), &call.namespace, &call.function).await
        {
            return refused;
        }
        if let Some(chosen) = &call.rule
            && let Err(refused) = chosen.admit(request.headers(), request.uri().query()).await
        {
            return refused;
        }
        let (mut parts, body) =
            match read_request(gateway.max_body, request, call.platform_call).await {
                Ok(read) => read,
                Err(refused) => return refused.into_response(),
            };
        if let Some(chosen) = &call.rule {
            chosen.decorate(&mut parts.headers);
        }
        forward(&gateway, &pool, &call, &parts, body).await
    }
    .instrument(span)
    .await;
    let mut response = response;
    if let Some(exposure) = &exposure {
        exposure.cors_answer(origin.as_ref(), response.headers_mut());
    }
    pool.metrics
        .called(response.status().as_u16(), started.elapsed().as_secs_f64());
    response
}

/// Checks a caller's JWT; the refusal (401 with `WWW-Authenticate: Bearer`, 403, 503) names
/// the function and what failed.
pub(crate) async fn check_jwt(
    verifier: &crate::jwt::JwtVerifier,
    headers: &HeaderMap,
    namespace: &str,
    function: &str,
) -> Result<(), Response> {
    let Err(refusal) = verifier.check(headers).await else {
        return Ok(());
    };
    let mut refused = ErrorResponse::message(
        refusal.status,
        format!("function {namespace}/{function}: {}", refusal.message),
    )
    .into_response();
    if refusal.status == StatusCode::UNAUTHORIZED {
        refused
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    Err(refused)
}

/// Where a request goes, once routed and allowed.
struct Call {
    namespace: String,
    function: String,
    /// The path and query the function sees.
    path_and_query: String,
    /// Carries the platform's token (the dispatcher's deliveries).
    platform_call: bool,
    /// The JWT check the caller must pass, for a function with JWT access.
    jwt: Option<Arc<crate::jwt::JwtVerifier>>,
    /// The APIRule rule the call falls under, when an APIRule routes it or exposes the function.
    rule: Option<Chosen>,
}

/// Routes a request to its function's pool (by the APIRule of its host, or by its path) and
/// checks the function's `access`; the APIRule rule it falls under is checked once routed.
fn find_function(
    gateway: &Gateway,
    exposure: Option<&Arc<Exposure>>,
    request: &Request,
) -> Result<(Arc<Pool>, Call), ErrorResponse> {
    let path = request.uri().path();
    let (namespace, function, rest, by_host) = match exposure {
        Some(exposure) => {
            let chosen = exposure.choose(request.method(), path)?;
            let target = &chosen.rule().target;
            (
                target.namespace.clone(),
                target.name.clone(),
                path.to_owned(),
                Some(chosen),
            )
        }
        None => {
            let Some((namespace, function, rest)) = route(path) else {
                return Err(ErrorResponse::message(
                    StatusCode::NOT_FOUND,
                    "no function here: use /{namespace}/{function}/...",
                ));
            };
            (
                namespace.to_owned(),
                function.to_owned(),
                rest.to_owned(),
                None,
            )
        }
    };
    let key = (namespace, function);
    let pool = gateway.pools.read().get(&key).cloned();
    let (namespace, function) = key;
    let Some(pool) = pool else {
        return Err(match &by_host {
            Some(chosen) => ErrorResponse::message(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "APIRule {}/{}: service {namespace}/{function} is not a Function here",
                    chosen.exposure().namespace,
                    chosen.exposure().name
                ),
            ),
            None => ErrorResponse::message(
                StatusCode::NOT_FOUND,
                format!("function {namespace}/{function} not found"),
            ),
        });
    };
    // The platform's token is the gateway's to check, never the function's to see: it would
    // open every token-protected function. It opens nothing on an APIRule's host.
    let platform_call = by_host.is_none()
        && gateway
            .bypass
            .as_ref()
            .is_some_and(|b| b.allows(request.headers()));
    let rule = match by_host {
        Some(chosen) => Some(chosen),
        None if platform_call => None,
        None => {
            gateway
                .exposures
                .on_function_path(&namespace, &function, request.method(), &rest)?
        }
    };
    let mut jwt = None;
    if !platform_call {
        match pool.access() {
            Access::Public => {}
            Access::Tokens(tokens) => {
                if !tokens.allows(request.headers()) {
                    return Err(ErrorResponse::message(
                        StatusCode::UNAUTHORIZED,
                        format!("function {namespace}/{function} needs a bearer token"),
                    ));
                }
            }
            // Checked once routed, off this synchronous path: it may fetch the issuer's keys.
            Access::Jwt(verifier) => jwt = Some(verifier),
        }
    }
    let mut path_and_query = rest;
    if let Some(query) = request.uri().query() {
        path_and_query.push('?');
        path_and_query.push_str(query);
    }
    let call = Call {
        namespace,
        function,
        path_and_query,
        platform_call,
        jwt,
        rule,
    };
    Ok((pool, call))
}

/// Reads the body (within the gateway's limits) and sets the headers the function sees.
pub(crate) async fn read_request(
    max_body: usize,
    request: Request,
    platform_call: bool,
) -> Result<(http::request::Parts, Bytes), ErrorResponse> {
    let (mut parts, body) = request.into_parts();
    if platform_call {
        parts.headers.remove(header::AUTHORIZATION);
    }
    // However slowly it arrives, the body is read within the gateway's request timeout.
    let collected = tokio::time::timeout(BODY_TIMEOUT, read_limited(body, max_body)).await;
    let body = match collected {
        Ok(Ok(body)) => body,
        Err(_) | Ok(Err(BodyError::Stalled)) => {
            return Err(ErrorResponse::message(
                StatusCode::REQUEST_TIMEOUT,
                "the request body did not arrive in time",
            ));
        }
        Ok(Err(BodyError::TooLarge)) => {
            return Err(ErrorResponse::message(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body is over {max_body} bytes"),
            ));
        }
        Ok(Err(BodyError::Unreadable(problem))) => {
            return Err(ErrorResponse::message(
                StatusCode::BAD_REQUEST,
                format!("cannot read the request body: {problem}"),
            ));
        }
    };
    // HTTP/1.1 names the host in `Host`, HTTP/2 in the URI (`:authority`).
    let original_host = parts.headers.get(header::HOST).cloned().or_else(|| {
        parts
            .uri
            .authority()
            .and_then(|authority| HeaderValue::from_str(authority.as_str()).ok())
    });
    forward_headers(&mut parts.headers);
    if let Some(host) = original_host {
        parts
            .headers
            .insert(HeaderName::from_static("x-forwarded-host"), host);
    }
    parts.headers.insert(
        HeaderName::from_static("x-forwarded-proto"),
        HeaderValue::from_static("http"),
    );
    if traces::enabled() {
        // The function continues the trace from the gateway's `call` span.
        traces::inject_http(&tracing::Span::current(), &mut parts.headers);
    }
    Ok((parts, body))
}

/// Sends the request to a ready instance (starting one if needed) and streams its answer back;
/// an instance that refuses the connection is replaced by another, one that does not answer in
/// time is suspected (and replaced when it fails its probes).
async fn forward(
    gateway: &Gateway,
    pool: &Arc<Pool>,
    call: &Call,
    parts: &http::request::Parts,
    body: Bytes,
) -> Response {
    let mut answer_timeout = pool
        .answer_timeout()
        .map_or(gateway.request_timeout, |t| t.min(gateway.request_timeout));
    if let Some(chosen) = &call.rule {
        answer_timeout = answer_timeout.min(chosen.rule().timeout);
    }
    let deadline = Instant::now() + gateway.activation_timeout;
    // Instances that refused the connection: not picked again for this request.
    let mut refused: Vec<u64> = Vec::new();
    loop {
        let lease = match acquire(pool, deadline, &refused).await {
            Ok(lease) => lease,
            Err(response) => return response,
        };
        let uri = match format!(
            "http://127.0.0.1:{}{}",
            lease.instance.port, call.path_and_query
        )
        .parse::<Uri>()
        {
            Ok(uri) => uri,
            Err(_) => return error(StatusCode::BAD_REQUEST, "invalid path"),
        };
        let mut upstream = http::Request::new(Full::new(body.clone()));
        *upstream.method_mut() = parts.method.clone();
        *upstream.uri_mut() = uri;
        *upstream.headers_mut() = parts.headers.clone();
        upstream.headers_mut().insert(
            HeaderName::from_static(INSTANCE_SECRET_HEADER),
            lease.instance.secret_header.clone(),
        );
        match tokio::time::timeout(answer_timeout, gateway.client.request(upstream)).await {
            Ok(Ok(response)) => {
                let (mut head, incoming) = response.into_parts();
                forward_headers(&mut head.headers);
                return Response::from_parts(
                    head,
                    Body::new(LeasedBody {
                        inner: incoming,
                        _lease: lease,
                    }),
                );
            }
            Ok(Err(problem)) if problem.is_connect() && refused.len() < 3 => {
                // The instance went away (or stopped listening) between pick and connect: try
                // another, and have this one probed and replaced if it does not answer.
                tracing::debug!(%problem, "instance refused the connection; trying another");
                refused.push(lease.instance.id);
                pool.suspect(&lease.instance);
            }
            Ok(Err(problem)) => {
                tracing::warn!(%problem, "instance failed");
                return error(
                    StatusCode::BAD_GATEWAY,
                    "the function instance failed to answer",
                );
            }
            Err(_) => {
                pool.suspect(&lease.instance);
                return error(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!(
                        "the function did not answer within {}s",
                        answer_timeout.as_secs()
                    ),
                );
            }
        }
    }
}

/// A ready instance other than `avoid`, waiting (and asking for one to be started) up to
/// `deadline`.
async fn acquire(pool: &Arc<Pool>, deadline: Instant, avoid: &[u64]) -> Result<Lease, Response> {
    if let Some(lease) = pool.pick(avoid) {
        return Ok(lease);
    }
    let _waiting = pool.wait_guard();
    let since = Instant::now();
    let acquired = wait_for_instance(pool, deadline, avoid).await;
    pool.metrics.waited(since.elapsed().as_secs_f64());
    acquired
}

/// Waits until an instance other than `avoid` is ready (or the pool is unavailable, or the
/// deadline passes).
async fn wait_for_instance(
    pool: &Arc<Pool>,
    deadline: Instant,
    avoid: &[u64],
) -> Result<Lease, Response> {
    loop {
        let changed = pool.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if let Some(lease) = pool.pick(avoid) {
            return Ok(lease);
        }
        if let Some(reason) = pool.unavailable() {
            return Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("function is not available: {reason}"),
            ));
        }
        let now = Instant::now();
        if now >= deadline {
            let detail = pool
                .last_error()
                .map(|e| format!(": {e}"))
                .unwrap_or_default();
            return Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("no instance became ready in time{detail}"),
            ));
        }
        // Woken when an instance changes; the timeout re-checks now and then regardless.
        let _ =
            tokio::time::timeout((deadline - now).min(Duration::from_millis(500)), changed).await;
    }
}

/// A response body that keeps its instance leased until the body is done.
struct LeasedBody {
    inner: hyper::body::Incoming,
    _lease: Lease,
}

impl http_body::Body for LeasedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_split_namespace_function_and_rest() {
        assert_eq!(route("/default/hello"), Some(("default", "hello", "/")));
        assert_eq!(route("/default/hello/"), Some(("default", "hello", "/")));
        assert_eq!(
            route("/shop/stock/items/42"),
            Some(("shop", "stock", "/items/42"))
        );
        assert_eq!(
            route("/shop/stock/a%2Fb"),
            Some(("shop", "stock", "/a%2Fb"))
        );
        assert_eq!(route("/default"), None);
        assert_eq!(route("/Default/hello"), None);
        assert_eq!(route("/default/.."), None);
        assert_eq!(route("/default/hello%2F..%2Fother"), None);
    }

    #[test]
    fn hop_by_hop_headers_are_dropped() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONNECTION, "keep-alive, x-secret".parse().unwrap());
        headers.insert("x-secret", "1".parse().unwrap());
        headers.insert("keep-alive", "timeout=5".parse().unwrap());
        headers.insert("ce-id", "1".parse().unwrap());
        forward_headers(&mut headers);
        assert_eq!(headers.len(), 1);
        assert!(headers.contains_key("ce-id"));
    }
}
