//! eddy on a real node: the control plane of `scripts/kube up --node real` (a kubelet with
//! containerd and runc, kube-proxy, a CNI bridge, CoreDNS), every image built here by
//! `scripts/images`, and the chart installed once per test run with
//! `charts/eddy/ci/real-node-values.yaml`. What runs inside the pods is proven here: the
//! chart's containers, the buildless `install` init container with real npm and pip installs
//! (through the node's forward proxy, the pods' one way out), the runtimes' images, the event's
//! path through pods, and the hardened security contexts.
//!
//! Needs root (the node). A node that cannot start fails these tests with its reason.

use std::{fs::File, process::Command, time::Duration};

use anyhow::{Context as _, Result, bail, ensure};
use eddy_testing::{
    control_plane::{ControlPlane, repo, run, run_with_input},
    eventually,
};
use serde_json::Value;

const RELEASE: &str = "eddy";
const SYSTEM: &str = "eddy-system";

/// The real node, with the chart installed (once per test run: each test is a process of its
/// own under nextest, so the install happens under a file lock).
fn installed() -> Result<&'static ControlPlane> {
    let plane = ControlPlane::real_node()?;
    let lock = File::create(plane.dir().join("release.lock"))?;
    lock.lock()?;
    let status = plane
        .helm()?
        .args(["status", RELEASE, "-n", SYSTEM])
        .output()?;
    if !status.status.success() {
        let started = std::time::Instant::now();
        let proxy = plane.egress_proxy()?;
        run(plane.helm()?.args(["install", RELEASE]).arg(repo().join("charts/eddy")).args([
            "-n",
            SYSTEM,
            "--create-namespace",
            "-f",
        ])
        .arg(repo().join("charts/eddy/ci/real-node-values.yaml"))
        .args([
            "--set",
            &format!("controller.egress.proxy={proxy}"),
            "--wait",
            "--timeout",
            "4m",
        ]))
        .context("helm install of the chart on the real node")?;
        eprintln!(
            "chart installed and Ready on the real node in {:.1} s",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(plane)
}

fn kubectl_json(plane: &ControlPlane, args: &[&str]) -> Result<Value> {
    let text = run(plane.kubectl()?.args(args).args(["-o", "json"]))?;
    Ok(serde_json::from_str(&text)?)
}

/// A namespace of its own for one test (deleted at the end, pods and all).
fn namespace(plane: &ControlPlane, prefix: &str) -> Result<String> {
    let name = format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..6]);
    run(plane.kubectl()?.args(["create", "namespace", &name]))?;
    Ok(name)
}

fn apply(plane: &ControlPlane, namespace: &str, manifest: &str) -> Result<()> {
    run_with_input(
        plane.kubectl()?.args(["apply", "-n", namespace, "-f", "-"]),
        manifest,
    )?;
    Ok(())
}

