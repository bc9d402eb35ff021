//! What a Function reads from Secrets and ConfigMaps in local mode: `env[].valueFrom`,
//! `secretMounts` and the Git credentials. Resolved from the resource store before each
//! deploy; a missing object or key holds the function back with a status naming it, as a pod
//! waits on Kubernetes, and the function goes on when the object is applied.

use std::collections::BTreeMap;

use eddy_model::resources::{FunctionSpec, KeySource, LocalFields};
use eddy_platform::store::{Store, StoreError};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};

use crate::git::{GitCredentials, MissingCredentialKey};
use crate::package_registry::PackageRegistry;

/// The keys and values of one Secret or ConfigMap.
pub type Data = BTreeMap<String, Vec<u8>>;

/// What a Function's spec reads from Secrets and ConfigMaps, resolved.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Inputs {
    /// Every `env` entry with its value (entries whose optional source is missing left out).
    pub env: Vec<(String, String)>,
    /// Each `secretMounts` entry: the mount path and the Secret's keys and values.
    pub mounts: Vec<(String, Data)>,
    /// The Git credentials, when the source names a Secret.
    pub git_credentials: Option<GitCredentials>,
    /// The private package registry configuration its dependency install uses (Kyma's
    /// `serverless-package-registry-config`), when there is one.
    pub package_registry: Option<PackageRegistry>,
}

impl std::fmt::Debug for Inputs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Names only: values may be secret.
        f.debug_struct("Inputs")
            .field(
                "env",
                &self.env.iter().map(|(name, _)| name).collect::<Vec<_>>(),
            )
            .field(
                "mounts",
                &self.mounts.iter().map(|(path, _)| path).collect::<Vec<_>>(),
            )
            .field("git_credentials", &self.git_credentials)
            .field("package_registry", &self.package_registry)
            .finish()
    }
}

/// A Secret or ConfigMap a Function reads that is not there, or lacks the key it reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MissingReference {
    /// The object is not there.
    #[error("{field}: {kind} {name} not found")]
    Object {
        /// The Function's field that names it.
        field: String,
        /// `Secret` or `ConfigMap`.
        kind: &'static str,
        /// Its name.
        name: String,
    },
    /// The object has no such key.
    #[error("{field}: {kind} {name} has no key {key}")]
    Key {
        /// The Function's field that names it.
        field: String,
        /// `Secret` or `ConfigMap`.
        kind: &'static str,
        /// Its name.
        name: String,
        /// The key.
        key: String,
    },
}

/// Resolves the spec's references with `lookup` (the object's data, or `None` when there is no
/// such object). The error names the field and what is missing. Pure.
pub fn resolve_with(
    fields: &LocalFields<'_>,
    lookup: impl Fn(KeySource, &str) -> Option<Data>,
) -> Result<Inputs, MissingReference> {
    let spec = fields.spec;
    let describe = |kind: KeySource| match kind {
        KeySource::Secret => "Secret",
        KeySource::ConfigMap => "ConfigMap",
    };
    let mut inputs = Inputs::default();
    for (index, var) in spec.env.iter().enumerate() {
        if let Some(value) = var.value_from.as_ref().and_then(|from| fields.value(from)) {
            inputs.env.push((var.name.clone(), value));
            continue;
        }
        let Some((kind, selector)) = var.value_from.as_ref().and_then(|from| from.selector())
        else {
            inputs.env.push((var.name.clone(), var.value.clone()));
            continue;
        };
        let optional = selector.optional.unwrap_or(false);
        let value = match lookup(kind, &selector.name) {
            None if optional => continue,
            None => {
                return Err(MissingReference::Object {
                    field: format!("spec.env[{index}] ({})", var.name),
                    kind: describe(kind),
                    name: selector.name.clone(),
                });
            }
            Some(data) => match data.get(&selector.key) {
                None if optional => continue,
                None => {
                    return Err(MissingReference::Key {
                        field: format!("spec.env[{index}] ({})", var.name),
                        kind: describe(kind),
                        name: selector.name.clone(),
                        key: selector.key.clone(),
                    });
                }
                Some(bytes) => String::from_utf8_lossy(bytes).into_owned(),
            },
        };
        inputs.env.push((var.name.clone(), value));
    }
    for (index, mount) in spec.secret_mounts.iter().enumerate() {
        let data = lookup(KeySource::Secret, &mount.secret_name).ok_or_else(|| {
            MissingReference::Object {
                field: format!("spec.secretMounts[{index}]"),
                kind: "Secret",
                name: mount.secret_name.clone(),
            }
        })?;
        inputs.mounts.push((mount.mount_path.clone(), data));
    }
    if let Some(git) = &spec.source.git_repository
        && let Some(auth) = &git.auth
    {
        let data = lookup(KeySource::Secret, &auth.secret_name).ok_or_else(|| {
            MissingReference::Object {
                field: "spec.source.gitRepository.auth".to_owned(),
                kind: "Secret",
                name: auth.secret_name.clone(),
            }
        })?;
        let credentials = GitCredentials::from_secret(auth.type_, &data).map_err(
            |MissingCredentialKey(key)| MissingReference::Key {
                field: "spec.source.gitRepository.auth".to_owned(),
                kind: "Secret",
                name: auth.secret_name.clone(),
                key: key.to_string(),
            },
        )?;
        inputs.git_credentials = Some(credentials);
    }
    Ok(inputs)
}

