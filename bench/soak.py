"""Soak: one long run of the default job with many random faults (issue #12).

Drives the run from outside: a prologue of plan faults (a SIGKILL in every phase), then random
faults of every kind that never leave the run without a group holding state; checks every step
against a failure-free reference, and watches for hangs and resource growth. What it injects,
its safety rule and its results: docs/benchmarks.md (the soak results).

    .venv/bin/python -m bench.soak [--faults N] [--nodes 1|2] [--seed S] [--launcher-faults]

Writes bench/results/soak.json (``--out`` elsewhere); runs live in outputs/soak/.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence, TextIO

from bench.common import CONFIG, PRECISION, RESULTS, ROOT
from titan_recover.compare import Comparison, compare_runs
from titan_recover.control.keys import COORDINATOR_ENV, INCARNATION_ENV, REPLICA_ENV, REPLICAS_ENV, RUN_ENV, SECRET_ENV
from titan_recover.control.transport import free_port
from titan_recover.observability.events import events_path, read_events, read_log
from titan_recover.policy.membership import Membership, TooFewReplicasError, donor

RANDOM_KINDS = ("kill", "stop", "slow", "kill_agent", "two_groups", "kill_joiner", "kill_donor")
TRANSFER_KINDS = ("kill_joiner", "kill_donor")
LAUNCHER_KIND = "launcher"
PHASES = ("forward", "backward", "allreduce", "optimizer", "join", "donate")
REL_TOL = 1e-3
DRIFT_MARGIN = 2.0  # the run may drift from the reference up to this many times the control's drift
OUT = ROOT / "outputs" / "soak"

log = logging.getLogger(__name__)


# ---- pure parts: the schedule, the safety rule, the bookkeeping, growth, summary ----------


def make_schedule(n: int, kinds: Sequence[str], rng: random.Random) -> list[str]:
    """``n`` fault kinds, every kind as often as the others (+-1), in random order."""
    deck = [kinds[i % len(kinds)] for i in range(n)]
    extra = list(kinds)
    rng.shuffle(extra)
    deck[len(deck) - n % len(kinds) :] = extra[: n % len(kinds)]  # which kinds get the remainder: random
    rng.shuffle(deck)
    return deck


def phase_plan(
    shards: int, gap: int, rng: random.Random, first: int = 3
) -> tuple[str, list[tuple[int, int, str]], int]:
    """The prologue's fault plan: a SIGKILL in each phase, on replicas 0 and 1 in turn.

    Each entry names the incarnation it expects (incarnations count the restarts before it):
    0 forward, 1 backward, 0 (back, incarnation 1) allreduce, 0 again while receiving its state
    (incarnation 2, join), 1 (incarnation 1) optimizer, 0 (incarnation 3) while sending its state to 1
    (donate). ``gap`` steps leave room for a group to restart and rejoin. Returns the plan,
    its (replica, incarnation, phase) entries and the step by which the prologue is over.
    """
    s1, s2 = first, first + gap // 2
    s3, s4 = s1 + gap, s2 + gap
    rank = lambda: rng.randrange(shards)  # noqa: E731
    entries = [
        (0, 0, "forward", f"step={s1}"),
        (1, 0, "backward", f"step={s2}"),
        (0, 1, "allreduce", f"step={s3}"),
        (0, 2, "join", ""),
        (1, 1, "optimizer", f"step={s4}"),
        (0, 3, "donate", ""),
    ]
    plan = "; ".join(
        " ".join(w for w in (f"kill replica={r} rank={rank()}", step, f"phase={p}", f"attempt={a}" if a else "") if w)
        for r, a, p, step in entries
    )
    return plan, [(r, a, p) for r, a, p, _ in entries], s4 + 2 * gap


@dataclass(frozen=True)
class View:
    """What the driver knows when it picks a fault."""

    holders: frozenset[int]  # groups holding the training state: last step's members less the failed
    joining: dict[int, int]  # admitted groups without state yet -> incarnation
    in_flight: frozenset[int] = frozenset()  # groups hit by a fault not yet recovered
    spare: int | None = None  # never hit
    node1: frozenset[int] = frozenset()  # groups of the second launcher (--nodes 2)
    lost: frozenset[int] = frozenset()  # groups that will not come back
    fresh: int | None = None  # a group admitted just now (its state transfer is starting)
    down: frozenset[int] = frozenset()  # failed groups not admitted again yet (an admission is coming)


def _donor(view: View, joiner: int) -> int | None:
    joining = sorted(set(view.joining) | {joiner})
    try:
        return donor(Membership(0, tuple(sorted(view.holders | set(joining)))), joining, joiner)
    except TooFewReplicasError:
        return None


def targets_for(kind: str, view: View, rng: random.Random) -> tuple[int, ...] | None:
    """The groups a fault of ``kind`` would hit now, or None when it may not be injected.

    Safety rule: a fault never hits the spare, a group with a fault in flight or a lost
    one; it is injected only while at least 2 groups hold state, and at least one of them
    still holds it afterwards. A joiner holds no state, so killing it needs only one holder.
    """
    candidates = sorted(view.holders - view.in_flight - view.lost - ({view.spare} if view.spare is not None else set()))
    if kind == "kill_joiner":
        j = view.fresh
        if j is None or j not in view.joining or j in view.in_flight or j == view.spare or not view.holders:
            return None
        return (j,)
    if len(view.holders) < 2:
        return None
    if kind == "kill_donor":
        if view.fresh is None or view.fresh not in view.joining:
            return None
        d = _donor(view, view.fresh)
        return (d,) if d in candidates and len(view.holders) >= 2 else None
    if kind == LAUNCHER_KIND:
        hit = view.node1 & (view.holders | set(view.joining))
        ok = (
            view.node1
            and view.node1 & view.holders
            and view.holders - view.node1
            and not view.node1 & (view.in_flight | view.lost)
            and view.spare not in view.node1
        )
        return tuple(sorted(hit)) if ok else None
    if kind == "two_groups":
        if len(candidates) < 2 or len(view.holders) < 3:
            return None
        return tuple(sorted(rng.sample(candidates, 2)))
    if kind in ("kill", "stop", "slow", "kill_agent"):
        return (rng.choice(candidates),) if candidates else None
    raise ValueError(f"unknown fault kind {kind!r}")


def pick(
    schedule: Sequence[str], view: View, rng: random.Random, lookahead: int = 8
) -> tuple[int, str, tuple[int, ...]] | None:
    """The next fault: (its index in ``schedule``, kind, target groups), or None to wait.

    Right after an admission (``view.fresh``) the first transfer kind among the next
    ``lookahead`` entries goes if it can. Otherwise transfer kinds wait for an admission and
    the first other kind goes if it can; if it cannot yet (e.g. ``two_groups`` while a group
    is still restarting) the driver waits for it, so that no kind starves. When only transfer
    kinds are left and no group is down or joining, no admission would ever come: an extra
    ``kill`` (index -1, not taken from the schedule) makes one.
    """
    if view.fresh is not None:
        for i, kind in enumerate(schedule[:lookahead]):
            if kind in TRANSFER_KINDS and (t := targets_for(kind, view, rng)):
                return i, kind, t
    for i, kind in enumerate(schedule):
        if kind in TRANSFER_KINDS:
            continue
        t = targets_for(kind, view, rng)
        return (i, kind, t) if t else None
    if schedule and not view.down and not view.joining and (t := targets_for("kill", view, rng)):
        return -1, "kill", t
    return None


@dataclass
class Fault:
    """One injected fault and what became of it."""

    index: int
    kind: str
    targets: tuple[int, ...]
    at: float  # monotonic time of injection
    step: int  # last committed step when injected
    wall: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)  # pids, ranks, attempts, seconds
    failed: dict[int, float] = field(default_factory=dict)  # target -> monotonic time its failure was seen
    cont_at: float | None = None  # slow: when SIGCONT was sent
    recovery_s: float | None = None  # fault to the membership without its targets published (``recovered`` event)
    resolved_at: float | None = None
    recovered_step: int | None = None
    outcome: str | None = None  # survived | fenced (slow) | unresolved | run_ended

    @property
    def done(self) -> bool:
        return self.outcome is not None

    def record(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("at", "failed", "cont_at", "resolved_at")}
        d["targets"] = list(self.targets)
        d["detect_s"] = round(max(self.failed.values()) - self.at, 3) if self.failed else None
        d["recover_s"] = round(self.resolved_at - self.at, 3) if self.resolved_at is not None else None
        return d


class Tracker:
    """The run's state as the event log tells it, and the faults in flight (no processes).

    Fed events in log order and the driver's injections; the clock is passed in.
    """

    def __init__(self, replicas: int, spare: int | None, node1: Iterable[int] = (), now: float = 0.0) -> None:
        self.replicas, self.spare, self.node1 = replicas, spare, frozenset(node1)
        self.step = 0
        self.holders: set[int] = set(range(replicas))
        self.joining: dict[int, int] = {}
        self.incarnations = {r: 0 for r in range(replicas)}
        self.unrecovered: set[int] = set()  # failed since the last committed step
        self.faults: list[Fault] = []
        self.collateral: list[dict[str, Any]] = []  # failures no fault aimed at
        self.unmatched: list[tuple[dict[str, Any], float]] = []  # failures seen before their plan fault's event
        self.lost: set[int] = set()
        self.fresh: tuple[int, float] | None = None  # (replica, monotonic) of the latest admission
        self.last_progress = now
        self.events: list[dict[str, Any]] = []

    def pending(self) -> list[Fault]:
        return [f for f in self.faults if not f.done]

    def inject(self, kind: str, targets: Sequence[int], now: float, wall: float | None = None, **detail: Any) -> Fault:
        """Records a fault sent at ``now`` (monotonic; ``wall``: its wall-clock time, default now)."""
        fault = Fault(
            len(self.faults) + 1,
            kind,
            tuple(targets),
            now,
            self.step,
            time.time() if wall is None else wall,
            dict(detail),
        )
        self.faults.append(fault)
        for e, seen in list(self.unmatched):  # its failure may have been read first (another file)
            if e["replica"] in fault.targets and e["replica"] not in fault.failed and e["time"] >= fault.wall - 2.0:
                fault.failed[e["replica"]] = seen
                self.unmatched.remove((e, seen))
        return fault

    def feed(self, e: dict[str, Any], now: float) -> list[Fault]:
        """Takes one event; returns the faults it resolved."""
        self.events.append(e)
        kind, resolved = e["event"], []
        if kind == "step":
            self.step, self.last_progress = e["step"], now
            self.holders = set(e["members"])
            self.joining = {r: a for r, a in self.joining.items() if r not in self.holders}
            self.unrecovered.clear()
            for f in self.pending():
                if (
                    f.kind != "slow"
                    and set(f.targets) <= set(f.failed)
                    or f.kind == "slow"
                    and f.targets[0] in f.failed
                ):
                    f.resolved_at, f.recovered_step = now, e["step"]
                    f.outcome = "fenced" if f.kind == "slow" else "survived"
                    resolved.append(f)
        elif kind == "failure":
            r = e["replica"]
            self.holders.discard(r)
            self.joining.pop(r, None)
            self.unrecovered.add(r)
            for f in self.pending():
                if r in f.targets and r not in f.failed:
                    f.failed[r] = now
                    f.detail.setdefault("causes", {})[str(r)] = e["cause"][:200]
                    break
            else:
                self.unmatched.append((e, now))
        elif kind == "recovered":
            # measured from the fault itself: the event's own latency_s starts at the failure's time,
            # which for a fault from outside is often its detection
            for f in self.pending():
                if f.recovery_s is None and f.failed and (f.kind == "slow" or set(f.targets) <= set(f.failed)):
                    f.recovery_s = round(e["time"] - f.wall, 3)
        elif kind == "admitted":
            self.incarnations[e["replica"]] = e["attempt"]
            self.joining[e["replica"]] = e["attempt"]
            self.fresh = (e["replica"], now)
        elif kind == "fault_injected":  # a plan fault fired inside a rank
            self.inject(
                f"{e['action']}_{e['phase']}",
                (e["replica"],),
                now,
                e["time"],
                rank=e["rank"],
                attempt=e["attempt"],
                phase=e["phase"],
                plan=True,
            )
        return resolved

    def tick(self, now: float, settle_s: float, timeout_s: float) -> list[Fault]:
        """Resolves slow faults that were not fenced, and gives up on faults older than ``timeout_s``."""
        resolved = []
        for f in self.pending():
            if (
                f.kind == "slow"
                and f.cont_at is not None
                and not f.failed
                and now >= f.cont_at + settle_s
                and self.last_progress > f.cont_at
            ):
                f.resolved_at, f.recovered_step, f.outcome = now, self.step, "survived"
                resolved.append(f)
            elif now - f.at > timeout_s:
                f.resolved_at, f.outcome = now, "unresolved"
                resolved.append(f)
        return resolved

    def settle_unmatched(self, now: float, wait_s: float = 5.0) -> None:
        """Failures no fault claimed within ``wait_s`` are collateral (e.g. a joiner whose donor died)."""
        for e, seen in list(self.unmatched):
            if now - seen >= wait_s:
                self.unmatched.remove((e, seen))
                self.collateral.append(e)

    def gate_open(self) -> bool:
        """No fault and no failure left to recover from."""
        return not self.pending() and not self.unrecovered

    def view(self, now: float, fresh_s: float = 1.0) -> View:
        fresh = None
        if self.fresh is not None and now - self.fresh[1] <= fresh_s and self.fresh[0] in self.joining:
            fresh = self.fresh[0]
        in_flight = {r for f in self.pending() for r in f.targets}
        down = set(range(self.replicas)) - self.holders - set(self.joining) - self.lost
        return View(
            frozenset(self.holders),
            dict(self.joining),
            frozenset(in_flight),
            self.spare,
            self.node1,
            frozenset(self.lost),
            fresh,
            frozenset(down),
        )


def incarnation_of_resources(events: Iterable[dict[str, Any]]) -> Iterable[tuple[dict[str, Any], int]]:
    """(resources event of a rank, incarnation of its replica group): the incarnation is the last
    ``admitted`` one before it in the log (0 before any), since an incarnation is admitted
    before it commits anything and is fenced before the next one is admitted."""
    incarnation: dict[int, int] = {}
    for e in events:
        if e["event"] == "admitted":
            incarnation[e["replica"]] = e["attempt"]
        elif e["event"] == "resources" and e.get("process") == "rank":
            yield e, incarnation.get(e["replica"], 0)


def _growth(series: list[dict[str, Any]]) -> dict[str, Any]:
    first, last = series[0], series[-1]
    return {
        "samples": len(series),
        "from_step": first.get("step"),
        "to_step": last.get("step"),
        "rss_mb": [first["rss_mb"], last["rss_mb"]],
        "max_rss_mb": max(e["rss_mb"] for e in series),
        "threads": [first["threads"], last["threads"]],
        "fds": [first["fds"], last["fds"]],
        "rss_growth_ratio": round(last["rss_mb"] / first["rss_mb"], 4) if first["rss_mb"] else None,
        "thread_growth": last["threads"] - first["threads"],
        "fd_growth": last["fds"] - first["fds"],
        **({"parked": [first["parked"], last["parked"]]} if "parked" in first and "parked" in last else {}),
    }


def survivor_growth(
    events: Iterable[dict[str, Any]], replica: int | None = None, rank: int = 0
) -> dict[str, Any] | None:
    """RSS, threads and fds of one surviving rank from its first ``resources`` event (the
    first failure it survived) to its last: ``replica``'s (or, if None, the incarnation with
    the most events), same incarnation throughout."""
    events = list(events)
    series: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e, incarnation in incarnation_of_resources(events):
        if e.get("rank", 0) == rank and (replica is None or e["replica"] == replica):
            series[(e["replica"], incarnation)].append(e)
    if not series:
        return None
    key = max(series, key=lambda k: (len(series[k]), -k[1], -k[0]))
    chosen = series[key]
    out = {"replica": key[0], "rank": rank, "attempt": key[1], **_growth(chosen)}
    # threads and fds follow the number of live peers (gloo pairs): also first to last among the
    # samples taken with as many members as the last one; and RSS over the second half (warm-up excluded)
    size = {e["step"]: len(e["members"]) for e in events if e["event"] == "step"}
    same = [e for e in chosen if size.get(e.get("step")) == size.get(chosen[-1].get("step"))]
    if size and len(same) >= 2:
        g = _growth(same)
        out["same_members"] = {
            "members": size.get(chosen[-1].get("step")),
            "samples": len(same),
            **{k: g[k] for k in ("rss_growth_ratio", "thread_growth", "fd_growth")},
        }
    half = chosen[len(chosen) // 2 :]
    out["rss_growth_ratio_second_half"] = _growth(half)["rss_growth_ratio"]
    return out


def coordinator_growth(events: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    series = [e for e in events if e["event"] == "resources" and e.get("process") == "coordinator"]
    return _growth(series) if series else None


def final_digests(events: Iterable[dict[str, Any]], replicas: int, last_step: int) -> list[str]:
    """Problems with the parameter digests: mismatches anywhere, and at the last step every
    replica logging one and all of them equal."""
    events = list(events)
    problems = [
        f"param_digest_mismatch: replica {e['replica']} at step {e['step']}"
        for e in events
        if e["event"] == "param_digest_mismatch"
    ]
    last = {e["replica"]: e["digest"] for e in events if e["event"] == "param_digest" and e["step"] == last_step}
    if sorted(last) != list(range(replicas)):
        problems.append(
            f"step {last_step}: param digests from replicas {sorted(last)}, expected all of 0..{replicas - 1}"
        )
    if len(set(last.values())) > 1:
        problems.append(f"step {last_step}: param digests differ: {last}")
    return problems


def loss_violations(run: Comparison, control: Comparison | None) -> list[str]:
    """The run's loss deviations that float rounding does not explain.

    Over hundreds of steps a deviation of one rounding unit, from summing the same
    microbatches' gradients in another order (which every change of members does), grows
    until the loss differs in the third digit. The control, a failure-free run that only
    sums in another order (one group computes all M), measures how far that alone goes:
    past ``REL_TOL`` the run may drift up to ``DRIFT_MARGIN`` times as far as the control.
    """
    if not run.loss:
        return []
    if control is not None and run.max_rel_loss_dev <= DRIFT_MARGIN * control.max_rel_loss_dev:
        return []
    floor = (
        f"more than {DRIFT_MARGIN:g} x the control's {control.max_rel_loss_dev:.2e}" if control else "no control run"
    )
    return [f"{line}: past {REL_TOL:g}, {floor}" for line in run.loss.values()]


def summarize(
    faults: Sequence[Fault],
    events: Sequence[dict[str, Any]],
    reference: Sequence[dict[str, Any]] | None,
    replicas: int,
    steps: int,
    spare: int | None,
    hang: dict[str, Any] | None,
    exit_codes: dict[str, int | None],
    collateral: Sequence[dict[str, Any]] = (),
    control: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The soak's result keys from its faults, its event log, the reference's and the control's."""
    of = lambda kind: [e for e in events if e["event"] == kind]  # noqa: E731
    violations: list[str] = []
    cmp = drift = None
    if reference is not None:
        cmp = compare_runs(reference, events, REL_TOL)
        drift = compare_runs(reference, control, REL_TOL) if control is not None else None
        violations += cmp.exact + loss_violations(cmp, drift)
        violations += [f"control: {p}" for p in (drift.exact if drift else [])]
    else:
        violations.append("no reference run to compare with")
    violations += final_digests(events, replicas, steps)
    violations += [f"fatal at step {e.get('step')}: {e.get('error')}" for e in of("fatal")]
    if hang is None:  # after a hang the driver killed the run
        violations += [f"{who} exited with code {code}" for who, code in exit_codes.items() if code != 0]
    survived = [f for f in faults if f.outcome in ("survived", "fenced")]
    unresolved = [f for f in faults if f.outcome == "unresolved"]
    growth = survivor_growth(events, spare)
    coord = coordinator_growth(events)
    logged = [e["latency_s"] for e in of("recovered")]
    latency = [f.recovery_s for f in faults if f.recovery_s is not None] or logged
    downtime = [e["downtime_s"] for e in of("rejoined")]
    return {
        "faults_injected": len(faults),
        "faults_by_kind": dict(sorted(Counter(f.kind for f in faults).items())),
        "faults_survived": len(survived),
        "survived_by_kind": dict(sorted(Counter(f.kind for f in survived).items())),
        "invariant_violations": len(violations),
        "hangs": int(hang is not None) + len(unresolved),
        "max_recovery_latency_s": round(max(latency), 3) if latency else None,
        "max_rejoin_downtime_s": round(max(downtime), 3) if downtime else None,
        "rss_growth_ratio": growth["rss_growth_ratio"] if growth else None,
        "fd_growth": growth["fd_growth"] if growth else None,
        "thread_growth": growth["thread_growth"] if growth else None,
        "survivor": growth,
        "coordinator_fd_growth": coord["fd_growth"] if coord else None,
        "coordinator": coord,
        "violations": violations[:50],
        "steps_committed": len(of("step")),
        "steps_compared": cmp.steps if cmp else 0,
        "max_rel_loss_dev": cmp.max_rel_loss_dev if cmp else None,
        "loss_steps_over_tol": len(cmp.loss) if cmp else None,
        "first_step_over_tol": min(cmp.loss, default=None) if cmp else None,
        "control_max_rel_loss_dev": drift.max_rel_loss_dev if drift else None,
        "control_loss_steps_over_tol": len(drift.loss) if drift else None,
        "control_first_step_over_tol": min(drift.loss, default=None) if drift else None,
        "failures": len(of("failure")),
        "collateral_failures": [{k: e.get(k) for k in ("replica", "step", "cause")} for e in collateral],
        "rejoins": len(of("rejoined")),
        "slow_fenced": sum(f.kind == "slow" and f.outcome == "fenced" for f in faults),
        "extra_kills": sum(bool(f.detail.get("extra")) for f in faults),  # to make an admission for a transfer kind
        "unresolved_faults": [f.index for f in unresolved],
        "mean_recovery_latency_s": round(sum(latency) / len(latency), 3) if latency else None,
        "max_recovery_latency_logged_s": round(max(logged), 3) if logged else None,  # the events' latency_s
        "mean_rejoin_downtime_s": round(sum(downtime) / len(downtime), 3) if downtime else None,
        "hang": hang,
        "exit_codes": exit_codes,
    }


