//! Requests shaped to hurt the event-bus: batches past the NATS client's ack window, bodies whose
//! parsing would cost far more than their size, requests that never finish, percent-encoded
//! attributes. Each against a real nats-server.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{Bus, header};
use eddy_testing::NatsServer;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn batch(count: usize, prefix: &str) -> String {
    let events: Vec<Value> = (0..count)
        .map(|i| {
            json!({"specversion": "1.0", "id": format!("{prefix}-{i}"), "source": "batcher",
            "type": "order.created.v1", "data": {"n": i}})
        })
        .collect();
    Value::Array(events).to_string()
}

/// A batch larger than the connection's ack window used to wait on itself forever, and every
/// other publish behind it. Now it is stored whole while single publishes keep being answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_past_the_ack_window_is_stored_while_others_publish() {
    let nats = NatsServer::start().unwrap();
    // A small client window makes the old deadlock certain with a small batch.
    let bus = Bus::start_with(nats, |args| args.max_acks_in_flight = 100).await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();

    let big = http
        .post(format!("{}/publish", bus.url))
        .header("content-type", "application/cloudevents-batch+json")
        .body(batch(2_000, "big"))
        .send();
    let singles = async {
        let mut slowest = Duration::ZERO;
        for i in 0..200 {
            let started = Instant::now();
            let response = bus
                .binary("single", &format!("s-{i}"), "order.created.v1")
                .timeout(Duration::from_secs(30))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 204, "single publish {i}");
            slowest = slowest.max(started.elapsed());
        }
        slowest
    };
    let (big, slowest) = tokio::join!(big, singles);
    let big = big.expect("the big batch is answered");
    assert_eq!(big.status(), 204, "{:?}", big.text().await);
    assert_eq!(bus.stored_count().await, 2_200);
    // Not a latency assertion: a single publish never waited for the whole batch's acks
    // (the client timeout above is what fails the old behaviour); this shows what it waited.
    eprintln!("slowest single publish beside the batch: {slowest:?}");
}

/// The default limits: a batch of `--max-batch-events` (10,000) events is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_at_the_event_count_limit_is_stored() {
    let bus = Bus::start().await;
    let response = bus
        .post("/publish")
        .header("content-type", "application/cloudevents-batch+json")
        .body(batch(10_000, "max"))
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204, "{:?}", response.text().await);
    assert_eq!(bus.stored_count().await, 10_000);
    let last = bus.stored(10_000).await;
    assert_eq!(header(&last, "ce-id"), Some("max-9999"));
}

/// Peak resident memory of this process (each nextest test is a process of its own), in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|line| line.starts_with("VmHWM:"))
        .unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// 16 MiB of JSON that is cheap as text and dear as values: one event whose data is millions of
/// small numbers, and a batch of millions of empty objects. Both are refused, and the process's
/// peak memory grows by a small multiple of the body (the client's copy included), not by the
/// gigabytes building values took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parsing_costs_what_the_body_weighs_not_its_shape() {
    let bus = Bus::start().await;
    let size = 16 * 1024 * 1024 - 1024;
    let mut numbers = String::with_capacity(size);
    numbers.push_str(r#"[{"specversion":"1.0","id":"n","source":"s","type":"t","data":["#);
    while numbers.len() < size - 8 {
        numbers.push_str("1,");
    }
    numbers.push_str("1]}]");
    let mut objects = String::with_capacity(size);
    objects.push('[');
    while objects.len() < size - 4 {
        objects.push_str("{},");
    }
    objects.push_str("{}]");

    let before = peak_rss();
    // The one event is over the size limit (400 naming it 413); the objects are past the count.
    for (body, status) in [(numbers, 400), (objects, 413)] {
        let body_len = body.len();
        let response = bus
            .post("/publish")
            .header("content-type", "application/cloudevents-batch+json")
            .body(body)
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), status);
        let answer: Value = response.json().await.unwrap();
        if status == 400 {
            assert_eq!(answer["results"][0]["status"], 413, "{answer}");
        }
        assert!(body_len > 15 * 1024 * 1024);
    }
    let grown = peak_rss().saturating_sub(before);
    assert!(
        grown < 8 * 16 * 1024 * 1024,
        "peak memory grew by {} MiB for 16 MiB bodies",
        grown >> 20
    );
    assert_eq!(bus.stored_count().await, 0);
}

