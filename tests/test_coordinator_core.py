"""The coordinator's decisions on the pure core: records in, effects out, no store, no processes."""

import dataclasses
import json
from typing import Callable

import pytest

from titan_recover.control.protocol import (
    Admission,
    CoordinatorState,
    Fence,
    Loss,
    MessageError,
    NodeGroup,
    Progress,
    Report,
    Snapshots,
    StepRecord,
    TransferRecord,
)
from titan_recover.coordinator.core import (
    KEEP_STEPS,
    Admit,
    CoordinatorCore,
    Emit,
    FenceOut,
    Forget,
    LogStep,
    Publish,
    Rules,
    Save,
    Say,
    Stop,
    stops,
)
from titan_recover.policy.membership import FailureDetector, Membership, group_views

pytestmark = pytest.mark.unit

RANKS = 2


def core(
    replicas: int = 3,
    spares: int = 0,
    min_replicas: int = 1,
    retries: int = 2,
    host_memory: bool = False,
    resume_wait_s: float = 0.0,
    launcher_timeout_s: float = 0.0,
    wall: Callable[[], float] = lambda: 1000.0,
    **lookups,
) -> CoordinatorCore:
    """A core of ``replicas`` groups of ``RANKS`` ranks; ``host_memory``: snapshots every 2 steps."""
    rules = Rules(
        replicas=replicas,
        replica_ids=replicas + spares,
        group_ranks=RANKS,
        steps=100,
        min_replicas=min_replicas,
        max_step_retries=retries,
        spare_timeout_s=5.0,
        snapshot_interval=2 if host_memory else 0,
        resume_wait_s=resume_wait_s,
        launcher_timeout_s=launcher_timeout_s,
    )
    detector = FailureDetector(members=tuple(range(replicas)), timeout_s=5.0, confirm_s=0.5, startup_s=60.0, start=0.0)
    return CoordinatorCore(rules, detector, wall=wall, **lookups)


def nodes(c: CoordinatorCore, now: float, **groups: NodeGroup) -> None:
    """What the node messages say, as the shell folds them (``r<id>=NodeGroup(...)``)."""
    c.on_nodes(group_views((int(name[1:]), g, now) for name, g in groups.items()), now)


def up(incarnation: int = 0, ready: int = 0, finished: int = 0) -> NodeGroup:
    return NodeGroup(attempt=incarnation, ranks=RANKS, ready=ready, finished=finished, silent_s=0.0)


def of(effects: list, kind: type) -> list:
    return [e for e in effects if isinstance(e, kind)]


def events(effects: list) -> list[str]:
    return [e.event for e in of(effects, Emit)]


def test_a_failed_member_is_fenced_in_a_new_epoch() -> None:
    c = core()
    effects = c.on_failure({1: "torchrun exited"}, now=10.0)
    assert of(effects, Publish) == [Publish(Membership(1, (0, 2)))]
    assert of(effects, FenceOut) == [FenceOut(1, Fence(0, 1))]
    assert events(effects) == ["failure", "recovered"]
    assert c.membership == Membership(1, (0, 2))
    assert c.state.down_since == {1: 1000.0}  # no beat, no injected fault: the detection time
    # the state is saved with the epoch, before the fence and the events that follow
    assert effects.index(Save()) < effects.index(FenceOut(1, Fence(0, 1)))


def test_a_member_that_reports_its_own_leave_leaves_in_a_new_epoch_without_a_failure() -> None:
    """A leave on notice goes out of the membership as a failure does, at once, but is no failure: no
    failure counted, no recovery, no slot held for its return (``down_since``)."""
    c = core()
    leave = Report(
        epoch=0, cause="left on notice before step 5", replica=1, suspect=1, step=5, attempt=0, left=True, notice_s=2.5
    )
    c.on_report(leave, now=1.0)
    failed, _ = c.detector.decide(now=1.0)
    assert failed == {1: "left on notice before step 5"}  # no detection timeout
    effects = c.on_failure(failed, now=1.0)
    assert of(effects, Publish) == [Publish(Membership(1, (0, 2)))]
    assert of(effects, FenceOut) == [FenceOut(1, Fence(0, 1))]
    [left] = of(effects, Emit)
    assert left.event == "left" and left.fields == {
        "replica": 1,
        "step": 5,
        "reason": "left on notice before step 5",
        "notice_s": 2.5,
        "attempt": 0,
    }
    assert c.state.failures == 0 and c.state.down_since == {} and not c.leaving


def test_a_leave_and_a_crash_in_one_decision_are_told_apart() -> None:
    c = core()
    c.on_report(Report(epoch=0, cause="left", replica=2, suspect=2, step=3, left=True), now=1.0)
    effects = c.on_failure({1: "torchrun exited", 2: "left"}, now=1.0)
    assert events(effects) == ["left", "failure", "recovered"]
    assert c.membership.members == (0,) and c.state.failures == 1 and list(c.state.down_since) == [1]


def test_every_member_leaving_on_notice_stops_the_run_in_order_instead_of_leaving_nobody() -> None:
    """A whole-job notice on any store: the leaves of every member, read before or in the decision, stop the run
    in order (the groups stop after the step they announced it in, its state saved) instead of a run with no
    group left; the leaves are no failures, and the run ends once every member finished."""
    c = core()
    c.on_step(StepRecord(4, 0, [0, 1, 2], [], "d", 1.0, None, time=1004.0))
    for r in (0, 1):
        c.on_report(Report(epoch=0, cause="left", replica=r, suspect=r, step=5, left=True), now=1.0)
    effects = c.on_failure(c.detector.decide(now=1.0)[0], now=1.0)
    assert events(effects) == ["left", "left"] and c.membership.members == (2,)  # one member still goes on
    c.on_report(Report(epoch=1, cause="left", replica=2, suspect=2, step=5, left=True), now=2.0)
    effects = c.on_failure(c.detector.decide(now=2.0)[0], now=2.0)
    assert events(effects) == ["stopping"] and not stops(effects)
    assert of(effects, Publish) == [Publish(Membership(2, (2,), last_step=5))]
    assert c.stopping is not None and c.stopping[1] == "every replica group leaves on notice"
    assert c.detector.decide(now=3.0)[0] == {} and c.state.failures == 0
    nodes(c, 4.0, r2=up(finished=RANKS))
    assert c.finished()


