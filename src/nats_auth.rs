//! NATS users for the nats-server `eddy up` starts.
//!
//! Without them any process on the machine could connect to NATS and read the KV bucket (the
//! functions' env) or rewrite it (a function's `access`, its `status.url`, so events and the
//! platform token go to any listener), bypassing every token. Each component gets a user and
//! password of its own with the least it needs: the event-bus publishes events, the dispatcher
//! consumes them and writes dead letters, the controller owns the KV bucket. An `eddy-admin`
//! user can do anything (operators, benchmarks). Passwords are generated once per data dir and
//! kept in `<data-dir>/secrets/nats-users.json` (0600); each client replies on its own inbox
//! prefix, so no user reads another's answers.

use std::{
    collections::BTreeMap,
    io::Write as _,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use eddy_platform::nats::{DEAD_LETTER_STREAM, EVENTS_STREAM, NatsArgs, RESOURCES_BUCKET};

/// The components with a NATS user of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Component {
    /// Publishes events.
    EventBus,
    /// Consumes events, writes dead letters, reads resources.
    Dispatcher,
    /// Owns the resource bucket, reads events (dashboard, subscription status).
    Controller,
    /// Everything (operators, `eddy bench`).
    Admin,
}

impl Component {
    const ALL: [Self; 4] = [
        Self::EventBus,
        Self::Dispatcher,
        Self::Controller,
        Self::Admin,
    ];

    /// The NATS user name.
    pub fn user(self) -> &'static str {
        match self {
            Self::EventBus => "eddy-event-bus",
            Self::Dispatcher => "eddy-dispatcher",
            Self::Controller => "eddy-controller",
            Self::Admin => "eddy-admin",
        }
    }

    /// Its reply subjects' prefix.
    pub fn inbox_prefix(self) -> String {
        format!("_INBOX_{}", self.user())
    }

    /// Subjects it may publish to (JetStream API calls are publishes too).
    pub fn publish_allowed(self) -> Vec<String> {
        let kv = format!("KV_{RESOURCES_BUCKET}");
        let mut allowed = vec!["$JS.API.INFO".to_owned()];
        let stream_api = |ops: &[&str], stream: &str| -> Vec<String> {
            ops.iter()
                .map(|op| format!("$JS.API.STREAM.{op}.{stream}"))
                .collect()
        };
        match self {
            Self::EventBus => {
                allowed.push(format!("{}.>", eddy_model::subject::EVENTS_SUBJECT_PREFIX));
                allowed.extend(stream_api(&["INFO", "CREATE", "UPDATE"], EVENTS_STREAM));
                // `GET /{application}/v1/events/subscribed` reads the Subscriptions' filters
                // from the consumers' configs: listing them, never changing one.
                allowed.push(format!("$JS.API.CONSUMER.LIST.{EVENTS_STREAM}"));
            }
            Self::Dispatcher => {
                // Dead letters, and the reply events of functions.
                allowed.push("eddy.dlq.>".to_owned());
                allowed.push("eddy.events.>".to_owned());
                allowed.extend(stream_api(&["INFO"], EVENTS_STREAM));
                allowed.extend(stream_api(
                    &["INFO", "CREATE", "UPDATE", "MSG.GET", "MSG.DELETE"],
                    DEAD_LETTER_STREAM,
                ));
                allowed.extend(stream_api(&["INFO", "MSG.GET"], &kv));
                allowed.push(format!("$JS.API.DIRECT.GET.{kv}.>"));
                allowed.extend(consuming());
            }
            Self::Controller => {
                allowed.push(format!("$KV.{RESOURCES_BUCKET}.>"));
                // Reading one event: the dashboard's event detail.
                allowed.extend(stream_api(&["INFO", "MSG.GET"], EVENTS_STREAM));
                allowed.extend(stream_api(&["INFO"], DEAD_LETTER_STREAM));
                allowed.extend(stream_api(&["INFO", "CREATE", "UPDATE", "MSG.GET"], &kv));
                allowed.push(format!("$JS.API.DIRECT.GET.{kv}.>"));
                allowed.extend(consuming());
            }
            Self::Admin => return vec![">".to_owned()],
        }
        allowed
    }

    /// Subjects it may subscribe to: its own replies (the admin: anything).
    pub fn subscribe_allowed(self) -> Vec<String> {
        match self {
            Self::Admin => vec![">".to_owned()],
            _ => vec![format!("{}.>", self.inbox_prefix())],
        }
    }
}

