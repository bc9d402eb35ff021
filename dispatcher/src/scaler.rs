//! Scale from zero on Kubernetes, the dispatcher's part (the contract is
//! `eddy_platform::scale`): Functions whose Deployment carries the scale-to-zero label are
//! woken for their events, scaled out by their Subscriptions' pending events up to their
//! `maxReplicas`, and back to zero once idle.
//!
//! - **Gates.** A worker delivers to such a Function only while it has a ready pod. An event
//!   that arrives while it has none is held: the worker asks for a wake-up and waits, sending
//!   in-progress acks, so the event is neither retried nor dead-lettered for the Function being
//!   asleep, and no delivery attempt reaches a Deployment at zero.
//! - **Decisions** ([`decide`], pure) are taken every [`TICK`] from the Deployment (watched)
//!   and the consumers' pending and unacknowledged counts (asked of JetStream): out as soon as
//!   the pending events call for more pods, in and to zero only after the idle window.
//! - Every dispatcher replica decides the same from the same figures; each change is a
//!   compare-and-set on the scale, so two of them never undo each other's step.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use eddy_model::resources::parse_function_sink;
use eddy_platform::{
    scale::{
        CALLS_LABEL, FUNCTION_LABEL, MAX_REPLICAS_ANNOTATION, MIN_REPLICAS_ANNOTATION,
        SCALED_BY_EDDY, SCALED_BY_LABEL, last_call, scale_deployment_if, unix_now,
    },
    shutdown::CancellationToken,
    watch::backed_off,
};
use futures::StreamExt as _;
use k8s_openapi::api::{apps::v1::Deployment, coordination::v1::Lease};
use kube::{Api, ResourceExt as _, runtime::watcher};
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};

use crate::{index::Delivering, metrics::Scalings};

/// How often scaling is decided.
pub const TICK: Duration = Duration::from_secs(1);

/// Flags of scaling from zero (with `--subscriptions-from kubernetes`).
#[derive(Debug, Clone, clap::Args)]
pub struct ScaleArgs {
    /// How long a Function that scales to zero stays up with no event and no call before it
    /// goes to zero (and how long pending events must stay low before it scales in).
    #[arg(long = "scale-to-zero-after", env = "EDDY_SCALE_TO_ZERO_AFTER", default_value = "60s", value_parser = humantime::parse_duration)]
    pub idle_after: Duration,
    /// Pending events per replica: a Function whose Subscriptions hold more gets more pods, up
    /// to its `maxReplicas`.
    #[arg(long = "events-per-replica", env = "EDDY_EVENTS_PER_REPLICA", default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
    pub events_per_replica: u64,
}

/// A Function, by namespace and name.
pub type FunctionKey = (String, String);

/// Whether a Function can take events now. Cheap to clone.
#[derive(Clone)]
pub struct Gate {
    key: Arc<FunctionKey>,
    open: watch::Receiver<bool>,
    wake: mpsc::UnboundedSender<Arc<FunctionKey>>,
}

impl Gate {
    /// Whether events may be delivered now.
    pub fn is_open(&self) -> bool {
        *self.open.borrow()
    }

    /// Asks for the Function to be woken, and waits until it has a ready pod.
    pub async fn wake_and_wait(&mut self) {
        let _ = self.wake.send(self.key.clone());
        let _ = self.open.wait_for(|open| *open).await;
    }
}

/// What the dispatcher knows of one Function that scales to zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observed {
    /// Replicas asked for.
    pub replicas: i32,
    /// Pods ready.
    pub ready: i32,
    /// Most replicas.
    pub max: i32,
    /// Fewest replicas: 0 for a Function that scales to zero, one or more for one that only
    /// follows its backlog.
    pub min: i32,
}

/// What to set a Function's replicas to, given what is seen: `None` to leave them. Pure.
///
/// - at zero: woken for pending events (as many pods as they call for) or a wake-up request,
///   and at once to `min` when that is one or more;
/// - up: out as soon as the pending events call for more pods (or `min` asks for more);
/// - to zero: nothing pending and nothing for `idle_for >= idle_after`, when `min` is 0;
/// - in: to what the pending events call for (`min`, and one, at least) once they have called
///   for fewer pods than run for `idle_after`.
pub fn decide(
    observed: Observed,
    pending: u64,
    wake_requested: bool,
    idle_for: Duration,
    low_for: Duration,
    args: &ScaleArgs,
) -> Option<i32> {
    let max = observed.max.max(1);
    let min = observed.min.clamp(0, max);
    let wanted = i32::try_from(pending.div_ceil(args.events_per_replica))
        .unwrap_or(i32::MAX)
        .clamp(min, max);
    if observed.replicas <= 0 {
        return (pending > 0 || wake_requested || min > 0).then_some(wanted.max(1));
    }
    if wanted > observed.replicas {
        return Some(wanted);
    }
    if min == 0 && pending == 0 && idle_for >= args.idle_after {
        return Some(0);
    }
    (wanted.max(1) < observed.replicas && low_for >= args.idle_after).then_some(wanted.max(1))
}

