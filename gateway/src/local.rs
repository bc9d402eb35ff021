//! The local gateway's [`Upstreams`]: the local supervisor's pools. A call goes to the
//! least-loaded ready instance of its function; a function scaled to zero gets an instance
//! started and the call is held until it is ready. A call whose instance refused the
//! connection (it just died) is sent to another one.

use std::{
    collections::HashMap,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::{
    body::Body,
    http::{HeaderName, StatusCode, Uri},
    response::Response,
};
use bytes::Bytes;
use eddy_controller::local::pool::{INSTANCE_SECRET_HEADER, Lease, Pool, Pools};
use eddy_model::resources::AccessSpec;
use eddy_platform::errors::ErrorResponse;
use http_body_util::Full;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use parking_lot::RwLock;

use crate::{
    Access, Destination, Found, FunctionKey, Upstreams, forward_headers,
    hold::{Held, HoldBudget},
};

/// The local supervisor's pools, as the gateway's upstreams.
pub struct LocalPools {
    pools: Pools,
    client: Client<HttpConnector, Full<Bytes>>,
    /// Each pool's `spec.access`, compiled once per version, keyed by the pool's address. An
    /// entry keeps its pool (so the address is not reused while it is here) and goes when the
    /// pool shuts down.
    access: Arc<RwLock<HashMap<usize, CompiledAccess>>>,
    activation_timeout: Duration,
    request_timeout: Duration,
    /// What the calls waiting for an instance may hold.
    held: Arc<HoldBudget>,
}

impl LocalPools {
    /// Calls go to `pools`; one waits up to `activation_timeout` for an instance, within the
    /// `held` budget, and an answer never takes longer than `request_timeout`.
    pub fn new(
        pools: Pools,
        activation_timeout: Duration,
        request_timeout: Duration,
        held: Arc<HoldBudget>,
    ) -> Self {
        Self {
            held,
            pools,
            client: eddy_platform::net::pooled_client(
                Duration::from_secs(30),
                Some(Duration::from_secs(2)),
            ),
            access: Arc::default(),
            activation_timeout,
            request_timeout,
        }
    }

    /// Who may call a pool's function: its `spec.access`, compiled once per version.
    fn access_of(&self, pool: &Arc<Pool>) -> Access {
        let Some(spec) = pool.access() else {
            return Access::Public;
        };
        let address = Arc::as_ptr(pool) as usize;
        if let Some(compiled) = self.access.read().get(&address)
            && Arc::ptr_eq(&compiled.spec, &spec)
        {
            return compiled.access.clone();
        }
        let mut cache = self.access.write();
        // A verifier for the same JWT settings keeps its keys.
        let existing = cache
            .values()
            .find(|compiled| matches!(&compiled.access, Access::Jwt(verifier) if Some(verifier.spec()) == spec.jwt.as_ref()))
            .map(|compiled| compiled.access.clone());
        let access = Access::of(Some(&spec), existing.as_ref());
        let compiled = CompiledAccess {
            _pool: pool.clone(),
            spec,
            access: access.clone(),
        };
        // A new version replaces the pool's old one; a pool's first gets its pruning.
        if cache.insert(address, compiled).is_none() {
            self.prune_when_closed(pool, address);
        }
        access
    }

    /// Drops the pool's compiled access once the pool shuts down.
    fn prune_when_closed(&self, pool: &Pool, address: usize) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (closed, cache) = (pool.closed(), Arc::downgrade(&self.access));
        runtime.spawn(async move {
            closed.await;
            if let Some(cache) = cache.upgrade() {
                cache.write().remove(&address);
            }
        });
    }

    /// How many pools' access is compiled and kept.
    #[cfg(test)]
    fn compiled_access(&self) -> usize {
        self.access.read().len()
    }
}

/// A pool's `spec.access` as compiled, with the pool it belongs to.
struct CompiledAccess {
    /// Held so that no other pool takes its address while the entry is here.
    _pool: Arc<Pool>,
    spec: Arc<AccessSpec>,
    access: Access,
}

impl Upstreams for LocalPools {
    type Function = Arc<Pool>;

    fn function(&self, key: &FunctionKey) -> Option<Found<Arc<Pool>>> {
        let pool = self.pools.read().get(key).cloned()?;
        let timeout = pool
            .answer_timeout()
            .map_or(self.request_timeout, |t| t.min(self.request_timeout));
        Some(Found {
            access: self.access_of(&pool),
            timeout,
            metrics: pool.metrics.clone(),
            function: pool,
        })
    }

