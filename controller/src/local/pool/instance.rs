//! One instance: its state, its process (spawned from a spare or cold, with its secrets on
//! stdin, its cgroup and its environment), its health check, and its exit and restart.

use super::{
    Arc, AtomicU8, AtomicU64, AtomicUsize, CancellationToken, Cgroup, Duration, Inner, Instant,
    Ordering, OsString, PUBLISHER_PROXY_ADDRESS, Pool, RESTART, Revision, SpareKey, Stdio, process,
    spares,
};
use crate::local::start::StartError;

/// An instance's cgroup, if any; dropped (everything left in it killed, then removed) on a
/// blocking thread, since that waits for the processes to go.
pub(super) struct ReleasedCgroup(Option<Cgroup>);

impl ReleasedCgroup {
    pub(super) fn out_of_memory(&self) -> bool {
        self.0.as_ref().is_some_and(Cgroup::out_of_memory)
    }
}

impl Drop for ReleasedCgroup {
    fn drop(&mut self) {
        if let Some(cgroup) = self.0.take() {
            tokio::task::spawn_blocking(move || drop(cgroup));
        }
    }
}

/// Where an instance is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum InstanceState {
    /// Started, not yet answering its health check.
    Starting = 0,
    /// Takes requests.
    Ready = 1,
    /// Takes no new requests; stops once the ones in flight are done.
    Draining = 2,
    /// Its process has exited.
    Gone = 3,
}

/// An [`InstanceState`] read and written from several tasks without a lock.
#[derive(Debug)]
pub(super) struct AtomicState(AtomicU8);

impl AtomicState {
    pub(super) fn new(state: InstanceState) -> Self {
        Self(AtomicU8::new(state as u8))
    }

    pub(super) fn load(&self) -> InstanceState {
        match self.0.load(Ordering::Acquire) {
            0 => InstanceState::Starting,
            1 => InstanceState::Ready,
            2 => InstanceState::Draining,
            _ => InstanceState::Gone,
        }
    }

    pub(super) fn store(&self, state: InstanceState) {
        self.0.store(state as u8, Ordering::Release);
    }
}

/// What can be shown of one instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceView {
    /// Unique within the pool.
    pub id: u64,
    /// The Function generation it runs.
    pub generation: i64,
    /// The rollout it belongs to.
    pub rollout: u64,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// Its process id (0 while it is being started).
    pub pid: u32,
    /// Where it is in its life.
    pub state: InstanceState,
    /// Requests it is serving.
    pub in_flight: usize,
}

/// One running instance.
#[derive(Debug)]
pub struct Instance {
    /// Unique within the pool.
    pub id: u64,
    /// The generation it runs.
    pub generation: i64,
    /// The rollout it belongs to.
    pub rollout: u64,
    /// Its port on 127.0.0.1.
    pub port: u16,
    pub(super) in_flight: AtomicUsize,
    pub(super) state: AtomicState,
    pub(super) stop: CancellationToken,
    /// Stop with SIGKILL at once (it stopped answering) instead of a graceful SIGTERM.
    pub(super) kill: std::sync::atomic::AtomicBool,
    pub(super) pid: AtomicU64,
    /// Sent by the gateway with every request (`x-eddy-instance-secret`): the runtime answers
    /// nothing else, so its loopback port cannot be called around the gateway's access checks.
    pub secret: String,
    /// [`Instance::secret`] as a header value, made once.
    pub secret_header: http::HeaderValue,
}

/// The header that carries [`Instance::secret`].
pub const INSTANCE_SECRET_HEADER: &str = "x-eddy-instance-secret";

impl Instance {
    /// Requests being served.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Where it is in its life.
    pub fn state(&self) -> InstanceState {
        self.state.load()
    }

    /// Whether it takes requests.
    pub fn is_ready(&self) -> bool {
        self.state() == InstanceState::Ready
    }

    /// The process id (0 before start).
    pub fn pid(&self) -> u32 {
        u32::try_from(self.pid.load(Ordering::Acquire)).unwrap_or(0)
    }
}

