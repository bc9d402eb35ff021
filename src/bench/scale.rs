//! `eddy bench scale-out`: replicas simulated on one machine. 1, 2, 4 … event-bus processes
//! behind one port (`SO_REUSEPORT`) and dispatcher processes sharing one consumer, each measured
//! with the CPU time every process used, so the figure that carries over to a cluster is events
//! per busy core; and NATS alone (one stream, R1 and a three-server R3 cluster) for where the
//! stream becomes the limit.

use super::{json, scale, write_json};
use anyhow::Context as _;

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::bail;
use async_nats::jetstream::{self, consumer::pull};
use futures::StreamExt as _;
use serde::Serialize;

use super::load::{
    self, Component, CpuMeter, closed_loop, drained, noop_sink, payload, prepare_dispatch,
    publish_http, publish_raw, store_events,
};
use crate::up::NatsChild;

/// Settings of `scale-out`.
pub struct ScaleArgs {
    /// Process counts to run, e.g. 1, 2, 4.
    pub processes: Vec<usize>,
    /// Publishing connections (and raw publishers).
    pub connections: usize,
    /// How long each publishing measurement runs.
    pub duration: Duration,
    /// Events stored and delivered per dispatch measurement.
    pub events: u64,
    /// The Subscription's maxInFlightMessages (shared by every dispatcher on the consumer).
    pub in_flight: usize,
    /// Bytes of data per event.
    pub size: usize,
    /// nats-server binary.
    pub nats_server: Option<PathBuf>,
}

/// One measured configuration.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ScalePoint {
    /// What ran: `event-bus`, `dispatcher`, `NATS R1 publish` …
    pub role: String,
    /// Processes of that role.
    pub processes: usize,
    /// Events per second through all of them.
    pub per_second: f64,
    /// Cores their processes kept busy (CPU seconds / wall seconds), summed.
    pub cores: f64,
    /// Events per second per busy core of the role (0 for NATS alone).
    pub per_core: f64,
    /// Cores the nats-server processes kept busy.
    pub nats_cores: f64,
    /// Events per second per busy nats-server core.
    pub per_nats_core: f64,
    /// Cores the bench process (load generator, sink) kept busy.
    pub bench_cores: f64,
}

/// A measurement of `role` with `per_second` events/s, given the meters of the role's processes
/// and of NATS.
fn point(
    role: &str,
    processes: usize,
    per_second: f64,
    role_meter: Option<&CpuMeter>,
    nats_meter: &CpuMeter,
) -> ScalePoint {
    let (cores, bench_cores) = role_meter.map_or((0.0, 0.0), CpuMeter::cores);
    let (nats_cores, own) = nats_meter.cores();
    ScalePoint {
        role: role.to_owned(),
        processes,
        per_second,
        cores,
        per_core: if cores > 0.0 { per_second / cores } else { 0.0 },
        nats_cores,
        per_nats_core: per_second / nats_cores.max(1e-9),
        bench_cores: if role_meter.is_some() {
            bench_cores
        } else {
            own
        },
    }
}

/// Runs every measurement: event-bus and dispatcher scale-out on one nats-server, then NATS
/// alone on R1 and on a three-server R3 cluster.
pub async fn run(args: &ScaleArgs) -> anyhow::Result<Vec<ScalePoint>> {
    let binary = crate::up::find_nats_server(args.nats_server.clone())?;
    let mut points = Vec::new();
    {
        let dir = tempfile::tempdir()?;
        std::fs::create_dir_all(dir.path().join("logs"))?;
        let mut nats = NatsChild::start(&binary, dir.path(), None).await?;
        let result = on_one_server(args, &nats, &mut points).await;
        nats.stop().await;
        result?;
    }
    let dir = tempfile::tempdir()?;
    let mut cluster = Cluster::start(&binary, dir.path()).await?;
    let result = nats_alone(args, cluster.urls(), cluster.pids(), 3, &mut points).await;
    cluster.stop().await;
    result?;
    Ok(points)
}

async fn on_one_server(
    args: &ScaleArgs,
    nats: &NatsChild,
    points: &mut Vec<ScalePoint>,
) -> anyhow::Result<()> {
    let nats_pid = nats.pid().context("nats-server is not running")?;
    for &processes in &args.processes {
        points.push(event_buses(args, &nats.url, nats_pid, processes).await?);
    }
    let client = async_nats::connect(&nats.url).await?;
    let js = jetstream::new(client);
    let sink = noop_sink().await?;
    let stream = prepare_dispatch(&js, &nats.url, &sink, args.in_flight).await?;
    for &processes in &args.processes {
        points.push(dispatchers(args, &js, &stream, &nats.url, nats_pid, processes).await?);
    }
    nats_alone(args, vec![nats.url.clone()], vec![nats_pid], 1, points).await
}

