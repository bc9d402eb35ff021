//! The HTTP surface of the event-bus (docs/event-bus.md). Built by [`router`] so tests drive it
//! in-process; every refusal is a JSON body that names what is wrong and never leaks internals.

use std::{
    collections::VecDeque,
    convert::Infallible,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::{
    Json, Router,
    body::Body,
    extract::{MatchedPath, Path, Request, State},
    http::{HeaderMap, HeaderValue, Method, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use serde_json::json;
use tokio::sync::Semaphore;
use tracing::Instrument as _;

use eddy_model::{
    event::{
        self, BatchError, ContentMode, EventError, Limits, OutgoingEvent, Refusal, TraceContext,
    },
    legacy,
};
use eddy_platform::{
    auth::Tokens,
    errors::ErrorResponse,
    net::{BodyError, read_limited},
    publisher::{PublishFailure, Publisher, Stored},
    traces,
};

use crate::metrics::{Metrics, Mode, Outcome, PUBLISH};

/// Everything the handlers share.
pub struct AppState {
    /// The JetStream side.
    pub publisher: Publisher,
    /// Event limits.
    pub limits: Limits,
    /// Largest batch body, in bytes.
    pub max_batch_bytes: usize,
    /// How many batches run at once, and how many acks each keeps pending.
    pub batches: BatchLimits,
    /// Longest a request may take.
    pub request_timeout: Duration,
    /// Accepted publisher tokens; `None` turns authentication off.
    pub tokens: Option<Tokens>,
    /// Metrics.
    pub metrics: Metrics,
}

impl AppState {
    /// The event size limit in force: the configured one, never above the server's max_payload.
    fn limits(&self) -> Limits {
        let server_max = self.publisher.max_payload();
        let mut limits = self.limits;
        if server_max > 0 {
            limits.max_event_size = limits.max_event_size.min(server_max);
        }
        limits
    }

    fn authorized(&self, headers: &HeaderMap) -> bool {
        self.tokens
            .as_ref()
            .is_none_or(|tokens| tokens.allows(headers))
    }
}

/// Bodies above this size take a batch slot before they are read.
const LARGE_BODY: u64 = 1 << 20;

/// Bounds on batch publishing. Large bodies are read and parsed a few at a time (memory is
/// bounded by the slots, not by the number of connections), and each batch keeps a bounded
/// window of acks pending: async-nats holds at most `max_acks_in_flight` unacknowledged
/// publishes per connection, and a batch that sent more before reading an ack would wait on
/// itself forever while every other publish waited behind it.
pub struct BatchLimits {
    slots: Semaphore,
    window: usize,
}

impl BatchLimits {
    /// `slots` batches at once, each with `max_acks_in_flight / (2 × slots)` acks pending (at
    /// least one): half of the connection's acks always stay free for single publishes.
    pub fn new(max_acks_in_flight: usize, slots: usize) -> Self {
        let slots = slots.max(1);
        Self {
            slots: Semaphore::new(slots),
            window: (max_acks_in_flight / (2 * slots)).max(1),
        }
    }

    /// Acks one batch keeps pending.
    pub fn window(&self) -> usize {
        self.window
    }
}

type Shared = State<Arc<AppState>>;

/// The event-bus's routes but `/publish` (which [`Service`] serves itself), each timed and
/// logged under its route label.
fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/{application}/v1/events", post(publish_legacy))
        .route("/{application}/v1/events/subscribed", get(subscribed))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .layer(tower::layer::layer_fn({
            let state = state.clone();
            move |inner| TrackLatency {
                inner,
                state: state.clone(),
            }
        }))
        .with_state(state)
}

/// The event-bus's HTTP service: what it serves. `/publish`, nearly every request, is served
/// here and only here: `POST` straight to its handler, timed, logged and traced as the router
/// would, any other method 405; every other path goes through [`router`]. Routing each publish through axum's router cost about 3% of the
/// event-bus's CPU: the path match, two request extensions (`MatchedPath`, `OriginalUri`)
/// allocated and dropped, and a boxed service clone per request.
#[derive(Clone)]
pub struct Service {
    router: Router,
    state: Arc<AppState>,
}

/// The event-bus's HTTP service over `state`.
pub fn service(state: Arc<AppState>) -> Service {
    Service {
        router: router(state.clone()),
        state,
    }
}

/// The one path [`Service`] serves itself.
const PUBLISH_PATH: &str = "/publish";

/// A publish's handler future. Boxed: an `async fn`'s future has no name to put in
/// [`Service`]'s `Future` type (axum boxes every handler's future too).
type PublishFuture = futures::future::BoxFuture<'static, Result<Response, Infallible>>;

impl tower::Service<Request> for Service {
    type Response = Response;
    type Error = Infallible;
    type Future = futures::future::Either<
        Tracked<PublishFuture>,
        <Router as tower::Service<Request>>::Future,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        tower::Service::<Request>::poll_ready(&mut self.router, cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        if request.uri().path() != PUBLISH_PATH {
            return futures::future::Either::Right(self.router.call(request));
        }
        if request.method() != Method::POST {
            // As a route taking only POST answers the others.
            let refused = (
                StatusCode::METHOD_NOT_ALLOWED,
                [(http::header::ALLOW, "POST")],
            )
                .into_response();
            return futures::future::Either::Left(track(&self.state, PUBLISH, request, |_| {
                Box::pin(std::future::ready(Ok(refused))) as PublishFuture
            }));
        }
        let state = self.state.clone();
        futures::future::Either::Left(track(&self.state, PUBLISH, request, move |request| {
            Box::pin(async move { Ok(publish(State(state), request).await) }) as PublishFuture
        }))
    }
}

fn route_label(path: Option<&MatchedPath>) -> &'static str {
    match path.map(MatchedPath::as_str) {
        Some("/{application}/v1/events") => "legacy",
        Some("/{application}/v1/events/subscribed") => "subscribed",
        Some("/healthz") => "healthz",
        Some("/readyz") => "readyz",
        Some("/metrics") => "metrics",
        _ => "unmatched",
    }
}

/// Times every request under its route and logs what is said while serving it under a
/// `request` span. A plain tower service rather than `middleware::from_fn`, which boxes the rest
/// of the stack and its future for every request: on the publish path that was a few percent of
/// the event-bus's CPU.
#[derive(Clone)]
struct TrackLatency<S> {
    inner: S,
    state: Arc<AppState>,
}

/// A request's response future, timed; with traces on, a publish runs under its trace span.
pub type Tracked<F> = futures::future::Either<
    Timed<tracing::instrument::Instrumented<F>>,
    Timed<futures::future::BoxFuture<'static, Result<Response, Infallible>>>,
>;

impl<S> tower::Service<Request> for TrackLatency<S>
where
    S: tower::Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Tracked<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let route = route_label(request.extensions().get::<MatchedPath>());
        if !is_traced(route) {
            return untraced(&self.state, route, self.inner.call(request));
        }
        // The service that was made ready serves this request; a clone takes its place.
        let ready = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, ready);
        track(&self.state, route, request, move |request| {
            inner.call(request)
        })
    }
}

