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

use anyhow::{Context as _, Result, ensure};
use eddy_testing::{
    control_plane::{ControlPlane, repo, run, run_with_input},
    eventually,
    pki::Pki,
};
use serde_json::Value;

mod faults;
#[path = "../support/jwt.rs"]
mod jwt;
mod mesh;
#[path = "../support/registry.rs"]
mod registry;
mod scale;
mod security;
mod tally;

const RELEASE: &str = "eddy";
const SYSTEM: &str = "eddy-system";
/// The ConfigMap of the CA the chart's gateway and dispatcher trust besides the public roots.
const TRUSTED_CA: &str = "eddy-test-ca";
/// The function namespace of the mesh tests, among the chart's `functionNamespaces` (STRICT
/// mTLS, only eddy's gateway and dispatcher may call its Functions).
const MESH_FUNCTIONS: &str = "mesh-functions";

/// The CA of the run's internal HTTPS servers (an issuer's JWKS on the node's address), kept
/// in the node's directory: every test process of the run shares it with the installed chart.
fn trusted_pki(plane: &ControlPlane) -> Result<Pki> {
    Ok(Pki::kept_in(
        &plane.dir().join("trusted-ca"),
        &plane.node_ip()?,
    ))
}

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
        let ca = std::fs::read_to_string(trusted_pki(plane)?.path("ca.pem"))?;
        let manifest = serde_json::json!([
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": SYSTEM}},
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": MESH_FUNCTIONS}},
            {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": TRUSTED_CA, "namespace": SYSTEM}, "data": {"ca.crt": ca}},
        ]);
        for object in manifest.as_array().context("the manifest")? {
            run_with_input(
                plane.kubectl()?.args(["apply", "-f", "-"]),
                &object.to_string(),
            )?;
        }
        run(plane
            .helm()?
            .args(["install", RELEASE])
            .arg(repo().join("charts/eddy"))
            .args(["-n", SYSTEM, "--create-namespace", "-f"])
            .arg(repo().join("charts/eddy/ci/real-node-values.yaml"))
            .args([
                "--set",
                &format!("controller.egress.proxy={proxy}"),
                "--set",
                &format!("trustedCA.configMap={TRUSTED_CA}"),
                // Functions of the tests' own namespaces (not among `functionNamespaces`) that
                // publish events: the event-bus takes them as the chart lets any namespace in.
                "--set",
                "eventBus.allowedNamespaces={kyma-new-*}",
                "--wait",
                "--timeout",
                "4m",
            ]))
        .context("helm install of the chart on the real node")?;
        let node = plane.node_ip()?;
        for policy in host_callers(&node) {
            run_with_input(
                plane.kubectl()?.args(["apply", "-f", "-"]),
                &policy.to_string(),
            )?;
        }
        eprintln!(
            "chart installed and Ready on the real node in {:.1} s",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(plane)
}

/// The tests' own way in from the host, which has no sidecar: an Istio ingress gateway stands
/// there in a user's cluster. The gateway's and the event-bus's pods also take plaintext, and
/// from the node's address alone; everything else the chart's mesh policies decide.
fn host_callers(node: &str) -> Vec<Value> {
    let mut policies = vec![serde_json::json!({
        "apiVersion": "security.istio.io/v1", "kind": "PeerAuthentication",
        "metadata": {"name": "test-host-callers", "namespace": SYSTEM},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/instance": RELEASE}},
            "mtls": {"mode": "PERMISSIVE"},
        },
    })];
    for component in ["gateway", "event-bus"] {
        policies.push(serde_json::json!({
            "apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
            "metadata": {"name": format!("test-host-calls-{component}"), "namespace": SYSTEM},
            "spec": {
                "selector": {"matchLabels": {
                    "app.kubernetes.io/instance": RELEASE,
                    "app.kubernetes.io/component": component,
                }},
                "action": "ALLOW",
                "rules": [{"from": [{"source": {"ipBlocks": [format!("{node}/32")]}}]}],
            },
        }));
    }
    policies
}

fn kubectl_json(plane: &ControlPlane, args: &[&str]) -> Result<Value> {
    let text = run(plane.kubectl()?.args(args).args(["-o", "json"]))?;
    Ok(serde_json::from_str(&text)?)
}

/// A namespace of its own for one test, deleted at the end, pods and all: by
/// [`delete_namespace`] once the test passed (waiting, so the next test has the node's room),
/// or when this is dropped by a failed test (not waiting), so its pods never hold the node's
/// CPU against the tests after it.
struct TestNamespace {
    name: String,
    plane: &'static ControlPlane,
}

impl std::ops::Deref for TestNamespace {
    type Target = str;
    fn deref(&self) -> &str {
        &self.name
    }
}

impl std::fmt::Display for TestNamespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        if let Ok(mut kubectl) = self.plane.kubectl() {
            let _ = kubectl
                .args([
                    "delete",
                    "namespace",
                    &self.name,
                    "--wait=false",
                    "--ignore-not-found",
                ])
                .output();
        }
    }
}

fn namespace(plane: &'static ControlPlane, prefix: &str) -> Result<TestNamespace> {
    let name = format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..6]
    );
    run(plane.kubectl()?.args(["create", "namespace", &name]))?;
    Ok(TestNamespace { name, plane })
}

/// The name of a pod of `selector` in `namespace`.
fn a_pod(plane: &ControlPlane, namespace: &str, selector: &str) -> Result<String> {
    let pods = kubectl_json(plane, &["get", "pods", "-n", namespace, "-l", selector])?;
    pods["items"]
        .as_array()
        .and_then(|items| items.first())
        .and_then(|pod| pod["metadata"]["name"].as_str())
        .map(str::to_owned)
        .with_context(|| format!("no pod of {selector} in {namespace}"))
}

/// A pod of Function `function` in `namespace`, as the API server shows it.
fn function_pod(plane: &ControlPlane, namespace: &str, function: &str) -> Result<Value> {
    let pods = kubectl_json(
        plane,
        &[
            "get",
            "pods",
            "-n",
            namespace,
            "-l",
            &format!("eddy.dev/function={function}"),
        ],
    )?;
    pods["items"]
        .get(0)
        .cloned()
        .with_context(|| format!("no pod of Function {namespace}/{function}"))
}

/// An object's `metadata.name`.
fn name_of(object: &Value) -> Result<String> {
    object["metadata"]["name"]
        .as_str()
        .map(str::to_owned)
        .context("an object without a name")
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
async fn running(
    plane: &ControlPlane,
    namespace: &str,
    name: &str,
    within: Duration,
) -> Result<()> {
    running_as(plane, "functions.eddy.dev", namespace, name, within).await
}

/// [`running`] for a Function of `resource` (eddy's, or Kyma's `functions.serverless.kyma-project.io`).
async fn running_as(
    plane: &ControlPlane,
    resource: &str,
    namespace: &str,
    name: &str,
    within: Duration,
) -> Result<()> {
    wait_for_function(plane, resource, namespace, name, within, |function| {
        condition(function, "Running").is_some_and(|(status, _, _)| status == "True")
    })
    .await
}

/// Whether a pod (as `kubectl get -o json` shows it) has its `Ready` condition True.
fn pod_ready(pod: &Value) -> bool {
    pod["status"]["conditions"]
        .as_array()
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|condition| condition["type"] == "Ready" && condition["status"] == "True")
        })
}

/// `curl` of `url` with `headers` (and `body`, POSTed): the status code and the body.
fn curl(url: &str, headers: &[String], body: Option<&str>) -> Result<(u16, String)> {
    curl_as(None, url, headers, body)
}

