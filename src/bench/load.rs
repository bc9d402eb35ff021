//! Throughput scenarios measured against the limits of eddy's own parts in the same run:
//! `ingest` (HTTP publish vs. async-nats publishing the same messages) and `dispatch` (delivery to
//! a no-op sink vs. a consumer that only acks, and vs. a plain HTTP client posting to the sink).

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use async_nats::jetstream::{self, consumer::pull};
use bytes::Bytes;
use eddy_dispatcher::sink_client;
use futures::StreamExt as _;
use http::HeaderValue;
use http_body_util::{BodyExt as _, Full};
use serde::Serialize;
use tokio::io::AsyncBufReadExt as _;

use super::{Summary, summarize};
use crate::up::NatsChild;

/// One measured run.
#[derive(Debug, Clone, Serialize)]
pub struct Rate {
    /// What was measured.
    pub name: String,
    /// Operations finished.
    pub count: u64,
    /// Operations per second.
    pub per_second: f64,
    /// Latency of one operation (zero where not measured per operation).
    pub latency: Summary,
}

impl Rate {
    fn from(name: &str, count: u64, elapsed: Duration, mut samples: Vec<Duration>) -> Self {
        samples.sort();
        Self {
            name: name.to_owned(),
            count,
            per_second: count as f64 / elapsed.as_secs_f64().max(1e-9),
            latency: summarize(&samples),
        }
    }
}

/// A child `eddy <component>` process, for its own RSS.
pub struct Component {
    child: tokio::process::Child,
    /// Its URL, from its ready line.
    pub url: String,
}

impl Component {
    /// Starts `eddy <args>` and waits for the line `<ready_prefix><url>`.
    pub async fn start(args: &[&str], ready_prefix: &str) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("cannot find the eddy binary")?;
        let mut command = tokio::process::Command::new(exe);
        command
            .args(args)
            .env("EDDY_LOG", "warn")
            .stdout(Stdio::piped());
        eddy_platform::process::supervise(&mut command);
        let mut child = command.spawn()?;
        let stdout = child.stdout.take().context("no stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let url = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await? {
                if let Some(url) = line.strip_prefix(ready_prefix) {
                    return Ok(url.to_owned());
                }
            }
            bail!("{args:?} exited before it was ready")
        })
        .await
        .context("component start timed out")??;
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        // Listening is not ready: wait for its dependencies (NATS, the stream).
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if matches!(http.get(format!("{url}/readyz")).send().await, Ok(r) if r.status().is_success())
            {
                return Ok(Self { child, url });
            }
            if Instant::now() > deadline {
                bail!("{args:?} did not become ready");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Peak resident memory (VmHWM), MiB.
    pub fn peak_rss_mib(&self) -> f64 {
        self.child.id().map_or(0.0, |pid| memory_mib(pid, "VmHWM"))
    }

    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// CPU time it has used so far, seconds.
    pub fn cpu_seconds(&self) -> f64 {
        self.child.id().map_or(0.0, cpu_seconds)
    }

    /// Stops it.
    pub async fn stop(mut self) {
        eddy_platform::process::terminate(&mut self.child, Duration::from_secs(10)).await;
    }
}

/// A memory figure of a process from `/proc/<pid>/status` (`VmRSS`, `VmHWM`, …), MiB; 0 when
/// it cannot be read.
pub fn memory_mib(pid: u32, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|value| {
            value
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<f64>()
                .ok()
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// CPU time a process has used so far (user and system), seconds; 0 when it cannot be read.
pub fn cpu_seconds(pid: u32) -> f64 {
    process_cpu_seconds(pid).unwrap_or(0.0)
}

/// CPU time a process has used so far (user and system, all its threads, ended ones included),
/// seconds; `None` when it cannot be read (the process is gone).
pub(super) fn process_cpu_seconds(pid: u32) -> Option<f64> {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| cpu_ticks(&stat))
        .map(|ticks| ticks as f64 / ticks_per_second())
}

/// The kernel's clock ticks per second, the unit of `/proc`'s CPU times.
fn ticks_per_second() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .map_or(100.0, |ticks| ticks as f64)
}

/// utime + stime from a `/proc/<pid>/stat` line (fields 14 and 15; the command name, which may
/// hold spaces, ends at the last `)`). Pure.
fn cpu_ticks(stat: &str) -> Option<u64> {
    let fields: Vec<&str> = stat
        .get(stat.rfind(')')? + 1..)?
        .split_whitespace()
        .collect();
    let user: u64 = fields.get(11)?.parse().ok()?;
    let system: u64 = fields.get(12)?.parse().ok()?;
    Some(user + system)
}

