"""End-to-end runs with real processes and real SIGKILLs (see conftest.run_job)."""

from pathlib import Path

import pytest
from conftest import SINGLES, THREE, Run, assert_same_trajectory, run_job

from titan_recover.titan.jobs import LINE

M = 4  # global_batch_size 16 / (local_batch_size 2 * 2 shards)


@pytest.mark.lines
def test_matches_stock_torchtitan_hsdp(tmp_path: Path, failure_free: Run) -> None:
    stock = run_job(tmp_path, "--recover.no-enable", "--recover.fault_plan", "none")
    assert stock.returncode == 0, stock.output[-3000:]
    assert "stock TorchTitan HSDP" in stock.output
    if LINE == "0.2":  # the TOML leaves the precision to the launcher; 0.3's recipes state float32 themselves
        for run in (stock, failure_free):  # both in float32 on this CPU: the comparison is like for like
            assert "no accelerator: parameters in float32" in run.output, run.output[-3000:]
    assert_same_trajectory(stock, failure_free, rel_tol=1e-4, num_microbatches=M)
    assert all(e["members"] == [0, 1] for e in failure_free.of("step"))
    assert not failure_free.of("failure")


# a kill in backward: test_rejoin.py and the self-test's default job (the lines tier's kill runs: test_features.py)
@pytest.mark.parametrize("phase", ["forward", "allreduce"])
def test_sigkill_mid_step_keeps_trajectory(tmp_path: Path, failure_free: Run, phase: str) -> None:
    run = run_job(
        tmp_path, "--recover.max_restarts", "0", "--recover.fault_plan", f"kill replica=1 rank=1 step=3 phase={phase}"
    )
    assert run.returncode == 0, run.output[-3000:]
    assert_same_trajectory(failure_free, run, rel_tol=1e-3, num_microbatches=M)
    (injected,) = run.of("fault_injected")
    assert (injected["replica"], injected["rank"], injected["step"], injected["phase"]) == (1, 1, 3, phase)
    assert [f["replica"] for f in run.of("failure")] == [1]
    (recovered,) = run.of("recovered")
    assert recovered["members"] == [0] and recovered["step"] == 3
    assert 0 <= recovered["latency_s"] < 10
    steps = run.steps()
    assert steps[2]["members"] == [0, 1] and steps[3]["members"] == [0] and steps[6]["members"] == [0]


def test_two_replicas_lost_in_one_step_down_to_one_survivor(tmp_path: Path, three_replicas: Run) -> None:
    plan = "kill replica=1 step=3 phase=backward; kill replica=2 step=3 phase=forward microbatch=0"
    run = run_job(
        tmp_path,
        *THREE,
        "--recover.max_restarts",
        "0",
        "--recover.collective_timeout_s",
        "60",
        "--recover.fault_plan",
        plan,
    )
    assert run.returncode == 0, run.output[-3000:]
    assert_same_trajectory(three_replicas, run, rel_tol=1e-3, num_microbatches=6)
    # no survivor waits out a collective timeout (a rendezvous with a dead peer once held its store client)
    steps = run.steps()
    assert steps[3]["time"] - steps[2]["time"] < 30
    assert sorted(f["replica"] for f in run.of("failure")) == [1, 2]
    assert run.steps()[6]["members"] == [0]


def test_below_min_replicas_is_a_clear_error(tmp_path: Path) -> None:
    run = run_job(
        tmp_path,
        *SINGLES,
        "--recover.min_replicas",
        "2",
        "--recover.max_restarts",
        "0",
        "--recover.fault_plan",
        "kill replica=1 step=2 phase=backward",
    )
    assert run.returncode != 0
    assert "recover.min_replicas is 2" in run.output
    assert run.of("fatal") and max(run.steps()) == 1
