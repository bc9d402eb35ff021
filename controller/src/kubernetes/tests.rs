//! The Kubernetes backend against a mock API server that asserts each request (method, path
//! and query, body) and answers it, in the order the reconciler must send them; plus the
//! pure decisions and the rendered objects.

use std::{collections::BTreeSet, sync::Arc, time::Duration};

use eddy_model::resources::{Function, SinkPolicy, Subscription};
use http::{Method, Request, Response};
use kube::{Client, client::Body, runtime::controller::Action};
use serde_json::{Value, json};
use tower_test::mock;

use super::*;

const APPLY: &str = "?&force=true&fieldManager=eddy-controller";

type Respond = Box<dyn FnOnce(Value) -> (u16, Value) + Send>;

/// One request the API server expects, and how it answers.
struct Exchange {
    method: Method,
    uri: String,
    respond: Respond,
}

fn expect(
    method: Method,
    uri: impl Into<String>,
    respond: impl FnOnce(Value) -> (u16, Value) + Send + 'static,
) -> Exchange {
    Exchange {
        method,
        uri: uri.into(),
        respond: Box::new(respond),
    }
}

/// Answers a server-side apply with what was applied (plus `extra`, merged at the top level),
/// after checking the body equals `expected`.
fn applied(expected: Value, extra: Value) -> impl FnOnce(Value) -> (u16, Value) + Send + 'static {
    move |body| {
        assert_eq!(body, expected, "the applied object");
        let mut answer = body;
        if let (Some(answer), Some(extra)) = (answer.as_object_mut(), extra.as_object()) {
            for (key, value) in extra {
                answer.insert(key.clone(), value.clone());
            }
        }
        (200, answer)
    }
}

/// The requests of a Function that installs dependencies in namespace `shop` where no private
/// package registry Secret applies: its own, the cluster-wide one, and the copy's removal.
fn no_package_registry() -> Vec<Exchange> {
    vec![
        expect(
            Method::GET,
            "/api/v1/namespaces/shop/secrets/serverless-package-registry-config",
            not_found,
        ),
        expect(
            Method::GET,
            "/api/v1/namespaces/kyma-system/secrets/serverless-package-registry-config",
            not_found,
        ),
        expect(
            Method::DELETE,
            "/api/v1/namespaces/shop/secrets/eddy-package-registry-config?",
            not_found,
        ),
    ]
}

fn not_found(_: Value) -> (u16, Value) {
    (
        404,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"}),
    )
}

/// The RBAC permissions of every request the mock API servers of this process answered.
static PERMISSIONS_USED: std::sync::Mutex<BTreeSet<String>> =
    std::sync::Mutex::new(BTreeSet::new());

/// A mock API server that expects exactly `exchanges`, in order, and nothing after them.
/// Records what each request needs in [`PERMISSIONS_USED`].
fn api_server(exchanges: Vec<Exchange>) -> (Client, tokio::task::JoinHandle<Vec<Value>>) {
    let (service, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let task = tokio::spawn(async move {
        let mut bodies = Vec::new();
        for (index, exchange) in exchanges.into_iter().enumerate() {
            // Generous: a reconcile may run the real `git` between two requests, and a loaded
            // machine is slow; a request that never comes fails the test all the same.
            let (request, send) =
                tokio::time::timeout(Duration::from_secs(30), handle.next_request())
                    .await
                    .unwrap_or_else(|_| {
                        panic!(
                            "request #{index} ({} {}) was never sent",
                            exchange.method, exchange.uri
                        )
                    })
                    .unwrap_or_else(|| {
                        panic!(
                            "the client went away before request #{index} ({} {})",
                            exchange.method, exchange.uri
                        )
                    });
            assert_eq!(
                (request.method(), request.uri().to_string()),
                (&exchange.method, exchange.uri.clone()),
                "request #{index}"
            );
            PERMISSIONS_USED
                .lock()
                .expect("not poisoned")
                .extend(eddy_testing::rbac::needed_by(
                    request.method().as_str(),
                    &request.uri().to_string(),
                ));
            // kube-lease-manager writes the Lease's holder fields with strategic merge patches.
            if request.method() == Method::PATCH
                && !request.uri().path().contains("/coordination.k8s.io/")
            {
                let content_type = request.headers().get(http::header::CONTENT_TYPE).cloned();
                assert_eq!(
                    content_type.as_ref().and_then(|v| v.to_str().ok()),
                    Some("application/apply-patch+yaml"),
                    "every write is a server-side apply"
                );
            }
            let bytes = request
                .into_body()
                .collect_bytes()
                .await
                .expect("request body");
            let body: Value = if bytes.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&bytes).expect("a JSON body")
            };
            bodies.push(body.clone());
            let (status, answer) = (exchange.respond)(body);
            send.send_response(
                Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(Body::from(serde_json::to_vec(&answer).expect("JSON")))
                    .expect("response"),
            );
        }
        let extra = tokio::time::timeout(Duration::from_secs(30), handle.next_request())
            .await
            .expect("the client is dropped after the reconcile");
        if let Some((request, _)) = extra {
            panic!("unexpected request {} {}", request.method(), request.uri());
        }
        bodies
    });
    (Client::new(service, "default"), task)
}

fn config() -> RenderConfig {
    RenderConfig {
        registry: "registry.example.com/eddy".to_owned(),
        builder_image: "gcr.io/kaniko-project/executor:v1.23.2".to_owned(),
        git_image: "docker.io/alpine/git:v2.47.2".to_owned(),
        registry_secret: None,
        insecure_registry: false,
        publisher_url: "http://eddy-event-bus.eddy-system.svc.cluster.local/publish".to_owned(),
        kyma_publisher_url: None,
        build_timeout_seconds: 600,
        target_cpu_utilization: 50,
        trace_collector: None,
        build: BuildMode::Image,
        runtime_images: "ghcr.io/eddy-dev/eddy-runtime-{runtime}:{version}".to_owned(),
        pod_security: PodSecurityLevel::Restricted,
        egress: render::Egress::default(),
    }
}

fn function(spec: Value) -> Function {
    let mut object = json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
        "metadata": {"name": "reserve-stock", "namespace": "shop", "uid": "8d3f6f7e-1", "generation": 1},
        "spec": {
            "runtime": "nodejs20",
            "source": {"inline": {"source": "module.exports = { main: () => 'ok' }"}},
            "env": [{"name": "LOG_LEVEL", "value": "debug"}],
            "scaleConfig": {"minReplicas": 1, "maxReplicas": 3},
        },
    });
    if let (Some(target), Some(patch)) = (object["spec"].as_object_mut(), spec.as_object()) {
        for (key, value) in patch {
            if value.is_null() {
                target.remove(key);
            } else {
                target.insert(key.clone(), value.clone());
            }
        }
    }
    serde_json::from_value(object).expect("a Function")
}

fn with_status(mut function: Function, status: &Value) -> Function {
    function.status = Some(serde_json::from_value(status.clone()).expect("a status"));
    function
}

fn to_json<T: serde::Serialize>(value: &T) -> Value {
    serde_json::to_value(value).expect("JSON")
}

fn condition_of<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .and_then(|all| all.iter().find(|c| c["type"] == type_))
        .unwrap_or_else(|| panic!("no {type_} condition in {status}"))
}

fn assert_condition(status: &Value, type_: &str, expected: &str, reason: &str) {
    let condition = condition_of(status, type_);
    assert_eq!(
        (condition["status"].as_str(), condition["reason"].as_str()),
        (Some(expected), Some(reason)),
        "{type_}: {condition}"
    );
}

fn base(kind: &str) -> &'static str {
    match kind {
        "jobs" => "/apis/batch/v1/namespaces/shop/jobs",
        "configmaps" => "/api/v1/namespaces/shop/configmaps",
        "deployments" => "/apis/apps/v1/namespaces/shop/deployments",
        "services" => "/api/v1/namespaces/shop/services",
        "hpas" => "/apis/autoscaling/v2/namespaces/shop/horizontalpodautoscalers",
        "pods" => "/api/v1/namespaces/shop/pods",
        "functions" => "/apis/eddy.dev/v1alpha1/namespaces/shop/functions",
        "subscriptions" => "/apis/eddy.dev/v1alpha1/namespaces/shop/subscriptions",
        other => panic!("no base for {other}"),
    }
}

fn status_answer(object: Value) -> impl FnOnce(Value) -> (u16, Value) + Send + 'static {
    move |body| {
        let mut answer = object;
        answer["status"] = body["status"].clone();
        (200, answer)
    }
}

fn job_with_status(rendered: &Rendered, status: Value) -> Value {
    let mut job = to_json(&rendered.job);
    job["status"] = status;
    job
}

fn metadata_list(kind: &str, names: &[&str]) -> Value {
    json!({
        "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList",
        "metadata": {},
        "items": names.iter().map(|name| json!({
            "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": {"name": name, "namespace": "shop"},
        })).collect::<Vec<_>>(),
        "kind_of_items": kind,
    })
}

