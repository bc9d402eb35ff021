//! Resources in the NATS KV bucket `eddy_resources` (local mode).
//!
//! Spec and status live under separate keys, so that the API (which writes specs) and the
//! controller (which writes status) never overwrite each other:
//! `<plural>.<namespace>.<name>` holds the resource without status, and
//! `status.<plural>.<namespace>.<name>` its status. Any process with a NATS connection can read
//! and watch them: the dispatcher resolves sinks from Function status this way.

use std::{collections::HashSet, fmt::Debug, time::Duration};

use async_nats::jetstream::{
    self,
    kv::{self, Operation},
};
use bytes::Bytes;
use futures::StreamExt as _;
use serde::{Serialize, de::DeserializeOwned};

use eddy_model::backoff::Backoff;
use eddy_model::resources::{
    Function, FunctionStatus, ObjectMeta, Subscription, SubscriptionStatus,
};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};

use crate::{nats::RESOURCES_BUCKET, shutdown::CancellationToken};

/// Errors of the resource store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// NATS did not answer or refused.
    #[error("resource store: {operation} failed: {message}")]
    Nats {
        /// What we were doing.
        operation: &'static str,
        /// What NATS said.
        message: String,
    },
    /// A stored value could not be decoded.
    #[error("resource store: {key} holds an invalid value: {source}")]
    Decode {
        /// The key.
        key: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// A concurrent writer changed the resource; reread and retry.
    #[error("resource store: {0} was changed concurrently")]
    Conflict(String),
    /// The resource has no name or namespace.
    #[error("resource store: the resource needs metadata.name")]
    Unnamed,
}

fn nats_error(operation: &'static str) -> impl FnOnce(String) -> StoreError {
    move |message| StoreError::Nats { operation, message }
}

/// A resource kept in the store.
pub trait StoredResource:
    Serialize + DeserializeOwned + Clone + Debug + Send + Sync + 'static
{
    /// Status type.
    type Status: Serialize + DeserializeOwned + Clone + Debug + Default + PartialEq + Send + Sync;
    /// `functions`, `subscriptions`.
    const PLURAL: &'static str;
    /// `Function`, `Subscription`.
    const KIND: &'static str;
    /// Metadata.
    fn meta(&self) -> &ObjectMeta;
    /// Metadata, mutable.
    fn meta_mut(&mut self) -> &mut ObjectMeta;
    /// Takes the status out (the spec key stores none).
    fn take_status(&mut self) -> Option<Self::Status>;
    /// Sets the status.
    fn set_status(&mut self, status: Option<Self::Status>);
    /// Whether two resources have the same spec.
    fn same_spec(&self, other: &Self) -> bool;

    /// `(namespace, name)`; a missing namespace is `default`, as the API stores it.
    fn key(&self) -> (String, String) {
        let meta = self.meta();
        (
            meta.namespace
                .clone()
                .unwrap_or_else(|| "default".to_owned()),
            meta.name.clone().unwrap_or_default(),
        )
    }
}

/// `StoredResource` for a kind with `metadata`, `spec` and `status` fields.
macro_rules! with_spec_and_status {
    ($kind:ty, $status:ty, $plural:literal, $name:literal) => {
        impl StoredResource for $kind {
            type Status = $status;
            const PLURAL: &'static str = $plural;
            const KIND: &'static str = $name;
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
            fn take_status(&mut self) -> Option<$status> {
                self.status.take()
            }
            fn set_status(&mut self, status: Option<$status>) {
                self.status = status;
            }
            fn same_spec(&self, other: &Self) -> bool {
                self.spec == other.spec
            }
        }
    };
}

with_spec_and_status!(Function, FunctionStatus, "functions", "Function");
with_spec_and_status!(
    Subscription,
    SubscriptionStatus,
    "subscriptions",
    "Subscription"
);
with_spec_and_status!(
    eddy_model::apirule::APIRule,
    eddy_model::apirule::ApiRuleStatus,
    "apirules",
    "APIRule"
);

with_spec_and_status!(
    eddy_model::ratelimit::RateLimit,
    eddy_model::ratelimit::RateLimitStatus,
    "ratelimits",
    "RateLimit"
);

with_spec_and_status!(
    eddy_model::istio::Istio,
    eddy_model::istio::IstioStatus,
    "istios",
    "Istio"
);