/// The users the Helm chart gives its own NATS, with the same permissions as `eddy up`'s: the
/// event-bus, the dispatcher and an admin for operators (the chart's controller does not use
/// NATS). `charts/eddy/files/nats-users.json` is this, written out; a test keeps the two equal.
pub fn chart_users() -> serde_json::Value {
    let users: Vec<serde_json::Value> = [
        (Component::EventBus, "event-bus"),
        (Component::Dispatcher, "dispatcher"),
        (Component::Admin, "admin"),
    ]
    .into_iter()
    .map(|(component, key)| {
        serde_json::json!({
            "user": component.user(),
            "secretKey": key,
            "inboxPrefix": component.inbox_prefix(),
            "publish": component.publish_allowed(),
            "subscribe": component.subscribe_allowed(),
        })
    })
    .collect();
    serde_json::json!({ "users": users })
}

/// Consumer management, pulling, acks and flow control.
fn consuming() -> Vec<String> {
    ["$JS.API.CONSUMER.>", "$JS.ACK.>", "$JS.FC.>"]
        .map(str::to_owned)
        .to_vec()
}

/// The generated users of one data dir.
#[derive(Debug, Clone)]
pub struct NatsUsers {
    passwords: BTreeMap<String, String>,
}

impl NatsUsers {
    /// Reads `<data-dir>/secrets/nats-users.json`, or creates it (0600, in a 0700 directory) with a
    /// fresh random password per user.
    pub fn load_or_create(data_dir: &Path) -> anyhow::Result<Self> {
        let path = secrets_path(data_dir);
        let mut passwords: BTreeMap<String, String> = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .with_context(|| format!("{} is not a JSON object of passwords", path.display()))?,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(error) => return Err(error).context(format!("cannot read {}", path.display())),
        };
        let mut added = false;
        for component in Component::ALL {
            passwords
                .entry(component.user().to_owned())
                .or_insert_with(|| {
                    added = true;
                    format!(
                        "{}{}",
                        uuid::Uuid::new_v4().simple(),
                        uuid::Uuid::new_v4().simple()
                    )
                });
        }
        if added {
            write_private(&path, &serde_json::to_vec_pretty(&passwords)?)?;
        }
        Ok(Self { passwords })
    }

    fn password(&self, component: Component) -> String {
        self.passwords
            .get(component.user())
            .cloned()
            .unwrap_or_default()
    }

    /// The nats-server `authorization` block for these users.
    pub fn server_config(&self) -> String {
        let list = |subjects: Vec<String>| {
            serde_json::to_string(&subjects).unwrap_or_else(|_| "[]".to_owned())
        };
        let mut config = String::from("authorization {\n  users: [\n");
        for component in Component::ALL {
            config.push_str(&format!(
                "    {{user: {}, password: {}, permissions: {{publish: {{allow: {}}}, subscribe: {{allow: {}}}}}}}\n",
                serde_json::Value::from(component.user()),
                serde_json::Value::from(self.password(component)),
                list(component.publish_allowed()),
                list(component.subscribe_allowed()),
            ));
        }
        config.push_str("  ]\n}\n");
        config
    }

    /// `url` with `component`'s user, password and inbox prefix.
    pub fn args(&self, component: Component, url: &str) -> NatsArgs {
        let mut args = NatsArgs::with_url(url);
        args.nats_user = Some(component.user().to_owned());
        args.nats_password = Some(self.password(component));
        args.inbox_prefix = Some(component.inbox_prefix());
        args
    }

    /// A client connected as `eddy-admin`.
    pub async fn connect_admin(&self, url: &str) -> anyhow::Result<async_nats::Client> {
        let client = async_nats::ConnectOptions::with_user_and_password(
            Component::Admin.user().to_owned(),
            self.password(Component::Admin),
        )
        .custom_inbox_prefix(Component::Admin.inbox_prefix())
        .connect(url)
        .await
        .with_context(|| format!("cannot connect to NATS at {url}"))?;
        Ok(client)
    }
}

