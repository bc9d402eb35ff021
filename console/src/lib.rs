//! eddy's console: the dashboard of a local platform, served at the API address. It reads the
//! resource store and JetStream, and the dispatcher, the event-bus and the gateway over HTTP;
//! nothing below it imports it. Four pages:
//! - Overview: Functions and Subscriptions with their state and counts, a map of the event flow
//!   (types → subscriptions → functions → reply types) and charts of the last minutes.
//! - Functions: an editor that applies through the resource API, a form that calls a function
//!   through the gateway, and its log, followed live.
//! - Events: a live tail (server-sent events from `EDDY_EVENTS`), an event's attributes, data,
//!   deliveries and trace, and a form that publishes a test event through the event-bus.
//! - Dead letters per Subscription, with redrive.
//!
//! The page talks to its own origin only (its Content-Security-Policy says so), so calling a
//! function, publishing and the dispatcher's admin API are reached through the endpoints here.

mod history;

use std::{
    convert::Infallible,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use async_nats::jetstream::{
    self,
    consumer::{DeliverPolicy, pull::OrderedConfig},
};
use axum::{
    Json, Router,
    extract::{Path, Query, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{
        Html, IntoResponse, Response,
        sse::{Event, KeepAlive, Sse},
    },
    routing::{get, post},
};
use eddy_model::admin::{
    DeadLetterList, EventDeliveries, SubscriptionDeliveries, SubscriptionList,
};
use eddy_model::resources::{self, Function, Subscription};
use eddy_platform::{
    errors::ErrorResponse, nats::EVENTS_STREAM, shutdown::CancellationToken, store::Store, traces,
};
use futures::StreamExt as _;
use serde::Deserialize;
use serde_json::{Value, json};

use eddy_platform::function_metrics::FunctionMetrics;
pub use history::Charts;
use history::{DeliveryTotals, History, Sample};

const PAGE: &str = include_str!("page.html");

/// Events shown when the tail opens.
const TAIL_HISTORY: u64 = 20;

/// Seconds between two samples of the charts.
const SAMPLE_EVERY: Duration = Duration::from_secs(2);

/// Samples kept: five minutes.
const SAMPLES_KEPT: usize = 151;

/// The most of a function's answer or an event's data the page is sent.
const SHOWN_BYTES: usize = 1024 * 1024;

/// What the dashboard reads and where it sends what the user does.
pub struct DashboardState {
    /// Resources.
    pub store: Store,
    /// Events.
    pub js: jetstream::Context,
    /// The dispatcher's admin API, for delivery counts, attempts and dead letters.
    pub dispatcher_url: Option<String>,
    /// HTTP client for the dispatcher (carries its API token).
    pub http: reqwest::Client,
    /// The gateway, for calls from the page.
    pub gateway_url: String,
    /// The event-bus, for test events from the page.
    pub bus_url: String,
    /// A token the event-bus accepts, when it requires one.
    pub bus_token: Option<String>,
    /// HTTP client for calls and publishes: no credentials of its own.
    pub callers: reqwest::Client,
    /// Every function's calls, for the charts.
    pub function_metrics: Arc<FunctionMetrics>,
    /// The charts' samples.
    pub history: Mutex<History>,
    /// The dispatcher's per-subscription items as last sampled (`None`: not reachable), so
    /// the page's polls do not ask the dispatcher again.
    pub dispatcher_items: Mutex<Option<Vec<SubscriptionDeliveries>>>,
}

/// The client the console reads the dispatcher with, sending `token` when given.
fn dispatcher_client(token: Option<&str>) -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(value) = token.and_then(eddy_platform::auth::bearer_header) {
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    reqwest::Client::builder()
        .default_headers(headers)
        .build()
        .unwrap_or_default()
}

impl DashboardState {
    /// The state for these parts, with an empty history.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: Store,
        js: jetstream::Context,
        dispatcher_url: Option<String>,
        dispatcher_token: Option<&str>,
        gateway_url: String,
        bus_url: String,
        bus_token: Option<String>,
        function_metrics: Arc<FunctionMetrics>,
    ) -> Self {
        Self {
            store,
            js,
            dispatcher_url: dispatcher_url.map(|url| url.trim_end_matches('/').to_owned()),
            http: dispatcher_client(dispatcher_token),
            gateway_url: gateway_url.trim_end_matches('/').to_owned(),
            bus_url: bus_url.trim_end_matches('/').to_owned(),
            bus_token,
            callers: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap_or_default(),
            function_metrics,
            history: Mutex::new(History::new(SAMPLES_KEPT)),
            dispatcher_items: Mutex::default(),
        }
    }

    /// The dispatcher's per-subscription items (`GET /subscriptions`), or `None` when it is
    /// not configured or not reachable.
    async fn dispatcher_subscriptions(&self) -> Option<Vec<SubscriptionDeliveries>> {
        let url = self.dispatcher_url.as_ref()?;
        let response = self
            .http
            .get(format!("{url}/subscriptions"))
            .timeout(Duration::from_secs(2))
            .send()
            .await;
        let list: SubscriptionList = answer(response).await?;
        Some(list.items)
    }

    /// Takes one sample of every counter the charts draw, keeping the dispatcher's items for
    /// the page.
    async fn sample(&self) -> Sample {
        let mut sample = Sample::default();
        let dispatcher = self.dispatcher_subscriptions().await;
        for item in dispatcher.iter().flatten() {
            sample.subscriptions.insert(
                format!("{}/{}", item.namespace, item.name),
                DeliveryTotals {
                    delivered: item.counts.delivered,
                    retried: item.counts.retried,
                    dead_lettered: item.counts.dead_lettered,
                },
            );
        }
        for ((namespace, name), totals) in self.function_metrics.totals() {
            sample
                .functions
                .insert(format!("{namespace}/{name}"), totals);
        }
        *self
            .dispatcher_items
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = dispatcher;
        sample
    }

    fn charts(&self) -> Charts {
        self.history
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .charts(SAMPLE_EVERY.as_secs_f64())
    }
}

/// Samples the charts' counters every [`SAMPLE_EVERY`] until `shutdown`.
pub async fn sample(state: Arc<DashboardState>, shutdown: CancellationToken) {
    let mut every = tokio::time::interval(SAMPLE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = every.tick() => {
                let sample = state.sample().await;
                state.history.lock().unwrap_or_else(PoisonError::into_inner).push(sample);
            }
        }
    }
}

