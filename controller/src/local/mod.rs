//! The local backend: Functions built in a directory and run as supervised processes on this
//! machine; the gateway (the eddy-gateway crate) reaches them through their [`pool::Pools`].
//!
//! For each Function: ConfigurationReady (the spec is valid), BuildReady (source and
//! dependencies built; unchanged code is never rebuilt), Running (instances answer `/healthz`),
//! with `replicas`, `url` and `observedGeneration`, all written to the resource store.

pub mod build;
pub mod inputs;
pub mod installer;
pub mod pool;
pub mod progress;
pub mod spares;
pub mod start;
pub mod toolchain;

use std::{collections::HashMap, sync::Arc, time::Duration};

use parking_lot::Mutex;
use tracing::Instrument as _;

use crate::status::condition;
use eddy_model::conditions::{ConditionType, Reason};
use eddy_model::resources::{
    ConditionStatus, Function, FunctionStatus, KeySource, describe_errors, set_condition,
    validate_function,
};
use eddy_platform::{
    shutdown::CancellationToken,
    store::{Change, Store, StoredResource as _},
};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use tokio::sync::Notify;

use crate::git::{self, GitConfig};

use self::{
    build::{BuildConfig, Code},
    inputs::Inputs,
    pool::{Pool, PoolConfig, PoolStatus, Pools, Revision},
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
    /// The Function as last applied, to reconcile again when what it reads changes.
    function: Mutex<Option<Function>>,
    /// The commit of a Git source that the current revision was built from.
    deployed_commit: Mutex<Option<String>>,
}

/// The local backend.
pub struct LocalController {
    store: Store,
    pools: Pools,
    tracked: Mutex<HashMap<Key, Arc<Tracked>>>,
    pool_config: Arc<PoolConfig>,
    build_config: Arc<BuildConfig>,
    sources: Arc<Sources>,
    gateway_url: String,
    shutdown: CancellationToken,
    progress: progress::BuildProgress,
}

/// Where a Function's Git sources and mounted Secrets are kept locally.
#[derive(Debug, Clone)]
pub struct Sources {
    /// Checkouts of Git sources and their settings.
    pub git: GitConfig,
    /// How often a Git source's reference is checked for a new commit.
    pub git_poll_interval: Duration,
    /// `secretMounts` files, one directory per function (private to this user).
    pub mounts_dir: std::path::PathBuf,
}

