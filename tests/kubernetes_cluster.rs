//! The Kubernetes mode against a real control plane (`scripts/kube`: etcd, kube-apiserver with
//! RBAC, kube-controller-manager, kube-scheduler, and kwok as the node; no container runs).
//!
//! The chart is installed with `helm install` (from a copy without the NATS subchart, which
//! cannot be fetched here: an external NATS, Istio off), and eddy's controller, dispatcher and
//! gateway run as processes of this test with the env the chart's Deployments give them and a
//! token of their chart ServiceAccount, so the API server enforces exactly the chart's RBAC.
//!
//! The tests run one at a time (a nextest test group, and a lock for `cargo test`): they share
//! one release and each starts its own controller, which holds the chart's Lease while it runs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::OnceLock,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use eddy_model::resources::{Function, validate_function, validate_subscription};
use eddy_testing::{
    control_plane::{ControlPlane, chart_copy, run, run_with_input},
    eventually,
};
use k8s_openapi::api::{
    apps::v1::Deployment,
    autoscaling::v2::HorizontalPodAutoscaler,
    batch::v1::Job,
    coordination::v1::Lease,
    core::v1::{ConfigMap, Pod, Service},
};
use kube::{
    Api, Client,
    api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams},
    core::{ApiResource, GroupVersionKind},
};
use serde_json::{Value, json};

#[path = "../model/tests/cases/mod.rs"]
mod cases;
mod support;

/// The shared release and its namespace.
const RELEASE: &str = "eddy";
const SYSTEM: &str = "eddy-system";
/// The chart's Lease, short so that a test's controller takes over quickly from the last one's.
const LEASE_DURATION: &str = "4s";

/// Values every install here needs: no NATS subchart, no Istio (no mesh CRDs on this cluster).
const BASE_VALUES: &[&str] = &[
    "nats.enabled=false",
    "externalNats.url=nats://127.0.0.1:4222",
    "istio.enabled=false",
    "gateway.expose.mode=none",
    "eventBus.stream.replicas=1",
];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One test at a time in this process (`cargo test`); nextest runs this binary's tests one
/// at a time through its test group.
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: OnceLock<tokio::sync::Mutex<()>> = OnceLock::new();
    LOCK.get_or_init(Default::default).lock().await
}

/// `helm install` of `chart` as `release` in `namespace` with `values` files (under the chart's
/// `ci/`) and `--set`s.
fn helm_install(
    plane: &ControlPlane,
    chart: &Path,
    release: &str,
    namespace: &str,
    values: &[&str],
    sets: &[&str],
) -> Result<String> {
    let mut helm = plane.helm()?;
    helm.args(["install", release]).arg(chart).args([
        "--namespace",
        namespace,
        "--create-namespace",
    ]);
    for file in values {
        helm.arg("--values").arg(chart.join("ci").join(file));
    }
    for set in BASE_VALUES.iter().chain(sets) {
        helm.args(["--set", set]);
    }
    run(&mut helm)
}

/// The release every test but the install test uses: Kyma compatibility on (Kyma's kinds are
/// cluster-wide, so one release per cluster serves them), installed once per control plane.
fn shared_release(plane: &ControlPlane) -> Result<()> {
    let lock = std::fs::File::create(plane.dir().join("release.lock"))?;
    lock.lock()?;
    if run(plane
        .helm()?
        .args(["status", RELEASE, "--namespace", SYSTEM]))
    .is_ok()
    {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let chart = chart_copy(dir.path())?;
    helm_install(
        plane,
        &chart,
        RELEASE,
        SYSTEM,
        &["kyma-compatibility-values.yaml"],
        &[
            &format!("controller.leaseDuration={LEASE_DURATION}"),
            "controller.registry=registry.test:5000/eddy",
            // The build tests watch Jobs; buildless has its own test (EDDY_BUILD on the process).
            "controller.build=image",
            "controller.allowedSinks=http://127.0.0.1:",
        ],
    )?;
    Ok(())
}

/// One of the chart's components (`controller`, `dispatcher`, `gateway`) run as a process with
/// its Deployment's env and a token of its ServiceAccount; killed on drop.
struct Component {
    child: Child,
    name: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Component {
    /// Starts `component` of the shared release; `overrides` replace or add env entries.
    async fn start(
        plane: &ControlPlane,
        admin: &Client,
        component: &str,
        overrides: &[(&str, &str)],
    ) -> Result<Self> {
        let deployments: Api<Deployment> = Api::namespaced(admin.clone(), SYSTEM);
        let name = format!("{RELEASE}-{component}");
        let deployment = deployments.get(&name).await?;
        let pod = deployment
            .spec
            .template
            .spec
            .context("the Deployment's pod spec")?;
        let account = pod
            .service_account_name
            .clone()
            .context("the chart names a ServiceAccount")?;
        let container = &pod.containers[0];
        let identity = format!("{name}-{}", &uuid::Uuid::new_v4().simple().to_string()[..6]);
        let mut env = BTreeMap::new();
        for var in container.env.iter().flatten() {
            let value = match (&var.value, &var.value_from) {
                (Some(value), _) => value.clone(),
                (None, Some(from)) => {
                    match from.field_ref.as_ref().map(|f| f.field_path.as_str()) {
                        Some("metadata.namespace") => SYSTEM.to_owned(),
                        Some("metadata.name") => identity.clone(),
                        other => panic!("{name}: env {} from {other:?}", var.name),
                    }
                }
                (None, None) => String::new(),
            };
            env.insert(var.name.clone(), value);
        }
        for (key, value) in overrides {
            env.insert((*key).to_owned(), (*value).to_owned());
        }
        let dir = tempfile::tempdir()?;
        let kubeconfig = plane
            .service_account_kubeconfig(admin, SYSTEM, &account, &dir.path().join("kubeconfig"))
            .await?;
        let log = dir.path().join("log");
        let child = Command::new(env!("CARGO_BIN_EXE_eddy"))
            .args(container.args.iter().flatten())
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", dir.path())
            .env("TMPDIR", dir.path())
            .envs(&env)
            .env("KUBECONFIG", &kubeconfig)
            .env("EDDY_LOG_FORMAT", "compact")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log)?)
            .stderr(std::fs::File::options().append(true).open(&log)?)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Self {
            child,
            name: identity,
            log,
            _dir: dir,
        })
    }

    /// The `http://host:port` the process says it is ready on (its log's "ready on http://…"),
    /// waited for.
    async fn url(&self) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let log = self.log();
            let address = log.lines().find_map(|line| {
                let rest = line.split("ready on http://").nth(1)?;
                rest.split(['/', ' ', '"']).next().map(str::to_owned)
            });
            if let Some(address) = address {
                return format!("http://{address}");
            }
            assert!(
                Instant::now() < deadline,
                "{} never said it was ready:\n{log}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The process's log so far.
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL, as a node failure would.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait, as a rolling update would.
    fn stop(&mut self) {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }
}

impl Drop for Component {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!("--- {} log ---\n{}", self.name, self.log());
        }
    }
}

/// What every test starts from: the control plane, an admin client, the shared release, and a
/// namespace of the test's own (deleted at the end).
struct Cluster {
    plane: &'static ControlPlane,
    admin: Client,
    namespace: String,
    /// When the test began (its window of the audit log).
    started: chrono::DateTime<chrono::Utc>,
}

impl Cluster {
    async fn new(prefix: &str) -> Self {
        let plane = ControlPlane::shared().unwrap();
        let admin = plane.client().await.unwrap();
        shared_release(plane).unwrap();
        let namespace = plane.namespace(&admin, prefix).await.unwrap();
        Self {
            plane,
            admin,
            namespace,
            started: chrono::Utc::now(),
        }
    }

    /// The chart's RBAC let its components do everything they tried during this test: the
    /// audit log has no request of the chart's ServiceAccounts that the authorizer forbade
    /// since the test began (a 403 for another reason, such as a namespace being deleted, is
    /// not RBAC's).
    fn assert_no_rbac_refusal(&self) {
        let refused: Vec<String> = audit_events(self.plane)
            .iter()
            .filter(|event| received(event) >= self.started)
            .filter(|event| event["annotations"]["authorization.k8s.io/decision"] == "forbid")
            .map(|event| {
                format!(
                    "{} ({})",
                    describe(event),
                    event["annotations"]["authorization.k8s.io/reason"]
                )
            })
            .collect();
        assert!(
            refused.is_empty(),
            "the chart's RBAC refused requests:\n{}",
            refused.join("\n")
        );
    }

    /// The chart's `component` with `overrides`, as a process.
    async fn component(&self, component: &str, overrides: &[(&str, &str)]) -> Component {
        Component::start(self.plane, &self.admin, component, overrides)
            .await
            .unwrap()
    }

    async fn controller(&self) -> Component {
        Component::start(
            self.plane,
            &self.admin,
            "controller",
            &[("EDDY_API_ADDR", "127.0.0.1:0")],
        )
        .await
        .unwrap()
    }

    fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
        K::DynamicType: Default,
    {
        Api::namespaced(self.admin.clone(), &self.namespace)
    }

    fn dynamic(&self, api_version: &str, kind: &str) -> Api<DynamicObject> {
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, kind));
        Api::namespaced_with(self.admin.clone(), &self.namespace, &resource)
    }

    /// `kubectl apply --server-side` of `yaml` into the test's namespace.
    fn kubectl_apply(&self, yaml: &str) -> Result<String> {
        let mut kubectl = self.plane.kubectl()?;
        kubectl
            .args(["apply", "--server-side", "--field-manager", "kubectl", "-n"])
            .arg(&self.namespace)
            .args(["-f", "-"]);
        run_with_input(&mut kubectl, yaml)
    }

    /// An example directory's manifests, with the sinks' `.default.svc` pointed at the test's
    /// namespace (the examples are written for `default`).
    fn example(&self, dir: &str) -> String {
        let mut text = String::new();
        let mut files: Vec<_> = std::fs::read_dir(repo().join("examples").join(dir))
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.extension().is_some_and(|e| e == "yaml"))
            .collect();
        files.sort();
        // The Secret and ConfigMap the functions read come first.
        files.sort_by_key(|path| !path.ends_with("config.yaml"));
        for file in files {
            text.push_str("---\n");
            text.push_str(&std::fs::read_to_string(file).unwrap());
            text.push('\n');
        }
        text.replace(".default.svc", &format!(".{}.svc", self.namespace))
    }

    /// The status condition `type_` of Function `name` (of `api_version`), as (status, reason, message).
    async fn condition(
        &self,
        api_version: &str,
        name: &str,
        type_: &str,
    ) -> Option<(String, String, String)> {
        let object = self
            .dynamic(api_version, "Function")
            .get_opt(name)
            .await
            .ok()??;
        let conditions = object.data["status"]["conditions"].as_array()?.clone();
        let condition = conditions.iter().find(|c| c["type"] == type_)?;
        Some((
            condition["status"].as_str()?.to_owned(),
            condition["reason"].as_str().unwrap_or_default().to_owned(),
            condition["message"].as_str().unwrap_or_default().to_owned(),
        ))
    }

    async fn wait_running(&self, api_version: &str, name: &str, within: Duration) {
        let result = eventually(&format!("Function {name} Running"), within, || async {
            self.condition(api_version, name, "Running")
                .await
                .is_some_and(|(status, _, _)| status == "True")
        })
        .await;
        if let Err(error) = result {
            let object = self.dynamic(api_version, "Function").get_opt(name).await;
            panic!("{error}: {object:#?}");
        }
    }

    async fn finish(self) {
        let _ = self
            .plane
            .delete_namespace(&self.admin, &self.namespace)
            .await;
    }
}

