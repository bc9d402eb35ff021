//! Kyma's function contract, line by line (docs/functions.md): handlers written as Kyma's docs
//! write them, deployed locally and called through the gateway, on the real Node.js and Python
//! runtimes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{Router, body::Bytes, extract::State, routing::post};
use eddy_testing::eventually;
use serde_json::{Value, json};
use support::kyma::{deploy_on, json_answer, text};
use support::{Platform, sample};

/// Deploys `source` as a nodejs20 function named `name`, with `extra` merged into the spec.
async fn deploy(platform: &Platform, name: &str, source: &str, extra: Value) {
    deploy_on(platform, "nodejs20", name, source, extra).await;
}

/// What function `name`'s `/metrics` shows.
async fn function_metrics(platform: &Platform, name: &str) -> String {
    platform
        .get_text(&format!("{}/default/{name}/metrics", platform.gateway))
        .await
}

/// Sends function `name` a binary-mode CloudEvent (its subject percent-encoded); its answer.
async fn send_binary_event(platform: &Platform, name: &str) -> Value {
    json_answer(
        platform
            .invoke(name, "/")
            .header("ce-specversion", "1.0")
            .header("ce-type", "order.created")
            .header("ce-source", "shop")
            .header("ce-id", "b-1")
            .header("ce-eventtypeversion", "v1")
            .header("ce-subject", "a%20b")
            .json(&json!({"sku": "A"})),
    )
    .await
}

/// Sends function `name` a structured-mode CloudEvent whose data is `{"amount": 5}`; its answer.
async fn send_structured_event(platform: &Platform, name: &str) -> Value {
    json_answer(
        platform
            .invoke(name, "/")
            .header("content-type", "application/cloudevents+json")
            .body(
                json!({"specversion": "1.0", "type": "order.paid", "source": "pay", "id": "s-1",
                       "time": "2026-11-23T10:00:00Z", "datacontenttype": "application/json",
                       "data": {"amount": 5}})
                .to_string(),
            ),
    )
    .await
}

#[tokio::test]
async fn the_express_request_and_response_are_the_functions_to_use() {
    let platform = Platform::start().await;
    let source = r#"
module.exports = { main: function (event, context) {
  const req = event.extensions.request;
  const res = event.extensions.response;
  res.status(202).set("x-kyma", "yes").json({
    query: req.query.name, header: req.get("X-Custom"), is: req.is("application/json"),
    body: req.body, path: req.path, method: req.method,
  });
} };
"#;
    deploy(&platform, "express", source, json!({})).await;
    let response = platform
        .invoke("express", "/orders?name=kyma")
        .header("x-custom", "given")
        .json(&json!({"a": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202);
    assert_eq!(response.headers()["x-kyma"], "yes");
    assert_eq!(response.headers()["access-control-allow-origin"], "*");
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body,
        json!({"query": "kyma", "header": "given", "is": "application/json",
               "body": {"a": 1}, "path": "/orders", "method": "POST"})
    );
}

#[tokio::test]
async fn send_response_and_the_set_response_helpers_shape_the_answer() {
    let platform = Platform::start().await;
    let source = r#"
module.exports = { main: async (event, context, sendResponse) => {
  switch (event.extensions.request.path) {
    case "/object": sendResponse({ made: true }, 201, { "x-made": "1" }); return;
    case "/string": sendResponse("plain words", 200); return;
    case "/status": sendResponse(undefined, 404); return;
    case "/helpers":
      event.setResponseStatus(418);
      event.setResponseHeader("x-helper", "set");
      event.setResponseContentType("text/csv");
      return "a,b\n1,2\n";
    case "/nothing": return undefined;
  }
} };
"#;
    deploy(&platform, "answers", source, json!({})).await;
    let response = platform.invoke("answers", "/object").send().await.unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(response.headers()["x-made"], "1");
    assert_eq!(
        response.json::<Value>().await.unwrap(),
        json!({"made": true})
    );
    let (status, body) = text(platform.invoke("answers", "/string").send().await.unwrap()).await;
    assert_eq!((status, body.as_str()), (200, "plain words"));
    let (status, body) = text(platform.invoke("answers", "/status").send().await.unwrap()).await;
    assert_eq!((status, body.as_str()), (404, "Not Found"));
    let response = platform.invoke("answers", "/helpers").send().await.unwrap();
    assert_eq!(response.status(), 418);
    assert_eq!(response.headers()["x-helper"], "set");
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/csv")
    );
    assert_eq!(response.text().await.unwrap(), "a,b\n1,2\n");
    let (status, body) = text(platform.invoke("answers", "/nothing").send().await.unwrap()).await;
    assert_eq!((status, body.as_str()), (200, ""));
}

