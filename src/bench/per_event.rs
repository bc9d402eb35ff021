//! `per-event`: what one delivered event costs the platform in CPU, and how long each hop takes,
//! at fixed rates low enough that nothing queues; locally here (`eddy up` as a process of its
//! own, beside a nats-server), through pods with `eddy bench real-node --per-event`. Both print
//! the same lines, so the two compare line by line.
//!
//! - CPU: the platform's processes only, read from the kernel's own accounting around each
//!   window: locally `eddy up` and its nats-server (`/proc/<pid>/stat`), on a node every
//!   container of eddy's pods, NATS and the mesh's sidecars included (their cgroups). Not the
//!   function (the user's code) and not the bench. Per delivered event, whole and above what the
//!   platform spends idle (measured first, as long as a window): at 50 events/s the idle part
//!   (timers, probes, the sidecars' own work) is much of the whole.
//! - Hops, per event: publish (sent → the event-bus's 204 back at the publisher: the event
//!   stored, at R3 on a quorum), delivery (that 204 → the function has the event: the
//!   dispatcher's pull and its HTTP call, through the gateway locally, through the mesh on a
//!   node), and the two together (sent → function). One machine, one clock.

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    process::Stdio,
    sync::{Arc, atomic::AtomicU64},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use eddy_model::resources::consumer_name;
use futures::future::BoxFuture;
use serde_json::json;

use super::e2e::{
    EVENT_SOURCE, Probed, Published, finish, offer, put, quantile, wait_ready, wait_settled,
};
use crate::up::NatsChild;

/// The sink every per-event run delivers to: it keeps each event's latency (publish → here) and
/// send stamp in memory, and hands them over (and forgets them) on a GET as pairs of
/// little-endian `f64`s. Not a log line per event: on a node that is three processes (the
/// function, containerd's shim, containerd) woken per event, which the path measured would
/// share. One typed array, allocated once; the newest million events are kept.
pub(super) const SINK_HANDLER: &str = "const CAPACITY = 1 << 20;\nconst held = new Float64Array(2 * CAPACITY);\nlet count = 0;\nmodule.exports = { main: async (event) => {\n  const sent = Number(event[\"ce-benchsent\"]);\n  if (sent) {\n    const at = 2 * (count % CAPACITY);\n    held[at] = (performance.timeOrigin + performance.now()) - sent;\n    held[at + 1] = sent;\n    count += 1;\n    return \"\";\n  }\n  const kept = Math.min(count, CAPACITY);\n  count = 0;\n  return Buffer.from(held.slice(0, 2 * kept).buffer);\n} };\n";

/// The runtime of the sink, here and in pods.
pub(super) const SINK_RUNTIME: &str = "nodejs22";

/// One event as the sink saw it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Measured {
    /// Publish → function, ms.
    pub latency_ms: f64,
    /// When the bench sent it (its `ce-benchsent` stamp), milliseconds since the Unix epoch.
    pub sent_ms: f64,
}

/// Decodes what the sink hands over: pairs of little-endian `f64`s (latency, send stamp). Pure.
pub(super) fn decode_sink(body: &[u8]) -> impl Iterator<Item = Measured> + '_ {
    let number = |bytes: &[u8]| bytes.try_into().map(f64::from_le_bytes).ok();
    body.chunks_exact(16).filter_map(move |pair| {
        Some(Measured {
            latency_ms: number(&pair[..8])?,
            sent_ms: number(&pair[8..])?,
        })
    })
}

/// Where the platform's CPU time is read, by the part of the platform it belongs to.
#[derive(Debug, Clone)]
pub(super) enum CpuSource {
    /// A process (all its threads, ended ones included).
    Process(u32),
    /// A cgroup (a container's): `cpuacct.usage` (v1, ns) or `cpu.stat`'s `usage_usec` (v2).
    Cgroup(PathBuf),
}

