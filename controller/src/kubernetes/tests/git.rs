//! Tests: Git sources.

use super::*;

/// A Git repository in a temporary directory, changed with the real `git`.
struct Repository {
    dir: tempfile::TempDir,
}

impl Repository {
    fn new() -> Self {
        let repository = Self {
            dir: tempfile::tempdir().expect("a temporary directory"),
        };
        repository.git(&["init", "-q", "-b", "main"]);
        repository
    }

    fn git(&self, args: &[&str]) -> String {
        let output = std::process::Command::new("git")
            .arg("-C")
            .arg(self.dir.path())
            .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
            .args(args)
            .output()
            .expect("git runs");
        assert!(output.status.success(), "git {args:?}: {output:?}");
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// Writes `handler.js` under `fn/` and commits it; returns the commit.
    fn commit_handler(&self, body: &str) -> String {
        let dir = self.dir.path().join("fn");
        std::fs::create_dir_all(&dir).expect("fn/");
        std::fs::write(dir.join("handler.js"), body).expect("handler.js");
        std::fs::write(dir.join("package.json"), r#"{"dependencies": {}}"#).expect("package.json");
        self.git(&["add", "-A"]);
        self.git(&["commit", "-q", "-m", "handler"]);
        self.git(&["rev-parse", "HEAD"])
    }

    fn url(&self) -> String {
        format!("file://{}", self.dir.path().display())
    }
}

fn git_function(url: &str, auth: Value) -> Function {
    let mut repository = json!({"url": url, "reference": "main", "baseDir": "/fn/"});
    if !auth.is_null() {
        repository["auth"] = auth;
    }
    function(json!({"source": {"gitRepository": repository}}))
}

async fn run_git_function(
    function: Function,
    git_dir: &std::path::Path,
    exchanges: Vec<Exchange>,
) -> (Result<Action>, Vec<Value>) {
    let (client, server) = kube_mock::scripted(exchanges);
    let mut context = Context::new(client, config(), SinkPolicy::default());
    context.clock = test_now;
    context.git.dir = git_dir.to_owned();
    context.git_poll_interval = Duration::from_secs(60);
    context.file_repositories = true;
    let context = Arc::new(context);
    let result = reconcile_function(Arc::new(function), context.clone()).await;
    drop(context);
    let bodies = server.await.expect("the API server saw what it expected");
    (result, bodies)
}

fn git_secret(_: Value) -> (u16, Value) {
    use base64::Engine as _;
    let encode = |text: &str| base64::engine::general_purpose::STANDARD.encode(text);
    (
        200,
        json!({"apiVersion": "v1", "kind": "Secret",
               "metadata": {"name": "git-creds", "namespace": "shop"},
               "data": {"username": encode("builder"), "password": encode("s3cret")}}),
    )
}

fn init_container(job: &Value) -> &Value {
    &job["spec"]["template"]["spec"]["initContainers"][0]
}

fn env_of<'a>(container: &'a Value, name: &str) -> &'a Value {
    container["env"]
        .as_array()
        .and_then(|env| env.iter().find(|var| var["name"] == name))
        .unwrap_or_else(|| panic!("no {name} in {container}"))
}

