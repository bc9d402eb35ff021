//! Dead letters: writing an event the dispatcher gives up on (with why), reading them, and
//! sending them back to their sink.

use eddy_model::admin::{DeadLetter, Outcome, Redriven};
use std::time::Duration;

use async_nats::jetstream::{
    self,
    consumer::{AckPolicy, DeliverPolicy, pull},
    message::StreamMessage,
};
use eddy_model::{headers as names, subject};
use eddy_platform::nats::DEAD_LETTER_STREAM;
use futures::StreamExt as _;

use async_nats::{HeaderMap as NatsHeaders, HeaderName, HeaderValue, jetstream::AckKind};

use crate::{
    Error, Result,
    delivery::{Failure, Verdict},
    index::LiveSubscription,
    send::{self, Shared},
};

fn summarize(sequence: u64, headers: &async_nats::HeaderMap, time: String) -> DeadLetter {
    let get = |name: &str| {
        headers
            .get(name)
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default()
    };
    DeadLetter {
        sequence,
        subscription: get(names::DLQ_SUBSCRIPTION),
        reason: get(names::DLQ_REASON),
        status: get(names::DLQ_STATUS).parse().ok(),
        attempts: get(names::DLQ_ATTEMPTS).parse().unwrap_or(0),
        stream_sequence: get(names::DLQ_STREAM_SEQ).parse().unwrap_or(0),
        id: get("ce-id"),
        ty: get("ce-type"),
        source: get("ce-source"),
        time,
    }
}

/// The dead-letter subject filter of one Subscription, or of all.
pub fn filter(subscription: Option<(&str, &str)>) -> String {
    match subscription {
        Some((namespace, name)) => subject::dead_letter_subject(namespace, name),
        None => format!("{}.>", subject::DEAD_LETTER_SUBJECT_PREFIX),
    }
}

/// Reads every dead letter under `filter`, oldest first, at most `limit`.
pub async fn read(
    js: &jetstream::Context,
    filter: &str,
    limit: usize,
) -> Result<Vec<(u64, StreamMessage)>> {
    let stream = js
        .get_stream(DEAD_LETTER_STREAM)
        .await
        .map_err(|e| Error::consumer(DEAD_LETTER_STREAM, "find stream", e))?;
    let mut consumer = stream
        .create_consumer(pull::Config {
            filter_subject: filter.to_owned(),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::None,
            inactive_threshold: Duration::from_secs(60),
            ..Default::default()
        })
        .await
        .map_err(|e| Error::consumer("dead-letter reader", "create", e))?;
    let pending = consumer
        .info()
        .await
        .map_err(|e| Error::consumer("dead-letter reader", "info", e))?
        .num_pending;
    let wanted = usize::try_from(pending).unwrap_or(usize::MAX).min(limit);
    let mut letters = Vec::with_capacity(wanted);
    while letters.len() < wanted {
        let batch = consumer
            .fetch()
            .max_messages((wanted - letters.len()).min(256))
            .expires(Duration::from_secs(2))
            .messages()
            .await
            .map_err(|e| Error::consumer("dead-letter reader", "fetch", e))?;
        let mut batch = std::pin::pin!(batch);
        let before = letters.len();
        while let Some(message) = batch.next().await {
            let message = message.map_err(|e| Error::consumer("dead-letter reader", "fetch", e))?;
            let info = message
                .info()
                .map_err(|e| Error::consumer("dead-letter reader", "info", e))?;
            let sequence = info.stream_sequence;
            let headers = message.headers.clone().unwrap_or_default();
            letters.push((
                sequence,
                StreamMessage {
                    subject: message.subject.clone(),
                    sequence,
                    headers,
                    payload: message.payload.clone(),
                    time: info.published,
                },
            ));
        }
        if letters.len() == before {
            break;
        }
    }
    let name = consumer.cached_info().name.clone();
    let _ = stream.delete_consumer(&name).await;
    Ok(letters)
}

/// Summaries of dead letters, oldest first.
pub async fn list(
    js: &jetstream::Context,
    subscription: Option<(&str, &str)>,
    limit: usize,
) -> Result<Vec<DeadLetter>> {
    let letters = read(js, &filter(subscription), limit).await?;
    Ok(letters
        .into_iter()
        .map(|(sequence, message)| {
            let time = eddy_platform::nats::stored_time(
                message.time.unix_timestamp(),
                message.time.nanosecond(),
            );
            summarize(sequence, &message.headers, time)
        })
        .collect())
}

/// Delivers every dead letter of `target` once more; delivered ones leave dead letters.
pub async fn redrive(shared: &Shared, target: &LiveSubscription) -> Result<Redriven> {
    let letters = read(
        &shared.js,
        &filter(Some((&target.namespace, &target.name))),
        usize::MAX,
    )
    .await?;
    let stream = shared
        .js
        .get_stream(DEAD_LETTER_STREAM)
        .await
        .map_err(|e| Error::consumer(DEAD_LETTER_STREAM, "find stream", e))?;
    let mut outcome = Redriven::default();
    let recent = shared.journal.subscription(&target.label);
    for (sequence, message) in letters {
        let letter = summarize(sequence, &message.headers, String::new());
        let started = std::time::Instant::now();
        let verdict = match shared.sinks.resolve(&target.sink) {
            Ok(sink) => {
                send::deliver(
                    shared,
                    target,
                    &sink,
                    Some(&message.headers),
                    &message.payload,
                    None,
                )
                .await
            }
            Err(verdict) => verdict,
        };
        match verdict {
            Verdict::Delivered { status } => {
                recent.attempted(
                    letter.stream_sequence,
                    letter.attempts.saturating_add(1),
                    Some(status),
                    Outcome::Redriven,
                    None,
                    started.elapsed().as_secs_f64(),
                );
                shared.metrics.subscription(&target.label).delivered(0.0);
                if let Err(error) = stream.delete_message(sequence).await {
                    tracing::warn!(%error, sequence, "delivered a dead letter but cannot remove it");
                }
                outcome.delivered += 1;
            }
            Verdict::Retry { reason, status } | Verdict::Dead { reason, status } => {
                recent.attempted(
                    letter.stream_sequence,
                    letter.attempts.saturating_add(1),
                    status,
                    Outcome::RedriveFailed,
                    Some(reason.label()),
                    started.elapsed().as_secs_f64(),
                );
                tracing::warn!(subscription = %target.label, %reason, status, sequence, "redrive failed; kept in dead letters");
                outcome.failed += 1;
            }
        }
    }
    tracing::info!(subscription = %target.label, delivered = outcome.delivered, failed = outcome.failed, "redrive done");
    Ok(outcome)
}

