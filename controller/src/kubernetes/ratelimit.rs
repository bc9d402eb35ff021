//! Kyma's RateLimits: the controller reports on them (the gateway keeps their buckets), each
//! judged among the others and the pods' labels of eddy's and Kyma's Functions, again whenever
//! a Function changes.

use std::{collections::BTreeMap, sync::Arc};

use eddy_model::{
    ratelimit::{self, RateLimit, function_pod_labels, status_of},
    resources::Function,
};
use eddy_platform::{shutdown::CancellationToken, store::StoredResource as _};
use futures::StreamExt as _;
use kube::{
    Api, Client, ResourceExt as _,
    api::{DynamicObject, Patch},
    runtime::{
        Controller, WatchStreamExt as _,
        controller::Action,
        reflector::{self, Store},
        watcher,
    },
};

use super::{Context, apply_params};
use crate::{Error, Result};

/// Reports on Kyma's RateLimits until `shutdown`: `Ready`, `Warning` when one selects no
/// Function's pods or an older one holds them, `Error` when invalid (Kyma's states and words).
pub(super) async fn run_ratelimits(
    client: Client,
    context: Arc<Context>,
    shutdown: CancellationToken,
) {
    let controller = Controller::new(
        Api::<RateLimit>::all(client.clone()),
        watcher::Config::default(),
    );
    let rate_limits = controller.store();
    let (functions, functions_writer) = reflector::store::<Function>();
    let kyma = eddy_model::kyma::function_resource();
    let kyma_writer = reflector::store::Writer::<DynamicObject>::new(kyma.clone());
    let kyma_functions = kyma_writer.as_reader();
    // Any change to a Function judges every RateLimit again (its labels may have changed).
    let function_changes = eddy_platform::watch::backed_off(
        watcher(
            Api::<Function>::all(client.clone()),
            watcher::Config::default(),
        )
        .reflect(functions_writer),
    )
    .map(|_| ());
    let kyma_changes = eddy_platform::watch::backed_off(
        watcher(
            Api::<DynamicObject>::all_with(client, &kyma),
            watcher::Config::default(),
        )
        .reflect(kyma_writer),
    )
    .map(|_| ());
    controller
        .reconcile_all_on(futures::stream::select(function_changes, kyma_changes))
        .graceful_shutdown_on(shutdown.cancelled_owned())
        .run(
            move |rate_limit: Arc<RateLimit>, context: Arc<Context>| {
                let all = rate_limits.state();
                let pods = pod_labels(&functions, &kyma_functions);
                async move { reconcile_ratelimit(rate_limit, all, pods, context).await }
            },
            |rate_limit: Arc<RateLimit>, error: &Error, context: Arc<Context>| {
                let (namespace, name) = ratelimit::key_of(&rate_limit);
                let key = format!("RateLimit/{namespace}/{name}");
                let failures = context.record_failure(&key);
                tracing::warn!(object = %key, %error, failures, "reconcile failed");
                Action::requeue(crate::kubernetes::RETRY.delay(failures))
            },
            context,
        )
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "RateLimit reconcile");
            }
        })
        .await;
}

/// Every Function's (namespace, name) and its pods' labels: eddy's and Kyma's.
fn pod_labels(
    functions: &Store<Function>,
    kyma_functions: &Store<DynamicObject>,
) -> Vec<((String, String), BTreeMap<String, String>)> {
    let eddy = functions.state().into_iter().map(|function| {
        let uid = function.uid().unwrap_or_default();
        (function.key(), function_pod_labels(&function, &uid))
    });
    let kyma = kyma_functions.state().into_iter().filter_map(|object| {
        let uid = object.uid().unwrap_or_default();
        let function =
            eddy_model::kyma::native_function(serde_json::to_value(object.as_ref()).ok()?).ok()?;
        Some((function.key(), function_pod_labels(&function, &uid)))
    });
    eddy.chain(kyma).collect()
}

/// Judges one RateLimit among `all` and writes its status when it changed.
async fn reconcile_ratelimit(
    rate_limit: Arc<RateLimit>,
    all: Vec<Arc<RateLimit>>,
    functions: Vec<((String, String), BTreeMap<String, String>)>,
    context: Arc<Context>,
) -> Result<Action> {
    let (namespace, name) = ratelimit::key_of(&rate_limit);
    let all: Vec<&RateLimit> = all.iter().map(AsRef::as_ref).collect();
    let status = status_of(
        &rate_limit,
        &all,
        functions
            .iter()
            .map(|((namespace, name), labels)| (namespace.as_str(), name.as_str(), labels)),
    );
    if rate_limit.status.as_ref() != Some(&status) {
        let api: Api<RateLimit> = Api::namespaced(context.client.clone(), &namespace);
        let patch = serde_json::json!({
            "apiVersion": ratelimit::API_VERSION, "kind": "RateLimit", "status": status,
        });
        api.patch_status(&name, &apply_params(), &Patch::Apply(patch))
            .await?;
        tracing::info!(%namespace, %name, state = %status.state, "RateLimit status");
    }
    context.record_success(&format!("RateLimit/{namespace}/{name}"));
    Ok(Action::await_change())
}
