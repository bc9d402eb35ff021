//! Whether an APIRule is valid, and whether it stays within its namespace.

use super::{
    APIRule, ApiRuleService, FieldError, MAX_TIMEOUT_SECONDS, METHODS, PathTemplate,
    is_dns1123_label, is_host,
};

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
                     start with a wildcard (*.example.com); never an IP address, nor a name ending in a \
                     number that parsers read as one (127.0.0.0x1)"
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
            error(format!("{at}.path"), problem.to_string());
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
pub(super) const UNSETTABLE_HEADERS: [&str; 14] = [
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

pub(super) fn check_service(
    at: &str,
    service: &ApiRuleService,
    error: &mut impl FnMut(String, String),
) {
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
