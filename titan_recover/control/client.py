"""Every read and write of the control store, through ``protocol`` records: nobody else builds keys.

``ControlClient`` wraps a store already seen through the run's secret (``transport.connect``
or ``transport.serve``). A record that does not check out raises ``protocol.MessageError``
naming its key; the caller decides whether to ignore it or stop.
"""

import time
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from titan_recover.control import keys
from titan_recover.control.protocol import (
    Admission,
    Membership,
    CoordinatorState,
    Fatal,
    FaultRecord,
    Fence,
    Launcher,
    NodeMessage,
    Record,
    Rendezvous,
    Report,
    StepRecord,
    TransferRecord,
    decode_int,
)

R = TypeVar("R", bound=Record)
COMMIT, ABORT = "commit", "abort"


class ControlClient:
    """The run's control store, one record at a time. ``store`` stays reachable for what needs the
    store itself (the gloo rendezvous of the replicate-dim groups)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    # ---- records and counters ---------------------------------------------------------

    def put(self, key: str, record: Record) -> None:
        self.store.set(key, record.dumps())

    def read(self, key: str, kind: type[R]) -> R | None:
        """The record under ``key``, or None while there is none."""
        return kind.loads(key, self.store.get(key)) if self.store.check([key]) else None

    def _int(self, key: str) -> int | None:
        return decode_int(key, self.store.get(key)) if self.store.check([key]) else None

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
        return self.store.check([keys.FATAL])

    def finish(self) -> None:
        self.store.set(keys.STATUS, "done")

    def finished(self) -> bool:
        return self.store.check([keys.STATUS])

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

    def vote(self, step: int, epoch: int) -> int:
        """One commit vote for ``step`` in ``epoch``; the number of votes so far."""
        return int(self.store.add(keys.ok_key(step, epoch), 1))

    def votes(self, step: int, epoch: int) -> int:
        return self._count(keys.ok_key(step, epoch))

    def decide(self, step: int, epoch: int, outcome: str) -> None:
        """The first writer of a step's decision in an epoch wins: every rank acts on the same outcome."""
        self.store.compare_set(keys.decision_key(step, epoch), "", outcome)

    def decision(self, step: int, epoch: int) -> str | None:
        key = keys.decision_key(step, epoch)
        return self.store.get(key).decode(errors="replace") if self.store.check([key]) else None

    def offer_step(self, record: StepRecord) -> None:
        """The committed step's record; the first member's counts."""
        self.store.compare_set(keys.step_key(record.step), "", record.dumps())

    def read_step(self, step: int) -> StepRecord | None:
        return self.read(keys.step_key(step), StepRecord)

    def drop_step(self, step: int) -> None:
        """Deletes a malformed step record; a member rewrites it when it commits the step."""
        self.store.delete_key(keys.step_key(step))

    def put_digest(self, step: int, replica: int, digest: str) -> None:
        self.store.set(keys.digest_key(step, replica), digest)

    def digests(self, step: int, replicas: list[int]) -> dict[int, str]:
        """The parameter digests of ``replicas`` at ``step`` written so far."""
        names = {r: keys.digest_key(step, r) for r in replicas}
        return {r: self.store.get(k).decode(errors="replace") for r, k in names.items() if self.store.check([k])}

    # ---- incarnations: fences, admissions, transfers ----------------------------------

    def fence(self, replica: int, fence: Fence) -> None:
        self.put(keys.fenced_key(replica), fence)

    def read_fence(self, replica: int) -> Fence | None:
        return self.read(keys.fenced_key(replica), Fence)

    def admit(self, replica: int, admission: Admission) -> None:
        self.put(keys.admitted_key(replica, admission.attempt), admission)

    def admitted(self, replica: int, attempt: int) -> bool:
        return self.store.check([keys.admitted_key(replica, attempt)])

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

    def set_joined(self, replica: int, part: int, attempt: int) -> None:
        self.store.set(keys.joined_key(replica, part), str(attempt))

    def joined(self, replica: int, part: int) -> int | None:
        """The incarnation of ``replica`` its node part ``part`` last started (None: none yet)."""
        return self._int(keys.joined_key(replica, part))

    # ---- launchers and their node messages --------------------------------------------

    def register(self, launcher: Launcher, message: NodeMessage) -> None:
        """Names a launcher to the coordinator; its node message exists before anyone reads it."""
        self.write_node(launcher, message)
        self.store.set(keys.node_key(int(self.store.add(keys.NODES, 1))), launcher.id)

    def write_node(self, launcher: Launcher, message: NodeMessage) -> None:
        self.put(launcher.key, message)

    def node_count(self) -> int:
        return self._count(keys.NODES)

    def node_name(self, index: int) -> str | None:
        """The launcher key of the ``index``-th registered node (None: registered, not yet named)."""
        key = keys.node_key(index)
        return keys.launcher_key(self.store.get(key).decode(errors="replace")) if self.store.check([key]) else None

    def node_messages(self, names: list[str]) -> list[bytes]:
        """The raw node messages under ``names`` (launcher keys), in one request: the coordinator
        parses only the ones that changed."""
        return self.store.multi_get(names)

    def node_message_raw(self, launcher: Launcher) -> bytes:
        """A launcher's node message as it stands (b"" before it registered): a sequence number makes every beat differ."""
        return self.store.get(launcher.key) if self.store.check([launcher.key]) else b""

    # ---- the coordinator's own --------------------------------------------------------

    def beat_alive(self) -> None:
        self.store.add(keys.ALIVE, 1)

    def save_state(self, state: CoordinatorState) -> None:
        self.put(keys.COORDINATOR_STATE, state)

    def read_state(self) -> CoordinatorState | None:
        return self.read(keys.COORDINATOR_STATE, CoordinatorState)

