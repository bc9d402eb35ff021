//! What an attacker on the same machine, a web page in the user's browser or a function's own
//! code could do to `eddy up`, each tried against the real processes: NATS without credentials,
//! foreign `Host` and `Origin` headers, idle and slow connections, a function port called around
//! the gateway, the platform token reaching function code, a function that never answers, build
//! scripts reading eddy's secrets or leaving processes behind, a build directory changed on disk.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    os::unix::fs::PermissionsExt as _,
    path::Path,
    time::{Duration, Instant},
};

mod up;

use eddy_testing::eventually;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use up::{Up, processes_inside};

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

async fn connect_as(url: &str, user: &str, password: &str) -> async_nats::Client {
    connect_watching(url, user, password).await.0
}

/// The server's permission violations one connection was told of.
type Violations = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

/// [`connect_as`], keeping the permission violations the server reports.
async fn connect_watching(
    url: &str,
    user: &str,
    password: &str,
) -> (async_nats::Client, Violations) {
    let violations = Violations::default();
    let seen = violations.clone();
    let client =
        async_nats::ConnectOptions::with_user_and_password(user.to_owned(), password.to_owned())
            .custom_inbox_prefix(format!("_INBOX_{user}"))
            .event_callback(move |event| {
                let seen = seen.clone();
                async move {
                    if let async_nats::Event::ServerError(async_nats::ServerError::Other(text)) =
                        event
                        && text.to_lowercase().contains("permissions violation")
                    {
                        seen.lock().unwrap().push(text);
                    }
                }
            })
            .connect(url)
            .await
            .unwrap();
    (client, violations)
}

/// Waits until the server has said that publishing to `subject` is not permitted: an
/// operation counts as denied only then (a timeout or a missing stream would not).
async fn denied(violations: &Violations, subject: &str, what: &str) {
    eventually(what, Duration::from_secs(10), || async {
        violations
            .lock()
            .unwrap()
            .iter()
            .any(|text| text.contains(&format!("Publish to \"{subject}\"")))
    })
    .await
    .unwrap_or_else(|error| panic!("{error}: {:?}", violations.lock().unwrap()));
}

fn jetstream(client: async_nats::Client) -> async_nats::jetstream::Context {
    async_nats::jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(2))
        .build(client)
}

/// The nats-server `eddy up` starts takes only eddy's own users, each with the least it needs:
/// nobody else reads the functions' env in the KV bucket or rewrites a function's access.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_takes_only_eddys_users_each_with_the_least_it_needs() {
    let data_dir = tempfile::tempdir().unwrap();
    let up = Up::start(data_dir.path(), &[], &[]).await;
    assert_eq!(mode(data_dir.path()), 0o700, "the data dir is private");
    let secrets = data_dir.path().join("secrets/nats-users.json");
    assert_eq!(mode(&secrets), 0o600, "the NATS passwords are private");
    let passwords: Value = serde_json::from_slice(&std::fs::read(&secrets).unwrap()).unwrap();
    let password = |user: &str| passwords[user].as_str().unwrap().to_owned();

    // No user, or a wrong password: refused by the server as an authorization violation (not
    // merely a connection that failed or took too long).
    let refused = |connected: Result<async_nats::Client, async_nats::ConnectError>| {
        connected.err().map(|error| error.kind())
    };
    let anonymous = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(10))
        .connect(&up.nats)
        .await;
    assert_eq!(
        refused(anonymous),
        Some(async_nats::ConnectErrorKind::AuthorizationViolation),
        "an anonymous client must not connect"
    );
    let wrong = async_nats::ConnectOptions::with_user_and_password(
        "eddy-controller".into(),
        "guess".into(),
    )
    .connection_timeout(Duration::from_secs(10))
    .connect(&up.nats)
    .await;
    assert_eq!(
        refused(wrong),
        Some(async_nats::ConnectErrorKind::AuthorizationViolation),
        "a wrong password must not connect"
    );

    // The controller owns the bucket: it reads and writes it (so the denials below mean it).
    let controller =
        jetstream(connect_as(&up.nats, "eddy-controller", &password("eddy-controller")).await);
    let bucket = controller.get_key_value("eddy_resources").await.unwrap();
    bucket.put("probe", "1".into()).await.unwrap();
    bucket.delete("probe").await.unwrap();

    // The event-bus publishes events and sees nothing of the bucket.
    let (bus, bus_violations) =
        connect_watching(&up.nats, "eddy-event-bus", &password("eddy-event-bus")).await;
    let bus = jetstream(bus);
    bus.get_stream("EDDY_EVENTS")
        .await
        .expect("the event-bus keeps its stream");
    assert!(
        bus.get_key_value("eddy_resources").await.is_err(),
        "the event-bus reads no resources"
    );
    denied(
        &bus_violations,
        "$JS.API.STREAM.INFO.KV_eddy_resources",
        "the event-bus refused the bucket",
    )
    .await;

    // The dispatcher reads resources but never writes them; it stores reply events but cannot
    // change, purge or delete the events stream.
    let (dispatcher, dispatcher_violations) =
        connect_watching(&up.nats, "eddy-dispatcher", &password("eddy-dispatcher")).await;
    let dispatcher = jetstream(dispatcher);
    let readable = dispatcher.get_key_value("eddy_resources").await.unwrap();
    readable.get("anything").await.unwrap();
    assert!(
        readable.put("evil", "1".into()).await.is_err(),
        "the dispatcher writes no resources"
    );
    denied(
        &dispatcher_violations,
        "$KV.eddy_resources.evil",
        "the dispatcher refused a write to the bucket",
    )
    .await;
    let stored = match dispatcher.publish("eddy.events.s.t", "x".into()).await {
        Ok(ack) => ack.await.is_ok(),
        Err(_) => false,
    };
    assert!(stored, "the dispatcher stores reply events");
    let mut events = dispatcher.get_stream("EDDY_EVENTS").await.unwrap();
    assert!(
        events.purge().await.is_err(),
        "the dispatcher cannot purge the events stream"
    );
    denied(
        &dispatcher_violations,
        "$JS.API.STREAM.PURGE.EDDY_EVENTS",
        "the dispatcher refused a purge",
    )
    .await;
    assert!(
        dispatcher.delete_stream("EDDY_EVENTS").await.is_err(),
        "the dispatcher cannot delete the events stream"
    );
    denied(
        &dispatcher_violations,
        "$JS.API.STREAM.DELETE.EDDY_EVENTS",
        "the dispatcher refused a stream deletion",
    )
    .await;
    assert!(
        events.info().await.unwrap().state.messages >= 1,
        "the events stream keeps what it held"
    );
    assert!(
        bucket.get("evil").await.unwrap().is_none(),
        "nothing the dispatcher tried was written"
    );
    up.stop().await;
}

