"""What the status page shows, folded from the event log and the control store: pure, no I/O.

``RunHistory`` takes the run's events as they are appended (``events.Tail``) and keeps what
the page plots and lists; ``snapshot`` joins it with ``Live``, what the store says now (the
saved coordinator state and the node messages), into the JSON of ``/status.json``. A run
read back from its event files alone (``python -m titan_recover.status --events``) has no
``Live``: its groups' states come from the events, with no heartbeat ages.

A group's state, in this order: ``joining`` (admitted, no step committed with it yet), ``spare``
(ready outside the membership), ``live`` (a member), ``restarting`` (out of the membership, a
newer incarnation started), ``left`` (out of the membership on its node's notice, no newer incarnation
yet), ``fenced`` (failed, no newer incarnation yet).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from titan_recover.observability import host_memory, phases

STATES = ("live", "fenced", "restarting", "joining", "spare", "left")
MAX_POINTS = 1500  # plotted points per series: a long run's history is sampled down to this
RATE_STEPS = 10  # steps/s over this many latest steps
RECENT = 50  # failures, leaves and rejoins listed (newest)
PHASE_EVENTS = frozenset({"failure", "recovered", "recovery_moments", "group_started", "admitted", "rejoined"})


@dataclass(frozen=True)
class LiveGroup:
    """One replica group's newest incarnation as the node messages show it."""

    incarnation: int
    nodes: tuple[str, ...]
    heartbeat_age_s: float


@dataclass(frozen=True)
class Live:
    """The control store now: the coordinator's saved bookkeeping (``protocol.CoordinatorState``
    as JSON; None before its first save), the groups in the node messages and each node's snapshot
    folder bytes (``host_memory.node_of`` -> bytes; only nodes with snapshots on)."""

    state: dict[str, Any] | None
    groups: dict[int, LiveGroup] = field(default_factory=dict)
    snapshot_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class _Group:
    incarnation: int = 0
    nodes: tuple[str, ...] = ()
    failed_at: float | None = None  # the last failure
    failed_incarnation: int = -1  # ... of this incarnation
    started_at: float = 0.0  # the newest incarnation's start
    admitted_at: float | None = None  # the last admission
    joining: bool = False  # admitted, no step committed with it yet
    spare: bool = False  # ready, waiting outside the membership
    left: bool = False  # its last incarnation left on notice (not a failure)


def _sample(n: int) -> list[int]:
    """Indexes of at most ``MAX_POINTS`` of ``n`` points, evenly spread, the last one kept."""
    if n <= MAX_POINTS:
        return list(range(n))
    stride = n / MAX_POINTS
    return sorted({int(i * stride) for i in range(MAX_POINTS)} | {n - 1})


