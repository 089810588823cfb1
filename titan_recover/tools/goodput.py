"""Goodput simulator: titan_recover against checkpoint-and-restart on a large cluster.

A discrete-event model of one pre-training run. The cluster is R replica groups of
``group_gpus`` GPUs each; every step sums M microbatches. Failures come from a
per-GPU rate (Poisson), from a trace of times, or at given step numbers (to replay a
measured benchmark). A failure takes out the replica group of the failed GPU; its
hardware is usable again after ``repair_s`` (0: a process crash, restarted at once;
``inf``: the GPUs are lost for good).

- **checkpoint-and-restart**: a blocking checkpoint every K steps (``young_daly_steps``
  gives the optimum for random failures, ``best_ckpt_every`` the best K for a given
  trace); a failure throws away the steps since the last checkpoint and costs
  ``restart_s`` (detect, relaunch, load), after which the job runs on the groups
  healthy at that moment, keeping M (more accumulation per group).
- **titan_recover**: a failure costs ``detect_s`` (detection + regroup) plus the lost
  group's share of the step in flight; survivors carry all M microbatches, so a step
  takes ``ceil(M / live) / ceil(M / R)`` times as long. A repaired group starts
  (``rejoin_s``) and is admitted after survivors pause ``transfer_s`` to send its state.
  With hot spares (``Cluster.spares``), a ready spare is called up at once instead
  (``spare_admit_s``) and the restarted group becomes a spare. A failure that leaves no
  group with state resumes from host-memory ``Snapshots`` where a copy of every shard is
  left, else from a DCP checkpoint; ``rack_failures`` draws whole racks lost.

Both systems pay for every working group, spares included. Stragglers (``Straggler``)
slow some groups for a time window; titan_recover splits the microbatches by a
``Policy`` (equal quotas, or quotas in proportion to speed), the baseline equally.

Pure Python, no process plumbing: ``python -m titan_recover.tools.goodput --help``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

HOUR = 3600.0


@dataclass(frozen=True)
class Cluster:
    gpus: int  # the training groups' GPUs; spares come on top
    group_gpus: int
    microbatches: int  # M: microbatches summed per step (>= number of groups)
    tokens_per_step: int
    # hot spare groups started with the job: model built, outside the membership, no
    # collectives, no throughput, but their GPUs are paid for (they are not failed here)
    spares: int = 0

    @property
    def groups(self) -> int:
        return self.gpus // self.group_gpus


@dataclass(frozen=True)
class Costs:
    """Seconds. ``step_s`` is the failure-free step time with every group live."""

    step_s: float
    ckpt_save_s: float  # blocking checkpoint save (baseline)
    restart_s: float  # baseline: failure -> training again (detect, relaunch, load checkpoint)
    detect_s: float  # titan_recover: failure -> survivors regrouped
    rejoin_s: float  # titan_recover: repaired group's process start -> asks to join
    transfer_s: float  # titan_recover: survivors' pause while a joiner receives its state
    repair_s: float = math.inf  # failed group's hardware usable again (0: restart at once)
    # titan_recover with a ready spare: failure -> the spare trains, less the wait for the
    # step boundary where it joins (survivors pause transfer_s then, as for any joiner);
    # never less than detect_s + transfer_s, the default (the spare is admitted once the
    # failure is detected)
    spare_admit_s: float | None = None

    @property
    def spare_ask_s(self) -> float:
        """Failure -> a called-up spare asks to join (its transfer pause comes after)."""
        admit = self.detect_s + self.transfer_s if self.spare_admit_s is None else self.spare_admit_s
        return admit - self.transfer_s


@dataclass(frozen=True)
class Failure:
    """One failure: at wall time ``time_s``, or when progress first reaches ``step``
    (after the previous step-triggered failure fired). ``groups`` groups fail at once."""

    time_s: float | None = None
    step: int | None = None
    groups: int = 1
    # where it leaves no group with state: whether the live nodes' memory still holds a copy of every shard
    # (False: it took every copy of some shard, a rack holding them all or every host)
    memory_kept: bool = True


@dataclass(frozen=True)
class Snapshots:
    """Host-memory snapshots (docs/host-memory.md): every ``interval`` committed steps each rank copies its
    shard into its node's memory, the step that takes one lasting ``step_s`` longer. A failure that leaves no
    group with state but a copy of every shard on live nodes is followed by the first step again ``resume_s``
    after it, from the newest snapshot (no DCP read), the steps since it computed again."""

    interval: int
    step_s: float
    resume_s: float


@dataclass(frozen=True)
class Straggler:
    """``groups`` live groups run at 1 / ``slowdown`` of the nominal speed from wall time
    ``start_s`` to ``end_s``. Failures spare them (they hit full-speed groups)."""

    slowdown: float
    groups: int = 1
    start_s: float = 0.0
    end_s: float = math.inf


# How titan_recover splits a step's microbatches: "balanced", equal quotas; "speed", quotas
# in proportion to the groups' speeds; "ideal", fractional quotas in proportion (a bound).
Policy = Literal["balanced", "speed", "ideal"]


@dataclass
class Result:
    system: str
    wall_s: float
    steps: int
    tokens: float
    gpu_hours: float
    failures: int
    curve: list[tuple[float, float, float]] = field(default_factory=list)  # (time s, tokens, GPU-hours)
    redone_steps: int = 0  # steps committed again after going back to a checkpoint or a snapshot
    resumes: dict[str, int] = field(default_factory=dict)  # every group lost: "checkpoint" or "memory", how often

    @property
    def throughput(self) -> float:
        """Effective throughput: tokens committed per second of wall time."""
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def tokens_at_gpu_hours(self, budget: float) -> float:
        """Tokens committed by the time ``budget`` GPU-hours were spent (linear in between)."""
        prev = (0.0, 0.0, 0.0)
        for point in self.curve:
            if point[2] >= budget:
                span = point[2] - prev[2]
                frac = (budget - prev[2]) / span if span > 0 else 1.0
                return prev[1] + frac * (point[1] - prev[1])
            prev = point
        return prev[1]


def quotas(microbatches: int, speeds: Sequence[float], policy: Policy = "balanced") -> list[int]:
    """Integer microbatches per group, by largest remainder: equal shares ("balanced") or
    shares in proportion to speed ("speed"). Ties go to the earlier group, so the stragglers,
    listed first, get a balanced step's extra microbatches: the worst case."""
    weights = speeds if policy == "speed" else [1.0] * len(speeds)
    exact = [microbatches * w / sum(weights) for w in weights]
    out = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: out[i] - exact[i])
    for i in by_remainder[: microbatches - sum(out)]:
        out[i] += 1
    return out


