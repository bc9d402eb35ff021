//! Header names used on stored events, deliveries and dead letters.

/// Prefix of CloudEvents attributes in binary content mode (HTTP and NATS alike).
pub const CE_PREFIX: &str = "ce-";
/// The data's media type in binary mode (the `datacontenttype` attribute).
pub const CONTENT_TYPE: &str = "content-type";
/// W3C trace context, carried from the publisher to the function.
pub const TRACEPARENT: &str = "traceparent";
/// W3C trace context vendor state.
pub const TRACESTATE: &str = "tracestate";
/// The `originaltype` extension Kyma's publisher proxy sets on every event it builds: the type
/// as the publisher wrote it (Kyma's dispatcher delivers it back as the type).
pub const ORIGINAL_TYPE: &str = "ce-originaltype";
/// The `eventtypeversion` extension of an event converted from Kyma's legacy format.
pub const EVENT_TYPE_VERSION: &str = "ce-eventtypeversion";
/// Media type of a structured CloudEvent.
pub const CLOUDEVENTS_JSON: &str = "application/cloudevents+json";
/// Media type of a batch of structured CloudEvents.
pub const CLOUDEVENTS_BATCH_JSON: &str = "application/cloudevents-batch+json";

/// Why an event went to dead letters (bounded vocabulary, see the dispatcher).
pub const DLQ_REASON: &str = "eddy-dlq-reason";
/// The last HTTP status the sink answered, when it answered.
pub const DLQ_STATUS: &str = "eddy-dlq-status";
/// How many deliveries were attempted.
pub const DLQ_ATTEMPTS: &str = "eddy-dlq-attempts";
/// `namespace/name` of the Subscription.
pub const DLQ_SUBSCRIPTION: &str = "eddy-dlq-subscription";
/// Sequence of the original event in `EDDY_EVENTS`.
pub const DLQ_STREAM_SEQ: &str = "eddy-dlq-stream-seq";