#[tokio::test]
pub(super) async fn a_git_source_is_fetched_at_its_commit_and_a_moved_reference_builds_again() {
    let repository = Repository::new();
    let first = repository.commit_handler("module.exports = { main: () => 'v1' }");
    let git_dir = tempfile::tempdir().expect("a scratch directory");
    let function = git_function(
        &repository.url(),
        json!({"type": "basic", "secretName": "git-creds"}),
    );
    let rendered = render_at(&function, &config(), Some(&first)).expect("renders");
    let secret = "/api/v1/namespaces/shop/secrets/git-creds";
    let mut exchanges = vec![expect(Method::GET, secret, git_secret)];
    exchanges.extend(no_package_registry());
    exchanges.extend(first_build(&function, &rendered));
    let (result, bodies) = run_git_function(function.clone(), git_dir.path(), exchanges).await;
    // The reference is looked at again every poll interval, not every five minutes.
    assert_eq!(
        result.expect("reconciled"),
        Action::requeue(Duration::from_secs(60))
    );
    let status = &bodies[7]["status"];
    assert_eq!(status["commit"], first.as_str());
    assert_condition(status, "BuildReady", "Unknown", "BuildRunning");
    assert!(
        condition_of(status, "ConfigurationReady")["message"]
            .as_str()
            .is_some_and(|m| m.contains(&format!("of commit {first}"))),
        "{status}"
    );
    // The ConfigMap carries the runtime only: the handler comes from the repository.
    let data = &bodies[5]["data"];
    assert!(data["Dockerfile"].is_string() && data["server.mjs"].is_string());
    assert!(data.get("handler.js").is_none(), "{data}");
    let job = &bodies[6];
    let fetch = init_container(job);
    assert_eq!(fetch["image"], "docker.io/alpine/git:v2.47.2");
    assert_eq!(env_of(fetch, "GIT_URL")["value"], repository.url());
    assert_eq!(env_of(fetch, "GIT_COMMIT")["value"], first.as_str());
    assert_eq!(env_of(fetch, "GIT_BASE_DIR")["value"], "fn");
    assert_eq!(
        env_of(fetch, "EDDY_GIT_PASSWORD")["valueFrom"],
        json!({"secretKeyRef": {"name": "git-creds", "key": "password"}})
    );
    assert_eq!(fetch["securityContext"]["runAsNonRoot"], true);
    assert_eq!(fetch["securityContext"]["readOnlyRootFilesystem"], true);
    let build = &job["spec"]["template"]["spec"]["containers"][0];
    assert!(
        build["args"]
            .as_array()
            .is_some_and(|args| args.contains(&json!("--context=dir:///workspace/context"))),
        "{build}"
    );

    // The branch moves: the next look builds the new commit under a new tag.
    let second = repository.commit_handler("module.exports = { main: () => 'v2' }");
    assert_ne!(first, second);
    let mut moved = function.clone();
    moved.status = serde_json::from_value(status.clone()).expect("a status");
    let rebuilt = render_at(&moved, &config(), Some(&second)).expect("renders");
    assert_ne!(rebuilt.hash, rendered.hash);
    let mut exchanges = vec![expect(Method::GET, secret, git_secret)];
    exchanges.extend(no_package_registry());
    exchanges.extend(first_build(&moved, &rebuilt));
    let (result, bodies) = run_git_function(moved, git_dir.path(), exchanges).await;
    result.expect("reconciled");
    assert_eq!(bodies[7]["status"]["commit"], second.as_str());
    assert_eq!(
        env_of(init_container(&bodies[6]), "GIT_COMMIT")["value"],
        second.as_str()
    );
}

#[tokio::test]
pub(super) async fn a_git_source_without_its_secret_or_reference_waits_and_says_why() {
    let repository = Repository::new();
    repository.commit_handler("module.exports = { main: () => 'v1' }");
    let git_dir = tempfile::tempdir().expect("a scratch directory");
    let function = git_function(
        &repository.url(),
        json!({"type": "basic", "secretName": "git-creds"}),
    );
    let (result, bodies) = run_git_function(
        function.clone(),
        git_dir.path(),
        vec![
            expect(
                Method::GET,
                "/api/v1/namespaces/shop/secrets/git-creds",
                not_found,
            ),
            function_status_write(&function),
        ],
    )
    .await;
    assert_eq!(
        result.expect("reconciled"),
        Action::requeue(Duration::from_secs(60))
    );
    let status = &bodies[1]["status"];
    assert_condition(status, "BuildReady", "False", "ReferenceNotFound");
    assert_eq!(
        condition_of(status, "BuildReady")["message"],
        "spec.source.gitRepository.auth: Secret git-creds not found"
    );

    let mut function = git_function(&repository.url(), Value::Null);
    if let Some(git) = function.spec.source.git_repository.as_mut() {
        git.reference = "no-such-branch".to_owned();
    }
    let (_, bodies) = run_git_function(
        function.clone(),
        git_dir.path(),
        vec![function_status_write(&function)],
    )
    .await;
    let status = &bodies[0]["status"];
    assert_condition(status, "BuildReady", "False", "SourceUnavailable");
    assert!(status.get("commit").is_none(), "{status}");
}

