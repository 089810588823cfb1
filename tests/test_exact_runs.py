"""``[recover] exact`` on real runs. A kill at R = 2 and at R = 3, giving the failure-free R = 2 run's bits
with a step redone on the coarser grid, is the node self-test's ``exact`` check (tests/test_selftest.py)."""

from pathlib import Path

import pytest
from conftest import EXACT_EVERY_STEP, SINGLES, Run, run_job

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


def test_a_flipped_gradient_bit_trains_in_unseen_by_the_parameter_digests(tmp_path: Path, exact_single: Run) -> None:
    """What the SDC checks are for: ``flip`` changes one microbatch's gradient before the step's sum, and the
    replicate all-reduce hands every group the same wrong sum. Two single-rank groups in exact mode (``SINGLES``):
    the default bit (the top mantissa bit) in replica 1's first microbatch of step 3, an exponent bit (30) in
    replica 0's second of step 6. The parameters agree across groups at every step (no digest mismatch) and equal
    the failure-free bits (``exact_single``) until step 2, then differ from them: trained in. The exponent flip
    makes the term huge, off the exact grid: the step is redone on a coarser grid, not stopped."""
    plan = "flip replica=1 step=3 microbatch=0; flip replica=0 step=6 microbatch=1 bit=30"
    run = run_job(tmp_path / "flip", *SINGLES, *EXACT_EVERY_STEP, "--recover.fault_plan", plan)
    assert run.returncode == 0, run.output[-3000:]
    fired = sorted((e["replica"], e["step"], e["action"]) for e in run.of("fault_injected"))
    assert fired == [(0, 6, "flip"), (1, 3, "flip")], fired
    assert not run.of("param_digest_mismatch") and not run.of("failure")
    digests: dict[int, set[str]] = {}
    for e in run.of("param_digest"):
        digests.setdefault(e["step"], set()).add(e["digest"])
    assert all(len(d) == 1 for d in digests.values()) and sorted(digests) == list(range(1, 11)), digests
    twin = {e["step"]: e["digest"] for e in exact_single.of("param_digest")}
    same = [s for s in range(1, 11) if digests[s] == {twin[s]}]
    assert same == [1, 2], (same, digests, twin)
    assert [(e["step"], e["replica"]) for e in run.of("exact_redo")] in ([(6, 0), (6, 1)], [(6, 1), (6, 0)])
