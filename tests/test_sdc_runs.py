"""``[recover] sdc_check`` on real runs in exact mode: a flipped gradient bit (the fault plan's ``flip``) in a
checked microbatch caught in its step, against the failure-free run's bits; one in a microbatch no check draws
not claimed; two groups without a third opinion; a third opinion that agrees with neither."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import EXACT_EVERY_STEP, SINGLES, THREE, Node, Run, events, on_nodes, run_job, shared_run

from titan_recover.compare import compare_runs
from titan_recover.control import keys
from titan_recover.observability.events import undo_resumed
from titan_recover.policy import sdc, workload

SIX = [*THREE, "--training.steps", "6"]  # three single-rank groups, M = 6, two each
CHECKS = ["--recover.sdc_check", "--recover.sdc_check_rate"]
SEED = 0  # recover.data_seed's default: the draw's seed


@pytest.fixture(scope="session")
def exact_six(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Run:
    """One single-rank group in exact mode, M = 6, six steps: the bits of every exact run of ``SIX``'s batch."""
    one = ("--parallelism.data_parallel_replicate_degree", "1", "--recover.fault_plan", "none")
    return shared_run(tmp_path_factory, worker_id, "exact_six", *SIX, *EXACT_EVERY_STEP, *one)


def digests(run: Run) -> dict[int, set[str]]:
    """Each step's parameter digests over the groups."""
    out: dict[int, set[str]] = {}
    for e in run.of("param_digest"):
        out.setdefault(e["step"], set()).add(e["digest"])
    return out


def same_as(run: Run, twin: Run) -> list[int]:
    """The steps whose every group's parameters have the twin's bits."""
    theirs = {e["step"]: e["digest"] for e in twin.of("param_digest")}
    return sorted(s for s, d in digests(run).items() if d == {theirs[s]})


def owner_and_index(step: int, rate: float, groups: tuple[int, ...]) -> tuple[int, int, int]:
    """The microbatch ``step`` checks, the group that owns it with every group a member, and its index among
    that group's own (what ``flip microbatch=`` names)."""
    m = sdc.checked_microbatch(SEED, step, rate, 6)
    assert m is not None, f"step {step} is not checked at rate {rate}"
    owner, owned = next((r, ms) for r, ms in workload.assign("balanced", groups, 6).items() if m in ms)
    return m, owner, owned.index(m)


def test_a_flip_in_a_checked_microbatch_is_outvoted_in_its_step_and_one_no_check_draws_trains_in(
    tmp_path: Path, exact_six: Run
) -> None:
    """Three groups, half the steps checked. The first checked step from 2 on: its microbatch's owner flips it
    (the top mantissa bit): the checker disagrees, the third group agrees with the checker, the owner fails in
    the step, the other two compute its microbatches, and the step commits the failure-free bits. The first step
    after it that no check draws: a group that never failed flips one of its microbatches, unseen (no mismatch
    claimed), and from then on the parameters differ from the failure-free ones."""
    rate = 0.5
    drawn = {s: sdc.checked_microbatch(SEED, s, rate, 6) for s in range(1, 7)}
    caught = next(s for s in range(2, 6) if drawn[s] is not None)
    unseen = next(s for s in range(caught + 1, 7) if drawn[s] is None)
    m, owner, index = owner_and_index(caught, rate, (0, 1, 2))
    other = next(r for r in (0, 1, 2) if r != owner)
    plan = f"flip replica={owner} step={caught} microbatch={index}; flip replica={other} step={unseen} microbatch=0"
    run = run_job(tmp_path / "dump", *SIX, *EXACT_EVERY_STEP, *CHECKS, str(rate), "--recover.fault_plan", plan)
    assert run.returncode == 0, run.output[-3000:]
    checker = sdc.after(owner, (0, 1, 2))
    mismatches = [(e["step"], e["microbatch"], e["outcome"], e["outvoted"]) for e in run.of("sdc_mismatch")]
    assert mismatches == [(caught, m, "third opinion", []), (caught, m, "outvoted", [owner])], mismatches
    assert run.of("sdc_mismatch")[0]["groups"] == [owner, checker]
    [failure] = run.of("failure")
    assert failure["replica"] == owner and "outvoted two to one" in failure["cause"], failure
    checked = {e["step"]: e["microbatch"] for e in run.of("sdc_checked")}
    assert checked == {s: d for s, d in drawn.items() if d is not None}, checked
    assert same_as(run, exact_six) == list(range(1, unseen)), (caught, unseen, digests(run))
    assert all(len(d) == 1 for d in digests(run).values())  # the unseen flip trained into every group alike


