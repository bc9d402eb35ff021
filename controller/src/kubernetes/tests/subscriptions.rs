//! Tests: Subscriptions.

use super::*;

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
    let (client, server) = kube_mock::scripted(exchanges);
    let context = Arc::new(Context::new(client, config(), SinkPolicy::default()));
    let result = reconcile_subscription(Arc::new(subscription), context.clone()).await;
    drop(context);
    (
        result,
        server.await.expect("the API server saw what it expected"),
    )
}

#[tokio::test]
pub(super) async fn a_subscription_to_an_existing_service_is_ready_with_its_subjects() {
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
pub(super) async fn a_subscription_to_a_missing_service_is_not_ready_and_looked_at_again() {
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
pub(super) async fn a_sink_outside_the_namespace_or_the_policy_is_refused_in_status() {
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
