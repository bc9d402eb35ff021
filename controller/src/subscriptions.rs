//! Subscription status in local mode.
//!
//! The dispatcher owns the consumers; the controller reports on them. A Subscription is Ready
//! when its spec is valid, its durable consumer exists in `EDDY_EVENTS` and its sink resolves
//! (the function exists and has a URL). Status carries each type with its subject filter.

use std::{collections::HashMap, sync::Arc, time::Duration};

use parking_lot::Mutex;

use crate::status::{self, condition_at};
use async_nats::jetstream;
use eddy_model::conditions::{ConditionType, Reason};
use eddy_model::resources::{
    Function, SinkPolicy, Subscription, SubscriptionBackend, SubscriptionStatus, consumer_name,
    describe_errors, parse_function_sink, set_condition, validate_subscription,
};
use eddy_platform::{
    nats::EVENTS_STREAM,
    shutdown::CancellationToken,
    store::{Change, Store, StoredResource as _},
};

/// Why a Subscription is or is not ready (the `Ready` condition's reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// Everything in place.
    Ready,
    /// The spec breaks a rule (stored before the rule existed, or written around the API).
    Invalid,
    /// The dispatcher has not created the consumer yet.
    ConsumerNotReady,
    /// The sink names a function that does not exist or has no URL yet.
    SinkNotFound,
}

impl Readiness {
    fn reason(self) -> Reason {
        match self {
            Self::Ready => Reason::ConsumerReady,
            Self::Invalid => Reason::Invalid,
            Self::ConsumerNotReady => Reason::ConsumerNotReady,
            Self::SinkNotFound => Reason::SinkNotFound,
        }
    }
}

/// The status a Subscription should have, given what was observed. Pure.
pub fn desired_status(
    subscription: &Subscription,
    previous: Option<&SubscriptionStatus>,
    readiness: Readiness,
    message: String,
    now: &str,
) -> SubscriptionStatus {
    let mut status = previous.cloned().unwrap_or_default();
    status.types = subscription.type_subjects().unwrap_or_default();
    let (namespace, name) = subscription.key();
    status.backend = Some(SubscriptionBackend {
        type_: "nats-jetstream".to_owned(),
        stream_name: EVENTS_STREAM.to_owned(),
        consumer_name: consumer_name(&namespace, &name),
    });
    status.ready = readiness == Readiness::Ready;
    status.observed_generation = subscription.metadata.generation;
    // What is written but not used is said where Kyma users look: the Ready condition.
    let ignored = subscription.spec.ignored_fields();
    let message = if ignored.is_empty() {
        message
    } else {
        format!("{message}; {}", ignored.join("; "))
    };
    if subscription.is_kyma() {
        set_kyma_conditions(&mut status.conditions, readiness, &message, now);
    }
    set_condition(
        &mut status.conditions,
        condition_at(
            ConditionType::Ready,
            Some(status.ready),
            readiness.reason(),
            message,
            now.to_owned(),
        ),
    );
    status
}

/// The conditions Kyma's JetStream backend gives a Subscription, which Kyma's tools and tests
/// wait for: `Subscription spec valid` and `Subscription active`, with Kyma's reasons (the
/// message is eddy's, from `Ready`, where one does not hold).
pub fn set_kyma_conditions(
    conditions: &mut Vec<eddy_model::resources::Condition>,
    readiness: Readiness,
    message: &str,
    now: &str,
) {
    let valid = readiness != Readiness::Invalid;
    let active = readiness == Readiness::Ready;
    for (type_, ok, reason) in [
        (
            ConditionType::KymaSubscriptionSpecValid,
            valid,
            if valid {
                Reason::KymaSpecHasNoValidationErrors
            } else {
                Reason::KymaSpecHasValidationErrors
            },
        ),
        (
            ConditionType::KymaSubscriptionActive,
            active,
            if active {
                Reason::KymaNatsSubscriptionActive
            } else {
                Reason::KymaNatsSubscriptionNotActive
            },
        ),
    ] {
        let message = if ok { "" } else { message };
        set_condition(
            conditions,
            condition_at(type_, Some(ok), reason, message, now.to_owned()),
        );
    }
}

type Statuses = Arc<Mutex<HashMap<(String, String), (Subscription, Option<SubscriptionStatus>)>>>;