/// Bound to loopback, the listeners answer only loopback host names (no DNS rebinding), refuse
/// state changes from foreign origins, take only JSON on the legacy route, and the dashboard
/// forbids framing and foreign scripts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn web_pages_cannot_use_the_loopback_listeners() {
    let data_dir = tempfile::tempdir().unwrap();
    let up = Up::start(data_dir.path(), &[], &[]).await;
    let http = reqwest::Client::new();
    let port = |url: &str| url.rsplit(':').next().unwrap().to_owned();

    let rebound = http
        .get(up.functions())
        .header("host", format!("attacker.example:{}", port(&up.api)))
        .send()
        .await
        .unwrap();
    assert_eq!(rebound.status(), 421);
    let own = http
        .get(up.functions())
        .header("host", format!("localhost:{}", port(&up.api)))
        .send()
        .await
        .unwrap();
    assert_eq!(own.status(), 200);

    let cross_origin = http
        .post(format!(
            "{}/subscriptions/default/any/redrive",
            up.dispatcher
        ))
        .header("origin", "http://attacker.example")
        .send()
        .await
        .unwrap();
    assert_eq!(cross_origin.status(), 403);
    let cross_origin_publish = up
        .binary("s", "1", "t")
        .header("origin", "https://attacker.example")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(cross_origin_publish.status(), 403);
    let same_origin = http
        .post(format!("{}/publish", up.bus))
        .header("origin", up.bus.clone())
        .header("ce-specversion", "1.0")
        .header("ce-id", "1")
        .header("ce-source", "s")
        .header("ce-type", "t")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(same_origin.status(), 204);

    let text_plain = http
        .post(format!("{}/shop/v1/events", up.bus))
        .header("content-type", "text/plain")
        .body(r#"{"event-type":"a","event-type-version":"v1","event-time":"2024-01-01T00:00:00Z","data":1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(text_plain.status(), 415);

    let page = http.get(format!("{}/", up.api)).send().await.unwrap();
    assert_eq!(page.headers()["x-frame-options"], "DENY");
    assert_eq!(page.headers()["x-content-type-options"], "nosniff");
    let policy = page.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(policy.contains("frame-ancestors 'none'"), "{policy}");
    assert!(policy.contains("script-src 'sha256-"), "{policy}");
    assert!(!policy.contains("unsafe-inline"), "{policy}");
    up.stop().await;
}

/// Idle connections past the fd limit used to stop every listener, and half a header held a
/// connection for good. Now idle and slow connections are closed after the header timeout and
/// the connection cap makes new clients wait, so the listener keeps answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_slow_clients_do_not_stop_a_listener() {
    let data_dir = tempfile::tempdir().unwrap();
    let up = Up::start(
        data_dir.path(),
        &[],
        &[
            ("EDDY_HEADER_READ_TIMEOUT", "1s"),
            ("EDDY_BODY_TIMEOUT", "1s"),
            ("EDDY_MAX_CONNECTIONS", "64"),
        ],
    )
    .await;
    let address = up.bus.trim_start_matches("http://").to_owned();
    let mut idle = Vec::new();
    for _ in 0..300 {
        idle.push(tokio::net::TcpStream::connect(&address).await.unwrap());
    }
    let mut slow = tokio::net::TcpStream::connect(&address).await.unwrap();
    slow.write_all(b"POST /publish HTTP/1.1\r\nhost: 127.0.0.1\r\nce-")
        .await
        .unwrap();

    let started = Instant::now();
    let response = reqwest::Client::new()
        .get(format!("{}/healthz", up.bus))
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .expect("the listener answers past 300 idle connections");
    assert_eq!(response.status(), 200);
    eprintln!(
        "answered after {:?} behind 300 idle connections",
        started.elapsed()
    );

    // The half-sent header is cut off: the server closes the connection.
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(20), slow.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "a connection stuck in its header is closed");
    // And so are the idle ones.
    let mut first = idle.remove(0);
    let closed = tokio::time::timeout(Duration::from_secs(20), first.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "an idle connection is closed");

    // A body that stops halfway is cut off on the API too (which has no request deadline of
    // its own): the request fails and the connection is let go.
    let api = up.api.trim_start_matches("http://").to_owned();
    let mut stalled = tokio::net::TcpStream::connect(&api).await.unwrap();
    stalled
        .write_all(
            b"PUT /apis/eddy.dev/v1alpha1/namespaces/default/functions/f HTTP/1.1\r\n\
              host: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"kind",
        )
        .await
        .unwrap();
    let mut answer = Vec::new();
    let read =
        tokio::time::timeout(Duration::from_secs(20), stalled.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "a stalled body is cut off");
    let answer = String::from_utf8_lossy(&answer);
    assert!(!answer.starts_with("HTTP/1.1 2"), "{answer}");
    up.stop().await;
}

/// `--max-connections` holds: with a cap of 4, four connections are served, the fifth is
/// accepted by the kernel but not served (it waits, as documented), and it is served as soon as
/// one of the four closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_cap_makes_the_next_client_wait_for_a_freed_slot() {
    let data_dir = tempfile::tempdir().unwrap();
    let up = Up::start(
        data_dir.path(),
        &[],
        &[
            ("EDDY_HEADER_READ_TIMEOUT", "60s"),
            ("EDDY_MAX_CONNECTIONS", "4"),
        ],
    )
    .await;
    let address = up.bus.trim_start_matches("http://").to_owned();
    const REQUEST: &[u8] = b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n";
    // Reads one answer's status line and headers.
    async fn answer(stream: &mut tokio::net::TcpStream) -> String {
        let mut seen = Vec::new();
        let mut byte = [0u8; 1];
        while !seen.ends_with(b"\r\n\r\n") {
            if stream.read(&mut byte).await.unwrap() == 0 {
                break;
            }
            seen.push(byte[0]);
        }
        String::from_utf8_lossy(&seen).into_owned()
    }
    // Four connections, each served and kept open (keep-alive).
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut stream = tokio::net::TcpStream::connect(&address).await.unwrap();
        stream.write_all(REQUEST).await.unwrap();
        let head = tokio::time::timeout(Duration::from_secs(10), answer(&mut stream))
            .await
            .expect("one of the first four is served");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        held.push(stream);
    }
    // The fifth is connected (the backlog) but not served while the four are open.
    let mut fifth = tokio::net::TcpStream::connect(&address).await.unwrap();
    fifth.write_all(REQUEST).await.unwrap();
    let mut waiting = Box::pin(answer(&mut fifth));
    assert!(
        tokio::time::timeout(Duration::from_secs(2), waiting.as_mut())
            .await
            .is_err(),
        "the fifth connection was served past a cap of four"
    );
    // A freed slot serves it.
    drop(held.pop());
    let freed = Instant::now();
    let head = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the fifth is served once a slot is free");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    eprintln!("served {:?} after a slot was freed", freed.elapsed());
    up.stop().await;
}