/// The Running condition once the newest version's build is known: a build or dependency
/// install of the newest generation that failed (`BuildReady` False) makes Running False with
/// the build's reason and words, whatever an older version still serves (`ready` instances).
/// Pure.
pub fn with_newest_build(
    running: (Option<bool>, Reason, String),
    build: Option<&eddy_model::resources::Condition>,
    ready: usize,
) -> (Option<bool>, Reason, String) {
    let Some(build) = build.filter(|build| build.status == ConditionStatus::False) else {
        return running;
    };
    let reason = if build.reason == Reason::DependencyInstallFailed.as_str() {
        Reason::DependencyInstallFailed
    } else {
        Reason::BuildFailed
    };
    let serving = if ready > 0 {
        format!(" (the previous version keeps serving with {ready} instance(s) ready)")
    } else {
        String::new()
    };
    (
        Some(false),
        reason,
        format!(
            "the newest version did not build{serving}: {}",
            build.message
        ),
    )
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
    if pool.ready > 0 && pool.rolling_out && pool.consecutive_failures > 0 {
        // As Kyma's controller says of a rollout that fails: False, though the previous version
        // keeps serving; the status describes the newest version.
        return (
            Some(false),
            Reason::DeploymentFailed,
            format!(
                "the newest version does not start ({} attempt(s)), last: {}; the previous \
                 version keeps serving with {} instance(s) ready",
                pool.consecutive_failures,
                pool.last_error.as_deref().unwrap_or("unknown"),
                pool.ready,
            ),
        );
    }
    if pool.ready > 0 && pool.rolling_out {
        // As Kyma's controller says of a rollout under way: Unknown until the newest version
        // serves.
        return (
            None,
            Reason::DeploymentWaiting,
            format!(
                "rolling out the newest version; the previous version keeps serving with {} \
                 instance(s) ready",
                pool.ready
            ),
        );
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
    // Only a Function that may have none is scaled to zero: one whose autoscaler has not yet
    // asked for its first instance is starting, not running.
    if pool.desired == 0 && pool.min == 0 {
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
    /// The warm spares new instances start from (`None` when turned off).
    pub fn spares(&self) -> Option<&Arc<spares::Spares>> {
        self.pool_config.spares.as_ref()
    }

    /// A backend; `pools` is shared with the gateway.
    pub fn new(
        store: Store,
        pools: Pools,
        pool_config: PoolConfig,
        build_config: BuildConfig,
        sources: Sources,
        gateway_url: String,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            store,
            pools,
            tracked: Mutex::default(),
            pool_config: Arc::new(pool_config),
            build_config: Arc::new(build_config),
            sources: Arc::new(sources),
            gateway_url: gateway_url.trim_end_matches('/').to_owned(),
            shutdown,
            progress: progress::BuildProgress::default(),
        }
    }

    /// What builds are doing, for a terminal to show.
    pub fn build_progress(&self) -> progress::BuildProgress {
        self.progress.clone()
    }

    /// Follows the stored Functions (and the Secrets and ConfigMaps they read) until shutdown;
    /// then stops every instance.
    pub async fn run(self: Arc<Self>) {
        let store = self.store.clone();
        let functions = store.follow::<Function, _, _>(&self.shutdown, |change| {
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
        });
        let secrets = store.follow::<Secret, _, _>(&self.shutdown, |change| {
            self.object_changed(KeySource::Secret, change.key());
            std::future::ready(())
        });
        let config_maps = store.follow::<ConfigMap, _, _>(&self.shutdown, |change| {
            self.object_changed(KeySource::ConfigMap, change.key());
            std::future::ready(())
        });
        tokio::join!(
            functions,
            secrets,
            config_maps,
            self.clone().poll_git_sources()
        );
        self.stop_everything().await;
    }

    /// Reconciles again every function that reads the Secret or ConfigMap that changed: by
    /// reference, or as its private package registry configuration (the namespace's, or the
    /// cluster-wide one in `kyma-system`).
    fn object_changed(self: &Arc<Self>, kind: KeySource, key: Option<(String, String)>) {
        use crate::package_registry::{CLUSTER_NAMESPACE, SECRET_NAME};
        let Some((namespace, name)) = key else { return };
        let registry = kind == KeySource::Secret && name == SECRET_NAME;
        let readers: Vec<(Function, Arc<Tracked>)> = self
            .tracked
            .lock()
            .iter()
            .filter(|((ns, _), _)| *ns == namespace || (registry && namespace == CLUSTER_NAMESPACE))
            .filter_map(|(_, tracked)| {
                let function = tracked.function.lock().clone()?;
                (registry
                    || function
                        .spec
                        .referenced_objects()
                        .contains(&(kind, name.as_str())))
                .then(|| (function, tracked.clone()))
            })
            .collect();
        for (function, tracked) in readers {
            self.start_reconcile(function, tracked);
        }
    }

    /// Checks every Git source's reference now and then; a moved reference is built and rolled
    /// out.
    async fn poll_git_sources(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.sources.git_poll_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = self.shutdown.cancelled() => return,
            }
            let watched: Vec<(Function, Arc<Tracked>)> = self
                .tracked
                .lock()
                .values()
                .filter_map(|tracked| {
                    let function = tracked.function.lock().clone()?;
                    function
                        .spec
                        .source
                        .git_repository
                        .is_some()
                        .then(|| (function, tracked.clone()))
                })
                .collect();
            for (function, tracked) in watched {
                let Some(deployed) = tracked.deployed_commit.lock().clone() else {
                    // Never built: a source that could not be reached is tried again at each
                    // poll (one still building, or failed for another reason, is left alone).
                    if Self::source_was_unavailable(&tracked) {
                        self.start_reconcile(function, tracked);
                    }
                    continue;
                };
                let Some(git) = &function.spec.source.git_repository else {
                    continue;
                };
                let (namespace, name) = function.key();
                let credentials =
                    match inputs::resolve(&self.store, &namespace, &name, &function.spec).await {
                        Ok(Ok(inputs)) => inputs.git_credentials,
                        _ => continue,
                    };
                match git::resolve(
                    &self.sources.git,
                    &git.url,
                    &git.reference,
                    credentials.as_ref(),
                )
                .await
                {
                    Ok(commit) if commit != deployed => {
                        tracing::info!(function = %format!("{}/{}", function.key().0, function.key().1), %commit, "the Git reference moved; building it");
                        self.start_reconcile(function, tracked);
                    }
                    Ok(_) => {}
                    Err(failure) => {
                        tracing::warn!(function = %format!("{}/{}", function.key().0, function.key().1), reason = %failure.reason, "cannot check the Git reference")
                    }
                }
            }
        }
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
        access: Option<&eddy_model::resources::AccessSpec>,
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
            function: Mutex::new(None),
            deployed_commit: Mutex::new(None),
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
        let access = function.spec.access.as_ref();
        let tracked = self.tracked(&namespace, &name, access);
        tracked.pool.set_access(access);
        *tracked.function.lock() = Some(function.clone());
        let generation = function.metadata.generation.unwrap_or(1);
        let observed = tracked.status.lock().observed_generation;
        if observed == Some(generation) {
            return;
        }
        self.start_reconcile(function, tracked);
    }

    /// Reconciles `function` in the background, cancelling a reconcile still running for it.
    fn start_reconcile(self: &Arc<Self>, function: Function, tracked: Arc<Tracked>) {
        let generation = function.metadata.generation.unwrap_or(1);
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
        let (namespace, name) = function.key();
        let inputs = match inputs::resolve(&self.store, &namespace, &name, &function.spec).await {
            Ok(Ok(inputs)) => inputs,
            Ok(Err(missing)) => {
                Self::held_back(
                    &tracked,
                    Reason::ReferenceNotFound,
                    missing.to_string(),
                    generation,
                );
                return;
            }
            Err(error) => {
                tracing::warn!(%error, "cannot read the Secrets and ConfigMaps the function reads");
                Self::held_back(
                    &tracked,
                    Reason::ReferenceNotFound,
                    "the resource store is unavailable; retried when a Secret or ConfigMap changes"
                        .to_owned(),
                    generation,
                );
                return;
            }
        };
        let built = tokio::select! {
            built = self.build(&function, &inputs) => built,
            () = cancel.cancelled() => return,
        };
        match built {
            Err(failure) => Self::build_failed(&tracked, failure, generation),
            Ok(_) if cancel.is_cancelled() => {}
            Ok((build, commit)) => match self.write_mounts(&function, &inputs).await {
                Ok(mounts) => {
                    *tracked.deployed_commit.lock() = commit.clone();
                    Self::deploy(
                        &function, &tracked, build, generation, inputs, mounts, commit,
                    );
                }
                Err(failure) => Self::build_failed(&tracked, failure, generation),
            },
        }
    }

    /// Builds the function's code: inline, or the Git source's reference checked out (the
    /// commit is returned too).
    async fn build(
        &self,
        function: &Function,
        inputs: &Inputs,
    ) -> Result<(build::Build, Option<String>), build::BuildFailure> {
        let runtime = function.spec.runtime;
        let (namespace, name) = function.key();
        let reporter = self.progress.of(format!("{namespace}/{name}"));
        let reporter = Some(&reporter);
        if let Some(inline) = &function.spec.source.inline {
            let code = Code::Inline {
                source: &inline.source,
                dependencies: &inline.dependencies,
            };
            return Ok((
                build::build(
                    &self.build_config,
                    runtime,
                    code,
                    inputs.package_registry.as_ref(),
                    reporter,
                )
                .await?,
                None,
            ));
        }
        let Some(repository) = &function.spec.source.git_repository else {
            return Err(build::BuildFailure {
                reason: Reason::BuildFailed,
                message: "the spec has no source".to_owned(),
            });
        };
        let credentials = inputs.git_credentials.as_ref();
        let git = &self.sources.git;
        let commit = git::resolve(git, &repository.url, &repository.reference, credentials).await?;
        let checkout = git::checkout(git, &repository.url, &commit, credentials).await?;
        let base_dir = repository
            .base_dir
            .as_deref()
            .unwrap_or("")
            .trim_matches('/');
        let dir = checkout.join(base_dir);
        // A base directory that leaves the checkout through a symbolic link is refused.
        let inside = tokio::fs::canonicalize(&dir)
            .await
            .ok()
            .zip(tokio::fs::canonicalize(&checkout).await.ok())
            .is_some_and(|(dir, checkout)| dir.starts_with(checkout) && dir.is_dir());
        if !inside {
            return Err(build::BuildFailure {
                reason: Reason::SourceUnavailable,
                message: format!("the repository has no directory {base_dir:?} at {commit}"),
            });
        }
        let identity = format!("git {} {commit} {base_dir}", repository.url);
        let code = Code::Directory {
            dir: &dir,
            identity: &identity,
        };
        Ok((
            build::build(
                &self.build_config,
                runtime,
                code,
                inputs.package_registry.as_ref(),
                reporter,
            )
            .await?,
            Some(commit),
        ))
    }

    /// Writes the `secretMounts` files: a directory per mount holding a file per key, private to
    /// this user, named by a digest of the contents so running instances keep theirs until they
    /// are replaced. Returns (mount path, directory) pairs.
    async fn write_mounts(
        &self,
        function: &Function,
        inputs: &Inputs,
    ) -> Result<Vec<(String, std::path::PathBuf)>, build::BuildFailure> {
        use sha2::{Digest as _, Sha256};
        use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
        if inputs.mounts.is_empty() {
            return Ok(Vec::new());
        }
        let (namespace, name) = function.key();
        let mut digest = Sha256::new();
        for (path, data) in &inputs.mounts {
            digest.update(path.as_bytes());
            for (key, value) in data {
                digest.update((key.len() as u64).to_be_bytes());
                digest.update(key.as_bytes());
                digest.update((value.len() as u64).to_be_bytes());
                digest.update(value);
            }
        }
        let version: String = digest.finalize()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let root = self
            .sources
            .mounts_dir
            .join(&namespace)
            .join(&name)
            .join(version);
        let mounts = inputs.mounts.clone();
        let target = root.clone();
        tokio::task::spawn_blocking(
            move || -> std::io::Result<Vec<(String, std::path::PathBuf)>> {
                let mut written = Vec::new();
                for (index, (mount_path, data)) in mounts.iter().enumerate() {
                    let dir = target.join(index.to_string());
                    std::fs::DirBuilder::new()
                        .recursive(true)
                        .mode(0o700)
                        .create(&dir)?;
                    for (key, value) in data {
                        let file = dir.join(key);
                        let mut out = std::fs::OpenOptions::new()
                            .write(true)
                            .create(true)
                            .truncate(true)
                            .mode(0o600)
                            .open(&file)?;
                        std::io::Write::write_all(&mut out, value)?;
                    }
                    written.push((mount_path.clone(), dir));
                }
                Ok(written)
            },
        )
        .await
        .map_err(|error| build::BuildFailure {
            reason: Reason::BuildFailed,
            message: format!("writing the secret mounts failed: {error}"),
        })?
        .map_err(|error| build::BuildFailure::io("write the secret mounts under", &root, &error))
    }

    /// The spec is invalid or something it reads is missing: said in ConfigurationReady; requests
    /// wait no longer when nothing else can run.
    fn held_back(tracked: &Tracked, reason: Reason, message: String, generation: i64) {
        tracing::warn!(%reason, %message, "the function is held back");
        if !tracked.pool.has_revision() {
            tracked.pool.set_unavailable(Some(message.clone()));
        }
        Self::update_status(tracked, |status| {
            set_condition(
                &mut status.conditions,
                condition(
                    ConditionType::ConfigurationReady,
                    Some(false),
                    reason,
                    message,
                ),
            );
            status.observed_generation = Some(generation);
        });
    }

    /// Checks the spec and says so in status; true when it is valid and a build starts.
    fn accept_spec(&self, function: &Function, tracked: &Tracked, generation: i64) -> bool {
        let errors = validate_function(function);
        if !errors.is_empty() {
            Self::held_back(
                tracked,
                Reason::ValidationFailed,
                describe_errors(&errors),
                generation,
            );
            return false;
        }
        let (namespace, name) = function.key();
        let url = format!("{}/{namespace}/{name}", self.gateway_url);
        let ignored = function.spec.kubernetes_only_fields();
        let message = function.spec.configured_message(if ignored.is_empty() {
            "the spec is valid".to_owned()
        } else {
            format!(
                "the spec is valid; ignored in local mode (they apply on Kubernetes): {}",
                ignored.join(", ")
            )
        });
        Self::update_status(tracked, |status| {
            set_condition(
                &mut status.conditions,
                condition(
                    ConditionType::ConfigurationReady,
                    Some(true),
                    Reason::ConfigurationValid,
                    message,
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

    /// Whether the last build stopped because the Git source could not be reached.
    fn source_was_unavailable(tracked: &Tracked) -> bool {
        tracked.status.lock().conditions.iter().any(|condition| {
            condition.type_ == ConditionType::BuildReady.as_str()
                && condition.status == ConditionStatus::False
                && condition.reason == Reason::SourceUnavailable.as_str()
        })
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
    fn deploy(
        function: &Function,
        tracked: &Tracked,
        build: build::Build,
        generation: i64,
        inputs: Inputs,
        secret_mounts: Vec<(String, std::path::PathBuf)>,
        commit: Option<String>,
    ) {
        tracing::info!(build = %build.hash, fresh = build.fresh, "build ready");
        let (min, max) = function.spec.replica_bounds();
        // `replicas: 0` switches the function off: answer at once rather than hold requests.
        tracked.pool.set_unavailable(
            (max == 0).then(|| "the function is switched off (replicas: 0)".to_owned()),
        );
        tracked.pool.set_revision(
            Revision {
                generation,
                rollout: 0,
                runtime: function.spec.runtime,
                dir: build.dir,
                function_dir: build.function_dir,
                program: build.program,
                libraries: build.libraries,
                env: inputs.env,
                secret_mounts,
                timeout_seconds: function.spec.timeout().as_secs(),
                memory_limit: function.spec.memory_limit_bytes(),
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
            status.commit = commit;
            status.describe_spec(&function.spec);
            status.pod_selector = Some(format!("eddy.dev/function={}", function.key().1));
        });
    }

    /// Writes the Function's status whenever the reconciler or the pool changes it.
    async fn write_status(self: Arc<Self>, namespace: String, name: String, tracked: Arc<Tracked>) {
        let mut pool_status = tracked.pool.status();
        let mut written: Option<FunctionStatus> = None;
        loop {
            let mut status = tracked.status.lock().clone();
            let snapshot = pool_status.borrow_and_update().clone();
            let build = status
                .conditions
                .iter()
                .find(|c| c.type_ == ConditionType::BuildReady.as_str());
            let (ok, reason, message) = with_newest_build(
                running_condition(&snapshot, tracked.pool.has_revision()),
                build,
                snapshot.ready,
            );
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
            self.pool_config.metrics.remove(namespace, name);
            let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
            while !tracked.pool.pids().is_empty() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tracing::info!(function = %format!("{namespace}/{name}"), "function removed");
        }
        let mounts = self.sources.mounts_dir.join(namespace).join(name);
        if let Err(error) = tokio::fs::remove_dir_all(&mounts).await
            && error.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(%error, dir = %mounts.display(), "cannot remove the function's secret mounts");
        }
        if let Err(error) = self.store.delete_status::<Function>(namespace, name).await {
            tracing::warn!(%error, %namespace, %name, "cannot remove function status");
        }
    }

    /// A function's instances as a Kubernetes-style `PodList`: each carries the Function's
    /// `labels` and `annotations` (and the deprecated `template`'s) beside `eddy.dev/function`,
    /// so `status.podSelector` selects them, and Kyma's four pod labels. `None` when the function is not known.
    pub fn instances(&self, namespace: &str, name: &str) -> Option<serde_json::Value> {
        let tracked = self
            .tracked
            .lock()
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()?;
        let function = tracked.function.lock().clone();
        // As its pods on Kubernetes: `labels` and `annotations` over the deprecated `template`'s.
        let mut labels = function
            .as_ref()
            .map(|f| f.spec.pod_labels())
            .unwrap_or_default();
        labels.insert("eddy.dev/function".to_owned(), name.to_owned());
        // Kyma's labels, as its Function controller puts them on the pods.
        let uid = function
            .as_ref()
            .and_then(|f| f.metadata.uid.clone())
            .unwrap_or_default();
        for (label, value) in eddy_model::kyma::pod_labels(name, &uid) {
            labels.insert(label.to_owned(), value);
        }
        let annotations = function
            .map(|f| f.spec.pod_annotations())
            .unwrap_or_default();
        let items: Vec<serde_json::Value> = tracked
            .pool
            .instances()
            .into_iter()
            .map(|instance| {
                let phase = match instance.state {
                    pool::InstanceState::Starting => "Pending",
                    pool::InstanceState::Ready => "Running",
                    pool::InstanceState::Draining => "Terminating",
                    pool::InstanceState::Gone => "Succeeded",
                };
                serde_json::json!({
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {
                        "name": format!("{name}-{}-{}", instance.rollout, instance.id),
                        "namespace": namespace,
                        "labels": labels,
                        "annotations": annotations,
                    },
                    "status": {
                        "phase": phase, "ready": instance.state == pool::InstanceState::Ready,
                        "pid": instance.pid, "port": instance.port,
                        "generation": instance.generation, "inFlight": instance.in_flight,
                    },
                })
            })
            .collect();
        Some(
            serde_json::json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}),
        )
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
        // Before its autoscaler asks for the first instance, a Function that must have one is
        // starting: its status must not say it runs (found when a test saw Running and no
        // process).
        let first = PoolStatus {
            min: 1,
            ..Default::default()
        };
        assert_eq!(
            running_condition(&first, true),
            (
                Some(false),
                Reason::Starting,
                "starting instances".to_owned()
            )
        );
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
        let update_failing = PoolStatus {
            ready: 1,
            desired: 1,
            restarts: 2,
            last_error: Some("instance exited during start-up".into()),
            rolling_out: true,
            consecutive_failures: 2,
            min: 1,
        };
        // Kyma's controller: a rollout that fails is False, one under way Unknown, though the
        // previous version serves; Running describes the newest version.
        let (ok, reason, message) = running_condition(&update_failing, true);
        assert_eq!((ok, reason), (Some(false), Reason::DeploymentFailed));
        assert!(
            message
                == "the newest version does not start (2 attempt(s)), last: instance exited \
                    during start-up; the previous version keeps serving with 1 instance(s) ready",
            "{message}"
        );
        let rolling = PoolStatus {
            consecutive_failures: 0,
            ..update_failing
        };
        assert_eq!(
            running_condition(&rolling, true).0,
            None,
            "a rollout under way"
        );
        assert_eq!(
            running_condition(&rolling, true).1,
            Reason::DeploymentWaiting
        );
        // The newest version's install failed before any rollout: False, with npm's words.
        let failed_build = eddy_model::resources::Condition {
            type_: "BuildReady".into(),
            status: ConditionStatus::False,
            reason: "DependencyInstallFailed".into(),
            message: "npm error 404 Not Found - GET https://registry.npmjs.org/nope".into(),
            last_transition_time: String::new(),
        };
        let (ok, reason, message) =
            with_newest_build(running_condition(&ready, true), Some(&failed_build), 2);
        assert_eq!((ok, reason), (Some(false), Reason::DependencyInstallFailed));
        assert!(
            message.contains("previous version keeps serving with 2"),
            "{message}"
        );
        assert!(message.contains("npm error 404"), "{message}");
        let built = eddy_model::resources::Condition {
            status: ConditionStatus::True,
            ..failed_build
        };
        assert_eq!(
            with_newest_build(running_condition(&ready, true), Some(&built), 2).1,
            Reason::Running
        );
    }
}
