//! The NATS layout: connection flags, the streams and their settings, finding nats-server.
//! (Subjects and message ids are the model's: `eddy_model::subject`.)

use std::{path::PathBuf, time::Duration};

use async_nats::jetstream::{
    self,
    stream::{self, DiscardPolicy, RetentionPolicy, StorageType},
};

use eddy_model::{backoff::Backoff, subject};

use crate::{Error, Result};

/// Name of the stream that stores every published event.
pub const EVENTS_STREAM: &str = "EDDY_EVENTS";
/// Name of the stream that keeps events that could not be delivered.
pub const DEAD_LETTER_STREAM: &str = "EDDY_DEAD_LETTERS";
/// NATS KV bucket holding Functions and Subscriptions in local mode.
pub const RESOURCES_BUCKET: &str = "eddy_resources";

/// How to reach NATS; flattened into every service command.
#[derive(Debug, Clone, clap::Args)]
pub struct NatsArgs {
    /// NATS server URL(s), comma-separated.
    #[arg(
        long = "nats-url",
        env = "EDDY_NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,
    /// NATS credentials file (JWT + nkey), when the server requires one.
    #[arg(long = "nats-creds", env = "EDDY_NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,
    /// NATS user name (with --nats-password), when the server requires one.
    #[arg(long = "nats-user", env = "EDDY_NATS_USER")]
    pub nats_user: Option<String>,
    /// NATS password of --nats-user (prefer the variable: a flag is visible to every process).
    #[arg(
        long = "nats-password",
        env = "EDDY_NATS_PASSWORD",
        hide_env_values = true
    )]
    pub nats_password: Option<String>,
    /// CA certificate (PEM) to verify the NATS server's TLS certificate with; implies TLS.
    #[arg(long = "nats-tls-ca", env = "EDDY_NATS_TLS_CA")]
    pub nats_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for NATS mutual TLS, with --nats-tls-key.
    #[arg(
        long = "nats-tls-cert",
        env = "EDDY_NATS_TLS_CERT",
        requires = "nats_tls_key"
    )]
    pub nats_tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --nats-tls-cert.
    #[arg(
        long = "nats-tls-key",
        env = "EDDY_NATS_TLS_KEY",
        requires = "nats_tls_cert"
    )]
    pub nats_tls_key: Option<PathBuf>,
    /// Require TLS to NATS even without a CA or client certificate (`tls://` URLs do too).
    #[arg(long = "nats-tls", env = "EDDY_NATS_TLS")]
    pub nats_tls: bool,
    /// Prefix of this client's reply subjects, for servers that allow each user only its own.
    #[arg(long = "nats-inbox-prefix", env = "EDDY_NATS_INBOX_PREFIX")]
    pub inbox_prefix: Option<String>,
    /// Longest wait between two reconnection attempts.
    #[arg(long = "nats-max-reconnect-delay", env = "EDDY_NATS_MAX_RECONNECT_DELAY", default_value = "2s", value_parser = humantime::parse_duration)]
    pub max_reconnect_delay: Duration,
}

impl NatsArgs {
    /// Arguments pointing at `url` with the defaults for everything else.
    pub fn with_url(url: impl Into<String>) -> Self {
        Self {
            nats_url: url.into(),
            ..crate::flags::defaults()
        }
    }