/// [`curl`] with the request's `method` named (`-X`).
fn curl_as(
    method: Option<&str>,
    url: &str,
    headers: &[String],
    body: Option<&str>,
) -> Result<(u16, String)> {
    let mut curl = Command::new("curl");
    curl.args(["-s", "-m", "20", "-w", "\n%{http_code}"]);
    if let Some(method) = method {
        curl.args(["-X", method]);
    }
    for header in headers {
        curl.args(["-H", header]);
    }
    if let Some(body) = body {
        curl.args(["--data-binary", body]);
    }
    let output = run(curl.arg(url))?;
    let (text, code) = output.rsplit_once('\n').context("curl's status line")?;
    Ok((code.trim().parse()?, text.to_owned()))
}

/// Deletes a test's namespace and waits until its pods are gone: their requests free the node
/// for the next test.
fn delete_namespace(plane: &ControlPlane, namespace: &str) -> Result<()> {
    run(plane
        .kubectl()?
        .args(["delete", "namespace", namespace, "--wait=false"]))?;
    pods_gone(plane, namespace)
}

/// [`delete_namespace`] for pods that never end on SIGTERM: once the namespace is terminating
/// (no pod can be created in it, so no ReplicaSet replaces one), its pods are deleted without
/// a grace period.
fn delete_namespace_forcing_its_pods(plane: &ControlPlane, namespace: &str) -> Result<()> {
    run(plane
        .kubectl()?
        .args(["delete", "namespace", namespace, "--wait=false"]))?;
    run(plane.kubectl()?.args([
        "delete",
        "pods",
        "--all",
        "-n",
        namespace,
        "--grace-period=0",
        "--force",
    ]))?;
    pods_gone(plane, namespace)
}

