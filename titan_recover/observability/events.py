"""The JSONL event log, one JSON object per line, one file per node in ``{dump_folder}``:
``recover_events.jsonl``, or ``recover_events.<node>.jsonl`` where ``$TITAN_RECOVER_NODE``
names the node (a multi-node run). A new run moves the run before's files to ``previous/<n>``
(``rotate_events``).

A node's processes (coordinator, trainers) append to its file, each event with one
``os.write`` on an ``O_APPEND`` descriptor, so their lines never interleave. Appends from
several hosts to one file are not atomic on NFS: no two nodes share a file, and readers
merge every node's file in the folder (``event_files``, ``read_log``).

Lines are written at least once: a coordinator leader that loses its lease between its
confirmation and its write may log a step its successor logs too. Readers therefore count
each step once (the first line wins) and skip a line that is not an event (cut short by a
killed writer), counting both.

Nothing the log cannot write stops the run: while its folder is full, failing, removed or
read-only, a process keeps its events in memory (up to ``PENDING_MAX_BYTES``, the oldest dropped
past it, counted), says so on stderr once per ``REPORT_EVERY_S``, and writes them in order once it
can, then logs an ``events_delayed`` event with the counts.
"""

from __future__ import annotations

import errno
import glob
import heapq
import json
import logging
import os
import re
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

EVENTS_FILE = "recover_events.jsonl"
RECOVERY_PHASES = ("detect", "abort", "reform", "first_good_step")
"""A recovery's phases, timed from the fault, in order: the verdict published, the survivors'
collectives torn down, re-formed in the new epoch, and the first step summed there (the self-test's
names, for every report of where a recovery's time went)."""
PENDING_MAX_BYTES = 16 * 2**20  # what one process keeps of an event log it cannot write (a step event: ~1 KiB)
REPORT_EVERY_S = 30.0  # how often a process says that it cannot write its event log
PREVIOUS_DIR = "previous"  # in the dump folder: earlier runs' event logs, one numbered folder each
KEEP_PREVIOUS = 10  # how many earlier runs' logs a dump folder keeps (a step event: ~1 KiB per node)
NODE_ENV = "TITAN_RECOVER_NODE"  # this node's name in a multi-node run: its processes log to their own file
_NODE_NAME = re.compile(r"[A-Za-z0-9_-]+")
log = logging.getLogger(__name__)


def events_path(dump_folder: str) -> str:
    """This node's event log: ``$TITAN_RECOVER_NODE`` names it, if set."""
    node = os.environ.get(NODE_ENV)
    if node is None:
        return os.path.join(dump_folder, EVENTS_FILE)
    if not _NODE_NAME.fullmatch(node):
        raise ValueError(
            f"{NODE_ENV}={node!r} cannot name this node's event log: use letters, digits, '-' and '_' only (e.g. node1)"
        )
    return os.path.join(dump_folder, f"recover_events.{node}.jsonl")


def event_files(dump_folder: str) -> list[str]:
    """Every node's event log in the folder: the unnamed one first, then the named ones by name."""
    plain = os.path.join(dump_folder, EVENTS_FILE)
    named = sorted(glob.glob(os.path.join(glob.escape(dump_folder), "recover_events.*.jsonl")))
    return ([plain] if os.path.exists(plain) else []) + named


def rotate_events(dump_folder: str, keep: int = KEEP_PREVIOUS) -> str | None:
    """Starts a new run's event log: every node's file of the run before (a requeued or resumed job's
    first part, or an earlier run) moves, under its own name, to ``previous/<n>`` (n one more than the
    last; ``event_files`` of it reads that run), and only the ``keep`` newest such folders are kept.
    Readers of the dump folder never take them for another node's log. A launcher joining a run
    (another node, a replacement) only appends. The folder they moved to, or None when there were none."""
    files = event_files(dump_folder)
    if not files:
        return None
    previous = os.path.join(dump_folder, PREVIOUS_DIR)
    numbers = sorted(int(n) for n in os.listdir(previous) if n.isdigit()) if os.path.isdir(previous) else []
    folder = os.path.join(previous, str(numbers[-1] + 1 if numbers else 1))
    os.makedirs(folder)
    for path in files:
        os.rename(path, os.path.join(folder, os.path.basename(path)))
    for old in numbers[: max(0, len(numbers) + 1 - keep)]:
        shutil.rmtree(os.path.join(previous, str(old)), ignore_errors=True)
    return folder


@dataclass
class Backlog:
    """Events not written yet, in order, and what became of the earlier ones (a pure queue: the writer is
    ``EventLog``). A full disk may take a line's first bytes only: that line is written again, whole, and
    its cut prefix (never JSON) is a line readers skip; one that lacks only its newline counts as written."""

    max_bytes: int = PENDING_MAX_BYTES
    lines: deque[bytes] = field(default_factory=deque)
    nbytes: int = 0
    delayed: int = 0  # events written later than emitted, since the log's last failure
    dropped: int = 0  # ...and dropped, the oldest first, past ``max_bytes``
    since: float | None = None  # when the log became unwritable (None: writable)

    def add(self, line: bytes) -> None:
        self.lines.append(line)
        self.nbytes += len(line)
        while self.nbytes > self.max_bytes and len(self.lines) > 1:
            self.nbytes -= len(self.lines.popleft())
            self.dropped += 1

    def wrote(self, count: int) -> None:
        """``count`` bytes of the first line reached the file."""
        if count < len(self.lines[0]) - 1:
            return  # a cut prefix: the line waits, whole
        self.nbytes -= len(self.lines.popleft())
        self.delayed += self.since is not None


