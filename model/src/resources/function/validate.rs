//! Whether a Function is valid: every problem, each naming its field.

use super::{
    AccessMode, BTreeMap, CONTAINER_RESOURCES, ENV_NAME_MESSAGE, EnvVar, FIELD_PATH_MESSAGE,
    FUNC_BODY_MB_LIMIT_ENV, FUNC_TIMEOUT_ENV, FieldError, Function, FunctionSpec, GIT_URL_MESSAGE,
    GitRepositorySource, KeySource, POD_FIELDS, PROFILES, REQ_MB_LIMIT_ENV, RESERVED_ENV,
    RESOURCE_MESSAGE, SCALE_ON_ANNOTATION, SCALE_ON_BACKLOG, SCALE_ON_CPU, SecretMount,
    VALUE_FROM_MESSAGE, is_allowed_jwks_uri, is_config_key, is_dns1123_subdomain, is_env_name,
    is_qualified_name_part, parse_digest, quantity_value, validate_metadata,
};

/// Checks a Function; every problem is reported.
pub fn validate_function(function: &Function) -> Vec<FieldError> {
    let mut errors = validate_metadata(&function.metadata, true);
    if let Some(scale_on) = function.scale_on()
        && scale_on != SCALE_ON_BACKLOG
        && scale_on != SCALE_ON_CPU
    {
        errors.push(FieldError::new(
            format!("metadata.annotations[{SCALE_ON_ANNOTATION}]"),
            format!("must be {SCALE_ON_BACKLOG} or {SCALE_ON_CPU}, not {scale_on:?}"),
        ));
    }
    let spec = &function.spec;
    match (&spec.source.inline, &spec.source.git_repository) {
        (None, None) | (Some(_), Some(_)) => errors.push(FieldError::new(
            "spec.source",
            "exactly one source kind is required: inline or gitRepository",
        )),
        (Some(inline), None) if inline.source.bytes().all(|b| b.is_ascii_whitespace()) => {
            errors.push(FieldError::new(
                "spec.source.inline.source",
                "must not be empty",
            ));
        }
        (Some(_), None) => {}
        (None, Some(git)) => validate_git_source(git, &mut errors),
    }
    for (index, var) in spec.env.iter().enumerate() {
        let field = format!("spec.env[{index}].name");
        if !is_env_name(&var.name) {
            errors.push(FieldError::new(field, ENV_NAME_MESSAGE));
        } else if RESERVED_ENV.contains(&var.name.as_str()) {
            errors.push(FieldError::new(
                field,
                format!("{} is set by the platform", var.name),
            ));
        } else if spec.env[..index]
            .iter()
            .any(|earlier| earlier.name == var.name)
        {
            errors.push(FieldError::new(
                field,
                // The CRD rule's words (a message naming the name costs the API server's
                // whole CEL budget); the field names the entry.
                "env names must be unique",
            ));
        }
        validate_env_value(spec, index, var, &mut errors);
    }
    validate_secret_mounts(&spec.secret_mounts, &mut errors);
    validate_pod_metadata("spec.labels", &spec.labels, true, &mut errors);
    validate_pod_metadata("spec.annotations", &spec.annotations, false, &mut errors);
    if let Some(template) = &spec.template {
        validate_pod_metadata("spec.template.labels", &template.labels, true, &mut errors);
        validate_pod_metadata(
            "spec.template.annotations",
            &template.annotations,
            false,
            &mut errors,
        );
    }
    if let Some(build) = spec
        .resource_configuration
        .as_ref()
        .and_then(|r| r.build.as_ref())
    {
        match (&build.profile, &build.resources) {
            (Some(_), Some(_)) => errors.push(FieldError::new(
                "spec.resourceConfiguration.build",
                "set profile or resources, not both",
            )),
            (Some(profile), None) if !BUILD_PROFILES.contains(&profile.as_str()) => {
                errors.push(FieldError::new(
                    "spec.resourceConfiguration.build.profile",
                    "must be one of local-dev, slow, normal, fast",
                ))
            }
            _ => {}
        }
    }
    if let Some(replicas) = spec.replicas
        && !(0..=100).contains(&replicas)
    {
        errors.push(FieldError::new(
            "spec.replicas",
            "must be between 0 and 100",
        ));
    }
    if let Some(scale) = spec.scale_config {
        if !(0..=100).contains(&scale.min_replicas) {
            errors.push(FieldError::new(
                "spec.scaleConfig.minReplicas",
                "must be between 0 and 100",
            ));
        }
        if !(1..=100).contains(&scale.max_replicas) {
            errors.push(FieldError::new(
                "spec.scaleConfig.maxReplicas",
                "must be between 1 and 100",
            ));
        } else if scale.max_replicas < scale.min_replicas {
            errors.push(FieldError::new(
                "spec.scaleConfig.maxReplicas",
                "must not be below minReplicas",
            ));
        }
    }
    if let Some(request) = spec
        .resource_configuration
        .as_ref()
        .and_then(|r| r.function.as_ref())
    {
        match (&request.profile, &request.resources) {
            (Some(_), Some(_)) => errors.push(FieldError::new(
                "spec.resourceConfiguration.function",
                "set profile or resources, not both",
            )),
            (Some(profile), None) if !PROFILES.iter().any(|p| p.0 == profile) => {
                errors.push(FieldError::new(
                    "spec.resourceConfiguration.function.profile",
                    "must be one of XS, S, M, L, XL",
                ))
            }
            (None, Some(resources)) => {
                // As Kyma's validation: explicit requests at least the configured minimums.
                let presets = super::presets::presets_in_force();
                for (name, minimum) in [
                    ("cpu", &presets.min_request_cpu),
                    ("memory", &presets.min_request_memory),
                ] {
                    let Some(asked) = resources.requests.get(name) else {
                        continue;
                    };
                    let below = quantity_value(&asked.0)
                        .zip(quantity_value(minimum))
                        .is_some_and(|(asked, minimum)| asked < minimum);
                    if below {
                        errors.push(FieldError::new(
                            format!(
                                "spec.resourceConfiguration.function.resources.requests.{name}"
                            ),
                            format!(
                                "must be at least {minimum} (this installation's minRequest{})",
                                if name == "cpu" { "Cpu" } else { "Memory" }
                            ),
                        ));
                    }
                }
            }
            _ => {}
        }
    }
    if let Some(access) = &spec.access {
        if access.token_digests.len() > 32 {
            errors.push(FieldError::new(
                "spec.access.tokenDigests",
                "at most 32 digests",
            ));
        }
        for (index, digest) in access.token_digests.iter().enumerate() {
            if parse_digest(digest).is_none() {
                errors.push(FieldError::new(
                    format!("spec.access.tokenDigests[{index}]"),
                    "each must be sha256: followed by 64 lower-case hex digits",
                ));
            }
        }
        if access.mode == AccessMode::Token && access.token_digests.is_empty() {
            errors.push(FieldError::new(
                "spec.access.tokenDigests",
                "mode token needs at least one entry in tokenDigests",
            ));
        }
        if (access.mode == AccessMode::Jwt) != access.jwt.is_some() {
            errors.push(FieldError::new(
                "spec.access.jwt",
                "jwt is required with mode jwt and allowed only with it",
            ));
        }
        if let Some(jwt) = &access.jwt {
            if jwt.issuer.is_empty() || jwt.issuer.len() > 1024 {
                errors.push(FieldError::new(
                    "spec.access.jwt.issuer",
                    "must be 1 to 1024 characters",
                ));
            }
            if jwt.jwks_uri.len() > 2048 || !is_allowed_jwks_uri(&jwt.jwks_uri) {
                errors.push(FieldError::new(
                    "spec.access.jwt.jwksUri",
                    "must be an https:// URL (http:// only to localhost)",
                ));
            }
            if jwt.audiences.len() > 16 {
                errors.push(FieldError::new(
                    "spec.access.jwt.audiences",
                    "at most 16 audiences",
                ));
            }
            if jwt.required_claims.len() > 16 {
                errors.push(FieldError::new(
                    "spec.access.jwt.requiredClaims",
                    "at most 16 claims",
                ));
            }
        }
    }
    if let Some(timeout) = spec.timeout_seconds
        && !(1..=3600).contains(&timeout)
    {
        errors.push(FieldError::new(
            "spec.timeoutSeconds",
            "must be between 1 and 3600",
        ));
    }
    errors
}

