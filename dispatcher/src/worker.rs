//! The delivery loop of one Subscription: pull events from its consumer, deliver each at most
//! `maxInFlightMessages` at a time, and settle each with JetStream.
//!
//! Settling follows vector's NATS source: ack only after the sink took the event; nak with the
//! Subscription's backoff when it may succeed later; dead-letter (then ack) when it never will or
//! attempts are used up. The dispatcher never retries in a loop of its own: every retry is a
//! JetStream redelivery, so a crash loses nothing and several dispatchers share the work.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use async_nats::jetstream::{self, AckKind, consumer::PullConsumer};
use eddy_model::{admin::Outcome as Recorded, backoff::Backoff, resources::DeliveryPolicy};
use eddy_platform::{shutdown::CancellationToken, traces};
use futures::{StreamExt as _, stream::FuturesUnordered};
use tracing::Instrument as _;

use crate::{
    consumer::{self, ConsumerPlan},
    delivery::{Failure, Verdict},
    index::LiveSubscription,
    journal::Recent,
    metrics::SubscriptionMetrics,
    scaler::Gate,
    send::{self, Shared},
    sinks::{Resolved, Sinks},
};

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
    let worker = Worker {
        shared,
        target,
        series: &series,
        recent: &recent,
    };
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
                    running.push(handle(&worker, resolved, gate.as_ref(), message));
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

/// One Subscription's worker, as each of its deliveries sees it.
struct Worker<'a> {
    shared: &'a Shared,
    target: &'a LiveSubscription,
    series: &'a SubscriptionMetrics,
    recent: &'a Recent,
}

/// How an event starts, before any attempt (the gate).
#[derive(Debug)]
enum Start {
    /// Settled without an attempt: past its last attempt (its dispatcher died during that
    /// one), or its sink does not resolve.
    Settled(Verdict),
    /// Its Function has no ready pod: wake it and hold the event, then attempt it.
    Hold(Arc<Resolved>),
    /// Attempted now.
    Now(Arc<Resolved>),
}

/// The gate: how delivery `attempt` (1 for the first) of an event starts, its sink resolved
/// (or not), its Function `asleep` (scaled to zero, no ready pod). Pure.
fn start(
    attempt: u32,
    max_attempts: u32,
    sink: Result<Arc<Resolved>, Verdict>,
    asleep: bool,
) -> Start {
    if attempt > max_attempts {
        // The last delivery after a crash during the final attempt: hand it to dead letters.
        return Start::Settled(Verdict::Dead {
            reason: Failure::MaxAttempts,
            status: None,
        });
    }
    match sink {
        Err(verdict) => Start::Settled(verdict),
        Ok(sink) if asleep => Start::Hold(sink),
        Ok(sink) => Start::Now(sink),
    }
}

/// Whether an attempt just after a wake-up was refused because the Function's Service does not
/// route to the new pod yet (endpoints and proxies follow the pod's readiness by a moment):
/// such a try never reached the Function, so it is made again rather than spent. Pure.
fn not_routed_yet(verdict: &Verdict) -> bool {
    matches!(
        verdict,
        Verdict::Retry {
            reason: Failure::ConnectError,
            ..
        } | Verdict::Retry {
            status: Some(503),
            ..
        }
    )
}

/// One attempt: the event sent to its sink, with in-progress acks for it while it runs.
async fn attempt(worker: &Worker<'_>, sink: &Resolved, message: &jetstream::Message) -> Verdict {
    send::deliver(
        worker.shared,
        worker.target,
        sink,
        message.headers.as_ref(),
        &message.payload,
        Some(message),
    )
    .await
}

