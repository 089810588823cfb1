"""The protocol client of one rank (``manager.ReplicaManager``), in-process and fast.

The coordinator's store is an in-process ``HashStore`` seen through the run
(``transport.in_run``), the node agent is played by publishing into a real channel file, and
the replicate-dim groups are a stand-in with ``ReplicateProcessGroups``' interface. The real
collectives and processes are the e2e tests'.
"""

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist

from titan_recover.config import Recover
from titan_recover.control import transport
from titan_recover.control.client import ABORT, COMMIT, REDO, ControlClient
from titan_recover.control.protocol import Admission, Report, Snapshots, StepRecord, TransferRecord
from titan_recover.control.sealed import Run
from titan_recover.data.tokens import DataError
from titan_recover.node.channel import DONE, FATAL, FINISHED, READY, RUNNING, STARTING, STATE, Channel
from titan_recover.policy.membership import Membership
from titan_recover.rank.collectives import CollectiveAborted
from titan_recover.rank.manager import ReplicaFenced, ReplicaLeaving, ReplicaManager, RunDone, RunFatal, RunStopping

pytestmark = pytest.mark.unit

RC = Recover(collective_timeout_s=0.5, heartbeat_interval_s=0.01, coordinator_timeout_s=3600.0)


class FakeGroups:
    """``ReplicateProcessGroups.allreduce``: every member contributed the same tensors, or it broke."""

    def __init__(self, error: str | None = None, during: Callable[[], None] = lambda: None) -> None:
        self.error, self.during = error, during
        self.calls: list[int] = []

    def allreduce(
        self,
        membership: Membership,
        tensors: list[torch.Tensor],
        abort: Callable[[], bool],
        on_launched: Callable[[], None] = lambda: None,
    ) -> None:
        self.calls.append(membership.epoch)
        on_launched()
        self.during()
        if self.error is not None or abort():
            raise CollectiveAborted(self.error or "the epoch ended first")
        for t in tensors:
            t.mul_(len(membership.members))

    def pair(self, epoch: int, joiner: int, donor: bool, abort: Callable[[], bool]) -> None:
        raise AssertionError("no transfer in these tests")

    def close(self) -> int:
        return 0


class Coordinator:
    """What the coordinator and the node agent do, by hand: publish memberships and epochs."""

    def __init__(self, tmp_path: Path) -> None:
        self.store = transport.in_run(dist.HashStore(), Run("s3cret", "test"))
        self.control = ControlClient(self.store)
        self.channel = Channel.create(0, 0, slots=4, directory=str(tmp_path))
        self.managers: list[ReplicaManager] = []

    def publish(self, epoch: int, members: tuple[int, ...], flags: int = 0) -> None:
        self.control.publish(Membership(epoch, members))
        self.channel.publish(epoch, flags)

    def manager(
        self,
        replica: int = 0,
        group_rank: int = 0,
        incarnation: int = 0,
        rejoining: bool = False,
        groups: FakeGroups | None = None,
    ) -> ReplicaManager:
        lost: list[str] = []
        m = ReplicaManager(
            self.store,
            self.channel,
            slot=len(self.managers),
            replica=replica,
            group_rank=group_rank,
            incarnation=incarnation,
            rejoining=rejoining,
            rc=RC,
            on_lost=lost.append,
        )
        m.attach(groups or FakeGroups(), torch.device("cpu"), 1)
        self.managers.append(m)
        return m

    def slot_state(self, m: ReplicaManager) -> int:
        return int(self.channel.read_slots()[m.slot, STATE])

    def reports(self) -> list[Report]:
        reports = [self.control.read_report(i) for i in range(1, self.control.report_count() + 1)]
        assert all(r is not None for r in reports)  # every reserved slot was written
        return [r for r in reports if r is not None]


@pytest.fixture
def coord(tmp_path: Path) -> Iterator[Coordinator]:
    c = Coordinator(tmp_path)
    yield c
    for m in c.managers:
        m.heartbeat.stop()
    c.channel.remove()


