"""Every read and write of the control store, through ``protocol`` records: nobody else builds keys.

``ControlClient`` wraps the run's sealed store (``transport.connect`` or ``transport.serve``).
A record that does not check out raises ``protocol.MessageError`` naming its key; the caller
decides whether to ignore it or stop. A value without the run's seal reads as missing
(``sealed.SealedStore.read``, which logs it): nothing here acts on a forged record.
"""

import time
import uuid
from collections.abc import Iterable
from datetime import timedelta
from typing import TypeVar

from titan_recover.control import keys
from titan_recover.control.protocol import (
    Admission,
    CoordinatorState,
    Drain,
    Fatal,
    FaultRecord,
    Fence,
    Launcher,
    Membership,
    MessageError,
    NodeMessage,
    Record,
    Rendezvous,
    Report,
    Snapshots,
    StepRecord,
    TransferRecord,
    decode_int,
)
from titan_recover.control.sealed import ForgedRecord, SealedStore

R = TypeVar("R", bound=Record)
COMMIT, ABORT = "commit", "abort"
REDO = "redo"  # + the round that follows: every vote was in, and the step is done again in this epoch
STOPPED = "stopped"  # the run's status when it stopped in order before its last step (else "done")


def redone(round: int) -> str:
    """The decision that ended ``round`` - 1 with a redo: the value ``round`` starts from."""
    return f"{REDO}{round}" if round else ""


