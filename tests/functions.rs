//! Functions on one machine: deployed through the API, built, run as processes and invoked
//! through the gateway, with real Node.js and Python runtimes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use eddy_testing::eventually;
use serde_json::{Value, json};
use support::{Options, Platform, sample};

const NODE_HANDLER: &str = r#"
module.exports = {
  main: async (event, context) => {
    const req = event.extensions.request;
    const url = new URL(req.url, "http://function");
    switch (url.pathname) {
      case "/throw": throw new Error("boom");
      case "/sleep": await new Promise((resolve) => setTimeout(resolve, 5000)); return "late";
      case "/text": return "hello " + event.data.name;
      case "/created":
        event.extensions.response.statusCode = 201;
        event.extensions.response.setHeader("x-custom", "yes");
        return { created: true };
      case "/emit": {
        const id = `emitted-${Date.now()}`;
        const answer = await event.emitCloudEvent("order.emitted.v1", "node-fn", { from: "node" }, { id });
        return { id, status: answer.status };
      }
    }
    return {
      data: event.data,
      type: event["ce-type"], source: event["ce-source"], id: event["ce-id"], subject: event["ce-subject"],
      context,
      method: req.method, path: url.pathname, query: url.search, header: req.headers["x-test"],
      env: {
        GREETING: process.env.GREETING, FUNC_NAME: process.env.FUNC_NAME,
        FUNC_NAMESPACE: process.env.FUNC_NAMESPACE, FUNC_RUNTIME: process.env.FUNC_RUNTIME,
        FUNC_PORT: process.env.FUNC_PORT, FUNC_TIMEOUT: process.env.FUNC_TIMEOUT,
        PUBLISHER_PROXY_ADDRESS: process.env.PUBLISHER_PROXY_ADDRESS,
        CARGO_PKG_NAME: process.env.CARGO_PKG_NAME || null,
      },
    };
  },
};
"#;

const PYTHON_HANDLER: &str = r#"
import os
import time


def main(event, context):
    request = event["extensions"]["request"]
    if request.path == "/throw":
        raise RuntimeError("boom")
    if request.path == "/sleep":
        time.sleep(5)
        return "late"
    if request.path == "/text":
        return "hello " + event["data"]["name"]
    if request.path == "/created":
        event["extensions"]["response"].status = 201
        event["extensions"]["response"].headers["x-custom"] = "yes"
        return {"created": True}
    if request.path == "/emit":
        event_id = "emitted-%d" % time.time_ns()
        event.emitCloudEvent("order.emitted.v1", "python-fn", {"from": "python"}, {"id": event_id})
        return {"id": event_id}
    names = ["GREETING", "FUNC_NAME", "FUNC_NAMESPACE", "FUNC_RUNTIME", "FUNC_PORT", "FUNC_TIMEOUT",
             "PUBLISHER_PROXY_ADDRESS", "CARGO_PKG_NAME"]
    return {
        "data": event["data"],
        "type": event.get("ce-type"), "source": event.get("ce-source"), "id": event.get("ce-id"),
        "subject": event.get("ce-subject"),
        "context": context,
        "method": request.method, "path": request.path,
        "query": "?" + "&".join(k + "=" + v for k, v in request.query.items()) if request.query else "",
        "header": request.headers.get("x-test"),
        "env": {name: os.environ.get(name) for name in names},
    }
"#;

fn spec(runtime: &str, source: &str) -> Value {
    json!({
        "runtime": runtime,
        "source": {"inline": {"source": source}},
        "env": [{"name": "GREETING", "value": "hi"}],
        "timeoutSeconds": 2,
    })
}

