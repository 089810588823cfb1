"""The coordinator process: owns membership (live replica groups, epoch) and detection.

Started by the launcher, never a trainer. The decisions are ``core``'s (pure);
this shell reads the control store (node messages, reports, step records), hands them to
the core and carries out the effects it returns. Its state lives in the control store: its
own TCPStore, or etcd (``[recover] control_store``), where a candidate runs beside every
node's launcher, one leads (``control.leader``), and a new leader restores the state its
predecessor saved there (``CoordinatorState``, saved with every epoch and every logged step).

    python -m titan_recover.coordinator --settings JSON
    (JSON: the job's ``config.CoordinatorSettings``, which its launcher writes: it reads no job config itself)
    (serves on the port in $TITAN_RECOVER_COORDINATOR, the run named by $TITAN_RECOVER_SECRET and $TITAN_RECOVER_RUN_ID;
    with an etcd:// address there, campaigns to lead and leads until the run ends)
"""

import argparse
import logging
import os
import socket
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Callable

from titan_recover import config
from titan_recover.config import ConfigError, CoordinatorSettings
from titan_recover.control import keys, transport
from titan_recover.control.addresses import LOOPBACK, is_etcd, parse_host_port
from titan_recover.control.board import LeaderBoard
from titan_recover.control.client import COMMIT, ControlClient
from titan_recover.control.keys import (
    BOARD,
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_STOPPED,
    FATAL,
    NO_PASS,
    NODES,
    REPORTS,
    START_STEP,
    leader_key,
)
from titan_recover.control.lifeline import PROBE_S
from titan_recover.control.protocol import (
    FAILED,
    CoordinatorState,
    Membership,
    MessageError,
    NodeMessage,
    Replacing,
    TransferRecord,
)
from titan_recover.control.sealed import Run, SealedStore
from titan_recover.coordinator import slurm
from titan_recover.coordinator.core import (
    Admit,
    Cancel,
    CoordinatorCore,
    Effect,
    Emit,
    FenceOut,
    Forget,
    LogStep,
    Publish,
    Replace,
    Rules,
    Save,
    Say,
    Stop,
    Usage,
)
from titan_recover.node.procs import on_notice
from titan_recover.observability import host_memory, resources
from titan_recover.observability.events import EventLog, Tail, event_files, logged_steps
from titan_recover.observability.logs import id_list
from titan_recover.observability.run_status import RunHistory
from titan_recover.observability.status_server import StatusServer, StatusSource, StoreReader
from titan_recover.policy import domains, replacements, sdc
from titan_recover.policy.membership import FailureDetector, group_views, store_stalled

if TYPE_CHECKING:
    from titan_recover.control.etcd_store import EtcdStore
    from titan_recover.control.presence import Presence

POLL_S = 0.02  # detection is bounded by report_confirm_s / heartbeats, not by this
ALIVE_S = 0.25  # how often the alive counter moves (watchers allow coordinator_timeout_s)
ETCD_ALIVE_S = 1.0  # ... on etcd, where each move is a Raft write
REPORT_GRACE_S = 5.0  # a reserved report slot still empty after this: its reporter died in between
FULL_PASS_S = 5.0  # on etcd a pass reads only the keys put since the last; every key at least this often
PRESENCE_CHECK_S = 0.5  # how often a noticed leader looks for a candidate whose node stays (one etcd read)
ANSWER_S = 1.0  # how often the records of replacement nodes are read
LIST_S = 10.0  # how often the scheduler is asked about the jobs of open replacement requests
log = logging.getLogger(__name__)


def sleep_then_anything(seconds: float) -> None:
    """The wait between passes on the TCPStore: nothing tells which keys changed (None), so every pass reads them
    all."""
    time.sleep(seconds)


class LeaderEvents(EventLog):
    """The event log of a leader on etcd: each event is written only after the lease was
    confirmed, so a stale leader resuming from a freeze logs nothing more (``LeadershipLost``).

    At least once, not exactly once: a leader frozen between the confirmation and the write
    still writes that one line, which its successor may have logged too (no order of write and
    confirmation is both at most once and at least once across a freeze). Confirming first keeps
    that to one line per freeze; the readers (``events.read_log``) count each step once."""

    def __init__(self, dump_folder: str, confirm: Callable[[], None]) -> None:
        super().__init__(dump_folder)
        self._confirm = confirm

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        self._confirm()
        return super().emit(event, **fields)


