//! The Kubernetes backend against a real cluster (the current kubeconfig context), with Kaniko
//! building into `EDDY_TEST_REGISTRY` (default `localhost:5000`, e.g. kind's local registry).
//! Run with `cargo test --test kubernetes_cluster -- --ignored`. The controller runs in this
//! process; the CRDs are applied first.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{sync::Arc, time::Duration};

use eddy_model::resources::{Function, SinkPolicy, Subscription};
use eddy_testing::eventually;
use k8s_openapi::{
    api::{apps::v1::Deployment, core::v1::Namespace},
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{
    Api, Client, CustomResourceExt as _,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use serde_json::json;

const NAMESPACE: &str = "eddy-cluster-test";

async fn setup() -> (Client, eddy_platform::shutdown::CancellationToken) {
    let client = Client::try_default()
        .await
        .expect("a cluster in the kubeconfig");
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let apply = PatchParams::apply("eddy-tests").force();
    for crd in [Function::crd(), Subscription::crd()] {
        let name = crd.metadata.name.clone().unwrap();
        crds.patch(&name, &apply, &Patch::Apply(&crd))
            .await
            .unwrap();
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let namespace =
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}});
    namespaces
        .patch(NAMESPACE, &apply, &Patch::Apply(&namespace))
        .await
        .unwrap();
    let shutdown = eddy_platform::shutdown::CancellationToken::new();
    let args = eddy_controller::KubernetesArgs {
        registry: std::env::var("EDDY_TEST_REGISTRY").unwrap_or_else(|_| "localhost:5000".into()),
        insecure_registry: true,
        ..Default::default()
    };
    let context = Arc::new(eddy_controller::kubernetes::Context::new(
        client.clone(),
        args.render_config(),
        SinkPolicy::default(),
    ));
    tokio::spawn(eddy_controller::kubernetes::run(
        client.clone(),
        context,
        shutdown.clone(),
    ));
    (client, shutdown)
}

fn function(name: &str, spec: serde_json::Value) -> Function {
    serde_json::from_value(json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }))
    .unwrap()
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn the_api_server_refuses_what_local_validation_refuses() {
    let (client, shutdown) = setup().await;
    let functions: Api<Function> = Api::namespaced(client, NAMESPACE);
    let invalid = function(
        "bad-scale",
        json!({"runtime": "nodejs20", "source": {"inline": {"source": "x"}},
               "scaleConfig": {"minReplicas": 3, "maxReplicas": 2}, "env": [{"name": "FUNC_NAME", "value": "x"}]}),
    );
    let error = functions
        .create(&PostParams::default(), &invalid)
        .await
        .unwrap_err();
    let kube::Error::Api(status) = error else {
        panic!("{error}")
    };
    assert_eq!(status.code, 422);
    assert!(status.message.contains("maxReplicas"), "{}", status.message);
    assert!(
        status.message.contains("is set by the platform"),
        "{}",
        status.message
    );
    shutdown.cancel();
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn a_function_is_built_runs_and_goes_with_everything_it_owns() {
    let (client, shutdown) = setup().await;
    let functions: Api<Function> = Api::namespaced(client.clone(), NAMESPACE);
    let hello = function(
        "hello",
        json!({"runtime": "nodejs20", "source": {"inline": {"source": "module.exports = { main: () => 'hello' }"}}}),
    );
    functions
        .create(&PostParams::default(), &hello)
        .await
        .unwrap();
    eventually("the function to run", Duration::from_secs(600), || async {
        functions
            .get("hello")
            .await
            .ok()
            .and_then(|f| f.status)
            .is_some_and(|status| {
                status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Running" && c.status == "True")
            })
    })
    .await
    .unwrap();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NAMESPACE);
    let deployment = deployments.get("hello").await.unwrap();
    let owner = &deployment.metadata.owner_references.unwrap()[0];
    assert_eq!(owner.kind, "Function");

    functions
        .delete("hello", &DeleteParams::foreground())
        .await
        .unwrap();
    eventually(
        "the garbage collector to remove the Deployment",
        Duration::from_secs(120),
        || async {
            deployments
                .get_opt("hello")
                .await
                .is_ok_and(|d| d.is_none())
        },
    )
    .await
    .unwrap();
    shutdown.cancel();
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn a_subscription_waits_for_its_sink_service() {
    let (client, shutdown) = setup().await;
    let subscriptions: Api<Subscription> = Api::namespaced(client, NAMESPACE);
    let subscription: Subscription = serde_json::from_value(json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
        "metadata": {"name": "to-nowhere", "namespace": NAMESPACE},
        "spec": {"sink": format!("http://nowhere.{NAMESPACE}.svc.cluster.local"), "types": ["order.created.v1"]},
    }))
    .unwrap();
    let _ = subscriptions
        .delete("to-nowhere", &DeleteParams::default())
        .await;
    subscriptions
        .create(&PostParams::default(), &subscription)
        .await
        .unwrap();
    eventually(
        "the SinkNotFound status",
        Duration::from_secs(60),
        || async {
            subscriptions
                .get("to-nowhere")
                .await
                .ok()
                .and_then(|s| s.status)
                .is_some_and(|status| {
                    !status.ready && status.conditions.iter().any(|c| c.reason == "SinkNotFound")
                })
        },
    )
    .await
    .unwrap();
    subscriptions
        .delete("to-nowhere", &DeleteParams::default())
        .await
        .unwrap();
    shutdown.cancel();
}
