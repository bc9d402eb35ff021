"""The platform's part of eddy's Python runtimes, shipped beside each of their servers (python311
and python312's, python314's): a warm spare becoming the instance it is handed, an instance's
secrets arriving on stdin, the secrets an instance keeps out of its function's sight, Secret
mounts read locally, and the file a pod's postStart hook waits for.
"""

import json
import os
import sys
import time

# The header the gateway sends an instance's secret in, as WSGI names it.
SECRET_ENVIRON_KEY = "HTTP_X_EDDY_INSTANCE_SECRET"


def become_instance():
    """Locally eddy keeps a warm spare of each runtime in use: a server started ahead of need,
    its libraries loaded, waiting for the one instance it becomes. Its first line on stdin names
    that instance's environment and directory; everything after this reads them."""
    sys.stdout.write("eddy-spare-ready\n")
    sys.stdout.flush()
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)  # stdin closed before a line came: no instance is wanted
    spec = json.loads(line)
    os.environ.clear()
    os.environ.update(spec["env"])
    os.chdir(spec["dir"])
    sys.path[0] = spec["dir"]  # as if the server had started there
    if hasattr(time, "tzset"):
        time.tzset()


def read_secrets():
    """A cold-started instance gets its secrets (below) as one JSON line on stdin, not in its
    environment, which every process of the same user can read in /proc/<pid>/environ."""
    line = sys.stdin.readline()
    if not line.endswith("\n"):
        # Without its secret an instance would take calls from anyone on the machine.
        sys.exit("eddy: the instance's secrets did not arrive on stdin")
    os.environ.update(json.loads(line))


def start():
    """Becomes the instance a spare is handed, and reads a cold start's secrets. A server calls
    it once the libraries a spare keeps warm are loaded, before it reads its environment."""
    if os.environ.get("EDDY_SPARE"):
        become_instance()
    if os.environ.pop("EDDY_SECRETS_ON_STDIN", None):
        read_secrets()


def take_secrets():
    """The instance's secret (bytes) and its publish-only token, taken out of the environment
    the function sees. Locally the gateway sends the secret with every request, so an
    instance's loopback port cannot be called around the gateway's access checks."""
    return (
        os.environ.pop("EDDY_INSTANCE_SECRET", "").encode(),
        os.environ.pop("EDDY_PUBLISHER_TOKEN", ""),
    )


def install_secret_mounts(text):
    """Locally a Secret cannot be mounted at the path the manifest names (it may be /etc/secrets,
    and there is no container): its files are in a private directory (`text` maps each mount
    path to it, as JSON), and the handler's reads of the mount path are sent there (os's
    functions, and so pathlib's, and open). On Kubernetes the Secret is a volume and this is
    unused."""
    import builtins
    import io

    mounts = [(os.path.abspath(path).rstrip("/"), directory) for path, directory in json.loads(text).items()]
    # The deepest mount first: `/s/inner` inside `/s` shows its own Secret, as on Kubernetes.
    mounts.sort(key=lambda mount: len(mount[0]), reverse=True)

    def remap(target):
        try:
            path = os.fspath(target)
        except TypeError:
            return target
        if not isinstance(path, str):
            return target
        absolute = os.path.abspath(path)
        for mount_path, directory in mounts:
            if absolute == mount_path or absolute.startswith(mount_path + "/"):
                return directory + absolute[len(mount_path) :]
        return target

    def wrap(module, name):
        original = getattr(module, name)

        def remapped(*args, **kwargs):
            if args:
                args = (remap(args[0]), *args[1:])
            return original(*args, **kwargs)

        setattr(module, name, remapped)

    for name in ("open", "stat", "lstat", "listdir", "scandir", "access"):
        wrap(os, name)
    wrap(builtins, "open")
    io.open = builtins.open


def announce_serving():
    """Writes EDDY_SERVING_FILE once the server listens. In a pod the container's postStart hook
    waits for it, so the kubelet's first readiness probe comes when the server can answer instead
    of a probe period after a refused one."""
    path = os.environ.get("EDDY_SERVING_FILE")
    if path:
        try:
            open(path, "w").close()
        except OSError as error:
            print(f"eddy: cannot write {path}: {error}", file=sys.stderr, flush=True)
