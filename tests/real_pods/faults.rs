//! Faults in pods: while events are published at a steady rate, one pod at a time is deleted (a
//! NATS server with no grace period, an event-bus pod, the dispatcher's pod, a Function's pod).
//! Every event the event-bus answered 2xx for must reach the Function (counted by id), the
//! duplicates are counted, and every refusal must be a 503 with `Retry-After`.
//!
//! The chart's own NATS cluster runs here: three servers (a StatefulSet), streams at R3
//! (`charts/eddy/ci/real-node-values.yaml`).

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use eddy_testing::eventually;
use serde_json::Value;

use super::*;

/// The worker (two replicas) and the tally (`super::tally`).
fn worker_and_tally(namespace: &str) -> String {
    tally::worker_and_tally(
        namespace,
        "fault",
        &tally::Worker {
            scaling: "replicas: 2",
            dependencies: None,
            max_in_flight: None,
            annotations: None,
        },
    )
}

/// How the event-bus answered one publish.
#[derive(Debug)]
enum Answer {
    /// 2xx: stored.
    Stored,
    /// A status other than 2xx, whether `Retry-After` came with it, and the start of the body
    /// (which says who answered: the event-bus's JSON or the sidecar's plain text).
    Refused {
        status: u16,
        retry_after: bool,
        body: String,
    },
    /// No HTTP answer (the connection was refused or reset).
    Unanswered(String),
}

impl std::fmt::Display for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Stored => f.write_str("stored"),
            Self::Refused {
                status,
                retry_after,
                body,
            } => {
                let retry = if *retry_after { "with" } else { "without" };
                write!(f, "{status} {retry} Retry-After: {body}")
            }
            Self::Unanswered(error) => write!(f, "unanswered: {error}"),
        }
    }
}

/// One publish: the event's id, when it was sent (since the test's start) and its answer.
struct Published {
    id: String,
    sent_at: Duration,
    answer: Answer,
}

