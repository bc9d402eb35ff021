//! Where a Subscription's sink points right now.
//!
//! In local mode `http://<function>.<namespace>.svc.cluster.local/...` resolves to the
//! function's `status.url` in the resource store (watched, so it works across processes). On
//! Kubernetes the cluster DNS resolves it, so it is used as is. Any other sink must match the
//! allowed prefixes, checked here again so a Subscription written around the API cannot reach
//! arbitrary hosts.

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use eddy_model::resources::{Function, SinkPolicy, parse_function_sink};
use eddy_platform::{
    shutdown::CancellationToken,
    store::{Change, StatusOf, Store},
};

use crate::delivery::{Failure, Verdict};

/// How function sinks are resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Resolution {
    /// Through Function status in the local resource store.
    Local,
    /// Used as written (Kubernetes DNS).
    Direct,
}

/// Resolves sinks; cheap to clone.
#[derive(Clone)]
pub struct Sinks {
    resolution: Resolution,
    policy: SinkPolicy,
    platform_token: Option<http::HeaderValue>,
    functions: Arc<parking_lot::RwLock<HashMap<(String, String), String>>>,
    /// Bumped on every change of `functions`, so a worker can keep what it resolved until then.
    generation: Arc<AtomicU64>,
}

/// Where to POST a Subscription's events, and the `Authorization` to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// Parsed once per resolution, not per delivery.
    pub uri: http::Uri,
    /// The platform token, for functions behind the local gateway.
    pub authorization: Option<http::HeaderValue>,
}

impl Sinks {
    /// A resolver; call [`Sinks::watch`] to feed it in local mode.
    pub fn new(resolution: Resolution, policy: SinkPolicy) -> Self {
        Self {
            resolution,
            policy,
            platform_token: None,
            functions: Arc::default(),
            generation: Arc::default(),
        }
    }

    /// Sends `token` (as a bearer token) with deliveries to the functions resolved through
    /// their status: the local gateway lets it reach functions with `access.mode: token`.
    pub fn with_platform_token(mut self, token: Option<&str>) -> Self {
        self.platform_token = token.and_then(eddy_platform::auth::bearer_header);
        self
    }

    /// Changes whenever a function's URL does: a [`Resolved`] obtained under one generation
    /// stays right until the generation moves.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Where to POST events for `sink`, or what to do with them when there is nowhere: a sink
    /// outside the allowed ones or not a plain HTTP URL never will be (dead letters); a function
    /// without a URL yet may get one (retry).
    pub fn resolve(&self, sink: &str) -> Result<Resolved, Verdict> {
        let (url, authorization) = self.resolve_text(sink)?;
        let uri = http::Uri::try_from(url).map_err(|_| never(Failure::SinkInvalid))?;
        let web = uri.scheme() == Some(&http::uri::Scheme::HTTP)
            || uri.scheme() == Some(&http::uri::Scheme::HTTPS);
        if !web || uri.host().is_none() {
            return Err(never(Failure::SinkInvalid));
        }
        Ok(Resolved { uri, authorization })
    }

    fn resolve_text(&self, sink: &str) -> Result<(String, Option<http::HeaderValue>), Verdict> {
        if let Some(function) = parse_function_sink(sink) {
            if self.resolution == Resolution::Direct {
                return Ok((sink.to_owned(), None));
            }
            let functions = self.functions.read();
            let base = functions
                .get(&(function.namespace, function.function))
                .ok_or(not_yet(Failure::SinkUnresolved))?;
            return Ok((
                join(base, &function.path_and_query),
                self.platform_token.clone(),
            ));
        }
        // Sent to the normalized URL that was checked, not to the text as written.
        match self.policy.allowed_url(sink) {
            Some(url) => Ok((url.into(), None)),
            None if url::Url::parse(sink).is_err() => Err(never(Failure::SinkInvalid)),
            None => Err(never(Failure::SinkNotAllowed)),
        }
    }

    /// Records a function's URL (tests and in-process wiring).
    pub fn set_function_url(&self, namespace: &str, name: &str, url: Option<String>) {
        {
            let mut functions = self.functions.write();
            let key = (namespace.to_owned(), name.to_owned());
            match url {
                Some(url) => functions.insert(key, url),
                None => functions.remove(&key),
            };
            // Under the write lock, so a reader that sees the new generation sees the new URL.
            self.generation.fetch_add(1, Ordering::Release);
        }
    }

