//! The controller: the examples reach Running under the chart's RBAC, builds follow the source, deleted Functions leave nothing, scaling, privileges refused, and fields taken back.

use super::*;

/// examples/shop and examples/kyma, applied with kubectl into a namespace of the test's
/// choosing, reach Running under the chart's RBAC, with every child object owned.
#[tokio::test]
async fn the_examples_reach_running_under_the_charts_rbac() {
    let _serial = serial().await;
    let cluster = Cluster::new("examples").await;
    let controller = cluster.controller().await;
    cluster.kubectl_apply(&cluster.example("shop")).unwrap();
    cluster.kubectl_apply(&cluster.example("kyma")).unwrap();
    let shop = ["stock-reserver", "reservation-recorder", "price-quote"];
    let kyma = ["greeter", "orders", "audit", "db-info"];
    for name in shop {
        cluster
            .wait_running("eddy.dev/v1alpha1", name, Duration::from_secs(60))
            .await;
    }
    for name in kyma {
        cluster
            .wait_running(
                "serverless.kyma-project.io/v1alpha2",
                name,
                Duration::from_secs(60),
            )
            .await;
    }
    let deployments: Api<Deployment> = cluster.api();
    let services: Api<Service> = cluster.api();
    let jobs: Api<Job> = cluster.api();
    let config_maps: Api<ConfigMap> = cluster.api();
    for name in shop.iter().chain(&kyma) {
        let deployment = deployments.get(name).await.unwrap();
        let owner = &deployment.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(owner.kind, "Function", "{name}");
        assert_eq!(owner.controller, Some(true), "{name}");
        let service = services.get(name).await.unwrap();
        assert_eq!(service.metadata.owner_references.unwrap()[0].name, *name);
        let selector = format!("eddy.dev/function={name}");
        let built = jobs
            .list(&ListParams::default().labels(&selector))
            .await
            .unwrap();
        assert!(!built.items.is_empty(), "{name} has a build Job");
        let sources = config_maps
            .list(&ListParams::default().labels(&selector))
            .await
            .unwrap();
        assert!(!sources.items.is_empty(), "{name} has a ConfigMap");
    }
    // The greeter keeps Kyma's FUNC_TIMEOUT.
    let greeter = deployments.get("greeter").await.unwrap();
    let env = greeter.spec.template.spec.unwrap().containers[0]
        .env
        .clone()
        .unwrap();
    let timeout = env.iter().find(|var| var.name == "FUNC_TIMEOUT").unwrap();
    assert_eq!(timeout.value.as_deref(), Some("10"));
    // An autoscaled function has its HPA.
    let hpas: Api<HorizontalPodAutoscaler> = cluster.api();
    let orders = hpas.get("orders").await.unwrap();
    assert_eq!(orders.spec.max_replicas, 3);
    // The chart's RBAC let the controller do all of it.
    cluster.assert_no_rbac_refusal();
    drop(controller);
    cluster.finish().await;
}

/// A changed source gets a new build Job and a rollout; a scale change gets none; a failed
/// build gives BuildFailed and is tried again later.
#[tokio::test]
async fn builds_follow_the_source_and_a_failed_build_is_reported() {
    let _serial = serial().await;
    let cluster = Cluster::new("builds").await;
    let _controller = cluster.controller().await;
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    let apply = PatchParams::apply("test").force();
    let hello = function("hello", inline("module.exports = {main: () => 'one'}"));
    functions
        .patch("hello", &apply, &Patch::Apply(&hello))
        .await
        .unwrap();
    cluster
        .wait_running("eddy.dev/v1alpha1", "hello", Duration::from_secs(60))
        .await;
    let jobs: Api<Job> = cluster.api();
    let deployments: Api<Deployment> = cluster.api();
    let selector = ListParams::default().labels("eddy.dev/function=hello");
    let first_image = image_of(&deployments.get("hello").await.unwrap());
    assert_eq!(jobs.list(&selector).await.unwrap().items.len(), 1);

    // A scale change: no new build, the same image, the new replica count.
    let mut scaled = hello.clone();
    scaled["spec"]["replicas"] = json!(2);
    functions
        .patch("hello", &apply, &Patch::Apply(&scaled))
        .await
        .unwrap();
    eventually(
        "the Deployment scaled to 2",
        Duration::from_secs(30),
        || async {
            deployments
                .get("hello")
                .await
                .is_ok_and(|d| d.spec.replicas == Some(2))
        },
    )
    .await
    .unwrap();
    assert_eq!(
        jobs.list(&selector).await.unwrap().items.len(),
        1,
        "no build for a scale change"
    );
    assert_eq!(
        image_of(&deployments.get("hello").await.unwrap()),
        first_image
    );

    // A changed source: a new Job, then the Deployment rolls to its image.
    let mut changed = scaled.clone();
    changed["spec"]["source"]["inline"]["source"] = json!("module.exports = {main: () => 'two'}");
    functions
        .patch("hello", &apply, &Patch::Apply(&changed))
        .await
        .unwrap();
    eventually(
        "the Deployment on a new image",
        Duration::from_secs(60),
        || async {
            deployments
                .get("hello")
                .await
                .is_ok_and(|d| image_of(&d) != first_image)
        },
    )
    .await
    .unwrap();
    cluster
        .wait_running("eddy.dev/v1alpha1", "hello", Duration::from_secs(60))
        .await;

    // A build that fails (the test node fails every build pod of a Function named build-fails).
    let failing = function("build-fails", inline("module.exports = {main: () => 'x'}"));
    functions
        .patch("build-fails", &apply, &Patch::Apply(&failing))
        .await
        .unwrap();
    eventually("BuildFailed", Duration::from_secs(60), || async {
        cluster
            .condition("eddy.dev/v1alpha1", "build-fails", "BuildReady")
            .await
            .is_some_and(|(status, reason, _)| status == "False" && reason == "BuildFailed")
    })
    .await
    .unwrap();
    let (_, _, message) = cluster
        .condition("eddy.dev/v1alpha1", "build-fails", "BuildReady")
        .await
        .unwrap();
    assert!(
        message.contains("the build failed (test node)"),
        "{message}"
    );
    assert!(
        message.contains("trying again at"),
        "the retry is announced: {message}"
    );
    let failed = functions.get("build-fails").await.unwrap();
    assert_eq!(
        failed.data["status"]["buildFailures"], 1,
        "{:#?}",
        failed.data
    );
    cluster.finish().await;
}

