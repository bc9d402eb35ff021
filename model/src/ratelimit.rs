//! Kyma's RateLimit (`gateway.kyma-project.io/v1alpha1`): local token buckets for the calls to
//! the Functions whose pods carry its `selectorLabels`. Kyma turns one into an Envoy
//! `local_ratelimit` filter on the selected pods' sidecars; eddy's gateway keeps the buckets
//! itself, in both modes. Types, validation (Kyma's rules, in Kyma's words), which RateLimit
//! holds a Function when several select it, and the status each one shows.

use std::{collections::BTreeMap, time::Duration};

use kube::{CustomResource, ResourceExt as _};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::resources::{FieldError, Function, parse_go_duration};

/// The API group of Kyma's RateLimit (the APIRule's).
pub const GROUP: &str = "gateway.kyma-project.io";
/// `gateway.kyma-project.io/v1alpha1`.
pub const API_VERSION: &str = "gateway.kyma-project.io/v1alpha1";
/// The shortest fill interval Kyma takes ("to avoid excessive refills").
pub const MIN_FILL_INTERVAL: Duration = Duration::from_millis(50);
/// The body of a call refused for want of a token, as Envoy's local rate limit answers it.
pub const LIMITED_BODY: &str = "local_rate_limited";

/// A RateLimit: token buckets for the calls to the Functions whose pods carry its labels.
#[derive(CustomResource, JsonSchema, Debug, Clone, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "gateway.kyma-project.io",
    version = "v1alpha1",
    kind = "RateLimit",
    plural = "ratelimits",
    namespaced,
    status = "RateLimitStatus",
    printcolumn = r#"{"name":"Status","type":"string","jsonPath":".status.state"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RateLimitSpec {
    /// The labels of the pods (on eddy, the Functions' pods) it applies to, within its own
    /// namespace. A Function is held by one RateLimit: the oldest that selects it.
    #[schemars(extend("minProperties" = 1))]
    pub selector_labels: BTreeMap<String, String>,
    /// The buckets.
    pub local: LocalConfig,
    /// Answer `x-ratelimit-limit` and `x-ratelimit-remaining` (default false).
    #[serde(default)]
    pub enable_response_headers: bool,
    /// Refuse calls past the limit (default true); false only counts them.
    #[serde(default = "enforced")]
    #[schemars(extend("default" = true))]
    pub enforce: bool,
}

fn enforced() -> bool {
    true
}

/// `spec.local`: the default bucket, and the buckets of particular paths and headers.
#[derive(JsonSchema, Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LocalConfig {
    /// The bucket of every call no other bucket takes.
    pub default_bucket: BucketSpec,
    /// Buckets for calls to a path, with headers, or both; the first a call matches takes it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub buckets: Vec<BucketConfig>,
}

/// One of `spec.local.buckets`: which calls, and their bucket.
#[derive(JsonSchema, Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BucketConfig {
    /// The path the Function sees (`/ip`), exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Headers the call must carry, each with exactly this value.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// The bucket.
    pub bucket: BucketSpec,
}

/// A token bucket: full at first, `tokensPerFill` more each `fillInterval`, never over
/// `maxTokens`; each call takes one.
#[derive(JsonSchema, Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BucketSpec {
    /// The most tokens it holds, and holds at first.
    pub max_tokens: i64,
    /// Tokens added each fill interval.
    pub tokens_per_fill: i64,
    /// How often it is filled (`30s`, `1m`, `500ms`), at least 50ms.
    pub fill_interval: String,
}

/// A RateLimit's status, as Kyma reports it.
#[derive(JsonSchema, Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RateLimitStatus {
    /// Why it is in its state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// `Ready`, `Warning` or `Error`.
    #[serde(default)]
    pub state: String,
}

/// A bucket as the gateway keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    /// The most tokens, and the first.
    pub max_tokens: u32,
    /// Tokens per fill.
    pub tokens_per_fill: u32,
    /// Time between fills.
    pub fill_interval: Duration,
}

