"""The job on a cluster of network namespaces (titan_recover.tools.clusters.netns): each node's launcher in a
namespace of its own with a real address, the coordinator bound to its node's address, and faults
of the network rather than of processes. The scenarios are titan_recover.tools.clusters.partitions's
(bench.partitions measures them); here each is asserted on, against the failure-free run on one host.
The etcd cases are in test_partitions_etcd.py (a file per worker's share: pytest-xdist hands out whole files)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SINGLES, Run, assert_all_rejoined, assert_same_trajectory, unexplained_tracebacks
from test_netns import needs_netns

from titan_recover.tools.clusters import partitions
from titan_recover.tools.clusters.netns import Cluster
from titan_recover.tools.clusters.partitions import PORT, Outcome


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with Cluster(2) as c:
        yield c


def as_run(outcome: Outcome, reference: Run) -> Run:
    """The outcome as a run of node 0 (every step logged once: ``Run.steps``), with the failure-free
    data, M microbatches and losses within 1e-3. The scenarios run single-rank groups (``SINGLES``):
    their faults are the network's, between groups."""
    run = Run(outcome.exits[0] or 0, outcome.outputs[0], outcome.events)
    assert outcome.exits[0] == 0, outcome.outputs[0][-3000:]
    assert_same_trajectory(reference, run, 1e-3, num_microbatches=4)
    return run


def rejoined(outcome: Outcome, reference: Run) -> Run:
    """Both nodes ended with exit 0, and both groups with equal parameters after replica 1's return."""
    assert outcome.exits == [0, 0], [out[-3000:] for out in outcome.outputs]
    run = as_run(outcome, reference)
    assert_all_rejoined(run, 2, 10)
    return run


@needs_netns
def test_a_node_cut_off_past_the_heartbeat_timeout_is_fenced_and_its_group_comes_back(
    tmp_path: Path, cluster: Cluster, two_singles: Run
) -> None:
    """Two nodes on their own addresses, replica group i (one rank) on node i, the coordinator on node 0
    bound to 198.18.0.1. After step 2 node 1's cable is pulled for 8 s (heartbeat_timeout_s is 5):
    replica 1 is fenced and replica 0 goes on alone, then holds step 5 until an epoch admits again.
    Reconnected, node 1's launcher (the same process: it never stopped) learns its group was fenced,
    restarts it, and it rejoins by state transfer over the network. All of it with 50 ms more each way on
    every connection between the nodes and 1% of their packets lost, from before the launchers start:
    latency and loss cost time, not correctness (no other failure, the failure-free data and losses);
    bench.partitions measures what they cost."""
    with cluster.delayed(50), cluster.dropping(cluster.nodes[1], percent=1):
        outcome = partitions.cut_off(cluster, tmp_path / "dump", *SINGLES)
    print(outcome.timings)
    run = rejoined(outcome, two_singles)
    [failure] = run.of("failure")
    assert failure["replica"] == 1 and failure["step"] == 3, failure
    [back_at] = [e["step"] for e in run.of("rejoined")]
    for s, e in run.steps().items():  # both, replica 0 alone, both again
        assert e["members"] == ([0] if 3 <= s < back_at else [0, 1]), (s, e)
    assert "killed local rank 0 of fenced replica 1 (attempt 0" in outcome.outputs[1]
    for out in outcome.outputs:  # torchrun's own report of the ranks its launcher killed, and nothing else
        assert not (extra := unexplained_tracebacks(out, "multiprocessing.errors.ChildFailedError:")), extra


@needs_netns
def test_the_coordinators_node_cut_off_stops_the_other_node_and_its_own_side_goes_on(
    tmp_path: Path, cluster: Cluster, two_singles: Run
) -> None:
    """On the TCPStore the coordinator's node is the run: node 0 (coordinator, replica 0) cut off for
    good after step 2. Node 1 (replica 1) stops within coordinator_timeout_s (10 s) of the cut with the
    one line saying how to resume (exit 3), its ranks gone with it; node 0 fences replica 1 and finishes
    alone with the failure-free data and losses."""
    outcome = partitions.coordinator_cut_off(cluster, tmp_path / "dump", *SINGLES)
    print(outcome.timings)
    assert outcome.exits[1] == 3, outcome.outputs[1][-3000:]
    assert outcome.timings["other_node_stopped_s"] < partitions.TIMEOUT_S + 5
    assert outcome.timings["processes_left_on_node_1"] == 0
    assert (
        f"lost the titan_recover coordinator: no sign of life from the coordinator at {cluster.nodes[0].address}:{PORT}"
    ) in outcome.outputs[1], outcome.outputs[1][-3000:]
    run = as_run(outcome, two_singles)
    [failure] = run.of("failure")
    assert failure["replica"] == 1 and failure["step"] == 3, failure
    assert {s: e["members"] for s, e in run.steps().items()} == {s: [0, 1] if s < 3 else [0] for s in range(1, 11)}


@needs_netns
def test_a_paused_node_loses_only_its_own_groups(tmp_path: Path, cluster: Cluster, two_singles: Run) -> None:
    """Every process of node 1 (its launcher, torchrun agent, ranks) SIGSTOPped for 2 x
    coordinator_timeout_s (20 s) after step 2, as a frozen VM: replica 1 is fenced and replica 0 goes on.
    Resumed, node 1's launcher sees it was the one paused, judges the coordinator on fresh readings
    (alive) instead of stopping, finds its group fenced, restarts it, and it rejoins."""
    outcome = partitions.paused(cluster, tmp_path / "dump", *SINGLES)
    print(outcome.timings)
    run = rejoined(outcome, two_singles)
    [failure] = run.of("failure")
    assert failure["replica"] == 1 and failure["step"] == 3, failure
    assert "did not run for" in outcome.outputs[1]  # it knows it was the one paused


@needs_netns
def test_a_replaced_node_running_the_same_command_takes_its_group_back(
    tmp_path: Path, cluster: Cluster, two_singles: Run
) -> None:
    """Node 1 replaced, as a new pod: every process of its namespace SIGKILLed after step 2, then the
    same command started again there. It takes the dead launcher's claim over once that launcher's
    node message has been silent for heartbeat_timeout_s, starts replica 1 as incarnation 1, and the
    group rejoins by state transfer; replica 0 holds step 5 until that admission."""
    outcome = partitions.replaced(cluster, tmp_path / "dump", *SINGLES)
    print(outcome.timings)
    run = rejoined(outcome, two_singles)
    assert [e["replica"] for e in run.of("failure")] == [1]
    [admitted] = run.of("admitted")
    assert admitted["replica"] == 1 and admitted["attempt"] == 1  # the store's incarnation count, not 0 again
    assert "took over replica groups [1] from the launcher on host" in outcome.outputs[1]