fn deployment_ready(generation: i64, replicas: i32) -> Value {
    json!({
        "metadata": {"generation": generation},
        "status": {
            "observedGeneration": generation, "replicas": replicas, "updatedReplicas": replicas,
            "readyReplicas": replicas, "availableReplicas": replicas,
            "conditions": [
                {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"},
            ],
        },
    })
}

async fn run_function(
    function: Function,
    exchanges: Vec<Exchange>,
) -> (Result<Action>, Vec<Value>) {
    let (client, server) = api_server(exchanges);
    let mut context = Context::new(client, config(), SinkPolicy::default());
    context.clock = test_now;
    let context = Arc::new(context);
    let result = reconcile_function(Arc::new(function), context.clone()).await;
    drop(context);
    let bodies = server.await.expect("the API server saw what it expected");
    (result, bodies)
}

/// A source's first build: no Job yet, so the ConfigMap and the Job are applied, then status.
fn first_build(function: &Function, rendered: &Rendered) -> Vec<Exchange> {
    let mut exchanges = build_started(rendered);
    exchanges.push(function_status_write(function));
    exchanges
}

/// A build started: no Job yet, so the ConfigMap and the Job are applied.
fn build_started(rendered: &Rendered) -> Vec<Exchange> {
    let job_name = rendered.job.metadata.name.clone().expect("a Job name");
    vec![
        expect(
            Method::GET,
            format!("{}/{job_name}", base("jobs")),
            not_found,
        ),
        apply_config_map(rendered),
        apply_job(&job_name, to_json(&rendered.job)),
    ]
}

/// The server-side apply of the status of `function` (answered with it and the new status).
fn function_status_write<T: serde::Serialize>(function: T) -> Exchange {
    expect(
        Method::PATCH,
        format!("{}/reserve-stock/status{APPLY}", base("functions")),
        status_answer(to_json(&function)),
    )
}

/// The server-side apply of a build's ConfigMap, answered with what was applied.
fn apply_config_map(rendered: &Rendered) -> Exchange {
    expect(
        Method::PATCH,
        format!(
            "{}/reserve-stock-{}{APPLY}",
            base("configmaps"),
            rendered.hash
        ),
        applied(to_json(&rendered.config_map), json!({})),
    )
}

/// The server-side apply of the build Job `job` (as JSON), answered with what was applied.
fn apply_job(job_name: &str, job: Value) -> Exchange {
    expect(
        Method::PATCH,
        format!("{}/{job_name}{APPLY}", base("jobs")),
        applied(job, json!({})),
    )
}

/// The time the reconciler sees in these tests.
fn test_now() -> k8s_openapi::jiff::Timestamp {
    "2026-11-24T12:00:00Z".parse().expect("a timestamp")
}

/// `test_now()` moved by `seconds`, as the API server writes times.
fn time_from_now(seconds: i64) -> String {
    let time = test_now()
        .checked_add(k8s_openapi::jiff::SignedDuration::from_secs(seconds))
        .expect("in range");
    time.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// Merges `extra` into a copy of the object the API server holds after an apply.
fn merged(mut object: Value, extra: Value) -> Value {
    if let (Some(object), Some(extra)) = (object.as_object_mut(), extra.as_object()) {
        for (key, value) in extra {
            match (object.get_mut(key), value) {
                (Some(Value::Object(inner)), Value::Object(more)) => {
                    for (k, v) in more {
                        inner.insert(k.clone(), v.clone());
                    }
                }
                _ => {
                    object.insert(key.clone(), value.clone());
                }
            }
        }
    }
    object
}

// ---------------------------------------------------------------------------------------------
// The Function lifecycle

#[tokio::test]
async fn first_reconcile_creates_the_config_map_and_the_build_job() {
    let function = function(json!({}));
    let rendered = render(&function, &config()).expect("renders");
    assert_eq!(
        rendered.job.metadata.name.as_deref(),
        Some(format!("reserve-stock-build-{}", rendered.hash).as_str())
    );
    let exchanges = first_build(&function, &rendered);
    let (result, bodies) = run_function(function, exchanges).await;
    assert_eq!(result.expect("reconciled"), Action::requeue(RESYNC));
    let status = &bodies[3]["status"];
    assert_eq!(bodies[3]["apiVersion"], "eddy.dev/v1alpha1");
    assert_eq!(bodies[3]["kind"], "Function");
    assert_condition(status, "ConfigurationReady", "True", "ConfigurationValid");
    assert_condition(status, "BuildReady", "Unknown", "BuildRunning");
    assert_condition(status, "Running", "Unknown", "Building");
    assert_eq!(status["url"], "http://reserve-stock.shop.svc.cluster.local");
    assert_eq!(status["observedGeneration"], 1);
    // The ConfigMap is the whole build context.
    let data = &bodies[1]["data"];
    assert!(
        data["Dockerfile"]
            .as_str()
            .is_some_and(|d| d.contains("ARG BASE_IMAGE=node:${NODE_MAJOR}-alpine"))
    );
    assert!(data["server.mjs"].is_string());
    assert!(data["runtime-package.json"].is_string());
    assert!(data["runtime-package-lock.json"].is_string());
    let job_args = &bodies[2]["spec"]["template"]["spec"]["containers"][0]["args"];
    assert!(
        job_args
            .as_array()
            .is_some_and(|args| args.contains(&json!("--build-arg=NODE_MAJOR=20"))),
        "{job_args}"
    );
    assert_eq!(data["handler.js"], "module.exports = { main: () => 'ok' }");
    assert!(
        data.get("package.json").is_none(),
        "no dependencies, no package.json"
    );
}

#[tokio::test]
async fn a_running_build_is_left_alone() {
    let function = function(json!({}));
    let rendered = render(&function, &config()).expect("renders");
    let job_name = format!("reserve-stock-build-{}", rendered.hash);
    let job = job_with_status(&rendered, json!({"active": 1}));
    let (result, bodies) = run_function(
        function.clone(),
        vec![
            expect(
                Method::GET,
                format!("{}/{job_name}", base("jobs")),
                move |_| (200, job),
            ),
            function_status_write(&function),
        ],
    )
    .await;
    assert_eq!(result.expect("reconciled"), Action::requeue(RESYNC));
    assert_condition(
        &bodies[1]["status"],
        "BuildReady",
        "Unknown",
        "BuildRunning",
    );
}

#[tokio::test]
async fn job_success_applies_the_deployment_service_and_autoscaler_and_cleans_up() {
    let function = function(json!({}));
    let rendered = render(&function, &config()).expect("renders");
    let job_name = format!("reserve-stock-build-{}", rendered.hash);
    let job = job_with_status(
        &rendered,
        json!({"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}),
    );
    let superseded = format!(
        "?&labelSelector=eddy.dev%2Ffunction%3Dreserve-stock%2Ceddy.dev%2Fbuild-hash%21%3D{}",
        rendered.hash
    );
    let deployment = to_json(&rendered.deployment);
    let (result, bodies) = run_function(
        function.clone(),
        vec![
            expect(
                Method::GET,
                format!("{}/{job_name}", base("jobs")),
                move |_| (200, job),
            ),
            expect(
                Method::PATCH,
                format!("{}/reserve-stock{APPLY}", base("deployments")),
                applied(
                    deployment.clone(),
                    merged(
                        deployment_ready(1, 1),
                        json!({"metadata": deployment["metadata"].clone()}),
                    ),
                ),
            ),
            expect(
                Method::PATCH,
                format!("{}/reserve-stock{APPLY}", base("services")),
                applied(to_json(&rendered.service), json!({})),
            ),
            expect(
                Method::PATCH,
                format!("{}/reserve-stock{APPLY}", base("hpas")),
                applied(
                    to_json(&rendered.autoscaler.clone().expect("autoscaled")),
                    json!({}),
                ),
            ),
            expect(Method::GET, format!("{}{superseded}", base("jobs")), |_| {
                (
                    200,
                    metadata_list("Job", &["reserve-stock-build-0123456789abcdef0123"]),
                )
            }),
            expect(
                Method::DELETE,
                format!("{}/reserve-stock-build-0123456789abcdef0123?", base("jobs")),
                |body| {
                    assert_eq!(
                        body["propagationPolicy"], "Background",
                        "the build pod goes with its Job"
                    );
                    (
                        200,
                        json!({"kind": "Status", "apiVersion": "v1", "status": "Success"}),
                    )
                },
            ),
            expect(
                Method::GET,
                format!("{}{superseded}", base("configmaps")),
                |_| {
                    (
                        200,
                        metadata_list("ConfigMap", &["reserve-stock-0123456789abcdef0123"]),
                    )
                },
            ),
            expect(
                Method::DELETE,
                format!("{}/reserve-stock-0123456789abcdef0123?", base("configmaps")),
                |_| {
                    (
                        200,
                        json!({"kind": "Status", "apiVersion": "v1", "status": "Success"}),
                    )
                },
            ),
            function_status_write(&function),
        ],
    )
    .await;
    assert_eq!(result.expect("reconciled"), Action::requeue(RESYNC));
    let status = &bodies[8]["status"];
    assert_condition(status, "BuildReady", "True", "BuildSucceeded");
    assert_condition(status, "Running", "True", "DeploymentReady");
    assert_eq!(status["replicas"], 1);
    // The HPA owns the replica count of an autoscaled Function.
    assert!(bodies[1]["spec"].get("replicas").is_none());
    assert_eq!(bodies[3]["spec"]["minReplicas"], 1);
    assert_eq!(bodies[3]["spec"]["maxReplicas"], 3);
    assert_eq!(
        bodies[1]["spec"]["template"]["spec"]["containers"][0]["image"],
        json!(rendered.image)
    );
}

/// A failed build Job (attempt `attempt`, failed `failed_ago` seconds before `test_now()`).
fn failed_job(rendered: &Rendered, attempt: u32, failed_ago: i64) -> Value {
    let mut job = to_json(&with_build_attempt(rendered.job.clone(), attempt));
    job["metadata"]["uid"] = json!(format!("job-uid-{attempt}"));
    job["status"] = json!({
        "failed": 1, "startTime": time_from_now(-failed_ago - 40),
        "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
            "message": "Job has reached the specified backoff limit",
            "lastTransitionTime": time_from_now(-failed_ago)}],
    });
    job
}

#[tokio::test]
async fn job_failure_puts_the_build_log_into_build_ready_and_waits_to_retry() {
    let function = function(
        json!({"source": {"inline": {"source": "x", "dependencies": "{\"dependencies\": {\"left-pad-nope\": \"1\"}}"}}}),
    );
    let rendered = render(&function, &config()).expect("renders");
    let job_name = format!("reserve-stock-build-{}", rendered.hash);
    // Failed 10 s ago, the first attempt: tried again 60 s after it failed.
    let job = failed_job(&rendered, 1, 10);
    let pods = json!({
        "apiVersion": "v1", "kind": "PodList", "metadata": {},
        "items": [{
            "metadata": {"name": format!("{job_name}-x7k2p"), "namespace": "shop"},
            "status": {"containerStatuses": [{
                "name": "build", "image": "kaniko", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"terminated": {"exitCode": 1, "message": "npm ERR! 404 Not Found - GET https://registry.npmjs.org/left-pad-nope\nerror building image: exit status 1\n"}},
            }]},
        }],
    });
    let mut exchanges = no_package_registry();
    exchanges.extend([
        expect(
            Method::GET,
            format!("{}/{job_name}", base("jobs")),
            move |_| (200, job),
        ),
        // Only this attempt's pods: an earlier attempt's may still be there.
        expect(
            Method::GET,
            format!(
                "{}?&labelSelector=batch.kubernetes.io%2Fcontroller-uid%3Djob-uid-1",
                base("pods")
            ),
            move |_| (200, pods),
        ),
        function_status_write(&function),
    ]);
    let (result, bodies) = run_function(function.clone(), exchanges).await;
    assert_eq!(
        result.expect("reconciled"),
        Action::requeue(Duration::from_secs(50)),
        "looked at again when the retry is due"
    );
    let status = &bodies[5]["status"];
    assert_condition(status, "BuildReady", "False", "BuildFailed");
    let message = condition_of(status, "BuildReady")["message"]
        .as_str()
        .unwrap_or_default();
    assert!(message.contains("BackoffLimitExceeded"), "{message}");
    assert!(message.contains("npm ERR! 404 Not Found"), "{message}");
    assert!(
        message.contains("failed build 1 of this source; trying again at 2026-11-24T12:00:50Z"),
        "{message}"
    );
    assert_eq!(status["buildFailures"], 1);
    assert_eq!(status["podSelector"], "eddy.dev/function=reserve-stock");
    assert_condition(status, "Running", "False", "BuildFailed");
}

#[tokio::test]
async fn a_failed_build_is_tried_again_once_its_delay_has_passed() {
    let function = function(json!({}));
    let rendered = render(&function, &config()).expect("renders");
    let job_name = format!("reserve-stock-build-{}", rendered.hash);
    // The second attempt failed 121 s ago: its delay is 2 minutes, so the third starts now.
    let job = failed_job(&rendered, 2, 121);
    let mut third = to_json(&rendered.job);
    third["metadata"]["annotations"] = json!({"eddy.dev/build-attempt": "3"});
    let (result, bodies) = run_function(
        function.clone(),
        vec![
            expect(
                Method::GET,
                format!("{}/{job_name}", base("jobs")),
                move |_| (200, job),
            ),
            expect(
                Method::DELETE,
                format!("{}/{job_name}?", base("jobs")),
                |body| {
                    assert_eq!(
                        body["propagationPolicy"], "Background",
                        "the failed attempt's pods go with it"
                    );
                    (
                        200,
                        json!({"kind": "Status", "apiVersion": "v1", "status": "Success"}),
                    )
                },
            ),
            apply_config_map(&rendered),
            apply_job(&job_name, third),
            function_status_write(&function),
        ],
    )
    .await;
    assert_eq!(result.expect("reconciled"), Action::requeue(RESYNC));
    let status = &bodies[4]["status"];
    assert_condition(status, "BuildReady", "Unknown", "BuildRunning");
    assert_eq!(status["buildFailures"], 2);
    let message = condition_of(status, "BuildReady")["message"]
        .as_str()
        .unwrap_or_default();
    assert!(
        message.contains("again after 2 failed build(s)"),
        "{message}"
    );
}

#[tokio::test]
async fn a_retried_build_keeps_its_failure_count_and_a_new_source_builds_at_once() {
    let function = function(json!({}));
    let rendered = render(&function, &config()).expect("renders");
    let job_name = format!("reserve-stock-build-{}", rendered.hash);
    let mut running = to_json(&with_build_attempt(rendered.job.clone(), 3));
    running["status"] = json!({"active": 1});
    let (_, bodies) = run_function(
        function.clone(),
        vec![
            expect(
                Method::GET,
                format!("{}/{job_name}", base("jobs")),
                move |_| (200, running),
            ),
            function_status_write(&function),
        ],
    )
    .await;
    let status = bodies[1]["status"].clone();
    assert_eq!(
        status["buildFailures"], 2,
        "attempt 3 runs after 2 failures"
    );
    assert_condition(&status, "BuildReady", "Unknown", "BuildRunning");

    // The user fixes the source while the old one waits for its retry: the new source has no
    // Job yet, so it is built at once, as a first attempt, and the count starts again.
    let fixed = with_status(
        function_with_source("module.exports = { main: () => 'fixed' }"),
        &status,
    );
    let rendered = render(&fixed, &config()).expect("renders");
    let (result, bodies) = run_function(fixed.clone(), first_build(&fixed, &rendered)).await;
    assert_eq!(result.expect("reconciled"), Action::requeue(RESYNC));
    let status = &bodies[3]["status"];
    assert_eq!(status.get("buildFailures"), None, "{status}");
    assert_condition(status, "BuildReady", "Unknown", "BuildRunning");
}

fn function_with_source(source: &str) -> Function {
    function(json!({"source": {"inline": {"source": source}}}))
}

/// A user's security context is merged over the hardened defaults: what they set wins, and
/// what they leave out stays hardened.
#[test]
fn security_contexts_are_merged_over_the_hardened_defaults() {
    let function = function(json!({
        "podSecurityContext": {"runAsUser": 2000, "fsGroup": 3000},
        "containerSecurityContext": {"runAsUser": 2000, "readOnlyRootFilesystem": false},
    }));
    let rendered = render(&function, &config()).expect("renders");
    let pod = to_json(&rendered.deployment)["spec"]["template"]["spec"].clone();
    assert_eq!(
        pod["securityContext"],
        json!({"runAsNonRoot": true, "runAsUser": 2000, "runAsGroup": 1000, "fsGroup": 3000,
               "seccompProfile": {"type": "RuntimeDefault"}})
    );
    assert_eq!(
        pod["containers"][0]["securityContext"],
        json!({"runAsNonRoot": true, "runAsUser": 2000, "allowPrivilegeEscalation": false,
               "privileged": false, "readOnlyRootFilesystem": false,
               "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}),
        "the user asked for a writable root filesystem; the rest stays hardened"
    );
}

#[test]
fn the_autoscaler_aims_at_the_configured_cpu_target() {
    let function = function(json!({"scaleConfig": {"minReplicas": 1, "maxReplicas": 4}}));
    let mut settings = config();
    settings.target_cpu_utilization = 70;
    let rendered = render(&function, &settings).expect("renders");
    let autoscaler = to_json(&rendered.autoscaler.expect("an HPA"));
    assert_eq!(
        autoscaler["spec"]["metrics"][0]["resource"]["target"],
        json!({"type": "Utilization", "averageUtilization": 70})
    );
}

#[test]
fn build_retries_wait_one_minute_doubling_to_thirty() {
    let function = function(json!({}));
    let rendered = render(&function, &config()).expect("renders");
    let now = test_now();
    let retry_in = |attempt: u32| {
        let job: Job = serde_json::from_value(failed_job(&rendered, attempt, 0)).expect("a Job");
        build_retry_at(&job, now).duration_since(now).as_secs()
    };
    let delays: Vec<i64> = (1..=7).map(retry_in).collect();
    assert_eq!(delays, [60, 120, 240, 480, 960, 1800, 1800]);
    // No failure time recorded: counted from now, never in the past.
    let mut bare = rendered.job.clone();
    bare.status = None;
    assert_eq!(build_retry_at(&bare, now).duration_since(now).as_secs(), 60);
    assert_eq!(build_attempt(&bare), 1);
    assert_eq!(
        build_attempt(&with_build_attempt(bare.clone(), 4)),
        4,
        "the attempt is read back from the Job"
    );
}

#[test]
fn build_jobs_get_the_build_profile_s_resources() {
    let resources_of = |build: Value| {
        let function = function(json!({"resourceConfiguration": {"build": build}}));
        let rendered = render(&function, &config()).expect("renders");
        let job = to_json(&rendered.job);
        job["spec"]["template"]["spec"]["containers"][0]["resources"].clone()
    };
    assert_eq!(
        resources_of(json!({"profile": "normal"})),
        json!({"requests": {"cpu": "700m", "memory": "700Mi"}, "limits": {"cpu": "1100m", "memory": "1100Mi"}})
    );
    assert_eq!(
        resources_of(json!({"profile": "local-dev"})),
        json!({"requests": {"cpu": "200m", "memory": "200Mi"}, "limits": {"cpu": "400m", "memory": "400Mi"}})
    );
    assert_eq!(
        resources_of(json!({"resources": {"limits": {"memory": "3Gi"}}})),
        json!({"limits": {"memory": "3Gi"}}),
        "explicit resources as given"
    );
    assert_eq!(
        resources_of(json!({})),
        json!({"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}),
        "eddy's default without a profile"
    );
}

#[tokio::test]
async fn a_source_change_starts_a_new_build_with_a_new_tag_and_keeps_the_old_one_running() {
    let old = function(json!({}));
    let old_rendered = render(&old, &config()).expect("renders");
    let running = json!({
        "conditions": [
            {"type": "ConfigurationReady", "status": "True", "reason": "ConfigurationValid", "message": "", "lastTransitionTime": "2026-11-22T10:00:00Z"},
            {"type": "BuildReady", "status": "True", "reason": "BuildSucceeded", "message": "", "lastTransitionTime": "2026-11-22T10:00:00Z"},
            {"type": "Running", "status": "True", "reason": "DeploymentReady", "message": "1 of 1 replicas available", "lastTransitionTime": "2026-11-22T10:00:00Z"},
        ],
        "replicas": 1, "url": "http://reserve-stock.shop.svc.cluster.local", "observedGeneration": 1,
    });
    let mut changed = with_status(
        function(
            json!({"source": {"inline": {"source": "module.exports = { main: () => 'v2' }"}}}),
        ),
        &running,
    );
    changed.metadata.generation = Some(2);
    let rendered = render(&changed, &config()).expect("renders");
    assert_ne!(rendered.hash, old_rendered.hash);
    assert_ne!(rendered.image, old_rendered.image);
    assert!(rendered.image.ends_with(&format!(":{}", rendered.hash)));
    let (result, bodies) = run_function(changed.clone(), first_build(&changed, &rendered)).await;
    assert_eq!(result.expect("reconciled"), Action::requeue(RESYNC));
    let args = bodies[2]["spec"]["template"]["spec"]["containers"][0]["args"].clone();
    assert!(
        args.as_array()
            .is_some_and(|a| a.contains(&json!(format!("--destination={}", rendered.image)))),
        "{args}"
    );
    let status = &bodies[3]["status"];
    assert_condition(status, "BuildReady", "Unknown", "BuildRunning");
    // The old image keeps serving until the new one is built.
    assert_condition(status, "Running", "True", "DeploymentReady");
    assert_eq!(status["observedGeneration"], 2);
}

#[tokio::test]
async fn a_scale_change_builds_nothing_and_drops_the_autoscaler() {
    let function = function(json!({"scaleConfig": null, "replicas": 2}));
    let rendered = render(&function, &config()).expect("renders");
    assert!(rendered.autoscaler.is_none());
    let job_name = format!("reserve-stock-build-{}", rendered.hash);
    let job = job_with_status(&rendered, json!({"succeeded": 1}));
    let superseded = format!(
        "?&labelSelector=eddy.dev%2Ffunction%3Dreserve-stock%2Ceddy.dev%2Fbuild-hash%21%3D{}",
        rendered.hash
    );
    let deployment = to_json(&rendered.deployment);
    let (result, bodies) = run_function(
        function.clone(),
        vec![
            expect(
                Method::GET,
                format!("{}/{job_name}", base("jobs")),
                move |_| (200, job),
            ),
            expect(
                Method::PATCH,
                format!("{}/reserve-stock{APPLY}", base("deployments")),
                applied(
                    deployment.clone(),
                    merged(
                        deployment_ready(2, 2),
                        json!({"metadata": deployment["metadata"].clone()}),
                    ),
                ),
            ),
            expect(
                Method::PATCH,
                format!("{}/reserve-stock{APPLY}", base("services")),
                applied(to_json(&rendered.service), json!({})),
            ),
            expect(
                Method::DELETE,
                format!("{}/reserve-stock?", base("hpas")),
                not_found,
            ),
            expect(Method::GET, format!("{}{superseded}", base("jobs")), |_| {
                (200, metadata_list("Job", &[]))
            }),
            expect(
                Method::GET,
                format!("{}{superseded}", base("configmaps")),
                |_| (200, metadata_list("ConfigMap", &[])),
            ),
            function_status_write(&function),
        ],
    )
    .await;
    assert_eq!(result.expect("reconciled"), Action::requeue(RESYNC));
    assert_eq!(bodies[1]["spec"]["replicas"], 2);
    assert_eq!(bodies[6]["status"]["replicas"], 2);
}

#[tokio::test]
async fn an_unchanged_status_is_not_written_again() {
    let function = function(json!({}));
    let rendered = render(&function, &config()).expect("renders");
    let job_name = format!("reserve-stock-build-{}", rendered.hash);
    let first_job = job_with_status(&rendered, json!({"active": 1}));
    let (_, bodies) = run_function(
        function.clone(),
        vec![
            expect(
                Method::GET,
                format!("{}/{job_name}", base("jobs")),
                move |_| (200, first_job),
            ),
            function_status_write(&function),
        ],
    )
    .await;
    let settled = with_status(function, &bodies[1]["status"]);
    let job = job_with_status(&rendered, json!({"active": 1}));
    let (result, _) = run_function(
        settled,
        vec![expect(
            Method::GET,
            format!("{}/{job_name}", base("jobs")),
            move |_| (200, job),
        )],
    )
    .await;
    assert_eq!(result.expect("reconciled"), Action::requeue(RESYNC));
}

#[tokio::test]
async fn a_refused_apply_goes_to_status_and_a_transient_error_is_retried() {
    let function = function(json!({}));
    let rendered = render(&function, &config()).expect("renders");
    let job_name = format!("reserve-stock-build-{}", rendered.hash);
    let forbidden = |_| {
        (
            403,
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
                   "message": "configmaps is forbidden: exceeded quota"}),
        )
    };
    let (result, bodies) = run_function(
        function.clone(),
        vec![
            expect(
                Method::GET,
                format!("{}/{job_name}", base("jobs")),
                not_found,
            ),
            expect(
                Method::PATCH,
                format!(
                    "{}/reserve-stock-{}{APPLY}",
                    base("configmaps"),
                    rendered.hash
                ),
                forbidden,
            ),
            function_status_write(&function),
        ],
    )
    .await;
    assert_eq!(result.expect("reported"), Action::requeue(RESYNC));
    let running = condition_of(&bodies[2]["status"], "Running");
    assert_eq!(running["reason"], "ApplyFailed");
    assert!(
        running["message"]
            .as_str()
            .is_some_and(|m| m.contains("exceeded quota")),
        "{running}"
    );

    let (result, _) = run_function(
        function,
        vec![expect(Method::GET, format!("{}/{job_name}", base("jobs")), |_| {
            (503, json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "ServiceUnavailable", "code": 503, "message": "etcd leader changed"}))
        })],
    )
    .await;
    let error = result.expect_err("a transient error is returned for a retry");
    assert!(!is_permanent(&error));
}

/// What lets Kubernetes' garbage collector delete what a Function owns: every rendered object
/// carries a controller owner reference to it, and none a finalizer that could hold the delete
/// up. (The collection itself is shown against a real API server and kube-controller-manager:
/// `tests/kubernetes_cluster.rs`, `a_deleted_function_leaves_nothing_behind`.)
#[test]
fn every_rendered_object_is_owned_by_its_function_without_finalizers() {
    let function = function(json!({}));
    let rendered = render(&function, &config()).expect("renders");
    let mut metas = vec![
        rendered.config_map.metadata.clone(),
        rendered.job.metadata.clone(),
        rendered.deployment.metadata.clone(),
        rendered.service.metadata.clone(),
    ];
    metas.extend(rendered.autoscaler.iter().map(|a| a.metadata.clone()));
    assert_eq!(metas.len(), 5);
    for meta in metas {
        let owners = meta.owner_references.unwrap_or_default();
        assert_eq!(owners.len(), 1, "{:?}", meta.name);
        let owner = &owners[0];
        assert_eq!(
            (
                owner.api_version.as_str(),
                owner.kind.as_str(),
                owner.name.as_str(),
                owner.uid.as_str()
            ),
            (
                "eddy.dev/v1alpha1",
                "Function",
                "reserve-stock",
                "8d3f6f7e-1"
            )
        );
        assert_eq!(owner.controller, Some(true));
        assert_eq!(owner.block_owner_deletion, Some(true));
        assert!(meta.finalizers.is_none());
        assert_eq!(meta.namespace.as_deref(), Some("shop"));
    }
}

// ---------------------------------------------------------------------------------------------
// Subscriptions

fn subscription(sink: &str) -> Subscription {
    serde_json::from_value(json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
        "metadata": {"name": "on-order", "namespace": "shop", "uid": "5", "generation": 3},
        "spec": {"sink": sink, "source": "shop", "types": ["order.created.v1"]},
    }))
    .expect("a Subscription")
}

