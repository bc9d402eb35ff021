//! The `eddy` command line against a running platform, as a user drives it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use axum::http::StatusCode;
use serde_json::Value;
use support::{Platform, Sink};

#[tokio::test]
async fn apply_get_publish_dlq_redrive_replay_delete() {
    let platform = Platform::start().await;
    let (sink, healthy) = Sink::switchable(StatusCode::SERVICE_UNAVAILABLE).await;
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("sub.yaml");
    std::fs::write(
        &manifest,
        format!(
            "apiVersion: eddy.dev/v1alpha1\nkind: Subscription\nmetadata:\n  name: cli-sub\nspec:\n  sink: {}\n  types: [order.created.v1]\n  delivery:\n    maxAttempts: 1\n",
            sink.url
        ),
    )
    .unwrap();

    let (ok, out, err) = platform
        .eddy(&["apply", "-f", manifest.to_str().unwrap()])
        .await;
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "subscription.eddy.dev/cli-sub created");
    let (ok, out, _) = platform
        .eddy(&["apply", "-f", dir.path().to_str().unwrap()])
        .await;
    assert!(ok);
    assert_eq!(out.trim(), "subscription.eddy.dev/cli-sub unchanged");
    platform.wait_subscription_ready("cli-sub").await;

    let (ok, out, _) = platform.eddy(&["get", "subscriptions"]).await;
    assert!(ok);
    assert!(
        out.lines().next().unwrap().starts_with("NAMESPACE"),
        "{out}"
    );
    assert!(
        out.contains("cli-sub") && out.contains("True") && out.contains("order.created.v1"),
        "{out}"
    );
    let (ok, out, _) = platform
        .eddy(&["get", "subscription", "cli-sub", "-o", "json"])
        .await;
    assert!(ok);
    let resource: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        resource["status"]["types"][0]["subject"],
        "eddy.events.*.order.created.v1"
    );

    let (ok, out, err) = platform
        .eddy(&[
            "publish",
            "--type",
            "order.created.v1",
            "--source",
            "shop",
            "--data",
            r#"{"sku":"A"}"#,
        ])
        .await;
    assert!(ok, "{err}");
    let id = out.trim().to_owned();
    assert_eq!(id.len(), 36, "a UUID is printed: {out}");
    platform.wait_settled("cli-sub").await;

    let (ok, out, _) = platform.eddy(&["dlq", "list", "cli-sub"]).await;
    assert!(ok);
    assert!(
        out.contains("http_5xx") && out.contains(&id) && out.contains("default/cli-sub"),
        "{out}"
    );

    healthy.store(true, std::sync::atomic::Ordering::SeqCst);
    let (ok, out, err) = platform.eddy(&["dlq", "redrive", "cli-sub"]).await;
    assert!(ok, "{err}");
    assert!(out.contains("1 delivered, 0 failed"), "{out}");
    let (_, out, _) = platform.eddy(&["dlq", "list", "cli-sub"]).await;
    assert_eq!(out.trim(), "no dead letters");

    let (ok, out, err) = platform.eddy(&["replay", "cli-sub", "--since", "1h"]).await;
    assert!(ok, "{err}");
    assert!(out.contains("replaying 1 stored event(s)"), "{out}");
    sink.wait_for(3).await;
    assert_eq!(sink.ids(), vec![id.clone(), id.clone(), id]);

    // Bad manifests are refused with the field named, and nothing changes.
    let before = platform.subscription("cli-sub").await;
    std::fs::write(&manifest, "apiVersion: eddy.dev/v1alpha1\nkind: Subscription\nmetadata:\n  name: cli-sub\nspec:\n  sink: http://10.0.0.1/\n  types: [a]\n").unwrap();
    let (ok, _, err) = platform
        .eddy(&["apply", "-f", manifest.to_str().unwrap()])
        .await;
    assert!(!ok);
    assert!(err.contains("spec.sink"), "{err}");
    let after = platform.subscription("cli-sub").await;
    assert_eq!(
        after["metadata"], before["metadata"],
        "same generation and version"
    );
    assert_eq!(after["spec"], before["spec"]);

    let (ok, out, _) = platform.eddy(&["delete", "subscriptions", "cli-sub"]).await;
    assert!(ok);
    assert_eq!(out.trim(), "subscription.eddy.dev/cli-sub deleted");
    let (ok, _, err) = platform.eddy(&["get", "subscriptions", "cli-sub"]).await;
    assert!(!ok);
    assert!(err.contains("not found"), "{err}");
}

