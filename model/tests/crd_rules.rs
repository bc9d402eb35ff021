//! The CRDs' CEL rules (`x-kubernetes-validations`) and the local validation must refuse the
//! same objects: the rules are evaluated here with kube's client-side CEL engine (schema
//! defaults applied first, as the API server does) and compared with `validate_function` and
//! `validate_subscription` case by case.
//!
//! Not compared: the sink's namespace (CEL on a CRD cannot read `metadata.namespace`, so the
//! controller checks it and reports it in the Subscription's status) and the schema's own
//! `type`/`enum`/`maxLength` checks, which the API server applies before any rule runs.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use eddy_model::resources::{
    Function, SinkPolicy, Subscription, validate_function, validate_subscription,
};
use kube::CustomResourceExt;
use kube::core::cel::{
    ErrorKind, ScopeContext, Validator, WarningKind, analyze_rule, apply_defaults, compile_schema,
};
use serde_json::{Value, json};

fn schema_of(
    crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
) -> Value {
    let schema = crd.spec.versions[0]
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .expect("the CRD has a schema");
    serde_json::to_value(schema).expect("schema serializes")
}

/// Applies a JSON merge patch to `base`.
fn merged(base: &Value, patch: &Value) -> Value {
    let mut out = base.clone();
    merge(&mut out, patch);
    out
}

fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(target), Value::Object(patch)) => {
            for (key, value) in patch {
                if value.is_null() {
                    target.remove(key);
                } else {
                    merge(target.entry(key.clone()).or_insert(Value::Null), value);
                }
            }
        }
        (target, patch) => *target = patch.clone(),
    }
}

fn base_function() -> Value {
    json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
        "metadata": {"name": "reserve-stock", "namespace": "shop"},
        "spec": {
            "runtime": "nodejs20",
            "source": {"inline": {"source": "module.exports = { main() {} }", "dependencies": "{}"}},
            "env": [{"name": "LOG_LEVEL", "value": "info"}, {"name": "REGION", "value": "eu"}],
            "scaleConfig": {"minReplicas": 1, "maxReplicas": 3},
            "resourceConfiguration": {"function": {"profile": "M"}},
            "timeoutSeconds": 30
        }
    })
}

fn base_subscription() -> Value {
    json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
        "metadata": {"name": "on-order", "namespace": "shop"},
        "spec": {
            "sink": "http://reserve-stock.shop.svc.cluster.local",
            "source": "shop",
            "types": ["order.created.v1", "payment.>"],
            "config": {"maxInFlightMessages": "10"},
            "delivery": {"maxAttempts": 5, "backoff": "exponential", "initialDelay": "1s", "maxDelay": "1m", "timeout": "30s"}
        }
    })
}

