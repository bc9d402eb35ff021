//! APIRules at the gateway, in both modes: which host exposes which Function (or, on
//! Kubernetes, Service), which rule a call falls under, and whether its caller passes that
//! rule (`noAuth`, or a JWT from one of the rule's issuers with one of its authorizations).
//! Also CORS as the APIRule's `corsPolicy` says, and the headers and cookies a rule adds.
//!
//! A call whose host an APIRule names is routed by the APIRule alone. A call on the gateway's
//! own `/<namespace>/<function>/` path to a Function some APIRule exposes must also pass one of
//! those APIRules' rules, so a rule's JWT cannot be walked around. The Function's own `access`
//! applies on both ways in: an APIRule never opens what `access` closes.
//!
//! Which APIRule holds a host is `eddy_model::apirule::award_hosts`, which the controller's
//! status also reports.

use std::{collections::HashMap, sync::Arc, time::Duration};

use axum::response::{IntoResponse as _, Response};
use eddy_model::apirule::{
    APIRule, ApiRuleSpec, CorsPolicy, DEFAULT_TIMEOUT_SECONDS, HostClaim, JwtAuthorization,
    JwtConfig, JwtHeader, NotHonoured, PathTemplate, award_hosts, host_suffixes, reads_as_address,
    request_host, select_rule, wildcard_suffix,
};
use eddy_model::ext_authz::UnusableAuthorizer;
use eddy_model::resources::JwtAccess;
use eddy_platform::errors::ErrorResponse;
use eddy_platform::flags::ApiRuleArgs;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use kube::ResourceExt as _;
use parking_lot::RwLock;
use serde_json::Value;

use crate::ext_authz::{Authorizer, CheckSlots, Granted};
use crate::jwt::{JwtVerifier, Refusal};

/// What Kyma's gateway (Istio's RBAC filter) answers a call no rule allows, or one without the
/// token or the claims a rule asks for: 403 with these words.
pub const RBAC_DENIED: &str = "RBAC: access denied";
/// What eddy's gateway answers a call on an APIRule's host that no rule has a route for (Kyma's
/// gateway, Envoy, answers 404 with no body): 404 with these words.
pub const NO_ROUTE: &str = "no rule of this host's APIRule lists this method and path";
/// What Kyma's gateway (Envoy's JWT filter) answers a token that fails verification: 401. It
/// answers so too when the issuer's keys could not be fetched: Istio then gives Envoy a key
/// no token is signed with.
pub const JWT_VERIFICATION_FAILS: &str = "Jwt verification fails";
/// What Kyma's gateway (Envoy's JWT filter) answers a token whose `iss` is none of the rule's
/// issuers: 401.
pub const JWT_ISSUER_NOT_CONFIGURED: &str = "Jwt issuer is not configured";

/// Why the gateway does not serve an APIRule: not honoured (the controller's status says the
/// same), or what it names cannot be built here.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NotServed {
    /// Invalid, hiding rules, or naming a host an older APIRule holds.
    #[error(transparent)]
    NotHonoured(#[from] NotHonoured),
    /// A rule with no Service, its own or the spec's.
    #[error("spec.rules[{index}]: no service")]
    NoService {
        /// The rule's index.
        index: usize,
    },
    /// An `extAuth` authorizer the gateway cannot use.
    #[error(transparent)]
    Authorizer(#[from] UnusableAuthorizer),
    /// A `corsPolicy.allowOrigins` regex that does not compile.
    #[error("allowOrigins regex {pattern:?}: {source}")]
    OriginPattern {
        /// The pattern as written.
        pattern: String,
        /// Why it does not compile.
        source: regex::Error,
    },
    /// The HTTP client fetching an issuer's keys could not be built (no TLS roots).
    #[error("no TLS for the JWKS client: {0}")]
    JwksClient(Arc<std::io::Error>),
    /// No APIRule of that name is known.
    #[error("not known")]
    NotKnown,
}

/// Where a rule sends its calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleService {
    /// The Service's (Function's) namespace.
    pub namespace: String,
    /// The Service's (Function's) name.
    pub name: String,
    /// The Service's port (on Kubernetes; a local Function is found by name).
    pub port: u16,
}

/// One issuer a JWT rule accepts, and where its token is read from.
struct Issuer {
    verifier: JwtVerifier,
    from_headers: Vec<JwtHeader>,
    from_params: Vec<String>,
}

/// A rule's JWT check: a token from one of its issuers, meeting one of its authorizations.
struct JwtCheck {
    issuers: Vec<Issuer>,
    authorizations: Vec<JwtAuthorization>,
}

enum RuleAccess {
    NoAuth,
    Jwt(JwtCheck),
    /// Every authorizer in turn, then the JWT `restrictions`.
    ExtAuth {
        authorizers: Vec<Authorizer>,
        restrictions: Option<JwtCheck>,
    },
}

/// One rule, ready to decide calls.
pub struct Rule {
    /// Where its calls go.
    pub target: RuleService,
    /// How long a call under it may take.
    pub timeout: Duration,
    access: RuleAccess,
    headers: Vec<(HeaderName, HeaderValue)>,
    cookies: Option<String>,
}