/// Whether a request on `route` runs under a trace span of its own: a publish, traces on.
fn is_traced(route: &str) -> bool {
    traces::enabled() && (route == PUBLISH || route == "legacy")
}

/// Serves `request` with `serve` under the `request` span (lines logged while serving it carry
/// its route once, from this span), timed under `route`; under its trace span too if
/// [`is_traced`].
fn track<F>(
    state: &Arc<AppState>,
    route: &'static str,
    request: Request,
    serve: impl FnOnce(Request) -> F + Send + 'static,
) -> Tracked<F>
where
    F: Future<Output = Result<Response, Infallible>> + Send + 'static,
{
    if !is_traced(route) {
        return untraced(state, route, serve(request));
    }
    let logged = tracing::info_span!("request", route);
    let traced = Box::pin(async move { Ok(traced_publish(request, serve, logged).await) });
    futures::future::Either::Right(Timed::new(state, route, traced))
}

/// `serving` under the `request` span, timed under `route`.
fn untraced<F>(state: &Arc<AppState>, route: &'static str, serving: F) -> Tracked<F> {
    let logged = tracing::info_span!("request", route);
    futures::future::Either::Left(Timed::new(state, route, serving.instrument(logged)))
}

pin_project_lite::pin_project! {
    /// A request's response future that records its latency when it completes.
    pub struct Timed<F> {
        #[pin]
        inner: F,
        started: Instant,
        route: &'static str,
        state: Arc<AppState>,
    }
}

impl<F> Timed<F> {
    /// `inner`, timed from now.
    fn new(state: &Arc<AppState>, route: &'static str, inner: F) -> Self {
        Self {
            inner,
            started: Instant::now(),
            route,
            state: state.clone(),
        }
    }
}

