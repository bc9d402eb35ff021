//! What a Function is: its source, access, env, secret mounts, scaling and resources.

use super::{
    BTreeMap, CustomResource, Deserialize, Duration, ENV_NAME_MESSAGE, FunctionStatus,
    GIT_URL_MESSAGE, IntOrString, JsonSchema, KubeSchema, PROFILES, Quantity, Runtime, Serialize,
    preset_resources, quantity_bytes, quantity_value,
};

/// A Function: user code run on demand behind an HTTP address.
#[derive(CustomResource, KubeSchema, Debug, Clone, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "eddy.dev",
    version = "v1alpha1",
    kind = "Function",
    namespaced,
    validation = Rule::new(r"self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 63")
        .message("metadata.name must be a DNS-1035 label: lower-case letters, digits and '-', starting with a letter, at most 63 characters"),
    status = "FunctionStatus",
    // `kubectl scale` and KEDA set `spec.replicas`; the selector lets an HPA find the pods.
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.podSelector"
    ),
    // `fn` and `fns` are Kyma's Function's (kymaCompatibility): one short name, one kind.
    shortname = "efn",
    printcolumn = r#"{"name":"Runtime","type":"string","jsonPath":".spec.runtime"}"#,
    printcolumn = r#"{"name":"Replicas","type":"integer","jsonPath":".status.replicas"}"#,
    printcolumn = r#"{"name":"URL","type":"string","jsonPath":".status.url"}"#
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(validation = Rule::new("!has(self.timeoutSeconds) || !has(self.env) || !self.env.exists(e, e.name == 'FUNC_TIMEOUT')")
    .message("FUNC_TIMEOUT and spec.timeoutSeconds both set the timeout; keep one").field_path(".env"))]
pub struct FunctionSpec {
    /// `nodejs20`, `nodejs22`, `nodejs24`, `nodejs26`, `python311`, `python312` or `python314`
    /// (nodejs20 and nodejs22 are deprecated, as in Kyma).
    pub runtime: Runtime,
    /// Where the code comes from (exactly one kind).
    #[x_kube(validation = Rule::new("has(self.inline) != has(self.gitRepository)").message("exactly one source kind is required: inline or gitRepository"))]
    pub source: FunctionSource,
    /// Environment variables given to every instance.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 128))]
    #[x_kube(validation = Rule::new("self.all(e, self.exists_one(f, f.name == e.name))").message("env names must be unique"))]
    pub env: Vec<EnvVar>,
    /// A fixed number of instances (ignored when `scaleConfig` is set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 100").message("must be between 0 and 100"))]
    pub replicas: Option<i32>,
    /// Autoscaling bounds; `minReplicas: 0` scales to zero when idle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_config: Option<ScaleConfig>,
    /// CPU and memory of each instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_configuration: Option<ResourceConfiguration>,
    /// Who may invoke it through the gateway (default: anyone who reaches the gateway).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access: Option<AccessSpec>,
    /// Longest a handler may run before it is answered 504 (default: `FUNC_TIMEOUT` in `env`,
    /// else 180). No schema default: the API server would fill it in beside a Kyma user's
    /// `FUNC_TIMEOUT`, and the two would conflict.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 3600").message("must be between 1 and 3600"))]
    pub timeout_seconds: Option<i32>,
    /// Secrets whose keys appear as files under `mountPath` in every instance.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub secret_mounts: Vec<SecretMount>,
    /// Labels added to the function's instances (pods on Kubernetes).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations added to the function's instances (pods on Kubernetes).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Kyma's deprecated place for the pods' labels and annotations: taken, under `labels` and
    /// `annotations` (which win), with a warning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<PodTemplate>,
    /// An image to run instead of the runtime's (Kubernetes only).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "empty_as_none"
    )]
    #[schemars(length(max = 1024))]
    pub runtime_image_override: Option<String>,
    /// The pod's security context (Kubernetes only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_security_context: Option<k8s_openapi::api::core::v1::PodSecurityContext>,
    /// The function container's security context (Kubernetes only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_security_context: Option<k8s_openapi::api::core::v1::SecurityContext>,
}

