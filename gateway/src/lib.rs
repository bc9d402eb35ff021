//! eddy's gateway, in both modes: `ANY /{namespace}/{function}/{rest...}` and the hosts Kyma's
//! APIRules name go to a Function, once its caller is let in. One proxy ([`Gateway`]) decides
//! every call: the route or the APIRule rule it falls under ([`apirules`]), who may call the
//! Function ([`Access`]: its `spec.access`, tokens or a JWT, [`jwt`]), the request read within
//! the limits, call traces and the per-function metrics. Where a call then goes is an
//! [`Upstreams`]: the local supervisor's pools ([`local`], scale from zero) or the cluster's
//! Services ([`kubernetes`]). Neither of those imports the other.

pub mod apirules;
pub mod ext_authz;
pub mod hold;
pub mod jwt;
pub mod kubernetes;
pub mod local;
pub mod ratelimit;

use std::{
    borrow::Cow,
    future::Future,
    sync::Arc,
    time::{Duration, Instant},
};

use axum::{
    Router,
    extract::{Request, State},
    http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use eddy_model::resources::{AccessMode, AccessSpec, is_dns1035_label, is_dns1123_label};
use eddy_platform::{
    errors::ErrorResponse,
    function_metrics::{FunctionMetrics, FunctionSeries},
    net::{BodyError, read_limited},
    traces,
};
use http_body_util::Full;
use tracing::Instrument as _;

use crate::apirules::{Chosen, Exposure, Exposures, RuleService};
use crate::ext_authz::Granted;
use crate::ratelimit::RateLimits;

/// Errors that stop a gateway.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Listening or serving failed.
    #[error(transparent)]
    Platform(#[from] eddy_platform::Error),
    /// A Kubernetes API call failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Who may invoke a function through the gateway.
#[derive(Debug, Clone, Default)]
pub enum Access {
    /// Anyone who reaches the gateway.
    #[default]
    Public,
    /// Callers with one of these bearer tokens.
    Tokens(Arc<eddy_platform::auth::Tokens>),
    /// Callers with a valid bearer JWT.
    Jwt(Arc<jwt::JwtVerifier>),
}

impl Access {
    /// A Function's access from its `spec.access` (a JWT verifier for the same `access.jwt` in
    /// `existing` is kept, with its keys).
    pub fn of(spec: Option<&AccessSpec>, existing: Option<&Access>) -> Access {
        let Some(access) = spec else {
            return Access::Public;
        };
        match (access.mode, &access.jwt) {
            (AccessMode::Jwt, Some(jwt)) => {
                if let Some(Access::Jwt(verifier)) = existing
                    && verifier.spec() == jwt
                {
                    return Access::Jwt(verifier.clone());
                }
                match jwt::JwtVerifier::new(jwt.clone()) {
                    Ok(verifier) => Access::Jwt(Arc::new(verifier)),
                    Err(error) => {
                        // No TLS roots: nothing can be verified, so nobody is let in.
                        tracing::error!(%error, "cannot set up JWT verification; the function refuses every call");
                        Access::Tokens(Arc::new(eddy_platform::auth::Tokens::from_digests(
                            Vec::new(),
                        )))
                    }
                }
            }
            _ => match access.digests() {
                Some(digests) => {
                    Access::Tokens(Arc::new(eddy_platform::auth::Tokens::from_digests(digests)))
                }
                None => Access::Public,
            },
        }
    }
}

/// (namespace, name) of a Function.
pub type FunctionKey = (String, String);

/// A Function as an [`Upstreams`] knows it.
pub struct Found<F> {
    /// What the upstreams need to send it a call (a pool; nothing for a Service).
    pub function: F,
    /// Who may call it.
    pub access: Access,
    /// How long its answer may take.
    pub timeout: Duration,
    /// Its series on the gateway's `/metrics`.
    pub metrics: Arc<FunctionSeries>,
}

/// Where a routed, allowed call goes.
pub struct Destination<'a, F> {
    /// The Function's (or Service's) namespace and name.
    pub key: &'a FunctionKey,
    /// The Function, when it is one here.
    pub function: Option<&'a F>,
    /// The APIRule rule's Service, for a call on an APIRule's host.
    pub service: Option<&'a RuleService>,
    /// The path and query it sees: the rest after `/{namespace}/{function}`, or an APIRule
    /// host's whole path.
    pub path_and_query: &'a str,
    /// How long its answer may take.
    pub timeout: Duration,
    /// Its part of the hold budget, taken while its body arrived, when it was known to wait
    /// for its Function to start.
    pub held: Option<hold::Held>,
}

/// Where the gateway's calls go: the local supervisor's pools or the cluster's Services.
pub trait Upstreams: Send + Sync + 'static {
    /// What a call needs of its Function.
    type Function: Send + Sync;

    /// The Function `key`, when it is one here.
    fn function(&self, key: &FunctionKey) -> Option<Found<Self::Function>>;

    /// Whether an APIRule may send calls to a Service that is no Function here (a cluster's
    /// Services: yes; the local pools: no).
    fn reaches_services(&self) -> bool;

    /// The hold budget, when a call to `function` will wait for it to start (it is asleep, or
    /// has no ready instance): such a call's body is charged to the budget as it arrives, so
    /// that a burst of large calls is refused before the gateway holds their bodies.
    fn waits_for_start(&self, function: &Self::Function) -> Option<&Arc<hold::HoldBudget>>;

    /// Sends a call and streams its answer back, or says why not (502, 503, 504).
    fn send(
        &self,
        destination: Destination<'_, Self::Function>,
        request: http::Request<Full<Bytes>>,
    ) -> impl Future<Output = Result<Response, ErrorResponse>> + Send;
}

