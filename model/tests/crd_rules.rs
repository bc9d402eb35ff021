//! The CRDs' CEL rules (`x-kubernetes-validations`) and the local validation must refuse the
//! same objects with the same words: the rules are evaluated here with kube's client-side CEL
//! engine (schema defaults applied first, as the API server does) and compared with
//! `validate_function` and `validate_subscription` case by case, messages included. (The same
//! table runs against a real API server in `tests/kubernetes_cluster/`.)
//!
//! Not compared: the sink's namespace (CEL on a CRD cannot read `metadata.namespace`, so the
//! controller checks it and reports it in the Subscription's status) and the schema's own
//! `type`/`enum`/`maxLength` checks, which the API server applies before any rule runs.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use eddy_model::resources::{
    FieldError, Function, SinkPolicy, Subscription, validate_function, validate_subscription,
};
use kube::CustomResourceExt;
use kube::core::cel::{
    ErrorKind, ScopeContext, Validator, WarningKind, analyze_rule, apply_defaults, compile_schema,
};
use serde_json::{Value, json};

mod cases;
use cases::{base_function, base_subscription, function_cases, merged, subscription_cases};

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

/// Ok when every rule holds; the failures' messages otherwise. A rule that cannot be evaluated
/// (an unsupported function, a runtime error) fails the test: a refusal must come from a rule
/// that evaluated to false.
fn cel_accepts(schema: &Value, object: &Value) -> Result<(), Vec<String>> {
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
    Err(errors.iter().map(|error| error.message.clone()).collect())
}

/// CEL and the local validation agree on `case`: both accept it, or both refuse it and every
/// rule's message is one the local validation gives (the words a user sees are the same in
/// both modes).
fn agree(case: &str, valid: bool, cel: Result<(), Vec<String>>, local: &[FieldError]) {
    assert_eq!(cel.is_ok(), valid, "CEL on {case}: {cel:?}");
    assert_eq!(
        local.is_empty(),
        valid,
        "local validation on {case}: {local:?}"
    );
    if let Err(messages) = cel {
        for message in messages {
            assert!(
                local.iter().any(|error| message.contains(&error.message)),
                "{case}: CEL says {message:?}, local validation {local:?}"
            );
        }
    }
}

#[test]
fn function_rules_match_local_validation() {
    let schema = schema_of(&Function::crd());
    for (case, patch, valid) in function_cases() {
        // As the API server sees it: with the schema's defaults.
        let object = defaulted(&schema, &merged(&base_function(), &patch));
        let cel = cel_accepts(&schema, &object);
        let function: Function = serde_json::from_value(object).expect(case);
        agree(case, valid, cel, &validate_function(&function));
    }
}

#[test]
fn subscription_rules_match_local_validation() {
    let schema = schema_of(&Subscription::crd());
    // On Kubernetes any http(s) sink passes the schema; where it may point is the controller's
    // policy, so the local side is given an open policy here.
    let open = SinkPolicy::parse(&["http://", "https://"]).expect("entries");
    for (case, patch, valid) in subscription_cases() {
        let object = defaulted(&schema, &merged(&base_subscription(), &patch));
        let cel = cel_accepts(&schema, &object);
        let subscription: Subscription = serde_json::from_value(object).expect(case);
        agree(
            case,
            valid,
            cel,
            &validate_subscription(&subscription, &open),
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
    // No schema default for the timeout: it would sit beside a Kyma user's FUNC_TIMEOUT.
    assert!(
        with_defaults["spec"].get("timeoutSeconds").is_none(),
        "{with_defaults}"
    );
    let bare: Function = serde_json::from_value(bare_function).unwrap();
    let stored: Function = serde_json::from_value(with_defaults).unwrap();
    assert_eq!(bare.spec.timeout(), stored.spec.timeout());
    assert_eq!(bare.spec.replica_bounds(), stored.spec.replica_bounds());
}