class RunHistory:
    """The run so far, from its events (fed in the order ``events.Tail`` reads them)."""

    def __init__(
        self,
        replicas: int = 0,
        replica_ids: int = 0,
        steps: int | None = None,
        tokens_per_step: int | None = None,
        precision: str | None = None,
    ) -> None:
        """The run's shape, from its config; a run read from its events alone takes it from its
        ``run_config`` event."""
        self.groups: dict[int, _Group] = {}
        self.members: list[int] = []
        self.run_id = ""  # the run's public id, as its run_config event says
        self._configure(replicas, replica_ids, steps, tokens_per_step, precision)
        self.steps: list[int] = []  # committed steps in order, with their time, loss and live groups
        self.times: list[float] = []
        self.losses: list[float | None] = []
        self.live: list[int] = []
        self.quotas: dict[str, int] = {}  # the last step's microbatches per replica
        self.failures: list[dict[str, Any]] = []
        self.leaves: list[dict[str, Any]] = []
        self.rejoins: list[dict[str, Any]] = []
        self.recovery_s: list[float] = []
        self.phase_events: list[dict[str, Any]] = []  # what ``phases.recoveries`` reads: a few per failure
        self._recoveries: tuple[int, list[dict[str, Any]]] = (0, [])  # for how many phase events, and what it gave
        self.snapshot_peaks: dict[str, int] = {}  # node -> its largest snapshot bytes, logged or read in the store
        self.digest_steps: set[int] = set()
        self.mismatches = 0
        self.sdc_checks = 0  # steps committed with an SDC check (sdc_checked events)
        self.sdc_mismatches = 0
        self.quarantined: dict[int, int] = {}  # replica -> the step it was quarantined at
        self.leader: dict[str, Any] | None = None
        self.fatal: str | None = None
        self.started: float | None = None
        self.updated: float | None = None

    def _configure(
        self, replicas: int, replica_ids: int, steps: int | None, tokens_per_step: int | None, precision: str | None
    ) -> None:
        self.steps_total = steps
        self.tokens_per_step, self.precision = tokens_per_step, precision
        for r in range(replica_ids):
            self.groups.setdefault(r, _Group(spare=r >= replicas))
        self.members = self.members or list(range(replicas))

    def _on_run_config(self, e: dict[str, Any], t: float) -> None:
        self.run_id = str(e.get("run", ""))
        fields = ("replicas", "replica_ids", "steps", "tokens_per_step")
        if all(type(e.get(k)) is int and e[k] >= 0 for k in fields):
            self._configure(e["replicas"], e["replica_ids"], e["steps"], e["tokens_per_step"], str(e.get("precision")))

    def add(self, event: dict[str, Any]) -> None:
        kind, t = event["event"], event.get("time", 0.0)
        self.started = t if self.started is None else min(self.started, t)
        self.updated = t if self.updated is None else max(self.updated, t)
        handler = getattr(self, f"_on_{kind}", None)
        if handler is not None:
            handler(event, t)
        if kind in PHASE_EVENTS:
            self.phase_events.append(event)

    def recoveries(self) -> list[dict[str, Any]]:
        """``phases.recoveries`` of the events so far, read again only once a phase event arrived (each
        refresh of the page asks; reading them is quadratic in the failures)."""
        if self._recoveries[0] != len(self.phase_events):
            self._recoveries = (len(self.phase_events), phases.recoveries(self.phase_events))
        return self._recoveries[1]

    def _group(self, event: dict[str, Any]) -> _Group | None:
        """The group an event names (one not known yet is added: a run read without its config)."""
        replica = event.get("replica")
        if type(replica) is not int or not 0 <= replica < 100_000:
            return None
        return self.groups.setdefault(replica, _Group())

    def _on_step(self, e: dict[str, Any], t: float) -> None:
        at = bisect.bisect(self.steps, e["step"])  # files merge by time, roughly: keep steps in order
        loss = e.get("loss")
        self.steps.insert(at, e["step"])
        self.times.insert(at, t)
        self.losses.insert(at, loss if isinstance(loss, (int, float)) else None)
        members: list[Any] = e["members"] if isinstance(e.get("members"), list) else []
        self.live.insert(at, len(members))
        if at == len(self.steps) - 1:
            self.members = members
            self.quotas = e["quotas"] if isinstance(e.get("quotas"), dict) else {}
            for r in members:  # a step committed with it: it holds the run's state
                if type(r) is int:
                    self.groups.setdefault(r, _Group()).joining = False

    def _on_resuming(self, e: dict[str, Any], t: float) -> None:
        """A resume from host memory went back to ``step``: the steps after it are committed again."""
        if type(e.get("step")) is int:
            keep = bisect.bisect(self.steps, e["step"])
            del self.steps[keep:], self.times[keep:], self.losses[keep:], self.live[keep:]
            self.digest_steps = {s for s in self.digest_steps if s <= e["step"]}

    def _on_failure(self, e: dict[str, Any], t: float) -> None:
        group = self._group(e)
        if group is not None:
            group.failed_at, group.failed_incarnation, group.joining, group.spare = t, group.incarnation, False, False
        detected = e.get("detected")
        self.failures.append(
            {
                "replica": e.get("replica"),
                "step": e.get("step"),
                "cause": str(e.get("cause", "")),
                "time": t,
                "clock": e.get("clock"),
                "detection_s": detected - t if isinstance(detected, (int, float)) else None,
                "recovery_s": None,
            }
        )

    def _on_left(self, e: dict[str, Any], t: float) -> None:
        group = self._group(e)
        if group is not None:
            group.failed_at, group.failed_incarnation, group.joining, group.spare = t, group.incarnation, False, False
            group.left = True
        if isinstance(e.get("replica"), int) and e["replica"] in self.members:
            self.members = [m for m in self.members if m != e["replica"]]
        self.leaves.append({k: e.get(k) for k in ("replica", "step", "reason", "notice_s")} | {"time": t})

    def _on_recovered(self, e: dict[str, Any], t: float) -> None:
        if isinstance(e.get("members"), list):
            self.members = e["members"]
        latency = e.get("latency_s")
        if isinstance(latency, (int, float)):
            self.recovery_s.append(latency)
            for failure in self.failures:
                if failure["recovery_s"] is None and failure["step"] == e.get("step"):
                    failure["recovery_s"] = latency

    def _on_group_started(self, e: dict[str, Any], t: float) -> None:
        group = self._group(e)
        incarnation = e.get("attempt")
        if group is None or type(incarnation) is not int or incarnation < group.incarnation:
            return
        same = incarnation == group.incarnation
        nodes = group.nodes if same and group.started_at else ()  # a group's parts, one per node
        group.incarnation, group.started_at = incarnation, t
        group.nodes = tuple(sorted({*nodes, str(e.get("host", "?"))}))

    def _on_admitted(self, e: dict[str, Any], t: float) -> None:
        group = self._group(e)
        if group is not None:
            group.admitted_at, group.joining, group.spare = t, True, False
            if e["replica"] not in self.members:
                self.members = sorted([*self.members, e["replica"]])

    def _on_rejoined(self, e: dict[str, Any], t: float) -> None:
        group = self._group(e)
        if group is not None:
            group.joining = False
        self.rejoins.append(
            {k: e.get(k) for k in ("replica", "step", "downtime_s", "bytes", "transfer_s", "replaces")} | {"time": t}
        )

    def _on_spare_ready(self, e: dict[str, Any], t: float) -> None:
        group = self._group(e)
        if group is not None:
            group.spare = True

    def _on_spare_lost(self, e: dict[str, Any], t: float) -> None:
        group = self._group(e)
        if group is not None:
            group.spare, group.failed_at, group.failed_incarnation = False, t, group.incarnation

    def _on_param_digest(self, e: dict[str, Any], t: float) -> None:
        if type(e.get("step")) is int:
            self.digest_steps.add(e["step"])

    def _on_param_digest_mismatch(self, e: dict[str, Any], t: float) -> None:
        self.mismatches += 1

    def _on_sdc_checked(self, e: dict[str, Any], t: float) -> None:
        self.sdc_checks += 1

    def _on_sdc_mismatch(self, e: dict[str, Any], t: float) -> None:
        self.sdc_mismatches += 1

    def _on_quarantined(self, e: dict[str, Any], t: float) -> None:
        if self._group(e) is not None and type(e.get("step")) is int:
            self.quarantined[e["replica"]] = e["step"]

    def _on_host_memory(self, e: dict[str, Any], t: float) -> None:
        found = host_memory.figure(e)
        if found is not None:
            node, size = found
            self.snapshot_peaks[node] = max(self.snapshot_peaks.get(node, 0), size)

    def snapshot_memory(self, live: Live | None) -> list[dict[str, Any]]:
        """Each node's snapshot folder: its bytes now (None: not in the store, e.g. a finished run's events read
        alone) and the run's peak, the largest of what the events logged and the bytes this page read (kept: the
        coordinator logs a figure only once it grew by a margin, and a peak shown never goes down)."""
        now = live.snapshot_bytes if live is not None else {}
        for n, size in now.items():
            self.snapshot_peaks[n] = max(self.snapshot_peaks.get(n, 0), size)
        return [
            {"node": n, "bytes": now.get(n), "peak_bytes": self.snapshot_peaks[n]} for n in sorted(self.snapshot_peaks)
        ]

    def _on_leader(self, e: dict[str, Any], t: float) -> None:
        self.leader = {"host": e.get("host"), "pid": e.get("pid")}

    def _on_fatal(self, e: dict[str, Any], t: float) -> None:
        self.fatal = str(e.get("error", ""))

    # ---- the snapshot -------------------------------------------------------------------

    def state_of(self, replica: int, live: Live | None) -> str:
        """The group's state (see the module docstring); the store's bookkeeping, when there is
        one, says who is joining or waiting as a spare."""
        group = self.groups[replica]
        if replica in self.quarantined:
            return "quarantined"
        saved = live.state if live is not None else None
        joining = str(replica) in saved.get("joining", {}) if saved is not None else group.joining
        spare = str(replica) in saved.get("spares", {}) if saved is not None else group.spare
        if joining:
            return "joining"
        if spare and replica not in self.members:
            return "spare"
        failed = group.failed_at is not None and group.failed_at > (group.admitted_at or 0.0)
        if replica in self.members and not failed:
            return "live"
        newest = live.groups[replica].incarnation if live is not None and replica in live.groups else group.incarnation
        if group.started_at > (group.failed_at or 0.0) or newest > group.failed_incarnation:
            return "restarting"
        return "left" if group.left else "fenced"

    def _rate(self) -> float | None:
        n = min(len(self.steps), RATE_STEPS + 1)
        if n < 2 or self.times[-1] <= self.times[-n]:
            return None
        return (self.steps[-1] - self.steps[-n]) / (self.times[-1] - self.times[-n])

    def run_state(self) -> str:
        if self.fatal is not None:
            return "failed"
        if not self.steps:
            return "starting"
        return "finished" if self.steps_total is not None and self.steps[-1] >= self.steps_total else "running"

    def snapshot(self, run_id: str | None, now: float, live: Live | None = None) -> dict[str, Any]:
        """The JSON of ``/status.json`` (the run named by ``run_id``, else as its events name it)."""
        rate = self._rate()
        picked = _sample(len(self.steps))
        groups = []
        for r, group in sorted(self.groups.items()):
            seen = live.groups.get(r) if live is not None else None
            state = self.state_of(r, live)
            saved_down = ((live.state or {}).get("down_since", {}) if live is not None else {}).get(str(r))
            groups.append(
                {
                    "replica": r,
                    "state": state,
                    "incarnation": max(group.incarnation, seen.incarnation if seen else 0),
                    "nodes": list(seen.nodes if seen and seen.nodes else group.nodes),
                    "heartbeat_age_s": round(seen.heartbeat_age_s, 3) if seen else None,
                    "microbatches": int(self.quotas.get(str(r), 0)) if state == "live" else 0,
                    "down_since": saved_down
                    if saved_down is not None
                    else (group.failed_at if state in ("fenced", "restarting") else None),
                }
            )
        recoveries = self.recoveries()
        timelines = {(r["replica"], r["step"]): r["phases"] for r in recoveries}
        failures = [f | {"phases": timelines.get((f["replica"], f["step"]))} for f in self.failures[-RECENT:][::-1]]
        return {
            "run": {
                "id": run_id or self.run_id,
                "state": self.run_state(),
                "step": self.steps[-1] if self.steps else 0,
                "steps": self.steps_total,
                "steps_per_s": rate,
                "tokens_per_s": rate * self.tokens_per_step if rate is not None and self.tokens_per_step else None,
                "tokens_per_step": self.tokens_per_step,
                "precision": self.precision,
                "started": self.started,
                "updated": self.updated,
                "now": now,
                "leader": self.leader,
                "fatal": self.fatal,
            },
            "groups": groups,
            "failures": failures,
            "host_memory": self.snapshot_memory(live),
            "rejoins": self.rejoins[-RECENT:][::-1],
            "leaves": self.leaves[-RECENT:][::-1],
            "digests": {
                "steps": sorted(self.digest_steps)[-RECENT:],
                "mismatches": self.mismatches,
                "last": max(self.digest_steps, default=None),
            },
            "sdc": {
                "checks": self.sdc_checks,
                "mismatches": self.sdc_mismatches,
                "quarantined": [{"replica": r, "step": s} for r, s in sorted(self.quarantined.items())],
            },
            "series": {
                "step": [self.steps[i] for i in picked],
                "time": [self.times[i] for i in picked],
                "loss": [self.losses[i] for i in picked],
                "live_groups": [self.live[i] for i in picked],
                "step_time_s": [
                    self.times[i] - self.times[i - 1] if i else None for i in picked
                ],  # the sampled ones only
            },
            "counts": {
                "failures": len(self.failures),
                "leaves": len(self.leaves),
                "rejoins": len(self.rejoins),
                "steps": len(self.steps),
                "digest_mismatches": self.mismatches,
                "sdc_checks": self.sdc_checks,
                "sdc_mismatches": self.sdc_mismatches,
                "quarantined": len(self.quarantined),
            },
            "latencies": {
                "recovery_s": list(self.recovery_s),
                "downtime_s": [r["downtime_s"] for r in self.rejoins if isinstance(r["downtime_s"], (int, float))],
                "phases": {
                    name: [r["phases"][name] for r in recoveries if r["phases"][name] is not None]
                    for name in phases.PHASES
                },
            },
        }
