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
    installer::{run_installer, run_installer_with},
    toolchain::{Prepared, Toolchain},
};
use crate::package_registry::PackageRegistry;
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

/// Builds (or finds) the build of a function, its dependencies installed with `registry`'s
/// configuration when there is one, saying what it does to `reporter`.
pub async fn build(
    config: &BuildConfig,
    runtime: Runtime,
    code: Code<'_>,
    registry: Option<&PackageRegistry>,
    reporter: Option<&Reporter>,
) -> Result<Build, BuildFailure> {
    let started = std::time::Instant::now();
    let built = build_reported(config, runtime, code, registry, reporter).await;
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
    registry: Option<&PackageRegistry>,
    reporter: Option<&Reporter>,
) -> Result<(Build, bool), BuildFailure> {
    progress::report(reporter, Phase::Runtime);
    let Prepared { program, libraries } = config.toolchain.prepare(runtime).await?;
    let (hash, may_install) = match code {
        Code::Inline {
            source,
            dependencies,
        } => (
            build_hash(runtime, source, dependencies),
            !dependencies.trim().is_empty(),
        ),
        Code::Directory { identity, .. } => (build_hash(runtime, identity, ""), true),
    };
    // What a private registry serves is part of what is built (and builds are shared).
    let registry = registry.filter(|_| may_install);
    let hash = registry.map_or(hash.clone(), |registry| registry.keyed(&hash));
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
    for (name, contents) in files.modules {
        write(dir.join(name), (*contents).to_owned()).await?;
    }
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
        install(config, runtime, &program, &function_dir, registry, reporter).await?;
    }
    let tree = tree_digest_of(&dir).await.ok_or_else(|| BuildFailure {
        reason: Reason::BuildFailed,
        message: format!("cannot read back the build directory {}", dir.display()),
    })?;
    write(dir.join(DONE_MARKER), format!("{hash} {tree}")).await?;
    Ok((built(true), has_dependencies))
}

/// Installs a function's own dependencies into its directory (`python` is the runtime's),
/// with a private registry's configuration when there is one.
async fn install(
    config: &BuildConfig,
    runtime: Runtime,
    python: &Path,
    dir: &Path,
    registry: Option<&PackageRegistry>,
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
    let Some(registry) = registry else {
        return run_installer(
            command,
            dir,
            config.toolchain.timeout,
            "installing dependencies",
            reporter,
        )
        .await;
    };
    // The configuration is written beside the builds, never into the function's directory,
    // readable by this user only, and removed when the install is done.
    let private = RegistryFile::write(&config.builds_dir, runtime, registry).await?;
    tracing::info!(secret = %registry.secret, "installing with a private package registry's configuration");
    let variable = if runtime.node_major().is_some() {
        "NPM_CONFIG_USERCONFIG"
    } else {
        "PIP_CONFIG_FILE"
    };
    let installed = run_installer_with(
        command,
        dir,
        config.toolchain.timeout,
        "installing dependencies",
        reporter,
        &[(variable, private.path.as_os_str())],
    )
    .await;
    private.remove().await;
    installed
}

/// A private registry's configuration file, for one install.
struct RegistryFile {
    dir: PathBuf,
    path: PathBuf,
}

impl RegistryFile {
    /// Writes it in a directory of its own under `builds_dir` (mode 0700). npm's file is the
    /// user's own configuration followed by the registry's, since npm reads one user file:
    /// the registry's settings win, the user's proxy or CA settings stay. pip reads its file
    /// after its others, so it is the registry's alone.
    async fn write(
        builds_dir: &Path,
        runtime: Runtime,
        registry: &PackageRegistry,
    ) -> Result<Self, BuildFailure> {
        use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
        let dir = builds_dir.join(format!(".registry-{}", uuid_like()));
        let (file_name, mut contents) = if runtime.node_major().is_some() {
            let user = std::env::var_os("NPM_CONFIG_USERCONFIG")
                .or_else(|| std::env::var_os("npm_config_userconfig"))
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".npmrc")));
            let mut own = match user {
                Some(path) => tokio::fs::read(&path).await.unwrap_or_default(),
                None => Vec::new(),
            };
            if !own.is_empty() && !own.ends_with(b"\n") {
                own.push(b'\n');
            }
            ("npmrc", own)
        } else {
            ("pip.conf", Vec::new())
        };
        contents.extend_from_slice(&registry.config);
        let path = dir.join(file_name);
        let (dir_for_task, path_for_task) = (dir.clone(), path.clone());
        tokio::task::spawn_blocking(move || {
            std::fs::DirBuilder::new()
                .mode(0o700)
                .recursive(true)
                .create(&dir_for_task)?;
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path_for_task)?;
            std::io::Write::write_all(&mut file, &contents)
        })
        .await
        .map_err(|error| BuildFailure {
            reason: Reason::BuildFailed,
            message: format!("writing the package registry configuration failed: {error}"),
        })?
        .map_err(|error| BuildFailure::io("write", &path, &error))?;
        Ok(Self { dir, path })
    }

    async fn remove(self) {
        if let Err(error) = tokio::fs::remove_dir_all(&self.dir).await {
            tracing::warn!(dir = %self.dir.display(), %error, "cannot remove a package registry configuration");
        }
    }
}

/// A name no other install uses at the same time.
fn uuid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
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
            None,
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
            None,
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
