//! The APIRule resource: its spec (hosts, Service, rules, CORS, JWT and extAuth access) and
//! status, and what its spec says at a glance (full hosts, targets, hidden rules, warnings).

use super::{
    BTreeMap, CustomResource, Deserialize, JsonSchema, PathTemplate, Serialize, VERSION_ALPHA,
    full_host,
};

/// An APIRule: the host a Service (on eddy, a Function) is exposed on, and its access rules.
#[derive(CustomResource, JsonSchema, Debug, Clone, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "gateway.kyma-project.io",
    version = "v2",
    kind = "APIRule",
    plural = "apirules",
    namespaced,
    status = "ApiRuleStatus",
    printcolumn = r#"{"name":"Status","type":"string","jsonPath":".status.state"}"#,
    printcolumn = r#"{"name":"Hosts","type":"string","jsonPath":".spec.hosts"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiRuleSpec {
    /// Where the Service is exposed: a fully qualified name (`shop.example.com`) or one label
    /// (`shop`), which is prefixed to the gateway's domain; either may be a wildcard
    /// (`*.example.com`, `*`), which a more specific host of another APIRule overrides.
    #[schemars(length(min = 1, max = 8), inner(length(max = 255)))]
    pub hosts: Vec<String>,
    /// The Service that receives the calls (a rule may name its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ApiRuleService>,
    /// The Istio Gateway (`namespace/name`); eddy has one gateway and does not read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 127))]
    pub gateway: Option<String>,
    /// An external gateway (Kyma's, mutually exclusive with `gateway`); not read by eddy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 127))]
    pub external_gateway: Option<String>,
    /// CORS headers answered to browsers; without it, CORS headers are removed from answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cors_policy: Option<CorsPolicy>,
    /// The rules, in order: a request falls under the first that matches it.
    #[schemars(length(min = 1, max = 64))]
    pub rules: Vec<ApiRuleRule>,
    /// Seconds a call may take, for every rule that sets none (180 when not given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3900))]
    pub timeout: Option<u32>,
}

/// A Service an APIRule sends calls to.
#[derive(JsonSchema, Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiRuleService {
    /// Its name (on eddy, the Function's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Its namespace (the APIRule's when not given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Its port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<u32>,
}

/// One access rule: a path, its methods, and exactly one of `noAuth`, `jwt` or `extAuth`.
#[derive(JsonSchema, Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiRuleRule {
    /// An exact path (`/orders`), with `{*}` for one segment and `{**}` for any number (last),
    /// or `/*` for every path.
    #[schemars(length(min = 1, max = 1024))]
    pub path: String,
    /// The Service of this rule, instead of the APIRule's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ApiRuleService>,
    /// The methods the rule allows.
    #[serde(default)]
    #[schemars(length(max = 9))]
    pub methods: Vec<String>,
    /// Anyone may call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_auth: Option<bool>,
    /// Callers need a JWT from one of these issuers, with these scopes and audiences.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jwt: Option<JwtConfig>,
    /// External authorizers (extension providers of the gateway), then optional JWT checks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ext_auth: Option<ExtAuth>,
    /// Seconds a call under this rule may take.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3900))]
    pub timeout: Option<u32>,
    /// Headers and cookies added to the request before it is forwarded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<RuleRequest>,
}

/// JWT authentication and authorization of one rule.
#[derive(JsonSchema, Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JwtConfig {
    /// Accepted issuers: a token signed by any of them passes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub authentications: Vec<JwtAuthentication>,
    /// What a valid token must carry: one of these must be met (all its scopes, one of its
    /// audiences). None: any valid token.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub authorizations: Vec<JwtAuthorization>,
}

/// An issuer a rule accepts.
#[derive(JsonSchema, Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JwtAuthentication {
    /// The `iss` its tokens carry.
    #[serde(default)]
    #[schemars(length(max = 1024))]
    pub issuer: String,
    /// Where its public keys are (a JWKS).
    #[serde(default)]
    #[schemars(length(max = 2048))]
    pub jwks_uri: String,
    /// Headers the token is read from (default: `Authorization: Bearer`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub from_headers: Vec<JwtHeader>,
    /// Query parameters the token is read from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub from_params: Vec<String>,
}

/// A header a token is read from.
#[derive(JsonSchema, Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JwtHeader {
    /// The header's name.
    #[serde(default)]
    pub name: String,
    /// What comes before the token in it (`Bearer `); none: the whole value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
}

/// One way a token is authorized.
#[derive(JsonSchema, Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JwtAuthorization {
    /// Scopes the token must all have (in `scp`, `scope` or `scopes`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub required_scopes: Vec<String>,
    /// Audiences of which the token's `aud` must name one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub audiences: Vec<String>,
}

/// Kyma's external authorization: every named authorizer (an extension provider the gateway is
/// configured with, as Istio's mesh config names them) must allow the call, then
/// `restrictions` (a JWT) apply.
#[derive(JsonSchema, Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExtAuth {
    /// The authorizers, by extension provider name; each is asked in turn.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub authorizers: Vec<String>,
    /// JWT checks after the authorizers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restrictions: Option<JwtConfig>,
}

