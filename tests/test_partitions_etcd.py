"""The network-namespace cluster's etcd cases (see test_partitions.py): a member on each of three
nodes, and the coordinator leader's node or an etcd member cut off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SINGLES, THREE, Run, assert_all_rejoined, assert_same_trajectory, needs_etcd
from test_netns import needs_netns
from test_partitions import rejoined

from titan_recover.config import Recover
from titan_recover.control.etcd_store import REQUEST_S
from titan_recover.tools.clusters import partitions
from titan_recover.tools.clusters.netns import Cluster

LEASE_S = Recover.leader_lease_s  # the coordinator leader's lease on etcd (the scenarios keep the default)


@pytest.fixture
def three() -> Iterator[Cluster]:
    """The etcd cases' cluster: an etcd member on each node (the scenario starts and stops them)."""
    with Cluster(partitions.ETCD_NODES) as c:
        yield c


@needs_netns
@needs_etcd
def test_the_coordinator_leaders_node_cut_off_past_its_lease_is_replaced_and_writes_nothing_more(
    tmp_path: Path, three: Cluster, two_singles: Run
) -> None:
    """On etcd, a member on each of three nodes, replica group i and a coordinator candidate on node i
    (0, 1). After step 2 the node of the coordinator leader is cut off for 8 s, past its lease (3 s;
    etcd's Raft leader was moved to node 2 first). The candidate on the other node takes over within the
    lease plus its campaign, fences the cut-off group and readmits it once its node is back. The old leader
    logs no coordinator event from the takeover on (its writes are guarded by the lease it lost), it
    finds its leadership lost after the reconnection, and every step is logged exactly once."""
    outcome = partitions.leader_cut_off(three, tmp_path / "dump", *SINGLES)
    print(outcome.timings)
    old, new = int(outcome.timings["leader_node"]), int(outcome.timings["new_leader_node"])
    assert {old, new} == {0, 1}, outcome.timings
    # the lease, then the new leader's first request: its store is new, and tries the first member of the
    # URL first (node 0's), up to etcd_store.REQUEST_S when that is the node cut off
    assert outcome.timings["takeover_s"] < LEASE_S + REQUEST_S + 2, outcome.timings
    assert outcome.timings["old_leader_writes"] == 0
    run = rejoined(outcome, two_singles)  # every step once, M = 4, failure-free data and losses
    assert len(run.of("leader")) == 2, run.of("leader")
    [failure] = run.of("failure")
    assert failure["replica"] == old, failure  # group i on node i
    assert "no longer the leader" in outcome.outputs[old], outcome.outputs[old][-3000:]


@needs_netns
@needs_etcd
def test_an_etcd_member_cut_off_and_back_is_invisible_to_the_run(
    tmp_path: Path, three: Cluster, two_singles: Run
) -> None:
    """On etcd, a member on each of three nodes, the launchers on nodes 0 and 1: node 2's member, moved to
    lead Raft, is cut off for 8 s after step 2 and reconnected mid-run. The other two elect a leader and the
    run sees nothing: no failure, no fence, the same coordinator leader, both groups throughout, the
    failure-free data and losses; node 2's member serves again after the reconnection."""
    outcome = partitions.etcd_member_cut_off(three, tmp_path / "dump", *SINGLES)
    print(outcome.timings)
    run = rejoined(outcome, two_singles)
    assert not run.of("failure") and not run.of("recovered"), run.of("failure")
    assert all(e["members"] == [0, 1] for e in run.of("step"))
    assert len(run.of("leader")) == 1, run.of("leader")


@needs_netns
@needs_etcd
def test_on_an_etcd_the_nodes_form_themselves_node_0_killed_whole_is_a_group_failure_like_any_other(
    tmp_path: Path, three: Cluster, three_replicas: Run
) -> None:
    """``control_store = "nodes://<the 3 nodes>"``: each launcher runs an etcd member and a coordinator candidate
    beside replica group i (three single-rank groups), and nobody runs etcd beforehand. After step 3 node 0,
    the node that began the run, is SIGKILLed whole, its member and candidate with it, and never comes back: the
    two members left keep quorum, a candidate on nodes 1 or 2 leads (taking over if node 0's led), replica 0's
    loss is a group failure like any other, and the run ends normally on the two other nodes, every step once,
    M = 6 every step, on the failure-free data and losses."""
    outcome = partitions.self_formed_node0_killed(three, tmp_path / "dump", *THREE)
    print(outcome.timings)
    assert outcome.exits == [0, 0], [out[-3000:] for out in outcome.outputs]
    run = Run(0, outcome.outputs[0], outcome.events)
    assert_same_trajectory(three_replicas, run, 1e-3, num_microbatches=6)
    [failure] = run.of("failure")
    assert failure["replica"] == 0, failure
    assert all(e["members"] == [1, 2] for e in run.of("step") if e["step"] > 4), run.of("step")
    assert not run.of("requeued") and "etcd member m1 of nodes://" in outcome.outputs[0]
    # the run finished on nodes 1 and 2: their members' data went with them; node 0's, killed, stays
    assert [p.name for p in (tmp_path / "tmp" / "titan_recover-etcd").glob("*/*/m*")] == ["m0"]
    # the summary, once, by the node whose candidate led last (the first node, which began the run, is gone)
    assert sum(out.count("titan_recover summary") for out in outcome.outputs) == 1, outcome.outputs


@needs_netns
@needs_etcd
def test_on_an_etcd_the_nodes_form_themselves_a_member_node_cut_off_and_back_is_fenced_and_rejoins(
    tmp_path: Path, three: Cluster, three_replicas: Run
) -> None:
    """``control_store = "nodes://<the 3 nodes>"``: node 2 (its etcd member, its coordinator candidate and replica
    group 2) cut off for 8 s after step 2, then back. The two other members keep quorum, so the run goes on:
    replica 2 is fenced on its silent heartbeat, and once its node is back (its member catching up from the
    others) its launcher restarts it and it rejoins; every node ends with exit 0, every step once, M = 6 every
    step, on the failure-free data and losses, all three groups equal at the end."""
    outcome = partitions.self_formed_member_cut_off(three, tmp_path / "dump", *THREE)
    print(outcome.timings)
    assert outcome.exits == [0, 0, 0], [out[-3000:] for out in outcome.outputs]
    run = Run(0, outcome.outputs[0], outcome.events)
    assert_same_trajectory(three_replicas, run, 1e-3, num_microbatches=6)
    [failure] = run.of("failure")
    [back] = run.of("rejoined")
    assert (failure["replica"], back["replica"]) == (2, 2), (failure, back)
    assert_all_rejoined(run, 3, 6)
