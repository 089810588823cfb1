"""bench/soak.py's pure parts: the fault schedule, the safety rule, the bookkeeping, growth, summary."""

import random
from collections import Counter
from typing import TypeVar

import pytest

from bench import soak
from titan_recover.policy.fault_plan import parse_fault_plan

pytestmark = pytest.mark.unit

T = TypeVar("T")


def present(found: T | None) -> T:
    """``found``, which the test expects to be there (None fails the test)."""
    assert found is not None
    return found


def test_schedule_draws_every_kind_evenly_in_random_order() -> None:
    deck = soak.make_schedule(100, soak.RANDOM_KINDS, random.Random(1))
    counts = Counter(deck)
    assert len(deck) == 100 and set(counts) == set(soak.RANDOM_KINDS)
    assert max(counts.values()) - min(counts.values()) <= 1
    assert deck != soak.make_schedule(100, soak.RANDOM_KINDS, random.Random(2))
    assert deck == soak.make_schedule(100, soak.RANDOM_KINDS, random.Random(1))  # seeded


def test_phase_plan_kills_in_every_phase_and_parses() -> None:
    plan, entries, end = soak.phase_plan(shards=2, gap=20, rng=random.Random(0))
    faults = parse_fault_plan(plan)
    assert sorted(f.phase for f in faults) == sorted(soak.PHASES)
    assert all(f.action == "kill" and f.replica in (0, 1) and f.rank in (0, 1) for f in faults)
    assert [(f.replica, f.incarnation, f.phase) for f in faults] == entries
    steps = [f.step for f in faults if f.step is not None]
    assert steps == sorted(steps) and end > max(steps)
    # the same replica is hit again only gap steps later, after it had time to rejoin
    assert [f.step for f in faults if f.replica == 0 and f.step] == [3, 23]


def _view(holders, joining=None, **kw) -> soak.View:
    return soak.View(frozenset(holders), dict(joining or {}), **kw)


@pytest.mark.parametrize("kind", soak.RANDOM_KINDS + (soak.LAUNCHER_KIND,))
def test_safety_rule_always_leaves_a_holder_and_spares_the_spare(kind: str) -> None:
    rng = random.Random(0)
    for _ in range(2000):
        holders = frozenset(r for r in range(4) if rng.random() < 0.6)
        joining = {r: 1 for r in range(4) if r not in holders and rng.random() < 0.5}
        in_flight = frozenset(r for r in range(4) if rng.random() < 0.2)
        view = soak.View(
            holders,
            joining,
            in_flight,
            spare=3,
            node1=frozenset({0, 1}),
            fresh=rng.choice([None, *joining]) if joining else None,
        )
        targets = soak.targets_for(kind, view, rng)
        if targets is None:
            continue
        assert 3 not in targets and not set(targets) & in_flight
        assert holders - set(targets), (kind, view, targets)  # one group still holds the state
        if kind != "kill_joiner":
            assert len(holders) >= 2
            assert set(targets) <= holders | set(joining)
        else:
            assert targets == (view.fresh,)


def test_targets_for_each_kind() -> None:
    rng = random.Random(0)
    full = _view({0, 1, 2}, spare=2)
    assert present(soak.targets_for("kill", full, rng))[0] in (0, 1)
    assert soak.targets_for("two_groups", full, rng) == (0, 1)
    assert (
        soak.targets_for("two_groups", _view({0, 2}, spare=2), rng) is None
    )  # would leave only... the spare, but 3 needed
    assert soak.targets_for("kill", _view({2}, spare=2), rng) is None  # fewer than 2 holders
    assert soak.targets_for("kill", _view({0, 2}, in_flight=frozenset({0}), spare=2), rng) is None
    # right after replica 0 was admitted: its donor is the lowest holder
    admitted = _view({1, 2}, {0: 3}, spare=2, fresh=0)
    assert soak.targets_for("kill_joiner", admitted, rng) == (0,)
    assert soak.targets_for("kill_donor", admitted, rng) == (1,)
    assert soak.targets_for("kill_donor", _view({2}, {0: 3, 1: 2}, spare=2, fresh=0), rng) is None  # donor = spare
    assert soak.targets_for("kill_joiner", _view({1, 2}, {0: 3}, spare=2), rng) is None  # no admission just now
    node = _view({0, 1, 2, 3}, spare=3, node1=frozenset({0, 1}))
    assert soak.targets_for(soak.LAUNCHER_KIND, node, rng) == (0, 1)
    assert soak.targets_for(soak.LAUNCHER_KIND, _view({0, 1}, spare=3, node1=frozenset({0, 1})), rng) is None


def test_pick_waits_for_the_head_kind_and_takes_transfers_at_admissions() -> None:
    rng = random.Random(0)
    schedule = ["kill_donor", "two_groups", "kill"]
    assert soak.pick(schedule, _view({0, 1, 2}, spare=2), rng) == (1, "two_groups", (0, 1))
    assert soak.pick(schedule, _view({1, 2}, {0: 1}, spare=2), rng) is None  # two_groups must wait
    assert soak.pick(schedule, _view({1, 2}, {0: 1}, spare=2, fresh=0), rng) == (0, "kill_donor", (1,))


