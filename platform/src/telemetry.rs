//! Logging setup shared by every binary.

use tracing_subscriber::{EnvFilter, fmt, prelude::*};

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable, one line per event.
    Compact,
    /// One JSON object per line, for log shippers.
    Json,
}

/// Logging flags, flattened into every command that runs a service.
#[derive(Debug, Clone, clap::Args)]
pub struct LogArgs {
    /// Log filter in `tracing` syntax, e.g. `info,eddy_event_bus=debug`.
    #[arg(
        long = "log-level",
        env = "EDDY_LOG",
        default_value = "info",
        global = true
    )]
    pub log_level: String,
    /// Log format.
    #[arg(
        long = "log-format",
        env = "EDDY_LOG_FORMAT",
        value_enum,
        default_value = "compact",
        global = true
    )]
    pub log_format: LogFormat,
}

impl LogArgs {
    /// Installs the global subscriber. Calling it twice keeps the first one.
    pub fn init(&self) -> crate::Result<()> {
        let filter = EnvFilter::try_new(&self.log_level)
            .map_err(|error| crate::Error::LogFilter(error.to_string()))?;
        let registry = tracing_subscriber::registry().with(filter);
        let installed = match self.log_format {
            LogFormat::Compact => registry
                .with(fmt::layer().compact().with_writer(std::io::stderr))
                .try_init(),
            LogFormat::Json => registry
                .with(
                    fmt::layer()
                        .json()
                        .flatten_event(true)
                        .with_writer(std::io::stderr),
                )
                .try_init(),
        };
        // Already installed (tests, or `eddy up` running several components): keep it.
        let _ = installed;
        Ok(())
    }
}