def rules(settings: CoordinatorSettings) -> Rules:
    rc = settings.recover
    return Rules(
        replicas=settings.replicas,
        replica_ids=settings.replica_ids,
        max_members=settings.max_members,
        group_ranks=settings.group_ranks,
        steps=settings.steps,
        min_replicas=rc.min_replicas,
        max_step_retries=rc.max_step_retries,
        spare_timeout_s=rc.heartbeat_timeout_s,
        snapshot_interval=rc.snapshot_interval,
        resume_wait_s=rc.startup_timeout_s,
        launcher_timeout_s=rc.heartbeat_timeout_s,
        sdc_window_s=rc.sdc_quarantine_window_s,
        snapshot_keep=rc.snapshot_keep,
    )


def run_config(settings: CoordinatorSettings) -> dict[str, Any]:
    """What a reader of the event log needs to know of the run (the status page of a finished run)."""
    return {
        "replicas": settings.replicas,
        "replica_ids": settings.replica_ids,
        "steps": settings.steps,
        "tokens_per_step": settings.tokens_per_step,
        "precision": settings.precision,
    }


def status_page(
    settings: CoordinatorSettings,
    connect: Callable[[], ControlClient],
    messages: Callable[[ControlClient, list[str]], list[bytes]],
    events: EventLog,
) -> StatusServer | None:
    """The run's status page (``[recover] status_port``), read from the event log and through
    ``connect``'s own client of the store, with what ``events`` could not write yet; None when it is
    off or cannot listen (said once: the run goes on without it)."""
    rc = settings.recover
    if not rc.status_port:
        return None
    history = RunHistory(**run_config(settings))
    folder = settings.dump_folder
    source = StatusSource(
        Tail(lambda: event_files(folder)),
        history,
        Run.from_env().public_id,
        StoreReader(connect, messages),
        events.pending,
    )
    try:
        server = StatusServer(source, rc.status_bind, rc.status_port)
    except OSError as e:  # checked free at launch: a frozen former leader on this host may hold it
        log.warning(
            f"no status page: cannot listen on {rc.status_bind}:{rc.status_port} ({e.strerror}); the run goes on"
        )
        return None
    log.info(f"status page at {server.address} (Prometheus: {server.address}metrics)")
    return server


