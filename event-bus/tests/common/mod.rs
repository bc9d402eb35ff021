//! An event-bus served in-process against a real nats-server, and helpers to read what it stored.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use async_nats::jetstream::{self, message::StreamMessage};
use eddy_event_bus::{Args, EventBus};
use eddy_platform::shutdown::CancellationToken;
use eddy_testing::{NatsServer, eventually};

pub struct Bus {
    pub nats: NatsServer,
    pub url: String,
    pub http: reqwest::Client,
    pub js: jetstream::Context,
    shutdown: CancellationToken,
}

impl Bus {
    pub async fn start() -> Self {
        Self::start_with(NatsServer::start().unwrap(), |_| {}).await
    }

    pub async fn start_with(nats: NatsServer, configure: impl FnOnce(&mut Args)) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut args = Args::new(listener.local_addr().unwrap(), nats.url());
        args.publish_timeout = Duration::from_secs(2);
        configure(&mut args);
        let shutdown = CancellationToken::new();
        let bus = EventBus::new(args, shutdown.clone()).await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(bus.serve(listener));
        let client = async_nats::connect(nats.url()).await.unwrap();
        let this = Self {
            nats,
            url,
            http: reqwest::Client::new(),
            js: jetstream::new(client),
            shutdown,
        };
        this.wait_ready().await;
        this
    }

    pub async fn wait_ready(&self) {
        let readyz = format!("{}/readyz", self.url);
        eventually(
            "the event-bus to be ready",
            Duration::from_secs(20),
            || async { matches!(self.http.get(&readyz).send().await, Ok(r) if r.status() == 200) },
        )
        .await
        .unwrap();
    }

    pub fn post(&self, path: &str) -> reqwest::RequestBuilder {
        self.http.post(format!("{}{path}", self.url))
    }

    /// A binary-mode publish with the required attributes.
    pub fn binary(&self, source: &str, id: &str, ty: &str) -> reqwest::RequestBuilder {
        self.post("/publish")
            .header("ce-specversion", "1.0")
            .header("ce-id", id)
            .header("ce-source", source)
            .header("ce-type", ty)
    }

    pub async fn stored_count(&self) -> u64 {
        let mut stream = self.js.get_stream("EDDY_EVENTS").await.unwrap();
        stream.info().await.unwrap().state.messages
    }

    pub async fn stored(&self, sequence: u64) -> StreamMessage {
        let stream = self.js.get_stream("EDDY_EVENTS").await.unwrap();
        stream.get_raw_message(sequence).await.unwrap()
    }

    pub async fn last_stored(&self) -> StreamMessage {
        let mut stream = self.js.get_stream("EDDY_EVENTS").await.unwrap();
        let last = stream.info().await.unwrap().state.last_sequence;
        self.stored(last).await
    }
}

impl Drop for Bus {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub fn header<'a>(message: &'a StreamMessage, name: &str) -> Option<&'a str> {
    message.headers.get(name).map(|value| value.as_str())
}
