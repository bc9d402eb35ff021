//! The instances of one Function on this machine: child processes on free ports, routed to only
//! once `/healthz` answers, restarted with backoff when they crash, scaled on in-flight requests
//! (to zero when idle, if allowed), and replaced revision by revision without dropping a request:
//! old instances keep serving until the new ones are ready, then drain and stop.

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

/// An instance's cgroup, if any; dropped (everything left in it killed, then removed) on a
/// blocking thread, since that waits for the processes to go.
struct ReleasedCgroup(Option<Cgroup>);

impl ReleasedCgroup {
    fn out_of_memory(&self) -> bool {
        self.0.as_ref().is_some_and(Cgroup::out_of_memory)
    }
}

impl Drop for ReleasedCgroup {
    fn drop(&mut self) {
        if let Some(cgroup) = self.0.take() {
            tokio::task::spawn_blocking(move || drop(cgroup));
        }
    }
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

/// Where an instance is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum InstanceState {
    /// Started, not yet answering its health check.
    Starting = 0,
    /// Takes requests.
    Ready = 1,
    /// Takes no new requests; stops once the ones in flight are done.
    Draining = 2,
    /// Its process has exited.
    Gone = 3,
}

/// An [`InstanceState`] read and written from several tasks without a lock.
#[derive(Debug)]
struct AtomicState(AtomicU8);

impl AtomicState {
    fn new(state: InstanceState) -> Self {
        Self(AtomicU8::new(state as u8))
    }

    fn load(&self) -> InstanceState {
        match self.0.load(Ordering::Acquire) {
            0 => InstanceState::Starting,
            1 => InstanceState::Ready,
            2 => InstanceState::Draining,
            _ => InstanceState::Gone,
        }
    }

    fn store(&self, state: InstanceState) {
        self.0.store(state as u8, Ordering::Release);
    }
}

/// What can be shown of one instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceView {
    /// Unique within the pool.
    pub id: u64,
    /// The Function generation it runs.
    pub generation: i64,
    /// The rollout it belongs to.
    pub rollout: u64,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// Its process id (0 while it is being started).
    pub pid: u32,
    /// Where it is in its life.
    pub state: InstanceState,
    /// Requests it is serving.
    pub in_flight: usize,
}

/// One running instance.
#[derive(Debug)]
pub struct Instance {
    /// Unique within the pool.
    pub id: u64,
    /// The generation it runs.
    pub generation: i64,
    /// The rollout it belongs to.
    pub rollout: u64,
    /// Its port on 127.0.0.1.
    pub port: u16,
    in_flight: AtomicUsize,
    state: AtomicState,
    stop: CancellationToken,
    /// Stop with SIGKILL at once (it stopped answering) instead of a graceful SIGTERM.
    kill: std::sync::atomic::AtomicBool,
    pid: AtomicU64,
    /// Sent by the gateway with every request (`x-eddy-instance-secret`): the runtime answers
    /// nothing else, so its loopback port cannot be called around the gateway's access checks.
    pub secret: String,
    /// [`Instance::secret`] as a header value, made once.
    pub secret_header: http::HeaderValue,
}

/// The header that carries [`Instance::secret`].
pub const INSTANCE_SECRET_HEADER: &str = "x-eddy-instance-secret";

impl Instance {
    /// Requests being served.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Where it is in its life.
    pub fn state(&self) -> InstanceState {
        self.state.load()
    }

    /// Whether it takes requests.
    pub fn is_ready(&self) -> bool {
        self.state() == InstanceState::Ready
    }

