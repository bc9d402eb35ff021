//! The Kubernetes backend: Functions become a ConfigMap, a build Job, a Deployment, a Service
//! and an HPA (the flow Kyma Serverless users know); Subscriptions are validated and get their
//! status. Objects are written with server-side apply under one field manager and owned by
//! their Function, so deleting the Function removes them.
//!
//! The decisions (what to render, where a build stands, whether a Deployment runs, which
//! errors are permanent) are pure functions; [`reconcile_function`] and
//! [`reconcile_subscription`] only read and write through the API.

mod apirule;
mod apply;
pub mod args;
mod function;
mod kyma;
pub mod leader;
mod progress;
mod ratelimit;
pub mod render;
mod subscription;

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
    Api, Client, Resource,
    api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PropagationPolicy},
    runtime::{Controller, controller::Action, watcher},
};

pub(crate) use self::apirule::*;
use self::apply::*;
pub use self::{function::*, kyma::*, progress::*, subscription::*};
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
    /// What was written lately, not to be sent again.
    written: Written,
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
            written: Written::default(),
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

    /// Consecutive failed reconciles of `key` so far (the one under way not counted).
    fn failures_of(&self, key: &str) -> u32 {
        self.failures.lock().get(key).copied().unwrap_or(0)
    }

    fn record_failure(&self, key: &str) -> u32 {
        let mut failures = self.failures.lock();
        let count = failures.entry(key.to_owned()).or_insert(0);
        *count = count.saturating_add(1);
        *count
    }
}

/// After this many consecutive failed reconciles with errors that are retried, a Function's
/// status says so (about 7 s with [`RETRY`]): a webhook that times out, or an API server that
/// keeps answering 5xx, is otherwise seen only in the controller's log.
pub const REPORT_RETRIES_AFTER: u32 = 3;

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
    let sinks = args.sinks.policy();
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
        leader::lead(leading, manager, shutdown, |term| {
            run(client.clone(), context.clone(), term)
        })
        .await
    };
    let (served, elected) = tokio::join!(server, reconcilers);
    elected?;
    Ok(served.map_err(eddy_platform::Error::Serve)?)
}

/// Runs the Function and Subscription controllers until `shutdown` (with `kyma`, also for
/// Kyma's Function and Subscription kinds).
pub async fn run(client: Client, context: Arc<Context>, shutdown: CancellationToken) {
    // A term starts knowing nothing of what it wrote: another replica may have led meanwhile.
    context.written.clear();
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
