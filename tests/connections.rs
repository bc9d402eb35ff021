//! How a component reaches the services around it, run as the `eddy` binary:
//! - the NATS connection options every component takes (`--nats-user`/`--nats-password`,
//!   `--nats-creds`, `--nats-tls-ca`, `--nats-tls-cert`/`--nats-tls-key`), each against a real
//!   nats-server that requires it: a server that refuses a plain connection, and an event-bus
//!   with the option that stores an event there;
//! - the standard `OTEL_*` variables for traces, and a collector that never answers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use base64::Engine as _;
use eddy_testing::{NatsServer, eventually};
use serde_json::json;

/// An event-bus child process, killed on drop.
struct Bus {
    url: String,
    _child: tokio::process::Child,
}

impl Bus {
    async fn start(nats: &NatsServer, options: &[&str]) -> Self {
        Self::start_with_env(nats, options, &[]).await
    }

    async fn start_with_env(nats: &NatsServer, options: &[&str], env: &[(&str, &str)]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_eddy"))
            .args(["event-bus", "--addr", &format!("127.0.0.1:{port}")])
            .args(["--nats-url", &nats.url()])
            .args(options)
            .envs(env.iter().copied())
            .env("EDDY_LOG", "warn")
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Self {
            url: format!("http://127.0.0.1:{port}"),
            _child: child,
        }
    }

    /// Ready (connected, events stream in place), then one event published: 204 only once
    /// JetStream stored it.
    async fn publishes(&self, case: &str) {
        self.wait_ready(case).await;
        let answer = self.publish(case).await;
        assert_eq!(answer.status().as_u16(), 204, "{case}: publish answered");
    }

    async fn wait_ready(&self, case: &str) {
        let http = reqwest::Client::new();
        eventually(
            &format!("{case}: the event-bus to be ready"),
            Duration::from_secs(30),
            || async {
                http.get(format!("{}/readyz", self.url))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success())
            },
        )
        .await
        .unwrap();
    }

    async fn publish(&self, id: &str) -> reqwest::Response {
        reqwest::Client::new()
            .post(format!("{}/publish", self.url))
            .header("ce-specversion", "1.0")
            .header("ce-id", id)
            .header("ce-source", "connections")
            .header("ce-type", "connection.checked.v1")
            .body("{}")
            .send()
            .await
            .unwrap()
    }
}

/// How a connection was refused: its error's kind (a timeout or a refused socket is not the
/// refusal a test means).
fn refusal(connected: Result<async_nats::Client, async_nats::ConnectError>) -> String {
    match connected {
        Ok(_) => "connected".to_owned(),
        Err(error) => format!("{:?}: {error}", error.kind()),
    }
}

/// A plain connection (no credentials, no TLS) is refused by the server, the way `expected`
/// (an error kind, and words of its message) says.
async fn plain_connect_is_refused(nats: &NatsServer, case: &str, expected: &[&str]) {
    let refused = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(nats.url())
        .await;
    let refused = refusal(refused);
    assert!(
        expected.iter().all(|word| refused.contains(word)),
        "{case}: the server must refuse a plain connection with {expected:?}: {refused}"
    );
}

/// The events stream holds the event `id` (read with `options`).
async fn stored(nats: &NatsServer, options: async_nats::ConnectOptions, id: &str) {
    let client = options.connect(nats.url()).await.unwrap();
    let stream = async_nats::jetstream::new(client)
        .get_stream(eddy_platform::nats::EVENTS_STREAM)
        .await
        .unwrap();
    // A fresh server: the event is the stream's first message.
    let message = stream.get_raw_message(1).await.unwrap();
    let headers = message.headers;
    assert_eq!(
        headers.get("ce-id").map(|v| v.to_string()),
        Some(id.to_owned()),
        "the stored event is the one published"
    );
}

#[tokio::test]
async fn user_and_password() {
    let nats = NatsServer::start_with_config(
        r#"authorization { users = [ { user: "bus", password: "s3cret-pass" } ] }"#,
    )
    .unwrap();
    plain_connect_is_refused(&nats, "user/password", &["AuthorizationViolation"]).await;
    let wrong = async_nats::ConnectOptions::with_user_and_password("bus".into(), "wrong".into())
        .connection_timeout(Duration::from_secs(5))
        .connect(nats.url())
        .await;
    let wrong = refusal(wrong);
    assert!(
        wrong.starts_with("AuthorizationViolation"),
        "a wrong password is refused by the server: {wrong}"
    );

    // The password comes from the environment, as the flag's help advises.
    let bus = Bus::start_with_env(
        &nats,
        &["--nats-user", "bus"],
        &[("EDDY_NATS_PASSWORD", "s3cret-pass")],
    )
    .await;
    bus.publishes("user-password").await;
    stored(
        &nats,
        async_nats::ConnectOptions::with_user_and_password("bus".into(), "s3cret-pass".into()),
        "user-password",
    )
    .await;
}