/// The page's Content-Security-Policy: its own inline script and style (by hash) and requests
/// to itself, nothing else; never framed (clickjacking).
fn content_security_policy() -> String {
    use base64::Engine as _;
    use sha2::{Digest as _, Sha256};
    let hash_of = |open: &str, close: &str| {
        let start = PAGE.find(open).map_or(0, |at| at + open.len());
        let end = PAGE[start..].find(close).map_or(start, |at| start + at);
        let digest = Sha256::digest(&PAGE.as_bytes()[start..end]);
        format!(
            "'sha256-{}'",
            base64::engine::general_purpose::STANDARD.encode(digest)
        )
    };
    format!(
        "default-src 'none'; script-src {}; style-src {}; connect-src 'self'; img-src 'self' data:; \
         base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        hash_of("<script>", "</script>"),
        hash_of("<style>", "</style>"),
    )
}

static PAGE_POLICY: std::sync::LazyLock<String> = std::sync::LazyLock::new(content_security_policy);

async fn page() -> Response {
    let mut response = Html(PAGE).into_response();
    let headers = response.headers_mut();
    if let Ok(policy) = HeaderValue::from_str(&PAGE_POLICY) {
        headers.insert(header::CONTENT_SECURITY_POLICY, policy);
    }
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    response
}

/// The page itself: static, holding no data, so it is served without a token and asks for
/// one when the API wants it.
pub fn page_router() -> Router {
    Router::new().route("/", get(page))
}

/// The only path that takes the API token as `?token=`: the live tail, which the page reads
/// with a browser `EventSource` (it cannot set headers).
pub const QUERY_TOKEN_PATHS: &[&str] = &[LIVE_TAIL];
const LIVE_TAIL: &str = "/dashboard/events";

