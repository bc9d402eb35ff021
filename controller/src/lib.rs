//! The eddy controller. In local mode it serves the resource API over the NATS KV store and
//! reconciles what is stored: Subscriptions get their status here, Functions are built and run
//! by the local backend.

pub mod api;
pub mod subscriptions;

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use axum::Router;
use eddy_api::{
    nats::NatsArgs,
    resources::SinkPolicy,
    shutdown::CancellationToken,
    store::{Store, StoreError},
};
use tokio::net::TcpListener;

/// Errors that stop the controller.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Shared setup failed.
    #[error(transparent)]
    Api(#[from] eddy_api::Error),
    /// The resource store could not be opened.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// An address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A server failed.
    #[error("HTTP server failed: {0}")]
    Serve(#[source] std::io::Error),
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Controller backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// Functions run as supervised processes on this machine; resources in NATS KV.
    Local,
}

/// Flags of `eddy controller`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Where Functions run.
    #[arg(
        long = "backend",
        env = "EDDY_BACKEND",
        value_enum,
        default_value = "local"
    )]
    pub backend: Backend,
    /// Address of the resource API (and dashboard).
    #[arg(
        long = "api-addr",
        env = "EDDY_API_ADDR",
        default_value = "127.0.0.1:8082"
    )]
    pub api_addr: SocketAddr,
    /// NATS connection.
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Directory for builds and logs.
    #[arg(long = "data-dir", env = "EDDY_DATA_DIR", default_value = ".eddy")]
    pub data_dir: PathBuf,
    /// URL prefixes Subscription sinks may use besides function Services (comma-separated).
    /// Everything else is refused, so Subscriptions cannot be used to reach arbitrary hosts.
    #[arg(
        long = "allowed-sinks",
        env = "EDDY_ALLOWED_SINKS",
        value_delimiter = ','
    )]
    pub allowed_sinks: Vec<String>,
    /// Longest wait for in-flight requests on shutdown.
    #[arg(long = "drain-timeout", env = "EDDY_DRAIN_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
}

impl Args {
    /// Defaults for everything but the NATS URL and the API address.
    pub fn new(api_addr: SocketAddr, nats_url: impl Into<String>) -> Self {
        Self {
            backend: Backend::Local,
            api_addr,
            nats: NatsArgs::with_url(nats_url),
            data_dir: PathBuf::from(".eddy"),
            allowed_sinks: Vec::new(),
            drain_timeout: Duration::from_secs(10),
        }
    }
}

/// A running controller's parts, ready to serve.
pub struct Controller {
    router: Router,
    drain_timeout: Duration,
    shutdown: CancellationToken,
}

impl Controller {
    /// Connects to NATS, opens the store and starts the reconcilers.
    pub async fn new(args: Args, shutdown: CancellationToken) -> Result<Self> {
        let Args {
            backend: Backend::Local,
            api_addr: _,
            nats,
            data_dir: _,
            allowed_sinks,
            drain_timeout,
        } = args;
        let client = nats
            .connect(
                "eddy-controller",
                |event| tracing::info!(%event, "NATS connection event"),
            )
            .await?;
        let js = async_nats::jetstream::new(client);
        let store = open_store(&js, &shutdown).await?;
        let sinks = SinkPolicy {
            allowed_prefixes: allowed_sinks,
        };
        tokio::spawn(subscriptions::run(
            store.clone(),
            js.clone(),
            sinks.clone(),
            shutdown.child_token(),
        ));
        let state = Arc::new(api::ApiState { store, sinks });
        let router = api::router(state).route("/healthz", axum::routing::get(|| async { "ok" }));
        Ok(Self {
            router,
            drain_timeout,
            shutdown,
        })
    }

    /// Serves the API until shutdown, draining for at most the drain timeout.
    pub async fn serve(self, listener: TcpListener) -> Result<()> {
        let shutdown = self.shutdown.clone();
        let server = axum::serve(listener, self.router)
            .with_graceful_shutdown(shutdown.clone().cancelled_owned());
        let deadline = async {
            shutdown.cancelled().await;
            tokio::time::sleep(self.drain_timeout).await;
        };
        tokio::select! {
            served = server => served.map_err(Error::Serve),
            () = deadline => Ok(()),
        }
    }
}

/// Opens the store, waiting for NATS (with backoff) until shutdown.
async fn open_store(
    js: &async_nats::jetstream::Context,
    shutdown: &CancellationToken,
) -> Result<Store> {
    let mut attempt = 0;
    loop {
        match Store::open(js, 1).await {
            Ok(store) => return Ok(store),
            Err(error) if attempt < 30 && !shutdown.is_cancelled() => {
                attempt += 1;
                tracing::warn!(%error, attempt, "resource store not available yet");
                tokio::time::sleep(eddy_api::store::rewatch_delay(attempt)).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// Runs the controller until `shutdown`.
pub async fn run(args: Args, shutdown: CancellationToken) -> Result<()> {
    let addr = args.api_addr;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })?;
    let local = listener
        .local_addr()
        .map_err(|source| Error::Bind { addr, source })?;
    let controller = Controller::new(args, shutdown).await?;
    println!("controller ready on http://{local}");
    controller.serve(listener).await
}
