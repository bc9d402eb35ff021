//! The status of Kyma's APIRules, in both modes: whether an APIRule is honoured (valid, and
//! holding every host it names: the oldest APIRule naming a host keeps it), and where it is
//! exposed. The gateways decide calls by the same rules (`eddy_model::apirule::award_hosts`),
//! so what the status says is what they do.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

use eddy_model::apirule::{APIRule, HostClaim, NotHonoured, RuleKey, award_hosts};
use eddy_platform::flags::ApiRuleArgs;
use kube::ResourceExt as _;

/// An APIRule's hosts (short ones with the domain), or why it is not honoured: invalid,
/// sending calls across the namespace boundary, or naming an authorizer the gateway lacks.
fn hosts_of(rule: &APIRule, serving: &ApiRuleArgs) -> Result<Vec<String>, NotHonoured> {
    serving.honourable(rule)?;
    Ok(rule.spec.full_hosts(&serving.domain))
}

/// Whether `rule` is honoured among `all` (it may be among them, in an older version): its
/// full hosts, or why not. `held` says which held their hosts before (they keep them against
/// one created in the same second). Pure.
pub fn judge(
    rule: &APIRule,
    all: &[&APIRule],
    serving: &ApiRuleArgs,
    held: impl Fn(&RuleKey) -> bool,
) -> Result<Vec<String>, NotHonoured> {
    let key_of = |rule: &APIRule| -> RuleKey {
        (
            rule.namespace().unwrap_or_else(|| "default".to_owned()),
            rule.name_any(),
        )
    };
    let own = key_of(rule);
    let own_hosts = hosts_of(rule, serving)?;
    // Those that cannot be honoured claim no host.
    let others: Vec<_> = all
        .iter()
        .copied()
        .filter(|other| key_of(other) != own)
        .filter_map(|other| Some((key_of(other), other, hosts_of(other, serving).ok()?)))
        .collect();
    let claims = std::iter::once((&own, rule, &own_hosts))
        .chain(
            others
                .iter()
                .map(|(key, other, hosts)| (key, *other, hosts)),
        )
        .map(|(key, each, hosts)| HostClaim {
            key,
            created: each.metadata.creation_timestamp.as_ref(),
            held: held(key),
            hosts,
        })
        .collect();
    for (key, awarded) in award_hosts(claims) {
        if *key == own {
            awarded?;
        }
    }
    Ok(own_hosts)
}

/// The state and description an APIRule's status shows: `Error` when it is not honoured,
/// `Warning` when a Service it names is missing or a field is not read, else `Ready`
/// with where it is exposed. Pure.
pub fn state_of(
    judged: &Result<Vec<String>, NotHonoured>,
    missing: &[String],
    warnings: &[String],
    scheme_and_port: (&str, Option<u16>),
) -> (&'static str, String) {
    match judged {
        Err(problem) => ("Error", problem.to_string()),
        Ok(_) if !missing.is_empty() || !warnings.is_empty() => {
            let mut notes: Vec<String> = missing
                .iter()
                .map(|service| format!("service {service} not found"))
                .collect();
            notes.extend(warnings.iter().cloned());
            ("Warning", notes.join("; "))
        }
        Ok(hosts) => {
            let (scheme, port) = scheme_and_port;
            let urls: Vec<String> = hosts
                .iter()
                .map(|host| match port {
                    Some(port) => format!("{scheme}://{host}:{port}"),
                    None => format!("{scheme}://{host}"),
                })
                .collect();
            ("Ready", format!("exposed on {}", urls.join(", ")))
        }
    }
}

/// Every APIRule the local follower has seen, by key: shared with the API, which judges an
/// APIRule being applied among them without reading the store.
pub type KnownApiRules = Arc<parking_lot::Mutex<HashMap<RuleKey, APIRule>>>;

/// What the local follower knows: every APIRule, and which were honoured when last judged
/// (they keep their hosts, as at the gateway).
struct Follower {
    store: eddy_platform::store::Store,
    serving: ApiRuleArgs,
    scheme: String,
    port: Option<u16>,
    rules: KnownApiRules,
    honoured: parking_lot::Mutex<HashSet<RuleKey>>,
}

