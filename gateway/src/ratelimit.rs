//! Kyma's RateLimits, kept by the gateway in both modes: each Function is held by the oldest
//! valid RateLimit of its namespace whose `selectorLabels` its pods carry
//! (`eddy_model::ratelimit::holder`, the rule the controller's status reports), and each call
//! to it takes a token from the first bucket it matches (path, headers) or the default one.
//! Buckets are the gateway instance's own, as Envoy's local rate limit keeps them per proxy.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
    time::Duration,
};

use axum::response::{IntoResponse, Response};
use eddy_model::ratelimit::{
    Bucket, BucketMatch, LIMITED_BODY, RateLimit, RateLimitKey, holder, key_of,
};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use parking_lot::{Mutex, RwLock};
use tokio::time::Instant;

use crate::FunctionKey;

/// `x-ratelimit-limit`: the bucket's size (Envoy's `DRAFT_VERSION_03` headers, as Kyma
/// configures them with `enableResponseHeaders`).
const LIMIT_HEADER: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `x-ratelimit-remaining`: the tokens left after this call.
const REMAINING_HEADER: HeaderName = HeaderName::from_static("x-ratelimit-remaining");

/// One token bucket: full at first, filled on its interval's ticks.
#[derive(Debug)]
struct TokenBucket {
    bucket: Bucket,
    /// Tokens now, and the tick they were counted at.
    state: Mutex<(u32, Instant)>,
}

impl TokenBucket {
    fn new(bucket: Bucket, now: Instant) -> Self {
        Self {
            bucket,
            state: Mutex::new((bucket.max_tokens, now)),
        }
    }

    /// Takes a token if there is one: whether it did, and how many are left.
    fn take(&self, now: Instant) -> (bool, u32) {
        let Bucket {
            max_tokens,
            tokens_per_fill,
            fill_interval,
        } = self.bucket;
        let mut state = self.state.lock();
        let (tokens, counted_at) = &mut *state;
        let ticks =
            now.saturating_duration_since(*counted_at).as_nanos() / fill_interval.as_nanos();
        if ticks > 0 {
            let added = u128::from(tokens_per_fill).saturating_mul(ticks);
            *tokens = u32::try_from((u128::from(*tokens) + added).min(u128::from(max_tokens)))
                .unwrap_or(max_tokens);
            // Whole ticks only: the next fill comes on the interval's beat, as Envoy's timer.
            let elapsed = u32::try_from(ticks)
                .ok()
                .and_then(|ticks| fill_interval.checked_mul(ticks))
                .unwrap_or(Duration::MAX);
            *counted_at = counted_at.checked_add(elapsed).unwrap_or(now);
        }
        if *tokens > 0 {
            *tokens -= 1;
            (true, *tokens)
        } else {
            (false, 0)
        }
    }
}

/// A RateLimit's buckets, as compiled once per spec.
#[derive(Debug)]
pub struct Limiter {
    default: TokenBucket,
    buckets: Vec<(BucketMatch, TokenBucket)>,
    enforce: bool,
    response_headers: bool,
    /// `namespace/name`, for logs.
    name: String,
}

/// What one call's token says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Refuse it (no token, and the RateLimit enforces).
    pub refused: bool,
    /// The bucket's size and the tokens left, when the RateLimit answers them.
    pub headers: Option<(u32, u32)>,
}

impl Verdict {
    /// Adds the `x-ratelimit-*` headers, when the RateLimit answers them.
    pub fn decorate(&self, headers: &mut HeaderMap) {
        if let Some((limit, remaining)) = self.headers {
            headers.insert(LIMIT_HEADER, HeaderValue::from(limit));
            headers.insert(REMAINING_HEADER, HeaderValue::from(remaining));
        }
    }

    /// The refusal, as Envoy's local rate limit answers it: 429, `local_rate_limited`.
    pub fn refusal(&self) -> Response {
        let mut answer = (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::CONTENT_TYPE, "text/plain")],
            LIMITED_BODY,
        )
            .into_response();
        self.decorate(answer.headers_mut());
        answer
    }
}

