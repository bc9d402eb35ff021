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
    http::{HeaderName, StatusCode, Uri, header},
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use eddy_platform::errors::ErrorResponse;
use http_body_util::Full;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use tracing::Instrument as _;

use super::pool::{INSTANCE_SECRET_HEADER, Lease, Pool};
use crate::{
    apirules::{Chosen, Exposure, Exposures},
    function_metrics::FunctionMetrics,
    gateway::{
        Access, check_jwt, forward_headers, metrics_text, read_request, route, with_call_traces,
    },
};

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

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    ErrorResponse::message(status, message).into_response()
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