impl Follower {
    /// Judges `rule` among the others and writes its status when it changed.
    async fn settle(&self, rule: &APIRule) {
        use eddy_platform::store::StoredResource as _;
        let key = rule.key();
        let judged = {
            let rules = self.rules.lock();
            let all: Vec<&APIRule> = rules.values().collect();
            let mut honoured = self.honoured.lock();
            let judged = judge(rule, &all, &self.serving, |key| honoured.contains(key));
            if judged.is_ok() {
                honoured.insert(key.clone());
            } else {
                honoured.remove(&key);
            }
            judged
        };
        let mut missing = Vec::new();
        if judged.is_ok() {
            let own = rule.namespace().unwrap_or_else(|| "default".to_owned());
            for (namespace, name) in rule.spec.targets(&own) {
                let found = self
                    .store
                    .get::<eddy_model::resources::Function>(&namespace, &name)
                    .await;
                if matches!(found, Ok(None)) {
                    missing.push(format!("{namespace}/{name}"));
                }
            }
        }
        let (state, description) = state_of(
            &judged,
            &missing,
            &rule.spec.warnings(),
            (&self.scheme, self.port),
        );
        let (namespace, name) = &key;
        let previous = self
            .store
            .get_status::<APIRule>(namespace, name)
            .await
            .ok()
            .flatten();
        if previous.as_ref().is_some_and(|p| {
            p.state == state && p.description.as_deref() == Some(description.as_str())
        }) {
            return;
        }
        if state != "Ready" {
            tracing::warn!(%namespace, %name, state, %description, "APIRule not ready");
        }
        let status = eddy_model::apirule::ApiRuleStatus {
            state: state.to_owned(),
            description: Some(description),
            last_processed_time: Some(crate::status::now()),
        };
        if let Err(error) = self
            .store
            .put_status::<APIRule>(namespace, name, &status)
            .await
        {
            tracing::warn!(%error, %namespace, %name, "cannot write APIRule status");
        }
    }

    /// Judges every APIRule again (a Function may have come, a host may have been freed).
    async fn settle_all(&self) {
        let all: Vec<APIRule> = self.rules.lock().values().cloned().collect();
        for rule in &all {
            self.settle(rule).await;
        }
    }
}

