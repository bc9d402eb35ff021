//! SIGKILL the dispatcher in the middle of a stream of events, with one delivery in flight, and
//! start it again: every event is still delivered at least once, the one in flight again.
//! Prints how many were delivered twice.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::{collections::HashSet, sync::Arc, time::Duration};

use axum::{http::StatusCode, response::IntoResponse};
use serde_json::json;
use support::{Options, Platform, Sink};

const EVENTS: usize = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_is_delivered_across_a_dispatcher_sigkill() {
    let platform = Arc::new(
        Platform::start_with(Options {
            ack_wait: Duration::from_secs(2),
            dispatcher: false,
            ..Options::default()
        })
        .await,
    );
    let mut dispatcher = platform.spawn_dispatcher("2s").await;
    // The first delivery of t-100 is held, so the kill finds it in flight.
    let sink = Sink::holding(
        Duration::from_millis(5),
        "t-100",
        Duration::from_secs(120),
        Arc::new(|_, _| StatusCode::OK.into_response()),
    )
    .await;
    platform
        .subscribe("crash", json!({"sink": sink.url, "types": ["tick.v1"]}))
        .await;

    // A steady publisher in the background.
    let publisher = {
        let platform = platform.clone();
        tokio::spawn(async move {
            let mut pace = tokio::time::interval(Duration::from_millis(5));
            for i in 0..EVENTS {
                pace.tick().await;
                platform
                    .publish("clock", "tick.v1", &format!("t-{i}"), json!({"n": i}))
                    .await;
            }
        })
    };

    sink.wait_for(80).await;
    eddy_testing::eventually("t-100 to be in flight", Duration::from_secs(60), || async {
        sink.in_flight_ids().contains(&"t-100".to_owned())
    })
    .await
    .unwrap();
    dispatcher.child.start_kill().unwrap();
    dispatcher.child.wait().await.unwrap();
    let delivered_before_restart = sink.count();
    let restarted = platform.spawn_dispatcher("2s").await;

    publisher.await.unwrap();
    let expected: HashSet<String> = (0..EVENTS).map(|i| format!("t-{i}")).collect();
    eddy_testing::eventually(
        "every event to be delivered",
        Duration::from_secs(60),
        || async {
            let seen: HashSet<String> = sink.ids().into_iter().collect();
            expected.is_subset(&seen)
        },
    )
    .await
    .unwrap();
    platform.wait_settled("crash").await;
    assert_eq!(
        sink.attempts("t-100"),
        2,
        "the delivery in flight at the kill is made again, once"
    );

    let total = sink.count();
    let unique: HashSet<String> = sink.ids().into_iter().collect();
    assert_eq!(unique, expected, "every published event arrived");
    // Only what was in flight at the kill comes again: at most maxInFlightMessages (10).
    assert!(
        total - unique.len() <= 10,
        "{} deliveries came twice; at most the 10 in flight at the kill may",
        total - unique.len()
    );
    println!(
        "dispatcher SIGKILL: published {EVENTS}, delivered {total} ({} unique), delivered twice {}, \
         delivered before the kill {delivered_before_restart}",
        unique.len(),
        total - unique.len()
    );
    drop(restarted);
}

/// A dispatcher killed during an event's last attempt: JetStream hands the event out once more
/// (`max_deliver` is maxAttempts + 1), and the next dispatcher puts it in dead letters as
/// `max_attempts` without calling the sink again, so no event is stranded at the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_whose_last_attempt_died_with_its_dispatcher_goes_to_dead_letters() {
    let platform = Platform::start_with(Options {
        ack_wait: Duration::from_secs(2),
        dispatcher: false,
        ..Options::default()
    })
    .await;
    let mut dispatcher = platform.spawn_dispatcher("2s").await;
    // The first (and last: maxAttempts 1) attempt is held, so the kill finds it in flight.
    let sink = Sink::holding(
        Duration::ZERO,
        "last",
        Duration::from_secs(120),
        Arc::new(|_, _| StatusCode::OK.into_response()),
    )
    .await;
    platform
        .subscribe(
            "once",
            json!({"sink": sink.url, "types": ["tick.v1"], "delivery": {"maxAttempts": 1}}),
        )
        .await;
    platform
        .publish("clock", "tick.v1", "last", json!({}))
        .await;
    eddy_testing::eventually(
        "the last attempt to be in flight",
        Duration::from_secs(30),
        || async { sink.in_flight_ids().contains(&"last".to_owned()) },
    )
    .await
    .unwrap();
    dispatcher.child.start_kill().unwrap();
    dispatcher.child.wait().await.unwrap();

    let restarted = platform.spawn_dispatcher("2s").await;
    let letters = || platform.dead_letters_at(&restarted.url, "once");
    eddy_testing::eventually(
        "the event in dead letters",
        Duration::from_secs(30),
        || async { !letters().await.is_empty() },
    )
    .await
    .unwrap();
    let letters = letters().await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0]["id"], "last");
    assert_eq!(letters[0]["reason"], "max_attempts");
    platform.wait_settled("once").await;
    assert_eq!(
        sink.attempts("last"),
        1,
        "the sink is not called past maxAttempts"
    );
    drop(restarted);
}