/// An APIRule, ready to decide calls.
pub struct Exposure {
    /// The APIRule's namespace.
    pub namespace: String,
    /// The APIRule's name.
    pub name: String,
    /// Its full host names (short ones with the gateway's domain).
    pub hosts: Vec<String>,
    templates: Vec<(PathTemplate, Vec<String>)>,
    rules: Vec<Rule>,
    cors: Option<Cors>,
    /// What it was compiled from (an unchanged APIRule is not compiled again: its JWT
    /// verifiers keep their keys).
    spec: ApiRuleSpec,
}

/// A rule an allowed call falls under.
#[derive(Clone)]
pub struct Chosen {
    exposure: Arc<Exposure>,
    index: usize,
}

impl Chosen {
    /// The rule.
    pub fn rule(&self) -> &Rule {
        &self.exposure.rules[self.index]
    }

    /// The APIRule.
    pub fn exposure(&self) -> &Arc<Exposure> {
        &self.exposure
    }

    /// Checks the caller against the rule: `noAuth` passes; a JWT rule needs a token from one
    /// of its issuers (401), meeting one of its authorizations (403); an `extAuth` rule asks
    /// each authorizer about the `method` call to `path_and_query` (the path the rule matched),
    /// then checks its JWT restrictions. What the authorizers grant is returned. The
    /// authorizers answer by `deadline` (the end of the rule's timeout), or the call is over.
    pub async fn admit(
        &self,
        method: &Method,
        path_and_query: &str,
        headers: &HeaderMap,
        query: Option<&str>,
        deadline: tokio::time::Instant,
    ) -> Result<Granted, Response> {
        let mut granted = Granted::default();
        match &self.rule().access {
            RuleAccess::NoAuth => {}
            RuleAccess::Jwt(check) => self.check_jwt(check, headers, query).await?,
            RuleAccess::ExtAuth {
                authorizers,
                restrictions,
            } => {
                for authorizer in authorizers {
                    authorizer
                        .check(method, path_and_query, headers, deadline, &mut granted)
                        .await?;
                }
                if let Some(check) = restrictions {
                    self.check_jwt(check, headers, query).await?;
                }
            }
        }
        Ok(granted)
    }

    /// A JWT check of the rule, answered as Kyma's gateway answers.
    async fn check_jwt(
        &self,
        check: &JwtCheck,
        headers: &HeaderMap,
        query: Option<&str>,
    ) -> Result<(), Response> {
        let JwtCheck {
            issuers,
            authorizations,
        } = check;
        let exposure = &self.exposure;
        // As Kyma's gateway (Istio) answers: no token, or a token the rule does not authorize,
        // is 403 `RBAC: access denied`; a token that fails verification, or whose issuer's
        // keys cannot be fetched, is 401 `Jwt verification fails` (with `WWW-Authenticate:
        // Bearer`). Why is logged, not said: the keys that cannot be fetched as a warning
        // (the verifier's), the caller's fault at debug.
        let refused = |refusal: Refusal| {
            tracing::debug!(
                apirule = %format_args!("{}/{}", exposure.namespace, exposure.name),
                why = %refusal.message,
                "APIRule refused a call"
            );
            match refusal.status {
                StatusCode::FORBIDDEN => ErrorResponse::text(StatusCode::FORBIDDEN, RBAC_DENIED),
                _ => ErrorResponse::text(StatusCode::UNAUTHORIZED, JWT_VERIFICATION_FAILS),
            }
            .into_response()
        };
        let found = issuers.iter().find_map(|issuer| {
            let token = token_from(issuer, headers, query)?;
            Some((issuer, token))
        });
        let Some((first, token)) = found else {
            return Err(refused(Refusal {
                status: StatusCode::FORBIDDEN,
                message: "a bearer JWT is required".to_owned(),
            }));
        };
        // The issuer is told by the token's `iss` (read unverified only to pick the keys); a
        // token without one is checked against the first issuer, whose `iss` it then lacks.
        let issuer = match unverified_issuer(&token) {
            None => first,
            Some(claimed) => issuers
                .iter()
                .find(|issuer| issuer.verifier.spec().issuer == claimed)
                .ok_or_else(|| {
                    tracing::debug!(
                        apirule = %format_args!("{}/{}", exposure.namespace, exposure.name),
                        "APIRule refused a token of an issuer it does not name"
                    );
                    ErrorResponse::text(StatusCode::UNAUTHORIZED, JWT_ISSUER_NOT_CONFIGURED)
                        .into_response()
                })?,
        };
        let claims = issuer.verifier.check_token(&token).await.map_err(refused)?;
        if authorizations.is_empty() || authorizations.iter().any(|a| authorized(&claims, a)) {
            Ok(())
        } else {
            Err(refused(Refusal {
                status: StatusCode::FORBIDDEN,
                message: "the JWT lacks the scopes or audience the rule requires".to_owned(),
            }))
        }
    }

