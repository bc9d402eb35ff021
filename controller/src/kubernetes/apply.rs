//! How the reconcilers write: server-side apply under one field manager, status patches, and
//! deleting what a newer version superseded.

use super::{
    Api, Client, ConfigMap, DeleteParams, Deployment, Duration, Error, HashMap, Job, ListParams,
    Mutex, Patch, PatchParams, PropagationPolicy, RESYNC, Resource, Result, render,
    write_kyma_status,
};
use kube::ResourceExt as _;

pub(super) fn key_of<K: Resource>(object: &K) -> String
where
    K::DynamicType: Default,
{
    key_of_named::<K>(
        object.meta().namespace.as_deref().unwrap_or_default(),
        object.meta().name.as_deref().unwrap_or_default(),
    )
}

/// [`key_of`] an object of kind `K` known by its namespace and name.
fn key_of_named<K: Resource>(namespace: &str, name: &str) -> String
where
    K::DynamicType: Default,
{
    format!("{}/{namespace}/{name}", K::kind(&Default::default()))
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

/// What this controller has written lately, so that a reconcile which would write the same
/// again sends nothing. Every change of a Function's Deployment (each step of a rollout, each
/// scale) reconciles the Function; without this, each of those re-applied its ConfigMap and
/// Service and deleted an HPA that was not there: four or five API writes that change nothing.
///
/// An entry holds for [`WRITTEN_FOR`]: eddy does not watch ConfigMaps or Services, so an
/// object someone else changed or deleted is put right at the first reconcile after that (the
/// periodic resync at the latest). Entries go when eddy deletes the object and when a
/// leadership term starts (another replica may have written in between).
#[derive(Default)]
pub(super) struct Written {
    entries: Mutex<HashMap<String, (u64, std::time::Instant)>>,
}

/// How long a write is trusted to still hold: under the resync period, so every other resync
/// at least writes again.
pub(super) const WRITTEN_FOR: Duration = Duration::from_secs(RESYNC.as_secs() / 2);

/// What [`Written`] records for an object known to be absent.
const ABSENT: u64 = 0;

impl Written {
    fn holds(&self, key: &str, digest: u64) -> bool {
        self.entries
            .lock()
            .get(key)
            .is_some_and(|(written, at)| *written == digest && at.elapsed() < WRITTEN_FOR)
    }

    fn record(&self, key: String, digest: u64) {
        self.entries
            .lock()
            .insert(key, (digest, std::time::Instant::now()));
    }

    fn forget(&self, key: &str) {
        self.entries.lock().remove(key);
    }

    /// Forgets everything (a new leadership term).
    pub(super) fn clear(&self) {
        self.entries.lock().clear();
    }
}

/// The digest [`Written`] keeps of an object as it is applied (never [`ABSENT`]); `None` for
/// one that does not serialize, which is then always sent (and refused there, with its error).
fn digest_of<T: serde::Serialize>(object: &T) -> Option<u64> {
    use std::hash::Hasher as _;
    /// Feeds the JSON straight into the hasher, without a buffer.
    struct Feed(std::collections::hash_map::DefaultHasher);
    impl std::io::Write for Feed {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.write(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut feed = Feed(std::collections::hash_map::DefaultHasher::new());
    serde_json::to_writer(&mut feed, object).ok()?;
    Some(feed.0.finish().max(ABSENT + 1))
}

/// [`apply`], unless this very object was applied within [`WRITTEN_FOR`].
pub(super) async fn apply_unless_written<K>(
    client: &Client,
    written: &Written,
    object: &K,
) -> Result<()>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let key = key_of(object);
    let digest = digest_of(object);
    if digest.is_some_and(|digest| written.holds(&key, digest)) {
        return Ok(());
    }
    apply(client, object).await?;
    if let Some(digest) = digest {
        written.record(key, digest);
    }
    Ok(())
}

/// Deletes `name` of `api`'s kind (gone already is fine), unless it was deleted, or found
/// absent, within [`WRITTEN_FOR`]. Whether something was there to delete.
pub(super) async fn delete_unless_written<K>(
    written: &Written,
    api: &Api<K>,
    namespace: &str,
    name: &str,
) -> Result<bool>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    K::DynamicType: Default,
{
    let key = key_of_named::<K>(namespace, name);
    if written.holds(&key, ABSENT) {
        return Ok(false);
    }
    let deleted = match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => true,
        Err(kube::Error::Api(status)) if status.is_not_found() => false,
        Err(error) => return Err(error.into()),
    };
    written.record(key, ABSENT);
    Ok(deleted)
}

/// Deletes the objects of `function` whose build hash is not `hash`: superseded build Jobs
/// (with their pods) and ConfigMaps. Once done for `hash`, done until [`WRITTEN_FOR`] has
/// passed: nothing makes objects of an older build meanwhile.
pub(super) async fn delete_superseded(
    client: &Client,
    written: &Written,
    namespace: &str,
    function: &str,
    hash: &str,
) -> Result<()> {
    let key = format!("superseded/{namespace}/{function}");
    let digest = digest_of(&hash).unwrap_or(ABSENT + 1);
    if written.holds(&key, digest) {
        return Ok(());
    }
    let selector = format!(
        "{}={function},{}!={hash}",
        render::FUNCTION_LABEL,
        render::BUILD_HASH_LABEL
    );
    let params = ListParams::default().labels(&selector);
    delete_listed(
        &Api::<Job>::namespaced(client.clone(), namespace),
        written,
        &params,
    )
    .await?;
    delete_listed(
        &Api::<ConfigMap>::namespaced(client.clone(), namespace),
        written,
        &params,
    )
    .await?;
    written.record(key, digest);
    Ok(())
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
/// What is deleted is no longer [`Written`]: applied again, it is sent again.
pub(super) async fn delete_listed<K>(
    api: &Api<K>,
    written: &Written,
    params: &ListParams,
) -> Result<()>
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
        written.forget(&key_of_named::<K>(
            object.metadata.namespace.as_deref().unwrap_or_default(),
            &object.name_any(),
        ));
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
