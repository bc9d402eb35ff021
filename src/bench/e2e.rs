//! `e2e`: publish → event-bus → JetStream → dispatcher → gateway → nodejs20 no-op function.
//!
//! The function logs, for every event, how long ago it was published (wall clock, sub-ms),
//! read back from its log after the run. First the maximum sustained rate (closed loop until the
//! backlog drains), then latency at fixed rates (open loop).

use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::bail;
use serde_json::json;

use crate::up::Platform;

const HANDLER: &str = "module.exports = { main: async (event) => {\n  const sent = Number(event[\"ce-benchsent\"]);\n  if (sent) console.log(\"latency_ms \" + ((performance.timeOrigin + performance.now()) - sent).toFixed(3));\n  return \"\";\n} };\n";

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
}

pub(super) fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

async fn publish(http: &reqwest::Client, url: &str, sequence: u64) -> anyhow::Result<()> {
    let response = http
        .post(url)
        .header("ce-specversion", "1.0")
        .header("ce-id", format!("e2e-{sequence}"))
        .header("ce-source", "bench")
        .header("ce-type", "bench.e2e.v1")
        .header("ce-benchsent", format!("{:.3}", now_ms()))
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await?;
    if response.status().as_u16() != 204 {
        bail!("the event-bus answered {}", response.status());
    }
    Ok(())
}

async fn consumer_settled(js: &async_nats::jetstream::Context) -> anyhow::Result<bool> {
    let stream = js.get_stream(eddy_platform::nats::EVENTS_STREAM).await?;
    super::consumer_settled(&stream, "sub_bench_e2e").await
}

async fn wait_settled(js: &async_nats::jetstream::Context) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(300);
    while !consumer_settled(js).await? {
        if Instant::now() > deadline {
            bail!("the backlog did not drain in 5 minutes");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

fn latencies(log: &Path, skip: usize) -> Vec<f64> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut values: Vec<f64> = text
        .lines()
        .filter_map(|line| line.strip_prefix("latency_ms "))
        .filter_map(|value| value.trim().parse().ok())
        .skip(skip)
        .collect();
    values.sort_by(f64::total_cmp);
    values
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

/// Runs the scenario on a started platform whose data dir is `data_dir`.
pub async fn run(
    platform: &Platform,
    data_dir: &Path,
    duration: Duration,
    connections: usize,
) -> anyhow::Result<(f64, Vec<Latency>)> {
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

    // Maximum sustained rate: publish as fast as the bus takes it, then wait for the backlog.
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let (http, url, next) = (http.clone(), publish_url.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            while started.elapsed() < duration {
                publish(&http, &url, next.fetch_add(1, Ordering::Relaxed)).await?;
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    wait_settled(&js).await?;
    let published = next.load(Ordering::Relaxed);
    let max_rate = published as f64 / started.elapsed().as_secs_f64();
    let mut seen = latencies(&log, 0).len();

    // Fixed rates: a quarter, half and three quarters of the maximum.
    let mut results = Vec::new();
    for fraction in [0.25, 0.5, 0.75] {
        let rate = ((max_rate * fraction) as u64).max(1);
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let begun = Instant::now();
        let mut sends = tokio::task::JoinSet::new();
        while begun.elapsed() < duration {
            tick.tick().await;
            let (http, url, sequence) = (
                http.clone(),
                publish_url.clone(),
                next.fetch_add(1, Ordering::Relaxed),
            );
            sends.spawn(async move { publish(&http, &url, sequence).await });
            while let Some(sent) = sends.try_join_next() {
                sent??;
            }
        }
        while let Some(sent) = sends.join_next().await {
            sent??;
        }
        // Node writes to a file synchronously, before it answers: once acked, the line is there.
        wait_settled(&js).await?;
        let values = latencies(&log, seen);
        seen += values.len();
        results.push(Latency {
            rate,
            count: values.len(),
            p50_ms: quantile(&values, 0.5),
            p99_ms: quantile(&values, 0.99),
            p999_ms: quantile(&values, 0.999),
        });
    }
    Ok((max_rate, results))
}