    /// Adds the rule's headers and cookies to a request about to be forwarded.
    pub fn decorate(&self, headers: &mut HeaderMap) {
        let rule = self.rule();
        for (name, value) in &rule.headers {
            headers.insert(name.clone(), value.clone());
        }
        if let Some(cookies) = &rule.cookies {
            let joined = match headers.get(header::COOKIE).and_then(|v| v.to_str().ok()) {
                Some(existing) if !existing.is_empty() => format!("{existing}; {cookies}"),
                _ => cookies.clone(),
            };
            if let Ok(value) = HeaderValue::from_str(&joined) {
                headers.insert(header::COOKIE, value);
            }
        }
    }
}

/// The token a request carries for `issuer`: its headers (default `Authorization: Bearer`),
/// then its query parameters.
fn token_from(issuer: &Issuer, headers: &HeaderMap, query: Option<&str>) -> Option<String> {
    if issuer.from_headers.is_empty() && issuer.from_params.is_empty() {
        return eddy_platform::auth::bearer_token(headers).map(str::to_owned);
    }
    for source in &issuer.from_headers {
        let Some(value) = headers.get(&source.name).and_then(|v| v.to_str().ok()) else {
            continue;
        };
        let token = match source.prefix.as_deref() {
            Some(prefix) => value.strip_prefix(prefix).map(str::trim_start),
            None => Some(value),
        };
        if let Some(token) = token.filter(|t| !t.is_empty()) {
            return Some(token.to_owned());
        }
    }
    let query = query?;
    url::form_urlencoded::parse(query.as_bytes())
        .find(|(name, _)| issuer.from_params.iter().any(|p| p == name))
        .map(|(_, value)| value.into_owned())
}

/// The `iss` a JWT claims, unverified. Pure.
fn unverified_issuer(token: &str) -> Option<String> {
    use base64::Engine as _;
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: Value = serde_json::from_slice(&bytes).ok()?;
    claims.get("iss")?.as_str().map(str::to_owned)
}

/// Whether `claims` meet `authorization`: every required scope (in `scp`, `scope` or
/// `scopes`, a list or space-separated words) and every listed audience (`aud`: one audience
/// or a list of them, as RFC 7519 says; a string is never split). Kyma's api-gateway docs:
/// "The token's aud claim must contain all listed audiences". Pure.
pub fn authorized(claims: &Value, authorization: &JwtAuthorization) -> bool {
    let words = |value: &Value| -> Vec<String> {
        match value {
            Value::String(text) => text.split(' ').map(str::to_owned).collect(),
            Value::Array(items) => items
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect(),
            _ => Vec::new(),
        }
    };
    let scopes: Vec<String> = ["scp", "scope", "scopes"]
        .iter()
        .filter_map(|claim| claims.get(*claim))
        .flat_map(words)
        .collect();
    let audience_named = |audience: &String| match claims.get("aud") {
        Some(Value::String(one)) => one == audience,
        Some(Value::Array(list)) => list.iter().any(|each| each.as_str() == Some(audience)),
        _ => false,
    };
    authorization
        .required_scopes
        .iter()
        .all(|scope| scopes.contains(scope))
        && authorization.audiences.iter().all(audience_named)
}

impl std::fmt::Debug for Exposure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exposure")
            .field("namespace", &self.namespace)
            .field("name", &self.name)
            .field("hosts", &self.hosts)
            .finish_non_exhaustive()
    }
}

impl Exposure {
    /// The rule a `method` call to `path` falls under. None is as Kyma's gateway answers it: a
    /// call no rule lists the method and path of has no route (404); one that a rule lists but
    /// an earlier rule takes the path from (Kyma's trap) is routed and not allowed (403 `RBAC:
    /// access denied`).
    pub fn choose(self: &Arc<Self>, method: &Method, path: &str) -> Result<Chosen, ErrorResponse> {
        if let Some(index) = select_rule(&self.templates, method.as_str(), path) {
            return Ok(Chosen {
                exposure: self.clone(),
                index,
            });
        }
        let routed = self.templates.iter().any(|(template, methods)| {
            methods.iter().any(|m| m == method.as_str()) && template.matches(path)
        });
        tracing::debug!(
            apirule = %format_args!("{}/{}", self.namespace, self.name),
            %method, path, routed, "no rule allows the call"
        );
        Err(if routed {
            ErrorResponse::text(StatusCode::FORBIDDEN, RBAC_DENIED)
        } else {
            ErrorResponse::text(StatusCode::NOT_FOUND, NO_ROUTE)
        })
    }

    /// The answer to a CORS preflight (`OPTIONS` with `Origin` and
    /// `Access-Control-Request-Method`), when the APIRule has a `corsPolicy`.
    pub fn preflight(&self, method: &Method, headers: &HeaderMap) -> Option<Response> {
        let cors = self.cors.as_ref()?;
        if method != Method::OPTIONS || !headers.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
        {
            return None;
        }
        let origin = headers.get(header::ORIGIN)?;
        let mut response = StatusCode::OK.into_response();
        if cors.allows(origin) {
            let answer = response.headers_mut();
            answer.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
            for (name, value) in &cors.preflight {
                answer.insert(name.clone(), value.clone());
            }
        }
        Some(response)
    }

