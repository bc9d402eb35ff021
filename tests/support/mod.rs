//! Shared pieces of the end-to-end tests: the platform's components in-process against a real
//! nats-server, and a programmable HTTP sink that records what it receives.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod jwt;
pub mod kyma;
pub mod registry;

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use async_nats::jetstream;
use axum::{
    Router,
    body::Bytes,
    extract::State,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
};
use eddy_model::resources::consumer_name;
use eddy_platform::{nats::EVENTS_STREAM, shutdown::CancellationToken};
use eddy_testing::{NatsServer, eventually};
use serde_json::{Value, json};

/// Options of [`Platform::start`].
pub struct Options {
    pub ack_wait: Duration,
    pub scale_to_zero_after: Duration,
    pub scale_down_window: Duration,
    pub target_concurrency: usize,
    pub git_poll_interval: Duration,
    /// Longest a request waits for an instance (`--activation-timeout`).
    pub activation_timeout: Duration,
    /// Largest request body the gateway forwards (`--max-request-size`).
    pub max_request_size: bytesize::ByteSize,
    /// Longest a dependency install may take (`--build-timeout`).
    pub build_timeout: Duration,
    /// The npm that installs Node.js dependencies (`--npm`).
    pub npm: std::path::PathBuf,
    /// Warm spares per runtime in use (`--warm-spares`).
    pub warm_spares: usize,
    /// Run a dispatcher in-process (tests that kill it run `eddy dispatcher` themselves).
    pub dispatcher: bool,
    /// What confines each instance (`--isolation`), and its task cap.
    pub isolation: eddy_controller::Isolation,
    pub max_function_tasks: u64,
    /// Tokens the event-bus asks publishers for (`--bus-token`); functions then get a
    /// publish-only token of their own.
    pub bus_tokens: Vec<String>,
    /// The gateway's external authorizers (`--extension-providers`).
    pub extension_providers: Option<eddy_model::ext_authz::ExtensionProviders>,
    /// What calls waiting for an instance may hold (`--max-held-calls`, `--max-held-bytes`,
    /// `--held-share-per-function`).
    pub hold: eddy_platform::flags::HoldArgs,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            ack_wait: Duration::from_secs(30),
            scale_to_zero_after: Duration::from_secs(60),
            scale_down_window: Duration::from_secs(30),
            target_concurrency: 10,
            git_poll_interval: Duration::from_secs(60),
            activation_timeout: Duration::from_secs(30),
            max_request_size: bytesize::ByteSize::mib(16),
            build_timeout: Duration::from_secs(300),
            npm: "npm".into(),
            warm_spares: 1,
            dispatcher: true,
            isolation: eddy_controller::Isolation::None,
            max_function_tasks: 512,
            bus_tokens: Vec::new(),
            extension_providers: None,
            hold: eddy_platform::flags::defaults(),
        }
    }
}

/// NATS, event-bus, controller API and dispatcher, each on its own port.
pub struct Platform {
    pub nats: NatsServer,
    pub bus: String,
    pub api: String,
    pub gateway: String,
    pub backend: std::sync::Arc<eddy_controller::local::LocalController>,
    pub data_dir: tempfile::TempDir,
    pub dispatcher: String,
    pub http: reqwest::Client,
    pub js: jetstream::Context,
    /// The token the platform's gateway accepts for every function (new each run).
    pub platform_token: String,
    shutdown: CancellationToken,
    dispatchers: Mutex<Vec<CancellationToken>>,
    _up: eddy::up::Platform,
}

async fn listener() -> (tokio::net::TcpListener, SocketAddr) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    (listener, addr)
}

impl Platform {
    pub async fn start() -> Self {
        Self::start_with(Options::default()).await
    }