pub(crate) fn image_of(deployment: &Deployment) -> String {
    deployment.spec.template.spec.as_ref().unwrap().containers[0]
        .image
        .clone()
        .unwrap()
}

/// `kubectl scale` sets the Function's replicas through the scale subresource; an HPA can
/// target the Function (the controller-manager reads its scale). kwok runs no container, so
/// nothing scales on load here: `tests/real_pods/`,
/// `an_autoscaled_function_scales_out_on_cpu_load_through_metrics_server`, does that.
#[tokio::test]
async fn kubectl_scale_sets_a_function_s_replicas_and_an_hpa_can_target_its_scale() {
    let _serial = serial().await;
    let cluster = Cluster::new("scale").await;
    let _controller = cluster.controller().await;
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    functions
        .patch(
            "scaled",
            &PatchParams::apply("test"),
            &Patch::Apply(function(
                "scaled",
                inline("module.exports = {main: () => 1}"),
            )),
        )
        .await
        .unwrap();
    cluster
        .wait_running("eddy.dev/v1alpha1", "scaled", Duration::from_secs(60))
        .await;
    let kubectl_scale = |replicas: &str| {
        run(cluster
            .plane
            .kubectl()
            .unwrap()
            .args([
                "scale",
                "functions.eddy.dev/scaled",
                "--replicas",
                replicas,
                "-n",
            ])
            .arg(&cluster.namespace))
        .unwrap();
    };
    kubectl_scale("3");
    let deployments: Api<Deployment> = cluster.api();
    eventually(
        "the Deployment at 3 replicas",
        Duration::from_secs(30),
        || async {
            deployments
                .get("scaled")
                .await
                .is_ok_and(|d| d.status.and_then(|s| s.ready_replicas) == Some(3))
        },
    )
    .await
    .unwrap();
    eventually("status.replicas 3", Duration::from_secs(30), || async {
        functions
            .get("scaled")
            .await
            .is_ok_and(|f| f.data["status"]["replicas"] == 3)
    })
    .await
    .unwrap();
    let scale = run(cluster
        .plane
        .kubectl()
        .unwrap()
        .args(["get", "--raw"])
        .arg(format!(
            "/apis/eddy.dev/v1alpha1/namespaces/{}/functions/scaled/scale",
            cluster.namespace
        )))
    .unwrap();
    let scale: Value = serde_json::from_str(&scale).unwrap();
    assert_eq!(
        scale["status"]["selector"], "eddy.dev/function=scaled",
        "{scale:#}"
    );
    // An HPA whose target is the Function: the API server accepts it and the controller-manager
    // reads the Function's scale subresource for it.
    let hpas: Api<HorizontalPodAutoscaler> = cluster.api();
    let hpa: HorizontalPodAutoscaler = serde_json::from_value(json!({
        "metadata": {"name": "scaled-by-keda-like"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "eddy.dev/v1alpha1", "kind": "Function", "name": "scaled"},
            "minReplicas": 1, "maxReplicas": 4,
            "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 50}}}]
        }
    }))
    .unwrap();
    hpas.create(&PostParams::default(), &hpa).await.unwrap();
    eventually(
        "the HPA reading the Function's scale",
        Duration::from_secs(60),
        || async {
            hpas.get("scaled-by-keda-like").await.is_ok_and(|h| {
                h.status.is_some_and(|s| {
                    s.current_replicas == Some(3)
                        || s.conditions
                            .iter()
                            .flatten()
                            .any(|c| c.type_ == "AbleToScale" && c.status == "True")
                })
            })
        },
    )
    .await
    .unwrap();
    // Scaled to zero: the Deployment follows and Running says so.
    kubectl_scale("0");
    eventually(
        "the Deployment at 0 replicas and Running ScaledToZero",
        Duration::from_secs(30),
        || async {
            deployments
                .get("scaled")
                .await
                .is_ok_and(|d| d.spec.replicas == Some(0))
                && cluster
                    .condition("eddy.dev/v1alpha1", "scaled", "Running")
                    .await
                    .is_some_and(|(_, reason, _)| reason == "ScaledToZero")
        },
    )
    .await
    .unwrap();
    cluster.finish().await;
}

