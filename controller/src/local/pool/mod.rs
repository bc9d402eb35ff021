//! The instances of one Function on this machine: child processes on free ports, routed to only
//! once `/healthz` answers, restarted with backoff when they crash, scaled on in-flight requests
//! (to zero when idle, if allowed), and replaced revision by revision without dropping a request:
//! old instances keep serving until the new ones are ready, then drain and stop.

mod instance;
mod scaling;

pub use self::instance::*;
pub use self::scaling::*;

use std::{
    collections::VecDeque,
    ffi::OsString,
    path::PathBuf,
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use parking_lot::Mutex;

use eddy_model::{
    backoff::Backoff,
    resources::{PUBLISHER_PROXY_ADDRESS, Runtime},
};
use eddy_platform::cgroup::Cgroup;
use eddy_platform::{process, shutdown::CancellationToken};
use tokio::sync::{Notify, watch};

use super::spares::{self, Interest, SpareKey, Spares};
use eddy_model::resources::AccessSpec;

/// Every Function's pool, by (namespace, name): what the gateway calls.
pub type Pools = Arc<parking_lot::RwLock<std::collections::HashMap<(String, String), Arc<Pool>>>>;

/// Settings shared by every pool.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Where instance logs go (`<dir>/<namespace>/<name>.log`).
    pub logs_dir: PathBuf,
    /// `…/publish` of the event-bus, given to functions as `PUBLISHER_PROXY_ADDRESS`.
    pub publisher_url: String,
    /// Publish-only token for the functions' `emitCloudEvent` (`EDDY_PUBLISHER_TOKEN`).
    pub publisher_token: Option<String>,
    /// Where functions send their spans (`TRACE_COLLECTOR_ENDPOINT`), while traces are on.
    pub trace_collector: Option<String>,
    /// Every function's series on the gateway's `/metrics`.
    pub metrics: Arc<eddy_platform::function_metrics::FunctionMetrics>,
    /// In-flight requests per instance the autoscaler aims for.
    pub target_concurrency: usize,
    /// Idle time after which a Function with `minReplicas: 0` has no instance.
    pub scale_to_zero_after: Duration,
    /// Window over which load is remembered before scaling down.
    pub scale_down_window: Duration,
    /// Longest an instance may take to answer `/healthz`.
    pub startup_timeout: Duration,
    /// Longest a draining instance may keep requests before it is stopped anyway.
    pub drain_timeout: Duration,
    /// Warm spares new instances start from, when there are any.
    pub spares: Option<Arc<Spares>>,
    /// With `--isolation cgroup`: where each instance's control group goes.
    pub cgroups: Option<Arc<eddy_platform::cgroup::Cgroups>>,
    /// Processes and threads one instance may have, in its cgroup.
    pub max_function_tasks: u64,
    /// What confines every runtime process.
    pub confinement: Arc<eddy_platform::process::Confinement>,
}

/// What to run: one generation of a Function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revision {
    /// The Function's generation.
    pub generation: i64,
    /// Which rollout of the pool this is (set by [`Pool::set_revision`]): a new one when the
    /// code or settings change, within one generation too (a Secret or a Git branch moved).
    pub rollout: u64,
    /// The runtime.
    pub runtime: Runtime,
    /// The build directory.
    pub dir: PathBuf,
    /// The function's own files (`FUNC_DIR`).
    pub function_dir: PathBuf,
    /// The interpreter that runs the runtime's server.
    pub program: PathBuf,
    /// The runtime's own libraries.
    pub libraries: PathBuf,
    /// The user's env.
    pub env: Vec<(String, String)>,
    /// `secretMounts`: each mount path and the directory holding its files.
    pub secret_mounts: Vec<(String, PathBuf)>,
    /// Handler timeout, seconds.
    pub timeout_seconds: u64,
    /// Memory limit of one instance (enforced with `--isolation cgroup`).
    pub memory_limit: Option<u64>,
}

impl Revision {
    /// Whether two revisions run the same code with the same settings (generation aside).
    pub fn runs_like(&self, other: &Self) -> bool {
        self.runtime == other.runtime
            && self.dir == other.dir
            && self.program == other.program
            && self.libraries == other.libraries
            && self.env == other.env
            && self.secret_mounts == other.secret_mounts
            && self.timeout_seconds == other.timeout_seconds
            && self.memory_limit == other.memory_limit
    }
}

