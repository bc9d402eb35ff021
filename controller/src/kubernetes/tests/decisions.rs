//! Tests: Pure decisions.

use super::*;

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
/// `tests/kubernetes_cluster/`, `kubectl_scale_sets_a_function_s_replicas_and_an_hpa_can_target_its_scale`.)
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
