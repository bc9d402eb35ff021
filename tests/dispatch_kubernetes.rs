//! The dispatcher reading Subscription objects through the Kubernetes API (a mock API server
//! here: one list, then a watch whose events the test sends) and delivering with the same code
//! as in local mode, against a real nats-server and event-bus.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::{
    collections::BTreeSet,
    convert::Infallible,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use eddy_testing::eventually;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::StreamBody;
use kube::client::Body;
use serde_json::{Value, json};
use support::{Options, Platform, Sink};
use tokio::sync::mpsc;

type WatchBody = StreamBody<futures::stream::BoxStream<'static, Result<Frame<Bytes>, Infallible>>>;

/// A response body that streams what is sent on `rx`, ending when it closes.
fn streamed(rx: mpsc::Receiver<Bytes>) -> WatchBody {
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        let chunk = rx.recv().await?;
        Some((Ok(Frame::data(chunk)), rx))
    });
    StreamBody::new(Box::pin(stream))
}

fn subscription(sink: &str, types: &[&str], resource_version: &str) -> Value {
    json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
        "metadata": {"name": "on-order", "namespace": "default", "uid": "1", "resourceVersion": resource_version},
        "spec": {"sink": sink, "source": "shop", "types": types},
    })
}

/// The requests an API server got (method and URI), checked by the test once it is done: a
/// panic in the server's task would not fail the test.
type Requests = Arc<Mutex<Vec<(String, String)>>>;

/// Answers the watcher: the list with `initial`, then one watch that streams what the test
/// sends on the returned channel. Later requests (a re-watch) are left pending, anything but
/// Subscriptions gets 404. Records every request.
fn api_server(initial: Value) -> (kube::Client, mpsc::Sender<Value>, Requests) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<WatchBody>>();
    let (events, receiver) = mpsc::channel::<Value>(16);
    let requests = Requests::default();
    let recorded = requests.clone();
    tokio::spawn(async move {
        let mut receiver = Some(receiver);
        let mut pending = Vec::new();
        while let Some((request, send)) = handle.next_request().await {
            let uri = request.uri().to_string();
            recorded
                .lock()
                .unwrap()
                .push((request.method().to_string(), uri.clone()));
            if !uri.starts_with("/apis/eddy.dev/v1alpha1/subscriptions?") {
                let mut response = Response::new(streamed(mpsc::channel(1).1));
                *response.status_mut() = http::StatusCode::NOT_FOUND;
                send.send_response(response);
                continue;
            }
            if !uri.contains("watch=true") {
                let list = json!({
                    "apiVersion": "eddy.dev/v1alpha1", "kind": "SubscriptionList",
                    "metadata": {"resourceVersion": "1"}, "items": [initial.clone()],
                });
                let (tx, rx) = mpsc::channel(1);
                tx.send(Bytes::from(list.to_string())).await.unwrap();
                drop(tx);
                send.send_response(Response::new(streamed(rx)));
            } else if let Some(mut events) = receiver.take() {
                let (tx, rx) = mpsc::channel(16);
                send.send_response(Response::new(streamed(rx)));
                tokio::spawn(async move {
                    while let Some(event) = events.recv().await {
                        let line = format!("{event}\n");
                        if tx.send(Bytes::from(line)).await.is_err() {
                            return;
                        }
                    }
                    // Keep the watch open until the test ends.
                    tx.closed().await;
                });
            } else {
                pending.push(send);
            }
        }
    });
    (kube::Client::new(service, "default"), events, requests)
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

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut args = eddy_dispatcher::Args::new(addr, platform.nats.url());
    args.allowed_sinks = vec!["http://127.0.0.1:".to_owned()];
    args.subscriptions_from = eddy_dispatcher::SubscriptionsFrom::Kubernetes;
    let shutdown = eddy_platform::shutdown::CancellationToken::new();
    let dispatcher =
        eddy_dispatcher::Dispatcher::with_kubernetes(args, Some(client), shutdown.clone())
            .await
            .unwrap();
    tokio::spawn(dispatcher.serve(listener));

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
    let template = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("charts/eddy/templates/dispatcher.yaml"),
    )
    .unwrap();
    let requests = requests.lock().unwrap().clone();
    let unexpected: Vec<_> = requests
        .iter()
        .filter(|(_, uri)| !uri.starts_with("/apis/eddy.dev/v1alpha1/subscriptions?"))
        .collect();
    assert!(unexpected.is_empty(), "unexpected requests: {unexpected:?}");
    let used: BTreeSet<String> = requests
        .iter()
        .flat_map(|(method, uri)| eddy_testing::rbac::needed_by(method, uri))
        .collect();
    assert_eq!(
        eddy_testing::rbac::granted_by_cluster_role(&template),
        used,
        "the chart's dispatcher ClusterRole and the dispatcher's requests"
    );
}
