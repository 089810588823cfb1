"""Elastic runs: a node told it goes away (SIGTERM to its launcher, or to every process of the node) takes its
replica groups out at a step boundary, and the others go on with every step's M microbatches; a notice too
short for the step falls back to in-step recovery at once. Two launchers on one host stand for two nodes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    EXACT_EVERY_STEP,
    ROOT,
    SINGLES,
    Node,
    Run,
    assert_all_rejoined,
    assert_same_trajectory,
    events,
    fired,
    on_nodes,
    unexplained_tracebacks,
)
from launcher_in_process import run_main

from titan_recover.control import keys
from titan_recover.control.keys import EXIT_LEFT, EXIT_STOPPED
from titan_recover.control.protocol import Drain, Launcher, MessageError
from titan_recover.drain import DrainError, on_node, parse_ids, plan
from titan_recover.drain import main as drain_main
from titan_recover.tools.clusters.partitions import wait_until

LAST = 10  # SINGLES' steps
# replica 1 holds step 4 (inside its backward) long enough for the notice to arrive while it is in the step
HOLD_STEP, HOLD_S = 4, 4


@pytest.mark.unit
def test_a_drain_names_members_only_and_leaves_one_at_least() -> None:
    assert parse_ids("1,3") == [1, 3]
    for bad in ("", "1,x", "1,1", "-1"):
        with pytest.raises(DrainError, match="--replicas"):
            parse_ids(bad)
    assert plan([1], (0, 1, 2), 4, {1: 2}) == {1: 2}  # the incarnation that runs now
    with pytest.raises(DrainError, match=r"replica group\(s\) \[5\] are not members of the run's epoch 4"):
        plan([1, 5], (0, 1, 2), 4, {})
    with pytest.raises(DrainError, match="would leave no replica group"):
        plan([0, 1], (0, 1), 4, {})


@pytest.mark.unit
def test_a_drain_by_node_takes_every_group_with_a_part_there() -> None:
    def on(host: str) -> Launcher:
        return Launcher(f"{host}:1:ab", host, 1)

    owners = {0: [on("n0")], 1: [on("n1")], 2: [on("n0"), on("n2")], 3: [on("n1")]}
    assert on_node("n1", owners, (0, 1, 2, 3)) == [1, 3]
    assert on_node("n2", owners, (0, 1, 2, 3)) == [2]  # a spanning group leaves whole
    with pytest.raises(DrainError, match=r"--node 'n1': no replica group of the run's members \[0, 2\] runs there"):
        on_node("n1", owners, (0, 2))


@pytest.mark.unit
def test_a_drain_record_is_checked_as_it_is_read() -> None:
    assert Drain.loads("drain/1", b'{"attempt": 2, "reason": "disk swap", "time": 5.0}') == Drain(2, "disk swap", 5.0)
    with pytest.raises(MessageError, match="attempt must be an integer >= 0"):
        Drain.loads("drain/1", b'{"attempt": -1, "reason": "x", "time": 5.0}')


def two_nodes(dump: Path, *overrides: str) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """The tests' tiny job on two launchers: A runs the coordinator and replica 0, B replica 1."""
    args, env, coordinator = on_nodes(dump, "elastic-test-secret", *SINGLES, *overrides)
    return args, {**env, keys.REPLICAS_ENV: "0"}, {**env, keys.REPLICAS_ENV: "1", keys.COORDINATOR_ENV: coordinator}


def steps(dump: Path) -> list[dict]:
    return [e for e in events(dump) if e["event"] == "step"]


BACK_STEP = 7  # replica 0 holds step 7 until node B is back (a new launcher, a cold start) and admitted
AGAIN_STEP = 9  # then node B's second launcher gets the other notice while replica 1 holds step 9