    /// Connects, retrying forever in the background: the returned client queues work until the
    /// server is reachable, so a service can start (and answer `/readyz` false) before NATS does.
    /// `on_event` sees every connection event (connected, disconnected, ...).
    pub async fn connect<F>(&self, name: &str, on_event: F) -> Result<async_nats::Client>
    where
        F: Fn(async_nats::Event) + Send + Sync + 'static,
    {
        let max_delay = self.max_reconnect_delay;
        let on_event = std::sync::Arc::new(on_event);
        let mut options = async_nats::ConnectOptions::new()
            .name(name)
            .retry_on_initial_connect()
            .max_reconnects(None)
            .reconnect_delay_callback(move |attempts| reconnect_delay(attempts, max_delay))
            .event_callback(move |event| {
                let on_event = on_event.clone();
                async move { on_event(event) }
            });
        if let Some(path) = &self.nats_creds {
            options =
                options
                    .credentials_file(path)
                    .await
                    .map_err(|source| Error::Credentials {
                        path: path.clone(),
                        source,
                    })?;
        }
        if let Some(user) = &self.nats_user {
            options = options
                .user_and_password(user.clone(), self.nats_password.clone().unwrap_or_default());
        }
        if let Some(ca) = &self.nats_tls_ca {
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let (Some(cert), Some(key)) = (&self.nats_tls_cert, &self.nats_tls_key) {
            options = options
                .add_client_certificate(cert.clone(), key.clone())
                .require_tls(true);
        }
        if self.nats_tls {
            options = options.require_tls(true);
        }
        if let Some(prefix) = &self.inbox_prefix {
            options = options.custom_inbox_prefix(prefix);
        }
        // Every cluster member given: the client starts with whichever answers and fails over
        // to the others (and to the members the servers announce).
        let servers: Vec<&str> = self
            .nats_url
            .split(',')
            .map(str::trim)
            .filter(|url| !url.is_empty())
            .collect();
        options
            .connect(servers)
            .await
            .map_err(|source| Error::Connect {
                url: self.nats_url.clone(),
                source,
            })
    }
}

/// Linear backoff from 50 ms, capped: quick to come back after a NATS restart, gentle on a server
/// that stays down.
pub fn reconnect_delay(attempts: usize, max: Duration) -> Duration {
    Backoff::linear(Duration::from_millis(50), max)
        .delay(u32::try_from(attempts).unwrap_or(u32::MAX))
}

/// Settings of the `EDDY_EVENTS` stream.
#[derive(Debug, Clone, clap::Args)]
pub struct StreamArgs {
    /// How long events are kept.
    #[arg(long = "stream-max-age", env = "EDDY_STREAM_MAX_AGE", default_value = "7d", value_parser = humantime::parse_duration)]
    pub max_age: Duration,
    /// Store size limit; when full, publishes are refused (503), stored events are never dropped.
    #[arg(
        long = "stream-max-bytes",
        env = "EDDY_STREAM_MAX_BYTES",
        default_value = "1GiB"
    )]
    pub max_bytes: bytesize::ByteSize,
    /// Window in which a repeated (source, id) is stored only once.
    #[arg(long = "duplicate-window", env = "EDDY_DUPLICATE_WINDOW", default_value = "2m", value_parser = humantime::parse_duration)]
    pub duplicate_window: Duration,
    /// Stream replicas: 1 on one machine, 3 in a cluster.
    #[arg(long = "stream-replicas", env = "EDDY_STREAM_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=5))]
    pub replicas: u8,
}

impl Default for StreamArgs {
    fn default() -> Self {
        crate::flags::defaults()
    }
}

/// The wanted configuration of `EDDY_EVENTS`.
pub fn events_stream_config(settings: &StreamArgs) -> stream::Config {
    stream::Config {
        name: EVENTS_STREAM.to_owned(),
        description: Some("eddy: every published event".to_owned()),
        subjects: vec![format!("{}.>", subject::EVENTS_SUBJECT_PREFIX)],
        retention: RetentionPolicy::Limits,
        storage: StorageType::File,
        discard: DiscardPolicy::New,
        max_age: settings.max_age,
        max_bytes: i64::try_from(settings.max_bytes.as_u64()).unwrap_or(i64::MAX),
        duplicate_window: settings.duplicate_window,
        num_replicas: usize::from(settings.replicas),
        ..Default::default()
    }
}

/// The wanted configuration of `EDDY_DEAD_LETTERS` (kept as long as the events themselves).
pub fn dead_letter_stream_config(settings: &StreamArgs) -> stream::Config {
    stream::Config {
        name: DEAD_LETTER_STREAM.to_owned(),
        description: Some("eddy: events that could not be delivered".to_owned()),
        subjects: vec![format!("{}.>", subject::DEAD_LETTER_SUBJECT_PREFIX)],
        ..events_stream_config(settings)
    }
}

