"""``[recover] exact`` on real runs. A kill at R = 2 and at R = 3, giving the failure-free R = 2 run's bits
with a step redone on the coarser grid, is the node self-test's ``exact`` check (tests/test_selftest.py)."""

from pathlib import Path

import pytest
from conftest import run_job

from titan_recover.selftest import EXACT


@pytest.mark.toml("the exact job's overrides use the 0.2 flags")
def test_a_nan_gradient_stops_the_run_naming_the_step_and_microbatch(tmp_path: Path) -> None:
    """A learning rate of 1e30 sends the parameters to ~1e30 in step 1: step 2's gradients are not finite.
    Every replica would compute them again, so the run stops instead of summing them."""
    run = run_job(
        tmp_path / "nan",
        *EXACT,
        "--optimizer.lr",
        "1e30",
        "--lr_scheduler.warmup_steps",
        "0",
        "--training.max_norm",
        "0",
        "--recover.fault_plan",
        "none",
        "--training.steps",
        "3",
    )
    assert run.returncode == 1, run.output[-3000:]
    assert "FATAL" in run.output and "NonFinite: the gradient of step 2 microbatch" in run.output, run.output[-3000:]
    assert "holds a NaN or an inf" in run.output
    assert sorted(run.steps()) == [1]  # nothing after the first step was committed
