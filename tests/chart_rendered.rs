//! The Helm chart rendered by Helm itself and every object checked against the Kubernetes
//! schemas of the lowest version the chart supports (`kubeVersion` in Chart.yaml), as are the
//! objects `eddy controller render` prints. Needs what `scripts/setup --tests` installs: Helm 4
//! and kubectl in `.tools/bin`, kubernetes-validate in `.tools/venv/bin`.
//!
//! The chart has no dependency to fetch: NATS is its own StatefulSet (templates/nats.yaml).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
};

use eddy_testing::control_plane::{self, repo};
use serde::Deserialize as _;
use serde_yaml_ng::Value;

fn tool(relative: &str) -> PathBuf {
    control_plane::tool(relative).unwrap()
}

fn run(command: &mut Command) -> String {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{command:?} failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    stdout + &stderr
}

/// The lowest Kubernetes version the chart claims (`kubeVersion: ">=1.30.0-0"` → `1.30.0`).
fn lowest_kubernetes_version() -> String {
    let chart: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(repo().join("charts/eddy/Chart.yaml")).unwrap(),
    )
    .unwrap();
    let constraint = chart["kubeVersion"]
        .as_str()
        .expect("Chart.yaml names kubeVersion");
    let version = constraint
        .trim_start_matches(">=")
        .trim()
        .split('-')
        .next()
        .unwrap()
        .to_owned();
    assert!(
        version.split('.').count() == 3 && version.split('.').all(|p| p.parse::<u32>().is_ok()),
        "kubeVersion {constraint:?} gives {version:?}"
    );
    version
}

fn chart_copy(dir: &Path) -> PathBuf {
    control_plane::chart_copy(dir).unwrap()
}

/// Checks `objects` (a multi-document YAML file) with kubernetes-validate --strict against
/// `version`. Objects of kinds Kubernetes has no schema for (Istio's, the Prometheus
/// Operator's) are only allowed from `custom_groups`; returns the count of each kind.
fn validate(objects: &Path, version: &str, custom_groups: &[&str]) -> BTreeMap<String, usize> {
    let output = run(Command::new(tool("venv/bin/kubernetes-validate"))
        .args(["--strict", "--kubernetes-version", version])
        .arg(objects));
    let mut kinds = BTreeMap::new();
    for line in output.lines() {
        if line.starts_with("INFO") && line.contains(" passed for resource ") {
            let resource = line.split(" passed for resource ").nth(1).unwrap();
            let kind = resource.split('/').next().unwrap().to_owned();
            *kinds.entry(kind).or_insert(0) += 1;
        } else if let Some(rest) = line.split("Couldn't find schema for kind ").nth(1) {
            // "<Kind> with api version <group>/<version> for kubernetes version …"
            let kind = rest.split(' ').next().unwrap();
            let api_version = rest
                .split("with api version ")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap();
            let group = api_version.split('/').next().unwrap();
            assert!(
                custom_groups.contains(&group),
                "{kind} ({api_version}) has no Kubernetes schema and is not an expected custom kind: a typo in apiVersion?\n{output}"
            );
            *kinds.entry(format!("{kind} ({group})")).or_insert(0) += 1;
        } else {
            assert!(
                !line.starts_with("ERROR") && !line.contains("did not validate"),
                "{line}\n{output}"
            );
        }
    }
    let documents = std::fs::read_to_string(objects)
        .unwrap()
        .split("\n---")
        .filter(|doc| doc.lines().any(|line| line.starts_with("kind:")))
        .count();
    assert_eq!(
        kinds.values().sum::<usize>(),
        documents,
        "every rendered object was checked: {kinds:?}\n{output}"
    );
    kinds
}

/// Lints and renders the chart with `values` (files under charts/eddy/ci, or none) and checks
/// every object, the CRDs included; returns the count of each kind.
fn render_chart(values: Option<&str>, extra: &[&str]) -> BTreeMap<String, usize> {
    render_chart_text(values, extra).0
}

