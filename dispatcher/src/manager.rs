//! Keeps one worker per Subscription in line with the stored Subscriptions: started, restarted
//! with the new settings when the spec changes (the consumer is updated in place), stopped and
//! its consumer deleted when the Subscription goes. Replays run beside the live workers.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use eddy_model::resources::{
    SinkPolicy, Subscription, consumer_name, describe_errors, validate_subscription,
};
use eddy_platform::{
    nats::EVENTS_STREAM,
    shutdown::CancellationToken,
    store::{Change, Store, StoredResource as _},
};
use futures::StreamExt as _;
use tokio::task::JoinHandle;

use crate::{
    Error, Result,
    consumer::{ConsumerPlan, consumer_config},
    worker::{self, Shared, Target},
};

type Key = (String, String);

/// Where the dispatcher learns about Subscriptions.
pub enum SubscriptionSource {
    /// The resource store in NATS KV (local mode).
    Store(Box<Store>),
    /// Subscription objects in a Kubernetes cluster.
    Kubernetes(kube::Client),
}

struct Running {
    target: Arc<Target>,
    plan: ConsumerPlan,
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

/// The workers of this dispatcher process.
pub struct Manager {
    shared: Arc<Shared>,
    sinks: SinkPolicy,
    ack_wait: Duration,
    drain_timeout: Duration,
    workers: tokio::sync::Mutex<HashMap<Key, Running>>,
    targets: Mutex<HashMap<Key, Arc<Target>>>,
    replays: Mutex<HashMap<Key, CancellationToken>>,
    known: Mutex<HashSet<Key>>,
    synced: std::sync::atomic::AtomicBool,
    shutdown: CancellationToken,
}

/// Where a replay starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayFrom {
    /// Events stored at or after this time.
    Time(chrono::DateTime<chrono::Utc>),
    /// Events from this stream sequence on.
    Sequence(u64),
}

/// The target and consumer plan of a valid Subscription.
pub fn plan_for(
    subscription: &Subscription,
    sinks: &SinkPolicy,
    ack_wait: Duration,
) -> Result<(Target, ConsumerPlan), String> {
    let errors = validate_subscription(subscription, sinks);
    if !errors.is_empty() {
        return Err(describe_errors(&errors));
    }
    let namespace = subscription
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".to_owned());
    let name = subscription.metadata.name.clone().unwrap_or_default();
    let policy = subscription
        .spec
        .delivery_policy()
        .map_err(|_| "invalid delivery settings".to_owned())?;
    let types = subscription
        .spec
        .type_subjects()
        .map_err(|_| "invalid types".to_owned())?;
    let plan = ConsumerPlan {
        name: consumer_name(&namespace, &name),
        filter_subjects: types.into_iter().map(|t| t.subject).collect(),
        policy,
        ack_wait,
    };
    let target = Target {
        label: format!("{namespace}/{name}"),
        namespace,
        name,
        sink: subscription.spec.sink.clone(),
        policy,
    };
    Ok((target, plan))
}