/// Busy CPU time of the whole machine so far, all cores added (seconds); 0 when it cannot be
/// read. Every process counts: eddy's, nats-server, the sink and the bench itself.
pub fn machine_busy_seconds() -> f64 {
    std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|stat| busy_ticks(&stat))
        .map_or(0.0, |ticks| ticks as f64 / ticks_per_second())
}

/// Busy ticks from `/proc/stat`'s first line: user, nice, system, irq and softirq (idle, iowait
/// and the time a hypervisor stole are not work done here; guest time is already in user). Pure.
fn busy_ticks(stat: &str) -> Option<u64> {
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let field = |index: usize| fields.get(index).copied();
    Some(field(0)? + field(1)? + field(2)? + field(5)? + field(6)?)
}

/// The machine's CPU over one measured phase, and the shares of the processes in it.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct MachineCpu {
    /// Busy CPU time of every process per operation, µs.
    pub us_per_op: f64,
    /// Cores busy on average (busy CPU seconds per wall second).
    pub cores_busy: f64,
    /// nats-server's CPU per operation, µs.
    pub nats_us: f64,
    /// The bench process's CPU per operation (raw clients, load generator, sink), µs.
    pub bench_us: f64,
    /// The measured eddy process's CPU per operation, µs (0 in phases without one).
    pub eddy_us: f64,
}

/// CPU time of a set of processes, and of the bench process, from a starting point.
pub(super) struct CpuMeter {
    pids: Vec<u32>,
    start: f64,
    own_start: f64,
    began: Instant,
}

impl CpuMeter {
    /// Starts measuring `pids` (and the bench process) now.
    pub(super) fn start(pids: Vec<u32>) -> Self {
        let start = pids.iter().map(|pid| cpu_seconds(*pid)).sum();
        Self {
            pids,
            start,
            own_start: cpu_seconds(std::process::id()),
            began: Instant::now(),
        }
    }

    /// CPU seconds used since the start: (the processes', the bench's own).
    fn used(&self) -> (f64, f64) {
        let used: f64 = self.pids.iter().map(|pid| cpu_seconds(*pid)).sum();
        let own = cpu_seconds(std::process::id());
        (used - self.start, own - self.own_start)
    }

    /// Wall-clock seconds since the start.
    fn wall(&self) -> f64 {
        self.began.elapsed().as_secs_f64().max(1e-9)
    }

    /// Cores busy since the start: (the processes', the bench's own).
    pub(super) fn cores(&self) -> (f64, f64) {
        let ((used, own), wall) = (self.used(), self.wall());
        (used / wall, own / wall)
    }
}

/// Measures the machine's busy CPU, and nats-server's and the bench's, from `start` until
/// `finish`.
pub struct MachineMeter {
    busy: f64,
    nats_and_bench: CpuMeter,
}

impl MachineMeter {
    /// Starts measuring now; `nats_pid` is nats-server's process.
    pub fn start(nats_pid: u32) -> Self {
        Self {
            busy: machine_busy_seconds(),
            nats_and_bench: CpuMeter::start(vec![nats_pid]),
        }
    }

    /// What the machine spent on `rate` since `start`; `eddy` is the eddy process started
    /// within the phase, if any (all its CPU counts).
    pub fn finish(&self, rate: &Rate, eddy: Option<&Component>) -> MachineCpu {
        let busy = machine_busy_seconds() - self.busy;
        let (nats, bench) = self.nats_and_bench.used();
        MachineCpu {
            us_per_op: cpu_us_per(busy, rate),
            cores_busy: busy / self.nats_and_bench.wall(),
            nats_us: cpu_us_per(nats, rate),
            bench_us: cpu_us_per(bench, rate),
            eddy_us: eddy.map_or(0.0, |eddy| cpu_us_per(eddy.cpu_seconds(), rate)),
        }
    }
}

