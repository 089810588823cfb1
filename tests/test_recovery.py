"""Tests for titan_recover.policy.steps: replayed microbatch ownership and the step tally."""

from __future__ import annotations

import random

import pytest
import torch

from titan_recover.policy import workload
from titan_recover.policy.membership import Membership
from titan_recover.policy.steps import (
    DIGEST,
    MICROBATCHES,
    TOKENS,
    InvariantError,
    StepSummary,
    new_tally,
    step_assignment,
    summarize,
    tally_leaving,
    tally_microbatch,
    tally_time,
)

pytestmark = pytest.mark.unit

# --- step_assignment -------------------------------------------------------------


@pytest.mark.parametrize("policy", ["balanced", "speed"])
@pytest.mark.parametrize("members, m", [((0, 1), 4), ((0, 1, 2, 3), 8), ((0, 2, 5), 7), ((3,), 1)])
def test_single_membership_equals_assign(policy: str, members: tuple[int, ...], m: int) -> None:
    got = step_assignment(policy, [Membership(4, members)], m)
    assert got == workload.assign(policy, members, m)


def test_single_membership_matches_stock_hsdp_blocks() -> None:
    assert step_assignment("balanced", [Membership(0, (0, 1, 2, 3))], 8) == {
        0: (0, 1),
        1: (2, 3),
        2: (4, 5),
        3: (6, 7),
    }


HISTORY = [Membership(0, (0, 1, 2, 3)), Membership(1, (0, 2, 3)), Membership(2, (0, 3))]


def owners(assignment: dict[int, tuple[int, ...]]) -> list[int]:
    return sorted(mb for ids in assignment.values() for mb in ids)


@pytest.mark.parametrize("m", [4, 5, 8, 13, 16])
def test_two_failures_every_id_owned_once_survivors_keep_theirs(m: int) -> None:
    start = step_assignment("balanced", HISTORY[:1], m)
    after_1 = step_assignment("balanced", HISTORY[:2], m)
    after_2 = step_assignment("balanced", HISTORY, m)
    for assignment, members in ((after_1, (0, 2, 3)), (after_2, (0, 3))):
        assert tuple(sorted(assignment)) == members
        assert owners(assignment) == list(range(m))
    # survivors keep every id they owned before each failure
    for r in (0, 2, 3):
        assert set(start[r]) <= set(after_1[r])
    for r in (0, 3):
        assert set(after_1[r]) <= set(after_2[r])
    # only the lost replicas' ids moved
    moved = {mb for r in (0, 3) for mb in set(after_2[r]) - set(start[r])}
    assert moved == set(start[1]) | set(start[2])


def test_two_failures_exact_owners_m8() -> None:
    assert step_assignment("balanced", HISTORY, 8) == {0: (0, 1, 2, 3, 4), 3: (5, 6, 7)}


def test_depends_only_on_the_history_list() -> None:
    """Ranks that saw the epochs at different times, or read members in any order, agree."""
    m = 11
    reference = step_assignment("balanced", HISTORY, m)
    rng = random.Random(0)
    for _ in range(20):
        # the same records as a late observer decodes them from the store
        decoded = []
        for mem in HISTORY:
            members = list(mem.members)
            rng.shuffle(members)
            decoded.append(Membership.from_json("members", {"epoch": mem.epoch, "members": members}))
        # intermediate calls (an early observer) leave no state behind
        for k in range(1, len(decoded)):
            step_assignment("balanced", decoded[:k], m)
        assert step_assignment("balanced", decoded, m) == reference
    # unsorted member tuples built directly give the same answer too
    unsorted = [Membership(e.epoch, tuple(reversed(e.members))) for e in HISTORY]
    assert step_assignment("balanced", unsorted, m) == reference


def test_history_order_matters_one_failure_at_a_time() -> None:
    """Skipping an intermediate epoch gives a different (still valid) assignment,
    which is why every rank replays the full list from the base epoch."""
    skipped = step_assignment("balanced", [HISTORY[0], HISTORY[2]], 8)
    assert owners(skipped) == list(range(8))
    assert skipped != step_assignment("balanced", HISTORY, 8)


def test_retry_epochs_with_same_members_change_nothing() -> None:
    with_retries = [
        HISTORY[0],
        Membership(1, (0, 1, 2, 3)),
        Membership(2, (0, 2, 3)),
        Membership(3, (0, 2, 3)),
        Membership(4, (0, 3)),
    ]
    assert step_assignment("balanced", with_retries, 8) == step_assignment("balanced", HISTORY, 8)


