//! Tests: Rendered objects.

use super::*;

#[test]
fn function_pods_are_hardened() {
    let rendered = render(&function(json!({})), &config()).expect("renders");
    let pod = rendered
        .deployment
        .spec
        .template
        .spec
        .clone()
        .expect("a pod spec");
    let pod_security = pod.security_context.clone().expect("pod security context");
    assert_eq!(pod_security.run_as_non_root, Some(true));
    assert_eq!(pod_security.run_as_user, Some(1000));
    assert_eq!(
        pod_security.seccomp_profile.map(|s| s.type_),
        Some("RuntimeDefault".to_owned())
    );
    assert_eq!(pod.automount_service_account_token, Some(false));
    let container = &pod.containers[0];
    let security = container
        .security_context
        .clone()
        .expect("container security context");
    assert_eq!(security.read_only_root_filesystem, Some(true));
    assert_eq!(security.allow_privilege_escalation, Some(false));
    assert_eq!(security.privileged, Some(false));
    assert_eq!(
        security.capabilities.and_then(|c| c.drop),
        Some(vec!["ALL".to_owned()])
    );
    assert_eq!(
        security.seccomp_profile.map(|s| s.type_),
        Some("RuntimeDefault".to_owned())
    );
    // A writable /tmp on the read-only root.
    let mounts = container.volume_mounts.clone().unwrap_or_default();
    let tmp = mounts
        .iter()
        .find(|m| m.mount_path == "/tmp")
        .expect("/tmp is mounted");
    let volumes = pod.volumes.clone().unwrap_or_default();
    let volume = volumes
        .iter()
        .find(|v| v.name == tmp.name)
        .expect("the /tmp volume");
    assert!(volume.empty_dir.is_some());
    assert_eq!(tmp.read_only, None);
}

#[test]
fn function_objects_are_labelled_for_the_mesh_and_for_cleanup() {
    let rendered = render(&function(json!({})), &config()).expect("renders");
    let template = rendered.deployment.spec.template.clone();
    let pod_labels = template.metadata.and_then(|m| m.labels).unwrap_or_default();
    assert_eq!(
        pod_labels
            .get("sidecar.istio.io/inject")
            .map(String::as_str),
        Some("true")
    );
    assert_eq!(
        pod_labels.get("eddy.dev/function").map(String::as_str),
        Some("reserve-stock")
    );
    assert_eq!(pod_labels.get("eddy.dev/build-hash"), Some(&rendered.hash));
    let selector = rendered
        .deployment
        .spec
        .selector
        .match_labels
        .clone()
        .unwrap_or_default();
    assert_eq!(
        selector.len(),
        1,
        "the selector survives rebuilds: {selector:?}"
    );
    // Kyma's label contract: the pods carry its four labels, and the Service selects them by
    // exactly those.
    let uid = function(json!({})).metadata.uid.expect("a uid");
    let kyma: std::collections::BTreeMap<String, String> = [
        ("serverless.kyma-project.io/function-name", "reserve-stock"),
        (
            "serverless.kyma-project.io/managed-by",
            "function-controller",
        ),
        ("serverless.kyma-project.io/uuid", uid.as_str()),
        ("serverless.kyma-project.io/resource", "deployment"),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value.to_owned()))
    .collect();
    for (name, value) in &kyma {
        assert_eq!(pod_labels.get(name), Some(value), "{name}");
    }
    let service_selector = rendered
        .service
        .spec
        .as_ref()
        .and_then(|spec| spec.selector.clone())
        .unwrap_or_default();
    assert_eq!(service_selector, kyma);
    let build_pod = rendered
        .job
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.clone())
        .expect("build pod metadata");
    assert_eq!(
        build_pod
            .annotations
            .unwrap_or_default()
            .get("sidecar.istio.io/inject")
            .map(String::as_str),
        Some("false"),
        "a sidecar would keep the build pod running"
    );
    for labels in [
        rendered.job.metadata.labels.clone(),
        rendered.config_map.metadata.labels.clone(),
    ] {
        let labels = labels.unwrap_or_default();
        assert_eq!(labels.get("eddy.dev/build-hash"), Some(&rendered.hash));
        assert_eq!(
            labels
                .get("app.kubernetes.io/managed-by")
                .map(String::as_str),
            Some("eddy")
        );
    }
    let service = rendered.service.spec.clone().expect("a service spec");
    let port = &service.ports.unwrap_or_default()[0];
    assert_eq!(
        (port.port, port.target_port.clone()),
        (
            80,
            Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(8080))
        )
    );
    assert_eq!(port.name.as_deref(), Some("http"));
}

