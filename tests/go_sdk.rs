//! eddy with CloudEvents' Go SDK on both ends, the SDK Kyma's publisher proxy and dispatcher are
//! built on and Kyma users' Go publishers and sinks use: a publisher (binary and structured
//! 1.0, binary 0.3, raw UTF-8 in binary-mode values) and sinks that read what eddy delivers.
//! The Go program is `tests/sdk/go`, built by `scripts/setup` into `.tools/bin/eddy-sdk-go`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::{path::PathBuf, process::Stdio, time::Duration};

use serde_json::{Value, json};
use support::Platform;
use tokio::io::{AsyncBufReadExt as _, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

fn go_sdk() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/bin/eddy-sdk-go");
    assert!(
        path.is_file(),
        "{} is missing: run scripts/setup (it builds tests/sdk/go)",
        path.display()
    );
    path
}

/// A Go SDK sink: its URL, its process (killed on drop), and the events it prints.
struct GoSink {
    url: String,
    _process: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl GoSink {
    async fn start() -> Self {
        let mut process = Command::new(go_sdk())
            .arg("sink")
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(process.stdout.take().unwrap()).lines();
        let first = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .expect("the Go sink to listen")
            .unwrap()
            .unwrap();
        let port = first.strip_prefix("listening ").unwrap().to_owned();
        Self {
            url: format!("http://127.0.0.1:{port}/"),
            _process: process,
            lines,
        }
    }

    /// The next `count` events it received, by id, within a deadline.
    async fn received(&mut self, count: usize) -> std::collections::BTreeMap<String, Value> {
        let mut events = std::collections::BTreeMap::new();
        while events.len() < count {
            let line = tokio::time::timeout(Duration::from_secs(30), self.lines.next_line())
                .await
                .unwrap_or_else(|_| panic!("{count} events at the Go sink; got {events:?}"))
                .unwrap()
                .expect("the Go sink ended");
            let event: Value = serde_json::from_str(&line).unwrap();
            events.insert(event["id"].as_str().unwrap().to_owned(), event);
        }
        events
    }
}

/// Kyma's publisher proxy takes what sdk-go sends, raw UTF-8 in binary mode and CloudEvents
/// 0.3 included, and Kyma's dispatcher (sdk-go) delivers values as they are, which a Go sink
/// reads unchanged. A Subscription in Kyma's form gets that delivery from eddy; eddy's own
/// Subscriptions get the HTTP binding's percent-encoding, which sdk-go does not decode (a Go
/// sink reads `%20` as it is).
#[tokio::test(flavor = "multi_thread")]
async fn go_sdk_publishers_and_sinks_work_with_eddy_as_with_kyma() {
    let platform = Platform::start().await;
    let mut kyma_sink = GoSink::start().await;
    let mut eddy_sink = GoSink::start().await;
    let manifest = format!(
        r#"apiVersion: eventing.kyma-project.io/v1alpha2
kind: Subscription
metadata:
  name: go-kyma
spec:
  sink: {kyma}
  source: ""
  types: ["order.créée.v1"]
  typeMatching: exact
---
apiVersion: eddy.dev/v1alpha1
kind: Subscription
metadata:
  name: go-eddy
spec:
  sink: {eddy}
  source: commerce
  types: ["order.créée.v1"]
"#,
        kyma = kyma_sink.url,
        eddy = eddy_sink.url,
    );
    let (ok, stdout, stderr) = platform.apply_text(&manifest).await;
    assert!(ok, "{stdout}\n{stderr}");
    for name in ["go-kyma", "go-eddy"] {
        platform.wait_subscription_ready(name).await;
    }

    let run = std::process::id().to_string();
    let output = Command::new(go_sdk())
        .args(["publish", &platform.bus, &run])
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "the Go SDK's publishes:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let sent: Vec<Value> = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(sent.len(), 3);

    let kyma = kyma_sink.received(3).await;
    let eddy = eddy_sink.received(3).await;
    for form in ["binary", "structured", "v03"] {
        let id = format!("go-{form}-{run}");
        let data = json!({"mode": form}).to_string();
        // Kyma's form: read by sdk-go exactly as sent, stored as 1.0, with `originaltype`.
        let got = &kyma[&id];
        assert_eq!(got["specversion"], "1.0", "{form}: {got}");
        assert_eq!(got["type"], "order.créée.v1", "{form}: {got}");
        assert_eq!(got["originaltype"], "order.créée.v1", "{form}: {got}");
        assert_eq!(got["source"], "commerce", "{form}: {got}");
        assert_eq!(got["subject"], "100% über", "{form}: {got}");
        assert_eq!(got["tenant"], "ä b", "{form}: {got}");
        assert_eq!(
            got["dataschema"], "https://schemas.example/commande",
            "{form}: {got}"
        );
        assert_eq!(
            serde_json::from_str::<Value>(got["data"].as_str().unwrap()).unwrap(),
            serde_json::from_str::<Value>(&data).unwrap(),
            "{form}: {got}"
        );
        // eddy's own Subscription: the HTTP binding's encoding, which sdk-go reads as it is.
        let got = &eddy[&id];
        assert_eq!(got["subject"], "100%25%20%C3%BCber", "{form}: {got}");
        assert_eq!(got["type"], "order.cr%C3%A9%C3%A9e.v1", "{form}: {got}");
    }
}