def run_with_notice(tmp_path: Path, *overrides: str, comes_back: bool = False) -> tuple[Run, list[Node], list[float]]:
    """Node B's launcher gets its notice while replica 1 is in step 4's backward (held there ``HOLD_S``): A's run,
    node B's launchers, and how long after each notice each exited. ``comes_back``: B's command is started again
    once it left, its group rejoins while replica 0 holds step 7, and then every process of that node gets its
    notice while replica 1 holds step 9."""
    dump = tmp_path / "dump"
    plan = f"sleep replica=1 step={HOLD_STEP} phase=backward seconds={HOLD_S}"
    if comes_back:
        plan += (
            f"; sleep replica=0 step={BACK_STEP} phase=optimizer seconds=120 until=epoch"
            f"; sleep replica=1 attempt=1 step={AGAIN_STEP} phase=backward seconds={HOLD_S}"  # node B's second
        )
    args, env_a, env_b = two_nodes(dump, "--recover.fault_plan", plan, *overrides)
    nodes: list[Node] = []
    gone: list[float] = []

    def leaves(node: Node, held: int, every_process: bool) -> None:
        wait_until(f"replica 1's hold in step {held}", lambda: (1, "backward") in fired(dump, held), 240, [a, node])
        sent = node.notice(every_process)
        code = node.wait(timeout=120)
        gone.append(time.monotonic() - sent)
        nodes.append(node)
        assert code == EXIT_LEFT, node.output()[-4000:]

    with Node("a", dump, args, env_a) as a, Node("b", dump, args, env_b) as b:
        leaves(b, HOLD_STEP, every_process=False)
        if comes_back:
            with Node("b2", dump, args, env_b) as b2:
                leaves(b2, AGAIN_STEP, every_process=True)
        assert a.wait(timeout=240) == 0, a.output()[-4000:]
    return Run(0, a.output(), events(dump)), nodes, gone


def test_a_node_told_it_goes_away_leaves_at_the_step_boundary_and_the_run_keeps_its_trajectory(
    tmp_path: Path, two_singles: Run
) -> None:
    """SIGTERM to node B's launcher (Kubernetes) while replica 1 is inside step 4: replica 1 finishes step 4 with
    replica 0, leaves before step 5 (nothing of it computed again: no failure, no retry, no detection), B's
    processes are gone within the notice budget by themselves (exit 4), and replica 0 goes on alone with every
    step's 4 microbatches and the failure-free twin's data. B's command started again brings its group back:
    admitted, its state from replica 0, no checkpoint. Then SIGTERM to every process of that node (Slurm:
    torchrun's agent and the rank too) while replica 1 is inside step 9: it leaves before step 10 the same way."""
    run, (b, b2), gone = run_with_notice(tmp_path, "--recover.digest_interval", "1", comes_back=True)
    print(f"node B gone {gone[0]:.1f}s after its launcher's notice, {gone[1]:.1f}s after every process's")
    assert [(e["replica"], e["step"]) for e in run.of("left")] == [(1, HOLD_STEP + 1), (1, AGAIN_STEP + 1)]
    for left in run.of("left"):
        assert left["notice_s"] is not None and 0 <= left["notice_s"] < 12, left
    assert not run.of("failure") and not run.of("recovered"), (run.of("failure"), run.of("recovered"))
    assert max(gone) < 12, gone  # recover.notice_budget_s: B's groups and B itself left by themselves
    [rejoined] = run.of("rejoined")
    back = rejoined["step"]
    assert rejoined["replica"] == 1 and rejoined["bytes"] > 0 and HOLD_STEP + 1 < back <= AGAIN_STEP, rejoined
    for s, e in run.steps().items():
        assert e["members"] == ([0, 1] if s <= HOLD_STEP or back <= s <= AGAIN_STEP else [0]), (s, e)
    for s in (HOLD_STEP, AGAIN_STEP):  # replica 1's work of the step it was told in counted, not redone
        assert run.steps()[s]["quotas"].get("1", 0) > 0, run.steps()[s]
    assert_same_trajectory(two_singles, run, rel_tol=1e-5, num_microbatches=4)
    assert_all_rejoined(run, 2, AGAIN_STEP)  # the same parameters on both once it was back
    for s in (HOLD_STEP, AGAIN_STEP):
        assert f"replica 1 left on notice before step {s + 1}" in run.output
    assert "left on notice       : 2" in run.output and "failures             : 0" in run.output
    for node in (b, b2):
        assert "this node left the run on notice: replica groups [1] at a step boundary" in node.output()
        assert "left the run on notice in" in node.output()
    assert "Traceback" not in run.output, run.output[-4000:]


def test_a_notice_shorter_than_the_step_falls_back_to_in_step_recovery_at_once(tmp_path: Path) -> None:
    """A notice budget of 1 s while replica 1 holds step 4 for 4 s: at the budget node B kills the group and
    reports it failed at once (no heartbeat timeout), replica 0 finishes step 4 in-step with all 4
    microbatches, and B still exits as a node that left."""
    run, [b], [gone_s] = run_with_notice(tmp_path, "--recover.notice_budget_s", "1")
    assert not run.of("left")
    [failure] = run.of("failure")
    assert failure["replica"] == 1 and failure["step"] == HOLD_STEP, failure
    assert "did not leave at a step boundary within recover.notice_budget_s" in failure["cause"], failure
    # failed by the budget (about 1 s after the notice, itself 1 s into the hold), not found after the hold
    assert failure["detected"] - failure["time"] < HOLD_S, failure
    assert gone_s < 1 + 5, gone_s
    assert all(len(e["microbatches"]) == 4 for e in run.of("step"))
    assert sorted(run.steps()) == list(range(1, LAST + 1))
    assert "failed at once" in b.output()


