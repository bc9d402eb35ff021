//! What serves a Function: its Deployment (built image, or the runtime image with the
//! buildless `install` init container), its Service and its HPA.

use super::{
    BTreeMap, BUILD_HASH_LABEL, BUILDLESS_INSTALL_SCRIPT, BUILDLESS_SOURCES, BuildMode,
    Capabilities, ConfigMapKeySelector, ConfigMapVolumeSource, Container, ContainerPort,
    CrossVersionObjectReference, DEFAULT_TIMEOUT_SECONDS, Deployment, DeploymentSpec,
    DeploymentStrategy, EGRESS_CA_DIR, EmptyDirVolumeSource, EnvVar, EnvVarSource, ExecAction,
    FUNC_TIMEOUT_ENV, FUNCTION_DIR, FUNCTION_LABEL, FUNCTION_PORT, Function, HTTPGetAction,
    HorizontalPodAutoscaler, HorizontalPodAutoscalerSpec, IntOrString, KeyToPath, LabelSelector,
    Lifecycle, LifecycleHandler, LocalObjectReference, MetricSpec, MetricTarget, ObjectMeta, Owned,
    PUBLISHER_PROXY_ADDRESS, PodSecurityContext, PodSpec, PodTemplateSpec, Probe, Quantity,
    RenderConfig, ResourceMetricSource, ResourceRequirements, RollingUpdateDeployment, Scaling,
    SeccompProfile, SecretKeySelector, SecretVolumeSource, SecurityContext, Service, ServicePort,
    ServiceSpec, Source, Volume, VolumeMount, WORKSPACE, config_map_name, git_fetch_container,
    git_volumes, labels, over_defaults, runtimes,
};
use eddy_platform::scale::{
    MAX_REPLICAS_ANNOTATION, MIN_REPLICAS_ANNOTATION, SCALE_TO_ZERO_LABEL, SCALED_BY_EDDY,
    SCALED_BY_LABEL,
};

/// eddy's container defaults: non-root, read-only root, no capabilities, no privilege
/// escalation, RuntimeDefault seccomp.
pub(super) fn hardened_container() -> SecurityContext {
    SecurityContext {
        run_as_non_root: Some(true),
        allow_privilege_escalation: Some(false),
        privileged: Some(false),
        read_only_root_filesystem: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Capabilities::default()
        }),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..SeccompProfile::default()
        }),
        ..SecurityContext::default()
    }
}

pub(super) fn quantities<const N: usize>(pairs: [(&str, &str); N]) -> BTreeMap<String, Quantity> {
    pairs
        .into_iter()
        .map(|(name, value)| (name.to_owned(), Quantity(value.to_owned())))
        .collect()
}

/// The function's pods: hardened, probed, rolled without dropping a request.
pub(super) fn deployment(
    owned: &Owned<'_>,
    function: &Function,
    config: &RenderConfig,
    image: &str,
    scaling: Scaling,
    source: Source<'_>,
) -> Deployment {
    let name = owned.name;
    let timeout =
        i32::try_from(function.spec.timeout().as_secs()).unwrap_or(DEFAULT_TIMEOUT_SECONDS);
    let env = function_env(owned, function, config, timeout);
    let mut volumes = FunctionVolumes::of(function);
    let mut init_containers = Vec::new();
    if config.build == BuildMode::Buildless {
        let buildless = buildless_pod(owned, function, config, image, source, &env);
        volumes.mounts.push(VolumeMount {
            name: "function".into(),
            mount_path: FUNCTION_DIR.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
        volumes.volumes.extend(buildless.volumes);
        init_containers = buildless.init_containers;
    }
    let container = function_container(function, image, env, volumes.mounts);
    let pod = PodParts {
        init_containers,
        container,
        volumes: volumes.volumes,
        timeout,
    };
    let mut metadata = owned.metadata(name, owned.labels());
    if let Scaling::ByEddy { min, max } = scaling {
        let labels = metadata.labels.get_or_insert_with(Default::default);
        labels.insert(SCALED_BY_LABEL.into(), SCALED_BY_EDDY.into());
        let mut annotations =
            BTreeMap::from([(MAX_REPLICAS_ANNOTATION.to_owned(), max.to_string())]);
        if min > 0 {
            annotations.insert(MIN_REPLICAS_ANNOTATION.to_owned(), min.to_string());
        } else {
            labels.insert(SCALE_TO_ZERO_LABEL.into(), "true".into());
        }
        metadata.annotations = Some(annotations);
    }
    Deployment {
        metadata,
        spec: DeploymentSpec {
            replicas: match scaling {
                Scaling::Fixed(replicas) => Some(replicas),
                Scaling::Autoscaled { .. } | Scaling::ByEddy { .. } => None,
            },
            selector: LabelSelector {
                match_labels: Some(labels([(FUNCTION_LABEL, name)])),
                ..LabelSelector::default()
            },
            // New pods must be ready before old ones go: an update drops no request.
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_unavailable: Some(IntOrString::Int(0)),
                    max_surge: Some(IntOrString::String("25%".into())),
                }),
            }),
            revision_history_limit: Some(3),
            template: pod_template(owned, function, config, pod),
            ..DeploymentSpec::default()
        },
        ..Deployment::default()
    }
}