impl StoredResource for Secret {
    type Status = NoStatus;
    const PLURAL: &'static str = "secrets";
    const KIND: &'static str = "Secret";
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
    fn take_status(&mut self) -> Option<NoStatus> {
        None
    }
    fn set_status(&mut self, _status: Option<NoStatus>) {}
    fn same_spec(&self, other: &Self) -> bool {
        self.data == other.data
            && self.string_data == other.string_data
            && self.type_ == other.type_
            && self.metadata.labels == other.metadata.labels
            && self.metadata.annotations == other.metadata.annotations
    }
}

impl StoredResource for ConfigMap {
    type Status = NoStatus;
    const PLURAL: &'static str = "configmaps";
    const KIND: &'static str = "ConfigMap";
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
    fn take_status(&mut self) -> Option<NoStatus> {
        None
    }
    fn set_status(&mut self, _status: Option<NoStatus>) {}
    fn same_spec(&self, other: &Self) -> bool {
        self.data == other.data
            && self.binary_data == other.binary_data
            && self.metadata.labels == other.metadata.labels
            && self.metadata.annotations == other.metadata.annotations
    }
}

/// The status of kinds that have none (Secret, ConfigMap).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NoStatus {}

/// The key of a resource's spec.
pub fn spec_key<R: StoredResource>(namespace: &str, name: &str) -> String {
    format!("{}.{namespace}.{name}", R::PLURAL)
}

/// The key of a resource's status.
pub fn status_key<R: StoredResource>(namespace: &str, name: &str) -> String {
    format!("status.{}.{namespace}.{name}", R::PLURAL)
}

/// A change seen by [`Store::watch`].
#[derive(Debug, Clone)]
pub enum Change<R> {
    /// Created or updated.
    Applied(R),
    /// Deleted.
    Deleted {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
    /// Every resource that existed when the watch started has been seen.
    Synced,
}

impl<R: StoredResource> Change<R> {
    /// `(namespace, name)` of the resource applied or deleted.
    pub fn key(&self) -> Option<(String, String)> {
        match self {
            Self::Applied(resource) => Some(resource.key()),
            Self::Deleted { namespace, name } => Some((namespace.clone(), name.clone())),
            Self::Synced => None,
        }
    }
}

/// The resource store; cheap to clone.
#[derive(Clone)]
pub struct Store {
    kv: kv::Store,
}

impl Store {
    /// Opens the bucket, creating it when missing.
    pub async fn open(js: &jetstream::Context, replicas: usize) -> Result<Self, StoreError> {
        let kv = match js.get_key_value(RESOURCES_BUCKET).await {
            Ok(kv) => kv,
            Err(_) => js
                .create_key_value(kv::Config {
                    bucket: RESOURCES_BUCKET.to_owned(),
                    description: "eddy: Functions and Subscriptions (local mode)".to_owned(),
                    history: 5,
                    storage: jetstream::stream::StorageType::File,
                    num_replicas: replicas,
                    ..Default::default()
                })
                .await
                .map_err(|e| nats_error("create bucket")(e.to_string()))?,
        };
        Ok(Self { kv })
    }

