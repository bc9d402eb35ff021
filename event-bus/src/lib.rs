//! The eddy event-bus: an HTTP endpoint that takes CloudEvents (binary, structured and batch
//! content modes, plus the legacy JSON format) and answers 2xx only once NATS JetStream has
//! stored the event.
//!
//! Stateless: any number of replicas can run against one NATS. See docs/event-bus.md and docs/architecture.md.

pub mod metrics;
pub mod routes;

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use eddy_platform::{
    nats::{NatsArgs, StreamArgs, events_stream_config},
    shutdown::CancellationToken,
};
use tokio::{net::TcpListener, sync::Notify};

pub use routes::{AppState, Service, service};

/// Errors that stop the event-bus.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Shared setup (NATS connection) failed.
    #[error(transparent)]
    Api(#[from] eddy_platform::Error),
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Flags of `eddy event-bus`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Address to listen on.
    #[arg(long = "addr", env = "EDDY_BUS_ADDR", default_value = "127.0.0.1:8081")]
    pub addr: SocketAddr,
    /// Share the port with other event-bus processes (`SO_REUSEPORT`): the kernel spreads new
    /// connections over every process listening on it, one per core without a proxy.
    #[arg(long = "reuse-port", env = "EDDY_BUS_REUSE_PORT")]
    pub reuse_port: bool,
    /// NATS connection.
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Settings of the EDDY_EVENTS stream, applied at start-up.
    #[command(flatten)]
    pub stream: StreamArgs,
    /// Largest event (data plus attributes); never above the NATS server's max_payload.
    #[arg(
        long = "max-event-size",
        env = "EDDY_MAX_EVENT_SIZE",
        default_value = "1MiB"
    )]
    pub max_event_size: bytesize::ByteSize,
    /// Largest batch request body.
    #[arg(
        long = "max-batch-size",
        env = "EDDY_MAX_BATCH_SIZE",
        default_value = "16MiB"
    )]
    pub max_batch_size: bytesize::ByteSize,
    /// Most events in one batch.
    #[arg(
        long = "max-batch-events",
        env = "EDDY_MAX_BATCH_EVENTS",
        default_value_t = 10_000
    )]
    pub max_batch_events: usize,
    /// How long to wait for JetStream's ack before answering 503.
    #[arg(long = "publish-timeout", env = "EDDY_PUBLISH_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    pub publish_timeout: Duration,
    /// Accepted publisher bearer tokens, comma-separated. With none (and no file), publishing is open.
    #[arg(
        long = "tokens",
        env = "EDDY_BUS_TOKENS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub tokens: Vec<String>,
    /// File with one accepted publisher token per line.
    #[arg(long = "token-file", env = "EDDY_BUS_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Longest a request may take, body included; past it the answer is 503 with `Retry-After`
    /// (a publish cut short may have been stored: retry with the same id, it is stored once).
    #[arg(long = "request-timeout", env = "EDDY_REQUEST_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub request_timeout: Duration,
    /// Most publishes waiting for JetStream's ack on the NATS connection; further publishes wait.
    #[arg(
        long = "max-acks-in-flight",
        env = "EDDY_MAX_ACKS_IN_FLIGHT",
        default_value_t = DEFAULT_MAX_ACKS_IN_FLIGHT,
        value_parser = clap::value_parser!(u32).range(16..)
    )]
    pub max_acks_in_flight: u32,
    /// Batch requests (and other bodies over 1 MiB) read, parsed and published at once; more
    /// wait their turn. Each batch keeps at most max-acks-in-flight / (2 × this) acks pending, so
    /// batches together never take all of the connection's acks from single publishes.
    #[arg(
        long = "max-concurrent-batches",
        env = "EDDY_MAX_CONCURRENT_BATCHES",
        default_value_t = DEFAULT_MAX_CONCURRENT_BATCHES,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub max_concurrent_batches: u32,
    /// Connection limits of the listener.
    #[command(flatten)]
    pub serve: eddy_platform::net::ServeArgs,
}

/// Default of `--max-acks-in-flight` (async-nats' own default, made explicit).
pub const DEFAULT_MAX_ACKS_IN_FLIGHT: u32 = 5_000;
/// Default of `--max-concurrent-batches`.
pub const DEFAULT_MAX_CONCURRENT_BATCHES: u32 = 8;

impl Args {
    /// Defaults for everything but the NATS URL and the listen address (for tests and `eddy up`).
    pub fn new(addr: SocketAddr, nats_url: impl Into<String>) -> Self {
        Self {
            addr,
            nats: NatsArgs::with_url(nats_url),
            ..eddy_platform::flags::defaults()
        }
    }
}