/// What one tick saw of a Function's Subscriptions and calls.
#[derive(Debug, Clone, Copy)]
struct Seen {
    /// Events pending or being delivered over its Subscriptions.
    pending: u64,
    /// When one of its Subscriptions last delivered (unix seconds).
    last_event: Option<u64>,
    /// When the gateway last forwarded it a call (unix seconds).
    last_call: Option<u64>,
    /// Every Subscription's backlog was read.
    known: bool,
}

impl Seen {
    /// [`decide`]'s inputs besides the backlog: how long the Function has been idle (no event,
    /// no call, no change of replicas), how long its backlog has called for fewer pods than
    /// run, and whether a wake-up is asked for. Marks it busy when its backlog calls for the
    /// pods it has or more. A backlog not read is no reason to scale in: both durations are
    /// zero then. Pure but for `tracked`.
    fn inputs(
        self,
        tracked: &mut Tracked,
        observed: Observed,
        now: Instant,
        unix_now: u64,
        args: &ScaleArgs,
    ) -> (Duration, Duration, bool) {
        let wanted =
            i32::try_from(self.pending.div_ceil(args.events_per_replica)).unwrap_or(i32::MAX);
        if wanted >= observed.replicas {
            tracked.busy_at = now;
        }
        let last_active = self.last_event.max(self.last_call).unwrap_or(0);
        let since_active = Duration::from_secs(unix_now.saturating_sub(last_active));
        let idle_for = since_active.min(now - tracked.changed_at);
        if !self.known {
            return (Duration::ZERO, Duration::ZERO, tracked.wake_requested);
        }
        (idle_for, now - tracked.busy_at, tracked.wake_requested)
    }
}

/// One Function's state in the scaler.
struct Tracked {
    observed: Observed,
    open: watch::Sender<bool>,
    /// When its replicas last changed, or this dispatcher first saw it.
    changed_at: Instant,
    /// When its pending events last called for as many pods as run.
    busy_at: Instant,
    wake_requested: bool,
}

/// The dispatcher's scaler: gates for the workers, and the task that decides.
#[derive(Clone)]
pub struct Scaler {
    client: kube::Client,
    args: ScaleArgs,
    functions: Arc<Mutex<HashMap<Arc<FunctionKey>, Tracked>>>,
    wake: mpsc::UnboundedSender<Arc<FunctionKey>>,
    wakes: Arc<Mutex<Option<mpsc::UnboundedReceiver<Arc<FunctionKey>>>>>,
    /// When the gateway last forwarded a call to each Function (its calls Lease).
    last_calls: Arc<Mutex<HashMap<FunctionKey, Option<u64>>>>,
}

impl Scaler {
    /// A scaler on the cluster of `client`.
    pub fn new(client: kube::Client, args: ScaleArgs) -> Self {
        let (wake, wakes) = mpsc::unbounded_channel();
        Self {
            client,
            args,
            functions: Arc::default(),
            wake,
            wakes: Arc::new(Mutex::new(Some(wakes))),
            last_calls: Arc::default(),
        }
    }

    /// The gate of the Function `sink` names; `None` for a sink that is no Function.
    pub fn gate(&self, sink: &str) -> Option<Gate> {
        let sink = parse_function_sink(sink)?;
        let key = Arc::new((sink.namespace, sink.function));
        let mut functions = self.functions.lock();
        let tracked = functions
            .entry(key.clone())
            .or_insert_with(|| Tracked::new(None));
        Some(Gate {
            key,
            open: tracked.open.subscribe(),
            wake: self.wake.clone(),
        })
    }