    /// The platform as `eddy up` puts it together (the same code), against the test's
    /// nats-server; dispatchers are started beside it so tests can stop and add them.
    pub async fn start_with(options: Options) -> Self {
        let nats = NatsServer::start().unwrap();
        let shutdown = CancellationToken::new();
        let data_dir = tempfile::tempdir().unwrap();
        let local = SocketAddr::from(([127, 0, 0, 1], 0));
        let args = eddy::up::Args {
            data_dir: data_dir.path().to_path_buf(),
            functions: eddy_controller::FunctionArgs {
                // Installed once for the whole suite, as a user's data dir keeps them.
                runtimes_dir: Some(
                    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/eddy-runtimes"),
                ),
                scale_to_zero_after: options.scale_to_zero_after,
                scale_down_window: options.scale_down_window,
                target_concurrency: options.target_concurrency,
                git_poll_interval: options.git_poll_interval,
                activation_timeout: options.activation_timeout,
                max_request_size: options.max_request_size,
                build_timeout: options.build_timeout,
                npm: options.npm.clone(),
                warm_spares: options.warm_spares,
                isolation: options.isolation,
                max_function_tasks: options.max_function_tasks,
                hold: options.hold.clone(),
                exposure: eddy_platform::flags::ApiRuleArgs {
                    extension_providers: options.extension_providers.clone(),
                    ..eddy_platform::flags::defaults()
                },
                ..Default::default()
            },
            nats_url: Some(nats.url()),
            bus_addr: local,
            gateway_addr: local,
            api_addr: local,
            dispatcher_addr: local,
            sinks: eddy_platform::flags::SinkArgs {
                allowed_sinks: vec![
                    "http://127.0.0.1:".parse().unwrap(),
                    "https://127.0.0.1:".parse().unwrap(),
                ],
            },
            no_dispatcher: true,
            bus_tokens: options.bus_tokens.clone(),
            ..eddy_platform::flags::defaults()
        };
        let up = eddy::up::Platform::start(&args, false, &shutdown)
            .await
            .unwrap();
        let client = async_nats::connect(nats.url()).await.unwrap();
        let mut platform = Self {
            nats,
            bus: up.bus_url.clone(),
            api: up.api_url.clone(),
            gateway: up.gateway_url.clone(),
            backend: up.local_controller.clone().unwrap(),
            platform_token: up.platform_token.clone(),
            data_dir,
            dispatcher: String::new(),
            http: reqwest::Client::new(),
            js: jetstream::new(client),
            dispatchers: Mutex::default(),
            shutdown,
            _up: up,
        };
        platform
            .wait_ready(&format!("{}/readyz", platform.bus))
            .await;
        if options.dispatcher {
            platform.dispatcher = platform.start_dispatcher(options.ack_wait).await;
        }
        platform
    }

    /// Starts one more dispatcher process-equivalent (in-process) and returns its admin URL.
    pub async fn start_dispatcher(&self, ack_wait: Duration) -> String {
        let (listener, addr) = listener().await;
        let mut args = eddy_dispatcher::Args::new(addr, self.nats.url());
        args.sinks.allowed_sinks = vec!["http://127.0.0.1:".parse().unwrap()];
        args.ack_wait = ack_wait;
        args.platform.platform_token = Some(self.platform_token.clone());
        // As `eddy up` starts it: deliveries to functions call the gateway in this process.
        args.gateway = self._up.gateway_in_process.clone();
        let token = self.shutdown.child_token();
        self.dispatchers.lock().unwrap().push(token.clone());
        let dispatcher = eddy_dispatcher::Dispatcher::new(args, token).await.unwrap();
        tokio::spawn(dispatcher.serve(listener));
        let url = format!("http://{addr}");
        self.wait_ready(&format!("{url}/readyz")).await;
        url
    }

    pub async fn wait_ready(&self, url: &str) {
        eventually(url, Duration::from_secs(20), || async {
            matches!(self.http.get(url).send().await, Ok(r) if r.status() == 200)
        })
        .await
        .unwrap();
    }

