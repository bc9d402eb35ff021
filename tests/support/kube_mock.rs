//! A mock Kubernetes API server for watchers: one list, then one watch whose events the test
//! sends (kube's tower-test pattern).

use std::{
    convert::Infallible,
    sync::{Arc, Mutex},
};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::StreamBody;
use kube::client::Body;
use serde_json::{Value, json};
use tokio::sync::mpsc;

pub type WatchBody =
    StreamBody<futures::stream::BoxStream<'static, Result<Frame<Bytes>, Infallible>>>;

/// A response body that streams what is sent on `rx`, ending when it closes.
pub fn streamed(rx: mpsc::Receiver<Bytes>) -> WatchBody {
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        let chunk = rx.recv().await?;
        Some((Ok(Frame::data(chunk)), rx))
    });
    StreamBody::new(Box::pin(stream))
}

/// The requests an API server got (method and URI), checked by the test once it is done: a
/// panic in the server's task would not fail the test.
pub type Requests = Arc<Mutex<Vec<(String, String)>>>;

/// Answers a watcher of the resources listed at `list_path` (`/apis/.../things?`): the list
/// (`list_kind`) with `initial`, then one watch that streams what the test sends on the
/// returned channel. Later requests (a re-watch) are left pending, anything else gets 404.
/// Records every request.
pub fn api_server(
    list_path: &'static str,
    list_kind: &'static str,
    initial: Vec<Value>,
) -> (kube::Client, mpsc::Sender<Value>, Requests) {
    let (client, mut watches, requests) = api_server_of(vec![Watched {
        list_path,
        list_kind,
        initial,
    }]);
    (client, watches.remove(0), requests)
}

/// One kind a mock API server answers watchers of.
pub struct Watched {
    /// `/apis/<group>/<version>/<plural>?`
    pub list_path: &'static str,
    /// The list's `kind`.
    pub list_kind: &'static str,
    /// What the list holds.
    pub initial: Vec<Value>,
}

/// Like [`api_server`], for several kinds: one watch channel per kind, in order.
pub fn api_server_of(kinds: Vec<Watched>) -> (kube::Client, Vec<mpsc::Sender<Value>>, Requests) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<WatchBody>>();
    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    for _ in &kinds {
        let (events, receiver) = mpsc::channel::<Value>(16);
        senders.push(events);
        receivers.push(Some(receiver));
    }
    let requests = Requests::default();
    let recorded = requests.clone();
    tokio::spawn(async move {
        let mut pending = Vec::new();
        while let Some((request, send)) = handle.next_request().await {
            let uri = request.uri().to_string();
            recorded
                .lock()
                .unwrap()
                .push((request.method().to_string(), uri.clone()));
            let Some(index) = kinds
                .iter()
                .position(|kind| uri.starts_with(kind.list_path))
            else {
                let mut response = Response::new(streamed(mpsc::channel(1).1));
                *response.status_mut() = http::StatusCode::NOT_FOUND;
                send.send_response(response);
                continue;
            };
            let kind = &kinds[index];
            if !uri.contains("watch=true") {
                let list = json!({
                    "apiVersion": "v1", "kind": kind.list_kind,
                    "metadata": {"resourceVersion": "1"}, "items": kind.initial.clone(),
                });
                let (tx, rx) = mpsc::channel(1);
                tx.send(Bytes::from(list.to_string())).await.unwrap();
                drop(tx);
                send.send_response(Response::new(streamed(rx)));
            } else if let Some(mut events) = receivers[index].take() {
                let (tx, rx) = mpsc::channel(16);
                send.send_response(Response::new(streamed(rx)));
                tokio::spawn(async move {
                    while let Some(event) = events.recv().await {
                        let line = format!("{event}\n");
                        if tx.send(Bytes::from(line)).await.is_err() {
                            return;
                        }
                    }
                    // Keep the watch open until the test ends.
                    tx.closed().await;
                });
            } else {
                pending.push(send);
            }
        }
    });
    (kube::Client::new(service, "default"), senders, requests)
}
