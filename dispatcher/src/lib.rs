//! The eddy dispatcher: one durable JetStream consumer per Subscription, pushing each event to
//! its sink as a binary-mode CloudEvent over HTTP, at least once. See `docs/architecture.md` and
//! `docs/dispatcher.md`.
//!
//! Any number of dispatcher processes can run against one NATS: they share each consumer, and
//! JetStream hands an event to one of them at a time.
//!
//! The modules, each importing only ones before it (`scripts/check-imports` refuses a circle):
//! `delivery` (what a sink's answer means), `consumer` (a Subscription's JetStream consumer),
//! `journal` (recent attempts); `index` (which Subscriptions are delivered for: pure), `sinks`
//! (where a sink is), `metrics`; `scaler` (Functions woken from zero, on Kubernetes); `send` (one
//! attempt); `deadletter`; `worker` (one Subscription's loop: gate, hold, attempt, settle);
//! `manager` (a worker per Subscription); `admin` (the admin API). The public surface is the
//! `pub use` list below.

mod admin;
mod consumer;
mod deadletter;
mod delivery;
mod index;
mod journal;
mod manager;
mod metrics;
mod scaler;
mod send;
mod sinks;
mod worker;

pub use consumer::{ConsumerPlan, ensure as ensure_consumer};
pub use delivery::{Failure, Verdict};
pub use index::LiveSubscription;
pub use journal::Journal;
pub use metrics::Metrics;
pub use scaler::ScaleArgs;
pub use send::{Deliveries, InProcessGateway, Shared, SinkClient, deliver, sink_client};
pub use sinks::{Resolution, Resolved, Sinks};

use std::{net::SocketAddr, sync::Arc, time::Duration};

use eddy_model::event::Limits;
use eddy_platform::{
    nats::{NatsArgs, StreamArgs, dead_letter_stream_config, ensure_stream},
    publisher::{AckLimits, Publisher},
    shutdown::CancellationToken,
    store::{Store, retry_at_start},
};
use tokio::net::TcpListener;

/// Longest wait for JetStream to acknowledge a reply event; past it the delivery is retried.
const REPLY_ACK_TIMEOUT: Duration = Duration::from_secs(10);
/// Most reply events awaiting their ack at once (more wait for a slot).
const REPLY_ACKS_IN_FLIGHT: usize = 1024;

/// Errors of the dispatcher.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Shared setup failed.
    #[error(transparent)]
    Api(#[from] eddy_platform::Error),
    /// The resource store failed.
    #[error(transparent)]
    Store(#[from] eddy_platform::store::StoreError),
    /// A JetStream consumer operation failed.
    #[error("consumer {consumer}: {operation} failed: {message}")]
    Consumer {
        /// The consumer.
        consumer: String,
        /// What we were doing.
        operation: &'static str,
        /// What NATS said.
        message: String,
    },
    /// The Kubernetes API could not be reached.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// A task the dispatcher cannot work without ended before shutdown (it returned or
    /// panicked): the dispatcher stopped rather than serve without it.
    #[error("{0} ended before shutdown")]
    Ended(&'static str),
}

/// Where Subscriptions are read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SubscriptionsFrom {
    /// The resource store in NATS KV (local mode).
    Kv,
    /// Subscription objects in the Kubernetes cluster (sinks are then used as written).
    Kubernetes,
}

impl Error {
    /// A consumer error with its context.
    pub fn consumer(
        consumer: &str,
        operation: &'static str,
        error: impl std::fmt::Display,
    ) -> Self {
        Self::Consumer {
            consumer: consumer.to_owned(),
            operation,
            message: error.to_string(),
        }
    }
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Default of `--ack-wait` (here and in `eddy up`).
pub const DEFAULT_ACK_WAIT: &str = "30s";

/// Flags of `eddy dispatcher`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Admin address: probes, metrics, dead letters, replay.
    #[arg(
        long = "addr",
        env = "EDDY_DISPATCHER_ADDR",
        default_value = "127.0.0.1:8083"
    )]
    pub addr: SocketAddr,
    /// NATS connection.
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Settings of the streams (the dead-letter stream takes the same limits as the events).
    #[command(flatten)]
    pub stream: StreamArgs,
    /// Where Subscriptions may deliver besides function Services.
    #[command(flatten)]
    pub sinks: eddy_platform::flags::SinkArgs,
    /// Where Subscriptions are read from.
    #[arg(
        long = "subscriptions-from",
        env = "EDDY_SUBSCRIPTIONS_FROM",
        value_enum,
        default_value = "kv"
    )]
    pub subscriptions_from: SubscriptionsFrom,
    /// With `--subscriptions-from kubernetes`: follow Kyma's Subscriptions
    /// (eventing.kyma-project.io/v1alpha2) as well as eddy's.
    #[arg(long = "kyma-compatibility", env = "EDDY_KYMA_COMPATIBILITY")]
    pub kyma_compatibility: bool,
    /// How function sinks are resolved: through Function status (local) or as written (direct).
    #[arg(
        long = "sink-resolution",
        env = "EDDY_SINK_RESOLUTION",
        value_enum,
        default_value = "local"
    )]
    pub sink_resolution: sinks::Resolution,
    /// How long a delivery may go without an ack before JetStream gives the event to another
    /// dispatcher; in-progress acks keep longer deliveries alive.
    #[arg(long = "ack-wait", env = "EDDY_ACK_WAIT", default_value = DEFAULT_ACK_WAIT, value_parser = humantime::parse_duration)]
    pub ack_wait: Duration,
    /// Largest reply event read from a sink's answer and stored (data plus headers, as the
    /// event-bus's `--max-event-size`).
    #[arg(
        long = "max-reply-size",
        env = "EDDY_MAX_REPLY_SIZE",
        default_value = "1MiB"
    )]
    pub max_reply_size: bytesize::ByteSize,
    /// Scaling Functions from zero (with `--subscriptions-from kubernetes`).
    #[command(flatten)]
    pub scale: scaler::ScaleArgs,
    /// Connection limits of the admin listener.
    #[command(flatten)]
    pub serve: eddy_platform::net::ServeArgs,
    /// The token the local gateway accepts for every function, sent with deliveries to the
    /// function sinks it resolves.
    #[command(flatten)]
    pub platform: eddy_platform::flags::PlatformTokenArgs,
    /// Bearer tokens for the admin API (dead letters, replay, metrics).
    #[command(flatten)]
    pub api_auth: eddy_platform::auth::ApiTokenArgs,
    /// The function gateway of this process, when one runs beside the dispatcher (`eddy up`):
    /// deliveries to its address are handed to it directly instead of over loopback HTTP.
    #[arg(skip)]
    pub gateway: Option<InProcessGateway>,
}