class Coordinator:
    """The I/O shell around ``CoordinatorCore``: one pass reads the store, the core decides, the shell publishes."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        client: SealedStore,
        events: EventLog,
        poll_s: float = POLL_S,
        wait: Callable[[float], Collection[str] | None] = sleep_then_anything,
        node_messages: Callable[[list[str]], list[bytes]] | None = None,
    ) -> None:
        self.rc = rc = settings.recover
        self.control = ControlClient(client)
        self.node_messages = node_messages or self.control.node_messages  # on etcd: the leader's board
        self.events = events
        self.poll_s, self.wait = poll_s, wait  # between passes: ``wait(poll_s)``, early with the keys put, or None
        self.alive_s = ETCD_ALIVE_S if rc.control_store else ALIVE_S
        detector = FailureDetector(
            members=tuple(range(settings.replicas)),
            timeout_s=rc.heartbeat_timeout_s,
            confirm_s=rc.report_confirm_s,
            startup_s=rc.startup_timeout_s,
            start=time.monotonic(),
        )
        submitter, why = slurm.Submitter.of(rc, os.environ)
        if why and rc.replace == "on":
            log.warning(f"recover.replace = on, but {why}")
        self.scheduler = None if submitter is None else slurm.Scheduler(submitter)
        if rc.sdc_check:
            said, enough = sdc.reach(settings.replicas, rc.sdc_check_rate, rc.snapshot_interval, rc.snapshot_keep)
            (log.info if enough else log.warning)(said)
        self.core = CoordinatorCore(
            rules(settings),
            detector,
            fault_time=self._fault_time,
            node_groups=lambda: {
                host_memory.node_of(key): set(message.groups) for key, (message, _) in self.node_groups.items()
            },
            committed=lambda step, epoch: self.control.decision(step, epoch) == COMMIT,
            snapshots=lambda replica, incarnation: self.control.snapshots(replica, incarnation, settings.group_ranks),
            replace_bounds=None
            if submitter is None
            else replacements.Bounds(rc.replace_after_s, rc.max_replacements, submitter.groups),
        )
        self.next_answers = 0.0  # when the replacement nodes' records are next read
        self.out_seen: set[int] = set()  # the groups out of the run when they were last read
        self.next_list = 0.0  # when the scheduler is next asked about the open requests' jobs
        self.slot_seen: dict[int, float] = {}  # unread report slots (``state.unread_reports``) -> first seen empty
        self.nodes: dict[
            str, int
        ] = {}  # the launcher key of every registered node still read -> its registration index
        self.next_node = 1  # the next registration index to name
        self.nodes_put = True  # a launcher may have registered since the count was last read
        self.pending_nodes: dict[int, float] = {}  # registrations not yet named -> first seen
        self.node_raw: dict[str, bytes] = {}  # each node's last message
        self.node_changed: dict[str, float] = {}  # ... when it last changed
        self.node_groups: dict[str, tuple[NodeMessage, float]] = {}  # ... parsed, and when it last changed
        self.snapshot_memory = host_memory.Peaks()  # each node's snapshot folder: latest, peak, logged
        self.claims_checked: dict[str, float] = {}  # silent nodes still holding a claim -> when that was read
        self.next_domains_read = 0.0  # when the members' claims are next read for their failure domains
        self.placement: dict[int, tuple[tuple[int, str], ...]] | None = None  # ... as last read, every part claimed
        self.exposed: dict[str, tuple[int, ...]] = {}  # domain -> shards whose copies all sit in it, as last warned
        self.unknown_said = False  # the line saying some nodes' domains are unknown (once)
        self.malformed_step: int | None = None  # the step whose record was last found malformed (warned once)
        self.next_node_read = 0.0
        self.last_node_read: float | None = None  # when the node messages were last read
        self.next_alive = 0.0
        self.settings = settings
        self.noticed: float | None = None  # when SIGTERM told this coordinator's node it goes away (wall clock)
        saved = self.control.read_state()
        if saved is not None:
            self._take_over(saved)
        else:
            self._apply([Publish(self.core.membership), Save()])
            self.events.emit("run_config", run=Run.from_env().public_id, **run_config(settings))

    @property
    def membership(self) -> Membership:
        return self.core.membership

    def _apply(self, effects: list[Effect]) -> bool:
        """Carries out the core's effects in order; False once the run stops."""
        for e in effects:
            if isinstance(e, Publish):
                self.control.publish(e.membership)
            elif isinstance(e, Save):
                self.control.save_state(self.core.state)
            elif isinstance(e, FenceOut):
                self.control.fence(e.replica, e.fence)
            elif isinstance(e, Admit):
                self.control.admit(e.replica, e.admission)
            elif isinstance(e, Emit):
                self.events.emit(e.event, **e.fields)
            elif isinstance(e, LogStep):
                self.events.step(e.record.to_json())
            elif isinstance(e, Usage):
                self.events.emit("resources", process="coordinator", step=e.step, **resources.usage())
            elif isinstance(e, Say):
                (log.warning if e.warn else log.info)(e.message)
            elif isinstance(e, Forget):
                self._forget(e)
            elif isinstance(e, Replace):
                assert self.scheduler is not None
                owners = self.control.claims(e.replicas, 1)  # the lost groups' last launchers
                self.scheduler.request(e.request, [owner.host for owner in owners.values()])
            elif isinstance(e, Cancel):
                assert self.scheduler is not None
                self.scheduler.cancel(e.job)
            elif isinstance(e, Stop):
                self.control.stop(e.error)
                self.events.emit("fatal", step=self.core.step(), error=e.error)
                log.error(f"FATAL: {e.error}")
                return False
        return True

    def _forget(self, forget: Forget) -> None:
        self.control.forget_steps(forget.steps, forget.vote_epochs, self.core.rules.replica_ids)
        self.control.forget_epochs(forget.epochs)
        self.control.forget_reports(forget.reports)
        for replica, incarnation in forget.admissions:
            self.control.forget_admission(replica, incarnation)

    def _take_over(self, saved: CoordinatorState) -> None:
        """Continues a run from the state its previous leader saved: the epochs from the store (those
        it kept), the rest from the saved state; steps it saved but did not log yet are logged now.
        Every member gets one heartbeat timeout to show it is alive (its beats are read anew), and
        every report slot it found empty one grace period to be written."""
        epoch = self.control.epoch()
        history = {m.epoch: m for m in self.control.memberships(list(range(saved.kept_epoch, epoch + 1)))}
        self.core.take_over(saved, history, epoch)
        now = time.monotonic()
        self.slot_seen = {index: now for index in saved.unread_reports}
        progress = saved.progress
        if progress is not None:  # past startup: every member beat before; the dead ones stop now
            self.core.grace(now)
            if progress.step not in logged_steps(self.events.path):
                # saved, then its leader died before the event was written (saves precede events one step at a time)
                try:
                    record = self.control.read_step(progress.step)
                except MessageError:
                    record = None  # committed without a record: its leader wrote the event saying so, or died first
                if record is not None:
                    self.events.step(record.to_json())
        log.info(f"took over at step {self.core.step()}: epoch {epoch}, members {id_list(self.membership.members)}")

    def _fault_time(self, replica: int, incarnation: int) -> float | None:
        """An injected fault's own time, if that incarnation had one (measurement only)."""
        try:
            rec = self.control.read_fault(replica)
        except MessageError:
            return None
        return rec.time if rec is not None and rec.attempt == incarnation else None

    def _read_start_step(self) -> None:
        if self.core.state.progress is None and self.core.start_step is None:  # written once: read once
            try:
                self.core.start_step = self.control.start_step()
            except MessageError as e:
                log.warning(f"ignoring malformed start step: {e}")

    def _poll_steps(self) -> None:
        """Logs each committed step once, in order, from the record its first committer wrote; a
        malformed record holds its step up only until the store shows the step committed."""
        self._read_start_step()
        while True:
            step = self.core.step()
            try:
                record = self.control.read_step(step)
                if record is None:
                    return
                if not self.core.accepts(record):
                    raise MessageError(f"the record of step {step} is for another step or epoch: {record!r:.200}")
            except MessageError as e:
                effects = self.core.on_malformed_step(str(e))
                if not effects:
                    if self.malformed_step != step:
                        log.warning(
                            f"malformed step record: {e}; step {step} is logged without it once the store "
                            "shows it committed"
                        )
                        self.malformed_step = step
                    return
                self._apply(effects)
                continue
            self._apply(self.core.on_step(record))

    def _poll_nodes(self, now: float, changed: Collection[str] | None = None) -> None:
        """Reads every node's message in one request, once per heartbeat interval, and folds
        them per replica group: the only liveness the coordinator reads (its work grows with
        nodes, not ranks)."""
        self.nodes_put = self.nodes_put or changed is None or NODES in changed
        if now < self.next_node_read:
            return
        self.next_node_read = now + config.node_message_interval_s(self.rc)
        started = time.monotonic()
        if self.nodes_put or self.pending_nodes:
            self.nodes_put = False
            self._register_nodes(now)
        if not self.nodes:
            return
        names = list(self.nodes)
        raws = self.node_messages(names)
        # the time between two reads, and the read's own request: not the time this coordinator spends on
        # what it read (it grows with the nodes, and taken for a stall it would hide every silent node)
        unread = max(now - self.last_node_read if self.last_node_read is not None else 0.0, time.monotonic() - started)
        # the messages written since the last read; the others' lifelines did not write (or not yet to this
        # leader's board): their groups age
        moved = [(key, raw) for key, raw in zip(names, raws) if raw and raw != self.node_raw.get(key)]
        if store_stalled(unread, self.rc.heartbeat_timeout_s, len(moved), len(names)):
            self.core.grace(now)  # no lifeline could write, or none was read: silence says nothing about the groups
            log.warning(
                f"no node message read for {unread:.1f}s and {len(moved)} of {len(names)} moved (the control store "
                "stalled, e.g. an etcd election, or this coordinator was frozen): every group gets one heartbeat "
                "timeout from now"
            )
        for key, raw in moved:
            self.node_raw[key], self.node_changed[key] = raw, now
            try:
                message = NodeMessage.loads(key, raw)
            except MessageError as e:
                log.warning(f"ignoring malformed node message: {e}")
                continue
            self.node_groups[key] = (message, now)
            node = host_memory.node_of(key)
            if message.snapshot_bytes is not None and self.snapshot_memory.observe(node, message.snapshot_bytes):
                self.events.emit("host_memory", node=node, bytes=message.snapshot_bytes)
        self._forget_nodes(now)
        self.core.on_nodes(
            group_views(
                (replica, entry, seen)
                for message, seen in self.node_groups.values()
                for replica, entry in message.groups.items()
            ),
            now,
        )
        self.last_node_read = now + (time.monotonic() - started)  # read and folded

    def _register_nodes(self, now: float) -> None:
        """Names the launchers registered since the last read (each writes its name right after the counter)."""
        count = self.control.node_count()
        for index in range(self.next_node, count + 1):
            self.pending_nodes[index] = now
        self.next_node = max(self.next_node, count + 1)
        for index, since in sorted(self.pending_nodes.items()):
            name = self.control.node_name(index)
            if name is not None:
                del self.pending_nodes[index]
                self.nodes[name] = index
                self.node_changed[name] = now
            elif now - since > REPORT_GRACE_S:
                del self.pending_nodes[index]
                log.info(
                    f"node {index} has no launcher name (it died before naming itself, or a previous leader "
                    "forgot it once another launcher had taken its claims over); skipped"
                )

    def _check_domains(self, now: float) -> None:
        """With host-memory snapshots on: once every part of every member group is claimed, and again whenever the
        members' nodes move to other failure domains (a group restarted on another node), logs a ``domains`` event
        and warns when every copy of some shard sits in one domain (``policy.domains``). The claims are read once
        per heartbeat timeout, the bound in which a restarted group's launcher claims it."""
        if not self.rc.snapshot_interval or now < self.next_domains_read or not self.membership.members:
            return
        self.next_domains_read = now + self.rc.heartbeat_timeout_s
        members, parts = self.membership.members, self.rc.group_nodes
        owners = self.control.claims(members, parts)
        if len(owners) < len(members) * parts:
            return  # a launcher has yet to claim its part
        placement = {r: tuple((p, owners[r, p].domain) for p in range(parts)) for r in members}
        if placement == self.placement:
            return
        self.placement = placement
        found = domains.exposure(placement, self.core.rules.group_ranks, parts)
        self.events.emit(
            "domains",
            step=self.core.step(),
            domains=list(found.domains),
            unknown=len(found.unknown),
            shards={d: list(ks) for d, ks in found.single.items()},
        )
        if found.single and found.single != self.exposed:
            log.warning(domains.warning(found))
        elif self.exposed and not found.single:
            log.info(f"every shard now has host-memory copies in more than one failure domain ({len(found.domains)})")
        self.exposed = dict(found.single)
        if found.unknown and not self.unknown_said and len({o.id for o in owners.values()}) > 1:  # nodes, not one
            self.unknown_said = True
            log.info(
                f"the failure domains of replica groups {id_list(found.unknown)}'s nodes are unknown: set "
                f"{keys.FAILURE_DOMAIN_ENV} (or [recover] failure_domain) on every node to be warned when every "
                "host-memory copy of a shard sits in one domain (docs/host-memory.md#failure-domains)"
            )

    def _forget_nodes(self, now: float) -> None:
        """Stops reading, and deletes, the launchers silent for longer than a claim's takeover bound
        (the heartbeat timeout) whose claims another launcher took over: replacement launchers
        then cost the store and each pass nothing once their predecessors are gone. A silent one
        still holding a claim (frozen, or cut off) is kept, and its claims read again one bound later."""
        bound = self.rc.heartbeat_timeout_s
        silent = [
            key
            for key in self.nodes
            if now - self.node_changed[key] > bound and now - self.claims_checked.get(key, -bound) >= bound
        ]
        if not silent:
            return
        holders = self.control.claim_holders(self.core.rules.replica_ids, self.rc.group_nodes)
        for key in silent:
            if key in holders:
                self.claims_checked[key] = now
                continue
            self.control.forget_node(self.nodes.pop(key), key)
            for seen in (self.node_raw, self.node_changed, self.node_groups, self.claims_checked):
                seen.pop(key, None)
            log.info(f"forgot {key}: silent for more than {bound:g}s and its claims taken over by another launcher")

    def _poll_reports(self, now: float, changed: Collection[str] | None = None) -> None:
        """Reads new reports; a reserved slot never written (its reporter died between
        reserving and writing) is skipped after ``REPORT_GRACE_S``, holding up no later report.
        The slots not read yet are part of the saved state: a new leader reads them too."""
        state = self.core.state
        if changed is None or REPORTS in changed:
            count = self.control.report_count()
            state.unread_reports += range(state.next_report, count + 1)
            state.next_report = max(state.next_report, count + 1)
        for index in list(state.unread_reports):
            since = self.slot_seen.setdefault(index, now)
            try:
                report = self.control.read_report(index)
            except MessageError as e:
                log.warning(f"ignoring malformed report: {e}")
                report = None
            else:
                if report is None and now - since <= REPORT_GRACE_S:
                    continue
                if report is None:
                    log.warning(f"report slot {index} was reserved but never written (its reporter died?); skipped")
            state.unread_reports.remove(index)
            del self.slot_seen[index]
            if report is not None:
                self._apply(self.core.on_report(report, now))

    def _transfers(self, replica: int) -> list[TransferRecord]:
        records = []
        for group_rank in range(self.core.rules.group_ranks):
            try:
                record = self.control.read_transfer(replica, group_rank)
            except MessageError as e:
                log.warning(f"ignoring malformed transfer record: {e}")
                continue
            if record is not None:
                records.append(record)
        return records

    def _stopped_by_a_process(self) -> bool:
        """A rank stopped the run (e.g. a DataError): the event log says why."""
        if not self.control.stopped():
            return False
        self._poll_steps()  # steps committed before it belong before it
        try:
            error = self.control.fatal() or ""
        except MessageError as e:
            error = f"a process stopped the run with a malformed message: {e}"
        self.events.emit("fatal", step=self.core.step(), error=error)
        log.error(f"FATAL: {error}")
        return True

    def _replacements(self, now: float) -> None:
        """Replacement requests (``[recover] replace``): the scheduler's answers, the replacement nodes' records
        (every ``ANSWER_S``), the open requests' jobs (every ``LIST_S``), then the core's new requests."""
        if self.scheduler is None:
            return
        self._scheduled(self.scheduler.results())
        out = set(self.core.state.down_since)
        if now >= self.next_answers or out != self.out_seen:  # a group back: was it a request's node, which
            self.next_answers = now + ANSWER_S  # recorded its ids before its groups started? (else it is cancelled)
            self.out_seen = out
            self._read_answers()
        if now >= self.next_list:
            self.next_list = now + LIST_S
            open_ = {r.number: r.job for r in self.core.state.requests if r.outcome is None and r.job}
            self.scheduler.ask_states(open_)
        self._apply(self.core.on_replacements())

    def _scheduled(self, results: list[slurm.Result]) -> None:
        for result in results:
            if isinstance(result, slurm.Submitted):
                self._apply(self.core.on_submitted(result.request, result.job, result.command))
            elif isinstance(result, slurm.Refused):
                self._apply(self.core.on_submit_failed(result.request, result.error, result.command))
            elif isinstance(result, slurm.Listed):
                ended = {n: state for n, state in result.states.items() if state not in slurm.ACTIVE}
                if ended:
                    self._read_answers()  # a node that joined, or left at once, wrote its record first
                for number, state in ended.items():
                    self._apply(self.core.on_job_gone(number, state))
            else:
                log.warning(f"could not cancel job {result.job} of a replacement request: {result.error}")

    def _read_answers(self) -> None:
        """The record of each replacement node that has not answered yet (one whose submission failed, too: a
        person may have run its command)."""
        for request in self.core.state.requests:
            if request.outcome is None or (request.outcome == FAILED and request.job is None):
                try:
                    answer = self.control.read(keys.replacement_key(request.number), Replacing)
                except MessageError as e:
                    log.warning(f"ignoring a malformed replacement record: {e}")
                    continue
                if answer is not None:
                    self._apply(self.core.on_answered(request.number, answer.replicas, answer.job))

    def notice(self) -> None:
        """SIGTERM's handler (on a TCPStore): this coordinator's node goes away, and its store with it. It
        only notes the time; the next pass stops the run in order (``CoordinatorCore.on_notice``)."""
        if self.noticed is None:
            self.noticed = time.time()

    def _stop_in_order(self) -> bool:
        """Once noticed: the run stops at a step boundary, or, not done within ``recover.notice_budget_s``
        (a hung rank, a slow save), ends as fatal at once; False then."""
        assert self.noticed is not None
        if self.core.stopping is None:
            self._poll_steps()  # the last step this coordinator knows committed bounds the stop
            self._apply(self.core.on_notice("the coordinator's node goes away (SIGTERM)"))
        late = time.time() - self.noticed
        if late <= self.rc.notice_budget_s:
            return True
        step = self.core.stopping[0] if self.core.stopping else self.core.step()
        return self._apply(
            [
                Stop(
                    f"the run did not stop in order within recover.notice_budget_s = {self.rc.notice_budget_s:g}s "
                    f"of its coordinator's notice (stopping after step {step}); {self.settings.resume_hint}"
                )
            ]
        )

    def _end_stopped(self) -> int:
        """Every group stopped at the same step boundary: the run's end says so, with the resume line."""
        assert self.core.stopping is not None
        step, why = self.core.step() - 1, self.core.stopping[1]
        self.control.finish(stopped=True)
        notice_s = None if self.noticed is None else round(time.time() - self.noticed, 3)  # this node's own notice
        self.events.emit("stopped", step=step, reason=why, notice_s=notice_s)
        log.info(f"the run stopped in order after step {step} ({why}). {self.settings.stop_hint}")
        return EXIT_STOPPED

    def _pass(self, changed: Collection[str] | None = None) -> int | None:
        """One pass over the store, reading the keys in ``changed`` (those put since the last
        pass; None: anything may have changed); the run's exit code once it ends."""
        if time.monotonic() >= self.next_alive:
            self.control.beat_alive()  # every process watches this move
            self.next_alive = time.monotonic() + self.alive_s
        if (changed is None or FATAL in changed) and self._stopped_by_a_process():
            return EXIT_FAILED
        if self.noticed is not None and not self._stop_in_order():
            return EXIT_FAILED
        now = time.monotonic()
        if changed is None or any(k.startswith(("step/", START_STEP)) for k in changed):
            self._poll_steps()
        self._poll_nodes(now, changed)
        self._check_domains(now)
        self._poll_reports(now, changed)
        failed, retry = self.core.detector.decide(now)
        if failed or retry:
            self._poll_steps()  # a step committed just before a failure belongs before it
            if not self._apply(self.core.on_failure(failed, now) if failed else self.core.on_retry(now)):
                return EXIT_FAILED
        if any(r in self.membership.members for r in self.core.asking):  # a restart may fence its own member
            self._poll_steps()
        if not self._apply(self.core.on_joins(now)):
            return EXIT_FAILED
        self._apply(self.core.on_rejoined(self._transfers))
        self._replacements(now)
        if self.core.finished():
            self._poll_steps()  # the last steps belong before the end, and their logging forgets older ones
            keys_left = self.control.key_count()
            if keys_left is not None:  # what the run leaves in the store: bounded whatever its length
                self.events.emit("store", step=self.core.step() - 1, keys=keys_left)
            if self.core.stopping is not None:
                return self._end_stopped()
            self.control.finish()
            log.info("all live replica groups finished")
            return EXIT_OK
        return None

    def run(self, confirm: Callable[[], None] = lambda: None) -> int:
        """Coordinates until the run ends; ``confirm`` raises once this leader lost its lease."""
        log.info(f"serving; members {id_list(self.membership.members)} x {self.core.rules.group_ranks} ranks")
        changed: Collection[str] | None = None
        full = time.monotonic()
        while True:
            confirm()
            if changed is None:
                full = time.monotonic()
            code = self._pass(changed)
            if code is not None:
                return code
            changed = self.wait(self.poll_s)
            if time.monotonic() - full >= FULL_PASS_S:
                changed = None

    def end(self) -> None:
        """Wakes every node agent, blocked until the next epoch, to read the run's end (done or fatal), cancels the
        replacement requests that never joined, logs each node's snapshot memory peak not logged yet, and writes
        what the event log still keeps (or says it cannot)."""
        self._apply(self.core.end())
        if self.scheduler is not None:  # the requests that never joined are cancelled: none is left queued
            self._read_answers()
            self._apply(self.core.on_replacements(ended=True))
            self._scheduled(self.scheduler.close())
            self._scheduled(self.scheduler.results())  # the cancellations of jobs submitted meanwhile
        for node, peak in self.snapshot_memory.unlogged().items():
            self.events.emit("host_memory", node=node, bytes=peak)
        self.events.close()


