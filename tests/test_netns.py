"""The namespace cluster itself (titan_recover.tools.clusters.netns): real addresses, and each fault doing
what it says to real packets, checked with TCP connects and UDP datagrams between its nodes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from titan_recover.tools.clusters import netns
from titan_recover.tools.clusters.netns import Cluster, Node

REASON = netns.unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no namespace cluster here: {REASON}")
PORT = 7000

# a UDP listener: prints how many datagrams it got in `seconds`
LISTEN = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], int(sys.argv[2]))); s.settimeout(0.1)
print("ready", flush=True)
got, end = 0, time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    try:
        s.recv(64); got += 1
    except socket.timeout:
        pass
print(got, flush=True)
"""
SEND = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(int(sys.argv[3])):
    s.sendto(b"x", (sys.argv[1], int(sys.argv[2]))); time.sleep(0.005)
"""
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close(); print("connected")
except OSError as e:
    print(type(e).__name__, e)
"""
ECHO = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(8); s.settimeout(60)
print("ready", flush=True)
while True:
    c = s.accept()[0]
    c.sendall(c.recv(64)); c.close()
"""
ROUND_TRIP = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
start = time.monotonic(); c.sendall(b"ping"); assert c.recv(64) == b"ping"
print(time.monotonic() - start)
"""
SERVE = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(64); s.settimeout(60)
print("ready", flush=True)
while True:
    s.accept()[0].close()
"""


def in_ns(node: Node, code: str, *args: object, timeout: float = 20) -> str:
    argv = ["ip", "netns", "exec", node.ns, sys.executable, "-c", code, *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=True).stdout.strip()


def connect(src: Node, dst: Node, timeout: float = 1.0) -> str:
    return in_ns(src, CONNECT, dst.address, PORT, timeout)


def reconnects(src: Node, dst: Node, within_s: float = 10.0) -> float:
    """Seconds until ``src`` connects to ``dst`` again (a node's neighbours forget it while it is away)."""
    start = time.monotonic()
    while (outcome := connect(src, dst)) != "connected":
        assert time.monotonic() - start < within_s, outcome
        time.sleep(0.1)
    return time.monotonic() - start


def datagrams(cluster: Cluster, src: Node, dst: Node, count: int = 40) -> int:
    """How many of ``count`` datagrams sent from ``src`` reach ``dst``."""
    listener = cluster.spawn(
        dst, [sys.executable, "-c", LISTEN, dst.address, str(PORT + 1), "2.5"], stdout=subprocess.PIPE, text=True
    )
    assert listener.stdout is not None and listener.stdout.readline().strip() == "ready"
    in_ns(src, SEND, dst.address, PORT + 1, count)
    out, _ = listener.communicate(timeout=20)
    return int(out.strip())


def states(pids: list[int]) -> set[str]:
    """The processes' states (``T``: stopped), once every signal sent to them has landed."""
    time.sleep(0.2)
    return {open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] for p in pids}


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with Cluster(3) as c:
        for node in c.nodes:  # every node serves TCP on its address
            server = c.spawn(
                node, [sys.executable, "-c", SERVE, node.address, str(PORT)], stdout=subprocess.PIPE, text=True
            )
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield c


@pytest.mark.unit
def test_bad_sizes_and_fault_arguments_are_refused_before_anything_is_made() -> None:
    with pytest.raises(ValueError, match="1 to 250 nodes, not 0"):
        Cluster(0)
    c = Cluster(2)  # not entered: nothing made
    assert [n.address for n in c.nodes] == ["198.18.0.1", "198.18.0.2"]
    with pytest.raises(ValueError, match="'in', 'out' or 'both'"):
        c.dropping(c.nodes[0], direction="sideways").__enter__()
    with pytest.raises(ValueError, match=r"percent is in \(0, 100\], not 0"):
        c.dropping(c.nodes[0], percent=0).__enter__()


@needs_netns
def test_nodes_reach_each_other_on_their_own_addresses_and_nothing_else(cluster: Cluster) -> None:
    a, b, c = cluster.nodes
    assert connect(a, b) == connect(b, c) == connect(c, a) == "connected"
    outside = in_ns(a, CONNECT, "192.0.2.1", 80, 1.0)  # TEST-NET-1: no route leads out of the cluster
    assert "unreachable" in outside, outside
    routes = subprocess.run(["ip", "-n", a.ns, "route"], capture_output=True, text=True, check=True).stdout
    assert "default" not in routes and "198.18.0.0/24" in routes


@needs_netns
def test_an_unplugged_node_is_cut_off_from_every_other_and_back_after(cluster: Cluster) -> None:
    a, b, c = cluster.nodes
    with cluster.unplugged(a):
        assert "timed out" in connect(a, b) and "timed out" in connect(c, a)
        assert connect(b, c) == "connected"  # the rest of the network is untouched
    print(f"reconnected in {reconnects(a, b):.2f}s and {reconnects(c, a):.2f}s")