def test_a_report_of_a_leave_for_another_group_is_refused() -> None:
    raw = {"epoch": 0, "cause": "left", "replica": 0, "suspect": 1, "left": True}
    with pytest.raises(MessageError, match="a group leaves only on its own report"):
        Report.from_json("report/1", raw)
    with pytest.raises(MessageError, match="notice_s must be a leave's seconds"):
        Report.from_json("report/1", {**raw, "suspect": 0, "notice_s": "soon"})


def test_an_injected_fault_time_is_the_failure_time() -> None:
    c = core(fault_time=lambda replica, incarnation: 990.0 if (replica, incarnation) == (2, 0) else None)
    failure = of(c.on_failure({2: "killed"}, now=10.0), Emit)[0]
    assert (failure.fields["time"], failure.fields["clock"]) == (990.0, "fault_injected")
    recovered = of(c.on_failure({}, now=11.0), Emit)
    assert recovered == []  # a retry without failures: no recovery event


def test_too_few_replicas_stop_the_run() -> None:
    c = core(replicas=2, min_replicas=2)
    effects = c.on_failure({0: "gone"}, now=1.0)
    assert stops(effects) and "recover.min_replicas is 2" in of(effects, Stop)[0].error
    assert of(effects, Publish) == []  # nothing published once the run stops


def test_the_jobs_own_error_on_two_replicas_stops_instead_of_restarting() -> None:
    c = core()
    for r in (0, 1):
        c.on_report(Report(epoch=0, cause="rank 0 raised E", replica=r, suspect=r, step=3, error="E"), now=1.0)
    effects = c.on_failure({0: "E", 1: "E"}, now=1.0)
    assert "the job's own error" in of(effects, Stop)[0].error


def test_reports_about_old_epochs_or_other_incarnations_are_ignored() -> None:
    c = core()
    c.on_failure({}, now=1.0)  # epoch 1, same members
    c.on_report(Report(epoch=0, cause="old all-reduce error", replica=0), now=2.0)
    c.on_report(Report(epoch=1, cause="a restart crossed it", replica=1, suspect=1, attempt=7), now=2.0)
    assert c.detector.decide(now=100.0)[0] == {r: "no heartbeat within 60s of start" for r in (0, 1, 2)}
    c.on_report(Report(epoch=1, cause="torchrun exited", replica=1, suspect=1, attempt=0), now=2.0)
    assert c.detector.decide(now=2.0) == ({1: "torchrun exited"}, False)


def test_a_broken_step_is_retried_then_its_holdout_fenced_then_stopped() -> None:
    c = core(retries=1)
    c.on_report(Report(epoch=0, cause="all-reduce broke", replica=0), now=0.0)
    assert [p.membership for p in of(c.on_retry(now=1.0), Publish)] == [Membership(1, (0, 1, 2))]
    c.on_report(Report(epoch=1, cause="all-reduce broke", replica=1), now=1.0)
    fenced = c.on_retry(now=2.0)  # replica 2 never reported: the others waited for it
    assert of(fenced, FenceOut) == [FenceOut(2, Fence(0, 2))]
    c2 = core(replicas=2, retries=0)
    for r in (0, 1):
        c2.on_report(Report(epoch=0, cause="all-reduce broke", replica=r), now=0.0)
    assert "check the network between the replica groups" in of(c2.on_retry(now=1.0), Stop)[0].error


def test_a_notice_to_the_coordinators_node_stops_the_run_after_the_step_in_progress() -> None:
    """The run stops in order: an epoch of the same members says no step after the one in progress (3)
    commits, every later epoch (a failure meanwhile) says it too, nobody is admitted any more, and the run
    ends once every member finished; a second notice changes nothing."""
    c = core()
    c.on_step(StepRecord(2, 0, [0, 1, 2], [], "d", 1.0, None, time=1002.0))
    effects = c.on_notice("the coordinator's node goes away")
    assert of(effects, Publish) == [Publish(Membership(1, (0, 1, 2), last_step=3))]
    assert events(effects) == ["stopping"] and of(effects, Emit)[0].fields["step"] == 3
    assert c.on_notice("again") == [] and c.stopping == (3, "the coordinator's node goes away")
    assert of(c.on_failure({1: "killed"}, now=10.0), Publish) == [Publish(Membership(2, (0, 2), last_step=3))]
    nodes(c, 11.0, r0=up(), r2=up(), r1=up(incarnation=1, ready=RANKS))
    assert c.on_joins(now=11.0) == []  # the restarted group is not admitted into a run that stops
    assert not c.finished()
    nodes(c, 12.0, r0=up(finished=RANKS), r2=up(finished=RANKS), r1=up(incarnation=1, ready=RANKS))
    assert c.finished()


def test_an_epochs_last_step_is_checked_as_it_is_read() -> None:
    assert Membership.loads("epoch/1", json.dumps({"epoch": 1, "members": [0], "last_step": 4}).encode()).last_step == 4
    assert "last_step" not in Membership(1, (0,)).to_json()  # a run that does not stop writes what it always did
    with pytest.raises(MessageError, match="last_step must be a step"):
        Membership.loads("epoch/1", json.dumps({"epoch": 1, "members": [0], "last_step": -1}).encode())


def test_a_restarted_group_is_admitted_then_rejoins_at_its_first_commit() -> None:
    c = core()
    c.on_failure({1: "killed"}, now=10.0)
    nodes(c, 11.0, r0=up(), r2=up(), r1=up(incarnation=1, ready=RANKS))
    effects = c.on_joins(now=11.0)
    assert of(effects, Admit) == [Admit(1, Admission(1, 2))]
    assert c.membership == Membership(2, (0, 1, 2)) and c.state.joining == {1: 2}
    assert c.state.repairs == {1: (1, 1000.0)} and c.state.down_since == {}
    step = StepRecord(1, 2, [0, 1, 2], [], "d", 1.0, None, time=1004.5)
    assert c.accepts(step)
    assert of(c.on_step(step), LogStep) == [LogStep(step)]
    rejoined = c.on_rejoined(lambda r: [TransferRecord(100, 0.25, 1, 2), TransferRecord(50, 0.5, 1, 2)])
    assert of(rejoined, Emit)[0].fields == {"replica": 1, "step": 1, "bytes": 150, "transfer_s": 0.5, "downtime_s": 4.5}
    assert c.state.joining == {}


