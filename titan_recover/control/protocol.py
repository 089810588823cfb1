"""The control plane's messages: one record per message, each with its one JSON form and its checks.

A peer's bytes are validated, never trusted: ``from_json`` raises ``MessageError`` naming
the store key and the field that is wrong. Values are JSON, never pickle, so a peer's
bytes can never run code. Writers and readers (and the tests) build messages only
through these records.
"""

import json
import math
import os
import secrets
import socket
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ClassVar, Mapping, TypeGuard, TypeVar

from titan_recover.control import keys


class MessageError(ValueError):
    """A store value that is not the JSON message expected under its key."""


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_count(value: object) -> TypeGuard[int]:
    return is_int(value) and value >= 0


def is_seconds(value: object) -> TypeGuard[float]:
    """A finite number (JSON has no int/float distinction a writer can rely on)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def decode_json(key: str, raw: bytes, required: tuple[str, ...] = ()) -> Any:
    """The JSON value under ``key``; with ``required``, an object holding those fields."""
    try:
        value = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MessageError(f"store key {key!r} does not hold JSON: {raw[:80]!r} ({e})") from e
    if required:
        if not isinstance(value, dict):
            raise MessageError(f"store key {key!r} must hold a JSON object, got {value!r}")
        missing = [f for f in required if f not in value]
        if missing:
            raise MessageError(f"store key {key!r} lacks fields {missing}: {value!r}")
    return value


def decode_int(key: str, raw: bytes) -> int:
    """A counter or an integer value (an epoch, a step)."""
    try:
        return int(raw)
    except ValueError as e:
        raise MessageError(f"store key {key!r} must hold an integer, got {raw[:80]!r}") from e


def _require(key: str, ok: bool, what: str, rec: object) -> None:
    if not ok:
        raise MessageError(f"store key {key!r}: {what}: {rec!r:.200}")


def _ids(key: str, obj: object, what: str, value: Callable[[Any], bool]) -> dict[int, Any]:
    """A ``{"<replica>": value}`` object with int keys, checked."""
    if not isinstance(obj, dict) or not all(isinstance(k, str) and k.isdigit() and value(v) for k, v in obj.items()):
        raise MessageError(f"store key {key!r}: {what} is not a map of replica ids: {obj!r:.200}")
    return {int(k): v for k, v in obj.items()}


R = TypeVar("R", bound="Record")

MAX_SNAPSHOTS = 64  # steps a rank may list in its ``Snapshots``: more is a corrupted record, not a setting
MAX_DOMAIN = 256  # characters of a launcher's failure domain: a name, not a document
MAX_STRIKES = 16  # SDC strikes kept per group: quarantine comes at the second within the window


class Record:
    """A message with one JSON form. Subclasses are dataclasses; ``REQUIRED`` fields must be present."""

    REQUIRED: ClassVar[tuple[str, ...]] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]  # Record is abstract: every subclass is a dataclass

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    @classmethod
    def loads(cls: type[R], key: str, raw: bytes) -> R:
        return cls.from_json(key, decode_json(key, raw, cls.REQUIRED))

    @classmethod
    def from_json(cls: type[R], key: str, rec: dict[str, Any]) -> R:
        raise NotImplementedError


@dataclass(frozen=True)
class Membership(Record):
    """Live replica groups of one epoch. Epochs only grow; an epoch's members never change.

    ``last_step``: the run stops in order (its coordinator's node goes away): no step after it commits;
    a group that reads it at a later step stops there, having committed the one before. Carried by every
    epoch from the first that says it."""

    epoch: int
    members: tuple[int, ...]
    last_step: int | None = None

    REQUIRED = ("epoch", "members")

    def to_json(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"epoch": self.epoch, "members": list(self.members)}
        if self.last_step is not None:
            rec["last_step"] = self.last_step
        return rec

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "Membership":
        epoch, members = rec.get("epoch"), rec.get("members")
        if not is_count(epoch):
            raise MessageError(f"store key {key!r}: membership epoch must be a non-negative int, got {epoch!r}")
        if not isinstance(members, list) or not all(is_count(m) for m in members):
            raise MessageError(f"store key {key!r}: membership members must be a list of replica ids, got {members!r}")
        if len(set(members)) != len(members):
            raise MessageError(f"store key {key!r}: membership members repeat a replica: {members!r}")
        last_step = rec.get("last_step")
        if last_step is not None and not is_count(last_step):
            raise MessageError(f"store key {key!r}: membership last_step must be a step (int >= 0), got {last_step!r}")
        return Membership(epoch, tuple(sorted(members)), last_step)


@dataclass(frozen=True)
class Stuck:
    """A rank whose main loop made no progress, and the step it was at."""

    rank: int
    step: int


@dataclass(frozen=True)
class NodeGroup(Record):
    """One incarnation of a replica group as one node sees its local ranks."""

    attempt: int
    ranks: int  # local ranks that have beaten (or finished)
    ready: int  # local ranks waiting to be admitted
    finished: int
    silent_s: float  # how long the most silent live local rank has been silent
    stuck: Stuck | None = None

    COUNTS: ClassVar[tuple[str, ...]] = ("attempt", "ranks", "ready", "finished")
    REQUIRED = (*COUNTS, "silent_s")

    def to_json(self) -> dict[str, Any]:
        rec = asdict(self)
        if self.stuck is None:
            del rec["stuck"]
        return rec

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "NodeGroup":
        silent = rec.get("silent_s")
        if not (
            all(f in rec for f in cls.REQUIRED)
            and all(is_count(rec[f]) for f in cls.COUNTS)
            and is_seconds(silent)
            and silent >= 0
        ):
            raise MessageError(
                f"store key {key!r}: a group needs non-negative integers {list(cls.COUNTS)} "
                f"and seconds silent_s: {rec!r:.200}"
            )
        stuck = rec.get("stuck")
        _require(
            key,
            stuck is None or (isinstance(stuck, dict) and is_int(stuck.get("rank")) and is_int(stuck.get("step"))),
            "stuck needs integers rank and step",
            stuck,
        )
        return NodeGroup(
            rec["attempt"],
            rec["ranks"],
            rec["ready"],
            rec["finished"],
            silent,
            None if stuck is None else Stuck(stuck["rank"], stuck["step"]),
        )


@dataclass(frozen=True)
class NodeMessage(Record):
    """A node agent's message, rewritten every heartbeat interval: its groups (replica -> entry), and the bytes
    of its launcher's snapshot folder as last measured (None: snapshots off, or a launcher that predates it)."""

    seq: int
    groups: dict[int, NodeGroup]
    snapshot_bytes: int | None = None

    REQUIRED = ("seq", "groups")

    def to_json(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"seq": self.seq, "groups": {str(r): g.to_json() for r, g in self.groups.items()}}
        if self.snapshot_bytes is not None:
            rec["snapshot_bytes"] = self.snapshot_bytes
        return rec

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "NodeMessage":
        _require(
            key,
            is_int(rec["seq"]) and isinstance(rec["groups"], dict),
            "seq must be an integer and groups an object",
            rec,
        )
        snapshot_bytes = rec.get("snapshot_bytes")
        _require(key, snapshot_bytes is None or is_count(snapshot_bytes), "snapshot_bytes must be an int >= 0", rec)
        groups = {}
        for replica, entry in rec["groups"].items():
            _require(
                key,
                isinstance(replica, str) and replica.isdigit() and isinstance(entry, dict),
                f"group {replica!r} is not a replica id with an object",
                entry,
            )
            try:
                groups[int(replica)] = NodeGroup.from_json(key, entry)
            except MessageError as e:
                raise MessageError(f"{e} (group {replica})") from None
        return NodeMessage(rec["seq"], groups, snapshot_bytes)


@dataclass(frozen=True)
class Report(Record):
    """A failure seen from a rank or a launcher, or a group's own leave on notice (``left``). ``suspect``
    names the failed group when the reporter knows it; a broken replicate-dim collective names none.
    ``waiting``: no collective broke, the reporter has waited long for its peers' commit votes or digests
    (a peer that died between collectives): a silent member is failed, and if nobody is silent nothing is
    retried."""

    epoch: int
    cause: str
    replica: int | None = None  # the reporter's replica group
    suspect: int | None = None
    step: int | None = None
    attempt: int | None = None  # the incarnation of ``suspect`` it is about (launcher reports)
    error: str | None = None  # the job's own error, as the same text on every replica that raises it
    time: float = 0.0  # when it was written (wall clock)
    waiting: bool = False
    left: bool = False  # ``suspect`` (the reporter's own group) leaves on notice before ``step``: no failure
    notice_s: float | None = None  # a leave's: seconds from the notice to the leave
    final: bool = False  # a launcher's: it does not restart ``suspect`` (no restarts left in its window)
    outvoted: bool = False  # ``suspect`` (the reporter's own group) was outvoted by an SDC check: a strike

    REQUIRED = ("epoch", "cause")

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "Report":
        if not is_count(rec["epoch"]):
            raise MessageError(f"store key {key!r}: epoch must be a non-negative integer, got {rec['epoch']!r}")
        for name in ("suspect", "replica", "step", "attempt"):
            value = rec.get(name)
            if value is not None and not is_count(value):
                raise MessageError(f"store key {key!r}: {name} must be a non-negative integer, got {value!r}")
        error = rec.get("error")
        _require(
            key,
            isinstance(rec["cause"], str) and (error is None or isinstance(error, str)),
            "cause and error must be strings",
            rec,
        )
        when, waiting = rec.get("time", 0.0), rec.get("waiting", False)
        _require(key, is_seconds(when), "time must be seconds", rec)
        _require(
            key,
            isinstance(waiting, bool) and not (waiting and rec.get("suspect") is not None),
            "waiting must be a boolean, and a waiting report names no suspect",
            rec,
        )
        left = rec.get("left", False)
        _require(
            key,
            isinstance(left, bool)
            and not (left and (rec.get("suspect") is None or rec.get("suspect") != rec.get("replica"))),
            "left must be a boolean, and a group leaves only on its own report (suspect = replica)",
            rec,
        )
        notice = rec.get("notice_s")
        _require(key, notice is None or (left and is_seconds(notice)), "notice_s must be a leave's seconds", rec)
        final = rec.get("final", False)
        _require(
            key,
            isinstance(final, bool) and not (final and rec.get("suspect") is None),
            "final must be a boolean, said of a suspect",
            rec,
        )
        outvoted = rec.get("outvoted", False)
        _require(
            key,
            isinstance(outvoted, bool)
            and not (outvoted and (rec.get("suspect") is None or rec.get("suspect") != rec.get("replica"))),
            "outvoted must be a boolean, said by a group of itself (suspect = replica)",
            rec,
        )
        return Report(
            rec["epoch"],
            rec["cause"],
            rec.get("replica"),
            rec.get("suspect"),
            rec.get("step"),
            rec.get("attempt"),
            error or None,
            float(when),
            waiting,
            left,
            None if notice is None else float(notice),
            final,
            outvoted,
        )


@dataclass(frozen=True)
class StepRecord(Record):
    """A committed step, as the first member to commit it wrote it and the event log shows it."""

    step: int
    epoch: int
    members: list[int]
    microbatches: list[Any]
    data_digest: str
    loss: float | None
    grad_norm: float | None
    time: float
    data_epochs: list[int] = field(default_factory=list)  # data epochs that begin at this step
    quotas: dict[str, int] = field(default_factory=dict)  # replica -> microbatches it computed
    seconds_per_microbatch: dict[str, float] = field(default_factory=dict)
    samples: Any = None  # the dataloader's windows (events of data epochs name them)
    commit_round_s: float | None = None  # the recording rank's vote to decision (None: stock mode)
    checked: list[int] = field(default_factory=list)  # the groups whose gradients of the step's SDC check agreed

    REQUIRED = ("step", "epoch", "members", "microbatches", "data_digest", "loss", "time")

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "StepRecord":
        _require(
            key,
            is_count(rec["step"])
            and is_count(rec["epoch"])
            and isinstance(rec["members"], list)
            and all(is_count(m) for m in rec["members"])
            and isinstance(rec["microbatches"], list)
            and isinstance(rec["data_digest"], str)
            and is_seconds(rec["time"]),
            "a step record needs integers step and epoch, a list of replica ids, microbatches, a digest and a time",
            rec,
        )
        data_epochs = rec.get("data_epochs", [])
        _require(
            key,
            isinstance(data_epochs, list) and all(is_count(e) for e in data_epochs),
            "data_epochs must be integers",
            rec,
        )
        commit_round_s = rec.get("commit_round_s")
        _require(key, commit_round_s is None or is_seconds(commit_round_s), "commit_round_s must be seconds", rec)
        checked = rec.get("checked", [])
        _require(
            key,
            isinstance(checked, list) and all(g in rec["members"] for g in checked),
            "checked must be members of the step",
            rec,
        )
        return StepRecord(
            rec["step"],
            rec["epoch"],
            rec["members"],
            rec["microbatches"],
            rec["data_digest"],
            rec["loss"],
            rec.get("grad_norm"),
            rec["time"],
            data_epochs,
            rec.get("quotas", {}),
            rec.get("seconds_per_microbatch", {}),
            rec.get("samples"),
            commit_round_s,
            checked,
        )


def _is_endpoint(rec: dict[str, Any]) -> bool:
    """A non-empty ``host`` string and a ``port`` in 1..65535."""
    return isinstance(rec["host"], str) and bool(rec["host"]) and is_int(rec["port"]) and 0 < rec["port"] < 65536


@dataclass(frozen=True)
class Rendezvous(Record):
    """Where the torchrun agents of one incarnation of a group that spans nodes meet (node part 0's
    host, at a port its launcher picked for that incarnation)."""

    attempt: int
    host: str
    port: int

    REQUIRED = ("attempt", "host", "port")

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "Rendezvous":
        _require(
            key,
            is_count(rec["attempt"]) and _is_endpoint(rec),
            "attempt must be an integer >= 0, host a name, port in 1..65535",
            rec,
        )
        return Rendezvous(rec["attempt"], rec["host"], rec["port"])


@dataclass(frozen=True)
class BoardAddress(Record):
    """Where the coordinator leader of a run on etcd serves the node messages (``board``)."""

    host: str
    port: int

    REQUIRED = ("host", "port")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "BoardAddress":
        _require(key, _is_endpoint(rec), "host must be a name, port in 1..65535", rec)
        return BoardAddress(rec["host"], rec["port"])


@dataclass(frozen=True)
class Candidate(Record):
    """A coordinator candidate of a run on etcd as it shows itself (``control.presence``): which process, and
    whether its node was told it goes away (``noticed``)."""

    pid: int
    host: str
    noticed: bool = False

    REQUIRED = ("pid", "host", "noticed")

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "Candidate":
        _require(
            key,
            is_count(rec["pid"]) and isinstance(rec["host"], str) and isinstance(rec["noticed"], bool),
            "pid must be an integer >= 0, host a string and noticed a boolean",
            rec,
        )
        return Candidate(rec["pid"], rec["host"], rec["noticed"])


@dataclass(frozen=True)
class Incarnation(Record):
    """An incarnation of a replica group (``attempt``) and the epoch a coordinator decision about it came with."""

    attempt: int
    epoch: int

    REQUIRED = ("attempt", "epoch")

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "Incarnation":
        _require(
            key, is_count(rec["attempt"]) and is_count(rec["epoch"]), "attempt and epoch must be integers >= 0", rec
        )
        return cls(rec["attempt"], rec["epoch"])


class Fence(Incarnation):
    """That incarnation is out: its launcher kills what is left of it."""


@dataclass(frozen=True)
class Admission(Incarnation):
    """That incarnation is a member from ``epoch`` on: its ranks take the state from a live peer, or, with
    ``resume_step`` (every group had lost its state), each loads that step's snapshot from its node's memory.
    ``holders``: the shards some admitted group lacks a copy of -> the groups that have one (rank k of a group
    missing shard k receives it from one of them); a shard not named is on every admitted group's nodes."""

    resume_step: int | None = None
    holders: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"attempt": self.attempt, "epoch": self.epoch}
        if self.resume_step is not None:
            rec["resume_step"] = self.resume_step
        if self.holders:
            rec["holders"] = {str(k): list(v) for k, v in sorted(self.holders.items())}
        return rec

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "Admission":
        base = Incarnation.from_json(key, rec)
        step = rec.get("resume_step")
        _require(key, step is None or is_count(step), "resume_step must be a step (int >= 0)", rec)
        holders = rec.get("holders", {})
        _require(
            key,
            isinstance(holders, dict)
            and (step is not None or not holders)
            and all(
                isinstance(k, str) and k.isdigit() and isinstance(v, list) and v and all(is_count(r) for r in v)
                for k, v in holders.items()
            ),
            'holders must map shards ("<k>") to non-empty lists of replica ids, and only with a resume_step',
            rec,
        )
        return cls(base.attempt, base.epoch, step, {int(k): tuple(v) for k, v in holders.items()})