/// The proxy over some [`Upstreams`].
pub struct Gateway<U> {
    upstreams: U,
    /// Every function's series, served at `/metrics`.
    metrics: Arc<FunctionMetrics>,
    /// The APIRules it honours.
    exposures: Arc<Exposures>,
    /// The RateLimits it keeps.
    rate_limits: Arc<RateLimits>,
    /// The platform's own token (the dispatcher's), accepted by every function.
    bypass: Option<eddy_platform::auth::Tokens>,
    max_body: usize,
}

impl<U: Upstreams> Gateway<U> {
    /// A gateway sending to `upstreams`, honouring the APIRules in `exposures`, reading
    /// bodies up to `max_body` bytes.
    pub fn new(
        upstreams: U,
        metrics: Arc<FunctionMetrics>,
        exposures: Arc<Exposures>,
        max_body: usize,
    ) -> Self {
        Self {
            upstreams,
            metrics,
            exposures,
            rate_limits: Arc::default(),
            bypass: None,
            max_body,
        }
    }

    /// Keeps the RateLimits of `rate_limits` (none otherwise).
    pub fn with_rate_limits(mut self, rate_limits: Arc<RateLimits>) -> Self {
        self.rate_limits = rate_limits;
        self
    }

    /// Accepts `token` for every function, whatever its access (the dispatcher delivers with
    /// it); it opens nothing on an APIRule's host.
    pub fn with_bypass_token(mut self, token: Option<&str>) -> Self {
        self.bypass = token.and_then(|token| {
            eddy_platform::auth::Tokens::load(&[token.to_owned()], None)
                .ok()
                .flatten()
        });
        self
    }

    /// The gateway's routes: every path is a call, but `GET /metrics` on a host no APIRule
    /// names (an APIRule's host is its Service's, `/metrics` and all).
    pub fn router(self: Arc<Self>) -> Router {
        with_call_traces(Router::new().fallback(proxy::<U>).with_state(self))
    }

    /// Whether a request carries the platform's own token (the dispatcher's deliveries): such a
    /// call is routed by its path alone, never by an APIRule's host, and the token is the
    /// gateway's to check, never the Function's to see (it would open every token-protected
    /// Function).
    fn is_platform_call(&self, headers: &HeaderMap) -> bool {
        self.bypass
            .as_ref()
            .is_some_and(|bypass| bypass.allows(headers))
    }