/// [`render_chart`], and the rendered YAML.
fn render_chart_text(values: Option<&str>, extra: &[&str]) -> (BTreeMap<String, usize>, String) {
    let dir = tempfile::tempdir().unwrap();
    let chart = chart_copy(dir.path());
    let mut value_args: Vec<String> = Vec::new();
    if let Some(values) = values {
        value_args.push("--values".to_owned());
        value_args.push(chart.join("ci").join(values).to_string_lossy().into_owned());
    }
    for set in extra {
        value_args.push("--set".to_owned());
        value_args.push((*set).to_owned());
    }
    let helm = tool("bin/helm");
    let version = lowest_kubernetes_version();
    run(Command::new(&helm)
        .args(["lint", "--strict", "--kube-version", &version])
        .arg(&chart)
        .args(&value_args));
    let rendered = run(Command::new(&helm)
        .args([
            "template",
            "eddy",
            "--namespace",
            "eddy-system",
            "--include-crds",
        ])
        .args(["--kube-version", &version])
        .arg(&chart)
        .args(&value_args));
    let objects = dir.path().join("rendered.yaml");
    std::fs::write(&objects, &rendered).unwrap();
    let kinds = validate(
        &objects,
        &version,
        &[
            "security.istio.io",
            "networking.istio.io",
            "gateway.networking.k8s.io",
            "monitoring.coreos.com",
        ],
    );
    (kinds, rendered)
}

/// Who each rendered Istio AuthorizationPolicy lets in, by policy name: the principals and
/// namespaces of its rules' sources, and whether a rule without a source opens more than the
/// probes (GET of /healthz, /readyz, /metrics).
fn authorization_policies(rendered: &str) -> BTreeMap<String, (Vec<String>, Vec<String>)> {
    let mut policies = BTreeMap::new();
    for document in rendered.split("\n---") {
        let Ok(object) = serde_yaml_ng::from_str::<serde_json::Value>(document) else {
            continue;
        };
        if object["kind"] != "AuthorizationPolicy" {
            continue;
        }
        assert_eq!(object["spec"]["action"], "ALLOW", "{object:#}");
        let (mut principals, mut namespaces) = (Vec::new(), Vec::new());
        for rule in object["spec"]["rules"].as_array().unwrap() {
            let Some(sources) = rule["from"].as_array() else {
                // Open to anyone: only the probes may be.
                for operation in rule["to"].as_array().unwrap() {
                    assert_eq!(
                        operation["operation"]["methods"],
                        serde_json::json!(["GET"]),
                        "{object:#}"
                    );
                    for path in operation["operation"]["paths"].as_array().unwrap() {
                        let path = path.as_str().unwrap();
                        assert!(
                            ["/healthz", "/readyz", "/metrics"].contains(&path),
                            "{path} open to anyone: {object:#}"
                        );
                    }
                }
                continue;
            };
            for source in sources {
                let strings = |key: &str| -> Vec<String> {
                    source["source"][key]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|v| v.as_str().unwrap().to_owned())
                        .collect()
                };
                principals.extend(strings("principals"));
                namespaces.extend(strings("namespaces"));
            }
        }
        principals.sort();
        namespaces.sort();
        let name = object["metadata"]["name"].as_str().unwrap().to_owned();
        policies.insert(name, (principals, namespaces));
    }
    policies
}

fn count(kinds: &BTreeMap<String, usize>, kind: &str) -> usize {
    kinds.get(kind).copied().unwrap_or(0)
}