/// A function's own port answers only the gateway (a per-instance secret); the platform token
/// the dispatcher delivers with never reaches function code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn functions_are_reached_only_through_the_gateway_and_never_see_the_platform_token() {
    let data_dir = tempfile::tempdir().unwrap();
    let up = Up::start(
        data_dir.path(),
        &["--allowed-sinks", "http://127.0.0.1:*"],
        &[],
    )
    .await;
    let recorder = r#"
const seen = [];
module.exports = { main: (event) => {
  const request = event.extensions.request;
  if (request.method === "GET") return seen;
  seen.push({ authorization: request.headers.authorization || null, secret: request.headers["x-eddy-instance-secret"] || null, env: Object.keys(process.env).filter((k) => k.startsWith("EDDY_")) });
  return "ok";
} };
"#;
    up.deploy(
        "recorder",
        json!({"runtime": "nodejs20", "source": {"inline": {"source": recorder}},
               "access": {"mode": "token", "tokenDigests": [eddy_platform::auth::Tokens::digest_text("caller-token")]}}),
    )
    .await;
    let http = reqwest::Client::new();
    // The instance's port, from its log line.
    let log = data_dir.path().join("logs/functions/default/recorder.log");
    let port_in_log = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .find_map(|line| line.strip_prefix("eddy: recorder listening on "))
            .and_then(|port| port.trim().parse::<u16>().ok())
    };
    eventually(
        "the instance's port in its log",
        Duration::from_secs(30),
        || async { port_in_log().is_some() },
    )
    .await
    .unwrap();
    let port = port_in_log().unwrap();
    let direct = http
        .post(format!("http://127.0.0.1:{port}/"))
        .body("around the gateway")
        .send()
        .await
        .unwrap();
    assert_eq!(
        direct.status(),
        403,
        "the instance port refuses callers without its secret"
    );

    // An event delivered by the dispatcher (with the platform token) and a caller's request.
    let subscription = json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
        "metadata": {"name": "to-recorder", "namespace": "default"},
        "spec": {"sink": "http://recorder.default.svc.cluster.local", "types": ["probe.v1"]},
    });
    let response = http
        .put(format!(
            "{}/apis/eddy.dev/v1alpha1/namespaces/default/subscriptions/to-recorder",
            up.api
        ))
        .json(&subscription)
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success());
    let sub_url = format!(
        "{}/apis/eddy.dev/v1alpha1/namespaces/default/subscriptions/to-recorder",
        up.api
    );
    eventually("subscription ready", Duration::from_secs(60), || async {
        let sub: Value = http
            .get(&sub_url)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        sub["status"]["ready"] == json!(true)
    })
    .await
    .unwrap();
    let published = up
        .binary("probe", "p-1", "probe.v1")
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(published.status(), 204);
    let invoked = http
        .post(format!("{}/default/recorder", up.gateway))
        .bearer_auth("caller-token")
        .body("hi")
        .send()
        .await
        .unwrap();
    assert_eq!(invoked.status(), 200);

    eventually(
        "both requests recorded",
        Duration::from_secs(30),
        || async {
            let seen: Value = http
                .get(format!("{}/default/recorder", up.gateway))
                .bearer_auth("caller-token")
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap_or_default();
            seen.as_array().is_some_and(|all| all.len() >= 2)
        },
    )
    .await
    .unwrap();
    let seen: Value = http
        .get(format!("{}/default/recorder", up.gateway))
        .bearer_auth("caller-token")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let authorizations: Vec<&Value> = seen
        .as_array()
        .unwrap()
        .iter()
        .map(|s| &s["authorization"])
        .collect();
    assert!(
        authorizations.contains(&&json!(null)),
        "the dispatcher's delivery arrives without the platform token: {seen}"
    );
    assert!(
        authorizations.contains(&&json!("Bearer caller-token")),
        "a caller's own token is passed on: {seen}"
    );
    for entry in seen.as_array().unwrap() {
        assert_eq!(
            entry["secret"],
            json!(null),
            "the instance secret is not shown to the handler"
        );
        assert_eq!(
            entry["env"],
            json!([]),
            "no EDDY_ variable reaches the handler: {entry}"
        );
    }
    up.stop().await;
}

/// A handler that busy-loops past its timeout is answered 504 at `timeoutSeconds` + 2 s by the
/// gateway (bounded on both sides), and the stuck instance is replaced: the next request is served by a new process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_function_is_answered_at_its_timeout_and_replaced() {
    let data_dir = tempfile::tempdir().unwrap();
    let up = Up::start(data_dir.path(), &[], &[]).await;
    let spinner = r#"
