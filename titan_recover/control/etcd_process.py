"""The etcd binaries on ``PATH`` (which release, refused where it carries etcd-io/etcd#13766) and one member's
command: shared by the members a run forms on its nodes (``launch.members``) and the tests' and benches' local
clusters (``tools.etcd_local``)."""

import functools
import re
import shutil
import subprocess

CTL_TIMEOUT_S = 5.0  # one etcd or etcdctl command
INSTALL = (
    "apt-get install etcd-server etcd-client (Debian's 3.4.23), or put an etcd release of 3.5.4 or later first on "
    "PATH (docs/etcd-operations.md#which-etcd)"
)
BROKEN = ((3, 5, 0), (3, 5, 3))  # etcd-io/etcd#13766: data inconsistency after a member's crash, fixed in 3.5.4


def etcd_binary(name: str = "etcd") -> str:
    """``etcd`` (or ``etcdctl``) from ``PATH``; RuntimeError saying how to install one where there is none."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"no {name} on PATH: {INSTALL}")
    return path


def version() -> tuple[int, int, int]:
    """The version of the ``etcd`` on ``PATH`` (``etcd --version``'s first line: ``etcd Version: 3.4.23``)."""
    return _version_of(etcd_binary())


@functools.lru_cache(maxsize=8)
def _version_of(binary: str) -> tuple[int, int, int]:
    """``binary``'s version, asked once per process (a launcher checks it, then logs it)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=CTL_TIMEOUT_S).stdout
    first = out.splitlines()[0] if out else ""
    if not (m := re.fullmatch(r"etcd Version: (\d+)\.(\d+)\.(\d+)\S*", first.strip())):
        raise RuntimeError(f"{binary} --version printed {first!r}, not 'etcd Version: X.Y.Z': {INSTALL}")
    major, minor, patch = map(int, m.groups())
    return major, minor, patch


def release() -> str:
    """The version of the ``etcd`` on ``PATH`` as it prints it: ``3.4.23``."""
    return ".".join(map(str, version()))


def unavailable() -> str | None:
    """Why this machine cannot run an etcd member (no etcd, or a release with etcd-io/etcd#13766), or None."""
    try:
        found = version()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if BROKEN[0] <= found <= BROKEN[1] or found < (3, 4, 0):
        return f"etcd {release()} ({etcd_binary()}) is refused: 3.4, or 3.5.4 and later (etcd-io/etcd#13766): {INSTALL}"
    return None


def member_command(
    name: str, client: str, peer: str, data_dir: str, cluster: str, token: str, state: str = "new"
) -> list[str]:
    """One member's ``etcd`` command: ``client`` and ``peer`` are its ``http://ip:port`` URLs, ``cluster``
    every member's ``name=peer`` (``--initial-cluster``; ignored once its data folder holds a cluster). ``state``
    "existing": a member added to a running cluster, which it joins with an empty data folder."""
    return [
        etcd_binary(),
        "--name",
        name,
        "--data-dir",
        data_dir,
        "--listen-client-urls",
        client,
        "--advertise-client-urls",
        client,
        "--listen-peer-urls",
        peer,
        "--initial-advertise-peer-urls",
        peer,
        "--initial-cluster",
        cluster,
        "--initial-cluster-state",
        state,
        "--initial-cluster-token",
        token,
        "--heartbeat-interval",
        "100",
        "--election-timeout",
        "1000",
        "--log-level",
        "error",
    ]  # no auto-compaction, as on a cluster set up without it: the run's leader compacts (``leader``)
