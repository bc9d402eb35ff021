//! eddy's gateway on Kubernetes: the same `/<namespace>/<function>/<rest>` URLs and the same
//! `spec.access` checks (tokens, JWT) as the gateway `eddy up` runs, in front of the function
//! Services instead of local instances. It follows Function objects through the API (one
//! list, then a watch; a relist replaces what it knows) and forwards each allowed call to
//! `http://<function>.<namespace>.svc.cluster.local` (`--function-url`), the rest of the path
//! and the query kept. The chart runs it as its own Deployment behind the Istio ingress
//! gateway or a Gateway API HTTPRoute.
//!
//! With `--apirules` it also follows Kyma's APIRules: a call for a host one names goes to the
//! rule's Service (`--service-url`) when the rule lets its caller in (crate::apirules); and
//! Kyma's RateLimits, with the labels of eddy's and Kyma's Functions they select
//! (crate::ratelimit).
//!
//! The cluster's Services are this gateway's [`Upstreams`] ([`Services`]); the proxy itself is
//! the crate's [`Gateway`], the one `eddy up` runs too.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::SocketAddr,
    sync::Arc,
    time::Duration,
};

use axum::{
    body::Body,
    extract::State,
    http::{StatusCode, Uri, header},
    response::Response,
};
use bytes::Bytes;
use eddy_model::{
    apirule::APIRule,
    ratelimit::{RateLimit, function_pod_labels},
    resources::Function,
};
use eddy_platform::{
    errors::ErrorResponse,
    flags::HoldArgs,
    function_metrics::{FunctionMetrics, FunctionSeries},
    shutdown::CancellationToken,
};
use futures::StreamExt as _;
use http_body_util::Full;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use kube::{Api, ResourceExt as _, runtime::watcher};
use parking_lot::RwLock;

use crate::{
    Access, Destination, Found, FunctionKey, Gateway, Result, Upstreams,
    apirules::{Exposures, RuleService},
    forward_headers,
    hold::{Held, HoldBudget},
    ratelimit::RateLimits,
};

/// Flags of `eddy gateway`.
#[derive(Debug, Clone, clap::Args)]
pub struct GatewayArgs {
    /// Address to listen on.
    #[arg(
        long = "gateway-addr",
        env = "EDDY_GATEWAY_ADDR",
        default_value = "0.0.0.0:8080"
    )]
    pub addr: SocketAddr,
    /// Where a function is reached, `{namespace}` and `{function}` replaced; the rest of the
    /// caller's path follows.
    #[arg(
        long = "function-url",
        env = "EDDY_FUNCTION_URL",
        default_value = "http://{function}.{namespace}.svc.cluster.local"
    )]
    pub function_url: String,
    /// Follow Kyma's APIRules (gateway.kyma-project.io, installed with `kymaCompatibility`)
    /// and serve the hosts they name.
    #[arg(long = "apirules", env = "EDDY_APIRULES")]
    pub apirules: bool,
    /// How APIRules are served: their domain, and the namespaces open to other namespaces' APIRules.
    #[command(flatten)]
    pub exposure: eddy_platform::flags::ApiRuleArgs,
    /// Where an APIRule's Service is reached, `{namespace}`, `{service}` and `{port}` replaced;
    /// the caller's path follows.
    #[arg(
        long = "service-url",
        env = "EDDY_SERVICE_URL",
        default_value = "http://{service}.{namespace}.svc.cluster.local:{port}"
    )]
    pub service_url: String,
    /// How long a call to a Function at zero replicas is held for its first pod to be ready
    /// (then 503 with `Retry-After`).
    #[arg(long = "wake-timeout", env = "EDDY_WAKE_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    pub wake_timeout: Duration,
    /// What calls held while their Functions wake may take: calls and bytes, in all and per
    /// Function (503 with `Retry-After` past a bound).
    #[command(flatten)]
    pub hold: HoldArgs,
    /// Largest request body forwarded (413 above it).
    #[arg(
        long = "max-request-size",
        env = "EDDY_MAX_REQUEST_SIZE",
        default_value = "16MiB"
    )]
    pub max_request_size: bytesize::ByteSize,
    /// Connection limits.
    #[command(flatten)]
    pub serve: eddy_platform::net::ServeArgs,
}

