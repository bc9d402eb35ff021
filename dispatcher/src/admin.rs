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
use serde::Deserialize;
use serde_json::json;
use tracing::Instrument as _;

use crate::{
    deadletter,
    manager::{ManagerHandle, ReplayFrom},
    worker::Shared,
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

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    eddy_platform::errors::ErrorResponse::message(status, message).into_response()
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

async fn subscriptions(State(state): Admin) -> Response {
    let items: Vec<_> = state
        .manager
        .targets()
        .iter()
        .map(|target| {
            json!({
                "namespace": target.namespace,
                "name": target.name,
                "sink": target.sink,
                "counts": state.shared.metrics.counts(&target.label),
                "replyTypes": state.shared.journal.reply_types(&target.label),
            })
        })
        .collect();
    Json(json!({ "items": items })).into_response()
}

#[derive(Debug, Deserialize)]
struct DeliveriesQuery {
    /// The event's sequence in `EDDY_EVENTS`.
    sequence: u64,
}

/// The recent attempts of one event, by subscription (what this dispatcher saw; see
/// [`crate::journal`]).
async fn deliveries(State(state): Admin, Query(query): Query<DeliveriesQuery>) -> Response {
    let items: Vec<_> = state
        .shared
        .journal
        .attempts_of(query.sequence)
        .into_iter()
        .map(|(subscription, attempts)| json!({"subscription": subscription, "attempts": attempts}))
        .collect();
    Json(json!({ "sequence": query.sequence, "items": items })).into_response()
}

#[derive(Debug, Deserialize)]
struct DeadLetterQuery {
    /// `namespace/name`; all when missing.
    subscription: Option<String>,
    /// At most this many (default 1000).
    limit: Option<usize>,
}

async fn dead_letters(State(state): Admin, Query(query): Query<DeadLetterQuery>) -> Response {
    let subscription = match query.subscription.as_deref() {
        None => None,
        Some(text) => match text.split_once('/') {
            Some((namespace, name)) if !namespace.is_empty() && !name.is_empty() => {
                Some((namespace, name))
            }
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "subscription must be namespace/name",
                );
            }
        },
    };
    match deadletter::list(&state.shared.js, subscription, query.limit.unwrap_or(1000)).await {
        Ok(items) => Json(json!({ "items": items })).into_response(),
        Err(failure) => {
            tracing::warn!(error = %failure, "cannot list dead letters");
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                "cannot read dead letters from NATS",
            )
        }
    }
}

async fn redrive(State(state): Admin, Path((namespace, name)): Path<(String, String)>) -> Response {
    let Some(target) = state.manager.target(&namespace, &name) else {
        return error(
            StatusCode::NOT_FOUND,
            format!("no subscription {namespace}/{name} is being delivered"),
        );
    };
    let span = tracing::info_span!("redrive", subscription = %target.label);
    match deadletter::redrive(&state.shared, &target)
        .instrument(span)
        .await
    {
        Ok(outcome) => Json(outcome).into_response(),
        Err(failure) => {
            tracing::warn!(error = %failure, "redrive failed");
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                "cannot read dead letters from NATS",
            )
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ReplayRequest {
    /// Replay events stored within this long ago (`10m`, `2h`).
    since: Option<String>,
    /// Replay from this stream sequence.
    from_seq: Option<u64>,
}

async fn replay(
    State(state): Admin,
    Path((namespace, name)): Path<(String, String)>,
    Json(request): Json<ReplayRequest>,
) -> Response {
    let Some(target) = state.manager.target(&namespace, &name) else {
        return error(
            StatusCode::NOT_FOUND,
            format!("no subscription {namespace}/{name} is being delivered"),
        );
    };
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
                return error(
                    StatusCode::BAD_REQUEST,
                    format!("since: not a duration: {problem}"),
                );
            }
        },
        (None, Some(sequence)) => ReplayFrom::Sequence(sequence.max(1)),
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "give exactly one of since or fromSeq",
            );
        }
    };
    match state.manager.replay(target, from).await {
        Ok(events) => (StatusCode::ACCEPTED, Json(json!({ "events": events }))).into_response(),
        Err(failure) => {
            tracing::warn!(error = %failure, "replay failed to start");
            error(StatusCode::SERVICE_UNAVAILABLE, "cannot start the replay")
        }
    }
}
