"""The job on a cluster of network namespaces (titan_recover.tools.netns): each node's launcher in a
namespace of its own with a real address, the coordinator bound to its node's address, and faults
of the network rather than of processes. Checked against the failure-free run on one host."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from titan_recover.control import keys
from titan_recover.tools.netns import Cluster, Node

from conftest import CONFIG, ROOT, TINY, Run, assert_all_rejoined, assert_same_trajectory
from test_netns import needs_netns
from test_nodes import events, wait_until

PORT = 29510  # every node has its own port space: a fixed port, as on a real cluster
HOLD = "sleep replica=0 step=5 phase=optimizer seconds=120 until=epoch"  # replica 0 waits for replica 1's admission


class Launcher:
    """One node's launcher, started inside its namespace; its output goes to ``<name>.log``."""

    def __init__(self, cluster: Cluster, node: Node, dump: Path, args: list[str], env: dict[str, str],
                 name: str = "") -> None:
        self.log = dump.parent / f"{name or f'node{node.index}'}.log"
        self.proc = cluster.spawn(node, args, cwd=ROOT, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text()


def launcher_args(dump: Path, coordinator: Node, plan: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "titan_recover.launch", "--job.config_file", str(CONFIG), "--job.dump_folder", str(dump),
        *TINY, "--recover.fault_plan", plan, "--recover.coordinator_port", str(PORT),
        "--recover.coordinator_bind", coordinator.address, *extra,
    ]


def node_envs(cluster: Cluster) -> list[dict[str, str]]:
    """Replica group i on node i; node 0 starts the coordinator, the others dial its address."""
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env.update({keys.SECRET_ENV: "partition-test-secret", "PYTHONUNBUFFERED": "1"})
    coordinator = f"{cluster.nodes[0].address}:{PORT}"
    return [{**env, keys.REPLICAS_ENV: str(n.index), **({keys.COORDINATOR_ENV: coordinator} if n.index else {})}
            for n in cluster.nodes]


@contextlib.contextmanager
def two_nodes(cluster: Cluster, dump: Path, args: list[str]) -> Iterator[list[Launcher]]:
    """Node 0's and node 1's launchers; the output of one still running at the end is shown (the
    cluster's teardown kills it)."""
    env0, env1 = node_envs(cluster)
    launchers = [Launcher(cluster, cluster.nodes[0], dump, args, env0), Launcher(cluster, cluster.nodes[1], dump, args, env1)]
    try:
        yield launchers
    finally:
        for launcher in launchers:
            if launcher.proc.poll() is None:
                print(f"--- {launcher.log.name}, still running\n{launcher.output()[-3000:]}")


def rejoined(dump: Path, launchers: list[Launcher], failure_free: Run) -> Run:
    """Waits for replica 1's rejoin and both launchers' exit 0; the run has the failure-free trajectory
    and ends with both groups holding equal parameters."""
    wait_until("replica 1 rejoined", lambda: any(e["event"] == "rejoined" for e in events(dump)), 240, launchers)
    for launcher in launchers:
        assert launcher.proc.wait(timeout=120) == 0, launcher.output()[-3000:]
    run = Run(0, launchers[0].output(), events(dump))
    assert_same_trajectory(failure_free, run, 1e-3, num_microbatches=4)
    assert_all_rejoined(run, 2, 6)
    return run


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with Cluster(2) as c:
        yield c


def steps(dump: Path) -> list[int]:
    return [e["step"] for e in events(dump) if e["event"] == "step"]


@needs_netns
def test_a_node_cut_off_past_the_heartbeat_timeout_is_fenced_and_its_group_comes_back(
    tmp_path: Path, cluster: Cluster, failure_free: Run
) -> None:
    """Two nodes on their own addresses, replica group i (FSDP 2) on node i, the coordinator on node 0
    bound to 198.18.0.1. After step 2 node 1's cable is pulled for 8 s (heartbeat_timeout_s is 5):
    replica 1 is fenced and replica 0 goes on alone, then holds step 5 until an epoch admits again.
    Reconnected, node 1's launcher (the same process: it never stopped) learns its group was fenced,
    restarts it, and it rejoins by state transfer over the network. Every step once, M microbatches,
    the failure-free data and losses, equal parameter digests at the end."""
    dump = tmp_path / "dump"
    args = launcher_args(dump, cluster.nodes[0], HOLD, "--recover.collective_timeout_s", "60")
    with two_nodes(cluster, dump, args) as launchers:
        wait_until("step 2", lambda: 2 in steps(dump), 240, launchers)
        with cluster.unplugged(cluster.nodes[1]):
            cut = time.monotonic()
            wait_until("replica 1 fenced", lambda: any(e["event"] == "failure" for e in events(dump)), 30, launchers)
            print(f"replica 1 fenced {time.monotonic() - cut:.1f}s after the cut")
            time.sleep(max(0.0, 8 - (time.monotonic() - cut)))
        back = time.time()
        run = rejoined(dump, launchers, failure_free)
        print(f"replica 1 rejoined {run.of('rejoined')[0]['time'] - back:.1f}s after node 1 was reconnected")
    [failure] = run.of("failure")
    assert failure["replica"] == 1 and failure["step"] == 3, failure
    [back_at] = [e["step"] for e in run.of("rejoined")]
    for s, e in run.steps().items():  # both, replica 0 alone, both again
        assert e["members"] == ([0] if 3 <= s < back_at else [0, 1]), (s, e)
    assert "killed local rank 0 of fenced replica 1 (attempt 0" in launchers[1].output()
    for launcher in launchers:  # torchrun's own report of the ranks its launcher killed, and nothing else
        out = launcher.output()
        assert out.count("Traceback") == out.count("multiprocessing.errors.ChildFailedError:"), out[-3000:]


@needs_netns
def test_the_coordinators_node_cut_off_stops_the_other_node_and_its_own_side_goes_on(
    tmp_path: Path, cluster: Cluster, failure_free: Run
) -> None:
    """On the TCPStore the coordinator's node is the run: node 0 (coordinator, replica 0) cut off for
    good after step 2. Node 1 (replica 1) stops within coordinator_timeout_s (10 s) of the cut with the
    one line saying how to resume (exit 3), its ranks gone with it; node 0 fences replica 1 and finishes
    alone with the failure-free data and losses."""
    dump = tmp_path / "dump"
    plan = "sleep replica=0 step=3 phase=optimizer seconds=20"  # step 3 not committed before the cut
    args = launcher_args(dump, cluster.nodes[0], plan, "--recover.coordinator_timeout_s", "10", "--recover.max_restarts", "0")
    with two_nodes(cluster, dump, args) as launchers:
        wait_until("step 2", lambda: 2 in steps(dump), 240, launchers)
        with cluster.unplugged(cluster.nodes[0]):
            cut = time.monotonic()
            assert launchers[1].proc.wait(timeout=40) == 3, launchers[1].output()[-3000:]
            stopped = time.monotonic() - cut
            print(f"node 1 stopped {stopped:.1f}s after the coordinator's node was cut off")
            assert stopped < 10 + 5
            assert not cluster.pids(cluster.nodes[1])  # no rank of node 1 lives on
            assert launchers[0].proc.wait(timeout=120) == 0, launchers[0].output()[-3000:]
    out = launchers[1].output()
    assert f"lost the titan_recover coordinator: no sign of life from the coordinator at {cluster.nodes[0].address}:{PORT}" in out, out[-3000:]
    run = Run(0, launchers[0].output(), events(dump))
    [failure] = run.of("failure")
    assert failure["replica"] == 1 and failure["step"] == 3, failure
    assert {s: e["members"] for s, e in run.steps().items()} == {1: [0, 1], 2: [0, 1], 3: [0], 4: [0], 5: [0], 6: [0]}
    assert_same_trajectory(failure_free, run, 1e-3, num_microbatches=4)


@needs_netns
def test_a_paused_node_loses_only_its_own_groups(tmp_path: Path, cluster: Cluster, failure_free: Run) -> None:
    """Every process of node 1 (its launcher, torchrun agent, ranks) SIGSTOPped for 2 x
    coordinator_timeout_s (20 s) after step 2, as a frozen VM: replica 1 is fenced and replica 0 goes on.
    Resumed, node 1's launcher sees it was the one paused, judges the coordinator on fresh readings
    (alive) instead of stopping, finds its group fenced, restarts it, and it rejoins."""
    dump = tmp_path / "dump"
    args = launcher_args(dump, cluster.nodes[0], HOLD, "--recover.coordinator_timeout_s", "10",
                         "--recover.collective_timeout_s", "60")
    with two_nodes(cluster, dump, args) as launchers:
        wait_until("step 2", lambda: 2 in steps(dump), 240, launchers)
        with cluster.paused(cluster.nodes[1]):
            wait_until("replica 1 fenced", lambda: any(e["event"] == "failure" for e in events(dump)), 30, launchers[:1])
            time.sleep(20)
        run = rejoined(dump, launchers, failure_free)
    [failure] = run.of("failure")
    assert failure["replica"] == 1 and failure["step"] == 3, failure
    assert "did not run for" in launchers[1].output()  # it knows it was the one paused


@needs_netns
def test_a_replaced_node_running_the_same_command_takes_its_group_back(
    tmp_path: Path, cluster: Cluster, failure_free: Run
) -> None:
    """Node 1 replaced, as a new pod: every process of its namespace SIGKILLed after step 2, then the
    same command started again there. It takes the dead launcher's claim over once that launcher's
    node message has been silent for heartbeat_timeout_s, starts replica 1 as incarnation 1, and the
    group rejoins by state transfer; replica 0 holds step 5 until that admission."""
    dump = tmp_path / "dump"
    args = launcher_args(dump, cluster.nodes[0], HOLD, "--recover.collective_timeout_s", "60")
    with two_nodes(cluster, dump, args) as launchers:
        wait_until("step 2", lambda: 2 in steps(dump), 240, launchers)
        assert launchers[1].proc.pid in cluster.kill(cluster.nodes[1])
        launchers[1] = Launcher(cluster, cluster.nodes[1], dump, args, node_envs(cluster)[1], name="node1-again")
        run = rejoined(dump, launchers, failure_free)
    assert [e["replica"] for e in run.of("failure")] == [1]
    [admitted] = run.of("admitted")
    assert admitted["replica"] == 1 and admitted["attempt"] == 1  # the store's incarnation count, not 0 again
    assert "took over replica groups [1] from the launcher on host" in launchers[1].output()


@needs_netns
def test_latency_and_loss_between_nodes_cost_time_not_correctness(
    tmp_path: Path, cluster: Cluster, failure_free: Run
) -> None:
    """50 ms more each way on every connection between the two nodes and 1% of their packets lost,
    from before the launchers start: the run completes with the failure-free data and losses, every
    step once, equal parameter digests; the step time it costs is bench/partitions.py's to measure."""
    dump = tmp_path / "dump"
    args = launcher_args(dump, cluster.nodes[0], "none")
    with cluster.delayed(50), cluster.dropping(cluster.nodes[1], percent=1), two_nodes(cluster, dump, args) as launchers:
        for launcher in launchers:
            assert launcher.proc.wait(timeout=400) == 0, launcher.output()[-3000:]
    run = Run(0, launchers[0].output(), events(dump))
    assert_same_trajectory(failure_free, run, 1e-3, num_microbatches=4)
    assert_all_rejoined(run, 2, 6)
    assert not run.of("failure")
    print(f"mean step time with 50 ms and 1% loss: {[round(e['time'] - p['time'], 2) for p, e in zip(run.of('step'), run.of('step')[1:])]}")
