//! The external authorizers an APIRule's `extAuth` names: Istio's mesh config
//! `extensionProviders` of the HTTP kind (`envoyExtAuthzHttp`), read from a file the operator
//! gives the gateway and the controller. The types, their checks, and the pure parts of Envoy's
//! HTTP ext_authz contract: which request headers an authorizer is sent, and which of its
//! answer's headers go on to the Function or back to the caller.

use std::{collections::BTreeMap, time::Duration};

use serde::Deserialize;

use crate::apirule::APIRule;
use crate::resources::FieldError;

/// How long an authorizer may take when its provider sets no `timeout` (Istio's default).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// What a caller is answered when the authorizer cannot be asked (Envoy's default
/// `statusOnError`).
pub const DEFAULT_STATUS_ON_ERROR: u16 = 403;

/// Why a file of extension providers cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ProvidersError {
    /// The file cannot be read.
    #[error("{}: {source}", path.display())]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// It is not YAML or JSON.
    #[error("not YAML or JSON: {0}")]
    Syntax(String),
    /// It holds something else than the list.
    #[error("not a list of Istio extensionProviders (or a mapping holding one)")]
    NotAList,
    /// Providers are invalid, each problem by its field.
    #[error("{}", crate::resources::describe_errors(.0))]
    Invalid(Vec<FieldError>),
    /// A problem in the file at `path`.
    #[error("{}: {source}", path.display())]
    In {
        /// The file.
        path: std::path::PathBuf,
        /// The problem.
        #[source]
        source: Box<ProvidersError>,
    },
}

/// Why an `extAuth` rule cannot use the authorizer it names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnusableAuthorizer {
    /// No provider has the name; the HTTP authorizers there are.
    #[error("no extension provider {name:?}: {}", if known.is_empty() {
        "the gateway has no external authorizers (--extension-providers)".to_owned()
    } else {
        format!("the gateway's authorizers are {}", known.join(", "))
    })]
    Missing {
        /// The name.
        name: String,
        /// The HTTP authorizers the gateway has.
        known: Vec<String>,
    },
    /// The provider is of another kind (a tracer, a gRPC authorizer).
    #[error(
        "extension provider {0:?} is not an HTTP authorizer (envoyExtAuthzHttp): the only kind eddy calls"
    )]
    NotHttp(String),
    /// The provider is invalid.
    #[error("extension provider {name:?}: {}: {}", problem.field, problem.message)]
    Invalid {
        /// The name.
        name: String,
        /// Its problem, by field.
        problem: FieldError,
    },
}

/// The extension providers the gateway knows, by name. Only the HTTP authorizers among them
/// can be named by `extAuth`; others (tracing, gRPC authorizers) are kept so a rule naming one
/// is told why it cannot use it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExtensionProviders {
    providers: Vec<ExtensionProvider>,
}

/// One entry of Istio's `extensionProviders`, as far as eddy reads it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExtensionProvider {
    /// The name `extAuth.authorizers` uses.
    pub name: String,
    /// An HTTP external authorizer; a provider of any other kind is not one eddy calls.
    #[serde(default)]
    pub envoy_ext_authz_http: Option<HttpAuthorizerSpec>,
}

/// Istio's `envoyExtAuthzHttp`: where the authorizer is and what it is sent and may answer.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpAuthorizerSpec {
    /// Its host (`oauth2-proxy.auth.svc.cluster.local`, `auth/oauth2-proxy...`, `127.0.0.1`).
    pub service: String,
    /// Its port.
    pub port: u16,
    /// How long it may take (`0.5s`, `2s`, `250ms`); 600 s when not given.
    #[serde(default)]
    pub timeout: Option<String>,
    /// Put before the request's path in the check (`/oauth2/auth` style prefixes).
    #[serde(default)]
    pub path_prefix: Option<String>,
    /// Let calls through when it cannot be asked.
    #[serde(default)]
    pub fail_open: bool,
    /// The status answered when it cannot be asked (403 when not given).
    #[serde(default)]
    pub status_on_error: Option<String>,
    /// Request headers sent to it (exact, `prefix*` or `*suffix`, any case), besides `Host`,
    /// `Authorization`, the method and the path, which always are.
    #[serde(default)]
    pub include_request_headers_in_check: Vec<String>,
    /// The older name of `includeRequestHeadersInCheck`, read the same.
    #[serde(default)]
    pub include_headers_in_check: Vec<String>,
    /// Headers with fixed values added to every check.
    #[serde(default)]
    pub include_additional_headers_in_check: BTreeMap<String, String>,
    /// Not supported: eddy sends checks without the request's body.
    #[serde(default)]
    pub include_request_body_in_check: Option<serde_json::Value>,
    /// Headers of an allowing answer set on the request to the Function.
    #[serde(default)]
    pub headers_to_upstream_on_allow: Vec<String>,
    /// Headers of an allowing answer added to the answer to the caller.
    #[serde(default)]
    pub headers_to_downstream_on_allow: Vec<String>,
    /// Headers of a denying answer passed to the caller (all but `Host` when not given).
    #[serde(default)]
    pub headers_to_downstream_on_deny: Vec<String>,
}

