//! Validation: the API server refuses what local validation refuses, with the same message, and stored defaults survive Kyma's conversion.

use super::*;

/// Every CEL rule: each invalid object of the shared table is refused by the API server with
/// the message the local validation gives for it, and each valid one is stored, defaults and all.
#[tokio::test]
async fn the_api_server_refuses_what_local_validation_refuses_with_the_same_message() {
    let _serial = serial().await;
    let cluster = Cluster::new("cel").await;
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    let subscriptions = cluster.dynamic("eddy.dev/v1alpha1", "Subscription");
    let mut checked = 0;
    let mut mismatches = Vec::new();
    for (kind, api, base, table) in [
        (
            "Function",
            &functions,
            cases::base_function(),
            cases::function_cases(),
        ),
        (
            "Subscription",
            &subscriptions,
            cases::base_subscription(),
            cases::subscription_cases(),
        ),
    ] {
        for (index, (what, patch, valid)) in table.into_iter().enumerate() {
            let mut object = cases::merged(&base, &patch);
            let name = format!("case-{index}");
            if patch["metadata"]["name"].is_null() {
                object["metadata"]["name"] = json!(name);
            }
            object["metadata"]["namespace"] = json!(cluster.namespace);
            // The base sink is a Service of the base's namespace: the test's own here.
            if let Some(sink) = object["spec"]["sink"].as_str() {
                let sink = sink.replace(".shop.svc", &format!(".{}.svc", cluster.namespace));
                object["spec"]["sink"] = json!(sink);
            }
            // The local messages (the sink's namespace is the controller's check, not a rule).
            let local: Vec<String> = if kind == "Function" {
                serde_json::from_value::<Function>(object.clone())
                    .map_err(|e| vec![e.to_string()])
                    .map(|f| {
                        validate_function(&f)
                            .into_iter()
                            .map(|e| e.message)
                            .collect()
                    })
                    .unwrap_or_else(|errors| errors)
            } else {
                serde_json::from_value::<eddy_model::resources::Subscription>(object.clone())
                    .map_err(|e| vec![e.to_string()])
                    .map(|s| {
                        validate_subscription(&s, &Default::default())
                            .into_iter()
                            .map(|e| e.message)
                            .collect()
                    })
                    .unwrap_or_else(|errors| errors)
            };
            let dynamic: DynamicObject = serde_json::from_value(object.clone()).unwrap();
            let answer = api.create(&PostParams::default(), &dynamic).await;
            match (valid, answer) {
                (true, Ok(_)) => {}
                (true, Err(error)) => panic!("{kind} {what:?} is valid but refused: {error}"),
                (false, Ok(_)) => panic!("{kind} {what:?} is invalid but the API server stored it"),
                (false, Err(kube::Error::Api(status))) => {
                    assert_eq!(status.code, 422, "{kind} {what:?}: {status:?}");
                    assert!(
                        !local.is_empty(),
                        "{kind} {what:?}: local validation accepts it"
                    );
                    // A CEL rule answers with eddy's own message; the schema's own checks
                    // (type, enum, maxLength) in the API server's words.
                    let same = local.iter().any(|m| status.message.contains(m.as_str()));
                    let schema = [
                        "Unsupported value",
                        "Too long",
                        "should be",
                        "must have at most",
                        "in body must be",
                    ]
                    .iter()
                    .any(|words| status.message.contains(words));
                    if !same && !schema {
                        mismatches.push(format!(
                            "{kind} {what:?}: the API server says {:?}, local validation {local:?}",
                            status.message
                        ));
                    }
                    checked += 1;
                }
                (false, Err(error)) => panic!("{kind} {what:?}: {error}"),
            }
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    assert!(checked > 20, "only {checked} invalid cases checked");
    cluster.finish().await;
}

/// The CRD defaults the API server fills in are the ones the code assumes, and they survive
/// Kyma's conversion and validation (a Kyma Function with FUNC_TIMEOUT is valid as stored).
#[tokio::test]
async fn stored_defaults_survive_the_kyma_conversion_and_validation() {
    let _serial = serial().await;
    let cluster = Cluster::new("defaults").await;
    cluster
        .kubectl_apply(
            "apiVersion: serverless.kyma-project.io/v1alpha2\nkind: Function\nmetadata: {name: timed}\nspec:\n  runtime: nodejs22\n  env: [{name: FUNC_TIMEOUT, value: \"10\"}]\n  source: {inline: {source: \"module.exports = {main: () => 'ok'}\"}}\n---\napiVersion: eventing.kyma-project.io/v1alpha2\nkind: Subscription\nmetadata: {name: bare}\nspec:\n  sink: http://timed.NS.svc.cluster.local\n  source: shop\n  types: [order.created.v1]\n"
                .replace("NS", &cluster.namespace)
                .as_str(),
        )
        .unwrap();
    for (api_version, kind, name) in [
        ("serverless.kyma-project.io/v1alpha2", "Function", "timed"),
        ("eventing.kyma-project.io/v1alpha2", "Subscription", "bare"),
    ] {
        let stored = cluster.dynamic(api_version, kind).get(name).await.unwrap();
        let manifest = serde_json::to_value(&stored).unwrap();
        let native = eddy_model::kyma::to_native(manifest.clone())
            .unwrap_or_else(|errors| panic!("{kind} as stored: {errors:?}\n{manifest:#}"));
        if kind == "Function" {
            let function: Function = serde_json::from_value(native).unwrap();
            let errors = validate_function(&function);
            assert!(errors.is_empty(), "{errors:?}");
            assert_eq!(function.spec.timeout(), Duration::from_secs(10));
        } else {
            let subscription: eddy_model::resources::Subscription =
                serde_json::from_value(native).unwrap();
            let errors = validate_subscription(&subscription, &Default::default());
            assert!(errors.is_empty(), "{errors:?}");
            assert_eq!(
                manifest["spec"]["config"]["maxInFlightMessages"], "10",
                "{manifest:#}"
            );
            assert_eq!(manifest["spec"]["typeMatching"], "standard", "{manifest:#}");
        }
    }
    cluster.finish().await;
}
