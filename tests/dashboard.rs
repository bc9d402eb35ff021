//! The dashboard as a user works in it: `eddy up` with API tokens on, and headless Chromium
//! (tests/browser/work.mjs, playwright-core driving Debian's Chromium) that gives the token
//! when asked, deploys a function from the editor, calls it, reads its log, publishes events and
//! opens them, finds a dead letter, fixes the function and redrives it, and reads the flow map
//! and the charts. What the browser saw is checked here, and against the API.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

mod up;

use serde_json::{Value, json};
use up::Up;

const TOKEN: &str = "dashboard-test-token";

/// Where the screenshots go: `EDDY_SCREENSHOT_DIR` (docs/ to refresh the README's), else
/// cargo's directory for integration tests' files under `target/` (each run replaces the last's,
/// and nothing is left in the system's temporary directory).
fn screenshot_dir() -> PathBuf {
    match std::env::var_os("EDDY_SCREENSHOT_DIR") {
        // Relative to the repository (the browser runs in tests/browser).
        Some(dir) => up::repo().join(dir),
        None => {
            let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard-screenshots");
            std::fs::create_dir_all(&dir).unwrap();
            dir
        }
    }
}

#[tokio::test]
async fn a_user_deploys_calls_publishes_and_redrives_from_the_dashboard() {
    let data_dir = tempfile::tempdir().unwrap();
    let up = Up::start(data_dir.path(), &["--api-tokens", TOKEN], &[]).await;

    // Without the token the API and the dashboard's endpoints are closed.
    let closed = reqwest::get(format!("{}/dashboard/state", up.api))
        .await
        .unwrap();
    assert_eq!(closed.status(), 401);

    // The Subscription the user's function will take events from (the function comes from
    // the editor, in the browser).
    up.apply_with_token(
        Some(TOKEN),
        json!({
            "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
            "metadata": {"name": "greetings", "namespace": "default"},
            "spec": {
                "sink": "http://greeter.default.svc.cluster.local",
                "types": ["com.example.greet.v1"],
            },
        }),
    )
    .await;

    let screenshots = screenshot_dir();
    let browser_dir = up::repo().join("tests/browser");
    let output = tokio::process::Command::new("node")
        .arg(browser_dir.join("work.mjs"))
        .arg(format!("{}/", up.api))
        .arg(TOKEN)
        .arg(&screenshots)
        .current_dir(&browser_dir)
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "the dashboard session failed (scripts/setup --tests installs Chromium and playwright-core; \
         screenshots in {}):\n{}",
        screenshots.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    let seen: Value = serde_json::from_slice(&output.stdout).unwrap();
    println!(
        "dashboard screenshots: {}\n{}",
        screenshots.display(),
        serde_json::to_string_pretty(&seen).unwrap()
    );

    // The token was asked for once and kept out of the address.
    assert_eq!(seen["askedForToken"], true);
    assert_eq!(seen["tokenInUrl"], false);
    // The API's refusal of a bad name is shown on the name field.
    let name_error = seen["nameError"].as_str().unwrap();
    assert!(name_error.starts_with("metadata.name"), "{name_error}");
    // The call form: status, time, headers and the function's answer.
    let call = &seen["call"];
    assert!(
        call["status"].as_str().unwrap().starts_with("200 · "),
        "{call}"
    );
    assert!(call["body"].as_str().unwrap().contains(r#""hello": "ada""#));
    assert!(
        call["headers"]
            .as_str()
            .unwrap()
            .contains("ce-type: com.example.greeted.v1")
    );
    assert!(seen["log"].as_str().unwrap().contains("greeting ada"));
    // The published event: its attributes, its data pretty-printed, one delivery.
    let published = &seen["published"];
    assert_eq!(published["attributes"]["type"], "com.example.greet.v1");
    assert_eq!(published["attributes"]["source"], "dashboard");
    assert_eq!(
        published["attributes"]["datacontenttype"],
        "application/json"
    );
    assert!(
        published["data"]
            .as_str()
            .unwrap()
            .contains("\"name\": \"grace\"")
    );
    let delivery = &published["deliveries"][0];
    assert_eq!(
        delivery.as_array().unwrap()[..5],
        [
            json!("default/greetings"),
            json!("1"),
            json!("delivered"),
            json!("200"),
            json!("")
        ]
    );
    // The refused event: dead-lettered at the first attempt, saying why.
    let refused = seen["refused"].as_array().unwrap();
    assert!(
        refused.iter().any(|row| row[2] == "dead letter"
            && row[3] == "400"
            && row[4] == "http_4xx"
            && row[1] == "1"),
        "{refused:?}"
    );
    // The flow map: type → subscription → function → reply type.
    let labels: Vec<&str> = seen["flow"]["labels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect();
    assert_eq!(
        labels,
        [
            "com.example.greet.v1",
            "greetings",
            "greeter",
            "com.example.greeted.v1"
        ]
    );
    assert_eq!(seen["flow"]["edges"], 3);
    // The charts: lines for the subscription and the function.
    let charts = seen["charts"].as_array().unwrap();
    for (title, series, points) in [
        ("default/greetings", "delivered", 2),
        ("default/greeter calls/s", "calls", 2),
        ("default/greeter p99 ms", "p99", 1),
    ] {
        let chart = charts
            .iter()
            .find(|c| c["title"] == title)
            .unwrap_or_else(|| panic!("no chart {title}: {charts:?}"));
        let line = chart["lines"]
            .as_array()
            .unwrap()
            .iter()
            .find(|line| line[0] == series)
            .unwrap_or_else(|| panic!("no {series} line in {chart}"));
        assert!(line[1].as_u64().unwrap() >= points, "{chart}");
    }
    // The dead letter, with why and how many attempts; redriven once the function was fixed.
    let letters = seen["deadLetters"].as_array().unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0][2], "com.example.greet.v1");
    assert_eq!(letters[0][3], "refused-1");
    assert_eq!(letters[0][4], "http_4xx");
    assert_eq!(letters[0][6], "1");
    assert!(seen["fixedCall"].as_str().unwrap().contains("world"));
    assert!(
        seen["redrive"]
            .as_str()
            .unwrap()
            .contains("delivered 1, failed 0"),
        "{}",
        seen["redrive"]
    );

    // What the dashboard showed is what the platform did.
    let http = reqwest::Client::new();
    // Bad input to the page's endpoints is refused, naming the field.
    for (path, body, field) in [
        (
            "/dashboard/invoke",
            json!({"namespace": "default", "name": "greeter", "method": "GET", "path": "/../../metrics"}),
            "path",
        ),
        // A tab or a backslash, which URL parsers drop or read as `/`, cannot climb out either.
        (
            "/dashboard/invoke",
            json!({"namespace": "default", "name": "greeter", "method": "GET", "path": "/.\t./.\t./metrics"}),
            "path",
        ),
        (
            "/dashboard/invoke",
            json!({"namespace": "default", "name": "greeter", "method": "GET", "path": "/.\t./.\t./victim/vfn"}),
            "path",
        ),
        (
            "/dashboard/invoke",
            json!({"namespace": "default", "name": "greeter", "method": "GET", "path": "/..\\..\\metrics"}),
            "path",
        ),
        (
            "/dashboard/invoke",
            json!({"namespace": "default", "name": "greeter", "method": "G ET", "path": "/"}),
            "method",
        ),
        (
            "/dashboard/publish",
            json!({"type": " ", "source": "dashboard", "data": {}}),
            "type",
        ),
        (
            "/dashboard/publish",
            json!({"type": "order.created.v1\r\nx-injected: 1", "source": "dashboard", "data": {}}),
            "type",
        ),
    ] {
        let response = http
            .post(format!("{}{path}", up.api))
            .bearer_auth(TOKEN)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 422, "{body}");
        let message = response.json::<Value>().await.unwrap()["error"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(message.starts_with(&format!("{field}:")), "{message}");
    }
    let dispatcher = |path: &str| {
        http.get(format!("{}{path}", up.dispatcher))
            .bearer_auth(TOKEN)
            .send()
    };
    let letters: Value = dispatcher("/dead-letters")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(letters["items"], json!([]));
    let subscriptions: Value = dispatcher("/subscriptions")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let counts = &subscriptions["items"][0]["counts"];
    assert_eq!(counts["delivered"], 2, "{subscriptions}");
    assert_eq!(counts["dead_lettered"], 1, "{subscriptions}");
    up.stop().await;
}
