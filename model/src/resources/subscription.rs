//! Subscription: types and their matching, delivery settings, sinks, status, and its
//! validation.

use super::{
    APPLIED_AS_ANNOTATION, BTreeMap, Backoff, BackoffShape, Condition, CustomResource, Deserialize,
    Duration, EVENTS_SUBJECT_PREFIX, FieldError, JsonSchema, KYMA_SUBSCRIPTION_API_VERSION,
    KubeSchema, Serialize, is_dns1035_label, is_dns1123_label, subject, validate_metadata,
};

/// How `spec.types` are matched.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum TypeMatching {
    /// Exact types, or prefixes ending in `.*` (one more segment) or `.>` (one or more).
    #[default]
    Standard,
    /// Types are taken literally.
    Exact,
}

/// A Subscription: events of some types, pushed to a sink.
#[derive(CustomResource, KubeSchema, Debug, Clone, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "eddy.dev",
    version = "v1alpha1",
    kind = "Subscription",
    namespaced,
    validation = Rule::new(r"self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 63")
        .message("metadata.name must be a DNS-1123 label: lower-case letters, digits and '-', at most 63 characters"),
    status = "SubscriptionStatus",
    shortname = "sub",
    printcolumn = r#"{"name":"Ready","type":"boolean","jsonPath":".status.ready"}"#,
    printcolumn = r#"{"name":"Sink","type":"string","jsonPath":".spec.sink"}"#
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(validation = Rule::new(r"(has(self.typeMatching) && self.typeMatching == 'exact') || self.types.all(t, !t.matches('(^|[.])[*>][.]') && !t.matches('^[*>]$'))")
    .message("wildcards `*` and `>` may only end a prefix, as in `order.*` or `order.>`").field_path(".types"))]
#[x_kube(validation = Rule::new(r"!has(self.source) || size(self.source) > 0 || (has(self.typeMatching) && self.typeMatching == 'exact')")
    .message(EMPTY_SOURCE_MESSAGE).field_path(".source"))]
pub struct SubscriptionSpec {
    /// Where events go: `http://<function>.<namespace>.svc.cluster.local`.
    #[schemars(length(max = 2048))]
    #[x_kube(validation = Rule::new("isURL(self) && (self.startsWith('http://') || self.startsWith('https://'))").message("must be an http(s) URL"))]
    pub sink: String,
    /// Only events with this CloudEvents source (standard matching; exact matching, as Kyma's,
    /// matches the type alone and ignores it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub source: Option<String>,
    /// Event types (or prefixes, with standard matching).
    #[schemars(length(max = 64), inner(length(max = 512)))]
    #[x_kube(validation = Rule::new("size(self) > 0").message("at least one type is required"))]
    #[x_kube(validation = Rule::new(r"self.all(t, t.matches('^[^.]+([.][^.]+)*$'))").message("types must not be empty or have empty segments (`a..b`, `.a`, `a.`)"))]
    #[x_kube(validation = Rule::new("self.all(t, self.exists_one(u, u == t))").message("types must be given once each"))]
    pub types: Vec<String>,
    /// `standard` (prefixes allowed) or `exact`.
    #[serde(default)]
    pub type_matching: TypeMatching,
    /// Flow control.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = {}))]
    pub config: Option<SubscriptionConfig>,
    /// Retries, backoff and timeouts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = {}))]
    pub delivery: Option<DeliverySpec>,
    /// An identifier of the user's choosing (Kyma's `id`), kept as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub id: Option<String>,
}

/// Flow control of a Subscription.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct SubscriptionConfig {
    /// Most events in flight to the sink at once (Kyma writes it as a string; both are taken).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = 10))]
    #[x_kube(validation = Rule::new("string(self).matches('^[0-9]{1,5}$') && int(string(self)) >= 1 && int(string(self)) <= 10000").message("must be a whole number between 1 and 10000"))]
    pub max_in_flight_messages: Option<IntOrString>,
    /// Other keys (those of Kyma's EventMesh backend): kept as written, not used, and reported
    /// as ignored.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(skip)]
    pub ignored: BTreeMap<String, serde_json::Value>,
}

/// Why an empty `source` is refused.
pub const EMPTY_SOURCE_MESSAGE: &str =
    "must not be empty with standard type matching (exact matching ignores it)";

impl std::fmt::Display for IntOrString {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Int(n) => write!(f, "{n}"),
            Self::String(text) => f.write_str(text),
        }
    }
}

