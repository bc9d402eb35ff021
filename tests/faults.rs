//! The fault suite: a steady, numbered stream of events while the event-bus, the dispatcher and
//! nats-server are SIGKILLed and restarted and a function instance is killed mid-request. Every
//! event the bus acknowledged must reach the function; the table printed per fault says
//! published, acked, delivered and duplicates.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::{
    collections::HashMap,
    path::PathBuf,
    process::Stdio,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use eddy_platform::shutdown::CancellationToken;
use eddy_testing::{NatsServer, eventually};
use serde_json::json;

/// A component run as `eddy <args>`, restartable on the same address.
struct Child {
    args: Vec<String>,
    child: Option<tokio::process::Child>,
}

impl Child {
    async fn start(args: Vec<String>, ready: &str) -> Self {
        let mut this = Self { args, child: None };
        this.spawn(ready).await;
        this
    }

    async fn spawn(&mut self, ready: &str) {
        use tokio::io::AsyncBufReadExt as _;
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_eddy"))
            .args(&self.args)
            .env("EDDY_LOG", "error")
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if line.starts_with(ready) {
                    return;
                }
            }
            panic!("{:?} exited before it was ready", self.args);
        })
        .await
        .unwrap();
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        self.child = Some(child);
    }

    async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.start_kill().unwrap();
            child.wait().await.unwrap();
        }
    }
}

const RECORDER: &str = r#"
const fs = require("fs");
module.exports = { main: async (event) => {
  // Record before answering: an event counts as delivered once it is on disk.
  fs.appendFileSync(process.env.RECORD_FILE, event["ce-id"] + "\n");
  await new Promise((resolve) => setTimeout(resolve, 20));
  return "";
} };
"#;

/// Events acknowledged in each phase before the next fault: traffic has resumed.
const FLOWING: u64 = 100;

