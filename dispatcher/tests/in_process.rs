//! Deliveries to a gateway running in the dispatcher's own process (`eddy up`) are handed to it
//! directly; every other sink is reached over HTTP.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{Router, extract::Request, http::StatusCode, response::IntoResponse};
use bytes::Bytes;
use eddy_dispatcher::{
    Deliveries, Failure, InProcessGateway, Journal, LiveSubscription, Metrics, Resolution,
    Resolved, Shared, Sinks, Verdict, deliver, sink_client,
};
use eddy_model::{
    backoff::Backoff,
    event::Limits,
    resources::{DeliveryPolicy, SinkPolicy},
};
use eddy_platform::publisher::{AckLimits, Publisher};
use eddy_testing::NatsServer;

/// What the in-process gateway was asked.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    authorization: Option<String>,
    ce_id: Option<String>,
    body: Bytes,
}

/// A gateway stand-in that records each request and answers 204.
fn recording_gateway(seen: Arc<Mutex<Vec<Seen>>>) -> Router {
    Router::new().fallback(move |request: Request| {
        let seen = seen.clone();
        async move {
            let (parts, body) = request.into_parts();
            let body = axum::body::to_bytes(body, 1 << 20).await.unwrap();
            let header = |name: &str| {
                parts
                    .headers
                    .get(name)
                    .map(|value| value.to_str().unwrap().to_owned())
            };
            seen.lock().unwrap().push(Seen {
                path: parts.uri.path().to_owned(),
                authorization: header("authorization"),
                ce_id: header("ce-id"),
                body,
            });
            StatusCode::NO_CONTENT.into_response()
        }
    })
}

/// An address nothing listens on: a delivery sent there over HTTP fails to connect.
fn closed_address() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

async fn shared(nats: &NatsServer, gateway: Option<InProcessGateway>) -> Shared {
    let client = async_nats::connect(nats.url()).await.unwrap();
    Shared {
        js: async_nats::jetstream::new(client.clone()),
        deliveries: Deliveries::new(sink_client(Duration::from_secs(60)).unwrap(), gateway),
        sinks: Sinks::new(Resolution::Local, SinkPolicy::default()),
        metrics: Metrics::new(),
        replies: Publisher::without_stream(
            client,
            AckLimits {
                timeout: Duration::from_secs(5),
                max_in_flight: 16,
            },
        ),
        reply_limits: Limits {
            max_event_size: 1 << 20,
            max_batch_events: 1,
        },
        progress_every: Duration::from_secs(10),
        journal: Journal::default(),
        scaler: None,
    }
}

fn target() -> LiveSubscription {
    LiveSubscription {
        namespace: "shop".into(),
        name: "reserve".into(),
        label: "shop/reserve".into(),
        sink: "http://stock.shop.svc.cluster.local".into(),
        policy: DeliveryPolicy {
            max_in_flight: 1,
            max_attempts: 3,
            backoff: Backoff::exponential(Duration::from_secs(1), Duration::from_secs(10)),
            timeout: Duration::from_secs(5),
        },
        filter_subjects: Vec::new(),
        encoding: Default::default(),
    }
}

fn stored_headers() -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("ce-specversion", "1.0");
    headers.insert("ce-id", "order-1");
    headers.insert("ce-type", "order.created.v1");
    headers.insert("ce-source", "shop");
    headers.insert("content-type", "application/json");
    headers
}

/// Delivers `payload` (with [`stored_headers`]) to `sink` as the Subscription of [`target`].
async fn deliver_to(shared: &Shared, sink: &Resolved, payload: &Bytes) -> Verdict {
    deliver(
        shared,
        &target(),
        sink,
        Some(&stored_headers()),
        payload,
        None,
    )
    .await
}

#[tokio::test]
async fn deliveries_to_the_gateway_of_this_process_do_not_cross_the_network() {
    let nats = NatsServer::start().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    // The gateway's address has no listener: only a call in this process can reach it.
    let gateway_addr = closed_address();
    let gateway = InProcessGateway::new(gateway_addr, recording_gateway(seen.clone()));
    let shared = shared(&nats, gateway).await;
    let to_gateway = Resolved {
        uri: format!("http://{gateway_addr}/shop/stock").parse().unwrap(),
        authorization: Some("Bearer platform".parse().unwrap()),
    };
    let payload = Bytes::from_static(br#"{"sku":"A1"}"#);
    let verdict = deliver_to(&shared, &to_gateway, &payload).await;
    assert_eq!(verdict, Verdict::Delivered { status: 204 });
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].path, "/shop/stock");
    assert_eq!(seen[0].ce_id.as_deref(), Some("order-1"));
    assert_eq!(
        seen[0].authorization.as_deref(),
        Some("Bearer platform"),
        "the gateway checks the platform token as it does over HTTP"
    );
    assert_eq!(seen[0].body, payload);

    // Any other address goes over HTTP (nothing listens there either: the connection fails).
    let elsewhere = Resolved {
        uri: format!("http://{}/shop/stock", closed_address())
            .parse()
            .unwrap(),
        authorization: None,
    };
    let verdict = deliver_to(&shared, &elsewhere, &payload).await;
    assert_eq!(
        verdict,
        Verdict::Retry {
            reason: Failure::ConnectError,
            status: None
        }
    );
}

#[tokio::test]
async fn the_gateway_s_refusals_are_classified_as_over_http() {
    let nats = NatsServer::start().unwrap();
    let gateway_addr = closed_address();
    let unavailable = Router::new().fallback(|| async { StatusCode::SERVICE_UNAVAILABLE });
    let gateway = InProcessGateway::new(gateway_addr, unavailable);
    let shared = shared(&nats, gateway).await;
    let to_gateway = Resolved {
        uri: format!("http://{gateway_addr}/shop/stock").parse().unwrap(),
        authorization: None,
    };
    let verdict = deliver_to(&shared, &to_gateway, &Bytes::from_static(b"{}")).await;
    assert_eq!(
        verdict,
        Verdict::Retry {
            reason: Failure::Http5xx,
            status: Some(503)
        }
    );
}