    /// Follows the labelled Deployments and decides until `shutdown`, for the Subscriptions
    /// `delivering` names (their consumers' backlogs, read through `js`); each scaling is
    /// counted in `scalings`.
    pub async fn run(
        self,
        js: async_nats::jetstream::Context,
        delivering: watch::Receiver<Delivering>,
        scalings: Scalings,
        shutdown: CancellationToken,
    ) {
        let metrics = &scalings;
        let Some(mut wakes) = self.wakes.lock().take() else {
            return;
        };
        let api: Api<Deployment> = Api::all(self.client.clone());
        let config =
            watcher::Config::default().labels(&format!("{SCALED_BY_LABEL}={SCALED_BY_EDDY}"));
        let events = backed_off(watcher(api, config));
        let mut events = std::pin::pin!(events);
        let leases: Api<Lease> = Api::all(self.client.clone());
        let calls = backed_off(watcher(
            leases,
            watcher::Config::default().labels(CALLS_LABEL),
        ));
        let mut calls = std::pin::pin!(calls);
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                event = events.next() => match event {
                    Some(Ok(event)) => self.observe(event),
                    Some(Err(error)) => tracing::warn!(%error, "watching Deployments that scale to zero failed; retrying with backoff"),
                    None => return,
                },
                call = calls.next() => match call {
                    Some(Ok(watcher::Event::Apply(lease) | watcher::Event::InitApply(lease))) => self.called(&lease),
                    Some(Ok(_)) => {}
                    Some(Err(error)) => tracing::warn!(%error, "watching calls Leases failed; retrying with backoff"),
                    None => return,
                },
                Some(key) = wakes.recv() => self.wake(&key, metrics).await,
                _ = tick.tick() => {
                    let targets = delivering.borrow().clone();
                    self.decide_all(&targets, &js, metrics).await;
                }
            }
        }
    }

    /// A calls Lease renewed by the gateway.
    fn called(&self, lease: &Lease) {
        let (Some(namespace), Some(function)) =
            (lease.namespace(), lease.labels().get(CALLS_LABEL))
        else {
            return;
        };
        let at = last_call(lease);
        self.last_calls
            .lock()
            .insert((namespace, function.clone()), at);
    }

    fn observe(&self, event: watcher::Event<Deployment>) {
        let mut functions = self.functions.lock();
        match event {
            watcher::Event::Apply(deployment) | watcher::Event::InitApply(deployment) => {
                let Some(key) = key_of(&deployment) else {
                    return;
                };
                let observed = observed(&deployment);
                let tracked = functions
                    .entry(Arc::new(key))
                    .or_insert_with(|| Tracked::new(Some(observed)));
                if tracked.observed.replicas != observed.replicas {
                    tracked.changed_at = Instant::now();
                    tracked.busy_at = tracked.changed_at;
                }
                tracked.observed = observed;
                tracked
                    .open
                    .send_replace(observed.replicas > 0 && observed.ready > 0);
            }
            watcher::Event::Delete(deployment) => {
                if let Some(key) = key_of(&deployment)
                    && let Some(tracked) = functions.get_mut(&key)
                {
                    // No longer scaled to zero by eddy: always open.
                    tracked.observed = Observed::always_up();
                    tracked.open.send_replace(true);
                }
            }
            watcher::Event::Init | watcher::Event::InitDone => {}
        }
    }

    async fn wake(&self, key: &Arc<FunctionKey>, metrics: &Scalings) {
        let asleep = {
            let mut functions = self.functions.lock();
            match functions.get_mut(key) {
                Some(tracked) if tracked.observed.replicas <= 0 => {
                    tracked.wake_requested = true;
                    true
                }
                _ => false,
            }
        };
        if asleep {
            self.set(key, 0, 1, "wake", metrics).await;
        }
    }

    /// Scales `key` from `from` replicas to `to`, if it still has `from`.
    async fn set(
        &self,
        key: &FunctionKey,
        from: i32,
        to: i32,
        direction: &'static str,
        metrics: &Scalings,
    ) {
        let (namespace, name) = key;
        match scale_deployment_if(&self.client, namespace, name, |now| now == from, to).await {
            Ok(Some(_)) => {
                tracing::info!(%namespace, function = %name, from, to, direction, "scaled");
                metrics.scaled(&format!("{namespace}/{name}"), direction);
                if let Some(tracked) = self.functions.lock().get_mut(key) {
                    tracked.wake_requested = false;
                }
            }
            Ok(None) => {}
            Err(error) => {
                tracing::warn!(%namespace, function = %name, %error, from, to, "cannot scale");
            }
        }
    }

    /// Decides every Function eddy scales, from its Subscriptions' backlogs in `targets`.
    async fn decide_all(
        &self,
        targets: &Delivering,
        js: &async_nats::jetstream::Context,
        metrics: &Scalings,
    ) {
        let watched: Vec<(Arc<FunctionKey>, Observed)> = self
            .functions
            .lock()
            .iter()
            .filter(|(_, tracked)| tracked.observed.max > 0)
            .map(|(key, tracked)| (key.clone(), tracked.observed))
            .collect();
        if watched.is_empty() {
            return;
        }
        let Ok(stream) = js.get_stream(eddy_platform::nats::EVENTS_STREAM).await else {
            return;
        };
        for (key, observed) in watched {
            let mut pending = 0u64;
            let mut last_event: Option<u64> = None;
            let mut known = true;
            for target in targets.values().filter(|target| {
                parse_function_sink(&target.sink)
                    .is_some_and(|sink| sink.namespace == key.0 && sink.function == key.1)
            }) {
                let consumer =
                    eddy_model::resources::consumer_name(&target.namespace, &target.name);
                match stream.consumer_info(&consumer).await {
                    Ok(info) => {
                        pending += info.num_pending + info.num_ack_pending as u64;
                        let active = info
                            .delivered
                            .last_active
                            .map(|at| u64::try_from(at.unix_timestamp()).unwrap_or(0));
                        last_event = last_event.max(active);
                    }
                    // Not knowing the backlog is no reason to scale in.
                    Err(_) => known = false,
                }
            }
            let (idle_for, low_for, wake_requested) = {
                let mut functions = self.functions.lock();
                let Some(tracked) = functions.get_mut(&key) else {
                    continue;
                };
                let last_call = self.last_calls.lock().get(&*key).copied().flatten();
                let seen = Seen {
                    pending,
                    last_event,
                    last_call,
                    known,
                };
                seen.inputs(tracked, observed, Instant::now(), unix_now(), &self.args)
            };
            if let Some(to) = decide(
                observed,
                pending,
                wake_requested,
                idle_for,
                low_for,
                &self.args,
            ) {
                let direction = if to == 0 {
                    "zero"
                } else if observed.replicas <= 0 {
                    "wake"
                } else if to > observed.replicas {
                    "out"
                } else {
                    "in"
                };
                self.set(&key, observed.replicas, to, direction, metrics)
                    .await;
            }
        }
    }
}

