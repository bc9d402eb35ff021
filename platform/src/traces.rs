//! Distributed traces: OpenTelemetry spans exported over OTLP/HTTP, off unless an endpoint is
//! configured (`--otlp-endpoint`, or the standard `OTEL_EXPORTER_OTLP_ENDPOINT`).
//!
//! One event makes one trace: the event-bus's `publish` (continuing the publisher's
//! `traceparent`), a `store` span per event with its stream sequence, the dispatcher's `deliver`
//! span per attempt, the gateway's `call`, the function's own spans, and the `reply` that stores
//! the function's answer as a new event. Context crosses each hop as W3C `traceparent` and
//! `tracestate`: from HTTP requests, in each stored event's headers (the context of the span
//! that stored it), and on every request eddy sends on.
//!
//! Only spans of the target [`TARGET`] are exported, never the spans that scope log lines. When
//! traces are off no exporter runs and no such span is made: [`enabled`] is one atomic load, so
//! the publish, dispatch and proxy paths pay nothing for the feature.

use std::sync::OnceLock;

use opentelemetry::{
    propagation::{Extractor, Injector, TextMapPropagator as _},
    trace::TracerProvider as _,
};
use opentelemetry_otlp::{Protocol, WithExportConfig as _};
use opentelemetry_sdk::{
    Resource,
    propagation::TraceContextPropagator,
    trace::{SdkTracerProvider, Tracer},
};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use eddy_model::{event::EventHeaders, headers as names};

/// The `tracing` target of exported spans: `tracing::info_span!(target: TARGET, …)`.
pub const TARGET: &str = "eddy::trace";

/// The traces URL (`<endpoint>/v1/traces`) once traces are on; unset while they are off.
static COLLECTOR: OnceLock<String> = OnceLock::new();

/// The tracing UI's link template, once traces are on and one is given.
static TRACE_UI: OnceLock<String> = OnceLock::new();

/// How spans are encoded on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OtlpProtocol {
    /// Protocol buffers (`application/x-protobuf`), OTLP's default.
    #[value(name = "http/protobuf")]
    HttpProtobuf,
    /// JSON (`application/json`).
    #[value(name = "http/json")]
    HttpJson,
}

/// Trace flags, flattened into the command line beside the logging flags.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TraceArgs {
    /// OTLP/HTTP endpoint to send traces to, e.g. `http://127.0.0.1:4318` (spans go to its
    /// `/v1/traces`); functions get it as `TRACE_COLLECTOR_ENDPOINT`. Defaults to
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`; with neither, nothing is traced.
    #[arg(long = "otlp-endpoint", env = "EDDY_OTLP_ENDPOINT", global = true)]
    pub otlp_endpoint: Option<String>,
    /// Encoding of exported spans. Defaults to `OTEL_EXPORTER_OTLP_PROTOCOL`, then
    /// `http/protobuf`.
    #[arg(
        long = "otlp-protocol",
        env = "EDDY_OTLP_PROTOCOL",
        value_enum,
        global = true
    )]
    pub otlp_protocol: Option<OtlpProtocol>,
    /// Your tracing UI's address of one trace, `{traceId}` standing for its id, e.g.
    /// `http://127.0.0.1:16686/trace/{traceId}` (Jaeger): the dashboard links each event's
    /// trace there.
    #[arg(long = "trace-ui-url", env = "EDDY_TRACE_UI_URL", global = true)]
    pub trace_ui_url: Option<String>,
}

impl TraceArgs {
    /// The base endpoint, from the flag or the standard variable; `None` turns traces off.
    pub fn endpoint(&self) -> Option<String> {
        self.otlp_endpoint
            .clone()
            .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok())
            .map(|endpoint| endpoint.trim().trim_end_matches('/').to_owned())
            .filter(|endpoint| !endpoint.is_empty())
    }

    fn protocol(&self) -> Protocol {
        let from_env = || match std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL").as_deref() {
            Ok("http/json") => OtlpProtocol::HttpJson,
            _ => OtlpProtocol::HttpProtobuf,
        };
        match self.otlp_protocol.unwrap_or_else(from_env) {
            OtlpProtocol::HttpProtobuf => Protocol::HttpBinary,
            OtlpProtocol::HttpJson => Protocol::HttpJson,
        }
    }
}

/// Traces are on: spans of [`TARGET`] are made and exported.
pub fn enabled() -> bool {
    COLLECTOR.get().is_some()
}

/// The OTLP/HTTP traces URL functions export their own spans to (`TRACE_COLLECTOR_ENDPOINT`),
/// while traces are on.
pub fn collector_endpoint() -> Option<&'static str> {
    COLLECTOR.get().map(String::as_str)
}

/// The tracing UI's page of the trace `trace_id` (32 hex digits), when traces are on and
/// `--trace-ui-url` is given.
pub fn ui_link(trace_id: &str) -> Option<String> {
    let valid = trace_id.len() == 32 && trace_id.bytes().all(|b| b.is_ascii_hexdigit());
    let template = TRACE_UI.get()?;
    valid.then(|| template.replace("{traceId}", trace_id))
}

/// The trace id of a W3C `traceparent` (`00-<trace id>-<span id>-<flags>`).
pub fn trace_id_of(traceparent: &str) -> Option<&str> {
    let mut fields = traceparent.trim().split('-');
    let (_version, trace_id) = (fields.next()?, fields.next()?);
    (trace_id.len() == 32 && trace_id.bytes().all(|b| b.is_ascii_hexdigit())).then_some(trace_id)
}