/// What the gateway knows of one Function.
#[derive(Debug, Clone)]
pub struct Route {
    /// Who may call it.
    pub access: Access,
    /// Its handler timeout: the call's answer is awaited this long and 5 s more.
    pub timeout: Duration,
    /// Its series on the gateway's `/metrics`.
    pub metrics: Arc<FunctionSeries>,
    /// Whether it scales to zero, and whether it has no ready pod now.
    pub sleep: Sleep,
}

/// What the gateway knows of a Function's sleep (`eddy_platform::scale`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sleep {
    /// It scales to zero: a call that finds no pod wakes it and waits.
    pub from_zero: bool,
    /// Its status shows no ready pod.
    pub asleep: bool,
}

/// Routes by (namespace, name), and whether the first list has arrived.
#[derive(Default)]
pub struct Routes {
    routes: RwLock<HashMap<(String, String), Route>>,
    /// Relisting: the routes seen so far, swapped in at the end of the list.
    relisting: parking_lot::Mutex<Option<HashMap<(String, String), Route>>>,
    synced: std::sync::atomic::AtomicBool,
    /// Every Function's series, served at `/metrics`.
    metrics: Arc<FunctionMetrics>,
}

impl Routes {
    /// The route of a Function.
    pub fn get(&self, key: &FunctionKey) -> Option<Route> {
        self.routes.read().get(key).cloned()
    }

    /// Whether the first list of Functions has been read.
    pub fn synced(&self) -> bool {
        self.synced.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Follows one watcher event.
    pub fn apply(&self, event: watcher::Event<Function>) {
        match event {
            watcher::Event::Init => *self.relisting.lock() = Some(HashMap::new()),
            watcher::Event::InitApply(function) => {
                let key = key_of(&function);
                let existing = self.routes.read().get(&key).map(|r| r.access.clone());
                let route = self.route_of(&function, existing);
                self.relisting
                    .lock()
                    .get_or_insert_with(HashMap::new)
                    .insert(key, route);
            }
            watcher::Event::InitDone => {
                let listed = self.relisting.lock().take().unwrap_or_default();
                let gone = std::mem::replace(&mut *self.routes.write(), listed);
                let routes = self.routes.read();
                for (namespace, name) in gone.keys().filter(|key| !routes.contains_key(*key)) {
                    self.metrics.remove(namespace, name);
                }
                self.synced
                    .store(true, std::sync::atomic::Ordering::Release);
            }
            watcher::Event::Apply(function) => {
                let key = key_of(&function);
                let existing = self.routes.read().get(&key).map(|r| r.access.clone());
                let route = self.route_of(&function, existing);
                self.routes.write().insert(key, route);
            }
            watcher::Event::Delete(function) => {
                let (namespace, name) = key_of(&function);
                self.routes
                    .write()
                    .remove(&(namespace.clone(), name.clone()));
                self.metrics.remove(&namespace, &name);
            }
        }
    }

    /// A Function's route (a JWT verifier for an unchanged `access.jwt` is kept, with its keys).
    fn route_of(&self, function: &Function, existing: Option<Access>) -> Route {
        let (namespace, name) = key_of(function);
        let (min, max) = function.spec.replica_bounds();
        let from_zero = min <= 0 && max > min;
        Route {
            access: Access::of(function.spec.access.as_ref(), existing.as_ref()),
            timeout: function.spec.timeout(),
            metrics: self.metrics.function(&namespace, &name),
            sleep: Sleep {
                from_zero,
                asleep: from_zero
                    && function
                        .status
                        .as_ref()
                        .is_some_and(|status| status.replicas == 0),
            },
        }
    }
}

fn key_of(function: &Function) -> (String, String) {
    (
        function.namespace().unwrap_or_default(),
        function.name_any(),
    )
}

/// The upstream URI of a call: the function's URL from `template` and the rest of the path.
/// `None` when they do not make a URI. Pure.
pub fn upstream_uri(template: &str, namespace: &str, function: &str, rest: &str) -> Option<Uri> {
    let base = template
        .replace("{namespace}", namespace)
        .replace("{function}", function);
    format!("{}{rest}", base.trim_end_matches('/')).parse().ok()
}

/// The cluster's Services, as the gateway's upstreams: a Function's at `--function-url`, an
/// APIRule rule's at `--service-url`.
pub struct Services {
    routes: Arc<Routes>,
    function_url: String,
    service_url: String,
    client: Client<HttpConnector, Full<Bytes>>,
    waking: Arc<Waking>,
}

/// Waking Functions at zero for calls: the scale subresource, the held calls' bound, and the
/// calls Leases that keep a Function awake.
pub struct Waking {
    kube: Option<kube::Client>,
    timeout: Duration,
    held: Arc<HoldBudget>,
    /// When each Function was last asked to wake (a wake-up per Function at most every
    /// [`WAKE_EVERY`], however many calls wait).
    asked: parking_lot::Mutex<HashMap<FunctionKey, std::time::Instant>>,
    /// Functions that scale to zero called since the last stamp.
    called: parking_lot::Mutex<std::collections::HashSet<FunctionKey>>,
}

/// The length of Envoy's `no healthy upstream` answer.
const NO_HEALTHY_UPSTREAM_LENGTH: &[u8] = b"19";
/// How often a waiting call asks again for its Function's wake-up.
const WAKE_EVERY: Duration = Duration::from_secs(1);
/// How often the calls to Functions that scale to zero renew their calls Leases.
const STAMP_EVERY: Duration = Duration::from_secs(5);
/// The wait between tries of a held call.
const HELD_RETRY: Duration = Duration::from_millis(100);

impl Waking {
    /// Wakes through `kube` (`None`: never, as in tests without a cluster); holds calls up to
    /// `timeout`, within the budget `hold` sets.
    pub fn new(kube: Option<kube::Client>, timeout: Duration, hold: &HoldArgs) -> Self {
        Self {
            kube,
            timeout,
            held: Arc::new(HoldBudget::new(hold)),
            asked: parking_lot::Mutex::default(),
            called: parking_lot::Mutex::default(),
        }
    }

