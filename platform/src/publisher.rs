//! Storing events in JetStream, and keeping the stream there.
//!
//! A publish counts only once JetStream has acknowledged it. While the client is not connected we
//! refuse at once (503) instead of letting the client queue the message: a queued message could
//! be stored after we told the publisher it was not. The one remaining window (NATS goes away
//! between the check and the ack) is covered by the message id: a publisher that retries is
//! stored once.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use async_nats::{
    connection::State,
    jetstream::{self, context::PublishErrorKind, message::PublishMessage, stream},
};
use eddy_model::{
    backoff::Backoff,
    event::{EventHeaders, OutgoingEvent},
};
use tokio::sync::Notify;

use crate::{nats as layout, shutdown::CancellationToken, traces};

/// Why a publish did not get a JetStream ack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishFailure {
    /// Not connected to NATS, or no ack in time.
    Unavailable,
    /// NATS answered but refused to store (store full, stream missing, ...).
    Refused,
    /// Larger than the server's `max_payload`.
    TooLarge,
}

impl PublishFailure {
    /// Bounded label for metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            Self::Unavailable => "nats_unavailable",
            Self::Refused => "stream_refused",
            Self::TooLarge => "too_large",
        }
    }
}

/// A stored event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    /// Sequence in `EDDY_EVENTS`.
    pub sequence: u64,
    /// The (source, id) was already stored inside the duplicate window.
    pub duplicate: bool,
}

/// How acks are awaited on the one NATS connection.
#[derive(Debug, Clone, Copy)]
pub struct AckLimits {
    /// Longest wait for one ack.
    pub timeout: Duration,
    /// Most publishes awaiting their ack at once; a publish past it waits for a free slot.
    pub max_in_flight: usize,
}

/// Publishes into `EDDY_EVENTS`; cheap to clone.
#[derive(Clone)]
pub struct Publisher {
    inner: Arc<Inner>,
}

struct Inner {
    client: async_nats::Client,
    jetstream: jetstream::Context,
    stream_ready: AtomicBool,
    max_payload: AtomicUsize,
    recheck_stream: Arc<Notify>,
}

impl Publisher {
    /// Wraps a client; `recheck_stream` is notified on every (re)connection by the caller's
    /// event callback. Spawns the task that keeps the stream in place until `shutdown`.
    pub fn start(
        client: async_nats::Client,
        wanted: stream::Config,
        acks: AckLimits,
        recheck_stream: Arc<Notify>,
        shutdown: CancellationToken,
    ) -> Self {
        let jetstream = ack_context(&client, acks);
        let inner = Arc::new(Inner {
            client,
            jetstream,
            stream_ready: AtomicBool::new(false),
            max_payload: AtomicUsize::new(0),
            recheck_stream,
        });
        tokio::spawn(keep_stream(inner.clone(), wanted, shutdown));
        Self { inner }
    }

    /// Publishes into a stream someone else keeps in place (the dispatcher's replies go to the
    /// stream the event-bus manages): nothing is spawned; a publish while the stream is missing
    /// fails as [`PublishFailure::Refused`].
    pub fn without_stream(client: async_nats::Client, acks: AckLimits) -> Self {
        let jetstream = ack_context(&client, acks);
        Self {
            inner: Arc::new(Inner {
                client,
                jetstream,
                stream_ready: AtomicBool::new(true),
                max_payload: AtomicUsize::new(0),
                recheck_stream: Arc::new(Notify::new()),
            }),
        }
    }

    /// The filter subjects of every consumer on the events stream: what the Subscriptions in
    /// force listen to (one durable consumer each).
    pub async fn consumer_filter_subjects(&self) -> Result<Vec<String>, crate::Error> {
        use futures::StreamExt as _;
        let failed = |operation: &'static str| {
            move |error: &dyn std::fmt::Display| crate::Error::JetStream {
                operation,
                stream: layout::EVENTS_STREAM.to_owned(),
                message: error.to_string(),
            }
        };
        let stream = self
            .inner
            .jetstream
            .get_stream_no_info(layout::EVENTS_STREAM)
            .await
            .map_err(|error| failed("get")(&error))?;
        let mut consumers = stream.consumers();
        let mut subjects = Vec::new();
        while let Some(info) = consumers.next().await {
            let info = info.map_err(|error| failed("consumer list")(&error))?;
            let config = info.config;
            subjects.extend(config.filter_subjects);
            if !config.filter_subject.is_empty() {
                subjects.push(config.filter_subject);
            }
        }
        Ok(subjects)
    }

    /// Connected to NATS and the stream is in place.
    pub fn is_ready(&self) -> bool {
        self.is_connected() && self.inner.stream_ready.load(Ordering::Acquire)
    }

    /// Connected to NATS.
    pub fn is_connected(&self) -> bool {
        self.inner.client.connection_state() == State::Connected
    }

    /// The server's `max_payload` (0 until first connected).
    pub fn max_payload(&self) -> usize {
        self.inner.max_payload.load(Ordering::Relaxed)
    }

    /// Sends one event and returns its pending ack. Sending in order and awaiting the acks
    /// afterwards keeps a batch in order while it is pipelined. With traces on, the event is
    /// stored under a `store` span (a child of the current trace span) whose context it carries
    /// in its `traceparent`, so its deliveries continue the trace from there.
    pub async fn send(&self, mut event: OutgoingEvent) -> Result<PendingAck, PublishFailure> {
        if !self.is_connected() {
            return Err(PublishFailure::Unavailable);
        }
        let span = traces::enabled().then(|| store_span(&mut event));
        let message = PublishMessage::build()
            .headers(nats_headers(event.headers)?)
            .payload(event.payload)
            .message_id(event.msg_id);
        match self
            .inner
            .jetstream
            .send_publish(event.subject, message)
            .await
        {
            Ok(ack) => Ok(PendingAck { ack, span }),
            Err(error) => {
                let failure = self.failure(&error);
                if let Some(span) = &span {
                    span_failed(span, failure);
                }
                Err(failure)
            }
        }
    }

    /// Waits for the ack of a sent event.
    pub async fn ack(&self, pending: PendingAck) -> Result<Stored, PublishFailure> {
        let PendingAck { ack, span } = pending;
        let stored = match ack.await {
            Ok(ack) => Ok(Stored {
                sequence: ack.sequence,
                duplicate: ack.duplicate,
            }),
            Err(error) => Err(self.failure(&error)),
        };
        if let Some(span) = span {
            match stored {
                Ok(stored) => {
                    span.record("messaging.nats.stream_sequence", stored.sequence);
                    span.record("eddy.duplicate", stored.duplicate);
                }
                Err(failure) => span_failed(&span, failure),
            }
        }
        stored
    }

    /// Sends one event and waits for its ack.
    pub async fn publish(&self, event: OutgoingEvent) -> Result<Stored, PublishFailure> {
        let pending = self.send(event).await?;
        self.ack(pending).await
    }

    fn failure(&self, error: &jetstream::context::PublishError) -> PublishFailure {
        let failure = match error.kind() {
            PublishErrorKind::MaxPayloadExceeded => PublishFailure::TooLarge,
            PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => {
                PublishFailure::Unavailable
            }
            PublishErrorKind::StreamNotFound => {
                // Someone deleted the stream, or NATS came back with an empty store.
                self.inner.stream_ready.store(false, Ordering::Release);
                self.inner.recheck_stream.notify_one();
                PublishFailure::Refused
            }
            _ => PublishFailure::Refused,
        };
        tracing::warn!(reason = failure.label(), %error, "publish not acknowledged");
        failure
    }
}