/// An integer that may be written as a string, as Kyma's `config` map does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum IntOrString {
    /// `10`
    Int(i64),
    /// `"10"`
    String(String),
}

/// The structural schema Kubernetes wants for a field that is an integer or a string.
impl JsonSchema for IntOrString {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "IntOrString".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({ "x-kubernetes-int-or-string": true })
    }
}

/// Delivery settings of a Subscription.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
// The cross-field rules skip malformed durations: the field's own rule reports those, and
// `duration()` on them would be an evaluation error rather than a clear message.
#[x_kube(validation = Rule::new("!has(self.maxDelay) || !self.maxDelay.matches('^([0-9]+(ns|us|ms|s|m|h))+$') || (has(self.initialDelay) && !self.initialDelay.matches('^([0-9]+(ns|us|ms|s|m|h))+$')) || duration(self.maxDelay) >= (has(self.initialDelay) ? duration(self.initialDelay) : duration('1s'))")
    .message("maxDelay must not be below initialDelay").field_path(".maxDelay"))]
#[x_kube(validation = Rule::new("has(self.maxDelay) || !has(self.initialDelay) || !self.initialDelay.matches('^([0-9]+(ns|us|ms|s|m|h))+$') || duration(self.initialDelay) <= duration('60s')")
    .message("maxDelay (default 60s) must not be below initialDelay").field_path(".initialDelay"))]
pub struct DeliverySpec {
    /// Deliveries before the event goes to dead letters (default 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = 5))]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 100").message("must be between 1 and 100"))]
    pub max_attempts: Option<i64>,
    /// Backoff shape (default exponential).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "exponential"))]
    pub backoff: Option<BackoffShape>,
    /// First retry delay (default 1s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64), extend("default" = "1s"))]
    #[x_kube(validation = Rule::new(GO_DURATION_RULE).message(GO_DURATION_MESSAGE))]
    pub initial_delay: Option<String>,
    /// Longest retry delay (default 60s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64), extend("default" = "60s"))]
    #[x_kube(validation = Rule::new(GO_DURATION_RULE).message(GO_DURATION_MESSAGE))]
    pub max_delay: Option<String>,
    /// Per-delivery timeout (default 30s, at most 1h).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64), extend("default" = "30s"))]
    #[x_kube(validation = Rule::new(GO_DURATION_RULE).message(GO_DURATION_MESSAGE))]
    #[x_kube(validation = Rule::new("!self.matches('^([0-9]+(ns|us|ms|s|m|h))+$') || duration(self) <= duration('1h')").message("must be at most 1h"))]
    pub timeout: Option<String>,
}

/// A resolved type filter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TypeStatus {
    /// The type as written in the spec.
    #[serde(rename = "type")]
    pub type_: String,
    /// The NATS subject filter it resolves to.
    pub subject: String,
    /// The type as written (Kyma's name for it).
    #[serde(rename = "originalType", default)]
    pub original_type: String,
    /// The type as matched: eddy matches types as written, so the same as `originalType`.
    #[serde(rename = "cleanType", default)]
    pub clean_type: String,
}

/// Observed state of a Subscription.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SubscriptionStatus {
    /// Valid, consumer in place, sink resolvable.
    #[serde(default)]
    pub ready: bool,
    /// `Ready`.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// Each type and its subject filter.
    #[serde(default)]
    pub types: Vec<TypeStatus>,
    /// Where the events come from: the JetStream stream and the Subscription's consumer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<SubscriptionBackend>,
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The JetStream objects behind a Subscription.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SubscriptionBackend {
    /// `nats-jetstream`.
    #[serde(rename = "type")]
    pub type_: String,
    /// The events stream.
    pub stream_name: String,
    /// The Subscription's durable consumer.
    pub consumer_name: String,
}

/// CEL rule for duration fields: Go duration syntax (which both CEL's `duration()` and
/// [`parse_go_duration`] read), greater than zero.
const GO_DURATION_RULE: &str =
    "self.matches('^([0-9]+(ns|us|ms|s|m|h))+$') && duration(self) > duration('0s')";
const GO_DURATION_MESSAGE: &str =
    "must be a duration greater than zero, like 500ms, 1s, 2m or 1h30m";