    /// Asks for `key`'s Deployment to go from zero to one replica (at most every
    /// [`WAKE_EVERY`]); counts a wake-up in `metrics` when it did.
    async fn wake(&self, key: &FunctionKey, metrics: &FunctionSeries) {
        let Some(kube) = &self.kube else {
            return;
        };
        {
            let mut asked = self.asked.lock();
            let now = std::time::Instant::now();
            if asked.get(key).is_some_and(|at| now - *at < WAKE_EVERY) {
                return;
            }
            asked.insert(key.clone(), now);
        }
        let (namespace, function) = key;
        match eddy_platform::scale::scale_deployment_if(
            kube,
            namespace,
            function,
            |now| now <= 0,
            1,
        )
        .await
        {
            Ok(Some(_)) => {
                tracing::info!(%namespace, %function, "woken for a call");
                metrics.cold_start();
            }
            Ok(None) => {}
            Err(error) => tracing::warn!(%namespace, %function, %error, "cannot wake"),
        }
    }

    /// Renews the calls Leases of the Functions called since the last round, every
    /// [`STAMP_EVERY`] until `shutdown`.
    pub async fn stamp_calls(self: Arc<Self>, shutdown: CancellationToken) {
        let Some(kube) = self.kube.clone() else {
            return;
        };
        let mut tick = tokio::time::interval(STAMP_EVERY);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let called = std::mem::take(&mut *self.called.lock());
            for (namespace, function) in called {
                if let Err(error) =
                    eddy_platform::scale::renew_calls_lease(&kube, &namespace, &function).await
                {
                    tracing::warn!(%namespace, %function, %error, "cannot renew the calls Lease");
                }
            }
        }
    }
}

/// Whether an answer means the Service has no ready pod to route to: a refused connection
/// (kube-proxy rejects a Service without endpoints) or a mesh proxy's `503` with no upstream.
fn not_routed(
    answer: &Result<http::Response<hyper::body::Incoming>, hyper_util::client::legacy::Error>,
) -> bool {
    match answer {
        Err(error) => error.is_connect(),
        Ok(response) => {
            response.status() == StatusCode::SERVICE_UNAVAILABLE
                && response
                    .headers()
                    .get(header::SERVER)
                    .is_some_and(|server| server.as_bytes().ends_with(b"envoy"))
                // Envoy's own `no healthy upstream`, not a Function's 503 passed on.
                && response
                    .headers()
                    .get(header::CONTENT_LENGTH)
                    .is_some_and(|length| length.as_bytes() == NO_HEALTHY_UPSTREAM_LENGTH)
        }
    }
}

