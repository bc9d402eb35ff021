//! Tests: The Function lifecycle.

use super::*;

#[tokio::test]
pub(super) async fn first_reconcile_creates_the_config_map_and_the_build_job() {
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
pub(super) async fn a_running_build_is_left_alone() {
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
pub(super) async fn job_success_applies_the_deployment_service_and_autoscaler_and_cleans_up() {
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
    let (result, bodies) = run_function(
        function.clone(),
        [
            built_then_workload_applied(&rendered, &job_name, job, 1),
            vec![
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
        ]
        .into_iter()
        .flatten()
        .collect(),
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
pub(super) async fn job_failure_puts_the_build_log_into_build_ready_and_waits_to_retry() {
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
pub(super) async fn a_failed_build_is_tried_again_once_its_delay_has_passed() {
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
pub(super) async fn a_retried_build_keeps_its_failure_count_and_a_new_source_builds_at_once() {
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
pub(super) async fn a_source_change_starts_a_new_build_with_a_new_tag_and_keeps_the_old_one_running()
 {
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
pub(super) async fn a_scale_change_builds_nothing_and_drops_the_autoscaler() {
    let function = function(json!({"scaleConfig": null, "replicas": 2}));
    let rendered = render(&function, &config()).expect("renders");
    assert!(rendered.autoscaler.is_none());
    let job_name = format!("reserve-stock-build-{}", rendered.hash);
    let job = job_with_status(&rendered, json!({"succeeded": 1}));
    let mut exchanges = built_without_an_autoscaler(&rendered, &job_name, job, 2);
    exchanges.push(function_status_write(&function));
    let (result, bodies) = run_function(function.clone(), exchanges).await;
    assert_eq!(result.expect("reconciled"), Action::requeue(RESYNC));
    assert_eq!(bodies[1]["spec"]["replicas"], 2);
    assert_eq!(bodies[6]["status"]["replicas"], 2);
}

/// Every change of a Function's Deployment reconciles the Function again. The second reconcile
/// of the same Function applies its Deployment (whose state it reports) and nothing else: not
/// the Service, not the HPA's deletion, not the search for superseded builds. A new leadership
/// term writes them again.
#[tokio::test]
pub(super) async fn a_second_reconcile_of_the_same_function_writes_only_its_deployment() {
    let function = function(json!({"scaleConfig": null, "replicas": 2}));
    let rendered = render(&function, &config()).expect("renders");
    let job_name = format!("reserve-stock-build-{}", rendered.hash);
    let job = || job_with_status(&rendered, json!({"succeeded": 1}));
    let everything = || built_without_an_autoscaler(&rendered, &job_name, job(), 2).into_iter();
    let settled = with_status(function.clone(), &json!({"replicas": 2, "conditions": []}));
    let mut first = everything().collect::<Vec<_>>();
    first.push(function_status_write(&function));
    let mut second = built_then_workload_applied(&rendered, &job_name, job(), 2);
    second.truncate(2);
    second.push(function_status_write(&function));
    let term = everything().chain([function_status_write(&function)]);
    let (client, server) =
        kube_mock::scripted(first.into_iter().chain(second).chain(term).collect());
    let mut context = Context::new(client, config(), SinkPolicy::default());
    context.clock = test_now;
    let context = Arc::new(context);
    for _ in 0..2 {
        reconcile_function(Arc::new(settled.clone()), context.clone())
            .await
            .expect("reconciled");
    }
    context.written.clear();
    reconcile_function(Arc::new(settled), context.clone())
        .await
        .expect("reconciled");
    drop(context);
    server.await.expect("the API server saw what it expected");
}

#[tokio::test]
pub(super) async fn an_unchanged_status_is_not_written_again() {
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
pub(super) async fn a_refused_apply_goes_to_status_and_a_transient_error_is_retried() {
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
        vec![expect(
            Method::GET,
            format!("{}/{job_name}", base("jobs")),
            unavailable,
        )],
    )
    .await;
    let error = result.expect_err("a transient error is returned for a retry");
    assert!(!is_permanent(&error));
}

/// Retried errors that keep coming back are said in status once the retries pass
/// [`REPORT_RETRIES_AFTER`], and the error still goes back for the next retry.
#[tokio::test]
async fn an_error_retried_again_and_again_is_said_in_status() {
    let function = function(json!({}));
    let rendered = render(&function, &config()).expect("renders");
    let job_name = format!("reserve-stock-build-{}", rendered.hash);
    let jobs = format!("{}/{job_name}", base("jobs"));
    // Up to the limit, nothing is written: the API server saw the one GET.
    let (result, _) = run_function_after_failures(
        function.clone(),
        REPORT_RETRIES_AFTER - 1,
        vec![expect(Method::GET, jobs.clone(), unavailable)],
    )
    .await;
    assert!(!is_permanent(&result.expect_err("retried")));
    let (result, bodies) = run_function_after_failures(
        function.clone(),
        REPORT_RETRIES_AFTER,
        vec![
            expect(Method::GET, jobs, unavailable),
            function_status_write(&function),
        ],
    )
    .await;
    assert!(!is_permanent(&result.expect_err("still retried")));
    let running = condition_of(&bodies[1]["status"], "Running");
    assert_eq!(running["status"], "Unknown", "{running}");
    assert_eq!(running["reason"], "ApplyFailed", "{running}");
    let message = running["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with(&format!(
            "{} attempts failed, retrying: ",
            REPORT_RETRIES_AFTER + 1
        )) && message.contains("etcd leader changed"),
        "{message}"
    );
}

/// What lets Kubernetes' garbage collector delete what a Function owns: every rendered object
/// carries a controller owner reference to it, and none a finalizer that could hold the delete
/// up. (The collection itself is shown on the real node, by kube-controller-manager's garbage
/// collector: `tests/real_pods/`, `a_new_controller_pod_reconciles_and_a_deleted_function_leaves_nothing_behind`.)
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

/// [`built_then_workload_applied`] for a Function with no autoscaler: then the HPA deleted
/// (none there) and no superseded build found.
fn built_without_an_autoscaler(
    rendered: &Rendered,
    job_name: &str,
    job: Value,
    replicas: i32,
) -> Vec<Exchange> {
    let superseded = format!(
        "?&labelSelector=eddy.dev%2Ffunction%3Dreserve-stock%2Ceddy.dev%2Fbuild-hash%21%3D{}",
        rendered.hash
    );
    let mut exchanges = built_then_workload_applied(rendered, job_name, job, replicas);
    exchanges.extend([
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
    ]);
    exchanges
}

/// The reconcile of a Function whose build Job (`job`) is done: the Job read, then its
/// Deployment (answered ready with `replicas`) and Service applied.
fn built_then_workload_applied(
    rendered: &Rendered,
    job_name: &str,
    job: Value,
    replicas: i32,
) -> Vec<Exchange> {
    let deployment = to_json(&rendered.deployment);
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
                    deployment_ready(i64::from(replicas), replicas),
                    json!({"metadata": deployment["metadata"].clone()}),
                ),
            ),
        ),
        expect(
            Method::PATCH,
            format!("{}/reserve-stock{APPLY}", base("services")),
            applied(to_json(&rendered.service), json!({})),
        ),
    ]
}