impl CpuSource {
    /// CPU seconds used so far.
    fn seconds(&self) -> anyhow::Result<f64> {
        match self {
            Self::Process(pid) => super::load::process_cpu_seconds(*pid)
                .with_context(|| format!("no CPU times of process {pid}: is it gone?")),
            Self::Cgroup(dir) => {
                if let Ok(usage) = std::fs::read_to_string(dir.join("cpuacct.usage")) {
                    let nanoseconds: f64 = usage
                        .trim()
                        .parse()
                        .with_context(|| format!("{}/cpuacct.usage: {usage:?}", dir.display()))?;
                    return Ok(nanoseconds / 1e9);
                }
                let stat = std::fs::read_to_string(dir.join("cpu.stat"))
                    .with_context(|| format!("no CPU accounting in {}", dir.display()))?;
                cgroup_v2_usage_seconds(&stat)
                    .with_context(|| format!("no usage_usec in {}/cpu.stat", dir.display()))
            }
        }
    }
}

/// `usage_usec` of a cgroup v2 `cpu.stat`, in seconds. Pure.
fn cgroup_v2_usage_seconds(stat: &str) -> Option<f64> {
    stat.lines()
        .find_map(|line| line.strip_prefix("usage_usec "))
        .and_then(|value| value.trim().parse::<f64>().ok())
        .map(|microseconds| microseconds / 1e6)
}

/// The platform's CPU, part by part: each part a name (`event-bus/istio-proxy`, `eddy up`) and
/// the sources it adds up. A part whose name ends in `/istio-proxy` is a sidecar of the mesh.
#[derive(Debug, Clone, Default)]
pub(super) struct CpuMeter {
    parts: Vec<(String, CpuSource)>,
}

/// Whether a part is one of the mesh's sidecars (Istio's container `istio-proxy`).
fn is_sidecar(part: &str) -> bool {
    part.ends_with("/istio-proxy")
}

impl CpuMeter {
    /// Adds `source` to the part `name`.
    pub fn add(&mut self, name: impl Into<String>, source: CpuSource) {
        self.parts.push((name.into(), source));
    }

    /// CPU seconds used so far, by part.
    fn read(&self) -> anyhow::Result<BTreeMap<String, f64>> {
        let mut parts = BTreeMap::new();
        for (name, source) in &self.parts {
            *parts.entry(name.clone()).or_insert(0.0) += source.seconds()?;
        }
        Ok(parts)
    }
}

/// What the platform used between two readings, per second of the time between them.
fn per_second(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
    elapsed: Duration,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(part, seconds)| {
            let used = seconds - before.get(part).copied().unwrap_or(0.0);
            (part.clone(), used / elapsed.as_secs_f64().max(1e-9))
        })
        .collect()
}

/// Hands over (and forgets) what the sink measured since the last call.
pub(super) type Drain<'a> =
    &'a (dyn Fn() -> BoxFuture<'static, anyhow::Result<Vec<Measured>>> + Sync);

/// The path one run measures: where events are published, what they are, the consumer that
/// delivers them, and where the sink's figures come from.
pub(super) struct EventPath<'a> {
    /// The publisher's client.
    pub http: &'a reqwest::Client,
    /// The event-bus's `/publish`.
    pub url: &'a str,
    /// The events' type and ids, and the consumer that delivers them.
    pub probed: &'a Arc<Probed>,
    /// JetStream, where the consumer's backlog is read.
    pub js: &'a async_nats::jetstream::Context,
    /// The next event's sequence number.
    pub next: &'a AtomicU64,
    /// The sink's figures.
    pub drain: Drain<'a>,
}