impl Limiter {
    fn compile(rate_limit: &RateLimit, now: Instant) -> Option<Self> {
        let eddy_model::ratelimit::Buckets { default, buckets } =
            rate_limit.spec.compiled().ok()?;
        let (namespace, name) = key_of(rate_limit);
        Some(Self {
            default: TokenBucket::new(default, now),
            buckets: buckets
                .into_iter()
                .map(|(matching, bucket)| (matching, TokenBucket::new(bucket, now)))
                .collect(),
            enforce: rate_limit.spec.enforce,
            response_headers: rate_limit.spec.enable_response_headers,
            name: format!("{namespace}/{name}"),
        })
    }

    /// Takes a token for a call to `path` (as the Function sees it, without the query) with
    /// `headers`: from the first bucket whose path and headers it matches, else the default.
    pub fn take(&self, path: &str, headers: &HeaderMap) -> Verdict {
        let matches = |matching: &BucketMatch| {
            matching.path.as_deref().is_none_or(|wanted| wanted == path)
                && matching.headers.iter().all(|(name, value)| {
                    headers
                        .get(name.as_str())
                        .is_some_and(|given| given.as_bytes() == value.as_bytes())
                })
        };
        let bucket = self
            .buckets
            .iter()
            .find(|(matching, _)| matches(matching))
            .map_or(&self.default, |(_, bucket)| bucket);
        let (taken, remaining) = bucket.take(Instant::now());
        if !taken {
            tracing::debug!(ratelimit = %self.name, path, enforced = self.enforce, "call over its rate limit");
        }
        Verdict {
            refused: !taken && self.enforce,
            headers: self
                .response_headers
                .then_some((bucket.bucket.max_tokens, remaining)),
        }
    }
}

/// A RateLimit and its buckets.
struct Entry {
    rate_limit: RateLimit,
    limiter: Option<Arc<Limiter>>,
}

#[derive(Default)]
struct Table {
    entries: HashMap<RateLimitKey, Entry>,
    /// Each Function's pod labels.
    functions: HashMap<FunctionKey, BTreeMap<String, String>>,
    /// Each limited Function's limiter.
    held: HashMap<FunctionKey, Arc<Limiter>>,
}

impl Table {
    /// `rate_limit` as an entry: the buckets of its known version when its spec is unchanged
    /// (they keep their tokens), else new ones (none when it is invalid).
    fn entry(&self, rate_limit: RateLimit) -> Entry {
        let limiter = match self.entries.get(&key_of(&rate_limit)) {
            Some(known) if known.rate_limit.spec == rate_limit.spec => known.limiter.clone(),
            _ => Limiter::compile(&rate_limit, Instant::now()).map(Arc::new),
        };
        Entry {
            rate_limit,
            limiter,
        }
    }

    fn rebuild(&mut self) {
        // The valid ones, with their buckets: only those hold a Function.
        let valid: Vec<(&RateLimit, &Arc<Limiter>)> = self
            .entries
            .values()
            .filter_map(|entry| Some((&entry.rate_limit, entry.limiter.as_ref()?)))
            .collect();
        let mut held = HashMap::new();
        for ((namespace, name), labels) in self.functions.iter().filter(|_| !valid.is_empty()) {
            let rate_limits = valid.iter().map(|(rate_limit, _)| *rate_limit);
            if let Some(holder) = holder(rate_limits, namespace, labels)
                && let Some((_, limiter)) = valid
                    .iter()
                    .find(|(rate_limit, _)| std::ptr::eq(*rate_limit, holder))
            {
                held.insert((namespace.clone(), name.clone()), Arc::clone(limiter));
            }
        }
        self.held = held;
    }
}

/// The RateLimits a gateway keeps, and the Functions they hold.
#[derive(Default)]
pub struct RateLimits {
    table: RwLock<Table>,
}