/// Keeps Subscription status up to date until `shutdown`.
pub async fn run(
    store: Store,
    js: jetstream::Context,
    sinks: SinkPolicy,
    shutdown: CancellationToken,
) {
    let tracked: Statuses = Arc::default();
    // Consumers and functions appear after the Subscription: look again at the ones not ready.
    let ticker = {
        let (store, js, sinks, tracked, shutdown) = (
            store.clone(),
            js.clone(),
            sinks.clone(),
            tracked.clone(),
            shutdown.clone(),
        );
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = shutdown.cancelled() => return,
                }
                let not_ready: Vec<Subscription> = tracked
                    .lock()
                    .values()
                    .filter(|(_, status)| !status.as_ref().is_some_and(|s| s.ready))
                    .map(|(subscription, _)| subscription.clone())
                    .collect();
                for subscription in not_ready {
                    reconcile(&store, &js, &sinks, &subscription, &tracked).await;
                }
            }
        })
    };
    store
        .follow::<Subscription, _, _>(&shutdown, |change| {
            let (store, js, sinks, tracked) = (store.clone(), js.clone(), sinks.clone(), tracked.clone());
            async move {
                match change {
                    Change::Applied(subscription) => reconcile(&store, &js, &sinks, &subscription, &tracked).await,
                    Change::Deleted { namespace, name } => {
                        {
 let mut all = tracked.lock();
                            all.remove(&(namespace.clone(), name.clone()));
                        }
                        if let Err(error) = store.delete_status::<Subscription>(&namespace, &name).await {
                            tracing::warn!(%error, %namespace, %name, "cannot remove subscription status");
                        }
                    }
                    Change::Synced => {}
                }
            }
        })
        .await;
    let _ = ticker.await;
}

async fn reconcile(
    store: &Store,
    js: &jetstream::Context,
    sinks: &SinkPolicy,
    subscription: &Subscription,
    tracked: &Statuses,
) {
    let key = subscription.key();
    let (namespace, name) = (&key.0, &key.1);
    let (readiness, message) = observe(store, js, sinks, subscription, namespace, name).await;
    let remembered = tracked
        .lock()
        .get(&key)
        .and_then(|(_, status)| status.clone());
    let previous = match remembered {
        Some(status) => Some(status),
        None => store
            .get_status::<Subscription>(namespace, name)
            .await
            .ok()
            .flatten(),
    };
    let now = status::now();
    let status = desired_status(subscription, previous.as_ref(), readiness, message, &now);
    let written = if previous.as_ref() == Some(&status) {
        true
    } else {
        match store
            .put_status::<Subscription>(namespace, name, &status)
            .await
        {
            Ok(()) => {
                tracing::info!(%namespace, %name, ready = status.ready, reason = %readiness.reason(), "subscription status");
                true
            }
            Err(error) => {
                tracing::warn!(%error, %namespace, %name, "cannot write subscription status");
                false
            }
        }
    };
    {
        let mut all = tracked.lock();
        // The ticker may have worked on an older copy while a newer one arrived: keep the newer.
        let newer_known = all
            .get(&key)
            .is_some_and(|(known, _)| known.metadata.generation > subscription.metadata.generation);
        if !newer_known {
            all.insert(key, (subscription.clone(), written.then_some(status)));
        }
    }
}

