"""A run's control store stays bounded: what a real run leaves in its TCPStore does not grow with its length."""

from pathlib import Path

from conftest import SINGLES, Run, run_job


def test_the_keys_a_run_leaves_in_its_store_do_not_grow_with_its_steps(tmp_path: Path, two_singles: Run) -> None:
    """Every committed step writes votes, a decision, a record and digests; the coordinator forgets
    them a few steps later, so 10 and 20 steps end with the same keys (counted as the run finishes).
    The 10 steps are the shared reference's (``two_singles``); the 20 are its job, only longer."""
    # no injected failure: how far a restarted group gets before the end would change the count
    run = run_job(tmp_path, *SINGLES, "--training.steps", "20", "--recover.fault_plan", "none")
    assert run.returncode == 0, run.output[-3000:]
    assert sorted(run.steps()) == list(range(1, 21))
    left = {}
    for steps, done in ((10, two_singles), (20, run)):
        (store,) = done.of("store")
        left[steps] = store["keys"]
    print(f"keys left in the store: {left}")
    assert left[10] == left[20], left
