//! Prometheus metrics of the event-bus. Labels are bounded: content mode, outcome and route
//! template, never anything taken from an event.

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

/// How the event arrived.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Mode {
    /// `ce-*` headers.
    Binary,
    /// `application/cloudevents+json`.
    Structured,
    /// `application/cloudevents-batch+json`.
    Batch,
    /// `POST /{application}/v1/events`.
    Legacy,
    /// Refused before the mode was known.
    Unknown,
}

/// What happened to it.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Outcome {
    /// Stored and acknowledged.
    Stored,
    /// Acknowledged as a duplicate of one stored inside the window.
    Duplicate,
    /// Refused as invalid (400).
    Invalid,
    /// Refused as too large (413).
    TooLarge,
    /// Refused: unknown content mode (415).
    Unsupported,
    /// Refused: no valid token (401).
    Unauthorized,
    /// Not stored: NATS unreachable or no ack in time (503).
    NatsUnavailable,
    /// Not stored: JetStream refused it, e.g. the store is full (503).
    StreamRefused,
    /// The request ran past the server's deadline (503); it may have been stored.
    TimedOut,
}

impl Mode {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Binary => "binary",
            Self::Structured => "structured",
            Self::Batch => "batch",
            Self::Legacy => "legacy",
            Self::Unknown => "unknown",
        }
    }
}

impl Outcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stored => "stored",
            Self::Duplicate => "duplicate",
            Self::Invalid => "invalid",
            Self::TooLarge => "too_large",
            Self::Unsupported => "unsupported",
            Self::Unauthorized => "unauthorized",
            Self::NatsUnavailable => "nats_unavailable",
            Self::StreamRefused => "stream_refused",
            Self::TimedOut => "timed_out",
        }
    }
}

impl EncodeLabelValue for Mode {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        EncodeLabelValue::encode(&self.as_str(), encoder)
    }
}

impl EncodeLabelValue for Outcome {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        EncodeLabelValue::encode(&self.as_str(), encoder)
    }
}

/// The route label of `POST /publish`.
pub const PUBLISH: &str = "publish";

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    mode: Mode,
    outcome: Outcome,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: &'static str,
}

/// The event-bus metrics.
pub struct Metrics {
    registry: Registry,
    events: Family<EventLabels, Counter>,
    request_seconds: Family<RouteLabels, Histogram>,
    received_bytes: Family<RouteLabels, Counter>,
    nats_connected: Gauge,
    /// The series every stored binary event touches, looked up once: a family lookup takes a
    /// lock and hashes the labels, three times per event.
    publish: PublishSeries,
}

/// The series of `POST /publish` and of binary events stored, resolved from their families.
struct PublishSeries {
    binary_stored: Counter,
    request_seconds: Histogram,
    received_bytes: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric under `eddy_bus_`.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("eddy_bus");
        let events = Family::<EventLabels, Counter>::default();
        registry.register(
            "events",
            "Events by content mode and outcome",
            events.clone(),
        );
        let request_seconds = Family::<RouteLabels, Histogram>::new_with_constructor(|| {
            Histogram::new([
                0.000_25, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0,
            ])
        });
        registry.register(
            "request_duration_seconds",
            "Time to answer a request, by route",
            request_seconds.clone(),
        );
        let received_bytes = Family::<RouteLabels, Counter>::default();
        registry.register(
            "received_bytes",
            "Request body bytes received, by route",
            received_bytes.clone(),
        );
        let nats_connected = Gauge::default();
        registry.register(
            "nats_connected",
            "1 while connected to NATS",
            nats_connected.clone(),
        );
        let publish_route = RouteLabels { route: PUBLISH };
        let publish = PublishSeries {
            binary_stored: events
                .get_or_create(&EventLabels {
                    mode: Mode::Binary,
                    outcome: Outcome::Stored,
                })
                .clone(),
            request_seconds: request_seconds.get_or_create(&publish_route).clone(),
            received_bytes: received_bytes.get_or_create(&publish_route).clone(),
        };
        Self {
            registry,
            events,
            request_seconds,
            received_bytes,
            nats_connected,
            publish,
        }
    }

    /// Counts `count` events with this mode and outcome.
    pub fn events(&self, mode: Mode, outcome: Outcome, count: u64) {
        if (mode, outcome) == (Mode::Binary, Outcome::Stored) {
            self.publish.binary_stored.inc_by(count);
            return;
        }
        self.events
            .get_or_create(&EventLabels { mode, outcome })
            .inc_by(count);
    }

    /// Records how long a request took.
    pub fn observe_request(&self, route: &'static str, seconds: f64) {
        if route == PUBLISH {
            self.publish.request_seconds.observe(seconds);
            return;
        }
        self.request_seconds
            .get_or_create(&RouteLabels { route })
            .observe(seconds);
    }

    /// Counts request body bytes.
    pub fn received(&self, route: &'static str, bytes: u64) {
        if route == PUBLISH {
            self.publish.received_bytes.inc_by(bytes);
            return;
        }
        self.received_bytes
            .get_or_create(&RouteLabels { route })
            .inc_by(bytes);
    }

    /// Sets the connection gauge.
    pub fn set_nats_connected(&self, connected: bool) {
        self.nats_connected.set(i64::from(connected));
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
