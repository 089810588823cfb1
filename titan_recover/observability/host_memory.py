"""Each node's host-memory snapshot folder as its node messages report it (``NodeMessage.snapshot_bytes``): the
figures the coordinator logs as ``host_memory`` events, which the summary and the status page read. Pure."""

from dataclasses import dataclass, field
from typing import Any

GROWTH = 1.25  # a node's figure is logged again once it passes this times the last one logged
MIN_LOGGED = 1 << 20  # ... and only from this many bytes on, until the run's end


def node_of(key: str) -> str:
    """The node a launcher's message key names: ``launcher/<host>:<pid>:<token>`` -> ``<host>:<pid>``. One
    launcher per node, and its snapshot folder is its own: a launcher started again on the node is a new one."""
    launcher = key.split("/", 1)[-1]
    return ":".join(launcher.split(":")[:2])


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@dataclass
class Peaks:
    """Each node's latest figure, the run's peak, and what the event log holds of it.

    ``observe`` says to log a figure once it passes ``GROWTH`` times the last logged one (the first from
    ``MIN_LOGGED`` bytes), and ``unlogged`` at the run's end each peak not logged exactly. Bounded: at most
    2 + log_GROWTH(peak / MIN_LOGGED) events per node (55 for a 200 GB folder), in practice two or three, as
    a folder fills to (keep + 1) copies of its shards and stays there; the summary's peak is exact for a run
    that ended in order, and within ``GROWTH`` of it where its coordinator died first."""

    latest: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    logged: dict[str, int] = field(default_factory=dict)

    def observe(self, node: str, figure: int) -> bool:
        """Takes a node's new figure; whether to log it now (it counts as logged from here)."""
        self.latest[node] = figure
        self.peak[node] = max(self.peak.get(node, 0), figure)
        last = self.logged.get(node)
        if figure < MIN_LOGGED or (last is not None and figure <= last * GROWTH):
            return False
        self.logged[node] = figure
        return True

    def unlogged(self) -> dict[str, int]:
        """The peaks the event log does not hold yet (above 0): what the run's end logs."""
        return {n: p for n, p in sorted(self.peak.items()) if p > self.logged.get(n, 0)}


def figure(event: dict[str, Any]) -> tuple[str, int] | None:
    """A ``host_memory`` event's node and bytes; None for a line that lacks them."""
    node, size = event.get("node"), event.get("bytes")
    if event.get("event") != "host_memory" or not isinstance(node, str) or type(size) is not int or size < 0:
        return None
    return node, size


def peaks_of(events: list[dict[str, Any]]) -> dict[str, int]:
    """Each node's peak as the ``host_memory`` events say it, by node."""
    peaks: dict[str, int] = {}
    for event in events:
        found = figure(event)
        if found is not None:
            peaks[found[0]] = max(peaks.get(found[0], 0), found[1])
    return dict(sorted(peaks.items()))