impl Manager {
    /// A manager with no workers yet.
    pub fn new(
        shared: Arc<Shared>,
        sinks: SinkPolicy,
        ack_wait: Duration,
        drain_timeout: Duration,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            shared,
            sinks,
            ack_wait,
            drain_timeout,
            workers: tokio::sync::Mutex::default(),
            targets: Mutex::default(),
            replays: Mutex::default(),
            known: Mutex::default(),
            synced: std::sync::atomic::AtomicBool::new(false),
            shutdown,
        }
    }

    /// Whether the first full list of Subscriptions has been applied.
    pub fn is_synced(&self) -> bool {
        self.synced.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The Subscriptions this dispatcher delivers for.
    pub fn targets(&self) -> Vec<Arc<Target>> {
        let mut targets: Vec<_> = self
            .targets
            .lock()
            .map(|t| t.values().cloned().collect())
            .unwrap_or_default();
        targets.sort_by(|a, b| a.label.cmp(&b.label));
        targets
    }

    /// One Subscription's target.
    pub fn target(&self, namespace: &str, name: &str) -> Option<Arc<Target>> {
        self.targets
            .lock()
            .ok()?
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// Follows the Subscriptions until shutdown, then stops every worker.
    pub async fn run(self: Arc<Self>, source: SubscriptionSource) {
        match source {
            SubscriptionSource::Store(store) => {
                store
                    .follow::<Subscription, _, _>(&self.shutdown, |change| {
                        let manager = self.clone();
                        async move { manager.handle(change).await }
                    })
                    .await;
            }
            SubscriptionSource::Kubernetes(client) => self.follow_kubernetes(client).await,
        }
        self.stop_all().await;
    }

    async fn handle(&self, change: Change<Subscription>) {
        match change {
            Change::Applied(subscription) => {
                if let Ok(mut known) = self.known.lock() {
                    known.insert(subscription.key());
                }
                self.apply(&subscription).await;
            }
            Change::Deleted { namespace, name } => {
                if let Ok(mut known) = self.known.lock() {
                    known.remove(&(namespace.clone(), name.clone()));
                }
                self.remove(&namespace, &name).await;
            }
            Change::Synced => {
                self.delete_orphan_consumers().await;
                self.synced
                    .store(true, std::sync::atomic::Ordering::Release);
            }
        }
    }

    /// Follows Subscription objects through the Kubernetes API: the same changes as from the
    /// store, so delivery is the same code in both modes.
    async fn follow_kubernetes(&self, client: kube::Client) {
        use kube::runtime::{WatchStreamExt as _, watcher};
        let api: kube::Api<Subscription> = kube::Api::all(client);
        let events = watcher(api, watcher::Config::default()).default_backoff();
        let mut events = std::pin::pin!(events);
        // Subscriptions seen in the current (re)list; the ones known before and not seen
        // again were deleted while the watch was down.
        let mut listed: HashSet<Key> = HashSet::new();
        loop {
            let event = tokio::select! {
                event = events.next() => event,
                () = self.shutdown.cancelled() => return,
            };
            match event {
                None => return,
                Some(Err(error)) => {
                    tracing::warn!(%error, "watching Subscriptions failed; retrying with backoff");
                }
                Some(Ok(watcher::Event::Init)) => listed.clear(),
                Some(Ok(watcher::Event::InitApply(subscription))) => {
                    listed.insert(subscription.key());
                    self.handle(Change::Applied(subscription)).await;
                }
                Some(Ok(watcher::Event::InitDone)) => {
                    let gone: Vec<Key> = self
                        .known
                        .lock()
                        .map(|known| known.difference(&listed).cloned().collect())
                        .unwrap_or_default();
                    for (namespace, name) in gone {
                        self.handle(Change::Deleted { namespace, name }).await;
                    }
                    self.handle(Change::Synced).await;
                }
                Some(Ok(watcher::Event::Apply(subscription))) => {
                    self.handle(Change::Applied(subscription)).await;
                }
                Some(Ok(watcher::Event::Delete(subscription))) => {
                    let (namespace, name) = subscription.key();
                    self.handle(Change::Deleted { namespace, name }).await;
                }
            }
        }
    }

    async fn apply(&self, subscription: &Subscription) {
        let key = subscription.key();
        let (namespace, name) = key.clone();
        let (target, plan) = match plan_for(subscription, &self.sinks, self.ack_wait) {
            Ok(planned) => planned,
            Err(problems) => {
                tracing::warn!(%namespace, %name, %problems, "subscription is invalid; not delivering for it");
                self.stop(&key).await;
                return;
            }
        };
        let mut workers = self.workers.lock().await;
        if let Some(running) = workers.get(&key) {
            if *running.target == target && running.plan == plan && !running.task.is_finished() {
                return;
            }
        }
        if let Some(old) = workers.remove(&key) {
            self.stop_running(old).await;
        }
        let target = Arc::new(target);
        let cancel = self.shutdown.child_token();
        let task = tokio::spawn(worker::run(
            self.shared.clone(),
            target.clone(),
            plan.clone(),
            cancel.clone(),
        ));
        tracing::info!(subscription = %target.label, sink = %target.sink, "delivering");
        if let Ok(mut targets) = self.targets.lock() {
            targets.insert(key.clone(), target.clone());
        }
        workers.insert(
            key,
            Running {
                target,
                plan,
                cancel,
                task,
            },
        );
    }

    async fn stop(&self, key: &Key) {
        let running = self.workers.lock().await.remove(key);
        if let Some(running) = running {
            self.stop_running(running).await;
        }
        if let Ok(mut targets) = self.targets.lock() {
            targets.remove(key);
        }
    }

    async fn stop_running(&self, running: Running) {
        running.cancel.cancel();
        let label = running.target.label.clone();
        if tokio::time::timeout(self.drain_timeout, running.task)
            .await
            .is_err()
        {
            tracing::warn!(subscription = %label, "worker did not drain in time");
        }
    }

    async fn remove(&self, namespace: &str, name: &str) {
        let key = (namespace.to_owned(), name.to_owned());
        self.stop(&key).await;
        if let Some(cancel) = self.replays.lock().ok().and_then(|mut r| r.remove(&key)) {
            cancel.cancel();
        }
        let label = format!("{namespace}/{name}");
        self.shared.metrics.forget(&label);
        let consumer = consumer_name(namespace, name);
        if let Ok(stream) = self.shared.js.get_stream(EVENTS_STREAM).await {
            // Another dispatcher may have deleted it first.
            if stream.delete_consumer(&consumer).await.is_ok() {
                tracing::info!(%consumer, "consumer deleted with its subscription");
            }
        }
    }

    /// Deletes consumers of Subscriptions that are gone (deleted while no dispatcher ran).
    async fn delete_orphan_consumers(&self) {
        let wanted: HashSet<String> = self
            .known
            .lock()
            .map(|known| {
                known
                    .iter()
                    .map(|(namespace, name)| consumer_name(namespace, name))
                    .collect()
            })
            .unwrap_or_default();
        let Ok(stream) = self.shared.js.get_stream(EVENTS_STREAM).await else {
            return;
        };
        let Ok(names) = stream
            .consumer_names()
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<Vec<_>, _>>()
        else {
            return;
        };
        for consumer in names {
            if consumer.starts_with("sub_")
                && !wanted.contains(&consumer)
                && stream.delete_consumer(&consumer).await.is_ok()
            {
                tracing::info!(%consumer, "deleted the consumer of a subscription that no longer exists");
            }
        }
    }

    async fn stop_all(&self) {
        let all: Vec<Running> = self
            .workers
            .lock()
            .await
            .drain()
            .map(|(_, running)| running)
            .collect();
        for running in &all {
            running.cancel.cancel();
        }
        // Workers were cancelled together; wait for them together, bounded.
        let drained = tokio::time::timeout(self.drain_timeout, async {
            for running in all {
                let _ = running.task.await;
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!("workers did not drain in time");
        }
    }

    /// Starts redelivering stored events to one Subscription, touching no other. Returns how
    /// many events the replay covers.
    pub async fn replay(self: &Arc<Self>, target: Arc<Target>, from: ReplayFrom) -> Result<u64> {
        let key = (target.namespace.clone(), target.name.clone());
        let replay_name = format!("replay_{}_{}", target.namespace, target.name);
        let stream = self
            .shared
            .js
            .get_stream(EVENTS_STREAM)
            .await
            .map_err(|e| Error::consumer(&replay_name, "find stream", e))?;
        let live = stream
            .consumer_info(consumer_name(&target.namespace, &target.name))
            .await
            .map_err(|e| Error::consumer(&replay_name, "read live consumer", e))?;
        if let Some(running) = self.replays.lock().ok().and_then(|r| r.get(&key).cloned()) {
            running.cancel();
        }
        let _ = stream.delete_consumer(&replay_name).await;
        let plan = ConsumerPlan {
            name: replay_name.clone(),
            filter_subjects: live.config.filter_subjects.clone(),
            policy: target.policy,
            ack_wait: self.ack_wait,
        };
        let deliver_policy = match from {
            ReplayFrom::Time(start_time) => DeliverPolicy::ByStartTime {
                start_time: time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(
                    start_time.timestamp_nanos_opt().unwrap_or(0),
                ))
                .map_err(|e| Error::consumer(&replay_name, "start time", e))?,
            },
            ReplayFrom::Sequence(start_sequence) => {
                DeliverPolicy::ByStartSequence { start_sequence }
            }
        };
        let config = pull::Config {
            ack_policy: AckPolicy::Explicit,
            inactive_threshold: Duration::from_secs(3600),
            ..consumer_config(&plan, deliver_policy)
        };
        let mut consumer = stream
            .create_consumer(config)
            .await
            .map_err(|e| Error::consumer(&replay_name, "create", e))?;
        let events = consumer
            .info()
            .await
            .map_err(|e| Error::consumer(&replay_name, "info", e))?
            .num_pending;
        let cancel = self.shutdown.child_token();
        if let Ok(mut replays) = self.replays.lock() {
            replays.insert(key.clone(), cancel.clone());
        }
        let manager = self.clone();
        tokio::spawn(async move {
            tracing::info!(subscription = %target.label, events, "replay started");
            let ended = worker::consume(&manager.shared, &target, consumer, true, &cancel).await;
            tracing::info!(subscription = %target.label, ?ended, "replay ended");
            if let Ok(stream) = manager.shared.js.get_stream(EVENTS_STREAM).await {
                let _ = stream.delete_consumer(&replay_name).await;
            }
            if let Ok(mut replays) = manager.replays.lock() {
                replays.remove(&key);
            }
        });
        Ok(events)
    }
}