    /// Sets an answer's CORS headers as the APIRule says: the function's own are removed, and
    /// with a `corsPolicy`, an allowed origin gets the policy's.
    pub fn cors_answer(&self, origin: Option<&HeaderValue>, answer: &mut HeaderMap) {
        for name in CORS_HEADERS {
            answer.remove(name);
        }
        let (Some(cors), Some(origin)) = (&self.cors, origin) else {
            return;
        };
        if cors.allows(origin) {
            answer.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
            for (name, value) in &cors.actual {
                answer.insert(name.clone(), value.clone());
            }
            answer.append(header::VARY, HeaderValue::from_static("Origin"));
        }
    }
}

const CORS_HEADERS: [HeaderName; 6] = [
    header::ACCESS_CONTROL_ALLOW_ORIGIN,
    header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
    header::ACCESS_CONTROL_ALLOW_HEADERS,
    header::ACCESS_CONTROL_ALLOW_METHODS,
    header::ACCESS_CONTROL_EXPOSE_HEADERS,
    header::ACCESS_CONTROL_MAX_AGE,
];

/// A `corsPolicy`, ready to answer.
struct Cors {
    origins: Vec<OriginMatch>,
    /// Headers of a preflight answer (besides the origin).
    preflight: Vec<(HeaderName, HeaderValue)>,
    /// Headers of an actual answer (besides the origin).
    actual: Vec<(HeaderName, HeaderValue)>,
}

enum OriginMatch {
    Exact(String),
    Prefix(String),
    Regex(regex::Regex),
}

impl Cors {
    fn new(policy: &CorsPolicy) -> Result<Self, NotServed> {
        let mut origins = Vec::new();
        for origin in &policy.allow_origins {
            for (kind, value) in origin {
                origins.push(match kind.as_str() {
                    "exact" => OriginMatch::Exact(value.clone()),
                    "prefix" => OriginMatch::Prefix(value.clone()),
                    _ => OriginMatch::Regex(regex::Regex::new(&format!("^(?:{value})$")).map_err(
                        |source| NotServed::OriginPattern {
                            pattern: value.clone(),
                            source,
                        },
                    )?),
                });
            }
        }
        let list = |items: &[String]| HeaderValue::from_str(&items.join(",")).ok();
        let mut preflight = Vec::new();
        let mut actual = Vec::new();
        if let Some(value) =
            list(&policy.allow_methods).filter(|_| !policy.allow_methods.is_empty())
        {
            preflight.push((header::ACCESS_CONTROL_ALLOW_METHODS, value));
        }
        if let Some(value) =
            list(&policy.allow_headers).filter(|_| !policy.allow_headers.is_empty())
        {
            preflight.push((header::ACCESS_CONTROL_ALLOW_HEADERS, value));
        }
        if let Some(max_age) = policy.max_age {
            preflight.push((header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from(max_age)));
        }
        if policy.allow_credentials == Some(true) {
            let value = HeaderValue::from_static("true");
            preflight.push((header::ACCESS_CONTROL_ALLOW_CREDENTIALS, value.clone()));
            actual.push((header::ACCESS_CONTROL_ALLOW_CREDENTIALS, value));
        }
        if let Some(value) =
            list(&policy.expose_headers).filter(|_| !policy.expose_headers.is_empty())
        {
            // Envoy's CORS filter sets it on every answer to an allowed origin, its own answer
            // to a preflight included.
            preflight.push((header::ACCESS_CONTROL_EXPOSE_HEADERS, value.clone()));
            actual.push((header::ACCESS_CONTROL_EXPOSE_HEADERS, value));
        }
        Ok(Self {
            origins,
            preflight,
            actual,
        })
    }

    fn allows(&self, origin: &HeaderValue) -> bool {
        let Ok(origin) = origin.to_str() else {
            return false;
        };
        self.origins.iter().any(|allowed| match allowed {
            OriginMatch::Exact(exact) => exact == origin,
            OriginMatch::Prefix(prefix) => origin.starts_with(prefix.as_str()),
            OriginMatch::Regex(regex) => regex.is_match(origin),
        })
    }
}

