//! The Kubernetes backend against a mock API server that asserts each request (method, path
//! and query, body) and answers it, in the order the reconciler must send them; plus the
//! pure decisions and the rendered objects.

use std::{collections::BTreeSet, sync::Arc, time::Duration};

use eddy_model::resources::{Function, SinkPolicy, Subscription};
use eddy_testing::kube_mock::{self, Exchange, expect};
use http::Method;
use kube::runtime::controller::Action;
use serde_json::{Value, json};

use super::*;

const APPLY: &str = "?&force=true&fieldManager=eddy-controller";

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

/// A transient refusal (retried, never reported as permanent).
fn unavailable(_: Value) -> (u16, Value) {
    (
        503,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "ServiceUnavailable", "code": 503, "message": "etcd leader changed"}),
    )
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
    run_function_after_failures(function, 0, exchanges).await
}

/// [`run_function`] for a Function whose last `failures` reconciles failed.
async fn run_function_after_failures(
    function: Function,
    failures: u32,
    exchanges: Vec<Exchange>,
) -> (Result<Action>, Vec<Value>) {
    let (client, server) = kube_mock::scripted(exchanges);
    let mut context = Context::new(client, config(), SinkPolicy::default());
    context.clock = test_now;
    let key = key_of(&function);
    for _ in 0..failures {
        context.record_failure(&key);
    }
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

mod buildless;
mod decisions;
mod git;
mod kyma_kinds;
mod lifecycle;
mod one_leader;
mod rendered;
mod subscriptions;

/// The chart's ClusterRole for the controller follows from what the reconcilers do: every
/// mock-API scenario above runs here, each request it makes must be granted, and the chart
/// grants nothing more than that except what the scenarios cannot show, named below. A new API
/// call in a reconciler fails this test until the chart allows it.
#[test]
fn the_chart_grants_the_controller_what_its_requests_need_and_no_more() {
    let scenarios: [fn(); 22] = [
        kyma_kinds::an_apirule_gets_kymas_status_judged_among_the_others,
        lifecycle::first_reconcile_creates_the_config_map_and_the_build_job,
        kyma_kinds::a_kyma_function_is_built_by_the_same_code_and_owns_its_objects,
        kyma_kinds::a_kyma_function_eddy_cannot_read_says_why_in_its_status,
        kyma_kinds::a_kyma_subscription_gets_its_status_from_the_same_code,
        git::a_git_source_is_fetched_at_its_commit_and_a_moved_reference_builds_again,
        git::a_git_source_without_its_secret_or_reference_waits_and_says_why,
        lifecycle::a_running_build_is_left_alone,
        lifecycle::job_success_applies_the_deployment_service_and_autoscaler_and_cleans_up,
        lifecycle::job_failure_puts_the_build_log_into_build_ready_and_waits_to_retry,
        lifecycle::a_failed_build_is_tried_again_once_its_delay_has_passed,
        lifecycle::a_retried_build_keeps_its_failure_count_and_a_new_source_builds_at_once,
        lifecycle::a_source_change_starts_a_new_build_with_a_new_tag_and_keeps_the_old_one_running,
        lifecycle::a_scale_change_builds_nothing_and_drops_the_autoscaler,
        lifecycle::an_unchanged_status_is_not_written_again,
        lifecycle::a_refused_apply_goes_to_status_and_a_transient_error_is_retried,
        subscriptions::a_subscription_to_an_existing_service_is_ready_with_its_subjects,
        subscriptions::a_subscription_to_a_missing_service_is_not_ready_and_looked_at_again,
        subscriptions::a_sink_outside_the_namespace_or_the_policy_is_refused_in_status,
        one_leader::the_lease_is_created_taken_renewed_and_lost_to_another_replica,
        one_leader::a_standby_takes_the_lease_once_the_holder_stops_renewing,
        buildless::a_cluster_wide_package_registry_secret_is_copied_and_mounted_for_the_install_only,
    ];
    for scenario in scenarios {
        scenario();
    }
    let used = kube_mock::permissions_used();
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
        // Kyma's RateLimits, reported on (tests/kubernetes_cluster/ proves it on the real
        // API server).
        "gateway.kyma-project.io/ratelimits:list",
        "gateway.kyma-project.io/ratelimits:watch",
        "gateway.kyma-project.io/ratelimits/status:patch",
        // Kyma's Istio resource, watched for its authorizers (tests/kubernetes_cluster/).
        "operator.kyma-project.io/istios:list",
        "operator.kyma-project.io/istios:watch",
        // Kyma's package registry Secrets, by name (resourceNames).
        "/secrets:list",
        "/secrets:watch",
        // Kyma's publisher alias replaced by a Function of its name (resourceNames), proven
        // against the real API server (tests/kubernetes_cluster/).
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

/// A Function's Deployment (answered with `deployment_answer` merged over what was applied),
/// Service and HPA applied, in that order.
fn workload_applied(rendered: &Rendered, deployment_answer: Value) -> Vec<Exchange> {
    vec![
        expect(
            Method::PATCH,
            format!("{}/reserve-stock{APPLY}", base("deployments")),
            applied(to_json(&rendered.deployment), deployment_answer),
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
    ]
}