impl Args {
    /// Defaults for everything but the NATS URL and the admin address.
    pub fn new(addr: SocketAddr, nats_url: impl Into<String>) -> Self {
        Self {
            addr,
            nats: NatsArgs::with_url(nats_url),
            ..eddy_platform::flags::defaults()
        }
    }
}

/// A configured dispatcher, delivering, with its admin API not yet served.
pub struct Dispatcher {
    router: axum::Router,
    /// The tasks it cannot work without (the subscription manager, its follower, the scaler):
    /// each cancels `shutdown` should it end early, and says so here.
    essentials: Vec<tokio::task::JoinHandle<Result<(), &'static str>>>,
    serve: eddy_platform::net::ServeArgs,
    drain_timeout: Duration,
    shutdown: CancellationToken,
}

impl Dispatcher {
    /// Connects, makes sure the dead-letter stream exists, and starts following Subscriptions.
    pub async fn new(args: Args, shutdown: CancellationToken) -> Result<Self> {
        let kube = match args.subscriptions_from {
            SubscriptionsFrom::Kv => None,
            SubscriptionsFrom::Kubernetes => Some(kube::Client::try_default().await?),
        };
        Self::with_kubernetes(args, kube, shutdown).await
    }

    /// Like [`Dispatcher::new`], reading Subscriptions through `kube` when it is given
    /// (`--subscriptions-from kubernetes`).
    pub async fn with_kubernetes(
        args: Args,
        kube: Option<kube::Client>,
        shutdown: CancellationToken,
    ) -> Result<Self> {
        let Args {
            addr: _,
            nats,
            stream,
            sinks,
            subscriptions_from: _,
            kyma_compatibility,
            sink_resolution,
            ack_wait,
            max_reply_size,
            scale,
            serve,
            platform: eddy_platform::flags::PlatformTokenArgs { platform_token },
            api_auth,
            gateway,
        } = args;
        let drain_timeout = serve.drain_timeout;
        let api_tokens = api_auth.load()?;
        let client = nats
            .connect(
                "eddy-dispatcher",
                |event| tracing::info!(%event, "NATS connection event"),
            )
            .await?;
        let js = async_nats::jetstream::new(client.clone());
        let policy = sinks.policy();
        let scaler = kube
            .clone()
            .map(|kube| scaler::Scaler::new(kube, scale.clone()));
        let mut essentials = Vec::new();
        let (source, sinks) = match kube {
            Some(kube) => {
                ensure_with_retry(&js, &stream, &shutdown).await?;
                // Cluster DNS resolves function Services.
                let sinks = sinks::Sinks::new(sinks::Resolution::Direct, policy.clone());
                let source = manager::SubscriptionSource::Kubernetes {
                    client: kube,
                    kyma: kyma_compatibility,
                };
                (source, sinks)
            }
            None => {
                let store = open_with_retry(&js, &stream, &shutdown).await?;
                let sinks = sinks::Sinks::new(sink_resolution, policy.clone())
                    .with_platform_token(platform_token.as_deref());
                if sink_resolution == sinks::Resolution::Local {
                    essentials.push(eddy_platform::shutdown::spawn_essential(
                        "the Functions' addresses follower",
                        shutdown.clone(),
                        sinks.clone().watch(store.clone(), shutdown.child_token()),
                    ));
                }
                (manager::SubscriptionSource::Store(Box::new(store)), sinks)
            }
        };
        let replies = Publisher::without_stream(
            client.clone(),
            AckLimits {
                timeout: REPLY_ACK_TIMEOUT,
                max_in_flight: REPLY_ACKS_IN_FLIGHT,
            },
        );
        let shared = Arc::new(Shared {
            js,
            deliveries: Deliveries::new(sink_client(Duration::from_secs(60))?, gateway),
            replies,
            sinks,
            metrics: metrics::Metrics::new(),
            reply_limits: Limits {
                max_event_size: usize::try_from(max_reply_size.as_u64()).unwrap_or(usize::MAX),
                max_batch_events: 1,
            },
            progress_every: (ack_wait / 3).max(Duration::from_millis(100)),
            journal: journal::Journal::default(),
            scaler: scaler.clone(),
        });
        let (manager, manager_tasks) = manager::start(
            shared.clone(),
            policy,
            ack_wait,
            drain_timeout,
            source,
            shutdown.child_token(),
            shutdown.clone(),
        );
        essentials.extend(manager_tasks);
        if let Some(scaler) = scaler {
            essentials.push(eddy_platform::shutdown::spawn_essential(
                "the scaler",
                shutdown.clone(),
                scaler.run(
                    shared.js.clone(),
                    manager.delivering(),
                    shared.metrics.scalings(),
                    shutdown.child_token(),
                ),
            ));
        }
        let router = eddy_platform::auth::protect(
            admin::router(Arc::new(admin::AdminState {
                shared,
                manager,
                client,
            })),
            api_tokens,
            &[],
        );
        Ok(Self {
            router,
            essentials,
            serve,
            drain_timeout,
            shutdown,
        })
    }