    /// Reads one resource with its status; `resourceVersion` is the spec key's revision.
    pub async fn get<R: StoredResource>(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<R>, StoreError> {
        let key = spec_key::<R>(namespace, name);
        let Some(entry) = self
            .kv
            .entry(&key)
            .await
            .map_err(|e| nats_error("get")(e.to_string()))?
        else {
            return Ok(None);
        };
        if entry.operation != Operation::Put {
            return Ok(None);
        }
        let mut resource: R = decode(&key, &entry.value)?;
        resource.meta_mut().resource_version = Some(entry.revision.to_string());
        resource.set_status(self.get_status::<R>(namespace, name).await?);
        Ok(Some(resource))
    }

    /// Reads a status alone.
    pub async fn get_status<R: StoredResource>(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<R::Status>, StoreError> {
        let key = status_key::<R>(namespace, name);
        match self
            .kv
            .get(&key)
            .await
            .map_err(|e| nats_error("get status")(e.to_string()))?
        {
            Some(value) if !value.is_empty() => Ok(Some(decode(&key, &value)?)),
            _ => Ok(None),
        }
    }

    /// Lists resources of a kind, in one namespace or all, sorted by namespace and name.
    pub async fn list<R: StoredResource>(
        &self,
        namespace: Option<&str>,
    ) -> Result<Vec<R>, StoreError> {
        let prefix = match namespace {
            Some(namespace) => format!("{}.{namespace}.", R::PLURAL),
            None => format!("{}.", R::PLURAL),
        };
        let mut keys = match self.kv.keys().await {
            Ok(keys) => keys,
            Err(error) => return Err(nats_error("list")(error.to_string())),
        };
        let mut names = Vec::new();
        while let Some(key) = keys.next().await {
            let key = key.map_err(|e| nats_error("list")(e.to_string()))?;
            if let Some(rest) = key.strip_prefix(&prefix) {
                let (namespace, name) = match namespace {
                    Some(namespace) => (namespace.to_owned(), rest.to_owned()),
                    None => match rest.split_once('.') {
                        Some((namespace, name)) => (namespace.to_owned(), name.to_owned()),
                        None => continue,
                    },
                };
                names.push((namespace, name));
            }
        }
        names.sort();
        let mut resources = Vec::with_capacity(names.len());
        for (namespace, name) in names {
            if let Some(resource) = self.get::<R>(&namespace, &name).await? {
                resources.push(resource);
            }
        }
        Ok(resources)
    }

    /// Creates or replaces a resource's spec. Keeps uid and creation time, bumps the generation
    /// when the spec changed, and refuses to overwrite a concurrent change. Returns the stored
    /// resource and whether it was created.
    pub async fn apply<R: StoredResource>(&self, mut resource: R) -> Result<(R, bool), StoreError> {
        let namespace = resource
            .meta()
            .namespace
            .clone()
            .unwrap_or_else(|| "default".to_owned());
        let name = resource.meta().name.clone().ok_or(StoreError::Unnamed)?;
        resource.meta_mut().namespace = Some(namespace.clone());
        let key = spec_key::<R>(&namespace, &name);
        let existing = self
            .kv
            .entry(&key)
            .await
            .map_err(|e| nats_error("get")(e.to_string()))?;
        let existing = match existing {
            Some(entry) if entry.operation == Operation::Put => {
                let old: R = decode(&key, &entry.value)?;
                Some((old, entry.revision))
            }
            _ => None,
        };
        resource.take_status();
        let meta = resource.meta_mut();
        meta.resource_version = None;
        meta.managed_fields = None;
        let created = existing.is_none();
        match &existing {
            Some((old, _)) => {
                let old_meta = old.meta();
                let generation = old_meta.generation.unwrap_or(1);
                let changed = !old.same_spec(&resource);
                let meta = resource.meta_mut();
                meta.uid.clone_from(&old_meta.uid);
                meta.creation_timestamp
                    .clone_from(&old_meta.creation_timestamp);
                meta.generation = Some(if changed { generation + 1 } else { generation });
            }
            None => {
                let meta = resource.meta_mut();
                meta.uid = Some(new_uid());
                meta.creation_timestamp =
                    Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                        k8s_openapi::jiff::Timestamp::now(),
                    ));
                meta.generation = Some(1);
            }
        }
        let value =
            Bytes::from(
                serde_json::to_vec(&resource).map_err(|source| StoreError::Decode {
                    key: key.clone(),
                    source,
                })?,
            );
        let revision = match existing {
            Some((_, revision)) => {
                self.kv
                    .update(&key, value, revision)
                    .await
                    .map_err(|error| {
                        if error.kind() == kv::UpdateErrorKind::WrongLastRevision {
                            StoreError::Conflict(key.clone())
                        } else {
                            nats_error("update")(error.to_string())
                        }
                    })?
            }
            None => self.kv.create(&key, value).await.map_err(|error| {
                if error.kind() == kv::CreateErrorKind::AlreadyExists {
                    StoreError::Conflict(key.clone())
                } else {
                    nats_error("create")(error.to_string())
                }
            })?,
        };
        resource.meta_mut().resource_version = Some(revision.to_string());
        resource.set_status(self.get_status::<R>(&namespace, &name).await?);
        Ok((resource, created))
    }

