"""Tests for titan_recover.policy.membership: epochs, fencing, and the failure detector.

The detector is pure logic driven with explicit ``now`` values, so no test here
sleeps or starts a process.
"""

from __future__ import annotations

import json

import pytest

from titan_recover.control.protocol import NodeGroup, Stuck
from titan_recover.policy.membership import (
    FailureDetector,
    GroupView,
    Membership,
    TooFewReplicasError,
    admit,
    awaited,
    donor,
    group_views,
    join_action,
    joiners,
    next_membership,
    repaired_failure,
    store_stalled,
)

pytestmark = pytest.mark.unit

# --- Membership JSON --------------------------------------------------------


def test_to_json_from_json_round_trip_through_real_json() -> None:
    m = Membership(7, (0, 2, 5))
    obj = m.to_json()
    assert obj == {"epoch": 7, "members": [0, 2, 5]}
    back = Membership.from_json("members/1", json.loads(json.dumps(obj)))
    assert back == m
    assert isinstance(back.members, tuple)


def test_from_json_sorts_members() -> None:
    assert Membership.from_json("members/1", {"epoch": 0, "members": [3, 0, 2]}).members == (0, 2, 3)


def test_from_json_accepts_epoch_zero_and_no_members() -> None:
    assert Membership.from_json("members/1", {"epoch": 0, "members": []}) == Membership(0, ())


@pytest.mark.parametrize("epoch", [-1, 1.0, "3", None])
def test_from_json_rejects_bad_epoch(epoch: object) -> None:
    obj: dict[str, object] = {"members": [0, 1]}
    if epoch is not None:
        obj["epoch"] = epoch
    with pytest.raises(ValueError, match="epoch must be a non-negative int") as info:
        Membership.from_json("members/1", obj)
    assert repr(epoch) in str(info.value)


@pytest.mark.parametrize("members", ["0,1", {"0": 1}, (0, 1), None, 3])
def test_from_json_rejects_non_list_members(members: object) -> None:
    with pytest.raises(ValueError, match="members must be a list of replica ids") as info:
        Membership.from_json("members/1", {"epoch": 1, "members": members})
    assert repr(members) in str(info.value)


@pytest.mark.parametrize("members", [[0, -1], [-3], [0, "1"], [0, 1.0], [None]])
def test_from_json_rejects_bad_replica_ids(members: list) -> None:
    with pytest.raises(ValueError, match="members must be a list of replica ids") as info:
        Membership.from_json("members/1", {"epoch": 1, "members": members})
    assert repr(members) in str(info.value)


def test_from_json_rejects_repeated_ids() -> None:
    with pytest.raises(ValueError, match="repeat a replica") as info:
        Membership.from_json("members/1", {"epoch": 2, "members": [0, 1, 1]})
    assert "[0, 1, 1]" in str(info.value)


@pytest.mark.parametrize("obj", [{"epoch": True, "members": [0]}, {"epoch": 1, "members": [False, True]}])
def test_from_json_rejects_booleans(obj: dict) -> None:
    with pytest.raises(ValueError):
        Membership.from_json("members/1", obj)


# --- next_membership -------------------------------------------------------


def test_next_membership_removes_failed_and_bumps_epoch() -> None:
    new = next_membership(Membership(3, (0, 1, 2, 3)), [1, 3], min_replicas=1)
    assert new == Membership(4, (0, 2))


def test_next_membership_ignores_non_members_in_failed() -> None:
    assert next_membership(Membership(0, (0, 1)), {5}, min_replicas=2) == Membership(1, (0, 1))


def test_next_membership_retry_with_nobody_failed_still_bumps_epoch() -> None:
    cur = Membership(5, (0, 1))
    new = next_membership(cur, [], min_replicas=2)
    assert new.epoch == 6
    assert new.members == cur.members


def test_next_membership_exactly_min_replicas_left_is_fine() -> None:
    assert next_membership(Membership(0, (0, 1, 2)), [0], min_replicas=2).members == (1, 2)