/// Runs `workers` closed loops of `operation` for `duration`; returns the rate and latencies.
pub(super) async fn closed_loop<F, Fut>(
    name: &str,
    workers: usize,
    duration: Duration,
    operation: F,
) -> anyhow::Result<Rate>
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<u64>> + Send,
{
    let operation = Arc::new(operation);
    let next = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let (operation, next, stop) = (operation.clone(), next.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut done = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let sequence = next.fetch_add(1, Ordering::Relaxed);
                let begun = Instant::now();
                done += operation(sequence).await?;
                samples.push(begun.elapsed());
            }
            Ok::<_, anyhow::Error>((done, samples))
        }));
    }
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let mut count = 0;
    let mut samples = Vec::new();
    for task in tasks {
        let (done, mut mine) = task.await??;
        count += done;
        samples.append(&mut mine);
    }
    Ok(Rate::from(name, count, started.elapsed(), samples))
}

pub(super) fn payload(size: usize) -> Bytes {
    let mut body = String::with_capacity(size);
    body.push_str("{\"data\":\"");
    while body.len() + 2 < size {
        body.push('x');
    }
    body.push_str("\"}");
    Bytes::from(body)
}

/// Settings shared by the load scenarios.
pub struct LoadArgs {
    /// Concurrent connections / workers.
    pub connections: usize,
    /// How long each measurement runs.
    pub duration: Duration,
    /// Data size of each event.
    pub size: usize,
    /// nats-server binary.
    pub nats_server: Option<PathBuf>,
    /// Measurement rounds (each runs every contender once, interleaved).
    pub rounds: usize,
    /// Send over HTTP/2 (prior knowledge, one connection, `connections` streams).
    pub http2: bool,
    /// The event-bus's log filter.
    pub event_bus_log_level: String,
}

/// One round of `ingest`: the event-bus, the forwarder (single events only) and raw publishing,
/// measured one after the other under the same load.
#[derive(Debug, Clone, Serialize)]
pub struct IngestRound {
    /// Through the event-bus.
    pub event_bus: Rate,
    /// Through the minimal forwarder.
    pub forwarder: Option<Rate>,
    /// async-nats publishing the same messages.
    pub raw: Rate,
    /// The event-bus process's CPU time per event while it was measured, µs.
    pub event_bus_cpu_us: f64,
    /// The forwarder process's CPU time per event while it was measured, µs.
    pub forwarder_cpu_us: Option<f64>,
}

/// CPU µs per operation of a process that used `cpu_seconds` for `rate`. Pure.
fn cpu_us_per(cpu_seconds: f64, rate: &Rate) -> f64 {
    cpu_seconds * 1e6 / rate.count.max(1) as f64
}

pub(super) async fn start_nats(args: &LoadArgs, dir: &Path) -> anyhow::Result<NatsChild> {
    let binary = crate::up::find_nats_server(args.nats_server.clone())?;
    NatsChild::start(&binary, dir, None).await
}

/// `ingest` / `ingest-batch`: the event-bus against a minimal forwarder and raw JetStream
/// publishing, in `rounds` interleaved rounds; also the event-bus's peak RSS (MiB).
pub async fn ingest(args: &LoadArgs, batch: usize) -> anyhow::Result<(Vec<IngestRound>, f64)> {
    let dir = tempfile::tempdir()?;
    std::fs::create_dir_all(dir.path().join("logs"))?;
    let mut nats = start_nats(args, dir.path()).await?;
    let result = ingest_against(args, batch, &nats.url).await;
    nats.stop().await;
    result
}

/// The load generator's client: plain HTTP (HTTP/1.1 or HTTP/2).
pub(super) type LoadClient = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<bytes::Bytes>,
>;

/// The load generator: hyper's client with the URI parsed once, so as little of the machine as
/// possible goes to the measuring side (two cores are shared by everything here). Over HTTP/2
/// it opens one connection and multiplexes every worker's requests on it.
pub(super) fn load_client(http2: bool) -> LoadClient {
    let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
    connector.set_nodelay(true);
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(http2)
        .pool_idle_timeout(Duration::from_secs(60))
        .build(connector)
}