/// Publishes `fault.work.v1` events at `per_second` until `stop`; each with its answer.
async fn publish_steadily(
    url: String,
    prefix: String,
    per_second: u64,
    started: Instant,
    stop: Arc<AtomicBool>,
) -> Vec<Published> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap_or_default();
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / per_second));
    let mut sent = tokio::task::JoinSet::new();
    let mut n = 0u64;
    while !stop.load(Ordering::Acquire) {
        tick.tick().await;
        let id = format!("{prefix}-{n}");
        n += 1;
        let request = client
            .post(&url)
            .header("ce-specversion", "1.0")
            .header("ce-type", "fault.work.v1")
            .header("ce-source", "fault-test")
            .header("ce-id", &id)
            .header("content-type", "application/json")
            .body(format!(r#"{{"id": "{id}"}}"#));
        let sent_at = started.elapsed();
        sent.spawn(async move {
            let answer = match request.send().await {
                Ok(response) if response.status().is_success() => Answer::Stored,
                Ok(response) => {
                    let status = response.status().as_u16();
                    let retry_after = response.headers().contains_key("retry-after");
                    let body = response.text().await.unwrap_or_default();
                    Answer::Refused {
                        status,
                        retry_after,
                        body: body.chars().take(200).collect(),
                    }
                }
                Err(error) => Answer::Unanswered(format!("{error:#}")),
            };
            Published {
                id,
                sent_at,
                answer,
            }
        });
    }
    sent.join_all().await
}

/// The events' stream is replicated on the three NATS servers, as a NATS server's monitoring
/// endpoint reports it (from the host: NATS pods have no sidecar); the server leading it.
fn events_stream_at_r3(plane: &ControlPlane) -> Result<String> {
    // Any server of the three reports it (the first that holds a replica).
    let stream = NATS_SERVERS
        .into_iter()
        .find_map(|server| events_stream(plane, server, "streams=true&config=true").ok())
        .context("no NATS server reports EDDY_EVENTS")?;
    let peers = 1 + stream["cluster"]["replicas"].as_array().map_or(0, Vec::len);
    ensure!(
        stream["config"]["num_replicas"] == 3 && peers == 3,
        "EDDY_EVENTS is not at R3 on three servers: {}",
        stream["cluster"]
    );
    stream["cluster"]["leader"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("EDDY_EVENTS has no leader: {}", stream["cluster"]))
}

/// The events' stream as the NATS server of pod `server` reports it on its monitoring endpoint
/// (`jsz` with `query`; from the host: NATS pods have no sidecar).
fn events_stream(plane: &ControlPlane, server: &str, query: &str) -> Result<Value> {
    let pod = kubectl_json(plane, &["get", "pod", server, "-n", SYSTEM])?;
    let ip = pod["status"]["podIP"]
        .as_str()
        .with_context(|| format!("{server}'s address"))?;
    let (status, body) = curl(&format!("http://{ip}:8222/jsz?{query}"), &[], None)?;
    ensure!(status == 200, "NATS monitoring answered {status}: {body}");
    let jsz: Value = serde_json::from_str(&body)?;
    jsz["account_details"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|account| account["stream_detail"].as_array().into_iter().flatten())
        .find(|stream| stream["name"] == "EDDY_EVENTS")
        .cloned()
        .with_context(|| format!("no EDDY_EVENTS in {body}"))
}

/// Events the stream holds for its consumers and has not delivered: the most any of the three
/// servers counts (a consumer's follower may count fewer than its leader), the backlog a deleted
/// server's replica would take with it.
fn undelivered(plane: &ControlPlane) -> u64 {
    NATS_SERVERS
        .into_iter()
        .filter_map(|server| events_stream(plane, server, "streams=true&consumers=true").ok())
        .map(|stream| {
            stream["consumer_detail"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|consumer| consumer["num_pending"].as_u64())
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0)
}

/// Waits until every pod of `selector` in `namespace` is ready, `count` of them.
async fn all_ready(
    plane: &ControlPlane,
    namespace: &str,
    selector: &str,
    count: usize,
) -> Result<()> {
    eventually(
        &format!("{count} ready pods of {selector}"),
        Duration::from_secs(120),
        || {
            let ready = kubectl_json(plane, &["get", "pods", "-n", namespace, "-l", selector])
                .is_ok_and(|pods| {
                    pods["items"].as_array().is_some_and(|items| {
                        items.len() == count
                            && items.iter().all(|pod| {
                                pod["metadata"]["deletionTimestamp"].is_null() && pod_ready(pod)
                            })
                    })
                });
            async move { ready }
        },
    )
    .await
}

/// The dispatcher's Deployment held at zero replicas while this lives; back at one when it is
/// dropped, whatever the test did in between (the tests after it need their dispatcher).
struct DeliveryPaused<'a> {
    plane: &'a ControlPlane,
}

impl<'a> DeliveryPaused<'a> {
    async fn start(plane: &'a ControlPlane) -> Result<Self> {
        let paused = Self { plane };
        paused.scale(0)?;
        eventually("no dispatcher pod left", Duration::from_secs(60), || {
            let gone = kubectl_json(plane, &["get", "pods", "-n", SYSTEM, "-l", DISPATCHER_PODS])
                .is_ok_and(|pods| pods["items"].as_array().is_some_and(Vec::is_empty));
            async move { gone }
        })
        .await?;
        Ok(paused)
    }

    fn scale(&self, replicas: u32) -> Result<()> {
        run(self.plane.kubectl()?.args([
            "scale",
            "deployment/eddy-dispatcher",
            "-n",
            SYSTEM,
            &format!("--replicas={replicas}"),
        ]))
        .map(drop)
    }
}

impl Drop for DeliveryPaused<'_> {
    fn drop(&mut self) {
        if let Err(error) = self.scale(1) {
            eprintln!("the dispatcher was not scaled back to one: {error:#}");
        }
    }
}

const DISPATCHER_PODS: &str = "app.kubernetes.io/component=dispatcher";
const NATS_PODS: &str = "app.kubernetes.io/name=nats";
const NATS_SERVERS: [&str; 3] = ["eddy-nats-0", "eddy-nats-1", "eddy-nats-2"];

