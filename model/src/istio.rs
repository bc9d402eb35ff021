//! Kyma's `Istio` resource (`operator.kyma-project.io/v1alpha2`), as far as eddy reads it: the
//! external authorizers of `spec.config.authorizers`, which Kyma's Istio module writes into the
//! mesh config as `envoyExtAuthzHttp` extension providers, and which APIRules' `extAuth` rules
//! name. Kyma reads one Istio resource: the oldest in `kyma-system`. The rest of its spec
//! (components, compatibility mode, experimental features) configures Istio itself and is kept
//! as written, unread.

use std::collections::BTreeMap;

use kube::CustomResource;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ext_authz::{ExtensionProvider, ExtensionProviders, HttpAuthorizerSpec};
use crate::resources::{FieldError, parse_go_duration};

/// The API group of Kyma's Istio resource.
pub const GROUP: &str = "operator.kyma-project.io";
/// `operator.kyma-project.io/v1alpha2`.
pub const API_VERSION: &str = "operator.kyma-project.io/v1alpha2";
/// The one namespace Kyma reads an Istio resource in.
pub const NAMESPACE: &str = "kyma-system";

/// Kyma's Istio resource. Its CRD is Kyma's: eddy never installs it, so no schema is derived.
#[derive(CustomResource, Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[kube(
    group = "operator.kyma-project.io",
    version = "v1alpha2",
    kind = "Istio",
    plural = "istios",
    namespaced,
    status = "IstioStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct IstioSpec {
    /// The mesh configuration, `authorizers` among it.
    #[serde(default)]
    pub config: IstioConfig,
    /// The rest of the spec, kept as written.
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

/// `spec.config`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IstioConfig {
    /// The external authorizers APIRules' `extAuth` may name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub authorizers: Vec<Authorizer>,
    /// The rest (`numTrustedProxies`, `gatewayExternalTrafficPolicy`, ...), kept as written.
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

/// One of `spec.config.authorizers`: an Envoy `ext_authz` HTTP service.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Authorizer {
    /// The name `extAuth.authorizers` uses.
    pub name: String,
    /// `[<namespace>/]<host>`.
    pub service: String,
    /// Its port.
    pub port: u32,
    /// What is sent to it and passed on from its answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<AuthorizerHeaders>,
    /// Put before the request's path in the check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    /// How long a check may take, as Kubernetes writes durations (`500ms`, `2s`, `1m30s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<String>,
}

/// `headers` of an authorizer.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AuthorizerHeaders {
    /// Headers in the check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_check: Option<InCheck>,
    /// Headers of an allowing answer set on the request to the Function.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_upstream: Option<ToUpstream>,
    /// Headers of the answer passed to the caller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_downstream: Option<ToDownstream>,
}

/// `headers.inCheck`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InCheck {
    /// The caller's headers sent in the check (exact, `prefix*` or `*suffix`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub include: Vec<String>,
    /// Fixed headers added to the check.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub add: BTreeMap<String, String>,
}

/// `headers.toUpstream`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ToUpstream {
    /// Headers of an allowing answer set on the request to the Function.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub on_allow: Vec<String>,
}

/// `headers.toDownstream`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ToDownstream {
    /// Headers of an allowing answer added to the caller's answer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub on_allow: Vec<String>,
    /// Headers of a denying answer passed to the caller (all but `Host` when not given).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub on_deny: Vec<String>,
}

/// What Kyma's Istio module reports, as far as eddy writes it (locally only: on Kubernetes the
/// resource is Kyma's).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IstioStatus {
    /// `Ready`, `Warning` or `Error`.
    pub state: String,
    /// Why, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// The Istio resource Kyma reads among `all`: the oldest in `kyma-system` (by creation time,
/// then name). Pure.
pub fn honoured<'a>(all: impl IntoIterator<Item = &'a Istio>) -> Option<&'a Istio> {
    all.into_iter()
        .filter(|istio| istio.metadata.namespace.as_deref() == Some(NAMESPACE))
        .min_by(|a, b| {
            let created = |istio: &Istio| istio.metadata.creation_timestamp.clone().map(|t| t.0);
            created(a)
                .cmp(&created(b))
                .then_with(|| a.metadata.name.cmp(&b.metadata.name))
        })
}

