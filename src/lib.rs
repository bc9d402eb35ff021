//! `eddy`: the one binary's code as a library, so tests wire the platform with the code `eddy up`
//! runs. Service subcommands run one component each (for containers and for tests that kill one
//! component); client verbs talk to a running platform.

pub mod bench;
pub mod cli;
pub mod local;
pub mod nats_auth;
pub mod terminal;
pub mod up;

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use eddy_platform::{telemetry::LogArgs, traces::TraceArgs};

/// eddy: an event-driven function platform.
#[derive(Debug, Parser)]
#[command(name = "eddy", version, about)]
pub struct Cli {
    /// Logging flags.
    #[command(flatten)]
    pub log: LogArgs,
    /// Trace export flags (services, `up` and `bench`).
    #[command(flatten)]
    pub traces: TraceArgs,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands of `eddy token`.
#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Print the digest of a token, as `spec.access.tokenDigests` takes it (the token itself is
    /// never stored).
    Digest {
        /// The token callers will send as `Authorization: Bearer <token>`.
        token: String,
    },
}

/// Subcommands of `eddy controller`.
#[derive(Debug, Subcommand)]
pub enum ControllerCommand {
    /// Print the Kubernetes objects the controller would create for the Functions in a
    /// manifest (a dry run; nothing is sent anywhere).
    Render {
        /// A YAML/JSON file (several documents allowed) or a directory of them.
        #[arg(short = 'f', long = "filename")]
        file: PathBuf,
        /// Settings of the Kubernetes backend.
        #[command(flatten)]
        kubernetes: eddy_controller::KubernetesArgs,
    },
}

/// The commands of `eddy`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run everything on this machine: nats-server, event-bus, controller (API, dashboard,
    /// builds, gateway) and dispatcher.
    Up(Box<up::Args>),
    /// Run the event-bus: the HTTP publish endpoint in front of JetStream.
    EventBus(eddy_event_bus::Args),
    /// Run the dispatcher: delivers subscribed events to their sinks.
    Dispatcher(eddy_dispatcher::Args),
    /// Run the controller: the resource API and the reconcilers.
    #[command(args_conflicts_with_subcommands = true)]
    Controller {
        /// The subcommand.
        #[command(subcommand)]
        command: Option<ControllerCommand>,
        /// The controller's flags.
        #[command(flatten)]
        args: Box<eddy_controller::Args>,
    },
    /// Run the gateway on Kubernetes: `/<namespace>/<function>` to the function Services, with
    /// each Function's `access` enforced (`eddy up` runs its own gateway locally).
    Gateway(eddy_gateway::kubernetes::GatewayArgs),
    /// Print the CustomResourceDefinitions of Function and Subscription (YAML).
    Crds {
        /// Kyma's kinds instead (serverless.kyma-project.io/v1alpha2 Function,
        /// eventing.kyma-project.io/v1alpha2 Subscription) with eddy's schema, as the chart's
        /// `kymaCompatibility` serves them.
        #[arg(long)]
        kyma: bool,
    },
    /// Tokens for a Function's `access`.
    Token {
        /// The subcommand.
        #[command(subcommand)]
        command: TokenCommand,
    },
    /// Publish one event to the event-bus (binary mode).
    Publish(cli::publish::Args),
    /// Create or update the resources in a manifest file or directory.
    Apply {
        /// A YAML/JSON file (several documents allowed) or a directory of them.
        #[arg(short = 'f', long = "filename")]
        file: PathBuf,
        /// Where the API is and how to authenticate.
        #[command(flatten)]
        api: cli::resources::ApiArgs,
    },
    /// Print the eddy-native form of Kyma manifests (other manifests unchanged).
    Convert {
        /// A YAML/JSON file (several documents allowed) or a directory of them.
        #[arg(short = 'f', long = "filename")]
        file: PathBuf,
    },
    /// Show resources.
    Get {
        /// functions, subscriptions, secrets or configmaps.
        kind: cli::resources::Kind,
        /// One resource; all when left out.
        name: Option<String>,
        /// Every namespace.
        #[arg(short = 'A', long = "all-namespaces")]
        all_namespaces: bool,
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: cli::resources::Output,
        /// After the list, print each resource again whenever it appears or changes, until
        /// Ctrl-C (as `kubectl get -w`).
        #[arg(short = 'w', long = "watch", env = "EDDY_WATCH")]
        watch: bool,
        /// Where the API is and how to authenticate.
        #[command(flatten)]
        api: cli::resources::ApiArgs,
    },
    /// Delete resources, by name or by manifest.
    Delete {
        /// functions, subscriptions, secrets or configmaps.
        kind: Option<cli::resources::Kind>,
        /// The resource.
        name: Option<String>,
        /// Delete what a manifest file or directory names.
        #[arg(short = 'f', long = "filename")]
        file: Option<PathBuf>,
        /// Where the API is and how to authenticate.
        #[command(flatten)]
        api: cli::resources::ApiArgs,
    },
    /// Print a function's logs (stdout and stderr of its instances).
    Logs {
        /// The function.
        name: String,
        /// Keep printing new lines.
        #[arg(short = 'f', long)]
        follow: bool,
        /// Where the API is and how to authenticate.
        #[command(flatten)]
        api: cli::resources::ApiArgs,
    },
    /// Call a function through the gateway and print its answer.
    Invoke {
        /// What to call and with what.
        #[command(flatten)]
        invoke: cli::functions::InvokeArgs,
        /// Where the API is and how to authenticate.
        #[command(flatten)]
        api: cli::resources::ApiArgs,
    },
    /// Scaffold a function: NAME/function.yaml with a handler to edit.
    Init {
        /// The function's name.
        name: String,
        /// nodejs20, nodejs22, nodejs24, nodejs26, python311, python312 or python314.
        #[arg(long, default_value = "nodejs26")]
        runtime: String,
        /// Namespace written into the manifest.
        #[arg(long = "namespace", short = 'n', default_value = "default")]
        namespace: String,
        /// Where to create the folder.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
    /// Measure eddy and print figures.
    Bench(bench::Args),
    /// Dead letters: events that could not be delivered.
    Dlq {
        /// The subcommand.
        #[command(subcommand)]
        command: DlqCommand,
        /// Where the dispatcher's admin API is.
        #[command(flatten)]
        dispatcher: cli::dlq::DispatcherArgs,
        /// Namespace of the subscription.
        #[arg(
            long = "namespace",
            short = 'n',
            env = "EDDY_NAMESPACE",
            default_value = "default",
            global = true
        )]
        namespace: String,
    },
    /// Deliver stored events again to one subscription (no other is touched).
    Replay {
        /// The subscription.
        subscription: String,
        /// Events stored within this long ago (e.g. 10m, 2h).
        #[arg(
            long,
            conflicts_with = "from_seq",
            required_unless_present = "from_seq"
        )]
        since: Option<String>,
        /// Events from this stream sequence on.
        #[arg(long = "from-seq")]
        from_seq: Option<u64>,
        /// Where the dispatcher's admin API is.
        #[command(flatten)]
        dispatcher: cli::dlq::DispatcherArgs,
        /// Namespace of the subscription.
        #[arg(
            long = "namespace",
            short = 'n',
            env = "EDDY_NAMESPACE",
            default_value = "default"
        )]
        namespace: String,
    },
}

