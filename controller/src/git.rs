//! Git sources, for both backends: locally a build fetches them; on Kubernetes the controller
//! resolves the reference (the build pod fetches).
//! How: a reference resolved to a commit with `git ls-remote`, the
//! commit fetched once into a cache keyed by repository and commit, credentials handed to `git`
//! through its environment (never on a command line, never in a file others can read).

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use eddy_model::{conditions::Reason, resources::RepositoryAuthType};
use eddy_platform::process;
use sha2::{Digest as _, Sha256};

use crate::status::{BuildFailure, tail};

/// Credentials for one repository, read from the Secret `auth.secretName` names.
#[derive(Clone, PartialEq, Eq)]
pub enum GitCredentials {
    /// HTTP basic: user name and password (or token).
    Basic {
        /// `username` key.
        username: String,
        /// `password` key.
        password: String,
    },
    /// An SSH private key and, for an encrypted key, its passphrase.
    Key {
        /// `key` key.
        key: String,
        /// `password` key, when present.
        passphrase: Option<String>,
    },
}

impl std::fmt::Debug for GitCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the values.
        match self {
            Self::Basic { .. } => f.write_str("GitCredentials::Basic"),
            Self::Key { .. } => f.write_str("GitCredentials::Key"),
        }
    }
}

/// A Git credentials Secret without a key its auth type needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no key {0}")]
pub struct MissingCredentialKey(pub &'static str);

impl GitCredentials {
    /// The credentials of `kind` from a Secret's data, or the key that is missing.
    pub fn from_secret(
        kind: RepositoryAuthType,
        data: &std::collections::BTreeMap<String, Vec<u8>>,
    ) -> Result<Self, MissingCredentialKey> {
        let text = |key: &'static str| {
            data.get(key)
                .map(|bytes| String::from_utf8_lossy(bytes).into_owned())
                .ok_or(MissingCredentialKey(key))
        };
        Ok(match kind {
            RepositoryAuthType::Basic => Self::Basic {
                username: text("username")?,
                password: text("password")?,
            },
            RepositoryAuthType::Key => Self::Key {
                key: text("key")?,
                passphrase: text("password").ok(),
            },
        })
    }
}

/// Where checkouts are kept and how long `git` may take.
#[derive(Debug, Clone)]
pub struct GitConfig {
    /// `<data>/git`: checkouts by repository and commit, `known_hosts`.
    pub dir: PathBuf,
    /// The longest one `git` command may run.
    pub timeout: Duration,
}

/// The commit `reference` names in the repository at `url`: a branch, a tag (peeled to its
/// commit), a full ref name, or a commit id itself.
pub async fn resolve(
    config: &GitConfig,
    url: &str,
    reference: &str,
    credentials: Option<&GitCredentials>,
) -> Result<String, BuildFailure> {
    let url = &*eddy_model::resources::git_remote_url(url);
    let scratch = Scratch::new(config)?;
    let mut command = git_command(config, &scratch, credentials)?;
    command.args(["ls-remote", "--", url]);
    let listing = run(
        command,
        config.timeout,
        "listing the repository's references",
    )
    .await?;
    if let Some(commit) = pick_commit(&listing, reference) {
        return Ok(commit);
    }
    if is_commit_id(reference) {
        return Ok(reference.to_ascii_lowercase());
    }
    Err(BuildFailure {
        reason: Reason::SourceUnavailable,
        message: format!("the repository has no branch, tag or ref named {reference}"),
    })
}

/// The commit a reference names in `git ls-remote` output. Pure.
pub fn pick_commit(listing: &str, reference: &str) -> Option<String> {
    let refs: Vec<(&str, &str)> = listing
        .lines()
        .filter_map(|line| line.split_once('\t'))
        .collect();
    let find = |name: &str| {
        refs.iter()
            .find(|(_, r)| *r == name)
            .map(|(commit, _)| (*commit).to_owned())
    };
    find(&format!("refs/heads/{reference}"))
        .or_else(|| find(&format!("refs/tags/{reference}^{{}}")))
        .or_else(|| find(&format!("refs/tags/{reference}")))
        .or_else(|| find(reference))
}

