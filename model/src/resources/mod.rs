//! The resource model: Function and Subscription, identical in local mode and on
//! Kubernetes. Field names follow Kyma's serverless and eventing v1alpha2 APIs.
//!
//! Defaults and validation are pure functions here so that the local API, the Kubernetes CRD
//! and the tests agree on one set of rules. By kind: [`function`] (Function, its runtimes,
//! source, env, resources and status), [`subscription`] (Subscription, delivery, sinks); here
//! what both share (field errors, conditions, names).

use std::{collections::BTreeMap, time::Duration};

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{
    backoff::{Backoff, BackoffShape},
    subject::{self, EVENTS_SUBJECT_PREFIX},
};

pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

pub mod function;
pub mod presets;
pub mod subscription;

pub use function::*;
pub use subscription::*;

/// API group of every eddy resource.
pub const GROUP: &str = "eddy.dev";
/// API version of every eddy resource.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` as written in manifests.
pub const API_VERSION: &str = "eddy.dev/v1alpha1";
/// `apiVersion` of Kyma's Function, accepted as written.
pub const KYMA_FUNCTION_API_VERSION: &str = "serverless.kyma-project.io/v1alpha2";
/// `apiVersion` of Kyma's Subscription, accepted as written.
pub const KYMA_SUBSCRIPTION_API_VERSION: &str = "eventing.kyma-project.io/v1alpha2";
/// Annotation recording the `apiVersion` a resource was applied with, so it is shown back in
/// that form.
pub const APPLIED_AS_ANNOTATION: &str = "eddy.dev/applied-as";

/// One problem with a resource, named by its JSON path (`spec.types[1]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FieldError {
    /// JSON path of the field.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl FieldError {
    /// A problem with `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Every problem as one line for logs and status messages: `field: message; field: message`.
pub fn describe_errors(errors: &[FieldError]) -> String {
    errors
        .iter()
        .map(|e| format!("{}: {}", e.field, e.message))
        .collect::<Vec<_>>()
        .join("; ")
}

/// A status condition, as Kubernetes writes them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// `ConfigurationReady`, `BuildReady`, `Running`, `Ready`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: ConditionStatus,
    /// CamelCase reason.
    pub reason: String,
    /// A sentence for humans.
    #[serde(default)]
    pub message: String,
    /// RFC 3339 time of the last status change.
    pub last_transition_time: String,
}

/// Whether a condition holds, as Kubernetes writes it: `True`, `False` or `Unknown`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum ConditionStatus {
    /// It holds.
    True,
    /// It does not.
    False,
    /// Not known yet.
    #[default]
    Unknown,
}

impl ConditionStatus {
    /// `True` or `False`.
    pub fn from_bool(holds: bool) -> Self {
        if holds { Self::True } else { Self::False }
    }

    /// As written on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::True => "True",
            Self::False => "False",
            Self::Unknown => "Unknown",
        }
    }
}

impl std::fmt::Display for ConditionStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Sets `condition` in `conditions`, keeping the transition time when the status did not change.
pub fn set_condition(conditions: &mut Vec<Condition>, mut condition: Condition) {
    match conditions
        .iter_mut()
        .find(|existing| existing.type_ == condition.type_)
    {
        Some(existing) => {
            if existing.status == condition.status {
                condition.last_transition_time = existing.last_transition_time.clone();
            }
            *existing = condition;
        }
        None => conditions.push(condition),
    }
}

// ---------------------------------------------------------------------------------------------
// Names

fn is_qualified_name_part(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 63
        && text.starts_with(|c: char| c.is_ascii_alphanumeric())
        && text.ends_with(|c: char| c.is_ascii_alphanumeric())
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// A Secret or ConfigMap key: letters, digits, `-`, `_`, `.`; at most 253.
pub fn is_config_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= 253
        && key != "."
        && key != ".."
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// DNS-1123 subdomain: dot-separated DNS-1123 labels, at most 253 characters.
pub fn is_dns1123_subdomain(name: &str) -> bool {
    name.len() <= 253 && name.split('.').all(is_dns1123_label)
}

/// What Kubernetes takes as an environment variable name (`API-KEY`, `app.mode`, `_X1`).
fn is_env_name(name: &str) -> bool {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if allowed(c) && !c.is_ascii_digit()) && chars.all(allowed)
}

