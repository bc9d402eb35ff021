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
    control_plane::{ControlPlane, chart_copy, repo, run, run_with_input},
    eventually,
};
use k8s_openapi::api::{
    apps::v1::Deployment,
    autoscaling::v2::HorizontalPodAutoscaler,
    batch::v1::Job,
    coordination::v1::Lease,
    core::v1::{ConfigMap, Secret, Service},
};
use kube::{
    Api, Client,
    api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams},
    core::{ApiResource, GroupVersionKind},
};
use serde_json::{Value, json};

#[path = "../../model/tests/cases/mod.rs"]
mod cases;
#[path = "../support/mod.rs"]
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
        let dir = tempfile::tempdir()?;
        let secrets: Api<Secret> = Api::namespaced(admin.clone(), SYSTEM);
        let secret_key = async |secret: &str, key: &str| -> Result<String> {
            let data = secrets
                .get(secret)
                .await
                .with_context(|| format!("Secret {secret}"))?
                .data
                .unwrap_or_default();
            let value = data
                .get(key)
                .with_context(|| format!("Secret {secret} has no {key}"))?;
            Ok(String::from_utf8(value.0.clone())?)
        };
        // The pod's Secret and ConfigMap mounts, as files of the process's own: a path under
        // a mount in the env points there instead.
        let mut mounts: Vec<(String, PathBuf)> = Vec::new();
        for mount in container.volume_mounts.iter().flatten() {
            let Some(volume) = pod
                .volumes
                .iter()
                .flatten()
                .find(|volume| volume.name == mount.name)
            else {
                continue;
            };
            let files: BTreeMap<String, String> = if let Some(secret) = &volume.secret {
                let secret_name = secret.secret_name.clone().unwrap_or_default();
                let data = secrets.get(&secret_name).await?.data.unwrap_or_default();
                data.into_iter()
                    .map(|(key, value)| (key, String::from_utf8_lossy(&value.0).into_owned()))
                    .collect()
            } else if let Some(config_map) = &volume.config_map {
                let config_maps: Api<ConfigMap> = Api::namespaced(admin.clone(), SYSTEM);
                config_maps
                    .get(&config_map.name)
                    .await?
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .collect()
            } else {
                continue;
            };
            let local = dir.path().join("mounts").join(&mount.name);
            std::fs::create_dir_all(&local)?;
            for (key, text) in files {
                std::fs::write(local.join(key), text)?;
            }
            mounts.push((mount.mount_path.clone(), local));
        }
        let mut env = BTreeMap::new();
        for var in container.env.iter().flatten() {
            let value = match (&var.value, &var.value_from) {
                (Some(value), _) => mounts
                    .iter()
                    .find_map(|(path, local)| {
                        let rest = value.strip_prefix(path.as_str())?.trim_start_matches('/');
                        Some(local.join(rest).to_string_lossy().into_owned())
                    })
                    .unwrap_or_else(|| value.clone()),
                (None, Some(from)) => match (&from.field_ref, &from.secret_key_ref) {
                    (Some(field), _) if field.field_path == "metadata.namespace" => {
                        SYSTEM.to_owned()
                    }
                    (Some(field), _) if field.field_path == "metadata.name" => identity.clone(),
                    (None, Some(key)) => secret_key(&key.name, &key.key).await?,
                    other => panic!("{name}: env {} from {other:?}", var.name),
                },
                (None, None) => String::new(),
            };
            env.insert(var.name.clone(), value);
        }
        for (key, value) in overrides {
            env.insert((*key).to_owned(), (*value).to_owned());
        }
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

mod apirules;
mod chart;
mod controller;
mod delivery;
mod kyma;
mod leadership;
mod routes;
mod validation;

// Helpers the topics share.
use self::{controller::*, delivery::*, routes::*};
