//! Tests: Buildless.

use super::*;

fn buildless_config() -> RenderConfig {
    RenderConfig {
        build: BuildMode::Buildless,
        ..config()
    }
}

/// Buildless: no build Job and no registry image; the Deployment runs eddy's runtime image,
/// mounts the handler and dependency files of the sources' ConfigMap, and an `install` init
/// container (same image, the function's resources) copies them into the `function` volume
/// and installs the dependencies, which the function container reads.
#[test]
fn buildless_pods_run_the_runtime_image_and_install_when_they_start() {
    let function = function(json!({
        "runtime": "nodejs22",
        "source": {"inline": {"source": "module.exports = { main: () => 'ok' }",
                              "dependencies": "{\"dependencies\": {\"lodash\": \"^4\"}}"}},
    }));
    let rendered = render(&function, &buildless_config()).expect("renders");
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        rendered.image,
        format!("ghcr.io/eddy-dev/eddy-runtime-nodejs22:{version}")
    );
    let pod = to_json(&rendered.deployment)["spec"]["template"]["spec"].clone();
    assert_eq!(pod["containers"][0]["image"], json!(rendered.image));
    let install = &pod["initContainers"][0];
    assert_eq!(install["name"], "install");
    assert_eq!(install["image"], json!(rendered.image));
    assert_eq!(install["command"][2], render::BUILDLESS_INSTALL_SCRIPT);
    assert_eq!(install["securityContext"]["readOnlyRootFilesystem"], true);
    let sources = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|volume| volume["name"] == "sources")
        .expect("a sources volume");
    assert_eq!(
        sources["configMap"]["name"],
        json!(format!("reserve-stock-{}", rendered.hash))
    );
    assert_eq!(
        sources["configMap"]["items"],
        json!([{"key": "handler.js", "path": "handler.js"},
               {"key": "package.json", "path": "package.json"}])
    );
    let mounts = &pod["containers"][0]["volumeMounts"];
    assert!(
        mounts.as_array().expect("mounts").contains(
            &json!({"name": "function", "mountPath": "/runtime/function", "readOnly": true})
        ),
        "{mounts}"
    );
}

/// Inline code without dependencies has nothing to install: no init container, and the
/// function container reads the handler straight from the sources' ConfigMap, mounted where
/// the install would have copied it.
#[test]
fn buildless_pods_without_dependencies_start_their_function_at_once() {
    let function = function(json!({
        "runtime": "python312",
        "source": {"inline": {"source": "def main(event, context):\n    return 'ok'\n",
                              "dependencies": "  \n"}},
    }));
    let rendered = render(&function, &buildless_config()).expect("renders");
    let pod = to_json(&rendered.deployment)["spec"]["template"]["spec"].clone();
    assert!(pod.get("initContainers").is_none(), "{pod}");
    assert_eq!(
        pod["volumes"]
            .as_array()
            .expect("volumes")
            .iter()
            .find(|volume| volume["name"] == "function")
            .expect("the function volume")["configMap"],
        json!({"name": format!("reserve-stock-{}", rendered.hash),
               "items": [{"key": "handler.py", "path": "handler.py"}]})
    );
    assert!(
        pod["containers"][0]["volumeMounts"]
            .as_array()
            .expect("mounts")
            .contains(
                &json!({"name": "function", "mountPath": "/runtime/function", "readOnly": true})
            ),
        "{pod}"
    );
}