def step_record(step: int, loss: float) -> StepRecord:
    return StepRecord(
        step=step,
        epoch=0,
        members=[0, 1, 2],
        microbatches=[0],
        data_digest="0",
        loss=loss,
        grad_norm=None,
        time=time.time(),
    )


def no_snapshots() -> Snapshots:
    """A rank that verified no host-memory snapshot on its node."""
    return Snapshots(())


def later(seconds: float, action: Callable[[], None]) -> threading.Thread:
    def sleep_then_act() -> None:
        time.sleep(seconds)
        action()

    t = threading.Thread(target=sleep_then_act, daemon=True)
    t.start()
    return t


def test_commits_when_every_member_votes(coord: Coordinator) -> None:
    coord.publish(0, (0, 1))
    a, b = coord.manager(0), coord.manager(1)
    assert a.start_step(1) == 0 and b.start_step(1) == 0
    assert coord.control.start_step() == 0  # records begin after step 0
    current = a.history(0)[-1]
    grads = [torch.ones(3), torch.ones(1)]
    assert a.allreduce(current, grads, on_launched=lambda: None)
    assert grads[0].tolist() == [2.0, 2.0, 2.0]
    votes: list[str] = []
    voter = threading.Thread(target=lambda: votes.append(a.should_commit(current)))
    voter.start()
    time.sleep(0.05)
    assert coord.control.decision(1, 0) is None  # one vote of two: no decision yet
    assert b.should_commit(current) == COMMIT
    voter.join(timeout=5)
    assert votes == [COMMIT]
    assert coord.control.decision(1, 0) == "commit"
    assert not a.committed(current)  # the same epoch as the previous step: no failure in between
    assert not coord.reports()


def test_a_redo_decided_by_the_last_voter_is_voted_on_again_in_the_next_round(coord: Coordinator) -> None:
    """``[recover] exact``: every member read an overflow from the same sum; the step is redone in
    the same epoch, its votes counted afresh, and the decision that ends the redo is the step's."""
    coord.publish(0, (0, 1))
    a, b = coord.manager(0), coord.manager(1)
    a.start_step(1), b.start_step(1)
    current = a.history(0)[-1]
    first: list[str] = []
    voter = threading.Thread(target=lambda: first.append(a.should_commit(current, redo=True)))
    voter.start()
    assert b.should_commit(current, redo=True) == REDO
    voter.join(timeout=5)
    assert first == [REDO] and coord.control.decision(1, 0) == "redo1"
    second: list[str] = []
    voter = threading.Thread(target=lambda: second.append(a.should_commit(current)))
    voter.start()
    time.sleep(0.05)
    assert coord.control.decision(1, 0) == "redo1"  # one vote of two in round 1: the redo stands
    assert b.should_commit(current) == COMMIT
    voter.join(timeout=5)
    assert second == [COMMIT] and coord.control.decision(1, 0) == COMMIT
    assert coord.control.votes(1, 0, round=1) == 2


def test_aborts_when_the_epoch_moves_during_the_vote(coord: Coordinator) -> None:
    coord.publish(0, (0, 1))
    a = coord.manager(0)
    current = a.history(a.start_step(1))[-1]
    later(0.05, lambda: coord.publish(1, (0,)))  # replica 1 was fenced before it voted
    start = time.monotonic()
    assert a.should_commit(current) == ABORT
    assert time.monotonic() - start < 1.0
    assert coord.control.decision(1, 0) == "abort"
    late = coord.manager(1)  # its vote comes too late to change the outcome
    late.step = 1
    assert late.should_commit(current) == ABORT
    assert a.agree_epoch(newer_than=0) == 1
    assert a.history(1)[-1].members == (0,)
    assert a.committed(a.history(1)[-1])  # committing in a later epoch than the last step's


