//! The attack probe's cluster findings, replayed in real pods: the chart's NATS takes no client
//! without its password (a Function's pod, a bare pod in another namespace); the dispatcher's
//! admin API (dead letters, redrive, replay) answers only its token, and in the mesh only the
//! workloads the chart names; the gateway holds a bounded number of bytes for a Function that
//! never starts.

use std::time::Instant;

use super::*;
use crate::mesh::{client_pod, post_from_pod, python_in_pod, request_from_pod};

/// A Python script that speaks NATS's client protocol to `host:port`: it reads the server's
/// `INFO`, sends `CONNECT` (with the user and password given, or none), a publish to the events'
/// subjects, a subscription to everything and a `PING`, and prints the server's first answer
/// (`PONG` when all of it was taken), or `refused: …` when no answer came.
fn nats_probe(host: &str, port: u16, credentials: Option<(&str, &str)>) -> String {
    let credentials = match credentials {
        Some((user, password)) => format!(r#", "user": {user:?}, "pass": {password:?}"#),
        None => String::new(),
    };
    format!(
        r#"
import json, socket
try:
    s = socket.create_connection(({host:?}, {port}), timeout=10)
    f = s.makefile("rb")
    f.readline()
    connect = json.loads('{{"verbose": false, "pedantic": false, "protocol": 1, "name": "probe"{credentials}}}')
    s.sendall(("CONNECT " + json.dumps(connect) + "\r\nPUB eddy.events.probe 2\r\nhi\r\nSUB > 1\r\nPING\r\n").encode())
    print(f.readline().decode().strip() or "closed")
except Exception as error:
    print("refused:", repr(error))
"#
    )
}

/// The key `key` of Secret `name` in eddy's namespace, decoded.
fn secret_value(plane: &ControlPlane, name: &str, key: &str) -> Result<String> {
    let value = run(plane.kubectl()?.args([
        "get",
        "secret",
        name,
        "-n",
        SYSTEM,
        "-o",
        &format!("go-template={{{{index .data {key:?} | base64decode}}}}"),
    ]))?;
    ensure!(!value.is_empty(), "Secret {name} has no {key}");
    Ok(value)
}

/// The probe's first finding: an anonymous client created `EDDY_EVENTS`, published a forged
/// event and deleted the stream from any pod. Now the chart's NATS takes only eddy's users:
/// from a Function's own pod (in the mesh, in one of the chart's Function namespaces) and from a bare
/// pod in another namespace, a client without a password, or with a guessed one, is refused
/// before it can publish, subscribe or call JetStream's API; the cluster's route port refuses a
/// route without the route user's password. The admin password from the chart's Secret gets
/// the same probe in (so the refusals are the password's doing, not the network's), and the
/// event path with the components' own users is every other test of this suite.
#[tokio::test]
async fn the_chart_s_nats_takes_no_client_without_its_password() -> Result<()> {
    let plane = installed()?;
    let admin = secret_value(plane, "eddy-nats-auth", "admin")?;
    let client = format!("{RELEASE}-nats.{SYSTEM}.svc.cluster.local");
    let route = format!("{RELEASE}-nats-0.{RELEASE}-nats-headless.{SYSTEM}.svc.cluster.local");
    // A Function of the mesh's Function namespace (python312: the probe is Python), and a bare
    // pod of another namespace.
    let function = format!(
        "nats-probe-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..6]
    );
    apply(
        plane,
        MESH_FUNCTIONS,
        &format!(
            r#"
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {{name: {function}}}
spec:
  runtime: python312
  resourceConfiguration: {{function: {{profile: XS}}}}
  source:
    inline:
      source: |
        def main(event, context):
            return "ok"
"#
        ),
    )?;
    running(plane, MESH_FUNCTIONS, &function, Duration::from_secs(120)).await?;
    let pod = function_pod(plane, MESH_FUNCTIONS, &function)?;
    let function_pod = name_of(&pod)?;
    let function_container = pod["spec"]["containers"][0]["name"]
        .as_str()
        .context("the Function's container")?
        .to_owned();
    let outside = namespace(plane, "nats-probe")?;
    let bare = client_pod(plane, &outside, false)?;
    for (namespace, pod, container) in [
        (MESH_FUNCTIONS, &function_pod, &function_container),
        (&*outside, &bare, &bare),
    ] {
        let probe = |host: &str, port: u16, credentials: Option<(&str, &str)>| {
            python_in_pod(
                plane,
                namespace,
                pod,
                container,
                &nats_probe(host, port, credentials),
            )
        };
        for (what, credentials) in [
            ("no password", None),
            ("a guessed password", Some(("eddy-admin", "eddy-admin"))),
            (
                "the event-bus's user, no password",
                Some(("eddy-event-bus", "")),
            ),
        ] {
            let answer = probe(&client, 4222, credentials)?;
            ensure!(
                answer.contains("Authorization Violation"),
                "{namespace}/{pod} with {what}: {answer}"
            );
        }
        let answer = probe(&route, 6222, None)?;
        ensure!(
            answer != "PONG" && !answer.starts_with("refused:"),
            "{namespace}/{pod} on the route port without its password: {answer}"
        );
        let answer = probe(&client, 4222, Some(("eddy-admin", &admin)))?;
        ensure!(
            answer == "PONG",
            "{namespace}/{pod} with the admin password: {answer}"
        );
    }
    run(plane
        .kubectl()?
        .args(["delete", "-n", MESH_FUNCTIONS, "--wait=false"])
        .arg(format!("function.eddy.dev/{function}")))?;
    delete_namespace(plane, &outside)?;
    Ok(())
}

/// The probe's second finding: a tenant's unauthenticated `POST /subscriptions/<ns>/<sub>/replay`
/// to the dispatcher re-ran another tenant's side effects. Now, in the mesh, a meshed pod of
/// another namespace gets Istio's 403 and a caller without a sidecar (the host, through the
/// Service) too. With the mesh path opened to that namespace (the policy
/// `dispatcher.admin.allowedNamespaces` renders, added here beside the chart's), the API
/// itself asks for the chart's token: 401 naming it without one or with a guessed one, the
/// answer with it.
#[tokio::test]
async fn the_dispatcher_s_admin_api_answers_only_its_token_and_the_workloads_named() -> Result<()> {
    let plane = installed()?;
    let tenant = namespace(plane, "admin-probe")?;
    let meshed = client_pod(plane, &tenant, true)?;
    let service = format!("http://{RELEASE}-dispatcher.{SYSTEM}.svc.cluster.local");
    for path in [
        "/subscriptions/other-tenant/orders/replay",
        "/subscriptions/other-tenant/orders/redrive",
    ] {
        let answer = post_from_pod(plane, &tenant, &meshed, &format!("{service}{path}"))?;
        ensure!(
            answer == "403 RBAC: access denied",
            "a meshed pod of another namespace, {path}: {answer}"
        );
    }
    let cluster_ip = service_url(plane, SYSTEM, &format!("{RELEASE}-dispatcher"))?;
    let (status, body) = curl_as(
        Some("POST"),
        &format!("{cluster_ip}/subscriptions/other-tenant/orders/replay"),
        &[],
        Some("{}"),
    )?;
    ensure!(
        status == 403 && body.contains("RBAC"),
        "a caller without a sidecar: {status} {body}"
    );

    let opened = format!("test-admin-from-{tenant}");
    run_with_input(
        plane.kubectl()?.args(["apply", "-f", "-"]),
        &serde_json::json!({
            "apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
            "metadata": {"name": opened, "namespace": SYSTEM},
            "spec": {
                "selector": {"matchLabels": {
                    "app.kubernetes.io/instance": RELEASE,
                    "app.kubernetes.io/component": "dispatcher",
                }},
                "action": "ALLOW",
                "rules": [{"from": [{"source": {"namespaces": [&*tenant]}}]}],
            },
        })
        .to_string(),
    )?;
    let token = secret_value(plane, &format!("{RELEASE}-dispatcher-admin"), "token")?;
    let replay = format!("{service}/subscriptions/other-tenant/orders/replay");
    let mut answer = String::new();
    let asked = eventually(
        "the opened mesh path reaching the API",
        Duration::from_secs(60),
        || {
            answer = request_from_pod(plane, &tenant, &meshed, "POST", &replay, None)
                .unwrap_or_default();
            let reached = answer.starts_with("401");
            async move { reached }
        },
    )
    .await;
    asked.with_context(|| format!("the last answer: {answer}"))?;
    ensure!(
        answer.contains("bearer token"),
        "without the token: {answer}"
    );
    let answer = request_from_pod(plane, &tenant, &meshed, "POST", &replay, Some("guessed"))?;
    ensure!(answer.starts_with("401"), "with a guessed token: {answer}");
    let answer = request_from_pod(
        plane,
        &tenant,
        &meshed,
        "GET",
        &format!("{service}/dead-letters"),
        Some(&token),
    )?;
    ensure!(answer.starts_with("200"), "with the token: {answer}");
    run(plane
        .kubectl()?
        .args(["delete", "authorizationpolicy", &opened, "-n", SYSTEM]))?;
    delete_namespace(plane, &tenant)?;
    Ok(())
}

/// A Node.js handler whose module never finishes loading (it blocks its only thread, without
/// burning it): its pod never becomes ready.
const NEVER_READY: &str = "Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 3600e3);\nmodule.exports = { main: () => 'never' };";

/// The probe's fourth finding in the chart's gateway (a 128 MiB limit; 32 MiB of held bodies,
/// a quarter of it per Function): two hundred 2 MiB calls at once to a Function that scales to
/// zero and whose pod never becomes ready. Held whole, as before, they are 400 MiB: the
/// gateway's container is killed. Now each body is charged to the hold budget as it arrives:
/// four are held and the others are answered 503 with `Retry-After` at once, naming the bound;
/// the gateway's container is never restarted, and it still answers.
#[tokio::test]
async fn the_gateway_pod_holds_a_bounded_number_of_bytes_for_a_function_that_never_starts()
-> Result<()> {
    let plane = installed()?;
    let tenant = namespace(plane, "held")?;
    let source = NEVER_READY.replace('\n', "\n        ");
    apply(
        plane,
        &tenant,
        &format!(
            r#"
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {{name: stuck}}
spec:
  runtime: nodejs22
  resourceConfiguration: {{function: {{profile: XS}}}}
  scaleConfig: {{minReplicas: 0, maxReplicas: 1}}
  source:
    inline:
      source: |
        {source}
"#
        ),
    )?;
    // Reconciled, with no ready pod (nor ever will it have one): the gateway takes it for
    // asleep, and charges each call's body to the hold budget as it arrives.
    wait_for_function(
        plane,
        "functions.eddy.dev",
        &tenant,
        "stuck",
        Duration::from_secs(120),
        |function| {
            condition(function, "ConfigurationReady").is_some_and(|(s, _, _)| s == "True")
                && function["status"]["replicas"].as_i64().unwrap_or(0) == 0
        },
    )
    .await?;
    let restarts = |pods: &Value| -> i64 {
        pods["items"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|pod| {
                pod["status"]["containerStatuses"]
                    .as_array()
                    .into_iter()
                    .flatten()
            })
            .filter_map(|container| container["restartCount"].as_i64())
            .sum()
    };
    let gateway_pods = || {
        kubectl_json(
            plane,
            &[
                "get",
                "pods",
                "-n",
                SYSTEM,
                "-l",
                "app.kubernetes.io/component=gateway",
            ],
        )
    };
    let restarts_before = restarts(&gateway_pods()?);
    let url = format!(
        "{}/{tenant}/stuck/",
        service_url(plane, SYSTEM, &format!("{RELEASE}-gateway"))?
    );
    let client = reqwest::Client::new();
    let body = bytes::Bytes::from(vec![b'x'; 2 * 1024 * 1024]);
    let started = Instant::now();
    let (answers, mut answered) = tokio::sync::mpsc::unbounded_channel();
    let calls: Vec<_> = (0..200)
        .map(|_| {
            let call = client.post(&url).body(body.clone());
            let answers = answers.clone();
            tokio::spawn(async move {
                let answer = match call.send().await {
                    Ok(response) => {
                        let retry_after = response.headers().contains_key("retry-after");
                        let status = response.status().as_u16();
                        (
                            status,
                            retry_after,
                            response.text().await.unwrap_or_default(),
                        )
                    }
                    Err(error) => (0, false, error.to_string()),
                };
                let _ = answers.send(answer);
            })
        })
        .collect();
    // Every answer within 30 s, by what it was. Besides the budget's refusals, the gateway's
    // sidecar answers some of a 200-connection burst with its own 503 ("reset before
    // headers": a pooled connection the gateway had closed as idle, or a connection to it
    // that failed; 0 to 93 of 200 in our runs): that is the mesh's connection, not the
    // budget, and it is counted apart. Some (at least 20) must be the budget's; anything else
    // fails the test. (With the hole open, none is the budget's and the container is killed.)
    let mut tally: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    let (mut refused, mut stale, mut other) = (0, 0, 0);
    while let Ok(Some((status, retry_after, text))) =
        tokio::time::timeout(Duration::from_secs(30), answered.recv()).await
    {
        if status == 503 && retry_after && text.contains("held-share-per-function") {
            refused += 1;
        } else if status == 503 && text.contains("reset before headers") {
            stale += 1;
        } else {
            other += 1;
        }
        let text: String = text.chars().take(80).collect();
        *tally
            .entry(format!("{status} retry-after={retry_after} {text}"))
            .or_default() += 1;
        if refused + stale >= 196 {
            break;
        }
    }
    let took = started.elapsed();
    for call in calls {
        call.abort();
    }
    let pods = gateway_pods()?;
    ensure!(
        refused >= 20 && refused + stale >= 196 && other == 0 && restarts(&pods) == restarts_before,
        "{refused} of 200 calls refused by the hold budget in {took:?}: {tally:#?}; the \
         gateway's containers: {}",
        pods["items"][0]["status"]["containerStatuses"]
    );
    eprintln!(
        "{refused} of 200 calls of 2 MiB refused in {:.1} s: {tally:?}",
        took.as_secs_f64()
    );
    // And it answers again (in the runs so far its sidecar could not reach it for a moment
    // after such a burst).
    let readyz = format!(
        "{}/readyz",
        service_url(plane, SYSTEM, &format!("{RELEASE}-gateway"))?
    );
    let mut last = (0, String::new());
    let answered_again = eventually(
        "the gateway answering after the burst",
        Duration::from_secs(60),
        || {
            last = curl(&readyz, &[], None).unwrap_or_default();
            let ready = last.0 == 200;
            async move { ready }
        },
    )
    .await;
    answered_again.with_context(|| format!("the gateway after the burst: {last:?}"))?;
    eprintln!(
        "the gateway answered again {:.1} s after the burst began",
        started.elapsed().as_secs_f64()
    );
    // Its blocked thread never runs the runtime's SIGTERM handler: without force, the pod
    // would take its whole grace period to go. Forced only once the namespace is terminating:
    // before, its ReplicaSet replaced a pod forced away with one deleted gracefully.
    delete_namespace_forcing_its_pods(plane, &tenant)?;
    Ok(())
}
