//! What the Kubernetes backend creates for a Function, as pure functions of the Function and
//! the controller's settings: the ConfigMap with the build context, the build Job, the
//! Deployment, the Service and the HorizontalPodAutoscaler. `eddy controller render` prints
//! these, and the reconciler applies exactly these.

use std::collections::BTreeMap;

use eddy_model::resources::{DEFAULT_TIMEOUT_SECONDS, Function, PROFILES, Resources};
use k8s_openapi::{
    api::{
        apps::v1::Deployment, autoscaling::v2::HorizontalPodAutoscaler, batch::v1::Job,
        core::v1::ConfigMap, core::v1::Service,
    },
    apimachinery::pkg::apis::meta::v1::OwnerReference,
};
use kube::{Resource as _, ResourceExt as _};
use serde_json::{Value, json};

use crate::{Error, runtimes};

/// The field manager of every server-side apply.
pub const FIELD_MANAGER: &str = "eddy-controller";
/// Label naming the Function an object belongs to.
pub const FUNCTION_LABEL: &str = "eddy.dev/function";
/// Label carrying the build hash of a ConfigMap, a Job or a pod template.
pub const BUILD_HASH_LABEL: &str = "eddy.dev/build-hash";
/// The port function containers listen on.
pub const FUNCTION_PORT: i32 = 8080;
/// The default resource profile.
pub const DEFAULT_PROFILE: &str = "S";
/// CPU utilization the HPA aims for, in percent of the request.
pub const TARGET_CPU_UTILIZATION: i32 = 50;

/// Settings of the Kubernetes backend that shape the objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderConfig {
    /// Registry (and optional path) images are pushed to and pulled from.
    pub registry: String,
    /// The image that builds function images (Kaniko's executor by default).
    pub builder_image: String,
    /// A `kubernetes.io/dockerconfigjson` Secret for pushing and pulling, in each namespace.
    pub registry_secret: Option<String>,
    /// Push over plain HTTP (an in-cluster registry without TLS).
    pub insecure_registry: bool,
    /// The event-bus publish URL given to functions as `PUBLISHER_PROXY_ADDRESS`.
    pub publisher_url: String,
    /// Longest a build may run.
    pub build_timeout_seconds: i64,
}

/// Everything the controller creates for one Function.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// The build key of the Function's code.
    pub hash: String,
    /// The image the build pushes and the Deployment runs.
    pub image: String,
    /// Build context: Dockerfile, runtime server, handler, dependencies.
    pub config_map: ConfigMap,
    /// The build.
    pub job: Job,
    /// The function's pods.
    pub deployment: Deployment,
    /// Port 80 → 8080.
    pub service: Service,
    /// Present when the Function autoscales (maxReplicas > minReplicas).
    pub autoscaler: Option<HorizontalPodAutoscaler>,
}

/// The ConfigMap holding a build's context.
pub fn config_map_name(function: &str, hash: &str) -> String {
    format!("{}-{hash}", truncate(function, 40))
}

/// The build Job of a build (at most 63 characters: Job names become label values).
pub fn job_name(function: &str, hash: &str) -> String {
    format!("{}-build-{hash}", truncate(function, 35))
}

/// The image a build pushes: `<registry>/<namespace>-<function>:<hash>`.
pub fn image(registry: &str, namespace: &str, function: &str, hash: &str) -> String {
    format!(
        "{}/{namespace}-{function}:{hash}",
        registry.trim_end_matches('/')
    )
}

/// The in-cluster URL of a function.
pub fn function_url(namespace: &str, function: &str) -> String {
    format!("http://{function}.{namespace}.svc.cluster.local")
}

fn truncate(name: &str, max: usize) -> &str {
    // Names are DNS labels (ASCII), so any byte index is a char boundary; no trailing '-'.
    name[..name.len().min(max)].trim_end_matches('-')
}