/// Events published at a steady 40/s through four faults in turn, each pod deleted once the
/// previous one's replacement is ready:
/// - the NATS server leading the events' stream, with grace period 0 (its store, an emptyDir,
///   goes with it), while the dispatcher is held at zero so that the stream holds a backlog of
///   stored, undelivered events when the server goes: only the other replicas can still have
///   them;
/// - an event-bus pod;
/// - the dispatcher's pod;
/// - a Function's pod.
///
/// Every stored event is delivered.
#[tokio::test]
async fn every_stored_event_is_delivered_through_pod_deletions_under_steady_publishing()
-> Result<()> {
    let plane = installed()?;
    let namespace = namespace(plane, "faults")?;
    apply(plane, &namespace, &worker_and_tally(&namespace))?;
    running(plane, &namespace, "worker", Duration::from_secs(120)).await?;
    running(plane, &namespace, "tally", Duration::from_secs(120)).await?;
    subscriptions_ready(plane, &namespace, &["work", "done"]).await?;
    events_stream_at_r3(plane)?;

    let url = format!("{}/publish", service_url(plane, SYSTEM, "eddy-event-bus")?);
    let prefix = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let publisher = tokio::spawn(publish_steadily(url, prefix, 40, started, stop.clone()));
    // (what, namespace, selector, pods, forced: grace period 0 with delivery held meanwhile;
    // the pod deleted is then the NATS server leading the events' stream at that moment)
    let faults: [(&str, &str, &str, usize, bool); 4] = [
        (
            "the NATS server leading the stream",
            SYSTEM,
            NATS_PODS,
            3,
            true,
        ),
        (
            "an event-bus pod",
            SYSTEM,
            "app.kubernetes.io/component=event-bus",
            2,
            false,
        ),
        ("the dispatcher's pod", SYSTEM, DISPATCHER_PODS, 1, false),
        (
            "a Function's pod",
            &namespace,
            "eddy.dev/function=worker",
            2,
            false,
        ),
    ];
    for (what, namespace, selector, count, forced) in faults {
        all_ready(plane, namespace, selector, count).await?;
        let paused = if forced {
            let paused = DeliveryPaused::start(plane).await?;
            eprintln!(
                "{:>5.1} s: delivery held (the dispatcher at zero)",
                started.elapsed().as_secs_f64()
            );
            Some(paused)
        } else {
            None
        };
        // Some events before each fault, under the steady rate.
        let before = Instant::now();
        eventually(
            "a few seconds of publishing",
            Duration::from_secs(10),
            || {
                let enough = before.elapsed() >= Duration::from_secs(3);
                async move { enough }
            },
        )
        .await?;
        let pod = if paused.is_some() {
            eventually(
                "a backlog while delivery is held",
                Duration::from_secs(20),
                || {
                    let backlog = undelivered(plane);
                    async move { backlog > 0 }
                },
            )
            .await?;
            eprintln!(
                "{:>5.1} s: {} stored events not yet delivered",
                started.elapsed().as_secs_f64(),
                undelivered(plane)
            );
            // Read now: the leader may have moved since the run began.
            events_stream_at_r3(plane)?
        } else {
            a_pod(plane, namespace, selector)?
        };
        let mut delete = plane.kubectl()?;
        delete.args(["delete", "pod", &pod, "-n", namespace, "--wait=false"]);
        if forced {
            delete.args(["--grace-period=0", "--force"]);
        }
        run(&mut delete).with_context(|| format!("deleting {what}"))?;
        eprintln!(
            "{:>5.1} s: deleted {what} ({pod})",
            started.elapsed().as_secs_f64()
        );
        all_ready(plane, namespace, selector, count).await?;
        eprintln!(
            "{:>5.1} s: {what} replaced",
            started.elapsed().as_secs_f64()
        );
        if let Some(paused) = paused {
            drop(paused);
            all_ready(plane, SYSTEM, DISPATCHER_PODS, 1).await?;
            eprintln!(
                "{:>5.1} s: delivery resumed",
                started.elapsed().as_secs_f64()
            );
        }
    }
    stop.store(true, Ordering::Release);
    let answers = publisher.await?;

    let stored: Vec<&String> = answers
        .iter()
        .filter(|published| matches!(published.answer, Answer::Stored))
        .map(|published| &published.id)
        .collect();
    let refused: Vec<&Published> = answers
        .iter()
        .filter(|published| matches!(published.answer, Answer::Refused { .. }))
        .collect();
    let unanswered: Vec<&Published> = answers
        .iter()
        .filter(|published| matches!(published.answer, Answer::Unanswered(_)))
        .collect();
    let mut counts = HashMap::new();
    let mut missing = stored.len();
    let delivered = eventually(
        "every stored event delivered",
        Duration::from_secs(180),
        || {
            counts = tally::tallied(plane, &namespace).unwrap_or_default();
            missing = stored
                .iter()
                .filter(|id| !counts.contains_key(**id))
                .count();
            async move { missing == 0 }
        },
    )
    .await;
    let duplicates = counts.values().filter(|count| **count > 1).count();
    eprintln!(
        "{} published over {:.0} s: {} stored, {} refused, {} unanswered (connections refused or reset); {} delivered, {} of them more than once, {missing} missing",
        answers.len(),
        started.elapsed().as_secs_f64(),
        stored.len(),
        refused.len(),
        unanswered.len(),
        counts.len(),
        duplicates,
    );
    // When each went wrong says which fault it belongs to (the timeline above).
    for published in refused.iter().chain(&unanswered) {
        eprintln!(
            "{:>5.1} s: {} {}",
            published.sent_at.as_secs_f64(),
            published.id,
            published.answer
        );
    }
    delivered.with_context(|| {
        format!(
            "{missing} of {} stored events never delivered",
            stored.len()
        )
    })?;
    for Published { id, answer, .. } in refused {
        ensure!(
            matches!(
                answer,
                Answer::Refused {
                    status: 503,
                    retry_after: true,
                    ..
                }
            ),
            "event {id} was refused, {answer}, not a 503 with Retry-After"
        );
    }
    ensure!(!stored.is_empty(), "some events were stored");
    // The cluster healed: the stream is on three servers again.
    events_stream_at_r3(plane)?;
    delete_namespace(plane, &namespace)?;
    Ok(())
}
