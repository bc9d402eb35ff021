//! `eddy up` in a terminal: status lines and build progress on stdout, the components' logs in a
//! file under the data dir, and `eddy get -w` printing resources as they change.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{process::Stdio, time::Duration};

mod up;

use eddy_testing::eventually;
use serde_json::json;
use tokio::io::AsyncBufReadExt as _;
use up::Up;

/// An `npm` that installs a function's dependencies offline, taking two seconds (long enough
/// for the watch to see the function being built), and runs the real npm for anything else.
fn offline_npm(dir: &std::path::Path) -> std::path::PathBuf {
    let npm = dir.join("npm");
    std::fs::write(
        &npm,
        "#!/bin/sh\nif [ \"$1\" = install ]; then\n  echo 'fetching left-pad'\n  sleep 2\n  \
         mkdir -p node_modules/left-pad\n  echo 'module.exports = (s) => s;' > node_modules/left-pad/index.js\n  \
         echo 'added 1 package'\n  exit 0\nfi\nexec npm \"$@\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&npm, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    npm
}

fn function(dependencies: Option<&str>) -> serde_json::Value {
    let mut inline = json!({"source": "module.exports = { main: () => 'hi' };"});
    if let Some(dependencies) = dependencies {
        inline["dependencies"] = json!(dependencies);
    }
    json!({"runtime": "nodejs20", "source": {"inline": inline}})
}

#[tokio::test]
async fn up_shows_builds_keeps_logs_in_a_file_and_get_watches() {
    let data_dir = tempfile::tempdir().unwrap();
    let tools = tempfile::tempdir().unwrap();
    let npm = offline_npm(tools.path());
    let up = Up::start(
        data_dir.path(),
        &["--npm", npm.to_str().unwrap()],
        &[("EDDY_LOG", "info")],
    )
    .await;

    // The components' log lines go to a file; the terminal keeps the status lines.
    let log_file = data_dir.path().join("logs").join("eddy.log");
    let said = |needle: String| {
        let output = up.output.clone();
        move || {
            let output = output.clone();
            let needle = needle.clone();
            async move {
                output
                    .lock()
                    .unwrap()
                    .iter()
                    .any(|line| line.contains(&needle))
            }
        }
    };
    eventually(
        "the log file named",
        Duration::from_secs(10),
        said(format!("logs      {}", log_file.display())),
    )
    .await
    .unwrap();
    eventually("log lines in the file", Duration::from_secs(10), || async {
        std::fs::read_to_string(&log_file).is_ok_and(|text| text.contains("INFO"))
    })
    .await
    .unwrap();

    // `eddy get functions -w`: the table, then a row whenever a function appears or changes.
    let mut watch = tokio::process::Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(["get", "functions", "-w"])
        .env("EDDY_SERVER", &up.api)
        .env_remove("EDDY_TOKEN")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let watched = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let mut lines = tokio::io::BufReader::new(watch.stdout.take().unwrap()).lines();
    let sink = watched.clone();
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            sink.lock().unwrap().push(line);
        }
    });
    let watched_line = |check: fn(&str) -> bool| {
        let watched = watched.clone();
        move || {
            let watched = watched.clone();
            async move { watched.lock().unwrap().iter().any(|line| check(line)) }
        }
    };
    eventually(
        "the watch's header",
        Duration::from_secs(10),
        watched_line(|line| line.starts_with("NAMESPACE")),
    )
    .await
    .unwrap();

    // A build that installs dependencies is shown step by step.
    up.deploy(
        "with-deps",
        function(Some(r#"{"dependencies": {"left-pad": "1.3.0"}}"#)),
    )
    .await;
    for step in [
        "installing dependencies (npm install)",
        "dependencies installed, built",
    ] {
        let output = up.output.clone();
        let shown = eventually(
            &format!("the build line {step:?}"),
            Duration::from_secs(10),
            || {
                let output = output.clone();
                async move {
                    output.lock().unwrap().iter().any(|line| {
                        line.starts_with("build")
                            && line.contains("default/with-deps")
                            && line.contains(step)
                    })
                }
            },
        )
        .await;
        assert!(shown.is_ok(), "{:#?}", up.output.lock().unwrap());
    }

    // The watch printed the new function, and again once it ran.
    eventually(
        "the watch's row of with-deps, running",
        Duration::from_secs(10),
        watched_line(|line| {
            // BUILT and RUNNING both True.
            line.starts_with("default")
                && line.contains("with-deps")
                && line.matches(" True ").count() == 2
        }),
    )
    .await
    .unwrap_or_else(|error| panic!("{error}: {:#?}", watched.lock().unwrap()));
    let rows: Vec<String> = watched
        .lock()
        .unwrap()
        .iter()
        .filter(|line| line.contains("with-deps"))
        .cloned()
        .collect();
    assert!(
        rows.len() >= 2,
        "a row when it appeared and one when it changed: {rows:#?}"
    );
    assert_eq!(
        watched
            .lock()
            .unwrap()
            .iter()
            .filter(|line| line.starts_with("NAMESPACE"))
            .count(),
        1,
        "the header once"
    );
    watch.kill().await.unwrap();
    up.stop().await;
}