async fn run_subscription(
    subscription: Subscription,
    exchanges: Vec<Exchange>,
) -> (Result<Action>, Vec<Value>) {
    let (client, server) = api_server(exchanges);
    let context = Arc::new(Context::new(client, config(), SinkPolicy::default()));
    let result = reconcile_subscription(Arc::new(subscription), context.clone()).await;
    drop(context);
    (
        result,
        server.await.expect("the API server saw what it expected"),
    )
}

#[tokio::test]
async fn a_subscription_to_an_existing_service_is_ready_with_its_subjects() {
    let subscription = subscription("http://reserve-stock.shop.svc.cluster.local");
    let object = to_json(&subscription);
    let (result, bodies) = run_subscription(
        subscription,
        vec![
            expect(Method::GET, format!("{}/reserve-stock", base("services")), |_| {
                (200, json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "reserve-stock", "namespace": "shop"}}))
            }),
            expect(Method::PATCH, format!("{}/on-order/status{APPLY}", base("subscriptions")), status_answer(object)),
        ],
    )
    .await;
    assert_eq!(result.expect("reconciled"), Action::requeue(RESYNC));
    let status = &bodies[1]["status"];
    assert_eq!(status["ready"], true);
    assert_eq!(
        status["types"],
        json!([{"type": "order.created.v1", "subject": "eddy.events.shop.order.created.v1",
                "originalType": "order.created.v1", "cleanType": "order.created.v1"}])
    );
    assert_eq!(status["backend"]["consumerName"], "sub_shop_on-order");
    assert_eq!(status["observedGeneration"], 3);
}

#[tokio::test]
async fn a_subscription_to_a_missing_service_is_not_ready_and_looked_at_again() {
    let subscription = subscription("http://reserve-stock.shop.svc.cluster.local");
    let object = to_json(&subscription);
    let (result, bodies) = run_subscription(
        subscription,
        vec![
            expect(
                Method::GET,
                format!("{}/reserve-stock", base("services")),
                not_found,
            ),
            expect(
                Method::PATCH,
                format!("{}/on-order/status{APPLY}", base("subscriptions")),
                status_answer(object),
            ),
        ],
    )
    .await;
    assert_eq!(
        result.expect("reconciled"),
        Action::requeue(Duration::from_secs(15))
    );
    let status = &bodies[1]["status"];
    assert_eq!(status["ready"], false);
    assert_condition(status, "Ready", "False", "SinkNotFound");
}

#[tokio::test]
async fn a_sink_outside_the_namespace_or_the_policy_is_refused_in_status() {
    for sink in [
        "http://reserve-stock.other.svc.cluster.local",
        "http://169.254.169.254/latest/meta-data",
    ] {
        let subscription = subscription(sink);
        let object = to_json(&subscription);
        let (result, bodies) = run_subscription(
            subscription,
            vec![expect(
                Method::PATCH,
                format!("{}/on-order/status{APPLY}", base("subscriptions")),
                status_answer(object),
            )],
        )
        .await;
        assert_eq!(result.expect("reconciled"), Action::await_change());
        assert_condition(&bodies[0]["status"], "Ready", "False", "Invalid");
        let message = condition_of(&bodies[0]["status"], "Ready")["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(message.contains("spec.sink"), "{message}");
    }
}

// ---------------------------------------------------------------------------------------------
// Rendered objects

#[test]
fn function_pods_are_hardened() {
    let rendered = render(&function(json!({})), &config()).expect("renders");
    let pod = rendered
        .deployment
        .spec
        .template
        .spec
        .clone()
        .expect("a pod spec");
    let pod_security = pod.security_context.clone().expect("pod security context");
    assert_eq!(pod_security.run_as_non_root, Some(true));
    assert_eq!(pod_security.run_as_user, Some(1000));
    assert_eq!(
        pod_security.seccomp_profile.map(|s| s.type_),
        Some("RuntimeDefault".to_owned())
    );
    assert_eq!(pod.automount_service_account_token, Some(false));
    let container = &pod.containers[0];
    let security = container
        .security_context
        .clone()
        .expect("container security context");
    assert_eq!(security.read_only_root_filesystem, Some(true));
    assert_eq!(security.allow_privilege_escalation, Some(false));
    assert_eq!(security.privileged, Some(false));
    assert_eq!(
        security.capabilities.and_then(|c| c.drop),
        Some(vec!["ALL".to_owned()])
    );
    assert_eq!(
        security.seccomp_profile.map(|s| s.type_),
        Some("RuntimeDefault".to_owned())
    );
    // A writable /tmp on the read-only root.
    let mounts = container.volume_mounts.clone().unwrap_or_default();
    let tmp = mounts
        .iter()
        .find(|m| m.mount_path == "/tmp")
        .expect("/tmp is mounted");
    let volumes = pod.volumes.clone().unwrap_or_default();
    let volume = volumes
        .iter()
        .find(|v| v.name == tmp.name)
        .expect("the /tmp volume");
    assert!(volume.empty_dir.is_some());
    assert_eq!(tmp.read_only, None);
}

#[test]
fn function_objects_are_labelled_for_the_mesh_and_for_cleanup() {
    let rendered = render(&function(json!({})), &config()).expect("renders");
    let template = rendered.deployment.spec.template.clone();
    let pod_labels = template.metadata.and_then(|m| m.labels).unwrap_or_default();
    assert_eq!(
        pod_labels
            .get("sidecar.istio.io/inject")
            .map(String::as_str),
        Some("true")
    );
    assert_eq!(
        pod_labels.get("eddy.dev/function").map(String::as_str),
        Some("reserve-stock")
    );
    assert_eq!(pod_labels.get("eddy.dev/build-hash"), Some(&rendered.hash));
    let selector = rendered
        .deployment
        .spec
        .selector
        .match_labels
        .clone()
        .unwrap_or_default();
    assert_eq!(
        selector.len(),
        1,
        "the selector survives rebuilds: {selector:?}"
    );
    // Kyma's label contract: the pods carry its four labels, and the Service selects them by
    // exactly those.
    let uid = function(json!({})).metadata.uid.expect("a uid");
    let kyma: std::collections::BTreeMap<String, String> = [
        ("serverless.kyma-project.io/function-name", "reserve-stock"),
        (
            "serverless.kyma-project.io/managed-by",
            "function-controller",
        ),
        ("serverless.kyma-project.io/uuid", uid.as_str()),
        ("serverless.kyma-project.io/resource", "deployment"),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value.to_owned()))
    .collect();
    for (name, value) in &kyma {
        assert_eq!(pod_labels.get(name), Some(value), "{name}");
    }
    let service_selector = rendered
        .service
        .spec
        .as_ref()
        .and_then(|spec| spec.selector.clone())
        .unwrap_or_default();
    assert_eq!(service_selector, kyma);
    let build_pod = rendered
        .job
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.clone())
        .expect("build pod metadata");
    assert_eq!(
        build_pod
            .annotations
            .unwrap_or_default()
            .get("sidecar.istio.io/inject")
            .map(String::as_str),
        Some("false"),
        "a sidecar would keep the build pod running"
    );
    for labels in [
        rendered.job.metadata.labels.clone(),
        rendered.config_map.metadata.labels.clone(),
    ] {
        let labels = labels.unwrap_or_default();
        assert_eq!(labels.get("eddy.dev/build-hash"), Some(&rendered.hash));
        assert_eq!(
            labels
                .get("app.kubernetes.io/managed-by")
                .map(String::as_str),
            Some("eddy")
        );
    }
    let service = rendered.service.spec.clone().expect("a service spec");
    let port = &service.ports.unwrap_or_default()[0];
    assert_eq!(
        (port.port, port.target_port.clone()),
        (
            80,
            Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(8080))
        )
    );
    assert_eq!(port.name.as_deref(), Some("http"));
}