def test_a_ready_group_waits_as_a_spare_while_the_membership_is_full_and_is_dropped_when_silent() -> None:
    c = core(replicas=2, spares=1)
    nodes(c, 1.0, r0=up(), r1=up(), r2=up(ready=RANKS))
    assert events(c.on_joins(now=1.0)) == ["spare_ready"] and c.state.spares == {2: 0}
    effects = c.on_joins(now=7.0)  # no beat from it for 6 s
    assert events(effects) == ["spare_lost"] and of(effects, FenceOut) == [FenceOut(2, Fence(0, 0))]
    assert c.state.dropped == {2: 0}


def test_a_spare_takes_a_failed_members_place() -> None:
    c = core(replicas=2, spares=1)
    nodes(c, 1.0, r0=up(), r1=up(), r2=up(ready=RANKS))
    c.on_joins(now=1.0)
    c.on_failure({0: "killed"}, now=2.0)
    effects = c.on_joins(now=2.0)
    assert of(effects, Admit) == [Admit(2, Admission(0, 2))]
    assert of(effects, Emit)[0].fields["replaces"] == 0 and c.state.spares == {}


def test_a_restart_that_beat_detection_replaces_its_own_member() -> None:
    c = core()
    nodes(c, 1.0, r0=up(), r2=up(), r1=up(incarnation=1, ready=RANKS))
    effects = c.on_joins(now=1.0)
    assert of(effects, FenceOut) == [FenceOut(1, Fence(0, 1))]
    assert of(effects, Admit) == [Admit(1, Admission(1, 2))]


def test_finished_waits_for_every_member_with_state() -> None:
    c = core(replicas=2)
    nodes(c, 1.0, r0=up(finished=RANKS), r1=up())
    assert not c.finished()
    nodes(c, 2.0, r0=up(finished=RANKS), r1=up(finished=RANKS))
    assert c.finished()


def test_the_state_a_new_leader_takes_over_round_trips_through_json() -> None:
    c = core()
    c.on_failure({1: "killed"}, now=10.0)
    nodes(c, 11.0, r0=up(), r2=up(), r1=up(incarnation=1, ready=RANKS))
    c.on_joins(now=11.0)
    c.state.progress = Progress(4, 2, 1003.0)
    raw = json.loads(c.state.dumps())
    assert CoordinatorState.from_json("coordinator/state", raw) == c.state
    successor = core()
    successor.take_over(CoordinatorState.from_json("coordinator/state", raw), dict(c.history), epoch=2)
    assert successor.membership == c.membership and successor.step() == 5


def test_an_admission_is_written_before_the_epoch_that_includes_it() -> None:
    """A joiner looks for its admission when it sees a new epoch: the admission must be there by then."""
    c = core()
    c.on_failure({1: "killed"}, now=10.0)
    nodes(c, 11.0, r0=up(), r2=up(), r1=up(incarnation=1, ready=RANKS))
    effects = c.on_joins(now=11.0)
    assert effects.index(Admit(1, Admission(1, 2))) < effects.index(Publish(Membership(2, (0, 1, 2))))
    replaced = core()  # a restart that beat detection: fenced in one epoch, admitted in the next
    nodes(replaced, 1.0, r0=up(), r2=up(), r1=up(incarnation=1, ready=RANKS))
    effects = replaced.on_joins(now=1.0)
    assert effects.index(Admit(1, Admission(1, 2))) < effects.index(Publish(Membership(2, (0, 1, 2))))


def test_the_saved_state_keeps_reserved_report_slots_not_read_yet() -> None:
    """A new leader reads the slots its predecessor reserved but found empty (next_report is past them)."""
    c = core()
    c.state.next_report, c.state.unread_reports = 5, [2, 4]
    saved = CoordinatorState.from_json("coordinator/state", json.loads(c.state.dumps()))
    assert saved == c.state and saved.unread_reports == [2, 4]
    with pytest.raises(MessageError, match="unread_reports"):
        CoordinatorState.from_json("coordinator/state", {**json.loads(c.state.dumps()), "unread_reports": [7]})


def test_a_malformed_step_record_counts_as_committed_once_the_store_says_so() -> None:
    commits: set[tuple[int, int]] = set()
    c = core(committed=lambda step, epoch: (step, epoch) in commits)
    c.on_failure({}, now=1.0)  # epoch 1
    assert c.on_malformed_step("store key 'step/1': not JSON") == []  # not committed (yet): it waits
    assert c.step() == 1
    commits.add((1, 1))
    effects = c.on_malformed_step("store key 'step/1': not JSON")
    assert c.state.progress == Progress(1, 1, 1000.0) and c.step() == 2
    (event,) = of(effects, Emit)
    assert event.event == "step_unrecorded"
    assert event.fields == {"step": 1, "epoch": 1, "error": "store key 'step/1': not JSON"}
    assert effects.index(Save()) < effects.index(event)  # saved before its event, like a logged step


def commit(c: CoordinatorCore, step: int, epoch: int | None = None) -> list:
    return c.on_step(
        StepRecord(
            step, c.membership.epoch if epoch is None else epoch, [0, 1, 2], [], "d", 1.0, None, time=1000.0 + step
        )
    )


def forgotten(effects: list) -> Forget | None:
    found = of(effects, Forget)
    assert len(found) <= 1
    return found[0] if found else None


def test_a_committed_steps_keys_are_forgotten_once_after_a_window() -> None:
    c = core()
    c.start_step = 0
    steps: list[int] = []
    for step in range(1, 30):
        if step == 12:
            c.on_failure({}, now=1.0)  # epoch 1: step 12 is voted in epochs 0 and 1
        effects = commit(c, step)
        f = forgotten(effects)
        if f is not None:
            assert effects.index(Save()) < effects.index(f)  # the state that says so is saved first
            assert not f.steps or max(f.steps) == step - KEEP_STEPS
            steps += list(f.steps)
            if 12 in f.steps:
                assert list(f.vote_epochs) == [0, 1] and list(f.epochs) == [0]
    assert steps == list(range(1, 30 - KEEP_STEPS))  # each exactly once, the newest KEEP_STEPS kept
    assert c.state.forgotten_steps == 29 - KEEP_STEPS and c.state.kept_epoch == 1
    assert min(c.history) == 1  # the epochs forgotten are no longer read


