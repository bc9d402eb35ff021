//! Local builds: a Function's source and dependencies in a directory keyed by a hash of
//! (runtime, runtime server, runtime libraries, source, dependencies), with the dependencies
//! installed. A directory that finished building is never built again, so an unchanged function
//! is never rebuilt.
//!
//! A Node.js build is laid out as the runtime image is: `server.mjs` and a link to the
//! runtime's shared libraries (`node_modules`) at the top, the function in `function/` with its
//! own `node_modules`. Node.js resolves a handler's imports from `function/node_modules`, then
//! from the runtime's libraries, and nowhere else that eddy puts there.

use std::path::{Path, PathBuf};

use crate::local::progress::{self, Phase, Reporter};
pub use crate::runtimes::build_hash;
use eddy_model::{conditions::Reason, resources::Runtime};

pub use super::installer::BuildFailure;
use super::{
    installer::run_installer,
    toolchain::{Prepared, Toolchain},
};
use crate::runtimes;

/// Marks a finished build.
const DONE_MARKER: &str = ".eddy-built";

/// Tools and limits of local builds.
#[derive(Debug)]
pub struct BuildConfig {
    /// Root of all builds.
    pub builds_dir: PathBuf,
    /// The interpreters, `npm`, the runtimes' shared libraries and the install timeout.
    pub toolchain: Toolchain,
}

/// A finished build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Build {
    /// The directory to run instances in (it holds the runtime's server).
    pub dir: PathBuf,
    /// Where the function's own files are (`FUNC_DIR`).
    pub function_dir: PathBuf,
    /// The interpreter that runs the server: `node` of the runtime's major version, `python3`.
    pub program: PathBuf,
    /// The runtime's own libraries.
    pub libraries: PathBuf,
    /// The build key.
    pub hash: String,
    /// Whether this call built it (false: it was already there).
    pub fresh: bool,
}

/// A function's code, as a build takes it.
#[derive(Debug, Clone, Copy)]
pub enum Code<'a> {
    /// The handler and the dependency file, as text.
    Inline {
        /// `handler.js` or `handler.py`.
        source: &'a str,
        /// `package.json` or `requirements.txt`; empty for none.
        dependencies: &'a str,
    },
    /// A directory of a Git checkout: every file in it is the function's.
    Directory {
        /// The directory (the repository's `baseDir`).
        dir: &'a Path,
        /// What identifies its contents: URL, commit and base directory.
        identity: &'a str,
    },
}

/// Builds (or finds) the build of a function, saying what it does to `reporter`.
pub async fn build(
    config: &BuildConfig,
    runtime: Runtime,
    code: Code<'_>,
    reporter: Option<&Reporter>,
) -> Result<Build, BuildFailure> {
    let started = std::time::Instant::now();
    let built = build_reported(config, runtime, code, reporter).await;
    match &built {
        Ok((build, installed)) if build.fresh => progress::report(
            reporter,
            Phase::Built {
                installed: *installed,
                seconds: started.elapsed().as_secs_f64(),
            },
        ),
        Ok(_) => {}
        Err(failure) => progress::report(
            reporter,
            Phase::Failed(
                failure
                    .message
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_owned(),
            ),
        ),
    }
    built.map(|(build, _)| build)
}