#[test]
fn resources_come_from_the_profile_or_are_given_explicitly() {
    let resources_of = |spec: Value| {
        let rendered = render(&function(spec), &config()).expect("renders");
        let pod = rendered.deployment.spec.template.spec.expect("a pod spec");
        let resources = pod.containers[0].resources.clone().expect("resources");
        let get = |map: Option<
            std::collections::BTreeMap<
                String,
                k8s_openapi::apimachinery::pkg::api::resource::Quantity,
            >,
        >,
                   key: &str| {
            map.and_then(|m| m.get(key).map(|q| q.0.clone()))
                .unwrap_or_default()
        };
        (
            get(resources.requests.clone(), "cpu"),
            get(resources.requests, "memory"),
            get(resources.limits.clone(), "cpu"),
            get(resources.limits, "memory"),
        )
    };
    assert_eq!(
        resources_of(json!({})),
        (
            "400m".into(),
            "512Mi".into(),
            "800m".into(),
            "1024Mi".into()
        ),
        "default profile L, as Kyma's"
    );
    assert_eq!(
        resources_of(json!({"resourceConfiguration": {"function": {"profile": "L"}}})),
        (
            "400m".into(),
            "512Mi".into(),
            "800m".into(),
            "1024Mi".into()
        )
    );
    assert_eq!(
        resources_of(
            json!({"resourceConfiguration": {"function": {"resources": {"requests": {"cpu": "150m", "memory": "100Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}}}})
        ),
        ("150m".into(), "100Mi".into(), "1".into(), "1Gi".into())
    );
}

#[test]
fn function_env_is_the_platform_s_then_the_user_s() {
    let rendered = render(&function(json!({"timeoutSeconds": 42})), &config()).expect("renders");
    let pod = rendered.deployment.spec.template.spec.expect("a pod spec");
    let env: Vec<(String, String)> = pod.containers[0]
        .env
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|e| (e.name, e.value.unwrap_or_default()))
        .collect();
    let expected: Vec<(String, String)> = [
        ("FUNC_NAME", "reserve-stock"),
        ("FUNC_NAMESPACE", "shop"),
        ("SERVICE_NAMESPACE", "shop"),
        ("FUNC_RUNTIME", "nodejs20"),
        ("FUNC_HANDLER", "main"),
        ("MOD_NAME", "handler"),
        ("FUNC_PORT", "8080"),
        ("FUNC_TIMEOUT", "42"),
        (
            "PUBLISHER_PROXY_ADDRESS",
            "http://eddy-event-bus.eddy-system.svc.cluster.local/publish",
        ),
        ("LOG_LEVEL", "debug"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    assert_eq!(env, expected);
    assert!(
        pod.containers[0].env_from.is_none(),
        "nothing but its own env"
    );
}

/// Kyma's pod-level fields reach the Deployment as written: env from Secrets and ConfigMaps
/// (passed to Kubernetes, never resolved by eddy), each Secret mounted read-only at its path,
/// the user's labels and annotations on the pods (eddy's own labels kept), and the runtime image
/// override in place of the built image.
#[test]
fn kyma_fields_reach_the_deployment_as_written() {
    let rendered = render(
        &function(json!({
            "env": [
                {"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}},
                {"name": "REGION", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "region"}}},
                {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
            ],
            "secretMounts": [{"secretName": "tls", "mountPath": "/etc/tls"}],
            "template": {"labels": {"tier": "gold"}},
            "labels": {"team": "checkout"},
            "annotations": {"owner": "checkout@example.com"},
            "runtimeImageOverride": "registry.example.com/custom-node:1",
        })),
        &config(),
    )
    .expect("renders");
    let deployment = serde_json::to_value(&rendered.deployment).expect("json");
    let template = &deployment["spec"]["template"];
    let container = &template["spec"]["containers"][0];
    let env = container["env"].as_array().expect("env");
    let named = |name: &str| env.iter().find(|e| e["name"] == name).cloned();
    assert_eq!(
        named("API_KEY").expect("API_KEY"),
        json!({"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}})
    );
    assert_eq!(
        named("REGION").expect("REGION"),
        json!({"name": "REGION", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "region"}}})
    );
    assert_eq!(
        named("POD").expect("POD"),
        json!({"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    );
    assert_eq!(
        named("MEM").expect("MEM"),
        json!({"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}})
    );
    assert_eq!(
        template["metadata"]["labels"]["tier"], "gold",
        "the deprecated template's labels are on the pods"
    );
    let mount = container["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .find(|m| m["mountPath"] == "/etc/tls")
        .cloned()
        .expect("the Secret's mount");
    assert_eq!(mount["readOnly"], true);
    let volume = template["spec"]["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == mount["name"])
        .cloned()
        .expect("the Secret's volume");
    assert_eq!(volume["secret"]["secretName"], "tls");
    assert_eq!(template["metadata"]["labels"]["team"], "checkout");
    assert_eq!(
        template["metadata"]["labels"]["app.kubernetes.io/managed-by"], "eddy",
        "eddy's labels kept"
    );
    assert_eq!(
        template["metadata"]["annotations"]["owner"],
        "checkout@example.com"
    );
    assert_eq!(container["image"], "registry.example.com/custom-node:1");
}

/// Function pods carry Kyma's Istio annotations: the application held until the proxy is up
/// (the user's own proxy config wins), and with init containers (the buildless install) the
/// native sidecar, so the proxy runs before them and their downloads are not lost.
#[test]
fn function_pods_start_their_istio_proxy_before_their_init_containers() {
    let annotations = |spec: serde_json::Value, build: BuildMode| {
        let rendered =
            render(&function(spec), &RenderConfig { build, ..config() }).expect("renders");
        let deployment = serde_json::to_value(&rendered.deployment).expect("json");
        deployment["spec"]["template"]["metadata"]["annotations"].clone()
    };
    let buildless = annotations(json!({}), BuildMode::Buildless);
    assert_eq!(buildless["sidecar.istio.io/nativeSidecar"], "true");
    assert_eq!(
        buildless["proxy.istio.io/config"],
        r#"{ "holdApplicationUntilProxyStarts": true }"#
    );
    let built = annotations(json!({}), BuildMode::Image);
    assert!(
        built.get("sidecar.istio.io/nativeSidecar").is_none(),
        "an image-built pod has no init container: {built}"
    );
    let own = annotations(
        json!({"annotations": {"proxy.istio.io/config": "{}", "sidecar.istio.io/nativeSidecar": "false"}}),
        BuildMode::Buildless,
    );
    assert_eq!(
        own["proxy.istio.io/config"], "{}",
        "the user's proxy config wins"
    );
    assert_eq!(
        own["sidecar.istio.io/nativeSidecar"], "true",
        "the init containers need the proxy first"
    );
}

/// PUBLISHER_PROXY_ADDRESS: eddy's event-bus by default; Kyma's current publisher address for
/// a Kyma Function where eddy serves it (what Kyma's Function controller sets); the
/// Function's own, once, where it sets one.
#[test]
fn the_publisher_address_is_eddys_kymas_or_the_functions_own() {
    let address_of = |function: &Function, config: &RenderConfig| -> Vec<String> {
        let rendered = render(function, config).expect("renders");
        let pod = rendered.deployment.spec.template.spec.expect("a pod");
        pod.containers[0]
            .env
            .clone()
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.name == "PUBLISHER_PROXY_ADDRESS")
            .map(|e| e.value.unwrap_or_default())
            .collect()
    };
    let kyma_address = "http://eventing-publisher-proxy.kyma-system.svc.cluster.local/publish";
    let serving_kyma = RenderConfig {
        kyma_publisher_url: Some(kyma_address.to_owned()),
        ..config()
    };
    let eddys = function(json!({}));
    assert_eq!(
        address_of(&eddys, &serving_kyma),
        vec!["http://eddy-event-bus.eddy-system.svc.cluster.local/publish"]
    );
    let mut kymas = function(json!({}));
    kymas.metadata.annotations = Some(
        [(
            eddy_model::resources::APPLIED_AS_ANNOTATION.to_owned(),
            eddy_model::resources::KYMA_FUNCTION_API_VERSION.to_owned(),
        )]
        .into(),
    );
    assert_eq!(address_of(&kymas, &serving_kyma), vec![kyma_address]);
    assert_eq!(
        address_of(&kymas, &config()),
        vec!["http://eddy-event-bus.eddy-system.svc.cluster.local/publish"],
        "without the alias served, eddy's own"
    );
    let own = function(
        json!({"env": [{"name": "PUBLISHER_PROXY_ADDRESS", "value": "http://mock.test/publish"}]}),
    );
    assert_eq!(
        address_of(&own, &serving_kyma),
        vec!["http://mock.test/publish"]
    );
}

#[test]
fn functions_get_the_trace_collector_while_traces_are_on() {
    let env_of = |config: &RenderConfig| -> Vec<(String, String)> {
        let rendered = render(&function(json!({})), config).expect("renders");
        let pod = rendered.deployment.spec.template.spec.expect("a pod spec");
        pod.containers[0]
            .env
            .clone()
            .unwrap_or_default()
            .into_iter()
            .map(|e| (e.name, e.value.unwrap_or_default()))
            .collect()
    };
    let traced = RenderConfig {
        trace_collector: Some("http://otel-collector.observability:4318/v1/traces".to_owned()),
        ..config()
    };
    let env = env_of(&traced);
    let at = |name: &str| env.iter().position(|(key, _)| key == name);
    assert_eq!(
        env[at("TRACE_COLLECTOR_ENDPOINT").expect("set")].1,
        "http://otel-collector.observability:4318/v1/traces"
    );
    // Before the user's env, so a Function may point its spans elsewhere.
    assert!(at("TRACE_COLLECTOR_ENDPOINT") < at("LOG_LEVEL"));
    assert!(
        env_of(&config())
            .iter()
            .all(|(key, _)| key != "TRACE_COLLECTOR_ENDPOINT"),
        "not set while traces are off"
    );
}

#[test]
fn scaling_maps_onto_replicas_or_an_autoscaler() {
    let scaled = |spec: Value| render::scaling(&function(spec));
    assert_eq!(scaled(json!({})), Scaling::Autoscaled { min: 1, max: 3 });
    assert_eq!(
        scaled(json!({"scaleConfig": {"minReplicas": 0, "maxReplicas": 4}})),
        Scaling::Autoscaled { min: 1, max: 4 }
    );
    assert_eq!(
        scaled(json!({"scaleConfig": {"minReplicas": 2, "maxReplicas": 2}})),
        Scaling::Fixed(2)
    );
    assert_eq!(
        scaled(json!({"scaleConfig": null, "replicas": 0})),
        Scaling::Fixed(0)
    );
    assert_eq!(scaled(json!({"scaleConfig": null})), Scaling::Fixed(1));
}

#[test]
fn builds_use_the_configured_builder_registry_and_secret() {
    let mut config = config();
    config.registry_secret = Some("registry-push".to_owned());
    config.insecure_registry = true;
    let long_name = format!("f{}", "x".repeat(62));
    let rendered = render(&function(json!({})), &config).expect("renders");
    assert_eq!(
        rendered.image,
        format!(
            "registry.example.com/eddy/shop-reserve-stock:{}",
            rendered.hash
        )
    );
    let job = rendered.job.spec.clone().expect("a job spec");
    assert_eq!(job.backoff_limit, Some(0));
    assert_eq!(job.active_deadline_seconds, Some(600));
    let pod = job.template.spec.expect("a pod spec");
    assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
    let builder = &pod.containers[0];
    assert_eq!(
        builder.image.as_deref(),
        Some("gcr.io/kaniko-project/executor:v1.23.2")
    );
    let args = builder.args.clone().unwrap_or_default();
    assert!(args.contains(&"--insecure".to_owned()));
    assert!(args.contains(&"--context=dir:///workspace".to_owned()));
    assert_eq!(
        builder.termination_message_policy.as_deref(),
        Some("FallbackToLogsOnError")
    );
    let mounts = builder.volume_mounts.clone().unwrap_or_default();
    assert!(mounts.iter().any(|m| m.mount_path == "/kaniko/.docker"));
    let deployment_pod = rendered.deployment.spec.template.spec.expect("a pod spec");
    assert_eq!(
        deployment_pod
            .image_pull_secrets
            .unwrap_or_default()
            .first()
            .map(|s| s.name.clone()),
        Some("registry-push".to_owned())
    );
    // Names stay valid for any Function name.
    assert!(render::job_name(&long_name, &rendered.hash).len() <= 63);
    assert!(!render::job_name("a-", &rendered.hash).contains("--"));
}

// ---------------------------------------------------------------------------------------------
// Pure decisions

#[test]
fn build_state_follows_the_job() {
    let job = |status: Value| -> Job {
        serde_json::from_value(json!({"metadata": {"name": "b"}, "status": status})).expect("a Job")
    };
    assert_eq!(build_state(&job(json!({}))), BuildState::Running);
    assert_eq!(build_state(&job(json!({"active": 1}))), BuildState::Running);
    assert_eq!(
        build_state(&job(json!({"succeeded": 1}))),
        BuildState::Succeeded
    );
    assert_eq!(
        build_state(&job(
            json!({"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded", "message": "Job was active longer than specified deadline"}]})
        )),
        BuildState::Failed(
            "DeadlineExceeded: Job was active longer than specified deadline".to_owned()
        )
    );
    assert!(matches!(
        build_state(&job(json!({"failed": 1}))),
        BuildState::Failed(_)
    ));
    assert_eq!(
        build_state(&job(
            json!({"conditions": [{"type": "Failed", "status": "False"}]})
        )),
        BuildState::Running
    );
}

#[test]
fn running_follows_the_deployment() {
    let deployment =
        |value: Value| -> Deployment { serde_json::from_value(value).expect("a Deployment") };
    let ready = deployment(deployment_ready(3, 2));
    assert_eq!(
        running_condition(&ready, Scaling::Fixed(2)).1,
        Reason::DeploymentReady
    );
    assert_eq!(running_condition(&ready, Scaling::Fixed(2)).3, 2);
    let mut rolling = deployment_ready(3, 2);
    rolling["status"]["updatedReplicas"] = json!(1);
    assert_eq!(
        running_condition(&deployment(rolling), Scaling::Fixed(2)).1,
        Reason::DeploymentWaiting
    );
    // An update whose new pod exists but never starts: the old pod keeps the Deployment
    // Available and the counts look whole, but the rollout has not finished (Progressing is
    // not NewReplicaSetAvailable): Unknown, as Kyma's controller says, never Running True.
    let mut updating = deployment_ready(4, 1);
    updating["status"]["replicas"] = json!(2);
    updating["status"]["conditions"][1]["reason"] = json!("ReplicaSetUpdated");
    let (ok, reason, message, _) = running_condition(&deployment(updating), Scaling::Fixed(1));
    assert_eq!((ok, reason), (None, Reason::DeploymentWaiting), "{message}");
    let mut unobserved = deployment_ready(3, 2);
    unobserved["status"]["observedGeneration"] = json!(2);
    assert_eq!(
        running_condition(&deployment(unobserved), Scaling::Fixed(2)).0,
        None
    );
    let pending = deployment(
        json!({"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "replicas": 1}}),
    );
    assert_eq!(
        running_condition(&pending, Scaling::Fixed(1)).1,
        Reason::DeploymentPending
    );
    let stuck = deployment(
        json!({"metadata": {"generation": 1}, "status": {"conditions": [
            {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "ReplicaSet \"x\" has timed out progressing."}
        ]}}),
    );
    let (ok, reason, message, _) = running_condition(&stuck, Scaling::Fixed(1));
    assert_eq!((ok, reason), (Some(false), Reason::DeploymentFailed));
    assert!(message.contains("timed out"));
    let zero =
        deployment(json!({"metadata": {"generation": 1}, "status": {"observedGeneration": 1}}));
    assert_eq!(
        running_condition(&zero, Scaling::Fixed(0)).1,
        Reason::ScaledToZero
    );
}

#[test]
fn retries_back_off_and_refusals_are_permanent() {
    assert_eq!(RETRY.delay(1), Duration::from_secs(1));
    assert_eq!(RETRY.delay(2), Duration::from_secs(2));
    assert_eq!(RETRY.delay(5), Duration::from_secs(16));
    assert_eq!(RETRY.delay(50), RESYNC);
    let api = |code: u16| {
        Error::Kube(kube::Error::Api(
            kube::core::Status::failure("x", "y")
                .with_code(code)
                .boxed(),
        ))
    };
    for code in [400, 403, 422] {
        assert!(is_permanent(&api(code)), "{code}");
    }
    for code in [404, 409, 429, 500, 503] {
        assert!(!is_permanent(&api(code)), "{code}");
    }
}

#[test]
fn a_refusal_for_a_terminating_namespace_is_told_apart() {
    let status = |causes: serde_json::Value| {
        let status: kube::core::Status = serde_json::from_value(json!({
            "status": "Failure", "code": 403, "reason": "Forbidden",
            "message": "configmaps \"x\" is forbidden",
            "details": {"name": "x", "kind": "configmaps", "causes": causes},
        }))
        .unwrap();
        Error::Kube(kube::Error::Api(Box::new(status)))
    };
    let terminating = status(
        json!([{"reason": "NamespaceTerminating", "message": "namespace shop is being terminated", "field": "metadata.namespace"}]),
    );
    assert!(is_namespace_terminating(&terminating));
    assert!(!is_namespace_terminating(&status(json!([]))));
}

#[test]
fn build_log_tail_reads_the_termination_message() {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "p"},
        "status": {"containerStatuses": [{"name": "build", "image": "k", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": 1, "message": (1..=30).map(|n| format!("line {n}")).collect::<Vec<_>>().join("\n")}}}]},
    }))
    .expect("a Pod");
    let tail = build_log_tail(&[pod]).expect("a message");
    assert!(
        tail.starts_with("line 11") && tail.ends_with("line 30"),
        "{tail}"
    );
    assert_eq!(build_log_tail(&[]), None);
}

#[test]
fn the_crds_print_as_yaml_with_their_rules() {
    let yaml = eddy_model::resources::crds_yaml().expect("YAML");
    assert!(yaml.contains("name: functions.eddy.dev"));
    assert!(yaml.contains("name: subscriptions.eddy.dev"));
    assert!(yaml.contains("x-kubernetes-validations"));
    assert!(yaml.contains("x-kubernetes-int-or-string: true"));
}

/// The CRD declares the scale subresource on the fields the controller reads and writes.
/// (`kubectl scale` and an HPA using it are shown against a real API server:
/// `tests/kubernetes_cluster.rs`, `kubectl_scale_sets_a_function_s_replicas_and_an_hpa_can_target_its_scale`.)
#[test]
fn the_function_crd_declares_the_scale_subresource_on_the_controllers_fields() {
    let crd = serde_json::to_value(<Function as kube::CustomResourceExt>::crd()).expect("JSON");
    assert_eq!(
        crd["spec"]["versions"][0]["subresources"]["scale"],
        json!({
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.podSelector",
        })
    );
    assert_eq!(
        render::pod_selector("reserve-stock"),
        "eddy.dev/function=reserve-stock"
    );
    let rendered = render(&function(json!({})), &config()).expect("renders");
    let deployment = to_json(&rendered.deployment);
    assert_eq!(
        deployment["spec"]["selector"]["matchLabels"],
        json!({"eddy.dev/function": "reserve-stock"}),
        "status.podSelector selects the Deployment's pods"
    );
}

/// The chart's ClusterRole for the controller follows from what the reconcilers do: every
/// mock-API scenario above runs here, each request it makes must be granted, and the chart
/// grants nothing more than that except what the scenarios cannot show, named below. A new API
/// call in a reconciler fails this test until the chart allows it.
#[test]
fn the_chart_grants_the_controller_what_its_requests_need_and_no_more() {
    let scenarios: [fn(); 22] = [
        an_apirule_gets_kymas_status_judged_among_the_others,
        first_reconcile_creates_the_config_map_and_the_build_job,
        a_kyma_function_is_built_by_the_same_code_and_owns_its_objects,
        a_kyma_function_eddy_cannot_read_says_why_in_its_status,
        a_kyma_subscription_gets_its_status_from_the_same_code,
        a_git_source_is_fetched_at_its_commit_and_a_moved_reference_builds_again,
        a_git_source_without_its_secret_or_reference_waits_and_says_why,
        a_running_build_is_left_alone,
        job_success_applies_the_deployment_service_and_autoscaler_and_cleans_up,
        job_failure_puts_the_build_log_into_build_ready_and_waits_to_retry,
        a_failed_build_is_tried_again_once_its_delay_has_passed,
        a_retried_build_keeps_its_failure_count_and_a_new_source_builds_at_once,
        a_source_change_starts_a_new_build_with_a_new_tag_and_keeps_the_old_one_running,
        a_scale_change_builds_nothing_and_drops_the_autoscaler,
        an_unchanged_status_is_not_written_again,
        a_refused_apply_goes_to_status_and_a_transient_error_is_retried,
        a_subscription_to_an_existing_service_is_ready_with_its_subjects,
        a_subscription_to_a_missing_service_is_not_ready_and_looked_at_again,
        a_sink_outside_the_namespace_or_the_policy_is_refused_in_status,
        the_lease_is_created_taken_renewed_and_lost_to_another_replica,
        a_standby_takes_the_lease_once_the_holder_stops_renewing,
        a_cluster_wide_package_registry_secret_is_copied_and_mounted_for_the_install_only,
    ];
    for scenario in scenarios {
        scenario();
    }
    let used = PERMISSIONS_USED.lock().expect("not poisoned").clone();
    // As Helm renders it with Kyma compatibility on (the scenarios reconcile Kyma's kinds too).
    let template =
        eddy_testing::rbac::rendered("controller.yaml", &["kymaCompatibility.enabled=true"])
            .expect("the chart's controller template, rendered");
    // The Lease lives in the controller's namespace: a Role there, not the ClusterRole.
    let lease_role = eddy_testing::rbac::granted_by_role(&template, "Role");
    assert!(
        lease_role
            .iter()
            .all(|p| p.starts_with("coordination.k8s.io/leases:")),
        "the Role grants only the Lease: {lease_role:?}"
    );
    let mut granted = eddy_testing::rbac::granted_by_cluster_role(&template);
    assert!(
        !granted
            .iter()
            .any(|p| p.starts_with("coordination.k8s.io/")),
        "no Lease anywhere in the cluster"
    );
    granted.extend(lease_role);
    let missing: Vec<&String> = used.difference(&granted).collect();
    assert!(
        missing.is_empty(),
        "the reconcilers make requests the chart does not allow: {missing:?}"
    );
    // `kubernetes::run`'s controllers list and watch what they reconcile and what they own
    // (kube's watchers, not part of a reconcile), and owner references with
    // blockOwnerDeletion need `update` on the owner's finalizers.
    let beyond_requests: BTreeSet<String> = [
        "eddy.dev/functions:list",
        "eddy.dev/functions:watch",
        "eddy.dev/subscriptions:list",
        "eddy.dev/subscriptions:watch",
        "batch/jobs:watch",
        "apps/deployments:list",
        "apps/deployments:watch",
        "eddy.dev/functions/finalizers:update",
        "serverless.kyma-project.io/functions:list",
        "serverless.kyma-project.io/functions:watch",
        "serverless.kyma-project.io/functions/finalizers:update",
        "eventing.kyma-project.io/subscriptions:list",
        "eventing.kyma-project.io/subscriptions:watch",
        "gateway.kyma-project.io/apirules:list",
        "gateway.kyma-project.io/apirules:watch",
        // Kyma's Istio resource, watched for its authorizers (tests/kubernetes_cluster.rs).
        "operator.kyma-project.io/istios:list",
        "operator.kyma-project.io/istios:watch",
        // Kyma's package registry Secrets, by name (resourceNames).
        "/secrets:list",
        "/secrets:watch",
        // Kyma's publisher alias replaced by a Function of its name (resourceNames), proven
        // against the real API server (tests/kubernetes_cluster.rs).
        "/services:delete",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    let extra: BTreeSet<String> = granted.difference(&used).cloned().collect();
    assert_eq!(
        extra, beyond_requests,
        "the chart grants more than the reconcilers use (recorded: {used:?})"
    );
}

// ---------------------------------------------------------------------------------------------
// Git sources

/// A Git repository in a temporary directory, changed with the real `git`.
struct Repository {
    dir: tempfile::TempDir,
}

impl Repository {
    fn new() -> Self {
        let repository = Self {
            dir: tempfile::tempdir().expect("a temporary directory"),
        };
        repository.git(&["init", "-q", "-b", "main"]);
        repository
    }

    fn git(&self, args: &[&str]) -> String {
        let output = std::process::Command::new("git")
            .arg("-C")
            .arg(self.dir.path())
            .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
            .args(args)
            .output()
            .expect("git runs");
        assert!(output.status.success(), "git {args:?}: {output:?}");
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// Writes `handler.js` under `fn/` and commits it; returns the commit.
    fn commit_handler(&self, body: &str) -> String {
        let dir = self.dir.path().join("fn");
        std::fs::create_dir_all(&dir).expect("fn/");
        std::fs::write(dir.join("handler.js"), body).expect("handler.js");
        std::fs::write(dir.join("package.json"), r#"{"dependencies": {}}"#).expect("package.json");
        self.git(&["add", "-A"]);
        self.git(&["commit", "-q", "-m", "handler"]);
        self.git(&["rev-parse", "HEAD"])
    }

    fn url(&self) -> String {
        format!("file://{}", self.dir.path().display())
    }
}

fn git_function(url: &str, auth: Value) -> Function {
    let mut repository = json!({"url": url, "reference": "main", "baseDir": "/fn/"});
    if !auth.is_null() {
        repository["auth"] = auth;
    }
    function(json!({"source": {"gitRepository": repository}}))
}

async fn run_git_function(
    function: Function,
    git_dir: &std::path::Path,
    exchanges: Vec<Exchange>,
) -> (Result<Action>, Vec<Value>) {
    let (client, server) = api_server(exchanges);
    let mut context = Context::new(client, config(), SinkPolicy::default());
    context.clock = test_now;
    context.git.dir = git_dir.to_owned();
    context.git_poll_interval = Duration::from_secs(60);
    context.file_repositories = true;
    let context = Arc::new(context);
    let result = reconcile_function(Arc::new(function), context.clone()).await;
    drop(context);
    let bodies = server.await.expect("the API server saw what it expected");
    (result, bodies)
}

fn git_secret(_: Value) -> (u16, Value) {
    use base64::Engine as _;
    let encode = |text: &str| base64::engine::general_purpose::STANDARD.encode(text);
    (
        200,
        json!({"apiVersion": "v1", "kind": "Secret",
               "metadata": {"name": "git-creds", "namespace": "shop"},
               "data": {"username": encode("builder"), "password": encode("s3cret")}}),
    )
}

fn init_container(job: &Value) -> &Value {
    &job["spec"]["template"]["spec"]["initContainers"][0]
}

fn env_of<'a>(container: &'a Value, name: &str) -> &'a Value {
    container["env"]
        .as_array()
        .and_then(|env| env.iter().find(|var| var["name"] == name))
        .unwrap_or_else(|| panic!("no {name} in {container}"))
}

#[tokio::test]
async fn a_git_source_is_fetched_at_its_commit_and_a_moved_reference_builds_again() {
    let repository = Repository::new();
    let first = repository.commit_handler("module.exports = { main: () => 'v1' }");
    let git_dir = tempfile::tempdir().expect("a scratch directory");
    let function = git_function(
        &repository.url(),
        json!({"type": "basic", "secretName": "git-creds"}),
    );
    let rendered = render_at(&function, &config(), Some(&first)).expect("renders");
    let secret = "/api/v1/namespaces/shop/secrets/git-creds";
    let mut exchanges = vec![expect(Method::GET, secret, git_secret)];
    exchanges.extend(no_package_registry());
    exchanges.extend(first_build(&function, &rendered));
    let (result, bodies) = run_git_function(function.clone(), git_dir.path(), exchanges).await;
    // The reference is looked at again every poll interval, not every five minutes.
    assert_eq!(
        result.expect("reconciled"),
        Action::requeue(Duration::from_secs(60))
    );
    let status = &bodies[7]["status"];
    assert_eq!(status["commit"], first.as_str());
    assert_condition(status, "BuildReady", "Unknown", "BuildRunning");
    assert!(
        condition_of(status, "ConfigurationReady")["message"]
            .as_str()
            .is_some_and(|m| m.contains(&format!("of commit {first}"))),
        "{status}"
    );
    // The ConfigMap carries the runtime only: the handler comes from the repository.
    let data = &bodies[5]["data"];
    assert!(data["Dockerfile"].is_string() && data["server.mjs"].is_string());
    assert!(data.get("handler.js").is_none(), "{data}");
    let job = &bodies[6];
    let fetch = init_container(job);
    assert_eq!(fetch["image"], "docker.io/alpine/git:v2.47.2");
    assert_eq!(env_of(fetch, "GIT_URL")["value"], repository.url());
    assert_eq!(env_of(fetch, "GIT_COMMIT")["value"], first.as_str());
    assert_eq!(env_of(fetch, "GIT_BASE_DIR")["value"], "fn");
    assert_eq!(
        env_of(fetch, "EDDY_GIT_PASSWORD")["valueFrom"],
        json!({"secretKeyRef": {"name": "git-creds", "key": "password"}})
    );
    assert_eq!(fetch["securityContext"]["runAsNonRoot"], true);
    assert_eq!(fetch["securityContext"]["readOnlyRootFilesystem"], true);
    let build = &job["spec"]["template"]["spec"]["containers"][0];
    assert!(
        build["args"]
            .as_array()
            .is_some_and(|args| args.contains(&json!("--context=dir:///workspace/context"))),
        "{build}"
    );

    // The branch moves: the next look builds the new commit under a new tag.
    let second = repository.commit_handler("module.exports = { main: () => 'v2' }");
    assert_ne!(first, second);
    let mut moved = function.clone();
    moved.status = serde_json::from_value(status.clone()).expect("a status");
    let rebuilt = render_at(&moved, &config(), Some(&second)).expect("renders");
    assert_ne!(rebuilt.hash, rendered.hash);
    let mut exchanges = vec![expect(Method::GET, secret, git_secret)];
    exchanges.extend(no_package_registry());
    exchanges.extend(first_build(&moved, &rebuilt));
    let (result, bodies) = run_git_function(moved, git_dir.path(), exchanges).await;
    result.expect("reconciled");
    assert_eq!(bodies[7]["status"]["commit"], second.as_str());
    assert_eq!(
        env_of(init_container(&bodies[6]), "GIT_COMMIT")["value"],
        second.as_str()
    );
}

#[tokio::test]
async fn a_git_source_without_its_secret_or_reference_waits_and_says_why() {
    let repository = Repository::new();
    repository.commit_handler("module.exports = { main: () => 'v1' }");
    let git_dir = tempfile::tempdir().expect("a scratch directory");
    let function = git_function(
        &repository.url(),
        json!({"type": "basic", "secretName": "git-creds"}),
    );
    let (result, bodies) = run_git_function(
        function.clone(),
        git_dir.path(),
        vec![
            expect(
                Method::GET,
                "/api/v1/namespaces/shop/secrets/git-creds",
                not_found,
            ),
            function_status_write(&function),
        ],
    )
    .await;
    assert_eq!(
        result.expect("reconciled"),
        Action::requeue(Duration::from_secs(60))
    );
    let status = &bodies[1]["status"];
    assert_condition(status, "BuildReady", "False", "ReferenceNotFound");
    assert_eq!(
        condition_of(status, "BuildReady")["message"],
        "spec.source.gitRepository.auth: Secret git-creds not found"
    );

    let mut function = git_function(&repository.url(), Value::Null);
    if let Some(git) = function.spec.source.git_repository.as_mut() {
        git.reference = "no-such-branch".to_owned();
    }
    let (_, bodies) = run_git_function(
        function.clone(),
        git_dir.path(),
        vec![function_status_write(&function)],
    )
    .await;
    let status = &bodies[0]["status"];
    assert_condition(status, "BuildReady", "False", "SourceUnavailable");
    assert!(status.get("commit").is_none(), "{status}");
}

#[test]
fn a_key_authenticated_git_source_mounts_the_key_for_the_fetch_only() {
    let function = as_if_stored_git(json!({"type": "key", "secretName": "deploy-key"}));
    let rendered = render_at(
        &function,
        &config(),
        Some("0123456789abcdef0123456789abcdef01234567"),
    )
    .expect("renders");
    let job = to_json(&rendered.job);
    let pod = &job["spec"]["template"]["spec"];
    let key_volume = pod["volumes"]
        .as_array()
        .and_then(|volumes| volumes.iter().find(|v| v["name"] == "git-auth"))
        .expect("a volume with the key");
    assert_eq!(
        key_volume["secret"],
        json!({"secretName": "deploy-key", "defaultMode": 0o440,
               "items": [{"key": "key", "path": "key", "mode": 0o440}]})
    );
    assert_eq!(pod["securityContext"]["fsGroup"], 65532);
    let fetch = init_container(&job);
    assert_eq!(
        env_of(fetch, "EDDY_GIT_KEY_PASSPHRASE")["valueFrom"],
        json!({"secretKeyRef": {"name": "deploy-key", "key": "password", "optional": true}})
    );
    assert!(
        fetch["volumeMounts"]
            .as_array()
            .is_some_and(|mounts| mounts.iter().any(|m| m["name"] == "git-auth")),
        "{fetch}"
    );
    // The build container never sees the key.
    let build = &pod["containers"][0];
    assert!(
        build["volumeMounts"]
            .as_array()
            .is_some_and(|mounts| mounts.iter().all(|m| m["name"] != "git-auth")),
        "{build}"
    );
}

fn as_if_stored_git(auth: Value) -> Function {
    git_function("ssh://git@git.example.com/shop/functions.git", auth)
}

/// Runs the fetch script as the init container would (its environment, with the directories
/// moved into a temporary one) against a real repository.
fn run_fetch_script(
    job: &Value,
    root: &std::path::Path,
    runtime_files: &[(&str, &str)],
) -> std::process::Output {
    let fetch = init_container(job);
    let context = root.join("runtime");
    let workspace = root.join("workspace");
    let home = root.join("home");
    for dir in [&context, &workspace, &home] {
        std::fs::create_dir_all(dir).expect("a directory");
    }
    for (name, contents) in runtime_files {
        std::fs::write(context.join(name), contents).expect("a runtime file");
    }
    let mut command = std::process::Command::new("/bin/sh");
    command
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default());
    for var in fetch["env"].as_array().expect("env") {
        if let Some(value) = var["value"].as_str() {
            command.env(var["name"].as_str().expect("a name"), value);
        }
    }
    command
        .env("EDDY_WORKSPACE", &workspace)
        .env("EDDY_CONTEXT", &context)
        .env("EDDY_GIT_AUTH", root.join("no-auth"))
        .env("HOME", &home)
        .arg("-c")
        .arg(fetch["command"][2].as_str().expect("the script"));
    command.output().expect("sh runs")
}

#[test]
fn the_fetch_script_lays_out_the_base_directory_with_the_runtime_files_over_it() {
    use std::os::unix::fs::PermissionsExt as _;
    let repository = Repository::new();
    repository.commit_handler("module.exports = { main: () => 'v1' }");
    let wanted = repository.commit_handler("module.exports = { main: () => 'v2' }");
    let function = git_function(&repository.url(), Value::Null);
    let rendered = render_at(&function, &config(), Some(&wanted)).expect("renders");
    let root = tempfile::tempdir().expect("a temporary directory");
    let output = run_fetch_script(
        &to_json(&rendered.job),
        root.path(),
        &[
            ("Dockerfile", "FROM scratch\n"),
            ("server.mjs", "// server\n"),
        ],
    );
    assert!(output.status.success(), "{output:?}");
    let context = root.path().join("workspace/context");
    let handler = context.join("handler.js");
    assert_eq!(
        std::fs::read_to_string(&handler).expect("handler.js"),
        "module.exports = { main: () => 'v2' }",
        "the commit asked for, not the branch's tip at fetch time"
    );
    assert!(context.join("package.json").is_file());
    assert_eq!(
        std::fs::read_to_string(context.join("Dockerfile")).expect("Dockerfile"),
        "FROM scratch\n"
    );
    assert!(context.join("server.mjs").is_file());
    assert!(
        !context.join(".git").exists(),
        "no Git metadata in the image"
    );
    // Readable by the function's user in the image.
    let mode = std::fs::metadata(&handler)
        .expect("metadata")
        .permissions()
        .mode();
    assert_eq!(mode & 0o044, 0o044, "mode {mode:o}");

    // A base directory the commit lacks fails the fetch, saying so.
    let mut function = function;
    if let Some(git) = function.spec.source.git_repository.as_mut() {
        git.base_dir = Some("missing".to_owned());
    }
    let rendered = render_at(&function, &config(), Some(&wanted)).expect("renders");
    let root = tempfile::tempdir().expect("a temporary directory");
    let output = run_fetch_script(&to_json(&rendered.job), root.path(), &[]);
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains(&format!(
            "the repository has no directory 'missing' at {wanted}"
        )),
        "{output:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Kyma's kinds (kymaCompatibility)

const KYMA_FUNCTIONS: &str = "/apis/serverless.kyma-project.io/v1alpha2/namespaces/shop/functions";
const KYMA_SUBSCRIPTIONS: &str =
    "/apis/eventing.kyma-project.io/v1alpha2/namespaces/shop/subscriptions";

fn kyma_function(spec: Value) -> Arc<DynamicObject> {
    Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "serverless.kyma-project.io/v1alpha2", "kind": "Function",
            "metadata": {"name": "reserve-stock", "namespace": "shop", "uid": "kyma-1", "generation": 2},
            "spec": spec,
        }))
        .expect("a DynamicObject"),
    )
}

/// Reconciles a Kyma object with `reconcile` against a mock API server expecting `exchanges`.
async fn run_kyma<F, Fut>(
    reconcile: F,
    object: Arc<DynamicObject>,
    exchanges: Vec<Exchange>,
) -> (Result<Action>, Vec<Value>)
where
    F: FnOnce(Arc<DynamicObject>, Arc<Context>) -> Fut,
    Fut: std::future::Future<Output = Result<Action>>,
{
    let (client, server) = api_server(exchanges);
    let mut context = Context::new(client, config(), SinkPolicy::default());
    context.clock = test_now;
    context.kyma_compatibility = true;
    let context = Arc::new(context);
    let result = reconcile(object, context.clone()).await;
    drop(context);
    let bodies = server.await.expect("the API server saw what it expected");
    (result, bodies)
}

#[tokio::test]
async fn a_kyma_function_is_built_by_the_same_code_and_owns_its_objects() {
    let object = kyma_function(json!({
        "runtime": "nodejs22",
        "source": {"inline": {"source": "module.exports = { main: () => 'ok' }"}},
        "env": [{"name": "FUNC_TIMEOUT", "value": "20"}],
    }));
    let native = eddy_model::kyma::native_function(to_json(object.as_ref())).expect("converts");
    assert_eq!(native.spec.timeout_seconds, Some(20), "Kyma's FUNC_TIMEOUT");
    let rendered = render(&native, &config()).expect("renders");
    let owner = json!([{"apiVersion": "serverless.kyma-project.io/v1alpha2", "kind": "Function",
                        "name": "reserve-stock", "uid": "kyma-1", "controller": true,
                        "blockOwnerDeletion": true}]);
    assert_eq!(to_json(&rendered.job)["metadata"]["ownerReferences"], owner);
    assert_eq!(
        to_json(&rendered.config_map)["metadata"]["ownerReferences"],
        owner
    );
    let mut exchanges = build_started(&rendered);
    exchanges.push(expect(
        Method::PATCH,
        format!("{KYMA_FUNCTIONS}/reserve-stock/status{APPLY}"),
        status_answer(to_json(object.as_ref())),
    ));
    let (result, bodies) = run_kyma(reconcile_kyma_function, object, exchanges).await;
    assert_eq!(result.expect("reconciled"), Action::requeue(RESYNC));
    assert_eq!(
        bodies[3]["apiVersion"],
        "serverless.kyma-project.io/v1alpha2"
    );
    assert_eq!(bodies[3]["kind"], "Function");
    let status = &bodies[3]["status"];
    assert_condition(status, "ConfigurationReady", "True", "ConfigurationValid");
    assert_condition(status, "BuildReady", "Unknown", "BuildRunning");
    assert_eq!(status["observedGeneration"], 2);
}

#[tokio::test]
async fn a_kyma_function_eddy_cannot_read_says_why_in_its_status() {
    let object = kyma_function(json!({
        "runtime": "nodejs22",
        "source": {"inline": {"source": "x"}},
        "replicas": "three",
    }));
    let exchanges = vec![expect(
        Method::PATCH,
        format!("{KYMA_FUNCTIONS}/reserve-stock/status{APPLY}"),
        status_answer(to_json(object.as_ref())),
    )];
    let (result, bodies) = run_kyma(reconcile_kyma_function, object, exchanges).await;
    assert_eq!(result.expect("reconciled"), Action::await_change());
    let status = &bodies[0]["status"];
    assert_condition(status, "ConfigurationReady", "False", "ValidationFailed");
    assert!(
        condition_of(status, "ConfigurationReady")["message"]
            .as_str()
            .is_some_and(|m| m.contains("spec.replicas")),
        "{status}"
    );
}

#[tokio::test]
async fn a_kyma_subscription_gets_its_status_from_the_same_code() {
    let object: Arc<DynamicObject> = Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "eventing.kyma-project.io/v1alpha2", "kind": "Subscription",
            "metadata": {"name": "on-order", "namespace": "shop", "uid": "kyma-2", "generation": 1},
            "spec": {"sink": "http://reserve-stock.shop.svc.cluster.local", "source": "shop",
                     "types": ["order.created.v1"], "config": {"maxInFlightMessages": "5"}},
        }))
        .expect("a DynamicObject"),
    );
    let exchanges = vec![
        expect(
            Method::GET,
            format!("{}/reserve-stock", base("services")),
            |_| {
                (
                    200,
                    json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "reserve-stock", "namespace": "shop"}}),
                )
            },
        ),
        expect(
            Method::PATCH,
            format!("{KYMA_SUBSCRIPTIONS}/on-order/status{APPLY}"),
            status_answer(to_json(object.as_ref())),
        ),
    ];
    let (result, bodies) = run_kyma(reconcile_kyma_subscription, object, exchanges).await;
    assert_eq!(result.expect("reconciled"), Action::requeue(RESYNC));
    assert_eq!(bodies[1]["apiVersion"], "eventing.kyma-project.io/v1alpha2");
    assert_eq!(bodies[1]["status"]["ready"], true);
    assert_eq!(
        bodies[1]["status"]["backend"]["consumerName"],
        "sub_shop_on-order"
    );
}

const APIRULES: &str = "/apis/gateway.kyma-project.io/v2/namespaces/shop/apirules";

fn api_rule(name: &str, created: &str, hosts: &[&str]) -> Arc<APIRule> {
    Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "gateway.kyma-project.io/v2", "kind": "APIRule",
            "metadata": {"name": name, "namespace": "shop", "creationTimestamp": created},
            "spec": {"hosts": hosts, "service": {"name": "orders", "port": 80},
                     "rules": [{"path": "/*", "methods": ["GET"], "noAuth": true}]},
        }))
        .expect("an APIRule"),
    )
}