def test_too_few_replicas_message_names_min_and_what_is_left() -> None:
    with pytest.raises(TooFewReplicasError) as info:
        next_membership(Membership(2, (0, 1, 2)), [0, 2], min_replicas=2)
    msg = str(info.value)
    assert "recover.min_replicas is 2" in msg
    assert "only 1 replica group(s) left [1]" in msg
    assert "[0, 2]" in msg  # what was lost


def test_too_few_replicas_when_all_fail() -> None:
    with pytest.raises(TooFewReplicasError, match=r"only 0 replica group\(s\) left \[\]"):
        next_membership(Membership(0, (0, 1)), [0, 1], min_replicas=1)


def test_only_joiners_left_is_too_few() -> None:
    with pytest.raises(TooFewReplicasError) as info:
        next_membership(Membership(4, (0, 1, 2)), [0], min_replicas=1, joining=[1, 2])
    msg = str(info.value)
    assert "no replica group with training state" in msg
    assert "[1, 2]" in msg  # the joiners that are left
    assert "[0]" in msg  # what was lost


def test_one_member_with_state_left_is_enough() -> None:
    new = next_membership(Membership(4, (0, 1, 2)), [0], min_replicas=1, joining=[2])
    assert new == Membership(5, (1, 2))


def test_failed_joiner_does_not_count_against_the_rest() -> None:
    assert next_membership(Membership(4, (0, 1)), [1], min_replicas=1, joining=[1]) == Membership(5, (0,))


def test_retry_with_only_joiners_is_too_few() -> None:
    with pytest.raises(TooFewReplicasError, match="no replica group with training state"):
        next_membership(Membership(2, (1,)), [], min_replicas=1, joining=(1,))


def test_min_replicas_is_checked_before_joiners() -> None:
    with pytest.raises(TooFewReplicasError, match="recover.min_replicas is 3"):
        next_membership(Membership(0, (0, 1, 2)), [0], min_replicas=3, joining=[1, 2])


# --- admit -----------------------------------------------------------------------


def test_admit_bumps_epoch_and_sorts() -> None:
    assert admit(Membership(4, (0, 2)), 1) == Membership(5, (0, 1, 2))
    assert admit(Membership(4, (0, 2)), 7) == Membership(5, (0, 2, 7))
    assert admit(Membership(0, ()), 3) == Membership(1, (3,))


def test_admit_keeps_the_current_membership_unchanged() -> None:
    cur = Membership(2, (1,))
    admit(cur, 0)
    assert cur == Membership(2, (1,))


def test_admit_of_a_member_is_an_error() -> None:
    with pytest.raises(ValueError) as info:
        admit(Membership(6, (0, 1)), 1)
    msg = str(info.value)
    assert "replica 1 is already a member of epoch 6" in msg
    assert "fence it first" in msg


# --- joiners ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "history",
    [
        [Membership(3, (0, 1))],
        [Membership(3, (0, 1)), Membership(4, (0, 1)), Membership(5, (0, 1))],
        [Membership(3, (0, 1, 2)), Membership(4, (0, 2))],  # a fence only
    ],
)
def test_no_joiners_in_steady_state_or_after_a_fence(history: list[Membership]) -> None:
    assert joiners(history) == ()


def test_admitted_during_the_step_is_a_joiner() -> None:
    assert joiners([Membership(3, (0,)), Membership(4, (0, 1))]) == (1,)


def test_fenced_and_readmitted_within_the_history_is_a_joiner() -> None:
    history = [Membership(3, (0, 1)), Membership(4, (0,)), Membership(5, (0, 1))]
    assert joiners(history) == (1,)


def test_replaced_in_one_step_still_a_joiner() -> None:
    """join_action "replace": fenced and re-admitted between the same two commits."""
    history = [Membership(3, (0, 1, 2)), Membership(4, (0, 2)), Membership(5, (0, 1, 2)), Membership(6, (0, 1, 2))]
    assert joiners(history) == (1,)


