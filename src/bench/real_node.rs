//! `real-node`: eddy's chart on a cluster with real pods (`scripts/kube up --node real`, the
//! chart installed with `charts/eddy/ci/real-node-values.yaml`), measured from the host:
//!
//! - a buildless Function's apply → Running (its Deployment available), without dependencies
//!   and with lodash (installed when the pod starts, through the node's proxy);
//! - the highest rate sustained through the pods (the event-bus Service, NATS, the dispatcher's
//!   pod, the function's Service and pod), searched as `e2e` searches it locally: the backlog
//!   left when each rate's window ends, read from the consumer in the chart's NATS;
//! - publish → function latency at half that rate (or at `--latency-at`). The function keeps
//!   how long ago each event was published (one machine, one clock) and hands the figures
//!   over on a GET after the run.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, atomic::AtomicU64},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use eddy_controller::kubernetes::render::FUNCTION_PORT;
use eddy_model::resources::{ConditionStatus, Function, Subscription, consumer_name};
use futures::TryStreamExt as _;
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret, Service};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, PartialObjectMeta, PostParams},
};
use serde_json::json;

use super::{
    e2e::{
        EVENT_SOURCE, HANDLER, Probed, finish, now_ms, offer, quantile, search_maximum,
        wait_settled,
    },
    per_event::{self, CpuMeter, CpuSource, Measured, SINK_HANDLER, SINK_RUNTIME, decode_sink},
};

/// The type of the events the bench publishes.
const EVENT_TYPE: &str = "bench.realnode.v1";

/// The run's Subscription of the sink.
const SUBSCRIPTION: &str = "to-sink";

/// Settings of the run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The first rate the search for the maximum offers, events per second.
    pub rate: u64,
    /// How long each rate is offered.
    pub duration: Duration,
    /// Where eddy's chart runs.
    pub system_namespace: String,
    /// Apply → Running runs per case.
    pub runs: usize,
    /// Measure apply → Running only.
    pub starts_only: bool,
    /// Measure latency at this rate only, without searching for the maximum (A/B comparisons
    /// at one rate).
    pub latency_at: Option<u64>,
    /// Measure CPU per delivered event and each hop's latency at these rates only (as
    /// `eddy bench per-event` does locally), without searching for the maximum.
    pub per_event: Vec<u64>,
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
    // Every run's Subscription takes the same event type: one left behind while its namespace
    // terminates (minutes, with the pods' grace periods) would take the next run's events too
    // and double the work it measures. It goes first, and the run waits until it is gone.
    let subscriptions: Api<Subscription> = Api::namespaced(client.clone(), &namespace);
    if subscriptions
        .delete(SUBSCRIPTION, &DeleteParams::default())
        .await
        .is_ok()
    {
        wait_gone(&subscriptions, SUBSCRIPTION, Duration::from_secs(60)).await;
    }
    // The next run must not measure this one's teardown. A namespace with pods deletes them
    // first and its other objects only after their grace period's estimate (minutes), while
    // the Function's Deployment, unable to make pods, keeps the controllers busy. So the sink
    // goes first, then the namespace, emptied of pods, which goes at once.
    let functions: Api<Function> = Api::namespaced(client.clone(), &namespace);
    if functions
        .delete("sink", &DeleteParams::default())
        .await
        .is_ok()
        && let Err(error) = wait_pods_gone(&client, &namespace, "sink").await
    {
        eprintln!("{error:#}");
    }
    if namespaces
        .delete(&namespace, &DeleteParams::default())
        .await
        .is_ok()
    {
        wait_gone(&namespaces, &namespace, Duration::from_secs(120)).await;
    }
    result
}