def test_forgetting_starts_after_a_resumed_checkpoint_and_waits_for_known_epochs_after_a_takeover() -> None:
    c = core()
    c.start_step = 500  # resumed from a DCP checkpoint: no keys before it in this run
    for step in range(501, 501 + KEEP_STEPS + 1):
        f = forgotten(commit(c, step))
    assert f is not None and list(f.steps) == [501]
    successor = core()
    successor.take_over(
        CoordinatorState.from_json("coordinator/state", json.loads(c.state.dumps())), dict(c.history), 0
    )
    for step in range(506, 506 + KEEP_STEPS):
        assert forgotten(commit(successor, step)) is None  # the commit epochs of steps before it are not known here
    f = forgotten(commit(successor, 506 + KEEP_STEPS))
    assert f is not None and list(f.steps) == list(range(502, 507))  # then it goes on where its predecessor stopped


def test_report_slots_are_forgotten_below_the_first_one_not_read() -> None:
    c = core()
    c.start_step = 0
    c.state.next_report, c.state.unread_reports = 9, [4, 7]
    for step in range(1, KEEP_STEPS + 2):
        f = forgotten(commit(c, step))
    assert f is not None and list(f.reports) == [1, 2, 3]  # slot 4 may still be written: it and later ones stay
    c.state.unread_reports = []
    f = forgotten(commit(c, KEEP_STEPS + 2))
    assert f is not None and list(f.reports) == [4, 5, 6, 7, 8] and c.state.forgotten_reports == 8


def test_an_admission_is_forgotten_once_its_group_rejoined_or_a_newer_incarnation_is_admitted() -> None:
    c = core()
    c.on_failure({1: "killed"}, now=10.0)
    nodes(c, 11.0, r0=up(), r2=up(), r1=up(incarnation=1, ready=RANKS))
    c.on_joins(now=11.0)
    commit(c, 1)
    assert forgotten(c.on_rejoined(lambda r: [])) == Forget(admissions=((1, 1),))
    c.on_failure({1: "killed again"}, now=20.0)
    nodes(c, 21.0, r0=up(), r2=up(), r1=up(incarnation=2, ready=RANKS))
    assert forgotten(c.on_joins(now=21.0)) == Forget(admissions=((1, 1),))  # the incarnation it replaces


# ---- every group's state lost: resuming from the nodes' memory ------------------------------


class Clock:
    """The core's wall clock, moved by hand."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def lists(*per_rank: tuple[int, ...]) -> dict[int, Snapshots | None]:
    """A restarted group's lists: group rank k verified the steps ``per_rank[k]``."""
    return {k: Snapshots(steps) for k, steps in enumerate(per_rank)}


HeldLists = dict[tuple[int, int], dict[int, Snapshots | None]]


def lost_run(
    held: HeldLists, clock: Clock, resume_wait_s: float = 30.0, launcher_timeout_s: float = 0.0
) -> tuple[CoordinatorCore, list]:
    """Steps 1..6 committed, then every group fails in step 7 at 1000.0; ``held``: (replica, incarnation) -> the
    lists its ranks wrote (read at each look, so a test adds them as the groups come back)."""
    c = core(
        host_memory=True,
        resume_wait_s=resume_wait_s,
        launcher_timeout_s=launcher_timeout_s,
        wall=clock,
        snapshots=lambda replica, incarnation: held.get((replica, incarnation), {}),
    )
    for step in range(1, 7):
        commit(c, step)
    return c, c.on_failure({r: "its node went away" for r in (0, 1, 2)}, now=10.0)


def back(c: CoordinatorCore, now: float, *replicas: int, incarnation: int = 1) -> None:
    """These groups restarted (``incarnation``) with every rank up and waiting to join."""
    nodes(c, now, **{f"r{r}": up(incarnation=incarnation, ready=RANKS) for r in replicas})


def test_every_member_failing_before_a_snapshot_could_be_taken_stops_the_run() -> None:
    """Snapshots every 2 steps, step 1 committed: no node can hold one, so waiting for the groups is pointless."""
    c = core(host_memory=True)
    commit(c, 1)
    effects = c.on_failure({r: "killed" for r in (0, 1, 2)}, now=10.0)
    assert stops(effects) and "only 0 replica group(s) left" in of(effects, Stop)[0].error


def test_every_member_failing_stops_the_run_without_host_memory_snapshots() -> None:
    c = core()
    effects = c.on_failure({r: "killed" for r in (0, 1, 2)}, now=1.0)
    assert stops(effects) and "only 0 replica group(s) left" in of(effects, Stop)[0].error
    assert of(effects, Publish) == [] and c.state.loss is None


def test_a_group_with_state_left_below_min_replicas_still_stops_with_host_memory_snapshots() -> None:
    """Too few groups but one still holds the state: not a loss the snapshots are for (``StateLost``)."""
    c = core(replicas=2, min_replicas=2, host_memory=True)
    effects = c.on_failure({0: "killed"}, now=1.0)
    assert "recover.min_replicas is 2" in of(effects, Stop)[0].error and c.state.loss is None
    stopping = core(host_memory=True)
    stopping.on_notice("the coordinator's node goes away")
    assert stops(stopping.on_failure({r: "killed" for r in (0, 1, 2)}, now=1.0))  # a run that stops does not wait


def test_every_member_failing_with_host_memory_snapshots_waits_in_an_epoch_without_members() -> None:
    c, effects = lost_run({}, Clock())
    assert not stops(effects)
    assert of(effects, Publish) == [Publish(Membership(1, ()))] and c.membership == Membership(1, ())
    assert of(effects, FenceOut) == [FenceOut(r, Fence(0, 1)) for r in (0, 1, 2)]
    assert effects.index(Save()) < effects.index(FenceOut(0, Fence(0, 1)))  # saved with the loss, before the fences
    assert events(effects) == ["failure", "failure", "failure", "state_lost"]
    lost = of(effects, Emit)[-1].fields
    assert {k: lost[k] for k in ("step", "epoch", "groups")} == {"step": 7, "epoch": 1, "groups": [0, 1, 2]}
    assert "only 0 replica group(s) left" in lost["cause"]
    assert c.state.loss == Loss(7, 1000.0, (0, 1, 2)) and c.state.failures == 3
    assert not c.finished()  # no member: nothing to wait for, but the run is not over
    assert c.on_joins(now=11.0) == []  # nobody back yet