impl BucketSpec {
    /// The bucket, or what is wrong with it (`at` names it in Kyma's words: `defaultBucket`,
    /// `bucket '[0]'`; `field` is its JSON path).
    fn checked(&self, at: &str, field: &str, errors: &mut Vec<FieldError>) -> Option<Bucket> {
        let mut count = |value: i64, name: &str| match u32::try_from(value) {
            Ok(count) if count > 0 => Some(count),
            _ => {
                errors.push(FieldError::new(
                    format!("{field}.{name}"),
                    format!("{at}: {name} must be between 1 and {}", u32::MAX),
                ));
                None
            }
        };
        let max_tokens = count(self.max_tokens, "maxTokens");
        let tokens_per_fill = count(self.tokens_per_fill, "tokensPerFill");
        let fill_interval = match parse_go_duration(&self.fill_interval) {
            None => {
                errors.push(FieldError::new(
                    format!("{field}.fillInterval"),
                    format!(
                        "{at}: fillInterval {:?} is not a duration (30s, 1m, 500ms)",
                        self.fill_interval
                    ),
                ));
                None
            }
            // Kyma's words.
            Some(interval) if interval < MIN_FILL_INTERVAL => {
                errors.push(FieldError::new(
                    format!("{field}.fillInterval"),
                    format!("{at}: fillInterval must be greater or equal 50ms"),
                ));
                None
            }
            Some(interval) => Some(interval),
        };
        Some(Bucket {
            max_tokens: max_tokens?,
            tokens_per_fill: tokens_per_fill?,
            fill_interval: fill_interval?,
        })
    }
}

/// A RateLimit's buckets, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Buckets {
    /// The bucket of every call no other takes.
    pub default: Bucket,
    /// The others, in order, with the calls each takes.
    pub buckets: Vec<(BucketMatch, Bucket)>,
}

/// A bucket's calls: its path and headers (names lower-case).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketMatch {
    /// The exact path, when it names one.
    pub path: Option<String>,
    /// Headers and their exact values.
    pub headers: Vec<(String, String)>,
}

impl RateLimitSpec {
    /// Every problem with it, each naming its field, with Kyma's words where Kyma has them:
    /// its status is `Error` (on Kubernetes) or it is refused (`eddy apply`).
    pub fn validate(&self) -> Vec<FieldError> {
        self.compiled().err().unwrap_or_default()
    }

    /// The default bucket and the others with their calls, or every problem.
    pub fn compiled(&self) -> Result<Buckets, Vec<FieldError>> {
        let mut errors = Vec::new();
        if self.selector_labels.is_empty() {
            errors.push(FieldError::new(
                "spec.selectorLabels",
                "at least one label selects the pods it applies to",
            ));
        }
        let default = self.local.default_bucket.checked(
            "defaultBucket",
            "spec.local.defaultBucket",
            &mut errors,
        );
        let mut buckets = Vec::with_capacity(self.local.buckets.len());
        for (index, config) in self.local.buckets.iter().enumerate() {
            let at = format!("bucket '[{index}]'");
            let field = format!("spec.local.buckets[{index}]");
            if config.path.is_none() && config.headers.is_empty() {
                errors.push(FieldError::new(
                    &field,
                    format!("{at}: a bucket names a path, headers or both"),
                ));
            }
            if let Some(path) = &config.path
                && !path.starts_with('/')
            {
                errors.push(FieldError::new(
                    format!("{field}.path"),
                    format!("{at}: the path must start with /"),
                ));
            }
            let Some(bucket) = config
                .bucket
                .checked(&at, &format!("{field}.bucket"), &mut errors)
            else {
                continue;
            };
            // Kyma's rule and words: Envoy fills every bucket on the default one's timer.
            if let Some(default) = default
                && !bucket
                    .fill_interval
                    .as_nanos()
                    .is_multiple_of(default.fill_interval.as_nanos())
            {
                errors.push(FieldError::new(
                    format!("{field}.bucket.fillInterval"),
                    format!("{at}: fillInterval must be a multiple of defaultBucket fillInterval"),
                ));
            }
            let matching = BucketMatch {
                path: config.path.clone(),
                headers: config
                    .headers
                    .iter()
                    .map(|(name, value)| (name.to_ascii_lowercase(), value.clone()))
                    .collect(),
            };
            buckets.push((matching, bucket));
        }
        match default {
            Some(default) if errors.is_empty() => Ok(Buckets { default, buckets }),
            _ => Err(errors),
        }
    }