/// The hold: wakes the Function and keeps the event (alive with in-progress acks, so it is not
/// redelivered meanwhile) until it has a ready pod, then attempts it, again while its Service
/// does not route to the pod yet, for at most [`ROUTING_GRACE`].
async fn hold_then_attempt(
    worker: &Worker<'_>,
    sink: &Resolved,
    gate: &Gate,
    message: &jetstream::Message,
) -> Verdict {
    let mut gate = gate.clone();
    hold(worker.shared, &mut gate, message).await;
    let opened = Instant::now();
    loop {
        let verdict = attempt(worker, sink, message).await;
        if !not_routed_yet(&verdict) || opened.elapsed() > ROUTING_GRACE {
            return verdict;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What settling an event does with JetStream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settlement {
    /// The sink took it: ack.
    Ack,
    /// It may succeed later: nak, redelivered after `delay`.
    Nak {
        /// When JetStream hands it out again.
        delay: Duration,
        /// Why the attempt failed.
        reason: Failure,
    },
    /// It will not: dead-letter it (then ack).
    DeadLetter {
        /// An attempt was made and failed for good (not one past the last).
        attempted: bool,
        /// Why.
        reason: Failure,
    },
}

/// How delivery `attempt` of an event with `verdict` is settled under `policy`. Pure.
fn settlement(verdict: &Verdict, attempt: u32, policy: &DeliveryPolicy) -> Settlement {
    match *verdict {
        Verdict::Delivered { .. } => Settlement::Ack,
        Verdict::Retry { reason, .. } if attempt < policy.max_attempts => Settlement::Nak {
            delay: policy.retry_delay(attempt),
            reason,
        },
        Verdict::Retry { reason, .. } | Verdict::Dead { reason, .. } => Settlement::DeadLetter {
            attempted: attempt <= policy.max_attempts,
            reason,
        },
    }
}

/// Settles an event as [`settlement`] says, and records what became of the attempt: the
/// Subscription's metrics and recent attempts, the span, the log.
async fn settle(
    worker: &Worker<'_>,
    span: Option<&tracing::Span>,
    message: &jetstream::Message,
    verdict: Verdict,
    tried: Attempt,
) {
    let Worker {
        shared,
        target,
        series,
        recent,
    } = worker;
    let status = match verdict {
        Verdict::Delivered { status } => Some(status),
        Verdict::Retry { status, .. } | Verdict::Dead { status, .. } => status,
    };
    let tried = Attempt { status, ..tried };
    match settlement(&verdict, tried.number, &target.policy) {
        Settlement::Ack => {
            if let Err(error) = message.ack().await {
                // The event will come again: at-least-once, never lost.
                tracing::warn!(%error, "ack failed; the event will be redelivered");
            }
            series.delivered(tried.seconds);
            tracing::debug!(status, attempt = tried.number, "delivered");
            record_outcome(span, recent, tried, Outcome::Delivered);
        }
        Settlement::Nak { delay, reason } => {
            record_outcome(span, recent, tried, Outcome::Retry(reason));
            shared.metrics.retried(&target.label, reason, tried.seconds);
            tracing::warn!(
                %reason, status, attempt = tried.number,
                max_attempts = target.policy.max_attempts, retry_in = ?delay,
                stream_sequence = tried.sequence,
                "delivery failed; will retry"
            );
            if let Err(error) = message.ack_with(AckKind::Nak(Some(delay))).await {
                tracing::warn!(%error, "nak failed; the event will be redelivered after ack wait");
            }
        }
        Settlement::DeadLetter { attempted, reason } => {
            // Past the last attempt (its dispatcher died during it) nothing was sent.
            if attempted {
                series.failed_for_good(tried.seconds);
            }
            record_outcome(span, recent, tried, Outcome::DeadLetter(reason));
            crate::deadletter::write(
                shared,
                target,
                message,
                reason,
                status,
                tried.number,
                tried.sequence,
            )
            .await;
        }
    }
}

/// Delivers one event and settles it with JetStream: the gate ([`start`]), the hold when its
/// Function sleeps ([`hold_then_attempt`]), the attempt ([`attempt`]), then [`settle`].
async fn handle(
    worker: &Worker<'_>,
    sink: Result<Arc<Resolved>, Verdict>,
    gate: Option<&Gate>,
    message: jetstream::Message,
) {
    let (number, sequence) = match message.info() {
        Ok(info) => (
            u32::try_from(info.delivered).unwrap_or(u32::MAX),
            info.stream_sequence,
        ),
        Err(_) => (1, 0),
    };
    let started = Instant::now();
    worker.series.add_in_flight(1);
    let asleep = gate.is_some_and(|gate| !gate.is_open());
    let delivery = async {
        match (
            start(number, worker.target.policy.max_attempts, sink, asleep),
            gate,
        ) {
            (Start::Settled(verdict), _) => verdict,
            (Start::Hold(sink), Some(gate)) => {
                hold_then_attempt(worker, &sink, gate, &message).await
            }
            (Start::Hold(sink) | Start::Now(sink), _) => attempt(worker, &sink, &message).await,
        }
    };
    let span = traces::enabled().then(|| delivery_span(worker.target, &message, number, sequence));
    let verdict = match &span {
        Some(span) => delivery.instrument(span.clone()).await,
        None => delivery.await,
    };
    let tried = Attempt {
        sequence,
        number,
        status: None,
        seconds: started.elapsed().as_secs_f64(),
    };
    settle(worker, span.as_ref(), &message, verdict, tried).await;
    worker.series.add_in_flight(-1);
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

#[cfg(test)]
mod tests {
    use super::*;
    use eddy_model::{
        backoff::{Backoff, BackoffShape},
        resources::SinkPolicy,
    };

    fn resolved() -> Arc<Resolved> {
        let sinks = Sinks::new(crate::sinks::Resolution::Direct, SinkPolicy::default());
        Arc::new(
            sinks
                .resolve("http://stock.shop.svc.cluster.local/hook")
                .unwrap(),
        )
    }

    fn policy(max_attempts: u32) -> DeliveryPolicy {
        DeliveryPolicy {
            max_in_flight: 1,
            max_attempts,
            backoff: Backoff {
                shape: BackoffShape::Exponential,
                initial: Duration::from_secs(1),
                max: Duration::from_secs(60),
            },
            timeout: Duration::from_secs(5),
        }
    }

    const UNRESOLVED: Verdict = Verdict::Retry {
        reason: Failure::SinkUnresolved,
        status: None,
    };

    /// The gate: past the last attempt, dead without a try; a sink that does not resolve,
    /// settled by its verdict; a sleeping Function's event held; else attempted now.
    #[test]
    fn the_gate_settles_holds_or_attempts() {
        assert!(matches!(
            start(4, 3, Ok(resolved()), false),
            Start::Settled(Verdict::Dead {
                reason: Failure::MaxAttempts,
                status: None
            })
        ));
        assert!(matches!(
            start(1, 3, Err(UNRESOLVED), true),
            Start::Settled(UNRESOLVED)
        ));
        assert!(matches!(start(3, 3, Ok(resolved()), true), Start::Hold(_)));
        assert!(matches!(start(1, 3, Ok(resolved()), false), Start::Now(_)));
    }

    /// The hold tries again (rather than spend an attempt) only what never reached the
    /// Function: a refused connection, the mesh's 503.
    #[test]
    fn only_refusals_before_routing_are_tried_again_after_a_wake_up() {
        let retry = |reason, status| Verdict::Retry { reason, status };
        assert!(not_routed_yet(&retry(Failure::ConnectError, None)));
        assert!(not_routed_yet(&retry(Failure::Http5xx, Some(503))));
        assert!(!not_routed_yet(&retry(Failure::Http5xx, Some(500))));
        assert!(!not_routed_yet(&retry(Failure::Timeout, None)));
        assert!(!not_routed_yet(&Verdict::Delivered { status: 200 }));
    }

    /// Settling: ack on delivery; nak with the Subscription's backoff while attempts remain;
    /// dead letters after the last, or at once for what will never succeed; one past the last
    /// (its dispatcher died during it) is dead-lettered as not attempted.
    #[test]
    fn settling_acks_naks_with_backoff_or_dead_letters() {
        let policy = policy(3);
        assert_eq!(
            settlement(&Verdict::Delivered { status: 204 }, 1, &policy),
            Settlement::Ack
        );
        let failed = Verdict::Retry {
            reason: Failure::Http5xx,
            status: Some(500),
        };
        let nak = |seconds| Settlement::Nak {
            delay: Duration::from_secs(seconds),
            reason: Failure::Http5xx,
        };
        assert_eq!(settlement(&failed, 1, &policy), nak(1));
        assert_eq!(settlement(&failed, 2, &policy), nak(2));
        assert_eq!(
            settlement(&failed, 3, &policy),
            Settlement::DeadLetter {
                attempted: true,
                reason: Failure::Http5xx
            }
        );
        let refused = Verdict::Dead {
            reason: Failure::Http4xx,
            status: Some(400),
        };
        assert_eq!(
            settlement(&refused, 1, &policy),
            Settlement::DeadLetter {
                attempted: true,
                reason: Failure::Http4xx
            }
        );
        let past_the_last = Verdict::Dead {
            reason: Failure::MaxAttempts,
            status: None,
        };
        assert_eq!(
            settlement(&past_the_last, 4, &policy),
            Settlement::DeadLetter {
                attempted: false,
                reason: Failure::MaxAttempts
            }
        );
    }

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
