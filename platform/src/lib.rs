//! What eddy's services share at run time: NATS connection and streams, the JetStream publisher,
//! the resource store, serving HTTP (timeouts, caps, drain, error answers, body limits), auth,
//! flag defaults, shutdown, process supervision and telemetry. The rules themselves (resource
//! types, subjects, event parsing) are `eddy-model`'s.
//!
//! Services depend on this crate and never on each other, so a component can be rebuilt, scaled
//! or replaced alone.

pub mod auth;
pub mod cgroup;
pub mod errors;
pub mod flags;
pub mod function_metrics;
pub mod nats;
pub mod net;
pub mod output;
pub mod process;
pub mod publisher;
pub mod scale;
pub mod shutdown;
pub mod store;
pub mod telemetry;
pub mod traces;
pub mod watch;

/// Errors raised by the shared helpers.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An HTTP server failed.
    #[error("HTTP server failed: {0}")]
    Serve(#[source] std::io::Error),
    /// The TLS client could not be set up (the system's CA roots).
    #[error("cannot set up TLS: {0}")]
    Tls(#[source] std::io::Error),
    /// Control groups cannot be used for function instances (`--isolation cgroup`).
    #[error("cgroups: {0}")]
    Cgroup(String),
    /// The NATS connection could not be set up (bad URL, unreadable credentials).
    #[error("cannot connect to NATS at {url}: {source}")]
    Connect {
        /// The URL we tried.
        url: String,
        /// What failed.
        #[source]
        source: async_nats::ConnectError,
    },
    /// The credentials file could not be read.
    #[error("cannot read NATS credentials file {path}: {source}")]
    Credentials {
        /// The file we tried.
        path: std::path::PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// A JetStream API call failed.
    #[error("JetStream {operation} on stream {stream} failed: {message}")]
    JetStream {
        /// What we were doing.
        operation: &'static str,
        /// The stream it was about.
        stream: String,
        /// What NATS said.
        message: String,
    },
    /// nats-server cannot reserve the stream's size limit in its JetStream file store (its
    /// `max_file_store`, by default 75% of the disk space free when it started).
    #[error(
        "nats-server cannot reserve {max_bytes} for stream {stream} ({message}): its JetStream store limit (max_file_store, by default 75% of the disk space free when nats-server started) is below the size limits of its streams together; free disk space and restart nats-server, raise max_file_store, or lower --stream-max-bytes (EDDY_STREAM_MAX_BYTES)"
    )]
    StreamStorage {
        /// The stream.
        stream: String,
        /// Its size limit.
        max_bytes: bytesize::ByteSize,
        /// What NATS said.
        message: String,
    },
    /// The existing stream differs from the wanted one in a setting NATS cannot change in place.
    #[error(
        "stream {stream} exists with a different {field}, which cannot be changed in place; delete the stream or keep its setting"
    )]
    StreamConflict {
        /// The stream.
        stream: String,
        /// The setting that differs.
        field: &'static str,
    },
    /// The logging flags are invalid.
    #[error("invalid log filter: {0}")]
    LogFilter(String),
    /// The log file could not be opened.
    #[error("cannot open the log file {path}: {source}")]
    LogFile {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The trace exporter could not be set up (a malformed endpoint).
    #[error("cannot export traces: {0}")]
    Traces(String),
    /// A token file could not be read.
    #[error("cannot read token file {path}: {source}")]
    TokenFile {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
