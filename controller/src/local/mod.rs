//! The local backend: Functions built in a directory and run as supervised processes behind
//! the gateway, on this machine.
//!
//! For each Function: ConfigurationReady (the spec is valid), BuildReady (source and
//! dependencies built; unchanged code is never rebuilt), Running (instances answer `/healthz`),
//! with `replicas`, `url` and `observedGeneration`, all written to the resource store.

pub mod build;
pub mod gateway;
pub mod pool;
pub mod toolchain;

use std::{collections::HashMap, sync::Arc, time::Duration};

use parking_lot::Mutex;
use tracing::Instrument as _;

use crate::status::condition;
use eddy_model::conditions::{ConditionType, Reason};
use eddy_model::resources::{
    Function, FunctionStatus, describe_errors, set_condition, validate_function,
};
use eddy_platform::{
    shutdown::CancellationToken,
    store::{Change, Store, StoredResource as _},
};
use tokio::sync::Notify;

use self::{
    build::BuildConfig,
    gateway::Pools,
    pool::{Pool, PoolConfig, PoolStatus, Revision},
};

type Key = (String, String);

/// What one Function's tasks share.
struct Tracked {
    pool: Arc<Pool>,
    /// Conditions from the reconciler; the status writer adds Running and replicas.
    status: Mutex<FunctionStatus>,
    status_changed: Notify,
    /// The reconcile in progress (a newer generation cancels an older build's rollout).
    reconcile: Mutex<Option<CancellationToken>>,
    /// Stops the status writer.
    stop: CancellationToken,
}

/// The local backend.
pub struct LocalController {
    store: Store,
    pools: Pools,
    tracked: Mutex<HashMap<Key, Arc<Tracked>>>,
    pool_config: Arc<PoolConfig>,
    build_config: Arc<BuildConfig>,
    gateway_url: String,
    shutdown: CancellationToken,
}

/// The Running condition and replica count for what the pool reports. Pure.
pub fn running_condition(pool: &PoolStatus, has_revision: bool) -> (Option<bool>, Reason, String) {
    let restarts = if pool.restarts > 0 {
        format!(
            "; restarted {} time(s), last: {}",
            pool.restarts,
            pool.last_error.as_deref().unwrap_or("unknown")
        )
    } else {
        String::new()
    };
    if !has_revision {
        return (None, Reason::Building, "waiting for a build".to_owned());
    }
    if pool.ready > 0 {
        return (
            Some(true),
            Reason::Running,
            format!(
                "{}/{} instance(s) ready{restarts}",
                pool.ready,
                pool.desired.max(pool.ready)
            ),
        );
    }
    if pool.desired == 0 {
        return (
            Some(true),
            Reason::ScaledToZero,
            format!("no instance while idle; the next request starts one{restarts}"),
        );
    }
    if pool.restarts > 0 {
        return (
            Some(false),
            Reason::InstanceFailing,
            format!("no instance ready{restarts}"),
        );
    }
    (
        Some(false),
        Reason::Starting,
        "starting instances".to_owned(),
    )
}