impl<F: Future<Output = Result<Response, Infallible>>> Future for Timed<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let response = std::task::ready!(this.inner.poll(cx));
        this.state
            .metrics
            .observe_request(this.route, this.started.elapsed().as_secs_f64());
        Poll::Ready(response)
    }
}

/// A publish under its trace span (traces on): it continues the publisher's `traceparent`, and
/// the `store` span of every event it stores is its child.
async fn traced_publish<F>(
    request: Request,
    serve: impl FnOnce(Request) -> F,
    logged: tracing::Span,
) -> Response
where
    F: Future<Output = Result<Response, Infallible>>,
{
    let span = tracing::info_span!(
        target: traces::TARGET,
        "publish",
        otel.kind = "server",
        http.request.method = "POST",
        url.path = request.uri().path(),
        http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    traces::serve_request(span, request, async |request| {
        let Ok(response) = serve(request).instrument(logged).await;
        response
    })
    .await
}

/// A batch (or large body) past `--request-timeout`: 503, some of it may be stored.
fn timed_out(state: &AppState) -> Response {
    state.metrics.events(Mode::Batch, Outcome::TimedOut, 1);
    tracing::warn!(timeout = ?state.request_timeout, "request ran past its deadline");
    refusal(
        StatusCode::SERVICE_UNAVAILABLE,
        &format!(
            "request not finished within {:?}; some events may be stored: retry with the same \
             ids (a repeated source and id is stored once)",
            state.request_timeout
        ),
        None,
    )
}

async fn readyz(State(state): Shared) -> Response {
    let connected = state.publisher.is_connected();
    state.metrics.set_nats_connected(connected);
    if state.publisher.is_ready() {
        (StatusCode::OK, "ready").into_response()
    } else {
        let reason = if connected {
            "events stream not ready"
        } else {
            "not connected to NATS"
        };
        (StatusCode::SERVICE_UNAVAILABLE, reason).into_response()
    }
}

async fn metrics(State(state): Shared) -> Response {
    state
        .metrics
        .set_nats_connected(state.publisher.is_connected());
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
        .into_response()
}

/// A refusal of `/publish`, as JSON.
fn refusal(status: StatusCode, message: &str, field: Option<&str>) -> Response {
    let error = ErrorResponse::message(status, message);
    match field {
        Some(field) => error.with("field", json!(field)),
        None => error,
    }
    .into_response()
}

fn refusal_status(refusal: Refusal) -> (StatusCode, Outcome) {
    match refusal {
        Refusal::Invalid => (StatusCode::BAD_REQUEST, Outcome::Invalid),
        Refusal::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, Outcome::TooLarge),
        Refusal::Unsupported => (StatusCode::UNSUPPORTED_MEDIA_TYPE, Outcome::Unsupported),
    }
}

fn failure_status(failure: PublishFailure) -> (StatusCode, Outcome, &'static str) {
    match failure {
        PublishFailure::Unavailable => (
            StatusCode::SERVICE_UNAVAILABLE,
            Outcome::NatsUnavailable,
            "event not stored: NATS is unavailable; retry later",
        ),
        PublishFailure::Refused => (
            StatusCode::SERVICE_UNAVAILABLE,
            Outcome::StreamRefused,
            "event not stored: the event store refused it (it may be full); retry later",
        ),
        PublishFailure::TooLarge => (
            StatusCode::PAYLOAD_TOO_LARGE,
            Outcome::TooLarge,
            "event not stored: larger than the server accepts",
        ),
    }
}

fn stored_outcome(stored: Stored) -> Outcome {
    if stored.duplicate {
        Outcome::Duplicate
    } else {
        Outcome::Stored
    }
}