/// Parses a Go-style duration made of whole numbers and units (`500ms`, `1m30s`, `2h`), the
/// subset that Kubernetes CEL's `duration()` reads too, so the CRD and the local API agree.
pub fn parse_go_duration(text: &str) -> Option<Duration> {
    let mut total = Duration::ZERO;
    let mut rest = text;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        let value: u64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        let unit = match &rest[..unit_len] {
            "ns" => Duration::from_nanos(1),
            "us" => Duration::from_micros(1),
            "ms" => Duration::from_millis(1),
            "s" => Duration::from_secs(1),
            "m" => Duration::from_secs(60),
            "h" => Duration::from_secs(3600),
            _ => return None,
        };
        rest = &rest[unit_len..];
        total = total.checked_add(unit.checked_mul(u32::try_from(value).ok()?)?)?;
    }
    Some(total)
}

/// Default `maxInFlightMessages`.
pub const DEFAULT_MAX_IN_FLIGHT: u32 = 10;
/// Default `maxAttempts`.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;

/// A Subscription's delivery settings with defaults filled in and durations parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeliveryPolicy {
    /// Most events in flight at once.
    pub max_in_flight: u32,
    /// Deliveries before dead letters.
    pub max_attempts: u32,
    /// Retry delays: shape, first delay, longest delay.
    pub backoff: Backoff,
    /// Per-delivery timeout.
    pub timeout: Duration,
}

impl DeliveryPolicy {
    /// Delay before attempt `attempt + 1`, after `attempt` (1-based) failed.
    pub fn retry_delay(&self, attempt: u32) -> Duration {
        self.backoff.delay(attempt.max(1))
    }
}

/// Where a sink may point.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SinkPolicy {
    /// Sink URLs allowed besides function Services, parsed where the flag is read (see
    /// [`AllowedSink`]): `http://127.0.0.1:9000/hooks`, `http://127.0.0.1:*`, `https://`, `*`.
    pub allowed: Vec<AllowedSink>,
}

impl SinkPolicy {
    /// The policy of these `--allowed-sinks` entries, or why one is not an entry.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Self, InvalidAllowedSink> {
        let allowed = entries
            .iter()
            .map(|entry| entry.as_ref().parse())
            .collect::<Result<_, _>>()?;
        Ok(Self { allowed })
    }

    /// The sink as a normalized URL (dot segments resolved) when an allowed entry covers it.
    /// Userinfo is never allowed: `http://127.0.0.1:9@10.0.0.1/` names host 10.0.0.1.
    pub fn allowed_url(&self, sink: &str) -> Option<url::Url> {
        let url = url::Url::parse(sink).ok()?;
        if !url.username().is_empty() || url.password().is_some() || url.cannot_be_a_base() {
            return None;
        }
        self.allowed
            .iter()
            .any(|allowed| allowed.covers(&url))
            .then_some(url)
    }
}

/// An `--allowed-sinks` entry that is not one: the entry, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("allowed sink `{entry}`: {problem}")]
pub struct InvalidAllowedSink {
    /// The entry as given.
    pub entry: String,
    /// What is wrong with it.
    pub problem: String,
}

/// One entry of the sink policy. Scheme, host and port are compared as parsed from a URL, and
/// the path at segment boundaries, never as text: `http://127.0.0.1:9` does not allow
/// `http://127.0.0.1:90` nor `http://127.0.0.1:9@other/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllowedSink {
    /// `*`: any http or https URL.
    Any,
    /// `scheme://[host[:port|:*]][/path]`.
    Url {
        /// `http` or `https`.
        scheme: String,
        /// `None`: any host.
        host: Option<String>,
        /// `None`: any port.
        port: Option<u16>,
        /// The path the sink's path starts with, ending in `/` or followed by one in the sink.
        path: String,
    },
}

impl std::str::FromStr for AllowedSink {
    type Err = InvalidAllowedSink;

    fn from_str(entry: &str) -> Result<Self, Self::Err> {
        let entry = entry.trim();
        if entry == "*" {
            return Ok(Self::Any);
        }
        let invalid = |problem: &str| InvalidAllowedSink {
            entry: entry.to_owned(),
            problem: problem.to_owned(),
        };
        let (scheme, rest) = entry
            .split_once("://")
            .ok_or_else(|| invalid("expected scheme://host[:port][/path] or *"))?;
        let scheme = scheme.to_ascii_lowercase();
        if scheme != "http" && scheme != "https" {
            return Err(invalid("the scheme must be http or https"));
        }
        let (authority, path) = match rest.find('/') {
            Some(slash) => (&rest[..slash], &rest[slash..]),
            None => (rest, "/"),
        };
        if authority.contains('@') {
            return Err(invalid("userinfo is not allowed"));
        }
        if authority.is_empty() {
            return Ok(Self::Url {
                scheme,
                host: None,
                port: None,
                path: "/".to_owned(),
            });
        }
        let (authority, any_port) = match authority
            .strip_suffix(":*")
            .or_else(|| authority.strip_suffix(':'))
        {
            Some(host) => (host, true),
            None => (authority, false),
        };
        let parsed = url::Url::parse(&format!("{scheme}://{authority}{path}"))
            .map_err(|error| invalid(&error.to_string()))?;
        let host = parsed
            .host_str()
            .ok_or_else(|| invalid("no host"))?
            .to_owned();
        Ok(Self::Url {
            scheme,
            host: Some(host),
            port: if any_port {
                None
            } else {
                parsed.port_or_known_default()
            },
            path: parsed.path().to_owned(),
        })
    }
}

