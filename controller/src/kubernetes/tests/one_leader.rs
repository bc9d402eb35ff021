//! Tests: One leader.

use super::*;

const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/eddy-system/leases/eddy-controller";

/// The lease duration of these tests. Long enough that a loaded machine's delays (a second or
/// two) stay well apart from the mistakes the tests look for: taking a lease before it runs out,
/// or waiting a second lease duration.
const LEASE_SECONDS: i64 = 4;

fn leader_args(identity: &str) -> leader::LeaderArgs {
    leader::LeaderArgs {
        enabled: true,
        lease_name: "eddy-controller".to_owned(),
        lease_namespace: "eddy-system".to_owned(),
        lease_duration: Duration::from_secs(LEASE_SECONDS.unsigned_abs()),
        identity: Some(identity.to_owned()),
    }
}

/// A Lease as the API server returns it: held by `holder` (renewed `renewed_ago` before now,
/// for `duration` seconds), or free.
fn lease(holder: Option<&str>, renewed_ago: Duration, duration: i64) -> Value {
    let spec = match holder {
        Some(holder) => {
            let renewed = std::time::SystemTime::now() - renewed_ago;
            let renewed = k8s_openapi::jiff::Timestamp::try_from(renewed).expect("a time");
            json!({
                "holderIdentity": holder, "leaseDurationSeconds": duration,
                "acquireTime": renewed.strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string(),
                "renewTime": renewed.strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string(),
                "leaseTransitions": 1,
            })
        }
        None => json!({}),
    };
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "eddy-controller", "namespace": "eddy-system", "resourceVersion": "1"},
        "spec": spec,
    })
}

/// Answers with [`lease`] as of the moment the request arrives.
fn answer_lease(
    holder: Option<&'static str>,
    renewed_ago: Duration,
    duration: i64,
) -> impl FnOnce(Value) -> (u16, Value) + Send + 'static {
    move |_| (200, lease(holder, renewed_ago, duration))
}

/// The patch URI of a replica's writes.
fn lease_patch(identity: &str) -> String {
    format!("{LEASE}?&fieldManager={}", leader::field_manager(identity))
}

/// Waits (at most `within`) until the receiver says `leads`.
async fn until_leading(
    leading: &mut tokio::sync::watch::Receiver<bool>,
    leads: bool,
    within: Duration,
) {
    tokio::time::timeout(within, leading.wait_for(|now| *now == leads))
        .await
        .unwrap_or_else(|_| panic!("leading = {leads} within {within:?}"))
        .expect("the election runs");
}

/// The exchanges of taking a free lease, from the sync that finds it free to the read-back.
fn take_free_lease(identity: &'static str) -> Vec<Exchange> {
    vec![
        // The state is stale at first, and a free lease never is fresh: read twice.
        expect(Method::GET, LEASE, answer_lease(None, Duration::ZERO, 0)),
        expect(Method::GET, LEASE, answer_lease(None, Duration::ZERO, 0)),
        expect(Method::PATCH, lease_patch(identity), move |body| {
            assert_eq!(body["spec"]["holderIdentity"], identity, "{body}");
            assert_eq!(
                body["spec"]["leaseDurationSeconds"], LEASE_SECONDS,
                "{body}"
            );
            (200, lease(Some(identity), Duration::ZERO, LEASE_SECONDS))
        }),
        expect(Method::PATCH, lease_patch(identity), |body| {
            assert_eq!(body["spec"]["leaseTransitions"], 1, "{body}");
            (200, body)
        }),
        expect(
            Method::GET,
            LEASE,
            answer_lease(Some(identity), Duration::ZERO, LEASE_SECONDS),
        ),
    ]
}