/// A buildless reconcile applies the ConfigMap and the Deployment at once (no Job is looked
/// for or made), reports BuildReady `Buildless`, and keeps the superseded ConfigMaps while the
/// rollout is under way (old pods still mount theirs).
#[tokio::test]
async fn a_buildless_function_is_deployed_without_a_build() {
    let function = function(json!({}));
    let rendered = render(&function, &buildless_config()).expect("renders");
    let deployment = to_json(&rendered.deployment);
    let rolling = json!({"metadata": {"generation": 2},
        "status": {"observedGeneration": 2, "replicas": 2, "updatedReplicas": 1}});
    let exchanges: Vec<Exchange> = vec![
        expect(
            Method::PATCH,
            format!(
                "{}/reserve-stock-{}{APPLY}",
                base("configmaps"),
                rendered.hash
            ),
            applied(to_json(&rendered.config_map), json!({})),
        ),
    ]
    .into_iter()
    .chain(workload_applied(
        &rendered,
        merged(rolling, json!({"metadata": deployment["metadata"].clone()})),
    ))
    .chain([
        // Not available yet: the pods of this build are read, and one no node takes is said.
        expect(
            Method::GET,
            format!(
                "{}?&labelSelector=eddy.dev%2Ffunction%3Dreserve-stock%2Ceddy.dev%2Fbuild-hash%3D{}",
                base("pods"),
                rendered.hash
            ),
            |_| {
                (
                    200,
                    json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": [{
                        "metadata": {"name": "reserve-stock-1"},
                        "status": {"conditions": [{"type": "PodScheduled", "status": "False",
                            "reason": "Unschedulable",
                            "message": "0/1 nodes are available: 1 Insufficient cpu."}]},
                    }]}),
                )
            },
        ),
        function_status_write(&function),
    ])
    .collect();
    let (client, server) = kube_mock::scripted(exchanges);
    let mut context = Context::new(client, buildless_config(), SinkPolicy::default());
    context.clock = test_now;
    let result = reconcile_function(Arc::new(function), Arc::new(context)).await;
    let bodies = server.await.expect("the API server saw what it expected");
    assert_eq!(result.expect("reconciled"), Action::requeue(INSTALL_CHECK));
    let status = &bodies[5]["status"];
    assert_condition(status, "BuildReady", "True", "Buildless");
    let running = status["conditions"]
        .as_array()
        .expect("conditions")
        .iter()
        .find(|condition| condition["type"] == "Running")
        .expect("Running");
    assert!(
        running["message"].as_str().is_some_and(|message| {
            message.contains(
            "pod reserve-stock-1 cannot be scheduled: 0/1 nodes are available: 1 Insufficient cpu."
        )
        }),
        "{running}"
    );
    assert_eq!(status["runtimeImage"], json!(rendered.image));
}

/// Kyma's cluster-wide package registry Secret (in `kyma-system`, with Kyma's label) is copied
/// into the Function's namespace, mounted into the `install` init container only (never the
/// function's container), and its contents are part of the build key.
#[tokio::test]
pub(super) async fn a_cluster_wide_package_registry_secret_is_copied_and_mounted_for_the_install_only()
 {
    use base64::Engine as _;
    let function = function(json!({
        "source": {"inline": {"source": "x",
            "dependencies": "{\"dependencies\": {\"@acme/greeting\": \"1\"}}"}},
    }));
    let npmrc = "@acme:registry=https://npm.acme.example/\n//npm.acme.example/:_authToken=t0k3n\n";
    let encoded = base64::engine::general_purpose::STANDARD.encode(npmrc);
    let registry = crate::package_registry::PackageRegistry {
        secret: "kyma-system/serverless-package-registry-config".into(),
        name: PACKAGE_REGISTRY_COPY.into(),
        config: npmrc.as_bytes().to_vec(),
    };
    let plain = render(&function, &buildless_config()).expect("renders");
    let rendered =
        render_with(&function, &buildless_config(), None, Some(&registry)).expect("renders");
    assert_ne!(
        rendered.hash, plain.hash,
        "the registry is part of the build key"
    );
    let deployment = to_json(&rendered.deployment);
    let pod = &deployment["spec"]["template"]["spec"];
    let install = pod["initContainers"]
        .as_array()
        .expect("init containers")
        .iter()
        .find(|c| c["name"] == "install")
        .expect("install");
    assert!(
        install["volumeMounts"].as_array().expect("mounts").contains(&json!(
            {"name": "package-registry", "mountPath": "/eddy/package-registry", "readOnly": true}
        )),
        "{install}"
    );
    assert!(
        pod["containers"][0]["volumeMounts"]
            .as_array()
            .is_none_or(|mounts| mounts.iter().all(|m| m["name"] != "package-registry")),
        "the function's container never sees the registry's credentials: {pod}"
    );
    assert!(pod["volumes"].as_array().expect("volumes").contains(&json!(
        {"name": "package-registry", "secret": {"secretName": "eddy-package-registry-config", "optional": true}}
    )));
    let cluster_secret = json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "serverless-package-registry-config", "namespace": "kyma-system",
            "labels": {"serverless.kyma-project.io/config": "credentials"}},
        "type": "Opaque", "data": {".npmrc": encoded},
    });
    let copy = json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "eddy-package-registry-config", "namespace": "shop",
            "labels": {"app.kubernetes.io/managed-by": "eddy",
                "eddy.dev/copy-of": "kyma-system.serverless-package-registry-config"}},
        "type": "Opaque", "data": {".npmrc": encoded},
    });
    let exchanges: Vec<Exchange> = vec![
        expect(
            Method::GET,
            "/api/v1/namespaces/shop/secrets/serverless-package-registry-config",
            not_found,
        ),
        expect(
            Method::GET,
            "/api/v1/namespaces/kyma-system/secrets/serverless-package-registry-config",
            move |_| (200, cluster_secret),
        ),
        expect(
            Method::PATCH,
            format!("/api/v1/namespaces/shop/secrets/eddy-package-registry-config{APPLY}"),
            applied(copy, json!({})),
        ),
        expect(
            Method::PATCH,
            format!(
                "{}/reserve-stock-{}{APPLY}",
                base("configmaps"),
                rendered.hash
            ),
            applied(to_json(&rendered.config_map), json!({})),
        ),
    ]
    .into_iter()
    .chain(workload_applied(&rendered, json!({})))
    .chain([
        expect(
            Method::GET,
            format!(
                "{}?&labelSelector=eddy.dev%2Ffunction%3Dreserve-stock%2Ceddy.dev%2Fbuild-hash%3D{}",
                base("pods"),
                rendered.hash
            ),
            |_| {
                (
                    200,
                    json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": []}),
                )
            },
        ),
        function_status_write(&function),
    ])
    .collect();
    let (client, server) = kube_mock::scripted(exchanges);
    let mut context = Context::new(client, buildless_config(), SinkPolicy::default());
    context.clock = test_now;
    let result = reconcile_function(Arc::new(function), Arc::new(context)).await;
    server.await.expect("the API server saw what it expected");
    result.expect("reconciled");
}

