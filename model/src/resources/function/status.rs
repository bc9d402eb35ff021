//! What a Function's status reports.

use super::{BTreeMap, Condition, Deserialize, FunctionSpec, JsonSchema, Serialize};

/// Observed state of a Function.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FunctionStatus {
    /// `ConfigurationReady`, `BuildReady`, `Running`.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// Instances ready to serve.
    #[serde(default)]
    pub replicas: i32,
    /// Where to invoke it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The runtime the running instances use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    /// Label selector of the function's instances (`eddy.dev/function=NAME`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<String>,
    /// Failed builds of the current source in a row (Kubernetes; 0 once one succeeds).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub build_failures: i32,
    /// The commit a Git source's reference resolved to, which the current build is of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<String>,
    /// The image the function's pods run (Kubernetes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_image: Option<String>,
    /// The resource profile in use (`XS` … `XL`, or `custom` for explicit resources), as Kyma
    /// reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function_resource_profile: Option<String>,
    /// A Git source's reference and base directory, as Kyma reports them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repository: Option<RepositoryStatus>,
    /// A Git source as Kyma's current status reports it: the URL, the reference, the base
    /// directory and the commit built.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub git_repository: Option<GitRepositoryStatus>,
    /// The annotations the function's pods (locally, its instances) were given from the spec,
    /// as Kyma reports them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub function_annotations: BTreeMap<String, String>,
}

/// A Git source as Kyma's `status.gitRepository` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GitRepositoryStatus {
    /// The repository's URL.
    pub url: String,
    /// The directory of the function in the repository.
    #[serde(default)]
    pub base_dir: String,
    /// The branch, tag or commit asked for.
    #[serde(default)]
    pub reference: String,
    /// The commit the reference resolved to, which the current build is of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<String>,
}

/// A Git source as the status shows it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RepositoryStatus {
    /// The directory of the function in the repository.
    #[serde(default)]
    pub base_dir: String,
    /// The branch, tag or commit asked for.
    #[serde(default)]
    pub reference: String,
}

impl FunctionStatus {
    /// Fills in what the status says about the spec itself, as Kyma's does: the runtime, the
    /// resource profile, the pods' annotations and a Git source (with the `commit` already in
    /// the status).
    pub fn describe_spec(&mut self, spec: &FunctionSpec) {
        self.function_annotations = spec.pod_annotations();
        self.git_repository = spec
            .source
            .git_repository
            .as_ref()
            .map(|git| GitRepositoryStatus {
                url: git.url.clone(),
                base_dir: git.base_dir.clone().unwrap_or_else(|| "/".to_owned()),
                reference: git.reference.clone(),
                commit: self.commit.clone(),
            });
        self.runtime = Some(spec.runtime.as_str().to_owned());
        self.function_resource_profile =
            Some(spec.resource_profile().unwrap_or("custom").to_owned());
        self.repository = spec
            .source
            .git_repository
            .as_ref()
            .map(|git| RepositoryStatus {
                base_dir: git.base_dir.clone().unwrap_or_else(|| "/".to_owned()),
                reference: git.reference.clone(),
            });
    }
}

pub(super) fn is_zero(value: &i32) -> bool {
    *value == 0
}
