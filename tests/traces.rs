//! One trace per event: with traces on, a test OTLP/HTTP receiver gets the publish, its store,
//! each delivery attempt, the gateway's call, the function's own spans and the publish of the
//! function's reply, each the child of the one before; a dead-lettered event's trace says why.
//!
//! This binary installs the process-wide trace exporter, so it holds this one test (nextest runs
//! every test in a process of its own; `cargo test` runs the binary alone).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{Json, Router, extract::State, http::StatusCode, routing::post};
use eddy_platform::{
    telemetry::{LogArgs, LogFormat},
    traces::{OtlpProtocol, TraceArgs},
};
use eddy_testing::eventually;
use serde_json::{Value, json};
use support::{Platform, Sink};

/// The spans an OTLP/HTTP JSON receiver got, flattened.
#[derive(Clone, Default)]
struct Receiver(Arc<Mutex<Vec<Value>>>);

impl Receiver {
    fn spans(&self) -> Vec<Value> {
        self.0.lock().unwrap().clone()
    }

    /// The one span named `name` whose attribute `key` is `value`.
    fn find(&self, name: &str, key: &str, value: &str) -> Option<Value> {
        self.spans()
            .into_iter()
            .find(|span| span["name"] == name && attribute(span, key).as_deref() == Some(value))
    }

    /// The spans whose parent is `parent`.
    fn children(&self, parent: &Value) -> Vec<Value> {
        self.spans()
            .into_iter()
            .filter(|span| span["parentSpanId"] == parent["spanId"])
            .collect()
    }
}

async fn collect(State(receiver): State<Receiver>, Json(body): Json<Value>) -> Json<Value> {
    let mut spans = receiver.0.lock().unwrap();
    for resource in body["resourceSpans"].as_array().into_iter().flatten() {
        for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
            spans.extend(scope["spans"].as_array().into_iter().flatten().cloned());
        }
    }
    Json(json!({}))
}

/// An attribute's value as text (OTLP/JSON writes integers as strings or numbers).
fn attribute(span: &Value, key: &str) -> Option<String> {
    let value = &span["attributes"]
        .as_array()?
        .iter()
        .find(|attribute| attribute["key"] == key)?["value"];
    ["stringValue", "intValue", "boolValue"]
        .iter()
        .find_map(|kind| match &value[kind] {
            Value::String(text) => Some(text.clone()),
            Value::Null => None,
            other => Some(other.to_string()),
        })
}

fn assert_child(child: &Value, parent: &Value, what: &str) {
    assert_eq!(
        child["parentSpanId"], parent["spanId"],
        "{what}: {child:#} should be the child of {parent:#}"
    );
    assert_eq!(child["traceId"], parent["traceId"], "{what}: same trace");
}

