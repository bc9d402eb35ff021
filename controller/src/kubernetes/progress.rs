//! Where a Function's build, install and rollout stand: pure decisions over its Job, its
//! pods and its Deployment, which the reconciler turns into conditions.

use super::{Backoff, Deployment, Duration, Job, Pod, Reason, Scaling, SignedDuration, Timestamp};
use kube::ResourceExt as _;

/// Where a build stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BuildState {
    /// Not finished.
    Running,
    /// The image is pushed.
    Succeeded,
    /// The build failed; why, as the Job says.
    Failed(String),
}

/// Annotation on a build Job: which attempt at building its source it is (1 when absent).
pub const BUILD_ATTEMPT_ANNOTATION: &str = "eddy.dev/build-attempt";

/// Delays before a failed build is tried again: 1 minute, doubling up to 30 minutes. A build
/// can fail for reasons outside its source (a registry or package mirror down, a node
/// evicted), so it is retried, but rarely enough not to load the cluster; a new source is
/// built at once.
pub const BUILD_RETRY: Backoff =
    Backoff::exponential(Duration::from_secs(60), Duration::from_secs(30 * 60));

/// Which attempt at building its source `job` is (1, 2, …). Pure.
pub fn build_attempt(job: &Job) -> u32 {
    job.metadata
        .annotations
        .as_ref()
        .and_then(|annotations| annotations.get(BUILD_ATTEMPT_ANNOTATION))
        .and_then(|attempt| attempt.parse::<u32>().ok())
        .unwrap_or(1)
        .max(1)
}

/// `job` marked as attempt `attempt` at its build. Pure.
pub fn with_build_attempt(mut job: Job, attempt: u32) -> Job {
    if attempt > 1 {
        job.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(BUILD_ATTEMPT_ANNOTATION.to_owned(), attempt.to_string());
    }
    job
}

/// When a failed build Job is tried again: [`BUILD_RETRY`]'s delay for its attempt after it
/// failed (its `Failed` condition's time, else its start, else `now`). Pure.
pub fn build_retry_at(job: &Job, now: Timestamp) -> Timestamp {
    let status = job.status.as_ref();
    let failed = status
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default()
        .iter()
        .filter(|c| (c.type_ == "Failed" || c.type_ == "FailureTarget") && c.status == "True")
        .find_map(|c| c.last_transition_time.as_ref())
        .or_else(|| status.and_then(|s| s.start_time.as_ref()))
        .map_or(now, |time| time.0);
    let delay = SignedDuration::try_from(BUILD_RETRY.delay(build_attempt(job)))
        .unwrap_or(SignedDuration::MAX);
    failed.checked_add(delay).unwrap_or(Timestamp::MAX)
}

/// Reads a build Job's state. Pure.
pub fn build_state(job: &Job) -> BuildState {
    let status = job.status.as_ref();
    let conditions = status
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    let holds = |type_: &str| {
        conditions
            .iter()
            .find(|c| c.type_ == type_ && c.status == "True")
    };
    if holds("Complete").is_some() || status.and_then(|s| s.succeeded).unwrap_or(0) > 0 {
        return BuildState::Succeeded;
    }
    if let Some(failed) = holds("Failed").or_else(|| holds("FailureTarget")) {
        let reason = failed.reason.as_deref().unwrap_or("Failed");
        let message = failed.message.as_deref().unwrap_or("the build Job failed");
        return BuildState::Failed(format!("{reason}: {message}"));
    }
    if status.and_then(|s| s.failed).unwrap_or(0) > 0 {
        // backoffLimit is 0: one failed pod is a failed build.
        return BuildState::Failed("the build pod failed".to_owned());
    }
    BuildState::Running
}

/// The tail of the build log, from the termination message of the build pod's container
/// that failed (the Git fetch or the build). Pure.
pub fn build_log_tail(pods: &[Pod]) -> Option<String> {
    pods.iter()
        .filter_map(|pod| pod.status.as_ref())
        .flat_map(|status| {
            let init = status.init_container_statuses.iter().flatten();
            init.chain(status.container_statuses.iter().flatten())
        })
        .filter_map(|status| status.state.as_ref()?.terminated.as_ref()?.message.clone())
        .map(|message| crate::status::tail(message.trim(), 20))
        .find(|message| !message.is_empty())
}

