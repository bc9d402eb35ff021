//! Kubernetes watches that back off while their list keeps failing.
//!
//! kube's `default_backoff` resets after every item the watcher yields, and the watcher yields
//! `Event::Init` before each list it starts. A list that keeps failing (a CRD that is not
//! installed, a role the chart did not grant) was therefore tried again about once a second,
//! for as long as the process ran: on a cluster without Kyma's Istio CRD, the gateway's and the
//! controller's lists of it were four in five of eddy's requests to the API server. Here only a
//! completed list or a watch event resets the backoff.

use std::time::Duration;

use eddy_model::backoff::Backoff;
use futures::{Stream, StreamExt as _};
use kube::runtime::watcher;

/// Delays between failed lists or watches: kube's first delay, doubling to half a minute.
pub const WATCH_BACKOFF: Backoff =
    Backoff::exponential(Duration::from_millis(800), Duration::from_secs(30));

/// `events` (a [`watcher::watcher`] stream) with [`WATCH_BACKOFF`] after each error: the delay
/// grows with every error in a row, and `Event::Init` (the start of a list) does not reset it.
/// Every error is still handed on, before its delay, so the caller can log it.
pub fn backed_off<S, K>(events: S) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>>
where
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
{
    let events = Box::pin(events);
    futures::stream::unfold(
        (events, 0_u32, false),
        |(mut events, mut failures, wait)| async move {
            if wait {
                tokio::time::sleep(WATCH_BACKOFF.delay(failures)).await;
            }
            let item = events.next().await?;
            let wait = match &item {
                Err(_) => {
                    failures = failures.saturating_add(1);
                    true
                }
                Ok(watcher::Event::Init) => false,
                Ok(_) => {
                    failures = 0;
                    false
                }
            };
            Some((item, (events, failures, wait)))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    /// A list that fails three times, then succeeds: the retries wait 0.8, 1.6 and 3.2 s (the
    /// `Init` before each list resets nothing), and after the list nothing waits.
    #[tokio::test(start_paused = true)]
    async fn a_failing_list_backs_off_until_a_list_completes() {
        let script: Vec<Result<watcher::Event<()>, watcher::Error>> = vec![
            Ok(watcher::Event::Init),
            Err(watcher::Error::NoResourceVersion),
            Ok(watcher::Event::Init),
            Err(watcher::Error::NoResourceVersion),
            Ok(watcher::Event::Init),
            Err(watcher::Error::NoResourceVersion),
            Ok(watcher::Event::Init),
            Ok(watcher::Event::InitDone),
            Err(watcher::Error::NoResourceVersion),
            Ok(watcher::Event::Init),
        ];
        let started = Instant::now();
        let mut at = Vec::new();
        let mut events = std::pin::pin!(backed_off(futures::stream::iter(script)));
        while let Some(_item) = events.next().await {
            at.push(started.elapsed().as_millis());
        }
        assert_eq!(
            at,
            [0, 0, 800, 800, 2_400, 2_400, 5_600, 5_600, 5_600, 6_400]
        );
    }
}