impl RateLimits {
    /// The limiter of calls to a Function, when a RateLimit holds it.
    pub fn of(&self, function: &FunctionKey) -> Option<Arc<Limiter>> {
        let table = self.table.read();
        if table.held.is_empty() {
            return None;
        }
        table.held.get(function).cloned()
    }

    /// Takes a RateLimit (replacing its earlier version; an unchanged spec keeps its buckets).
    pub fn apply(&self, rate_limit: &RateLimit) {
        let mut table = self.table.write();
        let entry = table.entry(rate_limit.clone());
        table.entries.insert(key_of(rate_limit), entry);
        table.rebuild();
    }

    /// Forgets a RateLimit.
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

    /// Takes every RateLimit there is, forgetting the rest (a relist).
    pub fn replace_all(&self, rate_limits: Vec<RateLimit>) {
        let mut table = self.table.write();
        let entries = rate_limits
            .into_iter()
            .map(|rate_limit| (key_of(&rate_limit), table.entry(rate_limit)))
            .collect();
        table.entries = entries;
        table.rebuild();
    }

    /// Takes a Function's pod labels (`None`: it is gone).
    pub fn set_function(&self, function: FunctionKey, labels: Option<BTreeMap<String, String>>) {
        let mut table = self.table.write();
        let changed = match labels {
            Some(labels) => table.functions.insert(function, labels.clone()) != Some(labels),
            None => table.functions.remove(&function).is_some(),
        };
        if changed && !table.entries.is_empty() {
            table.rebuild();
        }
    }
}