@dataclass(frozen=True)
class Snapshots(Record):
    """The steps whose host-memory snapshot of its shard a restarted rank found on its node and verified,
    newest first: what the coordinator resumes from when every group lost its state."""

    steps: tuple[int, ...]

    REQUIRED = ("steps",)

    def to_json(self) -> dict[str, Any]:
        return {"steps": list(self.steps)}

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "Snapshots":
        steps = rec["steps"]
        _require(
            key,
            isinstance(steps, list) and len(steps) <= MAX_SNAPSHOTS and all(is_count(s) for s in steps),
            f"steps must be a list of at most {MAX_SNAPSHOTS} steps (ints >= 0)",
            rec,
        )
        return cls(tuple(steps))


@dataclass(frozen=True)
class Drain(Record):
    """An operator's drain of incarnation ``attempt`` of a replica group (``python -m titan_recover.drain``):
    its launcher has it leave at its next step boundary, as on its node's notice. A later incarnation (the
    group started again) is not drained."""

    attempt: int
    reason: str
    time: float  # when the operator asked (wall clock)

    REQUIRED = ("attempt", "reason", "time")

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "Drain":
        _require(
            key,
            is_count(rec["attempt"]) and isinstance(rec["reason"], str) and is_seconds(rec["time"]),
            "attempt must be an integer >= 0, reason a string and time seconds",
            rec,
        )
        return Drain(rec["attempt"], rec["reason"], float(rec["time"]))