def test_replica_absent_from_base_takes_a_share_of_the_lost_ids_only() -> None:
    history = [Membership(0, (0, 1)), Membership(1, (0, 2))]
    got = step_assignment("balanced", history, 4)
    assert got == {0: (0, 1, 2), 2: (3,)}


def test_unknown_policy_raises() -> None:
    with pytest.raises(workload.WorkloadError, match="nosuch"):
        step_assignment("nosuch", HISTORY, 8)


# --- tally and summarize -----------------------------------------------------------


def test_new_tally_layout() -> None:
    t = new_tally(5)
    assert t.dtype == torch.float64
    assert t.shape == (MICROBATCHES + 2 * 5,)
    assert not t.any()


def full_tally(m: int, shards: int, digests: list[int], tokens: list[int], losses: list[float]) -> torch.Tensor:
    """The all-reduced tally: each shard computed a piece of every microbatch."""
    reduced = new_tally(m)
    for _ in range(shards):
        t = new_tally(m)
        for mb in range(m):
            tally_microbatch(t, mb, digests[mb], tokens[mb], torch.tensor(losses[mb]))
        reduced += t
    return reduced


def test_tally_microbatch_accumulates() -> None:
    t = new_tally(3)
    tally_microbatch(t, 2, digest=5, tokens=10, loss=torch.tensor(1.5))
    tally_microbatch(t, 0, digest=7, tokens=4, loss=torch.tensor(0.25, dtype=torch.bfloat16))
    assert t[MICROBATCHES + 1 :: 2].tolist() == [0.25, 0.0, 1.5]  # each microbatch's loss in its own slot
    assert t[TOKENS] == 14
    assert t[DIGEST] == 12
    assert t[MICROBATCHES::2].tolist() == [1.0, 0.0, 1.0]


def test_tally_keeps_a_loss_whose_tensor_is_overwritten_later() -> None:
    """Under CUDA graphs TorchTitan 0.3 returns a loss living in the graph's memory, which the next
    microbatch's replay overwrites in place: the tally must have read it by then."""
    t = new_tally(2)
    loss = torch.tensor(1.5)
    tally_microbatch(t, 0, digest=0, tokens=1, loss=loss)
    loss.fill_(99.0)  # the next replay
    tally_microbatch(t, 1, digest=0, tokens=1, loss=loss)
    assert t[MICROBATCHES + 1 :: 2].tolist() == [1.5, 99.0]


def test_summarize_happy_path() -> None:
    m, shards = 4, 2
    digests = [2**39 + 1, 2**38 + 3, 12345, 2**40 - 1]  # 40-bit digests like data.piece_digest
    tokens = [100, 101, 99, 100]
    losses = [1.0, 2.5, 0.5, 4.0]
    s = summarize(full_tally(m, shards, digests, tokens, losses), shards, expected_tokens=shards * sum(tokens))
    assert isinstance(s, StepSummary)
    assert s.microbatches == (0, 1, 2, 3)
    assert s.tokens == 800
    assert s.loss == pytest.approx(2 * sum(losses))
    assert s.data_digest == f"{shards * sum(digests):016x}"
    assert len(s.data_digest) == 16 and int(s.data_digest, 16) == shards * sum(digests)


def test_summarize_digest_is_order_independent() -> None:
    m = 6
    rng = random.Random(1)
    digests = [rng.getrandbits(40) for _ in range(m)]
    a, b = new_tally(m), new_tally(m)
    for mb in range(m):
        tally_microbatch(a, mb, digests[mb], 10, torch.tensor(1.0))
    for mb in reversed(range(m)):
        tally_microbatch(b, mb, digests[mb], 10, torch.tensor(1.0))
    assert summarize(a, 1, 60).data_digest == summarize(b, 1, 60).data_digest == f"{sum(digests):016x}"


def test_missing_microbatch_is_named() -> None:
    m, shards = 5, 2
    t = full_tally(m, shards, [1] * m, [10] * m, [1.0] * m)
    t[MICROBATCHES + 2 * 3] = 0  # nobody computed microbatch 3
    with pytest.raises(InvariantError) as info:
        summarize(t, shards, expected_tokens=100)
    msg = str(info.value)
    assert "not summed exactly once" in msg
    assert "3: 0.0" in msg
    for ok in (0, 1, 2, 4):
        assert f"{ok}:" not in msg


