//! `real-node`: eddy's chart on a cluster with real pods (`scripts/kube up --node real`, the
//! chart installed with `charts/eddy/ci/real-node-values.yaml`), measured from the host:
//!
//! - a buildless Function's apply → Running (its Deployment available), without dependencies
//!   and with lodash (installed when the pod starts, through the node's proxy);
//! - publish → function latency at a fixed rate through the pods: the event-bus Service, NATS,
//!   the dispatcher's pod, the function's Service and pod. The function logs how long ago each
//!   event was published (one machine, one clock); the log is read back after the run.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use eddy_model::resources::{ConditionStatus, Function, Subscription};
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, LogParams, PostParams},
};
use serde_json::json;

use super::e2e::{HANDLER, publish_stamped, quantile};

/// Settings of the run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Events per second offered.
    pub rate: u64,
    /// How long events are offered.
    pub duration: Duration,
    /// Where eddy's chart runs.
    pub system_namespace: String,
    /// Apply → Running runs per case.
    pub runs: usize,
}

/// Runs the benchmark against the cluster of the current kubeconfig and prints the figures.
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let client = Client::try_default()
        .await
        .context("a kubeconfig for the real node's cluster (eval \"$(scripts/kube env)\")")?;
    let namespace = format!("bench-{}", &uuid::Uuid::new_v4().simple().to_string()[..6]);
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": namespace}}))?,
        )
        .await
        .with_context(|| format!("creating namespace {namespace}"))?;
    let result = measure(&client, &namespace, &settings).await;
    let _ = namespaces
        .delete(&namespace, &DeleteParams::default())
        .await;
    result
}