/// An APIRule compiled for the gateway, or why it cannot be (the status's description):
/// invalid, or sending calls across the namespace boundary. Its authorizers count their checks
/// in flight in `slots`.
pub fn compile(
    rule: &APIRule,
    serving: &ApiRuleArgs,
    slots: &CheckSlots,
) -> Result<Exposure, NotServed> {
    serving.honourable(rule)?;
    let namespace = rule.namespace().unwrap_or_else(|| "default".to_owned());
    let spec = &rule.spec;
    let mut rules = Vec::with_capacity(spec.rules.len());
    for (index, each) in spec.rules.iter().enumerate() {
        let service = spec
            .service_of(each)
            .ok_or(NotServed::NoService { index })?;
        let target = RuleService {
            namespace: service
                .namespace
                .clone()
                .unwrap_or_else(|| namespace.clone()),
            name: service.name.clone().unwrap_or_default(),
            port: service
                .port
                .and_then(|p| u16::try_from(p).ok())
                .unwrap_or(80),
        };
        let access = match (&each.jwt, &each.ext_auth) {
            (Some(jwt), _) => RuleAccess::Jwt(jwt_check(jwt)?),
            (None, Some(ext_auth)) => RuleAccess::ExtAuth {
                authorizers: ext_auth
                    .authorizers
                    .iter()
                    .map(|name| {
                        let spec = serving.providers().authorizer(name)?;
                        Ok(Authorizer::new(spec, slots))
                    })
                    .collect::<Result<_, NotServed>>()?,
                restrictions: ext_auth.restrictions.as_ref().map(jwt_check).transpose()?,
            },
            (None, None) => RuleAccess::NoAuth,
        };
        let request = each.request.clone().unwrap_or_default();
        let headers = crate::header_pairs(&request.headers);
        let cookies = (!request.cookies.is_empty()).then(|| {
            request
                .cookies
                .iter()
                .map(|(name, value)| format!("{name}={value}"))
                .collect::<Vec<_>>()
                .join("; ")
        });
        let seconds = each
            .timeout
            .or(spec.timeout)
            .unwrap_or(DEFAULT_TIMEOUT_SECONDS);
        rules.push(Rule {
            target,
            timeout: Duration::from_secs(u64::from(seconds)),
            access,
            headers,
            cookies,
        });
    }
    let cors = spec.cors_policy.as_ref().map(Cors::new).transpose()?;
    Ok(Exposure {
        namespace,
        name: rule.name_any(),
        hosts: spec.full_hosts(&serving.domain),
        templates: spec.templates(),
        rules,
        cors,
        spec: spec.clone(),
    })
}

/// A rule's (or `extAuth` restrictions') JWT configuration, ready to check tokens.
fn jwt_check(jwt: &JwtConfig) -> Result<JwtCheck, NotServed> {
    let issuers = jwt
        .authentications
        .iter()
        .map(|authentication| {
            let verifier = JwtVerifier::new(JwtAccess {
                issuer: authentication.issuer.clone(),
                jwks_uri: authentication.jwks_uri.clone(),
                audiences: Vec::new(),
                required_claims: Default::default(),
            })
            .map_err(|error| NotServed::JwksClient(Arc::new(error)))?;
            Ok(Issuer {
                verifier,
                from_headers: authentication.from_headers.clone(),
                from_params: authentication.from_params.clone(),
            })
        })
        .collect::<Result<_, NotServed>>()?;
    Ok(JwtCheck {
        issuers,
        authorizations: jwt.authorizations.clone(),
    })
}

type Key = eddy_model::apirule::RuleKey;

/// One APIRule as the gateway knows it: compiled, or why it cannot be.
struct Entry {
    /// The APIRule, compiled again when the authorizers change.
    rule: APIRule,
    /// Who keeps a host both name: the one created first (in the same second, the one that
    /// held it, then by namespace and name).
    created: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    compiled: Result<Arc<Exposure>, NotServed>,
    /// The Services its rules name, honoured or not (a Function an APIRule of its namespace
    /// names is closed on its own path while none of them is honoured).
    targets: Vec<(String, String)>,
}

#[derive(Default)]
struct Table {
    entries: HashMap<Key, Entry>,
    /// What is honoured, by key and by host.
    live: HashMap<Key, Arc<Exposure>>,
    by_host: HashMap<String, Arc<Exposure>>,
    /// What is honoured under wildcard hosts, by the suffix they match (`.example.com`).
    by_suffix: HashMap<String, Arc<Exposure>>,
    /// Why an APIRule is not honoured: invalid, or a host an older one holds.
    refused: HashMap<Key, NotServed>,
}

impl Table {
    /// The APIRule serving a request's `host`: the one naming it, else the most specific
    /// wildcard over it (looked up by slices of `host`: a call allocates nothing here, and
    /// without wildcard hosts costs one lookup, as before them).
    fn find(&self, host: &str) -> Option<&Arc<Exposure>> {
        self.by_host.get(host).or_else(|| {
            if self.by_suffix.is_empty() {
                return None;
            }
            host_suffixes(host).find_map(|suffix| self.by_suffix.get(suffix))
        })
    }

