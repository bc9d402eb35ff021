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
    // Where NATS was, something that accepts connections and never speaks NATS: the buses'
    // attempts to connect are seen, and none of them can get ready.
    let silent = std::net::TcpListener::bind(("127.0.0.1", nats.port())).unwrap();
    silent.set_nonblocking(true).unwrap();
    let addr: SocketAddr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    let (mut shutdowns, mut buses) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        let mut args = Args::new(addr, nats.url());
        args.reuse_port = true;
        args.publish_timeout = Duration::from_secs(2);
        let shutdown = CancellationToken::new();
        buses.push(tokio::spawn(eddy_event_bus::run(args, shutdown.clone())));
        shutdowns.push(shutdown);
    }

    // Both have bound the port and are trying NATS (two connections seen, at least), and
    // neither takes connections: a bus that cannot store events does not listen.
    let mut attempts = Vec::new();
    eventually("both buses to try NATS", Duration::from_secs(20), || {
        while let Ok((connection, _)) = silent.accept() {
            attempts.push(connection);
        }
        let tried = attempts.len() >= 2;
        async move { tried }
    })
    .await
    .unwrap();
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "a bus that cannot store events must not take connections"
    );
    drop((silent, attempts));

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
        publish_on_a_fresh_connection(&url, i).await;
    }
    let mut stream = js.get_stream("EDDY_EVENTS").await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 40);

    // The first bus stops: every new connection now goes to the second, which stores it (the
    // second was serving on the shared port all along, not just bound to it).
    shutdowns[0].cancel();
    buses.remove(0).await.unwrap().unwrap();
    for i in 40..60 {
        publish_on_a_fresh_connection(&url, i).await;
    }
    assert_eq!(stream.info().await.unwrap().state.messages, 60);

    shutdowns[1].cancel();
    for bus in buses {
        bus.await.unwrap().unwrap();
    }
}

/// Publishes event `shared-<i>` on a connection of its own (the kernel picks the bus that
/// takes it); asserts it was stored (204).
async fn publish_on_a_fresh_connection(url: &str, i: usize) {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let response = http
        .post(url)
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