    /// Whether a pod with `labels` is one it applies to.
    pub fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        !self.selector_labels.is_empty()
            && self
                .selector_labels
                .iter()
                .all(|(name, value)| labels.get(name) == Some(value))
    }
}

/// The labels a Function's pods carry, which RateLimits select them by: its own (`labels`,
/// `template.labels`), eddy's and Kyma's (`serverless.kyma-project.io/function-name`, ...).
/// `uid` is the object's whose pods they are (a Kyma Function's for one applied as Kyma's).
/// Pure.
pub fn function_pod_labels(function: &Function, uid: &str) -> BTreeMap<String, String> {
    let name = function.name_any();
    let mut labels = function.spec.pod_labels();
    for (label, value) in [
        ("app.kubernetes.io/name", name.as_str()),
        ("app.kubernetes.io/component", "function"),
        ("app.kubernetes.io/managed-by", "eddy"),
        ("eddy.dev/function", name.as_str()),
    ] {
        labels.insert(label.to_owned(), value.to_owned());
    }
    for (label, value) in crate::kyma::pod_labels(&name, uid) {
        labels.insert(label.to_owned(), value);
    }
    labels
}

/// The key of a RateLimit: (namespace, name).
pub type RateLimitKey = (String, String);

/// The key of a RateLimit.
pub fn key_of(rate_limit: &RateLimit) -> RateLimitKey {
    (
        rate_limit
            .namespace()
            .unwrap_or_else(|| "default".to_owned()),
        rate_limit.name_any(),
    )
}

/// Which of `valid` (RateLimits without a problem: an invalid one holds nothing) holds a pod
/// of `namespace` with `labels`: the oldest of its namespace that selects it (by creation time,
/// then name), as the others' status says. Pure.
pub fn holder<'a>(
    valid: impl IntoIterator<Item = &'a RateLimit>,
    namespace: &str,
    labels: &BTreeMap<String, String>,
) -> Option<&'a RateLimit> {
    valid
        .into_iter()
        .filter(|each| key_of(each).0 == namespace && each.spec.selects(labels))
        .min_by(|a, b| age_order(a).cmp(&age_order(b)))
}

/// Oldest first (one not stored yet, being applied, after any stored), then by name.
fn age_order(
    rate_limit: &RateLimit,
) -> (
    bool,
    Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    String,
) {
    let created = rate_limit.metadata.creation_timestamp.as_ref();
    (created.is_none(), created, rate_limit.name_any())
}