def test_a_group_still_rejoining_is_fenced_with_the_others_when_no_member_holds_state() -> None:
    c = core(host_memory=True)
    for step in (1, 2):  # step 2's snapshot may exist
        commit(c, step)
    c.on_failure({1: "killed"}, now=10.0)
    nodes(c, 11.0, r0=up(), r2=up(), r1=up(incarnation=1, ready=RANKS))
    c.on_joins(now=11.0)  # epoch 2: replica 1 (attempt 1) rejoins, without state until it commits
    assert c.state.joining == {1: 2}
    effects = c.on_failure({0: "killed", 2: "killed"}, now=12.0)
    assert not stops(effects) and of(effects, Publish) == [Publish(Membership(3, ()))]
    assert of(effects, FenceOut) == [FenceOut(0, Fence(0, 3)), FenceOut(1, Fence(1, 3)), FenceOut(2, Fence(0, 3))]
    assert c.state.joining == {} and c.state.loss is not None and c.state.loss.groups == (0, 1, 2)
    assert events(effects)[-1] == "state_lost" and c.state.failures == 3


def test_restarted_groups_resume_from_the_newest_step_of_which_every_shard_has_a_copy() -> None:
    """Replicas 0 and 2 hold both shards of step 4 (2's step 7 was never committed: ignored), replica 1 only shard
    0: all three resume from step 4, 1's rank 1 taking shard 1 from 0 or 2, and steps 5..7 are computed again."""
    clock, held = Clock(), HeldLists()
    c, _ = lost_run(held, clock)
    held[(0, 1)] = lists((6, 4), (4, 2))
    held[(1, 1)] = lists((4, 2), (2,))
    held[(2, 1)] = lists((7, 4), (7, 4))
    clock.t = 1020.0
    back(c, 20.0, 0, 1, 2)
    effects = c.on_joins(now=20.0)
    resume = Publish(Membership(2, (0, 1, 2)))
    assert of(effects, Admit) == [Admit(r, Admission(1, 2, 4, {1: (0, 2)})) for r in (0, 1, 2)]
    assert of(effects, Publish) == [resume]
    assert all(effects.index(a) < effects.index(resume) for a in of(effects, Admit))  # admissions first
    assert forgotten(effects) == Forget(steps=range(5, 8))
    assert events(effects) == ["resuming"]
    assert of(effects, Emit)[0].fields == {
        "step": 4,
        "lost_step": 7,
        "recomputed": 2,
        "groups": [0, 1, 2],
        "whole": [0, 2],
        "holders": {"1": [0, 2]},
    }
    assert c.step() == 5 and c.state.progress == Progress(4, 2, 1020.0)
    assert c.state.attempts == {0: 1, 1: 1, 2: 1} and not c.state.down_since
    assert c.state.loss == Loss(7, 1000.0, (0, 1, 2), resume_step=4)
    assert not of(c.on_joins(now=20.5), Admit)  # nobody left to join

    def record(epoch: int, time: float = 1030.0) -> StepRecord:
        return StepRecord(5, epoch, [0, 1, 2], [], "d", 1.0, None, time=time)

    assert not c.accepts(record(0))  # step 5 as committed before the loss: undone by the resume
    assert not c.accepts(record(1))
    assert c.accepts(record(2))


def test_copies_spread_over_groups_resume_with_each_rank_missing_its_shard_taking_it_from_another_group() -> None:
    """A rack lost with the groups spanning racks: replica 0 kept shard 0 of step 4, replica 1 shard 1; neither holds
    it whole, and both are admitted, each told which group holds the shard its other rank lacks."""
    clock, held = Clock(), HeldLists()
    c, _ = lost_run(held, clock)
    held[(0, 1)] = lists((4, 2), ())
    held[(1, 1)] = lists((), (4,))
    back(c, 20.0, 0, 1)
    assert not c.on_joins(now=20.0)  # replica 2 may still come back
    clock.t = 1031.0  # it did not, and resume_wait_s passed
    effects = c.on_joins(now=31.0)
    assert of(effects, Admit) == [Admit(r, Admission(1, 2, 4, {0: (0,), 1: (1,)})) for r in (0, 1)]
    assert of(effects, Publish) == [Publish(Membership(2, (0, 1)))]
    assert of(effects, Emit)[0].fields["whole"] == [] and not stops(effects)
    said = " ".join(e.message for e in of(effects, Say))
    assert "no group holding every shard: shard 0 from group(s) [0]; shard 1 from group(s) [1]" in said, said


def test_a_lost_group_whose_launchers_went_silent_is_not_waited_for() -> None:
    """Replica 2's node is gone with the state (its launcher's last message, of incarnation 0, was written at 10.0):
    with launcher_timeout_s 5 the groups back resume at 20.0 without it, not resume_wait_s (30 s) after the loss.
    Its launcher still writing at 19.0 (its group restarting), the resume waits for it."""
    for written, resumes in ((10.0, True), (19.0, False)):
        clock, held = Clock(1020.0), HeldLists()
        c, _ = lost_run(held, clock, launcher_timeout_s=5.0)
        held[(0, 1)] = lists((4,), (4,))
        held[(1, 1)] = lists((4,), (4,))
        views = group_views([(0, up(1, ready=RANKS), 20.0), (1, up(1, ready=RANKS), 20.0), (2, up(0), written)])
        c.on_nodes(views, 20.0)
        effects = c.on_joins(now=20.0)
        assert bool(of(effects, Admit)) == resumes, (written, effects)
        if resumes:
            assert of(effects, Publish) == [Publish(Membership(2, (0, 1)))]
            said = " ".join(e.message for e in of(effects, Say))
            assert "not waited for: group(s) [2], whose launchers wrote nothing for 5s" in said, said