    /// PUTs a Subscription through the API; returns the status code and body.
    pub async fn put_subscription(&self, name: &str, spec: Value) -> (u16, Value) {
        let body = json!({
            "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription",
            "metadata": {"name": name, "namespace": "default"},
            "spec": spec,
        });
        self.put_json(
            &format!("/apis/eddy.dev/v1alpha1/namespaces/default/subscriptions/{name}"),
            &body,
        )
        .await
    }

    /// PUTs a Subscription and waits until it is Ready.
    pub async fn subscribe(&self, name: &str, spec: Value) {
        let (status, body) = self.put_subscription(name, spec).await;
        assert!(status == 200 || status == 201, "{status}: {body}");
        self.wait_subscription_ready(name).await;
    }

    pub async fn subscription(&self, name: &str) -> Value {
        self.get_json(&format!(
            "{}/apis/eddy.dev/v1alpha1/namespaces/default/subscriptions/{name}",
            self.api
        ))
        .await
    }

    pub async fn wait_subscription_ready(&self, name: &str) {
        eventually(
            &format!("subscription {name} to be ready"),
            Duration::from_secs(20),
            || async { self.subscription(name).await["status"]["ready"] == json!(true) },
        )
        .await
        .unwrap();
    }

    /// DELETEs a Function through the API; asserts 200.
    pub async fn delete_function(&self, name: &str) {
        let response = self
            .http
            .delete(format!(
                "{}/apis/eddy.dev/v1alpha1/namespaces/default/functions/{name}",
                self.api
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "deleting {name}");
    }

    pub async fn delete_subscription(&self, name: &str) {
        let response = self
            .http
            .delete(format!(
                "{}/apis/eddy.dev/v1alpha1/namespaces/default/subscriptions/{name}",
                self.api
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
    }

    /// Publishes a binary-mode event; asserts 204.
    pub async fn publish(&self, source: &str, ty: &str, id: &str, data: Value) {
        let response = self
            .http
            .post(format!("{}/publish", self.bus))
            .header("ce-specversion", "1.0")
            .header("ce-id", id)
            .header("ce-source", source)
            .header("ce-type", ty)
            .header("content-type", "application/json")
            .body(data.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 204, "publish {id}");
    }

    /// The consumer of a subscription, if it exists.
    pub async fn consumer_info(&self, name: &str) -> Option<jetstream::consumer::Info> {
        let stream = self.js.get_stream(EVENTS_STREAM).await.ok()?;
        stream
            .consumer_info(consumer_name("default", name))
            .await
            .ok()
    }

    /// Waits until a subscription's consumer has delivered every event it matches
    /// ([`eddy::bench::consumer_settled`]: nothing pending or unacknowledged is not enough on
    /// its own right after a publish).
    pub async fn wait_settled(&self, name: &str) {
        eventually(
            &format!("subscription {name} to settle"),
            Duration::from_secs(60),
            || async {
                let Ok(stream) = self.js.get_stream(EVENTS_STREAM).await else {
                    return false;
                };
                eddy::bench::consumer_settled(&stream, &consumer_name("default", name))
                    .await
                    .unwrap_or(false)
            },
        )
        .await
        .unwrap();
    }

    /// Dead letters of a subscription, as the dispatcher lists them.
    pub async fn dead_letters(&self, name: &str) -> Vec<Value> {
        self.dead_letters_at(&self.dispatcher, name).await
    }

    /// Dead letters of a subscription, as the dispatcher at `dispatcher` (its admin URL) lists
    /// them.
    pub async fn dead_letters_at(&self, dispatcher: &str, name: &str) -> Vec<Value> {
        let body: Value = self
            .http
            .get(format!(
                "{dispatcher}/dead-letters?subscription=default/{name}"
            ))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        body["items"].as_array().unwrap().clone()
    }

    pub fn stop_dispatchers(&self) {
        for token in self.dispatchers.lock().unwrap().drain(..) {
            token.cancel();
        }
    }
}

impl Drop for Platform {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// `eddy dispatcher` as a child process, killed on drop.
pub struct DispatcherProcess {
    pub child: tokio::process::Child,
    pub url: String,
    /// What the process logged so far (also passed on to the test's stderr).
    log: Arc<Mutex<String>>,
}

impl DispatcherProcess {
    /// The process's log lines so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }
}

impl Platform {
    /// Starts `eddy dispatcher` as its own process and waits until it is ready.
    pub async fn spawn_dispatcher(&self, ack_wait: &str) -> DispatcherProcess {
        self.spawn_dispatcher_with_env(ack_wait, &[]).await
    }

    /// [`Self::spawn_dispatcher`] with more environment variables.
    pub async fn spawn_dispatcher_with_env(
        &self,
        ack_wait: &str,
        env: &[(&str, &str)],
    ) -> DispatcherProcess {
        use tokio::io::AsyncBufReadExt as _;
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_eddy"))
            .args([
                "dispatcher",
                "--addr",
                "127.0.0.1:0",
                "--nats-url",
                &self.nats.url(),
            ])
            .env("EDDY_ALLOWED_SINKS", "http://127.0.0.1:,https://127.0.0.1:")
            .env("EDDY_ACK_WAIT", ack_wait)
            .envs(env.iter().copied())
            .env("EDDY_PLATFORM_TOKEN", &self.platform_token)
            .env("EDDY_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let mut log_lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let kept = log.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = log_lines.next_line().await {
                eprintln!("{line}");
                let mut kept = kept.lock().unwrap();
                kept.push_str(&line);
                kept.push('\n');
            }
        });
        let stdout = child.stdout.take().unwrap();
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let url = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if let Some(url) = line.strip_prefix("dispatcher ready on ") {
                    return url.to_owned();
                }
            }
            panic!("eddy dispatcher exited before it was ready");
        })
        .await
        .unwrap();
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        self.wait_ready(&format!("{url}/readyz")).await;
        DispatcherProcess { child, url, log }
    }
}

