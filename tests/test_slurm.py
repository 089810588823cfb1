"""``scripts/slurm/train.sbatch`` under a real Slurm (Debian's 22.05, ``titan_recover.tools.clusters.slurm_local``):
four Slurm nodes, each a network namespace with its own host name and address, one replica group per node
(a job on fewer nodes: the others are drained for it), submitted with ``sbatch`` as a user does. Each run is held
against the failure-free trajectory (every step once, M microbatches, the same data and losses). One cluster
serves the whole file; its jobs run in ``main``, whose jobs a job of ``urgent`` preempts (``GRACE_S``), as the
preemption case does."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import SINGLES, Run, assert_same_trajectory, needs_etcd

from titan_recover.control import keys
from titan_recover.titan.jobs import job
from titan_recover.tools.clusters import slurm_local
from titan_recover.tools.clusters.partitions import events, leaders

ROOT = Path(__file__).resolve().parents[1]
REASON = slurm_local.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no Slurm cluster here: {REASON}")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY")
RUN_S = 240.0  # a job's bound, start to end
GRACE_S = 20  # the preempted job's GraceTime: above the runs' recover.notice_budget_s, 12 s


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm_local.SlurmCluster]:
    with slurm_local.SlurmCluster(4, tmp_path_factory.mktemp("slurm"), grace_s=GRACE_S) as cluster:
        yield cluster


def ready(cluster: slurm_local.SlurmCluster, nodes: int) -> slurm_local.SlurmCluster:
    """The file's cluster with its first ``nodes`` nodes idle and the others drained (a two-node test's jobs, and
    the run's own requests, land where they always did): a node an earlier test failed is repaired first, and the
    jobs a failed test left running are cancelled (they would hold the nodes)."""
    left = cluster.queued()
    if left:
        cluster.client(["scancel", *left], check=False)
        cluster.wait(lambda: not cluster.queued(), 120, f"jobs {' '.join(left)}, left by an earlier test, ended")
    for index in range(len(cluster.names)):
        if cluster.down(index):
            cluster.start_node(index)
    cluster.wait(lambda: not any(cluster.down(i) for i in range(len(cluster.names))), 60, "every node up")
    for index, name in enumerate(cluster.names):
        change = ["State=RESUME"] if index < nodes else ["State=DRAIN", "Reason=unused"]
        cluster.client(["scontrol", "update", f"NodeName={name}", *change], check=False)  # refused where it is so
    want = {name: "idle" if index < nodes else "drain" for index, name in enumerate(cluster.names)}
    cluster.wait(lambda: cluster.states() == want, 60, f"nodes {want}")
    return cluster


@pytest.fixture
def slurm(cluster: slurm_local.SlurmCluster) -> slurm_local.SlurmCluster:
    return ready(cluster, 2)


@pytest.fixture
def slurm3(cluster: slurm_local.SlurmCluster) -> slurm_local.SlurmCluster:
    return ready(cluster, 3)


@pytest.fixture
def slurm4(cluster: slurm_local.SlurmCluster) -> slurm_local.SlurmCluster:
    return ready(cluster, 4)


def submit(
    slurm: slurm_local.SlurmCluster,
    out: Path,
    plan: str,
    *extra: str,
    env: dict[str, str] | None = None,
    dump: Path | None = None,
) -> str:
    """The tests' job (``SINGLES``, fault plan ``plan``) submitted on two nodes (``extra``: sbatch's
    options, then the job's), logging to ``out``.out, its run's secret saved in ``out``.secret unless ``env`` names
    another file, and dumping to ``dump`` (default: ``out``); its job id."""
    config, path, *args = job(dump or out, tiny=True)
    tmp = Path(f"{out}.tmp")  # the job's temporary folder (etcd members' data): this test's own
    tmp.mkdir(exist_ok=True)
    assert config == "--job.config_file"
    options = [a for a in extra if a.startswith("--nodes") or a.startswith("--nodelist")]
    overrides = [a for a in extra if a not in options]
    return slurm.sbatch(
        [
            "--nodes=2",
            f"--output={out}.out",
            *options,
            "scripts/slurm/train.sbatch",
            path,
            *args,
            *SINGLES,
            "--recover.fault_plan",
            plan,
            *overrides,
        ],
        env={keys.SECRET_FILE_ENV: f"{out}.secret", "TMPDIR": str(tmp), **(env or {})},
        cwd=ROOT,
    )


def finished(slurm: slurm_local.SlurmCluster, job_id: str, dump: Path) -> tuple[dict[str, str], Run]:
    """The job's end (its Slurm fields) and the run as node 0's launcher logged it."""
    fields = slurm.wait_job(job_id, ENDED, RUN_S)
    output = Path(f"{dump}.out").read_text()
    return fields, Run(0 if "0: titan_recover summary" in output else 1, output, events(dump))


def told(slurm: slurm_local.SlurmCluster, dump: Path) -> str:
    """What a timeout prints, most telling last (CI shows a failure's head and tail): the end of slurmctld's log
    and of the job's output, then each other node's last events and step lines of its slurmd (their output is
    lost with srun, where node 0 ran it and is gone)."""
    parts = [f"--- slurmctld ---\n{(slurm.folder / 'slurmctld.log').read_text()[-1500:]}"]
    parts.append(f"--- the job's output ---\n{Path(f'{dump}.out').read_text()[-1500:]}")
    for name in slurm.names[1:]:
        said = dump / f"recover_events.{name}.jsonl"
        lines = said.read_text().splitlines()[-4:] if said.exists() else ["(no event file)"]
        last = [json.loads(line) for line in lines if line.startswith("{")]
        shown = [" ".join(f"{k}={v}" for k, v in e.items() if k != "attempt") for e in last] or lines
        slurmd = (slurm.folder / f"slurmd.{name}.log").read_text().splitlines()
        steps = [line for line in slurmd if re.search(r"\] \[\d+\.|StepId=", line)][-4:]
        parts.append(f"--- {name}: events, then slurmd's step lines ---\n" + "\n".join([*shown, *steps]))
    return "\n".join(parts)


def wait_job(
    slurm: slurm_local.SlurmCluster, job_id: str, states: tuple[str, ...], timeout_s: float, dump: Path
) -> dict:
    """``slurm.wait_job``, its timeout saying what the job said (``told``)."""
    try:
        return slurm.wait_job(job_id, states, timeout_s)
    except TimeoutError as e:
        raise TimeoutError(f"{e}\n{told(slurm, dump)}") from None


def stalled(dump: Path, replica: int) -> Callable[[], bool]:
    """Whether ``replica``'s fault (its stall) has fired."""
    return lambda: any(e["event"] == "fault_injected" and e["replica"] == replica for e in events(dump))


def lost_then_asked_for(slurm: slurm_local.SlurmCluster, dump: Path, node: int) -> str:
    """Node ``node`` fails whole once its replica (one group per node) stalls, and is repaired once Slurm marks it
    down (until then it stays in the job's allocation), then the run asks for a replacement: the job id of that
    request. The stall outlasts any delay in seeing it, so the node always dies in the stalled step."""
    slurm.wait(stalled(dump, node), RUN_S, f"replica {node}'s stall")
    slurm.fail(node)
    slurm.wait(lambda: slurm.down(node), 60, f"node{node} down")
    slurm.start_node(node)
    asked = lambda: [e for e in events(dump) if e["event"] == "replacement_requested"]  # noqa: E731
    try:
        slurm.wait(lambda: bool(asked()), RUN_S, "the run's replacement request")
    except TimeoutError as e:
        raise TimeoutError(f"{e}\n{told(slurm, dump)}") from None
    return asked()[0]["job"]


def test_a_failed_node_costs_only_its_group_then_the_runs_own_request_lands_on_the_repaired_node_and_leaves_on_signal(
    tmp_path: Path, slurm: slurm_local.SlurmCluster, two_singles: Run
) -> None:
    """A node lost, capacity back by the run's own request, then preempted. Node 1 fails in step 3 (every process
    of it SIGKILLed, slurmd too) while its replica stalls in a forward pass; Slurm marks it down and, with the
    script's ``--no-kill``, neither signals node 0's task nor requeues the job: replica 0 takes over the step's
    microbatches. Node 1's slurmd starts again. Replica 1 out of the run for ``recover.replace_after_s`` (30 s, past
    Slurm taking node 1 out of the job), the coordinator submits the batch script on one node itself (``JOIN_RUN``
    its own address, the run id, the file the first job saved the run's secret in, mode 0600, as neither job is
    given one; node 1 not excluded, out of the job): the test submits nothing. That job lands on the repaired node,
    takes the lost group's replica id and is admitted while replica 0 holds step 5. Slurm then signals it
    (``scancel --signal=TERM``, as a preemption does) while replica 0 is slow in step 7: its group leaves at a step
    boundary and its job ends with exit 4. The first job completes, exit 0, no restart, every step once with M
    microbatches on the failure-free data; its events and summary name the request, its job, and that it joined."""
    dump = tmp_path / "dump"
    unset = {keys.SECRET_ENV: ""}  # as a user who sets none: the first job makes the run's and saves it
    plan = (
        "sleep replica=1 step=3 phase=forward seconds=60; "
        "sleep replica=0 step=5 phase=optimizer seconds=180 until=epoch; "
        "sleep replica=0 step=7 phase=forward seconds=8"
    )
    first = submit(slurm, dump, plan, "--recover.replace_after_s", "30", env=unset)
    joining = lost_then_asked_for(slurm, dump, 1)
    slurm.wait(lambda: any(e["event"] == "rejoined" for e in events(dump)), RUN_S, "the requested job's group admitted")
    slurm.client(["scancel", "--signal=TERM", joining])
    left = slurm.wait_job(joining, ENDED, RUN_S)
    fields, run = finished(slurm, first, dump)
    print(fields["JobState"], fields["ExitCode"], left["JobState"], left["ExitCode"], left["NodeList"])
    joined_out = tmp_path / f"replacement-{joining}.out"  # beside the run's secret file
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "0"), run.output[-3000:]
    assert (left["ExitCode"], left["NodeList"]) == ("4:0", "node1"), joined_out.read_text()[-3000:]
    assert Path(f"{dump}.secret").stat().st_mode & 0o777 == 0o600
    assert f"the run's secret: from {dump}.secret" in joined_out.read_text()
    assert_same_trajectory(two_singles, run, 1e-3, num_microbatches=4)
    [failure] = run.of("failure")
    [rejoined] = run.of("rejoined")
    [gone] = run.of("left")
    assert failure["replica"] == rejoined["replica"] == gone["replica"] == 1, (failure, rejoined, gone)
    members = {s: e["members"] for s, e in run.steps().items()}
    assert members[3] == [0] and members[rejoined["step"]] == [0, 1] and members[10] == [0], members
    assert gone["step"] > rejoined["step"], (rejoined, gone)
    assert "this node goes away" not in run.output, run.output[-3000:]  # Slurm never signalled node 0's task
    [requested] = run.of("replacement_requested")
    assert requested["replicas"] == [1] and "--exclude" not in requested["command"], requested
    assert requested["out_s"][0] >= 30, requested
    [joined] = run.of("replacement_joined")
    assert (joined["job"], joined["replicas"]) == (joining, [1]), joined
    assert not run.of("replacement_cancelled") and not run.of("replacement_failed")
    assert f"request 1 (job {joining}) for replica group(s) [1]: joined" in run.output, run.output[-3000:]


