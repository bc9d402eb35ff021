//! Tests: Kyma's kinds (kymaCompatibility).

use super::*;

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
    let (client, server) = kube_mock::scripted(exchanges);
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
pub(super) async fn a_kyma_function_is_built_by_the_same_code_and_owns_its_objects() {
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
pub(super) async fn a_kyma_function_eddy_cannot_read_says_why_in_its_status() {
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
pub(super) async fn a_kyma_subscription_gets_its_status_from_the_same_code() {
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
pub(super) async fn an_apirule_gets_kymas_status_judged_among_the_others() {
    let older = api_rule("orders", "2026-01-01T00:00:00Z", &["orders"]);
    let newer = api_rule("copy", "2026-01-02T00:00:00Z", &["orders.shop.example.com"]);
    let all = vec![older.clone(), newer.clone()];
    let run = |rule: Arc<APIRule>, all: Vec<Arc<APIRule>>, exchanges| async move {
        let (client, server) = kube_mock::scripted(exchanges);
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
