//! Warm spares: for each runtime a Function uses, a runtime server started ahead of need, its
//! libraries loaded, waiting on stdin for the one instance it becomes. Most of a cold start is
//! the interpreter loading Express or bottle, not the function; a new instance that takes a spare
//! skips it and only loads the handler. A spare is used once (it becomes one instance of one
//! Function and is never handed back), so nothing of one function reaches another.
//!
//! A spare runs the same interpreter and the same server file the instance's build holds, with
//! the same fixed environment an instance gets (`PATH`, `LANG`, `TZ`); the function's own
//! environment replaces it when the spare is taken. A function whose environment sets what an
//! interpreter reads only at its start (`NODE_OPTIONS`, `PYTHONPATH`, a locale) starts cold, as
//! does any instance when no spare is ready.

use std::{
    collections::{HashMap, VecDeque},
    ffi::OsString,
    io::Write as _,
    path::{Path, PathBuf},
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use eddy_model::{backoff::Backoff, resources::Runtime};
use eddy_platform::{process, shutdown::CancellationToken};
use parking_lot::Mutex;
use tokio::{
    io::{AsyncBufReadExt as _, AsyncWriteExt as _},
    sync::{Notify, oneshot},
};

use crate::local::start::StartError;
use crate::runtimes;

/// The line a spare prints once its libraries are loaded.
const READY_LINE: &[u8] = b"eddy-spare-ready\n";
/// How long after a spare is taken its replacement starts: the instance it became answers its
/// first call first (on a small machine the two would share the CPU).
const REFILL_DELAY: Duration = Duration::from_millis(500);
/// Spares that die before use are started again after this backoff (a broken runtime install
/// must not become a crash loop).
const RESPAWN: Backoff = Backoff::exponential(Duration::from_secs(1), Duration::from_secs(60));

/// Which spares can become an instance of a revision: the same runtime, interpreter and
/// libraries (the libraries' directory also fixes the server a build copies).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SpareKey {
    /// The runtime.
    pub runtime: Runtime,
    /// The interpreter.
    pub program: PathBuf,
    /// The runtime's libraries.
    pub libraries: PathBuf,
}

/// Whether an instance with this environment (the function's own `env`) may start from a spare:
/// not when it sets what the interpreter or a preloaded library reads only at start-up. Pure.
pub fn fits(runtime: Runtime, env: &[(String, String)]) -> bool {
    let read_at_start = |name: &str| {
        let node = runtime.node_major().is_some();
        name == "LANG"
            || name.starts_with("LC_")
            || (node
                && ((name.starts_with("NODE_") && name != "NODE_ENV")
                    || name.starts_with("UV_")
                    || name == "DEBUG"
                    || name == "OPENSSL_CONF"))
            || (!node && name.starts_with("PYTHON"))
    };
    !env.iter().any(|(name, _)| read_at_start(name))
}

/// The warm spares of every runtime in use, shared by all pools.
pub struct Spares {
    per_runtime: usize,
    /// Where the Python server file the spares run is written.
    dir: PathBuf,
    /// What confines every runtime process (spares become instances).
    confinement: Arc<eddy_platform::process::Confinement>,
    slots: Mutex<HashMap<SpareKey, Slot>>,
    kick: Notify,
}

#[derive(Default)]
struct Slot {
    /// Pools whose current revision could take one.
    interest: usize,
    idle: VecDeque<Spare>,
    refill_after: Option<Instant>,
    failures: u32,
}

/// A spare: started, maybe still loading its libraries.
pub struct Spare {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    loaded: Arc<AtomicBool>,
    /// Where its output goes once it becomes an instance (the function's log).
    log: oneshot::Sender<std::fs::File>,
    started: Instant,
}

/// Keeps spares of one key while held (a pool holds one for its current revision).
pub struct Interest {
    spares: Arc<Spares>,
    key: SpareKey,
}

impl Drop for Interest {
    fn drop(&mut self) {
        if let Some(slot) = self.spares.slots.lock().get_mut(&self.key) {
            slot.interest = slot.interest.saturating_sub(1);
        }
        self.spares.kick.notify_one();
    }
}