/// The function container's environment: the runtime's (Kyma's names), the trace collector,
/// where eddy's runtime says it serves (`SERVING_FILE`), then the spec's own `env` in its order.
fn function_env(
    owned: &Owned<'_>,
    function: &Function,
    config: &RenderConfig,
    timeout: i32,
) -> Vec<EnvVar> {
    let var = |name: &str, value: String| EnvVar {
        name: name.to_owned(),
        value: Some(value),
        ..EnvVar::default()
    };
    // A Kyma Function gets Kyma's publisher address when eddy serves it; a Function that sets
    // its own PUBLISHER_PROXY_ADDRESS keeps it.
    let publisher_url = match (
        &config.kyma_publisher_url,
        eddy_model::kyma::stored_as(&function.metadata),
    ) {
        (Some(kyma), Some(_)) => kyma,
        _ => &config.publisher_url,
    };
    let own_publisher = function
        .spec
        .env
        .iter()
        .any(|user| user.name == PUBLISHER_PROXY_ADDRESS);
    let mut env: Vec<EnvVar> = eddy_model::resources::runtime_env(
        owned.name,
        &owned.namespace,
        function.spec.runtime,
        FUNCTION_PORT,
        timeout,
        publisher_url,
    )
    .into_iter()
    .filter(|(name, _)| !(own_publisher && *name == PUBLISHER_PROXY_ADDRESS))
    .map(|(name, value)| var(name, value))
    .collect();
    if let Some(endpoint) = &config.trace_collector {
        env.push(var("TRACE_COLLECTOR_ENDPOINT", endpoint.clone()));
    }
    if runs_own_runtime(function) {
        env.push(var("EDDY_SERVING_FILE", SERVING_FILE.to_owned()));
    }
    // FUNC_TIMEOUT in the spec's env is already in `timeout`.
    env.extend(
        function
            .spec
            .env
            .iter()
            .filter(|user| user.name != FUNC_TIMEOUT_ENV)
            .map(user_env_var),
    );
    env
}

/// One `env` entry of the spec, as Kubernetes takes it.
fn user_env_var(user: &eddy_model::resources::EnvVar) -> EnvVar {
    EnvVar {
        name: user.name.clone(),
        value: user.value_from.is_none().then(|| user.value.clone()),
        value_from: user.value_from.as_ref().map(|from| EnvVarSource {
            secret_key_ref: from.secret_key_ref.as_ref().map(|key| SecretKeySelector {
                name: key.name.clone(),
                key: key.key.clone(),
                optional: key.optional,
            }),
            config_map_key_ref: from
                .config_map_key_ref
                .as_ref()
                .map(|key| ConfigMapKeySelector {
                    name: key.name.clone(),
                    key: key.key.clone(),
                    optional: key.optional,
                }),
            field_ref: from.field_ref.as_ref().map(|field| {
                k8s_openapi::api::core::v1::ObjectFieldSelector {
                    api_version: field.api_version.clone(),
                    field_path: field.field_path.clone(),
                }
            }),
            resource_field_ref: from.resource_field_ref.as_ref().map(|resource| {
                k8s_openapi::api::core::v1::ResourceFieldSelector {
                    container_name: resource.container_name.clone(),
                    divisor: resource.divisor.as_ref().map(|d| Quantity(d.to_string())),
                    resource: resource.resource.clone(),
                }
            }),
            ..EnvVarSource::default()
        }),
    }
}