    /// Routes a request (by the APIRule of its host, or by its path); the Function's access and
    /// the APIRule rule it falls under are checked once routed, and counted in its metrics.
    fn route(
        &self,
        exposure: Option<&Arc<Exposure>>,
        platform_call: bool,
        request: &Request,
    ) -> Result<Call<U::Function>, ErrorResponse> {
        let path = request.uri().path();
        let (key, mut path_and_query, by_host) = match exposure {
            Some(exposure) => {
                let chosen = exposure.choose(request.method(), path)?;
                let target = &chosen.rule().target;
                let key = (target.namespace.clone(), target.name.clone());
                (key, path.to_owned(), Some(chosen))
            }
            None => {
                let Some((namespace, function, rest)) = route(path) else {
                    return Err(ErrorResponse::message(
                        StatusCode::NOT_FOUND,
                        "no function here: use /{namespace}/{function}/...",
                    ));
                };
                let key = (namespace.to_owned(), function.to_owned());
                (key, rest.to_owned(), None)
            }
        };
        let found = self.upstreams.function(&key);
        let (namespace, function) = &key;
        if found.is_none() {
            match &by_host {
                Some(chosen) if !self.upstreams.reaches_services() => {
                    return Err(ErrorResponse::message(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!(
                            "APIRule {}/{}: service {namespace}/{function} is not a Function here",
                            chosen.exposure().namespace,
                            chosen.exposure().name
                        ),
                    ));
                }
                Some(_) => {}
                None => {
                    return Err(ErrorResponse::message(
                        StatusCode::NOT_FOUND,
                        format!("function {namespace}/{function} not found"),
                    ));
                }
            }
        }
        let routed_by_host = by_host.is_some();
        let rule = match by_host {
            Some(chosen) => Some(chosen),
            None if platform_call => None,
            // A Function an APIRule exposes obeys its rules on this path too.
            None => self.exposures.on_function_path(
                namespace,
                function,
                request.method(),
                &path_and_query,
            )?,
        };
        if let Some(query) = request.uri().query() {
            path_and_query.push('?');
            path_and_query.push_str(query);
        }
        Ok(Call {
            key,
            found,
            path_and_query,
            platform_call,
            rule,
            by_host: routed_by_host,
        })
    }

    /// A routed call: its RateLimit's token taken (before anything else, as Envoy's filter
    /// runs first), then [`Self::admit_and_send`]; the RateLimit's headers on any answer. The
    /// platform's deliveries take no token.
    async fn call(&self, call: &Call<U::Function>, request: Request) -> Response {
        let limiter = if call.platform_call {
            None
        } else {
            self.rate_limits.of(&call.key)
        };
        let Some(limiter) = limiter else {
            return self.admit_and_send(call, request).await;
        };
        let path = call
            .path_and_query
            .split_once('?')
            .map_or(call.path_and_query.as_str(), |(path, _)| path);
        let verdict = limiter.take(path, request.headers());
        if verdict.refused {
            return verdict.refusal();
        }
        let mut answer = self.admit_and_send(call, request).await;
        verdict.decorate(answer.headers_mut());
        answer
    }

    /// The Function's access and its APIRule rule checked, its body read, then sent.
    async fn admit_and_send(&self, call: &Call<U::Function>, request: Request) -> Response {
        // The call's whole time, from here: the authorizers, then the Function's answer.
        let mut timeout = call.found.as_ref().map_or(Duration::MAX, |f| f.timeout);
        if let Some(chosen) = &call.rule {
            timeout = timeout.min(chosen.rule().timeout);
        }
        let deadline = tokio::time::Instant::now()
            .checked_add(timeout)
            .unwrap_or_else(far_future);
        let (namespace, function) = &call.key;
        let access = call.found.as_ref().map(|found| &found.access);
        match access.filter(|_| !call.platform_call) {
            None | Some(Access::Public) => {}
            Some(Access::Tokens(tokens)) => {
                if !tokens.allows(request.headers()) {
                    return ErrorResponse::message(
                        StatusCode::UNAUTHORIZED,
                        format!("function {namespace}/{function} needs a bearer token"),
                    )
                    .into_response();
                }
            }
            Some(Access::Jwt(verifier)) => {
                if let Err(refused) =
                    check_jwt(verifier, request.headers(), namespace, function).await
                {
                    return refused;
                }
            }
        }
        let granted = match &call.rule {
            Some(chosen) => {
                let admitted = chosen
                    .admit(
                        request.method(),
                        &call.path_and_query,
                        request.headers(),
                        request.uri().query(),
                        deadline,
                    )
                    .await;
                match admitted {
                    Ok(granted) => granted,
                    Err(refused) => return refused,
                }
            }
            None => Granted::default(),
        };
        let mut held = match call.found.as_ref().and_then(|found| {
            self.upstreams
                .waits_for_start(&found.function)
                .map(|budget| budget.hold(&call.key, 0))
        }) {
            Some(Ok(held)) => Some(held),
            Some(Err(refused)) => return refused.into_response(),
            None => None,
        };
        let (mut parts, body) =
            match read_request(self.max_body, request, call.platform_call, held.as_mut()).await {
                Ok(read) => read,
                Err(refused) => return refused.into_response(),
            };
        // Mesh identity is the sidecars' to state: a caller's own `X-Forwarded-Client-Cert`
        // would reach a Function ahead of the entry its sidecar appends (Istio's default), and
        // a Function reading the first entry would believe whatever the caller wrote there.
        parts.headers.remove(FORWARDED_CLIENT_CERT);
        if let Some(chosen) = &call.rule {
            chosen.decorate(&mut parts.headers);
        }
        let timeout = deadline.saturating_duration_since(tokio::time::Instant::now());
        if timeout.is_zero() {
            return ext_authz::timed_out();
        }
        for (name, value) in granted.upstream {
            parts.headers.insert(name, value);
        }
        let by_host = call.rule.as_ref().filter(|_| call.by_host);
        let mut upstream = http::Request::new(Full::new(body));
        *upstream.method_mut() = parts.method;
        *upstream.headers_mut() = parts.headers;
        let destination = Destination {
            key: &call.key,
            function: call.found.as_ref().map(|found| &found.function),
            service: by_host.map(|chosen| &chosen.rule().target),
            path_and_query: &call.path_and_query,
            timeout,
            held,
        };
        let mut answer = self
            .upstreams
            .send(destination, upstream)
            .await
            .unwrap_or_else(IntoResponse::into_response);
        for (name, value) in granted.downstream {
            answer.headers_mut().append(name, value);
        }
        answer
    }
}