#[test]
fn resources_come_from_the_profile_or_are_given_explicitly() {
    let resources_of = |spec: Value| {
        let rendered = render(&function(spec), &config()).expect("renders");
        let pod = rendered.deployment.spec.template.spec.expect("a pod spec");
        let resources = pod.containers[0].resources.clone().expect("resources");
        let get = |map: Option<
            std::collections::BTreeMap<
                String,
                k8s_openapi::apimachinery::pkg::api::resource::Quantity,
            >,
        >,
                   key: &str| {
            map.and_then(|m| m.get(key).map(|q| q.0.clone()))
                .unwrap_or_default()
        };
        (
            get(resources.requests.clone(), "cpu"),
            get(resources.requests, "memory"),
            get(resources.limits.clone(), "cpu"),
            get(resources.limits, "memory"),
        )
    };
    assert_eq!(
        resources_of(json!({})),
        (
            "400m".into(),
            "512Mi".into(),
            "800m".into(),
            "1024Mi".into()
        ),
        "default profile L, as Kyma's"
    );
    assert_eq!(
        resources_of(json!({"resourceConfiguration": {"function": {"profile": "L"}}})),
        (
            "400m".into(),
            "512Mi".into(),
            "800m".into(),
            "1024Mi".into()
        )
    );
    assert_eq!(
        resources_of(
            json!({"resourceConfiguration": {"function": {"resources": {"requests": {"cpu": "150m", "memory": "100Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}}}})
        ),
        ("150m".into(), "100Mi".into(), "1".into(), "1Gi".into())
    );
}

#[test]
fn function_env_is_the_platform_s_then_the_user_s() {
    let rendered = render(&function(json!({"timeoutSeconds": 42})), &config()).expect("renders");
    let pod = rendered.deployment.spec.template.spec.expect("a pod spec");
    let env: Vec<(String, String)> = pod.containers[0]
        .env
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|e| (e.name, e.value.unwrap_or_default()))
        .collect();
    let expected: Vec<(String, String)> = [
        ("FUNC_NAME", "reserve-stock"),
        ("FUNC_NAMESPACE", "shop"),
        ("SERVICE_NAMESPACE", "shop"),
        ("FUNC_RUNTIME", "nodejs20"),
        ("FUNC_HANDLER", "main"),
        ("MOD_NAME", "handler"),
        ("FUNC_PORT", "8080"),
        ("FUNC_TIMEOUT", "42"),
        (
            "PUBLISHER_PROXY_ADDRESS",
            "http://eddy-event-bus.eddy-system.svc.cluster.local/publish",
        ),
        ("EDDY_SERVING_FILE", "/tmp/.eddy-serving"),
        ("LOG_LEVEL", "debug"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    assert_eq!(env, expected);
    assert!(
        pod.containers[0].env_from.is_none(),
        "nothing but its own env"
    );
}

/// eddy's runtime images wait for their server in a postStart hook, so the first readiness probe
/// finds it listening; an image of the user's (which may have no shell) gets no hook.
#[test]
fn own_runtime_images_wait_for_their_server_before_the_first_probe() {
    let hook = |spec: serde_json::Value| {
        let rendered = render(&function(spec), &config()).expect("renders");
        let pod = rendered.deployment.spec.template.spec.expect("a pod spec");
        pod.containers[0]
            .lifecycle
            .clone()
            .and_then(|lifecycle| lifecycle.post_start)
            .and_then(|handler| handler.exec)
            .and_then(|exec| exec.command)
    };
    let command = hook(json!({})).expect("a postStart exec hook");
    assert_eq!(command[..2], ["sh".to_owned(), "-c".to_owned()]);
    assert!(
        command[2].contains("[ ! -e /tmp/.eddy-serving ]"),
        "{command:?}"
    );
    assert!(
        command[2].ends_with("exit 0"),
        "a hook that fails kills the container"
    );
    assert_eq!(
        hook(json!({"runtimeImageOverride": "example.com/own:1"})),
        None
    );
}

/// Kyma's pod-level fields reach the Deployment as written: env from Secrets and ConfigMaps
/// (passed to Kubernetes, never resolved by eddy), each Secret mounted read-only at its path,
/// the user's labels and annotations on the pods (eddy's own labels kept), and the runtime image
/// override in place of the built image.
#[test]
fn kyma_fields_reach_the_deployment_as_written() {
    let rendered = render(
        &function(json!({
            "env": [
                {"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}},
                {"name": "REGION", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "region"}}},
                {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
            ],
            "secretMounts": [{"secretName": "tls", "mountPath": "/etc/tls"}],
            "template": {"labels": {"tier": "gold"}},
            "labels": {"team": "checkout"},
            "annotations": {"owner": "checkout@example.com"},
            "runtimeImageOverride": "registry.example.com/custom-node:1",
        })),
        &config(),
    )
    .expect("renders");
    let deployment = serde_json::to_value(&rendered.deployment).expect("json");
    let template = &deployment["spec"]["template"];
    let container = &template["spec"]["containers"][0];
    let env = container["env"].as_array().expect("env");
    let named = |name: &str| env.iter().find(|e| e["name"] == name).cloned();
    assert_eq!(
        named("API_KEY").expect("API_KEY"),
        json!({"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}})
    );
    assert_eq!(
        named("REGION").expect("REGION"),
        json!({"name": "REGION", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "region"}}})
    );
    assert_eq!(
        named("POD").expect("POD"),
        json!({"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    );
    assert_eq!(
        named("MEM").expect("MEM"),
        json!({"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}})
    );
    assert_eq!(
        template["metadata"]["labels"]["tier"], "gold",
        "the deprecated template's labels are on the pods"
    );
    let mount = container["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .find(|m| m["mountPath"] == "/etc/tls")
        .cloned()
        .expect("the Secret's mount");
    assert_eq!(mount["readOnly"], true);
    let volume = template["spec"]["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == mount["name"])
        .cloned()
        .expect("the Secret's volume");
    assert_eq!(volume["secret"]["secretName"], "tls");
    assert_eq!(template["metadata"]["labels"]["team"], "checkout");
    assert_eq!(
        template["metadata"]["labels"]["app.kubernetes.io/managed-by"], "eddy",
        "eddy's labels kept"
    );
    assert_eq!(
        template["metadata"]["annotations"]["owner"],
        "checkout@example.com"
    );
    assert_eq!(container["image"], "registry.example.com/custom-node:1");
}

/// Function pods carry Kyma's Istio annotations: the application held until the proxy is up
/// (the user's own proxy config wins), and with init containers (the buildless install) the
/// native sidecar, so the proxy runs before them and their downloads are not lost.
#[test]
fn function_pods_start_their_istio_proxy_before_their_init_containers() {
    let annotations = |spec: serde_json::Value, build: BuildMode| {
        let rendered =
            render(&function(spec), &RenderConfig { build, ..config() }).expect("renders");
        let deployment = serde_json::to_value(&rendered.deployment).expect("json");
        deployment["spec"]["template"]["metadata"]["annotations"].clone()
    };
    let with_dependencies = json!({"source": {"inline": {
        "source": "module.exports = { main: () => 'ok' }",
        "dependencies": "{\"dependencies\": {\"lodash\": \"^4\"}}"}}});
    let buildless = annotations(with_dependencies.clone(), BuildMode::Buildless);
    assert_eq!(buildless["sidecar.istio.io/nativeSidecar"], "true");
    let nothing_to_install = annotations(json!({}), BuildMode::Buildless);
    assert!(
        nothing_to_install
            .get("sidecar.istio.io/nativeSidecar")
            .is_none(),
        "a buildless pod without dependencies has no init container: {nothing_to_install}"
    );
    assert_eq!(
        buildless["proxy.istio.io/config"],
        r#"{ "holdApplicationUntilProxyStarts": true }"#
    );
    let built = annotations(json!({}), BuildMode::Image);
    assert!(
        built.get("sidecar.istio.io/nativeSidecar").is_none(),
        "an image-built pod has no init container: {built}"
    );
    let mut own_spec = with_dependencies;
    own_spec["annotations"] =
        json!({"proxy.istio.io/config": "{}", "sidecar.istio.io/nativeSidecar": "false"});
    let own = annotations(own_spec, BuildMode::Buildless);
    assert_eq!(
        own["proxy.istio.io/config"], "{}",
        "the user's proxy config wins"
    );
    assert_eq!(
        own["sidecar.istio.io/nativeSidecar"], "true",
        "the init containers need the proxy first"
    );
}

/// PUBLISHER_PROXY_ADDRESS: eddy's event-bus by default; Kyma's current publisher address for
/// a Kyma Function where eddy serves it (what Kyma's Function controller sets); the
/// Function's own, once, where it sets one.
#[test]
fn the_publisher_address_is_eddys_kymas_or_the_functions_own() {
    let address_of = |function: &Function, config: &RenderConfig| -> Vec<String> {
        let rendered = render(function, config).expect("renders");
        let pod = rendered.deployment.spec.template.spec.expect("a pod");
        pod.containers[0]
            .env
            .clone()
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.name == "PUBLISHER_PROXY_ADDRESS")
            .map(|e| e.value.unwrap_or_default())
            .collect()
    };
    let kyma_address = "http://eventing-publisher-proxy.kyma-system.svc.cluster.local/publish";
    let serving_kyma = RenderConfig {
        kyma_publisher_url: Some(kyma_address.to_owned()),
        ..config()
    };
    let eddys = function(json!({}));
    assert_eq!(
        address_of(&eddys, &serving_kyma),
        vec!["http://eddy-event-bus.eddy-system.svc.cluster.local/publish"]
    );
    let mut kymas = function(json!({}));
    kymas.metadata.annotations = Some(
        [(
            eddy_model::resources::APPLIED_AS_ANNOTATION.to_owned(),
            eddy_model::resources::KYMA_FUNCTION_API_VERSION.to_owned(),
        )]
        .into(),
    );
    assert_eq!(address_of(&kymas, &serving_kyma), vec![kyma_address]);
    assert_eq!(
        address_of(&kymas, &config()),
        vec!["http://eddy-event-bus.eddy-system.svc.cluster.local/publish"],
        "without the alias served, eddy's own"
    );
    let own = function(
        json!({"env": [{"name": "PUBLISHER_PROXY_ADDRESS", "value": "http://mock.test/publish"}]}),
    );
    assert_eq!(
        address_of(&own, &serving_kyma),
        vec!["http://mock.test/publish"]
    );
}

#[test]
fn functions_get_the_trace_collector_while_traces_are_on() {
    let env_of = |config: &RenderConfig| -> Vec<(String, String)> {
        let rendered = render(&function(json!({})), config).expect("renders");
        let pod = rendered.deployment.spec.template.spec.expect("a pod spec");
        pod.containers[0]
            .env
            .clone()
            .unwrap_or_default()
            .into_iter()
            .map(|e| (e.name, e.value.unwrap_or_default()))
            .collect()
    };
    let traced = RenderConfig {
        trace_collector: Some("http://otel-collector.observability:4318/v1/traces".to_owned()),
        ..config()
    };
    let env = env_of(&traced);
    let at = |name: &str| env.iter().position(|(key, _)| key == name);
    assert_eq!(
        env[at("TRACE_COLLECTOR_ENDPOINT").expect("set")].1,
        "http://otel-collector.observability:4318/v1/traces"
    );
    // Before the user's env, so a Function may point its spans elsewhere.
    assert!(at("TRACE_COLLECTOR_ENDPOINT") < at("LOG_LEVEL"));
    assert!(
        env_of(&config())
            .iter()
            .all(|(key, _)| key != "TRACE_COLLECTOR_ENDPOINT"),
        "not set while traces are off"
    );
}

#[test]
fn scaling_maps_onto_replicas_or_an_autoscaler() {
    let scaled = |spec: Value| render::scaling(&function(spec));
    assert_eq!(scaled(json!({})), Scaling::Autoscaled { min: 1, max: 3 });
    assert_eq!(
        scaled(json!({"scaleConfig": {"minReplicas": 0, "maxReplicas": 4}})),
        Scaling::ByEddy { min: 0, max: 4 }
    );
    assert_eq!(
        scaled(json!({"scaleConfig": {"minReplicas": 2, "maxReplicas": 2}})),
        Scaling::Fixed(2)
    );
    assert_eq!(
        scaled(json!({"scaleConfig": null, "replicas": 0})),
        Scaling::Fixed(0)
    );
    assert_eq!(scaled(json!({"scaleConfig": null})), Scaling::Fixed(1));
}

/// `eddy.dev/scale-on: backlog` on a Function with a minimum of one or more: no HPA, and its
/// Deployment leaves replicas to the dispatcher within the bounds it is annotated with; other
/// values, or a minimum of zero, change nothing.
#[test]
fn a_function_scaled_on_its_backlog_gets_bounds_for_the_dispatcher_and_no_hpa() {
    let annotated = |value: &str, spec: Value| {
        let mut function = function(spec);
        function.metadata.annotations = Some(
            [("eddy.dev/scale-on".to_owned(), value.to_owned())]
                .into_iter()
                .collect(),
        );
        function
    };
    let bounds = json!({"scaleConfig": {"minReplicas": 2, "maxReplicas": 5}});
    let function = annotated("backlog", bounds.clone());
    assert_eq!(
        render::scaling(&function),
        Scaling::ByEddy { min: 2, max: 5 }
    );
    let rendered = render(&function, &config()).expect("renders");
    assert!(rendered.autoscaler.is_none());
    let deployment = to_json(&rendered.deployment);
    assert!(deployment["spec"].get("replicas").is_none(), "{deployment}");
    assert_eq!(
        deployment["metadata"]["labels"]["eddy.dev/scaled-by"],
        "eddy"
    );
    assert!(
        deployment["metadata"]["labels"]
            .get("eddy.dev/scale-to-zero")
            .is_none()
    );
    assert_eq!(
        deployment["metadata"]["annotations"],
        json!({"eddy.dev/max-replicas": "5", "eddy.dev/min-replicas": "2"})
    );
    assert_eq!(
        render::scaling(&annotated("cpu", bounds)),
        Scaling::Autoscaled { min: 2, max: 5 }
    );
    assert_eq!(
        render::scaling(&annotated(
            "backlog",
            json!({"scaleConfig": {"minReplicas": 0, "maxReplicas": 5}})
        )),
        Scaling::ByEddy { min: 0, max: 5 }
    );
    let from_zero = render(&function_from_zero(), &config()).expect("renders");
    let labels = to_json(&from_zero.deployment)["metadata"]["labels"].clone();
    assert_eq!(labels["eddy.dev/scaled-by"], "eddy");
    assert_eq!(labels["eddy.dev/scale-to-zero"], "true");
}

fn function_from_zero() -> Function {
    function(json!({"scaleConfig": {"minReplicas": 0, "maxReplicas": 4}}))
}

#[test]
fn builds_use_the_configured_builder_registry_and_secret() {
    let mut config = config();
    config.registry_secret = Some("registry-push".to_owned());
    config.insecure_registry = true;
    let long_name = format!("f{}", "x".repeat(62));
    let rendered = render(&function(json!({})), &config).expect("renders");
    assert_eq!(
        rendered.image,
        format!(
            "registry.example.com/eddy/shop-reserve-stock:{}",
            rendered.hash
        )
    );
    let job = rendered.job.spec.clone().expect("a job spec");
    assert_eq!(job.backoff_limit, Some(0));
    assert_eq!(job.active_deadline_seconds, Some(600));
    let pod = job.template.spec.expect("a pod spec");
    assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
    let builder = &pod.containers[0];
    assert_eq!(
        builder.image.as_deref(),
        Some("gcr.io/kaniko-project/executor:v1.23.2")
    );
    let args = builder.args.clone().unwrap_or_default();
    assert!(args.contains(&"--insecure".to_owned()));
    assert!(args.contains(&"--context=dir:///workspace".to_owned()));
    assert_eq!(
        builder.termination_message_policy.as_deref(),
        Some("FallbackToLogsOnError")
    );
    let mounts = builder.volume_mounts.clone().unwrap_or_default();
    assert!(mounts.iter().any(|m| m.mount_path == "/kaniko/.docker"));
    let deployment_pod = rendered.deployment.spec.template.spec.expect("a pod spec");
    assert_eq!(
        deployment_pod
            .image_pull_secrets
            .unwrap_or_default()
            .first()
            .map(|s| s.name.clone()),
        Some("registry-push".to_owned())
    );
    // Names stay valid for any Function name.
    assert!(render::job_name(&long_name, &rendered.hash).len() <= 63);
    assert!(!render::job_name("a-", &rendered.hash).contains("--"));
}