    /// Deletes a resource's spec (its controller removes the status when it has cleaned up).
    /// Returns whether it existed.
    pub async fn delete<R: StoredResource>(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<bool, StoreError> {
        let key = spec_key::<R>(namespace, name);
        let exists = matches!(
            self.kv.entry(&key).await.map_err(|e| nats_error("get")(e.to_string()))?,
            Some(entry) if entry.operation == Operation::Put
        );
        if exists {
            self.kv
                .delete(&key)
                .await
                .map_err(|e| nats_error("delete")(e.to_string()))?;
        }
        Ok(exists)
    }

    /// Writes a status.
    pub async fn put_status<R: StoredResource>(
        &self,
        namespace: &str,
        name: &str,
        status: &R::Status,
    ) -> Result<(), StoreError> {
        let key = status_key::<R>(namespace, name);
        let value = serde_json::to_vec(status).map_err(|source| StoreError::Decode {
            key: key.clone(),
            source,
        })?;
        self.kv
            .put(&key, value.into())
            .await
            .map_err(|e| nats_error("put status")(e.to_string()))?;
        Ok(())
    }

    /// Removes a status.
    pub async fn delete_status<R: StoredResource>(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<(), StoreError> {
        let key = status_key::<R>(namespace, name);
        self.kv
            .delete(&key)
            .await
            .map_err(|e| nats_error("delete status")(e.to_string()))?;
        Ok(())
    }

    /// Watches the specs of a kind: every current resource first, then [`Change::Synced`], then
    /// changes as they happen. The stream ends when the watch breaks (NATS restarted, say);
    /// callers watch again and treat the new initial list as the truth.
    pub async fn watch<R: StoredResource>(
        &self,
    ) -> Result<
        impl futures::Stream<Item = Result<Change<R>, StoreError>> + Send + use<R>,
        StoreError,
    > {
        self.watch_prefix(format!("{}.", R::PLURAL), |entry, _, _| {
            decode::<R>(&entry.key, &entry.value).map(|mut resource| {
                resource.meta_mut().resource_version = Some(entry.revision.to_string());
                Some(resource)
            })
        })
        .await
    }

    /// Watches the status of a kind (for caches such as the dispatcher's sink table), as
    /// [`Store::watch`] does specs. A status that does not decode is logged and skipped.
    pub async fn watch_status<R: StoredResource>(
        &self,
    ) -> Result<
        impl futures::Stream<Item = Result<Change<StatusOf<R>>, StoreError>> + Send + use<R>,
        StoreError,
    > {
        self.watch_prefix(
            format!("status.{}.", R::PLURAL),
            |entry, namespace, name| match serde_json::from_slice(&entry.value) {
                Ok(status) => Ok(Some(StatusOf {
                    namespace: namespace.to_owned(),
                    name: name.to_owned(),
                    status,
                })),
                Err(error) => {
                    tracing::warn!(key = %entry.key, %error, "status does not decode; skipped");
                    Ok(None)
                }
            },
        )
        .await
    }

    /// The watch behind [`Store::watch`] and [`Store::watch_status`]: keys `<prefix><ns>.<name>`,
    /// values turned into `T` by `decode` (`None` skips one).
    async fn watch_prefix<T, D>(
        &self,
        prefix: String,
        decode: D,
    ) -> Result<
        impl futures::Stream<Item = Result<Change<T>, StoreError>> + Send + use<T, D>,
        StoreError,
    >
    where
        T: Send + 'static,
        D: Fn(&kv::Entry, &str, &str) -> Result<Option<T>, StoreError> + Send + 'static,
    {
        let mut watch = self
            .kv
            .watch_with_history(format!("{prefix}>"))
            .await
            .map_err(|e| nats_error("watch")(e.to_string()))?;
        // An empty prefix yields no entry to carry `seen_current`; ask whether there is one.
        let initially_empty = !self.has_keys(&prefix).await?;
        let stream = task_stream(move |sender| async move {
            let mut synced = false;
            if initially_empty {
                synced = true;
                if sender.send(Ok(Change::Synced)).await.is_err() {
                    return;
                }
            }
            while let Some(entry) = watch.next().await {
                let (change, seen_current) = match entry {
                    Err(error) => (Err(nats_error("watch")(error.to_string())), false),
                    Ok(entry) => {
                        let rest = entry.key.strip_prefix(&prefix).unwrap_or(&entry.key);
                        let (namespace, name) = rest.split_once('.').unwrap_or(("", rest));
                        let change = match entry.operation {
                            Operation::Put => decode(&entry, namespace, name)
                                .map(|decoded| decoded.map(Change::Applied)),
                            Operation::Delete | Operation::Purge => Ok(Some(Change::Deleted {
                                namespace: namespace.to_owned(),
                                name: name.to_owned(),
                            })),
                        };
                        (change, entry.seen_current)
                    }
                };
                let failed = change.is_err();
                if let Some(change) = change.transpose()
                    && (sender.send(change).await.is_err() || failed)
                {
                    return;
                }
                if seen_current && !synced {
                    synced = true;
                    if sender.send(Ok(Change::Synced)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(stream)
    }

    /// Whether any key starts with `prefix`.
    async fn has_keys(&self, prefix: &str) -> Result<bool, StoreError> {
        let mut keys = self
            .kv
            .keys()
            .await
            .map_err(|e| nats_error("list")(e.to_string()))?;
        while let Some(key) = keys.next().await {
            if key
                .map_err(|e| nats_error("list")(e.to_string()))?
                .starts_with(prefix)
            {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// One resource's status, as [`Store::watch_status`] reports it.
#[derive(Debug, Clone)]
pub struct StatusOf<R: StoredResource> {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// The status.
    pub status: R::Status,
}

fn decode<T: DeserializeOwned>(key: &str, value: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(value).map_err(|source| StoreError::Decode {
        key: key.to_owned(),
        source,
    })
}

fn new_uid() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// A stream fed by a task: simpler than a hand-written state machine for a loop with sends.
fn task_stream<T, F, Fut>(body: F) -> impl futures::Stream<Item = T> + Send
where
    T: Send + 'static,
    F: FnOnce(tokio::sync::mpsc::Sender<T>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (sender, receiver) = tokio::sync::mpsc::channel(64);
    tokio::spawn(body(sender));
    tokio_stream::wrappers::ReceiverStream::new(receiver)
}

/// What a watch that breaks and lists everything again needs to report the deletions it missed
/// while it was down: the keys known from before, and those listed since the watch (re)started.
/// Pure; used by [`Store::follow`] and by the dispatcher's Kubernetes watch.
#[derive(Debug, Default)]
pub struct Resync {
    known: HashSet<(String, String)>,
    listed: HashSet<(String, String)>,
}

impl Resync {
    /// A watch (re)starts: its initial list follows.
    pub fn restart(&mut self) {
        self.listed.clear();
    }

    /// A resource was listed or changed.
    pub fn applied(&mut self, key: (String, String)) {
        self.listed.insert(key.clone());
        self.known.insert(key);
    }

    /// A resource was deleted.
    pub fn deleted(&mut self, key: &(String, String)) {
        self.listed.remove(key);
        self.known.remove(key);
    }

    /// The initial list is complete: what was known and not listed again is gone (returned,
    /// and forgotten).
    pub fn synced(&mut self) -> Vec<(String, String)> {
        let gone: Vec<(String, String)> = self.known.difference(&self.listed).cloned().collect();
        for key in &gone {
            self.known.remove(key);
        }
        gone
    }
}

impl Store {
    /// Follows the specs of a kind until `shutdown`, handing every change to `on_change`. A
    /// broken watch is set up again with backoff; after each (re)watch's initial list,
    /// resources that disappeared meanwhile are reported as deleted, then [`Change::Synced`].
    pub async fn follow<R, F, Fut>(&self, shutdown: &CancellationToken, on_change: F)
    where
        R: StoredResource,
        F: FnMut(Change<R>) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        follow_watch(R::KIND, shutdown, || self.watch::<R>(), R::key, on_change).await;
    }

    /// Follows the status of a kind until `shutdown`, as [`Store::follow`] follows specs.
    pub async fn follow_status<R, F, Fut>(&self, shutdown: &CancellationToken, on_change: F)
    where
        R: StoredResource,
        F: FnMut(Change<StatusOf<R>>) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let key = |status: &StatusOf<R>| (status.namespace.clone(), status.name.clone());
        follow_watch(
            R::KIND,
            shutdown,
            || self.watch_status::<R>(),
            key,
            on_change,
        )
        .await;
    }
}

/// The one watch-with-resync loop: opens the watch, hands on its changes, reports what a relist
/// no longer has as deleted, and opens it again with [`REWATCH`] backoff when it breaks.
async fn follow_watch<T, W, WFut, S, K, F, Fut>(
    kind: &'static str,
    shutdown: &CancellationToken,
    mut open: W,
    key_of: K,
    mut on_change: F,
) where
    W: FnMut() -> WFut,
    WFut: std::future::Future<Output = Result<S, StoreError>>,
    S: futures::Stream<Item = Result<Change<T>, StoreError>>,
    K: Fn(&T) -> (String, String),
    F: FnMut(Change<T>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut resync = Resync::default();
    let mut failures = 0;
    loop {
        let watch = match open().await {
            Ok(watch) => watch,
            Err(error) => {
                failures += 1;
                tracing::warn!(%error, kind, "cannot watch; retrying");
                tokio::select! {
                    () = tokio::time::sleep(REWATCH.delay(failures)) => continue,
                    () = shutdown.cancelled() => return,
                }
            }
        };
        failures = 0;
        let mut watch = std::pin::pin!(watch);
        resync.restart();
        loop {
            let change = tokio::select! {
                change = watch.next() => change,
                () = shutdown.cancelled() => return,
            };
            match change {
                Some(Ok(Change::Applied(resource))) => {
                    resync.applied(key_of(&resource));
                    on_change(Change::Applied(resource)).await;
                }
                Some(Ok(Change::Deleted { namespace, name })) => {
                    let key = (namespace, name);
                    resync.deleted(&key);
                    on_change(Change::Deleted {
                        namespace: key.0,
                        name: key.1,
                    })
                    .await;
                }
                Some(Ok(Change::Synced)) => {
                    for (namespace, name) in resync.synced() {
                        on_change(Change::Deleted { namespace, name }).await;
                    }
                    on_change(Change::Synced).await;
                }
                Some(Err(error)) => {
                    tracing::warn!(%error, kind, "watch failed; watching again");
                    break;
                }
                None => break,
            }
        }
        tokio::select! {
            () = tokio::time::sleep(REWATCH.delay(1)) => {}
            () = shutdown.cancelled() => return,
        }
    }
}

/// Runs `attempt` until it succeeds, waiting [`REWATCH`] delays between tries: for start-up
/// steps that need NATS, which may come up after the service. Gives up with the last error
/// after `max_retries` failures or once `shutdown` fires; each failure is logged as `waiting`.
pub async fn retry_at_start<T, E, F, Fut>(
    waiting: &str,
    max_retries: u32,
    shutdown: &CancellationToken,
    mut attempt: F,
) -> Result<T, E>
where
    E: std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let mut failures = 0;
    loop {
        match attempt().await {
            Ok(value) => return Ok(value),
            Err(error) if failures < max_retries && !shutdown.is_cancelled() => {
                failures += 1;
                tracing::warn!(%error, attempt = failures, "{waiting}");
                tokio::select! {
                    () = tokio::time::sleep(REWATCH.delay(failures)) => {}
                    // One more attempt, which then returns its error: start-up ends at once.
                    () = shutdown.cancelled() => {}
                }
            }
            Err(error) => return Err(error),
        }
    }
}

/// Delays before watching again after a watch broke, and between start-up attempts.
pub const REWATCH: Backoff =
    Backoff::exponential(Duration::from_millis(400), Duration::from_secs(5));

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn start_up_retries_end_when_shutdown_fires_not_after_the_backoff() {
        let shutdown = CancellationToken::new();
        let trigger = shutdown.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            trigger.cancel();
        });
        let started = tokio::time::Instant::now();
        let mut attempts = 0;
        let result: Result<(), &str> = retry_at_start("waiting", 60, &shutdown, || {
            attempts += 1;
            async { Err("NATS not there") }
        })
        .await;
        assert_eq!(result, Err("NATS not there"));
        assert_eq!(attempts, 2, "one try, then one more once shutdown fired");
        // The clock is paused: elapsed time is exactly when the shutdown fired, well before the
        // first backoff (400 ms) would have ended.
        assert_eq!(started.elapsed(), Duration::from_millis(50));
    }

    fn key(name: &str) -> (String, String) {
        ("default".to_owned(), name.to_owned())
    }

    #[test]
    fn a_relist_reports_what_went_while_the_watch_was_down() {
        let mut resync = Resync::default();
        resync.restart();
        resync.applied(key("a"));
        resync.applied(key("b"));
        resync.applied(key("c"));
        assert!(resync.synced().is_empty(), "the first list misses nothing");
        resync.deleted(&key("c"));

        // The watch breaks; b goes meanwhile; the relist has a and a new d.
        resync.restart();
        resync.applied(key("a"));
        resync.applied(key("d"));
        assert_eq!(resync.synced(), vec![key("b")]);
        // Reported once: the next relist of the same set finds nothing gone.
        resync.restart();
        resync.applied(key("a"));
        resync.applied(key("d"));
        assert!(resync.synced().is_empty());
    }
}
