//! `soak`: the full path for a long time at a steady rate. Publish → event-bus → dispatcher →
//! gateway → `first` (nodejs22), whose answer is a CloudEvent the dispatcher stores → dispatcher
//! → `second`, which logs how long ago the original event was published. Every 10 s it prints the
//! rate, the end-to-end latency quantiles of that window and the resident memory of eddy, of
//! nats-server and of each function instance; at the end it checks that every published event
//! reached `second` exactly once and none was dead-lettered.

use super::{CancellationToken, PathBuf, bench_platform_args, soak, write_json};
use anyhow::Context as _;

use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::bail;
use serde_json::json;

use super::{
    e2e::{self, now_ms, quantile},
    load::memory_mib,
};
use crate::up::Platform;

const FIRST: &str = "module.exports = { main: async (event) => {\n  const response = event.extensions.response;\n  response.setHeader(\"ce-specversion\", \"1.0\");\n  response.setHeader(\"ce-type\", \"bench.answered.v1\");\n  response.setHeader(\"ce-source\", \"first\");\n  response.setHeader(\"ce-id\", event[\"ce-id\"] + \"-answer\");\n  response.setHeader(\"ce-benchsent\", String(event[\"ce-benchsent\"]));\n  return { answered: event[\"ce-id\"] };\n} };\n";

const SECOND: &str = "module.exports = { main: async (event) => {\n  const sent = Number(event[\"ce-benchsent\"]);\n  console.log(\"soak \" + event[\"ce-id\"] + \" \" + ((performance.timeOrigin + performance.now()) - sent).toFixed(3));\n  return \"\";\n} };\n";

/// One 10 s window.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Window {
    /// Seconds since the soak began, at the window's end.
    pub at_s: u64,
    /// Events published in the window, per second.
    pub published_per_s: f64,
    /// Events `second` handled in the window, per second.
    pub delivered_per_s: f64,
    /// End-to-end latency quantiles of the window, ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// 99.9th percentile, ms.
    pub p999_ms: f64,
    /// Resident memory, MiB: eddy, nats-server, then each function instance.
    pub rss_mib: Vec<(String, f64)>,
}

/// What the soak found.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Soak {
    /// The maximum sustained rate of the path, measured first.
    pub max_rate: f64,
    /// The rate offered (half the maximum unless given).
    pub rate: u64,
    /// Every window.
    pub windows: Vec<Window>,
    /// Events published (acknowledged by the event-bus).
    pub published: u64,
    /// Publishes that failed.
    pub publish_errors: u64,
    /// Distinct events `second` handled.
    pub delivered: u64,
    /// Events `second` handled more than once.
    pub duplicates: u64,
    /// Answers `second` handled to events that were not published.
    pub strays: u64,
    /// Events in the dead-letter stream.
    pub dead_letters: u64,
}

async fn publish(http: &reqwest::Client, url: &str, sequence: u64) -> bool {
    let sent = http
        .post(url)
        .header("ce-specversion", "1.0")
        .header("ce-id", format!("soak-{sequence}"))
        .header("ce-source", "bench")
        .header("ce-type", "bench.soak.v1")
        .header("ce-benchsent", format!("{:.3}", now_ms()))
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await;
    matches!(sent, Ok(response) if response.status().as_u16() == 204)
}

async fn settled(js: &async_nats::jetstream::Context) -> anyhow::Result<bool> {
    let stream = js.get_stream(eddy_platform::nats::EVENTS_STREAM).await?;
    for subscription in ["first", "second"] {
        let consumer = eddy_model::resources::consumer_name("bench", subscription);
        if !super::consumer_settled(&stream, &consumer).await? {
            return Ok(false);
        }
    }
    Ok(true)
}

