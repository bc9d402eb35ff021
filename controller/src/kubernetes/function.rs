//! A Function's reconcile: its ConfigMap, build Job or buildless pods, Deployment, Service
//! and HPA brought in line with its spec, the package registry Secret its install reads, and
//! its status.

use super::{
    Action, Api, Arc, BuildMode, BuildState, Client, ConditionType, Context, DeleteParams,
    Duration, Error, Function, FunctionStatus, GitCredentials, HorizontalPodAutoscaler,
    INSTALL_CHECK, Job, ListParams, Pod, PropagationPolicy, REPORT_RETRIES_AFTER, RESYNC, Reason,
    Rendered, Resource, Result, Secret, Timestamp, Written, apply, apply_unless_written,
    build_attempt, build_log_tail, build_retry_at, build_state, condition, delete_superseded,
    delete_unless_written, describe_errors, ignore_not_found, install_failure,
    is_namespace_terminating, is_permanent, key_of, render, render_with, replace_publisher_alias,
    rolled_out, running_condition, set_condition, unschedulable, validate_function, watcher,
    with_build_attempt, write_status,
};
use kube::ResourceExt as _;

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
        Err(error) => {
            let failures = context.failures_of(&key).saturating_add(1);
            if failures > REPORT_RETRIES_AFTER {
                report_retrying(&function, &context, failures, &error).await;
            }
            Err(error)
        }
    }
}

/// Says in status that reconciles keep failing and are retried: `Running` Unknown with
/// `ApplyFailed` and the last error (what ran before keeps running). Best effort: when the
/// API server is what fails, this write fails too, and the log has it.
async fn report_retrying(function: &Function, context: &Context, failures: u32, error: &Error) {
    let mut status = function.status.clone().unwrap_or_default();
    set_condition(
        &mut status.conditions,
        condition(
            ConditionType::Running,
            None,
            Reason::ApplyFailed,
            format!("{failures} attempts failed, retrying: {error}"),
        ),
    );
    if let Err(write) =
        write_status(&context.client, function, function.status.as_ref(), &status).await
    {
        tracing::debug!(error = %write, "cannot report the retries in status");
    }
}

pub(super) async fn reconcile_function_once(
    function: &Function,
    context: &Context,
) -> Result<Action> {
    let client = &context.client;
    let namespace = function.namespace().ok_or(Error::Incomplete("namespace"))?;
    let name = function.name_any();
    let previous = function.status.clone();
    let mut status = previous.clone().unwrap_or_default();
    status.observed_generation = function.metadata.generation;
    let errors = validate_function(function);
    let action = if !errors.is_empty() {
        // The CRD's rules refuse these but an annotation (CEL cannot read annotations); an
        // object stored before a rule existed ends here too.
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
        let registry = package_registry(client, &context.written, &namespace, function).await?;
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
        let target = Rollout {
            client,
            written: &context.written,
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
pub(super) struct Rollout<'a> {
    client: &'a Client,
    /// What was written lately (not sent again).
    written: &'a Written,
    namespace: &'a str,
    name: &'a str,
    rendered: &'a Rendered,
    /// Pods that take their sources from the ConfigMap (`--build buildless`).
    buildless: bool,
}

impl Rollout<'_> {
    /// Buildless: the sources' ConfigMap, then the Deployment on the runtime image (its pods
    /// install the dependencies when they start).
    async fn deploy_buildless(
        &self,
        status: &mut FunctionStatus,
        function: &Function,
    ) -> Result<Duration> {
        apply_unless_written(self.client, self.written, &self.rendered.config_map).await?;
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
            apply_unless_written(self.client, self.written, &rendered.config_map).await?;
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
        apply_unless_written(self.client, self.written, &rendered.service).await?;
        match &rendered.autoscaler {
            Some(autoscaler) => {
                apply_unless_written(self.client, self.written, autoscaler).await?;
            }
            None => {
                let autoscalers: Api<HorizontalPodAutoscaler> =
                    Api::namespaced(self.client.clone(), self.namespace);
                delete_unless_written(self.written, &autoscalers, self.namespace, self.name)
                    .await?;
            }
        }
        // A buildless pod mounts its ConfigMap: the old ones stay until the rollout is done.
        if !self.buildless || rolled_out(&deployment) {
            delete_superseded(
                self.client,
                self.written,
                self.namespace,
                self.name,
                &rendered.hash,
            )
            .await?;
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

/// Kyma's package registry Secrets, watched by that name alone (the chart grants list and
/// watch of no other Secret), so a Function is reconciled again when the Secret its install
/// reads appears, changes or goes.
pub(super) fn registry_secrets(client: &Client) -> (Api<Secret>, watcher::Config) {
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
pub(super) fn reached_by_registry<K>(
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
pub(super) async fn package_registry(
    client: &Client,
    written: &Written,
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
            apply_unless_written(client, written, &copy).await?;
            chosen.name = PACKAGE_REGISTRY_COPY.to_owned();
            Ok(Some(chosen))
        }
        (_, chosen) => {
            // A copy of a cluster-wide Secret that no longer applies goes (its credentials
            // with it).
            if delete_unless_written(written, &secrets, namespace, PACKAGE_REGISTRY_COPY).await? {
                tracing::info!(%namespace, "deleted the copy of the cluster-wide package registry Secret");
            }
            Ok(chosen)
        }
    }
}

/// The commit a Git source's reference names now, with the credentials its Secret holds;
/// or why it cannot be known (the reason and message for BuildReady). API errors are
/// returned as errors (retried).
pub(super) async fn resolve_commit(
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
                Err(missing) => {
                    return Ok(Err((
                        Reason::ReferenceNotFound,
                        format!(
                            "spec.source.gitRepository.auth: Secret {} has {missing}",
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

pub(super) fn saturating_i32(value: u32) -> i32 {
    i32::try_from(value).unwrap_or(i32::MAX)
}

pub(super) fn has_condition(status: &FunctionStatus, type_: ConditionType) -> bool {
    status.conditions.iter().any(|c| c.type_ == type_.as_str())
}