/// Follows the RateLimits and the Functions of the local store into `rate_limits` until
/// `shutdown` (the local gateway's; the controller reports their status by the same rule).
pub async fn follow_store(
    store: eddy_platform::store::Store,
    rate_limits: Arc<RateLimits>,
    shutdown: eddy_platform::shutdown::CancellationToken,
) {
    use eddy_model::resources::Function;
    use eddy_platform::store::{Change, StoredResource as _};
    use kube::ResourceExt as _;
    let limits = store.follow::<RateLimit, _, _>(&shutdown, |change| {
        let rate_limits = rate_limits.clone();
        async move {
            match change {
                Change::Applied(rate_limit) => rate_limits.apply(&rate_limit),
                Change::Deleted { namespace, name } => rate_limits.remove(&namespace, &name),
                Change::Synced => {}
            }
        }
    });
    let functions = store.follow::<Function, _, _>(&shutdown, |change| {
        let rate_limits = rate_limits.clone();
        async move {
            match change {
                Change::Applied(function) => {
                    let uid = function.uid().unwrap_or_default();
                    let labels = eddy_model::ratelimit::function_pod_labels(&function, &uid);
                    rate_limits.set_function(function.key(), Some(labels));
                }
                Change::Deleted { namespace, name } => {
                    rate_limits.set_function((namespace, name), None);
                }
                Change::Synced => {}
            }
        }
    });
    tokio::join!(limits, functions);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn bucket(max_tokens: u32, tokens_per_fill: u32, seconds: u64) -> TokenBucket {
        TokenBucket::new(
            Bucket {
                max_tokens,
                tokens_per_fill,
                fill_interval: Duration::from_secs(seconds),
            },
            Instant::now(),
        )
    }

    #[test]
    fn a_bucket_starts_full_and_fills_on_its_interval_up_to_its_size() {
        let start = Instant::now();
        let limited = bucket(2, 1, 10);
        *limited.state.lock() = (2, start);
        assert_eq!(limited.take(start), (true, 1));
        assert_eq!(limited.take(start), (true, 0));
        assert_eq!(limited.take(start + Duration::from_secs(9)), (false, 0));
        // One fill at 10 s; the next on the beat at 20 s, not 10 s after this call.
        assert_eq!(limited.take(start + Duration::from_secs(10)), (true, 0));
        assert_eq!(limited.take(start + Duration::from_secs(19)), (false, 0));
        assert_eq!(limited.take(start + Duration::from_secs(20)), (true, 0));
        // Never more than its size, however long it waited.
        assert_eq!(limited.take(start + Duration::from_secs(1000)), (true, 1));
    }

    fn rate_limit(name: &str, spec: serde_json::Value) -> RateLimit {
        serde_json::from_value(json!({
            "apiVersion": eddy_model::ratelimit::API_VERSION, "kind": "RateLimit",
            "metadata": {"name": name, "namespace": "test", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": spec,
        }))
        .unwrap()
    }

    /// Kyma's "Path and header-based rate limit configuration" sample: with the header on
    /// `/headers` the bucket of ten, else the default bucket of one, `/ip` with the header
    /// included (Kyma's docs answer it 429).
    #[test]
    fn a_call_takes_the_first_bucket_it_matches_else_the_default() {
        let limits = RateLimits::default();
        limits.apply(&rate_limit(
            "ratelimit-path-header-sample",
            json!({
                "selectorLabels": {"app": "httpbin"},
                "enableResponseHeaders": true,
                "local": {
                    "defaultBucket": {"maxTokens": 1, "tokensPerFill": 1, "fillInterval": "30s"},
                    "buckets": [{
                        "headers": {"X-Rate-Limited": "true"}, "path": "/headers",
                        "bucket": {"maxTokens": 10, "tokensPerFill": 5, "fillInterval": "30s"},
                    }],
                },
            }),
        ));
        let key = ("test".to_owned(), "httpbin".to_owned());
        assert!(limits.of(&key).is_none());
        limits.set_function(
            key.clone(),
            Some([("app".to_owned(), "httpbin".to_owned())].into()),
        );
        let limiter = limits.of(&key).unwrap();
        let mut flagged = HeaderMap::new();
        flagged.insert("x-rate-limited", HeaderValue::from_static("true"));
        assert_eq!(
            limiter.take("/headers", &HeaderMap::new()),
            Verdict {
                refused: false,
                headers: Some((1, 0))
            }
        );
        assert_eq!(
            limiter.take("/headers", &flagged),
            Verdict {
                refused: false,
                headers: Some((10, 9))
            }
        );
        assert_eq!(
            limiter.take("/ip", &flagged),
            Verdict {
                refused: true,
                headers: Some((1, 0))
            }
        );
        let refusal = limiter.take("/ip", &flagged).refusal();
        assert_eq!(refusal.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refusal.headers()["x-ratelimit-remaining"], "0");
        // Another pod's labels: not held.
        limits.set_function(key.clone(), Some(BTreeMap::new()));
        assert!(limits.of(&key).is_none());
    }

    #[test]
    fn a_rate_limit_that_does_not_enforce_counts_without_refusing() {
        let limits = RateLimits::default();
        limits.apply(&rate_limit(
            "dry-run",
            json!({
                "selectorLabels": {"app": "a"}, "enforce": false,
                "local": {"defaultBucket": {"maxTokens": 1, "tokensPerFill": 1, "fillInterval": "1h"}},
            }),
        ));
        let key = ("test".to_owned(), "a".to_owned());
        limits.set_function(
            key.clone(),
            Some([("app".to_owned(), "a".to_owned())].into()),
        );
        let limiter = limits.of(&key).unwrap();
        let none = HeaderMap::new();
        assert_eq!(
            limiter.take("/", &none),
            Verdict {
                refused: false,
                headers: None
            }
        );
        assert_eq!(
            limiter.take("/", &none),
            Verdict {
                refused: false,
                headers: None
            }
        );
        // Applied again unchanged, its buckets are kept; deleted, nothing is limited.
        limits.replace_all(vec![rate_limit(
            "dry-run",
            json!({
                "selectorLabels": {"app": "a"}, "enforce": false,
                "local": {"defaultBucket": {"maxTokens": 1, "tokensPerFill": 1, "fillInterval": "1h"}},
            }),
        )]);
        assert!(Arc::ptr_eq(&limits.of(&key).unwrap(), &limiter));
        limits.remove("test", "dry-run");
        assert!(limits.of(&key).is_none());
    }
}