/// What is added to a request under a rule before it is forwarded.
#[derive(JsonSchema, Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RuleRequest {
    /// Cookies added to the `Cookie` header.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub cookies: BTreeMap<String, String>,
    /// Headers set.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
}

/// The CORS answers of an APIRule.
#[derive(JsonSchema, Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CorsPolicy {
    /// `Access-Control-Allow-Headers`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_headers: Vec<String>,
    /// `Access-Control-Allow-Methods`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_methods: Vec<String>,
    /// Origins allowed, each `{exact: …}`, `{prefix: …}` or `{regex: …}`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_origins: Vec<BTreeMap<String, String>>,
    /// `Access-Control-Allow-Credentials`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_credentials: Option<bool>,
    /// `Access-Control-Expose-Headers`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expose_headers: Vec<String>,
    /// `Access-Control-Max-Age`, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_age: Option<u64>,
}

/// An APIRule's status, as Kyma reports it.
#[derive(JsonSchema, Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApiRuleStatus {
    /// `Ready`, `Warning`, `Error` (or `Processing`).
    #[serde(default)]
    pub state: String,
    /// Why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// When it was last looked at (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_processed_time: Option<String>,
}

/// The CRD serving both versions (`v2` stored, `v2alpha1` read the same: no conversion).
pub fn crd()
-> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    use kube::CustomResourceExt as _;
    let mut crd = APIRule::crd();
    if let Some(stored) = crd.spec.versions.first().cloned() {
        let mut alpha = stored;
        alpha.name = VERSION_ALPHA.to_owned();
        alpha.storage = false;
        crd.spec.versions.push(alpha);
    }
    crd
}

/// The Kubernetes client's view of the APIRule kind (stored version).
pub fn resource() -> kube::core::ApiResource {
    kube::core::ApiResource::erase::<APIRule>(&())
}

impl ApiRuleSpec {
    /// The Service a rule sends to: its own, or the APIRule's.
    pub fn service_of<'a>(&'a self, rule: &'a ApiRuleRule) -> Option<&'a ApiRuleService> {
        rule.service.as_ref().or(self.service.as_ref())
    }

    /// Its hosts as served: a one-label host is prefixed to `domain`. Pure.
    pub fn full_hosts(&self, domain: &str) -> Vec<String> {
        self.hosts
            .iter()
            .map(|host| full_host(host, domain))
            .collect()
    }

    /// The Services (namespace, name) the rules of an APIRule in `namespace` send to, each
    /// once, in rule order. Pure.
    pub fn targets(&self, namespace: &str) -> Vec<(String, String)> {
        let mut targets: Vec<(String, String)> = Vec::new();
        for rule in &self.rules {
            let Some(service) = self.service_of(rule) else {
                continue;
            };
            let target_namespace = service.namespace.as_deref().unwrap_or(namespace);
            let name = service.name.as_deref().unwrap_or_default();
            if !targets
                .iter()
                .any(|(n, s)| n == target_namespace && s == name)
            {
                targets.push((target_namespace.to_owned(), name.to_owned()));
            }
        }
        targets
    }

    /// Each rule's path template and methods, in order (rules whose path does not parse are
    /// left out: validation refuses them).
    pub fn templates(&self) -> Vec<(PathTemplate, Vec<String>)> {
        self.rules
            .iter()
            .filter_map(|rule| Some((PathTemplate::parse(&rule.path).ok()?, rule.methods.clone())))
            .collect()
    }

    /// What eddy takes but does not act on.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if self.external_gateway.is_some() {
            warnings.push("spec.externalGateway is not read: eddy has one gateway".to_owned());
        }
        warnings
    }

    /// Rules an earlier rule hides (Kyma's trap: a rule sharing a method with an earlier one
    /// loses the earlier one's paths, for all of its methods). As on Kyma, such an APIRule is
    /// in `Error` and not honoured; applying it is not refused.
    pub fn hidden_rules(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        for (index, rule) in self.rules.iter().enumerate() {
            let Ok(template) = PathTemplate::parse(&rule.path) else {
                continue;
            };
            for (earlier_index, earlier) in self.rules[..index].iter().enumerate() {
                if !rule.methods.iter().any(|m| earlier.methods.contains(m)) {
                    continue;
                }
                let exact = !earlier.path.contains(['{', '*']);
                if earlier.path == rule.path {
                    warnings.push(format!(
                        "spec.rules[{index}] never applies: spec.rules[{earlier_index}] has its \
                         path and shares a method with it"
                    ));
                } else if exact && template.matches(&earlier.path) {
                    warnings.push(format!(
                        "spec.rules[{index}] does not apply to {} for any of its methods: \
                         spec.rules[{earlier_index}] shares a method with it (as on Kyma)",
                        earlier.path
                    ));
                }
            }
        }
        warnings
    }
}
