//! What the Kubernetes backend creates for a Function, as pure functions of the Function and
//! the controller's settings: the ConfigMap with the build context, the build Job, the
//! Deployment, the Service and the HorizontalPodAutoscaler. `eddy controller render` prints
//! these, and the reconciler applies exactly these.

use std::collections::BTreeMap;

use eddy_model::resources::{
    BUILD_PROFILE_RESOURCES, DEFAULT_TIMEOUT_SECONDS, FUNC_TIMEOUT_ENV, Function,
    GitRepositorySource, InlineSource, PUBLISHER_PROXY_ADDRESS, RepositoryAuthType, Resources,
    Runtime,
};
use k8s_openapi::{
    api::{
        apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment},
        autoscaling::v2::{
            CrossVersionObjectReference, HorizontalPodAutoscaler, HorizontalPodAutoscalerSpec,
            MetricSpec, MetricTarget, ResourceMetricSource,
        },
        batch::v1::{Job, JobSpec},
        core::v1::{
            Capabilities, ConfigMap, ConfigMapKeySelector, ConfigMapVolumeSource, Container,
            ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource, ExecAction, HTTPGetAction,
            KeyToPath, Lifecycle, LifecycleHandler, LocalObjectReference, PodSecurityContext,
            PodSpec, PodTemplateSpec, Probe, ResourceRequirements, SeccompProfile,
            SecretKeySelector, SecretVolumeSource, SecurityContext, Service, ServicePort,
            ServiceSpec, Volume, VolumeMount,
        },
    },
    apimachinery::pkg::{
        api::resource::Quantity,
        apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference},
        util::intstr::IntOrString,
    },
};
use kube::{Resource as _, ResourceExt as _};

use crate::package_registry::PackageRegistry;
use crate::{Error, runtimes};

mod build;
mod pod_security;
mod workload;

pub use self::{build::GIT_FETCH_SCRIPT, pod_security::*};
use self::{build::*, workload::*};

/// The field manager of every server-side apply.
pub const FIELD_MANAGER: &str = "eddy-controller";
/// Label naming the Function an object belongs to.
pub use eddy_platform::scale::FUNCTION_LABEL;
/// Label carrying the build hash of a ConfigMap, a Job or a pod template.
pub const BUILD_HASH_LABEL: &str = "eddy.dev/build-hash";
/// The port function containers listen on.
pub const FUNCTION_PORT: i32 = 8080;
/// The default resource profile.
pub use eddy_model::resources::DEFAULT_PROFILE;
/// CPU utilization the HPA aims for by default, in percent of the request.
pub const TARGET_CPU_UTILIZATION: i32 = 50;

/// How a Function's code gets into its pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum BuildMode {
    /// No build and no registry: the pods run eddy's runtime image, take the sources from the
    /// Function's ConfigMap (or its Git commit) and install the dependencies when they start.
    #[default]
    Buildless,
    /// A build Job (Kaniko) makes an image per source and pushes it to the registry; the pods
    /// run it, dependencies included.
    Image,
}

/// The runtime image for `runtime` from `template` (`{runtime}`, `{version}`). Pure.
pub fn runtime_image(template: &str, runtime: eddy_model::resources::Runtime) -> String {
    template
        .replace("{runtime}", runtime.as_str())
        .replace("{version}", env!("CARGO_PKG_VERSION"))
}

/// Where the private package registry configuration is mounted for the dependency install
/// (the buildless `install` init container, the image build); the install script and the
/// runtime Dockerfiles read `.npmrc` and `pip.conf` there.
pub const PACKAGE_REGISTRY_DIR: &str = "/eddy/package-registry";

/// Where a buildless pod's sources are mounted, and where their install puts the function.
const BUILDLESS_SOURCES: &str = "/eddy/sources";
/// The function's directory in eddy's runtime images (`FUNC_DIR`).
const FUNCTION_DIR: &str = "/runtime/function";

