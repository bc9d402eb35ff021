//! APIRule hosts: what a short name means, which APIRule keeps a host several name, and the
//! names no APIRule may take (addresses, the gateway's own).

use super::{APIRule, BTreeMap, FieldError, is_dns1123_label};

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
    /// Its full host names. An APIRule that cannot be honoured claims nothing and is left out.
    pub hosts: &'a [String],
}

/// A host an older APIRule holds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("host {host} is already exposed by APIRule {}/{}", .holder.0, .holder.1)]
pub struct HostTaken {
    /// The host.
    pub host: String,
    /// Namespace and name of the APIRule holding it.
    pub holder: RuleKey,
}

/// Who holds each host: the oldest APIRule naming it; in the same second the one that held it,
/// then by namespace and name. Every claim gets `Ok` (it holds all its hosts) or the first host
/// it lost, in the order they were decided. The gateways route by it and the controllers report
/// it, so both say the same. Pure.
pub fn award_hosts<'a>(
    mut claims: Vec<HostClaim<'a>>,
) -> Vec<(&'a RuleKey, Result<(), HostTaken>)> {
    claims.sort_by(|a, b| (a.created, !a.held, a.key).cmp(&(b.created, !b.held, b.key)));
    let mut holders: BTreeMap<&'a str, &'a RuleKey> = BTreeMap::new();
    let mut awarded = Vec::with_capacity(claims.len());
    for claim in claims {
        if let Some((host, holder)) = claim
            .hosts
            .iter()
            .find_map(|host| Some((host, *holders.get(host.as_str())?)))
        {
            let taken = HostTaken {
                host: host.clone(),
                holder: holder.clone(),
            };
            awarded.push((claim.key, Err(taken)));
            continue;
        }
        for host in claim.hosts {
            holders.insert(host, claim.key);
        }
        awarded.push((claim.key, Ok(())));
    }
    awarded
}

/// Whether `host` is a name Kyma takes: one lower-case DNS label, or at least two. Never an
/// address: a name of two labels or more, or a wildcard, may not end in a numeric label (see
/// [`ends_in_number`]), so neither an IPv4 literal in any form a common parser reads
/// (`127.0.0.1`, `127.0.0.0x1`, `0x7f.1`) nor a wildcard that could match one (`*.0.0.1`,
/// `*.1`, `*.0x1`) is a host. Pure.
pub(super) fn is_host(host: &str) -> bool {
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
    host.len() <= 255
        && named.split('.').all(is_dns1123_label)
        && !(ends_named && ends_in_number(named))
}

/// Whether some common parser reads `host` (lower case, without its port) as an IP address
/// rather than a name: an IPv6 or dotted-decimal IPv4 literal, or any name whose last label is
/// a number in the bases inet_aton takes (`1`, `017`, `0x1f`, `0x`). inet_aton (Python's
/// urllib, wget, curl's older builds) reads `127.0.0.0x1`, `0x7f.1` and `2130706433` as
/// 127.0.0.1, and the WHATWG URL parser (browsers, Node's `new URL`) takes any host that ends
/// in such a label for an IPv4 address (RFC 3696 section 2: no top-level domain is numeric, so
/// no real name does). Pure.
pub fn reads_as_address(host: &str) -> bool {
    host.parse::<std::net::IpAddr>().is_ok() || ends_in_number(host)
}

/// Whether the last label of `name` (a trailing dot ignored) is a number to inet_aton:
/// decimal or octal digits, or `0x` followed by hex digits (none counts). Pure.
fn ends_in_number(name: &str) -> bool {
    let last = name
        .trim_end_matches('.')
        .rsplit('.')
        .next()
        .unwrap_or_default();
    let last = last.as_bytes();
    match last {
        [] => false,
        [b'0', b'x' | b'X', hex @ ..] => hex.iter().all(u8::is_ascii_hexdigit),
        digits => digits.iter().all(u8::is_ascii_digit),
    }
}

/// Whether an APIRule's full host (see [`full_host`]) takes `reserved`: names it, or is a
/// wildcard over it. Pure.
pub(super) fn takes(host: &str, reserved: &str) -> bool {
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
