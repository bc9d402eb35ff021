//! Scale from zero in real pods: a Function with `minReplicas: 0` goes to zero when idle
//! (`dispatcher.scaleToZeroAfter`, 15 s in the real node's values), is woken by events (the
//! dispatcher holds them) and by calls (the gateway holds them), scales out with its pending
//! events, and loses no event while its pod cannot start.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, ensure};
use eddy_testing::eventually;
use futures::StreamExt as _;
use serde_json::Value;

use super::*;

/// The worker and the tally (`super::tally`), the worker at zero when idle (0–3 replicas). A
/// `broken` worker's pods never get ready: their install init container fails on a package
/// that does not exist.
fn worker_and_tally(namespace: &str, broken: bool) -> String {
    tally::worker_and_tally(
        namespace,
        "scale",
        &tally::Worker {
            scaling: "scaleConfig: {minReplicas: 0, maxReplicas: 3}",
            dependencies: broken
                .then_some(r#"{"dependencies": {"eddy-no-such-package-8f3a1c": "1.0.0"}}"#),
            max_in_flight: Some(20),
            annotations: None,
        },
    )
}

/// The worker's Deployment's `spec.replicas`.
fn replicas(plane: &ControlPlane, namespace: &str) -> Result<i64> {
    let deployment = kubectl_json(plane, &["get", "deployment", "worker", "-n", namespace])?;
    Ok(deployment["spec"]["replicas"].as_i64().unwrap_or(1))
}

/// Waits until the worker is at zero: its status says `ScaledToZero`.
async fn at_zero(plane: &ControlPlane, namespace: &str, within: Duration) -> Result<()> {
    wait_for_function(
        plane,
        "functions.eddy.dev",
        namespace,
        "worker",
        within,
        |function| {
            condition(function, "Running")
                .is_some_and(|(status, reason, _)| status == "True" && reason == "ScaledToZero")
        },
    )
    .await
}

/// Publishes `ids` as `scale.work.v1` events, 16 at a time; every one must be stored (2xx).
async fn publish_all(plane: &ControlPlane, ids: &[String]) -> Result<()> {
    let url = format!("{}/publish", service_url(plane, SYSTEM, "eddy-event-bus")?);
    let client = reqwest::Client::new();
    let answers: Vec<Result<u16>> = futures::stream::iter(ids)
        .map(|id| {
            let request = client
                .post(&url)
                .header("ce-specversion", "1.0")
                .header("ce-type", "scale.work.v1")
                .header("ce-source", "scale-test")
                .header("ce-id", id)
                .header("content-type", "application/json")
                .body(format!(r#"{{"id": "{id}"}}"#));
            async move { Ok(request.send().await?.status().as_u16()) }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    for answer in answers {
        let status = answer?;
        ensure!((200..300).contains(&status), "publish answered {status}");
    }
    Ok(())
}

/// Waits until the tally holds every one of `ids`; fails with how many are missing.
async fn all_tallied(
    plane: &ControlPlane,
    namespace: &str,
    ids: &[String],
    within: Duration,
) -> Result<()> {
    let mut missing = ids.len();
    let done = eventually("every event tallied", within, || {
        let seen = tally::tallied(plane, namespace).unwrap_or_default();
        missing = ids.iter().filter(|id| !seen.contains_key(*id)).count();
        async move { missing == 0 }
    })
    .await;
    done.with_context(|| format!("{missing} of {} events not delivered", ids.len()))
}

/// A Function at zero woken by a burst of 1,000 events: every event delivered, its replicas up
/// (out past one, with the pending events) and back to zero when idle; then a call through the
/// gateway wakes it again and is answered (the time of that first call is printed).
#[tokio::test]
async fn a_function_at_zero_wakes_for_a_burst_of_events_and_for_a_call_then_sleeps_again()
-> Result<()> {
    let plane = installed()?;
    let namespace = namespace(plane, "scale")?;
    apply(plane, &namespace, &worker_and_tally(&namespace, false))?;
    running(plane, &namespace, "tally", Duration::from_secs(120)).await?;
    subscriptions_ready(plane, &namespace, &["work", "done"]).await?;
    // Up at first (a new Function's pod shows it works), then idle: to zero.
    at_zero(plane, &namespace, Duration::from_secs(120)).await?;
    ensure!(
        replicas(plane, &namespace)? == 0,
        "the Deployment is at zero"
    );

    let run = uuid::Uuid::new_v4().simple().to_string();
    let ids: Vec<String> = (0..1000).map(|n| format!("{}-{n}", &run[..8])).collect();
    let started = Instant::now();
    publish_all(plane, &ids).await?;
    let published = started.elapsed();
    let mut most = 0;
    let out = eventually(
        "the worker scaled out past one pod",
        Duration::from_secs(60),
        || {
            most = most.max(replicas(plane, &namespace).unwrap_or(0));
            async move { most > 1 }
        },
    )
    .await;
    all_tallied(plane, &namespace, &ids, Duration::from_secs(240)).await?;
    out.with_context(|| format!("the most replicas seen: {most}"))?;
    eprintln!(
        "1000 events published in {:.1} s, all delivered {:.1} s after the first, through a Function woken from zero (up to {most} replicas)",
        published.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    at_zero(plane, &namespace, Duration::from_secs(120)).await?;

    let called = Instant::now();
    let (status, body) = call(
        plane,
        SYSTEM,
        "eddy-gateway",
        &format!("/{namespace}/worker/"),
        Some(r#"{"id": "a-call"}"#),
    )?;
    ensure!(
        status == 200,
        "the call from zero answered {status}: {body}"
    );
    ensure!(body.contains("a-call"), "the call's answer: {body}");
    eprintln!(
        "a call to the Function at zero answered through the gateway in {:.2} s",
        called.elapsed().as_secs_f64()
    );
    // Calls keep it awake: the gateway renews the Function's calls Lease, under the chart's RBAC.
    eventually("the calls Lease renewed", Duration::from_secs(20), || {
        let lease = kubectl_json(
            plane,
            &["get", "lease", "eddy-calls-worker", "-n", &namespace],
        );
        let renewed = lease.is_ok_and(|lease| lease["spec"]["renewTime"].is_string());
        async move { renewed }
    })
    .await?;
    delete_namespace(plane, &namespace)?;
    Ok(())
}

/// A Function annotated `eddy.dev/scale-on: backlog` (1–3 replicas, no HPA) follows a burst of
/// 600 events: out past its minimum while they wait, every one delivered, then back to its
/// minimum when idle, and never to zero.
#[tokio::test]
async fn a_function_scaled_on_its_backlog_follows_a_burst_and_returns_to_its_minimum() -> Result<()>
{
    let plane = installed()?;
    let namespace = namespace(plane, "backlog")?;
    let manifest = tally::worker_and_tally(
        &namespace,
        "scale",
        &tally::Worker {
            scaling: "scaleConfig: {minReplicas: 1, maxReplicas: 3}",
            dependencies: None,
            max_in_flight: Some(20),
            annotations: Some("{eddy.dev/scale-on: backlog}"),
        },
    );
    apply(plane, &namespace, &manifest)?;
    running(plane, &namespace, "worker", Duration::from_secs(120)).await?;
    running(plane, &namespace, "tally", Duration::from_secs(120)).await?;
    subscriptions_ready(plane, &namespace, &["work", "done"]).await?;
    let hpas = kubectl_json(plane, &["get", "hpa", "-n", &namespace])?;
    ensure!(
        hpas["items"].as_array().is_some_and(Vec::is_empty),
        "no HPA for a Function scaled on its backlog: {hpas}"
    );

    let run = uuid::Uuid::new_v4().simple().to_string();
    let ids: Vec<String> = (0..600).map(|n| format!("{}-{n}", &run[..8])).collect();
    let started = Instant::now();
    publish_all(plane, &ids).await?;
    let mut most = 0;
    let mut fewest = i64::MAX;
    let out = eventually(
        "the worker scaled out past its minimum",
        Duration::from_secs(60),
        || {
            let now = replicas(plane, &namespace).unwrap_or(1);
            most = most.max(now);
            fewest = fewest.min(now);
            async move { most > 1 }
        },
    )
    .await;
    all_tallied(plane, &namespace, &ids, Duration::from_secs(240)).await?;
    out.with_context(|| format!("the most replicas seen: {most}"))?;
    eprintln!(
        "600 events delivered {:.1} s after the first, the Function scaled on its backlog up to {most} replicas",
        started.elapsed().as_secs_f64()
    );
    eventually(
        "the worker back at its minimum",
        Duration::from_secs(120),
        || {
            let now = replicas(plane, &namespace).unwrap_or(0);
            fewest = fewest.min(now);
            async move { now == 1 }
        },
    )
    .await?;
    ensure!(fewest >= 1, "the worker went below its minimum: {fewest}");
    delete_namespace(plane, &namespace)?;
    Ok(())
}

/// Events for a Function at zero whose pod cannot start wait in the stream (nothing
/// dead-lettered, nothing lost), and are all delivered once a fixed version starts.
#[tokio::test]
async fn events_for_a_function_whose_pod_cannot_start_wait_and_none_is_lost() -> Result<()> {
    let plane = installed()?;
    let namespace = namespace(plane, "unstartable")?;
    apply(plane, &namespace, &worker_and_tally(&namespace, false))?;
    running(plane, &namespace, "tally", Duration::from_secs(120)).await?;
    subscriptions_ready(plane, &namespace, &["work", "done"]).await?;
    at_zero(plane, &namespace, Duration::from_secs(120)).await?;
    // Broken while asleep: the next pod's install fails.
    apply(plane, &namespace, &worker_and_tally(&namespace, true))?;
    // The broken template is rolled out at zero before anything wakes it, so a wake-up starts
    // the broken version, not the working one the Deployment still had.
    eventually(
        "the broken version rolled out at zero",
        Duration::from_secs(60),
        || {
            let rolled = kubectl_json(plane, &["get", "deployment", "worker", "-n", &namespace])
                .is_ok_and(|deployment| {
                    deployment["metadata"]["annotations"]["deployment.kubernetes.io/revision"]
                        != "1"
                        && deployment["status"]["observedGeneration"]
                            == deployment["metadata"]["generation"]
                });
            async move { rolled }
        },
    )
    .await?;

    let run = uuid::Uuid::new_v4().simple().to_string();
    let ids: Vec<String> = (0..50).map(|n| format!("{}-{n}", &run[..8])).collect();
    publish_all(plane, &ids).await?;
    let woken = eventually("the worker woken", Duration::from_secs(30), || {
        let up = replicas(plane, &namespace).is_ok_and(|replicas| replicas > 0);
        async move { up }
    })
    .await;
    woken?;
    // Its pod cannot get ready: for 20 s nothing arrives, and the events stay.
    let mut seen = Value::Null;
    let stuck = eventually(
        "a worker pod not ready for 20 s",
        Duration::from_secs(90),
        || {
            let pods = kubectl_json(
                plane,
                &[
                    "get",
                    "pods",
                    "-n",
                    &namespace,
                    "-l",
                    "eddy.dev/function=worker",
                ],
            )
            .unwrap_or_default();
            let stuck = pods["items"].as_array().is_some_and(|items| {
                items.iter().any(|pod| {
                    let created = pod["metadata"]["creationTimestamp"]
                        .as_str()
                        .and_then(|at| chrono::DateTime::parse_from_rfc3339(at).ok());
                    let old = created.is_some_and(|at| {
                        chrono::Utc::now().signed_duration_since(at)
                            > chrono::TimeDelta::seconds(20)
                    });
                    old && !pod_ready(pod)
                })
            });
            seen = pods;
            async move { stuck }
        },
    )
    .await;
    stuck.with_context(|| format!("the worker's pods: {seen}"))?;
    ensure!(
        tally::tallied(plane, &namespace)?.is_empty(),
        "nothing is delivered while the pod cannot start"
    );

    apply(plane, &namespace, &worker_and_tally(&namespace, false))?;
    all_tallied(plane, &namespace, &ids, Duration::from_secs(180)).await?;
    delete_namespace(plane, &namespace)?;
    Ok(())
}