/// (what the case is, merge patch on the base object, whether it is valid)
type Case = (&'static str, Value, bool);

fn function_cases() -> Vec<Case> {
    let jwt = |jwks_uri: &str| json!({"issuer": "https://id.example.com/", "jwksUri": jwks_uri});
    vec![
        ("the base object", json!({}), true),
        (
            "jwt access with an https JWKS",
            json!({"spec": {"access": {"mode": "jwt", "jwt": jwt("https://id.example.com/jwks.json")}}}),
            true,
        ),
        (
            "jwt access with a JWKS on localhost over http",
            json!({"spec": {"access": {"mode": "jwt", "jwt": jwt("http://127.0.0.1:9000/keys")}}}),
            true,
        ),
        (
            "jwt access with a JWKS on [::1] over http",
            json!({"spec": {"access": {"mode": "jwt", "jwt": jwt("http://[::1]:9000/keys")}}}),
            true,
        ),
        (
            "jwt access with a remote JWKS over http",
            json!({"spec": {"access": {"mode": "jwt", "jwt": jwt("http://id.example.com/keys")}}}),
            false,
        ),
        (
            "jwt access with a JWKS on a host named like localhost",
            json!({"spec": {"access": {"mode": "jwt", "jwt": jwt("http://localhost.example.com/keys")}}}),
            false,
        ),
        (
            "mode jwt without jwt",
            json!({"spec": {"access": {"mode": "jwt"}}}),
            false,
        ),
        (
            "jwt with mode public",
            json!({"spec": {"access": {"mode": "public", "jwt": jwt("https://id.example.com/k")}}}),
            false,
        ),
        (
            "a fixed replica count",
            json!({"spec": {"scaleConfig": null, "replicas": 0}}),
            true,
        ),
        (
            "explicit resources",
            json!({"spec": {"resourceConfiguration": {"function": {"profile": null, "resources": {"limits": {"cpu": "1"}}}}}}),
            true,
        ),
        (
            "name with upper case",
            json!({"metadata": {"name": "Reserve"}}),
            false,
        ),
        (
            "name starting with a digit",
            json!({"metadata": {"name": "1stock"}}),
            false,
        ),
        (
            "name ending in -",
            json!({"metadata": {"name": "stock-"}}),
            false,
        ),
        (
            "name of 64 characters",
            json!({"metadata": {"name": "a".repeat(64)}}),
            false,
        ),
        (
            "no source kind",
            json!({"spec": {"source": {"inline": null}}}),
            false,
        ),
        (
            "blank source",
            json!({"spec": {"source": {"inline": {"source": " \n\t"}}}}),
            false,
        ),
        (
            "duplicate env",
            json!({"spec": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}}),
            false,
        ),
        (
            "env name not an identifier",
            json!({"spec": {"env": [{"name": "1A", "value": ""}]}}),
            false,
        ),
        (
            "env name with a dash",
            json!({"spec": {"env": [{"name": "A-B", "value": ""}]}}),
            false,
        ),
        (
            "reserved env",
            json!({"spec": {"env": [{"name": "FUNC_NAME", "value": "x"}]}}),
            false,
        ),
        (
            "replicas above 100",
            json!({"spec": {"scaleConfig": null, "replicas": 101}}),
            false,
        ),
        (
            "negative replicas",
            json!({"spec": {"scaleConfig": null, "replicas": -1}}),
            false,
        ),
        (
            "max below min",
            json!({"spec": {"scaleConfig": {"minReplicas": 3, "maxReplicas": 2}}}),
            false,
        ),
        (
            "negative min",
            json!({"spec": {"scaleConfig": {"minReplicas": -1, "maxReplicas": 2}}}),
            false,
        ),
        (
            "zero max",
            json!({"spec": {"scaleConfig": {"minReplicas": 0, "maxReplicas": 0}}}),
            false,
        ),
        (
            "scale to zero",
            json!({"spec": {"scaleConfig": {"minReplicas": 0, "maxReplicas": 5}}}),
            true,
        ),
        (
            "unknown profile",
            json!({"spec": {"resourceConfiguration": {"function": {"profile": "XXL"}}}}),
            false,
        ),
        (
            "profile and resources",
            json!({"spec": {"resourceConfiguration": {"function": {"profile": "S", "resources": {"limits": {"cpu": "1"}}}}}}),
            false,
        ),
        ("timeout 0", json!({"spec": {"timeoutSeconds": 0}}), false),
        (
            "timeout above an hour",
            json!({"spec": {"timeoutSeconds": 3601}}),
            false,
        ),
        (
            "timeout of an hour",
            json!({"spec": {"timeoutSeconds": 3600}}),
            true,
        ),
    ]
}