/// The header in which Envoy states a mesh peer's identity.
const FORWARDED_CLIENT_CERT: HeaderName = HeaderName::from_static("x-forwarded-client-cert");

/// An instant no call reaches (a call without any timeout).
fn far_future() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600)
}

/// A routed call.
struct Call<F> {
    key: FunctionKey,
    found: Option<Found<F>>,
    path_and_query: String,
    /// Carries the platform's token (the dispatcher's deliveries): the Function's access is
    /// not asked.
    platform_call: bool,
    /// The APIRule rule the call falls under, when an APIRule routes it or exposes the function.
    rule: Option<Chosen>,
    /// Routed by the APIRule of its host (to the rule's Service, with the whole path).
    by_host: bool,
}

async fn proxy<U: Upstreams>(
    State(gateway): State<Arc<Gateway<U>>>,
    mut request: Request,
) -> Response {
    // Rules are matched, and Functions reached, on the path as Istio's gateway normalises it:
    // `/%61dmin` is `/admin` to the rule and to the Function alike.
    match normalize_path(request.uri().path()) {
        Ok(Cow::Borrowed(_)) => {}
        Ok(Cow::Owned(path)) => match with_path(request.uri(), &path) {
            Some(uri) => *request.uri_mut() = uri,
            None => return PathRefusal::Unusable.into_response(),
        },
        Err(refusal) => return refusal.into_response(),
    }
    append_forwarded_for(&mut request);
    // The platform's own calls are never routed by host: an APIRule naming the address they
    // are sent to would otherwise be handed them, and the token they carry.
    let platform_call = gateway.is_platform_call(request.headers());
    let exposure = if platform_call {
        None
    } else {
        gateway.exposures.by_host(request.headers(), request.uri())
    };
    if exposure.is_none() && request.uri().path() == "/metrics" {
        if request.method() != http::Method::GET {
            return StatusCode::METHOD_NOT_ALLOWED.into_response();
        }
        return metrics_text(gateway.metrics.encode());
    }
    if let Some(answer) = exposure
        .as_ref()
        .and_then(|exposure| exposure.preflight(request.method(), request.headers()))
    {
        return answer;
    }
    let origin = exposure
        .as_ref()
        .and_then(|_| request.headers().get(header::ORIGIN).cloned());
    let mut response = match gateway.route(exposure.as_ref(), platform_call, &request) {
        Err(refused) => refused.into_response(),
        Ok(call) => {
            // Every line logged while serving this call names the function once, here.
            let span = tracing::info_span!("call", namespace = %call.key.0, function = %call.key.1);
            let started = Instant::now();
            let response = gateway.call(&call, request).instrument(span).await;
            if let Some(found) = &call.found {
                found
                    .metrics
                    .called(response.status().as_u16(), started.elapsed().as_secs_f64());
            }
            response
        }
    };
    if let Some(exposure) = &exposure {
        exposure.cors_answer(origin.as_ref(), response.headers_mut());
    }
    response
}

