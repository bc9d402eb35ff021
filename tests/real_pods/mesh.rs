//! eddy in Istio's mesh on the real node: who reaches a Function (mTLS, eddy's
//! AuthorizationPolicies, Istio's ingress gateway), planted breaks that show those checks can
//! fail, and probes rewritten by the injector.

use super::*;

/// A pod of its own in `namespace`, running the python312 runtime image idle, with or without
/// Istio's sidecar; ready once `kubectl wait` says so (its proxy too, when it has one).
pub(super) fn client_pod(plane: &ControlPlane, namespace: &str, meshed: bool) -> Result<String> {
    let name = format!("client-{}", &uuid::Uuid::new_v4().simple().to_string()[..6]);
    let image = format!(
        "localhost/eddy-runtime-python312:{}",
        env!("CARGO_PKG_VERSION")
    );
    run(plane.kubectl()?.args([
        "run",
        &name,
        "-n",
        namespace,
        "--image",
        &image,
        "--image-pull-policy=Never",
        "--restart=Never",
        "--labels",
        &format!("sidecar.istio.io/inject={meshed}"),
        "--command",
        "--",
        "sleep",
        "600",
    ]))?;
    run(plane.kubectl()?.args([
        "wait",
        "-n",
        namespace,
        "--for=condition=Ready",
        &format!("pod/{name}"),
        "--timeout=120s",
    ]))?;
    Ok(name)
}

/// POSTs `{}` to `url` from inside `pod` (its container named as the pod): the status and the
/// start of the body, or `refused: …` when no HTTP answer came.
pub(super) fn post_from_pod(
    plane: &ControlPlane,
    namespace: &str,
    pod: &str,
    url: &str,
) -> Result<String> {
    request_from_pod(plane, namespace, pod, "POST", url, None)
}

/// A request from inside `pod` with `method` (a POST carries `{}` as JSON) and an optional
/// bearer `token`: the status and the start of the body, or `refused: …` when no HTTP answer
/// came.
pub(super) fn request_from_pod(
    plane: &ControlPlane,
    namespace: &str,
    pod: &str,
    method: &str,
    url: &str,
    token: Option<&str>,
) -> Result<String> {
    let authorization = token.map_or(String::new(), |token| format!("Bearer {token}"));
    let script = format!(
        r#"
import urllib.request, urllib.error
headers = {{"content-type": "application/json"}} if {method:?} == "POST" else {{}}
if {authorization:?}:
    headers["authorization"] = {authorization:?}
request = urllib.request.Request({url:?}, data=b"{{}}" if {method:?} == "POST" else None, method={method:?}, headers=headers)
try:
    answer = urllib.request.urlopen(request, timeout=10)
    print(answer.status, answer.read()[:200].decode())
except urllib.error.HTTPError as error:
    print(error.code, error.read()[:200].decode())
except Exception as error:
    print("refused:", repr(error))
"#
    );
    python_in_pod(plane, namespace, pod, pod, &script)
}

/// Runs `script` with python3 in `container` of `pod`; its output, trimmed.
pub(super) fn python_in_pod(
    plane: &ControlPlane,
    namespace: &str,
    pod: &str,
    container: &str,
    script: &str,
) -> Result<String> {
    let output = run(plane
        .kubectl()?
        .args([
            "exec", "-n", namespace, pod, "-c", container, "--", "python3", "-c",
        ])
        .arg(script))?;
    Ok(output.trim().to_owned())
}

