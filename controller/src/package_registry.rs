//! Kyma's private package registry configuration: a Secret named
//! `serverless-package-registry-config` holding `.npmrc` (Node.js) and/or `pip.conf` (Python),
//! in the Function's namespace, or cluster-wide in `kyma-system` with the label
//! `serverless.kyma-project.io/config: credentials`. The namespace's own wins. It is given only
//! to what installs a Function's dependencies (a local build's npm or pip; on Kubernetes the
//! buildless `install` init container or the image build), never to the function.
//!
//! Its contents are part of the build key: builds are shared by equal code, and a build
//! installed with one namespace's private registry must never serve another namespace's
//! Function that lacks it.

use std::collections::BTreeMap;

use eddy_model::resources::Runtime;
use sha2::{Digest as _, Sha256};

/// The Secret's name, in a namespace or in [`CLUSTER_NAMESPACE`].
pub const SECRET_NAME: &str = "serverless-package-registry-config";
/// Where the cluster-wide Secret is.
pub const CLUSTER_NAMESPACE: &str = "kyma-system";
/// The label the cluster-wide Secret must carry, and its value.
pub const CLUSTER_LABEL: (&str, &str) = ("serverless.kyma-project.io/config", "credentials");
/// The key holding npm's configuration.
pub const NPMRC_KEY: &str = ".npmrc";
/// The key holding pip's configuration.
pub const PIP_CONF_KEY: &str = "pip.conf";

/// The configuration a Function's dependency install uses, and where it came from.
#[derive(Clone, PartialEq, Eq)]
pub struct PackageRegistry {
    /// `namespace/name` of the Secret (said in logs and statuses; never its contents).
    pub secret: String,
    /// The Secret's name (in the Function's namespace on Kubernetes, where pods mount it).
    pub name: String,
    /// The configuration file of the Function's runtime (`.npmrc` or `pip.conf`).
    pub config: Vec<u8>,
}

impl std::fmt::Debug for PackageRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the contents: they hold registry tokens.
        f.debug_struct("PackageRegistry")
            .field("secret", &self.secret)
            .finish_non_exhaustive()
    }
}

/// The key of a Secret that `runtime`'s installer reads. Pure.
pub fn key_for(runtime: Runtime) -> &'static str {
    if runtime.node_major().is_some() {
        NPMRC_KEY
    } else {
        PIP_CONF_KEY
    }
}

/// Whether a Secret's labels make it the cluster-wide configuration. Pure.
pub fn is_cluster_wide(labels: Option<&BTreeMap<String, String>>) -> bool {
    labels
        .and_then(|labels| labels.get(CLUSTER_LABEL.0))
        .is_some_and(|value| value == CLUSTER_LABEL.1)
}

/// The configuration for a `runtime` Function in a namespace, from the namespace's own Secret
/// (`own`: its data) or else the cluster-wide one (`cluster`: its data, when labelled); `None`
/// when neither holds the runtime's key. Pure.
pub fn choose(
    runtime: Runtime,
    namespace: &str,
    own: Option<&BTreeMap<String, Vec<u8>>>,
    cluster: Option<&BTreeMap<String, Vec<u8>>>,
) -> Option<PackageRegistry> {
    let key = key_for(runtime);
    let (from, data) = match own {
        Some(data) => (namespace, data),
        None => (CLUSTER_NAMESPACE, cluster?),
    };
    let config = data.get(key)?.clone();
    Some(PackageRegistry {
        secret: format!("{from}/{SECRET_NAME}"),
        name: SECRET_NAME.to_owned(),
        config,
    })
}

impl PackageRegistry {
    /// The build key of code installed with this configuration: `hash` and the configuration's
    /// digest together, as long as a build key. Pure.
    pub fn keyed(&self, hash: &str) -> String {
        let mut hasher = Sha256::new();
        hasher.update(hash.as_bytes());
        hasher.update([0]);
        hasher.update(&self.config);
        hasher.finalize()[..10]
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, Vec<u8>> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn the_namespace_s_own_secret_wins_and_each_runtime_reads_its_key() {
        let own = data(&[(".npmrc", "@acme:registry=http://own/")]);
        let cluster = data(&[
            (".npmrc", "@acme:registry=http://cluster/"),
            (
                "pip.conf",
                "[global]\nextra-index-url = http://cluster/simple",
            ),
        ]);
        let node = choose(Runtime::Nodejs24, "shop", Some(&own), Some(&cluster)).unwrap();
        assert_eq!(node.secret, "shop/serverless-package-registry-config");
        assert_eq!(node.config, b"@acme:registry=http://own/");
        // The namespace's Secret has no pip.conf: Python installs use none (it is not merged
        // with the cluster-wide one).
        assert!(choose(Runtime::Python312, "shop", Some(&own), Some(&cluster)).is_none());
        let python = choose(Runtime::Python312, "shop", None, Some(&cluster)).unwrap();
        assert_eq!(
            python.secret,
            "kyma-system/serverless-package-registry-config"
        );
        assert!(choose(Runtime::Nodejs24, "shop", None, None).is_none());
        assert!(!format!("{node:?}").contains("acme"));
    }

    #[test]
    fn the_configuration_changes_the_build_key() {
        let registry = |config: &str| PackageRegistry {
            secret: "a/b".into(),
            name: "b".into(),
            config: config.as_bytes().to_vec(),
        };
        let hash = "0123456789abcdef0123";
        assert_eq!(registry("x").keyed(hash).len(), hash.len());
        assert_ne!(registry("x").keyed(hash), hash);
        assert_ne!(registry("x").keyed(hash), registry("y").keyed(hash));
        assert_eq!(registry("x").keyed(hash), registry("x").keyed(hash));
    }

    #[test]
    fn only_the_labelled_secret_is_cluster_wide() {
        let labelled = BTreeMap::from([(
            "serverless.kyma-project.io/config".to_owned(),
            "credentials".to_owned(),
        )]);
        assert!(is_cluster_wide(Some(&labelled)));
        assert!(!is_cluster_wide(None));
        assert!(!is_cluster_wide(Some(&BTreeMap::new())));
    }
}