def _step(step, members, t=0.0):
    return {
        "event": "step",
        "step": step,
        "members": members,
        "time": t,
        "microbatches": [0, 1],
        "data_digest": 7,
        "loss": 5.0,
    }


def _failure(replica, step, t=0.0):
    return {"event": "failure", "replica": replica, "step": step, "cause": "x", "time": t}


def test_tracker_resolves_a_fault_after_its_failure_and_a_later_step() -> None:
    tr = soak.Tracker(3, spare=2)
    tr.feed(_step(1, [0, 1, 2]), 1.0)
    assert tr.gate_open()
    fault = tr.inject("kill", (0,), 2.0, wall=100.0)
    assert not tr.gate_open() and tr.view(2.0).in_flight == {0}
    assert tr.feed(_step(2, [0, 1, 2]), 2.5) == []  # committed before the failure was seen
    tr.feed(_failure(0, 3), 3.0)
    assert tr.holders == {1, 2} and not tr.gate_open()
    tr.feed({"event": "recovered", "latency_s": 0.0, "time": 101.25}, 3.1)
    assert fault.recovery_s == 1.25  # from the fault itself, not from its detection
    assert tr.feed(_step(3, [1, 2]), 3.5) == [fault]
    assert fault.outcome == "survived" and fault.recovered_step == 3 and fault.record()["detect_s"] == 1.0
    assert tr.gate_open()
    tr.feed({"event": "admitted", "replica": 0, "attempt": 1, "epoch": 3, "step": 9}, 10.0)
    assert tr.view(10.2).fresh == 0 and tr.view(11.5).fresh is None and tr.incarnations[0] == 1
    tr.feed(_step(4, [0, 1, 2]), 11.0)
    assert tr.holders == {0, 1, 2} and not tr.joining


def test_tracker_plan_faults_slow_ranks_collateral_and_timeouts() -> None:
    tr = soak.Tracker(3, spare=2)
    tr.feed(_step(1, [0, 1, 2], t=100.0), 1.0)
    # a plan fault: its own event, read after the failure (two event files)
    tr.feed(_failure(1, 2, t=100.5), 2.0)
    tr.feed(
        {
            "event": "fault_injected",
            "action": "kill",
            "phase": "optimizer",
            "replica": 1,
            "rank": 0,
            "attempt": 0,
            "step": 2,
            "time": 100.4,
        },
        2.1,
    )
    (plan,) = tr.pending()
    assert plan.kind == "kill_optimizer" and plan.failed
    tr.feed(_step(2, [0, 2]), 3.0)
    assert plan.outcome == "survived"
    # a slow rank not fenced: resolved once it was woken and a step committed after
    slow = tr.inject("slow", (0,), 4.0, seconds=1.0)
    slow.cont_at = 5.0
    assert tr.tick(6.0, settle_s=4.0, timeout_s=120.0) == []
    tr.feed(_step(3, [0, 2]), 7.0)
    assert tr.tick(9.5, settle_s=4.0, timeout_s=120.0) == [slow] and slow.outcome == "survived"
    # a failure nobody aimed at
    tr.feed(_failure(0, 4), 10.0)
    tr.settle_unmatched(20.0)
    assert [e["replica"] for e in tr.collateral] == [0]
    # a fault never followed by its failure
    stuck = tr.inject("stop", (2,), 30.0)
    assert tr.tick(200.0, settle_s=4.0, timeout_s=120.0) == [stuck] and stuck.outcome == "unresolved"


def _resources(replica, step, rss, threads, fds, process="rank"):
    return {
        "event": "resources",
        "process": process,
        "replica": replica,
        "rank": 0,
        "step": step,
        "rss_mb": rss,
        "threads": threads,
        "fds": fds,
        "parked": 0,
    }


def test_growth_follows_one_incarnation() -> None:
    events = [
        _resources(0, 5, 100.0, 10, 20),
        _resources(2, 5, 200.0, 12, 30),
        {"event": "admitted", "replica": 0, "attempt": 1},
        _resources(0, 9, 50.0, 8, 15),  # replica 0's next incarnation: not the same process
        _resources(2, 9, 210.0, 12, 31),
        _resources(2, 20, 220.0, 13, 30),
        _resources(None, 20, 80.0, 4, 9, process="coordinator"),
        _resources(None, 30, 81.0, 4, 11, process="coordinator"),
    ]
    g = present(soak.survivor_growth(events, replica=2))
    assert (g["replica"], g["attempt"], g["samples"]) == (2, 0, 3)
    assert g["rss_growth_ratio"] == 1.1 and g["fd_growth"] == 0 and g["thread_growth"] == 1
    assert present(soak.survivor_growth(events))["replica"] == 2  # the longest-lived incarnation
    zero = present(soak.survivor_growth(events, replica=0))
    assert (zero["attempt"], zero["samples"]) == (0, 1)  # attempt 0's only sample; attempt 1's is apart
    assert present(soak.coordinator_growth(events))["fd_growth"] == 2