/// The API server's audit log (`scripts/kube` audits every request of the chart's
/// ServiceAccounts), one JSON event a line, as far as it is written.
fn audit_events(plane: &ControlPlane) -> Vec<Value> {
    std::fs::read_to_string(plane.dir().join("audit.log"))
        .unwrap_or_default()
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect()
}

/// When an audit event's request came in.
fn received(event: &Value) -> chrono::DateTime<chrono::Utc> {
    event["requestReceivedTimestamp"]
        .as_str()
        .and_then(|text| chrono::DateTime::parse_from_rfc3339(text).ok())
        .map_or(chrono::DateTime::<chrono::Utc>::MIN_UTC, |time| time.into())
}

/// One line saying who asked what of the API server, and its answer.
fn describe(event: &Value) -> String {
    let object = &event["objectRef"];
    format!(
        "{} {} {}/{}/{} by {} ({}): {}",
        event["verb"].as_str().unwrap_or_default(),
        object["resource"].as_str().unwrap_or_default(),
        object["apiGroup"].as_str().unwrap_or_default(),
        object["namespace"].as_str().unwrap_or_default(),
        object["name"].as_str().unwrap_or_default(),
        event["user"]["username"].as_str().unwrap_or_default(),
        event["userAgent"].as_str().unwrap_or_default(),
        event["responseStatus"]["code"]
    )
}

/// Whether a verb changes something.
fn is_write(event: &Value) -> bool {
    matches!(
        event["verb"].as_str(),
        Some("create" | "update" | "patch" | "delete" | "deletecollection")
    )
}

fn function(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "eddy.dev/v1alpha1", "kind": "Function", "metadata": {"name": name}, "spec": spec})
}

fn inline(source: &str) -> Value {
    json!({"runtime": "nodejs22", "source": {"inline": {"source": source}}})
}

// --- the chart -------------------------------------------------------------------------------

#[tokio::test]
async fn the_chart_installs_with_each_values_set_and_its_crds_are_accepted() {
    let _serial = serial().await;
    let plane = ControlPlane::shared().unwrap();
    let admin = plane.client().await.unwrap();
    // Kyma compatibility: the shared release.
    shared_release(plane).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let chart = chart_copy(dir.path()).unwrap();
    for (release, values) in [
        ("external-nats", "external-nats-values.yaml"),
        ("istio-off", "istio-off-values.yaml"),
    ] {
        let namespace = plane.namespace(&admin, release).await.unwrap();
        let output = helm_install(plane, &chart, release, &namespace, &[values], &[]).unwrap();
        assert!(output.contains("STATUS: deployed"), "{output}");
        run(plane
            .helm()
            .unwrap()
            .args(["uninstall", release, "--namespace", &namespace]))
        .unwrap();
        plane.delete_namespace(&admin, &namespace).await.unwrap();
    }
    // Every CRD the chart and `eddy crds` carry is served.
    let crds = run(plane.kubectl().unwrap().args(["get", "crds", "-o", "name"])).unwrap();
    for crd in [
        "functions.eddy.dev",
        "subscriptions.eddy.dev",
        "functions.serverless.kyma-project.io",
        "subscriptions.eventing.kyma-project.io",
    ] {
        assert!(crds.contains(crd), "{crd} missing: {crds}");
    }
    let printed = run(Command::new(env!("CARGO_BIN_EXE_eddy")).arg("crds")).unwrap();
    let mut apply = plane.kubectl().unwrap();
    apply.args([
        "apply",
        "--server-side",
        "--force-conflicts",
        "--dry-run=server",
        "-f",
        "-",
    ]);
    if let Err(error) = run_with_input(&mut apply, &printed) {
        panic!("the API server refuses `eddy crds`: {error:#}");
    }
}

// --- validation ------------------------------------------------------------------------------