#[test]
fn a_key_authenticated_git_source_mounts_the_key_for_the_fetch_only() {
    let function = as_if_stored_git(json!({"type": "key", "secretName": "deploy-key"}));
    let rendered = render_at(
        &function,
        &config(),
        Some("0123456789abcdef0123456789abcdef01234567"),
    )
    .expect("renders");
    let job = to_json(&rendered.job);
    let pod = &job["spec"]["template"]["spec"];
    let key_volume = pod["volumes"]
        .as_array()
        .and_then(|volumes| volumes.iter().find(|v| v["name"] == "git-auth"))
        .expect("a volume with the key");
    assert_eq!(
        key_volume["secret"],
        json!({"secretName": "deploy-key", "defaultMode": 0o440,
               "items": [{"key": "key", "path": "key", "mode": 0o440}]})
    );
    assert_eq!(pod["securityContext"]["fsGroup"], 65532);
    let fetch = init_container(&job);
    assert_eq!(
        env_of(fetch, "EDDY_GIT_KEY_PASSPHRASE")["valueFrom"],
        json!({"secretKeyRef": {"name": "deploy-key", "key": "password", "optional": true}})
    );
    assert!(
        fetch["volumeMounts"]
            .as_array()
            .is_some_and(|mounts| mounts.iter().any(|m| m["name"] == "git-auth")),
        "{fetch}"
    );
    // The build container never sees the key.
    let build = &pod["containers"][0];
    assert!(
        build["volumeMounts"]
            .as_array()
            .is_some_and(|mounts| mounts.iter().all(|m| m["name"] != "git-auth")),
        "{build}"
    );
}

fn as_if_stored_git(auth: Value) -> Function {
    git_function("ssh://git@git.example.com/shop/functions.git", auth)
}

/// Runs the fetch script as the init container would (its environment, with the directories
/// moved into a temporary one) against a real repository.
fn run_fetch_script(
    job: &Value,
    root: &std::path::Path,
    runtime_files: &[(&str, &str)],
) -> std::process::Output {
    let fetch = init_container(job);
    let context = root.join("runtime");
    let workspace = root.join("workspace");
    let home = root.join("home");
    for dir in [&context, &workspace, &home] {
        std::fs::create_dir_all(dir).expect("a directory");
    }
    for (name, contents) in runtime_files {
        std::fs::write(context.join(name), contents).expect("a runtime file");
    }
    let mut command = std::process::Command::new("/bin/sh");
    command
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default());
    for var in fetch["env"].as_array().expect("env") {
        if let Some(value) = var["value"].as_str() {
            command.env(var["name"].as_str().expect("a name"), value);
        }
    }
    command
        .env("EDDY_WORKSPACE", &workspace)
        .env("EDDY_CONTEXT", &context)
        .env("EDDY_GIT_AUTH", root.join("no-auth"))
        .env("HOME", &home)
        .arg("-c")
        .arg(fetch["command"][2].as_str().expect("the script"));
    command.output().expect("sh runs")
}

#[test]
fn the_fetch_script_lays_out_the_base_directory_with_the_runtime_files_over_it() {
    use std::os::unix::fs::PermissionsExt as _;
    let repository = Repository::new();
    repository.commit_handler("module.exports = { main: () => 'v1' }");
    let wanted = repository.commit_handler("module.exports = { main: () => 'v2' }");
    let function = git_function(&repository.url(), Value::Null);
    let rendered = render_at(&function, &config(), Some(&wanted)).expect("renders");
    let root = tempfile::tempdir().expect("a temporary directory");
    let output = run_fetch_script(
        &to_json(&rendered.job),
        root.path(),
        &[
            ("Dockerfile", "FROM scratch\n"),
            ("server.mjs", "// server\n"),
        ],
    );
    assert!(output.status.success(), "{output:?}");
    let context = root.path().join("workspace/context");
    let handler = context.join("handler.js");
    assert_eq!(
        std::fs::read_to_string(&handler).expect("handler.js"),
        "module.exports = { main: () => 'v2' }",
        "the commit asked for, not the branch's tip at fetch time"
    );
    assert!(context.join("package.json").is_file());
    assert_eq!(
        std::fs::read_to_string(context.join("Dockerfile")).expect("Dockerfile"),
        "FROM scratch\n"
    );
    assert!(context.join("server.mjs").is_file());
    assert!(
        !context.join(".git").exists(),
        "no Git metadata in the image"
    );
    // Readable by the function's user in the image.
    let mode = std::fs::metadata(&handler)
        .expect("metadata")
        .permissions()
        .mode();
    assert_eq!(mode & 0o044, 0o044, "mode {mode:o}");

    // A base directory the commit lacks fails the fetch, saying so.
    let mut function = function;
    if let Some(git) = function.spec.source.git_repository.as_mut() {
        git.base_dir = Some("missing".to_owned());
    }
    let rendered = render_at(&function, &config(), Some(&wanted)).expect("renders");
    let root = tempfile::tempdir().expect("a temporary directory");
    let output = run_fetch_script(&to_json(&rendered.job), root.path(), &[]);
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains(&format!(
            "the repository has no directory 'missing' at {wanted}"
        )),
        "{output:?}"
    );
}