/// [`build`], and whether dependencies were installed.
async fn build_reported(
    config: &BuildConfig,
    runtime: Runtime,
    code: Code<'_>,
    reporter: Option<&Reporter>,
) -> Result<(Build, bool), BuildFailure> {
    progress::report(reporter, Phase::Runtime);
    let Prepared { program, libraries } = config.toolchain.prepare(runtime).await?;
    let hash = match code {
        Code::Inline {
            source,
            dependencies,
        } => build_hash(runtime, source, dependencies),
        Code::Directory { identity, .. } => build_hash(runtime, identity, ""),
    };
    let dir = config
        .builds_dir
        .join(format!("{}-{hash}", runtime.as_str()));
    let function_dir = dir.join("function");
    let built = |fresh| Build {
        dir: dir.clone(),
        function_dir: function_dir.clone(),
        program: program.clone(),
        libraries: libraries.clone(),
        hash: hash.clone(),
        fresh,
    };
    // One build of a hash at a time: Functions with the same code (or one Git commit) applied
    // together wait for the first build and reuse it.
    let lock = crate::path_lock::of(&dir);
    let _held = lock.lock().await;
    if let Ok(marker) = tokio::fs::read_to_string(dir.join(DONE_MARKER)).await {
        // Reused only when its files are still the ones built: a build directory changed on
        // disk (by a function, or anyone with access to the data dir) is built again.
        let (built_hash, built_tree) = marker.split_once(' ').unwrap_or((marker.as_str(), ""));
        let tree = tree_digest_of(&dir).await;
        if built_hash == hash && tree.as_deref() == Some(built_tree) {
            return Ok((built(false), false));
        }
        tracing::warn!(dir = %dir.display(), "build directory changed since it was built; building it again");
    }
    let write = |path: PathBuf, contents: String| async move {
        tokio::fs::write(&path, contents)
            .await
            .map_err(|error| BuildFailure::io("write", &path, &error))
    };
    progress::report(reporter, Phase::Source);
    // A half-finished earlier attempt is started over.
    let _ = tokio::fs::remove_dir_all(&dir).await;
    tokio::fs::create_dir_all(&function_dir)
        .await
        .map_err(|error| BuildFailure::io("create", &function_dir, &error))?;
    let files = runtimes::files(runtime);
    let server = match files.bundled_server {
        Some(bundle) => {
            let path = libraries.join(bundle);
            tokio::fs::read_to_string(&path)
                .await
                .map_err(|error| BuildFailure::io("read", &path, &error))?
        }
        None => files.server.to_owned(),
    };
    write(dir.join(files.server_file), server).await?;
    if runtime.node_major().is_some() {
        // Ends Node.js's search for the nearest package.json here, so nothing above the build
        // decides whether handler.js is CommonJS or an ES module.
        write(dir.join("package.json"), "{\"private\": true}\n".to_owned()).await?;
        let link = dir.join("node_modules");
        tokio::fs::symlink(libraries.join("node_modules"), &link)
            .await
            .map_err(|error| BuildFailure::io("link", &link, &error))?;
    }
    let has_dependencies = match code {
        Code::Inline {
            source,
            dependencies,
        } => {
            write(function_dir.join(files.handler_file), source.to_owned()).await?;
            if !dependencies.trim().is_empty() {
                write(
                    function_dir.join(files.dependencies_file),
                    dependencies.to_owned(),
                )
                .await?;
            }
            !dependencies.trim().is_empty()
        }
        Code::Directory {
            dir: source_dir, ..
        } => {
            let (from, to) = (source_dir.to_owned(), function_dir.clone());
            tokio::task::spawn_blocking(move || copy_tree(&from, &to))
                .await
                .map_err(|error| BuildFailure {
                    reason: Reason::BuildFailed,
                    message: format!("copying the source failed: {error}"),
                })?
                .map_err(|error| BuildFailure::io("copy", source_dir, &error))?;
            if !function_dir.join(files.handler_file).is_file() {
                return Err(BuildFailure {
                    reason: Reason::BuildFailed,
                    message: format!(
                        "the repository has no {} in its base directory",
                        files.handler_file
                    ),
                });
            }
            function_dir.join(files.dependencies_file).is_file()
        }
    };
    if has_dependencies {
        install(config, runtime, &program, &function_dir, reporter).await?;
    }
    let tree = tree_digest_of(&dir).await.ok_or_else(|| BuildFailure {
        reason: Reason::BuildFailed,
        message: format!("cannot read back the build directory {}", dir.display()),
    })?;
    write(dir.join(DONE_MARKER), format!("{hash} {tree}")).await?;
    Ok((built(true), has_dependencies))
}

