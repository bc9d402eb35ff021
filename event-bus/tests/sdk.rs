//! Events sent by the official CloudEvents SDKs (Python from PyPI, JavaScript from npm), in binary
//! and structured mode, are accepted and stored with every attribute and extension intact.
//!
//! The SDKs are installed by `scripts/setup` (into `.tools/venv` and `tests/sdk/node_modules`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use async_nats::jetstream::message::StreamMessage;
use common::{Bus, header};
use serde_json::Value;

fn sdk_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/sdk")
}

fn python() -> PathBuf {
    if let Some(python) = std::env::var_os("EDDY_PYTHON") {
        return python.into();
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/venv/bin/python");
    if venv.is_file() {
        venv
    } else {
        PathBuf::from("python3")
    }
}

/// Runs a publishing script and returns what it says it sent.
async fn run_script(program: &Path, script: &str, bus: &Bus) -> Vec<Value> {
    let run_id = std::process::id().to_string();
    let output = tokio::process::Command::new(program)
        .arg(sdk_dir().join(script))
        .args([&bus.url, &run_id])
        .current_dir(sdk_dir())
        .output()
        .await
        .unwrap_or_else(|error| panic!("cannot run {}: {error}", program.display()));
    assert!(
        output.status.success(),
        "{script} failed (run scripts/setup to install the CloudEvents SDKs):\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// Every stored event by its id; an id stored twice fails the test (a duplicate is not keyed
/// away).
async fn stored_by_id(bus: &Bus) -> HashMap<String, StreamMessage> {
    let mut stored = HashMap::new();
    for sequence in 1..=bus.stored_count().await {
        let message = bus.stored(sequence).await;
        let id = header(&message, "ce-id").unwrap().to_owned();
        assert!(
            stored.insert(id.clone(), message).is_none(),
            "event {id} was stored twice"
        );
    }
    stored
}

fn assert_intact(sent: &Value, stored: &StreamMessage) {
    let mode = sent["mode"].as_str().unwrap();
    let attributes = sent["attributes"].as_object().unwrap();
    for (name, expected) in attributes {
        let expected = expected.as_str().unwrap();
        let header_name = if name == "datacontenttype" {
            "content-type".to_owned()
        } else {
            format!("ce-{name}")
        };
        let actual = header(stored, &header_name)
            .unwrap_or_else(|| panic!("{mode}: attribute {name} was not stored"));
        if name == "time" {
            let expected = chrono::DateTime::parse_from_rfc3339(expected).unwrap();
            let actual = chrono::DateTime::parse_from_rfc3339(actual).unwrap();
            assert_eq!(actual, expected, "{mode}: time");
        } else if name == "datacontenttype" {
            assert!(
                actual.starts_with(expected),
                "{mode}: content-type {actual} vs {expected}"
            );
        } else {
            assert_eq!(actual, expected, "{mode}: attribute {name}");
        }
    }
    let data: Value = serde_json::from_slice(&stored.payload).unwrap();
    assert_eq!(data, sent["data"], "{mode}: data");
}

async fn check_sdk(program: &Path, script: &str, extensions: &[&str]) {
    let bus = Bus::start().await;
    let sent = run_script(program, script, &bus).await;
    assert_eq!(sent.len(), 2);
    let stored = stored_by_id(&bus).await;
    assert_eq!(stored.len(), 2);
    for event in &sent {
        let id = event["attributes"]["id"].as_str().unwrap();
        let message = stored
            .get(id)
            .unwrap_or_else(|| panic!("event {id} was not stored"));
        for extension in extensions {
            assert!(
                event["attributes"].get(*extension).is_some(),
                "{script} did not send the extension {extension}"
            );
        }
        assert_intact(event, message);
    }
}

#[tokio::test]
async fn python_sdk_events_are_stored_intact() {
    check_sdk(&python(), "publish_python.py", &["tenant", "priority"]).await;
}

#[tokio::test]
async fn javascript_sdk_events_are_stored_intact() {
    check_sdk(
        Path::new("node"),
        "publish_node.mjs",
        &["tenant", "priority"],
    )
    .await;
}