/// A copy of a buffered request, for another try.
fn copy_request(request: &http::Request<Full<Bytes>>) -> http::Request<Full<Bytes>> {
    let mut copy = http::Request::new(request.body().clone());
    *copy.method_mut() = request.method().clone();
    *copy.uri_mut() = request.uri().clone();
    *copy.version_mut() = request.version();
    *copy.headers_mut() = request.headers().clone();
    copy
}

impl Services {
    /// Functions known from `routes`, reached at `function_url`; APIRule Services at
    /// `service_url`; Functions at zero woken by `waking`.
    pub fn new(
        routes: Arc<Routes>,
        function_url: String,
        service_url: String,
        waking: Arc<Waking>,
    ) -> Self {
        Self {
            routes,
            function_url,
            service_url,
            waking,
            client: eddy_platform::net::pooled_client(
                Duration::from_secs(30),
                Some(Duration::from_secs(5)),
            ),
        }
    }
}

impl Services {
    /// Sends a call to a Function that scales to zero: while its Service routes to no pod, the
    /// call is held (bounded by the hold budget and `--wake-timeout`), the Function woken,
    /// and the call tried again. A try that was not routed never reached a Function, so trying
    /// again cannot run it twice.
    async fn send_waking(
        &self,
        key: &FunctionKey,
        sleep: Sleep,
        request: http::Request<Full<Bytes>>,
        answer_within: Duration,
        held_already: Option<Held>,
    ) -> Result<
        Result<
            Result<http::Response<hyper::body::Incoming>, hyper_util::client::legacy::Error>,
            tokio::time::error::Elapsed,
        >,
        ErrorResponse,
    > {
        let (namespace, function) = key;
        let metrics = self.routes.get(key).map(|route| route.metrics);
        // Taken while the body arrived, when the Function was known to be asleep.
        let mut held: Option<(Held, std::time::Instant)> =
            held_already.map(|held| (held, std::time::Instant::now()));
        let mut asleep = sleep.asleep;
        loop {
            if asleep {
                if held.is_none() {
                    let bytes = http_body::Body::size_hint(request.body()).lower();
                    let permit = self.waking.held.hold(key, bytes)?;
                    held = Some((permit, std::time::Instant::now()));
                }
                if let Some(metrics) = &metrics {
                    self.waking.wake(key, metrics).await;
                }
            }
            let answer =
                tokio::time::timeout(answer_within, self.client.request(copy_request(&request)))
                    .await;
            let routed = !matches!(&answer, Ok(answer) if not_routed(answer));
            let waited = held.as_ref().map(|(_, since)| since.elapsed());
            if routed {
                if let (Some(waited), Some(metrics)) = (waited, &metrics) {
                    metrics.waited(waited.as_secs_f64());
                }
                return Ok(answer);
            }
            if waited.is_some_and(|waited| waited >= self.waking.timeout) {
                return Err(starting(format!(
                    "function {namespace}/{function} is starting: no pod was ready within {}s",
                    self.waking.timeout.as_secs()
                )));
            }
            asleep = true;
            tokio::time::sleep(HELD_RETRY).await;
        }
    }
}

/// A 503 (with `Retry-After`) for a call whose Function is not up yet.
fn starting(message: String) -> ErrorResponse {
    ErrorResponse::message(StatusCode::SERVICE_UNAVAILABLE, message)
}

impl Upstreams for Services {
    type Function = Sleep;

    fn function(&self, key: &FunctionKey) -> Option<Found<Sleep>> {
        let route = self.routes.get(key)?;
        Some(Found {
            function: route.sleep,
            access: route.access,
            // The handler's timeout, and time to answer after it.
            timeout: route.timeout + Duration::from_secs(5),
            metrics: route.metrics,
        })
    }

    fn reaches_services(&self) -> bool {
        true
    }

    fn waits_for_start(&self, sleep: &Sleep) -> Option<&Arc<HoldBudget>> {
        (sleep.from_zero && sleep.asleep).then_some(&self.waking.held)
    }