async fn measure(client: &Client, namespace: &str, settings: &Settings) -> anyhow::Result<()> {
    let functions: Api<Function> = Api::namespaced(client.clone(), namespace);
    let starts = settings.runs > 0 && settings.per_event.is_empty();
    if starts {
        println!(
            "real node: buildless Function apply → Running ({} runs each)",
            settings.runs
        );
    }
    let cases = [
        ("no dependencies", ""),
        ("lodash", r#"{"dependencies": {"lodash": "4.17.21"}}"#),
    ];
    for (case, dependencies) in cases.into_iter().filter(|_| starts) {
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
                apply_until_running(&functions, &name, HANDLER, dependencies)
                    .await?
                    .as_secs_f64(),
            );
            functions.delete(&name, &DeleteParams::default()).await?;
            // The next run starts when this one's pod is gone: until then its CPU request
            // holds the room the next pod needs on a full node, and the next pod would wait
            // for the scheduler, which is capacity, not start time.
            wait_pods_gone(client, namespace, &name).await?;
        }
        times.sort_by(f64::total_cmp);
        println!(
            "  {case:<16} median {:.2} s, min {:.2} s, max {:.2} s",
            quantile(&times, 0.5),
            times.first().copied().unwrap_or(0.0),
            times.last().copied().unwrap_or(0.0)
        );
    }

    if settings.starts_only {
        return Ok(());
    }
    apply_until_running(&functions, "sink", SINK_HANDLER, "").await?;
    let subscriptions: Api<Subscription> = Api::namespaced(client.clone(), namespace);
    let subscription: Subscription = serde_json::from_value(json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
        "metadata": {"name": SUBSCRIPTION},
        "spec": {"sink": format!("http://sink.{namespace}.svc.cluster.local"),
                 "types": [EVENT_TYPE], "config": {"maxInFlightMessages": 64}},
    }))?;
    subscriptions
        .create(&PostParams::default(), &subscription)
        .await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let current = subscriptions.get(SUBSCRIPTION).await?;
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
    let cluster_ip = |name: &'static str| {
        let services = services.clone();
        async move {
            services
                .get(name)
                .await
                .with_context(|| format!("the {name} Service"))?
                .spec
                .and_then(|spec| spec.cluster_ip)
                .with_context(|| format!("the {name} Service's ClusterIP"))
        }
    };
    let url = format!("http://{}/publish", cluster_ip("eddy-event-bus").await?);
    // The backlog is read from NATS itself (its pods have no sidecar; kube-proxy serves the
    // ClusterIP on the host), as the chart's admin user: its NATS takes no anonymous client.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &settings.system_namespace);
    let admin_password = secrets
        .get("eddy-nats-auth")
        .await
        .context("the chart's NATS users (Secret eddy-nats-auth)")?
        .data
        .and_then(|mut data| data.remove("admin"))
        .and_then(|password| String::from_utf8(password.0).ok())
        .context("the admin password in Secret eddy-nats-auth")?;
    let nats = async_nats::ConnectOptions::with_user_and_password(
        crate::nats_auth::Component::Admin.user().to_owned(),
        admin_password,
    )
    .connect(format!("nats://{}:4222", cluster_ip("eddy-nats").await?))
    .await
    .context("connecting to the chart's NATS")?;
    let js = async_nats::jetstream::new(nats);
    // The events of earlier runs go: a search stores hundreds of thousands, and a stream at its
    // `maxBytes` refuses new ones (503) rather than dropping old ones. Only the bench's own
    // subject is purged.
    let subject = eddy_model::subject::event_subject(EVENT_SOURCE, EVENT_TYPE)?;
    js.get_stream(eddy_platform::nats::EVENTS_STREAM)
        .await
        .context("the chart's event stream")?
        .purge()
        .filter(subject)
        .await
        .context("purging the events of earlier runs")?;
    // Every connection a probe opened stays in the pool for the next: one closed per publish
    // beyond a smaller pool leaves a socket in TIME_WAIT for a minute, and a search through
    // thousands of events per second runs out of local ports for the ClusterIP.
    let http = reqwest::Client::builder()
        .pool_idle_timeout(Duration::from_secs(90))
        .build()?;
    // Ids of this run alone: the same source and id within JetStream's duplicate window is the
    // same event, stored once (an earlier run's ids would be answered 2xx and never delivered
    // again).
    let path = Arc::new(Probed {
        kind: EVENT_TYPE,
        ids: namespace.to_owned(),
        consumer: consumer_name(namespace, SUBSCRIPTION),
    });
    let next = AtomicU64::new(0);
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    if !settings.per_event.is_empty() {
        let drain = || -> futures::future::BoxFuture<'static, anyhow::Result<Vec<Measured>>> {
            let (http, pods) = (http.clone(), pods.clone());
            Box::pin(async move { Ok(drain_sink(&http, &pods).await?.0) })
        };
        let meter = platform_cpu(client, &settings.system_namespace).await?;
        let path = per_event::EventPath {
            http: &http,
            url: &url,
            probed: &path,
            js: &js,
            next: &next,
            drain: &drain,
        };
        let (idle, windows) =
            per_event::measure(&path, &meter, &settings.per_event, settings.duration).await?;
        println!(
            "per event, through pods: every container of the pods in namespace {} (NATS and the sidecars included), a {SINK_RUNTIME} sink, {:?} per window",
            settings.system_namespace, settings.duration
        );
        per_event::print("pods", &idle, &windows);
        return Ok(());
    }
    let half = match settings.latency_at {
        Some(rate) => rate.max(1),
        None => {
            let (max_rate, probes) = search_maximum(
                &http,
                &url,
                &path,
                &js,
                &next,
                settings.rate as f64,
                settings.duration,
            )
            .await?;
            for probe in &probes {
                println!(
                    "  offered {:>6}/s for {:?}: backlog {:>6} at the end, {}",
                    probe.rate,
                    settings.duration,
                    probe.backlog,
                    if probe.sustained {
                        "sustained"
                    } else {
                        "fell behind"
                    }
                );
            }
            println!("real node: maximum sustained rate through the pods {max_rate:.0} events/s");
            ((max_rate / 2.0) as u64).max(1)
        }
    };

    // The sink is read before the warm-up (it forgets what it held) and once more after the last
    // window, which are told apart by send time. Reading it is the one request the measured
    // events never make (a GET answered with bytes): a read between windows had V8 throw away
    // code it had optimized for the load (16–27 functions of the request path,
    // `--trace-deopt`) and compile it again in the next window, a stall of 40–110 ms on the
    // busy cores.
    drain_sink(&http, &pods).await?;
    let warm_up = offer(&http, &url, &path, &next, half, settings.duration).await?;
    // Every event sent, answered or not yet: wait_settled has seen them delivered, and the
    // sink must hand over as many.
    let mut sent = usize::try_from(warm_up.sent)?;
    finish(warm_up.sends, warm_up.answered).await?;
    wait_settled(&js, &path.consumer).await?;
    // At a chosen rate, three windows; after a search, one.
    let count = if settings.latency_at.is_some() { 3 } else { 1 };
    let mut windows = Vec::with_capacity(count);
    for _ in 0..count {
        let first_send_ms = now_ms();
        let window = offer(&http, &url, &path, &next, half, settings.duration).await?;
        let last_send_ms = now_ms();
        sent += usize::try_from(window.sent)?;
        finish(window.sends, window.answered).await?;
        wait_settled(&js, &path.consumer).await?;
        windows.push((first_send_ms..=last_send_ms, window.lag_p99_ms));
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut measured = Vec::with_capacity(sent);
    loop {
        let (values, read) = drain_sink(&http, &pods).await?;
        measured.extend(values);
        if measured.len() >= sent {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "{} of {sent} events measured by the function in 2 minutes (last read: {read})",
                measured.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for (sent_in, lag_p99_ms) in windows {
        let mut in_window: Vec<Measured> = measured
            .iter()
            .filter(|event| sent_in.contains(&event.sent_ms))
            .copied()
            .collect();
        let bursts = slowest_bursts(&mut in_window);
        let mut latencies: Vec<f64> = in_window.iter().map(|event| event.latency_ms).collect();
        latencies.sort_by(f64::total_cmp);
        println!(
            "real node: publish → function at {half} events/s for {:?}: {} events, p50 {:.2} ms, p99 {:.2} ms, p999 {:.2} ms, max {:.2} ms",
            settings.duration,
            latencies.len(),
            quantile(&latencies, 0.5),
            quantile(&latencies, 0.99),
            quantile(&latencies, 0.999),
            latencies.last().copied().unwrap_or(0.0)
        );
        println!("  {bursts}; the bench's sends behind its schedule: p99 {lag_p99_ms:.2} ms");
    }
    Ok(())
}

/// Events sent within this many milliseconds of each other belong to one burst of the tail.
const BURST_GAP_MS: f64 = 50.0;

/// When the slowest 1% of a window's events were sent, as bursts (sent within
/// [`BURST_GAP_MS`] of each other): a few long bursts are stalls (a pause, a process starved
/// of the CPU), many short ones are queueing spread through the window.
fn slowest_bursts(events: &mut [Measured]) -> String {
    let Some(start) = events.iter().map(|event| event.sent_ms).reduce(f64::min) else {
        return "no events".to_owned();
    };
    events.sort_by(|a, b| b.latency_ms.total_cmp(&a.latency_ms));
    let tail = events.len().div_ceil(100);
    let slowest = &mut events[..tail];
    slowest.sort_by(|a, b| a.sent_ms.total_cmp(&b.sent_ms));
    let mut bursts: Vec<(f64, f64, usize)> = Vec::new();
    for event in slowest.iter() {
        match bursts.last_mut() {
            Some((_, last, count)) if event.sent_ms - *last <= BURST_GAP_MS => {
                *last = event.sent_ms;
                *count += 1;
            }
            _ => bursts.push((event.sent_ms, event.sent_ms, 1)),
        }
    }
    let shown: Vec<String> = bursts
        .iter()
        .map(|(first, last, count)| {
            format!(
                "{count} at +{:.2} s over {:.0} ms",
                (first - start) / 1000.0,
                last - first
            )
        })
        .collect();
    format!(
        "slowest 1% ({} events; the window began at {:.3} s Unix time) in {} bursts: {}",
        slowest.len(),
        start / 1000.0,
        bursts.len(),
        shown.join(", ")
    )
}

/// The CPU of every running container of the pods in `namespace` (eddy's), each a part named
/// `<component>/<container>`, read from the container's cgroup on this machine (the real
/// node's): the kubelet's cgroup driver is cgroupfs, so a pod's cgroup is a directory
/// `pod<uid>` and its containers' are named by their ids.
async fn platform_cpu(client: &Client, namespace: &str) -> anyhow::Result<CpuMeter> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let mut meter = CpuMeter::default();
    let roots: Vec<PathBuf> = [
        "/sys/fs/cgroup/cpuacct",
        "/sys/fs/cgroup/cpu,cpuacct",
        "/sys/fs/cgroup",
    ]
    .into_iter()
    .map(PathBuf::from)
    .filter(|root| root.is_dir())
    .collect();
    for pod in pods.list(&ListParams::default()).await?.items {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let component = pod
            .metadata
            .labels
            .as_ref()
            .and_then(|labels| labels.get("app.kubernetes.io/component"))
            .cloned()
            .unwrap_or_else(|| name.clone());
        let uid = pod.metadata.uid.clone().context("a pod without a uid")?;
        let pod_dir = roots
            .iter()
            .find_map(|root| find_dir(root, &format!("pod{uid}"), 6))
            .with_context(|| format!("no cgroup of pod {name} (pod{uid}) under /sys/fs/cgroup: is this the real node?"))?;
        // Native sidecars (the mesh's istio-proxy) run among the init containers.
        let statuses = pod
            .status
            .map(|status| {
                let mut statuses = status.container_statuses.unwrap_or_default();
                statuses.extend(status.init_container_statuses.unwrap_or_default());
                statuses
            })
            .unwrap_or_default();
        for status in statuses {
            let running = status
                .state
                .as_ref()
                .is_some_and(|state| state.running.is_some());
            let Some(id) = status
                .container_id
                .as_deref()
                .and_then(|id| id.split("://").nth(1))
                .filter(|_| running)
            else {
                continue;
            };
            let dir = pod_dir.join(id);
            if !dir.is_dir() {
                bail!(
                    "no cgroup of container {} of pod {name} ({})",
                    status.name,
                    dir.display()
                );
            }
            meter.add(
                format!("{component}/{}", status.name),
                CpuSource::Cgroup(dir),
            );
        }
    }
    Ok(meter)
}

/// The first directory named `name` under `root`, at most `depth` levels down.
fn find_dir(root: &Path, name: &str, depth: usize) -> Option<PathBuf> {
    let entries = std::fs::read_dir(root).ok()?;
    let mut below = Vec::new();
    for entry in entries.flatten() {
        if !entry.file_type().is_ok_and(|kind| kind.is_dir()) {
            continue;
        }
        if entry.file_name() == name {
            return Some(entry.path());
        }
        below.push(entry.path());
    }
    if depth == 0 {
        return None;
    }
    below.iter().find_map(|dir| find_dir(dir, name, depth - 1))
}

/// Takes the latencies every pod of the sink holds (a rollout or a scale-out may leave several),
/// which forget them; and what was read, pod by pod, for an error. A pod that restarted lost
/// its own, and the run fails on the count.
async fn drain_sink(
    http: &reqwest::Client,
    pods: &Api<Pod>,
) -> anyhow::Result<(Vec<Measured>, String)> {
    let mut values = Vec::new();
    let mut read = Vec::new();
    for pod in pods.list(&function_pods("sink")).await?.items {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let Some(ip) = pod.status.and_then(|status| status.pod_ip) else {
            read.push(format!("{name}: no IP"));
            continue;
        };
        // The pod itself, not its Service: each pod holds its own.
        let body = match http
            .get(format!("http://{ip}:{FUNCTION_PORT}/"))
            .send()
            .await
        {
            Ok(response) if response.status().is_success() => response.bytes().await?,
            Ok(response) => {
                read.push(format!("{name}: {}", response.status()));
                continue;
            }
            Err(error) => {
                read.push(format!("{name}: {error}"));
                continue;
            }
        };
        let before = values.len();
        values.extend(decode_sink(&body));
        read.push(format!("{name}: {}", values.len() - before));
    }
    Ok((values, read.join(", ")))
}

/// Applies a Function of the sink's runtime and waits for its Running condition; how long that took.
async fn apply_until_running(
    functions: &Api<Function>,
    name: &str,
    source: &str,
    dependencies: &str,
) -> anyhow::Result<Duration> {
    let function: Function = serde_json::from_value(json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
        "metadata": {"name": name},
        "spec": {"runtime": SINK_RUNTIME,
                 "source": {"inline": {"source": source, "dependencies": dependencies}}},
    }))?;
    let started = Instant::now();
    functions.create(&PostParams::default(), &function).await?;
    // A watch, not a poll: the time is the status change's, not the next poll's.
    let running = |function: Option<&Function>| {
        function
            .and_then(|function| function.status.as_ref())
            .is_some_and(|status| {
                status.conditions.iter().any(|condition| {
                    condition.type_ == "Running" && condition.status == ConditionStatus::True
                })
            })
    };
    match tokio::time::timeout(
        Duration::from_secs(300),
        kube::runtime::wait::await_condition(functions.clone(), name, running),
    )
    .await
    {
        Ok(watched) => {
            watched.with_context(|| format!("watching Function {name}"))?;
            Ok(started.elapsed())
        }
        Err(_) => bail!(
            "Function {name} was not Running in 5 minutes: {:?}",
            functions.get(name).await?.status
        ),
    }
}

