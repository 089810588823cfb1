"""TP and PP inside a replica group, with real processes: a rank of replica 1 is SIGKILLed
mid-backward, the survivor finishes the step with all M microbatches, the group restarts and
rejoins with each rank's state sent by the same (stage, shard, TP) rank of the donor.

Groups of 2 ranks (TP 2, or 2 stages) keep these fast on 2 cores; the shipped configs
add FSDP inside the group (2 x 2 ranks). Stock TorchTitan cannot run these layouts with
one FSDP rank (it falls back to DDP, which refuses TP and PP), so there is no stock run.
"""

from pathlib import Path

import pytest
from conftest import Run, assert_all_rejoined, assert_same_trajectory, run_job
from test_rejoin import WAIT, rejoined

M = 4
ONE_SHARD = ["--parallelism.data_parallel_shard_degree", "1", "--training.global_batch_size", "8"]  # M = 8 / 2
LAYOUTS = {
    "tp": [*ONE_SHARD, "--parallelism.tensor_parallel_degree", "2"],
    "pp": [
        *ONE_SHARD,
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "1",
    ],
}


def ok(run: Run) -> Run:
    assert run.returncode == 0, run.output[-3000:]
    return run


# the lines tier runs PP, where TorchTitan 0.3 takes microbatches differently (titan.model_inputs);
# TP goes through the adapter as FSDP does, and each run pair costs CI two minutes
@pytest.mark.parametrize("layout", [pytest.param("pp", marks=pytest.mark.lines), "tp"])
def test_kill_and_rejoin_inside_a_3d_group(tmp_path: Path, layout: str) -> None:
    args = LAYOUTS[layout]
    reference = ok(run_job(tmp_path / "ff", *args, "--recover.fault_plan", "none"))
    assert "2 ranks each" in reference.output

    plan = f"kill replica=1 rank=1 step=2 phase=backward; {WAIT.format(r=0, s=3)}"
    run = ok(run_job(tmp_path / "kill", *args, "--recover.fault_plan", plan))
    assert_same_trajectory(reference, run, rel_tol=1e-3, num_microbatches=M)
    assert [(f["replica"], f["rank"], f["step"]) for f in run.of("fault_injected") if f["action"] == "kill"] == [
        (1, 1, 2)
    ]
    assert run.steps()[2]["members"] == [0]  # the survivor finished the failed step alone
    assert rejoined(run, 1)["step"] <= 6
    assert_all_rejoined(run, replicas=2, last_step=6)
