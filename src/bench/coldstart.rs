//! `coldstart`: apply → first answer for each runtime, from a spare and cold, beside the bare
//! runtime's own start.

use super::{
    CancellationToken, Condition, ConditionStatus, ConditionType, Duration, Function, Instant,
    PathBuf, Platform, Reason, Runtime, Summary, Value, bail, json, local, summarize, up,
};
use anyhow::Context as _;

pub(super) fn handler(runtime: &str, run: usize) -> anyhow::Result<String> {
    // A comment with the run number makes every deploy a fresh build.
    Ok(match runtime {
        "nodejs20" | "nodejs22" | "nodejs24" => {
            format!("// run {run}\nmodule.exports = {{ main: async () => 'ok' }};\n")
        }
        "python311" | "python312" => {
            format!("# run {run}\ndef main(event, context):\n    return 'ok'\n")
        }
        other => bail!("unknown runtime {other:?}"),
    })
}

pub(super) async fn function(
    http: &reqwest::Client,
    api: &str,
    name: &str,
) -> anyhow::Result<Function> {
    Ok(http
        .get(format!(
            "{api}/apis/eddy.dev/v1alpha1/namespaces/bench/functions/{name}"
        ))
        .send()
        .await?
        .json()
        .await?)
}

/// The Function's `Running` condition, when it has one.
pub(super) fn running(function: &Function) -> Option<&Condition> {
    function
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == ConditionType::Running.as_str())
}

pub(super) async fn wait_for(
    http: &reqwest::Client,
    api: &str,
    name: &str,
    what: &str,
    done: impl Fn(&Function) -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let current = function(http, api, name).await?;
        if done(&current) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{name} did not become {what} within 120s: {:?}",
                current.status
            );
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

