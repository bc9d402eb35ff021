//! `eddy bench`: programs that measure eddy and print figures (never timed tests).
//!
//! Each scenario starts its own platform (nats-server as a child, every component in-process,
//! free ports, a temporary data dir), so figures come from one known setup.

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use eddy_model::{
    conditions::{ConditionType, Reason},
    resources::{Condition, Function, Runtime},
};
use serde_json::{Value, json};

use crate::up::{self, Platform};
use eddy_platform::shutdown::CancellationToken;

mod buildless;
mod e2e;
mod forwarder;
mod load;
mod real_node;
mod scale;
mod soak;

/// Flags of `eddy bench`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// What to measure.
    #[command(subcommand)]
    pub scenario: Scenario,
}

/// Flags of the throughput scenarios.
#[derive(Debug, clap::Args)]
pub struct LoadFlags {
    /// Concurrent connections (HTTP) or workers (raw NATS).
    #[arg(long, default_value_t = 32)]
    pub connections: usize,
    /// How long each measurement runs.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Bytes of data per event.
    #[arg(long, default_value_t = 1024)]
    pub size: usize,
    /// Also write the figures as JSON here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The nats-server binary (default: PATH, then .tools/venv/bin).
    #[arg(long = "nats-server", env = "EDDY_NATS_SERVER")]
    pub nats_server: Option<PathBuf>,
    /// Rounds (ingest): each measures every contender once, one after the other, so a machine
    /// that slows down or speeds up moves all of them; the spread is printed.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Publish over HTTP/2 (ingest): prior knowledge, one connection carrying `--connections`
    /// streams.
    #[arg(long)]
    pub http2: bool,
    /// The event-bus's log filter (ingest). `warn` keeps logging out of the figures; `info`
    /// (the event-bus's default) measures what its per-request log span costs.
    #[arg(
        long = "event-bus-log-level",
        env = "EDDY_BENCH_EVENT_BUS_LOG_LEVEL",
        default_value = "warn"
    )]
    pub event_bus_log_level: String,
}

impl LoadFlags {
    fn load_args(&self) -> load::LoadArgs {
        load::LoadArgs {
            connections: self.connections,
            duration: self.duration,
            size: self.size,
            nats_server: self.nats_server.clone(),
            rounds: self.rounds,
            http2: self.http2,
            event_bus_log_level: self.event_bus_log_level.clone(),
        }
    }
}

