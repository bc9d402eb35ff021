//! Kyma's APIRule (`gateway.kyma-project.io/v2`, and `v2alpha1` read the same): which host
//! exposes a Function, and who may call which path with which method. Types, validation, and
//! the pure decisions the gateways make with it: path templates (`/*`, `{*}`, `{**}`), which
//! rule a request falls under (Kyma's order and exclusions), and the host a short name means.

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::resources::{FieldError, is_dns1123_label};

/// The API group of Kyma's APIRule.
pub const GROUP: &str = "gateway.kyma-project.io";
/// The version eddy stores.
pub const VERSION: &str = "v2";
/// The older version read the same.
pub const VERSION_ALPHA: &str = "v2alpha1";
/// `gateway.kyma-project.io/v2`.
pub const API_VERSION: &str = "gateway.kyma-project.io/v2";
/// `gateway.kyma-project.io/v2alpha1`.
pub const API_VERSION_ALPHA: &str = "gateway.kyma-project.io/v2alpha1";
/// The methods a rule may list (Kyma's enum).
pub const METHODS: [&str; 9] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
];
/// The timeout of a rule that sets none, as Kyma's.
pub const DEFAULT_TIMEOUT_SECONDS: u32 = 180;
/// The longest timeout a rule may set, as Kyma's.
pub const MAX_TIMEOUT_SECONDS: u32 = 3900;

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

/// One piece of a path template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    /// This text exactly.
    Literal(String),
    /// `{*}`: any one segment (also an empty one).
    One,
    /// `{**}` or a trailing `/*`: any number of segments, none included.
    Any,
}

/// A rule's path (Kyma's templates): exact, with `{*}` and `{**}`, or `/*` for every path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathTemplate {
    segments: Vec<Segment>,
}

impl PathTemplate {
    /// Reads `path`, or says what is wrong with it. `v2alpha1`'s `/.*` means every path.
    pub fn parse(path: &str) -> Result<Self, String> {
        if path == "/*" || path == "/.*" {
            return Ok(Self {
                segments: vec![Segment::Any],
            });
        }
        let Some(rest) = path.strip_prefix('/') else {
            return Err("must start with /".to_owned());
        };
        let parts: Vec<&str> = rest.split('/').collect();
        let mut segments = Vec::with_capacity(parts.len());
        for (index, part) in parts.iter().enumerate() {
            let last = index + 1 == parts.len();
            let segment = match *part {
                "{*}" => Segment::One,
                "{**}" => Segment::Any,
                "*" if last => Segment::Any,
                text => {
                    if text.contains(['*', '{', '}']) {
                        return Err(format!(
                            "segment {text:?}: '*', '{{' and '}}' only in the operators {{*}} \
                             and {{**}}, or as a last /*"
                        ));
                    }
                    if let Some(bad) = text.chars().find(|c| !is_path_char(*c)) {
                        return Err(format!(
                            "segment {text:?}: {bad:?} is not allowed in a path"
                        ));
                    }
                    Segment::Literal(text.to_owned())
                }
            };
            segments.push(segment);
        }
        // Only literals may follow `{**}`: it must be the last operator.
        if segments
            .iter()
            .skip_while(|s| **s != Segment::Any)
            .skip(1)
            .any(|s| !matches!(s, Segment::Literal(_)))
        {
            return Err("{**} (or /*) must be the last operator".to_owned());
        }
        Ok(Self { segments })
    }

    /// Whether the request path `path` (without its query) matches.
    pub fn matches(&self, path: &str) -> bool {
        let path = path.strip_prefix('/').unwrap_or(path);
        let parts: Vec<&str> = path.split('/').collect();
        matches_from(&self.segments, &parts)
    }
}

/// Whether `parts` matches `segments`: `{**}` takes zero or more parts (only literals follow
/// it, so trying each split is linear in practice).
fn matches_from(segments: &[Segment], parts: &[&str]) -> bool {
    match segments.split_first() {
        None => parts.is_empty(),
        Some((Segment::Literal(text), rest)) => parts
            .split_first()
            .is_some_and(|(part, after)| part == text && matches_from(rest, after)),
        Some((Segment::One, rest)) => parts
            .split_first()
            .is_some_and(|(_, after)| matches_from(rest, after)),
        Some((Segment::Any, rest)) => {
            (0..=parts.len()).any(|taken| matches_from(rest, &parts[taken..]))
        }
    }
}

