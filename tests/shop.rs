//! End to end, as a user drives it: `eddy up` with the shop examples, events through the whole
//! chain, the dashboard in headless Chromium, a clean shutdown with no process left behind, and a
//! restart on the same data dir that brings back every resource and undelivered event.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{path::Path, time::Duration};

mod up;

use eddy_testing::eventually;
use serde_json::{Value, json};
use up::{Up, processes_inside};

async fn eddy_up(data_dir: &Path, apply: bool) -> Up {
    let examples = up::repo().join("examples/shop");
    let extra: Vec<&str> = if apply {
        vec!["--apply", examples.to_str().unwrap()]
    } else {
        Vec::new()
    };
    Up::start(data_dir, &extra, &[]).await
}

/// What the dashboard shows in headless Chromium once `min_events` events are in its tail and
/// its subscriptions show `min_delivered` deliveries together (tests/browser/dashboard.mjs,
/// playwright-core driving Debian's Chromium).
async fn render(url: &str, min_events: usize, min_delivered: usize) -> Value {
    let dir = up::repo().join("tests/browser");
    // Under target/ (cargo's directory for integration tests' files), replaced by each run.
    let screenshot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("shop-dashboard.png");
    let output = tokio::process::Command::new("node")
        .arg(dir.join("dashboard.mjs"))
        .arg(url)
        .arg(min_events.to_string())
        .arg(min_delivered.to_string())
        .arg(&screenshot)
        .current_dir(&dir)
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "the dashboard check failed (scripts/setup --tests installs Chromium and playwright-core):\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    println!("dashboard screenshot: {}", screenshot.display());
    serde_json::from_slice(&output.stdout).unwrap()
}