/// An APIRule gets Kyma's status by server-side apply: Ready with its URL, and Error (looked
/// at again soon) for a host an older APIRule holds; an unchanged status is not written.
#[tokio::test]
async fn an_apirule_gets_kymas_status_judged_among_the_others() {
    let older = api_rule("orders", "2026-01-01T00:00:00Z", &["orders"]);
    let newer = api_rule("copy", "2026-01-02T00:00:00Z", &["orders.shop.example.com"]);
    let all = vec![older.clone(), newer.clone()];
    let run = |rule: Arc<APIRule>, all: Vec<Arc<APIRule>>, exchanges| async move {
        let (client, server) = api_server(exchanges);
        let mut context = Context::new(client, config(), SinkPolicy::default());
        context.apirules.domain = "shop.example.com".to_owned();
        let result = reconcile_apirule(rule, all, Arc::new(context)).await;
        let bodies = server.await.expect("the API server saw what it expected");
        (result, bodies)
    };
    let patched = |rule: &APIRule| {
        expect(
            Method::PATCH,
            format!(
                "{APIRULES}/{}/status{APPLY}",
                rule.metadata.name.as_deref().unwrap_or_default()
            ),
            status_answer(to_json(rule)),
        )
    };
    let (result, bodies) = run(older.clone(), all.clone(), vec![patched(&older)]).await;
    assert_eq!(result.expect("reconciled"), Action::await_change());
    assert_eq!(bodies[0]["kind"], "APIRule");
    assert_eq!(bodies[0]["status"]["state"], "Ready");
    assert_eq!(
        bodies[0]["status"]["description"],
        "exposed on https://orders.shop.example.com"
    );
    let (result, bodies) = run(newer.clone(), all.clone(), vec![patched(&newer)]).await;
    assert_eq!(
        result.expect("reconciled"),
        Action::requeue(APIRULE_RECHECK)
    );
    assert_eq!(bodies[0]["status"]["state"], "Error");
    assert_eq!(
        bodies[0]["status"]["description"],
        "host orders.shop.example.com is already exposed by APIRule shop/orders"
    );
    // Written already: nothing is sent.
    let mut settled = (*older).clone();
    settled.status = Some(eddy_model::apirule::ApiRuleStatus {
        state: "Ready".to_owned(),
        description: Some("exposed on https://orders.shop.example.com".to_owned()),
        last_processed_time: Some("2026-01-01T00:00:01Z".to_owned()),
    });
    let (result, _) = run(Arc::new(settled), all, Vec::new()).await;
    assert_eq!(result.expect("reconciled"), Action::await_change());
}

