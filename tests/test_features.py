"""TorchTitan's training features under titan_recover, on every TorchTitan line: runs in which a
rank of replica 1 is SIGKILLed mid-backward, checked against a failure-free run. Checkpoint
save and resume is test_rejoin.py's DCP backstop; TP and PP are test_parallel.py's."""

from pathlib import Path

import pytest

from bench.common import FLAGS, LINE
from conftest import Run, assert_same_trajectory, run_job

pytestmark = pytest.mark.lines

M = 4  # global_batch_size 16 / (local_batch_size 2 * 2 shards)
PROFILER = FLAGS["profiler"]
KILL = ["--recover.max_restarts", "0", "--recover.fault_plan", "kill replica=1 rank=1 step=4 phase=backward"]

SAME_MATH = [
    # dynamo and AOTAutograd as on a GPU; aot_eager skips inductor's C++ code generation on CPU, which
    # would take minutes per rank on a 2-core machine
    "--compile.enable", "--compile.backend", "aot_eager",
    # TorchTitan's default is the fused AdamW
    "--optimizer.implementation", "foreach",
    f"{PROFILER}.enable_profiling", f"{PROFILER}.profile_freq", "3", f"{PROFILER}.profiler_warmup", "1",
    f"{PROFILER}.profiler_active", "1",
    # full recomputation of every block in the backward: the same ops, so the same trajectory (last:
    # TorchTitan 0.3 selects it by a subcommand, which takes every flag after it as its own)
    *(["--activation_checkpoint.mode", "full"] if LINE == "0.2" else ["activation-checkpoint:full"]),
]
"""Features that leave the arithmetic as it is, all in one run (each run costs a minute of CI's two
cores): its kill run is checked against the plain failure-free run."""

LOGGED = [
    "Applied full activation checkpointing" if LINE == "0.2" else "Applied FullAC activation checkpointing",
    "Compiling each TransformerBlock with torch.compile",
]
"""What TorchTitan logs when it applies a feature: the setting reached it."""


def assert_survived(run: Run, reference: Run) -> None:
    assert run.returncode == 0, run.output[-3000:]
    assert_same_trajectory(reference, run, rel_tol=1e-3, num_microbatches=M)
    assert [f["replica"] for f in run.of("failure")] == [1]
    assert run.steps()[3]["members"] == [0, 1] and run.steps()[6]["members"] == [0]


def test_a_kill_under_checkpointing_compile_foreach_and_the_profiler_keeps_the_trajectory(
        tmp_path: Path, failure_free: Run) -> None:
    run = run_job(tmp_path, *KILL, *SAME_MATH)
    assert_survived(run, failure_free)
    for line in LOGGED:
        assert line in run.output, run.output[-3000:]
    # each replica group is a torchrun world of its own, so its traces go to a folder of its own;
    # replica 1 traced step 3 and died in step 4
    folder, suffix = ("profile_traces", "json") if LINE == "0.2" else ("profiling/traces", "json.gz")
    traces = sorted(str(p.relative_to(tmp_path / folder)) for p in (tmp_path / folder).glob("*/iteration_*/*_trace.*"))
    assert traces == [f"replica{r}/iteration_{i}/rank{k}_trace.{suffix}"
                      for r, steps in ((0, (3, 6)), (1, (3,))) for i in steps for k in (0, 1)], traces


def test_a_kill_under_a_cosine_schedule_keeps_its_trajectory(tmp_path: Path, failure_free: Run) -> None:
    """A schedule changes the arithmetic: its own failure-free run is the reference."""
    cosine = ["--lr_scheduler.decay_type", "cosine"]
    reference = run_job(tmp_path / "failure_free", "--recover.fault_plan", "none", *cosine)
    assert reference.returncode == 0, reference.output[-3000:]
    # the schedule reached the optimizer: after warmup its learning rates are not the linear decay's
    assert reference.steps()[6]["loss"] != failure_free.steps()[6]["loss"]
    assert_survived(run_job(tmp_path / "kill", *KILL, *cosine), reference)
