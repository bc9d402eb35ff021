//! The Kubernetes backend: Functions become a ConfigMap, a build Job, a Deployment, a Service
//! and an HPA (the flow Kyma Serverless users know); Subscriptions are validated and get their
//! status. Objects are written with server-side apply under one field manager and owned by
//! their Function, so deleting the Function removes them.
//!
//! The decisions (what to render, where a build stands, whether a Deployment runs, which
//! errors are permanent) are pure functions; [`reconcile_function`] and
//! [`reconcile_subscription`] only read and write through the API.

pub mod leader;
pub mod render;

use std::{collections::HashMap, sync::Arc, time::Duration};

use parking_lot::Mutex;

use eddy_model::apirule::APIRule;
use eddy_model::backoff::Backoff;
use eddy_model::conditions::{ConditionType, Reason};
use eddy_model::resources::{
    Function, FunctionStatus, SinkPolicy, Subscription, SubscriptionStatus, describe_errors,
    parse_function_sink, set_condition, validate_function, validate_subscription,
};
use eddy_platform::shutdown::CancellationToken;
use futures::StreamExt as _;
use k8s_openapi::api::{
    apps::v1::Deployment,
    autoscaling::v2::HorizontalPodAutoscaler,
    batch::v1::Job,
    core::v1::{ConfigMap, Pod, Secret, Service},
};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::{
    Api, Client, Resource, ResourceExt as _,
    api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PropagationPolicy},
    runtime::{Controller, controller::Action, watcher},
};

pub use render::{
    BuildMode, PodSecurityLevel, RenderConfig, Rendered, Scaling, render, render_at, render_with,
};

use crate::{
    Error, Result,
    git::{GitConfig, GitCredentials},
    status::{condition, now},
    subscriptions::{Readiness, desired_status},
};

/// What the reconcilers share.
pub struct Context {
    /// The API server.
    pub client: Client,
    /// How objects are rendered.
    pub config: RenderConfig,
    /// Sinks allowed besides function Services.
    pub sinks: SinkPolicy,
    /// Consecutive failures per object, for the retry backoff.
    failures: Mutex<HashMap<String, u32>>,
    /// The time now (a fixed time in tests, so retry delays can be asserted exactly).
    pub clock: fn() -> Timestamp,
    /// Where `git ls-remote` keeps its scratch files and known hosts, and how long it may run.
    pub git: GitConfig,
    /// How often a Git source's reference is checked for a new commit.
    pub git_poll_interval: Duration,
    /// Whether Kyma's Function and Subscription kinds are reconciled too.
    pub kyma_compatibility: bool,
    /// Whether `file://` repositories are resolved (tests only: build pods cannot see the
    /// controller's files).
    pub file_repositories: bool,
    /// How APIRules are served: the domain their one-label hosts are prefixed to (their
    /// status names the URL), and the namespaces open to other namespaces' APIRules.
    pub apirules: eddy_platform::flags::ApiRuleArgs,
}

impl Context {
    /// A context for the reconcilers.
    pub fn new(client: Client, config: RenderConfig, sinks: SinkPolicy) -> Self {
        Self {
            client,
            config,
            sinks,
            failures: Mutex::default(),
            clock: Timestamp::now,
            git: GitConfig {
                dir: std::env::temp_dir().join("eddy-controller-git"),
                timeout: GIT_TIMEOUT,
            },
            git_poll_interval: Duration::from_secs(60),
            file_repositories: false,
            kyma_compatibility: false,
            apirules: eddy_platform::flags::defaults(),
        }
    }

    fn record_success(&self, key: &str) {
        {
            let mut failures = self.failures.lock();
            failures.remove(key);
        }
    }

    fn record_failure(&self, key: &str) -> u32 {
        let mut failures = self.failures.lock();
        let count = failures.entry(key.to_owned()).or_insert(0);
        *count = count.saturating_add(1);
        *count
    }
}

/// How often a settled object is looked at again anyway (drift from manual edits).
pub const RESYNC: Duration = Duration::from_secs(300);

/// Longest one `git ls-remote` of a Git source may take.
pub const GIT_TIMEOUT: Duration = Duration::from_secs(60);

/// Delays before retrying after consecutive transient errors: 1 s doubling to 5 min.
pub const RETRY: Backoff = Backoff::exponential(Duration::from_secs(1), RESYNC);

/// Whether an error will not go away by retrying the same request: the API server refused
/// what we sent (invalid, forbidden, a bad request). Such errors go into status; everything
/// else (connection problems, conflicts, throttling, server errors) is retried. Pure.
pub fn is_permanent(error: &Error) -> bool {
    match error {
        Error::Kube(kube::Error::Api(status)) => {
            matches!(status.code, 400 | 403 | 405 | 413 | 415 | 422)
        }
        Error::Incomplete(_) | Error::Unsupported(_) => true,
        _ => false,
    }
}

/// Whether the API server refused to create an object because its namespace is being deleted:
/// the Function goes with the namespace, so there is nothing to report or retry. Pure.
pub fn is_namespace_terminating(error: &Error) -> bool {
    let Error::Kube(kube::Error::Api(status)) = error else {
        return false;
    };
    status.details.as_ref().is_some_and(|details| {
        details
            .causes
            .iter()
            .any(|cause| cause.reason == "NamespaceTerminating")
    })
}

/// Where a build stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BuildState {
    /// Not finished.
    Running,
    /// The image is pushed.
    Succeeded,
    /// The build failed; why, as the Job says.
    Failed(String),
}

/// Annotation on a build Job: which attempt at building its source it is (1 when absent).
pub const BUILD_ATTEMPT_ANNOTATION: &str = "eddy.dev/build-attempt";

/// Delays before a failed build is tried again: 1 minute, doubling up to 30 minutes. A build
/// can fail for reasons outside its source (a registry or package mirror down, a node
/// evicted), so it is retried, but rarely enough not to load the cluster; a new source is
/// built at once.
pub const BUILD_RETRY: Backoff =
    Backoff::exponential(Duration::from_secs(60), Duration::from_secs(30 * 60));

/// Which attempt at building its source `job` is (1, 2, …). Pure.
pub fn build_attempt(job: &Job) -> u32 {
    job.metadata
        .annotations
        .as_ref()
        .and_then(|annotations| annotations.get(BUILD_ATTEMPT_ANNOTATION))
        .and_then(|attempt| attempt.parse::<u32>().ok())
        .unwrap_or(1)
        .max(1)
}

/// `job` marked as attempt `attempt` at its build. Pure.
pub fn with_build_attempt(mut job: Job, attempt: u32) -> Job {
    if attempt > 1 {
        job.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(BUILD_ATTEMPT_ANNOTATION.to_owned(), attempt.to_string());
    }
    job
}