/// Longest a request body may take to arrive (a slow client holds no instance meanwhile).
const BODY_TIMEOUT: Duration = Duration::from_secs(60);

/// The `/metrics` answer of a gateway.
pub fn metrics_text(text: String) -> Response {
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
pub fn with_call_traces(router: Router) -> Router {
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

/// Why a request path cannot be normalised: it is refused (400) before any rule or route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathRefusal {
    /// `%2F` or `%5C`: a separator to some readers and text to others.
    EncodedSeparator,
    /// A raw `\`: text to the rules, a `/` to WHATWG URL parsers (Node's `new URL`), so
    /// `/x\..\admin` would be matched as one path and served as `/admin`.
    Backslash,
    /// A `%` not followed by two hex digits, or an escape of a NUL or a control character.
    BadEscape,
    /// The normalised path does not make a request target.
    Unusable,
}

impl IntoResponse for PathRefusal {
    fn into_response(self) -> Response {
        let message = match self {
            Self::EncodedSeparator => {
                "the path has an encoded '/' or '\\' (%2F, %5C); send the separator as it is, or \
                 encode it in the query"
            }
            Self::Backslash => {
                "the path has a '\\', which some readers take for '/'; send '/' or encode the \
                 '\\' in the query"
            }
            Self::BadEscape => {
                "the path has a '%' that escapes no character, or escapes a control character"
            }
            Self::Unusable => "the path cannot be normalised into a request target",
        };
        ErrorResponse::message(StatusCode::BAD_REQUEST, message).into_response()
    }
}

/// A request path as Istio's gateway normalises it before matching routes (RFC 3986 section
/// 6): escapes of unreserved characters decoded (`%61` is `a`, `%2E` is `.`) and the others
/// upper-cased, runs of `/` merged, and `.` and `..` segments resolved (never above the root).
/// Borrowed when the path is normal already (the common case costs a scan). A `\`, raw or
/// encoded, an encoded `/` and a broken or control-character escape are refused. Pure.
pub fn normalize_path(path: &str) -> Result<Cow<'_, str>, PathRefusal> {
    let bytes = path.as_bytes();
    if bytes.contains(&b'\\') {
        return Err(PathRefusal::Backslash);
    }
    let suspicious = path.contains('%')
        || path.contains("//")
        || path
            .split('/')
            .any(|segment| segment == "." || segment == "..");
    if !suspicious {
        return Ok(Cow::Borrowed(path));
    }
    let mut decoded: Vec<u8> = Vec::with_capacity(path.len());
    let mut index = 0;
    while index < bytes.len() {
        let byte = bytes[index];
        if byte != b'%' {
            decoded.push(byte);
            index += 1;
            continue;
        }
        let hex = |at: usize| bytes.get(at).and_then(|b| char::from(*b).to_digit(16));
        let (Some(high), Some(low)) = (hex(index + 1), hex(index + 2)) else {
            return Err(PathRefusal::BadEscape);
        };
        let value = u8::try_from(high * 16 + low).map_err(|_| PathRefusal::BadEscape)?;
        match value {
            b'/' | b'\\' => return Err(PathRefusal::EncodedSeparator),
            value if value.is_ascii_alphanumeric() || b"-._~".contains(&value) => {
                decoded.push(value);
            }
            value if value.is_ascii_control() => return Err(PathRefusal::BadEscape),
            _ => decoded.extend_from_slice(&[b'%', upper_hex(high), upper_hex(low)]),
        }
        index += 3;
    }
    // Only unreserved ASCII was decoded: the rest of `path` is copied as it was, whole.
    let decoded = String::from_utf8(decoded).map_err(|_| PathRefusal::Unusable)?;
    let last = decoded.rsplit('/').next().unwrap_or_default();
    let trailing = matches!(last, "" | "." | "..");
    let mut kept: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                kept.pop();
            }
            segment => kept.push(segment),
        }
    }
    let mut normal = String::with_capacity(decoded.len());
    for segment in &kept {
        normal.push('/');
        normal.push_str(segment);
    }
    if trailing || normal.is_empty() {
        normal.push('/');
    }
    Ok(if normal == path {
        Cow::Borrowed(path)
    } else {
        Cow::Owned(normal)
    })
}