/// The status a RateLimit shows among `all` (it may be among them, in an older version), the
/// Functions there are given as (namespace, name, pod labels): `Error` when invalid,
/// `Warning` when it selects no Function's pods or an older RateLimit holds one it selects,
/// else `Ready`. Kyma's states and words. Pure.
pub fn status_of<'a>(
    rate_limit: &RateLimit,
    all: &[&RateLimit],
    functions: impl IntoIterator<Item = (&'a str, &'a str, &'a BTreeMap<String, String>)>,
) -> RateLimitStatus {
    let problems = rate_limit.spec.validate();
    if !problems.is_empty() {
        return RateLimitStatus {
            state: "Error".to_owned(),
            description: Some(
                problems
                    .into_iter()
                    .map(|problem| problem.message)
                    .collect::<Vec<_>>()
                    .join("; "),
            ),
        };
    }
    let own = key_of(rate_limit);
    // Validated once, not for every Function.
    let valid_others: Vec<&RateLimit> = all
        .iter()
        .copied()
        .filter(|other| {
            let key = key_of(other);
            key != own && key.0 == own.0 && other.spec.validate().is_empty()
        })
        .collect();
    let mut selected = false;
    let mut conflicting: Vec<String> = Vec::new();
    for (namespace, _, labels) in functions {
        if namespace != own.0 || !rate_limit.spec.selects(labels) {
            continue;
        }
        selected = true;
        let candidates = valid_others
            .iter()
            .copied()
            .chain(std::iter::once(rate_limit));
        if let Some(holder) = holder(candidates, namespace, labels)
            && key_of(holder) != own
            && !conflicting.contains(&holder.name_any())
        {
            conflicting.push(holder.name_any());
        }
    }
    let (state, description) = if !selected {
        // Kyma's words, its selectors printed as Go prints a map.
        let selectors: Vec<String> = rate_limit
            .spec
            .selector_labels
            .iter()
            .map(|(name, value)| format!("{name}:{value}"))
            .collect();
        (
            "Warning",
            format!(
                "no pods found with the given selectors: map[{}] in namespace {}",
                selectors.join(" "),
                own.0
            ),
        )
    } else if !conflicting.is_empty() {
        conflicting.sort();
        (
            "Warning",
            format!(
                "conflicting with the following RateLimit CRs: {}",
                conflicting.join(", ")
            ),
        )
    } else {
        ("Ready", "Finished reconciliation".to_owned())
    };
    RateLimitStatus {
        state: state.to_owned(),
        description: Some(description),
    }
}