/// Kyma's name of a field of Istio's `envoyExtAuthzHttp`, for messages.
fn kyma_field(istio_field: &str) -> &str {
    match istio_field {
        "includeRequestHeadersInCheck" => "headers.inCheck.include",
        "includeAdditionalHeadersInCheck" => "headers.inCheck.add",
        "headersToUpstreamOnAllow" => "headers.toUpstream.onAllow",
        "headersToDownstreamOnAllow" => "headers.toDownstream.onAllow",
        "headersToDownstreamOnDeny" => "headers.toDownstream.onDeny",
        other => other,
    }
}

impl Authorizer {
    /// The extension provider Kyma's Istio module makes of it. Pure.
    pub fn extension_provider(&self) -> Result<ExtensionProvider, FieldError> {
        let headers = self.headers.clone().unwrap_or_default();
        let in_check = headers.in_check.unwrap_or_default();
        let to_downstream = headers.to_downstream.unwrap_or_default();
        let timeout = match self.timeout.as_deref() {
            None => None,
            Some(text) => {
                let duration = parse_go_duration(text).ok_or_else(|| {
                    FieldError::new(
                        "timeout",
                        format!("{text:?} is not a duration such as 500ms, 2s or 1m30s"),
                    )
                })?;
                Some(format!("{}s", duration.as_secs_f64()))
            }
        };
        let port = u16::try_from(self.port)
            .ok()
            .filter(|port| *port > 0)
            .ok_or_else(|| FieldError::new("port", "must be 1 to 65535"))?;
        Ok(ExtensionProvider {
            name: self.name.clone(),
            envoy_ext_authz_http: Some(HttpAuthorizerSpec {
                service: self.service.clone(),
                port,
                timeout,
                path_prefix: self.path_prefix.clone(),
                include_request_headers_in_check: in_check.include,
                include_additional_headers_in_check: in_check.add,
                headers_to_upstream_on_allow: headers.to_upstream.unwrap_or_default().on_allow,
                headers_to_downstream_on_allow: to_downstream.on_allow,
                headers_to_downstream_on_deny: to_downstream.on_deny,
                ..HttpAuthorizerSpec::default()
            }),
        })
    }
}

impl Istio {
    /// Its authorizers as extension providers, beside the gateway's own (`--extension-providers`,
    /// the chart's list): those that can be used, and a problem, by field, for each that cannot
    /// (invalid, named twice, or named as one of the gateway's own, which keeps its name).
    /// Pure.
    pub fn authorizers(&self, own: &ExtensionProviders) -> (ExtensionProviders, Vec<FieldError>) {
        let mut usable = Vec::new();
        let mut problems = Vec::new();
        for (index, authorizer) in self.spec.config.authorizers.iter().enumerate() {
            let at = format!("spec.config.authorizers[{index}]");
            let named_before = self.spec.config.authorizers[..index]
                .iter()
                .any(|other| other.name == authorizer.name);
            let problem = if authorizer.name.is_empty() {
                Some(FieldError::new(format!("{at}.name"), "is required"))
            } else if named_before {
                Some(FieldError::new(
                    format!("{at}.name"),
                    format!("{:?} is named twice", authorizer.name),
                ))
            } else if own.contains(&authorizer.name) {
                Some(FieldError::new(
                    format!("{at}.name"),
                    format!(
                        "{:?} is already one of the gateway's extension providers \
                         (--extension-providers), which keeps the name: rename one",
                        authorizer.name
                    ),
                ))
            } else {
                match authorizer
                    .extension_provider()
                    .and_then(|provider| ExtensionProviders::checked(&provider).map(|()| provider))
                {
                    Ok(provider) => {
                        usable.push(provider);
                        None
                    }
                    Err(error) => {
                        let split = error.field.find(['.', '[']).unwrap_or(error.field.len());
                        let (field, rest) = error.field.split_at(split);
                        Some(FieldError::new(
                            format!("{at}.{}{rest}", kyma_field(field)),
                            error.message,
                        ))
                    }
                }
            };
            problems.extend(problem);
        }
        (ExtensionProviders::from_providers(usable), problems)
    }

