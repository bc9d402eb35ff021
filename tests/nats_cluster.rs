//! The event-bus on a 3-node NATS JetStream cluster (stream replicas 3): the stream's leader is
//! SIGKILLed while events are published at a steady rate. Every event the bus answered 2xx must
//! be in the stream afterwards; publishes refused during the election are retried by the
//! publisher (same id, so the retry is deduplicated) and count once they are acked.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use async_nats::jetstream::{self, consumer::pull};
use eddy_testing::{NatsCluster, eventually};
use futures::StreamExt as _;

const RATE: Duration = Duration::from_millis(5);

#[derive(Default)]
struct Tally {
    acked: BTreeSet<u64>,
    refused: u64,
}

/// Publishes events numbered from 0 at a steady rate until `stop`, retrying each until the bus
/// acks it (or 30 s pass, which fails the test).
async fn publish_steadily(
    bus: String,
    tally: Arc<Mutex<Tally>>,
    stop: eddy_platform::shutdown::CancellationToken,
) {
    let http = reqwest::Client::new();
    let mut next = 0u64;
    let mut tick = tokio::time::interval(RATE);
    while !stop.is_cancelled() {
        tick.tick().await;
        let number = next;
        next += 1;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let sent = http
                .post(format!("{bus}/publish"))
                .header("ce-specversion", "1.0")
                .header("ce-id", format!("e-{number}"))
                .header("ce-source", "cluster-test")
                .header("ce-type", "order.created.v1")
                .header("content-type", "application/json")
                .body(format!("{{\"n\":{number}}}"))
                .timeout(Duration::from_secs(10))
                .send()
                .await;
            match sent {
                Ok(response) if response.status().is_success() => {
                    tally.lock().unwrap().acked.insert(number);
                    break;
                }
                _ => {
                    tally.lock().unwrap().refused += 1;
                    assert!(
                        Instant::now() < deadline,
                        "event {number} was never acknowledged"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_acked_event_is_lost_when_the_stream_leader_dies() {
    let mut cluster = NatsCluster::start(3).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut args = eddy_event_bus::Args::new(addr, cluster.urls());
    args.stream.replicas = 3;
    let shutdown = eddy_platform::shutdown::CancellationToken::new();
    // The stream can only be created once the cluster has elected a meta leader; the bus
    // retries until then and reports ready.
    let bus = eddy_event_bus::EventBus::new(args, shutdown.child_token())
        .await
        .unwrap();
    tokio::spawn(bus.serve(listener));
    let bus_url = format!("http://{addr}");
    let http = reqwest::Client::new();
    eventually(
        "the event-bus to be ready on the cluster",
        Duration::from_secs(60),
        || async {
            matches!(http.get(format!("{bus_url}/readyz")).send().await, Ok(r) if r.status() == 200)
        },
    )
    .await
    .unwrap();

    let urls: Vec<String> = cluster.urls().split(',').map(str::to_owned).collect();
    let js = jetstream::new(async_nats::connect(urls).await.unwrap());
    let info = js
        .get_stream("EDDY_EVENTS")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .clone();
    assert_eq!(info.config.num_replicas, 3);

    let tally = Arc::new(Mutex::new(Tally::default()));
    let stop = eddy_platform::shutdown::CancellationToken::new();
    let publisher = tokio::spawn(publish_steadily(
        bus_url.clone(),
        tally.clone(),
        stop.clone(),
    ));
    let acked = || tally.lock().unwrap().acked.len();
    eventually(
        "300 events acked before the fault",
        Duration::from_secs(30),
        || async { acked() >= 300 },
    )
    .await
    .unwrap();

    // SIGKILL the stream's leader, mid-stream.
    let leader = js
        .get_stream("EDDY_EVENTS")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .cluster
        .clone()
        .and_then(|c| c.leader)
        .expect("the stream has a leader");
    let index = NatsCluster::node_index(&leader).expect("a node name");
    let before_kill = acked();
    cluster.nodes[index].kill();

    // Publishing goes on once a new leader is elected among the two left.
    eventually(
        "300 more events acked after the leader died",
        Duration::from_secs(60),
        || async { acked() >= before_kill + 300 },
    )
    .await
    .unwrap();
    cluster.nodes[index].restart().unwrap();
    eventually(
        "100 more with the old leader back",
        Duration::from_secs(60),
        || async { acked() >= before_kill + 400 },
    )
    .await
    .unwrap();
    stop.cancel();
    publisher.await.unwrap();

    // Read the whole stream back. Right after the restart the cluster may still be settling
    // (the restarted node catching up, a meta-leader change): a JetStream API request can time
    // out then, so the read-back set-up is retried until it answers.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let (consumer, stored_count) = loop {
        let attempt = async {
            let stream = js.get_stream("EDDY_EVENTS").await?;
            let consumer: jetstream::consumer::PullConsumer = stream
                .create_consumer(pull::Config {
                    ack_policy: jetstream::consumer::AckPolicy::None,
                    ..Default::default()
                })
                .await?;
            let stored_count = stream.clone().info().await?.state.messages;
            Ok::<_, async_nats::Error>((consumer, stored_count))
        };
        match attempt.await {
            Ok(ready) => break ready,
            Err(error) if tokio::time::Instant::now() < deadline => {
                println!("read-back set-up failed, retrying: {error}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(error) => panic!("cannot read the stream back: {error}"),
        }
    };
    // Every stored message, duplicates included: the multiset is compared below.
    let mut stored_ids = Vec::new();
    let mut messages = consumer.messages().await.unwrap();
    while (stored_ids.len() as u64) < stored_count {
        let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .expect("the stream reads back")
            .unwrap()
            .unwrap();
        let id = message
            .headers
            .as_ref()
            .and_then(|h| h.get("ce-id"))
            .map(|v| v.as_str().to_owned())
            .unwrap();
        stored_ids.push(id.trim_start_matches("e-").parse::<u64>().unwrap());
    }
    let stored: BTreeSet<u64> = stored_ids.iter().copied().collect();

    let tally = tally.lock().unwrap();
    let lost: Vec<&u64> = tally.acked.difference(&stored).collect();
    println!(
        "leader {leader} killed after {before_kill} acks: acked {}, stored {} ({} messages), refused and retried {}, lost {}",
        tally.acked.len(),
        stored.len(),
        stored_count,
        tally.refused,
        lost.len()
    );
    assert!(lost.is_empty(), "acked but not stored: {lost:?}");
    assert_eq!(
        stored_ids.len(),
        stored.len(),
        "each event is stored once; stored more than once: {:?}",
        stored_ids
            .iter()
            .filter(|id| stored_ids.iter().filter(|other| other == id).count() > 1)
            .collect::<BTreeSet<_>>()
    );
    shutdown.cancel();
}
