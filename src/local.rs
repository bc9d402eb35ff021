//! Local mode's controller process (`eddy controller`, and the one `eddy up` runs): the
//! eddy-controller's resource API and backend, the gateway over its pools, and the console
//! beside the API. The three crates do not know each other; they are put together here.

use std::{sync::Arc, time::Duration};

use anyhow::Context as _;
use axum::Router;
use eddy_gateway::{
    Gateway, apirules::Exposures, hold::HoldBudget, local::LocalPools, ratelimit::RateLimits,
};
use eddy_platform::{
    net::{Browsers, serve},
    shutdown::{CancellationToken, essentials_ended, spawn_essential},
};
use tokio::net::TcpListener;

/// Longest a function's answer may take, whatever its own timeout says.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(3600);

/// A local controller with its gateway and console, ready to serve.
pub struct Controller {
    controller: eddy_controller::Controller,
    api: Router,
    gateway: Router,
    /// The APIRules the gateway honours (their hosts pass its loopback host check).
    exposures: Arc<Exposures>,
    /// The gateway's followers of APIRules and RateLimits: without them it would go on
    /// serving what it last knew, so one that ends stops the process.
    followers: [tokio::task::JoinHandle<Result<(), &'static str>>; 2],
    serve: eddy_platform::net::ServeArgs,
    drain_timeout: Duration,
    shutdown: CancellationToken,
}

impl Controller {
    /// Starts the controller (NATS, the store, the reconcilers) and builds the gateway and the
    /// console on it. `gateway_url` is where callers reach the gateway.
    pub async fn new(
        args: eddy_controller::Args,
        gateway_url: String,
        shutdown: CancellationToken,
    ) -> anyhow::Result<Self> {
        let local = args.local.clone();
        let functions = &local.functions;
        let serve = args.serve.clone();
        let drain_timeout = args.serve.drain_timeout;
        let dispatcher_token = args.api_auth.client_token()?;
        let controller =
            eddy_controller::Controller::new(args, gateway_url.clone(), shutdown.clone()).await?;

        let exposures = Arc::new(Exposures::new(&functions.exposure));
        let rate_limits = Arc::new(RateLimits::default());
        let followers = [
            spawn_essential(
                "the gateway's APIRules follower",
                shutdown.clone(),
                eddy_gateway::apirules::follow_store(
                    controller.store.clone(),
                    exposures.clone(),
                    shutdown.child_token(),
                ),
            ),
            spawn_essential(
                "the gateway's RateLimits follower",
                shutdown.clone(),
                eddy_gateway::ratelimit::follow_store(
                    controller.store.clone(),
                    rate_limits.clone(),
                    shutdown.child_token(),
                ),
            ),
        ];
        let max_body = usize::try_from(functions.max_request_size.as_u64()).unwrap_or(usize::MAX);
        let upstreams = LocalPools::new(
            controller.pools.clone(),
            functions.activation_timeout,
            REQUEST_TIMEOUT,
            Arc::new(HoldBudget::new(&functions.hold)),
        );
        let gateway = Arc::new(
            Gateway::new(
                upstreams,
                controller.function_metrics.clone(),
                exposures.clone(),
                max_body,
            )
            .with_bypass_token(local.platform.platform_token.as_deref())
            .with_rate_limits(rate_limits),
        );

        let console = Arc::new(eddy_console::DashboardState::new(
            eddy_console::DashboardParts {
                store: controller.store.clone(),
                js: controller.js.clone(),
                dispatcher_url: local.dispatcher_url.clone(),
                // The dispatcher of `eddy up` takes the same API tokens as the controller.
                dispatcher_token: dispatcher_token.clone(),
                // The console calls functions through the gateway of this process.
                gateway_url,
                bus_url: local.bus_url.clone(),
                bus_token: local.function_publisher_token.clone(),
                function_metrics: controller.function_metrics.clone(),
            },
        ));
        tokio::spawn(eddy_console::sample(
            console.clone(),
            shutdown.child_token(),
        ));
        let api = eddy_platform::auth::protect(
            controller.api.clone().merge(eddy_console::router(console)),
            controller.api_tokens.clone(),
            eddy_console::QUERY_TOKEN_PATHS,
        )
        .merge(eddy_console::page_router())
        .route("/healthz", axum::routing::get(|| async { "ok" }));
        Ok(Self {
            controller,
            api,
            gateway: gateway.router(),
            exposures,
            followers,
            serve,
            drain_timeout,
            shutdown,
        })
    }

    /// The gateway's service, to be called in this process as well as served (the dispatcher
    /// `eddy up` runs beside it delivers to functions through it).
    pub fn gateway(&self) -> Router {
        self.gateway.clone()
    }

    /// The local backend (tests reach instance processes through it).
    pub fn backend(&self) -> Arc<eddy_controller::local::LocalController> {
        self.controller.backend.clone()
    }

    /// Serves the API and the gateway until shutdown, drains them for at most the drain
    /// timeout, then stops every function instance.
    pub async fn serve(self, api: TcpListener, gateway: TcpListener) -> anyhow::Result<()> {
        let api_server = serve(
            api,
            self.api,
            &self.serve,
            Browsers::SameOrigin,
            self.shutdown.clone(),
            self.drain_timeout,
        );
        // The gateway tells Functions (and authorizers) who called: `X-Forwarded-For`.
        let gateway_serve = eddy_platform::net::ServeArgs {
            peer_addresses: true,
            ..self.serve.clone()
        };
        let gateway_server = serve(
            gateway,
            self.gateway,
            &gateway_serve,
            Browsers::HostOnlyAnd({
                let exposures = self.exposures.clone();
                Arc::new(move |host: &str| exposures.names_host(host))
            }),
            self.shutdown.clone(),
            self.drain_timeout,
        );
        let served = tokio::try_join!(api_server, gateway_server)
            .map(drop)
            .context("HTTP server failed");
        // The backend stops every instance once shutdown is signalled; wait for it.
        let stopped = self.controller.stopped().await;
        let (follower_ended, _) = essentials_ended(self.followers, Duration::from_secs(20)).await;
        served?;
        stopped?;
        match follower_ended {
            Some(task) => Err(anyhow::anyhow!("{task} ended before shutdown")),
            None => Ok(()),
        }
    }
}

/// Runs the controller of `args.backend` until `shutdown`: on Kubernetes the reconcilers, on
/// this machine the controller with its gateway and console.
pub async fn run(args: eddy_controller::Args, shutdown: CancellationToken) -> anyhow::Result<()> {
    if args.backend == eddy_controller::Backend::Kubernetes {
        return Ok(eddy_controller::kubernetes::serve(args, shutdown).await?);
    }
    let (api, api_local) = eddy_platform::net::bind(args.api_addr)?;
    let (gateway, gateway_local) = eddy_platform::net::bind(args.local.gateway_addr)?;
    let controller = Controller::new(args, format!("http://{gateway_local}"), shutdown).await?;
    eddy_platform::output::say(format!("controller ready on http://{api_local}"));
    eddy_platform::output::say(format!("gateway ready on http://{gateway_local}"));
    controller.serve(api, gateway).await
}
