//! The ceiling `eddy bench ingest` measures the event-bus against: a minimal HTTP → JetStream
//! forwarder written for the bench. It speaks HTTP/1.1 and HTTP/2 (prior knowledge) as the
//! event-bus does, copies the `ce-*` and `content-type` headers, sets the same `Nats-Msg-Id`,
//! waits for the stream's ack and answers 204; it validates nothing and escapes nothing.

use std::{convert::Infallible, net::SocketAddr};

use async_nats::jetstream;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::conn::auto,
};

/// Serves the forwarder on `addr` until the process ends; prints `forwarder ready on <url>`.
pub async fn run(addr: SocketAddr, nats_url: &str) -> anyhow::Result<()> {
    let js = jetstream::new(async_nats::connect(nats_url).await?);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("forwarder ready on http://{}", listener.local_addr()?);
    loop {
        let (stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let js = js.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| forward(js.clone(), request));
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn forward(
    js: jetstream::Context,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let answer = |status: StatusCode| {
        let mut response = Response::new(Full::new(Bytes::new()));
        *response.status_mut() = status;
        Ok(response)
    };
    if request.uri().path() == "/readyz" {
        return answer(StatusCode::OK);
    }
    let (parts, body) = request.into_parts();
    let Ok(body) = body.collect().await.map(|collected| collected.to_bytes()) else {
        return answer(StatusCode::BAD_REQUEST);
    };
    let mut headers = async_nats::HeaderMap::new();
    for (name, value) in &parts.headers {
        let name = name.as_str();
        if (name.starts_with("ce-") || name == "content-type")
            && let Ok(value) = value.to_str()
        {
            headers.insert(name, value);
        }
    }
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default()
    };
    let (source, id, type_) = (header("ce-source"), header("ce-id"), header("ce-type"));
    let subject = format!("eddy.events.{source}.{type_}");
    let message = jetstream::message::PublishMessage::build()
        .headers(headers)
        .payload(body)
        .message_id(eddy_model::subject::message_id(source, id));
    let stored = match js.send_publish(subject, message).await {
        Ok(ack) => ack.await.is_ok(),
        Err(_) => false,
    };
    answer(if stored {
        StatusCode::NO_CONTENT
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    })
}