/// Stores the event in `EDDY_DEAD_LETTERS` with why, then acks it. When dead letters cannot be
/// written the event is nak'ed, so it stays in `EDDY_EVENTS` and comes back.
pub(crate) async fn write(
    shared: &Shared,
    target: &LiveSubscription,
    message: &jetstream::Message,
    reason: Failure,
    status: Option<u16>,
    attempt: u32,
    stream_sequence: u64,
) {
    let headers = dead_letter_headers(
        message.headers.as_ref(),
        target,
        reason,
        status,
        attempt,
        stream_sequence,
    );
    let subject = subject::dead_letter_subject(&target.namespace, &target.name);
    let stored = match shared
        .js
        .publish_with_headers(subject, headers, message.payload.clone())
        .await
    {
        Ok(ack) => ack.await.map(drop).map_err(|e| e.to_string()),
        Err(error) => Err(error.to_string()),
    };
    match stored {
        Ok(()) => {
            shared.metrics.dead_lettered(&target.label, reason);
            tracing::warn!(
                %reason, status, attempt, stream_sequence,
                "event sent to dead letters"
            );
            if let Err(error) = message.ack().await {
                tracing::warn!(%error, "ack after dead-lettering failed");
            }
        }
        Err(error) => {
            shared
                .metrics
                .failure(&target.label, Failure::DeadLetterUnavailable);
            tracing::error!(%error, %reason, "cannot store the dead letter; the event stays and comes back");
            let _ = message
                .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                .await;
        }
    }
}

/// The original headers (without its message id) plus why it is here.
pub fn dead_letter_headers(
    original: Option<&NatsHeaders>,
    target: &LiveSubscription,
    reason: Failure,
    status: Option<u16>,
    attempt: u32,
    stream_sequence: u64,
) -> NatsHeaders {
    let mut headers = NatsHeaders::new();
    if let Some(original) = original {
        for (name, values) in original.iter() {
            if AsRef::<str>::as_ref(name).eq_ignore_ascii_case("nats-msg-id") {
                continue;
            }
            for value in values {
                headers.append(name.clone(), value.clone());
            }
        }
    }
    let mut set = |name: &'static str, value: String| {
        if let Ok(value) = value.parse::<HeaderValue>() {
            headers.insert(HeaderName::from_static(name), value);
        }
    };
    set(names::DLQ_REASON, reason.label().to_owned());
    if let Some(status) = status {
        set(names::DLQ_STATUS, status.to_string());
    }
    set(names::DLQ_ATTEMPTS, attempt.to_string());
    set(names::DLQ_SUBSCRIPTION, target.label.clone());
    set(names::DLQ_STREAM_SEQ, stream_sequence.to_string());
    headers
}

#[cfg(test)]
mod tests {
    use super::*;
    use eddy_model::{
        backoff::{Backoff, BackoffShape},
        resources::DeliveryPolicy,
    };

    #[test]
    fn dead_letters_keep_the_event_and_say_why() {
        let mut original = NatsHeaders::new();
        original.insert("ce-id", "1");
        original.insert("Nats-Msg-Id", "abc");
        let target = LiveSubscription {
            namespace: "default".into(),
            name: "s".into(),
            label: "default/s".into(),
            sink: "http://f.default.svc.cluster.local".into(),
            policy: DeliveryPolicy {
                max_in_flight: 1,
                max_attempts: 3,
                backoff: Backoff {
                    shape: BackoffShape::Constant,
                    initial: Duration::from_secs(1),
                    max: Duration::from_secs(1),
                },
                timeout: Duration::from_secs(1),
            },
            filter_subjects: Vec::new(),
            encoding: Default::default(),
        };
        let headers =
            dead_letter_headers(Some(&original), &target, Failure::Http5xx, Some(500), 3, 42);
        assert_eq!(headers.get("ce-id").unwrap().as_str(), "1");
        assert!(headers.get("Nats-Msg-Id").is_none());
        assert_eq!(headers.get(names::DLQ_REASON).unwrap().as_str(), "http_5xx");
        assert_eq!(headers.get(names::DLQ_STATUS).unwrap().as_str(), "500");
        assert_eq!(headers.get(names::DLQ_ATTEMPTS).unwrap().as_str(), "3");
        assert_eq!(
            headers.get(names::DLQ_SUBSCRIPTION).unwrap().as_str(),
            "default/s"
        );
        assert_eq!(headers.get(names::DLQ_STREAM_SEQ).unwrap().as_str(), "42");
    }
}
