//! Kyma's ways: buildless Functions, the package registry Secret, the publisher proxy's names, deprecated runtimes.

use super::*;

/// Buildless (`controller.build: buildless`, the default) on the real API server under the
/// chart's RBAC: a Kyma Function with dependencies (and the empty `runtimeImageOverride` and
/// profile Kyma's tools write) reaches Running without any build Job, its
/// pods on the runtime image with the `install` init container and the sources' ConfigMap;
/// a changed source rolls to a new ConfigMap (the old one kept until the rollout is done).
#[tokio::test]
async fn buildless_functions_run_without_a_build_or_a_registry() {
    let _serial = serial().await;
    let cluster = Cluster::new("buildless").await;
    // The cluster's presets, in Kyma's Serverless configuration's shape (the chart's
    // `controller.functionPresets`): a Function naming no profile gets `defaultPreset`'s.
    let presets_dir = tempfile::tempdir().unwrap();
    let presets = presets_dir.path().join("presets.yaml");
    std::fs::write(
        &presets,
        "resourcesConfiguration:\n  function:\n    resources:\n      defaultPreset: S\n      presets:\n        S: {requestCpu: 70m, requestMemory: 100Mi, limitCpu: 140m, limitMemory: 200Mi}\n",
    )
    .unwrap();
    let controller = cluster
        .component(
            "controller",
            &[
                ("EDDY_API_ADDR", "127.0.0.1:0"),
                ("EDDY_BUILD", "buildless"),
                (
                    "EDDY_RUNTIME_IMAGES",
                    "runtimes.test/eddy-runtime-{runtime}:{version}",
                ),
                ("EDDY_FUNCTION_PRESETS", presets.to_str().unwrap()),
            ],
        )
        .await;
    let ns = cluster.namespace.clone();
    let kyma = format!(
        r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: hello
  namespace: {ns}
spec:
  runtime: nodejs22
  # As Kyma's tools write a field left blank: not set, in the CRD and in the Deployment.
  runtimeImageOverride: ""
  resourceConfiguration:
    function:
      profile: ""
  source:
    inline:
      source: "module.exports = {{ main: () => require('lodash').capitalize('hi') }}"
      dependencies: '{{"dependencies": {{"lodash": "^4.17.21"}}}}'
"#
    );
    cluster.kubectl_apply(&kyma).unwrap();
    let api = "serverless.kyma-project.io/v1alpha2";
    cluster
        .wait_running(api, "hello", Duration::from_secs(60))
        .await;
    let (status, reason, message) = cluster.condition(api, "hello", "BuildReady").await.unwrap();
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "Buildless"),
        "{message}"
    );
    let jobs: Api<Job> = cluster.api();
    let deployments: Api<Deployment> = cluster.api();
    let config_maps: Api<k8s_openapi::api::core::v1::ConfigMap> = cluster.api();
    let selector = ListParams::default().labels("eddy.dev/function=hello");
    assert!(
        jobs.list(&selector).await.unwrap().items.is_empty(),
        "no build Job"
    );
    let version = env!("CARGO_PKG_VERSION");
    let deployment = deployments.get("hello").await.unwrap();
    assert_eq!(
        image_of(&deployment),
        format!("runtimes.test/eddy-runtime-nodejs22:{version}")
    );
    let pod = deployment.spec.template.spec.unwrap();
    let resources = pod.containers[0].resources.clone().unwrap();
    let quantities = |map: Option<
        std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    >| {
        map.unwrap_or_default()
            .into_iter()
            .map(|(name, quantity)| (name, quantity.0))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        quantities(resources.requests),
        [
            ("cpu".to_owned(), "70m".to_owned()),
            ("memory".to_owned(), "100Mi".to_owned())
        ],
        "the configured defaultPreset S"
    );
    assert_eq!(
        quantities(resources.limits),
        [
            ("cpu".to_owned(), "140m".to_owned()),
            ("memory".to_owned(), "200Mi".to_owned())
        ]
    );
    let install = &pod.init_containers.clone().unwrap()[0];
    assert_eq!(install.name, "install");
    let first_config_map = config_maps.list(&selector).await.unwrap().items;
    assert_eq!(first_config_map.len(), 1);
    // Kyma's short names: `fn` and `fns` name Kyma's Function (eddy's own is `efn`).
    for short in ["fn", "fns"] {
        let mut kubectl = cluster.plane.kubectl().unwrap();
        kubectl.args(["get", short, "-o", "name", "-n", &ns]);
        assert_eq!(
            run(&mut kubectl).unwrap().trim(),
            "function.serverless.kyma-project.io/hello",
            "kubectl get {short}"
        );
    }
    let mut kubectl = cluster.plane.kubectl().unwrap();
    kubectl.args(["get", "efn", "-o", "name", "-n", &ns]);
    assert_eq!(
        run(&mut kubectl).unwrap().trim(),
        "",
        "no eddy Function here"
    );

    // A new source: a new ConfigMap; the old one goes once the rollout is done.
    let changed = kyma.replace("capitalize('hi')", "capitalize('ho')");
    cluster.kubectl_apply(&changed).unwrap();
    let old = first_config_map[0].metadata.name.clone().unwrap();
    eventually(
        "the new ConfigMap alone, once rolled out",
        Duration::from_secs(60),
        || async {
            let names: Vec<String> = config_maps
                .list(&selector)
                .await
                .unwrap()
                .items
                .into_iter()
                .filter_map(|c| c.metadata.name)
                .collect();
            names.len() == 1 && names[0] != old
        },
    )
    .await
    .unwrap();
    assert!(
        jobs.list(&selector).await.unwrap().items.is_empty(),
        "still no Job"
    );

    cluster.assert_no_rbac_refusal();
    drop(controller);
    cluster.finish().await;
}