/// A header-name pattern of Istio's lists: exact, `prefix*` or `*suffix`, any case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderPattern {
    /// This name.
    Exact(String),
    /// Names starting with this.
    Prefix(String),
    /// Names ending with this.
    Suffix(String),
}

impl HeaderPattern {
    fn parse(pattern: &str) -> Self {
        let lower = pattern.to_ascii_lowercase();
        if let Some(prefix) = lower.strip_suffix('*') {
            Self::Prefix(prefix.to_owned())
        } else if let Some(suffix) = lower.strip_prefix('*') {
            Self::Suffix(suffix.to_owned())
        } else {
            Self::Exact(lower)
        }
    }

    /// Whether a (lower-case, as `http` keeps them) header name matches.
    pub fn matches(&self, name: &str) -> bool {
        match self {
            Self::Exact(exact) => name == exact,
            Self::Prefix(prefix) => name.starts_with(prefix.as_str()),
            Self::Suffix(suffix) => name.ends_with(suffix.as_str()),
        }
    }
}

/// Whether any of `patterns` matches `name`. Pure.
pub fn any_matches(patterns: &[HeaderPattern], name: &str) -> bool {
    patterns.iter().any(|pattern| pattern.matches(name))
}

/// An HTTP authorizer ready to be called: its checks done, its lists compiled.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpAuthorizer {
    /// The provider's name.
    pub name: String,
    /// `http://<service>:<port><pathPrefix>`: the request's path and query follow it.
    pub base_url: String,
    /// How long it may take.
    pub timeout: Duration,
    /// Let calls through when it cannot be asked.
    pub fail_open: bool,
    /// What the caller is answered when it cannot be asked.
    pub status_on_error: u16,
    /// Request headers it is sent, besides the ones always sent.
    pub include: Vec<HeaderPattern>,
    /// Fixed headers added to each check.
    pub additional: Vec<(String, String)>,
    /// Headers of an allowing answer set on the Function's request.
    pub to_upstream_on_allow: Vec<HeaderPattern>,
    /// Headers of an allowing answer added to the caller's answer.
    pub to_downstream_on_allow: Vec<HeaderPattern>,
    /// Headers of a denying answer passed to the caller; empty: all of them.
    pub to_downstream_on_deny: Vec<HeaderPattern>,
}

/// Request headers every check carries (Envoy's), whatever the provider lists.
pub const ALWAYS_SENT: [&str; 2] = ["host", "authorization"];

/// Headers that frame or route a message: never copied between the authorizer's answer and
/// the Function's request or the caller's answer (they describe that one message only).
const FRAMING: [&str; 8] = [
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "host",
];

/// Whether a header of the authorizer's answer may be copied onto another message. Pure.
pub fn is_copyable(name: &str) -> bool {
    !FRAMING.contains(&name) && !name.starts_with(':') && !name.starts_with("proxy-")
}

/// Which of a denying answer's headers reach the caller: the listed ones, and with a list,
/// Envoy's always-passed `www-authenticate` and `location`; without one, all. Pure.
pub fn passes_on_deny(authorizer: &HttpAuthorizer, name: &str) -> bool {
    is_copyable(name)
        && (authorizer.to_downstream_on_deny.is_empty()
            || matches!(name, "www-authenticate" | "location")
            || any_matches(&authorizer.to_downstream_on_deny, name))
}

/// A protobuf-style duration (`1.5s`, `250ms`). Pure.
fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let (number, scale) = if let Some(ms) = text.strip_suffix("ms") {
        (ms, 0.001)
    } else if let Some(s) = text.strip_suffix('s') {
        (s, 1.0)
    } else {
        return None;
    };
    let seconds = number.trim().parse::<f64>().ok()? * scale;
    (seconds.is_finite() && seconds > 0.0).then(|| Duration::from_secs_f64(seconds))
}

