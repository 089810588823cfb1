"""Hot spares with real processes: a spare group that waits ready outside the membership
replaces a killed group at once (no process start on the critical path), the killed group
comes back as the new spare, and a spare killed while waiting or while receiving its state
costs the run nothing but another restart. Every step still sums the failure-free M."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, Run, assert_same_trajectory, run_job

from titan_recover.control import keys
from titan_recover.titan.jobs import job

ONE_SHARD = ["--parallelism.data_parallel_shard_degree", "1", "--training.steps", "12"]  # M = 8
M = 8
# replica 0 pauses after a commit so that a restarted group has time to come up within the run
# (the others wait for it in the next all-reduce: a long collective timeout)
PAUSE = "sleep replica=0 step={step} phase=optimizer seconds=40"
SPARE = ["--recover.spares", "1", "--recover.collective_timeout_s", "120"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = run_job(tmp_path_factory.mktemp("reference"), *ONE_SHARD, "--recover.fault_plan", "none")
    assert run.returncode == 0, run.output[-3000:]
    return run


def _one(run: Run, kind: str, **match: object) -> dict:
    found = [e for e in run.of(kind) if all(e.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (kind, match, run.of(kind), run.output[-3000:])
    return found[0]


def _events(dump: Path) -> list[dict]:
    path = dump / "recover_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _ranks_of(replica: int, incarnation: int) -> list[int]:
    """Pids of the training ranks of that incarnation (their environment says which)."""
    want = {f"{keys.REPLICA_ENV}={replica}".encode(), f"{keys.INCARNATION_ENV}={incarnation}".encode()}
    pids = []
    for entry in os.listdir("/proc"):
        try:
            env = set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"))
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if want <= env and b"titan_recover.train" in cmd and b"torch.distributed.run" not in cmd:
            pids.append(int(entry))
    return pids


def _assert_end_state(run: Run, reference: Run, members: list[int]) -> None:
    assert run.returncode == 0, run.output[-3000:]
    assert_same_trajectory(reference, run, rel_tol=1e-3, num_microbatches=M)
    assert run.steps()[12]["members"] == members
    digests = {e["replica"]: e["digest"] for e in run.of("param_digest") if e["step"] == 12}
    assert sorted(digests) == members and len(set(digests.values())) == 1, digests
    assert not run.of("param_digest_mismatch")


def test_a_spare_replaces_a_killed_group_at_once_and_the_group_comes_back_as_the_spare(
    tmp_path: Path, reference: Run
) -> None:
    dump = tmp_path / "run"
    plan = f"{PAUSE.format(step=2)}; kill replica=1 rank=0 step=4; {PAUSE.format(step=6)}"
    cmd = [
        sys.executable,
        "-m",
        "titan_recover.launch",
        *job(dump, tiny=True),
        *ONE_SHARD,
        *SPARE,
        "--recover.fault_plan",
        plan,
    ]
    env = {k: v for k, v in os.environ.items() if k != keys.SECRET_ENV}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # the spare, waiting (replica 0 pauses at step 2): SIGKILLed from outside, its launcher starts it again
        deadline = time.monotonic() + 120
        while not any(e["event"] == "spare_ready" and e["replica"] == 2 for e in _events(dump)):
            assert time.monotonic() < deadline and proc.poll() is None, "the spare never got ready"
            time.sleep(0.2)
        pids = _ranks_of(2, 0)
        assert pids, "no rank of the waiting spare found"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=400)
    finally:
        proc.kill()
    run = Run(proc.returncode, output, _events(dump))

    respawned = _one(run, "spare_ready", replica=2, attempt=1)  # back as a spare, nobody failed
    failure = _one(run, "failure")
    assert failure["replica"] == 1 and failure["step"] == 4
    assert respawned["time"] < failure["time"], "the spare was not back before the kill at step 4"
    admitted = _one(run, "admitted", replica=2)
    comeback = _one(run, "spare_ready", replica=1, attempt=1)
    # the spare took the place before the killed group's new processes were even up
    assert admitted["replaces"] == 1 and admitted["time"] < comeback["time"]
    rejoined = _one(run, "rejoined", replica=2)
    assert rejoined["replaces"] == 1 and rejoined["downtime_s"] < comeback["time"] - failure["time"]
    # its launcher's report or its silence dropped the dead spare; nothing else was lost
    assert {(e["replica"], e["attempt"]) for e in run.of("spare_lost")} <= {(2, 0)}
    _assert_end_state(run, reference, members=[0, 2])
    assert "replica 2 (spare, for replica 1) at step" in run.output


def test_a_spare_killed_while_receiving_its_state_leaves_the_failure_open_for_the_next(
    tmp_path: Path, reference: Run
) -> None:
    plan = f"kill replica=1 rank=0 step=4; kill replica=2 phase=join attempt=0; {PAUSE.format(step=6)}"
    run = run_job(tmp_path / "run", *ONE_SHARD, *SPARE, "--recover.fault_plan", plan, timeout=400)
    assert run.returncode == 0, run.output[-3000:]
    first = _one(run, "failure", replica=1)
    # died mid-transfer: failed like a joiner, in no committed step. Admitted at step 4 when it was ready
    # in time; on a loaded machine later (seen: at step 6, failed at 7 after the donor's pause)
    assert _one(run, "admitted", replica=2, attempt=0)["step"] <= _one(run, "failure", replica=2)["step"]
    (rejoined,) = run.of("rejoined")  # one of the two restarted groups, the other waits as the spare
    assert rejoined["replica"] in (1, 2)
    # the killed spare (incarnation 0) is in no committed step; replica 2 only from its restarted incarnation's rejoin
    # (seen on a fresh clone: incarnation 1 of replica 2 admitted at step 6 and rejoined at 7, replica 1 the spare)
    joined_at = rejoined["step"] if rejoined["replica"] == 2 else float("inf")
    assert all(2 not in e["members"] or e["step"] >= joined_at for e in run.of("step")), run.of("step")
    # timed from replica 1's failure, which the dead spare never repaired
    assert rejoined["downtime_s"] == pytest.approx(rejoined["time"] - first["time"], abs=2.0)
    _assert_end_state(run, reference, members=sorted((0, rejoined["replica"])))
