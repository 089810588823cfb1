"""The coordinator's decisions as a pure state machine: records in, effects out.

``CoordinatorCore`` holds the bookkeeping (``protocol.CoordinatorState``: attempts, joining
groups, repairs, spares, dropped groups, down-since times, the last committed step) and
the membership history. Its transitions (``on_step``, ``on_malformed_step``, ``on_nodes``,
``on_report``, ``on_failure``, ``on_retry``, ``on_joins``, ``on_rejoined``) change that state
and return the effects the shell (``coordinator.Coordinator``) carries out in order: publish
an epoch, fence or admit an incarnation, save the state, write an event, log a line, stop
the run, forget store keys nobody reads any more. Reads it needs (an injected fault's time,
a step's decision, transfer records) come in as functions, so every rule is testable in
microseconds without a store.
"""

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Union

from titan_recover.control.protocol import (
    CANCELLED,
    FAILED,
    JOINED,
    LEFT,
    Admission,
    CoordinatorState,
    Fence,
    Loss,
    Progress,
    Report,
    Request,
    Snapshots,
    StepRecord,
    TransferRecord,
)
from titan_recover.observability.logs import id_list
from titan_recover.policy import replacements, sdc
from titan_recover.policy.membership import (
    FailureDetector,
    GroupView,
    Membership,
    admit,
    repaired_failure,
    retry_verdict,
)
from titan_recover.policy.replacements import Bounds
from titan_recover.policy.resume import ResumePlan, resume_plan
from titan_recover.policy.roster import DropSpare, Leave, Limits, Roster, joins, reported, take_out

KEEP_STEPS = 4  # a committed step's store keys outlive it by this many steps. A step commits only once
# every rank of its members voted in it, having read the decision and offered the record of the step
# before; the margin covers a rank slow to read. One fenced meanwhile may still write a key of an
# old step (an abort, a late record): that key stays, one per fenced rank, never one per step.


@dataclass(frozen=True)
class Rules:
    """What the coordinator decides by, from the job config."""

    replicas: int  # members of epoch 0; ids past them start as spares
    replica_ids: int  # every id of the run: 0..replica_ids-1
    group_ranks: int  # ranks per replica group
    steps: int
    min_replicas: int
    max_step_retries: int
    spare_timeout_s: float  # a waiting spare silent this long is fenced (the heartbeat timeout)
    max_members: int = 0  # the most members at once (0: ``replicas``): groups beyond R are admitted up to it
    snapshot_interval: int = 0  # ranks keep host-memory snapshots of every this many steps (0: none)
    resume_wait_s: float = 0.0  # after such a loss, how long to wait for every lost group to come back
    # ... except those whose launchers wrote nothing this long (their nodes gone): 0 waits for every one
    launcher_timeout_s: float = 0.0
    sdc_window_s: float = 86400.0  # a group outvoted by SDC checks twice within this is quarantined
    snapshot_keep: int = 1  # complete snapshots each rank keeps: how far back a rollback reaches


@dataclass(frozen=True)
class Publish:
    membership: Membership


@dataclass(frozen=True)
class Save:
    """The state changed in a way a new leader needs: save it (before the events that follow)."""


@dataclass(frozen=True)
class FenceOut:
    replica: int
    fence: Fence


@dataclass(frozen=True)
class Admit:
    replica: int
    admission: Admission


@dataclass(frozen=True)
class Emit:
    event: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LogStep:
    record: StepRecord


@dataclass(frozen=True)
class Usage:
    """Write the coordinator's resource usage into the event log at ``step``."""

    step: int


@dataclass(frozen=True)
class Say:
    message: str
    warn: bool = False  # a WARNING: something the user should act on


@dataclass(frozen=True)
class Stop:
    error: str


@dataclass(frozen=True)
class Forget:
    """Store keys nobody reads any more: deleted after the state saying so was saved, so a new
    leader never reads a key its predecessor deleted (one that dies in between leaves them)."""

    steps: range = range(0)  # committed steps: their records, parameter digests, votes and decisions
    vote_epochs: range = range(0)  # the epochs those steps were voted in
    epochs: range = range(0)  # their members and their groups' rendezvous keys
    reports: range = range(0)  # report slots read, and saved as read
    admissions: tuple[tuple[int, int], ...] = ()  # (replica, incarnation): admissions read, or of a replaced one


@dataclass(frozen=True)
class Replace:
    """Ask the scheduler for a node that joins the run for free replica ids (``replicas``: those it is for)."""

    request: int
    replicas: tuple[int, ...]


@dataclass(frozen=True)
class Cancel:
    """Cancel the scheduler's job ``job`` of a replacement request that never joined."""

    request: int
    job: str


Effect = Union[Publish, Save, FenceOut, Admit, Emit, LogStep, Usage, Say, Stop, Forget, Replace, Cancel]


def stops(effects: list[Effect]) -> bool:
    return any(isinstance(e, Stop) for e in effects)