// ---------------------------------------------------------------------------------------------
// One leader

const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/eddy-system/leases/eddy-controller";

/// The lease duration of these tests. Long enough that a loaded machine's delays (a second or
/// two) stay well apart from the mistakes the tests look for: taking a lease before it runs out,
/// or waiting a second lease duration.
const LEASE_SECONDS: i64 = 4;

fn leader_args(identity: &str) -> leader::LeaderArgs {
    leader::LeaderArgs {
        enabled: true,
        lease_name: "eddy-controller".to_owned(),
        lease_namespace: "eddy-system".to_owned(),
        lease_duration: Duration::from_secs(LEASE_SECONDS.unsigned_abs()),
        identity: Some(identity.to_owned()),
    }
}

/// A Lease as the API server returns it: held by `holder` (renewed `renewed_ago` before now,
/// for `duration` seconds), or free.
fn lease(holder: Option<&str>, renewed_ago: Duration, duration: i64) -> Value {
    let spec = match holder {
        Some(holder) => {
            let renewed = std::time::SystemTime::now() - renewed_ago;
            let renewed = k8s_openapi::jiff::Timestamp::try_from(renewed).expect("a time");
            json!({
                "holderIdentity": holder, "leaseDurationSeconds": duration,
                "acquireTime": renewed.strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string(),
                "renewTime": renewed.strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string(),
                "leaseTransitions": 1,
            })
        }
        None => json!({}),
    };
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "eddy-controller", "namespace": "eddy-system", "resourceVersion": "1"},
        "spec": spec,
    })
}