def test_with_two_groups_a_mismatch_computes_the_step_again_and_a_bad_device_stops_the_run(
    tmp_path: Path, exact_single: Run
) -> None:
    """Two groups (``SINGLES``, M = 4), every step checked: no third opinion. A flip once in step 2's checked
    microbatch: the step is computed again from its start, without either contribution, and commits the
    failure-free bits. Replica 1 flipping every microbatch from step 4 on (``repeat=true``, a bad device): the
    step's second computation disagrees again, and the run stops there rather than train it in."""
    m = sdc.checked_microbatch(SEED, 2, 1.0, 4)
    assert m is not None
    owner, owned = next((r, ms) for r, ms in workload.assign("balanced", (0, 1), 4).items() if m in ms)
    plan = f"flip replica={owner} step=2 microbatch={owned.index(m)}; flip replica=1 step=4 repeat=true"
    run = run_job(tmp_path / "dump", *SINGLES, *EXACT_EVERY_STEP, *CHECKS, "1", "--recover.fault_plan", plan)
    assert run.returncode == 1, run.output[-3000:]
    outcomes = [(e["step"], e["outcome"]) for e in run.of("sdc_mismatch")]
    assert outcomes == [(2, "computed again"), (4, "computed again"), (4, "undecided")], outcomes
    assert sorted(run.steps()) == [1, 2, 3]  # step 4 never commits
    assert same_as(run, exact_single) == [1, 2, 3], digests(run)
    assert "CheckUndecided" in run.output and "give no majority" in run.output, run.output[-3000:]


def test_a_third_opinion_that_agrees_with_neither_stops_the_step_from_committing(tmp_path: Path) -> None:
    """Three groups, every step checked: at step 2 the owner of the checked microbatch flips it once, and the
    third group flips another bit of every microbatch from step 2 on (its duplicate of the checked one too; the
    same bit would make the two wrong digests alike, and outvote the right one). Three digests, no two alike: the
    step does not commit and the run stops, saying so."""
    m, owner, index = owner_and_index(2, 1.0, (0, 1, 2))
    checker = sdc.after(owner, (0, 1, 2))
    assert checker is not None
    third = sdc.after(checker, (0, 1, 2), skip=(owner, checker))
    plan = f"flip replica={owner} step=2 microbatch={index}; flip replica={third} step=2 bit=21 repeat=true"
    run = run_job(tmp_path / "dump", *SIX, *EXACT_EVERY_STEP, *CHECKS, "1", "--recover.fault_plan", plan)
    assert run.returncode == 1, run.output[-3000:]
    outcomes = [(e["step"], e["microbatch"], e["outcome"], e["groups"]) for e in run.of("sdc_mismatch")]
    assert outcomes == [(2, m, "third opinion", [owner, checker]), (2, m, "undecided", [owner, checker, third])]
    assert sorted(run.steps()) == [1]
    assert "give no majority" in run.output, run.output[-3000:]