/// RFC 3986 path characters (Kyma's pattern), `%` for escapes.
fn is_path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "-._~!$&'()+,;=:@%".contains(c)
}

/// Which rule (by index) a `method` call to `path` falls under, as Kyma (Istio) decides: the
/// first rule that lists the method and matches the path, unless an earlier rule sharing any
/// method with it matches the path too (then the path is excluded from the later rule). `None`:
/// no rule allows the call. Pure.
pub fn select_rule(
    templates: &[(PathTemplate, Vec<String>)],
    method: &str,
    path: &str,
) -> Option<usize> {
    let shares = |a: &[String], b: &[String]| a.iter().any(|m| b.contains(m));
    templates
        .iter()
        .enumerate()
        .position(|(index, (template, methods))| {
            methods.iter().any(|m| m == method)
                && template.matches(path)
                && !templates[..index].iter().any(|(earlier, earlier_methods)| {
                    shares(earlier_methods, methods) && earlier.matches(path)
                })
        })
}

/// The host a request names (`Host` or `:authority`) as an APIRule host is compared with: lower
/// case, without its port. Pure.
pub fn request_host(host: &str) -> String {
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split_once(']').map_or(v6, |(address, _)| address),
        None => host
            .rsplit_once(':')
            .filter(|(_, port)| port.chars().all(|c| c.is_ascii_digit()))
            .map_or(host, |(name, _)| name),
    };
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// The full host a spec host means: a single label is prefixed to `domain`. Pure.
pub fn full_host(host: &str, domain: &str) -> String {
    if host.contains('.') || domain.is_empty() {
        host.to_ascii_lowercase()
    } else {
        format!("{}.{}", host.to_ascii_lowercase(), domain.trim_matches('.'))
    }
}

/// Namespace and name of an APIRule.
pub type RuleKey = (String, String);

/// One APIRule's claim on its hosts, for [`award_hosts`].
#[derive(Debug, Clone)]
pub struct HostClaim<'a> {
    /// Its namespace and name.
    pub key: &'a RuleKey,
    /// When it was created (one-second precision).
    pub created: Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// Whether it held its hosts before this decision.
    pub held: bool,
    /// Its full host names, or why it cannot be honoured (it claims nothing then).
    pub hosts: Result<&'a [String], &'a str>,
}

/// Who holds each host: the oldest APIRule naming it; in the same second the one that held it,
/// then by namespace and name. Every claim gets `Ok` (it holds all its hosts) or why not, in
/// the order they were decided. The gateways route by it and the controllers report it, so
/// both say the same. Pure.
pub fn award_hosts<'a>(mut claims: Vec<HostClaim<'a>>) -> Vec<(&'a RuleKey, Result<(), String>)> {
    claims.sort_by(|a, b| (a.created, !a.held, a.key).cmp(&(b.created, !b.held, b.key)));
    let mut holders: BTreeMap<&'a str, &'a RuleKey> = BTreeMap::new();
    let mut awarded = Vec::with_capacity(claims.len());
    for claim in claims {
        let hosts = match claim.hosts {
            Ok(hosts) => hosts,
            Err(problem) => {
                awarded.push((claim.key, Err(problem.to_owned())));
                continue;
            }
        };
        if let Some((host, (namespace, name))) = hosts
            .iter()
            .find_map(|host| Some((host, *holders.get(host.as_str())?)))
        {
            let problem = format!("host {host} is already exposed by APIRule {namespace}/{name}");
            awarded.push((claim.key, Err(problem)));
            continue;
        }
        for host in hosts {
            holders.insert(host, claim.key);
        }
        awarded.push((claim.key, Ok(())));
    }
    awarded
}

