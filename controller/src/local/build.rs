//! Local builds: a Function's source and dependencies in a directory keyed by a hash of
//! (runtime, runtime server, source, dependencies), with the dependencies installed. A directory
//! that finished building is never built again, so an unchanged function is never rebuilt.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

pub use crate::runtimes::build_hash;
use eddy_model::{conditions::Reason, resources::Runtime};
use eddy_platform::process;

use crate::runtimes;

/// Marks a finished build.
const DONE_MARKER: &str = ".eddy-built";

/// Tools and limits of local builds.
#[derive(Debug, Clone)]
pub struct BuildConfig {
    /// Root of all builds.
    pub builds_dir: PathBuf,
    /// `node` (also runs the instances).
    pub node: PathBuf,
    /// `npm`.
    pub npm: PathBuf,
    /// `python3` (also runs the instances).
    pub python: PathBuf,
    /// Longest a dependency install may take.
    pub timeout: Duration,
}

/// A finished build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Build {
    /// The directory to run instances in.
    pub dir: PathBuf,
    /// The build key.
    pub hash: String,
    /// Whether this call built it (false: it was already there).
    pub fresh: bool,
}

/// Why a build failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {message}")]
pub struct BuildFailure {
    /// CamelCase reason for the BuildReady condition.
    pub reason: Reason,
    /// What happened, with the tail of the build log.
    pub message: String,
}

/// The last `lines` lines of `text`.
pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Builds (or finds) the build of a function.
pub async fn build(
    config: &BuildConfig,
    runtime: Runtime,
    source: &str,
    dependencies: &str,
) -> Result<Build, BuildFailure> {
    let hash = build_hash(runtime, source, dependencies);
    let dir = config
        .builds_dir
        .join(format!("{}-{hash}", runtime.as_str()));
    if let Ok(marker) = tokio::fs::read_to_string(dir.join(DONE_MARKER)).await {
        // Reused only when its files are still the ones built: a build directory changed on
        // disk (by a function, or anyone with access to the data dir) is built again.
        let (built_hash, built_tree) = marker.split_once(' ').unwrap_or((marker.as_str(), ""));
        let tree = tree_digest_of(&dir).await;
        if built_hash == hash && tree.as_deref() == Some(built_tree) {
            return Ok(Build {
                dir,
                hash,
                fresh: false,
            });
        }
        tracing::warn!(dir = %dir.display(), "build directory changed since it was built; building it again");
    }
    let io_failure = |error: std::io::Error| BuildFailure {
        reason: Reason::BuildFailed,
        message: format!(
            "cannot write the build directory {}: {error}",
            dir.display()
        ),
    };
    // A half-finished earlier attempt is started over.
    let _ = tokio::fs::remove_dir_all(&dir).await;
    tokio::fs::create_dir_all(&dir).await.map_err(io_failure)?;
    let files = runtimes::files(runtime);
    tokio::fs::write(dir.join(files.server_file), files.server)
        .await
        .map_err(io_failure)?;
    tokio::fs::write(dir.join(files.handler_file), source)
        .await
        .map_err(io_failure)?;
    if !dependencies.trim().is_empty() {
        tokio::fs::write(dir.join(files.dependencies_file), dependencies)
            .await
            .map_err(io_failure)?;
        install(config, runtime, &dir).await?;
    }
    let tree = tree_digest_of(&dir).await.ok_or_else(|| BuildFailure {
        reason: Reason::BuildFailed,
        message: format!("cannot read back the build directory {}", dir.display()),
    })?;
    tokio::fs::write(dir.join(DONE_MARKER), format!("{hash} {tree}"))
        .await
        .map_err(io_failure)?;
    Ok(Build {
        dir,
        hash,
        fresh: true,
    })
}