/// The function pod's volumes and the function container's mounts of them: a bounded `/tmp`
/// (the root is read-only) and each of the spec's `secretMounts`.
struct FunctionVolumes {
    mounts: Vec<VolumeMount>,
    volumes: Vec<Volume>,
}

impl FunctionVolumes {
    fn of(function: &Function) -> Self {
        let mut mounts = vec![VolumeMount {
            name: "tmp".into(),
            mount_path: "/tmp".into(),
            ..VolumeMount::default()
        }];
        let mut volumes = vec![Volume {
            name: "tmp".into(),
            empty_dir: Some(EmptyDirVolumeSource {
                size_limit: Some(Quantity("256Mi".into())),
                ..EmptyDirVolumeSource::default()
            }),
            ..Volume::default()
        }];
        for (index, mount) in function.spec.secret_mounts.iter().enumerate() {
            let volume = format!("secret-{index}");
            mounts.push(VolumeMount {
                name: volume.clone(),
                mount_path: mount.mount_path.clone(),
                read_only: Some(true),
                ..VolumeMount::default()
            });
            volumes.push(Volume {
                name: volume,
                secret: Some(SecretVolumeSource {
                    secret_name: Some(mount.secret_name.clone()),
                    ..SecretVolumeSource::default()
                }),
                ..Volume::default()
            });
        }
        Self { mounts, volumes }
    }
}

/// Whether the function container runs one of eddy's runtime images (no `runtimeImageOverride`):
/// only those write [`SERVING_FILE`] and have a shell for the hook that waits for it, so the
/// variable and the hook go together.
fn runs_own_runtime(function: &Function) -> bool {
    function.spec.runtime_image_override.is_none()
}

/// The file eddy's runtime servers write once they listen (`EDDY_SERVING_FILE`), in the pod's
/// `/tmp` volume.
pub const SERVING_FILE: &str = "/tmp/.eddy-serving";

/// The postStart hook of a function container running eddy's runtime: wait until the server
/// listens, at most 10 s, and never fail (a failed hook kills the container; readiness decides).
/// The kubelet runs no probe before the hook returns. Without it, the first readiness probe comes
/// as the container starts, before any runtime can listen, and the next a whole period later.
fn wait_for_serving() -> String {
    format!(
        "n=0; while [ ! -e {SERVING_FILE} ] && [ \"$n\" -lt 200 ]; do sleep 0.05; n=$((n+1)); done; exit 0"
    )
}

