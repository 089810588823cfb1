"""The protocol client of one rank: what a rank says to and hears from the coordinator.

A ``ReplicaManager`` is to titan_recover what torchft's ``Manager`` is to torchft: the
trainer asks it which epoch a step runs in (``start_step``), hands it the gradients
(``allreduce``) and asks whether the step commits (``should_commit``); everything else
the protocol needs lives here too, so the trainer never touches a store key:

- the epoch view: the latest epoch, as this node's agent pushed it (``_read_epoch``, the
  one place that reads it and the run's fatal/done flags), agreed inside the replica
  group, and whether it moved while a collective runs;
- the membership of each epoch (cached: an epoch's members never change);
- the commit vote (``ok/<step>/<epoch>`` counter, ``decision/<step>/<epoch>`` outcome);
- failure reports: a replicate-dim collective that broke, the group's own failure, a
  fault the plan injected, a diverged replica;
- a leave on notice: said in the group's last step's all-reduce and reported with its commit, and the other
  members' wait for the epoch without it before the next all-reduce (``announce``, ``settled_epoch``);
- the rejoin handshake (ready to join, then the admission) and the transfer record;
- where the run's step records begin, the committed step's record, the parameter digests, and the end of the run;
- the rank's lifeline (``RankBeat``), started once, before TorchTitan builds
  the model, so the node agent sees the rank beat while it starts.

Words as in the glossary (docs/design.md): a *replica group* is one torchrun world; ``group_rank`` is
a rank's index inside its group (the same coordinate on every group; the replicate
all-reduce joins them).
"""

import logging
import os
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.distributed as dist

from titan_recover.config import Recover
from titan_recover.control import transport
from titan_recover.control.client import ABORT, COMMIT, REDO, ControlClient, redone
from titan_recover.control.protocol import (
    Admission,
    FaultRecord,
    MessageError,
    Report,
    Snapshots,
    StepRecord,
    TransferRecord,
)
from titan_recover.control.sealed import SealedStore
from titan_recover.data.tokens import DataError
from titan_recover.node import devices, procs
from titan_recover.node.channel import (
    CHANNEL_ENV,
    DONE,
    FATAL,
    FINISHED,
    LEAVE,
    READY,
    RUNNING,
    STARTING,
    Channel,
    RankBeat,
)
from titan_recover.observability import logs
from titan_recover.policy import steps
from titan_recover.policy.membership import Membership, awaited
from titan_recover.rank import snapshot, transfer
from titan_recover.rank.collectives import POLL_S, CollectiveAborted, backoff
from titan_recover.rank.exact import NonFinite
from titan_recover.rank.sdc_checks import CheckUndecided, ReplicaOutvoted

EPOCH_POLL_S = 0.02  # how stale a rank's view of the epoch may be while it waits
DECISION_WAIT_S = 0.1  # on etcd a rank watches for the commit decision this long at a time, then looks at
# the epoch (every read there is an HTTP request served by Raft: polling took CPU from computing ranks)


class ReplicaFenced(RuntimeError):
    """This replica group was declared failed; it must not rejoin this step."""


class RunFatal(RuntimeError):
    """The coordinator ended the run as ``fatal`` (e.g. fewer than min_replicas left)."""


class RunDone(Exception):
    """The run ended ``done`` while this (rejoining) group was still waiting to take part."""


class RunStopping(Exception):
    """The run stops in order (its coordinator's node goes away, or every group leaves on notice): this group's
    step is past the epoch's ``last_step``, or every member said it leaves, so it stops here, every step up to
    ``step`` committed."""

    def __init__(self, step: int, why: str = "the coordinator's node goes away") -> None:
        super().__init__(f"stops in order after step {step}: {why}")
        self.step = step


class ReplicaLeaving(Exception):
    """This replica group's node was told it goes away: the group leaves before ``step``, having
    committed every step before it and reported its leave with the last one's commit (``ReplicaManager.start_step``)."""

    def __init__(self, step: int, notice_s: float) -> None:
        super().__init__(f"leaves on notice before step {step}, {notice_s:.1f}s after the notice")
        self.step, self.notice_s = step, notice_s