def serve(settings: CoordinatorSettings, port: int) -> Coordinator:
    """The coordinator on its own TCPStore, listening on ``port`` (on the socket its launcher bound
    there, when it handed one over)."""
    rc = settings.recover
    fd = os.environ.get(keys.LISTEN_FD_ENV)
    if fd is not None and not fd.isdigit():
        raise RuntimeError(
            f"{keys.LISTEN_FD_ENV}={fd!r} is not a file descriptor: start the coordinator with run_train.sh"
        )
    client = transport.serve(
        port, rc.collective_timeout_s, rc.coordinator_bind or LOOPBACK, fd=None if fd is None else int(fd)
    )
    return Coordinator(settings, client, EventLog(settings.dump_folder))


def lead(settings: CoordinatorSettings, address: str) -> int:
    """A candidate on etcd: campaigns, and once it leads, coordinates until the run ends; a
    leadership lost meanwhile (it froze past its lease, or its node goes away and another's stays)
    sends it back to campaigning. It shows itself among the run's candidates meanwhile (``presence``)."""
    from titan_recover.control.presence import Presence  # the etcd extra: only a run on etcd needs it

    rc = settings.recover
    run = Run.from_env()
    raw = transport.etcd(address, rc.coordinator_timeout_s)
    presence = Presence(raw, run, rc.leader_lease_s)
    on_notice(presence.notice)  # this node goes away: the lead passes to a candidate whose node stays, if one lives
    try:
        return Campaign(settings, address, run, raw, presence).run()
    finally:
        presence.close()