fn subscription_cases() -> Vec<Case> {
    vec![
        ("the base object", json!({}), true),
        (
            "name starting with a digit",
            json!({"metadata": {"name": "1-on-order"}}),
            true,
        ),
        (
            "name with a dot",
            json!({"metadata": {"name": "on.order"}}),
            false,
        ),
        (
            "https sink",
            json!({"spec": {"sink": "https://hooks.example.com/eddy"}}),
            true,
        ),
        (
            "ftp sink",
            json!({"spec": {"sink": "ftp://hooks.example.com/"}}),
            false,
        ),
        (
            "sink that is no URL",
            json!({"spec": {"sink": "reserve-stock"}}),
            false,
        ),
        ("empty source", json!({"spec": {"source": ""}}), false),
        ("no types", json!({"spec": {"types": []}}), false),
        (
            "empty segment",
            json!({"spec": {"types": ["order..created"]}}),
            false,
        ),
        ("leading dot", json!({"spec": {"types": [".order"]}}), false),
        (
            "trailing dot",
            json!({"spec": {"types": ["order."]}}),
            false,
        ),
        ("empty type", json!({"spec": {"types": [""]}}), false),
        (
            "duplicate types",
            json!({"spec": {"types": ["a.b", "a.b"]}}),
            false,
        ),
        (
            "prefix wildcards",
            json!({"spec": {"types": ["order.*", "order.>"]}}),
            true,
        ),
        (
            "wildcard first",
            json!({"spec": {"types": ["*.created"]}}),
            false,
        ),
        ("wildcard alone", json!({"spec": {"types": [">"]}}), false),
        (
            "wildcard in the middle",
            json!({"spec": {"types": ["order.*.v1"]}}),
            false,
        ),
        (
            "wildcards taken literally",
            json!({"spec": {"types": ["*.created", ">"], "typeMatching": "exact"}}),
            true,
        ),
        (
            "max in flight as a number",
            json!({"spec": {"config": {"maxInFlightMessages": 100}}}),
            true,
        ),
        (
            "max in flight 0",
            json!({"spec": {"config": {"maxInFlightMessages": 0}}}),
            false,
        ),
        (
            "max in flight above 10000",
            json!({"spec": {"config": {"maxInFlightMessages": "10001"}}}),
            false,
        ),
        (
            "max in flight not a number",
            json!({"spec": {"config": {"maxInFlightMessages": "ten"}}}),
            false,
        ),
        (
            "max in flight with a space",
            json!({"spec": {"config": {"maxInFlightMessages": " 10"}}}),
            false,
        ),
        (
            "max in flight negative",
            json!({"spec": {"config": {"maxInFlightMessages": "-1"}}}),
            false,
        ),
        (
            "max attempts 0",
            json!({"spec": {"delivery": {"maxAttempts": 0}}}),
            false,
        ),
        (
            "max attempts 101",
            json!({"spec": {"delivery": {"maxAttempts": 101}}}),
            false,
        ),
        (
            "compound duration",
            json!({"spec": {"delivery": {"initialDelay": "1m30s", "maxDelay": "2h"}}}),
            true,
        ),
        (
            "fractional duration",
            json!({"spec": {"delivery": {"initialDelay": "1.5s"}}}),
            false,
        ),
        (
            "duration without unit",
            json!({"spec": {"delivery": {"initialDelay": "10"}}}),
            false,
        ),
        (
            "duration with a bad unit",
            json!({"spec": {"delivery": {"initialDelay": "1d"}}}),
            false,
        ),
        (
            "zero duration",
            json!({"spec": {"delivery": {"timeout": "0s"}}}),
            false,
        ),
        (
            "max delay below initial delay",
            json!({"spec": {"delivery": {"initialDelay": "5s", "maxDelay": "2s"}}}),
            false,
        ),
        (
            "max delay below the default initial delay",
            json!({"spec": {"delivery": {"initialDelay": null, "maxDelay": "500ms"}}}),
            false,
        ),
        (
            "initial delay above the default max delay",
            json!({"spec": {"delivery": {"initialDelay": "2m", "maxDelay": null}}}),
            false,
        ),
        (
            "timeout above an hour",
            json!({"spec": {"delivery": {"timeout": "61m"}}}),
            false,
        ),
        (
            "no delivery settings",
            json!({"spec": {"delivery": null, "config": null}}),
            true,
        ),
    ]
}