/// A buildless Git source is fetched by the pod itself: the build Job's `source` init container
/// (same script, same commit), then `install` from the fetched context.
#[test]
fn a_buildless_git_source_is_fetched_by_the_pod() {
    let function = function(json!({
        "runtime": "python312",
        "source": {"gitRepository": {"url": "https://git.example.com/shop.git",
                                     "reference": "main", "baseDir": "/orders"}},
    }));
    let rendered =
        render_at(&function, &buildless_config(), Some("0123456789abcdef")).expect("renders");
    let pod = to_json(&rendered.deployment)["spec"]["template"]["spec"].clone();
    let names: Vec<&str> = pod["initContainers"]
        .as_array()
        .expect("init containers")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(names, ["source", "install"]);
    let env = &pod["initContainers"][1]["env"];
    assert!(
        env.as_array()
            .expect("env")
            .contains(&json!({"name": "EDDY_SOURCES", "value": "/workspace/context"})),
        "{env}"
    );
    let job_source =
        to_json(&rendered.job)["spec"]["template"]["spec"]["initContainers"][0].clone();
    assert_eq!(
        pod["initContainers"][0], job_source,
        "the build's own fetch"
    );
}

/// A Function's own security contexts are judged against the operator's Pod Security level on
/// what its pods would run: eddy's defaults pass `restricted`; `privileged: true`, an added
/// `SYS_ADMIN` and `runAsUser: 0` (the attack probe's asks) are refused by field, under
/// `baseline` the root user passes but not the rest, and `privileged` takes anything.
#[test]
fn security_contexts_beyond_the_operators_level_are_refused_by_field() {
    let plain = function(json!({"runtime": "nodejs22", "source": {"inline": {"source": "x"}}}));
    let rendered = render(&plain, &config()).unwrap();
    assert_eq!(
        rendered.pod_security_violations(PodSecurityLevel::Restricted),
        Vec::<String>::new()
    );
    let asking = function(json!({
        "runtime": "nodejs22", "source": {"inline": {"source": "x"}},
        "podSecurityContext": {"runAsUser": 0, "runAsNonRoot": false},
        "containerSecurityContext": {"privileged": true, "allowPrivilegeEscalation": true,
                                     "capabilities": {"add": ["SYS_ADMIN"], "drop": []}},
    }));
    let rendered = render(&asking, &config()).unwrap();
    let restricted = rendered.pod_security_violations(PodSecurityLevel::Restricted);
    for field in [
        "spec.containerSecurityContext.privileged: must not be true",
        "spec.containerSecurityContext.capabilities.add: SYS_ADMIN may not be added",
        "spec.containerSecurityContext.allowPrivilegeEscalation: must be false",
        "spec.podSecurityContext.runAsUser: must not be 0",
        "spec.containerSecurityContext.capabilities.drop: must include ALL",
    ] {
        assert!(
            restricted.iter().any(|v| v.starts_with(field)),
            "{field} in {restricted:?}"
        );
    }
    assert!(
        restricted[0].ends_with("(the restricted Pod Security profile the operator set)"),
        "{restricted:?}"
    );
    let baseline = rendered.pod_security_violations(PodSecurityLevel::Baseline);
    assert_eq!(baseline.len(), 2, "{baseline:?}");
    assert!(
        baseline.iter().all(|v| !v.contains("runAsUser")),
        "{baseline:?}"
    );
    assert!(
        rendered
            .pod_security_violations(PodSecurityLevel::Privileged)
            .is_empty()
    );
}