/// When a failed build Job is tried again: [`BUILD_RETRY`]'s delay for its attempt after it
/// failed (its `Failed` condition's time, else its start, else `now`). Pure.
pub fn build_retry_at(job: &Job, now: Timestamp) -> Timestamp {
    let status = job.status.as_ref();
    let failed = status
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default()
        .iter()
        .filter(|c| (c.type_ == "Failed" || c.type_ == "FailureTarget") && c.status == "True")
        .find_map(|c| c.last_transition_time.as_ref())
        .or_else(|| status.and_then(|s| s.start_time.as_ref()))
        .map_or(now, |time| time.0);
    let delay = SignedDuration::try_from(BUILD_RETRY.delay(build_attempt(job)))
        .unwrap_or(SignedDuration::MAX);
    failed.checked_add(delay).unwrap_or(Timestamp::MAX)
}

/// Reads a build Job's state. Pure.
pub fn build_state(job: &Job) -> BuildState {
    let status = job.status.as_ref();
    let conditions = status
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    let holds = |type_: &str| {
        conditions
            .iter()
            .find(|c| c.type_ == type_ && c.status == "True")
    };
    if holds("Complete").is_some() || status.and_then(|s| s.succeeded).unwrap_or(0) > 0 {
        return BuildState::Succeeded;
    }
    if let Some(failed) = holds("Failed").or_else(|| holds("FailureTarget")) {
        let reason = failed.reason.as_deref().unwrap_or("Failed");
        let message = failed.message.as_deref().unwrap_or("the build Job failed");
        return BuildState::Failed(format!("{reason}: {message}"));
    }
    if status.and_then(|s| s.failed).unwrap_or(0) > 0 {
        // backoffLimit is 0: one failed pod is a failed build.
        return BuildState::Failed("the build pod failed".to_owned());
    }
    BuildState::Running
}

/// The tail of the build log, from the termination message of the build pod's container
/// that failed (the Git fetch or the build). Pure.
pub fn build_log_tail(pods: &[Pod]) -> Option<String> {
    pods.iter()
        .filter_map(|pod| pod.status.as_ref())
        .flat_map(|status| {
            let init = status.init_container_statuses.iter().flatten();
            init.chain(status.container_statuses.iter().flatten())
        })
        .filter_map(|status| status.state.as_ref()?.terminated.as_ref()?.message.clone())
        .map(|message| crate::status::tail(message.trim(), 20))
        .find(|message| !message.is_empty())
}

/// Why a buildless pod's `install` init container failed, from its termination message (the
/// tail of npm's or pip's output): the pod name and the message. The container may be waiting
/// to run again (CrashLoopBackOff), so its last state counts as well. Pure.
pub fn install_failure(pods: &[Pod]) -> Option<(String, String)> {
    pods.iter().find_map(|pod| {
        let statuses = pod.status.as_ref()?.init_container_statuses.as_ref()?;
        let install = statuses.iter().find(|status| status.name == "install")?;
        let failed = [install.state.as_ref(), install.last_state.as_ref()]
            .into_iter()
            .flatten()
            .filter_map(|state| state.terminated.as_ref())
            .find(|terminated| terminated.exit_code != 0)?;
        let message = failed
            .message
            .as_deref()
            .map(|message| crate::status::tail(message.trim(), 20))
            .filter(|message| !message.is_empty())
            .unwrap_or_else(|| format!("exit code {}", failed.exit_code));
        Some((pod.name_any(), message))
    })
}

/// Why a Function's pod cannot be placed on a node (the scheduler's own message, such as
/// `0/1 nodes are available: 1 Insufficient cpu.`): the pod name and the message. Pure.
pub fn unschedulable(pods: &[Pod]) -> Option<(String, String)> {
    pods.iter().find_map(|pod| {
        let conditions = pod.status.as_ref()?.conditions.as_ref()?;
        let refused = conditions.iter().find(|condition| {
            condition.type_ == "PodScheduled"
                && condition.status == "False"
                && condition.reason.as_deref() == Some("Unschedulable")
        })?;
        Some((pod.name_any(), refused.message.clone().unwrap_or_default()))
    })
}

/// How soon a Function whose pods are not available yet is looked at again: a failed install
/// or a pod no node takes shows in no object the controller watches.
const INSTALL_CHECK: Duration = Duration::from_secs(5);

/// The Running condition (status, reason, message) and available replicas of a Function's
/// Deployment. Pure.
pub fn running_condition(
    deployment: &Deployment,
    scaling: Scaling,
) -> (Option<bool>, Reason, String, i32) {
    let status = deployment.status.clone().unwrap_or_default();
    let available = status.available_replicas.unwrap_or(0);
    let desired = match scaling {
        Scaling::Fixed(replicas) => replicas,
        Scaling::Autoscaled { min, .. } => status.replicas.unwrap_or(min).max(min),
    };
    let conditions = status.conditions.unwrap_or_default();
    if let Some(stuck) = conditions.iter().find(|c| {
        c.type_.as_deref() == Some("Progressing")
            && c.status.as_deref() == Some("False")
            && c.reason.as_deref() == Some("ProgressDeadlineExceeded")
    }) {
        let message = stuck.message.clone().unwrap_or_default();
        return (Some(false), Reason::DeploymentFailed, message, available);
    }
    let observed =
        status.observed_generation.unwrap_or(0) >= deployment.metadata.generation.unwrap_or(0);
    let updated = status.updated_replicas.unwrap_or(0);
    if desired == 0 && observed && status.replicas.unwrap_or(0) == 0 {
        return (
            Some(true),
            Reason::ScaledToZero,
            "0 replicas requested".to_owned(),
            0,
        );
    }
    let available_condition = conditions
        .iter()
        .any(|c| c.type_.as_deref() == Some("Available") && c.status.as_deref() == Some("True"));
    // As Kyma's controller: running only once the newest version is out (Progressing with
    // NewReplicaSetAvailable). An update whose new pod never starts leaves the old pod
    // Available and the counts whole (the new pod is counted as updated), so neither tells.
    let newest_out = conditions.iter().any(|c| {
        c.type_.as_deref() == Some("Progressing")
            && c.status.as_deref() == Some("True")
            && c.reason.as_deref() == Some("NewReplicaSetAvailable")
    });
    if observed && available_condition && newest_out && updated >= desired && available >= desired {
        return (
            Some(true),
            Reason::DeploymentReady,
            format!("{available} of {desired} replicas available"),
            available,
        );
    }
    if available_condition {
        return (
            None,
            Reason::DeploymentWaiting,
            format!(
                "rolling out the newest version: {updated} of {desired} replicas updated, \
                 {available} available (the previous version serves meanwhile)"
            ),
            available,
        );
    }
    (
        None,
        Reason::DeploymentPending,
        "waiting for the Deployment to become available".to_owned(),
        available,
    )
}