impl AllowedSink {
    /// Whether `url` is inside this entry.
    pub fn covers(&self, url: &url::Url) -> bool {
        let (scheme, host, port, path) = match self {
            Self::Any => return matches!(url.scheme(), "http" | "https"),
            Self::Url {
                scheme,
                host,
                port,
                path,
            } => (scheme, host, port, path),
        };
        if url.scheme() != scheme {
            return false;
        }
        if host
            .as_deref()
            .is_some_and(|host| url.host_str() != Some(host))
        {
            return false;
        }
        if port.is_some_and(|port| url.port_or_known_default() != Some(port)) {
            return false;
        }
        let sink_path = url.path();
        sink_path.starts_with(path.as_str())
            && (path.ends_with('/')
                || sink_path.len() == path.len()
                || sink_path[path.len()..].starts_with('/'))
    }
}

/// One `--allowed-sinks` entry (a clap value parser).
pub fn parse_allowed_sink(entry: &str) -> Result<AllowedSink, InvalidAllowedSink> {
    entry.parse()
}

/// A sink that names a Function's Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionSink {
    /// The function.
    pub function: String,
    /// Its namespace.
    pub namespace: String,
    /// Path and query after the host, `/` at least.
    pub path_and_query: String,
}

/// Parses a Service sink as Kyma takes it: `http[s]://<service>.<namespace>.svc.cluster.local
/// [:port][/path]`. On Kubernetes the URL is used as written; locally, where a Function has no
/// Service, it goes to the Function's instances whatever the scheme and port say.
pub fn parse_function_sink(sink: &str) -> Option<FunctionSink> {
    let url = url::Url::parse(sink).ok()?;
    if !matches!(url.scheme(), "http" | "https")
        || !url.username().is_empty()
        || url.password().is_some()
    {
        return None;
    }
    let host = url.host_str()?;
    let rest = host.strip_suffix(".svc.cluster.local")?;
    let (function, namespace) = rest.split_once('.')?;
    if !is_dns1035_label(function) || !is_dns1123_label(namespace) {
        return None;
    }
    let mut path_and_query = url.path().to_owned();
    if let Some(query) = url.query() {
        path_and_query.push('?');
        path_and_query.push_str(query);
    }
    Some(FunctionSink {
        function: function.to_owned(),
        namespace: namespace.to_owned(),
        path_and_query,
    })
}

fn parse_duration_field(
    value: Option<&str>,
    default: Duration,
    field: &str,
    errors: &mut Vec<FieldError>,
) -> Duration {
    let Some(text) = value else { return default };
    match parse_go_duration(text) {
        Some(duration) if !duration.is_zero() => duration,
        _ => {
            errors.push(FieldError::new(field, GO_DURATION_MESSAGE));
            default
        }
    }
}

