//! Dispatcher metrics, per subscription (`namespace/name`: a bounded set, owned by operators)
//! and reason (a fixed vocabulary), never per event.

use crate::delivery::Failure;
use eddy_model::admin::Counts;
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SubscriptionLabel {
    subscription: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ScaleLabels {
    function: String,
    direction: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    subscription: String,
    reason: &'static str,
}

/// The series of one subscription, looked up once so the delivery path does not allocate a
/// label and hash it for every event.
#[derive(Clone)]
pub struct SubscriptionMetrics {
    delivered: Counter,
    duration: Histogram,
    in_flight: Gauge,
    pending: Gauge,
}

impl SubscriptionMetrics {
    /// A delivery succeeded after `seconds`.
    pub fn delivered(&self, seconds: f64) {
        self.delivered.inc();
        self.duration.observe(seconds);
    }

    /// An attempt whose event goes to dead letters took `seconds` (retried attempts are
    /// observed by [`Metrics::retried`]): the histogram holds every attempt.
    pub fn failed_for_good(&self, seconds: f64) {
        self.duration.observe(seconds);
    }

    /// Changes the in-flight gauge by `delta`.
    pub fn add_in_flight(&self, delta: i64) {
        self.in_flight.inc_by(delta);
    }

    /// Sets the pending gauge.
    pub fn set_pending(&self, pending: i64) {
        self.pending.set(pending);
    }
}

/// `eddy_dispatcher_function_scaled_total`, by Function and direction.
#[derive(Clone)]
pub struct Scalings(Family<ScaleLabels, Counter>);

impl Scalings {
    /// The dispatcher changed the replicas of `function` (`namespace/name`): `direction` is
    /// `wake`, `out`, `in` or `zero`.
    pub fn scaled(&self, function: &str, direction: &'static str) {
        self.0
            .get_or_create(&ScaleLabels {
                function: function.to_owned(),
                direction,
            })
            .inc();
    }
}

/// The dispatcher metrics.
pub struct Metrics {
    registry: Registry,
    delivered: Family<SubscriptionLabel, Counter>,
    retried: Family<SubscriptionLabel, Counter>,
    dead_lettered: Family<SubscriptionLabel, Counter>,
    failures: Family<ReasonLabels, Counter>,
    duration: Family<SubscriptionLabel, Histogram>,
    pending: Family<SubscriptionLabel, Gauge>,
    in_flight: Family<SubscriptionLabel, Gauge>,
    stream_breaks: Family<ReasonLabels, Counter>,
    scaled: Family<ScaleLabels, Counter>,
    skipped: Family<SubscriptionLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric under `eddy_dispatcher_`.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("eddy_dispatcher");
        let delivered = Family::<SubscriptionLabel, Counter>::default();
        registry.register(
            "delivered",
            "Events delivered (sink answered 2xx)",
            delivered.clone(),
        );
        let retried = Family::<SubscriptionLabel, Counter>::default();
        registry.register(
            "retried",
            "Deliveries that failed and will be retried",
            retried.clone(),
        );
        let dead_lettered = Family::<SubscriptionLabel, Counter>::default();
        registry.register(
            "dead_lettered",
            "Events sent to dead letters",
            dead_lettered.clone(),
        );
        let failures = Family::<ReasonLabels, Counter>::default();
        registry.register("failures", "Failed deliveries by reason", failures.clone());
        let duration = Family::<SubscriptionLabel, Histogram>::new_with_constructor(|| {
            Histogram::new([
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ])
        });
        registry.register(
            "delivery_duration_seconds",
            "Time of one delivery attempt",
            duration.clone(),
        );
        let pending = Family::<SubscriptionLabel, Gauge>::default();
        registry.register(
            "pending_events",
            "Events stored and not yet delivered",
            pending.clone(),
        );
        let in_flight = Family::<SubscriptionLabel, Gauge>::default();
        registry.register("in_flight", "Deliveries running now", in_flight.clone());
        let stream_breaks = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "stream_breaks",
            "Message streams from JetStream that ended and were opened again, by reason",
            stream_breaks.clone(),
        );
        let scaled = Family::<ScaleLabels, Counter>::default();
        registry.register(
            "function_scaled",
            "Replica changes of Functions that scale to zero, by direction (wake, out, in, zero)",
            scaled.clone(),
        );
        let skipped = Family::<SubscriptionLabel, Counter>::default();
        registry.register(
            "skipped",
            "Events taken without delivery: a legacy event's copy in Kyma's legacy form, where \
             the Subscription takes the event itself",
            skipped.clone(),
        );
        Self {
            registry,
            scaled,
            skipped,
            delivered,
            retried,
            dead_lettered,
            failures,
            duration,
            pending,
            in_flight,
            stream_breaks,
        }
    }

    /// The scaler's counter, as a handle of its own (the scaler needs nothing else of these).
    pub fn scalings(&self) -> Scalings {
        Scalings(self.scaled.clone())
    }

    /// A legacy event's copy in Kyma's form was taken without delivery: the Subscription
    /// takes the event itself.
    pub fn skipped(&self, subscription: &str) {
        self.skipped.get_or_create(&Self::label(subscription)).inc();
    }

    /// A subscription's message stream ended for `reason` (a fixed vocabulary) and is rebuilt.
    pub fn stream_broke(&self, subscription: &str, reason: &'static str) {
        self.stream_breaks
            .get_or_create(&ReasonLabels {
                subscription: subscription.to_owned(),
                reason,
            })
            .inc();
    }

    fn label(subscription: &str) -> SubscriptionLabel {
        SubscriptionLabel {
            subscription: subscription.to_owned(),
        }
    }

    /// The hot-path series of one subscription.
    pub fn subscription(&self, subscription: &str) -> SubscriptionMetrics {
        let label = Self::label(subscription);
        SubscriptionMetrics {
            delivered: self.delivered.get_or_create(&label).clone(),
            duration: self.duration.get_or_create(&label).clone(),
            in_flight: self.in_flight.get_or_create(&label).clone(),
            pending: self.pending.get_or_create(&label).clone(),
        }
    }

    /// A delivery failed and will be retried.
    pub fn retried(&self, subscription: &str, reason: Failure, seconds: f64) {
        let label = Self::label(subscription);
        self.retried.get_or_create(&label).inc();
        self.duration.get_or_create(&label).observe(seconds);
        self.failures
            .get_or_create(&ReasonLabels {
                subscription: subscription.to_owned(),
                reason: reason.label(),
            })
            .inc();
    }

    /// An event went to dead letters.
    pub fn dead_lettered(&self, subscription: &str, reason: Failure) {
        self.dead_lettered
            .get_or_create(&Self::label(subscription))
            .inc();
        self.failures
            .get_or_create(&ReasonLabels {
                subscription: subscription.to_owned(),
                reason: reason.label(),
            })
            .inc();
    }

    /// Counts a failure that is neither a retry nor a dead letter (e.g. a refused reply).
    pub fn failure(&self, subscription: &str, reason: Failure) {
        self.failures
            .get_or_create(&ReasonLabels {
                subscription: subscription.to_owned(),
                reason: reason.label(),
            })
            .inc();
    }

    /// Current counters of one subscription.
    pub fn counts(&self, subscription: &str) -> Counts {
        let label = Self::label(subscription);
        Counts {
            delivered: self.delivered.get_or_create(&label).get(),
            retried: self.retried.get_or_create(&label).get(),
            dead_lettered: self.dead_lettered.get_or_create(&label).get(),
            pending: self.pending.get_or_create(&label).get(),
            in_flight: self.in_flight.get_or_create(&label).get(),
        }
    }

    /// Drops the series of a deleted subscription.
    pub fn forget(&self, subscription: &str) {
        let label = Self::label(subscription);
        self.pending.remove(&label);
        self.in_flight.remove(&label);
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