#[tokio::test]
async fn commonjs_and_es_module_handlers_load_and_use_the_runtime_libraries() {
    let platform = Platform::start().await;
    let commonjs = r#"
const express = require("express");
module.exports = { main: () => ({ kind: "commonjs", express: typeof express }) };
"#;
    let module = r#"
import axios from "axios";
import { CloudEvent } from "cloudevents";
import { trace } from "@opentelemetry/api";
export function main(event, context) {
  return { kind: "module", axios: typeof axios, cloudevents: typeof CloudEvent, otel: typeof trace.getTracer };
}
"#;
    let typed = r#"{"name": "typed", "version": "1.0.0", "type": "module"}"#;
    deploy(&platform, "cjs", commonjs, json!({})).await;
    deploy(&platform, "esm", module, json!({})).await;
    deploy(&platform, "typed", module, json!({"dependencies": typed})).await;
    let answer = |name: &'static str| {
        let request = platform.invoke(name, "/");
        async move { request.send().await.unwrap().json::<Value>().await.unwrap() }
    };
    assert_eq!(
        answer("cjs").await,
        json!({"kind": "commonjs", "express": "function"})
    );
    let expected = json!({"kind": "module", "axios": "function", "cloudevents": "function", "otel": "function"});
    assert_eq!(answer("esm").await, expected);
    assert_eq!(
        answer("typed").await,
        expected,
        "a function's \"type\": \"module\" does not break the runtime's server"
    );
}

#[tokio::test]
async fn errors_become_500_and_a_late_exception_does_not_kill_the_instance() {
    let platform = Platform::start().await;
    let source = r#"
module.exports = { main: async (event) => {
  switch (event.extensions.request.path) {
    case "/string": throw "the order is gone";
    case "/error": throw new Error("with a secret stack");
    case "/reject": return Promise.reject("rejected in words");
    case "/later": setTimeout(() => { throw new Error("thrown later"); }, 0); return "scheduled";
  }
  return { pid: process.pid };
} };
"#;
    deploy(&platform, "failing", source, json!({})).await;
    let call = |path: &'static str| {
        let request = platform.invoke("failing", path);
        async move { text(request.send().await.unwrap()).await }
    };
    assert_eq!(call("/string").await, (500, "the order is gone".to_owned()));
    assert_eq!(
        call("/error").await,
        (500, "Internal server error".to_owned())
    );
    assert_eq!(call("/reject").await, (500, "rejected in words".to_owned()));
    let (_, before) = call("/").await;
    assert_eq!(call("/later").await, (200, "scheduled".to_owned()));
    // The late exception is logged, and the same process keeps serving.
    eventually(
        "the late exception in the log",
        Duration::from_secs(10),
        || async {
            platform
                .function_log("failing")
                .await
                .contains("thrown later")
        },
    )
    .await
    .unwrap();
    let (status, after) = call("/").await;
    assert_eq!((status, after), (200, before));
}

#[tokio::test]
async fn a_call_past_func_timeout_is_answered_408() {
    let platform = Platform::start().await;
    let source = r#"
module.exports = { main: () => new Promise((resolve) => setTimeout(() => resolve("late"), 10000)) };
"#;
    deploy(&platform, "slow", source, json!({"timeoutSeconds": 1})).await;
    let started = std::time::Instant::now();
    let (status, _) = text(platform.invoke("slow", "/").send().await.unwrap()).await;
    assert_eq!(status, 408);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_handler_that_fails_to_load_leaves_the_server_up_and_says_so() {
    let platform = Platform::start().await;
    deploy(
        &platform,
        "broken",
        "module.exports = { main: () => 1 }; throw new Error('broken at load');",
        json!({}),
    )
    .await;
    let (status, body) = text(platform.invoke("broken", "/").send().await.unwrap()).await;
    assert_eq!((status, body.as_str()), (500, "User function not loaded"));
    let (status, body) = text(
        platform
            .http
            .get(format!("{}/default/broken/healthz", platform.gateway))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, body.as_str()), (200, "OK"));
    assert!(
        platform
            .function_log("broken")
            .await
            .contains("broken at load")
    );
}