/// The same shapes inside single structured events and the legacy format are refused by size
/// before any value is built; within the size limit, JSON data is stored as sent.
#[tokio::test]
async fn structured_and_legacy_data_is_stored_as_sent() {
    let bus = Bus::start().await;
    let body = r#"{"specversion":"1.0","id":"raw","source":"s","type":"t","data": {"b": [1, 2.50, 1e3],  "a": null}}"#;
    let response = bus
        .post("/publish")
        .header("content-type", "application/cloudevents+json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204, "{:?}", response.text().await);
    let stored = bus.last_stored().await;
    assert_eq!(&stored.payload[..], br#"{"b": [1, 2.50, 1e3],  "a": null}"#);

    let legacy = r#"{"event-type":"order.created","event-type-version":"v1","event-time":"2024-01-01T00:00:00Z","data": [ 1,2 ]}"#;
    let response = bus
        .post("/shop/v1/events")
        .header("content-type", "application/json")
        .body(legacy)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{:?}", response.text().await);
    let stored = bus.last_stored().await;
    assert_eq!(&stored.payload[..], b"[ 1,2 ]");

    // An attribute that is an array of many tiny values is refused by type, never built.
    let attribute = format!(
        r#"{{"specversion":"1.0","id":"x","source":"s","type":"t","tenant":[{}0]}}"#,
        "0,".repeat(100_000)
    );
    let response = bus
        .post("/publish")
        .header("content-type", "application/cloudevents+json")
        .body(attribute)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["field"], "tenant");
}

/// A body that stops arriving is cut off after `--body-timeout` (408), and a batch that keeps
/// trickling in is cut off at `--request-timeout` (503): neither holds its connection, slot and
/// memory for as long as the client likes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_and_trickling_requests_are_cut_off() {
    let nats = NatsServer::start().unwrap();
    let bus = Bus::start_with(nats, |args| {
        // The trickle below sends every 200 ms: ten times within the body timeout, so a loaded
        // machine cannot turn it into a stall.
        args.serve.body_timeout = Duration::from_secs(2);
        args.request_timeout = Duration::from_secs(4);
    })
    .await;
    let address = bus.url.trim_start_matches("http://").to_owned();

    let mut stalled = tokio::net::TcpStream::connect(&address).await.unwrap();
    stalled
        .write_all(
            b"POST /publish HTTP/1.1\r\nhost: 127.0.0.1\r\nce-specversion: 1.0\r\nce-id: 1\r\n\
              ce-source: s\r\nce-type: t\r\ncontent-length: 100\r\n\r\nonly ten b",
        )
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), stalled.read_to_end(&mut answer))
        .await
        .expect("a stalled body is answered and the connection closed")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");

    let mut trickle = tokio::net::TcpStream::connect(&address).await.unwrap();
    trickle
        .write_all(
            b"POST /publish HTTP/1.1\r\nhost: 127.0.0.1\r\n\
              content-type: application/cloudevents-batch+json\r\ntransfer-encoding: chunked\r\n\r\n1\r\n[\r\n",
        )
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let mut answer = vec![0u8; 4096];
    let read = loop {
        // A byte of whitespace every 200 ms: never stalled, never finished.
        tokio::select! {
            read = trickle.read(&mut answer) => break read.unwrap(),
            () = tokio::time::sleep(Duration::from_millis(200)) => {
                if trickle.write_all(b"1\r\n \r\n").await.is_err() {
                    break trickle.read(&mut answer).await.unwrap_or(0);
                }
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "a trickling batch is cut off"
        );
    };
    let answer = String::from_utf8_lossy(&answer[..read]);
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("retry-after: 1"),
        "{answer}"
    );
    assert_eq!(bus.stored_count().await, 0);
}

