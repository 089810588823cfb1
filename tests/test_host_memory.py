"""Every replica group lost at once, their launchers alive: the run resumes from the host-memory snapshots
on its nodes, no checkpoint read, and ends on its failure-free twin's bits (exact mode).

Real runs: two groups of two ranks, each rank SIGKILLed by the fault plan; snapshots every 3 steps, so a loss
in step 8 resumes from step 6 and computes step 7 again."""

import glob
import os
import subprocess
import sys
import time
from pathlib import Path
from threading import Thread

import pytest
from conftest import Node, Run, events, run_job

from titan_recover.compare import compare_runs
from titan_recover.control import keys, transport
from titan_recover.observability.events import undo_resumed
from titan_recover.titan.jobs import job
from titan_recover.tools.clusters.partitions import wait_until

STEPS = 10
JOB = [
    "--recover.exact",
    "--recover.digest_interval",
    "1",
    "--training.steps",
    str(STEPS),
    "--recover.snapshot_interval",
    "3",
    "--checkpoint.no-enable",  # nothing to resume from but the nodes' memory
]
EVERY_RANK = "; ".join(f"kill replica={r} rank={k} step=8 phase=backward" for r in (0, 1) for k in (0, 1))


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The failure-free twin: one group (exact mode's bits do not depend on the membership), no faults."""
    dump = tmp_path_factory.mktemp("twin")
    run = run_job(
        dump, *JOB, "--parallelism.data_parallel_replicate_degree", "1", "--recover.fault_plan", "none", timeout=300
    )
    assert run.returncode == 0, run.output[-3000:]
    return run


def resumed_on_the_twins_bits(run: Run, twin: Run, from_step: int) -> None:
    assert run.returncode == 0, run.output[-4000:]
    [lost] = run.of("state_lost")
    assert lost["step"] == 8 and lost["groups"] == [0, 1], lost
    [resuming] = run.of("resuming")
    assert (resuming["step"], resuming["lost_step"], resuming["recomputed"]) == (from_step, 8, 7 - from_step)
    [back] = run.of("resumed")
    assert back["step"] == from_step + 1 and back["seconds"] > 0, back
    kept, undone = undo_resumed(run.events)
    assert sorted(e["step"] for e in undone if e["event"] == "step") == list(range(from_step + 1, 8))
    assert sorted(e["step"] for e in kept if e["event"] == "step") == list(range(1, STEPS + 1))
    result = compare_runs(twin.events, run.events, rel_tol=0.0, exact=True)
    assert not result.problems, result.problems
    assert result.steps == STEPS and result.digest_steps == STEPS
    assert [e for e in kept if e["event"] == "step"][-1]["members"] == [0, 1]
    assert "resumed from this node's snapshot of step" in run.output
    assert "resume from the last checkpoint" not in run.output


def test_every_rank_of_every_group_killed_in_one_step_resumes_from_the_nodes_memory(tmp_path: Path, twin: Run) -> None:
    run = run_job(tmp_path / "run", *JOB, "--recover.fault_plan", EVERY_RANK, timeout=400)
    resumed_on_the_twins_bits(run, twin, from_step=6)
    assert "resumed from memory at step 6 (1 step(s) computed again)" in run.output  # the summary


def test_one_rank_of_every_group_killed_at_once_resumes_from_the_nodes_memory(tmp_path: Path, twin: Run) -> None:
    plan = "kill replica=0 rank=1 step=8 phase=backward; kill replica=1 rank=0 step=8 phase=backward"
    run = run_job(tmp_path / "run", *JOB, "--recover.fault_plan", plan, timeout=400)
    resumed_on_the_twins_bits(run, twin, from_step=6)


def test_a_snapshot_altered_in_memory_is_never_loaded_and_an_older_one_is(tmp_path: Path, twin: Run) -> None:
    """Step 6's copies altered while replica 0 sleeps in step 8, before every rank is killed: the restarted ranks
    find them corrupt, and the run resumes from step 3 (two copies kept), computing steps 4 to 7 again."""
    memory = tmp_path / "memory"
    memory.mkdir()
    hold = "sleep replica=0 rank=0 step=8 phase=forward seconds=15"
    plan = f"{hold}; {EVERY_RANK}"
    altered: list[str] = []

    def alter() -> None:
        """Once step 7 committed (replica 0 then sleeps 15 s in step 8) and no write is in flight: both groups'
        ranks write each shard's step 6 to the same name, and the later rename would put an intact copy back."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(altered) < 2:
            files = glob.glob(str(memory / "*" / "shard*" / "*")) + glob.glob(str(memory / "*" / "shard*" / ".*"))
            if not any(e["step"] >= 7 for e in events(tmp_path / "run") if e["event"] == "step") or any(
                name.endswith(".tmp") for name in files
            ):
                time.sleep(0.05)
                continue
            for path in files:
                name = os.path.basename(path)
                if path in altered or not name.startswith(f"step{6:012d}"):  # not a temp file (".step...tmp")
                    continue
                with open(path, "r+b") as f:  # one byte of the payload, at the end of the file
                    f.seek(-1, os.SEEK_END)
                    byte = f.read(1)
                    f.seek(-1, os.SEEK_END)
                    f.write(bytes([byte[0] ^ 0xFF]))
                altered.append(path)
            time.sleep(0.05)

    thread = Thread(target=alter, daemon=True)
    thread.start()
    run = run_job(
        tmp_path / "run",
        *JOB,
        "--recover.snapshot_keep",
        "2",
        "--recover.snapshot_dir",
        str(memory),
        "--recover.fault_plan",
        plan,
        timeout=400,
    )
    thread.join(timeout=5)
    assert len(altered) == 2, altered  # step 6 of both shards: the node keeps one copy of each, whichever group
    resumed_on_the_twins_bits(run, twin, from_step=3)
    assert "snapshot of step 6 is not used" in run.output
    assert not os.listdir(memory), os.listdir(memory)  # every launcher freed its folder at the end


def test_a_node_lost_whole_with_the_other_nodes_group_resumes_from_the_survivors_memory(tmp_path: Path) -> None:
    """Two launchers on one host stand for two nodes: A runs the coordinator and replica 0, B replica 1. B's whole
    tree is SIGKILLed after step 7 (its memory goes with it: B's command started again sweeps the dead launcher's
    folder) and replica 0 is killed in step 8: no group with state is left. Replica 0 comes back on A and resumes
    from A's newest snapshot (step 6, or 3 while 6's was still written) without waiting for replica 1, whose
    launcher is silent; replica 1, started again on B after that, holds none and rejoins from replica 0 by the state
    transfer. The run ends on its failure-free twin's bits."""
    dump, memory = tmp_path / "dump", tmp_path / "memory"
    memory.mkdir()
    port, secret = transport.free_port(), "host-memory-test-secret"
    single = ["--parallelism.data_parallel_shard_degree", "1", "--training.global_batch_size", "8"]
    twin = run_job(
        tmp_path / "twin",
        *JOB,
        *single,
        "--parallelism.data_parallel_replicate_degree",
        "1",
        "--recover.fault_plan",
        "none",
    )
    assert twin.returncode == 0, twin.output[-3000:]
    args = [
        sys.executable,
        "-m",
        "titan_recover.launch",
        *job(dump, tiny=True),
        *JOB,
        *single,
        "--recover.fault_plan",
        # the resumed replica 0 holds its second step until B's command, started again, joins the run (at most 120 s);
        # it resumes as its incarnation 1, or 2 where incarnation 1 was admitted before B's silence was seen
        "kill replica=0 step=8 phase=backward; "
        + "; ".join(f"sleep replica=0 attempt={a} step=+2 seconds=120 until=epoch" for a in (1, 2)),
        "--recover.snapshot_dir",
        str(memory),
        "--recover.coordinator_port",
        str(port),
        "--recover.coordinator_bind",
        "127.0.0.1",
    ]
    env = {**os.environ, keys.SECRET_ENV: secret, "PYTHONUNBUFFERED": "1"}
    env_b = {**env, keys.REPLICAS_ENV: "1", keys.COORDINATOR_ENV: f"127.0.0.1:{port}"}
    logged = lambda kind: [e for e in events(dump) if e["event"] == kind]  # noqa: E731
    with Node("a", dump, args, {**env, keys.REPLICAS_ENV: "0"}) as a, Node("b", dump, args, env_b) as b:
        wait_until("step 7", lambda: any(e["step"] >= 7 for e in logged("step")), 240, [a, b])
        b.kill_node()
        wait_until("every group's state lost", lambda: bool(logged("state_lost")), 120, [a])
        # B's launcher is silent: the resume waits heartbeat_timeout_s for it, not startup_timeout_s (600 s)
        wait_until("the resume without B", lambda: bool(logged("resuming")), 60, [a])
        with Node("b2", dump, args, env_b) as b2:
            assert a.wait(timeout=240) == 0, a.output()[-3000:]
            assert b2.wait(timeout=60) == 0, b2.output()[-3000:]
    run = Run(0, a.output(), events(dump))
    [resuming] = run.of("resuming")
    # step 6's snapshot, or step 3's where step 6's was still being written (a background thread) when the group died
    assert resuming["step"] in (3, 6) and resuming["groups"] == [0], resuming
    [rejoined] = run.of("rejoined")
    assert rejoined["replica"] == 1 and rejoined["bytes"] > 0, rejoined
    assert "of a launcher that is gone" in b2.output(), b2.output()[-3000:]  # B's folder, swept by B2
    assert not os.listdir(memory), os.listdir(memory)
    result = compare_runs(twin.events, run.events, rel_tol=0.0, exact=True)
    assert not result.problems, result.problems
    assert result.steps == STEPS and result.digest_steps == STEPS


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a 1 MiB tmpfs: needs root")
def test_a_snapshot_folder_without_room_stops_the_run_at_start_saying_what_to_set(tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        run = run_job(tmp_path / "run", "--recover.snapshot_dir", str(small), timeout=300)
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert run.returncode == 1, run.output[-3000:]
    [fatal] = run.of("fatal")
    assert fatal["error"].startswith("SnapshotError: snapshot folder"), fatal
    assert "recover.snapshot_interval = 0" in fatal["error"] and "recover.snapshot_dir" in fatal["error"]
    assert not run.of("step")  # it stopped before training


def test_a_damaged_state_saved_at_a_stop_stops_the_run_at_start_naming_it(tmp_path: Path) -> None:
    """The stop folder holds files of step 3 whose bytes do not verify: every group would have resumed there,
    so none starts elsewhere: the run stops before its first step, naming the file and what to remove."""
    dump = tmp_path / "run"
    stop = dump / "checkpoint" / "stop"
    for shard in (0, 1):  # the job's groups have two ranks
        damaged = stop / f"shard{shard}" / "step000000000003.snapshot"
        damaged.parent.mkdir(parents=True)
        damaged.write_bytes(b"TRSNAP\r\n" + bytes(200))
    run = run_job(dump, timeout=300)
    assert run.returncode == 1, run.output[-3000:]
    [fatal] = run.of("fatal")
    assert "the state saved at the stop of step 3" in fatal["error"], fatal
    assert "Remove that folder" in fatal["error"] and str(stop) in fatal["error"], fatal
    assert not run.of("step")  # it stopped before training