async fn ingest_against(
    args: &LoadArgs,
    batch: usize,
    nats_url: &str,
) -> anyhow::Result<(Vec<IngestRound>, f64)> {
    let bus = Component::start(
        &[
            "--log-level",
            &args.event_bus_log_level,
            "event-bus",
            "--addr",
            "127.0.0.1:0",
            "--nats-url",
            nats_url,
            "--stream-max-bytes",
            "8GiB",
        ],
        "event-bus ready on ",
    )
    .await?;
    // The forwarder takes single events only (it does not parse batches).
    let forwarder = if batch > 1 {
        None
    } else {
        Some(
            Component::start(
                &[
                    "bench",
                    "forwarder",
                    "--addr",
                    "127.0.0.1:0",
                    "--nats-url",
                    nats_url,
                ],
                "forwarder ready on ",
            )
            .await?,
        )
    };
    let data = payload(args.size);
    let http = load_client(args.http2);
    let bus_url: http::Uri = format!("{}/publish", bus.url).parse()?;
    let forwarder_url: Option<http::Uri> = match &forwarder {
        Some(forwarder) => Some(format!("{}/publish", forwarder.url).parse()?),
        None => None,
    };
    let over_http = |name: String, url: http::Uri, duration: Duration, offset: u64| {
        let (http, data) = (http.clone(), data.clone());
        async move {
            closed_loop(&name, args.connections, duration, move |sequence| {
                publish_http(
                    http.clone(),
                    url.clone(),
                    data.clone(),
                    sequence + offset,
                    batch,
                )
            })
            .await
        }
    };
    // Warm up connections and the stream.
    let warm_up = Duration::from_millis(500);
    over_http("warm-up".into(), bus_url.clone(), warm_up, 1 << 40).await?;
    if let Some(url) = &forwarder_url {
        over_http("warm-up".into(), url.clone(), warm_up, 2 << 40).await?;
    }
    let client = async_nats::connect(nats_url).await?;
    let js = jetstream::new(client);
    let protocol = if args.http2 { " HTTP/2" } else { "" };
    let bus_name = if batch > 1 {
        format!("event-bus{protocol} (batches of {batch})")
    } else {
        format!("event-bus{protocol}")
    };
    let mut rounds = Vec::new();
    for round in 0..args.rounds.max(1) as u64 {
        // Distinct ids per round and contender: nothing is a duplicate.
        let offset = (round + 3) << 40;
        // Throughput on two shared cores moves with everything else on the machine; the CPU
        // each process spends per event is the steadier measure of its own work.
        let cpu_before = bus.cpu_seconds();
        let event_bus = over_http(bus_name.clone(), bus_url.clone(), args.duration, offset).await?;
        let event_bus_cpu_us = cpu_us_per(bus.cpu_seconds() - cpu_before, &event_bus);
        let (forwarder, forwarder_cpu_us) = match (&forwarder_url, &forwarder) {
            (Some(url), Some(process)) => {
                let cpu_before = process.cpu_seconds();
                let rate = over_http(
                    format!("forwarder{protocol}"),
                    url.clone(),
                    args.duration,
                    offset + (1 << 39),
                )
                .await?;
                let cpu_us = cpu_us_per(process.cpu_seconds() - cpu_before, &rate);
                (Some(rate), Some(cpu_us))
            }
            _ => (None, None),
        };
        let raw = closed_loop("raw async-nats", args.connections, args.duration, {
            let (js, data) = (js.clone(), data.clone());
            move |sequence| publish_raw(js.clone(), data.clone(), sequence + offset, batch)
        })
        .await?;
        rounds.push(IngestRound {
            event_bus,
            forwarder,
            raw,
            event_bus_cpu_us,
            forwarder_cpu_us,
        });
    }
    let rss = bus.peak_rss_mib();
    bus.stop().await;
    if let Some(forwarder) = forwarder {
        forwarder.stop().await;
    }
    Ok((rounds, rss))
}

