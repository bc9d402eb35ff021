//! The dashboard, served at the API address: Functions with status and replicas, Subscriptions
//! with delivered, retried and dead-lettered counts and pending events (from the dispatcher),
//! and a live tail of events (server-sent events from `EDDY_EVENTS`).

use std::{convert::Infallible, sync::Arc, time::Duration};

use async_nats::jetstream::{
    self,
    consumer::{DeliverPolicy, pull::OrderedConfig},
};
use axum::{
    Router,
    extract::State,
    http::{HeaderMap, HeaderValue, header},
    response::{
        Html, IntoResponse, Response,
        sse::{Event, KeepAlive, Sse},
    },
    routing::get,
};
use eddy_model::resources::{Function, Subscription};
use eddy_platform::{nats::EVENTS_STREAM, store::Store};
use futures::StreamExt as _;
use serde_json::{Value, json};

const PAGE: &str = include_str!("dashboard.html");

/// Events shown when the tail opens.
const TAIL_HISTORY: u64 = 20;

/// What the dashboard reads.
pub struct DashboardState {
    /// Resources.
    pub store: Store,
    /// Events.
    pub js: jetstream::Context,
    /// The dispatcher's admin API, for delivery counts.
    pub dispatcher_url: Option<String>,
    /// HTTP client for the dispatcher.
    pub http: reqwest::Client,
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

/// The dashboard routes.
pub fn router(state: Arc<DashboardState>) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/dashboard/state", get(snapshot))
        .route("/dashboard/events", get(tail))
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
    let counts = match &state.dispatcher_url {
        Some(url) => match state
            .http
            .get(format!("{url}/subscriptions"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
        {
            Ok(response) => response.json::<Value>().await.unwrap_or(Value::Null),
            Err(_) => Value::Null,
        },
        None => Value::Null,
    };
    let counts_of = |namespace: &str, name: &str| {
        counts["items"]
            .as_array()
            .and_then(|items| {
                items
                    .iter()
                    .find(|i| i["namespace"] == namespace && i["name"] == name)
            })
            .map(|item| item["counts"].clone())
            .unwrap_or(Value::Null)
    };
    let subscriptions: Vec<Value> = subscriptions
        .iter()
        .map(|sub| {
            let namespace = sub.metadata.namespace.as_deref().unwrap_or("default");
            let name = sub.metadata.name.as_deref().unwrap_or("");
            json!({"resource": sub, "counts": counts_of(namespace, name)})
        })
        .collect();
    // What the table shows, not the functions' source and env (secrets may be in env).
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
        "dispatcher": counts.is_object(),
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
        axum::http::StatusCode::NOT_MODIFIED.into_response()
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
    let start = match state.js.get_stream(EVENTS_STREAM).await {
        Ok(mut stream) => match stream.info().await {
            Ok(info) => info
                .state
                .last_sequence
                .saturating_sub(TAIL_HISTORY - 1)
                .max(1),
            Err(_) => 1,
        },
        Err(_) => {
            return (
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                "event stream unavailable",
            )
                .into_response();
        }
    };
    let consumer = match state.js.get_stream(EVENTS_STREAM).await {
        Ok(stream) => {
            stream
                .create_consumer(OrderedConfig {
                    deliver_policy: DeliverPolicy::ByStartSequence {
                        start_sequence: start,
                    },
                    ..Default::default()
                })
                .await
        }
        Err(error) => {
            tracing::warn!(%error, "dashboard tail: no stream");
            return (
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                "event stream unavailable",
            )
                .into_response();
        }
    };
    let messages = match consumer {
        Ok(consumer) => consumer.messages().await,
        Err(error) => {
            tracing::warn!(%error, "dashboard tail: cannot create consumer");
            return (
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                "event stream unavailable",
            )
                .into_response();
        }
    };
    let Ok(messages) = messages else {
        return (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "event stream unavailable",
        )
            .into_response();
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
