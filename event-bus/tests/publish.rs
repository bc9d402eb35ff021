//! The event-bus contract (docs/event-bus.md), against a real nats-server.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use async_nats::jetstream::stream::{self, DiscardPolicy};
use common::{Bus, header};
use eddy_model::subject::message_id;
use eddy_testing::{NatsServer, eventually};
use serde_json::{Value, json};

#[tokio::test]
async fn binary_event_is_stored_with_its_attributes_and_untouched_data() {
    let bus = Bus::start().await;
    let data = "{ \"sku\": \"A-1\",  \"qty\": 2 }";
    let response = bus
        .binary("shop", "order-1", "order.created.v1")
        .header("ce-time", "2024-05-01T10:00:00.5+02:00")
        .header("ce-subject", "orders/1")
        .header("ce-dataschema", "https://schemas.example/order")
        .header("ce-tenant", "acme")
        .header("content-type", "application/json; charset=utf-8")
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .header("tracestate", "vendor=1")
        .body(data)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204, "{:?}", response.text().await);

    let stored = bus.last_stored().await;
    assert_eq!(stored.subject.as_str(), "eddy.events.shop.order.created.v1");
    assert_eq!(&stored.payload[..], data.as_bytes());
    for (name, value) in [
        ("ce-specversion", "1.0"),
        ("ce-id", "order-1"),
        ("ce-source", "shop"),
        ("ce-type", "order.created.v1"),
        ("ce-time", "2024-05-01T10:00:00.5+02:00"),
        ("ce-subject", "orders/1"),
        ("ce-dataschema", "https://schemas.example/order"),
        ("ce-tenant", "acme"),
        ("content-type", "application/json; charset=utf-8"),
        (
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ),
        ("tracestate", "vendor=1"),
        ("Nats-Msg-Id", message_id("shop", "order-1").as_str()),
    ] {
        assert_eq!(header(&stored, name), Some(value), "{name}");
    }
}

/// What Kyma's publisher proxy takes from CloudEvents' Go SDK, stored as that proxy would
/// store it: a 0.3 event in binary mode as 1.0 (sdk-go's `AsV1`: `schemaurl` becomes
/// `dataschema`), raw UTF-8 in `ce-*` values as it is (sdk-go writes and reads them so), and
/// `originaltype` set to the type as published (Kyma's `GenericBuilder.Build`).
#[tokio::test]
async fn go_sdk_events_are_stored_as_kymas_publisher_proxy_takes_them() {
    let bus = Bus::start().await;
    let raw = |text: &str| reqwest::header::HeaderValue::from_bytes(text.as_bytes()).unwrap();
    let response = bus
        .post("/publish")
        .header("ce-specversion", "0.3")
        .header("ce-id", "go-1")
        .header("ce-source", "boutique")
        .header("ce-type", raw("commande.créée.v1"))
        .header("ce-subject", raw("100% über"))
        .header("ce-schemaurl", "https://schemas.example/commande")
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204, "{:?}", response.text().await);
    let stored = bus.last_stored().await;
    assert_eq!(
        stored.subject.as_str(),
        "eddy.events.boutique.commande.cr~C3~A9~C3~A9e.v1"
    );
    for (name, value) in [
        ("ce-specversion", Some("1.0")),
        ("ce-type", Some("commande.créée.v1")),
        ("ce-originaltype", Some("commande.créée.v1")),
        ("ce-subject", Some("100% über")),
        ("ce-dataschema", Some("https://schemas.example/commande")),
        ("ce-schemaurl", None),
    ] {
        assert_eq!(header(&stored, name), value, "{name}");
    }
}