async fn publish(State(state): Shared, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let headers = &parts.headers;
    if !state.authorized(headers) {
        state
            .metrics
            .events(Mode::Unknown, Outcome::Unauthorized, 1);
        return refusal(
            StatusCode::UNAUTHORIZED,
            "a valid bearer token is required",
            None,
        );
    }
    let mode = match event::content_mode(headers) {
        Ok(mode) => mode,
        Err(error) => return refused(&state, Mode::Unknown, &error),
    };
    let limits = state.limits();
    // Structured events carry their attributes and maybe base64 data inside the body.
    let body_limit = match mode {
        ContentMode::Binary => limits.max_event_size,
        ContentMode::Structured => limits.max_event_size.saturating_mul(2),
        ContentMode::Batch => state.max_batch_bytes,
    };
    let metric_mode = match mode {
        ContentMode::Binary => Mode::Binary,
        ContentMode::Structured => Mode::Structured,
        ContentMode::Batch => Mode::Batch,
    };
    let declared_size = http_body::Body::size_hint(&body)
        .upper()
        .unwrap_or(u64::MAX);
    let request = Accepted {
        headers: &parts.headers,
        mode,
        metric_mode,
        body_limit,
        limits,
    };
    if mode != ContentMode::Batch && declared_size <= LARGE_BODY {
        // Bounded without a timer of its own: the body by --body-timeout, the ack by
        // --publish-timeout.
        return accept(&state, request, body).await;
    }
    // Batches and large bodies: one of a few slots, and the request deadline over all of it.
    let work = async {
        let Ok(_slot) = state.batches.slots.acquire().await else {
            return refused(&state, metric_mode, &EventError::malformed("shutting down"));
        };
        accept(&state, request, body).await
    };
    match tokio::time::timeout(state.request_timeout, work).await {
        Ok(response) => response,
        Err(_) => timed_out(&state),
    }
}

/// What `publish` found out about a request before reading its body.
struct Accepted<'a> {
    headers: &'a HeaderMap,
    mode: ContentMode,
    metric_mode: Mode,
    body_limit: usize,
    limits: Limits,
}

/// Reads, parses and stores the body of a publish.
async fn accept(state: &AppState, request: Accepted<'_>, body: Body) -> Response {
    let Accepted {
        headers,
        mode,
        metric_mode,
        body_limit,
        limits,
    } = request;
    let body = match read_limited(body, body_limit).await {
        Ok(body) => body,
        Err(BodyError::TooLarge) => {
            let error = EventError {
                refusal: Refusal::TooLarge,
                field: None,
                message: format!("request body is over the limit of {body_limit} bytes"),
            };
            return refused(state, metric_mode, &error);
        }
        Err(BodyError::Stalled) => return stalled(state, metric_mode),
        Err(BodyError::Unreadable(problem)) => {
            let message = format!("cannot read the request body: {problem}");
            return refused(state, metric_mode, &EventError::malformed(message));
        }
    };
    state.metrics.received(PUBLISH, body.len() as u64);

    let parsed = match mode {
        ContentMode::Batch => return publish_batch(state, headers, &body, &limits).await,
        single => event::from_single(single, headers, body, &limits),
    };
    match parsed {
        Ok(event) => publish_one(state, metric_mode, event).await,
        Err(error) => refused(state, metric_mode, &error),
    }
}