/// Benchmark scenarios.
#[derive(Debug, clap::Subcommand)]
pub enum Scenario {
    /// HTTP publish through the event-bus against async-nats publishing the same events.
    Ingest(LoadFlags),
    /// The same with batches of 100 events.
    IngestBatch(LoadFlags),
    /// Publish → nodejs20 no-op function: maximum sustained rate, latency at fixed rates.
    E2e(LoadFlags),
    /// Stored events delivered to a no-op sink, against the limits of its parts.
    Dispatch {
        /// Where and how to run.
        #[command(flatten)]
        flags: LoadFlags,
        /// Events to store and deliver.
        #[arg(long, default_value_t = 20_000)]
        events: u64,
        /// The Subscription's maxInFlightMessages (and the raw runs' concurrency).
        #[arg(long = "in-flight", default_value_t = 64)]
        in_flight: usize,
    },
    /// The minimal HTTP → JetStream forwarder `ingest` measures against (run by the bench).
    #[command(hide = true)]
    Forwarder {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:0")]
        addr: std::net::SocketAddr,
        /// NATS to publish to.
        #[arg(long = "nats-url")]
        nats_url: String,
    },
    /// An OTLP/HTTP receiver that takes every export and keeps nothing, for measuring what
    /// traces cost (`EDDY_OTLP_ENDPOINT=<its url> eddy bench ingest`); prints the spans' bytes
    /// received when stopped.
    OtlpSink {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:4318")]
        addr: std::net::SocketAddr,
    },
    /// The full path (publish → function → its reply → a second function) for a long time at
    /// half the maximum sustained rate: rate, latency and memory every 10 s, every event
    /// accounted for at the end.
    Soak {
        /// How long to soak (after measuring the maximum rate for 10 s).
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        duration: Duration,
        /// Events per second to offer (default: half the maximum sustained rate).
        #[arg(long)]
        rate: Option<u64>,
        /// Publishers while measuring the maximum rate.
        #[arg(long, default_value_t = 16)]
        connections: usize,
        /// Also write the figures as JSON here.
        #[arg(long)]
        out: Option<PathBuf>,
        /// The nats-server binary (default: PATH, then .tools/venv/bin).
        #[arg(long = "nats-server", env = "EDDY_NATS_SERVER")]
        nats_server: Option<PathBuf>,
    },
    /// Replicas simulated on this machine: 1, 2, 4 … event-bus processes behind one port
    /// (SO_REUSEPORT) and dispatchers on one consumer, with events/s per busy core; NATS alone on
    /// one stream, R1 and a three-server R3 cluster.
    ScaleOut {
        /// Process counts to measure.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
        processes: Vec<usize>,
        /// Publishing connections (HTTP) and raw publishers.
        #[arg(long, default_value_t = 64)]
        connections: usize,
        /// How long each publishing measurement runs.
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        duration: Duration,
        /// Events stored and delivered per dispatcher measurement.
        #[arg(long, default_value_t = 200_000)]
        events: u64,
        /// The Subscription's maxInFlightMessages (shared by every dispatcher on its consumer).
        #[arg(long = "in-flight", default_value_t = 64)]
        in_flight: usize,
        /// Bytes of data per event.
        #[arg(long, default_value_t = 1024)]
        size: usize,
        /// Also write the figures as JSON here.
        #[arg(long)]
        out: Option<PathBuf>,
        /// The nats-server binary (default: PATH, then .tools/venv/bin).
        #[arg(long = "nats-server", env = "EDDY_NATS_SERVER")]
        nats_server: Option<PathBuf>,
    },
    /// A buildless pod's start (install at start) against an image build's, nodejs22: spawn →
    /// first answer, with the runtime's server and the install script pods run.
    Buildless {
        /// Runs per case.
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// The function's package.json (its dependencies).
        #[arg(long, default_value = r#"{"dependencies": {"lodash": "^4.17.21"}}"#)]
        dependencies: String,
        /// Where the runtime's libraries are installed (kept between runs).
        #[arg(long = "runtimes-dir", env = "EDDY_RUNTIMES_DIR")]
        runtimes_dir: Option<PathBuf>,
    },
    /// The chart on a real node (scripts/kube up --node real, the current kubeconfig): a
    /// buildless Function's apply → Running without and with a dependency, and publish →
    /// function latency at a fixed rate through the pods.
    RealNode {
        /// Events per second offered.
        #[arg(long, default_value_t = 50)]
        rate: u64,
        /// How long events are offered.
        #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
        duration: Duration,
        /// Apply → Running runs per case.
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// The namespace eddy's chart runs in.
        #[arg(long = "system-namespace", default_value = "eddy-system")]
        system_namespace: String,
    },
    /// Deploy → ready, and first response from zero instances, per runtime.
    Coldstart {
        /// Runs per runtime and measure.
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// Runtimes to measure.
        #[arg(
            long = "runtime",
            value_delimiter = ',',
            default_value = "nodejs20,nodejs22,nodejs24,python311,python312"
        )]
        runtimes: Vec<String>,
        /// Also write the figures as JSON here.
        #[arg(long)]
        out: Option<PathBuf>,
        /// The nats-server binary (default: PATH, then .tools/venv/bin).
        #[arg(long = "nats-server", env = "EDDY_NATS_SERVER")]
        nats_server: Option<PathBuf>,
        /// Warm spares per runtime, as `eddy up --warm-spares` (0: every start is cold).
        #[arg(long = "warm-spares", default_value_t = 1)]
        warm_spares: usize,
    },
}

/// Runs a scenario.
pub async fn run(args: Args) -> anyhow::Result<()> {
    match args.scenario {
        Scenario::Coldstart {
            runs,
            runtimes,
            out,
            nats_server,
            warm_spares,
        } => coldstart(runs, &runtimes, out, nats_server, warm_spares).await,
        Scenario::Buildless {
            runs,
            dependencies,
            runtimes_dir,
        } => {
            let data_dir = tempfile::tempdir().context("cannot create a temporary data dir")?;
            let runtimes = runtimes_dir.unwrap_or_else(|| data_dir.path().join("runtimes"));
            buildless::run(runs, &dependencies, data_dir.path(), &runtimes).await
        }
        Scenario::RealNode {
            rate,
            duration,
            runs,
            system_namespace,
        } => {
            real_node::run(real_node::Settings {
                rate,
                duration,
                system_namespace,
                runs,
            })
            .await
        }
        Scenario::Ingest(flags) => ingest(&flags, 1).await,
        Scenario::IngestBatch(flags) => ingest(&flags, 100).await,
        Scenario::Dispatch {
            flags,
            events,
            in_flight,
        } => dispatch(&flags, events, in_flight).await,
        Scenario::ScaleOut {
            processes,
            connections,
            duration,
            events,
            in_flight,
            size,
            out,
            nats_server,
        } => {
            let args = scale::ScaleArgs {
                processes,
                connections,
                duration,
                events,
                in_flight,
                size,
                nats_server,
            };
            scale_out(&args, out.as_ref()).await
        }
        Scenario::E2e(flags) => end_to_end(&flags).await,
        Scenario::Forwarder { addr, nats_url } => forwarder::run(addr, &nats_url).await,
        Scenario::OtlpSink { addr } => otlp_sink(addr).await,
        Scenario::Soak {
            duration,
            rate,
            connections,
            out,
            nats_server,
        } => soak_test(duration, rate, connections, out, nats_server).await,
    }
}