def test_several_joiners_come_in_member_order() -> None:
    history = [Membership(0, (1,)), Membership(1, (1, 3)), Membership(2, (0, 1, 3))]
    assert joiners(history) == (0, 3)


def test_only_last_epoch_members_can_be_joiners() -> None:
    history = [Membership(0, (0,)), Membership(1, (0, 1)), Membership(2, (0,))]  # 1 admitted, then fenced
    assert joiners(history) == ()


# --- awaited ---------------------------------------------------------------------


def test_a_leaver_still_in_every_epoch_since_the_commit_is_awaited() -> None:
    history = [Membership(3, (0, 1, 2)), Membership(4, (0, 1, 2, 5))]  # an admission, the leave not out yet
    assert awaited(history, (2, 1)) == (1, 2)
    assert awaited(history[:1], ()) == ()  # nobody said it leaves: nothing to wait for


def test_a_leaver_out_of_one_epoch_is_gone_even_if_admitted_again() -> None:
    history = [Membership(3, (0, 1, 2)), Membership(4, (0, 2)), Membership(5, (0, 1, 2))]  # 1 left, came back
    assert awaited(history, (1,)) == ()


def test_of_several_leavers_only_those_still_in_are_awaited() -> None:
    history = [Membership(3, (0, 1, 2, 3)), Membership(4, (0, 2, 3))]  # 1's leave is out, 3's not yet
    assert awaited(history, (1, 3)) == (3,)


# --- donor -----------------------------------------------------------------------


def test_donor_spreads_joiners_over_members_with_state() -> None:
    m = Membership(5, (0, 1, 2, 3))
    assert donor(m, (1, 3), 1) == 0
    assert donor(m, (1, 3), 3) == 2


def test_donor_order_does_not_depend_on_joining_order() -> None:
    m = Membership(5, (0, 1, 2, 3))
    for joiner in (1, 3):
        assert donor(m, (3, 1), joiner) == donor(m, (1, 3), joiner)


def test_donor_wraps_when_joiners_outnumber_donors() -> None:
    m = Membership(2, (0, 1, 2, 3, 4))
    assert [donor(m, (4, 2, 3), j) for j in (2, 3, 4)] == [0, 1, 0]


def test_single_donor_serves_every_joiner() -> None:
    m = Membership(2, (0, 1, 2))
    assert [donor(m, (1, 2), j) for j in (1, 2)] == [0, 0]


def test_no_donor_is_too_few_replicas() -> None:
    with pytest.raises(TooFewReplicasError, match="epoch 7 has no member with training state"):
        donor(Membership(7, (1, 2)), (1, 2), 1)


# --- join_action -----------------------------------------------------------------


@pytest.mark.parametrize(
    "members, replica, admitted, incarnation, ready, shards, action",
    [
        ((0,), 1, 0, 1, 2, 2, "admit"),
        ((0, 2), 1, -1, 0, 1, 1, "admit"),  # never admitted before
        ((0, 1), 1, 0, 1, 2, 2, "replace"),  # the restart beat detection
        ((0,), 1, 0, 1, 1, 2, "wait"),  # not all ranks up
        ((0, 1), 1, 0, 1, 0, 2, "wait"),
        ((0,), 1, 1, 1, 2, 2, "wait"),  # already admitted this incarnation
        ((0, 1), 1, 1, 1, 2, 2, "wait"),  # ... and it is a member
        ((0,), 1, 2, 1, 2, 2, "wait"),  # stale request of an older incarnation
        ((0,), 1, 1, 2, 3, 2, "admit"),  # more ready than shards: enough
    ],
)
def test_join_action(
    members: tuple[int, ...], replica: int, admitted: int, incarnation: int, ready: int, shards: int, action: str
) -> None:
    assert join_action(members, replica, admitted, incarnation, ready, shards) == action


# --- FailureDetector ----------------------------------------------------------

INTERVAL = 0.1