def test_a_broken_allreduce_is_reported_with_its_cause(coord: Coordinator) -> None:
    coord.publish(0, (0, 1))
    m = coord.manager(1, group_rank=1, groups=FakeGroups(error="Connection closed by peer"))
    current = m.history(m.start_step(3))[-1]
    grads = [torch.ones(2)]
    assert not m.allreduce(current, grads, on_launched=lambda: None)
    assert grads[0].tolist() == [1.0, 1.0]
    (report,) = coord.reports()
    assert (report.replica, report.epoch, report.step, report.suspect) == (1, 0, 3, None)
    assert "replicate all-reduce broke (replica 1 rank 1)" in report.cause  # the rank (group_rank 1) is named here
    assert "Connection closed by peer" in report.cause


def test_an_allreduce_aborted_by_a_new_epoch_is_not_reported(coord: Coordinator) -> None:
    coord.publish(0, (0, 1))
    groups = FakeGroups(during=lambda: coord.publish(1, (0,)))
    m = coord.manager(0, groups=groups)
    current = m.history(m.start_step(2))[-1]
    assert not m.allreduce(current, [torch.ones(1)], on_launched=lambda: None)
    assert groups.calls == [0] and not coord.reports()
    assert m.aborted == 1  # the step's all-reduces given up, for its recovery_moments event
    m.start_step(3)
    assert m.aborted == 0


def test_a_leaver_reports_with_its_last_steps_commit_and_leaves_before_the_next(coord: Coordinator) -> None:
    """Its group heard a notice as step 3 began: it computes step 3 with the others and says so in the step's
    all-reduce; its first rank reports the leave as the step commits, naming step 4 as the first without it,
    and the group leaves as step 4 begins."""
    coord.publish(0, (0, 1))
    first, second = coord.manager(1), coord.manager(1, group_rank=1)
    for m in (first, second):
        m.notice(time.time() - 2.0)
        assert m.start_step(3) == 0 and m.leave_agreed  # the notice is heard; the step goes on
        m.announce((1,), (0, 1))
    (report,) = coord.reports()  # its first rank's only
    assert (report.suspect, report.replica, report.step, report.left) == (1, 1, 4, True)
    assert report.notice_s is not None and 2.0 <= report.notice_s < 10, report
    assert report.cause.startswith("left on notice before step 4 (2.")
    for m in (first, second):
        with pytest.raises(ReplicaLeaving, match="leaves on notice before step 4"):
            m.start_step(4)
    assert len(coord.reports()) == 1


def test_every_member_leaving_after_one_step_stops_the_run_in_order_there(coord: Coordinator) -> None:
    """A whole-job notice: both groups said in step 3's all-reduce that they leave. Each group's ranks know it from
    the same all-reduce, so each stops in order after step 3 (and saves it), with no word from the coordinator."""
    coord.publish(0, (0, 1))
    m = coord.manager(1)
    m.notice(time.time() - 1.0)
    m.start_step(3)
    m.announce((0, 1), (0, 1))
    with pytest.raises(RunStopping) as stopping:
        m.start_step(4)
    assert stopping.value.step == 3
    (report,) = coord.reports()  # the leave is still reported: a coordinator that reads it stops the run in order
    assert report.left and report.step == 4


def test_the_step_after_a_leave_all_reduces_once_the_epoch_without_the_leaver_is_out(coord: Coordinator) -> None:
    """Replica 1 said in step 3's all-reduce that it leaves after it: replica 0's step 4 waits, its share
    computed, for the epoch without it instead of an all-reduce that would wait for replica 1."""
    coord.publish(0, (0, 1))
    m = coord.manager(0)
    m.start_step(3)
    m.announce((1,), (0, 1))
    m.committed(m.history(0)[-1])
    assert not coord.reports()  # another group's leave: nothing to say
    assert m.start_step(4) == 0
    later(0.1, lambda: coord.publish(1, (0,)))
    assert m.settled_epoch(0) == 1
    assert m.settled_epoch(1) == 1  # replica 1 is out: nothing to wait for
    assert not coord.reports()
    m.announce((), (0, 1))
    coord.publish(2, (0, 2))
    assert m.settled_epoch(1) == 2  # no leave: the latest epoch, at once