async fn soak_test(
    duration: Duration,
    rate: Option<u64>,
    connections: usize,
    out: Option<PathBuf>,
    nats_server: Option<PathBuf>,
) -> anyhow::Result<()> {
    let data_dir = tempfile::tempdir().context("cannot create a temporary data dir")?;
    let platform = Platform::start(
        &bench_platform_args(data_dir.path(), nats_server),
        false,
        &CancellationToken::new(),
    )
    .await?;
    let result = soak::run(&platform, data_dir.path(), duration, rate, connections).await;
    platform.stop(false).await;
    let soak = result?;
    let minute = 6.min(soak.windows.len());
    let p99 = |windows: &[soak::Window]| {
        windows
            .iter()
            .map(|window| window.p99_ms)
            .fold(0.0_f64, f64::max)
    };
    let first_minute = p99(soak.windows.get(..minute).unwrap_or_default());
    let last_minute = p99(soak
        .windows
        .get(soak.windows.len().saturating_sub(minute)..)
        .unwrap_or_default());
    let total = |window: Option<&soak::Window>| {
        window.map_or(0.0, |w| w.rss_mib.iter().map(|(_, mib)| mib).sum::<f64>())
    };
    let warmed = total(soak.windows.get(minute.saturating_sub(1)));
    let last = total(soak.windows.last());
    println!(
        "published {} (errors {}), delivered to the second function {} (duplicates {}, strays {}), dead letters {}",
        soak.published,
        soak.publish_errors,
        soak.delivered,
        soak.duplicates,
        soak.strays,
        soak.dead_letters
    );
    let accounted = soak.publish_errors == 0
        && soak.delivered == soak.published
        && soak.duplicates == 0
        && soak.strays == 0
        && soak.dead_letters == 0;
    println!(
        "every event accounted for: {}",
        if accounted { "yes" } else { "NO" }
    );
    println!(
        "worst window p99: first minute {first_minute:.2} ms, last minute {last_minute:.2} ms ({:.2}×)",
        last_minute / first_minute.max(1e-9)
    );
    println!(
        "resident memory, all processes: {warmed:.0} MiB after the first minute, {last:.0} MiB at the end ({:+.0} MiB)",
        last - warmed
    );
    write_json(
        out.as_ref(),
        &json!({"scenario": "soak", "soak": soak,
        "p99FirstMinuteMs": first_minute, "p99LastMinuteMs": last_minute,
        "rssAfterFirstMinuteMiB": warmed, "rssAtEndMiB": last, "accounted": accounted}),
    )?;
    if !accounted {
        anyhow::bail!("events were lost, duplicated or dead-lettered");
    }
    Ok(())
}

/// `eddy up`'s settings for a benchmark: every listener on a free loopback port, functions
/// that stay up.
fn bench_platform_args(data_dir: &std::path::Path, nats_server: Option<PathBuf>) -> up::Args {
    up::Args {
        data_dir: data_dir.to_path_buf(),
        nats_server,
        bus_addr: local(0),
        gateway_addr: local(0),
        api_addr: local(0),
        dispatcher_addr: local(0),
        functions: eddy_controller::FunctionArgs {
            scale_to_zero_after: Duration::from_secs(3600),
            ..Default::default()
        },
        ..eddy_platform::flags::defaults()
    }
}