impl Tracked {
    fn new(observed: Option<Observed>) -> Self {
        let observed = observed.unwrap_or_else(Observed::always_up);
        let now = Instant::now();
        Self {
            observed,
            open: watch::Sender::new(observed.replicas > 0 && observed.ready > 0),
            changed_at: now,
            busy_at: now,
            wake_requested: false,
        }
    }
}

impl Observed {
    /// A Function eddy does not scale to zero (or not yet seen as one): always open, never
    /// scaled by the dispatcher (`max` 0).
    fn always_up() -> Self {
        Self {
            replicas: 1,
            ready: 1,
            max: 0,
            min: 0,
        }
    }
}

fn key_of(deployment: &Deployment) -> Option<FunctionKey> {
    let function = deployment.labels().get(FUNCTION_LABEL)?;
    Some((deployment.namespace()?, function.clone()))
}

fn observed(deployment: &Deployment) -> Observed {
    let annotation = |name: &str| deployment.annotations().get(name);
    Observed {
        replicas: deployment.spec.replicas.unwrap_or(1),
        ready: deployment
            .status
            .as_ref()
            .and_then(|status| status.ready_replicas)
            .unwrap_or(0),
        max: annotation(MAX_REPLICAS_ANNOTATION)
            .and_then(|max| max.parse().ok())
            .unwrap_or(1),
        min: annotation(MIN_REPLICAS_ANNOTATION)
            .and_then(|min| min.parse().ok())
            .unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(pending: u64, last_event: Option<u64>, last_call: Option<u64>) -> Seen {
        Seen {
            pending,
            last_event,
            last_call,
            known: true,
        }
    }

    /// decide_all's inputs: idle since the later of the last event and the last call, but
    /// never longer than since the replicas changed; low since the backlog last called for
    /// the pods that run; nothing read, nothing idle.
    #[test]
    fn a_function_is_idle_since_its_last_event_call_or_change() {
        let start = Instant::now();
        let mut tracked = Tracked::new(Some(at(2)));
        tracked.changed_at = start;
        tracked.busy_at = start;
        let now = start + Duration::from_secs(600);
        // Last event at unix 1000, last call at 1500, now 1600: idle 100 s.
        let (idle, low, wake) =
            seen(0, Some(1000), Some(1500)).inputs(&mut tracked, at(2), now, 1600, &args());
        assert_eq!(
            (idle, low, wake),
            (Duration::from_secs(100), Duration::from_secs(600), false)
        );
        // Never idle longer than since its replicas changed (300 s ago).
        tracked.changed_at = start + Duration::from_secs(300);
        let (idle, _, _) = seen(0, None, None).inputs(&mut tracked, at(2), now, 1600, &args());
        assert_eq!(idle, Duration::from_secs(300));
        // A backlog calling for the pods that run (200 events, 100 per replica, 2 replicas)
        // makes it busy now: low for nothing.
        let (_, low, _) = seen(200, None, None).inputs(&mut tracked, at(2), now, 1600, &args());
        assert_eq!(low, Duration::ZERO);
        assert_eq!(tracked.busy_at, now);
        // A backlog not read: neither idle nor low, the wake-up request still told.
        tracked.wake_requested = true;
        let unknown = Seen {
            known: false,
            ..seen(0, None, None)
        };
        let later = now + Duration::from_secs(600);
        assert_eq!(
            unknown.inputs(&mut tracked, at(2), later, 2200, &args()),
            (Duration::ZERO, Duration::ZERO, true)
        );
    }

    fn args() -> ScaleArgs {
        ScaleArgs {
            idle_after: Duration::from_secs(60),
            events_per_replica: 100,
        }
    }

    fn at(replicas: i32) -> Observed {
        Observed {
            replicas,
            ready: replicas,
            max: 4,
            min: 0,
        }
    }

    const NOW: Duration = Duration::ZERO;
    const LONG: Duration = Duration::from_secs(61);

    #[test]
    fn at_zero_only_pending_events_or_a_wake_up_start_pods() {
        assert_eq!(decide(at(0), 0, false, LONG, LONG, &args()), None);
        assert_eq!(decide(at(0), 0, true, LONG, LONG, &args()), Some(1));
        assert_eq!(decide(at(0), 1, false, LONG, LONG, &args()), Some(1));
        assert_eq!(decide(at(0), 250, false, NOW, NOW, &args()), Some(3));
        assert_eq!(
            decide(at(0), 1_000, false, NOW, NOW, &args()),
            Some(4),
            "capped at max"
        );
    }

    #[test]
    fn pending_events_scale_out_at_once_and_in_only_after_the_window() {
        assert_eq!(decide(at(1), 350, false, NOW, NOW, &args()), Some(4));
        assert_eq!(decide(at(4), 350, false, NOW, NOW, &args()), None);
        assert_eq!(
            decide(at(4), 50, false, NOW, NOW, &args()),
            None,
            "not low for long yet"
        );
        assert_eq!(decide(at(4), 50, false, NOW, LONG, &args()), Some(1));
        assert_eq!(decide(at(4), 150, false, NOW, LONG, &args()), Some(2));
    }

    #[test]
    fn only_idle_functions_with_nothing_pending_go_to_zero() {
        assert_eq!(decide(at(1), 0, false, NOW, LONG, &args()), None);
        assert_eq!(decide(at(1), 0, false, LONG, LONG, &args()), Some(0));
        assert_eq!(
            decide(at(1), 1, false, LONG, LONG, &args()),
            None,
            "an event is pending"
        );
        assert_eq!(decide(at(3), 0, false, LONG, LONG, &args()), Some(0));
    }

    /// A Function that follows its backlog (`eddy.dev/scale-on: backlog`) between a minimum of
    /// one or more and its maximum: out with the backlog, in to the minimum, never to zero.
    #[test]
    fn a_backlog_scaled_function_stays_between_its_minimum_and_maximum() {
        let between = |replicas: i32| Observed {
            min: 2,
            ..at(replicas)
        };
        assert_eq!(
            decide(between(1), 0, false, NOW, NOW, &args()),
            Some(2),
            "raised to the minimum at once"
        );
        assert_eq!(
            decide(between(0), 0, false, LONG, LONG, &args()),
            Some(2),
            "scaled to zero by hand: back to the minimum"
        );
        assert_eq!(decide(between(2), 350, false, NOW, NOW, &args()), Some(4));
        assert_eq!(decide(between(4), 50, false, NOW, LONG, &args()), Some(2));
        assert_eq!(
            decide(between(2), 0, false, LONG, LONG, &args()),
            None,
            "idle, but never below the minimum"
        );
    }
}
