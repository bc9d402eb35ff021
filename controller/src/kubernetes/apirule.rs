//! Kyma's APIRules: the controller reports on them (the gateway honours them), judging each
//! among all the others and again when the authorizers change.

use super::{
    APIRule, Action, Api, Arc, CancellationToken, Client, Context, Controller, Duration, Error,
    Patch, RETRY, Result, apply_params, watcher,
};
use futures::StreamExt as _;
use kube::ResourceExt as _;

/// How often an APIRule that is not honoured is looked at again (a host it names may have
/// been freed).
pub(super) const APIRULE_RECHECK: Duration = Duration::from_secs(15);

/// Reports on Kyma's APIRules (the gateway honours them): `Ready` with the URLs, `Warning`
/// when a rule is hidden by another, `Error` when invalid or naming a host an older APIRule
/// holds. Every APIRule is judged against all the others the controller sees.
pub(super) async fn run_apirules(
    client: Client,
    context: Arc<Context>,
    shutdown: CancellationToken,
) {
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