def test_a_bad_device_outvoted_twice_is_quarantined_with_its_node_and_never_readmitted(
    tmp_path: Path, exact_six: Run
) -> None:
    """Three groups on two launchers, every step checked, ten steps; the owner of step 2's checked microbatch
    flips every microbatch from step 2 on, in every incarnation (``repeat=true``: a bad device). Its node (launcher
    B) also runs one of the other groups; launcher A runs the coordinator and the third. Step 2: outvoted, a
    strike; it fails in the step, the others commit the failure-free bits without it, and hold after step 3 until
    it is back. Back, it is outvoted again at the first check it takes part in: quarantined (the event, the
    summary), and its node's other group with it. B restarts neither and exits; A's group ends the run alone."""
    steps = 10
    m, bad, _ = owner_and_index(2, 1.0, (0, 1, 2))
    others = [r for r in (0, 1, 2) if r != bad]
    involved = [
        s for s in range(5, steps + 1) if bad in (o := owner_and_index(s, 1.0, (0, 1, 2))[1], sdc.after(o, (0, 1, 2)))
    ]
    assert involved, "no check from step 5 on involves the bad group: choose another layout"
    mate, alone = others
    hold = "; ".join(f"sleep replica={r} step=3 phase=optimizer seconds=120 until=epoch" for r in others)
    # the last step waits for B to see its groups exit: a run that ends first ends B with the run's outcome
    last_hold = f"sleep replica={alone} step={steps} phase=optimizer seconds=10"
    plan = f"flip replica={bad} step=2 repeat=true; {hold}; {last_hold}"
    dump = tmp_path / "dump"
    layout = [*THREE, "--training.steps", str(steps), *EXACT_EVERY_STEP, *CHECKS, "1", "--recover.fault_plan", plan]
    args, env, coordinator = on_nodes(dump, "sdc-test-secret", *layout)
    env_a = {**env, keys.REPLICAS_ENV: str(alone)}
    env_b = {**env, keys.REPLICAS_ENV: f"{bad},{mate}", keys.COORDINATOR_ENV: coordinator}
    with Node("a", dump, args, env_a) as a, Node("b", dump, args, env_b) as b:
        code_a, code_b = a.wait(timeout=300), b.wait(timeout=60)
    run = Run(code_a, a.output() + b.output(), events(dump))
    assert code_a == 0, a.output()[-3000:]
    assert code_b == keys.EXIT_QUARANTINED and "quarantined: the run goes on without this node" in b.output()
    [first, *_] = run.of("sdc_mismatch")
    assert (first["step"], first["outvoted"]) == (2, []) and first["groups"][0] == bad, first
    outvoted = [(e["step"], e["outvoted"]) for e in run.of("sdc_mismatch") if e["outvoted"]]
    assert outvoted[0] == (2, [bad]) and len(outvoted) == 2 and outvoted[1][0] <= involved[0], outvoted
    caught = outvoted[1][0]
    quarantined = [(e["replica"], e["step"], e.get("with")) for e in run.of("quarantined")]
    assert quarantined == [(bad, caught, None), (mate, caught, bad)], quarantined
    assert [e["replica"] for e in run.of("admitted")] == [bad]  # back once, after its first strike only
    for r in (bad, mate):
        assert f"replica group {r} exited" in b.output() and "it is quarantined" in b.output(), b.output()[-3000:]
    assert f"replica {mate} quarantined with replica {bad}'s node" in a.output(), a.output()[-3000:]
    assert f"QUARANTINED          : replica {bad} at step {caught} (check" in a.output(), a.output()[-3000:]
    assert f"QUARANTINED          : replica {mate} at step {caught} (on replica {bad}'s node" in a.output()
    last = run.steps()[steps]
    assert last["members"] == [alone], last
    twin = {e["step"]: e["digest"] for e in exact_six.of("param_digest")}
    assert all(digests(run)[s] == {twin[s]} for s in (1, 2, 3)), digests(run)


def test_a_bad_device_caught_after_unchecked_steps_is_rolled_back_past_and_the_run_ends_on_the_twins_bits(
    tmp_path: Path, exact_six: Run
) -> None:
    """Three groups, every step checked, a snapshot every step (4 kept). The bad group is one whose gradients step
    1's check vouches for, that no check draws in step 2, and that step 3's check draws: it flips every microbatch
    from step 2 on, in every incarnation. Step 2 commits its wrong gradients unseen; step 3 outvotes it. The run
    rolls back to step 1's snapshot (every group restarts and resumes from its node's memory) and computes step 2
    again, the bad group with it, which step 3 outvotes again: quarantined, and the run rolls back to step 1
    once more, without it. The other two end the run on the failure-free bits."""
    pairs = {s: (o := owner_and_index(s, 1.0, (0, 1, 2))[1], sdc.after(o, (0, 1, 2))) for s in (1, 2, 3)}
    bad = next((r for r in (0, 1, 2) if r in pairs[1] and r not in pairs[2] and r in pairs[3]), None)
    assert bad is not None, f"no group fits the scenario with seed {SEED}: {pairs}"
    keep = ["--recover.snapshot_interval", "1", "--recover.snapshot_keep", "4", "--checkpoint.no-enable"]
    plan = f"flip replica={bad} step=2 repeat=true"
    run = run_job(tmp_path / "dump", *SIX, *EXACT_EVERY_STEP, *CHECKS, "1", *keep, "--recover.fault_plan", plan)
    assert run.returncode == 0, run.output[-4000:]
    rollbacks = [(e["replica"], e["step"], e["to"]) for e in run.of("sdc_rollback")]
    assert rollbacks == [(bad, 3, 1), (bad, 3, 1)], rollbacks
    assert [e["step"] for e in run.of("resuming")] == [1, 1]
    [quarantined] = run.of("quarantined")
    assert quarantined["replica"] == bad
    kept, _ = undo_resumed(run.events)
    steps = [e for e in kept if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 7)) and steps[-1]["members"] == [
        r for r in (0, 1, 2) if r != bad
    ]
    result = compare_runs(exact_six.events, run.events, rel_tol=0.0, exact=True)
    assert not result.problems, result.problems
    assert result.steps == 6 and result.digest_steps == 6