/// In Istio's mesh (sidecars on eddy's pods and Functions, STRICT mTLS in the chart's function
/// namespaces, eddy's AuthorizationPolicies): an event reaches a Function through the
/// event-bus's, the dispatcher's and the Function's sidecars, and a call through the gateway's;
/// the Function sees who called from the client certificate its sidecar verified (the
/// dispatcher's, the gateway's SPIFFE identity), also for a call from outside through Istio's
/// ingress gateway and the chart's Gateway and VirtualService. A pod without a sidecar is
/// refused by mTLS, and a meshed pod that is not among the Function's callers gets Istio's
/// 403; planted breaks show those two checks can fail.
#[tokio::test]
async fn in_the_mesh_only_the_gateway_and_the_dispatcher_reach_a_function_over_mutual_tls()
-> Result<()> {
    let plane = installed()?;
    sidecars_where_the_chart_wants_them(plane)?;
    sidecars_close_idle_connections_to_their_container_first(plane)?;
    let name = format!("peer-{}", &uuid::Uuid::new_v4().simple().to_string()[..6]);
    let function = format!(
        r#"
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {{name: {name}}}
spec:
  runtime: python312
  resourceConfiguration: {{function: {{profile: XS}}}}
  source:
    inline:
      source: |
        def main(event, context):
            # Set by the sidecar from the client certificate it verified.
            xfcc = event["extensions"]["request"].headers.get("x-forwarded-client-cert", "")
            caller = xfcc.split("URI=")[-1] if "URI=" in xfcc else "no client certificate"
            print("peer", event.get("ce-id"), "from", caller, flush=True)
            return "called by " + caller
---
apiVersion: eddy.dev/v1alpha1
kind: Subscription
metadata: {{name: {name}}}
spec:
  sink: http://{name}.{MESH_FUNCTIONS}.svc.cluster.local
  types: [mesh.peer.v1]
"#
    );
    apply(plane, MESH_FUNCTIONS, &function)?;
    running(plane, MESH_FUNCTIONS, &name, Duration::from_secs(120)).await?;
    subscriptions_ready(plane, MESH_FUNCTIONS, &[&name]).await?;
    let id = format!("peer-{}", uuid::Uuid::new_v4().simple());
    let status = publish(plane, "mesh-test", "mesh.peer.v1", &id, "{}")?;
    ensure!(
        matches!(status, 200 | 202 | 204),
        "publish answered {status}"
    );
    let dispatcher = format!("spiffe://cluster.local/ns/{SYSTEM}/sa/{RELEASE}-dispatcher");
    pod_log_shows(
        plane,
        MESH_FUNCTIONS,
        &name,
        &format!("peer {id} from {dispatcher}"),
    )
    .await?;

    let gateway = format!("spiffe://cluster.local/ns/{SYSTEM}/sa/{RELEASE}-gateway");
    let (status, body) = call(
        plane,
        SYSTEM,
        "eddy-gateway",
        &format!("/{MESH_FUNCTIONS}/{name}/"),
        Some("{}"),
    )?;
    ensure!(
        status == 200 && body.contains(&format!("called by {gateway}")),
        "through the gateway: {status} {body}"
    );

    // From outside the cluster, as a user's callers come: Istio's ingress gateway, the chart's
    // Istio Gateway and VirtualService, eddy's gateway.
    run(plane.kubectl()?.args([
        "rollout",
        "status",
        "deployment/istio-ingressgateway",
        "-n",
        "istio-system",
        "--timeout=180s",
    ]))?;
    let ingress = kubectl_json(
        plane,
        &[
            "get",
            "service",
            "istio-ingressgateway",
            "-n",
            "istio-system",
        ],
    )?;
    let ingress = ingress["spec"]["clusterIP"]
        .as_str()
        .context("the ingress gateway's ClusterIP")?;
    let mut answer = (0, String::new());
    let routed = eventually(
        "a route through the ingress gateway",
        Duration::from_secs(60),
        || {
            answer = curl(
                &format!("http://{ingress}/{MESH_FUNCTIONS}/{name}/"),
                &["content-type: application/json".to_owned()],
                Some("{}"),
            )
            .unwrap_or_default();
            let routed = answer.0 == 200;
            async move { routed }
        },
    )
    .await;
    routed.with_context(|| format!("the last answer: {answer:?}"))?;
    ensure!(
        answer.1.contains(&format!("called by {gateway}")),
        "through the ingress gateway: {answer:?}"
    );

    let outside = namespace(plane, "outside")?;
    let url = format!("http://{name}.{MESH_FUNCTIONS}.svc.cluster.local/");
    let plain = client_pod(plane, &outside, false)?;
    let answer = post_from_pod(plane, &outside, &plain, &url)?;
    ensure!(
        answer.starts_with("refused:"),
        "a pod without a sidecar got an answer from a STRICT function: {answer}"
    );
    let meshed = client_pod(plane, &outside, true)?;
    let answer = post_from_pod(plane, &outside, &meshed, &url)?;
    ensure!(
        answer == "403 RBAC: access denied",
        "a meshed pod outside the callers: {answer}"
    );
    planted_breaks_change_the_answers(plane, &outside, (&plain, &meshed), &url).await?;
    run(plane
        .kubectl()?
        .args(["delete", "-n", MESH_FUNCTIONS, "--wait=false"])
        .arg(format!("function.eddy.dev/{name}"))
        .arg(format!("subscription.eddy.dev/{name}")))?;
    delete_namespace(plane, &outside)?;
    Ok(())
}

