//! Keeps one worker per Subscription in line with the Subscriptions: started, restarted with the
//! new settings when the spec changes (the consumer is updated in place), stopped and its
//! consumer deleted when the Subscription goes. Replays run beside the live workers.
//!
//! One task owns every map. Changes from the source and requests from the admin API reach it as
//! messages; what to do about a change is decided by the pure [`SubscriptionIndex`]; the admin
//! API reads a snapshot the task publishes after each change.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use eddy_model::resources::{SinkPolicy, Subscription, consumer_name};
use eddy_platform::{
    nats::EVENTS_STREAM,
    shutdown::{CancellationToken, spawn_essential},
    store::{Change, Resync, Store, StoredResource as _},
    watch::backed_off,
};
use futures::StreamExt as _;
use kube::runtime::watcher;
use tokio::{
    sync::{mpsc, oneshot, watch},
    task::JoinHandle,
};
use tracing::Instrument as _;

use crate::{
    Error, Result,
    consumer::{ConsumerPlan, consumer_config},
    index::{Action, Delivering, Key, LiveSubscription, SubscriptionIndex},
    send::Shared,
    worker,
};

/// Where the dispatcher learns about Subscriptions.
pub enum SubscriptionSource {
    /// The resource store in NATS KV (local mode).
    Store(Box<Store>),
    /// Subscription objects in a Kubernetes cluster; with `kyma`, Kyma's Subscriptions
    /// (eventing.kyma-project.io/v1alpha2) as well.
    Kubernetes {
        /// The API server.
        client: kube::Client,
        /// Whether Kyma's Subscriptions are followed too.
        kyma: bool,
    },
}

/// Where a replay starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayFrom {
    /// Events stored at or after this time.
    Time(chrono::DateTime<chrono::Utc>),
    /// Events from this stream sequence on.
    Sequence(u64),
}

/// What the admin API sees of the manager: the Subscriptions delivered for, and replays on
/// request. Cheap to clone.
#[derive(Clone)]
pub struct ManagerHandle {
    view: watch::Receiver<View>,
    delivering: watch::Receiver<Delivering>,
    requests: mpsc::Sender<Request>,
}

/// The manager's state as last published.
#[derive(Debug, Clone, Default)]
struct View {
    targets: Delivering,
    synced: bool,
}

struct ReplayRequest {
    target: Arc<LiveSubscription>,
    from: ReplayFrom,
    answer: oneshot::Sender<Result<u64>>,
}

enum Request {
    Replay(ReplayRequest),
}

enum Message {
    Change(Box<Change<Subscription>>),
    /// A replay's task ended; `generation` tells it from a newer replay of the same Subscription.
    ReplayEnded {
        key: Key,
        generation: u64,
    },
}

impl ManagerHandle {
    /// Whether the first full list of Subscriptions has been applied.
    pub fn is_synced(&self) -> bool {
        self.view.borrow().synced
    }

    /// The Subscriptions this dispatcher delivers for, by label.
    pub fn targets(&self) -> Vec<Arc<LiveSubscription>> {
        let mut targets: Vec<_> = self.view.borrow().targets.values().cloned().collect();
        targets.sort_by(|a, b| a.label.cmp(&b.label));
        targets
    }

    /// The Subscriptions delivered for, as they change (the scaler reads their backlogs).
    pub fn delivering(&self) -> watch::Receiver<Delivering> {
        self.delivering.clone()
    }