def make_detector(
    members: tuple[int, ...] = (0, 1, 2),
    timeout_s: float = 5.0,
    confirm_s: float = 0.5,
    startup_s: float = 60.0,
    start: float = 1000.0,
) -> FailureDetector:
    return FailureDetector(
        members=members,
        timeout_s=timeout_s,
        confirm_s=confirm_s,
        startup_s=startup_s,
        start=start,
    )


class Beats:
    """Two ranks per group beating, folded as the node agent (when each rank last beat) and
    the coordinator (a group beats once every rank has, as of its most silent one) fold them."""

    def __init__(self, det: FailureDetector, ranks: int = 2) -> None:
        self.det, self.ranks = det, ranks
        self.changed: dict[tuple[int, int], float] = {}

    def tick(self, now: float, replicas: tuple[int, ...], shards: tuple[int, ...] | None = None) -> None:
        for r in replicas:
            for s in shards if shards is not None else range(self.ranks):
                self.changed[(r, s)] = now
        self.poll(now)

    def poll(self, now: float) -> None:
        """One coordinator read: ranks that did not beat since keep their old times."""
        for r in sorted({r for r, _ in self.changed}):
            times = [self.changed.get((r, s)) for s in range(self.ranks)]
            beaten = [t for t in times if t is not None]
            if len(beaten) == len(times):
                self.det.beat(r, min(beaten))


def run_until(det: FailureDetector, beats: Beats, t0: float, t1: float, beating: tuple[int, ...]) -> float:
    """Advance time from t0 to t1 in heartbeat intervals with ``beating`` replicas alive."""
    t = t0
    while t < t1 - 1e-9:
        t = round(t + INTERVAL, 6)
        beats.tick(t, beating)
        beats.poll(t)
    return t


def test_all_beating_nothing_failed() -> None:
    det = make_detector()
    beats = Beats(det)
    t = run_until(det, beats, 1000.0, 1030.0, (0, 1, 2))
    assert det.decide(t) == ({}, False)


def test_named_suspect_is_fenced_at_once() -> None:
    det = make_detector()
    beats = Beats(det)
    beats.tick(1000.1, (0, 1, 2))
    det.report(1, "peer in my group died", now=1000.1)
    failed, retry = det.decide(1000.1)
    assert failed == {1: "peer in my group died"}
    assert retry is False


def test_first_cause_of_a_suspect_is_kept() -> None:
    det = make_detector()
    Beats(det).tick(1000.1, (0, 1, 2))
    det.report(2, "first", now=1000.1)
    det.report(2, "second", now=1000.2)
    assert det.decide(1000.2)[0] == {2: "first"}


def test_report_naming_a_non_member_is_ignored() -> None:
    det = make_detector(members=(0, 1))
    Beats(det).tick(1000.1, (0, 1))
    det.report(7, "not one of ours", now=1000.1)
    assert det.decide(1000.1) == ({}, False)
    assert det.decide(1001.0) == ({}, False)


def test_unnamed_report_fences_only_the_silent_replica_after_confirm() -> None:
    det = make_detector(confirm_s=0.5)
    beats = Beats(det)
    t = run_until(det, beats, 1000.0, 1002.0, (0, 1, 2))
    # replica 1 dies at t; survivors keep beating; a survivor reports a collective error
    det.report(None, "allreduce broke", now=t + 0.05)
    report_t = t + 0.05
    # before confirm_s has passed: nothing, not even a retry
    t2 = run_until(det, beats, t, report_t + 0.4, (0, 2))
    assert t2 < report_t + 0.5
    assert det.decide(t2) == ({}, False)
    # once confirm_s has passed since the report: replica 1 (silent > confirm_s) only
    t3 = run_until(det, beats, t2, report_t + 0.5, (0, 2))
    failed, retry = det.decide(t3)
    assert set(failed) == {1}
    assert "allreduce broke" in failed[1]
    assert retry is False
    # the report is consumed: later decisions do not fence anybody else
    det.set_members((0, 2))
    t4 = run_until(det, beats, t3, t3 + 1.0, (0, 2))
    assert det.decide(t4) == ({}, False)


