//! The one mock Kubernetes API server of eddy's tests (kube's tower-test pattern), in two
//! modes over the same plumbing:
//! - [`scripted`]: expects exactly the given requests, in order, asserts each (method, path
//!   and query, body) and answers it as told; for reconcilers, whose every request matters;
//! - [`watching`]: answers watchers of some kinds with one list, then one watch whose events
//!   the test sends; for the gateway's and the dispatcher's followers.
//!
//! Both record the RBAC permission each request needs ([`permissions_used`]), so a test can
//! hold the chart's grants against what the code really asks for.

use std::{
    collections::BTreeSet,
    convert::Infallible,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body::Frame;
use http_body_util::{BodyExt as _, Full, StreamBody, combinators::UnsyncBoxBody};
use kube::client::Body;
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// What the mock answers with: a whole JSON document, or a stream of watch events.
pub type MockBody = UnsyncBoxBody<Bytes, Infallible>;

/// A response body that streams what is sent on `rx`, ending when it closes.
fn streamed(rx: mpsc::Receiver<Bytes>) -> MockBody {
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        let chunk = rx.recv().await?;
        Some((Ok(Frame::data(chunk)), rx))
    });
    StreamBody::new(stream).boxed_unsync()
}

fn json_response(status: u16, answer: &Value) -> Response<MockBody> {
    let mut response = Response::new(Full::new(Bytes::from(answer.to_string())).boxed_unsync());
    *response.status_mut() = http::StatusCode::from_u16(status).unwrap_or_else(|_| {
        panic!("a mock answer's status {status} is not an HTTP status");
    });
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

/// The RBAC permissions of every request the mock API servers of this process answered.
static PERMISSIONS_USED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// The RBAC permissions (`group/resource:verb`) of every request the mock API servers of this
/// process answered so far.
pub fn permissions_used() -> BTreeSet<String> {
    PERMISSIONS_USED.lock().expect("not poisoned").clone()
}

fn record_permission(method: &Method, uri: &http::Uri) {
    PERMISSIONS_USED
        .lock()
        .expect("not poisoned")
        .extend(crate::rbac::needed_by(method.as_str(), &uri.to_string()));
}

/// How a scripted exchange answers the request's body (JSON, or `null` for none): a status
/// and a JSON answer.
pub type Respond = Box<dyn FnOnce(Value) -> (u16, Value) + Send>;

/// One request a [`scripted`] API server expects, and how it answers.
pub struct Exchange {
    /// The method.
    pub method: Method,
    /// The path and query, exactly as kube sends them.
    pub uri: String,
    /// The answer, from the request's body.
    pub respond: Respond,
}

/// A request expected with `method` on `uri`, answered by `respond`.
pub fn expect(
    method: Method,
    uri: impl Into<String>,
    respond: impl FnOnce(Value) -> (u16, Value) + Send + 'static,
) -> Exchange {
    Exchange {
        method,
        uri: uri.into(),
        respond: Box::new(respond),
    }
}

/// A mock API server that expects exactly `exchanges`, in order, and nothing after them (it
/// waits for the client to be dropped). Every write but the Lease's must be a server-side
/// apply. The task returns the bodies it got; await it to fail the test on a wrong request
/// (a panic in the server's task alone would not).
pub fn scripted(exchanges: Vec<Exchange>) -> (kube::Client, tokio::task::JoinHandle<Vec<Value>>) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<MockBody>>();
    let task = tokio::spawn(async move {
        let mut bodies = Vec::new();
        for (index, exchange) in exchanges.into_iter().enumerate() {
            // Generous: a reconcile may run the real `git` between two requests, and a loaded
            // machine is slow; a request that never comes fails the test all the same.
            let (request, send) =
                tokio::time::timeout(Duration::from_secs(30), handle.next_request())
                    .await
                    .unwrap_or_else(|_| {
                        panic!(
                            "request #{index} ({} {}) was never sent",
                            exchange.method, exchange.uri
                        )
                    })
                    .unwrap_or_else(|| {
                        panic!(
                            "the client went away before request #{index} ({} {})",
                            exchange.method, exchange.uri
                        )
                    });
            assert_eq!(
                (request.method(), request.uri().to_string()),
                (&exchange.method, exchange.uri.clone()),
                "request #{index}"
            );
            record_permission(request.method(), request.uri());
            // kube-lease-manager writes the Lease's holder fields with strategic merge patches.
            if request.method() == Method::PATCH
                && !request.uri().path().contains("/coordination.k8s.io/")
            {
                let content_type = request.headers().get(http::header::CONTENT_TYPE).cloned();
                assert_eq!(
                    content_type.as_ref().and_then(|v| v.to_str().ok()),
                    Some("application/apply-patch+yaml"),
                    "every write is a server-side apply"
                );
            }
            let bytes = request
                .into_body()
                .collect_bytes()
                .await
                .expect("request body");
            let body: Value = if bytes.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&bytes).expect("a JSON body")
            };
            bodies.push(body.clone());
            let (status, answer) = (exchange.respond)(body);
            send.send_response(json_response(status, &answer));
        }
        let extra = tokio::time::timeout(Duration::from_secs(30), handle.next_request())
            .await
            .expect("the client is dropped after the reconcile");
        if let Some((request, _)) = extra {
            panic!("unexpected request {} {}", request.method(), request.uri());
        }
        bodies
    });
    (kube::Client::new(service, "default"), task)
}

/// The requests a [`watching`] API server got (method and URI), checked by the test once it
/// is done: a panic in the server's task would not fail the test.
pub type Requests = Arc<Mutex<Vec<(String, String)>>>;

/// One kind a [`watching`] API server answers watchers of.
pub struct Watched {
    /// `/apis/<group>/<version>/<plural>?`
    pub list_path: &'static str,
    /// The list's `kind`.
    pub list_kind: &'static str,
    /// What the list holds.
    pub initial: Vec<Value>,
}

/// Answers a watcher of the resources listed at `list_path` (`/apis/.../things?`): the list
/// (`list_kind`) with `initial`, then one watch that streams what the test sends on the
/// returned channel. See [`watching`].
pub fn api_server(
    list_path: &'static str,
    list_kind: &'static str,
    initial: Vec<Value>,
) -> (kube::Client, mpsc::Sender<Value>, Requests) {
    let (client, mut watches, requests) = watching(vec![Watched {
        list_path,
        list_kind,
        initial,
    }]);
    (client, watches.remove(0), requests)
}

/// Answers watchers of several kinds: each kind's list, then one watch per kind that streams
/// what the test sends on that kind's channel (in the order of `kinds`). Later requests (a
/// re-watch) are left pending, anything else gets 404. Records every request.
pub fn watching(kinds: Vec<Watched>) -> (kube::Client, Vec<mpsc::Sender<Value>>, Requests) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<MockBody>>();
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
            record_permission(request.method(), request.uri());
            recorded
                .lock()
                .expect("not poisoned")
                .push((request.method().to_string(), uri.clone()));
            let Some(index) = kinds
                .iter()
                .position(|kind| uri.starts_with(kind.list_path))
            else {
                send.send_response(json_response(404, &json!({"kind": "Status", "code": 404})));
                continue;
            };
            let kind = &kinds[index];
            if !uri.contains("watch=true") {
                let list = json!({
                    "apiVersion": "v1", "kind": kind.list_kind,
                    "metadata": {"resourceVersion": "1"}, "items": kind.initial.clone(),
                });
                send.send_response(json_response(200, &list));
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