/// A body that stopped arriving: 408, the connection is not reused.
fn stalled(state: &AppState, mode: Mode) -> Response {
    state.metrics.events(mode, Outcome::TimedOut, 1);
    let mut response = refusal(
        StatusCode::REQUEST_TIMEOUT,
        "the request body stopped arriving; nothing was stored",
        None,
    );
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

fn refused(state: &AppState, mode: Mode, error: &EventError) -> Response {
    let (status, outcome) = refusal_status(error.refusal);
    state.metrics.events(mode, outcome, 1);
    tracing::debug!(?mode, field = ?error.field, message = %error.message, "event refused");
    refusal(status, &error.message, error.field.as_deref())
}

async fn publish_one(state: &AppState, mode: Mode, event: OutgoingEvent) -> Response {
    match state.publisher.publish(event).await {
        Ok(stored) => {
            state.metrics.events(mode, stored_outcome(stored), 1);
            StatusCode::NO_CONTENT.into_response()
        }
        Err(failure) => {
            let (status, outcome, message) = failure_status(failure);
            state.metrics.events(mode, outcome, 1);
            refusal(status, message, None)
        }
    }
}

async fn publish_batch(
    state: &AppState,
    headers: &HeaderMap,
    body: &[u8],
    limits: &Limits,
) -> Response {
    let events = match event::from_batch(body, &TraceContext::from_http(headers), limits) {
        Ok(events) => events,
        Err(BatchError::Whole(error)) => return refused(state, Mode::Batch, &error),
        Err(BatchError::PerEvent(errors)) => return invalid_batch(state, &errors),
    };
    let identities: Vec<(String, String)> = events
        .iter()
        .map(|event| (event.id.clone(), event.source.clone()))
        .collect();
    let results = store_in_order(state, events).await;
    batch_answer(state, &results, &identities)
}

/// A batch with invalid events: 400, each event's problem (or why a valid one was not stored).
fn invalid_batch(state: &AppState, errors: &[Option<EventError>]) -> Response {
    let invalid = errors.iter().flatten().count() as u64;
    state.metrics.events(Mode::Batch, Outcome::Invalid, invalid);
    let results: Vec<_> = errors
        .iter()
        .map(|error| match error {
            None => json!({ "status": 409, "error": "not stored: another event in the batch is invalid" }),
            Some(error) => {
                let mut entry = json!({ "status": refusal_status(error.refusal).0.as_u16(), "error": error.message });
                if let Some(field) = &error.field {
                    entry["field"] = json!(field);
                }
                entry
            }
        })
        .collect();
    ErrorResponse::new(
        StatusCode::BAD_REQUEST,
        json!({ "error": "the batch has invalid events; none was stored", "results": results }),
    )
    .into_response()
}

/// Sends the events in order, pipelined on one connection, with at most the batch window of
/// acks pending (the oldest ack is awaited before one more event goes out); one result each.
async fn store_in_order(
    state: &AppState,
    events: Vec<OutgoingEvent>,
) -> Vec<Result<Stored, PublishFailure>> {
    let window = state.batches.window();
    let mut results = Vec::with_capacity(events.len());
    let mut pending = VecDeque::with_capacity(window.min(events.len()));
    let mut send_failure = None;
    for event in events {
        if let Some(failure) = send_failure {
            // Once a send failed, NATS is gone: do not push later events out of order.
            results.push(Err(failure));
            continue;
        }
        if pending.len() >= window
            && let Some(oldest) = pending.pop_front()
        {
            results.push(state.publisher.ack(oldest).await);
        }
        match state.publisher.send(event).await {
            Ok(ack) => pending.push_back(ack),
            Err(failure) => {
                for earlier in pending.drain(..) {
                    results.push(state.publisher.ack(earlier).await);
                }
                results.push(Err(failure));
                send_failure = Some(failure);
            }
        }
    }
    for remaining in pending {
        results.push(state.publisher.ack(remaining).await);
    }
    results
}

/// 204 when every event is stored; otherwise the status of each (207, or the failure's status
/// when none was stored), with `Retry-After`. Counts every outcome.
fn batch_answer(
    state: &AppState,
    results: &[Result<Stored, PublishFailure>],
    identities: &[(String, String)],
) -> Response {
    let mut first_failure = None;
    let mut stored_count = 0u64;
    let mut duplicates = 0u64;
    for outcome in results {
        match outcome {
            Ok(stored) if stored.duplicate => duplicates += 1,
            Ok(_) => stored_count += 1,
            Err(failure) => {
                state
                    .metrics
                    .events(Mode::Batch, failure_status(*failure).1, 1);
                first_failure.get_or_insert(*failure);
            }
        }
    }
    state
        .metrics
        .events(Mode::Batch, Outcome::Stored, stored_count);
    state
        .metrics
        .events(Mode::Batch, Outcome::Duplicate, duplicates);

    let Some(first_failure) = first_failure else {
        return StatusCode::NO_CONTENT.into_response();
    };
    let entries: Vec<_> = results
        .iter()
        .zip(identities)
        .map(|(outcome, (id, source))| match outcome {
            Ok(_) => json!({ "id": id, "source": source, "status": 204 }),
            Err(failure) => {
                let (status, _, message) = failure_status(*failure);
                json!({ "id": id, "source": source, "status": status.as_u16(), "error": message })
            }
        })
        .collect();
    let all_failed = stored_count + duplicates == 0;
    let status = if all_failed {
        failure_status(first_failure).0
    } else {
        StatusCode::MULTI_STATUS
    };
    let message = if all_failed {
        "no event was stored"
    } else {
        "some events were not stored"
    };
    ErrorResponse::new(status, json!({ "error": message, "results": entries }))
        .retry_after()
        .into_response()
}

fn is_json_media_type(content_type: Option<&HeaderValue>) -> bool {
    content_type
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|media_type| media_type.trim().eq_ignore_ascii_case("application/json"))
}

fn legacy_error(
    status: StatusCode,
    message: &str,
    details: &[legacy::LegacyFieldError],
) -> Response {
    let kind = match status {
        StatusCode::BAD_REQUEST => "validation_violation",
        StatusCode::PAYLOAD_TOO_LARGE => "request_body_too_large",
        StatusCode::UNAUTHORIZED => "unauthorized",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        _ => "internal_server_error",
    };
    let body =
        json!({ "status": status.as_u16(), "type": kind, "message": message, "details": details });
    ErrorResponse::new(status, body).into_response()
}