def checkpoint_keys(folder: Path) -> list[str]:
    """The state a DCP checkpoint holds, by key."""
    from torch.distributed.checkpoint import FileSystemReader

    return sorted(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def test_the_coordinators_node_told_it_goes_away_stops_the_run_in_order_and_the_same_commands_resume_it(
    tmp_path: Path, two_singles: Run
) -> None:
    """SIGTERM to every process of node A (Slurm), which runs the TCPStore coordinator and replica 0, while
    replica 1 is inside step 4: the run's store goes with A, so the coordinator stops the run in order. Both
    groups finish step 4 and stop at its boundary (no failure, no leave, nothing computed again), replica 0
    (the step's leader) saves a checkpoint of the whole state at step 4 although the interval is 100, and both
    launchers exit 5 by themselves within the notice budget, saying how to resume. The same two commands then
    resume from it: steps 5-10 run, and the two parts together have the failure-free twin's data and losses."""
    dump = tmp_path / "dump"
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "100"]
    plan = f"sleep replica=1 step={HOLD_STEP} phase=backward seconds={HOLD_S}"
    args, env_a, env_b = two_nodes(dump, "--recover.fault_plan", plan, *ckpt)
    with Node("a", dump, args, env_a) as a, Node("b", dump, args, env_b) as b:
        wait_until(
            f"replica 1's hold in step {HOLD_STEP}", lambda: (1, "backward") in fired(dump, HOLD_STEP), 240, [a, b]
        )
        sent = a.notice(every_process=True)
        code_a = a.wait(timeout=120)
        gone_s = time.monotonic() - sent
        code_b = b.wait(timeout=60)
    print(f"node A gone {gone_s:.1f}s after its notice")
    assert code_a == EXIT_STOPPED, a.output()[-4000:]
    assert code_b == EXIT_STOPPED, b.output()[-4000:]
    assert gone_s < 12, gone_s  # recover.notice_budget_s
    first = Run(code_a, a.output(), events(dump))
    assert sorted(first.steps()) == list(range(1, HOLD_STEP + 1))
    assert all(e["members"] == [0, 1] for e in first.of("step"))
    assert not first.of("failure") and not first.of("left") and not first.of("fatal")
    [stopping], [stopped] = first.of("stopping"), first.of("stopped")
    assert stopping["step"] == HOLD_STEP and stopped["step"] == HOLD_STEP, (stopping, stopped)
    saved = dump / "checkpoint" / f"step-{HOLD_STEP}"
    assert (saved / ".metadata").exists(), sorted(p.name for p in (dump / "checkpoint").iterdir())
    whole = checkpoint_keys(saved)
    assert any("exp_avg" in k for k in whole), whole  # the optimizer's state too, not the model only
    for node in (a, b):
        assert "stopped in order at a step boundary" in node.output(), node.output()[-3000:]
        assert "To resume, run the same command again" in node.output()
        # torchrun's agent, SIGTERMed on A, prints its own SignalException once its ranks stopped; nothing else
        said = node.output()
        assert not (extra := unexplained_tracebacks(said, "SignalException: Process")), extra
    with Node("a2", dump, args, env_a) as a2, Node("b2", dump, args, env_b) as b2:
        assert a2.wait(timeout=300) == 0, a2.output()[-4000:]
        assert b2.wait(timeout=60) == 0, b2.output()[-4000:]
    second = Run(0, a2.output(), events(dump))
    assert sorted(second.steps()) == list(range(HOLD_STEP + 1, LAST + 1))
    assert_same_trajectory(two_singles, Run(0, "", first.events + second.events), rel_tol=1e-5, num_microbatches=4)