def test_unnamed_report_not_due_one_tick_before_confirm() -> None:
    det = make_detector(confirm_s=0.5)
    beats = Beats(det)
    beats.tick(1000.0, (0, 1, 2))
    det.report(None, "broke", now=1001.0)
    # replica 1 is silent well past confirm_s (but below timeout_s), replicas 0 and 2 beat
    beats.tick(1001.49, (0, 2))
    assert det.decide(1001.49) == ({}, False)
    beats.tick(1001.5, (0, 2))
    failed, retry = det.decide(1001.5)
    assert set(failed) == {1} and retry is False


def test_unnamed_report_with_everybody_beating_is_a_retry() -> None:
    det = make_detector(confirm_s=0.5)
    beats = Beats(det)
    t = run_until(det, beats, 1000.0, 1001.0, (0, 1, 2))
    det.report(None, "transient", now=t)
    t = run_until(det, beats, t, t + 0.6, (0, 1, 2))
    assert det.decide(t) == ({}, True)
    # the retry consumed the report
    t = run_until(det, beats, t, t + 0.6, (0, 1, 2))
    assert det.decide(t) == ({}, False)


def test_waiting_report_fences_the_silent_replica_and_retries_nothing() -> None:
    # replica 1 died after the all-reduce: no collective broke, its peers wait for its vote
    det = make_detector(confirm_s=0.5)
    beats = Beats(det)
    t = run_until(det, beats, 1000.0, 1001.0, (0, 1, 2))
    det.report(None, "replica 0 rank 0 waited 0.5s for the commit votes of step 3", now=t + 0.1, waiting=True)
    t = run_until(det, beats, t, t + 0.6, (0, 2))
    failed, retry = det.decide(t)
    assert set(failed) == {1} and retry is False
    assert failed[1].startswith("silent 0.") and "while its peers waited (replica 0 rank 0 waited" in failed[1]


def test_waiting_report_with_everybody_beating_is_no_retry() -> None:
    # a slow peer still beating: the wait goes on, the epoch is not bumped
    det = make_detector(confirm_s=0.5)
    beats = Beats(det)
    t = run_until(det, beats, 1000.0, 1001.0, (0, 1, 2))
    det.report(None, "waited", now=t, waiting=True)
    t = run_until(det, beats, t, t + 0.6, (0, 1, 2))
    assert det.decide(t) == ({}, False)
    det.report(None, "waited", now=t, waiting=True)
    det.report(None, "broke", now=t)
    t = run_until(det, beats, t, t + 0.6, (0, 1, 2))
    assert det.decide(t) == ({}, True)  # a broken collective among them still retries


def test_one_silent_shard_makes_its_replica_silent() -> None:
    det = make_detector(confirm_s=0.5)
    beats = Beats(det)
    t = run_until(det, beats, 1000.0, 1001.0, (0, 1, 2))
    det.report(None, "broke", now=t)
    # replica 2's shard 1 stops; its shard 0 keeps beating
    for _ in range(6):
        t = round(t + INTERVAL, 6)
        beats.tick(t, (0, 1))
        beats.tick(t, (2,), shards=(0,))
    failed, retry = det.decide(t)
    assert set(failed) == {2} and retry is False


def test_slow_but_alive_rank_is_never_failed() -> None:
    """A rank stuck in a long computation whose heartbeat thread still runs."""
    det = make_detector(timeout_s=5.0, confirm_s=0.5)
    beats = Beats(det)
    t = 1000.0
    for _ in range(600):  # 60 s, decisions every tick
        t = round(t + INTERVAL, 6)
        beats.tick(t, (0, 1, 2))
        assert det.decide(t) == ({}, False)


