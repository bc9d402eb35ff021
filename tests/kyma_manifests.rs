//! Kyma's manifests applied to eddy as Kyma users write them: `examples/kyma` through
//! `eddy apply`, Secrets and ConfigMaps read by `env[].valueFrom` and `secretMounts`, a Git
//! source followed as its branch moves, Kubernetes-only fields reported as ignored, and
//! `eddy convert` output that behaves the same.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::{path::Path, time::Duration};

use eddy_testing::eventually;
use serde_json::{Value, json};
use support::{Options, Platform, condition_of};

fn examples() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/kyma")
}

async fn call(
    platform: &Platform,
    namespace: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let url = format!("{}/{namespace}/{path}", platform.gateway);
    let request = match body {
        Some(body) => platform.http.post(url).json(&body),
        None => platform.http.get(url),
    };
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// Calls the example functions in `namespace` and checks what each promises.
async fn examples_behave(platform: &Platform, namespace: &str) {
    for name in ["greeter", "orders", "audit", "db-info"] {
        platform.wait_running_at(namespace, name).await;
    }
    let (status, body) = call(platform, namespace, "greeter?name=Kyma", None).await;
    assert_eq!((status, body), (200, json!({"message": "Hello, Kyma!"})));

    let (status, body) = call(platform, namespace, "db-info", None).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({"user": "orders", "currency": "EUR", "passwordLength": "example-only-password".len()})
    );

    let (status, body) = call(platform, namespace, "orders", Some(json!({}))).await;
    assert_eq!((status, body), (400, json!("an order needs an item")));
    let (status, order) = call(platform, namespace, "orders", Some(json!({"item": "A-1"}))).await;
    assert_eq!(status, 201, "{order}");
    let id = order["id"].as_str().unwrap().to_owned();
    let log_url = format!(
        "{}/apis/eddy.dev/v1alpha1/namespaces/{namespace}/functions/audit/log",
        platform.api
    );
    let expected = format!("audited order.received.v1 {id} item=A-1");
    let seen = eventually(
        "the audit function to see the order",
        Duration::from_secs(60),
        || async {
            let log = platform.get_text(&log_url).await;
            log.contains(&expected)
        },
    )
    .await;
    if let Err(error) = seen {
        let log = platform.get_text(&log_url).await;
        let orders_log = platform
            .get_text(&log_url.replace("/audit/", "/orders/"))
            .await;
        panic!("{error}\naudit log:\n{log}\norders log:\n{orders_log}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn kyma_examples_apply_unchanged_and_behave_as_documented() {
    let platform = Platform::start().await;
    let (ok, stdout, stderr) = platform
        .eddy(&["apply", "-f", examples().to_str().unwrap()])
        .await;
    assert!(ok, "{stdout}\n{stderr}");
    for applied in [
        "secret/orders-db created",
        "configmap/orders-settings created",
        "function.eddy.dev/greeter created",
        "subscription.eddy.dev/audit-orders created",
    ] {
        assert!(stdout.contains(applied), "{applied} in {stdout}");
    }
    // A Kubernetes-only field is taken and reported, not refused.
    assert!(
        stderr.contains("Warning: function.eddy.dev/db-info: spec.resourceConfiguration.function is ignored in local mode"),
        "{stderr}"
    );
    examples_behave(&platform, "default").await;

    // Shown back in the form they were applied.
    let (ok, yaml, _) = platform
        .eddy(&["get", "functions", "greeter", "-o", "yaml"])
        .await;
    assert!(ok);
    assert!(
        yaml.starts_with("apiVersion: serverless.kyma-project.io/v1alpha2\n"),
        "{yaml}"
    );
    let function = platform.wait_running_at("default", "db-info").await;
    assert_eq!(
        function["apiVersion"],
        "serverless.kyma-project.io/v1alpha2"
    );
    assert_eq!(function["status"]["runtime"], "nodejs24");
    assert_eq!(
        function["status"]["podSelector"],
        "eddy.dev/function=db-info"
    );
    let (_, _, message) = condition_of(&function, "ConfigurationReady");
    assert!(message.contains("ignored in local mode"), "{message}");
    let subscription: Value = platform.get_json(&format!(
            "{}/apis/eventing.kyma-project.io/v1alpha2/namespaces/default/subscriptions/audit-orders",
            platform.api
        )).await;
    assert_eq!(
        subscription["apiVersion"],
        "eventing.kyma-project.io/v1alpha2"
    );
    assert_eq!(subscription["spec"]["config"]["maxInFlightMessages"], "5");
    assert_eq!(
        subscription["status"]["types"][0]["originalType"],
        "order.received.v1"
    );

    // The Function's labels and annotations are on its instances.
    let (ok, table, stderr) = platform.eddy(&["get", "instances", "audit"]).await;
    assert!(ok, "{stderr}");
    assert!(
        table.contains("Running")
            && table.contains("team=orders")
            && table.contains("eddy.dev/function=audit"),
        "{table}"
    );
    let instances: Value = platform
        .get_json(&format!(
            "{}/apis/eddy.dev/v1alpha1/namespaces/default/functions/audit/instances",
            platform.api
        ))
        .await;
    assert_eq!(
        instances["items"][0]["metadata"]["annotations"]["example.com/owner"],
        "orders-team"
    );
    let audit = platform.function("audit").await;
    assert_eq!(
        audit["status"]["functionAnnotations"]["example.com/owner"], "orders-team",
        "Kyma's status names the pods' annotations: {audit}"
    );

    // A Secret's values are never shown.
    let (ok, table, _) = platform.eddy(&["get", "secrets"]).await;
    assert!(ok);
    assert!(
        table.contains("orders-db") && table.contains("Opaque"),
        "{table}"
    );
    let (ok, yaml, _) = platform
        .eddy(&["get", "secret", "orders-db", "-o", "yaml"])
        .await;
    assert!(ok);
    assert!(
        yaml.contains("password") && !yaml.contains("example-only-password"),
        "{yaml}"
    );
    assert!(
        !yaml.contains(&base64_of("example-only-password")),
        "{yaml}"
    );

    // `eddy convert` gives eddy's own form, which applies and behaves the same.
    let (ok, converted, stderr) = platform
        .eddy(&["convert", "-f", examples().to_str().unwrap()])
        .await;
    assert!(ok, "{stderr}");
    assert!(!converted.contains("kyma-project.io"), "{converted}");
    assert!(converted.contains("timeoutSeconds: 10"), "{converted}");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("converted.yaml");
    std::fs::write(
        &file,
        converted.replace("audit.default.svc", "audit.converted.svc"),
    )
    .unwrap();
    let (ok, stdout, stderr) = platform
        .eddy(&["apply", "-n", "converted", "-f", file.to_str().unwrap()])
        .await;
    assert!(ok, "{stdout}\n{stderr}");
    examples_behave(&platform, "converted").await;
    let function = platform.wait_running_at("converted", "greeter").await;
    assert_eq!(function["apiVersion"], "eddy.dev/v1alpha1");
    assert_eq!(function["spec"]["timeoutSeconds"], 10);
}

fn base64_of(text: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(text)
}

async fn put_secret(platform: &Platform, name: &str, data: Value) {
    let secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": data});
    let path = format!("/api/v1/namespaces/default/secrets/{name}");
    let (status, body) = platform.put_json(&path, &secret).await;
    assert!(status == 200 || status == 201, "{status}: {body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_function_waits_for_its_secret_and_follows_its_changes() {
    let platform = Platform::start().await;
    let source = r#"
        const fs = require("fs");
        module.exports = { main: () => ({
            token: process.env.TOKEN,
            optional: process.env.OPTIONAL ?? null,
            file: fs.readFileSync("/var/run/secrets/api/token", "utf8"),
            listed: fs.readdirSync("/var/run/secrets/api").sort(),
        }) };
    "#;
    let function = json!({
        "apiVersion": "serverless.kyma-project.io/v1alpha2", "kind": "Function",
        "metadata": {"name": "reader"},
        "spec": {
            "runtime": "nodejs22",
            "source": {"inline": {"source": source}},
            "env": [
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "api", "key": "token"}}},
                {"name": "OPTIONAL", "valueFrom": {"configMapKeyRef": {"name": "absent", "key": "x", "optional": true}}},
            ],
            "secretMounts": [{"secretName": "api", "mountPath": "/var/run/secrets/api"}],
        },
    });
    let (status, body) = platform
        .put_json(
            "/apis/serverless.kyma-project.io/v1alpha2/namespaces/default/functions/reader",
            &function,
        )
        .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["apiVersion"], "serverless.kyma-project.io/v1alpha2");
    eventually(
        "the missing Secret to be named",
        Duration::from_secs(30),
        || async {
            let (status, reason, message) =
                platform.condition("reader", "ConfigurationReady").await;
            status == "False"
                && reason == "ReferenceNotFound"
                && message.contains("Secret api not found")
        },
    )
    .await
    .unwrap();
    let (status, body) = call(&platform, "default", "reader", None).await;
    assert_eq!(status, 503, "{body}");

    put_secret(&platform, "api", json!({"token": "first"})).await;
    platform.wait_running_at("default", "reader").await;
    let (status, body) = call(&platform, "default", "reader", None).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({"token": "first", "optional": null, "file": "first", "listed": ["token"]})
    );
    let log = platform.function_log("reader").await;
    assert!(!log.contains("first"), "{log}");

    // A changed Secret reaches new instances, as the pods of a restarted Deployment get it.
    put_secret(&platform, "api", json!({"token": "second", "extra": "x"})).await;
    eventually("the new Secret to be served", Duration::from_secs(60), || async {
        let (_, body) = call(&platform, "default", "reader", None).await;
        body == json!({"token": "second", "optional": null, "file": "second", "listed": ["extra", "token"]})
    })
    .await
    .unwrap();
}