/// Presets of `resourceConfiguration.build.profile`, as Kyma names them.
pub const BUILD_PROFILES: [&str; 4] = ["local-dev", "slow", "normal", "fast"];

/// What each build preset gives the build Job on Kubernetes, Kyma's figures: (profile, cpu
/// request, memory request, cpu limit, memory limit).
pub const BUILD_PROFILE_RESOURCES: [(&str, &str, &str, &str, &str); 4] = [
    ("local-dev", "200m", "200Mi", "400m", "400Mi"),
    ("slow", "200m", "200Mi", "700m", "700Mi"),
    ("normal", "700m", "700Mi", "1100m", "1100Mi"),
    ("fast", "1100m", "1100Mi", "1700m", "1100Mi"),
];

/// A host and path without a scheme, as Kyma's docs write them (`github.com/org/repo`): the
/// first segment names a host (it has a dot).
pub(super) fn is_schemeless_host_path(url: &str) -> bool {
    url.split_once('/').is_some_and(|(host, path)| {
        !path.is_empty()
            && host.contains('.')
            && !host.starts_with(['.', '-'])
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':'))
    })
}

/// The URL `git` is given for a `gitRepository.url`: as written, except a host and path
/// without a scheme (`github.com/org/repo`), which Kyma fetches over HTTPS.
pub fn git_remote_url(url: &str) -> std::borrow::Cow<'_, str> {
    if !url.contains("://") && !is_scp_like(url) && is_schemeless_host_path(url) {
        std::borrow::Cow::Owned(format!("https://{url}"))
    } else {
        std::borrow::Cow::Borrowed(url)
    }
}

