//! eddy's gateway on Kubernetes: the same `/<namespace>/<function>/<rest>` URLs and the same
//! `spec.access` checks (tokens, JWT) as the gateway `eddy up` runs, in front of the function
//! Services instead of local instances. It follows Function objects through the API (one
//! list, then a watch; a relist replaces what it knows) and forwards each allowed call to
//! `http://<function>.<namespace>.svc.cluster.local` (`--function-url`), the rest of the path
//! and the query kept. The chart runs it as its own Deployment behind the Istio ingress
//! gateway or a Gateway API HTTPRoute.
//!
//! With `--apirules` it also follows Kyma's APIRules: a call for a host one names goes to the
//! rule's Service (`--service-url`) when the rule lets its caller in (crate::apirules).
//!
//! The cluster's Services are this gateway's [`Upstreams`] ([`Services`]); the proxy itself is
//! the crate's [`Gateway`], the one `eddy up` runs too.

use std::{collections::HashMap, net::SocketAddr, sync::Arc, time::Duration};

use axum::{
    body::Body,
    extract::State,
    http::{StatusCode, Uri, header},
    response::Response,
};
use bytes::Bytes;
use eddy_model::{apirule::APIRule, resources::Function};
use eddy_platform::{
    errors::ErrorResponse,
    function_metrics::{FunctionMetrics, FunctionSeries},
    shutdown::CancellationToken,
};
use futures::StreamExt as _;
use http_body_util::Full;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use kube::{
    Api, ResourceExt as _,
    runtime::{WatchStreamExt as _, watcher},
};
use parking_lot::RwLock;

use crate::{
    Access, Destination, Found, FunctionKey, Gateway, Result, Upstreams,
    apirules::{Exposures, Target},
    forward_headers,
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
        Route {
            access: Access::of(function.spec.access.as_ref(), existing.as_ref()),
            timeout: function.spec.timeout(),
            metrics: self.metrics.function(&namespace, &name),
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
}

impl Services {
    /// Functions known from `routes`, reached at `function_url`; APIRule Services at
    /// `service_url`.
    pub fn new(routes: Arc<Routes>, function_url: String, service_url: String) -> Self {
        Self {
            routes,
            function_url,
            service_url,
            client: eddy_platform::net::pooled_client(
                Duration::from_secs(30),
                Some(Duration::from_secs(5)),
            ),
        }
    }
}

impl Upstreams for Services {
    type Function = ();

    fn function(&self, key: &FunctionKey) -> Option<Found<()>> {
        let route = self.routes.get(key)?;
        Some(Found {
            function: (),
            access: route.access,
            // The handler's timeout, and time to answer after it.
            timeout: route.timeout + Duration::from_secs(5),
            metrics: route.metrics,
        })
    }

    fn reaches_services(&self) -> bool {
        true
    }

    async fn send(
        &self,
        destination: Destination<'_, ()>,
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
        match tokio::time::timeout(answer_within, self.client.request(request)).await {
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
    mut on_event: impl FnMut(watcher::Event<K>),
) where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + 'static,
{
    let api: Api<K> = Api::all(client);
    let events = watcher(api, watcher::Config::default()).default_backoff();
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
pub fn service_uri(template: &str, target: &Target, path_and_query: &str) -> Option<Uri> {
    let base = template
        .replace("{namespace}", &target.namespace)
        .replace("{service}", &target.name)
        .replace("{port}", &target.port.to_string());
    format!("{}{path_and_query}", base.trim_end_matches('/'))
        .parse()
        .ok()
}

/// Follows Function objects into `routes` until `shutdown`.
pub async fn follow(client: kube::Client, routes: Arc<Routes>, shutdown: CancellationToken) {
    watch_all(client, "Functions", shutdown, |event| routes.apply(event)).await;
}

/// The gateway's routes: probes, `/metrics`, then every path as a function call.
pub fn router(
    routes: Arc<Routes>,
    exposures: Arc<Exposures>,
    function_url: String,
    service_url: String,
    max_body: usize,
) -> axum::Router {
    let metrics = routes.metrics.clone();
    let services = Services::new(routes.clone(), function_url, service_url);
    let gateway = Arc::new(Gateway::new(services, metrics, exposures, max_body));
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
    let max_body = usize::try_from(args.max_request_size.as_u64()).unwrap_or(usize::MAX);
    let app = router(
        routes.clone(),
        exposures.clone(),
        args.function_url.clone(),
        args.service_url.clone(),
        max_body,
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
            );
        }
    };
    let (served, (), ()) = tokio::join!(
        server,
        follow(client.clone(), routes, shutdown.clone()),
        apirules
    );
    Ok(served.map_err(eddy_platform::Error::Serve)?)
}