    async fn send(
        &self,
        destination: Destination<'_, Sleep>,
        mut request: http::Request<Full<Bytes>>,
    ) -> Result<Response, ErrorResponse> {
        let (namespace, function) = destination.key;
        let uri = match destination.service {
            Some(service) => service_uri(&self.service_url, service, destination.path_and_query),
            None => upstream_uri(
                &self.function_url,
                namespace,
                function,
                destination.path_and_query,
            ),
        };
        let uri =
            uri.ok_or_else(|| ErrorResponse::message(StatusCode::BAD_REQUEST, "invalid path"))?;
        *request.uri_mut() = uri;
        // The Service's host, not the caller's (kept in X-Forwarded-Host).
        request.headers_mut().remove(header::HOST);
        let answer_within = destination.timeout;
        let sleep = destination.function.copied().unwrap_or_default();
        if sleep.from_zero {
            // Cloned only for the first call since the last renewal round.
            let mut called = self.waking.called.lock();
            if !called.contains(destination.key) {
                called.insert(destination.key.clone());
            }
        }
        let answer = if sleep.from_zero {
            self.send_waking(
                destination.key,
                sleep,
                request,
                answer_within,
                destination.held,
            )
            .await?
        } else {
            tokio::time::timeout(answer_within, self.client.request(request)).await
        };
        match answer {
            Ok(Ok(response)) => {
                let (mut head, incoming) = response.into_parts();
                forward_headers(&mut head.headers);
                Ok(Response::from_parts(head, Body::new(incoming)))
            }
            Ok(Err(problem)) => {
                tracing::warn!(%namespace, %function, %problem, "function Service failed");
                Err(ErrorResponse::message(
                    StatusCode::BAD_GATEWAY,
                    format!("function {namespace}/{function} did not answer"),
                ))
            }
            Err(_) => Err(ErrorResponse::message(
                StatusCode::GATEWAY_TIMEOUT,
                format!(
                    "function {namespace}/{function} did not answer within {}s",
                    answer_within.as_secs()
                ),
            )),
        }
    }
}

/// Follows APIRules into `exposures` until `shutdown` (a relist replaces what it knows).
pub async fn follow_apirules(
    client: kube::Client,
    exposures: Arc<Exposures>,
    shutdown: CancellationToken,
) {
    let mut relisting: Option<Vec<APIRule>> = None;
    watch_all(client, "APIRules", shutdown, |event| match event {
        watcher::Event::Init => relisting = Some(Vec::new()),
        watcher::Event::InitApply(rule) => relisting.get_or_insert_with(Vec::new).push(rule),
        watcher::Event::InitDone => {
            exposures.replace_all(relisting.take().unwrap_or_default().iter());
        }
        watcher::Event::Apply(rule) => {
            if let Err(problem) = exposures.apply(&rule) {
                tracing::warn!(apirule = %rule.name_any(), %problem, "APIRule not honoured");
            }
        }
        watcher::Event::Delete(rule) => {
            exposures.remove(&rule.namespace().unwrap_or_default(), &rule.name_any());
        }
    })
    .await;
}

/// Watches every object of `K` in the cluster until `shutdown`, handing each event to
/// `on_event`; a failed watch is retried with backoff (and relists).
async fn watch_all<K>(
    client: kube::Client,
    kind: &str,
    shutdown: CancellationToken,
    on_event: impl FnMut(watcher::Event<K>),
) where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + 'static,
{
    watch_api(Api::all(client), kind, shutdown, on_event).await;
}

