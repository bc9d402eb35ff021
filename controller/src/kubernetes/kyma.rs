//! Kyma's kinds (`serverless.kyma-project.io`, `eventing.kyma-project.io`): their
//! controllers, the same reconcilers behind a conversion, their status written back in Kyma's
//! form, and the publisher proxy's names a Function may take over.

use super::{
    Action, Api, Arc, CancellationToken, Client, ConditionType, Context, Controller, DeleteParams,
    Deployment, DynamicObject, Error, FunctionStatus, Job, Patch, RETRY, Reason, Result, Secret,
    Service, StatusPatch, SubscriptionStatus, apply_params, condition, describe_errors,
    ignore_not_found, reached_by_registry, reconcile_function, reconcile_subscription,
    registry_secrets, run_apirules, set_condition, watcher,
};
use futures::StreamExt as _;

/// Writes `status` to the Kyma object `meta` names (`kymaCompatibility`).
pub(super) async fn write_kyma_status<S: serde::Serialize + std::fmt::Debug>(
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
    ignore_not_found(
        api.patch_status(name, &apply_params(), &Patch::Apply(&body))
            .await
            .map(drop),
    )
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
            let message = describe_errors(&errors);
            let mut conditions = Vec::new();
            crate::subscriptions::set_kyma_conditions(
                &mut conditions,
                crate::subscriptions::Readiness::Invalid,
                &message,
                &crate::status::now(),
            );
            conditions.push(condition(
                ConditionType::Ready,
                Some(false),
                Reason::Invalid,
                message,
            ));
            let status = SubscriptionStatus {
                ready: false,
                conditions,
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

/// The names of Kyma's publisher proxy in `kyma-system`, which the chart's
/// `kymaCompatibility.publisherProxy` answers at (ExternalName Services to the event-bus).
pub const PUBLISHER_ALIASES: [&str; 2] =
    ["eventing-publisher-proxy", "eventing-event-publisher-proxy"];

/// A Function named as Kyma's publisher proxy in `kyma-system` (Kyma's own tests deploy a
/// publisher mock so) wins over the chart's alias of that name: the alias Service is deleted
/// so the Function's own takes the name. Anything else of that name is left to the apply.
pub(super) async fn replace_publisher_alias(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<()> {
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

/// The controllers of Kyma's kinds: the same reconcilers behind a conversion.
pub(super) async fn run_kyma(client: Client, context: Arc<Context>, shutdown: CancellationToken) {
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
        run_apirules(
            client.clone(),
            context_for_apirules.clone(),
            shutdown_for_apirules.clone()
        ),
        super::ratelimit::run_ratelimits(client, context_for_apirules, shutdown_for_apirules)
    );
}