def test_the_coordinators_node_lost_requeues_the_job_and_it_resumes_from_the_checkpoint(
    tmp_path: Path, slurm: slurm_local.SlurmCluster, two_singles: Run
) -> None:
    """On the TCPStore the coordinator's node is the run: node 0 fails (every process SIGKILLed) in step 5,
    after the step-4 checkpoint, while replica 1 stalls in a forward pass. Node 0 was the batch host, and
    with ``--no-kill`` Slurm leaves the job running without it (measured: still RUNNING 120 s later). Node
    1's launcher loses the coordinator (exit 3), its ``node.sh`` waits for Slurm to find node 0 not
    responding and requeues the job (same id; its lines are lost with srun, which ran on node 0). Once node
    0 is back, the requeued job runs the same command (the stall again): TorchTitan resumes from the step-4
    checkpoint, steps 5-10 run, and the two runs together are the failure-free trajectory."""
    dump = tmp_path / "dump"
    # the real loss is seen at once (the coordinator's connections reset); a live coordinator slow to answer on a
    # loaded machine is not taken for lost, which would requeue nothing once node 0 really goes
    checkpoint = ("--checkpoint.enable", "--checkpoint.interval", "2", "--recover.coordinator_timeout_s", "15")
    job_id = submit(slurm, dump, "sleep replica=1 step=5 phase=forward seconds=15", *checkpoint)
    slurm.wait(stalled(dump, 1), RUN_S, "replica 1's stall")
    # replica 0 saves step 4 while replica 1 goes on into step 5: its last file, .metadata, may come after the stall
    slurm.wait((dump / "checkpoint" / "step-4" / ".metadata").exists, 30, "the step-4 checkpoint")
    first = Run(1, "", events(dump))  # a new run's launchers start the event files again
    slurm.fail(0)
    wait_job(slurm, job_id, ("PENDING",), 120, dump)  # by node 1's node.sh, once Slurm finds node 0 not responding
    slurm.wait(lambda: slurm.down(0), 60, "node0 down")
    slurm.start_node(0)
    slurm.wait(lambda: slurm.states().get("node0") == "idle", 60, "node0 idle again")
    slurm.client(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])  # Slurm holds a requeued job 120 s
    fields, second = finished(slurm, job_id, dump)
    print(fields["JobState"], fields["ExitCode"], fields["Restarts"])
    ended = (fields["JobState"], fields["ExitCode"], fields["Restarts"])
    assert ended == ("COMPLETED", "0:0", "1"), second.output[-3000:]
    assert sorted(first.steps()) == [1, 2, 3, 4]
    assert sorted(second.steps()) == list(range(5, 11)), second.output[-3000:]
    assert second.output.count("0: titan_recover summary") == 1  # the first run's output kept (--open-mode=append)
    assert_same_trajectory(two_singles, Run(0, "", first.events + second.events), 1e-3, num_microbatches=4)


