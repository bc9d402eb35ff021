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
    resources::{Condition, ConditionStatus, Function, Runtime},
};
use serde_json::{Value, json};

use crate::up::{self, Platform};
use eddy_platform::shutdown::CancellationToken;

mod buildless;
mod coldstart;
mod dispatch;
mod e2e;
mod forwarder;
mod ingest;
mod load;
mod per_event;
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
    /// buildless Function's apply → Running without and with a dependency, the highest rate
    /// sustained through the pods, and publish → function latency at half of it.
    RealNode {
        /// The first rate the search for the maximum offers, events per second.
        #[arg(long, default_value_t = 200)]
        rate: u64,
        /// How long each rate is offered.
        #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
        duration: Duration,
        /// Apply → Running runs per case.
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// The namespace eddy's chart runs in.
        #[arg(long = "system-namespace", default_value = "eddy-system")]
        system_namespace: String,
        /// Measure apply → Running only, not the event path.
        #[arg(long = "starts-only")]
        starts_only: bool,
        /// Measure publish → function latency at this rate only (three windows after a warm-up),
        /// without searching for the maximum: for comparing two setups at one rate.
        #[arg(long = "latency-at")]
        latency_at: Option<u64>,
        /// Measure CPU per delivered event (every container of eddy's pods, read from their
        /// cgroups on this node) and each hop's latency at these rates, comma-separated, as
        /// `eddy bench per-event` does locally; without searching for the maximum.
        #[arg(long = "per-event", value_delimiter = ',')]
        per_event: Vec<u64>,
    },
    /// CPU per delivered event (eddy up's process and its nats-server) and each hop's latency
    /// (publish, delivery, the whole) at fixed rates, locally; `real-node --per-event` measures
    /// the same through pods.
    PerEvent {
        /// Rates to measure, events per second, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "50,400")]
        rates: Vec<u64>,
        /// How long each window runs (and the idle one, and each rate's warm-up).
        #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
        duration: Duration,
        /// The nats-server binary (default: PATH, then .tools/venv/bin).
        #[arg(long = "nats-server", env = "EDDY_NATS_SERVER")]
        nats_server: Option<PathBuf>,
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
        } => coldstart::coldstart(runs, &runtimes, out, nats_server, warm_spares).await,
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
            starts_only,
            latency_at,
            per_event,
        } => {
            real_node::run(real_node::Settings {
                rate,
                duration,
                system_namespace,
                runs,
                starts_only,
                latency_at,
                per_event,
            })
            .await
        }
        Scenario::PerEvent {
            rates,
            duration,
            nats_server,
        } => {
            per_event::local(per_event::Settings {
                rates,
                duration,
                nats_server,
            })
            .await
        }
        Scenario::Ingest(flags) => ingest::ingest(&flags, 1).await,
        Scenario::IngestBatch(flags) => ingest::ingest(&flags, 100).await,
        Scenario::Dispatch {
            flags,
            events,
            in_flight,
        } => dispatch::dispatch(&flags, events, in_flight).await,
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
            scale::scale_out(&args, out.as_ref()).await
        }
        Scenario::E2e(flags) => e2e::end_to_end(&flags).await,
        Scenario::Forwarder { addr, nats_url } => forwarder::run(addr, &nats_url).await,
        Scenario::OtlpSink { addr } => otlp_sink(addr).await,
        Scenario::Soak {
            duration,
            rate,
            connections,
            out,
            nats_server,
        } => soak::soak_test(duration, rate, connections, out, nats_server).await,
    }
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