fn pods_gone(plane: &ControlPlane, namespace: &str) -> Result<()> {
    // Waits until its pods are gone (the node's CPU and memory free for the next test), not for
    // the Namespace object: with a pod left at its first pass, the namespace controller looks
    // again only after half the pods' grace period (185 s for a Function), whatever the pods do.
    let deadline = std::time::Instant::now() + Duration::from_secs(200);
    loop {
        let pods = run(plane
            .kubectl()?
            .args(["get", "pods", "-n", namespace, "-o", "name"]))?;
        if pods.trim().is_empty() {
            return Ok(());
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "namespace {namespace}: pods still there after 200 s:\n{pods}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Waits until the log of `deployment`'s pod holds `wanted`, or fails with the log.
async fn pod_log_shows(
    plane: &ControlPlane,
    namespace: &str,
    deployment: &str,
    wanted: &str,
) -> Result<()> {
    let mut log = String::new();
    let seen = eventually(
        &format!("{wanted:?} in the log of {namespace}/{deployment}"),
        Duration::from_secs(60),
        || {
            log = plane
                .kubectl()
                .and_then(|mut kubectl| {
                    run(kubectl.args(["logs", "-n", namespace, &format!("deploy/{deployment}")]))
                })
                .unwrap_or_default();
            let seen = log.contains(wanted);
            async move { seen }
        },
    )
    .await;
    seen.with_context(|| format!("the pod's log:\n{log}"))
}

/// [`call_once`], again while the Service refuses the connection: a Deployment is available a
/// moment before kube-proxy routes its Service to the new endpoints.
fn call(
    plane: &ControlPlane,
    namespace: &str,
    service: &str,
    path: &str,
    body: Option<&str>,
) -> Result<(u16, String)> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match call_once(plane, namespace, service, path, body) {
            Err(error)
                if std::time::Instant::now() < deadline
                    && format!("{error:#}").contains("exit status: 7") =>
            {
                std::thread::sleep(Duration::from_millis(200));
            }
            answer => return answer,
        }
    }
}

/// `http://<ClusterIP>:<port>` of a Service (kube-proxy serves it on the host too).
fn service_url(plane: &ControlPlane, namespace: &str, service: &str) -> Result<String> {
    let service = kubectl_json(plane, &["get", "service", service, "-n", namespace])?;
    let ip = service["spec"]["clusterIP"]
        .as_str()
        .context("the Service's ClusterIP")?;
    let port = service["spec"]["ports"][0]["port"]
        .as_u64()
        .context("the Service's port")?;
    Ok(format!("http://{ip}:{port}"))
}

/// `curl` from the host to a Service's ClusterIP.
fn call_once(
    plane: &ControlPlane,
    namespace: &str,
    service: &str,
    path: &str,
    body: Option<&str>,
) -> Result<(u16, String)> {
    let url = service_url(plane, namespace, service)?;
    let mut headers = Vec::new();
    if body.is_some() {
        headers.push("content-type: application/json".to_owned());
    }
    curl(&format!("{url}{path}"), &headers, body)
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
    for wanted in [
        "eddy-controller",
        "eddy-event-bus",
        "eddy-dispatcher",
        "eddy-gateway",
    ] {
        ensure!(
            names.contains(&wanted),
            "no Deployment {wanted} in {names:?}"
        );
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
    ensure!(
        nats["status"]["readyReplicas"] == 3,
        "NATS's three servers not Ready: {}",
        nats["status"]
    );
    let pods = kubectl_json(plane, &["get", "pods", "-n", SYSTEM])?;
    for pod in pods["items"].as_array().context("pods")? {
        for container in pod["status"]["containerStatuses"]
            .as_array()
            .context("container statuses")?
        {
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
async fn buildless_functions_install_their_dependencies_and_answer_through_their_services()
-> Result<()> {
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
  resourceConfiguration: {function: {profile: XS}}
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
  resourceConfiguration: {function: {profile: XS}}
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
    ensure!(
        status == 200 && body == "[[1,2],[3,4],[5]]",
        "chunker answered {status}: {body}"
    );
    let (status, body) = call(plane, &namespace, "semver", "/", None)?;
    ensure!(
        status == 200 && body == "True True",
        "semver answered {status}: {body}"
    );
    delete_namespace(plane, &namespace)?;
    Ok(())
}

/// A dependency that does not exist: the Function's status carries npm's own error within two
/// minutes (the install container's termination message), not a progress deadline later. And,
/// as Kyma's buildless controller reports it, the status describes the newest version: a
/// running Function updated with such a dependency is no longer Running True while its old pod
/// keeps serving the old code; its status says both, for the generation it observed.
#[tokio::test]
async fn a_failed_dependency_install_shows_its_own_error_in_the_status() -> Result<()> {
    let plane = installed()?;
    let namespace = namespace(plane, "badinstall")?;
    let bad_dependencies = r#"'{"dependencies": {"eddy-no-such-package-8f3a1c": "1.0.0"}}'"#;
    apply(
        plane,
        &namespace,
        &format!(
            r#"
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {{name: broken}}
spec:
  runtime: nodejs22
  resourceConfiguration: {{function: {{profile: XS}}}}
  source:
    inline:
      source: "module.exports = {{ main: () => 'never' }};"
      dependencies: {bad_dependencies}
---
apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata: {{name: updated}}
spec:
  runtime: nodejs22
  resourceConfiguration: {{function: {{profile: XS}}}}
  source:
    inline:
      source: "module.exports = {{ main: () => 'version one' }};"
"#
        ),
    )?;
    // npm's own words, and whether an older version still serves.
    let install_failed = |serving: bool| {
        move |function: &Value| {
            let running = condition(function, "Running");
            running.is_some_and(|(status, reason, message)| {
                status == "False"
                    && reason == "DependencyInstallFailed"
                    && message.contains("eddy-no-such-package-8f3a1c")
                    && message.contains("the previous version keeps serving") == serving
            }) && function["status"]["observedGeneration"] == function["metadata"]["generation"]
        }
    };
    let kyma_functions = "functions.serverless.kyma-project.io";
    wait_for_function(
        plane,
        "functions.eddy.dev",
        &namespace,
        "broken",
        Duration::from_secs(120),
        install_failed(false),
    )
    .await?;
    running_as(
        plane,
        kyma_functions,
        &namespace,
        "updated",
        Duration::from_secs(180),
    )
    .await?;
    let (status, body) = call(plane, &namespace, "updated", "/", None)?;
    ensure!(
        status == 200 && body == "version one",
        "updated answered {status}: {body}"
    );

    // Kyma's buildless controller: Running is True only once the Deployment is Available and
    // Progressing with NewReplicaSetAvailable; a failed rollout is False with why.
    apply(
        plane,
        &namespace,
        &format!(
            r#"
apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata: {{name: updated}}
spec:
  runtime: nodejs22
  resourceConfiguration: {{function: {{profile: XS}}}}
  source:
    inline:
      source: "module.exports = {{ main: () => 'version two' }};"
      dependencies: {bad_dependencies}
"#
        ),
    )?;
    wait_for_function(
        plane,
        kyma_functions,
        &namespace,
        "updated",
        Duration::from_secs(120),
        install_failed(true),
    )
    .await?;
    let (status, body) = call(plane, &namespace, "updated", "/", None)?;
    ensure!(
        status == 200 && body == "version one",
        "the old pod should still serve the old code; updated answered {status}: {body}"
    );
    delete_namespace(plane, &namespace)?;
    Ok(())
}

/// Waits until the Function `name` of `resource` (eddy's, or Kyma's
/// `functions.serverless.kyma-project.io`) satisfies `done`.
async fn wait_for_function(
    plane: &ControlPlane,
    resource: &str,
    namespace: &str,
    name: &str,
    within: Duration,
    done: impl Fn(&Value) -> bool,
) -> Result<()> {
    let mut seen = Value::Null;
    let reached = eventually(&format!("Function {name}'s status"), within, || {
        let function = kubectl_json(plane, &["get", resource, name, "-n", namespace]);
        let reached = function.as_ref().is_ok_and(&done);
        if let Ok(function) = function {
            seen = function["status"].clone();
        }
        async move { reached }
    })
    .await;
    reached.with_context(|| {
        if seen.is_null() {
            // Nothing written: the controller's own account says why.
            format!("the status: null; {}", controller_account(plane))
        } else {
            format!("the status: {seen}")
        }
    })
}

/// The controller pods' state and their last log lines, for a failure that the controller
/// explains.
fn controller_account(plane: &ControlPlane) -> String {
    let selector = "app.kubernetes.io/component=controller";
    let pods = plane.kubectl().and_then(|mut kubectl| {
        run(kubectl.args(["get", "pods", "-n", SYSTEM, "-l", selector, "-o", "wide"]))
    });
    let logs = plane.kubectl().and_then(|mut kubectl| {
        run(kubectl.args([
            "logs",
            "-n",
            SYSTEM,
            "-l",
            selector,
            "-c",
            "controller",
            "--tail",
            "25",
        ]))
    });
    let shown = |result: Result<String>| result.unwrap_or_else(|error| format!("({error:#})"));
    format!(
        "the controller's pods:\n{}\ntheir last log lines:\n{}",
        shown(pods),
        shown(logs)
    )
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
  resourceConfiguration: {function: {profile: XS}}
  source:
    inline:
      source: |
        def main(event, context):
            return "ok"
"#,
    )?;
    running(plane, &namespace, "plain", Duration::from_secs(120)).await?;
    let pod = name_of(&function_pod(plane, &namespace, "plain")?)?;
    let id = run(plane
        .kubectl()?
        .args(["exec", "-n", &namespace, &pod, "--", "id", "-u"]))?;
    ensure!(id.trim() != "0", "the function runs as root");
    let write = plane
        .kubectl()?
        .args([
            "exec",
            "-n",
            &namespace,
            &pod,
            "--",
            "sh",
            "-c",
            "echo x > /pwned",
        ])
        .output()?;
    ensure!(
        !write.status.success(),
        "a write to / succeeded inside the function's container"
    );
    let said = String::from_utf8_lossy(&write.stderr);
    ensure!(
        said.contains("Read-only file system"),
        "the write failed for another reason: {said}"
    );
    delete_namespace(plane, &namespace)?;
    Ok(())
}

/// Waits until each Subscription is Ready: its consumer exists, so an event published from
/// now on is delivered (a consumer delivers from its creation).
async fn subscriptions_ready(plane: &ControlPlane, namespace: &str, names: &[&str]) -> Result<()> {
    subscriptions_ready_as(plane, "subscriptions.eddy.dev", namespace, names).await
}

/// [`subscriptions_ready`] for Subscriptions of `resource` (eddy's or Kyma's).
async fn subscriptions_ready_as(
    plane: &ControlPlane,
    resource: &str,
    namespace: &str,
    names: &[&str],
) -> Result<()> {
    for name in names {
        eventually(
            &format!("Subscription {namespace}/{name} Ready"),
            Duration::from_secs(60),
            || {
                let ready = kubectl_json(plane, &["get", resource, name, "-n", namespace])
                    .is_ok_and(|subscription| {
                        condition(&subscription, "Ready")
                            .is_some_and(|(status, _, _)| status == "True")
                    });
                async move { ready }
            },
        )
        .await?;
    }
    Ok(())
}

/// Publishes one CloudEvent (binary mode) from `source` to the event-bus Service; its status
/// code.
fn publish(plane: &ControlPlane, source: &str, kind: &str, id: &str, data: &str) -> Result<u16> {
    let bus = kubectl_json(plane, &["get", "service", "eddy-event-bus", "-n", SYSTEM])?;
    let ip = bus["spec"]["clusterIP"]
        .as_str()
        .context("the event-bus ClusterIP")?;
    let code = run(Command::new("curl").args([
        "-s",
        "-m",
        "20",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "-H",
        "ce-specversion: 1.0",
        "-H",
        &format!("ce-type: {kind}"),
        "-H",
        &format!("ce-source: {source}"),
        "-H",
        &format!("ce-id: {id}"),
        "-H",
        "content-type: application/json",
        "--data-binary",
        data,
        &format!("http://{ip}/publish"),
    ]))?;
    Ok(code.trim().parse()?)
}

/// An event published to the event-bus Service goes through NATS in its pod and the
/// dispatcher's pod to the Function's pod, whose log shows it.
#[tokio::test]
async fn a_published_event_reaches_the_subscribed_functions_pod() -> Result<()> {
    let plane = installed()?;
    let namespace = namespace(plane, "events")?;
    apply(
        plane,
        &namespace,
        &format!(
            r#"
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {{name: logger}}
spec:
  runtime: nodejs22
  resourceConfiguration: {{function: {{profile: XS}}}}
  source:
    inline:
      source: |
        module.exports = {{ main: (event) => {{ console.log("received", event["ce-id"], JSON.stringify(event.data)); return "ok"; }} }};
---
apiVersion: eddy.dev/v1alpha1
kind: Subscription
metadata: {{name: to-logger}}
spec:
  sink: http://logger.{namespace}.svc.cluster.local
  types: [realpod.ping.v1]
"#
        ),
    )?;
    running(plane, &namespace, "logger", Duration::from_secs(120)).await?;
    subscriptions_ready(plane, &namespace, &["to-logger"]).await?;
    let id = format!("ping-{}", uuid::Uuid::new_v4().simple());
    let status = publish(
        plane,
        "real-pod-test",
        "realpod.ping.v1",
        &id,
        r#"{"n": 42}"#,
    )?;
    ensure!(
        status == 204 || status == 202 || status == 200,
        "publish answered {status}"
    );
    let wanted = format!("received {id} {{\"n\":42}}");
    pod_log_shows(plane, &namespace, "logger", &wanted).await?;
    delete_namespace(plane, &namespace)?;
    Ok(())
}

/// examples/shop as a user applies it (namespace default): an order published to the event-bus
/// reserves stock in the nodejs20 pod, whose reply event is recorded by the python311 pod.
#[tokio::test]
async fn the_shop_example_chains_its_functions_through_real_pods() -> Result<()> {
    let plane = installed()?;
    for file in ["functions.yaml", "subscriptions.yaml"] {
        run(plane
            .kubectl()?
            .args(["apply", "-n", "default", "-f"])
            .arg(repo().join("examples/shop").join(file)))?;
    }
    running(plane, "default", "stock-reserver", Duration::from_secs(180)).await?;
    running(
        plane,
        "default",
        "reservation-recorder",
        Duration::from_secs(180),
    )
    .await?;
    subscriptions_ready(plane, "default", &["reserve-stock", "record-reservation"]).await?;
    let order = format!("order-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let data = format!(r#"{{"orderId": "{order}", "items": [{{"sku": "A-1", "qty": 2}}]}}"#);
    let published = publish(plane, "shop", "order.created.v1", &order, &data)?;
    ensure!(
        (200..300).contains(&published),
        "publish answered {published}"
    );
    let mut answer = String::new();
    // Through eddy's gateway: in the mesh, namespace default is one of the chart's function
    // namespaces, whose Functions take calls from the gateway and the dispatcher alone.
    let recorded = eventually("the reservation recorded", Duration::from_secs(60), || {
        answer = call(
            plane,
            SYSTEM,
            "eddy-gateway",
            "/default/reservation-recorder/",
            None,
        )
        .map(|(_, body)| body)
        .unwrap_or_default();
        let recorded = answer.contains(&order);
        async move { recorded }
    })
    .await;
    recorded.with_context(|| format!("the recorder holds: {answer}"))?;
    let reservations: Value = serde_json::from_str(&answer)?;
    let mine: Vec<&Value> = reservations["reservations"]
        .as_array()
        .context("reservations")?
        .iter()
        .filter(|reservation| reservation["orderId"] == order.as_str())
        .collect();
    ensure!(
        mine.len() == 1,
        "the order was recorded {} times: {answer}",
        mine.len()
    );
    ensure!(
        mine[0]["items"] == serde_json::json!([{"sku": "A-1", "qty": 2}]),
        "{answer}"
    );
    Ok(())
}

/// The controller's pod deleted: its Deployment's next pod takes the Lease and reconciles a
/// Function applied after; a deleted Function leaves nothing behind: no pod, and none of the
/// objects it owned (kube-controller-manager's garbage collector follows their owner
/// references).
#[tokio::test]
async fn a_new_controller_pod_reconciles_and_a_deleted_function_leaves_nothing_behind() -> Result<()>
{
    let plane = installed()?;
    let namespace = namespace(plane, "successor")?;
    run(plane.kubectl()?.args([
        "delete",
        "pod",
        "-n",
        SYSTEM,
        "-l",
        "app.kubernetes.io/component=controller",
        "--wait=true",
    ]))?;
    apply(
        plane,
        &namespace,
        r#"
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {name: after}
spec:
  runtime: python312
  resourceConfiguration: {function: {profile: XS}}
  # An HPA too, among the objects the Function owns.
  scaleConfig: {minReplicas: 1, maxReplicas: 2}
  source:
    inline:
      source: |
        def main(event, context):
            return "made by the successor"
"#,
    )?;
    running(plane, &namespace, "after", Duration::from_secs(150)).await?;
    let (status, body) = call(plane, &namespace, "after", "/", None)?;
    ensure!(
        status == 200 && body == "made by the successor",
        "{status}: {body}"
    );
    let owned = ["hpa", "service", "deployment", "configmap", "pod"];
    let hpa = kubectl_json(plane, &["get", "hpa", "after", "-n", &namespace])?;
    ensure!(
        hpa["spec"]["maxReplicas"] == 2,
        "the Function's HPA before its deletion: {hpa}"
    );
    run(plane
        .kubectl()?
        .args(["delete", "functions.eddy.dev", "after", "-n", &namespace]))?;
    let mut left = Vec::new();
    let gone = eventually(
        "nothing of the deleted Function left",
        Duration::from_secs(90),
        || {
            left = owned
                .iter()
                .filter(|kind| {
                    !kubectl_json(
                        plane,
                        &[
                            "get",
                            kind,
                            "-n",
                            &namespace,
                            "-l",
                            "eddy.dev/function=after",
                        ],
                    )
                    .is_ok_and(|list| list["items"].as_array().is_some_and(Vec::is_empty))
                })
                .copied()
                .collect::<Vec<_>>();
            let gone = left.is_empty();
            async move { gone }
        },
    )
    .await;
    gone.with_context(|| format!("still there: {left:?}"))?;
    delete_namespace(plane, &namespace)?;
    Ok(())
}

/// The node's drop rule's packet count (pod traffic that tried to leave the node).
fn dropped_off_node(plane: &ControlPlane) -> Result<u64> {
    let settings = std::fs::read_to_string(plane.dir().join("node.env"))?;
    let id = settings
        .lines()
        .find_map(|line| line.strip_prefix("node_id="))
        .context("node_id in node.env")?;
    let chain =
        run(Command::new("nft").args(["list", "chain", "inet", &format!("eddy-{id}"), "forward"]))?;
    let packets = chain
        .split_whitespace()
        .skip_while(|word| *word != "packets")
        .nth(1)
        .context("the drop rule's counter")?;
    Ok(packets.parse()?)
}

/// A host off the node that would answer a pod: a network namespace behind a veth, routed both
/// ways, with an HTTP server the host itself reaches. Removed on drop.
struct OutsideHost {
    namespace: String,
    link: String,
    server: std::process::Child,
    address: String,
}

impl OutsideHost {
    fn start() -> Result<Self> {
        let id = &uuid::Uuid::new_v4().simple().to_string()[..6];
        let namespace = format!("eddy-outside-{id}");
        let (link, peer) = (format!("vo{id}"), format!("vi{id}"));
        let octet = u8::from_str_radix(&id[..2], 16)?;
        let (near, address) = (format!("10.251.{octet}.1"), format!("10.251.{octet}.2"));
        let ip = |args: &[&str]| run(Command::new("ip").args(args));
        ip(&["netns", "add", &namespace])?;
        let mut host = Self {
            namespace: namespace.clone(),
            link: link.clone(),
            server: Command::new("true").spawn()?,
            address: address.clone(),
        };
        ip(&["link", "add", &link, "type", "veth", "peer", "name", &peer])?;
        ip(&["link", "set", &peer, "netns", &namespace])?;
        ip(&["addr", "add", &format!("{near}/30"), "dev", &link])?;
        ip(&["link", "set", &link, "up"])?;
        // The answer comes back in through this link: forwarding on it only.
        std::fs::write(format!("/proc/sys/net/ipv4/conf/{link}/forwarding"), "1")?;
        ip(&[
            "netns",
            "exec",
            &namespace,
            "ip",
            "addr",
            "add",
            &format!("{address}/30"),
            "dev",
            &peer,
        ])?;
        ip(&[
            "netns", "exec", &namespace, "ip", "link", "set", &peer, "up",
        ])?;
        ip(&["netns", "exec", &namespace, "ip", "link", "set", "lo", "up"])?;
        ip(&[
            "netns", "exec", &namespace, "ip", "route", "add", "default", "via", &near,
        ])?;
        // A bare responder: http.server would first look its address up in DNS, which this
        // namespace cannot reach.
        let responder = format!(
            "import socket\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind(('{address}', 8000))\ns.listen()\nwhile True:\n    c, _ = s.accept()\n    c.sendall(b'HTTP/1.0 200 OK\\r\\ncontent-length: 2\\r\\n\\r\\nok')\n    c.close()\n"
        );
        host.server = Command::new("ip")
            .args(["netns", "exec", &namespace, "python3", "-c", &responder])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        Ok(host)
    }
}

impl Drop for OutsideHost {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let _ = Command::new("ip")
            .args(["link", "del", &self.link])
            .output();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.namespace])
            .output();
    }
}

/// Pod traffic stays on the node: a host off the node that the host itself reaches, and that
/// would answer a pod (it routes back), is out of a pod's reach (the node's drop rule counts
/// the attempt), while the forward proxy on the node's bridge takes the pod to a package
/// registry.
#[tokio::test]
async fn pod_traffic_stays_on_the_node_but_for_the_proxy() -> Result<()> {
    let plane = installed()?;
    let outside = OutsideHost::start()?;
    let url = format!("http://{}:8000/", outside.address);
    eventually(
        "the outside host to answer the host",
        Duration::from_secs(10),
        || {
            let reached =
                run(Command::new("curl").args(["-sf", "-m", "2", "-o", "/dev/null", &url])).is_ok();
            async move { reached }
        },
    )
    .await?;
    let namespace = namespace(plane, "egress")?;
    let proxy = plane.egress_proxy()?;
    let version = env!("CARGO_PKG_VERSION");
    let script = r#"
import socket, urllib.request, os
try:
    socket.create_connection((os.environ["OUTSIDE"], 8000), timeout=5)
    print("direct: connected")
except OSError as error:
    print("direct: failed", type(error).__name__)
opener = urllib.request.build_opener(urllib.request.ProxyHandler({"https": os.environ["PROXY"]}))
print("proxied:", opener.open("https://pypi.org/simple/packaging/", timeout=30).status)
"#;
    let before = dropped_off_node(plane)?;
    let pod = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "egress"},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "probe",
            "image": format!("localhost/eddy-runtime-python312:{version}"),
            "imagePullPolicy": "Never",
            "command": ["python", "-c", script],
            "env": [{"name": "PROXY", "value": proxy}, {"name": "OUTSIDE", "value": outside.address}],
        }]}
    });
    apply(plane, &namespace, &pod.to_string())?;
    eventually("the probe pod to finish", Duration::from_secs(90), || {
        let done =
            kubectl_json(plane, &["get", "pod", "egress", "-n", &namespace]).is_ok_and(|pod| {
                pod["status"]["phase"] == "Succeeded" || pod["status"]["phase"] == "Failed"
            });
        async move { done }
    })
    .await?;
    let log = run(plane.kubectl()?.args(["logs", "-n", &namespace, "egress"]))?;
    ensure!(
        log.contains("direct: failed"),
        "a pod reached a host off the node: {log}"
    );
    ensure!(
        log.contains("proxied: 200"),
        "the proxy did not take the pod out: {log}"
    );
    let after = dropped_off_node(plane)?;
    ensure!(
        after > before,
        "the node's drop rule counted nothing ({before} then {after}): {log}"
    );
    delete_namespace(plane, &namespace)?;
    Ok(())
}