/// The `install` init container of a buildless pod: the function's files into the `function`
/// volume, then its dependencies (npm or pip, as the image build does). It runs once per pod:
/// a restarted container finds them installed. POSIX sh; the runtime is in `FUNC_RUNTIME`.
pub const BUILDLESS_INSTALL_SCRIPT: &str = r#"set -eu
cp -RL "$EDDY_SOURCES/." "$FUNC_DIR/"
cd "$FUNC_DIR"
# A private registry's configuration (Kyma's serverless-package-registry-config), when mounted.
if [ -f /eddy/package-registry/.npmrc ]; then export NPM_CONFIG_USERCONFIG=/eddy/package-registry/.npmrc; fi
if [ -f /eddy/package-registry/pip.conf ]; then export PIP_CONFIG_FILE=/eddy/package-registry/pip.conf; fi
case "$FUNC_RUNTIME" in
  nodejs*)
    if [ -f package.json ]; then
      npm install --omit=dev --no-audit --no-fund --cache "${TMPDIR:-/tmp}/npm-cache"
    fi ;;
  python*)
    if [ -f requirements.txt ]; then
      /runtime/venv/bin/python -m pip install --no-cache-dir --target deps -r requirements.txt
    fi ;;
esac
echo "installed $EDDY_BUILD_HASH"
"#;

/// Settings of the Kubernetes backend that shape the objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderConfig {
    /// Registry (and optional path) images are pushed to and pulled from.
    pub registry: String,
    /// The image that builds function images (Kaniko's executor by default).
    pub builder_image: String,
    /// The image whose `git` fetches a Git source for its build (an init container).
    pub git_image: String,
    /// A `kubernetes.io/dockerconfigjson` Secret for pushing and pulling, in each namespace.
    pub registry_secret: Option<String>,
    /// Push over plain HTTP (an in-cluster registry without TLS).
    pub insecure_registry: bool,
    /// The event-bus publish URL given to functions as `PUBLISHER_PROXY_ADDRESS`.
    pub publisher_url: String,
    /// With Kyma's publisher address served (kymaCompatibility): what Kyma's Function
    /// controller sets, given to Kyma Functions instead of `publisher_url`.
    pub kyma_publisher_url: Option<String>,
    /// Longest a build may run.
    pub build_timeout_seconds: i64,
    /// CPU utilization an autoscaled Function's HPA aims for, in percent of the request.
    pub target_cpu_utilization: i32,
    /// Where functions send their spans (`TRACE_COLLECTOR_ENDPOINT`), while traces are on.
    pub trace_collector: Option<String>,
    /// Image builds, or buildless pods.
    pub build: BuildMode,
    /// The runtime images buildless pods run (`{runtime}`, `{version}` replaced).
    pub runtime_images: String,
    /// What a Function's own security contexts must meet.
    pub pod_security: PodSecurityLevel,
    /// How the containers that download while a Function is built get out.
    pub egress: Egress,
}

/// How the containers that reach the network while a Function is built (the buildless
/// `install`, the Git fetch, the image build) get out, as clusters behind a corporate proxy
/// need: through a forward proxy, trusting the CA certificates of a ConfigMap.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Egress {
    /// The forward proxy (`http://proxy.corp:3128`), given as HTTP_PROXY and HTTPS_PROXY.
    pub proxy: Option<String>,
    /// Hosts reached without the proxy (NO_PROXY), comma-separated.
    pub no_proxy: String,
    /// A ConfigMap in each function namespace whose key `ca.crt` is the CA bundle to trust:
    /// the public roots and the proxy's own, as one PEM file.
    pub ca_config_map: Option<String>,
}

/// Where [`Egress::ca_config_map`]'s bundle is mounted.
const EGRESS_CA_DIR: &str = "/etc/eddy/ca";

