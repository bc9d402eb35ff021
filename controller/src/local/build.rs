//! Local builds: a Function's source and dependencies in a directory keyed by a hash of
//! (runtime, runtime server, source, dependencies), with the dependencies installed. A directory
//! that finished building is never built again, so an unchanged function is never rebuilt.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

pub use crate::runtimes::build_hash;
use eddy_api::{process, resources::Runtime};

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
    pub reason: &'static str,
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
    if dir.join(DONE_MARKER).is_file() {
        return Ok(Build {
            dir,
            hash,
            fresh: false,
        });
    }
    let io_failure = |error: std::io::Error| BuildFailure {
        reason: "BuildFailed",
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
    tokio::fs::write(dir.join(DONE_MARKER), hash.as_bytes())
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
        reason: "BuildFailed",
        message: format!("cannot create {}: {error}", log_path.display()),
    })?;
    let log_err = log.try_clone().map_err(|error| BuildFailure {
        reason: "BuildFailed",
        message: format!("cannot open {}: {error}", log_path.display()),
    })?;
    command
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err);
    process::supervise(&mut command);
    let mut child = command.spawn().map_err(|error| BuildFailure {
        reason: "BuildToolMissing",
        message: format!(
            "cannot run the dependency installer for {}: {error}",
            runtime.as_str()
        ),
    })?;
    let outcome = tokio::time::timeout(config.timeout, child.wait()).await;
    let read_log = || tail(&std::fs::read_to_string(&log_path).unwrap_or_default(), 20);
    match outcome {
        Ok(Ok(status)) if status.success() => Ok(()),
        Ok(Ok(status)) => Err(BuildFailure {
            reason: "DependencyInstallFailed",
            message: format!("installing dependencies failed ({status}):\n{}", read_log()),
        }),
        Ok(Err(error)) => Err(BuildFailure {
            reason: "BuildFailed",
            message: format!("the installer failed: {error}"),
        }),
        Err(_) => {
            process::kill(&mut child).await;
            Err(BuildFailure {
                reason: "BuildTimeout",
                message: format!(
                    "installing dependencies took longer than {:?}:\n{}",
                    config.timeout,
                    read_log()
                ),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(failed.reason, "DependencyInstallFailed");
        assert!(failed.message.contains("requirement"), "{}", failed.message);
    }
}
