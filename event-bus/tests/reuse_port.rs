//! Several event-bus processes behind one port (`--reuse-port`): each joins only once it can
//! store events, and then every connection, whichever process the kernel gives it to, is stored.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{net::SocketAddr, time::Duration};

use eddy_event_bus::Args;
use eddy_platform::shutdown::CancellationToken;
use eddy_testing::{NatsServer, eventually};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buses_sharing_a_port_join_once_they_can_store_and_then_store_every_event() {
    let mut nats = NatsServer::start().unwrap();
    nats.kill();
    let addr: SocketAddr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    let shutdown = CancellationToken::new();
    let mut buses = Vec::new();
    for _ in 0..2 {
        let mut args = Args::new(addr, nats.url());
        args.reuse_port = true;
        args.publish_timeout = Duration::from_secs(2);
        buses.push(tokio::spawn(eddy_event_bus::run(args, shutdown.clone())));
    }

    // Neither takes connections while NATS is away (a bus that listened at once would be
    // reached well within the half second).
    let reached = tokio::time::timeout(Duration::from_millis(500), async {
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(
        reached.is_err(),
        "a bus that cannot store events must not take connections"
    );

    nats.restart().unwrap();
    let url = format!("http://{addr}/publish");
    eventually(
        "the buses to take connections",
        Duration::from_secs(20),
        || async { tokio::net::TcpStream::connect(addr).await.is_ok() },
    )
    .await
    .unwrap();
    // Fresh connections, spread by the kernel over the buses that listen: every event stored.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    for i in 0..40 {
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap();
        let response = http
            .post(&url)
            .header("ce-specversion", "1.0")
            .header("ce-id", format!("shared-{i}"))
            .header("ce-source", "reuse-port-test")
            .header("ce-type", "shared.port.v1")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(
            response.status(),
            204,
            "event {i}: {:?}",
            response.text().await
        );
    }
    let mut stream = js.get_stream("EDDY_EVENTS").await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 40);

    shutdown.cancel();
    for bus in buses {
        bus.await.unwrap().unwrap();
    }
}
