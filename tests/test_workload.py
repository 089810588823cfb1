"""Tests for titan_recover.policy.workload: exact, deterministic microbatch ownership."""

from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from titan_recover.policy import workload
from titan_recover.policy.workload import (
    POLICIES,
    Speeds,
    WorkloadError,
    assign,
    check_assignment,
    get_policy,
    predicted_step_s,
    reassign,
    register_policy,
    update_speeds,
)

SPEEDS_SAMPLE = {0: 2.0, 1: 0.5, 2: 1.25, 3: 3.0, 5: 0.1, 8: 7.0}


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Let a test register policies without leaking them into other tests."""
    registry = dict(workload.POLICIES)
    monkeypatch.setattr(workload, "POLICIES", registry)
    return registry


def _flatten(assignment: dict[int, tuple[int, ...]]) -> list[int]:
    return [mb for replica in sorted(assignment) for mb in assignment[replica]]


# --- assign ---------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("policy", ["balanced", "speed"])
def test_assign_covers_every_id_once_contiguously(policy: str) -> None:
    for num_replicas in range(1, 13):
        live = list(range(0, 2 * num_replicas, 2))  # non-contiguous ids
        speeds = {r: 0.5 + (r % 5) for r in live}
        for num_mb in range(1, 41):
            result = assign(policy, live, num_mb, speeds)
            assert list(result) == sorted(live)
            check_assignment(result, num_mb)
            # Contiguous blocks in replica-id order: concatenation is 0..M-1.
            assert _flatten(result) == list(range(num_mb))
            assert all(ids == tuple(sorted(ids)) for ids in result.values())


@pytest.mark.unit
def test_balanced_quotas_differ_by_at_most_one_extras_to_lowest_ids() -> None:
    for num_replicas in range(1, 11):
        live = list(range(num_replicas))
        for num_mb in range(1, 35):
            sizes = [len(assign("balanced", live, num_mb)[r]) for r in live]
            base, extra = divmod(num_mb, num_replicas)
            assert sizes == [base + 1] * extra + [base] * (num_replicas - extra)


@pytest.mark.unit
def test_more_replicas_than_microbatches_gives_some_zero_quotas() -> None:
    result = assign("balanced", [4, 1, 9, 3, 7], 3)
    assert result == {1: (0,), 3: (1,), 4: (2,), 7: (), 9: ()}
    check_assignment(result, 3)


@pytest.mark.unit
def test_matches_stock_hsdp_data_order_when_divisible() -> None:
    for num_replicas in range(1, 9):
        for per_replica in range(1, 6):
            num_mb = num_replicas * per_replica
            for policy in ("balanced", "speed"):
                result = assign(policy, range(num_replicas), num_mb)
                for i in range(num_replicas):
                    lo, hi = i * num_mb // num_replicas, (i + 1) * num_mb // num_replicas
                    assert result[i] == tuple(range(lo, hi))


@pytest.mark.unit
def test_assign_independent_of_live_order_and_iterable_type() -> None:
    expected = assign("balanced", [0, 1, 2], 7)
    assert assign("balanced", [2, 0, 1], 7) == expected
    assert assign("balanced", (r for r in (1, 2, 0)), 7) == expected
    ids = [0, 1, 2, 5]
    speeds = {0: 1.5, 1: 0.7, 2: 2.2, 5: 1.1}
    reference = assign("speed", ids, 23, speeds)
    for perm in itertools.permutations(ids):
        shuffled_speeds = {r: speeds[r] for r in reversed(perm)}
        assert assign("speed", perm, 23, shuffled_speeds) == reference


@pytest.mark.unit
def test_single_live_replica_gets_everything() -> None:
    assert assign("balanced", [7], 5) == {7: (0, 1, 2, 3, 4)}
    assert assign("speed", [7], 5, {7: 0.3}) == {7: (0, 1, 2, 3, 4)}


# --- speed policy ---------------------------------------------------------


@pytest.mark.unit
def test_speed_gives_faster_replica_more() -> None:
    assert assign("speed", [0, 1], 8, {0: 3.0, 1: 1.0}) == {0: (0, 1, 2, 3, 4, 5), 1: (6, 7)}
    quotas = POLICIES["speed"]((0, 1, 2), 10, {0: 1.0, 1: 4.0, 2: 1.0})
    assert quotas[1] > quotas[0] and quotas[1] > quotas[2]


@pytest.mark.unit
def test_speed_quotas_are_floor_or_ceil_of_exact_share_and_largest_remainder() -> None:
    rng = random.Random(1234)
    for _ in range(300):
        live = tuple(sorted(rng.sample(range(20), rng.randint(1, 8))))
        speeds = {r: rng.uniform(0.01, 10.0) for r in live}
        num_mb = rng.randint(0, 60)
        quotas = POLICIES["speed"](live, num_mb, speeds)
        assert sum(quotas.values()) == num_mb
        total = sum(Fraction(s) for s in speeds.values())
        exact = {r: num_mb * Fraction(speeds[r]) / total for r in live}
        for r in live:
            assert quotas[r] in (math.floor(exact[r]), math.ceil(exact[r]))
        # Largest remainder: any replica rounded up has a remainder >= any rounded down.
        up = [exact[r] - math.floor(exact[r]) for r in live if quotas[r] > exact[r]]
        down = [exact[r] - math.floor(exact[r]) for r in live if quotas[r] < exact[r]]
        if up and down:
            assert min(up) >= max(down)


@pytest.mark.unit
def test_speed_ties_go_to_lowest_replica_id() -> None:
    assert POLICIES["speed"]((0, 1, 2), 4, {2: 1.0, 1: 1.0, 0: 1.0}) == {0: 2, 1: 1, 2: 1}
    assert POLICIES["speed"]((3, 5), 3, {5: 2.0, 3: 2.0}) == {3: 2, 5: 1}


@pytest.mark.unit
def test_speed_none_or_empty_equals_balanced() -> None:
    for num_mb in range(1, 20):
        expected = assign("balanced", [0, 1, 2, 3], num_mb)
        assert assign("speed", [0, 1, 2, 3], num_mb, None) == expected
        assert assign("speed", [0, 1, 2, 3], num_mb, {}) == expected


@pytest.mark.unit
def test_speed_missing_replica_defaults_to_mean_of_measured_live() -> None:
    # Mean of {0: 1, 1: 3} is 2, so replica 2 behaves as speed 2: quotas 2/6/4 of 12.
    assert POLICIES["speed"]((0, 1, 2), 12, {0: 1.0, 1: 3.0}) == {0: 2, 1: 6, 2: 4}
    # Dead replicas' speeds (even 0, from a stall) neither count toward the mean nor raise.
    assert POLICIES["speed"]((0, 1, 2), 12, {0: 1.0, 1: 3.0, 9: 0.0, 8: 100.0}) == {0: 2, 1: 6, 2: 4}


@pytest.mark.unit
def test_speed_exact_despite_float_rounding() -> None:
    # 0.1 + 0.2 != 0.3 in floats; exact rationals keep every rank identical and sums exact.
    speeds = {0: 0.1, 1: 0.2, 2: 0.3}
    first = POLICIES["speed"]((0, 1, 2), 600, speeds)
    assert sum(first.values()) == 600
    assert first == POLICIES["speed"]((0, 1, 2), 600, dict(reversed(list(speeds.items()))))


@pytest.mark.unit
def test_speed_uses_exact_values_of_the_given_floats() -> None:
    # Nominally 7.5 / 2.5 (a tie, which float math would hand to replica 0), but the
    # binary float 0.3 is slightly below 3 * 0.1, so replica 1's exact remainder wins.
    assert Fraction(0.3) < 3 * Fraction(0.1)
    assert POLICIES["speed"]((0, 1), 10, {0: 0.3, 1: 0.1}) == {0: 7, 1: 3}


# --- reassign -------------------------------------------------------------


@pytest.mark.unit
def test_reassign_one_failure_concrete() -> None:
    start = assign("balanced", range(4), 8)
    assert start == {0: (0, 1), 1: (2, 3), 2: (4, 5), 3: (6, 7)}
    after = reassign("balanced", start, [0, 2, 3])
    assert after == {0: (0, 1, 2), 2: (3, 4, 5), 3: (6, 7)}


@pytest.mark.unit
def test_reassign_single_survivor_gets_everything() -> None:
    start = assign("balanced", range(4), 10)
    assert reassign("balanced", start, [2]) == {2: tuple(range(10))}


def _check_reassign(before: dict, after: dict, live: list[int], num_mb: int) -> None:
    assert list(after) == sorted(live)
    check_assignment(after, num_mb)
    for replica in live:
        assert set(before.get(replica, ())) <= set(after[replica])
        assert after[replica] == tuple(sorted(after[replica]))


@pytest.mark.unit
@pytest.mark.parametrize("policy", ["balanced", "speed"])
def test_reassign_two_failures_in_one_step_keeps_invariants(policy: str) -> None:
    for num_replicas in range(2, 7):
        replicas = list(range(num_replicas))
        speeds = {r: 1.0 + r for r in replicas}
        for num_mb in range(1, 17):
            start = assign(policy, replicas, num_mb, speeds)
            for first, second in itertools.permutations(replicas, 2):
                live1 = [r for r in replicas if r != first]
                mid = reassign(policy, start, live1, speeds)
                _check_reassign(start, mid, live1, num_mb)
                live2 = [r for r in live1 if r != second]
                if not live2:
                    continue
                end = reassign(policy, mid, live2, speeds)
                _check_reassign(mid, end, live2, num_mb)
                # Survivors of both failures still hold their original ids.
                for replica in live2:
                    assert set(start[replica]) <= set(end[replica])


@pytest.mark.unit
def test_reassign_without_loss_is_identity() -> None:
    start = assign("balanced", range(3), 7)
    assert reassign("balanced", start, [2, 1, 0]) == start


@pytest.mark.unit
def test_reassign_independent_of_live_order() -> None:
    start = assign("balanced", range(5), 13)
    expected = reassign("balanced", start, [0, 2, 4])
    for perm in itertools.permutations([0, 2, 4]):
        assert reassign("balanced", start, perm) == expected


@pytest.mark.unit
def test_reassign_speed_gives_lost_work_to_faster_survivor() -> None:
    start = assign("balanced", range(3), 9)
    after = reassign("speed", start, [0, 2], {0: 1.0, 2: 2.0})
    # Lost ids 3,4,5 split 1:2, contiguous in replica order.
    assert after == {0: (0, 1, 2, 3), 2: (4, 5, 6, 7, 8)}


@pytest.mark.unit
def test_reassign_rejoiner_absent_from_assignment() -> None:
    start = assign("balanced", [0, 1], 4)
    # No lost ids: the rejoiner is included and owns nothing.
    assert reassign("balanced", start, [0, 1, 5]) == {0: (0, 1), 1: (2, 3), 5: ()}
    # Lost ids: the rejoiner takes its policy share like any survivor.
    after = reassign("balanced", start, [0, 5])
    assert after == {0: (0, 1, 2), 5: (3,)}
    check_assignment(after, 4)


# --- check_assignment -----------------------------------------------------


@pytest.mark.unit
def test_check_assignment_accepts_valid() -> None:
    check_assignment({0: (0, 2), 1: (1,), 3: ()}, 3)


@pytest.mark.unit
def test_check_assignment_reports_missing_duplicated_out_of_range() -> None:
    with pytest.raises(WorkloadError, match=r"missing microbatch ids \[2, 4\]"):
        check_assignment({0: (0, 1), 1: (3,)}, 5)
    with pytest.raises(WorkloadError, match=r"duplicated microbatch ids \[1\]"):
        check_assignment({0: (0, 1), 1: (1, 2)}, 3)
    with pytest.raises(WorkloadError, match=r"out of range \[0, 3\): \[-1, 3, 10\]"):
        check_assignment({0: (0, 1, 10), 1: (2, 3, -1)}, 3)


@pytest.mark.unit
@pytest.mark.parametrize("bad", [0, -2, 1.5])
def test_check_assignment_rejects_bad_num_microbatches(bad: Any) -> None:  # Any: the wrong type on purpose
    with pytest.raises(WorkloadError, match=f"num_microbatches.*got {bad}"):
        check_assignment({0: (0,)}, bad)


# --- errors and registry --------------------------------------------------


@pytest.mark.unit
def test_workload_error_is_value_error() -> None:
    assert issubclass(WorkloadError, ValueError)


@pytest.mark.unit
@pytest.mark.parametrize("live", [[], (), iter(())])
def test_no_live_replicas(live) -> None:
    with pytest.raises(WorkloadError, match="no live replicas"):
        assign("balanced", live, 4)


@pytest.mark.unit
def test_reassign_no_live_replicas() -> None:
    with pytest.raises(WorkloadError, match="no live replicas"):
        reassign("balanced", {0: (0,)}, [])


@pytest.mark.unit
@pytest.mark.parametrize("bad", [0, -3])
def test_num_microbatches_must_be_positive(bad: int) -> None:
    with pytest.raises(WorkloadError, match=f"num_microbatches must be >= 1, got {bad}"):
        assign("balanced", [0], bad)


@pytest.mark.unit
@pytest.mark.parametrize("bad", [2.5, True, "4"])
def test_num_microbatches_must_be_int(bad: Any) -> None:  # Any: the wrong type on purpose
    with pytest.raises(WorkloadError, match=f"num_microbatches must be an int, got {bad!r}"):
        assign("balanced", [0], bad)


@pytest.mark.unit
def test_unknown_policy_names_choices() -> None:
    with pytest.raises(WorkloadError, match="unknown workload policy 'x'; choose one of: balanced, speed"):
        assign("x", [0], 1)
    with pytest.raises(WorkloadError, match="unknown workload policy 'fast'"):
        reassign("fast", {0: (0,)}, [0])
    with pytest.raises(WorkloadError, match="unknown workload policy 'nope'"):
        get_policy("nope")


@pytest.mark.unit
@pytest.mark.parametrize(("bad", "shown"), [(-1.0, "-1.0"), (0, "0.0"), (math.nan, "nan"), (math.inf, "inf")])
def test_speed_must_be_positive_and_finite(bad: float, shown: str) -> None:
    with pytest.raises(WorkloadError, match=f"speed for replica 3 must be finite and > 0, got {shown}"):
        assign("speed", [1, 3], 4, {1: 1.0, 3: bad})


@pytest.mark.unit
def test_replica_ids_must_be_unique() -> None:
    with pytest.raises(WorkloadError, match=r"replica ids must be unique, got duplicates \[1, 4\]"):
        assign("balanced", [1, 4, 2, 1, 4], 4)
    with pytest.raises(WorkloadError, match="replica ids must be unique"):
        reassign("balanced", {0: (0,), 1: (1,)}, [0, 0])


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["0", 1.0, None, True])
def test_replica_ids_must_be_ints(bad: Any) -> None:  # Any: the wrong type on purpose
    with pytest.raises(WorkloadError, match=f"replica ids must be ints, got {bad!r}"):
        assign("balanced", [0, bad], 4)


@pytest.mark.unit
def test_reassign_rejects_assignment_with_shared_ids() -> None:
    with pytest.raises(WorkloadError, match=r"microbatch ids \[1, 2\] to more than one replica"):
        reassign("balanced", {0: (0, 1, 2), 1: (1, 2, 3)}, [0])


@pytest.mark.unit
def test_get_policy_returns_builtins() -> None:
    assert get_policy("balanced") is workload.balanced
    assert get_policy("speed") is workload.speed
    assert set(POLICIES) >= {"balanced", "speed"}


@pytest.mark.unit
def test_register_policy_is_usable(isolated_registry: dict) -> None:
    def all_to_last(live, num_items, speeds):
        return {r: (num_items if r == live[-1] else 0) for r in live}

    register_policy("last", all_to_last)
    assert get_policy("last") is all_to_last
    assert assign("last", [2, 0, 1], 3) == {0: (), 1: (), 2: (0, 1, 2)}
    with pytest.raises(WorkloadError, match="choose one of: balanced, last, speed"):
        get_policy("x")


@pytest.mark.unit
def test_register_policy_rejects_duplicates(isolated_registry: dict) -> None:
    with pytest.raises(WorkloadError, match="'balanced' is already registered"):
        register_policy("balanced", lambda live, n, speeds: {})
    assert isolated_registry["balanced"] is workload.balanced
    register_policy("mine", workload.balanced)
    with pytest.raises(WorkloadError, match="'mine' is already registered"):
        register_policy("mine", workload.speed)


@pytest.mark.unit
def test_register_policy_rejects_non_callable(isolated_registry: dict) -> None:
    with pytest.raises(TypeError, match="'bad' must be callable"):
        register_policy("bad", 42)  # type: ignore[arg-type]  # not callable, on purpose
    assert "bad" not in isolated_registry


@pytest.mark.unit
@pytest.mark.parametrize(
    "quotas",
    [
        {0: 2},  # missing a live replica
        {0: 2, 1: 1, 2: 0},  # extra replica
        {0: 1, 1: 1},  # wrong sum
        {0: 3, 1: -1},  # negative
        {0: 1.0, 1: 1},  # not int
    ],
)
def test_misbehaving_policy_is_rejected(isolated_registry: dict, quotas: dict) -> None:
    register_policy("broken", lambda live, n, speeds: dict(quotas))
    with pytest.raises(WorkloadError, match=r"workload policy 'broken' returned .* summing to 3"):
        assign("broken", [0, 1], 3)


def test_module_does_not_import_torch() -> None:
    code = "import sys, titan_recover.policy.workload; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


# --- measured speeds: smoothing, hysteresis, transfer ----------------------------------


def _settle(speeds: Speeds, measured: dict[int, float], steps: int, live=(0, 1), m: int = 8) -> list[dict[int, int]]:
    quotas = []
    for _ in range(steps):
        quotas.append(assign("speed", live, m, speeds.rates()))
        speeds = update_speeds(speeds, measured, live, m, smoothing=0.5, threshold=0.1)
    return [{r: len(ids) for r, ids in q.items()} for q in quotas]


@pytest.mark.unit
def test_equal_replicas_keep_equal_quotas_under_noise() -> None:
    rng = random.Random(0)
    speeds = Speeds()
    for _ in range(200):
        noisy = {r: 1.0 + rng.uniform(-0.05, 0.05) for r in (0, 1, 2, 3)}
        speeds = update_speeds(speeds, noisy, (0, 1, 2, 3), 8, smoothing=0.3, threshold=0.1)
        assert {r: len(ids) for r, ids in assign("speed", (0, 1, 2, 3), 8, speeds.rates()).items()} == {
            0: 2,
            1: 2,
            2: 2,
            3: 2,
        }


@pytest.mark.unit
def test_a_4x_straggler_gets_fewer_microbatches_after_one_step() -> None:
    quotas = _settle(Speeds(), {0: 1.0, 1: 4.0}, steps=4)
    assert quotas[0] == {0: 4, 1: 4}  # nothing measured yet
    assert quotas[1:] == [{0: 6, 1: 2}] * 3  # 6 x 1 s and 2 x 4 s: 8 s against 16 s balanced


@pytest.mark.unit
def test_a_small_gain_does_not_move_work() -> None:
    assert _settle(Speeds(), {0: 1.0, 1: 1.05}, steps=5) == [{0: 4, 1: 4}] * 5


@pytest.mark.unit
def test_smoothing_follows_a_replica_that_recovers() -> None:
    speeds = Speeds()
    for _ in range(3):
        speeds = update_speeds(speeds, {0: 1.0, 1: 4.0}, (0, 1), 8, smoothing=0.5, threshold=0.1)
    assert speeds.estimate == {0: 1.0, 1: 4.0}
    for _ in range(10):
        speeds = update_speeds(speeds, {0: 1.0, 1: 1.0}, (0, 1), 8, smoothing=0.5, threshold=0.1)
    assert {r: len(i) for r, i in assign("speed", (0, 1), 8, speeds.rates()).items()} == {0: 4, 1: 4}


@pytest.mark.unit
def test_a_replica_that_computed_nothing_keeps_its_estimate_and_a_new_one_gets_the_mean() -> None:
    speeds = update_speeds(Speeds(), {0: 1.0, 1: 3.0}, (0, 1), 8, 0.5, 0.1)
    kept = update_speeds(speeds, {0: 1.0}, (0, 1, 2), 8, 0.5, 0.1)
    assert kept.estimate[1] == 3.0
    assert predicted_step_s({0: 4, 1: 2, 2: 2}, kept.estimate) == 6.0  # replica 2 counts at the mean, 2.0


@pytest.mark.unit
def test_update_refuses_a_bad_measurement() -> None:
    with pytest.raises(WorkloadError, match="replica 1"):
        update_speeds(Speeds(), {1: float("nan")}, (0, 1), 4, 0.5, 0.1)


@pytest.mark.unit
def test_speeds_travel_as_json_exactly_and_bad_input_is_named() -> None:
    speeds = update_speeds(Speeds(), {0: 0.1234567891234, 3: 2.0}, (0, 3), 8, 0.3, 0.1)
    assert Speeds.from_json(json.loads(json.dumps(speeds.to_json()))) == speeds
    assert Speeds.from_json({"estimate": {}, "applied": {}}).rates() is None
    bad: object
    for bad in [
        None,
        {"estimate": []},
        {"estimate": {"x": 1.0}, "applied": {}},
        {"estimate": {"1": -1.0}, "applied": {}},
        {"estimate": {"1": True}, "applied": {}},
    ]:
        with pytest.raises(WorkloadError, match="speeds"):
            Speeds.from_json(bad)
