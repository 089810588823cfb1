"""One logging path: a logger per module, the handlers once per process.

Every module logs through ``log = logging.getLogger(__name__)``, so all of them sit under the
``titan_recover`` logger. Each process's entry point calls ``setup(kind)`` once (``launcher``,
``coordinator``, ``rank``, ``selftest``, ``status``, ``bench``): from then on every line of the process
goes to stdout (info; torchrun's ``--tee`` and the launcher's terminal pick it up) or stderr
(warnings and errors), prefixed ``[titan_recover <kind>]`` (ranks: ``[titan_recover]``) whichever
module logged it. A module run as ``python -m`` logs as ``__main__``: its entry point names that
logger too (``setup(kind, __name__)``).

Without ``setup`` (the package used as a library, tests calling functions in-process) nothing is
configured: the records propagate to the root logger like any library's.

A rank's lines name its replica group and rank: ``for_rank(log, replica, group_rank)``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, MutableMapping
from typing import Any, TextIO

ROOT = "titan_recover"
RANK = "rank"  # the kind whose lines carry the bare prefix
SHORT_LIST = 16  # replica groups a line lists one by one

logging.getLogger(ROOT)  # a logger, not a placeholder, from the start: whoever saves logging's state sees it


def prefix(kind: str) -> str:
    """The prefix of a process kind's lines."""
    return f"[{ROOT}]" if kind == RANK else f"[{ROOT} {kind}]"


def ranges(values: list[int]) -> str:
    """Sorted integers (steps, replica ids) by their runs: [1, 2, 3, 7] -> "1-3, 7"."""
    spans: list[list[int]] = []
    for n in values:
        if spans and spans[-1][1] == n - 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def id_list(ids: Iterable[int]) -> str:
    """Replica groups as a log line names them: the list while it is short, its spans and count beyond
    (12,500 groups listed one by one make a line of 70 kB)."""
    ids = list(ids)
    return str(ids) if len(ids) <= SHORT_LIST else f"[{ranges(ids)}] ({len(ids):,} groups)"


class _Prefix(logging.Formatter):
    """The message behind the process kind's prefix (the logger's name plays no part)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.prefix = prefix(kind)

    def format(self, record: logging.LogRecord) -> str:
        return f"{self.prefix} {record.getMessage()}"


class _Std(logging.StreamHandler):
    """Writes to ``sys.stdout`` or ``sys.stderr`` as they are when a record comes (tests swap them)."""

    def __init__(self, name: str, low: int, high: int) -> None:
        super().__init__()
        self._name = name
        self.addFilter(lambda r: low <= r.levelno < high)

    @property  # read-only: the stream of the moment
    def stream(self) -> TextIO:
        return getattr(sys, self._name)

    @stream.setter
    def stream(self, _: TextIO) -> None:
        pass


def setup(kind: str, *others: str) -> None:
    """Sends this process's records to stdout (info) and stderr (warnings, errors) behind the prefix of
    its ``kind``: those of the ``titan_recover`` logger, and of ``others`` (``__main__`` for a module run
    as ``python -m``; a package of scripts). They do not reach the root logger, which TorchTitan
    configures its own way. Called once by each entry point; a second call adds no handler (its
    ``kind`` names the lines from then on)."""
    formatter = _Prefix(kind)
    for name in dict.fromkeys((ROOT, *others)):
        if name != ROOT and name.startswith(ROOT + "."):
            continue  # the titan_recover logger's handlers already have its records
        logger = logging.getLogger(name)
        ours = [h for h in logger.handlers if isinstance(h, _Std)]
        if not ours:
            ours = [
                _Std("stdout", logging.DEBUG, logging.WARNING),
                _Std("stderr", logging.WARNING, logging.CRITICAL + 1),
            ]
            for handler in ours:
                logger.addHandler(handler)
        for handler in ours:
            handler.setFormatter(formatter)
        logger.setLevel(logging.INFO)
        logger.propagate = False


class _Rank(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        extra = self.extra or {}
        return f"replica {extra['replica']} rank {extra['group_rank']}: {msg}", kwargs


def for_rank(logger: logging.Logger, replica: int, group_rank: int) -> logging.LoggerAdapter:
    """``logger`` with ``replica {replica} rank {group_rank}: `` before each message."""
    return _Rank(logger, {"replica": replica, "group_rank": group_rank})
