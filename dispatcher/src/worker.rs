//! The delivery loop of one Subscription: pull events from its consumer, deliver each at most
//! `maxInFlightMessages` at a time, and settle each with JetStream.
//!
//! Settling follows vector's NATS source: ack only after the sink took the event; nak with the
//! Subscription's backoff when it may succeed later; dead-letter (then ack) when it never will or
//! attempts are used up. The dispatcher never retries in a loop of its own: every retry is a
//! JetStream redelivery, so a crash loses nothing and several dispatchers share the work.

use eddy_model::admin::Outcome as Recorded;
use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use async_nats::{
    HeaderMap as NatsHeaders,
    jetstream::{self, AckKind, consumer::PullConsumer},
};
use bytes::Bytes;
use eddy_model::event::{self, Limits};
use eddy_model::{backoff::Backoff, headers as names, resources::DeliveryPolicy};
use eddy_platform::{
    publisher::{PublishFailure, Publisher},
    shutdown::CancellationToken,
    traces,
};
use futures::{StreamExt as _, stream::FuturesUnordered};
use http_body_util::Full;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use tracing::Instrument as _;

use crate::{
    consumer::{self, ConsumerPlan},
    delivery::{self, Failure, Verdict},
    journal::{Journal, Recent},
    metrics::{Metrics, SubscriptionMetrics},
    scaler::{Gate, Scaler},
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

/// One Subscription, as the worker sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveSubscription {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// `namespace/name`: the metrics label and the dead-letter header.
    pub label: String,
    /// The sink as written.
    pub sink: String,
    /// Delivery settings.
    pub policy: DeliveryPolicy,
    /// The subjects its consumer takes (one per type).
    pub filter_subjects: Vec<String>,
    /// How its deliveries write `ce-*` values: raw for a Subscription applied in Kyma's form.
    pub encoding: delivery::AttributeEncoding,
}

impl LiveSubscription {
    /// Whether `message` is a legacy event's copy in Kyma's legacy form whose event this
    /// Subscription takes too: it is taken without delivery, so that no Subscription gets one
    /// legacy event twice.
    fn takes_the_original_of(&self, message: &jetstream::Message) -> bool {
        let Some(original) = message
            .headers
            .as_ref()
            .and_then(|headers| headers.get(eddy_model::legacy::KYMA_FORM_OF))
        else {
            return false;
        };
        self.filter_subjects
            .iter()
            .any(|filter| eddy_model::subject::filter_matches(filter, original.as_str()))
    }
}

/// Runs the live consumer of a Subscription until `cancel`: keeps the consumer in place and
/// rebuilds the message stream with capped backoff when it breaks.
pub async fn run(
    shared: Arc<Shared>,
    target: Arc<LiveSubscription>,
    plan: ConsumerPlan,
    cancel: CancellationToken,
) {
    // Attempts in a row that delivered nothing: set-up failures and streams that broke before
    // their first event. Reset only by a stream that delivered, so a consumer that is set up
    // fine but whose stream keeps breaking at once backs off too.
    let mut failures: u32 = 0;
    // The consumer's ack floor (stream sequence) as last read: where a consumer that went is
    // created again from.
    let mut acked: Option<u64> = None;
    loop {
        let consumer = match ensure(&shared, &plan, acked).await {
            Ok(consumer) => consumer,
            Err(error) => {
                failures += 1;
                tracing::warn!(%error, "cannot set up the consumer; retrying");
                if sleep_or_cancel(CONSUMER_RETRY.delay(failures), &cancel).await {
                    return;
                }
                continue;
            }
        };
        match consume(&shared, &target, consumer, false, &mut acked, &cancel).await {
            Ended::Cancelled | Ended::CaughtUp => return,
            Ended::Broken { delivered } => {
                // A stream that was delivering is opened again at once: waiting would only add
                // latency to a Subscription that works. Only a stream that breaks before its
                // first event (JetStream away, the consumer gone) backs off.
                if delivered {
                    failures = 0;
                    continue;
                }
                failures += 1;
                if sleep_or_cancel(CONSUMER_RETRY.delay(failures), &cancel).await {
                    return;
                }
            }
        }
    }
}