@dataclass(frozen=True)
class Replacing(Record):
    """What the launcher of a node the run asked its scheduler for (``$TITAN_RECOVER_REPLACEMENT``, the request's
    number) found: the free replica ids it took, none when every id it could take was back already (it then leaves
    at once); ``job``: its scheduler's id for it ("" where none is known)."""

    replicas: tuple[int, ...]
    job: str

    REQUIRED = ("replicas", "job")

    def to_json(self) -> dict[str, Any]:
        return {"replicas": list(self.replicas), "job": self.job}

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "Replacing":
        replicas = rec["replicas"]
        _require(
            key,
            isinstance(replicas, list) and all(is_count(r) for r in replicas) and isinstance(rec["job"], str),
            "replicas must be a list of replica ids and job a string",
            rec,
        )
        return Replacing(tuple(replicas), rec["job"])


@dataclass(frozen=True)
class Launcher(Record):
    """One launcher process of the run (the owner of its claims); ``id`` is unique even across
    hosts and pid reuse. ``domain``: its node's failure domain ("" = unknown; absent from the JSON then, so
    a launcher without one writes the bytes it always did)."""

    launcher: str  # its id
    host: str
    pid: int
    domain: str = ""

    REQUIRED = ("launcher", "host", "pid")

    @staticmethod
    def this(domain: str = "") -> "Launcher":
        host, pid = socket.gethostname(), os.getpid()
        return Launcher(f"{host}:{pid}:{secrets.token_hex(4)}", host, pid, domain)

    @property
    def id(self) -> str:
        return self.launcher

    @property
    def key(self) -> str:
        """Where its lifeline writes its node message."""
        return keys.launcher_key(self.launcher)

    def to_json(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"launcher": self.launcher, "host": self.host, "pid": self.pid}
        if self.domain:
            rec["domain"] = self.domain
        return rec

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)  # claims compare the bytes

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "Launcher":
        domain = rec.get("domain", "")
        _require(
            key,
            isinstance(rec["launcher"], str)
            and isinstance(rec["host"], str)
            and is_int(rec["pid"])
            and isinstance(domain, str)
            and len(domain) <= MAX_DOMAIN,
            f"launcher, host and domain (at most {MAX_DOMAIN} characters) must be strings, pid an integer",
            rec,
        )
        return Launcher(rec["launcher"], rec["host"], rec["pid"], domain)

    def __str__(self) -> str:
        return f"the launcher on host {self.host} (pid {self.pid})"