async fn end_to_end(flags: &LoadFlags) -> anyhow::Result<()> {
    let data_dir = tempfile::tempdir().context("cannot create a temporary data dir")?;
    let args = bench_platform_args(data_dir.path(), flags.nats_server.clone());
    let platform = Platform::start(&args, false, &CancellationToken::new()).await?;
    let result = e2e::run(
        &platform,
        data_dir.path(),
        flags.duration,
        flags.connections,
    )
    .await;
    platform.stop(false).await;
    let measured = result?;
    println!(
        "e2e: publish -> nodejs20 no-op function ({} connections for the closed loop, {:?} per rate)",
        flags.connections, flags.duration
    );
    println!(
        "closed loop (where the search starts): {:.0} events/s",
        measured.closed_loop_rate
    );
    for probe in &measured.probes {
        println!(
            "  offered {:>6}/s for {:?}: {:>6} left behind, {}",
            probe.rate,
            flags.duration,
            probe.backlog,
            if probe.sustained {
                "sustained"
            } else {
                "falling behind"
            }
        );
    }
    println!("maximum sustained rate: {:.0} events/s", measured.max_rate);
    println!(
        "{:>10} {:>8} {:>10} {:>10} {:>10}",
        "rate/s", "count", "p50 ms", "p99 ms", "p999 ms"
    );
    for latency in &measured.latencies {
        println!(
            "{:>10} {:>8} {:>10.2} {:>10.2} {:>10.2}",
            latency.rate, latency.count, latency.p50_ms, latency.p99_ms, latency.p999_ms
        );
    }
    write_json(
        flags.out.as_ref(),
        &json!({"scenario": "e2e", "maxRate": measured.max_rate,
            "closedLoopRate": measured.closed_loop_rate, "probes": measured.probes,
            "latencies": measured.latencies}),
    )
}

fn print_rates(title: &str, rates: &[&load::Rate]) {
    println!("{title}");
    println!(
        "{:<34} {:>12} {:>10} {:>10} {:>10}",
        "", "events/s", "p50 ms", "p99 ms", "count"
    );
    for rate in rates {
        // A rate timed as a whole has no per-operation latency: a dash, not a zero.
        let (p50, p99) = if rate.latency.p99_ms > 0.0 {
            (
                format!("{:.2}", rate.latency.p50_ms),
                format!("{:.2}", rate.latency.p99_ms),
            )
        } else {
            ("-".to_owned(), "-".to_owned())
        };
        println!(
            "{:<34} {:>12.0} {:>10} {:>10} {:>10}",
            rate.name, rate.per_second, p50, p99, rate.count
        );
    }
}

fn write_json(out: Option<&PathBuf>, value: &Value) -> anyhow::Result<()> {
    if let Some(out) = out {
        std::fs::write(out, serde_json::to_string_pretty(value)?)
            .with_context(|| format!("cannot write {}", out.display()))?;
        println!("wrote {}", out.display());
    }
    Ok(())
}

async fn ingest(flags: &LoadFlags, batch: usize) -> anyhow::Result<()> {
    let (rounds, rss) = load::ingest(&flags.load_args(), batch).await?;
    let batched = if batch > 1 {
        format!(", batches of {batch} (latency per batch)")
    } else {
        String::new()
    };
    let protocol = if flags.http2 { "HTTP/2" } else { "HTTP/1.1" };
    println!(
        "ingest: {} B events, {} {}, {:?} each, {} rounds{batched}",
        flags.size,
        flags.connections,
        if flags.http2 {
            "streams on one HTTP/2 connection"
        } else {
            "connections"
        },
        flags.duration,
        rounds.len()
    );
    let mut to_forwarder = Vec::new();
    let mut to_raw = Vec::new();
    let mut cpu_to_forwarder = Vec::new();
    for (index, round) in rounds.iter().enumerate() {
        let mut rates = vec![&round.event_bus];
        rates.extend(round.forwarder.as_ref());
        rates.push(&round.raw);
        print_rates(&format!("round {}", index + 1), &rates);
        let bus = round.event_bus.per_second;
        if let Some(forwarder) = &round.forwarder {
            to_forwarder.push(bus / forwarder.per_second.max(1e-9));
        }
        print!("CPU per event: event-bus {:.1} µs", round.event_bus_cpu_us);
        if let Some(forwarder_cpu) = round.forwarder_cpu_us {
            print!(", forwarder {forwarder_cpu:.1} µs");
            cpu_to_forwarder.push(round.event_bus_cpu_us / forwarder_cpu.max(1e-9));
        }
        println!();
        to_raw.push(bus / round.raw.per_second.max(1e-9));
    }
    let to_forwarder = (!to_forwarder.is_empty()).then(|| spread(&to_forwarder));
    let cpu_to_forwarder = (!cpu_to_forwarder.is_empty()).then(|| spread(&cpu_to_forwarder));
    let to_raw = spread(&to_raw);
    if let Some(ratio) = &to_forwarder {
        println!("event-bus / forwarder ({protocol}): {}", show_spread(ratio));
    }
    if let Some(ratio) = &cpu_to_forwarder {
        println!(
            "event-bus CPU per event / forwarder's: {}",
            show_spread(ratio)
        );
    }
    println!("event-bus / raw: {}", show_spread(&to_raw));
    println!("event-bus peak RSS: {rss:.1} MiB");
    write_json(
        flags.out.as_ref(),
        &json!({"scenario": if batch > 1 { "ingest-batch" } else { "ingest" }, "size": flags.size,
            "connections": flags.connections, "http2": flags.http2, "batch": batch,
            "rounds": rounds, "eventBusToForwarder": to_forwarder, "eventBusToRaw": to_raw,
            "eventBusCpuToForwarder": cpu_to_forwarder,
            "eventBusPeakRssMiB": rss}),
    )
}