/// Answers with [`lease`] as of the moment the request arrives.
fn answer_lease(
    holder: Option<&'static str>,
    renewed_ago: Duration,
    duration: i64,
) -> impl FnOnce(Value) -> (u16, Value) + Send + 'static {
    move |_| (200, lease(holder, renewed_ago, duration))
}

/// The patch URI of a replica's writes.
fn lease_patch(identity: &str) -> String {
    format!("{LEASE}?&fieldManager={}", leader::field_manager(identity))
}

/// Waits (at most `within`) until the receiver says `leads`.
async fn until_leading(
    leading: &mut tokio::sync::watch::Receiver<bool>,
    leads: bool,
    within: Duration,
) {
    tokio::time::timeout(within, leading.wait_for(|now| *now == leads))
        .await
        .unwrap_or_else(|_| panic!("leading = {leads} within {within:?}"))
        .expect("the election runs");
}

/// The exchanges of taking a free lease, from the sync that finds it free to the read-back.
fn take_free_lease(identity: &'static str) -> Vec<Exchange> {
    vec![
        // The state is stale at first, and a free lease never is fresh: read twice.
        expect(Method::GET, LEASE, answer_lease(None, Duration::ZERO, 0)),
        expect(Method::GET, LEASE, answer_lease(None, Duration::ZERO, 0)),
        expect(Method::PATCH, lease_patch(identity), move |body| {
            assert_eq!(body["spec"]["holderIdentity"], identity, "{body}");
            assert_eq!(
                body["spec"]["leaseDurationSeconds"], LEASE_SECONDS,
                "{body}"
            );
            (200, lease(Some(identity), Duration::ZERO, LEASE_SECONDS))
        }),
        expect(Method::PATCH, lease_patch(identity), |body| {
            assert_eq!(body["spec"]["leaseTransitions"], 1, "{body}");
            (200, body)
        }),
        expect(
            Method::GET,
            LEASE,
            answer_lease(Some(identity), Duration::ZERO, LEASE_SECONDS),
        ),
    ]
}

/// A replica creates the Lease, takes it, renews it, and stops leading when it finds another
/// replica holding it; stopping, it leaves another's lease alone.
#[tokio::test]
async fn the_lease_is_created_taken_renewed_and_lost_to_another_replica() {
    let mut exchanges = vec![
        expect(Method::GET, LEASE, not_found),
        expect(
            Method::POST,
            "/apis/coordination.k8s.io/v1/namespaces/eddy-system/leases?",
            |body| {
                assert_eq!(body["metadata"]["name"], "eddy-controller");
                (201, lease(None, Duration::ZERO, 0))
            },
        ),
    ];
    exchanges.extend(take_free_lease("controller-a"));
    exchanges.extend([
        // Renewed a third of the duration before it runs out: 2.7 s after it was taken.
        expect(Method::PATCH, lease_patch("controller-a"), |body| {
            assert_eq!(
                body["spec"]["leaseDurationSeconds"], LEASE_SECONDS,
                "{body}"
            );
            assert!(body["spec"]["renewTime"].is_string(), "{body}");
            (200, body)
        }),
        // Meanwhile another replica holds it (this one was partitioned, say).
        expect(
            Method::GET,
            LEASE,
            answer_lease(Some("controller-b"), Duration::ZERO, LEASE_SECONDS),
        ),
        // Stopping: the lease is another's, so nothing is released; read back once.
        expect(
            Method::GET,
            LEASE,
            answer_lease(Some("controller-b"), Duration::ZERO, LEASE_SECONDS),
        ),
    ]);
    let (client, server) = api_server(exchanges);
    let (mut leading, manager) = leader::leadership(
        client,
        &leader_args("controller-a"),
        "controller-a".to_owned(),
        &eddy_platform::shutdown::CancellationToken::new(),
    )
    .await
    .expect("the election starts");
    until_leading(&mut leading, true, Duration::from_secs(10)).await;
    let taken = std::time::Instant::now();
    until_leading(&mut leading, false, Duration::from_secs(10)).await;
    assert!(
        taken.elapsed() >= Duration::from_millis(2000),
        "renewed at two thirds of the 4 s lease, not before ({:?})",
        taken.elapsed()
    );
    drop(leading);
    tokio::time::timeout(Duration::from_secs(5), manager)
        .await
        .expect("the manager ends once the receiver is gone")
        .expect("joined")
        .expect("released");
    server.await.expect("the API server saw what it expected");
}

/// A standby waits while another replica holds the lease and takes it once the holder stops
/// renewing: within the lease duration (and up to a second) of the last renewal.
#[tokio::test]
async fn a_standby_takes_the_lease_once_the_holder_stops_renewing() {
    let mut exchanges = vec![
        // Held by controller-b, renewed just now, and never again.
        expect(
            Method::GET,
            LEASE,
            answer_lease(Some("controller-b"), Duration::ZERO, LEASE_SECONDS),
        ),
        expect(
            Method::GET,
            LEASE,
            answer_lease(Some("controller-b"), Duration::ZERO, LEASE_SECONDS),
        ),
        // Looked at again when it runs out (and once more before freeing it): still
        // controller-b's, expired.
        expect(
            Method::GET,
            LEASE,
            answer_lease(Some("controller-b"), Duration::from_secs(5), LEASE_SECONDS),
        ),
        expect(
            Method::GET,
            LEASE,
            answer_lease(Some("controller-b"), Duration::from_secs(5), LEASE_SECONDS),
        ),
        // Freed by force...
        expect(Method::PATCH, lease_patch("controller-a"), |body| {
            assert_eq!(body["spec"]["holderIdentity"], Value::Null, "{body}");
            (200, lease(None, Duration::ZERO, 0))
        }),
        expect(Method::GET, LEASE, answer_lease(None, Duration::ZERO, 0)),
    ];
    // ...and taken.
    exchanges.extend(take_free_lease("controller-a"));
    exchanges.extend([
        // Stopping: this replica holds it, so it releases it for the next one.
        expect(Method::PATCH, lease_patch("controller-a"), |body| {
            assert_eq!(body["spec"]["holderIdentity"], Value::Null, "{body}");
            (200, lease(None, Duration::ZERO, 0))
        }),
        expect(Method::GET, LEASE, answer_lease(None, Duration::ZERO, 0)),
    ]);
    let (client, server) = api_server(exchanges);
    let started = std::time::Instant::now();
    let (mut leading, manager) = leader::leadership(
        client,
        &leader_args("controller-a"),
        "controller-a".to_owned(),
        &eddy_platform::shutdown::CancellationToken::new(),
    )
    .await
    .expect("the election starts");
    until_leading(&mut leading, true, Duration::from_secs(15)).await;
    let waited = started.elapsed();
    // Not before the lease runs out (a loaded machine only makes it later), and not a second
    // lease duration later (8 s): the second of retry plus up to 2 s of a loaded machine.
    assert!(
        waited >= Duration::from_millis(3500) && waited <= Duration::from_millis(7000),
        "took over after the 4 s lease ran out, within a second or so ({waited:?})"
    );
    drop(leading);
    tokio::time::timeout(Duration::from_secs(5), manager)
        .await
        .expect("the manager ends once the receiver is gone")
        .expect("joined")
        .expect("released");
    server.await.expect("the API server saw what it expected");
}

/// The reconcilers run exactly while the replica leads, and stop at shutdown.
#[tokio::test]
async fn reconcilers_run_only_while_leading() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (elect, leading) = tokio::sync::watch::channel(false);
    let shutdown = CancellationToken::new();
    let started = Arc::new(AtomicUsize::new(0));
    let running = Arc::new(AtomicUsize::new(0));
    let task = tokio::spawn({
        let (shutdown, started, running) = (shutdown.clone(), started.clone(), running.clone());
        leader::while_leading(leading, shutdown, move |term| {
            let (started, running) = (started.clone(), running.clone());
            async move {
                started.fetch_add(1, Ordering::SeqCst);
                running.fetch_add(1, Ordering::SeqCst);
                term.cancelled().await;
                running.fetch_sub(1, Ordering::SeqCst);
            }
        })
    });
    let until = |what: &'static str, check: Box<dyn Fn() -> bool + Send>| async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !check() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::task::yield_now().await;
    assert_eq!(started.load(Ordering::SeqCst), 0, "not before leading");
    elect.send(true).expect("listening");
    let (s, r) = (started.clone(), running.clone());
    until(
        "the first start",
        Box::new(move || s.load(Ordering::SeqCst) == 1 && r.load(Ordering::SeqCst) == 1),
    )
    .await;
    elect.send(false).expect("listening");
    let r = running.clone();
    until(
        "the stop on loss",
        Box::new(move || r.load(Ordering::SeqCst) == 0),
    )
    .await;
    elect.send(true).expect("listening");
    let (s, r) = (started.clone(), running.clone());
    until(
        "the second start",
        Box::new(move || s.load(Ordering::SeqCst) == 2 && r.load(Ordering::SeqCst) == 1),
    )
    .await;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("ends at shutdown")
        .expect("joined");
    assert_eq!(running.load(Ordering::SeqCst), 0, "the work was stopped");
    assert_eq!(started.load(Ordering::SeqCst), 2);
}

// ---------------------------------------------------------------------------------------------
// Buildless

fn buildless_config() -> RenderConfig {
    RenderConfig {
        build: BuildMode::Buildless,
        ..config()
    }
}

/// Buildless: no build Job and no registry image; the Deployment runs eddy's runtime image,
/// mounts the handler and dependency files of the sources' ConfigMap, and an `install` init
/// container (same image, the function's resources) copies them into the `function` volume
/// and installs the dependencies, which the function container reads.
#[test]
fn buildless_pods_run_the_runtime_image_and_install_when_they_start() {
    let function = function(json!({
        "runtime": "nodejs22",
        "source": {"inline": {"source": "module.exports = { main: () => 'ok' }",
                              "dependencies": "{\"dependencies\": {\"lodash\": \"^4\"}}"}},
    }));
    let rendered = render(&function, &buildless_config()).expect("renders");
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        rendered.image,
        format!("ghcr.io/eddy-dev/eddy-runtime-nodejs22:{version}")
    );
    let pod = to_json(&rendered.deployment)["spec"]["template"]["spec"].clone();
    assert_eq!(pod["containers"][0]["image"], json!(rendered.image));
    let install = &pod["initContainers"][0];
    assert_eq!(install["name"], "install");
    assert_eq!(install["image"], json!(rendered.image));
    assert_eq!(install["command"][2], render::BUILDLESS_INSTALL_SCRIPT);
    assert_eq!(install["securityContext"]["readOnlyRootFilesystem"], true);
    let sources = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|volume| volume["name"] == "sources")
        .expect("a sources volume");
    assert_eq!(
        sources["configMap"]["name"],
        json!(format!("reserve-stock-{}", rendered.hash))
    );
    assert_eq!(
        sources["configMap"]["items"],
        json!([{"key": "handler.js", "path": "handler.js"},
               {"key": "package.json", "path": "package.json"}])
    );
    let mounts = &pod["containers"][0]["volumeMounts"];
    assert!(
        mounts.as_array().expect("mounts").contains(
            &json!({"name": "function", "mountPath": "/runtime/function", "readOnly": true})
        ),
        "{mounts}"
    );
}

