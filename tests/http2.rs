//! HTTP/2 over cleartext (prior knowledge) at the event-bus and the gateway, beside HTTP/1.1:
//! many requests in flight on one connection.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use bytes::Bytes;
use http::{Request, StatusCode, Version};
use http_body_util::{BodyExt as _, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use serde_json::{Value, json};
use support::Platform;

/// A client that speaks only HTTP/2 and opens one connection per host.
fn http2_client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http()
}

#[tokio::test]
async fn the_event_bus_and_the_gateway_speak_http2_with_prior_knowledge() {
    let platform = Platform::start().await;
    let client = http2_client();
    let stored_before = platform
        .js
        .get_stream("EDDY_EVENTS")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;

    // 64 events in flight at once on one connection, each stored before its 204.
    let publishes = (0..64).map(|i| {
        let client = client.clone();
        let url = format!("{}/publish", platform.bus);
        async move {
            let request = Request::post(url)
                .header("ce-specversion", "1.0")
                .header("ce-id", format!("h2-{i}"))
                .header("ce-source", "shop")
                .header("ce-type", "order.created.v1")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(format!(r#"{{"n":{i}}}"#))))
                .unwrap();
            let response = client.request(request).await.unwrap();
            (response.version(), response.status())
        }
    });
    for (version, status) in futures::future::join_all(publishes).await {
        assert_eq!((version, status), (Version::HTTP_2, StatusCode::NO_CONTENT));
    }
    let mut stream = platform.js.get_stream("EDDY_EVENTS").await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().state.messages,
        stored_before + 64
    );
    // Each of the 64, once: by id, not by count.
    let mut stored = Vec::new();
    for sequence in stored_before + 1..=stored_before + 64 {
        let message = stream.get_raw_message(sequence).await.unwrap();
        let id = message
            .headers
            .get("ce-id")
            .map(|value| value.as_str().to_owned())
            .unwrap_or_default();
        stored.push(id);
    }
    stored.sort();
    let mut expected: Vec<String> = (0..64).map(|i| format!("h2-{i}")).collect();
    expected.sort();
    assert_eq!(stored, expected);

    // A function invoked over HTTP/2 through the gateway sees the host the caller named.
    let (status, body) = platform
        .put_function(
            "where",
            json!({"runtime": "nodejs22", "source": {"inline": {"source":
                "module.exports = { main: (event) => ({ host: event.extensions.request.headers['x-forwarded-host'] }) }"}}}),
        )
        .await;
    assert!(status < 300, "{status} {body}");
    platform.wait_running_at("default", "where").await;
    let gateway: http::Uri = platform.gateway.parse().unwrap();
    let response = client
        .request(
            Request::get(format!("{}/default/where/", platform.gateway))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.version(), Version::HTTP_2);
    assert_eq!(response.status(), StatusCode::OK);
    let body: Value =
        serde_json::from_slice(&response.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(
        body["host"].as_str(),
        gateway.authority().map(|authority| authority.as_str())
    );
}