/// Removes kyma-system's package registry Secret when a test ends, passed or not: the cluster
/// is shared, and another test's Functions must not install with it.
pub(crate) struct ClusterRegistrySecret(&'static ControlPlane);

impl Drop for ClusterRegistrySecret {
    fn drop(&mut self) {
        if let Ok(mut kubectl) = self.0.kubectl() {
            kubectl.args([
                "delete",
                "secret",
                "serverless-package-registry-config",
                "-n",
                "kyma-system",
                "--ignore-not-found",
            ]);
            let _ = run(&mut kubectl);
        }
    }
}

/// Kyma's private package registry Secret under the chart's RBAC: kyma-system's labelled one is
/// copied into the Function's namespace (the one Secret name the controller may write) and
/// mounted into the buildless `install` init container only; the namespace's own Secret then
/// wins and the copy goes. The controller watches Secrets of that name alone (the only Secrets
/// the chart lets it list), and the audit log shows no request of it refused.
#[tokio::test]
async fn kyma_s_package_registry_secret_reaches_the_install_only_under_the_charts_rbac() {
    let _serial = serial().await;
    let cluster = Cluster::new("registry").await;
    let _controller = cluster
        .component(
            "controller",
            &[
                ("EDDY_API_ADDR", "127.0.0.1:0"),
                ("EDDY_BUILD", "buildless"),
                (
                    "EDDY_RUNTIME_IMAGES",
                    "runtimes.test/eddy-runtime-{runtime}:{version}",
                ),
            ],
        )
        .await;
    let ns = cluster.namespace.clone();
    cluster
        .kubectl_apply(&format!(
            r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: greet
  namespace: {ns}
spec:
  runtime: nodejs24
  source:
    inline:
      source: "module.exports = {{ main: () => require('@acme/greeting').hello() }}"
      dependencies: '{{"dependencies": {{"@acme/greeting": "1.0.0"}}}}'
"#
        ))
        .unwrap();
    let deployments: Api<Deployment> = cluster.api();
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = cluster.api();
    // Which Secret the install mounts, and whether the function's container mounts none.
    let registry_mount = || async {
        let deployment = deployments.get_opt("greet").await.ok()??;
        let pod = deployment.spec.template.spec?;
        let install = pod
            .init_containers?
            .into_iter()
            .find(|c| c.name == "install")?;
        let mounted = install
            .volume_mounts?
            .into_iter()
            .find(|m| m.name == "package-registry")?;
        assert_eq!(mounted.mount_path, "/eddy/package-registry");
        assert!(
            pod.containers[0]
                .volume_mounts
                .iter()
                .flatten()
                .all(|m| m.name != "package-registry"),
            "the function's container mounts the registry"
        );
        pod.volumes?
            .into_iter()
            .find(|v| v.name == "package-registry")?
            .secret?
            .secret_name
    };
    eventually("the Deployment", Duration::from_secs(60), || async {
        deployments.get_opt("greet").await.ok().flatten().is_some()
    })
    .await
    .unwrap();
    assert_eq!(registry_mount().await, None);

    let _cleanup = ClusterRegistrySecret(cluster.plane);
    let cluster_secret = r#"apiVersion: v1
kind: Secret
metadata:
  name: serverless-package-registry-config
  namespace: kyma-system
  labels: {"serverless.kyma-project.io/config": credentials}
type: Opaque
stringData:
  .npmrc: |
    @acme:registry=https://npm.acme.example/
    //npm.acme.example/:_authToken=cluster-token
"#;
    let mut kubectl = cluster.plane.kubectl().unwrap();
    kubectl.args(["apply", "--server-side", "-n", "kyma-system", "-f", "-"]);
    run_with_input(&mut kubectl, cluster_secret).unwrap();
    eventually(
        "the install to mount the copy of kyma-system's Secret",
        Duration::from_secs(60),
        || async { registry_mount().await.as_deref() == Some("eddy-package-registry-config") },
    )
    .await
    .unwrap();
    let copy = secrets.get("eddy-package-registry-config").await.unwrap();
    assert_eq!(
        copy.data.unwrap()[".npmrc"].0,
        b"@acme:registry=https://npm.acme.example/\n//npm.acme.example/:_authToken=cluster-token\n"
    );

    // The namespace's own Secret wins; the copy goes.
    cluster
        .kubectl_apply(
            "apiVersion: v1\nkind: Secret\nmetadata: {name: serverless-package-registry-config}\ntype: Opaque\nstringData:\n  .npmrc: \"@acme:registry=https://npm.own.example/\\n\"\n",
        )
        .unwrap();
    eventually(
        "the install to mount the namespace's own Secret, the copy gone",
        Duration::from_secs(60),
        || async {
            registry_mount().await.as_deref() == Some("serverless-package-registry-config")
                && secrets
                    .get_opt("eddy-package-registry-config")
                    .await
                    .is_ok_and(|copy| copy.is_none())
        },
    )
    .await
    .unwrap();
    cluster.assert_no_rbac_refusal();
    cluster.finish().await;
}

/// Puts back the chart's publisher alias a test replaced (the cluster is shared).
pub(crate) struct PublisherAlias(&'static ControlPlane, String);

impl Drop for PublisherAlias {
    fn drop(&mut self) {
        for args in [
            &[
                "delete",
                "functions.serverless.kyma-project.io",
                "eventing-publisher-proxy",
                "-n",
                "kyma-system",
                "--ignore-not-found",
                "--wait=false",
            ][..],
            &[
                "delete",
                "service",
                "eventing-publisher-proxy",
                "-n",
                "kyma-system",
                "--ignore-not-found",
            ][..],
        ] {
            if let Ok(mut kubectl) = self.0.kubectl() {
                kubectl.args(args);
                let _ = run(&mut kubectl);
            }
        }
        if let Ok(mut kubectl) = self.0.kubectl() {
            kubectl.args(["create", "-f", "-"]);
            let _ = run_with_input(&mut kubectl, &self.1);
        }
    }
}

/// Kyma's own tests deploy a publisher mock as a Function named `eventing-publisher-proxy` in
/// `kyma-system`: created after the chart's alias of that name, it replaces the alias (the
/// controller deletes the ExternalName Service, the only Services it may delete) and its own
/// Service takes the name, under the chart's RBAC.
#[tokio::test]
async fn a_function_named_as_kyma_s_publisher_proxy_replaces_the_chart_s_alias() {
    let _serial = serial().await;
    let cluster = Cluster::new("publisher").await;
    let services: Api<k8s_openapi::api::core::v1::Service> =
        Api::namespaced(cluster.admin.clone(), "kyma-system");
    let alias = services.get("eventing-publisher-proxy").await.unwrap();
    assert_eq!(
        alias.spec.as_ref().unwrap().type_.as_deref(),
        Some("ExternalName")
    );
    let mut saved = serde_json::to_value(&alias).unwrap();
    for field in [
        "resourceVersion",
        "uid",
        "creationTimestamp",
        "managedFields",
    ] {
        saved["metadata"].as_object_mut().unwrap().remove(field);
    }
    saved.as_object_mut().unwrap().remove("status");
    let _restore = PublisherAlias(cluster.plane, saved.to_string());
    let _controller = cluster
        .component(
            "controller",
            &[
                ("EDDY_API_ADDR", "127.0.0.1:0"),
                ("EDDY_BUILD", "buildless"),
                (
                    "EDDY_RUNTIME_IMAGES",
                    "runtimes.test/eddy-runtime-{runtime}:{version}",
                ),
            ],
        )
        .await;
    let mut kubectl = cluster.plane.kubectl().unwrap();
    kubectl.args(["apply", "--server-side", "-n", "kyma-system", "-f", "-"]);
    run_with_input(
        &mut kubectl,
        r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: eventing-publisher-proxy
  namespace: kyma-system
spec:
  runtime: nodejs24
  source:
    inline:
      source: "module.exports = { main: (event) => { console.log(JSON.stringify(event.data)); return ''; } }"
"#,
    )
    .unwrap();
    eventually(
        "the Function's own Service to take the alias's name",
        Duration::from_secs(60),
        || async {
            services
                .get_opt("eventing-publisher-proxy")
                .await
                .ok()
                .flatten()
                .and_then(|service| service.spec)
                .is_some_and(|spec| {
                    spec.type_.as_deref() != Some("ExternalName")
                        && spec.selector.is_some_and(|s| {
                            // Kyma's label contract: the Service selects by Kyma's labels.
                            s.get("serverless.kyma-project.io/function-name")
                                .map(String::as_str)
                                == Some("eventing-publisher-proxy")
                        })
                })
        },
    )
    .await
    .unwrap();
    // The other alias is untouched.
    let other = services
        .get("eventing-event-publisher-proxy")
        .await
        .unwrap();
    assert_eq!(other.spec.unwrap().type_.as_deref(), Some("ExternalName"));
    cluster.assert_no_rbac_refusal();
    cluster.finish().await;
}

/// `kubectl apply` of a Function on a runtime Kyma's schedule deprecates prints the warning
/// `eddy apply` prints (the chart's admission policy, Warn only), and the Function is stored;
/// a current runtime draws none.
#[tokio::test]
async fn kubectl_apply_warns_of_a_deprecated_runtime() {
    let _serial = serial().await;
    let cluster = Cluster::new("deprecated").await;
    let ns = cluster.namespace.clone();
    let manifest = |name: &str, runtime: &str| {
        format!(
            "apiVersion: serverless.kyma-project.io/v1alpha2\nkind: Function\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  runtime: {runtime}\n  source:\n    inline:\n      source: \"module.exports = {{ main: () => 'hi' }}\"\n"
        )
    };
    let apply = |yaml: String| {
        let mut kubectl = cluster.plane.kubectl().unwrap();
        kubectl.args(["apply", "-f", "-"]);
        kubectl
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = kubectl.spawn().unwrap();
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), yaml.as_bytes()).unwrap();
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success(), "{output:?}");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let warned = apply(manifest("old", "nodejs20"));
    assert!(
        warned.contains(
            "spec.runtime: runtime nodejs20 is deprecated and will be removed in the future \
             (Kyma's deprecation schedule); move to nodejs26"
        ),
        "{warned}"
    );
    let quiet = apply(manifest("new", "nodejs24"));
    assert!(!quiet.contains("deprecated"), "{quiet}");
    let stored = cluster
        .dynamic("serverless.kyma-project.io/v1alpha2", "Function")
        .get_opt("old")
        .await
        .unwrap();
    assert!(stored.is_some());
    cluster.finish().await;
}
