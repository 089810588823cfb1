"""Restart and checkpoint-free rejoin with real processes: SIGKILL, SIGSTOP, slow ranks,
and failures in the middle of a state transfer.

A restarted group needs several seconds to start (imports, model build), longer
than the tiny model's remaining steps, so the survivors are held back (a ``sleep ... until=epoch``
fault, which must not get them evicted) until it is admitted.
"""

from pathlib import Path

import pytest
from conftest import SINGLES, THREE, Run, assert_all_rejoined, assert_same_trajectory, run_job

from titan_recover.titan.jobs import LINE

M = 4
# survivors wait for the admission: 6-13 s here, over 30 s once on a loaded 2-core CI machine
WAIT = "sleep replica={r} step={s} phase=optimizer seconds=120 until=epoch"


def rejoined(run: Run, replica: int) -> dict:
    events = [e for e in run.of("rejoined") if e["replica"] == replica]
    assert len(events) == 1, f"replica {replica} rejoined {len(events)} times:\n{run.output[-3000:]}"
    (event,) = events
    assert event["bytes"] > 0 and 0 < event["transfer_s"] < event["downtime_s"]
    return event


@pytest.mark.lines
@pytest.mark.skipif(LINE == "0.2", reason="on 0.2 the self-test's default job is this run (tests/test_selftest.py)")
def test_kill_restart_rejoin_keeps_trajectory(tmp_path: Path, failure_free: Run) -> None:
    plan = f"kill replica=1 rank=1 step=2 phase=backward; {WAIT.format(r=0, s=3)}"
    run = run_job(tmp_path, "--recover.fault_plan", plan)
    assert run.returncode == 0, run.output[-3000:]
    assert_same_trajectory(failure_free, run, rel_tol=1e-3, num_microbatches=M)
    assert [f["replica"] for f in run.of("failure")] == [1]  # the sleeper was not evicted
    (admitted,) = run.of("admitted")
    assert (admitted["replica"], admitted["attempt"]) == (1, 1)
    assert rejoined(run, 1)["step"] <= 6
    assert run.steps()[2]["members"] == [0]
    assert_all_rejoined(run, replicas=2, last_step=6)


@pytest.fixture(scope="module")
def stopped_then_joiner_killed(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Replica 1's rank 0 SIGSTOPped mid-backward at step 2 (found by its silence, heartbeat_timeout_s 3),
    then its restarted incarnation's rank 0 SIGKILLed while it receives its state: one run for both
    stories, each test reading its own."""
    plan = (
        "stop replica=1 rank=0 step=2 phase=backward; kill replica=1 rank=0 phase=join; "
        f"{WAIT.format(r=0, s=3)}; {WAIT.format(r=0, s=4)}"
    )
    run = run_job(
        tmp_path_factory.mktemp("stopped"), "--recover.heartbeat_timeout_s", "3", "--recover.fault_plan", plan
    )
    assert run.returncode == 0, run.output[-3000:]
    return run


def test_sigstop_is_detected_fenced_and_restarted(stopped_then_joiner_killed: Run, failure_free: Run) -> None:
    run = stopped_then_joiner_killed
    assert_same_trajectory(failure_free, run, rel_tol=1e-3, num_microbatches=M)
    stopped = run.of("failure")[0]
    assert stopped["replica"] == 1 and "heartbeat silent" in stopped["cause"], stopped
    recovered = run.of("recovered")[0]
    assert 2.5 < recovered["latency_s"] < 10, recovered  # the hang costs about heartbeat_timeout_s
    assert "killed local rank 0 of fenced replica 1 (attempt 0" in run.output  # the hung rank was cleared away
    rejoined(run, 1)
    assert_all_rejoined(run, replicas=2, last_step=6)


def test_joiner_killed_mid_transfer_retries(stopped_then_joiner_killed: Run) -> None:
    run = stopped_then_joiner_killed
    assert [(e["replica"], e["attempt"]) for e in run.of("admitted")] == [(1, 1), (1, 2)]
    assert any(e["phase"] == "join" and e["attempt"] == 1 for e in run.of("fault_injected"))
    assert [f["replica"] for f in run.of("failure")] == [1, 1]  # the stopped incarnation, then the killed joiner
    rejoined(run, 1)  # once: the joiner killed in incarnation 1 never finished its transfer


def test_a_peer_hung_between_collectives_is_fenced_once_the_wait_is_reported(tmp_path: Path, two_singles: Run) -> None:
    # replica 1 hangs after its step was agreed: no collective breaks, replica 0 waits for its
    # parameter digest, reports the wait after report_confirm_s, and the coordinator fences the
    # silent group then (not after heartbeat_timeout_s, 10 s here); single-rank groups: the hang is between groups
    plan = f"stop replica=1 rank=0 step=2 phase=optimizer; {WAIT.format(r=0, s=3)}"
    run = run_job(
        tmp_path,
        *SINGLES,
        "--recover.heartbeat_timeout_s",
        "10",
        "--recover.digest_interval",
        "2",
        "--recover.fault_plan",
        plan,
    )
    assert run.returncode == 0, run.output[-3000:]
    assert_same_trajectory(two_singles, run, rel_tol=1e-3, num_microbatches=M)
    (failure,) = run.of("failure")
    assert failure["replica"] == 1, failure
    assert "while its peers waited (replica 0 rank 0 waited 1s for the parameter digests of step 2" in failure["cause"]
    (recovered,) = run.of("recovered")
    assert 1 < recovered["latency_s"] < 5, recovered
    rejoined(run, 1)
    assert_all_rejoined(run, replicas=2, last_step=10)


def test_donor_killed_mid_transfer_another_donor_takes_over(tmp_path: Path, three_replicas: Run) -> None:
    plan = (
        "kill replica=2 step=2 phase=backward; kill replica=0 phase=donate; "
        f"{WAIT.format(r=1, s=3)}; {WAIT.format(r=1, s=4)}"
    )
    run = run_job(tmp_path, *THREE, "--recover.fault_plan", plan)
    assert run.returncode == 0, run.output[-3000:]
    assert_same_trajectory(three_replicas, run, rel_tol=1e-3, num_microbatches=6)
    assert sorted(f["replica"] for f in run.of("failure")) == [0, 2]
    rejoined(run, 0)
    rejoined(run, 2)
    assert_all_rejoined(run, replicas=3, last_step=6)


@pytest.mark.lines
def test_dcp_checkpoint_backstop_resumes_on_the_failure_free_data(tmp_path: Path, failure_free: Run) -> None:
    ckpt = [
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.no-last-save-model-only",
        "--recover.max_restarts",
        "0",
    ]
    lost = run_job(tmp_path, *ckpt, "--recover.fault_plan", "kill replica=0 step=5; kill replica=1 step=5")
    assert lost.returncode != 0 and lost.of("fatal")  # every replica gone: only the checkpoint is left
    assert (tmp_path / "checkpoint" / "step-4").is_dir()
    resumed = run_job(tmp_path, *ckpt, "--recover.fault_plan", "none")
    assert resumed.returncode == 0, resumed.output[-3000:]
    steps, reference = resumed.steps(), failure_free.steps()
    assert sorted(steps) == [5, 6]
    for t in (5, 6):
        assert steps[t]["data_digest"] == reference[t]["data_digest"]
        assert abs(steps[t]["loss"] - reference[t]["loss"]) <= 1e-3 * abs(reference[t]["loss"])