/// [`watch_all`] through `api` (a kind known at run time, as Kyma's Functions are).
async fn watch_api<K>(
    api: Api<K>,
    kind: &str,
    shutdown: CancellationToken,
    mut on_event: impl FnMut(watcher::Event<K>),
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    K::DynamicType: Clone + std::hash::Hash + Eq,
{
    let events = eddy_platform::watch::backed_off(watcher(api, watcher::Config::default()));
    let mut events = std::pin::pin!(events);
    loop {
        let event = tokio::select! {
            event = events.next() => event,
            () = shutdown.cancelled() => return,
        };
        match event {
            None => return,
            Some(Ok(event)) => on_event(event),
            Some(Err(error)) => {
                tracing::warn!(%error, "watching {kind} failed; retrying with backoff");
            }
        }
    }
}

/// The upstream URI of an APIRule's call: the Service's URL from `template` and the path.
/// `None` when they do not make a URI. Pure.
pub fn service_uri(template: &str, target: &RuleService, path_and_query: &str) -> Option<Uri> {
    let base = template
        .replace("{namespace}", &target.namespace)
        .replace("{service}", &target.name)
        .replace("{port}", &target.port.to_string());
    format!("{}{path_and_query}", base.trim_end_matches('/'))
        .parse()
        .ok()
}

/// Follows Function objects into `routes`, and their pods' labels into `rate_limits`, until
/// `shutdown`.
pub async fn follow(
    client: kube::Client,
    routes: Arc<Routes>,
    rate_limits: Arc<RateLimits>,
    shutdown: CancellationToken,
) {
    let mut labels = LabelFeed::new(rate_limits);
    watch_all(client, "Functions", shutdown, |event| {
        labels.follow(&event, |function: &Function| {
            let uid = function.uid().unwrap_or_default();
            Some((key_of(function), function_pod_labels(function, &uid)))
        });
        routes.apply(event);
    })
    .await;
}

/// Follows RateLimits into `rate_limits` (a relist replaces what it knows), and the pods'
/// labels of Kyma's Functions, until `shutdown`.
pub async fn follow_rate_limits(
    client: kube::Client,
    rate_limits: Arc<RateLimits>,
    shutdown: CancellationToken,
) {
    let mut relisting: Option<Vec<RateLimit>> = None;
    let limits = watch_all(
        client.clone(),
        "RateLimits",
        shutdown.clone(),
        |event| match event {
            watcher::Event::Init => relisting = Some(Vec::new()),
            watcher::Event::InitApply(limit) => relisting.get_or_insert_with(Vec::new).push(limit),
            watcher::Event::InitDone => {
                rate_limits.replace_all(relisting.take().unwrap_or_default())
            }
            watcher::Event::Apply(limit) => rate_limits.apply(&limit),
            watcher::Event::Delete(limit) => {
                rate_limits.remove(&limit.namespace().unwrap_or_default(), &limit.name_any());
            }
        },
    );
    let kyma = eddy_model::kyma::function_resource();
    let mut labels = LabelFeed::new(rate_limits.clone());
    let kyma_functions = watch_api(
        Api::<kube::api::DynamicObject>::all_with(client, &kyma),
        "Kyma's Functions",
        shutdown,
        |event| {
            labels.follow(&event, |object| {
                let uid = object.uid().unwrap_or_default();
                let value = serde_json::to_value(object).ok()?;
                let function = eddy_model::kyma::native_function(value).ok()?;
                Some((key_of(&function), function_pod_labels(&function, &uid)))
            });
        },
    );
    tokio::join!(limits, kyma_functions);
}

/// One watch's Functions, handed to the RateLimits with their pods' labels; those a relist no
/// longer lists are forgotten.
struct LabelFeed {
    rate_limits: Arc<RateLimits>,
    known: HashSet<FunctionKey>,
    relisted: Option<HashSet<FunctionKey>>,
}

impl LabelFeed {
    fn new(rate_limits: Arc<RateLimits>) -> Self {
        Self {
            rate_limits,
            known: HashSet::new(),
            relisted: None,
        }
    }

    /// Follows one event; `labels_of` reads an object's key and its pods' labels.
    fn follow<K>(
        &mut self,
        event: &watcher::Event<K>,
        labels_of: impl Fn(&K) -> Option<(FunctionKey, BTreeMap<String, String>)>,
    ) {
        match event {
            watcher::Event::Init => self.relisted = Some(HashSet::new()),
            watcher::Event::InitApply(object) | watcher::Event::Apply(object) => {
                let Some((key, labels)) = labels_of(object) else {
                    return;
                };
                if let (watcher::Event::InitApply(_), Some(relisted)) = (event, &mut self.relisted)
                {
                    relisted.insert(key.clone());
                }
                self.known.insert(key.clone());
                self.rate_limits.set_function(key, Some(labels));
            }
            watcher::Event::InitDone => {
                let relisted = self.relisted.take().unwrap_or_default();
                for gone in self.known.difference(&relisted) {
                    self.rate_limits.set_function(gone.clone(), None);
                }
                self.known = relisted;
            }
            watcher::Event::Delete(object) => {
                if let Some((key, _)) = labels_of(object) {
                    self.known.remove(&key);
                    self.rate_limits.set_function(key, None);
                }
            }
        }
    }
}

/// The gateway's routes: probes, `/metrics`, then every path as a function call.
pub fn router(
    routes: Arc<Routes>,
    exposures: Arc<Exposures>,
    function_url: String,
    service_url: String,
    max_body: usize,
    waking: Arc<Waking>,
    rate_limits: Arc<RateLimits>,
) -> axum::Router {
    let metrics = routes.metrics.clone();
    let services = Services::new(routes.clone(), function_url, service_url, waking);
    let gateway = Arc::new(
        Gateway::new(services, metrics, exposures, max_body).with_rate_limits(rate_limits),
    );
    let probes = axum::Router::new()
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .route(
            "/readyz",
            axum::routing::get(|State(routes): State<Arc<Routes>>| async move {
                if routes.synced() {
                    (StatusCode::OK, "ok")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "Functions not listed yet")
                }
            }),
        )
        .with_state(routes);
    probes.merge(gateway.router())
}