fn key_of<K: Resource>(object: &K) -> String
where
    K::DynamicType: Default,
{
    format!(
        "{}/{}/{}",
        K::kind(&Default::default()),
        object.meta().namespace.as_deref().unwrap_or_default(),
        object.meta().name.as_deref().unwrap_or_default()
    )
}

fn apply_params() -> PatchParams {
    PatchParams::apply(render::FIELD_MANAGER).force()
}

/// The API of `object`'s kind in its namespace, and its name.
fn api_for<'a, K>(client: &Client, object: &'a K) -> Result<(Api<K>, &'a str)>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    let meta = object.meta();
    let namespace = meta
        .namespace
        .as_deref()
        .ok_or(Error::Incomplete("namespace"))?;
    let name = meta.name.as_deref().ok_or(Error::Incomplete("name"))?;
    Ok((Api::namespaced(client.clone(), namespace), name))
}

/// Server-side applies `object` (named by its metadata) and returns what the API server has.
async fn apply<K>(client: &Client, object: &K) -> Result<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let (api, name) = api_for(client, object)?;
    Ok(api
        .patch(name, &apply_params(), &Patch::Apply(object))
        .await?)
}

/// Deletes the objects of `function` whose build hash is not `hash`: superseded build Jobs
/// (with their pods) and ConfigMaps.
async fn delete_superseded(
    client: &Client,
    namespace: &str,
    function: &str,
    hash: &str,
) -> Result<()> {
    let selector = format!(
        "{}={function},{}!={hash}",
        render::FUNCTION_LABEL,
        render::BUILD_HASH_LABEL
    );
    let params = ListParams::default().labels(&selector);
    delete_listed(&Api::<Job>::namespaced(client.clone(), namespace), &params).await?;
    delete_listed(
        &Api::<ConfigMap>::namespaced(client.clone(), namespace),
        &params,
    )
    .await
}

/// Whether every replica runs the Deployment's current pod template. Pure.
fn rolled_out(deployment: &Deployment) -> bool {
    let Some(status) = &deployment.status else {
        return false;
    };
    let wanted = deployment.spec.replicas.unwrap_or(1);
    status.observed_generation >= deployment.metadata.generation
        && status.updated_replicas.unwrap_or(0) >= wanted
        && status.replicas.unwrap_or(0) == status.updated_replicas.unwrap_or(0)
}

/// Deletes what `params` lists, with its dependents in the background; gone already is fine.
async fn delete_listed<K>(api: &Api<K>, params: &ListParams) -> Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    K::DynamicType: Default,
{
    let background = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Background),
        ..DeleteParams::default()
    };
    for object in api.list_metadata(params).await? {
        tracing::info!(
            kind = %K::kind(&Default::default()),
            namespace = object.metadata.namespace.as_deref().unwrap_or_default(),
            name = %object.name_any(),
            "deleting a superseded build object"
        );
        ignore_not_found(api.delete(&object.name_any(), &background).await.map(drop))?;
    }
    Ok(())
}

fn ignore_not_found(result: kube::Result<()>) -> Result<()> {
    match result {
        Err(kube::Error::Api(status)) if status.is_not_found() => Ok(()),
        other => Ok(other?),
    }
}

/// The body of a server-side apply of an object's status.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct StatusPatch<'a, S> {
    api_version: String,
    kind: String,
    status: &'a S,
}

/// Writes `status` when it differs from what the object has (`previous`).
async fn write_status<K, S>(
    client: &Client,
    object: &K,
    previous: Option<&S>,
    status: &S,
) -> Result<()>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
    S: serde::Serialize + PartialEq + std::fmt::Debug,
{
    if previous == Some(status) {
        return Ok(());
    }
    if let Some(kyma) = eddy_model::kyma::stored_as(object.meta()) {
        return write_kyma_status(client, object.meta(), &kyma, status).await;
    }
    let (api, name) = api_for(client, object)?;
    let body = StatusPatch {
        api_version: K::api_version(&Default::default()).into_owned(),
        kind: K::kind(&Default::default()).into_owned(),
        status,
    };
    api.patch_status(name, &apply_params(), &Patch::Apply(&body))
        .await?;
    Ok(())
}

/// Writes `status` to the Kyma object `meta` names (`kymaCompatibility`).
async fn write_kyma_status<S: serde::Serialize + std::fmt::Debug>(
    client: &Client,
    meta: &kube::core::ObjectMeta,
    kyma: &kube::core::ApiResource,
    status: &S,
) -> Result<()> {
    let namespace = meta
        .namespace
        .as_deref()
        .ok_or(Error::Incomplete("namespace"))?;
    let name = meta.name.as_deref().ok_or(Error::Incomplete("name"))?;
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, kyma);
    let body = StatusPatch {
        api_version: kyma.api_version.clone(),
        kind: kyma.kind.clone(),
        status,
    };
    api.patch_status(name, &apply_params(), &Patch::Apply(&body))
        .await?;
    Ok(())
}

/// A Kyma Function (`kymaCompatibility`): converted to eddy's and reconciled by
/// [`reconcile_function`], which writes back to the Kyma object. One that does not convert
/// says why in its status.
pub async fn reconcile_kyma_function(
    object: Arc<DynamicObject>,
    context: Arc<Context>,
) -> Result<Action> {
    let value = serde_json::to_value(object.as_ref()).unwrap_or_default();
    match eddy_model::kyma::native_function(value) {
        Ok(function) => reconcile_function(Arc::new(function), context).await,
        Err(errors) => {
            let mut status = FunctionStatus {
                observed_generation: object.metadata.generation,
                ..FunctionStatus::default()
            };
            set_condition(
                &mut status.conditions,
                condition(
                    ConditionType::ConfigurationReady,
                    Some(false),
                    Reason::ValidationFailed,
                    describe_errors(&errors),
                ),
            );
            let kyma = eddy_model::kyma::function_resource();
            write_kyma_status(&context.client, &object.metadata, &kyma, &status).await?;
            Ok(Action::await_change())
        }
    }
}

/// A Kyma Subscription (`kymaCompatibility`), like [`reconcile_kyma_function`].
pub async fn reconcile_kyma_subscription(
    object: Arc<DynamicObject>,
    context: Arc<Context>,
) -> Result<Action> {
    let value = serde_json::to_value(object.as_ref()).unwrap_or_default();
    match eddy_model::kyma::native_subscription(value) {
        Ok(subscription) => reconcile_subscription(Arc::new(subscription), context).await,
        Err(errors) => {
            let status = SubscriptionStatus {
                ready: false,
                conditions: vec![condition(
                    ConditionType::Ready,
                    Some(false),
                    Reason::Invalid,
                    describe_errors(&errors),
                )],
                ..SubscriptionStatus::default()
            };
            let kyma = eddy_model::kyma::subscription_resource();
            write_kyma_status(&context.client, &object.metadata, &kyma, &status).await?;
            Ok(Action::await_change())
        }
    }
}

