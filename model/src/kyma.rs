//! Kyma's manifests in eddy's own form (`eddy convert`). eddy's Function and Subscription take
//! every field of Kyma's `serverless.kyma-project.io/v1alpha2` Function and
//! `eventing.kyma-project.io/v1alpha2` Subscription, so a Kyma manifest is applied as written;
//! converting spells out what eddy writes differently:
//! - the `apiVersion` is `eddy.dev/v1alpha1`;
//! - `FUNC_TIMEOUT` in `env` becomes `timeoutSeconds`;
//! - `config.maxInFlightMessages`, a string in Kyma, becomes a number;
//! - `status` and the `eddy.dev/applied-as` annotation are dropped.

use serde_json::Value;

use crate::resources::{
    API_VERSION, APPLIED_AS_ANNOTATION, FUNC_TIMEOUT_ENV, FieldError, Function,
    KYMA_FUNCTION_API_VERSION, KYMA_SUBSCRIPTION_API_VERSION, Subscription,
};

/// The eddy-native form of one manifest. Manifests that are not Kyma's come back unchanged.
/// A Kyma manifest that does not decode is refused with the field at fault.
pub fn to_native(mut manifest: Value) -> Result<Value, Vec<FieldError>> {
    let api_version = manifest["apiVersion"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let kind = manifest["kind"].as_str().unwrap_or_default().to_owned();
    let is_kyma = matches!(
        (api_version.as_str(), kind.as_str()),
        (KYMA_FUNCTION_API_VERSION, "Function") | (KYMA_SUBSCRIPTION_API_VERSION, "Subscription")
    );
    if !is_kyma {
        return Ok(manifest);
    }
    let Some(object) = manifest.as_object_mut() else {
        return Ok(manifest);
    };
    object.insert("apiVersion".into(), Value::from(API_VERSION));
    object.remove("status");
    if let Some(metadata) = object.get_mut("metadata").and_then(Value::as_object_mut)
        && let Some(annotations) = metadata
            .get_mut("annotations")
            .and_then(Value::as_object_mut)
    {
        annotations.remove(APPLIED_AS_ANNOTATION);
        if annotations.is_empty() {
            metadata.remove("annotations");
        }
    }
    let spec = object.get_mut("spec").and_then(Value::as_object_mut);
    match (kind.as_str(), spec) {
        ("Function", Some(spec)) => {
            let timeout = spec
                .get("env")
                .and_then(Value::as_array)
                .and_then(|env| {
                    env.iter().position(|var| {
                        var["name"] == FUNC_TIMEOUT_ENV && var.get("valueFrom").is_none()
                    })
                })
                .and_then(|index| {
                    let seconds = spec["env"][index]["value"]
                        .as_str()?
                        .trim()
                        .parse::<i64>()
                        .ok()?;
                    Some((index, seconds))
                });
            if let (Some((index, seconds)), false) = (timeout, spec.contains_key("timeoutSeconds"))
            {
                if let Some(env) = spec.get_mut("env").and_then(Value::as_array_mut) {
                    env.remove(index);
                    if env.is_empty() {
                        spec.remove("env");
                    }
                }
                spec.insert("timeoutSeconds".into(), Value::from(seconds));
            }
            check::<Function>(&manifest)?;
        }
        ("Subscription", Some(spec)) => {
            if let Some(config) = spec.get_mut("config").and_then(Value::as_object_mut) {
                let number = config
                    .get("maxInFlightMessages")
                    .and_then(Value::as_str)
                    .and_then(|text| text.trim().parse::<i64>().ok());
                if let Some(number) = number {
                    config.insert("maxInFlightMessages".into(), Value::from(number));
                }
            }
            check::<Subscription>(&manifest)?;
        }
        _ => {
            return Err(vec![FieldError {
                field: "spec".into(),
                message: "is required".into(),
            }]);
        }
    }
    Ok(manifest)
}

/// That the converted manifest decodes, naming the field when it does not.
fn check<R: serde::de::DeserializeOwned>(manifest: &Value) -> Result<(), Vec<FieldError>> {
    serde_path_to_error::deserialize::<_, R>(manifest)
        .map(|_| ())
        .map_err(|error| {
            vec![FieldError {
                field: error.path().to_string(),
                message: error.into_inner().to_string(),
            }]
        })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_kyma_function_becomes_eddys_with_its_timeout_as_a_field() {
        let kyma = json!({
            "apiVersion": "serverless.kyma-project.io/v1alpha2", "kind": "Function",
            "metadata": {"name": "greet", "annotations": {"eddy.dev/applied-as": "serverless.kyma-project.io/v1alpha2"}},
            "spec": {"runtime": "nodejs22", "source": {"inline": {"source": "x"}},
                     "env": [{"name": "FUNC_TIMEOUT", "value": "5"}, {"name": "A", "value": "b"}]},
            "status": {"replicas": 1},
        });
        let native = to_native(kyma).unwrap();
        assert_eq!(
            native,
            json!({
                "apiVersion": "eddy.dev/v1alpha1", "kind": "Function", "metadata": {"name": "greet"},
                "spec": {"runtime": "nodejs22", "source": {"inline": {"source": "x"}},
                         "env": [{"name": "A", "value": "b"}], "timeoutSeconds": 5},
            })
        );
    }

    #[test]
    fn a_kyma_subscription_gets_a_numeric_in_flight_limit() {
        let kyma = json!({
            "apiVersion": "eventing.kyma-project.io/v1alpha2", "kind": "Subscription",
            "metadata": {"name": "on-order"},
            "spec": {"sink": "http://a.default.svc.cluster.local", "types": ["order.created.v1"],
                     "source": "shop", "config": {"maxInFlightMessages": "5"}},
        });
        let native = to_native(kyma).unwrap();
        assert_eq!(native["apiVersion"], "eddy.dev/v1alpha1");
        assert_eq!(native["spec"]["config"]["maxInFlightMessages"], 5);
    }

    #[test]
    fn other_manifests_pass_unchanged_and_bad_ones_name_the_field() {
        let secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}});
        assert_eq!(to_native(secret.clone()).unwrap(), secret);
        let bad = json!({
            "apiVersion": "serverless.kyma-project.io/v1alpha2", "kind": "Function",
            "metadata": {"name": "greet"},
            "spec": {"runtime": "nodejs18", "source": {"inline": {"source": "x"}}},
        });
        let errors = to_native(bad).unwrap_err();
        assert_eq!(errors[0].field, "spec.runtime");
    }
}
