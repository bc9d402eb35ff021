//! One delivery attempt: the event POSTed to its sink within the Subscription's timeout (with
//! in-progress acks while it runs), the answer classified, and a reply event the sink answered
//! with stored. Also what every attempt needs ([`Shared`]) and how it reaches sinks
//! ([`Deliveries`]: over HTTP, or to the gateway of this process). Settling the event with
//! JetStream is the worker's; this module never acks.

use std::time::Duration;

use async_nats::{
    HeaderMap as NatsHeaders,
    jetstream::{self, AckKind},
};
use bytes::Bytes;
use eddy_model::event::{self, Limits};
use eddy_model::headers as names;
use eddy_platform::{
    publisher::{PublishFailure, Publisher},
    traces,
};
use http_body_util::Full;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use tracing::Instrument as _;

use crate::{
    delivery::{self, Failure, Verdict},
    index::LiveSubscription,
    journal::Journal,
    metrics::Metrics,
    scaler::Scaler,
    sinks::{Resolved, Sinks},
};

/// What every delivery needs.
pub struct Shared {
    /// JetStream (dead letters, consumers).
    pub js: jetstream::Context,
    /// How deliveries reach sinks.
    pub deliveries: Deliveries,
    /// Sink resolution.
    pub sinks: Sinks,
    /// Metrics.
    pub metrics: Metrics,
    /// Stores sinks' reply events in `EDDY_EVENTS`.
    pub replies: Publisher,
    /// Limits of a reply event (its size is `--max-reply-size`).
    pub reply_limits: Limits,
    /// How often to send in-progress acks while a delivery runs.
    pub progress_every: Duration,
    /// Recent attempts and reply types, for the dashboard.
    pub journal: Journal,
    /// Scaling from zero on Kubernetes: events for a Function with no ready pod wait for it.
    pub scaler: Option<Scaler>,
}

/// The client deliveries go through.
pub type SinkClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// How deliveries reach sinks: over HTTP, except those to a gateway running in this process.
#[derive(Debug, Clone)]
pub struct Deliveries {
    /// HTTP client for sinks: hyper's pooled client, no redirects (a sink cannot bounce us
    /// elsewhere), the request built from the pre-parsed sink URI.
    client: SinkClient,
    gateway: Option<InProcessGateway>,
}

impl Deliveries {
    /// Deliveries over HTTP through `client`, except those to `gateway`'s address, which are
    /// handed to it in this process.
    pub fn new(client: SinkClient, gateway: Option<InProcessGateway>) -> Self {
        Self { client, gateway }
    }

    /// The in-process gateway, when `uri` points at it.
    fn in_process(&self, uri: &http::Uri) -> Option<&InProcessGateway> {
        self.gateway
            .as_ref()
            .filter(|gateway| uri.authority() == Some(&gateway.authority))
    }
}

/// The function gateway of this process (`eddy up` runs it beside the dispatcher), called
/// directly: a delivery to a function behind it skips a loopback HTTP exchange (a write and a
/// read at each end, and two connection tasks woken) and gets the same routing, access checks
/// and answers as over HTTP.
#[derive(Debug, Clone)]
pub struct InProcessGateway {
    /// The gateway's listening address, as sink URLs name it.
    authority: http::uri::Authority,
    service: axum::Router,
}

impl InProcessGateway {
    /// The gateway `service`, listening at `addr`.
    pub fn new(addr: std::net::SocketAddr, service: axum::Router) -> Option<Self> {
        let authority = http::uri::Authority::try_from(addr.to_string()).ok()?;
        Some(Self { authority, service })
    }
}

/// A pooled HTTP/1 client for sinks, over HTTP and HTTPS.
pub fn sink_client(pool_idle_timeout: Duration) -> crate::Result<SinkClient> {
    // No connect timeout of its own: the Subscription's delivery timeout bounds the whole try.
    Ok(eddy_platform::net::pooled_tls_client(
        pool_idle_timeout,
        None,
    )?)
}

/// What a sink answered that matters after the exchange.
struct Answer {
    verdict: Verdict,
    /// A reply event, when the sink's 2xx answer carried one.
    reply: Option<delivery::Reply>,
}

/// POSTs an event to the sink within the Subscription's timeout; with `progress`, sends
/// in-progress acks for it while it runs. One timer per delivery serves both.
pub async fn deliver(
    shared: &Shared,
    target: &LiveSubscription,
    sink: &Resolved,
    stored_headers: Option<&NatsHeaders>,
    payload: &Bytes,
    progress: Option<&jetstream::Message>,
) -> Verdict {
    let mut headers = stored_headers
        .map(|stored| delivery::http_headers(stored, target.encoding))
        .unwrap_or_default();
    if let Some(authorization) = &sink.authorization {
        headers.insert(http::header::AUTHORIZATION, authorization.clone());
    }
    if traces::enabled() {
        // The sink's spans are children of this attempt's.
        traces::inject_http(&tracing::Span::current(), &mut headers);
    }
    let mut request = http::Request::new(Full::new(payload.clone()));
    *request.method_mut() = http::Method::POST;
    *request.uri_mut() = sink.uri.clone();
    *request.headers_mut() = headers;
    let exchange = exchange(shared, target, request);
    let mut exchange = std::pin::pin!(exchange);
    let now = tokio::time::Instant::now();
    let deadline = now + target.policy.timeout;
    let mut next_progress = now + shared.progress_every;
    let timer = tokio::time::sleep_until(deadline.min(next_progress));
    let mut timer = std::pin::pin!(timer);
    let answer = loop {
        tokio::select! {
            answer = &mut exchange => break answer,
            () = &mut timer => {
                if tokio::time::Instant::now() >= deadline {
                    return Verdict::Retry { reason: Failure::Timeout, status: None };
                }
                if let Some(message) = progress
                    && let Err(error) = message.ack_with(AckKind::Progress).await {
                        tracing::debug!(%error, "in-progress ack failed");
                    }
                next_progress += shared.progress_every;
                timer.as_mut().reset(deadline.min(next_progress));
            }
        }
    };
    match answer {
        Answer {
            verdict,
            reply: Some(reply),
        } => match publish_reply(shared, target, stored_headers, reply).await {
            Ok(()) => verdict,
            Err(reason) => Verdict::Retry {
                reason,
                status: None,
            },
        },
        Answer { verdict, .. } => verdict,
    }
}