#[derive(Default, Clone, Copy)]
struct Counts {
    published: u64,
    acked: u64,
    refused: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_acknowledged_event_is_lost_through_crashes() {
    let mut nats = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let record_file: PathBuf = dir.path().join("delivered.txt");
    std::fs::write(&record_file, "").unwrap();

    // Claimed below the ephemeral range: no other process is handed it while the event-bus is
    // down between its SIGKILL and its restart on the same port.
    let bus_claim = eddy_testing::PortClaim::new().unwrap();
    let bus_port = bus_claim.port;
    let bus_url = format!("http://127.0.0.1:{bus_port}");
    let mut bus = Child::start(
        [
            "event-bus",
            "--addr",
            &format!("127.0.0.1:{bus_port}"),
            "--nats-url",
            &nats.url(),
        ]
        .map(String::from)
        .to_vec(),
        "event-bus ready",
    )
    .await;

    // Controller (API, gateway, function instances) in this process.
    let shutdown = CancellationToken::new();
    let api = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api_url = format!("http://{}", api.local_addr().unwrap());
    let gateway = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway_url = format!("http://{}", gateway.local_addr().unwrap());
    let mut controller_args = eddy_controller::Args::new(api.local_addr().unwrap(), nats.url());
    controller_args.local.bus_url = bus_url.clone();
    controller_args.local.data_dir = dir.path().join("data");
    let controller =
        eddy::local::Controller::new(controller_args, gateway_url, shutdown.child_token())
            .await
            .unwrap();
    let backend = controller.backend();
    tokio::spawn(controller.serve(api, gateway));

    let dispatcher_args: Vec<String> = [
        "dispatcher",
        "--addr",
        "127.0.0.1:0",
        "--nats-url",
        &nats.url(),
        "--ack-wait",
        "2s",
    ]
    .map(String::from)
    .to_vec();
    let mut dispatcher = Child::start(dispatcher_args, "dispatcher ready").await;

    let http = reqwest::Client::new();
    let put = |kind: &str, name: &str, body: serde_json::Value| {
        let request = http
            .put(format!(
                "{api_url}/apis/eddy.dev/v1alpha1/namespaces/default/{kind}/{name}"
            ))
            .json(&body);
        async move { assert!(request.send().await.unwrap().status().is_success()) }
    };
    put(
        "functions",
        "recorder",
        json!({"apiVersion": "eddy.dev/v1alpha1", "kind": "Function", "metadata": {"name": "recorder"},
            "spec": {"runtime": "nodejs20", "replicas": 2, "source": {"inline": {"source": RECORDER}},
                "env": [{"name": "RECORD_FILE", "value": record_file.to_str().unwrap()}]}}),
    )
    .await;
    put(
        "subscriptions",
        "faults",
        json!({"apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription", "metadata": {"name": "faults"},
            "spec": {"sink": "http://recorder.default.svc.cluster.local", "types": ["fault.tick.v1"],
                "delivery": {"maxAttempts": 100, "initialDelay": "100ms", "maxDelay": "1s", "timeout": "5s"}}}),
    )
    .await;
    eventually(
        "the subscription and function to be ready",
        Duration::from_secs(60),
        || async {
            let sub: serde_json::Value = http
                .get(format!(
                    "{api_url}/apis/eddy.dev/v1alpha1/namespaces/default/subscriptions/faults"
                ))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            sub["status"]["ready"] == json!(true) && backend.pids("default", "recorder").len() == 2
        },
    )
    .await
    .unwrap();

    // A steady publisher: one event every 10 ms, each retried until the bus acknowledges it.
    let phase = Arc::new(Mutex::new("steady"));
    let counts: Arc<Mutex<HashMap<&'static str, Counts>>> = Arc::default();
    let phase_of: Arc<Mutex<HashMap<String, &'static str>>> = Arc::default();
    let stop = CancellationToken::new();
    let publisher = {
        let (phase, counts, phase_of, stop, bus_url) = (
            phase.clone(),
            counts.clone(),
            phase_of.clone(),
            stop.clone(),
            bus_url.clone(),
        );
        tokio::spawn(async move {
            let http = reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap();
            let mut pace = tokio::time::interval(Duration::from_millis(10));
            let mut n = 0u64;
            while !stop.is_cancelled() {
                pace.tick().await;
                let id = format!("f-{n}");
                n += 1;
                let current = *phase.lock().unwrap();
                phase_of.lock().unwrap().insert(id.clone(), current);
                counts.lock().unwrap().entry(current).or_default().published += 1;
                let deadline = Instant::now() + Duration::from_secs(60);
                loop {
                    let sent = http
                        .post(format!("{bus_url}/publish"))
                        .header("ce-specversion", "1.0")
                        .header("ce-id", &id)
                        .header("ce-source", "faults")
                        .header("ce-type", "fault.tick.v1")
                        .body("{}")
                        .send()
                        .await;
                    match sent {
                        Ok(response) if response.status().as_u16() == 204 => {
                            counts.lock().unwrap().entry(current).or_default().acked += 1;
                            break;
                        }
                        _ => {
                            counts.lock().unwrap().entry(current).or_default().refused += 1;
                            assert!(Instant::now() < deadline, "{id} was never acknowledged");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
            }
        })
    };

    // Each phase lasts until events published in it are acknowledged again after the fault
    // (a polled condition, not a fixed sleep: a publish caught in the crash can hang for the
    // bus's publish timeout before it is refused and retried).
    let traffic_flows = |name: &'static str| {
        let counts = counts.clone();
        async move {
            eventually(
                &format!("{FLOWING} events acknowledged during {name}"),
                Duration::from_secs(60),
                || async {
                    counts
                        .lock()
                        .unwrap()
                        .get(name)
                        .is_some_and(|c| c.acked >= FLOWING)
                },
            )
            .await
            .unwrap();
        }
    };
    traffic_flows("steady").await;

    *phase.lock().unwrap() = "event-bus SIGKILL";
    bus.kill().await;
    bus.spawn("event-bus ready").await;
    traffic_flows("event-bus SIGKILL").await;

    *phase.lock().unwrap() = "dispatcher SIGKILL";
    dispatcher.kill().await;
    dispatcher.spawn("dispatcher ready").await;
    traffic_flows("dispatcher SIGKILL").await;

    *phase.lock().unwrap() = "nats-server SIGKILL";
    nats.kill();
    nats.restart().unwrap();
    traffic_flows("nats-server SIGKILL").await;

    *phase.lock().unwrap() = "instance killed mid-request";
    for pid in backend.pids("default", "recorder") {
        std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .unwrap();
    }
    traffic_flows("instance killed mid-request").await;
    stop.cancel();
    publisher.await.unwrap();

    // Every acknowledged event reaches the function.
    let acked: Vec<String> = phase_of.lock().unwrap().keys().cloned().collect();
    let delivered = || {
        let text = std::fs::read_to_string(&record_file).unwrap();
        let mut seen: HashMap<String, u64> = HashMap::new();
        for line in text.lines() {
            *seen.entry(line.to_owned()).or_default() += 1;
        }
        seen
    };
    let waited = eventually(
        "every acknowledged event to be delivered",
        Duration::from_secs(90),
        || async {
            let seen = delivered();
            acked.iter().all(|id| seen.contains_key(id))
        },
    )
    .await;
    let seen = delivered();
    let missing: Vec<&String> = acked.iter().filter(|id| !seen.contains_key(*id)).collect();

    println!(
        "{:<30} {:>10} {:>8} {:>8} {:>10} {:>11}",
        "fault", "published", "acked", "503/err", "delivered", "duplicates"
    );
    let phase_of = phase_of.lock().unwrap().clone();
    for name in [
        "steady",
        "event-bus SIGKILL",
        "dispatcher SIGKILL",
        "nats-server SIGKILL",
        "instance killed mid-request",
    ] {
        let count = counts
            .lock()
            .unwrap()
            .get(name)
            .copied()
            .unwrap_or_default();
        let ids: Vec<&String> = phase_of
            .iter()
            .filter(|(_, p)| **p == name)
            .map(|(id, _)| id)
            .collect();
        let delivered = ids.iter().filter(|id| seen.contains_key(**id)).count();
        let duplicates: u64 = ids
            .iter()
            .map(|id| seen.get(*id).copied().unwrap_or(0).saturating_sub(1))
            .sum();
        println!(
            "{name:<30} {:>10} {:>8} {:>8} {delivered:>10} {duplicates:>11}",
            count.published, count.acked, count.refused
        );
    }
    assert!(
        waited.is_ok() && missing.is_empty(),
        "acknowledged events lost: {} ({:?}...)",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    // Duplicates are bounded, not just printed. Three faults interrupt deliveries (the dispatcher,
    // nats-server, an instance); each can redeliver only what was unacknowledged at that moment,
    // which JetStream caps at maxInFlightMessages (10, the default). No event lives through two
    // of them, so none may arrive more than twice.
    let twice_or_more: Vec<(&String, &u64)> = seen.iter().filter(|(_, n)| **n > 2).collect();
    assert!(
        twice_or_more.is_empty(),
        "events delivered more than twice: {twice_or_more:?}"
    );
    let duplicates: u64 = seen.values().map(|n| n.saturating_sub(1)).sum();
    let bound = 3 * u64::from(eddy_model::resources::DEFAULT_MAX_IN_FLIGHT);
    assert!(
        duplicates <= bound,
        "{duplicates} duplicates, more than the {bound} that three interrupted windows of \
         maxInFlightMessages allow"
    );
    shutdown.cancel();
}

/// One sample of the event-bus's `eddy_bus_events_total` (0 when not there yet).
async fn bus_events(http: &reqwest::Client, bus_url: &str, mode: &str, outcome: &str) -> f64 {
    let metrics = http
        .get(format!("{bus_url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    metrics
        .lines()
        .filter(|line| line.starts_with("eddy_bus_events_total{"))
        .filter(|line| {
            line.contains(&format!("mode=\"{mode}\""))
                && line.contains(&format!("outcome=\"{outcome}\""))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Sends SIGSTOP or SIGCONT to a process: a hung server, then one going on.
fn signal(pid: u32, which: nix::sys::signal::Signal) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
        which,
    )
    .unwrap_or_else(|error| panic!("{which} to {pid}: {error}"));
}

/// Each way the event-bus refuses to store an event is counted under its own outcome in
/// `eddy_bus_events_total`, as docs/operations.md tells operators to watch: a full store
/// (`stream_refused`), an ack that does not come from a hung NATS (`nats_unavailable`), a batch
/// past `--request-timeout` (`timed_out`), and NATS gone (`nats_unavailable` again). Each
/// refused publish is a 503, and each is counted exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_refused_publish_is_counted_under_its_outcome() {
    let mut nats = NatsServer::start().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut args = eddy_event_bus::Args::new(addr, nats.url());
    args.stream.max_bytes = bytesize::ByteSize::kib(16);
    args.publish_timeout = Duration::from_millis(1500);
    args.request_timeout = Duration::from_millis(500);
    let shutdown = CancellationToken::new();
    let bus = eddy_event_bus::EventBus::new(args, shutdown.child_token())
        .await
        .unwrap();
    tokio::spawn(bus.serve(listener));
    let bus_url = format!("http://{addr}");
    let http = reqwest::Client::new();
    let ready = |expected: u16| {
        let (http, url) = (http.clone(), format!("{bus_url}/readyz"));
        async move { matches!(http.get(&url).send().await, Ok(r) if r.status() == expected) }
    };
    eventually("the event-bus ready", Duration::from_secs(20), || {
        ready(200)
    })
    .await
    .unwrap();
    let publish = |id: String| {
        http.post(format!("{bus_url}/publish"))
            .header("ce-specversion", "1.0")
            .header("ce-type", "order.created.v1")
            .header("ce-source", "shop")
            .header("ce-id", id)
            .header("content-type", "application/json")
            .body(format!("{{\"pad\": \"{}\"}}", "x".repeat(2048)))
            .send()
    };

    // NATS hangs (first, while the store has room and nothing was refused): a single event's
    // ack never comes (nats_unavailable), and a batch runs past the request deadline
    // (timed_out).
    let pid = nats.pid().unwrap();
    signal(pid, nix::sys::signal::Signal::SIGSTOP);
    // Stopped before anything is sent to it (state `T` in /proc).
    eventually("nats-server stopped", Duration::from_secs(5), || async {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            stat.rsplit(')')
                .next()
                .is_some_and(|rest| rest.trim_start().starts_with('T'))
        })
    })
    .await
    .unwrap();
    let hung = publish("hung".to_owned()).await.unwrap();
    assert_eq!(hung.status(), 503);
    let said = hung.text().await.unwrap();
    assert!(said.contains("NATS is unavailable"), "{said}");
    let batch = http
        .post(format!("{bus_url}/publish"))
        .header("content-type", "application/cloudevents-batch+json")
        .body(
            json!([{"specversion": "1.0", "type": "order.created.v1", "source": "shop",
                    "id": "batch-1", "data": {}}])
            .to_string(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(batch.status(), 503);
    let said = batch.text().await.unwrap();
    assert!(said.contains("not finished within"), "{said}");
    signal(pid, nix::sys::signal::Signal::SIGCONT);
    assert_eq!(
        bus_events(&http, &bus_url, "binary", "nats_unavailable").await,
        1.0
    );
    assert_eq!(bus_events(&http, &bus_url, "batch", "timed_out").await, 1.0);
    // NATS goes on: the next publish is stored.
    let resumed = publish("resumed".to_owned()).await.unwrap();
    assert_eq!(resumed.status(), 204);

    // The store fills up: the first refusal is a 503 counted as stream_refused.
    let mut stored = 0;
    let refusal = loop {
        let answer = publish(format!("fill-{stored}")).await.unwrap();
        if answer.status() != 204 && answer.status() != 200 && answer.status() != 201 {
            break answer;
        }
        stored += 1;
        assert!(stored < 100, "a 16 KiB store took 100 events of 2 KiB");
    };
    assert_eq!(refusal.status(), 503);
    let said = refusal.text().await.unwrap();
    assert!(said.contains("refused"), "{said}");
    assert_eq!(
        bus_events(&http, &bus_url, "binary", "stream_refused").await,
        1.0
    );
    assert_eq!(
        bus_events(&http, &bus_url, "binary", "stored").await,
        f64::from(stored) + 1.0,
        "the fill and the one stored after NATS went on"
    );

    // NATS gone: refused at once, counted as nats_unavailable.
    nats.kill();
    eventually(
        "the event-bus to see NATS gone",
        Duration::from_secs(20),
        || ready(503),
    )
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let gone = publish("gone".to_owned()).await.unwrap();
    assert_eq!(gone.status(), 503);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "refused at once"
    );
    assert_eq!(
        bus_events(&http, &bus_url, "binary", "nats_unavailable").await,
        2.0
    );
    shutdown.cancel();
}
