//! The durable consumer of a Subscription: its configuration (pure) and keeping it in place.

use std::time::Duration;

use async_nats::jetstream::{
    self,
    consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull},
    context::ConsumerInfoErrorKind,
};
use eddy_model::resources::DeliveryPolicy;

use crate::{Error, Result};

/// What a Subscription needs from its consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerPlan {
    /// Durable name.
    pub name: String,
    /// Subject filters, one per type.
    pub filter_subjects: Vec<String>,
    /// Delivery settings.
    pub policy: DeliveryPolicy,
    /// How long a delivery may go without an ack or in-progress ack before JetStream hands the
    /// event to another dispatcher.
    pub ack_wait: Duration,
    /// The Subscription's creation: its first consumer delivers every event stored since then,
    /// so none published after the Subscription existed is skipped (one created again after it
    /// was lost goes on after its last known ack floor instead, when there is one). `None`
    /// delivers only events stored after the consumer.
    pub deliver_from: Option<time::OffsetDateTime>,
}

impl ConsumerPlan {
    /// Where a new consumer of this plan starts.
    pub fn deliver_policy(&self) -> DeliverPolicy {
        match self.deliver_from {
            Some(start_time) => DeliverPolicy::ByStartTime { start_time },
            None => DeliverPolicy::New,
        }
    }
}

/// The consumer configuration for a plan. `max_deliver` is one more than `maxAttempts`: the
/// last delivery is kept for handing the event to dead letters when a dispatcher died during the
/// final attempt, so no event is stranded at the limit. Retry delays come from naks with delay,
/// computed from the Subscription's backoff; the consumer itself carries no backoff list so that
/// in-progress acks keep a slow delivery alive.
pub fn consumer_config(plan: &ConsumerPlan, deliver_policy: DeliverPolicy) -> pull::Config {
    pull::Config {
        durable_name: Some(plan.name.clone()),
        description: Some("eddy subscription".to_owned()),
        deliver_policy,
        ack_policy: AckPolicy::Explicit,
        ack_wait: plan.ack_wait,
        max_deliver: i64::from(plan.policy.max_attempts) + 1,
        filter_subjects: plan.filter_subjects.clone(),
        max_ack_pending: i64::from(plan.policy.max_in_flight),
        ..Default::default()
    }
}

/// Whether an existing consumer must be updated to match the plan.
pub fn needs_update(existing: &jetstream::consumer::Config, wanted: &pull::Config) -> bool {
    let mut existing_filters = existing.filter_subjects.clone();
    if !existing.filter_subject.is_empty() {
        existing_filters.push(existing.filter_subject.clone());
    }
    existing_filters.sort();
    let mut wanted_filters = wanted.filter_subjects.clone();
    wanted_filters.sort();
    existing_filters != wanted_filters
        || existing.max_ack_pending != wanted.max_ack_pending
        || existing.max_deliver != wanted.max_deliver
        || existing.ack_wait != wanted.ack_wait
}

/// Creates the consumer (delivering from the Subscription's creation) or updates it in place
/// (keeping its position and deliver policy). Only a consumer JetStream says does not exist is
/// created: any other failure to read it (a timeout, JetStream unavailable) is an error for the
/// caller to retry, never a reason to start over.
pub async fn ensure(
    stream: &jetstream::stream::Stream,
    plan: &ConsumerPlan,
    resume_after: Option<u64>,
) -> Result<PullConsumer> {
    match stream.consumer_info(&plan.name).await {
        Ok(info) => {
            let wanted = consumer_config(plan, info.config.deliver_policy);
            if needs_update(&info.config, &wanted) {
                tracing::info!(consumer = %plan.name, "updating consumer");
                stream
                    .update_consumer(wanted)
                    .await
                    .map_err(|e| Error::consumer(&plan.name, "update", e))?;
            }
            stream
                .get_consumer(&plan.name)
                .await
                .map_err(|e| Error::consumer(&plan.name, "get", e))
        }
        Err(error) if error.kind() == ConsumerInfoErrorKind::NotFound => {
            // A consumer that went (deleted, lost with its stream's leader) goes on from where
            // it had acknowledged, not from the Subscription's start: at most the acks since the
            // last look at it are delivered again, never the whole history.
            let deliver_policy = match resume_after {
                Some(acked) if acked > 0 => DeliverPolicy::ByStartSequence {
                    start_sequence: acked + 1,
                },
                _ => plan.deliver_policy(),
            };
            tracing::info!(consumer = %plan.name, deliver_from = ?plan.deliver_from, ?resume_after, "creating consumer");
            stream
                .create_consumer(consumer_config(plan, deliver_policy))
                .await
                .map_err(|e| Error::consumer(&plan.name, "create", e))
        }
        Err(error) => Err(Error::consumer(&plan.name, "read", error)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use eddy_model::backoff::Backoff;

    fn plan() -> ConsumerPlan {
        ConsumerPlan {
            name: "sub_default_s".into(),
            filter_subjects: vec!["eddy.events.*.a".into(), "eddy.events.*.b.>".into()],
            policy: DeliveryPolicy {
                max_in_flight: 7,
                max_attempts: 3,
                backoff: Backoff::exponential(Duration::from_secs(1), Duration::from_secs(10)),
                timeout: Duration::from_secs(5),
            },
            ack_wait: Duration::from_secs(30),
            deliver_from: None,
        }
    }

    #[test]
    fn a_new_consumer_starts_at_the_subscriptions_creation() {
        assert_eq!(plan().deliver_policy(), DeliverPolicy::New);
        let created = time::OffsetDateTime::from_unix_timestamp(1_700_000_000).unwrap();
        let plan = ConsumerPlan {
            deliver_from: Some(created),
            ..plan()
        };
        assert_eq!(
            plan.deliver_policy(),
            DeliverPolicy::ByStartTime {
                start_time: created
            }
        );
    }

    #[test]
    fn config_follows_the_subscription() {
        let config = consumer_config(&plan(), DeliverPolicy::New);
        assert_eq!(config.durable_name.as_deref(), Some("sub_default_s"));
        assert_eq!(config.deliver_policy, DeliverPolicy::New);
        assert_eq!(config.ack_policy, AckPolicy::Explicit);
        assert_eq!(config.max_ack_pending, 7);
        assert_eq!(config.max_deliver, 4);
        assert_eq!(config.filter_subjects.len(), 2);
    }

    #[test]
    fn updates_only_when_something_we_own_changed() {
        let wanted = consumer_config(&plan(), DeliverPolicy::New);
        let existing = jetstream::consumer::Config {
            durable_name: wanted.durable_name.clone(),
            filter_subjects: vec!["eddy.events.*.b.>".into(), "eddy.events.*.a".into()],
            max_ack_pending: 7,
            max_deliver: 4,
            ack_wait: Duration::from_secs(30),
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        };
        assert!(!needs_update(&existing, &wanted));
        let narrower = jetstream::consumer::Config {
            filter_subjects: vec!["eddy.events.*.a".into()],
            ..existing.clone()
        };
        assert!(needs_update(&narrower, &wanted));
        let more = jetstream::consumer::Config {
            max_ack_pending: 1,
            ..existing
        };
        assert!(needs_update(&more, &wanted));
    }
}