module.exports = { main: (event) => {
  if (event.extensions.request.url.includes("spin")) { for (;;) {} }
  return { pid: process.pid };
} };
"#;
    up.deploy(
        "spinner",
        json!({"runtime": "nodejs20", "source": {"inline": {"source": spinner}}, "timeoutSeconds": 3}),
    )
    .await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let before: Value = http
        .get(format!("{}/default/spinner", up.gateway))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let started = Instant::now();
    let stuck = http
        .get(format!("{}/default/spinner/spin", up.gateway))
        .send()
        .await
        .unwrap();
    let waited = started.elapsed();
    assert_eq!(stuck.status(), 504);
    // At the 3 s timeout plus the gateway's 2 s margin: not before it (the function had its
    // time), and not much after (the old behaviour waited for the gateway's hour). The upper
    // bound leaves a loaded machine a second and a half.
    assert!(
        waited >= Duration::from_secs(5) && waited < Duration::from_millis(6_500),
        "answered after {waited:?}, expected at 5 s"
    );
    let replaced = eventually(
        "a new instance answers",
        Duration::from_secs(60),
        || async {
            let Ok(response) = http
                .get(format!("{}/default/spinner", up.gateway))
                .timeout(Duration::from_secs(5))
                .send()
                .await
            else {
                return false;
            };
            let now: Value = response.json().await.unwrap_or_default();
            now["pid"].is_number() && now["pid"] != before["pid"]
        },
    )
    .await;
    replaced.unwrap();
    up.stop().await;
}

/// Dependency installs run with a cleared environment (an npm lifecycle script sees no token),
/// what they leave running is stopped with them, and a build directory changed on disk is built
/// again instead of trusted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builds_see_no_secrets_leave_nothing_running_and_are_not_trusted_when_changed() {
    let data_dir = tempfile::tempdir().unwrap();
    let up = Up::start(
        data_dir.path(),
        &["--api-tokens", "api-secret-token"],
        &[("EDDY_BUS_TOKENS", "bus-secret-token")],
    )
    .await;
    let package = r#"{"name": "probe", "version": "1.0.0", "scripts": {"postinstall": "node -e \"const fs=require('fs');fs.writeFileSync('install-env.json', JSON.stringify(process.env));const c=require('child_process').spawn('sleep',['300'],{stdio:'ignore'});fs.writeFileSync('leftover.pid', String(c.pid));c.unref()\""}}"#;
    let source = r#"module.exports = { main: () => "original" };"#;
    let http = reqwest::Client::new();
    let response = http
        .put(format!("{}/probe", up.functions()))
        .bearer_auth("api-secret-token")
        .json(&json!({
            "apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
            "metadata": {"name": "probe", "namespace": "default"},
            "spec": {"runtime": "nodejs20", "source": {"inline": {"source": source, "dependencies": package}}},
        }))
        .send()
        .await
        .unwrap();
    assert!(
        response.status().is_success(),
        "{:?}",
        response.text().await
    );
    let builds = data_dir.path().join("builds");
    eventually("the build to finish", Duration::from_secs(120), || async {
        std::fs::read_dir(&builds)
            .ok()
            .and_then(|mut dirs| dirs.next())
            .and_then(Result::ok)
            .is_some_and(|dir| dir.path().join(".eddy-built").is_file())
    })
    .await
    .unwrap();
    let build_dir = std::fs::read_dir(&builds)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();

    let env: Value = serde_json::from_slice(
        &std::fs::read(build_dir.join("function/install-env.json")).unwrap(),
    )
    .unwrap();
    let leaked: Vec<&String> = env
        .as_object()
        .unwrap()
        .iter()
        .filter(|(name, value)| {
            name.starts_with("EDDY_") || value.as_str().is_some_and(|v| v.contains("secret-token"))
        })
        .map(|(name, _)| name)
        .collect();
    assert!(leaked.is_empty(), "the install saw {leaked:?}");

    let leftover: u32 = std::fs::read_to_string(build_dir.join("function/leftover.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    eventually(
        "the install's background process to be gone",
        Duration::from_secs(30),
        || async { eddy_testing::process_gone(leftover) },
    )
    .await
    .unwrap();

    // Change the built handler on disk, restart: the build is redone, the change is gone.
    let invoke = |gateway: String| {
        let http = http.clone();
        async move {
            http.get(format!("{gateway}/default/probe"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        }
    };
    eventually("the function answers", Duration::from_secs(60), || {
        let gateway = up.gateway.clone();
        let invoke = &invoke;
        async move { invoke(gateway).await == "original" }
    })
    .await
    .unwrap();
    std::fs::write(
        build_dir.join("function/handler.js"),
        r#"module.exports = { main: () => "tampered" };"#,
    )
    .unwrap();
    up.stop().await;
    let up = Up::start(
        data_dir.path(),
        &["--api-tokens", "api-secret-token"],
        &[("EDDY_BUS_TOKENS", "bus-secret-token")],
    )
    .await;
    eventually(
        "the rebuilt function answers",
        Duration::from_secs(120),
        || {
            let gateway = up.gateway.clone();
            let invoke = &invoke;
            async move { invoke(gateway).await == "original" }
        },
    )
    .await
    .unwrap();
    up.stop().await;
}

/// A manifest of 200,000 nested `[` took the YAML parser minutes to refuse; it is refused at
/// once, naming why, before anything is sent; so is one over 8 MiB.
#[tokio::test]
async fn deeply_nested_manifests_are_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("deep.yaml");
    std::fs::write(
        &manifest,
        format!("a: {}{}\n", "[".repeat(200_000), "]".repeat(200_000)),
    )
    .unwrap();
    let started = Instant::now();
    let stderr = refused_apply(&manifest).await;
    assert!(stderr.contains("nested deeper than 64"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "refused after {:?}",
        started.elapsed()
    );

    // Over 8 MiB: refused by its size, before it is parsed (or anything is sent).
    let big = dir.path().join("big.yaml");
    std::fs::write(&big, format!("# {}\n", "x".repeat(8 * 1024 * 1024))).unwrap();
    let stderr = refused_apply(&big).await;
    assert!(stderr.contains("manifests are at most 8388608"), "{stderr}");
}

/// `eddy apply -f manifest` against a server nothing listens on: it must fail before sending
/// anything; its stderr.
async fn refused_apply(manifest: &std::path::Path) -> String {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(["apply", "--server", "http://127.0.0.1:9", "-f"])
        .arg(manifest)
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Bad names and oversized resources get 404 / 413 / 422 (they used to reach the store and come
/// back 503); the dashboard's state holds no source or env and answers 304 while nothing
/// changed; a Python function's log holds no traceback for the health probes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_answers_bad_input_precisely_and_the_dashboard_sends_only_what_changed() {
    let data_dir = tempfile::tempdir().unwrap();
    let up = Up::start(data_dir.path(), &[], &[]).await;
    let http = reqwest::Client::new();
    let base = format!("{}/apis/eddy.dev/v1alpha1/namespaces", up.api);
    for path in [
        "default/functions/Not_A_Name",
        "Bad%20NS/functions/f",
        "default/functions/a..b",
    ] {
        let read = http.get(format!("{base}/{path}")).send().await.unwrap();
        assert_eq!(read.status(), 404, "GET {path}");
        let delete = http.delete(format!("{base}/{path}")).send().await.unwrap();
        assert_eq!(delete.status(), 404, "DELETE {path}");
    }
    let put = http
        .put(format!("{base}/default/functions/Not_A_Name"))
        .json(&json!({"apiVersion": "eddy.dev/v1alpha1", "kind": "Function", "metadata": {"name": "Not_A_Name"},
            "spec": {"runtime": "nodejs20", "source": {"inline": {"source": "x"}}}}))
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 422);
    let huge = json!({"apiVersion": "eddy.dev/v1alpha1", "kind": "Function", "metadata": {"name": "huge"},
        "spec": {"runtime": "nodejs20", "source": {"inline": {"source": "x".repeat(900 * 1024)}}}});
    let put = http
        .put(format!("{base}/default/functions/huge"))
        .json(&huge)
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 413);

    let handler = "def main(event, context):\n    return 'ok'\n";
    let env_secret = "very-secret-value";
    up.deploy(
        "pyfn",
        json!({"runtime": "python311", "source": {"inline": {"source": handler}},
               "env": [{"name": "API_KEY", "value": env_secret}]}),
    )
    .await;
    let state = http
        .get(format!("{}/dashboard/state", up.api))
        .send()
        .await
        .unwrap();
    assert_eq!(state.status(), 200);
    let tag = state.headers()["etag"].to_str().unwrap().to_owned();
    let body = state.text().await.unwrap();
    assert!(body.contains("pyfn"), "{body}");
    assert!(
        !body.contains(env_secret) && !body.contains("def main"),
        "{body}"
    );
    let unchanged = http
        .get(format!("{}/dashboard/state", up.api))
        .header("if-none-match", &tag)
        .send()
        .await
        .unwrap();
    assert_eq!(unchanged.status(), 304);
    assert!(unchanged.text().await.unwrap().is_empty());

    let answer = http
        .get(format!("{}/default/pyfn", up.gateway))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.text().await.unwrap(), "ok");
    let log =
        std::fs::read_to_string(data_dir.path().join("logs/functions/default/pyfn.log")).unwrap();
    assert!(!log.contains("Traceback"), "{log}");
    up.stop().await;
}