/// Why a buildless pod's `install` init container failed, from its termination message (the
/// tail of npm's or pip's output): the pod name and the message. The container may be waiting
/// to run again (CrashLoopBackOff), so its last state counts as well. Pure.
pub fn install_failure(pods: &[Pod]) -> Option<(String, String)> {
    pods.iter().find_map(|pod| {
        let statuses = pod.status.as_ref()?.init_container_statuses.as_ref()?;
        let install = statuses.iter().find(|status| status.name == "install")?;
        let failed = [install.state.as_ref(), install.last_state.as_ref()]
            .into_iter()
            .flatten()
            .filter_map(|state| state.terminated.as_ref())
            .find(|terminated| terminated.exit_code != 0)?;
        let message = failed
            .message
            .as_deref()
            .map(|message| crate::status::tail(message.trim(), 20))
            .filter(|message| !message.is_empty())
            .unwrap_or_else(|| format!("exit code {}", failed.exit_code));
        Some((pod.name_any(), message))
    })
}

/// Why a Function's pod cannot be placed on a node (the scheduler's own message, such as
/// `0/1 nodes are available: 1 Insufficient cpu.`): the pod name and the message. Pure.
pub fn unschedulable(pods: &[Pod]) -> Option<(String, String)> {
    pods.iter().find_map(|pod| {
        let conditions = pod.status.as_ref()?.conditions.as_ref()?;
        let refused = conditions.iter().find(|condition| {
            condition.type_ == "PodScheduled"
                && condition.status == "False"
                && condition.reason.as_deref() == Some("Unschedulable")
        })?;
        Some((pod.name_any(), refused.message.clone().unwrap_or_default()))
    })
}

/// How soon a Function whose pods are not available yet is looked at again: a failed install
/// or a pod no node takes shows in no object the controller watches.
pub(super) const INSTALL_CHECK: Duration = Duration::from_secs(5);

/// The Running condition (status, reason, message) and available replicas of a Function's
/// Deployment. Pure.
pub fn running_condition(
    deployment: &Deployment,
    scaling: Scaling,
) -> (Option<bool>, Reason, String, i32) {
    let status = deployment.status.clone().unwrap_or_default();
    let available = status.available_replicas.unwrap_or(0);
    let desired = match scaling {
        Scaling::Fixed(replicas) => replicas,
        Scaling::Autoscaled { min, .. } => status.replicas.unwrap_or(min).max(min),
        // What the gateway or the dispatcher last asked for.
        Scaling::ByEddy { min, .. } => deployment.spec.replicas.unwrap_or(min.max(1)).max(min),
    };
    let conditions = status.conditions.unwrap_or_default();
    if let Some(stuck) = conditions.iter().find(|c| {
        c.type_.as_deref() == Some("Progressing")
            && c.status.as_deref() == Some("False")
            && c.reason.as_deref() == Some("ProgressDeadlineExceeded")
    }) {
        let message = stuck.message.clone().unwrap_or_default();
        return (Some(false), Reason::DeploymentFailed, message, available);
    }
    let observed =
        status.observed_generation.unwrap_or(0) >= deployment.metadata.generation.unwrap_or(0);
    let updated = status.updated_replicas.unwrap_or(0);
    if desired == 0 && observed && status.replicas.unwrap_or(0) == 0 {
        let message = match scaling {
            Scaling::ByEddy { min: 0, .. } => "no pod while idle; a call or an event wakes it",
            _ => "0 replicas requested",
        };
        return (Some(true), Reason::ScaledToZero, message.to_owned(), 0);
    }
    let available_condition = conditions
        .iter()
        .any(|c| c.type_.as_deref() == Some("Available") && c.status.as_deref() == Some("True"));
    // As Kyma's controller: running only once the newest version is out (Progressing with
    // NewReplicaSetAvailable). An update whose new pod never starts leaves the old pod
    // Available and the counts whole (the new pod is counted as updated), so neither tells.
    let newest_out = conditions.iter().any(|c| {
        c.type_.as_deref() == Some("Progressing")
            && c.status.as_deref() == Some("True")
            && c.reason.as_deref() == Some("NewReplicaSetAvailable")
    });
    if observed && available_condition && newest_out && updated >= desired && available >= desired {
        return (
            Some(true),
            Reason::DeploymentReady,
            format!("{available} of {desired} replicas available"),
            available,
        );
    }
    if available_condition {
        return (
            None,
            Reason::DeploymentWaiting,
            format!(
                "rolling out the newest version: {updated} of {desired} replicas updated, \
                 {available} available (the previous version serves meanwhile)"
            ),
            available,
        );
    }
    (
        None,
        Reason::DeploymentPending,
        "waiting for the Deployment to become available".to_owned(),
        available,
    )
}
