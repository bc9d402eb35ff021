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
mod pages;

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
pub use pages::invoke::invoke_url;
use pages::{dead_letters::*, events::*, invoke::*, overview::*, publish::*};

const PAGE: &str = include_str!("page.html");

/// Events shown when the tail opens.
const TAIL_HISTORY: u64 = 20;

/// Seconds between two samples of the charts.
const SAMPLE_EVERY: Duration = Duration::from_secs(2);

/// Samples kept: five minutes.
const SAMPLES_KEPT: usize = 151;

/// The most of a function's answer or an event's data the page is sent.
const SHOWN_BYTES: usize = 1024 * 1024;

/// What the dashboard is built from.
pub struct DashboardParts {
    /// The resource store (Functions, Subscriptions, their status).
    pub store: Store,
    /// JetStream, for the live tail and the events' detail.
    pub js: jetstream::Context,
    /// The dispatcher's admin API (its delivery counts, dead letters), when there is one.
    pub dispatcher_url: Option<String>,
    /// The token the dispatcher's admin API takes.
    pub dispatcher_token: Option<String>,
    /// Where Functions are called (the gateway).
    pub gateway_url: String,
    /// Where test events are published (the event-bus).
    pub bus_url: String,
    /// The token the event-bus takes from publishers.
    pub bus_token: Option<String>,
    /// The Functions' call counts, for the charts.
    pub function_metrics: Arc<FunctionMetrics>,
}

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
    pub fn new(parts: DashboardParts) -> Self {
        let DashboardParts {
            store,
            js,
            dispatcher_url,
            dispatcher_token,
            gateway_url,
            bus_url,
            bus_token,
            function_metrics,
        } = parts;
        Self {
            store,
            js,
            dispatcher_url: dispatcher_url.map(|url| url.trim_end_matches('/').to_owned()),
            http: dispatcher_client(dispatcher_token.as_deref()),
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
        let dispatcher = self.dispatcher_subscriptions().await;
        let mut sample = Sample {
            subscriptions_unknown: self.dispatcher_url.is_some() && dispatcher.is_none(),
            ..Sample::default()
        };
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
