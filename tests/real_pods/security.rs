//! The attack probe's cluster findings, replayed in real pods: the chart's NATS takes no client
//! without its password (a Function's pod, a bare pod in another namespace), and the
//! dispatcher's admin API (dead letters, redrive, replay) answers only its token, and in the
//! mesh only the workloads the chart names.

use std::io::{BufRead as _, BufReader};

use super::*;
use crate::mesh::{client_pod, post_from_pod};

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

/// Runs `script` with python3 inside `pod`; its output, trimmed.
fn python_in_pod(plane: &ControlPlane, namespace: &str, pod: &str, script: &str) -> Result<String> {
    let output = run(plane
        .kubectl()?
        .args([
            "exec", "-n", namespace, pod, "-c", pod, "--", "python3", "-c",
        ])
        .arg(script))?;
    Ok(output.trim().to_owned())
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
/// from a pod in a Function namespace with a sidecar (as a Function's own pod) and from a bare
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
    let outside = namespace(plane, "nats-probe")?;
    let function_like = client_pod(plane, MESH_FUNCTIONS, true)?;
    let bare = client_pod(plane, &outside, false)?;
    for (namespace, pod) in [(MESH_FUNCTIONS, &function_like), (&*outside, &bare)] {
        for (what, credentials) in [
            ("no password", None),
            ("a guessed password", Some(("eddy-admin", "eddy-admin"))),
            (
                "the event-bus's user, no password",
                Some(("eddy-event-bus", "")),
            ),
        ] {
            let answer = python_in_pod(
                plane,
                namespace,
                pod,
                &nats_probe(&client, 4222, credentials),
            )?;
            ensure!(
                answer.contains("Authorization Violation"),
                "{namespace}/{pod} with {what}: {answer}"
            );
        }
        let answer = python_in_pod(plane, namespace, pod, &nats_probe(&route, 6222, None))?;
        ensure!(
            answer != "PONG" && !answer.starts_with("refused:"),
            "{namespace}/{pod} on the route port without its password: {answer}"
        );
        let answer = python_in_pod(
            plane,
            namespace,
            pod,
            &nats_probe(&client, 4222, Some(("eddy-admin", &admin))),
        )?;
        ensure!(
            answer == "PONG",
            "{namespace}/{pod} with the admin password: {answer}"
        );
    }
    run(plane.kubectl()?.args([
        "delete",
        "pod",
        &function_like,
        "-n",
        MESH_FUNCTIONS,
        "--wait=false",
    ]))?;
    delete_namespace(plane, &outside)?;
    Ok(())
}

/// `kubectl port-forward` to a Deployment's port, stopped when dropped: the operator's way to
/// the dispatcher's admin API.
struct PortForward {
    child: std::process::Child,
    /// `http://127.0.0.1:<port>`.
    url: String,
}

impl PortForward {
    fn start(plane: &ControlPlane, target: &str, port: u16) -> Result<Self> {
        let mut child = plane
            .kubectl()?
            .args(["port-forward", "-n", SYSTEM, target, &format!(":{port}")])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        let stdout = child.stdout.take().context("port-forward's output")?;
        // "Forwarding from 127.0.0.1:40123 -> 8083"
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let local = line
            .split_whitespace()
            .nth(2)
            .filter(|address| address.starts_with("127.0.0.1:"))
            .with_context(|| format!("port-forward said {line:?}"))?;
        Ok(Self {
            url: format!("http://{local}"),
            child,
        })
    }
}

impl Drop for PortForward {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The probe's second finding: a tenant's unauthenticated `POST /subscriptions/<ns>/<sub>/replay`
/// to the dispatcher re-ran another tenant's side effects. Now, in the mesh, a meshed pod of
/// another namespace gets Istio's 403 and a caller without a sidecar (the host, through the
/// Service) too; and through `kubectl port-forward`, around the mesh, the API asks for the
/// chart's token (401 naming it), and answers with it.
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

    let token = secret_value(plane, &format!("{RELEASE}-dispatcher-admin"), "token")?;
    let forward = PortForward::start(plane, &format!("deployment/{RELEASE}-dispatcher"), 8083)?;
    for headers in [vec![], vec!["authorization: Bearer guessed".to_owned()]] {
        let (status, body) = curl_as(
            Some("POST"),
            &format!("{}/subscriptions/other-tenant/orders/replay", forward.url),
            &headers,
            Some("{}"),
        )?;
        ensure!(
            status == 401 && body.contains("bearer token"),
            "the admin API without its token ({headers:?}): {status} {body}"
        );
    }
    let (status, body) = curl(
        &format!("{}/dead-letters", forward.url),
        &[format!("authorization: Bearer {token}")],
        None,
    )?;
    ensure!(
        status == 200,
        "the admin API with its token: {status} {body}"
    );
    drop(forward);
    delete_namespace(plane, &tenant)?;
    Ok(())
}