/// One request a sink received.
#[derive(Debug, Clone)]
pub struct Received {
    pub headers: HeaderMap,
    pub body: Bytes,
    /// When the request arrived.
    pub at: std::time::Instant,
}

impl Received {
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
    }
}

/// How a sink answers.
pub type Behaviour = Arc<dyn Fn(&Received, usize) -> Response + Send + Sync>;

struct SinkState {
    received: Mutex<Vec<Received>>,
    attempts_by_id: Mutex<HashMap<String, usize>>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    overlaps: AtomicUsize,
    active_ids: Mutex<Vec<String>>,
    delay: Duration,
    /// The first attempt of this event id is held this long before it is answered.
    hold: Option<(String, Duration)>,
    behaviour: Behaviour,
}

/// An HTTP sink in the test process.
pub struct Sink {
    pub url: String,
    state: Arc<SinkState>,
}

impl Sink {
    /// Answers 200 to everything.
    pub async fn ok() -> Self {
        Self::answering(StatusCode::OK).await
    }

    /// Answers `status` to everything, at once.
    pub async fn answering(status: StatusCode) -> Self {
        Self::start(Duration::ZERO, Arc::new(move |_, _| status.into_response())).await
    }

    /// Answers `failing` until the switch it returns is turned on, then 200.
    pub async fn switchable(failing: StatusCode) -> (Self, Arc<std::sync::atomic::AtomicBool>) {
        let healthy = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let switch = healthy.clone();
        let sink = Self::start(
            Duration::ZERO,
            Arc::new(move |_, _| {
                if switch.load(std::sync::atomic::Ordering::SeqCst) {
                    StatusCode::OK.into_response()
                } else {
                    failing.into_response()
                }
            }),
        )
        .await;
        (sink, healthy)
    }

    /// `behaviour(request, attempt_of_this_event)` decides the answer; `delay` before answering.
    pub async fn start(delay: Duration, behaviour: Behaviour) -> Self {
        Self::start_with(delay, None, behaviour).await
    }