/// The dashboard's data and actions (behind the API's tokens, when they are on).
pub fn router(state: Arc<DashboardState>) -> Router {
    Router::new()
        .route("/dashboard/state", get(snapshot))
        .route(LIVE_TAIL, get(tail))
        .route("/dashboard/events/{sequence}", get(event_detail))
        .route("/dashboard/publish", post(publish))
        .route("/dashboard/invoke", post(invoke))
        .route("/dashboard/dead-letters", get(dead_letters))
        .route(
            "/dashboard/subscriptions/{namespace}/{name}/redrive",
            post(redrive),
        )
        .with_state(state)
}

async fn snapshot(
    State(state): State<Arc<DashboardState>>,
    request_headers: HeaderMap,
) -> Response {
    let functions = state.store.list::<Function>(None).await.unwrap_or_default();
    let subscriptions = state
        .store
        .list::<Subscription>(None)
        .await
        .unwrap_or_default();
    // As sampled for the charts (every 2 s, as often as the page polls).
    let counts = state
        .dispatcher_items
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let item_of = |namespace: &str, name: &str| {
        counts
            .iter()
            .flatten()
            .find(|item| item.namespace == namespace && item.name == name)
    };
    let subscriptions: Vec<Value> = subscriptions
        .iter()
        .map(|sub| {
            let namespace = sub.metadata.namespace.as_deref().unwrap_or("default");
            let name = sub.metadata.name.as_deref().unwrap_or("");
            let item = item_of(namespace, name);
            let function = resources::parse_function_sink(&sub.spec.sink)
                .map(|sink| format!("{}/{}", sink.namespace, sink.function));
            json!({
                "resource": sub,
                "counts": item.map(|item| item.counts),
                "replyTypes": item.map(|item| item.reply_types.as_slice()).unwrap_or_default(),
                "function": function,
            })
        })
        .collect();
    // What the tables show, not the functions' source and env (secrets may be in env).
    let functions: Vec<Value> = functions
        .iter()
        .map(|function| {
            json!({
                "metadata": {"namespace": function.metadata.namespace, "name": function.metadata.name},
                "spec": {"runtime": function.spec.runtime},
                "status": function.status,
            })
        })
        .collect();
    let body = json!({
        "functions": functions,
        "subscriptions": subscriptions,
        "dispatcher": counts.is_some(),
        "charts": state.charts(),
    })
    .to_string();
    // The page polls every 2 s: an unchanged state is answered 304 with no body (the browser
    // revalidates by itself thanks to `no-cache`).
    let tag = {
        use sha2::{Digest as _, Sha256};
        format!("\"{:x}\"", Sha256::digest(body.as_bytes()))
    };
    let matches = request_headers
        .get(header::IF_NONE_MATCH)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|given| given.split(',').any(|one| one.trim() == tag));
    let mut response = if matches {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response()
    };
    if let Ok(tag) = HeaderValue::from_str(&tag) {
        response.headers_mut().insert(header::ETAG, tag);
    }
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// The text of `bytes` for the page: UTF-8 (lossy) up to [`SHOWN_BYTES`], and whether it
/// was cut.
fn shown(bytes: &[u8]) -> (String, bool) {
    let cut = bytes.len() > SHOWN_BYTES;
    let kept = &bytes[..bytes.len().min(SHOWN_BYTES)];
    (String::from_utf8_lossy(kept).into_owned(), cut)
}