#[tokio::test]
async fn tls_with_a_private_ca() {
    let pki = eddy_testing::pki::Pki::new();
    let nats = NatsServer::start_with_config(&pki.server_tls(false)).unwrap();
    // The server requires TLS: the client upgrades, and the private CA's certificate is not
    // one the system trusts.
    plain_connect_is_refused(&nats, "TLS", &["invalid peer certificate: UnknownIssuer"]).await;
    let bus = Bus::start(&nats, &["--nats-tls-ca", &pki.arg("ca.pem")]).await;
    bus.publishes("tls-ca").await;
    stored(
        &nats,
        async_nats::ConnectOptions::new()
            .add_root_certificates(pki.path("ca.pem"))
            .require_tls(true),
        "tls-ca",
    )
    .await;
}

#[tokio::test]
async fn mutual_tls() {
    let pki = eddy_testing::pki::Pki::new();
    let nats = NatsServer::start_with_config(&pki.server_tls(true)).unwrap();
    // TLS without a client certificate is not enough.
    let anonymous = async_nats::ConnectOptions::new()
        .add_root_certificates(pki.path("ca.pem"))
        .require_tls(true)
        .connection_timeout(Duration::from_secs(5))
        .connect(nats.url())
        .await;
    let anonymous = refusal(anonymous);
    assert!(
        anonymous.contains("received fatal alert: CertificateRequired"),
        "a client without a certificate is refused by the server's TLS alert: {anonymous}"
    );
    let bus = Bus::start(
        &nats,
        &[
            "--nats-tls-ca",
            &pki.arg("ca.pem"),
            "--nats-tls-cert",
            &pki.arg("client.pem"),
            "--nats-tls-key",
            &pki.arg("client.key"),
        ],
    )
    .await;
    bus.publishes("mutual-tls").await;
    stored(
        &nats,
        async_nats::ConnectOptions::new()
            .add_root_certificates(pki.path("ca.pem"))
            .add_client_certificate(pki.path("client.pem"), pki.path("client.key"))
            .require_tls(true),
        "mutual-tls",
    )
    .await;
}