async fn measure(client: &Client, namespace: &str, settings: &Settings) -> anyhow::Result<()> {
    let functions: Api<Function> = Api::namespaced(client.clone(), namespace);
    println!(
        "real node: buildless Function apply → Running ({} runs each)",
        settings.runs
    );
    for (case, dependencies) in [
        ("no dependencies", ""),
        ("lodash", r#"{"dependencies": {"lodash": "4.17.21"}}"#),
    ] {
        let mut times = Vec::new();
        for run in 0..settings.runs {
            let name = format!(
                "start-{}-{run}",
                if dependencies.is_empty() {
                    "plain"
                } else {
                    "lodash"
                }
            );
            times.push(
                apply_until_running(&functions, &name, dependencies)
                    .await?
                    .as_secs_f64(),
            );
            functions.delete(&name, &DeleteParams::default()).await?;
        }
        times.sort_by(f64::total_cmp);
        println!(
            "  {case:<16} median {:.1} s, min {:.1} s, max {:.1} s",
            quantile(&times, 0.5),
            times.first().copied().unwrap_or(0.0),
            times.last().copied().unwrap_or(0.0)
        );
    }

    apply_until_running(&functions, "sink", "").await?;
    let subscriptions: Api<Subscription> = Api::namespaced(client.clone(), namespace);
    let subscription: Subscription = serde_json::from_value(json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
        "metadata": {"name": "to-sink"},
        "spec": {"sink": format!("http://sink.{namespace}.svc.cluster.local"),
                 "types": ["bench.realnode.v1"], "config": {"maxInFlightMessages": 64}},
    }))?;
    subscriptions
        .create(&PostParams::default(), &subscription)
        .await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let current = subscriptions.get("to-sink").await?;
        let ready = current.status.as_ref().is_some_and(|status| {
            status.conditions.iter().any(|condition| {
                condition.type_ == "Ready" && condition.status == ConditionStatus::True
            })
        });
        if ready {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "the Subscription was not Ready in 60 s: {:?}",
                current.status
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let services: Api<Service> = Api::namespaced(client.clone(), &settings.system_namespace);
    let bus = services
        .get("eddy-event-bus")
        .await
        .context("the event-bus Service")?;
    let ip = bus
        .spec
        .and_then(|spec| spec.cluster_ip)
        .context("the event-bus Service's ClusterIP")?;
    let url = format!("http://{ip}/publish");
    let http = reqwest::Client::new();
    let total = settings.rate * settings.duration.as_secs();
    let interval = Duration::from_secs_f64(1.0 / settings.rate as f64);
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut sends = tokio::task::JoinSet::new();
    for sequence in 0..total {
        ticker.tick().await;
        let http = http.clone();
        let url = url.clone();
        // Ids of this run alone: the same source and id within JetStream's duplicate window
        // is the same event, stored once (an earlier run's ids would be answered 2xx and
        // never delivered again).
        let id = format!("{namespace}-{sequence}");
        sends.spawn(async move { publish_stamped(&http, &url, "bench.realnode.v1", &id).await });
    }
    while let Some(sent) = sends.join_next().await {
        sent??;
    }

    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let deadline = Instant::now() + Duration::from_secs(120);
    let latencies = loop {
        let (mut values, read) = sink_latencies(&pods).await?;
        if values.len() as u64 >= total {
            values.sort_by(f64::total_cmp);
            break values;
        }
        if Instant::now() > deadline {
            bail!(
                "{} of {total} events reached the function in 2 minutes (read: {read})",
                values.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    println!(
        "real node: publish → function through the pods at {} events/s for {:?}: {} events, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        settings.rate,
        settings.duration,
        latencies.len(),
        quantile(&latencies, 0.5),
        quantile(&latencies, 0.99),
        latencies.last().copied().unwrap_or(0.0)
    );
    Ok(())
}

/// The latencies the sink logged, from every pod of it (a rollout may leave two) and from the
/// container before a restart, and what was read, pod by pod, for an error.
async fn sink_latencies(pods: &Api<Pod>) -> anyhow::Result<(Vec<f64>, String)> {
    let mut values = Vec::new();
    let mut read = Vec::new();
    for pod in pods
        .list(&ListParams::default().labels("eddy.dev/function=sink"))
        .await?
        .items
    {
        let name = pod.metadata.name.clone().context("the pod's name")?;
        let restarted = pod
            .status
            .and_then(|status| status.container_statuses)
            .into_iter()
            .flatten()
            .any(|container| container.name == "function" && container.restart_count > 0);
        for previous in [false, true].into_iter().filter(|p| !p || restarted) {
            let params = LogParams {
                container: Some("function".into()),
                previous,
                ..LogParams::default()
            };
            let log = pods.logs(&name, &params).await.unwrap_or_default();
            let before = values.len();
            values.extend(
                log.lines()
                    .filter_map(|line| line.strip_prefix("latency_ms "))
                    .filter_map(|value| value.trim().parse::<f64>().ok()),
            );
            let which = if previous {
                " (before its restart)"
            } else {
                ""
            };
            read.push(format!("{name}{which}: {}", values.len() - before));
        }
    }
    Ok((values, read.join(", ")))
}

/// Applies a nodejs22 Function and waits for its Running condition; how long that took.
async fn apply_until_running(
    functions: &Api<Function>,
    name: &str,
    dependencies: &str,
) -> anyhow::Result<Duration> {
    let function: Function = serde_json::from_value(json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
        "metadata": {"name": name},
        "spec": {"runtime": "nodejs22",
                 "source": {"inline": {"source": HANDLER, "dependencies": dependencies}}},
    }))?;
    let started = Instant::now();
    functions.create(&PostParams::default(), &function).await?;
    let deadline = started + Duration::from_secs(300);
    loop {
        let current = functions.get(name).await?;
        let running = current.status.as_ref().is_some_and(|status| {
            status.conditions.iter().any(|condition| {
                condition.type_ == "Running" && condition.status == ConditionStatus::True
            })
        });
        if running {
            return Ok(started.elapsed());
        }
        if Instant::now() > deadline {
            bail!(
                "Function {name} was not Running in 5 minutes: {:?}",
                current.status
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