def test_a_whole_job_notice_with_checkpoints_off_saves_the_stop_and_the_same_commands_lose_no_step(
    tmp_path: Path, two_singles: Run
) -> None:
    """SIGTERM to every process of both nodes at once (a whole-job preemption: each launcher's tree walked, ranks
    included), DCP checkpoints off, while replica 1 is inside step 4. The coordinator's node stops the run in
    order; the groups that read the stop save the state of step 4 to the stop folder, one copy per shard; node B
    may have taken its group out first (its own notice), which the save does not need. A exits 5, saying how to
    resume; no DCP checkpoint exists. The same two commands then resume from step 4's saved state: steps 5-10
    run, and the two parts together are the failure-free twin's data and losses."""
    dump = tmp_path / "dump"
    plan = f"sleep replica=1 step={HOLD_STEP} phase=backward seconds={HOLD_S}"
    args, env_a, env_b = two_nodes(dump, "--recover.fault_plan", plan)
    with Node("a", dump, args, env_a) as a, Node("b", dump, args, env_b) as b:
        wait_until(
            f"replica 1's hold in step {HOLD_STEP}", lambda: (1, "backward") in fired(dump, HOLD_STEP), 240, [a, b]
        )
        signalled = len(a.notice_tree()) + len(b.notice_tree())
        code_a, code_b = a.wait(timeout=120), b.wait(timeout=60)
    print(f"SIGTERM to {signalled} processes; exit codes {code_a}, {code_b}")
    assert code_a == EXIT_STOPPED, a.output()[-4000:]
    assert code_b in (EXIT_LEFT, EXIT_STOPPED), b.output()[-4000:]
    first = Run(code_a, a.output(), events(dump))
    assert sorted(first.steps()) == list(range(1, HOLD_STEP + 1))
    assert not first.of("failure") and not first.of("fatal"), first.of("failure")
    [stopped] = first.of("stopped")
    assert stopped["step"] == HOLD_STEP, stopped
    [saved] = first.of("stop_saved")  # one copy of the one shard
    assert saved["step"] == HOLD_STEP, saved
    assert not list((dump / "checkpoint").glob("step-*")), "checkpoints are off: no DCP save"
    assert "it resumes from the state saved at the stop" in a.output(), a.output()[-3000:]
    for node in (a, b):  # the rate of a save measured at start: 4.5 MiB fits 12 s
        assert "a whole-job notice's save of this shard's state fits recover.notice_budget_s" in node.output()
    assert not first.of("stop_save_short"), first.of("stop_save_short")
    with Node("a2", dump, args, env_a) as a2, Node("b2", dump, args, env_b) as b2:
        assert a2.wait(timeout=300) == 0, a2.output()[-4000:]
        assert b2.wait(timeout=60) == 0, b2.output()[-4000:]
    second = Run(0, a2.output(), events(dump))
    assert sorted(second.steps()) == list(range(HOLD_STEP + 1, LAST + 1)), second.output[-3000:]
    assert {e["replica"] for e in second.of("stop_resumed")} == {0, 1}, second.of("stop_resumed")
    assert not list((dump / "checkpoint" / "stop").rglob("*.snapshot")), "the run ended: the stop's state is spent"
    assert not (dump / "checkpoint").exists(), "checkpoints are off: the stop folder's parent goes with it"
    assert_same_trajectory(two_singles, Run(0, "", first.events + second.events), rel_tol=1e-5, num_microbatches=4)