/// The function container: the image (or the spec's `runtimeImageOverride`), its port, its
/// resources, hardened unless the spec says otherwise, and probed on `/healthz`. eddy's own
/// runtime images also wait for their server before the first probe (`wait_for_serving`); an
/// image of the user's may have no shell and no such server.
fn function_container(
    function: &Function,
    image: &str,
    env: Vec<EnvVar>,
    volume_mounts: Vec<VolumeMount>,
) -> Container {
    let resources = function.spec.function_resources();
    let health = |period: i32, failures: i32, timeout: Option<i32>| Probe {
        http_get: Some(HTTPGetAction {
            path: Some("/healthz".into()),
            port: IntOrString::Int(FUNCTION_PORT),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        timeout_seconds: timeout,
        ..Probe::default()
    };
    Container {
        name: "function".into(),
        image: Some(
            function
                .spec
                .runtime_image_override
                .clone()
                .unwrap_or_else(|| image.to_owned()),
        ),
        ports: Some(vec![ContainerPort {
            name: Some("http".into()),
            container_port: FUNCTION_PORT,
            protocol: Some("TCP".into()),
            ..ContainerPort::default()
        }]),
        env: Some(env),
        resources: Some(ResourceRequirements {
            requests: (!resources.requests.is_empty()).then_some(resources.requests),
            limits: (!resources.limits.is_empty()).then_some(resources.limits),
            ..ResourceRequirements::default()
        }),
        security_context: Some(over_defaults(
            hardened_container(),
            function.spec.container_security_context.as_ref(),
        )),
        // Probed every second: a new pod is Ready (and takes traffic, and its Function is
        // Running) within a second of answering, not two. Four misses in a row, as two of two
        // seconds did, take it out of its Service.
        readiness_probe: Some(health(1, 4, None)),
        liveness_probe: Some(health(10, 3, Some(2))),
        lifecycle: runs_own_runtime(function).then(|| Lifecycle {
            post_start: Some(LifecycleHandler {
                exec: Some(ExecAction {
                    command: Some(vec!["sh".into(), "-c".into(), wait_for_serving()]),
                }),
                ..LifecycleHandler::default()
            }),
            ..Lifecycle::default()
        }),
        volume_mounts: Some(volume_mounts),
        ..Container::default()
    }
}

/// What goes into the function's pod template.
struct PodParts {
    init_containers: Vec<Container>,
    container: Container,
    volumes: Vec<Volume>,
    /// The Function's timeout in seconds (its grace period follows it).
    timeout: i32,
}

/// The function's pod template: labels (the user's, eddy's, Kyma's, Istio injection),
/// annotations, a non-root pod without a service account token, the registry secret.
fn pod_template(
    owned: &Owned<'_>,
    function: &Function,
    config: &RenderConfig,
    pod: PodParts,
) -> PodTemplateSpec {
    let mut pod_labels = function.spec.pod_labels();
    pod_labels.extend(owned.labels());
    pod_labels.insert(BUILD_HASH_LABEL.into(), owned.hash.clone());
    pod_labels.insert("sidecar.istio.io/inject".into(), "true".into());
    pod_labels.extend(owned.kyma_labels());
    let runtime_default = || {
        Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..SeccompProfile::default()
        })
    };
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(pod_labels),
            annotations: Some(pod_annotations(function, !pod.init_containers.is_empty())),
            ..ObjectMeta::default()
        }),
        spec: Some(PodSpec {
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            termination_grace_period_seconds: Some(i64::from(pod.timeout.min(300)) + 5),
            security_context: Some(over_defaults(
                PodSecurityContext {
                    run_as_non_root: Some(true),
                    run_as_user: Some(1000),
                    run_as_group: Some(1000),
                    fs_group: Some(1000),
                    seccomp_profile: runtime_default(),
                    ..PodSecurityContext::default()
                },
                function.spec.pod_security_context.as_ref(),
            )),
            image_pull_secrets: Some(
                config
                    .registry_secret
                    .iter()
                    .map(|secret| LocalObjectReference {
                        name: secret.clone(),
                    })
                    .collect(),
            ),
            init_containers: (!pod.init_containers.is_empty()).then_some(pod.init_containers),
            containers: vec![pod.container],
            volumes: Some(pod.volumes),
            ..PodSpec::default()
        }),
    }
}

/// A function pod's annotations: Istio's proxy held until it is ready (Kyma's default, which
/// the user's annotations may override), then the user's, and with init containers (the
/// buildless install, the Git fetch) Istio's native sidecar: the proxy then starts before them,
/// so their downloads are not lost to a mesh redirect with no proxy behind it yet.
pub(super) fn pod_annotations(
    function: &Function,
    has_init_containers: bool,
) -> BTreeMap<String, String> {
    let mut annotations = BTreeMap::from([(
        "proxy.istio.io/config".to_owned(),
        r#"{ "holdApplicationUntilProxyStarts": true }"#.to_owned(),
    )]);
    annotations.extend(function.spec.pod_annotations());
    if has_init_containers {
        annotations.insert(
            "sidecar.istio.io/nativeSidecar".to_owned(),
            "true".to_owned(),
        );
    }
    annotations
}

