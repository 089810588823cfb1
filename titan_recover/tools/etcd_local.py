"""A real etcd cluster on this machine, from the ``etcd`` and ``etcdctl`` on ``PATH``: for the tests, the
benches, and trying ``control_store`` out. A release with etcd-io/etcd#13766 (3.5.0 to 3.5.3: a member
SIGKILLed can come back with data the others do not have) is refused: Debian's ``etcd-server`` and
``etcd-client`` (3.4.23, the 3.4 line never had it; ``./run_tests.sh`` installs them where it runs as root),
or an etcd release of 3.5.4 or later first on ``PATH`` (docs/etcd-operations.md#which-etcd). Its members
listen on loopback, or each on an address of its own, started where that address is (a node of a
namespace cluster, ``tools.clusters.netns``: a member per node, for partitions between members).

    python -m titan_recover.tools.etcd_local [--members 3] [--dir DIR]
    (prints the control_store URL and serves until interrupted)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from titan_recover.control.addresses import ETCD_SCHEME, LOOPBACK
from titan_recover.control.etcd_process import CTL_TIMEOUT_S, etcd_binary, member_command, unavailable
from titan_recover.control.transport import free_port

# how member i's processes start (member index, argv, Popen's keywords): here, or in its node's namespace
Spawn = Callable[..., subprocess.Popen]


def _here(index: int, argv: list[str], **popen: Any) -> subprocess.Popen:
    return subprocess.Popen(argv, **popen)


class LocalEtcd:
    """``members`` etcd processes, one Raft cluster; ``url`` is its control_store value. On loopback,
    or member i on ``hosts[i]``, its processes started by ``spawn(i, argv, **popen)`` where that
    address is (``Cluster.spawn`` of its node)."""

    def __init__(
        self, members: int = 3, root: str | None = None, hosts: Sequence[str] = (), spawn: Spawn = _here
    ) -> None:
        if hosts and len(hosts) != members:
            raise ValueError(f"{len(hosts)} hosts for {members} etcd members")
        self.root = root or tempfile.mkdtemp(prefix="titan-recover-etcd-")
        self._own_root = root is None
        self.names = [f"m{i}" for i in range(members)]
        self.hosts = {n: hosts[i] if hosts else LOOPBACK for i, n in enumerate(self.names)}
        self._spawn = spawn
        self.client_ports = {n: free_port() for n in self.names}
        self.peer_ports = {n: free_port() for n in self.names}
        self.procs: dict[str, subprocess.Popen] = {}
        self.url = ETCD_SCHEME + ",".join(f"{self.hosts[n]}:{self.client_ports[n]}" for n in self.names)

    def _client(self, name: str) -> str:
        return f"http://{self.hosts[name]}:{self.client_ports[name]}"

    def _peer(self, name: str) -> str:
        return f"http://{self.hosts[name]}:{self.peer_ports[name]}"

    def _command(self, name: str) -> list[str]:
        cluster = ",".join(f"{n}={self._peer(n)}" for n in self.names)
        data = os.path.join(self.root, name)
        return member_command(name, self._client(name), self._peer(name), data, cluster, self.root)

    def start(self, timeout_s: float = 30.0) -> "LocalEtcd":
        if (why := unavailable()) is not None:
            raise RuntimeError(why)
        with open(os.path.join(self.root, "etcd.log"), "ab") as log:  # the members keep their own copies
            for i, name in enumerate(self.names):
                self.procs[name] = self._spawn(i, self._command(name), stdout=log, stderr=log)
        try:
            self.wait_serving(self.names[0], timeout_s, every=True)
        except RuntimeError:
            self.stop()
            raise
        return self

    def ctl(self, name: str, *args: str, every: bool = False) -> subprocess.CompletedProcess:
        """``etcdctl ARGS`` started beside member ``name``, asking that member (or ``every`` member)."""
        endpoints = ",".join(self._client(n) for n in (self.names if every else [name]))
        proc = self._spawn(
            self.names.index(name),
            [
                etcd_binary("etcdctl"),
                "--endpoints",
                endpoints,
                "--dial-timeout",
                "2s",
                "--command-timeout",
                "2s",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = proc.communicate(timeout=CTL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def wait_serving(self, name: str, timeout_s: float, every: bool = False) -> None:
        """Returns once member ``name`` (or any member) answers a linearizable read, which takes a
        Raft leader and a quorum it is part of; RuntimeError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (done := self.ctl(name, "get", "titan_recover/probe", every=every)).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"etcd {'cluster' if every else f'member {name}'} did not serve within "
                    f"{timeout_s:g}s: {done.stderr.strip()[-300:]}"
                )
            time.sleep(0.1)

    def move_leader(self, name: str, timeout_s: float = 10.0) -> None:
        """Makes member ``name`` lead Raft (``etcdctl move-leader``), within ``timeout_s``: a test
        that cuts a member off chooses whether etcd must elect a new leader."""
        deadline = time.monotonic() + timeout_s
        while True:
            done = self.ctl(name, "endpoint", "status", "-w", "json", every=True)
            statuses = json.loads(done.stdout or "[]")
            target = next(
                (s["Status"]["header"]["member_id"] for s in statuses if s["Endpoint"] == self._client(name)), None
            )
            if target is not None and {s["Status"]["leader"] for s in statuses} == {target}:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"etcd member {name} does not lead {timeout_s:g}s after asking: "
                    f"{done.stdout.strip()} {done.stderr.strip()}"
                )
            if target is not None:
                self.ctl(name, "move-leader", format(target, "x"), every=True)
            time.sleep(0.1)

    def kill(self, name: str) -> None:
        """SIGKILLs one member."""
        self.procs[name].kill()
        self.procs[name].wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--dir", default=None, help="data directory (default: a temporary one, removed at exit)")
    args = parser.parse_args(argv)
    cluster = LocalEtcd(args.members, args.dir).start()
    print(f"etcd: {args.members} members up; use --recover.control_store {cluster.url}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while all(p.poll() is None for p in cluster.procs.values()):
            time.sleep(1.0)
        return 1
    except (KeyboardInterrupt, SystemExit):
        return 0
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