/// SSH's scp form, `user@host:path`.
pub(super) fn is_scp_like(url: &str) -> bool {
    url.split_once(':')
        .and_then(|(user_host, _)| user_host.split_once('@'))
        .is_some_and(|(user, host)| {
            !user.is_empty()
                && !host.is_empty()
                && !user.starts_with('-')
                && user_host_chars(user)
                && user_host_chars(host)
        })
}

pub(super) fn validate_git_source(git: &GitRepositorySource, errors: &mut Vec<FieldError>) {
    let url = git.url.as_str();
    let scp_like = is_scp_like(url);
    let known_scheme = ["https://", "http://", "ssh://", "file://"]
        .iter()
        .any(|scheme| url.starts_with(scheme));
    if !(known_scheme || scp_like || is_schemeless_host_path(url))
        || url.chars().any(char::is_whitespace)
    {
        errors.push(FieldError::new(
            "spec.source.gitRepository.url",
            GIT_URL_MESSAGE,
        ));
    }
    if git.reference.is_empty()
        || git.reference.starts_with('-')
        || git
            .reference
            .chars()
            .any(|c| c.is_whitespace() || c.is_control())
    {
        errors.push(FieldError::new(
            "spec.source.gitRepository.reference",
            "must be a branch, tag or commit: no spaces, not starting with '-'",
        ));
    }
    if let Some(base_dir) = &git.base_dir
        && (base_dir.split('/').any(|segment| segment == "..") || base_dir.contains('\0'))
    {
        errors.push(FieldError::new(
            "spec.source.gitRepository.baseDir",
            "must stay inside the repository: no '..'",
        ));
    }
    if let Some(auth) = &git.auth
        && !is_dns1123_subdomain(&auth.secret_name)
    {
        errors.push(FieldError::new(
            "spec.source.gitRepository.auth.secretName",
            "must name a Secret: a DNS-1123 subdomain",
        ));
    }
}