/// Sends the request (over HTTP, or to the gateway of this process) and reads a 2xx answer's
/// body (a possible reply event).
async fn exchange(
    shared: &Shared,
    target: &LiveSubscription,
    request: http::Request<Full<Bytes>>,
) -> Answer {
    if let Some(gateway) = shared.deliveries.in_process(request.uri()) {
        use tower::ServiceExt as _;
        // The router's error type is `Infallible`: every failure is an answer.
        let Ok(response) = gateway.service.clone().oneshot(request).await;
        return answer(shared, target, response).await;
    }
    match shared.deliveries.client.request(request).await {
        Ok(response) => answer(shared, target, response).await,
        Err(error) => {
            tracing::debug!(%error, "delivery failed in transport");
            Answer {
                verdict: delivery::classify_error(&error),
                reply: None,
            }
        }
    }
}

/// What the sink's `response` means, with the reply event a 2xx answer carries.
async fn answer<B>(
    shared: &Shared,
    target: &LiveSubscription,
    response: http::Response<B>,
) -> Answer
where
    B: http_body::Body,
    B::Error: Into<axum::BoxError>,
{
    let verdict = delivery::classify_status(response.status().as_u16());
    if !matches!(verdict, Verdict::Delivered { .. }) {
        return Answer {
            verdict,
            reply: None,
        };
    }
    // Only an answer that looks like an event needs its headers kept; any body is read so the
    // connection goes back to the pool.
    let (parts, body) = response.into_parts();
    let reply_headers = delivery::may_carry_reply(&parts.headers).then_some(parts.headers);
    let body = eddy_platform::net::read_limited(body, shared.reply_limits.max_event_size).await;
    let reply = match (reply_headers, body) {
        (Some(headers), Ok(body)) => delivery::reply_event(&headers, body),
        (Some(_), Err(_)) => {
            shared
                .metrics
                .failure(&target.label, Failure::ReplyTooLarge);
            tracing::warn!("the sink's answer is too large (or broken) to be a reply; ignored");
            None
        }
        (None, _) => None,
    };
    Answer { verdict, reply }
}

/// Stores a sink's reply event in JetStream, parsed by the event-bus's own code (the stored
/// event is the same, byte for byte) with the trace context of the event it answers. A reply
/// that is not a valid event is logged and counted: retrying the delivery will not mend it. A
/// reply not stored is retried with the delivery.
async fn publish_reply(
    shared: &Shared,
    target: &LiveSubscription,
    stored_headers: Option<&NatsHeaders>,
    reply: delivery::Reply,
) -> Result<(), Failure> {
    let mut headers = reply.headers;
    if let Some(traceparent) = stored_headers
        .and_then(|h| h.get(names::TRACEPARENT))
        .and_then(|value| http::HeaderValue::from_str(value.as_str()).ok())
    {
        headers.insert(names::TRACEPARENT, traceparent);
    }
    let parsed = event::content_mode(&headers)
        .and_then(|mode| event::from_single(mode, &headers, reply.body, &shared.reply_limits));
    let event = match parsed {
        Ok(event) => event,
        Err(error) => {
            shared.metrics.failure(&target.label, Failure::ReplyRefused);
            tracing::warn!(reason = %error.message, "the sink's reply is not a valid event; dropped");
            return Ok(());
        }
    };
    // The flow map shows what the sink answers with, stored or not.
    if let Some(ty) = event.headers.get("ce-type") {
        shared.journal.replied(&target.label, ty);
    }
    let stored = if traces::enabled() {
        let span = tracing::info_span!(
            target: traces::TARGET,
            "reply",
            eddy.subscription = %target.label,
        );
        shared.replies.publish(event).instrument(span).await
    } else {
        shared.replies.publish(event).await
    };
    match stored {
        Ok(_) => Ok(()),
        Err(PublishFailure::TooLarge) => {
            shared.metrics.failure(&target.label, Failure::ReplyRefused);
            tracing::warn!("the sink's reply is larger than NATS accepts; dropped");
            Ok(())
        }
        Err(failure) => {
            tracing::warn!(
                reason = failure.label(),
                "reply not stored; will retry the delivery"
            );
            Err(Failure::ReplyNotStored)
        }
    }
}