class CoordinatorCore:
    """Membership and lifecycle of one run, with no store, no clock of its own and no I/O: who is in the run
    is ``policy.roster``'s decision, which the core carries out."""

    def __init__(
        self,
        rules: Rules,
        detector: FailureDetector,
        *,
        fault_time: Callable[[int, int], float | None] = lambda replica, incarnation: None,
        committed: Callable[[int, int], bool] = lambda step, epoch: False,
        snapshots: Callable[[int, int], dict[int, Snapshots | None]] = lambda replica, incarnation: {},
        wall: Callable[[], float] = time.time,
        node_groups: Callable[[], dict[str, set[int]]] = dict,
        replace_bounds: Bounds | None = None,
    ) -> None:
        """``node_groups``: node -> the replica groups running on it, as the node messages last said (read at a
        quarantine only); ``replace_bounds``: the bounds of replacement requests (``[recover] replace``); None: it
        makes none."""
        self.rules, self.detector = rules, detector
        self.limits = Limits(
            replica_ids=rules.replica_ids,
            group_ranks=rules.group_ranks,
            seats=rules.max_members or rules.replicas,
            min_replicas=rules.min_replicas,
            spare_timeout_s=rules.spare_timeout_s,
        )
        self.fault_time, self.committed, self.snapshots, self.wall = fault_time, committed, snapshots, wall
        self.node_groups = node_groups
        members = tuple(range(rules.replicas))
        self.state = CoordinatorState(attempts={r: 0 for r in members}, admitted_epoch={r: 0 for r in members})
        self.history: dict[int, Membership] = {0: Membership(0, members)}
        self.start_step: int | None = None  # the step the ranks started from (a DCP checkpoint's, or 0)
        self.reporters: set[int] = set()  # replicas that reported a broken collective in this step
        self.errors: dict[int, tuple[str, int]] = {}  # replica -> (its ranks' own error, step)
        self.views: dict[tuple[int, int], GroupView] = {}  # (replica, incarnation) -> folded over its nodes
        self.asking: dict[int, int] = {}  # replica -> its latest incarnation whose ranks wait to join
        self.commit_epochs: dict[int, int] = {}  # step -> its commit epoch, for the steps this leader saw commit
        self.leaving: dict[int, Report] = {}  # members whose own report says they leave on notice: no failure
        self.stopping: tuple[int, str] | None = None  # the run stops in order: (its last step at most, why)
        self.given_up: set[int] = set()  # groups their launchers restart no more (until an incarnation asks again)
        self.replace_bounds = replace_bounds
        self.fenced_quarantined: dict[int, int] = {}  # quarantined replica -> its latest incarnation fenced
        self.struck: set[tuple[int, int | None]] = set()  # (replica, incarnation) strikes counted by this leader
        self.rollback: int | None = None  # the snapshot step a strike asked to roll back to, at its failure

    def take_over(self, state: CoordinatorState, history: dict[int, Membership], epoch: int) -> None:
        """Continues from the state a previous leader saved and the epochs the store holds (those from
        ``state.kept_epoch``)."""
        self.state, self.history = state, {e: m for e, m in history.items() if state.kept_epoch <= e <= epoch}
        self.detector.set_members(self.membership.members)
        for request in state.requests:  # its submission's answer went with the previous leader: its node may still
            if request.outcome is None and request.job is None:  # join, and answers then (``on_answered``)
                self._ended(request.number, FAILED, why="its leader ended before the scheduler answered")

    @property
    def membership(self) -> Membership:
        return self.history[max(self.history)]

    def _roster(self) -> Roster:
        """The membership the decisions read: members, spares, incarnations, and whether the run still takes joins."""
        state = self.state
        done = state.progress is not None and state.progress.step >= self.rules.steps
        return Roster(self.membership, state.spares, state.attempts, state.dropped, done or self.stopping is not None)

    def step(self) -> int:
        """The step in progress: one past the last committed step (or the checkpoint resumed from)."""
        progress = self.state.progress
        return progress.step + 1 if progress is not None else (self.start_step or 0) + 1

    def grace(self, now: float) -> None:
        """Every member and waiting spare counts as having beaten at ``now``: one heartbeat timeout
        to show it is alive, when the beats before could not be read."""
        for replica in (*self.membership.members, *self.state.spares):
            self.detector.expect(replica, now)

    def _publish(self, membership: Membership) -> list[Effect]:
        if self.stopping is not None:
            membership = replace(membership, last_step=self.stopping[0])
        self.history[membership.epoch] = membership
        return [Publish(membership), Save()]

    # ---- committed steps ----------------------------------------------------------------

    def accepts(self, record: StepRecord) -> bool:
        """Whether ``record`` is the step in progress, committed in an epoch this run published."""
        progress = self.state.progress
        return (
            record.step == self.step()
            and record.epoch in self.history
            and (progress is None or record.epoch >= progress.epoch)  # not a record of steps a resume undid
        )

    def on_step(self, record: StepRecord) -> list[Effect]:
        """A committed step: saved before its event, so a leader that dies in between has its successor log it."""
        forget = self._commit(record.step, record.epoch, record.time)
        for group in record.checked:  # its gradients of this step passed a check: trusted up to here
            self.state.trusted[group] = max(self.state.trusted.get(group, 0), record.step)
        return [
            Save(),
            *self._resumed(record.step, record.time),
            LogStep(record),
            *(
                Say(
                    f"data epoch {epoch} begins at step {record.step}: every sample of the corpus was read "
                    "once; they are read again in a new order"
                )
                for epoch in record.data_epochs
            ),
            *forget,
        ]

    def on_malformed_step(self, error: str) -> list[Effect]:
        """The record of the step in progress does not check out (``error`` names its key). Members
        write it once, so no good one follows: once the store shows the step committed (in an epoch
        since the last commit), it counts as committed without a record, and an event says so;
        until then nothing changes (an empty list)."""
        step, progress = self.step(), self.state.progress
        since = progress.epoch if progress is not None else min(self.history)
        epoch = next((e for e in sorted(self.history) if e >= since and self.committed(step, e)), None)
        if epoch is None:
            return []
        when = self.wall()
        forget = self._commit(step, epoch, when)
        return [
            Save(),
            *self._resumed(step, when),
            Emit("step_unrecorded", {"step": step, "epoch": epoch, "error": error}),
            Say(
                f"step {step} committed in epoch {epoch} without a readable record ({error}): it is not in the "
                "event log's steps"
            ),
            *forget,
        ]

    def _commit(self, step: int, epoch: int, when: float) -> list[Effect]:
        """``step`` committed in ``epoch``: the run's progress, and the keys that can go now."""
        self.state.progress = Progress(step, epoch, when)
        self.state.retries, self.reporters = 0, set()
        self.commit_epochs[step] = epoch
        return self._forget()

    # ---- forgetting ---------------------------------------------------------------------

    def _forget(self) -> list[Effect]:
        """The keys of steps ``KEEP_STEPS`` behind the last commit, of the epochs before the one that
        step committed in (no member's rank looks further back), and the report slots read before
        the first one still unread. Steps committed before this leader (it took over) are forgotten
        once a step whose commit epoch it saw is old enough."""
        state = self.state
        assert state.progress is not None
        last = state.progress.step - KEEP_STEPS
        edge = self.commit_epochs.get(last)
        if edge is None:
            return []
        first = max(state.forgotten_steps, self.start_step or 0) + 1
        upto = min([*state.unread_reports, state.next_report])
        forget = Forget(
            steps=range(first, last + 1),
            vote_epochs=range(state.kept_epoch, edge + 1),
            epochs=range(state.kept_epoch, edge),
            reports=range(state.forgotten_reports + 1, upto),
        )
        state.forgotten_steps, state.kept_epoch = max(state.forgotten_steps, last), max(state.kept_epoch, edge)
        state.forgotten_reports = max(state.forgotten_reports, upto - 1)
        self.commit_epochs = {s: e for s, e in self.commit_epochs.items() if s > last}
        self.history = {e: m for e, m in self.history.items() if e >= state.kept_epoch}
        return [forget] if forget.steps or forget.epochs or forget.reports else []

    # ---- liveness -----------------------------------------------------------------------

    def on_nodes(self, views: dict[tuple[int, int], GroupView], now: float) -> None:
        """The groups as the node messages show them: beats of current incarnations reach the
        detector; a rank whose main loop is stuck is its group's failure."""
        self.views = views
        self.asking = {replica: incarnation for (replica, incarnation), view in sorted(views.items()) if view.ready}
        for replica in (*self.membership.members, *self.state.spares):
            incarnation = self._incarnation(replica)
            view = None if incarnation is None else views.get((replica, incarnation))
            if view is None or view.ranks < self.rules.group_ranks:
                continue  # not every rank has beaten yet: the startup bound holds
            self.detector.beat(replica, view.alive_at)
            if view.stuck is not None:
                self.detector.report(replica, view.stuck, now)

    def on_report(self, report: Report, now: float) -> list[Effect]:
        suspect = report.suspect
        if suspect is None and report.epoch < self.membership.epoch:
            return []  # about an epoch already replaced
        if suspect is not None and report.epoch < self.state.admitted_epoch.get(suspect, 0):
            return []  # about an incarnation already replaced
        if report.attempt is not None and (suspect is None or report.attempt != self._incarnation(suspect)):
            return []  # a launcher's report about another incarnation (it crossed that group's restart)
        if suspect is None and report.replica is not None and not report.waiting:
            self.reporters.add(report.replica)
        if suspect is not None and report.error and report.step is not None:
            self.errors[suspect] = (report.error, report.step)
        if suspect is not None and report.final:
            self.given_up.add(suspect)
        decision = reported(self._roster(), suspect, report.left, report.cause)
        effects: list[Effect] = (
            self._strike(suspect, report.step, now) if suspect is not None and report.outvoted else []
        )
        if isinstance(decision, Leave):
            self.leaving.setdefault(decision.replica, report)  # taken out of the next epoch at once, as a failure is
        elif isinstance(decision, DropSpare):
            effects += self._drop_spare(decision.replica, decision.cause)
        self.detector.report(suspect, report.cause, now, report.waiting)
        return effects

    def _strike(self, replica: int, step: int | None, now: float) -> list[Effect]:
        """``replica`` was outvoted by an SDC check (its ranks' own report, once per rank): a strike, counted
        once per incarnation; the second within ``sdc_window_s`` quarantines it."""
        state, attempt = self.state, self._incarnation(replica)
        if replica in state.quarantined or (replica, attempt) in self.struck:
            return []
        self.struck.add((replica, attempt))
        state.strikes[replica], quarantined = sdc.strikes(
            state.strikes.get(replica, []), self.wall(), self.rules.sdc_window_s
        )
        caught = self.step() if step is None else step
        effects: list[Effect] = [Save(), *self._roll_back(replica, caught)]
        if not quarantined:
            return effects
        state.quarantined[replica] = caught
        return [
            *effects,
            Emit(
                "quarantined",
                {"replica": replica, "step": state.quarantined[replica], "strikes": state.strikes[replica]},
            ),
            Say(
                f"replica {replica} quarantined: SDC checks outvoted it {len(state.strikes[replica])} times within "
                f"recover.sdc_quarantine_window_s = {self.rules.sdc_window_s:g}s; it is fenced and never readmitted "
                "(check or replace its devices)"
            ),
            *self._quarantine_node_of(replica, caught, now),
        ]

    def _quarantine_node_of(self, replica: int, caught: int, now: float) -> list[Effect]:
        """The other groups on the quarantined group's nodes go with it: what is bad may be the node (its CPU, its
        memory), and the node is what a scheduler drains and repairs. Each is quarantined too and, where a member,
        failed now (its microbatches go to the others). Where no member would be left on another node, the
        node's other groups stay: quarantining them would end the run, so the operator is told instead."""
        placement = self.node_groups()
        nodes = sorted(n for n, groups in placement.items() if replica in groups)
        mates = sorted({r for n in nodes for r in placement[n]} - {replica} - set(self.state.quarantined))
        if not mates:
            return []
        if not set(self.membership.members) - set(mates) - set(self.state.quarantined):
            return [
                Say(
                    f"replica {replica}'s node {', '.join(nodes)} also runs replica(s) {mates}; they stay in the "
                    "run, for no member group runs on another node: replace that node",
                    warn=True,
                )
            ]
        why = f"quarantined with replica {replica}'s node {', '.join(nodes)}"
        effects: list[Effect] = []
        for mate in mates:
            self.state.quarantined[mate] = caught
            if mate in self.membership.members:
                self.detector.report(mate, why, now)
            effects += [
                Emit("quarantined", {"replica": mate, "step": caught, "with": replica, "nodes": nodes}),
                Say(f"replica {mate} {why}: fenced, never readmitted", warn=True),
            ]
        return effects

    def _roll_back(self, replica: int, caught: int) -> list[Effect]:
        """``replica`` was outvoted in step ``caught``: its gradients in the committed steps since the last check it
        passed (``trusted``) may be wrong too. Where the nodes' snapshots reach back that far, the run rolls back
        to the newest one at or before it once the group's failure is decided (every group restarts and resumes
        from it, ``_lose``); where they do not, it says how many steps may have trained on wrong gradients."""
        trusted = self.state.trusted.get(replica, self.start_step or 0)
        if trusted >= caught - 1:
            return []  # caught at its first step since it was vouched for: nothing trained in
        back = sdc.rollback_step(trusted, caught - 1, self.rules.snapshot_interval, self.rules.snapshot_keep)
        if back is None:
            steps = caught - 1 - trusted
            return [
                Emit("sdc_trained_in", {"replica": replica, "step": caught, "from": trusted + 1, "steps": steps}),
                Say(
                    f"replica {replica} was outvoted in step {caught}; its gradients in steps "
                    f"{trusted + 1}..{caught - 1} ({steps} step(s)) were never checked and may have trained in: the "
                    "nodes keep no snapshot that old (raise recover.snapshot_keep, or lower "
                    "recover.snapshot_interval, to reach back further)",
                    warn=True,
                ),
            ]
        self.rollback = back if self.rollback is None else min(self.rollback, back)
        return [
            Emit("sdc_rollback", {"replica": replica, "step": caught, "to": back, "steps": caught - 1 - back}),
            Say(
                f"replica {replica} was outvoted in step {caught}; its gradients since step {trusted + 1} were never "
                f"checked: the run rolls back to step {back}'s snapshot and computes steps {back + 1}..{caught - 1} "
                "again"
            ),
        ]

    def _incarnation(self, replica: int) -> int | None:
        """The number of the incarnation of ``replica`` the run holds now: as a member or as a waiting spare."""
        return self.state.spares[replica] if replica in self.state.spares else self.state.attempts.get(replica)

    def _failure_time(self, replica: int, detected: float, now: float) -> tuple[float, str]:
        """When this incarnation failed, and by which clock: an injected fault's own time
        (measurement only), else the last heartbeat of its most silent rank (the failure
        came after it; found by a report or by silence alike), else the detection."""
        injected = self.fault_time(replica, self.state.attempts.get(replica, -1))
        if injected is not None:
            return injected, "fault_injected"
        last = self.detector.silent_since(replica)  # a dead or hung rank beats no more; a live one just beat
        if last is not None:
            return detected - (now - last), "last_heartbeat"
        return detected, "detected"

    # ---- failures -----------------------------------------------------------------------

    def on_failure(self, failed: dict[int, str], now: float) -> list[Effect]:
        """The next epoch without ``failed`` (a retry when it is empty), or the run's stop. A member that
        reported its own leave on notice (``leaving``) goes the same way, as a leave: no failure counted,
        no slot held for its return."""
        wall, step, state = self.wall(), self.step(), self.state
        members = self.membership.members
        if self.stopping is None and members and set(members) | set(failed) <= set(self.leaving):
            # a whole-job notice: the groups stop in order after the step they announced it in (each knows from
            # its all-reduce), each shard saved; the run ends stopped, not with nobody left
            self.leaving.clear()
            self.detector.withdraw(members)
            return self.on_notice("every replica group leaves on notice")
        effects: list[Effect] = []
        first = wall
        out = take_out(self._roster(), self.limits, failed, self.leaving, self._still_joining(), self.errors)
        leaving = {r: self.leaving.pop(r) for r in out.left}
        for replica, report in leaving.items():
            effects += [
                Emit(
                    "left",
                    {
                        "replica": replica,
                        "step": report.step if report.step is not None else step,
                        "reason": report.cause,
                        "notice_s": report.notice_s,
                        "attempt": report.attempt,
                    },
                ),
                Say(f"replica {replica} {report.cause}: its quota goes to the others"),
            ]
        crashed = {r: failed[r] for r in out.crashed}
        for replica, cause in crashed.items():
            t, clock = self._failure_time(replica, wall, now)
            first = min(first, t)
            if replica in state.repairs:  # failed before its first step: what it was to repair is open again
                replaced, since = state.repairs.pop(replica)
                state.down_since[replaced] = since
            else:
                state.down_since.setdefault(replica, t)
            effects += [
                Emit(
                    "failure",
                    {"replica": replica, "step": step, "cause": cause, "time": t, "clock": clock, "detected": wall},
                ),
                Say(f"replica {replica} failed at step {step}: {cause}"),
            ]
        new = out.membership
        if new is None:
            if out.lost and self._snapshots_exist() and self.stopping is None:
                return effects + self._lose(len(crashed), first, out.stop)
            return effects + [Stop(out.stop)]
        if self.rollback is not None and self.stopping is None:  # past a bad group's gradients: every group resumes
            back, self.rollback = self.rollback, None
            why = f"a rollback to step {back}, past gradients an SDC check found wrong"
            return effects + self._lose(len(crashed), first, why, at_most=back)
        if crashed:  # counted before the publish, so the state saved with it holds them
            state.failures += len(crashed)
            state.last_recovery_s = latency = self.wall() - first
        effects += self._publish(new)
        for replica in failed:
            state.joining.pop(replica, None)
            # its launcher kills whatever is left of this incarnation (e.g. a hung rank)
            effects.append(FenceOut(replica, Fence(state.attempts[replica], new.epoch)))
        self.detector.set_members(new.members)
        if crashed:
            return effects + [
                Emit(
                    "recovered", {"step": step, "epoch": new.epoch, "members": list(new.members), "latency_s": latency}
                ),
                Usage(step),
                Say(f"epoch {new.epoch}: members {id_list(new.members)} (recovered in {latency:.3f}s)"),
            ]
        if leaving:
            return effects + [Say(f"epoch {new.epoch}: members {id_list(new.members)}")]
        return effects + [
            Say(
                f"epoch {new.epoch}: retrying step {step} with the same members {id_list(new.members)} "
                f"(retry {state.retries} of at most {self.rules.max_step_retries})"
            )
        ]

    def _still_joining(self) -> dict[int, int]:
        """Joiners without state. One admitted in an epoch whose step the store already
        marks committed holds that step's state, even if nobody has logged it yet."""
        if self.committed(self.step(), self.membership.epoch):
            return {}  # every joiner was admitted in this epoch or before, so it took part in the commit
        return self.state.joining

    def on_retry(self, now: float) -> list[Effect]:
        """The step's collectives broke with nobody silent: retry, fence who held it up, or stop."""
        self.state.retries += 1
        retries = self.state.retries
        verdict, who = retry_verdict(self.membership.members, self.reporters, retries - 1, self.rules.max_step_retries)
        if verdict == "retry":
            return self.on_failure({}, now)
        if verdict == "fence":
            reporters = sorted(self.reporters)
            return self.on_failure(
                {
                    r: f"step {self.step()} broke {retries} times: replicas {reporters} "
                    "reported broken collectives and this one never did (it held them up)"
                    for r in who
                },
                now,
            )
        return [
            Stop(
                f"step {self.step()} broke {retries} times with every replica ({list(who)}) reporting broken "
                "collectives and none silent: check the network between the replica groups"
            )
        ]

    # ---- every group's state lost: resuming from host memory ------------------------------

    def _snapshots_exist(self) -> bool:
        """Whether the ranks may hold a snapshot: one of a step committed since the run (re)started."""
        interval, progress = self.rules.snapshot_interval, self.state.progress
        if interval <= 0 or progress is None:
            return False
        return progress.step // interval * interval > (self.start_step or 0)

    def _lose(self, crashed: int, since: float, why: str, at_most: int | None = None) -> list[Effect]:
        """No member with state is left (``why``): every member is fenced (one still rejoining holds nothing), and
        the run waits, in an epoch without members, for the groups to come back with their nodes' snapshots (of
        step ``at_most`` at the newest: a rollback)."""
        state, step = self.state, self.step()
        state.failures += crashed
        # the groups that held the last committed state, failed since or not: their nodes have its snapshots
        committed = self.history.get(state.progress.epoch) if state.progress is not None else None
        held = set(self.membership.members) | set(committed.members if committed is not None else ())
        state.loss = Loss(step, since, groups=tuple(sorted(held - set(state.quarantined))), at_most=at_most)
        members = self.membership.members
        new = Membership(self.membership.epoch + 1, ())
        effects = self._publish(new)
        for replica in members:
            state.joining.pop(replica, None)
            effects.append(FenceOut(replica, Fence(state.attempts[replica], new.epoch)))
        self.detector.set_members(())
        return effects + [
            Emit("state_lost", {"step": step, "epoch": new.epoch, "groups": list(state.loss.groups), "cause": why}),
            Say(
                f"every replica group lost its state in step {step} ({why}): the run resumes from the newest "
                f"snapshot in the nodes' memory once groups {id_list(state.loss.groups)} are back"
            ),
        ]

    def _resume(self, now: float) -> list[Effect]:
        """Once every lost group is back (or ``resume_wait_s`` after the loss, those that are): the groups holding a
        copy of some shard of the newest step every shard has a copy of are admitted at it (``resume_plan``); the
        others rejoin from them."""
        state, loss = self.state, self.state.loss
        assert loss is not None
        found: dict[int, dict[int, tuple[int, ...]]] = {}
        for replica, incarnation in self.asking.items():
            view = self.views.get((replica, incarnation))
            if replica >= self.rules.replica_ids or incarnation <= state.attempts.get(replica, -1):
                continue
            if view is None or view.ready < self.rules.group_ranks:
                continue
            lists = self.snapshots(replica, incarnation)
            if len(lists) == self.rules.group_ranks and all(v is not None for v in lists.values()):
                found[replica] = {k: v.steps for k, v in lists.items() if v is not None}
        waited = self.wall() - loss.time
        self.given_up -= set(self.asking)  # a group whose incarnation asks is back, whoever started it
        silent = self._launchers_gone(now)
        expected = set(loss.groups) - self.given_up - silent  # their launchers restart them
        if not expected <= set(found) and waited < self.rules.resume_wait_s:
            return []
        newest = loss.step - 1 if loss.at_most is None else min(loss.step - 1, loss.at_most)
        plan = resume_plan(found, self.rules.group_ranks, at_most=newest)
        if not isinstance(plan, ResumePlan):
            if not found and expected and waited < 2 * self.rules.resume_wait_s:
                return []  # nobody is back yet: one more bound to come
            return [
                Stop(
                    f"every replica group lost its state in step {loss.step} and the run cannot resume from the "
                    f"nodes' memory: {plan}; resume from the last checkpoint"
                )
            ]
        effects = self._resume_from(plan, {r: self.asking[r] for r in plan.groups}, loss)
        if gone := sorted(set(loss.groups) & silent - set(found)):
            effects.append(
                Say(
                    f"not waited for: group(s) {gone}, whose launchers wrote nothing for "
                    f"{self.rules.launcher_timeout_s:g}s (their nodes gone?); each rejoins once started again"
                )
            )
        return effects

    def _launchers_gone(self, now: float) -> set[int]:
        """The groups whose newest incarnation's launchers wrote no node message for ``launcher_timeout_s``: their
        nodes are gone, and nothing restarts them until a launcher starts there again (which then rejoins); a
        resume that waited for them would wait out ``resume_wait_s`` (``startup_timeout_s``)."""
        bound = self.rules.launcher_timeout_s
        newest = {replica: view for (replica, _), view in sorted(self.views.items())}  # the highest incarnation's
        return {r for r, view in newest.items() if bound > 0 and now - view.launcher_at > bound}

    def _resume_from(self, plan: ResumePlan, incarnations: dict[int, int], loss: Loss) -> list[Effect]:
        state, step = self.state, plan.step
        new = Membership(self.membership.epoch + 1, plan.groups)
        holders = {k: held for k, held in enumerate(plan.holders) if held != plan.groups}
        effects: list[Effect] = [Admit(r, Admission(incarnations[r], new.epoch, step, holders)) for r in plan.groups]
        effects += self._publish(new)
        for replica in plan.groups:
            state.attempts[replica] = incarnations[replica]
            state.admitted_epoch[replica] = new.epoch
            state.down_since.pop(replica, None)
        state.trusted = {r: min(t, step) for r, t in state.trusted.items()}  # what comes after is computed again
        # the steps after the snapshot are committed again: their old records and digests go first
        undone = range(step + 1, loss.step + 1)
        state.progress = Progress(step, new.epoch, self.wall())
        state.retries, self.reporters = 0, set()
        state.forgotten_steps = min(state.forgotten_steps, step)
        self.commit_epochs = {s: e for s, e in self.commit_epochs.items() if s <= step}
        state.loss = replace(loss, resume_step=step)
        self.detector.set_members(new.members, self.wall())
        recomputed = loss.step - 1 - step
        where = (
            f"which replica group(s) {id_list(plan.whole)} load whole from their nodes' memory"
            if plan.whole
            else "no group holding every shard: "
            + "; ".join(f"shard {k} from group(s) {id_list(held)}" for k, held in sorted(holders.items()))
        )
        return effects + [
            Forget(steps=undone),
            Emit(
                "resuming",
                {
                    "step": step,
                    "lost_step": loss.step,
                    "recomputed": recomputed,
                    "groups": list(plan.groups),
                    "whole": list(plan.whole),
                    "holders": {str(k): list(v) for k, v in sorted(holders.items())},
                },
            ),
            Say(
                f"epoch {new.epoch}: resuming from step {step}, {where} ({recomputed} committed step(s) computed "
                f"again); a rank without its shard's copy takes it from the same rank of a group that has one"
            ),
        ]

    def _resumed(self, step: int, when: float) -> list[Effect]:
        """``step`` committed at ``when``: the first after a resume from memory ends the loss."""
        loss = self.state.loss
        if loss is None or loss.resume_step is None or step != loss.resume_step + 1:
            return []
        self.state.loss = None
        seconds = when - loss.time
        return [
            Emit("resumed", {"step": step, "from_step": loss.resume_step, "lost_step": loss.step, "seconds": seconds}),
            Say(f"step {step} committed {seconds:.1f}s after every group lost its state: the run is back"),
        ]

    # ---- joins, spares, rejoins ---------------------------------------------------------

    def on_joins(self, now: float) -> list[Effect]:
        """Carries out ``roster.joins``: replaces, admits, holds and drops the groups whose ranks are all up."""
        state = self.state
        effects: list[Effect] = []
        for replica in sorted(self.asking.keys() & state.quarantined.keys()):  # its launcher restarted it: fenced
            incarnation = self.asking.pop(replica)
            if self.fenced_quarantined.get(replica) != incarnation:
                self.fenced_quarantined[replica] = incarnation
                effects += [
                    FenceOut(replica, Fence(incarnation, self.membership.epoch)),
                    Say(f"replica {replica} (attempt {incarnation}) asks to join, but is quarantined: fenced"),
                ]
        if state.loss is not None and state.loss.resume_step is None:
            return effects + self._resume(now)
        last_beat = {r: self.detector.silent_since(r) for r in state.spares}
        decision = joins(self._roster(), self.limits, self.asking, self.views, last_beat, now)
        for replica, incarnation in decision.replace:  # its previous incarnation is a member: it takes its place back
            effects += self.on_failure({replica: f"restarted by its launcher (attempt {incarnation})"}, now)
            if stops(effects):
                return effects
            effects += self._admit(replica, incarnation, now)
        effects += [
            Say(f"ignoring a join request of replica {replica}: the run has ids 0..{self.rules.replica_ids - 1}")
            for replica in decision.outside
        ]
        for replica in decision.gone:
            del state.spares[replica]
        for replica, cause in decision.drop:
            effects += self._drop_spare(replica, cause)
        for replica, incarnation in decision.admit:
            state.spares.pop(replica, None)
            effects += self._admit(replica, incarnation, now)
        for replica, incarnation in decision.hold:
            state.spares[replica] = incarnation
            self.detector.expect(replica, now)  # its beats are watched from now on
            effects.append(Emit("spare_ready", {"replica": replica, "attempt": incarnation, "step": self.step()}))
        return effects

    def _drop_spare(self, replica: int, cause: str) -> list[Effect]:
        incarnation = self.state.spares.pop(replica)
        self.state.dropped[replica] = incarnation
        return [
            Save(),
            FenceOut(replica, Fence(incarnation, self.membership.epoch)),
            Emit("spare_lost", {"replica": replica, "attempt": incarnation, "step": self.step(), "cause": cause}),
            Say(f"spare replica {replica} (attempt {incarnation}) fenced: {cause}"),
        ]

    def _admit(self, replica: int, incarnation: int, now: float) -> list[Effect]:
        """Makes a ready group a member in a new epoch; it takes the state from a live peer."""
        state = self.state
        new = admit(self.membership, replica)
        replaced_incarnation = state.attempts.get(replica)
        # the admission before the epoch: a joiner looks for it when it sees an epoch that includes it
        effects: list[Effect] = [Admit(replica, Admission(incarnation, new.epoch)), *self._publish(new)]
        if replaced_incarnation is not None and replaced_incarnation != incarnation:
            effects.append(Forget(admissions=((replica, replaced_incarnation),)))
        state.attempts[replica] = incarnation
        state.admitted_epoch[replica] = state.joining[replica] = new.epoch
        # its gradients count from this step on: none before it can be wrong
        state.trusted[replica] = max(state.trusted.get(replica, 0), self.step() - 1)
        self.detector.set_members(new.members, now)
        replaced = repaired_failure(replica, state.down_since)
        if replaced is not None:
            state.repairs[replica] = (replaced, state.down_since.pop(replaced))
        instead = "" if replaced in (None, replica) else f" in place of replica {replaced}"
        return effects + [
            Emit(
                "admitted",
                {
                    "replica": replica,
                    "attempt": incarnation,
                    "epoch": new.epoch,
                    "step": self.step(),
                    **({"replaces": replaced} if replaced is not None else {}),
                },
            ),
            Say(
                f"epoch {new.epoch}: replica {replica} (attempt {incarnation}) "
                f"admitted{instead}, members {id_list(new.members)}"
            ),
        ]

    def on_rejoined(self, transfers: Callable[[int], list[TransferRecord]]) -> list[Effect]:
        """A joiner is back once a step commits in an epoch it is a member of; ``transfers`` gives
        the state transfer records of its ranks."""
        progress = self.state.progress
        if progress is None:
            return []
        effects: list[Effect] = []
        for replica, epoch in list(self.state.joining.items()):
            committed = self.history.get(progress.epoch)
            if progress.epoch < epoch or committed is None or replica not in committed.members:
                continue
            del self.state.joining[replica]
            effects.append(Forget(admissions=((replica, self.state.attempts[replica]),)))  # its ranks read it
            records = transfers(replica)
            replaced, since = self.state.repairs.pop(replica, (replica, progress.time))
            downtime = progress.time - since
            self.state.rejoins += 1
            self.state.last_downtime_s = downtime
            what = "rejoined" if replaced == replica else f"(a spare) replaced replica {replaced}"
            effects += [
                Save(),
                Emit(
                    "rejoined",
                    {
                        "replica": replica,
                        "step": progress.step,
                        "bytes": sum(r.bytes for r in records),
                        "transfer_s": max((r.transfer_s for r in records), default=0.0),
                        "downtime_s": downtime,
                        **({"replaces": replaced} if replaced != replica else {}),
                    },
                ),
                Say(f"replica {replica} {what} at step {progress.step}, {downtime:.1f}s after the failure"),
            ]
        return effects

    def on_notice(self, why: str) -> list[Effect]:
        """The run stops in order (``why``: the coordinator's own node goes away, and on a TCPStore the run with
        it): a new epoch of the same members says that no step after the one in progress commits. A group
        reading it in a later step (this leader had not read a commit yet) stops there, having committed the
        step before: commits are all or none, so every group ends at the same step. Each group stops at that
        boundary, the step's leader saves a DCP checkpoint of the whole state, and ``finished`` ends the run."""
        if self.stopping is not None:
            return []
        self.stopping = (self.step(), why)
        return [
            *self._publish(Membership(self.membership.epoch + 1, self.membership.members)),
            Emit("stopping", {"step": self.step(), "reason": why}),
            Say(
                f"{why}: the run stops in order after step {self.step()} at the latest (every group at the same step "
                "boundary, its state saved first: one copy per shard in the stop folder, and a DCP checkpoint where "
                "checkpoints are on)"
            ),
        ]

    def finished(self) -> bool:
        """Every member with state has finished (a group still rejoining is not waited for)."""
        if self.state.loss is not None and self.state.loss.resume_step is None:
            return False  # no member: the run waits for its groups to resume
        return all(
            (view := self.views.get((r, self.state.attempts[r]))) is not None
            and view.finished >= self.rules.group_ranks
            for r in self.membership.members
            if r not in self.state.joining
        )

    def end(self) -> list[Effect]:
        """Wakes every node agent, blocked until the next epoch, to read the run's end (done or fatal)."""
        return self._publish(Membership(self.membership.epoch + 1, self.membership.members))

    # ---- replacement requests -----------------------------------------------------------

    def on_replacements(self, ended: bool = False) -> list[Effect]:
        """Carries out ``replacements.decide``: new requests for the groups out of the run too long, cancellations
        of open ones whose groups are back (or of every open one once the run ``ended``, its last step committed
        or its stop in order begun)."""
        progress = self.state.progress
        ended = ended or self.stopping is not None or (progress is not None and progress.step >= self.rules.steps)
        if self.replace_bounds is None or (ended and not any(r.outcome is None for r in self.state.requests)):
            return []
        now = self.wall()
        out = {} if ended else dict(self.state.down_since)
        decision = replacements.decide(now, out, self.state.requests, ended, self.replace_bounds)
        effects: list[Effect] = []
        for number in decision.cancel:
            why = "the run ended" if ended else "every replica group it was for is back in the run"
            effects += self._cancel(number, why)
        asked = () if self.state.refused else decision.request  # none once the scheduler refused one: it would again
        for ids in asked:
            out_s = tuple(round(now - out[r], 1) for r in ids)
            self.state.requests.append(Request(len(self.state.requests) + 1, ids, now, out_s=out_s))
            effects.append(Replace(len(self.state.requests), ids))
        # saved before anything is submitted or cancelled: a new leader knows every request this one made
        return [Save(), *effects] if decision.cancel or asked else effects

    def _ended(self, number: int, outcome: str, **changes: Any) -> Request:
        """Request ``number`` as it was, now ended with ``outcome``."""
        request = self.state.requests[number - 1]
        self.state.requests[number - 1] = replace(request, outcome=outcome, ended=self.wall(), **changes)
        return request

    def _cancel(self, number: int, why: str) -> list[Effect]:
        """Cancels an open request; one still being submitted is cancelled once its job is known (``on_submitted``)."""
        request = self._ended(number, CANCELLED, why=why)
        return [] if request.job is None else self._cancelled(self.state.requests[number - 1])

    def _cancelled(self, request: Request) -> list[Effect]:
        assert request.job is not None
        return [
            Cancel(request.number, request.job),
            Emit(
                "replacement_cancelled",
                {
                    "request": request.number,
                    "job": request.job,
                    "replicas": list(request.replicas),
                    "reason": request.why,
                },
            ),
            Say(f"replacement request {request.number} (job {request.job}) cancelled: {request.why}"),
        ]

    def on_submitted(self, number: int, job: str, command: str) -> list[Effect]:
        """The scheduler took request ``number`` as job ``job`` (submitted with ``command``)."""
        request = self.state.requests[number - 1]
        self.state.requests[number - 1] = replace(request, job=job)
        out_s = list(request.out_s)
        effects: list[Effect] = [
            Save(),
            Emit(
                "replacement_requested",
                {"request": number, "job": job, "replicas": list(request.replicas), "out_s": out_s, "command": command},
            ),
            Say(
                f"replica group(s) {id_list(request.replicas)} out of the run for {max(out_s):g}s: asked the scheduler "
                f"for a node that joins it for free replica ids (request {number}, job {job})"
            ),
        ]
        if request.outcome == CANCELLED:  # cancelled while it was being submitted
            effects += self._cancelled(self.state.requests[number - 1])
        return effects

    def on_submit_failed(self, number: int, error: str, command: str) -> list[Effect]:
        """The scheduler refused request ``number`` (or cannot be reached from here): said once, with the command
        for a person to run, and no request follows in this run."""
        request = self._ended(number, FAILED)
        self.state.refused = True
        return [
            Save(),
            _failed(request, error),
            Say(
                f"could not ask the scheduler for a replacement of replica group(s) {id_list(request.replicas)} "
                f"({error}); the run goes on without them and asks no more. To bring them back, run: {command}",
                warn=True,
            ),
        ]

    def on_answered(self, number: int, replicas: tuple[int, ...], job: str | None) -> list[Effect]:
        """The node of request ``number`` (its scheduler's job ``job``) took ``replicas``, as its launcher's record
        says: none when every id it could take was back already, and it left at once. A request whose submission
        failed may be answered too: a person ran its command."""
        request = self.state.requests[number - 1]
        if request.outcome in (JOINED, LEFT):
            return []
        job = request.job or job or None  # "": its node knew no job id (started outside the scheduler)
        fields = {"request": number, "job": job, "replicas": list(replicas)}
        what = f"replacement request {number}" + (f" (job {job})" if job else "")
        if replicas:
            self._ended(number, JOINED, job=job, took=replicas)
            return [
                Save(),
                Emit("replacement_joined", fields),
                Say(f"{what} joined the run: replica group(s) {id_list(replicas)}"),
            ]
        self._ended(number, LEFT, job=job)
        return [
            Save(),
            Emit("replacement_left", {**fields, "reason": "no free replica id: the groups it was for are back"}),
            Say(f"{what} found no free replica id and left at once"),
        ]

    def on_job_gone(self, number: int, state: str) -> list[Effect]:
        """The scheduler's job of open request ``number`` ended (``state``) without its launcher's record."""
        request = self.state.requests[number - 1]
        if request.outcome is not None:
            return []
        self._ended(number, FAILED)
        error = f"job {request.job} ended ({state}) without joining"
        return [
            Save(),
            _failed(request, error),
            Say(f"replacement request {number}: {error}; its groups may be asked for again"),
        ]


def _failed(request: Request, error: str) -> Emit:
    """The ``replacement_failed`` event of ``request`` (its job, None where the scheduler never took it)."""
    return Emit(
        "replacement_failed",
        {"request": request.number, "job": request.job, "replicas": list(request.replicas), "error": error},
    )