async fn observe(
    store: &Store,
    js: &jetstream::Context,
    sinks: &SinkPolicy,
    subscription: &Subscription,
    namespace: &str,
    name: &str,
) -> (Readiness, String) {
    let errors = validate_subscription(subscription, sinks);
    if !errors.is_empty() {
        return (Readiness::Invalid, describe_errors(&errors));
    }
    let consumer = consumer_name(namespace, name);
    let consumer_exists = match js.get_stream(EVENTS_STREAM).await {
        Ok(stream) => stream.consumer_info(&consumer).await.is_ok(),
        Err(_) => false,
    };
    if !consumer_exists {
        return (
            Readiness::ConsumerNotReady,
            format!("waiting for the dispatcher to create consumer {consumer}"),
        );
    }
    if let Some(sink) = parse_function_sink(&subscription.spec.sink) {
        match store.get::<Function>(&sink.namespace, &sink.function).await {
            Ok(Some(function)) if function.status.as_ref().is_some_and(|s| s.url.is_some()) => {}
            Ok(Some(_)) => {
                return (
                    Readiness::SinkNotFound,
                    format!("function {} has no URL yet", sink.function),
                );
            }
            Ok(None) => {
                return (
                    Readiness::SinkNotFound,
                    format!("function {} does not exist", sink.function),
                );
            }
            Err(error) => {
                return (
                    Readiness::SinkNotFound,
                    format!("cannot read function {}: {error}", sink.function),
                );
            }
        }
    }
    (
        Readiness::Ready,
        format!("delivering through consumer {consumer}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subscription() -> Subscription {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
            "metadata": {"name": "s", "namespace": "default", "generation": 3},
            "spec": {"sink": "http://f.default.svc.cluster.local", "types": ["order.created.v1"], "source": "shop"}
        }))
        .unwrap()
    }

    #[test]
    fn ready_status_lists_subjects() {
        let status = desired_status(&subscription(), None, Readiness::Ready, "ok".into(), "t1");
        assert!(status.ready);
        assert_eq!(status.observed_generation, Some(3));
        assert_eq!(status.types[0].subject, "eddy.events.shop.order.created.v1");
        assert_eq!(status.conditions[0].reason, "ConsumerReady");
        assert_eq!(
            status.conditions[0].status,
            eddy_model::resources::ConditionStatus::True
        );
    }

    /// A Subscription applied in Kyma's form carries the conditions Kyma's JetStream backend
    /// writes (eventing-manager's `makeSubscriptionActiveCondition`: type "Subscription
    /// active", reason "NATS Subscription active", or "NATS Subscription not active" with the
    /// error as message), which Kyma's e2e suite waits for; eddy's own `Ready` stays beside.
    #[test]
    fn kyma_subscriptions_carry_kymas_conditions() {
        let mut kyma = subscription();
        kyma.metadata.annotations = Some(
            [(
                eddy_model::resources::APPLIED_AS_ANNOTATION.to_owned(),
                eddy_model::resources::KYMA_SUBSCRIPTION_API_VERSION.to_owned(),
            )]
            .into(),
        );
        let find = |status: &SubscriptionStatus, type_: &str| {
            status
                .conditions
                .iter()
                .find(|c| c.type_ == type_)
                .map(|c| (c.status.to_string(), c.reason.clone(), c.message.clone()))
        };
        let waiting = desired_status(
            &kyma,
            None,
            Readiness::ConsumerNotReady,
            "no consumer yet".into(),
            "t1",
        );
        assert_eq!(
            find(&waiting, "Subscription active"),
            Some((
                "False".into(),
                "NATS Subscription not active".into(),
                "no consumer yet".into()
            ))
        );
        assert_eq!(
            find(&waiting, "Subscription spec valid"),
            Some((
                "True".into(),
                "Subscription spec has no validation errors".into(),
                String::new()
            ))
        );
        let active = desired_status(&kyma, Some(&waiting), Readiness::Ready, "ok".into(), "t2");
        assert_eq!(
            find(&active, "Subscription active"),
            Some((
                "True".into(),
                "NATS Subscription active".into(),
                String::new()
            ))
        );
        assert_eq!(
            find(&active, "Ready").map(|c| c.1),
            Some("ConsumerReady".into())
        );
        let invalid = desired_status(&kyma, None, Readiness::Invalid, "bad sink".into(), "t3");
        assert_eq!(
            find(&invalid, "Subscription spec valid"),
            Some((
                "False".into(),
                "Subscription spec has validation errors".into(),
                "bad sink".into()
            ))
        );
        // eddy's own Subscriptions keep eddy's one condition.
        let own = desired_status(&subscription(), None, Readiness::Ready, "ok".into(), "t1");
        assert_eq!(own.conditions.len(), 1);
    }

    #[test]
    fn unchanged_observations_give_an_unchanged_status() {
        let first = desired_status(
            &subscription(),
            None,
            Readiness::SinkNotFound,
            "no".into(),
            "t1",
        );
        let second = desired_status(
            &subscription(),
            Some(&first),
            Readiness::SinkNotFound,
            "no".into(),
            "t2",
        );
        assert_eq!(first, second);
        let third = desired_status(
            &subscription(),
            Some(&second),
            Readiness::Ready,
            "ok".into(),
            "t3",
        );
        assert_eq!(third.conditions[0].last_transition_time, "t3");
    }
}