/// Behind a corporate proxy: the buildless install gets the proxy (both spellings, since npm
/// and pip read different ones) and the CA bundle of the operator's ConfigMap, mounted where
/// the variables point; the function container gets neither.
#[test]
fn buildless_installs_reach_registries_through_the_egress_proxy_and_ca_bundle() {
    let function = function(json!({
        "runtime": "python312",
        "source": {"inline": {"source": "def main(event, context):\n    return 'ok'\n",
                              "dependencies": "requests==2.32.3"}},
    }));
    let config = RenderConfig {
        egress: render::Egress {
            proxy: Some("http://proxy.corp:3128".into()),
            no_proxy: ".svc,.cluster.local".into(),
            ca_config_map: Some("corp-ca".into()),
        },
        ..buildless_config()
    };
    let rendered = render(&function, &config).expect("renders");
    let pod = to_json(&rendered.deployment)["spec"]["template"]["spec"].clone();
    let install = &pod["initContainers"][0];
    let env = |container: &Value, name: &str| {
        container["env"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|var| var["name"] == name)
            .map(|var| var["value"].clone())
    };
    for name in ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY"] {
        assert_eq!(
            env(install, name),
            Some(json!("http://proxy.corp:3128")),
            "{name}"
        );
    }
    assert_eq!(env(install, "NO_PROXY"), Some(json!(".svc,.cluster.local")));
    for name in ["PIP_CERT", "NODE_EXTRA_CA_CERTS", "SSL_CERT_FILE"] {
        assert_eq!(
            env(install, name),
            Some(json!("/etc/eddy/ca/ca.crt")),
            "{name}"
        );
    }
    assert!(
        install["volumeMounts"]
            .as_array()
            .expect("mounts")
            .contains(&json!({"name": "egress-ca", "mountPath": "/etc/eddy/ca", "readOnly": true}))
    );
    let volume = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|volume| volume["name"] == "egress-ca")
        .expect("the CA volume");
    assert_eq!(volume["configMap"]["name"], "corp-ca");
    let function_container = &pod["containers"][0];
    assert_eq!(env(function_container, "HTTPS_PROXY"), None);
    assert_eq!(env(function_container, "PIP_CERT"), None);

    let plain = render(&function, &buildless_config()).expect("renders");
    let pod = to_json(&plain.deployment)["spec"]["template"]["spec"].clone();
    assert_eq!(env(&pod["initContainers"][0], "HTTPS_PROXY"), None);
}

/// A buildless pod whose `install` failed (now, or before a restart: CrashLoopBackOff) names
/// the pod and npm's own message; a running or still-installing pod names nothing.
#[test]
fn a_failed_install_is_read_from_the_install_containers_termination_message() {
    let pod = |name: &str, install: Value| -> k8s_openapi::api::core::v1::Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "status": {"initContainerStatuses": [install]},
        }))
        .expect("a pod")
    };
    let npm = "npm error code E404\nnpm error 404 Not Found - GET https://registry.npmjs.org/nope";
    let crashing = pod(
        "f-1",
        json!({"name": "install", "ready": false, "restartCount": 2, "image": "i", "imageID": "",
               "state": {"waiting": {"reason": "CrashLoopBackOff"}},
               "lastState": {"terminated": {"exitCode": 1, "message": npm}}}),
    );
    let installing = pod(
        "f-2",
        json!({"name": "install", "ready": false, "restartCount": 0, "image": "i", "imageID": "",
               "state": {"running": {}}}),
    );
    let installed = pod(
        "f-3",
        json!({"name": "install", "ready": true, "restartCount": 0, "image": "i", "imageID": "",
               "state": {"terminated": {"exitCode": 0, "message": "installed abc"}}}),
    );
    assert_eq!(
        install_failure(&[installing.clone(), crashing]),
        Some(("f-1".to_owned(), npm.to_owned()))
    );
    assert_eq!(install_failure(&[installing, installed]), None);
    let silent = pod(
        "f-4",
        json!({"name": "install", "ready": false, "restartCount": 0, "image": "i", "imageID": "",
               "state": {"terminated": {"exitCode": 137}}}),
    );
    assert_eq!(
        install_failure(&[silent]),
        Some(("f-4".to_owned(), "exit code 137".to_owned()))
    );
}
