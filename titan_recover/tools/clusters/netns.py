"""Hosts made of Linux network namespaces: a cluster on one machine with real addresses, for the
tests and benches of what crosses a network (partitions, loss, paused and replaced nodes).

Each node is a namespace with one interface, ``eth0``, holding an address of 198.18.0.0/15 (set
aside for network benchmarks, RFC 2544) that exists only inside the cluster: the nodes' veth peers
sit on a bridge in a switch namespace of their own, with no route out, so nothing leaves the
machine. Faults: a node's cable pulled (its switch port down), its packets dropped by nftables rules
on the switch's bridge (both ways, one way, or a random share: loss; neither end sees an error, as
on a real link), latency (every new TCP connection between nodes through a relay that delays each
byte, ``delay_relay``), every process of a node SIGSTOPped or SIGKILLed (at one instant, through the
node's cgroup, where cgroup v2 has ``cgroup.kill``). This kernel has no netem; nftables (Debian's
``nftables``), bridges and veth work.
Every fault is a context manager that undoes itself, and the cluster removes all it made on exit,
also when the test fails; namespaces left by a SIGKILLed test process are removed by the next one.

Needs root, ``ip`` (iproute2) and ``nft``; ``unavailable()`` says why not where they are missing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_recover.node.procs import pid_alive
from titan_recover.tools.clusters import delay_relay

log = logging.getLogger(__name__)

SUBNET = "198.18.0"  # the nodes' addresses: 198.18.0.1, .2, ...
PREFIX = "trc"  # namespace names: trc<owner pid>x<cluster>-<node or "sw">
_NAME = re.compile(rf"^{PREFIX}(\d+)x\d+-\w+$")
_TABLE = "titan_recover"  # the switch's nftables tables of a node's faults: titan_recover_<port>
COMMAND_TIMEOUT_S = 10.0
RELAY_PORT = 19999  # the delay relay's port inside a node (below the ephemeral range)


class NetnsError(RuntimeError):
    """A namespace command failed: the command and what it printed."""


def _run(*argv: str, timeout: float = COMMAND_TIMEOUT_S) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} exited {done.returncode}: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why this machine cannot make a namespace cluster, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (id -u is not 0)"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian package {package})"
    probe = f"{PREFIX}{os.getpid()}x0-probe"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "netns", "exec", probe, "nft", "add", "table", "bridge", _TABLE)
    except (NetnsError, subprocess.TimeoutExpired) as e:
        return f"cannot make a network namespace with nftables here: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=COMMAND_TIMEOUT_S)
    return None


@functools.cache
def _cgroups() -> Path | None:
    """Where each node gets a cgroup v2 of its own, one that can kill all its processes at once
    (``cgroup.kill``, Linux 5.14), or None where there is none to make."""
    for root in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        probe = root / f"{PREFIX}{os.getpid()}probe"
        if not (root / "cgroup.controllers").exists():  # not a cgroup v2 hierarchy
            continue
        try:
            probe.mkdir()
        except OSError:
            continue
        usable = (probe / "cgroup.kill").exists()
        probe.rmdir()
        if usable:
            return root
    log.info("no cgroup v2 with cgroup.kill here: a node's processes are SIGKILLed one by one")
    return None


def _cgroup(ns: str) -> Path | None:
    root = _cgroups()
    return root / ns if root else None


def remove_orphans() -> list[str]:
    """Removes the namespaces (and their processes and cgroups) of clusters whose owner process is gone."""
    removed = []
    root = _cgroups()
    left = {path.name for path in root.iterdir() if path.is_dir()} if root else set()
    for name in sorted(set(_run("ip", "netns", "list").split()) | left):
        match = _NAME.match(name)
        if match and not pid_alive(int(match.group(1))):
            _remove(name)
            removed.append(name)
    if removed:
        log.warning(f"removed {len(removed)} network namespace(s) left by a process that is gone: {', '.join(removed)}")
    return removed


def _nft(ns: str, script: str) -> None:
    """An nftables script run inside namespace ``ns``."""
    done = subprocess.run(
        ["ip", "netns", "exec", ns, "nft", "-f", "-"],
        input=script,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    if done.returncode != 0:
        raise NetnsError(f"nft in {ns} exited {done.returncode}: {done.stderr.strip()}\n{script}")


def _pids(ns: str) -> list[int]:
    return [int(p) for p in _run("ip", "netns", "pids", ns).split()]


def _inside(pid: int, ns: str) -> bool:
    """Whether process ``pid`` is in namespace ``ns`` (the test ``ip netns pids`` makes)."""
    try:
        here, there = os.stat(f"/proc/{pid}/ns/net"), os.stat(f"/run/netns/{ns}")
    except OSError:  # the process is gone, or not ours to look at
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _signal_all(ns: str, sig: signal.Signals) -> list[int]:
    pids = _pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


def _kill_all(ns: str) -> list[int]:
    """Every process of ``ns`` SIGKILLed; the ones listed. Those of its cgroup die at one instant, as on a node
    that fails: killed one by one, a process could see another one die first and act on it (srun aborts
    the whole job step, every node's tasks, when it sees its own node's slurmstepd die)."""
    pids = _pids(ns) if Path(f"/run/netns/{ns}").exists() else []
    cgroup = _cgroup(ns)
    if cgroup and cgroup.exists():
        (cgroup / "cgroup.kill").write_text("1")
    if pids:
        pids += [pid for pid in _signal_all(ns, signal.SIGKILL) if pid not in pids]  # any outside the cgroup
    return pids


def _remove(ns: str) -> None:
    with contextlib.suppress(NetnsError):
        _kill_all(ns)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=COMMAND_TIMEOUT_S)
    cgroup = _cgroup(ns)
    deadline = time.monotonic() + COMMAND_TIMEOUT_S
    while cgroup and cgroup.exists():
        try:
            cgroup.rmdir()
        except OSError as e:  # its processes still dying
            if time.monotonic() > deadline:
                log.warning(f"cgroup {cgroup} not removed: {e}")
                break
            time.sleep(0.05)


@dataclass(frozen=True)
class Node:
    index: int
    ns: str  # its namespace
    address: str  # its address on the cluster's network
    port: str  # its veth peer on the switch: its cable


class Cluster:
    """``size`` nodes on one bridge; ``with Cluster(3) as c: c.spawn(c.nodes[0], [...])``."""

    _count = 0

    def __init__(self, size: int) -> None:
        if not 1 <= size <= 250:
            raise ValueError(f"a namespace cluster has 1 to 250 nodes, not {size}")
        Cluster._count += 1
        self.name = f"{PREFIX}{os.getpid()}x{Cluster._count}"
        self.switch = f"{self.name}-sw"
        self.nodes = [Node(i, f"{self.name}-n{i}", f"{SUBNET}.{i + 1}", f"n{i}") for i in range(size)]
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Cluster":
        remove_orphans()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        _run("ip", "netns", "add", self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge", "forward_delay", "0", "stp_state", "0")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for node in self.nodes:
            _run("ip", "netns", "add", node.ns)
            cgroup = _cgroup(node.ns)
            if cgroup:
                cgroup.mkdir()
            _run(
                "ip",
                "link",
                "add",
                "eth0",
                "netns",
                node.ns,
                "type",
                "veth",
                "peer",
                "name",
                node.port,
                "netns",
                self.switch,
            )
            _run("ip", "-n", self.switch, "link", "set", node.port, "master", "br0", "up")
            _run("ip", "-n", node.ns, "addr", "add", f"{node.address}/24", "dev", "eth0")
            _run("ip", "-n", node.ns, "link", "set", "eth0", "up")
            _run("ip", "-n", node.ns, "link", "set", "lo", "up")
        log.info(
            f"namespace cluster {self.name}: {len(self.nodes)} node(s), "
            f"{self.nodes[0].address}..{self.nodes[-1].address}"
        )

    def close(self) -> None:
        """Kills every process of the cluster and removes its namespaces (and with them the links)."""
        for node in self.nodes:
            _remove(node.ns)
        _remove(self.switch)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=COMMAND_TIMEOUT_S)

    # --- processes -------------------------------------------------------------------------

    def spawn(self, node: Node, argv: Sequence[str], **popen: Any) -> subprocess.Popen:
        """``argv`` started inside ``node``'s namespace (``ip netns exec`` execs it: the pid is its own).
        Returns once the process is inside (or has already ended): until ``ip netns exec`` has entered
        the namespace, the node's process list, pause and kill would miss it."""
        proc = subprocess.Popen([*self.entering(node), "ip", "netns", "exec", node.ns, *argv], **popen)
        self.procs.append(proc)
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while not _inside(proc.pid, node.ns) and proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                raise NetnsError(f"{' '.join(argv)} did not enter {node.ns} within {COMMAND_TIMEOUT_S:g}s")
            time.sleep(0.005)
        return proc

    def entering(self, node: Node) -> list[str]:
        """The command prefix that starts a process in ``node``'s cgroup (its children with it), so that the
        node's loss kills them all at once; nothing where there is no cgroup."""
        cgroup = _cgroup(node.ns)
        return ["sh", "-c", 'echo 0 > "$0" && exec "$@"', str(cgroup / "cgroup.procs")] if cgroup else []

    def pids(self, node: Node) -> list[int]:
        return _pids(node.ns)

    def kill(self, node: Node, timeout_s: float = COMMAND_TIMEOUT_S) -> list[int]:
        """SIGKILLs every process of ``node`` (a node lost, or replaced) and waits until none is left."""
        pids = _kill_all(node.ns)
        deadline = time.monotonic() + timeout_s
        while self.pids(node):
            if time.monotonic() > deadline:
                raise NetnsError(f"{node.ns}: processes {self.pids(node)} still alive {timeout_s:g}s after SIGKILL")
            time.sleep(0.05)
        for proc in self.procs:  # reap the ones started here
            with contextlib.suppress(subprocess.TimeoutExpired):
                if proc.pid in pids:
                    proc.wait(timeout=timeout_s)
        log.info(f"{node.ns}: SIGKILLed {len(pids)} process(es)")
        return pids

    @contextlib.contextmanager
    def paused(self, node: Node) -> Iterator[list[int]]:
        """Every process of ``node`` SIGSTOPped (a frozen VM) until the block ends."""
        pids = _signal_all(node.ns, signal.SIGSTOP)
        log.info(f"{node.ns}: SIGSTOPped {len(pids)} process(es)")
        try:
            yield pids
        finally:
            _signal_all(node.ns, signal.SIGCONT)
            log.info(f"{node.ns}: resumed")

    # --- network faults --------------------------------------------------------------------

    @contextlib.contextmanager
    def unplugged(self, node: Node) -> Iterator[None]:
        """``node`` cut off from every other node (its switch port down) until the block ends."""
        _run("ip", "-n", self.switch, "link", "set", node.port, "down")
        log.info(f"{node.ns}: cut off")
        try:
            yield
        finally:
            _run("ip", "-n", self.switch, "link", "set", node.port, "up")
            log.info(f"{node.ns}: reconnected")

    @contextlib.contextmanager
    def dropping(
        self, node: Node, peers: Sequence[Node] = (), direction: str = "both", percent: int = 100
    ) -> Iterator[None]:
        """``percent`` % of the IPv4 packets between ``node`` and ``peers`` (every other node when
        empty) dropped on the switch, silently to both ends, as on a lossy link: ``direction`` "in"
        (what they send it), "out" (what it sends them) or "both". Below 100, each packet is dropped
        at random: loss."""
        if direction not in ("in", "out", "both"):
            raise ValueError(f"direction is 'in', 'out' or 'both', not {direction!r}")
        if not 0 < percent <= 100:
            raise ValueError(f"percent is in (0, 100], not {percent}")
        others = ", ".join(p.address for p in (peers or [n for n in self.nodes if n != node]))
        chance = "" if percent == 100 else f"numgen random mod 100 < {percent} "
        ways = {
            "out": f'iifname "{node.port}" ip daddr {{ {others} }}',
            "in": f'oifname "{node.port}" ip saddr {{ {others} }}',
        }
        table = f"{_TABLE}_{node.port}"
        rules = [
            f"add table bridge {table}",
            f"add chain bridge {table} forward {{ type filter hook forward priority 0; policy accept; }}",
        ]
        rules += [
            f"add rule bridge {table} forward {ways[way]} {chance}drop"
            for way in (("in", "out") if direction == "both" else (direction,))
        ]
        _nft(self.switch, "\n".join(rules))
        log.info(f"{node.ns}: dropping {percent}% {direction} with {others}")
        try:
            yield
        finally:
            _nft(self.switch, f"delete table bridge {table}")
            log.info(f"{node.ns}: no longer dropping")

    @contextlib.contextmanager
    def delayed(self, delay_ms: float, nodes: Sequence[Node] = (), seconds: float = 900.0) -> Iterator[None]:
        """Every TCP connection that ``nodes`` (all when empty) open to other nodes from now on gets
        ``delay_ms`` more latency each way: each such node redirects them to a ``delay_relay`` of its
        own (at most ``seconds``; gone with the block). Connections open before are not delayed."""
        nodes = list(nodes) or self.nodes
        relays: list[subprocess.Popen] = []
        try:
            for node in nodes:
                relay = self.spawn(
                    node,
                    [
                        sys.executable,
                        "-m",
                        "titan_recover.tools.clusters.delay_relay",
                        "--port",
                        str(RELAY_PORT),
                        "--delay-ms",
                        str(delay_ms),
                        "--seconds",
                        str(seconds),
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                relays.append(relay)
                if relay.stdout is None or relay.stdout.readline().strip() != "ready":
                    raise NetnsError(f"{node.ns}: the delay relay did not start (exit {relay.poll()})")
                others = ", ".join(n.address for n in self.nodes if n != node)
                _nft(
                    node.ns,
                    f"add table ip {_TABLE}\n"
                    f"add chain ip {_TABLE} delay {{ type nat hook output priority -100; }}\n"
                    f"add rule ip {_TABLE} delay ip daddr {{ {others} }} meta l4proto tcp "
                    f"meta mark != {delay_relay.MARK} redirect to :{RELAY_PORT}",
                )
            log.info(f"{', '.join(n.ns for n in nodes)}: {delay_ms:g} ms more each way on new TCP connections")
            yield
        finally:
            for node in nodes[: len(relays)]:
                with contextlib.suppress(NetnsError):
                    _nft(node.ns, f"delete table ip {_TABLE}")
            for relay in relays:
                relay.kill()
                relay.wait(timeout=COMMAND_TIMEOUT_S)