    /// Every problem with it as a resource eddy stores (locally), each naming its field: the
    /// namespace Kyma reads it in, and each authorizer that cannot be used. Pure.
    pub fn validate(&self, own: &ExtensionProviders) -> Vec<FieldError> {
        let mut errors = Vec::new();
        if self.metadata.namespace.as_deref() != Some(NAMESPACE) {
            errors.push(FieldError::new(
                "metadata.namespace",
                format!("Kyma reads an Istio resource in {NAMESPACE} only"),
            ));
        }
        errors.extend(self.authorizers(own).1);
        errors
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use std::time::Duration;

    use super::*;
    use crate::ext_authz::any_matches;

    fn istio(yaml: &str) -> Istio {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    /// Kyma's extAuth docs, "Minimal configuration": the Istio resource declares the authorizer
    /// with `name`, `port`, `service` and `headers.inCheck.include`.
    const KYMA_MINIMAL: &str = r#"
apiVersion: operator.kyma-project.io/v1alpha2
kind: Istio
metadata: {name: default, namespace: kyma-system}
spec:
  config:
    numTrustedProxies: 1
    authorizers:
      - name: oauth2-proxy
        port: 80
        service: oauth2-proxy.oauth2-proxy.svc.cluster.local
        headers:
          inCheck:
            include: ["x-forwarded-for", "cookie", "authorization"]
            add: {x-client: eddy}
          toUpstream: {onAllow: ["x-auth-request-*"]}
          toDownstream: {onAllow: ["set-cookie"], onDeny: ["content-type", "set-cookie"]}
        timeout: 1m30s
  components:
    pilot: {k8s: {resources: {requests: {cpu: 250m}}}}
"#;

    #[test]
    fn kyma_s_authorizer_becomes_the_extension_provider_its_istio_module_writes() {
        let istio = istio(KYMA_MINIMAL);
        let (providers, problems) = istio.authorizers(&ExtensionProviders::default());
        assert!(problems.is_empty(), "{problems:?}");
        let proxy = providers.authorizer("oauth2-proxy").unwrap();
        assert_eq!(
            proxy.base_url,
            "http://oauth2-proxy.oauth2-proxy.svc.cluster.local:80"
        );
        assert_eq!(proxy.timeout, Duration::from_secs(90));
        assert!(any_matches(&proxy.include, "cookie"));
        assert_eq!(proxy.additional, vec![("x-client".into(), "eddy".into())]);
        assert!(any_matches(
            &proxy.to_upstream_on_allow,
            "x-auth-request-user"
        ));
        assert!(any_matches(&proxy.to_downstream_on_allow, "set-cookie"));
        assert!(any_matches(&proxy.to_downstream_on_deny, "content-type"));
        // What eddy does not read is kept as written.
        let shown = serde_json::to_value(&istio).unwrap();
        assert_eq!(shown["spec"]["config"]["numTrustedProxies"], 1);
        assert_eq!(
            shown["spec"]["components"]["pilot"]["k8s"]["resources"]["requests"]["cpu"],
            "250m"
        );
    }

    #[test]
    fn every_authorizer_that_cannot_be_used_is_named_by_its_field() {
        let own = ExtensionProviders::parse(
            "[{name: opa, envoyExtAuthzHttp: {service: opa.opa, port: 8181}}]",
        )
        .unwrap();
        let istio = istio(
            r#"
metadata: {name: default, namespace: istio-system}
spec:
  config:
    authorizers:
      - {name: a, service: a.auth, port: 80, timeout: soon}
      - {name: a, service: b.auth, port: 80}
      - {name: opa, service: c.auth, port: 80}
      - {name: d, service: d.auth, port: 70000}
      - {name: e, service: e.auth, port: 80, headers: {inCheck: {include: ["bad header"]}}}
      - {name: f, service: f.auth, port: 80}
"#,
        );
        let (usable, problems) = istio.authorizers(&own);
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "spec.config.authorizers[0].timeout",
                "spec.config.authorizers[1].name",
                "spec.config.authorizers[2].name",
                "spec.config.authorizers[3].port",
                "spec.config.authorizers[4].headers.inCheck.include",
            ]
        );
        assert!(problems[2].message.contains("--extension-providers"));
        assert!(usable.authorizer("f").is_ok());
        assert!(usable.authorizer("a").is_err());
        let errors = istio.validate(&own);
        assert_eq!(errors[0].field, "metadata.namespace");
    }

    #[test]
    fn the_oldest_istio_resource_in_kyma_system_is_the_one_read() {
        let at = |name: &str, namespace: &str, created: &str| {
            istio(&format!(
                "metadata: {{name: {name}, namespace: {namespace}, creationTimestamp: \"{created}\"}}\nspec: {{}}"
            ))
        };
        let all = [
            at("newer", "kyma-system", "2026-02-01T00:00:00Z"),
            at("elsewhere", "default", "2025-01-01T00:00:00Z"),
            at("default", "kyma-system", "2026-01-01T00:00:00Z"),
        ];
        assert_eq!(
            honoured(&all).and_then(|i| i.metadata.name.as_deref()),
            Some("default")
        );
        assert!(honoured(&all[1..2]).is_none());
    }
}