#[tokio::test]
async fn structured_event_is_stored_in_binary_form() {
    let bus = Bus::start().await;
    let event = json!({
        "specversion": "1.0", "id": "s-1", "source": "https://shop.example/orders",
        "type": "order.created.v1", "time": "2024-05-01T08:00:00Z", "subject": "orders/1",
        "tenant": "acme", "priority": 3, "urgent": true,
        "data": {"sku": "A-1", "qty": 2, "note": "ünïcode"}
    });
    let response = bus
        .post("/publish")
        .header(
            "content-type",
            "application/cloudevents+json; charset=utf-8",
        )
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .body(event.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204, "{:?}", response.text().await);

    let stored = bus.last_stored().await;
    assert_eq!(
        stored.subject.as_str(),
        "eddy.events.https~3A~2F~2Fshop~2Eexample~2Forders.order.created.v1"
    );
    for (name, value) in [
        ("ce-id", "s-1"),
        ("ce-source", "https://shop.example/orders"),
        ("ce-type", "order.created.v1"),
        ("ce-time", "2024-05-01T08:00:00Z"),
        ("ce-subject", "orders/1"),
        ("ce-tenant", "acme"),
        ("ce-priority", "3"),
        ("ce-urgent", "true"),
        ("content-type", "application/json"),
        (
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ),
    ] {
        assert_eq!(header(&stored, name), Some(value), "{name}");
    }
    let data: Value = serde_json::from_slice(&stored.payload).unwrap();
    assert_eq!(data, json!({"sku": "A-1", "qty": 2, "note": "ünïcode"}));
    // Key order is kept.
    assert!(
        std::str::from_utf8(&stored.payload)
            .unwrap()
            .starts_with("{\"sku\"")
    );
}

#[tokio::test]
async fn structured_binary_data_and_text_data_become_the_payload() {
    let bus = Bus::start().await;
    let base64 = json!({"specversion": "1.0", "id": "b", "source": "s", "type": "t",
        "datacontenttype": "application/octet-stream", "data_base64": "AAEC/w=="});
    let text = json!({"specversion": "1.0", "id": "c", "source": "s", "type": "t",
        "datacontenttype": "text/plain", "data": "hello"});
    for event in [&base64, &text] {
        let response = bus
            .post("/publish")
            .header("content-type", "application/cloudevents+json")
            .body(event.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 204);
    }
    let first = bus.stored(1).await;
    assert_eq!(&first.payload[..], &[0, 1, 2, 255]);
    assert_eq!(
        header(&first, "content-type"),
        Some("application/octet-stream")
    );
    let second = bus.stored(2).await;
    assert_eq!(&second.payload[..], b"hello");
    assert_eq!(header(&second, "content-type"), Some("text/plain"));
}

