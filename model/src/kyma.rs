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

/// The labels Kyma's Function controller puts on a Function's pods, and the ones its Service
/// selects them by: users select Function pods by them (NetworkPolicies, AuthorizationPolicies,
/// PodMonitors, scripts). `uid` is the Function's (the Kyma Function's, for one applied as
/// Kyma's). Pure.
pub fn pod_labels(name: &str, uid: &str) -> [(&'static str, String); 4] {
    [
        ("serverless.kyma-project.io/function-name", name.to_owned()),
        (
            "serverless.kyma-project.io/managed-by",
            "function-controller".to_owned(),
        ),
        ("serverless.kyma-project.io/uuid", uid.to_owned()),
        (
            "serverless.kyma-project.io/resource",
            "deployment".to_owned(),
        ),
    ]
}

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

/// The API group and version of Kyma's Function.
pub const FUNCTION_GROUP: &str = "serverless.kyma-project.io";
/// The API group of Kyma's Subscription.
pub const SUBSCRIPTION_GROUP: &str = "eventing.kyma-project.io";
/// The version of both of Kyma's kinds eddy serves.
pub const VERSION: &str = "v1alpha2";

/// Kyma's Function kind, for clients of the Kubernetes API (`kymaCompatibility`).
pub fn function_resource() -> kube::core::ApiResource {
    kyma_resource(FUNCTION_GROUP, "Function", "functions")
}

/// Kyma's Subscription kind, for clients of the Kubernetes API (`kymaCompatibility`).
pub fn subscription_resource() -> kube::core::ApiResource {
    kyma_resource(SUBSCRIPTION_GROUP, "Subscription", "subscriptions")
}

fn kyma_resource(group: &str, kind: &str, plural: &str) -> kube::core::ApiResource {
    kube::core::ApiResource {
        group: group.to_owned(),
        version: VERSION.to_owned(),
        api_version: format!("{group}/{VERSION}"),
        kind: kind.to_owned(),
        plural: plural.to_owned(),
    }
}

/// CRDs that serve Kyma's Function and Subscription with eddy's schema (which takes every
/// Kyma field as Kyma writes it): eddy's own CRDs under Kyma's group and version; and Kyma's
/// APIRule (`v2`, `v2alpha1`).
pub fn crds()
-> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>
{
    use kube::CustomResourceExt as _;
    [
        (Function::crd(), FUNCTION_GROUP),
        (Subscription::crd(), SUBSCRIPTION_GROUP),
    ]
    .into_iter()
    .map(|(mut crd, group)| {
        crd.metadata.name = Some(format!("{}.{group}", crd.spec.names.plural));
        crd.spec.group = group.to_owned();
        // Kyma's short names: `fn` and `fns` for its Function (eddy's is `efn`), none for its
        // Subscription (`sub` stays eddy's).
        crd.spec.names.short_names =
            (group == FUNCTION_GROUP).then(|| vec!["fn".to_owned(), "fns".to_owned()]);
        for version in &mut crd.spec.versions {
            version.name = VERSION.to_owned();
            // Kyma's `config` is a map of strings: its tools read the default back as "10".
            if group == SUBSCRIPTION_GROUP
                && let Some(max_in_flight) = version
                    .schema
                    .as_mut()
                    .and_then(|schema| schema.open_api_v3_schema.as_mut())
                    .and_then(|root| root.properties.as_mut()?.get_mut("spec"))
                    .and_then(|spec| spec.properties.as_mut()?.get_mut("config"))
                    .and_then(|config| config.properties.as_mut()?.get_mut("maxInFlightMessages"))
            {
                max_in_flight.default = Some(
                    k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSON(
                        Value::from(crate::resources::DEFAULT_MAX_IN_FLIGHT.to_string()),
                    ),
                );
            }
        }
        crd
    })
    .chain([crate::apirule::crd(), crate::ratelimit::crd()])
    .collect()
}

/// [`crds`] as YAML, for the chart's `kymaCompatibility`.
pub fn crds_yaml() -> Result<String, serde_yaml_ng::Error> {
    let mut out = String::from(
        "# Generated by `eddy crds --kyma` from the Rust types in model/src/resources/; do not edit.\n",
    );
    for crd in crds() {
        out.push_str("---\n");
        out.push_str(&serde_yaml_ng::to_string(&crd)?);
    }
    Ok(out)
}

/// A Kyma Function stored in the cluster (any JSON form of it) as eddy's, marked with the
/// [`APPLIED_AS_ANNOTATION`] so what is written back (status, owner references) goes to the
/// Kyma object.
pub fn native_function(object: Value) -> Result<Function, Vec<FieldError>> {
    native(object, KYMA_FUNCTION_API_VERSION)
}

/// A Kyma Subscription stored in the cluster as eddy's, marked like [`native_function`]'s.
pub fn native_subscription(object: Value) -> Result<Subscription, Vec<FieldError>> {
    native(object, KYMA_SUBSCRIPTION_API_VERSION)
}

fn native<R: serde::de::DeserializeOwned + kube::Resource>(
    mut object: Value,
    api_version: &str,
) -> Result<R, Vec<FieldError>> {
    let status = object.as_object_mut().and_then(|o| o.remove("status"));
    let mut native = to_native(object)?;
    if let Some(status) = status.filter(|s| !s.is_null()) {
        native["status"] = status;
    }
    let mut resource: R = serde_path_to_error::deserialize(&native).map_err(|error| {
        vec![FieldError {
            field: error.path().to_string(),
            message: error.into_inner().to_string(),
        }]
    })?;
    resource
        .meta_mut()
        .annotations
        .get_or_insert_with(Default::default)
        .insert(APPLIED_AS_ANNOTATION.to_owned(), api_version.to_owned());
    Ok(resource)
}

/// The Kyma kind `meta`'s object was stored as, when it came through [`native_function`] or
/// [`native_subscription`].
pub fn stored_as(meta: &kube::core::ObjectMeta) -> Option<kube::core::ApiResource> {
    match meta
        .annotations
        .as_ref()?
        .get(APPLIED_AS_ANNOTATION)?
        .as_str()
    {
        KYMA_FUNCTION_API_VERSION => Some(function_resource()),
        KYMA_SUBSCRIPTION_API_VERSION => Some(subscription_resource()),
        _ => None,
    }
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