/// One stored event: its attributes, data, the attempts the dispatcher recorded, its dead
/// letters and its trace.
async fn event_detail(
    State(state): State<Arc<DashboardState>>,
    Path(sequence): Path<u64>,
) -> Result<Response, ErrorResponse> {
    let stream = match state.js.get_stream(EVENTS_STREAM).await {
        Ok(stream) => stream,
        Err(error) => {
            tracing::warn!(%error, "dashboard: no event stream");
            return Err(ErrorResponse::message(
                StatusCode::SERVICE_UNAVAILABLE,
                "event stream unavailable",
            ));
        }
    };
    let message = match stream.get_raw_message(sequence).await {
        Ok(message) => message,
        Err(error) => {
            use async_nats::jetstream::stream::RawMessageErrorKind as Kind;
            return if matches!(error.kind(), Kind::NoMessageFound) {
                Err(ErrorResponse::message(
                    StatusCode::NOT_FOUND,
                    format!(
                        "no event at sequence {sequence} (never stored, or removed by the stream's limits)"
                    ),
                ))
            } else {
                tracing::warn!(%error, sequence, "dashboard: cannot read an event");
                Err(ErrorResponse::message(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "cannot read the event from NATS",
                ))
            };
        }
    };
    let mut attributes = serde_json::Map::new();
    let mut traceparent = None;
    for (name, values) in message.headers.iter() {
        let name: &str = name.as_ref();
        let Some(value) = values.first().map(|v| v.as_str().to_owned()) else {
            continue;
        };
        if let Some(attribute) = name.strip_prefix("ce-") {
            attributes.insert(attribute.to_owned(), Value::String(value));
        } else if name.eq_ignore_ascii_case("content-type") {
            attributes.insert("datacontenttype".to_owned(), Value::String(value));
        } else if name.eq_ignore_ascii_case(eddy_model::headers::TRACEPARENT) {
            traceparent = Some(value);
        }
    }
    let (data, truncated) = shown(&message.payload);
    let trace_id = traceparent
        .as_deref()
        .and_then(traces::trace_id_of)
        .map(str::to_owned);
    let trace_url = trace_id.as_deref().and_then(traces::ui_link);
    let (deliveries, dead_letters) = match &state.dispatcher_url {
        Some(url) => {
            // Two independent reads of the dispatcher: asked at once, not one after the other.
            let (deliveries, letters) = futures::join!(
                state
                    .http
                    .get(format!("{url}/deliveries?sequence={sequence}"))
                    .timeout(Duration::from_secs(2))
                    .send(),
                state
                    .http
                    .get(format!("{url}/dead-letters"))
                    .timeout(Duration::from_secs(5))
                    .send(),
            );
            let deliveries = answer::<EventDeliveries>(deliveries)
                .await
                .map(|deliveries| deliveries.items);
            let letters = answer::<DeadLetterList>(letters).await.map(|letters| {
                letters
                    .items
                    .into_iter()
                    .filter(|letter| letter.stream_sequence == sequence)
                    .collect::<Vec<_>>()
            });
            (deliveries, letters)
        }
        None => (None, None),
    };
    Ok(Json(json!({
        "sequence": sequence,
        "subject": message.subject.as_str(),
        "stored": eddy_platform::nats::stored_time(message.time.unix_timestamp(), message.time.nanosecond()),
        "attributes": attributes,
        "data": data,
        "truncated": truncated,
        "deliveriesKnown": deliveries.is_some(),
        "deliveries": deliveries.unwrap_or_default(),
        "deadLetters": dead_letters.unwrap_or_default(),
        "traceId": trace_id,
        "traceUrl": trace_url,
    }))
    .into_response())
}

/// A test event from the page's form.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PublishForm {
    #[serde(rename = "type")]
    ty: String,
    source: String,
    /// A new UUID when missing or empty.
    id: Option<String>,
    /// Sent as `application/json`.
    data: Value,
}