def test_copies_of_different_steps_on_different_groups_stop_the_run_naming_them() -> None:
    clock, held = Clock(), HeldLists()
    c, _ = lost_run(held, clock)
    held[(0, 1)] = lists((4,), ())
    held[(1, 1)] = lists((), (6, 2))
    held[(2, 1)] = lists((), ())
    back(c, 20.0, 0, 1, 2)
    [stop] = of(c.on_joins(now=20.0), Stop)
    assert "shard 0: steps [4]; shard 1: steps [2, 6]" in stop.error and "last checkpoint" in stop.error


def test_a_group_without_the_resumed_step_rejoins_the_ordinary_way_and_the_first_commit_ends_the_loss() -> None:
    clock, held = Clock(), HeldLists()
    c, _ = lost_run(held, clock)
    held[(0, 1)] = lists((4,), (4,))
    held[(1, 1)] = lists((2,), (2,))  # no copy of step 4
    held[(2, 1)] = lists((4,), (4,))
    back(c, 20.0, 0, 1, 2)
    assert of(c.on_joins(now=20.0), Publish) == [Publish(Membership(2, (0, 2)))]
    joined = c.on_joins(now=21.0)
    assert of(joined, Admit) == [Admit(1, Admission(1, 3))]  # no resume_step: it takes the state from a member
    assert of(joined, Publish) == [Publish(Membership(3, (0, 1, 2)))]
    assert events(joined) == ["admitted"] and c.state.joining == {1: 3}
    first = c.on_step(StepRecord(5, 3, [0, 1, 2], [], "d", 1.0, None, time=1042.5))
    assert events(first) == ["resumed"]
    assert of(first, Emit)[0].fields == {"step": 5, "from_step": 4, "lost_step": 7, "seconds": 42.5}
    assert c.state.loss is None
    rejoined = of(c.on_rejoined(lambda r: []), Emit)
    assert [(e.event, e.fields["replica"], e.fields["step"]) for e in rejoined] == [("rejoined", 1, 5)]
    assert "resumed" not in events(commit(c, 6))


def test_the_resume_waits_for_every_lost_group_until_resume_wait_s_then_goes_on_with_those_back() -> None:
    clock, held = Clock(), HeldLists()
    c, _ = lost_run(held, clock, resume_wait_s=30.0)
    held[(0, 1)] = lists((6,), (6,))
    held[(1, 1)] = {0: Snapshots((6,)), 1: None}  # its rank 1 has not written its list yet
    held[(2, 0)] = lists((6,), (6,))  # the fenced incarnation's lists: not a group that came back
    nodes(c, 20.0, r0=up(incarnation=1, ready=RANKS), r1=up(incarnation=1, ready=RANKS), r2=up(ready=RANKS))
    clock.t = 1010.0
    assert c.on_joins(now=20.0) == []
    held[(1, 1)] = lists((6,), (6,))
    clock.t = 1029.9
    assert c.on_joins(now=21.0) == []  # replica 2 is not back, and 30 s have not passed
    assert not c.finished()
    clock.t = 1030.0
    effects = c.on_joins(now=22.0)
    assert of(effects, Admit) == [Admit(0, Admission(1, 2, 6)), Admit(1, Admission(1, 2, 6))]
    assert of(effects, Publish) == [Publish(Membership(2, (0, 1)))]
    assert forgotten(effects) == Forget(steps=range(7, 8))  # only the step in progress when they were lost
    assert of(effects, Emit)[0].fields["recomputed"] == 0 and c.step() == 7
    nodes(c, 40.0, r0=up(incarnation=1), r1=up(incarnation=1), r2=up(incarnation=1, ready=RANKS))
    late = c.on_joins(now=40.0)
    assert of(late, Admit) == [Admit(2, Admission(1, 3))] and c.state.joining == {2: 3}


def test_every_group_back_resumes_at_once_without_waiting() -> None:
    clock = Clock()
    c, _ = lost_run({(r, 1): lists((6,), (6,)) for r in (0, 1, 2)}, clock, resume_wait_s=600.0)
    clock.t = 1001.0
    back(c, 20.0, 0, 1, 2)
    assert of(c.on_joins(now=20.0), Publish) == [Publish(Membership(2, (0, 1, 2)))]


def test_no_snapshot_of_a_shard_anywhere_stops_the_run_naming_it_and_the_checkpoint() -> None:
    c, _ = lost_run({(r, 1): lists((6, 4), ()) for r in (0, 1, 2)}, Clock())
    back(c, 20.0, 0, 1, 2)
    effects = c.on_joins(now=20.0)
    assert of(effects, Admit) == [] and of(effects, Publish) == []
    [stop] = of(effects, Stop)
    assert "lost its state in step 7" in stop.error
    assert "shard(s) [1]" in stop.error and "shard 0: steps [4, 6]" in stop.error
    assert "resume from the last checkpoint" in stop.error


def test_no_group_back_at_all_stops_the_run_after_twice_resume_wait_s() -> None:
    clock = Clock()
    c, _ = lost_run({}, clock, resume_wait_s=30.0)
    clock.t = 1059.0
    assert c.on_joins(now=59.0) == []
    clock.t = 1060.0
    [stop] = of(c.on_joins(now=60.0), Stop)
    assert "no replica group came back" in stop.error and "checkpoint" in stop.error


def test_groups_their_launchers_restart_no_more_are_not_waited_for() -> None:
    """Every launcher said it restarts its group no more (``Report.final``): the run stops at once, without
    waiting ``resume_wait_s``; one given up among groups that are back does not hold the resume up."""
    clock = Clock()
    c, _ = lost_run({}, clock, resume_wait_s=600.0)
    for r in (0, 1, 2):
        c.on_report(
            Report(epoch=1, cause="exited (no restarts left)", replica=r, suspect=r, attempt=0, final=True), 11.0
        )
    [stop] = of(c.on_joins(now=12.0), Stop)
    assert "no replica group came back" in stop.error
    held = {(r, 1): lists((6,), (6,)) for r in (0, 1)}
    c, _ = lost_run(held, clock, resume_wait_s=600.0)
    c.on_report(Report(epoch=1, cause="exited (no restarts left)", replica=2, suspect=2, attempt=0, final=True), 11.0)
    back(c, 12.0, 0, 1)
    assert of(c.on_joins(now=12.0), Admit) == [Admit(r, Admission(1, 2, 6)) for r in (0, 1)]