pub(super) async fn coldstart(
    runs: usize,
    runtimes: &[String],
    out: Option<PathBuf>,
    nats_server: Option<PathBuf>,
    warm_spares: usize,
) -> anyhow::Result<()> {
    let data_dir = tempfile::tempdir().context("cannot create a temporary data dir")?;
    let args = up::Args {
        data_dir: data_dir.path().to_path_buf(),
        nats_server,
        bus_addr: local(0),
        gateway_addr: local(0),
        api_addr: local(0),
        dispatcher_addr: local(0),
        functions: eddy_controller::FunctionArgs {
            scale_to_zero_after: Duration::from_millis(300),
            warm_spares,
            ..Default::default()
        },
        ..eddy_platform::flags::defaults()
    };
    let platform = Platform::start(&args, false, &CancellationToken::new()).await?;
    let result = measure_coldstart(&platform, data_dir.path(), runs, runtimes).await;
    platform.stop(false).await;
    let figures = result?;
    println!(
        "cold start ({runs} runs each; {} cores; warm spares per runtime: {warm_spares})",
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    // Each cell formatted first, so the columns line up whatever the figures' widths.
    let cell = |s: &Summary| format!("{:.0} ms ({:.0}–{:.0})", s.p50_ms, s.min_ms, s.max_ms);
    println!(
        "{:<10} {:>26} {:>26} {:>26} {:>6}",
        "runtime",
        "deploy→ready p50 (min–max)",
        "from zero p50 (min–max)",
        "bare runtime p50 (min–max)",
        "ratio"
    );
    for figure in &figures {
        let (deploy, zero, floor) = (&figure.deploy, &figure.from_zero, &figure.floor);
        println!(
            "{:<10} {:>26} {:>26} {:>26} {:>5.1}×",
            figure.runtime,
            cell(deploy),
            cell(zero),
            cell(floor),
            zero.p50_ms / floor.p50_ms.max(f64::MIN_POSITIVE)
        );
    }
    if let Some(out) = out {
        let json: Vec<Value> = figures
            .iter()
            .map(|f| json!({"runtime": f.runtime, "deployToReady": f.deploy, "firstResponseFromZero": f.from_zero, "bareRuntime": f.floor}))
            .collect();
        std::fs::write(
            &out,
            serde_json::to_string_pretty(
                &json!({"scenario": "coldstart", "runs": runs, "warmSpares": warm_spares, "results": json}),
            )?,
        )
        .with_context(|| format!("cannot write {}", out.display()))?;
        println!("wrote {}", out.display());
    }
    Ok(())
}

/// One runtime's cold start figures.
pub(super) struct Coldstart {
    runtime: String,
    deploy: Summary,
    from_zero: Summary,
    /// The same interpreter with a minimal HTTP server: spawn → first response.
    floor: Summary,
}

pub(super) async fn measure_coldstart(
    platform: &Platform,
    data_dir: &std::path::Path,
    runs: usize,
    runtimes: &[String],
) -> anyhow::Result<Vec<Coldstart>> {
    let toolchain = eddy_controller::local::toolchain::Toolchain::new(
        "node".into(),
        "npm".into(),
        "python3".into(),
        eddy_controller::default_tools_dir(data_dir),
        data_dir.join("runtimes"),
        Duration::from_secs(300),
    );
    let http = reqwest::Client::new();
    let api = platform.api_url.as_str();
    let mut figures = Vec::new();
    for runtime in runtimes {
        let parsed: Runtime = serde_json::from_value(json!(runtime))
            .with_context(|| format!("unknown runtime {runtime:?}"))?;
        // Found (or installed) before the clock runs, as they are on any machine after its
        // first build: the interpreter and the runtime's libraries.
        let program = toolchain
            .prepare(parsed)
            .await
            .map_err(|failure| anyhow::anyhow!("{failure}"))?
            .program;
        let mut deploys = Vec::with_capacity(runs);
        let mut from_zero = Vec::with_capacity(runs);
        for run in 0..runs {
            let name = format!(
                "cold-{}-{run}",
                runtime.replace(|c: char| !c.is_ascii_alphanumeric(), "")
            );
            let manifest = json!({
                "apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
                "metadata": {"name": name, "namespace": "bench"},
                "spec": {"runtime": runtime, "source": {"inline": {"source": handler(runtime, run)?}},
                    "scaleConfig": {"minReplicas": 0, "maxReplicas": 1}},
            });
            let started = Instant::now();
            let response = http
                .put(format!(
                    "{api}/apis/eddy.dev/v1alpha1/namespaces/bench/functions/{name}"
                ))
                .json(&manifest)
                .send()
                .await?;
            if !response.status().is_success() {
                bail!(
                    "deploy refused: {}",
                    response.text().await.unwrap_or_default()
                );
            }
            // Ready: serving, or already idle again (a function that may scale to zero can be
            // back at zero before the next poll).
            wait_for(&http, api, &name, "ready", |f| {
                running(f).is_some_and(|c| c.status == ConditionStatus::True)
            })
            .await?;
            deploys.push(started.elapsed());

            wait_for(&http, api, &name, "scaled to zero", |f| {
                running(f).is_some_and(|c| c.reason == Reason::ScaledToZero.as_str())
            })
            .await?;
            // As after any real idle period (scale-to-zero takes a minute by default, not the
            // 300 ms set here): the spare that replaced the deploy's has loaded.
            wait_for_spare(platform, parsed).await?;
            let started = Instant::now();
            let response = http
                .get(format!("{}/bench/{name}/", platform.gateway_url))
                .send()
                .await?;
            let status = response.status();
            let _ = response.bytes().await?;
            if !status.is_success() {
                bail!("{name} answered {status} from zero");
            }
            from_zero.push(started.elapsed());
            http.delete(format!(
                "{api}/apis/eddy.dev/v1alpha1/namespaces/bench/functions/{name}"
            ))
            .send()
            .await?;
        }
        let mut floor = Vec::with_capacity(runs);
        for _ in 0..runs {
            floor.push(bare_runtime(&http, &program, parsed).await?);
        }
        figures.push(Coldstart {
            runtime: runtime.clone(),
            deploy: summarize(&deploys),
            from_zero: summarize(&from_zero),
            floor: summarize(&floor),
        });
    }
    Ok(figures)
}

/// Waits until a warm spare of `runtime` has loaded, when the platform keeps them.
pub(super) async fn wait_for_spare(platform: &Platform, runtime: Runtime) -> anyhow::Result<()> {
    let Some(spares) = platform
        .local_controller
        .as_ref()
        .and_then(|controller| controller.spares())
    else {
        return Ok(());
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while spares.ready(runtime) == 0 {
        if Instant::now() > deadline {
            bail!("no warm spare of {} loaded within 60 s", runtime.as_str());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// Spawn → first response of `program` running a minimal HTTP server: what no platform can beat.
pub(super) async fn bare_runtime(
    http: &reqwest::Client,
    program: &std::path::Path,
    runtime: Runtime,
) -> anyhow::Result<Duration> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut command = tokio::process::Command::new(program);
    if runtime.node_major().is_some() {
        command.arg("-e").arg(format!(
            "require('http').createServer((q, s) => s.end('ok')).listen({port}, '127.0.0.1')"
        ));
    } else {
        command.arg("-c").arg(format!(
            "import http.server as h\n\
             class H(h.BaseHTTPRequestHandler):\n    \
             def do_GET(self):\n        \
             self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n\
             h.HTTPServer(('127.0.0.1', {port}), H).serve_forever()"
        ));
    }
    command
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    let started = Instant::now();
    let mut child = command
        .spawn()
        .with_context(|| format!("cannot run {}", program.display()))?;
    let url = format!("http://127.0.0.1:{port}/");
    let answered = loop {
        if let Ok(response) = http.get(&url).send().await
            && response.status().is_success()
        {
            break started.elapsed();
        }
        if started.elapsed() > Duration::from_secs(30) {
            bail!("{} did not answer within 30 s", program.display());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    let _ = child.kill().await;
    Ok(answered)
}