async fn install(config: &BuildConfig, runtime: Runtime, dir: &Path) -> Result<(), BuildFailure> {
    let mut command = match runtime {
        Runtime::Nodejs20 => {
            let mut command = tokio::process::Command::new(&config.npm);
            command.args([
                "install",
                "--omit=dev",
                "--no-audit",
                "--no-fund",
                "--no-package-lock",
                "--loglevel=error",
            ]);
            command
        }
        Runtime::Python311 => {
            let mut command = tokio::process::Command::new(&config.python);
            command.args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--no-input",
                "--target",
                "deps",
                "-r",
                "requirements.txt",
            ]);
            command
        }
    };
    let log_path = dir.join("build.log");
    let log = std::fs::File::create(&log_path).map_err(|error| BuildFailure {
        reason: Reason::BuildFailed,
        message: format!("cannot create {}: {error}", log_path.display()),
    })?;
    let log_err = log.try_clone().map_err(|error| BuildFailure {
        reason: Reason::BuildFailed,
        message: format!("cannot open {}: {error}", log_path.display()),
    })?;
    command
        .current_dir(dir)
        .env_clear()
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err);
    // Installers run third-party code (npm lifecycle scripts, setup.py): they get what finding
    // and fetching packages needs, never eddy's environment (tokens, credentials).
    for (name, value) in std::env::vars_os() {
        if build_env_passes(&name.to_string_lossy()) {
            command.env(name, value);
        }
    }
    process::supervise(&mut command);
    let mut child = command.spawn().map_err(|error| BuildFailure {
        reason: Reason::BuildToolMissing,
        message: format!(
            "cannot run the dependency installer for {}: {error}",
            runtime.as_str()
        ),
    })?;
    let group = process::group_of(&child);
    let outcome = tokio::time::timeout(config.timeout, child.wait()).await;
    // Whatever the installer started and left running goes with it.
    if let Some(group) = group {
        process::kill_group(group);
    }
    let read_log = || tail(&std::fs::read_to_string(&log_path).unwrap_or_default(), 20);
    match outcome {
        Ok(Ok(status)) if status.success() => Ok(()),
        Ok(Ok(status)) => Err(BuildFailure {
            reason: Reason::DependencyInstallFailed,
            message: format!("installing dependencies failed ({status}):\n{}", read_log()),
        }),
        Ok(Err(error)) => Err(BuildFailure {
            reason: Reason::BuildFailed,
            message: format!("the installer failed: {error}"),
        }),
        Err(_) => {
            process::kill(&mut child).await;
            Err(BuildFailure {
                reason: Reason::BuildTimeout,
                message: format!(
                    "installing dependencies took longer than {:?}:\n{}",
                    config.timeout,
                    read_log()
                ),
            })
        }
    }
}

/// [`tree_digest`] off the async threads (dependency trees have thousands of files).
async fn tree_digest_of(dir: &Path) -> Option<String> {
    let dir = dir.to_owned();
    tokio::task::spawn_blocking(move || tree_digest(&dir).ok())
        .await
        .ok()
        .flatten()
}

/// SHA-256 over every file under `dir` (relative path, executable bit, contents; symlinks by
/// target) in a fixed order, leaving out the marker and the build log.
pub fn tree_digest(dir: &Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    use std::os::unix::fs::PermissionsExt as _;
    let mut files = Vec::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(current) = pending.pop() {
        for entry in std::fs::read_dir(&current)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            if kind.is_dir() {
                pending.push(entry.path());
            } else {
                files.push(entry.path());
            }
        }
    }
    files.sort();
    let mut digest = Sha256::new();
    for path in files {
        let relative = path.strip_prefix(dir).unwrap_or(&path);
        if relative == Path::new(DONE_MARKER) || relative == Path::new("build.log") {
            continue;
        }
        digest.update(relative.to_string_lossy().as_bytes());
        digest.update([0]);
        let metadata = std::fs::symlink_metadata(&path)?;
        if metadata.file_type().is_symlink() {
            digest.update(b"link:");
            digest.update(std::fs::read_link(&path)?.to_string_lossy().as_bytes());
        } else {
            digest.update([u8::from(metadata.permissions().mode() & 0o111 != 0)]);
            digest.update(std::fs::read(&path)?);
        }
        digest.update([0]);
    }
    Ok(format!("{:x}", digest.finalize()))
}