def test_summarize_counts_violations_and_survivors() -> None:
    ref = [_step(1, [0, 1, 2]), _step(2, [0, 1, 2])]
    run = [
        _step(1, [0, 1, 2]),
        _failure(1, 2),
        {"event": "recovered", "latency_s": 0.7},
        {**_step(2, [0, 2]), "loss": 5.1},
        {"event": "rejoined", "replica": 1, "downtime_s": 12.5},
        *({"event": "param_digest", "step": 2, "replica": r, "digest": "ab"} for r in (0, 2)),
    ]
    tr = soak.Tracker(3, spare=2)
    fault = tr.inject("kill", (1,), 0.0)
    fault.outcome = "survived"
    slow = tr.inject("slow", (0,), 0.0)
    slow.outcome = "unresolved"
    r = soak.summarize(tr.faults, run, ref, replicas=3, steps=2, spare=2, hang=None, exit_codes={"node0": 0})
    assert r["faults_injected"] == 2 and r["faults_survived"] == 1 and r["hangs"] == 1
    assert r["faults_by_kind"] == {"kill": 1, "slow": 1}
    assert r["max_recovery_latency_s"] == 0.7 and r["max_rejoin_downtime_s"] == 12.5
    # step 2's loss is 2% off, replica 1 logged no digest at the last step
    assert r["invariant_violations"] == 2, r["violations"]
    assert "faults injected" in soak.format_table(r)


def test_growth_like_for_like_counts_only_samples_with_as_many_members() -> None:
    events = [
        _step(3, [1, 2]),
        _resources(2, 3, 100.0, 10, 23),
        _step(4, [2]),
        _resources(2, 4, 101.0, 7, 18),
        _step(9, [0, 1, 2]),
        _resources(2, 9, 103.0, 12, 28),
        _step(12, [1, 2]),
        _resources(2, 12, 104.0, 10, 24),
    ]
    g = present(soak.survivor_growth(events, replica=2))
    assert g["fd_growth"] == 1 and g["rss_growth_ratio"] == 1.04
    assert g["same_members"] == {
        "members": 2,
        "samples": 2,
        "rss_growth_ratio": 1.04,
        "thread_growth": 0,
        "fd_growth": 1,
    }
    assert g["rss_growth_ratio_second_half"] == round(104.0 / 103.0, 4)


def test_pick_makes_an_admission_when_only_transfer_kinds_are_left() -> None:
    rng = random.Random(0)
    schedule = ["kill_joiner", "kill_donor"]
    i, kind, (target,) = present(soak.pick(schedule, _view({0, 1, 2}, spare=2), rng))
    assert (i, kind) == (-1, "kill") and target in (0, 1)  # an extra kill, not from the schedule
    assert soak.pick(schedule, _view({1, 2}, spare=2, down=frozenset({0})), rng) is None  # one is coming
    assert soak.pick(schedule, _view({1, 2}, {0: 1}, spare=2), rng) is None
    assert present(soak.pick(schedule, _view({1, 2}, {0: 1}, spare=2, fresh=0), rng))[:2] == (0, "kill_joiner")
    tr = soak.Tracker(3, spare=2)
    tr.feed(_failure(0, 1), 1.0)
    assert tr.view(1.0).down == {0}


def test_loss_past_the_tolerance_is_a_violation_unless_the_control_drifts_as_far() -> None:
    ref = [_step(n, [0, 1, 2]) for n in (1, 2, 3)]
    run = [_step(1, [0, 1, 2]), {**_step(2, [0, 2]), "loss": _step(2, [0])["loss"] * 1.003}, _step(3, [0, 1, 2])]
    far = soak.compare_runs(ref, run, soak.REL_TOL)
    assert list(far.loss) == [2] and not far.exact
    assert soak.loss_violations(far, None) == [
        "step 2: loss 5.015000 vs 5.000000 (rel 3.00e-03): past 0.001, no control run"
    ]
    control = [*ref[:2], {**ref[2], "loss": ref[2]["loss"] * (1 - 0.002)}]  # drifts 2e-3: 3e-3 is within 2x
    assert soak.loss_violations(far, soak.compare_runs(ref, control, soak.REL_TOL)) == []
    calm = [*ref[:2], {**ref[2], "loss": ref[2]["loss"] * (1 + 1e-4)}]  # drifts 1e-4: 3e-3 is not float rounding
    assert (
        "more than 2 x the control's 1.00e-04"
        in soak.loss_violations(far, soak.compare_runs(ref, calm, soak.REL_TOL))[0]
    )
    near = soak.compare_runs(ref, calm, soak.REL_TOL)
    assert soak.loss_violations(near, None) == []  # within the tolerance: nothing to explain