@dataclass(frozen=True)
class TransferRecord(Record):
    """The state a joiner rank received: how much, how long, at which step and epoch."""

    bytes: int
    transfer_s: float
    step: int
    epoch: int

    REQUIRED = ("bytes", "transfer_s")

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "TransferRecord":
        _require(
            key, is_count(rec["bytes"]) and is_seconds(rec["transfer_s"]), "bytes and transfer_s must be numbers", rec
        )
        return TransferRecord(rec["bytes"], rec["transfer_s"], rec.get("step", 0), rec.get("epoch", 0))


@dataclass(frozen=True)
class FaultRecord(Record):
    """A fault the plan injected into a rank (detection latency is measured from its time)."""

    replica: int
    rank: int
    attempt: int
    step: int
    phase: str
    time: float = 0.0

    REQUIRED = ("time", "attempt")

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "FaultRecord":
        _require(key, is_seconds(rec["time"]) and is_count(rec["attempt"]), "time and attempt must be numbers", rec)
        return FaultRecord(
            rec.get("replica", -1),
            rec.get("rank", -1),
            rec["attempt"],
            rec.get("step", -1),
            str(rec.get("phase", "")),
            float(rec["time"]),
        )


@dataclass(frozen=True)
class Fatal(Record):
    """The run stops: every process reads why."""

    error: str

    REQUIRED = ("error",)

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "Fatal":
        return Fatal(str(rec["error"]))