/// Retries a failed reconcile of a Kyma object, like [`error_policy`].
pub fn kyma_error_policy(
    object: Arc<DynamicObject>,
    error: &Error,
    context: Arc<Context>,
) -> Action {
    let key = format!(
        "{}/{}/{}",
        object
            .types
            .as_ref()
            .map_or("", |types| types.kind.as_str()),
        object.metadata.namespace.as_deref().unwrap_or_default(),
        object.metadata.name.as_deref().unwrap_or_default()
    );
    let failures = context.record_failure(&key);
    let delay = RETRY.delay(failures);
    tracing::warn!(object = %key, %error, failures, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// Brings a Function's objects in line with its spec and reports in its status.
pub async fn reconcile_function(function: Arc<Function>, context: Arc<Context>) -> Result<Action> {
    let key = key_of(function.as_ref());
    match reconcile_function_once(&function, &context).await {
        Ok(action) => {
            context.record_success(&key);
            Ok(action)
        }
        Err(error) if is_namespace_terminating(&error) => {
            tracing::debug!(function = %key, "its namespace is being deleted; nothing to do");
            Ok(Action::await_change())
        }
        Err(error) if is_permanent(&error) => {
            tracing::warn!(function = %key, %error, "cannot reconcile the function; reported in status");
            let mut status = function.status.clone().unwrap_or_default();
            set_condition(
                &mut status.conditions,
                condition(
                    ConditionType::Running,
                    Some(false),
                    Reason::ApplyFailed,
                    error.to_string(),
                ),
            );
            write_status(
                &context.client,
                function.as_ref(),
                function.status.as_ref(),
                &status,
            )
            .await?;
            Ok(Action::requeue(RESYNC))
        }
        Err(error) => Err(error),
    }
}

async fn reconcile_function_once(function: &Function, context: &Context) -> Result<Action> {
    let client = &context.client;
    let namespace = function.namespace().ok_or(Error::Incomplete("namespace"))?;
    let name = function.name_any();
    let previous = function.status.clone();
    let mut status = previous.clone().unwrap_or_default();
    status.observed_generation = function.metadata.generation;
    let errors = validate_function(function);
    let action = if !errors.is_empty() {
        // The CRD's rules refuse these; an object stored before a rule existed ends here.
        set_condition(
            &mut status.conditions,
            condition(
                ConditionType::ConfigurationReady,
                Some(false),
                Reason::ValidationFailed,
                describe_errors(&errors),
            ),
        );
        Action::await_change()
    } else {
        let commit = match &function.spec.source.git_repository {
            None => None,
            Some(repository) => match resolve_commit(context, &namespace, repository).await? {
                Ok(commit) => Some(commit),
                Err((reason, message)) => {
                    // What runs keeps running; the reference is looked at again soon.
                    tracing::warn!(%namespace, function = %name, %message, "cannot resolve the Git source");
                    set_condition(
                        &mut status.conditions,
                        condition(ConditionType::BuildReady, Some(false), reason, message),
                    );
                    write_status(client, function, previous.as_ref(), &status).await?;
                    return Ok(Action::requeue(context.git_poll_interval));
                }
            },
        };
        let registry = package_registry(client, &namespace, function).await?;
        let rendered = render_with(
            function,
            &context.config,
            commit.as_deref(),
            registry.as_ref(),
        )?;
        let violations = rendered.pod_security_violations(context.config.pod_security);
        if !violations.is_empty() {
            // What runs keeps running; nothing of this generation is applied.
            let message = violations.join("; ");
            tracing::warn!(%namespace, function = %name, %message, "security context refused");
            set_condition(
                &mut status.conditions,
                condition(
                    ConditionType::ConfigurationReady,
                    Some(false),
                    Reason::SecurityContextRefused,
                    message,
                ),
            );
            write_status(client, function, previous.as_ref(), &status).await?;
            return Ok(Action::await_change());
        }
        let configured = match &commit {
            Some(commit) => format!("build {} of commit {commit}", rendered.hash),
            None => format!("build {}", rendered.hash),
        };
        set_condition(
            &mut status.conditions,
            condition(
                ConditionType::ConfigurationReady,
                Some(true),
                Reason::ConfigurationValid,
                function.spec.configured_message(configured),
            ),
        );
        status.commit = commit;
        status.url = Some(render::function_url(&namespace, &name));
        let target = Target {
            client,
            namespace: &namespace,
            name: &name,
            rendered: &rendered,
            buildless: context.config.build == BuildMode::Buildless,
        };
        let jobs: Api<Job> = Api::namespaced(client.clone(), &namespace);
        let job_name = rendered.job.metadata.name.clone().unwrap_or_default();
        status.pod_selector = Some(render::pod_selector(&name));
        let requeue_after = if context.config.build == BuildMode::Buildless {
            status.build_failures = 0;
            target.deploy_buildless(&mut status, function).await?
        } else {
            match jobs.get_opt(&job_name).await? {
                None => {
                    status.build_failures = 0;
                    target.build(&mut status, Some(1)).await?
                }
                Some(job) => match build_state(&job) {
                    BuildState::Running => {
                        status.build_failures = saturating_i32(build_attempt(&job) - 1);
                        target.build(&mut status, None).await?
                    }
                    BuildState::Failed(reason) => {
                        let now = (context.clock)();
                        target.build_failed(&mut status, &job, reason, now).await?
                    }
                    BuildState::Succeeded => {
                        status.build_failures = 0;
                        let built = (Reason::BuildSucceeded, format!("image {}", rendered.image));
                        target.deploy(&mut status, function, built).await?
                    }
                },
            }
        };
        // A Git reference can move at any time: look again at least every poll interval.
        match status.commit {
            Some(_) => Action::requeue(requeue_after.min(context.git_poll_interval)),
            None => Action::requeue(requeue_after),
        }
    };
    write_status(client, function, previous.as_ref(), &status).await?;
    Ok(action)
}

/// One valid Function's rendered objects, and where they go.
struct Target<'a> {
    client: &'a Client,
    namespace: &'a str,
    name: &'a str,
    rendered: &'a Rendered,
    /// Pods that take their sources from the ConfigMap (`--build buildless`).
    buildless: bool,
}

impl Target<'_> {
    /// Buildless: the sources' ConfigMap, then the Deployment on the runtime image (its pods
    /// install the dependencies when they start).
    async fn deploy_buildless(
        &self,
        status: &mut FunctionStatus,
        function: &Function,
    ) -> Result<Duration> {
        apply(self.client, &self.rendered.config_map).await?;
        let message = format!(
            "no build: {} installs the dependencies when a pod starts",
            self.rendered.image
        );
        self.deploy(status, function, (Reason::Buildless, message))
            .await
    }

    /// A build runs (`start`: starts that attempt first).
    async fn build(&self, status: &mut FunctionStatus, start: Option<u32>) -> Result<Duration> {
        let rendered = self.rendered;
        if let Some(attempt) = start {
            tracing::info!(namespace = %self.namespace, function = %self.name, image = %rendered.image, attempt, "building");
            apply(self.client, &rendered.config_map).await?;
            apply(
                self.client,
                &with_build_attempt(rendered.job.clone(), attempt),
            )
            .await?;
        }
        let message = match status.build_failures {
            0 => format!("building {}", rendered.image),
            failures => format!(
                "building {} again after {failures} failed build(s)",
                rendered.image
            ),
        };
        set_condition(
            &mut status.conditions,
            condition(
                ConditionType::BuildReady,
                None,
                Reason::BuildRunning,
                message,
            ),
        );
        if !has_condition(status, ConditionType::Running) {
            set_condition(
                &mut status.conditions,
                condition(
                    ConditionType::Running,
                    None,
                    Reason::Building,
                    "waiting for the first build",
                ),
            );
        }
        Ok(RESYNC)
    }

    /// The build failed: its reason, the tail of its log and when it is tried again go into
    /// status; once that time has come, the failed Job is replaced by the next attempt.
    async fn build_failed(
        &self,
        status: &mut FunctionStatus,
        job: &Job,
        reason: String,
        now: Timestamp,
    ) -> Result<Duration> {
        let attempt = build_attempt(job);
        let retry_at = build_retry_at(job, now);
        if now >= retry_at {
            let jobs: Api<Job> = Api::namespaced(self.client.clone(), self.namespace);
            let background = DeleteParams {
                propagation_policy: Some(PropagationPolicy::Background),
                ..DeleteParams::default()
            };
            tracing::info!(namespace = %self.namespace, function = %self.name, failures = attempt, "building again after a failed build");
            ignore_not_found(jobs.delete(&job.name_any(), &background).await.map(drop))?;
            status.build_failures = saturating_i32(attempt);
            return self.build(status, Some(attempt.saturating_add(1))).await;
        }
        // The pods of this Job, not of an earlier attempt under the same name.
        let selector = match job.metadata.uid.as_deref() {
            Some(uid) => format!("batch.kubernetes.io/controller-uid={uid}"),
            None => format!("batch.kubernetes.io/job-name={}", job.name_any()),
        };
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), self.namespace);
        let log = build_log_tail(
            &pods
                .list(&ListParams::default().labels(&selector))
                .await?
                .items,
        );
        let retry = format!(
            "failed build {attempt} of this source; trying again at {}",
            retry_at.strftime("%Y-%m-%dT%H:%M:%SZ")
        );
        let message = match log {
            Some(log) => format!("{reason}\n{log}\n{retry}"),
            None => format!("{reason}\n{retry}"),
        };
        tracing::warn!(namespace = %self.namespace, function = %self.name, %message, "build failed");
        status.build_failures = saturating_i32(attempt);
        set_condition(
            &mut status.conditions,
            condition(
                ConditionType::BuildReady,
                Some(false),
                Reason::BuildFailed,
                message,
            ),
        );
        if !has_condition(status, ConditionType::Running) {
            set_condition(
                &mut status.conditions,
                condition(
                    ConditionType::Running,
                    Some(false),
                    Reason::BuildFailed,
                    "no image to run",
                ),
            );
        }
        Ok(retry_at.duration_since(now).unsigned_abs())
    }

    /// The image exists: apply the Deployment, Service and HPA (or delete an HPA no longer
    /// wanted), clear superseded builds, and report how the rollout goes.
    async fn deploy(
        &self,
        status: &mut FunctionStatus,
        function: &Function,
        (reason, message): (Reason, String),
    ) -> Result<Duration> {
        let rendered = self.rendered;
        set_condition(
            &mut status.conditions,
            condition(ConditionType::BuildReady, Some(true), reason, message),
        );
        let deployment = apply(self.client, &rendered.deployment).await?;
        replace_publisher_alias(self.client, self.namespace, self.name).await?;
        apply(self.client, &rendered.service).await?;
        match &rendered.autoscaler {
            Some(autoscaler) => {
                apply(self.client, autoscaler).await?;
            }
            None => {
                let autoscalers: Api<HorizontalPodAutoscaler> =
                    Api::namespaced(self.client.clone(), self.namespace);
                ignore_not_found(
                    autoscalers
                        .delete(self.name, &DeleteParams::default())
                        .await
                        .map(drop),
                )?;
            }
        }
        // A buildless pod mounts its ConfigMap: the old ones stay until the rollout is done.
        if !self.buildless || rolled_out(&deployment) {
            delete_superseded(self.client, self.namespace, self.name, &rendered.hash).await?;
        }
        let (ok, reason, message, replicas) =
            running_condition(&deployment, render::scaling(function));
        status.replicas = replicas;
        status.describe_spec(&function.spec);
        status.runtime_image = Some(rendered.image.clone());
        let mut message = message;
        if ok != Some(true) {
            let pods: Api<Pod> = Api::namespaced(self.client.clone(), self.namespace);
            let selector = format!(
                "{}={},{}={}",
                render::FUNCTION_LABEL,
                self.name,
                render::BUILD_HASH_LABEL,
                rendered.hash
            );
            let pods = pods.list(&ListParams::default().labels(&selector)).await?;
            if let Some((pod, log)) = install_failure(&pods.items) {
                // While an update fails, the previous version may still serve: say both.
                let serving = if replicas > 0 {
                    format!(" (the previous version keeps serving: {replicas} available)")
                } else {
                    String::new()
                };
                let message =
                    format!("installing the dependencies failed in pod {pod}{serving}:\n{log}");
                tracing::warn!(namespace = %self.namespace, function = %self.name, %message, "dependency install failed");
                for kind in [ConditionType::BuildReady, ConditionType::Running] {
                    set_condition(
                        &mut status.conditions,
                        condition(
                            kind,
                            Some(false),
                            Reason::DependencyInstallFailed,
                            message.clone(),
                        ),
                    );
                }
                return Ok(INSTALL_CHECK);
            }
            // Pending for want of a node is said, with the scheduler's reason.
            if let Some((pod, why)) = unschedulable(&pods.items) {
                message = format!("{message}; pod {pod} cannot be scheduled: {why}");
            }
        }
        set_condition(
            &mut status.conditions,
            condition(ConditionType::Running, ok, reason, message),
        );
        Ok(if ok != Some(true) {
            INSTALL_CHECK
        } else {
            RESYNC
        })
    }
}