/// Runs the gateway until `shutdown`: Functions from the cluster the process runs in (or the
/// current kubeconfig context), calls on `args.addr`.
pub async fn run(args: GatewayArgs, shutdown: CancellationToken) -> Result<()> {
    let client = kube::Client::try_default().await?;
    serve(args, client, shutdown).await
}

/// [`run`] with a given client (tests use a mock API server).
pub async fn serve(
    args: GatewayArgs,
    client: kube::Client,
    shutdown: CancellationToken,
) -> Result<()> {
    let (listener, _) = eddy_platform::net::bind(args.addr)?;
    serve_on(listener, args, client, shutdown).await
}

/// [`serve`] on a bound listener.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    args: GatewayArgs,
    client: kube::Client,
    shutdown: CancellationToken,
) -> Result<()> {
    let routes = Arc::new(Routes::default());
    let exposures = Arc::new(Exposures::new(&args.exposure));
    let rate_limits = Arc::new(RateLimits::default());
    let max_body = usize::try_from(args.max_request_size.as_u64()).unwrap_or(usize::MAX);
    let waking = Arc::new(Waking::new(
        Some(client.clone()),
        args.wake_timeout,
        &args.hold,
    ));
    let app = router(
        routes.clone(),
        exposures.clone(),
        args.function_url.clone(),
        args.service_url.clone(),
        max_body,
        waking.clone(),
        rate_limits.clone(),
    );
    let addr = listener.local_addr().map_err(eddy_platform::Error::Serve)?;
    eddy_platform::output::say(format!(
        "gateway (kubernetes) ready on http://{addr}/<namespace>/<function>"
    ));
    // The gateway tells Functions (and authorizers) who called: `X-Forwarded-For`.
    let serve = eddy_platform::net::ServeArgs {
        peer_addresses: true,
        ..args.serve.clone()
    };
    let server = eddy_platform::net::serve(
        listener,
        app,
        &serve,
        eddy_platform::net::Browsers::HostOnlyAnd({
            let exposures = exposures.clone();
            Arc::new(move |host: &str| exposures.names_host(host))
        }),
        shutdown.clone(),
        args.serve.drain_timeout,
    );
    let apirules = async {
        if args.apirules {
            tokio::join!(
                follow_apirules(client.clone(), exposures.clone(), shutdown.clone()),
                eddy_controller::istio::follow_cluster(
                    client.clone(),
                    args.exposure.clone(),
                    shutdown.clone()
                ),
                exposures.follow_authorizers(shutdown.clone()),
                follow_rate_limits(client.clone(), rate_limits.clone(), shutdown.clone()),
            );
        }
    };
    let (served, (), (), ()) = tokio::join!(
        server,
        follow(
            client.clone(),
            routes,
            rate_limits.clone(),
            shutdown.clone()
        ),
        apirules,
        waking.stamp_calls(shutdown.clone()),
    );
    Ok(served.map_err(eddy_platform::Error::Serve)?)
}