/// A NATS JWT (`ed25519-nkey`) with `claims`, issued by `issuer` for `subject`.
fn nats_jwt(issuer: &nkeys::KeyPair, subject: &str, nats: serde_json::Value) -> String {
    let encode = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    let header = encode(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let issued = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims = json!({
        "jti": format!("{subject}-{issued}"), "iat": issued, "iss": issuer.public_key(),
        "sub": subject, "name": "eddy-test", "nats": nats,
    });
    let payload = encode(claims.to_string().as_bytes());
    let signed = format!("{header}.{payload}");
    let signature = encode(&issuer.sign(signed.as_bytes()).unwrap());
    format!("{signed}.{signature}")
}

/// An operator-mode server (an operator, an account with JetStream, preloaded) and a creds file
/// of one user of that account.
fn operator_setup(dir: &Path) -> (String, PathBuf) {
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    // JetStream in operator mode needs a system account.
    let system = nkeys::KeyPair::new_account();
    let system_jwt = nats_jwt(
        &operator,
        &system.public_key(),
        json!({"type": "account", "version": 2}),
    );
    let user = nkeys::KeyPair::new_user();
    let operator_jwt = nats_jwt(
        &operator,
        &operator.public_key(),
        json!({"type": "operator", "version": 2}),
    );
    let account_jwt = nats_jwt(
        &operator,
        &account.public_key(),
        json!({"type": "account", "version": 2, "limits": {
            "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
            "wildcards": true, "conn": -1, "leaf": -1,
            "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}}),
    );
    let user_jwt = nats_jwt(
        &account,
        &user.public_key(),
        json!({"type": "user", "version": 2, "pub": {}, "sub": {},
            "subs": -1, "data": -1, "payload": -1}),
    );
    let config = format!(
        "operator: {operator_jwt:?}\nsystem_account: {system}\nresolver: MEMORY\n\
         resolver_preload: {{ {account}: {account_jwt:?}, {system}: {system_jwt:?} }}\n",
        account = account.public_key(),
        system = system.public_key(),
    );
    let creds = dir.join("user.creds");
    std::fs::write(
        &creds,
        format!(
            "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
             -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n",
            user.seed().unwrap()
        ),
    )
    .unwrap();
    (config, creds)
}

#[tokio::test]
async fn a_credentials_file() {
    let dir = tempfile::tempdir().unwrap();
    let (config, creds) = operator_setup(dir.path());
    let nats = NatsServer::start_with_config(&config).unwrap();
    plain_connect_is_refused(&nats, "creds", &["AuthorizationViolation"]).await;
    let bus = Bus::start(&nats, &["--nats-creds", creds.to_str().unwrap()]).await;
    bus.publishes("creds").await;
    stored(
        &nats,
        async_nats::ConnectOptions::with_credentials_file(creds.clone())
            .await
            .unwrap(),
        "creds",
    )
    .await;
}

/// What an OTLP/HTTP JSON receiver got: each export's resource service name and span names.
#[derive(Clone, Default)]
struct Collector(std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>);

impl Collector {
    /// Serves `/v1/traces` on a free port; returns its base URL.
    async fn serve(&self) -> String {
        use axum::{Json, extract::State, routing::post};
        async fn collect(
            State(collector): State<Collector>,
            Json(body): Json<serde_json::Value>,
        ) -> Json<serde_json::Value> {
            let mut got = collector.0.lock().unwrap();
            for resource in body["resourceSpans"].as_array().into_iter().flatten() {
                let service = resource["resource"]["attributes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|a| a["key"] == "service.name")
                    .and_then(|a| a["value"]["stringValue"].as_str())
                    .unwrap_or_default()
                    .to_owned();
                for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
                    for span in scope["spans"].as_array().into_iter().flatten() {
                        let name = span["name"].as_str().unwrap_or_default().to_owned();
                        got.push((service.clone(), name));
                    }
                }
            }
            Json(json!({}))
        }
        let app = axum::Router::new()
            .route("/v1/traces", post(collect))
            .with_state(self.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    }
}

/// The standard variables alone turn traces on: `OTEL_EXPORTER_OTLP_ENDPOINT`,
/// `OTEL_EXPORTER_OTLP_PROTOCOL` (JSON here: the receiver reads only JSON), `OTEL_SERVICE_NAME`
/// and `OTEL_BSP_SCHEDULE_DELAY`.
#[tokio::test]
async fn the_standard_otel_variables_turn_traces_on() {
    let nats = NatsServer::start().unwrap();
    let collector = Collector::default();
    let endpoint = collector.serve().await;
    let bus = Bus::start_with_env(
        &nats,
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
            ("OTEL_SERVICE_NAME", "bus-under-test"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    )
    .await;
    bus.publishes("traced").await;
    eventually(
        "the publish and store spans of bus-under-test at the collector",
        Duration::from_secs(20),
        || async {
            let got = collector.0.lock().unwrap().clone();
            ["publish", "store"].iter().all(|name| {
                got.iter()
                    .any(|(service, span)| service == "bus-under-test" && span == name)
            })
        },
    )
    .await
    .unwrap_or_else(|_| panic!("spans received: {:?}", collector.0.lock().unwrap()));
}

/// A collector that takes connections and never answers: exports hang until their timeout and
/// spans are dropped, and no publish waits for them. Exports are attempted every 100 ms for the
/// whole run; a publish that waited on one would take the export timeout (10 s).
#[tokio::test]
async fn a_collector_that_never_answers_costs_spans_not_publishes() {
    let nats = NatsServer::start().unwrap();
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", silent.local_addr().unwrap());
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    tokio::spawn({
        let accepted = accepted.clone();
        async move {
            let mut held = Vec::new();
            while let Ok((connection, _)) = silent.accept().await {
                accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                held.push(connection);
            }
        }
    });
    let bus = Bus::start_with_env(
        &nats,
        &["--otlp-endpoint", &endpoint],
        &[("OTEL_BSP_SCHEDULE_DELAY", "100")],
    )
    .await;
    bus.wait_ready("silent collector").await;
    let mut slowest = Duration::ZERO;
    let started = std::time::Instant::now();
    let mut published = 0;
    while started.elapsed() < Duration::from_secs(3) || published < 200 {
        let sent = std::time::Instant::now();
        let answer = bus.publish(&format!("silent-{published}")).await;
        assert_eq!(answer.status().as_u16(), 204);
        slowest = slowest.max(sent.elapsed());
        published += 1;
    }
    assert!(
        accepted.load(std::sync::atomic::Ordering::SeqCst) > 0,
        "the exporter tried the collector"
    );
    assert!(
        slowest < Duration::from_secs(2),
        "a publish took {slowest:?} while the collector hung"
    );
    let mut stream = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap())
        .get_stream(eddy_platform::nats::EVENTS_STREAM)
        .await
        .unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, published);
}
