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
            ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource, HTTPGetAction, KeyToPath,
            LocalObjectReference, PodSecurityContext, PodSpec, PodTemplateSpec, Probe,
            ResourceRequirements, SeccompProfile, SecretKeySelector, SecretVolumeSource,
            SecurityContext, Service, ServicePort, ServiceSpec, Volume, VolumeMount,
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

/// The field manager of every server-side apply.
pub const FIELD_MANAGER: &str = "eddy-controller";
/// Label naming the Function an object belongs to.
pub const FUNCTION_LABEL: &str = "eddy.dev/function";
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

/// The Pod Security Standards level a Function's own security contexts (`podSecurityContext`,
/// `containerSecurityContext`) must meet: what the operator lets Function authors ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PodSecurityLevel {
    /// Kubernetes' `restricted` profile (the default): non-root, no privilege escalation, no
    /// capability beyond `NET_BIND_SERVICE`, every other one dropped, a confined seccomp profile.
    Restricted,
    /// Kubernetes' `baseline` profile: no privileged container, only the default capabilities,
    /// no unconfined seccomp or AppArmor, no custom `procMount` or SELinux user or role.
    Baseline,
    /// Anything the API server takes.
    Privileged,
}

/// Capabilities the `baseline` profile allows to be added.
const BASELINE_CAPABILITIES: [&str; 13] = [
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
];