/// Publishes a test event through the event-bus (binary mode), so it is checked and stored
/// exactly as any publisher's; answers the event-bus's status and message, and the id.
async fn publish(
    State(state): State<Arc<DashboardState>>,
    Json(form): Json<PublishForm>,
) -> Result<Response, ErrorResponse> {
    let id = form
        .id
        .filter(|id| !id.trim().is_empty())
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    for (field, value) in [("type", &form.ty), ("source", &form.source), ("id", &id)] {
        if value.trim().is_empty() {
            return Err(ErrorResponse::message(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("{field}: must not be empty"),
            ));
        }
        // Sent as a `ce-` header: a line break or another control character cannot be.
        if header::HeaderValue::from_str(value).is_err() {
            return Err(ErrorResponse::message(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("{field}: must hold no line breaks or other control characters"),
            ));
        }
    }
    let mut request = state
        .callers
        .post(format!("{}/publish", state.bus_url))
        .header("ce-specversion", "1.0")
        .header("ce-id", &id)
        .header("ce-source", &form.source)
        .header("ce-type", &form.ty)
        .header(header::CONTENT_TYPE, "application/json")
        .body(form.data.to_string())
        .timeout(Duration::from_secs(10));
    if let Some(token) = &state.bus_token {
        request = request.bearer_auth(token);
    }
    match request.send().await {
        Ok(response) if response.status().is_success() => {
            Ok(Json(json!({"id": id, "source": form.source, "type": form.ty})).into_response())
        }
        Ok(response) => {
            let status = response.status();
            let body = response.bytes().await.unwrap_or_default();
            let message = serde_json::from_slice::<Value>(&body)
                .ok()
                .and_then(|body| {
                    body["error"]
                        .as_str()
                        .or_else(|| body["message"].as_str())
                        .map(str::to_owned)
                })
                .unwrap_or_else(|| shown(&body).0);
            Err(ErrorResponse::message(
                status,
                format!("the event-bus refused it: {message}"),
            ))
        }
        Err(error) => {
            tracing::warn!(%error, "dashboard: cannot reach the event-bus");
            Err(ErrorResponse::message(
                StatusCode::BAD_GATEWAY,
                "the event-bus is not reachable",
            ))
        }
    }
}

/// A call from the page's form.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct InvokeForm {
    namespace: String,
    name: String,
    method: String,
    /// Path and query after the function's address, from `/`.
    path: String,
    #[serde(default)]
    headers: Vec<(String, String)>,
    #[serde(default)]
    body: String,
}

/// Headers the page may not set on a call: the connection's own.
const HOP_BY_HOP: [&str; 8] = [
    "host",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
];

/// The gateway URL of a dashboard call of `namespace/name` at `path`, or `None` when the call
/// would leave the function's own address. `path` must be visible ASCII (no spaces, tabs or
/// other controls, which URL parsers drop, and no backslash, which they read as `/`), without a
/// fragment or a `.`/`..` segment (plain or percent-encoded); and the URL as parsed must still
/// be under `/<namespace>/<name>`. Pure.
pub fn invoke_url(gateway: &str, namespace: &str, name: &str, path: &str) -> Option<String> {
    let path_only = path.split('?').next().unwrap_or_default();
    let climbs = path_only.split('/').any(|segment| {
        let segment = segment.to_ascii_lowercase().replace("%2e", ".");
        segment == ".." || segment == "."
    });
    let visible = path
        .bytes()
        .all(|b| b.is_ascii_graphic() && b != b'\\' && b != b'#');
    if !path.starts_with('/') || !visible || climbs {
        return None;
    }
    let url = format!(
        "{gateway}/{namespace}/{name}{}",
        if path == "/" { "" } else { path }
    );
    let parsed = url::Url::parse(&url).ok()?;
    let base = format!("/{namespace}/{name}");
    let inside = parsed.path() == base || parsed.path().starts_with(&format!("{base}/"));
    inside.then_some(url)
}

