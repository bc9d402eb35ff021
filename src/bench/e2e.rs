//! `e2e`: publish → event-bus → JetStream → dispatcher → gateway → nodejs20 no-op function.
//!
//! The function logs, for every event, how long ago it was published (wall clock, sub-ms),
//! read back from its log after the run. First the maximum sustained rate, then latency at fixed
//! rates (open loop).
//!
//! The maximum sustained rate is searched for in open loop: the highest offered rate after which
//! the backlog is at most [`BACKLOG_BUDGET`] worth of events. A closed loop (publish as fast as the
//! event-bus takes events, then drain) only gives the starting bracket: it measures how the two
//! cores are shared between publishing and draining, not a rate the path keeps up with, and it
//! moved 4.7k–9.9k run to run while the path fell behind at ¾ of it.

use super::{CancellationToken, LoadFlags, bench_platform_args, e2e, write_json};
use anyhow::Context as _;

use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::bail;
use eddy_model::resources::consumer_name;
use serde_json::json;

use crate::up::Platform;

/// A no-op nodejs handler that logs, for every event, how long ago it was published.
pub(super) const HANDLER: &str = "module.exports = { main: async (event) => {\n  const sent = Number(event[\"ce-benchsent\"]);\n  if (sent) console.log(\"latency_ms \" + ((performance.timeOrigin + performance.now()) - sent).toFixed(3));\n  return \"\";\n} };\n";

/// The backlog a sustained rate may leave when its window ends, in time at that rate. A path 5%
/// short of the rate leaves this much behind in two seconds; one scheduling stall of a few
/// tens of milliseconds does not.
const BACKLOG_BUDGET: Duration = Duration::from_millis(100);

/// How much faster each rate of the search is than the last while every rate so far was
/// sustained.
const GALLOP: f64 = 1.5;

/// Rates tried going up (or down, from a start that fell behind) before the search settles for
/// what it has.
const MAX_GALLOPS: usize = 6;

/// Rates tried once the search has a bracket, the one that made it included (it fell behind
/// above a sustained rate): four midpoints after it, so the bracket shrinks to 1/16 of its width,
/// about 3% of the maximum when it spans one gallop.
const BISECTIONS: usize = 5;

/// Publishes a probe keeps unanswered at most. A rate this far behind is not sustained anyway;
/// without a cap every tick opens one more connection and a probe well above the maximum runs
/// the process out of file descriptors. Ticks skipped at the cap count as left behind.
const MAX_UNANSWERED: usize = 2_000;

/// One rate offered during the search for the maximum.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Probe {
    /// Offered events per second.
    pub rate: u64,
    /// Events left behind when the window ended: publishes not yet answered, and stored events
    /// not yet delivered or acknowledged.
    pub backlog: u64,
    /// Whether the backlog was within [`BACKLOG_BUDGET`] at this rate.
    pub sustained: bool,
}

/// What `e2e` measured.
#[derive(Debug, Clone)]
pub struct EndToEnd {
    /// The highest rate the search found sustained.
    pub max_rate: f64,
    /// The closed-loop rate that started the search (publish as fast as possible, then drain).
    pub closed_loop_rate: f64,
    /// The search, in order.
    pub probes: Vec<Probe>,
    /// Latency at ¼, ½ and ¾ of the maximum.
    pub latencies: Vec<Latency>,
    /// The function's instances started, from a warm spare and as processes of their own (the
    /// first copies its output to the log through eddy, which costs eddy's process CPU): which
    /// one a run had tells its figures apart. `None` when the gateway's metrics were unreadable.
    pub instance_starts: Option<(u64, u64)>,
}

/// Latency at one rate.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Latency {
    /// Offered events per second.
    pub rate: u64,
    /// Events delivered.
    pub count: usize,
    /// Median, ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// 99.9th percentile, ms.
    pub p999_ms: f64,
    /// How late the bench's own sends were against its schedule, 99th percentile, ms. Events
    /// are stamped when they go out, so this delay is not in the latencies above.
    pub bench_lag_p99_ms: f64,
}

/// What [`offer`] sent.
pub(super) struct Offered {
    /// Events left behind when the window ended: publishes unanswered, and ticks skipped at the
    /// cap.
    pub left_behind: u64,
    /// The unanswered publishes.
    pub sends: tokio::task::JoinSet<anyhow::Result<Published>>,
    /// The publishes answered within the window.
    pub answered: Vec<Published>,
    /// Publishes started in the window.
    pub sent: u64,
    /// How late the sends were against the schedule, 99th percentile, ms: 0–1 ms is tokio's
    /// timer granularity, more is the bench waiting for a core.
    pub lag_p99_ms: f64,
}

