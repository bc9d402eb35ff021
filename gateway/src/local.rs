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

use crate::{Access, Destination, Found, FunctionKey, Upstreams, forward_headers};

/// The local supervisor's pools, as the gateway's upstreams.
pub struct LocalPools {
    pools: Pools,
    client: Client<HttpConnector, Full<Bytes>>,
    /// Each `spec.access` a pool holds, compiled once (keyed by its `Arc`'s address; the `Arc`
    /// is kept, so the address is not reused while it is here).
    access: RwLock<HashMap<usize, (Arc<AccessSpec>, Access)>>,
    activation_timeout: Duration,
    request_timeout: Duration,
}

impl LocalPools {
    /// Calls go to `pools`; one waits up to `activation_timeout` for an instance, and an
    /// answer never takes longer than `request_timeout`.
    pub fn new(pools: Pools, activation_timeout: Duration, request_timeout: Duration) -> Self {
        Self {
            pools,
            client: eddy_platform::net::pooled_client(
                Duration::from_secs(30),
                Some(Duration::from_secs(2)),
            ),
            access: RwLock::default(),
            activation_timeout,
            request_timeout,
        }
    }

    /// Who may call a pool's function: its `spec.access`, compiled once per version.
    fn access_of(&self, pool: &Pool) -> Access {
        let Some(spec) = pool.access() else {
            return Access::Public;
        };
        let address = Arc::as_ptr(&spec) as usize;
        if let Some((_, access)) = self.access.read().get(&address) {
            return access.clone();
        }
        let mut compiled = self.access.write();
        // A verifier for the same JWT settings keeps its keys.
        let existing = compiled
            .values()
            .find(|(_, access)| matches!(access, Access::Jwt(verifier) if Some(verifier.spec()) == spec.jwt.as_ref()))
            .map(|(_, access)| access.clone());
        let access = Access::of(Some(&spec), existing.as_ref());
        // Versions no pool holds any more go.
        compiled.retain(|_, (held, _)| Arc::strong_count(held) > 1);
        compiled.insert(address, (spec, access.clone()));
        access
    }
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

    async fn send(
        &self,
        destination: Destination<'_, Arc<Pool>>,
        request: http::Request<Full<Bytes>>,
    ) -> Result<Response, ErrorResponse> {
        let pool = destination.function.ok_or_else(|| {
            ErrorResponse::message(StatusCode::SERVICE_UNAVAILABLE, "no such function here")
        })?;
        forward(self, pool, &destination, request).await
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
) -> Result<Response, ErrorResponse> {
    let answer_timeout = destination.timeout;
    let (parts, body) = request.into_parts();
    let deadline = Instant::now() + upstreams.activation_timeout;
    // Instances that refused the connection: not picked again for this request.
    let mut refused: Vec<u64> = Vec::new();
    loop {
        let lease = acquire(pool, deadline, &refused).await?;
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

/// A ready instance other than `avoid`, waiting (and asking for one to be started) up to
/// `deadline`.
async fn acquire(
    pool: &Arc<Pool>,
    deadline: Instant,
    avoid: &[u64],
) -> Result<Lease, ErrorResponse> {
    if let Some(lease) = pool.pick(avoid) {
        return Ok(lease);
    }
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