/// A Secret shown to the function as files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretMount {
    /// The Secret, in the Function's namespace.
    #[schemars(length(max = 253))]
    pub secret_name: String,
    /// Absolute directory the Secret's keys appear in, one file per key.
    #[schemars(length(max = 1024))]
    #[x_kube(validation = Rule::new("self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')").message("must be an absolute path without '..'"))]
    pub mount_path: String,
}

/// Who may invoke a Function through the gateway.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(validation = Rule::new("self.mode != 'token' || (has(self.tokenDigests) && size(self.tokenDigests) > 0)")
    .message("mode token needs at least one entry in tokenDigests").field_path(".tokenDigests"))]
#[x_kube(validation = Rule::new("(self.mode == 'jwt') == has(self.jwt)")
    .message("jwt is required with mode jwt and allowed only with it").field_path(".jwt"))]
pub struct AccessSpec {
    /// `public` (default), `token` or `jwt`.
    #[serde(default)]
    pub mode: AccessMode,
    /// SHA-256 digests of the bearer tokens that may invoke it, as `sha256:<64 hex digits>`
    /// (`eddy token digest TOKEN` prints one); the tokens themselves are never stored.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(length(max = 71)))]
    #[x_kube(validation = Rule::new("self.all(d, d.matches('^sha256:[0-9a-f]{64}$'))").message("each must be sha256: followed by 64 lower-case hex digits"))]
    pub token_digests: Vec<String>,
    /// With mode `jwt`: the issuer and keys a caller's JWT must be signed by, and what it must
    /// claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jwt: Option<JwtAccess>,
}

/// JWT access: a bearer JWT signed by one of the issuer's keys (a JWKS), not expired, for one of
/// the audiences (when given), with every required claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JwtAccess {
    /// The `iss` a token must carry.
    #[schemars(length(min = 1, max = 1024))]
    pub issuer: String,
    /// Where the issuer's public keys are (a JWKS document): `https://`, or `http://` to this
    /// machine only.
    #[schemars(length(max = 2048))]
    #[x_kube(validation = Rule::new(r"self.startsWith('https://') || self.matches('^http://(localhost|127[.]0[.]0[.]1|\\[::1\\])(:[0-9]+)?(/.*)?$')").message("must be an https:// URL (http:// only to localhost)"))]
    pub jwks_uri: String,
    /// Accepted `aud` values; empty: `aud` is not checked.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub audiences: Vec<String>,
    /// Claims a token must have, with the value each must have: equal to a string claim, in
    /// an array claim, or one of the words of a space-separated claim (OAuth's `scope`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(length(max = 16))]
    pub required_claims: BTreeMap<String, String>,
}

/// Whether `uri` is a JWKS address eddy fetches: https, or http to this machine. Pure.
pub fn is_allowed_jwks_uri(uri: &str) -> bool {
    if uri.starts_with("https://") {
        return uri.len() > "https://".len();
    }
    let Some(rest) = uri.strip_prefix("http://") else {
        return false;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host = match authority.strip_prefix("[::1]") {
        Some(port) => return port.is_empty() || is_port_suffix(port),
        None => authority.split(':').next().unwrap_or_default(),
    };
    let port = &authority[host.len()..];
    matches!(host, "localhost" | "127.0.0.1") && (port.is_empty() || is_port_suffix(port))
}

pub(super) fn is_port_suffix(text: &str) -> bool {
    text.strip_prefix(':')
        .is_some_and(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
}

/// Access modes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum AccessMode {
    /// Anyone who reaches the gateway.
    #[default]
    Public,
    /// Only callers with a bearer token whose digest is listed (and the platform's dispatcher).
    Token,
    /// Only callers with a valid bearer JWT (see [`JwtAccess`]), and the platform's dispatcher.
    Jwt,
}

impl AccessSpec {
    /// The accepted token digests, or `None` when the Function is public.
    pub fn digests(&self) -> Option<Vec<[u8; 32]>> {
        (self.mode == AccessMode::Token).then(|| {
            self.token_digests
                .iter()
                .filter_map(|d| parse_digest(d))
                .collect()
        })
    }
}

/// Parses `sha256:<64 lower-case hex digits>`.
pub fn parse_digest(text: &str) -> Option<[u8; 32]> {
    let hex = text.strip_prefix("sha256:")?;
    if hex.len() != 64
        || !hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    let mut digest = [0u8; 32];
    for (index, byte) in digest.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[index * 2..index * 2 + 2], 16).ok()?;
    }
    Some(digest)
}