def test_silent_for_timeout_is_failed_slightly_less_is_not() -> None:
    det = make_detector(timeout_s=5.0)
    beats = Beats(det)
    beats.tick(1000.5, (0, 1, 2))
    last_beat_of_1 = 1000.5
    t = 1000.5
    while t < last_beat_of_1 + 4.9:
        t = round(t + INTERVAL, 6)
        beats.tick(t, (0, 2))
        beats.poll(t)  # replica 1's counter is read but does not move
    assert det.decide(last_beat_of_1 + 4.99) == ({}, False)
    failed, retry = det.decide(last_beat_of_1 + 5.0)
    assert set(failed) == {1}
    assert "silent" in failed[1]
    assert retry is False


def test_a_group_is_as_alive_as_its_most_silent_rank() -> None:
    """Rank 0 hangs while rank 1 keeps beating: the group counts as silent since rank 0's last beat."""
    det = make_detector(members=(0,), timeout_s=5.0)
    beats = Beats(det)
    beats.tick(1000.0, (0,))
    for t in (1001.0, 1002.0, 1003.0, 1004.0, 1004.9):
        beats.tick(t, (0,), shards=(1,))
        assert det.decide(t) == ({}, False)
    failed, _ = det.decide(1005.0)
    assert set(failed) == {0}


def test_replica_that_never_beat_fails_only_after_startup() -> None:
    det = make_detector(startup_s=60.0, timeout_s=5.0, confirm_s=0.5, start=1000.0)
    beats = Beats(det)
    # replica 2's shard 1 never beats; everything else does
    t = 1000.0
    while t < 1059.9:
        t = round(t + INTERVAL, 6)
        beats.tick(t, (0, 1))
        beats.tick(t, (2,), shards=(0,))
        assert det.decide(t) == ({}, False), t
    assert det.decide(1059.99) == ({}, False)
    failed, retry = det.decide(1060.0)
    assert set(failed) == {2}
    assert "no heartbeat within 60s" in failed[2]
    assert retry is False


def test_unnamed_report_does_not_fence_a_replica_that_never_beat() -> None:
    """Before its first beat a replica is only judged by startup_s."""
    det = make_detector(startup_s=60.0, confirm_s=0.5, start=1000.0)
    beats = Beats(det)
    beats.tick(1000.1, (0, 1))
    det.report(None, "broke", now=1000.1)
    beats.tick(1001.0, (0, 1))
    assert det.decide(1001.0) == ({}, True)


def test_set_members_drops_suspects_of_removed_replicas() -> None:
    det = make_detector(members=(0, 1, 2))
    beats = Beats(det)
    beats.tick(1000.1, (0, 1, 2))
    det.report(1, "died", now=1000.1)
    det.report(2, "also died", now=1000.1)
    det.set_members([0, 2])  # 1 fenced by somebody else; 2 still a member
    assert det.members == (0, 2)
    assert det.decide(1000.1)[0] == {2: "also died"}
    det.set_members([0])
    assert det.decide(1000.2) == ({}, False)


def test_set_members_sorts() -> None:
    det = make_detector(members=(0, 1, 2))
    det.set_members([2, 0])
    assert det.members == (0, 2)


def test_removed_replica_silence_is_ignored() -> None:
    det = make_detector(members=(0, 1), timeout_s=5.0)
    beats = Beats(det)
    beats.tick(1000.1, (0, 1))
    det.set_members([0])
    t = run_until(det, beats, 1000.1, 1020.0, (0,))
    assert det.decide(t) == ({}, False)


def test_set_members_gives_a_new_member_a_fresh_beat() -> None:
    det = make_detector(members=(0,), timeout_s=5.0, startup_s=60.0, start=1000.0)
    beats = Beats(det)
    t = run_until(det, beats, 1000.0, 1100.0, (0,))
    # replica 1 is admitted long after start, before its first beat reached the detector
    det.set_members([1, 0], now=t)
    assert det.members == (0, 1)
    assert det.decide(t) == ({}, False)
    t2 = run_until(det, beats, t, t + 4.9, (0,))
    assert det.decide(t2) == ({}, False)
    failed, retry = det.decide(t + 5.0)  # judged by timeout_s from its admission
    assert set(failed) == {1} and "silent" in failed[1]
    assert retry is False


