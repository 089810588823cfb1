"""``[recover] sdc_check``'s pure parts: the seeded draw, who computes a checked microbatch again, and the
verdict of the groups' digests; the keys' refusals."""

from __future__ import annotations

import pytest
from test_config import load

from titan_recover.config import ConfigError
from titan_recover.policy import sdc

pytestmark = pytest.mark.unit


def test_the_draw_is_the_runs_seed_and_the_step_alone_and_checks_about_the_rate() -> None:
    drawn = [sdc.checked_microbatch(7, step, 0.05, 8) for step in range(1, 20_001)]
    assert drawn == [sdc.checked_microbatch(7, step, 0.05, 8) for step in range(1, 20_001)]  # every rank alike
    checked = [m for m in drawn if m is not None]
    assert 0.045 < len(checked) / len(drawn) < 0.055, len(checked)
    assert {m: checked.count(m) for m in range(8)}.keys() == set(checked)  # every microbatch id drawn
    assert min(checked.count(m) for m in range(8)) > len(checked) / 8 * 0.8
    assert drawn != [sdc.checked_microbatch(8, step, 0.05, 8) for step in range(1, 20_001)]  # another seed
    assert all(sdc.checked_microbatch(0, step, 1.0, 6) is not None for step in range(1, 1000))
    assert all(sdc.checked_microbatch(0, step, 0.0, 6) is None for step in range(1, 1000))


def test_the_checker_is_the_member_after_the_owner_and_the_third_the_one_after_both() -> None:
    assert sdc.after(1, (0, 1, 2)) == 2
    assert sdc.after(2, (0, 1, 2)) == 0  # cyclic
    assert sdc.after(0, (0, 3, 5)) == 3
    assert sdc.after(4, (0, 3, 5)) == 5  # a replica that left: the member after its id
    assert sdc.after(0, (0,)) is None  # one group: no second opinion
    assert sdc.after(2, (0, 1, 2), skip=(1, 2)) == 0
    assert sdc.after(1, (0, 1), skip=(0, 1)) is None  # two groups: no third


def test_a_digest_is_nonzero_and_below_its_slot_and_moves_with_any_bit() -> None:
    a = sdc.digest([b"\x00" * 64, b"\x01\x02"])
    assert 0 < a < 2**sdc.DIGEST_BITS
    assert sdc.digest([b"\x00" * 64, b"\x01\x03"]) != a
    assert sdc.digest([memoryview(b"\x00" * 64), b"\x01\x02"]) == a


@pytest.mark.parametrize(
    ("shards", "expected"),
    [
        ([{0: 5, 1: 5}], sdc.Verdict(agree=True)),
        ([{0: 5}], sdc.Verdict(agree=True)),  # one opinion (the checker left): nothing to compare
        ([{0: 5, 1: 6}], sdc.Verdict(agree=False, undecided=True)),  # two that differ: no majority
        ([{0: 5, 1: 6, 2: 5}], sdc.Verdict(agree=False, outvoted=(1,))),
        ([{0: 5, 1: 5, 2: 5}, {0: 7, 1: 7, 2: 8}], sdc.Verdict(agree=False, outvoted=(2,))),  # shard 1's
        ([{0: 5, 1: 6, 2: 7}], sdc.Verdict(agree=False, undecided=True)),  # a third agreeing with neither
        ([{0: 5, 1: 6, 2: 5}, {0: 7, 1: 8, 2: 9}], sdc.Verdict(agree=False, outvoted=(1,), undecided=True)),
    ],
)
def test_the_verdict_over_the_shards(shards: list[dict[int, int]], expected: sdc.Verdict) -> None:
    assert sdc.verdict(shards) == expected


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--recover.sdc_check"], "recover.sdc_check compares two replica groups' gradients"),
        (["--recover.exact", "--recover.sdc_check", "--recover.sdc_check_rate", "0"], "sdc_check_rate = 0"),
        (["--recover.exact", "--recover.sdc_check", "--recover.sdc_check_rate", "1.5"], "in (0, 1]"),
        (["--recover.exact", "--recover.sdc_check", "--recover.sdc_check_rate", "nan"], "sdc_check_rate = nan"),
    ],
)
def test_the_checks_outside_exact_mode_or_at_an_impossible_rate_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(*overrides)
    assert message in str(info.value)


def test_the_checks_load_in_exact_mode() -> None:
    rc = load("--recover.exact", "--recover.sdc_check", "--recover.sdc_check_rate", "0.25").recover
    assert rc.sdc_check and rc.sdc_check_rate == 0.25


def test_each_group_puts_its_digest_and_its_device_models_in_its_own_slots() -> None:
    """What a rank adds to the replicate all-reduce: the checked microbatch's digest (0 until computed) and its
    device model's; the sum over the groups holds each in its group's slot. Two models among the members: the
    first step warns (``RecoverTrainer._tell_models``)."""
    import torch

    from titan_recover.rank.sdc_checks import Checks

    cpu = torch.device("cpu")
    mine = Checks(0, 1.0, 4, replica=1, replica_slots=3, device=cpu)
    other = Checks(0, 1.0, 4, replica=2, replica_slots=3, device=cpu)
    assert mine.begin(1) is not None
    mine.note(mine.microbatch or 0, [torch.ones(3)])
    summed = mine.slots() + other.slots()
    assert summed[0] == 0 and summed[1] == mine.mine != 0 and summed[2] == 0  # the other has not computed it
    assert mine.models(summed) == 1
    summed[3] = 12345  # replica 0 on another model
    assert mine.models(summed) == 2


def test_the_start_says_how_soon_a_bad_device_is_caught_and_whether_the_snapshots_reach_back_that_far() -> None:
    said, enough = sdc.reach(4, 0.05, 10, 1)
    assert "caught after about 40 step(s) on average, 120 at the 95th percentile" in said and not enough
    assert "reach back 10 step(s)" in said and "raise recover.snapshot_keep to 12" in said
    said, enough = sdc.reach(3, 1.0, 1, 8)
    assert enough and "about 2 step(s) on average, 5 at the 95th percentile" in said
    said, enough = sdc.reach(2, 0.5, 0, 1)
    assert not enough and "set recover.snapshot_interval" in said and "about 2 step(s)" in said


def test_the_benchs_catch_delay_follows_the_ranks_draw_and_the_geometric_expectation() -> None:
    """``bench.sdc``'s count: with two groups every checked step draws a bad group's microbatch (it owns it or
    checks it), so at every step it is caught at once; with four, half the microbatches involve it."""
    from bench.sdc import catch_delay

    two = catch_delay(100, 1.0, 2, 12)
    assert two["mean_steps"] == two["expected_mean_steps"] == 1.0 and two["p95_steps"] == 1
    four = catch_delay(400, 1.0, 4, 8)
    assert four["expected_mean_steps"] == 2.0 and 1.7 < four["mean_steps"] < 2.3
    assert four["not_caught_within"]["seeds"] == 0