/// A buildless reconcile applies the ConfigMap and the Deployment at once (no Job is looked
/// for or made), reports BuildReady `Buildless`, and keeps the superseded ConfigMaps while the
/// rollout is under way (old pods still mount theirs).
#[tokio::test]
async fn a_buildless_function_is_deployed_without_a_build() {
    let function = function(json!({}));
    let rendered = render(&function, &buildless_config()).expect("renders");
    let deployment = to_json(&rendered.deployment);
    let rolling = json!({"metadata": {"generation": 2},
        "status": {"observedGeneration": 2, "replicas": 2, "updatedReplicas": 1}});
    let exchanges = vec![
        expect(
            Method::PATCH,
            format!(
                "{}/reserve-stock-{}{APPLY}",
                base("configmaps"),
                rendered.hash
            ),
            applied(to_json(&rendered.config_map), json!({})),
        ),
        expect(
            Method::PATCH,
            format!("{}/reserve-stock{APPLY}", base("deployments")),
            applied(
                deployment.clone(),
                merged(rolling, json!({"metadata": deployment["metadata"].clone()})),
            ),
        ),
        expect(
            Method::PATCH,
            format!("{}/reserve-stock{APPLY}", base("services")),
            applied(to_json(&rendered.service), json!({})),
        ),
        expect(
            Method::PATCH,
            format!("{}/reserve-stock{APPLY}", base("hpas")),
            applied(
                to_json(&rendered.autoscaler.clone().expect("autoscaled")),
                json!({}),
            ),
        ),
        // Not available yet: the pods of this build are read, and one no node takes is said.
        expect(
            Method::GET,
            format!(
                "{}?&labelSelector=eddy.dev%2Ffunction%3Dreserve-stock%2Ceddy.dev%2Fbuild-hash%3D{}",
                base("pods"),
                rendered.hash
            ),
            |_| {
                (
                    200,
                    json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": [{
                        "metadata": {"name": "reserve-stock-1"},
                        "status": {"conditions": [{"type": "PodScheduled", "status": "False",
                            "reason": "Unschedulable",
                            "message": "0/1 nodes are available: 1 Insufficient cpu."}]},
                    }]}),
                )
            },
        ),
        function_status_write(&function),
    ];
    let (client, server) = api_server(exchanges);
    let mut context = Context::new(client, buildless_config(), SinkPolicy::default());
    context.clock = test_now;
    let result = reconcile_function(Arc::new(function), Arc::new(context)).await;
    let bodies = server.await.expect("the API server saw what it expected");
    assert_eq!(result.expect("reconciled"), Action::requeue(INSTALL_CHECK));
    let status = &bodies[5]["status"];
    assert_condition(status, "BuildReady", "True", "Buildless");
    let running = status["conditions"]
        .as_array()
        .expect("conditions")
        .iter()
        .find(|condition| condition["type"] == "Running")
        .expect("Running");
    assert!(
        running["message"].as_str().is_some_and(|message| {
            message.contains(
            "pod reserve-stock-1 cannot be scheduled: 0/1 nodes are available: 1 Insufficient cpu."
        )
        }),
        "{running}"
    );
    assert_eq!(status["runtimeImage"], json!(rendered.image));
}

/// Kyma's cluster-wide package registry Secret (in `kyma-system`, with Kyma's label) is copied
/// into the Function's namespace, mounted into the `install` init container only (never the
/// function's container), and its contents are part of the build key.
#[tokio::test]
async fn a_cluster_wide_package_registry_secret_is_copied_and_mounted_for_the_install_only() {
    use base64::Engine as _;
    let function = function(json!({
        "source": {"inline": {"source": "x",
            "dependencies": "{\"dependencies\": {\"@acme/greeting\": \"1\"}}"}},
    }));
    let npmrc = "@acme:registry=https://npm.acme.example/\n//npm.acme.example/:_authToken=t0k3n\n";
    let encoded = base64::engine::general_purpose::STANDARD.encode(npmrc);
    let registry = crate::package_registry::PackageRegistry {
        secret: "kyma-system/serverless-package-registry-config".into(),
        name: PACKAGE_REGISTRY_COPY.into(),
        config: npmrc.as_bytes().to_vec(),
    };
    let plain = render(&function, &buildless_config()).expect("renders");
    let rendered =
        render_with(&function, &buildless_config(), None, Some(&registry)).expect("renders");
    assert_ne!(
        rendered.hash, plain.hash,
        "the registry is part of the build key"
    );
    let deployment = to_json(&rendered.deployment);
    let pod = &deployment["spec"]["template"]["spec"];
    let install = pod["initContainers"]
        .as_array()
        .expect("init containers")
        .iter()
        .find(|c| c["name"] == "install")
        .expect("install");
    assert!(
        install["volumeMounts"].as_array().expect("mounts").contains(&json!(
            {"name": "package-registry", "mountPath": "/eddy/package-registry", "readOnly": true}
        )),
        "{install}"
    );
    assert!(
        pod["containers"][0]["volumeMounts"]
            .as_array()
            .is_none_or(|mounts| mounts.iter().all(|m| m["name"] != "package-registry")),
        "the function's container never sees the registry's credentials: {pod}"
    );
    assert!(pod["volumes"].as_array().expect("volumes").contains(&json!(
        {"name": "package-registry", "secret": {"secretName": "eddy-package-registry-config", "optional": true}}
    )));
    let cluster_secret = json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "serverless-package-registry-config", "namespace": "kyma-system",
            "labels": {"serverless.kyma-project.io/config": "credentials"}},
        "type": "Opaque", "data": {".npmrc": encoded},
    });
    let copy = json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "eddy-package-registry-config", "namespace": "shop",
            "labels": {"app.kubernetes.io/managed-by": "eddy",
                "eddy.dev/copy-of": "kyma-system.serverless-package-registry-config"}},
        "type": "Opaque", "data": {".npmrc": encoded},
    });
    let exchanges = vec![
        expect(
            Method::GET,
            "/api/v1/namespaces/shop/secrets/serverless-package-registry-config",
            not_found,
        ),
        expect(
            Method::GET,
            "/api/v1/namespaces/kyma-system/secrets/serverless-package-registry-config",
            move |_| (200, cluster_secret),
        ),
        expect(
            Method::PATCH,
            format!("/api/v1/namespaces/shop/secrets/eddy-package-registry-config{APPLY}"),
            applied(copy, json!({})),
        ),
        expect(
            Method::PATCH,
            format!(
                "{}/reserve-stock-{}{APPLY}",
                base("configmaps"),
                rendered.hash
            ),
            applied(to_json(&rendered.config_map), json!({})),
        ),
        expect(
            Method::PATCH,
            format!("{}/reserve-stock{APPLY}", base("deployments")),
            applied(deployment.clone(), json!({})),
        ),
        expect(
            Method::PATCH,
            format!("{}/reserve-stock{APPLY}", base("services")),
            applied(to_json(&rendered.service), json!({})),
        ),
        expect(
            Method::PATCH,
            format!("{}/reserve-stock{APPLY}", base("hpas")),
            applied(
                to_json(&rendered.autoscaler.clone().expect("autoscaled")),
                json!({}),
            ),
        ),
        expect(
            Method::GET,
            format!(
                "{}?&labelSelector=eddy.dev%2Ffunction%3Dreserve-stock%2Ceddy.dev%2Fbuild-hash%3D{}",
                base("pods"),
                rendered.hash
            ),
            |_| {
                (
                    200,
                    json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": []}),
                )
            },
        ),
        function_status_write(&function),
    ];
    let (client, server) = api_server(exchanges);
    let mut context = Context::new(client, buildless_config(), SinkPolicy::default());
    context.clock = test_now;
    let result = reconcile_function(Arc::new(function), Arc::new(context)).await;
    server.await.expect("the API server saw what it expected");
    result.expect("reconciled");
}

/// A buildless Git source is fetched by the pod itself: the build Job's `source` init container
/// (same script, same commit), then `install` from the fetched context.
#[test]
fn a_buildless_git_source_is_fetched_by_the_pod() {
    let function = function(json!({
        "runtime": "python312",
        "source": {"gitRepository": {"url": "https://git.example.com/shop.git",
                                     "reference": "main", "baseDir": "/orders"}},
    }));
    let rendered =
        render_at(&function, &buildless_config(), Some("0123456789abcdef")).expect("renders");
    let pod = to_json(&rendered.deployment)["spec"]["template"]["spec"].clone();
    let names: Vec<&str> = pod["initContainers"]
        .as_array()
        .expect("init containers")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(names, ["source", "install"]);
    let env = &pod["initContainers"][1]["env"];
    assert!(
        env.as_array()
            .expect("env")
            .contains(&json!({"name": "EDDY_SOURCES", "value": "/workspace/context"})),
        "{env}"
    );
    let job_source =
        to_json(&rendered.job)["spec"]["template"]["spec"]["initContainers"][0].clone();
    assert_eq!(
        pod["initContainers"][0], job_source,
        "the build's own fetch"
    );
}

/// A Function's own security contexts are judged against the operator's Pod Security level on
/// what its pods would run: eddy's defaults pass `restricted`; `privileged: true`, an added
/// `SYS_ADMIN` and `runAsUser: 0` (the attack probe's asks) are refused by field, under
/// `baseline` the root user passes but not the rest, and `privileged` takes anything.
#[test]
fn security_contexts_beyond_the_operators_level_are_refused_by_field() {
    let plain = function(json!({"runtime": "nodejs22", "source": {"inline": {"source": "x"}}}));
    let rendered = render(&plain, &config()).unwrap();
    assert_eq!(
        rendered.pod_security_violations(PodSecurityLevel::Restricted),
        Vec::<String>::new()
    );
    let asking = function(json!({
        "runtime": "nodejs22", "source": {"inline": {"source": "x"}},
        "podSecurityContext": {"runAsUser": 0, "runAsNonRoot": false},
        "containerSecurityContext": {"privileged": true, "allowPrivilegeEscalation": true,
                                     "capabilities": {"add": ["SYS_ADMIN"], "drop": []}},
    }));
    let rendered = render(&asking, &config()).unwrap();
    let restricted = rendered.pod_security_violations(PodSecurityLevel::Restricted);
    for field in [
        "spec.containerSecurityContext.privileged: must not be true",
        "spec.containerSecurityContext.capabilities.add: SYS_ADMIN may not be added",
        "spec.containerSecurityContext.allowPrivilegeEscalation: must be false",
        "spec.podSecurityContext.runAsUser: must not be 0",
        "spec.containerSecurityContext.capabilities.drop: must include ALL",
    ] {
        assert!(
            restricted.iter().any(|v| v.starts_with(field)),
            "{field} in {restricted:?}"
        );
    }
    assert!(
        restricted[0].ends_with("(the restricted Pod Security profile the operator set)"),
        "{restricted:?}"
    );
    let baseline = rendered.pod_security_violations(PodSecurityLevel::Baseline);
    assert_eq!(baseline.len(), 2, "{baseline:?}");
    assert!(
        baseline.iter().all(|v| !v.contains("runAsUser")),
        "{baseline:?}"
    );
    assert!(
        rendered
            .pod_security_violations(PodSecurityLevel::Privileged)
            .is_empty()
    );
}

/// Behind a corporate proxy: the buildless install gets the proxy (both spellings, since npm
/// and pip read different ones) and the CA bundle of the operator's ConfigMap, mounted where
/// the variables point; the function container gets neither.
#[test]
fn buildless_installs_reach_registries_through_the_egress_proxy_and_ca_bundle() {
    let function = function(json!({
        "runtime": "python312",
        "source": {"inline": {"source": "def main(event, context):\n    return 'ok'\n",
                              "dependencies": "requests==2.32.3"}},
    }));
    let config = RenderConfig {
        egress: render::Egress {
            proxy: Some("http://proxy.corp:3128".into()),
            no_proxy: ".svc,.cluster.local".into(),
            ca_config_map: Some("corp-ca".into()),
        },
        ..buildless_config()
    };
    let rendered = render(&function, &config).expect("renders");
    let pod = to_json(&rendered.deployment)["spec"]["template"]["spec"].clone();
    let install = &pod["initContainers"][0];
    let env = |container: &Value, name: &str| {
        container["env"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|var| var["name"] == name)
            .map(|var| var["value"].clone())
    };
    for name in ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY"] {
        assert_eq!(
            env(install, name),
            Some(json!("http://proxy.corp:3128")),
            "{name}"
        );
    }
    assert_eq!(env(install, "NO_PROXY"), Some(json!(".svc,.cluster.local")));
    for name in ["PIP_CERT", "NODE_EXTRA_CA_CERTS", "SSL_CERT_FILE"] {
        assert_eq!(
            env(install, name),
            Some(json!("/etc/eddy/ca/ca.crt")),
            "{name}"
        );
    }
    assert!(
        install["volumeMounts"]
            .as_array()
            .expect("mounts")
            .contains(&json!({"name": "egress-ca", "mountPath": "/etc/eddy/ca", "readOnly": true}))
    );
    let volume = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|volume| volume["name"] == "egress-ca")
        .expect("the CA volume");
    assert_eq!(volume["configMap"]["name"], "corp-ca");
    let function_container = &pod["containers"][0];
    assert_eq!(env(function_container, "HTTPS_PROXY"), None);
    assert_eq!(env(function_container, "PIP_CERT"), None);

    let plain = render(&function, &buildless_config()).expect("renders");
    let pod = to_json(&plain.deployment)["spec"]["template"]["spec"].clone();
    assert_eq!(env(&pod["initContainers"][0], "HTTPS_PROXY"), None);
}

/// A buildless pod whose `install` failed (now, or before a restart: CrashLoopBackOff) names
/// the pod and npm's own message; a running or still-installing pod names nothing.
#[test]
fn a_failed_install_is_read_from_the_install_containers_termination_message() {
    let pod = |name: &str, install: Value| -> k8s_openapi::api::core::v1::Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "status": {"initContainerStatuses": [install]},
        }))
        .expect("a pod")
    };
    let npm = "npm error code E404\nnpm error 404 Not Found - GET https://registry.npmjs.org/nope";
    let crashing = pod(
        "f-1",
        json!({"name": "install", "ready": false, "restartCount": 2, "image": "i", "imageID": "",
               "state": {"waiting": {"reason": "CrashLoopBackOff"}},
               "lastState": {"terminated": {"exitCode": 1, "message": npm}}}),
    );
    let installing = pod(
        "f-2",
        json!({"name": "install", "ready": false, "restartCount": 0, "image": "i", "imageID": "",
               "state": {"running": {}}}),
    );
    let installed = pod(
        "f-3",
        json!({"name": "install", "ready": true, "restartCount": 0, "image": "i", "imageID": "",
               "state": {"terminated": {"exitCode": 0, "message": "installed abc"}}}),
    );
    assert_eq!(
        install_failure(&[installing.clone(), crashing]),
        Some(("f-1".to_owned(), npm.to_owned()))
    );
    assert_eq!(install_failure(&[installing, installed]), None);
    let silent = pod(
        "f-4",
        json!({"name": "install", "ready": false, "restartCount": 0, "image": "i", "imageID": "",
               "state": {"terminated": {"exitCode": 137}}}),
    );
    assert_eq!(
        install_failure(&[silent]),
        Some(("f-4".to_owned(), "exit code 137".to_owned()))
    );
}