def test_set_members_forgets_a_rejoiners_stale_silence() -> None:
    det = make_detector(members=(0, 1), timeout_s=5.0, start=1000.0)
    beats = Beats(det)
    beats.tick(1000.1, (0, 1))
    det.set_members([0], now=1000.2)  # replica 1 fenced; its last beat was at 1000.1
    t = run_until(det, beats, 1000.1, 1050.0, (0,))
    det.set_members([0, 1], now=t)  # restarted and re-admitted
    assert det.decide(t) == ({}, False)
    t = run_until(det, beats, t, t + 20.0, (0, 1))  # the new incarnation beats
    assert det.decide(t) == ({}, False)


def test_set_members_keeps_old_members_beats() -> None:
    """Only newly added members get a fresh beat: a silent old member stays silent."""
    det = make_detector(members=(0, 1), timeout_s=5.0, start=1000.0)
    beats = Beats(det)
    beats.tick(1000.1, (0, 1))
    t = run_until(det, beats, 1000.1, 1010.0, (0,))  # replica 1 silent since 1000.1
    det.set_members([0, 1, 2], now=t)
    failed, _ = det.decide(t)
    assert set(failed) == {1}


def test_new_member_then_beating_is_never_failed() -> None:
    det = make_detector(members=(0,), timeout_s=5.0, start=1000.0)
    beats = Beats(det)
    t = run_until(det, beats, 1000.0, 1200.0, (0,))
    det.set_members([0, 1], now=t)
    for _ in range(200):
        t = round(t + INTERVAL, 6)
        beats.tick(t, (0, 1))
        assert det.decide(t) == ({}, False)


def test_set_members_accepts_a_one_shot_iterable() -> None:
    det = make_detector(members=(0, 1))
    det.set_members((r for r in (0, 1, 2)), now=1000.0)
    assert det.members == (0, 1, 2)


def test_new_epoch_drops_unnamed_reports_about_the_old_one() -> None:
    """A survivor's report about the epoch that fenced replica 2 must not cause a retry later."""
    det = make_detector(confirm_s=0.5)
    beats = Beats(det)
    t = run_until(det, beats, 1000.0, 1001.0, (0, 1, 2))
    det.report(2, "its own group broke", now=t)
    det.report(None, "all-reduce broke: replica 2 is gone", now=t)
    failed, _ = det.decide(t)
    assert set(failed) == {2}
    det.set_members((0, 1), now=t)
    t = run_until(det, beats, t, t + 0.6, (0, 1))
    assert det.decide(t) == ({}, False)


# --- bounded retries, the job's own errors, diverged replicas -------------------------

from titan_recover.policy.membership import diverged, job_error, retry_verdict  # noqa: E402


def test_retry_verdict_retries_then_fences_the_silent_then_stops() -> None:
    assert retry_verdict((0, 1, 2), {0}, retries=0, max_retries=2) == ("retry", ())
    assert retry_verdict((0, 1, 2), {0}, retries=1, max_retries=2) == ("retry", ())
    assert retry_verdict((0, 1, 2), {0, 2}, retries=2, max_retries=2) == ("fence", (1,))
    assert retry_verdict((0, 1, 2), {0}, retries=5, max_retries=2) == ("fence", (1, 2))
    assert retry_verdict((0, 1), {0, 1}, retries=2, max_retries=2) == ("stop", (0, 1))
    assert retry_verdict((0, 1), set(), retries=2, max_retries=2) == ("stop", (0, 1))  # nobody to tell apart