/// How an existing stream compares with the wanted one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamDrift {
    /// Nothing to do.
    UpToDate,
    /// These settings differ and can be updated in place.
    Update(Vec<&'static str>),
    /// This setting differs and NATS cannot change it in place.
    Conflict(&'static str),
}

/// Compares the settings eddy owns; anything else on the stream (set by an operator) is left alone.
pub fn stream_drift(existing: &stream::Config, wanted: &stream::Config) -> StreamDrift {
    if existing.storage != wanted.storage {
        return StreamDrift::Conflict("storage");
    }
    if existing.retention != wanted.retention {
        return StreamDrift::Conflict("retention");
    }
    let mut changed = Vec::new();
    let mut check = |field: &'static str, differs: bool| {
        if differs {
            changed.push(field);
        }
    };
    check("subjects", existing.subjects != wanted.subjects);
    check("discard", existing.discard != wanted.discard);
    check("max_age", existing.max_age != wanted.max_age);
    check("max_bytes", existing.max_bytes != wanted.max_bytes);
    check(
        "duplicate_window",
        existing.duplicate_window != wanted.duplicate_window,
    );
    check("num_replicas", existing.num_replicas != wanted.num_replicas);
    if changed.is_empty() {
        StreamDrift::UpToDate
    } else {
        StreamDrift::Update(changed)
    }
}

/// Creates the stream, or brings the settings eddy owns up to date.
pub async fn ensure_stream(
    js: &jetstream::Context,
    wanted: stream::Config,
) -> Result<stream::Info> {
    let name = wanted.name.clone();
    let max_bytes = wanted.max_bytes;
    let failed = |operation: &'static str, message: String| Error::JetStream {
        operation,
        stream: name.clone(),
        message,
    };
    // A store too small for the size limit is the one create/update failure an operator can
    // fix without reading NATS docs; say how.
    let write_failed = |operation: &'static str, error: jetstream::context::CreateStreamError| {
        match error.kind() {
            jetstream::context::CreateStreamErrorKind::JetStream(api)
                if api.error_code() == jetstream::ErrorCode::STORAGE_RESOURCES_EXCEEDED =>
            {
                Error::StreamStorage {
                    stream: name.clone(),
                    max_bytes: bytesize::ByteSize::b(u64::try_from(max_bytes).unwrap_or(0)),
                    message: api.to_string(),
                }
            }
            _ => failed(operation, error.to_string()),
        }
    };
    match js.get_stream(&name).await {
        Ok(mut existing) => {
            let info = existing
                .info()
                .await
                .map_err(|e| failed("info", e.to_string()))?
                .clone();
            match stream_drift(&info.config, &wanted) {
                StreamDrift::UpToDate => Ok(info),
                StreamDrift::Conflict(field) => Err(Error::StreamConflict {
                    stream: name.clone(),
                    field,
                }),
                StreamDrift::Update(fields) => {
                    tracing::info!(stream = %name, ?fields, "updating stream settings");
                    let merged = stream::Config {
                        subjects: wanted.subjects,
                        discard: wanted.discard,
                        max_age: wanted.max_age,
                        max_bytes: wanted.max_bytes,
                        duplicate_window: wanted.duplicate_window,
                        num_replicas: wanted.num_replicas,
                        ..info.config
                    };
                    js.update_stream(merged)
                        .await
                        .map_err(|e| write_failed("update", e))
                }
            }
        }
        Err(error)
            if matches!(
                error.kind(),
                jetstream::context::GetStreamErrorKind::JetStream(ref api)
                    if api.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
            ) =>
        {
            tracing::info!(stream = %name, "creating stream");
            let mut created = js
                .create_stream(wanted)
                .await
                .map_err(|e| write_failed("create", e))?;
            Ok(created
                .info()
                .await
                .map_err(|e| failed("info", e.to_string()))?
                .clone())
        }
        Err(error) => Err(failed("lookup", error.to_string())),
    }
}