    /// Serves the admin API until shutdown, then waits for the workers to drain.
    pub async fn serve(self, listener: TcpListener) -> Result<()> {
        let served = eddy_platform::net::serve(
            listener,
            self.router,
            &self.serve,
            eddy_platform::net::Browsers::SameOrigin,
            self.shutdown.clone(),
            self.drain_timeout,
        )
        .await
        .map_err(eddy_platform::Error::Serve);
        // The manager stops every worker on shutdown, each bounded by the drain timeout.
        let (ended_early, drained) = eddy_platform::shutdown::essentials_ended(
            self.essentials,
            self.drain_timeout + Duration::from_secs(1),
        )
        .await;
        if !drained {
            tracing::warn!("dispatcher workers did not drain in time");
        }
        served?;
        // A task that ended early stopped the dispatcher: it exits with an error.
        match ended_early {
            Some(task) => Err(Error::Ended(task)),
            None => Ok(()),
        }
    }
}

/// Creates the dead-letter stream, waiting for NATS with backoff.
async fn ensure_with_retry(
    js: &async_nats::jetstream::Context,
    stream: &StreamArgs,
    shutdown: &CancellationToken,
) -> Result<()> {
    retry_at_start(NATS_NOT_READY, 60, shutdown, || async {
        ensure_stream(js, dead_letter_stream_config(stream)).await?;
        Ok(())
    })
    .await
}

/// Creates the dead-letter stream and opens the store, waiting for NATS with backoff.
async fn open_with_retry(
    js: &async_nats::jetstream::Context,
    stream: &StreamArgs,
    shutdown: &CancellationToken,
) -> Result<Store> {
    retry_at_start(NATS_NOT_READY, 60, shutdown, || async {
        ensure_stream(js, dead_letter_stream_config(stream)).await?;
        Ok(Store::open(js, usize::from(stream.replicas)).await?)
    })
    .await
}

const NATS_NOT_READY: &str = "NATS not ready for the dispatcher yet";

/// Runs the dispatcher until `shutdown`.
pub async fn run(args: Args, shutdown: CancellationToken) -> Result<()> {
    let (listener, local) = eddy_platform::net::bind(args.addr)?;
    let dispatcher = Dispatcher::new(args, shutdown).await?;
    eddy_platform::output::say(format!("dispatcher ready on http://{local}"));
    dispatcher.serve(listener).await
}