#[tokio::test]
async fn preflight_favicon_and_metrics_are_answered_by_the_runtime() {
    let platform = Platform::start().await;
    let source = r#"
module.exports = { main: (event) => { if (event.extensions.request.path === "/fail") throw "no"; return "called"; } };
"#;
    deploy(&platform, "routes", source, json!({})).await;
    let url = |path: &str| format!("{}/default/routes{path}", platform.gateway);
    let preflight = platform
        .http
        .request(reqwest::Method::OPTIONS, url("/orders"))
        .header("origin", "https://shop.example")
        .header("access-control-request-method", "PUT")
        .header("access-control-request-headers", "x-token")
        .send()
        .await
        .unwrap();
    // Kyma's runtime answers a preflight with `res.end()`: 200, an empty body.
    assert_eq!(preflight.status(), 200);
    assert_eq!(preflight.headers()["access-control-allow-origin"], "*");
    assert_eq!(preflight.headers()["access-control-allow-methods"], "PUT");
    assert_eq!(
        preflight.headers()["access-control-allow-headers"],
        "x-token"
    );
    assert_eq!(preflight.text().await.unwrap(), "");
    let favicon = platform.http.get(url("/favicon.ico")).send().await.unwrap();
    assert_eq!(favicon.status(), 204);

    for path in ["/a", "/b", "/fail"] {
        platform.invoke("routes", path).send().await.unwrap();
    }
    let metrics = function_metrics(&platform, "routes").await;
    // The preflight and the favicon did not call the function.
    assert_eq!(sample(&metrics, "function_calls_total"), 3.0, "{metrics}");
    assert_eq!(sample(&metrics, "function_failures_total"), 1.0);
    assert_eq!(sample(&metrics, "function_duration_miliseconds_count"), 3.0);
}

#[tokio::test]
async fn cloud_events_are_read_with_the_sdk_in_both_modes() {
    let platform = Platform::start().await;
    let source = r#"
module.exports = { main: (event) => ({
  data: event.data, type: event["ce-type"], source: event["ce-source"], id: event["ce-id"],
  specversion: event["ce-specversion"], eventtypeversion: event["ce-eventtypeversion"],
  time: event["ce-time"], datacontenttype: event["ce-datacontenttype"], subject: event["ce-subject"],
}) };
"#;
    deploy(&platform, "events", source, json!({})).await;
    let binary = send_binary_event(&platform, "events").await;
    assert_eq!(binary["data"], json!({"sku": "A"}));
    assert_eq!(binary["type"], "order.created");
    assert_eq!(binary["source"], "shop");
    assert_eq!(binary["id"], "b-1");
    assert_eq!(binary["specversion"], "1.0");
    assert_eq!(binary["eventtypeversion"], "v1");
    assert_eq!(binary["subject"], "a b", "attributes are percent-decoded");

    let structured = send_structured_event(&platform, "events").await;
    assert_eq!(structured["data"], json!({"amount": 5}), "unwrapped");
    assert_eq!(structured["type"], "order.paid");
    assert_eq!(structured["id"], "s-1");
    assert_eq!(structured["time"], "2026-11-23T10:00:00.000Z");
    assert_eq!(structured["datacontenttype"], "application/json");

    // A plain request is no event: data is the parsed body, form or text.
    let plain: Value = json_answer(
        platform
            .invoke("events", "/")
            .header("content-type", "application/x-www-form-urlencoded")
            .body("a=1"),
    )
    .await;
    assert_eq!(plain, json!({"data": {"a": "1"}}));
}

#[tokio::test]
async fn emit_cloud_event_reaches_a_subscriber() {
    let source = r#"
module.exports = { main: async (event) => {
  const answer = await event.emitCloudEvent("order.shipped.v1", "warehouse", { order: 7 }, { id: "ship-7" });
  return { status: answer.status };
} };
"#;
    let (status, body) = support::check_emit("nodejs20", source).await;
    assert_eq!(status, 200);
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert!(
        answer["status"]
            .as_u64()
            .is_some_and(|s| (200..300).contains(&s)),
        "axios resolves to the event-bus's answer: {answer}"
    );
}

/// Bodies an OTLP/HTTP receiver got.
#[derive(Clone, Default)]
struct Collector(Arc<Mutex<Vec<Bytes>>>);