/// What the controller reports in Function status.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStatus {
    /// Instances taking requests.
    pub ready: usize,
    /// Instances the autoscaler wants.
    pub desired: usize,
    /// The fewest instances the Function asks for (`minReplicas`).
    pub min: usize,
    /// Instances restarted after crashing or failing to start.
    pub restarts: u32,
    /// The last crash or start failure.
    pub last_error: Option<String>,
    /// Instances of an earlier rollout serve while the current one has none ready.
    pub rolling_out: bool,
    /// Starts that failed since the last one that succeeded.
    pub consecutive_failures: u32,
}

struct Inner {
    revision: Option<Arc<Revision>>,
    min: usize,
    max: usize,
    instances: Vec<Arc<Instance>>,
    next_id: u64,
    restarts: u32,
    consecutive_failures: u32,
    not_before: Instant,
    last_error: Option<String>,
    load: LoadWindow,
    desired: usize,
    /// Keeps a warm spare of the current revision's runtime, when it may use one.
    spare_interest: Option<Interest>,
}

/// The instances of one Function.
pub struct Pool {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    config: Arc<PoolConfig>,
    inner: Mutex<Inner>,
    /// Woken whenever an instance becomes ready or goes away.
    pub changed: Notify,
    kick: Notify,
    waiting: AtomicUsize,
    last_request: Mutex<Instant>,
    status: watch::Sender<PoolStatus>,
    unavailable: Mutex<Option<String>>,
    /// Who may call it: the Function's `spec.access` (the gateway compiles it, once per
    /// version: a new one is a new `Arc`).
    access: parking_lot::RwLock<Option<Arc<AccessSpec>>>,
    /// The current revision's handler timeout (0 before there is one), read per request.
    timeout_seconds: AtomicU64,
    shutdown: CancellationToken,
    /// This function's metrics series.
    pub metrics: Arc<eddy_platform::function_metrics::FunctionSeries>,
}

/// Delays before starting an instance again after failures in a row.
pub const RESTART: Backoff =
    Backoff::exponential(Duration::from_millis(100), Duration::from_secs(10));

/// Releases an instance when a request is done.
pub struct Lease {
    pool: Arc<Pool>,
    /// The instance.
    pub instance: Arc<Instance>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.instance.in_flight.fetch_sub(1, Ordering::AcqRel) == 1
            && self.instance.state() == InstanceState::Draining
        {
            self.pool.kick.notify_one();
        }
    }
}