#[test]
fn the_chart_renders_valid_objects_with_its_default_values() {
    let (kinds, rendered) = render_chart_text(None, &[]);
    assert_eq!(count(&kinds, "customresourcedefinition"), 2, "{kinds:?}");
    // NATS, the chart's own: three clustered JetStream servers on their own volumes, and the
    // components pointed at its Service.
    assert_eq!(count(&kinds, "statefulset"), 1, "{kinds:?}");
    assert!(
        rendered.contains("replicas: 3\n  serviceName: eddy-nats-headless"),
        "{rendered}"
    );
    assert!(
        rendered.contains("@eddy-nats-2.eddy-nats-headless.eddy-system.svc.cluster.local:6222"),
        "the cluster routes name every server"
    );
    assert!(
        rendered.contains("volumeClaimTemplates:"),
        "a PVC per server"
    );
    assert!(
        rendered.contains("nats://eddy-nats.eddy-system.svc.cluster.local:4222"),
        "the components connect to the chart's NATS"
    );
    // Who gets in, read from the policies' rules: functions take only the dispatcher and the
    // gateway, the event-bus only the dispatcher and the function namespaces, the gateway only
    // the ingress gateway; anything else open is a probe.
    let sa = |name: &str| format!("cluster.local/ns/eddy-system/sa/{name}");
    let policies = authorization_policies(&rendered);
    let expected: BTreeMap<String, (Vec<String>, Vec<String>)> = [
        (
            "eddy-functions",
            vec![sa("eddy-dispatcher"), sa("eddy-gateway")],
            vec![],
        ),
        (
            "eddy-event-bus",
            vec![sa("eddy-dispatcher")],
            vec!["default".to_owned()],
        ),
        (
            "eddy-gateway",
            vec![
                "cluster.local/ns/istio-system/sa/istio-ingressgateway-service-account".to_owned(),
            ],
            vec![],
        ),
        // The dispatcher's admin API: nobody in the mesh unless values name them.
        ("eddy-dispatcher", vec![], vec![]),
    ]
    .into_iter()
    .map(|(name, principals, namespaces)| (name.to_owned(), (principals, namespaces)))
    .collect();
    assert_eq!(policies, expected);
    assert_eq!(
        count(&kinds, "deployment"),
        4,
        "controller, event-bus, dispatcher, gateway: {kinds:?}"
    );
    assert_eq!(count(&kinds, "role"), 1, "the Lease's Role: {kinds:?}");
    assert_eq!(
        count(&kinds, "poddisruptionbudget"),
        4,
        "the event-bus's, the gateway's, the two controllers' and NATS's: {kinds:?}"
    );
    assert_eq!(
        count(&kinds, "AuthorizationPolicy (security.istio.io)"),
        4,
        "event-bus, functions, gateway, dispatcher: {kinds:?}"
    );
    nats_takes_only_eddy_s_users(&rendered);
    the_dispatcher_s_admin_api_asks_for_its_token(&rendered);
    assert_eq!(
        count(&kinds, "Gateway (networking.istio.io)"),
        1,
        "{kinds:?}"
    );
    assert_eq!(
        count(&kinds, "VirtualService (networking.istio.io)"),
        1,
        "{kinds:?}"
    );
}

#[test]
fn the_chart_renders_valid_objects_for_an_external_nats() {
    let kinds = render_chart(Some("external-nats-values.yaml"), &[]);
    assert_eq!(count(&kinds, "deployment"), 4, "{kinds:?}");
    assert_eq!(
        count(&kinds, "statefulset"),
        0,
        "no NATS of the chart's: {kinds:?}"
    );
}