async fn collect(State(collector): State<Collector>, body: Bytes) -> &'static str {
    collector.0.lock().unwrap().push(body);
    "{}"
}

/// Deploys `source` (which starts a span named `reserve-stock`) with tracing on, calls it inside
/// a caller's trace, and waits for the span at a test OTLP/HTTP collector.
async fn check_tracing(runtime: &str, source: &str) {
    let platform = Platform::start().await;
    let collector = Collector::default();
    let app = Router::new()
        .route("/v1/traces", post(collect))
        .with_state(collector.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}/v1/traces", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    deploy_on(
        &platform,
        runtime,
        "traced",
        source,
        json!({"env": [
            {"name": "TRACE_COLLECTOR_ENDPOINT", "value": endpoint},
            {"name": "OTEL_BSP_SCHEDULE_DELAY", "value": "100"},
        ]}),
    )
    .await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let (status, _) = text(
        platform
            .invoke("traced", "/")
            .header("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    // OTLP/HTTP carries JSON (Node.js) or protobuf (Python): the trace id appears as hex or as
    // its 16 raw bytes.
    let raw_id: Vec<u8> = (0..16)
        .map(|i| u8::from_str_radix(&trace_id[i * 2..i * 2 + 2], 16).unwrap())
        .collect();
    eventually(
        "the span at the collector",
        Duration::from_secs(20),
        || async {
            let bodies = collector.0.lock().unwrap().clone();
            bodies.iter().any(|body| {
                let has = |needle: &[u8]| body.windows(needle.len()).any(|w| w == needle);
                has(b"reserve-stock") && (has(trace_id.as_bytes()) || has(&raw_id))
            })
        },
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn tracer_spans_reach_the_collector_and_continue_the_callers_trace() {
    let source = r#"
module.exports = { main: (event) => {
  const span = event.tracer.startSpan("reserve-stock");
  span.setAttribute("order", "7");
  span.end();
  return "traced";
} };
"#;
    check_tracing("nodejs20", source).await;
}

#[tokio::test]
async fn a_function_sees_only_its_own_and_the_runtimes_packages() {
    let platform = Platform::start().await;
    // A package where Node.js would find it from the build directory: above it.
    let host_package = platform.data_dir.path().join("node_modules/host-only");
    std::fs::create_dir_all(&host_package).unwrap();
    std::fs::write(host_package.join("index.js"), "module.exports = 'host';").unwrap();
    let source = r#"
module.exports = { main: async () => {
  const out = {};
  try { require("host-only"); out.require = "loaded"; } catch (error) { out.require = error.code; }
  try { await import("host-only"); out.import = "loaded"; } catch (error) { out.import = error.code; }
  out.express = typeof require("express");
  return out;
} };
"#;
    deploy(&platform, "isolated", source, json!({})).await;
    let answer: Value = json_answer(platform.invoke("isolated", "/")).await;
    assert_eq!(
        answer,
        json!({"require": "MODULE_NOT_FOUND", "import": "ERR_MODULE_NOT_FOUND", "express": "function"})
    );
}

#[tokio::test]
async fn each_nodejs_runtime_runs_on_its_own_major_version() {
    let platform = Platform::start().await;
    let source = "module.exports = { main: (event, context) => ({ version: process.version, runtime: context.runtime }) };";
    for runtime in ["nodejs20", "nodejs22", "nodejs24"] {
        platform
            .deploy(
                runtime,
                json!({"runtime": runtime, "source": {"inline": {"source": source}}}),
            )
            .await;
    }
    for (runtime, major) in [
        ("nodejs20", "v20."),
        ("nodejs22", "v22."),
        ("nodejs24", "v24."),
    ] {
        let answer: Value = json_answer(platform.invoke(runtime, "/")).await;
        assert_eq!(answer["runtime"], runtime);
        assert!(
            answer["version"].as_str().unwrap().starts_with(major),
            "{runtime}: {answer}"
        );
    }
}

// ---- Python ------------------------------------------------------------------------------------

#[tokio::test]
async fn python_functions_get_bottles_request_and_answer_as_bottle_does() {
    let platform = Platform::start().await;
    let source = r#"
from bottle import HTTPResponse


def main(event, context):
    request = event["extensions"]["request"]
    if request.path == "/made":
        return HTTPResponse(body="made", status=201, headers={"x-made": "1"})
    if request.path == "/words":
        return "some words"
    return {
        "query": request.query.get("name"), "json": request.json, "method": request.method,
        "path": request.path, "header": request.headers.get("X-CUSTOM"),
        "get_header": request.get_header("x-custom"), "data": event["data"],
        "context": sorted(context.keys()),
    }
"#;
    deploy_on(&platform, "python312", "bottled", source, json!({})).await;
    let body: Value = json_answer(
        platform
            .invoke("bottled", "/orders?name=kyma")
            .header("x-custom", "given")
            .json(&json!({"a": 1})),
    )
    .await;
    assert_eq!(
        body,
        json!({"query": "kyma", "json": {"a": 1}, "method": "POST", "path": "/orders",
               "header": "given", "get_header": "given", "data": {"a": 1},
               "context": ["body-size-limit", "function-name", "memory-limit", "namespace", "runtime", "timeout"]})
    );
    let made = platform.invoke("bottled", "/made").send().await.unwrap();
    assert_eq!(made.status(), 201);
    assert_eq!(made.headers()["x-made"], "1");
    assert_eq!(made.text().await.unwrap(), "made");
    let words = platform.invoke("bottled", "/words").send().await.unwrap();
    assert!(
        words.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html")
    );
    assert_eq!(words.text().await.unwrap(), "some words");
}

#[tokio::test]
async fn python_failures_timeouts_and_load_errors_are_answered_as_kyma_does() {
    let platform = Platform::start().await;
    let source = r#"
import time


def main(event, context):
    path = event["extensions"]["request"].path
    if path == "/fail":
        raise ValueError("a secret detail")
    if path == "/slow":
        time.sleep(10)
    return "fine"
"#;
    deploy_on(
        &platform,
        "python312",
        "strict",
        source,
        json!({"timeoutSeconds": 1}),
    )
    .await;
    deploy_on(
        &platform,
        "python312",
        "unloadable",
        "import no_such_module\n",
        json!({}),
    )
    .await;
    let call = |name: &'static str, path: &'static str| {
        let request = platform.invoke(name, path);
        async move { text(request.send().await.unwrap()).await }
    };
    assert_eq!(
        call("strict", "/fail").await,
        (500, "Internal server error".to_owned())
    );
    assert_eq!(call("strict", "/slow").await.0, 408);
    assert_eq!(call("strict", "/").await, (200, "fine".to_owned()));
    assert!(
        platform
            .function_log("strict")
            .await
            .contains("a secret detail")
    );
    assert_eq!(
        call("unloadable", "/").await,
        (500, "User function not loaded".to_owned())
    );
    let url = |path: &str| format!("{}/default/strict{path}", platform.gateway);
    let favicon = platform.http.get(url("/favicon.ico")).send().await.unwrap();
    assert_eq!(favicon.status(), 204);
    let metrics = function_metrics(&platform, "strict").await;
    assert_eq!(
        sample(&metrics, "function_calls_total{method=\"POST\"}"),
        3.0,
        "{metrics}"
    );
    assert_eq!(
        sample(&metrics, "function_failures_total{method=\"POST\"}"),
        2.0
    );
    assert_eq!(
        sample(&metrics, "function_duration_seconds_count{method=\"POST\"}"),
        3.0
    );
}

#[tokio::test]
async fn python_cloud_events_fill_ce_headers_in_both_modes() {
    let platform = Platform::start().await;
    let source = r#"
def main(event, context):
    headers = event.ceHeaders
    return {name: headers.get(name) for name in
            ["data", "ce-type", "ce-source", "ce-id", "ce-specversion", "ce-eventtypeversion", "ce-subject"]}
"#;
    deploy_on(&platform, "python312", "pyevents", source, json!({})).await;
    let binary = send_binary_event(&platform, "pyevents").await;
    assert_eq!(
        binary,
        json!({"data": {"sku": "A"}, "ce-type": "order.created", "ce-source": "shop", "ce-id": "b-1",
               "ce-specversion": "1.0", "ce-eventtypeversion": "v1", "ce-subject": "a b"})
    );
    let structured = send_structured_event(&platform, "pyevents").await;
    assert_eq!(structured["data"], json!({"amount": 5}), "unwrapped");
    assert_eq!(structured["ce-type"], "order.paid");
    assert_eq!(structured["ce-id"], "s-1");
}

#[tokio::test]
async fn python_emit_cloud_event_reaches_a_subscriber() {
    let source = r#"
def main(event, context):
    event.emitCloudEvent("order.shipped.v1", "warehouse", {"order": 7}, {"id": "ship-7"})
    return "emitted"
"#;
    assert_eq!(
        support::check_emit("python312", source).await,
        (200, "emitted".to_owned())
    );
}

#[tokio::test]
async fn python_tracer_spans_reach_the_collector() {
    let source = r#"
def main(event, context):
    with event.tracer.start_as_current_span("reserve-stock"):
        pass
    return "traced"
"#;
    check_tracing("python312", source).await;
}

#[tokio::test]
async fn a_python_function_sees_only_the_runtimes_and_its_own_packages() {
    let platform = Platform::start().await;
    let source = r#"
import sys


def main(event, context):
    import requests, bottle, cloudevents, opentelemetry, prometheus_client
    import six_for_eddy_test
    return {"prefix": sys.prefix, "base": sys.base_prefix, "path": sys.path,
            "no_user_site": bool(sys.flags.no_user_site or not __import__("site").ENABLE_USER_SITE),
            "own": six_for_eddy_test.__name__}
"#;
    // Its own requirements.txt: a local package, so no index is needed.
    let package = platform.data_dir.path().join("six_for_eddy_test");
    std::fs::create_dir_all(package.join("six_for_eddy_test")).unwrap();
    std::fs::write(package.join("six_for_eddy_test/__init__.py"), "").unwrap();
    std::fs::write(
        package.join("pyproject.toml"),
        "[project]\nname = \"six_for_eddy_test\"\nversion = \"1.0\"\n[build-system]\nrequires = []\nbuild-backend = \"backend\"\nbackend-path = [\".\"]\n",
    )
    .unwrap();
    std::fs::write(package.join("backend.py"), WHEEL_BACKEND).unwrap();
    deploy_on(
        &platform,
        "python312",
        "pyisolated",
        source,
        json!({"dependencies": format!("{}\n", package.display())}),
    )
    .await;
    let answer: Value = json_answer(platform.invoke("pyisolated", "/")).await;
    let prefix = answer["prefix"].as_str().unwrap();
    let base = answer["base"].as_str().unwrap();
    assert_ne!(prefix, base, "a virtual environment: {answer}");
    assert_eq!(answer["own"], "six_for_eddy_test");
    assert_eq!(answer["no_user_site"], true);
    for entry in answer["path"].as_array().unwrap() {
        let entry = entry.as_str().unwrap();
        assert!(
            !(entry.starts_with(base) && entry.contains("-packages")),
            "the host's {entry} is on the function's path: {answer}"
        );
    }
}

/// A PEP 517 backend small enough to inline: builds a wheel of the package beside it.
const WHEEL_BACKEND: &str = r#"
import base64, hashlib, os, zipfile

NAME, VERSION = "six_for_eddy_test", "1.0"
DIST = f"{NAME}-{VERSION}.dist-info"


def _record(entries):
    lines = []
    for path, data in entries:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{path},sha256={digest},{len(data)}")
    lines.append(f"{DIST}/RECORD,,")
    return "\n".join(lines) + "\n"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    entries = [
        (f"{NAME}/__init__.py", b""),
        (f"{DIST}/METADATA", f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n".encode()),
        (f"{DIST}/WHEEL", b"Wheel-Version: 1.0\nGenerator: eddy-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"),
    ]
    name = f"{NAME}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as wheel:
        for path, data in entries:
            wheel.writestr(path, data)
        wheel.writestr(f"{DIST}/RECORD", _record(entries))
    return name
"#;

#[tokio::test]
async fn each_python_runtime_runs_on_its_own_minor_version() {
    let platform = Platform::start().await;
    let source = "import sys\n\ndef main(event, context):\n    return {'version': '%d.%d' % sys.version_info[:2], 'runtime': context['runtime']}\n";
    for runtime in ["python311", "python312"] {
        deploy_on(&platform, runtime, runtime, source, json!({})).await;
    }
    for (runtime, version) in [("python311", "3.11"), ("python312", "3.12")] {
        let answer: Value = json_answer(platform.invoke(runtime, "/")).await;
        assert_eq!(answer, json!({"version": version, "runtime": runtime}));
    }
}
