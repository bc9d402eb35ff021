//! The build: the context ConfigMap, the Job that builds and pushes the Function's image, and
//! the Git fetch that gives it (or the buildless pod) a repository's sources.

use super::{
    BTreeMap, ConfigMap, ConfigMapVolumeSource, Container, EGRESS_CA_DIR, EmptyDirVolumeSource,
    EnvVar, EnvVarSource, Function, GitRepositorySource, Job, JobSpec, KeyToPath, ObjectMeta,
    Owned, PodSecurityContext, PodSpec, PodTemplateSpec, Quantity, RenderConfig,
    RepositoryAuthType, ResourceRequirements, Resources, Runtime, SecretKeySelector,
    SecretVolumeSource, SecurityContext, Source, Volume, VolumeMount, config_map_name,
    git_base_dir, hardened_container, job_name, labels, quantities, runtimes,
};

/// The ConfigMap with the build context: Dockerfile, runtime server and, for inline code,
/// handler and dependencies (a Git source's come from the repository).
pub(super) fn build_context(
    owned: &Owned<'_>,
    function: &Function,
    source: Source<'_>,
) -> ConfigMap {
    let files = runtimes::files(function.spec.runtime);
    let mut data = BTreeMap::from([
        ("Dockerfile".to_owned(), files.dockerfile.to_owned()),
        (files.server_file.to_owned(), files.server.to_owned()),
    ]);
    for (name, contents) in files.libraries {
        data.insert(format!("runtime-{name}"), (*contents).to_owned());
    }
    for (name, contents) in files.modules {
        data.insert((*name).to_owned(), (*contents).to_owned());
    }
    if let Source::Inline(inline) = source {
        data.insert(files.handler_file.to_owned(), inline.source.clone());
        if !inline.dependencies.trim().is_empty() {
            data.insert(
                files.dependencies_file.to_owned(),
                inline.dependencies.clone(),
            );
        }
    }
    ConfigMap {
        metadata: owned.metadata(
            &config_map_name(owned.name, &owned.hash),
            owned.build_labels(),
        ),
        data: Some(data),
        ..ConfigMap::default()
    }
}

/// The shell script of a Git build's `source` init container: fetches the commit (shallow
/// where the server allows it), then lays out the build context: the base directory's files
/// with the runtime's from the ConfigMap over them. The URL, commit and directories come from
/// the environment (never spliced into the script); credentials come from the Secret as
/// files and variables, and the password only ever reaches `git` as an HTTP header in its
/// environment. POSIX sh and git only: any image with both runs it.
pub const GIT_FETCH_SCRIPT: &str = r#"set -eu
umask 022
ssh_command="ssh -o StrictHostKeyChecking=accept-new -o UserKnownHostsFile=$HOME/known_hosts"
if [ -n "${EDDY_GIT_USERNAME:-}" ]; then
  GIT_CONFIG_COUNT=1
  GIT_CONFIG_KEY_0=http.extraHeader
  GIT_CONFIG_VALUE_0="Authorization: Basic $(printf '%s:%s' "$EDDY_GIT_USERNAME" "${EDDY_GIT_PASSWORD:-}" | base64 | tr -d '\n')"
  export GIT_CONFIG_COUNT GIT_CONFIG_KEY_0 GIT_CONFIG_VALUE_0
fi
if [ -f "$EDDY_GIT_AUTH/key" ]; then
  (umask 077 && { cat "$EDDY_GIT_AUTH/key"; echo; } > "$HOME/key")
  ssh_command="$ssh_command -o IdentitiesOnly=yes -i $HOME/key"
  if [ -n "${EDDY_GIT_KEY_PASSPHRASE:-}" ]; then
    (umask 077 && printf '#!/bin/sh\nprintf "%%s\\n" "$EDDY_GIT_KEY_PASSPHRASE"\n' > "$HOME/askpass")
    chmod 700 "$HOME/askpass"
    SSH_ASKPASS="$HOME/askpass" SSH_ASKPASS_REQUIRE=force DISPLAY=none
    export SSH_ASKPASS SSH_ASKPASS_REQUIRE DISPLAY
  else
    ssh_command="$ssh_command -o BatchMode=yes"
  fi
else
  ssh_command="$ssh_command -o BatchMode=yes"
fi
GIT_SSH_COMMAND="$ssh_command"
export GIT_SSH_COMMAND
repo="$EDDY_WORKSPACE/repository"
git init -q "$repo"
if ! git -C "$repo" fetch -q --depth 1 -- "$GIT_URL" "$GIT_COMMIT"; then
  echo "the server does not hand out single commits; fetching every branch and tag" >&2
  git -C "$repo" fetch -q -- "$GIT_URL" '+refs/heads/*:refs/remotes/origin/*' '+refs/tags/*:refs/tags/*'
fi
git -C "$repo" -c advice.detachedHead=false checkout -q --detach "$GIT_COMMIT"
source_dir="$repo/$GIT_BASE_DIR"
if [ ! -d "$source_dir" ]; then
  echo "the repository has no directory '$GIT_BASE_DIR' at $GIT_COMMIT" >&2
  exit 1