#[tokio::test]
async fn same_source_and_id_is_stored_once() {
    let bus = Bus::start().await;
    for _ in 0..3 {
        let response = bus
            .binary("shop", "dup-1", "order.created.v1")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 204);
    }
    // Same id from another source is another event.
    let response = bus
        .binary("billing", "dup-1", "order.created.v1")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204);
    // A structured retry of the binary event is a duplicate too.
    let structured = json!({"specversion": "1.0", "id": "dup-1", "source": "shop", "type": "order.created.v1", "data": {}});
    let response = bus
        .post("/publish")
        .header("content-type", "application/cloudevents+json")
        .body(structured.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204);
    assert_eq!(bus.stored_count().await, 2);
    // Which two: shop's dup-1 once, and billing's.
    let mut stored = Vec::new();
    for sequence in 1..=2 {
        let message = bus.stored(sequence).await;
        stored.push((
            header(&message, "ce-source").map(str::to_owned),
            header(&message, "ce-id").map(str::to_owned),
        ));
    }
    let pair = |source: &str| (Some(source.to_owned()), Some("dup-1".to_owned()));
    assert_eq!(stored, [pair("shop"), pair("billing")]);
    let metrics = bus
        .http
        .get(format!("{}/metrics", bus.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains(r#"eddy_bus_events_total{mode="binary",outcome="duplicate"} 2"#),
        "{metrics}"
    );
}

async fn assert_refused(response: reqwest::Response, status: u16, field: Option<&str>) -> Value {
    assert_eq!(response.status(), status);
    let body: Value = response.json().await.unwrap();
    assert!(
        body["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{body}"
    );
    assert_eq!(body["field"].as_str(), field, "{body}");
    body
}

#[tokio::test]
async fn malformed_binary_events_get_400_naming_the_attribute() {
    let bus = Bus::start().await;
    type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            "missing id",
            vec![
                ("ce-specversion", "1.0"),
                ("ce-source", "s"),
                ("ce-type", "t"),
            ],
            "id",
        ),
        (
            "empty source",
            vec![
                ("ce-specversion", "1.0"),
                ("ce-id", "1"),
                ("ce-source", ""),
                ("ce-type", "t"),
            ],
            "source",
        ),
        (
            "missing type",
            vec![
                ("ce-specversion", "1.0"),
                ("ce-id", "1"),
                ("ce-source", "s"),
            ],
            "type",
        ),
        (
            "unknown spec",
            vec![
                ("ce-specversion", "0.2"),
                ("ce-id", "1"),
                ("ce-source", "s"),
                ("ce-type", "t"),
            ],
            "specversion",
        ),
        (
            "empty type segment",
            vec![
                ("ce-specversion", "1.0"),
                ("ce-id", "1"),
                ("ce-source", "s"),
                ("ce-type", "order..created"),
            ],
            "type",
        ),
        (
            "bad time",
            vec![
                ("ce-specversion", "1.0"),
                ("ce-id", "1"),
                ("ce-source", "s"),
                ("ce-type", "t"),
                ("ce-time", "yesterday"),
            ],
            "time",
        ),
        (
            "bad dataschema",
            vec![
                ("ce-specversion", "1.0"),
                ("ce-id", "1"),
                ("ce-source", "s"),
                ("ce-type", "t"),
                ("ce-dataschema", "not a uri"),
            ],
            "dataschema",
        ),
        (
            "bad extension name",
            vec![
                ("ce-specversion", "1.0"),
                ("ce-id", "1"),
                ("ce-source", "s"),
                ("ce-type", "t"),
                ("ce-my-ext", "x"),
            ],
            "my-ext",
        ),
    ];
    for (case, headers, field) in cases {
        let mut request = bus.post("/publish");
        for (name, value) in headers {
            request = request.header(name, value);
        }
        let response = request.body("{}").send().await.unwrap();
        assert_eq!(response.status(), 400, "{case}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["field"], field, "{case}: {body}");
    }
    assert_eq!(bus.stored_count().await, 0);
}

#[tokio::test]
async fn malformed_structured_events_get_400_naming_the_attribute() {
    let bus = Bus::start().await;
    let base = json!({"specversion": "1.0", "id": "1", "source": "s", "type": "t", "data": {}});
    let with = |key: &str, value: Value| {
        let mut event = base.clone();
        event[key] = value;
        event
    };
    let without = |key: &str| {
        let mut event = base.clone();
        event.as_object_mut().unwrap().remove(key);
        event
    };
    let cases = vec![
        (without("id"), Some("id")),
        (without("source"), Some("source")),
        (without("specversion"), Some("specversion")),
        (with("id", json!(5)), Some("id")),
        (with("type", json!("a.")), Some("type")),
        (with("myExt", json!("x")), Some("myExt")),
        (with("nested", json!({"a": 1})), Some("nested")),
        (with("big", json!(5_000_000_000i64)), Some("big")),
        (with("subject", json!("line\nbreak")), Some("subject")),
        (with("time", json!("2024-13-01")), Some("time")),
        (with("data_base64", json!("AAA=")), Some("data_base64")),
        (json!([1, 2]), None),
    ];
    for (event, field) in cases {
        let response = bus
            .post("/publish")
            .header("content-type", "application/cloudevents+json")
            .body(event.to_string())
            .send()
            .await
            .unwrap();
        assert_refused(response, 400, field).await;
    }
    let response = bus
        .post("/publish")
        .header("content-type", "application/cloudevents+json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_refused(response, 400, None).await;
    assert_eq!(bus.stored_count().await, 0);
}

/// `/publish` takes POST only: any other method is 405 naming POST, as any route answers a
/// method it does not take; the other paths are the router's.
#[tokio::test]
async fn publish_takes_post_only() {
    let bus = Bus::start().await;
    for method in [
        reqwest::Method::GET,
        reqwest::Method::PUT,
        reqwest::Method::DELETE,
    ] {
        let response = bus
            .http
            .request(method.clone(), format!("{}/publish", bus.url))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 405, "{method}");
        assert_eq!(response.headers()["allow"], "POST", "{method}");
    }
    let other = bus
        .http
        .get(format!("{}/healthz", bus.url))
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 200);
    let unknown = bus
        .http
        .get(format!("{}/publisher", bus.url))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
}