/// charts/eddy/ci/real-node-values.yaml: one node, no registry (what the real-pod tests
/// install): the chart's three NATS servers, clustered, each on an emptyDir, with streams at
/// R3, images from the node, and the egress proxy passed to the controller when set.
#[test]
fn the_chart_renders_valid_objects_for_one_real_node() {
    let (kinds, rendered) = render_chart_text(
        Some("real-node-values.yaml"),
        &[
            "controller.egress.proxy=http://10.0.0.1:3128",
            "trustedCA.configMap=corp-ca",
        ],
    );
    assert_eq!(count(&kinds, "statefulset"), 1, "{kinds:?}");
    assert_eq!(count(&kinds, "authorizationpolicy"), 0, "{kinds:?}");
    assert!(
        rendered.contains("replicas: 3\n  serviceName: eddy-nats-headless"),
        "{rendered}"
    );
    assert!(
        !rendered.contains("volumeClaimTemplates:"),
        "an emptyDir, no PVC"
    );
    assert!(rendered.contains("cluster {"), "three servers, clustered");
    assert!(
        rendered.contains("image: localhost/nats:local"),
        "{rendered}"
    );
    assert!(
        rendered.contains("image: localhost/eddy:0.1.0"),
        "{rendered}"
    );
    assert!(
        rendered.contains("{name: EDDY_STREAM_REPLICAS, value: \"3\"}"),
        "streams at R3"
    );
    assert!(rendered.contains("{name: EDDY_EGRESS_PROXY, value: \"http://10.0.0.1:3128\"}"));
    // The trusted CA reaches the two components that make outbound TLS calls, with the image's
    // public roots kept (rustls reads SSL_CERT_FILE and SSL_CERT_DIR together).
    assert_eq!(
        rendered
            .matches("{name: SSL_CERT_DIR, value: /etc/eddy/trusted-ca}")
            .count(),
        2,
        "gateway and dispatcher"
    );
    assert_eq!(rendered.matches("name: corp-ca\n").count(), 2, "{rendered}");
    // Kyma's kinds served: both publisher names answer, and Kyma Functions get the current one.
    for alias in ["eventing-publisher-proxy", "eventing-event-publisher-proxy"] {
        assert!(
            rendered.contains(&format!("name: {alias}\n  namespace: kyma-system")),
            "{alias}"
        );
    }
    assert!(rendered.contains(
        "{name: EDDY_KYMA_PUBLISHER_URL, value: \"http://eventing-publisher-proxy.kyma-system.svc.cluster.local/publish\"}"
    ));
}

#[test]
fn the_chart_renders_valid_objects_serving_kyma_s_api_groups() {
    let kinds = render_chart(Some("kyma-compatibility-values.yaml"), &[]);
    // Kyma's Function, Subscription, APIRule and RateLimit CRDs beside eddy's, the kyma-system
    // namespace and Kyma's two publisher addresses in it.
    assert_eq!(count(&kinds, "customresourcedefinition"), 6, "{kinds:?}");
    assert_eq!(count(&kinds, "namespace"), 1, "{kinds:?}");
    assert_eq!(count(&kinds, "service"), 5, "{kinds:?}");
    let defaults = render_chart(None, &[]);
    assert_eq!(
        count(&defaults, "customresourcedefinition"),
        2,
        "{defaults:?}"
    );
    assert_eq!(count(&defaults, "namespace"), 0, "{defaults:?}");
}

/// The external authorizers of APIRules' `extAuth` rules: one ConfigMap, read as the gateway
/// and the controller read it, given to both (their APIRule decisions must agree), and a
/// changed list restarts them.
#[test]
fn the_chart_gives_the_gateway_and_the_controller_the_extension_providers() {
    let (_, rendered) = render_chart_text(Some("extension-providers-values.yaml"), &[]);
    let objects: Vec<serde_json::Value> = rendered
        .split("\n---")
        .filter_map(|document| serde_yaml_ng::from_str(document).ok())
        .collect();
    let providers = objects
        .iter()
        .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == "eddy-extension-providers")
        .expect("the extension providers' ConfigMap");
    let providers = eddy_model::ext_authz::ExtensionProviders::parse(
        providers["data"]["providers.yaml"].as_str().unwrap(),
    )
    .unwrap();
    let oauth2_proxy = providers.authorizer("oauth2-proxy").unwrap();
    assert_eq!(
        oauth2_proxy.base_url,
        "http://oauth2-proxy.oauth2-proxy.svc.cluster.local:80"
    );
    for component in ["gateway", "controller"] {
        let deployment = objects
            .iter()
            .find(|o| {
                o["kind"] == "Deployment" && o["metadata"]["name"] == format!("eddy-{component}")
            })
            .unwrap();
        let pod = &deployment["spec"]["template"]["spec"];
        let container = &pod["containers"][0];
        let env = container["env"].as_array().unwrap();
        assert!(
            env.iter().any(|e| e["name"] == "EDDY_EXTENSION_PROVIDERS"
                && e["value"] == "/etc/eddy/extension-providers/providers.yaml"),
            "{component}: {container:#}"
        );
        assert!(
            pod["volumes"]
                .as_array()
                .unwrap()
                .iter()
                .any(|v| v["configMap"]["name"] == "eddy-extension-providers"),
            "{component}: {pod:#}"
        );
        assert!(
            deployment["spec"]["template"]["metadata"]["annotations"]
                ["checksum/extension-providers"]
                .is_string(),
            "{component}: a changed provider list restarts it"
        );
    }
}