/// A replica creates the Lease, takes it, renews it, and stops leading when it finds another
/// replica holding it; stopping, it leaves another's lease alone.
#[tokio::test]
pub(super) async fn the_lease_is_created_taken_renewed_and_lost_to_another_replica() {
    let mut exchanges = vec![
        expect(Method::GET, LEASE, not_found),
        expect(
            Method::POST,
            "/apis/coordination.k8s.io/v1/namespaces/eddy-system/leases?",
            |body| {
                assert_eq!(body["metadata"]["name"], "eddy-controller");
                (201, lease(None, Duration::ZERO, 0))
            },
        ),
    ];
    exchanges.extend(take_free_lease("controller-a"));
    exchanges.extend([
        // Renewed a third of the duration before it runs out: 2.7 s after it was taken.
        expect(Method::PATCH, lease_patch("controller-a"), |body| {
            assert_eq!(
                body["spec"]["leaseDurationSeconds"], LEASE_SECONDS,
                "{body}"
            );
            assert!(body["spec"]["renewTime"].is_string(), "{body}");
            (200, body)
        }),
        // Meanwhile another replica holds it (this one was partitioned, say).
        expect(
            Method::GET,
            LEASE,
            answer_lease(Some("controller-b"), Duration::ZERO, LEASE_SECONDS),
        ),
        // Stopping: the lease is another's, so nothing is released; read back once.
        expect(
            Method::GET,
            LEASE,
            answer_lease(Some("controller-b"), Duration::ZERO, LEASE_SECONDS),
        ),
    ]);
    let (client, server) = kube_mock::scripted(exchanges);
    let (mut leading, manager) = leader::leadership(
        client,
        &leader_args("controller-a"),
        "controller-a".to_owned(),
        &eddy_platform::shutdown::CancellationToken::new(),
    )
    .await
    .expect("the election starts");
    until_leading(&mut leading, true, Duration::from_secs(10)).await;
    let taken = std::time::Instant::now();
    until_leading(&mut leading, false, Duration::from_secs(10)).await;
    assert!(
        taken.elapsed() >= Duration::from_millis(2000),
        "renewed at two thirds of the 4 s lease, not before ({:?})",
        taken.elapsed()
    );
    drop(leading);
    tokio::time::timeout(Duration::from_secs(5), manager)
        .await
        .expect("the manager ends once the receiver is gone")
        .expect("joined")
        .expect("released");
    server.await.expect("the API server saw what it expected");
}

/// A standby waits while another replica holds the lease and takes it once the holder stops
/// renewing: within the lease duration (and up to a second) of the last renewal.
#[tokio::test]
pub(super) async fn a_standby_takes_the_lease_once_the_holder_stops_renewing() {
    let mut exchanges = vec![
        // Held by controller-b, renewed just now, and never again.
        expect(
            Method::GET,
            LEASE,
            answer_lease(Some("controller-b"), Duration::ZERO, LEASE_SECONDS),
        ),
        expect(
            Method::GET,
            LEASE,
            answer_lease(Some("controller-b"), Duration::ZERO, LEASE_SECONDS),
        ),
        // Looked at again when it runs out (and once more before freeing it): still
        // controller-b's, expired.
        expect(
            Method::GET,
            LEASE,
            answer_lease(Some("controller-b"), Duration::from_secs(5), LEASE_SECONDS),
        ),
        expect(
            Method::GET,
            LEASE,
            answer_lease(Some("controller-b"), Duration::from_secs(5), LEASE_SECONDS),
        ),
        // Freed by force...
        expect(Method::PATCH, lease_patch("controller-a"), |body| {
            assert_eq!(body["spec"]["holderIdentity"], Value::Null, "{body}");
            (200, lease(None, Duration::ZERO, 0))
        }),
        expect(Method::GET, LEASE, answer_lease(None, Duration::ZERO, 0)),
    ];
    // ...and taken.
    exchanges.extend(take_free_lease("controller-a"));
    exchanges.extend([
        // Stopping: this replica holds it, so it releases it for the next one.
        expect(Method::PATCH, lease_patch("controller-a"), |body| {
            assert_eq!(body["spec"]["holderIdentity"], Value::Null, "{body}");
            (200, lease(None, Duration::ZERO, 0))
        }),
        expect(Method::GET, LEASE, answer_lease(None, Duration::ZERO, 0)),
    ]);
    let (client, server) = kube_mock::scripted(exchanges);
    let started = std::time::Instant::now();
    let (mut leading, manager) = leader::leadership(
        client,
        &leader_args("controller-a"),
        "controller-a".to_owned(),
        &eddy_platform::shutdown::CancellationToken::new(),
    )
    .await
    .expect("the election starts");
    until_leading(&mut leading, true, Duration::from_secs(15)).await;
    let waited = started.elapsed();
    // Not before the lease runs out (a loaded machine only makes it later), and not a second
    // lease duration later (8 s): the second of retry plus up to 2 s of a loaded machine.
    assert!(
        waited >= Duration::from_millis(3500) && waited <= Duration::from_millis(7000),
        "took over after the 4 s lease ran out, within a second or so ({waited:?})"
    );
    drop(leading);
    tokio::time::timeout(Duration::from_secs(5), manager)
        .await
        .expect("the manager ends once the receiver is gone")
        .expect("joined")
        .expect("released");
    server.await.expect("the API server saw what it expected");
}