impl Pool {
    /// Starts one instance of `revision` on a free port.
    pub(super) fn start_instance(self: &Arc<Self>, inner: &mut Inner, revision: &Arc<Revision>) {
        let id = inner.next_id;
        inner.next_id += 1;
        let port = match free_port() {
            Ok(port) => port,
            Err(error) => {
                inner.last_error = Some(format!("no free port: {error}"));
                return;
            }
        };
        // Hex digits: always a valid header value.
        let secret = uuid::Uuid::new_v4().simple().to_string();
        let instance = Arc::new(Instance {
            id,
            generation: revision.generation,
            rollout: revision.rollout,
            port,
            in_flight: AtomicUsize::new(0),
            state: AtomicState::new(InstanceState::Starting),
            stop: self.shutdown.child_token(),
            kill: std::sync::atomic::AtomicBool::new(false),
            pid: AtomicU64::new(0),
            secret_header: http::HeaderValue::from_str(&secret)
                .unwrap_or_else(|_| http::HeaderValue::from_static("-")),
            secret,
        });
        inner.instances.push(instance.clone());
        tokio::spawn(self.clone().run_instance(instance, revision.clone()));
    }

    pub(super) fn record_failure(&self, message: String) {
        {
            let mut inner = self.inner.lock();
            inner.restarts += 1;
            inner.consecutive_failures += 1;
            inner.not_before = Instant::now() + RESTART.delay(inner.consecutive_failures);
            inner.last_error = Some(message);
        }
    }

    pub(super) async fn run_instance(
        self: Arc<Self>,
        instance: Arc<Instance>,
        revision: Arc<Revision>,
    ) {
        let label = format!("{}/{}#{}", self.namespace, self.name, instance.id);
        match self.spawn(&instance, &revision).await {
            Ok((mut child, warm, cgroup)) => {
                self.metrics.instance_started(warm);
                let cgroup = ReleasedCgroup(cgroup);
                instance
                    .pid
                    .store(u64::from(child.id().unwrap_or(0)), Ordering::Release);
                let started = Instant::now();
                let healthy = self.wait_healthy(&instance, &mut child).await;
                match healthy {
                    Ok(()) => {
                        instance.state.store(InstanceState::Ready);
                        tracing::info!(instance = %label, port = instance.port, generation = revision.generation, startup = ?started.elapsed(), warm, "instance ready");
                        self.changed.notify_waiters();
                        self.kick.notify_one();
                        tokio::select! {
                            exit = child.wait() => {
                                self.exited(&label, &instance, &revision, &cgroup, exit, started.elapsed());
                            }
                            () = instance.stop.cancelled() => {
                                self.stop_instance(&label, &instance, &mut child).await;
                            }
                        }
                    }
                    Err(StartError::Stopped) => process::kill(&mut child).await,
                    Err(error) => {
                        process::kill(&mut child).await;
                        if !instance.stop.is_cancelled() {
                            tracing::warn!(instance = %label, %error, "instance failed to start");
                            self.record_failure(error.to_string());
                        }
                    }
                }
            }
            Err(error) => {
                tracing::warn!(instance = %label, %error, "cannot start instance");
                self.record_failure(error.to_string());
            }
        }
        instance.state.store(InstanceState::Gone);
        self.changed.notify_waiters();
        self.kick.notify_one();
    }

    /// An instance's process exited by itself: why (out of memory, with `--isolation cgroup`),
    /// recorded as a failure; one that ran a while resets the count of failures in a row.
    pub(super) fn exited(
        &self,
        label: &str,
        instance: &Instance,
        revision: &Revision,
        cgroup: &ReleasedCgroup,
        exit: std::io::Result<std::process::ExitStatus>,
        ran_for: Duration,
    ) {
        let mut text = exit.map_or_else(|e| e.to_string(), |status| status.to_string());
        if cgroup.out_of_memory() {
            let limit = revision.memory_limit.map_or_else(
                || "none".to_owned(),
                |bytes| bytesize::ByteSize(bytes).to_string(),
            );
            text = format!("{text}: out of memory, over its limit of {limit}");
        }
        tracing::warn!(instance = %label, status = %text, "instance exited; restarting");
        if ran_for > Duration::from_secs(10) {
            self.inner.lock().consecutive_failures = 0;
        }
        self.record_failure(format!("instance {} exited ({text})", instance.id));
    }

    /// Stops an instance asked to stop: killed when it stopped answering (a failure), else
    /// terminated gracefully (its in-flight requests drain).
    pub(super) async fn stop_instance(
        &self,
        label: &str,
        instance: &Instance,
        child: &mut tokio::process::Child,
    ) {
        if instance.kill.load(Ordering::Acquire) {
            process::kill(child).await;
            tracing::warn!(instance = %label, "instance killed: it stopped answering");
            self.record_failure(format!(
                "instance {} stopped answering and was replaced",
                instance.id
            ));
        } else {
            let grace = self.config.drain_timeout.min(Duration::from_secs(10));
            process::terminate(child, grace).await;
            tracing::info!(instance = %label, "instance stopped");
        }
    }