/// Follows the APIRules of the local store and writes their status, until `shutdown`. A
/// Service is a Function of that name. Every APIRule is judged again when something it depends
/// on changes: an APIRule applied or deleted (hosts are taken and freed), or a Function an
/// APIRule names applied or deleted. Changes that come together are judged together.
pub async fn follow_local(
    store: eddy_platform::store::Store,
    serving: ApiRuleArgs,
    gateway_url: String,
    known: KnownApiRules,
    shutdown: eddy_platform::shutdown::CancellationToken,
) {
    use eddy_platform::store::{Change, StoredResource as _};
    let url = url::Url::parse(&gateway_url).ok();
    let follower = Arc::new(Follower {
        store: store.clone(),
        serving,
        scheme: url.as_ref().map_or("http", url::Url::scheme).to_owned(),
        port: url.as_ref().and_then(url::Url::port),
        rules: known,
        honoured: parking_lot::Mutex::default(),
    });
    // One permit at most: a burst of changes wakes the judge once.
    let changed = Arc::new(tokio::sync::Notify::new());
    let judge = eddy_platform::shutdown::on_each_notification(&changed, &shutdown, || {
        follower.settle_all()
    });
    let rules = store.follow::<APIRule, _, _>(&shutdown, |change| {
        let (store, follower, changed) = (store.clone(), follower.clone(), changed.clone());
        async move {
            match change {
                Change::Applied(rule) => {
                    follower.rules.lock().insert(rule.key(), rule.clone());
                    // This one at once (`eddy apply` reads its status next); the others with it.
                    follower.settle(&rule).await;
                }
                Change::Deleted { namespace, name } => {
                    let key = (namespace, name);
                    follower.rules.lock().remove(&key);
                    follower.honoured.lock().remove(&key);
                    let (namespace, name) = &key;
                    if let Err(error) = store.delete_status::<APIRule>(namespace, name).await {
                        tracing::warn!(%error, %namespace, %name, "cannot remove APIRule status");
                    }
                }
                Change::Synced => {}
            }
            changed.notify_one();
        }
    });
    // Kyma's Istio resource brings authorizers: APIRules naming them are judged again.
    let istios = store.follow::<eddy_model::istio::Istio, _, _>(&shutdown, |change| {
        let (store, follower, changed) = (store.clone(), follower.clone(), changed.clone());
        async move {
            if let Change::Deleted { namespace, name } = &change
                && let Err(error) = store
                    .delete_status::<eddy_model::istio::Istio>(namespace, name)
                    .await
            {
                tracing::warn!(%error, %namespace, %name, "cannot remove Istio status");
            }
            // Judged again even when the authorizers in force did not change here: the API
            // may have put them in force already, answering the apply.
            crate::istio::settle(&store, &follower.serving).await;
            changed.notify_one();
        }
    });
    let functions = store.follow::<eddy_model::resources::Function, _, _>(&shutdown, |change| {
        let (follower, changed) = (follower.clone(), changed.clone());
        if let Some((namespace, name)) = change.key() {
            let named = follower.rules.lock().iter().any(|((own, _), rule)| {
                rule.spec
                    .targets(own)
                    .iter()
                    .any(|(n, s)| *n == namespace && *s == name)
            });
            if named {
                changed.notify_one();
            }
        }
        std::future::ready(())
    });
    tokio::join!(rules, istios, functions, judge);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn api_rule(name: &str, created: &str, spec: Value) -> APIRule {
        serde_json::from_value(json!({
            "apiVersion": "gateway.kyma-project.io/v2",
            "kind": "APIRule",
            "metadata": {"name": name, "namespace": "default", "creationTimestamp": created},
            "spec": spec,
        }))
        .unwrap()
    }

    fn serving(domain: &str) -> ApiRuleArgs {
        ApiRuleArgs {
            domain: domain.to_owned(),
            ..eddy_platform::flags::defaults()
        }
    }

    fn exposing(host: &str) -> Value {
        json!({
            "hosts": [host],
            "service": {"name": "hello", "port": 80},
            "gateway": "kyma-system/kyma-gateway",
            "rules": [{"path": "/*", "methods": ["GET"], "noAuth": true}],
        })
    }

    #[test]
    fn the_oldest_apirule_naming_a_host_is_ready_and_a_newer_one_is_an_error() {
        let older = api_rule("older", "2026-01-01T00:00:00Z", exposing("hello"));
        let newer = api_rule("newer", "2026-01-02T00:00:00Z", exposing("hello"));
        let all = [&older, &newer];
        let judged = judge(&older, &all, &serving("example.com"), |_| false);
        assert_eq!(judged, Ok(vec!["hello.example.com".to_owned()]));
        assert_eq!(
            state_of(&judged, &[], &[], ("https", None)),
            ("Ready", "exposed on https://hello.example.com".to_owned())
        );
        let refused = judge(&newer, &all, &serving("example.com"), |_| false);
        assert_eq!(
            state_of(&refused, &[], &[], ("https", None)),
            (
                "Error",
                "host hello.example.com is already exposed by APIRule default/older".to_owned()
            )
        );
        // Once the holder is gone, the host is the next one's.
        assert!(judge(&newer, &[&newer], &serving("example.com"), |_| false).is_ok());
    }

    #[test]
    fn in_the_same_second_the_apirule_holding_a_host_keeps_it() {
        let holder = api_rule("hello", "2026-01-01T00:00:00Z", exposing("hello"));
        let copycat = api_rule("copycat", "2026-01-01T00:00:00Z", exposing("hello"));
        let all = [&holder, &copycat];
        let held = |key: &RuleKey| key.1 == "hello";
        assert!(judge(&holder, &all, &serving("localhost"), held).is_ok());
        assert_eq!(
            judge(&copycat, &all, &serving("localhost"), held).map_err(|e| e.to_string()),
            Err("host hello.localhost is already exposed by APIRule default/hello".to_owned())
        );
        // Nobody held it: the name decides.
        assert!(judge(&copycat, &all, &serving("localhost"), |_| false).is_ok());
    }

    #[test]
    fn a_missing_service_is_a_warning() {
        let rule = api_rule("one", "2026-01-01T00:00:00Z", exposing("hello"));
        let judged = judge(&rule, &[&rule], &serving("localhost"), |_| false);
        assert_eq!(
            rule.spec.targets("default"),
            vec![("default".to_owned(), "hello".to_owned())]
        );
        assert_eq!(
            state_of(
                &judged,
                &["default/hello".to_owned()],
                &[],
                ("http", Some(8080))
            ),
            ("Warning", "service default/hello not found".to_owned())
        );
    }

    #[test]
    fn an_apirule_reaches_another_namespace_only_when_it_is_opened() {
        let mut spec = exposing("vault");
        spec["service"]["namespace"] = json!("victim");
        let crossing = api_rule("steal", "2026-01-01T00:00:00Z", spec);
        let refused = judge(&crossing, &[&crossing], &serving("localhost"), |_| false);
        let (state, description) = state_of(&refused, &[], &[], ("http", None));
        assert_eq!(state, "Error");
        assert!(
            description.starts_with("spec.service.namespace: an APIRule in namespace default cannot send calls to namespace victim"),
            "{description}"
        );
        let mut opened = serving("localhost");
        opened.open_namespaces = vec!["victim".to_owned()];
        assert!(judge(&crossing, &[&crossing], &opened, |_| false).is_ok());
        opened.open_namespaces = vec!["*".to_owned()];
        assert!(judge(&crossing, &[&crossing], &opened, |_| false).is_ok());
    }
}