/// Source of a Function's code.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FunctionSource {
    /// Code given inline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inline: Option<InlineSource>,
    /// Code in a Git repository.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub git_repository: Option<GitRepositorySource>,
}

/// A directory of a Git repository at a branch, tag or commit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GitRepositorySource {
    /// `https://…`, `http://…`, `ssh://…`, `git@host:path`, `file://…`, or a host and path
    /// without a scheme (`github.com/org/repo`, fetched over HTTPS).
    #[schemars(length(max = 2048))]
    #[x_kube(validation = Rule::new("self.matches('^(https?://|ssh://|file://|[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:|[A-Za-z0-9][A-Za-z0-9-]*([.][A-Za-z0-9-]+)+(:[0-9]+)?/.)')").message(GIT_URL_MESSAGE))]
    pub url: String,
    /// Branch, tag or commit.
    #[schemars(length(max = 256))]
    #[x_kube(validation = Rule::new(r"self.matches('^[^-\\s][^\\s]*$')").message("must be a branch, tag or commit: no spaces, not starting with '-'"))]
    pub reference: String,
    /// Directory of the function in the repository (default: the top).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "empty_as_none"
    )]
    #[schemars(length(max = 1024))]
    #[x_kube(validation = Rule::new("!self.matches('(^|/)[.][.](/|$)')").message("must stay inside the repository: no '..'"))]
    pub base_dir: Option<String>,
    /// Credentials, from a Secret in the Function's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<RepositoryAuth>,
}

/// How to authenticate to a Git repository.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RepositoryAuth {
    /// `basic` (Secret keys `username`, `password`) or `key` (Secret keys `key` and, for an
    /// encrypted key, `password`).
    #[serde(rename = "type")]
    pub type_: RepositoryAuthType,
    /// The Secret holding the credentials.
    #[schemars(length(max = 253))]
    pub secret_name: String,
}

/// Kyma's deprecated `spec.template`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodTemplate {
    /// Labels of the function's pods.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations of the function's pods.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// Git credential kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum RepositoryAuthType {
    /// User name and password (or token) over HTTP.
    Basic,
    /// An SSH private key.
    Key,
}

/// Inline code and dependencies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InlineSource {
    /// `handler.js` or `handler.py`.
    #[schemars(length(max = 262144))]
    #[x_kube(validation = Rule::new(r"self.matches('\\S')").message("must not be empty"))]
    pub source: String,
    /// `package.json` or `requirements.txt` text.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 65536))]
    pub dependencies: String,
}

/// One environment variable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EnvVar {
    /// Name (as Kubernetes takes it: letters, digits, `_`, `-` and `.`, not starting with a
    /// digit; names the platform sets are reserved).
    #[schemars(length(max = 256))]
    #[x_kube(validation = Rule::new("self.matches('^[-._A-Za-z][-._A-Za-z0-9]*$')").message(ENV_NAME_MESSAGE))]
    #[x_kube(validation = Rule::new("!(self in ['FUNC_NAME', 'FUNC_NAMESPACE', 'SERVICE_NAMESPACE', 'FUNC_RUNTIME', 'FUNC_HANDLER', 'MOD_NAME', 'FUNC_PORT', 'EDDY_INSTANCE_SECRET', 'EDDY_PUBLISHER_TOKEN'])").message(Message::Expression("self + ' is set by the platform'".into())))]
    pub name: String,
    /// Value (no NUL byte: a process environment cannot hold one; at most 64 KiB, which also
    /// keeps the rule within the API server's cost budget).
    #[serde(default)]
    #[schemars(length(max = 65536))]
    #[x_kube(validation = Rule::new(r"!self.contains('\x00')").message("must not contain a NUL byte"))]
    pub value: String,
    /// The value, from a Secret or ConfigMap key in the Function's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_from: Option<EnvVarSource>,
}