@needs_netns
def test_one_way_drop_loses_only_what_the_node_sends(cluster: Cluster) -> None:
    a, b, c = cluster.nodes
    with cluster.dropping(a, peers=[b], direction="out"):
        assert datagrams(cluster, a, b) == 0
        assert datagrams(cluster, b, a) == 40  # the other way is untouched
        assert datagrams(cluster, a, c) == 40  # and so is every other peer
        assert "timed out" in connect(a, b)  # TCP needs both ways
    assert datagrams(cluster, a, b) == 40


@needs_netns
def test_loss_drops_a_random_share_both_ways(cluster: Cluster) -> None:
    a, b, _ = cluster.nodes
    with cluster.dropping(a, percent=50):
        sent = [datagrams(cluster, a, b, 100), datagrams(cluster, b, a, 100)]
    assert all(15 <= got <= 85 for got in sent), sent  # 50% of 100: outside [15, 85] has p < 1e-11
    assert datagrams(cluster, b, a) == 40


@needs_netns
def test_a_paused_node_stops_every_process_and_a_killed_one_loses_them_all(cluster: Cluster) -> None:
    a = cluster.nodes[0]
    extra = cluster.spawn(a, ["sleep", "60"])
    pids = cluster.pids(a)
    assert extra.pid in pids and len(pids) == 2  # the server and the sleeper
    with cluster.paused(a) as stopped:
        assert sorted(stopped) == sorted(pids)
        assert states(pids) == {"T"}
    assert "T" not in states(pids)
    assert sorted(cluster.kill(a)) == sorted(pids)
    assert cluster.pids(a) == [] and extra.poll() == -9
    assert "refused" in connect(cluster.nodes[1], a)  # the node is up, nothing listens


@needs_netns
def test_a_killed_node_loses_at_once_the_processes_it_forks_while_it_dies(cluster: Cluster) -> None:
    """Through the node's cgroup: one by one, a listing misses what forks after it, and a process may see
    another die first (srun then aborts the job step on every node)."""
    if netns._cgroups() is None:
        pytest.skip("no cgroup v2 with cgroup.kill: a node's processes are killed one by one")
    a = cluster.nodes[0]
    forker = cluster.spawn(a, ["sh", "-c", "while :; do sleep 30 & sleep 0.002; done"])  # a 30 s child every 2 ms
    time.sleep(0.3)
    assert forker.pid in cluster.kill(a, timeout_s=5)
    assert cluster.pids(a) == [] and forker.poll() == -9


@needs_netns
def test_a_spawned_process_is_inside_its_node_when_spawn_returns() -> None:
    """``ip netns exec`` enters the namespace after its own start: spawn waits for it, or a pause or
    kill of the node right after could miss the process."""
    with Cluster(1) as c:
        node = c.nodes[0]
        procs = [c.spawn(node, ["sleep", "60"]) for _ in range(20)]
        inside = c.pids(node)
        assert all(p.pid in inside for p in procs), ([p.pid for p in procs], inside)
        assert sorted(c.kill(node)) == sorted(inside) and all(p.poll() == -9 for p in procs)


@needs_netns
def test_the_cluster_removes_what_it_made_also_when_the_test_fails() -> None:
    with pytest.raises(RuntimeError, match="a test failing"):
        with Cluster(2) as c:
            sleeper = c.spawn(c.nodes[1], ["sleep", "60"])
            with c.unplugged(c.nodes[0]):
                raise RuntimeError("a test failing")
    assert not [
        n
        for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        if n.startswith(c.name + "-")
    ]
    assert sleeper.poll() == -9


@needs_netns
def test_namespaces_of_a_test_process_that_died_are_removed_by_the_next_cluster() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = f"{netns.PREFIX}{dead.pid}x1-n0"
    subprocess.run(["ip", "netns", "add", orphan], check=True)
    start = time.monotonic()
    with Cluster(1):
        assert orphan not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert time.monotonic() - start < 30


@needs_netns
def test_latency_delays_new_connections_both_ways_and_ends_with_its_block(cluster: Cluster) -> None:
    a, b, _ = cluster.nodes
    echo = cluster.spawn(b, [sys.executable, "-c", ECHO, b.address, str(PORT + 2)], stdout=subprocess.PIPE, text=True)
    assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
    round_trip = lambda: float(in_ns(a, ROUND_TRIP, b.address, PORT + 2))  # noqa: E731
    before = round_trip()
    with cluster.delayed(50):
        during = [round_trip() for _ in range(3)]
        assert connect(b, a) == "connected"  # the other way too, through b's own relay
    after = round_trip()
    print(
        f"request-reply: {before * 1000:.1f} ms, with 50 ms each way {[round(d * 1000, 1) for d in during]} ms, "
        f"then {after * 1000:.1f} ms"
    )
    assert all(0.100 <= d < 0.100 + 0.5 for d in during), during
    assert before < 0.05 and after < 0.05