impl std::fmt::Debug for Spares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spares")
            .field("per_runtime", &self.per_runtime)
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl Spares {
    /// Keeps `per_runtime` spares of each runtime in use (0: none); runs until `shutdown`.
    pub fn start(
        per_runtime: usize,
        dir: PathBuf,
        confinement: Arc<eddy_platform::process::Confinement>,
        shutdown: CancellationToken,
    ) -> Arc<Self> {
        let spares = Arc::new(Self {
            per_runtime,
            dir,
            confinement,
            slots: Mutex::default(),
            kick: Notify::new(),
        });
        if per_runtime > 0 {
            tokio::spawn(spares.clone().tend(shutdown));
        }
        spares
    }

    /// Asks for spares of `key` while the returned guard lives.
    pub fn interest(self: &Arc<Self>, key: SpareKey) -> Interest {
        self.slots.lock().entry(key.clone()).or_default().interest += 1;
        self.kick.notify_one();
        Interest {
            spares: self.clone(),
            key,
        }
    }

    /// A live spare of `key`, if one is there (its replacement starts shortly after).
    pub fn take(&self, key: &SpareKey) -> Option<Spare> {
        let mut slots = self.slots.lock();
        let slot = slots.get_mut(key)?;
        let spare = loop {
            let mut spare = slot.idle.pop_front()?;
            if matches!(spare.child.try_wait(), Ok(None)) {
                break spare;
            }
        };
        slot.refill_after = Some(Instant::now() + REFILL_DELAY);
        // It lived until it was needed: whatever made earlier ones die has passed.
        slot.failures = 0;
        drop(slots);
        self.kick.notify_one();
        Some(spare)
    }

    /// Spares of `runtime` that have loaded their libraries and wait.
    pub fn ready(&self, runtime: Runtime) -> usize {
        self.slots
            .lock()
            .iter()
            .filter(|(key, _)| key.runtime == runtime)
            .map(|(_, slot)| {
                slot.idle
                    .iter()
                    .filter(|spare| spare.loaded.load(Ordering::Acquire))
                    .count()
            })
            .sum()
    }

    /// Process ids of the spares of `runtime` that wait for an instance.
    pub fn idle_pids(&self, runtime: Runtime) -> Vec<u32> {
        self.slots
            .lock()
            .iter()
            .filter(|(key, _)| key.runtime == runtime)
            .flat_map(|(_, slot)| slot.idle.iter().filter_map(|spare| spare.child.id()))
            .collect()
    }

    async fn tend(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            let wake = self.tend_once().await;
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = self.kick.notified() => {}
                () = tokio::time::sleep(wake) => {}
            }
        }
        // Dropping them kills them (the child processes are killed on drop).
        self.slots.lock().clear();
    }

    /// Drops dead and unwanted spares and starts missing ones; returns when to look again.
    async fn tend_once(&self) -> Duration {
        let now = Instant::now();
        let mut wanted = Vec::new();
        let mut wake = Duration::from_secs(1);
        {
            let mut slots = self.slots.lock();
            slots.retain(|_, slot| slot.interest > 0);
            for (key, slot) in slots.iter_mut() {
                let mut died = Vec::new();
                slot.idle.retain_mut(|spare| match spare.child.try_wait() {
                    Ok(None) => true,
                    Ok(Some(status)) => {
                        died.push((status.to_string(), spare.started.elapsed()));
                        false
                    }
                    Err(error) => {
                        died.push((error.to_string(), spare.started.elapsed()));
                        false
                    }
                });
                for (status, lived) in died {
                    slot.failures += 1;
                    let delay = RESPAWN.delay(slot.failures);
                    slot.refill_after = Some(now + delay);
                    tracing::warn!(runtime = key.runtime.as_str(), %status, ?lived, retry_in = ?delay, "a warm spare exited before use");
                }
                if let Some(at) = slot.refill_after {
                    if at > now {
                        wake = wake.min(at - now);
                        continue;
                    }
                    slot.refill_after = None;
                }
                for _ in slot.idle.len()..self.per_runtime {
                    wanted.push(key.clone());
                }
            }
        }
        for key in wanted {
            match self.spawn(&key).await {
                Ok(spare) => {
                    let mut slots = self.slots.lock();
                    if let Some(slot) = slots.get_mut(&key) {
                        slot.idle.push_back(spare);
                    }
                }
                Err(error) => {
                    let mut slots = self.slots.lock();
                    if let Some(slot) = slots.get_mut(&key) {
                        slot.failures += 1;
                        let delay = RESPAWN.delay(slot.failures);
                        slot.refill_after = Some(Instant::now() + delay);
                        wake = wake.min(delay);
                        tracing::warn!(runtime = key.runtime.as_str(), %error, retry_in = ?delay, "cannot start a warm spare");
                    }
                }
            }
        }
        wake
    }

    async fn spawn(&self, key: &SpareKey) -> Result<Spare, StartError> {
        let (server, dir) = self.server_of(key).await?;
        let (reader, writer) = std::io::pipe().map_err(|source| StartError::Pipe {
            what: "cannot create a pipe",
            source,
        })?;
        let writer_too = writer.try_clone().map_err(|source| StartError::Pipe {
            what: "cannot duplicate a pipe",
            source,
        })?;
        let mut command = tokio::process::Command::new(&key.program);
        command
            .arg(&server)
            .current_dir(&dir)
            .env_clear()
            .envs(base_env())
            .env("EDDY_SPARE", "1")
            .stdin(Stdio::piped())
            .stdout(writer)
            .stderr(writer_too);
        process::supervise(&mut command);
        self.confinement.apply(command.as_std_mut());
        let spawned = command.spawn();
        // The command holds the pipe's writing end; it must close here, so the reader sees the
        // end when the spare exits.
        drop(command);
        let mut child = spawned.map_err(|source| StartError::Run {
            program: key.program.clone(),
            source,
        })?;
        let stdin = child.stdin.take().ok_or(StartError::NoStdin)?;
        let output =
            tokio::net::unix::pipe::Receiver::from_owned_fd(reader.into()).map_err(|source| {
                StartError::Pipe {
                    what: "cannot read the spare's output",
                    source,
                }
            })?;
        let loaded = Arc::new(AtomicBool::new(false));
        let (log, log_file) = oneshot::channel();
        tokio::spawn(forward_output(
            output,
            loaded.clone(),
            log_file,
            key.runtime,
        ));
        Ok(Spare {
            child,
            stdin,
            loaded,
            log,
            started: Instant::now(),
        })
    }

    /// The server file a spare of `key` runs, and the directory it starts in: the same file a
    /// build of that runtime copies.
    async fn server_of(&self, key: &SpareKey) -> Result<(PathBuf, PathBuf), StartError> {
        let files = runtimes::files(key.runtime);
        if let Some(bundle) = files.bundled_server {
            let server = key.libraries.join(bundle);
            let dir = server.parent().unwrap_or(&key.libraries).to_path_buf();
            return Ok((server, dir));
        }
        let dir = self.dir.join(key.runtime.as_str());
        // The modules first: a server is never there without what it imports.
        for (name, contents) in files
            .modules
            .iter()
            .chain(std::iter::once(&(files.server_file, files.server)))
        {
            let path = dir.join(name);
            if tokio::fs::read_to_string(&path).await.ok().as_deref() == Some(*contents) {
                continue;
            }
            let io = |action, path: &Path| {
                let path = path.to_path_buf();
                move |source| StartError::Io {
                    action,
                    path,
                    source,
                }
            };
            tokio::fs::create_dir_all(&dir)
                .await
                .map_err(io("create", &dir))?;
            let partial = dir.join(format!(".{name}.partial"));
            tokio::fs::write(&partial, contents)
                .await
                .map_err(io("write", &partial))?;
            tokio::fs::rename(&partial, &path)
                .await
                .map_err(io("write", &path))?;
        }
        Ok((dir.join(files.server_file), dir))
    }
}

