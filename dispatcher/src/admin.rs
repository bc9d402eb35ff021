//! The dispatcher's admin API: probes, metrics, per-subscription counts (for the dashboard),
//! dead letters, redrive and replay (for `eddy dlq` and `eddy replay`).

use std::sync::Arc;

use axum::{
    Json, Router,
    extract::{Path, Query, State},
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use eddy_model::admin::{
    DeadLetterList, EventDeliveries, Redriven, ReplayRequest, ReplayStarted, SubscriptionAttempts,
    SubscriptionDeliveries, SubscriptionList,
};
use eddy_platform::errors::ErrorResponse;
use serde::Deserialize;
use tracing::Instrument as _;

use crate::{
    deadletter,
    manager::{ManagerHandle, ReplayFrom},
    send::Shared,
};

/// What the admin handlers share.
pub struct AdminState {
    /// Delivery context.
    pub shared: Arc<Shared>,
    /// The workers.
    pub manager: ManagerHandle,
    /// NATS client, for readiness.
    pub client: async_nats::Client,
}

type Admin = State<Arc<AdminState>>;

/// The admin router.
pub fn router(state: Arc<AdminState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/subscriptions", get(subscriptions))
        .route("/dead-letters", get(dead_letters))
        .route("/deliveries", get(deliveries))
        .route("/subscriptions/{namespace}/{name}/redrive", post(redrive))
        .route("/subscriptions/{namespace}/{name}/replay", post(replay))
        .with_state(state)
}

async fn readyz(State(state): Admin) -> Response {
    let connected = state.client.connection_state() == async_nats::connection::State::Connected;
    if connected && state.manager.is_synced() {
        (StatusCode::OK, "ready").into_response()
    } else if connected {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "subscriptions not loaded yet",
        )
            .into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not connected to NATS").into_response()
    }
}

async fn metrics(State(state): Admin) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.shared.metrics.encode(),
    )
        .into_response()
}

async fn subscriptions(State(state): Admin) -> Json<SubscriptionList> {
    let items: Vec<_> = state
        .manager
        .targets()
        .iter()
        .map(|target| SubscriptionDeliveries {
            namespace: target.namespace.clone(),
            name: target.name.clone(),
            sink: target.sink.clone(),
            counts: state.shared.metrics.counts(&target.label),
            reply_types: state.shared.journal.reply_types(&target.label),
        })
        .collect();
    Json(SubscriptionList { items })
}

#[derive(Debug, Deserialize)]
struct DeliveriesQuery {
    /// The event's sequence in `EDDY_EVENTS`.
    sequence: u64,
}

/// The recent attempts of one event, by subscription (what this dispatcher saw; see
/// [`crate::journal`]).
async fn deliveries(
    State(state): Admin,
    Query(query): Query<DeliveriesQuery>,
) -> Json<EventDeliveries> {
    let items: Vec<_> = state
        .shared
        .journal
        .attempts_of(query.sequence)
        .into_iter()
        .map(|(subscription, attempts)| SubscriptionAttempts {
            subscription,
            attempts,
        })
        .collect();
    Json(EventDeliveries {
        sequence: query.sequence,
        items,
    })
}

#[derive(Debug, Deserialize)]
struct DeadLetterQuery {
    /// `namespace/name`; all when missing.
    subscription: Option<String>,
    /// At most this many (default 1000).
    limit: Option<usize>,
}

async fn dead_letters(
    State(state): Admin,
    Query(query): Query<DeadLetterQuery>,
) -> Result<Json<DeadLetterList>, ErrorResponse> {
    let subscription = match query.subscription.as_deref() {
        None => None,
        Some(text) => match text.split_once('/') {
            Some((namespace, name)) if !namespace.is_empty() && !name.is_empty() => {
                Some((namespace, name))
            }
            _ => {
                return Err(ErrorResponse::message(
                    StatusCode::BAD_REQUEST,
                    "subscription must be namespace/name",
                ));
            }
        },
    };
    let items = deadletter::list(&state.shared.js, subscription, query.limit.unwrap_or(1000))
        .await
        .map_err(|failure| {
            tracing::warn!(error = %failure, "cannot list dead letters");
            unreadable_dead_letters()
        })?;
    Ok(Json(DeadLetterList { items }))
}

fn unreadable_dead_letters() -> ErrorResponse {
    ErrorResponse::message(
        StatusCode::SERVICE_UNAVAILABLE,
        "cannot read dead letters from NATS",
    )
}

/// The Subscription `namespace/name` this dispatcher delivers, or 404.
fn delivered(
    state: &AdminState,
    namespace: &str,
    name: &str,
) -> Result<Arc<crate::index::LiveSubscription>, ErrorResponse> {
    state.manager.target(namespace, name).ok_or_else(|| {
        ErrorResponse::message(
            StatusCode::NOT_FOUND,
            format!("no subscription {namespace}/{name} is being delivered"),
        )
    })
}

async fn redrive(
    State(state): Admin,
    Path((namespace, name)): Path<(String, String)>,
) -> Result<Json<Redriven>, ErrorResponse> {
    let target = delivered(&state, &namespace, &name)?;
    let span = tracing::info_span!("redrive", subscription = %target.label);
    let outcome = deadletter::redrive(&state.shared, &target)
        .instrument(span)
        .await
        .map_err(|failure| {
            tracing::warn!(error = %failure, "redrive failed");
            unreadable_dead_letters()
        })?;
    Ok(Json(outcome))
}

async fn replay(
    State(state): Admin,
    Path((namespace, name)): Path<(String, String)>,
    Json(request): Json<ReplayRequest>,
) -> Result<(StatusCode, Json<ReplayStarted>), ErrorResponse> {
    let target = delivered(&state, &namespace, &name)?;
    let from = match (request.since, request.from_seq) {
        (Some(since), None) => match humantime::parse_duration(&since) {
            Ok(duration) => {
                let ago = chrono::Duration::from_std(duration).unwrap_or(chrono::Duration::MAX);
                ReplayFrom::Time(
                    chrono::Utc::now()
                        .checked_sub_signed(ago)
                        .unwrap_or_default(),
                )
            }
            Err(problem) => {
                return Err(ErrorResponse::message(
                    StatusCode::BAD_REQUEST,
                    format!("since: not a duration: {problem}"),
                ));
            }
        },
        (None, Some(sequence)) => ReplayFrom::Sequence(sequence.max(1)),
        _ => {
            return Err(ErrorResponse::message(
                StatusCode::BAD_REQUEST,
                "give exactly one of since or fromSeq",
            ));
        }
    };
    let events = state
        .manager
        .replay(target, from)
        .await
        .map_err(|failure| {
            tracing::warn!(error = %failure, "replay failed to start");
            ErrorResponse::message(StatusCode::SERVICE_UNAVAILABLE, "cannot start the replay")
        })?;
    Ok((StatusCode::ACCEPTED, Json(ReplayStarted { events })))
}
