"""One logger per process kind, on the standard ``logging`` module.

Every process of a run logs through ``logging.getLogger("titan_recover.<kind>")`` with the
prefix ``[titan_recover <kind>]`` (ranks: ``[titan_recover]``), to stdout, where torchrun's
``--tee`` and the launcher's terminal pick it up; warnings and errors go to stderr.
"""

import logging
import sys
from typing import TextIO

ROOT = "titan_recover"
KINDS = ("launcher", "coordinator", "rank", "selftest")


class _Prefix(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        kind = record.name.removeprefix(ROOT).lstrip(".")
        prefix = f"[{ROOT} {kind}]" if kind and kind != "rank" else f"[{ROOT}]"
        return f"{prefix} {record.getMessage()}"


class _Std(logging.StreamHandler):
    """Writes to ``sys.stdout`` or ``sys.stderr`` as they are when a record comes (tests swap them)."""

    def __init__(self, name: str, low: int, high: int) -> None:
        super().__init__()
        self._name = name
        self.setFormatter(_Prefix())
        self.addFilter(lambda r: low <= r.levelno < high)

    @property  # read-only: the stream of the moment
    def stream(self) -> TextIO:
        return getattr(sys, self._name)

    @stream.setter
    def stream(self, _: TextIO) -> None:
        pass


def setup() -> None:
    """Sends this process's titan_recover records to stdout (info) and stderr (warnings, errors),
    once; records do not reach the root logger, which TorchTitan configures its own way."""
    root = logging.getLogger(ROOT)
    if root.handlers:
        return
    root.setLevel(logging.INFO)
    root.propagate = False
    root.addHandler(_Std("stdout", logging.DEBUG, logging.WARNING))
    root.addHandler(_Std("stderr", logging.WARNING, logging.CRITICAL + 1))


def get(kind: str) -> logging.Logger:
    """The logger of a process kind (one of ``KINDS``), set up on first use."""
    if kind not in KINDS:
        raise ValueError(f"unknown process kind {kind!r}; one of {KINDS}")
    setup()
    return logging.getLogger(f"{ROOT}.{kind}")