/// The median, least and greatest of per-round ratios, with the rounds themselves. Pure.
fn spread(ratios: &[f64]) -> Value {
    let mut sorted = ratios.to_vec();
    sorted.sort_by(f64::total_cmp);
    let middle = sorted.len() / 2;
    let median = if sorted.len().is_multiple_of(2) {
        match (sorted.get(middle.wrapping_sub(1)), sorted.get(middle)) {
            (Some(low), Some(high)) => (low + high) / 2.0,
            _ => 0.0,
        }
    } else {
        sorted.get(middle).copied().unwrap_or(0.0)
    };
    json!({
        "median": median,
        "min": sorted.first().copied().unwrap_or(0.0),
        "max": sorted.last().copied().unwrap_or(0.0),
        "rounds": ratios,
    })
}

async fn dispatch(flags: &LoadFlags, events: u64, in_flight: usize) -> anyhow::Result<()> {
    let (rounds, rss) = load::dispatch(&flags.load_args(), events, in_flight).await?;
    println!(
        "dispatch: {events} stored events of {} B, maxInFlightMessages {in_flight}, {} rounds",
        flags.size,
        rounds.len()
    );
    let mut to_min = Vec::new();
    let mut to_both = Vec::new();
    let mut to_cpu = Vec::new();
    for (index, round) in rounds.iter().enumerate() {
        print_rates(
            &format!("round {}", index + 1),
            &[&round.dispatcher, &round.ack_only, &round.http_only],
        );
        let limit = round.ack_only.per_second.min(round.http_only.per_second);
        let both = round.both_in_series();
        println!("both raw halves in series: {both:.0} events/s");
        for (phase, cpu) in ["dispatcher", "ack only", "HTTP only"]
            .iter()
            .zip(round.machine_cpu)
        {
            println!(
                "machine CPU per event, {phase}: {:.1} µs ({:.2} cores busy), of it dispatcher \
                 {:.1}, nats-server {:.1}, bench and sink {:.1}",
                cpu.us_per_op, cpu.cores_busy, cpu.eddy_us, cpu.nats_us, cpu.bench_us
            );
        }
        let cpu_to_halves = round.cpu_to_halves();
        println!("dispatcher / the two halves added: {cpu_to_halves:.2}");
        to_min.push(round.dispatcher.per_second / limit.max(1e-9));
        to_both.push(round.dispatcher.per_second / both.max(1e-9));
        to_cpu.push(cpu_to_halves);
    }
    let (to_min, to_both, to_cpu) = (spread(&to_min), spread(&to_both), spread(&to_cpu));
    println!("dispatcher / lower raw half: {}", show_spread(&to_min));
    println!(
        "dispatcher / both raw halves in series: {}",
        show_spread(&to_both)
    );
    println!(
        "machine CPU per event, dispatcher / the two halves added: {}",
        show_spread(&to_cpu)
    );
    println!("dispatcher peak RSS: {rss:.1} MiB");
    write_json(
        flags.out.as_ref(),
        &json!({"scenario": "dispatch", "events": events, "inFlight": in_flight, "rounds": rounds,
            "dispatcherToLowerHalf": to_min, "dispatcherToBothInSeries": to_both,
            "machineCpuDispatcherToHalves": to_cpu,
            "dispatcherPeakRssMiB": rss}),
    )
}

async fn scale_out(args: &scale::ScaleArgs, out: Option<&PathBuf>) -> anyhow::Result<()> {
    let cores = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    println!(
        "scale-out: {} B events, {} connections, maxInFlightMessages {} shared, {cores} cores",
        args.size, args.connections, args.in_flight
    );
    let points = scale::run(args).await?;
    println!(
        "{:<26} {:>9} {:>10} {:>7} {:>13} {:>11} {:>15} {:>11}",
        "",
        "processes",
        "events/s",
        "cores",
        "per core",
        "NATS cores",
        "per NATS core",
        "bench cores"
    );
    for point in &points {
        // NATS alone has no eddy process: a dash rather than zero cores.
        let (cores, per_core) = if point.cores > 0.0 {
            (
                format!("{:.2}", point.cores),
                format!("{:.0}", point.per_core),
            )
        } else {
            ("-".to_owned(), "-".to_owned())
        };
        println!(
            "{:<26} {:>9} {:>10.0} {:>7} {:>13} {:>11.2} {:>15.0} {:>11.2}",
            point.role,
            point.processes,
            point.per_second,
            cores,
            per_core,
            point.nats_cores,
            point.per_nats_core,
            point.bench_cores
        );
    }
    write_json(
        out,
        &json!({"scenario": "scale-out", "size": args.size, "connections": args.connections,
            "inFlight": args.in_flight, "cores": cores, "points": points}),
    )
}