def test_a_node_cut_off_costs_only_its_group_and_slurm_ends_its_tasks_when_it_is_back(
    tmp_path: Path, slurm: slurm_local.SlurmCluster, two_singles: Run
) -> None:
    """Node 1's cable pulled (its processes run on, unreachable) while its replica stalls in step 3, until
    Slurm marks it down; then put back. The coordinator fences replica 1 on its silent heartbeat and replica
    0 runs on alone; with ``--no-kill`` Slurm removes node 1 from the job instead of ending it, and kills the
    job's tasks there once the node answers again. The job completes, exit 0, no restart, node 0 never
    signalled, every step once with M microbatches on the failure-free data. Also the main job under
    ``sbatch --nodes=2 scripts/slurm/train.sbatch``: node 1's launcher dials node 0's coordinator by its Slurm
    node name (both groups members of steps 1-2), and the job ends COMPLETED."""
    dump = tmp_path / "dump"
    job_id = submit(slurm, dump, "sleep replica=1 step=3 phase=forward seconds=30")
    slurm.wait(stalled(dump, 1), RUN_S, "replica 1's stall")
    with slurm.cut_off(1):
        slurm.wait(lambda: slurm.down(1), 60, "node1 down")
    fields, run = finished(slurm, job_id, dump)
    print(fields["JobState"], fields["ExitCode"], fields["NodeList"])
    ended = (fields["JobState"], fields["ExitCode"], fields["Restarts"], fields["NodeList"])
    assert ended == ("COMPLETED", "0:0", "0", "node0"), run.output[-3000:]
    assert_same_trajectory(two_singles, run, 1e-3, num_microbatches=4)
    [failure] = run.of("failure")
    assert (failure["replica"], failure["step"]) == (1, 3) and "heartbeat silent" in failure["cause"], failure
    assert {s: e["members"] for s, e in run.steps().items()} == {s: [0, 1] if s < 3 else [0] for s in range(1, 11)}
    assert "this node goes away" not in run.output, run.output[-3000:]
    slurm.wait(lambda: slurm.processes(1) == ["slurmd"], 60, "the job's tasks on node1 ended by Slurm")