impl Pool {
    /// A pool with nothing to run yet; its manager runs until `shutdown`.
    pub fn start(
        namespace: &str,
        name: &str,
        config: Arc<PoolConfig>,
        shutdown: CancellationToken,
    ) -> Arc<Self> {
        let (status, _) = watch::channel(PoolStatus::default());
        let metrics = config.metrics.function(namespace, name);
        let pool = Arc::new(Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            config,
            inner: Mutex::new(Inner {
                revision: None,
                min: 1,
                max: 1,
                instances: Vec::new(),
                next_id: 1,
                restarts: 0,
                consecutive_failures: 0,
                not_before: Instant::now(),
                last_error: None,
                load: LoadWindow::default(),
                desired: 0,
                spare_interest: None,
            }),
            changed: Notify::new(),
            kick: Notify::new(),
            waiting: AtomicUsize::new(0),
            last_request: Mutex::new(Instant::now()),
            status,
            unavailable: Mutex::new(None),
            access: parking_lot::RwLock::new(None),
            timeout_seconds: AtomicU64::new(0),
            shutdown,
            metrics,
        });
        tokio::spawn(pool.clone().manage());
        pool
    }

    /// Status updates for the controller.
    pub fn status(&self) -> watch::Receiver<PoolStatus> {
        self.status.subscribe()
    }

    /// Runs `revision` with these bounds (a new generation rolls out; the same one rescales).
    pub fn set_revision(&self, mut revision: Revision, min: usize, max: usize) {
        {
            let mut inner = self.inner.lock();
            // A new generation that runs the same thing (only the scale changed) keeps the
            // running instances.
            let changed = inner
                .revision
                .as_deref()
                .is_none_or(|current| !current.runs_like(&revision));
            if changed {
                revision.rollout = inner
                    .revision
                    .as_ref()
                    .map_or(1, |current| current.rollout + 1);
                self.timeout_seconds
                    .store(revision.timeout_seconds, Ordering::Release);
                inner.spare_interest = self
                    .config
                    .spares
                    .as_ref()
                    .filter(|_| spares::fits(revision.runtime, &revision.env))
                    .map(|spares| spares.interest(spare_key(&revision)));
                inner.revision = Some(Arc::new(revision));
                inner.consecutive_failures = 0;
                inner.not_before = Instant::now();
                inner.last_error = None;
            }
            inner.min = min;
            inner.max = max.max(min);
        }
        {
            let mut last = self.last_request.lock();
            *last = Instant::now();
        }
        self.kick.notify_one();
    }

    /// Who may invoke the function (its `spec.access`); an equal one keeps the current `Arc`.
    pub fn set_access(&self, access: Option<&AccessSpec>) {
        let mut current = self.access.write();
        if current.as_deref() != access {
            *current = access.cloned().map(Arc::new);
        }
    }

    /// Who may invoke the function (its `spec.access`; `None`: anyone).
    pub fn access(&self) -> Option<Arc<AccessSpec>> {
        self.access.read().clone()
    }

    /// Says why nothing can run (a failed build with no earlier revision), so requests are
    /// answered at once instead of waiting; `None` clears it.
    pub fn set_unavailable(&self, reason: Option<String>) {
        {
            let mut unavailable = self.unavailable.lock();
            *unavailable = reason;
        }
        self.changed.notify_waiters();
    }

    /// Why nothing can run, if so.
    pub fn unavailable(&self) -> Option<String> {
        self.unavailable.lock().clone()
    }

    /// Stops every instance and the manager.
    pub fn shutdown(&self) {
        self.shutdown.cancel();
        self.inner.lock().spare_interest = None;
    }

    /// Completes once the pool is shut down (its Function removed, or eddy stopping): what
    /// others keep for it can go then.
    pub fn closed(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        self.shutdown.clone().cancelled_owned()
    }

    /// Whether there is anything to run.
    pub fn has_revision(&self) -> bool {
        self.inner.lock().revision.is_some()
    }

    /// The least-loaded ready instance (the current generation's first), leased for one request;
    /// never one of `avoid` (instances that just refused this request's connection).
    pub fn pick(self: &Arc<Self>, avoid: &[u64]) -> Option<Lease> {
        let inner = self.inner.lock();
        let current = inner.revision.as_ref().map(|r| r.rollout);
        let ready = inner
            .instances
            .iter()
            .filter(|i| i.is_ready() && !avoid.contains(&i.id));
        let newest = ready
            .clone()
            .filter(|i| Some(i.rollout) == current)
            .min_by_key(|i| i.in_flight());
        let chosen = newest
            .or_else(|| ready.min_by_key(|i| i.in_flight()))?
            .clone();
        chosen.in_flight.fetch_add(1, Ordering::AcqRel);
        drop(inner);
        {
            let mut last = self.last_request.lock();
            *last = Instant::now();
        }
        Some(Lease {
            pool: self.clone(),
            instance: chosen,
        })
    }

    /// Whether an instance was ready when the pool last published its status: the gateway's
    /// guess, without the pool's lock, whether a call will wait for a start.
    pub fn has_ready(&self) -> bool {
        self.metrics.ready_instances() > 0
    }

    /// Marks a request as waiting for an instance (scale from zero) until the guard drops.
    pub fn wait_guard(self: &Arc<Self>) -> WaitGuard {
        self.waiting.fetch_add(1, Ordering::AcqRel);
        {
            let mut last = self.last_request.lock();
            *last = Instant::now();
        }
        self.kick.notify_one();
        WaitGuard { pool: self.clone() }
    }

    /// How long the gateway waits for an answer: the function's timeout plus a margin for the
    /// runtime to answer its own timeout response.
    pub fn answer_timeout(&self) -> Option<Duration> {
        let seconds = self.timeout_seconds.load(Ordering::Acquire);
        (seconds > 0).then(|| Duration::from_secs(seconds) + Duration::from_secs(2))
    }

    /// An instance did not answer within the function's timeout: if it does not answer a health
    /// probe either (a busy loop blocks the runtime), it is killed and replaced.
    pub fn suspect(self: &Arc<Self>, instance: &Arc<Instance>) {
        let (pool, instance) = (self.clone(), instance.clone());
        tokio::spawn(async move {
            let address = format!("127.0.0.1:{}", instance.port);
            // Three chances a second apart: a runtime busy with another request still answers.
            for _ in 0..3 {
                if probe(&address, &instance.secret).await {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            tracing::warn!(function = %format!("{}/{}", pool.namespace, pool.name), instance = instance.id, "instance stopped answering; replacing it");
            instance.state.store(InstanceState::Draining);
            instance.kill.store(true, Ordering::Release);
            instance.stop.cancel();
            pool.changed.notify_waiters();
            pool.kick.notify_one();
        });
    }

    /// The last start failure, for gateway answers.
    pub fn last_error(&self) -> Option<String> {
        self.inner.lock().last_error.clone()
    }

    /// Process ids of the running instances (tests kill them).
    /// The instances that have not exited, newest rollout first.
    pub fn instances(&self) -> Vec<InstanceView> {
        let mut views: Vec<InstanceView> = self
            .inner
            .lock()
            .instances
            .iter()
            .filter(|i| i.state() != InstanceState::Gone)
            .map(|i| InstanceView {
                id: i.id,
                generation: i.generation,
                rollout: i.rollout,
                port: i.port,
                pid: i.pid(),
                state: i.state(),
                in_flight: i.in_flight(),
            })
            .collect();
        views.sort_by_key(|view| (std::cmp::Reverse(view.rollout), view.id));
        views
    }

    /// Process ids of the instances that have not exited.
    pub fn pids(&self) -> Vec<u32> {
        self.inner
            .lock()
            .instances
            .iter()
            .filter(|i| i.state() != InstanceState::Gone)
            .map(|i| i.pid())
            .filter(|p| *p > 0)
            .collect()
    }

    fn publish_status(&self, inner: &Inner) {
        let ready: Vec<&Arc<Instance>> = inner.instances.iter().filter(|i| i.is_ready()).collect();
        self.metrics.set_instances(ready.len());
        let status = PoolStatus {
            ready: ready.len(),
            desired: inner.desired,
            min: inner.min,
            restarts: inner.restarts,
            last_error: inner.last_error.clone(),
            rolling_out: inner.revision.as_ref().is_some_and(|current| {
                !ready.is_empty() && ready.iter().all(|i| i.rollout != current.rollout)
            }),
            consecutive_failures: inner.consecutive_failures,
        };
        self.status.send_if_modified(|current| {
            if *current == status {
                false
            } else {
                *current = status;
                true
            }
        });
    }

    async fn manage(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = self.kick.notified() => {}
                _ = tick.tick() => {}
                () = self.shutdown.cancelled() => break,
            }
            self.reconcile();
        }
        let instances: Vec<Arc<Instance>> = self.inner.lock().instances.clone();
        for instance in &instances {
            instance.stop.cancel();
        }
    }

    /// Brings the instances in line with the load: how many are wanted, start what is
    /// missing, drain the surplus and older generations, stop what drained.
    fn reconcile(self: &Arc<Self>) {
        let mut inner = self.inner.lock();
        inner.instances.retain(|i| i.state() != InstanceState::Gone);
        let now = Instant::now();
        let Some(revision) = inner.revision.clone() else {
            let waiting = self.waiting.load(Ordering::Acquire);
            self.record_load(&mut inner, now, waiting);
            self.publish_status(&inner);
            return;
        };
        let desired = self.desired(&mut inner, now);
        inner.desired = desired;
        let current: Vec<Arc<Instance>> = inner
            .instances
            .iter()
            .filter(|i| {
                i.rollout == revision.rollout
                    && matches!(i.state(), InstanceState::Starting | InstanceState::Ready)
            })
            .cloned()
            .collect();
        // Start what is missing (after the crash backoff).
        if current.len() < desired && now >= inner.not_before {
            // Calls are waiting and nothing can take them: a cold start.
            if self.waiting.load(Ordering::Acquire) > 0
                && !inner
                    .instances
                    .iter()
                    .any(|i| i.is_ready() || i.state() == InstanceState::Starting)
            {
                self.metrics.cold_start();
            }
            for _ in current.len()..desired {
                self.start_instance(&mut inner, &revision);
            }
        }
        // Too many of the current generation: drain the least busy.
        if current.len() > desired {
            let mut surplus = current.clone();
            surplus.sort_by_key(|i| (i.is_ready(), i.in_flight()));
            for instance in surplus.into_iter().take(current.len() - desired) {
                instance.state.store(InstanceState::Draining);
            }
        }
        // Older generations go once the current one serves at full strength (or nothing is wanted).
        let current_ready = current.iter().filter(|i| i.is_ready()).count();
        if current_ready >= desired {
            for instance in inner
                .instances
                .iter()
                .filter(|i| i.rollout != revision.rollout)
            {
                if instance.state() != InstanceState::Gone {
                    instance.state.store(InstanceState::Draining);
                }
            }
        }
        // Draining instances stop when idle.
        for instance in inner
            .instances
            .iter()
            .filter(|i| i.state() == InstanceState::Draining && i.in_flight() == 0)
        {
            instance.stop.cancel();
        }
        self.publish_status(&inner);
    }
}