def format_table(r: dict[str, Any]) -> str:
    rows = [
        ("faults injected", r["faults_injected"]),
        ("faults survived", r["faults_survived"]),
        ("invariant violations", r["invariant_violations"]),
        ("hangs", r["hangs"]),
        ("max recovery latency (s)", r["max_recovery_latency_s"]),
        ("max rejoin downtime (s)", r["max_rejoin_downtime_s"]),
        ("rss growth ratio", r["rss_growth_ratio"]),
        ("fd growth", r["fd_growth"]),
        ("thread growth", r["thread_growth"]),
        ("coordinator fd growth", r["coordinator_fd_growth"]),
        ("steps committed / compared", f"{r['steps_committed']} / {r['steps_compared']}"),
        ("max rel loss deviation", r["max_rel_loss_dev"]),
        ("  the control's (float drift)", r.get("control_max_rel_loss_dev")),
        (
            "steps past the loss tolerance",
            f"{r.get('loss_steps_over_tol')} (control: {r.get('control_loss_steps_over_tol')})",
        ),
        ("failures / rejoins", f"{r['failures']} / {r['rejoins']}"),
        ("collateral failures", len(r["collateral_failures"])),
        ("slow ranks fenced", r["slow_fenced"]),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["soak summary"] + [f"  {k:<{width}} : {v}" for k, v in rows]
    lines.append("  by kind (injected / survived):")
    for kind, n in r["faults_by_kind"].items():
        lines.append(f"    {kind:<16} {n:>4} / {r['survived_by_kind'].get(kind, 0)}")
    lines += [f"  VIOLATION {v}" for v in r["violations"][:20]]
    return "\n".join(lines)


# ---- processes ----------------------------------------------------------------------


@dataclass
class Proc:
    pid: int
    ppid: int
    state: str
    replica: int | None
    incarnation: int | None
    rank: int | None  # None: not a rank (a torchrun agent, the coordinator, a launcher)
    cmd: str


def _stat(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return int(rest[1]), rest[0]
    except (OSError, IndexError, ValueError):
        return None


def process_tree(roots: Iterable[int]) -> list[Proc]:
    """Every live process under ``roots`` (the launchers this driver started), from /proc."""
    children: dict[int, list[int]] = defaultdict(list)
    states: dict[int, tuple[int, str]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            states[int(name)] = st
            children[st[0]].append(int(name))
    out, todo = [], [r for r in roots if r in states]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        ppid, state = states[pid]
        if state in ("Z", "X"):
            continue
        env: dict[str, str] = {}
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                for item in f.read().split(b"\0"):
                    key, _, value = item.decode(errors="replace").partition("=")
                    if key in (REPLICA_ENV, INCARNATION_ENV, "RANK"):
                        env[key] = value
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
        num = lambda k: int(env[k]) if env.get(k, "").isdigit() else None  # noqa: E731
        out.append(
            Proc(
                pid,
                ppid,
                state,
                num(REPLICA_ENV),
                num(INCARNATION_ENV),
                num("RANK") if num(REPLICA_ENV) is not None else None,
                cmd,
            )
        )
    return out


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


class Tail:
    """New complete lines of a JSONL file that other processes append to."""

    def __init__(self, path: Path) -> None:
        self.path, self.buf = path, ""
        self.f: TextIO | None = None

    def read(self) -> list[dict[str, Any]]:
        if self.f is None:
            try:
                self.f = open(self.path)
            except FileNotFoundError:
                return []
        self.buf += self.f.read()
        *lines, self.buf = self.buf.split("\n")
        return [json.loads(line) for line in lines if line.strip()]

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


# ---- the run ----------------------------------------------------------------------------


@dataclass
class Setup:
    replicas: int
    shards: int
    steps: int
    seed: int
    nodes: int
    plan: str
    heartbeat_timeout_s: float
    collective_timeout_s: float
    digest_interval: int
    local_batch: int = 2
    exact: bool = False  # [recover] exact: the run and its reference must be the same bits

    @property
    def node1(self) -> list[int]:
        """Groups of the second launcher: the lower half (the spare, R - 1, stays with the coordinator)."""
        return list(range(self.replicas // 2)) if self.nodes == 2 else []

    def args(self, dump: Path, plan: str | None = None) -> list[str]:
        return [
            sys.executable,
            "-m",
            "titan_recover.launch",
            "--job.config_file",
            str(CONFIG.relative_to(ROOT)),
            "--job.dump_folder",
            str(dump),
            *PRECISION,
            "--training.steps",
            str(self.steps),
            "--debug.seed",
            "42",
            "--metrics.log_freq",
            "10",
            "--parallelism.data_parallel_replicate_degree",
            str(self.replicas),
            "--parallelism.data_parallel_shard_degree",
            str(self.shards),
            "--training.local_batch_size",
            str(self.local_batch),
            "--training.global_batch_size",
            str(2 * self.replicas * self.shards * self.local_batch),
            "--recover.max_restarts",
            "1000",
            "--recover.restart_window_s",
            "3600",
            "--recover.heartbeat_timeout_s",
            str(self.heartbeat_timeout_s),
            "--recover.collective_timeout_s",
            str(self.collective_timeout_s),
            "--recover.digest_interval",
            str(self.digest_interval),
            *(["--recover.exact"] if self.exact else []),
            "--recover.fault_plan",
            self.plan if plan is None else plan,
        ]


class Soak:
    def __init__(self, setup: Setup, args: argparse.Namespace) -> None:
        self.setup, self.args = setup, args
        self.rng = random.Random(args.seed)
        self.spare = None if args.spare < 0 else args.spare
        self.t0 = time.monotonic()
        self.launchers: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, dict[str, Any]] = {}
        self.logs: dict[str, Path] = {}
        self.relaunches = 0
        self.launcher_rejoin: list[dict[str, Any]] = []

    def log(self, msg: str, step: int | None = None) -> None:
        log.info("[soak %7.1fs step %4s] %s", time.monotonic() - self.t0, step if step is not None else "-", msg)

    # -- launchers --

    def _start(self, name: str) -> subprocess.Popen:
        spec = self.commands[name]
        with open(self.logs[name], "a") as out:
            proc = subprocess.Popen(
                spec["cmd"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=spec["env"], start_new_session=True
            )
        self.launchers[name] = proc
        return proc

    def start(self, dump: Path) -> None:
        s = self.setup
        base = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, RUN_ENV, COORDINATOR_ENV, REPLICAS_ENV)}
        base["PYTHONUNBUFFERED"] = "1"
        if s.nodes == 1:
            self.commands["node0"] = {"cmd": s.args(dump / "node0"), "env": base, "replicas": list(range(s.replicas))}
        else:
            port, secret = free_port(), os.urandom(16).hex()
            extra = ["--recover.coordinator_bind", "127.0.0.1", "--recover.coordinator_port", str(port)]
            local0 = [r for r in range(s.replicas) if r not in s.node1]
            self.commands["node0"] = {
                "cmd": s.args(dump / "node0") + extra,
                "replicas": local0,
                "env": {**base, SECRET_ENV: secret, REPLICAS_ENV: ",".join(map(str, local0))},
            }
            self.commands["node1"] = {
                "cmd": s.args(dump / "node1") + extra,
                "replicas": s.node1,
                "env": {
                    **base,
                    SECRET_ENV: secret,
                    REPLICAS_ENV: ",".join(map(str, s.node1)),
                    COORDINATOR_ENV: f"127.0.0.1:{port}",
                },
            }
        for name in self.commands:
            (dump / name).mkdir(parents=True, exist_ok=True)
            self.logs[name] = dump / f"{name}.log"
            self.logs[name].write_text("")
            self._start(name)
        for name, spec in self.commands.items():
            env = " ".join(f"{k}={v}" for k, v in spec["env"].items() if k in (REPLICAS_ENV, COORDINATOR_ENV))
            self.log(f"started {name}: {env + ' ' if env else ''}{shlex.join(spec['cmd'][1:])}")

    def stop_all(self) -> None:
        """SIGKILLs what is left of the launchers' trees (ranks run in sessions of their own)."""
        tree = process_tree([pr.pid for pr in self.launchers.values() if pr.poll() is None])
        for proc in self.launchers.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        for p in tree:
            _signal(p.pid, signal.SIGKILL)

    # -- finding targets --

    def ranks(self, replica: int, incarnation: int | None = None) -> list[Proc]:
        roots = [p.pid for p in self.launchers.values() if p.poll() is None]
        procs = [p for p in process_tree(roots) if p.replica == replica and p.rank is not None]
        if incarnation is None and procs:
            incarnation = max(p.incarnation or 0 for p in procs)
        return sorted((p for p in procs if p.incarnation == incarnation), key=lambda p: p.rank or 0)

    def agent(self, replica: int, incarnation: int) -> Proc | None:
        launchers = {p.pid for p in self.launchers.values() if p.poll() is None}
        for p in process_tree(launchers):
            if p.ppid in launchers and p.replica == replica and p.incarnation == incarnation and p.rank is None:
                return p
        return None

    def _rank_of(self, replica: int, incarnation: int) -> Proc | None:
        procs = [p for p in self.ranks(replica, incarnation) if p.state not in ("T", "t")]
        return self.rng.choice(procs) if len(procs) == self.setup.shards else None

    # -- injecting --

    def inject(self, kind: str, targets: tuple[int, ...], tracker: Tracker, now: float) -> Fault | None:
        """Sends the fault's signals; None (nothing sent) when its processes are not all there."""
        att = tracker.incarnations
        if kind in ("kill", "stop", "slow", "kill_joiner", "kill_donor", "two_groups"):
            found = [self._rank_of(r, att[r]) for r in targets]
            procs = [p for p in found if p is not None]
            if len(procs) != len(found):
                return None
            detail: dict[str, Any] = {
                "ranks": [p.rank for p in procs],
                "pids": [p.pid for p in procs],
                "attempts": [att[r] for r in targets],
            }
            if kind == "slow":
                detail["seconds"] = round(self.rng.uniform(0.3, 0.6) * self.setup.heartbeat_timeout_s, 2)
            if kind in TRANSFER_KINDS:
                fresh = tracker.fresh
                detail["after_admitted_s"] = round(now - fresh[1], 3) if fresh else None
            sig = signal.SIGSTOP if kind in ("stop", "slow") else signal.SIGKILL
            for p in procs:  # back to back: two_groups within microseconds, far inside 50 ms
                _signal(p.pid, sig)
            return tracker.inject(kind, targets, now, **detail)
        if kind == "kill_agent":
            agent = self.agent(targets[0], att[targets[0]])
            if agent is None:
                return None
            _signal(agent.pid, signal.SIGKILL)
            return tracker.inject(kind, targets, now, pids=[agent.pid], attempts=[att[targets[0]]])
        if kind == LAUNCHER_KIND:
            return self.kill_launcher(targets, tracker, now)
        raise ValueError(kind)

    def kill_launcher(self, targets: tuple[int, ...], tracker: Tracker, now: float) -> Fault | None:
        proc = self.launchers["node1"]
        if proc.poll() is not None:
            return None
        tree = process_tree([proc.pid])
        for p in tree:  # the whole node at once
            _signal(p.pid, signal.SIGKILL)
        proc.wait()
        fault = tracker.inject(LAUNCHER_KIND, targets, now, pids=[p.pid for p in tree])
        self.relaunches += 1
        self.rotate_node1()
        time.sleep(1.0)  # the node "reboots"
        self._start("node1")
        self.launcher_rejoin.append(
            {"fault": fault.index, "at": now, "replicas": list(self.setup.node1), "rejoined": [], "rejoin_s": {}}
        )
        self.log(f"relaunched node1 (same command), pid {self.launchers['node1'].pid}")
        return fault

    def rotate_node1(self) -> None:
        """The relaunched launcher deletes its node's event log: keep the old one (and its events)."""
        path = Path(events_path(str(self.dump / "node1")))
        for t in self.tails:
            if t.path == path:
                self.pending_events += t.read()
                t.close()
                self.tails.remove(t)
                break
        if path.exists():
            path.rename(path.with_name(f"recover_events.{self.relaunches}.jsonl"))
        self.tails.append(Tail(path))

    # -- the loop --

    def run(self, dump: Path) -> dict[str, Any]:
        """Watches the run and injects faults until node0's launcher exits or the run hangs."""
        tracker = self._prepare(dump)
        hang: dict[str, Any] | None = None
        while True:
            now = time.monotonic()
            self._take_events(tracker, now)
            self._settle(tracker, now)
            self._wake_slow_ranks(tracker, now)
            self._judge_relaunches(tracker, now)
            if self._node0_ended():
                break
            hang = self._hang(tracker, now)
            if hang is not None:
                break
            self._report_status(tracker, now)
            self._inject_next(tracker, now)
            time.sleep(0.02)
        return self._collect(tracker, hang)

    def _prepare(self, dump: Path) -> Tracker:
        """The event logs to follow, the random faults' schedule, and the loop's bookkeeping."""
        s, a = self.setup, self.args
        self.dump = dump
        self.tails = [
            Tail(Path(events_path(str(dump / n)))) for n in ("node1", "node0") if n in self.commands or n == "node0"
        ]
        self.pending_events: list[dict[str, Any]] = []
        tracker = Tracker(s.replicas, self.spare, s.node1, time.monotonic())
        kinds = tuple(a.kinds) if a.kinds else RANDOM_KINDS + ((LAUNCHER_KIND,) if a.launcher_faults else ())
        self.schedule = make_schedule(a.faults, kinds, self.rng)
        self.plan_total = len([x for x in s.plan.split(";") if x.strip()]) if s.plan != "none" else 0
        self.random_injected = 0
        self.blocked_since: float | None = None  # since when the schedule's head kind could not go
        self.next_at: float | None = None  # when the next random fault is due
        self.step_times: list[float] = []
        self.last_status = time.monotonic()
        self.finished_at: float | None = None  # when the last step committed
        self.log(
            f"{s.replicas} groups x {s.shards} ranks, {s.steps} steps; prologue plan: {s.plan}; "
            f"then {a.faults} random faults until step {s.steps - a.tail}; spare {self.spare}"
        )
        return tracker

    def _take_events(self, tracker: Tracker, now: float) -> None:
        """Feeds the tracker every event logged since the last pass (those kept from a rotated log first)."""
        events = self.pending_events + [e for t in self.tails for e in t.read()]
        self.pending_events = []
        for e in events:
            self._on_event(tracker, e, now)

    def _on_event(self, tracker: Tracker, e: dict[str, Any], now: float) -> None:
        prev_step = tracker.step
        for f in tracker.feed(e, now):
            self.log(
                f"fault {f.index} {f.kind} {list(f.targets)}: {f.outcome}, "
                f"detected {f.record()['detect_s']}s, recovered by step {f.recovered_step}",
                tracker.step,
            )
        if e["event"] == "step" and tracker.step == prev_step + 1:
            self.step_times.append(e["time"])
        elif e["event"] == "failure":
            self.log(f"failure: replica {e['replica']} at step {e['step']}: {e['cause'][:140]}", tracker.step)
        elif e["event"] == "fault_injected":
            self.log(
                f"plan fault fired: kill replica {e['replica']} rank {e['rank']} attempt {e['attempt']} "
                f"phase {e['phase']} (fault {len(tracker.faults)})",
                tracker.step,
            )
        elif e["event"] == "admitted":
            self.log(f"admitted replica {e['replica']} attempt {e['attempt']}", tracker.step)
        elif e["event"] == "rejoined":
            self._on_rejoined(tracker, e, now)
        elif e["event"] in ("fatal", "param_digest_mismatch"):
            self.log(f"{e['event'].upper()}: {e}", tracker.step)

    def _on_rejoined(self, tracker: Tracker, e: dict[str, Any], now: float) -> None:
        """Counts a group of a relaunched node back; a lost one may be hit again."""
        for lr in self.launcher_rejoin:
            if e["replica"] in lr["replicas"] and e["replica"] not in lr["rejoined"]:
                lr["rejoined"].append(e["replica"])
                lr["rejoin_s"][str(e["replica"])] = round(now - lr["at"], 1)
                if e["replica"] in tracker.lost:
                    tracker.lost.discard(e["replica"])
                    self.log(
                        f"replica {e['replica']} is back, {now - lr['at']:.0f}s after node1's relaunch", tracker.step
                    )

    def _settle(self, tracker: Tracker, now: float) -> None:
        """Unclaimed failures become collateral; slow ranks not fenced survived; old faults are unresolved."""
        tracker.settle_unmatched(now)
        for f in tracker.tick(now, self.setup.heartbeat_timeout_s + 1.0, self.args.hang_s):
            self.log(f"fault {f.index} {f.kind} {list(f.targets)}: {f.outcome}", tracker.step)

    def _wake_slow_ranks(self, tracker: Tracker, now: float) -> None:
        for f in tracker.pending():
            if f.kind == "slow" and f.cont_at is None and now >= f.at + f.detail["seconds"]:
                for pid in f.detail["pids"]:
                    _signal(pid, signal.SIGCONT)
                f.cont_at = now

    def _judge_relaunches(self, tracker: Tracker, now: float) -> None:
        """A relaunched node's groups rejoined, or, past ``--hang-s``, are lost (not hit until they are back)."""
        for lr in self.launcher_rejoin:
            if not lr.get("verdict") and set(lr["rejoined"]) >= set(lr["replicas"]):
                lr["verdict"] = "rejoined"
                self.log(f"node1's groups {lr['replicas']} rejoined after the relaunch", tracker.step)
            elif not lr.get("verdict") and now - lr["at"] > self.args.hang_s:
                lr["verdict"] = "not rejoined"
                tracker.lost |= set(lr["replicas"]) - set(lr["rejoined"])
                self.log(
                    f"node1's groups {sorted(tracker.lost)} did not rejoin within {self.args.hang_s:.0f}s of the "
                    "relaunch: not hit until they are back",
                    tracker.step,
                )

    def _node0_ended(self) -> bool:
        codes = {n: p.poll() for n, p in self.launchers.items()}
        return codes["node0"] is not None

    def _hang(self, tracker: Tracker, now: float) -> dict[str, Any] | None:
        """The diagnostics of a hang (no committed step, a fault not recovered, no end after the last step), or None."""
        s, a = self.setup, self.args
        stalled = now - tracker.last_progress > a.hang_s
        if any(f.outcome == "unresolved" for f in tracker.faults) or stalled and tracker.step < s.steps:
            return self.diagnose(tracker, self.dump, "no committed step" if stalled else "a fault was not recovered")
        if tracker.step >= s.steps:
            self.finished_at = self.finished_at or now
            if now - self.finished_at > a.hang_s:
                return self.diagnose(tracker, self.dump, "the run did not end after its last step")
        return None

    def _report_status(self, tracker: Tracker, now: float) -> None:
        if now - self.last_status > 30:
            self.last_status = now
            self.log(
                f"members {sorted(tracker.holders)}, joining {sorted(tracker.joining)}, faults "
                f"{len(tracker.faults)} ({self.random_injected}/{self.args.faults} random), pending "
                f"{[f.index for f in tracker.pending()]}",
                tracker.step,
            )

    def _may_inject(self, tracker: Tracker) -> bool:
        """Random faults go after the prologue's plan faults, before the tail, and only when nothing is being
        recovered."""
        s, a = self.setup, self.args
        prologue = (
            len([f for f in tracker.faults if f.detail.get("plan")]) < self.plan_total and tracker.step < a.prologue_end
        )
        return (
            self.random_injected < a.faults
            and not prologue
            and tracker.step < s.steps - a.tail
            and tracker.step > 0
            and tracker.gate_open()
        )

    def _inject_next(self, tracker: Tracker, now: float) -> None:
        """Injects the next random fault when it is due (at once after an admission, for a transfer kind)."""
        if not self._may_inject(tracker):
            self.next_at = None
            return
        view = tracker.view(now)
        step_s = (self.step_times[-1] - self.step_times[-6]) / 5 if len(self.step_times) >= 6 else 2.0
        if self.next_at is None:  # a random point of some step
            self.next_at = now + self.rng.uniform(0.0, 2.0 * step_s)
        if view.fresh is None and now < self.next_at:
            return
        choice = pick(self.schedule, view, self.rng)
        if choice is not None and (view.fresh is None or choice[1] in TRANSFER_KINDS or now >= self.next_at):
            fault, now = self._fire(*choice, tracker, now)
            if fault is None:
                choice = None  # its processes are not all there (yet): counts as blocked
        if view.fresh is not None and tracker.fresh is not None:
            tracker.fresh = None  # one chance per admission
        if choice is None and self.schedule:
            self._blocked(tracker, now)

    def _fire(
        self, i: int, kind: str, targets: tuple[int, ...], tracker: Tracker, now: float
    ) -> tuple[Fault | None, float]:
        """Injects schedule entry ``i`` (-1: an extra kill); the fault, or None, and the time it was sent."""
        if kind in TRANSFER_KINDS:  # somewhere in the transfer: its group setup, header or tensors
            time.sleep(self.rng.uniform(0.0, self.args.transfer_delay_s))
            now = time.monotonic()
        fault = self.inject(kind, targets, tracker, now)
        if fault is None:
            return None, now
        if i >= 0:
            self.schedule.pop(i)
            self.random_injected += 1
        else:  # only transfer kinds left: this kill makes a group restart and rejoin
            fault.detail["extra"] = True
        self.blocked_since, self.next_at = None, None
        self.log(
            f"fault {fault.index} ({self.random_injected}/{self.args.faults}): {kind} replicas {list(targets)} "
            f"{ {k: v for k, v in fault.detail.items() if k != 'pids'} }",
            tracker.step,
        )
        return fault, now

    def _blocked(self, tracker: Tracker, now: float) -> None:
        """The schedule's head kind could not go: past ``--block-s`` it goes to the back (a launcher fault
        is dropped while node1's groups are lost), so that no kind holds the others up."""
        self.blocked_since = self.blocked_since or now
        if now - self.blocked_since > self.args.block_s:
            head = (
                next(i for i, k in enumerate(self.schedule) if k not in TRANSFER_KINDS)
                if any(k not in TRANSFER_KINDS for k in self.schedule)
                else 0
            )
            kind = self.schedule.pop(head)
            if kind == LAUNCHER_KIND and tracker.lost:
                self.log("launcher fault dropped: node1's groups are lost", tracker.step)
            else:
                self.schedule.append(kind)
            self.blocked_since = None

    def _collect(self, tracker: Tracker, hang: dict[str, Any] | None) -> dict[str, Any]:
        """After the run ended (or hung): its last events, the faults left open, the launchers' exit codes."""
        if hang is not None:
            self.stop_all()
        self._wait_launchers()
        for e in self.pending_events + [e for t in self.tails for e in t.read()]:
            tracker.feed(e, time.monotonic())
        tracker.settle_unmatched(float("inf"))
        for f in tracker.pending():
            f.outcome = "run_ended"
        self.stop_all()
        self.tracker = tracker
        return {"hang": hang, "exit_codes": {n: p.returncode for n, p in self.launchers.items()}}

    def _wait_launchers(self) -> None:
        """Gives every launcher 60 s in all to exit after node0's, then SIGKILLs its tree."""
        end = time.monotonic() + 60
        for name, proc in self.launchers.items():
            try:
                proc.wait(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log(f"{name} still running 60 s after node0 ended: killed")
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def diagnose(self, tracker: Tracker, dump: Path, why: str) -> dict[str, Any]:
        path = dump / "hang_diagnostics.txt"
        roots = [p.pid for p in self.launchers.values() if p.poll() is None]
        lines = [
            f"hang: {why}; last step {tracker.step}; members {sorted(tracker.holders)}; joining {tracker.joining}",
            f"pending faults: {[f.record() for f in tracker.pending()]}",
            "",
            "processes:",
        ]
        for p in process_tree(roots):
            try:
                wchan = Path(f"/proc/{p.pid}/wchan").read_text()
            except OSError:
                wchan = "?"
            lines.append(
                f"  pid {p.pid} ppid {p.ppid} state {p.state} wchan {wchan} replica {p.replica} "
                f"attempt {p.incarnation} rank {p.rank}: {p.cmd[:120]}"
            )
        if shutil.which("py-spy"):
            for p in process_tree(roots):
                if p.rank is not None:
                    out = subprocess.run(
                        ["py-spy", "dump", "--pid", str(p.pid)], capture_output=True, text=True, timeout=30
                    )
                    lines += ["", f"py-spy dump {p.pid}:", out.stdout[-4000:]]
        lines += ["", "last events:"] + [json.dumps(e) for e in tracker.events[-60:]]
        for logfile in self.logs.values():
            lines += ["", f"tail of {logfile}:"] + logfile.read_text(errors="replace").splitlines()[-80:]
        path.write_text("\n".join(lines) + "\n")
        self.log(f"HANG: {why}; diagnostics in {path}", tracker.step)
        return {"why": why, "step": tracker.step, "diagnostics": str(path.relative_to(ROOT))}


CONTROL = ("--parallelism.data_parallel_replicate_degree", "1")  # same data and M, all summed by one group


def run_reference(setup: Setup, dump: Path, extra: Sequence[str] = ()) -> tuple[list[dict[str, Any]], float, list[str]]:
    """The failure-free run of the same command (with ``extra`` overrides): the reference
    every committed step must match, or with ``CONTROL`` the float-drift control."""
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    cmd = [*setup.args(dump / "node0", plan="none"), *extra]
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, RUN_ENV, COORDINATOR_ENV, REPLICAS_ENV)}
    start = time.monotonic()
    with open(dump / "node0.log", "w") as out:
        code = subprocess.call(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"}
        )
    if code != 0:
        raise RuntimeError(f"failure-free run failed (exit {code}); see {dump / 'node0.log'}")
    events = list(read_events(events_path(str(dump / "node0"))))
    return events, time.monotonic() - start, cmd


def read_all(dump: Path) -> list[dict[str, Any]]:
    """Every event of the run: node0's log, plus node1's (its rotated parts too) merged by time, each step once."""
    return read_log(*map(str, sorted(dump.glob("node*/recover_events*.jsonl")))).events


def _log_to_stdout() -> None:
    """The driver's lines go to stdout as they are, not through the ``titan_recover`` logger's prefix."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=100, help="random faults to inject (the phase prologue adds 6)")
    p.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="2: two launchers standing for two nodes")
    p.add_argument(
        "--launcher-faults", action="store_true", help="also SIGKILL the second launcher's tree (needs --nodes 2)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kinds",
        nargs="+",
        choices=RANDOM_KINDS + (LAUNCHER_KIND,),
        default=None,
        help="draw only these kinds (default: all; launcher with --launcher-faults)",
    )
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--spare", type=int, default=None, help="replica never hit (default R - 1; -1: none)")
    p.add_argument("--steps", type=int, default=None, help="default: prologue + faults * --steps-per-fault + tail")
    p.add_argument("--steps-per-fault", type=int, default=8)
    p.add_argument("--phase-gap", type=int, default=24, help="steps between the prologue's plan faults")
    p.add_argument("--no-phase-faults", action="store_true", help="skip the prologue of plan faults")
    p.add_argument("--heartbeat-timeout-s", type=float, default=3.0)
    p.add_argument("--collective-timeout-s", type=float, default=10.0)
    p.add_argument("--digest-interval", type=int, default=10)
    p.add_argument("--hang-s", type=float, default=120.0, help="no committed step this long is a hang")
    p.add_argument(
        "--transfer-delay-s",
        type=float,
        default=0.5,
        help="kill_joiner/kill_donor strike up to this long after the admission",
    )
    p.add_argument("--block-s", type=float, default=90.0, help="a kind that cannot go this long is put back")
    p.add_argument("--reference", type=Path, default=None, help="reuse this reference event log (same command)")
    p.add_argument("--control", type=Path, default=None, help="reuse this control event log (same command, 1 group)")
    p.add_argument(
        "--exact",
        action="store_true",
        help="[recover] exact in the run and the reference, compared bit for bit (compare --exact); no control run",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    a = p.parse_args(argv)
    if a.replicas < 3:
        p.error("--replicas must be >= 3 (two groups at once, and a spare)")
    if (a.launcher_faults or LAUNCHER_KIND in (a.kinds or ())) and a.nodes != 2:
        p.error("launcher faults need --nodes 2")
    _log_to_stdout()
    a.spare = a.replicas - 1 if a.spare is None else a.spare
    if a.spare in (0, 1) and not a.no_phase_faults:
        p.error("the prologue hits replicas 0 and 1: choose another --spare or --no-phase-faults")
    rng = random.Random(a.seed)
    if a.no_phase_faults:
        plan, a.prologue_end = "none", 0
    else:
        plan, _, a.prologue_end = phase_plan(a.shards, a.phase_gap, rng)
    a.tail = a.phase_gap + 6  # the last restarted group rejoins before the final digest
    steps = a.steps or a.prologue_end + a.faults * a.steps_per_fault + a.tail
    setup = Setup(
        a.replicas,
        a.shards,
        steps,
        a.seed,
        a.nodes,
        plan,
        a.heartbeat_timeout_s,
        a.collective_timeout_s,
        a.digest_interval,
        exact=a.exact,
    )
    dump = OUT / "run"
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    soak = Soak(setup, a)
    soak.rng = random.Random(rng.random())
    soak.start(dump)
    t0 = time.monotonic()
    try:
        ended = soak.run(dump)
    finally:
        soak.stop_all()
    wall = time.monotonic() - t0
    events = read_all(dump)
    reference, ref_wall, ref_cmd = None, None, None
    control, control_wall, control_cmd = None, None, None
    if a.reference is not None:
        reference = list(read_events(str(a.reference)))
    elif ended["hang"] is None:
        soak.log(f"run ended in {wall:.0f}s; the failure-free reference ({steps} steps) now")
        reference, ref_wall, ref_cmd = run_reference(setup, OUT / "reference")
    if a.control is not None:
        control = list(read_events(str(a.control)))
    elif ended["hang"] is None and not a.exact:
        soak.log(f"the failure-free control ({steps} steps, one group sums all M) now")
        control, control_wall, control_cmd = run_reference(setup, OUT / "control", CONTROL)
    result = summarize(
        soak.tracker.faults,
        events,
        reference,
        a.replicas,
        steps,
        a.spare if a.spare >= 0 else None,
        ended["hang"],
        ended["exit_codes"],
        soak.tracker.collateral,
        control,
    )
    by_phase = {ph: sum(f.kind == f"kill_{ph}" for f in soak.tracker.faults) for ph in PHASES}
    out = {
        "issue": 12,
        **result,
        "command": " ".join(
            shlex.quote(x) for x in ["python", "-m", "bench.soak", *(argv if argv is not None else sys.argv[1:])]
        ),
        "launch_commands": {
            n: (
                " ".join(f"{k}={v}" for k, v in c["env"].items() if k in (REPLICAS_ENV, COORDINATOR_ENV))
                + " "
                + shlex.join(["python", *c["cmd"][1:]])
            ).strip()
            for n, c in soak.commands.items()
        },
        "reference_command": shlex.join(["python", *ref_cmd[1:]])
        if ref_cmd
        else (str(a.reference) if a.reference else None),
        "control_command": shlex.join(["python", *control_cmd[1:]])
        if control_cmd
        else (str(a.control) if a.control else None),
        "precision": PRECISION[-1],
        "model": "llama3 debugmodel",
        "replicas": a.replicas,
        "shards": a.shards,
        "nodes": a.nodes,
        "spare": a.spare,
        "steps": steps,
        "seed": a.seed,
        "microbatches": 2 * a.replicas,
        "heartbeat_timeout_s": a.heartbeat_timeout_s,
        "collective_timeout_s": a.collective_timeout_s,
        "random_faults_target": a.faults,
        "phase_plan": plan,
        "phase_kills": by_phase,
        "wall_s": round(wall, 1),
        "reference_wall_s": round(ref_wall, 1) if ref_wall else None,
        "control_wall_s": round(control_wall, 1) if control_wall else None,
        "launcher_relaunches": [{k: v for k, v in lr.items() if k != "at"} for lr in soak.launcher_rejoin],
        "faults": [f.record() for f in soak.tracker.faults],
    }
    if a.exact and reference is not None:
        bits = compare_runs(reference, events, 0.0, exact=True)
        out["exact"] = {
            "steps": bits.steps,
            "digest_steps": bits.digest_steps,
            "max_rel_loss_dev": bits.max_rel_loss_dev,
            "mismatches": len(bits.exact),
            "first_mismatches": bits.exact[:10],
        }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(format_table(out))
    log.info("wrote %s", a.out)
    exact_ok = "exact" not in out or not out["exact"]["mismatches"]
    return 0 if not out["invariant_violations"] and not out["hangs"] and exact_ok else 1


if __name__ == "__main__":
    sys.exit(main())