/// Calls a function through the gateway, as any caller would (its access rules apply), and
/// answers the status, headers, body and time taken.
async fn invoke(
    State(state): State<Arc<DashboardState>>,
    Json(form): Json<InvokeForm>,
) -> Result<Response, ErrorResponse> {
    if !resources::is_dns1123_label(&form.namespace) {
        return Err(ErrorResponse::message(
            StatusCode::UNPROCESSABLE_ENTITY,
            "namespace: not a namespace name",
        ));
    }
    if !resources::is_dns1035_label(&form.name) {
        return Err(ErrorResponse::message(
            StatusCode::UNPROCESSABLE_ENTITY,
            "name: not a function name",
        ));
    }
    let Ok(method) = reqwest::Method::from_bytes(form.method.as_bytes()) else {
        return Err(ErrorResponse::message(
            StatusCode::UNPROCESSABLE_ENTITY,
            "method: not an HTTP method",
        ));
    };
    let Some(url) = invoke_url(&state.gateway_url, &form.namespace, &form.name, &form.path) else {
        return Err(ErrorResponse::message(
            StatusCode::UNPROCESSABLE_ENTITY,
            "path: must start with / and hold only visible ASCII, no backslash, fragment or . and .. segments",
        ));
    };
    let mut headers = reqwest::header::HeaderMap::new();
    for (name, value) in &form.headers {
        let (Ok(header_name), Ok(header_value)) = (
            reqwest::header::HeaderName::from_bytes(name.trim().as_bytes()),
            reqwest::header::HeaderValue::from_str(value.trim()),
        ) else {
            return Err(ErrorResponse::message(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("headers: {name:?} is not a valid header"),
            ));
        };
        if HOP_BY_HOP.contains(&header_name.as_str()) {
            continue;
        }
        headers.append(header_name, header_value);
    }
    let started = Instant::now();
    let sent = state
        .callers
        .request(method, url)
        .headers(headers)
        .body(form.body)
        .timeout(Duration::from_secs(300))
        .send()
        .await;
    let response = match sent {
        Ok(response) => response,
        Err(error) => {
            tracing::debug!(%error, "dashboard: the call failed");
            return Err(ErrorResponse::message(
                StatusCode::BAD_GATEWAY,
                format!(
                    "the call failed: {}",
                    if error.is_timeout() {
                        "no answer within 5 minutes"
                    } else {
                        "the gateway is not reachable"
                    }
                ),
            ));
        }
    };
    let status = response.status().as_u16();
    let answer_headers: Vec<(String, String)> = response
        .headers()
        .iter()
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                String::from_utf8_lossy(value.as_bytes()).into_owned(),
            )
        })
        .collect();
    let mut body = Vec::new();
    let mut truncated = false;
    let mut response = response;
    loop {
        match response.chunk().await {
            Ok(None) => break,
            Ok(Some(chunk)) => {
                let room = SHOWN_BYTES.saturating_sub(body.len());
                body.extend_from_slice(&chunk[..chunk.len().min(room)]);
                if chunk.len() > room {
                    truncated = true;
                    break;
                }
            }
            Err(error) => {
                tracing::debug!(%error, "dashboard: the answer broke off");
                truncated = true;
                break;
            }
        }
    }
    Ok(Json(json!({
        "status": status,
        "headers": answer_headers,
        "body": String::from_utf8_lossy(&body),
        "truncated": truncated,
        "millis": started.elapsed().as_secs_f64() * 1000.0,
    }))
    .into_response())
}