impl Egress {
    /// The proxy and CA variables npm, pip, git and Kaniko read (both spellings of the proxy
    /// ones: tools disagree on which they read).
    fn env(&self) -> Vec<EnvVar> {
        let var = |name: &str, value: &str| EnvVar {
            name: name.to_owned(),
            value: Some(value.to_owned()),
            ..EnvVar::default()
        };
        let mut env = Vec::new();
        if let Some(proxy) = &self.proxy {
            for name in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
                env.push(var(name, proxy));
            }
            for name in ["NO_PROXY", "no_proxy"] {
                env.push(var(name, &self.no_proxy));
            }
        }
        if self.ca_config_map.is_some() {
            let bundle = format!("{EGRESS_CA_DIR}/ca.crt");
            for name in [
                "SSL_CERT_FILE",
                "NODE_EXTRA_CA_CERTS",
                "PIP_CERT",
                "REQUESTS_CA_BUNDLE",
                "GIT_SSL_CAINFO",
            ] {
                env.push(var(name, &bundle));
            }
        }
        env
    }

    /// The CA bundle's volume, when there is one.
    fn volume(&self) -> Option<Volume> {
        let name = self.ca_config_map.as_ref()?;
        Some(Volume {
            name: "egress-ca".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: name.clone(),
                items: Some(vec![KeyToPath {
                    key: "ca.crt".into(),
                    path: "ca.crt".into(),
                    ..KeyToPath::default()
                }]),
                ..ConfigMapVolumeSource::default()
            }),
            ..Volume::default()
        })
    }

    /// The CA bundle's mount at `dir`, when there is one.
    fn mount(&self, dir: &'static str) -> Option<VolumeMount> {
        self.ca_config_map.as_ref()?;
        Some(VolumeMount {
            name: "egress-ca".into(),
            mount_path: dir.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        })
    }
}

/// Everything the controller creates for one Function.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// The build key of the Function's code.
    pub hash: String,
    /// The image the Deployment runs: the build's (image mode) or the runtime's (buildless).
    pub image: String,
    /// Build context: Dockerfile, runtime server, handler, dependencies.
    pub config_map: ConfigMap,
    /// The build (image mode only: a buildless Function has none).
    pub job: Job,
    /// How the code gets into the pods.
    pub build: BuildMode,
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

/// The label selector of a function's pods, as `status.podSelector` gives it to an HPA.
pub fn pod_selector(function: &str) -> String {
    format!("{FUNCTION_LABEL}={function}")
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
/// `minReplicas: 0` is left to eddy's own scaling instead (`eddy_platform::scale`).
pub fn scaling(function: &Function) -> Scaling {
    let (min, max) = function.spec.replica_bounds();
    let on_backlog = function.scale_on() == Some(eddy_platform::scale::SCALE_ON_BACKLOG);
    if max > min && (min <= 0 || on_backlog) {
        Scaling::ByEddy {
            min: min.max(0),
            max,
        }
    } else if max > min {
        Scaling::Autoscaled { min, max }
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
    /// Between min and max, left to eddy's scaling (the Deployment does not set replicas):
    /// raised by the Subscriptions' pending events. With a minimum of zero, woken by the
    /// gateway and the dispatcher and back to zero when idle (an HPA cannot scale to zero);
    /// with one or more, instead of an HPA on CPU (`eddy.dev/scale-on: backlog`).
    ByEddy {
        /// Fewest pods: zero or more.
        min: i32,
        /// Most pods.
        max: i32,
    },
}

/// The user's security context merged over eddy's hardened defaults: every field the user
/// sets wins (weaker only where they ask), every other keeps eddy's value. Pure.
pub fn over_defaults<T: k8s_openapi::DeepMerge + Clone>(defaults: T, user: Option<&T>) -> T {
    let mut merged = defaults;
    if let Some(user) = user {
        merged.merge_from(user.clone());
    }
    merged
}

/// Requests and limits of the build container: the build profile's, the explicit ones, or
/// eddy's default (a quarter core and 512 MiB requested, 2 GiB at most: enough for Kaniko to
/// install a typical dependency tree without reserving much of a node).
pub fn build_resources(function: &Function) -> Resources {
    let request = function
        .spec
        .resource_configuration
        .as_ref()
        .and_then(|r| r.build.as_ref());
    if let Some(explicit) = request.and_then(|r| r.resources.clone()) {
        return explicit;
    }
    let preset = request
        .and_then(|r| r.profile.as_deref())
        .and_then(|profile| BUILD_PROFILE_RESOURCES.iter().find(|p| p.0 == profile));
    match preset {
        Some(&preset) => eddy_model::resources::preset_resources(preset),
        None => Resources {
            requests: quantities([("cpu", "250m"), ("memory", "512Mi")]),
            limits: quantities([("memory", "2Gi")]),
        },
    }
}

fn owner_reference(function: &Function) -> Result<OwnerReference, Error> {
    let mut owner = function
        .controller_owner_ref(&())
        .ok_or(Error::Incomplete("uid"))?;
    // A Kyma Function owns its objects itself, so deleting it deletes them.
    if let Some(kyma) = eddy_model::kyma::stored_as(&function.metadata) {
        owner.api_version = kyma.api_version;
        owner.kind = kyma.kind;
    }
    // Foreground deletion of the Function waits for its objects.
    owner.block_owner_deletion = Some(true);
    Ok(owner)
}

/// What every object of one Function shares: in its namespace, labelled, owned by it.
struct Owned<'a> {
    name: &'a str,
    namespace: String,
    owner: OwnerReference,
    hash: String,
    /// The Secret of the namespace holding the private package registry configuration the
    /// dependency install reads, when one applies.
    package_registry: Option<&'a str>,
}

impl Owned<'_> {
    /// The private registry's volume and its read-only mount, for what installs dependencies.
    fn package_registry(&self) -> Option<(Volume, VolumeMount)> {
        let secret = self.package_registry?;
        Some((
            Volume {
                name: "package-registry".into(),
                secret: Some(SecretVolumeSource {
                    secret_name: Some(secret.to_owned()),
                    // A Secret deleted since leaves the install without it, as on Kyma.
                    optional: Some(true),
                    ..SecretVolumeSource::default()
                }),
                ..Volume::default()
            },
            VolumeMount {
                name: "package-registry".into(),
                mount_path: PACKAGE_REGISTRY_DIR.into(),
                read_only: Some(true),
                ..VolumeMount::default()
            },
        ))
    }
}