pub(super) fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

/// What a rate search publishes, and the consumer whose backlog tells whether it kept up.
#[derive(Debug, Clone)]
pub(super) struct Probed {
    /// The events' type.
    pub kind: &'static str,
    /// Their ids' prefix (`<prefix>-<sequence>`), unique to the run.
    pub ids: String,
    /// The consumer that delivers them.
    pub consumer: String,
}

async fn publish(
    http: &reqwest::Client,
    url: &str,
    path: &Probed,
    sequence: u64,
) -> anyhow::Result<Published> {
    publish_stamped(http, url, path.kind, &format!("{}-{sequence}", path.ids)).await
}

/// The source of every event the benches publish over HTTP.
pub(super) const EVENT_SOURCE: &str = "bench";

/// One event published: its send-time stamp, as the function reads it, and when the event-bus's
/// 204 (the event stored) reached the publisher.
#[derive(Debug, Clone, Copy)]
pub(super) struct Published {
    /// The stamp sent in `ce-benchsent`, milliseconds since the Unix epoch.
    pub sent_ms: f64,
    /// When the 204 arrived, milliseconds since the Unix epoch.
    pub answered_ms: f64,
}

/// Publishes one event of type `kind` stamped with its send time (`ce-benchsent`, which
/// [`HANDLER`] reads); an answer other than 204 is an error.
pub(super) async fn publish_stamped(
    http: &reqwest::Client,
    url: &str,
    kind: &str,
    id: &str,
) -> anyhow::Result<Published> {
    let stamp = format!("{:.3}", now_ms());
    // The stamp as the function will parse it, so a publish and its delivery pair up exactly.
    let sent_ms = stamp.parse()?;
    let response = http
        .post(url)
        .header("ce-specversion", "1.0")
        .header("ce-id", id)
        .header("ce-source", EVENT_SOURCE)
        .header("ce-type", kind)
        .header("ce-benchsent", stamp)
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await?;
    let answered_ms = now_ms();
    if response.status().as_u16() != 204 {
        bail!("the event-bus answered {}", response.status());
    }
    Ok(Published {
        sent_ms,
        answered_ms,
    })
}

async fn consumer_settled(
    js: &async_nats::jetstream::Context,
    consumer: &str,
) -> anyhow::Result<bool> {
    let stream = js.get_stream(eddy_platform::nats::EVENTS_STREAM).await?;
    super::consumer_settled(&stream, consumer).await
}

