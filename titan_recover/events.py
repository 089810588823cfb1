"""The JSONL event log: ``{dump_folder}/recover_events.jsonl``, one JSON object per line.

Several processes (coordinator, trainers, launcher) append to the same file. Each
event is written with one ``os.write`` on an ``O_APPEND`` descriptor, so lines from
different processes never interleave.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator

EVENTS_FILE = "recover_events.jsonl"


def events_path(dump_folder: str) -> str:
    return os.path.join(dump_folder, EVENTS_FILE)


class EventLog:
    """Appends events to the run's event log."""

    def __init__(self, dump_folder: str) -> None:
        os.makedirs(dump_folder, exist_ok=True)
        self.path = events_path(dump_folder)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, **fields}
        record.setdefault("time", time.time())
        os.write(self._fd, (json.dumps(record, sort_keys=True) + "\n").encode())
        return record

    def step(self, record: dict[str, Any]) -> None:
        """A committed step, preceded by the data epochs it starts (see ``order.epochs_started``)."""
        for epoch in record.get("data_epochs", ()):
            self.emit("data_epoch", step=record["step"], epoch=epoch, samples=record.get("samples"))
        self.emit("step", **{k: v for k, v in record.items() if k not in ("data_epochs", "samples")})

    def close(self) -> None:
        os.close(self._fd)


def read_events(path: str) -> Iterator[dict[str, Any]]:
    """Yields the events of a log; a line that is not a JSON object is an error naming it."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e})") from e
            if not isinstance(record, dict) or "event" not in record:
                raise ValueError(f"{path}:{lineno}: not an event object")
            yield record


def logged_steps(path: str) -> set[int]:
    """The steps a log already holds (a new coordinator leader logs none of them again);
    a line cut short by a killed writer is skipped."""
    steps: set[int] = set()
    if not os.path.exists(path):
        return steps
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("event") == "step" and isinstance(record.get("step"), int):
                steps.add(record["step"])
    return steps