/// A sent event whose ack has not been read yet.
pub struct PendingAck {
    ack: jetstream::context::PublishAckFuture,
    /// The event's `store` span, with traces on: it ends with the ack.
    span: Option<tracing::Span>,
}

/// The `store` span of one event, its context written into the event's trace headers.
fn store_span(event: &mut OutgoingEvent) -> tracing::Span {
    let span = tracing::info_span!(
        target: traces::TARGET,
        "store",
        otel.kind = "producer",
        messaging.system = "nats",
        messaging.destination.name = %event.subject,
        cloudevents.event_id = %event.id,
        cloudevents.event_source = %event.source,
        cloudevents.event_type = event.headers.get("ce-type"),
        messaging.nats.stream_sequence = tracing::field::Empty,
        eddy.duplicate = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        otel.status_description = tracing::field::Empty,
    );
    traces::inject_event(&span, &mut event.headers);
    span
}

fn span_failed(span: &tracing::Span, failure: PublishFailure) {
    span.record("otel.status_code", "error");
    span.record("otel.status_description", failure.label());
}

/// A JetStream context with the ack limits. Deliberate, not the library's default: a publish past
/// the limit waits for a slot (backpressure) instead of failing; batches keep their own share well
/// below it.
fn ack_context(client: &async_nats::Client, acks: AckLimits) -> jetstream::Context {
    jetstream::ContextBuilder::new()
        .timeout(acks.timeout)
        .max_ack_inflight(acks.max_in_flight)
        .backpressure_on_inflight(true)
        .build(client.clone())
}

/// The NATS form of an event's headers. The model has checked every name and value as it set
/// them; a header NATS still refuses is refused here rather than published without it.
pub fn nats_headers(headers: EventHeaders) -> Result<async_nats::HeaderMap, PublishFailure> {
    let mut map = async_nats::HeaderMap::new();
    for (name, value) in headers.into_entries() {
        let name = async_nats::HeaderName::try_from(name.as_ref());
        let (Ok(name), false) = (name, value.contains(['\r', '\n'])) else {
            tracing::warn!(reason = "invalid_header", "publish refused");
            return Err(PublishFailure::Refused);
        };
        // Checked just above: the conversion takes the string without copying it.
        map.insert(name, async_nats::HeaderValue::from(value));
    }
    Ok(map)
}

/// Creates or updates the stream after every (re)connection, retrying with capped backoff.
async fn keep_stream(inner: Arc<Inner>, wanted: stream::Config, shutdown: CancellationToken) {
    const RETRY: Backoff = Backoff::exponential(Duration::from_millis(100), Duration::from_secs(5));
    let mut failures = 0;
    loop {
        if inner.client.connection_state() == State::Connected {
            // Read here, once per connection, not on the publish path (server_info clones).
            inner
                .max_payload
                .store(inner.client.server_info().max_payload, Ordering::Relaxed);
            match layout::ensure_stream(&inner.jetstream, wanted.clone()).await {
                Ok(info) => {
                    tracing::info!(stream = %info.config.name, messages = info.state.messages, "stream ready");
                    inner.stream_ready.store(true, Ordering::Release);
                    failures = 0;
                    tokio::select! {
                        () = inner.recheck_stream.notified() => continue,
                        () = shutdown.cancelled() => return,
                    }
                }
                Err(error) => {
                    inner.stream_ready.store(false, Ordering::Release);
                    tracing::error!(%error, retry_in = ?RETRY.delay(failures + 1), "cannot set up the events stream");
                }
            }
        }
        failures += 1;
        tokio::select! {
            () = tokio::time::sleep(RETRY.delay(failures)) => {}
            () = inner.recheck_stream.notified() => {}
            () = shutdown.cancelled() => return,
        }
    }
}