async fn ensure(
    shared: &Shared,
    plan: &ConsumerPlan,
    resume_after: Option<u64>,
) -> crate::Result<PullConsumer> {
    let stream = shared
        .js
        .get_stream(eddy_platform::nats::EVENTS_STREAM)
        .await
        .map_err(|e| crate::Error::consumer(&plan.name, "find stream", e))?;
    consumer::ensure(&stream, plan, resume_after).await
}

/// Delays between attempts to set up or re-read the consumer.
const CONSUMER_RETRY: Backoff =
    Backoff::exponential(Duration::from_millis(200), Duration::from_secs(5));

/// How long after a woken Function's first ready pod a refused delivery is taken for its Service
/// not routing to the pod yet.
const ROUTING_GRACE: Duration = Duration::from_secs(10);

/// Waits for `gate` to open (asking for the wake-up), with in-progress acks for `message`.
async fn hold(shared: &Shared, gate: &mut Gate, message: &jetstream::Message) {
    let opened = gate.wake_and_wait();
    let mut opened = std::pin::pin!(opened);
    loop {
        tokio::select! {
            () = &mut opened => return,
            () = tokio::time::sleep(shared.progress_every) => {
                if let Err(error) = message.ack_with(AckKind::Progress).await {
                    tracing::debug!(%error, "in-progress ack failed");
                }
            }
        }
    }
}

/// Sleeps; true when cancelled first.
async fn sleep_or_cancel(delay: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        () = tokio::time::sleep(delay) => false,
        () = cancel.cancelled() => true,
    }
}

/// Why a consume loop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Asked to stop.
    Cancelled,
    /// A replay delivered everything.
    CaughtUp,
    /// The message stream failed; build it again. `delivered`: it had handed out events first.
    Broken {
        /// At least one event came through the stream before it broke.
        delivered: bool,
    },
}

/// Why a message stream broke, as a metric label; `None` when the stream carries on by itself.
///
/// Only a missed idle heartbeat is left to the stream. After every other kind async-nats either
/// ends the stream (consumer deleted, push based, a request over the consumer's limits) or keeps
/// counting a pull request that will never be answered, which would stall the Subscription until
/// the request expires (30 s and more): opening a new stream is the fast way back.
fn stream_break(
    kind: async_nats::jetstream::consumer::pull::MessagesErrorKind,
) -> Option<&'static str> {
    use async_nats::jetstream::consumer::pull::MessagesErrorKind as Kind;
    match kind {
        Kind::MissingHeartbeat => None,
        Kind::ConsumerDeleted => Some("consumer_deleted"),
        Kind::Pull => Some("pull_failed"),
        Kind::PushBasedConsumer => Some("push_based"),
        Kind::NoResponders => Some("no_responders"),
        Kind::RequestLimitExceeded => Some("request_limit"),
        Kind::Other => Some("other"),
    }
}