    /// Follows Function status in the store until shutdown (a Function deleted while the watch
    /// was down loses its address at the relist).
    pub async fn watch(self, store: Store, shutdown: CancellationToken) {
        store
            .follow_status::<Function, _, _>(&shutdown, |change| {
                match change {
                    Change::Applied(StatusOf {
                        namespace,
                        name,
                        status,
                    }) => self.set_function_url(&namespace, &name, status.url),
                    Change::Deleted { namespace, name } => {
                        self.set_function_url(&namespace, &name, None);
                    }
                    Change::Synced => {}
                }
                std::future::ready(())
            })
            .await;
    }
}

fn never(reason: Failure) -> Verdict {
    Verdict::Dead {
        reason,
        status: None,
    }
}

fn not_yet(reason: Failure) -> Verdict {
    Verdict::Retry {
        reason,
        status: None,
    }
}

/// `base` + `path_and_query`, where the sink's path `/` means the function's root.
fn join(base: &str, path_and_query: &str) -> String {
    if path_and_query == "/" || path_and_query.is_empty() {
        base.to_owned()
    } else {
        format!("{}{path_and_query}", base.trim_end_matches('/'))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Sinks {
        fn url_of(&self, sink: &str) -> Result<String, Verdict> {
            self.resolve(sink).map(|resolved| resolved.uri.to_string())
        }
    }

    #[test]
    fn the_platform_token_goes_only_to_functions_behind_the_gateway() {
        let policy = SinkPolicy::parse(&["http://127.0.0.1:9000/"]).unwrap();
        let sinks = Sinks::new(Resolution::Local, policy).with_platform_token(Some("t0k"));
        sinks.set_function_url(
            "shop",
            "stock",
            Some("http://127.0.0.1:8080/shop/stock".into()),
        );
        let to_function = sinks
            .resolve("http://stock.shop.svc.cluster.local")
            .unwrap()
            .authorization;
        assert_eq!(
            to_function.as_ref().map(|v| v.as_bytes()),
            Some(&b"Bearer t0k"[..])
        );
        let elsewhere = sinks
            .resolve("http://127.0.0.1:9000/hook")
            .unwrap()
            .authorization;
        assert!(
            elsewhere.is_none(),
            "an allowed URL never sees the platform token"
        );
    }

    #[test]
    fn function_sinks_resolve_through_status() {
        let sinks = Sinks::new(Resolution::Local, SinkPolicy::default());
        let sink = "http://stock.shop.svc.cluster.local";
        assert_eq!(sinks.url_of(sink), Err(not_yet(Failure::SinkUnresolved)));
        let before = sinks.generation();
        sinks.set_function_url(
            "shop",
            "stock",
            Some("http://127.0.0.1:8080/shop/stock".into()),
        );
        assert_ne!(sinks.generation(), before, "a new URL moves the generation");
        assert_eq!(
            sinks.url_of(sink).unwrap(),
            "http://127.0.0.1:8080/shop/stock"
        );
        assert_eq!(
            sinks
                .url_of("http://stock.shop.svc.cluster.local/hook?x=1")
                .unwrap(),
            "http://127.0.0.1:8080/shop/stock/hook?x=1"
        );
        sinks.set_function_url("shop", "stock", None);
        assert_eq!(sinks.url_of(sink), Err(not_yet(Failure::SinkUnresolved)));
    }

    #[test]
    fn other_sinks_need_an_allowed_prefix() {
        let sinks = Sinks::new(
            Resolution::Direct,
            SinkPolicy::parse(&["http://127.0.0.1:"]).unwrap(),
        );
        assert_eq!(
            sinks.url_of("http://127.0.0.1:9000/x").unwrap(),
            "http://127.0.0.1:9000/x"
        );
        assert_eq!(
            sinks.url_of("http://10.0.0.1/x"),
            Err(never(Failure::SinkNotAllowed))
        );
        let anything = Sinks::new(Resolution::Direct, SinkPolicy::parse(&["*"]).unwrap());
        assert_eq!(
            anything.url_of("https://example.com/x"),
            Ok("https://example.com/x".to_owned()),
            "https sinks are delivered over TLS"
        );
        assert_eq!(
            anything.url_of("ftp://example.com/x"),
            Err(never(Failure::SinkNotAllowed))
        );
        assert_eq!(
            sinks.url_of("http://127.0.0.1:9@10.0.0.1:8083/dlq"),
            Err(never(Failure::SinkNotAllowed)),
            "userinfo cannot smuggle another host past the policy"
        );
        assert_eq!(
            anything.url_of("not a url"),
            Err(never(Failure::SinkInvalid))
        );
        assert_eq!(
            sinks.url_of("http://stock.shop.svc.cluster.local").unwrap(),
            "http://stock.shop.svc.cluster.local/"
        );
    }
}
