//! Delivery of subscribed events (docs/dispatcher.md), end to end through the event-bus, JetStream, the
//! controller API and the dispatcher, to HTTP sinks in the test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::{collections::HashSet, sync::Arc, time::Duration};

use axum::{http::StatusCode, response::IntoResponse};
use eddy_testing::eventually;
use serde_json::{Value, json};
use support::{Options, Platform, Sink};

fn unique(ids: &[String]) -> HashSet<&String> {
    ids.iter().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_reaches_every_matching_subscription_exactly_once() {
    let platform = Platform::start().await;
    let orders_created = Sink::ok().await;
    let all_orders = Sink::ok().await;
    platform
        .subscribe(
            "created",
            json!({"sink": orders_created.url, "types": ["order.created.v1"]}),
        )
        .await;
    platform
        .subscribe(
            "orders",
            json!({"sink": all_orders.url, "types": ["order.>"]}),
        )
        .await;

    for i in 0..50 {
        platform
            .publish(
                "shop",
                "order.created.v1",
                &format!("c-{i}"),
                json!({"n": i}),
            )
            .await;
    }
    for i in 0..20 {
        platform
            .publish("shop", "order.paid.v1", &format!("p-{i}"), json!({"n": i}))
            .await;
    }
    for i in 0..10 {
        platform
            .publish(
                "shop",
                "invoice.sent.v1",
                &format!("i-{i}"),
                json!({"n": i}),
            )
            .await;
    }
    platform.wait_settled("created").await;
    platform.wait_settled("orders").await;

    // The exact ids, each once: nothing missing, nothing extra, no duplicate.
    let sorted = |mut ids: Vec<String>| {
        ids.sort();
        ids
    };
    let ids =
        |prefix: &str, count: usize| sorted((0..count).map(|i| format!("{prefix}-{i}")).collect());
    assert_eq!(
        sorted(orders_created.ids()),
        ids("c", 50),
        "deliveries to the exact-type subscription"
    );
    let mut expected_orders = ids("c", 50);
    expected_orders.extend(ids("p", 20));
    assert_eq!(
        sorted(all_orders.ids()),
        sorted(expected_orders),
        "deliveries to the prefix subscription"
    );

    // The event arrives as a binary-mode CloudEvent with its data untouched.
    let first = orders_created
        .received()
        .into_iter()
        .find(|r| r.header("ce-id") == "c-7")
        .unwrap();
    assert_eq!(first.header("ce-type"), "order.created.v1");
    assert_eq!(first.header("ce-source"), "shop");
    assert_eq!(first.header("ce-specversion"), "1.0");
    assert_eq!(first.header("content-type"), "application/json");
    assert_eq!(
        serde_json::from_slice::<Value>(&first.body).unwrap(),
        json!({"n": 7})
    );

    let metrics = platform
        .http
        .get(format!("{}/metrics", platform.dispatcher))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains(r#"eddy_dispatcher_delivered_total{subscription="default/created"} 50"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"eddy_dispatcher_delivered_total{subscription="default/orders"} 70"#),
        "{metrics}"
    );
}

#[tokio::test]
async fn prefix_source_and_exact_filters_select_exactly_the_right_events() {
    let platform = Platform::start().await;
    let one_segment = Sink::ok().await;
    let exact = Sink::ok().await;
    platform
        .subscribe(
            "shop-orders",
            json!({"sink": one_segment.url, "types": ["order.*"], "source": "shop"}),
        )
        .await;
    platform
        .subscribe(
            "literal",
            json!({"sink": exact.url, "types": ["order.*"], "typeMatching": "exact"}),
        )
        .await;

    platform
        .publish("shop", "order.created", "match-1", json!({}))
        .await;
    platform
        .publish("shop", "order.paid", "match-2", json!({}))
        .await;
    platform
        .publish("billing", "order.created", "other-source", json!({}))
        .await;
    platform
        .publish("shop", "order.created.v1", "too-deep", json!({}))
        .await;
    platform
        .publish("shop", "orders.created", "other-prefix", json!({}))
        .await;
    platform
        .publish("shop", "order.*", "literal-star", json!({}))
        .await;
    platform.wait_settled("shop-orders").await;
    platform.wait_settled("literal").await;

    let mut got = one_segment.ids();
    got.sort();
    assert_eq!(got, vec!["literal-star", "match-1", "match-2"]);
    assert_eq!(exact.ids(), vec!["literal-star"]);

    let status = platform.subscription("shop-orders").await;
    assert_eq!(
        status["status"]["types"][0]["subject"],
        "eddy.events.shop.order.*"
    );
}

#[tokio::test]
async fn a_sink_that_fails_twice_gets_the_event_on_attempt_three() {
    let platform = Platform::start().await;
    let sink = Sink::start(
        Duration::ZERO,
        Arc::new(|_, attempt| {
            if attempt <= 2 {
                StatusCode::SERVICE_UNAVAILABLE.into_response()
            } else {
                StatusCode::OK.into_response()
            }
        }),
    )
    .await;
    platform
        .subscribe(
            "flaky",
            json!({"sink": sink.url, "types": ["order.created.v1"],
                "delivery": {"maxAttempts": 5, "backoff": "exponential", "initialDelay": "300ms", "maxDelay": "600ms"}}),
        )
        .await;
    platform
        .publish("shop", "order.created.v1", "retry-me", json!({}))
        .await;
    platform.wait_settled("flaky").await;
    assert_eq!(sink.attempts("retry-me"), 3);
    // The backoff is applied between attempts: 300 ms, then 600 ms (exponential, capped).
    let arrivals: Vec<std::time::Instant> = sink.received().iter().map(|r| r.at).collect();
    let gaps: Vec<Duration> = arrivals.windows(2).map(|pair| pair[1] - pair[0]).collect();
    assert!(
        gaps[0] >= Duration::from_millis(300) && gaps[1] >= Duration::from_millis(600),
        "the waits between attempts were {gaps:?}"
    );
    assert!(platform.dead_letters("flaky").await.is_empty());
    let counts = subscription_counts(&platform, "flaky").await;
    assert_eq!(counts["delivered"], 1);
    assert_eq!(counts["retried"], 2);
}

async fn subscription_counts(platform: &Platform, name: &str) -> Value {
    let body: Value = platform
        .http
        .get(format!("{}/subscriptions", platform.dispatcher))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    body["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|item| item["name"] == name)
        .unwrap()["counts"]
        .clone()
}

#[tokio::test]
async fn a_sink_that_always_fails_sends_the_event_to_dead_letters_after_max_attempts() {
    let platform = Platform::start().await;
    let sink = Sink::answering(StatusCode::INTERNAL_SERVER_ERROR).await;
    platform
        .subscribe(
            "broken",
            json!({"sink": sink.url, "types": ["order.created.v1"],
                "delivery": {"maxAttempts": 3, "initialDelay": "50ms", "maxDelay": "100ms"}}),
        )
        .await;
    platform
        .publish("shop", "order.created.v1", "doomed", json!({"x": 1}))
        .await;
    platform.wait_settled("broken").await;
    assert_eq!(sink.attempts("doomed"), 3);

    let letters = platform.dead_letters("broken").await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    let letter = &letters[0];
    assert_eq!(letter["reason"], "http_5xx");
    assert_eq!(letter["status"], 500);
    assert_eq!(letter["attempts"], 3);
    assert_eq!(letter["subscription"], "default/broken");
    assert_eq!(letter["id"], "doomed");
    assert_eq!(letter["streamSequence"], 1);

    // The stored dead letter keeps the event and carries the reason headers.
    let stream = platform.js.get_stream("EDDY_DEAD_LETTERS").await.unwrap();
    let stored = stream
        .get_raw_message(letter["sequence"].as_u64().unwrap())
        .await
        .unwrap();
    assert_eq!(stored.subject.as_str(), "eddy.dlq.default.broken");
    assert_eq!(
        serde_json::from_slice::<Value>(&stored.payload).unwrap(),
        json!({"x": 1})
    );
    for (name, value) in [
        ("eddy-dlq-reason", "http_5xx"),
        ("eddy-dlq-status", "500"),
        ("eddy-dlq-attempts", "3"),
        ("eddy-dlq-subscription", "default/broken"),
        ("eddy-dlq-stream-seq", "1"),
        ("ce-id", "doomed"),
    ] {
        assert_eq!(
            stored.headers.get(name).map(|v| v.as_str()),
            Some(value),
            "{name}"
        );
    }
}

#[tokio::test]
async fn a_permanent_4xx_goes_to_dead_letters_at_once() {
    let platform = Platform::start().await;
    let sink = Sink::answering(StatusCode::BAD_REQUEST).await;
    platform
        .subscribe("picky", json!({"sink": sink.url, "types": ["order.created.v1"], "delivery": {"maxAttempts": 5}}))
        .await;
    platform
        .publish("shop", "order.created.v1", "rejected", json!({}))
        .await;
    platform.wait_settled("picky").await;
    assert_eq!(sink.attempts("rejected"), 1);
    let letters = platform.dead_letters("picky").await;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0]["reason"], "http_4xx");
    assert_eq!(letters[0]["status"], 400);
    assert_eq!(letters[0]["attempts"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_more_than_max_in_flight_deliveries_to_one_subscription() {
    let platform = Platform::start().await;
    let sink = Sink::start(
        Duration::from_millis(150),
        Arc::new(|_, _| StatusCode::OK.into_response()),
    )
    .await;
    platform
        .subscribe(
            "slow",
            json!({"sink": sink.url, "types": ["job.v1"], "config": {"maxInFlightMessages": "3"}}),
        )
        .await;
    for i in 0..15 {
        platform
            .publish("batch", "job.v1", &format!("job-{i}"), json!({}))
            .await;
    }
    platform.wait_settled("slow").await;
    assert_eq!(sink.count(), 15);
    assert_eq!(
        sink.max_in_flight(),
        3,
        "the limit is used, and never exceeded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_delivery_is_kept_alive_by_in_progress_acks() {
    // Ack wait 3 s, a sink that takes 7 s (over two ack waits): without in-progress acks
    // JetStream would redeliver. In-progress acks go every second (a third of the ack wait), so
    // a loaded machine has two seconds of slack before a late one would count as a redelivery.
    let platform = Platform::start_with(Options {
        ack_wait: Duration::from_secs(3),
        ..Options::default()
    })
    .await;
    let sink = Sink::start(
        Duration::from_secs(7),
        Arc::new(|_, _| StatusCode::OK.into_response()),
    )
    .await;
    platform
        .subscribe(
            "patient",
            json!({"sink": sink.url, "types": ["slow.v1"], "delivery": {"timeout": "10s"}}),
        )
        .await;
    platform.publish("s", "slow.v1", "slow-1", json!({})).await;
    platform.wait_settled("patient").await;
    assert_eq!(sink.attempts("slow-1"), 1);
    assert_eq!(sink.overlaps(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_over_its_timeout_is_retried() {
    let platform = Platform::start().await;
    let sink = Sink::start(
        Duration::from_millis(600),
        Arc::new(|_, _| StatusCode::OK.into_response()),
    )
    .await;
    platform
        .subscribe(
            "impatient",
            json!({"sink": sink.url, "types": ["slow.v1"],
                "delivery": {"timeout": "200ms", "maxAttempts": 2, "initialDelay": "50ms"}}),
        )
        .await;
    platform
        .publish("s", "slow.v1", "too-slow", json!({}))
        .await;
    platform.wait_settled("impatient").await;
    let letters = platform.dead_letters("impatient").await;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0]["reason"], "timeout");
    assert_eq!(letters[0]["attempts"], 2);
}

#[tokio::test]
async fn a_reply_event_triggers_the_subscription_for_its_type() {
    let platform = Platform::start().await;
    let replier = Sink::start(
        Duration::ZERO,
        Arc::new(|received, _| {
            let id = format!("reply-to-{}", received.header("ce-id"));
            (
                StatusCode::OK,
                [
                    ("ce-specversion", "1.0"),
                    ("ce-id", id.as_str()),
                    ("ce-source", "stock-service"),
                    ("ce-type", "stock.reserved.v1"),
                    ("content-type", "application/json"),
                ],
                r#"{"reserved":true}"#,
            )
                .into_response()
        }),
    )
    .await;
    let recorder = Sink::ok().await;
    platform
        .subscribe(
            "reserve",
            json!({"sink": replier.url, "types": ["order.created.v1"]}),
        )
        .await;
    platform
        .subscribe(
            "record",
            json!({"sink": recorder.url, "types": ["stock.reserved.v1"]}),
        )
        .await;

    platform
        .publish("shop", "order.created.v1", "o-1", json!({"sku": "A"}))
        .await;
    recorder.wait_for(1).await;
    let reply = &recorder.received()[0];
    assert_eq!(reply.header("ce-id"), "reply-to-o-1");
    assert_eq!(reply.header("ce-source"), "stock-service");
    assert_eq!(
        serde_json::from_slice::<Value>(&reply.body).unwrap(),
        json!({"reserved": true})
    );
}

/// A function's reply event is stored by the dispatcher exactly as the event-bus stores the same
/// event published to it (same subject, message id, headers and data, byte for byte), in binary
/// and structured mode, with the trace context of the event it answers.
#[tokio::test]
async fn a_reply_is_stored_exactly_as_the_event_bus_stores_it() {
    const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let binary: (Vec<(&str, &str)>, &str) = (
        vec![
            ("ce-specversion", "1.0"),
            ("ce-id", "r-1"),
            ("ce-source", "stock-service"),
            ("ce-type", "stock.binary.v1"),
            ("ce-time", "2026-01-01T00:00:00Z"),
            ("ce-subject", "sku%20A%25"),
            ("ce-partition", "7"),
            ("content-type", "text/plain; charset=utf-8"),
        ],
        "reserved: 1",
    );
    let structured: (Vec<(&str, &str)>, &str) = (
        vec![("content-type", "application/cloudevents+json")],
        r#"{"specversion":"1.0","id":"r-2","source":"stock-service","type":"stock.structured.v1",
            "time":"2026-01-01T01:00:00+01:00","subject":"sku A","partition":7,"urgent":true,
            "data":{"b":1, "a":[2, 3.50]}}"#,
    );
    let replies = Arc::new([binary, structured]);

    let platform = Platform::start().await;
    let answers = replies.clone();
    let replier = Sink::start(
        Duration::ZERO,
        Arc::new(move |received, _| {
            let index = usize::from(received.header("ce-id") == "t-1");
            let (headers, body) = &answers[index];
            let mut response = (*body).into_response();
            for (name, value) in headers {
                response.headers_mut().insert(*name, value.parse().unwrap());
            }
            response
        }),
    )
    .await;
    platform
        .subscribe(
            "reserve",
            json!({"sink": replier.url, "types": ["order.created.v1"]}),
        )
        .await;
    for id in ["t-0", "t-1"] {
        let response = platform
            .http
            .post(format!("{}/publish", platform.bus))
            .header("ce-specversion", "1.0")
            .header("ce-id", id)
            .header("ce-source", "shop")
            .header("ce-type", "order.created.v1")
            .header("traceparent", TRACEPARENT)
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 204);
    }

    // The same events, published to a second platform's event-bus with the same trace context.
    let direct = Platform::start_with(Options {
        dispatcher: false,
        ..Options::default()
    })
    .await;
    for (headers, body) in replies.iter() {
        let mut request = direct
            .http
            .post(format!("{}/publish", direct.bus))
            .header("traceparent", TRACEPARENT)
            .body(*body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 204, "{}", response.text().await.unwrap());
    }

    let stored = |platform: &Platform, subject: &'static str| {
        let js = platform.js.clone();
        async move {
            let stream = js.get_stream("EDDY_EVENTS").await.ok()?;
            let message = stream.get_last_raw_message_by_subject(subject).await.ok()?;
            let mut headers: Vec<(String, Vec<String>)> = message
                .headers
                .iter()
                .map(|(name, values)| {
                    let name: &str = name.as_ref();
                    let values = values.iter().map(|v| v.as_str().to_owned()).collect();
                    (name.to_owned(), values)
                })
                .collect();
            headers.sort();
            Some((message.subject.to_string(), headers, message.payload))
        }
    };
    for subject in [
        "eddy.events.stock-service.stock.binary.v1",
        "eddy.events.stock-service.stock.structured.v1",
    ] {
        let reply = || async { stored(&platform, subject).await.is_some() };
        eventually("the reply stored", Duration::from_secs(20), reply)
            .await
            .unwrap();
        let from_dispatcher = stored(&platform, subject)
            .await
            .expect("stored by the dispatcher");
        let from_bus = stored(&direct, subject)
            .await
            .expect("stored by the event-bus");
        assert_eq!(from_dispatcher, from_bus, "{subject}");
        let headers = &from_bus.1;
        assert!(
            headers.contains(&("traceparent".to_owned(), vec![TRACEPARENT.to_owned()])),
            "{headers:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_dispatchers_share_the_work_and_never_hold_one_event_twice() {
    let platform = Platform::start().await;
    let second = platform.start_dispatcher(Duration::from_secs(30)).await;
    let sink = Sink::start(
        Duration::from_millis(20),
        Arc::new(|_, _| StatusCode::OK.into_response()),
    )
    .await;
    platform
        .subscribe(
            "shared",
            json!({"sink": sink.url, "types": ["work.v1"], "config": {"maxInFlightMessages": 8}}),
        )
        .await;
    for i in 0..120 {
        platform
            .publish("s", "work.v1", &format!("w-{i}"), json!({}))
            .await;
    }
    platform.wait_settled("shared").await;
    let ids = sink.ids();
    assert_eq!(ids.len(), 120);
    assert_eq!(unique(&ids).len(), 120);
    assert_eq!(sink.overlaps(), 0);
    assert!(sink.max_in_flight() <= 8);

    let delivered = |body: Value| {
        body["items"][0]["counts"]["delivered"]
            .as_u64()
            .unwrap_or(0)
    };
    let first: Value = platform
        .http
        .get(format!("{}/subscriptions", platform.dispatcher))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let other: Value = platform
        .http
        .get(format!("{second}/subscriptions"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let (a, b) = (delivered(first), delivered(other));
    println!("dispatcher 1 delivered {a}, dispatcher 2 delivered {b}");
    assert_eq!(a + b, 120);
    assert!(a > 0 && b > 0, "both dispatchers took part: {a} and {b}");
}

#[tokio::test]
async fn consumers_follow_their_subscription_and_survive_restarts() {
    let platform = Platform::start().await;
    let sink = Sink::ok().await;
    platform
        .subscribe("life", json!({"sink": sink.url, "types": ["a.v1"]}))
        .await;
    let info = platform.consumer_info("life").await.unwrap();
    assert_eq!(
        info.config.filter_subjects,
        vec!["eddy.events.*.a.v1".to_owned()]
    );
    assert_eq!(info.config.max_ack_pending, 10);
    platform
        .publish("s", "a.v1", "before-update", json!({}))
        .await;
    platform.wait_settled("life").await;

    // Updated in place: new filters and limits, same consumer, position kept.
    let (status, body) = platform
        .put_subscription("life", json!({"sink": sink.url, "types": ["a.v1", "b.v1"], "config": {"maxInFlightMessages": 4}}))
        .await;
    assert_eq!(status, 200, "{body}");
    eventually(
        "the consumer to be updated",
        Duration::from_secs(20),
        || async {
            platform
                .consumer_info("life")
                .await
                .is_some_and(|info| info.config.filter_subjects.len() == 2)
        },
    )
    .await
    .unwrap();
    let updated = platform.consumer_info("life").await.unwrap();
    assert_eq!(updated.config.max_ack_pending, 4);
    assert_eq!(updated.created, info.created);
    platform
        .publish("s", "b.v1", "after-update", json!({}))
        .await;
    platform.wait_settled("life").await;
    assert_eq!(sink.ids(), vec!["before-update", "after-update"]);

    // A new dispatcher after the old one stopped picks up where it left off.
    platform.stop_dispatchers();
    platform.publish("s", "a.v1", "while-down", json!({})).await;
    let restarted = platform.start_dispatcher(Duration::from_secs(30)).await;
    platform.wait_settled("life").await;
    assert_eq!(
        sink.ids(),
        vec!["before-update", "after-update", "while-down"]
    );
    let _ = restarted;

    // Deleting the Subscription deletes its consumer.
    platform.delete_subscription("life").await;
    eventually(
        "the consumer to be deleted",
        Duration::from_secs(20),
        || async { platform.consumer_info("life").await.is_none() },
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn invalid_subscriptions_are_refused_naming_the_field() {
    let platform = Platform::start().await;
    let (status, body) = platform
        .put_subscription(
            "bad",
            json!({"sink": "http://169.254.169.254/latest", "types": ["a..b"]}),
        )
        .await;
    assert_eq!(status, 422);
    assert_eq!(body["kind"], "Status");
    assert_eq!(body["reason"], "Invalid");
    let fields: Vec<&str> = body["details"]["causes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["field"].as_str().unwrap())
        .collect();
    assert_eq!(fields, vec!["spec.types[0]", "spec.sink"]);
    let (status, body) = platform
        .put_subscription(
            "typo",
            json!({"sink": "http://127.0.0.1:1/", "type": ["a"]}),
        )
        .await;
    assert_eq!(status, 422);
    assert!(body["message"].as_str().unwrap().contains("type"), "{body}");
    let response = platform
        .http
        .get(format!(
            "{}/apis/eddy.dev/v1alpha1/namespaces/default/subscriptions/bad",
            platform.api
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
}

#[tokio::test]
async fn dead_letters_can_be_redriven_and_events_replayed() {
    let platform = Platform::start().await;
    let (sink, healthy) = Sink::switchable(StatusCode::INTERNAL_SERVER_ERROR).await;
    let bystander = Sink::ok().await;
    platform
        .subscribe(
            "redo",
            json!({"sink": sink.url, "types": ["r.v1"], "delivery": {"maxAttempts": 1}}),
        )
        .await;
    platform
        .subscribe(
            "bystander",
            json!({"sink": bystander.url, "types": ["r.v1"]}),
        )
        .await;
    for i in 0..3 {
        platform
            .publish("s", "r.v1", &format!("r-{i}"), json!({}))
            .await;
    }
    platform.wait_settled("redo").await;
    platform.wait_settled("bystander").await;
    let ids = |sink: &Sink, from: usize| {
        let mut ids: Vec<String> = sink.ids().into_iter().skip(from).collect();
        ids.sort();
        ids
    };
    let all = ["r-0", "r-1", "r-2"].map(str::to_owned).to_vec();
    let mut lettered: Vec<String> = platform
        .dead_letters("redo")
        .await
        .iter()
        .map(|letter| letter["id"].as_str().unwrap().to_owned())
        .collect();
    lettered.sort();
    assert_eq!(lettered, all, "each failed event is a dead letter, once");
    assert_eq!(ids(&sink, 0), all, "one attempt each");

    healthy.store(true, std::sync::atomic::Ordering::SeqCst);
    let outcome: Value = platform
        .http
        .post(format!(
            "{}/subscriptions/default/redo/redrive",
            platform.dispatcher
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(outcome, json!({"delivered": 3, "failed": 0}));
    assert!(platform.dead_letters("redo").await.is_empty());
    assert_eq!(
        ids(&sink, 3),
        all,
        "the redrive delivered each dead letter once"
    );

    // Replay from the first event: the one subscription gets all three again, no other does.
    let response = platform
        .http
        .post(format!(
            "{}/subscriptions/default/redo/replay",
            platform.dispatcher
        ))
        .json(&json!({"fromSeq": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202);
    assert_eq!(response.json::<Value>().await.unwrap()["events"], 3);
    sink.wait_for(9).await;
    eventually(
        "the replay consumer to be removed",
        Duration::from_secs(20),
        || async {
            let stream = platform.js.get_stream("EDDY_EVENTS").await.unwrap();
            stream.consumer_info("replay_default_redo").await.is_err()
        },
    )
    .await
    .unwrap();
    assert_eq!(ids(&sink, 6), all, "the replay delivered each event once");
    assert_eq!(
        ids(&bystander, 0),
        all,
        "the other subscription got no replay"
    );
}

/// A sink's redirect is not followed: the event is dead-lettered as `http_3xx` and the place the
/// redirect names receives nothing.
#[tokio::test]
async fn redirects_are_not_followed() {
    let platform = Platform::start().await;
    let elsewhere = Sink::ok().await;
    let location = elsewhere.url.clone();
    let redirecting = Sink::start(
        Duration::ZERO,
        Arc::new(move |_, _| {
            (
                StatusCode::FOUND,
                [("location", location.as_str())],
                "moved",
            )
                .into_response()
        }),
    )
    .await;
    platform
        .subscribe(
            "bounced",
            json!({"sink": redirecting.url, "types": ["order.created.v1"]}),
        )
        .await;
    platform
        .publish("shop", "order.created.v1", "r-1", json!({}))
        .await;
    platform.wait_settled("bounced").await;
    let letters = platform.dead_letters("bounced").await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0]["reason"], "http_3xx");
    assert_eq!(letters[0]["status"], 302);
    assert_eq!(redirecting.count(), 1);
    assert_eq!(elsewhere.count(), 0, "the redirect was followed");
}

/// A reply that is not a valid event is dropped, counted as `reply_refused`, and the event it
/// answers is delivered (acked, not retried); the delivery metrics say so.
#[tokio::test]
async fn an_invalid_reply_is_refused_counted_and_the_event_still_delivered() {
    let platform = Platform::start().await;
    // Binary mode without ce-type: not a valid CloudEvent.
    let replier = replying_sink(&[
        ("ce-specversion", "1.0"),
        ("ce-id", "broken-reply"),
        ("ce-source", "stock-service"),
    ])
    .await;
    platform
        .subscribe(
            "answers",
            json!({"sink": replier.url, "types": ["order.created.v1"]}),
        )
        .await;
    platform
        .publish("shop", "order.created.v1", "q-1", json!({}))
        .await;
    platform.wait_settled("answers").await;
    assert_eq!(replier.attempts("q-1"), 1, "delivered once, not retried");
    assert!(platform.dead_letters("answers").await.is_empty());
    // The gauges follow on the worker's next look at its consumer: poll for them.
    let expected = [
        (
            "eddy_dispatcher_failures_total{subscription=\"default/answers\",reason=\"reply_refused\"}",
            1.0,
        ),
        (
            "eddy_dispatcher_delivered_total{subscription=\"default/answers\"}",
            1.0,
        ),
        (
            "eddy_dispatcher_pending_events{subscription=\"default/answers\"}",
            0.0,
        ),
        (
            "eddy_dispatcher_in_flight{subscription=\"default/answers\"}",
            0.0,
        ),
    ];
    eventually(
        "the metrics to show the refused reply",
        Duration::from_secs(20),
        || async {
            for (sample, value) in expected {
                if metric(&platform, sample).await != Some(value) {
                    return false;
                }
            }
            true
        },
    )
    .await
    .unwrap();
    // Nothing from the broken reply reached the stream: it holds the one published event.
    let mut stream = platform.js.get_stream("EDDY_EVENTS").await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 1);
}

/// A reply over `--max-reply-size` (1 MiB) is not stored: counted as `reply_too_large`, and
/// the event it answers is delivered (acked, not retried).
#[tokio::test]
async fn a_reply_over_the_size_limit_is_counted_and_the_event_still_delivered() {
    let platform = Platform::start().await;
    let replier = Sink::start(
        Duration::ZERO,
        Arc::new(|_, _| {
            (
                StatusCode::OK,
                [
                    ("ce-specversion", "1.0"),
                    ("ce-id", "huge-reply"),
                    ("ce-source", "stock-service"),
                    ("ce-type", "stock.reserved.v1"),
                    ("content-type", "application/json"),
                ],
                format!("\"{}\"", "x".repeat(2 * 1024 * 1024)),
            )
                .into_response()
        }),
    )
    .await;
    platform
        .subscribe(
            "big-answers",
            json!({"sink": replier.url, "types": ["order.created.v1"]}),
        )
        .await;
    platform
        .publish("shop", "order.created.v1", "q-2", json!({}))
        .await;
    platform.wait_settled("big-answers").await;
    assert_eq!(replier.attempts("q-2"), 1, "delivered once, not retried");
    assert!(platform.dead_letters("big-answers").await.is_empty());
    eventually("the oversized reply to be counted", Duration::from_secs(20), || async {
        metric(
            &platform,
            "eddy_dispatcher_failures_total{subscription=\"default/big-answers\",reason=\"reply_too_large\"}",
        )
        .await
            == Some(1.0)
    })
    .await
    .unwrap();
    let mut stream = platform.js.get_stream("EDDY_EVENTS").await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().state.messages,
        1,
        "the reply was not stored"
    );
}

/// A new Subscription sees events published after it exists, not the ones stored before
/// (its consumer starts at its creation; `eddy replay` is how to get older ones).
#[tokio::test]
async fn a_new_subscription_starts_with_new_events() {
    let platform = Platform::start().await;
    platform
        .publish("shop", "order.created.v1", "before", json!({}))
        .await;
    // A Subscription starts at its creationTimestamp, which has whole seconds: an event of the
    // same second would be its first. Create it in a later second.
    let published = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    eventually("the next second", Duration::from_secs(3), || async {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            > published
    })
    .await
    .unwrap();
    let sink = Sink::ok().await;
    platform
        .subscribe(
            "latecomer",
            json!({"sink": sink.url, "types": ["order.created.v1"]}),
        )
        .await;
    platform
        .publish("shop", "order.created.v1", "after", json!({}))
        .await;
    sink.wait_for(1).await;
    platform.wait_settled("latecomer").await;
    assert_eq!(sink.ids(), vec!["after"]);
}

/// A sink that answers every event 200 with `headers` and `{}`: a reply event when the
/// headers make one.
async fn replying_sink(headers: &'static [(&'static str, &'static str)]) -> Sink {
    Sink::start(
        Duration::ZERO,
        Arc::new(move |_, _| {
            let mut response = (StatusCode::OK, "{}").into_response();
            for (name, value) in headers {
                response.headers_mut().insert(
                    axum::http::HeaderName::from_static(name),
                    axum::http::HeaderValue::from_static(value),
                );
            }
            response
        }),
    )
    .await
}

/// The value of one sample in the dispatcher's `/metrics`, if it is there.
async fn metric(platform: &Platform, sample: &str) -> Option<f64> {
    metric_at(platform, &platform.dispatcher, sample).await
}

/// [`metric`] of the dispatcher whose admin API is at `dispatcher`.
async fn metric_at(platform: &Platform, dispatcher: &str, sample: &str) -> Option<f64> {
    let metrics = platform.get_text(&format!("{dispatcher}/metrics")).await;
    metrics.lines().find_map(|line| {
        let value = line.strip_prefix(sample)?.strip_prefix(' ')?;
        value.parse().ok()
    })
}

/// Sets a stream's message limit (`-1`: none); its discard policy is "new", so a full stream
/// refuses what comes next.
async fn limit_messages(platform: &Platform, stream: &str, max_messages: i64) {
    let mut config = platform
        .js
        .get_stream(stream)
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    assert_eq!(
        config.discard,
        async_nats::jetstream::stream::DiscardPolicy::New
    );
    config.max_messages = max_messages;
    platform.js.update_stream(config).await.unwrap();
}

async fn stored_ids(platform: &Platform, stream: &str) -> Vec<String> {
    let mut stream = platform.js.get_stream(stream).await.unwrap();
    let state = stream.info().await.unwrap().state.clone();
    let mut ids = Vec::new();
    for sequence in state.first_sequence..=state.last_sequence {
        if let Ok(message) = stream.get_raw_message(sequence).await {
            ids.push(
                message
                    .headers
                    .get("ce-id")
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default(),
            );
        }
    }
    ids
}

/// A reply JetStream does not store (here: the events stream is full) is not dropped: the
/// delivery is retried, the failure counted, and the reply stored once the stream takes it.
#[tokio::test]
async fn a_reply_that_is_not_stored_retries_the_delivery_until_it_is() {
    let platform = Platform::start().await;
    let replier = replying_sink(&[
        ("ce-specversion", "1.0"),
        ("ce-id", "reserved-1"),
        ("ce-source", "stock-service"),
        ("ce-type", "stock.reserved.v1"),
        ("content-type", "application/json"),
    ])
    .await;
    platform
        .subscribe(
            "answers",
            json!({"sink": replier.url, "types": ["order.created.v1"],
                "delivery": {"maxAttempts": 100, "initialDelay": "50ms", "maxDelay": "100ms"}}),
        )
        .await;
    // Room for the event, none for its reply.
    limit_messages(&platform, "EDDY_EVENTS", 1).await;
    platform
        .publish("shop", "order.created.v1", "q-1", json!({}))
        .await;
    let not_stored = "eddy_dispatcher_failures_total{subscription=\"default/answers\",reason=\"reply_not_stored\"}";
    eventually(
        "the delivery to be retried for its unstored reply",
        Duration::from_secs(30),
        || async {
            replier.attempts("q-1") >= 3 && metric(&platform, not_stored).await >= Some(2.0)
        },
    )
    .await
    .unwrap();
    assert_eq!(stored_ids(&platform, "EDDY_EVENTS").await, vec!["q-1"]);
    assert!(platform.dead_letters("answers").await.is_empty());

    limit_messages(&platform, "EDDY_EVENTS", -1).await;
    platform.wait_settled("answers").await;
    assert_eq!(
        stored_ids(&platform, "EDDY_EVENTS").await,
        vec!["q-1", "reserved-1"]
    );
    assert!(platform.dead_letters("answers").await.is_empty());
    assert_eq!(
        metric(
            &platform,
            "eddy_dispatcher_delivered_total{subscription=\"default/answers\"}"
        )
        .await,
        Some(1.0)
    );
}

/// When the dead letter cannot be written (here: the dead-letter stream is full) the event is
/// not acknowledged: it stays in the events stream, comes back, and is dead-lettered once the
/// stream takes it. The failure is counted.
#[tokio::test]
async fn an_event_whose_dead_letter_cannot_be_written_is_kept() {
    let platform = Platform::start().await;
    let sink = Sink::answering(StatusCode::BAD_REQUEST).await;
    platform
        .subscribe(
            "picky",
            json!({"sink": sink.url, "types": ["order.created.v1"], "delivery": {"maxAttempts": 3}}),
        )
        .await;
    // Fill the dead-letter stream: one message of another subscription, and a limit of one.
    platform
        .js
        .publish(
            eddy_model::subject::dead_letter_subject("default", "other"),
            "filler".into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    limit_messages(&platform, "EDDY_DEAD_LETTERS", 1).await;
    platform
        .publish("shop", "order.created.v1", "rejected", json!({}))
        .await;
    let unavailable = "eddy_dispatcher_failures_total{subscription=\"default/picky\",reason=\"dead_letter_unavailable\"}";
    eventually(
        "the failed dead-letter write to be counted and tried again",
        Duration::from_secs(30),
        || async { metric(&platform, unavailable).await >= Some(2.0) },
    )
    .await
    .unwrap();
    let info = platform.consumer_info("picky").await.unwrap();
    assert_eq!(
        info.num_pending + info.num_ack_pending as u64,
        1,
        "the event is not acknowledged: {info:?}"
    );
    assert!(platform.dead_letters("picky").await.is_empty());

    limit_messages(&platform, "EDDY_DEAD_LETTERS", -1).await;
    platform.wait_settled("picky").await;
    let letters = platform.dead_letters("picky").await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0]["id"], "rejected");
    assert_eq!(letters[0]["reason"], "http_4xx");
}

/// A Subscription whose consumer was lost (deleted by hand, or by another dispatcher's sweep
/// that listed before the Subscription existed) gets it back from the Subscription's creation:
/// the event published while there was no consumer is delivered, not skipped.
#[tokio::test]
async fn a_lost_consumer_is_created_again_from_the_subscriptions_creation() {
    let platform = Platform::start_with(Options {
        dispatcher: false,
        ..Options::default()
    })
    .await;
    let sink = Sink::ok().await;
    let (status, body) = platform
        .put_subscription(
            "late",
            json!({"sink": sink.url, "types": ["order.created.v1"]}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    let mut dispatcher = platform.spawn_dispatcher("30s").await;
    platform.wait_subscription_ready("late").await;
    platform
        .publish("shop", "order.created.v1", "before", json!({}))
        .await;
    sink.wait_for(1).await;
    platform.wait_settled("late").await;
    dispatcher.child.kill().await.unwrap();
    let stream = platform.js.get_stream("EDDY_EVENTS").await.unwrap();
    stream.delete_consumer("sub_default_late").await.unwrap();
    platform
        .publish("shop", "order.created.v1", "while-lost", json!({}))
        .await;
    let _dispatcher = platform.spawn_dispatcher("30s").await;
    eventually(
        "the event published while the consumer was lost",
        Duration::from_secs(20),
        || async { sink.ids().contains(&"while-lost".to_owned()) },
    )
    .await
    .unwrap();
}

/// A consumer whose Subscription was deleted while no dispatcher ran is removed when one
/// starts; its other consumers and the ones eddy does not own are left alone.
#[tokio::test]
async fn consumers_of_deleted_subscriptions_are_removed_at_start() {
    use async_nats::jetstream::consumer::pull;
    use futures::StreamExt as _;
    let platform = Platform::start_with(Options {
        dispatcher: false,
        ..Options::default()
    })
    .await;
    let sink = Sink::ok().await;
    let (status, body) = platform
        .put_subscription(
            "kept",
            json!({"sink": sink.url, "types": ["order.created.v1"]}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    let stream = platform.js.get_stream("EDDY_EVENTS").await.unwrap();
    for name in ["sub_default_gone", "audit-tool"] {
        stream
            .create_consumer(pull::Config {
                durable_name: Some(name.to_owned()),
                ..Default::default()
            })
            .await
            .unwrap();
    }

    let dispatcher = platform.start_dispatcher(Duration::from_secs(30)).await;
    let names = || async {
        let mut names: Vec<String> = platform
            .js
            .get_stream("EDDY_EVENTS")
            .await
            .unwrap()
            .consumer_names()
            .map(|name| name.unwrap())
            .collect()
            .await;
        names.sort();
        names
    };
    eventually(
        "the orphan consumer to be removed",
        Duration::from_secs(20),
        || async { !names().await.contains(&"sub_default_gone".to_owned()) },
    )
    .await
    .unwrap();
    assert_eq!(names().await, vec!["audit-tool", "sub_default_kept"]);
    // The kept Subscription still delivers.
    platform
        .publish("shop", "order.created.v1", "o-1", json!({}))
        .await;
    sink.wait_for(1).await;
    assert_eq!(sink.ids(), vec!["o-1"]);
    drop(dispatcher);
}

/// Serves HTTPS on loopback with `pki`'s server certificate; records each request's `ce-id`
/// and path. Returns the port.
async fn tls_sink(
    pki: &eddy_testing::pki::Pki,
    received: Arc<std::sync::Mutex<Vec<(String, String)>>>,
) -> u16 {
    let app = axum::Router::new().fallback(move |request: axum::extract::Request| {
        let id = request
            .headers()
            .get("ce-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        received
            .lock()
            .unwrap()
            .push((id, request.uri().path().to_owned()));
        async {}
    });
    eddy_testing::pki::serve_tls(pki, "127.0.0.1", app)
        .await
        .port()
}

/// An `https://` sink (allowed by the sink policy) gets its events over TLS, its certificate
/// checked against the system's CA roots, here the test CA named by `SSL_CERT_FILE`.
#[tokio::test(flavor = "multi_thread")]
async fn https_sinks_get_their_events_over_tls() {
    let platform = Platform::start_with(Options {
        dispatcher: false,
        ..Options::default()
    })
    .await;
    let pki = eddy_testing::pki::Pki::new();
    let received = Arc::new(std::sync::Mutex::new(Vec::new()));
    let port = tls_sink(&pki, received.clone()).await;
    let (status, body) = platform
        .put_subscription(
            "secure",
            json!({"sink": format!("https://127.0.0.1:{port}/hooks/orders"),
                   "types": ["order.created.v1"]}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    let _dispatcher = platform
        .spawn_dispatcher_with_env("30s", &[("SSL_CERT_FILE", &pki.arg("ca.pem"))])
        .await;
    platform.wait_subscription_ready("secure").await;
    platform
        .publish("shop", "order.created.v1", "over-tls", json!({}))
        .await;
    eventually("the event over TLS", Duration::from_secs(30), || async {
        !received.lock().unwrap().is_empty()
    })
    .await
    .unwrap();
    assert_eq!(
        received.lock().unwrap()[0],
        ("over-tls".to_owned(), "/hooks/orders".to_owned())
    );
}

/// A Function sink that never resolves (no such Function) is retried for its attempts and
/// then dead-lettered as `sink_unresolved`, counted in `eddy_dispatcher_dead_lettered_total`
/// and `eddy_dispatcher_retried_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unresolved_function_sink_is_dead_lettered_with_its_reason() {
    let platform = Platform::start().await;
    let (status, body) = platform
        .put_subscription(
            "nobody",
            json!({"sink": "http://nobody.default.svc.cluster.local", "types": ["order.created.v1"],
                   "delivery": {"maxAttempts": 2, "backoff": "constant", "initialDelay": "200ms"}}),
        )
        .await;
    assert!(status == 200 || status == 201, "{status}: {body}");
    eventually(
        "the consumer of nobody",
        Duration::from_secs(20),
        || async { platform.consumer_info("nobody").await.is_some() },
    )
    .await
    .unwrap();
    platform
        .publish("shop", "order.created.v1", "lost-sink", json!({}))
        .await;
    platform.wait_settled("nobody").await;
    let letters = platform.dead_letters("nobody").await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0]["reason"], "sink_unresolved", "{letters:?}");
    assert_eq!(letters[0]["attempts"], 2, "{letters:?}");
    let subscription = "{subscription=\"default/nobody\"}";
    assert_eq!(
        metric(
            &platform,
            &format!("eddy_dispatcher_dead_lettered_total{subscription}")
        )
        .await,
        Some(1.0)
    );
    assert_eq!(
        metric(
            &platform,
            &format!("eddy_dispatcher_retried_total{subscription}")
        )
        .await,
        Some(1.0)
    );
}

/// 408 and 429 are retried like 5xx, and the waits between attempts follow the Subscription's
/// `backoff`: `linear` grows by `initialDelay` per attempt up to `maxDelay` (500 ms, then
/// capped at 600 ms where it would be 1 s and 1.5 s), `constant` waits `initialDelay` each time
/// (where `exponential` would double it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retried_statuses_wait_as_the_linear_and_constant_backoffs_say() {
    let platform = Platform::start().await;
    let answers = || -> support::Behaviour {
        Arc::new(|_, attempt| match attempt {
            1 => StatusCode::REQUEST_TIMEOUT.into_response(),
            2 => StatusCode::TOO_MANY_REQUESTS.into_response(),
            3 => StatusCode::SERVICE_UNAVAILABLE.into_response(),
            _ => StatusCode::OK.into_response(),
        })
    };
    let linear = Sink::start(Duration::ZERO, answers()).await;
    let constant = Sink::start(Duration::ZERO, answers()).await;
    for (name, sink, delivery) in [
        (
            "linear",
            &linear,
            json!({"maxAttempts": 5, "backoff": "linear", "initialDelay": "500ms", "maxDelay": "600ms"}),
        ),
        (
            "constant",
            &constant,
            json!({"maxAttempts": 5, "backoff": "constant", "initialDelay": "300ms", "maxDelay": "60s"}),
        ),
    ] {
        platform
            .subscribe(
                name,
                json!({"sink": sink.url, "types": ["order.created.v1"], "delivery": delivery}),
            )
            .await;
    }
    platform
        .publish("shop", "order.created.v1", "patience", json!({}))
        .await;
    for name in ["linear", "constant"] {
        platform.wait_settled(name).await;
        let counts = subscription_counts(&platform, name).await;
        assert_eq!(counts["delivered"], 1, "{name}: {counts}");
        assert_eq!(
            counts["retried"], 3,
            "{name}: 408, 429 and 503 retried: {counts}"
        );
        assert!(platform.dead_letters(name).await.is_empty(), "{name}");
    }
    let gaps = |sink: &Sink| -> Vec<Duration> {
        let arrivals: Vec<std::time::Instant> = sink.received().iter().map(|r| r.at).collect();
        arrivals.windows(2).map(|pair| pair[1] - pair[0]).collect()
    };
    let ms = Duration::from_millis;
    // Lower bounds are the promise; upper bounds tell the shape apart on a loaded machine.
    let waited = gaps(&linear);
    assert_eq!(waited.len(), 3, "{waited:?}");
    assert!(
        waited[0] >= ms(500) && waited[0] < ms(950),
        "linear: {waited:?}"
    );
    for gap in &waited[1..] {
        assert!(
            *gap >= ms(600) && *gap < ms(1_000),
            "linear, capped at 600 ms: {waited:?}"
        );
    }
    let waited = gaps(&constant);
    assert_eq!(waited.len(), 3, "{waited:?}");
    for gap in &waited {
        assert!(
            *gap >= ms(300) && *gap < ms(580),
            "constant 300 ms: {waited:?}"
        );
    }
}

/// When a consumer goes under a Subscription (deleted by hand, lost with its stream's leader),
/// its message stream breaks: the break is counted in `eddy_dispatcher_stream_breaks_total`
/// with its reason and the consumer is created again. One that breaks before its first event
/// waits 200 ms, then 400 ms, 800 ms … (up to 5 s); one that had delivered is opened again at
/// once; each wait is measured from the deletion to the consumer's return. A consumer created
/// again goes on from its ack floor: events published before it went are not delivered again
/// from the Subscription's start, and events published after all that still arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_consumer_is_created_again_with_backoff_before_events_and_at_once_after() {
    let platform = Platform::start().await;
    let sink = Sink::ok().await;
    platform
        .subscribe(
            "watched",
            json!({"sink": sink.url, "types": ["order.created.v1"]}),
        )
        .await;
    let stream = platform
        .js
        .get_stream(eddy_platform::nats::EVENTS_STREAM)
        .await
        .unwrap();
    let consumer = eddy_model::resources::consumer_name("default", "watched");
    // Once the dispatcher is pulling from the consumer (a pull request waits on it), deletes
    // the consumer and measures how long until it is back.
    let delete_and_time = || async {
        eventually(
            "the dispatcher pulling",
            Duration::from_secs(20),
            || async {
                platform
                    .consumer_info("watched")
                    .await
                    .is_some_and(|info| info.num_waiting > 0)
            },
        )
        .await
        .unwrap();
        // Timed from the request (the consumer cannot be back sooner than its wait after it)
        // and from the answer (which can come late on a loaded machine, after the wait has
        // begun or even ended: the bounds above are taken from it).
        let asked = std::time::Instant::now();
        stream.delete_consumer(&consumer).await.unwrap();
        let answered = std::time::Instant::now();
        eventually("the consumer back", Duration::from_secs(20), || async {
            platform.consumer_info("watched").await.is_some()
        })
        .await
        .unwrap();
        Back {
            since_asked: asked.elapsed(),
            since_answered: answered.elapsed(),
        }
    };
    // Before any event: a growing wait.
    let mut waits = Vec::new();
    for _ in 0..3 {
        waits.push(delete_and_time().await);
    }
    eprintln!("consumer back, before events, after: {waits:?}");
    for (wait, backoff) in waits.iter().zip([200, 400, 800]) {
        let backoff = Duration::from_millis(backoff);
        assert!(
            wait.since_asked >= backoff
                && wait.since_answered < backoff + Duration::from_millis(600),
            "{waits:?}: expected {backoff:?}"
        );
    }
    // After an event: at once.
    platform
        .publish("shop", "order.created.v1", "before", json!({}))
        .await;
    sink.wait_for(1).await;
    platform.wait_settled("watched").await;
    let again = delete_and_time().await;
    assert!(
        again.since_answered < Duration::from_millis(190),
        "after an event the consumer is back at once, not after a backoff: {again:?}"
    );
    let all = platform
        .get_text(&format!("{}/metrics", platform.dispatcher))
        .await;
    let breaks: Vec<&str> = all
        .lines()
        .filter(|line| line.starts_with("eddy_dispatcher_stream_breaks_total{"))
        .collect();
    assert_eq!(
        breaks,
        [
            "eddy_dispatcher_stream_breaks_total{subscription=\"default/watched\",reason=\"consumer_deleted\"} 4"
        ]
    );
    // Events published after all that arrive; "before" was delivered once, or again only if
    // its ack came after the consumer was last read (its ack floor is read every 2 s). A
    // consumer created again hands both to the sink at once (several deliveries in flight), so
    // a second "before" may come after "after".
    platform
        .publish("shop", "order.created.v1", "after", json!({}))
        .await;
    eventually(
        "the event published after",
        Duration::from_secs(20),
        || async { sink.ids().contains(&"after".to_owned()) },
    )
    .await
    .unwrap();
    platform.wait_settled("watched").await;
    let ids = sink.ids();
    let count = |wanted: &str| ids.iter().filter(|id| *id == wanted).count();
    assert!(
        (1..=2).contains(&count("before"))
            && count("after") == 1
            && ids.len() == count("before") + 1,
        "{ids:?}"
    );
}

/// How long a deleted consumer took to come back.
#[derive(Debug)]
struct Back {
    since_asked: Duration,
    since_answered: Duration,
}

/// A consumer created again after it was lost starts after the ack floor last read from it,
/// not from the Subscription's start: with five events stored, one resumed after sequence 3
/// delivers the fourth first, and one without a floor delivers from the start.
#[tokio::test]
async fn a_consumer_created_again_resumes_after_its_ack_floor() {
    use futures::StreamExt as _;
    let platform = Platform::start_with(Options {
        dispatcher: false,
        ..Options::default()
    })
    .await;
    let started = time::OffsetDateTime::now_utc() - time::Duration::minutes(1);
    for i in 1..=5 {
        platform
            .publish("shop", "order.created.v1", &format!("e-{i}"), json!({}))
            .await;
    }
    let stream = platform
        .js
        .get_stream(eddy_platform::nats::EVENTS_STREAM)
        .await
        .unwrap();
    let subscription: eddy_model::resources::Subscription = serde_json::from_value(json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
        "metadata": {"name": "probe", "namespace": "default"},
        "spec": {"sink": "http://127.0.0.1:9/", "types": ["order.created.v1"]},
    }))
    .unwrap();
    let first_sequence = |resume_after: Option<u64>, name: &'static str| {
        let plan = eddy_dispatcher::ConsumerPlan {
            name: name.to_owned(),
            filter_subjects: vec!["eddy.events.shop.order.created.v1".to_owned()],
            policy: subscription.spec.delivery_policy().unwrap(),
            ack_wait: Duration::from_secs(30),
            deliver_from: Some(started),
        };
        let stream = stream.clone();
        async move {
            let consumer = eddy_dispatcher::ensure_consumer(&stream, &plan, resume_after)
                .await
                .unwrap();
            let mut batch = consumer.fetch().max_messages(1).messages().await.unwrap();
            let message = batch.next().await.unwrap().unwrap();
            message.info().unwrap().stream_sequence
        }
    };
    let events_before = stream.clone().info().await.unwrap().state.first_sequence - 1;
    assert_eq!(
        first_sequence(Some(events_before + 3), "probe_resumed").await,
        events_before + 4
    );
    assert_eq!(
        first_sequence(None, "probe_from_start").await,
        events_before + 1
    );
}

/// An `https://` sink whose certificate the dispatcher does not trust (the test CA is not among
/// its roots) is a transport failure: retried for the Subscription's attempts, counted under its
/// reason, then dead-lettered; nothing reaches the sink. Each attempt's duration is observed in
/// `eddy_dispatcher_delivery_duration_seconds`.
#[tokio::test(flavor = "multi_thread")]
async fn an_https_sink_with_an_untrusted_certificate_is_retried_then_dead_lettered() {
    let platform = Platform::start_with(Options {
        dispatcher: false,
        ..Options::default()
    })
    .await;
    let pki = eddy_testing::pki::Pki::new();
    let received = Arc::new(std::sync::Mutex::new(Vec::new()));
    let port = tls_sink(&pki, received.clone()).await;
    let (status, body) = platform
        .put_subscription(
            "untrusted",
            json!({"sink": format!("https://127.0.0.1:{port}/hooks"), "types": ["order.created.v1"],
                   "delivery": {"maxAttempts": 3, "backoff": "constant", "initialDelay": "200ms"}}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    let dispatcher = platform.spawn_dispatcher("30s").await;
    eventually(
        "the consumer of untrusted",
        Duration::from_secs(20),
        || async { platform.consumer_info("untrusted").await.is_some() },
    )
    .await
    .unwrap();
    platform
        .publish("shop", "order.created.v1", "not-trusted", json!({}))
        .await;
    platform.wait_settled("untrusted").await;
    let letters = platform.dead_letters_at(&dispatcher.url, "untrusted").await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    let reason = letters[0]["reason"].as_str().unwrap_or_default().to_owned();
    assert!(
        reason == "connect_error" || reason == "transport_error",
        "a TLS failure is a transport failure, not {reason}: {letters:?}"
    );
    assert_eq!(letters[0]["attempts"], 3, "{letters:?}");
    assert!(received.lock().unwrap().is_empty());
    // Each retry and the dead letter are logged with the reason, the attempt and the event's
    // stream sequence.
    let sequence = letters[0]["streamSequence"].as_u64().unwrap();
    let log = dispatcher.log();
    for attempt in [1, 2] {
        assert!(
            log.lines()
                .any(|line| line.contains("delivery failed; will retry")
                    && line.contains(&format!("reason={reason}"))
                    && line.contains(&format!("attempt={attempt} "))
                    && line.contains(&format!("stream_sequence={sequence}"))),
            "retry {attempt} not logged:\n{log}"
        );
    }
    assert!(
        log.lines()
            .any(|line| line.contains("event sent to dead letters")
                && line.contains(&format!("reason={reason}"))
                && line.contains("attempt=3")
                && line.contains(&format!("stream_sequence={sequence}"))),
        "the dead letter not logged:\n{log}"
    );
    let subscription = "subscription=\"default/untrusted\"";
    for (sample, expected) in [
        (
            format!("eddy_dispatcher_failures_total{{{subscription},reason=\"{reason}\"}}"),
            3.0,
        ),
        (
            format!("eddy_dispatcher_retried_total{{{subscription}}}"),
            2.0,
        ),
        (
            format!("eddy_dispatcher_delivery_duration_seconds_count{{{subscription}}}"),
            3.0,
        ),
    ] {
        assert_eq!(
            metric_at(&platform, &dispatcher.url, &sample).await,
            Some(expected),
            "{sample}"
        );
    }
}

/// A dispatcher whose own `--allowed-sinks` refuses a Subscription's sink (stricter than the
/// controller's) does not deliver for it and dead-letters nothing: the events wait in the
/// stream, and a dispatcher that allows the sink delivers them.
#[tokio::test(flavor = "multi_thread")]
async fn a_sink_the_dispatcher_refuses_keeps_its_events_until_it_is_allowed() {
    let platform = Platform::start_with(Options {
        dispatcher: false,
        ..Options::default()
    })
    .await;
    let sink = Sink::ok().await;
    let (status, body) = platform
        .put_subscription(
            "stricter",
            json!({"sink": sink.url, "types": ["order.created.v1"]}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    platform
        .publish("shop", "order.created.v1", "waits", json!({}))
        .await;
    let strict = platform
        .spawn_dispatcher_with_env(
            "30s",
            &[("EDDY_ALLOWED_SINKS", "https://sinks.example.com/")],
        )
        .await;
    // Spawned once ready: every Subscription has been read and judged.
    let subscriptions = platform
        .get_json(&format!("{}/subscriptions", strict.url))
        .await;
    assert!(
        !subscriptions.to_string().contains("stricter"),
        "the refused Subscription is not delivered for: {subscriptions}"
    );
    assert!(platform.consumer_info("stricter").await.is_none());
    assert!(
        platform
            .dead_letters_at(&strict.url, "stricter")
            .await
            .is_empty()
    );
    drop(strict);
    let allowing = platform.spawn_dispatcher("30s").await;
    eventually(
        "the waiting event delivered",
        Duration::from_secs(20),
        || async { sink.ids() == ["waits"] },
    )
    .await
    .unwrap();
    platform.wait_settled("stricter").await;
    assert!(
        platform
            .dead_letters_at(&allowing.url, "stricter")
            .await
            .is_empty()
    );
}
