//! Flag defaults, written once: in each flag's `default_value` attribute. `Args::new` and the
//! `Default` impls of the flag groups take them from there through [`defaults`], so clap and the
//! code that builds arguments by hand (`eddy up`, tests, benches) can never disagree.

use std::sync::Arc;

use clap::{Args, Command, FromArgMatches};
use eddy_model::apirule::{
    APIRule, NotHonoured, check_gateway_hosts, check_namespace_boundary, validate_api_rule,
};
use eddy_model::ext_authz::ExtensionProviders;
use eddy_model::resources::FieldError;

/// Where Subscriptions may deliver besides Function Services: one flag for every component
/// that checks sinks (the controller, the dispatcher, `eddy up`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SinkArgs {
    /// Sink URLs Subscriptions may use besides function Services (comma-separated), compared as
    /// URLs: `http://host:port/path`, `http://host:*` (any port), `https://` (any host), `*`.
    /// Everything else is refused, so Subscriptions cannot be used to reach arbitrary hosts.
    #[arg(
        long = "allowed-sinks",
        env = "EDDY_ALLOWED_SINKS",
        value_delimiter = ',',
        value_parser = eddy_model::resources::parse_allowed_sink
    )]
    pub allowed_sinks: Vec<eddy_model::resources::AllowedSink>,
}

impl SinkArgs {
    /// The sink policy these entries make.
    pub fn policy(&self) -> eddy_model::resources::SinkPolicy {
        eddy_model::resources::SinkPolicy {
            allowed: self.allowed_sinks.clone(),
        }
    }
}

/// The token the gateway accepts for every Function, which the dispatcher sends: one flag for
/// the controller's gateway, the dispatcher and `eddy up`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct PlatformTokenArgs {
    /// A token the gateway accepts for every function, whatever its `access`, and the
    /// dispatcher sends with deliveries to the functions it resolves: give both the same
    /// (`eddy up` makes a new one for each run when none is given).
    #[arg(
        long = "platform-token",
        env = "EDDY_PLATFORM_TOKEN",
        hide_env_values = true
    )]
    pub platform_token: Option<String>,
}

/// What calls waiting for their Function to start (scale from zero) may hold in the gateway:
/// past any bound a call is answered 503 with `Retry-After` at once.
#[derive(Debug, Clone, clap::Args)]
pub struct HoldArgs {
    /// Most calls held at once, over every Function, while their Functions start.
    #[arg(
        long = "max-held-calls",
        env = "EDDY_MAX_HELD_CALLS",
        default_value_t = 1000
    )]
    pub max_held_calls: usize,
    /// Most request-body bytes those calls hold at once, over every Function (each held call
    /// keeps its whole body in memory until its Function takes it).
    #[arg(
        long = "max-held-bytes",
        env = "EDDY_MAX_HELD_BYTES",
        default_value = "64MiB"
    )]
    pub max_held_bytes: bytesize::ByteSize,
    /// The part of either bound, in percent, that one Function's held calls may take, so
    /// that a burst to one Function leaves room for the others' wake-ups.
    #[arg(
        long = "held-share-per-function",
        env = "EDDY_HELD_SHARE_PER_FUNCTION",
        default_value_t = 25,
        value_parser = clap::value_parser!(u8).range(1..=100)
    )]
    pub held_share_percent: u8,
}

/// How Kyma's APIRules are served, for the controller (their status says whether they are
/// honoured, and the URL) and the gateways (they route by them) alike.
#[derive(Debug, Clone, clap::Args)]
pub struct ApiRuleArgs {
    /// The domain an APIRule's one-label host is prefixed to: `orders` is served as
    /// `orders.<domain>` (`orders.localhost` resolves to this machine).
    #[arg(long = "domain", env = "EDDY_DOMAIN", default_value = "localhost")]
    pub domain: String,
    /// The names the gateway's own `/<namespace>/<function>` routes are reached by (its
    /// Service's DNS names, the hosts it is exposed on): no APIRule may take one, nor a
    /// wildcard over one, nor the domain itself. Addresses (`127.0.0.1`) are never APIRule
    /// hosts, whatever this says.
    #[arg(
        long = "gateway-hosts",
        env = "EDDY_GATEWAY_HOSTS",
        value_delimiter = ',',
        default_value = "localhost"
    )]
    pub gateway_hosts: Vec<String>,
    /// Namespaces whose Services APIRules of other namespaces may send calls to (`*`: every
    /// namespace). By default an APIRule reaches only its own namespace.
    #[arg(
        long = "apirule-open-namespaces",
        env = "EDDY_APIRULE_OPEN_NAMESPACES",
        value_delimiter = ','
    )]
    pub open_namespaces: Vec<String>,
    /// A YAML file of Istio's `extensionProviders` (the list, or a mapping holding it): the
    /// HTTP external authorizers (`envoyExtAuthzHttp`) APIRules' `extAuth` rules may name.
    #[arg(
        long = "extension-providers",
        env = "EDDY_EXTENSION_PROVIDERS",
        value_name = "FILE",
        value_parser = read_extension_providers
    )]
    pub extension_providers: Option<ExtensionProviders>,
    /// Checks one external authorizer may have in flight (Envoy's circuit breaker for it):
    /// past it a call is answered as when the authorizer cannot be asked, at once, so a slow
    /// authorizer holds no more of the gateway's connections than this.
    #[arg(
        long = "max-authorizer-checks",
        env = "EDDY_MAX_AUTHORIZER_CHECKS",
        default_value_t = 1024
    )]
    pub max_authorizer_checks: usize,
    /// The authorizers Kyma's `Istio` resource declares, beside the file's. Every copy of these
    /// settings shares them, so whoever reads that resource (the local store's follower, the
    /// cluster's) gives them to the API, the statuses and the gateway at once.
    #[arg(skip)]
    pub istio_authorizers: IstioAuthorizers,
}