class Campaign:
    """A candidate's campaigns, and its terms as the leader, until the run ends (``lead``)."""

    def __init__(
        self, settings: CoordinatorSettings, address: str, run: Run, raw: "EtcdStore", presence: "Presence"
    ) -> None:
        from titan_recover.control.leader import Lease  # the etcd extra: only a run on etcd needs it

        self.settings, self.address, self.of, self.raw, self.presence = (
            settings,
            address,
            run,
            raw,
            presence,
        )  # of: the run
        self.lease = Lease(raw, leader_key(run.prefix), settings.recover.leader_lease_s)
        self.view = ControlClient(transport.in_run(raw, run))
        self.next_check = 0.0  # when a noticed leader next looks for a candidate whose node stays
        self.leads_on_said = False

    def ended(self) -> bool:
        return self.view.finished() or self.view.stopped()

    def confirm(self) -> None:
        """Raises ``LeadershipLost`` once the lease expired, or once this node goes away while another live
        candidate's stays (asked every ``PRESENCE_CHECK_S``)."""
        from titan_recover.control.etcd_store import LeadershipLost

        self.lease.check()
        if not self.presence.noticed or time.monotonic() < self.next_check:
            return
        self.next_check = time.monotonic() + PRESENCE_CHECK_S
        if not self.presence.leads_on():
            raise LeadershipLost("this node goes away (SIGTERM): the lead passes to a candidate whose node stays")
        if not self.leads_on_said:
            self.leads_on_said = True
            log.info(
                "this node goes away (SIGTERM), and so does every other live candidate's: this one leads on, so "
                "that the run stops in order (a whole-job notice)"
            )

    def run(self) -> int:
        """The candidate's exit code: the run's end as it read it (a leader's: as it ended it)."""
        from titan_recover.control.etcd_store import Changes, LeadershipLost

        settings, address, run, raw, lease, view = self.settings, self.address, self.of, self.raw, self.lease, self.view
        rc = settings.recover
        if not view.begun():  # the first node starts the run's event log afresh first: a leader's lines must come after
            log.info(f"waiting up to {rc.startup_timeout_s:g}s for run {run.id!r} to begin (its first node's launcher)")
            try:
                transport.wait_for(view.store, keys.HELLO, rc.startup_timeout_s, poll_s=0.1)
            except TimeoutError:
                log.error(
                    f"run {run.id!r} did not begin within recover.startup_timeout_s = {rc.startup_timeout_s:g}s: "
                    "start the run's first node, with the same run id and secret"
                )
                return EXIT_FAILED
        while True:
            guarded = lease.campaign(self.ended, self.presence.leads_on)
            if guarded is None or self.ended():  # another candidate led the run to its end (perhaps as this one won)
                lease.resign()
                return EXIT_FAILED if view.stopped() else EXIT_STOPPED if view.stopped_in_order() else EXIT_OK
            log.info(f"leading (lease {rc.leader_lease_s:g}s)")
            client = transport.in_run(guarded, run)
            changes = Changes(raw, f"{run.prefix}/", NO_PASS)  # a pass when a key it acts on changed
            board = LeaderBoard(address, run, rc.collective_timeout_s)
            status: StatusServer | None = None
            try:
                ControlClient(client).put(BOARD, board.where)
                log.info(f"node messages on {board.where.address}")
                events = LeaderEvents(settings.dump_folder, guarded.confirm_guard)
                try:
                    coordinator = Coordinator(
                        settings, client, events, config.node_message_interval_s(rc), changes.wait, board.messages
                    )
                except MessageError as e:  # no leader could act on it: the run stops, saying why
                    error = f"the coordinator state in etcd cannot be taken over: {e}; {settings.resume_hint}"
                    ControlClient(client).stop(error)
                    events.emit("fatal", error=error)
                    log.error(f"FATAL: {error}")
                    return EXIT_FAILED
                events.emit(
                    "leader",
                    pid=os.getpid(),
                    host=socket.gethostname(),
                    step=coordinator.core.step(),
                    epoch=coordinator.membership.epoch,
                )
                status = status_page(
                    settings,
                    lambda: ControlClient(transport.in_run(transport.etcd(address, rc.coordinator_timeout_s), run)),
                    lambda _, names: board.messages(names),
                    events,
                )
                code = coordinator.run(self.confirm)
                coordinator.end()
                time.sleep(4 * PROBE_S)  # the board stays up while the launchers read the end and stop writing to it
                return code  # the state stays in etcd: no store to keep up for the others to read
            except LeadershipLost as e:
                log.info(f"no longer the leader ({e}); campaigning again")
            finally:
                if status is not None:
                    status.close()
                changes.close()
                board.close()
                lease.resign()