async fn check_runtime(platform: &Platform, name: &str, runtime: &str, source: &str) {
    platform.deploy(name, spec(runtime, source)).await;
    let function = platform.function(name).await;
    assert_eq!(
        function["status"]["url"],
        format!("{}/default/{name}", platform.gateway)
    );
    assert_eq!(function["status"]["replicas"], 1);
    let (build, reason, _) = platform.condition(name, "BuildReady").await;
    assert_eq!(build, "True", "{reason}");

    let response = platform
        .invoke(name, "/orders/7?x=1")
        .header("ce-specversion", "1.0")
        .header("ce-type", "order.created.v1")
        .header("ce-source", "shop")
        .header("ce-id", "e-1")
        .header("ce-subject", "a%20b")
        .header("x-test", "kept")
        .json(&json!({"sku": "A-1", "qty": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/json")
    );
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["data"], json!({"sku": "A-1", "qty": 2}), "{body}");
    assert_eq!(body["type"], "order.created.v1");
    assert_eq!(body["source"], "shop");
    assert_eq!(body["id"], "e-1");
    assert_eq!(body["subject"], "a b", "ce-* values are percent-decoded");
    // As a Subscription in Kyma's form delivers it (CloudEvents' Go SDK's way): raw UTF-8, read
    // as it is, its `%` kept.
    let raw = platform
        .invoke(name, "/")
        .header("ce-specversion", "1.0")
        .header("ce-type", "order.created.v1")
        .header("ce-source", "shop")
        .header("ce-id", "e-2")
        .header(
            "ce-subject",
            reqwest::header::HeaderValue::from_bytes("100% über".as_bytes()).unwrap(),
        )
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status(), 200);
    let raw: Value = raw.json().await.unwrap();
    assert_eq!(raw["subject"], "100% über", "raw UTF-8 is read as it is");
    assert_eq!(body["method"], "POST");
    assert_eq!(body["path"], "/orders/7");
    assert_eq!(body["query"], "?x=1");
    assert_eq!(body["header"], "kept");
    assert_eq!(body["context"]["function-name"], name);
    assert_eq!(body["context"]["namespace"], "default");
    assert_eq!(body["context"]["timeout"].as_f64(), Some(2.0));
    assert_eq!(body["context"]["runtime"], runtime);
    let env = &body["env"];
    assert_eq!(env["GREETING"], "hi");
    assert_eq!(env["FUNC_NAME"], name);
    assert_eq!(env["FUNC_NAMESPACE"], "default");
    assert_eq!(env["FUNC_RUNTIME"], runtime);
    assert_eq!(env["FUNC_TIMEOUT"], "2");
    assert!(env["FUNC_PORT"].as_str().unwrap().parse::<u16>().is_ok());
    assert_eq!(
        env["PUBLISHER_PROXY_ADDRESS"],
        format!("{}/publish", platform.bus)
    );
    assert_eq!(
        env["CARGO_PKG_NAME"],
        Value::Null,
        "instances get only their own env"
    );

    let response = platform
        .invoke(name, "/text")
        .json(&json!({"name": "eddy"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    // A string answer: Kyma's Python runtime sends it as bottle does (text/html).
    let text_type = if runtime.starts_with("nodejs") {
        "text/plain"
    } else {
        "text/html"
    };
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with(text_type)
    );
    assert_eq!(response.text().await.unwrap(), "hello eddy");

    let response = platform.invoke(name, "/created").send().await.unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(response.headers()["x-custom"], "yes");
    assert_eq!(
        response.json::<Value>().await.unwrap(),
        json!({"created": true})
    );

    let response = platform.invoke(name, "/throw").send().await.unwrap();
    assert_eq!(response.status(), 500);
    let response = platform.invoke(name, "/sleep").send().await.unwrap();
    // Kyma's runtimes answer a call past FUNC_TIMEOUT with 408.
    assert_eq!(response.status(), 408);

    // The handler's error went to the function's log.
    let log = platform.function_log(name).await;
    assert!(log.contains("boom"), "{log}");

    // emitCloudEvent publishes through the event-bus into JetStream.
    let response = platform.invoke(name, "/emit").send().await.unwrap();
    assert_eq!(response.status(), 200);
    let id = response.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut stream = platform.js.get_stream("EDDY_EVENTS").await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let stored = stream.get_raw_message(last).await.unwrap();
    assert_eq!(stored.headers.get("ce-id").unwrap().as_str(), id);
    assert_eq!(
        stored.headers.get("ce-type").unwrap().as_str(),
        "order.emitted.v1"
    );
}

#[tokio::test]
async fn nodejs20_functions_serve_the_runtime_contract() {
    let platform = Platform::start().await;
    check_runtime(&platform, "node-fn", "nodejs20", NODE_HANDLER).await;
}

#[tokio::test]
async fn python311_functions_serve_the_runtime_contract() {
    let platform = Platform::start().await;
    check_runtime(&platform, "python-fn", "python311", PYTHON_HANDLER).await;
}

#[tokio::test]
async fn unknown_functions_get_404() {
    let platform = Platform::start().await;
    let response = platform.invoke("nope", "/").send().await.unwrap();
    assert_eq!(response.status(), 404);
    assert!(
        response.json::<Value>().await.unwrap()["error"]
            .as_str()
            .unwrap()
            .contains("nope")
    );
    let response = platform
        .http
        .get(format!("{}/default", platform.gateway))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
}

#[tokio::test]
async fn a_build_that_fails_is_reported_and_harms_nothing_else() {
    let platform = Platform::start().await;
    platform
        .deploy("healthy", spec("nodejs20", NODE_HANDLER))
        .await;
    let (status, body) = platform
        .put_function(
            "broken-deps",
            json!({"runtime": "python311", "source": {"inline": {
                "source": "def main(event, context):\n    return 'never'\n",
                "dependencies": "=== this is not a requirement\n"}}}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    eventually("the build to fail", Duration::from_secs(60), || async {
        platform.condition("broken-deps", "BuildReady").await.0 == "False"
    })
    .await
    .unwrap();
    let (_, reason, message) = platform.condition("broken-deps", "BuildReady").await;
    assert_eq!(reason, "DependencyInstallFailed");
    assert!(message.contains("requirement"), "{message}");
    let response = platform.invoke("broken-deps", "/").send().await.unwrap();
    assert_eq!(response.status(), 503);
    // The platform and the other function are fine.
    let response = platform
        .invoke("healthy", "/text")
        .json(&json!({"name": "still"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.text().await.unwrap(), "hello still");
    assert_eq!(
        platform
            .http
            .get(format!("{}/readyz", platform.bus))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
}

#[tokio::test]
async fn invalid_functions_are_refused_with_422() {
    let platform = Platform::start().await;
    let (status, body) = platform
        .put_function(
            "bad",
            json!({"runtime": "nodejs20", "source": {"inline": {"source": ""}},
                "env": [{"name": "FUNC_PORT", "value": "1"}], "scaleConfig": {"minReplicas": 2, "maxReplicas": 1}}),
        )
        .await;
    assert_eq!(status, 422);
    let fields: Vec<&str> = body["details"]["causes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["field"].as_str().unwrap())
        .collect();
    assert_eq!(
        fields,
        vec![
            "spec.source.inline.source",
            "spec.env[0].name",
            "spec.scaleConfig.maxReplicas"
        ]
    );
    let (status, body) = platform
        .put_function(
            "bad",
            json!({"runtime": "cobol", "source": {"inline": {"source": "x"}}}),
        )
        .await;
    assert_eq!(status, 422);
    assert_eq!(
        body["details"]["causes"][0]["field"], "spec.runtime",
        "{body}"
    );
}

#[tokio::test]
async fn a_killed_instance_is_restarted_and_invocations_succeed_again() {
    let platform = Platform::start().await;
    platform
        .deploy("phoenix", spec("nodejs20", NODE_HANDLER))
        .await;
    let pids = platform.pids("phoenix");
    assert_eq!(pids.len(), 1);
    let killed = pids[0];
    std::process::Command::new("kill")
        .args(["-9", &killed.to_string()])
        .status()
        .unwrap();
    eventually("a new instance", Duration::from_secs(30), || async {
        let pids = platform.pids("phoenix");
        !pids.is_empty() && !pids.contains(&killed)
    })
    .await
    .unwrap();
    eventually("invocations to succeed again", Duration::from_secs(30), || async {
        matches!(platform.invoke("phoenix", "/text").json(&json!({"name": "again"})).send().await,
            Ok(r) if r.status() == 200)
    })
    .await
    .unwrap();
    eventually(
        "the restart to show in status",
        Duration::from_secs(10),
        || async {
            platform
                .condition("phoenix", "Running")
                .await
                .2
                .contains("restarted 1 time(s)")
        },
    )
    .await
    .unwrap();
}

/// A platform whose functions scale to zero after half a second idle.
fn idle_quickly() -> Options {
    Options {
        scale_to_zero_after: Duration::from_millis(500),
        scale_down_window: Duration::from_millis(500),
        ..Options::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_functions_scale_to_zero_and_start_on_the_next_request() {
    let platform = Platform::start_with(idle_quickly()).await;
    let mut spec = spec("nodejs20", NODE_HANDLER);
    spec["scaleConfig"] = json!({"minReplicas": 0, "maxReplicas": 2});
    platform.deploy("sleepy", spec).await;
    eventually("no instance to run", Duration::from_secs(20), || async {
        platform.pids("sleepy").is_empty()
    })
    .await
    .unwrap();
    eventually(
        "status to say scaled to zero",
        Duration::from_secs(10),
        || async { platform.condition("sleepy", "Running").await.1 == "ScaledToZero" },
    )
    .await
    .unwrap();
    let response = platform
        .invoke("sleepy", "/text")
        .json(&json!({"name": "awake"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.unwrap(), "hello awake");
    assert_eq!(platform.pids("sleepy").len(), 1);
}

/// The gateway's `/metrics` per function: each call by status class with its duration, 5xx
/// answers as errors, a start from zero as a cold start whose wait is measured, the ready
/// instances; the series go with the Function.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_counts_calls_errors_cold_starts_and_instances_per_function() {
    let platform = Platform::start_with(Options {
        scale_to_zero_after: Duration::from_secs(2),
        scale_down_window: Duration::from_millis(500),
        ..Options::default()
    })
    .await;
    let mut spec = spec("nodejs20", NODE_HANDLER);
    spec["scaleConfig"] = json!({"minReplicas": 0, "maxReplicas": 1});
    platform.deploy("counted", spec).await;
    eventually("no instance to run", Duration::from_secs(20), || async {
        platform.pids("counted").is_empty()
    })
    .await
    .unwrap();
    let metrics_url = format!("{}/metrics", platform.gateway);
    let before = platform.get_text(&metrics_url).await;
    assert!(
        before.contains(r#"eddy_function_instances{namespace="default",function="counted"} 0"#),
        "{before}"
    );
    let waits_before = counter(&before, "eddy_function_queue_wait_seconds_count");
    let cold_before = counter(&before, "eddy_function_cold_starts_total");

    for (path, status) in [
        ("/text", 200),
        ("/text", 200),
        ("/throw", 500),
        ("/created", 201),
    ] {
        let response = platform
            .invoke("counted", path)
            .json(&json!({"name": "metrics"}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), status, "{path}");
    }
    let after = platform.get_text(&metrics_url).await;
    for line in [
        r#"eddy_function_calls_total{namespace="default",function="counted",status_class="2xx"} 3"#,
        r#"eddy_function_calls_total{namespace="default",function="counted",status_class="5xx"} 1"#,
        r#"eddy_function_calls_total{namespace="default",function="counted",status_class="4xx"} 0"#,
        r#"eddy_function_errors_total{namespace="default",function="counted"} 1"#,
        r#"eddy_function_duration_seconds_count{namespace="default",function="counted"} 4"#,
        r#"eddy_function_instances{namespace="default",function="counted"} 1"#,
    ] {
        assert!(after.contains(line), "{line} missing from\n{after}");
    }
    // The first call found no instance: it waited for the one started for it.
    assert_eq!(
        counter(&after, "eddy_function_cold_starts_total"),
        cold_before + 1
    );
    assert_eq!(
        counter(&after, "eddy_function_queue_wait_seconds_count"),
        waits_before + 1
    );

    platform.delete_function("counted").await;
    eventually(
        "the deleted function's series to go",
        Duration::from_secs(20),
        || async { !platform.get_text(&metrics_url).await.contains("counted") },
    )
    .await
    .unwrap();
}

/// The value of `name{namespace="default",function="counted"}` in a metrics text.
fn counter(text: &str, name: &str) -> u64 {
    sample(
        text,
        &format!(r#"{name}{{namespace="default",function="counted"}}"#),
    ) as u64
}

/// A function from zero takes a warm spare (a runtime server started ahead, libraries loaded)
/// and behaves as a cold start would: its own environment, directory, package isolation and log,
/// and none of the spare's. A replacement spare follows. A function whose env sets what Node.js
/// reads only at start-up (`NODE_OPTIONS`) starts cold, and that setting takes effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_zero_an_instance_starts_from_a_warm_spare_as_a_cold_one_would() {
    let platform = Platform::start_with(idle_quickly()).await;
    // Where Node.js would find a package from the build directory, were it not kept out.
    let host_package = platform.data_dir.path().join("node_modules/host-only");
    std::fs::create_dir_all(&host_package).unwrap();
    std::fs::write(host_package.join("index.js"), "module.exports = 'host';").unwrap();
    let node = r#"
module.exports = { main: async () => {
  console.log("a line from the instance");
  let hostOnly;
  try { require("host-only"); hostOnly = "loaded"; } catch (error) { hostOnly = error.code; }
  return { pid: process.pid, cwd: process.cwd(), home: process.env.HOME, name: process.env.FUNC_NAME,
    greeting: process.env.GREETING, spare: process.env.EDDY_SPARE || null,
    secret: process.env.EDDY_INSTANCE_SECRET || null, title: process.title, hostOnly,
    express: typeof require("express") };
} };
"#;
    let python = r#"
import os
import sys


def main(event, context):
    print("a line from the instance", flush=True)
    return {"pid": os.getpid(), "cwd": os.getcwd(), "home": os.environ.get("HOME"),
            "name": os.environ.get("FUNC_NAME"), "greeting": os.environ.get("GREETING"),
            "spare": os.environ.get("EDDY_SPARE"), "secret": os.environ.get("EDDY_INSTANCE_SECRET"),
            "path": sys.path}
"#;
    let scale = json!({"minReplicas": 0, "maxReplicas": 1});
    let greeting = json!([{"name": "GREETING", "value": "hi"}]);
    for (name, runtime, source, env) in [
        ("warm-node", "nodejs20", node, greeting.clone()),
        ("warm-python", "python311", python, greeting.clone()),
        (
            "cold-node",
            "nodejs20",
            node,
            json!([{"name": "NODE_OPTIONS", "value": "--title=eddy-cold-start"}]),
        ),
    ] {
        platform
            .deploy(
                name,
                json!({"runtime": runtime, "source": {"inline": {"source": source}},
                    "env": env, "scaleConfig": scale}),
            )
            .await;
    }
    let spares = platform.backend.spares().expect("spares are on by default");
    for name in ["warm-node", "warm-python", "cold-node"] {
        eventually(
            &format!("{name} to scale to zero"),
            Duration::from_secs(20),
            || async { platform.condition(name, "Running").await.1 == "ScaledToZero" },
        )
        .await
        .unwrap();
    }
    for (name, runtime) in [
        ("warm-node", eddy_model::resources::Runtime::Nodejs20),
        ("warm-python", eddy_model::resources::Runtime::Python311),
    ] {
        eventually(
            &format!("a loaded spare of {}", runtime.as_str()),
            Duration::from_secs(30),
            || async { spares.ready(runtime) == 1 },
        )
        .await
        .unwrap();
        let waiting = spares.idle_pids(runtime);
        let starts_before = instance_starts(&platform, name).await;
        let answer: Value = platform
            .invoke(name, "/")
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let pid = u32::try_from(answer["pid"].as_u64().unwrap()).unwrap();
        assert!(
            waiting.contains(&pid),
            "{name} runs in the spare that waited ({waiting:?}): {answer}"
        );
        assert_eq!(platform.pids(name), vec![pid]);
        // Counted as a start from a warm spare.
        let (warm, process) = starts_before;
        assert_eq!(
            instance_starts(&platform, name).await,
            (warm + 1, process),
            "{name}"
        );
        let build_dir = std::fs::canonicalize(answer["cwd"].as_str().unwrap()).unwrap();
        assert!(
            build_dir.starts_with(
                std::fs::canonicalize(platform.data_dir.path().join("builds")).unwrap()
            ),
            "{answer}"
        );
        assert_eq!(answer["home"], answer["cwd"], "{answer}");
        assert_eq!(answer["name"], name);
        assert_eq!(answer["greeting"], "hi");
        assert_eq!(answer["spare"], Value::Null, "{answer}");
        assert_eq!(answer["secret"], Value::Null, "{answer}");
        if runtime == eddy_model::resources::Runtime::Nodejs20 {
            assert_eq!(answer["hostOnly"], "MODULE_NOT_FOUND", "{answer}");
            assert_eq!(answer["express"], "function", "{answer}");
        } else {
            // As a server started in the build directory has it, and nothing of the spare's.
            let path: Vec<&str> = answer["path"]
                .as_array()
                .unwrap()
                .iter()
                .map(|entry| entry.as_str().unwrap())
                .collect();
            assert!(path.contains(&answer["cwd"].as_str().unwrap()), "{answer}");
            let spares_dir = platform.data_dir.path().join("spares");
            assert!(
                !path
                    .iter()
                    .any(|entry| entry.starts_with(spares_dir.to_str().unwrap())),
                "{answer}"
            );
        }
        eventually(
            &format!("{name}'s output in its log"),
            Duration::from_secs(10),
            || async {
                platform
                    .function_log(name)
                    .await
                    .contains("a line from the instance")
            },
        )
        .await
        .unwrap();
        eventually(
            &format!(
                "a new spare of {} in place of the used one",
                runtime.as_str()
            ),
            Duration::from_secs(30),
            || async { spares.ready(runtime) == 1 && !spares.idle_pids(runtime).contains(&pid) },
        )
        .await
        .unwrap();
    }
    let waiting = spares.idle_pids(eddy_model::resources::Runtime::Nodejs20);
    let (warm, process) = instance_starts(&platform, "cold-node").await;
    let answer: Value = platform
        .invoke("cold-node", "/")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(answer["title"], "eddy-cold-start", "{answer}");
    let pid = u32::try_from(answer["pid"].as_u64().unwrap()).unwrap();
    assert!(!waiting.contains(&pid), "started cold: {answer}");
    assert_eq!(
        instance_starts(&platform, "cold-node").await,
        (warm, process + 1)
    );
}

/// The instances of `function` (namespace `default`) started so far, as the gateway's
/// `/metrics` counts them: from a warm spare, and as a process of their own.
async fn instance_starts(platform: &Platform, function: &str) -> (u64, u64) {
    let text = platform
        .get_text(&format!("{}/metrics", platform.gateway))
        .await;
    let count = |origin: &str| {
        // A counter: a whole number, exact as f64.
        sample(
            &text,
            &format!(
                r#"eddy_function_instance_starts_total{{namespace="default",function="{function}",origin="{origin}"}}"#
            ),
        ) as u64
    };
    (count("warm_spare"), count("process"))
}

/// With `--warm-spares 0` no spare is kept, and every instance is a process started for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_spares_can_be_turned_off() {
    let platform = Platform::start_with(Options {
        warm_spares: 0,
        ..Options::default()
    })
    .await;
    assert!(platform.backend.spares().is_none());
    platform
        .deploy(
            "no-spares",
            json!({"runtime": "nodejs20",
                "source": {"inline": {"source": "module.exports = { main: () => 'ok' };"}}}),
        )
        .await;
    let answer = platform.invoke("no-spares", "/").send().await.unwrap();
    assert_eq!(answer.status(), 200);
    // What the process started with: a spare's environment says EDDY_SPARE, an instance's
    // started for it says FUNC_NAME.
    let pids = platform.pids("no-spares");
    assert_eq!(pids.len(), 1);
    let environ = std::fs::read(format!("/proc/{}/environ", pids[0])).unwrap();
    let environ = String::from_utf8_lossy(&environ);
    assert!(
        environ.split('\0').any(|v| v == "FUNC_NAME=no-spares"),
        "{environ}"
    );
    assert!(!environ.contains("EDDY_SPARE"), "{environ}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updating_source_under_load_fails_no_request() {
    let platform = Arc::new(Platform::start().await);
    let v1 = "module.exports = { main: async () => 'v1' };";
    let v2 = "module.exports = { main: async () => 'v2' };";
    platform
        .deploy(
            "rolling",
            json!({"runtime": "nodejs20", "source": {"inline": {"source": v1}}}),
        )
        .await;

    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(AtomicUsize::new(0));
    let seen_v2 = Arc::new(AtomicUsize::new(0));
    let mut loops = Vec::new();
    for _ in 0..4 {
        let (platform, stop, failures, seen_v2) = (
            platform.clone(),
            stop.clone(),
            failures.clone(),
            seen_v2.clone(),
        );
        loops.push(tokio::spawn(async move {
            let mut total = 0;
            while !stop.load(Ordering::SeqCst) {
                total += 1;
                match platform.invoke("rolling", "/").send().await {
                    Ok(response) if response.status() == 200 => {
                        let text = response.text().await.unwrap_or_default();
                        if text == "v2" {
                            seen_v2.fetch_add(1, Ordering::SeqCst);
                        } else if text != "v1" {
                            failures.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    Ok(response) => {
                        eprintln!("failed: {}", response.status());
                        failures.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(error) => {
                        eprintln!("failed: {error}");
                        failures.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
            total
        }));
    }
    platform
        .deploy(
            "rolling",
            json!({"runtime": "nodejs20", "source": {"inline": {"source": v2}}}),
        )
        .await;
    let before = seen_v2.load(Ordering::SeqCst);
    eventually(
        "new requests to get v2",
        Duration::from_secs(30),
        || async { seen_v2.load(Ordering::SeqCst) > before + 50 },
    )
    .await
    .unwrap();
    stop.store(true, Ordering::SeqCst);
    let mut total = 0;
    for handle in loops {
        total += handle.await.unwrap();
    }
    println!(
        "rolling update: {total} requests, {} failed",
        failures.load(Ordering::SeqCst)
    );
    assert_eq!(failures.load(Ordering::SeqCst), 0);
    // Once v2 is out, nothing answers v1 any more.
    for _ in 0..20 {
        assert_eq!(
            platform
                .invoke("rolling", "/")
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap(),
            "v2"
        );
    }
    eventually(
        "the old instance to stop",
        Duration::from_secs(20),
        || async { platform.pids("rolling").len() == 1 },
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn deleting_a_function_stops_its_instances() {
    let platform = Platform::start().await;
    platform
        .deploy("ephemeral", spec("python311", PYTHON_HANDLER))
        .await;
    let pids = platform.pids("ephemeral");
    assert_eq!(pids.len(), 1);
    platform.delete_function("ephemeral").await;
    eventually("the instance to stop", Duration::from_secs(20), || async {
        let alive = std::path::Path::new(&format!("/proc/{}", pids[0])).exists();
        !alive && platform.pids("ephemeral").is_empty()
    })
    .await
    .unwrap();
    eventually(
        "the gateway to forget it",
        Duration::from_secs(10),
        || async {
            platform
                .invoke("ephemeral", "/")
                .send()
                .await
                .unwrap()
                .status()
                == 404
        },
    )
    .await
    .unwrap();
}

/// A process a function started in a session of its own (a detached child, `setsid`) leaves
/// the function's process group; it is stopped with the function all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detached_child_of_a_function_goes_with_it() {
    let platform = Platform::start().await;
    let source = r#"
        const { spawn } = require("child_process");
        let child;
        module.exports = { main: () => {
            child ??= spawn("sleep", ["300"], { detached: true, stdio: "ignore" });
            return { pid: child.pid };
        } };
    "#;
    platform
        .deploy(
            "spawner",
            json!({"runtime": "nodejs22", "source": {"inline": {"source": source}}}),
        )
        .await;
    let answer: serde_json::Value = platform
        .invoke("spawner", "/")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let pid = u32::try_from(answer["pid"].as_u64().unwrap()).unwrap();
    let gone = || eddy_testing::process_gone(pid);
    assert!(!gone(), "the detached child runs");
    platform.delete_function("spawner").await;
    eventually(
        "the detached child to stop",
        Duration::from_secs(30),
        || async { gone() },
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_scales_a_function_out_and_quiet_scales_it_back() {
    let platform = Arc::new(
        Platform::start_with(Options {
            target_concurrency: 2,
            scale_down_window: Duration::from_secs(1),
            ..Options::default()
        })
        .await,
    );
    let slow = "module.exports = { main: async () => { await new Promise((r) => setTimeout(r, 300)); return 'done'; } };";
    platform
        .deploy(
            "elastic",
            json!({"runtime": "nodejs20", "source": {"inline": {"source": slow}},
                "scaleConfig": {"minReplicas": 1, "maxReplicas": 4}}),
        )
        .await;
    assert_eq!(platform.pids("elastic").len(), 1);

    // Eight callers in a loop: eight in flight against a target of two per instance.
    let stop = Arc::new(AtomicBool::new(false));
    let mut callers = Vec::new();
    for _ in 0..8 {
        let (platform, stop) = (platform.clone(), stop.clone());
        callers.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let response = platform.invoke("elastic", "/").send().await.unwrap();
                assert_eq!(response.status(), 200);
            }
        }));
    }
    eventually(
        "four instances under load",
        Duration::from_secs(30),
        || async { platform.pids("elastic").len() == 4 },
    )
    .await
    .unwrap();
    stop.store(true, Ordering::SeqCst);
    for caller in callers {
        caller.await.unwrap();
    }
    eventually(
        "back to one instance when quiet",
        Duration::from_secs(30),
        || async { platform.pids("elastic").len() == 1 },
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn init_apply_invoke_and_logs_from_the_command_line() {
    let platform = Platform::start().await;
    let dir = tempfile::tempdir().unwrap();
    let eddy = |args: Vec<String>| {
        let api = platform.api.clone();
        async move {
            let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_eddy"))
                .args(&args)
                .env("EDDY_SERVER", api)
                .output()
                .await
                .unwrap();
            assert!(
                output.status.success(),
                "eddy {args:?}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            String::from_utf8_lossy(&output.stdout).into_owned()
        }
    };
    let dir_arg = dir.path().to_str().unwrap().to_owned();
    eddy(vec![
        "init".into(),
        "hello".into(),
        "--runtime".into(),
        "python311".into(),
        "--dir".into(),
        dir_arg,
    ])
    .await;
    let manifest = dir.path().join("hello/function.yaml");
    let out = eddy(vec![
        "apply".into(),
        "-f".into(),
        manifest.to_str().unwrap().into(),
    ])
    .await;
    assert_eq!(out.trim(), "function.eddy.dev/hello created");
    eventually("hello to run", Duration::from_secs(60), || async {
        platform.condition("hello", "Running").await.0 == "True"
    })
    .await
    .unwrap();
    let out = eddy(vec![
        "invoke".into(),
        "hello".into(),
        "--data".into(),
        r#"{"n": 1}"#.into(),
    ])
    .await;
    let answer: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(answer, json!({"hello": "from hello", "received": {"n": 1}}));
    eventually(
        "the handler's print in the log",
        Duration::from_secs(10),
        || async {
            let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_eddy"))
                .args(["logs", "hello"])
                .env("EDDY_SERVER", &platform.api)
                .output()
                .await
                .unwrap();
            String::from_utf8_lossy(&out.stdout).contains("hello got a request")
        },
    )
    .await
    .unwrap();
    let out = eddy(vec!["get".into(), "functions".into()]).await;
    assert!(
        out.contains("hello") && out.contains("python311") && out.contains("True"),
        "{out}"
    );
}

/// `--max-request-size` bounds what the gateway forwards (413, the limit named); the resource
/// API refuses bodies past its own limit the same way and keeps serving.
#[tokio::test]
async fn request_bodies_over_the_limits_get_413() {
    let platform = Platform::start_with(Options {
        max_request_size: bytesize::ByteSize::b(1024),
        ..Options::default()
    })
    .await;
    platform
        .deploy("small", spec("nodejs20", NODE_HANDLER))
        .await;
    let name = "n".repeat(1024 - r#"{"name":""}"#.len());
    let fits = json!({ "name": name }).to_string();
    assert_eq!(fits.len(), 1024);
    let response = platform
        .invoke("small", "/text")
        .header("content-type", "application/json")
        .body(fits)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let too_large = json!({ "name": format!("{name}x") }).to_string();
    let response = platform
        .invoke("small", "/text")
        .header("content-type", "application/json")
        .body(too_large)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 413);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"], "request body is over 1024 bytes", "{body}");

    // Past the API's request limit (more than a resource may weigh, 768 KiB): 413 before the
    // body is parsed, and the API answers the next request.
    let response = platform
        .http
        .put(format!(
            "{}/apis/eddy.dev/v1alpha1/namespaces/default/functions/huge",
            platform.api
        ))
        .header("content-type", "application/json")
        .body(vec![b' '; 3 * 1024 * 1024])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 413);
    assert_eq!(
        platform.function("small").await["metadata"]["name"],
        "small"
    );
}

/// A request for a function whose instance does not become ready within
/// `--activation-timeout` gets 503 then, not a hang; once the instance is ready it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_at_most_the_activation_timeout() {
    let platform = Platform::start_with(Options {
        activation_timeout: Duration::from_secs(1),
        scale_to_zero_after: Duration::from_secs(1),
        scale_down_window: Duration::from_secs(1),
        ..Options::default()
    })
    .await;
    // Ready only after its module has slept 6 s.
    let source = "import time\ntime.sleep(6)\n\ndef main(event, context):\n    return 'awake'\n";
    let (status, body) = platform
        .put_function(
            "slow-start",
            json!({"runtime": "python311", "source": {"inline": {"source": source}},
                "scaleConfig": {"minReplicas": 0, "maxReplicas": 1}}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    eventually("the build to finish", Duration::from_secs(120), || async {
        platform.condition("slow-start", "Running").await.1 == "ScaledToZero"
    })
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let response = platform.invoke("slow-start", "/").send().await.unwrap();
    let waited = started.elapsed();
    assert_eq!(response.status(), 503);
    let body: Value = response.json().await.unwrap();
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("no instance became ready in time")),
        "{body}"
    );
    // It waited for the instance (not refused at once), and gave up well before it was ready.
    assert!(
        waited >= Duration::from_secs(1) && waited < Duration::from_secs(6),
        "{waited:?}"
    );
    eventually(
        "the started instance to serve",
        Duration::from_secs(60),
        || async {
            match platform.invoke("slow-start", "/").send().await {
                Ok(response) if response.status() == 200 => {
                    response.text().await.unwrap_or_default() == "awake"
                }
                _ => false,
            }
        },
    )
    .await
    .unwrap();
}

/// An update whose code does not start leaves the old instances serving, and the status says why:
/// Running describes the newest version, False (`DeploymentFailed`, as Kyma's controller says
/// of a rollout that fails), naming the previous version that keeps serving.
#[tokio::test]
async fn a_failed_update_keeps_the_old_instances_serving() {
    let platform = Platform::start().await;
    let v1 = "def main(event, context):\n    return 'v1'\n";
    platform
        .deploy(
            "steady",
            json!({"runtime": "python311", "source": {"inline": {"source": v1}}}),
        )
        .await;
    let old_pids = platform.pids("steady");
    assert_eq!(old_pids.len(), 1);
    let broken =
        "import sys\nsys.exit('v2 cannot start')\n\ndef main(event, context):\n    return 'v2'\n";
    let (status, body) = platform
        .put_function(
            "steady",
            json!({"runtime": "python311", "source": {"inline": {"source": broken}}}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let failing = eventually(
        "the status to say the new instances fail",
        Duration::from_secs(120),
        || async {
            let (state, reason, _) = platform.condition("steady", "Running").await;
            state == "False" && reason == "DeploymentFailed"
        },
    )
    .await;
    if let Err(error) = failing {
        panic!("{error}: {}", platform.function("steady").await);
    }
    let (_, _, message) = platform.condition("steady", "Running").await;
    assert!(
        message.starts_with("the newest version does not start (")
            && message.ends_with(
                "last: instance exited during start-up (exit status: 1); see `eddy logs \
                 steady`; the previous version keeps serving with 1 instance(s) ready"
            ),
        "{message}"
    );
    assert!(
        platform
            .function_log("steady")
            .await
            .contains("v2 cannot start"),
        "the reason is in the function's log"
    );
    for _ in 0..5 {
        let response = platform.invoke("steady", "/").send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.text().await.unwrap(), "v1");
    }
    assert!(
        platform.pids("steady").contains(&old_pids[0]),
        "the old instance still runs"
    );
}

/// An instance that stops accepting connections is passed over: requests go to another
/// instance at once and none fails; the silent one is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_retried_on_another_instance() {
    let platform = Platform::start().await;
    let source = r#"
module.exports = {
  main: async (event) => {
    const req = event.extensions.request;
    if (req.path === "/stop-listening") {
      // New connections are refused from now on; this one closes after the answer.
      req.socket.server.close();
      event.extensions.response.set("connection", "close");
      return "closed " + process.pid;
    }
    return "served by " + process.pid;
  },
};
"#;
    platform
        .deploy(
            "pair",
            json!({"runtime": "nodejs20", "source": {"inline": {"source": source}},
                "scaleConfig": {"minReplicas": 2, "maxReplicas": 2}}),
        )
        .await;
    eventually("two instances", Duration::from_secs(60), || async {
        platform.function("pair").await["status"]["replicas"] == 2
    })
    .await
    .unwrap();
    let closed = platform
        .invoke("pair", "/stop-listening")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let closed_pid = closed.strip_prefix("closed ").unwrap().to_owned();
    for i in 0..20 {
        let response = platform.invoke("pair", "/").send().await.unwrap();
        let status = response.status();
        let text = response.text().await.unwrap();
        assert_eq!(status, 200, "request {i}: {text}");
        assert!(text.starts_with("served by "), "{text}");
        assert_ne!(text, format!("served by {closed_pid}"));
    }
    eventually(
        "the instance that stopped listening to be replaced",
        Duration::from_secs(30),
        || async {
            let pids = platform.pids("pair");
            pids.len() == 2 && !pids.iter().any(|pid| pid.to_string() == closed_pid)
        },
    )
    .await
    .unwrap();
}

/// A Node.js function with one dependency, so its build runs the npm installer.
fn with_dependency() -> Value {
    json!({"runtime": "nodejs20", "source": {"inline": {
        "source": "module.exports = { main: () => 'never' };",
        "dependencies": r#"{"dependencies": {"left-pad": "1.3.0"}}"#}}})
}

/// Installs the suite's shared copy of `runtime`'s own libraries now, with the real tools and
/// the default timeout: a test that breaks the installer on purpose must only break the install
/// of its function's dependencies (on a fresh clone the runtime's libraries are not there yet).
async fn runtime_installed(runtime: eddy_model::resources::Runtime) {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let toolchain = eddy_controller::local::toolchain::Toolchain::new(
        "node".into(),
        "npm".into(),
        "python3".into(),
        repo.join(".tools"),
        repo.join("target/eddy-runtimes"),
        Duration::from_secs(300),
    );
    if let Err(failure) = toolchain.prepare(runtime).await {
        panic!("{runtime:?}: {}", failure.message);
    }
}

/// An install that outlasts `--build-timeout` is stopped together with what it started, and
/// the Function says `BuildTimeout` with the log's tail; no instance is started.
#[tokio::test]
async fn a_build_over_its_timeout_is_stopped_and_reported() {
    runtime_installed(eddy_model::resources::Runtime::Nodejs20).await;
    let tools = tempfile::tempdir().unwrap();
    let child_pid = tools.path().join("child.pid");
    // `npm install` (the function's dependencies) hangs with a child of its own; the
    // runtime's libraries still come from the real npm.
    let npm = tools.path().join("npm");
    std::fs::write(
        &npm,
        format!(
            "#!/bin/sh\nif [ \"$1\" = install ]; then\n  echo installing slowly\n  sleep 300 &\n  \
             echo $! > {}\n  wait\nfi\nexec npm \"$@\"\n",
            child_pid.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&npm, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let platform = Platform::start_with(Options {
        build_timeout: Duration::from_secs(2),
        npm,
        ..Options::default()
    })
    .await;
    let (status, body) = platform.put_function("slow-deps", with_dependency()).await;
    assert_eq!(status, 201, "{body}");
    eventually("the build to fail", Duration::from_secs(120), || async {
        platform.condition("slow-deps", "BuildReady").await.0 == "False"
    })
    .await
    .unwrap();
    let (_, reason, message) = platform.condition("slow-deps", "BuildReady").await;
    assert_eq!(reason, "BuildTimeout");
    assert!(
        message.starts_with("installing dependencies took longer than 2s")
            && message.contains("installing slowly"),
        "{message}"
    );
    // What the installer started is gone with it.
    let pid = std::fs::read_to_string(&child_pid).unwrap();
    eventually(
        "the installer's child to be stopped",
        Duration::from_secs(10),
        || async { !std::path::Path::new(&format!("/proc/{}", pid.trim())).exists() },
    )
    .await
    .unwrap();
    assert!(platform.pids("slow-deps").is_empty());
    let response = platform.invoke("slow-deps", "/").send().await.unwrap();
    assert_eq!(response.status(), 503);
}

/// An installer that cannot be run is `BuildToolMissing`, naming it; no instance is started.
#[tokio::test]
async fn a_missing_build_tool_is_named() {
    runtime_installed(eddy_model::resources::Runtime::Nodejs20).await;
    let platform = Platform::start_with(Options {
        npm: "/nonexistent/npm".into(),
        ..Options::default()
    })
    .await;
    let (status, body) = platform.put_function("no-npm", with_dependency()).await;
    assert_eq!(status, 201, "{body}");
    eventually("the build to fail", Duration::from_secs(120), || async {
        platform.condition("no-npm", "BuildReady").await.0 == "False"
    })
    .await
    .unwrap();
    let (_, reason, message) = platform.condition("no-npm", "BuildReady").await;
    assert_eq!(reason, "BuildToolMissing");
    assert!(message.contains("cannot run /nonexistent/npm"), "{message}");
    assert!(platform.pids("no-npm").is_empty());
    let (state, running_reason, _) = platform.condition("no-npm", "Running").await;
    assert_ne!(state, "True", "{running_reason}");
}

/// `eddy logs NAME -f` prints what the function writes while it runs, as it happens, until
/// stopped.
#[tokio::test]
async fn logs_follow_prints_new_lines_as_they_are_written() {
    use tokio::io::AsyncBufReadExt as _;
    let platform = Platform::start().await;
    let source = r#"
module.exports = { main: (event) => {
  console.log("call " + event.extensions.request.query.n);
  return "logged";
} };
"#;
    platform
        .deploy(
            "chatty",
            json!({"runtime": "nodejs20", "source": {"inline": {"source": source}}}),
        )
        .await;
    platform
        .invoke("chatty", "/?n=before")
        .send()
        .await
        .unwrap();
    let mut follow = tokio::process::Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(["logs", "chatty", "-f"])
        .env("EDDY_SERVER", &platform.api)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(follow.stdout.take().unwrap()).lines();
    let mut next_line_with = async |wanted: &str| {
        tokio::time::timeout(Duration::from_secs(20), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if line.contains(wanted) {
                    return line;
                }
            }
            panic!("eddy logs -f ended before {wanted:?}");
        })
        .await
        .unwrap_or_else(|_| panic!("no {wanted:?} from eddy logs -f within 20 s"))
    };
    // What was there already, then each new call as it is made.
    next_line_with("call before").await;
    for n in ["one", "two"] {
        let response = platform
            .invoke("chatty", &format!("/?n={n}"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        next_line_with(&format!("call {n}")).await;
    }
    assert!(
        follow.try_wait().unwrap().is_none(),
        "still following after the last line"
    );
    follow.kill().await.unwrap();
}

/// With `--isolation cgroup` each instance runs in a control group of its own. Its Function's
/// memory limit holds (XS: 256Mi, as in Kyma; allocating 1 GiB gets the instance killed, and the status says
/// it ran out of memory), its processes and threads are capped (`--max-function-tasks`), and a
/// daemon that left its process group and its parent (which `--isolation none` cannot find at
/// stop) goes with the function.
#[tokio::test]
async fn isolated_instances_keep_to_their_limits_and_leave_nothing_behind_as_root() {
    let platform = Platform::start_with(Options {
        isolation: eddy_controller::Isolation::Cgroup,
        max_function_tasks: 64,
        ..Options::default()
    })
    .await;
    let source = r#"
        const { spawn, execSync } = require("child_process");
        const held = [];
        module.exports = { main: (event) => {
            const what = event.extensions.request.query.do;
            if (what === "daemon") {
                // setsid, and its parent shell exits at once: an orphan in a session of its own.
                const pid = execSync("setsid sh -c 'sleep 300 >/dev/null 2>&1 & echo $!'");
                return { pid: Number(String(pid).trim()) };
            }
            if (what === "fork") {
                let started = 0;
                for (let i = 0; i < 200; i++) {
                    const child = spawn("sleep", ["300"], { stdio: "ignore" });
                    child.on("error", () => {});
                    if (child.pid) { started++; held.push(child); }
                }
                return { started };
            }
            if (what === "escape") {
                // What the attack probe did as root: raise its own task cap, move itself to
                // the root cgroups. Each write's outcome, and the capabilities it has.
                const fs = require("fs");
                const tried = {};
                for (const line of fs.readFileSync("/proc/self/cgroup", "utf8").trim().split("\n")) {
                    const [, controllers, path] = line.split(":");
                    const base = "/sys/fs/cgroup" + (controllers ? "/" + controllers.replace(/^name=/, "") : "");
                    for (const [file, value] of [[base + path + "/pids.max", "max"],
                                                 [base + "/cgroup.procs", String(process.pid)]]) {
                        try { fs.writeFileSync(file, value); tried[file] = "written"; }
                        catch (error) { tried[file] = error.code; }
                    }
                }
                const capabilities = /CapEff:\s*(\w+)/.exec(fs.readFileSync("/proc/self/status", "utf8"))[1];
                return { tried, capabilities, uid: process.getuid() };
            }
            if (what === "peek") {
                // Another function's memory and environment, where its secrets are.
                const fs = require("fs");
                const pid = event.extensions.request.query.pid;
                const seen = {};
                for (const file of ["mem", "environ"]) {
                    try { fs.closeSync(fs.openSync(`/proc/${pid}/${file}`, "r")); seen[file] = "opened"; }
                    catch (error) { seen[file] = error.code; }
                }
                return seen;
            }
            if (what === "alloc") {
                for (let i = 0; i < 64; i++) { held.push(Buffer.alloc(16 * 1024 * 1024, 1)); }
                return { allocated: held.length };
            }
            return "ok";
        } };
    "#;
    platform
        .deploy(
            "confined",
            json!({"runtime": "nodejs22", "source": {"inline": {"source": source}},
                "resourceConfiguration": {"function": {"profile": "XS"}}}),
        )
        .await;
    let call = |what: &str| {
        let request = platform.invoke("confined", &format!("/?do={what}"));
        async move {
            let response = request.send().await.unwrap();
            let status = response.status();
            (status, response.text().await.unwrap())
        }
    };

    let (status, body) = call("daemon").await;
    assert_eq!(status, 200, "{body}");
    let daemon: u32 = serde_json::from_str::<serde_json::Value>(&body).unwrap()["pid"]
        .as_u64()
        .unwrap()
        .try_into()
        .unwrap();
    assert!(!eddy_testing::process_gone(daemon), "the daemon runs");

    // The function cannot lift its own limits nor leave its cgroup (as root it used to).
    let (status, body) = call("escape").await;
    assert_eq!(status, 200, "{body}");
    let escape: serde_json::Value = serde_json::from_str(&body).unwrap();
    let tried = escape["tried"].as_object().unwrap();
    assert!(!tried.is_empty(), "{escape}");
    assert!(
        tried.values().all(|outcome| outcome != "written"),
        "the function changed its cgroups: {escape}"
    );
    if nix::unistd::geteuid().is_root() {
        assert_eq!(escape["capabilities"], "0000000000000000", "{escape}");
    }
    // Nor open another function's memory or environment (the runtimes are non-dumpable).
    platform
        .deploy(
            "neighbour",
            json!({"runtime": "nodejs22", "source": {"inline": {"source": "module.exports = { main: () => 'hi' }"}}}),
        )
        .await;
    let neighbour = platform.pids("neighbour")[0];
    let (status, body) = call(&format!("peek&pid={neighbour}")).await;
    assert_eq!(status, 200, "{body}");
    let seen: serde_json::Value = serde_json::from_str(&body).unwrap();
    for file in ["mem", "environ"] {
        assert!(
            seen[file] == "EACCES" || seen[file] == "EPERM",
            "another function's /proc/<pid>/{file}: {seen}"
        );
    }

    let (status, body) = call("fork").await;
    assert_eq!(status, 200, "{body}");
    let started = serde_json::from_str::<serde_json::Value>(&body).unwrap()["started"]
        .as_u64()
        .unwrap();
    assert!(
        (1..64).contains(&started),
        "{started} of 200 children started under a cap of 64 tasks (the runtime's own threads count)"
    );

    let (status, body) = call("alloc").await;
    assert!(
        status.is_server_error(),
        "1 GiB in a 256Mi instance: {status} {body}"
    );
    let running = std::sync::Mutex::new(String::new());
    eventually(
        "the status to say the instance ran out of memory",
        Duration::from_secs(30),
        || async {
            let function = platform.function("confined").await;
            let (_, _, message) = support::condition_of(&function, "Running");
            *running.lock().unwrap() = message.clone();
            message.contains("out of memory")
        },
    )
    .await
    .unwrap_or_else(|_| panic!("Running: {}", running.lock().unwrap()));
    let running = running.lock().unwrap().clone();
    assert!(
        running.contains("256.0 MiB") || running.contains("256 MiB"),
        "{running}"
    );
    // The killed instance's cgroup went with everything in it: the daemon too.
    eventually("the daemon to be gone", Duration::from_secs(30), || async {
        eddy_testing::process_gone(daemon)
    })
    .await
    .unwrap();
    // A new instance serves.
    eventually(
        "the function to answer again",
        Duration::from_secs(60),
        || async { call("").await.0 == 200 },
    )
    .await
    .unwrap();
}

/// A function that crashes as it loads is restarted with a growing delay (100 ms after the
/// first failure, doubling up to 10 s), not in a tight loop, and its status says it keeps
/// failing. Each start writes its time to a file, so the waits between starts are measured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashing_instance_is_restarted_with_a_growing_backoff() {
    let platform = Platform::start().await;
    let dir = tempfile::tempdir().unwrap();
    let starts = dir.path().join("starts");
    let source = r#"
require("fs").appendFileSync(process.env.STARTS_FILE, Date.now() + "\n");
process.exit(3);
"#;
    let (status, body) = platform
        .put_function(
            "crasher",
            json!({"runtime": "nodejs22", "source": {"inline": {"source": source}},
                   "env": [{"name": "STARTS_FILE", "value": starts.to_str().unwrap()}]}),
        )
        .await;
    assert!(status == 200 || status == 201, "{status}: {body}");
    let times = || -> Vec<u64> {
        std::fs::read_to_string(&starts)
            .unwrap_or_default()
            .lines()
            .filter_map(|line| line.parse().ok())
            .collect()
    };
    eventually("six starts", Duration::from_secs(60), || async {
        times().len() >= 6
    })
    .await
    .unwrap_or_else(|error| panic!("{error}: {:?}", times()));
    let started = times();
    let gaps: Vec<u64> = started.windows(2).map(|pair| pair[1] - pair[0]).collect();
    // 100, 200, 400, 800, 1600 ms after failures 1 to 5, plus each start's own time (spawning
    // a runtime, loading the function), which only adds.
    for (index, gap) in gaps.iter().take(5).enumerate() {
        let backoff = 100_u64 << index;
        assert!(
            *gap >= backoff && *gap < backoff + 2_000,
            "wait {index} was {gap} ms, the backoff {backoff} ms: {gaps:?}"
        );
    }
    let (status, reason, message) = platform.condition("crasher", "Running").await;
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "InstanceFailing"),
        "{message}"
    );
}

/// A warm spare that dies before use is started again after a growing wait, 1 s after the
/// first death and doubling (to at most 60 s), not in a tight loop: each spare is SIGKILLed as
/// soon as it is ready, and the wait until the next one is measured. The watcher looks at its
/// spares at least every second, so each wait is the backoff plus up to a second and the
/// start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_spare_that_keeps_dying_is_started_again_after_a_growing_wait() {
    use eddy_model::resources::Runtime;
    let platform = Platform::start().await;
    platform
        .deploy(
            "keeps-spares",
            json!({"runtime": "nodejs24", "source": {"inline": {"source": "module.exports = { main: () => 'ok' };"}}}),
        )
        .await;
    let spares = platform.backend.spares().expect("spares are on by default");
    let runtime = Runtime::Nodejs24;
    let ready_spare = |not: Option<u32>| async move {
        let new_spare = || {
            spares
                .idle_pids(runtime)
                .into_iter()
                .find(|pid| Some(*pid) != not)
        };
        eventually(
            "a new warm spare of nodejs24",
            Duration::from_secs(30),
            || async { new_spare().is_some() && spares.ready(runtime) == 1 },
        )
        .await
        .unwrap();
        new_spare().unwrap()
    };
    let mut pid = ready_spare(None).await;
    let mut waits = Vec::new();
    for _ in 0..3 {
        let killed = std::time::Instant::now();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        pid = ready_spare(Some(pid)).await;
        waits.push(killed.elapsed());
    }
    eprintln!("waits before each new spare: {waits:?}");
    for (wait, backoff) in waits.iter().zip([1, 2, 4]) {
        let backoff = Duration::from_secs(backoff);
        assert!(
            *wait >= backoff && *wait < backoff + Duration::from_millis(3500),
            "{waits:?}: expected {backoff:?} plus at most a second and a start"
        );
    }
}