/// `processes` event-bus processes on one port under `connections` publishing connections.
async fn event_buses(
    args: &ScaleArgs,
    nats_url: &str,
    nats_pid: u32,
    processes: usize,
) -> anyhow::Result<ScalePoint> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut buses = Vec::new();
    for _ in 0..processes.max(1) {
        buses.push(
            Component::start(
                &[
                    "event-bus",
                    "--addr",
                    &addr,
                    "--reuse-port",
                    "--nats-url",
                    nats_url,
                    "--stream-max-bytes",
                    "8GiB",
                ],
                "event-bus ready on ",
            )
            .await?,
        );
    }
    let http = load::load_client(false);
    let url: http::Uri = format!("http://{addr}/publish").parse()?;
    let data = payload(args.size);
    let offset = (processes as u64 + 16) << 40;
    let publish = |duration: Duration, offset: u64| {
        let (http, url, data) = (http.clone(), url.clone(), data.clone());
        closed_loop("event-bus", args.connections, duration, move |sequence| {
            publish_http(
                http.clone(),
                url.clone(),
                data.clone(),
                sequence + offset,
                1,
            )
        })
    };
    // Opens the connections (the kernel spreads them over the processes) and warms up.
    publish(Duration::from_millis(500), offset).await?;
    let bus_meter = CpuMeter::start(buses.iter().filter_map(Component::pid).collect());
    let nats_meter = CpuMeter::start(vec![nats_pid]);
    let rate = publish(args.duration, offset + (1 << 39)).await?;
    let measured = point(
        "event-bus",
        processes,
        rate.per_second,
        Some(&bus_meter),
        &nats_meter,
    );
    for bus in buses {
        bus.stop().await;
    }
    Ok(measured)
}

/// `processes` dispatchers draining `events` stored events from the one consumer.
async fn dispatchers(
    args: &ScaleArgs,
    js: &jetstream::Context,
    stream: &jetstream::stream::Stream,
    nats_url: &str,
    nats_pid: u32,
    processes: usize,
) -> anyhow::Result<ScalePoint> {
    // Each run stores its own range of events (the same ids would be dropped as duplicates).
    let first = u64::try_from(processes)? << 40;
    store_events(
        js,
        &payload(args.size),
        first,
        args.events,
        args.connections,
    )
    .await?;
    let mut running = Vec::new();
    for _ in 0..processes.max(1) {
        running.push(
            Component::start(&load::dispatcher_args(nats_url), "dispatcher ready on ").await?,
        );
    }
    // Timed from when every process runs: what is left then, delivered by all of them.
    let info = stream.consumer_info(load::BENCH_CONSUMER).await?;
    let left = info.num_pending + info.num_ack_pending as u64;
    let dispatcher_meter = CpuMeter::start(running.iter().filter_map(Component::pid).collect());
    let nats_meter = CpuMeter::start(vec![nats_pid]);
    let started = Instant::now();
    drained(stream, started).await?;
    let per_second = left as f64 / started.elapsed().as_secs_f64().max(1e-9);
    let measured = point(
        "dispatcher",
        processes,
        per_second,
        Some(&dispatcher_meter),
        &nats_meter,
    );
    if left < args.events / 2 {
        bail!(
            "only {left} of {} events were left when the dispatchers had started: too few to \
             measure; raise --events",
            args.events
        );
    }
    for dispatcher in running {
        dispatcher.stop().await;
    }
    Ok(measured)
}