@needs_etcd
def test_with_the_defaults_on_three_nodes_the_batch_hosts_loss_is_a_group_failure_and_its_capacity_comes_back(
    tmp_path: Path, slurm3: slurm_local.SlurmCluster, three_replicas: Run
) -> None:
    """``sbatch --nodes=3 scripts/slurm/train.sbatch`` with no ``CONTROL_STORE``: from three nodes on the run keeps
    its membership on an etcd whose members the three launchers start themselves, and every node runs a
    coordinator candidate. Node 0, the batch host, fails whole (every process SIGKILLed, slurmd, its etcd member
    and its candidate too) while every group waits after step 4's commit: the two members left keep quorum, a
    candidate on node 1 or 2 leads, and replica 0's loss is a group failure like any other (no requeue, no
    checkpoint read). Node 0's slurmd starts again; replica 0 out for
    ``replace_after_s`` (30 s), the leading candidate submits the batch script on one node (``JOIN_RUN`` the run's
    ``etcd://`` store): the job lands on the repaired node 0, takes replica id 0 and is admitted while replicas 1
    and 2 hold step 5. Its launcher, joining an etcd the run formed on its nodes, volunteers and takes m0's place
    as m3 (three members again) while its group holds after the last step. The run ends normally, every step once
    with M microbatches on the failure-free data (three single-rank groups, M = 6, as ``THREE``). Slurm removed
    node 0 from the first job but, its batch script dead, would leave it running (measured): the first node whose
    run ended ends it (``scancel``, CANCELLED); the replacement's job completes."""
    dump = tmp_path / "dump"
    three = ("--training.global_batch_size", "12", "--training.steps", "6")  # M = 6, two each; THREE's steps
    # both survivors wait after step 5's commit (neither in a collective, which would time out) until the next
    # epoch: the replacement's admission
    hold = "; ".join(f"sleep replica={r} step=5 phase=optimizer seconds=180 until=epoch" for r in (1, 2))
    # node 0 fails while every group waits after step 4's commit, none in a collective: the kill lands in the
    # same place however slow the machine is
    wait = "; ".join(f"sleep replica={r} step=4 phase=optimizer seconds=60 until=epoch" for r in (1, 2))
    # the replacement's group holds after the last step's commit while its node takes the lost member's place
    # (three keeper passes of 2 s, once m0 has been silent member_replace_after_s)
    member = "sleep replica=0 step=6 phase=optimizer seconds=10"
    plan = f"sleep replica=0 step=4 phase=optimizer seconds=60; {wait}; {hold}; {member}"
    extra = ("--recover.replace_after_s", "30", "--recover.member_replace_after_s", "10")
    job_id = submit(slurm3, dump, plan, "--nodes=3", *extra, *three)
    joining = lost_then_asked_for(slurm3, dump, 0)
    fields = wait_job(slurm3, job_id, ENDED, RUN_S, dump)
    joined = wait_job(slurm3, joining, ENDED, 60, dump)
    run = Run(0, "", events(dump))  # srun ran on node 0: the other nodes' lines went with it
    hosts = [e["host"] for e in leaders(dump)]
    print(fields["JobState"], fields["Restarts"], joined["JobState"], joined["NodeList"], "leaders:", hosts)
    assert (fields["JobState"], fields["Restarts"]) == ("CANCELLED", "0"), fields
    joined_out = tmp_path / f"replacement-{joining}.out"
    assert (joined["JobState"], joined["ExitCode"], joined["NodeList"]) == ("COMPLETED", "0:0", "node0"), (
        joined_out.read_text()[-3000:]
    )
    output = Path(f"{dump}.out").read_text()
    assert "an etcd member on each of node0 node1 node2 (nodes://node0,node1,node2)" in output, output[-3000:]
    replaced = joined_out.read_text()  # the node took m0's place: three members again, a second loss survivable
    assert "this node volunteers for a lost member" in replaced, replaced[-3000:]
    assert "etcd member m3 starts on this node" in replaced, replaced[-3000:]
    assert_same_trajectory(three_replicas, run, 1e-3, num_microbatches=6)
    assert hosts[-1] in ("node1", "node2") and "node0" not in hosts[1:], hosts  # a takeover, where node 0 led
    [failure] = run.of("failure")
    [rejoined] = run.of("rejoined")
    assert (failure["replica"], failure["step"], rejoined["replica"]) == (0, 4, 0), (failure, rejoined)
    members = {s: e["members"] for s, e in run.steps().items()}
    assert members == {s: [1, 2] if 5 <= s < rejoined["step"] else [0, 1, 2] for s in range(1, 7)}, members
    [requested] = run.of("replacement_requested")
    assert requested["replicas"] == [0] and "JOIN_RUN=etcd://node0:2379,node1:2379,node2:2379" in requested["command"]
    [took] = run.of("replacement_joined")
    assert (took["job"], took["replicas"]) == (joining, [0]), took