    /// The process id (0 before start).
    pub fn pid(&self) -> u32 {
        u32::try_from(self.pid.load(Ordering::Acquire)).unwrap_or(0)
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

/// Inputs of the autoscaler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScaleInput {
    /// `minReplicas`.
    pub min: usize,
    /// `maxReplicas`.
    pub max: usize,
    /// In-flight requests per instance to aim for.
    pub target: usize,
    /// Highest in-flight count (including requests waiting for an instance) over the window.
    pub peak_load: usize,
    /// Requests waiting for an instance now.
    pub waiting: usize,
    /// Time since the last request.
    pub idle_for: Duration,
    /// Idle time before scaling to zero.
    pub scale_to_zero_after: Duration,
}

/// How many instances to run. Pure.
pub fn desired_replicas(input: ScaleInput) -> usize {
    let target = input.target.max(1);
    let by_load = input.peak_load.div_ceil(target);
    let mut desired = by_load.max(input.min).min(input.max.max(input.min));
    let active =
        input.waiting > 0 || input.peak_load > 0 || input.idle_for < input.scale_to_zero_after;
    // `replicas: 0` (max 0) switches a function off; otherwise activity keeps one instance.
    if desired == 0 && active && input.max > 0 {
        desired = 1;
    }
    desired
}

/// The load samples of the last scale-down window: scaling down follows the peak over the
/// window, so a short lull does not stop instances that the next burst needs. Pure: the time is
/// given.
#[derive(Debug, Default)]
pub struct LoadWindow {
    samples: VecDeque<(Instant, usize)>,
}

impl LoadWindow {
    /// Adds the load seen at `now`, forgets samples older than `window`; the peak of the rest.
    pub fn record(&mut self, now: Instant, load: usize, window: Duration) -> usize {
        self.samples.push_back((now, load));
        while self
            .samples
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) > window)
        {
            self.samples.pop_front();
        }
        self.samples
            .iter()
            .map(|(_, load)| *load)
            .max()
            .unwrap_or(0)
    }
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

    /// Remembers the load now (requests in flight and waiting); returns the peak over the
    /// scale-down window.
    fn record_load(&self, inner: &mut Inner, now: Instant, waiting: usize) -> usize {
        let in_flight: usize = inner.instances.iter().map(|i| i.in_flight()).sum();
        inner
            .load
            .record(now, in_flight + waiting, self.config.scale_down_window)
    }

    /// How many instances the load calls for (see [`desired_replicas`]).
    fn desired(&self, inner: &mut Inner, now: Instant) -> usize {
        let waiting = self.waiting.load(Ordering::Acquire);
        let peak_load = self.record_load(inner, now, waiting);
        desired_replicas(ScaleInput {
            min: inner.min,
            max: inner.max,
            target: self.config.target_concurrency,
            peak_load,
            waiting,
            idle_for: now.duration_since(*self.last_request.lock()),
            scale_to_zero_after: self.config.scale_to_zero_after,
        })
    }

    /// Starts one instance of `revision` on a free port.
    fn start_instance(self: &Arc<Self>, inner: &mut Inner, revision: &Arc<Revision>) {
        let id = inner.next_id;
        inner.next_id += 1;
        let port = match free_port() {
            Ok(port) => port,
            Err(error) => {
                inner.last_error = Some(format!("no free port: {error}"));
                return;
            }
        };
        // Hex digits: always a valid header value.
        let secret = uuid::Uuid::new_v4().simple().to_string();
        let instance = Arc::new(Instance {
            id,
            generation: revision.generation,
            rollout: revision.rollout,
            port,
            in_flight: AtomicUsize::new(0),
            state: AtomicState::new(InstanceState::Starting),
            stop: self.shutdown.child_token(),
            kill: std::sync::atomic::AtomicBool::new(false),
            pid: AtomicU64::new(0),
            secret_header: http::HeaderValue::from_str(&secret)
                .unwrap_or_else(|_| http::HeaderValue::from_static("-")),
            secret,
        });
        inner.instances.push(instance.clone());
        tokio::spawn(self.clone().run_instance(instance, revision.clone()));
    }

    fn record_failure(&self, message: String) {
        {
            let mut inner = self.inner.lock();
            inner.restarts += 1;
            inner.consecutive_failures += 1;
            inner.not_before = Instant::now() + RESTART.delay(inner.consecutive_failures);
            inner.last_error = Some(message);
        }
    }

    async fn run_instance(self: Arc<Self>, instance: Arc<Instance>, revision: Arc<Revision>) {
        let label = format!("{}/{}#{}", self.namespace, self.name, instance.id);
        match self.spawn(&instance, &revision).await {
            Ok((mut child, warm, cgroup)) => {
                let cgroup = ReleasedCgroup(cgroup);
                instance
                    .pid
                    .store(u64::from(child.id().unwrap_or(0)), Ordering::Release);
                let started = Instant::now();
                let healthy = self.wait_healthy(&instance, &mut child).await;
                match healthy {
                    Ok(()) => {
                        instance.state.store(InstanceState::Ready);
                        tracing::info!(instance = %label, port = instance.port, generation = revision.generation, startup = ?started.elapsed(), warm, "instance ready");
                        self.changed.notify_waiters();
                        self.kick.notify_one();
                        tokio::select! {
                            exit = child.wait() => {
                                self.exited(&label, &instance, &revision, &cgroup, exit, started.elapsed());
                            }
                            () = instance.stop.cancelled() => {
                                self.stop_instance(&label, &instance, &mut child).await;
                            }
                        }
                    }
                    Err(message) => {
                        process::kill(&mut child).await;
                        if !instance.stop.is_cancelled() {
                            tracing::warn!(instance = %label, %message, "instance failed to start");
                            self.record_failure(message);
                        }
                    }
                }
            }
            Err(message) => {
                tracing::warn!(instance = %label, %message, "cannot start instance");
                self.record_failure(message);
            }
        }
        instance.state.store(InstanceState::Gone);
        self.changed.notify_waiters();
        self.kick.notify_one();
    }

    /// An instance's process exited by itself: why (out of memory, with `--isolation cgroup`),
    /// recorded as a failure; one that ran a while resets the count of failures in a row.
    fn exited(
        &self,
        label: &str,
        instance: &Instance,
        revision: &Revision,
        cgroup: &ReleasedCgroup,
        exit: std::io::Result<std::process::ExitStatus>,
        ran_for: Duration,
    ) {
        let mut text = exit.map_or_else(|e| e.to_string(), |status| status.to_string());
        if cgroup.out_of_memory() {
            let limit = revision.memory_limit.map_or_else(
                || "none".to_owned(),
                |bytes| bytesize::ByteSize(bytes).to_string(),
            );
            text = format!("{text}: out of memory, over its limit of {limit}");
        }
        tracing::warn!(instance = %label, status = %text, "instance exited; restarting");
        if ran_for > Duration::from_secs(10) {
            self.inner.lock().consecutive_failures = 0;
        }
        self.record_failure(format!("instance {} exited ({text})", instance.id));
    }

    /// Stops an instance asked to stop: killed when it stopped answering (a failure), else
    /// terminated gracefully (its in-flight requests drain).
    async fn stop_instance(
        &self,
        label: &str,
        instance: &Instance,
        child: &mut tokio::process::Child,
    ) {
        if instance.kill.load(Ordering::Acquire) {
            process::kill(child).await;
            tracing::warn!(instance = %label, "instance killed: it stopped answering");
            self.record_failure(format!(
                "instance {} stopped answering and was replaced",
                instance.id
            ));
        } else {
            let grace = self.config.drain_timeout.min(Duration::from_secs(10));
            process::terminate(child, grace).await;
            tracing::info!(instance = %label, "instance stopped");
        }
    }

    /// Starts an instance: from a warm spare when one fits, else a new process. Returns the
    /// process, whether it was a spare, and its cgroup (with `--isolation cgroup`).
    async fn spawn(
        &self,
        instance: &Instance,
        revision: &Revision,
    ) -> Result<(tokio::process::Child, bool, Option<Cgroup>), String> {
        let cgroup = match &self.config.cgroups {
            None => None,
            Some(cgroups) => Some(
                cgroups
                    .create(
                        &format!("{}_{}_{}", self.namespace, self.name, instance.id),
                        eddy_platform::cgroup::Limits {
                            memory_bytes: revision.memory_limit,
                            max_tasks: Some(self.config.max_function_tasks),
                        },
                    )
                    .map_err(|error| error.to_string())?,
            ),
        };
        let log_dir = self.config.logs_dir.join(&self.namespace);
        std::fs::create_dir_all(&log_dir)
            .map_err(|e| format!("cannot create {}: {e}", log_dir.display()))?;
        let log_path = log_dir.join(format!("{}.log", self.name));
        let open = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log_path)
                .map_err(|e| format!("cannot open {}: {e}", log_path.display()))
        };
        let env = self.instance_env(instance, revision);
        let spare = self
            .config
            .spares
            .as_ref()
            .filter(|_| spares::fits(revision.runtime, &revision.env))
            .and_then(|spares| spares.take(&spare_key(revision)));
        if let Some(spare) = spare {
            // Into the instance's cgroup before it loads the function's code.
            if let (Some(cgroup), Some(pid)) = (&cgroup, spare.id()) {
                cgroup.add(pid).map_err(|error| error.to_string())?;
            }
            match spare.become_instance(&env, &revision.dir, open()?).await {
                Ok(child) => return Ok((child, true, cgroup)),
                // The spare is gone (killed on drop); a new process does the same job.
                Err(message) => {
                    tracing::warn!(function = %self.name, %message, "cannot use a warm spare")
                }
            }
        }
        let program = &revision.program;
        let server = crate::runtimes::files(revision.runtime).server_file;
        // The secrets go on stdin, not into the environment: a process's environment is
        // readable by every process of its user (/proc/<pid>/environ), other functions included.
        let (secrets, env): (Vec<_>, Vec<_>) = env
            .into_iter()
            .partition(|(name, _)| SECRET_ENV.iter().any(|secret| name == *secret));
        let mut command = tokio::process::Command::new(program);
        command
            .arg(server)
            .current_dir(&revision.dir)
            .env_clear()
            .envs(env)
            .env("EDDY_SECRETS_ON_STDIN", "1")
            .stdin(Stdio::piped())
            .stdout(open()?)
            .stderr(open()?);
        process::supervise(&mut command);
        if let Some(cgroup) = &cgroup {
            cgroup
                .join_on_spawn(command.as_std_mut())
                .map_err(|error| error.to_string())?;
        }
        self.config.confinement.apply(command.as_std_mut());
        let mut child = command
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
        let line = secrets_line(&secrets)?;
        let mut stdin = child
            .stdin
            .take()
            .ok_or_else(|| "the instance has no stdin".to_owned())?;
        tokio::io::AsyncWriteExt::write_all(&mut stdin, &line)
            .await
            .map_err(|e| format!("cannot hand the instance its secrets: {e}"))?;
        // Closed: an instance reads nothing more on stdin.
        drop(stdin);
        Ok((child, false, cgroup))
    }

    /// An instance's whole environment: the fixed part, the instance's own settings and the
    /// function's `env`; never eddy's own environment. (A cold start gets the secrets among it
    /// on stdin.)
    fn instance_env(&self, instance: &Instance, revision: &Revision) -> Vec<(OsString, OsString)> {
        let mut env = spares::base_env();
        let mut set = |name: &str, value: &std::ffi::OsStr| env.push((name.into(), value.into()));
        set("HOME", revision.dir.as_os_str());
        let contract = eddy_model::resources::runtime_env(
            &self.name,
            &self.namespace,
            revision.runtime,
            instance.port,
            revision.timeout_seconds,
            &self.config.publisher_url,
        );
        for (name, value) in &contract {
            set(name, value.as_ref());
        }
        set("FUNC_DIR", revision.function_dir.as_os_str());
        set("EDDY_INSTANCE_SECRET", instance.secret.as_ref());
        // The event-bus's publish token goes only where the platform's address points: a
        // function that names its own PUBLISHER_PROXY_ADDRESS (Kyma's tests point it at a mock)
        // publishes there without it.
        let own_publisher = revision
            .env
            .iter()
            .any(|(name, _)| name == PUBLISHER_PROXY_ADDRESS);
        if let Some(token) = self
            .config
            .publisher_token
            .as_ref()
            .filter(|_| !own_publisher)
        {
            set("EDDY_PUBLISHER_TOKEN", token.as_ref());
        }
        if let Some(endpoint) = &self.config.trace_collector {
            set("TRACE_COLLECTOR_ENDPOINT", endpoint.as_ref());
        }
        for (name, value) in &revision.env {
            set(name, value.as_ref());
        }
        if !revision.secret_mounts.is_empty() {
            // The runtime server shows these directories to the handler at the mount paths.
            let mounts: serde_json::Map<String, serde_json::Value> = revision
                .secret_mounts
                .iter()
                .map(|(path, dir)| (path.clone(), dir.to_string_lossy().into_owned().into()))
                .collect();
            set(
                "EDDY_SECRET_MOUNTS",
                serde_json::Value::Object(mounts).to_string().as_ref(),
            );
        }
        // A later entry wins, as `Command::env` would have it: the function's env may override.
        let mut seen = std::collections::HashSet::new();
        let mut unique: Vec<(OsString, OsString)> = env
            .into_iter()
            .rev()
            .filter(|(name, _)| seen.insert(name.clone()))
            .collect();
        unique.reverse();
        unique
    }

    async fn wait_healthy(
        &self,
        instance: &Instance,
        child: &mut tokio::process::Child,
    ) -> Result<(), String> {
        let started = Instant::now();
        let deadline = started + self.config.startup_timeout;
        let address = format!("127.0.0.1:{}", instance.port);
        loop {
            if instance.stop.is_cancelled() {
                return Err("stopped while starting".to_owned());
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "instance exited during start-up ({status}); see `eddy logs {}`",
                    self.name
                ));
            }
            if probe(&address, &instance.secret).await {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "instance did not answer /healthz within {:?}",
                    self.config.startup_timeout
                ));
            }
            // Often at first: a spare answers within milliseconds of being handed its instance.
            let pause = if started.elapsed() < Duration::from_secs(1) {
                Duration::from_millis(2)
            } else {
                Duration::from_millis(20)
            };
            tokio::time::sleep(pause).await;
        }
    }
}

