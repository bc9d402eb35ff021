//! One shutdown signal for the whole process.
//!
//! SIGINT or SIGTERM cancels a single [`CancellationToken`]; every server, watch and consumer loop
//! holds a child of it, so one signal drains them all.

pub use tokio_util::sync::CancellationToken;

/// Returns a token that is cancelled on the first SIGINT or SIGTERM.
pub fn on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let trigger = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutdown signal received");
        trigger.cancel();
    });
    token
}

/// Runs `run` each time `changed` is notified, until `shutdown`. A `Notify` keeps one permit, so
/// the changes that come while `run` runs are taken together by the next run.
pub async fn on_each_notification<F, Fut>(
    changed: &tokio::sync::Notify,
    shutdown: &CancellationToken,
    mut run: F,
) where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    loop {
        tokio::select! {
            () = changed.notified() => {}
            () = shutdown.cancelled() => return,
        }
        run().await;
    }
}

/// Spawns a task the process cannot do its work without (a dispatcher's subscription manager,
/// its scaler). Should it end before `stop` is cancelled, because it returned or panicked,
/// that is logged as an error naming it and `stop` is cancelled: the process shuts down and
/// exits (and is started again by its supervisor) rather than go on serving without it.
/// The handle answers `Err(name)` for such an early end, `Ok(())` for an end after `stop`.
pub fn spawn_essential<F>(
    name: &'static str,
    stop: CancellationToken,
    task: F,
) -> tokio::task::JoinHandle<Result<(), &'static str>>
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    tokio::spawn(async move {
        let ended = tokio::spawn(task).await;
        if stop.is_cancelled() {
            return Ok(());
        }
        match ended {
            Err(error) if error.is_panic() => {
                tracing::error!(task = name, "panicked; stopping the process");
            }
            _ => tracing::error!(task = name, "ended before shutdown; stopping the process"),
        }
        stop.cancel();
        Err(name)
    })
}

/// Waits at most `limit` for the handles of [`spawn_essential`] tasks, after shutdown. Returns
/// the name of one that ended early (the cause of the shutdown), noted as it ends so that the
/// others' slow drain does not hide it, and whether every task ended within `limit`.
pub async fn essentials_ended(
    handles: impl IntoIterator<Item = tokio::task::JoinHandle<Result<(), &'static str>>>,
    limit: std::time::Duration,
) -> (Option<&'static str>, bool) {
    use futures::StreamExt as _;
    let mut ended_early = None;
    let mut handles: futures::stream::FuturesUnordered<_> = handles.into_iter().collect();
    let drained = tokio::time::timeout(limit, async {
        while let Some(joined) = handles.next().await {
            if let Ok(Err(task)) = joined {
                ended_early.get_or_insert(task);
            }
        }
    })
    .await
    .is_ok();
    (ended_early, drained)
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM; only SIGINT stops this process");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::time::Duration;

    use super::*;

    /// What an essential task's handle answered, within 5 s.
    async fn outcome(
        handle: tokio::task::JoinHandle<Result<(), &'static str>>,
    ) -> Result<(), &'static str> {
        tokio::time::timeout(Duration::from_secs(5), handle)
            .await
            .expect("ends")
            .expect("joined")
    }

    /// A task that ends early, by returning or by panicking, stops the process (its token) and
    /// is named; one that ends at shutdown is no error.
    #[tokio::test]
    async fn an_essential_task_that_ends_early_stops_the_process() {
        let stop = CancellationToken::new();
        let returned = spawn_essential("returner", stop.clone(), async {});
        let ended = outcome(returned).await;
        assert_eq!(ended, Err("returner"));
        assert!(stop.is_cancelled());

        let stop = CancellationToken::new();
        let panicked = spawn_essential("panicker", stop.clone(), async {
            panic!("a bug");
        });
        let ended = outcome(panicked).await;
        assert_eq!(ended, Err("panicker"));
        assert!(stop.is_cancelled());

        let stop = CancellationToken::new();
        let waiting = spawn_essential("waiter", stop.clone(), {
            let stop = stop.clone();
            async move { stop.cancelled().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "runs until shutdown");
        stop.cancel();
        let ended = outcome(waiting).await;
        assert_eq!(ended, Ok(()));
    }

    /// The task that ended early is named even when another does not end within the limit.
    #[tokio::test]
    async fn an_early_end_is_named_though_another_task_does_not_drain() {
        let stop = CancellationToken::new();
        let stuck = spawn_essential("stuck", stop.clone(), std::future::pending());
        let early = spawn_essential("early", stop.clone(), async {});
        let (ended_early, drained) =
            essentials_ended([stuck, early], Duration::from_millis(200)).await;
        assert_eq!(ended_early, Some("early"));
        assert!(!drained, "the stuck task did not end");

        let stop = CancellationToken::new();
        let waiting = spawn_essential("waiter", stop.clone(), {
            let stop = stop.clone();
            async move { stop.cancelled().await }
        });
        stop.cancel();
        let (ended_early, drained) = essentials_ended([waiting], Duration::from_secs(5)).await;
        assert_eq!((ended_early, drained), (None, true));
    }
}