/// Installs a function's own dependencies into its directory (`python` is the runtime's).
async fn install(
    config: &BuildConfig,
    runtime: Runtime,
    python: &Path,
    dir: &Path,
    reporter: Option<&Reporter>,
) -> Result<(), BuildFailure> {
    let tool = if runtime.node_major().is_some() {
        "npm install"
    } else {
        "pip install"
    };
    progress::report(reporter, Phase::Installing { tool });
    let command = match runtime.node_major() {
        Some(_) => {
            let mut command = tokio::process::Command::new(&config.toolchain.npm);
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
        None => {
            let mut command = tokio::process::Command::new(python);
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
    run_installer(
        command,
        dir,
        config.toolchain.timeout,
        "installing dependencies",
        reporter,
    )
    .await
}

/// Copies the files and directories under `from` into `to`, leaving out `.git`, installed
/// dependencies (`node_modules`, `deps`, `__pycache__`) and symbolic links (which could point
/// anywhere on this machine).
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    let mut pending = vec![(from.to_owned(), to.to_owned())];
    while let Some((source, target)) = pending.pop() {
        std::fs::create_dir_all(&target)?;
        for entry in std::fs::read_dir(&source)? {
            let entry = entry?;
            let name = entry.file_name();
            if matches!(
                name.to_str(),
                Some(".git" | "node_modules" | "deps" | "__pycache__")
            ) {
                continue;
            }
            let kind = entry.file_type()?;
            if kind.is_dir() {
                pending.push((entry.path(), target.join(&name)));
            } else if kind.is_file() {
                std::fs::copy(entry.path(), target.join(&name))?;
            }
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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

    #[tokio::test]
    async fn builds_are_reused_and_failures_explained() {
        let dir = tempfile::tempdir().unwrap();
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let config = BuildConfig {
            builds_dir: dir.path().to_path_buf(),
            toolchain: Toolchain::new(
                "node".into(),
                "npm".into(),
                "python3".into(),
                workspace.join(".tools"),
                workspace.join("target/eddy-runtimes"),
                Duration::from_secs(300),
            ),
        };
        let progress = crate::local::progress::BuildProgress::default();
        let mut events = progress.subscribe();
        let reporter = progress.of("shop/first".to_owned());
        let first = build(
            &config,
            Runtime::Nodejs20,
            Code::Inline {
                source: "module.exports={main:()=>1}",
                dependencies: "",
            },
            Some(&reporter),
        )
        .await
        .unwrap();
        let mut phases = Vec::new();
        while let Ok(event) = events.try_recv() {
            assert_eq!(event.function, "shop/first");
            phases.push(event.phase);
        }
        assert_eq!(phases[..2], [Phase::Runtime, Phase::Source]);
        assert!(
            matches!(
                phases[2],
                Phase::Built {
                    installed: false,
                    ..
                }
            ),
            "{phases:?}"
        );
        assert!(first.fresh);
        assert!(first.dir.join("server.mjs").is_file());
        assert_eq!(first.function_dir, first.dir.join("function"));
        assert!(first.function_dir.join("handler.js").is_file());
        assert!(
            first
                .dir
                .join("node_modules/express/package.json")
                .is_file(),
            "the runtime's libraries are linked beside the server"
        );
        let again = build(
            &config,
            Runtime::Nodejs20,
            Code::Inline {
                source: "module.exports={main:()=>1}",
                dependencies: "",
            },
            None,
        )
        .await
        .unwrap();
        assert!(!again.fresh);
        assert_eq!(again.dir, first.dir);

        let failed = build(
            &config,
            Runtime::Python311,
            Code::Inline {
                source: "def main(e, c): pass",
                dependencies: "=== this is not a requirement\n",
            },
            Some(&progress.of("shop/failed".to_owned())),
        )
        .await
        .unwrap_err();
        assert_eq!(failed.reason, Reason::DependencyInstallFailed);
        let phases: Vec<Phase> = std::iter::from_fn(|| events.try_recv().ok())
            .map(|event| event.phase)
            .filter(|phase| !matches!(phase, Phase::Output(_)))
            .collect();
        assert_eq!(
            phases,
            [
                Phase::Runtime,
                Phase::Source,
                Phase::Installing {
                    tool: "pip install"
                },
                Phase::Failed("installing dependencies failed (exit status: 1):".to_owned()),
            ]
        );
        assert!(failed.message.contains("requirement"), "{}", failed.message);
    }
}