/// Where an environment variable's value comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(validation = Rule::new("[has(self.secretKeyRef), has(self.configMapKeyRef), has(self.fieldRef), has(self.resourceFieldRef)].filter(x, x).size() == 1").message(VALUE_FROM_MESSAGE))]
pub struct EnvVarSource {
    /// A key of a Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_key_ref: Option<KeySelector>,
    /// A key of a ConfigMap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map_key_ref: Option<KeySelector>,
    /// A field of the pod (locally: of the Function).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field_ref: Option<FieldSelector>,
    /// A resource limit or request of the function's container (locally: of its profile).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_field_ref: Option<ResourceFieldSelector>,
}

/// Why a `valueFrom` is refused.
pub const VALUE_FROM_MESSAGE: &str =
    "set exactly one of secretKeyRef, configMapKeyRef, fieldRef and resourceFieldRef";

/// The pod fields `fieldRef` may name, as Kubernetes allows them for an env variable (besides
/// `metadata.labels['…']` and `metadata.annotations['…']`).
pub const POD_FIELDS: [&str; 9] = [
    "metadata.name",
    "metadata.namespace",
    "metadata.uid",
    "spec.nodeName",
    "spec.serviceAccountName",
    "status.hostIP",
    "status.hostIPs",
    "status.podIP",
    "status.podIPs",
];

/// The container resources `resourceFieldRef` may name.
pub const CONTAINER_RESOURCES: [&str; 6] = [
    "limits.cpu",
    "limits.memory",
    "limits.ephemeral-storage",
    "requests.cpu",
    "requests.memory",
    "requests.ephemeral-storage",
];

/// A field of the pod, as Kubernetes' `ObjectFieldSelector`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FieldSelector {
    /// `v1` (the default).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "empty_as_none"
    )]
    #[schemars(length(max = 16))]
    pub api_version: Option<String>,
    /// `metadata.name`, `metadata.namespace`, `metadata.labels['k']`, `status.podIP`, ….
    #[schemars(length(max = 512))]
    #[x_kube(validation = Rule::new(r"self in ['metadata.name', 'metadata.namespace', 'metadata.uid', 'spec.nodeName', 'spec.serviceAccountName', 'status.hostIP', 'status.hostIPs', 'status.podIP', 'status.podIPs'] || self.matches('^metadata[.](labels|annotations)\\[\'[^\']+\'\\]$')").message(FIELD_PATH_MESSAGE))]
    pub field_path: String,
}

/// Reads an optional string, an empty one as not set: Kyma's tools write `""` for a field left
/// blank (`runtimeImageOverride: ""`), and Kyma takes it as absent.
pub(super) fn empty_as_none<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<String>, D::Error> {
    Ok(Option::<String>::deserialize(deserializer)?.filter(|value| !value.is_empty()))
}

/// Why a `fieldRef.fieldPath` is refused.
pub const FIELD_PATH_MESSAGE: &str = "must be a pod field Kubernetes passes to env: metadata.name, metadata.namespace, metadata.uid, metadata.labels['…'], metadata.annotations['…'], spec.nodeName, spec.serviceAccountName, status.hostIP(s) or status.podIP(s)";

/// A resource of the function's container, as Kubernetes' `ResourceFieldSelector`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResourceFieldSelector {
    /// The container (the function's, when given).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "empty_as_none"
    )]
    #[schemars(length(max = 63))]
    pub container_name: Option<String>,
    /// `limits.cpu`, `limits.memory`, `requests.cpu`, `requests.memory`, ….
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new("self in ['limits.cpu', 'limits.memory', 'limits.ephemeral-storage', 'requests.cpu', 'requests.memory', 'requests.ephemeral-storage']").message(RESOURCE_MESSAGE))]
    pub resource: String,
    /// The unit of the value, a quantity (default `1`: whole cores, bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub divisor: Option<IntOrString>,
}

/// Why a `resourceFieldRef.resource` is refused.
pub const RESOURCE_MESSAGE: &str = "must be limits.cpu, limits.memory, limits.ephemeral-storage, requests.cpu, requests.memory or requests.ephemeral-storage";