/// Binary-mode attributes are percent-decoded before they are validated and before the subject
/// and the dedup id are made: `a%2E%2Eb` is the type `a..b`, refused as it would be sent plainly.
#[tokio::test]
async fn decoded_attribute_values_make_the_subject_and_the_id() {
    let bus = Bus::start().await;
    let response = bus
        .binary("s", "1", "a%2E%2Eb")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["field"], "type");

    let response = bus
        .binary("sh%6Fp", "o%2D1", "order%2Ecreated")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204);
    let stored = bus.last_stored().await;
    assert_eq!(stored.subject.as_str(), "eddy.events.shop.order.created");
    assert_eq!(header(&stored, "ce-id"), Some("o-1"));
    // The same event sent plainly is a duplicate of it.
    let response = bus
        .binary("shop", "o-1", "order.created")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204);
    assert_eq!(bus.stored_count().await, 1);
}

/// `--max-concurrent-batches`: batches are read, parsed and published a few at a time, and the
/// rest wait. A batch whose body is held half-sent keeps its slot: with two slots a second batch
/// is answered meanwhile (the control, which also times how long an answer takes here); with one
/// slot it is not, and once the first batch is finished both are stored, the first one's events
/// before the second's.
#[tokio::test]
async fn batches_beyond_max_concurrent_batches_wait_for_a_slot() {
    // How long the two-slot control took to answer, times ten: the one-slot case waits that long.
    let mut control = Duration::ZERO;
    for slots in [2_u32, 1] {
        let bus = Bus::start_with(NatsServer::start().unwrap(), |args| {
            args.max_concurrent_batches = slots;
        })
        .await;
        let address = bus.url.trim_start_matches("http://").to_owned();
        let held = batch(3, "held");
        let (first_half, second_half) = held.split_at(held.len() / 2);
        let mut holder = tokio::net::TcpStream::connect(&address).await.unwrap();
        holder
            .write_all(
                format!(
                    "POST /publish HTTP/1.1\r\nhost: {address}\r\n\
                     content-type: application/cloudevents-batch+json\r\n\
                     content-length: {}\r\n\r\n{first_half}",
                    held.len()
                )
                .as_bytes(),
            )
            .await
            .unwrap();
        let started = Instant::now();
        let second = tokio::spawn(
            bus.post("/publish")
                .header("content-type", "application/cloudevents-batch+json")
                .body(batch(3, "waiting"))
                .send(),
        );
        let mut second = Box::pin(second);
        let answered_while_held = if slots == 2 {
            let answer = tokio::time::timeout(Duration::from_secs(20), &mut second)
                .await
                .expect("with a free slot, the second batch is answered while the first is held")
                .unwrap()
                .unwrap();
            // Ten times what the control took, and at least two seconds.
            control = (started.elapsed() * 10).max(Duration::from_secs(2));
            Some(answer.status())
        } else {
            assert!(
                tokio::time::timeout(control, &mut second).await.is_err(),
                "the second batch was answered within {control:?} while the only slot was held"
            );
            None
        };
        holder.write_all(second_half.as_bytes()).await.unwrap();
        let mut answer = [0_u8; 12];
        holder.read_exact(&mut answer).await.unwrap();
        assert_eq!(
            &answer, b"HTTP/1.1 204",
            "the held batch is stored once sent"
        );
        let second_status = match answered_while_held {
            Some(status) => status,
            None => second.await.unwrap().unwrap().status(),
        };
        assert_eq!(second_status, 204);
        let mut order = Vec::new();
        for sequence in 1..=6 {
            let stored = bus.stored(sequence).await;
            order.push(header(&stored, "ce-id").unwrap().to_owned());
        }
        if slots == 1 {
            assert_eq!(
                order,
                [
                    "held-0",
                    "held-1",
                    "held-2",
                    "waiting-0",
                    "waiting-1",
                    "waiting-2"
                ],
                "the waiting batch went in only after the held one"
            );
        } else {
            assert_eq!(&order[..3], ["waiting-0", "waiting-1", "waiting-2"]);
        }
    }
}
