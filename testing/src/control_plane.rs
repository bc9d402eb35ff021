//! A real Kubernetes control plane for the tests: etcd, kube-apiserver, kube-controller-manager,
//! kube-scheduler and kwok as the node, started by `scripts/kube up` on loopback ports.
//!
//! [`ControlPlane::shared`] starts one per test run and hands it to every test that asks: the
//! first test process to get there starts it (under a file lock) in a directory named after the
//! test runner's process (nextest, or cargo for `cargo test`), and the control plane stops when
//! that runner exits. Tests keep apart by namespace ([`ControlPlane::namespace`]) and by Helm
//! release. What the API server decides (CEL, defaults, RBAC, Leases, watches, garbage
//! collection) is asserted against it; no container runs (kwok only marks pods Running, Ready
//! and, for a Job's pod, Succeeded).

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use k8s_openapi::api::{
    authentication::v1::{TokenRequest, TokenRequestSpec},
    core::v1::{Namespace, ServiceAccount},
};
use kube::{
    Api, Client,
    api::{DeleteParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
};

/// The repository's root directory.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// Where `scripts/setup` puts the tools (`EDDY_TOOLS_DIR`, default `.tools`).
pub fn tools() -> PathBuf {
    std::env::var_os("EDDY_TOOLS_DIR").map_or_else(|| repo().join(".tools"), PathBuf::from)
}

/// A tool from the tools dir (`relative`, e.g. `bin/helm`), else by its name from PATH; a clear
/// error when neither has it.
pub fn tool(relative: &str) -> Result<PathBuf> {
    let installed = tools().join(relative);
    if installed.is_file() {
        return Ok(installed);
    }
    let name = Path::new(relative)
        .file_name()
        .context("a tool's file name")?;
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
        .with_context(|| {
            format!(
                "{} is not installed: run scripts/setup --tests",
                name.to_string_lossy()
            )
        })
}

/// Runs `command`; its stdout, or an error with both outputs.
pub fn run(command: &mut Command) -> Result<String> {
    let output = command
        .output()
        .with_context(|| format!("starting {command:?}"))?;
    outcome(command, &output)
}

/// [`run`] with `input` on the command's stdin (`kubectl apply -f -`).
pub fn run_with_input(command: &mut Command, input: &str) -> Result<String> {
    use std::{io::Write as _, process::Stdio};
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {command:?}"))?;
    child
        .stdin
        .take()
        .context("the command's stdin")?
        .write_all(input.as_bytes())?;
    let output = child.wait_with_output()?;
    outcome(command, &output)
}

fn outcome(command: &Command, output: &std::process::Output) -> Result<String> {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    ensure!(
        output.status.success(),
        "{command:?} failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(stdout)
}

/// A copy of the chart in `dir`, for a test to install or render (and change when it must).
pub fn chart_copy(dir: &Path) -> Result<PathBuf> {
    let chart = dir.join("eddy");
    run(Command::new("cp")
        .arg("-r")
        .arg(repo().join("charts/eddy"))
        .arg(&chart))?;
    Ok(chart)
}

/// A running control plane (see the module docs).
#[derive(Debug)]
pub struct ControlPlane {
    dir: PathBuf,
    kubeconfig: PathBuf,
}

/// What runs the pods of a control plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Node {
    /// kwok: pods are marked Running, no container runs.
    Kwok,
    /// A real kubelet with containerd and runc in an Istio mesh (`scripts/kube up --node real
    /// --mesh istio`), with every image of `scripts/images` loaded.
    Real,
}

impl ControlPlane {
    /// The control plane of this test run, started on first use.
    pub fn shared() -> Result<&'static ControlPlane> {
        static SHARED: OnceLock<ControlPlane> = OnceLock::new();
        if let Some(plane) = SHARED.get() {
            return Ok(plane);
        }
        let plane = Self::start_or_join(Node::Kwok)?;
        Ok(SHARED.get_or_init(|| plane))
    }

    /// The control plane with a real node of this test run, started on first use, with
    /// eddy's images built and loaded into the node (`scripts/images`). A node that cannot
    /// start is an error with its reason, never a skip.
    pub fn real_node() -> Result<&'static ControlPlane> {
        static REAL: OnceLock<ControlPlane> = OnceLock::new();
        if let Some(plane) = REAL.get() {
            return Ok(plane);
        }
        let plane = Self::start_or_join(Node::Real)?;
        Ok(REAL.get_or_init(|| plane))
    }

    fn start_or_join(node: Node) -> Result<Self> {
        let runner = std::os::unix::process::parent_id();
        let name = match node {
            Node::Kwok => format!("eddy-kube-{runner}"),
            Node::Real => format!("eddy-kube-real-{runner}"),
        };
        let dir = std::env::temp_dir().join(name);
        std::fs::create_dir_all(&dir)?;
        let lock = std::fs::File::create(dir.join("start.lock"))?;
        lock.lock()?;
        let plane = Self {
            kubeconfig: dir.join("admin.kubeconfig"),
            dir,
        };
        if !plane.serving() {
            let started = std::time::Instant::now();
            let mut up = Command::new(repo().join("scripts/kube"));
            up.arg("up");
            if node == Node::Real {
                // In Istio's mesh, as every Kyma cluster is (scripts/kube-mesh).
                up.args(["--node", "real", "--mesh", "istio"]);
            }
            let output = up
                .env("EDDY_KUBE_DIR", &plane.dir)
                .env("EDDY_KUBE_OWNER_PID", runner.to_string())
                .output()
                .context("running scripts/kube up")?;
            ensure!(
                output.status.success(),
                "scripts/kube up failed ({}):\n{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
            ensure!(
                plane.serving(),
                "scripts/kube up finished but the API server does not answer"
            );
            eprintln!(
                "control plane up in {:.1} s ({})",
                started.elapsed().as_secs_f64(),
                plane.dir.display()
            );
            if node == Node::Real {
                let started = std::time::Instant::now();
                run(Command::new(repo().join("scripts/images")).env("EDDY_KUBE_DIR", &plane.dir))
                    .context("scripts/images")?;
                eprintln!(
                    "images ready on the node in {:.1} s",
                    started.elapsed().as_secs_f64()
                );
            }
        }
        drop(lock);
        Ok(plane)
    }

    /// The forward proxy on a real node's bridge, pods' one way out (`http://<ip>:<port>`).
    pub fn egress_proxy(&self) -> Result<String> {
        let url = std::fs::read_to_string(self.dir.join("proxy.url"))
            .context("the real node's proxy.url (a kwok control plane has none)")?;
        Ok(url.trim().to_owned())
    }

    /// The real node's address (its name too): pods reach the host there, on the node's bridge.
    pub fn node_ip(&self) -> Result<String> {
        let proxy = self.egress_proxy()?;
        proxy
            .strip_prefix("http://")
            .and_then(|rest| rest.split(':').next())
            .map(str::to_owned)
            .with_context(|| format!("no address in the proxy URL {proxy}"))
    }

    /// Whether the last `scripts/kube up` in its directory finished (a failed one leaves no
    /// `up.done`) and its API server answers `/readyz`.
    fn serving(&self) -> bool {
        self.dir.join("up.done").is_file()
            && self.kubeconfig.is_file()
            && self
                .kubectl()
                .is_ok_and(|mut kubectl| run(kubectl.args(["get", "--raw", "/readyz"])).is_ok())
    }

    /// The admin kubeconfig (`system:masters`).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Where the control plane keeps its state and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A client with the admin's rights.
    pub async fn client(&self) -> Result<Client> {
        client_from(&self.kubeconfig).await
    }

    /// `kubectl` with the admin kubeconfig.
    pub fn kubectl(&self) -> Result<Command> {
        let mut command = Command::new(tool("bin/kubectl")?);
        command.arg("--kubeconfig").arg(&self.kubeconfig);
        Ok(command)
    }

    /// `helm` with the admin kubeconfig.
    pub fn helm(&self) -> Result<Command> {
        let mut command = Command::new(tool("bin/helm")?);
        command.arg("--kubeconfig").arg(&self.kubeconfig);
        Ok(command)
    }

    /// A new namespace named `<prefix>-<random>`, for one test.
    pub async fn namespace(&self, client: &Client, prefix: &str) -> Result<String> {
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let name = format!("{prefix}-{}", &suffix[..8]);
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let namespace: Namespace = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name}
        }))?;
        namespaces
            .create(&PostParams::default(), &namespace)
            .await
            .with_context(|| format!("creating namespace {name}"))?;
        // ServiceAccount admission needs the namespace's `default` account, which the
        // controller-manager makes.
        let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), &name);
        crate::eventually(
            "the namespace's default ServiceAccount",
            Duration::from_secs(30),
            || {
                let accounts = accounts.clone();
                async move { accounts.get_opt("default").await.is_ok_and(|a| a.is_some()) }
            },
        )
        .await?;
        Ok(name)
    }

    /// Deletes a namespace (and so everything in it) without waiting.
    pub async fn delete_namespace(&self, client: &Client, name: &str) -> Result<()> {
        let namespaces: Api<Namespace> = Api::all(client.clone());
        namespaces.delete(name, &DeleteParams::default()).await?;
        Ok(())
    }

    /// A kubeconfig file at `path` that authenticates as ServiceAccount `namespace/account`
    /// with a token from the TokenRequest API: a process given it has exactly that account's
    /// rights, as a pod running under it would.
    pub async fn service_account_kubeconfig(
        &self,
        client: &Client,
        namespace: &str,
        account: &str,
        path: &Path,
    ) -> Result<PathBuf> {
        let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                expiration_seconds: Some(24 * 3600),
                ..TokenRequestSpec::default()
            }),
            ..TokenRequest::default()
        };
        let answer: TokenRequest = accounts
            .create_subresource("token", account, &PostParams::default(), &request)
            .await
            .with_context(|| format!("a token for ServiceAccount {namespace}/{account}"))?;
        let token = answer
            .status
            .and_then(|status| status.token)
            .context("the TokenRequest answer has no token")?;
        let admin = Kubeconfig::read_from(&self.kubeconfig)?;
        let cluster = admin
            .clusters
            .first()
            .and_then(|named| named.cluster.clone())
            .context("the admin kubeconfig names a cluster")?;
        let server = cluster.server.context("the cluster's server")?;
        let ca = cluster
            .certificate_authority
            .context("the cluster's certificate authority")?;
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: eddy-test\n  cluster: {{server: \"{server}\", certificate-authority: \"{ca}\"}}\nusers:\n- name: {account}\n  user: {{token: \"{token}\"}}\ncontexts:\n- name: eddy-test\n  context: {{cluster: eddy-test, user: {account}, namespace: {namespace}}}\ncurrent-context: eddy-test\n"
        );
        std::fs::write(path, text)?;
        Ok(path.to_path_buf())
    }

    /// Compacts etcd at its current revision, so that a watch resuming from an older
    /// resourceVersion gets `410 Gone` and must list again.
    pub fn compact_etcd(&self) -> Result<()> {
        let port = std::fs::read_to_string(self.dir.join("etcd.port"))?;
        let endpoint = format!("http://127.0.0.1:{}", port.trim());
        let status = run(Command::new("curl").args([
            "-sf",
            "-X",
            "POST",
            &format!("{endpoint}/v3/kv/range"),
            "-d",
            r#"{"key":"AA==","limit":1}"#,
        ]))?;
        let status: serde_json::Value = serde_json::from_str(&status)?;
        let revision = status["header"]["revision"]
            .as_str()
            .context("etcd's revision")?;
        run(Command::new("curl").args([
            "-sf",
            "-X",
            "POST",
            &format!("{endpoint}/v3/kv/compaction"),
            "-d",
            &format!(r#"{{"revision":"{revision}","physical":true}}"#),
        ]))?;
        Ok(())
    }
}

impl ControlPlane {
    /// Stops and starts the API server (same port, same etcd): every watch breaks and
    /// resumes from the revision it had seen, against a new watch cache.
    pub fn restart_api_server(&self) -> Result<()> {
        let script = repo().join("scripts/kube");
        run(Command::new(&script)
            .args(["stop", "kube-apiserver"])
            .env("EDDY_KUBE_DIR", &self.dir))?;
        run(Command::new(&script)
            .arg("up")
            .env("EDDY_KUBE_DIR", &self.dir))?;
        Ok(())
    }
}

/// A client from a kubeconfig file.
pub async fn client_from(kubeconfig: &Path) -> Result<Client> {
    let config = kube::Config::from_custom_kubeconfig(
        Kubeconfig::read_from(kubeconfig)?,
        &KubeConfigOptions::default(),
    )
    .await?;
    Ok(Client::try_from(config)?)
}
