//! The dispatcher's admin API, typed: what it is asked and what it answers. The dispatcher
//! serves these types; `eddy dlq`, `eddy replay` and the console read them back, so a field
//! renamed on one side is a compile error on the other.
//!
//! - `GET /subscriptions`: [`SubscriptionList`]
//! - `GET /deliveries?sequence=N`: [`EventDeliveries`]
//! - `GET /dead-letters[?subscription=ns/name&limit=N]`: [`DeadLetterList`]
//! - `POST /subscriptions/{namespace}/{name}/redrive`: [`Redriven`]
//! - `POST /subscriptions/{namespace}/{name}/replay` with [`ReplayRequest`]: [`ReplayStarted`]

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

/// Counters of one Subscription.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Delivered (2xx).
    pub delivered: u64,
    /// Retried (nak with backoff).
    pub retried: u64,
    /// Sent to dead letters.
    pub dead_lettered: u64,
    /// Events not yet delivered (stored, not acknowledged).
    pub pending: i64,
    /// Deliveries running now in this process.
    pub in_flight: i64,
}

/// One Subscription the dispatcher delivers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SubscriptionDeliveries {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Where it delivers.
    pub sink: String,
    /// What it delivered.
    pub counts: Counts,
    /// The event types its sink answered with (the first few).
    pub reply_types: Vec<String>,
}

/// `GET /subscriptions`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubscriptionList {
    /// Every Subscription being delivered.
    pub items: Vec<SubscriptionDeliveries>,
}

/// How one attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The sink took it.
    Delivered,
    /// It failed and comes again.
    Retry,
    /// It failed for good and went to dead letters.
    DeadLetter,
    /// A dead letter sent again by a redrive, and taken.
    Redriven,
    /// A dead letter sent again by a redrive that failed again (it stays a dead letter).
    RedriveFailed,
}

impl Outcome {
    /// Its name on the wire, in traces and in metrics.
    pub fn label(self) -> &'static str {
        match self {
            Self::Delivered => "delivered",
            Self::Retry => "retry",
            Self::DeadLetter => "dead_letter",
            Self::Redriven => "redriven",
            Self::RedriveFailed => "redrive_failed",
        }
    }
}

/// One delivery attempt of one event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Attempt {
    /// The event's sequence in `EDDY_EVENTS`.
    pub sequence: u64,
    /// Which attempt (1 for the first).
    pub attempt: u32,
    /// The sink's status, when it answered.
    pub status: Option<u16>,
    /// How it ended.
    pub outcome: Outcome,
    /// Why it failed (the dispatcher's own words are static: recording one allocates nothing).
    pub reason: Option<Cow<'static, str>>,
    /// How long it took, in milliseconds.
    pub millis: f64,
    /// When it ended, in milliseconds since the Unix epoch.
    pub at: u64,
}

/// One Subscription's attempts at one event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubscriptionAttempts {
    /// `namespace/name`.
    pub subscription: String,
    /// Oldest first.
    pub attempts: Vec<Attempt>,
}

/// `GET /deliveries?sequence=N`: the recent attempts at one event, by Subscription.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventDeliveries {
    /// The event's sequence in `EDDY_EVENTS`.
    pub sequence: u64,
    /// Each Subscription that attempted it.
    pub items: Vec<SubscriptionAttempts>,
}

/// One dead letter, summarized.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetter {
    /// Sequence in `EDDY_DEAD_LETTERS`.
    pub sequence: u64,
    /// `namespace/name` of the Subscription.
    pub subscription: String,
    /// Why.
    pub reason: String,
    /// The sink's last status, when it answered.
    pub status: Option<u16>,
    /// Deliveries attempted.
    pub attempts: u32,
    /// Sequence of the original event in `EDDY_EVENTS`.
    pub stream_sequence: u64,
    /// CloudEvents id.
    pub id: String,
    /// CloudEvents type.
    #[serde(rename = "type")]
    pub ty: String,
    /// CloudEvents source.
    pub source: String,
    /// When it was dead-lettered (RFC 3339).
    pub time: String,
}

/// `GET /dead-letters`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetterList {
    /// Oldest first.
    pub items: Vec<DeadLetter>,
}

/// `POST …/redrive`: what a redrive did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Redriven {
    /// Delivered and removed from dead letters.
    pub delivered: u64,
    /// Failed again; still in dead letters.
    pub failed: u64,
}

/// `POST …/replay`: where to replay from (exactly one of the two).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReplayRequest {
    /// Replay events stored within this long ago (`10m`, `2h`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// Replay from this stream sequence.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_seq: Option<u64>,
}

/// `POST …/replay`: the replay started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplayStarted {
    /// Events it will deliver.
    pub events: u64,
}
