//! Kyma's current runtimes, nodejs26 and python314, with Kyma's new runtime API, against real
//! processes: the handlers are written as Kyma's docs and runtime sources write them (Express's
//! `req` and `res`; Flask's `flask.request`; the `sdk` module), served locally through the
//! gateway, their events published through the event-bus and delivered by the dispatcher.
//! nodejs20 and nodejs22, deprecated in Kyma's schedule, still run with a warning. Also the
//! smaller pieces of Kyma's current contract: manifests on standard input, the instances'
//! labels, a hidden APIRule rule as an Error, the publisher proxy's subscribed events.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use eddy_testing::eventually;
use serde_json::{Value, json};
use support::kyma::{json_answer, text};
use support::{Options, Platform, Sink};

/// Deploys `source` on `runtime` as `name` with `env`.
async fn deploy_on(platform: &Platform, runtime: &str, name: &str, source: &str, env: Value) {
    support::kyma::deploy_on(platform, runtime, name, source, json!({"env": env})).await;
}

fn binary_event(request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
    request
        .header("ce-specversion", "1.0")
        .header("ce-type", "order.created")
        .header("ce-source", "shop")
        .header("ce-id", "b-1")
        .json(&json!({"sku": "A"}))
}

fn structured_event(request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
    request
        .header("content-type", "application/cloudevents+json")
        .body(
            json!({"specversion": "1.0", "type": "order.paid", "source": "pay", "id": "s-1",
                   "datacontenttype": "application/json", "data": {"amount": 5}})
            .to_string(),
        )
}

// ---- nodejs26 ----------------------------------------------------------------------------------

/// Kyma's migration guide's "after" handler: `main(req, res)` reads Express's request (query,
/// parsed JSON body, headers) and answers through `res`; CORS is open and a preflight is
/// answered by the server without calling the function; it runs on Node.js 26.
#[tokio::test]
async fn nodejs26_calls_main_with_express_request_and_response() {
    let platform = Platform::start().await;
    let source = r#"
module.exports = {
  main: async function (req, res) {
    if (req.method === "OPTIONS") { res.status(500).send("the function must not see a preflight"); return; }
    res.status(201).json({
      name: req.query.name,
      body: req.body,
      header: req.get("x-shop"),
      method: req.method,
      path: req.path,
      node: process.version,
    });
  },
};
"#;
    deploy_on(&platform, "nodejs26", "express", source, json!([])).await;
    let response = platform
        .invoke("express", "/orders?name=Ada")
        .header("x-shop", "north")
        .json(&json!({"sku": "A-1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(
        response.headers()["access-control-allow-origin"],
        "*",
        "CORS is open, as Kyma's nodejs26"
    );
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["name"], "Ada");
    assert_eq!(answer["body"], json!({"sku": "A-1"}));
    assert_eq!(answer["header"], "north");
    assert_eq!(answer["method"], "POST");
    assert_eq!(answer["path"], "/orders");
    assert!(
        answer["node"].as_str().unwrap().starts_with("v26."),
        "{answer}"
    );
    let preflight = platform
        .invoke("express", "/orders")
        .header("origin", "https://shop.example.com")
        .header("access-control-request-method", "PUT")
        .header("access-control-request-headers", "x-shop")
        .build()
        .unwrap();
    let mut preflight = preflight;
    *preflight.method_mut() = reqwest::Method::OPTIONS;
    let answer = reqwest::Client::new().execute(preflight).await.unwrap();
    // Kyma's runtime answers a preflight with `res.end()`: 200, an empty body.
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.headers()["access-control-allow-methods"], "PUT");
    assert_eq!(answer.headers()["access-control-allow-headers"], "x-shop");
    assert_eq!(answer.headers()["access-control-allow-origin"], "*");
}

/// A rejected promise or a thrown error is a 500: a string is the body, anything else is
/// "Internal server error" (Kyma's handleError); a function that never answers gets 408 at
/// FUNC_TIMEOUT; the instance keeps serving.
#[tokio::test]
async fn nodejs26_failures_and_timeouts_are_answered_as_kyma_does() {
    let platform = Platform::start().await;
    let source = r#"
module.exports = {
  main: async function (req, res) {
    if (req.path === "/string") throw "out of stock";
    if (req.path === "/error") return Promise.reject(new Error("secret detail"));
    if (req.path === "/silent") return;
    res.send("fine");
  },
};
"#;
    deploy_on(
        &platform,
        "nodejs26",
        "failing",
        source,
        json!([{"name": "FUNC_TIMEOUT", "value": "2"}]),
    )
    .await;
    let call = |path: &'static str| {
        let request = platform.invoke("failing", path);
        async move { text(request.send().await.unwrap()).await }
    };
    assert_eq!(call("/string").await, (500, "out of stock".to_owned()));
    assert_eq!(
        call("/error").await,
        (500, "Internal server error".to_owned())
    );
    let started = std::time::Instant::now();
    let (status, _) = call("/silent").await;
    assert_eq!(status, 408);
    assert!(
        started.elapsed() >= Duration::from_millis(1900),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(call("/").await, (200, "fine".to_owned()));
}

/// The sdk module as Kyma's docs use it: the CloudEvent of a binary or structured request
/// (null for a plain one), and the function's own settings.
#[tokio::test]
async fn nodejs26_sdk_reads_cloud_events_and_the_functions_settings() {
    let platform = Platform::start().await;
    let source = r#"
const sdk = require("sdk");
module.exports = {
  main: async function (req, res) {
    const event = sdk.getCloudEvent(req);
    res.json({
      event: event && { type: event.type, source: event.source, id: event.id, data: event.data },
      name: sdk.getFunctionName(),
      namespace: sdk.getNamespace(),
      runtime: sdk.getRuntime(),
      timeout: sdk.getTimeout(),
      bodyLimit: sdk.getBodySizeLimit(),
      tracer: typeof sdk.getTracer().startSpan,
    });
  },
};
"#;
    deploy_on(
        &platform,
        "nodejs26",
        "reader",
        source,
        json!([{"name": "FUNC_TIMEOUT", "value": "30"}]),
    )
    .await;
    let binary = json_answer(binary_event(platform.invoke("reader", "/"))).await;
    assert_eq!(
        binary["event"],
        json!({"type": "order.created", "source": "shop", "id": "b-1", "data": {"sku": "A"}})
    );
    assert_eq!(binary["name"], "reader");
    assert_eq!(binary["namespace"], "default");
    assert_eq!(binary["runtime"], "nodejs26");
    assert_eq!(binary["timeout"], 30);
    assert_eq!(binary["bodyLimit"], 1);
    assert_eq!(binary["tracer"], "function");
    let structured = json_answer(structured_event(platform.invoke("reader", "/"))).await;
    assert_eq!(
        structured["event"],
        json!({"type": "order.paid", "source": "pay", "id": "s-1", "data": {"amount": 5}})
    );
    let plain = json_answer(platform.invoke("reader", "/").json(&json!({"x": 1}))).await;
    assert_eq!(plain["event"], Value::Null);
    // Raw UTF-8, as a Subscription in Kyma's form delivers it (CloudEvents' Go SDK's way).
    let raw = json_answer(
        platform
            .invoke("reader", "/")
            .header("ce-specversion", "1.0")
            .header(
                "ce-type",
                reqwest::header::HeaderValue::from_bytes("commande.créée.v1".as_bytes()).unwrap(),
            )
            .header("ce-source", "boutique")
            .header("ce-id", "r-1")
            .json(&json!({})),
    )
    .await;
    assert_eq!(raw["event"]["type"], "commande.créée.v1", "{raw}");
}