    /// As [`Sink::start`], and the first attempt of event `id` is held for `hold` before it is
    /// answered (a delivery kept in flight).
    pub async fn holding(delay: Duration, id: &str, hold: Duration, behaviour: Behaviour) -> Self {
        Self::start_with(delay, Some((id.to_owned(), hold)), behaviour).await
    }

    async fn start_with(
        delay: Duration,
        hold: Option<(String, Duration)>,
        behaviour: Behaviour,
    ) -> Self {
        let state = Arc::new(SinkState {
            received: Mutex::default(),
            attempts_by_id: Mutex::default(),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            overlaps: AtomicUsize::new(0),
            active_ids: Mutex::default(),
            delay,
            hold,
            behaviour,
        });
        let app = Router::new()
            .route("/{*path}", post(receive))
            .route("/", post(receive))
            .with_state(state.clone());
        let (listener, addr) = listener().await;
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self {
            url: format!("http://{addr}/"),
            state,
        }
    }

    pub fn received(&self) -> Vec<Received> {
        self.state.received.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.state.received.lock().unwrap().len()
    }

    pub fn ids(&self) -> Vec<String> {
        self.received()
            .iter()
            .map(|r| r.header("ce-id").to_owned())
            .collect()
    }

    pub fn attempts(&self, id: &str) -> usize {
        self.state
            .attempts_by_id
            .lock()
            .unwrap()
            .get(id)
            .copied()
            .unwrap_or(0)
    }

    pub fn max_in_flight(&self) -> usize {
        self.state.max_in_flight.load(Ordering::SeqCst)
    }

    /// The ids of the events being delivered right now.
    pub fn in_flight_ids(&self) -> Vec<String> {
        self.state.active_ids.lock().unwrap().clone()
    }

    /// How often one event was being delivered twice at the same moment.
    pub fn overlaps(&self) -> usize {
        self.state.overlaps.load(Ordering::SeqCst)
    }

    pub async fn wait_for(&self, count: usize) {
        eventually(
            &format!("{count} deliveries"),
            Duration::from_secs(60),
            || async { self.count() >= count },
        )
        .await
        .unwrap_or_else(|error| panic!("{error}; got {}", self.count()));
    }
}