async fn wait_for<T>(what: &str, find: impl Fn() -> Option<T>) -> T {
    // The exporter sends spans in batches every few seconds.
    eventually(what, Duration::from_secs(30), || async { find().is_some() })
        .await
        .unwrap();
    find().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_event_makes_one_trace_from_publish_to_the_reply_and_dead_letters_say_why() {
    let receiver = Receiver::default();
    let app = Router::new()
        .route("/v1/traces", post(collect))
        .with_state(receiver.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let log = LogArgs {
        log_level: "warn".to_owned(),
        log_format: LogFormat::Compact,
    };
    let traces = TraceArgs {
        otlp_endpoint: Some(endpoint.clone()),
        otlp_protocol: Some(OtlpProtocol::HttpJson),
        trace_ui_url: Some("http://traces.example/trace/{traceId}".to_owned()),
    };
    let _exporter = log.init(&traces, "eddy").unwrap().expect("traces on");

    let platform = Platform::start().await;
    // The function's own span, and an answer that is a CloudEvent: the dispatcher stores it.
    let source = r#"
module.exports = { main: (event) => {
  const span = event.tracer.startSpan("reserve-stock");
  span.end();
  event.setResponseHeader("ce-specversion", "1.0");
  event.setResponseHeader("ce-type", "stock.reserved.v1");
  event.setResponseHeader("ce-source", "stock");
  event.setResponseHeader("ce-id", "reply-" + event["ce-id"]);
  return { reserved: event.data.orderId };
} };
"#;
    platform
        .deploy(
            "reserver",
            json!({
                "runtime": "nodejs20",
                "source": {"inline": {"source": source}},
                "env": [{"name": "OTEL_BSP_SCHEDULE_DELAY", "value": "100"}],
            }),
        )
        .await;
    platform
        .subscribe(
            "reserve",
            json!({"sink": "http://reserver.default.svc.cluster.local", "source": "shop",
                   "types": ["order.created.v1"]}),
        )
        .await;
    let reserved = Sink::ok().await;
    platform
        .subscribe(
            "reserved",
            json!({"sink": reserved.url, "source": "stock", "types": ["stock.reserved.v1"]}),
        )
        .await;
    let refusing = Sink::answering(StatusCode::BAD_REQUEST).await;
    platform
        .subscribe(
            "doomed",
            json!({"sink": refusing.url, "source": "shop", "types": ["order.doomed.v1"]}),
        )
        .await;

    // The publisher's own trace: eddy's spans continue it.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let publisher_span = "00f067aa0ba902b7";
    let response = platform
        .http
        .post(format!("{}/publish", platform.bus))
        .header("ce-specversion", "1.0")
        .header("ce-id", "order-1")
        .header("ce-source", "shop")
        .header("ce-type", "order.created.v1")
        .header("content-type", "application/json")
        .header("traceparent", format!("00-{trace_id}-{publisher_span}-01"))
        .body(r#"{"orderId": "1001"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204);
    reserved.wait_for(1).await;
    platform
        .publish("shop", "order.doomed.v1", "doomed-1", json!({}))
        .await;
    eventually(
        "the doomed event in dead letters",
        Duration::from_secs(20),
        || async { !platform.dead_letters("doomed").await.is_empty() },
    )
    .await
    .unwrap();

    // publish → store → deliver → gateway call → the function → its own span.
    let store = wait_for("the store span of order-1", || {
        receiver.find("store", "cloudevents.event_id", "order-1")
    })
    .await;
    assert_eq!(store["traceId"], trace_id, "the publisher's trace goes on");
    let publish = receiver
        .spans()
        .into_iter()
        .find(|span| span["spanId"] == store["parentSpanId"])
        .expect("the publish span");
    assert_eq!(publish["name"], "publish");
    assert_eq!(publish["parentSpanId"], publisher_span);
    assert_eq!(
        attribute(&publish, "http.response.status_code").as_deref(),
        Some("204")
    );
    let sequence = attribute(&store, "messaging.nats.stream_sequence").expect("the sequence");
    assert!(sequence.parse::<u64>().unwrap() >= 1, "{sequence}");
    // The dashboard's event detail names the trace and links it in the tracing UI.
    let detail = platform
        .get_json(&format!("{}/dashboard/events/{sequence}", platform.api))
        .await;
    assert_eq!(detail["traceId"], trace_id, "{detail}");
    assert_eq!(
        detail["traceUrl"],
        format!("http://traces.example/trace/{trace_id}")
    );
    assert_eq!(detail["attributes"]["id"], "order-1");
    // The dispatcher's record of its deliveries (this platform's controller is not told where
    // the dispatcher is, so the detail above has none).
    let deliveries = platform
        .get_json(&format!(
            "{}/deliveries?sequence={sequence}",
            platform.dispatcher
        ))
        .await;
    assert_eq!(deliveries["items"][0]["subscription"], "default/reserve");
    let attempt = &deliveries["items"][0]["attempts"][0];
    assert_eq!(attempt["outcome"], "delivered", "{deliveries}");
    assert_eq!(attempt["attempt"], 1);
    assert_eq!(attempt["status"], 200);

    let deliver = wait_for("the delivery of order-1", || {
        receiver.find("deliver", "eddy.subscription", "default/reserve")
    })
    .await;
    assert_child(&deliver, &store, "delivery");
    assert_eq!(attribute(&deliver, "eddy.attempt").as_deref(), Some("1"));
    assert_eq!(
        attribute(&deliver, "eddy.outcome").as_deref(),
        Some("delivered")
    );
    assert_eq!(
        attribute(&deliver, "http.response.status_code").as_deref(),
        Some("200")
    );

    let call = wait_for("the gateway's call", || {
        receiver.find("call", "eddy.function", "reserver")
    })
    .await;
    assert_child(&call, &deliver, "gateway call");
    let user_span = wait_for("the function's own span", || {
        receiver
            .spans()
            .into_iter()
            .find(|span| span["name"] == "reserve-stock")
    })
    .await;
    let function_span = receiver
        .spans()
        .into_iter()
        .find(|span| span["spanId"] == user_span["parentSpanId"])
        .expect("the function's server span");
    assert_child(&function_span, &call, "the function's server span");

    // The reply: stored under the delivery, and delivered in the same trace.
    let reply = wait_for("the reply span", || {
        receiver.find("reply", "eddy.subscription", "default/reserve")
    })
    .await;
    assert_child(&reply, &deliver, "reply");
    let reply_store = wait_for("the reply's store span", || {
        receiver.find("store", "cloudevents.event_id", "reply-order-1")
    })
    .await;
    assert_child(&reply_store, &reply, "reply store");
    let reply_delivery = wait_for("the reply's delivery", || {
        receiver.find("deliver", "eddy.subscription", "default/reserved")
    })
    .await;
    assert_child(&reply_delivery, &reply_store, "reply delivery");
    assert_eq!(
        &reserved.received()[0].header("traceparent")[3..35],
        trace_id,
        "the sink got the trace's context"
    );

    // A dead letter's trace says why.
    let doomed_store = wait_for("the store span of doomed-1", || {
        receiver.find("store", "cloudevents.event_id", "doomed-1")
    })
    .await;
    let doomed = wait_for("the dead-lettered delivery", || {
        receiver.find("deliver", "eddy.subscription", "default/doomed")
    })
    .await;
    assert_child(&doomed, &doomed_store, "dead-lettered delivery");
    assert_eq!(
        attribute(&doomed, "eddy.outcome").as_deref(),
        Some("dead_letter")
    );
    assert_eq!(
        attribute(&doomed, "eddy.reason").as_deref(),
        Some("http_4xx")
    );
    assert_eq!(doomed["status"]["message"], "dead-lettered: http_4xx");
    assert_eq!(
        attribute(&doomed, "http.response.status_code").as_deref(),
        Some("400")
    );
    // Every span of order-1's trace is one of these, none orphaned.
    let in_trace: Vec<Value> = receiver
        .spans()
        .into_iter()
        .filter(|span| span["traceId"] == trace_id)
        .collect();
    for span in &in_trace {
        let parent = &span["parentSpanId"];
        assert!(
            parent == publisher_span || in_trace.iter().any(|other| other["spanId"] == *parent),
            "a span of the trace whose parent is missing: {span:#}"
        );
    }
    assert!(receiver.children(&deliver).len() >= 2, "call and reply");
}