def test_a_loss_round_trips_through_json_and_a_new_leader_resumes_from_it() -> None:
    clock = Clock()
    held = {(r, 1): lists((6,), (6,)) for r in (0, 1, 2)}
    c, _ = lost_run(held, clock)
    raw = json.loads(c.state.dumps())
    assert raw["loss"] == {"step": 7, "time": 1000.0, "groups": [0, 1, 2], "resume_step": None, "at_most": None}
    state = CoordinatorState.from_json("coordinator/state", raw)
    assert state == c.state
    successor = core(
        host_memory=True, resume_wait_s=30.0, wall=clock, snapshots=lambda replica, incarnation: held[replica, 1]
    )
    successor.take_over(state, dict(c.history), epoch=1)
    assert successor.membership == Membership(1, ()) and not successor.finished()
    back(successor, 20.0, 0, 1, 2)
    assert of(successor.on_joins(now=20.0), Publish) == [Publish(Membership(2, (0, 1, 2)))]
    assert successor.state.loss == Loss(7, 1000.0, (0, 1, 2), resume_step=6)
    again = CoordinatorState.from_json("coordinator/state", json.loads(successor.state.dumps()))
    assert again == successor.state


@pytest.mark.parametrize(
    "loss",
    [
        [7, 1000.0, [0]],
        {"step": 7, "time": 1000.0},
        {"step": -1, "time": 1000.0, "groups": []},
        {"step": 7, "time": "noon", "groups": []},
        {"step": 7, "time": 1000.0, "groups": ["0"]},
        {"step": 7, "time": 1000.0, "groups": [0], "resume_step": "4"},
    ],
)
def test_a_malformed_loss_in_the_saved_state_is_refused(loss: object) -> None:
    raw = {**json.loads(core().state.dumps()), "loss": loss}
    with pytest.raises(MessageError, match="loss needs step, time, groups and an optional resume_step"):
        CoordinatorState.from_json("coordinator/state", raw)


def test_a_group_outvoted_twice_within_the_window_is_quarantined_and_its_restarts_are_fenced() -> None:
    """SDC checks: an outvoted group's ranks each report themselves (``outvoted``): one strike per incarnation.
    The first fails the group as any report does, and it may come back; the second within ``sdc_window_s``
    quarantines it: saved in the state (a new leader keeps it), a ``quarantined`` event, and every incarnation its
    launcher starts after is fenced when it asks to join, never admitted."""
    clock = [1000.0]
    c = core(wall=lambda: clock[0])
    outvoted = lambda attempt: Report(  # noqa: E731
        epoch=c.membership.epoch, cause="outvoted", replica=1, suspect=1, step=c.step(), attempt=None, outvoted=True
    )  # caught in the step in progress, at its first since it joined: nothing to roll back
    for _ in range(RANKS):  # one report per rank: one strike
        assert events(c.on_report(outvoted(0), now=1.0)) == []
    assert c.state.strikes == {1: [1000.0]} and c.state.quarantined == {}
    c.on_failure(c.detector.decide(now=1.0)[0], now=1.0)
    nodes(c, 2.0, r0=up(), r1=up(incarnation=1, ready=RANKS), r2=up())
    assert events(c.on_joins(2.0)) == ["admitted"]  # back after its first strike
    clock[0] = 1000.0 + 3600.0
    effects = c.on_report(outvoted(1), now=3.0)
    assert events(effects) == ["quarantined"] and Save() in effects
    [quarantined] = of(effects, Emit)
    assert quarantined.fields == {"replica": 1, "step": 1, "strikes": [1000.0, 4600.0]}
    assert c.state.quarantined == {1: 1}
    assert CoordinatorState.from_json("s", json.loads(json.dumps(c.state.to_json()))).quarantined == {1: 1}
    c.on_failure(c.detector.decide(now=3.0)[0], now=3.0)
    nodes(c, 4.0, r0=up(), r1=up(incarnation=2, ready=RANKS), r2=up())
    effects = c.on_joins(4.0)
    assert of(effects, FenceOut) == [FenceOut(1, Fence(2, c.membership.epoch))] and not of(effects, Admit)
    assert of(c.on_joins(4.5), FenceOut) == []  # fenced once per incarnation
    assert 1 not in c.membership.members


def quarantine_on(placement: dict[str, set[int]]) -> tuple[CoordinatorCore, list]:
    """Three groups placed on nodes as ``placement`` says; replica 1 outvoted in two incarnations."""
    c = core(node_groups=lambda: placement)
    outvoted = lambda: Report(  # noqa: E731
        epoch=c.membership.epoch, cause="outvoted", replica=1, suspect=1, step=c.step(), outvoted=True
    )
    c.on_report(outvoted(), now=1.0)
    c.on_failure(c.detector.decide(now=1.0)[0], now=1.0)
    nodes(c, 2.0, r0=up(), r1=up(incarnation=1, ready=RANKS), r2=up())
    assert events(c.on_joins(2.0)) == ["admitted"]
    return c, c.on_report(outvoted(), now=3.0)


def test_a_quarantine_takes_the_other_groups_of_the_bad_groups_node_with_it() -> None:
    """Node a runs replicas 0 and 1, node b replica 2: replica 1 quarantined takes replica 0 with it, which fails
    now (its microbatches go to replica 2) and is never readmitted; node b's group is untouched."""
    c, effects = quarantine_on({"a": {0, 1}, "b": {2}})
    quarantined = [e.fields for e in of(effects, Emit) if e.event == "quarantined"]
    assert [q["replica"] for q in quarantined] == [1, 0], quarantined
    assert quarantined[1] == {"replica": 0, "step": 1, "with": 1, "nodes": ["a"]}
    assert c.state.quarantined == {1: 1, 0: 1}
    failed, _ = c.detector.decide(now=4.0)
    assert sorted(failed) == [0, 1], failed
    c.on_failure(failed, now=4.0)
    assert c.membership.members == (2,)
    nodes(c, 5.0, r0=up(incarnation=1, ready=RANKS), r1=up(incarnation=2, ready=RANKS), r2=up())
    assert sorted(f.replica for f in of(c.on_joins(5.0), FenceOut)) == [0, 1]