pub(super) fn user_host_chars(text: &str) -> bool {
    text.chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

pub(super) fn validate_env_value(
    spec: &FunctionSpec,
    index: usize,
    var: &EnvVar,
    errors: &mut Vec<FieldError>,
) {
    let field = format!("spec.env[{index}]");
    if var.value.contains('\0') {
        errors.push(FieldError::new(
            format!("{field}.value"),
            "must not contain a NUL byte",
        ));
    }
    if let Some(source) = &var.value_from {
        if !var.value.is_empty() {
            errors.push(FieldError::new(
                format!("{field}.valueFrom"),
                "set value or valueFrom, not both",
            ));
        }
        let kinds = [
            source.secret_key_ref.is_some(),
            source.config_map_key_ref.is_some(),
            source.field_ref.is_some(),
            source.resource_field_ref.is_some(),
        ];
        if kinds.iter().filter(|set| **set).count() != 1 {
            errors.push(FieldError::new(
                format!("{field}.valueFrom"),
                VALUE_FROM_MESSAGE,
            ));
        }
        if let Some(selector) = &source.field_ref {
            let path = selector.field_path.as_str();
            let keyed = ["metadata.labels['", "metadata.annotations['"]
                .iter()
                .any(|prefix| {
                    path.strip_prefix(prefix)
                        .and_then(|rest| rest.strip_suffix("']"))
                        .is_some_and(|key| !key.is_empty() && !key.contains('\''))
                });
            if !(POD_FIELDS.contains(&path) || keyed) {
                errors.push(FieldError::new(
                    format!("{field}.valueFrom.fieldRef.fieldPath"),
                    FIELD_PATH_MESSAGE,
                ));
            }
        }
        if let Some(selector) = &source.resource_field_ref
            && !CONTAINER_RESOURCES.contains(&selector.resource.as_str())
        {
            errors.push(FieldError::new(
                format!("{field}.valueFrom.resourceFieldRef.resource"),
                RESOURCE_MESSAGE,
            ));
        }
        match source.selector() {
            None => {}
            Some((kind, selector)) => {
                let at = match kind {
                    KeySource::Secret => format!("{field}.valueFrom.secretKeyRef"),
                    KeySource::ConfigMap => format!("{field}.valueFrom.configMapKeyRef"),
                };
                if !is_dns1123_subdomain(&selector.name) {
                    errors.push(FieldError::new(
                        format!("{at}.name"),
                        "must be a DNS-1123 subdomain",
                    ));
                }
                if !is_config_key(&selector.key) {
                    errors.push(FieldError::new(
                        format!("{at}.key"),
                        "must be a key: letters, digits, '-', '_' and '.'",
                    ));
                }
            }
        }
    }
    let whole_number = |max: i64| {
        var.value_from.is_none()
            && var
                .value
                .trim()
                .parse::<i64>()
                .is_ok_and(|n| (1..=max).contains(&n))
    };
    match var.name.as_str() {
        FUNC_TIMEOUT_ENV if !whole_number(3600) => errors.push(FieldError::new(
            format!("{field}.value"),
            "FUNC_TIMEOUT must be a whole number of seconds between 1 and 3600",
        )),
        FUNC_TIMEOUT_ENV if spec.timeout_seconds.is_some() => errors.push(FieldError::new(
            field,
            "FUNC_TIMEOUT and spec.timeoutSeconds both set the timeout; keep one",
        )),
        REQ_MB_LIMIT_ENV | FUNC_BODY_MB_LIMIT_ENV if !whole_number(1024) => {
            errors.push(FieldError::new(
                format!("{field}.value"),
                format!(
                    "{} must be a whole number of MiB between 1 and 1024",
                    var.name
                ),
            ));
        }
        _ => {}
    }
}

pub(super) fn validate_secret_mounts(mounts: &[SecretMount], errors: &mut Vec<FieldError>) {
    for (index, mount) in mounts.iter().enumerate() {
        let field = format!("spec.secretMounts[{index}]");
        if !is_dns1123_subdomain(&mount.secret_name) {
            errors.push(FieldError::new(
                format!("{field}.secretName"),
                "must name a Secret: a DNS-1123 subdomain",
            ));
        }
        let path = mount.mount_path.trim_end_matches('/');
        if !mount.mount_path.starts_with('/')
            || path.is_empty()
            || path
                .split('/')
                .any(|segment| segment == ".." || segment == ".")
            || path.contains('\0')
        {
            errors.push(FieldError::new(
                format!("{field}.mountPath"),
                "must be an absolute directory other than /, without '.' or '..'",
            ));
        } else if mounts[..index]
            .iter()
            .any(|earlier| earlier.mount_path.trim_end_matches('/') == path)
        {
            errors.push(FieldError::new(
                format!("{field}.mountPath"),
                "is mounted more than once",
            ));
        }
    }
}

/// Checks label or annotation keys (and label values) as Kubernetes does; `eddy.dev/` keys are
/// the platform's.
pub(super) fn validate_pod_metadata(
    field: &str,
    entries: &BTreeMap<String, String>,
    labels: bool,
    errors: &mut Vec<FieldError>,
) {
    for (key, value) in entries {
        let (prefix, name) = match key.rsplit_once('/') {
            Some((prefix, name)) => (Some(prefix), name),
            None => (None, key.as_str()),
        };
        if !prefix.is_none_or(is_dns1123_subdomain) || !is_qualified_name_part(name) {
            errors.push(FieldError::new(
                format!("{field}.{key}"),
                "must be a qualified name: [prefix/]name, the name at most 63 letters, digits, '-', '_' or '.'",
            ));
        } else if prefix == Some("eddy.dev") {
            errors.push(FieldError::new(
                format!("{field}.{key}"),
                "eddy.dev/ keys are set by the platform",
            ));
        } else if labels && !(value.is_empty() || is_qualified_name_part(value)) {
            errors.push(FieldError::new(
                format!("{field}.{key}"),
                "a label value is at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit",
            ));
        }
    }
}