impl Spare {
    /// The spare's process id (none once it has exited).
    pub fn id(&self) -> Option<u32> {
        self.child.id()
    }

    /// Makes this spare an instance: its environment becomes `env`, it moves to `dir`, and its
    /// output goes to `log` from now on.
    pub async fn become_instance(
        mut self,
        env: &[(OsString, OsString)],
        dir: &Path,
        log: std::fs::File,
    ) -> Result<tokio::process::Child, StartError> {
        let vars = env_object(env)?;
        let dir_text = dir
            .to_str()
            .ok_or_else(|| StartError::NotUtf8(dir.display().to_string()))?;
        let mut line = serde_json::to_vec(&serde_json::json!({"env": vars, "dir": dir_text}))?;
        line.push(b'\n');
        self.log.send(log).map_err(|_| StartError::SpareGone)?;
        self.stdin
            .write_all(&line)
            .await
            .map_err(|source| StartError::Pipe {
                what: "cannot hand the spare its instance",
                source,
            })?;
        // Closed: an instance reads nothing on stdin.
        drop(self.stdin);
        Ok(self.child)
    }
}

/// Environment variables as a JSON object, as a runtime server reads them from stdin (a spare's
/// hand-over, a cold start's secrets). Only UTF-8 names and values can be sent.
pub fn env_object(
    env: &[(OsString, OsString)],
) -> Result<serde_json::Map<String, serde_json::Value>, StartError> {
    let mut vars = serde_json::Map::new();
    for (name, value) in env {
        let (Some(name), Some(value)) = (name.to_str(), value.to_str()) else {
            return Err(StartError::NotUtf8(format!(
                "the environment variable {}",
                name.to_string_lossy()
            )));
        };
        vars.insert(name.to_owned(), value.into());
    }
    Ok(vars)
}