fn secrets_path(data_dir: &Path) -> PathBuf {
    data_dir.join("secrets").join("nats-users.json")
}

/// Writes `bytes` to `path` readable by this user only, its directory 0700.
pub fn write_private(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    // An older file keeps its mode on open: tighten it too.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    file.write_all(bytes)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_are_generated_once_per_data_dir_and_kept_private() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let first = NatsUsers::load_or_create(dir.path()).unwrap();
        let again = NatsUsers::load_or_create(dir.path()).unwrap();
        assert_eq!(first.passwords, again.passwords);
        assert_eq!(first.passwords.len(), 4);
        let mode = std::fs::metadata(secrets_path(dir.path()))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let other = NatsUsers::load_or_create(tempfile::tempdir().unwrap().path()).unwrap();
        assert_ne!(first.passwords, other.passwords);
    }

    /// The chart renders its NATS users from `charts/eddy/files/nats-users.json`; it must say
    /// what `eddy up` grants. `EDDY_WRITE_CHART_FILES=1` writes it anew after a change here.
    #[test]
    fn the_charts_nats_users_are_eddy_up_s() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/eddy/files/nats-users.json");
        let expected = format!(
            "{}\n",
            serde_json::to_string_pretty(&chart_users()).unwrap()
        );
        if std::env::var_os("EDDY_WRITE_CHART_FILES").is_some() {
            std::fs::write(&path, &expected).unwrap();
        }
        let written = std::fs::read_to_string(&path).unwrap_or_default();
        assert_eq!(
            written,
            expected,
            "{} differs from nats_auth::chart_users(): run this test with EDDY_WRITE_CHART_FILES=1",
            path.display()
        );
    }

    #[test]
    fn only_the_controller_writes_resources_and_only_the_event_bus_manages_the_events_stream() {
        let kv_write = format!("$KV.{RESOURCES_BUCKET}.>");
        for component in [Component::EventBus, Component::Dispatcher] {
            let allowed = component.publish_allowed();
            assert!(!allowed.contains(&kv_write), "{component:?}");
            assert!(
                !allowed.iter().any(|s| s.starts_with("$KV")),
                "{component:?}"
            );
            assert!(!allowed.iter().any(|s| s == ">"), "{component:?}");
        }
        assert!(Component::Controller.publish_allowed().contains(&kv_write));
        // The controller publishes no events; the dispatcher stores replies but cannot change,
        // purge or delete the events stream.
        assert!(
            !Component::Controller
                .publish_allowed()
                .iter()
                .any(|s| s.starts_with("eddy.events"))
        );
        let dispatcher = Component::Dispatcher.publish_allowed();
        assert!(dispatcher.iter().any(|s| s == "eddy.events.>"));
        for operation in ["CREATE", "UPDATE", "DELETE", "PURGE"] {
            let subject = format!("$JS.API.STREAM.{operation}.{EVENTS_STREAM}");
            assert!(!dispatcher.contains(&subject), "{subject}");
        }
        // The event-bus lists the consumers (the subscribed events), and changes none.
        let event_bus = Component::EventBus.publish_allowed();
        assert!(!event_bus.iter().any(|s| s.contains("KV_")));
        let consumers: Vec<&String> = event_bus
            .iter()
            .filter(|s| s.contains("CONSUMER"))
            .collect();
        assert_eq!(
            consumers,
            [&format!("$JS.API.CONSUMER.LIST.{EVENTS_STREAM}")]
        );
    }
}