/// With publisher tokens on, a function's `emitCloudEvent` publishes with the publish-only token
/// eddy gives it (and the dispatcher's replies with one of their own); a Subscription whose sink
/// smuggles another host in userinfo is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn functions_publish_with_their_own_token_and_sinks_are_compared_as_urls() {
    let data_dir = tempfile::tempdir().unwrap();
    let token_file = data_dir.path().join("bus-tokens");
    std::fs::write(&token_file, "publisher-secret\n").unwrap();
    let up = Up::start(
        data_dir.path(),
        &[
            "--bus-token-file",
            token_file.to_str().unwrap(),
            "--allowed-sinks",
            "http://127.0.0.1:9000/hooks",
        ],
        &[],
    )
    .await;
    let http = reqwest::Client::new();
    let unauthorized = up.binary("s", "x", "t").send().await.unwrap();
    assert_eq!(unauthorized.status(), 401, "the token file is in force");

    let emitter = r#"
module.exports = { main: async (event) => {
  const id = `emitted-${Date.now()}`;
  await event.emitCloudEvent("emitted.v1", "emitter", { ok: true }, { id });
  return { id, sawToken: Object.keys(process.env).includes("EDDY_PUBLISHER_TOKEN") };
} };
"#;
    up.deploy(
        "emitter",
        json!({"runtime": "nodejs20", "source": {"inline": {"source": emitter}}}),
    )
    .await;
    let answer = http
        .post(format!("{}/default/emitter", up.gateway))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200, "{:?}", answer.text().await);
    let answer: Value = answer.json().await.unwrap();
    assert!(answer["id"].is_string(), "{answer}");
    assert_eq!(
        answer["sawToken"], false,
        "the publish token stays in the runtime, out of the function's env"
    );

    let base = format!(
        "{}/apis/eddy.dev/v1alpha1/namespaces/default/subscriptions",
        up.api
    );
    for (sink, status) in [
        ("http://127.0.0.1:9000@127.0.0.1:8083/subscriptions", 422),
        ("http://127.0.0.1:9000/hooksmith", 422),
        ("http://127.0.0.1:9000/hooks/../admin", 422),
        ("http://127.0.0.1:9000/hooks/orders", 201),
    ] {
        let response = http
            .put(format!("{base}/hook"))
            .json(
                &json!({"apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
                "metadata": {"name": "hook", "namespace": "default"},
                "spec": {"sink": sink, "types": ["a.v1"]}}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), status, "{sink}");
    }
    up.stop().await;
}

/// The CLI writing into a closed pipe (`eddy crds | head -1` once `head` is gone) ends quietly,
/// as Unix tools do, instead of panicking.
#[tokio::test]
async fn the_cli_stops_quietly_on_a_closed_pipe() {
    use std::os::unix::process::ExitStatusExt as _;
    for args in [&["crds"][..], &["token", "digest", "abc"][..]] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_eddy"))
            .args(args)
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
            .wait_with_output()
            .await
            .unwrap();
        assert!(output.stdout.is_empty(), "stdout went to the closed pipe");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!stderr.contains("panicked"), "eddy {args:?}: {stderr}");
        assert!(
            output.status.success() || output.status.signal() == Some(13),
            "eddy {args:?}: {:?}",
            output.status
        );
    }
}