class ControlClient:
    """The run's control store, one record at a time. ``store`` stays reachable for what needs the
    store itself (the gloo rendezvous of the replicate-dim groups)."""

    def __init__(self, store: SealedStore) -> None:
        self.store = store

    # ---- records and counters ---------------------------------------------------------

    def put(self, key: str, record: Record) -> None:
        self.store.set(key, record.dumps())

    def read(self, key: str, kind: type[R]) -> R | None:
        """The record under ``key``, or None while there is none."""
        raw = self.store.read(key)
        return None if raw is None else kind.loads(key, raw)

    def _int(self, key: str) -> int | None:
        raw = self.store.read(key)
        return None if raw is None else decode_int(key, raw)

    def _text(self, key: str) -> str | None:
        raw = self.store.read(key)
        return None if raw is None else raw.decode(errors="replace")

    def _count(self, key: str) -> int:
        return int(self.store.add(key, 0))

    # ---- epochs -----------------------------------------------------------------------

    def epoch(self) -> int:
        return decode_int(keys.EPOCH, self.store.get(keys.EPOCH))

    def publish(self, membership: Membership) -> None:
        """members/<e> is written before the epoch, so whoever sees an epoch can read its members."""
        self.store.set(keys.members_key(membership.epoch), membership.dumps())
        self.store.set(keys.EPOCH, str(membership.epoch))

    def memberships(self, epochs: list[int]) -> list[Membership]:
        names = [keys.members_key(e) for e in epochs]
        return [Membership.loads(key, raw) for key, raw in zip(names, self.store.multi_get(names))]

    def membership(self, epoch: int) -> Membership:
        return self.memberships([epoch])[0]

    def wait_epoch_after(self, epoch: int, timeout_s: float) -> None:
        """Blocks until the members of the epoch after ``epoch`` are published (the server answers
        when the key is set), or raises when ``timeout_s`` passes first."""
        self.store.wait([keys.members_key(epoch + 1)], timedelta(seconds=timeout_s))

    # ---- the run's end ----------------------------------------------------------------

    def stop(self, error: str) -> None:
        """Ends the run: every process sees ``fatal`` and stops."""
        self.put(keys.FATAL, Fatal(error))

    def fatal(self) -> str | None:
        """Why the run stopped, or None while it goes on."""
        rec = self.read(keys.FATAL, Fatal)
        return None if rec is None else rec.error

    def stopped(self) -> bool:
        return self.store.read(keys.FATAL) is not None

    def finish(self, stopped: bool = False) -> None:
        """Ends the run: done (its last step), or ``stopped`` in order before it (the same command resumes)."""
        self.store.set(keys.STATUS, STOPPED if stopped else "done")

    def finished(self) -> bool:
        return self.store.read(keys.STATUS) is not None

    def stopped_in_order(self) -> bool:
        """Whether the run ended stopped in order rather than done (read once, at its end)."""
        return self.store.read(keys.STATUS) == STOPPED.encode()

    def begin(self) -> bool:
        """Says hello for the run on a shared store (etcd): True when this call started it, False
        when it had started already (a relaunched node joins it)."""
        mine = f"titan_recover {uuid.uuid4().hex}"
        return self.store.compare_set(keys.HELLO, "", mine).decode(errors="replace") == mine

    def begun(self) -> bool:
        """Whether the run has started (its hello is set): until then no process of it writes an event."""
        return self.store.check([keys.HELLO])

    def ended(self) -> str | None:
        """How the run ended ("done", or why it stopped), or None while it goes on."""
        return "done" if self.finished() else self.fatal()

    # ---- failure reports --------------------------------------------------------------

    def report(self, record: Report) -> None:
        """Tells the coordinator about a failure seen from here. A slot is reserved (``add``) then
        written (``set``); a reporter that dies in between leaves an empty slot, which the
        coordinator skips after a grace period."""
        index = self.store.add(keys.REPORTS, 1)
        self.put(keys.report_key(index), Report(**{**record.to_json(), "time": time.time()}))

    def report_count(self) -> int:
        return self._count(keys.REPORTS)

    def read_report(self, index: int) -> Report | None:
        """Report ``index``, or None while its slot is reserved but not written."""
        return self.read(keys.report_key(index), Report)

    def report_fault(self, replica: int, record: FaultRecord) -> None:
        self.put(keys.fault_key(replica), FaultRecord(**{**record.to_json(), "time": time.time()}))

    def read_fault(self, replica: int) -> FaultRecord | None:
        return self.read(keys.fault_key(replica), FaultRecord)

    # ---- steps and their commit vote --------------------------------------------------

    def tell_start_step(self, step: int) -> None:
        """Where the run's step records begin (0, or the DCP checkpoint resumed from); the first teller wins."""
        self.store.compare_set(keys.START_STEP, "", str(step))

    def start_step(self) -> int | None:
        return self._int(keys.START_STEP)

    def vote(self, step: int, epoch: int, voter: str, expected: int, outcome: str, round: int = 0) -> str | None:
        """``voter``'s commit vote for ``step`` in ``epoch`` (and ``round``); the step's decision after
        it (None: none yet, or a value not sealed with the run's secret). The last of ``expected``
        votes decides ``outcome`` unless another writer (an abort) was first: every rank acts on the
        same outcome. On etcd the vote and that decision are one Raft write."""
        try:
            _, won = self.store.vote(
                keys.ok_key(step, epoch, round), voter, keys.decision_key(step, epoch), expected, redone(round), outcome
            )
        except ForgedRecord:
            return None
        return None if won is None else won.decode(errors="replace") or None

    def votes(self, step: int, epoch: int, round: int = 0) -> int:
        return self.store.tallied(keys.ok_key(step, epoch, round))

    def abort(self, step: int, epoch: int, expected: int, round: int = 0) -> str | None:
        """Decides ``ABORT`` for ``step`` in ``epoch`` unless it is decided already (on etcd only while
        its votes are fewer than ``expected``, so an abort racing the last vote yields one outcome);
        the decision every rank acts on (None: a value not sealed with the run's secret)."""
        try:
            won = self.store.decide_short(
                keys.ok_key(step, epoch, round), keys.decision_key(step, epoch), expected, redone(round), ABORT
            )
        except ForgedRecord:
            return None
        return won.decode(errors="replace") or None

    def decision(self, step: int, epoch: int) -> str | None:
        return self._text(keys.decision_key(step, epoch))

    def await_decision(self, step: int, epoch: int, seconds: float) -> str | None:
        """``step``'s decision in ``epoch`` once it exists, or None after ``seconds``. For etcd, where
        the wait is a watch whose event carries the decision; the TCPStore's server-side wait logs
        a warning at every timeout."""
        raw = self.store.read_within(keys.decision_key(step, epoch), seconds)
        return None if raw is None else raw.decode(errors="replace")

    def offer_step(self, record: StepRecord) -> None:
        """The committed step's record; the first member's counts."""
        self.store.compare_set(keys.step_key(record.step), "", record.dumps())

    def read_step(self, step: int) -> StepRecord | None:
        return self.read(keys.step_key(step), StepRecord)

    def put_digest(self, step: int, replica: int, digest: str) -> None:
        self.store.set(keys.digest_key(step, replica), digest)

    def digests(self, step: int, replicas: list[int]) -> dict[int, str]:
        """The parameter digests of ``replicas`` at ``step`` written so far."""
        found = self.store.multi_read([keys.digest_key(step, r) for r in replicas])
        return {r: raw.decode(errors="replace") for r, raw in zip(replicas, found) if raw is not None}

    # ---- incarnations: fences, admissions, transfers ----------------------------------

    def fence(self, replica: int, fence: Fence) -> None:
        self.put(keys.fenced_key(replica), fence)

    def read_fence(self, replica: int) -> Fence | None:
        return self.read(keys.fenced_key(replica), Fence)

    def read_fences(self, replicas: list[int]) -> dict[int, Fence | None]:
        """The fences of ``replicas`` (None: not fenced), in one request on etcd."""
        names = [keys.fenced_key(r) for r in replicas]
        return {
            r: None if raw is None else Fence.loads(name, raw)
            for r, name, raw in zip(replicas, names, self.store.multi_read(names))
        }

    def drain(self, replica: int, drain: Drain) -> None:
        self.put(keys.drain_key(replica), drain)

    def read_drains(self, replicas: list[int]) -> dict[int, Drain | None]:
        """The operator's drains of ``replicas`` (None: none asked), in one request on etcd."""
        names = [keys.drain_key(r) for r in replicas]
        return {
            r: None if raw is None else Drain.loads(name, raw)
            for r, name, raw in zip(replicas, names, self.store.multi_read(names))
        }

    def admit(self, replica: int, admission: Admission) -> None:
        self.put(keys.admitted_key(replica, admission.attempt), admission)

    def admitted(self, replica: int, incarnation: int) -> bool:
        return self.store.read(keys.admitted_key(replica, incarnation)) is not None

    def admission(self, replica: int, incarnation: int) -> Admission | None:
        return self.read(keys.admitted_key(replica, incarnation), Admission)

    def put_snapshots(self, replica: int, incarnation: int, group_rank: int, found: Snapshots) -> None:
        self.put(keys.snapshots_key(replica, incarnation, group_rank), found)

    def snapshots(self, replica: int, incarnation: int, group_ranks: int) -> dict[int, Snapshots | None]:
        """Group rank -> the steps it verified (None: not written yet, or not a record: ``MessageError`` is
        not raised, a rank whose list cannot be read holds nothing the run can resume from)."""
        names = [keys.snapshots_key(replica, incarnation, k) for k in range(group_ranks)]
        out: dict[int, Snapshots | None] = {}
        for k, (name, raw) in enumerate(zip(names, self.store.multi_read(names))):
            try:
                out[k] = None if raw is None else Snapshots.loads(name, raw)
            except MessageError:
                out[k] = None
        return out

    def record_transfer(self, replica: int, group_rank: int, record: TransferRecord) -> None:
        self.put(keys.transfer_key(replica, group_rank), record)

    def read_transfer(self, replica: int, group_rank: int) -> TransferRecord | None:
        return self.read(keys.transfer_key(replica, group_rank), TransferRecord)

    def next_incarnation(self, replica: int) -> int:
        """The next incarnation number of ``replica``: 0 for its first start in the run, whoever starts it."""
        return int(self.store.add(keys.incarnation_key(replica), 1)) - 1

    # ---- groups that span nodes -------------------------------------------------------

    def publish_rendezvous(self, replica: int, rendezvous: Rendezvous) -> None:
        self.put(keys.rendezvous_key(replica), rendezvous)

    def read_rendezvous(self, replica: int) -> Rendezvous | None:
        return self.read(keys.rendezvous_key(replica), Rendezvous)

    def set_joined(self, replica: int, part: int, incarnation: int) -> None:
        self.store.set(keys.joined_key(replica, part), str(incarnation))

    def joined(self, replica: int, part: int) -> int | None:
        """The incarnation of ``replica`` its node part ``part`` last started (None: none yet)."""
        return self._int(keys.joined_key(replica, part))

    # ---- launchers and their node messages --------------------------------------------

    def register(self, launcher: Launcher, message: NodeMessage) -> None:
        """Names a launcher to the coordinator; its node message exists before anyone reads it."""
        self.write_node(launcher, message)
        self.name_node(launcher)

    def name_node(self, launcher: Launcher) -> None:
        """Names a launcher to the coordinator, which reads its node message from then on."""
        self.store.set(keys.node_key(int(self.store.add(keys.NODES, 1))), launcher.id)

    def write_node(self, launcher: Launcher, message: NodeMessage) -> None:
        self.put(launcher.key, message)

    def node_count(self) -> int:
        return self._count(keys.NODES)

    def node_name(self, index: int) -> str | None:
        """The launcher key of the ``index``-th registered node (None: registered, not yet named)."""
        launcher = self._text(keys.node_key(index))
        return None if launcher is None else keys.launcher_key(launcher)

    def node_messages(self, names: list[str]) -> list[bytes]:
        """The raw node messages under ``names`` (launcher keys), in one request: the coordinator
        parses only the ones that changed."""
        return self.store.multi_get(names)

    def node_message_raw(self, launcher: Launcher) -> bytes:
        """A launcher's node message as it stands (b"" before it registered): a sequence number makes every beat
        differ."""
        return self.store.read(launcher.key) or b""

    # ---- the coordinator's own --------------------------------------------------------

    def beat_alive(self) -> None:
        self.store.add(keys.ALIVE, 1)

    def save_state(self, state: CoordinatorState) -> None:
        self.put(keys.COORDINATOR_STATE, state)

    def read_state(self) -> CoordinatorState | None:
        return self.read(keys.COORDINATOR_STATE, CoordinatorState)

    # ---- forgetting -------------------------------------------------------------------
    # Keys nobody reads any more are deleted, so a long run's store stays bounded. The coordinator
    # decides which (``coordinator.core.Forget``), after saving the state that says they are gone.

    def _delete(self, names: list[str]) -> None:
        self.store.delete_many(names)

    def forget_steps(self, steps: range, epochs: range, replicas: int) -> None:
        """What committed ``steps`` left: their records, the parameter digests of replica ids
        0..``replicas``-1, and their commit votes and decisions in ``epochs``."""
        names = [
            name
            for step in steps
            for name in (
                keys.step_key(step),
                *(keys.digest_key(step, r) for r in range(replicas)),
                *(keys.decision_key(step, e) for e in epochs),
            )
        ]
        self.store.delete_many(names, tallies=[keys.ok_key(step, e) for step in steps for e in epochs])

    def forget_epochs(self, epochs: range) -> None:
        """The members of ``epochs`` and the rendezvous keys of their replicate and transfer groups
        (``keys.replicate_group_prefix``, ``keys.transfer_group_prefix``: one per shard and joiner)."""
        if epochs:
            self._delete([keys.members_key(e) for e in epochs])
            self.store.delete_under(tuple(p for e in epochs for p in keys.process_group_prefixes(e)))

    def forget_reports(self, slots: range) -> None:
        self._delete([keys.report_key(i) for i in slots])

    def forget_admission(self, replica: int, incarnation: int) -> None:
        self._delete([keys.admitted_key(replica, incarnation)])

    def forget_node(self, index: int, name: str) -> None:
        """A launcher gone for good (``name``: its launcher key): its registration first, so a new
        coordinator leader never names it and then waits for its message."""
        self._delete([keys.node_key(index), name])

    def claim_holders(self, replicas: int, parts: int) -> set[str]:
        """The launcher keys of the launchers that hold a claim on a group 0..``replicas``-1 (any of its
        ``parts`` node parts)."""
        return {owner.key for owner in self.claims(range(replicas), parts).values()}

    def claims(self, replicas: Iterable[int], parts: int) -> dict[tuple[int, int], Launcher]:
        """(replica, node part) -> the launcher that claims it, for each of the ``parts`` parts of ``replicas``; a
        released or malformed claim is left out. One read of every claim (12,500 groups read one by one took
        seconds of the coordinator's pass)."""
        where = [(replica, part) for replica in replicas for part in range(parts)]
        names = [keys.owner_key(replica, part) for replica, part in where]
        found = {}
        for at, key, raw in zip(where, names, self.store.multi_read(names)):
            if raw:
                try:
                    found[at] = Launcher.loads(key, raw)
                except MessageError:
                    continue
        return found

    def key_count(self) -> int | None:
        """How many keys the run has in the store (None where the store cannot list them: etcd)."""
        return self.store.key_count()