def drain(env: dict[str, str], port: int, *args: str) -> subprocess.Popen:
    """``python -m titan_recover.drain`` against the run's coordinator, started (its output piped)."""
    return subprocess.Popen(
        [sys.executable, "-m", "titan_recover.drain", "--coordinator", f"127.0.0.1:{port}", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_group_joins_beyond_r_and_the_operator_drains_another_on_the_coordinators_node(
    tmp_path: Path, exact_single: Run, capfd: pytest.CaptureFixture[str]
) -> None:
    """``recover.max_replicas = 3`` on a run of R = 2 whose one launcher runs replicas 0 and 1 and the
    coordinator. A node started once step 2 is logged, asking for any free id (it gets 2), is admitted at a step
    boundary while replica 0 holds step 4, receives its state from a live peer and computes a share of the same 4
    microbatches. Then, while replica 1 holds step 8 for 20 s, ``python -m titan_recover.drain --replicas 1``, the
    run's secret in the file ``TITAN_RECOVER_SECRET_FILE`` names:
    replica 1 says in step 8's all-reduce that it leaves and reports it with the step's commit, so replica 1 dying
    at once after (killed before its optimizer step) is still a leave at the boundary (a ``left`` event, no
    failure) and the survivors' next all-reduce waits for no one; its launcher runs replica 0 on to exit 0.
    Draining a group that is no member, or every member (also by naming this host, where every launcher runs),
    or a node that runs none exits 2 naming it and drains nothing. In exact mode
    throughout: every member's parameters after every step are the bits of one group's failure-free run, with
    its data and losses, and every step's 4 microbatches."""
    dump = tmp_path / "dump"
    plan = (
        "sleep replica=0 step=4 phase=optimizer seconds=120 until=epoch; "  # until the new group is admitted
        "sleep replica=1 step=8 phase=backward seconds=20; "  # the drain command imports torch meanwhile
        "kill replica=1 step=8 phase=optimizer"  # after the commit that announced its leave
    )
    budget = ("--recover.notice_budget_s", "40")  # above the 20 s hold
    args, env, env_c = two_nodes(
        dump, "--recover.fault_plan", plan, "--recover.max_replicas", "3", *budget, *EXACT_EVERY_STEP
    )
    port = int(args[args.index("--recover.coordinator_port") + 1])
    with Node("a", dump, args, {**env, keys.REPLICAS_ENV: "0,1"}) as a:
        wait_until("step 2", lambda: len(steps(dump)) >= 2, 240, [a])
        with Node("c", dump, args, {**env_c, keys.REPLICAS_ENV: "any"}) as c:  # id 2: the only free one
            wait_until("step 7", lambda: len(steps(dump)) >= 7, 240, [a, c])
            # the refusals in this process (each drains nothing), the drain asked as the command a user runs
            refusals = [["--replicas", "7"], ["--replicas", "0,1,2"], ["--node", socket.gethostname()]]
            refusals.append(["--node", "no-such-node"])
            refused = [
                run_main(drain_main, ["--coordinator", f"127.0.0.1:{port}", *which], capfd, env) for which in refusals
            ]
            saved = tmp_path / "secret"  # the run's secret in a file, as the Slurm batch script saves it
            saved.write_text(env[keys.SECRET_ENV] + "\n")
            by_file = {**{k: v for k, v in env.items() if k != keys.SECRET_ENV}, keys.SECRET_FILE_ENV: str(saved)}
            asked = drain(by_file, port, "--replicas", "1", "--reason", "disk swap")
            said = asked.communicate(timeout=120)[1]
            assert a.wait(timeout=300) == 0, a.output()[-4000:]
            assert c.wait(timeout=60) == 0, c.output()[-4000:]
    assert asked.returncode == 0, said
    assert [r.returncode for r in refused] == [2] * 4, [r.stderr for r in refused]
    absent, every, here, nowhere = (r.stderr for r in refused)
    assert "replica group(s) [7] are not members of the run's epoch" in absent, absent
    assert "would leave no replica group" in every, every
    assert "would leave no replica group" in here, here  # every launcher runs on this host
    assert "--node 'no-such-node': no replica group of the run's members" in nowhere, nowhere
    assert f"{keys.REPLICAS_ENV}=any: replica ids [2] are free (members [0, 1])" in c.output(), c.output()[-3000:]
    run = Run(0, a.output(), events(dump))
    [admitted] = run.of("admitted")
    assert admitted["replica"] == 2 and "replaces" not in admitted, admitted  # a member beyond R, no repair
    [rejoined] = run.of("rejoined")
    [left] = run.of("left")
    joined, gone = rejoined["step"], left["step"]
    assert left["replica"] == 1 and 2 < joined < gone <= LAST and rejoined["bytes"] > 0, (rejoined, left)
    assert not run.of("failure")
    aborted = {e["replica"]: e["aborted"] for e in run.of("recovery_moments") if e["step"] == gone}
    assert aborted == {0: 0, 2: 0}, run.of("recovery_moments")  # no survivor's all-reduce waited for replica 1
    for s, e in run.steps().items():
        members = [0, 1] if s < joined else [0, 1, 2] if s < gone else [0, 2]
        assert e["members"] == members and sum(e["quotas"].values()) == 4, (s, e)
        assert s <= joined or e["quotas"].get("2", 0) > 0, (s, e)  # the joiner takes a share once it holds state
    assert_same_trajectory(exact_single, run, rel_tol=0.0, num_microbatches=4)
    twin = {e["step"]: e["digest"] for e in exact_single.of("param_digest")}
    differ = [(e["step"], e["replica"]) for e in run.of("param_digest") if e["digest"] != twin[e["step"]]]
    assert sorted(twin) == list(range(1, LAST + 1)) and not differ, differ
    assert sorted(e["replica"] for e in run.of("param_digest") if e["step"] == LAST) == [0, 2]
    assert "leaves at its next step boundary (drained by the operator: disk swap)" in run.output
    assert "left on notice       : 1" in run.output