#[test]
fn the_chart_renders_valid_objects_exposing_functions_through_the_gateway_api() {
    let kinds = render_chart(Some("gateway-api-values.yaml"), &[]);
    assert_eq!(
        count(&kinds, "HTTPRoute (gateway.networking.k8s.io)"),
        1,
        "{kinds:?}"
    );
    assert!(
        !kinds
            .keys()
            .any(|kind| kind.starts_with("Gateway (") || kind.starts_with("VirtualService (")),
        "no Istio Gateway or VirtualService: {kinds:?}"
    );
    assert_eq!(
        count(&kinds, "AuthorizationPolicy (security.istio.io)"),
        5,
        "event-bus, functions, gateway, dispatcher, and price-quote's named caller: {kinds:?}"
    );
    assert_eq!(
        count(&kinds, "horizontalpodautoscaler"),
        1,
        "a fixed gateway: {kinds:?}"
    );
}

/// Every rendered object.
fn objects(rendered: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(rendered)
        .map(|document| Value::deserialize(document).unwrap())
        .filter(|object| !object.is_null())
        .collect()
}

/// The rendered object of `kind` named `name`.
fn object<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|object| object["kind"] == kind && object["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// A container's env entry `name` in the Deployment `deployment`.
fn env_of<'a>(objects: &'a [Value], deployment: &str, name: &str) -> Option<&'a Value> {
    object(objects, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_sequence()?
        .iter()
        .find(|entry| entry["name"] == name)
}