/// The reconcilers run exactly while the replica leads, and stop at shutdown.
#[tokio::test]
async fn reconcilers_run_only_while_leading() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (elect, leading) = tokio::sync::watch::channel(false);
    let shutdown = CancellationToken::new();
    let started = Arc::new(AtomicUsize::new(0));
    let running = Arc::new(AtomicUsize::new(0));
    let task = tokio::spawn({
        let (shutdown, started, running) = (shutdown.clone(), started.clone(), running.clone());
        leader::while_leading(leading, shutdown, move |term| {
            let (started, running) = (started.clone(), running.clone());
            async move {
                started.fetch_add(1, Ordering::SeqCst);
                running.fetch_add(1, Ordering::SeqCst);
                term.cancelled().await;
                running.fetch_sub(1, Ordering::SeqCst);
            }
        })
    });
    let until = |what: &'static str, check: Box<dyn Fn() -> bool + Send>| async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !check() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::task::yield_now().await;
    assert_eq!(started.load(Ordering::SeqCst), 0, "not before leading");
    elect.send(true).expect("listening");
    let (s, r) = (started.clone(), running.clone());
    until(
        "the first start",
        Box::new(move || s.load(Ordering::SeqCst) == 1 && r.load(Ordering::SeqCst) == 1),
    )
    .await;
    elect.send(false).expect("listening");
    let r = running.clone();
    until(
        "the stop on loss",
        Box::new(move || r.load(Ordering::SeqCst) == 0),
    )
    .await;
    elect.send(true).expect("listening");
    let (s, r) = (started.clone(), running.clone());
    until(
        "the second start",
        Box::new(move || s.load(Ordering::SeqCst) == 2 && r.load(Ordering::SeqCst) == 1),
    )
    .await;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("ends at shutdown")
        .expect("joined");
    assert_eq!(running.load(Ordering::SeqCst), 0, "the work was stopped");
    assert_eq!(started.load(Ordering::SeqCst), 2);
}

/// An election whose task ends while the replica runs stops the reconcilers and the whole
/// process (its shutdown), with an error: the kubelet starts it again, where staying up would
/// leave a controller that reconciles nothing. At shutdown, the same return is no error.
#[tokio::test]
async fn an_election_that_ends_before_shutdown_stops_the_process_with_an_error() {
    let ended = |reason: &'static str| {
        tokio::spawn(async move {
            Err(kube_lease_manager::LeaseManagerError::InconsistentState(
                reason.to_owned(),
            ))
        })
    };
    let (elect, leading) = tokio::sync::watch::channel(true);
    let shutdown = CancellationToken::new();
    let (cancelled_tx, cancelled) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(leader::lead(leading, ended("gone"), shutdown.clone(), {
        let mut cancelled_tx = Some(cancelled_tx);
        move |term| {
            let tx = cancelled_tx.take();
            async move {
                term.cancelled().await;
                if let Some(tx) = tx {
                    let _ = tx.send(());
                }
            }
        }
    }));
    // The election's task ends: its sender is dropped while the replica leads.
    tokio::task::yield_now().await;
    drop(elect);
    let result = tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("lead returns once the election ends")
        .expect("joined");
    assert!(
        matches!(result, Err(crate::Error::ElectionEnded)),
        "{result:?}"
    );
    assert!(shutdown.is_cancelled(), "the process is told to stop");
    tokio::time::timeout(Duration::from_secs(5), cancelled)
        .await
        .expect("the reconcilers were stopped")
        .expect("sent");

    let (_elect, leading) = tokio::sync::watch::channel(false);
    let shutdown = CancellationToken::new();
    shutdown.cancel();
    let result = leader::lead(leading, ended("released"), shutdown, |_| async {}).await;
    assert!(result.is_ok(), "{result:?}");
}