/// What a buildless pod adds: its volumes and init containers.
pub(super) struct Buildless {
    volumes: Vec<Volume>,
    init_containers: Vec<Container>,
}

impl Buildless {
    /// Inline code without dependencies has nothing to install: the ConfigMap's handler is the
    /// `function` volume itself, and the pod starts its function container at once. An init
    /// container that only copied one file cost about two seconds of every start (its own
    /// start, then the kubelet noticing it had ended).
    fn handler_only(owned: &Owned<'_>, handler_file: &str) -> Self {
        Self {
            volumes: vec![Volume {
                name: "function".into(),
                config_map: Some(ConfigMapVolumeSource {
                    name: config_map_name(owned.name, &owned.hash),
                    items: Some(vec![KeyToPath {
                        key: handler_file.to_owned(),
                        path: handler_file.to_owned(),
                        ..KeyToPath::default()
                    }]),
                    ..ConfigMapVolumeSource::default()
                }),
                ..Volume::default()
            }],
            init_containers: Vec::new(),
        }
    }
}

/// A buildless pod's sources and install: inline code from the Function's ConfigMap (only its
/// handler and dependency files), a Git source fetched at its commit by the same init
/// container as an image build's; then the `install` init container, in the runtime image,
/// with the function's resources (the install runs where the function will).
pub(super) fn buildless_pod(
    owned: &Owned<'_>,
    function: &Function,
    config: &RenderConfig,
    image: &str,
    source: Source<'_>,
    env: &[EnvVar],
) -> Buildless {
    let files = runtimes::files(function.spec.runtime);
    if let Source::Inline(inline) = &source
        && inline.dependencies.trim().is_empty()
    {
        return Buildless::handler_only(owned, files.handler_file);
    }
    let var = |name: &str, value: &str| EnvVar {
        name: name.to_owned(),
        value: Some(value.to_owned()),
        ..EnvVar::default()
    };
    let mut volumes = vec![Volume {
        name: "function".into(),
        empty_dir: Some(EmptyDirVolumeSource {
            size_limit: Some(Quantity("1Gi".into())),
            ..EmptyDirVolumeSource::default()
        }),
        ..Volume::default()
    }];
    let mut init_containers = Vec::new();
    let sources = match source {
        Source::Inline(inline) => {
            let mut items = vec![KeyToPath {
                key: files.handler_file.to_owned(),
                path: files.handler_file.to_owned(),
                ..KeyToPath::default()
            }];
            if !inline.dependencies.trim().is_empty() {
                items.push(KeyToPath {
                    key: files.dependencies_file.to_owned(),
                    path: files.dependencies_file.to_owned(),
                    ..KeyToPath::default()
                });
            }
            volumes.push(Volume {
                name: "sources".into(),
                config_map: Some(ConfigMapVolumeSource {
                    name: config_map_name(owned.name, &owned.hash),
                    items: Some(items),
                    ..ConfigMapVolumeSource::default()
                }),
                ..Volume::default()
            });
            (
                VolumeMount {
                    name: "sources".into(),
                    mount_path: BUILDLESS_SOURCES.into(),
                    read_only: Some(true),
                    ..VolumeMount::default()
                },
                BUILDLESS_SOURCES.to_owned(),
            )
        }
        Source::Git { repository, commit } => {
            // The fetch lays the runtime's files (from the ConfigMap) over the checkout, as
            // for a build; the install copies them along, unused.
            volumes.push(Volume {
                name: "context".into(),
                config_map: Some(ConfigMapVolumeSource {
                    name: config_map_name(owned.name, &owned.hash),
                    ..ConfigMapVolumeSource::default()
                }),
                ..Volume::default()
            });
            volumes.extend(git_volumes(repository));
            init_containers.push(git_fetch_container(config, repository, commit));
            (
                VolumeMount {
                    name: "workspace".into(),
                    mount_path: WORKSPACE.into(),
                    read_only: Some(true),
                    ..VolumeMount::default()
                },
                format!("{WORKSPACE}/context"),
            )
        }
    };
    let (sources_mount, sources_dir) = sources;
    let mut install_env: Vec<EnvVar> = env
        .iter()
        .filter(|var| var.name == "FUNC_RUNTIME")
        .cloned()
        .collect();
    install_env.extend([
        var("EDDY_SOURCES", &sources_dir),
        var("FUNC_DIR", FUNCTION_DIR),
        var("EDDY_BUILD_HASH", &owned.hash),
        var("HOME", "/tmp"),
    ]);
    install_env.extend(config.egress.env());
    volumes.extend(config.egress.volume());
    // Only the install sees the registry's credentials, never the function's container.
    let registry_mount = owned.package_registry().map(|(volume, mount)| {
        volumes.push(volume);
        mount
    });
    let resources = function.spec.function_resources();
    init_containers.push(Container {
        name: "install".into(),
        image: Some(image.to_owned()),
        command: Some(vec![
            "/bin/sh".into(),
            "-c".into(),
            BUILDLESS_INSTALL_SCRIPT.into(),
        ]),
        env: Some(install_env),
        resources: Some(ResourceRequirements {
            requests: (!resources.requests.is_empty()).then_some(resources.requests),
            limits: (!resources.limits.is_empty()).then_some(resources.limits),
            ..ResourceRequirements::default()
        }),
        security_context: Some(hardened_container()),
        // npm's or pip's own error becomes the termination message, which the controller puts
        // into the Function's status (DependencyInstallFailed).
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        volume_mounts: Some(
            vec![
                sources_mount,
                VolumeMount {
                    name: "function".into(),
                    mount_path: FUNCTION_DIR.into(),
                    ..VolumeMount::default()
                },
                VolumeMount {
                    name: "tmp".into(),
                    mount_path: "/tmp".into(),
                    ..VolumeMount::default()
                },
            ]
            .into_iter()
            .chain(config.egress.mount(EGRESS_CA_DIR))
            .chain(registry_mount)
            .collect(),
        ),
        ..Container::default()
    });
    Buildless {
        volumes,
        init_containers,
    }
}