/// The probe's first finding, closed in the chart: its NATS takes only eddy's users, each with
/// the permissions `eddy up` gives it (files/nats-users.json, kept equal to the code by a unit
/// test), the routes only the route user; the components get their own password from the
/// Secret by reference; the monitor port is on no Service; a NetworkPolicy lets only the
/// event-bus and the dispatcher reach the client port.
fn nats_takes_only_eddy_s_users(rendered: &str) {
    let objects = objects(rendered);
    let secret = object(&objects, "Secret", "eddy-nats-auth");
    let auth = secret["stringData"]["auth.conf"].as_str().unwrap();
    let users: serde_json::Value =
        serde_json::from_str(include_str!("../charts/eddy/files/nats-users.json")).unwrap();
    for user in users["users"].as_array().unwrap() {
        let name = user["user"].as_str().unwrap();
        let password = secret["stringData"][user["secretKey"].as_str().unwrap()]
            .as_str()
            .unwrap();
        assert!(password.len() >= 32, "{name}'s password: {password:?}");
        let subjects = |list: &serde_json::Value| {
            list.as_array()
                .unwrap()
                .iter()
                .map(|subject| format!("{subject}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let line = format!(
            "{{user: \"{name}\", password: \"{password}\", permissions: {{publish: {{allow: [{}]}}, subscribe: {{allow: [{}]}}}}}}",
            subjects(&user["publish"]),
            subjects(&user["subscribe"]),
        );
        assert!(auth.contains(&line), "{line}\nnot in\n{auth}");
    }
    assert_eq!(auth.matches("{user:").count(), 3, "{auth}");
    let cluster = secret["stringData"]["cluster.conf"].as_str().unwrap();
    let route = secret["stringData"]["route"].as_str().unwrap();
    assert!(
        cluster.contains(&format!("user: eddy-route\n    password: \"{route}\""))
            && cluster.contains(&format!(
                "nats://eddy-route:{route}@eddy-nats-2.eddy-nats-headless"
            )),
        "{cluster}"
    );
    let config = object(&objects, "ConfigMap", "eddy-nats")["data"]["nats.conf"]
        .as_str()
        .unwrap();
    assert!(
        config.contains("include ./auth/auth.conf")
            && config.contains("include ./auth/cluster.conf"),
        "{config}"
    );
    assert!(
        !config.contains("routes:"),
        "no route without its password: {config}"
    );
    for (deployment, key, user) in [
        ("eddy-event-bus", "event-bus", "eddy-event-bus"),
        ("eddy-dispatcher", "dispatcher", "eddy-dispatcher"),
    ] {
        assert_eq!(
            env_of(&objects, deployment, "EDDY_NATS_USER").unwrap()["value"],
            user
        );
        let password = env_of(&objects, deployment, "EDDY_NATS_PASSWORD").unwrap();
        assert_eq!(
            password["valueFrom"]["secretKeyRef"]["name"],
            "eddy-nats-auth"
        );
        assert_eq!(password["valueFrom"]["secretKeyRef"]["key"], key);
        assert_eq!(
            env_of(&objects, deployment, "EDDY_NATS_INBOX_PREFIX").unwrap()["value"],
            format!("_INBOX_{user}").as_str()
        );
    }
    for service in objects.iter().filter(|object| object["kind"] == "Service") {
        let ports = service["spec"]["ports"].as_sequence().unwrap();
        assert!(
            !ports.iter().any(|port| port["port"] == 8222),
            "the NATS monitor on Service {}",
            service["metadata"]["name"].as_str().unwrap()
        );
    }
    let policy = object(&objects, "NetworkPolicy", "eddy-nats");
    let rules = policy["spec"]["ingress"].as_sequence().unwrap();
    let client = rules
        .iter()
        .find(|rule| rule["ports"][0]["port"] == "client")
        .unwrap();
    let components: Vec<&str> = client["from"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|peer| {
            peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                .as_str()
                .unwrap()
        })
        .collect();
    assert_eq!(components, ["event-bus", "dispatcher"]);
}

/// The probe's second finding, closed in the chart: the dispatcher reads its admin token from a
/// Secret generated at install, and Prometheus sends it.
fn the_dispatcher_s_admin_api_asks_for_its_token(rendered: &str) {
    let objects = objects(rendered);
    let token = object(&objects, "Secret", "eddy-dispatcher-admin")["stringData"]["token"]
        .as_str()
        .unwrap();
    assert!(token.len() >= 32, "{token:?}");
    assert_eq!(
        env_of(&objects, "eddy-dispatcher", "EDDY_API_TOKEN_FILE").unwrap()["value"],
        "/etc/eddy/admin/token"
    );
    let volumes =
        &object(&objects, "Deployment", "eddy-dispatcher")["spec"]["template"]["spec"]["volumes"];
    assert!(
        volumes
            .as_sequence()
            .unwrap()
            .iter()
            .any(|volume| volume["secret"]["secretName"] == "eddy-dispatcher-admin"),
        "{volumes:?}"
    );
}

/// The Go runtime's knobs in the NATS servers' container, by name.
fn nats_go_env(rendered: &str) -> BTreeMap<String, String> {
    let objects = objects(rendered);
    let nats = object(&objects, "StatefulSet", "eddy-nats");
    nats["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter(|variable| variable["name"].as_str().unwrap().starts_with("GO"))
        .map(|variable| {
            let name = variable["name"].as_str().unwrap().to_owned();
            (name, variable["value"].as_str().unwrap().to_owned())
        })
        .collect()
}

#[test]
fn the_chart_sizes_the_nats_servers_garbage_collector_unless_told_not_to() {
    let (_, rendered) = render_chart_text(None, &[]);
    assert_eq!(
        nats_go_env(&rendered),
        BTreeMap::from([
            ("GOGC".to_owned(), "400".to_owned()),
            ("GOMEMLIMIT".to_owned(), "900MiB".to_owned()),
        ])
    );
    let (_, rendered) = render_chart_text(None, &["nats.gc.percent=", "nats.gc.memoryLimit="]);
    assert_eq!(nats_go_env(&rendered), BTreeMap::new(), "Go's defaults");
}

#[test]
fn the_chart_sets_the_nats_servers_threads_only_when_told() {
    let (_, rendered) = render_chart_text(None, &[]);
    assert!(
        !nats_go_env(&rendered).contains_key("GOMAXPROCS"),
        "Go's default"
    );
    let (_, rendered) = render_chart_text(None, &["nats.goMaxProcs=1"]);
    assert_eq!(
        nats_go_env(&rendered).get("GOMAXPROCS").map(String::as_str),
        Some("1")
    );
}

#[test]
fn the_chart_renders_valid_objects_without_istio() {
    let kinds = render_chart(Some("istio-off-values.yaml"), &[]);
    assert!(
        !kinds.keys().any(|kind| kind.contains("istio")),
        "no Istio objects: {kinds:?}"
    );
    assert_eq!(
        count(&kinds, "poddisruptionbudget"),
        1,
        "one controller replica, no controller PDB: {kinds:?}"
    );
    assert_eq!(count(&kinds, "horizontalpodautoscaler"), 0, "{kinds:?}");
    assert_eq!(
        count(&kinds, "deployment"),
        4,
        "the gateway runs, unexposed: {kinds:?}"
    );
}

#[test]
fn the_chart_renders_valid_objects_with_service_monitors_and_three_function_namespaces() {
    let kinds = render_chart(Some("metrics-values.yaml"), &[]);
    assert_eq!(
        count(&kinds, "ServiceMonitor (monitoring.coreos.com)"),
        3,
        "the event-bus, the dispatcher and the gateway: {kinds:?}"
    );
    assert_eq!(
        count(&kinds, "PodMonitor (monitoring.coreos.com)"),
        3,
        "each function namespace's pods: {kinds:?}"
    );
    assert_eq!(
        count(&kinds, "PeerAuthentication (security.istio.io)"),
        4,
        "eddy's namespace and three function namespaces: {kinds:?}"
    );
}

/// `eddy controller render` prints objects Kubernetes accepts, for the shop examples and for a
/// Kyma Function that uses every field the Kubernetes backend renders.
#[test]
fn controller_render_prints_valid_objects() {
    let dir = tempfile::tempdir().unwrap();
    let kyma = dir.path().join("kyma-function.yaml");
    std::fs::write(
        &kyma,
        r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: every-field
  namespace: shop
spec:
  runtime: nodejs22
  source:
    inline:
      source: "module.exports = { main: () => 'ok' }"
      dependencies: '{"name": "every-field", "dependencies": {"lodash": "4.17.21"}}'
  env:
    - name: GREETING
      value: hello
    - name: API_KEY
      valueFrom:
        secretKeyRef: {name: api, key: key}
    - name: REGION
      valueFrom:
        configMapKeyRef: {name: settings, key: region}
  scaleConfig: {minReplicas: 1, maxReplicas: 5}
  resourceConfiguration:
    function: {profile: M}
    build: {profile: fast}
  secretMounts:
    - {secretName: tls, mountPath: /etc/tls}
  labels: {team: checkout}
  annotations: {owner: checkout@example.com}
  podSecurityContext: {runAsUser: 2000, fsGroup: 2000}
  containerSecurityContext: {readOnlyRootFilesystem: true}
"#,
    )
    .unwrap();
    // A Git source: the build Job fetches it in an init container.
    let repository = dir.path().join("functions");
    std::fs::create_dir_all(repository.join("greet")).unwrap();
    std::fs::write(
        repository.join("greet/handler.js"),
        "module.exports = { main: () => 'hi' }",
    )
    .unwrap();
    for args in [
        &["init", "-q", "-b", "main"][..],
        &["add", "-A"],
        &[
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@example.com",
            "commit",
            "-q",
            "-m",
            "greet",
        ],
    ] {
        run(Command::new("git").arg("-C").arg(&repository).args(args));
    }
    let git = dir.path().join("git-function.yaml");
    std::fs::write(
        &git,
        format!(
            r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: from-git
  namespace: shop
spec:
  runtime: nodejs22
  source:
    gitRepository:
      url: file://{}
      reference: main
      baseDir: greet
"#,
            repository.display()
        ),
    )
    .unwrap();
    let version = lowest_kubernetes_version();
    // Both build modes: image builds have a Job per Function, buildless pods none.
    for build in ["image", "buildless"] {
        for (manifest, functions) in [
            (repo().join("examples/shop"), 3),
            (kyma.clone(), 1),
            (git.clone(), 1),
        ] {
            let rendered = run(Command::new(env!("CARGO_BIN_EXE_eddy"))
                .args(["controller", "render", "--build", build, "-f"])
                .arg(&manifest));
            let objects = dir.path().join("rendered.yaml");
            std::fs::write(&objects, rendered).unwrap();
            let kinds = validate(&objects, &version, &[]);
            let jobs = if build == "image" { functions } else { 0 };
            for (kind, wanted) in [
                ("configmap", functions),
                ("job", jobs),
                ("deployment", functions),
                ("service", functions),
            ] {
                assert_eq!(
                    count(&kinds, kind),
                    wanted,
                    "{build} {}: {kinds:?}",
                    manifest.display()
                );
            }
        }
    }
}

/// `kubectl apply` warns of the runtimes `eddy apply` warns of: the chart's admission policy
/// names exactly the runtimes eddy's model deprecates, with the model's words.
#[test]
fn the_chart_warns_of_the_runtimes_eddy_deprecates() {
    use eddy_model::resources::Runtime;
    let (_, rendered) = render_chart_text(None, &[]);
    let policy: serde_json::Value = rendered
        .split("\n---")
        .filter_map(|document| serde_yaml_ng::from_str::<serde_json::Value>(document).ok())
        .find(|object| object["kind"] == "ValidatingAdmissionPolicy")
        .expect("the deprecation policy");
    let runtime_rule = &policy["spec"]["validations"][0];
    let expression = runtime_rule["expression"].as_str().unwrap();
    let listed = expression
        .split_once(" in [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| list)
        .unwrap();
    let listed: Vec<&str> = listed
        .split(',')
        .map(|n| n.trim().trim_matches('"'))
        .collect();
    let deprecated: Vec<&str> = Runtime::ALL
        .into_iter()
        .filter(|runtime| runtime.deprecation().is_some())
        .map(Runtime::as_str)
        .collect();
    assert_eq!(listed, deprecated);
    let words = Runtime::Nodejs20.deprecation().unwrap();
    let (before, after) = words.split_once("nodejs20").unwrap();
    let message = runtime_rule["messageExpression"].as_str().unwrap();
    assert!(
        message.contains(before) && message.contains(after),
        "{message} says {words}"
    );
}

/// The sidecars of eddy's own pods close their idle connections to the container before the
/// container does (its header-read timeout, which no component overrides): otherwise a request
/// sent on a connection as the container closes it is answered 503 by the sidecar.
#[test]
fn eddy_s_sidecars_close_idle_connections_to_their_containers_first() {
    let (_, rendered) = render_chart_text(None, &[]);
    let objects = objects(&rendered);
    let sidecars = objects
        .iter()
        .filter(|object| object["kind"] == "Sidecar")
        .count();
    assert_eq!(sidecars, 1, "one Sidecar, for eddy's own pods");
    let sidecar = object(&objects, "Sidecar", "eddy-inbound");
    let selected = &sidecar["spec"]["workloadSelector"]["labels"];
    assert!(
        selected.as_mapping().map(serde_yaml_ng::Mapping::len) == Some(1)
            && selected["app.kubernetes.io/instance"] == "eddy",
        "{selected:?}"
    );
    let idle = humantime::parse_duration(
        sidecar["spec"]["inboundConnectionPool"]["http"]["idleTimeout"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let serve: eddy_platform::net::ServeArgs = eddy_platform::flags::defaults();
    assert!(
        idle < serve.header_read_timeout,
        "{idle:?} against the containers' {:?}",
        serve.header_read_timeout
    );
    let overridden: Vec<&Value> = objects
        .iter()
        .flat_map(|object| {
            object["spec"]["template"]["spec"]["containers"]
                .as_sequence()
                .into_iter()
                .flatten()
        })
        .flat_map(|container| container["env"].as_sequence().into_iter().flatten())
        .filter(|variable| variable["name"] == "EDDY_HEADER_READ_TIMEOUT")
        .collect();
    assert!(overridden.is_empty(), "{overridden:?}");
}
