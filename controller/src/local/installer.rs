//! Running a package installer (npm, pip) for a build: in its directory, with a filtered
//! environment, its output in `build.log`, within a timeout, its process group gone after;
//! and how a build fails ([`BuildFailure`]). Builds and the toolchain (which installs the
//! runtimes' own libraries) both run installers through here.

use std::{path::Path, process::Stdio, time::Duration};

use eddy_model::conditions::Reason;
use eddy_platform::process;

use super::progress::{Phase, Reporter};
use crate::status::tail;

pub use crate::status::BuildFailure;

/// Runs an installer in `dir` with a filtered environment, its output in `dir/build.log`, within
/// `timeout`; a failure says `what` failed, with the end of the log.
pub async fn run_installer(
    command: tokio::process::Command,
    dir: &Path,
    timeout: Duration,
    what: &str,
    reporter: Option<&Reporter>,
) -> Result<(), BuildFailure> {
    run_installer_with(command, dir, timeout, what, reporter, &[]).await
}

/// [`run_installer`] with `extra_env` set over the filtered environment (a private registry's
/// configuration file).
pub async fn run_installer_with(
    mut command: tokio::process::Command,
    dir: &Path,
    timeout: Duration,
    what: &str,
    reporter: Option<&Reporter>,
    extra_env: &[(&str, &std::ffi::OsStr)],
) -> Result<(), BuildFailure> {
    let log_path = dir.join("build.log");
    let log = std::fs::File::create(&log_path)
        .map_err(|error| BuildFailure::io("create", &log_path, &error))?;
    let log_err = log
        .try_clone()
        .map_err(|error| BuildFailure::io("open", &log_path, &error))?;
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
    for (name, value) in extra_env {
        command.env(name, value);
    }
    process::supervise(&mut command);
    let program = command
        .as_std()
        .get_program()
        .to_string_lossy()
        .into_owned();
    let mut child = command.spawn().map_err(|error| BuildFailure {
        reason: Reason::BuildToolMissing,
        message: format!("{what}: cannot run {program}: {error}"),
    })?;
    let group = process::group_of(&child);
    let outcome = match reporter {
        Some(reporter) => {
            tokio::time::timeout(timeout, watch_output(&mut child, &log_path, reporter)).await
        }
        None => tokio::time::timeout(timeout, child.wait()).await,
    };
    // Whatever the installer started and left running goes with it.
    if let Some(group) = group {
        process::kill_group(group);
    }
    let read_log = || tail(&std::fs::read_to_string(&log_path).unwrap_or_default(), 20);
    match outcome {
        Ok(Ok(status)) if status.success() => Ok(()),
        Ok(Ok(status)) => Err(BuildFailure {
            reason: Reason::DependencyInstallFailed,
            message: format!("{what} failed ({status}):\n{}", read_log()),
        }),
        Ok(Err(error)) => Err(BuildFailure {
            reason: Reason::BuildFailed,
            message: format!("{what}: the installer failed: {error}"),
        }),
        Err(_) => {
            process::kill(&mut child).await;
            Err(BuildFailure {
                reason: Reason::BuildTimeout,
                message: format!("{what} took longer than {timeout:?}:\n{}", read_log()),
            })
        }
    }
}

/// Waits for the installer, reporting the last line of its log whenever it changes.
async fn watch_output(
    child: &mut tokio::process::Child,
    log_path: &Path,
    reporter: &Reporter,
) -> std::io::Result<std::process::ExitStatus> {
    let mut every = tokio::time::interval(Duration::from_millis(250));
    let mut last = String::new();
    loop {
        tokio::select! {
            status = child.wait() => return status,
            _ = every.tick() => {
                let log = tokio::fs::read_to_string(log_path).await.unwrap_or_default();
                let line = log.lines().rev().map(str::trim).find(|line| !line.is_empty()).unwrap_or_default();
                if line != last {
                    line.clone_into(&mut last);
                    reporter.report(Phase::Output(last.clone()));
                }
            }
        }
    }
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
}