/// Port 80 of the function's pods, by name in the mesh; its pods selected by Kyma's four labels,
/// as Kyma's Function Service selects them.
pub(super) fn service(owned: &Owned<'_>) -> Service {
    Service {
        metadata: owned.metadata(owned.name, owned.labels()),
        spec: Some(ServiceSpec {
            selector: Some(owned.kyma_labels()),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: 80,
                target_port: Some(IntOrString::Int(FUNCTION_PORT)),
                protocol: Some("TCP".into()),
                app_protocol: Some("http".into()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// CPU-based scaling between the Function's bounds, when it has any.
pub(super) fn autoscaler(
    owned: &Owned<'_>,
    scaling: Scaling,
    target_cpu_utilization: i32,
) -> Option<HorizontalPodAutoscaler> {
    let Scaling::Autoscaled { min, max } = scaling else {
        return None;
    };
    Some(HorizontalPodAutoscaler {
        metadata: owned.metadata(owned.name, owned.labels()),
        spec: HorizontalPodAutoscalerSpec {
            scale_target_ref: CrossVersionObjectReference {
                api_version: Some("apps/v1".into()),
                kind: "Deployment".into(),
                name: owned.name.to_owned(),
            },
            min_replicas: Some(min),
            max_replicas: max,
            metrics: Some(vec![MetricSpec {
                type_: "Resource".into(),
                resource: Some(ResourceMetricSource {
                    name: "cpu".into(),
                    target: MetricTarget {
                        type_: "Utilization".into(),
                        average_utilization: Some(target_cpu_utilization),
                        ..MetricTarget::default()
                    },
                }),
                ..MetricSpec::default()
            }]),
            ..HorizontalPodAutoscalerSpec::default()
        },
        ..HorizontalPodAutoscaler::default()
    })
}
