"""Every replica group lost at once, their launchers alive: the run resumes from the host-memory snapshots
on its nodes, no checkpoint read, and ends on its failure-free twin's bits (exact mode).

Real runs: two groups of two ranks, each rank SIGKILLed by the fault plan; snapshots every 3 steps, so a loss
in step 8 resumes from step 6 and computes step 7 again."""

import glob
import os
import time
from pathlib import Path
from threading import Thread

import pytest
from conftest import Run, run_job

from titan_recover.compare import compare_runs
from titan_recover.observability.events import undo_resumed

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
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(altered) < 2:
            for path in glob.glob(str(memory / "*" / "shard*" / "*")):
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