def test_a_quarantine_leaves_the_nodes_other_groups_where_no_member_runs_elsewhere() -> None:
    """Every group on one node (one launcher): quarantining the node would end the run. Replica 1 alone is
    quarantined, and the operator is told to replace the node."""
    c, effects = quarantine_on({"a": {0, 1, 2}})
    assert [e.fields["replica"] for e in of(effects, Emit) if e.event == "quarantined"] == [1]
    assert c.state.quarantined == {1: 1}
    assert any("also runs replica(s) [0, 2]; they stay" in s.message and s.warn for s in of(effects, Say)), effects


def test_strikes_older_than_the_window_do_not_count() -> None:
    clock = [1000.0]
    c = core(wall=lambda: clock[0])
    for attempt, now in ((0, 1000.0), (1, 1000.0 + 86400.0)):
        clock[0] = now
        report = Report(epoch=0, cause="outvoted", replica=2, suspect=2, step=1, outvoted=True)
        c.state.attempts[2] = attempt
        assert events(c.on_report(report, now=1.0)) == []
    assert c.state.strikes == {2: [87400.0]} and not c.state.quarantined


@pytest.mark.parametrize(
    "rec",
    [
        {"epoch": 0, "cause": "x", "replica": 1, "suspect": 2, "outvoted": True},  # of another group
        {"epoch": 0, "cause": "x", "replica": 1, "outvoted": True},  # of nobody
        {"epoch": 0, "cause": "x", "replica": 1, "suspect": 1, "outvoted": "yes"},
    ],
)
def test_an_outvoted_report_is_only_a_groups_own(rec: dict) -> None:
    with pytest.raises(MessageError, match="outvoted must be a boolean, said by a group of itself"):
        Report.from_json("k", rec)


@pytest.mark.parametrize(
    ("field", "value"),
    [("strikes", {"1": ["a"]}), ("strikes", {"1": [1.0] * 17}), ("quarantined", {"x": 3}), ("quarantined", {"1": -1})],
)
def test_a_saved_state_with_malformed_strikes_or_quarantine_is_refused(field: str, value: object) -> None:
    rec = CoordinatorState().to_json() | {field: value}
    with pytest.raises(MessageError, match=field):
        CoordinatorState.from_json("s", json.loads(json.dumps(rec)))


def rolled(keep: int, checked_at: int = 2) -> tuple[CoordinatorCore, HeldLists, list]:
    """Snapshots every 2 steps, ``keep`` of them; steps 1..6 committed, replica 1's gradients vouched for by step
    ``checked_at``'s check; then replica 1 outvoted in step 7 (its ranks' reports)."""
    held: HeldLists = {}
    c = core(host_memory=True, snapshots=lambda replica, incarnation: held.get((replica, incarnation), {}))
    c.rules = dataclasses.replace(c.rules, snapshot_keep=keep)
    for step in range(1, 7):
        checked = [1, 2] if step == checked_at else []
        c.on_step(
            StepRecord(step, c.membership.epoch, [0, 1, 2], [], "d", 1.0, None, time=1000.0 + step, checked=checked)
        )
    assert c.state.trusted == {1: checked_at, 2: checked_at}
    report = Report(epoch=c.membership.epoch, cause="outvoted", replica=1, suspect=1, step=7, outvoted=True)
    return c, held, c.on_report(report, now=1.0)


def test_a_bad_group_caught_after_unchecked_steps_rolls_the_run_back_to_a_snapshot_from_before_them() -> None:
    """Replica 1 last passed a check at step 2 and is outvoted in step 7: its gradients of steps 3..6 may be wrong.
    Snapshots reach back to step 2 (every 2 steps, 3 kept): at its failure every group is fenced, the run waits
    for them as after losing every group, and resumes from step 2 at the newest, not from step 6."""
    c, held, effects = rolled(keep=3)
    assert events(effects) == ["sdc_rollback"]
    assert of(effects, Emit)[0].fields == {"replica": 1, "step": 7, "to": 2, "steps": 4}
    effects = c.on_failure(c.detector.decide(now=1.0)[0], now=1.0)
    assert events(effects) == ["failure", "state_lost"] and of(effects, Publish) == [Publish(Membership(1, ()))]
    assert of(effects, FenceOut) == [FenceOut(r, Fence(0, 1)) for r in (0, 1, 2)]
    assert c.state.loss is not None and c.state.loss.at_most == 2 and c.rollback is None
    for r in (0, 1, 2):
        held[(r, 1)] = lists((6, 4, 2), (6, 4, 2))
    back(c, 2.0, 0, 1, 2)
    effects = c.on_joins(now=2.0)
    assert of(effects, Admit) == [Admit(r, Admission(1, 2, 2, {})) for r in (0, 1, 2)]
    assert of(effects, Emit)[0].fields["step"] == 2 and c.state.trusted == {1: 2, 2: 2}


def test_a_bad_group_caught_past_the_snapshots_kept_says_how_many_steps_may_have_trained_in() -> None:
    c, _, effects = rolled(keep=1)
    assert events(effects) == ["sdc_trained_in"]
    assert of(effects, Emit)[0].fields == {"replica": 1, "step": 7, "from": 3, "steps": 4}
    assert [s.warn for s in of(effects, Say)] == [True]
    effects = c.on_failure(c.detector.decide(now=1.0)[0], now=1.0)
    assert of(effects, Publish) == [Publish(Membership(1, (0, 2)))]  # in-step recovery only


def test_a_bad_group_caught_at_its_first_step_since_its_last_check_rolls_nothing_back() -> None:
    c, _, effects = rolled(keep=3, checked_at=6)
    assert events(effects) == [] and c.rollback is None


@pytest.mark.parametrize(
    ("trusted", "committed", "interval", "keep", "expected"),
    [(5, 9, 1, 8, 5), (5, 9, 1, 4, None), (5, 9, 2, 3, 4), (5, 9, 2, 2, None), (0, 9, 1, 20, None), (3, 9, 0, 9, None)],
)
def test_the_rollback_goes_to_the_newest_snapshot_at_or_before_the_last_vouched_step_still_kept(
    trusted: int, committed: int, interval: int, keep: int, expected: int | None
) -> None:
    from titan_recover.policy import sdc

    assert sdc.rollback_step(trusted, committed, interval, keep) == expected