fi
context="$EDDY_WORKSPACE/context"
mkdir -p "$context"
cp -R "$source_dir/." "$context/"
rm -rf "$context/.git"
for file in "$EDDY_CONTEXT"/*; do
  cp -L "$file" "$context/"
done
echo "fetched $GIT_COMMIT of $GIT_URL"
"#;

/// Where a Git build's init container puts the repository and the build context.
pub(super) const WORKSPACE: &str = "/workspace";
/// Where the ConfigMap's runtime files are mounted in a Git build.
pub(super) const RUNTIME_FILES: &str = "/eddy/context";
/// Where an SSH key from the Secret is mounted in a Git build.
pub(super) const GIT_AUTH: &str = "/eddy/git-auth";

/// The build Job: Kaniko turns the build context into the function's image. A Git source is
/// fetched first, by an init container, into a volume the build reads.
pub(super) fn build_job(
    owned: &Owned<'_>,
    config: &RenderConfig,
    image: &str,
    runtime: Runtime,
    resources: Resources,
    source: Source<'_>,
) -> Job {
    let context_dir = match source {
        Source::Inline(_) => WORKSPACE.to_owned(),
        Source::Git { .. } => format!("{WORKSPACE}/context"),
    };
    let mut args = vec![
        format!("--context=dir://{context_dir}"),
        format!("--dockerfile={context_dir}/Dockerfile"),
        format!("--destination={image}"),
        "--snapshot-mode=redo".to_owned(),
        "--use-new-run".to_owned(),
    ];
    if let Some(major) = runtime.node_major() {
        args.push(format!("--build-arg=NODE_MAJOR={major}"));
    }
    if let Some(minor) = runtime.python_minor() {
        args.push(format!("--build-arg=PYTHON_VERSION=3.{minor}"));
    }
    if config.insecure_registry {
        args.push("--insecure".to_owned());
        args.push("--skip-tls-verify".to_owned());
    }
    let mut volumes = vec![Volume {
        name: "context".into(),
        config_map: Some(ConfigMapVolumeSource {
            name: config_map_name(owned.name, &owned.hash),
            ..ConfigMapVolumeSource::default()
        }),
        ..Volume::default()
    }];
    let (mut mounts, init_containers) = match source {
        Source::Inline(_) => (
            vec![VolumeMount {
                name: "context".into(),
                mount_path: WORKSPACE.into(),
                read_only: Some(true),
                ..VolumeMount::default()
            }],
            None,
        ),
        Source::Git { repository, commit } => {
            volumes.extend(git_volumes(repository));
            let workspace = VolumeMount {
                name: "workspace".into(),
                mount_path: WORKSPACE.into(),
                ..VolumeMount::default()
            };
            (
                vec![workspace],
                Some(vec![git_fetch_container(config, repository, commit)]),
            )
        }
    };
    // Kaniko, written in Go, trusts SSL_CERT_FILE's bundle.
    mounts.extend(config.egress.mount(EGRESS_CA_DIR));
    volumes.extend(config.egress.volume());
    // Kaniko runs the Dockerfile's install in this container, where the mount is seen and
    // left out of the image.
    if let Some((volume, mount)) = owned.package_registry() {
        volumes.push(volume);
        mounts.push(mount);
    }
    if let Some(secret) = &config.registry_secret {
        mounts.push(VolumeMount {
            name: "registry".into(),
            mount_path: "/kaniko/.docker".into(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
        volumes.push(Volume {
            name: "registry".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(secret.clone()),
                items: Some(vec![KeyToPath {
                    key: ".dockerconfigjson".into(),
                    path: "config.json".into(),
                    ..KeyToPath::default()
                }]),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        });
    }
    let build_labels = owned.build_labels();
    Job {
        metadata: owned.metadata(&job_name(owned.name, &owned.hash), build_labels.clone()),
        spec: Some(JobSpec {
            // A build of the same inputs fails the same way: one attempt, and the failure goes
            // to status instead of a retry loop.
            backoff_limit: Some(0),
            active_deadline_seconds: Some(config.build_timeout_seconds),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(build_labels),
                    // A sidecar would keep the Job's pod running after the build.
                    annotations: Some(labels([("sidecar.istio.io/inject", "false")])),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    restart_policy: Some("Never".into()),
                    automount_service_account_token: Some(false),
                    // The Secret's key is group-readable by the unprivileged fetch.
                    security_context: init_containers.is_some().then(|| PodSecurityContext {
                        fs_group: Some(65532),
                        ..PodSecurityContext::default()
                    }),
                    init_containers,
                    containers: vec![Container {
                        name: "build".into(),
                        image: Some(config.builder_image.clone()),
                        args: Some(args),
                        env: Some(config.egress.env()).filter(|env| !env.is_empty()),
                        // The build log's tail becomes the container's termination message,
                        // which the controller puts into BuildReady.
                        termination_message_policy: Some("FallbackToLogsOnError".into()),
                        volume_mounts: Some(mounts),
                        resources: Some(ResourceRequirements {
                            requests: (!resources.requests.is_empty())
                                .then_some(resources.requests),
                            limits: (!resources.limits.is_empty()).then_some(resources.limits),
                            ..ResourceRequirements::default()
                        }),
                        ..Container::default()
                    }],
                    volumes: Some(volumes),
                    ..PodSpec::default()
                }),
            },
            ..JobSpec::default()
        }),
        ..Job::default()
    }
}

/// The volumes a Git build adds: the workspace the source is fetched into, a private
/// scratch directory, and the SSH key when the repository takes one.
pub(super) fn git_volumes(repository: &GitRepositorySource) -> Vec<Volume> {
    let empty = |name: &str, limit: &str| Volume {
        name: name.into(),
        empty_dir: Some(EmptyDirVolumeSource {
            size_limit: Some(Quantity(limit.into())),
            ..EmptyDirVolumeSource::default()
        }),
        ..Volume::default()
    };
    let mut volumes = vec![empty("workspace", "2Gi"), empty("git-home", "16Mi")];
    if let Some(auth) = &repository.auth
        && auth.type_ == RepositoryAuthType::Key
    {
        volumes.push(Volume {
            name: "git-auth".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(auth.secret_name.clone()),
                items: Some(vec![KeyToPath {
                    key: "key".into(),
                    path: "key".into(),
                    mode: Some(0o440),
                    ..KeyToPath::default()
                }]),
                default_mode: Some(0o440),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        });
    }
    volumes
}

/// The init container that fetches a Git source at `commit` and lays out the build context
/// (see [`GIT_FETCH_SCRIPT`]): unprivileged, read-only root, credentials from the Secret.
pub(super) fn git_fetch_container(
    config: &RenderConfig,
    repository: &GitRepositorySource,
    commit: &str,
) -> Container {
    let var = |name: &str, value: &str| EnvVar {
        name: name.to_owned(),
        value: Some(value.to_owned()),
        ..EnvVar::default()
    };
    let from_secret = |name: &str, secret: &str, key: &str, optional: bool| EnvVar {
        name: name.to_owned(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.to_owned(),
                key: key.to_owned(),
                optional: optional.then_some(true),
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    };
    let mut env = vec![
        var(
            "GIT_URL",
            &eddy_model::resources::git_remote_url(&repository.url),
        ),
        var("GIT_COMMIT", commit),
        var("GIT_BASE_DIR", git_base_dir(repository)),
        var("EDDY_WORKSPACE", WORKSPACE),
        var("EDDY_CONTEXT", RUNTIME_FILES),
        var("EDDY_GIT_AUTH", GIT_AUTH),
        var("HOME", "/home/git"),
        var("GIT_TERMINAL_PROMPT", "0"),
        var("GIT_CONFIG_NOSYSTEM", "1"),
    ];
    let mut mounts = vec![
        VolumeMount {
            name: "workspace".into(),
            mount_path: WORKSPACE.into(),
            ..VolumeMount::default()
        },
        VolumeMount {
            name: "context".into(),
            mount_path: RUNTIME_FILES.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        },
        VolumeMount {
            name: "git-home".into(),
            mount_path: "/home/git".into(),
            ..VolumeMount::default()
        },
    ];
    env.extend(config.egress.env());
    mounts.extend(config.egress.mount(EGRESS_CA_DIR));
    match &repository.auth {
        Some(auth) if auth.type_ == RepositoryAuthType::Basic => {
            env.push(from_secret(
                "EDDY_GIT_USERNAME",
                &auth.secret_name,
                "username",
                false,
            ));
            env.push(from_secret(
                "EDDY_GIT_PASSWORD",
                &auth.secret_name,
                "password",
                false,
            ));
        }
        Some(auth) => {
            env.push(from_secret(
                "EDDY_GIT_KEY_PASSPHRASE",
                &auth.secret_name,
                "password",
                true,
            ));
            mounts.push(VolumeMount {
                name: "git-auth".into(),
                mount_path: GIT_AUTH.into(),
                read_only: Some(true),
                ..VolumeMount::default()
            });
        }
        None => {}
    }
    Container {
        name: "source".into(),
        image: Some(config.git_image.clone()),
        command: Some(vec!["/bin/sh".into(), "-c".into(), GIT_FETCH_SCRIPT.into()]),
        env: Some(env),
        // Why a fetch failed becomes the termination message, which goes into BuildReady.
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        volume_mounts: Some(mounts),
        resources: Some(ResourceRequirements {
            requests: Some(quantities([("cpu", "50m"), ("memory", "64Mi")])),
            limits: Some(quantities([("memory", "512Mi")])),
            ..ResourceRequirements::default()
        }),
        security_context: Some(SecurityContext {
            run_as_user: Some(65532),
            run_as_group: Some(65532),
            ..hardened_container()
        }),
        ..Container::default()
    }
}
