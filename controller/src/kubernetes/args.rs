//! The Kubernetes backend's flags (also read by `eddy controller render`), and the renderer's
//! settings they make.

use std::time::Duration;

/// Flags of the Kubernetes backend (also read by `eddy controller render`).
#[derive(Debug, Clone, clap::Args)]
pub struct KubernetesArgs {
    /// Registry (and path) function images are pushed to and pulled from.
    #[arg(
        long = "registry",
        env = "EDDY_REGISTRY",
        default_value = "localhost:5000"
    )]
    pub registry: String,
    /// The image that builds function images.
    #[arg(
        long = "builder-image",
        env = "EDDY_BUILDER_IMAGE",
        default_value = "gcr.io/kaniko-project/executor:v1.23.2"
    )]
    pub builder_image: String,
    /// The image whose `git` (and `ssh`) fetches a Function's Git source before its build.
    #[arg(
        long = "git-image",
        env = "EDDY_GIT_IMAGE",
        default_value = "docker.io/alpine/git:v2.47.2"
    )]
    pub git_image: String,
    /// A `kubernetes.io/dockerconfigjson` Secret, in each function namespace, for pushing
    /// and pulling function images.
    #[arg(long = "registry-secret", env = "EDDY_REGISTRY_SECRET")]
    pub registry_secret: Option<String>,
    /// Push to the registry over plain HTTP.
    #[arg(long = "insecure-registry", env = "EDDY_INSECURE_REGISTRY")]
    pub insecure_registry: bool,
    /// The event-bus publish URL functions get as PUBLISHER_PROXY_ADDRESS.
    #[arg(
        long = "publisher-url",
        env = "EDDY_PUBLISHER_URL",
        default_value = "http://eddy-event-bus.eddy-system.svc.cluster.local/publish"
    )]
    pub publisher_url: String,
    /// Kyma's publisher address, given to Kyma Functions as PUBLISHER_PROXY_ADDRESS instead of
    /// --publisher-url where it is served (the chart's kymaCompatibility.publisherProxy), as
    /// Kyma's Function controller sets it.
    #[arg(long = "kyma-publisher-url", env = "EDDY_KYMA_PUBLISHER_URL")]
    pub kyma_publisher_url: Option<String>,
    /// Longest an image build may run.
    #[arg(long = "image-build-timeout", env = "EDDY_IMAGE_BUILD_TIMEOUT", default_value = "15m", value_parser = humantime::parse_duration)]
    pub image_build_timeout: Duration,
    /// CPU utilization (percent of the request) an autoscaled Function's HPA aims for.
    #[arg(long = "hpa-cpu-target", env = "EDDY_HPA_CPU_TARGET", default_value_t = super::render::TARGET_CPU_UTILIZATION, value_parser = clap::value_parser!(i32).range(1..=1000))]
    pub hpa_cpu_target: i32,
    /// Also reconcile Kyma's Function (serverless.kyma-project.io/v1alpha2) and Subscription
    /// (eventing.kyma-project.io/v1alpha2) kinds, served by eddy's chart in a cluster without
    /// Kyma.
    #[arg(long = "kyma-compatibility", env = "EDDY_KYMA_COMPATIBILITY")]
    pub kyma_compatibility: bool,
    /// How code gets into function pods: `buildless` (eddy's runtime image installs the
    /// dependencies when a pod starts; no registry, no build) or `image` (a Kaniko build per
    /// source, pushed to `--registry`).
    #[arg(long = "build", env = "EDDY_BUILD", value_enum, default_value_t = super::render::BuildMode::Buildless)]
    pub build: super::render::BuildMode,
    /// The runtime images buildless pods run: `{runtime}` (nodejs22, python312, …) and
    /// `{version}` (eddy's) replaced.
    #[arg(
        long = "runtime-images",
        env = "EDDY_RUNTIME_IMAGES",
        default_value = "ghcr.io/eddy-dev/eddy-runtime-{runtime}:{version}"
    )]
    pub runtime_images: String,
    /// The Pod Security Standards level a Function's own `podSecurityContext` and
    /// `containerSecurityContext` must meet (`restricted`, `baseline` or `privileged`); a
    /// Function asking for more is not deployed, and its status names the fields.
    #[arg(
        long = "function-pod-security",
        env = "EDDY_FUNCTION_POD_SECURITY",
        value_enum,
        default_value_t = super::render::PodSecurityLevel::Restricted
    )]
    pub function_pod_security: super::render::PodSecurityLevel,
    /// The forward proxy the containers that download while a Function is built (the
    /// buildless install, the Git fetch, the image build) go through: HTTP_PROXY and
    /// HTTPS_PROXY in them.
    #[arg(long = "egress-proxy", env = "EDDY_EGRESS_PROXY")]
    pub egress_proxy: Option<String>,
    /// Hosts those containers reach without the proxy (NO_PROXY).
    #[arg(
        long = "egress-no-proxy",
        env = "EDDY_EGRESS_NO_PROXY",
        default_value = "localhost,127.0.0.1,.svc,.cluster.local"
    )]
    pub egress_no_proxy: String,
    /// A ConfigMap, in each function namespace, whose key `ca.crt` is the CA bundle those
    /// containers trust (the public roots and a TLS-intercepting proxy's, as one PEM file).
    #[arg(long = "egress-ca-configmap", env = "EDDY_EGRESS_CA_CONFIGMAP")]
    pub egress_ca_config_map: Option<String>,
    /// One active controller among the replicas.
    #[command(flatten)]
    pub leader: super::leader::LeaderArgs,
}

impl Default for KubernetesArgs {
    fn default() -> Self {
        eddy_platform::flags::defaults()
    }
}

impl KubernetesArgs {
    /// The renderer's settings.
    pub fn render_config(&self) -> super::RenderConfig {
        super::RenderConfig {
            registry: self.registry.clone(),
            builder_image: self.builder_image.clone(),
            git_image: self.git_image.clone(),
            registry_secret: self.registry_secret.clone(),
            insecure_registry: self.insecure_registry,
            publisher_url: self.publisher_url.clone(),
            kyma_publisher_url: self
                .kyma_publisher_url
                .clone()
                .filter(|url| !url.is_empty()),
            build_timeout_seconds: i64::try_from(self.image_build_timeout.as_secs())
                .unwrap_or(i64::MAX),
            target_cpu_utilization: self.hpa_cpu_target,
            trace_collector: eddy_platform::traces::collector_endpoint().map(str::to_owned),
            build: self.build,
            runtime_images: self.runtime_images.clone(),
            pod_security: self.function_pod_security,
            egress: super::render::Egress {
                proxy: self.egress_proxy.clone().filter(|proxy| !proxy.is_empty()),
                no_proxy: self.egress_no_proxy.clone(),
                ca_config_map: self
                    .egress_ca_config_map
                    .clone()
                    .filter(|name| !name.is_empty()),
            },
        }
    }
}