/// Every CEL rule: each invalid object of the shared table is refused by the API server with
/// the message the local validation gives for it, and each valid one is stored, defaults and all.
#[tokio::test]
async fn the_api_server_refuses_what_local_validation_refuses_with_the_same_message() {
    let _serial = serial().await;
    let cluster = Cluster::new("cel").await;
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    let subscriptions = cluster.dynamic("eddy.dev/v1alpha1", "Subscription");
    let mut checked = 0;
    let mut mismatches = Vec::new();
    for (kind, api, base, table) in [
        (
            "Function",
            &functions,
            cases::base_function(),
            cases::function_cases(),
        ),
        (
            "Subscription",
            &subscriptions,
            cases::base_subscription(),
            cases::subscription_cases(),
        ),
    ] {
        for (index, (what, patch, valid)) in table.into_iter().enumerate() {
            let mut object = cases::merged(&base, &patch);
            let name = format!("case-{index}");
            if patch["metadata"]["name"].is_null() {
                object["metadata"]["name"] = json!(name);
            }
            object["metadata"]["namespace"] = json!(cluster.namespace);
            // The base sink is a Service of the base's namespace: the test's own here.
            if let Some(sink) = object["spec"]["sink"].as_str() {
                let sink = sink.replace(".shop.svc", &format!(".{}.svc", cluster.namespace));
                object["spec"]["sink"] = json!(sink);
            }
            // The local messages (the sink's namespace is the controller's check, not a rule).
            let local: Vec<String> = if kind == "Function" {
                serde_json::from_value::<Function>(object.clone())
                    .map_err(|e| vec![e.to_string()])
                    .map(|f| {
                        validate_function(&f)
                            .into_iter()
                            .map(|e| e.message)
                            .collect()
                    })
                    .unwrap_or_else(|errors| errors)
            } else {
                serde_json::from_value::<eddy_model::resources::Subscription>(object.clone())
                    .map_err(|e| vec![e.to_string()])
                    .map(|s| {
                        validate_subscription(&s, &Default::default())
                            .into_iter()
                            .map(|e| e.message)
                            .collect()
                    })
                    .unwrap_or_else(|errors| errors)
            };
            let dynamic: DynamicObject = serde_json::from_value(object.clone()).unwrap();
            let answer = api.create(&PostParams::default(), &dynamic).await;
            match (valid, answer) {
                (true, Ok(_)) => {}
                (true, Err(error)) => panic!("{kind} {what:?} is valid but refused: {error}"),
                (false, Ok(_)) => panic!("{kind} {what:?} is invalid but the API server stored it"),
                (false, Err(kube::Error::Api(status))) => {
                    assert_eq!(status.code, 422, "{kind} {what:?}: {status:?}");
                    assert!(
                        !local.is_empty(),
                        "{kind} {what:?}: local validation accepts it"
                    );
                    // A CEL rule answers with eddy's own message; the schema's own checks
                    // (type, enum, maxLength) in the API server's words.
                    let same = local.iter().any(|m| status.message.contains(m.as_str()));
                    let schema = [
                        "Unsupported value",
                        "Too long",
                        "should be",
                        "must have at most",
                        "in body must be",
                    ]
                    .iter()
                    .any(|words| status.message.contains(words));
                    if !same && !schema {
                        mismatches.push(format!(
                            "{kind} {what:?}: the API server says {:?}, local validation {local:?}",
                            status.message
                        ));
                    }
                    checked += 1;
                }
                (false, Err(error)) => panic!("{kind} {what:?}: {error}"),
            }
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    assert!(checked > 20, "only {checked} invalid cases checked");
    cluster.finish().await;
}

/// The CRD defaults the API server fills in are the ones the code assumes, and they survive
/// Kyma's conversion and validation (a Kyma Function with FUNC_TIMEOUT is valid as stored).
#[tokio::test]
async fn stored_defaults_survive_the_kyma_conversion_and_validation() {
    let _serial = serial().await;
    let cluster = Cluster::new("defaults").await;
    cluster
        .kubectl_apply(
            "apiVersion: serverless.kyma-project.io/v1alpha2\nkind: Function\nmetadata: {name: timed}\nspec:\n  runtime: nodejs22\n  env: [{name: FUNC_TIMEOUT, value: \"10\"}]\n  source: {inline: {source: \"module.exports = {main: () => 'ok'}\"}}\n---\napiVersion: eventing.kyma-project.io/v1alpha2\nkind: Subscription\nmetadata: {name: bare}\nspec:\n  sink: http://timed.NS.svc.cluster.local\n  source: shop\n  types: [order.created.v1]\n"
                .replace("NS", &cluster.namespace)
                .as_str(),
        )
        .unwrap();
    for (api_version, kind, name) in [
        ("serverless.kyma-project.io/v1alpha2", "Function", "timed"),
        ("eventing.kyma-project.io/v1alpha2", "Subscription", "bare"),
    ] {
        let stored = cluster.dynamic(api_version, kind).get(name).await.unwrap();
        let manifest = serde_json::to_value(&stored).unwrap();
        let native = eddy_model::kyma::to_native(manifest.clone())
            .unwrap_or_else(|errors| panic!("{kind} as stored: {errors:?}\n{manifest:#}"));
        if kind == "Function" {
            let function: Function = serde_json::from_value(native).unwrap();
            let errors = validate_function(&function);
            assert!(errors.is_empty(), "{errors:?}");
            assert_eq!(function.spec.timeout(), Duration::from_secs(10));
        } else {
            let subscription: eddy_model::resources::Subscription =
                serde_json::from_value(native).unwrap();
            let errors = validate_subscription(&subscription, &Default::default());
            assert!(errors.is_empty(), "{errors:?}");
            assert_eq!(
                manifest["spec"]["config"]["maxInFlightMessages"], "10",
                "{manifest:#}"
            );
            assert_eq!(manifest["spec"]["typeMatching"], "standard", "{manifest:#}");
        }
    }
    cluster.finish().await;
}

// --- the controller --------------------------------------------------------------------------

/// examples/shop and examples/kyma, applied with kubectl into a namespace of the test's
/// choosing, reach Running under the chart's RBAC, with every child object owned.
#[tokio::test]
async fn the_examples_reach_running_under_the_charts_rbac() {
    let _serial = serial().await;
    let cluster = Cluster::new("examples").await;
    let controller = cluster.controller().await;
    cluster.kubectl_apply(&cluster.example("shop")).unwrap();
    cluster.kubectl_apply(&cluster.example("kyma")).unwrap();
    let shop = ["stock-reserver", "reservation-recorder", "price-quote"];
    let kyma = ["greeter", "orders", "audit", "db-info"];
    for name in shop {
        cluster
            .wait_running("eddy.dev/v1alpha1", name, Duration::from_secs(60))
            .await;
    }
    for name in kyma {
        cluster
            .wait_running(
                "serverless.kyma-project.io/v1alpha2",
                name,
                Duration::from_secs(60),
            )
            .await;
    }
    let deployments: Api<Deployment> = cluster.api();
    let services: Api<Service> = cluster.api();
    let jobs: Api<Job> = cluster.api();
    let config_maps: Api<ConfigMap> = cluster.api();
    for name in shop.iter().chain(&kyma) {
        let deployment = deployments.get(name).await.unwrap();
        let owner = &deployment.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(owner.kind, "Function", "{name}");
        assert_eq!(owner.controller, Some(true), "{name}");
        let service = services.get(name).await.unwrap();
        assert_eq!(service.metadata.owner_references.unwrap()[0].name, *name);
        let selector = format!("eddy.dev/function={name}");
        let built = jobs
            .list(&ListParams::default().labels(&selector))
            .await
            .unwrap();
        assert!(!built.items.is_empty(), "{name} has a build Job");
        let sources = config_maps
            .list(&ListParams::default().labels(&selector))
            .await
            .unwrap();
        assert!(!sources.items.is_empty(), "{name} has a ConfigMap");
    }
    // The greeter keeps Kyma's FUNC_TIMEOUT.
    let greeter = deployments.get("greeter").await.unwrap();
    let env = greeter.spec.template.spec.unwrap().containers[0]
        .env
        .clone()
        .unwrap();
    let timeout = env.iter().find(|var| var.name == "FUNC_TIMEOUT").unwrap();
    assert_eq!(timeout.value.as_deref(), Some("10"));
    // An autoscaled function has its HPA.
    let hpas: Api<HorizontalPodAutoscaler> = cluster.api();
    let orders = hpas.get("orders").await.unwrap();
    assert_eq!(orders.spec.max_replicas, 3);
    // The chart's RBAC let the controller do all of it.
    cluster.assert_no_rbac_refusal();
    drop(controller);
    cluster.finish().await;
}

/// A changed source gets a new build Job and a rollout; a scale change gets none; a failed
/// build gives BuildFailed and is tried again later.
#[tokio::test]
async fn builds_follow_the_source_and_a_failed_build_is_reported() {
    let _serial = serial().await;
    let cluster = Cluster::new("builds").await;
    let _controller = cluster.controller().await;
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    let apply = PatchParams::apply("test").force();
    let hello = function("hello", inline("module.exports = {main: () => 'one'}"));
    functions
        .patch("hello", &apply, &Patch::Apply(&hello))
        .await
        .unwrap();
    cluster
        .wait_running("eddy.dev/v1alpha1", "hello", Duration::from_secs(60))
        .await;
    let jobs: Api<Job> = cluster.api();
    let deployments: Api<Deployment> = cluster.api();
    let selector = ListParams::default().labels("eddy.dev/function=hello");
    let first_image = image_of(&deployments.get("hello").await.unwrap());
    assert_eq!(jobs.list(&selector).await.unwrap().items.len(), 1);

    // A scale change: no new build, the same image, the new replica count.
    let mut scaled = hello.clone();
    scaled["spec"]["replicas"] = json!(2);
    functions
        .patch("hello", &apply, &Patch::Apply(&scaled))
        .await
        .unwrap();
    eventually(
        "the Deployment scaled to 2",
        Duration::from_secs(30),
        || async {
            deployments
                .get("hello")
                .await
                .is_ok_and(|d| d.spec.replicas == Some(2))
        },
    )
    .await
    .unwrap();
    assert_eq!(
        jobs.list(&selector).await.unwrap().items.len(),
        1,
        "no build for a scale change"
    );
    assert_eq!(
        image_of(&deployments.get("hello").await.unwrap()),
        first_image
    );

    // A changed source: a new Job, then the Deployment rolls to its image.
    let mut changed = scaled.clone();
    changed["spec"]["source"]["inline"]["source"] = json!("module.exports = {main: () => 'two'}");
    functions
        .patch("hello", &apply, &Patch::Apply(&changed))
        .await
        .unwrap();
    eventually(
        "the Deployment on a new image",
        Duration::from_secs(60),
        || async {
            deployments
                .get("hello")
                .await
                .is_ok_and(|d| image_of(&d) != first_image)
        },
    )
    .await
    .unwrap();
    cluster
        .wait_running("eddy.dev/v1alpha1", "hello", Duration::from_secs(60))
        .await;

    // A build that fails (the test node fails every build pod of a Function named build-fails).
    let failing = function("build-fails", inline("module.exports = {main: () => 'x'}"));
    functions
        .patch("build-fails", &apply, &Patch::Apply(&failing))
        .await
        .unwrap();
    eventually("BuildFailed", Duration::from_secs(60), || async {
        cluster
            .condition("eddy.dev/v1alpha1", "build-fails", "BuildReady")
            .await
            .is_some_and(|(status, reason, _)| status == "False" && reason == "BuildFailed")
    })
    .await
    .unwrap();
    let (_, _, message) = cluster
        .condition("eddy.dev/v1alpha1", "build-fails", "BuildReady")
        .await
        .unwrap();
    assert!(
        message.contains("the build failed (test node)"),
        "{message}"
    );
    assert!(
        message.contains("trying again at"),
        "the retry is announced: {message}"
    );
    let failed = functions.get("build-fails").await.unwrap();
    assert_eq!(
        failed.data["status"]["buildFailures"], 1,
        "{:#?}",
        failed.data
    );
    cluster.finish().await;
}

fn image_of(deployment: &Deployment) -> String {
    deployment.spec.template.spec.as_ref().unwrap().containers[0]
        .image
        .clone()
        .unwrap()
}

/// Deleting a Function removes every object it owns (kube-controller-manager's garbage
/// collector, following the owner references).
#[tokio::test]
async fn a_deleted_function_leaves_nothing_behind() {
    let _serial = serial().await;
    let cluster = Cluster::new("gc").await;
    let _controller = cluster.controller().await;
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    let mut spec = inline("module.exports = {main: () => 'gone soon'}");
    spec["scaleConfig"] = json!({"minReplicas": 1, "maxReplicas": 2});
    functions
        .patch(
            "brief",
            &PatchParams::apply("test"),
            &Patch::Apply(function("brief", spec)),
        )
        .await
        .unwrap();
    cluster
        .wait_running("eddy.dev/v1alpha1", "brief", Duration::from_secs(60))
        .await;
    functions
        .delete("brief", &DeleteParams::default())
        .await
        .unwrap();
    let selector = ListParams::default().labels("eddy.dev/function=brief");
    let deployments: Api<Deployment> = cluster.api();
    let services: Api<Service> = cluster.api();
    let jobs: Api<Job> = cluster.api();
    let config_maps: Api<ConfigMap> = cluster.api();
    let hpas: Api<HorizontalPodAutoscaler> = cluster.api();
    let pods: Api<Pod> = cluster.api();
    eventually("every child gone", Duration::from_secs(60), || async {
        deployments
            .list(&selector)
            .await
            .is_ok_and(|l| l.items.is_empty())
            && services.get_opt("brief").await.is_ok_and(|s| s.is_none())
            && jobs.list(&selector).await.is_ok_and(|l| l.items.is_empty())
            && config_maps
                .list(&selector)
                .await
                .is_ok_and(|l| l.items.is_empty())
            && hpas.get_opt("brief").await.is_ok_and(|h| h.is_none())
            && pods.list(&selector).await.is_ok_and(|l| l.items.is_empty())
    })
    .await
    .unwrap();
    cluster.finish().await;
}

/// `kubectl scale` sets the Function's replicas through the scale subresource; an HPA can
/// target the Function (the controller-manager reads its scale). kwok runs no container, so
/// nothing scales on load here: `tests/real_pods.rs`,
/// `an_autoscaled_function_scales_out_on_cpu_load_through_metrics_server`, does that.
#[tokio::test]
async fn kubectl_scale_sets_a_function_s_replicas_and_an_hpa_can_target_its_scale() {
    let _serial = serial().await;
    let cluster = Cluster::new("scale").await;
    let _controller = cluster.controller().await;
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    functions
        .patch(
            "scaled",
            &PatchParams::apply("test"),
            &Patch::Apply(function(
                "scaled",
                inline("module.exports = {main: () => 1}"),
            )),
        )
        .await
        .unwrap();
    cluster
        .wait_running("eddy.dev/v1alpha1", "scaled", Duration::from_secs(60))
        .await;
    let kubectl_scale = |replicas: &str| {
        run(cluster
            .plane
            .kubectl()
            .unwrap()
            .args([
                "scale",
                "functions.eddy.dev/scaled",
                "--replicas",
                replicas,
                "-n",
            ])
            .arg(&cluster.namespace))
        .unwrap();
    };
    kubectl_scale("3");
    let deployments: Api<Deployment> = cluster.api();
    eventually(
        "the Deployment at 3 replicas",
        Duration::from_secs(30),
        || async {
            deployments
                .get("scaled")
                .await
                .is_ok_and(|d| d.status.and_then(|s| s.ready_replicas) == Some(3))
        },
    )
    .await
    .unwrap();
    eventually("status.replicas 3", Duration::from_secs(30), || async {
        functions
            .get("scaled")
            .await
            .is_ok_and(|f| f.data["status"]["replicas"] == 3)
    })
    .await
    .unwrap();
    let scale = run(cluster
        .plane
        .kubectl()
        .unwrap()
        .args(["get", "--raw"])
        .arg(format!(
            "/apis/eddy.dev/v1alpha1/namespaces/{}/functions/scaled/scale",
            cluster.namespace
        )))
    .unwrap();
    let scale: Value = serde_json::from_str(&scale).unwrap();
    assert_eq!(
        scale["status"]["selector"], "eddy.dev/function=scaled",
        "{scale:#}"
    );
    // An HPA whose target is the Function: the API server accepts it and the controller-manager
    // reads the Function's scale subresource for it.
    let hpas: Api<HorizontalPodAutoscaler> = cluster.api();
    let hpa: HorizontalPodAutoscaler = serde_json::from_value(json!({
        "metadata": {"name": "scaled-by-keda-like"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "eddy.dev/v1alpha1", "kind": "Function", "name": "scaled"},
            "minReplicas": 1, "maxReplicas": 4,
            "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 50}}}]
        }
    }))
    .unwrap();
    hpas.create(&PostParams::default(), &hpa).await.unwrap();
    eventually(
        "the HPA reading the Function's scale",
        Duration::from_secs(60),
        || async {
            hpas.get("scaled-by-keda-like").await.is_ok_and(|h| {
                h.status.is_some_and(|s| {
                    s.current_replicas == Some(3)
                        || s.conditions
                            .iter()
                            .flatten()
                            .any(|c| c.type_ == "AbleToScale" && c.status == "True")
                })
            })
        },
    )
    .await
    .unwrap();
    // Scaled to zero: the Deployment follows and Running says so.
    kubectl_scale("0");
    eventually(
        "the Deployment at 0 replicas and Running ScaledToZero",
        Duration::from_secs(30),
        || async {
            deployments
                .get("scaled")
                .await
                .is_ok_and(|d| d.spec.replicas == Some(0))
                && cluster
                    .condition("eddy.dev/v1alpha1", "scaled", "Running")
                    .await
                    .is_some_and(|(_, reason, _)| reason == "ScaledToZero")
        },
    )
    .await
    .unwrap();
    cluster.finish().await;
}

/// A Function whose security contexts ask for more than the operator's Pod Security level
/// (`restricted` by default) is not deployed: ConfigurationReady names each field, and the
/// version already running keeps running as it was.
#[tokio::test]
async fn a_function_asking_for_privileges_is_refused_and_its_running_version_kept() {
    let _serial = serial().await;
    let cluster = Cluster::new("privileges").await;
    let _controller = cluster.controller().await;
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    let apply = |spec: Value| {
        let functions = functions.clone();
        async move {
            functions
                .patch(
                    "greedy",
                    &PatchParams::apply("test"),
                    &Patch::Apply(function("greedy", spec)),
                )
                .await
                .unwrap();
        }
    };
    apply(inline("module.exports = {main: () => 'plain'}")).await;
    cluster
        .wait_running("eddy.dev/v1alpha1", "greedy", Duration::from_secs(60))
        .await;
    let deployments: Api<Deployment> = cluster.api();
    let before = deployments.get("greedy").await.unwrap();
    let mut spec = inline("module.exports = {main: () => 'root'}");
    spec["containerSecurityContext"] = json!({"privileged": true,
        "capabilities": {"add": ["SYS_ADMIN"]}});
    spec["podSecurityContext"] = json!({"runAsUser": 0});
    apply(spec).await;
    let refused = eventually(
        "ConfigurationReady False, SecurityContextRefused",
        Duration::from_secs(30),
        || async {
            cluster
                .condition("eddy.dev/v1alpha1", "greedy", "ConfigurationReady")
                .await
                .is_some_and(|(status, reason, _)| {
                    status == "False" && reason == "SecurityContextRefused"
                })
        },
    )
    .await;
    let condition = cluster
        .condition("eddy.dev/v1alpha1", "greedy", "ConfigurationReady")
        .await;
    refused.unwrap_or_else(|error| panic!("{error}: {condition:?}"));
    let (_, _, message) = condition.unwrap();
    for field in ["privileged", "SYS_ADMIN", "runAsUser"] {
        assert!(message.contains(field), "{field} not named: {message}");
    }
    let after = deployments.get("greedy").await.unwrap();
    assert_eq!(
        serde_json::to_value(&after.spec).unwrap(),
        serde_json::to_value(&before.spec).unwrap(),
        "the running version's Deployment was changed"
    );
    cluster.finish().await;
}

/// A controller started before the namespace of its Lease exists (a new user's order of steps)
/// says why it cannot join the election, keeps trying, and leads and reconciles once the
/// namespace and the chart's Lease Role are there: no restart.
#[tokio::test]
async fn a_controller_started_before_its_lease_namespace_leads_once_it_exists() {
    use k8s_openapi::api::{
        core::v1::Namespace,
        rbac::v1::{Role, RoleBinding},
    };
    let _serial = serial().await;
    let cluster = Cluster::new("late-lease").await;
    let lease_namespace = format!("{}-lease", cluster.namespace);
    let controller = cluster
        .component(
            "controller",
            &[
                ("EDDY_API_ADDR", "127.0.0.1:0"),
                ("EDDY_LEASE_NAMESPACE", &lease_namespace),
            ],
        )
        .await;
    eventually(
        "the controller to say why it cannot join",
        Duration::from_secs(30),
        || async {
            let log = controller.log();
            log.contains("cannot join the lease election") && log.contains(&lease_namespace)
        },
    )
    .await
    .unwrap_or_else(|error| panic!("{error}:\n{}", controller.log()));

    // The namespace, and in it the chart's Lease Role and its binding, as the chart makes them.
    let namespaces: Api<Namespace> = Api::all(cluster.admin.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": lease_namespace}})).unwrap(),
        )
        .await
        .unwrap();
    let roles: Api<Role> = Api::namespaced(cluster.admin.clone(), SYSTEM);
    let bindings: Api<RoleBinding> = Api::namespaced(cluster.admin.clone(), SYSTEM);
    let lease_role = roles
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|role| {
            role.rules.iter().flatten().any(|rule| {
                rule.resources
                    .iter()
                    .flatten()
                    .any(|resource| resource == "leases")
            })
        })
        .expect("the chart's Lease Role");
    let role_name = lease_role.metadata.name.clone().unwrap();
    let binding = bindings
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|binding| binding.role_ref.name == role_name)
        .expect("the chart's Lease RoleBinding");
    let copy = |metadata: &kube::core::ObjectMeta| kube::core::ObjectMeta {
        name: metadata.name.clone(),
        namespace: Some(lease_namespace.clone()),
        ..Default::default()
    };
    Api::<Role>::namespaced(cluster.admin.clone(), &lease_namespace)
        .create(
            &PostParams::default(),
            &Role {
                metadata: copy(&lease_role.metadata),
                rules: lease_role.rules.clone(),
            },
        )
        .await
        .unwrap();
    Api::<RoleBinding>::namespaced(cluster.admin.clone(), &lease_namespace)
        .create(
            &PostParams::default(),
            &RoleBinding {
                metadata: copy(&binding.metadata),
                role_ref: binding.role_ref.clone(),
                subjects: binding.subjects.clone(),
            },
        )
        .await
        .unwrap();

    let leases: Api<Lease> = Api::namespaced(cluster.admin.clone(), &lease_namespace);
    let lease_name = format!("{RELEASE}-controller");
    eventually(
        "the controller to lead, unrestarted",
        Duration::from_secs(30),
        || async {
            leases.get(&lease_name).await.is_ok_and(|l| {
                l.spec.and_then(|s| s.holder_identity).as_deref() == Some(controller.name.as_str())
            })
        },
    )
    .await
    .unwrap_or_else(|error| panic!("{error}:\n{}", controller.log()));
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    functions
        .patch(
            "late",
            &PatchParams::apply("test"),
            &Patch::Apply(function("late", inline("module.exports = {main: () => 1}"))),
        )
        .await
        .unwrap();
    cluster
        .wait_running("eddy.dev/v1alpha1", "late", Duration::from_secs(60))
        .await;
    drop(controller);
    let _ = namespaces
        .delete(&lease_namespace, &DeleteParams::default())
        .await;
    cluster.finish().await;
}