/// Pulls and delivers until cancelled, broken, or (`until_caught_up`) nothing is left.
///
/// Deliveries run concurrently inside this task (at most `maxInFlightMessages`), not as a task
/// each: no spawn, semaphore or cross-thread wake-up per event. The HTTP connections still run
/// as tasks of their own, so the work spreads over the runtime's threads.
pub async fn consume(
    shared: &Arc<Shared>,
    target: &Arc<LiveSubscription>,
    consumer: PullConsumer,
    until_caught_up: bool,
    acked: &mut Option<u64>,
    cancel: &CancellationToken,
) -> Ended {
    let max_in_flight = usize::try_from(target.policy.max_in_flight)
        .unwrap_or(1)
        .max(1);
    let messages = consumer
        .stream()
        .max_messages_per_batch(max_in_flight)
        .heartbeat(Duration::from_secs(5))
        .expires(Duration::from_secs(30))
        .messages()
        .await;
    let mut messages = match messages {
        Ok(messages) => messages,
        Err(error) => {
            tracing::warn!(%error, "cannot open the message stream");
            shared.metrics.stream_broke(&target.label, "open_failed");
            return Ended::Broken { delivered: false };
        }
    };
    let series = shared.metrics.subscription(&target.label);
    let recent = shared.journal.subscription(&target.label);
    let mut sink = SinkCache::default();
    let gate = shared
        .scaler
        .as_ref()
        .and_then(|scaler| scaler.gate(&target.sink));
    let mut running = FuturesUnordered::new();
    let mut asking: Option<futures::future::BoxFuture<'_, _>> = None;
    let mut delivered = false;
    let mut tick = tokio::time::interval(if until_caught_up {
        Duration::from_millis(200)
    } else {
        Duration::from_secs(2)
    });
    let ended = loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => break Ended::Cancelled,
            // Settle finished deliveries first: each frees a slot for the next event.
            Some(()) = running.next(), if !running.is_empty() => {}
            message = messages.next(), if running.len() < max_in_flight => match message {
                Some(Ok(message)) => {
                    delivered = true;
                    if target.takes_the_original_of(&message) {
                        shared.metrics.skipped(&target.label);
                        tracing::debug!(reason = "delivered_as_the_original", "a legacy event's copy in Kyma's form taken without delivery");
                        if let Err(error) = message.ack().await {
                            tracing::warn!(%error, "ack failed; the copy will come again and be taken again");
                        }
                        continue;
                    }
                    let resolved = sink.get(&shared.sinks, &target.sink);
                    running.push(handle(shared, target, &series, &recent, resolved, gate.as_ref(), message));
                }
                Some(Err(error)) => match stream_break(error.kind()) {
                    None => tracing::debug!("missed heartbeat; the stream recovers on its own"),
                    Some(reason) => {
                        tracing::warn!(%error, reason, "message stream failed; opening it again");
                        shared.metrics.stream_broke(&target.label, reason);
                        break Ended::Broken { delivered };
                    }
                },
                None => {
                    tracing::warn!(reason = "ended", "message stream ended; opening it again");
                    shared.metrics.stream_broke(&target.label, "ended");
                    break Ended::Broken { delivered };
                }
            },
            // Asked alongside the deliveries, not in their way: a slow answer (NATS electing a
            // leader) must not hold up settling events or their in-progress acks.
            _ = tick.tick(), if asking.is_none() => asking = Some(Box::pin(consumer.get_info())),
            answer = async { match asking.as_mut() { Some(request) => request.await, None => std::future::pending().await } } => {
                asking = None;
                if let Ok(info) = answer {
                    *acked = Some(info.ack_floor.stream_sequence);
                    let pending = i64::try_from(info.num_pending + info.num_ack_pending as u64).unwrap_or(i64::MAX);
                    series.set_pending(pending);
                    if until_caught_up && info.num_pending == 0 && info.num_ack_pending == 0 && running.is_empty() {
                        break Ended::CaughtUp;
                    }
                }
            }
        }
    };
    // Let running deliveries finish and settle; the caller bounds the whole drain.
    while running.next().await.is_some() {}
    ended
}

/// The sink as last resolved, kept until the sink table changes: resolving parses URLs, which
/// is too much to do for every event.
#[derive(Default)]
struct SinkCache {
    resolved: Option<(u64, Result<Arc<Resolved>, Verdict>)>,
}

impl SinkCache {
    fn get(&mut self, sinks: &Sinks, sink: &str) -> Result<Arc<Resolved>, Verdict> {
        let generation = sinks.generation();
        match &self.resolved {
            Some((seen, resolved)) if *seen == generation => resolved.clone(),
            _ => {
                let resolved = sinks.resolve(sink).map(Arc::new);
                self.resolved = Some((generation, resolved.clone()));
                resolved
            }
        }
    }
}