/// The machine's host name (a local Function's `spec.nodeName`), read once.
fn host_name() -> &'static str {
    static HOST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    HOST.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|host| host.trim().to_owned())
            .unwrap_or_else(|_| "localhost".to_owned())
    })
}

/// Resolves the spec's references from the store.
pub async fn resolve(
    store: &Store,
    namespace: &str,
    name: &str,
    spec: &FunctionSpec,
) -> Result<Result<Inputs, MissingReference>, StoreError> {
    let mut found: Vec<((KeySource, String), Option<Data>)> = Vec::new();
    for (kind, name) in spec.referenced_objects() {
        let data = match kind {
            KeySource::Secret => store
                .get::<Secret>(namespace, name)
                .await?
                .map(|secret| secret_data(&secret)),
            KeySource::ConfigMap => store
                .get::<ConfigMap>(namespace, name)
                .await?
                .map(|config_map| config_map_data(&config_map)),
        };
        found.push(((kind, name.to_owned()), data));
    }
    let fields = LocalFields {
        name,
        namespace,
        spec,
        node: host_name(),
    };
    let package_registry = package_registry(store, namespace, spec).await?;
    Ok(resolve_with(&fields, |kind, name| {
        found
            .iter()
            .find(|((k, n), _)| *k == kind && n == name)
            .and_then(|(_, data)| data.clone())
    })
    .map(|inputs| Inputs {
        package_registry,
        ..inputs
    }))
}

/// The private package registry configuration a Function in `namespace` installs with: the
/// namespace's `serverless-package-registry-config`, else `kyma-system`'s when it carries
/// Kyma's label.
async fn package_registry(
    store: &Store,
    namespace: &str,
    spec: &FunctionSpec,
) -> Result<Option<PackageRegistry>, StoreError> {
    use crate::package_registry::{CLUSTER_NAMESPACE, SECRET_NAME, choose, is_cluster_wide};
    let own = store
        .get::<Secret>(namespace, SECRET_NAME)
        .await?
        .map(|secret| secret_data(&secret));
    let cluster = match own {
        Some(_) => None,
        None => store
            .get::<Secret>(CLUSTER_NAMESPACE, SECRET_NAME)
            .await?
            .filter(|secret| is_cluster_wide(secret.metadata.labels.as_ref()))
            .map(|secret| secret_data(&secret)),
    };
    Ok(choose(
        spec.runtime,
        namespace,
        own.as_ref(),
        cluster.as_ref(),
    ))
}

/// A Secret's keys and values (`stringData` was folded into `data` when it was applied).
pub fn secret_data(secret: &Secret) -> Data {
    let mut data: Data = secret
        .data
        .iter()
        .flatten()
        .map(|(key, value)| (key.clone(), value.0.clone()))
        .collect();
    for (key, value) in secret.string_data.iter().flatten() {
        data.insert(key.clone(), value.clone().into_bytes());
    }
    data
}