/// Two controllers: one leads; SIGKILL it and the other takes over within the lease duration;
/// only the leader wrote (the API server's audit log, by each replica's user agent; and
/// managedFields).
#[tokio::test]
async fn a_standby_controller_takes_over_within_the_lease_duration() {
    let _serial = serial().await;
    let cluster = Cluster::new("leader").await;
    let mut first = cluster.controller().await;
    let leases: Api<Lease> = Api::namespaced(cluster.admin.clone(), SYSTEM);
    let lease_name = format!("{RELEASE}-controller");
    eventually(
        "the first controller to lead",
        Duration::from_secs(30),
        || async {
            leases.get(&lease_name).await.is_ok_and(|l| {
                l.spec.and_then(|s| s.holder_identity).as_deref() == Some(first.name.as_str())
            })
        },
    )
    .await
    .unwrap();
    let second = cluster.controller().await;
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    let apply = PatchParams::apply("test");
    functions
        .patch(
            "led",
            &apply,
            &Patch::Apply(function("led", inline("module.exports = {main: () => 1}"))),
        )
        .await
        .unwrap();
    cluster
        .wait_running("eddy.dev/v1alpha1", "led", Duration::from_secs(60))
        .await;
    let killed_at = chrono::Utc::now();
    first.kill();
    let killed = Instant::now();
    functions
        .patch(
            "after",
            &apply,
            &Patch::Apply(function(
                "after",
                inline("module.exports = {main: () => 2}"),
            )),
        )
        .await
        .unwrap();
    eventually("the standby to lead", Duration::from_secs(10), || async {
        leases.get(&lease_name).await.is_ok_and(|l| {
            l.spec.and_then(|s| s.holder_identity).as_deref() == Some(second.name.as_str())
        })
    })
    .await
    .unwrap();
    let took_over = killed.elapsed();
    assert!(
        took_over <= Duration::from_secs(4) + Duration::from_secs(2),
        "took over after {took_over:?}, the lease is {LEASE_DURATION}"
    );
    cluster
        .wait_running("eddy.dev/v1alpha1", "after", Duration::from_secs(60))
        .await;
    // Only the leader wrote: the audit log tells the replicas apart by their user agents.
    // Until the first was killed, the standby made no write but its lease attempts; the
    // first's writes are there (so the check can see a write when there is one).
    let writes_by = |name: &str, before: chrono::DateTime<chrono::Utc>| -> Vec<String> {
        let agent = format!("eddy-controller/{name}");
        audit_events(cluster.plane)
            .iter()
            .filter(|event| received(event) >= cluster.started && received(event) < before)
            .filter(|event| event["userAgent"] == agent.as_str() && is_write(event))
            .filter(|event| event["objectRef"]["resource"] != "leases")
            .map(describe)
            .collect()
    };
    assert!(
        !writes_by(&first.name, killed_at).is_empty(),
        "the leader's writes are in the audit log"
    );
    let standby = writes_by(&second.name, killed_at);
    assert!(
        standby.is_empty(),
        "the standby wrote while it stood by:\n{}",
        standby.join("\n")
    );
    // Only the controller's field manager wrote the children.
    let deployments: Api<Deployment> = cluster.api();
    for name in ["led", "after"] {
        let deployment = deployments.get(name).await.unwrap();
        let managers: Vec<String> = deployment
            .metadata
            .managed_fields
            .iter()
            .flatten()
            .filter(|f| f.operation.as_deref() == Some("Apply"))
            .filter_map(|f| f.manager.clone())
            .collect();
        assert_eq!(managers, ["eddy-controller"], "{name}");
    }
    eprintln!("the standby took over {took_over:?} after the leader's SIGKILL");
    drop(second);
    cluster.finish().await;
}