/// One rate's figures.
#[derive(Debug, Clone)]
pub(super) struct Window {
    /// Offered events per second.
    pub rate: u64,
    /// Events published and delivered in the window.
    pub events: usize,
    /// CPU seconds per second by part, while the window ran and its events settled.
    pub cpu_per_second: BTreeMap<String, f64>,
    /// Seconds from the window's start until its last event was acknowledged.
    pub seconds: f64,
    /// The whole machine's busy cores over that time (every process: the platform, the
    /// function, the bench, on a node the control plane too).
    pub machine_busy_cores: f64,
    /// Sent → the event-bus's 204, sorted, ms.
    pub publish_ms: Vec<f64>,
    /// The 204 → the function has the event, sorted, ms (the events that paired up by stamp).
    pub delivery_ms: Vec<f64>,
    /// Sent → the function has the event, sorted, ms.
    pub whole_ms: Vec<f64>,
}

/// Measures the platform idle for `duration`, then each of `rates` for `duration` (after a
/// warm-up as long) and prints them as [`print`] does.
pub(super) async fn measure(
    path: &EventPath<'_>,
    meter: &CpuMeter,
    rates: &[u64],
    duration: Duration,
) -> anyhow::Result<(BTreeMap<String, f64>, Vec<Window>)> {
    (path.drain)().await?;
    // What the platform spends with nothing to deliver: a window with no events, measured
    // (not waited for) as long as the others.
    let before = meter.read()?;
    let started = Instant::now();
    tokio::time::sleep(duration).await;
    let idle = per_second(&before, &meter.read()?, started.elapsed());
    let mut windows = Vec::with_capacity(rates.len());
    for &rate in rates {
        let warm_up = offer(path.http, path.url, path.probed, path.next, rate, duration).await?;
        let warmed = finish(warm_up.sends, warm_up.answered).await?;
        wait_settled(path.js, &path.probed.consumer).await?;
        wait_drained(path.drain, warmed.len()).await?;

        let before = meter.read()?;
        let machine_before = super::load::machine_busy_seconds();
        let started = Instant::now();
        let window = offer(path.http, path.url, path.probed, path.next, rate, duration).await?;
        let published = finish(window.sends, window.answered).await?;
        wait_settled(path.js, &path.probed.consumer).await?;
        let elapsed = started.elapsed();
        let cpu_per_second = per_second(&before, &meter.read()?, elapsed);
        let machine_busy_cores =
            (super::load::machine_busy_seconds() - machine_before) / elapsed.as_secs_f64();
        let measured = wait_drained(path.drain, published.len()).await?;
        let (publish_ms, delivery_ms, whole_ms) = hops(&published, &measured);
        windows.push(Window {
            rate,
            events: published.len(),
            cpu_per_second,
            seconds: elapsed.as_secs_f64(),
            machine_busy_cores,
            publish_ms,
            delivery_ms,
            whole_ms,
        });
    }
    Ok((idle, windows))
}