async fn otlp_sink(addr: std::net::SocketAddr) -> anyhow::Result<()> {
    use std::sync::atomic::{AtomicU64, Ordering};
    let received = std::sync::Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
    let counted = received.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: bytes::Bytes| {
            let counted = counted.clone();
            async move {
                counted.0.fetch_add(1, Ordering::Relaxed);
                counted.1.fetch_add(body.len() as u64, Ordering::Relaxed);
                "{}"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("otlp-sink ready on http://{}", listener.local_addr()?);
    let shutdown = eddy_platform::shutdown::on_signal();
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await?;
    println!(
        "{} exports, {} bytes of spans",
        received.0.load(Ordering::Relaxed),
        received.1.load(Ordering::Relaxed)
    );
    Ok(())
}

/// `median (rounds min–max)` of a [`spread`].
fn show_spread(ratio: &Value) -> String {
    format!(
        "{:.2} (rounds {:.2}–{:.2})",
        ratio["median"].as_f64().unwrap_or(0.0),
        ratio["min"].as_f64().unwrap_or(0.0),
        ratio["max"].as_f64().unwrap_or(0.0)
    )
}

fn local(port: u16) -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], port))
}

/// Whether a consumer of `stream` has delivered everything it matches: nothing pending, nothing
/// unacknowledged, and acknowledged past the last stored event its filters match. The last
/// condition matters: JetStream counts a new event into `num_pending` just after acknowledging
/// its publish, so on a busy machine the first two alone can read "settled" before that event
/// (about 1 read in 100 right after a publish ack, measured under load).
pub async fn consumer_settled(
    stream: &async_nats::jetstream::stream::Stream,
    consumer: &str,
) -> anyhow::Result<bool> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    let info = stream.consumer_info(consumer).await?;
    if info.num_pending != 0 || info.num_ack_pending != 0 {
        return Ok(false);
    }
    let mut filters = info.config.filter_subjects.clone();
    if !info.config.filter_subject.is_empty() {
        filters.push(info.config.filter_subject.clone());
    }
    let mut last = 0;
    for filter in &filters {
        match stream.get_last_raw_message_by_subject(filter).await {
            Ok(message) => last = last.max(message.sequence),
            Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => {}
            Err(error) => return Err(error.into()),
        }
    }
    Ok(info.ack_floor.stream_sequence >= last)
}

/// Milliseconds summary of a list of durations.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Summary {
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Fastest.
    pub min_ms: f64,
    /// Slowest.
    pub max_ms: f64,
}