PEER_FAILURE = re.compile(r"gloo|nccl|connection|timed out|timeout|closed by peer|broken pipe", re.IGNORECASE)


def brief(e: BaseException) -> str:
    """One line of an error for a report or the event log (gloo's messages run on for paragraphs)."""
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return text.split(". This is typically")[0][:200]


def own_error(e: BaseException) -> str | None:
    """The error as the same text on every replica that raises it, or None when it may be
    a peer's failure seen from here (a collective broke): only the former can be the job's."""
    if isinstance(e, dist.DistError) or PEER_FAILURE.search(str(e)):
        return None
    return re.sub(r"0x[0-9a-fA-F]+", "0x?", brief(e))


log = logging.getLogger(__name__)


class Collectives(Protocol):
    """What the manager needs of ``collectives.ReplicateProcessGroups`` (tests pass a stand-in)."""

    def allreduce(
        self,
        membership: Membership,
        tensors: list[torch.Tensor],
        abort: Callable[[], bool],
        on_launched: Callable[[], None] = ...,
    ) -> None: ...

    def pair(self, epoch: int, joiner: int, donor: bool, abort: Callable[[], bool]) -> Any: ...

    def close(self) -> int: ...


def stops_before(membership: Membership, step: int) -> None:
    """RunStopping when ``membership`` says the run stops before ``step`` (its ``last_step``)."""
    if membership.last_step is not None and step > membership.last_step:
        raise RunStopping(step - 1)


# raised as they are: the protocol already knows (fenced, run stopped), or no group failure
# explains them (a step that does not add up, a bad transfer, a malformed message)
NOT_REPORTED = (ReplicaFenced, RunFatal, RunStopping, steps.InvariantError, transfer.TransferError, MessageError)