/// Why a Git URL is refused.
pub const GIT_URL_MESSAGE: &str =
    "must be an https, http, ssh, file or git@host:path URL, or host/path (github.com/org/repo)";

/// Why an env name is refused.
pub const ENV_NAME_MESSAGE: &str =
    "must consist of letters, digits, '_', '-' and '.', and must not start with a digit";

/// DNS-1035 label: lower-case letters, digits and `-`, starting with a letter, at most 63.
pub fn is_dns1035_label(name: &str) -> bool {
    name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && !name.ends_with('-')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

/// DNS-1123 label: like DNS-1035 but may start with a digit.
pub fn is_dns1123_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && !name.ends_with('-')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

fn validate_metadata(metadata: &ObjectMeta, dns1035: bool) -> Vec<FieldError> {
    let mut errors = Vec::new();
    match metadata.name.as_deref() {
        None | Some("") => errors.push(FieldError::new("metadata.name", "is required")),
        Some(name) if dns1035 && !is_dns1035_label(name) => errors.push(FieldError::new(
            "metadata.name",
            "must be a DNS-1035 label: lower-case letters, digits and '-', starting with a letter, at most 63 characters",
        )),
        Some(name) if !dns1035 && !is_dns1123_label(name) => errors.push(FieldError::new(
            "metadata.name",
            "must be a DNS-1123 label: lower-case letters, digits and '-', at most 63 characters",
        )),
        Some(_) => {}
    }
    if let Some(namespace) = metadata.namespace.as_deref()
        && !is_dns1123_label(namespace)
    {
        errors.push(FieldError::new(
            "metadata.namespace",
            "must be a DNS-1123 label",
        ));
    }
    errors
}

/// The durable consumer name of a Subscription (`sub_<namespace>_<name>`; `_` appears in neither).
pub fn consumer_name(namespace: &str, name: &str) -> String {
    format!("sub_{namespace}_{name}")
}

/// The CustomResourceDefinitions of Function and Subscription as one YAML text (what `eddy crds`
/// prints and `charts/eddy/crds` holds), generated from the types above.
pub fn crds_yaml() -> Result<String, serde_yaml_ng::Error> {
    use kube::CustomResourceExt as _;
    let mut out = String::from(
        "# Generated by `eddy crds` from the Rust types in model/src/resources/; do not edit.\n",
    );
    for crd in [Function::crd(), Subscription::crd()] {
        out.push_str("---\n");
        out.push_str(&serde_yaml_ng::to_string(&crd)?);
    }
    Ok(out)
}

#[cfg(test)]
mod quantity_tests {
    use super::*;

    #[test]
    fn quantities_are_read_as_kubernetes_writes_them() {
        assert_eq!(quantity_bytes("128Mi"), Some(128 * 1024 * 1024));
        assert_eq!(quantity_bytes("1G"), Some(1_000_000_000));
        assert_eq!(quantity_bytes("0.5Gi"), Some(512 * 1024 * 1024));
        assert_eq!(quantity_bytes("512"), Some(512));
        assert_eq!(quantity_bytes("1e3"), Some(1000));
        assert_eq!(quantity_bytes("lots"), None);
        assert_eq!(quantity_bytes("-1Mi"), None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sub_json(spec: serde_json::Value) -> Subscription {
        serde_json::from_value(serde_json::json!({
            "apiVersion": API_VERSION, "kind": "Subscription",
            "metadata": {"name": "on-order", "namespace": "default"},
            "spec": spec,
        }))
        .unwrap()
    }

    /// Kyma's tools write `""` for a field left blank: each optional string means "not set",
    /// so it renders no empty image, draws no warning and passes validation.
    #[test]
    fn empty_optional_strings_from_kymas_tools_mean_not_set() {
        let function: Function = serde_json::from_value(serde_json::json!({
            "apiVersion": KYMA_FUNCTION_API_VERSION, "kind": "Function",
            "metadata": {"name": "hello", "namespace": "default"},
            "spec": {
                "runtime": "nodejs22",
                "runtimeImageOverride": "",
                "source": {"gitRepository": {"url": "https://example.com/r.git",
                                             "reference": "main", "baseDir": ""}},
                "resourceConfiguration": {"function": {"profile": "", "resources": {"limits": {"memory": "64Mi"}}},
                                          "build": {"profile": ""}},
                "env": [{"name": "MEM", "valueFrom": {"resourceFieldRef": {"containerName": "", "resource": "limits.memory"}}},
                        {"name": "POD", "valueFrom": {"fieldRef": {"apiVersion": "", "fieldPath": "metadata.name"}}}],
            },
        }))
        .unwrap();
        let spec = &function.spec;
        assert_eq!(spec.runtime_image_override, None);
        let git = spec.source.git_repository.as_ref().unwrap();
        assert_eq!(git.base_dir, None);
        let resources = spec.resource_configuration.as_ref().unwrap();
        assert_eq!(resources.function.as_ref().unwrap().profile, None);
        assert_eq!(resources.build.as_ref().unwrap().profile, None);
        assert!(
            !spec
                .kubernetes_only_fields()
                .contains(&"spec.runtimeImageOverride")
        );
        assert_eq!(validate_function(&function), Vec::new());
    }

    #[test]
    fn types_resolve_to_subject_filters() {
        let sub = sub_json(serde_json::json!({
            "sink": "http://stock.default.svc.cluster.local",
            "source": "shop",
            "types": ["order.created.v1", "order.*", "payment.>"],
        }));
        let subjects: Vec<_> = sub
            .spec
            .type_subjects()
            .unwrap()
            .into_iter()
            .map(|t| t.subject)
            .collect();
        assert_eq!(
            subjects,
            vec![
                "eddy.events.shop.order.created.v1",
                "eddy.events.shop.order.*",
                "eddy.events.shop.payment.>"
            ]
        );
        assert!(validate_subscription(&sub, &SinkPolicy::default()).is_empty());
    }

    #[test]
    fn any_source_and_escaped_tokens() {
        let sub = sub_json(serde_json::json!({
            "sink": "http://stock.default.svc.cluster.local",
            "types": ["com.example/order created"],
        }));
        assert_eq!(
            sub.spec.type_subjects().unwrap()[0].subject,
            "eddy.events.*.com.example~2Forder~20created"
        );
        let exact = sub_json(serde_json::json!({
            "sink": "http://stock.default.svc.cluster.local",
            "types": ["order.*"], "typeMatching": "exact",
        }));
        assert_eq!(
            exact.spec.type_subjects().unwrap()[0].subject,
            "eddy.events.*.order.~2A"
        );
    }

    #[test]
    fn bad_types_are_named() {
        let sub = sub_json(serde_json::json!({
            "sink": "http://stock.default.svc.cluster.local",
            "types": ["ok", "a..b", "*.created", "order.*.v1", "ok"],
        }));
        let fields: Vec<_> = validate_subscription(&sub, &SinkPolicy::default())
            .into_iter()
            .map(|e| e.field)
            .collect();
        assert_eq!(
            fields,
            vec![
                "spec.types[1]",
                "spec.types[2]",
                "spec.types[3]",
                "spec.types[4]"
            ]
        );
        let none = sub_json(
            serde_json::json!({"sink": "http://stock.default.svc.cluster.local", "types": []}),
        );
        assert_eq!(
            validate_subscription(&none, &SinkPolicy::default())[0].field,
            "spec.types"
        );
    }

    #[test]
    fn allowed_sinks_are_compared_as_urls() {
        let policy = |entries: &[&str]| SinkPolicy::parse(entries).unwrap();
        let hooks = policy(&["http://127.0.0.1:9000/hooks"]);
        for (sink, ok) in [
            ("http://127.0.0.1:9000/hooks", true),
            ("http://127.0.0.1:9000/hooks/a?b=c", true),
            ("http://127.0.0.1:9000/hooksmith", false),
            ("http://127.0.0.1:9000/hooks/../admin", false),
            ("http://127.0.0.1:90000/hooks", false),
            ("http://127.0.0.1:900/hooks", false),
            ("http://127.0.0.1:9000@127.0.0.1:8083/hooks", false),
            ("http://u:p@127.0.0.1:9000/hooks", false),
            ("https://127.0.0.1:9000/hooks", false),
            ("http://127.0.0.2:9000/hooks", false),
        ] {
            assert_eq!(hooks.allowed_url(sink).is_some(), ok, "{sink}");
        }
        let any_port = policy(&["http://localhost:*"]);
        assert!(any_port.allowed_url("http://LOCALHOST:1/x").is_some());
        assert!(any_port.allowed_url("http://localhost.evil:1/x").is_none());
        let default_port = policy(&["http://hooks.example"]);
        assert!(
            default_port
                .allowed_url("http://hooks.example:80/a")
                .is_some()
        );
        assert!(
            default_port
                .allowed_url("http://hooks.example:8080/a")
                .is_none()
        );
        assert!(policy(&["*"]).allowed_url("https://anywhere/").is_some());
        assert!(policy(&["*"]).allowed_url("ftp://anywhere/").is_none());
        let normalized = hooks
            .allowed_url("http://127.0.0.1:9000/hooks/./a")
            .unwrap();
        assert_eq!(normalized.as_str(), "http://127.0.0.1:9000/hooks/a");
        for bad in ["127.0.0.1:9000", "ftp://x/", "http://u@x/", ""] {
            assert!(parse_allowed_sink(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn sinks_are_function_services_or_allowed() {
        let policy = SinkPolicy::parse(&["http://127.0.0.1:"]).unwrap();
        for (sink, ok) in [
            ("http://stock.default.svc.cluster.local", true),
            ("http://stock.default.svc.cluster.local/orders?x=1", true),
            ("http://stock.other.svc.cluster.local", false),
            ("http://127.0.0.1:9000/hook", true),
            ("http://169.254.169.254/latest/meta-data", false),
            // A Service sink as Kyma takes it: any port, https.
            ("https://stock.default.svc.cluster.local", true),
            ("http://stock.default.svc.cluster.local:8080", true),
            ("https://stock.other.svc.cluster.local:8443", false),
            ("http://127.0.0.1:9@169.254.169.254/", false),
            ("http://127.0.0.1.evil.example:9000/", false),
        ] {
            let sub = sub_json(serde_json::json!({"sink": sink, "types": ["a"]}));
            assert_eq!(
                validate_subscription(&sub, &policy).is_empty(),
                ok,
                "{sink}"
            );
        }
        let parsed = parse_function_sink("http://stock.shop.svc.cluster.local/a/b?c=d").unwrap();
        assert_eq!(
            parsed,
            FunctionSink {
                function: "stock".into(),
                namespace: "shop".into(),
                path_and_query: "/a/b?c=d".into()
            }
        );
    }

    #[test]
    fn delivery_defaults_and_limits() {
        let sub = sub_json(
            serde_json::json!({"sink": "http://a.default.svc.cluster.local", "types": ["a"]}),
        );
        let policy = sub.spec.delivery_policy().unwrap();
        assert_eq!(policy.max_in_flight, 10);
        assert_eq!(policy.max_attempts, 5);
        assert_eq!(policy.timeout, Duration::from_secs(30));
        let kyma = sub_json(serde_json::json!({
            "sink": "http://a.default.svc.cluster.local", "types": ["a"],
            "config": {"maxInFlightMessages": "3"},
            "delivery": {"maxAttempts": 3, "backoff": "linear", "initialDelay": "200ms", "maxDelay": "1s", "timeout": "5s"}
        }));
        let policy = kyma.spec.delivery_policy().unwrap();
        assert_eq!((policy.max_in_flight, policy.max_attempts), (3, 3));
        assert_eq!(policy.retry_delay(1), Duration::from_millis(200));
        assert_eq!(policy.retry_delay(2), Duration::from_millis(400));
        assert_eq!(policy.retry_delay(9), Duration::from_secs(1));
        let bad = sub_json(serde_json::json!({
            "sink": "http://a.default.svc.cluster.local", "types": ["a"],
            "config": {"maxInFlightMessages": "lots"},
            "delivery": {"maxAttempts": 0, "initialDelay": "soon", "timeout": "0s"}
        }));
        let fields: Vec<_> = bad
            .spec
            .delivery_policy()
            .unwrap_err()
            .into_iter()
            .map(|e| e.field)
            .collect();
        assert_eq!(
            fields,
            vec![
                "spec.config.maxInFlightMessages",
                "spec.delivery.maxAttempts",
                "spec.delivery.initialDelay",
                "spec.delivery.timeout"
            ]
        );
    }

    #[test]
    fn exponential_backoff_doubles_up_to_the_cap() {
        let policy = DeliveryPolicy {
            max_in_flight: 1,
            max_attempts: 5,
            backoff: Backoff::exponential(Duration::from_secs(1), Duration::from_secs(10)),
            timeout: Duration::from_secs(1),
        };
        let delays: Vec<_> = (1..=6).map(|a| policy.retry_delay(a).as_secs()).collect();
        assert_eq!(delays, vec![1, 2, 4, 8, 10, 10]);
        assert_eq!(policy.retry_delay(u32::MAX), Duration::from_secs(10));
    }

    #[test]
    fn functions_are_validated_field_by_field() {
        let function: Function = serde_json::from_value(serde_json::json!({
            "apiVersion": API_VERSION, "kind": "Function",
            "metadata": {"name": "9bad", "namespace": "default"},
            "spec": {
                "runtime": "nodejs20",
                "source": {"inline": {"source": " "}},
                "env": [{"name": "FUNC_PORT", "value": "1"}, {"name": "1X"}, {"name": "A"}, {"name": "A"}],
                "scaleConfig": {"minReplicas": 3, "maxReplicas": 2},
                "resourceConfiguration": {"function": {"profile": "S", "resources": {"limits": {"cpu": "1"}}}},
                "timeoutSeconds": 0
            }
        }))
        .unwrap();
        let fields: Vec<_> = validate_function(&function)
            .into_iter()
            .map(|e| e.field)
            .collect();
        assert_eq!(
            fields,
            vec![
                "metadata.name",
                "spec.source.inline.source",
                "spec.env[0].name",
                "spec.env[1].name",
                "spec.env[3].name",
                "spec.scaleConfig.maxReplicas",
                "spec.resourceConfiguration.function",
                "spec.timeoutSeconds"
            ]
        );
    }

    /// `eddy.dev/scale-on` takes `backlog` or `cpu`: a typo is refused, naming the annotation,
    /// rather than silently leaving the Function on CPU.
    #[test]
    fn the_scale_on_annotation_takes_backlog_or_cpu() {
        let with = |value: &str| -> Function {
            serde_json::from_value(serde_json::json!({
                "apiVersion": API_VERSION, "kind": "Function",
                "metadata": {"name": "a", "annotations": {"eddy.dev/scale-on": value}},
                "spec": {"runtime": "nodejs22", "source": {"inline": {"source": "x"}}}
            }))
            .unwrap()
        };
        assert_eq!(validate_function(&with("backlog")), Vec::new());
        assert_eq!(validate_function(&with("cpu")), Vec::new());
        let errors = validate_function(&with("backlg"));
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].field, "metadata.annotations[eddy.dev/scale-on]");
        assert_eq!(errors[0].message, "must be backlog or cpu, not \"backlg\"");
    }

    #[test]
    fn unknown_fields_and_runtimes_are_refused() {
        let typo = serde_json::from_value::<Function>(serde_json::json!({
            "apiVersion": API_VERSION, "kind": "Function", "metadata": {"name": "a"},
            "spec": {"runtime": "nodejs20", "source": {"inline": {"source": "x"}}, "replica": 2}
        }));
        assert!(typo.unwrap_err().to_string().contains("replica"));
        let runtime = serde_json::from_value::<Function>(serde_json::json!({
            "apiVersion": API_VERSION, "kind": "Function", "metadata": {"name": "a"},
            "spec": {"runtime": "cobol", "source": {"inline": {"source": "x"}}}
        }));
        assert!(runtime.is_err());
    }

    #[test]
    fn conditions_keep_their_transition_time_until_the_status_changes() {
        let mut conditions = Vec::new();
        let make = |status: ConditionStatus, time: &str| Condition {
            type_: "Ready".into(),
            status,
            reason: "R".into(),
            message: String::new(),
            last_transition_time: time.into(),
        };
        set_condition(&mut conditions, make(ConditionStatus::True, "t1"));
        set_condition(&mut conditions, make(ConditionStatus::True, "t2"));
        assert_eq!(conditions[0].last_transition_time, "t1");
        set_condition(&mut conditions, make(ConditionStatus::False, "t3"));
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0].last_transition_time, "t3");
    }

    #[test]
    fn consumer_names_cannot_collide() {
        assert_eq!(consumer_name("default", "on-order"), "sub_default_on-order");
        assert_ne!(consumer_name("a-b", "c"), consumer_name("a", "b-c"));
    }
}
