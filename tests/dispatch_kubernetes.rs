//! The dispatcher reading Subscription objects through the Kubernetes API (a mock API server
//! here: one list, then a watch whose events the test sends) and delivering with the same code
//! as in local mode, against a real nats-server and event-bus.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::{collections::BTreeSet, time::Duration};

use eddy_testing::{
    eventually,
    kube_mock::{self, Requests},
};
use serde_json::{Value, json};
use support::{Options, Platform, Sink};
use tokio::sync::mpsc;

fn subscription(sink: &str, types: &[&str], resource_version: &str) -> Value {
    json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
        "metadata": {"name": "on-order", "namespace": "default", "uid": "1", "resourceVersion": resource_version},
        "spec": {"sink": sink, "source": "shop", "types": types},
    })
}

fn api_server(initial: Value) -> (kube::Client, mpsc::Sender<Value>, Requests) {
    let (client, mut watches, requests) = kube_mock::watching(
        std::iter::once(subscriptions(initial))
            .chain(scaler_watches())
            .collect(),
    );
    (client, watches.remove(0), requests)
}

/// eddy's Subscriptions, `initial` listed.
fn subscriptions(initial: Value) -> kube_mock::Watched {
    kube_mock::Watched {
        list_path: "/apis/eddy.dev/v1alpha1/subscriptions?",
        list_kind: "SubscriptionList",
        initial: vec![initial],
    }
}

/// The scaler's watches, with nothing listed (no Function here scales to zero): the
/// Deployments labelled to scale to zero, and the gateway's calls Leases.
fn scaler_watches() -> [kube_mock::Watched; 2] {
    let nothing = |list_path, list_kind| kube_mock::Watched {
        list_path,
        list_kind,
        initial: Vec::new(),
    };
    [
        nothing("/apis/apps/v1/deployments?", "DeploymentList"),
        nothing("/apis/coordination.k8s.io/v1/leases?", "LeaseList"),
    ]
}