/// Waits (with a watch, as for Running) until the object `name` of `api` is gone, at most
/// `within`. Part of a run's clean-up: what goes wrong is said, and the run's own result is what
/// it returns; a run that outlives this may measure the teardown of the one before it.
async fn wait_gone<K>(api: &Api<K>, name: &str, within: Duration)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + 'static,
{
    let kind = K::kind(&());
    let gone = |object: Option<&K>| object.is_none();
    match tokio::time::timeout(
        within,
        kube::runtime::wait::await_condition(api.clone(), name, gone),
    )
    .await
    {
        Ok(Ok(_)) => {}
        Ok(Err(error)) => eprintln!("cannot see whether {kind} {name} is gone: {error}"),
        Err(_) => eprintln!("{kind} {name} was not gone in {within:?}"),
    }
}

/// The pods of the Function `name`, by the label eddy puts on every object of a Function.
fn function_pods(name: &str) -> ListParams {
    ListParams::default().labels(&format!("{}={name}", eddy_platform::scale::FUNCTION_LABEL))
}

/// Waits until no pod of the Function `name` is left in `namespace`: a watch of its pods'
/// metadata, not a list every 100 ms (a run's teardown should not load the API server that the
/// next run shares).
async fn wait_pods_gone(client: &Client, namespace: &str, name: &str) -> anyhow::Result<()> {
    use kube::runtime::{reflector, watcher};
    // Metadata only: the pods' specs and statuses are not needed.
    let pods: Api<PartialObjectMeta<Pod>> = Api::namespaced(client.clone(), namespace);
    let selector = format!("{}={name}", eddy_platform::scale::FUNCTION_LABEL);
    let (store, writer) = reflector::store();
    let events = reflector(
        writer,
        watcher::watcher(pods, watcher::Config::default().labels(&selector)),
    );
    let none_left = async {
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.try_next().await? {
            let settled = matches!(event, watcher::Event::InitDone | watcher::Event::Delete(_));
            if settled && store.is_empty() {
                return Ok(());
            }
        }
        bail!("the watch of Function {name}'s pods ended")
    };
    tokio::time::timeout(Duration::from_secs(120), none_left)
        .await
        .map_err(|_| anyhow::anyhow!("the pods of Function {name} were not gone in 120 s"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(sent_ms: f64, latency_ms: f64) -> Measured {
        Measured {
            latency_ms,
            sent_ms,
        }
    }

    #[test]
    fn the_slowest_events_sent_close_together_are_one_burst() {
        // 300 events a millisecond apart; the slowest 1% (3) are two sent 10 ms apart and one
        // sent 200 ms later.
        let mut events: Vec<Measured> = (0..300)
            .map(|index| event(1_000.0 + f64::from(index), 1.0))
            .collect();
        events[50].latency_ms = 80.0;
        events[60].latency_ms = 90.0;
        events[260].latency_ms = 70.0;
        let bursts = slowest_bursts(&mut events);
        assert!(
            bursts.ends_with("in 2 bursts: 2 at +0.05 s over 10 ms, 1 at +0.26 s over 0 ms"),
            "{bursts}"
        );
        assert!(bursts.starts_with("slowest 1% (3 events"), "{bursts}");
    }

    #[test]
    fn no_events_are_no_bursts() {
        assert_eq!(slowest_bursts(&mut []), "no events");
    }
}