/// A watch whose resourceVersion is gone (etcd compacted, the API server's watch cache new)
/// gets 410 Gone; the controller, the dispatcher and the gateway list again and miss no change
/// made meanwhile (additions, a change, a deletion).
#[tokio::test]
async fn watches_relist_after_410_gone_and_miss_nothing() {
    let _serial = serial().await;
    let cluster = Cluster::new("gone").await;
    let ns = cluster.namespace.clone();
    // Without leader election, so that pausing it below cannot cost it the lead (a new leader
    // lists anyway, which would hide what this test is about).
    let controller = cluster
        .component(
            "controller",
            &[
                ("EDDY_API_ADDR", "127.0.0.1:0"),
                ("EDDY_LEADER_ELECTION", "false"),
            ],
        )
        .await;
    let events = Events::start(&cluster).await;
    let dispatcher = events.dispatcher(&cluster).await;
    let (gateway, url) = gateway(&cluster, &function_services().await).await;
    let sink = support::Sink::ok().await;
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    let subscriptions = cluster.dynamic("eddy.dev/v1alpha1", "Subscription");
    let apply = PatchParams::apply("test");
    functions
        .patch(
            "before",
            &apply,
            &Patch::Apply(with_access("before", json!({"mode": "public"}))),
        )
        .await
        .unwrap();
    for name in ["kept", "dropped"] {
        subscriptions
            .patch(
                name,
                &apply,
                &Patch::Apply(eddy_subscription(name, &sink.url, &["order.created.v1"])),
            )
            .await
            .unwrap();
    }
    cluster
        .wait_running("eddy.dev/v1alpha1", "before", Duration::from_secs(60))
        .await;
    eventually(
        "the consumers and the route",
        Duration::from_secs(30),
        || async {
            events.consumer(&ns, "kept").await.is_some()
                && events.consumer(&ns, "dropped").await.is_some()
                && call(&format!("{url}/{ns}/before/"), None).await.0 == 200
        },
    )
    .await
    .unwrap();

    // The three paused (SIGSTOP) see nothing of the changes; etcd is compacted past them and
    // the API server restarted, so their watches resume from a revision that is gone.
    let pids: Vec<String> = [&controller, &dispatcher, &gateway]
        .iter()
        .map(|component| component.child.id().to_string())
        .collect();
    for pid in &pids {
        run(Command::new("kill").args(["-STOP", pid])).unwrap();
    }
    let digest = eddy_platform::auth::Tokens::digest_text("secret");
    functions
        .patch(
            "before",
            &apply,
            &Patch::Apply(with_access(
                "before",
                json!({"mode": "token", "tokenDigests": [digest]}),
            )),
        )
        .await
        .unwrap();
    for index in 0..3 {
        let name = format!("during-{index}");
        functions
            .patch(
                &name,
                &apply,
                &Patch::Apply(with_access(&name, json!({"mode": "public"}))),
            )
            .await
            .unwrap();
    }
    subscriptions
        .patch(
            "added",
            &apply,
            &Patch::Apply(eddy_subscription("added", &sink.url, &["order.paid.v1"])),
        )
        .await
        .unwrap();
    subscriptions
        .delete("dropped", &DeleteParams::default())
        .await
        .unwrap();
    cluster.plane.compact_etcd().unwrap();
    cluster.plane.restart_api_server().unwrap();
    for pid in &pids {
        run(Command::new("kill").args(["-CONT", pid])).unwrap();
    }
    for index in 0..3 {
        cluster
            .wait_running(
                "eddy.dev/v1alpha1",
                &format!("during-{index}"),
                Duration::from_secs(90),
            )
            .await;
    }
    eventually(
        "the dispatcher and the gateway to catch up",
        Duration::from_secs(60),
        || async {
            events.consumer(&ns, "added").await.is_some()
                && events.consumer(&ns, "dropped").await.is_none()
                && events.consumer(&ns, "kept").await.is_some()
                && call(&format!("{url}/{ns}/before/"), None).await.0 == 401
                && call(&format!("{url}/{ns}/before/"), Some("secret")).await.0 == 200
                && call(&format!("{url}/{ns}/during-2/"), None).await.0 == 200
        },
    )
    .await
    .unwrap();
    drop((controller, dispatcher, gateway));
    cluster.finish().await;
}

/// A field another manager set on a child: the controller applies with force, so the fields it
/// owns (the Deployment's replicas) are taken back at its next reconcile, and fields it does not
/// set (another tool's annotation) are left alone.
#[tokio::test]
async fn the_controller_takes_back_its_fields_and_leaves_the_rest() {
    let _serial = serial().await;
    let cluster = Cluster::new("fields").await;
    let controller = cluster.controller().await;
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    let mut spec = inline("module.exports = {main: () => 'owned'}");
    spec["replicas"] = json!(1);
    functions
        .patch(
            "owned",
            &PatchParams::apply("test"),
            &Patch::Apply(function("owned", spec)),
        )
        .await
        .unwrap();
    cluster
        .wait_running("eddy.dev/v1alpha1", "owned", Duration::from_secs(60))
        .await;
    let kubectl = |args: &[&str]| {
        let mut command = cluster.plane.kubectl().unwrap();
        command.args(args).arg("-n").arg(&cluster.namespace);
        run(&mut command).unwrap()
    };
    kubectl(&["annotate", "deployment", "owned", "example.com/team=shop"]);
    kubectl(&["scale", "deployment", "owned", "--replicas", "3"]);
    let deployments: Api<Deployment> = cluster.api();
    eventually(
        "the replicas taken back",
        Duration::from_secs(30),
        || async {
            deployments.get("owned").await.is_ok_and(|d| {
                d.spec.replicas == Some(1)
                    && d.metadata.managed_fields.iter().flatten().any(|f| {
                        f.manager.as_deref() == Some("eddy-controller")
                            && f.fields_v1
                                .as_ref()
                                .is_some_and(|v| v.0["f:spec"]["f:replicas"].is_object())
                    })
            })
        },
    )
    .await
    .unwrap();
    let deployment = deployments.get("owned").await.unwrap();
    assert_eq!(
        deployment
            .metadata
            .annotations
            .unwrap_or_default()
            .get("example.com/team")
            .map(String::as_str),
        Some("shop"),
        "another manager's annotation is kept"
    );
    cluster.assert_no_rbac_refusal();
    drop(controller);
    cluster.finish().await;
}

// --- the dispatcher and the gateway ------------------------------------------------------------

/// A nats-server and the chart's event-bus in front of it, as processes.
/// (Fields drop in order: the event-bus stops before its nats-server.)
struct Events {
    bus: Component,
    nats: eddy_testing::NatsServer,
    bus_url: String,
    js: async_nats::jetstream::Context,
    http: reqwest::Client,
}

impl Events {
    async fn start(cluster: &Cluster) -> Self {
        let nats = eddy_testing::NatsServer::start().unwrap();
        let bus = cluster
            .component(
                "event-bus",
                &[
                    ("EDDY_NATS_URL", &nats.url()),
                    ("EDDY_BUS_ADDR", "127.0.0.1:0"),
                ],
            )
            .await;
        let bus_url = bus.url().await;
        let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
        Self {
            bus,
            nats,
            bus_url,
            js,
            http: reqwest::Client::new(),
        }
    }

    /// The chart's dispatcher against this nats-server.
    async fn dispatcher(&self, cluster: &Cluster) -> Component {
        cluster
            .component(
                "dispatcher",
                &[
                    ("EDDY_NATS_URL", &self.nats.url()),
                    ("EDDY_DISPATCHER_ADDR", "127.0.0.1:0"),
                ],
            )
            .await
    }

    async fn publish(&self, ty: &str, id: &str) {
        let response = self
            .http
            .post(format!("{}/publish", self.bus_url))
            .header("ce-specversion", "1.0")
            .header("ce-id", id)
            .header("ce-source", "shop")
            .header("ce-type", ty)
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 204, "publish {id}: {}", self.bus.log());
    }

    /// The consumer of Subscription `namespace/name`, if there is one.
    async fn consumer(
        &self,
        namespace: &str,
        name: &str,
    ) -> Option<async_nats::jetstream::consumer::Info> {
        let stream = self
            .js
            .get_stream(eddy_platform::nats::EVENTS_STREAM)
            .await
            .ok()?;
        stream
            .consumer_info(eddy_model::resources::consumer_name(namespace, name))
            .await
            .ok()
    }

    /// Waits until Subscription `namespace/name`'s consumer has delivered all it matches.
    async fn settled(&self, namespace: &str, name: &str) {
        eventually(
            &format!("{name} to settle"),
            Duration::from_secs(30),
            || async {
                let Ok(stream) = self.js.get_stream(eddy_platform::nats::EVENTS_STREAM).await
                else {
                    return false;
                };
                eddy::bench::consumer_settled(
                    &stream,
                    &eddy_model::resources::consumer_name(namespace, name),
                )
                .await
                .unwrap_or(false)
            },
        )
        .await
        .unwrap();
    }
}

fn eddy_subscription(name: &str, sink: &str, types: &[&str]) -> Value {
    json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription", "metadata": {"name": name},
        "spec": {"sink": sink, "source": "shop", "types": types},
    })
}

fn kyma_subscription(name: &str, sink: &str, types: &[&str]) -> Value {
    json!({
        "apiVersion": "eventing.kyma-project.io/v1alpha2", "kind": "Subscription",
        "metadata": {"name": name},
        "spec": {"sink": sink, "source": "shop", "types": types},
    })
}

/// The chart's dispatcher reads Subscriptions of both API groups from the API server (under its
/// ClusterRole), delivers each matching event to a sink it may reach, and follows updates and
/// deletions.
#[tokio::test]
async fn the_dispatcher_delivers_for_subscriptions_of_both_groups_and_follows_them() {
    let _serial = serial().await;
    let cluster = Cluster::new("dispatch").await;
    let events = Events::start(&cluster).await;
    let dispatcher = events.dispatcher(&cluster).await;
    let ns = cluster.namespace.clone();
    let (native, kyma) = (support::Sink::ok().await, support::Sink::ok().await);
    let eddy_api = cluster.dynamic("eddy.dev/v1alpha1", "Subscription");
    let kyma_api = cluster.dynamic("eventing.kyma-project.io/v1alpha2", "Subscription");
    let apply = PatchParams::apply("test");
    let created = ["order.created.v1"];
    eddy_api
        .patch(
            "on-order",
            &apply,
            &Patch::Apply(eddy_subscription("on-order", &native.url, &created)),
        )
        .await
        .unwrap();
    kyma_api
        .patch(
            "kyma-on-order",
            &apply,
            &Patch::Apply(kyma_subscription("kyma-on-order", &kyma.url, &created)),
        )
        .await
        .unwrap();
    for name in ["on-order", "kyma-on-order"] {
        eventually(
            &format!("the consumer of {name}"),
            Duration::from_secs(30),
            || async { events.consumer(&ns, name).await.is_some() },
        )
        .await
        .unwrap();
    }
    for index in 0..5 {
        events
            .publish("order.created.v1", &format!("c-{index}"))
            .await;
    }
    native.wait_for(5).await;
    kyma.wait_for(5).await;
    // Settled first: a duplicate delivered late is seen.
    events.settled(&ns, "on-order").await;
    events.settled(&ns, "kyma-on-order").await;
    let expected: Vec<String> = (0..5).map(|i| format!("c-{i}")).collect();
    for sink in [&native, &kyma] {
        let mut ids = sink.ids();
        ids.sort();
        assert_eq!(ids, expected);
    }

    // An update: the consumer's filter follows the object.
    eddy_api
        .patch(
            "on-order",
            &apply,
            &Patch::Apply(eddy_subscription(
                "on-order",
                &native.url,
                &["order.paid.v1"],
            )),
        )
        .await
        .unwrap();
    eventually(
        "the filter to follow the update",
        Duration::from_secs(30),
        || async {
            events.consumer(&ns, "on-order").await.is_some_and(|info| {
                info.config.filter_subjects == ["eddy.events.shop.order.paid.v1"]
                    || info.config.filter_subject == "eddy.events.shop.order.paid.v1"
            })
        },
    )
    .await
    .unwrap();
    events.publish("order.created.v1", "c-after").await;
    events.publish("order.paid.v1", "p-1").await;
    native.wait_for(6).await;
    kyma.wait_for(6).await;
    events.settled(&ns, "on-order").await;
    events.settled(&ns, "kyma-on-order").await;
    assert_eq!(
        native.ids()[5..],
        ["p-1".to_owned()],
        "only the new type after the update"
    );
    assert_eq!(kyma.ids()[5..], ["c-after".to_owned()]);

    // Deletions: the consumers go.
    eddy_api
        .delete("on-order", &DeleteParams::default())
        .await
        .unwrap();
    kyma_api
        .delete("kyma-on-order", &DeleteParams::default())
        .await
        .unwrap();
    for name in ["on-order", "kyma-on-order"] {
        eventually(
            &format!("the consumer of {name} to go"),
            Duration::from_secs(30),
            || async { events.consumer(&ns, name).await.is_none() },
        )
        .await
        .unwrap();
    }
    cluster.assert_no_rbac_refusal();
    drop(dispatcher);
    cluster.finish().await;
}