/// In the mesh, Istio's injector rewrites a Function's probes to go through its sidecar's
/// agent (port 15020, `/app-health/...`); they still tell the truth. A handler that holds the
/// runtime's only server thread makes the health check fail: Running leaves True (Unknown,
/// `DeploymentPending`, as Kyma says while a Deployment is not available), and turns True
/// again once the thread is free or the liveness probe has restarted the container.
#[tokio::test]
async fn a_function_s_probes_rewritten_by_the_mesh_still_drive_running() -> Result<()> {
    let plane = installed()?;
    let namespace = namespace(plane, "probes")?;
    apply(
        plane,
        &namespace,
        r#"
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {name: hog}
spec:
  runtime: python312
  resourceConfiguration: {function: {profile: XS}}
  # One server thread: while a call holds it, /healthz waits too.
  env: [{name: CHERRYPY_NUMTHREADS, value: "1"}]
  source:
    inline:
      source: |
        import time
        def main(event, context):
            time.sleep(40)
            return "done"
"#,
    )?;
    running(plane, &namespace, "hog", Duration::from_secs(120)).await?;
    let pods = kubectl_json(
        plane,
        &[
            "get",
            "pods",
            "-n",
            &namespace,
            "-l",
            "eddy.dev/function=hog",
        ],
    )?;
    let function = pods["items"][0]["spec"]["containers"]
        .as_array()
        .context("containers")?
        .iter()
        .find(|container| container["name"] == "function")
        .context("the function container")?
        .clone();
    for probe in ["readinessProbe", "livenessProbe"] {
        let get = &function[probe]["httpGet"];
        ensure!(
            get["port"] == 15020
                && get["path"]
                    .as_str()
                    .is_some_and(|path| path.starts_with("/app-health/function/")),
            "{probe} not rewritten by the injector: {get}"
        );
    }
    let url = format!("{}/", service_url(plane, &namespace, "hog")?);
    let hogging = std::thread::spawn(move || curl(&url, &[], None));
    wait_for_function(
        plane,
        "functions.eddy.dev",
        &namespace,
        "hog",
        Duration::from_secs(60),
        |function| condition(function, "Running").is_some_and(|(status, _, _)| status != "True"),
    )
    .await
    .context("Running stayed True while the health check failed")?;
    running(plane, &namespace, "hog", Duration::from_secs(120))
        .await
        .context("Running did not turn True again")?;
    let _ = hogging.join();
    delete_namespace(plane, &namespace)?;
    Ok(())
}