#[tokio::test]
async fn unknown_content_modes_get_415() {
    let bus = Bus::start().await;
    let response = bus
        .post("/publish")
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_refused(response, 415, None).await;
    let response = bus
        .post("/publish")
        .header("content-type", "application/cloudevents+avro")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_refused(response, 415, None).await;
}

#[tokio::test]
async fn events_over_the_size_limit_get_413() {
    let nats = NatsServer::start().unwrap();
    let bus = Bus::start_with(nats, |args| {
        args.max_event_size = bytesize::ByteSize::kib(4)
    })
    .await;
    let big = "x".repeat(5 * 1024);
    let response = bus
        .binary("s", "1", "t")
        .header("content-type", "text/plain")
        .body(big.clone())
        .send()
        .await
        .unwrap();
    assert_refused(response, 413, None).await;
    let structured =
        json!({"specversion": "1.0", "id": "2", "source": "s", "type": "t", "data": big});
    let response = bus
        .post("/publish")
        .header("content-type", "application/cloudevents+json")
        .body(structured.to_string())
        .send()
        .await
        .unwrap();
    assert_refused(response, 413, None).await;
    // Just under the limit is fine.
    let response = bus
        .binary("s", "3", "t")
        .body("x".repeat(3 * 1024))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204);
    assert_eq!(bus.stored_count().await, 1);
}

#[tokio::test]
async fn event_size_never_exceeds_the_servers_max_payload() {
    let nats = NatsServer::start_with_config("max_payload: 65536\n").unwrap();
    // Configured at 1 MiB, but the server takes at most 64 KiB.
    let bus = Bus::start_with(nats, |_| {}).await;
    let response = bus
        .binary("s", "1", "t")
        .body("x".repeat(100 * 1024))
        .send()
        .await
        .unwrap();
    assert_refused(response, 413, None).await;
    let response = bus
        .binary("s", "2", "t")
        .body("x".repeat(32 * 1024))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204);
}

#[tokio::test]
async fn batch_of_1000_is_stored_whole_and_in_order() {
    let bus = Bus::start().await;
    let events: Vec<Value> = (0..1000)
        .map(|i| {
            json!({"specversion": "1.0", "id": format!("b-{i}"), "source": "batcher",
            "type": "order.created.v1", "data": {"n": i}})
        })
        .collect();
    let response = bus
        .post("/publish")
        .header("content-type", "application/cloudevents-batch+json")
        .body(Value::Array(events).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204, "{:?}", response.text().await);
    assert_eq!(bus.stored_count().await, 1000);
    // Every one of them, in order.
    for sequence in 1u64..=1000 {
        let stored = bus.stored(sequence).await;
        let expected = format!("b-{}", sequence - 1);
        assert_eq!(header(&stored, "ce-id"), Some(expected.as_str()));
        let data: Value = serde_json::from_slice(&stored.payload).unwrap();
        assert_eq!(data["n"], sequence - 1);
    }
}