/// Stands in for every function Service (the gateway's `--function-url` points here): answers
/// with the path it was asked for.
async fn function_services() -> String {
    let app = axum::Router::new()
        .fallback(|request: axum::extract::Request| async move { request.uri().path().to_owned() });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// The chart's gateway with its function URLs pointed at `services`.
async fn gateway(cluster: &Cluster, services: &str) -> (Component, String) {
    let function_url = format!("{services}/svc/{{namespace}}/{{function}}");
    let gateway = cluster
        .component(
            "gateway",
            &[
                ("EDDY_GATEWAY_ADDR", "127.0.0.1:0"),
                ("EDDY_FUNCTION_URL", &function_url),
            ],
        )
        .await;
    let url = gateway.url().await;
    let http = reqwest::Client::new();
    eventually(
        "the gateway to list Functions",
        Duration::from_secs(30),
        || async {
            http.get(format!("{url}/readyz"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        },
    )
    .await
    .unwrap();
    (gateway, url)
}

/// GET `url` with an optional bearer token: (status, body).
async fn call(url: &str, token: Option<&str>) -> (u16, String) {
    let mut request = reqwest::Client::new().get(url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    match request.send().await {
        Ok(response) => (
            response.status().as_u16(),
            response.text().await.unwrap_or_default(),
        ),
        Err(error) => (0, error.to_string()),
    }
}

fn with_access(name: &str, access: Value) -> Value {
    let mut spec = inline("module.exports = {main: () => 1}");
    spec["access"] = access;
    function(name, spec)
}

/// The chart's gateway reads Functions from the API server (under its ClusterRole): 404 for one
/// that does not exist, `access` enforced, and it follows changes and deletions.
#[tokio::test]
async fn the_gateway_routes_by_the_functions_it_reads_and_enforces_access() {
    let _serial = serial().await;
    let cluster = Cluster::new("gateway").await;
    let ns = cluster.namespace.clone();
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    let apply = PatchParams::apply("test");
    let digest = eddy_platform::auth::Tokens::digest_text("vault-token");
    functions
        .patch(
            "hello",
            &apply,
            &Patch::Apply(with_access("hello", json!({"mode": "public"}))),
        )
        .await
        .unwrap();
    functions
        .patch(
            "vault",
            &apply,
            &Patch::Apply(with_access(
                "vault",
                json!({"mode": "token", "tokenDigests": [digest]}),
            )),
        )
        .await
        .unwrap();
    let (gateway, url) = gateway(&cluster, &function_services().await).await;

    assert_eq!(
        call(&format!("{url}/{ns}/hello/a?b=c"), None).await,
        (200, format!("/svc/{ns}/hello/a"))
    );
    let (status, body) = call(&format!("{url}/{ns}/nobody/"), None).await;
    assert_eq!(status, 404, "{body}");
    assert!(
        body.contains(&format!("function {ns}/nobody not found")),
        "{body}"
    );
    assert_eq!(call(&format!("{url}/{ns}/vault/"), None).await.0, 401);
    assert_eq!(
        call(&format!("{url}/{ns}/vault/"), Some("other")).await.0,
        401
    );
    assert_eq!(
        call(&format!("{url}/{ns}/vault/"), Some("vault-token")).await,
        (200, format!("/svc/{ns}/vault/"))
    );

    // Changes and deletions are followed.
    functions
        .patch(
            "hello",
            &apply,
            &Patch::Apply(with_access(
                "hello",
                json!({"mode": "token", "tokenDigests": [digest]}),
            )),
        )
        .await
        .unwrap();
    functions
        .delete("vault", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the gateway to follow", Duration::from_secs(30), || async {
        call(&format!("{url}/{ns}/hello/"), None).await.0 == 401
            && call(&format!("{url}/{ns}/vault/"), Some("vault-token"))
                .await
                .0
                == 404
    })
    .await
    .unwrap();
    cluster.assert_no_rbac_refusal();
    drop(gateway);
    cluster.finish().await;
}

/// Kyma's APIRules on the real API server, under the chart's RBAC: both versions are served
/// (the CRD takes Kyma's tutorial manifests as written), the controller reports Kyma's status
/// (Ready with the URL; Error for a host an older APIRule holds, for an `extAuth` authorizer
/// the gateway lacks, and for a Service in another namespace), and the gateway routes a named host to the rule's Service:
/// noAuth 200, JWT 401 without a token and 200 with one, a method no rule lists 404; the
/// APIRule crossing namespaces routes nothing.
#[tokio::test]
async fn apirules_are_reported_by_the_controller_and_honoured_by_the_gateway() {
    use support::jwt::{ISSUER, ISSUER_KEY, jwt, serve_jwks};
    let _serial = serial().await;
    let cluster = Cluster::new("apirules").await;
    let ns = cluster.namespace.clone();
    let (jwks_uri, _) = serve_jwks().await;
    // A Kyma cluster has Kyma's Istio CRD (the Istio module's); this one gets a stand-in.
    install_kyma_istio_crd(&cluster);
    let controller = cluster.controller().await;
    let services = function_services().await;
    let service_url = format!("{services}/svc/{{namespace}}/{{service}}/{{port}}");
    let function_url = format!("{services}/fn/{{namespace}}/{{function}}");
    let gateway = cluster
        .component(
            "gateway",
            &[
                ("EDDY_GATEWAY_ADDR", "127.0.0.1:0"),
                ("EDDY_FUNCTION_URL", &function_url),
                ("EDDY_SERVICE_URL", &service_url),
            ],
        )
        .await;
    let url = gateway.url().await;
    let yaml = format!(
        r#"apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata:
  name: hello
  namespace: {ns}
spec:
  hosts:
    - hello
  service:
    name: hello
    namespace: {ns}
    port: 80
  gateway: kyma-system/kyma-gateway
  rules:
    - path: /*
      methods: ["GET", "POST"]
      noAuth: true
---
apiVersion: gateway.kyma-project.io/v2alpha1
kind: APIRule
metadata:
  name: secured
  namespace: {ns}
spec:
  hosts:
    - secured.example.com
  service:
    name: secured
    namespace: {ns}
    port: 8080
  gateway: kyma-system/kyma-gateway
  rules:
    - jwt:
        authentications:
          - issuer: {ISSUER}
            jwksUri: {jwks_uri}
      methods:
        - GET
      path: /*
"#
    );
    cluster.kubectl_apply(&yaml).unwrap();
    let rules = cluster.dynamic("gateway.kyma-project.io/v2", "APIRule");
    let state_of = |name: &'static str| {
        let rules = rules.clone();
        async move {
            let rule = rules.get(name).await.ok()?;
            let status = rule.data.get("status")?.clone();
            Some((
                status["state"].as_str()?.to_owned(),
                status["description"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                status["lastProcessedTime"].is_string(),
            ))
        }
    };
    eventually("both APIRules Ready", Duration::from_secs(60), || async {
        state_of("hello").await.is_some_and(|s| s.0 == "Ready")
            && state_of("secured").await.is_some_and(|s| s.0 == "Ready")
    })
    .await
    .unwrap();
    assert_eq!(
        state_of("hello").await.unwrap(),
        (
            "Ready".to_owned(),
            "exposed on https://hello.localhost".to_owned(),
            true
        )
    );
    // Created after `hello` (or in its second: then by name, and `hello` < `other-hello`).
    let refused = format!(
        r#"apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata:
  name: other-hello
  namespace: {ns}
spec:
  hosts: [hello]
  service: {{name: other, port: 80}}
  rules: [{{path: /*, methods: [GET], noAuth: true}}]
---
apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata:
  name: outsourced
  namespace: {ns}
spec:
  hosts: [outsourced]
  service: {{name: other, port: 80}}
  rules:
    - path: /*
      methods: [GET]
      extAuth:
        authorizers: [oauth2-proxy]
---
apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata:
  name: crossing
  namespace: {ns}
spec:
  hosts: [crossing]
  service: {{name: eddy-controller, namespace: eddy-system, port: 8082}}
  rules: [{{path: /*, methods: [GET], noAuth: true}}]
"#
    );
    cluster.kubectl_apply(&refused).unwrap();
    eventually("the refusals", Duration::from_secs(60), || async {
        let copy = state_of("other-hello").await;
        let outsourced = state_of("outsourced").await;
        let crossing = state_of("crossing").await;
        copy.is_some_and(|s| {
            s.0 == "Error"
                && s.1 == format!("host hello.localhost is already exposed by APIRule {ns}/hello")
        }) && outsourced
            .is_some_and(|s| s.0 == "Error" && s.1.contains("spec.rules[0].extAuth.authorizers[0]"))
            && crossing.is_some_and(|s| {
                s.0 == "Error"
                    && s.1.starts_with(&format!(
                        "spec.service.namespace: an APIRule in namespace {ns} cannot send calls \
                         to namespace eddy-system"
                    ))
            })
    })
    .await
    .unwrap();

    // The gateway: the host decides the APIRule, the rule the Service and who may call.
    let addr: std::net::SocketAddr = url.trim_start_matches("http://").parse().unwrap();
    let port = addr.port();
    let hosts = reqwest::Client::builder()
        .resolve("hello.localhost", addr)
        .resolve("secured.example.com", addr)
        .resolve("crossing.localhost", addr)
        .build()
        .unwrap();
    let call = |url: String, token: Option<String>| {
        let hosts = hosts.clone();
        async move {
            let mut request = hosts.get(url);
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            match request.send().await {
                Ok(response) => (response.status().as_u16(), response.text().await.unwrap()),
                Err(error) => (0, error.to_string()),
            }
        }
    };
    eventually(
        "the gateway to follow APIRules",
        Duration::from_secs(30),
        || async {
            call(format!("http://hello.localhost:{port}/greet?x=1"), None).await
                == (200, format!("/svc/{ns}/hello/80/greet"))
        },
    )
    .await
    .unwrap();
    let deleted = hosts
        .delete(format!("http://hello.localhost:{port}/greet"))
        .send()
        .await
        .unwrap();
    // No rule lists DELETE: no route, 404 (as Kyma's gateway answers).
    assert_eq!(deleted.status(), 404);
    let secured = format!("http://secured.example.com:{port}/orders");
    assert_eq!(
        call(secured.clone(), None).await,
        (403, "RBAC: access denied".to_owned())
    );
    assert_eq!(
        call(secured, Some(jwt(ISSUER_KEY, "key-1", json!({})))).await,
        (200, format!("/svc/{ns}/secured/8080/orders"))
    );
    // An APIRule crossing into another namespace (here toward the controller's API) routes
    // nothing: its host is no APIRule's, and the path names no function.
    let (status, body) = call(format!("http://crossing.localhost:{port}/apis"), None).await;
    assert_eq!(status, 404, "{body}");
    assert!(!body.contains("/svc/"), "{body}");

    // Kyma's extAuth docs, "Minimal configuration": "To use the extAuth access strategy,
    // you must first configure the authorizer in the Istio custom resource" (in kyma-system,
    // `spec.config.authorizers`). The controller and the gateway read it: the APIRule naming
    // it turns Ready, and calls are asked of it.
    let authorizer = serve_cookie_authorizer().await;
    let istio = format!(
        r#"apiVersion: operator.kyma-project.io/v1alpha2
kind: Istio
metadata: {{name: default, namespace: kyma-system}}
spec:
  config:
    authorizers:
      - name: oauth2-proxy
        service: 127.0.0.1
        port: {authorizer}
        headers:
          inCheck: {{include: [cookie]}}
          toUpstream: {{onAllow: [x-auth-request-user]}}
"#
    );
    run_with_input(
        cluster
            .plane
            .kubectl()
            .unwrap()
            .args(["apply", "--server-side", "-f", "-"]),
        &istio,
    )
    .unwrap();
    eventually(
        "the APIRule naming the Istio resource's authorizer Ready",
        Duration::from_secs(60),
        || async { state_of("outsourced").await.is_some_and(|s| s.0 == "Ready") },
    )
    .await
    .unwrap();
    let outsourced = reqwest::Client::builder()
        .resolve("outsourced.localhost", addr)
        .build()
        .unwrap();
    let ask = |cookie: Option<&'static str>| {
        let outsourced = outsourced.clone();
        async move {
            let mut request = outsourced.get(format!("http://outsourced.localhost:{port}/me"));
            if let Some(cookie) = cookie {
                request = request.header("cookie", cookie);
            }
            let response = request.send().await.unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        }
    };
    eventually(
        "the gateway to ask the Istio resource's authorizer",
        Duration::from_secs(30),
        || async { ask(None).await == (401, "sign in".to_owned()) },
    )
    .await
    .unwrap();
    assert_eq!(
        ask(Some("session=ok")).await,
        (200, format!("/svc/{ns}/other/80/me"))
    );
    // Deleted, the authorizer is gone: the APIRule is an Error again, and routes nothing.
    run(cluster
        .plane
        .kubectl()
        .unwrap()
        .args(["delete", "istio", "default", "-n", "kyma-system"]))
    .unwrap();
    eventually(
        "the APIRule an Error once the Istio resource is gone",
        Duration::from_secs(60),
        || async {
            state_of("outsourced").await.is_some_and(|s| {
                s.0 == "Error" && s.1.contains("no extension provider \"oauth2-proxy\"")
            })
        },
    )
    .await
    .unwrap();
    // Its host routes nothing then (on Kyma, no VirtualService: 404).
    eventually(
        "the gateway to close it",
        Duration::from_secs(30),
        || async {
            let (status, body) = ask(Some("session=ok")).await;
            status == 404 && !body.contains("/svc/")
        },
    )
    .await
    .unwrap();
    cluster.assert_no_rbac_refusal();
    drop(gateway);
    drop(controller);
    cluster.finish().await;
}

/// A stand-in for Kyma's Istio CRD (`istios.operator.kyma-project.io`, the Istio module's),
/// and the `kyma-system` namespace the Istio resource lives in.
fn install_kyma_istio_crd(cluster: &Cluster) {
    let crd = r#"apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: istios.operator.kyma-project.io}
spec:
  group: operator.kyma-project.io
  scope: Namespaced
  names: {kind: Istio, plural: istios, singular: istio, listKind: IstioList}
  versions:
    - name: v1alpha2
      served: true
      storage: true
      subresources: {status: {}}
      schema:
        openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}
---
apiVersion: v1
kind: Namespace
metadata: {name: kyma-system}
"#;
    let kubectl = || cluster.plane.kubectl().unwrap();
    run_with_input(kubectl().args(["apply", "--server-side", "-f", "-"]), crd).unwrap();
    run(kubectl().args([
        "wait",
        "--for=condition=established",
        "--timeout=30s",
        "crd/istios.operator.kyma-project.io",
    ]))
    .unwrap();
}

/// An external authorizer that lets a call through when it carries `session=ok` (saying who
/// with `x-auth-request-user`), and otherwise answers 401 `sign in`. Its port.
async fn serve_cookie_authorizer() -> u16 {
    use axum::response::IntoResponse as _;
    let app = axum::Router::new().fallback(|headers: http::HeaderMap| async move {
        let signed_in = headers
            .get("cookie")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|cookie| cookie.contains("session=ok"));
        if signed_in {
            ([("x-auth-request-user", "ada")], "").into_response()
        } else {
            (http::StatusCode::UNAUTHORIZED, "sign in").into_response()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    port
}

/// Buildless (`controller.build: buildless`, the default) on the real API server under the
/// chart's RBAC: a Kyma Function with dependencies (and the empty `runtimeImageOverride` and
/// profile Kyma's tools write) reaches Running without any build Job, its
/// pods on the runtime image with the `install` init container and the sources' ConfigMap;
/// a changed source rolls to a new ConfigMap (the old one kept until the rollout is done).
#[tokio::test]
async fn buildless_functions_run_without_a_build_or_a_registry() {
    let _serial = serial().await;
    let cluster = Cluster::new("buildless").await;
    // The cluster's presets, in Kyma's Serverless configuration's shape (the chart's
    // `controller.functionPresets`): a Function naming no profile gets `defaultPreset`'s.
    let presets_dir = tempfile::tempdir().unwrap();
    let presets = presets_dir.path().join("presets.yaml");
    std::fs::write(
        &presets,
        "resourcesConfiguration:\n  function:\n    resources:\n      defaultPreset: S\n      presets:\n        S: {requestCpu: 70m, requestMemory: 100Mi, limitCpu: 140m, limitMemory: 200Mi}\n",
    )
    .unwrap();
    let controller = cluster
        .component(
            "controller",
            &[
                ("EDDY_API_ADDR", "127.0.0.1:0"),
                ("EDDY_BUILD", "buildless"),
                (
                    "EDDY_RUNTIME_IMAGES",
                    "runtimes.test/eddy-runtime-{runtime}:{version}",
                ),
                ("EDDY_FUNCTION_PRESETS", presets.to_str().unwrap()),
            ],
        )
        .await;
    let ns = cluster.namespace.clone();
    let kyma = format!(
        r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: hello
  namespace: {ns}
spec:
  runtime: nodejs22
  # As Kyma's tools write a field left blank: not set, in the CRD and in the Deployment.
  runtimeImageOverride: ""
  resourceConfiguration:
    function:
      profile: ""
  source:
    inline:
      source: "module.exports = {{ main: () => require('lodash').capitalize('hi') }}"
      dependencies: '{{"dependencies": {{"lodash": "^4.17.21"}}}}'
"#
    );
    cluster.kubectl_apply(&kyma).unwrap();
    let api = "serverless.kyma-project.io/v1alpha2";
    cluster
        .wait_running(api, "hello", Duration::from_secs(60))
        .await;
    let (status, reason, message) = cluster.condition(api, "hello", "BuildReady").await.unwrap();
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "Buildless"),
        "{message}"
    );
    let jobs: Api<Job> = cluster.api();
    let deployments: Api<Deployment> = cluster.api();
    let config_maps: Api<k8s_openapi::api::core::v1::ConfigMap> = cluster.api();
    let selector = ListParams::default().labels("eddy.dev/function=hello");
    assert!(
        jobs.list(&selector).await.unwrap().items.is_empty(),
        "no build Job"
    );
    let version = env!("CARGO_PKG_VERSION");
    let deployment = deployments.get("hello").await.unwrap();
    assert_eq!(
        image_of(&deployment),
        format!("runtimes.test/eddy-runtime-nodejs22:{version}")
    );
    let pod = deployment.spec.template.spec.unwrap();
    let resources = pod.containers[0].resources.clone().unwrap();
    let quantities = |map: Option<
        std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    >| {
        map.unwrap_or_default()
            .into_iter()
            .map(|(name, quantity)| (name, quantity.0))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        quantities(resources.requests),
        [
            ("cpu".to_owned(), "70m".to_owned()),
            ("memory".to_owned(), "100Mi".to_owned())
        ],
        "the configured defaultPreset S"
    );
    assert_eq!(
        quantities(resources.limits),
        [
            ("cpu".to_owned(), "140m".to_owned()),
            ("memory".to_owned(), "200Mi".to_owned())
        ]
    );
    let install = &pod.init_containers.clone().unwrap()[0];
    assert_eq!(install.name, "install");
    let first_config_map = config_maps.list(&selector).await.unwrap().items;
    assert_eq!(first_config_map.len(), 1);
    // Kyma's short names: `fn` and `fns` name Kyma's Function (eddy's own is `efn`).
    for short in ["fn", "fns"] {
        let mut kubectl = cluster.plane.kubectl().unwrap();
        kubectl.args(["get", short, "-o", "name", "-n", &ns]);
        assert_eq!(
            run(&mut kubectl).unwrap().trim(),
            "function.serverless.kyma-project.io/hello",
            "kubectl get {short}"
        );
    }
    let mut kubectl = cluster.plane.kubectl().unwrap();
    kubectl.args(["get", "efn", "-o", "name", "-n", &ns]);
    assert_eq!(
        run(&mut kubectl).unwrap().trim(),
        "",
        "no eddy Function here"
    );

    // A new source: a new ConfigMap; the old one goes once the rollout is done.
    let changed = kyma.replace("capitalize('hi')", "capitalize('ho')");
    cluster.kubectl_apply(&changed).unwrap();
    let old = first_config_map[0].metadata.name.clone().unwrap();
    eventually(
        "the new ConfigMap alone, once rolled out",
        Duration::from_secs(60),
        || async {
            let names: Vec<String> = config_maps
                .list(&selector)
                .await
                .unwrap()
                .items
                .into_iter()
                .filter_map(|c| c.metadata.name)
                .collect();
            names.len() == 1 && names[0] != old
        },
    )
    .await
    .unwrap();
    assert!(
        jobs.list(&selector).await.unwrap().items.is_empty(),
        "still no Job"
    );

    cluster.assert_no_rbac_refusal();
    drop(controller);
    cluster.finish().await;
}

/// Removes kyma-system's package registry Secret when a test ends, passed or not: the cluster
/// is shared, and another test's Functions must not install with it.
struct ClusterRegistrySecret(&'static ControlPlane);

impl Drop for ClusterRegistrySecret {
    fn drop(&mut self) {
        if let Ok(mut kubectl) = self.0.kubectl() {
            kubectl.args([
                "delete",
                "secret",
                "serverless-package-registry-config",
                "-n",
                "kyma-system",
                "--ignore-not-found",
            ]);
            let _ = run(&mut kubectl);
        }
    }
}

/// Kyma's private package registry Secret under the chart's RBAC: kyma-system's labelled one is
/// copied into the Function's namespace (the one Secret name the controller may write) and
/// mounted into the buildless `install` init container only; the namespace's own Secret then
/// wins and the copy goes. The controller watches Secrets of that name alone (the only Secrets
/// the chart lets it list), and the audit log shows no request of it refused.
#[tokio::test]
async fn kyma_s_package_registry_secret_reaches_the_install_only_under_the_charts_rbac() {
    let _serial = serial().await;
    let cluster = Cluster::new("registry").await;
    let _controller = cluster
        .component(
            "controller",
            &[
                ("EDDY_API_ADDR", "127.0.0.1:0"),
                ("EDDY_BUILD", "buildless"),
                (
                    "EDDY_RUNTIME_IMAGES",
                    "runtimes.test/eddy-runtime-{runtime}:{version}",
                ),
            ],
        )
        .await;
    let ns = cluster.namespace.clone();
    cluster
        .kubectl_apply(&format!(
            r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: greet
  namespace: {ns}
spec:
  runtime: nodejs24
  source:
    inline:
      source: "module.exports = {{ main: () => require('@acme/greeting').hello() }}"
      dependencies: '{{"dependencies": {{"@acme/greeting": "1.0.0"}}}}'
"#
        ))
        .unwrap();
    let deployments: Api<Deployment> = cluster.api();
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = cluster.api();
    // Which Secret the install mounts, and whether the function's container mounts none.
    let registry_mount = || async {
        let deployment = deployments.get_opt("greet").await.ok()??;
        let pod = deployment.spec.template.spec?;
        let install = pod
            .init_containers?
            .into_iter()
            .find(|c| c.name == "install")?;
        let mounted = install
            .volume_mounts?
            .into_iter()
            .find(|m| m.name == "package-registry")?;
        assert_eq!(mounted.mount_path, "/eddy/package-registry");
        assert!(
            pod.containers[0]
                .volume_mounts
                .iter()
                .flatten()
                .all(|m| m.name != "package-registry"),
            "the function's container mounts the registry"
        );
        pod.volumes?
            .into_iter()
            .find(|v| v.name == "package-registry")?
            .secret?
            .secret_name
    };
    eventually("the Deployment", Duration::from_secs(60), || async {
        deployments.get_opt("greet").await.ok().flatten().is_some()
    })
    .await
    .unwrap();
    assert_eq!(registry_mount().await, None);

    let _cleanup = ClusterRegistrySecret(cluster.plane);
    let cluster_secret = r#"apiVersion: v1
kind: Secret
metadata:
  name: serverless-package-registry-config
  namespace: kyma-system
  labels: {"serverless.kyma-project.io/config": credentials}
type: Opaque
stringData:
  .npmrc: |
    @acme:registry=https://npm.acme.example/
    //npm.acme.example/:_authToken=cluster-token
"#;
    let mut kubectl = cluster.plane.kubectl().unwrap();
    kubectl.args(["apply", "--server-side", "-n", "kyma-system", "-f", "-"]);
    run_with_input(&mut kubectl, cluster_secret).unwrap();
    eventually(
        "the install to mount the copy of kyma-system's Secret",
        Duration::from_secs(60),
        || async { registry_mount().await.as_deref() == Some("eddy-package-registry-config") },
    )
    .await
    .unwrap();
    let copy = secrets.get("eddy-package-registry-config").await.unwrap();
    assert_eq!(
        copy.data.unwrap()[".npmrc"].0,
        b"@acme:registry=https://npm.acme.example/\n//npm.acme.example/:_authToken=cluster-token\n"
    );

    // The namespace's own Secret wins; the copy goes.
    cluster
        .kubectl_apply(
            "apiVersion: v1\nkind: Secret\nmetadata: {name: serverless-package-registry-config}\ntype: Opaque\nstringData:\n  .npmrc: \"@acme:registry=https://npm.own.example/\\n\"\n",
        )
        .unwrap();
    eventually(
        "the install to mount the namespace's own Secret, the copy gone",
        Duration::from_secs(60),
        || async {
            registry_mount().await.as_deref() == Some("serverless-package-registry-config")
                && secrets
                    .get_opt("eddy-package-registry-config")
                    .await
                    .is_ok_and(|copy| copy.is_none())
        },
    )
    .await
    .unwrap();
    cluster.assert_no_rbac_refusal();
    cluster.finish().await;
}

/// Puts back the chart's publisher alias a test replaced (the cluster is shared).
struct PublisherAlias(&'static ControlPlane, String);

impl Drop for PublisherAlias {
    fn drop(&mut self) {
        for args in [
            &[
                "delete",
                "functions.serverless.kyma-project.io",
                "eventing-publisher-proxy",
                "-n",
                "kyma-system",
                "--ignore-not-found",
                "--wait=false",
            ][..],
            &[
                "delete",
                "service",
                "eventing-publisher-proxy",
                "-n",
                "kyma-system",
                "--ignore-not-found",
            ][..],
        ] {
            if let Ok(mut kubectl) = self.0.kubectl() {
                kubectl.args(args);
                let _ = run(&mut kubectl);
            }
        }
        if let Ok(mut kubectl) = self.0.kubectl() {
            kubectl.args(["create", "-f", "-"]);
            let _ = run_with_input(&mut kubectl, &self.1);
        }
    }
}

/// Kyma's own tests deploy a publisher mock as a Function named `eventing-publisher-proxy` in
/// `kyma-system`: created after the chart's alias of that name, it replaces the alias (the
/// controller deletes the ExternalName Service, the only Services it may delete) and its own
/// Service takes the name, under the chart's RBAC.
#[tokio::test]
async fn a_function_named_as_kyma_s_publisher_proxy_replaces_the_chart_s_alias() {
    let _serial = serial().await;
    let cluster = Cluster::new("publisher").await;
    let services: Api<k8s_openapi::api::core::v1::Service> =
        Api::namespaced(cluster.admin.clone(), "kyma-system");
    let alias = services.get("eventing-publisher-proxy").await.unwrap();
    assert_eq!(
        alias.spec.as_ref().unwrap().type_.as_deref(),
        Some("ExternalName")
    );
    let mut saved = serde_json::to_value(&alias).unwrap();
    for field in [
        "resourceVersion",
        "uid",
        "creationTimestamp",
        "managedFields",
    ] {
        saved["metadata"].as_object_mut().unwrap().remove(field);
    }
    saved.as_object_mut().unwrap().remove("status");
    let _restore = PublisherAlias(cluster.plane, saved.to_string());
    let _controller = cluster
        .component(
            "controller",
            &[
                ("EDDY_API_ADDR", "127.0.0.1:0"),
                ("EDDY_BUILD", "buildless"),
                (
                    "EDDY_RUNTIME_IMAGES",
                    "runtimes.test/eddy-runtime-{runtime}:{version}",
                ),
            ],
        )
        .await;
    let mut kubectl = cluster.plane.kubectl().unwrap();
    kubectl.args(["apply", "--server-side", "-n", "kyma-system", "-f", "-"]);
    run_with_input(
        &mut kubectl,
        r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: eventing-publisher-proxy
  namespace: kyma-system
spec:
  runtime: nodejs24
  source:
    inline:
      source: "module.exports = { main: (event) => { console.log(JSON.stringify(event.data)); return ''; } }"
"#,
    )
    .unwrap();
    eventually(
        "the Function's own Service to take the alias's name",
        Duration::from_secs(60),
        || async {
            services
                .get_opt("eventing-publisher-proxy")
                .await
                .ok()
                .flatten()
                .and_then(|service| service.spec)
                .is_some_and(|spec| {
                    spec.type_.as_deref() != Some("ExternalName")
                        && spec.selector.is_some_and(|s| {
                            // Kyma's label contract: the Service selects by Kyma's labels.
                            s.get("serverless.kyma-project.io/function-name")
                                .map(String::as_str)
                                == Some("eventing-publisher-proxy")
                        })
                })
        },
    )
    .await
    .unwrap();
    // The other alias is untouched.
    let other = services
        .get("eventing-event-publisher-proxy")
        .await
        .unwrap();
    assert_eq!(other.spec.unwrap().type_.as_deref(), Some("ExternalName"));
    cluster.assert_no_rbac_refusal();
    cluster.finish().await;
}

/// `kubectl apply` of a Function on a runtime Kyma's schedule deprecates prints the warning
/// `eddy apply` prints (the chart's admission policy, Warn only), and the Function is stored;
/// a current runtime draws none.
#[tokio::test]
async fn kubectl_apply_warns_of_a_deprecated_runtime() {
    let _serial = serial().await;
    let cluster = Cluster::new("deprecated").await;
    let ns = cluster.namespace.clone();
    let manifest = |name: &str, runtime: &str| {
        format!(
            "apiVersion: serverless.kyma-project.io/v1alpha2\nkind: Function\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  runtime: {runtime}\n  source:\n    inline:\n      source: \"module.exports = {{ main: () => 'hi' }}\"\n"
        )
    };
    let apply = |yaml: String| {
        let mut kubectl = cluster.plane.kubectl().unwrap();
        kubectl.args(["apply", "-f", "-"]);
        kubectl
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = kubectl.spawn().unwrap();
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), yaml.as_bytes()).unwrap();
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success(), "{output:?}");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let warned = apply(manifest("old", "nodejs20"));
    assert!(
        warned.contains(
            "spec.runtime: runtime nodejs20 is deprecated and will be removed in the future \
             (Kyma's deprecation schedule); move to nodejs26"
        ),
        "{warned}"
    );
    let quiet = apply(manifest("new", "nodejs24"));
    assert!(!quiet.contains("deprecated"), "{quiet}");
    let stored = cluster
        .dynamic("serverless.kyma-project.io/v1alpha2", "Function")
        .get_opt("old")
        .await
        .unwrap();
    assert!(stored.is_some());
    cluster.finish().await;
}
