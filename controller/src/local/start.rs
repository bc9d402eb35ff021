//! Why a function process (an instance, or a warm spare of its runtime) could not be started,
//! or did not become healthy. The pool tells a stop apart from a failure by the kind; every
//! failure goes into the Function's status in these words.

use std::{path::PathBuf, process::ExitStatus, time::Duration};

/// Why a function process could not be started.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A file or directory the process needs could not be made, opened or written.
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// `create`, `open`, `write`.
        action: &'static str,
        /// What.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The runtime's program could not be run.
    #[error("cannot run {}: {source}", program.display())]
    Run {
        /// The program.
        program: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A pipe to or from the process failed.
    #[error("{what}: {source}")]
    Pipe {
        /// What was being done.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The process got no pipe for its stdin.
    #[error("the process has no stdin")]
    NoStdin,
    /// Its cgroup could not be made or joined.
    #[error(transparent)]
    Cgroup(#[from] eddy_platform::Error),
    /// What it is handed on stdin is JSON, and this is not UTF-8.
    #[error("{0} is not UTF-8")]
    NotUtf8(String),
    /// The hand-over could not be written as JSON.
    #[error("cannot write the hand-over: {0}")]
    Json(#[from] serde_json::Error),
    /// The spare's output was closed before it became an instance.
    #[error("the spare's output has closed")]
    SpareGone,
    /// The instance was stopped before it answered: not a failure.
    #[error("stopped while starting")]
    Stopped,
    /// The instance exited before it answered `/healthz`.
    #[error("instance exited during start-up ({status}); see `eddy logs {function}`")]
    Exited {
        /// How it exited.
        status: ExitStatus,
        /// Its Function.
        function: String,
    },
    /// The instance did not answer `/healthz` in time.
    #[error("instance did not answer /healthz within {0:?}")]
    Unhealthy(Duration),
}