/// What `fieldRef` and `resourceFieldRef` read in local mode, where there is no pod: the
/// Function's name and namespace, its `spec.labels` and `spec.annotations` (what its pods carry
/// on Kubernetes), loopback for the IPs, the machine's host name for the node, and the
/// resources of its profile.
pub struct LocalFields<'a> {
    /// The Function's name.
    pub name: &'a str,
    /// Its namespace.
    pub namespace: &'a str,
    /// Its spec.
    pub spec: &'a FunctionSpec,
    /// The machine's host name.
    pub node: &'a str,
}

impl LocalFields<'_> {
    /// The value of `source` when it is a `fieldRef` or `resourceFieldRef`; `None` otherwise.
    pub fn value(&self, source: &EnvVarSource) -> Option<String> {
        if let Some(field) = &source.field_ref {
            let path = field.field_path.as_str();
            let key_of = |prefix: &str| {
                path.strip_prefix(prefix)?
                    .strip_prefix("['")?
                    .strip_suffix("']")
                    .map(str::to_owned)
            };
            return Some(match path {
                "metadata.name" => self.name.to_owned(),
                "metadata.namespace" => self.namespace.to_owned(),
                "metadata.uid" => String::new(),
                "spec.nodeName" => self.node.to_owned(),
                "spec.serviceAccountName" => "default".to_owned(),
                "status.hostIP" | "status.hostIPs" | "status.podIP" | "status.podIPs" => {
                    "127.0.0.1".to_owned()
                }
                _ => {
                    if let Some(key) = key_of("metadata.labels") {
                        self.spec.pod_labels().remove(&key).unwrap_or_default()
                    } else if let Some(key) = key_of("metadata.annotations") {
                        self.spec.pod_annotations().remove(&key).unwrap_or_default()
                    } else {
                        String::new()
                    }
                }
            });
        }
        let resource = source.resource_field_ref.as_ref()?;
        let resources = self.spec.function_resources();
        let (kind, name) = resource.resource.split_once('.')?;
        let table = if kind == "limits" {
            &resources.limits
        } else {
            &resources.requests
        };
        let value = table
            .get(name)
            .and_then(|quantity| quantity_value(&quantity.0))
            .unwrap_or(0.0);
        let divisor = resource
            .divisor
            .as_ref()
            .and_then(|quantity| quantity_value(&quantity.to_string()))
            .filter(|divisor| *divisor > 0.0)
            .unwrap_or(1.0);
        // Kubernetes rounds up: 150m of CPU is 1 core.
        Some(format!("{}", (value / divisor).ceil()))
    }
}

/// One key of a Secret or ConfigMap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KeySelector {
    /// The Secret or ConfigMap.
    #[schemars(length(max = 253))]
    pub name: String,
    /// The key.
    #[schemars(length(max = 253))]
    pub key: String,
    /// When true, a missing object or key leaves the variable unset instead of holding the
    /// function back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optional: Option<bool>,
}

/// Which kind of object a [`KeySelector`] names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySource {
    /// A `v1` Secret.
    Secret,
    /// A `v1` ConfigMap.
    ConfigMap,
}

impl EnvVarSource {
    /// The object kind and key selected.
    pub fn selector(&self) -> Option<(KeySource, &KeySelector)> {
        match (&self.secret_key_ref, &self.config_map_key_ref) {
            (Some(secret), None) => Some((KeySource::Secret, secret)),
            (None, Some(config_map)) => Some((KeySource::ConfigMap, config_map)),
            _ => None,
        }
    }
}

/// Autoscaling bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(validation = Rule::new("self.maxReplicas >= self.minReplicas").message("maxReplicas must not be below minReplicas").field_path(".maxReplicas"))]
pub struct ScaleConfig {
    /// Fewest instances; 0 scales to zero.
    #[x_kube(validation = Rule::new("self >= 0 && self <= 100").message("must be between 0 and 100"))]
    pub min_replicas: i32,
    /// Most instances.
    #[x_kube(validation = Rule::new("self >= 1 && self <= 100").message("must be between 1 and 100"))]
    pub max_replicas: i32,
}

/// Resources of the function container.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResourceConfiguration {
    /// The function's own container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<ResourceRequest>,
    /// The build Job (Kubernetes only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<BuildResourceRequest>,
}