/// Whether `host` is a name Kyma takes: one lower-case DNS label, or at least two. Never an
/// address: a name of two labels or more, or a wildcard, may not end in an all-digit label
/// (RFC 3696 section 2: no top-level domain is all-numeric), so neither an IPv4 literal
/// (`127.0.0.1`) nor a wildcard that could match one (`*.0.0.1`, `*.1`) is a host. Pure.
fn is_host(host: &str) -> bool {
    // A wildcard (`*.example.com`, or `*` under the gateway's domain) as Kyma takes it.
    let named = match host.strip_prefix('*') {
        Some("") => return true,
        Some(rest) => match rest.strip_prefix('.') {
            Some(rest) => rest,
            None => return false,
        },
        None => host,
    };
    // One label alone is prefixed to the gateway's domain; a wildcard's or a full name's last
    // label is the name's end.
    let ends_named = named.contains('.') || host.starts_with('*');
    let numeric_top = ends_named
        && named
            .rsplit('.')
            .next()
            .is_some_and(|top| top.bytes().all(|b| b.is_ascii_digit()));
    host.len() <= 255 && named.split('.').all(is_dns1123_label) && !numeric_top
}

/// Whether an APIRule's full host (see [`full_host`]) takes `reserved`: names it, or is a
/// wildcard over it. Pure.
fn takes(host: &str, reserved: &str) -> bool {
    host == reserved || wildcard_suffix(host).is_some_and(|suffix| reserved.ends_with(suffix))
}

/// The hosts of an APIRule that the gateway answers to itself, each naming its field: its
/// domain and `gateway_hosts` (the names its `/<namespace>/<function>` routes are reached by),
/// or a wildcard over one of them. An APIRule holding one would be handed every call (and the
/// tokens they carry) that was meant for the gateway's own routes. Wildcard entries of
/// `gateway_hosts` reserve nothing (the chart's `expose.hosts: ["*"]` sends every name to the
/// gateway; the APIRules then take theirs). Pure.
pub fn check_gateway_hosts(
    rule: &APIRule,
    domain: &str,
    gateway_hosts: &[String],
) -> Vec<FieldError> {
    let domain = domain.trim_matches('.').to_ascii_lowercase();
    let reserved: Vec<String> = gateway_hosts
        .iter()
        .filter(|name| !name.contains('*'))
        .map(|name| request_host(name))
        .chain((!domain.is_empty()).then(|| domain.clone()))
        .collect();
    let mut errors = Vec::new();
    for (index, host) in rule.spec.hosts.iter().enumerate() {
        let full = full_host(host, &domain);
        if let Some(taken) = reserved.iter().find(|reserved| takes(&full, reserved)) {
            errors.push(FieldError {
                field: format!("spec.hosts[{index}]"),
                message: format!(
                    "{host:?} would take {taken}, a name the gateway itself answers to (its \
                     domain, or --gateway-hosts): name a host under {domain}"
                ),
            });
        }
    }
    errors
}

/// What a wildcard host matches the end of (`*.example.com`: `.example.com`); `None` for a
/// host without a wildcard. Pure.
pub fn wildcard_suffix(host: &str) -> Option<&str> {
    host.strip_prefix('*')
        .filter(|suffix| suffix.starts_with('.'))
}