/// Summarizes durations (empty input gives zeros). Pure.
pub fn summarize(samples: &[Duration]) -> Summary {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| {
        ms.get(((ms.len().saturating_sub(1)) as f64 * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    Summary {
        p50_ms: at(0.5),
        p99_ms: at(0.99),
        min_ms: ms.first().copied().unwrap_or(0.0),
        max_ms: ms.last().copied().unwrap_or(0.0),
    }
}

fn handler(runtime: &str, run: usize) -> anyhow::Result<String> {
    // A comment with the run number makes every deploy a fresh build.
    Ok(match runtime {
        "nodejs20" | "nodejs22" | "nodejs24" => {
            format!("// run {run}\nmodule.exports = {{ main: async () => 'ok' }};\n")
        }
        "python311" | "python312" => {
            format!("# run {run}\ndef main(event, context):\n    return 'ok'\n")
        }
        other => bail!("unknown runtime {other:?}"),
    })
}

async fn function(http: &reqwest::Client, api: &str, name: &str) -> anyhow::Result<Function> {
    Ok(http
        .get(format!(
            "{api}/apis/eddy.dev/v1alpha1/namespaces/bench/functions/{name}"
        ))
        .send()
        .await?
        .json()
        .await?)
}

/// The Function's `Running` condition, when it has one.
fn running(function: &Function) -> Option<&Condition> {
    function
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == ConditionType::Running.as_str())
}

async fn wait_for(
    http: &reqwest::Client,
    api: &str,
    name: &str,
    what: &str,
    done: impl Fn(&Function) -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let current = function(http, api, name).await?;
        if done(&current) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{name} did not become {what} within 120s: {:?}",
                current.status
            );
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn coldstart(
    runs: usize,
    runtimes: &[String],
    out: Option<PathBuf>,
    nats_server: Option<PathBuf>,
    warm_spares: usize,
) -> anyhow::Result<()> {
    let data_dir = tempfile::tempdir().context("cannot create a temporary data dir")?;
    let args = up::Args {
        data_dir: data_dir.path().to_path_buf(),
        nats_server,
        bus_addr: local(0),
        gateway_addr: local(0),
        api_addr: local(0),
        dispatcher_addr: local(0),
        functions: eddy_controller::FunctionArgs {
            scale_to_zero_after: Duration::from_millis(300),
            warm_spares,
            ..Default::default()
        },
        ..eddy_platform::flags::defaults()
    };
    let platform = Platform::start(&args, false, &CancellationToken::new()).await?;
    let result = measure_coldstart(&platform, data_dir.path(), runs, runtimes).await;
    platform.stop(false).await;
    let figures = result?;
    println!(
        "cold start ({runs} runs each; {} cores; warm spares per runtime: {warm_spares})",
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    // Each cell formatted first, so the columns line up whatever the figures' widths.
    let cell = |s: &Summary| format!("{:.0} ms ({:.0}–{:.0})", s.p50_ms, s.min_ms, s.max_ms);
    println!(
        "{:<10} {:>26} {:>26} {:>26} {:>6}",
        "runtime",
        "deploy→ready p50 (min–max)",
        "from zero p50 (min–max)",
        "bare runtime p50 (min–max)",
        "ratio"
    );
    for figure in &figures {
        let (deploy, zero, floor) = (&figure.deploy, &figure.from_zero, &figure.floor);
        println!(
            "{:<10} {:>26} {:>26} {:>26} {:>5.1}×",
            figure.runtime,
            cell(deploy),
            cell(zero),
            cell(floor),
            zero.p50_ms / floor.p50_ms.max(f64::MIN_POSITIVE)
        );
    }
    if let Some(out) = out {
        let json: Vec<Value> = figures
            .iter()
            .map(|f| json!({"runtime": f.runtime, "deployToReady": f.deploy, "firstResponseFromZero": f.from_zero, "bareRuntime": f.floor}))
            .collect();
        std::fs::write(
            &out,
            serde_json::to_string_pretty(
                &json!({"scenario": "coldstart", "runs": runs, "warmSpares": warm_spares, "results": json}),
            )?,
        )
        .with_context(|| format!("cannot write {}", out.display()))?;
        println!("wrote {}", out.display());
    }
    Ok(())
}

/// One runtime's cold start figures.
struct Coldstart {
    runtime: String,
    deploy: Summary,
    from_zero: Summary,
    /// The same interpreter with a minimal HTTP server: spawn → first response.
    floor: Summary,
}

async fn measure_coldstart(
    platform: &Platform,
    data_dir: &std::path::Path,
    runs: usize,
    runtimes: &[String],
) -> anyhow::Result<Vec<Coldstart>> {
    let toolchain = eddy_controller::local::toolchain::Toolchain::new(
        "node".into(),
        "npm".into(),
        "python3".into(),
        eddy_controller::default_tools_dir(data_dir),
        data_dir.join("runtimes"),
        Duration::from_secs(300),
    );
    let http = reqwest::Client::new();
    let api = platform.api_url.as_str();
    let mut figures = Vec::new();
    for runtime in runtimes {
        let parsed: Runtime = serde_json::from_value(json!(runtime))
            .with_context(|| format!("unknown runtime {runtime:?}"))?;
        // Found (or installed) before the clock runs, as they are on any machine after its
        // first build: the interpreter and the runtime's libraries.
        let program = toolchain
            .prepare(parsed)
            .await
            .map_err(|failure| anyhow::anyhow!("{failure}"))?
            .program;
        let mut deploys = Vec::with_capacity(runs);
        let mut from_zero = Vec::with_capacity(runs);
        for run in 0..runs {
            let name = format!(
                "cold-{}-{run}",
                runtime.replace(|c: char| !c.is_ascii_alphanumeric(), "")
            );
            let manifest = json!({
                "apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
                "metadata": {"name": name, "namespace": "bench"},
                "spec": {"runtime": runtime, "source": {"inline": {"source": handler(runtime, run)?}},
                    "scaleConfig": {"minReplicas": 0, "maxReplicas": 1}},
            });
            let started = Instant::now();
            let response = http
                .put(format!(
                    "{api}/apis/eddy.dev/v1alpha1/namespaces/bench/functions/{name}"
                ))
                .json(&manifest)
                .send()
                .await?;
            if !response.status().is_success() {
                bail!(
                    "deploy refused: {}",
                    response.text().await.unwrap_or_default()
                );
            }
            // Ready: serving, or already idle again (a function that may scale to zero can be
            // back at zero before the next poll).
            wait_for(&http, api, &name, "ready", |f| {
                running(f).is_some_and(|c| c.status == "True")
            })
            .await?;
            deploys.push(started.elapsed());

            wait_for(&http, api, &name, "scaled to zero", |f| {
                running(f).is_some_and(|c| c.reason == Reason::ScaledToZero.as_str())
            })
            .await?;
            // As after any real idle period (scale-to-zero takes a minute by default, not the
            // 300 ms set here): the spare that replaced the deploy's has loaded.
            wait_for_spare(platform, parsed).await?;
            let started = Instant::now();
            let response = http
                .get(format!("{}/bench/{name}/", platform.gateway_url))
                .send()
                .await?;
            let status = response.status();
            let _ = response.bytes().await?;
            if !status.is_success() {
                bail!("{name} answered {status} from zero");
            }
            from_zero.push(started.elapsed());
            http.delete(format!(
                "{api}/apis/eddy.dev/v1alpha1/namespaces/bench/functions/{name}"
            ))
            .send()
            .await?;
        }
        let mut floor = Vec::with_capacity(runs);
        for _ in 0..runs {
            floor.push(bare_runtime(&http, &program, parsed).await?);
        }
        figures.push(Coldstart {
            runtime: runtime.clone(),
            deploy: summarize(&deploys),
            from_zero: summarize(&from_zero),
            floor: summarize(&floor),
        });
    }
    Ok(figures)
}

/// Waits until a warm spare of `runtime` has loaded, when the platform keeps them.
async fn wait_for_spare(platform: &Platform, runtime: Runtime) -> anyhow::Result<()> {
    let Some(spares) = platform
        .local_controller
        .as_ref()
        .and_then(|controller| controller.spares())
    else {
        return Ok(());
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while spares.ready(runtime) == 0 {
        if Instant::now() > deadline {
            bail!("no warm spare of {} loaded within 60 s", runtime.as_str());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// Spawn → first response of `program` running a minimal HTTP server: what no platform can beat.
async fn bare_runtime(
    http: &reqwest::Client,
    program: &std::path::Path,
    runtime: Runtime,
) -> anyhow::Result<Duration> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut command = tokio::process::Command::new(program);
    if runtime.node_major().is_some() {
        command.arg("-e").arg(format!(
            "require('http').createServer((q, s) => s.end('ok')).listen({port}, '127.0.0.1')"
        ));
    } else {
        command.arg("-c").arg(format!(
            "import http.server as h\n\
             class H(h.BaseHTTPRequestHandler):\n    \
             def do_GET(self):\n        \
             self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n\
             h.HTTPServer(('127.0.0.1', {port}), H).serve_forever()"
        ));
    }
    command
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    let started = Instant::now();
    let mut child = command
        .spawn()
        .with_context(|| format!("cannot run {}", program.display()))?;
    let url = format!("http://127.0.0.1:{port}/");
    let answered = loop {
        if let Ok(response) = http.get(&url).send().await
            && response.status().is_success()
        {
            break started.elapsed();
        }
        if started.elapsed() > Duration::from_secs(30) {
            bail!("{} did not answer within 30 s", program.display());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    let _ = child.kill().await;
    Ok(answered)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_comes_from_proc_status() {
        let mine = load::memory_mib(std::process::id(), "VmRSS");
        assert!(mine > 1.0 && mine < 100_000.0, "{mine}");
        assert_eq!(load::memory_mib(std::process::id(), "VmNoSuchField"), 0.0);
    }

    #[test]
    fn spreads() {
        assert_eq!(
            spread(&[0.9, 0.8, 1.0]),
            json!({"median": 0.9, "min": 0.8, "max": 1.0, "rounds": [0.9, 0.8, 1.0]})
        );
        assert_eq!(spread(&[0.8, 1.0])["median"], 0.9);
        assert_eq!(spread(&[])["median"], 0.0);
    }

    #[test]
    fn summaries() {
        let samples: Vec<Duration> = [30, 10, 20]
            .iter()
            .map(|ms| Duration::from_millis(*ms))
            .collect();
        let summary = summarize(&samples);
        assert_eq!(
            (summary.min_ms, summary.p50_ms, summary.max_ms),
            (10.0, 20.0, 30.0)
        );
        assert_eq!(summarize(&[]).p50_ms, 0.0);
    }
}