@dataclass(frozen=True)
class Progress:
    """The last committed step, its epoch and its wall time."""

    step: int
    epoch: int
    time: float


@dataclass(frozen=True)
class Loss:
    """Every replica group lost its state in ``step`` at ``time`` (wall clock): the run waits for them to come
    back and resumes from host-memory snapshots; ``resume_step`` once it has (until that resume's first commit)."""

    step: int
    time: float
    groups: tuple[int, ...] = ()  # the members it took: the run waits for them to come back
    resume_step: int | None = None
    at_most: int | None = None  # a rollback past a bad device's gradients: resume from this step or an older one


JOINED, LEFT, CANCELLED, FAILED = "joined", "left", "cancelled", "failed"  # what became of a replacement request
OUTCOMES = (JOINED, LEFT, CANCELLED, FAILED)
MAX_REQUESTS = 4096  # replacement requests a saved state may hold: more is a corrupted record, not a run


@dataclass(frozen=True)
class Request:
    """One replacement request of the run (``policy.replacements``), open while ``outcome`` is None. Kept in the
    coordinator's saved state: a new leader on etcd goes on with the requests its predecessor made."""

    number: int  # the run's own count: 1, 2, ...
    replicas: tuple[int, ...]  # the ids it was made for (its node takes whichever are free)
    asked: float  # when it was made (wall clock)
    job: str | None = None  # the scheduler's id for it, once submitted
    outcome: str | None = None  # one of OUTCOMES, once it ended
    ended: float | None = None  # when that was known
    why: str = ""  # why it was cancelled, or why it ended without its scheduler's answer
    out_s: tuple[float, ...] = ()  # how long each of ``replicas`` had been out when it was made
    took: tuple[int, ...] = ()  # the ids its node took, once it joined