/// The extension providers of Kyma's `Istio` resource, shared and watched: see
/// [`ApiRuleArgs::istio_authorizers`].
#[derive(Debug, Clone)]
pub struct IstioAuthorizers(Arc<tokio::sync::watch::Sender<Arc<ExtensionProviders>>>);

impl Default for IstioAuthorizers {
    fn default() -> Self {
        Self(Arc::new(tokio::sync::watch::Sender::new(Arc::default())))
    }
}

impl IstioAuthorizers {
    /// The ones in force.
    pub fn current(&self) -> Arc<ExtensionProviders> {
        self.0.borrow().clone()
    }

    /// Puts `providers` in force; `true` when they differ from the ones before (watchers of
    /// [`Self::changes`] are woken then only).
    pub fn set(&self, providers: ExtensionProviders) -> bool {
        self.0.send_if_modified(|current| {
            let changed = **current != providers;
            if changed {
                *current = Arc::new(providers);
            }
            changed
        })
    }

    /// Wakes on every change from now on.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<Arc<ExtensionProviders>> {
        self.0.subscribe()
    }
}

fn read_extension_providers(
    path: &str,
) -> Result<ExtensionProviders, eddy_model::ext_authz::ProvidersError> {
    ExtensionProviders::read(std::path::Path::new(path))
}

impl ApiRuleArgs {
    /// The extension providers of the file (none when no file was given).
    pub fn own_providers(&self) -> &ExtensionProviders {
        static NONE: std::sync::OnceLock<ExtensionProviders> = std::sync::OnceLock::new();
        self.extension_providers
            .as_ref()
            .unwrap_or_else(|| NONE.get_or_init(ExtensionProviders::default))
    }

    /// The external authorizers APIRules may name: the file's, then those of Kyma's `Istio`
    /// resource (a name in both is the file's).
    pub fn providers(&self) -> ExtensionProviders {
        self.own_providers()
            .merged(&self.istio_authorizers.current())
    }

    /// What refuses an APIRule outright, each naming its field: its own validity, the hosts
    /// that are the gateway's, and the namespace boundary. Pure.
    pub fn refusals(&self, rule: &APIRule) -> Vec<FieldError> {
        let mut errors = validate_api_rule(rule);
        errors.extend(check_gateway_hosts(rule, &self.domain, &self.gateway_hosts));
        errors.extend(check_namespace_boundary(rule, &self.open_namespaces));
        errors
    }

    /// Everything that keeps an APIRule from being honoured now, each naming its field: the
    /// [`Self::refusals`], and authorizers the gateway does not have (yet: an `Istio` resource
    /// may bring them).
    pub fn problems(&self, rule: &APIRule) -> Vec<FieldError> {
        let mut errors = self.refusals(rule);
        errors.extend(self.providers().check(rule));
        errors
    }

    /// Whether an APIRule can be honoured now, leaving aside the hosts older APIRules hold:
    /// no [`Self::problems`], and no rule an earlier one hides (as on Kyma). Pure.
    pub fn honourable(&self, rule: &APIRule) -> Result<(), NotHonoured> {
        let errors = self.problems(rule);
        if !errors.is_empty() {
            return Err(NotHonoured::Invalid(errors));
        }
        let hidden = rule.spec.hidden_rules();
        if !hidden.is_empty() {
            return Err(NotHonoured::HiddenRules(hidden));
        }
        Ok(())
    }
}

/// What clap gives `T` for an empty command line, the environment ignored.
///
/// Every flag of the groups this is used for has a default, an `Option` or a `Vec`: a group
/// where an empty command line does not parse is a programming error, caught by each crate's
/// `defaults_match_an_empty_command_line` test, not something input can cause.
pub fn defaults<T: Args + FromArgMatches>() -> T {
    let command = T::augment_args(Command::new("defaults"))
        .no_binary_name(true)
        .mut_args(|arg| arg.env(None::<&str>));
    let parsed = command
        .try_get_matches_from(std::iter::empty::<&str>())
        .and_then(|matches| T::from_arg_matches(&matches));
    match parsed {
        Ok(value) => value,
        #[allow(clippy::panic)] // A flag declared without a default; see above.
        Err(error) => panic!("flag defaults of {}: {error}", std::any::type_name::<T>()),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[derive(Debug, clap::Args)]
    struct Sample {
        #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
        wait: Duration,
        #[arg(long, default_value_t = 7)]
        count: u32,
        #[arg(long)]
        name: Option<String>,
        /// PATH is set wherever tests run: the default must win over it.
        #[arg(long, env = "PATH", default_value = "from the attribute")]
        path: String,
    }

    #[test]
    fn defaults_come_from_the_attributes_not_the_environment() {
        assert!(std::env::var_os("PATH").is_some());
        let sample: Sample = defaults();
        assert_eq!(sample.wait, Duration::from_secs(3));
        assert_eq!(sample.count, 7);
        assert_eq!(sample.name, None);
        assert_eq!(sample.path, "from the attribute");
    }
}