@needs_etcd
def test_with_the_defaults_on_four_nodes_the_member_nodes_lost_one_after_another_keep_the_quorum(
    tmp_path: Path, slurm4: slurm_local.SlurmCluster, two_singles: Run
) -> None:
    """``sbatch --nodes=4`` with no ``CONTROL_STORE``: etcd members on nodes 0-2, started by their launchers, node 3
    without one (it volunteers). Every group holds after step 2's commit while node 0 (the batch host) and then
    node 1 fail whole: node 0's member is replaced by one on node 3 (``member_replace_after_s`` 5 s), so node 1's
    loss leaves two of three members, a quorum (without the replacement, two of three lost). Groups 2 and 3 end
    the run: every step once, M = 4 every step, on the failure-free data (``SINGLES`` on four single-rank groups);
    no replacement job (``replace off``: capacity back is the three-node case's), no requeue, ``Restarts=0``."""
    dump = tmp_path / "dump"
    hold = "; ".join(f"sleep replica={r} step=2 phase=optimizer seconds=45" for r in range(4))
    extra = ("--recover.member_replace_after_s", "5", "--recover.replace", "off")
    job_id = submit(slurm4, dump, hold, "--nodes=4", *extra)
    held = lambda: {e["replica"] for e in events(dump) if e["event"] == "fault_injected"} == {0, 1, 2, 3}  # noqa: E731
    slurm4.wait(held, RUN_S, "every group's hold")
    slurm4.fail(0)
    killed = time.monotonic()
    try:  # node 3's launcher logs it through srun, which died with node 0: its member's log shows it
        slurm4.wait(lambda: (dump / "etcd.m3.log").exists(), 90, "m3 started on node 3")
    except TimeoutError as e:
        raise TimeoutError(f"{e}\n{told(slurm4, dump)}") from None
    print(f"m3 started {time.monotonic() - killed:.1f}s after node 0's loss")
    slurm4.fail(1)
    fields = wait_job(slurm4, job_id, ENDED, RUN_S, dump)
    run = Run(0, "", events(dump))
    assert (fields["JobState"], fields["Restarts"]) == ("CANCELLED", "0"), fields
    assert_same_trajectory(two_singles, run, 1e-3, num_microbatches=4)
    assert sorted(f["replica"] for f in run.of("failure")) == [0, 1], run.of("failure")
    assert run.steps()[10]["members"] == [2, 3], run.steps()[10]
    assert not run.of("requeued")