/// The Deployment's replica count and the HPA's bounds, from the Function's scaling fields.
/// An HPA cannot scale to zero (that needs the alpha `HPAScaleToZero` gate), so an autoscaled
/// `minReplicas: 0` keeps one replica on Kubernetes.
pub fn scaling(function: &Function) -> Scaling {
    let (min, max) = function.spec.replica_bounds();
    if max > min {
        Scaling::Autoscaled {
            min: min.max(1),
            max,
        }
    } else {
        Scaling::Fixed(min)
    }
}

/// How a Function's pods are counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scaling {
    /// A fixed count, set on the Deployment.
    Fixed(i32),
    /// Between min and max, left to the HPA (the Deployment does not set replicas, so the two
    /// never fight over the field).
    Autoscaled {
        /// Fewest pods.
        min: i32,
        /// Most pods.
        max: i32,
    },
}

/// Requests and limits of the function container: the profile's, or the explicit ones.
pub fn container_resources(function: &Function) -> Resources {
    let request = function
        .spec
        .resource_configuration
        .as_ref()
        .and_then(|r| r.function.as_ref());
    if let Some(explicit) = request.and_then(|r| r.resources.clone()) {
        return explicit;
    }
    let profile = request
        .and_then(|r| r.profile.as_deref())
        .unwrap_or(DEFAULT_PROFILE);
    let (_, cpu_request, memory_request, cpu_limit, memory_limit) = PROFILES
        .iter()
        .copied()
        .find(|p| p.0 == profile)
        .unwrap_or(PROFILES[1]);
    let quantity = |q: &str| k8s_openapi::apimachinery::pkg::api::resource::Quantity(q.to_owned());
    Resources {
        requests: BTreeMap::from([
            ("cpu".to_owned(), quantity(cpu_request)),
            ("memory".to_owned(), quantity(memory_request)),
        ]),
        limits: BTreeMap::from([
            ("cpu".to_owned(), quantity(cpu_limit)),
            ("memory".to_owned(), quantity(memory_limit)),
        ]),
    }
}

fn owner_reference(function: &Function) -> Result<OwnerReference, Error> {
    let mut owner = function
        .controller_owner_ref(&())
        .ok_or(Error::Incomplete("uid"))?;
    // Foreground deletion of the Function waits for its objects.
    owner.block_owner_deletion = Some(true);
    Ok(owner)
}

fn typed<T: serde::de::DeserializeOwned>(kind: &'static str, value: Value) -> Result<T, Error> {
    serde_json::from_value(value).map_err(|source| Error::Render { kind, source })
}

