//! `eddy bench buildless`: what a buildless pod's start costs against an image build's, with
//! the pieces a pod runs, on this machine: the runtime's server (the one eddy's runtime image
//! holds, bundled) and the `install` script of buildless pods (the very text the controller
//! renders). Measured from spawn to the first `/healthz` answer:
//! - image: the function's files and `node_modules` are in place (they are in a built image);
//! - buildless, no dependencies: the install copies the sources, then the server starts;
//! - buildless, with dependencies: the install also runs `npm install` (a fresh npm cache, as
//!   a new pod's `/tmp` is), then the server starts;
//! - buildless, container restart: the init container does not run again; the server starts on
//!   what is installed.
//!
//! What a cluster adds is not here: scheduling and image pulls (a runtime image is pulled once
//! per node and shared by every Function of its runtime; each built image is pulled on its own).

use std::{
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use eddy_controller::kubernetes::render::BUILDLESS_INSTALL_SCRIPT;
use eddy_model::resources::Runtime;

use super::{Summary, summarize};

/// The handler every case serves.
const HANDLER: &str = "module.exports = { main: () => require('lodash').capitalize('hello') };\n";
const HANDLER_WITHOUT_DEPENDENCIES: &str = "module.exports = { main: () => 'hello' };\n";

/// Runs `runs` rounds of each case and prints the figures; `dependencies` is the package.json.
pub async fn run(
    runs: usize,
    dependencies: &str,
    data_dir: &Path,
    runtimes_dir: &Path,
) -> anyhow::Result<()> {
    let toolchain = eddy_controller::local::toolchain::Toolchain::new(
        "node".into(),
        "npm".into(),
        "python3".into(),
        eddy_controller::default_tools_dir(data_dir),
        runtimes_dir.to_path_buf(),
        Duration::from_secs(600),
    );
    let runtime = Runtime::Nodejs22;
    let prepared = toolchain
        .prepare(runtime)
        .await
        .map_err(|failure| anyhow::anyhow!("{failure}"))?;
    // npm from PATH, as the runtime image has its own beside node.
    let path = std::env::var_os("PATH").unwrap_or_default();
    let work = tempfile::tempdir()?;
    // The image's /runtime: the bundled server beside the runtime's node_modules.
    let runtime_dir = work.path().join("runtime");
    std::fs::create_dir_all(&runtime_dir)?;
    let bundled = prepared.libraries.join("dist/server.mjs");
    let server_source = if bundled.is_file() {
        bundled
    } else {
        prepared.libraries.join("server.mjs")
    };
    let server = runtime_dir.join("server.mjs");
    std::fs::copy(&server_source, &server)?;
    std::os::unix::fs::symlink(
        std::path::absolute(prepared.libraries.join("node_modules"))?,
        runtime_dir.join("node_modules"),
    )?;
    let pieces = Pieces {
        node: prepared.program.clone(),
        server,
        path,
    };
    let http = reqwest::Client::new();

    // The image: installed once, before the clock runs (a build did it).
    // Function directories sit in /runtime, as /runtime/function does (the server lets a
    // function load only what lies under its own directory).
    let image_dir = runtime_dir.join("function-image");
    let installed = pieces
        .install(
            &sources(work.path(), "image-src", Some(dependencies))?,
            &image_dir,
            work.path(),
        )
        .await?;
    eprintln!("installed once for the image case in {installed:?}");
    let mut image = Vec::new();
    let mut without = Vec::new();
    let mut with = Vec::new();
    let mut restart = Vec::new();
    for round in 0..runs {
        image.push(pieces.start(&http, &image_dir, None).await?);
        let plain = sources(work.path(), &format!("plain-src-{round}"), None)?;
        let dir = runtime_dir.join(format!("function-plain-{round}"));
        without.push(
            pieces
                .start(&http, &dir, Some((&plain, work.path())))
                .await?,
        );
        let with_dependencies = sources(
            work.path(),
            &format!("deps-src-{round}"),
            Some(dependencies),
        )?;
        let dir = runtime_dir.join(format!("function-deps-{round}"));
        let tmp = work.path().join(format!("tmp-{round}"));
        std::fs::create_dir_all(&tmp)?;
        with.push(
            pieces
                .start(&http, &dir, Some((&with_dependencies, &tmp)))
                .await?,
        );
        restart.push(pieces.start(&http, &dir, None).await?);
    }
    let rows: [(&str, Summary); 4] = [
        ("image (dependencies built in)", summarize(&image)),
        ("buildless, no dependencies", summarize(&without)),
        (
            "buildless, with dependencies (cold npm cache)",
            summarize(&with),
        ),
        ("buildless, container restart", summarize(&restart)),
    ];
    println!("nodejs22, {runs} runs each: spawn → first /healthz answer (ms)");
    println!("{:<48} {:>8} {:>8} {:>8}", "case", "median", "min", "max");
    for (case, summary) in rows {
        println!(
            "{case:<48} {:>8.0} {:>8.0} {:>8.0}",
            summary.p50_ms, summary.min_ms, summary.max_ms
        );
    }
    Ok(())
}

/// A sources directory as a buildless pod mounts it: the handler, and package.json if given.
fn sources(
    work: &Path,
    name: &str,
    dependencies: Option<&str>,
) -> anyhow::Result<std::path::PathBuf> {
    let dir = work.join(name);
    std::fs::create_dir_all(&dir)?;
    let handler = if dependencies.is_some() {
        HANDLER
    } else {
        HANDLER_WITHOUT_DEPENDENCIES
    };
    std::fs::write(dir.join("handler.js"), handler)?;
    if let Some(dependencies) = dependencies {
        std::fs::write(dir.join("package.json"), dependencies)?;
    }
    Ok(dir)
}

struct Pieces {
    node: std::path::PathBuf,
    server: std::path::PathBuf,
    path: std::ffi::OsString,
}

impl Pieces {
    /// Runs the install script of buildless pods: `sources` into `function_dir`.
    async fn install(
        &self,
        sources: &Path,
        function_dir: &Path,
        tmp: &Path,
    ) -> anyhow::Result<Duration> {
        std::fs::create_dir_all(function_dir)?;
        let started = Instant::now();
        let output = tokio::process::Command::new("/bin/sh")
            .args(["-c", BUILDLESS_INSTALL_SCRIPT])
            .env_clear()
            .env("PATH", &self.path)
            .env("HOME", tmp)
            .env("TMPDIR", tmp)
            .env("EDDY_SOURCES", sources)
            .env("FUNC_DIR", function_dir)
            .env("FUNC_RUNTIME", "nodejs22")
            .env("EDDY_BUILD_HASH", "bench")
            .kill_on_drop(true)
            .output()
            .await
            .context("cannot run /bin/sh")?;
        if !output.status.success() {
            bail!(
                "the install failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(started.elapsed())
    }

    /// Spawn (after the install, when given sources) → first `/healthz` answer.
    async fn start(
        &self,
        http: &reqwest::Client,
        function_dir: &Path,
        install: Option<(&Path, &Path)>,
    ) -> anyhow::Result<Duration> {
        let started = Instant::now();
        if let Some((sources, tmp)) = install {
            self.install(sources, function_dir, tmp).await?;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let mut child = tokio::process::Command::new(&self.node)
            .arg(&self.server)
            .env_clear()
            .env("PATH", &self.path)
            .env("FUNC_DIR", function_dir)
            .env("FUNC_PORT", port.to_string())
            .env("FUNC_HOST", "127.0.0.1")
            .env("FUNC_RUNTIME", "nodejs22")
            .env("FUNC_HANDLER", "main")
            .env("MOD_NAME", "handler")
            .env("NODE_ENV", "production")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(function_dir.with_extension("log"))?)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot run {}", self.node.display()))?;
        let url = format!("http://127.0.0.1:{port}/healthz");
        let answered = loop {
            if let Ok(response) = http.get(&url).send().await
                && response.status().is_success()
            {
                break started.elapsed();
            }
            if started.elapsed() > Duration::from_secs(120) {
                bail!(
                    "the server did not answer within 120 s: {}",
                    std::fs::read_to_string(function_dir.with_extension("log")).unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        // The handler loads its dependency: the function works, not only the server.
        let called = http
            .get(format!("http://127.0.0.1:{port}/"))
            .send()
            .await?
            .text()
            .await?;
        if called != "Hello" && called != "hello" {
            bail!(
                "the function answered {called:?}: {}",
                std::fs::read_to_string(function_dir.with_extension("log")).unwrap_or_default()
            );
        }
        let _ = child.kill().await;
        Ok(answered)
    }
}
