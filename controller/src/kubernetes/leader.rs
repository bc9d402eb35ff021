//! One active controller on Kubernetes. The replicas compete for a `coordination.k8s.io`
//! Lease (through `kube-lease-manager`); only the holder runs the reconcilers, and a standby
//! takes over once the holder stops renewing it (at most the lease duration plus up to a
//! second after). A replica that stops releases the lease, so a rolling update hands over at
//! once.

use std::{future::Future, time::Duration};

use eddy_platform::shutdown::CancellationToken;
use kube::Client;
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder};
use tokio::{sync::watch, task::JoinHandle};

use crate::Result;

/// Flags of leader election.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Kubernetes backend: leader election")]
pub struct LeaderArgs {
    /// Run the reconcilers only while this replica holds the lease (`false`: always, for a
    /// controller that runs as one replica).
    #[arg(long = "leader-election", env = "EDDY_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    pub enabled: bool,
    /// Name of the Lease.
    #[arg(
        long = "lease-name",
        env = "EDDY_LEASE_NAME",
        default_value = "eddy-controller"
    )]
    pub lease_name: String,
    /// Namespace of the Lease (the chart gives the controller's own).
    #[arg(
        long = "lease-namespace",
        env = "EDDY_LEASE_NAMESPACE",
        default_value = "eddy-system"
    )]
    pub lease_namespace: String,
    /// How long the lease holds without being renewed; it is renewed a third of that before it
    /// runs out. At least 3 s.
    #[arg(long = "lease-duration", env = "EDDY_LEASE_DURATION", default_value = "15s", value_parser = parse_lease_duration)]
    pub lease_duration: Duration,
    /// This replica's name in the Lease (default: `$HOSTNAME`, the pod's name).
    #[arg(long = "lease-identity", env = "EDDY_LEASE_IDENTITY")]
    pub identity: Option<String>,
}

/// Why a `--lease-duration` is not one.
#[derive(Debug, thiserror::Error)]
pub enum LeaseDurationError {
    /// Not a duration.
    #[error(transparent)]
    Unreadable(#[from] humantime::DurationError),
    /// Shorter than a renewal round trip can be trusted to take.
    #[error("must be at least 3s")]
    TooShort,
}

fn parse_lease_duration(text: &str) -> Result<Duration, LeaseDurationError> {
    let duration = humantime::parse_duration(text)?;
    if duration < Duration::from_secs(3) {
        return Err(LeaseDurationError::TooShort);
    }
    Ok(duration)
}

impl LeaderArgs {
    /// This replica's identity.
    pub fn identity(&self) -> String {
        self.identity
            .clone()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .filter(|name| !name.is_empty())
            .unwrap_or_else(|| format!("eddy-controller-{}", std::process::id()))
    }

    /// (duration, renew this long before it runs out) in whole seconds.
    pub fn timing(&self) -> (u64, u64) {
        let duration = self.lease_duration.as_secs().max(3);
        (duration, (duration / 3).max(1))
    }
}

/// The field manager a replica writes the Lease with.
pub fn field_manager(identity: &str) -> String {
    format!("eddy-controller-{identity}")
}

/// Competes for the lease. The receiver says whether this replica leads; dropping it releases
/// the lease, after which the returned task ends. Joining the election is retried until it
/// succeeds (an API server that is not there yet, a Lease namespace that does not exist yet),
/// each failure logged with its cause, with a backoff from 200 ms to 10 s; `None` at
/// `shutdown`. Once joined, the manager retries its own errors (logged by it).
pub async fn leadership(
    client: Client,
    args: &LeaderArgs,
    identity: String,
    shutdown: &CancellationToken,
) -> Option<(
    watch::Receiver<bool>,
    JoinHandle<kube_lease_manager::Result<LeaseManager>>,
)> {
    let (duration, grace) = args.timing();
    let mut failures = 0_u32;
    loop {
        let built = LeaseManagerBuilder::new(client.clone(), args.lease_name.clone())
            .with_namespace(args.lease_namespace.clone())
            // Its own field manager per replica: two replicas' applies of the holder conflict.
            .with_field_manager(field_manager(&identity))
            .with_identity(identity.clone())
            .with_duration(duration)
            .with_grace(grace)
            .build()
            .await;
        let error = match built {
            Ok(manager) => {
                if failures > 0 {
                    tracing::info!(failures, "joined the lease election");
                }
                return Some(manager.watch().await);
            }
            Err(error) => error,
        };
        failures = failures.saturating_add(1);
        let delay = JOIN_RETRY.delay(failures);
        tracing::warn!(
            %error,
            lease = %args.lease_name,
            namespace = %args.lease_namespace,
            failures,
            retry_in = ?delay,
            "cannot join the lease election; nothing is reconciled until it is joined"
        );
        tokio::select! {
            () = shutdown.cancelled() => return None,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

/// How joining the lease election is retried.
const JOIN_RETRY: eddy_model::backoff::Backoff =
    eddy_model::backoff::Backoff::exponential(Duration::from_millis(200), Duration::from_secs(10));

/// Runs `work` while this replica leads ([`while_leading`]) until `shutdown`, then waits (up
/// to 5 s) for `manager` to release the lease, so that a standby takes over at once. An
/// election that ends before `shutdown` (its task gone) cancels `shutdown`, so the whole
/// process stops and is started again, and is [`crate::Error::ElectionEnded`]: a controller
/// that stays up without an election would reconcile nothing, and say nothing.
pub async fn lead<F, Fut>(
    leading: watch::Receiver<bool>,
    manager: JoinHandle<kube_lease_manager::Result<LeaseManager>>,
    shutdown: CancellationToken,
    work: F,
) -> Result<()>
where
    F: FnMut(CancellationToken) -> Fut,
    Fut: Future<Output = ()>,
{
    while_leading(leading, shutdown.clone(), work).await;
    let ended = !shutdown.is_cancelled();
    if ended {
        shutdown.cancel();
    }
    // The receiver is gone: the manager releases the lease.
    match tokio::time::timeout(Duration::from_secs(5), manager).await {
        Ok(Ok(Err(error))) => tracing::warn!(%error, "releasing the lease"),
        Err(_) => tracing::warn!("releasing the lease took over 5s"),
        _ => {}
    }
    if ended {
        return Err(crate::Error::ElectionEnded);
    }
    Ok(())
}

/// Runs `work` while `leading` is true: started when this replica becomes the leader,
/// cancelled (its token) and awaited when it stops being one, started again when it leads
/// again. Returns at `shutdown` (the work's token is a child of it) or when the election ends.
pub async fn while_leading<F, Fut>(
    mut leading: watch::Receiver<bool>,
    shutdown: CancellationToken,
    mut work: F,
) where
    F: FnMut(CancellationToken) -> Fut,
    Fut: Future<Output = ()>,
{
    loop {
        let elected = tokio::select! {
            () = shutdown.cancelled() => return,
            result = leading.wait_for(|leads| *leads) => result.is_ok(),
        };
        if !elected {
            tracing::error!("leader election ended");
            return;
        }
        tracing::info!("holding the lease: reconcilers run");
        let term = shutdown.child_token();
        let run = work(term.clone());
        tokio::pin!(run);
        let lost = tokio::select! {
            () = &mut run => return,
            result = leading.wait_for(|leads| !*leads) => result.map(drop),
        };
        tracing::warn!("lost the lease: reconcilers stop until it is held again");
        term.cancel();
        run.await;
        if lost.is_err() {
            return;
        }
    }
}