/// Renders every object for `function`.
pub fn render(function: &Function, config: &RenderConfig) -> Result<Rendered, Error> {
    let name = function
        .metadata
        .name
        .as_deref()
        .ok_or(Error::Incomplete("name"))?;
    let namespace = function.namespace().ok_or(Error::Incomplete("namespace"))?;
    let owner =
        serde_json::to_value(owner_reference(function)?).map_err(|source| Error::Render {
            kind: "owner reference",
            source,
        })?;
    let inline = function
        .spec
        .source
        .inline
        .as_ref()
        .ok_or(Error::Incomplete("spec.source.inline"))?;
    let runtime = function.spec.runtime;
    let files = runtimes::files(runtime);
    let hash = runtimes::build_hash(runtime, &inline.source, &inline.dependencies);
    let image = image(&config.registry, &namespace, name, &hash);
    let labels = json!({
        "app.kubernetes.io/name": name,
        "app.kubernetes.io/component": "function",
        "app.kubernetes.io/managed-by": "eddy",
        FUNCTION_LABEL: name,
    });
    let build_labels = {
        let mut labels = labels.clone();
        labels["app.kubernetes.io/component"] = json!("build");
        labels[BUILD_HASH_LABEL] = json!(hash);
        labels
    };

    // Every object: in the Function's namespace, labelled, owned by the Function.
    let metadata = |object: &str, labels: &Value| {
        json!({
            "name": object, "namespace": namespace,
            "labels": labels, "ownerReferences": [owner],
        })
    };

    let mut data = serde_json::Map::new();
    data.insert("Dockerfile".into(), json!(files.dockerfile));
    data.insert(files.server_file.into(), json!(files.server));
    data.insert(files.handler_file.into(), json!(inline.source));
    if !inline.dependencies.trim().is_empty() {
        data.insert(files.dependencies_file.into(), json!(inline.dependencies));
    }
    let config_map_name = config_map_name(name, &hash);
    let config_map: ConfigMap = typed(
        "ConfigMap",
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": metadata(&config_map_name, &build_labels),
            "data": data,
        }),
    )?;

    let mut builder_args = vec![
        json!("--context=dir:///workspace"),
        json!("--dockerfile=/workspace/Dockerfile"),
        json!(format!("--destination={image}")),
        json!("--snapshot-mode=redo"),
        json!("--use-new-run"),
    ];
    if config.insecure_registry {
        builder_args.push(json!("--insecure"));
        builder_args.push(json!("--skip-tls-verify"));
    }
    let mut builder_mounts =
        vec![json!({"name": "context", "mountPath": "/workspace", "readOnly": true})];
    let mut builder_volumes =
        vec![json!({"name": "context", "configMap": {"name": config_map_name}})];
    if let Some(secret) = &config.registry_secret {
        builder_mounts
            .push(json!({"name": "registry", "mountPath": "/kaniko/.docker", "readOnly": true}));
        builder_volumes.push(json!({
            "name": "registry",
            "secret": {"secretName": secret, "items": [{"key": ".dockerconfigjson", "path": "config.json"}]},
        }));
    }
    let job: Job = typed(
        "Job",
        json!({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": metadata(&job_name(name, &hash), &build_labels),
            "spec": {
                // A build of the same inputs fails the same way: one attempt, and the
                // failure goes to status instead of a retry loop.
                "backoffLimit": 0,
                "activeDeadlineSeconds": config.build_timeout_seconds,
                "template": {
                    "metadata": {
                        "labels": build_labels,
                        // A sidecar would keep the Job's pod running after the build.
                        "annotations": {"sidecar.istio.io/inject": "false"},
                    },
                    "spec": {
                        "restartPolicy": "Never",
                        "automountServiceAccountToken": false,
                        "containers": [{
                            "name": "build",
                            "image": config.builder_image,
                            "args": builder_args,
                            // The build log's tail becomes the container's termination
                            // message, which the controller puts into BuildReady.
                            "terminationMessagePolicy": "FallbackToLogsOnError",
                            "volumeMounts": builder_mounts,
                            "resources": {
                                "requests": {"cpu": "250m", "memory": "512Mi"},
                                "limits": {"memory": "2Gi"},
                            },
                        }],
                        "volumes": builder_volumes,
                    },
                },
            },
        }),
    )?;

    let timeout = function
        .spec
        .timeout_seconds
        .unwrap_or(DEFAULT_TIMEOUT_SECONDS);
    let mut env = vec![
        json!({"name": "FUNC_NAME", "value": name}),
        json!({"name": "FUNC_NAMESPACE", "value": namespace}),
        json!({"name": "FUNC_RUNTIME", "value": runtime.as_str()}),
        json!({"name": "FUNC_PORT", "value": FUNCTION_PORT.to_string()}),
        json!({"name": "FUNC_TIMEOUT", "value": timeout.to_string()}),
        json!({"name": "PUBLISHER_PROXY_ADDRESS", "value": config.publisher_url}),
    ];
    env.extend(
        function
            .spec
            .env
            .iter()
            .map(|var| json!({"name": var.name, "value": var.value})),
    );
    let scaling = scaling(function);
    let mut pod_labels = labels.clone();
    pod_labels[BUILD_HASH_LABEL] = json!(hash);
    pod_labels["sidecar.istio.io/inject"] = json!("true");
    let mut deployment_spec = json!({
        "selector": {"matchLabels": {FUNCTION_LABEL: name}},
        // New pods must be ready before old ones go: an update drops no request.
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": "25%"}},
        "revisionHistoryLimit": 3,
        "template": {
            "metadata": {"labels": pod_labels},
            "spec": {
                "automountServiceAccountToken": false,
                "enableServiceLinks": false,
                "terminationGracePeriodSeconds": i64::from(timeout.min(300)) + 5,
                "securityContext": {
                    "runAsNonRoot": true,
                    "runAsUser": 1000,
                    "runAsGroup": 1000,
                    "fsGroup": 1000,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
                "imagePullSecrets": config.registry_secret.iter().map(|s| json!({"name": s})).collect::<Vec<_>>(),
                "containers": [{
                    "name": "function",
                    "image": image,
                    "ports": [{"name": "http", "containerPort": FUNCTION_PORT, "protocol": "TCP"}],
                    "env": env,
                    "resources": container_resources(function),
                    "securityContext": {
                        "runAsNonRoot": true,
                        "allowPrivilegeEscalation": false,
                        "privileged": false,
                        "readOnlyRootFilesystem": true,
                        "capabilities": {"drop": ["ALL"]},
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "readinessProbe": {
                        "httpGet": {"path": "/healthz", "port": FUNCTION_PORT},
                        "periodSeconds": 2, "failureThreshold": 2,
                    },
                    "livenessProbe": {
                        "httpGet": {"path": "/healthz", "port": FUNCTION_PORT},
                        "periodSeconds": 10, "failureThreshold": 3, "timeoutSeconds": 2,
                    },
                    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                }],
                "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}],
            },
        },
    });
    if let Scaling::Fixed(replicas) = scaling {
        deployment_spec["replicas"] = json!(replicas);
    }
    let deployment: Deployment = typed(
        "Deployment",
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": metadata(name, &labels),
            "spec": deployment_spec,
        }),
    )?;

    let service: Service = typed(
        "Service",
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": metadata(name, &labels),
            "spec": {
                "selector": {FUNCTION_LABEL: name},
                "ports": [{"name": "http", "port": 80, "targetPort": FUNCTION_PORT, "protocol": "TCP", "appProtocol": "http"}],
            },
        }),
    )?;

    let autoscaler = match scaling {
        Scaling::Fixed(_) => None,
        Scaling::Autoscaled { min, max } => Some(typed(
            "HorizontalPodAutoscaler",
            json!({
                "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                "metadata": metadata(name, &labels),
                "spec": {
                    "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                    "minReplicas": min,
                    "maxReplicas": max,
                    "metrics": [{
                        "type": "Resource",
                        "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": TARGET_CPU_UTILIZATION}},
                    }],
                },
            }),
        )?),
    };

    Ok(Rendered {
        hash,
        image,
        config_map,
        job,
        deployment,
        service,
        autoscaler,
    })
}

impl Rendered {
    /// Every object as one multi-document YAML text, in the order they are created.
    pub fn to_yaml(&self) -> Result<String, serde_yaml::Error> {
        let mut out = String::new();
        let mut push = |yaml: String| {
            out.push_str("---\n");
            out.push_str(&yaml);
        };
        push(serde_yaml::to_string(&self.config_map)?);
        push(serde_yaml::to_string(&self.job)?);
        push(serde_yaml::to_string(&self.deployment)?);
        push(serde_yaml::to_string(&self.service)?);
        if let Some(autoscaler) = &self.autoscaler {
            push(serde_yaml::to_string(autoscaler)?);
        }
        Ok(out)
    }
}

/// A Function as read from a manifest, given what the API server would add (a namespace and a
/// uid), so it can be rendered without a cluster.
pub fn as_if_stored(mut function: Function) -> Function {
    if function.metadata.namespace.is_none() {
        function.metadata.namespace = Some("default".to_owned());
    }
    if function.metadata.uid.is_none() {
        function.metadata.uid = Some("00000000-0000-0000-0000-000000000000".to_owned());
    }
    function
}