def step_time(
    cluster: Cluster,
    costs: Costs,
    live: int,
    slow: Sequence[float] = (),
    policy: Policy = "balanced",
    microbatches: float | None = None,
) -> float:
    """A step of ``microbatches`` (default M; a fraction counts whole) on ``live`` groups,
    ``slow`` the speeds of the straggling ones (1 = nominal): the time of the group that
    finishes last. Without stragglers, each computes ceil(M / live) microbatches."""
    per_microbatch = costs.step_s / math.ceil(cluster.microbatches / cluster.groups)
    work = cluster.microbatches if microbatches is None else microbatches
    slow = slow[:live]
    if policy == "ideal":
        return per_microbatch * work / (sum(slow) + live - len(slow))
    if not slow:  # equal speeds, both policies: in closed form, as the sweeps take millions of steps
        return per_microbatch * math.ceil(work / live)
    speeds = [*slow, *[1.0] * (live - len(slow))]
    return per_microbatch * max(q / s for q, s in zip(quotas(math.ceil(work), speeds, policy), speeds))


def young_daly_interval_s(ckpt_save_s: float, mtbf_s: float) -> float:
    """Daly's optimum checkpoint interval (compute time between checkpoints)."""
    if ckpt_save_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = ckpt_save_s / (2 * mtbf_s)
    return math.sqrt(2 * ckpt_save_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - ckpt_save_s


def young_daly_steps(costs: Costs, mtbf_s: float) -> int:
    return max(1, round(young_daly_interval_s(costs.ckpt_save_s, mtbf_s) / costs.step_s))


def poisson_failures(cluster: Cluster, rate_per_gpu_hour: float, horizon_s: float, seed: int = 0) -> list[Failure]:
    """Failures of a cluster whose GPUs fail independently (rate per GPU-hour)."""
    rng, t, out = random.Random(seed), 0.0, []
    rate = rate_per_gpu_hour * cluster.gpus / HOUR
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= horizon_s:
            break
        out.append(Failure(time_s=t))
    return out


def spread_failures(count: int, horizon_s: float, groups: int = 1) -> list[Failure]:
    """``count`` failures evenly spread over the run (the paper's "lost spread over the run")."""
    return [Failure(time_s=horizon_s * (i + 1) / (count + 1), groups=groups) for i in range(count)]


# How replica groups' parts (one node each) are laid over racks: "groups", each group's parts on consecutive
# nodes; "aligned", part p of every group on consecutive nodes (a rack may hold every copy of some shards: the
# layout docs/host-memory.md warns about); "spread", aligned with group g's parts rotated by g, so that part p's
# copies sit in different stripes of ``groups`` nodes
Placement = Literal["groups", "aligned", "spread"]


def rack_placement(groups: int, parts: int, rack_nodes: int, placement: Placement) -> list[frozenset[tuple[int, int]]]:
    """The (group, part) pairs each rack runs: ``groups`` replica groups of ``parts`` nodes, a node running one
    part (its shards), ordered by ``placement`` and filled into racks of ``rack_nodes`` nodes."""
    if min(groups, parts, rack_nodes) < 1:
        raise ValueError(f"need groups, parts and rack_nodes >= 1 (got {groups}, {parts}, {rack_nodes})")
    index = {
        "groups": lambda g, p: g * parts + p,
        "aligned": lambda g, p: p * groups + g,
        "spread": lambda g, p: ((p + g) % parts) * groups + g,
    }[placement]
    racks: list[set[tuple[int, int]]] = [set() for _ in range(math.ceil(groups * parts / rack_nodes))]
    for g in range(groups):
        for p in range(parts):
            racks[index(g, p) // rack_nodes].add((g, p))
    return [frozenset(r) for r in racks]


def rack_loss(racks: Sequence[frozenset[tuple[int, int]]], rack: int, time_s: float) -> Failure:
    """Rack ``rack`` lost whole at ``time_s``: the groups with a part in it fail, and the nodes' memory keeps a
    copy of every shard where each part runs on some other rack too."""
    left = {p for i, r in enumerate(racks) if i != rack for _, p in r}
    return Failure(
        time_s=time_s,
        groups=len({g for g, _ in racks[rack]}),
        memory_kept={p for r in racks for _, p in r} <= left,
    )


def rack_failures(
    racks: Sequence[frozenset[tuple[int, int]]], rate_per_rack_hour: float, horizon_s: float, seed: int, most: int
) -> list[Failure]:
    """Correlated losses, a whole rack at a time: each rack fails at ``rate_per_rack_hour`` (Poisson), the one
    that fails drawn at random; at most ``most`` losses before ``horizon_s``, the same ones for a seed."""
    rng, t, out = random.Random(seed), 0.0, list[Failure]()
    rate = rate_per_rack_hour * len(racks) / HOUR
    while rate > 0 and len(out) < most:
        t += rng.expovariate(rate)
        if t >= horizon_s:
            break
        out.append(rack_loss(racks, rng.randrange(len(racks)), t))
    return out


@dataclass(frozen=True)
class TraceEvent:
    """One line of a capacity trace: a node arrives (``add``) or goes away (``remove``) at ``time_s``."""

    time_s: float
    kind: str  # "add" or "remove"
    node: str


def read_capacity_trace(text: str) -> list[TraceEvent]:
    """A capacity trace's CSV lines ``time_ms,add|remove,node`` (Bamboo's and Parcae's format), in file
    order; ValueError naming the line when one is malformed or inconsistent (a node added while live, a
    node removed while not, time going backwards)."""
    events: list[TraceEvent] = []
    live: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]

        def bad(why: str, number: int = number, line: str = line) -> ValueError:
            return ValueError(f"capacity trace line {number} ({line.strip()!r}): {why}")

        if len(fields) != 3:
            raise bad(f"expected time_ms,add|remove,node; got {len(fields)} fields")
        ms, kind, node = fields
        if not ms.isdigit():
            raise bad(f"the time {ms!r} is not a whole number of milliseconds >= 0")
        if kind not in ("add", "remove") or not node:
            raise bad(f"expected add or remove and a node name, got {kind!r} and {node!r}")
        time_s = int(ms) / 1000
        if events and time_s < events[-1].time_s:
            raise bad(f"time goes backwards (the line before is at {events[-1].time_s:g} s)")
        if (node in live) == (kind == "add"):
            raise bad(f"node {node!r} is {'already' if kind == 'add' else 'not'} live")
        (live.add if kind == "add" else live.discard)(node)
        events.append(TraceEvent(time_s, kind, node))
    return events


def group_changes(
    events: Sequence[TraceEvent], nodes_per_group: int, max_groups: int, min_groups: int = 0
) -> list[tuple[float, int]]:
    """(time s, replica groups) where the groups the live nodes make change: ``live // nodes_per_group``
    clamped to ``[min_groups, max_groups]``, after all events of a time stamp; the first time stamp always."""
    if nodes_per_group < 1 or max_groups < max(1, min_groups):
        raise ValueError(
            f"nodes_per_group must be >= 1 (got {nodes_per_group}) and max_groups >= max(1, min_groups) "
            f"(got {max_groups}, {min_groups})"
        )
    out: list[tuple[float, int]] = []
    live = 0
    for i, event in enumerate(events):
        live += 1 if event.kind == "add" else -1
        if i + 1 < len(events) and events[i + 1].time_s == event.time_s:
            continue  # the time stamp's other events first
        groups = min(max_groups, max(min_groups, live // nodes_per_group))
        if not out or out[-1][1] != groups:
            out.append((event.time_s, groups))
    return out


CapacitySystem = Literal["elastic", "fixed", "restart", "membership"]
CAPACITY_SYSTEMS: dict[CapacitySystem, str] = {
    "elastic": "titan_recover elastic (leaves on notice, joins beyond R)",
    "fixed": "titan_recover, R fixed at the start (every loss a crash, rejoins into its slot)",
    "restart": "checkpoint-and-restart (the whole job restarted on every change, global batch kept)",
    "membership": "global batch follows the membership (torchft's semantics: a loss discards the step)",
}


# a node's life: its name and which of its lives (a name added again after its removal is a new node)
_Life = tuple[str, int]


@dataclass
class _Nodes:
    """A capacity trace seen from one node-sized replica group each: when each node's life starts and ends.
    The run starts at the trace's first line (``start_s``) and ends at its last."""

    added: dict[_Life, float]
    removed: dict[_Life, float]
    start_s: float
    end_s: float

    @staticmethod
    def of(events: Sequence[TraceEvent]) -> _Nodes:
        if not events:
            raise ValueError("the capacity trace has no events: give it at least one add line")
        added: dict[_Life, float] = {}
        removed: dict[_Life, float] = {}
        lives: dict[str, int] = {}
        for e in events:
            if e.kind == "add":
                lives[e.node] = lives.get(e.node, 0) + 1
                added[(e.node, lives[e.node])] = e.time_s
            else:
                removed[(e.node, lives[e.node])] = e.time_s
        return _Nodes(added, removed, events[0].time_s, events[-1].time_s)

    def gone(self, node: _Life) -> float:
        return self.removed.get(node, math.inf)

    def live(self, t: float) -> list[_Life]:
        return [n for n, a in self.added.items() if a <= t < self.gone(n)]

    def next_change(self, t: float, *times: float) -> float:
        """The first arrival, removal or one of ``times`` after ``t`` (the trace's end at the latest): where
        a run with nothing to train waits to, always forward."""
        later = [x for x in (*self.added.values(), *self.removed.values(), *times) if x > t]
        return min([*later, self.end_s]) if t < self.end_s else self.end_s


# Where a member under notice leaves: "first", the first step boundary after its notice; "last", the last
# boundary before its removal, the one after which the next step would not end before it
LeaveAt = Literal["first", "last"]


def _leaving_last(
    members: set[_Life], nodes: _Nodes, t: float, notice_s: float, step: Callable[[int], float]
) -> set[_Life]:
    """The noticed members that cannot finish the step starting at ``t`` on the members that stay
    (``step``: its time on that many groups); each one leaving makes the step longer, so until none more."""
    leaving: set[_Life] = set()
    while len(leaving) < len(members):
        dt = step(len(members) - len(leaving))
        more = {n for n in members - leaving if nodes.gone(n) - notice_s <= t and nodes.gone(n) <= t + dt}
        if not more:
            break
        leaving |= more
    return leaving


def _titan(
    nodes: _Nodes,
    cluster: Cluster,
    costs: Costs,
    notice_s: float,
    elastic: bool,
    leave: LeaveAt = "first",
    policy: Policy = "balanced",
    snapshots: Snapshots | None = None,
) -> dict:
    """titan_recover on a capacity trace. ``elastic``: up to every live node a member, a member under notice
    leaves at a step boundary (``leave``; a crash at its removal, detection 0, only where no boundary came in
    between); a new node not under notice starts at once (``rejoin_s``) and is admitted at a boundary
    (``transfer_s``). Else R is the start's node count: a node beyond it waits, unstarted, for a slot; every
    removal is a crash (``detect_s``, the lost share of the step redone) and the slot goes to a waiting node
    (``rejoin_s``). ``policy`` "ideal": fractional quotas (M / live microbatches a group), a bound. With
    ``snapshots``, a step that takes one lasts ``snapshots.step_s`` longer; a node's memory goes with it, so
    they never resume anything here. ``no_members``: how often every member was gone at once (the run goes on as
    if the state were kept: count it before trusting a trace's figures)."""
    t = nodes.start_s
    cap = len(nodes.live(t)) if not elastic else cluster.groups
    members = set(nodes.live(t)[:cap])
    starting: dict[_Life, float] = {}  # node -> when it can be admitted
    steps, redone, leaves, crashes, joins, most, no_members, holding = 0, 0.0, 0, 0, 0, 0, 0, False

    def noticed(n: _Life) -> bool:
        return elastic and nodes.gone(n) - notice_s <= t

    def step(live: int, microbatches: float = cluster.microbatches) -> float:
        return step_time(cluster, costs, live, policy=policy, microbatches=microbatches)

    while t < nodes.end_s:
        for n in nodes.live(t):  # nodes that start: any not under notice (elastic), or into a free slot
            if n not in members and n not in starting and not noticed(n) and len(members) + len(starting) < cap:
                starting[n] = t + costs.rejoin_s
        starting = {n: r for n, r in starting.items() if nodes.gone(n) > t and not noticed(n)}
        if elastic and leave == "first":  # noticed members leave here, at the boundary
            going = {n for n in members if noticed(n)}
            leaves, members = leaves + len(going), members - going
        gone = {n for n in members if nodes.gone(n) <= t}  # lost between steps (in a pause): found, nothing redone
        if gone:
            crashes, members, t = crashes + len(gone), members - gone, t + (0.0 if elastic else costs.detect_s)
        ready = {n for n, r in starting.items() if r <= t}
        if ready:
            t += costs.transfer_s if members else 0.0
            members |= ready
            joins += len(ready)
            starting = {n: r for n, r in starting.items() if n not in ready}
        if elastic and leave == "last":  # after any pause: those whose removal comes before the step's end
            going = _leaving_last(members, nodes, t, notice_s, step)
            leaves, members = leaves + len(going), members - going
        if not members:  # nothing trains until a node is ready, arrives or goes
            no_members, holding = no_members + holding, False
            t = nodes.next_change(t, *starting.values())
            continue
        most, holding = max(most, len(members)), True
        remaining = float(cluster.microbatches)
        snap = snapshots.step_s if snapshots and (steps + 1) % snapshots.interval == 0 else 0.0
        while remaining > 0 and members:
            dt = step(len(members), remaining)
            lost = {n for n in members if t < nodes.gone(n) < t + dt}
            if not lost:
                t += dt + snap
                break
            at = min(nodes.gone(n) for n in lost)
            lost = {n for n in lost if nodes.gone(n) == at}
            done = remaining * (at - t) / dt
            redone += done * len(lost) / len(members)
            remaining -= done * (1 - len(lost) / len(members))
            crashes, members = crashes + len(lost), members - lost
            t = at + (0.0 if elastic else costs.detect_s)
        steps += 1 if members and t <= nodes.end_s else 0  # a step the trace's end cuts is not counted
    return {"steps": steps, "redone_steps": redone / cluster.microbatches, "leaves": leaves, "crashes": crashes,
            "joins": joins, "groups_at_most": most, "no_members": no_members}  # fmt: skip


def _restart(nodes: _Nodes, cluster: Cluster, costs: Costs, ckpt_every: int, grow: bool) -> dict:
    """Checkpoint-and-restart: the job runs on the nodes live when it started, a blocking checkpoint every
    ``ckpt_every`` steps. It stops at the loss of one of its nodes, losing the steps since the last checkpoint
    (a notice shorter than ``ckpt_save_s`` cannot save one), and, with ``grow``, at an arrival too, taken
    after a checkpoint (nothing lost); then ``restart_s`` on every live node, and a change during a restart
    starts it over."""
    stamps = sorted({*nodes.added.values(), *nodes.removed.values()} - {nodes.start_s})
    t, steps, saved, lost, restarts, i = nodes.start_s, 0, 0, 0, 0, 0
    while t < nodes.end_s:
        used = nodes.live(t)
        while i < len(stamps) and not (grow or any(nodes.gone(n) == stamps[i] for n in used)):
            i += 1  # a change that does not stop the job: an arrival, or the loss of a node it does not use
        change = stamps[i] if i < len(stamps) else nodes.end_s
        live = len(used)
        while live:
            dt = step_time(cluster, costs, live) + (costs.ckpt_save_s if (steps + 1) % ckpt_every == 0 else 0.0)
            if t + dt > change:
                break
            t, steps = t + dt, steps + 1
            saved = steps if steps % ckpt_every == 0 else saved
        if change >= nodes.end_s:
            break
        if any(r == change for r in nodes.removed.values()):
            lost, steps = lost + steps - saved, saved
        else:
            saved = steps
            change += costs.ckpt_save_s
        t = change + costs.restart_s
        restarts += 1
        i += 1
        while i < len(stamps) and stamps[i] < t:  # changed again while restarting: start over from there
            if any(r == stamps[i] for r in nodes.removed.values()):
                lost, steps = lost + steps - saved, saved
            t, i = stamps[i] + costs.restart_s, i + 1
            restarts += 1
    return {"steps": steps, "redone_steps": float(lost), "restarts": restarts, "ckpt_every": ckpt_every, "grow": grow}


def _membership(nodes: _Nodes, cluster: Cluster, costs: Costs) -> dict:
    """The global batch follows the membership: each member computes its own share of a full cluster's batch
    in ``step_s`` whatever the others do; a member lost in a step discards that step for all (no drain path),
    found after ``detect_s``; a new node heals from a peer (``rejoin_s``, then ``transfer_s`` at a step)."""
    t = nodes.start_s
    members = set(nodes.live(t))
    steps, tokens, discarded, batches = 0, 0.0, 0.0, []
    per_group = cluster.tokens_per_step / cluster.groups
    while t < nodes.end_s:
        gone = {n for n in members if nodes.gone(n) <= t}  # lost between steps: found after the detection
        if gone:
            members, t = members - gone, t + costs.detect_s
        ready = {n for n in nodes.live(t) if n not in members and nodes.added[n] + costs.rejoin_s <= t}
        if ready:
            t += costs.transfer_s if members else 0.0
            members |= ready
        if not members:
            t = nodes.next_change(t, *(a + costs.rejoin_s for a in nodes.added.values()))
            continue
        lost = [nodes.gone(n) for n in members if t < nodes.gone(n) < t + costs.step_s]
        if lost:
            discarded += (min(lost) - t) / costs.step_s
            members = {n for n in members if nodes.gone(n) > min(lost)}
            t = min(lost) + costs.detect_s
            continue
        t += costs.step_s
        if t > nodes.end_s:  # a step the trace's end cuts is not counted
            break
        steps, tokens = steps + 1, tokens + per_group * len(members)
        batches.append(len(members))
    return {"steps": steps, "redone_steps": discarded, "tokens": tokens,
            "global_batch_groups": [min(batches, default=0), max(batches, default=0)]}  # fmt: skip


def simulate_capacity(
    system: CapacitySystem,
    events: Sequence[TraceEvent],
    cluster: Cluster,
    costs: Costs,
    notice_s: float = 25.0,
    ckpt_every: int = 0,
    grow: bool = True,
    leave: LeaveAt = "first",
    policy: Policy = "balanced",
    snapshots: Snapshots | None = None,
) -> dict:
    """One system over a capacity trace (``read_capacity_trace``), one node = one replica group of
    ``cluster.group_gpus`` GPUs; ``cluster.groups`` is the most nodes live at once, and M is fixed except
    under ``membership``. The run starts at the trace's first line and ends at its last. Tokens per hour
    over that span, steps, the work computed again (in steps: a crash's share redone, a restart's steps since
    its checkpoint, a discarded step's part done) and its fraction. ``restart`` checkpoints every
    ``ckpt_every`` steps and, with ``grow``, restarts to take arrivals too. titan_recover's: ``groups_at_most``,
    the most groups that trained a step at once; ``leave``, where a noticed member leaves (elastic); ``policy``
    "ideal" for fractional quotas (a bound); ``snapshots``, host-memory snapshots' step cost. Finer microbatches:
    a larger ``cluster.microbatches``, the same ``tokens_per_step``; no pause for a joiner: ``costs.transfer_s`` 0."""
    if costs.step_s <= 0 or (system == "restart" and ckpt_every < 1):
        raise ValueError(
            f"need costs.step_s > 0 (got {costs.step_s}) and, for restart, ckpt_every >= 1 (got {ckpt_every})"
        )
    if snapshots and system in ("restart", "membership"):
        raise ValueError(f"snapshots are titan_recover's (elastic or fixed), not {system}'s")
    nodes = _Nodes.of(events)
    if system == "restart":
        out = _restart(nodes, cluster, costs, ckpt_every, grow)
    elif system == "membership":
        out = _membership(nodes, cluster, costs)
    else:
        out = _titan(nodes, cluster, costs, notice_s, system == "elastic", leave, policy, snapshots)
    tokens = out.pop("tokens", out["steps"] * float(cluster.tokens_per_step))
    span_h = (nodes.end_s - nodes.start_s) / HOUR
    return {
        "system": CAPACITY_SYSTEMS[system],
        **out,
        "tokens": tokens,
        "tokens_per_hour": tokens / span_h if span_h > 0 else 0.0,
        "redone_fraction": out["redone_steps"] / max(1e-9, out["steps"] + out["redone_steps"]),
    }


@dataclass(frozen=True)
class Horizon:
    """When a simulated run stops: whichever comes first."""

    steps: int | None = None
    wall_s: float = math.inf
    gpu_hours: float = math.inf


def _time_s(failure: Failure) -> float:
    """When a failure hits: math.inf for one triggered by a step instead."""
    return math.inf if failure.time_s is None else failure.time_s


class _Run:
    """The clock, failures, repairs and curve of one simulated run (shared by both systems)."""

    def __init__(
        self,
        system: str,
        cluster: Cluster,
        costs: Costs,
        failures: list[Failure],
        horizon: Horizon,
        stragglers: Sequence[Straggler],
    ) -> None:
        self.system, self.cluster, self.costs, self.horizon = system, cluster, costs, horizon
        self.timed = sorted((f for f in failures if f.time_s is not None), key=_time_s)  # only failures with a time
        self.by_step = [f for f in failures if f.step is not None]
        self.stragglers = stragglers
        self.t, self.steps, self.fired, self.gpu_hours = 0.0, 0, 0, 0.0
        self.memory_kept = True  # the last failure's Failure.memory_kept
        self.redone = 0  # steps committed again after going back to a checkpoint or snapshot
        self.resumes = {"memory": 0, "checkpoint": 0}  # every group lost: where the run went on from
        self.healthy = cluster.groups + cluster.spares  # groups whose hardware works (they are paid for)
        self.repairs: list[float] = []  # heap: when failed groups' hardware is back
        self.curve: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)]

    def done(self) -> bool:
        h = self.horizon
        return (h.steps is not None and self.steps >= h.steps) or self.t >= h.wall_s or self.gpu_hours >= h.gpu_hours

    def advance(self, until: float) -> None:
        """Moves the clock to ``until``, charging GPU-hours for healthy groups and repairing."""
        while self.t < until:
            nxt = min(until, self.repairs[0] if self.repairs else math.inf)
            self.gpu_hours += (nxt - self.t) * self.healthy * self.cluster.group_gpus / HOUR
            self.t = nxt
            while self.repairs and self.repairs[0] <= self.t:
                heapq.heappop(self.repairs)
                self.healthy += 1

    def slow(self) -> list[float]:
        """Speeds of the groups straggling now: a step's are taken when it (or, after a
        failure, its remainder) starts."""
        return [1 / s.slowdown for s in self.stragglers if s.start_s <= self.t < s.end_s for _ in range(s.groups)]

    def next_timed(self) -> float:
        """When the next timed failure hits; math.inf if none."""
        return _time_s(self.timed[0]) if self.timed else math.inf

    def _step_due(self) -> bool:
        return bool(self.by_step) and self.by_step[0].step == self.steps + 1

    def next_failure(self, start: float, duration: float) -> float:
        """When the next failure hits, for a stretch of work [start, start + duration):
        a step-triggered one mid-way, a timed one at its time; math.inf if none."""
        timed = self.next_timed()
        return min(timed, start + duration / 2) if self._step_due() else timed

    def fail(self, exposed: int) -> int:
        """Fires the failure due now on ``exposed`` training groups; returns how many it took."""
        timed_now = bool(self.timed) and self.next_timed() <= self.t
        failure = self.timed.pop(0) if timed_now or not self._step_due() else self.by_step.pop(0)
        lost = min(failure.groups, exposed, self.healthy)
        self.healthy -= lost
        self.fired += 1
        self.memory_kept = failure.memory_kept
        for _ in range(lost):
            heapq.heappush(self.repairs, self.t + self.costs.repair_s)
        return lost

    def record(self) -> None:
        self.curve.append((self.t, self.steps * float(self.cluster.tokens_per_step), self.gpu_hours))

    def back_to(self, step: int, source: str) -> None:
        """Every group's state lost: training goes on from ``step`` (a checkpoint's or a snapshot's)."""
        self.redone += self.steps - step
        self.steps = step
        self.resumes[source] = self.resumes.get(source, 0) + 1

    def result(self) -> Result:
        self.record()
        tokens = self.steps * float(self.cluster.tokens_per_step)
        return Result(
            self.system, self.t, self.steps, tokens, self.gpu_hours, self.fired, self.curve, self.redone, self.resumes
        )


def simulate_restart(
    cluster: Cluster,
    costs: Costs,
    failures: list[Failure],
    horizon: Horizon,
    ckpt_every: int,
    stragglers: Sequence[Straggler] = (),
) -> Result:
    """Checkpoint-and-restart with a blocking checkpoint every ``ckpt_every`` steps. Its
    quotas are equal; a restart takes up to R working groups, spares included."""
    run = _Run(f"ckpt-restart K={ckpt_every}", cluster, costs, failures, horizon, stragglers)
    live, ckpt_step = cluster.groups, 0
    while not run.done():
        saving = (run.steps + 1) % ckpt_every == 0
        dt = step_time(cluster, costs, live, run.slow()) + (costs.ckpt_save_s if saving else 0.0)
        at = run.next_failure(run.t, dt)
        if at >= run.t + dt:
            run.advance(run.t + dt)
            run.steps += 1
            ckpt_step = run.steps if saving else ckpt_step
            run.record()
            continue
        run.advance(at)
        run.fail(live)
        run.back_to(ckpt_step, "checkpoint")  # work since the last checkpoint is lost
        restart_end = run.t + costs.restart_s
        while run.timed and run.next_timed() < restart_end:  # a failure during the restart starts it over
            run.advance(run.next_timed())
            run.fail(min(cluster.groups, run.healthy))
            restart_end = run.t + costs.restart_s
        run.advance(restart_end)
        if run.healthy == 0:  # nothing to restart on until hardware comes back
            if not run.repairs:
                break
            run.advance(run.repairs[0])
        live = min(cluster.groups, run.healthy)
        run.record()
    return run.result()


@dataclass
class _Outside:
    """titan_recover's working groups outside the membership: ``ready`` ones (spares) and a
    heap of when restarted groups and called-up spares ask to join."""

    ready: int
    asks: list[float] = field(default_factory=list)

    def lose(self, t: float, costs: Costs) -> None:
        """A training group failed at ``t``: a ready spare, if any, is called up, and the
        failed group restarts (a spare if no place is left when it asks)."""
        if self.ready:
            self.ready -= 1
            heapq.heappush(self.asks, t + costs.spare_ask_s)
        heapq.heappush(self.asks, t + costs.repair_s + costs.rejoin_s)

    def admit(self, run: _Run, live: int) -> int:
        """At a step boundary, admits asking groups while places are free, survivors pausing
        ``transfer_s`` for each; returns the groups live after."""
        while True:
            while self.asks and self.asks[0] <= run.t:
                heapq.heappop(self.asks)
                self.ready += 1
            if live == run.cluster.groups or not self.ready:
                return live
            self.ready -= 1
            run.advance(run.t + run.costs.transfer_s)
            live += 1


def _recover_step(run: _Run, live: int, outside: _Outside, policy: Policy) -> int:
    """One titan_recover step; returns the groups live at its end (0: every group died)."""
    remaining = float(run.cluster.microbatches)
    while remaining > 0 and live > 0:
        dt = step_time(run.cluster, run.costs, live, run.slow(), policy, remaining)
        at = run.next_failure(run.t, dt)
        if at >= run.t + dt:
            run.advance(run.t + dt)
            return live
        done = remaining * (at - run.t) / dt
        run.advance(at)
        lost = run.fail(live)
        # survivors keep their work; the failed groups' share (an equal one, even with stragglers) is redone
        remaining -= done * (1 - lost / live)
        live -= lost
        for _ in range(lost):
            outside.lose(run.t, run.costs)
        if live:  # the survivors regroup; with none left, the run's backstop counts from the loss
            run.advance(run.t + run.costs.detect_s)
    return live


def _pause(run: _Run, live: int, outside: _Outside, seconds: float) -> int:
    """The live groups pause ``seconds`` after a step (a blocking save); returns the groups live at its end
    (0: every group died in it, the save incomplete). A failure in the pause loses no work; the survivors regroup
    (``detect_s``) before the next step."""
    end = run.t + seconds
    while live and run.next_timed() < end:
        run.advance(run.next_timed())
        lost = run.fail(live)
        live -= lost
        for _ in range(lost):
            outside.lose(run.t, run.costs)
        end = max(end, run.t + run.costs.detect_s)
    if live:
        run.advance(end)
    return live


def _start_again(run: _Run, resume: Callable[[], tuple[float, str] | None]) -> tuple[_Outside, str] | None:
    """Every group lost at ``run.t``: ``resume`` gives the seconds to the first step again and where from
    ("memory" or "checkpoint"), or None where the run cannot go on. A failure meanwhile starts it over (and may
    take the memory with it); with no group's hardware working, the start waits for the first repair, as
    checkpoint-and-restart's does. Returns who is outside the membership then, the repaired groups beyond R as
    ready spares and the unrepaired ones asking to join once repaired and restarted, and where the run went on
    from; None: it stops."""
    how = resume()
    if how is None:
        return None
    end = run.t + how[0]
    while run.timed and run.next_timed() < end:
        run.advance(run.next_timed())
        run.fail(min(run.cluster.groups, run.healthy))
        how = resume()
        if how is None:
            return None
        end = run.t + how[0]
    run.advance(end)
    if run.healthy == 0 and run.repairs and math.isfinite(run.repairs[0]):
        run.advance(run.repairs[0])
    if run.healthy == 0:
        return None
    ready = run.healthy - min(run.cluster.groups, run.healthy)
    return _Outside(ready=ready, asks=sorted(r + run.costs.rejoin_s for r in run.repairs)), how[1]


def simulate_recover(
    cluster: Cluster,
    costs: Costs,
    failures: list[Failure],
    horizon: Horizon,
    stragglers: Sequence[Straggler] = (),
    policy: Policy = "balanced",
    ckpt_every: int = 0,
    snapshots: Snapshots | None = None,
) -> Result:
    """titan_recover: survivors finish the step in flight and carry all M microbatches. A failure that leaves no
    group with state stops the run, unless: with ``snapshots`` and the memory kept (``Failure.memory_kept``), it
    resumes from the newest snapshot ``snapshots.resume_s`` after the loss; else, with ``ckpt_every`` (a
    blocking DCP save every that many steps, ``ckpt_save_s``), from the last checkpoint ``restart_s`` after it,
    as checkpoint-and-restart does. Then it trains on the groups whose hardware works; the others rejoin."""
    name = "titan_recover" + (f" snapshots every {snapshots.interval}" if snapshots else "")
    run = _Run(name, cluster, costs, failures, horizon, stragglers)
    live, outside = cluster.groups, _Outside(ready=cluster.spares)
    saved = {"checkpoint": 0, "memory": 0}  # the newest step of each kind of copy

    def resume() -> tuple[float, str] | None:
        if snapshots and run.memory_kept:
            return snapshots.resume_s, "memory"
        return (costs.restart_s, "checkpoint") if ckpt_every else None

    while not run.done():
        live = outside.admit(run, live)
        live = _recover_step(run, live, outside, policy)
        if live:
            run.steps += 1
            ckpt = ckpt_every > 0 and run.steps % ckpt_every == 0
            snap = snapshots is not None and run.steps % snapshots.interval == 0
            pause = (costs.ckpt_save_s if ckpt else 0.0) + (snapshots.step_s if snapshots and snap else 0.0)
            live = _pause(run, live, outside, pause) if pause else live
            if live:
                saved["checkpoint"] = run.steps if ckpt else saved["checkpoint"]
                saved["memory"] = run.steps if snap else saved["memory"]
                run.record()
                continue
        restarted = _start_again(run, resume)  # no group holds the state
        if restarted is None:
            break
        outside, source = restarted
        run.back_to(saved[source], source)
        saved = {kind: min(step, run.steps) for kind, step in saved.items()}  # later copies: another trajectory
        live = min(cluster.groups, run.healthy)
        run.record()
    return run.result()


def mtbf_s(
    cluster: Cluster, failures: list[Failure], horizon: Horizon, rate_per_gpu_hour: float | None = None
) -> float:
    """Mean time between failures of the whole job, for the Young/Daly interval."""
    if rate_per_gpu_hour:
        return HOUR / (rate_per_gpu_hour * cluster.gpus)
    times = [f.time_s for f in failures if f.time_s is not None]
    span = horizon.wall_s if math.isfinite(horizon.wall_s) else (max(times) if times else math.inf)
    return span / len(times) if times else math.inf


def compare(
    cluster: Cluster,
    costs: Costs,
    failures: list[Failure],
    horizon: Horizon,
    ckpt_every: int,
    curves: bool = False,
    stragglers: Sequence[Straggler] = (),
    policy: Policy = "balanced",
) -> dict:
    """Both systems on the same failures and stragglers (titan_recover's quotas by
    ``policy``); ratios are titan_recover over checkpoint-and-restart. With ``curves``,
    also each run's (time s, tokens, GPU-hours) points."""
    rec = simulate_recover(cluster, costs, failures, horizon, stragglers, policy)
    base = simulate_restart(cluster, costs, failures, horizon, ckpt_every, stragglers)
    out: dict = {
        "ckpt_every": ckpt_every,
        "recover": summary(rec),
        "restart": summary(base),
        "throughput_ratio": rec.throughput / base.throughput
        if base.throughput
        else None,  # None: baseline made nothing
    }
    if math.isfinite(horizon.gpu_hours):
        r, b = rec.tokens_at_gpu_hours(horizon.gpu_hours), base.tokens_at_gpu_hours(horizon.gpu_hours)
        out["tokens_ratio_at_gpu_hours"] = r / b if b else None
    if curves:
        out["curves"] = {"recover": rec.curve, "restart": base.curve}
    return out


def summary(result: Result) -> dict:
    return {
        "system": result.system,
        "wall_s": result.wall_s,
        "steps": result.steps,
        "tokens": result.tokens,
        "gpu_hours": result.gpu_hours,
        "failures": result.failures,
        "tokens_per_s": result.throughput,
    }


def best_ckpt_every(
    cluster: Cluster,
    costs: Costs,
    failures: list[Failure],
    horizon: Horizon,
    upto: int,
    stragglers: Sequence[Straggler] = (),
) -> int:
    """The checkpoint interval (1..upto steps) that gives the baseline its highest throughput
    on these very failures: fairer than Young/Daly when failures are not random."""
    return max(
        range(1, upto + 1), key=lambda k: simulate_restart(cluster, costs, failures, horizon, k, stragglers).throughput
    )


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` (to extrapolate measured costs to more groups)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


# The paper's setting: 512 GPUs, 256 of them lost spread over the run, compared at 234
# GPU-hours. The costs are GPU-cluster assumptions of ours, not numbers from the paper:
# a ~10 s step, a 30 s blocking DCP save, a 5 min job restart (reschedule, rendezvous,
# load), and for titan_recover the detection/regroup and the state transfer of a group.
MICROBATCHES_PER_GROUP = 8  # gradient accumulation per group when all are live
PAPER_CLUSTER = Cluster(gpus=512, group_gpus=8, microbatches=512, tokens_per_step=4 * 2**20)
PAPER_COSTS = Costs(step_s=10.0, ckpt_save_s=30.0, restart_s=300.0, detect_s=5.0, rejoin_s=120.0, transfer_s=5.0)
PAPER_LOST_GPUS, PAPER_GPU_HOURS = 256, 234.0


def paper_setting(
    costs: Costs = PAPER_COSTS,
    events: int = 4,
    curves: bool = False,
    spares: int = 0,
    stragglers: Sequence[Straggler] = (),
    policy: Policy = "balanced",
) -> dict:
    """``events`` failures, each losing 256 / events GPUs for good, evenly spread over the
    run, which ends when 234 GPU-hours are spent. The baseline checkpoints at the interval
    that suits it best on these failures (searched up to twice the Young/Daly one).
    ``spares`` groups come on top of the 512 GPUs, paid from the same budget: the run, and
    with it the failures' spread, is that much shorter."""
    cluster = replace(PAPER_CLUSTER, spares=spares)
    lost_groups = PAPER_LOST_GPUS // cluster.group_gpus
    if lost_groups % events:
        raise ValueError(f"{PAPER_LOST_GPUS} GPUs in groups of {cluster.group_gpus} do not split into {events} events")
    # events at span * i / (events + 1): the cluster spends equal time at each size
    mean_gpus = cluster.gpus + cluster.spares * cluster.group_gpus - PAPER_LOST_GPUS / 2
    span = PAPER_GPU_HOURS * HOUR / mean_gpus
    failures = spread_failures(events, span, groups=lost_groups // events)
    horizon = Horizon(gpu_hours=PAPER_GPU_HOURS)
    costs = replace(costs, repair_s=math.inf)
    daly = young_daly_steps(costs, span / events)
    ckpt_every = best_ckpt_every(cluster, costs, failures, horizon, 2 * daly, stragglers)
    out = compare(cluster, costs, failures, horizon, ckpt_every, curves, stragglers, policy)
    out["young_daly_steps"] = daly
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m titan_recover.tools.goodput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=int, default=PAPER_CLUSTER.gpus)
    c.add_argument("--group-gpus", type=int, default=PAPER_CLUSTER.group_gpus, help="GPUs per replica group")
    c.add_argument(
        "--microbatches", type=int, default=None, help=f"M per step (default: {MICROBATCHES_PER_GROUP} per group)"
    )
    c.add_argument("--tokens-per-step", type=int, default=PAPER_CLUSTER.tokens_per_step)
    c.add_argument("--spares", type=int, default=0, help="hot spare groups on top of --gpus")
    k = p.add_argument_group("costs (seconds)")
    for name, value in asdict(PAPER_COSTS).items():
        k.add_argument(f"--{name.replace('_', '-')}", type=float, default=value)
    f = p.add_argument_group("failures (one of)")
    f.add_argument("--failure-rate", type=float, help="failures per GPU-hour (Poisson; use --repair-s)")
    f.add_argument("--trace", help="JSON list of failure times in seconds")
    f.add_argument("--paper", action="store_true", help="the paper's setting: 512 GPUs, 256 lost, 234 GPU-hours")
    f.add_argument("--events", type=int, default=4, help="with --paper: how many failures lose the 256 GPUs")
    s = p.add_argument_group("stragglers (the whole run)")
    s.add_argument("--slowdown", type=float, help="some groups run this many times slower")
    s.add_argument("--slow-groups", type=int, default=1, help="how many groups straggle")
    s.add_argument(
        "--policy",
        choices=("balanced", "speed", "ideal"),
        default="balanced",
        help="titan_recover's microbatch quotas: equal, by speed, or fractional by speed (a bound)",
    )
    h = p.add_argument_group("horizon")
    h.add_argument("--hours", type=float, default=24.0, help="wall-clock hours to simulate")
    h.add_argument("--ckpt-every", type=int, help="baseline checkpoint interval in steps (default: Young/Daly)")
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--json", help="also write the result here")
    return p


def _times(ratio: float | None) -> str:
    return f"{ratio:.2f}x" if ratio is not None else "unbounded (checkpoint-and-restart committed nothing)"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    costs = Costs(**{name: getattr(args, name) for name in asdict(PAPER_COSTS)})
    stragglers = [Straggler(args.slowdown, args.slow_groups)] if args.slowdown else []
    if args.paper:
        result = paper_setting(costs, args.events, spares=args.spares, stragglers=stragglers, policy=args.policy)
    else:
        cluster = Cluster(
            args.gpus,
            args.group_gpus,
            args.microbatches or MICROBATCHES_PER_GROUP * (args.gpus // args.group_gpus),
            args.tokens_per_step,
            args.spares,
        )
        if cluster.groups < 1 or cluster.microbatches < cluster.groups:
            raise SystemExit(f"error: need --gpus >= --group-gpus and --microbatches >= {cluster.groups} groups")
        horizon = Horizon(wall_s=args.hours * HOUR)
        if args.trace:
            with open(args.trace) as fh:
                failures = [Failure(time_s=float(t)) for t in json.load(fh)]
        else:
            failures = poisson_failures(cluster, args.failure_rate or 0.0, horizon.wall_s, args.seed)
        ckpt = args.ckpt_every or young_daly_steps(costs, mtbf_s(cluster, failures, horizon, args.failure_rate))
        result = compare(cluster, costs, failures, horizon, ckpt, stragglers=stragglers, policy=args.policy)
    for side in ("recover", "restart"):
        s = result[side]
        print(
            f"{s['system']:22s} wall {s['wall_s'] / HOUR:7.2f} h  steps {s['steps']:7d}  failures {s['failures']:4d}  "
            f"GPU-hours {s['gpu_hours']:9.1f}  tokens/s {s['tokens_per_s']:12.0f}"
        )
    print(f"effective throughput ratio titan_recover / checkpoint-and-restart: {_times(result['throughput_ratio'])}")
    if "tokens_ratio_at_gpu_hours" in result:
        print(f"tokens at {PAPER_GPU_HOURS:g} GPU-hours: {_times(result['tokens_ratio_at_gpu_hours'])}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