/// Waits until `consumer` has delivered and acknowledged everything stored for it.
pub(super) async fn wait_settled(
    js: &async_nats::jetstream::Context,
    consumer: &str,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(300);
    while !consumer_settled(js, consumer).await? {
        if Instant::now() > deadline {
            bail!("the backlog did not drain in 5 minutes");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

async fn latencies(log: &Path, skip: usize, expected: u64) -> anyhow::Result<Vec<f64>> {
    // The function writes each line before it answers, but an instance that was a warm spare
    // writes into a pipe that eddy copies to the file: the last lines can arrive a moment after
    // the last acknowledgement, and would otherwise count in the next window.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = tokio::fs::read_to_string(log).await.unwrap_or_default();
        let logged: Vec<f64> = text
            .lines()
            .filter_map(|line| line.strip_prefix("latency_ms "))
            .filter_map(|value| value.trim().parse().ok())
            .collect();
        if logged.len() as u64 >= expected {
            let mut values = logged.get(skip..).unwrap_or_default().to_vec();
            values.sort_by(f64::total_cmp);
            return Ok(values);
        }
        if Instant::now() > deadline {
            bail!(
                "the function logged {} latencies, not one for each of the {expected} events published",
                logged.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub(super) fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted
        .get(((sorted.len().saturating_sub(1)) as f64 * q).round() as usize)
        .copied()
        .unwrap_or(0.0)
}

/// Creates or replaces a Function or Subscription (`kind`, plural) in namespace `bench`.
pub(super) async fn put(
    http: &reqwest::Client,
    api: &str,
    kind: &str,
    body: &serde_json::Value,
) -> anyhow::Result<()> {
    let name = body["metadata"]["name"].as_str().unwrap_or_default();
    let response = http
        .put(format!(
            "{api}/apis/eddy.dev/v1alpha1/namespaces/bench/{kind}/{name}"
        ))
        .json(body)
        .send()
        .await?;
    if !response.status().is_success() {
        bail!(
            "cannot create {name}: {}",
            response.text().await.unwrap_or_default()
        );
    }
    Ok(())
}

/// Waits until Subscription `name` in namespace `bench` is ready (its consumer in place).
pub(super) async fn wait_ready(
    http: &reqwest::Client,
    api: &str,
    name: &str,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let status: serde_json::Value = http
            .get(format!(
                "{api}/apis/eddy.dev/v1alpha1/namespaces/bench/subscriptions/{name}"
            ))
            .send()
            .await?
            .json()
            .await?;
        if status["status"]["ready"] == json!(true) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "subscription {name} did not become ready: {}",
                status["status"]
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Publishes at `rate` events per second for `window` (open loop: a send does not wait for the
/// one before, up to [`MAX_UNANSWERED`] at once).
pub(super) async fn offer(
    http: &reqwest::Client,
    url: &str,
    path: &Arc<Probed>,
    next: &AtomicU64,
    rate: u64,
    window: Duration,
) -> anyhow::Result<Offered> {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(1) as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let begun = Instant::now();
    let mut sends = tokio::task::JoinSet::new();
    let mut skipped: u64 = 0;
    let mut sent: u64 = 0;
    let mut answered = Vec::with_capacity((rate as f64 * window.as_secs_f64()) as usize + 1);
    let mut lags = Vec::with_capacity((rate as f64 * window.as_secs_f64()) as usize + 1);
    while begun.elapsed() < window {
        let due = tick.tick().await;
        lags.push(
            tokio::time::Instant::now()
                .saturating_duration_since(due)
                .as_secs_f64()
                * 1000.0,
        );
        while let Some(sent) = sends.try_join_next() {
            answered.push(sent??);
        }
        if sends.len() >= MAX_UNANSWERED {
            skipped += 1;
            continue;
        }
        let (http, url, path, sequence) = (
            http.clone(),
            url.to_owned(),
            path.clone(),
            next.fetch_add(1, Ordering::Relaxed),
        );
        sends.spawn(async move { publish(&http, &url, &path, sequence).await });
        sent += 1;
    }
    lags.sort_by(f64::total_cmp);
    Ok(Offered {
        left_behind: sends.len() as u64 + skipped,
        sends,
        answered,
        sent,
        lag_p99_ms: quantile(&lags, 0.99),
    })
}

/// Waits for every publish still unanswered; all of them, answered earlier or now.
pub(super) async fn finish(
    mut sends: tokio::task::JoinSet<anyhow::Result<Published>>,
    mut answered: Vec<Published>,
) -> anyhow::Result<Vec<Published>> {
    while let Some(sent) = sends.join_next().await {
        answered.push(sent??);
    }
    Ok(answered)
}

/// Events stored for `consumer` and not yet delivered and acknowledged.
async fn undelivered(js: &async_nats::jetstream::Context, consumer: &str) -> anyhow::Result<u64> {
    let stream = js.get_stream(eddy_platform::nats::EVENTS_STREAM).await?;
    let info = stream.consumer_info(consumer).await?;
    Ok(info.num_pending + info.num_ack_pending as u64)
}

/// Whether a backlog of `backlog` events is within [`BACKLOG_BUDGET`] at `rate`. Pure.
pub fn within_budget(rate: u64, backlog: u64) -> bool {
    backlog as f64 <= rate as f64 * BACKLOG_BUDGET.as_secs_f64()
}

/// The search for the maximum sustained rate, as pure state: from a starting rate it goes up by
/// [`GALLOP`] while rates are sustained (down while none is), then halves the bracket between
/// the highest sustained rate and the lowest one that fell behind.
#[derive(Debug, Clone)]
pub struct Search {
    /// The highest rate found sustained (0 before any).
    sustained: f64,
    /// The lowest rate that fell behind, once one did.
    behind: Option<f64>,
    next: f64,
    gallops: usize,
    bisections: usize,
}

impl Search {
    /// A search whose first rate is `start`.
    pub fn new(start: f64) -> Self {
        Self {
            sustained: 0.0,
            behind: None,
            next: start.max(1.0),
            gallops: 0,
            bisections: 0,
        }
    }

    /// The rate to try next; `None` once the search is done.
    pub fn next_rate(&self) -> Option<f64> {
        let bracketed = self.behind.is_some() && self.sustained > 0.0;
        let done = if bracketed {
            self.bisections >= BISECTIONS
        } else {
            self.gallops >= MAX_GALLOPS
        };
        (!done).then_some(self.next)
    }

    /// Records whether `rate` was sustained.
    pub fn record(&mut self, rate: f64, sustained: bool) {
        if sustained {
            self.sustained = self.sustained.max(rate);
        } else {
            self.behind = Some(self.behind.map_or(rate, |behind| behind.min(rate)));
        }
        match self.behind {
            // Nothing fell behind yet: go up.
            None => {
                self.gallops += 1;
                self.next = rate * GALLOP;
            }
            // Nothing sustained yet: come down.
            Some(behind) if self.sustained == 0.0 => {
                self.gallops += 1;
                self.next = behind / GALLOP;
            }
            Some(behind) => {
                self.bisections += 1;
                self.next = (self.sustained + behind) / 2.0;
            }
        }
    }

    /// The highest rate found sustained.
    pub fn maximum(&self) -> f64 {
        self.sustained
    }
}

/// The highest rate whose backlog stays within [`BACKLOG_BUDGET`] when offered for `window`,
/// searched from `start` (each probe drains before the next); the probes in order.
pub(super) async fn search_maximum(
    http: &reqwest::Client,
    url: &str,
    path: &Arc<Probed>,
    js: &async_nats::jetstream::Context,
    next: &AtomicU64,
    start: f64,
    window: Duration,
) -> anyhow::Result<(f64, Vec<Probe>)> {
    let mut search = Search::new(start);
    let mut probes = Vec::new();
    while let Some(rate) = search.next_rate() {
        let rate = rate as u64;
        let Offered {
            left_behind,
            sends,
            answered,
            ..
        } = offer(http, url, path, next, rate, window).await?;
        let backlog = left_behind + undelivered(js, &path.consumer).await?;
        finish(sends, answered).await?;
        wait_settled(js, &path.consumer).await?;
        let sustained = within_budget(rate, backlog);
        probes.push(Probe {
            rate,
            backlog,
            sustained,
        });
        search.record(rate as f64, sustained);
    }
    Ok((search.maximum(), probes))
}

/// Runs the scenario on a started platform whose data dir is `data_dir`.
pub async fn run(
    platform: &Platform,
    data_dir: &Path,
    duration: Duration,
    connections: usize,
) -> anyhow::Result<EndToEnd> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(connections)
        .build()?;
    let api = &platform.api_url;
    let function = json!({"apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
        "metadata": {"name": "noop", "namespace": "bench"},
        "spec": {"runtime": "nodejs20", "replicas": 1, "source": {"inline": {"source": HANDLER}}}});
    let subscription = json!({"apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
        "metadata": {"name": "e2e", "namespace": "bench"},
        "spec": {"sink": "http://noop.bench.svc.cluster.local", "types": ["bench.e2e.v1"],
            "config": {"maxInFlightMessages": 64}}});
    put(&http, api, "functions", &function).await?;
    put(&http, api, "subscriptions", &subscription).await?;
    wait_ready(&http, api, "e2e").await?;
    let client = platform.nats_client().await?;
    let js = async_nats::jetstream::new(client);
    let log = data_dir.join("logs/functions/bench/noop.log");
    let publish_url = format!("{}/publish", platform.bus_url);
    let path = Arc::new(Probed {
        kind: "bench.e2e.v1",
        ids: "e2e".into(),
        consumer: consumer_name("bench", "e2e"),
    });

    // The search's bracket: publish as fast as the bus takes it, then wait for the backlog.
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let (http, url, next, path) = (
            http.clone(),
            publish_url.clone(),
            next.clone(),
            path.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while started.elapsed() < duration {
                publish(&http, &url, &path, next.fetch_add(1, Ordering::Relaxed)).await?;
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    wait_settled(&js, &path.consumer).await?;
    let published = next.load(Ordering::Relaxed);
    let closed_loop_rate = published as f64 / started.elapsed().as_secs_f64();

    // The maximum: the highest rate whose backlog stays in budget, searched from the closed loop.
    let (max_rate, probes) = search_maximum(
        &http,
        &publish_url,
        &path,
        &js,
        &next,
        closed_loop_rate,
        duration,
    )
    .await?;
    let mut seen = latencies(&log, 0, next.load(Ordering::Relaxed))
        .await?
        .len();

    // Fixed rates: a quarter, half and three quarters of the maximum.
    let mut results = Vec::new();
    for fraction in [0.25, 0.5, 0.75] {
        let rate = ((max_rate * fraction) as u64).max(1);
        let offered = offer(&http, &publish_url, &path, &next, rate, duration).await?;
        finish(offered.sends, offered.answered).await?;
        wait_settled(&js, &path.consumer).await?;
        let values = latencies(&log, seen, next.load(Ordering::Relaxed)).await?;
        seen += values.len();
        results.push(Latency {
            rate,
            count: values.len(),
            p50_ms: quantile(&values, 0.5),
            p99_ms: quantile(&values, 0.99),
            p999_ms: quantile(&values, 0.999),
            bench_lag_p99_ms: offered.lag_p99_ms,
        });
    }
    Ok(EndToEnd {
        max_rate,
        closed_loop_rate,
        probes,
        latencies: results,
        instance_starts: instance_starts(&http, &platform.gateway_url).await,
    })
}

/// The bench function's instances started so far, from a warm spare and as processes of their
/// own, as the gateway's `/metrics` counts them.
async fn instance_starts(http: &reqwest::Client, gateway: &str) -> Option<(u64, u64)> {
    let text = http
        .get(format!("{gateway}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    let count = |origin: &str| {
        let prefix = format!(
            r#"eddy_function_instance_starts_total{{namespace="bench",function="noop",origin="{origin}"}} "#
        );
        text.lines()
            .find_map(|line| line.strip_prefix(&prefix))?
            .trim()
            .parse()
            .ok()
    };
    Some((count("warm_spare")?, count("process")?))
}

pub(super) async fn end_to_end(flags: &LoadFlags) -> anyhow::Result<()> {
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
        "{:>10} {:>8} {:>10} {:>10} {:>10} {:>16}",
        "rate/s", "count", "p50 ms", "p99 ms", "p999 ms", "bench lag p99 ms"
    );
    for latency in &measured.latencies {
        println!(
            "{:>10} {:>8} {:>10.2} {:>10.2} {:>10.2} {:>16.2}",
            latency.rate,
            latency.count,
            latency.p50_ms,
            latency.p99_ms,
            latency.p999_ms,
            latency.bench_lag_p99_ms
        );
    }
    let starts = measured.instance_starts;
    match starts {
        Some((warm, process)) => println!(
            "the function's instances: {warm} from a warm spare (its output reaches the log through eddy), {process} started as a process of its own"
        ),
        None => {
            println!("the function's instances: unknown (the gateway's metrics were unreadable)")
        }
    }
    write_json(
        flags.out.as_ref(),
        &json!({"scenario": "e2e", "maxRate": measured.max_rate,
            "closedLoopRate": measured.closed_loop_rate, "probes": measured.probes,
            "latencies": measured.latencies,
            "instanceStarts": starts.map(|(warm, process)| json!({"warmSpare": warm, "process": process}))}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backlog_is_judged_in_time_at_the_rate() {
        assert!(within_budget(4_000, 400));
        assert!(!within_budget(4_000, 401));
        assert!(within_budget(1, 0));
        assert!(!within_budget(0, 1));
    }

    /// Runs a search against a path that sustains exactly `capacity` events/s.
    fn searched(start: f64, capacity: f64) -> (Search, Vec<f64>) {
        let mut search = Search::new(start);
        let mut tried = Vec::new();
        while let Some(rate) = search.next_rate() {
            tried.push(rate);
            search.record(rate, rate <= capacity);
        }
        (search, tried)
    }

    #[test]
    fn the_search_goes_up_past_a_low_start_then_narrows() {
        let (search, tried) = searched(2_000.0, 7_800.0);
        assert_eq!(&tried[..4], &[2_000.0, 3_000.0, 4_500.0, 6_750.0]);
        assert_eq!(tried[4], 10_125.0, "the first rate that falls behind");
        assert_eq!(tried.len(), 4 + BISECTIONS);
        let maximum = search.maximum();
        assert!(maximum <= 7_800.0 && maximum > 7_800.0 * 0.97, "{maximum}");
    }

    #[test]
    fn the_search_comes_down_from_a_start_that_falls_behind() {
        let (search, tried) = searched(6_000.0, 1_000.0);
        assert_eq!(&tried[..3], &[6_000.0, 4_000.0, 6_000.0 / 1.5 / 1.5]);
        let maximum = search.maximum();
        assert!(maximum <= 1_000.0 && maximum > 1_000.0 * 0.8, "{maximum}");
    }

    #[test]
    fn the_search_ends_going_up_when_everything_is_sustained() {
        let (search, tried) = searched(1_000.0, f64::INFINITY);
        assert_eq!(tried.len(), MAX_GALLOPS);
        assert_eq!(search.maximum(), *tried.last().unwrap());
    }
}