/// `GET /{application}/v1/events/subscribed`, as Kyma's publisher proxy answers it: the event
/// types the Subscriptions in force receive from `application`, `{"eventsInfo": [{"name",
/// "version"}]}`. Read from the consumers JetStream holds for them. The publish token is
/// asked for when tokens are on, as for publishing.
async fn subscribed(
    State(state): Shared,
    Path(application): Path<String>,
    headers: HeaderMap,
) -> Response {
    if !state.authorized(&headers) {
        return legacy_error(
            StatusCode::UNAUTHORIZED,
            "a valid bearer token is required",
            &[],
        );
    }
    match state.publisher.consumer_filter_subjects().await {
        Ok(subjects) => {
            let events = legacy::subscribed_events(&application, &subjects);
            Json(json!({ "eventsInfo": events })).into_response()
        }
        Err(problem) => {
            tracing::warn!(%problem, "cannot list the subscribed events");
            legacy_error(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("cannot list the subscribed events: {problem}"),
                &[],
            )
        }
    }
}

async fn publish_legacy(
    State(state): Shared,
    Path(application): Path<String>,
    request: Request,
) -> Response {
    let (parts, body) = request.into_parts();
    if !state.authorized(&parts.headers) {
        state.metrics.events(Mode::Legacy, Outcome::Unauthorized, 1);
        return legacy_error(
            StatusCode::UNAUTHORIZED,
            "a valid bearer token is required",
            &[],
        );
    }
    // JSON only: a browser can send `text/plain` cross-origin without asking first.
    if !is_json_media_type(parts.headers.get(header::CONTENT_TYPE)) {
        state.metrics.events(Mode::Legacy, Outcome::Unsupported, 1);
        return legacy_error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "send the event as application/json",
            &[],
        );
    }
    let limits = state.limits();
    let body_limit = limits.max_event_size.saturating_mul(2);
    let body = match read_limited(body, body_limit).await {
        Ok(body) => body,
        Err(BodyError::TooLarge) => {
            state.metrics.events(Mode::Legacy, Outcome::TooLarge, 1);
            let message = format!("request body is over the limit of {body_limit} bytes");
            return legacy_error(StatusCode::PAYLOAD_TOO_LARGE, &message, &[]);
        }
        Err(BodyError::Stalled) => return stalled(&state, Mode::Legacy),
        Err(BodyError::Unreadable(problem)) => {
            let message = format!("cannot read the request body: {problem}");
            state.metrics.events(Mode::Legacy, Outcome::Invalid, 1);
            return legacy_error(StatusCode::BAD_REQUEST, &message, &[]);
        }
    };
    state.metrics.received("legacy", body.len() as u64);
    let event = match legacy::from_legacy(&application, &body, &limits, || {
        uuid::Uuid::new_v4().to_string()
    }) {
        Ok(event) => event,
        Err(errors) => {
            let too_large = errors.iter().any(|error| error.kind == "too_large");
            let (status, outcome) = if too_large {
                (StatusCode::PAYLOAD_TOO_LARGE, Outcome::TooLarge)
            } else {
                (StatusCode::BAD_REQUEST, Outcome::Invalid)
            };
            state.metrics.events(Mode::Legacy, outcome, 1);
            let message = errors
                .first()
                .map_or("invalid event", |error| error.message.as_str());
            return legacy_error(status, message, &errors);
        }
    };
    let id = event.id.clone();
    // Stored twice, as Kyma's publisher proxy publishes it: as eddy's CloudEvent and in Kyma's
    // legacy form, which exact Subscriptions written for Kyma take (the dispatcher delivers
    // the copy only where the event itself is not delivered). Answered when both are stored.
    let copy = legacy::kyma_form(&application, &event);
    let stored = match copy {
        None => state.publisher.publish(event).await,
        Some(copy) => {
            let mut results = store_in_order(&state, vec![event, copy]).await.into_iter();
            match (results.next(), results.next()) {
                (Some(Ok(stored)), Some(Ok(_))) => Ok(stored),
                (Some(Err(failure)), _) | (_, Some(Err(failure))) => Err(failure),
                _ => Err(PublishFailure::Unavailable),
            }
        }
    };
    match stored {
        Ok(stored) => {
            state
                .metrics
                .events(Mode::Legacy, stored_outcome(stored), 1);
            (StatusCode::OK, Json(json!({ "event-id": id }))).into_response()
        }
        Err(failure) => {
            let (status, outcome, message) = failure_status(failure);
            state.metrics.events(Mode::Legacy, outcome, 1);
            legacy_error(status, message, &[])
        }
    }
}