/// Ok when every rule holds; the failures otherwise. A rule that cannot be evaluated (an
/// unsupported function, a runtime error) fails the test: a refusal must come from a rule that
/// evaluated to false.
fn cel_accepts(schema: &Value, object: &Value) -> Result<(), String> {
    let Err(errors) = Validator::new().validate(schema, object, None) else {
        return Ok(());
    };
    for error in errors.iter() {
        assert_eq!(
            error.kind,
            ErrorKind::ValidationFailure,
            "{error} ({})",
            error.rule
        );
    }
    Err(errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; "))
}

#[test]
fn function_rules_match_local_validation() {
    let schema = schema_of(&Function::crd());
    for (case, patch, valid) in function_cases() {
        let object = merged(&base_function(), &patch);
        let cel = cel_accepts(&schema, &object);
        let function: Function = serde_json::from_value(object).expect(case);
        let local = validate_function(&function);
        assert_eq!(cel.is_ok(), valid, "CEL on {case}: {cel:?}");
        assert_eq!(
            local.is_empty(),
            valid,
            "local validation on {case}: {local:?}"
        );
    }
}

#[test]
fn subscription_rules_match_local_validation() {
    let schema = schema_of(&Subscription::crd());
    // On Kubernetes any http(s) sink passes the schema; where it may point is the controller's
    // policy, so the local side is given an open policy here.
    let open = SinkPolicy {
        allowed: vec!["http://".into(), "https://".into()],
    };
    for (case, patch, valid) in subscription_cases() {
        let object = merged(&base_subscription(), &patch);
        let cel = cel_accepts(&schema, &object);
        let subscription: Subscription = serde_json::from_value(object).expect(case);
        let local = validate_subscription(&subscription, &open);
        assert_eq!(cel.is_ok(), valid, "CEL on {case}: {cel:?}");
        assert_eq!(
            local.is_empty(),
            valid,
            "local validation on {case}: {local:?}"
        );
    }
}

/// Every rule compiles and stays within the API server's cost budget (which rejects a CRD whose rules could exceed it).
#[test]
fn rules_compile_and_fit_the_cost_budget() {
    for schema in [schema_of(&Function::crd()), schema_of(&Subscription::crd())] {
        let compiled = compile_schema(&schema);
        assert!(
            !compiled.has_errors(),
            "{:?}",
            compiled.compilation_errors()
        );
        let mut rules = 0;
        visit_rules(&schema, &mut |node, rule| {
            rules += 1;
            let warnings = analyze_rule(rule, &compile_schema(node), ScopeContext::CrdValidation);
            let fatal: Vec<_> = warnings
                .iter()
                .filter(|w| matches!(w.kind, WarningKind::CostExceeded))
                .collect();
            assert!(fatal.is_empty(), "{rule}: {fatal:?}");
        });
        assert!(rules >= 5, "the schema carries its rules");
    }
}

fn visit_rules(node: &Value, visit: &mut dyn FnMut(&Value, &str)) {
    match node {
        Value::Object(map) => {
            if let Some(Value::Array(rules)) = map.get("x-kubernetes-validations") {
                for rule in rules {
                    if let Some(text) = rule.get("rule").and_then(Value::as_str) {
                        visit(node, text);
                    }
                }
            }
            for value in map.values() {
                visit_rules(value, visit);
            }
        }
        Value::Array(items) => items.iter().for_each(|item| visit_rules(item, visit)),
        _ => {}
    }
}

/// Schema defaults as the API server applies them: a defaulted object gets its own fields'
/// defaults too (kube's client-side pass does one level per call, so repeat to a fixpoint).
fn defaulted(schema: &Value, object: &Value) -> Value {
    let mut current = object.clone();
    loop {
        let next = apply_defaults(schema, &current);
        if next == current {
            return current;
        }
        current = next;
    }
}

/// The defaults the API server writes into a stored object are the ones the code assumes when
/// a field is left out, so a Subscription or Function behaves the same in both modes.
#[test]
fn schema_defaults_are_the_local_defaults() {
    let bare_subscription = json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
        "metadata": {"name": "bare", "namespace": "shop"},
        "spec": {"sink": "http://fn.shop.svc.cluster.local", "types": ["a.b"]},
    });
    let with_defaults = defaulted(&schema_of(&Subscription::crd()), &bare_subscription);
    assert_eq!(
        with_defaults["spec"]["delivery"]["maxAttempts"], 5,
        "{with_defaults}"
    );
    let bare: Subscription = serde_json::from_value(bare_subscription).unwrap();
    let stored: Subscription = serde_json::from_value(with_defaults).unwrap();
    assert_eq!(
        bare.spec.delivery_policy().unwrap(),
        stored.spec.delivery_policy().unwrap()
    );
    assert_eq!(bare.spec.type_matching, stored.spec.type_matching);

    let bare_function = json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
        "metadata": {"name": "bare", "namespace": "shop"},
        "spec": {"runtime": "python311", "source": {"inline": {"source": "def main(e, c): pass"}}},
    });
    let with_defaults = defaulted(&schema_of(&Function::crd()), &bare_function);
    assert_eq!(
        with_defaults["spec"]["timeoutSeconds"], 180,
        "{with_defaults}"
    );
    let bare: Function = serde_json::from_value(bare_function).unwrap();
    let stored: Function = serde_json::from_value(with_defaults).unwrap();
    assert_eq!(bare.spec.timeout(), stored.spec.timeout());
    assert_eq!(bare.spec.replica_bounds(), stored.spec.replica_bounds());
}