/// The wildcard suffixes a request's `host` falls under, the most specific first
/// (`a.b.example.com`: `.b.example.com`, `.example.com`, `.com`), as an Istio Gateway's suffix
/// wildcards match: slices of `host`, nothing allocated. Pure.
pub fn host_suffixes(host: &str) -> impl Iterator<Item = &str> {
    host.match_indices('.').map(move |(dot, _)| &host[dot..])
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

/// Every problem with an APIRule, each naming its field. Pure.
pub fn validate_api_rule(rule: &APIRule) -> Vec<FieldError> {
    let mut errors = Vec::new();
    let mut error = |field: String, message: String| errors.push(FieldError { field, message });
    let spec = &rule.spec;
    if let Some(name) = rule.metadata.name.as_deref()
        && !is_dns1123_label(name)
    {
        error(
            "metadata.name".into(),
            "must be a DNS-1123 label: lower-case letters, digits and '-', at most 63 characters"
                .into(),
        );
    }
    if spec.hosts.is_empty() {
        error("spec.hosts".into(), "name at least one host".into());
    }
    for (index, host) in spec.hosts.iter().enumerate() {
        if !is_host(host) {
            error(
                format!("spec.hosts[{index}]"),
                format!(
                    "{host:?} is not a host: one lower-case DNS label (prefixed to the gateway's \
                     domain) or a fully qualified name such as shop.example.com, either may \
                     start with a wildcard (*.example.com); never an IP address"
                ),
            );
        }
    }
    if spec.rules.is_empty() {
        error("spec.rules".into(), "give at least one rule".into());
    }
    if let Some(service) = &spec.service {
        check_service("spec.service", service, &mut error);
    }
    if spec
        .timeout
        .is_some_and(|t| t == 0 || t > MAX_TIMEOUT_SECONDS)
    {
        error(
            "spec.timeout".into(),
            format!("must be 1 to {MAX_TIMEOUT_SECONDS} seconds"),
        );
    }
    if let Some(cors) = &spec.cors_policy {
        for (index, origin) in cors.allow_origins.iter().enumerate() {
            let known = origin.len() == 1
                && origin
                    .keys()
                    .all(|k| matches!(k.as_str(), "exact" | "prefix" | "regex"));
            if !known {
                error(
                    format!("spec.corsPolicy.allowOrigins[{index}]"),
                    "must be one of {exact: …}, {prefix: …} or {regex: …}".into(),
                );
            }
        }
    }
    for (index, rule) in spec.rules.iter().enumerate() {
        let at = format!("spec.rules[{index}]");
        if let Err(problem) = PathTemplate::parse(&rule.path) {
            error(format!("{at}.path"), problem);
        }
        if rule.methods.is_empty() {
            error(
                format!("{at}.methods"),
                "list the methods the rule allows".into(),
            );
        }
        for (m, method) in rule.methods.iter().enumerate() {
            if !METHODS.contains(&method.as_str()) {
                error(
                    format!("{at}.methods[{m}]"),
                    format!("{method:?} is not one of {}", METHODS.join(", ")),
                );
            }
        }
        match &rule.service {
            Some(service) => check_service(&format!("{at}.service"), service, &mut error),
            None if spec.service.is_none() => error(
                format!("{at}.service"),
                "name a service here or in spec.service".into(),
            ),
            None => {}
        }
        if rule
            .timeout
            .is_some_and(|t| t == 0 || t > MAX_TIMEOUT_SECONDS)
        {
            error(
                format!("{at}.timeout"),
                format!("must be 1 to {MAX_TIMEOUT_SECONDS} seconds"),
            );
        }
        let strategies = usize::from(rule.no_auth == Some(true))
            + usize::from(rule.jwt.is_some())
            + usize::from(rule.ext_auth.is_some());
        if strategies != 1 {
            error(
                at.clone(),
                "give exactly one access strategy: noAuth: true, jwt or extAuth".into(),
            );
        }
        if let Some(ext_auth) = &rule.ext_auth {
            if ext_auth.authorizers.is_empty() {
                error(
                    format!("{at}.extAuth.authorizers"),
                    "name at least one authorizer (an extension provider of the gateway)".into(),
                );
            }
            for (a, name) in ext_auth.authorizers.iter().enumerate() {
                if name.is_empty() {
                    error(format!("{at}.extAuth.authorizers[{a}]"), "is empty".into());
                }
            }
        }
        let jwt_checks = [
            (rule.jwt.as_ref(), "jwt"),
            (
                rule.ext_auth.as_ref().and_then(|e| e.restrictions.as_ref()),
                "extAuth.restrictions",
            ),
        ];
        for (jwt, field) in jwt_checks {
            let Some(jwt) = jwt else { continue };
            let at = format!("{at}.{field}");
            if jwt.authentications.is_empty() {
                error(
                    format!("{at}.authentications"),
                    "name at least one issuer (issuer and jwksUri)".into(),
                );
            }
            for (a, authentication) in jwt.authentications.iter().enumerate() {
                let at = format!("{at}.authentications[{a}]");
                if authentication.issuer.is_empty() {
                    error(format!("{at}.issuer"), "is required".into());
                }
                if !crate::resources::is_allowed_jwks_uri(&authentication.jwks_uri) {
                    error(
                        format!("{at}.jwksUri"),
                        "must be an https:// URL (http:// only to localhost)".into(),
                    );
                }
                for (h, header) in authentication.from_headers.iter().enumerate() {
                    if http::HeaderName::from_bytes(header.name.as_bytes()).is_err() {
                        error(
                            format!("{at}.fromHeaders[{h}].name"),
                            format!("{:?} is not a header name", header.name),
                        );
                    }
                }
            }
        }
        if let Some(request) = &rule.request {
            for (name, value) in &request.headers {
                if http::HeaderName::from_bytes(name.as_bytes()).is_err()
                    || http::HeaderValue::from_str(value).is_err()
                {
                    error(
                        format!("{at}.request.headers[{name}]"),
                        "is not a valid header".into(),
                    );
                } else if !is_settable_request_header(name) {
                    error(
                        format!("{at}.request.headers[{name}]"),
                        "a rule cannot set this header: it frames or routes the request, or \
                         carries the caller's credentials (use request.cookies for cookies)"
                            .into(),
                    );
                }
            }
            for (name, value) in &request.cookies {
                if name.is_empty() || name.contains([';', '=', ' ']) || value.contains(';') {
                    error(
                        format!("{at}.request.cookies[{name}]"),
                        "is not a valid cookie".into(),
                    );
                }
            }
        }
    }
    errors
}

/// Headers a rule may not set on the requests it forwards: the ones that frame the request
/// (a wrong `content-length` cuts a body or leaves the upstream waiting for one), route it, or
/// carry who the caller is (the rule would hand every caller someone's identity).
const UNSETTABLE_HEADERS: [&str; 14] = [
    "content-length",
    "transfer-encoding",
    "host",
    "connection",
    "te",
    "trailer",
    "upgrade",
    "keep-alive",
    "expect",
    "authorization",
    "proxy-authorization",
    "proxy-authenticate",
    "proxy-connection",
    "cookie",
];

/// Whether a rule may set the request header `name` (any case). Pure.
pub fn is_settable_request_header(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    !UNSETTABLE_HEADERS.contains(&name.as_str())
        && !name.starts_with("proxy-")
        && !name.starts_with(':')
}

/// The rule every APIRule is held to beside [`validate_api_rule`]: it sends calls only to
/// Services of its own namespace, or of a namespace the operator opened to APIRules of other
/// namespaces (`open`; `*` opens every namespace). Kyma lets any APIRule name any namespace;
/// eddy's gateway also serves every Function on its own path, so an APIRule crossing namespaces
/// would let one namespace open another's Functions. Each crossing is an error naming its
/// field. Pure.
pub fn check_namespace_boundary(rule: &APIRule, open: &[String]) -> Vec<FieldError> {
    let own = rule.metadata.namespace.as_deref().unwrap_or("default");
    let opened = |namespace: &str| open.iter().any(|o| o == "*" || o == namespace);
    let mut errors = Vec::new();
    let mut check = |at: String, service: &ApiRuleService| {
        if let Some(namespace) = service.namespace.as_deref()
            && namespace != own
            && !opened(namespace)
        {
            errors.push(FieldError {
                field: format!("{at}.namespace"),
                message: format!(
                    "an APIRule in namespace {own} cannot send calls to namespace {namespace}: \
                     APIRules reach Services of their own namespace, and of those the operator \
                     opens to other namespaces (--apirule-open-namespaces)"
                ),
            });
        }
    };
    if let Some(service) = &rule.spec.service {
        check("spec.service".to_owned(), service);
    }
    for (index, each) in rule.spec.rules.iter().enumerate() {
        if let Some(service) = &each.service {
            check(format!("spec.rules[{index}].service"), service);
        }
    }
    errors
}

fn check_service(at: &str, service: &ApiRuleService, error: &mut impl FnMut(String, String)) {
    match service.name.as_deref() {
        Some(name) if is_dns1123_label(name) => {}
        Some(name) => error(
            format!("{at}.name"),
            format!("{name:?} is not a Service name (a DNS-1123 label)"),
        ),
        None => error(format!("{at}.name"), "is required".into()),
    }
    if let Some(namespace) = service.namespace.as_deref()
        && !is_dns1123_label(namespace)
    {
        error(
            format!("{at}.namespace"),
            format!("{namespace:?} is not a namespace (a DNS-1123 label)"),
        );
    }
    match service.port {
        Some(1..=65535) => {}
        Some(_) => error(format!("{at}.port"), "must be 1 to 65535".into()),
        None => error(format!("{at}.port"), "is required".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(path: &str) -> PathTemplate {
        PathTemplate::parse(path).unwrap()
    }

    #[test]
    fn path_templates_match_as_kyma_documents_them() {
        let cases: [(&str, &[&str], &[&str]); 7] = [
            ("/*", &["/", "/a", "/a/b/c"], &[]),
            ("/", &["/"], &["/a"]),
            (
                "/example/one",
                &["/example/one"],
                &["/example/one/", "/example", "/example/two"],
            ),
            (
                "/example/{*}",
                &["/example/anything", "/example/"],
                &["/example/a/b"],
            ),
            (
                "/example/{*}/one",
                &["/example/anything/one", "/example/two/one"],
                &["/example/one", "/example/a/b/one"],
            ),
            (
                "/example/{**}",
                &[
                    "/example/anything",
                    "/example/anything/more",
                    "/example/",
                    "/example",
                ],
                &["/other"],
            ),
            (
                "/example/{**}/one",
                &[
                    "/example/anything/two/one",
                    "/example/anything/one",
                    "/example/one",
                ],
                &["/example/anything"],
            ),
        ];
        for (path, matching, other) in cases {
            let template = template(path);
            for request in matching {
                assert!(template.matches(request), "{path} should match {request}");
            }
            for request in other {
                assert!(
                    !template.matches(request),
                    "{path} should not match {request}"
                );
            }
        }
        assert!(template("/{*}/example/{*}/*").matches("/anything/example/anything/more"));
        assert!(template("/.*").matches("/x/y"));
    }

    #[test]
    fn bad_paths_are_refused() {
        for path in ["orders", "/a*", "/{**}/{**}", "/a/{x}", "/a b", "/{**}/{*}"] {
            assert!(
                PathTemplate::parse(path).is_err(),
                "{path} should be refused"
            );
        }
    }

    fn rules(list: &[(&str, &[&str])]) -> Vec<(PathTemplate, Vec<String>)> {
        list.iter()
            .map(|(path, methods)| {
                (
                    template(path),
                    methods.iter().map(|m| (*m).to_owned()).collect(),
                )
            })
            .collect()
    }

    #[test]
    fn the_first_matching_rule_applies_with_kymas_exclusions() {
        // Kyma's ordering example: rule 1 (GET) hides /anything/one from rule 2 for POST too.
        let excluding = rules(&[
            ("/anything/one", &["GET"]),
            ("/anything/{**}", &["GET", "POST"]),
        ]);
        assert_eq!(select_rule(&excluding, "GET", "/anything/one"), Some(0));
        assert_eq!(select_rule(&excluding, "POST", "/anything/one"), None);
        assert_eq!(select_rule(&excluding, "POST", "/anything/two"), Some(1));
        assert_eq!(select_rule(&excluding, "DELETE", "/anything/two"), None);
        // Its fix: separate rules per method.
        let fixed = rules(&[
            ("/anything/one", &["GET"]),
            ("/anything/{**}", &["GET"]),
            ("/anything/{**}", &["POST"]),
        ]);
        assert_eq!(select_rule(&fixed, "POST", "/anything/one"), Some(2));
        assert_eq!(select_rule(&fixed, "GET", "/anything/two"), Some(1));
    }

    #[test]
    fn hosts_compare_without_port_and_short_hosts_take_the_domain() {
        assert_eq!(request_host("Hello.localhost:8080"), "hello.localhost");
        assert_eq!(request_host("shop.example.com."), "shop.example.com");
        assert_eq!(request_host("[::1]:8080"), "::1");
        assert_eq!(full_host("hello", "localhost"), "hello.localhost");
        assert_eq!(
            full_host("shop.example.com", "localhost"),
            "shop.example.com"
        );
    }

    #[test]
    fn validation_names_each_field() {
        let rule: APIRule = serde_json::from_value(serde_json::json!({
            "apiVersion": API_VERSION, "kind": "APIRule", "metadata": {"name": "r"},
            "spec": {
                "hosts": ["Bad_Host"],
                "rules": [
                    {"path": "/a*", "methods": ["FETCH"], "noAuth": true},
                    {"path": "/*", "methods": ["GET"], "extAuth": {"authorizers": [""],
                     "restrictions": {"authentications": [{"issuer": "", "jwksUri": "https://i/jwks"}]}},
                     "service": {"name": "s", "port": 70000}},
                    {"path": "/x", "methods": ["GET"], "jwt": {"authentications": [{"issuer": "i", "jwksUri": "http://example.com/jwks"}]},
                     "service": {"name": "s", "port": 80}},
                ],
            },
        }))
        .unwrap();
        let fields: Vec<String> = validate_api_rule(&rule)
            .into_iter()
            .map(|e| e.field)
            .collect();
        assert_eq!(
            fields,
            [
                "spec.hosts[0]",
                "spec.rules[0].path",
                "spec.rules[0].methods[0]",
                "spec.rules[0].service",
                "spec.rules[1].service.port",
                "spec.rules[1].extAuth.authorizers[0]",
                "spec.rules[1].extAuth.restrictions.authentications[0].issuer",
                "spec.rules[2].jwt.authentications[0].jwksUri",
            ]
        );
    }

    #[test]
    fn no_apirule_takes_a_name_the_gateway_answers_to() {
        let rule = |hosts: &[&str]| -> APIRule {
            serde_json::from_value(serde_json::json!({
                "apiVersion": API_VERSION, "kind": "APIRule", "metadata": {"name": "r"},
                "spec": {"hosts": hosts, "service": {"name": "s", "port": 80},
                         "rules": [{"path": "/*", "methods": ["GET"], "noAuth": true}]},
            }))
            .unwrap()
        };
        let own = [
            "localhost".to_owned(),
            "eddy-gateway.eddy-system.svc.cluster.local".to_owned(),
            "*".to_owned(),
        ];
        let taken = |hosts: &[&str]| -> Vec<String> {
            check_gateway_hosts(&rule(hosts), "example.com", &own)
                .into_iter()
                .map(|e| e.field)
                .collect()
        };
        assert!(taken(&["shop", "*", "a.example.com", "*.shop.example.com"]).is_empty());
        assert_eq!(taken(&["example.com"]), ["spec.hosts[0]"]);
        // One label is under the domain: `localhost` is `localhost.example.com`, no gateway name.
        assert!(taken(&["localhost"]).is_empty());
        assert_eq!(taken(&["*.svc.cluster.local"]), ["spec.hosts[0]"]);
        assert_eq!(
            taken(&["eddy-gateway.eddy-system.svc.cluster.local"]),
            ["spec.hosts[0]"]
        );
        // `*` under `localhost` matches names under it, never `localhost` itself.
        assert!(check_gateway_hosts(&rule(&["*"]), "localhost", &own).is_empty());
        assert_eq!(
            check_gateway_hosts(
                &rule(&["localhost.localhost"]),
                "localhost",
                &["localhost.localhost:8080".to_owned()]
            )
            .len(),
            1
        );
    }

    #[test]
    fn kymas_trap_is_found() {
        let spec: ApiRuleSpec = serde_json::from_value(serde_json::json!({
            "hosts": ["h"], "service": {"name": "s", "port": 80},
            "rules": [
                {"path": "/anything/one", "methods": ["GET"], "noAuth": true},
                {"path": "/anything/{**}", "methods": ["GET", "POST"], "noAuth": true},
            ],
        }))
        .unwrap();
        assert!(spec.warnings().is_empty());
        let warnings = spec.hidden_rules();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("spec.rules[1] does not apply to /anything/one"),
            "{warnings:?}"
        );
    }

    #[test]
    fn wildcard_hosts_are_taken_and_matched_most_specific_first() {
        for good in ["*", "*.example.com", "*.shop.example.com", "shop"] {
            assert!(is_host(good), "{good}");
        }
        for bad in [
            "*example.com",
            "a*.example.com",
            "shop.*.com",
            "*.",
            "**.example.com",
            // Addresses, and wildcards that could match one, are no hosts.
            "127.0.0.1",
            "*.0.0.1",
            "*.1",
            "10.0.0.42",
            "::1",
            "[::1]",
        ] {
            assert!(!is_host(bad), "{bad}");
        }
        assert_eq!(full_host("*", "localhost"), "*.localhost");
        assert_eq!(wildcard_suffix("*.example.com"), Some(".example.com"));
        assert_eq!(wildcard_suffix("shop.example.com"), None);
        let suffixes: Vec<&str> = host_suffixes("a.b.example.com").collect();
        assert_eq!(suffixes, [".b.example.com", ".example.com", ".com"]);
    }
}