/// `sdk.emitCloudEvent` (an ES module handler importing the sdk) publishes through the
/// event-bus; the event reaches a subscribed sink.
#[tokio::test]
async fn nodejs26_sdk_emits_a_cloud_event_that_reaches_a_subscriber() {
    let source = r#"
import { emitCloudEvent } from "sdk";
export async function main(req, res) {
  const answer = await emitCloudEvent("order.shipped.v1", "warehouse", { order: 7 }, { id: "ship-7" });
  res.json({ status: answer.status });
}
"#;
    let (status, body) = support::check_emit("nodejs26", source).await;
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert!(
        answer["status"]
            .as_u64()
            .is_some_and(|s| (200..300).contains(&s)),
        "{answer}"
    );
}

// ---- python314 ---------------------------------------------------------------------------------

/// Kyma's python314 handler: `main()` reads Flask's `flask.request` (JSON body, query,
/// headers) and answers as a Flask view does (a dict as JSON, a tuple with a status); it runs
/// on Python 3.14 under gevent.
#[tokio::test]
async fn python314_calls_main_with_flask_request() {
    let platform = Platform::start().await;
    let source = r#"
import sys
import flask


def main():
    request = flask.request
    if request.path == "/created":
        return {"created": request.get_json()["sku"]}, 201
    return {
        "name": request.args.get("name", "World"),
        "body": request.get_json(silent=True),
        "header": request.headers.get("x-shop"),
        "method": request.method,
        "python": "%d.%d" % sys.version_info[:2],
        "gevent": "gevent" in sys.modules,
    }
"#;
    deploy_on(&platform, "python314", "flasky", source, json!([])).await;
    let answer = json_answer(
        platform
            .invoke("flasky", "/?name=Ada")
            .header("x-shop", "north")
            .json(&json!({"sku": "A-1"})),
    )
    .await;
    assert_eq!(
        answer,
        json!({"name": "Ada", "body": {"sku": "A-1"}, "header": "north", "method": "POST",
               "python": "3.14", "gevent": true})
    );
    let response = platform
        .invoke("flasky", "/created")
        .json(&json!({"sku": "B-2"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(
        response.json::<Value>().await.unwrap(),
        json!({"created": "B-2"})
    );
}

/// `SERVER_INTERNAL_LOGGER` in a Function's env logs each request in Apache's combined format,
/// on both of Kyma's current runtimes; without it no request line is logged.
#[tokio::test]
async fn server_internal_logger_logs_each_request_in_apache_s_combined_format() {
    let platform = Platform::start().await;
    let logger = json!([{"name": "SERVER_INTERNAL_LOGGER", "value": "true"}]);
    deploy_on(
        &platform,
        "nodejs26",
        "logged-node",
        "module.exports = { main: (req, res) => res.send('node') };",
        logger.clone(),
    )
    .await;
    deploy_on(
        &platform,
        "python314",
        "logged-python",
        "def main():\n    return 'python'\n",
        logger,
    )
    .await;
    deploy_on(
        &platform,
        "python314",
        "quiet-python",
        "def main():\n    return 'quiet'\n",
        json!([]),
    )
    .await;
    for name in ["logged-node", "logged-python", "quiet-python"] {
        let response = platform
            .http
            .get(format!("{}/default/{name}/logged?x=1", platform.gateway))
            .header("user-agent", "eddy-log-probe/1.0")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{name}");
    }
    for name in ["logged-node", "logged-python"] {
        let logged = eventually(
            &format!("{name}'s request line"),
            Duration::from_secs(20),
            || async {
                // morgan keeps the query string; wsgi-request-logger (Kyma's python314) does not.
                platform.function_log(name).await.lines().any(|line| {
                    line.starts_with("127.0.0.1 - ")
                        && (line.contains("\"GET /logged?x=1 HTTP/1.1\" 200 ")
                            || line.contains("\"GET /logged HTTP/1.1\" 200 "))
                        && line.contains("\"eddy-log-probe/1.0\"")
                })
            },
        )
        .await;
        let log = platform.function_log(name).await;
        assert!(logged.is_ok(), "{name}'s log:\n{log}");
    }
    let quiet = platform.function_log("quiet-python").await;
    assert!(!quiet.contains("eddy-log-probe"), "{quiet}");
}

/// An exception is Flask's 500 "Internal Server Error" (its text stays in the log), a call past
/// FUNC_TIMEOUT is 408 with Kyma's words, and the instance keeps serving.
#[tokio::test]
async fn python314_failures_and_timeouts_are_answered_as_kyma_does() {
    let platform = Platform::start().await;
    let source = r#"
import flask
import gevent


def main():
    if flask.request.path == "/fail":
        raise ValueError("secret detail")
    if flask.request.path == "/slow":
        gevent.sleep(30)
    return "fine"
"#;
    deploy_on(
        &platform,
        "python314",
        "failing",
        source,
        json!([{"name": "FUNC_TIMEOUT", "value": "2"}]),
    )
    .await;
    let call = |path: &'static str| {
        let request = platform.invoke("failing", path);
        async move { text(request.send().await.unwrap()).await }
    };
    assert_eq!(
        call("/fail").await,
        (500, "Internal Server Error".to_owned())
    );
    let started = std::time::Instant::now();
    assert_eq!(
        call("/slow").await,
        (408, "Timeout while processing the function".to_owned())
    );
    assert!(
        started.elapsed() >= Duration::from_millis(1900),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(call("/").await, (200, "fine".to_owned()));
    let log = platform.function_log("failing").await;
    assert!(log.contains("secret detail"), "{log}");
}

/// The sdk module: `get_cloud_event()` of a binary or structured request (None for a plain
/// one) and the getters in snake case.
#[tokio::test]
async fn python314_sdk_reads_cloud_events_and_the_functions_settings() {
    let platform = Platform::start().await;
    let source = r#"
import sdk


def main():
    event = sdk.get_cloud_event()
    return {
        "event": event and {"type": event.get_type(), "source": event.get_source(), "id": event.get_id(), "data": event.get_data()},
        "name": sdk.get_function_name(),
        "namespace": sdk.get_namespace(),
        "runtime": sdk.get_runtime(),
        "timeout": sdk.get_timeout(),
        "body_limit": sdk.get_body_size_limit(),
        "tracer": hasattr(sdk.get_tracer(), "start_as_current_span"),
    }
"#;
    deploy_on(
        &platform,
        "python314",
        "reader",
        source,
        json!([{"name": "FUNC_TIMEOUT", "value": "30"}]),
    )
    .await;
    let binary = json_answer(binary_event(platform.invoke("reader", "/"))).await;
    assert_eq!(binary["event"]["type"], "order.created");
    assert_eq!(binary["event"]["source"], "shop");
    assert_eq!(binary["event"]["id"], "b-1");
    let data = &binary["event"]["data"];
    // Binary mode: the data is the body, JSON decoded by the SDK or as bytes decoded to text.
    assert!(
        *data == json!({"sku": "A"}) || data.as_str() == Some(r#"{"sku":"A"}"#),
        "{binary}"
    );
    assert_eq!(binary["name"], "reader");
    assert_eq!(binary["namespace"], "default");
    assert_eq!(binary["runtime"], "python314");
    assert_eq!(binary["timeout"], 30);
    assert_eq!(binary["body_limit"], 100);
    assert_eq!(binary["tracer"], true);
    let structured = json_answer(structured_event(platform.invoke("reader", "/"))).await;
    assert_eq!(
        structured["event"],
        json!({"type": "order.paid", "source": "pay", "id": "s-1", "data": {"amount": 5}})
    );
    let plain = json_answer(platform.invoke("reader", "/").json(&json!({"x": 1}))).await;
    assert_eq!(plain["event"], Value::Null);
}

/// `sdk.emit_cloud_event` publishes through the event-bus; the event reaches a subscriber.
#[tokio::test]
async fn python314_sdk_emits_a_cloud_event_that_reaches_a_subscriber() {
    let source = r#"
import sdk


def main():
    answer = sdk.emit_cloud_event("order.shipped.v1", "warehouse", {"order": 7}, {"id": "ship-7"})
    return {"status": answer.status_code}
"#;
    let (status, body) = support::check_emit("python314", source).await;
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert!(
        answer["status"]
            .as_u64()
            .is_some_and(|s| (200..300).contains(&s)),
        "{answer}"
    );
}

// ---- deprecated runtimes ------------------------------------------------------------------------

/// nodejs20 and nodejs22 are deprecated in Kyma's schedule: `eddy apply` warns, the Function's
/// ConfigurationReady says so, and the Function still runs. nodejs26 gets no warning.
#[tokio::test]
async fn deprecated_runtimes_warn_at_apply_and_in_the_status_and_still_run() {
    let platform = Platform::start().await;
    let manifest = |name: &str, runtime: &str| {
        format!(
            "apiVersion: eddy.dev/v1alpha1\nkind: Function\nmetadata: {{name: {name}}}\nspec:\n  runtime: {runtime}\n  source:\n    inline:\n      source: |\n        module.exports = {{ main: () => 'still here' }};\n"
        )
    };
    let (ok, _, stderr) = platform.apply_text(&manifest("old", "nodejs20")).await;
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("spec.runtime: runtime nodejs20 is deprecated"),
        "{stderr}"
    );
    let (ok, _, stderr) = platform
        .apply_text(&manifest("current", "nodejs26").replace(
            "module.exports = { main: () => 'still here' };",
            "module.exports = { main: (req, res) => res.send('current') };",
        ))
        .await;
    assert!(ok, "{stderr}");
    assert!(!stderr.contains("deprecated"), "{stderr}");
    platform.wait_running_at("default", "old").await;
    let (status, _, message) = platform.condition("old", "ConfigurationReady").await;
    assert_eq!(status, "True");
    assert!(
        message.contains("Warning: runtime nodejs20 is deprecated"),
        "{message}"
    );
    let (_, answer) = text(platform.invoke("old", "/").send().await.unwrap()).await;
    assert_eq!(answer, "still here");
    platform.wait_running_at("default", "current").await;
    let (_, _, message) = platform.condition("current", "ConfigurationReady").await;
    assert!(!message.contains("deprecated"), "{message}");
    eventually("nodejs26 to answer", Duration::from_secs(10), || async {
        platform
            .invoke("current", "/")
            .send()
            .await
            .ok()
            .map(|r| r.status().is_success())
            .unwrap_or(false)
    })
    .await
    .unwrap();
}

// ---- manifests on standard input ---------------------------------------------------------------

/// Runs the eddy CLI against `platform` with `input` on its standard input; its stdout and
/// stderr together.
async fn eddy_with_input(platform: &Platform, args: &[&str], input: &str) -> (bool, String) {
    let (ok, stdout, stderr) = platform.eddy_with_input(args, input).await;
    (ok, format!("{stdout}{stderr}"))
}

/// `cat <<EOF | eddy apply -f -`, as Kyma's tutorials apply every manifest with kubectl: the
/// Kyma Function from standard input runs; `eddy delete -f -` of the same text removes it.
#[tokio::test]
async fn manifests_are_applied_and_deleted_from_standard_input() {
    let platform = Platform::start().await;
    let manifest = r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: piped
spec:
  runtime: nodejs26
  source:
    inline:
      source: |
        module.exports = { main: (req, res) => res.send("from stdin") };
"#;
    let (ok, output) = eddy_with_input(&platform, &["apply", "-f", "-"], manifest).await;
    assert!(ok, "{output}");
    platform.wait_running_at("default", "piped").await;
    let (status, body) = text(platform.invoke("piped", "/").send().await.unwrap()).await;
    assert_eq!((status, body.as_str()), (200, "from stdin"));
    let (ok, output) = eddy_with_input(&platform, &["delete", "-f", "-"], manifest).await;
    assert!(ok, "{output}");
    eventually("the Function gone", Duration::from_secs(30), || async {
        platform.function("piped").await["kind"] != "Function"
    })
    .await
    .unwrap();
    let (ok, output) = eddy_with_input(&platform, &["apply", "-f", "-"], "kind: [").await;
    assert!(!ok);
    assert!(
        output.contains("standard input is not valid YAML"),
        "{output}"
    );
}

/// A Function's instances carry its labels and annotations as its pods would, the deprecated
/// `template`'s too, and Kyma's four pod labels (Kyma users select pods by them).
#[tokio::test]
async fn local_instances_carry_the_functions_and_the_templates_labels() {
    let platform = Platform::start().await;
    platform
        .deploy(
            "labelled",
            json!({"runtime": "nodejs26",
                   "source": {"inline": {"source": "module.exports = { main: (req, res) => res.end() };"}},
                   "labels": {"team": "orders"}, "annotations": {"example.com/owner": "orders-team"},
                   "template": {"labels": {"tier": "gold"}, "annotations": {"example.com/cost": "low"}}}),
        )
        .await;
    let instances: Value = platform
        .get_json(&format!(
            "{}/apis/eddy.dev/v1alpha1/namespaces/default/functions/labelled/instances",
            platform.api
        ))
        .await;
    let metadata = &instances["items"][0]["metadata"];
    assert_eq!(metadata["labels"]["team"], "orders", "{instances}");
    assert_eq!(metadata["labels"]["tier"], "gold", "{instances}");
    assert_eq!(metadata["labels"]["eddy.dev/function"], "labelled");
    assert_eq!(metadata["annotations"]["example.com/owner"], "orders-team");
    assert_eq!(metadata["annotations"]["example.com/cost"], "low");
    // Kyma's label contract, as its Function controller labels a Function's pods (and its
    // Service selects them): function-name, managed-by, uuid (the Function's UID), resource.
    let function = platform.function("labelled").await;
    let uid = function["metadata"]["uid"].as_str().unwrap();
    assert_eq!(
        metadata["labels"]["serverless.kyma-project.io/function-name"],
        "labelled"
    );
    assert_eq!(
        metadata["labels"]["serverless.kyma-project.io/managed-by"],
        "function-controller"
    );
    assert_eq!(metadata["labels"]["serverless.kyma-project.io/uuid"], uid);
    assert_eq!(
        metadata["labels"]["serverless.kyma-project.io/resource"],
        "deployment"
    );
}

// ---- APIRules ------------------------------------------------------------------------------------

/// Kyma's trap, a rule hidden by an earlier one sharing a method: applied, but the APIRule is
/// in `Error` as on Kyma, with eddy's explanation as its description, and its host serves
/// nothing; fixed, it is Ready and serves.
#[tokio::test]
async fn an_apirule_with_a_hidden_rule_is_an_error_as_on_kyma() {
    let platform = Platform::start().await;
    deploy_on(
        &platform,
        "nodejs26",
        "hello",
        "module.exports = { main: (req, res) => res.send('hello ' + req.path) };",
        json!([]),
    )
    .await;
    let manifest = |second_path: &str| {
        format!(
            r#"apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata: {{name: trap}}
spec:
  hosts: [trap]
  service: {{name: hello, port: 80}}
  gateway: kyma-system/kyma-gateway
  rules:
    - path: /anything/one
      methods: [GET]
      noAuth: true
    - path: {second_path}
      methods: [GET, POST]
      noAuth: true
"#
        )
    };
    let (ok, _, stderr) = platform.apply_text(&manifest("/anything/{**}")).await;
    assert!(ok, "applying is not refused: {stderr}");
    eventually("the APIRule in Error", Duration::from_secs(20), || async {
        platform.apirule_state("default", "trap").await.0 == "Error"
    })
    .await
    .unwrap();
    let (_, description) = platform.apirule_state("default", "trap").await;
    assert!(
        description.contains("spec.rules[1] does not apply to /anything/one"),
        "{description}"
    );
    let port = platform.gateway.rsplit(':').next().unwrap().to_owned();
    let hosts = platform.host_client(&["trap.localhost"]);
    let url = format!("http://trap.localhost:{port}/anything/one");
    let answer = hosts.get(&url).send().await.unwrap();
    assert_ne!(answer.status(), 200, "an APIRule in Error serves nothing");
    let (ok, _, stderr) = platform.apply_text(&manifest("/other/{**}")).await;
    assert!(ok, "{stderr}");
    eventually(
        "the fixed APIRule Ready",
        Duration::from_secs(20),
        || async { platform.apirule_state("default", "trap").await.0 == "Ready" },
    )
    .await
    .unwrap();
    let answer = hosts.get(&url).send().await.unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.text().await.unwrap(), "hello /anything/one");
}

// ---- the publisher proxy's subscribed events ----------------------------------------------------

/// `GET /{application}/v1/events/subscribed` answers as Kyma's publisher proxy: the types the
/// Subscriptions receive from that application (standard matching by source; exact matching by
/// Kyma's `sap.kyma.custom.<application>.` prefix), each once.
#[tokio::test]
async fn the_event_bus_lists_an_applications_subscribed_events() {
    let platform = Platform::start().await;
    let sink = Sink::ok().await;
    platform
        .subscribe(
            "orders",
            json!({"sink": sink.url, "source": "shop", "types": ["order.created.v1", "order.paid.v2"]}),
        )
        .await;
    platform
        .subscribe(
            "orders-again",
            json!({"sink": sink.url, "source": "shop", "types": ["order.created.v1"]}),
        )
        .await;
    platform
        .subscribe(
            "carts",
            json!({"sink": sink.url, "typeMatching": "exact", "types": ["sap.kyma.custom.shop.cart.emptied.v1"]}),
        )
        .await;
    platform
        .subscribe(
            "invoices",
            json!({"sink": sink.url, "source": "billing", "types": ["invoice.sent.v1"]}),
        )
        .await;
    for name in ["orders", "orders-again", "carts", "invoices"] {
        platform.wait_subscription_ready(name).await;
    }
    let url = format!("{}/shop/v1/events/subscribed", platform.bus);
    let answer = std::sync::Arc::new(std::sync::Mutex::new(Value::Null));
    let listed = eventually("the four consumers listed", Duration::from_secs(20), || {
        let (request, answer) = (reqwest::get(url.clone()), answer.clone());
        async move {
            let listed: Value = request.await.unwrap().json().await.unwrap();
            let three = listed["eventsInfo"]
                .as_array()
                .is_some_and(|e| e.len() == 3);
            *answer.lock().unwrap() = listed;
            three
        }
    })
    .await;
    let answer = answer.lock().unwrap().clone();
    assert!(listed.is_ok(), "{answer}");
    assert_eq!(
        answer,
        json!({"eventsInfo": [
            {"name": "cart.emptied", "version": "v1"},
            {"name": "order.created", "version": "v1"},
            {"name": "order.paid", "version": "v2"},
        ]})
    );
    let none: Value = reqwest::get(format!("{}/nobody/v1/events/subscribed", platform.bus))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(none, json!({"eventsInfo": []}));
}

// ---- PUBLISHER_PROXY_ADDRESS ------------------------------------------------------------------

/// A Function may set PUBLISHER_PROXY_ADDRESS (Kyma's own tests point it at a publisher mock):
/// its runtime then publishes there, and eddy's publish token does not go with the event.
#[tokio::test]
async fn a_functions_own_publisher_address_is_what_its_runtime_uses() {
    // With publish tokens on, so the runtime has a token that must not reach the mock.
    let platform = Platform::start_with(Options {
        bus_tokens: vec!["publisher-secret".to_owned()],
        ..Options::default()
    })
    .await;
    let mock = Sink::ok().await;
    let token_holder = r#"
const sdk = require("sdk");
module.exports = { main: async (req, res) => {
  const answer = await sdk.emitCloudEvent("order.real.v1", "tests", { n: 2 }, { id: "real-1" });
  res.json({ status: answer.status });
} };
"#;
    // The platform's address still takes the function's token (else the event-bus says 401).
    deploy_on(&platform, "nodejs26", "platformed", token_holder, json!([])).await;
    let answer = json_answer(platform.invoke("platformed", "/")).await;
    assert!(
        answer["status"]
            .as_u64()
            .is_some_and(|s| (200..300).contains(&s)),
        "{answer}"
    );
    let source = r#"
const sdk = require("sdk");
module.exports = { main: async (req, res) => {
  const answer = await sdk.emitCloudEvent("order.mocked.v1", "tests", { n: 1 }, { id: "mocked-1" });
  res.json({ status: answer.status, address: process.env.PUBLISHER_PROXY_ADDRESS });
} };
"#;
    deploy_on(
        &platform,
        "nodejs26",
        "mocked",
        source,
        json!([{"name": "PUBLISHER_PROXY_ADDRESS", "value": mock.url}]),
    )
    .await;
    let answer = json_answer(platform.invoke("mocked", "/")).await;
    assert_eq!(answer["address"], mock.url.as_str());
    mock.wait_for(1).await;
    let received = &mock.received()[0];
    let event: Value = serde_json::from_slice(&received.body).unwrap();
    assert_eq!(event["id"], "mocked-1", "a structured CloudEvent: {event}");
    assert_eq!(event["type"], "order.mocked.v1");
    assert_eq!(
        received.header("authorization"),
        "",
        "no eddy token for a foreign address"
    );
}

/// Wildcard APIRule hosts, as Kyma takes them: `*.example.com` serves any name under it (one
/// label or more), a more specific APIRule's host wins over it, and locally `*` under the
/// gateway's domain serves any label.
#[tokio::test]
async fn wildcard_apirule_hosts_serve_any_name_under_them_and_yield_to_specific_ones() {
    let platform = Platform::start().await;
    for name in ["wild", "special", "catchall"] {
        deploy_on(
            &platform,
            "nodejs26",
            name,
            &format!("module.exports = {{ main: (req, res) => res.send('{name}') }};"),
            json!([]),
        )
        .await;
    }
    let rule = |name: &str, host: &str, service: &str| {
        format!(
            "apiVersion: gateway.kyma-project.io/v2\nkind: APIRule\nmetadata: {{name: {name}}}\nspec:\n  hosts: [\"{host}\"]\n  service: {{name: {service}, port: 80}}\n  gateway: kyma-system/kyma-gateway\n  rules:\n    - path: /*\n      methods: [GET]\n      noAuth: true\n"
        )
    };
    let manifests = [
        rule("wild", "*.example.com", "wild"),
        rule("special", "special.example.com", "special"),
        rule("catchall", "*", "catchall"),
    ]
    .join("---\n");
    let (ok, _, stderr) = platform.apply_text(&manifests).await;
    assert!(ok, "{stderr}");
    for name in ["wild", "special", "catchall"] {
        eventually(
            &format!("APIRule {name} Ready"),
            Duration::from_secs(20),
            || async { platform.apirule_state("default", name).await.0 == "Ready" },
        )
        .await
        .unwrap();
    }
    let port = platform.gateway.rsplit(':').next().unwrap().to_owned();
    let hosts = [
        "orders.example.com",
        "a.b.example.com",
        "special.example.com",
        "anything.localhost",
    ];
    let client = platform.host_client(&hosts);
    for (host, served_by) in [
        ("orders.example.com", "wild"),
        ("a.b.example.com", "wild"),
        ("special.example.com", "special"),
        ("anything.localhost", "catchall"),
    ] {
        let answer = client
            .get(format!("http://{host}:{port}/"))
            .send()
            .await
            .unwrap();
        let status = answer.status();
        assert_eq!(
            (status.as_u16(), answer.text().await.unwrap()),
            (200, served_by.to_owned()),
            "{host}"
        );
    }
}

/// One check an authorizer was sent.
#[derive(Debug, Clone)]
struct Check {
    method: String,
    path_and_query: String,
    headers: http::HeaderMap,
}

/// An oauth2-proxy-shaped authorizer on loopback: a session cookie `_oauth2_proxy=alice-session`
/// is allowed (202, with who the caller is in `x-auth-request-*` headers), anything else is
/// refused with 401 and a sign-in hint, as oauth2-proxy's `/oauth2/auth` answers. Every check
/// it is sent is kept.
async fn serve_authorizer() -> (u16, std::sync::Arc<std::sync::Mutex<Vec<Check>>>) {
    use axum::response::IntoResponse as _;
    let checks: std::sync::Arc<std::sync::Mutex<Vec<Check>>> = Default::default();
    let kept = checks.clone();
    let app = axum::Router::new().fallback(move |request: axum::extract::Request| {
        let kept = kept.clone();
        async move {
            let (parts, _) = request.into_parts();
            let signed_in = parts
                .headers
                .get("cookie")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|c| c.split("; ").any(|c| c == "_oauth2_proxy=alice-session"));
            kept.lock().unwrap().push(Check {
                method: parts.method.to_string(),
                path_and_query: parts.uri.path_and_query().unwrap().to_string(),
                headers: parts.headers,
            });
            if signed_in {
                (
                    http::StatusCode::ACCEPTED,
                    [
                        ("x-auth-request-user", "alice"),
                        ("x-auth-request-email", "alice@example.com"),
                        ("x-internal-note", "not for the function"),
                        ("x-auth-trace", "checked-by-oauth2-proxy"),
                    ],
                )
                    .into_response()
            } else {
                (
                    http::StatusCode::UNAUTHORIZED,
                    [
                        ("content-type", "text/plain"),
                        ("set-cookie", "_oauth2_proxy_csrf=abc; Path=/"),
                        ("x-debug", "not for the caller"),
                    ],
                    "Unauthorized: sign in at /oauth2/start",
                )
                    .into_response()
            }
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (port, checks)
}

/// Kyma's `extAuth`, through Istio's HTTP ext_authz contract: the authorizer named by the rule
/// (an extension provider in Istio's mesh config shape) is sent the call's method, path (after
/// its `pathPrefix`), host, authorization and listed headers, and no body; a 2xx lets the call
/// through with the answer's listed headers; any other answer reaches the caller as the
/// authorizer gave it, with only its listed headers. `restrictions` (a JWT) apply after it. An
/// authorizer that cannot be asked answers `statusOnError`, or lets the call through with
/// `failOpen`. The Function's own path obeys the rule too. A rule naming an authorizer the
/// gateway lacks is taken but not honoured until Kyma's Istio resource declares it.
#[tokio::test]
async fn an_ext_auth_rule_asks_its_authorizer_then_checks_its_jwt_restrictions() {
    use support::jwt::{ISSUER, ISSUER_KEY, jwt, serve_jwks};
    let (port, checks) = serve_authorizer().await;
    let closed_port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let providers = eddy_model::ext_authz::ExtensionProviders::parse(&format!(
        r#"
extensionProviders:
  - name: oauth2-proxy
    envoyExtAuthzHttp:
      service: 127.0.0.1
      port: {port}
      pathPrefix: /check
      includeRequestHeadersInCheck: ["cookie", "x-forwarded-*"]
      includeAdditionalHeadersInCheck: {{x-checked-by: eddy}}
      headersToUpstreamOnAllow: ["x-auth-request-*"]
      headersToDownstreamOnAllow: ["x-auth-trace"]
      headersToDownstreamOnDeny: ["content-type", "set-cookie"]
  - name: gone
    envoyExtAuthzHttp: {{service: 127.0.0.1, port: {closed_port}, timeout: 2s, statusOnError: "503"}}
  - name: gone-open
    envoyExtAuthzHttp: {{service: 127.0.0.1, port: {closed_port}, timeout: 2s, failOpen: true}}
"#
    ))
    .unwrap();
    let platform = Platform::start_with(Options {
        extension_providers: Some(providers),
        ..Options::default()
    })
    .await;
    deploy_on(
        &platform,
        "nodejs26",
        "orders",
        "module.exports = { main: (req, res) => res.json({ user: req.get('x-auth-request-user') || null, \
         internal: req.get('x-internal-note') || null, path: req.originalUrl }) };",
        json!([]),
    )
    .await;
    let (jwks_uri, _) = serve_jwks().await;
    let (ok, _, stderr) = platform
        .apply_text(&format!(
            r#"apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata: {{name: orders}}
spec:
  hosts: [orders]
  service: {{name: orders, port: 80}}
  gateway: kyma-system/kyma-gateway
  rules:
    - path: /*
      methods: [GET]
      extAuth:
        authorizers: [oauth2-proxy]
    - path: /admin
      methods: [POST]
      extAuth:
        authorizers: [oauth2-proxy]
        restrictions:
          authentications: [{{issuer: "{ISSUER}", jwksUri: "{jwks_uri}"}}]
    - path: /gone
      methods: [PUT]
      extAuth: {{authorizers: [gone]}}
    - path: /gone-open
      methods: [DELETE]
      extAuth: {{authorizers: [gone-open]}}
"#
        ))
        .await;
    assert!(ok, "{stderr}");
    eventually("APIRule orders Ready", Duration::from_secs(20), || async {
        platform.apirule_state("default", "orders").await.0 == "Ready"
    })
    .await
    .unwrap();
    let gateway_port = platform.gateway.rsplit(':').next().unwrap().to_owned();
    let host = "orders.localhost";
    let base = format!("http://{host}:{gateway_port}");
    let client = platform.host_client(&[host]);
    let session = "theme=dark; _oauth2_proxy=alice-session";

    // Refused by the authorizer: its status, body and listed headers reach the caller.
    let refused = client
        .get(format!("{base}/orders/42?full=1"))
        .header("x-forwarded-proto", "https")
        .header("x-not-listed", "kept back")
        .header("authorization", "Bearer opaque")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 401);
    assert_eq!(
        refused.headers()["set-cookie"],
        "_oauth2_proxy_csrf=abc; Path=/"
    );
    assert!(refused.headers().get("x-debug").is_none());
    assert_eq!(
        refused.text().await.unwrap(),
        "Unauthorized: sign in at /oauth2/start"
    );
    let check = checks.lock().unwrap().last().cloned().unwrap();
    assert_eq!(check.method, "GET");
    assert_eq!(check.path_and_query, "/check/orders/42?full=1");
    assert_eq!(check.headers["host"], format!("{host}:{gateway_port}"));
    assert_eq!(check.headers["authorization"], "Bearer opaque");
    assert_eq!(check.headers["x-forwarded-proto"], "https");
    assert_eq!(check.headers["x-checked-by"], "eddy");
    assert_eq!(check.headers["content-length"], "0");
    assert!(check.headers.get("x-not-listed").is_none(), "{check:?}");
    assert!(check.headers.get("cookie").is_none(), "{check:?}");

    // Allowed: the Function sees the listed headers of the answer, the caller the others.
    let allowed = client
        .get(format!("{base}/orders/42"))
        .header("cookie", session)
        .send()
        .await
        .unwrap();
    assert_eq!(allowed.status().as_u16(), 200);
    assert_eq!(allowed.headers()["x-auth-trace"], "checked-by-oauth2-proxy");
    assert_eq!(
        allowed.json::<Value>().await.unwrap(),
        json!({"user": "alice", "internal": null, "path": "/orders/42"})
    );
    assert_eq!(
        checks.lock().unwrap().last().unwrap().headers["cookie"],
        session
    );

    // What the authorizer grants overrides what the caller sent under the same name.
    let forged = client
        .get(format!("{base}/orders/1"))
        .header("cookie", session)
        .header("x-auth-request-user", "mallory")
        .send()
        .await
        .unwrap();
    assert_eq!(forged.json::<Value>().await.unwrap()["user"], "alice");

    // The JWT restrictions apply after the authorizer.
    let token = jwt(ISSUER_KEY, "key-1", json!({}));
    let post = |cookie: Option<&str>, token: Option<&str>| {
        let mut request = client.post(format!("{base}/admin"));
        if let Some(cookie) = cookie {
            request = request.header("cookie", cookie);
        }
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        async move { request.send().await.unwrap().status().as_u16() }
    };
    assert_eq!(post(Some(session), None).await, 403);
    assert_eq!(post(None, Some(&token)).await, 401);
    assert_eq!(post(Some(session), Some(&token)).await, 200);

    // An authorizer that cannot be asked: statusOnError, or through with failOpen.
    let gone = client.put(format!("{base}/gone")).send().await.unwrap();
    assert_eq!(gone.status().as_u16(), 503);
    let gone_open = client
        .delete(format!("{base}/gone-open"))
        .send()
        .await
        .unwrap();
    assert_eq!(gone_open.status().as_u16(), 200);

    // The Function's own path obeys the rule, with the path the Function is sent.
    let own_path = format!("{}/default/orders/items?page=2", platform.gateway);
    let refused = platform.http.get(&own_path).send().await.unwrap();
    assert_eq!(refused.status().as_u16(), 401);
    assert_eq!(
        checks.lock().unwrap().last().unwrap().path_and_query,
        "/check/items?page=2"
    );
    let allowed = platform
        .http
        .get(&own_path)
        .header("cookie", session)
        .send()
        .await
        .unwrap();
    assert_eq!(allowed.status().as_u16(), 200);

    // An authorizer the gateway does not have yet: the APIRule is taken (an Istio resource
    // may bring the authorizer, later or later in the same file) but not honoured, and both the
    // apply and its status say why, by field.
    let (ok, _, stderr) = platform
        .apply_text(
            "apiVersion: gateway.kyma-project.io/v2\nkind: APIRule\nmetadata: {name: opa}\nspec:\n  hosts: [opa]\n  service: {name: orders, port: 80}\n  rules:\n    - path: /*\n      methods: [GET]\n      extAuth: {authorizers: [opa]}\n",
        )
        .await;
    assert!(ok, "{stderr}");
    let lacking = |text: &str| {
        text.contains("spec.rules[0].extAuth.authorizers[0]")
            // (A Warning header carries ' for ".)
            && (text.contains("no extension provider \"opa\"")
                || text.contains("no extension provider 'opa'"))
            && text.contains("oauth2-proxy, gone, gone-open")
    };
    assert!(
        stderr.starts_with("Warning:") && lacking(&stderr),
        "{stderr}"
    );
    let (state, description) = platform.apirule_state("default", "opa").await;
    assert!(state == "Error" && lacking(&description), "{description}");

    // Kyma's extAuth docs, "Minimal configuration": "To use the extAuth access strategy, you
    // must first configure the authorizer in the Istio custom resource" (`spec.config.
    // authorizers`), and Kyma's Istio resource docs: "You are only allowed to use one Istio
    // CR, which you must create in the kyma-system namespace". A name the gateway's own
    // providers hold, or another namespace, is refused by field.
    let istio = |namespace: &str, name: &str| {
        format!(
            r#"apiVersion: operator.kyma-project.io/v1alpha2
kind: Istio
metadata: {{name: default, namespace: {namespace}}}
spec:
  config:
    numTrustedProxies: 1
    authorizers:
      - name: {name}
        service: 127.0.0.1
        port: {port}
        pathPrefix: /opa
        timeout: 2s
        headers:
          inCheck: {{include: [cookie], add: {{x-checked-by: kyma-istio}}}}
          toUpstream: {{onAllow: [x-auth-request-user]}}
          toDownstream: {{onDeny: [set-cookie]}}
"#
        )
    };
    let (ok, _, stderr) = platform
        .apply_text(&istio("kyma-system", "oauth2-proxy"))
        .await;
    assert!(!ok);
    assert!(
        stderr.contains("spec.config.authorizers[0].name")
            && stderr.contains("--extension-providers"),
        "{stderr}"
    );
    let (ok, _, stderr) = platform.apply_text(&istio("default", "opa")).await;
    assert!(!ok);
    assert!(
        stderr.contains("metadata.namespace: Kyma reads an Istio resource in kyma-system only"),
        "{stderr}"
    );
    let (ok, stdout, stderr) = platform.apply_text(&istio("kyma-system", "opa")).await;
    assert!(ok, "{stderr}");
    assert_eq!(
        stdout.trim(),
        "istio.operator.kyma-project.io/default created"
    );
    let (ok, listed, _) = platform.eddy(&["get", "istios", "-n", "kyma-system"]).await;
    assert!(
        ok && listed.contains("Ready") && listed.contains("the gateway's authorizers include opa"),
        "{listed}"
    );
    eventually("APIRule opa Ready", Duration::from_secs(20), || async {
        platform.apirule_state("default", "opa").await.0 == "Ready"
    })
    .await
    .unwrap();
    let opa = platform.host_client(&["opa.localhost"]);
    let opa_url = format!("http://opa.localhost:{gateway_port}/items?page=1");
    let refused = opa.get(&opa_url).send().await.unwrap();
    assert_eq!(refused.status().as_u16(), 401);
    assert!(refused.headers().get("content-type").is_none());
    let check = checks.lock().unwrap().last().cloned().unwrap();
    assert_eq!(check.path_and_query, "/opa/items?page=1");
    assert_eq!(check.headers["x-checked-by"], "kyma-istio");
    let allowed = opa
        .get(&opa_url)
        .header("cookie", session)
        .send()
        .await
        .unwrap();
    assert_eq!(allowed.status().as_u16(), 200);
    let seen: Value = allowed.json().await.unwrap();
    assert_eq!(seen["user"], "alice");

    // Deleted, it takes its authorizers along: the APIRule is no longer honoured.
    let (ok, _, stderr) = platform
        .eddy(&["delete", "istio", "default", "-n", "kyma-system"])
        .await;
    assert!(ok, "{stderr}");
    eventually(
        "APIRule opa an Error again",
        Duration::from_secs(20),
        || async {
            let (state, description) = platform.apirule_state("default", "opa").await;
            state == "Error" && lacking(&description)
        },
    )
    .await
    .unwrap();
    // Its host routes nothing (on Kyma, no VirtualService: 404).
    eventually(
        "opa.localhost to route nothing",
        Duration::from_secs(10),
        || async {
            let gone = opa.get(&opa_url).header("cookie", session).send().await;
            gone.is_ok_and(|gone| gone.status() == 404)
        },
    )
    .await
    .unwrap();
}

/// An authorizer that keeps its callers waiting or denies with a large page: `/big/...` answers
/// 401 with a 200 KB sign-in page, `/slow/...` answers 200 after 20 s. Every check's
/// `X-Forwarded-For` is kept.
async fn serve_awkward_authorizer() -> (u16, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use axum::response::IntoResponse as _;
    let forwarded: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
    let kept = forwarded.clone();
    let app = axum::Router::new().fallback(move |request: axum::extract::Request| {
        let kept = kept.clone();
        let forwarded_for = request
            .headers()
            .get("x-forwarded-for")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let slow = request.uri().path().starts_with("/slow");
        async move {
            kept.lock().unwrap().push(forwarded_for);
            if slow {
                tokio::time::sleep(Duration::from_secs(20)).await;
                return http::StatusCode::OK.into_response();
            }
            let page = format!("<html>sign in{}</html>", " ".repeat(200_000));
            (
                http::StatusCode::UNAUTHORIZED,
                [
                    ("www-authenticate", "Bearer realm=\"shop\""),
                    ("content-type", "text/html"),
                ],
                page,
            )
                .into_response()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (port, forwarded)
}

/// The probe's authorizer findings:
/// - A denial is the authorizer's answer, taken from its status and headers: a 401 with a 200 KB
///   sign-in page reaches the caller as a 401 with the page cut at 64 KiB, with a fail-closed
///   provider (it used to be its `statusOnError`, 403) and with `failOpen` (the call used to go
///   through to the Function: `failOpen` is for an authorizer that cannot be asked, not one
///   that says no).
/// - The rule's `timeout` covers the whole call, the authorizer included: with `timeout: 3`
///   and an authorizer that takes 20 s, the caller gets 504 after 3 s (it used to wait 20 s and
///   get 200). A hundred such calls at once leave an unrelated Function answering at once.
/// - `X-Forwarded-For` gets the caller's address appended, as Envoy at the edge does: the
///   authorizer and the Function see what the caller wrote, then the peer the gateway saw.
/// - A denial the gateway cannot read (a 401 with 150 `Set-Cookie`, a 500 KB header, a
///   malformed header line) is a denial, answered `statusOnError` (403) with `failOpen` too: it
///   used to be taken for "could not be asked", and `failOpen` let the call through (200).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authorizers_answer_is_its_status_and_the_rules_timeout_bounds_it() {
    let (port, forwarded) = serve_awkward_authorizer().await;
    let unreadable_port = serve_unreadable_authorizer().await;
    let providers = eddy_model::ext_authz::ExtensionProviders::parse(&format!(
        r#"
extensionProviders:
  - name: big
    envoyExtAuthzHttp: {{service: 127.0.0.1, port: {port}, pathPrefix: /big, includeRequestHeadersInCheck: [x-forwarded-for]}}
  - name: big-open
    envoyExtAuthzHttp: {{service: 127.0.0.1, port: {port}, pathPrefix: /big, failOpen: true}}
  - name: slow
    envoyExtAuthzHttp: {{service: 127.0.0.1, port: {port}, pathPrefix: /slow}}
  - name: unreadable
    envoyExtAuthzHttp: {{service: 127.0.0.1, port: {unreadable_port}, failOpen: true}}
"#
    ))
    .unwrap();
    let platform = Platform::start_with(Options {
        extension_providers: Some(providers),
        ..Options::default()
    })
    .await;
    let echo = "module.exports = { main: (req, res) => res.json({ xff: req.get('x-forwarded-for') || null }) };";
    deploy_on(&platform, "nodejs26", "authz", echo, json!([])).await;
    deploy_on(&platform, "nodejs26", "bystander", echo, json!([])).await;
    let (ok, _, stderr) = platform
        .apply_text(
            r#"apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata: {name: authz}
spec:
  hosts: [authz]
  service: {name: authz, port: 80}
  rules:
    - path: /big
      methods: [GET]
      extAuth: {authorizers: [big]}
    - path: /big-open
      methods: [GET]
      extAuth: {authorizers: [big-open]}
    - path: /slow
      methods: [GET]
      timeout: 3
      extAuth: {authorizers: [slow]}
    - path: /open
      methods: [GET]
      noAuth: true
    - path: /unreadable/{*}
      methods: [GET]
      extAuth: {authorizers: [unreadable]}
"#,
        )
        .await;
    assert!(ok, "{stderr}");
    eventually("APIRule authz Ready", Duration::from_secs(20), || async {
        platform.apirule_state("default", "authz").await.0 == "Ready"
    })
    .await
    .unwrap();
    let gateway_port = platform.gateway.rsplit(':').next().unwrap().to_owned();
    let base = format!("http://authz.localhost:{gateway_port}");
    let client = platform.host_client(&["authz.localhost"]);

    // A large denial is the authorizer's answer, cut.
    for path in ["/big", "/big-open"] {
        let denied = client
            .get(format!("{base}{path}"))
            .header("x-forwarded-for", "203.0.113.9")
            .send()
            .await
            .unwrap();
        assert_eq!(denied.status().as_u16(), 401, "{path}");
        assert_eq!(
            denied.headers()["www-authenticate"],
            "Bearer realm=\"shop\""
        );
        let page = denied.text().await.unwrap();
        assert_eq!(page.len(), 64 * 1024, "{path}");
        assert!(page.starts_with("<html>sign in"), "{path}");
    }
    // The authorizer saw the caller's X-Forwarded-For, then the gateway's peer; so does the
    // Function.
    assert_eq!(
        forwarded.lock().unwrap().first().cloned().unwrap(),
        "203.0.113.9, 127.0.0.1"
    );
    let open: Value = client
        .get(format!("{base}/open"))
        .header("x-forwarded-for", "203.0.113.9")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(open["xff"], "203.0.113.9, 127.0.0.1");

    // A denial that cannot be read is a denial, failOpen or not.
    for kind in ["cookies", "huge", "malformed"] {
        let denied = client
            .get(format!("{base}/unreadable/{kind}"))
            .send()
            .await
            .unwrap();
        let status = denied.status().as_u16();
        let text = denied.text().await.unwrap();
        assert_eq!(status, 403, "{kind}: {text}");
        assert!(!text.contains("xff"), "{kind} reached the Function: {text}");
    }
    // The same authorizer's readable allow still lets a call through.
    let allowed = client
        .get(format!("{base}/unreadable/allow"))
        .send()
        .await
        .unwrap();
    assert_eq!(allowed.status().as_u16(), 200);

    // The rule's timeout covers the authorizer: 504 after 3 s, not 200 after 20 s.
    let started = std::time::Instant::now();
    let slow = client.get(format!("{base}/slow")).send().await.unwrap();
    let took = started.elapsed();
    assert_eq!(slow.status().as_u16(), 504, "{:?}", slow.text().await);
    assert!(
        took >= Duration::from_millis(2_900) && took < Duration::from_secs(8),
        "answered after {took:?}"
    );

    // A hundred calls held by the slow authorizer: another Function still answers at once.
    let held: Vec<_> = (0..100)
        .map(|_| {
            let request = client.get(format!("{base}/slow"));
            tokio::spawn(async move { request.send().await.map(|r| r.status().as_u16()) })
        })
        .collect();
    eventually(
        "the hundred slow checks in flight",
        Duration::from_secs(10),
        || async { forwarded.lock().unwrap().len() >= 103 },
    )
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let bystander = platform.invoke("bystander", "/").send().await.unwrap();
    let took = started.elapsed();
    assert_eq!(bystander.status().as_u16(), 200);
    assert!(
        took < Duration::from_secs(1),
        "the bystander answered after {took:?}"
    );
    for call in held {
        assert_eq!(call.await.unwrap().unwrap(), 504);
    }
}

/// An authorizer on a raw socket whose denials the gateway cannot read, by the check's path:
/// `/unreadable/cookies` a 401 with 150 `Set-Cookie`, `/unreadable/huge` a 401 with a 500 KB
/// header, `/unreadable/malformed` a 401 with a header line without a colon; any other path
/// an allowing 200. Returns its port.
async fn serve_unreadable_authorizer() -> u16 {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buffer = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(read) => head.extend_from_slice(&buffer[..read]),
                    }
                }
                let line = String::from_utf8_lossy(&head)
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_owned();
                let mut answer = String::from("HTTP/1.1 401 Unauthorized\r\n");
                if line.contains("/unreadable/cookies") {
                    for n in 0..150 {
                        answer.push_str(&format!("Set-Cookie: c{n}=v\r\n"));
                    }
                } else if line.contains("/unreadable/huge") {
                    answer.push_str(&format!("X-Big: {}\r\n", "a".repeat(500 * 1024)));
                } else if line.contains("/unreadable/malformed") {
                    answer.push_str("this line is no header\r\n");
                } else {
                    answer = String::from("HTTP/1.1 200 OK\r\n");
                }
                answer.push_str("Content-Length: 0\r\nConnection: close\r\n\r\n");
                let _ = stream.write_all(answer.as_bytes()).await;
            });
        }
    });
    port
}

/// Every file under `dir` that holds `needle`.
fn files_holding(dir: &std::path::Path, needle: &[u8]) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(current) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&current) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if kind.is_dir() {
                pending.push(entry.path());
            } else if kind.is_file()
                && std::fs::read(entry.path())
                    .is_ok_and(|bytes| bytes.windows(needle.len()).any(|w| w == needle))
            {
                found.push(entry.path());
            }
        }
    }
    found
}

/// Kyma's private package registry Secret, locally: a Function whose dependency lives in a
/// private registry fails its install without `serverless-package-registry-config`, and is
/// built and runs once the Secret is applied (its namespace's `.npmrc`; Python through the
/// cluster-wide Secret in `kyma-system` with Kyma's label, which without the label is not
/// used). The token never reaches the function: not in its environment, not in any file of
/// the data directory (builds, logs).
#[tokio::test]
async fn private_packages_install_with_kyma_s_package_registry_secret() {
    const TOKEN: &str = "registry-token-5e1f0c";
    let (registry, refused) = support::registry::serve("127.0.0.1", TOKEN).await;
    let host = registry.trim_start_matches("http://");
    let platform = Platform::start().await;
    let function = |namespace: &str, name: &str, runtime: &str, source: &str, deps: &str| {
        format!(
            "apiVersion: serverless.kyma-project.io/v1alpha2\nkind: Function\nmetadata: {{name: {name}, namespace: {namespace}}}\nspec:\n  runtime: {runtime}\n  source:\n    inline:\n      source: |\n{}\n      dependencies: |\n{}\n",
            source
                .lines()
                .map(|l| format!("        {l}"))
                .collect::<Vec<_>>()
                .join("\n"),
            deps.lines()
                .map(|l| format!("        {l}"))
                .collect::<Vec<_>>()
                .join("\n"),
        )
    };
    let node_source = "const greeting = require('@eddy-private/greeting');\nmodule.exports = { main: (req, res) => res.json({ greeting: greeting.hello('kyma'),\n  registryEnv: Object.keys(process.env).filter((k) => /npm_config|pip_config/i.test(k)) }) };";
    let (ok, _, stderr) = platform
        .apply_text(&function(
            "default",
            "greet",
            "nodejs26",
            node_source,
            r#"{"name": "greet", "dependencies": {"@eddy-private/greeting": "1.0.0"}}"#,
        ))
        .await;
    assert!(ok, "{stderr}");
    // Without the Secret npm does not know the private registry, and the build says so.
    eventually("the install to fail", Duration::from_secs(120), || async {
        let (state, reason, message) =
            condition_of_at(&platform, "default", "greet", "BuildReady").await;
        state == "False"
            && reason == "DependencyInstallFailed"
            && message.contains("@eddy-private/greeting")
    })
    .await
    .unwrap();
    let secret = format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: serverless-package-registry-config, namespace: default}}\ntype: Opaque\nstringData:\n  .npmrc: |\n    @eddy-private:registry={registry}/\n    //{host}/:_authToken={TOKEN}\n"
    );
    let (ok, _, stderr) = platform.apply_text(&secret).await;
    assert!(ok, "{stderr}");
    // The Secret's arrival builds the Function again, and the private package is installed.
    platform.wait_running_at("default", "greet").await;
    let answer = json_answer(
        platform
            .http
            .get(format!("{}/default/greet", platform.gateway)),
    )
    .await;
    assert_eq!(
        answer,
        json!({"greeting": "hello kyma, from the private registry", "registryEnv": []})
    );

    // Python, through the cluster-wide Secret: only with Kyma's label.
    let python_source = "import eddy_private_greeting\n\ndef main(event, context):\n    return eddy_private_greeting.hello('kyma')";
    let cluster_secret = |labels: &str| {
        format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: serverless-package-registry-config\n  namespace: kyma-system\n  labels: {{{labels}}}\ntype: Opaque\nstringData:\n  pip.conf: |\n    [global]\n    index-url = http://eddy:{TOKEN}@{host}/simple/\n    trusted-host = 127.0.0.1\n"
        )
    };
    let (ok, _, stderr) = platform.apply_text(&cluster_secret("")).await;
    assert!(ok, "{stderr}");
    let (ok, _, stderr) = platform
        .apply_text(&function(
            "analytics",
            "count",
            "python312",
            python_source,
            "eddy-private-greeting==1.0.0",
        ))
        .await;
    assert!(ok, "{stderr}");
    eventually(
        "the unlabelled Secret to be ignored",
        Duration::from_secs(120),
        || async {
            let (state, reason, _) =
                condition_of_at(&platform, "analytics", "count", "BuildReady").await;
            state == "False" && reason == "DependencyInstallFailed"
        },
    )
    .await
    .unwrap();
    let (ok, _, stderr) = platform
        .apply_text(&cluster_secret(
            "serverless.kyma-project.io/config: credentials",
        ))
        .await;
    assert!(ok, "{stderr}");
    platform.wait_running_at("analytics", "count").await;
    let (status, body) = text(
        platform
            .http
            .get(format!("{}/analytics/count", platform.gateway))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (status, body.as_str()),
        (200, "hello kyma, from the private index")
    );

    // Every request the registry was sent carried the token.
    assert!(refused.lock().unwrap().is_empty(), "{refused:?}");
    // The token is in no build, log or runtime file.
    let holding = files_holding(platform.data_dir.path(), TOKEN.as_bytes());
    assert!(holding.is_empty(), "{holding:?}");
}

async fn condition_of_at(
    platform: &Platform,
    namespace: &str,
    name: &str,
    type_: &str,
) -> (String, String, String) {
    support::condition_of(&platform.function_at(namespace, name).await, type_)
}

/// A Function's status describes its newest version, as Kyma's controller reports it: an update
/// whose dependencies cannot be installed leaves the previous version serving, and Running is
/// False with npm's own words (it used to stay True, "1/1 ready", for as long as it was
/// watched), `status.observedGeneration` the update's; mended, Running is True again.
#[tokio::test]
async fn running_describes_the_newest_version_while_an_older_one_serves() {
    let platform = Platform::start().await;
    let source = |version: &str| {
        format!("module.exports = {{ main: (req, res) => res.send('{version}') }};")
    };
    deploy_on(&platform, "nodejs26", "updated", &source("v1"), json!([])).await;
    let (ok, _, stderr) = platform
        .apply_text(&format!(
            "apiVersion: serverless.kyma-project.io/v1alpha2\nkind: Function\nmetadata: {{name: updated}}\nspec:\n  runtime: nodejs26\n  source:\n    inline:\n      source: \"{}\"\n      dependencies: '{{\"dependencies\": {{\"eddy-no-such-package-7f3c\": \"1.0.0\"}}}}'\n",
            source("v2")
        ))
        .await;
    assert!(ok, "{stderr}");
    let generation = platform.function("updated").await["metadata"]["generation"].clone();
    let last = std::sync::Arc::new(std::sync::Mutex::new(Value::Null));
    let failed = eventually(
        "Running False for the update that cannot install",
        Duration::from_secs(120),
        || {
            let (last, platform, generation) = (last.clone(), &platform, &generation);
            async move {
                let function = platform.function("updated").await;
                let running = support::condition_of(&function, "Running");
                *last.lock().unwrap() = function.clone();
                running.0 == "False"
                    && running.1 == "DependencyInstallFailed"
                    && function["status"]["observedGeneration"] == *generation
            }
        },
    )
    .await;
    let function = last.lock().unwrap().clone();
    assert!(failed.is_ok(), "{function}");
    let (_, _, message) = support::condition_of(&function, "Running");
    assert!(
        message.contains("previous version keeps serving") && message.contains("404"),
        "{message}"
    );
    // The previous version serves meanwhile.
    let (status, body) = text(platform.invoke("updated", "/").send().await.unwrap()).await;
    assert_eq!((status, body.as_str()), (200, "v1"));
    // Mended: the newest version runs, and Running says so.
    deploy_on(&platform, "nodejs26", "updated", &source("v3"), json!([])).await;
    eventually("v3 serves", Duration::from_secs(60), || async {
        text(platform.invoke("updated", "/").send().await.unwrap()).await == (200, "v3".to_owned())
    })
    .await
    .unwrap();
    let function = platform.function("updated").await;
    assert_eq!(
        support::condition_of(&function, "Running").0,
        "True",
        "{function}"
    );
}