/// The environment variables a dependency install keeps: paths, locale, proxies and the package
/// managers' own settings. Nothing else, `EDDY_*` least of all.
fn build_env_passes(name: &str) -> bool {
    const KEPT: [&str; 14] = [
        "PATH",
        "HOME",
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "TZ",
        "TMPDIR",
        "SYSTEMROOT",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
    ];
    let upper = name.to_ascii_uppercase();
    KEPT.contains(&upper.as_str())
        || upper.starts_with("NPM_CONFIG_")
        || upper.starts_with("PIP_")
        || upper == "NODE_EXTRA_CA_CERTS"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_build_directory_has_another_digest() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("node_modules/a")).unwrap();
        std::fs::write(dir.path().join("handler.js"), "x").unwrap();
        std::fs::write(dir.path().join("node_modules/a/index.js"), "y").unwrap();
        let before = tree_digest(dir.path()).unwrap();
        std::fs::write(dir.path().join(DONE_MARKER), "marker").unwrap();
        assert_eq!(
            tree_digest(dir.path()).unwrap(),
            before,
            "the marker is left out"
        );
        std::fs::write(dir.path().join("node_modules/a/index.js"), "evil").unwrap();
        assert_ne!(tree_digest(dir.path()).unwrap(), before);
        std::fs::write(dir.path().join("node_modules/a/index.js"), "y").unwrap();
        std::fs::write(dir.path().join("node_modules/a/extra.js"), "").unwrap();
        assert_ne!(tree_digest(dir.path()).unwrap(), before);
    }

    #[test]
    fn builds_keep_only_what_installers_need() {
        for kept in [
            "PATH",
            "HOME",
            "https_proxy",
            "npm_config_registry",
            "PIP_INDEX_URL",
        ] {
            assert!(build_env_passes(kept), "{kept}");
        }
        for dropped in [
            "EDDY_API_TOKENS",
            "EDDY_BUS_TOKENS",
            "AWS_SECRET_ACCESS_KEY",
            "GITHUB_TOKEN",
            "NATS_CREDS",
        ] {
            assert!(!build_env_passes(dropped), "{dropped}");
        }
    }

    #[test]
    fn hashes_change_with_every_input() {
        let base = build_hash(Runtime::Nodejs20, "a", "");
        assert_eq!(base, build_hash(Runtime::Nodejs20, "a", ""));
        assert_ne!(base, build_hash(Runtime::Python311, "a", ""));
        assert_ne!(base, build_hash(Runtime::Nodejs20, "b", ""));
        assert_ne!(base, build_hash(Runtime::Nodejs20, "a", "{}"));
        assert_ne!(
            build_hash(Runtime::Nodejs20, "ab", "c"),
            build_hash(Runtime::Nodejs20, "a", "bc")
        );
    }

    #[test]
    fn tails_keep_the_last_lines() {
        assert_eq!(tail("1\n2\n3\n4", 2), "3\n4");
        assert_eq!(tail("1", 5), "1");
    }

    #[tokio::test]
    async fn builds_are_reused_and_failures_explained() {
        let dir = tempfile::tempdir().unwrap();
        let config = BuildConfig {
            builds_dir: dir.path().to_path_buf(),
            node: "node".into(),
            npm: "npm".into(),
            python: "python3".into(),
            timeout: Duration::from_secs(60),
        };
        let first = build(
            &config,
            Runtime::Nodejs20,
            "module.exports={main:()=>1}",
            "",
        )
        .await
        .unwrap();
        assert!(first.fresh);
        assert!(first.dir.join("handler.js").is_file() && first.dir.join("server.js").is_file());
        let again = build(
            &config,
            Runtime::Nodejs20,
            "module.exports={main:()=>1}",
            "",
        )
        .await
        .unwrap();
        assert!(!again.fresh);
        assert_eq!(again.dir, first.dir);

        let failed = build(
            &config,
            Runtime::Python311,
            "def main(e, c): pass",
            "=== this is not a requirement\n",
        )
        .await
        .unwrap_err();
        assert_eq!(failed.reason, Reason::DependencyInstallFailed);
        assert!(failed.message.contains("requirement"), "{}", failed.message);
    }
}
