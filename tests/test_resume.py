"""``policy.resume.resume_plan``: which step a run resumes from once every group lost its state, and which groups' ranks
load each shard from their nodes' memory."""

import pytest

from titan_recover.policy.resume import ResumePlan, resume_plan

Found = dict[int, dict[int, tuple[int, ...]]]  # replica -> group rank -> the steps it verified

pytestmark = pytest.mark.unit


def test_the_newest_step_every_shard_has_is_chosen_with_the_groups_holding_some_of_it() -> None:
    found: Found = {
        0: {0: (8, 4), 1: (8, 4)},
        1: {0: (12, 8, 4), 1: (8, 4)},  # no copy of shard 1 of step 12 anywhere: 12 is not whole
        2: {0: (4,), 1: (8, 4)},  # its rank 0 receives shard 0 of step 8
        3: {0: (12, 8), 1: (8,)},
        4: {0: (4,), 1: (4,)},  # holds none of step 8: rejoins from the others
    }
    plan = resume_plan(found, group_ranks=2, at_most=20)
    assert plan == ResumePlan(8, (0, 1, 2, 3), ((0, 1, 3), (0, 1, 2, 3)))
    assert isinstance(plan, ResumePlan) and plan.whole == (0, 1, 3)


def test_steps_after_the_last_commit_are_ignored() -> None:
    """A copy newer than the last committed step cannot be the committed state: one that claims to is skipped."""
    found: Found = {0: {0: (9, 6), 1: (9, 6)}, 1: {0: (6,), 1: (6,)}}
    assert resume_plan(found, group_ranks=2, at_most=8) == ResumePlan(6, (0, 1), ((0, 1), (0, 1)))
    assert resume_plan(found, group_ranks=2, at_most=9) == ResumePlan(9, (0,), ((0,), (0,)))


def test_a_group_without_a_list_for_a_shard_holds_no_step() -> None:
    found = {0: {0: (4,)}, 1: {0: (2,), 1: (2,)}}
    assert resume_plan(found, group_ranks=2, at_most=10) == ResumePlan(2, (1,), ((1,), (1,)))


def test_no_group_back_says_so() -> None:
    assert resume_plan({}, group_ranks=2, at_most=10) == ("no replica group came back to resume from its nodes' memory")


def test_shards_without_any_copy_are_named_with_what_the_others_hold() -> None:
    why = resume_plan({0: {0: (4, 2), 1: (), 2: ()}, 1: {0: (6,), 1: (), 2: (11,)}}, group_ranks=3, at_most=10)
    assert isinstance(why, str)
    assert "shard(s) [1, 2]" in why
    assert "(the others: shard 0: steps [2, 4, 6])" in why  # step 11 on shard 2 is past the last commit


def test_no_copy_at_all_names_every_shard_and_nothing_held() -> None:
    why = resume_plan({0: {0: (), 1: ()}}, group_ranks=2, at_most=3)
    assert why == "no restarted group's nodes hold a verified snapshot of shard(s) [0, 1]"


def test_copies_spread_over_groups_make_a_plan_with_no_group_whole() -> None:
    """A rack lost with groups spanning racks: group 0 kept shard 0, group 1 shard 1; each rank missing its shard
    takes it from the other group's same rank."""
    plan = resume_plan({0: {0: (4,), 1: ()}, 1: {0: (), 1: (4, 2)}}, group_ranks=2, at_most=10)
    assert plan == ResumePlan(4, (0, 1), ((0,), (1,)))
    assert isinstance(plan, ResumePlan) and plan.whole == ()


def test_shards_held_only_at_different_steps_have_no_plan() -> None:
    why = resume_plan({0: {0: (4,), 1: ()}, 1: {0: (), 1: (6, 2)}}, group_ranks=2, at_most=10)
    assert why == "every shard has a verified snapshot, but of no one step (shard 0: steps [4]; shard 1: steps [2, 6])"