async fn receive(State(state): State<Arc<SinkState>>, headers: HeaderMap, body: Bytes) -> Response {
    let received = Received {
        headers,
        body,
        at: std::time::Instant::now(),
    };
    let id = received.header("ce-id").to_owned();
    {
        let mut active = state.active_ids.lock().unwrap();
        if active.contains(&id) {
            state.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        active.push(id.clone());
    }
    let now = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    state.max_in_flight.fetch_max(now, Ordering::SeqCst);
    let attempt = {
        let mut attempts = state.attempts_by_id.lock().unwrap();
        let entry = attempts.entry(id.clone()).or_default();
        *entry += 1;
        *entry
    };
    if !state.delay.is_zero() {
        tokio::time::sleep(state.delay).await;
    }
    if let Some((held, hold)) = &state.hold
        && *held == id
        && attempt == 1
    {
        tokio::time::sleep(*hold).await;
    }
    let response = (state.behaviour)(&received, attempt);
    state.received.lock().unwrap().push(received);
    state.in_flight.fetch_sub(1, Ordering::SeqCst);
    {
        let mut active = state.active_ids.lock().unwrap();
        if let Some(position) = active.iter().position(|active| *active == id) {
            active.remove(position);
        }
    }
    response
}

impl Platform {
    /// PUTs a Function through the API; returns the status code and body.
    pub async fn put_function(&self, name: &str, spec: Value) -> (u16, Value) {
        let body = json!({
            "apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
            "metadata": {"name": name, "namespace": "default"},
            "spec": spec,
        });
        self.put_json(
            &format!("/apis/eddy.dev/v1alpha1/namespaces/default/functions/{name}"),
            &body,
        )
        .await
    }

    pub async fn function(&self, name: &str) -> Value {
        self.function_at("default", name).await
    }

    /// The status of one condition of a Function (`True`, `False`, `Unknown`, or "").
    pub async fn condition(&self, name: &str, type_: &str) -> (String, String, String) {
        condition_of(&self.function(name).await, type_)
    }

    /// Runs the eddy CLI against this platform; returns (success, stdout, stderr).
    pub async fn eddy(&self, args: &[&str]) -> (bool, String, String) {
        eddy_testing::eddy_cli(env!("CARGO_BIN_EXE_eddy"), self.urls(), args, None).await
    }

    /// Runs the eddy CLI against this platform with `input` on its standard input.
    pub async fn eddy_with_input(&self, args: &[&str], input: &str) -> (bool, String, String) {
        eddy_testing::eddy_cli(env!("CARGO_BIN_EXE_eddy"), self.urls(), args, Some(input)).await
    }

    /// `eddy apply -f -` of `manifests` (YAML, several documents allowed); returns (success,
    /// stdout, stderr).
    pub async fn apply_text(&self, manifests: &str) -> (bool, String, String) {
        let args = ["apply", "-f", "-"];
        eddy_testing::eddy_cli(
            env!("CARGO_BIN_EXE_eddy"),
            self.urls(),
            &args,
            Some(manifests),
        )
        .await
    }

    fn urls(&self) -> eddy_testing::EddyUrls<'_> {
        eddy_testing::EddyUrls {
            api: &self.api,
            bus: &self.bus,
            dispatcher: &self.dispatcher,
        }
    }

    /// PUTs `body` as JSON to the controller API's `path`; returns the status code and body.
    pub async fn put_json(&self, path: &str, body: &Value) -> (u16, Value) {
        let response = self
            .http
            .put(format!("{}{path}", self.api))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        (status, response.json().await.unwrap())
    }

    /// The body of a GET, as text.
    pub async fn get_text(&self, url: &str) -> String {
        let response = self.http.get(url).send().await.unwrap();
        response.text().await.unwrap()
    }

    /// The body of a GET, as JSON.
    pub async fn get_json(&self, url: &str) -> Value {
        let response = self.http.get(url).send().await.unwrap();
        response.json().await.unwrap()
    }

    /// Function `name` in `namespace`, as the API shows it.
    pub async fn function_at(&self, namespace: &str, name: &str) -> Value {
        self.get_json(&format!(
            "{}/apis/eddy.dev/v1alpha1/namespaces/{namespace}/functions/{name}",
            self.api
        ))
        .await
    }

    /// Waits until function `name` in `namespace` runs an instance of its current generation;
    /// returns it.
    pub async fn wait_running_at(&self, namespace: &str, name: &str) -> Value {
        let waited = eventually(
            &format!("function {namespace}/{name} to run"),
            Duration::from_secs(180),
            || async {
                let function = self.function_at(namespace, name).await;
                condition_of(&function, "Running").0 == "True"
                    && function["status"]["observedGeneration"]
                        == function["metadata"]["generation"]
            },
        )
        .await;
        let function = self.function_at(namespace, name).await;
        if let Err(error) = waited {
            panic!("{error}: {function}");
        }
        function
    }

    /// Deploys a Function and waits until it runs an instance of this generation.
    pub async fn deploy(&self, name: &str, spec: Value) {
        let (status, body) = self.put_function(name, spec).await;
        assert!(status == 200 || status == 201, "{status}: {body}");
        self.wait_running_at("default", name).await;
    }

    /// A client that reaches every one of `hosts` on the gateway's address (as `*.localhost`
    /// and a DNS record would), so calls name the host an APIRule exposes.
    pub fn host_client(&self, hosts: &[&str]) -> reqwest::Client {
        let addr: SocketAddr = self.gateway.trim_start_matches("http://").parse().unwrap();
        let mut builder = reqwest::Client::builder();
        for host in hosts {
            builder = builder.resolve(host, addr);
        }
        builder.build().unwrap()
    }

    /// The `state` and `description` of APIRule `namespace/name`'s status (empty when none).
    pub async fn apirule_state(&self, namespace: &str, name: &str) -> (String, String) {
        let rule = self
            .get_json(&format!(
                "{}/apis/gateway.kyma-project.io/v2/namespaces/{namespace}/apirules/{name}",
                self.api
            ))
            .await;
        let text = |field: &str| {
            rule["status"][field]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        };
        (text("state"), text("description"))
    }

    /// What a function's instances wrote to their log so far.
    pub async fn function_log(&self, name: &str) -> String {
        self.get_text(&format!(
            "{}/apis/eddy.dev/v1alpha1/namespaces/default/functions/{name}/log",
            self.api
        ))
        .await
    }

    /// Invokes a function through the gateway.
    pub fn invoke(&self, name: &str, path: &str) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{}/default/{name}{path}", self.gateway))
    }

    pub fn pids(&self, name: &str) -> Vec<u32> {
        self.backend.pids("default", name)
    }
}

