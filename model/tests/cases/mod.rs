//! Valid and invalid Functions and Subscriptions, each a merge patch on a valid base object:
//! the table both the client-side CEL test (`model/tests/crd_rules.rs`) and the real API server
//! test (`tests/kubernetes_cluster/`) check the CRDs' rules and the local validation against.
#![allow(dead_code)]

use serde_json::{Value, json};

/// Applies a JSON merge patch to `base`.
pub fn merged(base: &Value, patch: &Value) -> Value {
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

pub fn base_function() -> Value {
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

pub fn base_subscription() -> Value {
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
pub type Case = (&'static str, Value, bool);

pub fn function_cases() -> Vec<Case> {
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
            "a git source",
            json!({"spec": {"source": {"inline": null, "gitRepository": {"url": "https://git.example.com/shop.git", "reference": "v1.2"}}}}),
            true,
        ),
        (
            "a git reference with a space",
            json!({"spec": {"source": {"inline": null, "gitRepository": {"url": "https://git.example.com/shop.git", "reference": "v1 2"}}}}),
            false,
        ),
        (
            "a git reference starting with -",
            json!({"spec": {"source": {"inline": null, "gitRepository": {"url": "https://git.example.com/shop.git", "reference": "-main"}}}}),
            false,
        ),
        (
            "token access with a digest",
            json!({"spec": {"access": {"mode": "token", "tokenDigests": [format!("sha256:{}", "ab".repeat(32))]}}}),
            true,
        ),
        (
            "token access without digests",
            json!({"spec": {"access": {"mode": "token"}}}),
            false,
        ),
        (
            "a token digest in upper case",
            json!({"spec": {"access": {"mode": "token", "tokenDigests": [format!("sha256:{}", "AB".repeat(32))]}}}),
            false,
        ),
        (
            "the timeout as Kyma's FUNC_TIMEOUT",
            json!({"spec": {"timeoutSeconds": null, "env": [{"name": "FUNC_TIMEOUT", "value": "30"}]}}),
            true,
        ),
        (
            "FUNC_TIMEOUT beside timeoutSeconds",
            json!({"spec": {"env": [{"name": "FUNC_TIMEOUT", "value": "30"}]}}),
            false,
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
            "env names with a dash and a dot, as Kubernetes takes them",
            json!({"spec": {"env": [{"name": "API-KEY", "value": "x"}, {"name": "app.mode", "value": "y"}]}}),
            true,
        ),
        (
            "env name with a space",
            json!({"spec": {"env": [{"name": "A B", "value": ""}]}}),
            false,
        ),
        (
            "env from pod fields and container resources",
            json!({"spec": {"env": [
                {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "TIER", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['tier']"}}},
                {"name": "IP", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}},
                {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
            ]}}),
            true,
        ),
        (
            "env from a pod field Kubernetes does not pass",
            json!({"spec": {"env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.containers"}}}]}}),
            false,
        ),
        (
            "env from an unknown container resource",
            json!({"spec": {"env": [{"name": "X", "valueFrom": {"resourceFieldRef": {"resource": "limits.gpu"}}}]}}),
            false,
        ),
        (
            "env from two sources",
            json!({"spec": {"env": [{"name": "X", "valueFrom": {
                "fieldRef": {"fieldPath": "metadata.name"},
                "secretKeyRef": {"name": "s", "key": "k"}}}]}}),
            false,
        ),
        (
            "a git URL without a scheme, as Kyma's docs write it",
            json!({"spec": {"source": {"inline": null, "gitRepository": {"url": "github.com/kyma-project/examples", "reference": "main"}}}}),
            true,
        ),
        (
            "a git URL in SSH's scp form",
            json!({"spec": {"source": {"inline": null, "gitRepository": {"url": "git@github.com:kyma-project/examples.git", "reference": "main"}}}}),
            true,
        ),
        (
            "a git URL that is a bare word",
            json!({"spec": {"source": {"inline": null, "gitRepository": {"url": "examples", "reference": "main"}}}}),
            false,
        ),
        (
            "Kyma's deprecated template",
            json!({"spec": {"template": {"labels": {"app": "shop"}, "annotations": {"team": "a"}}}}),
            true,
        ),
        (
            "reserved env",
            json!({"spec": {"env": [{"name": "FUNC_NAME", "value": "x"}]}}),
            false,
        ),
        (
            "env value with a NUL byte",
            json!({"spec": {"env": [{"name": "A", "value": "a\u{0}b"}]}}),
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

pub fn subscription_cases() -> Vec<Case> {
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
            "Service sinks with a port, a path, or https, as Kyma takes them",
            json!({"spec": {"sink": "https://reserve-stock.shop.svc.cluster.local:8443/orders"}}),
            true,
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
        (
            "empty source with exact matching, as Kyma takes it",
            json!({"spec": {"source": "", "typeMatching": "exact", "types": ["order.created.v1"]}}),
            true,
        ),
        (
            "config keys of Kyma's EventMesh backend",
            json!({"spec": {"config": {"maxInFlightMessages": "5", "webhookAuth": "oauth2", "qos": "AT_LEAST_ONCE"}}}),
            true,
        ),
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