fn is_commit_id(reference: &str) -> bool {
    (7..=40).contains(&reference.len()) && reference.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The files of `commit`, checked out once into the cache and reused afterwards.
pub async fn checkout(
    config: &GitConfig,
    url: &str,
    commit: &str,
    credentials: Option<&GitCredentials>,
) -> Result<PathBuf, BuildFailure> {
    let url = &*eddy_model::resources::git_remote_url(url);
    let repository = hex(&Sha256::digest(url.as_bytes())[..8]);
    let target = config.dir.join("checkouts").join(&repository).join(commit);
    if target.join(".eddy-checked-out").is_file() {
        return Ok(target);
    }
    // One fetch per commit at a time: Functions of one repository and reference applied
    // together wait for the first and reuse its checkout.
    let lock = crate::path_lock::of(&target);
    let _held = lock.lock().await;
    if target.join(".eddy-checked-out").is_file() {
        return Ok(target);
    }
    // A staging folder of this call's own (another process may check out the same commit).
    let staging = config
        .dir
        .join("checkouts")
        .join(&repository)
        .join(format!(".{commit}.{}", unique_suffix()));
    let _ = tokio::fs::remove_dir_all(&staging).await;
    tokio::fs::create_dir_all(&staging)
        .await
        .map_err(|error| BuildFailure::io("create", &staging, &error))?;
    let scratch = Scratch::new(config)?;
    let git = |args: &[&str]| -> Result<tokio::process::Command, BuildFailure> {
        let mut command = git_command(config, &scratch, credentials)?;
        command.arg("-C").arg(&staging).args(args);
        Ok(command)
    };
    run(
        git(&["init", "-q"])?,
        config.timeout,
        "preparing the checkout",
    )
    .await?;
    // Most servers hand out one commit by id; the rest get a full fetch.
    let shallow = run(
        git(&["fetch", "-q", "--depth", "1", "--", url, commit])?,
        config.timeout,
        "fetching the commit",
    )
    .await;
    if shallow.is_err() {
        run(
            git(&[
                "fetch",
                "-q",
                "--",
                url,
                "+refs/heads/*:refs/remotes/origin/*",
                "+refs/tags/*:refs/tags/*",
            ])?,
            config.timeout,
            "fetching the repository",
        )
        .await?;
    }
    run(
        git(&[
            "-c",
            "advice.detachedHead=false",
            "checkout",
            "-q",
            "--detach",
            commit,
        ])?,
        config.timeout,
        "checking out the commit",
    )
    .await?;
    let marker = staging.join(".eddy-checked-out");
    tokio::fs::write(&marker, commit)
        .await
        .map_err(|error| BuildFailure::io("write", &marker, &error))?;
    if let Err(error) = tokio::fs::rename(&staging, &target).await {
        // Another reconcile got there first: theirs is as good.
        let _ = tokio::fs::remove_dir_all(&staging).await;
        if !target.join(".eddy-checked-out").is_file() {
            return Err(BuildFailure::io("move into place", &target, &error));
        }
    }
    Ok(target)
}

/// A name no other call, in this process or another, gets: `<pid>-<counter>`.
fn unique_suffix() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

/// A private directory for one `git` run's key and helper files, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(config: &GitConfig) -> Result<Self, BuildFailure> {
        use std::os::unix::fs::DirBuilderExt as _;
        let base = config.dir.join("tmp");
        std::fs::create_dir_all(&base)
            .map_err(|error| BuildFailure::io("create", &base, &error))?;
        let path = base.join(unique_suffix());
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(|error| BuildFailure::io("create", &path, &error))?;
        Ok(Self(path))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `git` with a clean environment: no prompts, no system or user configuration, and the
/// credentials (if any) in variables only `git` and its children see.
fn git_command(
    config: &GitConfig,
    scratch: &Scratch,
    credentials: Option<&GitCredentials>,
) -> Result<tokio::process::Command, BuildFailure> {
    let mut command = tokio::process::Command::new("git");
    command.env_clear();
    for name in [
        "PATH",
        "LANG",
        "TZ",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
    ] {
        if let Some(value) = std::env::var_os(name) {
            command.env(name, value);
        }
    }
    let known_hosts = config.dir.join("known_hosts");
    let mut ssh = format!(
        "ssh -o StrictHostKeyChecking=accept-new -o UserKnownHostsFile={}",
        shell_quote(&known_hosts.to_string_lossy())
    );
    command
        .env("HOME", &scratch.0)
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null");
    match credentials {
        None => ssh.push_str(" -o BatchMode=yes"),
        Some(GitCredentials::Basic { username, password }) => {
            use base64::Engine as _;
            let token =
                base64::engine::general_purpose::STANDARD.encode(format!("{username}:{password}"));
            command
                .env("GIT_CONFIG_COUNT", "1")
                .env("GIT_CONFIG_KEY_0", "http.extraHeader")
                .env(
                    "GIT_CONFIG_VALUE_0",
                    format!("Authorization: Basic {token}"),
                );
            ssh.push_str(" -o BatchMode=yes");
        }
        Some(GitCredentials::Key { key, passphrase }) => {
            let key_file = scratch.0.join("key");
            write_private(&key_file, &format!("{}\n", key.trim_end()))?;
            ssh.push_str(&format!(
                " -o IdentitiesOnly=yes -i {}",
                shell_quote(&key_file.to_string_lossy())
            ));
            match passphrase {
                Some(passphrase) => {
                    let askpass = scratch.0.join("askpass");
                    write_private(
                        &askpass,
                        "#!/bin/sh\nprintf '%s\\n' \"$EDDY_GIT_KEY_PASSPHRASE\"\n",
                    )?;
                    set_executable(&askpass)?;
                    command
                        .env("SSH_ASKPASS", &askpass)
                        .env("SSH_ASKPASS_REQUIRE", "force")
                        .env("DISPLAY", "none")
                        .env("EDDY_GIT_KEY_PASSPHRASE", passphrase);
                }
                None => ssh.push_str(" -o BatchMode=yes"),
            }
        }
    }
    command.env("GIT_SSH_COMMAND", ssh);
    Ok(command)
}

fn write_private(path: &Path, contents: &str) -> Result<(), BuildFailure> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut file| file.write_all(contents.as_bytes()))
        .map_err(|error| BuildFailure::io("write", path, &error))
}