/// The names of Kyma's publisher proxy in `kyma-system`, which the chart's
/// `kymaCompatibility.publisherProxy` answers at (ExternalName Services to the event-bus).
pub const PUBLISHER_ALIASES: [&str; 2] =
    ["eventing-publisher-proxy", "eventing-event-publisher-proxy"];

/// A Function named as Kyma's publisher proxy in `kyma-system` (Kyma's own tests deploy a
/// publisher mock so) wins over the chart's alias of that name: the alias Service is deleted
/// so the Function's own takes the name. Anything else of that name is left to the apply.
async fn replace_publisher_alias(client: &Client, namespace: &str, name: &str) -> Result<()> {
    if namespace != "kyma-system" || !PUBLISHER_ALIASES.contains(&name) {
        return Ok(());
    }
    let services: Api<Service> = Api::namespaced(client.clone(), namespace);
    let Some(existing) = services.get_opt(name).await? else {
        return Ok(());
    };
    let labels = existing.metadata.labels.clone().unwrap_or_default();
    let is_alias = existing
        .spec
        .as_ref()
        .and_then(|spec| spec.type_.as_deref())
        == Some("ExternalName")
        && labels.get("app.kubernetes.io/part-of").map(String::as_str) == Some("eddy")
        && labels
            .get("app.kubernetes.io/component")
            .map(String::as_str)
            == Some("event-bus");
    if !is_alias {
        return Ok(());
    }
    // Only the alias read above: never a Service made in between.
    let params = DeleteParams {
        preconditions: existing.metadata.uid.map(|uid| kube::api::Preconditions {
            uid: Some(uid),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    ignore_not_found(services.delete(name, &params).await.map(|_| ()))?;
    tracing::info!(%namespace, function = %name, "the Function replaces the chart's publisher alias of its name");
    Ok(())
}

/// Kyma's package registry Secrets, watched by that name alone (the chart grants list and
/// watch of no other Secret), so a Function is reconciled again when the Secret its install
/// reads appears, changes or goes.
fn registry_secrets(client: &Client) -> (Api<Secret>, watcher::Config) {
    (
        Api::all(client.clone()),
        watcher::Config::default().fields(&format!(
            "metadata.name={}",
            crate::package_registry::SECRET_NAME
        )),
    )
}

/// The Functions of `known` (eddy's or Kyma's) that a change to the package registry Secret
/// `secret` concerns, among those `wanted` keeps: the ones of its namespace, or all for the
/// cluster-wide one; as references for a controller's `watches`.
fn reached_by_registry<K>(
    known: &kube::runtime::reflector::Store<K>,
    secret: &Secret,
    wanted: impl Fn(&K) -> bool,
    dynamic_type: &K::DynamicType,
) -> Vec<kube::runtime::reflector::ObjectRef<K>>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Clone + Eq + std::hash::Hash,
{
    let changed = secret.namespace().unwrap_or_default();
    let cluster_wide = changed == crate::package_registry::CLUSTER_NAMESPACE;
    known
        .state()
        .into_iter()
        .filter(|object| {
            (cluster_wide || object.namespace().as_deref() == Some(changed.as_str()))
                && wanted(object)
        })
        .map(|object| {
            kube::runtime::reflector::ObjectRef::from_obj_with(
                object.as_ref(),
                dynamic_type.clone(),
            )
        })
        .collect()
}

/// The name of the copy of the cluster-wide private package registry Secret in a Function's
/// namespace (pods mount Secrets of their own namespace only).
pub const PACKAGE_REGISTRY_COPY: &str = "eddy-package-registry-config";

/// The private package registry configuration `function`'s dependency install uses, as a
/// Secret of its namespace that its pods can mount: the namespace's own
/// `serverless-package-registry-config`, else a copy of `kyma-system`'s labelled one (kept
/// up to date at each reconcile, deleted when it no longer applies). `None` for code that
/// installs nothing.
async fn package_registry(
    client: &Client,
    namespace: &str,
    function: &Function,
) -> Result<Option<crate::package_registry::PackageRegistry>> {
    use crate::package_registry::{CLUSTER_NAMESPACE, SECRET_NAME, choose, is_cluster_wide};
    if !render::may_install(function) {
        return Ok(None);
    }
    let data_of = |secret: &Secret| -> std::collections::BTreeMap<String, Vec<u8>> {
        secret
            .data
            .iter()
            .flatten()
            .map(|(key, value)| (key.clone(), value.0.clone()))
            .collect()
    };
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let own = secrets.get_opt(SECRET_NAME).await?;
    let cluster = match (&own, namespace == CLUSTER_NAMESPACE) {
        (None, false) => Api::<Secret>::namespaced(client.clone(), CLUSTER_NAMESPACE)
            .get_opt(SECRET_NAME)
            .await?
            .filter(|secret| is_cluster_wide(secret.metadata.labels.as_ref())),
        _ => None,
    };
    let chosen = choose(
        function.spec.runtime,
        namespace,
        own.as_ref().map(data_of).as_ref(),
        cluster.as_ref().map(data_of).as_ref(),
    );
    match (&cluster, chosen) {
        (Some(cluster), Some(mut chosen)) => {
            let copy = Secret {
                metadata: kube::api::ObjectMeta {
                    name: Some(PACKAGE_REGISTRY_COPY.to_owned()),
                    namespace: Some(namespace.to_owned()),
                    labels: Some(
                        [
                            ("app.kubernetes.io/managed-by", "eddy"),
                            (
                                "eddy.dev/copy-of",
                                "kyma-system.serverless-package-registry-config",
                            ),
                        ]
                        .into_iter()
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .collect(),
                    ),
                    ..Default::default()
                },
                type_: Some("Opaque".to_owned()),
                data: cluster.data.clone(),
                ..Secret::default()
            };
            apply(client, &copy).await?;
            chosen.name = PACKAGE_REGISTRY_COPY.to_owned();
            Ok(Some(chosen))
        }
        (_, chosen) => {
            // A copy of a cluster-wide Secret that no longer applies goes (its credentials
            // with it).
            match secrets
                .delete(PACKAGE_REGISTRY_COPY, &DeleteParams::default())
                .await
            {
                Ok(_) => {
                    tracing::info!(%namespace, "deleted the copy of the cluster-wide package registry Secret");
                }
                Err(kube::Error::Api(response)) if response.code == 404 => {}
                Err(error) => return Err(error.into()),
            }
            Ok(chosen)
        }
    }
}

/// The commit a Git source's reference names now, with the credentials its Secret holds;
/// or why it cannot be known (the reason and message for BuildReady). API errors are
/// returned as errors (retried).
async fn resolve_commit(
    context: &Context,
    namespace: &str,
    repository: &eddy_model::resources::GitRepositorySource,
) -> Result<std::result::Result<String, (Reason, String)>> {
    if repository.url.starts_with("file://") && !context.file_repositories {
        return Ok(Err((
            Reason::SourceUnavailable,
            "spec.source.gitRepository.url: file:// repositories are not reachable from build \
             pods; use https://, http:// or ssh://"
                .to_owned(),
        )));
    }
    let credentials = match &repository.auth {
        None => None,
        Some(auth) => {
            let secrets: Api<Secret> = Api::namespaced(context.client.clone(), namespace);
            let Some(secret) = secrets.get_opt(&auth.secret_name).await? else {
                return Ok(Err((
                    Reason::ReferenceNotFound,
                    format!(
                        "spec.source.gitRepository.auth: Secret {} not found",
                        auth.secret_name
                    ),
                )));
            };
            let data: std::collections::BTreeMap<String, Vec<u8>> = secret
                .data
                .unwrap_or_default()
                .into_iter()
                .map(|(key, value)| (key, value.0))
                .collect();
            match GitCredentials::from_secret(auth.type_, &data) {
                Ok(credentials) => Some(credentials),
                Err(key) => {
                    return Ok(Err((
                        Reason::ReferenceNotFound,
                        format!(
                            "spec.source.gitRepository.auth: Secret {} has no key {key}",
                            auth.secret_name
                        ),
                    )));
                }
            }
        }
    };
    Ok(crate::git::resolve(
        &context.git,
        &repository.url,
        &repository.reference,
        credentials.as_ref(),
    )
    .await
    .map_err(|failure| (failure.reason, failure.message)))
}

fn saturating_i32(value: u32) -> i32 {
    i32::try_from(value).unwrap_or(i32::MAX)
}

fn has_condition(status: &FunctionStatus, type_: ConditionType) -> bool {
    status.conditions.iter().any(|c| c.type_ == type_.as_str())
}

/// Validates a Subscription (its sink must be a Service in its namespace, or an allowed URL)
/// and reports the subjects its types resolve to.
pub async fn reconcile_subscription(
    subscription: Arc<Subscription>,
    context: Arc<Context>,
) -> Result<Action> {
    let key = key_of(subscription.as_ref());
    let namespace = subscription
        .namespace()
        .ok_or(Error::Incomplete("namespace"))?;
    let errors = validate_subscription(&subscription, &context.sinks);
    let (readiness, message, action) = if !errors.is_empty() {
        let message = describe_errors(&errors);
        (Readiness::Invalid, message, Action::await_change())
    } else if let Some(sink) = parse_function_sink(&subscription.spec.sink) {
        let services: Api<Service> = Api::namespaced(context.client.clone(), &namespace);
        if services.get_opt(&sink.function).await?.is_some() {
            (
                Readiness::Ready,
                format!("delivering to Service {}", sink.function),
                Action::requeue(RESYNC),
            )
        } else {
            (
                Readiness::SinkNotFound,
                format!("no Service {} in namespace {namespace}", sink.function),
                Action::requeue(Duration::from_secs(15)),
            )
        }
    } else {
        (
            Readiness::Ready,
            "delivering to an allowed URL".to_owned(),
            Action::requeue(RESYNC),
        )
    };
    let status: SubscriptionStatus = desired_status(
        &subscription,
        subscription.status.as_ref(),
        readiness,
        message,
        &now(),
    );
    write_status(
        &context.client,
        subscription.as_ref(),
        subscription.status.as_ref(),
        &status,
    )
    .await?;
    context.record_success(&key);
    Ok(action)
}

/// Retries a failed reconcile with a per-object exponential backoff.
pub fn error_policy<K: Resource>(object: Arc<K>, error: &Error, context: Arc<Context>) -> Action
where
    K::DynamicType: Default,
{
    let key = key_of(object.as_ref());
    let failures = context.record_failure(&key);
    let delay = RETRY.delay(failures);
    tracing::warn!(object = %key, %error, failures, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// The Kubernetes backend as a service: probes on the API address, the reconcilers against
/// the cluster the controller runs in (or the current kubeconfig context).
pub async fn serve(args: crate::Args, shutdown: CancellationToken) -> Result<()> {
    crate::configure_presets(args.local.functions.function_presets.as_ref())?;
    // Each replica names itself in its requests' user agent, so the API server's audit log
    // tells the leader's writes from a standby's.
    let mut config = kube::Config::infer()
        .await
        .map_err(kube::Error::InferConfig)?;
    let agent = format!("eddy-controller/{}", args.kubernetes.leader.identity());
    if let Ok(agent) = http::HeaderValue::from_str(&agent) {
        config.headers.push((http::header::USER_AGENT, agent));
    }
    let client = Client::try_from(config)?;
    let sinks = SinkPolicy {
        allowed: args.allowed_sinks.clone(),
    };
    let mut context = Context::new(client.clone(), args.kubernetes.render_config(), sinks);
    context.git_poll_interval = args.local.functions.git_poll_interval;
    context.kyma_compatibility = args.kubernetes.kyma_compatibility;
    context.apirules.clone_from(&args.local.functions.exposure);
    let context = Arc::new(context);
    let (listener, _) = eddy_platform::net::bind(args.api_addr)?;
    let probes = axum::Router::new()
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .route("/readyz", axum::routing::get(|| async { "ok" }));
    let server = eddy_platform::net::serve(
        listener,
        probes,
        &args.serve,
        eddy_platform::net::Browsers::SameOrigin,
        shutdown.clone(),
        args.serve.drain_timeout,
    );
    eddy_platform::output::say(format!(
        "controller (kubernetes backend) ready on http://{}",
        args.api_addr
    ));
    let election = &args.kubernetes.leader;
    let reconcilers = async {
        if !election.enabled {
            run(client, context, shutdown).await;
            return Ok::<(), Error>(());
        }
        let identity = election.identity();
        let Some((leading, manager)) =
            leader::leadership(client.clone(), election, identity.clone(), &shutdown).await
        else {
            return Ok(());
        };
        tracing::info!(%identity, lease = %election.lease_name, namespace = %election.lease_namespace, "competing for the lease");
        leader::while_leading(leading, shutdown, |term| {
            run(client.clone(), context.clone(), term)
        })
        .await;
        // The receiver is gone: the manager releases the lease, so a standby takes over now.
        match tokio::time::timeout(Duration::from_secs(5), manager).await {
            Ok(Ok(Err(error))) => tracing::warn!(%error, "releasing the lease"),
            Err(_) => tracing::warn!("releasing the lease took over 5s"),
            _ => {}
        }
        Ok(())
    };
    let (served, elected) = tokio::join!(server, reconcilers);
    elected?;
    Ok(served.map_err(eddy_platform::Error::Serve)?)
}

/// Runs the Function and Subscription controllers until `shutdown` (with `kyma`, also for
/// Kyma's Function and Subscription kinds).
pub async fn run(client: Client, context: Arc<Context>, shutdown: CancellationToken) {
    let kyma = context.kyma_compatibility;
    let kyma_controllers = async {
        if kyma {
            run_kyma(client.clone(), context.clone(), shutdown.clone()).await;
        }
    };
    tokio::join!(
        run_eddy(client.clone(), context.clone(), shutdown.clone()),
        kyma_controllers
    );
}

/// The controllers of Kyma's kinds: the same reconcilers behind a conversion.
async fn run_kyma(client: Client, context: Arc<Context>, shutdown: CancellationToken) {
    let (context_for_apirules, shutdown_for_apirules) = (context.clone(), shutdown.clone());
    let functions = eddy_model::kyma::function_resource();
    let subscriptions = eddy_model::kyma::subscription_resource();
    let owned = watcher::Config::default().labels("app.kubernetes.io/managed-by=eddy");
    let function_controller = Controller::new_with(
        Api::<DynamicObject>::all_with(client.clone(), &functions),
        watcher::Config::default(),
        functions.clone(),
    );
    let known = function_controller.store();
    let (secrets, named) = registry_secrets(&client);
    let function_controller = function_controller
        .owns(Api::<Job>::all(client.clone()), owned.clone())
        .owns(Api::<Deployment>::all(client.clone()), owned)
        .watches(secrets, named, move |secret: Secret| {
            reached_by_registry(&known, &secret, |_| true, &functions)
        })
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(reconcile_kyma_function, kyma_error_policy, context.clone())
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "Kyma function reconcile");
            }
        });
    let subscription_controller = Controller::new_with(
        Api::<DynamicObject>::all_with(client.clone(), &subscriptions),
        watcher::Config::default(),
        subscriptions,
    )
    .graceful_shutdown_on(shutdown.clone().cancelled_owned())
    .run(
        reconcile_kyma_subscription,
        kyma_error_policy,
        context.clone(),
    )
    .for_each(|result| async move {
        if let Err(error) = result {
            tracing::debug!(%error, "Kyma subscription reconcile");
        }
    });
    tokio::join!(
        function_controller,
        subscription_controller,
        run_apirules(client, context_for_apirules, shutdown_for_apirules)
    );
}

/// How often an APIRule that is not honoured is looked at again (a host it names may have
/// been freed).
const APIRULE_RECHECK: Duration = Duration::from_secs(15);

/// Reports on Kyma's APIRules (the gateway honours them): `Ready` with the URLs, `Warning`
/// when a rule is hidden by another, `Error` when invalid or naming a host an older APIRule
/// holds. Every APIRule is judged against all the others the controller sees.
async fn run_apirules(client: Client, context: Arc<Context>, shutdown: CancellationToken) {
    let controller = Controller::new(
        Api::<APIRule>::all(client.clone()),
        watcher::Config::default(),
    );
    let store = controller.store();
    // Kyma's Istio resource brings authorizers: every APIRule is judged again when they change.
    let serving = context.apirules.clone();
    let authorizers =
        crate::istio::follow_cluster(client.clone(), serving.clone(), shutdown.clone());
    let changes = futures::stream::unfold(
        serving.istio_authorizers.changes(),
        |mut changes| async move {
            changes.changed().await.ok()?;
            Some(((), changes))
        },
    );
    let rules = controller
        .reconcile_all_on(changes)
        .graceful_shutdown_on(shutdown.cancelled_owned())
        .run(
            move |rule: Arc<APIRule>, context: Arc<Context>| {
                let all = store.state();
                async move { reconcile_apirule(rule, all, context).await }
            },
            |rule: Arc<APIRule>, error: &Error, context: Arc<Context>| {
                let key = format!(
                    "APIRule/{}/{}",
                    rule.namespace().unwrap_or_default(),
                    rule.name_any()
                );
                let failures = context.record_failure(&key);
                tracing::warn!(object = %key, %error, failures, "reconcile failed");
                Action::requeue(RETRY.delay(failures))
            },
            context,
        )
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "APIRule reconcile");
            }
        });
    tokio::join!(authorizers, rules);
}