/// eddy SIGKILLed has no chance to stop anything: the kernel stops nats-server and every
/// function instance with it (each child is told to die with its parent), so nothing of this
/// data dir is left running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_left_running_when_eddy_is_sigkilled() {
    let data_dir = tempfile::tempdir().unwrap();
    let up = Up::start(data_dir.path(), &[], &[]).await;
    up.deploy(
        "py",
        json!({"runtime": "python311", "source": {"inline": {"source": "def main(event, context):\n    return 'ok'\n"}}}),
    )
    .await;
    up.deploy(
        "node",
        json!({"runtime": "nodejs20", "source": {"inline": {"source": "module.exports = { main: () => 'ok' };"}}}),
    )
    .await;
    let running = processes_inside(data_dir.path());
    for part in ["nats-server", "server.py", "server.mjs"] {
        assert!(
            running.iter().any(|process| process.contains(part)),
            "{part} runs before the kill: {running:?}"
        );
    }
    assert!(!up.stop_with("KILL").await, "SIGKILL is not a clean exit");
    eventually(
        "every child of eddy to be gone",
        Duration::from_secs(20),
        || async { processes_inside(data_dir.path()).is_empty() },
    )
    .await
    .unwrap_or_else(|error| panic!("{error}: {:?}", processes_inside(data_dir.path())));
}

/// eddy's tokens stay out of nats-server's environment (which every process of the same user,
/// a function's included, can read in /proc/<pid>/environ), and `eddy up --api-token-file F
/// --apply DIR` applies its own manifests with a token from that file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_stay_out_of_nats_server_and_apply_uses_the_token_file() {
    let data_dir = tempfile::tempdir().unwrap();
    let inputs = tempfile::tempdir().unwrap();
    let token_file = inputs.path().join("api-tokens");
    std::fs::write(&token_file, "# operators\n\nfile-api-token\n").unwrap();
    let manifests = inputs.path().join("manifests");
    std::fs::create_dir(&manifests).unwrap();
    std::fs::write(
        manifests.join("settings.yaml"),
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: settings}\ndata: {greeting: hello}\n",
    )
    .unwrap();
    let up = Up::start(
        data_dir.path(),
        &[
            "--api-token-file",
            token_file.to_str().unwrap(),
            "--apply",
            manifests.to_str().unwrap(),
        ],
        &[("EDDY_BUS_TOKENS", "bus-secret-token")],
    )
    .await;
    // Applied before `ready`, with the file's token.
    let list: Value = reqwest::Client::new()
        .get(format!("{}/api/v1/configmaps", up.api))
        .bearer_auth("file-api-token")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let names: Vec<&str> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|item| item["metadata"]["name"].as_str())
        .collect();
    assert_eq!(names, ["settings"], "{list}");

    let nats: Vec<String> = processes_inside(data_dir.path())
        .into_iter()
        .filter(|process| process.contains("nats-server"))
        .collect();
    assert_eq!(nats.len(), 1, "{nats:?}");
    let pid = nats[0].split(':').next().unwrap();
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let environ = String::from_utf8_lossy(&environ);
    assert!(
        environ.contains("PATH="),
        "the environment was read: {environ}"
    );
    for secret in ["bus-secret-token", "EDDY_"] {
        assert!(
            !environ.contains(secret),
            "nats-server's environment holds {secret}: {environ}"
        );
    }
    up.stop().await;
}

/// eddy's service processes (event-bus, dispatcher, controller, `eddy up`) are non-dumpable:
/// a process of the same user cannot read their `/proc/<pid>/environ` (where tokens may be) or
/// memory. The kernel shows it as the owner of `/proc/<pid>/environ`: root for a non-dumpable
/// process, the process's own user otherwise. To see the difference when the tests run as root,
/// the processes run as `nobody`; a CLI command (dumpable) is the control.
#[tokio::test]
async fn service_processes_are_not_dumpable() {
    use std::os::unix::{fs::MetadataExt as _, process::CommandExt as _};
    let as_root = nix::unistd::geteuid().is_root();
    let user = if as_root {
        65534
    } else {
        nix::unistd::geteuid().as_raw()
    };
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let spawn = |args: &[&str]| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_eddy"));
        command
            .args(args)
            .current_dir(dir.path())
            .env("EDDY_LOG", "error")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        if as_root {
            command.uid(user).gid(65534);
        }
        command.spawn().unwrap()
    };
    let unreachable_nats = ["--nats-url", "nats://127.0.0.1:9"];
    let mut services = vec![
        (
            "event-bus",
            spawn(
                &[
                    &["event-bus", "--addr", "127.0.0.1:0"][..],
                    &unreachable_nats,
                ]
                .concat(),
            ),
        ),
        (
            "dispatcher",
            spawn(
                &[
                    &["dispatcher", "--addr", "127.0.0.1:0"][..],
                    &unreachable_nats,
                ]
                .concat(),
            ),
        ),
    ];
    // The control: a CLI command that waits (here for an API that never answers).
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_url = format!("http://{}", silent.local_addr().unwrap());
    let mut control = spawn(&["get", "functions", "--server", &silent_url]);
    let owner = |pid: u32| {
        std::fs::metadata(format!("/proc/{pid}/environ"))
            .map(|meta| meta.uid())
            .ok()
    };
    assert_eq!(
        owner(control.id()),
        Some(user),
        "the control (a CLI command) stays dumpable, so the check tells them apart"
    );
    for (name, child) in &services {
        let pid = child.id();
        eventually(
            &format!("{name}'s /proc/{pid}/environ to be root's (non-dumpable)"),
            Duration::from_secs(20),
            || async { owner(pid) == Some(0) },
        )
        .await
        .unwrap_or_else(|_| panic!("{name} is dumpable: environ owned by {:?}", owner(pid)));
    }
    let _ = control.kill();
    let _ = control.wait();
    for (_, child) in &mut services {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// `eddy up --isolation cgroup` where cgroups cannot be made (an unprivileged user without a
/// delegated cgroup) refuses to start and says why, rather than running functions unconfined.
#[tokio::test]
async fn isolation_that_cannot_be_had_refuses_to_start_as_root() {
    // As an unprivileged user the outcome depends on delegation, which this test cannot
    // arrange; as root it runs the command as `nobody`, who has none. scripts/test skips the
    // `_as_root` tests (in its summary) for a user who is not root, except under CI.
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (scripts/test skips it for other users, except under CI)"
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(["up", "--isolation", "cgroup", "--data-dir"])
        .arg(dir.path().join("data"))
        .args(["--api-addr", "127.0.0.1:0", "--gateway-addr", "127.0.0.1:0"])
        .args([
            "--bus-addr",
            "127.0.0.1:0",
            "--dispatcher-addr",
            "127.0.0.1:0",
        ])
        .current_dir(dir.path())
        .env("HOME", dir.path())
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .uid(65534)
        .gid(65534)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(60), output)
        .await
        .expect("eddy up gave up within a minute")
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!output.status.success(), "{said}");
    assert!(said.contains("--isolation cgroup"), "{said}");
}