impl Owned<'_> {
    /// The labels of the function's own objects.
    fn labels(&self) -> BTreeMap<String, String> {
        labels([
            ("app.kubernetes.io/name", self.name),
            ("app.kubernetes.io/component", "function"),
            ("app.kubernetes.io/managed-by", "eddy"),
            (FUNCTION_LABEL, self.name),
        ])
    }

    /// The labels Kyma gives a Function's pods, which its Service selects them by.
    fn kyma_labels(&self) -> BTreeMap<String, String> {
        eddy_model::kyma::pod_labels(self.name, &self.owner.uid)
            .into_iter()
            .map(|(name, value)| (name.to_owned(), value))
            .collect()
    }

    /// The labels of build objects (the ConfigMap, the Job and its pod).
    fn build_labels(&self) -> BTreeMap<String, String> {
        let mut labels = self.labels();
        labels.insert("app.kubernetes.io/component".into(), "build".into());
        labels.insert(BUILD_HASH_LABEL.into(), self.hash.clone());
        labels
    }

    fn metadata(&self, object: &str, labels: BTreeMap<String, String>) -> ObjectMeta {
        ObjectMeta {
            name: Some(object.to_owned()),
            namespace: Some(self.namespace.clone()),
            labels: Some(labels),
            owner_references: Some(vec![self.owner.clone()]),
            ..ObjectMeta::default()
        }
    }
}

fn labels<const N: usize>(pairs: [(&str, &str); N]) -> BTreeMap<String, String> {
    pairs
        .into_iter()
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .collect()
}

/// Where a Function's code comes from, as its build sees it.
#[derive(Debug, Clone, Copy)]
pub enum Source<'a> {
    /// Code and dependencies in the spec.
    Inline(&'a InlineSource),
    /// A directory of a repository at a commit (the reference resolved by the controller).
    Git {
        /// The spec's `source.gitRepository`.
        repository: &'a GitRepositorySource,
        /// The commit its reference names now.
        commit: &'a str,
    },
}

/// Renders every object for an inline-source `function` (a Git source needs its commit:
/// [`render_at`]).
pub fn render(function: &Function, config: &RenderConfig) -> Result<Rendered, Error> {
    render_at(function, config, None)
}

/// Renders every object for `function`; a Git source is built at `commit`.
pub fn render_at(
    function: &Function,
    config: &RenderConfig,
    commit: Option<&str>,
) -> Result<Rendered, Error> {
    render_with(function, config, commit, None)
}