/// What the chart grants the dispatcher beyond what these tests make it ask: changing a
/// Deployment's scale, which the real-pod tests exercise with the chart's own RBAC
/// (tests/real_pods/scale.rs).
fn scaling_grants() -> BTreeSet<String> {
    [
        "apps/deployments/scale:get",
        "apps/deployments/scale:update",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect()
}

/// A dispatcher reading Subscriptions through `client` (and Kyma's with `kyma`), delivering
/// to local sinks; stopped by the returned token.
async fn start_dispatcher(
    platform: &Platform,
    client: kube::Client,
    kyma: bool,
) -> eddy_platform::shutdown::CancellationToken {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut args = eddy_dispatcher::Args::new(addr, platform.nats.url());
    args.sinks.allowed_sinks = vec!["http://127.0.0.1:".parse().unwrap()];
    args.subscriptions_from = eddy_dispatcher::SubscriptionsFrom::Kubernetes;
    args.kyma_compatibility = kyma;
    let shutdown = eddy_platform::shutdown::CancellationToken::new();
    let dispatcher =
        eddy_dispatcher::Dispatcher::with_kubernetes(args, Some(client), shutdown.clone())
            .await
            .unwrap();
    tokio::spawn(dispatcher.serve(listener));
    shutdown
}

#[tokio::test]
async fn subscriptions_from_kubernetes_are_delivered_updated_and_removed() {
    let platform = Platform::start_with(Options {
        dispatcher: false,
        ..Options::default()
    })
    .await;
    let sink = Sink::ok().await;
    let (client, watch, requests) = api_server(subscription(&sink.url, &["order.created.v1"], "1"));
    let shutdown = start_dispatcher(&platform, client, false).await;

    // The listed Subscription gets its consumer, and its events are delivered once each.
    eventually(
        "the consumer of the listed subscription",
        Duration::from_secs(20),
        || async { platform.consumer_info("on-order").await.is_some() },
    )
    .await
    .unwrap();
    for i in 0..20 {
        platform
            .publish(
                "shop",
                "order.created.v1",
                &format!("c-{i}"),
                json!({"n": i}),
            )
            .await;
    }
    sink.wait_for(20).await;
    platform.wait_settled("on-order").await;
    // Each id once: duplicates are not hidden.
    let mut ids = sink.ids();
    ids.sort();
    let mut expected: Vec<String> = (0..20).map(|i| format!("c-{i}")).collect();
    expected.sort();
    assert_eq!(ids, expected);

    // A change to the object updates the consumer's filter in place.
    watch
        .send(
            json!({"type": "MODIFIED", "object": subscription(&sink.url, &["order.paid.v1"], "2")}),
        )
        .await
        .unwrap();
    eventually(
        "the consumer filter to follow the object",
        Duration::from_secs(20),
        || async {
            platform
                .consumer_info("on-order")
                .await
                .is_some_and(|info| {
                    info.config.filter_subjects == vec!["eddy.events.shop.order.paid.v1".to_owned()]
                })
        },
    )
    .await
    .unwrap();
    platform
        .publish("shop", "order.paid.v1", "p-1", json!({}))
        .await;
    platform
        .publish("shop", "order.created.v1", "c-after", json!({}))
        .await;
    sink.wait_for(21).await;
    platform.wait_settled("on-order").await;
    let last: Vec<String> = sink.ids().into_iter().skip(20).collect();
    assert_eq!(last, vec!["p-1".to_owned()]);

    // Deleting the object removes its consumer.
    watch
        .send(
            json!({"type": "DELETED", "object": subscription(&sink.url, &["order.paid.v1"], "3")}),
        )
        .await
        .unwrap();
    eventually(
        "the consumer to go with its subscription",
        Duration::from_secs(20),
        || async { platform.consumer_info("on-order").await.is_none() },
    )
    .await
    .unwrap();
    shutdown.cancel();

    // The chart's ClusterRole for the dispatcher grants exactly what these requests needed.
    let rendered = eddy_testing::rbac::rendered("dispatcher.yaml", &[]).unwrap();
    let requests = requests.lock().unwrap().clone();
    let unexpected: Vec<_> = requests
        .iter()
        .filter(|(_, uri)| {
            ![
                "/apis/eddy.dev/v1alpha1/subscriptions?",
                "/apis/apps/v1/deployments?",
                "/apis/coordination.k8s.io/v1/leases?",
            ]
            .iter()
            .any(|path| uri.starts_with(path))
        })
        .collect();
    assert!(unexpected.is_empty(), "unexpected requests: {unexpected:?}");
    let used: BTreeSet<String> = requests
        .iter()
        .flat_map(|(method, uri)| eddy_testing::rbac::needed_by(method, uri))
        .chain(scaling_grants())
        .collect();
    // Without `kymaCompatibility`, nothing of Kyma's group (the test below turns it on).
    let granted = eddy_testing::rbac::granted_by_cluster_role(&rendered);
    assert_eq!(
        granted, used,
        "the chart's dispatcher ClusterRole and the dispatcher's requests"
    );
}

/// With `kymaCompatibility`, Kyma's Subscriptions (as Kyma writes them: a string
/// `maxInFlightMessages`) are delivered for beside eddy's, by the same code.
#[tokio::test]
async fn kyma_subscriptions_are_delivered_beside_eddy_s() {
    let platform = Platform::start_with(Options {
        dispatcher: false,
        ..Options::default()
    })
    .await;
    let sink = Sink::ok().await;
    let kyma = json!({
        "apiVersion": "eventing.kyma-project.io/v1alpha2", "kind": "Subscription",
        "metadata": {"name": "on-payment", "namespace": "default", "uid": "2", "resourceVersion": "1"},
        "spec": {"sink": sink.url, "source": "shop", "types": ["order.paid.v1"],
                 "config": {"maxInFlightMessages": "5"}},
    });
    let (client, _watches, requests) = kube_mock::watching(
        [
            subscriptions(subscription(&sink.url, &["order.created.v1"], "1")),
            kube_mock::Watched {
                list_path: "/apis/eventing.kyma-project.io/v1alpha2/subscriptions?",
                list_kind: "SubscriptionList",
                initial: vec![kyma],
            },
        ]
        .into_iter()
        .chain(scaler_watches())
        .collect(),
    );
    let shutdown = start_dispatcher(&platform, client, true).await;
    for name in ["on-order", "on-payment"] {
        eventually(
            "a consumer for each kind's subscription",
            Duration::from_secs(20),
            || async { platform.consumer_info(name).await.is_some() },
        )
        .await
        .unwrap();
    }
    let payment = platform.consumer_info("on-payment").await.unwrap();
    assert_eq!(payment.config.max_ack_pending, 5, "Kyma's string limit");
    platform
        .publish("shop", "order.created.v1", "c-1", json!({}))
        .await;
    platform
        .publish("shop", "order.paid.v1", "p-1", json!({}))
        .await;
    sink.wait_for(2).await;
    // Settled first: a duplicate delivered late is seen.
    platform.wait_settled("on-order").await;
    platform.wait_settled("on-payment").await;
    let mut ids = sink.ids();
    ids.sort();
    assert_eq!(ids, vec!["c-1".to_owned(), "p-1".to_owned()]);
    shutdown.cancel();

    let rendered =
        eddy_testing::rbac::rendered("dispatcher.yaml", &["kymaCompatibility.enabled=true"])
            .unwrap();
    let used: BTreeSet<String> = requests
        .lock()
        .unwrap()
        .iter()
        .flat_map(|(method, uri)| eddy_testing::rbac::needed_by(method, uri))
        .chain(scaling_grants())
        .collect();
    assert_eq!(
        eddy_testing::rbac::granted_by_cluster_role(&rendered),
        used,
        "the chart's dispatcher ClusterRole (with kymaCompatibility) and the dispatcher's requests"
    );
}
