"""``[recover] exact`` on real runs: a kill at R = 2 and at R = 3 gives the failure-free R = 2 run's bits."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, Run, run_job

EXACT = ["--recover.exact", "--recover.digest_interval", "1", "--training.global_batch_size", "24"]  # M = 6: 3 or 2 each
SPIKE = ["--optimizer.lr", "3", "--lr_scheduler.warmup_steps", "0"]
"""A learning rate that makes step 2's gradients ~2**5 where step 1's were below 2**-6: past the grid's 8-bit
margin, so every run redoes step 2 on the coarser grid (measured: bound 2 -> 6); the losses stay finite."""


def compare_exact(reference: Path, run: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "titan_recover.compare", "--exact", str(reference), str(run)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def passed(run: Run) -> Run:
    assert run.returncode == 0, run.output[-3000:]
    return run


@pytest.mark.toml("the exact job's overrides use the 0.2 flags")
def test_a_kill_at_two_and_at_three_replicas_and_a_redo_give_the_failure_free_bits(tmp_path: Path) -> None:
    """R = 3 loses a group in the very step that is redone: the survivors take its microbatches over,
    then the step is redone on the coarser grid, and the bits are still the failure-free R = 2 run's."""
    free = passed(run_job(tmp_path / "free", *EXACT, *SPIKE, "--recover.fault_plan", "none"))
    two = passed(run_job(tmp_path / "two", *EXACT, *SPIKE, "--recover.fault_plan", "kill replica=1 rank=1 step=3 phase=backward"))
    three = passed(run_job(tmp_path / "three", *EXACT, *SPIKE, "--parallelism.data_parallel_replicate_degree", "3",
                           "--recover.fault_plan", "kill replica=2 rank=0 step=2 phase=forward"))
    for run in (free, two, three):
        assert {e["step"] for e in run.of("exact_redo")} == {2}, run.of("exact_redo")
    for run, replicas in ((two, 2), (three, 3)):
        assert run.of("failure") and len(run.steps()) == 6
        assert {len(e["members"]) for e in run.of("step")} >= {replicas - 1}  # steps the survivors carried
        result = compare_exact(tmp_path / "free", tmp_path / ("two" if replicas == 2 else "three"))
        assert result.returncode == 0, result.stdout + result.stderr
        assert "6 steps compared, parameter digests of 6 steps, max relative loss deviation 0.00e+00: the same bits" in result.stdout
    assert free.steps()[6]["loss"] == two.steps()[6]["loss"] == three.steps()[6]["loss"]


@pytest.mark.toml("the exact job's overrides use the 0.2 flags")
def test_a_nan_gradient_stops_the_run_naming_the_step_and_microbatch(tmp_path: Path) -> None:
    """A learning rate of 1e30 sends the parameters to ~1e30 in step 1: step 2's gradients are not finite.
    Every replica would compute them again, so the run stops instead of summing them."""
    run = run_job(tmp_path / "nan", *EXACT, "--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0",
                  "--training.max_norm", "0", "--recover.fault_plan", "none", "--training.steps", "3")
    assert run.returncode == 1, run.output[-3000:]
    assert "FATAL" in run.output and "NonFinite: the gradient of step 2 microbatch" in run.output, run.output[-3000:]
    assert "holds a NaN or an inf" in run.output
    assert sorted(run.steps()) == [1]  # nothing after the first step was committed
