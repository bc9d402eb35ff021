//! `eddy up` as a user runs it: the real binary as a child process on free ports, its addresses
//! read from what it prints, stopped with a signal.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{path::Path, process::Stdio, time::Duration};

use eddy_testing::eventually;
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt as _;

/// A running `eddy up`.
pub struct Up {
    pub child: tokio::process::Child,
    pub bus: String,
    pub api: String,
    pub gateway: String,
    pub dispatcher: String,
    pub nats: String,
    /// Every line `eddy up` printed after "ready".
    pub output: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

pub use eddy_testing::control_plane::repo;

impl Up {
    /// `eddy up` on free ports with `extra` flags and `env`, once it says "ready".
    pub async fn start(data_dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Self {
        Self::start_in(&repo(), data_dir, extra, env).await
    }

    /// [`Up::start`] with `cwd` as its working directory.
    pub async fn start_in(
        cwd: &Path,
        data_dir: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_eddy"));
        command
            .arg("up")
            .arg("--data-dir")
            .arg(data_dir)
            .args(["--bus-addr", "127.0.0.1:0", "--api-addr", "127.0.0.1:0"])
            .args([
                "--gateway-addr",
                "127.0.0.1:0",
                "--dispatcher-addr",
                "127.0.0.1:0",
            ])
            .args(extra)
            .env("EDDY_LOG", "warn")
            // The runtimes' libraries are installed once for the whole suite.
            .env("EDDY_RUNTIMES_DIR", repo().join("target/eddy-runtimes"))
            .current_dir(cwd)
            // The tools are found as a user's eddy finds them: above its working directory,
            // else above its binary.
            .env_remove("EDDY_TOOLS_DIR")
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        for (name, value) in env {
            command.env(name, value);
        }
        let mut child = command.spawn().unwrap();
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let mut up = Self {
            child,
            bus: String::new(),
            api: String::new(),
            gateway: String::new(),
            dispatcher: String::new(),
            nats: String::new(),
            output: std::sync::Arc::default(),
        };
        tokio::time::timeout(Duration::from_secs(180), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                let url = line
                    .split_whitespace()
                    .nth(2)
                    .unwrap_or_default()
                    .to_owned();
                match line.split_whitespace().next() {
                    Some("nats") => up.nats = url,
                    Some("event-bus") => up.bus = url.trim_end_matches("/publish").to_owned(),
                    Some("controller") => up.api = url,
                    Some("gateway") => up.gateway = url.split("/<").next().unwrap().to_owned(),
                    Some("dispatcher") => up.dispatcher = url,
                    Some("ready") => return,
                    _ => {}
                }
            }
            panic!("eddy up exited before it was ready");
        })
        .await
        .expect("eddy up did not get ready in time");
        let output = up.output.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                output.lock().unwrap().push(line);
            }
        });
        up
    }

    /// The Functions collection of the default namespace.
    pub fn functions(&self) -> String {
        format!(
            "{}/apis/eddy.dev/v1alpha1/namespaces/default/functions",
            self.api
        )
    }

    /// A binary-mode publish with the required attributes, to send as it is or add to.
    pub fn binary(&self, source: &str, id: &str, ty: &str) -> reqwest::RequestBuilder {
        reqwest::Client::new()
            .post(format!("{}/publish", self.bus))
            .header("ce-specversion", "1.0")
            .header("ce-id", id)
            .header("ce-source", source)
            .header("ce-type", ty)
    }

    /// Publishes one binary-mode event from source `shop`; expects 204.
    pub async fn publish(&self, ty: &str, id: &str, data: Value) {
        let response = self
            .binary("shop", id, ty)
            .header("content-type", "application/json")
            .body(data.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 204);
    }

    pub async fn get(&self, url: String) -> Value {
        reqwest::get(url).await.unwrap().json().await.unwrap()
    }

    /// PUTs a Function or Subscription manifest into the default namespace.
    pub async fn apply(&self, manifest: Value) {
        self.apply_with_token(None, manifest).await;
    }

    /// [`Up::apply`] with the API's bearer token (`eddy up --api-tokens`).
    pub async fn apply_with_token(&self, token: Option<&str>, manifest: Value) {
        let kind = if manifest["kind"] == "Function" {
            "functions"
        } else {
            "subscriptions"
        };
        let name = manifest["metadata"]["name"].as_str().unwrap().to_owned();
        let mut request = reqwest::Client::new().put(format!(
            "{}/apis/eddy.dev/v1alpha1/namespaces/default/{kind}/{name}",
            self.api
        ));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request.json(&manifest).send().await.unwrap();
        assert!(
            response.status().is_success(),
            "{}",
            response.text().await.unwrap()
        );
    }

    /// Applies a Function and waits until it runs.
    pub async fn deploy(&self, name: &str, spec: Value) {
        self.apply(json!({
            "apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec,
        }))
        .await;
        let http = reqwest::Client::new();
        let url = format!("{}/{name}", self.functions());
        eventually(
            &format!("function {name} running"),
            Duration::from_secs(120),
            || async {
                let Ok(response) = http.get(&url).send().await else {
                    return false;
                };
                let function: Value = response.json().await.unwrap_or_default();
                function["status"]["conditions"]
                    .as_array()
                    .is_some_and(|all| {
                        all.iter()
                            .any(|c| c["type"] == "Running" && c["status"] == "True")
                    })
            },
        )
        .await
        .unwrap();
    }

    /// Runs the eddy CLI against this platform; returns (success, stdout, stderr).
    pub async fn eddy(&self, args: &[&str]) -> (bool, String, String) {
        eddy_testing::eddy_cli(env!("CARGO_BIN_EXE_eddy"), self.urls(), args, None).await
    }

    /// `eddy apply -f -` of `manifests` (YAML, several documents allowed); returns (success,
    /// stdout, stderr).
    pub async fn apply_text(&self, manifests: &str) -> (bool, String, String) {
        let args = ["apply", "-f", "-"];
        eddy_testing::eddy_cli(
            env!("CARGO_BIN_EXE_eddy"),
            self.urls(),
            &args,
            Some(manifests),
        )
        .await
    }

    fn urls(&self) -> eddy_testing::EddyUrls<'_> {
        eddy_testing::EddyUrls {
            api: &self.api,
            bus: &self.bus,
            dispatcher: &self.dispatcher,
        }
    }

    /// Sends `signal` (as `kill -<signal>`); returns whether eddy exited cleanly.
    pub async fn stop_with(mut self, signal: &str) -> bool {
        let pid = self.child.id().unwrap().to_string();
        std::process::Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .unwrap();
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .unwrap()
            .unwrap();
        status.success()
    }

    /// SIGTERM, waiting for the exit.
    pub async fn stop(self) {
        self.stop_with("TERM").await;
    }
}

/// Processes whose working directory or command line is inside `dir`.
pub fn processes_inside(dir: &Path) -> Vec<String> {
    let dir = dir.canonicalize().unwrap();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let path = entry.path();
        if !entry
            .file_name()
            .to_string_lossy()
            .chars()
            .all(|c| c.is_ascii_digit())
        {
            continue;
        }
        let cwd = std::fs::read_link(path.join("cwd")).unwrap_or_default();
        let cmdline = std::fs::read(path.join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cwd.starts_with(&dir) || cmdline.contains(dir.to_str().unwrap()) {
            found.push(format!(
                "{}: {cmdline}",
                entry.file_name().to_string_lossy()
            ));
        }
    }
    found
}