/// A request waiting for an instance.
pub struct WaitGuard {
    pool: Arc<Pool>,
}

impl Drop for WaitGuard {
    fn drop(&mut self) {
        self.pool.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_load_is_kept_for_the_scale_down_window() {
        let window = Duration::from_secs(30);
        let start = Instant::now();
        let at = |seconds: u64| start + Duration::from_secs(seconds);
        let mut load = LoadWindow::default();
        assert_eq!(load.record(at(0), 8, window), 8);
        // Quiet, but within the window: the peak holds (no scale-down yet).
        assert_eq!(load.record(at(10), 0, window), 8);
        assert_eq!(load.record(at(30), 1, window), 8);
        // Past the window the burst is forgotten.
        assert_eq!(load.record(at(31), 0, window), 1);
        assert_eq!(load.record(at(60), 0, window), 1);
        assert_eq!(load.record(at(61), 0, window), 0);
        // A new burst counts at once (scaling up does not wait).
        assert_eq!(load.record(at(63), 20, window), 20);
    }

    fn input() -> ScaleInput {
        ScaleInput {
            min: 1,
            max: 5,
            target: 10,
            peak_load: 0,
            waiting: 0,
            idle_for: Duration::from_secs(1),
            scale_to_zero_after: Duration::from_secs(60),
        }
    }

    #[test]
    fn scales_on_load_within_bounds() {
        assert_eq!(desired_replicas(input()), 1);
        assert_eq!(
            desired_replicas(ScaleInput {
                peak_load: 10,
                ..input()
            }),
            1
        );
        assert_eq!(
            desired_replicas(ScaleInput {
                peak_load: 11,
                ..input()
            }),
            2
        );
        assert_eq!(
            desired_replicas(ScaleInput {
                peak_load: 35,
                ..input()
            }),
            4
        );
        assert_eq!(
            desired_replicas(ScaleInput {
                peak_load: 500,
                ..input()
            }),
            5
        );
        assert_eq!(desired_replicas(ScaleInput { min: 3, ..input() }), 3);
    }

    #[test]
    fn scales_to_zero_only_when_idle_and_allowed() {
        let zero = ScaleInput { min: 0, ..input() };
        assert_eq!(desired_replicas(zero), 1, "recently used");
        let idle = ScaleInput {
            idle_for: Duration::from_secs(61),
            ..zero
        };
        assert_eq!(desired_replicas(idle), 0);
        assert_eq!(
            desired_replicas(ScaleInput { waiting: 1, ..idle }),
            1,
            "a request is waiting"
        );
        assert_eq!(
            desired_replicas(ScaleInput {
                idle_for: Duration::from_secs(61),
                ..input()
            }),
            1,
            "min 1 stays"
        );
    }

    #[test]
    fn restart_backoff_grows_and_is_capped() {
        assert_eq!(RESTART.delay(0), Duration::ZERO);
        assert_eq!(RESTART.delay(1), Duration::from_millis(100));
        assert_eq!(RESTART.delay(2), Duration::from_millis(200));
        assert_eq!(RESTART.delay(50), Duration::from_secs(10));
    }
}