/// The entries of an instance's environment a cold start gets on stdin instead.
const SECRET_ENV: [&str; 2] = ["EDDY_INSTANCE_SECRET", "EDDY_PUBLISHER_TOKEN"];

/// The JSON line of `secrets` a cold-started runtime server reads from stdin
/// (`EDDY_SECRETS_ON_STDIN`) before it serves. Pure.
fn secrets_line(secrets: &[(OsString, OsString)]) -> Result<Vec<u8>, String> {
    let vars = spares::env_object(secrets)?;
    let mut line = serde_json::to_vec(&vars).map_err(|e| e.to_string())?;
    line.push(b'\n');
    Ok(line)
}

/// The spares an instance of `revision` can start from.
fn spare_key(revision: &Revision) -> SpareKey {
    SpareKey {
        runtime: revision.runtime,
        program: revision.program.clone(),
        libraries: revision.libraries.clone(),
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

/// `GET /healthz` answered 200, over a raw connection (no client pool for a probe). The whole
/// answer is read before the connection closes, so the runtime never writes into a closed
/// socket (Python printed a traceback for that on every probe).
async fn probe(address: &str, secret: &str) -> bool {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let Ok(Ok(mut stream)) = tokio::time::timeout(
        Duration::from_millis(500),
        tokio::net::TcpStream::connect(address),
    )
    .await
    else {
        return false;
    };
    let request = format!(
        "GET /healthz HTTP/1.1\r\nHost: {address}\r\n{INSTANCE_SECRET_HEADER}: {secret}\r\nConnection: close\r\n\r\n"
    );
    if stream.write_all(request.as_bytes()).await.is_err() {
        return false;
    }
    let mut answer = Vec::with_capacity(256);
    let read = tokio::time::timeout(
        Duration::from_millis(500),
        (&mut stream).take(64 * 1024).read_to_end(&mut answer),
    )
    .await;
    matches!(read, Ok(Ok(_))) && answer.get(9..12) == Some(b"200".as_slice())
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
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
