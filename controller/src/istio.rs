//! Kyma's `Istio` resource in local mode: the oldest one in `kyma-system` gives the gateway its
//! authorizers (`spec.config.authorizers`), beside `--extension-providers`, and every Istio
//! resource gets a status saying whether it is the one read, as Kyma's Istio module reports.
//! On Kubernetes the resource is Kyma's own; see `kubernetes::istio`.

use eddy_model::istio::{self, Istio, IstioStatus};
use eddy_model::resources::describe_errors;
use eddy_platform::flags::ApiRuleArgs;
use eddy_platform::store::Store;
use kube::ResourceExt as _;

/// What an Istio resource's status says, given the one read (`None`: none is). Pure.
pub fn status_of(
    resource: &Istio,
    read: Option<&Istio>,
    serving: &ApiRuleArgs,
) -> (&'static str, String) {
    let key = |i: &Istio| (i.namespace(), i.name_any());
    match read {
        Some(read) if key(read) == key(resource) => {
            let (providers, problems) = resource.authorizers(serving.own_providers());
            if !problems.is_empty() {
                return ("Error", describe_errors(&problems));
            }
            let names = providers.names();
            if names.is_empty() {
                ("Ready", "no authorizers declared".to_owned())
            } else {
                (
                    "Ready",
                    format!("the gateway's authorizers include {}", names.join(", ")),
                )
            }
        }
        Some(read) => (
            "Warning",
            format!(
                "only the oldest Istio resource in {} is read: {}/{}",
                istio::NAMESPACE,
                istio::NAMESPACE,
                read.name_any()
            ),
        ),
        None => (
            "Warning",
            format!("only an Istio resource in {} is read", istio::NAMESPACE),
        ),
    }
}

/// Reads the Istio resources of the store, puts the authorizers of the one read in force
/// (`serving.istio_authorizers`), and writes each one's status when it changed. Returns whether
/// the authorizers in force changed.
pub async fn settle(store: &Store, serving: &ApiRuleArgs) -> bool {
    let all = match store.list::<Istio>(Some(istio::NAMESPACE)).await {
        Ok(all) => all,
        Err(error) => {
            tracing::warn!(%error, "cannot list Istio resources; the authorizers are unchanged");
            return false;
        }
    };
    let read = istio::honoured(&all);
    let authorizers = read.map_or_else(Default::default, |read| {
        read.authorizers(serving.own_providers()).0
    });
    let changed = serving.istio_authorizers.set(authorizers);
    if changed {
        tracing::info!(
            authorizers = %serving.istio_authorizers.current().names().join(","),
            "the Istio resource's authorizers are in force"
        );
    }
    for resource in &all {
        let (state, description) = status_of(resource, read, serving);
        let (namespace, name) = (
            resource.namespace().unwrap_or_default(),
            resource.name_any(),
        );
        let previous = store
            .get_status::<Istio>(&namespace, &name)
            .await
            .ok()
            .flatten();
        if previous.as_ref().is_some_and(|previous| {
            previous.state == state && previous.description.as_deref() == Some(&description)
        }) {
            continue;
        }
        let status = IstioStatus {
            state: state.to_owned(),
            description: Some(description),
        };
        if let Err(error) = store.put_status::<Istio>(&namespace, &name, &status).await {
            tracing::warn!(%error, %namespace, %name, "cannot write the Istio resource's status");
        }
    }
    changed
}

/// Follows Kyma's Istio resources in `kyma-system` on Kubernetes, where Kyma's Istio CRD exists,
/// and puts the authorizers of the one read in force (`serving.istio_authorizers`) until
/// `shutdown`. Where the CRD does not exist, the gateway has `--extension-providers` (the
/// chart's list) only; it is looked for again with backoff, so a CRD installed later is found.
/// An authorizer that cannot be used (invalid, or named as one of the chart's, which keeps the
/// name) is left out with a warning: the resource is Kyma's, and eddy writes no status on it.
pub async fn follow_cluster(
    client: kube::Client,
    serving: ApiRuleArgs,
    shutdown: eddy_platform::shutdown::CancellationToken,
) {
    use futures::StreamExt as _;
    use kube::runtime::watcher;
    let api: kube::Api<Istio> = kube::Api::namespaced(client, istio::NAMESPACE);
    let events = eddy_platform::watch::backed_off(watcher(api, watcher::Config::default()));
    let mut events = std::pin::pin!(events);
    let mut known: std::collections::BTreeMap<String, Istio> = Default::default();
    let mut relisted: Option<std::collections::BTreeMap<String, Istio>> = None;
    let mut missing_reported = false;
    loop {
        let event = tokio::select! {
            event = events.next() => event,
            () = shutdown.cancelled() => return,
        };
        match event {
            None => return,
            Some(Err(error)) => {
                let missing = matches!(
                    &error,
                    watcher::Error::InitialListFailed(kube::Error::Api(status))
                        | watcher::Error::WatchFailed(kube::Error::Api(status))
                        if status.code == 404
                );
                if !missing {
                    tracing::warn!(%error, "watching Kyma's Istio resources failed; retrying");
                } else if !missing_reported {
                    tracing::info!(
                        "no Istio CRD of Kyma (istios.operator.kyma-project.io): the \
                         authorizers are --extension-providers' only"
                    );
                    missing_reported = true;
                }
                continue;
            }
            Some(Ok(event)) => match event {
                watcher::Event::Init => {
                    relisted = Some(Default::default());
                    continue;
                }
                watcher::Event::InitApply(resource) => {
                    relisted
                        .get_or_insert_with(Default::default)
                        .insert(resource.name_any(), resource);
                    continue;
                }
                watcher::Event::InitDone => known = relisted.take().unwrap_or_default(),
                watcher::Event::Apply(resource) => {
                    known.insert(resource.name_any(), resource);
                }
                watcher::Event::Delete(resource) => {
                    known.remove(&resource.name_any());
                }
            },
        }
        missing_reported = false;
        let read = istio::honoured(known.values());
        let (authorizers, problems) = read.map_or_else(Default::default, |read| {
            read.authorizers(serving.own_providers())
        });
        if let Some(read) = read
            && !problems.is_empty()
        {
            tracing::warn!(
                istio = %format_args!("{}/{}", istio::NAMESPACE, read.name_any()),
                problems = %describe_errors(&problems),
                "authorizers of Kyma's Istio resource left out"
            );
        }
        if serving.istio_authorizers.set(authorizers) {
            tracing::info!(
                authorizers = %serving.istio_authorizers.current().names().join(","),
                "the Istio resource's authorizers are in force"
            );
        }
    }
}
