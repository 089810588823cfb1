"""The network-namespace cluster's etcd cases (see test_partitions.py): a member on each of three
nodes, and the coordinator leader's node or an etcd member cut off; the etcd the run forms on its own
nodes, a member's node cut off, and a member's node replaced. The members' nodes lost one after another are
test_slurm.py's four-node case (and bench/self_formed.py's five-node run)."""

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


@needs_netns
@needs_etcd
def test_on_an_etcd_the_nodes_form_themselves_a_member_node_replaced_by_a_new_one_comes_back_as_a_new_member(
    tmp_path: Path, three: Cluster, three_replicas: Run
) -> None:
    """``control_store = "nodes://<the 3 nodes>"``: node 0 (the node that began the run) SIGKILLed whole while every
    group holds step 2, its member's data removed, and the same command started on it at once, as a scheduler
    replacing a node or a pod does. Its launcher does not start m0 empty (etcd would take it for m0 with its data
    lost): it volunteers, node 1's keeper removes m0 once it is silent for 5 s and adds node 0 as m3, and node 0's
    group rejoins. Node 1 then lost whole leaves m2 and m3 of three, a quorum. Nodes 0 and 2 end the run with exit
    0, every step once, M = 6 every step, on the failure-free data and losses."""
    outcome = partitions.member_node_replaced(three, tmp_path / "dump", *THREE)
    print(outcome.timings)
    assert outcome.exits == [0, 0], [out[-3000:] for out in outcome.outputs]
    run = Run(0, outcome.outputs[0], outcome.events)
    assert_same_trajectory(three_replicas, run, 1e-3, num_microbatches=6)
    assert sorted(f["replica"] for f in run.of("failure")) == [0, 1], run.of("failure")
    assert [e["replica"] for e in run.of("rejoined")] == [0], run.of("rejoined")
    last = run.steps()[max(run.steps())]  # each node writes its own file: the files' order is not the steps'
    assert last["members"] == [0, 2], last
    assert "ran on this node before" in outcome.outputs[0] and "volunteers" in outcome.outputs[0], outcome.outputs[0]