impl ExtensionProviders {
    /// Reads the file's text (YAML or JSON): Istio's `extensionProviders` list, or a mapping
    /// holding it. Every problem is named by its provider and field.
    pub fn parse(text: &str) -> Result<Self, ProvidersError> {
        let file: serde_yaml_ng::Value = serde_yaml_ng::from_str(text)
            .map_err(|error| ProvidersError::Syntax(error.to_string()))?;
        // The list, or a mapping holding it (a mesh config's section).
        let list = match file {
            serde_yaml_ng::Value::Sequence(_) => file,
            serde_yaml_ng::Value::Mapping(mut mapping) => mapping
                .remove("extensionProviders")
                .unwrap_or(serde_yaml_ng::Value::Sequence(Vec::new())),
            _ => return Err(ProvidersError::NotAList),
        };
        let providers: Vec<ExtensionProvider> =
            serde_path_to_error::deserialize(list).map_err(|error| {
                let path = error.path().to_string();
                let path = if path == "." { String::new() } else { path };
                ProvidersError::Invalid(vec![FieldError::new(
                    format!("extensionProviders{path}"),
                    error.inner().to_string(),
                )])
            })?;
        let mut problems = Vec::new();
        for (index, provider) in providers.iter().enumerate() {
            let at = format!("extensionProviders[{index}]");
            if provider.name.is_empty() {
                problems.push(FieldError::new(format!("{at}.name"), "is required"));
            }
            if providers[..index].iter().any(|p| p.name == provider.name) {
                problems.push(FieldError::new(
                    format!("{at}.name"),
                    format!("{:?} is named twice", provider.name),
                ));
            }
            if let Some(http) = &provider.envoy_ext_authz_http
                && let Err(problem) = Self::compile(&provider.name, http)
            {
                problems.push(FieldError::new(
                    format!("{at}.envoyExtAuthzHttp.{}", problem.field),
                    problem.message,
                ));
            }
        }
        if problems.is_empty() {
            Ok(Self { providers })
        } else {
            Err(ProvidersError::Invalid(problems))
        }
    }

    /// These providers, in this order (their names are unique: see [`Self::parse`]).
    pub fn from_providers(providers: Vec<ExtensionProvider>) -> Self {
        Self { providers }
    }