/// The task of the chart's controller container on the node (containerd's id), from crictl's
/// view through `ctr`: the container labelled as the controller of eddy's namespace.
fn controller_task(plane: &ControlPlane) -> Result<Option<String>> {
    let socket = plane.dir().join("run/containerd/containerd.sock");
    let containers = run(Command::new("ctr").arg("-a").arg(&socket).args([
        "-n",
        "k8s.io",
        "containers",
        "ls",
        "-q",
    ]))?;
    let tasks = run(Command::new("ctr")
        .arg("-a")
        .arg(&socket)
        .args(["-n", "k8s.io", "tasks", "ls"]))?;
    for id in containers.lines() {
        let info = run(Command::new("ctr").arg("-a").arg(&socket).args([
            "-n",
            "k8s.io",
            "containers",
            "info",
            id,
        ]))?;
        let info: Value = serde_json::from_str(&info)?;
        let labels = &info["Labels"];
        let running = tasks
            .lines()
            .any(|line| line.starts_with(id) && line.contains("RUNNING"));
        if labels["io.kubernetes.container.name"] == "controller"
            && labels["io.kubernetes.pod.namespace"] == SYSTEM
            && running
        {
            return Ok(Some(id.to_owned()));
        }
    }
    Ok(None)
}

/// The controller started while the API server is down (its container killed, the kubelet
/// starting it again meanwhile) recovers once the API server is back, without a restart of
/// its own: it takes the Lease and reconciles a Function applied then.
#[tokio::test]
async fn a_controller_started_while_the_api_server_is_down_recovers_without_a_restart() -> Result<()>
{
    let plane = installed()?;
    let pods = kubectl_json(
        plane,
        &[
            "get",
            "pods",
            "-n",
            SYSTEM,
            "-l",
            "app.kubernetes.io/component=controller",
        ],
    )?;
    let restarts_before = pods["items"][0]["status"]["containerStatuses"][0]["restartCount"]
        .as_i64()
        .context("the controller's restart count")?;
    let first = controller_task(plane)?.context("the controller's container on the node")?;
    let script = repo().join("scripts/kube");
    run(Command::new(&script)
        .args(["stop", "kube-apiserver"])
        .env("EDDY_KUBE_DIR", plane.dir()))?;
    let socket = plane.dir().join("run/containerd/containerd.sock");
    run(Command::new("ctr")
        .arg("-a")
        .arg(&socket)
        .args(["-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", &first]))?;
    // The kubelet starts it again on its own, API server or not.
    let mut second = None;
    let restarted = eventually(
        "the kubelet to start the controller again",
        Duration::from_secs(60),
        || {
            second = controller_task(plane)
                .ok()
                .flatten()
                .filter(|id| *id != first);
            let restarted = second.is_some();
            async move { restarted }
        },
    )
    .await;
    let up = run(Command::new(&script)
        .arg("up")
        .env("EDDY_KUBE_DIR", plane.dir()));
    restarted?;
    up?;
    let namespace = namespace(plane, "recovery")?;
    apply(
        plane,
        &namespace,
        r#"
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {name: later}
spec:
  runtime: nodejs22
  resourceConfiguration: {function: {profile: XS}}
  source:
    inline:
      source: "module.exports = { main: () => 'reconciled' };"
"#,
    )?;
    running(plane, &namespace, "later", Duration::from_secs(120)).await?;
    let (status, body) = call(plane, &namespace, "later", "/", None)?;
    ensure!(status == 200 && body == "reconciled", "{status}: {body}");
    ensure!(
        controller_task(plane)? == second,
        "the controller was restarted again: it did not recover on its own"
    );
    let pods = kubectl_json(
        plane,
        &[
            "get",
            "pods",
            "-n",
            SYSTEM,
            "-l",
            "app.kubernetes.io/component=controller",
        ],
    )?;
    let restarts = pods["items"][0]["status"]["containerStatuses"][0]["restartCount"]
        .as_i64()
        .context("the controller's restart count")?;
    ensure!(
        restarts == restarts_before + 1,
        "restarts: {restarts_before} before, {restarts} after (one was ours)"
    );
    delete_namespace(plane, &namespace)?;
    Ok(())
}

