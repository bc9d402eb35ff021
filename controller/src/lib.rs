//! The eddy controller. In local mode it serves the resource API over the NATS KV store and
//! reconciles what is stored: Subscriptions and APIRules get their status here, Functions are
//! built and run by the local backend ([`local`]). On Kubernetes it reconciles the same kinds
//! as CRDs ([`kubernetes`]). The gateway and the console are crates above this one: they read
//! the local backend's pools and the function metrics, and never the other way round.

pub mod api;
pub mod apirules;
pub mod git;
pub mod istio;
pub mod kubernetes;
pub mod local;
pub mod package_registry;
mod path_lock;
pub mod ratelimits;
pub mod runtimes;
pub mod status;
pub mod subscriptions;

pub use kubernetes::args::KubernetesArgs;

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use axum::Router;
use eddy_platform::{
    nats::NatsArgs,
    shutdown::{CancellationToken, spawn_essential},
    store::{Store, StoreError, retry_at_start},
};

/// Errors that stop the controller.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `--isolation cgroup` cannot be had here.
    #[error("--isolation cgroup: {0}")]
    Isolation(String),
    /// The runtimes' preload library (non-dumpable processes) cannot be written.
    #[error("cannot write the function runtimes' preload library under {0}: {1}")]
    Confinement(std::path::PathBuf, #[source] std::io::Error),
    /// Shared setup failed.
    #[error(transparent)]
    Api(#[from] eddy_platform::Error),
    /// The resource store could not be opened.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A Kubernetes API call failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// An object lacks what the API server always sets.
    #[error("the object has no {0}")]
    Incomplete(&'static str),
    /// The spec asks for something this backend does not build yet.
    #[error("{0}")]
    Unsupported(&'static str),
    /// Leader election failed.
    #[error("leader election: {0}")]
    Lease(#[from] kube_lease_manager::LeaseManagerError),
    /// The lease election's task ended while the controller runs (it should not): the
    /// process exits, so that Kubernetes starts it again rather than keep a controller that
    /// reconciles nothing.
    #[error("the leader election ended before shutdown")]
    ElectionEnded,
    /// A task of the local controller (a follower, the function backend) ended before
    /// shutdown (it should not): `eddy up` stops rather than run without it.
    #[error("{0} ended before shutdown")]
    Ended(&'static str),
    /// YAML could not be written.
    #[error("cannot write YAML: {0}")]
    Yaml(#[from] serde_yaml_ng::Error),
    /// The Function resource presets differ from the ones this process already uses.
    #[error("--function-presets: other presets are in force in this process")]
    PresetsInForce,
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Controller backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// Functions run as supervised processes on this machine; resources in NATS KV.
    Local,
    /// Functions run as Deployments built by Kaniko Jobs; resources are CRDs.
    Kubernetes,
}

impl FunctionArgs {
    /// How the local backend runs instances: from these flags, with logs and spares under
    /// `data_dir`, publishing to the event-bus at `bus_url`.
    fn pool_config(
        &self,
        data_dir: &std::path::Path,
        bus_url: &str,
        publisher_token: Option<String>,
        metrics: Arc<eddy_platform::function_metrics::FunctionMetrics>,
        drain_timeout: Duration,
        shutdown: &CancellationToken,
    ) -> Result<local::pool::PoolConfig> {
        let without_privileges =
            self.isolation == Isolation::Cgroup && nix::unistd::geteuid().is_root();
        let lib_dir = data_dir.join("lib");
        let confinement = Arc::new(
            eddy_platform::process::Confinement::new(&lib_dir, without_privileges)
                .map_err(|error| Error::Confinement(lib_dir.clone(), error))?,
        );
        Ok(local::pool::PoolConfig {
            logs_dir: data_dir.join("logs").join("functions"),
            publisher_url: format!("{}/publish", bus_url.trim_end_matches('/')),
            publisher_token,
            trace_collector: eddy_platform::traces::collector_endpoint().map(str::to_owned),
            metrics,
            target_concurrency: self.target_concurrency,
            scale_to_zero_after: self.scale_to_zero_after,
            scale_down_window: self.scale_down_window,
            startup_timeout: self.startup_timeout,
            drain_timeout,
            cgroups: match self.isolation {
                Isolation::None => None,
                Isolation::Cgroup => Some(Arc::new(
                    eddy_platform::cgroup::Cgroups::new("eddy")
                        .map_err(|error| Error::Isolation(error.to_string()))?,
                )),
            },
            max_function_tasks: self.max_function_tasks,
            confinement: confinement.clone(),
            spares: (self.warm_spares > 0).then(|| {
                local::spares::Spares::start(
                    self.warm_spares,
                    data_dir.join("spares"),
                    confinement.clone(),
                    shutdown.child_token(),
                )
            }),
        })
    }

    /// How the local backend builds: under `data_dir`, with these tools.
    fn build_config(&self, data_dir: &std::path::Path) -> local::build::BuildConfig {
        // Absolute: instances and installers run in other directories.
        let absolute = |dir: &PathBuf| std::path::absolute(dir).unwrap_or_else(|_| dir.clone());
        local::build::BuildConfig {
            builds_dir: data_dir.join("builds"),
            toolchain: local::toolchain::Toolchain::new(
                self.node.clone(),
                self.npm.clone(),
                self.python.clone(),
                self.tools_dir
                    .as_ref()
                    .map_or_else(|| default_tools_dir(data_dir), absolute),
                self.runtimes_dir
                    .as_ref()
                    .map_or_else(|| data_dir.join("runtimes"), absolute),
                self.build_timeout,
            ),
        }
    }

    /// Where the local backend keeps Git checkouts and mounted Secrets, under `data_dir`.
    fn sources(&self, data_dir: &std::path::Path) -> local::Sources {
        local::Sources {
            git: git::GitConfig {
                dir: data_dir.join("git"),
                timeout: self.build_timeout,
            },
            git_poll_interval: self.git_poll_interval,
            mounts_dir: data_dir.join("secret-mounts"),
        }
    }
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
    /// Where Subscriptions may deliver besides function Services.
    #[command(flatten)]
    pub sinks: eddy_platform::flags::SinkArgs,
    /// Connection limits of each listener (API, gateway).
    #[command(flatten)]
    pub serve: eddy_platform::net::ServeArgs,
    /// Bearer tokens for the resource API and the dashboard.
    #[command(flatten)]
    pub api_auth: eddy_platform::auth::ApiTokenArgs,
    /// Settings of the local backend.
    #[command(flatten)]
    pub local: LocalArgs,
    /// Settings of the Kubernetes backend.
    #[command(flatten)]
    pub kubernetes: KubernetesArgs,
}

/// Flags of the local backend: the gateway, builds, instances and scaling.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Local backend")]
pub struct LocalArgs {
    /// Address of the gateway that invokes functions (local backend).
    #[arg(
        long = "gateway-addr",
        env = "EDDY_GATEWAY_ADDR",
        default_value = "127.0.0.1:8080"
    )]
    pub gateway_addr: SocketAddr,
    /// The gateway's URL as callers reach it (default: http:// and the gateway address).
    #[arg(long = "gateway-url", env = "EDDY_GATEWAY_URL")]
    pub gateway_url: Option<String>,
    /// The event-bus, given to functions for emitCloudEvent.
    #[arg(
        long = "bus-url",
        env = "EDDY_BUS_URL",
        default_value = "http://127.0.0.1:8081"
    )]
    pub bus_url: String,
    /// The dispatcher's admin API, for delivery counts on the dashboard.
    #[arg(long = "dispatcher-url", env = "EDDY_DISPATCHER_URL")]
    pub dispatcher_url: Option<String>,
    /// How functions are built, run, scaled and reached (shared with `eddy up`).
    #[command(flatten)]
    pub functions: FunctionArgs,
    /// Directory for builds and logs.
    #[arg(long = "data-dir", env = "EDDY_DATA_DIR", default_value = ".eddy")]
    pub data_dir: PathBuf,
    /// The token the gateway accepts for every function.
    #[command(flatten)]
    pub platform: eddy_platform::flags::PlatformTokenArgs,
    /// A publish-only token given to function instances (`EDDY_PUBLISHER_TOKEN`), which their
    /// `emitCloudEvent` sends, for an event-bus that requires tokens.
    #[arg(
        long = "function-publisher-token",
        env = "EDDY_FUNCTION_PUBLISHER_TOKEN",
        hide_env_values = true
    )]
    pub function_publisher_token: Option<String>,
}