pub(super) async fn publish_http(
    http: LoadClient,
    url: http::Uri,
    data: Bytes,
    sequence: u64,
    batch: usize,
) -> anyhow::Result<u64> {
    let mut request = if batch <= 1 {
        let mut request = http::Request::new(Full::new(data));
        let headers = request.headers_mut();
        headers.insert("ce-specversion", HeaderValue::from_static("1.0"));
        headers.insert(
            "ce-id",
            HeaderValue::from_str(&format!("bench-{sequence}"))?,
        );
        headers.insert("ce-source", HeaderValue::from_static("bench"));
        headers.insert("ce-type", HeaderValue::from_static("bench.tick.v1"));
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        request
    } else {
        let text = std::str::from_utf8(&data)?;
        let events: Vec<String> = (0..batch)
            .map(|i| {
                format!(
                    r#"{{"specversion":"1.0","id":"bench-{sequence}-{i}","source":"bench","type":"bench.tick.v1","data":{text}}}"#
                )
            })
            .collect();
        let mut request =
            http::Request::new(Full::new(Bytes::from(format!("[{}]", events.join(",")))));
        request.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/cloudevents-batch+json"),
        );
        request
    };
    *request.method_mut() = http::Method::POST;
    *request.uri_mut() = url;
    let response = http.request(request).await?;
    let status = response.status();
    // Read to the end so the connection goes back to the pool.
    let body = response.into_body().collect().await?.to_bytes();
    if status.as_u16() != 204 {
        bail!(
            "the event-bus answered {status}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    Ok(batch.max(1) as u64)
}

pub(super) async fn publish_raw(
    js: jetstream::Context,
    data: Bytes,
    sequence: u64,
    batch: usize,
) -> anyhow::Result<u64> {
    let mut pending = Vec::with_capacity(batch.max(1));
    for i in 0..batch.max(1) {
        let id = format!("raw-{sequence}-{i}");
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("ce-specversion", "1.0");
        headers.insert("ce-id", id.as_str());
        headers.insert("ce-source", "bench");
        headers.insert("ce-type", "bench.tick.v1");
        headers.insert("content-type", "application/json");
        let message = jetstream::message::PublishMessage::build()
            .headers(headers)
            .payload(data.clone())
            .message_id(eddy_model::subject::message_id("bench", &id));
        pending.push(
            js.send_publish("eddy.events.bench.bench.tick.v1", message)
                .await?,
        );
    }
    for ack in pending {
        ack.await?;
    }
    Ok(batch.max(1) as u64)
}

/// One round of `dispatch`: a fresh dispatcher draining the stored events, then the two raw
/// halves of its work, each alone.
#[derive(Debug, Clone, Serialize)]
pub struct DispatchRound {
    /// Through an `eddy dispatcher` process.
    pub dispatcher: Rate,
    /// A JetStream consumer that only acks (same `max_ack_pending`).
    pub ack_only: Rate,
    /// The dispatcher's HTTP client posting to the sink (same concurrency).
    pub http_only: Rate,
    /// The whole machine's CPU in each of the three phases: dispatcher, ack only, HTTP only.
    pub machine_cpu: [MachineCpu; 3],
}

impl DispatchRound {
    /// The two raw halves in series, `1 / (1/ack-only + 1/http)`: what the dispatcher can reach
    /// when the cores (shared by NATS, the sink and the dispatcher) are the limit.
    pub fn both_in_series(&self) -> f64 {
        1.0 / (1.0 / self.ack_only.per_second.max(1e-9) + 1.0 / self.http_only.per_second.max(1e-9))
    }

    /// The machine's CPU per event through the dispatcher over what the two raw halves cost it
    /// together: above 1 is work the dispatcher adds; at 1, a shortfall against the halves in
    /// series is cores left idle (waits), not work.
    pub fn cpu_to_halves(&self) -> f64 {
        let [dispatcher, ack_only, http_only] = self.machine_cpu;
        dispatcher.us_per_op / (ack_only.us_per_op + http_only.us_per_op).max(1e-9)
    }
}

/// `dispatch`: stored events delivered to a no-op sink, against a consumer that only acks and
/// a plain HTTP client posting to the same sink, in `rounds` interleaved rounds; also the
/// dispatcher's peak RSS (MiB).
pub async fn dispatch(
    args: &LoadArgs,
    events: u64,
    in_flight: usize,
) -> anyhow::Result<(Vec<DispatchRound>, f64)> {
    let dir = tempfile::tempdir()?;
    std::fs::create_dir_all(dir.path().join("logs"))?;
    let mut nats = start_nats(args, dir.path()).await?;
    let result = match nats.pid() {
        Some(pid) => dispatch_against(args, events, in_flight, &nats.url, pid).await,
        None => Err(anyhow::anyhow!("nats-server is not running")),
    };
    nats.stop().await;
    result
}

/// A sink that answers every request 204 at once; its URL.
pub async fn noop_sink() -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/", listener.local_addr()?);
    let app = axum::Router::new().fallback(|| async { axum::http::StatusCode::NO_CONTENT });
    tokio::spawn(async move { axum::serve(eddy_platform::net::no_delay(listener), app).await });
    Ok(url)
}

/// The dispatcher's consumer name for the bench Subscription.
pub const BENCH_CONSUMER: &str = "sub_default_bench";

/// The `dispatcher` command line of the bench (any free address, the sink on loopback allowed).
pub fn dispatcher_args(nats_url: &str) -> [&str; 7] {
    [
        "dispatcher",
        "--addr",
        "127.0.0.1:0",
        "--nats-url",
        nats_url,
        "--allowed-sinks",
        "http://127.0.0.1:",
    ]
}