    /// Starts an instance: from a warm spare when one fits, else a new process. Returns the
    /// process, whether it was a spare, and its cgroup (with `--isolation cgroup`).
    pub(super) async fn spawn(
        &self,
        instance: &Instance,
        revision: &Revision,
    ) -> Result<(tokio::process::Child, bool, Option<Cgroup>), StartError> {
        let cgroup = match &self.config.cgroups {
            None => None,
            Some(cgroups) => Some(cgroups.create(
                &format!("{}_{}_{}", self.namespace, self.name, instance.id),
                eddy_platform::cgroup::Limits {
                    memory_bytes: revision.memory_limit,
                    max_tasks: Some(self.config.max_function_tasks),
                },
            )?),
        };
        let log_dir = self.config.logs_dir.join(&self.namespace);
        std::fs::create_dir_all(&log_dir).map_err(|source| StartError::Io {
            action: "create",
            path: log_dir.clone(),
            source,
        })?;
        let log_path = log_dir.join(format!("{}.log", self.name));
        let open = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log_path)
                .map_err(|source| StartError::Io {
                    action: "open",
                    path: log_path.clone(),
                    source,
                })
        };
        let env = self.instance_env(instance, revision);
        let spare = self
            .config
            .spares
            .as_ref()
            .filter(|_| spares::fits(revision.runtime, &revision.env))
            .and_then(|spares| spares.take(&spare_key(revision)));
        if let Some(spare) = spare {
            // Into the instance's cgroup before it loads the function's code.
            if let (Some(cgroup), Some(pid)) = (&cgroup, spare.id()) {
                cgroup.add(pid)?;
            }
            match spare.become_instance(&env, &revision.dir, open()?).await {
                Ok(child) => return Ok((child, true, cgroup)),
                // The spare is gone (killed on drop); a new process does the same job.
                Err(error) => {
                    tracing::warn!(function = %self.name, %error, "cannot use a warm spare")
                }
            }
        }
        let program = &revision.program;
        let server = crate::runtimes::files(revision.runtime).server_file;
        // The secrets go on stdin, not into the environment: a process's environment is
        // readable by every process of its user (/proc/<pid>/environ), other functions included.
        let (secrets, env): (Vec<_>, Vec<_>) = env
            .into_iter()
            .partition(|(name, _)| SECRET_ENV.iter().any(|secret| name == *secret));
        let mut command = tokio::process::Command::new(program);
        command
            .arg(server)
            .current_dir(&revision.dir)
            .env_clear()
            .envs(env)
            .env("EDDY_SECRETS_ON_STDIN", "1")
            .stdin(Stdio::piped())
            .stdout(open()?)
            .stderr(open()?);
        process::supervise(&mut command);
        if let Some(cgroup) = &cgroup {
            cgroup.join_on_spawn(command.as_std_mut())?;
        }
        self.config.confinement.apply(command.as_std_mut());
        let mut child = command.spawn().map_err(|source| StartError::Run {
            program: program.clone(),
            source,
        })?;
        let line = secrets_line(&secrets)?;
        let mut stdin = child.stdin.take().ok_or(StartError::NoStdin)?;
        tokio::io::AsyncWriteExt::write_all(&mut stdin, &line)
            .await
            .map_err(|source| StartError::Pipe {
                what: "cannot hand the instance its secrets",
                source,
            })?;
        // Closed: an instance reads nothing more on stdin.
        drop(stdin);
        Ok((child, false, cgroup))
    }

    /// An instance's whole environment: the fixed part, the instance's own settings and the
    /// function's `env`; never eddy's own environment. (A cold start gets the secrets among it
    /// on stdin.)
    pub(super) fn instance_env(
        &self,
        instance: &Instance,
        revision: &Revision,
    ) -> Vec<(OsString, OsString)> {
        let mut env = spares::base_env();
        let mut set = |name: &str, value: &std::ffi::OsStr| env.push((name.into(), value.into()));
        set("HOME", revision.dir.as_os_str());
        let contract = eddy_model::resources::runtime_env(
            &self.name,
            &self.namespace,
            revision.runtime,
            instance.port,
            revision.timeout_seconds,
            &self.config.publisher_url,
        );
        for (name, value) in &contract {
            set(name, value.as_ref());
        }
        set("FUNC_DIR", revision.function_dir.as_os_str());
        set("EDDY_INSTANCE_SECRET", instance.secret.as_ref());
        // The event-bus's publish token goes only where the platform's address points: a
        // function that names its own PUBLISHER_PROXY_ADDRESS (Kyma's tests point it at a mock)
        // publishes there without it.
        let own_publisher = revision
            .env
            .iter()
            .any(|(name, _)| name == PUBLISHER_PROXY_ADDRESS);
        if let Some(token) = self
            .config
            .publisher_token
            .as_ref()
            .filter(|_| !own_publisher)
        {
            set("EDDY_PUBLISHER_TOKEN", token.as_ref());
        }
        if let Some(endpoint) = &self.config.trace_collector {
            set("TRACE_COLLECTOR_ENDPOINT", endpoint.as_ref());
        }
        for (name, value) in &revision.env {
            set(name, value.as_ref());
        }
        if !revision.secret_mounts.is_empty() {
            // The runtime server shows these directories to the handler at the mount paths.
            let mounts: serde_json::Map<String, serde_json::Value> = revision
                .secret_mounts
                .iter()
                .map(|(path, dir)| (path.clone(), dir.to_string_lossy().into_owned().into()))
                .collect();
            set(
                "EDDY_SECRET_MOUNTS",
                serde_json::Value::Object(mounts).to_string().as_ref(),
            );
        }
        // A later entry wins, as `Command::env` would have it: the function's env may override.
        let mut seen = std::collections::HashSet::new();
        let mut unique: Vec<(OsString, OsString)> = env
            .into_iter()
            .rev()
            .filter(|(name, _)| seen.insert(name.clone()))
            .collect();
        unique.reverse();
        unique
    }

    pub(super) async fn wait_healthy(
        &self,
        instance: &Instance,
        child: &mut tokio::process::Child,
    ) -> Result<(), StartError> {
        let started = Instant::now();
        let deadline = started + self.config.startup_timeout;
        let address = format!("127.0.0.1:{}", instance.port);
        loop {
            if instance.stop.is_cancelled() {
                return Err(StartError::Stopped);
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(StartError::Exited {
                    status,
                    function: self.name.clone(),
                });
            }
            if probe(&address, &instance.secret).await {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(StartError::Unhealthy(self.config.startup_timeout));
            }
            // Often at first: a spare answers within milliseconds of being handed its instance.
            let pause = if started.elapsed() < Duration::from_secs(1) {
                Duration::from_millis(2)
            } else {
                Duration::from_millis(20)
            };
            tokio::time::sleep(pause).await;
        }
    }
}