/// What confines a local function instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Isolation {
    /// Nothing beyond eddy's own user and limits.
    None,
    /// A control group per instance: memory limit, task cap, and killed whole.
    Cgroup,
}

/// Flags of functions in local mode: their toolchains, builds, instances, scaling and the
/// gateway's limits. `eddy controller` and `eddy up` take the same set.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Functions (local backend)")]
pub struct FunctionArgs {
    /// Node.js, to run the Node.js runtimes of its major version (others are found or installed
    /// in the tools dir).
    #[arg(long = "node", env = "EDDY_NODE", default_value = "node")]
    pub node: PathBuf,
    /// npm, to install Node.js dependencies.
    #[arg(long = "npm", env = "EDDY_NPM", default_value = "npm")]
    pub npm: PathBuf,
    /// Python 3.11, to run python311 functions and install their dependencies.
    #[arg(long = "python", env = "EDDY_PYTHON", default_value = "python3")]
    pub python: PathBuf,
    /// Longest a dependency install may take.
    #[arg(long = "build-timeout", env = "EDDY_BUILD_TIMEOUT", default_value = "5m", value_parser = humantime::parse_duration)]
    pub build_timeout: Duration,
    /// How often the reference of a Function's Git source is checked for a new commit.
    #[arg(long = "git-poll-interval", env = "EDDY_GIT_POLL_INTERVAL", default_value = "1m", value_parser = humantime::parse_duration)]
    pub git_poll_interval: Duration,
    /// In-flight requests per instance the autoscaler aims for.
    #[arg(
        long = "target-concurrency",
        env = "EDDY_TARGET_CONCURRENCY",
        default_value_t = 10
    )]
    pub target_concurrency: usize,
    /// Idle time after which a Function with minReplicas 0 runs no instance.
    #[arg(long = "scale-to-zero-after", env = "EDDY_SCALE_TO_ZERO_AFTER", default_value = "60s", value_parser = humantime::parse_duration)]
    pub scale_to_zero_after: Duration,
    /// How long load is remembered before scaling down.
    #[arg(long = "scale-down-window", env = "EDDY_SCALE_DOWN_WINDOW", default_value = "30s", value_parser = humantime::parse_duration)]
    pub scale_down_window: Duration,
    /// Longest a request waits for an instance to start.
    #[arg(long = "activation-timeout", env = "EDDY_ACTIVATION_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub activation_timeout: Duration,
    /// What the requests waiting for an instance to start may hold in the gateway: calls and
    /// bytes, in all and per Function (503 with `Retry-After` past a bound).
    #[command(flatten)]
    pub hold: eddy_platform::flags::HoldArgs,
    /// Warm spares kept of each runtime in use (its server started, libraries loaded), which new
    /// instances start from: a first call from zero skips the libraries' load. 0 turns them off.
    #[arg(long = "warm-spares", env = "EDDY_WARM_SPARES", default_value_t = 1)]
    pub warm_spares: usize,
    /// Longest an instance may take to answer /healthz after it starts.
    #[arg(long = "startup-timeout", env = "EDDY_STARTUP_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub startup_timeout: Duration,
    /// What confines each function instance: `none` (it runs as eddy's user, with eddy's
    /// limits), or `cgroup` (a control group of its own: its Function's memory limit, at most
    /// --max-function-tasks processes and threads, and everything it started killed with it).
    /// `cgroup` needs root, or a cgroup v2 delegated to the user.
    #[arg(long = "isolation", env = "EDDY_ISOLATION", value_enum, default_value_t = Isolation::None)]
    pub isolation: Isolation,
    /// Processes and threads one instance may have at once, with `--isolation cgroup`.
    #[arg(
        long = "max-function-tasks",
        env = "EDDY_MAX_FUNCTION_TASKS",
        default_value_t = 512
    )]
    pub max_function_tasks: u64,
    /// Largest request body the gateway forwards.
    #[arg(
        long = "max-request-size",
        env = "EDDY_MAX_REQUEST_SIZE",
        default_value = "16MiB"
    )]
    pub max_request_size: bytesize::ByteSize,
    /// Where the runtimes' own libraries are installed once and shared by every build
    /// (default: `<data-dir>/runtimes`).
    #[arg(long = "runtimes-dir", env = "EDDY_RUNTIMES_DIR")]
    pub runtimes_dir: Option<PathBuf>,
    /// Where Node.js versions the host lacks are found and installed (default: the nearest
    /// `.tools` above the working directory, where `scripts/setup` puts them, else
    /// `<data-dir>/tools`).
    #[arg(long = "tools-dir", env = "EDDY_TOOLS_DIR")]
    pub tools_dir: Option<PathBuf>,
    /// How APIRules are served: their domain, and the namespaces open to other namespaces' APIRules.
    #[command(flatten)]
    pub exposure: eddy_platform::flags::ApiRuleArgs,
    /// The Functions' resource presets, in Kyma's shape (a YAML file: `defaultPreset`,
    /// `minRequestCpu`, `minRequestMemory`, `presets` XS to XL with `requestCpu`,
    /// `requestMemory`, `limitCpu`, `limitMemory`; bare, or under Kyma's
    /// `resourcesConfiguration.function.resources`). Kyma's values when not given. Both
    /// backends.
    #[arg(
        long = "function-presets",
        env = "EDDY_FUNCTION_PRESETS",
        value_name = "FILE",
        value_parser = read_function_presets
    )]
    pub function_presets: Option<eddy_model::resources::presets::FunctionPresets>,
}

