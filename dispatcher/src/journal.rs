//! The recent delivery attempts of each Subscription and the reply types its sink answered
//! with, for the dashboard: which subscriptions took an event, after how many attempts, and the
//! event flow (types → subscriptions → functions → reply types).
//!
//! Bounded on both counts ([`ATTEMPTS_KEPT`] attempts, [`REPLY_TYPES_KEPT`] reply types per
//! Subscription) and kept in memory only: it tells what this dispatcher saw recently, the
//! metrics and dead letters stay the record. Recording an attempt takes one uncontended lock
//! (a Subscription's deliveries are settled by one task) and copies a few integers.

use eddy_model::admin::{Attempt, Outcome};
use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex, PoisonError},
    time::{SystemTime, UNIX_EPOCH},
};

/// Attempts kept per Subscription.
pub const ATTEMPTS_KEPT: usize = 512;

/// Distinct reply types kept per Subscription.
pub const REPLY_TYPES_KEPT: usize = 16;

/// One Subscription's recent attempts and reply types.
#[derive(Debug, Default)]
pub struct Recent {
    attempts: Mutex<VecDeque<Attempt>>,
    reply_types: Mutex<Vec<Arc<str>>>,
}

impl Recent {
    /// Records an attempt, dropping the oldest beyond [`ATTEMPTS_KEPT`].
    pub fn attempted(
        &self,
        sequence: u64,
        attempt: u32,
        status: Option<u16>,
        outcome: Outcome,
        reason: Option<&'static str>,
        seconds: f64,
    ) {
        let at = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| {
                u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
            });
        let record = Attempt {
            sequence,
            attempt,
            status,
            outcome,
            reason: reason.map(std::borrow::Cow::Borrowed),
            millis: seconds * 1000.0,
            at,
        };
        let mut attempts = self.attempts.lock().unwrap_or_else(PoisonError::into_inner);
        if attempts.len() == ATTEMPTS_KEPT {
            attempts.pop_front();
        }
        attempts.push_back(record);
    }

    /// Notes that the sink answered with an event of `ty` (the first [`REPLY_TYPES_KEPT`]
    /// distinct types are kept).
    pub fn replied(&self, ty: &str) {
        let mut types = self
            .reply_types
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if types.len() < REPLY_TYPES_KEPT && !types.iter().any(|known| &**known == ty) {
            types.push(Arc::from(ty));
        }
    }

    /// The attempts kept for the event at `sequence`, oldest first.
    pub fn attempts_of(&self, sequence: u64) -> Vec<Attempt> {
        self.attempts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|attempt| attempt.sequence == sequence)
            .cloned()
            .collect()
    }

    /// The reply types seen, in the order first seen.
    pub fn reply_types(&self) -> Vec<String> {
        self.reply_types
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|ty| ty.to_string())
            .collect()
    }
}

/// Every Subscription's [`Recent`], by `namespace/name`.
#[derive(Debug, Default)]
pub struct Journal {
    subscriptions: Mutex<HashMap<String, Arc<Recent>>>,
}

impl Journal {
    /// The record of `subscription` (`namespace/name`), created on first use; a worker looks
    /// it up once.
    pub fn subscription(&self, subscription: &str) -> Arc<Recent> {
        self.subscriptions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(subscription.to_owned())
            .or_default()
            .clone()
    }

    /// The record of `subscription` if it has one (a lookup never creates one).
    fn existing(&self, subscription: &str) -> Option<Arc<Recent>> {
        self.subscriptions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(subscription)
            .cloned()
    }

    /// Notes that the sink of `subscription` answered with an event of `ty`.
    pub fn replied(&self, subscription: &str, ty: &str) {
        if let Some(recent) = self.existing(subscription) {
            recent.replied(ty);
        }
    }

    /// The reply types seen from the sink of `subscription`.
    pub fn reply_types(&self, subscription: &str) -> Vec<String> {
        self.existing(subscription)
            .map(|recent| recent.reply_types())
            .unwrap_or_default()
    }

    /// Drops a removed Subscription's record.
    pub fn forget(&self, subscription: &str) {
        self.subscriptions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(subscription);
    }

    /// Every Subscription's kept attempts of the event at `sequence`, by subscription.
    pub fn attempts_of(&self, sequence: u64) -> Vec<(String, Vec<Attempt>)> {
        let subscriptions: Vec<(String, Arc<Recent>)> = self
            .subscriptions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(label, recent)| (label.clone(), recent.clone()))
            .collect();
        let mut found: Vec<(String, Vec<Attempt>)> = subscriptions
            .into_iter()
            .map(|(label, recent)| (label, recent.attempts_of(sequence)))
            .filter(|(_, attempts)| !attempts.is_empty())
            .collect();
        found.sort_by(|a, b| a.0.cmp(&b.0));
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_have_one_name_in_traces_and_the_admin_api() {
        for outcome in [
            Outcome::Delivered,
            Outcome::Retry,
            Outcome::DeadLetter,
            Outcome::Redriven,
            Outcome::RedriveFailed,
        ] {
            assert_eq!(
                serde_json::to_value(outcome).unwrap(),
                serde_json::json!(outcome.label())
            );
        }
    }

    #[test]
    fn keeps_the_latest_attempts_and_distinct_reply_types() {
        let journal = Journal::default();
        let recent = journal.subscription("shop/orders");
        for sequence in 1..=(ATTEMPTS_KEPT as u64 + 2) {
            recent.attempted(sequence, 1, Some(200), Outcome::Delivered, None, 0.002);
        }
        recent.attempted(7, 2, None, Outcome::Retry, Some("timeout"), 1.0);
        assert!(journal.attempts_of(1).is_empty(), "the oldest are dropped");
        assert!(journal.attempts_of(2).is_empty());
        let seven = journal.attempts_of(7);
        assert_eq!(seven.len(), 1);
        assert_eq!(seven[0].0, "shop/orders");
        let attempts: Vec<_> = seven[0].1.iter().map(|a| (a.attempt, a.outcome)).collect();
        assert_eq!(
            attempts,
            [(1, Outcome::Delivered), (2, Outcome::Retry)],
            "oldest first"
        );
        assert!((seven[0].1[0].millis - 2.0).abs() < 1e-9);

        for n in 0..(REPLY_TYPES_KEPT + 3) {
            recent.replied(&format!("t{}", n % (REPLY_TYPES_KEPT + 3)));
            recent.replied("t0");
        }
        let types = recent.reply_types();
        assert_eq!(types.len(), REPLY_TYPES_KEPT);
        assert_eq!(types[0], "t0");

        journal.forget("shop/orders");
        assert!(journal.attempts_of(7).is_empty());
    }
}
