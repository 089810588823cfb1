"""A straggler with real processes: the ``speed`` policy measures every replica's seconds per
microbatch in the committed tally and moves work off the slow one, and a replica that
rejoins meanwhile derives the same quotas from the speeds its donor sends, while every step
still sums the failure-free run's M microbatches."""

from __future__ import annotations

from pathlib import Path

from conftest import assert_all_rejoined, assert_same_trajectory, run_job

ONE_SHARD = ["--parallelism.data_parallel_shard_degree", "1", "--training.steps", "30"]  # M = 8
M = 8


def test_a_slow_replica_gets_fewer_microbatches_and_a_rejoiner_derives_the_same_quotas(tmp_path: Path) -> None:
    reference = run_job(tmp_path / "reference", *ONE_SHARD, "--recover.fault_plan", "none")
    assert reference.returncode == 0, reference.output[-3000:]
    run = run_job(
        tmp_path / "run",
        *ONE_SHARD,
        "--recover.policy",
        "speed",
        # replica 1 is 10x slower in every incarnation (sleeping, so no CPU taken from the other tests; a
        # tiny microbatch's time is noise on 2 busy cores, a 10x gap is not); the fast one dies and
        # rejoins from the slow one
        "--recover.fault_plan",
        "slow replica=1 factor=10; kill replica=0 rank=0 step=4",
    )
    assert run.returncode == 0, run.output[-3000:]
    steps = run.steps()
    assert steps[1]["quotas"] == {"0": 4, "1": 4}  # nothing measured yet: equal quotas
    for step in (2, 3):  # one step measured: the straggler gives work away
        assert steps[step]["quotas"].get("1", 0) < steps[step]["quotas"]["0"], steps[step]
    (rejoined,) = run.of("rejoined")
    after = [s for s in steps.values() if s["step"] > rejoined["step"]]
    assert after, f"replica 0 rejoined at step {rejoined['step']}, after the last step"
    for s in after:  # the joiner took the measured speeds with its state: no reshuffle, no relearning
        # (a quota of 0 is left out of the event: the straggler may be measured too slow for any)
        assert s["members"] == [0, 1] and s["quotas"].get("1", 0) < s["quotas"]["0"], s
    assert_same_trajectory(reference, run, rel_tol=1e-3, num_microbatches=M)
    assert_all_rejoined(run, replicas=2, last_step=30)