impl SubscriptionSpec {
    /// The delivery policy, or every problem with the fields behind it.
    pub fn delivery_policy(&self) -> Result<DeliveryPolicy, Vec<FieldError>> {
        let mut errors = Vec::new();
        let max_in_flight = match self
            .config
            .as_ref()
            .and_then(|c| c.max_in_flight_messages.as_ref())
        {
            None => DEFAULT_MAX_IN_FLIGHT,
            Some(value) => {
                let parsed = match value {
                    IntOrString::Int(n) => Some(*n),
                    IntOrString::String(text)
                        if (1..=5).contains(&text.len())
                            && text.bytes().all(|b| b.is_ascii_digit()) =>
                    {
                        text.parse().ok()
                    }
                    IntOrString::String(_) => None,
                };
                match parsed
                    .and_then(|n| u32::try_from(n).ok())
                    .filter(|n| (1..=10_000).contains(n))
                {
                    Some(n) => n,
                    None => {
                        errors.push(FieldError::new(
                            "spec.config.maxInFlightMessages",
                            "must be a whole number between 1 and 10000",
                        ));
                        DEFAULT_MAX_IN_FLIGHT
                    }
                }
            }
        };
        let delivery = self.delivery.clone().unwrap_or_default();
        let max_attempts = match delivery.max_attempts {
            None => DEFAULT_MAX_ATTEMPTS,
            Some(n) => match u32::try_from(n).ok().filter(|n| (1..=100).contains(n)) {
                Some(n) => n,
                None => {
                    errors.push(FieldError::new(
                        "spec.delivery.maxAttempts",
                        "must be between 1 and 100",
                    ));
                    DEFAULT_MAX_ATTEMPTS
                }
            },
        };
        let initial_delay = parse_duration_field(
            delivery.initial_delay.as_deref(),
            Duration::from_secs(1),
            "spec.delivery.initialDelay",
            &mut errors,
        );
        let max_delay = parse_duration_field(
            delivery.max_delay.as_deref(),
            Duration::from_secs(60),
            "spec.delivery.maxDelay",
            &mut errors,
        );
        let timeout = parse_duration_field(
            delivery.timeout.as_deref(),
            Duration::from_secs(30),
            "spec.delivery.timeout",
            &mut errors,
        );
        if max_delay < initial_delay {
            errors.push(FieldError::new(
                "spec.delivery.maxDelay",
                "must not be below initialDelay",
            ));
        }
        if timeout > Duration::from_secs(3600) {
            errors.push(FieldError::new(
                "spec.delivery.timeout",
                "must be at most 1h",
            ));
        }
        if errors.is_empty() {
            Ok(DeliveryPolicy {
                max_in_flight,
                max_attempts,
                backoff: Backoff {
                    shape: delivery.backoff.unwrap_or_default(),
                    initial: initial_delay,
                    max: max_delay,
                },
                timeout,
            })
        } else {
            Err(errors)
        }
    }

    /// The NATS subject filter of each type under eddy's rules, or the problems with them.
    pub fn type_subjects(&self) -> Result<Vec<TypeStatus>, Vec<FieldError>> {
        self.type_subjects_as(false)
    }

    /// What is written but not used, for warnings: `source` under exact matching, and `config`
    /// keys other than `maxInFlightMessages`.
    pub fn ignored_fields(&self) -> Vec<String> {
        let mut ignored = Vec::new();
        if self.type_matching == TypeMatching::Exact
            && self.source.as_deref().is_some_and(|s| !s.is_empty())
        {
            ignored.push("spec.source is ignored with exact type matching: the type alone is matched, as in Kyma".to_owned());
        }
        if let Some(config) = &self.config {
            for key in config.ignored.keys() {
                ignored.push(format!("spec.config.{key} is ignored: eddy reads only maxInFlightMessages (other keys belong to Kyma's EventMesh backend)"));
            }
        }
        ignored
    }

    /// The NATS subject filter of each type, or the problems with them. Exact matching matches
    /// the type alone, whatever `source` says. `kyma`: the Subscription came in Kyma's form, where
    /// standard matching has no wildcards (`*` and `>` are among the characters Kyma's backend
    /// removes) and the status reports the type as Kyma's backend cleans it (`cleanType`).
    pub fn type_subjects_as(&self, kyma: bool) -> Result<Vec<TypeStatus>, Vec<FieldError>> {
        let mut errors = Vec::new();
        let mut resolved = Vec::with_capacity(self.types.len());
        if self.types.is_empty() {
            errors.push(FieldError::new(
                "spec.types",
                "at least one type is required",
            ));
        }
        let exact = self.type_matching == TypeMatching::Exact;
        let source_token = match self.source.as_deref() {
            _ if exact => "*".to_owned(),
            None => "*".to_owned(),
            Some("") => {
                errors.push(FieldError::new("spec.source", EMPTY_SOURCE_MESSAGE));
                "*".to_owned()
            }
            Some(source) => subject::escape_token(source),
        };
        let matching = if kyma {
            TypeMatching::Exact
        } else {
            self.type_matching
        };
        for (index, ty) in self.types.iter().enumerate() {
            match type_filter(ty, matching) {
                Ok(pattern) => {
                    let subject = format!("{EVENTS_SUBJECT_PREFIX}.{source_token}.{pattern}");
                    if subject.len() > subject::MAX_SUBJECT_LEN {
                        errors.push(FieldError::new(format!("spec.types[{index}]"), "too long"));
                    } else if resolved.iter().any(|t: &TypeStatus| t.subject == subject) {
                        errors.push(FieldError::new(
                            format!("spec.types[{index}]"),
                            "types must be given once each",
                        ));
                    } else {
                        resolved.push(TypeStatus {
                            type_: ty.clone(),
                            subject,
                            original_type: ty.clone(),
                            clean_type: if kyma && !exact {
                                kyma_clean_type(ty)
                            } else {
                                ty.clone()
                            },
                        });
                    }
                }
                Err(bad) => errors.push(FieldError::new(
                    format!("spec.types[{index}]"),
                    bad.to_string(),
                )),
            }
        }
        if errors.is_empty() {
            Ok(resolved)
        } else {
            Err(errors)
        }
    }
}

