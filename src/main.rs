//! `eddy`: the one binary. Service subcommands run one component each (for containers and for
//! tests that kill one component); client verbs talk to a running platform.

mod cli;
mod up;

use clap::{Parser, Subcommand};
use eddy_api::telemetry::LogArgs;

/// eddy: an event-driven function platform.
#[derive(Debug, Parser)]
#[command(name = "eddy", version, about)]
struct Cli {
    #[command(flatten)]
    log: LogArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run everything on this machine: nats-server, event-bus (and, as they land, the rest).
    Up(up::Args),
    /// Run the event-bus: the HTTP publish endpoint in front of JetStream.
    EventBus(eddy_event_bus::Args),
    /// Publish one event to the event-bus (binary mode).
    Publish(cli::publish::Args),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let Cli { log, command } = Cli::parse();
    log.init()?;
    match command {
        Command::EventBus(args) => {
            let shutdown = eddy_api::shutdown::on_signal();
            eddy_event_bus::run(args, shutdown).await?;
        }
        Command::Up(args) => up::run(args).await?,
        Command::Publish(args) => cli::publish::run(args).await?,
    }
    Ok(())
}