/// The status, reason and message of one condition of a resource (empty when it has none).
pub fn condition_of(resource: &Value, type_: &str) -> (String, String, String) {
    let found = resource["status"]["conditions"]
        .as_array()
        .and_then(|all| all.iter().find(|c| c["type"] == type_).cloned())
        .unwrap_or(Value::Null);
    (
        found["status"].as_str().unwrap_or("").to_owned(),
        found["reason"].as_str().unwrap_or("").to_owned(),
        found["message"].as_str().unwrap_or("").to_owned(),
    )
}

/// Deploys `source` on `runtime` as `emitter` (it emits `order.shipped.v1` from `warehouse`
/// with id `ship-7` and data `{"order": 7}`), calls it and waits for the event at a subscribed
/// sink. The call's status and body.
pub async fn check_emit(runtime: &str, source: &str) -> (u16, String) {
    let platform = Platform::start_with(Options::default()).await;
    let sink = Sink::ok().await;
    platform
        .subscribe(
            "emitted",
            json!({"sink": sink.url, "types": ["order.shipped.v1"]}),
        )
        .await;
    platform
        .deploy(
            "emitter",
            json!({"runtime": runtime, "source": {"inline": {"source": source}}}),
        )
        .await;
    let response = platform.invoke("emitter", "/").send().await.unwrap();
    let answer = (response.status().as_u16(), response.text().await.unwrap());
    eprintln!("the emitter answered {answer:?}");
    sink.wait_for(1).await;
    let received = &sink.received()[0];
    assert_eq!(received.header("ce-id"), "ship-7");
    assert_eq!(received.header("ce-type"), "order.shipped.v1");
    assert_eq!(received.header("ce-source"), "warehouse");
    assert_eq!(
        serde_json::from_slice::<Value>(&received.body).unwrap(),
        json!({"order": 7})
    );
    answer
}

/// The value of the sample `series` (a metric's name, with its labels as written when it has
/// any) in Prometheus text.
pub fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in\n{metrics}"))
}

/// What a call answered that a RateLimit decides: its status, `x-ratelimit-limit` and
/// `x-ratelimit-remaining` (empty when absent), its `content-type` and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimited {
    pub status: u16,
    pub limits: (String, String),
    pub content_type: String,
    pub body: String,
}

/// `GET url`, with `X-Rate-Limited: true` when `flagged` (the header of Kyma's RateLimit
/// samples), and what a RateLimit decided of it.
#[allow(dead_code)]
pub async fn rate_limited_get(http: &reqwest::Client, url: String, flagged: bool) -> RateLimited {
    let mut request = http.get(url);
    if flagged {
        request = request.header("X-Rate-Limited", "true");
    }
    let response = request.send().await.unwrap();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let limits = (header("x-ratelimit-limit"), header("x-ratelimit-remaining"));
    let content_type = header("content-type");
    RateLimited {
        status: response.status().as_u16(),
        limits,
        content_type,
        body: response.text().await.unwrap(),
    }
}