def parse_settings(argv: list[str]) -> str:
    """The JSON of ``--settings JSON``, the coordinator's one argument (its launcher writes it)."""
    parser = argparse.ArgumentParser(
        prog="python -m titan_recover.coordinator",
        description="The coordinator of a run; run_train.sh's launcher starts it.",
    )
    parser.add_argument(
        "--settings", required=True, help="the job's settings record (config.CoordinatorSettings) as JSON"
    )
    return parser.parse_args(argv).settings


def main(argv: list[str]) -> int:
    try:
        settings = CoordinatorSettings.from_json(parse_settings(argv))
    except ConfigError as e:
        log.error(f"error: {e}")
        return EXIT_BAD_INPUT
    address = transport.coordinator_address()
    if is_etcd(address):
        return lead(settings, address)
    coordinator = serve(settings, parse_host_port(address)[1])
    on_notice(coordinator.notice)  # the run's store goes with this process: a notice stops the run in order
    status = status_page(
        settings,
        lambda: ControlClient(transport.connect(address, settings.recover.startup_timeout_s)),
        lambda client, names: client.node_messages(names),
        coordinator.events,
    )
    try:
        code = coordinator.run()
        coordinator.end()
        return code
    finally:
        time.sleep(4 * PROBE_S)  # let every process read the final keys before the store goes away
        if status is not None:
            status.close()