/// The mesh checks above can fail: with the chart's PeerAuthentication left out of the
/// function namespace, plaintext gets through mTLS (the sidecar's RBAC then answers it); with
/// the chart's AuthorizationPolicy widened, the meshed outsider gets the Function's answer.
/// Each break is undone before the next, and the namespace left as the chart made it.
async fn planted_breaks_change_the_answers(
    plane: &ControlPlane,
    outside: &str,
    (plain, meshed): (&str, &str),
    url: &str,
) -> Result<()> {
    let strict = format!("{RELEASE}-strict");
    let saved = kubectl_json(
        plane,
        &["get", "peerauthentication", &strict, "-n", MESH_FUNCTIONS],
    )?;
    run(plane.kubectl()?.args([
        "delete",
        "peerauthentication",
        &strict,
        "-n",
        MESH_FUNCTIONS,
    ]))?;
    let mut answer = String::new();
    let through = eventually(
        "plaintext through without STRICT",
        Duration::from_secs(30),
        || {
            answer = post_from_pod(plane, outside, plain, url).unwrap_or_default();
            let through = !answer.starts_with("refused:");
            async move { through }
        },
    )
    .await;
    let mut restored = saved.clone();
    restored["metadata"] = serde_json::json!({
        "name": saved["metadata"]["name"],
        "namespace": saved["metadata"]["namespace"],
        "labels": saved["metadata"]["labels"],
        "annotations": saved["metadata"]["annotations"],
    });
    run_with_input(
        plane.kubectl()?.args(["create", "-f", "-"]),
        &restored.to_string(),
    )?;
    through.with_context(|| format!("without the PeerAuthentication, still: {answer}"))?;
    eventually("plaintext refused again", Duration::from_secs(30), || {
        let refused = post_from_pod(plane, outside, plain, url)
            .is_ok_and(|answer| answer.starts_with("refused:"));
        async move { refused }
    })
    .await?;

    let policy = format!("{RELEASE}-functions");
    let patch_policy = |patch: &str| -> Result<String> {
        run(plane.kubectl()?.args([
            "patch",
            "authorizationpolicy",
            &policy,
            "-n",
            MESH_FUNCTIONS,
            "--type",
            "json",
            "-p",
            patch,
        ]))
    };
    patch_policy(r#"[{"op": "add", "path": "/spec/rules/-", "value": {}}]"#)?;
    let widened = eventually(
        "the outsider through a widened policy",
        Duration::from_secs(30),
        || {
            answer = post_from_pod(plane, outside, meshed, url).unwrap_or_default();
            let through = answer.starts_with("200 ");
            async move { through }
        },
    )
    .await;
    let rules = kubectl_json(
        plane,
        &["get", "authorizationpolicy", &policy, "-n", MESH_FUNCTIONS],
    )?["spec"]["rules"]
        .as_array()
        .map_or(0, Vec::len);
    patch_policy(&format!(
        r#"[{{"op": "remove", "path": "/spec/rules/{}"}}]"#,
        rules.saturating_sub(1)
    ))?;
    widened.with_context(|| format!("with the policy widened, still: {answer}"))?;
    eventually(
        "the outsider refused again",
        Duration::from_secs(30),
        || {
            let refused = post_from_pod(plane, outside, meshed, url)
                .is_ok_and(|answer| answer == "403 RBAC: access denied");
            async move { refused }
        },
    )
    .await?;
    Ok(())
}

/// Istio's injector gave the gateway's and the dispatcher's pods a native sidecar (an init
/// container that keeps running), the event-bus's the classic one its chart asks for (a
/// container: it exits before the event-bus stops listening), and left the controller (it
/// talks to the API server only) and NATS (its clients bypass the proxies) without one.
fn sidecars_where_the_chart_wants_them(plane: &ControlPlane) -> Result<()> {
    let pods = kubectl_json(plane, &["get", "pods", "-n", SYSTEM])?;
    for pod in pods["items"].as_array().context("pods")? {
        let component = pod["metadata"]["labels"]["app.kubernetes.io/component"]
            .as_str()
            .unwrap_or_default();
        let proxy_in = ["initContainers", "containers"].into_iter().find(|list| {
            pod["spec"][list]
                .as_array()
                .is_some_and(|containers| containers.iter().any(|c| c["name"] == "istio-proxy"))
        });
        let wanted = match component {
            "gateway" | "dispatcher" => Some("initContainers"),
            "event-bus" => Some("containers"),
            _ => None,
        };
        ensure!(
            proxy_in == wanted,
            "pod {} ({component}): its sidecar among {proxy_in:?}, wanted among {wanted:?}",
            pod["metadata"]["name"]
        );
    }
    Ok(())
}

/// Each sidecar of eddy's pods keeps an idle connection to its container for the chart's
/// `istio.inboundIdleTimeout` (5 s), less than the container's own idle close (10 s), read
/// from the configuration istiod sent it: the chart's Sidecar reached Envoy.
fn sidecars_close_idle_connections_to_their_container_first(plane: &ControlPlane) -> Result<()> {
    for component in ["event-bus", "gateway", "dispatcher"] {
        let pod = a_pod(
            plane,
            SYSTEM,
            &format!("app.kubernetes.io/component={component}"),
        )?;
        let dump = run(plane.kubectl()?.args([
            "exec",
            "-n",
            SYSTEM,
            &pod,
            "-c",
            "istio-proxy",
            "--",
            "pilot-agent",
            "request",
            "GET",
            "config_dump?resource=dynamic_active_clusters",
        ]))?;
        let dump: Value = serde_json::from_str(&dump).context("Envoy's config dump")?;
        let inbound: Vec<(String, Value)> = dump["configs"]
            .as_array()
            .context("configs")?
            .iter()
            .filter_map(|config| {
                let cluster = &config["cluster"];
                let name = cluster["name"].as_str()?;
                name.starts_with("inbound|").then(|| {
                    let idle = cluster["typed_extension_protocol_options"]
                        ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
                        ["common_http_protocol_options"]["idle_timeout"]
                        .clone();
                    (name.to_owned(), idle)
                })
            })
            .collect();
        ensure!(
            !inbound.is_empty() && inbound.iter().all(|(_, idle)| idle == "5s"),
            "{component} ({pod}): inbound clusters and their idle timeouts {inbound:?}"
        );
    }
    Ok(())
}