def test_microbatch_counted_twice_is_named() -> None:
    m, shards = 4, 2
    t = full_tally(m, shards, [1] * m, [10] * m, [1.0] * m)
    tally_microbatch(t, 1, 1, 10, torch.tensor(1.0))  # a replica redid microbatch 1 on both shards
    tally_microbatch(t, 1, 1, 10, torch.tensor(1.0))
    tally_microbatch(t, 2, 1, 10, torch.tensor(1.0))  # and microbatch 2 on one shard only
    with pytest.raises(InvariantError) as info:
        summarize(t, shards, expected_tokens=80)
    msg = str(info.value)
    assert "1: 2.0" in msg
    assert "2: 1.5" in msg
    assert "0:" not in msg and "3:" not in msg


def test_counted_on_one_shard_only_is_an_error() -> None:
    t = new_tally(2)
    tally_microbatch(t, 0, 1, 10, torch.tensor(1.0))
    tally_microbatch(t, 1, 1, 10, torch.tensor(1.0))
    assert summarize(t, 1, 20).tokens == 20
    with pytest.raises(InvariantError, match="0: 0.5"):
        summarize(t, 2, 20)


def test_token_mismatch_is_an_error() -> None:
    m, shards = 3, 2
    t = full_tally(m, shards, [1] * m, [10, 11, 12], [1.0] * m)
    assert summarize(t, shards, expected_tokens=66).tokens == 66
    with pytest.raises(InvariantError) as info:
        summarize(t, shards, expected_tokens=64)
    assert "66" in str(info.value) and "expected 64" in str(info.value)


def test_seconds_per_microbatch_and_quotas_come_out_of_the_reduced_tally() -> None:
    m, slots = 4, 3
    reduced = new_tally(m, slots)
    for replica, ids, seconds in [(0, (0, 1, 2), 0.5), (2, (3,), 2.0)]:
        t = new_tally(m, slots)
        for mb in ids:
            tally_microbatch(t, mb, 1, 10, torch.tensor(1.0))
            tally_time(t, slots, replica, seconds)
        reduced += t
    s = summarize(reduced, 1, expected_tokens=40, replica_slots=slots)
    assert s.microbatches == (0, 1, 2, 3)
    assert s.quotas == {0: 3, 2: 1}
    assert s.seconds_per_microbatch == {0: 0.5, 2: 2.0}  # replica 1 computed nothing: no measurement


def test_the_groups_that_leave_after_the_step_come_out_of_the_reduced_tally() -> None:
    """A leaving group's rank 0 says so in its tally: after the reduction every rank knows who leaves, and the
    step's own counts are untouched."""
    m, slots = 2, 4
    reduced = new_tally(m, slots)
    for replica, leaves in [(0, False), (1, True), (3, True)]:
        t = new_tally(m, slots)
        if replica < m:
            tally_microbatch(t, replica, 1, 10, torch.tensor(1.0))
            tally_time(t, slots, replica, 0.5)
        if leaves:
            tally_leaving(t, slots, replica)
        reduced += t
    s = summarize(reduced, 1, expected_tokens=20, replica_slots=slots)
    assert s.leaving == (1, 3)
    assert s.quotas == {0: 1, 1: 1} and s.seconds_per_microbatch == {0: 0.5, 1: 0.5}
    assert summarize(new_tally(0, slots), 1, 0, slots).leaving == ()


def test_the_steps_loss_is_the_same_bits_whoever_computed_which_microbatch() -> None:
    """Per-microbatch slots summed in microbatch order: a float64 sum in the order of arrival would not be."""
    losses = [0.1 * (k + 1) + 1e-9 * k for k in range(6)]
    reference = None
    for split in ([range(6)], [range(0, 6, 2), range(1, 6, 2)], [range(5, -1, -1)], [[3], [5, 0], [4, 1, 2]]):
        reduced = new_tally(6)
        for group in split:
            t = new_tally(6)
            for mb in group:
                tally_microbatch(t, mb, 0, 10, torch.tensor(losses[mb]))
            reduced += t
        loss = summarize(reduced, 1, 60).loss
        reference = loss if reference is None else reference
        assert loss.hex() == reference.hex()