/// The upper-case hex digit of `digit` (0 to 15).
fn upper_hex(digit: u32) -> u8 {
    b"0123456789ABCDEF"[(digit & 15) as usize]
}

/// `uri` with its path replaced by `path` (its scheme, authority and query kept).
fn with_path(uri: &http::Uri, path: &str) -> Option<http::Uri> {
    let path_and_query = match uri.query() {
        Some(query) => format!("{path}?{query}"),
        None => path.to_owned(),
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(path_and_query.parse().ok()?);
    http::Uri::from_parts(parts).ok()
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

/// Appends the caller's address to `X-Forwarded-For`, as Envoy at the edge does
/// (`use_remote_address`): what the caller wrote there stays, and the last entry is the one
/// the gateway saw (the Function and the authorizers read it from the end).
fn append_forwarded_for(request: &mut Request) {
    let Some(eddy_platform::net::PeerAddr(peer)) = request.extensions().get().copied() else {
        return;
    };
    let peer = peer.ip().to_canonical();
    let mut value = String::new();
    for written in request.headers().get_all(X_FORWARDED_FOR) {
        if let Ok(text) = written.to_str()
            && !text.trim().is_empty()
        {
            value.push_str(text.trim());
            value.push_str(", ");
        }
    }
    value.push_str(&peer.to_string());
    if let Ok(value) = HeaderValue::from_str(&value) {
        request.headers_mut().insert(X_FORWARDED_FOR, value);
    }
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

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

/// Configured header names and values (an APIRule's `request.headers`, an authorizer's fixed
/// check headers) as HTTP headers, parsed once; a pair that is not a valid header is left out
/// (validation refused those already).
pub(crate) fn header_pairs<'a>(
    pairs: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> Vec<(HeaderName, HeaderValue)> {
    pairs
        .into_iter()
        .filter_map(|(name, value)| {
            Some((
                HeaderName::from_bytes(name.as_bytes()).ok()?,
                HeaderValue::from_str(value).ok()?,
            ))
        })
        .collect()
}

/// Drops the hop-by-hop headers (and those `Connection` names) of a request or an answer.
pub fn forward_headers(headers: &mut HeaderMap) {
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

/// Checks a caller's JWT; the refusal (401 with `WWW-Authenticate: Bearer`, 403, 503) names
/// the function and what failed.
pub async fn check_jwt(
    verifier: &jwt::JwtVerifier,
    headers: &HeaderMap,
    namespace: &str,
    function: &str,
) -> Result<(), Response> {
    // A 401 says `WWW-Authenticate: Bearer` (ErrorResponse adds it).
    match verifier.check(headers).await {
        Ok(_) => Ok(()),
        Err(refusal) => Err(ErrorResponse::message(
            refusal.status,
            format!("function {namespace}/{function}: {}", refusal.message),
        )
        .into_response()),
    }
}

/// Reads the body (within the gateway's limits) and sets the headers the function sees.
pub async fn read_request(
    max_body: usize,
    request: Request,
    platform_call: bool,
    held: Option<&mut hold::Held>,
) -> Result<(http::request::Parts, Bytes), ErrorResponse> {
    let (mut parts, body) = request.into_parts();
    if platform_call {
        parts.headers.remove(header::AUTHORIZATION);
    }
    // However slowly it arrives, the body is read within the gateway's request timeout.
    let collected = match held {
        None => tokio::time::timeout(BODY_TIMEOUT, read_limited(body, max_body)).await,
        Some(held) => {
            match tokio::time::timeout(BODY_TIMEOUT, read_charged(body, max_body, held)).await {
                Ok(Err(Charged::Refused(refused))) => return Err(refused),
                Ok(Err(Charged::Body(error))) => Ok(Err(error)),
                Ok(Ok(body)) => Ok(Ok(body)),
                Err(elapsed) => Err(elapsed),
            }
        }
    };
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

/// Why a charged body was not read whole.
enum Charged {
    /// The hold budget has no room for it (503).
    Refused(ErrorResponse),
    /// It could not be read.
    Body(BodyError),
}

/// Reads a whole body as [`read_limited`] does, charging `held` for the memory it takes
/// before taking it: a declared length at once (a body over the room left is refused before a
/// byte of it is kept), a chunked body's buffer as it grows.
async fn read_charged(
    mut body: axum::body::Body,
    limit: usize,
    held: &mut hold::Held,
) -> Result<Bytes, Charged> {
    use http_body::Body as _;
    use http_body_util::BodyExt as _;
    let declared = body
        .size_hint()
        .exact()
        .and_then(|length| usize::try_from(length).ok());
    let mut collected = bytes::BytesMut::new();
    if let Some(length) = declared {
        if length > limit {
            return Err(Charged::Body(BodyError::TooLarge));
        }
        if let Err(refused) = held.grow(length as u64) {
            discard(body, length).await;
            return Err(Charged::Refused(refused));
        }
        collected.reserve(length);
    }
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| {
            Charged::Body(if eddy_platform::net::is_stalled(&error) {
                BodyError::Stalled
            } else {
                BodyError::Unreadable(error.to_string())
            })
        })?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let needed = collected.len() + data.len();
        if needed > limit {
            return Err(Charged::Body(BodyError::TooLarge));
        }
        if needed > collected.capacity() {
            // What a Vec's growth allocates (twice what it had, or what is needed), charged
            // before it is allocated.
            let grown = needed.max(collected.capacity() * 2);
            if let Err(refused) = held.grow((grown - collected.capacity()) as u64) {
                // The rest is read and dropped, nothing kept: answering before the request
                // is read whole makes the server close the connection with data unread,
                // which resets it, and a proxy in front (the sidecar) then answers its own
                // 503 instead of this one.
                let room = limit - needed;
                drop(collected);
                discard(body, room).await;
                return Err(Charged::Refused(refused));
            }
            collected.reserve(grown - collected.len());
        }
        collected.extend_from_slice(&data);
    }
    Ok(collected.freeze())
}

/// Reads what is left of `body`, at most `limit` bytes more, keeping none of it.
async fn discard(mut body: axum::body::Body, limit: usize) {
    use http_body_util::BodyExt as _;
    let mut read = 0;
    while read <= limit {
        let Some(Ok(frame)) = body.frame().await else {
            return;
        };
        read += frame.data_ref().map_or(0, Bytes::len);
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
    fn paths_are_normalised_as_istio_normalises_them() {
        for (raw, normal) in [
            ("/admin/users", "/admin/users"),
            ("/%61dmin/users", "/admin/users"),
            ("/public/../admin", "/admin"),
            ("/public/%2e%2e/admin", "/admin"),
            ("/public/%2E./admin", "/admin"),
            ("/public/./admin", "/public/admin"),
            ("/public/.%2e", "/"),
            ("/..", "/"),
            ("/../../etc", "/etc"),
            ("//a///b/", "/a/b/"),
            ("/a/b/.", "/a/b/"),
            ("/a/%7e%2D%5F", "/a/~-_"),
            ("/a/%c3%a9", "/a/%C3%A9"),
            ("/a/%20b", "/a/%20b"),
            ("/", "/"),
            ("/public/file.txt", "/public/file.txt"),
            ("/public/...", "/public/..."),
            ("/public/.well-known/x", "/public/.well-known/x"),
            ("/public/..x", "/public/..x"),
        ] {
            assert_eq!(normalize_path(raw).as_deref(), Ok(normal), "{raw}");
        }
        assert!(matches!(normalize_path("/a/b"), Ok(Cow::Borrowed(_))));
        assert!(matches!(normalize_path("/a/%C3%A9"), Ok(Cow::Borrowed(_))));
        for (raw, refusal) in [
            ("/a%2Fb", PathRefusal::EncodedSeparator),
            ("/a%2fb", PathRefusal::EncodedSeparator),
            ("/a%5Cb", PathRefusal::EncodedSeparator),
            ("/x\\..\\admin/users", PathRefusal::Backslash),
            ("/a\\b", PathRefusal::Backslash),
            ("/a%", PathRefusal::BadEscape),
            ("/a%4", PathRefusal::BadEscape),
            ("/a%zz", PathRefusal::BadEscape),
            ("/a%00", PathRefusal::BadEscape),
            ("/a%0A", PathRefusal::BadEscape),
        ] {
            assert_eq!(normalize_path(raw), Err(refusal), "{raw}");
        }
        let uri: http::Uri = "http://127.0.0.1:8080/%61?x=%2F".parse().unwrap();
        assert_eq!(
            with_path(&uri, "/a").unwrap().to_string(),
            "http://127.0.0.1:8080/a?x=%2F"
        );
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