/// A build preset or explicit resources, never both.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(validation = Rule::new("!(has(self.profile) && self.profile != '' && has(self.resources))").message("set profile or resources, not both"))]
pub struct BuildResourceRequest {
    /// `local-dev`, `slow`, `normal` or `fast`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "empty_as_none"
    )]
    #[x_kube(validation = Rule::new("self in ['', 'local-dev', 'slow', 'normal', 'fast']").message("must be one of local-dev, slow, normal, fast"))]
    pub profile: Option<String>,
    /// Explicit requests and limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,
}

/// A preset or explicit resources, never both.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(validation = Rule::new("!(has(self.profile) && self.profile != '' && has(self.resources))").message("set profile or resources, not both"))]
pub struct ResourceRequest {
    /// `XS`, `S`, `M`, `L` or `XL`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "empty_as_none"
    )]
    #[x_kube(validation = Rule::new("self in ['', 'XS', 'S', 'M', 'L', 'XL']").message("must be one of XS, S, M, L, XL"))]
    pub profile: Option<String>,
    /// Explicit requests and limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,
}

/// Requests and limits, as in a Kubernetes container.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Resources {
    /// Limits (`cpu`, `memory`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, Quantity>,
    /// Requests (`cpu`, `memory`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub requests: BTreeMap<String, Quantity>,
}

/// Default handler timeout.
pub const DEFAULT_TIMEOUT_SECONDS: i32 = 180;

impl FunctionSpec {
    /// The labels of the function's instances: `labels` over the deprecated `template.labels`.
    pub fn pod_labels(&self) -> BTreeMap<String, String> {
        let mut labels = self
            .template
            .as_ref()
            .map(|t| t.labels.clone())
            .unwrap_or_default();
        labels.extend(self.labels.clone());
        labels
    }

    /// The annotations of the function's instances: `annotations` over the deprecated
    /// `template.annotations`.
    pub fn pod_annotations(&self) -> BTreeMap<String, String> {
        let mut annotations = self
            .template
            .as_ref()
            .map(|t| t.annotations.clone())
            .unwrap_or_default();
        annotations.extend(self.annotations.clone());
        annotations
    }

    /// Warnings for what is accepted but deprecated: the deprecated `template` and a runtime
    /// Kyma has deprecated.
    pub fn deprecated_fields(&self) -> Vec<String> {
        let mut deprecated = Vec::new();
        if self.template.is_some() {
            deprecated.push("spec.template is deprecated (as in Kyma): its labels and annotations are used as spec.labels and spec.annotations".to_owned());
        }
        deprecated.extend(
            self.runtime
                .deprecation()
                .map(|text| format!("spec.runtime: {text}")),
        );
        deprecated
    }

    /// What ConfigurationReady says of a valid spec, `configured`, with Kyma's warning when the
    /// runtime is deprecated (the Function still runs). Pure.
    pub fn configured_message(&self, configured: String) -> String {
        match self.runtime.deprecation() {
            Some(text) => format!("{configured}; Warning: {text}"),
            None => configured,
        }
    }

    /// The resource profile of one instance: the one named, the installation's default
    /// (`defaultPreset`, Kyma's `L`) when none is; `None` when explicit resources are given
    /// instead.
    pub fn resource_profile(&self) -> Option<&str> {
        let request = self
            .resource_configuration
            .as_ref()
            .and_then(|r| r.function.as_ref());
        let default = super::presets::presets_in_force().default_preset.as_str();
        match request {
            Some(request) if request.resources.is_some() => None,
            Some(request) => Some(request.profile.as_deref().unwrap_or(default)),
            None => Some(default),
        }
    }

    /// Requests and limits of one instance: the explicit ones, or the profile's, as this
    /// installation's presets set them (Kyma's by default).
    pub fn function_resources(&self) -> Resources {
        let explicit = self
            .resource_configuration
            .as_ref()
            .and_then(|r| r.function.as_ref())
            .and_then(|r| r.resources.clone());
        if let Some(explicit) = explicit {
            return explicit;
        }
        let presets = super::presets::presets_in_force();
        let preset = self
            .resource_profile()
            .and_then(|name| presets.preset(name))
            .or_else(|| presets.preset(&presets.default_preset));
        match preset {
            Some(preset) => preset_resources((
                "",
                &preset.request_cpu,
                &preset.request_memory,
                &preset.limit_cpu,
                &preset.limit_memory,
            )),
            None => preset_resources(PROFILES[3]),
        }
    }