impl LocalController {
    /// A backend; `pools` is shared with the gateway.
    pub fn new(
        store: Store,
        pools: Pools,
        pool_config: PoolConfig,
        build_config: BuildConfig,
        gateway_url: String,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            store,
            pools,
            tracked: Mutex::default(),
            pool_config: Arc::new(pool_config),
            build_config: Arc::new(build_config),
            gateway_url: gateway_url.trim_end_matches('/').to_owned(),
            shutdown,
        }
    }

    /// Follows the stored Functions until shutdown; then stops every instance.
    pub async fn run(self: Arc<Self>) {
        let store = self.store.clone();
        store
            .follow::<Function, _, _>(&self.shutdown, |change| {
                match change {
                    Change::Applied(function) => self.apply(function),
                    Change::Deleted { namespace, name } => {
                        // Stopping instances takes a moment; do not hold up other changes.
                        let backend = self.clone();
                        tokio::spawn(async move { backend.remove(&namespace, &name).await });
                    }
                    Change::Synced => {}
                }
                std::future::ready(())
            })
            .await;
        self.stop_everything().await;
    }

    async fn stop_everything(&self) {
        let all: Vec<Arc<Tracked>> = self.tracked.lock().values().cloned().collect();
        for tracked in &all {
            tracked.pool.shutdown();
            tracked.stop.cancel();
        }
        // Wait for the instances to be gone, so none outlives the controller.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while all.iter().any(|t| !t.pool.pids().is_empty())
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn tracked(
        self: &Arc<Self>,
        namespace: &str,
        name: &str,
        access: Option<eddy_platform::auth::Tokens>,
    ) -> Arc<Tracked> {
        let key = (namespace.to_owned(), name.to_owned());
        let mut all = self.tracked.lock();
        if let Some(existing) = all.get(&key) {
            return existing.clone();
        }
        let tracked = self.new_tracked(namespace, name);
        tracked.pool.set_access(access);
        all.insert(key.clone(), tracked.clone());
        {
            let mut pools = self.pools.write();
            pools.insert(key, tracked.pool.clone());
        }
        tracked
    }

    fn new_tracked(self: &Arc<Self>, namespace: &str, name: &str) -> Arc<Tracked> {
        let pool = Pool::start(
            namespace,
            name,
            self.pool_config.clone(),
            self.shutdown.child_token(),
        );
        let tracked = Arc::new(Tracked {
            pool,
            status: Mutex::new(FunctionStatus::default()),
            status_changed: Notify::new(),
            reconcile: Mutex::new(None),
            stop: self.shutdown.child_token(),
        });
        tokio::spawn(self.clone().write_status(
            namespace.to_owned(),
            name.to_owned(),
            tracked.clone(),
        ));
        tracked
    }

    fn apply(self: &Arc<Self>, function: Function) {
        let (namespace, name) = function.key();
        // Access applies at once, also to the instances of the previous revision, and a new
        // function's pool has it before the gateway can see the pool.
        let access = function
            .spec
            .access
            .as_ref()
            .and_then(|access| access.digests())
            .map(eddy_platform::auth::Tokens::from_digests);
        let tracked = self.tracked(&namespace, &name, access.clone());
        tracked.pool.set_access(access);
        let generation = function.metadata.generation.unwrap_or(1);
        let observed = tracked.status.lock().observed_generation;
        if observed == Some(generation) {
            return;
        }
        let cancel = self.shutdown.child_token();
        {
            let mut running = tracked.reconcile.lock();
            if let Some(previous) = running.replace(cancel.clone()) {
                previous.cancel();
            }
        }
        let span = tracing::info_span!("reconcile", function = %format!("{}/{}", function.key().0, function.key().1), generation);
        tokio::spawn(
            self.clone()
                .reconcile(function, tracked, cancel)
                .instrument(span),
        );
    }

    fn update_status(tracked: &Tracked, change: impl FnOnce(&mut FunctionStatus)) {
        {
            let mut status = tracked.status.lock();
            change(&mut status);
        }
        tracked.status_changed.notify_one();
    }

    /// Validates, builds and (re)deploys one generation of a Function; runs inside a span
    /// naming the function, so its log lines need not repeat it.
    async fn reconcile(
        self: Arc<Self>,
        function: Function,
        tracked: Arc<Tracked>,
        cancel: CancellationToken,
    ) {
        let generation = function.metadata.generation.unwrap_or(1);
        if !self.accept_spec(&function, &tracked, generation) {
            return;
        }
        let Some(inline) = function.spec.source.inline.as_ref() else {
            return;
        };
        let built = tokio::select! {
            built = build::build(&self.build_config, function.spec.runtime, &inline.source, &inline.dependencies) => built,
            () = cancel.cancelled() => return,
        };
        match built {
            Err(failure) => Self::build_failed(&tracked, failure, generation),
            Ok(_) if cancel.is_cancelled() => {}
            Ok(build) => Self::deploy(&function, &tracked, build, generation),
        }
    }

    /// Checks the spec and says so in status; true when it is valid and a build starts.
    fn accept_spec(&self, function: &Function, tracked: &Tracked, generation: i64) -> bool {
        let errors = validate_function(function);
        if !errors.is_empty() {
            Self::update_status(tracked, |status| {
                set_condition(
                    &mut status.conditions,
                    condition(
                        ConditionType::ConfigurationReady,
                        Some(false),
                        Reason::ValidationFailed,
                        describe_errors(&errors),
                    ),
                );
                status.observed_generation = Some(generation);
            });
            return false;
        }
        let (namespace, name) = function.key();
        let url = format!("{}/{namespace}/{name}", self.gateway_url);
        Self::update_status(tracked, |status| {
            set_condition(
                &mut status.conditions,
                condition(
                    ConditionType::ConfigurationReady,
                    Some(true),
                    Reason::ConfigurationValid,
                    "the spec is valid",
                ),
            );
            set_condition(
                &mut status.conditions,
                condition(
                    ConditionType::BuildReady,
                    None,
                    Reason::BuildRunning,
                    "building the function",
                ),
            );
            status.url = Some(url);
        });
        true
    }

    /// A failed build: said in status; requests wait no longer when nothing else can run.
    fn build_failed(tracked: &Tracked, failure: build::BuildFailure, generation: i64) {
        tracing::warn!(reason = %failure.reason, "build failed");
        if !tracked.pool.has_revision() {
            tracked
                .pool
                .set_unavailable(Some(format!("build failed ({})", failure.reason)));
        }
        Self::update_status(tracked, |status| {
            set_condition(
                &mut status.conditions,
                condition(
                    ConditionType::BuildReady,
                    Some(false),
                    failure.reason,
                    failure.message,
                ),
            );
            status.observed_generation = Some(generation);
        });
    }

    /// Hands a successful build to the pool as the new revision (old instances serve until new
    /// ones are ready) and says so in status.
    fn deploy(function: &Function, tracked: &Tracked, build: build::Build, generation: i64) {
        tracing::info!(build = %build.hash, fresh = build.fresh, "build ready");
        let (min, max) = function.spec.replica_bounds();
        // `replicas: 0` switches the function off: answer at once rather than hold requests.
        tracked.pool.set_unavailable(
            (max == 0).then(|| "the function is switched off (replicas: 0)".to_owned()),
        );
        tracked.pool.set_revision(
            Revision {
                generation,
                runtime: function.spec.runtime,
                dir: build.dir,
                function_dir: build.function_dir,
                program: build.program,
                env: function
                    .spec
                    .env
                    .iter()
                    .map(|var| (var.name.clone(), var.value.clone()))
                    .collect(),
                timeout_seconds: function.spec.timeout().as_secs(),
            },
            usize::try_from(min).unwrap_or(0),
            usize::try_from(max).unwrap_or(1),
        );
        let reason = if build.fresh {
            Reason::BuildSucceeded
        } else {
            Reason::BuildReused
        };
        Self::update_status(tracked, |status| {
            set_condition(
                &mut status.conditions,
                condition(
                    ConditionType::BuildReady,
                    Some(true),
                    reason,
                    format!("build {}", build.hash),
                ),
            );
            status.observed_generation = Some(generation);
        });
    }

    /// Writes the Function's status whenever the reconciler or the pool changes it.
    async fn write_status(self: Arc<Self>, namespace: String, name: String, tracked: Arc<Tracked>) {
        let mut pool_status = tracked.pool.status();
        let mut written: Option<FunctionStatus> = None;
        loop {
            let mut status = tracked.status.lock().clone();
            let snapshot = pool_status.borrow_and_update().clone();
            let (ok, reason, message) = running_condition(&snapshot, tracked.pool.has_revision());
            let mut conditions = written
                .as_ref()
                .map(|w| w.conditions.clone())
                .unwrap_or_default();
            for existing in &status.conditions {
                set_condition(&mut conditions, existing.clone());
            }
            set_condition(
                &mut conditions,
                condition(ConditionType::Running, ok, reason, message),
            );
            status.conditions = conditions;
            status.replicas = i32::try_from(snapshot.ready).unwrap_or(i32::MAX);
            if written.as_ref() != Some(&status) {
                match self
                    .store
                    .put_status::<Function>(&namespace, &name, &status)
                    .await
                {
                    Ok(()) => written = Some(status),
                    Err(error) => {
                        tracing::warn!(%error, %namespace, %name, "cannot write function status")
                    }
                }
            }
            tokio::select! {
                () = tracked.status_changed.notified() => {}
                changed = pool_status.changed() => if changed.is_err() { return },
                () = tracked.stop.cancelled() => return,
                // Retry a failed write now and then.
                () = tokio::time::sleep(Duration::from_secs(5)) => {}
            }
        }
    }

    async fn remove(&self, namespace: &str, name: &str) {
        let key = (namespace.to_owned(), name.to_owned());
        let tracked = self.tracked.lock().remove(&key);
        {
            let mut pools = self.pools.write();
            pools.remove(&key);
        }
        if let Some(tracked) = tracked {
            if let Some(running) = tracked.reconcile.lock().take() {
                running.cancel();
            }
            tracked.stop.cancel();
            tracked.pool.shutdown();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
            while !tracked.pool.pids().is_empty() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tracing::info!(function = %format!("{namespace}/{name}"), "function removed");
        }
        if let Err(error) = self.store.delete_status::<Function>(namespace, name).await {
            tracing::warn!(%error, %namespace, %name, "cannot remove function status");
        }
    }

    /// Process ids of a function's instances (for tests and `eddy` diagnostics).
    pub fn pids(&self, namespace: &str, name: &str) -> Vec<u32> {
        self.tracked
            .lock()
            .get(&(namespace.to_owned(), name.to_owned()))
            .map(|t| t.pool.pids())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_reflects_the_pool() {
        let ready = PoolStatus {
            ready: 2,
            desired: 2,
            ..Default::default()
        };
        assert_eq!(running_condition(&ready, true).0, Some(true));
        assert_eq!(running_condition(&ready, true).1, Reason::Running);
        let zero = PoolStatus::default();
        assert_eq!(running_condition(&zero, true).1, Reason::ScaledToZero);
        let crashing = PoolStatus {
            desired: 1,
            restarts: 3,
            last_error: Some("exited".into()),
            ..Default::default()
        };
        let (ok, reason, message) = running_condition(&crashing, true);
        assert_eq!((ok, reason), (Some(false), Reason::InstanceFailing));
        assert!(message.contains("restarted 3 time(s)"));
        assert_eq!(running_condition(&zero, false).1, Reason::Building);
    }
}