/// A Function whose security contexts ask for more than the operator's Pod Security level
/// (`restricted` by default) is not deployed: ConfigurationReady names each field, and the
/// version already running keeps running as it was.
#[tokio::test]
async fn a_function_asking_for_privileges_is_refused_and_its_running_version_kept() {
    let _serial = serial().await;
    let cluster = Cluster::new("privileges").await;
    let _controller = cluster.controller().await;
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    let apply = |spec: Value| {
        let functions = functions.clone();
        async move {
            functions
                .patch(
                    "greedy",
                    &PatchParams::apply("test"),
                    &Patch::Apply(function("greedy", spec)),
                )
                .await
                .unwrap();
        }
    };
    apply(inline("module.exports = {main: () => 'plain'}")).await;
    cluster
        .wait_running("eddy.dev/v1alpha1", "greedy", Duration::from_secs(60))
        .await;
    let deployments: Api<Deployment> = cluster.api();
    let before = deployments.get("greedy").await.unwrap();
    let mut spec = inline("module.exports = {main: () => 'root'}");
    spec["containerSecurityContext"] = json!({"privileged": true,
        "capabilities": {"add": ["SYS_ADMIN"]}});
    spec["podSecurityContext"] = json!({"runAsUser": 0});
    apply(spec).await;
    let refused = eventually(
        "ConfigurationReady False, SecurityContextRefused",
        Duration::from_secs(30),
        || async {
            cluster
                .condition("eddy.dev/v1alpha1", "greedy", "ConfigurationReady")
                .await
                .is_some_and(|(status, reason, _)| {
                    status == "False" && reason == "SecurityContextRefused"
                })
        },
    )
    .await;
    let condition = cluster
        .condition("eddy.dev/v1alpha1", "greedy", "ConfigurationReady")
        .await;
    refused.unwrap_or_else(|error| panic!("{error}: {condition:?}"));
    let (_, _, message) = condition.unwrap();
    for field in ["privileged", "SYS_ADMIN", "runAsUser"] {
        assert!(message.contains(field), "{field} not named: {message}");
    }
    let after = deployments.get("greedy").await.unwrap();
    assert_eq!(
        serde_json::to_value(&after.spec).unwrap(),
        serde_json::to_value(&before.spec).unwrap(),
        "the running version's Deployment was changed"
    );
    cluster.finish().await;
}

/// A field another manager set on a child: the controller applies with force, so the fields it
/// owns (the Deployment's replicas) are taken back at its next reconcile, and fields it does not
/// set (another tool's annotation) are left alone.
#[tokio::test]
async fn the_controller_takes_back_its_fields_and_leaves_the_rest() {
    let _serial = serial().await;
    let cluster = Cluster::new("fields").await;
    let controller = cluster.controller().await;
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    let mut spec = inline("module.exports = {main: () => 'owned'}");
    spec["replicas"] = json!(1);
    functions
        .patch(
            "owned",
            &PatchParams::apply("test"),
            &Patch::Apply(function("owned", spec)),
        )
        .await
        .unwrap();
    cluster
        .wait_running("eddy.dev/v1alpha1", "owned", Duration::from_secs(60))
        .await;
    let kubectl = |args: &[&str]| {
        let mut command = cluster.plane.kubectl().unwrap();
        command.args(args).arg("-n").arg(&cluster.namespace);
        run(&mut command).unwrap()
    };
    kubectl(&["annotate", "deployment", "owned", "example.com/team=shop"]);
    kubectl(&["scale", "deployment", "owned", "--replicas", "3"]);
    let deployments: Api<Deployment> = cluster.api();
    eventually(
        "the replicas taken back",
        Duration::from_secs(30),
        || async {
            deployments.get("owned").await.is_ok_and(|d| {
                d.spec.replicas == Some(1)
                    && d.metadata.managed_fields.iter().flatten().any(|f| {
                        f.manager.as_deref() == Some("eddy-controller")
                            && f.fields_v1
                                .as_ref()
                                .is_some_and(|v| v.0["f:spec"]["f:replicas"].is_object())
                    })
            })
        },
    )
    .await
    .unwrap();
    let deployment = deployments.get("owned").await.unwrap();
    assert_eq!(
        deployment
            .metadata
            .annotations
            .unwrap_or_default()
            .get("example.com/team")
            .map(String::as_str),
        Some("shop"),
        "another manager's annotation is kept"
    );
    cluster.assert_no_rbac_refusal();
    drop(controller);
    cluster.finish().await;
}