/// A type as Kyma's JetStream backend cleans it for standard matching: whitespace, `>`, `*`,
/// `/` and `\` removed.
pub fn kyma_clean_type(ty: &str) -> String {
    ty.chars()
        .filter(|c| !c.is_whitespace() && !matches!(c, '>' | '*' | '/' | '\\'))
        .collect()
}

impl Subscription {
    /// Whether it was applied in Kyma's form (`eventing.kyma-project.io/v1alpha2`).
    pub fn is_kyma(&self) -> bool {
        self.metadata
            .annotations
            .as_ref()
            .and_then(|annotations| annotations.get(APPLIED_AS_ANNOTATION))
            .is_some_and(|applied_as| applied_as == KYMA_SUBSCRIPTION_API_VERSION)
    }

    /// The NATS subject filter of each type, under the rules of the form it was applied in.
    pub fn type_subjects(&self) -> Result<Vec<TypeStatus>, Vec<FieldError>> {
        self.spec.type_subjects_as(self.is_kyma())
    }
}

/// Why a Subscription's type cannot be matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
enum BadType {
    #[error("must not be empty or have empty segments (`a..b`, `.a`, `a.`)")]
    EmptySegment,
    #[error("wildcards `*` and `>` may only end a prefix, as in `order.*` or `order.>`")]
    MisplacedWildcard,
}

/// The subject pattern after the source token for one type.
fn type_filter(ty: &str, matching: TypeMatching) -> Result<String, BadType> {
    let segments: Vec<&str> = ty.split('.').collect();
    if segments.iter().any(|segment| segment.is_empty()) {
        return Err(BadType::EmptySegment);
    }
    let mut pattern = String::with_capacity(ty.len() + 8);
    let last = segments.len() - 1;
    for (index, segment) in segments.iter().enumerate() {
        if index > 0 {
            pattern.push('.');
        }
        let wildcard = matching == TypeMatching::Standard && (*segment == "*" || *segment == ">");
        if wildcard && index == last && index > 0 {
            pattern.push_str(segment);
        } else if wildcard {
            return Err(BadType::MisplacedWildcard);
        } else {
            subject::escape_token_into(segment, &mut pattern);
        }
    }
    Ok(pattern)
}

/// Checks a Subscription; every problem is reported.
pub fn validate_subscription(subscription: &Subscription, sinks: &SinkPolicy) -> Vec<FieldError> {
    let mut errors = validate_metadata(&subscription.metadata, false);
    let spec = &subscription.spec;
    if let Err(found) = subscription.type_subjects() {
        errors.extend(found);
    }
    if let Err(found) = spec.delivery_policy() {
        errors.extend(found);
    }
    let namespace = subscription
        .metadata
        .namespace
        .as_deref()
        .unwrap_or("default");
    let http_url = (spec.sink.starts_with("http://") || spec.sink.starts_with("https://"))
        && url::Url::parse(&spec.sink).is_ok();
    match parse_function_sink(&spec.sink) {
        // The same words as the CRD's rule on `sink`.
        _ if !http_url => errors.push(FieldError::new("spec.sink", "must be an http(s) URL")),
        Some(sink) if sink.namespace != namespace => errors.push(FieldError::new(
            "spec.sink",
            format!("must be a Service in the Subscription's namespace ({namespace})"),
        )),
        Some(_) => {}
        None if sinks.allowed_url(&spec.sink).is_some() => {}
        None => errors.push(FieldError::new(
            "spec.sink",
            format!(
                "must be a function Service, http://<function>.{namespace}.svc.cluster.local, \
                 or a URL allowed by the platform's sink policy"
            ),
        )),
    }
    errors
}