fn git(dir: &Path, args: &[&str]) {
    let output = std::process::Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_AUTHOR_NAME", "eddy test")
        .env("GIT_AUTHOR_EMAIL", "test@example.com")
        .env("GIT_COMMITTER_NAME", "eddy test")
        .env("GIT_COMMITTER_EMAIL", "test@example.com")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Commits `handler` (and a helper module it requires) under `hello/` and pushes to `main`.
fn push_version(work: &Path, version: &str) {
    let code = work.join("hello");
    std::fs::create_dir_all(&code).unwrap();
    std::fs::write(
        code.join("handler.js"),
        "const { version } = require('./version');\nmodule.exports = { main: () => ({ version }) };\n",
    )
    .unwrap();
    std::fs::write(
        code.join("version.js"),
        format!("module.exports = {{ version: '{version}' }};\n"),
    )
    .unwrap();
    git(work, &["add", "."]);
    git(work, &["commit", "-q", "-m", version]);
    git(work, &["push", "-q", "origin", "HEAD:main"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_git_source_is_built_at_its_reference_and_rebuilt_when_it_moves() {
    let platform = Platform::start_with(Options {
        git_poll_interval: Duration::from_millis(500),
        ..Options::default()
    })
    .await;
    let repos = tempfile::tempdir().unwrap();
    let bare = repos.path().join("functions.git");
    let work = repos.path().join("work");
    new_repository(&bare, &work);
    push_version(&work, "v1");

    let manifest = std::fs::read_to_string(examples().join("git/function.yaml"))
        .unwrap()
        .replace(
            "https://github.com/your-org/functions.git",
            &format!("file://{}", bare.display()),
        );
    let (ok, stdout, stderr) = platform.apply_text(&manifest).await;
    assert!(ok, "{stdout}\n{stderr}");
    platform.wait_running_at("default", "git-hello").await;
    let (status, body) = call(&platform, "default", "git-hello", None).await;
    assert_eq!((status, body), (200, json!({"version": "v1"})));

    // The branch moves: the new commit is built and rolled out without a new apply.
    push_version(&work, "v2");
    eventually(
        "the new commit to serve",
        Duration::from_secs(120),
        || async {
            call(&platform, "default", "git-hello", None).await.1 == json!({"version": "v2"})
        },
    )
    .await
    .unwrap();

    // A reference that names nothing is said in status.
    let mut function: Value = serde_yaml_ng::from_str(&manifest).unwrap();
    function["spec"]["source"]["gitRepository"]["reference"] = json!("no-such-branch");
    let (status, body) = platform
        .put_json(
            "/apis/serverless.kyma-project.io/v1alpha2/namespaces/default/functions/git-hello",
            &function,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    eventually(
        "the bad reference to be reported",
        Duration::from_secs(30),
        || async {
            let (status, reason, message) = platform.condition("git-hello", "BuildReady").await;
            status == "False" && reason == "SourceUnavailable" && message.contains("no-such-branch")
        },
    )
    .await
    .unwrap();
    // The last good revision keeps serving.
    let (status, body) = call(&platform, "default", "git-hello", None).await;
    assert_eq!((status, body), (200, json!({"version": "v2"})));
}

/// A bare repository at `bare` with `hello/` at v1 on `main`; the work tree is `work`.
/// A bare repository at `bare` (branch `main`) and a work tree at `work` that pushes to it.
fn new_repository(bare: &Path, work: &Path) {
    std::fs::create_dir_all(bare).unwrap();
    git(bare, &["init", "-q", "--bare", "-b", "main"]);
    std::fs::create_dir_all(work).unwrap();
    git(work, &["init", "-q", "-b", "main"]);
    git(work, &["remote", "add", "origin", bare.to_str().unwrap()]);
}

fn repository_at(bare: &Path, work: &Path) {
    new_repository(bare, work);
    push_version(work, "v1");
}

fn git_function(name: &str, url: &str) -> Value {
    json!({
        "apiVersion": "serverless.kyma-project.io/v1alpha2", "kind": "Function",
        "metadata": {"name": name},
        "spec": {"runtime": "nodejs22", "source": {"gitRepository": {"url": url, "reference": "main", "baseDir": "hello"}}},
    })
}

/// Several Functions of one repository and reference applied at once all build (one checkout,
/// shared); a Function whose repository could not be reached at first is tried again at each
/// poll and runs once it can be.
#[tokio::test(flavor = "multi_thread")]
async fn functions_of_one_repository_build_together_and_an_unreachable_source_is_retried() {
    let platform = Platform::start_with(Options {
        git_poll_interval: Duration::from_millis(500),
        dispatcher: false,
        ..Options::default()
    })
    .await;
    let repos = tempfile::tempdir().unwrap();
    let bare = repos.path().join("shared.git");
    repository_at(&bare, &repos.path().join("work"));
    let url = format!("file://{}", bare.display());
    let names: Vec<String> = (0..5).map(|i| format!("same-repo-{i}")).collect();
    let applied = futures::future::join_all(names.iter().map(|name| {
        let platform = &platform;
        let function = git_function(name, &url);
        async move {
            platform
                .put_json(
                    &format!("/apis/serverless.kyma-project.io/v1alpha2/namespaces/default/functions/{name}"),
                    &function,
                )
                .await
        }
    }))
    .await;
    for (status, body) in applied {
        assert_eq!(status, 201, "{body}");
    }
    for name in &names {
        let function = platform.wait_running_at("default", name).await;
        let (status, body) = call(&platform, "default", name, None).await;
        assert_eq!((status, body), (200, json!({"version": "v1"})), "{name}");
        // Kyma's current status of a Git source, with the commit built.
        let git = &function["status"]["gitRepository"];
        assert_eq!(git["url"], url.as_str(), "{function}");
        assert_eq!(git["reference"], "main");
        assert_eq!(git["baseDir"], "hello");
        assert_eq!(git["commit"], function["status"]["commit"]);
        assert_eq!(git["commit"].as_str().map(str::len), Some(40), "{function}");
    }

    // A repository that is not there yet: SourceUnavailable, then running once it is.
    let later = repos.path().join("later.git");
    let function = git_function("comes-later", &format!("file://{}", later.display()));
    let (status, body) = platform
        .put_json(
            "/apis/serverless.kyma-project.io/v1alpha2/namespaces/default/functions/comes-later",
            &function,
        )
        .await;
    assert_eq!(status, 201, "{body}");
    eventually(
        "the unreachable source to be reported",
        Duration::from_secs(30),
        || async {
            let (status, reason, _) = platform.condition("comes-later", "BuildReady").await;
            status == "False" && reason == "SourceUnavailable"
        },
    )
    .await
    .unwrap();
    repository_at(&later, &repos.path().join("later-work"));
    platform.wait_running_at("default", "comes-later").await;
    let (status, body) = call(&platform, "default", "comes-later", None).await;
    assert_eq!((status, body), (200, json!({"version": "v1"})));
}

#[tokio::test(flavor = "multi_thread")]
async fn kyma_fields_eddy_cannot_honour_are_refused_by_name() {
    let platform = Platform::start_with(Options {
        dispatcher: false,
        ..Options::default()
    })
    .await;
    let refused = |spec: Value| {
        let platform = &platform;
        async move {
            let (status, body) = platform
                .put_json(
                    "/apis/serverless.kyma-project.io/v1alpha2/namespaces/default/functions/bad",
                    &json!({"apiVersion": "serverless.kyma-project.io/v1alpha2", "kind": "Function",
                       "metadata": {"name": "bad"}, "spec": spec}),
                )
                .await;
            assert_eq!(status, 422, "{body}");
            body["details"]["causes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|cause| {
                    format!(
                        "{}: {}",
                        cause["field"].as_str().unwrap(),
                        cause["message"].as_str().unwrap()
                    )
                })
                .collect::<Vec<_>>()
                .join("\n")
        }
    };
    let inline = json!({"inline": {"source": "module.exports = {main: () => 1}"}});
    // fieldRef and resourceFieldRef are taken (as Kubernetes takes them); a field Kubernetes
    // does not pass to env is not.
    let causes = refused(json!({"runtime": "nodejs22", "source": inline,
        "env": [{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.containers"}}},
                {"name": "GPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.gpu"}}}]}))
    .await;
    assert_eq!(
        causes,
        format!(
            "spec.env[0].valueFrom.fieldRef.fieldPath: {}\n\
             spec.env[1].valueFrom.resourceFieldRef.resource: {}",
            eddy_model::resources::FIELD_PATH_MESSAGE,
            eddy_model::resources::RESOURCE_MESSAGE
        )
    );
    let causes = refused(json!({"runtime": "nodejs22", "source": inline,
        "env": [{"name": "FUNC_TIMEOUT", "value": "soon"}, {"name": "REQ_MB_LIMIT", "value": "0"}]})).await;
    assert_eq!(
        causes,
        "spec.env[0].value: FUNC_TIMEOUT must be a whole number of seconds between 1 and 3600\n\
         spec.env[1].value: REQ_MB_LIMIT must be a whole number of MiB between 1 and 1024"
    );
    let causes = refused(json!({"runtime": "nodejs22", "source": inline,
        "secretMounts": [{"secretName": "s", "mountPath": "relative/dir"}],
        "labels": {"eddy.dev/function": "other"}}))
    .await;
    assert_eq!(
        causes,
        "spec.secretMounts[0].mountPath: must be an absolute directory other than /, without '.' or '..'\n\
         spec.labels.eddy.dev/function: eddy.dev/ keys are set by the platform"
    );
    let causes = refused(json!({"runtime": "nodejs22",
        "source": {"gitRepository": {"url": "--upload-pack=touch /tmp/x", "reference": "-x"}}}))
    .await;
    assert_eq!(
        causes,
        "spec.source.gitRepository.url: must be an https, http, ssh, file or git@host:path URL, or host/path (github.com/org/repo)\n\
         spec.source.gitRepository.reference: must be a branch, tag or commit: no spaces, not starting with '-'"
    );
    let causes = refused(json!({"runtime": "nodejs18", "source": inline})).await;
    assert!(
        causes.starts_with("spec.runtime: unknown variant `nodejs18`"),
        "{causes}"
    );
}

/// A mount inside another (`/s` and `/s/inner`, which Kubernetes allows) shows its own Secret:
/// the deepest mount wins, in both runtimes, and Python reads it through `open`, `os.scandir`
/// and `pathlib` alike.
#[tokio::test(flavor = "multi_thread")]
async fn nested_secret_mounts_each_show_their_own_secret() {
    let platform = Platform::start().await;
    put_secret(&platform, "outer", json!({"a": "from-outer"})).await;
    put_secret(&platform, "inner", json!({"b": "from-inner"})).await;
    let mounts = json!([
        {"secretName": "outer", "mountPath": "/s"},
        {"secretName": "inner", "mountPath": "/s/inner"},
    ]);
    for (name, runtime, source) in [
        (
            "nested-node",
            "nodejs22",
            r#"const fs = require("fs"); module.exports = { main: () => fs.readFileSync("/s/a", "utf8") + " " + fs.readFileSync("/s/inner/b", "utf8") };"#,
        ),
        (
            "nested-python",
            "python311",
            "def main(event, context):\n    return open('/s/a').read() + ' ' + open('/s/inner/b').read()\n",
        ),
        // The ways Python code lists and reads a mount besides open(): os.scandir, pathlib.
        (
            "nested-pathlib",
            "python311",
            "import os, pathlib\n\
             def main(event, context):\n    \
                 names = sorted(entry.name for entry in os.scandir('/s') if entry.is_file())\n    \
                 inner = pathlib.Path('/s/inner')\n    \
                 listed = sorted(p.name for p in inner.iterdir())\n    \
                 assert names == ['a'] and listed == ['b'] and (inner / 'b').exists(), (names, listed)\n    \
                 return pathlib.Path('/s/a').read_text() + ' ' + (inner / 'b').read_text()\n",
        ),
    ] {
        let function = json!({
            "apiVersion": "serverless.kyma-project.io/v1alpha2", "kind": "Function",
            "metadata": {"name": name},
            "spec": {"runtime": runtime, "source": {"inline": {"source": source}}, "secretMounts": mounts},
        });
        let (status, body) = platform
            .put_json(
                &format!(
                    "/apis/serverless.kyma-project.io/v1alpha2/namespaces/default/functions/{name}"
                ),
                &function,
            )
            .await;
        assert_eq!(status, 201, "{body}");
        platform.wait_running_at("default", name).await;
        let (status, body) = call(&platform, "default", name, None).await;
        assert_eq!(
            (status, body),
            (200, json!("from-outer from-inner")),
            "{name}"
        );
    }
    // The files behind the mounts are private: directories 0700, files 0600.
    fn walk(dir: &Path, seen: &mut Vec<(std::path::PathBuf, u32)>) {
        use std::os::unix::fs::PermissionsExt as _;
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let mode = entry.metadata().unwrap().permissions().mode() & 0o777;
            seen.push((entry.path(), mode));
            if entry.file_type().unwrap().is_dir() {
                walk(&entry.path(), seen);
            }
        }
    }
    let mut seen = Vec::new();
    walk(&platform.data_dir.path().join("secret-mounts"), &mut seen);
    assert!(seen.iter().any(|(path, _)| path.is_file()), "{seen:?}");
    for (path, mode) in &seen {
        let wanted = if path.is_dir() { 0o700 } else { 0o600 };
        assert_eq!(*mode, wanted, "{}", path.display());
    }
}

/// Kyma's Subscription rules, applied as Kyma users write them: exact matching takes the type
/// alone (`source: ""` included, and a source given anyway is ignored with a warning), standard
/// matching takes the source too, the status lists Kyma's `cleanType`, and `config` keys of
/// Kyma's EventMesh backend are kept and reported as ignored.
#[tokio::test(flavor = "multi_thread")]
async fn kyma_subscriptions_match_as_kyma_does() {
    let platform = Platform::start().await;
    let exact = support::Sink::ok().await;
    let exact_with_source = support::Sink::ok().await;
    let standard = support::Sink::ok().await;
    let manifest = format!(
        r#"apiVersion: eventing.kyma-project.io/v1alpha2
kind: Subscription
metadata:
  name: exact-any-source
spec:
  sink: {exact}
  source: ""
  types: [order.created.v1]
  typeMatching: exact
# As Kyma's Go client serialises a Subscription it creates: with its zero status, which the
# API server ignores on create, and so does eddy.
status:
  ready: false
  backend: {{}}
---
apiVersion: eventing.kyma-project.io/v1alpha2
kind: Subscription
metadata:
  name: exact-source-ignored
spec:
  sink: {exact_with_source}
  source: shop
  types: [order.created.v1]
  typeMatching: exact
---
apiVersion: eventing.kyma-project.io/v1alpha2
kind: Subscription
metadata:
  name: standard-from-shop
spec:
  sink: {standard}
  source: shop
  types: [order.created.v1, "order/shipped v1"]
  typeMatching: standard
  config:
    maxInFlightMessages: "3"
    webhookAuth: oauth2
"#,
        exact = exact.url,
        exact_with_source = exact_with_source.url,
        standard = standard.url,
    );
    let (ok, stdout, stderr) = platform.apply_text(&manifest).await;
    assert!(ok, "{stdout}\n{stderr}");
    for warning in [
        "subscription.eddy.dev/exact-source-ignored: spec.source is ignored with exact type matching",
        "subscription.eddy.dev/standard-from-shop: spec.config.webhookAuth is ignored",
    ] {
        assert!(stderr.contains(warning), "{warning} in {stderr}");
    }
    for name in [
        "exact-any-source",
        "exact-source-ignored",
        "standard-from-shop",
    ] {
        platform.wait_subscription_ready(name).await;
    }

    platform
        .publish("shop", "order.created.v1", "from-shop", json!({}))
        .await;
    platform
        .publish("crm", "order.created.v1", "from-crm", json!({}))
        .await;
    exact.wait_for(2).await;
    exact_with_source.wait_for(2).await;
    standard.wait_for(1).await;
    let mut ids = exact.ids();
    ids.sort();
    assert_eq!(ids, ["from-crm", "from-shop"], "exact: any source");
    // Kyma's publisher proxy sets `originaltype` (the type as published) on every event it
    // builds, and Kyma's dispatcher delivers it: Kyma's e2e suite checks it on every event.
    for received in exact.received() {
        assert_eq!(
            received
                .headers
                .get("ce-originaltype")
                .map(|v| v.as_bytes()),
            Some(&b"order.created.v1"[..]),
            "{:?}",
            received.headers
        );
    }
    let mut ids = exact_with_source.ids();
    ids.sort();
    assert_eq!(
        ids,
        ["from-crm", "from-shop"],
        "exact: the source is ignored"
    );
    // The standard one took shop's event; crm's was published after it and is not coming
    // (the exact ones got it, so it was stored and dispatched).
    platform.wait_settled("standard-from-shop").await;
    assert_eq!(standard.ids(), ["from-shop"], "standard: only shop's");

    let status = platform.subscription("standard-from-shop").await;
    assert_eq!(
        status["spec"]["config"]["webhookAuth"], "oauth2",
        "kept as written"
    );
    let (_, _, message) = condition_of(&status, "Ready");
    assert!(
        message.contains("spec.config.webhookAuth is ignored"),
        "{message}"
    );
    assert_eq!(
        status["status"]["types"][1]["originalType"],
        "order/shipped v1"
    );
    assert_eq!(status["status"]["types"][1]["cleanType"], "ordershippedv1");
    let status = platform.subscription("exact-source-ignored").await;
    let (_, _, message) = condition_of(&status, "Ready");
    assert!(message.contains("spec.source is ignored"), "{message}");
    // Kyma's conditions, which Kyma's tools wait for (eventing-manager's JetStream backend:
    // type "Subscription active", reason "NATS Subscription active").
    let (state, reason, _) = condition_of(&status, "Subscription active");
    assert_eq!(
        (state.as_str(), reason.as_str()),
        ("True", "NATS Subscription active")
    );
    let (state, reason, _) = condition_of(&status, "Subscription spec valid");
    assert_eq!(
        (state.as_str(), reason.as_str()),
        ("True", "Subscription spec has no validation errors")
    );
    assert_eq!(
        platform.subscription("exact-any-source").await["status"]["backend"]["type"],
        "nats-jetstream",
        "the status eddy wrote, not the one applied"
    );
    assert_eq!(
        status["status"]["types"][0]["cleanType"],
        "order.created.v1"
    );
}

/// Kyma's publisher proxy publishes a legacy event twice (`publishLegacyEventsAsCE`): as a
/// CloudEvent of the application, and in Kyma's legacy form
/// `sap.kyma.custom.<app>.<event>.<version>` (`WriteLegacyRequestsToCE`), which the exact
/// Subscriptions of Kyma's eventing e2e suite name (`sap.kyma.custom.commerce.order.created.v1`,
/// source `commerce`, checked for id, type, source, data and `originaltype`). eddy stores
/// both; a Subscription that takes both forms gets the event once, in its own form.
#[tokio::test(flavor = "multi_thread")]
async fn legacy_events_reach_subscriptions_in_kymas_legacy_form_once() {
    let platform = Platform::start().await;
    let exact = support::Sink::ok().await;
    let standard = support::Sink::ok().await;
    let both = support::Sink::ok().await;
    let manifest = format!(
        r#"apiVersion: eventing.kyma-project.io/v1alpha2
kind: Subscription
metadata:
  name: legacy-exact
spec:
  sink: {exact}
  source: commerce
  types: [sap.kyma.custom.commerce.order.created.v1]
  typeMatching: exact
---
apiVersion: eventing.kyma-project.io/v1alpha2
kind: Subscription
metadata:
  name: legacy-standard
spec:
  sink: {standard}
  source: commerce
  types: [order.created.v1]
---
apiVersion: eventing.kyma-project.io/v1alpha2
kind: Subscription
metadata:
  name: legacy-both
spec:
  sink: {both}
  source: ""
  types: [order.created.v1, sap.kyma.custom.commerce.order.created.v1]
  typeMatching: exact
"#,
        exact = exact.url,
        standard = standard.url,
        both = both.url,
    );
    let (ok, stdout, stderr) = platform.apply_text(&manifest).await;
    assert!(ok, "{stdout}\n{stderr}");
    for name in ["legacy-exact", "legacy-standard", "legacy-both"] {
        platform.wait_subscription_ready(name).await;
    }
    let response = platform
        .http
        .post(format!("{}/commerce/v1/events", platform.bus))
        .json(
            &json!({"event-type": "order.created", "event-type-version": "v1",
            "event-id": "legacy-1", "event-time": "2020-04-02T21:37:00Z",
            "data": "{\"app\":\"commerce\",\"mode\":\"legacy\"}"}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{:?}", response.text().await);
    exact.wait_for(1).await;
    standard.wait_for(1).await;
    both.wait_for(1).await;
    for name in ["legacy-exact", "legacy-standard", "legacy-both"] {
        platform.wait_settled(name).await;
    }
    let only = |sink: &support::Sink| {
        let received = sink.received();
        assert_eq!(received.len(), 1, "{:?}", sink.ids());
        let event = &received[0];
        (
            event.header("ce-id").to_owned(),
            event.header("ce-type").to_owned(),
            event.header("ce-source").to_owned(),
            event.header("ce-originaltype").to_owned(),
            event.body.clone(),
        )
    };
    let data = bytes::Bytes::from_static(br#""{\"app\":\"commerce\",\"mode\":\"legacy\"}""#);
    let kyma_form = "sap.kyma.custom.commerce.order.created.v1";
    assert_eq!(
        only(&exact),
        (
            "legacy-1".into(),
            kyma_form.into(),
            "commerce".into(),
            kyma_form.into(),
            data.clone()
        )
    );
    let own_form = (
        "legacy-1".to_owned(),
        "order.created.v1".to_owned(),
        "commerce".to_owned(),
        "order.created.v1".to_owned(),
        data,
    );
    assert_eq!(only(&standard), own_form);
    assert_eq!(only(&both), own_form, "once, in its own form");
}

/// What Kyma's samples write that Kubernetes allows: env names with `-` and `.` (`API-KEY`),
/// `fieldRef` and `resourceFieldRef` (locally: the Function's name, namespace and labels, its
/// profile's resources), Kyma's current body limit `FUNC_BODY_MB_LIMIT` in both runtimes, and
/// the deprecated `template`, taken with a warning.
#[tokio::test(flavor = "multi_thread")]
async fn kyma_functions_take_kubernetes_env_forms_the_body_limit_and_template() {
    let platform = Platform::start_with(Options {
        dispatcher: false,
        ..Options::default()
    })
    .await;
    let node = r#"module.exports = { main: (event) => ({
        key: process.env["API-KEY"], mode: process.env["app.mode"], pod: process.env.POD,
        ns: process.env.NS, tier: process.env.TIER, mem: process.env.MEM,
        size: JSON.stringify(event.data || "").length }) };"#;
    let python = "def main(event, context):\n    return {'size': len(str(event['data']))}\n";
    let manifest = format!(
        r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: envy
spec:
  runtime: nodejs22
  source:
    inline:
      source: {node:?}
  resourceConfiguration:
    function:
      profile: S
  template:
    labels:
      tier: gold
  env:
    - name: API-KEY
      value: k1
    - name: app.mode
      value: dev
    - name: POD
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
    - name: NS
      valueFrom:
        fieldRef:
          fieldPath: metadata.namespace
    - name: TIER
      valueFrom:
        fieldRef:
          fieldPath: metadata.labels['tier']
    - name: MEM
      valueFrom:
        resourceFieldRef:
          resource: limits.memory
          divisor: 1Mi
    - name: FUNC_BODY_MB_LIMIT
      value: "3"
---
apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: small
spec:
  runtime: nodejs22
  source:
    inline:
      source: {node:?}
---
apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: pyenvy
spec:
  runtime: python312
  source:
    inline:
      source: {python:?}
  env:
    - name: FUNC_BODY_MB_LIMIT
      value: "1"
"#
    );
    let (ok, stdout, stderr) = platform.apply_text(&manifest).await;
    assert!(ok, "{stdout}\n{stderr}");
    assert!(
        stderr.contains("function.eddy.dev/envy: spec.template is deprecated"),
        "{stderr}"
    );
    for name in ["envy", "small", "pyenvy"] {
        platform.wait_running_at("default", name).await;
    }
    let (status, body) = call(&platform, "default", "envy", None).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({"key": "k1", "mode": "dev", "pod": "envy", "ns": "default", "tier": "gold",
               "mem": "256", "size": 2})
    );
    // A 2 MiB body: within envy's 3 MiB, over the 1 MiB default of small.
    let big = json!({"blob": "x".repeat(2 * 1024 * 1024)});
    let (status, body) = call(&platform, "default", "envy", Some(big.clone())).await;
    assert_eq!(status, 200, "{body}");
    assert!(body["size"].as_u64().unwrap() > 2 * 1024 * 1024, "{body}");
    let (status, _) = call(&platform, "default", "small", Some(big.clone())).await;
    assert_eq!(status, 413, "the default limit is 1 MiB");
    // Python: FUNC_BODY_MB_LIMIT in MiB (Kyma's python314), here under the body.
    let (status, _) = call(&platform, "default", "pyenvy", Some(big)).await;
    assert_eq!(status, 413, "python's limit is FUNC_BODY_MB_LIMIT");
    let (status, body) = call(&platform, "default", "pyenvy", Some(json!({"a": 1}))).await;
    assert_eq!(status, 200, "{body}");
    // The status says what Kyma's does.
    let function = platform.wait_running_at("default", "envy").await;
    assert_eq!(function["status"]["functionResourceProfile"], "S");
    assert_eq!(function["status"]["runtime"], "nodejs22");
}

/// Git URLs as Kyma's docs write them: a host and path without a scheme is fetched over HTTPS.
#[test]
fn a_git_url_without_a_scheme_is_fetched_over_https() {
    use eddy_model::resources::git_remote_url;
    assert_eq!(
        git_remote_url("github.com/kyma-project/examples"),
        "https://github.com/kyma-project/examples"
    );
    for as_written in [
        "https://github.com/kyma-project/examples.git",
        "git@github.com:kyma-project/examples.git",
        "ssh://git@github.com/kyma-project/examples.git",
        "file:///srv/repo",
    ] {
        assert_eq!(git_remote_url(as_written), as_written);
    }
}

/// The shape of Kyma's in-cluster eventing sample: one repository holds an emitter and a
/// receiver, both Functions and the Subscription between them are one file applied at once
/// (`eddy apply`), both at the same reference. Both build from the one checkout, and the
/// receiver gets what the emitter publishes (through a sink with a port and a path, which Kyma
/// takes).
#[tokio::test(flavor = "multi_thread")]
async fn two_functions_of_one_repository_in_one_file_build_and_talk() {
    let platform = Platform::start_with(Options {
        git_poll_interval: Duration::from_millis(500),
        ..Options::default()
    })
    .await;
    let repos = tempfile::tempdir().unwrap();
    let bare = repos.path().join("eventing.git");
    let work = repos.path().join("work");
    new_repository(&bare, &work);
    std::fs::create_dir_all(work.join("emitter")).unwrap();
    std::fs::create_dir_all(work.join("receiver")).unwrap();
    std::fs::write(
        work.join("emitter/handler.js"),
        "module.exports = { main: async (event) => {\n\
           await event.emitCloudEvent('sample.order.placed.v1', 'emitter', {order: event.data.order});\n\
           return 'sent';\n} };\n",
    )
    .unwrap();
    std::fs::write(
        work.join("receiver/handler.js"),
        "module.exports = { main: (event) => { console.log('received order ' + event.data.order); return ''; } };\n",
    )
    .unwrap();
    git(&work, &["add", "."]);
    git(&work, &["commit", "-q", "-m", "sample"]);
    git(&work, &["push", "-q", "origin", "HEAD:main"]);
    let url = format!("file://{}", bare.display());
    let manifest = format!(
        r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: emitter
spec:
  runtime: nodejs22
  source:
    gitRepository:
      url: {url}
      baseDir: /emitter
      reference: main
---
apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: receiver
spec:
  runtime: nodejs22
  source:
    gitRepository:
      url: {url}
      baseDir: /receiver
      reference: main
---
apiVersion: eventing.kyma-project.io/v1alpha2
kind: Subscription
metadata:
  name: receiver-orders
spec:
  sink: http://receiver.default.svc.cluster.local:8080/incoming
  source: ""
  types: [sample.order.placed.v1]
  typeMatching: exact
"#
    );
    let (ok, stdout, stderr) = platform.apply_text(&manifest).await;
    assert!(ok, "{stdout}\n{stderr}");
    for name in ["emitter", "receiver"] {
        let function = platform.wait_running_at("default", name).await;
        assert_eq!(function["status"]["repository"]["reference"], "main");
        assert!(function["status"]["commit"].is_string(), "{function}");
    }
    platform.wait_subscription_ready("receiver-orders").await;
    let (status, body) = call(
        &platform,
        "default",
        "emitter",
        Some(json!({"order": "o-17"})),
    )
    .await;
    assert_eq!((status, body), (200, json!("sent")));
    eventually(
        "the receiver to log the order",
        Duration::from_secs(30),
        || async {
            platform
                .function_log("receiver")
                .await
                .contains("received order o-17")
        },
    )
    .await
    .unwrap();
}

/// Kyma's tutorials for exposing a Function, applied unchanged in one file with their
/// Functions: the noAuth APIRule answers 200 without a token; the JWT one 401 without and 200
/// with a valid token, on its host and on the gateway's own path to the Function. Rules decide
/// by path and method; `v2alpha1` reads the same; `corsPolicy` answers preflights; the status
/// is Kyma's; and a file with one refused APIRule (its host an address) applies nothing.
#[tokio::test(flavor = "multi_thread")]
async fn kyma_apirules_expose_functions_as_kymas_tutorials_do() {
    use support::jwt::{ISSUER, ISSUER_KEY, OTHER_KEY, jwt, serve_jwks};
    let platform = Platform::start_with(Options {
        dispatcher: false,
        ..Options::default()
    })
    .await;
    let (jwks_uri, _) = serve_jwks().await;
    let manifest = format!(
        r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: hello
spec:
  runtime: nodejs22
  source:
    inline:
      source: |
        module.exports = {{
          main: function (event, context) {{
            return "Hello World! " + event.extensions.request.path;
          }}
        }}
---
apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata:
  name: hello
spec:
  hosts:
    - hello
  service:
    name: hello
    namespace: default
    port: 80
  gateway: kyma-system/kyma-gateway
  rules:
    - path: /*
      methods: ["GET", "POST"]
      noAuth: true
---
apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: secured
spec:
  runtime: nodejs22
  source:
    inline:
      source: |
        module.exports = {{ main: function (event, context) {{ return "secret"; }} }}
---
apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata:
  name: secured
  namespace: default
spec:
  hosts:
    - secured.example.com
  service:
    name: secured
    namespace: default
    port: 80
  gateway: kyma-system/kyma-gateway
  rules:
    - jwt:
        authentications:
          - issuer: {ISSUER}
            jwksUri: {jwks_uri}
      methods:
        - GET
      path: /*
---
apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: keyless
spec:
  runtime: nodejs22
  source:
    inline:
      source: |
        module.exports = {{ main: function (event, context) {{ return "never"; }} }}
---
apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata:
  name: keyless
  namespace: default
spec:
  hosts:
    - keyless.example.com
  service:
    name: keyless
    namespace: default
    port: 80
  gateway: kyma-system/kyma-gateway
  rules:
    - jwt:
        authentications:
          - issuer: {ISSUER}
            jwksUri: http://127.0.0.1:1/jwks
      methods:
        - GET
      path: /*
---
apiVersion: gateway.kyma-project.io/v2alpha1
kind: APIRule
metadata:
  name: hello-alpha
spec:
  hosts:
    - hello-alpha.example.com
  service:
    name: hello
    port: 80
  corsPolicy:
    allowOrigins:
      - exact: https://shop.example.com
    allowMethods: ["GET"]
    allowHeaders: ["x-shop"]
    exposeHeaders: ["x-order-id"]
    allowCredentials: true
    maxAge: 600
  rules:
    - path: /orders/{{*}}
      methods: ["GET"]
      noAuth: true
"#
    );
    let (ok, stdout, stderr) = platform.apply_text(&manifest).await;
    assert!(ok, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("apirule.gateway.kyma-project.io/hello created"),
        "{stdout}"
    );
    for name in ["hello", "secured", "keyless"] {
        platform.wait_running_at("default", name).await;
    }
    let port = platform.gateway.rsplit(':').next().unwrap().to_owned();
    eventually(
        "the APIRules to be Ready",
        Duration::from_secs(30),
        || async {
            let mut ready = true;
            for name in ["hello", "secured", "keyless", "hello-alpha"] {
                ready &= platform.apirule_state("default", name).await.0 == "Ready";
            }
            ready
        },
    )
    .await
    .unwrap();
    assert_eq!(
        platform.apirule_state("default", "hello").await.1,
        format!("exposed on http://hello.localhost:{port}")
    );
    let hosts = platform.host_client(&[
        "hello.localhost",
        "secured.example.com",
        "keyless.example.com",
        "hello-alpha.example.com",
    ]);
    let get = |url: String, token: Option<String>| {
        let hosts = hosts.clone();
        async move {
            let mut request = hosts.get(url);
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            let response = request.send().await.unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        }
    };

    // noAuth: 200 without a token, the whole path kept; a method no rule lists: 404.
    let hello = format!("http://hello.localhost:{port}");
    assert_eq!(
        get(format!("{hello}/greet"), None).await,
        (200, "Hello World! /greet".to_owned())
    );
    let posted = hosts.post(format!("{hello}/")).send().await.unwrap();
    assert_eq!(posted.status(), 200);
    // A method no rule lists has no route: 404, as Kyma's gateway (Envoy) answers a call no
    // route matches. api-gateway's docs on rule order: "each request is evaluated against the
    // list of paths from top to bottom in your APIRule, and the first matching rule is
    // applied"; with none, there is no route.
    let deleted = hosts.delete(format!("{hello}/")).send().await.unwrap();
    assert_eq!(deleted.status(), 404);

    // JWT, as Kyma's gateway answers: 403 `RBAC: access denied` without a token, 401 `Jwt
    // verification fails` with another issuer's key, 200 with a valid one.
    let secured = format!("http://secured.example.com:{port}/");
    assert_eq!(
        get(secured.clone(), None).await,
        (403, "RBAC: access denied".to_owned())
    );
    let forged = jwt(OTHER_KEY, "key-1", json!({}));
    assert_eq!(
        get(secured.clone(), Some(forged)).await,
        (401, "Jwt verification fails".to_owned())
    );
    // A token of an issuer the rule does not name: Envoy's JWT filter answers 401 "Jwt
    // issuer is not configured" (its status for a token whose `iss` no provider has).
    let stranger = jwt(
        ISSUER_KEY,
        "key-1",
        json!({"iss": "https://stranger.example.com"}),
    );
    assert_eq!(
        get(secured.clone(), Some(stranger)).await,
        (401, "Jwt issuer is not configured".to_owned())
    );
    // An issuer whose JWKS cannot be fetched: Istio gives Envoy a key no token is signed with
    // (istiod's fallback JWKS), so a valid token gets 401 "Jwt verification fails".
    let token = jwt(ISSUER_KEY, "key-1", json!({}));
    let keyless = format!("http://keyless.example.com:{port}/");
    assert_eq!(
        get(keyless, Some(token.clone())).await,
        (401, "Jwt verification fails".to_owned())
    );
    assert_eq!(
        get(secured.clone(), Some(token.clone())).await,
        (200, "secret".to_owned())
    );
    // The gateway's own path to the Function obeys the APIRule that exposes it.
    let by_path = format!("{}/default/secured/", platform.gateway);
    assert_eq!(get(by_path.clone(), None).await.0, 403);
    assert_eq!(get(by_path, Some(token)).await.0, 200);

    // v2alpha1, `{*}`, and CORS.
    let alpha = format!("http://hello-alpha.example.com:{port}");
    assert_eq!(
        get(format!("{alpha}/orders/7"), None).await,
        (200, "Hello World! /orders/7".to_owned())
    );
    assert_eq!(get(format!("{alpha}/orders/7/lines"), None).await.0, 404);
    let preflight = hosts
        .request(reqwest::Method::OPTIONS, format!("{alpha}/orders/7"))
        .header("origin", "https://shop.example.com")
        .header("access-control-request-method", "GET")
        .send()
        .await
        .unwrap();
    // Envoy's CORS filter answers the preflight itself: 200, the origin, credentials, methods,
    // headers, max-age, and (set on every answer to an allowed origin) the exposed headers.
    assert_eq!(preflight.status(), 200);
    let cors = |answer: &reqwest::Response, name: &str| {
        answer
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    for (name, value) in [
        ("access-control-allow-origin", "https://shop.example.com"),
        ("access-control-allow-credentials", "true"),
        ("access-control-allow-methods", "GET"),
        ("access-control-allow-headers", "x-shop"),
        ("access-control-max-age", "600"),
        ("access-control-expose-headers", "x-order-id"),
    ] {
        assert_eq!(cors(&preflight, name).as_deref(), Some(value), "{name}");
    }
    // The actual answer: the origin, credentials and the exposed headers; the preflight's
    // own headers are not repeated.
    let actual = hosts
        .get(format!("{alpha}/orders/7"))
        .header("origin", "https://shop.example.com")
        .send()
        .await
        .unwrap();
    assert_eq!(actual.status(), 200);
    for (name, value) in [
        (
            "access-control-allow-origin",
            Some("https://shop.example.com"),
        ),
        ("access-control-allow-credentials", Some("true")),
        ("access-control-expose-headers", Some("x-order-id")),
        ("access-control-allow-methods", None),
        ("access-control-allow-headers", None),
        ("access-control-max-age", None),
    ] {
        assert_eq!(cors(&actual, name).as_deref(), value, "{name}");
    }
    let other_origin = hosts
        .get(format!("{alpha}/orders/7"))
        .header("origin", "https://evil.example.com")
        .send()
        .await
        .unwrap();
    assert!(
        !other_origin
            .headers()
            .contains_key("access-control-allow-origin")
    );

    // `eddy get apirules`, Kyma's status.
    let (ok, stdout, stderr) = platform.eddy(&["get", "apirules"]).await;
    assert!(ok, "{stderr}");
    assert!(stdout.contains("STATUS"), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|line| line.contains("secured") && line.contains("Ready")),
        "{stdout}"
    );
    let rule = platform
        .get_json(&format!(
            "{}/apis/gateway.kyma-project.io/v2alpha1/namespaces/default/apirules/hello-alpha",
            platform.api
        ))
        .await;
    assert!(rule["status"]["lastProcessedTime"].is_string(), "{rule}");

    // A missing service is a Warning; a host taken by another APIRule is an Error.
    let (ok, stdout, stderr) = platform
        .apply_text(
            r#"apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata:
  name: nobody
spec:
  hosts: [nobody]
  service: {name: nobody, port: 80}
  rules: [{path: /*, methods: [GET], noAuth: true}]
---
apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata:
  name: copycat
spec:
  hosts: [hello]
  service: {name: hello, port: 80}
  rules: [{path: /*, methods: [GET], noAuth: true}]
"#,
        )
        .await;
    assert!(ok, "{stdout}\n{stderr}");
    eventually("the statuses", Duration::from_secs(30), || async {
        let nobody = platform.apirule_state("default", "nobody").await;
        let copycat = platform.apirule_state("default", "copycat").await;
        nobody
            == (
                "Warning".to_owned(),
                "service default/nobody not found".to_owned(),
            )
            && copycat
                == (
                    "Error".to_owned(),
                    "host hello.localhost is already exposed by APIRule default/hello".to_owned(),
                )
    })
    .await
    .unwrap();

    // One refused document refuses the whole file: the Function before it is not applied.
    let (ok, stdout, stderr) = platform
        .apply_text(
            r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: later
spec:
  runtime: nodejs22
  source:
    inline:
      source: "module.exports = { main: () => 'later' }"
---
apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata:
  name: later
spec:
  hosts: ["127.0.0.1"]
  service: {name: later, port: 80}
  rules:
    - path: /*
      methods: [GET]
      noAuth: true
"#,
        )
        .await;
    assert!(!ok, "{stdout}");
    assert!(stderr.contains("spec.hosts[0]"), "{stderr}");
    assert!(stderr.contains("nothing was applied"), "{stderr}");
    let later = platform
        .http
        .get(format!(
            "{}/apis/eddy.dev/v1alpha1/namespaces/default/functions/later",
            platform.api
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(later.status(), 404);
}

/// The APIRule fields the tutorials above leave out, against the real gateway: a JWT read from
/// `fromHeaders` (with its prefix) or `fromParams` and from nowhere else, a rule's own `timeout`
/// cutting a slow call at its seconds (504) while a rule without one lets it finish, and CORS
/// origins allowed by `prefix` and `regex` (an origin neither matches gets no CORS headers).
#[tokio::test]
async fn apirule_token_sources_rule_timeouts_and_cors_origin_patterns() {
    use support::jwt::{ISSUER, ISSUER_KEY, jwt, serve_jwks};
    let platform = Platform::start_with(Options {
        dispatcher: false,
        ..Options::default()
    })
    .await;
    let (jwks_uri, _) = serve_jwks().await;
    let manifest = format!(
        r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata: {{name: orders}}
spec:
  runtime: nodejs26
  source:
    inline:
      source: |
        module.exports = {{ main: (req, res) => {{
          const ms = Number(req.query.ms || 0);
          setTimeout(() => res.send(`done ${{req.path}}`), ms);
        }} }};
---
apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata: {{name: orders}}
spec:
  hosts: [orders]
  service: {{name: orders, port: 80}}
  gateway: kyma-system/kyma-gateway
  corsPolicy:
    allowOrigins: [{{prefix: "https://shop."}}, {{regex: "https://[a-z]+\\.example\\.org"}}]
    allowMethods: [GET]
  rules:
    - path: /header
      methods: [GET]
      jwt:
        authentications:
          - issuer: "{ISSUER}"
            jwksUri: "{jwks_uri}"
            fromHeaders: [{{name: x-jwt-assertion, prefix: "Kyma "}}]
    - path: /param
      methods: [GET]
      jwt:
        authentications:
          - {{issuer: "{ISSUER}", jwksUri: "{jwks_uri}", fromParams: [jwt]}}
    - path: /slow
      methods: [GET]
      timeout: 1
      noAuth: true
    - path: /patient
      methods: [GET]
      noAuth: true
"#
    );
    let (ok, _, stderr) = platform.apply_text(&manifest).await;
    assert!(ok, "{stderr}");
    platform.wait_running_at("default", "orders").await;
    eventually("APIRule orders Ready", Duration::from_secs(20), || async {
        platform.apirule_state("default", "orders").await.0 == "Ready"
    })
    .await
    .unwrap();
    let port = platform.gateway.rsplit(':').next().unwrap().to_owned();
    let base = format!("http://orders.localhost:{port}");
    let client = platform.host_client(&["orders.localhost"]);
    let token = jwt(ISSUER_KEY, "key-1", json!({}));
    let status = |request: reqwest::RequestBuilder| async move {
        let answer = request.send().await.unwrap();
        (answer.status().as_u16(), answer.text().await.unwrap())
    };

    // fromHeaders: that header with its prefix, and not the default Authorization.
    let header = format!("{base}/header");
    assert_eq!(
        status(
            client
                .get(&header)
                .header("x-jwt-assertion", format!("Kyma {token}"))
        )
        .await,
        (200, "done /header".to_owned())
    );
    assert_eq!(status(client.get(&header).bearer_auth(&token)).await.0, 403);
    assert_eq!(
        status(
            client
                .get(&header)
                .header("x-jwt-assertion", token.as_str())
        )
        .await
        .0,
        403,
        "without its prefix the header holds no token"
    );
    // fromParams: the query parameter, and not the header.
    let param = format!("{base}/param");
    assert_eq!(
        status(client.get(format!("{param}?jwt={token}"))).await,
        (200, "done /param".to_owned())
    );
    assert_eq!(status(client.get(&param).bearer_auth(&token)).await.0, 403);

    // A rule's timeout: 504 at its one second, not before; a rule without one waits.
    let started = std::time::Instant::now();
    let (cut, _) = status(client.get(format!("{base}/slow?ms=4000"))).await;
    let waited = started.elapsed();
    assert_eq!(cut, 504);
    assert!(
        waited >= Duration::from_millis(950) && waited < Duration::from_millis(3000),
        "cut after {waited:?}"
    );
    assert_eq!(
        status(client.get(format!("{base}/patient?ms=1500"))).await,
        (200, "done /patient".to_owned())
    );

    // CORS origins by prefix and by regex; another origin gets no CORS headers.
    for (origin, allowed) in [
        ("https://shop.example.com", true),
        ("https://eu.example.org", true),
        ("https://shop-evil.com", false),
        ("https://eu.example.org.evil.com", false),
    ] {
        let answer = client
            .request(reqwest::Method::OPTIONS, format!("{base}/patient"))
            .header("origin", origin)
            .header("access-control-request-method", "GET")
            .send()
            .await
            .unwrap();
        let echoed = answer
            .headers()
            .get("access-control-allow-origin")
            .map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(echoed, allowed.then(|| origin.to_owned()), "{origin}");
    }
}

/// APIRule statuses follow what they depend on, as it changes (no periodic look): an APIRule
/// naming a Function that does not exist yet is `Warning` and turns `Ready` when the Function
/// is applied; one refused a host an older APIRule holds is `Error` and turns `Ready` when
/// that APIRule is deleted.
#[tokio::test]
async fn apirule_statuses_follow_their_functions_and_the_hosts_freed() {
    let platform = Platform::start_with(Options {
        dispatcher: false,
        ..Options::default()
    })
    .await;
    let rule = |name: &str, host: &str, service: &str| {
        format!(
            "apiVersion: gateway.kyma-project.io/v2\nkind: APIRule\nmetadata: {{name: {name}}}\nspec:\n  hosts: [{host}]\n  service: {{name: {service}, port: 80}}\n  rules:\n    - path: /*\n      methods: [GET]\n      noAuth: true\n"
        )
    };
    let state = |name: &'static str| {
        let platform = &platform;
        async move { platform.apirule_state("default", name).await.0 }
    };
    let (ok, _, stderr) = platform
        .apply_text(&rule("early", "early", "later-fn"))
        .await;
    assert!(ok, "{stderr}");
    eventually("early: Warning", Duration::from_secs(20), || async {
        state("early").await == "Warning"
    })
    .await
    .unwrap();
    platform
        .deploy(
            "later-fn",
            json!({"runtime": "nodejs24", "source": {"inline": {"source": "module.exports = { main: () => 'here' };"}}}),
        )
        .await;
    eventually(
        "early: Ready once its Function exists",
        Duration::from_secs(20),
        || async { state("early").await == "Ready" },
    )
    .await
    .unwrap();

    let (ok, _, stderr) = platform
        .apply_text(&rule("holder", "shared", "later-fn"))
        .await;
    assert!(ok, "{stderr}");
    eventually("holder: Ready", Duration::from_secs(20), || async {
        state("holder").await == "Ready"
    })
    .await
    .unwrap();
    let (_, _, _) = platform
        .apply_text(&rule("second", "shared", "later-fn"))
        .await;
    eventually("second: Error", Duration::from_secs(20), || async {
        state("second").await == "Error"
    })
    .await
    .unwrap();
    let (ok, _, stderr) = platform
        .eddy(&["delete", "apirule", "holder", "-n", "default"])
        .await;
    assert!(ok, "{stderr}");
    eventually(
        "second: Ready once the host is free",
        Duration::from_secs(20),
        || async { state("second").await == "Ready" },
    )
    .await
    .unwrap();
}

/// Kyma's RateLimit, with the samples of Kyma's docs (api-gateway's "Configuring Local Rate
/// Limiting") applied as written but for the namespace, on a Kyma Function labelled as the
/// docs' workload (`app: httpbin`). "If you send the request with the header to a different
/// endpoint, the token from the default bucket is still used" (429 `local_rate_limited`, with
/// `x-ratelimit-limit: 1` and `x-ratelimit-remaining: 0`); a second RateLimit selecting the
/// same pods is a Warning ("Each Pod must match only one RateLimit CR") until the first goes;
/// the fill interval rules are refused in Kyma's words.
#[tokio::test(flavor = "multi_thread")]
async fn kyma_ratelimits_limit_calls_as_kymas_docs_show() {
    let platform = Platform::start_with(Options {
        dispatcher: false,
        ..Options::default()
    })
    .await;
    let (ok, _, stderr) = platform
        .apply_text(
            "apiVersion: serverless.kyma-project.io/v1alpha2\nkind: Function\nmetadata: {name: httpbin}\nspec:\n  runtime: nodejs22\n  labels: {app: httpbin}\n  source:\n    inline:\n      source: |\n        module.exports = { main: () => 'ok' };\n",
        )
        .await;
    assert!(ok, "{stderr}");
    let path_and_header = support::kyma::RATELIMIT_PATH_HEADER_SAMPLE;
    let (ok, stdout, stderr) = platform.apply_text(path_and_header).await;
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("ratelimit.gateway.kyma-project.io/ratelimit-path-header-sample created"),
        "{stdout}"
    );
    let state = |name: &'static str| {
        let platform = &platform;
        async move {
            let limit = platform
                .get_json(&format!(
                    "{}/apis/gateway.kyma-project.io/v1alpha1/namespaces/default/ratelimits/{name}",
                    platform.api
                ))
                .await;
            (
                limit["status"]["state"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                limit["status"]["description"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
        }
    };
    eventually("the RateLimit Ready", Duration::from_secs(30), || async {
        state("ratelimit-path-header-sample").await
            == ("Ready".to_owned(), "Finished reconciliation".to_owned())
    })
    .await
    .unwrap();
    let url = |path: &str| format!("{}/default/httpbin{path}", platform.gateway);
    let get = |path: &'static str, flagged: bool| {
        let (http, url) = (platform.http.clone(), url(path));
        async move {
            let answer = support::rate_limited_get(&http, url, flagged).await;
            (
                answer.status,
                answer.limits,
                answer.content_type,
                answer.body,
            )
        }
    };
    // The bucket of ten: the header, on /headers. Its first token may go to a call the gateway
    // answered before it knew the RateLimit; each later one is counted.
    let left = std::sync::atomic::AtomicU32::new(0);
    eventually(
        "the gateway to keep the buckets",
        Duration::from_secs(30),
        || async {
            let (status, limits, _, _) = get("/headers", true).await;
            assert_eq!(status, 200);
            left.store(
                limits.1.parse().unwrap_or(0),
                std::sync::atomic::Ordering::Relaxed,
            );
            limits.0 == "10"
        },
    )
    .await
    .unwrap();
    let remaining = left.load(std::sync::atomic::Ordering::Relaxed);
    assert!(remaining >= 8, "{remaining}");
    // Kyma's docs: "This call uses tokens from the default bucket".
    let (status, limits, _, body) = get("/headers", false).await;
    assert_eq!((status, body.as_str()), (200, "ok"));
    assert_eq!(limits, ("1".to_owned(), "0".to_owned()));
    let (status, limits, _, _) = get("/headers", true).await;
    assert_eq!(status, 200);
    assert_eq!(limits, ("10".to_owned(), (remaining - 1).to_string()));
    // "You get the HTTP/2 429 status code, which confirms that the rate limit has been exceeded".
    let (status, limits, content_type, body) = get("/ip", true).await;
    assert_eq!(
        (status, body.as_str(), content_type.as_str()),
        (429, "local_rate_limited", "text/plain")
    );
    assert_eq!(limits, ("1".to_owned(), "0".to_owned()));

    // The path sample, selecting the same pods: the older RateLimit keeps them.
    let path_sample = "apiVersion: gateway.kyma-project.io/v1alpha1
kind: RateLimit
metadata:
  labels:
    app: httpbin
  name: ratelimit-path-sample
spec:
  selectorLabels:
    app: httpbin
  enableResponseHeaders: true
  local:
    defaultBucket:
      maxTokens: 5
      tokensPerFill: 5
      fillInterval: 60s
    buckets:
      - path: /ip
        bucket:
          maxTokens: 10
          tokensPerFill: 5
          fillInterval: 60m
";
    let (ok, _, stderr) = platform.apply_text(path_sample).await;
    assert!(ok, "{stderr}");
    eventually(
        "the newer RateLimit a Warning",
        Duration::from_secs(30),
        || async {
            state("ratelimit-path-sample").await
                == (
                    "Warning".to_owned(),
                    "conflicting with the following RateLimit CRs: ratelimit-path-header-sample"
                        .to_owned(),
                )
        },
    )
    .await
    .unwrap();
    let (status, _, _, _) = get("/ip", true).await;
    assert_eq!(status, 429, "the older RateLimit still holds the Function");
    let (ok, _, stderr) = platform
        .eddy(&[
            "delete",
            "ratelimit",
            "ratelimit-path-header-sample",
            "-n",
            "default",
        ])
        .await;
    assert!(ok, "{stderr}");
    eventually("the path sample Ready", Duration::from_secs(30), || async {
        state("ratelimit-path-sample").await.0 == "Ready"
    })
    .await
    .unwrap();
    // Kyma's docs: `curl .../ip` answers `x-ratelimit-limit: 10`, `x-ratelimit-remaining: 9`.
    eventually(
        "the path sample in force",
        Duration::from_secs(30),
        || async {
            let (status, limits, _, _) = get("/ip", false).await;
            status == 200 && limits == ("10".to_owned(), "9".to_owned())
        },
    )
    .await
    .unwrap();
    let (ok, stdout, stderr) = platform.eddy(&["get", "ratelimits"]).await;
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("ratelimit-path-sample") && stdout.contains("Ready"),
        "{stdout}"
    );

    // The header sample ("Deploying Header-Based Rate Limit Configuration"), in its place.
    let (ok, _, stderr) = platform
        .eddy(&[
            "delete",
            "ratelimit",
            "ratelimit-path-sample",
            "-n",
            "default",
        ])
        .await;
    assert!(ok, "{stderr}");
    let header_sample = "apiVersion: gateway.kyma-project.io/v1alpha1
kind: RateLimit
metadata:
  labels:
    app: httpbin
  name: ratelimit-header-sample
spec:
  selectorLabels:
    app: httpbin
  enableResponseHeaders: true
  local:
    defaultBucket:
      maxTokens: 1
      tokensPerFill: 1
      fillInterval: 30s
    buckets:
      - headers:
          X-Rate-Limited: \"true\"
        bucket:
          maxTokens: 10
          tokensPerFill: 5
          fillInterval: 30s
";
    let (ok, _, stderr) = platform.apply_text(header_sample).await;
    assert!(ok, "{stderr}");
    // Kyma's docs: `curl .../headers` answers 1 and 0; with `X-Rate-Limited: true`, 10 and 9.
    eventually(
        "the header sample in force",
        Duration::from_secs(30),
        || async {
            let (status, limits, _, _) = get("/headers", false).await;
            status == 200 && limits == ("1".to_owned(), "0".to_owned())
        },
    )
    .await
    .unwrap();
    let (status, limits, _, _) = get("/headers", true).await;
    assert_eq!(status, 200);
    assert_eq!(limits, ("10".to_owned(), "9".to_owned()));

    // Kyma's interval rules, refused by field in Kyma's words.
    let broken = path_sample
        .replace("name: ratelimit-path-sample", "name: broken")
        .replace("fillInterval: 60m", "fillInterval: 90s");
    let (ok, _, stderr) = platform.apply_text(&broken).await;
    assert!(!ok);
    assert!(
        stderr.contains("spec.local.buckets[0].bucket.fillInterval")
            && stderr.contains(
                "bucket '[0]': fillInterval must be a multiple of defaultBucket fillInterval"
            ),
        "{stderr}"
    );
    let broken = path_sample
        .replace("name: ratelimit-path-sample", "name: broken")
        .replace("fillInterval: 60s", "fillInterval: 10ms");
    let (ok, _, stderr) = platform.apply_text(&broken).await;
    assert!(!ok);
    assert!(
        stderr.contains("defaultBucket: fillInterval must be greater or equal 50ms"),
        "{stderr}"
    );
}