/// Sends a request to the dispatcher's admin API and answers what it answered.
async fn to_dispatcher(
    state: &DashboardState,
    request: impl FnOnce(&reqwest::Client, &str) -> reqwest::RequestBuilder,
) -> Result<Response, ErrorResponse> {
    let Some(url) = &state.dispatcher_url else {
        return Err(ErrorResponse::message(
            StatusCode::SERVICE_UNAVAILABLE,
            "no dispatcher is configured (--dispatcher-url)",
        ));
    };
    match request(&state.http, url)
        .timeout(Duration::from_secs(60))
        .send()
        .await
    {
        Ok(response) => {
            let status =
                StatusCode::from_u16(response.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            let body = response.bytes().await.unwrap_or_default();
            Ok((
                status,
                [(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                )],
                body,
            )
                .into_response())
        }
        Err(error) => {
            tracing::warn!(%error, "dashboard: cannot reach the dispatcher");
            Err(ErrorResponse::message(
                StatusCode::BAD_GATEWAY,
                "the dispatcher is not reachable",
            ))
        }
    }
}

#[derive(Debug, Deserialize)]
struct DeadLetterQuery {
    subscription: Option<String>,
}

async fn dead_letters(
    State(state): State<Arc<DashboardState>>,
    Query(query): Query<DeadLetterQuery>,
) -> Result<Response, ErrorResponse> {
    to_dispatcher(&state, |http, url| match &query.subscription {
        Some(subscription) => http.get(format!(
            "{url}/dead-letters?{}",
            url::form_urlencoded::Serializer::new(String::new())
                .append_pair("subscription", subscription)
                .finish()
        )),
        None => http.get(format!("{url}/dead-letters")),
    })
    .await
}

async fn redrive(
    State(state): State<Arc<DashboardState>>,
    Path((namespace, name)): Path<(String, String)>,
) -> Result<Response, ErrorResponse> {
    if !resources::is_dns1123_label(&namespace) || !resources::is_dns1123_subdomain(&name) {
        return Err(ErrorResponse::message(
            StatusCode::NOT_FOUND,
            "no such subscription",
        ));
    }
    to_dispatcher(&state, |http, url| {
        http.post(format!("{url}/subscriptions/{namespace}/{name}/redrive"))
    })
    .await
}

/// A successful answer of the dispatcher, read as `T`: every typed answer the console reads
/// goes through here (a failed or unreadable one is `None`).
async fn answer<T: serde::de::DeserializeOwned>(
    response: Result<reqwest::Response, reqwest::Error>,
) -> Option<T> {
    match response {
        Ok(response) if response.status().is_success() => response.json().await.ok(),
        _ => None,
    }
}

fn summary(message: &jetstream::Message) -> Value {
    let header = |name: &str| {
        message
            .headers
            .as_ref()
            .and_then(|h| h.get(name))
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default()
    };
    let info = message.info().ok();
    let sequence = info.as_ref().map_or(0, |info| info.stream_sequence);
    let mut time = header("ce-time");
    if time.is_empty() {
        // No `time` attribute: show when JetStream stored it.
        if let Some(published) = info.map(|info| info.published) {
            time = eddy_platform::nats::stored_time(
                published.unix_timestamp(),
                published.nanosecond(),
            );
        }
    }
    json!({
        "sequence": sequence,
        "type": header("ce-type"),
        "source": header("ce-source"),
        "id": header("ce-id"),
        "time": time,
        "bytes": message.payload.len(),
    })
}

async fn tail(State(state): State<Arc<DashboardState>>) -> Response {
    let unavailable =
        || (StatusCode::SERVICE_UNAVAILABLE, "event stream unavailable").into_response();
    let mut stream = match state.js.get_stream(EVENTS_STREAM).await {
        Ok(stream) => stream,
        Err(error) => {
            tracing::warn!(%error, "dashboard tail: no stream");
            return unavailable();
        }
    };
    // The last TAIL_HISTORY events first, then what comes.
    let start = match stream.info().await {
        Ok(info) => info
            .state
            .last_sequence
            .saturating_sub(TAIL_HISTORY - 1)
            .max(1),
        Err(_) => 1,
    };
    let consumer = stream
        .create_consumer(OrderedConfig {
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: start,
            },
            ..Default::default()
        })
        .await;
    let messages = match consumer {
        Ok(consumer) => consumer.messages().await,
        Err(error) => {
            tracing::warn!(%error, "dashboard tail: cannot create consumer");
            return unavailable();
        }
    };
    let messages = match messages {
        Ok(messages) => messages,
        Err(error) => {
            tracing::warn!(%error, "dashboard tail: cannot read the consumer");
            return unavailable();
        }
    };
    let events = messages.filter_map(|message| async move {
        let message = message.ok()?;
        Some(Ok::<_, Infallible>(
            Event::default()
                .event("cloudevent")
                .data(summary(&message).to_string()),
        ))
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::invoke_url;

    #[test]
    fn invoke_urls_stay_under_the_function() {
        let url = |path: &str| invoke_url("http://127.0.0.1:8080", "shop", "quote", path);
        assert_eq!(
            url("/").as_deref(),
            Some("http://127.0.0.1:8080/shop/quote")
        );
        assert_eq!(
            url("/orders/7?expand=lines").as_deref(),
            Some("http://127.0.0.1:8080/shop/quote/orders/7?expand=lines")
        );
        for escape in [
            "/../../metrics",
            "/%2e%2e/%2E%2E/metrics",
            "/.\t./.\t./metrics",
            "/.\n./x",
            "/..\\..\\metrics",
            "/a b",
            "/#frag",
            "relative",
            "/ä",
        ] {
            assert_eq!(url(escape), None, "{escape:?}");
        }
    }
}