#[tokio::test]
async fn the_shop_runs_end_to_end_and_survives_a_restart() {
    let data_dir = tempfile::tempdir().unwrap();
    let up = eddy_up(data_dir.path(), true).await;

    // The chain: order.created.v1 -> stock-reserver -> stock.reserved.v1 -> reservation-recorder.
    for (i, sku) in ["A-1", "B-2", "A-1"].iter().enumerate() {
        up.publish(
            "order.created.v1",
            &format!("order-{i}"),
            json!({"orderId": format!("100{i}"), "items": [{"sku": sku, "qty": 1}]}),
        )
        .await;
    }
    let recorder = format!("{}/default/reservation-recorder", up.gateway);
    eventually(
        "three recorded reservations",
        Duration::from_secs(60),
        || async { up.get(recorder.clone()).await["count"] == 3 },
    )
    .await
    .unwrap();
    let recorded = up.get(recorder.clone()).await;
    let mut orders: Vec<&str> = recorded["reservations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["orderId"].as_str().unwrap())
        .collect();
    orders.sort();
    assert_eq!(orders, vec!["1000", "1001", "1002"]);

    // The function exposed for direct invocation.
    let quote: Value = reqwest::Client::new()
        .post(format!("{}/default/price-quote", up.gateway))
        .json(&json!({"items": [{"sku": "A-1", "qty": 2}, {"sku": "B-2", "qty": 1}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(quote["total"], 43.0);

    // The dashboard shows functions, subscriptions with their counts, and the events.
    // A delivery is counted when the function answers and its ack reaches JetStream a moment
    // later: the page is read once the state it polls shows nothing pending.
    let state = format!("{}/dashboard/state", up.api);
    eventually(
        "the deliveries' acks to reach JetStream",
        Duration::from_secs(30),
        || async {
            up.get(state.clone()).await["subscriptions"]
                .as_array()
                .is_some_and(|rows| rows.iter().all(|row| row["counts"]["pending"] == 0))
        },
    )
    .await
    .unwrap();
    let shown = render(&format!("{}/", up.api), 6, 6).await;
    let functions: Vec<(String, String)> = shown["functions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            (
                row[1].as_str().unwrap().to_owned(),
                row[4].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        functions,
        vec![
            ("price-quote".to_owned(), "Running".to_owned()),
            ("reservation-recorder".to_owned(), "Running".to_owned()),
            ("stock-reserver".to_owned(), "Running".to_owned()),
        ]
    );
    let subscription = |name: &str| {
        shown["subscriptions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|row| row[1] == name)
            .unwrap()
            .clone()
    };
    // Columns: namespace, name, ready, types, sink, delivered, retried, dead-lettered, pending.
    for name in ["reserve-stock", "record-reservation"] {
        let row = subscription(name);
        assert_eq!(row[2], "ConsumerReady", "{row}");
        assert_eq!(
            (row[5].as_str(), row[7].as_str(), row[8].as_str()),
            (Some("3"), Some("0"), Some("0")),
            "{row}"
        );
    }
    let types: Vec<&str> = shown["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| row[1].as_str().unwrap())
        .collect();
    assert_eq!(
        types.iter().filter(|t| **t == "order.created.v1").count(),
        3,
        "{types:?}"
    );
    assert_eq!(
        types.iter().filter(|t| **t == "stock.reserved.v1").count(),
        3,
        "{types:?}"
    );

    // Events for a sink that does not exist yet stay undelivered across the restart.
    up.apply(json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
        "metadata": {"name": "late-orders", "namespace": "default"},
        "spec": {"sink": "http://late-handler.default.svc.cluster.local", "types": ["order.late.v1"],
            "delivery": {"maxAttempts": 100, "initialDelay": "200ms", "maxDelay": "500ms"}}
    }))
    .await;
    eventually(
        "the late subscription's consumer",
        Duration::from_secs(30),
        || async {
            let status = up
                .get(format!(
                    "{}/apis/eddy.dev/v1alpha1/namespaces/default/subscriptions/late-orders",
                    up.api
                ))
                .await;
            status["status"]["conditions"][0]["reason"] == "SinkNotFound"
        },
    )
    .await
    .unwrap();
    up.publish("order.late.v1", "late-1", json!({"n": 1})).await;
    up.publish("order.late.v1", "late-2", json!({"n": 2})).await;

    assert!(up.stop_with("INT").await, "eddy up exits cleanly on SIGINT");
    let left = processes_inside(data_dir.path());
    assert!(left.is_empty(), "processes left behind: {left:?}");

    // Same data dir, nothing applied: everything comes back.
    let up = eddy_up(data_dir.path(), false).await;
    let functions = up
        .get(format!("{}/apis/eddy.dev/v1alpha1/functions", up.api))
        .await;
    let names: Vec<&str> = functions["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        vec!["price-quote", "reservation-recorder", "stock-reserver"]
    );
    let subscriptions = up
        .get(format!("{}/apis/eddy.dev/v1alpha1/subscriptions", up.api))
        .await;
    assert_eq!(subscriptions["items"].as_array().unwrap().len(), 3);
    // New ports after the restart.
    let recorder = format!("{}/default/reservation-recorder", up.gateway);
    eventually("the shop to run again", Duration::from_secs(60), || async {
        matches!(reqwest::get(&recorder).await, Ok(response) if response.status() == 200)
    })
    .await
    .unwrap();

    // The late handler appears; the events stored before the restart reach it.
    up.apply(json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
        "metadata": {"name": "late-handler", "namespace": "default"},
        "spec": {"runtime": "python311", "source": {"inline": {"source":
            "SEEN = set()\n\ndef main(event, context):\n    if event.get('ce-id'):\n        SEEN.add(event['ce-id'])\n    return {'seen': sorted(SEEN)}\n"}}}
    }))
    .await;
    let late = format!("{}/default/late-handler", up.gateway);
    eventually(
        "the undelivered events to arrive",
        Duration::from_secs(60),
        || async {
            match reqwest::get(&late).await {
                Ok(response) if response.status() == 200 => {
                    response.json::<Value>().await.unwrap_or_default()
                        == json!({"seen": ["late-1", "late-2"]})
                }
                _ => false,
            }
        },
    )
    .await
    .unwrap();

    assert!(up.stop_with("INT").await);
    assert!(processes_inside(data_dir.path()).is_empty());
}
