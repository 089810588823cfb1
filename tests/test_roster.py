"""Who is in the run (titan_recover.policy.roster): one test of the decision per membership event, with no
coordinator and no launcher: the state goes in as values, the decision comes out as one."""

import pytest

from titan_recover.control.protocol import Membership
from titan_recover.policy.membership import GroupView
from titan_recover.policy.restarts import RestartBudget
from titan_recover.policy.roster import (
    DropSpare,
    GiveUp,
    Joins,
    Leave,
    Limits,
    Restart,
    Roster,
    TakeOut,
    joins,
    on_exit,
    reported,
    take_out,
)

pytestmark = pytest.mark.unit

RANKS = 2
LIMITS = Limits(replica_ids=4, group_ranks=RANKS, seats=2, min_replicas=1, spare_timeout_s=5.0)


def roster(*members: int, spares: dict[int, int] | None = None, dropped: dict[int, int] | None = None) -> Roster:
    """``members`` in epoch 1, each admitted as incarnation 0, and the ``spares`` and ``dropped`` incarnations."""
    return Roster(Membership(1, members), spares or {}, {r: 0 for r in members}, dropped or {})


def decide(r: Roster, now: float = 0.0, limits: Limits = LIMITS, **groups: int) -> Joins:
    """``joins`` with every rank of each ``r<id>=<incarnation>`` up, and each spare last beaten at 0."""
    asking = {int(name[1:]): incarnation for name, incarnation in groups.items()}
    views = {(replica, a): GroupView(RANKS, RANKS, 0, 0.0) for replica, a in asking.items()}
    return joins(r, limits, asking, views, {s: 0.0 for s in r.spares}, now)


# ---- joins ------------------------------------------------------------------------------


def test_admit_a_ready_group_while_a_seat_is_free() -> None:
    assert decide(roster(0), r1=1) == Joins(admit=((1, 1),))


def test_a_group_not_all_up_or_a_stale_incarnation_waits() -> None:
    views = {(1, 1): GroupView(RANKS, RANKS - 1, 0, 0.0), (2, 0): GroupView(RANKS, RANKS, 0, 0.0)}
    stale = roster(0, dropped={2: 0})  # incarnation 0 of group 2 was dropped as a spare already
    assert joins(stale, LIMITS, {1: 1, 2: 0}, views, {}, 0.0) == Joins()


def test_hold_as_a_spare_while_the_membership_is_full() -> None:
    assert decide(roster(0, 1), r2=0, r3=0) == Joins(hold=((2, 0), (3, 0)))


def test_a_waiting_spare_is_held_once() -> None:
    assert decide(roster(0, 1, spares={2: 0}), 1.0, r2=0) == Joins()


def test_drop_a_spare_silent_for_the_spare_timeout() -> None:
    waiting = roster(0, 1, spares={2: 0, 3: 0})
    assert decide(waiting, 4.99, r2=0, r3=0) == Joins()
    assert decide(waiting, 5.0, r2=0, r3=0) == Joins(
        drop=(
            (2, "heartbeat silent for 5.00s while waiting as a spare"),
            (3, "heartbeat silent for 5.00s while waiting as a spare"),
        )
    )


def test_a_silent_spare_is_dropped_not_admitted_into_a_free_seat() -> None:
    assert decide(roster(0, spares={2: 0}), 6.0, r2=0) == Joins(
        drop=((2, "heartbeat silent for 6.00s while waiting as a spare"),)
    )


def test_a_spare_that_stopped_asking_is_forgotten_and_its_restart_held_anew() -> None:
    assert decide(roster(0, 1, spares={2: 0, 3: 0}), 1.0, r3=1) == Joins(gone=(2, 3), hold=((3, 1),))


def test_a_spare_takes_a_free_seat() -> None:
    assert decide(roster(0, spares={2: 0}), 1.0, r2=0) == Joins(admit=((2, 0),))


def test_grow_beyond_r_up_to_max_members() -> None:
    grow = Limits(replica_ids=5, group_ranks=RANKS, seats=4, min_replicas=1, spare_timeout_s=5.0)
    assert decide(roster(0, 1), limits=grow, r2=0, r3=0, r4=0) == Joins(admit=((2, 0), (3, 0)), hold=((4, 0),))


def test_replace_a_member_whose_restart_beat_detection() -> None:
    assert decide(roster(0, 1), r1=1) == Joins(replace=((1, 1),))


def test_ignore_an_id_outside_the_run() -> None:
    assert decide(roster(0, 1), r1=1, r7=0) == Joins(replace=((1, 1),), outside=(7,))


def test_nobody_joins_a_run_that_is_closing() -> None:
    closing = Roster(Membership(1, (0,)), spares={2: 0}, incarnations={0: 0}, closed=True)
    assert decide(closing, 9.0, r1=1, r2=0) == Joins()


# ---- reports ----------------------------------------------------------------------------


@pytest.mark.parametrize("cause", ["left on notice before step 5", "drained by the operator: disk errors"])
def test_take_out_on_a_leave_or_a_drain(cause: str) -> None:
    assert reported(roster(0, 1), 1, True, cause) == Leave(1)


def test_a_report_about_a_waiting_spare_drops_it() -> None:
    assert reported(roster(0, spares={2: 0}), 2, False, "torchrun exited") == DropSpare(2, "torchrun exited")


@pytest.mark.parametrize("suspect, left", [(1, False), (None, False), (3, True)])
def test_a_failure_report_or_a_leave_of_a_non_member_decides_nothing_here(suspect: int | None, left: bool) -> None:
    assert reported(roster(0, 1), suspect, left, "torchrun exited") is None


# ---- taking out -------------------------------------------------------------------------


def test_take_out_tells_leaves_from_failures() -> None:
    out = take_out(roster(0, 1, 2), LIMITS, {2: "torchrun exited", 1: "left"}, {1}, (), {})
    assert out == TakeOut(left=(1,), crashed=(2,), membership=Membership(2, (0,)))


def test_take_out_of_nobody_is_a_retry() -> None:
    assert take_out(roster(0, 1), LIMITS, {}, (), (), {}) == TakeOut((), (), Membership(2, (0, 1)))


def test_take_out_stops_when_too_few_with_state_are_left() -> None:
    out = take_out(roster(0, 1), LIMITS, {0: "killed"}, (), {1: 1}, {})
    assert out.membership is None and out.crashed == (0,) and "no replica group with training state" in out.stop


def test_take_out_stops_on_the_jobs_own_error() -> None:
    out = take_out(roster(0, 1, 2), LIMITS, {0: "E", 1: "E"}, (), (), {0: ("E", 3), 1: ("E", 3)})
    assert out.membership is None and out.stop.startswith("the job's own error, not a hardware failure")


# ---- a launcher's restarts --------------------------------------------------------------


def test_restart_within_the_budget() -> None:
    assert on_exit(RestartBudget(1, 3600.0, [0.0]), 3600.0) == Restart()


def test_refuse_a_flapping_group() -> None:
    decision = on_exit(RestartBudget(1, 3600.0, [0.0]), 10.0)
    assert isinstance(decision, GiveUp) and decision.why.endswith("it is flapping")
    assert on_exit(RestartBudget(0, 3600.0), 0.0) == GiveUp("recover.max_restarts = 0 allows no restart")