/// eddy's gateway in its pod fronts a Function at `/<namespace>/<function>` and enforces its
/// `access`: no token 401, a wrong one 401, the right one reaches the function's pod.
#[tokio::test]
async fn the_gateway_pod_serves_a_function_and_enforces_its_access() -> Result<()> {
    let plane = installed()?;
    let namespace = namespace(plane, "gateway")?;
    let token = format!("tok-{}", uuid::Uuid::new_v4().simple());
    let digest = run_with_input(&mut Command::new("sha256sum"), &token)?;
    let digest = digest
        .split_whitespace()
        .next()
        .context("sha256sum's digest")?
        .to_owned();
    apply(
        plane,
        &namespace,
        &format!(
            r#"
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {{name: guarded}}
spec:
  runtime: python312
  resourceConfiguration: {{function: {{profile: XS}}}}
  access: {{mode: token, tokenDigests: ["sha256:{digest}"]}}
  source:
    inline:
      source: |
        def main(event, context):
            return "behind the gateway"
"#
        ),
    )?;
    running(plane, &namespace, "guarded", Duration::from_secs(120)).await?;
    let gateway = kubectl_json(plane, &["get", "service", "eddy-gateway", "-n", SYSTEM])?;
    let ip = gateway["spec"]["clusterIP"]
        .as_str()
        .context("the gateway's ClusterIP")?
        .to_owned();
    let url = format!("http://{ip}/{namespace}/guarded/");
    let status = |authorization: Option<&str>| -> Result<(u16, String)> {
        let headers: Vec<String> = authorization
            .map(|token| format!("authorization: Bearer {token}"))
            .into_iter()
            .collect();
        curl(&url, &headers, None)
    };
    // The gateway learns of the Function through its watch: poll until it routes.
    let mut last = (0, String::new());
    let served = eventually(
        "the gateway to serve the Function with its token",
        Duration::from_secs(60),
        || {
            last = status(Some(&token)).unwrap_or((0, String::new()));
            let served = last == (200, "behind the gateway".to_owned());
            async move { served }
        },
    )
    .await;
    served.with_context(|| format!("the gateway answered {} {}", last.0, last.1))?;
    ensure!(status(None)?.0 == 401, "no token must be refused");
    ensure!(
        status(Some("not-the-token"))?.0 == 401,
        "a wrong token must be refused"
    );
    delete_namespace(plane, &namespace)?;
    Ok(())
}