/// Drains the sink until it has handed over `expected` events (a delivery's answer can reach
/// the dispatcher before the sink's next read sees it), at most two minutes.
async fn wait_drained(drain: Drain<'_>, expected: usize) -> anyhow::Result<Vec<Measured>> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut measured = Vec::with_capacity(expected);
    loop {
        measured.extend(drain().await?);
        if measured.len() >= expected {
            return Ok(measured);
        }
        if Instant::now() > deadline {
            bail!(
                "the sink measured {} of {expected} events in 2 minutes",
                measured.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Each hop's latencies, sorted: publish (sent → 204), delivery (204 → function) for the events
/// whose publish and delivery pair up by send stamp, and the whole (sent → function) for every
/// delivered event. Pure.
fn hops(published: &[Published], measured: &[Measured]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    // Two publishes stamped in the same microsecond cannot be told apart: neither pairs up.
    let mut by_stamp: HashMap<u64, Option<f64>> = HashMap::with_capacity(published.len());
    for event in published {
        by_stamp
            .entry(event.sent_ms.to_bits())
            .and_modify(|answered| *answered = None)
            .or_insert(Some(event.answered_ms));
    }
    let mut publish: Vec<f64> = published
        .iter()
        .map(|event| event.answered_ms - event.sent_ms)
        .collect();
    let mut delivery: Vec<f64> = measured
        .iter()
        .filter_map(|event| {
            let answered = by_stamp.get(&event.sent_ms.to_bits()).copied().flatten()?;
            Some(event.sent_ms + event.latency_ms - answered)
        })
        .collect();
    let mut whole: Vec<f64> = measured.iter().map(|event| event.latency_ms).collect();
    for values in [&mut publish, &mut delivery, &mut whole] {
        values.sort_by(f64::total_cmp);
    }
    (publish, delivery, whole)
}

/// Prints the idle figures and each window: CPU per delivered event by part and in all (whole,
/// and above idle), then each hop's p50, p99 and max.
pub(super) fn print(setting: &str, idle: &BTreeMap<String, f64>, windows: &[Window]) {
    let total = |parts: &BTreeMap<String, f64>, sidecars: bool| -> f64 {
        parts
            .iter()
            .filter(|(part, _)| sidecars || !is_sidecar(part))
            .map(|(_, seconds)| seconds)
            .sum()
    };
    let has_sidecars = idle.keys().any(|part| is_sidecar(part));
    println!(
        "{setting}: idle, the platform's CPU {:.1} ms/s{}",
        total(idle, true) * 1e3,
        if has_sidecars {
            format!(
                " ({:.1} ms/s without the sidecars)",
                total(idle, false) * 1e3
            )
        } else {
            String::new()
        }
    );
    for window in windows {
        let events = window.events.max(1) as f64;
        let per_event_us = |per_second: f64| per_second * window.seconds / events * 1e6;
        println!(
            "{setting}: {} events/s, {} events, settled in {:.1} s; the machine {:.2} of {} cores busy",
            window.rate,
            window.events,
            window.seconds,
            window.machine_busy_cores,
            std::thread::available_parallelism().map_or(0, usize::from)
        );
        for (part, per_second) in &window.cpu_per_second {
            let idle_part = idle.get(part).copied().unwrap_or(0.0);
            println!(
                "  cpu {part:<28} {:>8.1} µs/event ({:>7.1} above idle)",
                per_event_us(*per_second),
                per_event_us(per_second - idle_part)
            );
        }
        let mut lines = vec![("all", true)];
        if has_sidecars {
            lines.push(("all but the sidecars", false));
        }
        for (name, sidecars) in lines {
            let whole = total(&window.cpu_per_second, sidecars);
            println!(
                "  cpu {name:<28} {:>8.1} µs/event ({:>7.1} above idle)",
                per_event_us(whole),
                per_event_us(whole - total(idle, sidecars))
            );
        }
        for (hop, values) in [
            ("publish (sent → 204)", &window.publish_ms),
            ("delivery (204 → function)", &window.delivery_ms),
            ("whole (sent → function)", &window.whole_ms),
        ] {
            println!(
                "  hop {hop:<28} p50 {:>7.2} ms, p99 {:>7.2} ms, max {:>7.2} ms ({} events)",
                quantile(values, 0.5),
                quantile(values, 0.99),
                values.last().copied().unwrap_or(0.0),
                values.len()
            );
        }
    }
}

/// The type of the events a local run publishes.
const EVENT_TYPE: &str = "bench.perevent.v1";

/// Settings of a local run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Rates to measure, events per second.
    pub rates: Vec<u64>,
    /// How long each window (and the idle one) runs.
    pub duration: Duration,
    /// The nats-server binary (default: PATH, then .tools/venv/bin).
    pub nats_server: Option<PathBuf>,
}

/// `eddy bench per-event`: `eddy up` as users run it (its own process, default flags but free
/// ports and no warm spare), beside a nats-server the bench starts (so the bench can read the
/// consumer), a nodejs22 sink Function and a Subscription to it.
pub async fn local(settings: Settings) -> anyhow::Result<()> {
    let data_dir = tempfile::tempdir().context("cannot create a temporary data dir")?;
    let binary = crate::up::find_nats_server(settings.nats_server.clone())?;
    let nats_dir = data_dir.path().join("nats-server");
    std::fs::create_dir_all(nats_dir.join("logs"))?;
    let mut nats = NatsChild::start(&binary, &nats_dir, None).await?;
    let result = with_nats(&settings, &nats, data_dir.path()).await;
    nats.stop().await;
    result
}

async fn with_nats(settings: &Settings, nats: &NatsChild, data_dir: &Path) -> anyhow::Result<()> {
    let ports = free_ports::<4>()?;
    let [bus, gateway, api, dispatcher] = ports.map(|port| format!("127.0.0.1:{port}"));
    let exe = std::env::current_exe().context("cannot find the eddy binary")?;
    let mut command = tokio::process::Command::new(exe);
    command
        .args(["up", "--data-dir"])
        .arg(data_dir.join("eddy"))
        .args(["--nats-url", &nats.url])
        .args(["--bus-addr", &bus, "--gateway-addr", &gateway])
        .args(["--api-addr", &api, "--dispatcher-addr", &dispatcher])
        .args(["--warm-spares", "0", "--scale-to-zero-after", "1h"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    eddy_platform::process::supervise(&mut command);
    let mut eddy = command.spawn().context("cannot start eddy up")?;
    let result = async {
        let pid = eddy.id().context("eddy up exited at once")?;
        let nats_pid = nats.pid().context("nats-server exited")?;
        run_local(settings, pid, nats_pid, &nats.url, &bus, &gateway, &api).await
    }
    .await;
    eddy_platform::process::terminate(&mut eddy, Duration::from_secs(10)).await;
    result
}

async fn run_local(
    settings: &Settings,
    eddy_pid: u32,
    nats_pid: u32,
    nats_url: &str,
    bus: &str,
    gateway: &str,
    api: &str,
) -> anyhow::Result<()> {
    let http = reqwest::Client::builder()
        .pool_idle_timeout(Duration::from_secs(90))
        .build()?;
    let api = format!("http://{api}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !matches!(http.get(format!("http://{bus}/readyz")).send().await, Ok(r) if r.status().is_success())
        || http.get(format!("{api}/healthz")).send().await.is_err()
    {
        if Instant::now() > deadline {
            bail!("eddy up was not ready in 60 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let function = json!({"apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
        "metadata": {"name": "sink", "namespace": "bench"},
        "spec": {"runtime": SINK_RUNTIME, "replicas": 1,
                 "source": {"inline": {"source": SINK_HANDLER}}}});
    let subscription = json!({"apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
        "metadata": {"name": "per-event", "namespace": "bench"},
        "spec": {"sink": "http://sink.bench.svc.cluster.local", "types": [EVENT_TYPE],
            "config": {"maxInFlightMessages": 64}}});
    put(&http, &api, "functions", &function).await?;
    put(&http, &api, "subscriptions", &subscription).await?;
    wait_ready(&http, &api, "per-event").await?;
    let js = async_nats::jetstream::new(async_nats::connect(nats_url).await?);
    let sink = format!("http://{gateway}/bench/sink");
    let drain_http = http.clone();
    let drain = move || -> BoxFuture<'static, anyhow::Result<Vec<Measured>>> {
        let (http, sink) = (drain_http.clone(), sink.clone());
        Box::pin(async move {
            let response = http.get(&sink).send().await?;
            if !response.status().is_success() {
                bail!("the sink answered {}", response.status());
            }
            Ok(decode_sink(&response.bytes().await?).collect())
        })
    };
    // The Function starts on its first call: the drain makes it.
    let deadline = Instant::now() + Duration::from_secs(120);
    while let Err(error) = drain().await {
        if Instant::now() > deadline {
            return Err(error.context("the sink did not answer in 2 minutes"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut meter = CpuMeter::default();
    meter.add("eddy up", CpuSource::Process(eddy_pid));
    meter.add("nats-server", CpuSource::Process(nats_pid));
    let probed = Arc::new(Probed {
        kind: EVENT_TYPE,
        ids: format!("per-event-{}", uuid::Uuid::new_v4().simple()),
        consumer: consumer_name("bench", "per-event"),
    });
    let next = AtomicU64::new(0);
    let url = format!("http://{bus}/publish");
    let path = EventPath {
        http: &http,
        url: &url,
        probed: &probed,
        js: &js,
        next: &next,
        drain: &drain,
    };
    let (idle, windows) = measure(&path, &meter, &settings.rates, settings.duration).await?;
    println!(
        "per event, local: eddy up (its own process) and nats-server, a {SINK_RUNTIME} sink, events from source {EVENT_SOURCE}, {:?} per window",
        settings.duration
    );
    print("local", &idle, &windows);
    Ok(())
}

/// `N` ports free on 127.0.0.1 now (bound together, so distinct, then released).
fn free_ports<const N: usize>() -> anyhow::Result<[u16; N]> {
    let listeners = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()?;
    let mut ports = [0; N];
    for (port, listener) in ports.iter_mut().zip(&listeners) {
        *port = listener.local_addr()?.port();
    }
    Ok(ports)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hops_pair_a_publish_with_its_delivery_by_stamp() {
        let published = [
            Published {
                sent_ms: 1_000.5,
                answered_ms: 1_002.0,
            },
            Published {
                sent_ms: 1_010.25,
                answered_ms: 1_011.0,
            },
            // Two stamped in the same microsecond: neither pairs up.
            Published {
                sent_ms: 1_020.0,
                answered_ms: 1_021.0,
            },
            Published {
                sent_ms: 1_020.0,
                answered_ms: 1_025.0,
            },
        ];
        let measured = [
            Measured {
                latency_ms: 4.0,
                sent_ms: 1_000.5,
            },
            Measured {
                latency_ms: 3.0,
                sent_ms: 1_010.25,
            },
            Measured {
                latency_ms: 6.0,
                sent_ms: 1_020.0,
            },
        ];
        let (publish, delivery, whole) = hops(&published, &measured);
        assert_eq!(publish, vec![0.75, 1.0, 1.5, 5.0]);
        assert_eq!(delivery, vec![2.25, 2.5]);
        assert_eq!(whole, vec![3.0, 4.0, 6.0]);
    }

    #[test]
    fn the_sink_hands_over_pairs_of_little_endian_floats() {
        let mut body = Vec::new();
        for value in [2.5f64, 1_000.0, 3.25, 2_000.0] {
            body.extend(value.to_le_bytes());
        }
        body.push(7); // a torn tail is left out
        let measured: Vec<(f64, f64)> = decode_sink(&body)
            .map(|event| (event.latency_ms, event.sent_ms))
            .collect();
        assert_eq!(measured, vec![(2.5, 1_000.0), (3.25, 2_000.0)]);
    }

    #[test]
    fn a_cgroup_v2_usage_is_read_in_seconds() {
        let stat = "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n";
        assert_eq!(cgroup_v2_usage_seconds(stat), Some(2.5));
        assert_eq!(cgroup_v2_usage_seconds("user_usec 1\n"), None);
    }

    #[test]
    fn cpu_per_second_is_what_each_part_used_over_the_time() {
        let before = BTreeMap::from([("a".to_owned(), 1.0), ("b".to_owned(), 2.0)]);
        let after = BTreeMap::from([("a".to_owned(), 1.5), ("b".to_owned(), 4.0)]);
        let rates = per_second(&before, &after, Duration::from_secs(2));
        assert_eq!(rates["a"], 0.25);
        assert_eq!(rates["b"], 1.0);
    }
}