/// Subcommands of `eddy dlq`.
#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List dead letters, of one subscription or all.
    List {
        /// The subscription.
        subscription: Option<String>,
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: cli::resources::Output,
    },
    /// Deliver a subscription's dead letters to its sink again; delivered ones leave dead letters.
    Redrive {
        /// The subscription.
        subscription: String,
    },
}

/// The `service.name` of a command that serves (and so traces), by default.
fn traced_service(command: &Command) -> Option<&'static str> {
    match command {
        Command::Up(_) | Command::Bench(_) => Some("eddy"),
        Command::EventBus(_) => Some("eddy-event-bus"),
        Command::Dispatcher(_) => Some("eddy-dispatcher"),
        Command::Gateway(_) => Some("eddy-gateway"),
        Command::Controller { command: None, .. } => Some("eddy-controller"),
        _ => None,
    }
}

/// Runs one command line.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let Cli {
        mut log,
        traces,
        command,
    } = cli;
    // Benchmarks print figures; keep component logs out of them unless asked for.
    if matches!(command, Command::Bench(_))
        && std::env::var_os("EDDY_LOG").is_none()
        && log.log_level == "info"
    {
        log.log_level = "warn".to_owned();
    }
    // Only the services trace (a client verb has nothing to export); the guard flushes the
    // exporter when the command ends.
    // `eddy up` keeps the terminal for its status lines and build progress.
    let log_file = match &command {
        Command::Up(args) => up::log_file(args)?,
        _ => None,
    };
    let traces = match traced_service(&command) {
        Some(service) => log.init_to(&traces, service, log_file.as_deref())?,
        None => log.init(&TraceArgs::default(), "eddy")?,
    };
    if matches!(
        command,
        Command::EventBus(_)
            | Command::Dispatcher(_)
            | Command::Gateway(_)
            | Command::Controller { command: None, .. }
            | Command::Up(_)
    ) {
        eddy_platform::process::harden();
    } else {
        eddy_platform::process::quiet_on_closed_pipe();
    }
    match command {
        Command::EventBus(args) => {
            let shutdown = eddy_platform::shutdown::on_signal();
            eddy_event_bus::run(args, shutdown).await?;
        }
        Command::Dispatcher(args) => {
            let shutdown = eddy_platform::shutdown::on_signal();
            eddy_dispatcher::run(args, shutdown).await?;
        }
        Command::Gateway(args) => {
            let shutdown = eddy_platform::shutdown::on_signal();
            eddy_gateway::kubernetes::run(args, shutdown).await?;
        }
        Command::Controller {
            command: None,
            args,
        } => {
            let shutdown = eddy_platform::shutdown::on_signal();
            local::run(*args, shutdown).await?;
        }
        Command::Controller {
            command: Some(ControllerCommand::Render { file, kubernetes }),
            ..
        } => print!("{}", cli::resources::render(&file, &kubernetes).await?),
        Command::Crds { kyma: false } => print!("{}", eddy_model::resources::crds_yaml()?),
        Command::Crds { kyma: true } => print!("{}", eddy_model::kyma::crds_yaml()?),
        Command::Token {
            command: TokenCommand::Digest { token },
        } => println!("{}", eddy_platform::auth::Tokens::digest_text(&token)),
        Command::Up(args) => up::run(*args).await?,
        Command::Publish(args) => cli::publish::run(args).await?,
        Command::Apply { file, api } => cli::resources::apply(&api, &file).await?,
        Command::Convert { file } => print!("{}", cli::resources::convert(&file)?),
        Command::Get {
            kind,
            name,
            all_namespaces,
            output,
            watch,
            api,
        } => {
            cli::resources::get(&api, kind, name.as_deref(), all_namespaces, output, watch).await?;
        }
        Command::Delete {
            kind,
            name,
            file,
            api,
        } => {
            cli::resources::delete(&api, kind, name.as_deref(), file.as_ref()).await?;
        }
        Command::Logs { name, follow, api } => cli::functions::logs(&api, &name, follow).await?,
        Command::Invoke { invoke, api } => cli::functions::invoke(&api, invoke).await?,
        Command::Init {
            name,
            runtime,
            namespace,
            dir,
        } => cli::functions::init(&name, &runtime, &namespace, &dir)?,
        Command::Bench(args) => bench::run(args).await?,
        Command::Dlq {
            command,
            dispatcher,
            namespace,
        } => match command {
            DlqCommand::List {
                subscription,
                output,
            } => {
                cli::dlq::list(&dispatcher, &namespace, subscription.as_deref(), output).await?;
            }
            DlqCommand::Redrive { subscription } => {
                cli::dlq::redrive(&dispatcher, &namespace, &subscription).await?
            }
        },
        Command::Replay {
            subscription,
            since,
            from_seq,
            dispatcher,
            namespace,
        } => {
            cli::dlq::replay(
                &dispatcher,
                &namespace,
                &subscription,
                since.as_deref(),
                from_seq,
            )
            .await?;
        }
    }
    drop(traces);
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]

    use clap::Parser as _;

    use super::*;

    fn parse(line: &[&str]) -> Command {
        Cli::try_parse_from(line).unwrap().command
    }

    fn same<T: std::fmt::Debug>(parsed: &T, built: &T) {
        assert_eq!(format!("{parsed:#?}"), format!("{built:#?}"));
    }

    /// The arguments code builds by hand (`Args::new`, the groups' `Default`) are what an empty
    /// command line gives: flag defaults are written once.
    #[test]
    fn defaults_match_an_empty_command_line() {
        let Command::EventBus(bus) = parse(&["eddy", "event-bus"]) else {
            panic!("not the event-bus");
        };
        same(
            &bus,
            &eddy_event_bus::Args::new(bus.addr, bus.nats.nats_url.clone()),
        );
        same(&bus.stream, &eddy_platform::nats::StreamArgs::default());
        same(&bus.serve, &eddy_platform::net::ServeArgs::default());

        let Command::Dispatcher(dispatcher) = parse(&["eddy", "dispatcher"]) else {
            panic!("not the dispatcher");
        };
        same(
            &dispatcher,
            &eddy_dispatcher::Args::new(dispatcher.addr, dispatcher.nats.nats_url.clone()),
        );

        let Command::Controller { args, .. } = parse(&["eddy", "controller"]) else {
            panic!("not the controller");
        };
        same(
            &*args,
            &eddy_controller::Args::new(args.api_addr, args.nats.nats_url.clone()),
        );
        same(
            &args.kubernetes,
            &eddy_controller::KubernetesArgs::default(),
        );

        let Command::Up(up) = parse(&["eddy", "up"]) else {
            panic!("not up");
        };
        same(&*up, &eddy_platform::flags::defaults::<up::Args>());
    }
}