/// Where eddy finds nats-server, the same for `eddy up` and the test harness: the path given
/// (`--nats-server` or `EDDY_NATS_SERVER`), then `PATH`, then the project's tool dir
/// (`.tools/venv/bin`, where `scripts/setup` installs it) in `project_dir` or a directory above.
pub fn find_nats_server(given: Option<PathBuf>, project_dir: &std::path::Path) -> Option<PathBuf> {
    if let Some(path) = given {
        return Some(path);
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("nats-server"))
            .find(|candidate| candidate.is_file())
    });
    on_path.or_else(|| {
        project_dir
            .ancestors()
            .map(|dir| dir.join(".tools/venv/bin/nats-server"))
            .find(|candidate| candidate.is_file())
    })
}

/// The client URL a nats-server started with `--ports_file_dir DIR` wrote into DIR, once it
/// listens (`nats://127.0.0.1:<port>`).
pub fn read_ports_file(dir: &std::path::Path) -> Option<String> {
    let entry = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .find(|entry| entry.path().extension().is_some_and(|ext| ext == "ports"))?;
    let text = std::fs::read_to_string(entry.path()).ok()?;
    let url = text
        .split('"')
        .find(|part| part.starts_with("nats://") || part.starts_with("tls://"))?;
    Some(url.replace("0.0.0.0", "127.0.0.1"))
}

/// RFC 3339 (milliseconds, `Z`) of a JetStream timestamp given as Unix seconds and nanoseconds,
/// as the dashboard and dead-letter listings show when an event was stored.
pub fn stored_time(unix_seconds: i64, nanoseconds: u32) -> String {
    chrono::DateTime::from_timestamp(unix_seconds, nanoseconds)
        .map(|time| time.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_stream_follows_the_design() {
        let config = events_stream_config(&StreamArgs::default());
        assert_eq!(config.name, "EDDY_EVENTS");
        assert_eq!(config.subjects, vec!["eddy.events.>".to_owned()]);
        assert_eq!(config.storage, StorageType::File);
        assert_eq!(config.retention, RetentionPolicy::Limits);
        assert_eq!(config.discard, DiscardPolicy::New);
        assert_eq!(config.duplicate_window, Duration::from_secs(120));
        assert_eq!(config.num_replicas, 1);
        assert_eq!(config.max_bytes, 1 << 30);
    }

    #[test]
    fn dead_letters_bind_their_own_subjects() {
        let config = dead_letter_stream_config(&StreamArgs::default());
        assert_eq!(config.name, "EDDY_DEAD_LETTERS");
        assert_eq!(config.subjects, vec!["eddy.dlq.>".to_owned()]);
        assert_eq!(config.discard, DiscardPolicy::New);
    }

    #[test]
    fn drift_lists_changed_settings() {
        let wanted = events_stream_config(&StreamArgs::default());
        assert_eq!(stream_drift(&wanted, &wanted), StreamDrift::UpToDate);
        let old = stream::Config {
            max_age: Duration::from_secs(60),
            discard: DiscardPolicy::Old,
            ..wanted.clone()
        };
        assert_eq!(
            stream_drift(&old, &wanted),
            StreamDrift::Update(vec!["discard", "max_age"])
        );
        let memory = stream::Config {
            storage: StorageType::Memory,
            ..wanted.clone()
        };
        assert_eq!(
            stream_drift(&memory, &wanted),
            StreamDrift::Conflict("storage")
        );
    }

    #[test]
    fn reconnect_delay_is_capped() {
        let max = Duration::from_secs(2);
        assert_eq!(reconnect_delay(1, max), Duration::from_millis(50));
        assert_eq!(reconnect_delay(1000, max), max);
        assert_eq!(reconnect_delay(usize::MAX, max), max);
    }
}