    fn reaches_services(&self) -> bool {
        false
    }

    fn waits_for_start(&self, pool: &Arc<Pool>) -> Option<&Arc<HoldBudget>> {
        (!pool.has_ready()).then_some(&self.held)
    }

    async fn send(
        &self,
        mut destination: Destination<'_, Arc<Pool>>,
        request: http::Request<Full<Bytes>>,
    ) -> Result<Response, ErrorResponse> {
        let pool = destination.function.ok_or_else(|| {
            ErrorResponse::message(StatusCode::SERVICE_UNAVAILABLE, "no such function here")
        })?;
        let held = destination.held.take();
        forward(self, pool, &destination, request, held).await
    }
}

/// Sends the request to a ready instance (starting one if needed) and streams its answer back;
/// an instance that refuses the connection is replaced by another, one that does not answer in
/// time is suspected (and replaced when it fails its probes).
async fn forward(
    upstreams: &LocalPools,
    pool: &Arc<Pool>,
    destination: &Destination<'_, Arc<Pool>>,
    request: http::Request<Full<Bytes>>,
    held: Option<Held>,
) -> Result<Response, ErrorResponse> {
    let answer_timeout = destination.timeout;
    let (parts, body) = request.into_parts();
    let deadline = Instant::now() + upstreams.activation_timeout;
    let mut waiting = Waiting {
        budget: &upstreams.held,
        key: destination.key,
        bytes: http_body::Body::size_hint(&body).lower(),
        held,
    };
    // Instances that refused the connection: not picked again for this request.
    let mut refused: Vec<u64> = Vec::new();
    loop {
        let lease = acquire(pool, deadline, &refused, &mut waiting).await?;
        let uri = format!(
            "http://127.0.0.1:{}{}",
            lease.instance.port, destination.path_and_query
        )
        .parse::<Uri>()
        .map_err(|_| ErrorResponse::message(StatusCode::BAD_REQUEST, "invalid path"))?;
        let mut upstream = http::Request::new(body.clone());
        *upstream.method_mut() = parts.method.clone();
        *upstream.uri_mut() = uri;
        *upstream.headers_mut() = parts.headers.clone();
        upstream.headers_mut().insert(
            HeaderName::from_static(INSTANCE_SECRET_HEADER),
            lease.instance.secret_header.clone(),
        );
        match tokio::time::timeout(answer_timeout, upstreams.client.request(upstream)).await {
            Ok(Ok(response)) => {
                let (mut head, incoming) = response.into_parts();
                forward_headers(&mut head.headers);
                return Ok(Response::from_parts(
                    head,
                    Body::new(LeasedBody {
                        inner: incoming,
                        _lease: lease,
                    }),
                ));
            }
            Ok(Err(problem)) if problem.is_connect() && refused.len() < 3 => {
                // The instance went away (or stopped listening) between pick and connect: try
                // another, and have this one probed and replaced if it does not answer.
                tracing::debug!(%problem, "instance refused the connection; trying another");
                refused.push(lease.instance.id);
                pool.suspect(&lease.instance);
            }
            Ok(Err(problem)) => {
                tracing::warn!(%problem, "instance failed");
                return Err(ErrorResponse::message(
                    StatusCode::BAD_GATEWAY,
                    "the function instance failed to answer",
                ));
            }
            Err(_) => {
                pool.suspect(&lease.instance);
                return Err(ErrorResponse::message(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!(
                        "the function did not answer within {}s",
                        answer_timeout.as_secs()
                    ),
                ));
            }
        }
    }
}

/// A call that may have to wait for an instance: what it holds while it does.
struct Waiting<'a> {
    budget: &'a Arc<HoldBudget>,
    key: &'a FunctionKey,
    bytes: u64,
    /// Taken while its body arrived (no instance was ready then), kept until it is sent.
    held: Option<Held>,
}

