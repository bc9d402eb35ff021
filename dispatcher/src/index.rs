//! Which Subscriptions this dispatcher delivers for, and with what settings: changes in, actions
//! out. Pure (no I/O, no clock), so every rule is tested directly; the manager carries the
//! actions out.

use std::{
    collections::{BTreeMap, HashSet},
    sync::Arc,
    time::Duration,
};

use eddy_model::resources::{
    DeliveryPolicy, FieldError, SinkPolicy, Subscription, consumer_name, describe_errors,
    validate_subscription,
};
use eddy_platform::store::StoredResource as _;

use async_nats::jetstream;

use crate::{consumer::ConsumerPlan, delivery};

/// A Subscription's namespace and name.
pub type Key = (String, String);

/// The Subscriptions delivered for, by key, as the manager last published them.
pub type Delivering = Arc<BTreeMap<Key, Arc<LiveSubscription>>>;

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
    pub fn takes_the_original_of(&self, message: &jetstream::Message) -> bool {
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

/// What the manager must do to follow a change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Deliver for a Subscription with these settings: start its worker, or restart it when
    /// one runs with other settings (its consumer is updated in place).
    Start {
        /// Where to deliver.
        target: Arc<LiveSubscription>,
        /// Its consumer.
        plan: ConsumerPlan,
    },
    /// Do not deliver for an invalid Subscription (stop its worker if one runs, and say why);
    /// its consumer stays, so nothing stored for it is lost while it is being fixed.
    Stop {
        /// The Subscription.
        key: Key,
        /// What is wrong with it.
        problems: String,
    },
    /// The Subscription is gone: stop its worker and any replay, delete its consumer, forget
    /// its metrics.
    Remove {
        /// The Subscription.
        key: Key,
    },
    /// A complete list is in: delete `sub_*` consumers not named here (their Subscriptions
    /// were deleted while no dispatcher ran).
    DeleteOrphans {
        /// The consumers to keep.
        wanted: HashSet<String>,
    },
}

/// The Subscriptions known and the ones delivered for.
#[derive(Debug)]
pub struct SubscriptionIndex {
    sinks: SinkPolicy,
    ack_wait: Duration,
    /// Every Subscription that exists, valid or not (their consumers are kept).
    known: HashSet<Key>,
    /// The valid ones, with their settings.
    delivering: BTreeMap<Key, (Arc<LiveSubscription>, ConsumerPlan)>,
    synced: bool,
}

impl SubscriptionIndex {
    /// An empty index; `sinks` decides which sinks are allowed, `ack_wait` goes into each plan.
    pub fn new(sinks: SinkPolicy, ack_wait: Duration) -> Self {
        Self {
            sinks,
            ack_wait,
            known: HashSet::new(),
            delivering: BTreeMap::new(),
            synced: false,
        }
    }

    /// A Subscription was created or changed.
    pub fn apply(&mut self, subscription: &Subscription) -> Vec<Action> {
        let key = subscription.key();
        self.known.insert(key.clone());
        match plan_for(subscription, &self.sinks, self.ack_wait) {
            Err(errors) => {
                self.delivering.remove(&key);
                vec![Action::Stop {
                    key,
                    problems: describe_errors(&errors),
                }]
            }
            Ok((target, plan)) => {
                let unchanged = self
                    .delivering
                    .get(&key)
                    .is_some_and(|(running, running_plan)| {
                        **running == target && *running_plan == plan
                    });
                if unchanged {
                    return Vec::new();
                }
                let target = Arc::new(target);
                self.delivering.insert(key, (target.clone(), plan.clone()));
                vec![Action::Start { target, plan }]
            }
        }
    }

    /// A Subscription was deleted.
    pub fn delete(&mut self, key: Key) -> Vec<Action> {
        self.known.remove(&key);
        self.delivering.remove(&key);
        vec![Action::Remove { key }]
    }

    /// The source's list is complete (after every (re)list, deletions missed meanwhile
    /// already reported): consumers left behind by deleted Subscriptions are swept.
    pub fn synced(&mut self) -> Vec<Action> {
        self.synced = true;
        let wanted = self
            .known
            .iter()
            .map(|(namespace, name)| consumer_name(namespace, name))
            .collect();
        vec![Action::DeleteOrphans { wanted }]
    }

    /// Whether the first complete list has been applied.
    pub fn is_synced(&self) -> bool {
        self.synced
    }

    /// The Subscriptions delivered for, by key.
    pub fn targets(&self) -> impl Iterator<Item = (&Key, &Arc<LiveSubscription>)> {
        self.delivering
            .iter()
            .map(|(key, (target, _))| (key, target))
    }
}