def test_job_error_needs_two_replicas_or_every_member() -> None:
    assert job_error({}, (0, 1)) is None
    assert job_error({1: ("E", 3)}, (0, 1)) is None  # one replica: could be its hardware
    assert job_error({0: ("E", 3), 1: ("E", 4)}, (0, 1, 2)) is None  # not the same step
    assert job_error({0: ("E", 3), 1: ("F", 3)}, (0, 1, 2)) is None  # not the same error
    two = job_error({0: ("E", 3), 2: ("E", 3)}, (0, 1, 2))
    assert two is not None and "[0, 2]" in two
    every = job_error({0: ("E", 1)}, (0,))
    assert every is not None and "[0]" in every  # every member (R = 1)


def test_diverged_majority_else_leader() -> None:
    assert diverged({0: "a", 1: "a", 2: "b"}, leader=0) == {2}
    assert diverged({0: "b", 1: "a", 2: "a"}, leader=0) == {0}  # the majority wins over the leader
    assert diverged({0: "a", 1: "b"}, leader=0) == {1}  # a tie: the leader's is the reference
    assert diverged({0: "a", 1: "b"}, leader=1) == {0}
    assert diverged({0: "a", 1: "a"}, leader=0) == set()
    assert diverged({}, leader=0) == set()


def test_an_admission_repairs_its_own_failure_else_the_oldest() -> None:
    assert repaired_failure(2, {}) is None  # nothing failed
    assert repaired_failure(1, {1: 9.0, 3: 5.0}) == 1  # a failed group back in its own place
    assert repaired_failure(2, {1: 9.0, 3: 5.0}) == 3  # a spare stands in for the longest-standing failure
    assert repaired_failure(2, {4: 5.0, 3: 5.0}) == 3  # ties: the lowest id


def test_expect_restarts_a_replicas_clock() -> None:
    d = FailureDetector(members=(0,), timeout_s=5, confirm_s=1, startup_s=60, start=0.0)
    assert d.silent_since(3) is None  # never beat
    d.expect(3, 100.0)
    assert d.silent_since(3) == 100.0  # its old beats are stale: it counts as up from now
    d.beat(3, 1.0)  # a stale view (its earlier incarnation's) does not move it back
    assert d.silent_since(3) == 100.0
    d.beat(3, 101.0)
    assert d.silent_since(3) == 101.0


def test_group_views_add_ranks_over_nodes_and_take_the_most_silent() -> None:
    a = NodeGroup(attempt=1, ranks=4, ready=4, finished=0, silent_s=0.5)
    b = NodeGroup(attempt=1, ranks=4, ready=3, finished=0, silent_s=2.0, stuck=Stuck(rank=3, step=7))
    old = NodeGroup(attempt=0, ranks=8, ready=0, finished=0, silent_s=0.0)
    views = group_views([(5, a, 100.0), (5, b, 99.0), (5, old, 50.0)])
    assert views[(5, 1)] == GroupView(
        ranks=8,
        ready=7,
        finished=0,
        alive_at=97.0,
        stuck="the main loop of its rank 3 made no progress (at step 7)",
        launcher_at=99.0,  # the launcher that wrote last least recently
    )
    assert views[(5, 0)].alive_at == views[(5, 0)].launcher_at == 50.0  # another incarnation: a view of its own


@pytest.mark.parametrize(
    "gap_s, moved, read, stalled",
    [
        (0.1, 0, 4, False),  # read every interval: silence is silence
        (2.6, 0, 4, True),  # over half the 5 s timeout and nothing moved: the store took no writes
        (2.6, 1, 4, True),  # fewer than half moved
        (2.6, 2, 4, False),  # half moved: the store took writes, the others are silent indeed
        (3.0, 12_499, 12_500, False),  # a slow read of 100,000 ranks with one node dead
        (2.5, 0, 4, False),  # exactly half the timeout is no stall
        (9.0, 0, 1, True),  # one node: a stall and its death look alike for one timeout
    ],
)
def test_a_store_stall_is_a_long_gap_in_which_most_node_messages_stood_still(
    gap_s: float, moved: int, read: int, stalled: bool
) -> None:
    assert store_stalled(gap_s, 5.0, moved, read) is stalled