/// The CRD, as Kyma's api-gateway serves it (eddy's schema).
pub fn crd()
-> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    use kube::CustomResourceExt as _;
    RateLimit::crd()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rate_limit(name: &str, created: &str, spec: serde_json::Value) -> RateLimit {
        serde_json::from_value(json!({
            "apiVersion": API_VERSION, "kind": "RateLimit",
            "metadata": {"name": name, "namespace": "test", "creationTimestamp": created},
            "spec": spec,
        }))
        .unwrap()
    }

    /// Kyma's sample (docs/user/local-rate-limit.md, "Deploying Path-Based Rate Limit
    /// Configuration").
    fn path_sample() -> serde_json::Value {
        json!({
            "selectorLabels": {"app": "httpbin"},
            "enableResponseHeaders": true,
            "local": {
                "defaultBucket": {"maxTokens": 5, "tokensPerFill": 5, "fillInterval": "60s"},
                "buckets": [{"path": "/ip", "bucket": {"maxTokens": 10, "tokensPerFill": 5, "fillInterval": "60m"}}],
            },
        })
    }

    #[test]
    fn kymas_samples_compile_with_enforce_on_by_default() {
        let sample = rate_limit(
            "ratelimit-path-sample",
            "2026-01-01T00:00:00Z",
            path_sample(),
        );
        assert!(sample.spec.enforce);
        let Buckets { default, buckets } = sample.spec.compiled().unwrap();
        assert_eq!(
            default,
            Bucket {
                max_tokens: 5,
                tokens_per_fill: 5,
                fill_interval: Duration::from_secs(60)
            }
        );
        assert_eq!(buckets[0].0.path.as_deref(), Some("/ip"));
        assert_eq!(buckets[0].1.fill_interval, Duration::from_secs(3600));
    }

    #[test]
    fn kymas_interval_rules_are_refused_in_kymas_words() {
        let mut spec = path_sample();
        spec["local"]["defaultBucket"]["fillInterval"] = json!("10ms");
        let problems = rate_limit("a", "2026-01-01T00:00:00Z", spec)
            .spec
            .validate();
        assert_eq!(
            problems[0],
            FieldError::new(
                "spec.local.defaultBucket.fillInterval",
                "defaultBucket: fillInterval must be greater or equal 50ms"
            )
        );
        let mut spec = path_sample();
        spec["local"]["buckets"][0]["bucket"]["fillInterval"] = json!("90s");
        let problems = rate_limit("a", "2026-01-01T00:00:00Z", spec)
            .spec
            .validate();
        assert_eq!(
            problems,
            vec![FieldError::new(
                "spec.local.buckets[0].bucket.fillInterval",
                "bucket '[0]': fillInterval must be a multiple of defaultBucket fillInterval"
            )]
        );
        let mut spec = path_sample();
        spec["local"]["buckets"][0] =
            json!({"bucket": {"maxTokens": 0, "tokensPerFill": 1, "fillInterval": "60s"}});
        spec["selectorLabels"] = json!({});
        let fields: Vec<String> = rate_limit("a", "2026-01-01T00:00:00Z", spec)
            .spec
            .validate()
            .into_iter()
            .map(|problem| problem.field)
            .collect();
        assert_eq!(
            fields,
            [
                "spec.selectorLabels",
                "spec.local.buckets[0]",
                "spec.local.buckets[0].bucket.maxTokens"
            ]
        );
    }

    #[test]
    fn the_oldest_rate_limit_selecting_a_pod_holds_it_and_the_others_say_so() {
        let httpbin: BTreeMap<String, String> = [("app".to_owned(), "httpbin".to_owned())].into();
        let older = rate_limit("older", "2026-01-01T00:00:00Z", path_sample());
        let newer = rate_limit("newer", "2026-01-02T00:00:00Z", path_sample());
        let all = [&older, &newer];
        let functions = [("test", "httpbin", &httpbin)];
        assert_eq!(
            holder(all, "test", &httpbin).map(kube::ResourceExt::name_any),
            Some("older".to_owned())
        );
        assert!(holder(all, "other", &httpbin).is_none());
        assert_eq!(
            status_of(&older, &all, functions),
            RateLimitStatus {
                state: "Ready".into(),
                description: Some("Finished reconciliation".into())
            }
        );
        assert_eq!(
            status_of(&newer, &all, functions),
            RateLimitStatus {
                state: "Warning".into(),
                description: Some("conflicting with the following RateLimit CRs: older".into())
            }
        );
        // Kyma's words for a selector without pods.
        assert_eq!(
            status_of(&older, &all, []),
            RateLimitStatus {
                state: "Warning".into(),
                description: Some(
                    "no pods found with the given selectors: map[app:httpbin] in namespace test"
                        .into()
                )
            }
        );
        // An invalid one holds nothing: the newer valid one does.
        let mut broken = path_sample();
        broken["local"]["defaultBucket"]["fillInterval"] = json!("1ms");
        let broken = rate_limit("older", "2026-01-01T00:00:00Z", broken);
        assert_eq!(
            status_of(&broken, &[&broken, &newer], functions).state,
            "Error"
        );
        assert_eq!(
            status_of(&newer, &[&broken, &newer], functions).state,
            "Ready"
        );
    }

    #[test]
    fn a_function_s_pods_are_selected_by_its_labels_and_kymas() {
        let function: Function = serde_json::from_value(json!({
            "apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
            "metadata": {"name": "httpbin", "namespace": "test"},
            "spec": {"runtime": "nodejs22", "source": {"inline": {"source": "x"}}, "labels": {"app": "httpbin"}},
        }))
        .unwrap();
        let labels = function_pod_labels(&function, "uid-1");
        let sample = rate_limit("a", "2026-01-01T00:00:00Z", path_sample());
        assert!(sample.spec.selects(&labels));
        assert_eq!(
            labels["serverless.kyma-project.io/function-name"],
            "httpbin"
        );
        assert_eq!(labels["eddy.dev/function"], "httpbin");
    }
}