/// A configured event-bus, connected (or connecting) to NATS, not yet serving.
pub struct EventBus {
    state: Arc<AppState>,
    serve: eddy_platform::net::ServeArgs,
    drain_timeout: Duration,
    shutdown: CancellationToken,
}

impl EventBus {
    /// Connects to NATS (in the background when it is not up yet) and starts keeping the stream.
    pub async fn new(args: Args, shutdown: CancellationToken) -> Result<Self> {
        let Args {
            addr: _,
            reuse_port: _,
            nats,
            stream,
            max_event_size,
            max_batch_size,
            max_batch_events,
            publish_timeout,
            tokens,
            token_file,
            request_timeout,
            max_acks_in_flight,
            max_concurrent_batches,
            serve,
        } = args;
        let drain_timeout = serve.drain_timeout;
        let tokens = eddy_platform::auth::Tokens::load(&tokens, token_file.as_deref())?;
        if tokens.is_none() {
            tracing::warn!(
                "no publisher tokens configured: anyone who reaches the event-bus can publish"
            );
        }
        let metrics = metrics::Metrics::new();
        let recheck_stream = Arc::new(Notify::new());
        let on_event = {
            let recheck_stream = recheck_stream.clone();
            move |event: async_nats::Event| match event {
                async_nats::Event::Connected => {
                    tracing::info!("connected to NATS");
                    recheck_stream.notify_one();
                }
                async_nats::Event::Disconnected => {
                    tracing::warn!("disconnected from NATS; publishes answer 503 until it is back")
                }
                other => tracing::info!(event = %other, "NATS connection event"),
            }
        };
        let client = nats.connect("eddy-event-bus", on_event).await?;
        let publisher = eddy_platform::publisher::Publisher::start(
            client,
            events_stream_config(&stream),
            eddy_platform::publisher::AckLimits {
                timeout: publish_timeout,
                max_in_flight: max_acks_in_flight as usize,
            },
            recheck_stream,
            shutdown.clone(),
        );
        let limits = eddy_model::event::Limits {
            max_event_size: usize::try_from(max_event_size.as_u64()).unwrap_or(usize::MAX),
            max_batch_events,
        };
        let max_batch_bytes = usize::try_from(max_batch_size.as_u64()).unwrap_or(usize::MAX);
        let batches =
            routes::BatchLimits::new(max_acks_in_flight as usize, max_concurrent_batches as usize);
        let state = Arc::new(AppState {
            publisher,
            limits,
            max_batch_bytes,
            batches,
            request_timeout,
            tokens,
            metrics,
        });
        Ok(Self {
            state,
            serve,
            drain_timeout,
            shutdown,
        })
    }

    /// The shared state (for embedding the router elsewhere).
    pub fn state(&self) -> Arc<AppState> {
        self.state.clone()
    }

    /// Serves on `listener` until shutdown, then drains in-flight requests for at most the drain
    /// timeout.
    pub async fn serve(self, listener: TcpListener) -> Result<()> {
        eddy_platform::net::serve(
            listener,
            service(self.state),
            &self.serve,
            eddy_platform::net::Browsers::SameOrigin,
            self.shutdown,
            self.drain_timeout,
        )
        .await
        .map_err(eddy_platform::Error::Serve)?;
        Ok(())
    }
}

/// Runs the event-bus until `shutdown` is cancelled.
pub async fn run(args: Args, shutdown: CancellationToken) -> Result<()> {
    let (addr, reuse_port) = (args.addr, args.reuse_port);
    let cannot_bind = |source| eddy_platform::Error::Bind { addr, source };
    let socket = eddy_platform::net::bind_socket(addr, reuse_port).map_err(cannot_bind)?;
    let local = socket.local_addr().map_err(cannot_bind)?;
    let bus = EventBus::new(args, shutdown.clone()).await?;
    if reuse_port {
        // A process sharing the port gets its share of new connections as soon as it listens:
        // it joins only once it can store events, so its peers' clients never see its 503s.
        tracing::info!(addr = %local, "waiting for NATS and the stream before sharing the port");
        let publisher = bus.state().publisher.clone();
        while !publisher.is_ready() {
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
    }
    let listener = eddy_platform::net::listen(socket).map_err(cannot_bind)?;
    tracing::info!(addr = %local, "event-bus listening");
    eddy_platform::output::say(format!("event-bus ready on http://{local}"));
    bus.serve(listener).await
}
