//! How the reconcilers write: server-side apply under one field manager, status patches, and
//! deleting what a newer version superseded.

use super::*;

pub(super) fn key_of<K: Resource>(object: &K) -> String
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

pub(super) fn apply_params() -> PatchParams {
    PatchParams::apply(render::FIELD_MANAGER).force()
}

/// The API of `object`'s kind in its namespace, and its name.
pub(super) fn api_for<'a, K>(client: &Client, object: &'a K) -> Result<(Api<K>, &'a str)>
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
pub(super) async fn apply<K>(client: &Client, object: &K) -> Result<K>
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
pub(super) async fn delete_superseded(
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
pub(super) fn rolled_out(deployment: &Deployment) -> bool {
    let Some(status) = &deployment.status else {
        return false;
    };
    let wanted = deployment.spec.replicas.unwrap_or(1);
    status.observed_generation >= deployment.metadata.generation
        && status.updated_replicas.unwrap_or(0) >= wanted
        && status.replicas.unwrap_or(0) == status.updated_replicas.unwrap_or(0)
}

/// Deletes what `params` lists, with its dependents in the background; gone already is fine.
pub(super) async fn delete_listed<K>(api: &Api<K>, params: &ListParams) -> Result<()>
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

/// `result`, with "not found" taken as done: what was to be deleted or updated is gone.
pub(super) fn ignore_not_found(result: kube::Result<()>) -> Result<()> {
    match result {
        Err(kube::Error::Api(status)) if status.is_not_found() => Ok(()),
        other => Ok(other?),
    }
}

/// The body of a server-side apply of an object's status.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct StatusPatch<'a, S> {
    pub(super) api_version: String,
    pub(super) kind: String,
    pub(super) status: &'a S,
}

/// Writes `status` when it differs from what the object has (`previous`).
pub(super) async fn write_status<K, S>(
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
    // An object deleted while it was reconciled has no status to take: nothing failed.
    ignore_not_found(
        api.patch_status(name, &apply_params(), &Patch::Apply(&body))
            .await
            .map(drop),
    )
}