fn set_executable(path: &Path) -> Result<(), BuildFailure> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
        .map_err(|error| BuildFailure::io("set permissions of", path, &error))
}

fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', "'\\''"))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Runs one `git` command within `timeout`; its standard output, or a failure saying what
/// failed with the end of git's message.
async fn run(
    mut command: tokio::process::Command,
    timeout: Duration,
    what: &str,
) -> Result<String, BuildFailure> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    process::supervise(&mut command);
    let child = command.spawn().map_err(|error| BuildFailure {
        reason: Reason::BuildToolMissing,
        message: format!(
            "{what}: cannot run git ({error}); install Git to build functions from a repository"
        ),
    })?;
    match tokio::time::timeout(timeout, child.wait_with_output()).await {
        Ok(Ok(output)) if output.status.success() => {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        }
        Ok(Ok(output)) => Err(BuildFailure {
            reason: Reason::SourceUnavailable,
            message: format!(
                "{what} failed: {}",
                tail(String::from_utf8_lossy(&output.stderr).trim(), 5)
            ),
        }),
        Ok(Err(error)) => Err(BuildFailure {
            reason: Reason::SourceUnavailable,
            message: format!("{what}: git failed: {error}"),
        }),
        Err(_) => Err(BuildFailure {
            reason: Reason::SourceUnavailable,
            message: format!("{what} took longer than {timeout:?}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_resolve_to_branches_then_peeled_tags_then_refs() {
        let listing = "1111111111111111111111111111111111111111\tHEAD\n\
                       2222222222222222222222222222222222222222\trefs/heads/main\n\
                       3333333333333333333333333333333333333333\trefs/tags/v1\n\
                       4444444444444444444444444444444444444444\trefs/tags/v1^{}\n\
                       5555555555555555555555555555555555555555\trefs/tags/light\n";
        assert_eq!(pick_commit(listing, "main").unwrap(), "2".repeat(40));
        assert_eq!(pick_commit(listing, "v1").unwrap(), "4".repeat(40));
        assert_eq!(pick_commit(listing, "light").unwrap(), "5".repeat(40));
        assert_eq!(pick_commit(listing, "HEAD").unwrap(), "1".repeat(40));
        assert_eq!(
            pick_commit(listing, "refs/heads/main").unwrap(),
            "2".repeat(40)
        );
        assert_eq!(pick_commit(listing, "nope"), None);
        assert!(is_commit_id("abc1234"));
        assert!(!is_commit_id("main"));
    }

    /// The environment `git` gets, as (name, value) text.
    fn env_of(command: &tokio::process::Command) -> Vec<(String, String)> {
        command
            .as_std()
            .get_envs()
            .filter_map(|(name, value)| {
                Some((
                    name.to_string_lossy().into_owned(),
                    value?.to_string_lossy().into_owned(),
                ))
            })
            .collect()
    }

    #[test]
    fn credentials_reach_git_through_its_environment_only() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let config = GitConfig {
            dir: dir.path().to_owned(),
            timeout: Duration::from_secs(5),
        };
        let scratch = Scratch::new(&config).unwrap();
        let basic = GitCredentials::Basic {
            username: "me".into(),
            password: "pw".into(),
        };
        let command = git_command(&config, &scratch, Some(&basic)).unwrap();
        let env = env_of(&command);
        assert!(env.contains(&("GIT_CONFIG_KEY_0".into(), "http.extraHeader".into())));
        // base64("me:pw")
        assert!(env.contains(&(
            "GIT_CONFIG_VALUE_0".into(),
            "Authorization: Basic bWU6cHc=".into()
        )));
        assert!(env.contains(&("GIT_TERMINAL_PROMPT".into(), "0".into())));
        assert_eq!(
            command.as_std().get_args().count(),
            0,
            "no credentials on the command line"
        );

        let key = GitCredentials::Key {
            key: "PRIVATE KEY".into(),
            passphrase: Some("phrase".into()),
        };
        let command = git_command(&config, &scratch, Some(&key)).unwrap();
        let env = env_of(&command);
        let ssh = &env
            .iter()
            .find(|(name, _)| name == "GIT_SSH_COMMAND")
            .unwrap()
            .1;
        assert!(ssh.contains("-o IdentitiesOnly=yes -i "), "{ssh}");
        let key_file = scratch.0.join("key");
        assert_eq!(std::fs::read_to_string(&key_file).unwrap(), "PRIVATE KEY\n");
        assert_eq!(
            std::fs::metadata(&key_file).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert!(env.contains(&("EDDY_GIT_KEY_PASSPHRASE".into(), "phrase".into())));
        assert!(env.contains(&("SSH_ASKPASS_REQUIRE".into(), "force".into())));
        let scratch_dir = scratch.0.clone();
        drop(scratch);
        assert!(
            !scratch_dir.exists(),
            "the key is removed with the scratch directory"
        );
    }

    #[test]
    fn credentials_come_from_the_secret_keys_kyma_names() {
        let data: std::collections::BTreeMap<String, Vec<u8>> = [
            ("username".to_owned(), b"me".to_vec()),
            ("password".to_owned(), b"pw".to_vec()),
        ]
        .into();
        assert_eq!(
            GitCredentials::from_secret(RepositoryAuthType::Basic, &data).unwrap(),
            GitCredentials::Basic {
                username: "me".into(),
                password: "pw".into()
            }
        );
        assert_eq!(
            GitCredentials::from_secret(RepositoryAuthType::Key, &data).unwrap_err(),
            MissingCredentialKey("key")
        );
        assert_eq!(
            format!(
                "{:?}",
                GitCredentials::Basic {
                    username: "me".into(),
                    password: "pw".into()
                }
            ),
            "GitCredentials::Basic"
        );
    }
}