/// async-nats publishing to, then an ack-only consumer draining, one stream of `replicas`.
async fn nats_alone(
    args: &ScaleArgs,
    nats_urls: Vec<String>,
    nats_pids: Vec<u32>,
    replicas: u8,
    points: &mut Vec<ScalePoint>,
) -> anyhow::Result<()> {
    // A cluster just started may not listen yet.
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(nats_urls)
        .await?;
    let js = jetstream::new(client);
    let config = eddy_platform::nats::events_stream_config(&eddy_platform::nats::StreamArgs {
        max_bytes: bytesize::ByteSize::gib(8),
        replicas,
        ..Default::default()
    });
    // A new cluster elects its JetStream leader first: retry until the stream can be made.
    let deadline = Instant::now() + Duration::from_secs(60);
    let stream = loop {
        match eddy_platform::nats::ensure_stream(&js, config.clone()).await {
            Ok(_) => break js.get_stream(eddy_platform::nats::EVENTS_STREAM).await?,
            Err(error) if Instant::now() > deadline => {
                bail!("cannot create the R{replicas} stream: {error}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    };
    let consumer_name = format!("bench_raw_r{replicas}");
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(consumer_name),
            filter_subject: "eddy.events.>".to_owned(),
            deliver_policy: jetstream::consumer::DeliverPolicy::New,
            max_ack_pending: i64::try_from(args.in_flight).unwrap_or(i64::MAX),
            ..Default::default()
        })
        .await?;
    let data = payload(args.size);
    let offset = (u64::from(replicas) + 32) << 40;
    let publish = |duration: Duration, offset: u64| {
        let (js, data) = (js.clone(), data.clone());
        closed_loop("raw", args.connections, duration, move |sequence| {
            publish_raw(js.clone(), data.clone(), sequence + offset, 1)
        })
    };
    publish(Duration::from_millis(500), offset).await?;
    let nats_meter = CpuMeter::start(nats_pids.clone());
    let published = publish(args.duration, offset + (1 << 39)).await?;
    points.push(point(
        &format!("NATS R{replicas}: publish"),
        nats_pids.len(),
        published.per_second,
        None,
        &nats_meter,
    ));
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(args.in_flight)
        .messages()
        .await?;
    let to_ack = published.count.min(args.events);
    let nats_meter = CpuMeter::start(nats_pids.clone());
    let started = Instant::now();
    for _ in 0..to_ack {
        let Some(message) = messages.next().await else {
            bail!("the ack-only consumer stopped")
        };
        message
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .ack()
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let per_second = to_ack as f64 / started.elapsed().as_secs_f64().max(1e-9);
    points.push(point(
        &format!("NATS R{replicas}: consume + ack"),
        nats_pids.len(),
        per_second,
        None,
        &nats_meter,
    ));
    Ok(())
}

/// Three nats-servers with JetStream in one cluster on loopback.
struct Cluster {
    servers: Vec<tokio::process::Child>,
    ports: Vec<u16>,
}

impl Cluster {
    async fn start(binary: &Path, dir: &Path) -> anyhow::Result<Self> {
        let free = || -> anyhow::Result<u16> {
            Ok(std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port())
        };
        let ports: Vec<u16> = (0..3).map(|_| free()).collect::<anyhow::Result<_>>()?;
        let routes: Vec<u16> = (0..3).map(|_| free()).collect::<anyhow::Result<_>>()?;
        let mut servers = Vec::new();
        for (index, (port, route)) in ports.iter().zip(&routes).enumerate() {
            let others: Vec<String> = routes
                .iter()
                .filter(|other| *other != route)
                .map(|other| format!("nats://127.0.0.1:{other}"))
                .collect();
            let store = dir.join(format!("n{index}"));
            std::fs::create_dir_all(&store)?;
            let mut command = tokio::process::Command::new(binary);
            command
                .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string()])
                .arg("-sd")
                .arg(&store)
                .args(["-n", &format!("bench-{index}"), "--cluster_name", "bench"])
                .args(["--cluster", &format!("nats://127.0.0.1:{route}")])
                .args(["--routes", &others.join(",")])
                .arg("-l")
                .arg(dir.join(format!("n{index}.log")))
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .kill_on_drop(true);
            eddy_platform::process::supervise(&mut command);
            servers.push(
                command
                    .spawn()
                    .with_context(|| format!("cannot start {}", binary.display()))?,
            );
        }
        Ok(Self { servers, ports })
    }

    fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|port| format!("nats://127.0.0.1:{port}"))
            .collect()
    }

    fn pids(&self) -> Vec<u32> {
        self.servers
            .iter()
            .filter_map(tokio::process::Child::id)
            .collect()
    }

    async fn stop(&mut self) {
        for server in &mut self.servers {
            eddy_platform::process::terminate(server, Duration::from_secs(10)).await;
        }
    }
}

pub(super) async fn scale_out(
    args: &scale::ScaleArgs,
    out: Option<&PathBuf>,
) -> anyhow::Result<()> {
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