/// The target and consumer plan of a valid Subscription.
pub fn plan_for(
    subscription: &Subscription,
    sinks: &SinkPolicy,
    ack_wait: Duration,
) -> Result<(LiveSubscription, ConsumerPlan), Vec<FieldError>> {
    let errors = validate_subscription(subscription, sinks);
    if !errors.is_empty() {
        return Err(errors);
    }
    let (namespace, name) = subscription.key();
    let policy = subscription.spec.delivery_policy()?;
    let types = subscription.type_subjects()?;
    let filter_subjects: Vec<String> = types.into_iter().map(|t| t.subject).collect();
    let plan = ConsumerPlan {
        name: consumer_name(&namespace, &name),
        filter_subjects: filter_subjects.clone(),
        policy,
        ack_wait,
        deliver_from: subscription
            .metadata
            .creation_timestamp
            .as_ref()
            .and_then(|created| {
                time::OffsetDateTime::from_unix_timestamp_nanos(created.0.as_nanosecond()).ok()
            }),
    };
    let target = LiveSubscription {
        label: format!("{namespace}/{name}"),
        namespace,
        name,
        sink: subscription.spec.sink.clone(),
        policy,
        filter_subjects,
        encoding: if subscription.is_kyma() {
            delivery::AttributeEncoding::Raw
        } else {
            delivery::AttributeEncoding::Binding
        },
    };
    Ok((target, plan))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]

    use serde_json::json;

    use super::*;

    const ACK_WAIT: Duration = Duration::from_secs(30);

    fn index() -> SubscriptionIndex {
        SubscriptionIndex::new(
            SinkPolicy::parse(&["http://127.0.0.1:*"]).unwrap(),
            ACK_WAIT,
        )
    }

    fn subscription(name: &str, spec: serde_json::Value) -> Subscription {
        serde_json::from_value(json!({
            "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
            "metadata": {"name": name, "namespace": "shop"},
            "spec": spec,
        }))
        .unwrap()
    }

    fn orders(name: &str, sink: &str) -> Subscription {
        subscription(name, json!({"sink": sink, "types": ["order.created.v1"]}))
    }

    fn key(name: &str) -> Key {
        ("shop".to_owned(), name.to_owned())
    }

    fn started(actions: &[Action]) -> Vec<(String, Vec<String>)> {
        actions
            .iter()
            .map(|action| match action {
                Action::Start { target, plan } => {
                    (target.label.clone(), plan.filter_subjects.clone())
                }
                other => panic!("not a start: {other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_new_subscription_starts_with_its_consumer_plan() {
        let mut index = index();
        let actions = index.apply(&orders("a", "http://127.0.0.1:9000/"));
        assert_eq!(
            started(&actions),
            vec![(
                "shop/a".to_owned(),
                vec!["eddy.events.*.order.created.v1".to_owned()]
            )]
        );
        let Action::Start { plan, target } = &actions[0] else {
            unreachable!()
        };
        assert_eq!(plan.name, "sub_shop_a");
        assert_eq!(plan.ack_wait, ACK_WAIT);
        assert_eq!(target.sink, "http://127.0.0.1:9000/");
        assert_eq!(index.targets().count(), 1);
    }

    #[test]
    fn the_same_spec_again_does_nothing_and_a_change_restarts() {
        let mut index = index();
        index.apply(&orders("a", "http://127.0.0.1:9000/"));
        assert_eq!(index.apply(&orders("a", "http://127.0.0.1:9000/")), vec![]);
        let moved = index.apply(&orders("a", "http://127.0.0.1:9001/"));
        assert_eq!(started(&moved).len(), 1);
        let Action::Start { target, .. } = &moved[0] else {
            unreachable!()
        };
        assert_eq!(target.sink, "http://127.0.0.1:9001/");
    }

    #[test]
    fn an_invalid_change_stops_delivery_but_keeps_the_consumer() {
        let mut index = index();
        index.apply(&orders("a", "http://127.0.0.1:9000/"));
        let actions = index.apply(&orders("a", "http://10.0.0.1/"));
        let [
            Action::Stop {
                key: stopped,
                problems,
            },
        ] = actions.as_slice()
        else {
            panic!("{actions:?}");
        };
        assert_eq!(stopped, &key("a"));
        assert!(problems.contains("sink"), "{problems}");
        assert_eq!(index.targets().count(), 0);
        // Invalid from the start: said so as well.
        assert!(matches!(
            index.apply(&orders("b", "http://10.0.0.1/")).as_slice(),
            [Action::Stop { .. }]
        ));
        // Its consumer is not an orphan.
        let sweep = index.synced();
        let [Action::DeleteOrphans { wanted }] = sweep.as_slice() else {
            panic!("no orphan sweep");
        };
        assert!(wanted.contains("sub_shop_a") && wanted.contains("sub_shop_b"));
    }

    #[test]
    fn a_deletion_removes_and_every_complete_list_sweeps_orphans() {
        let mut index = index();
        index.apply(&orders("a", "http://127.0.0.1:9000/"));
        index.apply(&orders("b", "http://127.0.0.1:9000/"));
        assert!(!index.is_synced());
        let sweep = index.synced();
        assert_eq!(
            sweep,
            vec![Action::DeleteOrphans {
                wanted: ["sub_shop_a", "sub_shop_b"].map(String::from).into()
            }]
        );
        assert!(index.is_synced());
        assert_eq!(
            index.delete(key("a")),
            vec![Action::Remove { key: key("a") }]
        );
        assert_eq!(index.targets().count(), 1);
        // A relist later: the deleted one's consumer is not wanted any more.
        assert_eq!(
            index.synced(),
            vec![Action::DeleteOrphans {
                wanted: ["sub_shop_b"].map(String::from).into()
            }]
        );
    }
}