def test_the_wait_for_a_leavers_epoch_reports_itself_and_is_bounded(
    coord: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    """The leaver's report never came (it died as it left): after report_confirm_s the wait is reported (a silent
    leaver is fenced), after collective_timeout_s the step all-reduces in the epoch it has, saying so."""
    coord.publish(0, (0, 1))
    m = coord.manager(0)
    m.rc = dataclasses.replace(RC, collective_timeout_s=0.3, report_confirm_s=0.05)
    m.start_step(3)
    m.announce((1,), (0, 1))
    m.committed(m.history(0)[-1])
    m.start_step(4)
    with caplog.at_level(logging.INFO):
        assert m.settled_epoch(0) == 0
    assert "step 4: an epoch without replica(s) [1], which leave after step 3, did not come within 0.3s" in caplog.text
    (report,) = coord.reports()
    assert report.waiting and report.suspect is None and report.step == 4, report
    assert "waited 0.05s for an epoch without replica(s) [1]" in report.cause


def test_the_groups_own_failure_is_reported_with_the_error(coord: Coordinator) -> None:
    coord.publish(0, (0, 1))
    m = coord.manager(1, group_rank=0)
    m.start_step(4)
    m.report_failure(0, ValueError("bad shape at 0xdeadbeef"))
    m.report_failure(0, RuntimeError("[gloo] Connection reset by peer"))
    m.report_failure(0, ReplicaFenced("fenced"))  # the coordinator knows: nothing to say
    (own, peer) = coord.reports()
    assert own.suspect == 1 and own.error == "ValueError: bad shape at 0x?"
    assert own.cause == "rank 0 raised ValueError: bad shape at 0x?" and own.step == 4
    assert peer.suspect == 1 and peer.error is None and "saw its own group fail" in peer.cause
    m.report_failure(0, DataError("token file truncated"))  # every replica would meet it: the run stops
    assert coord.control.fatal() == "DataError: token file truncated"
    assert len(coord.reports()) == 2


def test_a_fenced_replica_raises(coord: Coordinator) -> None:
    coord.publish(0, (0, 1))
    coord.publish(1, (0,))
    m = coord.manager(1)
    assert m.start_step(1) == 1
    with pytest.raises(ReplicaFenced, match="replica 1 was fenced out in epoch 1"):
        m.history(1)


def test_the_run_failing_reaches_every_wait(coord: Coordinator) -> None:
    coord.publish(0, (0, 1))
    m = coord.manager(0)
    coord.control.stop("only 1 replica group(s) left")
    coord.channel.publish(0, FATAL)
    with pytest.raises(RunFatal, match="only 1 replica group"):
        m.start_step(1)


def test_agreeing_on_a_newer_epoch_is_bounded(coord: Coordinator) -> None:
    coord.publish(0, (0, 1))
    m = coord.manager(0)
    m.rc = dataclasses.replace(RC, collective_timeout_s=0.05)
    with pytest.raises(TimeoutError, match="no epoch after 0 within 0.05s"):
        m.agree_epoch(newer_than=0)


def test_join_request_then_admission(coord: Coordinator) -> None:
    coord.publish(0, (0, 1))
    m = coord.manager(2, incarnation=1, rejoining=True)
    assert coord.slot_state(m) == STARTING
    waiter = threading.Thread(target=m.wait_for_admission, args=(0, 2, no_snapshots), daemon=True)
    waiter.start()
    time.sleep(0.05)
    assert coord.slot_state(m) == READY  # the node agent tells the coordinator
    coord.control.admit(2, Admission(attempt=1, epoch=1))
    time.sleep(0.05)
    assert waiter.is_alive()  # an admission comes with a new epoch: only then is the store read
    coord.publish(1, (0, 1, 2))
    waiter.join(timeout=5)
    assert not waiter.is_alive() and coord.slot_state(m) == RUNNING
    assert m.agree_epoch() == 1
    m.start_step(1)
    assert coord.control.start_step() is None  # a rejoiner holds no state: it does not say where records begin


def test_a_spare_waiting_for_admission_ends_with_the_run(coord: Coordinator) -> None:
    coord.publish(0, (0, 1))
    m = coord.manager(2, rejoining=True)
    later(0.05, lambda: coord.channel.publish(0, DONE))
    with pytest.raises(RunDone):
        m.wait_for_admission(0, 2, no_snapshots)


@pytest.mark.parametrize(
    "members, says",
    [
        ((0,), "1 of 2 groups are members (epoch 0): it is admitted once"),
        ((0, 1), "the membership is full (2 of 2, epoch 0): it waits as a hot spare"),
    ],
)
def test_a_joiner_says_what_it_waits_for(
    coord: Coordinator, members: tuple[int, ...], says: str, caplog: pytest.LogCaptureFixture
) -> None:
    coord.publish(0, members)
    m = coord.manager(1 if len(members) == 1 else 2, incarnation=1, rejoining=True)
    later(0.05, lambda: coord.channel.publish(0, DONE))
    with caplog.at_level(logging.INFO), pytest.raises(RunDone):
        m.wait_for_admission(3, 2, no_snapshots)
    assert f"(attempt 1) asks to join; {says}" in caplog.text


def test_records_digests_and_the_end(coord: Coordinator) -> None:
    coord.publish(0, (0, 1, 2))
    m = coord.manager(0)
    m.start_step(5)
    m.publish_step(step_record(5, loss=1.0))
    m.flush_steps()
    coord.managers.append(
        other := ReplicaManager(  # a second member offers its record too: the first counts
            coord.store,
            coord.channel,
            slot=1,
            replica=1,
            group_rank=0,
            incarnation=0,
            rejoining=False,
            rc=RC,
            on_lost=print,
        )
    )
    other.step = 5
    other.publish_step(step_record(5, loss=2.0))
    other.flush_steps()
    record = coord.control.read_step(5)
    assert record is not None and record.loss == 1.0
    coord.control.put_digest(5, 1, "abc")
    coord.publish(1, (0, 1))  # replica 2 was fenced: nobody waits for its digest
    assert m.exchange_digests((0, 1, 2), "abc") == {0: "abc", 1: "abc"}
    m.record_transfer(TransferRecord(bytes=1, transfer_s=0.1, step=5, epoch=1))
    assert coord.store.check(["transfer/0/0"])  # the key string other processes read
    assert coord.control.read_transfer(0, 0) == TransferRecord(bytes=1, transfer_s=0.1, step=5, epoch=1)
    m.finish()
    assert coord.slot_state(m) == FINISHED


def test_step_records_are_written_behind_the_step_and_all_there_at_the_finish(coord: Coordinator) -> None:
    coord.publish(0, (0,))
    m = coord.manager(0)
    written = threading.Event()
    offer = m.control.offer_step

    def offer_once_written(record: StepRecord) -> None:
        written.wait(5)
        offer(record)

    m.control.offer_step = offer_once_written  # type: ignore[method-assign]  # held until the test lets it through
    m.publish_step(step_record(1, loss=1.0))
    m.publish_step(step_record(2, loss=2.0))  # returns while the first is still being written
    assert coord.control.read_step(1) is None
    written.set()
    m.finish()  # the records are in the store before the agent counts the rank finished
    records = [coord.control.read_step(s) for s in (1, 2)]
    assert [r.loss if r is not None else None for r in records] == [1.0, 2.0]


def test_a_step_record_that_could_not_be_written_fails_the_next_step(coord: Coordinator) -> None:
    coord.publish(0, (0,))
    m = coord.manager(0)

    def refused(record: StepRecord) -> None:
        raise dist.DistStoreError("the store went away")

    m.control.offer_step = refused  # type: ignore[method-assign]  # the store refuses every step record
    m.publish_step(step_record(1, loss=1.0))
    time.sleep(0.2)
    with pytest.raises(dist.DistStoreError, match="went away"):
        m.publish_step(step_record(2, loss=1.0))


def test_a_joiner_goes_on_only_in_an_epoch_that_includes_it(coord: Coordinator) -> None:
    """The admission is written before its epoch is published; a leader that dies in between leaves an
    admission whose epoch never includes the group: the joiner waits for its successor's admission."""
    coord.publish(0, (0, 1))
    m = coord.manager(2, incarnation=1, rejoining=True)
    waiter = threading.Thread(target=m.wait_for_admission, args=(0, 2, no_snapshots), daemon=True)
    waiter.start()
    coord.control.admit(2, Admission(attempt=1, epoch=1))  # then its leader died before publishing epoch 1
    time.sleep(0.05)
    coord.publish(1, (0,))  # the next leader's epoch 1 (replica 1 failed) does not include it
    time.sleep(0.1)
    assert waiter.is_alive() and coord.slot_state(m) == READY
    coord.control.admit(2, Admission(attempt=1, epoch=2))  # the next leader admits the group still asking
    coord.publish(2, (0, 2))
    waiter.join(timeout=5)
    assert not waiter.is_alive() and coord.slot_state(m) == RUNNING


class Offers:
    """``offer`` of a rank with snapshots of steps 4 and 2 on its node: counts its calls and the slot state at each."""

    def __init__(self, coord: Coordinator, m: ReplicaManager) -> None:
        self.coord, self.m = coord, m
        self.states: list[int] = []

    def __call__(self) -> Snapshots:
        self.states.append(self.coord.slot_state(self.m))
        return Snapshots((4, 2))


def until(check: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return check()


@pytest.mark.parametrize("lost_before", [True, False], ids=["lost-before-the-wait", "lost-during-the-wait"])
def test_a_rank_waiting_while_no_group_is_a_member_writes_its_snapshot_list_once(
    coord: Coordinator, lost_before: bool
) -> None:
    """Every group lost its state: the coordinator waits, in an epoch without members, for the restarted
    groups' lists. A rank writes its list once, while its slot says it is not ready (the group is counted
    ready only once every rank's list is there), and its admission says which step it resumes from."""
    coord.publish(0, (0, 1))
    if lost_before:
        coord.publish(1, ())
    m = coord.manager(0, group_rank=1, incarnation=1, rejoining=True)
    offer = Offers(coord, m)
    admitted: list[Admission] = []
    waiter = threading.Thread(target=lambda: admitted.append(m.wait_for_admission(5, 2, offer)), daemon=True)
    waiter.start()
    assert until(lambda: coord.slot_state(m) == READY)
    if not lost_before:
        time.sleep(0.05)
        assert offer.states == []  # the epoch has members: nothing to write
        coord.publish(1, ())
    assert until(lambda: len(offer.states) == 1)
    assert offer.states == [STARTING]
    assert until(lambda: coord.slot_state(m) == READY)
    assert coord.control.snapshots(0, 1, group_ranks=2) == {0: None, 1: Snapshots((4, 2))}
    coord.publish(2, ())  # a later epoch without members (a leader taking over): written once
    time.sleep(0.05)
    assert len(offer.states) == 1 and waiter.is_alive()
    coord.control.admit(0, Admission(attempt=1, epoch=3, resume_step=4))
    coord.publish(3, (0,))
    waiter.join(timeout=5)
    assert not waiter.is_alive() and admitted == [Admission(1, 3, 4)]
    assert coord.slot_state(m) == RUNNING and len(offer.states) == 1