#[tokio::test]
async fn batch_with_an_invalid_event_stores_nothing_and_says_which() {
    let bus = Bus::start().await;
    let batch = json!([
        {"specversion": "1.0", "id": "1", "source": "s", "type": "t"},
        {"specversion": "1.0", "source": "s", "type": "t"},
        {"specversion": "1.0", "id": "3", "source": "s", "type": "t"}
    ]);
    let response = bus
        .post("/publish")
        .header("content-type", "application/cloudevents-batch+json")
        .body(batch.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.unwrap();
    let results = body["results"].as_array().unwrap();
    assert_eq!(results.len(), 3);
    assert_eq!(results[0]["status"], 409);
    assert_eq!(results[1]["status"], 400);
    assert_eq!(results[1]["field"], "id");
    assert_eq!(results[2]["status"], 409);
    assert_eq!(bus.stored_count().await, 0);

    let response = bus
        .post("/publish")
        .header("content-type", "application/cloudevents-batch+json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_refused(response, 400, None).await;
}

#[tokio::test]
async fn batch_over_the_event_count_limit_gets_413() {
    let nats = NatsServer::start().unwrap();
    let bus = Bus::start_with(nats, |args| args.max_batch_events = 2).await;
    let event = json!({"specversion": "1.0", "id": "1", "source": "s", "type": "t"});
    let response = bus
        .post("/publish")
        .header("content-type", "application/cloudevents-batch+json")
        .body(json!([event, event, event]).to_string())
        .send()
        .await
        .unwrap();
    assert_refused(response, 413, None).await;
}

#[tokio::test]
async fn legacy_events_are_stored_as_cloudevents() {
    let bus = Bus::start().await;
    let response = bus
        .post("/shop/v1/events")
        .json(
            &json!({"event-type": "order.created", "event-type-version": "v1", "event-id": "leg-1",
            "event-time": "2024-05-01T08:00:00Z", "data": {"sku": "A-1"}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.json::<Value>().await.unwrap(),
        json!({"event-id": "leg-1"})
    );
    // Stored twice, as Kyma's publisher proxy publishes it: as a CloudEvent, then in Kyma's
    // legacy form (its JetStream sender's `sap.kyma.custom.<app>.<event>.<version>`).
    assert_eq!(bus.stored_count().await, 2);
    let stored = bus.stored(1).await;
    assert_eq!(stored.subject.as_str(), "eddy.events.shop.order.created.v1");
    assert_eq!(header(&stored, "ce-type"), Some("order.created.v1"));
    assert_eq!(header(&stored, "ce-source"), Some("shop"));
    assert_eq!(header(&stored, "ce-time"), Some("2024-05-01T08:00:00Z"));
    assert_eq!(header(&stored, "content-type"), Some("application/json"));
    assert_eq!(header(&stored, "ce-eventtypeversion"), Some("v1"));
    assert_eq!(header(&stored, "ce-originaltype"), Some("order.created.v1"));
    assert_eq!(&stored.payload[..], br#"{"sku":"A-1"}"#);
    let copy = bus.stored(2).await;
    assert_eq!(
        copy.subject.as_str(),
        "eddy.events.shop.sap.kyma.custom.shop.order.created.v1"
    );
    assert_eq!(
        header(&copy, "ce-type"),
        Some("sap.kyma.custom.shop.order.created.v1")
    );
    assert_eq!(header(&copy, "ce-id"), Some("leg-1"));
    assert_eq!(
        header(&copy, "eddy-kyma-form-of"),
        Some("eddy.events.shop.order.created.v1")
    );
    assert_eq!(&copy.payload[..], br#"{"sku":"A-1"}"#);
    // A retried publish is stored once, both forms.
    let again = bus
        .post("/shop/v1/events")
        .json(
            &json!({"event-type": "order.created", "event-type-version": "v1", "event-id": "leg-1",
            "event-time": "2024-05-01T08:00:00Z", "data": {"sku": "A-1"}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 200);
    assert_eq!(bus.stored_count().await, 2);

    // Without an id, one is generated and returned.
    let response = bus
        .post("/shop/v1/events")
        .json(
            &json!({"event-type": "order.created", "event-type-version": "v1",
            "event-time": "2024-05-01T08:00:00Z", "data": 1}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let id = response.json::<Value>().await.unwrap()["event-id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(!id.is_empty());
    assert_eq!(header(&bus.last_stored().await, "ce-id"), Some(id.as_str()));
}

#[tokio::test]
async fn invalid_legacy_events_get_400_naming_the_field() {
    let bus = Bus::start().await;
    let response = bus
        .post("/shop/v1/events")
        .json(&json!({"event-type": "order.created", "event-time": "2024-05-01T08:00:00Z", "data": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["details"][0]["field"], "event-type-version", "{body}");
    assert_eq!(body["details"][0]["type"], "missing_field");
    assert_eq!(bus.stored_count().await, 0);
}

#[tokio::test]
async fn nats_down_gives_503_and_publishing_resumes_when_it_is_back() {
    let mut bus = Bus::start().await;
    let response = bus
        .binary("s", "before", "t")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204);

    bus.nats.kill();
    let readyz = format!("{}/readyz", bus.url);
    eventually(
        "readyz to report NATS down",
        Duration::from_secs(10),
        || async { bus.http.get(&readyz).send().await.unwrap().status() == 503 },
    )
    .await
    .unwrap();
    let response = bus
        .binary("s", "while-down", "t")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["retry-after"], "1");
    let legacy = bus
        .post("/shop/v1/events")
        .json(&json!({"event-type": "a", "event-type-version": "v1", "event-time": "2024-05-01T08:00:00Z", "data": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(legacy.status(), 503);

    bus.nats.restart().unwrap();
    bus.wait_ready().await;
    let response = bus
        .binary("s", "after", "t")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204);

    // The test's own client reconnects too; read what the restarted server has.
    let ids = eventually_ids(&bus).await;
    assert_eq!(ids, vec!["before".to_owned(), "after".to_owned()]);
}

async fn eventually_ids(bus: &Bus) -> Vec<String> {
    let mut ids = Vec::new();
    eventually(
        "the stream to be readable",
        Duration::from_secs(10),
        || async { bus.js.get_stream("EDDY_EVENTS").await.is_ok() },
    )
    .await
    .unwrap();
    let count = bus.stored_count().await;
    for sequence in 1..=count {
        ids.push(
            header(&bus.stored(sequence).await, "ce-id")
                .unwrap()
                .to_owned(),
        );
    }
    ids
}

#[tokio::test]
async fn a_full_store_refuses_with_503_and_keeps_what_it_has() {
    let nats = NatsServer::start().unwrap();
    let bus = Bus::start_with(nats, |args| {
        args.stream.max_bytes = bytesize::ByteSize::kib(16)
    })
    .await;
    let mut stored = 0;
    let mut refused = None;
    for i in 0..100 {
        let response = bus
            .binary("s", &format!("fill-{i}"), "t")
            .body("x".repeat(1024))
            .send()
            .await
            .unwrap();
        match response.status().as_u16() {
            204 => stored += 1,
            503 => {
                refused = Some(response);
                break;
            }
            other => panic!("unexpected status {other}"),
        }
    }
    let refused = refused.expect("the store never filled up");
    assert_eq!(refused.headers()["retry-after"], "1");
    assert!(stored > 0);
    assert_eq!(bus.stored_count().await, stored);
    assert_eq!(header(&bus.stored(1).await, "ce-id"), Some("fill-0"));
}

#[tokio::test]
async fn publisher_tokens_are_required_when_configured() {
    let nats = NatsServer::start().unwrap();
    let bus = Bus::start_with(nats, |args| args.tokens = vec!["s3cret".to_owned()]).await;
    let response = bus.binary("s", "1", "t").body("{}").send().await.unwrap();
    assert_eq!(response.status(), 401);
    assert_eq!(response.headers()["www-authenticate"], "Bearer");
    let response = bus
        .binary("s", "1", "t")
        .bearer_auth("wrong")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    let response = bus
        .post("/shop/v1/events")
        .json(&json!({"event-type": "a", "event-type-version": "v1", "event-time": "2024-05-01T08:00:00Z", "data": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    assert_eq!(bus.stored_count().await, 0);
    let response = bus
        .binary("s", "1", "t")
        .bearer_auth("s3cret")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204);
    // Probes stay open.
    assert_eq!(
        bus.http
            .get(format!("{}/healthz", bus.url))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
}

#[tokio::test]
async fn health_readiness_and_metrics() {
    let bus = Bus::start().await;
    assert_eq!(
        bus.http
            .get(format!("{}/healthz", bus.url))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        bus.http
            .get(format!("{}/readyz", bus.url))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    bus.binary("s", "1", "t")
        .body("{\"a\":1}")
        .send()
        .await
        .unwrap();
    bus.binary("s", "2", "t").send().await.unwrap();
    bus.post("/publish")
        .header("content-type", "text/plain")
        .body("x")
        .send()
        .await
        .unwrap();
    let response = bus
        .http
        .get(format!("{}/metrics", bus.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    for expected in [
        r#"eddy_bus_events_total{mode="binary",outcome="stored"} 2"#,
        r#"eddy_bus_events_total{mode="unknown",outcome="unsupported"} 1"#,
        r#"eddy_bus_request_duration_seconds_count{route="publish"} 3"#,
        r#"eddy_bus_received_bytes_total{route="publish"} 7"#,
        "eddy_bus_nats_connected 1",
    ] {
        assert!(text.contains(expected), "missing {expected} in\n{text}");
    }
}

#[tokio::test]
async fn an_existing_stream_is_brought_up_to_date() {
    let nats = NatsServer::start().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    js.create_stream(stream::Config {
        name: "EDDY_EVENTS".into(),
        subjects: vec!["eddy.events.>".into()],
        discard: DiscardPolicy::Old,
        max_age: Duration::from_secs(60),
        ..Default::default()
    })
    .await
    .unwrap();
    let bus = Bus::start_with(nats, |args| {
        args.stream.duplicate_window = Duration::from_secs(30)
    })
    .await;
    let mut stream = bus.js.get_stream("EDDY_EVENTS").await.unwrap();
    let config = stream.info().await.unwrap().config.clone();
    assert_eq!(config.discard, DiscardPolicy::New);
    assert_eq!(config.max_age, Duration::from_secs(7 * 24 * 3600));
    assert_eq!(config.duplicate_window, Duration::from_secs(30));
    assert_eq!(config.max_bytes, 1 << 30);
}

#[tokio::test]
async fn the_bus_starts_before_nats_and_becomes_ready_when_it_appears() {
    let mut nats = NatsServer::start().unwrap();
    nats.kill();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = eddy_platform::shutdown::CancellationToken::new();
    let bus = eddy_event_bus::EventBus::new(
        eddy_event_bus::Args::new(addr, nats.url()),
        shutdown.clone(),
    )
    .await
    .unwrap();
    tokio::spawn(bus.serve(listener));
    let http = reqwest::Client::new();
    let readyz = format!("http://{addr}/readyz");
    assert_eq!(http.get(&readyz).send().await.unwrap().status(), 503);
    nats.restart().unwrap();
    eventually(
        "readyz once NATS is up",
        Duration::from_secs(20),
        || async { http.get(&readyz).send().await.unwrap().status() == 200 },
    )
    .await
    .unwrap();
    shutdown.cancel();
}

#[tokio::test]
async fn events_stream_reports_a_store_too_small_for_it() {
    let nats = NatsServer::start_with_config("jetstream { max_file_store: 512MB }").unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let mut settings = eddy_platform::nats::StreamArgs::default();
    let error = eddy_platform::nats::ensure_stream(
        &js,
        eddy_platform::nats::events_stream_config(&settings),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(error, eddy_platform::Error::StreamStorage { ref stream, .. } if stream == "EDDY_EVENTS"),
        "{error:?}"
    );
    let message = error.to_string();
    for hint in [
        "1.0 GiB",
        "max_file_store",
        "--stream-max-bytes",
        "EDDY_STREAM_MAX_BYTES",
    ] {
        assert!(message.contains(hint), "no {hint:?} in: {message}");
    }
    // The remedy the message names works.
    settings.max_bytes = bytesize::ByteSize::mib(256);
    eddy_platform::nats::ensure_stream(&js, eddy_platform::nats::events_stream_config(&settings))
        .await
        .unwrap();
}

/// A structured batch of `count` events of 1 KiB data each, ids `{prefix}-{i}`.
fn kib_batch(prefix: &str, count: usize) -> String {
    let events: Vec<Value> = (0..count)
        .map(|i| {
            json!({"specversion": "1.0", "id": format!("{prefix}-{i}"), "source": "s",
                "type": "t", "data": "x".repeat(1024)})
        })
        .collect();
    Value::Array(events).to_string()
}

#[tokio::test]
async fn a_batch_stored_in_part_gets_207_and_one_stored_in_none_503() {
    let nats = NatsServer::start().unwrap();
    let bus = Bus::start_with(nats, |args| {
        args.stream.max_bytes = bytesize::ByteSize::kib(16)
    })
    .await;
    let response = bus
        .post("/publish")
        .header("content-type", "application/cloudevents-batch+json")
        .body(kib_batch("part", 30))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 207);
    assert_eq!(response.headers()["retry-after"], "1");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"], "some events were not stored");
    let results = body["results"].as_array().unwrap();
    assert_eq!(results.len(), 30, "{body}");
    // The store fills up part way: a run of stored events, then only refusals, each named.
    let stored = results.iter().take_while(|r| r["status"] == 204).count();
    assert!(stored > 0 && stored < 30, "{body}");
    for (i, result) in results.iter().enumerate() {
        assert_eq!(result["id"], format!("part-{i}"));
        assert_eq!(result["source"], "s");
        if i >= stored {
            assert_eq!(result["status"], 503, "{result}");
            assert!(result["error"].as_str().is_some_and(|e| !e.is_empty()));
        }
    }
    // Exactly the events answered 204 are in the stream, in order.
    assert_eq!(bus.stored_count().await, stored as u64);
    for sequence in 1..=stored as u64 {
        let expected = format!("part-{}", sequence - 1);
        assert_eq!(
            header(&bus.stored(sequence).await, "ce-id"),
            Some(expected.as_str())
        );
    }

    // The store is full now: nothing of the next batch is stored.
    let response = bus
        .post("/publish")
        .header("content-type", "application/cloudevents-batch+json")
        .body(kib_batch("none", 3))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["retry-after"], "1");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"], "no event was stored");
    let statuses: Vec<&Value> = body["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["status"])
        .collect();
    assert_eq!(statuses, vec![&json!(503); 3], "{body}");
    assert_eq!(bus.stored_count().await, stored as u64);
}

#[tokio::test]
async fn the_events_stream_is_created_again_when_it_is_gone() {
    let mut bus = Bus::start().await;
    let publish = |id: &'static str| bus.binary("s", id, "t").body("{}").send();
    assert_eq!(publish("first").await.unwrap().status(), 204);

    // Deleted under the running bus: the next publish is refused (not lost silently) and the
    // bus puts the stream back.
    bus.js.delete_stream("EDDY_EVENTS").await.unwrap();
    eventually(
        "a publish to be stored again after the stream was deleted",
        Duration::from_secs(20),
        || async { matches!(publish("after-delete").await, Ok(r) if r.status() == 204) },
    )
    .await
    .unwrap();
    assert_eq!(eventually_ids(&bus).await, vec!["after-delete".to_owned()]);

    // NATS comes back with an empty store (a new volume, a wiped disk).
    bus.nats.kill();
    std::fs::remove_dir_all(bus.nats.store_dir()).unwrap();
    bus.nats.restart().unwrap();
    eventually(
        "a publish to be stored on the NATS that came back empty",
        Duration::from_secs(30),
        || async {
            matches!(bus.binary("s", "after-restart", "t").body("{}").send().await,
                Ok(r) if r.status() == 204)
        },
    )
    .await
    .unwrap();
    assert_eq!(eventually_ids(&bus).await, vec!["after-restart".to_owned()]);
    let config = bus
        .js
        .get_stream("EDDY_EVENTS")
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    assert_eq!(
        config.discard,
        DiscardPolicy::New,
        "created with eddy's settings"
    );
}