/// Where the function's pod breaks `level`, each naming the Function's field; judged on what
/// the pods would run (eddy's defaults with the Function's contexts over them), as the
/// Pod Security admission would judge it. Pure.
pub fn pod_security_violations(
    pod: &PodSecurityContext,
    container: &SecurityContext,
    level: PodSecurityLevel,
) -> Vec<String> {
    let mut violations = Vec::new();
    if level == PodSecurityLevel::Privileged {
        return violations;
    }
    let profile = match level {
        PodSecurityLevel::Restricted => "restricted",
        _ => "baseline",
    };
    let mut refuse = |field: &str, why: &str| {
        violations.push(format!(
            "{field}: {why} (the {profile} Pod Security profile the operator set)"
        ));
    };
    const POD: &str = "spec.podSecurityContext";
    const CONTAINER: &str = "spec.containerSecurityContext";
    // Baseline, and so restricted too.
    if container.privileged == Some(true) {
        refuse(&format!("{CONTAINER}.privileged"), "must not be true");
    }
    let added = container
        .capabilities
        .as_ref()
        .and_then(|c| c.add.as_deref())
        .unwrap_or_default();
    for capability in added {
        let name = capability.trim_start_matches("CAP_");
        let allowed = match level {
            PodSecurityLevel::Restricted => name == "NET_BIND_SERVICE",
            _ => BASELINE_CAPABILITIES.contains(&name),
        };
        if !allowed {
            refuse(
                &format!("{CONTAINER}.capabilities.add"),
                &format!("{capability} may not be added"),
            );
        }
    }
    if container
        .proc_mount
        .as_deref()
        .is_some_and(|m| m != "Default")
    {
        refuse(&format!("{CONTAINER}.procMount"), "must be Default");
    }
    let unconfined = |profile: Option<&str>| profile == Some("Unconfined");
    for (field, seccomp) in [
        (POD, pod.seccomp_profile.as_ref()),
        (CONTAINER, container.seccomp_profile.as_ref()),
    ] {
        if unconfined(seccomp.map(|p| p.type_.as_str())) {
            refuse(
                &format!("{field}.seccompProfile.type"),
                "must not be Unconfined",
            );
        }
    }
    for (field, apparmor) in [
        (POD, pod.app_armor_profile.as_ref()),
        (CONTAINER, container.app_armor_profile.as_ref()),
    ] {
        if unconfined(apparmor.map(|p| p.type_.as_str())) {
            refuse(
                &format!("{field}.appArmorProfile.type"),
                "must not be Unconfined",
            );
        }
    }
    for (field, selinux) in [
        (POD, pod.se_linux_options.as_ref()),
        (CONTAINER, container.se_linux_options.as_ref()),
    ] {
        let Some(selinux) = selinux else { continue };
        if selinux.type_.as_deref().is_some_and(|t| {
            ![
                "",
                "container_t",
                "container_init_t",
                "container_kvm_t",
                "container_engine_t",
            ]
            .contains(&t)
        }) {
            refuse(
                &format!("{field}.seLinuxOptions.type"),
                "is not a container type",
            );
        }
        if selinux.user.as_deref().is_some_and(|u| !u.is_empty())
            || selinux.role.as_deref().is_some_and(|r| !r.is_empty())
        {
            refuse(
                &format!("{field}.seLinuxOptions"),
                "must not set user or role",
            );
        }
    }
    if pod.sysctls.as_ref().is_some_and(|s| !s.is_empty()) {
        refuse(&format!("{POD}.sysctls"), "must not be set");
    }
    for (field, windows) in [
        (POD, pod.windows_options.as_ref()),
        (CONTAINER, container.windows_options.as_ref()),
    ] {
        if windows.and_then(|w| w.host_process) == Some(true) {
            refuse(
                &format!("{field}.windowsOptions.hostProcess"),
                "must not be true",
            );
        }
    }
    if level == PodSecurityLevel::Baseline {
        return violations;
    }
    // Restricted.
    if container.allow_privilege_escalation != Some(false) {
        refuse(
            &format!("{CONTAINER}.allowPrivilegeEscalation"),
            "must be false",
        );
    }
    let non_root = container.run_as_non_root.or(pod.run_as_non_root);
    if non_root != Some(true) {
        let field = if container.run_as_non_root.is_some() {
            CONTAINER
        } else {
            POD
        };
        refuse(&format!("{field}.runAsNonRoot"), "must be true");
    }
    for (field, user) in [(POD, pod.run_as_user), (CONTAINER, container.run_as_user)] {
        if user == Some(0) {
            refuse(&format!("{field}.runAsUser"), "must not be 0");
        }
    }
    let dropped = container
        .capabilities
        .as_ref()
        .and_then(|c| c.drop.as_deref())
        .unwrap_or_default();
    if !dropped.iter().any(|c| c == "ALL") {
        refuse(
            &format!("{CONTAINER}.capabilities.drop"),
            "must include ALL",
        );
    }
    let confined = |profile: Option<&str>| matches!(profile, Some("RuntimeDefault" | "Localhost"));
    let seccomp = container
        .seccomp_profile
        .as_ref()
        .or(pod.seccomp_profile.as_ref())
        .map(|p| p.type_.as_str());
    if !confined(seccomp) {
        refuse(
            &format!("{CONTAINER}.seccompProfile.type"),
            "must be RuntimeDefault or Localhost",
        );
    }
    violations
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

/// The ConfigMap with the build context: Dockerfile, runtime server and, for inline code,
/// handler and dependencies (a Git source's come from the repository).
fn build_context(owned: &Owned<'_>, function: &Function, source: Source<'_>) -> ConfigMap {
    let files = runtimes::files(function.spec.runtime);
    let mut data = BTreeMap::from([
        ("Dockerfile".to_owned(), files.dockerfile.to_owned()),
        (files.server_file.to_owned(), files.server.to_owned()),
    ]);
    for (name, contents) in files.libraries {
        data.insert(format!("runtime-{name}"), (*contents).to_owned());
    }
    if let Source::Inline(inline) = source {
        data.insert(files.handler_file.to_owned(), inline.source.clone());
        if !inline.dependencies.trim().is_empty() {
            data.insert(
                files.dependencies_file.to_owned(),
                inline.dependencies.clone(),
            );
        }
    }
    ConfigMap {
        metadata: owned.metadata(
            &config_map_name(owned.name, &owned.hash),
            owned.build_labels(),
        ),
        data: Some(data),
        ..ConfigMap::default()
    }
}

/// The shell script of a Git build's `source` init container: fetches the commit (shallow
/// where the server allows it), then lays out the build context: the base directory's files
/// with the runtime's from the ConfigMap over them. The URL, commit and directories come from
/// the environment (never spliced into the script); credentials come from the Secret as
/// files and variables, and the password only ever reaches `git` as an HTTP header in its
/// environment. POSIX sh and git only: any image with both runs it.
pub const GIT_FETCH_SCRIPT: &str = r#"set -eu
umask 022
ssh_command="ssh -o StrictHostKeyChecking=accept-new -o UserKnownHostsFile=$HOME/known_hosts"
if [ -n "${EDDY_GIT_USERNAME:-}" ]; then
  GIT_CONFIG_COUNT=1
  GIT_CONFIG_KEY_0=http.extraHeader
  GIT_CONFIG_VALUE_0="Authorization: Basic $(printf '%s:%s' "$EDDY_GIT_USERNAME" "${EDDY_GIT_PASSWORD:-}" | base64 | tr -d '\n')"
  export GIT_CONFIG_COUNT GIT_CONFIG_KEY_0 GIT_CONFIG_VALUE_0
fi
if [ -f "$EDDY_GIT_AUTH/key" ]; then
  (umask 077 && { cat "$EDDY_GIT_AUTH/key"; echo; } > "$HOME/key")
  ssh_command="$ssh_command -o IdentitiesOnly=yes -i $HOME/key"
  if [ -n "${EDDY_GIT_KEY_PASSPHRASE:-}" ]; then
    (umask 077 && printf '#!/bin/sh\nprintf "%%s\\n" "$EDDY_GIT_KEY_PASSPHRASE"\n' > "$HOME/askpass")
    chmod 700 "$HOME/askpass"
    SSH_ASKPASS="$HOME/askpass" SSH_ASKPASS_REQUIRE=force DISPLAY=none
    export SSH_ASKPASS SSH_ASKPASS_REQUIRE DISPLAY
  else
    ssh_command="$ssh_command -o BatchMode=yes"
  fi
else
  ssh_command="$ssh_command -o BatchMode=yes"
fi
GIT_SSH_COMMAND="$ssh_command"
export GIT_SSH_COMMAND
repo="$EDDY_WORKSPACE/repository"
git init -q "$repo"
if ! git -C "$repo" fetch -q --depth 1 -- "$GIT_URL" "$GIT_COMMIT"; then
  echo "the server does not hand out single commits; fetching every branch and tag" >&2
  git -C "$repo" fetch -q -- "$GIT_URL" '+refs/heads/*:refs/remotes/origin/*' '+refs/tags/*:refs/tags/*'
fi
git -C "$repo" -c advice.detachedHead=false checkout -q --detach "$GIT_COMMIT"
source_dir="$repo/$GIT_BASE_DIR"
if [ ! -d "$source_dir" ]; then
  echo "the repository has no directory '$GIT_BASE_DIR' at $GIT_COMMIT" >&2
  exit 1
fi
context="$EDDY_WORKSPACE/context"
mkdir -p "$context"
cp -R "$source_dir/." "$context/"
rm -rf "$context/.git"
for file in "$EDDY_CONTEXT"/*; do
  cp -L "$file" "$context/"
done
echo "fetched $GIT_COMMIT of $GIT_URL"
"#;

/// Where a Git build's init container puts the repository and the build context.
const WORKSPACE: &str = "/workspace";
/// Where the ConfigMap's runtime files are mounted in a Git build.
const RUNTIME_FILES: &str = "/eddy/context";
/// Where an SSH key from the Secret is mounted in a Git build.
const GIT_AUTH: &str = "/eddy/git-auth";

/// The build Job: Kaniko turns the build context into the function's image. A Git source is
/// fetched first, by an init container, into a volume the build reads.
fn build_job(
    owned: &Owned<'_>,
    config: &RenderConfig,
    image: &str,
    runtime: Runtime,
    resources: Resources,
    source: Source<'_>,
) -> Job {
    let context_dir = match source {
        Source::Inline(_) => WORKSPACE.to_owned(),
        Source::Git { .. } => format!("{WORKSPACE}/context"),
    };
    let mut args = vec![
        format!("--context=dir://{context_dir}"),
        format!("--dockerfile={context_dir}/Dockerfile"),
        format!("--destination={image}"),
        "--snapshot-mode=redo".to_owned(),
        "--use-new-run".to_owned(),
    ];
    if let Some(major) = runtime.node_major() {
        args.push(format!("--build-arg=NODE_MAJOR={major}"));
    }
    if let Some(minor) = runtime.python_minor() {
        args.push(format!("--build-arg=PYTHON_VERSION=3.{minor}"));
    }
    if config.insecure_registry {
        args.push("--insecure".to_owned());
        args.push("--skip-tls-verify".to_owned());
    }
    let mut volumes = vec![Volume {
        name: "context".into(),
        config_map: Some(ConfigMapVolumeSource {
            name: config_map_name(owned.name, &owned.hash),
            ..ConfigMapVolumeSource::default()
        }),
        ..Volume::default()
    }];
    let (mut mounts, init_containers) = match source {
        Source::Inline(_) => (
            vec![VolumeMount {
                name: "context".into(),
                mount_path: WORKSPACE.into(),
                read_only: Some(true),
                ..VolumeMount::default()
            }],
            None,
        ),
        Source::Git { repository, commit } => {
            volumes.extend(git_volumes(repository));
            let workspace = VolumeMount {
                name: "workspace".into(),
                mount_path: WORKSPACE.into(),
                ..VolumeMount::default()
            };
            (
                vec![workspace],
                Some(vec![git_fetch_container(config, repository, commit)]),
            )
        }
    };
    // Kaniko, written in Go, trusts SSL_CERT_FILE's bundle.
    mounts.extend(config.egress.mount(EGRESS_CA_DIR));
    volumes.extend(config.egress.volume());
    // Kaniko runs the Dockerfile's install in this container, where the mount is seen and
    // left out of the image.
    if let Some((volume, mount)) = owned.package_registry() {
        volumes.push(volume);
        mounts.push(mount);
    }
    if let Some(secret) = &config.registry_secret {
        mounts.push(VolumeMount {
            name: "registry".into(),
            mount_path: "/kaniko/.docker".into(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
        volumes.push(Volume {
            name: "registry".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(secret.clone()),
                items: Some(vec![KeyToPath {
                    key: ".dockerconfigjson".into(),
                    path: "config.json".into(),
                    ..KeyToPath::default()
                }]),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        });
    }
    let build_labels = owned.build_labels();
    Job {
        metadata: owned.metadata(&job_name(owned.name, &owned.hash), build_labels.clone()),
        spec: Some(JobSpec {
            // A build of the same inputs fails the same way: one attempt, and the failure goes
            // to status instead of a retry loop.
            backoff_limit: Some(0),
            active_deadline_seconds: Some(config.build_timeout_seconds),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(build_labels),
                    // A sidecar would keep the Job's pod running after the build.
                    annotations: Some(labels([("sidecar.istio.io/inject", "false")])),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    restart_policy: Some("Never".into()),
                    automount_service_account_token: Some(false),
                    // The Secret's key is group-readable by the unprivileged fetch.
                    security_context: init_containers.is_some().then(|| PodSecurityContext {
                        fs_group: Some(65532),
                        ..PodSecurityContext::default()
                    }),
                    init_containers,
                    containers: vec![Container {
                        name: "build".into(),
                        image: Some(config.builder_image.clone()),
                        args: Some(args),
                        env: Some(config.egress.env()).filter(|env| !env.is_empty()),
                        // The build log's tail becomes the container's termination message,
                        // which the controller puts into BuildReady.
                        termination_message_policy: Some("FallbackToLogsOnError".into()),
                        volume_mounts: Some(mounts),
                        resources: Some(ResourceRequirements {
                            requests: (!resources.requests.is_empty())
                                .then_some(resources.requests),
                            limits: (!resources.limits.is_empty()).then_some(resources.limits),
                            ..ResourceRequirements::default()
                        }),
                        ..Container::default()
                    }],
                    volumes: Some(volumes),
                    ..PodSpec::default()
                }),
            },
            ..JobSpec::default()
        }),
        ..Job::default()
    }
}

/// The volumes a Git build adds: the workspace the source is fetched into, a private
/// scratch directory, and the SSH key when the repository takes one.
fn git_volumes(repository: &GitRepositorySource) -> Vec<Volume> {
    let empty = |name: &str, limit: &str| Volume {
        name: name.into(),
        empty_dir: Some(EmptyDirVolumeSource {
            size_limit: Some(Quantity(limit.into())),
            ..EmptyDirVolumeSource::default()
        }),
        ..Volume::default()
    };
    let mut volumes = vec![empty("workspace", "2Gi"), empty("git-home", "16Mi")];
    if let Some(auth) = &repository.auth
        && auth.type_ == RepositoryAuthType::Key
    {
        volumes.push(Volume {
            name: "git-auth".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(auth.secret_name.clone()),
                items: Some(vec![KeyToPath {
                    key: "key".into(),
                    path: "key".into(),
                    mode: Some(0o440),
                    ..KeyToPath::default()
                }]),
                default_mode: Some(0o440),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        });
    }
    volumes
}

/// The init container that fetches a Git source at `commit` and lays out the build context
/// (see [`GIT_FETCH_SCRIPT`]): unprivileged, read-only root, credentials from the Secret.
fn git_fetch_container(
    config: &RenderConfig,
    repository: &GitRepositorySource,
    commit: &str,
) -> Container {
    let var = |name: &str, value: &str| EnvVar {
        name: name.to_owned(),
        value: Some(value.to_owned()),
        ..EnvVar::default()
    };
    let from_secret = |name: &str, secret: &str, key: &str, optional: bool| EnvVar {
        name: name.to_owned(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.to_owned(),
                key: key.to_owned(),
                optional: optional.then_some(true),
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    };
    let mut env = vec![
        var(
            "GIT_URL",
            &eddy_model::resources::git_remote_url(&repository.url),
        ),
        var("GIT_COMMIT", commit),
        var("GIT_BASE_DIR", git_base_dir(repository)),
        var("EDDY_WORKSPACE", WORKSPACE),
        var("EDDY_CONTEXT", RUNTIME_FILES),
        var("EDDY_GIT_AUTH", GIT_AUTH),
        var("HOME", "/home/git"),
        var("GIT_TERMINAL_PROMPT", "0"),
        var("GIT_CONFIG_NOSYSTEM", "1"),
    ];
    let mut mounts = vec![
        VolumeMount {
            name: "workspace".into(),
            mount_path: WORKSPACE.into(),
            ..VolumeMount::default()
        },
        VolumeMount {
            name: "context".into(),
            mount_path: RUNTIME_FILES.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        },
        VolumeMount {
            name: "git-home".into(),
            mount_path: "/home/git".into(),
            ..VolumeMount::default()
        },
    ];
    env.extend(config.egress.env());
    mounts.extend(config.egress.mount(EGRESS_CA_DIR));
    match &repository.auth {
        Some(auth) if auth.type_ == RepositoryAuthType::Basic => {
            env.push(from_secret(
                "EDDY_GIT_USERNAME",
                &auth.secret_name,
                "username",
                false,
            ));
            env.push(from_secret(
                "EDDY_GIT_PASSWORD",
                &auth.secret_name,
                "password",
                false,
            ));
        }
        Some(auth) => {
            env.push(from_secret(
                "EDDY_GIT_KEY_PASSPHRASE",
                &auth.secret_name,
                "password",
                true,
            ));
            mounts.push(VolumeMount {
                name: "git-auth".into(),
                mount_path: GIT_AUTH.into(),
                read_only: Some(true),
                ..VolumeMount::default()
            });
        }
        None => {}
    }
    Container {
        name: "source".into(),
        image: Some(config.git_image.clone()),
        command: Some(vec!["/bin/sh".into(), "-c".into(), GIT_FETCH_SCRIPT.into()]),
        env: Some(env),
        // Why a fetch failed becomes the termination message, which goes into BuildReady.
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        volume_mounts: Some(mounts),
        resources: Some(ResourceRequirements {
            requests: Some(quantities([("cpu", "50m"), ("memory", "64Mi")])),
            limits: Some(quantities([("memory", "512Mi")])),
            ..ResourceRequirements::default()
        }),
        security_context: Some(SecurityContext {
            run_as_user: Some(65532),
            run_as_group: Some(65532),
            ..hardened_container()
        }),
        ..Container::default()
    }
}

/// eddy's container defaults: non-root, read-only root, no capabilities, no privilege
/// escalation, RuntimeDefault seccomp.
fn hardened_container() -> SecurityContext {
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

fn quantities<const N: usize>(pairs: [(&str, &str); N]) -> BTreeMap<String, Quantity> {
    pairs
        .into_iter()
        .map(|(name, value)| (name.to_owned(), Quantity(value.to_owned())))
        .collect()
}

/// The function's pods: hardened, probed, rolled without dropping a request.
fn deployment(
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
        name,
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
    // FUNC_TIMEOUT in the spec's env is already in `timeout`.
    env.extend(
        function
            .spec
            .env
            .iter()
            .filter(|user| user.name != FUNC_TIMEOUT_ENV)
            .map(|user| EnvVar {
                name: user.name.clone(),
                value: user.value_from.is_none().then(|| user.value.clone()),
                value_from: user.value_from.as_ref().map(|from| EnvVarSource {
                    secret_key_ref: from.secret_key_ref.as_ref().map(|key| SecretKeySelector {
                        name: key.name.clone(),
                        key: key.key.clone(),
                        optional: key.optional,
                    }),
                    config_map_key_ref: from.config_map_key_ref.as_ref().map(|key| {
                        ConfigMapKeySelector {
                            name: key.name.clone(),
                            key: key.key.clone(),
                            optional: key.optional,
                        }
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
            }),
    );
    let mut volume_mounts = vec![VolumeMount {
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
        volume_mounts.push(VolumeMount {
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
    let mut init_containers = Vec::new();
    if config.build == BuildMode::Buildless {
        let buildless = buildless_pod(owned, function, config, image, source, &env);
        volume_mounts.push(VolumeMount {
            name: "function".into(),
            mount_path: FUNCTION_DIR.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
        volumes.extend(buildless.volumes);
        init_containers = buildless.init_containers;
    }
    let mut pod_labels = function.spec.pod_labels();
    pod_labels.extend(owned.labels());
    pod_labels.insert(BUILD_HASH_LABEL.into(), owned.hash.clone());
    pod_labels.insert("sidecar.istio.io/inject".into(), "true".into());
    pod_labels.extend(owned.kyma_labels());
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
    let runtime_default = || {
        Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..SeccompProfile::default()
        })
    };
    let container = Container {
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
        readiness_probe: Some(health(2, 2, None)),
        liveness_probe: Some(health(10, 3, Some(2))),
        volume_mounts: Some(volume_mounts),
        ..Container::default()
    };
    Deployment {
        metadata: owned.metadata(name, owned.labels()),
        spec: DeploymentSpec {
            replicas: match scaling {
                Scaling::Fixed(replicas) => Some(replicas),
                Scaling::Autoscaled { .. } => None,
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
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations: Some(pod_annotations(function, !init_containers.is_empty())),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    automount_service_account_token: Some(false),
                    enable_service_links: Some(false),
                    termination_grace_period_seconds: Some(i64::from(timeout.min(300)) + 5),
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
                    init_containers: (!init_containers.is_empty()).then_some(init_containers),
                    containers: vec![container],
                    volumes: Some(volumes),
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        },
        ..Deployment::default()
    }
}

/// A function pod's annotations: Istio's proxy held until it is ready (Kyma's default, which
/// the user's annotations may override), then the user's, and with init containers (the
/// buildless install, the Git fetch) Istio's native sidecar: the proxy then starts before them,
/// so their downloads are not lost to a mesh redirect with no proxy behind it yet.
fn pod_annotations(function: &Function, has_init_containers: bool) -> BTreeMap<String, String> {
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
struct Buildless {
    volumes: Vec<Volume>,
    init_containers: Vec<Container>,
}

/// A buildless pod's sources and install: inline code from the Function's ConfigMap (only its
/// handler and dependency files), a Git source fetched at its commit by the same init
/// container as an image build's; then the `install` init container, in the runtime image,
/// with the function's resources (the install runs where the function will).
fn buildless_pod(
    owned: &Owned<'_>,
    function: &Function,
    config: &RenderConfig,
    image: &str,
    source: Source<'_>,
    env: &[EnvVar],
) -> Buildless {
    let files = runtimes::files(function.spec.runtime);
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
fn service(owned: &Owned<'_>) -> Service {
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
fn autoscaler(
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