/// The entries of an instance's environment a cold start gets on stdin instead.
pub(super) const SECRET_ENV: [&str; 2] = ["EDDY_INSTANCE_SECRET", "EDDY_PUBLISHER_TOKEN"];

/// The JSON line of `secrets` a cold-started runtime server reads from stdin
/// (`EDDY_SECRETS_ON_STDIN`) before it serves. Pure.
pub(super) fn secrets_line(secrets: &[(OsString, OsString)]) -> Result<Vec<u8>, StartError> {
    let vars = spares::env_object(secrets)?;
    let mut line = serde_json::to_vec(&vars)?;
    line.push(b'\n');
    Ok(line)
}

/// The spares an instance of `revision` can start from.
pub(super) fn spare_key(revision: &Revision) -> SpareKey {
    SpareKey {
        runtime: revision.runtime,
        program: revision.program.clone(),
        libraries: revision.libraries.clone(),
    }
}

/// `GET /healthz` answered 200, over a raw connection (no client pool for a probe). The whole
/// answer is read before the connection closes, so the runtime never writes into a closed
/// socket (Python printed a traceback for that on every probe).
pub(super) async fn probe(address: &str, secret: &str) -> bool {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let Ok(Ok(mut stream)) = tokio::time::timeout(
        Duration::from_millis(500),
        tokio::net::TcpStream::connect(address),
    )
    .await
    else {
        return false;
    };
    let request = format!(
        "GET /healthz HTTP/1.1\r\nHost: {address}\r\n{INSTANCE_SECRET_HEADER}: {secret}\r\nConnection: close\r\n\r\n"
    );
    if stream.write_all(request.as_bytes()).await.is_err() {
        return false;
    }
    let mut answer = Vec::with_capacity(256);
    let read = tokio::time::timeout(
        Duration::from_millis(500),
        (&mut stream).take(64 * 1024).read_to_end(&mut answer),
    )
    .await;
    matches!(read, Ok(Ok(_))) && answer.get(9..12) == Some(b"200".as_slice())
}

pub(super) fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