    /// Decides again who holds each host (`award_hosts`: oldest first).
    fn rebuild(&mut self) {
        let held: std::collections::HashSet<Key> = self.live.drain().map(|(key, _)| key).collect();
        self.by_host.clear();
        self.by_suffix.clear();
        self.refused.clear();
        let mut claims = Vec::with_capacity(self.entries.len());
        for (key, entry) in &self.entries {
            match &entry.compiled {
                Ok(exposure) => claims.push(HostClaim {
                    key,
                    created: entry.created.as_ref(),
                    held: held.contains(key),
                    hosts: exposure.hosts.as_slice(),
                }),
                Err(problem) => {
                    self.refused.insert(key.clone(), problem.clone());
                }
            }
        }
        for (key, awarded) in award_hosts(claims) {
            if let Err(taken) = awarded {
                let problem = NotServed::NotHonoured(NotHonoured::HostTaken(taken));
                self.refused.insert(key.clone(), problem);
                continue;
            }
            // Only what compiled claimed hosts.
            let Ok(exposure) = &self.entries[key].compiled else {
                continue;
            };
            for host in &exposure.hosts {
                match wildcard_suffix(host) {
                    Some(suffix) => self.by_suffix.insert(suffix.to_owned(), exposure.clone()),
                    None => self.by_host.insert(host.clone(), exposure.clone()),
                };
            }
            self.live.insert(key.clone(), exposure.clone());
        }
    }

    fn state(&self, key: &Key) -> Result<Arc<Exposure>, NotServed> {
        match self.live.get(key) {
            Some(exposure) => Ok(exposure.clone()),
            None => Err(self
                .refused
                .get(key)
                .cloned()
                .unwrap_or(NotServed::NotKnown)),
        }
    }
}

/// The APIRules a gateway honours, by host and by the Functions they expose.
pub struct Exposures {
    serving: ApiRuleArgs,
    table: RwLock<Table>,
    /// The external authorizers' checks in flight, by authorizer.
    slots: CheckSlots,
}

fn key_of(rule: &APIRule) -> Key {
    (
        rule.namespace().unwrap_or_else(|| "default".to_owned()),
        rule.name_any(),
    )
}

impl Exposures {
    /// None yet; short hosts are prefixed to the domain, and APIRules cross into the open
    /// namespaces only.
    pub fn new(serving: &ApiRuleArgs) -> Self {
        Self {
            serving: ApiRuleArgs {
                domain: serving.domain.trim_matches('.').to_ascii_lowercase(),
                ..serving.clone()
            },
            table: RwLock::default(),
            slots: CheckSlots::new(serving.max_authorizer_checks),
        }
    }

    fn entry(&self, rule: &APIRule, known: Option<&Entry>) -> Entry {
        let created = rule.metadata.creation_timestamp.clone();
        // An unchanged APIRule is not compiled again: its JWT verifiers keep their keys.
        let compiled = match known.map(|entry| &entry.compiled) {
            Some(Ok(exposure)) if exposure.spec == rule.spec => Ok(exposure.clone()),
            _ => compile(rule, &self.serving, &self.slots).map(Arc::new),
        };
        let (namespace, _) = key_of(rule);
        Entry {
            rule: rule.clone(),
            created,
            compiled,
            targets: rule.spec.targets(&namespace),
        }
    }

    /// Takes an APIRule (replacing its earlier version). `Err` says why it is not honoured:
    /// invalid, or naming a host an older APIRule holds.
    pub fn apply(&self, rule: &APIRule) -> Result<Arc<Exposure>, NotServed> {
        let key = key_of(rule);
        let mut table = self.table.write();
        let entry = self.entry(rule, table.entries.get(&key));
        table.entries.insert(key.clone(), entry);
        table.rebuild();
        table.state(&key)
    }