@dataclass
class CoordinatorState(Record):
    """The coordinator's bookkeeping: what a new leader needs that the store does not hold otherwise.

    Mutable: the coordinator core (``coordinator.core``) changes it in its transitions and the
    shell saves it whole with every epoch and every logged step.
    """

    progress: Progress | None = None  # the last committed step
    next_report: int = 1  # the first report slot not reserved when last read
    retries: int = 0  # epochs retried with the same members in the step in progress
    attempts: dict[int, int] = field(default_factory=dict)  # incarnation of each member
    admitted_epoch: dict[int, int] = field(default_factory=dict)  # epoch each member was admitted in
    joining: dict[int, int] = field(default_factory=dict)  # admitted, no step committed yet -> admission epoch
    spares: dict[int, int] = field(default_factory=dict)  # ready to join while the membership is full -> incarnation
    dropped: dict[int, int] = field(default_factory=dict)  # waiting incarnations fenced for silence -> incarnation
    down_since: dict[int, float] = field(default_factory=dict)  # failed replica, not yet replaced -> when it failed
    repairs: dict[int, tuple[int, float]] = field(
        default_factory=dict
    )  # admitted group -> (replica it replaces, since)
    unread_reports: list[int] = field(default_factory=list)  # slots below next_report reserved but not written yet
    forgotten_steps: int = 0  # the store keys of committed steps up to this one are deleted
    kept_epoch: int = 0  # the oldest epoch whose store keys (members, group rendezvous) are kept
    forgotten_reports: int = 0  # report slots up to this one are deleted
    failures: int = 0  # replica group failures so far: what the status page and the metrics count
    rejoins: int = 0  # groups back with state so far
    last_recovery_s: float | None = None  # the last failure's recovery latency
    last_downtime_s: float | None = None  # the last rejoin's downtime
    loss: Loss | None = None  # every group lost its state: waiting for them, or resumed and not committed yet
    requests: list[Request] = field(default_factory=list)  # every replacement request, in order (number i + 1 at i)
    refused: bool = False  # the scheduler refused a replacement request: no more are made
    strikes: dict[int, list[float]] = field(default_factory=dict)  # group -> when SDC checks outvoted it (wall)
    quarantined: dict[int, int] = field(default_factory=dict)  # group -> the step it was quarantined at: never back
    trusted: dict[int, int] = field(
        default_factory=dict
    )  # group -> the last step whose gradients of it a check vouched for

    REQUIRED = (
        "progress",
        "next_report",
        "retries",
        "attempts",
        "admitted_epoch",
        "joining",
        "spares",
        "dropped",
        "down_since",
        "repairs",
    )
    COUNTS: ClassVar[tuple[str, ...]] = (
        "forgotten_steps",
        "kept_epoch",
        "forgotten_reports",
        "failures",
        "rejoins",
    )  # absent: 0
    SECONDS: ClassVar[tuple[str, ...]] = ("last_recovery_s", "last_downtime_s")  # absent: none yet

    def to_json(self) -> dict[str, Any]:
        rec = asdict(self)
        rec["repairs"] = {r: list(v) for r, v in self.repairs.items()}
        return rec

    @classmethod
    def from_json(cls, key: str, rec: dict[str, Any]) -> "CoordinatorState":
        progress = rec["progress"]
        _require(
            key,
            progress is None
            or (
                isinstance(progress, dict)
                and is_int(progress.get("step"))
                and is_int(progress.get("epoch"))
                and is_seconds(progress.get("time"))
            ),
            "progress needs step, epoch, time",
            progress,
        )
        _require(
            key,
            is_int(rec["next_report"]) and rec["next_report"] >= 1 and is_int(rec["retries"]),
            "next_report and retries must be integers",
            rec,
        )
        unread = rec.get("unread_reports", [])
        _require(
            key,
            isinstance(unread, list) and all(is_int(i) and 1 <= i < rec["next_report"] for i in unread),
            "unread_reports must be report slots below next_report",
            unread,
        )
        counts = [rec.get(k, 0) for k in cls.COUNTS]
        _require(key, all(is_count(c) for c in counts), f"{list(cls.COUNTS)} must be integers >= 0", rec)
        seconds = [rec.get(k) for k in cls.SECONDS]
        _require(
            key,
            all(s is None or (is_seconds(s) and s >= 0) for s in seconds),
            f"{list(cls.SECONDS)} must be seconds >= 0",
            rec,
        )
        pair = lambda v: isinstance(v, list) and len(v) == 2 and is_int(v[0]) and is_seconds(v[1])  # noqa: E731
        incarnations, admitted_epoch, joining, spares, dropped = (
            _ids(key, rec[k], k, is_int) for k in ("attempts", "admitted_epoch", "joining", "spares", "dropped")
        )
        state = CoordinatorState(
            None if progress is None else Progress(progress["step"], progress["epoch"], progress["time"]),
            rec["next_report"],
            rec["retries"],
            incarnations,
            admitted_epoch,
            joining,
            spares,
            dropped,
            _ids(key, rec["down_since"], "down_since", is_seconds),
            {r: (v[0], v[1]) for r, v in _ids(key, rec["repairs"], "repairs", pair).items()},
            sorted(unread),
            *counts,
            *seconds,
        )
        state.loss = _loss(key, rec.get("loss"))
        requests = rec.get("requests", [])
        _require(key, isinstance(requests, list) and len(requests) <= MAX_REQUESTS, "requests must be a list", requests)
        state.requests = [_request(key, number, r) for number, r in enumerate(requests, 1)]
        _require(key, isinstance(rec.get("refused", False), bool), "refused must be true or false", rec.get("refused"))
        state.refused = rec.get("refused", False)
        times = lambda v: isinstance(v, list) and len(v) <= MAX_STRIKES and all(is_seconds(t) for t in v)  # noqa: E731
        state.strikes = _ids(key, rec.get("strikes", {}), "strikes", times)
        state.quarantined = _ids(key, rec.get("quarantined", {}), "quarantined", is_count)
        state.trusted = _ids(key, rec.get("trusted", {}), "trusted", is_count)
        return state