def test_slurms_own_preemption_stops_the_run_which_saves_is_requeued_once_by_slurm_and_resumes_with_no_step_lost(
    tmp_path: Path, slurm: slurm_local.SlurmCluster, two_singles: Run
) -> None:
    """Slurm's preemption as a cluster configures it (``PreemptType=preempt/partition_prio``,
    ``PreemptMode=REQUEUE``, the run's partition ``GraceTime=20`` under a higher ``PriorityTier`` one over the same
    nodes), DCP checkpoints off. While replica 1 is inside step 4, a job submitted to the higher partition needs both
    nodes: Slurm SIGTERMs every task of the run, the coordinator's node stops the run in order after step 4 and the
    groups save its state to the stop folder. Slurm requeues the job by itself once the grace is over, and only
    then: ``node_slurm.sh`` waits for it (a job that ended first would not be requeued) and requeues nothing. The
    preemptor runs; once it has ended, the requeued job (same id, same command) resumes from the stop: steps 5-10,
    one restart, and the two runs together are the failure-free trajectory."""
    dump = tmp_path / "dump"
    job_id = submit(slurm, dump, "sleep replica=1 step=4 phase=backward seconds=6")
    slurm.wait(stalled(dump, 1), RUN_S, "replica 1's stall")
    noticed = time.monotonic()
    urgent = slurm.sbatch(
        ["--nodes=2", "--exclusive", f"--partition={slurm_local.URGENT}", f"--output={tmp_path}/urgent.out"]
        + ["--wrap", "sleep 2"],
        cwd=tmp_path,
    )
    # the grace, then Slurm's periodic check (every 30 s) ends the job and requeues it
    wait_job(slurm, job_id, ("PENDING",), GRACE_S + 60, dump)
    requeued_s = time.monotonic() - noticed
    first = Run(5, "", events(dump))  # a new run's launchers start the event files again
    ran = slurm.wait_job(urgent, ENDED, 60)
    slurm.client(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])  # Slurm holds a requeued job 120 s
    fields, second = finished(slurm, job_id, dump)
    print(f"requeued {requeued_s:.1f}s after the preemptor's submission;", fields["JobState"], fields["Restarts"])
    assert ran["JobState"] == "COMPLETED", ran
    ended = (fields["JobState"], fields["ExitCode"], fields["Restarts"])
    assert ended == ("COMPLETED", "0:0", "1"), second.output[-3000:]
    assert f"GraceTime={GRACE_S}s (partition main): the run stops and saves" in second.output, second.output[:3000]
    assert f"job {job_id} is preempted" in second.output and "requeueing job" not in second.output, second.output[
        -3000:
    ]
    assert sorted(first.steps()) == [1, 2, 3, 4], first.steps()
    assert not first.of("failure") and not first.of("fatal"), first.of("failure") + first.of("fatal")
    [saved] = first.of("stop_saved")  # one copy of the one shard
    assert saved["step"] == 4, saved
    assert not list((dump / "checkpoint").glob("step-*")), "checkpoints are off: no DCP save"
    assert sorted(second.steps()) == list(range(5, 11)), second.output[-3000:]
    assert {e["replica"] for e in second.of("stop_resumed")} == {0, 1}, second.of("stop_resumed")
    assert second.output.count("0: titan_recover summary") == 2  # the stopped run's, kept (--open-mode=append)
    assert_same_trajectory(two_singles, Run(0, "", first.events + second.events), 1e-3, num_microbatches=4)