fn eddy_offline(args: &[&str]) -> (bool, String, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// `eddy controller render` is a dry run of the Kubernetes backend: the shop's Functions come
/// out as the objects the controller would apply, and an invalid one is refused by field.
#[test]
fn controller_render_prints_the_kubernetes_objects_of_the_shop() {
    let (ok, stdout, stderr) = eddy_offline(&[
        "controller",
        "render",
        "-f",
        "examples/shop",
        "--registry",
        "registry.example.com/shop",
        "--build",
        "image",
    ]);
    assert!(ok, "{stderr}");
    let documents: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&stdout)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .collect();
    let kinds: Vec<(&str, &str)> = documents
        .iter()
        .map(|d| {
            (
                d["kind"].as_str().unwrap(),
                d["metadata"]["name"].as_str().unwrap(),
            )
        })
        .collect();
    for kind in ["ConfigMap", "Job", "Deployment", "Service"] {
        assert!(kinds.iter().any(|(k, _)| *k == kind), "{kind} in {kinds:?}");
    }
    let images: Vec<&str> = documents
        .iter()
        .filter(|d| d["kind"] == "Deployment")
        .map(|d| {
            d["spec"]["template"]["spec"]["containers"][0]["image"]
                .as_str()
                .unwrap()
        })
        .collect();
    assert!(!images.is_empty());
    assert!(
        images
            .iter()
            .all(|i| i.starts_with("registry.example.com/shop/")),
        "{images:?}"
    );

    // Buildless (the default): no build Job, the pods on eddy's runtime images.
    let (ok, stdout, stderr) = eddy_offline(&["controller", "render", "-f", "examples/shop"]);
    assert!(ok, "{stderr}");
    let documents: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&stdout)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .collect();
    assert!(!documents.iter().any(|d| d["kind"] == "Job"), "{stdout}");
    let version = env!("CARGO_PKG_VERSION");
    assert!(
        documents
            .iter()
            .filter(|d| d["kind"] == "Deployment")
            .all(|d| d["spec"]["template"]["spec"]["containers"][0]["image"]
                .as_str()
                .is_some_and(|image| image.starts_with("ghcr.io/eddy-dev/eddy-runtime-")
                    && image.ends_with(&format!(":{version}")))),
        "{stdout}"
    );

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "apiVersion: eddy.dev/v1alpha1\nkind: Function\nmetadata: {name: Bad_Name}\nspec:\n  runtime: nodejs20\n  source: {inline: {source: x}}\n",
    )
    .unwrap();
    let (ok, _, stderr) = eddy_offline(&["controller", "render", "-f", bad.to_str().unwrap()]);
    assert!(!ok);
    assert!(stderr.contains("metadata.name"), "{stderr}");

    let (ok, stdout, _) = eddy_offline(&["crds"]);
    assert!(ok);
    assert!(
        stdout.contains("name: functions.eddy.dev")
            && stdout.contains("name: subscriptions.eddy.dev")
    );
}

/// `eddy token digest` prints the form `spec.access.tokenDigests` takes: `sha256:` and the
/// SHA-256 of the token in hex (the token itself is never stored).
#[tokio::test]
async fn token_digest_prints_the_sha256_of_the_token() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(["token", "digest", "abc"])
        .output()
        .await
        .unwrap();
    assert!(output.status.success());
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad\n"
    );
}