def _request(key: str, number: int, rec: object) -> Request:
    """The saved replacement request ``number``, checked."""
    ids = lambda v: isinstance(v, list) and all(is_count(i) for i in v)  # noqa: E731
    short = lambda v: isinstance(v, str) and len(v) <= MAX_DOMAIN  # noqa: E731
    _require(
        key,
        isinstance(rec, dict)
        and rec.get("number") == number
        and ids(rec.get("replicas"))
        and is_seconds(rec.get("asked"))
        and (rec.get("job") is None or short(rec.get("job")))
        and rec.get("outcome", None) in (None, *OUTCOMES)
        and (rec.get("ended") is None or is_seconds(rec.get("ended")))
        and short(rec.get("why", ""))
        and isinstance(rec.get("out_s", []), list)
        and all(is_seconds(s) for s in rec.get("out_s", []))
        and ids(rec.get("took", [])),
        f"replacement request {number} needs number {number}, replicas, asked and valid optional fields",
        rec,
    )
    assert isinstance(rec, dict)
    return Request(
        number,
        tuple(rec["replicas"]),
        rec["asked"],
        rec.get("job"),
        rec.get("outcome"),
        rec.get("ended"),
        rec.get("why", ""),
        tuple(rec.get("out_s", [])),
        tuple(rec.get("took", [])),
    )


def _loss(key: str, rec: object) -> Loss | None:
    if rec is None:
        return None
    _require(
        key,
        isinstance(rec, dict)
        and is_count(rec.get("step"))
        and is_seconds(rec.get("time"))
        and isinstance(rec.get("groups"), list)
        and all(is_count(g) for g in rec["groups"])
        and (rec.get("resume_step") is None or is_count(rec.get("resume_step")))
        and (rec.get("at_most") is None or is_count(rec.get("at_most"))),
        "loss needs step, time, groups and an optional resume_step and at_most",
        rec,
    )
    assert isinstance(rec, dict)
    return Loss(rec["step"], float(rec["time"]), tuple(rec["groups"]), rec.get("resume_step"), rec.get("at_most"))