/// The fixed part of every instance's environment, also a spare's: never eddy's own settings.
pub fn base_env() -> Vec<(OsString, OsString)> {
    let mut env: Vec<(OsString, OsString)> = ["PATH", "LANG", "TZ", "SYSTEMROOT"]
        .into_iter()
        .filter_map(|name| std::env::var_os(name).map(|value| (name.into(), value)))
        .collect();
    for (name, value) in [
        ("NODE_ENV", "production"),
        ("PYTHONUNBUFFERED", "1"),
        ("PYTHONDONTWRITEBYTECODE", "1"),
        // Not the user site-packages of whoever runs eddy either.
        ("PYTHONNOUSERSITE", "1"),
    ] {
        env.push((name.into(), value.into()));
    }
    env
}

/// A spare's output: up to its ready line, held (and logged if it dies unused); from then on,
/// once it becomes an instance, appended to the function's log.
async fn forward_output(
    output: tokio::net::unix::pipe::Receiver,
    loaded: Arc<AtomicBool>,
    log: oneshot::Receiver<std::fs::File>,
    runtime: Runtime,
) {
    let mut reader = tokio::io::BufReader::new(output);
    let mut early = Vec::new();
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => break,
            Ok(_) if line == READY_LINE => {
                loaded.store(true, Ordering::Release);
                break;
            }
            Ok(_) => early.extend_from_slice(&line),
        }
    }
    let Ok(file) = log.await else {
        if !early.is_empty() {
            tracing::warn!(
                runtime = runtime.as_str(),
                output = %String::from_utf8_lossy(&early),
                "a warm spare printed this and was not used"
            );
        }
        return;
    };
    // From here on the output only goes to the file, copied by a thread of its own with blocking
    // reads and writes. Through tokio's file every write was a trip through the blocking pool:
    // at a line per 100 µs, about 8× the CPU per line, paid per event by a function that logs
    // each one. Should the thread not start, the pipe closes and the function's writes fail, as
    // they would with a log that cannot be written.
    let unread = reader.buffer().to_vec();
    let output = reader.into_inner();
    let copy = move || {
        let mut file = file;
        let copied = file
            .write_all(&early)
            .and_then(|()| file.write_all(&unread))
            .and_then(|()| output.into_blocking_fd())
            .and_then(|output| std::io::copy(&mut std::fs::File::from(output), &mut file));
        if let Err(error) = copied {
            tracing::warn!(runtime = runtime.as_str(), %error, "a function's output no longer reaches its log");
        }
    };
    if let Err(error) = std::thread::Builder::new()
        .name("eddy-function-output".into())
        .spawn(copy)
    {
        tracing::error!(runtime = runtime.as_str(), %error, "no thread to copy a function's output to its log");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(names: &[&str]) -> Vec<(String, String)> {
        names
            .iter()
            .map(|name| ((*name).to_owned(), "x".to_owned()))
            .collect()
    }

    #[test]
    fn what_an_interpreter_reads_at_start_keeps_a_function_off_spares() {
        assert!(fits(
            Runtime::Nodejs22,
            &env(&["GREETING", "NODE_ENV", "PYTHONPATH"])
        ));
        assert!(!fits(Runtime::Nodejs22, &env(&["NODE_OPTIONS"])));
        assert!(!fits(Runtime::Nodejs20, &env(&["DEBUG"])));
        assert!(!fits(Runtime::Nodejs24, &env(&["UV_THREADPOOL_SIZE"])));
        assert!(fits(
            Runtime::Python312,
            &env(&["GREETING", "NODE_OPTIONS", "DEBUG"])
        ));
        assert!(!fits(Runtime::Python311, &env(&["PYTHONPATH"])));
        assert!(!fits(Runtime::Python311, &env(&["LC_ALL"])));
        assert!(!fits(Runtime::Nodejs22, &env(&["LANG"])));
    }
}