async fn wait_settled(js: &async_nats::jetstream::Context) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(600);
    while !settled(js).await? {
        if Instant::now() > deadline {
            bail!("the backlog did not drain in 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Reads what `second` logs, from where the last read stopped: each window costs what the
/// window logged, not the whole log (which would load the machine more as the soak goes on).
struct LogTail {
    path: std::path::PathBuf,
    offset: u64,
    /// An incomplete last line, kept for the next read.
    partial: String,
}

impl LogTail {
    fn new(path: std::path::PathBuf) -> Self {
        Self {
            path,
            offset: 0,
            partial: String::new(),
        }
    }

    /// The `(id, latency ms)` lines logged since the last call.
    fn read(&mut self) -> std::io::Result<Vec<(String, f64)>> {
        use std::io::{Read as _, Seek as _};
        let mut file = match std::fs::File::open(&self.path) {
            Ok(file) => file,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(error) => return Err(error),
        };
        file.seek(std::io::SeekFrom::Start(self.offset))?;
        let mut text = std::mem::take(&mut self.partial);
        let read = file.read_to_string(&mut text)?;
        self.offset += read as u64;
        let complete = text.rfind('\n').map_or(0, |end| end + 1);
        self.partial = text.split_off(complete);
        Ok(text
            .lines()
            .filter_map(|line| line.strip_prefix("soak "))
            .filter_map(|rest| {
                let (id, latency) = rest.split_once(' ')?;
                Some((id.to_owned(), latency.trim().parse().ok()?))
            })
            .collect())
    }
}

fn rss_now(platform: &Platform) -> Vec<(String, f64)> {
    let mut rss = vec![("eddy".to_owned(), memory_mib(std::process::id(), "VmRSS"))];
    if let Some(pid) = platform.nats_pid() {
        rss.push(("nats-server".to_owned(), memory_mib(pid, "VmRSS")));
    }
    if let Some(controller) = &platform.local_controller {
        for name in ["first", "second"] {
            for (index, pid) in controller.pids("bench", name).into_iter().enumerate() {
                rss.push((format!("{name}#{index}"), memory_mib(pid, "VmRSS")));
            }
        }
    }
    rss
}

/// Runs the soak on a started platform whose data dir is `data_dir`.
pub async fn run(
    platform: &Platform,
    data_dir: &Path,
    duration: Duration,
    rate: Option<u64>,
    connections: usize,
) -> anyhow::Result<Soak> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(connections.max(64))
        .build()?;
    let api = &platform.api_url;
    for (name, source) in [("first", FIRST), ("second", SECOND)] {
        let function = json!({"apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
            "metadata": {"name": name, "namespace": "bench"},
            "spec": {"runtime": "nodejs22", "replicas": 1, "source": {"inline": {"source": source}}}});
        e2e::put(&http, api, "functions", &function).await?;
    }
    for (name, sink, ty) in [
        ("first", "first", "bench.soak.v1"),
        ("second", "second", "bench.answered.v1"),
    ] {
        let subscription = json!({"apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
            "metadata": {"name": name, "namespace": "bench"},
            "spec": {"sink": format!("http://{sink}.bench.svc.cluster.local"), "types": [ty],
                "config": {"maxInFlightMessages": 64}}});
        e2e::put(&http, api, "subscriptions", &subscription).await?;
    }
    for name in ["first", "second"] {
        e2e::wait_ready(&http, api, name).await?;
    }
    let js = async_nats::jetstream::new(platform.nats_client().await?);
    let mut log = LogTail::new(data_dir.join("logs/functions/bench/second.log"));
    // How many times `second` handled the answer to each published sequence number (a byte
    // per event, so the bench's own memory barely grows), and answers to nothing published.
    let mut handled_times: Vec<u8> = Vec::new();
    let mut strays = 0_u64;
    let mut count = |lines: &[(String, f64)]| {
        for (id, _) in lines {
            let sequence = id
                .strip_prefix("soak-")
                .and_then(|rest| rest.strip_suffix("-answer"))
                .and_then(|sequence| sequence.parse::<usize>().ok());
            match sequence {
                Some(sequence) => {
                    if handled_times.len() <= sequence {
                        handled_times.resize(sequence + 1, 0);
                    }
                    if let Some(times) = handled_times.get_mut(sequence) {
                        *times = times.saturating_add(1);
                    }
                }
                None => strays += 1,
            }
        }
    };
    let url = format!("{}/publish", platform.bus_url);
    let next = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));

    // The maximum sustained rate of the whole path: publish as fast as the bus takes it for
    // 10 s, then count until both subscriptions have drained.
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let (http, url, next, errors) = (http.clone(), url.clone(), next.clone(), errors.clone());
        tasks.push(tokio::spawn(async move {
            while started.elapsed() < Duration::from_secs(10) {
                if !publish(&http, &url, next.fetch_add(1, Ordering::Relaxed)).await {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for task in tasks {
        task.await?;
    }
    wait_settled(&js).await?;
    let max_rate = next.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    let rate = rate.unwrap_or(((max_rate / 2.0) as u64).max(1));
    count(&log.read()?);
    println!(
        "maximum sustained rate {max_rate:.0} events/s; soaking at {rate} events/s for {duration:?}"
    );
    println!(
        "{:>6} {:>10} {:>10} {:>9} {:>9} {:>9}  rss MiB",
        "t s", "publish/s", "deliver/s", "p50 ms", "p99 ms", "p999 ms"
    );

    // The soak: an open loop at `rate`, a line every 10 s.
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let begun = Instant::now();
    let mut window_start = Instant::now();
    let mut window_published = next.load(Ordering::Relaxed);
    let mut windows = Vec::new();
    let mut sends = tokio::task::JoinSet::new();
    while begun.elapsed() < duration {
        tick.tick().await;
        let (http, url, errors) = (http.clone(), url.clone(), errors.clone());
        let sequence = next.fetch_add(1, Ordering::Relaxed);
        sends.spawn(async move {
            if !publish(&http, &url, sequence).await {
                errors.fetch_add(1, Ordering::Relaxed);
            }
        });
        while sends.try_join_next().is_some() {}
        if window_start.elapsed() >= Duration::from_secs(10) {
            let elapsed = window_start.elapsed().as_secs_f64();
            let published = next.load(Ordering::Relaxed);
            let lines = log.read()?;
            count(&lines);
            let mut latencies: Vec<f64> = lines.iter().map(|(_, latency)| *latency).collect();
            latencies.sort_by(f64::total_cmp);
            let window = Window {
                at_s: begun.elapsed().as_secs(),
                published_per_s: (published - window_published) as f64 / elapsed,
                delivered_per_s: lines.len() as f64 / elapsed,
                p50_ms: quantile(&latencies, 0.5),
                p99_ms: quantile(&latencies, 0.99),
                p999_ms: quantile(&latencies, 0.999),
                rss_mib: rss_now(platform),
            };
            let rss: Vec<String> = window
                .rss_mib
                .iter()
                .map(|(name, mib)| format!("{name} {mib:.0}"))
                .collect();
            println!(
                "{:>6} {:>10.0} {:>10.0} {:>9.2} {:>9.2} {:>9.2}  {}",
                window.at_s,
                window.published_per_s,
                window.delivered_per_s,
                window.p50_ms,
                window.p99_ms,
                window.p999_ms,
                rss.join(", ")
            );
            windows.push(window);
            window_start = Instant::now();
            window_published = published;
        }
    }
    while sends.join_next().await.is_some() {}
    wait_settled(&js).await?;

    // Every event accounted for: each published id reached `second` once.
    let published = next.load(Ordering::Relaxed) - errors.load(Ordering::Relaxed);
    count(&log.read()?);
    let delivered = handled_times.iter().filter(|times| **times > 0).count() as u64;
    let total: u64 = handled_times.iter().map(|times| u64::from(*times)).sum();
    let dead_letters = match js.get_stream(eddy_platform::nats::DEAD_LETTER_STREAM).await {
        Ok(mut stream) => stream.info().await?.state.messages,
        Err(_) => 0,
    };
    Ok(Soak {
        max_rate,
        rate,
        windows,
        published,
        publish_errors: errors.load(Ordering::Relaxed),
        delivered,
        duplicates: total - delivered,
        strays,
        dead_letters,
    })
}

pub(super) async fn soak_test(
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