/// Whether building `function` may install dependencies: inline code with some, or a Git
/// source (whose files are known only when fetched). Pure.
pub fn may_install(function: &Function) -> bool {
    match &function.spec.source.inline {
        Some(inline) => !inline.dependencies.trim().is_empty(),
        None => function.spec.source.git_repository.is_some(),
    }
}

/// [`render_at`], its dependencies installed with `registry`'s configuration (its Secret
/// mounted where they are installed, its contents part of the build key).
pub fn render_with(
    function: &Function,
    config: &RenderConfig,
    commit: Option<&str>,
    registry: Option<&PackageRegistry>,
) -> Result<Rendered, Error> {
    let name = function
        .metadata
        .name
        .as_deref()
        .ok_or(Error::Incomplete("name"))?;
    let namespace = function.namespace().ok_or(Error::Incomplete("namespace"))?;
    let source = match (
        &function.spec.source.inline,
        &function.spec.source.git_repository,
    ) {
        (Some(inline), _) => Source::Inline(inline),
        (None, Some(repository)) => Source::Git {
            repository,
            commit: commit.ok_or(Error::Incomplete(
                "the commit spec.source.gitRepository.reference names",
            ))?,
        },
        (None, None) => return Err(Error::Incomplete("spec.source")),
    };
    let runtime = function.spec.runtime;
    let hash = match source {
        Source::Inline(inline) => {
            runtimes::build_hash(runtime, &inline.source, &inline.dependencies)
        }
        Source::Git { repository, commit } => runtimes::build_hash(
            runtime,
            &format!(
                "git {} {commit} {}",
                repository.url,
                git_base_dir(repository)
            ),
            "",
        ),
    };
    let registry = registry.filter(|_| may_install(function));
    let hash = registry.map_or(hash.clone(), |registry| registry.keyed(&hash));
    let image = match config.build {
        BuildMode::Image => image(&config.registry, &namespace, name, &hash),
        BuildMode::Buildless => runtime_image(&config.runtime_images, runtime),
    };
    let owned = Owned {
        name,
        namespace,
        owner: owner_reference(function)?,
        hash,
        package_registry: registry.map(|registry| registry.name.as_str()),
    };
    let scaling = scaling(function);
    Ok(Rendered {
        config_map: build_context(&owned, function, source),
        job: build_job(
            &owned,
            config,
            &image,
            runtime,
            build_resources(function),
            source,
        ),
        deployment: deployment(&owned, function, config, &image, scaling, source),
        service: service(&owned),
        autoscaler: autoscaler(&owned, scaling, config.target_cpu_utilization),
        hash: owned.hash,
        image,
        build: config.build,
    })
}

/// The function's directory in its repository, without leading or trailing `/` ("" for the
/// top). Pure.
pub fn git_base_dir(repository: &GitRepositorySource) -> &str {
    repository
        .base_dir
        .as_deref()
        .unwrap_or("")
        .trim_matches('/')
}

impl Rendered {
    /// Where the pods' security contexts (eddy's defaults with the Function's over them) break
    /// `level`; none when the Deployment has no pod template yet. Pure.
    pub fn pod_security_violations(&self, level: PodSecurityLevel) -> Vec<String> {
        let Some(pod) = self.deployment.spec.template.spec.as_ref() else {
            return Vec::new();
        };
        let Some(container) = pod.containers.iter().find(|c| c.name == "function") else {
            return Vec::new();
        };
        pod_security_violations(
            &pod.security_context.clone().unwrap_or_default(),
            &container.security_context.clone().unwrap_or_default(),
            level,
        )
    }

    /// Every object as one multi-document YAML text, in the order they are created.
    pub fn to_yaml(&self) -> Result<String, serde_yaml_ng::Error> {
        let mut out = String::new();
        let mut push = |yaml: String| {
            out.push_str("---\n");
            out.push_str(&yaml);
        };
        push(serde_yaml_ng::to_string(&self.config_map)?);
        if self.build == BuildMode::Image {
            push(serde_yaml_ng::to_string(&self.job)?);
        }
        push(serde_yaml_ng::to_string(&self.deployment)?);
        push(serde_yaml_ng::to_string(&self.service)?);
        if let Some(autoscaler) = &self.autoscaler {
            push(serde_yaml_ng::to_string(autoscaler)?);
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