/// What the probe's victim and attacker Functions both are: a recorder of what reaches them
/// (`GET` lists it).
const RECORDER: &str = r#"
const seen = [];
module.exports = { main: (event) => {
  const request = event.extensions.request;
  if (request.method === "GET") return seen;
  seen.push({ path: request.url, type: event["ce-type"] || null,
              authorization: request.headers.authorization || null });
  return "recorded";
} };
"#;

/// The attack probe's high finding, replayed against a real `eddy up` (its NATS permissions, its
/// dispatcher delivering in-process with the platform token): an APIRule in namespace
/// `attacker` named the gateway's own address (`127.0.0.1`, or `*.0.0.1`), was Ready, and was
/// then handed the callers' calls to `victim`'s token-protected Function with their tokens, and
/// the dispatcher's deliveries with the platform token. Closed at every layer, each checked:
/// - no APIRule host is an address, a wildcard that can match one, or a name the gateway
///   answers to itself (`--gateway-hosts`, its domain) or a wildcard over one: refused at
///   apply, naming the field;
/// - a call carrying the platform token is routed by its path, never by the APIRule of its
///   host, and the token never reaches a Function;
/// - so a caller's token and a published event reach the victim, and the attacker's Function,
///   live on its own host all along, records none of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_apirule_takes_the_gateways_own_address_or_the_platforms_deliveries() {
    const PLATFORM_TOKEN: &str = "probe-platform-token";
    let data_dir = tempfile::tempdir().unwrap();
    let up = Up::start(
        data_dir.path(),
        &[
            "--allowed-sinks",
            "http://127.0.0.1:*",
            "--platform-token",
            PLATFORM_TOKEN,
            "--gateway-hosts",
            "localhost,eddy.localhost",
        ],
        &[],
    )
    .await;
    let indented = RECORDER.replace('\n', "\n        ");
    let digest = eddy_platform::auth::Tokens::digest_text("victim-token");
    let (ok, stdout, stderr) = up
        .apply_text(&format!(
            r#"apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {{name: vict, namespace: victim}}
spec:
  runtime: nodejs22
  access: {{mode: token, tokenDigests: ["{digest}"]}}
  source:
    inline:
      source: |
        {indented}
---
apiVersion: eddy.dev/v1alpha1
kind: Subscription
metadata: {{name: to-vict, namespace: victim}}
spec: {{sink: "http://vict.victim.svc.cluster.local", types: [probe.v1]}}
---
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {{name: spy, namespace: attacker}}
spec:
  runtime: nodejs22
  source:
    inline:
      source: |
        {indented}
---
apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata: {{name: spy, namespace: attacker}}
spec:
  hosts: [spy]
  service: {{name: spy, port: 80}}
  rules: [{{path: /*, methods: [GET, POST], noAuth: true}}]
"#
        ))
        .await;
    assert!(ok, "{stdout}\n{stderr}");

    // The gateway's own names are no APIRule's, whoever asks.
    for (host, why) in [
        ("127.0.0.1", "never an IP address"),
        ("\"*.0.0.1\"", "never an IP address"),
        ("\"*.1\"", "never an IP address"),
        // inet_aton's forms (Python's urllib, wget read each as 127.0.0.1).
        ("127.0.0.0x1", "never an IP address"),
        ("0x7f.0.0.0x1", "never an IP address"),
        ("\"*.0x1\"", "never an IP address"),
        // The gateway's own name (`--gateway-hosts`), and a wildcard over it.
        ("eddy", "a name the gateway itself answers to"),
        ("eddy.localhost", "a name the gateway itself answers to"),
        ("\"*\"", "a name the gateway itself answers to"),
    ] {
        let (ok, stdout, stderr) = up
            .apply_text(&format!(
                "apiVersion: gateway.kyma-project.io/v2\nkind: APIRule\nmetadata: {{name: capture, namespace: attacker}}\nspec:\n  hosts: [{host}]\n  service: {{name: spy, port: 80}}\n  rules: [{{path: /*, methods: [GET, POST], noAuth: true}}]\n"
            ))
            .await;
        assert!(!ok, "{host}: {stdout}");
        assert!(
            stderr.contains("spec.hosts[0]") && stderr.contains(why),
            "{host}: {stderr}"
        );
    }

    let http = reqwest::Client::new();
    let port = up.gateway.rsplit(':').next().unwrap().to_owned();
    let spy_host = reqwest::Client::builder()
        .resolve(
            "spy.localhost",
            format!("127.0.0.1:{port}").parse().unwrap(),
        )
        .build()
        .unwrap();
    let spy_url = format!("http://spy.localhost:{port}/");
    let victim_url = format!("{}/victim/vict/", up.gateway);
    let seen = |request: reqwest::RequestBuilder| async move {
        let Ok(response) = request.send().await else {
            return Value::Null;
        };
        response.json::<Value>().await.unwrap_or(Value::Null)
    };
    // Both Functions run, and the attacker's APIRule is live on its own host.
    eventually(
        "both Functions answer",
        Duration::from_secs(120),
        || async {
            seen(spy_host.get(&spy_url)).await.is_array()
                && seen(http.get(&victim_url).bearer_auth("victim-token"))
                    .await
                    .is_array()
        },
    )
    .await
    .unwrap();

    // A caller's token on the gateway's own address reaches the victim.
    let called = http
        .post(&victim_url)
        .bearer_auth("victim-token")
        .body("{}")
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(called.status(), 200);
    // A call with the platform token on the attacker's host is routed by its path, and the
    // token is taken off before the Function.
    let platform_call = spy_host
        .post(format!("http://spy.localhost:{port}/victim/vict"))
        .bearer_auth(PLATFORM_TOKEN)
        .body("{}")
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(platform_call.status(), 200);
    // The dispatcher's delivery reaches the victim.
    up.publish("probe.v1", "probe-1", json!({"n": 1})).await;

    eventually(
        "the call, the platform call and the event at the victim",
        Duration::from_secs(60),
        || async {
            seen(http.get(&victim_url).bearer_auth("victim-token"))
                .await
                .as_array()
                .is_some_and(|all| all.len() >= 3)
        },
    )
    .await
    .unwrap();
    let victim = seen(http.get(&victim_url).bearer_auth("victim-token")).await;
    let victim = victim.as_array().unwrap();
    assert_eq!(victim.len(), 3, "{victim:?}");
    assert_eq!(
        victim[0]["authorization"], "Bearer victim-token",
        "{victim:?}"
    );
    for delivered in &victim[1..] {
        assert_eq!(delivered["authorization"], Value::Null, "{victim:?}");
    }
    assert!(
        victim.iter().any(|each| each["type"] == "probe.v1"),
        "{victim:?}"
    );
    let spy = seen(spy_host.get(&spy_url)).await;
    assert_eq!(spy, json!([]), "the attacker's Function got nothing");
    up.stop().await;
}

/// `GET /{application}/v1/events/subscribed` under `eddy up`, with its NATS permissions: the
/// event-bus's user may list the consumers (it answered 503 after 5 s, refused
/// `$JS.API.CONSUMER.LIST.EDDY_EVENTS`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subscribed_events_answer_under_eddy_up() {
    let data_dir = tempfile::tempdir().unwrap();
    let up = Up::start(
        data_dir.path(),
        &["--allowed-sinks", "http://127.0.0.1:*"],
        &[],
    )
    .await;
    up.apply(json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
        "metadata": {"name": "orders", "namespace": "default"},
        "spec": {"sink": "http://127.0.0.1:9/", "source": "shop", "types": ["order.created.v1"]},
    }))
    .await;
    let url = format!("{}/shop/v1/events/subscribed", up.bus);
    let answer = std::sync::Arc::new(std::sync::Mutex::new((0u16, String::new())));
    let listed = eventually(
        "the subscribed events listed",
        Duration::from_secs(30),
        || {
            let (url, answer) = (url.clone(), answer.clone());
            async move {
                let Ok(response) = reqwest::get(url).await else {
                    return false;
                };
                let status = response.status().as_u16();
                let body = response.text().await.unwrap_or_default();
                let done = status == 200 && body.contains("order.created");
                *answer.lock().unwrap() = (status, body);
                done
            }
        },
    )
    .await;
    let (status, body) = answer.lock().unwrap().clone();
    assert!(listed.is_ok(), "{status}: {body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap(),
        json!({"eventsInfo": [{"name": "order.created", "version": "v1"}]})
    );
    up.stop().await;
}

/// A binary of a checkout run from another directory finds the tools `scripts/setup` put in
/// that checkout's `.tools` (Python 3.14 for python314, unpacked there): it used to look above
/// its working directory only, and python314 Functions stopped at `BuildToolMissing`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eddy_run_from_elsewhere_finds_its_checkouts_tools() {
    let elsewhere = tempfile::tempdir().unwrap();
    let data_dir = tempfile::tempdir().unwrap();
    let has_python314 = std::process::Command::new("python3.14")
        .arg("--version")
        .output()
        .is_ok_and(|output| output.status.success());
    let unpacked = up::repo().join(".tools/python3.14/usr/bin/python3.14");
    assert!(
        has_python314 || unpacked.is_file(),
        "no Python 3.14 here: run scripts/setup --python314"
    );
    let up = Up::start_in(elsewhere.path(), data_dir.path(), &[], &[]).await;
    up.deploy(
        "snake",
        json!({"runtime": "python314",
               "source": {"inline": {"source": "def main():\n    return 'from 3.14'\n"}}}),
    )
    .await;
    let answer = reqwest::get(format!("{}/default/snake", up.gateway))
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.text().await.unwrap(), "from 3.14");
    up.stop().await;
}

/// Resource presets as Kyma's Serverless configuration sets them, per installation (`eddy up
/// --function-presets`, in Kyma's shape): a Function naming no profile gets `defaultPreset`'s
/// requests and limits (read here through `resourceFieldRef`, as its pod's would be), a named
/// profile the configured values, and explicit requests under `minRequestCpu` are refused by
/// field, as Kyma's validation refuses them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn function_presets_are_the_installations() {
    let data_dir = tempfile::tempdir().unwrap();
    let presets = data_dir.path().join("presets.yaml");
    std::fs::write(
        &presets,
        "defaultPreset: S\nminRequestCpu: 30m\npresets:\n  S: {requestCpu: 70m, requestMemory: 100Mi, limitCpu: 140m, limitMemory: 200Mi}\n  XS: {requestCpu: 30m, requestMemory: 48Mi, limitCpu: 90m, limitMemory: 96Mi}\n",
    )
    .unwrap();
    let up = Up::start(
        data_dir.path(),
        &["--function-presets", presets.to_str().unwrap()],
        &[],
    )
    .await;
    let source = "module.exports = { main: () => ({ memory: process.env.MEMORY_LIMIT, cpu: process.env.CPU_REQUEST }) };";
    let env = json!([
        {"name": "MEMORY_LIMIT", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
        {"name": "CPU_REQUEST", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1m"}}},
    ]);
    up.deploy(
        "defaulted",
        json!({"runtime": "nodejs22", "source": {"inline": {"source": source}}, "env": env}),
    )
    .await;
    up.deploy(
        "tiny",
        json!({"runtime": "nodejs22", "source": {"inline": {"source": source}}, "env": env,
               "resourceConfiguration": {"function": {"profile": "XS"}}}),
    )
    .await;
    for (name, memory, cpu, profile) in
        [("defaulted", "200", "70", "S"), ("tiny", "96", "30", "XS")]
    {
        let answer: Value = reqwest::get(format!("{}/default/{name}", up.gateway))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(answer, json!({"memory": memory, "cpu": cpu}), "{name}");
        let function = up.get(format!("{}/{name}", up.functions())).await;
        assert_eq!(
            function["status"]["functionResourceProfile"], profile,
            "{function}"
        );
    }
    let refused = reqwest::Client::new()
        .put(format!("{}/small", up.functions()))
        .json(&json!({
            "apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
            "metadata": {"name": "small", "namespace": "default"},
            "spec": {"runtime": "nodejs22", "source": {"inline": {"source": source}},
                     "resourceConfiguration": {"function": {"resources": {"requests": {"cpu": "10m"}}}}},
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 422);
    let body = refused.text().await.unwrap();
    assert!(
        body.contains("spec.resourceConfiguration.function.resources.requests.cpu")
            && body.contains("must be at least 30m"),
        "{body}"
    );
    up.stop().await;
}