/// Judges one APIRule among `all` and writes its status when it changed.
pub(crate) async fn reconcile_apirule(
    rule: Arc<APIRule>,
    all: Vec<Arc<APIRule>>,
    context: Arc<Context>,
) -> Result<Action> {
    let namespace = rule.namespace().unwrap_or_default();
    let name = rule.name_any();
    // `all` may hold an older version of this one. Created in the same second, the one whose
    // name sorts first keeps a host: every replica decides the same.
    let all: Vec<&APIRule> = all.iter().map(AsRef::as_ref).collect();
    let judged = crate::apirules::judge(&rule, &all, &context.apirules, |_| false);
    let (phase, description) =
        crate::apirules::state_of(&judged, &[], &rule.spec.warnings(), ("https", None));
    let unchanged = rule.status.as_ref().is_some_and(|status| {
        status.state == phase && status.description.as_deref() == Some(description.as_str())
    });
    if !unchanged {
        let status = eddy_model::apirule::ApiRuleStatus {
            state: phase.to_owned(),
            description: Some(description),
            last_processed_time: Some(crate::status::now()),
        };
        let api: Api<APIRule> = Api::namespaced(context.client.clone(), &namespace);
        let patch = serde_json::json!({
            "apiVersion": eddy_model::apirule::API_VERSION, "kind": "APIRule", "status": status,
        });
        api.patch_status(&name, &apply_params(), &Patch::Apply(patch))
            .await?;
        tracing::info!(%namespace, %name, state = phase, "APIRule status");
    }
    context.record_success(&format!("APIRule/{namespace}/{name}"));
    Ok(if phase == "Error" {
        Action::requeue(APIRULE_RECHECK)
    } else {
        Action::await_change()
    })
}

/// The controllers of eddy's own kinds.
async fn run_eddy(client: Client, context: Arc<Context>, shutdown: CancellationToken) {
    let functions: Api<Function> = Api::all(client.clone());
    let subscriptions: Api<Subscription> = Api::all(client.clone());
    let owned = watcher::Config::default().labels("app.kubernetes.io/managed-by=eddy");
    let function_controller = Controller::new(functions, watcher::Config::default());
    let known = function_controller.store();
    let (secrets, named) = registry_secrets(&client);
    let function_controller = function_controller
        .owns(Api::<Job>::all(client.clone()), owned.clone())
        .owns(Api::<Deployment>::all(client.clone()), owned)
        .watches(secrets, named, move |secret: Secret| {
            reached_by_registry(&known, &secret, render::may_install, &())
        })
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(reconcile_function, error_policy, context.clone())
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "function reconcile");
            }
        });
    let subscription_controller = Controller::new(subscriptions, watcher::Config::default())
        .graceful_shutdown_on(shutdown.cancelled_owned())
        .run(reconcile_subscription, error_policy, context)
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "subscription reconcile");
            }
        });
    tokio::join!(function_controller, subscription_controller);
}

#[cfg(test)]
mod tests;