/// The exporter behind the spans; flushes what is queued and stops when dropped.
pub struct Traces {
    provider: SdkTracerProvider,
}

impl Drop for Traces {
    fn drop(&mut self) {
        if let Err(error) = self.provider.shutdown() {
            tracing::warn!(%error, "traces not flushed at exit");
        }
    }
}

/// Sets up the exporter for `service` (or `OTEL_SERVICE_NAME`), when an endpoint is
/// configured: the tracer for the `tracing` layer and the guard that flushes at exit.
pub(crate) fn start(args: &TraceArgs, service: &str) -> crate::Result<Option<(Tracer, Traces)>> {
    let Some(endpoint) = args.endpoint() else {
        return Ok(None);
    };
    let traces_url = format!("{endpoint}/v1/traces");
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(traces_url.clone())
        .with_protocol(args.protocol())
        .build()
        .map_err(|error| crate::Error::Traces(error.to_string()))?;
    let service = std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| service.to_owned());
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(service).build())
        .build();
    let tracer = provider.tracer("eddy");
    // A second start in one process (tests) keeps the first endpoint.
    let _ = COLLECTOR.set(traces_url);
    if let Some(template) = args.trace_ui_url.as_ref().filter(|t| !t.trim().is_empty()) {
        let _ = TRACE_UI.set(template.trim().to_owned());
    }
    Ok(Some((tracer, Traces { provider })))
}

/// Makes `span` continue the trace of an incoming HTTP request (W3C `traceparent`), if it
/// carries one. Call it before the span is first entered.
pub fn continue_http(span: &tracing::Span, headers: &http::HeaderMap) {
    let parent =
        TraceContextPropagator::new().extract(&opentelemetry_http::HeaderExtractor(headers));
    let _ = span.set_parent(parent);
}

/// Serves `request` under `span`, a server span with the fields `http.response.status_code`
/// and `otel.status_code` left empty: the span continues the caller's trace, and records the
/// answer's status (an error status for a 5xx).
pub async fn serve_request(
    span: tracing::Span,
    request: axum::extract::Request,
    serve: impl AsyncFnOnce(axum::extract::Request) -> axum::response::Response,
) -> axum::response::Response {
    use tracing::Instrument as _;
    continue_http(&span, request.headers());
    let response = serve(request).instrument(span.clone()).await;
    let status = response.status();
    span.record("http.response.status_code", status.as_u16());
    if status.is_server_error() {
        span.record("otel.status_code", "error");
    }
    response
}

/// Makes `span` continue the trace a stored event carries in its NATS headers.
pub fn continue_nats(span: &tracing::Span, headers: Option<&async_nats::HeaderMap>) {
    if let Some(headers) = headers {
        let parent = TraceContextPropagator::new().extract(&NatsExtractor(headers));
        let _ = span.set_parent(parent);
    }
}

/// Writes `span`'s context as `traceparent` (and `tracestate`) into outgoing HTTP headers,
/// replacing what they carried, so the receiver's spans are children of `span`.
pub fn inject_http(span: &tracing::Span, headers: &mut http::HeaderMap) {
    TraceContextPropagator::new().inject_context(
        &span.context(),
        &mut opentelemetry_http::HeaderInjector(headers),
    );
}

/// Writes `span`'s context into an event's headers before it is stored, so its deliveries
/// continue the trace from the span that stored it.
pub fn inject_event(span: &tracing::Span, headers: &mut EventHeaders) {
    TraceContextPropagator::new().inject_context(&span.context(), &mut EventInjector(headers));
}

struct NatsExtractor<'a>(&'a async_nats::HeaderMap);

impl Extractor for NatsExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(async_nats::HeaderValue::as_str)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(name, _)| name.as_ref()).collect()
    }
}

struct EventInjector<'a>(&'a mut EventHeaders);

impl Injector for EventInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        // The propagator writes only these two; values it makes are plain ASCII.
        let name = match key {
            names::TRACEPARENT => names::TRACEPARENT,
            names::TRACESTATE => names::TRACESTATE,
            _ => return,
        };
        if !value.contains(['\r', '\n']) {
            self.0.set(name, value);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_endpoint_comes_from_the_flag_and_loses_its_trailing_slash() {
        let args = TraceArgs {
            otlp_endpoint: Some(" http://127.0.0.1:4318/ ".to_owned()),
            otlp_protocol: None,
            trace_ui_url: None,
        };
        assert_eq!(args.endpoint().as_deref(), Some("http://127.0.0.1:4318"));
        let empty = TraceArgs {
            otlp_endpoint: Some(String::new()),
            otlp_protocol: None,
            trace_ui_url: None,
        };
        // An empty flag turns traces off.
        assert_eq!(empty.endpoint(), None);
    }

    #[test]
    fn the_protocol_flag_wins() {
        let args = TraceArgs {
            otlp_endpoint: None,
            otlp_protocol: Some(OtlpProtocol::HttpJson),
            trace_ui_url: None,
        };
        assert_eq!(args.protocol(), Protocol::HttpJson);
    }

    #[test]
    fn the_trace_id_is_the_second_field_of_a_traceparent() {
        assert_eq!(
            trace_id_of("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        assert_eq!(trace_id_of("00-short-00f067aa0ba902b7-01"), None);
        assert_eq!(trace_id_of(""), None);
    }
}