    /// The memory limit of one instance in bytes: `resources.limits.memory` when resources are
    /// given (none there: no limit), else the profile's ([`DEFAULT_PROFILE`] when none is named).
    pub fn memory_limit_bytes(&self) -> Option<u64> {
        self.function_resources()
            .limits
            .get("memory")
            .and_then(|quantity| quantity_bytes(&quantity.0))
    }

    /// The (min, max) instance counts this spec asks for.
    pub fn replica_bounds(&self) -> (i32, i32) {
        match (self.scale_config, self.replicas) {
            (Some(scale), _) => (scale.min_replicas, scale.max_replicas),
            (None, Some(fixed)) => (fixed, fixed),
            (None, None) => (1, 1),
        }
    }

    /// The handler timeout: `timeoutSeconds`, or `FUNC_TIMEOUT` in `env` as Kyma users set it.
    pub fn timeout(&self) -> Duration {
        let from_env = self
            .env_value(FUNC_TIMEOUT_ENV)
            .and_then(|text| text.trim().parse::<i32>().ok());
        let seconds = self
            .timeout_seconds
            .or(from_env)
            .unwrap_or(DEFAULT_TIMEOUT_SECONDS);
        Duration::from_secs(u64::try_from(seconds).unwrap_or(1))
    }

    /// The literal value of an `env` entry (not one from `valueFrom`).
    pub fn env_value(&self, name: &str) -> Option<&str> {
        self.env
            .iter()
            .find(|var| var.name == name && var.value_from.is_none())
            .map(|var| var.value.as_str())
    }

    /// The Secrets and ConfigMaps the spec reads, each once: env `valueFrom`, `secretMounts`
    /// and the Git credentials.
    pub fn referenced_objects(&self) -> Vec<(KeySource, &str)> {
        let mut found: Vec<(KeySource, &str)> = Vec::new();
        for var in &self.env {
            if let Some((kind, selector)) = var.value_from.as_ref().and_then(EnvVarSource::selector)
            {
                found.push((kind, selector.name.as_str()));
            }
        }
        for mount in &self.secret_mounts {
            found.push((KeySource::Secret, mount.secret_name.as_str()));
        }
        if let Some(auth) = self
            .source
            .git_repository
            .as_ref()
            .and_then(|git| git.auth.as_ref())
        {
            found.push((KeySource::Secret, auth.secret_name.as_str()));
        }
        let mut unique = Vec::with_capacity(found.len());
        for item in found {
            if !unique.contains(&item) {
                unique.push(item);
            }
        }
        unique
    }

    /// Fields that matter only on Kubernetes and that this spec sets (local mode reports them
    /// as ignored).
    pub fn kubernetes_only_fields(&self) -> Vec<&'static str> {
        let mut fields = Vec::new();
        if self.runtime_image_override.is_some() {
            fields.push("spec.runtimeImageOverride");
        }
        if self.pod_security_context.is_some() {
            fields.push("spec.podSecurityContext");
        }
        if self.container_security_context.is_some() {
            fields.push("spec.containerSecurityContext");
        }
        if self
            .resource_configuration
            .as_ref()
            .is_some_and(|r| r.build.is_some())
        {
            fields.push("spec.resourceConfiguration.build");
        }
        if self
            .resource_configuration
            .as_ref()
            .is_some_and(|r| r.function.is_some())
        {
            fields.push("spec.resourceConfiguration.function");
        }
        fields
    }
}

/// The environment variable Kyma users set the handler timeout with.
pub const FUNC_TIMEOUT_ENV: &str = "FUNC_TIMEOUT";
/// The environment variable Kyma users set the Node.js body limit (MiB) with.
pub const REQ_MB_LIMIT_ENV: &str = "REQ_MB_LIMIT";
/// Kyma's current name for the body limit (MiB), of both runtimes.
pub const FUNC_BODY_MB_LIMIT_ENV: &str = "FUNC_BODY_MB_LIMIT";
