"""A rack lost whole while the replica groups span racks: the run resumes from the other rack's memory.

Four launchers on this host stand for four nodes in two racks (``TITAN_RECOVER_FAILURE_DOMAIN``), each group of two
ranks spanning two of them with its parts crossed: group 0 runs part 0 (shard 0) in rack b and part 1 in rack a,
group 1 part 0 in rack a and part 1 in rack b, so each shard has a copy in each rack. The coordinator runs with
rack b's first launcher. Rack a's two launchers are SIGKILLed with every process under them in step 8 (snapshots
every 3 steps), then started again, as repaired or replacement nodes with empty memory: no group holds step 6 whole,
group 0's node in rack b holds shard 0 and group 1's holds shard 1. Each rank there loads its shard and sends it to
the same rank of the other group; no checkpoint exists (DCP off). The first time, group 0's rank in rack b is
SIGKILLed as it sends shard 0 (a donor lost mid-resume): both groups fail again in the step after the resumed one,
and the run resumes again from the same copies. It ends on its failure-free twin's bits."""

import contextlib
import os
import signal
import sys
from pathlib import Path

from conftest import Node, Run, descendants, events
from test_host_memory import JOB, STEPS, twin  # noqa: F401 (a fixture of this file too)

from titan_recover.compare import compare_runs
from titan_recover.control import keys, transport
from titan_recover.observability.events import undo_resumed
from titan_recover.titan.jobs import job
from titan_recover.tools.clusters.partitions import wait_until

HELD = "sleep replica=0 step=8 phase=forward seconds=120 until=epoch"  # step 8 is in flight when rack a goes
DONOR_LOST = "kill replica=0 rank=0 step=6 phase=donate attempt=1"  # the first resume's donor of shard 0


def kill_rack(*nodes: Node) -> None:
    """SIGKILL to every process of the nodes at once, as a rack's power going: launchers, agents and ranks (which
    torchrun starts in sessions of their own, out of the launcher's process group)."""
    pids = [pid for node in nodes for pid in descendants(node.proc.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for node in nodes:
        node.proc.wait()


def test_a_rack_lost_whole_resumes_from_the_other_racks_memory_with_no_group_holding_a_step_whole(
    tmp_path: Path,
    twin: Run,  # noqa: F811 (the fixture imported above)
) -> None:
    dump, memory, port = tmp_path / "dump", tmp_path / "memory", transport.free_port()
    memory.mkdir()
    args = [
        sys.executable,
        "-m",
        "titan_recover.launch",
        *job(dump, tiny=True),
        *JOB,
        "--recover.group_nodes",
        "2",
        "--recover.fault_plan",
        f"{HELD}; {DONOR_LOST}",
        "--recover.snapshot_dir",
        str(memory),
        "--recover.coordinator_port",
        str(port),
        "--recover.coordinator_bind",
        "127.0.0.1",
    ]
    env = {**os.environ, keys.SECRET_ENV: "racks-test-secret", "PYTHONUNBUFFERED": "1"}
    joins = {keys.COORDINATOR_ENV: f"127.0.0.1:{port}"}

    def node(replica: int, part: int, rack: str, first: bool = False) -> dict[str, str]:
        where = {keys.REPLICAS_ENV: str(replica), keys.GROUP_NODE_ENV: str(part), keys.FAILURE_DOMAIN_ENV: rack}
        return {**env, **where, **({} if first else joins)}

    b0, a1, a0, b1 = node(0, 0, "rack-b", first=True), node(0, 1, "rack-a"), node(1, 0, "rack-a"), node(1, 1, "rack-b")
    logged = lambda kind: [e for e in events(dump) if e["event"] == kind]  # noqa: E731
    with (
        Node("b-g0p0", dump, args, b0) as coordinator_node,
        Node("b-g1p1", dump, args, b1) as other_b,
        Node("a-g0p1", dump, args, a1) as g0_a,
        Node("a-g1p0", dump, args, a0) as g1_a,
    ):
        wait_until("step 7", lambda: any(e["step"] >= 7 for e in logged("step")), 300, [coordinator_node, g0_a])
        kill_rack(g0_a, g1_a)
        wait_until("every group's state lost", lambda: bool(logged("state_lost")), 120, [coordinator_node])
        with Node("a-g0p1-again", dump, args, a1) as g0_again, Node("a-g1p0-again", dump, args, a0) as g1_again:
            for launcher in (coordinator_node, other_b, g0_again, g1_again):
                assert launcher.wait(timeout=300) == 0, launcher.output()[-4000:]
    run = Run(0, coordinator_node.output(), events(dump))
    assert [(e["step"], e["groups"]) for e in run.of("state_lost")] == [(8, [0, 1]), (7, [0, 1])]
    for resuming in run.of("resuming"):  # no group holds step 6 whole: each lends the other the shard it kept
        assert resuming["step"] == 6 and resuming["whole"] == [] and resuming["holders"] == {"0": [0], "1": [1]}
    assert len(run.of("resuming")) == 2 and [e["step"] for e in run.of("resumed")] == [7]
    kept, _ = undo_resumed(run.events)
    assert sorted(e["step"] for e in kept if e["event"] == "step") == list(range(1, STEPS + 1))
    result = compare_runs(twin.events, run.events, rel_tol=0.0, exact=True)
    assert not result.problems, result.problems
    assert result.steps == STEPS and result.digest_steps == STEPS
    assert "one failure domain" not in coordinator_node.output()  # every shard has a copy in each rack
    for again in (g0_again, g1_again):  # each restarted rank took its shard from the other group's rank in rack b
        assert "of state for step 6" in again.output(), again.output()[-3000:]
    assert not list(dump.glob("checkpoint*/step-*")), "a DCP checkpoint was written"
    assert not os.listdir(memory), os.listdir(memory)