/// Delivers one event and settles it with JetStream.
async fn handle(
    shared: &Shared,
    target: &LiveSubscription,
    series: &SubscriptionMetrics,
    recent: &Recent,
    sink: Result<Arc<Resolved>, Verdict>,
    gate: Option<&Gate>,
    message: jetstream::Message,
) {
    let (attempt, stream_sequence) = match message.info() {
        Ok(info) => (
            u32::try_from(info.delivered).unwrap_or(u32::MAX),
            info.stream_sequence,
        ),
        Err(_) => (1, 0),
    };
    let started = Instant::now();
    series.add_in_flight(1);
    let delivery = async {
        if attempt > target.policy.max_attempts {
            // The last delivery after a crash during the final attempt: hand it to dead letters.
            return Verdict::Dead {
                reason: Failure::MaxAttempts,
                status: None,
            };
        }
        let sink = match sink {
            Ok(sink) => sink,
            Err(verdict) => return verdict,
        };
        let Some(gate) = gate.filter(|gate| !gate.is_open()) else {
            return deliver(
                shared,
                target,
                &sink,
                message.headers.as_ref(),
                &message.payload,
                Some(&message),
            )
            .await;
        };
        // The Function has no ready pod: wake it, hold the event (kept alive with in-progress
        // acks, so it is not redelivered meanwhile), then deliver. Until its Service routes to
        // the new pod (endpoints and proxies follow the pod's readiness by a moment), a refused
        // connection is tried again here rather than spent as an attempt.
        let mut gate = gate.clone();
        hold(shared, &mut gate, &message).await;
        let opened = Instant::now();
        loop {
            let verdict = deliver(
                shared,
                target,
                &sink,
                message.headers.as_ref(),
                &message.payload,
                Some(&message),
            )
            .await;
            let not_routed_yet = matches!(
                verdict,
                Verdict::Retry {
                    reason: Failure::ConnectError,
                    ..
                } | Verdict::Retry {
                    status: Some(503),
                    ..
                }
            );
            if !not_routed_yet || opened.elapsed() > ROUTING_GRACE {
                return verdict;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let span = traces::enabled().then(|| delivery_span(target, &message, attempt, stream_sequence));
    let verdict = match &span {
        Some(span) => delivery.instrument(span.clone()).await,
        None => delivery.await,
    };
    let seconds = started.elapsed().as_secs_f64();
    let tried = |status| Attempt {
        sequence: stream_sequence,
        number: attempt,
        status,
        seconds,
    };
    match verdict {
        Verdict::Delivered { status } => {
            if let Err(error) = message.ack().await {
                // The event will come again: at-least-once, never lost.
                tracing::warn!(%error, "ack failed; the event will be redelivered");
            }
            series.delivered(seconds);
            tracing::debug!(status, attempt, "delivered");
            record_outcome(
                span.as_ref(),
                recent,
                tried(Some(status)),
                Outcome::Delivered,
            );
        }
        Verdict::Retry { reason, status } if attempt < target.policy.max_attempts => {
            record_outcome(span.as_ref(), recent, tried(status), Outcome::Retry(reason));
            let delay = target.policy.retry_delay(attempt);
            shared.metrics.retried(&target.label, reason, seconds);
            tracing::warn!(
                %reason, status, attempt,
                max_attempts = target.policy.max_attempts, retry_in = ?delay, stream_sequence,
                "delivery failed; will retry"
            );
            if let Err(error) = message.ack_with(AckKind::Nak(Some(delay))).await {
                tracing::warn!(%error, "nak failed; the event will be redelivered after ack wait");
            }
        }
        Verdict::Retry { reason, status } | Verdict::Dead { reason, status } => {
            // Past the last attempt (its dispatcher died during it) nothing was sent.
            if attempt <= target.policy.max_attempts {
                series.failed_for_good(seconds);
            }
            record_outcome(
                span.as_ref(),
                recent,
                tried(status),
                Outcome::DeadLetter(reason),
            );
            crate::deadletter::write(
                shared,
                target,
                &message,
                reason,
                status,
                attempt,
                stream_sequence,
            )
            .await;
        }
    }
    series.add_in_flight(-1);
}

/// The trace span of one delivery attempt, continuing the trace the stored event carries (the
/// span that stored it).
fn delivery_span(
    target: &LiveSubscription,
    message: &jetstream::Message,
    attempt: u32,
    stream_sequence: u64,
) -> tracing::Span {
    let span = tracing::info_span!(
        target: traces::TARGET,
        "deliver",
        otel.kind = "client",
        eddy.subscription = %target.label,
        eddy.attempt = attempt,
        messaging.nats.stream_sequence = stream_sequence,
        http.response.status_code = tracing::field::Empty,
        eddy.outcome = tracing::field::Empty,
        eddy.reason = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        otel.status_description = tracing::field::Empty,
    );
    traces::continue_nats(&span, message.headers.as_ref());
    span
}

/// What became of one attempt.
#[derive(Clone, Copy)]
enum Outcome {
    Delivered,
    Retry(Failure),
    DeadLetter(Failure),
}

/// The attempt whose outcome is recorded.
#[derive(Clone, Copy)]
struct Attempt {
    /// The event's stream sequence.
    sequence: u64,
    /// 1 for the first.
    number: u32,
    /// The sink's status, when it answered.
    status: Option<u16>,
    /// How long it took.
    seconds: f64,
}

/// Writes what became of an attempt where it is told: the Subscription's recent attempts (the
/// dashboard) and its span (traces on), where a failure says why. Called from the arm of
/// `handle` that settles the event, so both tell what was done.
fn record_outcome(
    span: Option<&tracing::Span>,
    recent: &Recent,
    attempt: Attempt,
    outcome: Outcome,
) {
    let (recorded, failure) = match outcome {
        Outcome::Delivered => (Recorded::Delivered, None),
        Outcome::Retry(reason) => (Recorded::Retry, Some(("will retry", reason))),
        Outcome::DeadLetter(reason) => (Recorded::DeadLetter, Some(("dead-lettered", reason))),
    };
    recent.attempted(
        attempt.sequence,
        attempt.number,
        attempt.status,
        recorded,
        failure.map(|(_, reason)| reason.label()),
        attempt.seconds,
    );
    let Some(span) = span else {
        return;
    };
    if let Some(status) = attempt.status {
        span.record("http.response.status_code", status);
    }
    span.record("eddy.outcome", recorded.label());
    if let Some((what, reason)) = failure {
        span.record("eddy.reason", reason.label());
        span.record("otel.status_code", "error");
        span.record(
            "otel.status_description",
            format!("{what}: {}", reason.label()),
        );
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use eddy_model::resources::SinkPolicy;

    #[test]
    fn the_sink_cache_follows_function_url_changes() {
        let sinks = Sinks::new(crate::sinks::Resolution::Local, SinkPolicy::default());
        let sink = "http://stock.shop.svc.cluster.local/hook";
        let mut cache = SinkCache::default();
        assert_eq!(
            cache.get(&sinks, sink).err(),
            Some(Verdict::Retry {
                reason: Failure::SinkUnresolved,
                status: None
            })
        );
        sinks.set_function_url(
            "shop",
            "stock",
            Some("http://127.0.0.1:8080/shop/stock".into()),
        );
        let first = cache.get(&sinks, sink).unwrap();
        assert_eq!(first.uri, "http://127.0.0.1:8080/shop/stock/hook");
        let again = cache.get(&sinks, sink).unwrap();
        assert!(Arc::ptr_eq(&first, &again), "unchanged: resolved once");
        sinks.set_function_url(
            "shop",
            "stock",
            Some("http://127.0.0.1:9090/shop/stock".into()),
        );
        assert_eq!(
            cache.get(&sinks, sink).unwrap().uri,
            "http://127.0.0.1:9090/shop/stock/hook"
        );
        sinks.set_function_url("shop", "stock", None);
        assert_eq!(
            cache.get(&sinks, sink).err(),
            Some(Verdict::Retry {
                reason: Failure::SinkUnresolved,
                status: None
            })
        );
    }
}
