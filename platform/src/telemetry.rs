//! Logging (and, when configured, trace export) set up once per process, shared by every
//! binary.

use tracing_subscriber::{EnvFilter, Layer as _, filter, fmt, prelude::*};

use crate::traces::{self, TraceArgs, Traces};

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
    /// Installs the global subscriber, with the span exporter when `traces` names an endpoint
    /// (spans of [`traces::TARGET`] only; `service` is the default `service.name`). The guard
    /// it returns flushes the exporter when dropped. Calling it twice keeps the first setup.
    pub fn init(&self, traces: &TraceArgs, service: &str) -> crate::Result<Option<Traces>> {
        self.init_to(traces, service, None)
    }

    /// [`Self::init`], with the log lines appended to `file` instead of stderr when given
    /// (`eddy up` keeps the terminal for its status lines).
    pub fn init_to(
        &self,
        traces: &TraceArgs,
        service: &str,
        file: Option<&std::path::Path>,
    ) -> crate::Result<Option<Traces>> {
        let filter = EnvFilter::try_new(&self.log_level)
            .map_err(|error| crate::Error::LogFilter(error.to_string()))?;
        let writer = match file {
            Some(path) => {
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|source| crate::Error::LogFile {
                        path: path.to_owned(),
                        source,
                    })?;
                // `&File` writes: one write per line, no lock of our own.
                fmt::writer::BoxMakeWriter::new(std::sync::Arc::new(file))
            }
            None => fmt::writer::BoxMakeWriter::new(std::io::stderr),
        };
        // Colour codes only for a person at a terminal: not in a file, a pipe, a CI log or a
        // pod's log.
        let ansi = file.is_none() && std::io::IsTerminal::is_terminal(&std::io::stderr());
        let Some((tracer, guard)) = traces::start(traces, service)? else {
            // Without traces the filter stays global: spans and events it rejects cost nothing.
            let _ = tracing_subscriber::registry()
                .with(filter)
                .with(log_layer(self.log_format, writer, ansi))
                .try_init();
            return Ok(None);
        };
        // With traces, each layer filters on its own: the log level never hides a trace span,
        // and only trace spans are exported.
        let exported = filter::filter_fn(|metadata| metadata.target() == traces::TARGET);
        let installed = tracing_subscriber::registry()
            .with(log_layer(self.log_format, writer, ansi).with_filter(filter))
            .with(
                tracing_opentelemetry::layer()
                    .with_tracer(tracer)
                    .with_filter(exported),
            )
            .try_init();
        // Already installed (tests, or `eddy up` running several components): keep it.
        Ok(installed.is_ok().then_some(guard))
    }
}

/// The log lines' layer, to `writer` in `format` (colours only for a terminal's stderr).
fn log_layer<S>(
    format: LogFormat,
    writer: fmt::writer::BoxMakeWriter,
    ansi: bool,
) -> Box<dyn tracing_subscriber::Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    match format {
        LogFormat::Compact => {
            let layer = fmt::layer().compact().with_writer(writer);
            // A file gets no colour codes; a terminal keeps the default (which honours NO_COLOR).
            if ansi {
                layer.boxed()
            } else {
                layer.with_ansi(false).boxed()
            }
        }
        LogFormat::Json => fmt::layer()
            .json()
            .flatten_event(true)
            .with_writer(writer)
            .boxed(),
    }
}
