//! The status of Kyma's RateLimits, in both modes: `Error` when invalid, `Warning` when they
//! select no Function's pods or an older RateLimit holds one they select, else `Ready`
//! (`eddy_model::ratelimit::status_of`). The gateways hold Functions by the same rule
//! (`eddy_model::ratelimit::holder`), so what the status says is what they do.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use eddy_model::{
    ratelimit::{RateLimit, RateLimitKey, RateLimitStatus, function_pod_labels, key_of, status_of},
    resources::Function,
};
use eddy_platform::store::{Change, Store, StoredResource as _};
use kube::ResourceExt as _;

/// What the local follower knows: every RateLimit and every Function's pod labels.
#[derive(Default)]
struct Known {
    rate_limits: HashMap<RateLimitKey, RateLimit>,
    functions: HashMap<(String, String), BTreeMap<String, String>>,
}

impl Known {
    /// The status `rate_limit` (one of those known) should show now.
    fn status_of(&self, rate_limit: &RateLimit, all: &[&RateLimit]) -> RateLimitStatus {
        let functions = self
            .functions
            .iter()
            .map(|((namespace, name), labels)| (namespace.as_str(), name.as_str(), labels));
        status_of(rate_limit, all, functions)
    }

    /// Every RateLimit's status as it should read now.
    fn statuses(&self) -> Vec<(RateLimitKey, RateLimitStatus)> {
        let all: Vec<&RateLimit> = self.rate_limits.values().collect();
        all.iter()
            .map(|rate_limit| (key_of(rate_limit), self.status_of(rate_limit, &all)))
            .collect()
    }

    /// One RateLimit's status as it should read now, if it is known.
    fn status(&self, key: &RateLimitKey) -> Option<RateLimitStatus> {
        let all: Vec<&RateLimit> = self.rate_limits.values().collect();
        Some(self.status_of(self.rate_limits.get(key)?, &all))
    }
}

/// Writes `status` unless the store holds it already.
async fn write(store: &Store, (namespace, name): &RateLimitKey, status: &RateLimitStatus) {
    let previous = store
        .get_status::<RateLimit>(namespace, name)
        .await
        .ok()
        .flatten();
    if previous.as_ref() == Some(status) {
        return;
    }
    if status.state != "Ready" {
        tracing::warn!(%namespace, %name, state = %status.state, description = ?status.description, "RateLimit not ready");
    }
    if let Err(error) = store.put_status::<RateLimit>(namespace, name, status).await {
        tracing::warn!(%error, %namespace, %name, "cannot write RateLimit status");
    }
}

/// Follows the RateLimits and Functions of the local store and writes the RateLimits' status,
/// until `shutdown`. A change to either judges every RateLimit again; changes that come
/// together are judged together.
pub async fn follow_local(store: Store, shutdown: eddy_platform::shutdown::CancellationToken) {
    let known = Arc::new(parking_lot::Mutex::new(Known::default()));
    let changed = Arc::new(tokio::sync::Notify::new());
    let judge = eddy_platform::shutdown::on_each_notification(&changed, &shutdown, || async {
        let statuses = known.lock().statuses();
        for (key, status) in &statuses {
            write(&store, key, status).await;
        }
    });
    let rate_limits = store.follow::<RateLimit, _, _>(&shutdown, |change| {
        let (store, known, changed) = (store.clone(), known.clone(), changed.clone());
        async move {
            match change {
                Change::Applied(rate_limit) => {
                    let key = key_of(&rate_limit);
                    known.lock().rate_limits.insert(key.clone(), rate_limit);
                    // This one at once (`eddy apply` reads its status next); the others with it.
                    let status = known.lock().status(&key);
                    if let Some(status) = status {
                        write(&store, &key, &status).await;
                    }
                }
                Change::Deleted { namespace, name } => {
                    known
                        .lock()
                        .rate_limits
                        .remove(&(namespace.clone(), name.clone()));
                    if let Err(error) = store.delete_status::<RateLimit>(&namespace, &name).await {
                        tracing::warn!(%error, %namespace, %name, "cannot remove RateLimit status");
                    }
                }
                Change::Synced => {}
            }
            changed.notify_one();
        }
    });
    let functions = store.follow::<Function, _, _>(&shutdown, |change| {
        let (known, changed) = (known.clone(), changed.clone());
        match change {
            Change::Applied(function) => {
                let key = function.key();
                let labels = function_pod_labels(&function, &function.uid().unwrap_or_default());
                let mut known = known.lock();
                let before = known.functions.insert(key, labels.clone());
                if before.as_ref() != Some(&labels) && !known.rate_limits.is_empty() {
                    changed.notify_one();
                }
            }
            Change::Deleted { namespace, name } => {
                let mut known = known.lock();
                if known.functions.remove(&(namespace, name)).is_some()
                    && !known.rate_limits.is_empty()
                {
                    changed.notify_one();
                }
            }
            Change::Synced => {}
        }
        std::future::ready(())
    });
    tokio::join!(rate_limits, functions, judge);
}