class ReplicaManager:
    """The protocol client of rank ``group_rank`` of replica group ``replica``.

    Built in two stages: ``__init__`` (or ``connect``) before TorchTitan initializes, so the
    lifeline beats while the model is built; ``attach`` once the rank's device, its group's
    world and the replicate-dim groups exist.
    """

    def __init__(
        self,
        client: SealedStore,
        channel: Channel,
        *,
        slot: int,
        replica: int,
        group_rank: int,
        incarnation: int,
        rejoining: bool,
        rc: Recover,
        on_lost: Callable[[str], None],
    ) -> None:
        self.store, self.control, self.channel, self.slot = client, ControlClient(client), channel, slot
        self.replica, self.group_rank, self.incarnation, self.rc = replica, group_rank, incarnation, rc
        self.log = logs.for_rank(log, replica, group_rank)  # its lines begin with replica and rank
        self.rejoining = rejoining  # holds no training state until a peer sends it
        self.base_epoch = 0  # the epoch the previous step committed with
        self._round: tuple[tuple[int, int], int] = ((-1, -1), 0)  # (step, epoch) -> its vote round (a redo's)
        self.commit_round_s: float | None = None  # the last agreement round's vote to decision
        self.step = 0  # the step this rank works on (its reports and its channel slot name it)
        self.process_groups: Collectives | None = None
        self.device = torch.device("cpu")
        self.group_size = 1  # ranks in this replica group
        self._memberships: dict[int, Membership] = {}
        self._epoch_checked = (0.0, 0)
        self._start_told = False
        self.noticed_at: float | None = None  # when this rank's node was told it goes away (wall clock)
        self.leave_agreed = False  # ...and every rank of its group has (each acts at the same step boundary)
        self.leaving: tuple[int, ...] = ()  # groups that said in the last committed step's all-reduce they leave
        self.announced = False  # this group is one of them: its leave is reported with that step's commit
        self.everyone_leaves = False  # and so is every member of that step: the run stops in order after it
        self.aborted = 0  # this step's replicate all-reduces given up (an epoch change or a broken peer ended them)
        # step records are written off the step's path (on etcd each is a Raft write), in order
        self._offers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan-recover-steps")
        self._offered: list[Future[None]] = []
        channel.set_state(slot, STARTING)
        self.heartbeat = RankBeat(  # the one lifeline of this rank
            channel,
            slot,
            rc.heartbeat_interval_s,
            rc.progress_timeout_s,
            rc.coordinator_timeout_s,
            on_lost=on_lost,
        )

    @classmethod
    def connect(
        cls, rc: Recover, *, replica: int, group_rank: int, incarnation: int, rejoining: bool, resume_hint: str
    ) -> "ReplicaManager":
        """The manager of this process: the coordinator's store (it may still be starting) and
        the channel of this node's agent, both named by the environment the launcher sets."""
        client = transport.connect(transport.coordinator_address(), rc.startup_timeout_s)
        client.set_timeout(timedelta(seconds=rc.collective_timeout_s))
        channel = Channel.open(os.environ.get(CHANNEL_ENV, ""))
        who = f"replica {replica} rank {group_rank}"
        return cls(
            client,
            channel,
            slot=devices.local_rank(os.environ),
            replica=replica,
            group_rank=group_rank,
            incarnation=incarnation,
            rejoining=rejoining,
            rc=rc,
            on_lost=lambda reason: procs.exit_lost(who, reason, resume_hint),
        )

    def attach(self, groups: Collectives, device: torch.device, group_size: int) -> None:
        """The replicate-dim groups, and the device and size of this group's own world
        (where the in-group agreements run), once TorchTitan has set them up."""
        self.process_groups, self.device, self.group_size = groups, device, group_size

    # ---- the epoch view -------------------------------------------------------------

    def _read_epoch(self) -> int:
        """The latest epoch, as this node's agent pushed it into the channel (-1: none yet);
        raises RunFatal / RunDone when the run stopped. The only read of the epoch."""
        self.heartbeat.tick(f"waiting at step {self.step}")  # a loop that polls is not stuck
        self.channel.set_step(self.slot, self.step)
        flags = self.channel.flags()
        if flags & FATAL:
            raise RunFatal(self.control.fatal() or "the run stopped")
        if self.rejoining and flags & DONE:
            raise RunDone()  # the groups with state finished without us
        if flags & LEAVE:
            self.notice(self.channel.notice())
        return self.channel.epoch()

    def notice(self, at: float | None = None) -> None:
        """This rank's node goes away, told at ``at`` (its agent's LEAVE flag; None: now, a SIGTERM to the
        rank itself)."""
        if self.noticed_at is None:
            self.noticed_at = at or time.time()

    def epoch_moved(self, epoch: int) -> bool:
        """Throttled check whether the coordinator has published an epoch after ``epoch``
        (the abort test of every replicate-dim collective)."""
        last_time, last_epoch = self._epoch_checked
        now = time.monotonic()
        self.heartbeat.tick(f"in a collective at step {self.step}")
        if now - last_time >= EPOCH_POLL_S:
            self._epoch_checked = (now, self._read_epoch())
        return self._epoch_checked[1] > epoch

    def agree_epoch(self, newer_than: int = -1) -> int:
        """The epoch every rank of this replica group continues in (max of their views); whether one of
        them heard of a leave rides along (``leave_agreed``), so every rank of the group knows it at once."""
        deadline = time.monotonic() + self.rc.collective_timeout_s
        while (epoch := self._read_epoch()) <= newer_than:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no epoch after {newer_than} within {self.rc.collective_timeout_s}s")
            time.sleep(EPOCH_POLL_S)
        leave = self.noticed_at is not None
        if self.group_size > 1:
            t = torch.tensor([epoch, int(leave)], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            epoch, leave = int(t[0].item()), bool(t[1].item())
        self.leave_agreed = self.leave_agreed or leave
        return epoch

    def group_all(self, ok: bool) -> bool:
        """True only if every rank of this replica group says so (they then act alike)."""
        if self.group_size > 1:
            t = torch.tensor([int(ok)], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            ok = bool(t.item())
        return ok

    def membership(self, epoch: int) -> Membership:
        if epoch not in self._memberships:
            self._memberships[epoch] = self.control.membership(epoch)
        return self._memberships[epoch]

    def history(self, epoch: int) -> list[Membership]:
        """The memberships from the epoch the previous step committed with through ``epoch``
        (what the step's assignment is replayed from); ReplicaFenced if we are not in ``epoch``, RunStopping if
        the run stops before this step."""
        history = [self.membership(e) for e in range(self.base_epoch, epoch + 1)]
        if self.replica not in history[-1].members:
            raise ReplicaFenced(f"replica {self.replica} was fenced out in epoch {epoch}")
        stops_before(history[-1], self.step)
        return history

    # ---- the step -------------------------------------------------------------------

    def start_step(self, step: int) -> int:
        """Begins ``step``; returns the epoch this group starts it in. A group holding state
        tells the coordinator once where the run's step records begin (after a DCP resume too). A group that
        said in the last step's all-reduce that it leaves (``announce``) leaves here; a notice heard here or
        later in the step goes into this step's all-reduce, the group's last."""
        self.step, self.aborted = step, 0
        if not self.rejoining and not self._start_told:
            self.control.tell_start_step(step - 1)
            self._start_told = True
        epoch = self.agree_epoch()
        if self.announced:
            stops_before(self.membership(epoch), step)  # the run stops here too: the group stops with it, may save
            if self.everyone_leaves:  # nobody would go on: every group stops here, the state saved
                raise RunStopping(step - 1, "every replica group leaves on notice after it")
            raise ReplicaLeaving(step, self._notice_s())
        return epoch

    def _notice_s(self) -> float:
        """Seconds since this group's notice (since now, when a peer of the group heard it first)."""
        self.noticed_at = self.noticed_at or time.time()
        return time.time() - self.noticed_at

    def announce(self, leaving: tuple[int, ...], members: tuple[int, ...]) -> None:
        """The step committed with ``members``, and ``leaving`` said in its all-reduce that they leave after it
        (their ranks had agreed on a notice, ``leave_agreed``): the next step all-reduces in an epoch without them
        (``settled_epoch``). When this group is one of them, it leaves before the next step (``start_step``), and
        its first rank tells the coordinator now, before its optimizer step, which takes the group out of the
        next epoch at once (no detection, no failure), so that epoch is out while every member steps. Where every
        member leaves (a whole-job notice, on any store), the groups stop in order there instead: each knows it
        from the same all-reduce, so all save the same step, with no word from the coordinator needed."""
        self.leaving = leaving
        self.announced = self.replica in leaving
        self.everyone_leaves = self.announced and set(members) <= set(leaving)
        if self.announced and self.group_rank == 0:
            step, notice_s = self.step + 1, self._notice_s()
            self.control.report(
                Report(
                    epoch=max(self.channel.epoch(), 0),
                    cause=f"left on notice before step {step} ({notice_s:.1f}s after the notice)",
                    replica=self.replica,
                    suspect=self.replica,
                    step=step,
                    attempt=self.incarnation,
                    left=True,
                    notice_s=round(notice_s, 3),
                )
            )

    def settled_epoch(self, epoch: int) -> int:
        """The epoch this group all-reduces the step in, its share in ``epoch`` computed: the latest its ranks
        agree on. While that is still ``epoch`` and holds a group that said in the previous step's all-reduce it
        leaves after it (``membership.awaited``; it reported with that step's commit), a newer one is waited
        for, not an all-reduce that would wait for the leaver. The wait reports itself after report_confirm_s
        (a leaver that died silent is fenced) and ends after collective_timeout_s: the step then all-reduces
        in ``epoch``, where an all-reduce that breaks or is aborted recovers as any does."""
        latest = self.agree_epoch()
        if latest != epoch or not (gone := awaited(self.history(epoch), self.leaving)):
            return latest
        what = f"an epoch without replica(s) {list(gone)}, which leave after step {self.step - 1}"
        waited = self._waiting(epoch, lambda: what)
        deadline = time.monotonic() + self.rc.collective_timeout_s
        while latest == epoch:
            if not self.group_all(time.monotonic() < deadline):
                self.log.info(
                    f"step {self.step}: {what}, did not come within {self.rc.collective_timeout_s:g}s; "
                    f"it all-reduces in epoch {epoch}, which waits for them or for a newer epoch"
                )
                break
            waited()
            time.sleep(EPOCH_POLL_S)
            latest = self.agree_epoch()
        return latest

    def allreduce(self, membership: Membership, tensors: list[torch.Tensor], on_launched: Callable[[], None]) -> bool:
        """Sums ``tensors`` in place across ``membership``'s replicas; False (reported, the
        caller's other buffers untouched) when it broke or the epoch moved first."""
        assert self.process_groups is not None, "attach() first"
        epoch = membership.epoch
        try:
            self.process_groups.allreduce(
                membership, tensors, abort=lambda: self.epoch_moved(epoch), on_launched=on_launched
            )
        except CollectiveAborted as e:
            self.aborted += 1
            self.report_broken(epoch, f"replicate all-reduce broke (replica {self.replica} rank {self.group_rank})", e)
            return False
        return True

    def should_commit(self, membership: Membership, redo: bool = False) -> str:
        """The agreement round after the all-reduce: every rank of every member votes, and the
        step commits in this epoch (``COMMIT``) only if all did before the epoch moved (else
        ``ABORT``). ``redo``: this rank read from the sum that the step must be done again in this
        epoch (``[recover] exact``'s grid overflowed); every member read the same sum, so the last
        voter decides ``REDO`` for all, and the next call votes in the next round.

        A collective can succeed on some ranks and fail on others; the first writer of
        the decision wins, so every rank acts on the same outcome. The wait ends with the
        last vote or a new epoch: the wait is reported after ``report_confirm_s``, and the
        coordinator fences a member silent that long; a slow member still beating is waited
        for, and named in the log.
        """
        epoch = membership.epoch
        round = self._round[1] if self._round[0] == (self.step, epoch) else 0
        expected = len(membership.members) * self.group_size
        start = time.monotonic()
        outcome = redone(round + 1) if redo else COMMIT
        decision = self.control.vote(self.step, epoch, f"{self.replica}.{self.group_rank}", expected, outcome, round)
        pause, told = POLL_S[0], False
        waited = self._waiting(
            epoch,
            lambda: (
                f"the commit votes of step {self.step} ({self.control.votes(self.step, epoch, round)} of {expected})"
            ),
        )
        while decision is None or decision == redone(round):  # a redo's own start is no decision
            if self.epoch_moved(epoch):
                decision = self.control.abort(self.step, epoch, expected, round)
            elif self.rc.control_store and not round:  # a watch: the decision comes with its event
                decision = self.control.await_decision(self.step, epoch, DECISION_WAIT_S)
            elif (decision := self.control.decision(self.step, epoch)) in (None, redone(round)):
                pause = backoff(pause)  # slower replicas: spare the CPU
            waited()
            if not told and time.monotonic() - start > self.rc.collective_timeout_s:
                votes = self.control.votes(self.step, epoch, round)
                self.log.info(
                    f"step {self.step} epoch {epoch} has {votes} of "
                    f"{expected} commit votes after {self.rc.collective_timeout_s:g}s; "
                    "it waits for the rest or a new epoch"
                )
                told = True
        self.commit_round_s = time.monotonic() - start
        if decision == redone(round + 1):
            self._round = ((self.step, epoch), round + 1)
            return REDO
        return COMMIT if decision == COMMIT else ABORT

    def committed(self, membership: Membership) -> bool:
        """Records that the step committed in ``membership``'s epoch; True when that epoch
        differs from the previous step's on a group that held state (a failure or an
        admission happened during the step)."""
        changed = membership.epoch != self.base_epoch and not self.rejoining
        self.base_epoch = membership.epoch
        self.rejoining = False  # from here on this group holds the state like any member
        return changed

    def publish_step(self, record: StepRecord) -> None:
        """Offers the committed step's record; the first member's counts (the coordinator logs
        it), so a member dying after the commit loses nothing. The write runs while the next step
        computes; an error of an earlier one is raised here, one step late."""
        pending = []
        for offered in self._offered:
            if offered.done():
                offered.result()
            else:
                pending.append(offered)
        self._offered = pending
        self._offered.append(self._offers.submit(self.control.offer_step, record))

    def flush_steps(self) -> None:
        """Waits for the step records still being written (bounded by the store's timeout)."""
        for offered in self._offered:
            offered.result(timeout=self.rc.collective_timeout_s)
        self._offered = []

    def exchange_digests(self, members: tuple[int, ...], digest: str) -> dict[int, str]:
        """Publishes this replica's parameter digest of the step and collects the members'
        (a member fenced meanwhile never writes; the wait is bounded by collective_timeout_s)."""
        self.control.put_digest(self.step, self.replica, digest)
        wanted = list(members)
        epoch = self._read_epoch()
        waited = self._waiting(
            epoch,
            lambda: f"the parameter digests of step {self.step} from replicas {sorted(set(wanted) - set(digests))}",
        )
        deadline = time.monotonic() + self.rc.collective_timeout_s
        while len(digests := self.control.digests(self.step, wanted)) < len(wanted) and time.monotonic() < deadline:
            live = self.membership(self._read_epoch()).members
            wanted = [r for r in wanted if r in live]
            waited()
            time.sleep(EPOCH_POLL_S)
        return digests

    def _waiting(self, epoch: int, what: Callable[[], str]) -> Callable[[], None]:
        """Call it on every turn of a wait for peers outside a collective: once the wait has lasted
        ``report_confirm_s``, it reports it once (a waiting report), so that a peer that died
        between collectives is fenced after ``report_confirm_s`` of silence, not ``heartbeat_timeout_s``.
        Group rank 0 speaks for its group (its ranks wait for the same peers): one report per group."""
        start, told = time.monotonic(), self.group_rank != 0

        def turn() -> None:
            nonlocal told
            if not told and time.monotonic() - start >= self.rc.report_confirm_s and not self.epoch_moved(epoch):
                told = True
                self.control.report(
                    Report(
                        epoch=epoch,
                        cause=f"replica {self.replica} rank {self.group_rank} waited "
                        f"{self.rc.report_confirm_s:g}s for {what()}",
                        replica=self.replica,
                        step=self.step,
                        waiting=True,
                    )
                )

        return turn

    def tick(self, where: str) -> None:
        """The main loop made progress (at ``where``): the lifeline keeps beating."""
        self.heartbeat.tick(where)

    def finish(self) -> None:
        """This rank finished the run: its step records are written, its agent counts it, and its lifeline stops."""
        self.flush_steps()
        self._offers.shutdown()
        self.channel.set_state(self.slot, FINISHED)
        self.heartbeat.stop()

    def close(self) -> None:
        """This rank stops (finished or not): its threads end and its replicate-dim groups are closed
        (``ReplicateProcessGroups.close``), within about a second."""
        self._offers.shutdown(wait=False, cancel_futures=True)
        self.heartbeat.stop()
        if self.process_groups is not None and (kept := self.process_groups.close()):
            self.log.info(
                f"{kept} replicate-dim collective(s) still wait "
                "on a peer that finished or died; the rank leaves without waiting for them"
            )

    # ---- failure reports ------------------------------------------------------------

    def _report(
        self, epoch: int, suspect: int | None, cause: str, error: str | None = None, outvoted: bool = False
    ) -> None:
        self.control.report(
            Report(
                epoch=epoch,
                cause=cause,
                replica=self.replica,
                suspect=suspect,
                step=self.step,
                error=error,
                outvoted=outvoted,
            )
        )

    def report_broken(self, epoch: int, cause: str, e: BaseException) -> None:
        """Tells the coordinator a replicate-dim collective broke, without knowing whose fault."""
        if not self.epoch_moved(epoch):  # a peer broke it, not a newer epoch
            self._report(epoch, None, f"{cause}: {brief(e)}")

    def report_failure(self, epoch: int, e: BaseException) -> None:
        """Tells the coordinator this group failed in ``epoch`` with ``e`` (a peer of ours died,
        or our own error); bad data stops the run instead, as every replica would meet it.
        A NaN or inf gradient (``[recover] exact``) stops it too, and a snapshot folder without room for the
        node's snapshots (checked at start). ``NOT_REPORTED`` errors are left alone."""
        if isinstance(e, NOT_REPORTED):
            return
        if isinstance(e, (DataError, NonFinite, snapshot.SnapshotError, CheckUndecided)):
            self.control.stop(f"{type(e).__name__}: {e}")
            return
        error = own_error(e)
        rank = self.group_rank
        cause = f"rank {rank} raised {error}" if error else f"rank {rank} saw its own group fail: {brief(e)}"
        self._report(epoch, self.replica, cause, error, outvoted=isinstance(e, ReplicaOutvoted))

    def report_diverged(self, epoch: int, cause: str) -> None:
        """This replica's parameters differ from the others': it reports itself before it restarts."""
        self._report(epoch, self.replica, cause)

    def report_fault(self, record: FaultRecord) -> None:
        """An injected fault, for the coordinator's log (detection latency is measured from it)."""
        self.control.report_fault(self.replica, record)

    # ---- rejoin ---------------------------------------------------------------------

    def wait_for_admission(self, step: int, wanted: int, offer: Callable[[], Snapshots]) -> Admission:
        """Tells this node's agent the rank is ready to join (the agent tells the coordinator
        once every rank of the group is), then waits for the admission. A hot spare waits here
        while the membership is full (``wanted`` members): the wait ends with the admission, or
        with the run (RunDone / RunFatal), and the lifeline ends it if the coordinator is lost.

        In an epoch without members (every group lost its state) the coordinator resumes from the
        nodes' snapshots: ``offer`` lists the ones this rank verified, written once, before it says ready
        (so a group counted ready has written every rank's list)."""
        self.step = step
        offered = self._offer_if_lost(offer, self._read_epoch(), False)
        self.channel.set_state(self.slot, READY)
        self.log.info(f"(attempt {self.incarnation}) asks to join; " + self._why_wait(wanted))
        looked = -1
        while True:  # an admission comes with a new epoch: the store is read only then
            epoch = self._read_epoch()
            if epoch != looked:
                looked = epoch
                if self._admitted_in(epoch):
                    break
                if not offered and self._offer_if_lost(offer, epoch, True):
                    offered = True
            time.sleep(EPOCH_POLL_S)
        self.channel.set_state(self.slot, RUNNING)
        admission = self.control.admission(self.replica, self.incarnation)
        assert admission is not None  # _admitted_in read it
        return admission

    def _offer_if_lost(self, offer: Callable[[], Snapshots], epoch: int, ready: bool) -> bool:
        """Writes this rank's snapshot list where ``epoch`` has no members; whether it did. A rank already
        counted ready says it is not for as long as it verifies its files: its group is counted once it has
        written its list."""
        if epoch < 0 or self.membership(epoch).members:
            return False
        if ready:
            self.channel.set_state(self.slot, STARTING)
        self.control.put_snapshots(self.replica, self.incarnation, self.group_rank, offer())
        if ready:
            self.channel.set_state(self.slot, READY)
        return True

    def _why_wait(self, wanted: int) -> str:
        """What the rank waits for, from the latest membership: a free place, or one to free up."""
        epoch = self._read_epoch()
        if epoch < 0:
            return "no membership is published yet"
        members = len(self.membership(epoch).members)
        if members < wanted:
            return (
                f"{members} of {wanted} groups are members (epoch {epoch}): it is admitted once "
                "every rank of its group is up"
            )
        return f"the membership is full ({members} of {wanted}, epoch {epoch}): it waits as a hot spare"

    def _admitted_in(self, epoch: int) -> bool:
        """Whether this incarnation is admitted and a member of ``epoch``. The coordinator writes an
        admission before it publishes the epoch that includes the group; one whose leader died in
        between names an epoch its successor may publish without the group, which then re-admits it."""
        return self.control.admitted(self.replica, self.incarnation) and self.replica in self.membership(epoch).members

    @contextmanager
    def transfer_group(self, epoch: int, joiner: int, donor: bool) -> Iterator[Any]:
        """The two-rank group that hands ``joiner`` this group rank's state in ``epoch``;
        it aborts when the epoch moves."""
        assert self.process_groups is not None, "attach() first"
        with self.process_groups.pair(epoch, joiner, donor=donor, abort=lambda: self.epoch_moved(epoch)) as group:
            yield group

    def record_transfer(self, record: TransferRecord) -> None:
        """The state this rank received (the coordinator logs it)."""
        self.control.record_transfer(self.replica, self.group_rank, record)