    /// Takes every APIRule there is, forgetting the rest (a relist).
    pub fn replace_all<'a>(&self, rules: impl IntoIterator<Item = &'a APIRule>) {
        let mut table = self.table.write();
        let mut entries = HashMap::new();
        for rule in rules {
            let key = key_of(rule);
            let entry = self.entry(rule, table.entries.get(&key));
            entries.insert(key, entry);
        }
        table.entries = entries;
        table.rebuild();
    }

    /// Compiles again every APIRule with an `extAuth` rule: the authorizers changed (Kyma's
    /// `Istio` resource was applied or deleted), so one may be honoured now, or no longer.
    pub fn refresh_authorizers(&self) {
        let mut table = self.table.write();
        let rules: Vec<APIRule> = table
            .entries
            .values()
            .map(|entry| entry.rule.clone())
            .collect();
        let mut entries = HashMap::with_capacity(rules.len());
        for rule in &rules {
            let key = key_of(rule);
            let names_authorizers = rule.spec.rules.iter().any(|each| each.ext_auth.is_some());
            let known = table.entries.get(&key).filter(|_| !names_authorizers);
            entries.insert(key, self.entry(rule, known));
        }
        table.entries = entries;
        table.rebuild();
    }

    /// Compiles the APIRules again whenever the authorizers of Kyma's `Istio` resource
    /// change, until `shutdown`.
    pub async fn follow_authorizers(&self, shutdown: eddy_platform::shutdown::CancellationToken) {
        let mut changes = self.serving.istio_authorizers.changes();
        loop {
            tokio::select! {
                changed = changes.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    self.refresh_authorizers();
                }
                () = shutdown.cancelled() => return,
            }
        }
    }

    /// Whether an APIRule is honoured, or why not.
    pub fn state(&self, namespace: &str, name: &str) -> Result<Arc<Exposure>, NotServed> {
        self.table
            .read()
            .state(&(namespace.to_owned(), name.to_owned()))
    }

    /// Forgets an APIRule (a host it held goes to the next oldest that names it).
    pub fn remove(&self, namespace: &str, name: &str) {
        let mut table = self.table.write();
        if table
            .entries
            .remove(&(namespace.to_owned(), name.to_owned()))
            .is_some()
        {
            table.rebuild();
        }
    }

    /// Whether an APIRule exposes `host` (as a request names it, port and all).
    pub fn names_host(&self, host: &str) -> bool {
        let table = self.table.read();
        let none = table.by_host.is_empty() && table.by_suffix.is_empty();
        !none && table.find(&request_host(host)).is_some()
    }

    /// The APIRule exposing the host a request names (`Host`, or HTTP/2's `:authority`). An
    /// address (`127.0.0.1:8080`, `[::1]`) is the gateway's own and never an APIRule's: such a
    /// request is routed by its path, whatever the table holds.
    pub fn by_host(&self, headers: &HeaderMap, uri: &http::Uri) -> Option<Arc<Exposure>> {
        let table = self.table.read();
        if table.by_host.is_empty() && table.by_suffix.is_empty() {
            return None;
        }
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .or_else(|| uri.authority().map(http::uri::Authority::as_str))?;
        let host = request_host(host);
        // An address, in any form a client's parser reads as one (`127.0.0.0x1`), is the
        // gateway's own: routed by the path.
        if reads_as_address(&host) {
            return None;
        }
        table.find(&host).cloned()
    }

    /// The rule a call on the gateway's own path to `namespace/function` falls under, when
    /// APIRules of the Function's own namespace name it: `Ok(None)` when none does, 404 when
    /// none of the honoured ones allows the call, and 403 when none of them is honoured (an
    /// APIRule that is invalid, or refused its host, never leaves its Function open). They
    /// are tried in name order. APIRules of other namespaces (where the Function's namespace
    /// is open to them) serve their hosts only.
    pub fn on_function_path(
        &self,
        namespace: &str,
        function: &str,
        method: &Method,
        path: &str,
    ) -> Result<Option<Chosen>, ErrorResponse> {
        let table = self.table.read();
        if table.entries.is_empty() {
            return Ok(None);
        }
        let names_it = |(rule_namespace, _): &Key, entry: &Entry| {
            rule_namespace == namespace
                && entry
                    .targets
                    .iter()
                    .any(|(n, name)| n == namespace && name == function)
        };
        let mut naming: Vec<&Key> = table
            .entries
            .iter()
            .filter(|(key, entry)| names_it(key, entry))
            .map(|(key, _)| key)
            .collect();
        if naming.is_empty() {
            return Ok(None);
        }
        naming.sort();
        let honoured: Vec<&Arc<Exposure>> = naming
            .iter()
            .filter_map(|key| table.live.get(*key))
            .collect();
        if honoured.is_empty() {
            let reasons: Vec<String> = naming
                .iter()
                .map(|key| match table.refused.get(*key) {
                    Some(why) => format!("APIRule {}/{}: {why}", key.0, key.1),
                    None => format!("APIRule {}/{}: not honoured", key.0, key.1),
                })
                .collect();
            return Err(ErrorResponse::message(
                StatusCode::FORBIDDEN,
                format!(
                    "function {namespace}/{function} is closed: the APIRules naming it are not \
                     honoured ({})",
                    reasons.join("; ")
                ),
            ));
        }
        honoured
            .iter()
            .find_map(|exposure| {
                let chosen = exposure.choose(method, path).ok()?;
                let target = &chosen.rule().target;
                (target.namespace == namespace && target.name == function).then_some(chosen)
            })
            .map(Some)
            .ok_or_else(|| {
                tracing::debug!(
                    function = %format_args!("{namespace}/{function}"),
                    %method, path, "exposed by APIRules, none of whose rules allows the call"
                );
                ErrorResponse::text(StatusCode::FORBIDDEN, RBAC_DENIED)
            })
    }
}