    /// One Subscription's target.
    pub fn target(&self, namespace: &str, name: &str) -> Option<Arc<LiveSubscription>> {
        self.view
            .borrow()
            .targets
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// Starts redelivering stored events to one Subscription, touching no other. Returns how
    /// many events the replay covers.
    pub async fn replay(&self, target: Arc<LiveSubscription>, from: ReplayFrom) -> Result<u64> {
        let shutting_down = |label: &str| Error::Consumer {
            consumer: format!("replay of {label}"),
            operation: "start",
            message: "the dispatcher is shutting down".to_owned(),
        };
        let label = target.label.clone();
        let (answer, answered) = oneshot::channel();
        let request = Request::Replay(ReplayRequest {
            target,
            from,
            answer,
        });
        if self.requests.send(request).await.is_err() {
            return Err(shutting_down(&label));
        }
        answered
            .await
            .unwrap_or_else(|_| Err(shutting_down(&label)))
    }
}

struct Running {
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

/// The workers of this dispatcher process, owned by one task.
struct Manager {
    shared: Arc<Shared>,
    index: SubscriptionIndex,
    ack_wait: Duration,
    drain_timeout: Duration,
    workers: HashMap<Key, Running>,
    replays: HashMap<Key, (u64, CancellationToken)>,
    replay_generation: u64,
    view: watch::Sender<View>,
    delivering: watch::Sender<Delivering>,
    messages: mpsc::Sender<Message>,
    shutdown: CancellationToken,
}

/// Starts the manager's task: it follows `source` until `shutdown`, then stops every worker
/// (each bounded by `drain_timeout`). The manager and its follower are essential: should either
/// end before `stop` (the dispatcher's own token), `stop` is cancelled and its handle (of the
/// two returned) answers which ([`eddy_platform::shutdown::spawn_essential`]).
pub fn start(
    shared: Arc<Shared>,
    sinks: SinkPolicy,
    ack_wait: Duration,
    drain_timeout: Duration,
    source: SubscriptionSource,
    shutdown: CancellationToken,
    stop: CancellationToken,
) -> (ManagerHandle, [JoinHandle<Result<(), &'static str>>; 2]) {
    let (view, view_reader) = watch::channel(View::default());
    let (delivering, delivering_reader) = watch::channel(Delivering::default());
    let (requests, request_reader) = mpsc::channel(16);
    let (messages, message_reader) = mpsc::channel(256);
    let follower = spawn_essential(
        "the Subscriptions follower",
        stop.clone(),
        follow(source, messages.clone(), shutdown.clone()),
    );
    let manager = Manager {
        shared,
        index: SubscriptionIndex::new(sinks, ack_wait),
        ack_wait,
        drain_timeout,
        workers: HashMap::new(),
        replays: HashMap::new(),
        replay_generation: 0,
        view,
        delivering,
        messages,
        shutdown,
    };
    let task = spawn_essential("the subscription manager", stop, async move {
        manager.run(message_reader, request_reader).await;
    });
    let handle = ManagerHandle {
        view: view_reader,
        delivering: delivering_reader,
        requests,
    };
    (handle, [task, follower])
}

/// Feeds the manager the Subscriptions' changes: the same changes from the store and from
/// Kubernetes, so delivery is the same code in both modes.
async fn follow(
    source: SubscriptionSource,
    to: mpsc::Sender<Message>,
    shutdown: CancellationToken,
) {
    match source {
        SubscriptionSource::Store(store) => {
            store
                .follow::<Subscription, _, _>(&shutdown, |change| {
                    let to = to.clone();
                    async move {
                        let _ = to.send(Message::Change(Box::new(change))).await;
                    }
                })
                .await;
        }
        SubscriptionSource::Kubernetes { client, kyma } => {
            follow_kubernetes(client, kyma, &to, &shutdown).await;
        }
    }
}

/// What one watch event says about the Subscriptions, whichever kind they were stored as.
enum Seen {
    /// A (re)list begins.
    Init,
    /// Listed or changed.
    Applied(Box<Subscription>),
    /// The list is complete.
    InitDone,
    /// Deleted.
    Deleted((String, String)),
    /// An object that is not a Subscription eddy can deliver for (logged).
    Skipped,
}

fn seen_eddy(event: watcher::Event<Subscription>) -> Seen {
    match event {
        watcher::Event::Init => Seen::Init,
        watcher::Event::InitApply(subscription) | watcher::Event::Apply(subscription) => {
            Seen::Applied(Box::new(subscription))
        }
        watcher::Event::InitDone => Seen::InitDone,
        watcher::Event::Delete(subscription) => Seen::Deleted(subscription.key()),
    }
}

fn seen_kyma(event: watcher::Event<kube::api::DynamicObject>) -> Seen {
    match event {
        watcher::Event::Init => Seen::Init,
        watcher::Event::InitApply(object) | watcher::Event::Apply(object) => {
            let key = format!(
                "{}/{}",
                object.metadata.namespace.as_deref().unwrap_or_default(),
                object.metadata.name.as_deref().unwrap_or_default()
            );
            let value = serde_json::to_value(&object).unwrap_or_default();
            match eddy_model::kyma::native_subscription(value) {
                Ok(subscription) => Seen::Applied(Box::new(subscription)),
                Err(errors) => {
                    // The controller puts the same errors into the object's status.
                    tracing::warn!(subscription = %key, errors = %eddy_model::resources::describe_errors(&errors), "a Kyma Subscription eddy cannot read; left as it was");
                    Seen::Skipped
                }
            }
        }
        watcher::Event::InitDone => Seen::InitDone,
        watcher::Event::Delete(object) => Seen::Deleted((
            object.metadata.namespace.unwrap_or_default(),
            object.metadata.name.unwrap_or_default(),
        )),
    }
}

/// Which kinds of Subscription have been listed whole at least once. Consumers without a
/// Subscription are swept only once every kind is: before that, a Kyma Subscription not yet
/// listed would look gone and lose its consumer.
struct Listed(Vec<bool>);

impl Listed {
    fn new(kinds: usize) -> Self {
        Self(vec![false; kinds])
    }

    /// `kind` finished a list; true when every kind has.
    fn done(&mut self, kind: usize) -> bool {
        if let Some(listed) = self.0.get_mut(kind) {
            *listed = true;
        }
        self.0.iter().all(|listed| *listed)
    }
}

/// Subscription objects through the Kubernetes API (eddy's and, with `kyma`, Kyma's); a
/// relist reports what was deleted while the watch was down, as the store's watch does. The
/// first [`Change::Synced`] waits for every kind's initial list, so no Subscription of one
/// kind is taken for gone while the other is still listing.
async fn follow_kubernetes(
    client: kube::Client,
    kyma: bool,
    to: &mpsc::Sender<Message>,
    shutdown: &CancellationToken,
) {
    let eddy_api: kube::Api<Subscription> = kube::Api::all(client.clone());
    let eddy = backed_off(watcher(eddy_api, watcher::Config::default()))
        .map(|event| (0_usize, event.map(seen_eddy)))
        .boxed();
    let mut kinds = vec![eddy];
    if kyma {
        let resource = eddy_model::kyma::subscription_resource();
        let api = kube::Api::<kube::api::DynamicObject>::all_with(client, &resource);
        let kyma = backed_off(watcher(api, watcher::Config::default()))
            .map(|event| (1_usize, event.map(seen_kyma)))
            .boxed();
        kinds.push(kyma);
    }
    let mut resyncs: Vec<Resync> = kinds.iter().map(|_| Resync::default()).collect();
    let mut listed = Listed::new(kinds.len());
    let mut events = futures::stream::select_all(kinds);
    loop {
        let event = tokio::select! {
            event = events.next() => event,
            () = shutdown.cancelled() => return,
        };
        let (kind, seen) = match event {
            None => return,
            Some((_, Err(error))) => {
                tracing::warn!(%error, "watching Subscriptions failed; retrying with backoff");
                continue;
            }
            Some((kind, Ok(seen))) => (kind, seen),
        };
        let resync = &mut resyncs[kind];
        let changes = match seen {
            Seen::Init => {
                resync.restart();
                continue;
            }
            Seen::Skipped => continue,
            Seen::Applied(subscription) => {
                resync.applied(subscription.key());
                vec![Change::Applied(*subscription)]
            }
            Seen::InitDone => {
                let mut changes: Vec<_> = resync
                    .synced()
                    .into_iter()
                    .map(|(namespace, name)| Change::Deleted { namespace, name })
                    .collect();
                if listed.done(kind) {
                    changes.push(Change::Synced);
                }
                changes
            }
            Seen::Deleted(key) => {
                resync.deleted(&key);
                vec![Change::Deleted {
                    namespace: key.0,
                    name: key.1,
                }]
            }
        };
        for change in changes {
            if to.send(Message::Change(Box::new(change))).await.is_err() {
                return;
            }
        }
    }
}

impl Manager {
    async fn run(
        mut self,
        mut messages: mpsc::Receiver<Message>,
        mut requests: mpsc::Receiver<Request>,
    ) {
        loop {
            tokio::select! {
                Some(message) = messages.recv() => match message {
                    Message::Change(change) => self.change(*change).await,
                    Message::ReplayEnded { key, generation } => {
                        if self.replays.get(&key).is_some_and(|(current, _)| *current == generation) {
                            self.replays.remove(&key);
                        }
                    }
                },
                Some(Request::Replay(request)) = requests.recv() => {
                    let started = self.replay(request.target, request.from).await;
                    let _ = request.answer.send(started);
                }
                () = self.shutdown.cancelled() => break,
            }
        }
        self.stop_all().await;
    }

    async fn change(&mut self, change: Change<Subscription>) {
        let actions = match change {
            Change::Applied(subscription) => self.index.apply(&subscription),
            Change::Deleted { namespace, name } => self.index.delete((namespace, name)),
            Change::Synced => self.index.synced(),
        };
        for action in actions {
            self.act(action).await;
        }
        let targets: Delivering = Arc::new(
            self.index
                .targets()
                .map(|(key, target)| (key.clone(), target.clone()))
                .collect(),
        );
        self.delivering.send_replace(targets.clone());
        self.view.send_replace(View {
            targets,
            synced: self.index.is_synced(),
        });
    }

    async fn act(&mut self, action: Action) {
        match action {
            Action::Start { target, plan } => {
                let key = (target.namespace.clone(), target.name.clone());
                self.stop_worker(&key).await;
                let cancel = self.shutdown.child_token();
                // Every line the worker logs names its Subscription through this span.
                let span = tracing::info_span!("worker", subscription = %target.label);
                let task = tokio::spawn(
                    worker::run(self.shared.clone(), target.clone(), plan, cancel.clone())
                        .instrument(span),
                );
                tracing::info!(subscription = %target.label, sink = %target.sink, "delivering");
                self.workers.insert(key, Running { cancel, task });
            }
            Action::Stop { key, problems } => {
                let (namespace, name) = &key;
                tracing::warn!(%namespace, %name, %problems, "subscription is invalid; not delivering for it");
                self.stop_worker(&key).await;
            }
            Action::Remove { key } => self.remove(key).await,
            Action::DeleteOrphans { wanted } => self.delete_orphan_consumers(&wanted).await,
        }
    }

    async fn stop_worker(&mut self, key: &Key) {
        let Some(running) = self.workers.remove(key) else {
            return;
        };
        running.cancel.cancel();
        if tokio::time::timeout(self.drain_timeout, running.task)
            .await
            .is_err()
        {
            let (namespace, name) = key;
            tracing::warn!(%namespace, %name, "worker did not drain in time");
        }
    }

    async fn remove(&mut self, key: Key) {
        self.stop_worker(&key).await;
        if let Some((_, cancel)) = self.replays.remove(&key) {
            cancel.cancel();
        }
        let (namespace, name) = &key;
        let label = format!("{namespace}/{name}");
        self.shared.metrics.forget(&label);
        self.shared.journal.forget(&label);
        let consumer = consumer_name(namespace, name);
        if let Ok(stream) = self.shared.js.get_stream(EVENTS_STREAM).await {
            // Another dispatcher may have deleted it first.
            if stream.delete_consumer(&consumer).await.is_ok() {
                tracing::info!(%consumer, "consumer deleted with its subscription");
            }
        }
    }

    /// Deletes consumers of Subscriptions that are gone (deleted while no dispatcher ran).
    async fn delete_orphan_consumers(&self, wanted: &HashSet<String>) {
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

    async fn stop_all(&mut self) {
        let all: Vec<Running> = self.workers.drain().map(|(_, running)| running).collect();
        for running in &all {
            running.cancel.cancel();
        }
        for (_, cancel) in self.replays.values() {
            cancel.cancel();
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

    /// Starts redelivering stored events to one Subscription through a consumer of its own,
    /// replacing a replay of it that still runs.
    async fn replay(&mut self, target: Arc<LiveSubscription>, from: ReplayFrom) -> Result<u64> {
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
        if let Some((_, running)) = self.replays.remove(&key) {
            running.cancel();
        }
        let _ = stream.delete_consumer(&replay_name).await;
        let plan = ConsumerPlan {
            name: replay_name.clone(),
            filter_subjects: live.config.filter_subjects.clone(),
            policy: target.policy,
            ack_wait: self.ack_wait,
            // A replay's start is its own (below).
            deliver_from: None,
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
        self.replay_generation += 1;
        let generation = self.replay_generation;
        self.replays
            .insert(key.clone(), (generation, cancel.clone()));
        let shared = self.shared.clone();
        let ended = self.messages.clone();
        let span = tracing::info_span!("replay", subscription = %target.label);
        tokio::spawn(
            async move {
                tracing::info!(events, "replay started");
                let outcome =
                    worker::consume(&shared, &target, consumer, true, &mut None, &cancel).await;
                tracing::info!(?outcome, "replay ended");
                if let Ok(stream) = shared.js.get_stream(EVENTS_STREAM).await {
                    let _ = stream.delete_consumer(&replay_name).await;
                }
                let _ = ended.send(Message::ReplayEnded { key, generation }).await;
            }
            .instrument(span),
        );
        Ok(events)
    }
}

#[cfg(test)]
mod tests {
    use super::Listed;

    /// The orphan sweep (`Change::Synced`) waits for eddy's and Kyma's lists, in either order;
    /// a later relist of one kind needs no second list of the other.
    #[test]
    fn orphans_are_swept_only_once_both_kinds_are_listed() {
        let (eddy, kyma) = (0, 1);
        let mut listed = Listed::new(2);
        assert!(
            !listed.done(eddy),
            "Kyma's Subscriptions are not listed yet"
        );
        assert!(listed.done(kyma));
        assert!(
            listed.done(eddy),
            "a relist of eddy's kind, Kyma's still known"
        );

        let mut listed = Listed::new(2);
        assert!(
            !listed.done(kyma),
            "eddy's Subscriptions are not listed yet"
        );
        assert!(listed.done(eddy));

        assert!(
            Listed::new(1).done(eddy),
            "without Kyma, eddy's list is enough"
        );
    }
}