/// A ready instance other than `avoid`, waiting (and asking for one to be started) up to
/// `deadline`, when the hold budget has room for the call.
async fn acquire(
    pool: &Arc<Pool>,
    deadline: Instant,
    avoid: &[u64],
    waiting: &mut Waiting<'_>,
) -> Result<Lease, ErrorResponse> {
    if let Some(lease) = pool.pick(avoid) {
        // An instance became ready while the body arrived: nothing is held any longer.
        waiting.held = None;
        return Ok(lease);
    }
    let _held = match waiting.held.take() {
        Some(held) => held,
        None => waiting.budget.hold(waiting.key, waiting.bytes)?,
    };
    let _waiting = pool.wait_guard();
    let since = Instant::now();
    let acquired = wait_for_instance(pool, deadline, avoid).await;
    pool.metrics.waited(since.elapsed().as_secs_f64());
    acquired
}

/// Waits until an instance other than `avoid` is ready (or the pool is unavailable, or the
/// deadline passes).
async fn wait_for_instance(
    pool: &Arc<Pool>,
    deadline: Instant,
    avoid: &[u64],
) -> Result<Lease, ErrorResponse> {
    loop {
        let changed = pool.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if let Some(lease) = pool.pick(avoid) {
            return Ok(lease);
        }
        if let Some(reason) = pool.unavailable() {
            return Err(ErrorResponse::message(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("function is not available: {reason}"),
            ));
        }
        let now = Instant::now();
        if now >= deadline {
            let detail = pool
                .last_error()
                .map(|e| format!(": {e}"))
                .unwrap_or_default();
            return Err(ErrorResponse::message(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("no instance became ready in time{detail}"),
            ));
        }
        // Woken when an instance changes; the timeout re-checks now and then regardless.
        let _ =
            tokio::time::timeout((deadline - now).min(Duration::from_millis(500)), changed).await;
    }
}

/// A response body that keeps its instance leased until the body is done.
struct LeasedBody {
    inner: hyper::body::Incoming,
    _lease: Lease,
}

impl http_body::Body for LeasedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::time::Duration;

    use eddy_controller::local::pool::PoolConfig;
    use eddy_platform::shutdown::CancellationToken;

    use super::*;

    fn token_access(digest: char) -> AccessSpec {
        serde_json::from_value(serde_json::json!({
            "mode": "token",
            "tokenDigests": [format!("sha256:{}", digest.to_string().repeat(64))],
        }))
        .unwrap()
    }

    /// A pool's compiled access is kept while the pool lives, replaced by a new version, and
    /// dropped when the pool shuts down, without waiting for another pool's call.
    #[tokio::test]
    async fn a_pool_s_compiled_access_goes_with_the_pool() {
        let dir = std::env::temp_dir().join(format!("eddy-local-pools-{}", std::process::id()));
        let config = Arc::new(PoolConfig {
            logs_dir: dir.join("logs"),
            publisher_url: "http://127.0.0.1:9/publish".into(),
            publisher_token: None,
            trace_collector: None,
            metrics: Arc::new(eddy_platform::function_metrics::FunctionMetrics::new()),
            target_concurrency: 1,
            scale_to_zero_after: Duration::from_secs(60),
            scale_down_window: Duration::from_secs(30),
            startup_timeout: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(1),
            spares: None,
            cgroups: None,
            max_function_tasks: 64,
            confinement: Arc::new(eddy_platform::process::Confinement::new(&dir, false).unwrap()),
        });
        let pool = Pool::start("shop", "vault", config, CancellationToken::new());
        pool.set_access(Some(&token_access('a')));
        let pools = Pools::default();
        let key = ("shop".to_owned(), "vault".to_owned());
        pools.write().insert(key.clone(), pool.clone());
        let upstreams = LocalPools::new(
            pools.clone(),
            Duration::from_secs(1),
            Duration::from_secs(1),
            Arc::new(HoldBudget::new(&eddy_platform::flags::defaults())),
        );

        assert!(matches!(
            upstreams.function(&key).unwrap().access,
            Access::Tokens(_)
        ));
        upstreams.function(&key).unwrap();
        assert_eq!(upstreams.compiled_access(), 1);
        // A new version replaces the old one.
        pool.set_access(Some(&token_access('b')));
        upstreams.function(&key).unwrap();
        assert_eq!(upstreams.compiled_access(), 1);

        // The Function goes: its pool leaves the map and shuts down.
        pools.write().remove(&key);
        pool.shutdown();
        drop(pool);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while upstreams.compiled_access() > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the removed pool's access was still kept after 5 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}