/// A ConfigMap's keys and values, text and binary.
pub fn config_map_data(config_map: &ConfigMap) -> Data {
    let mut data: Data = config_map
        .data
        .iter()
        .flatten()
        .map(|(key, value)| (key.clone(), value.clone().into_bytes()))
        .collect();
    for (key, value) in config_map.binary_data.iter().flatten() {
        data.insert(key.clone(), value.0.clone());
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(value: serde_json::Value) -> FunctionSpec {
        serde_json::from_value(value).unwrap()
    }

    fn lookup(kind: KeySource, name: &str) -> Option<Data> {
        match (kind, name) {
            (KeySource::Secret, "db") => Some([("password".to_owned(), b"s3cret".to_vec())].into()),
            (KeySource::ConfigMap, "settings") => {
                Some([("greeting".to_owned(), b"hello".to_vec())].into())
            }
            (KeySource::Secret, "git") => Some(
                [
                    ("username".to_owned(), b"u".to_vec()),
                    ("password".to_owned(), b"p".to_vec()),
                ]
                .into(),
            ),
            _ => None,
        }
    }

    fn fields(spec: &FunctionSpec) -> LocalFields<'_> {
        LocalFields {
            name: "orders",
            namespace: "shop",
            spec,
            node: "here",
        }
    }

    /// `fieldRef` and `resourceFieldRef` read the Function and its profile locally.
    #[test]
    fn field_and_resource_references_read_the_function_locally() {
        let spec = spec(json!({
            "runtime": "nodejs22", "source": {"inline": {"source": "x"}},
            "labels": {"tier": "gold"},
            "resourceConfiguration": {"function": {"profile": "XS"}},
            "env": [
                {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "TIER", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['tier']"}}},
                {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
                {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
                {"name": "MILLI", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1m"}}},
            ],
        }));
        let env = resolve_with(&fields(&spec), lookup).unwrap().env;
        let value = |name: &str| env.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
        assert_eq!(value("POD"), Some("orders"));
        assert_eq!(value("NS"), Some("shop"));
        assert_eq!(value("TIER"), Some("gold"));
        assert_eq!(value("IP"), Some("127.0.0.1"));
        assert_eq!(value("MEM"), Some("256"), "XS: 256Mi");
        assert_eq!(
            value("CPU"),
            Some("1"),
            "150m rounds up to one core, as on Kubernetes"
        );
        assert_eq!(value("MILLI"), Some("50"));
    }

    #[test]
    fn env_values_come_from_secrets_and_config_maps_in_order() {
        let spec = spec(json!({
            "runtime": "nodejs22", "source": {"inline": {"source": "x"}},
            "env": [
                {"name": "A", "value": "1"},
                {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "db", "key": "password"}}},
                {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "greeting"}}},
                {"name": "MAYBE", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k", "optional": true}}},
            ],
            "secretMounts": [{"secretName": "db", "mountPath": "/etc/db"}],
        }));
        let inputs = resolve_with(&fields(&spec), lookup).unwrap();
        assert_eq!(
            inputs.env,
            vec![
                ("A".to_owned(), "1".to_owned()),
                ("PASSWORD".to_owned(), "s3cret".to_owned()),
                ("GREETING".to_owned(), "hello".to_owned()),
            ]
        );
        assert_eq!(inputs.mounts[0].0, "/etc/db");
        assert_eq!(inputs.mounts[0].1["password"], b"s3cret");
        assert!(!format!("{inputs:?}").contains("s3cret"));
    }

    #[test]
    fn a_missing_object_or_key_is_named() {
        let missing_key = spec(json!({
            "runtime": "nodejs22", "source": {"inline": {"source": "x"}},
            "env": [{"name": "P", "valueFrom": {"secretKeyRef": {"name": "db", "key": "user"}}}],
        }));
        assert_eq!(
            resolve_with(&fields(&missing_key), lookup)
                .unwrap_err()
                .to_string(),
            "spec.env[0] (P): Secret db has no key user"
        );
        let missing_mount = spec(json!({
            "runtime": "nodejs22", "source": {"inline": {"source": "x"}},
            "secretMounts": [{"secretName": "nope", "mountPath": "/etc/x"}],
        }));
        assert_eq!(
            resolve_with(&fields(&missing_mount), lookup)
                .unwrap_err()
                .to_string(),
            "spec.secretMounts[0]: Secret nope not found"
        );
        let git = spec(json!({
            "runtime": "nodejs22",
            "source": {"gitRepository": {"url": "https://example.com/r.git", "reference": "main",
                                          "auth": {"type": "key", "secretName": "git"}}},
        }));
        assert_eq!(
            resolve_with(&fields(&git), lookup).unwrap_err().to_string(),
            "spec.source.gitRepository.auth: Secret git has no key key"
        );
    }
}