/// The events stream, a Subscription `default/bench` of `bench.tick.v1` to `sink`, and its
/// consumer (created by a dispatcher that delivers only new events, then stops): afterwards
/// every stored event waits for the next dispatcher.
pub async fn prepare_dispatch(
    js: &jetstream::Context,
    nats_url: &str,
    sink: &str,
    in_flight: usize,
) -> anyhow::Result<jetstream::stream::Stream> {
    eddy_platform::nats::ensure_stream(
        js,
        eddy_platform::nats::events_stream_config(&eddy_platform::nats::StreamArgs {
            max_bytes: bytesize::ByteSize::gib(8),
            ..Default::default()
        }),
    )
    .await?;
    let store = eddy_platform::store::Store::open(js, 1).await?;
    let subscription: eddy_model::resources::Subscription = serde_json::from_value(
        serde_json::json!({
            "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
            "metadata": {"name": "bench", "namespace": "default"},
            "spec": {"sink": sink, "types": ["bench.tick.v1"], "config": {"maxInFlightMessages": in_flight}},
        }),
    )?;
    store.apply(subscription).await?;
    let first = Component::start(&dispatcher_args(nats_url), "dispatcher ready on ").await?;
    let stream = js.get_stream(eddy_platform::nats::EVENTS_STREAM).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while stream.consumer_info(BENCH_CONSUMER).await.is_err() {
        if Instant::now() > deadline {
            bail!("the dispatcher did not create the consumer");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.stop().await;
    Ok(stream)
}

/// Waits until the bench consumer has nothing pending or unacknowledged.
pub async fn drained(stream: &jetstream::stream::Stream, started: Instant) -> anyhow::Result<()> {
    loop {
        if super::consumer_settled(stream, BENCH_CONSUMER).await? {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(600) {
            bail!("delivery did not finish within 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn dispatch_against(
    args: &LoadArgs,
    events: u64,
    in_flight: usize,
    nats_url: &str,
    nats_pid: u32,
) -> anyhow::Result<(Vec<DispatchRound>, f64)> {
    let sink = noop_sink().await?;
    let client = async_nats::connect(nats_url).await?;
    let js = jetstream::new(client);
    let stream = prepare_dispatch(&js, nats_url, &sink, in_flight).await?;
    // Raw limit 2: plain HTTP POSTs to the same sink, same concurrency, through the same HTTP
    // client the dispatcher uses.
    let http = sink_client(Duration::from_secs(60))?;
    let sink: http::Uri = sink.parse()?;
    let data = payload(args.size);
    let mut rounds = Vec::new();
    let mut rss: f64 = 0.0;
    for round in 0..u64::try_from(args.rounds.max(1))? {
        // Store the events, then time a fresh dispatcher draining them.
        let first_sequence = js
            .get_stream(eddy_platform::nats::EVENTS_STREAM)
            .await?
            .info()
            .await?
            .state
            .last_sequence
            + 1;
        store_events(&js, &data, round * events, events, args.connections).await?;
        let started = Instant::now();
        let machine = MachineMeter::start(nats_pid);
        let dispatcher =
            Component::start(&dispatcher_args(nats_url), "dispatcher ready on ").await?;
        drained(&stream, started).await?;
        let through_dispatcher = Rate::from("dispatcher", events, started.elapsed(), Vec::new());
        let dispatcher_cpu = machine.finish(&through_dispatcher, Some(&dispatcher));
        rss = rss.max(dispatcher.peak_rss_mib());
        dispatcher.stop().await;

        // Raw limit 1: a consumer that acks without delivering, same in-flight bound, pulled
        // as the dispatcher pulls. A fresh one per round from this round's first event: a
        // consumer kept idle between rounds pulls erratically afterwards (0.4k–7.5k events/s
        // at 1 in flight). A fresh one can stall too, less often: some rounds run 5-10x
        // slower with the machine idle (docs/benchmarks.md, "Where the goals stand"); the per-phase CPU
        // figures printed show such a round (cores busy far below 1).
        let name = format!("bench_ack_only_{round}");
        let consumer = stream
            .create_consumer(pull::Config {
                durable_name: Some(name.clone()),
                filter_subject: "eddy.events.>".to_owned(),
                deliver_policy: jetstream::consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: first_sequence,
                },
                max_ack_pending: i64::try_from(in_flight).unwrap_or(i64::MAX),
                ..Default::default()
            })
            .await?;
        let started = Instant::now();
        let machine = MachineMeter::start(nats_pid);
        let mut messages = consumer
            .stream()
            .max_messages_per_batch(in_flight)
            .heartbeat(Duration::from_secs(5))
            .expires(Duration::from_secs(30))
            .messages()
            .await?;
        let mut acked = 0;
        while acked < events {
            let Some(message) = messages.next().await else {
                bail!("the ack-only consumer stopped")
            };
            let message = match message {
                Ok(message) => message,
                // As in the dispatcher: a missed heartbeat is reported, the stream goes on.
                Err(error)
                    if error.kind()
                        == jetstream::consumer::pull::MessagesErrorKind::MissingHeartbeat =>
                {
                    continue;
                }
                Err(error) => bail!("the ack-only consumer failed: {error}"),
            };
            message.ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
            acked += 1;
        }
        let ack_only = Rate::from(
            "JetStream consumer, ack only",
            events,
            started.elapsed(),
            Vec::new(),
        );
        let ack_only_cpu = machine.finish(&ack_only, None);
        drop(messages);
        stream.delete_consumer(&name).await?;

        let started = Instant::now();
        let machine = MachineMeter::start(nats_pid);
        let next = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for _ in 0..in_flight {
            let (http, sink, data, next) = (http.clone(), sink.clone(), data.clone(), next.clone());
            tasks.push(tokio::spawn(async move {
                while next.fetch_add(1, Ordering::Relaxed) < events {
                    let mut request = http::Request::new(Full::new(data.clone()));
                    *request.method_mut() = http::Method::POST;
                    *request.uri_mut() = sink.clone();
                    request
                        .headers_mut()
                        .insert("ce-type", HeaderValue::from_static("bench.tick.v1"));
                    let response = http.request(request).await?;
                    response.into_body().collect().await?;
                }
                Ok::<_, anyhow::Error>(())
            }));
        }
        for task in tasks {
            task.await??;
        }
        let http_only = Rate::from("plain HTTP client", events, started.elapsed(), Vec::new());
        let http_only_cpu = machine.finish(&http_only, None);
        rounds.push(DispatchRound {
            dispatcher: through_dispatcher,
            ack_only,
            http_only,
            machine_cpu: [dispatcher_cpu, ack_only_cpu, http_only_cpu],
        });
    }
    Ok((rounds, rss))
}

/// Stores `events` bench events numbered from `first` with `workers` concurrent publishers
/// (batches of 100). The numbers make the message ids: a range stored twice within the
/// stream's duplicate window is stored once.
pub async fn store_events(
    js: &jetstream::Context,
    data: &Bytes,
    first: u64,
    events: u64,
    workers: usize,
) -> anyhow::Result<()> {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..workers.max(1) {
        let (js, data, next) = (js.clone(), data.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let sequence = next.fetch_add(100, Ordering::Relaxed);
                if sequence >= events {
                    return Ok::<_, anyhow::Error>(());
                }
                let count = (events - sequence).min(100) as usize;
                publish_raw(js.clone(), data.clone(), first + sequence, count).await?;
            }
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_user_plus_system_after_the_command_name() {
        // A command name with spaces and a parenthesis, as /proc shows it.
        let stat = "4242 (my (odd) cmd) S 1 4242 4242 0 -1 4194560 1500 0 0 0 731 269 0 0 20 0 9 0";
        assert_eq!(cpu_ticks(stat), Some(731 + 269));
        assert_eq!(cpu_ticks("4242 (cut"), None);
        assert!(cpu_seconds(std::process::id()) >= 0.0);
    }

    #[test]
    fn machine_busy_time_leaves_out_idle_iowait_and_steal() {
        // user nice system idle iowait irq softirq steal guest guest_nice
        let stat = "cpu  100 2 30 5000 7 1 4 9 0 0\ncpu0 50 1 15 2500 3 0 2 4 0 0\n";
        assert_eq!(busy_ticks(stat), Some(100 + 2 + 30 + 1 + 4));
        assert_eq!(busy_ticks("cpu0 1 2 3 4 5 6 7\n"), None);
        assert_eq!(busy_ticks("cpu  1 2 3\n"), None);
        assert!(machine_busy_seconds() > 0.0);
    }
}