fn read_function_presets(
    path: &str,
) -> std::result::Result<
    eddy_model::resources::presets::FunctionPresets,
    eddy_model::resources::presets::PresetsError,
> {
    eddy_model::resources::presets::FunctionPresets::read(std::path::Path::new(path))
}

/// Makes `presets` this process's Function resource presets (Kyma's when `None`); an error when
/// others are in force already.
pub fn configure_presets(
    presets: Option<&eddy_model::resources::presets::FunctionPresets>,
) -> Result<()> {
    eddy_model::resources::presets::configure(presets.cloned().unwrap_or_default())
        .map_err(|_| Error::PresetsInForce)
}

impl Default for FunctionArgs {
    fn default() -> Self {
        eddy_platform::flags::defaults()
    }
}

impl Default for LocalArgs {
    fn default() -> Self {
        eddy_platform::flags::defaults()
    }
}

impl Args {
    /// Defaults for everything but the NATS URL and the API address.
    pub fn new(api_addr: SocketAddr, nats_url: impl Into<String>) -> Self {
        Self {
            api_addr,
            nats: NatsArgs::with_url(nats_url),
            ..eddy_platform::flags::defaults()
        }
    }
}

/// A local controller, started: its resource API's routes and its backend, and what the
/// gateway and the console built beside it read (the pools, the function metrics, the store).
pub struct Controller {
    /// The resource API's routes, not yet behind the API tokens (the console's routes join
    /// them there).
    pub api: Router,
    /// The API's bearer tokens (`None`: no token asked).
    pub api_tokens: Option<eddy_platform::auth::Tokens>,
    /// The local backend.
    pub backend: Arc<local::LocalController>,
    /// Every Function's pool: what the gateway calls.
    pub pools: local::pool::Pools,
    /// Every Function's series (the pools record instances, the gateway calls).
    pub function_metrics: Arc<eddy_platform::function_metrics::FunctionMetrics>,
    /// The resource store.
    pub store: Store,
    /// The JetStream context it opened.
    pub js: async_nats::jetstream::Context,
    backend_task: tokio::task::JoinHandle<Result<(), &'static str>>,
    followers: [tokio::task::JoinHandle<Result<(), &'static str>>; 3],
}

/// The nearest `.tools` above the working directory (a checkout's, filled by `scripts/setup`),
/// else the one above the running binary (`<checkout>/target/release/eddy` run from anywhere
/// finds its checkout's), else `<data_dir>/tools`.
pub fn default_tools_dir(data_dir: &std::path::Path) -> PathBuf {
    let above = |dir: &std::path::Path| {
        dir.ancestors()
            .map(|dir| dir.join(".tools"))
            .find(|tools| tools.is_dir())
    };
    std::env::current_dir()
        .ok()
        .and_then(|cwd| above(&cwd))
        .or_else(|| {
            let binary = std::env::current_exe().ok()?;
            above(binary.parent()?)
        })
        .unwrap_or_else(|| data_dir.join("tools"))
}

impl Controller {
    /// Connects to NATS, opens the store and starts the reconcilers. `gateway_url` is where
    /// callers reach the gateway (it goes into Function and APIRule status).
    pub async fn new(args: Args, gateway_url: String, shutdown: CancellationToken) -> Result<Self> {
        let Args {
            backend: _,
            api_addr: _,
            nats,
            sinks,
            serve: eddy_platform::net::ServeArgs { drain_timeout, .. },
            api_auth,
            local:
                LocalArgs {
                    gateway_addr: _,
                    gateway_url: configured_gateway_url,
                    bus_url,
                    dispatcher_url: _,
                    functions,
                    data_dir,
                    platform: _,
                    function_publisher_token,
                },
            kubernetes: _,
        } = args;
        let api_tokens = api_auth.load()?;
        let gateway_url = configured_gateway_url.unwrap_or(gateway_url);
        let client = nats
            .connect(
                "eddy-controller",
                |event| tracing::info!(%event, "NATS connection event"),
            )
            .await?;
        let js = async_nats::jetstream::new(client);
        let store = open_store(&js, &shutdown).await?;
        let sinks = sinks.policy();
        // Each runs until shutdown; one that ends before it stops the process (`stopped`).
        let subscriptions_follower = spawn_essential(
            "the Subscriptions follower",
            shutdown.clone(),
            subscriptions::run(
                store.clone(),
                js.clone(),
                sinks.clone(),
                shutdown.child_token(),
            ),
        );

        let data_dir = std::path::absolute(&data_dir).unwrap_or(data_dir);
        let pools: local::pool::Pools = Arc::default();
        let function_metrics = Arc::new(eddy_platform::function_metrics::FunctionMetrics::new());
        let pool_config = functions.pool_config(
            &data_dir,
            &bus_url,
            function_publisher_token,
            function_metrics.clone(),
            drain_timeout,
            &shutdown,
        )?;
        let logs_dir = pool_config.logs_dir.clone();
        let build_config = functions.build_config(&data_dir);
        let sources = functions.sources(&data_dir);
        let known_apirules = apirules::KnownApiRules::default();
        let apirules_follower = spawn_essential(
            "the APIRules follower",
            shutdown.clone(),
            apirules::follow_local(
                store.clone(),
                functions.exposure.clone(),
                gateway_url.clone(),
                known_apirules.clone(),
                shutdown.child_token(),
            ),
        );
        let ratelimits_follower = spawn_essential(
            "the RateLimits follower",
            shutdown.clone(),
            ratelimits::follow_local(store.clone(), shutdown.child_token()),
        );
        configure_presets(functions.function_presets.as_ref())?;
        let backend = Arc::new(local::LocalController::new(
            store.clone(),
            pools.clone(),
            pool_config,
            build_config,
            sources,
            gateway_url,
            shutdown.child_token(),
        ));
        let backend_task = spawn_essential(
            "the function backend",
            shutdown.clone(),
            backend.clone().run(),
        );
        let state = Arc::new(api::ApiState {
            store: store.clone(),
            policy: api::Policy {
                sinks,
                apirules: functions.exposure.clone(),
            },
            known_apirules,
            logs_dir,
            backend: Some(backend.clone()),
        });
        Ok(Self {
            api: api::router(state),
            api_tokens,
            backend,
            pools,
            function_metrics,
            store,
            js,
            backend_task,
            followers: [
                subscriptions_follower,
                apirules_follower,
                ratelimits_follower,
            ],
        })
    }

    /// Waits (at most 20 s) for the backend to have stopped every instance, once shutdown is
    /// signalled. An error names a task that ended before shutdown (and so caused it).
    pub async fn stopped(self) -> Result<()> {
        let handles = std::iter::once(self.backend_task).chain(self.followers);
        let (ended_early, _) =
            eddy_platform::shutdown::essentials_ended(handles, Duration::from_secs(20)).await;
        ended_early.map_or(Ok(()), |task| Err(Error::Ended(task)))
    }
}

/// Opens the store, waiting for NATS (with backoff) until shutdown.
async fn open_store(
    js: &async_nats::jetstream::Context,
    shutdown: &CancellationToken,
) -> Result<Store> {
    Ok(
        retry_at_start("resource store not available yet", 30, shutdown, || {
            Store::open(js, 1)
        })
        .await?,
    )
}
