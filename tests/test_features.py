"""TorchTitan's training features under titan_recover, on every TorchTitan line: a run in which a
rank of replica 1 is SIGKILLed mid-backward, checked against its failure-free twin. Checkpoint
save and resume is test_rejoin.py's DCP backstop; TP and PP are test_parallel.py's."""

from pathlib import Path

import pytest
from conftest import Run, assert_same_trajectory, run_job

from titan_recover.titan.jobs import FLAGS, LINE

pytestmark = pytest.mark.lines

M = 4  # global_batch_size 16 / (local_batch_size 2 * 2 shards)
PROFILER = FLAGS["profiler"]
KILL = ["--recover.max_restarts", "0", "--recover.fault_plan", "kill replica=1 rank=1 step=4 phase=backward"]

FEATURES = [
    "--lr_scheduler.decay_type",
    "cosine",
    # dynamo and AOTAutograd as on a GPU; aot_eager skips inductor's C++ code generation on CPU, which
    # would take minutes per rank on a 2-core machine
    "--compile.enable",
    "--compile.backend",
    "aot_eager",
    # TorchTitan's default is the fused AdamW
    "--optimizer.implementation",
    "foreach",
    f"{PROFILER}.enable_profiling",
    f"{PROFILER}.profile_freq",
    "3",
    f"{PROFILER}.profiler_warmup",
    "1",
    f"{PROFILER}.profiler_active",
    "1",
    # full recomputation of every block in the backward (last: TorchTitan 0.3 selects it by a
    # subcommand, which takes every flag after it as its own)
    *(["--activation_checkpoint.mode", "full"] if LINE == "0.2" else ["activation-checkpoint:full"]),
]
"""All in one pair of runs: each run costs about a minute of CI's two cores."""

LOGGED = [
    "Applied full activation checkpointing" if LINE == "0.2" else "Applied FullAC activation checkpointing",
    "Compiling each TransformerBlock with torch.compile",
]
"""What TorchTitan logs when it applies a feature: the setting reached it."""


def test_a_kill_under_torchtitans_features_keeps_its_failure_free_twins_trajectory(
    tmp_path: Path, failure_free: Run
) -> None:
    twin = run_job(tmp_path / "failure_free", "--recover.fault_plan", "none", *FEATURES)
    assert twin.returncode == 0, twin.output[-3000:]
    # the schedule reached the optimizer: after warmup its learning rates are not the linear decay's
    assert twin.steps()[6]["loss"] != failure_free.steps()[6]["loss"]

    run = run_job(tmp_path / "kill", *KILL, *FEATURES)
    assert run.returncode == 0, run.output[-3000:]
    assert_same_trajectory(twin, run, rel_tol=1e-3, num_microbatches=M)
    assert [f["replica"] for f in run.of("failure")] == [1]
    assert run.steps()[3]["members"] == [0, 1] and run.steps()[6]["members"] == [0]
    for line in LOGGED:
        assert line in run.output, run.output[-3000:]
    # each replica group is a torchrun world of its own, so its traces go to a folder of its own;
    # replica 1 traced step 3 and died in step 4
    folder, suffix = ("profile_traces", "json") if LINE == "0.2" else ("profiling/traces", "json.gz")
    traces = tmp_path / "kill" / folder
    found = sorted(str(p.relative_to(traces)) for p in traces.glob("*/iteration_*/*_trace.*"))
    assert found == [
        f"replica{r}/iteration_{i}/rank{k}_trace.{suffix}"
        for r, steps in ((0, (3, 6)), (1, (3,)))
        for i in steps
        for k in (0, 1)
    ], found
    # and the flight recorder's dumps (written on an NCCL timeout) too
    assert sorted(p.name for p in (tmp_path / "kill" / "comm_traces").iterdir()) == ["replica0", "replica1"]