/// Follows the APIRules of the local store, and the authorizers in force, into `exposures`
/// until `shutdown` (the local gateway's; the controller reports their status by the same
/// rules).
pub async fn follow_store(
    store: eddy_platform::store::Store,
    exposures: Arc<Exposures>,
    shutdown: eddy_platform::shutdown::CancellationToken,
) {
    use eddy_platform::store::Change;
    let authorizers = exposures.follow_authorizers(shutdown.clone());
    let rules = store
        .follow::<APIRule, _, _>(&shutdown, |change| {
            let exposures = exposures.clone();
            async move {
                match change {
                    Change::Applied(rule) => {
                        if let Err(problem) = exposures.apply(&rule) {
                            tracing::debug!(apirule = %rule.name_any(), %problem, "APIRule not honoured");
                        }
                    }
                    Change::Deleted { namespace, name } => exposures.remove(&namespace, &name),
                    Change::Synced => {}
                }
            }
        });
    tokio::join!(authorizers, rules);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn api_rule(name: &str, spec: Value) -> APIRule {
        serde_json::from_value(json!({
            "apiVersion": "gateway.kyma-project.io/v2", "kind": "APIRule",
            "metadata": {"name": name, "namespace": "shop"}, "spec": spec,
        }))
        .unwrap()
    }

    fn serving() -> ApiRuleArgs {
        ApiRuleArgs {
            domain: "localhost".to_owned(),
            ..eddy_platform::flags::defaults()
        }
    }

    #[test]
    fn authorizations_need_every_scope_and_every_audience() {
        let wanted = JwtAuthorization {
            required_scopes: vec!["read".into(), "write".into()],
            audiences: vec!["app1".into(), "app2".into()],
        };
        // "The token's aud claim must contain all listed audiences" (Kyma's api-gateway docs).
        assert!(authorized(
            &json!({"scp": ["read", "write"], "aud": ["app2", "app1"]}),
            &wanted
        ));
        assert!(authorized(
            &json!({"scope": "write read other", "aud": ["x", "app1", "app2"]}),
            &wanted
        ));
        assert!(!authorized(
            &json!({"scp": ["read", "write"], "aud": "app2"}),
            &wanted
        ));
        assert!(!authorized(
            &json!({"scope": "write read other", "aud": ["x", "app1"]}),
            &wanted
        ));
        assert!(!authorized(
            &json!({"scope": "read", "aud": "app1"}),
            &wanted
        ));
        assert!(!authorized(
            &json!({"scp": "read write", "aud": "other"}),
            &wanted
        ));
        assert!(authorized(&json!({}), &JwtAuthorization::default()));
        // `aud` is one audience as a string: "x app1" is not app1 (RFC 7519 4.1.3).
        assert!(!authorized(
            &json!({"scp": "read write", "aud": "x app1"}),
            &wanted
        ));
    }

    #[test]
    fn a_host_belongs_to_the_oldest_apirule_that_names_it() {
        let exposures = Exposures::new(&serving());
        let spec = |host: &str| {
            json!({"hosts": [host], "service": {"name": "orders", "port": 80},
                   "rules": [{"path": "/*", "methods": ["GET"], "noAuth": true}]})
        };
        let first = exposures.apply(&api_rule("one", spec("orders"))).unwrap();
        assert_eq!(first.hosts, ["orders.localhost"]);
        let refused = exposures
            .apply(&api_rule("two", spec("orders.localhost")))
            .unwrap_err()
            .to_string();
        assert!(
            refused.contains("already exposed by APIRule shop/one"),
            "{refused}"
        );
        let mut headers = HeaderMap::new();
        headers.insert(
            header::HOST,
            HeaderValue::from_static("Orders.localhost:8080"),
        );
        let found = exposures.by_host(&headers, &"/x".parse().unwrap()).unwrap();
        assert_eq!(found.name, "one");
        // Moving its host frees the old one, for the APIRule that was refused it.
        exposures.apply(&api_rule("one", spec("other"))).unwrap();
        assert_eq!(
            exposures
                .by_host(&headers, &"/x".parse().unwrap())
                .unwrap()
                .name,
            "two"
        );
        assert!(exposures.state("shop", "two").is_ok());
        // Created in the same second, the one holding a host keeps it.
        exposures
            .apply(&api_rule("a-first-by-name", spec("orders")))
            .unwrap_err();
        exposures.remove("shop", "two");
        assert_eq!(
            exposures
                .by_host(&headers, &"/x".parse().unwrap())
                .unwrap()
                .name,
            "a-first-by-name"
        );
    }

    #[test]
    fn the_function_path_obeys_the_apirules_that_expose_it() {
        let exposures = Exposures::new(&serving());
        assert!(
            exposures
                .on_function_path("shop", "orders", &Method::GET, "/")
                .unwrap()
                .is_none()
        );
        exposures
            .apply(&api_rule(
                "orders",
                json!({"hosts": ["orders"], "service": {"name": "orders", "port": 80},
                       "rules": [{"path": "/public/{**}", "methods": ["GET"], "noAuth": true}]}),
            ))
            .unwrap();
        assert!(
            exposures
                .on_function_path("shop", "orders", &Method::GET, "/public/a")
                .unwrap()
                .is_some()
        );
        assert!(
            exposures
                .on_function_path("shop", "orders", &Method::POST, "/public/a")
                .is_err()
        );
        assert!(
            exposures
                .on_function_path("shop", "orders", &Method::GET, "/private")
                .is_err()
        );
        assert!(
            exposures
                .on_function_path("shop", "other", &Method::GET, "/private")
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn the_issuer_is_read_from_the_token() {
        use base64::Engine as _;
        let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(br#"{"iss":"https://id.example.com"}"#);
        assert_eq!(
            unverified_issuer(&format!("e30.{payload}.sig")).as_deref(),
            Some("https://id.example.com")
        );
        assert_eq!(unverified_issuer("not-a-jwt"), None);
    }
}