    /// Their names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.providers.iter().map(|p| p.name.as_str()).collect()
    }

    /// Whether one of them is named `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.providers.iter().any(|provider| provider.name == name)
    }

    /// These, then those of `more` whose names are not taken here. Pure.
    #[must_use]
    pub fn merged(&self, more: &Self) -> Self {
        let mut providers = self.providers.clone();
        providers.extend(
            more.providers
                .iter()
                .filter(|provider| !self.contains(&provider.name))
                .cloned(),
        );
        Self { providers }
    }

    /// Whether `provider` can be called, or its first problem, by its field in Istio's
    /// `envoyExtAuthzHttp` (`timeout`, `includeRequestHeadersInCheck`). Pure.
    pub fn checked(provider: &ExtensionProvider) -> Result<(), FieldError> {
        let Some(spec) = &provider.envoy_ext_authz_http else {
            return Ok(());
        };
        Self::compile(&provider.name, spec).map(drop)
    }

    /// Reads the file at `path`.
    pub fn read(path: &std::path::Path) -> Result<Self, ProvidersError> {
        let text = std::fs::read_to_string(path).map_err(|source| ProvidersError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text).map_err(|problem| ProvidersError::In {
            path: path.to_path_buf(),
            source: Box::new(problem),
        })
    }

    fn compile(name: &str, spec: &HttpAuthorizerSpec) -> Result<HttpAuthorizer, FieldError> {
        if spec.service.is_empty() {
            return Err(FieldError::new("service", "is required"));
        }
        if spec.port == 0 {
            return Err(FieldError::new("port", "must be 1 to 65535"));
        }
        if spec.include_request_body_in_check.is_some() {
            return Err(FieldError::new(
                "includeRequestBodyInCheck",
                "eddy sends checks without the body",
            ));
        }
        // Istio also takes `namespace/host`.
        let host = spec
            .service
            .rsplit_once('/')
            .map_or(spec.service.as_str(), |(_, host)| host);
        let prefix = spec.path_prefix.as_deref().unwrap_or_default();
        if !prefix.is_empty() && !prefix.starts_with('/') {
            return Err(FieldError::new("pathPrefix", "must start with /"));
        }
        let base_url = format!(
            "http://{host}:{}{}",
            spec.port,
            prefix.trim_end_matches('/')
        );
        if base_url.parse::<http::Uri>().is_err() {
            return Err(FieldError::new(
                "service",
                format!("{host:?} is not a host"),
            ));
        }
        let timeout = match spec.timeout.as_deref() {
            None => DEFAULT_TIMEOUT,
            Some(text) => parse_duration(text).ok_or_else(|| {
                FieldError::new(
                    "timeout",
                    format!("{text:?} is not a duration such as 2s or 500ms"),
                )
            })?,
        };
        let status_on_error = match spec.status_on_error.as_deref() {
            None => DEFAULT_STATUS_ON_ERROR,
            Some(text) => text
                .parse::<u16>()
                .ok()
                .filter(|code| (200..600).contains(code))
                .ok_or_else(|| {
                    FieldError::new("statusOnError", format!("{text:?} is not an HTTP status"))
                })?,
        };
        let patterns = |list: &[String], field: &str| -> Result<Vec<HeaderPattern>, FieldError> {
            list.iter()
                .map(|pattern| {
                    let bare = pattern.trim_matches('*');
                    if bare.is_empty() || http::HeaderName::from_bytes(bare.as_bytes()).is_err() {
                        Err(FieldError::new(
                            field,
                            format!("{pattern:?} is not a header name or pattern"),
                        ))
                    } else {
                        Ok(HeaderPattern::parse(pattern))
                    }
                })
                .collect()
        };
        let mut include = patterns(
            &spec.include_request_headers_in_check,
            "includeRequestHeadersInCheck",
        )?;
        include.extend(patterns(
            &spec.include_headers_in_check,
            "includeHeadersInCheck",
        )?);
        let mut additional = Vec::new();
        for (header, value) in &spec.include_additional_headers_in_check {
            if http::HeaderName::from_bytes(header.as_bytes()).is_err()
                || http::HeaderValue::from_str(value).is_err()
            {
                return Err(FieldError::new(
                    format!("includeAdditionalHeadersInCheck[{header}]"),
                    "is not a valid header",
                ));
            }
            additional.push((header.to_ascii_lowercase(), value.clone()));
        }
        Ok(HttpAuthorizer {
            name: name.to_owned(),
            base_url,
            timeout,
            fail_open: spec.fail_open,
            status_on_error,
            include,
            additional,
            to_upstream_on_allow: patterns(
                &spec.headers_to_upstream_on_allow,
                "headersToUpstreamOnAllow",
            )?,
            to_downstream_on_allow: patterns(
                &spec.headers_to_downstream_on_allow,
                "headersToDownstreamOnAllow",
            )?,
            to_downstream_on_deny: patterns(
                &spec.headers_to_downstream_on_deny,
                "headersToDownstreamOnDeny",
            )?,
        })
    }

    /// The HTTP authorizer named `name`, or why a rule cannot use it.
    pub fn authorizer(&self, name: &str) -> Result<HttpAuthorizer, UnusableAuthorizer> {
        let Some(provider) = self.providers.iter().find(|p| p.name == name) else {
            return Err(UnusableAuthorizer::Missing {
                name: name.to_owned(),
                known: self
                    .providers
                    .iter()
                    .filter(|p| p.envoy_ext_authz_http.is_some())
                    .map(|p| p.name.clone())
                    .collect(),
            });
        };
        let Some(spec) = &provider.envoy_ext_authz_http else {
            return Err(UnusableAuthorizer::NotHttp(name.to_owned()));
        };
        Self::compile(name, spec).map_err(|problem| UnusableAuthorizer::Invalid {
            name: name.to_owned(),
            problem,
        })
    }

    /// Every `extAuth` authorizer of `rule` that is not an HTTP authorizer here, each an error
    /// naming its field. Pure.
    pub fn check(&self, rule: &APIRule) -> Vec<FieldError> {
        let mut errors = Vec::new();
        for (index, each) in rule.spec.rules.iter().enumerate() {
            let Some(ext_auth) = &each.ext_auth else {
                continue;
            };
            for (a, name) in ext_auth.authorizers.iter().enumerate() {
                if let Err(unusable) = self.authorizer(name) {
                    errors.push(FieldError {
                        field: format!("spec.rules[{index}].extAuth.authorizers[{a}]"),
                        message: unusable.to_string(),
                    });
                }
            }
        }
        errors
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn kyma_s_oauth2_proxy_provider_reads_as_istio_s_mesh_config() {
        let providers = ExtensionProviders::parse(
            r#"
extensionProviders:
  - name: oauth2-proxy
    envoyExtAuthzHttp:
      service: oauth2-proxy.oauth2-proxy.svc.cluster.local
      port: 80
      includeRequestHeadersInCheck: ["authorization", "cookie"]
      headersToUpstreamOnAllow: ["authorization", "path", "x-auth-request-*"]
      headersToDownstreamOnDeny: ["content-type", "set-cookie"]
  - name: zipkin
    zipkin: {service: zipkin.istio-system.svc.cluster.local, port: 9411}
"#,
        )
        .unwrap();
        let proxy = providers.authorizer("oauth2-proxy").unwrap();
        assert_eq!(
            proxy.base_url,
            "http://oauth2-proxy.oauth2-proxy.svc.cluster.local:80"
        );
        assert_eq!(proxy.timeout, DEFAULT_TIMEOUT);
        assert_eq!(proxy.status_on_error, 403);
        assert!(any_matches(&proxy.include, "cookie"));
        assert!(!any_matches(&proxy.include, "x-secret"));
        assert!(any_matches(
            &proxy.to_upstream_on_allow,
            "x-auth-request-email"
        ));
        assert!(passes_on_deny(&proxy, "set-cookie"));
        assert!(passes_on_deny(&proxy, "location"));
        assert!(!passes_on_deny(&proxy, "x-debug"));
        assert!(!passes_on_deny(&proxy, "content-length"));
        let zipkin = providers.authorizer("zipkin").unwrap_err().to_string();
        assert!(zipkin.contains("not an HTTP authorizer"), "{zipkin}");
        let missing = providers.authorizer("opa").unwrap_err().to_string();
        assert!(missing.contains("oauth2-proxy"), "{missing}");
    }

    #[test]
    fn a_bare_list_with_prefix_timeout_and_status_reads() {
        let providers = ExtensionProviders::parse(
            r#"[{"name": "a", "envoyExtAuthzHttp": {"service": "auth/127.0.0.1", "port": 9000,
                "pathPrefix": "/check/", "timeout": "1.5s", "statusOnError": "503",
                "failOpen": true}}]"#,
        )
        .unwrap();
        let a = providers.authorizer("a").unwrap();
        assert_eq!(a.base_url, "http://127.0.0.1:9000/check");
        assert_eq!(a.timeout, Duration::from_millis(1500));
        assert_eq!(a.status_on_error, 503);
        assert!(a.fail_open);
    }

    #[test]
    fn every_bad_provider_field_is_named() {
        let problem = ExtensionProviders::parse(
            r#"
- name: a
  envoyExtAuthzHttp: {service: x, port: 1, timeout: soon}
- name: a
  envoyExtAuthzHttp: {service: x, port: 1, statusOnError: "99"}
- name: b
  envoyExtAuthzHttp: {service: x, port: 1, includeRequestBodyInCheck: {maxRequestBytes: 10}}
- name: c
  envoyExtAuthzHttp: {service: x, port: 1, pathPrefx: /typo}
"#,
        )
        .unwrap_err()
        .to_string();
        assert!(
            problem.starts_with("extensionProviders[3].envoyExtAuthzHttp.pathPrefx: unknown field"),
            "{problem}"
        );
        let problem = ExtensionProviders::parse(
            r#"
- name: a
  envoyExtAuthzHttp: {service: x, port: 1, timeout: soon}
- name: a
  envoyExtAuthzHttp: {service: x, port: 1, statusOnError: "99"}
- name: b
  envoyExtAuthzHttp: {service: x, port: 1, includeRequestBodyInCheck: {maxRequestBytes: 10}}
"#,
        )
        .unwrap_err()
        .to_string();
        for expected in [
            "extensionProviders[0].envoyExtAuthzHttp.timeout",
            "extensionProviders[1].name: \"a\" is named twice",
            "extensionProviders[1].envoyExtAuthzHttp.statusOnError",
            "extensionProviders[2].envoyExtAuthzHttp.includeRequestBodyInCheck",
        ] {
            assert!(problem.contains(expected), "{expected} in {problem}");
        }
    }
}