/// The gateway pod enforces a Kyma APIRule's JWT rule with an issuer whose JWKS is served over
/// HTTPS under an internal CA (the chart's `trustedCA`), from the node's address: no token and
/// a token signed by another key are refused, a valid token is served, a method no rule lists
/// is not routed, and the keys were fetched from inside the cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_pod_enforces_a_jwt_apirule_with_an_issuer_behind_an_internal_ca() -> Result<()>
{
    let plane = installed()?;
    let pki = trusted_pki(plane)?;
    let (jwks_uri, fetches) = jwt::serve_jwks_tls(&pki, &plane.node_ip()?).await;
    let namespace = namespace(plane, "jwt")?;
    let issuer = jwt::ISSUER;
    apply(
        plane,
        &namespace,
        &format!(
            r#"
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {{name: secured}}
spec:
  runtime: python312
  resourceConfiguration: {{function: {{profile: XS}}}}
  source:
    inline:
      source: |
        def main(event, context):
            return "for token holders"
---
apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata: {{name: secured}}
spec:
  hosts: [secured.example.com]
  service: {{name: secured, port: 80}}
  gateway: kyma-system/kyma-gateway
  rules:
    - path: /*
      methods: [GET]
      jwt:
        authentications:
          - issuer: {issuer}
            jwksUri: {jwks_uri}
"#
        ),
    )?;
    running(plane, &namespace, "secured", Duration::from_secs(120)).await?;
    let gateway = kubectl_json(plane, &["get", "service", "eddy-gateway", "-n", SYSTEM])?;
    let ip = gateway["spec"]["clusterIP"]
        .as_str()
        .context("the gateway's ClusterIP")?
        .to_owned();
    let url = format!("http://{ip}/");
    let ask = |token: Option<&str>, method: &str| -> Result<(u16, String)> {
        let mut headers = vec!["host: secured.example.com".to_owned()];
        headers.extend(token.map(|token| format!("authorization: Bearer {token}")));
        curl_as(Some(method), &url, &headers, None)
    };
    let valid = jwt::jwt(jwt::ISSUER_KEY, "key-1", serde_json::json!({}));
    // The gateway learns of the APIRule through its watch: poll until it routes.
    let mut last = (0, String::new());
    let served = eventually(
        "the gateway to serve the APIRule's host to a valid token",
        Duration::from_secs(60),
        || {
            last = ask(Some(&valid), "GET").unwrap_or((0, String::new()));
            let served = last == (200, "for token holders".to_owned());
            async move { served }
        },
    )
    .await;
    served.with_context(|| format!("the gateway answered {} {}", last.0, last.1))?;
    ensure!(
        fetches.load(std::sync::atomic::Ordering::SeqCst) > 0,
        "the gateway pod never fetched the issuer's keys"
    );
    // As Kyma's gateway answers.
    let missing = ask(None, "GET")?;
    ensure!(
        missing == (403, "RBAC: access denied".to_owned()),
        "no token: {missing:?}"
    );
    let forged = jwt::jwt(jwt::OTHER_KEY, "key-1", serde_json::json!({}));
    let forged = ask(Some(&forged), "GET")?;
    ensure!(
        forged == (401, "Jwt verification fails".to_owned()),
        "a token of another key: {forged:?}"
    );
    let unlisted = ask(Some(&valid), "DELETE")?;
    // No route for a method no rule lists: 404, as Kyma's gateway answers.
    ensure!(unlisted.0 == 404, "a method no rule lists: {unlisted:?}");
    delete_namespace(plane, &namespace)?;
    Ok(())
}

/// Every runtime image `scripts/images` builds serves a Function in a real pod: each answers
/// with its own interpreter's version.
#[tokio::test]
async fn every_runtime_image_serves_a_function() -> Result<()> {
    let plane = installed()?;
    let namespace = namespace(plane, "runtimes")?;
    let runtimes = [
        ("nodejs20", "v20."),
        ("nodejs22", "v22."),
        ("nodejs24", "v24."),
        ("nodejs26", "v26."),
        ("python311", "3.11."),
        ("python312", "3.12."),
        ("python314", "3.14."),
    ];
    let mut manifests = String::new();
    for (runtime, _) in runtimes {
        let source = match runtime {
            // Kyma's new runtime API: Express's response, Flask's request.
            "nodejs26" => "module.exports = { main: (req, res) => res.send(process.version) };",
            "python314" => "import platform\n\ndef main():\n    return platform.python_version()\n",
            nodejs if nodejs.starts_with("nodejs") => {
                "module.exports = { main: () => process.version };"
            }
            _ => {
                "import platform\ndef main(event, context):\n    return platform.python_version()\n"
            }
        };
        let function = serde_json::json!({
            "apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
            "metadata": {"name": runtime},
            "spec": {"runtime": runtime,
                     "resourceConfiguration": {"function": {"profile": "XS"}},
                     "source": {"inline": {"source": source}}},
        });
        manifests.push_str(&format!("---\n{function}\n"));
    }
    apply(plane, &namespace, &manifests)?;
    for (runtime, version) in runtimes {
        running(plane, &namespace, runtime, Duration::from_secs(150)).await?;
        let (status, body) = call(plane, &namespace, runtime, "/", None)?;
        ensure!(
            status == 200 && body.starts_with(version),
            "{runtime} answered {status}: {body}"
        );
    }
    delete_namespace(plane, &namespace)?;
    Ok(())
}

/// Kyma's current runtimes in real pods, from Kyma's own kinds: a nodejs26 Function emits an
/// event with the sdk (through the event-bus Service, as PUBLISHER_PROXY_ADDRESS names it), a
/// Kyma Subscription delivers it, and a python314 Function reads it with the sdk and logs it.
#[tokio::test]
async fn kyma_s_current_runtimes_chain_an_event_through_real_pods() -> Result<()> {
    let plane = installed()?;
    let namespace = namespace(plane, "kyma-new")?;
    apply(
        plane,
        &namespace,
        &format!(
            r#"
apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata: {{name: emitter}}
spec:
  runtime: nodejs26
  resourceConfiguration: {{function: {{profile: XS}}}}
  source:
    inline:
      source: |
        const sdk = require("sdk");
        module.exports = {{ main: async (req, res) => {{
          const answer = await sdk.emitCloudEvent("order.shipped.v1", "warehouse", req.body, {{ id: req.query.id }});
          res.status(202).json({{ published: answer.status }});
        }} }};
---
apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata: {{name: recorder}}
spec:
  runtime: python314
  resourceConfiguration: {{function: {{profile: XS}}}}
  source:
    inline:
      source: |
        import json
        import sdk


        def main():
            event = sdk.get_cloud_event()
            print("recorded", event.get_id(), json.dumps(event.get_data()), flush=True)
            return "ok"
---
apiVersion: eventing.kyma-project.io/v1alpha2
kind: Subscription
metadata: {{name: to-recorder}}
spec:
  sink: http://recorder.{namespace}.svc.cluster.local
  source: warehouse
  types: [order.shipped.v1]
"#
        ),
    )?;
    let kyma_functions = "functions.serverless.kyma-project.io";
    running_as(
        plane,
        kyma_functions,
        &namespace,
        "emitter",
        Duration::from_secs(150),
    )
    .await?;
    running_as(
        plane,
        kyma_functions,
        &namespace,
        "recorder",
        Duration::from_secs(150),
    )
    .await?;
    subscriptions_ready_as(
        plane,
        "subscriptions.eventing.kyma-project.io",
        &namespace,
        &["to-recorder"],
    )
    .await?;
    let id = format!("ship-{}", uuid::Uuid::new_v4().simple());
    let (status, body) = call(
        plane,
        &namespace,
        "emitter",
        &format!("/?id={id}"),
        Some(r#"{"order": 7}"#),
    )?;
    ensure!(status == 202, "the emitter answered {status}: {body}");
    let wanted = format!("recorded {id} {{\"order\": 7}}");
    pod_log_shows(plane, &namespace, "recorder", &wanted).await?;
    delete_namespace(plane, &namespace)?;
    Ok(())
}

/// Deletes kyma-system's package registry Secret when the test ends, passed or not: other
/// tests' Functions must not install with it.
struct ClusterRegistrySecret(&'static ControlPlane);

impl Drop for ClusterRegistrySecret {
    fn drop(&mut self) {
        if let Ok(mut kubectl) = self.0.kubectl() {
            let _ = kubectl
                .args([
                    "delete",
                    "secret",
                    "serverless-package-registry-config",
                    "-n",
                    "kyma-system",
                    "--ignore-not-found",
                ])
                .output();
        }
    }
}

/// Kyma's private package registry Secret in real pods: a nodejs26 Function installs a package
/// only a private npm registry serves (its namespace's `.npmrc` with the registry's token),
/// and a python312 Function one only a private index serves (kyma-system's labelled
/// `pip.conf`, copied into its namespace), both by the buildless `install` init container
/// through the node's proxy. The function's container has no trace of the configuration.
#[tokio::test]
async fn private_packages_install_in_real_pods_with_kyma_s_package_registry_secret() -> Result<()> {
    const TOKEN: &str = "registry-token-real-7c2e";
    let plane = installed()?;
    let ip = plane.node_ip()?;
    let (registry, refused) = registry::serve(&ip, TOKEN).await;
    let host = registry.trim_start_matches("http://").to_owned();
    // Another namespace, without a Secret of its own: there the cluster-wide one applies (a
    // namespace's own Secret wins whole).
    let analytics = namespace(plane, "analytics")?;
    let namespace = namespace(plane, "registry")?;
    let _cleanup = ClusterRegistrySecret(plane);
    run_with_input(
        plane
            .kubectl()?
            .args(["apply", "-n", "kyma-system", "-f", "-"]),
        &format!(
            r#"
apiVersion: v1
kind: Secret
metadata:
  name: serverless-package-registry-config
  labels: {{serverless.kyma-project.io/config: credentials}}
type: Opaque
stringData:
  pip.conf: |
    [global]
    index-url = http://eddy:{TOKEN}@{host}/simple/
    trusted-host = {ip}
"#
        ),
    )?;
    apply(
        plane,
        &namespace,
        &format!(
            r#"
apiVersion: v1
kind: Secret
metadata: {{name: serverless-package-registry-config}}
type: Opaque
stringData:
  .npmrc: |
    @eddy-private:registry={registry}/
    //{host}/:_authToken={TOKEN}
---
apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata: {{name: greet}}
spec:
  runtime: nodejs26
  resourceConfiguration: {{function: {{profile: XS}}}}
  source:
    inline:
      source: |
        const greeting = require("@eddy-private/greeting");
        module.exports = {{ main: (req, res) => res.send(greeting.hello("pods")) }};
      dependencies: '{{"dependencies": {{"@eddy-private/greeting": "1.0.0"}}}}'
"#
        ),
    )?;
    apply(
        plane,
        &analytics,
        r#"
apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata: {name: count}
spec:
  runtime: python312
  resourceConfiguration: {function: {profile: XS}}
  source:
    inline:
      source: |
        import eddy_private_greeting

        def main(event, context):
            return eddy_private_greeting.hello("pods")
      dependencies: eddy-private-greeting==1.0.0
"#,
    )?;
    let kyma_functions = "functions.serverless.kyma-project.io";
    for (namespace, name) in [(&namespace, "greet"), (&analytics, "count")] {
        running_as(
            plane,
            kyma_functions,
            namespace,
            name,
            Duration::from_secs(180),
        )
        .await?;
    }
    let (status, body) = call(plane, &namespace, "greet", "/", None)?;
    ensure!(
        status == 200 && body == "hello pods, from the private registry",
        "greet answered {status}: {body}"
    );
    let (status, body) = call(plane, &analytics, "count", "/", None)?;
    ensure!(
        status == 200 && body == "hello pods, from the private index",
        "count answered {status}: {body}"
    );
    ensure!(
        refused.lock().is_ok_and(|refused| refused.is_empty()),
        "the registry was asked without its token: {refused:?}"
    );
    // Neither the configuration nor its variables are in the function's container.
    for (namespace, name) in [(&namespace, "greet"), (&analytics, "count")] {
        let pod = name_of(&function_pod(plane, namespace, name)?)?;
        let seen = run(plane.kubectl()?.args([
            "exec",
            "-n",
            namespace,
            &pod,
            "-c",
            "function",
            "--",
            "sh",
            "-c",
            "ls /eddy/package-registry 2>&1; env | grep -ci -e npm_config_userconfig -e pip_config_file; true",
        ]))?;
        ensure!(
            seen.contains("No such file or directory") && seen.trim_end().ends_with('0'),
            "{name}'s container sees the registry configuration: {seen}"
        );
    }
    delete_namespace(plane, &namespace)?;
    delete_namespace(plane, &analytics)?;
    Ok(())
}

/// An autoscaled Function scales out on CPU load as in any cluster: metrics-server (behind the
/// API server's aggregation layer) reads the pods' CPU from the kubelet, the controller-manager's
/// HPA (the one eddy renders: 50 % of the CPU request) raises the Deployment's replicas, the
/// controller leaves them to it, and the new pods answer calls.
#[tokio::test]
async fn an_autoscaled_function_scales_out_on_cpu_load_through_metrics_server() -> Result<()> {
    let plane = installed()?;
    let namespace = namespace(plane, "autoscale")?;
    // Each call spins for a quarter of a second of wall time: under steady calls the pod runs
    // at its XS limit (150m), three times its request (50m).
    apply(
        plane,
        &namespace,
        r#"
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {name: spinner}
spec:
  runtime: python312
  scaleConfig: {minReplicas: 1, maxReplicas: 3}
  resourceConfiguration: {function: {profile: XS}}
  source:
    inline:
      source: |
        import socket, time
        def main(event, context):
            end = time.monotonic() + 0.25
            while time.monotonic() < end:
                pass
            return socket.gethostname()
"#,
    )?;
    running(plane, &namespace, "spinner", Duration::from_secs(150)).await?;
    let url = format!("{}/", service_url(plane, &namespace, "spinner")?);

    // Two callers, each calling again as soon as it is answered; every answering pod is kept.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let answered_by = std::sync::Arc::new(std::sync::Mutex::new(std::collections::BTreeSet::<
        String,
    >::new()));
    let callers: Vec<_> = (0..2)
        .map(|_| {
            let (stop, answered_by, url) = (stop.clone(), answered_by.clone(), url.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok((200, pod)) = curl(&url, &[], None)
                        && let Ok(mut pods) = answered_by.lock()
                    {
                        pods.insert(pod);
                    }
                }
            })
        })
        .collect();
    let outcome = async {
        // The metrics pipeline: the pod's CPU, as metrics.k8s.io serves it.
        let pod_metrics = format!("/apis/metrics.k8s.io/v1beta1/namespaces/{namespace}/pods");
        let mut last = String::new();
        eventually(
            "metrics.k8s.io to report the Function's pod using CPU",
            Duration::from_secs(90),
            || {
                last = plane
                    .kubectl()
                    .and_then(|mut kubectl| run(kubectl.args(["get", "--raw", &pod_metrics])))
                    .unwrap_or_default();
                let busy = serde_json::from_str::<Value>(&last).is_ok_and(|list| {
                    list["items"].as_array().is_some_and(|pods| {
                        pods.iter().any(|pod| {
                            pod["containers"].as_array().is_some_and(|containers| {
                                containers.iter().any(|container| {
                                    container["name"] == "function"
                                        && cpu_millis(&container["usage"]["cpu"]) >= 50.0
                                })
                            })
                        })
                    })
                });
                async move { busy }
            },
        )
        .await
        .with_context(|| format!("metrics.k8s.io answered: {last}"))?;

        // The HPA sees the load and the Deployment grows to the Function's maximum.
        let mut hpa = Value::Null;
        let mut deployment = Value::Null;
        eventually(
            "the HPA to scale the Function's Deployment to 3 ready replicas",
            Duration::from_secs(180),
            || {
                hpa = kubectl_json(plane, &["get", "hpa", "spinner", "-n", &namespace])
                    .unwrap_or_default();
                deployment =
                    kubectl_json(plane, &["get", "deployment", "spinner", "-n", &namespace])
                        .unwrap_or_default();
                let scaled = deployment["status"]["readyReplicas"].as_u64() == Some(3);
                async move { scaled }
            },
        )
        .await
        .with_context(|| {
            format!(
                "the HPA's status: {}\nthe Deployment's status: {}",
                hpa["status"], deployment["status"]
            )
        })?;
        let utilization =
            hpa["status"]["currentMetrics"][0]["resource"]["current"]["averageUtilization"]
                .as_u64()
                .unwrap_or_default();
        ensure!(
            utilization > 50,
            "the HPA scaled at {utilization} % of the CPU request, not above its 50 % target: {}",
            hpa["status"]
        );
        // The new pods serve: calls are answered by more than one pod.
        eventually(
            "calls answered by at least two of the Function's pods",
            Duration::from_secs(60),
            || {
                let pods = answered_by.lock().map(|pods| pods.len()).unwrap_or(0);
                async move { pods >= 2 }
            },
        )
        .await?;
        // The Function reports the replicas the HPA chose (its scale subresource's status).
        let mut function = Value::Null;
        eventually(
            "the Function's status to report 3 replicas",
            Duration::from_secs(30),
            || {
                function = kubectl_json(plane, &["get", "function", "spinner", "-n", &namespace])
                    .unwrap_or_default();
                let reported = function["status"]["replicas"] == 3;
                async move { reported }
            },
        )
        .await
        .with_context(|| format!("its status: {}", function["status"]))?;
        ensure!(
            deployment["spec"]["replicas"] == 3,
            "the Deployment's replicas were set back: {}",
            deployment["spec"]
        );
        eprintln!(
            "scaled to 3 replicas at {utilization} % of the CPU request; answered by {:?}",
            answered_by
                .lock()
                .map(|pods| pods.clone())
                .unwrap_or_default(),
        );
        anyhow::Ok(())
    }
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for caller in callers {
        let _ = caller.join();
    }
    outcome?;
    delete_namespace(plane, &namespace)?;
    Ok(())
}

/// A CPU quantity (`"153457112n"`, `"150m"`, `"1"`) in millicores.
fn cpu_millis(quantity: &Value) -> f64 {
    let text = quantity.as_str().unwrap_or_default();
    let (number, scale) = match text.char_indices().last() {
        Some((at, 'n')) => (&text[..at], 1e-6),
        Some((at, 'u')) => (&text[..at], 1e-3),
        Some((at, 'm')) => (&text[..at], 1.0),
        _ => (text, 1000.0),
    };
    number.parse::<f64>().map_or(0.0, |n| n * scale)
}

/// A Function whose pod no node can take says why in its Running condition within seconds,
/// with the scheduler's own reason, not after the Deployment's progress deadline.
#[tokio::test]
async fn a_function_no_node_can_take_says_the_scheduler_s_reason() -> Result<()> {
    let plane = installed()?;
    let namespace = namespace(plane, "unschedulable")?;
    apply(
        plane,
        &namespace,
        r#"
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {name: greedy}
spec:
  runtime: python312
  resourceConfiguration:
    function:
      resources:
        requests: {cpu: "64", memory: 64Mi}
        limits: {cpu: "64", memory: 128Mi}
  source:
    inline:
      source: |
        def main(event, context):
            return "never runs"
"#,
    )?;
    let mut last = Value::Null;
    let pending = eventually(
        "Running Unknown with the scheduler's reason",
        Duration::from_secs(60),
        || {
            last = kubectl_json(plane, &["get", "function", "greedy", "-n", &namespace])
                .unwrap_or_default();
            let said = condition(&last, "Running").is_some_and(|(status, reason, message)| {
                // Unknown: pending is not a failure, the pod may still be placed.
                status == "Unknown"
                    && reason == "DeploymentPending"
                    && message.contains("Insufficient cpu")
            });
            async move { said }
        },
    )
    .await;
    pending.with_context(|| format!("its status: {}", last["status"]))?;
    delete_namespace(plane, &namespace)?;
    Ok(())
}