class EventLog:
    """Appends events to this node's event log; what it cannot write waits in a ``Backlog``."""

    def __init__(self, dump_folder: str) -> None:
        self.folder = dump_folder
        self.path = events_path(dump_folder)
        self.backlog = Backlog()
        self._fd: int | None = None
        self._reported = 0.0
        self._error = ""

    def _open(self) -> int:
        if self._fd is not None and os.fstat(self._fd).st_nlink == 0:  # removed (its folder too): lines would vanish
            self._reopen()
        if self._fd is None:
            os.makedirs(self.folder, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        return self._fd

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, **fields}
        record.setdefault("time", time.time())
        self.backlog.add((json.dumps(record, sort_keys=True) + "\n").encode())
        self.flush()
        return record

    def flush(self) -> bool:
        """Writes what waits, in order; False where some still waits (the folder cannot take it yet)."""
        backlog = self.backlog
        while backlog.lines:
            line = backlog.lines[0]
            try:
                fd = self._open()
                lead = self._lead(fd)
                count = os.write(fd, lead + line) - len(lead)
            except OSError as e:
                self._failed(e)
                return False
            backlog.wrote(count)
            if count < len(line):  # the disk took a part of it: it is full
                self._failed(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
                return False
        if backlog.since is not None:
            self._recovered()
        return True

    def _lead(self, fd: int) -> bytes:
        """A newline to put first, after a write failed here, where the file does not end in one: a line cut
        short by the full disk (this process's, or another's of the node) must not swallow this one. Only
        then: while other processes append, the last byte is a race (a write still being copied)."""
        if self.backlog.since is None:
            return b""
        size = os.fstat(fd).st_size
        return b"\n" if size and os.pread(fd, 1, size - 1) != b"\n" else b""

    def _failed(self, error: OSError) -> None:
        backlog = self.backlog
        if backlog.since is None:
            backlog.since = time.time()
        if isinstance(error, FileNotFoundError) or error.errno in (errno.ESTALE, errno.EBADF):
            self._reopen()  # the folder or file went away: made again at the next try
        self._error = f"{os.strerror(error.errno) if error.errno else error}"
        now = time.monotonic()
        if now - self._reported >= REPORT_EVERY_S:
            self._reported = now
            log.warning(
                f"cannot write the event log in {self.folder}: {self._error}; {len(backlog.lines)} events "
                f"({backlog.nbytes / 2**10:.0f} KiB) kept in memory, written once it can be"
                + (
                    f", {backlog.dropped} of the oldest dropped past {backlog.max_bytes >> 20} MiB"
                    if backlog.dropped
                    else ""
                )
                + "; the training goes on"
            )

    def _reopen(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def _recovered(self) -> None:
        backlog = self.backlog
        delayed, dropped, since = backlog.delayed, backlog.dropped, backlog.since or time.time()
        backlog.delayed = backlog.dropped = 0
        backlog.since = None
        self._reported = 0.0
        late = time.time() - since
        log.warning(
            f"the event log in {self.folder} is written again: {delayed} events written up to {late:.0f}s late"
            + (f", {dropped} dropped" if dropped else "")
        )
        self.emit("events_delayed", pid=os.getpid(), delayed=delayed, dropped=dropped, seconds=round(late, 1))

    def pending(self) -> dict[str, Any]:
        """What waits to be written (the status page's and /metrics' figures)."""
        backlog = self.backlog
        return {
            "events": len(backlog.lines),
            "bytes": backlog.nbytes,
            "dropped": backlog.dropped,
            "since": backlog.since,
            "folder": self.folder,
            "error": self._error if backlog.since is not None else "",
        }

    def step(self, record: dict[str, Any]) -> None:
        """A committed step, preceded by the data epochs it starts (see ``order.epochs_started``)."""
        for epoch in record.get("data_epochs", ()):
            self.emit("data_epoch", step=record["step"], epoch=epoch, samples=record.get("samples"))
        self.emit("step", **{k: v for k, v in record.items() if k not in ("data_epochs", "samples")})

    def close(self) -> None:
        """Writes what waits one last time; what still cannot be written is said and left."""
        if not self.flush():
            backlog = self.backlog
            log.error(
                f"the event log in {self.folder} could not be written since "
                f"{time.strftime('%H:%M:%S', time.localtime(backlog.since))} ({self._error}): its last "
                f"{len(backlog.lines)} events are lost with this process"
                + (f", and {backlog.dropped} dropped before" if backlog.dropped else "")
                + "; the run's record ends before them"
            )
        self._reopen()


@dataclass
class Log:
    """Events read back from one or more files, each step once."""

    events: list[dict[str, Any]]
    files: list[str]
    skipped: list[str] = field(default_factory=list)  # "path:line: why" of each line that is no event
    duplicates: list[dict[str, Any]] = field(default_factory=list)  # a step's lines logged again, dropped
    undone: list[dict[str, Any]] = field(default_factory=list)  # lines of steps a resume from memory computed again


def _parse(line: str) -> dict[str, Any] | str:
    """The event on a line, or why it is none."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return f"not JSON ({e})"
    if not isinstance(record, dict) or not isinstance(record.get("event"), str):
        return "not an event object"
    if record["event"] in ("step", "data_epoch") and type(record.get("step")) is not int:
        return "a step event without an integer step"
    if type(record.get("time", 0.0)) not in (int, float):
        return "time is not a number"
    return record


def _read_file(path: str, skipped: list[str]) -> list[dict[str, Any]]:
    events = []
    with open(path, errors="replace") as f:  # a torn write can leave bytes that are not UTF-8
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            parsed = _parse(line)
            if isinstance(parsed, str):
                skipped.append(f"{path}:{lineno}: {parsed}")
            else:
                events.append(parsed)
    return events


def _once(event: dict[str, Any]) -> tuple[Any, ...] | None:
    """What makes an event one of a kind logged once per run: a step, and the data epochs it starts."""
    if event["event"] == "step":
        return "step", event["step"]
    if event["event"] == "data_epoch":
        return "data_epoch", event["step"], event.get("epoch")
    return None


UNDONE = ("step", "data_epoch", "param_digest")
"""Events of one step: a resume from host memory (``resuming``, back to its ``step``) undoes those of later steps."""


def undo_resumed(events: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(kept, undone): each ``resuming`` event undoes the lines of the steps after its ``step`` logged before it
    (those steps are computed and logged again after it; the second lines count)."""
    kept: list[dict[str, Any]] = []
    undone: list[dict[str, Any]] = []
    for event in events:
        if event["event"] == "resuming" and type(event.get("step")) is int:
            back = event["step"]
            undone += [e for e in kept if e["event"] in UNDONE and e.get("step", -1) > back]
            kept = [e for e in kept if not (e["event"] in UNDONE and e.get("step", -1) > back)]
        kept.append(event)
    return kept, undone


def read_log(*paths: str) -> Log:
    """The events of these files, merged by time (each file's own order kept); a line that is no
    event is skipped, and a step logged again is dropped (the first line wins), both counted. A
    ``resuming`` event moves the lines of the steps it computes again to ``undone`` first (``undo_resumed``)."""
    out = Log([], list(paths))
    seen: set[tuple[Any, ...]] = set()
    per_file = [_read_file(path, out.skipped) for path in paths]
    merged, out.undone = undo_resumed(heapq.merge(*per_file, key=lambda e: e.get("time", 0.0)))
    for event in merged:
        key = _once(event)
        if key is not None and key in seen:
            out.duplicates.append(event)
            continue
        out.events.append(event)
        if key is not None:
            seen.add(key)
    if out.skipped:
        log.warning(f"{len(out.skipped)} line(s) that are no event skipped, the first {out.skipped[0]}")
    return out


class Tail:
    """Follows event logs as the run writes them (the status page's source): ``files`` names them
    (every node's in a folder: ``lambda: event_files(folder)``), and each ``read`` returns the events
    appended since the last, each step once, merged by time. A line still being written (no newline
    yet) waits for the next read; a file that appears later (another node's) is read from its start."""

    def __init__(self, files: Callable[[], list[str]]) -> None:
        self.files = files
        self.offsets: dict[str, int] = {}
        self.seen: set[tuple[Any, ...]] = set()
        self.skipped = 0  # lines that are no event

    def _new_lines(self, path: str) -> list[str]:
        try:
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offsets[path] = self.offsets.get(path, 0) + end
        return data[:end].decode(errors="replace").splitlines()

    def read(self) -> list[dict[str, Any]]:
        out = []
        for path in self.files():
            for line in self._new_lines(path):
                parsed = _parse(line) if line.strip() else "blank"
                if isinstance(parsed, str):
                    self.skipped += line.strip() != ""
                    continue
                if parsed["event"] == "resuming" and type(parsed.get("step")) is int:
                    back = parsed["step"]  # the steps after it are committed again: their new lines count
                    self.seen = {k for k in self.seen if k[1] <= back}
                key = _once(parsed)
                if key is not None:
                    if key in self.seen:
                        continue
                    self.seen.add(key)
                out.append(parsed)
        return sorted(out, key=lambda e: e.get("time", 0.0))


def read_events(path: str) -> list[dict[str, Any]]:
    """The events of one file, each step once (see ``read_log``)."""
    return read_log(path).events


def of_kind(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The events named ``kind``, in their order."""
    return [e for e in events if e["event"] == kind]


def logged_steps(path: str) -> set[int]:
    """The steps logged in this file or any other node's beside it (a new coordinator leader
    logs none of them again)."""
    files = [p for p in sorted({path, *event_files(os.path.dirname(path))}) if os.path.exists(p)]
    return {e["step"] for e in read_log(*files).events if e["event"] == "step"}