/// The Function's condition `kind`, as (status, reason, message).
fn condition(function: &Value, kind: &str) -> Option<(String, String, String)> {
    function["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|condition| condition["type"] == kind)
        .map(|condition| {
            let text = |key: &str| condition[key].as_str().unwrap_or_default().to_owned();
            (text("status"), text("reason"), text("message"))
        })
}

/// Waits until the Function is Running (its Deployment available), or fails with its status.
async fn running(plane: &ControlPlane, namespace: &str, name: &str, within: Duration) -> Result<()> {
    let mut last = Value::Null;
    let ready = eventually(&format!("Function {namespace}/{name} Running"), within, || {
        let result = kubectl_json(plane, &["get", "functions.eddy.dev", name, "-n", namespace]);
        if let Ok(function) = &result {
            last = function.clone();
        }
        let ok = result.is_ok_and(|function| {
            condition(&function, "Running").is_some_and(|(status, _, _)| status == "True")
        });
        async move { ok }
    })
    .await;
    ready.with_context(|| format!("its status: {}", last["status"]))
}

/// `curl` from the host to a Service's ClusterIP (kube-proxy serves it on the host too).
fn call(plane: &ControlPlane, namespace: &str, service: &str, path: &str, body: Option<&str>) -> Result<(u16, String)> {
    let service = kubectl_json(plane, &["get", "service", service, "-n", namespace])?;
    let ip = service["spec"]["clusterIP"].as_str().context("the Service's ClusterIP")?;
    let port = service["spec"]["ports"][0]["port"].as_u64().context("the Service's port")?;
    let mut curl = Command::new("curl");
    curl.args(["-s", "-m", "20", "-w", "\n%{http_code}"]);
    if let Some(body) = body {
        curl.args(["-H", "content-type: application/json", "--data-binary", body]);
    }
    let output = run(curl.arg(format!("http://{ip}:{port}{path}")))?;
    let (text, code) = output.rsplit_once('\n').context("curl's status line")?;
    Ok((code.trim().parse()?, text.to_owned()))
}

/// The chart's every Deployment Available and its NATS Ready, each container running without
/// a restart: eddy's own image, the NATS image and the hardened security contexts run for real.
#[tokio::test]
async fn the_chart_runs_on_a_real_node_with_every_container_up() -> Result<()> {
    let plane = installed()?;
    let deployments = kubectl_json(plane, &["get", "deployments", "-n", SYSTEM])?;
    let names: Vec<&str> = deployments["items"]
        .as_array()
        .context("deployments")?
        .iter()
        .filter_map(|item| item["metadata"]["name"].as_str())
        .collect();
    for wanted in ["eddy-controller", "eddy-event-bus", "eddy-dispatcher", "eddy-gateway"] {
        ensure!(names.contains(&wanted), "no Deployment {wanted} in {names:?}");
    }
    for deployment in deployments["items"].as_array().context("deployments")? {
        let available = deployment["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|condition| condition["type"] == "Available" && condition["status"] == "True");
        ensure!(
            available,
            "Deployment {} is not Available: {}",
            deployment["metadata"]["name"],
            deployment["status"]
        );
    }
    let nats = kubectl_json(plane, &["get", "statefulset", "eddy-nats", "-n", SYSTEM])?;
    ensure!(nats["status"]["readyReplicas"] == 1, "NATS not Ready: {}", nats["status"]);
    let pods = kubectl_json(plane, &["get", "pods", "-n", SYSTEM])?;
    for pod in pods["items"].as_array().context("pods")? {
        for container in pod["status"]["containerStatuses"].as_array().context("container statuses")? {
            ensure!(
                container["ready"] == true && container["restartCount"] == 0,
                "pod {} container {}: ready {} after {} restarts ({})",
                pod["metadata"]["name"],
                container["name"],
                container["ready"],
                container["restartCount"],
                container["lastState"]
            );
            ensure!(
                container["state"]["running"].is_object(),
                "container {} of {} is not running: {}",
                container["name"],
                pod["metadata"]["name"],
                container["state"]
            );
        }
    }
    Ok(())
}

/// Buildless Functions with a dependency, installed by npm and pip in the `install` init
/// container through the node's proxy, each answering through its Service with what only the
/// dependency could compute.
#[tokio::test]
async fn buildless_functions_install_their_dependencies_and_answer_through_their_services() -> Result<()> {
    let plane = installed()?;
    let namespace = namespace(plane, "buildless")?;
    apply(
        plane,
        &namespace,
        r#"
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {name: chunker}
spec:
  runtime: nodejs22
  source:
    inline:
      source: |
        const _ = require("lodash");
        module.exports = { main: (event) => JSON.stringify(_.chunk([1, 2, 3, 4, 5], 2)) };
      dependencies: '{"dependencies": {"lodash": "4.17.21"}}'
---
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {name: semver}
spec:
  runtime: python312
  source:
    inline:
      source: |
        from packaging.version import Version
        def main(event, context):
            return str(Version("1.10.0") > Version("1.9.9")) + " " + str(Version("2.0.0rc1").is_prerelease)
      dependencies: packaging==24.1
"#,
    )?;
    running(plane, &namespace, "chunker", Duration::from_secs(180)).await?;
    running(plane, &namespace, "semver", Duration::from_secs(180)).await?;
    let (status, body) = call(plane, &namespace, "chunker", "/", None)?;
    ensure!(status == 200 && body == "[[1,2],[3,4],[5]]", "chunker answered {status}: {body}");
    let (status, body) = call(plane, &namespace, "semver", "/", None)?;
    ensure!(status == 200 && body == "True True", "semver answered {status}: {body}");
    run(plane.kubectl()?.args(["delete", "namespace", &namespace, "--wait=false"]))?;
    Ok(())
}

/// A dependency that does not exist: the Function's status carries npm's own error within two
/// minutes (the install container's termination message), not a progress deadline later.
#[tokio::test]
async fn a_failed_dependency_install_shows_its_own_error_in_the_status() -> Result<()> {
    let plane = installed()?;
    let namespace = namespace(plane, "badinstall")?;
    apply(
        plane,
        &namespace,
        r#"
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {name: broken}
spec:
  runtime: nodejs22
  source:
    inline:
      source: "module.exports = { main: () => 'never' };"
      dependencies: '{"dependencies": {"eddy-no-such-package-8f3a1c": "1.0.0"}}'
"#,
    )?;
    let mut seen = Value::Null;
    let failed = eventually(
        "the Function's status to say the install failed",
        Duration::from_secs(120),
        || {
            let function = kubectl_json(plane, &["get", "functions.eddy.dev", "broken", "-n", &namespace]);
            if let Ok(function) = &function {
                seen = function["status"].clone();
            }
            let failed = function.is_ok_and(|function| {
                ["BuildReady", "Running"].iter().any(|kind| {
                    condition(&function, kind).is_some_and(|(status, reason, message)| {
                        status == "False"
                            && reason == "DependencyInstallFailed"
                            && message.contains("eddy-no-such-package-8f3a1c")
                    })
                })
            });
            async move { failed }
        },
    )
    .await;
    failed.with_context(|| format!("the status: {seen}"))?;
    run(plane.kubectl()?.args(["delete", "namespace", &namespace, "--wait=false"]))?;
    Ok(())
}

/// Function pods run as they are rendered: non-root, and their root filesystem read-only
/// (a write to / from inside the running container is refused).
#[tokio::test]
async fn function_pods_hold_their_security_context_inside_the_container() -> Result<()> {
    let plane = installed()?;
    let namespace = namespace(plane, "hardened")?;
    apply(
        plane,
        &namespace,
        r#"
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {name: plain}
spec:
  runtime: python312
  source:
    inline:
      source: |
        def main(event, context):
            return "ok"
"#,
    )?;
    running(plane, &namespace, "plain", Duration::from_secs(120)).await?;
    let pods = kubectl_json(plane, &["get", "pods", "-n", &namespace, "-l", "eddy.dev/function=plain"])?;
    let pod = pods["items"][0]["metadata"]["name"].as_str().context("the function's pod")?.to_owned();
    let id = run(plane.kubectl()?.args(["exec", "-n", &namespace, &pod, "--", "id", "-u"]))?;
    ensure!(id.trim() != "0", "the function runs as root");
    let write = plane
        .kubectl()?
        .args(["exec", "-n", &namespace, &pod, "--", "sh", "-c", "echo x > /pwned"])
        .output()?;
    ensure!(!write.status.success(), "a write to / succeeded inside the function's container");
    let said = String::from_utf8_lossy(&write.stderr);
    ensure!(said.contains("Read-only file system"), "the write failed for another reason: {said}");
    run(plane.kubectl()?.args(["delete", "namespace", &namespace, "--wait=false"]))?;
    Ok(())
}

/// Pod traffic stays on the node: a pod cannot open a connection to an address off the node
/// (the node's drop rule counts it), while the forward proxy is reachable.
#[tokio::test]
async fn pod_traffic_stays_on_the_node_but_for_the_proxy() -> Result<()> {
    let plane = installed()?;
    let pods = kubectl_json(plane, &["get", "pods", "-n", SYSTEM, "-l", "app.kubernetes.io/name=nats"])?;
    let _ = pods;
    bail!("not written yet")
}
