"""A real spot-instance trace replayed on this machine: four systems on the same window of it.

The trace (``bench/traces/aws-p3-trace.csv``: 32 AWS p3.2xlarge spot nodes at most over 11.4 hours, MIT,
from Bamboo) gives the live-node count; one single-rank replica group stands for 8 trace nodes
(``goodput.group_changes``: live // 8, between 1 and 4). A window (``--start-min``, ``--minutes``) is
replayed ``--compress`` times faster; each launcher (or torchrun) stands for a node running one group of
the tests' tiny llama3 (M = 12, local batch 1, float32 on a CPU). Node A runs replica 0 (and the
coordinator) and is never preempted. When the count rises, a node starts with the lowest free id; when it
falls, the most recently started node goes: a preemption notice (SIGTERM to its launcher) 25 trace seconds
before the removal's time stamp, as Parcae's replayer fires it, then SIGKILL of its whole process tree at
the stamp; every third removal comes without notice (the SIGKILL only), to show the fallback.

``--systems``, one after the other on the same window:

- ``elastic``: titan_recover with ``max_replicas = 4``, notices honoured (``notice_budget_s`` = the
  compressed notice), groups beyond the starting R admitted;
- ``fixed``: titan_recover as before elasticity: R fixed at the window's starting count (capacity beyond
  it unused), every removal a crash, the slot restarted on the next node that arrives;
- ``restart``: stock TorchTitan with a DCP checkpoint every ``--ckpt-every`` steps, the whole job killed
  and started again from its checkpoint on the new count at every change (global batch kept);
- ``membership``: torchft (``bench.fidelity``'s trainer), each group a fixed M / 4 samples a step, so the
  global batch follows the membership; no drain path, so a removal is its SIGKILL.

Then the references: one titan_recover group failure-free in exact mode (every digest of every step of
``elastic`` and ``fixed`` must be its digest: exact mode gives the same bits at any membership), and a
4-group failure-free torchft run (``membership``'s drift: replica 0's own loss, the same samples in both).

Per system: steps committed, steps per trace hour, steps computed again, microbatches redone at most (a
crashed group's quota of one step; a leave redoes none), leaves, failures, joins, M every step. The
simulator's whole-trace figures (``bench.simulate.spot_trace``) go into the same file. Needs torchft for
``membership`` (the ``bench`` extra). About 40 minutes on 2 cores.

    .venv/bin/python -m bench.spot [--start-min 40] [--minutes 35] [--compress 6]  -> bench/results/spot.json
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import fidelity
from bench.common import ROOT, write_result
from bench.simulate import spot_trace
from titan_recover.control import keys, transport
from titan_recover.observability import logs
from titan_recover.observability.events import of_kind, read_log
from titan_recover.titan.jobs import job
from titan_recover.tools.goodput import group_changes, read_capacity_trace

TRACE = Path(__file__).parent / "traces" / "aws-p3-trace.csv"
MIN = 60.0
STEPS = 1_000_000  # every run's training.steps (its learning rate schedule): each is stopped from outside
M = 12  # divisible by every membership 1..4 (stock TorchTitan's restarts need it), one sample a microbatch
SHAPE = [
    "--parallelism.data_parallel_shard_degree",
    "1",
    "--training.local_batch_size",
    "1",
    "--training.global_batch_size",
    str(M),
]
CKPT_EVERY = 25
COMMITTED = '"committed": true'  # a torchft group's committed step in its event log
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replay:
    """How the trace maps onto this machine."""

    start_min: float = 40.0
    minutes: float = 35.0
    compress: float = 6.0
    nodes_per_group: int = 8
    max_groups: int = 4
    notice_s: float = 25.0  # trace seconds before a removal's time stamp
    hard_every: int = 3  # every n-th removal comes without notice

    def real_s(self, trace_s: float) -> float:
        """Seconds into the replay of a trace time."""
        return (trace_s - self.start_min * MIN) / self.compress


@dataclass(frozen=True)
class Action:
    """At ``at`` seconds into the replay: ``start`` a node for group ``replica``, give it its ``notice``, or
    ``kill`` its whole process tree."""

    at: float
    kind: str
    replica: int


def schedule(changes: list[tuple[float, int]], replay: Replay, cap: int, notices: bool) -> tuple[int, list[Action]]:
    """The groups at the window's start and the actions after it. ``cap``: the most groups used (the run's
    maximum); ``notices``: False makes every removal a crash. Joins take the lowest free id (0 is node A's,
    never removed); a fall removes the most recently started groups."""
    start_s, end_s = replay.start_min * MIN, (replay.start_min + replay.minutes) * MIN
    first = max(1, min(cap, _at_start(changes, replay)))
    live, removals, actions = list(range(first)), 0, []
    for t, n in changes:
        if not start_s < t < end_s:
            continue
        want, at = max(1, min(cap, n)), replay.real_s(t)
        while len(live) < want:
            replica = min(set(range(cap)) - set(live))
            live.append(replica)
            actions.append(Action(at, "start", replica))
        while len(live) > want:
            replica = live.pop()
            removals += 1
            if notices and removals % replay.hard_every:
                actions.append(Action(max(0.0, at - replay.notice_s / replay.compress), "notice", replica))
            actions.append(Action(at, "kill", replica))
    return first, sorted(actions, key=lambda a: (a.at, a.kind != "notice"))


@dataclass
class Replayed:
    """One system's replay, as read from its event log."""

    system: str
    groups_at_start: int
    window_s: float  # the replay's seconds here
    trace_s: float  # the trace's seconds they stand for
    steps: int = 0
    leaves: int = 0
    failures: int = 0
    joins: int = 0
    redone_at_most: int = 0
    computed_again: int = 0  # steps logged again (checkpoint-and-restart's work since its last checkpoint)
    m_every_step: bool = True
    digests: dict[int, set[str]] = field(default_factory=dict)  # step -> the replicas' parameter digests
    losses: dict[int, float] = field(default_factory=dict)  # torchft's: step -> loss
    batches: list[int] = field(default_factory=list)  # torchft's: each committed step's global batch (samples)
    actions: list[dict[str, Any]] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "groups_at_start": self.groups_at_start,
            "steps": self.steps,
            "window_s": round(self.window_s, 2),
            "steps_per_trace_hour": round(self.steps * 3600 / self.trace_s, 1),
            "steps_per_hour_here": round(self.steps * 3600 / self.window_s, 1),
            "steps_computed_again": self.computed_again,
            "leaves": self.leaves,
            "failures": self.failures,
            "joins": self.joins,
            "microbatches_redone_at_most": self.redone_at_most,
            "redone_fraction_at_most": round(self.redone_at_most / max(1, self.steps * M), 5),
            "m_every_step": self.m_every_step,
            "actions": self.actions,
        }


def launcher(dump: Path, groups: int, *flags: str) -> list[str]:
    """Every system's job (the same ``training.steps``, so the same learning rates), with ``flags``."""
    return [
        sys.executable,
        "-m",
        "titan_recover.launch",
        *job(dump, tiny=True),
        *SHAPE,
        "--parallelism.data_parallel_replicate_degree",
        str(groups),
        "--training.steps",
        str(STEPS),
        "--metrics.log_freq",
        "50",
        "--recover.fault_plan",
        "none",
        *flags,
    ]


def recover_flags(port: int, max_groups: int, notice_budget_s: float) -> list[str]:
    """titan_recover's: exact mode, a digest every step, nodes' groups restarted only by the nodes the trace
    brings."""
    return [
        "--recover.exact",
        "--recover.digest_interval",
        "1",
        "--recover.max_restarts",
        "0",
        "--recover.max_replicas",
        str(max_groups),
        "--recover.notice_budget_s",
        f"{notice_budget_s:.3f}",
        "--recover.coordinator_port",
        str(port),
        "--recover.coordinator_bind",
        "127.0.0.1",
    ]


class Node:
    """One launcher standing for a trace node, in a session of its own (its tree can be SIGKILLed)."""

    def __init__(self, args: list[str], env: dict[str, str], out: Path) -> None:
        self.proc = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=out.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def notice(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL of its process group and of every process under it (torchrun starts its workers in
        sessions of their own, out of the group's reach; titan_recover's ranks die with their agent anyway)."""
        if self.proc.poll() is None:
            under = descendants(self.proc.pid)
            os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in under:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.proc.wait()


def descendants(pid: int) -> list[int]:
    """The processes under ``pid``, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def steps_logged(events: Path, marker: str = '"event": "step"') -> int:
    return events.read_text().count(marker) if events.exists() else 0


def first_step(events: Path, node: Node, what: str, marker: str = '"event": "step"') -> float:
    """When the run's first step was logged (monotonic): the replay's start."""
    deadline = time.monotonic() + 600
    while steps_logged(events, marker) < 1:
        if time.monotonic() > deadline or node.proc.poll() is not None:
            raise RuntimeError(f"{what}: the run never committed step 1 (exit {node.proc.poll()})")
        time.sleep(0.05)
    return time.monotonic()


def replay(system: str, replay: Replay, changes: list[tuple[float, int]], folder: Path) -> Replayed:
    """One system over the window; node A's run is stopped (SIGKILL of every node) at the window's end."""
    elastic = system == "elastic"
    cap = replay.max_groups if elastic else max(1, min(replay.max_groups, _at_start(changes, replay)))
    first, actions = schedule(changes, replay, cap, notices=elastic)
    dump = folder / system
    port = transport.free_port()
    args = launcher(dump, first, *recover_flags(port, cap, replay.notice_s / replay.compress))
    env = {**os.environ, keys.SECRET_ENV: f"bench-spot-{system}", "PYTHONUNBUFFERED": "1"}
    joined = {**env, keys.COORDINATOR_ENV: f"127.0.0.1:{port}"}
    nodes: dict[int, Node] = {0: Node(args, {**env, keys.REPLICAS_ENV: "0"}, folder / f"{system}-a.log")}
    started = 0

    def start(replica: int) -> None:
        nonlocal started
        started += 1
        out = folder / f"{system}-{replica}-{started}.log"
        nodes[replica] = Node(args, {**joined, keys.REPLICAS_ENV: str(replica)}, out)

    for replica in range(1, first):
        start(replica)
    events = dump / "recover_events.jsonl"
    t0, done = first_step(events, nodes[0], f"{system} (see {folder})"), []
    try:
        for action in actions:
            time.sleep(max(0.0, t0 + action.at - time.monotonic()))
            if nodes[0].proc.poll() is not None:
                raise RuntimeError(f"{system}: node A's run ended (exit {nodes[0].proc.returncode}), see {folder}")
            if action.kind == "start":
                start(action.replica)
            elif action.kind == "notice":
                nodes[action.replica].notice()
            else:
                nodes[action.replica].kill()
            done.append({**asdict(action), "late_s": round(time.monotonic() - t0 - action.at, 3)})
            log.info("%s: %.1fs %s replica %d", system, action.at, action.kind, action.replica)
        time.sleep(max(0.0, t0 + replay.minutes * MIN / replay.compress - time.monotonic()))
        window = time.monotonic() - t0
        alive = nodes[0].proc.poll() is None
    finally:
        for node in nodes.values():
            node.kill()
    if not alive:
        raise RuntimeError(f"{system}: node A's run ended before the window did, see {folder}")
    return read_replay(Replayed(system, first, window, window * replay.compress, actions=done), str(events))


def restarts(plan: Replay, changes: list[tuple[float, int]], folder: Path, ckpt_every: int) -> Replayed:
    """Stock TorchTitan HSDP (``--recover.no-enable``) with a DCP checkpoint every ``ckpt_every`` steps: at
    every change of the group count the whole job is killed (at the removal's time stamp: stock TorchTitan
    does nothing with a notice) and started again on the new count from its latest checkpoint, the global
    batch kept (more accumulation per group)."""
    first, actions = schedule(changes, plan, plan.max_groups, notices=False)
    counts: dict[float, int] = {}
    live = first
    for action in actions:
        live += 1 if action.kind == "start" else -1
        counts[action.at] = live  # actions at one time stamp: one restart
    checkpoints = folder / "restart-checkpoints"  # shared by the jobs; each job's event log is its own
    flags = ["--recover.no-enable", "--checkpoint.enable", "--checkpoint.interval", str(ckpt_every)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done: list[dict[str, Any]] = []

    def start(groups: int) -> Node:
        dump = folder / f"restart-{len(done)}"
        return Node(
            launcher(dump, groups, *flags, "--checkpoint.folder", str(checkpoints)), env, dump.with_suffix(".log")
        )

    job = start(first)
    t0 = first_step(folder / "restart-0" / "recover_events.jsonl", job, f"checkpoint-and-restart (see {folder})")
    try:
        for at, groups in counts.items():
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            job.kill()
            done.append({"at": at, "kind": "restart", "groups": groups, "late_s": round(time.monotonic() - t0 - at, 3)})
            log.info("restart: %.1fs on %d groups", at, groups)
            job = start(groups)
        time.sleep(max(0.0, t0 + plan.minutes * MIN / plan.compress - time.monotonic()))
        window = time.monotonic() - t0
    finally:
        job.kill()
    events = sorted(str(p) for p in folder.glob("restart-*/recover_events.jsonl"))
    return read_replay(Replayed("restart", first, window, window * plan.compress, actions=done), *events)


def torchft_setup(plan: Replay) -> fidelity.Setup:
    """The batch-follows-membership run's job: the same model, data, seed and learning rates, each of the
    ``max_groups`` groups a fixed M / max_groups samples a step (so M with every group, fewer with fewer)."""
    return fidelity.Setup(steps=STEPS, fault_step=0, replicas=plan.max_groups, local_batch=1, global_batch=M)


def torchft_run(plan: Replay, first: int, actions: list[Action], folder: Path, name: str, until: int = 0) -> Replayed:
    """TorchTitan's fault-tolerance trainer (torchft, ``bench.fidelity``'s) on the same schedule: a group
    started for each arrival joins torchft's quorum and heals from a peer; a notice does nothing (torchft has
    no drain path) and the removal SIGKILLs the group; its step is not committed, and the global batch is
    the members' share. ``until``: no actions, stopped once that many steps are committed (the twin)."""
    setup, dump = torchft_setup(plan), folder / name
    dump.mkdir(parents=True)
    for r in range(first, plan.max_groups):  # the start barrier counts the groups the trace brings later as up
        (dump / f"torchft_ready_{r}_0").touch()
    light, _, port = fidelity.lighthouse(setup, dump)
    env, groups, started = fidelity.torchft_env(setup, port), {}, 0

    def start(replica: int) -> None:
        nonlocal started
        started += 1
        cmd = fidelity.torchft_group(setup, replica, "none", dump)
        groups[replica] = Node(cmd, env, folder / f"{name}-{replica}-{started}.log")

    events = dump / "recover_events.jsonl"
    done: list[dict[str, Any]] = []
    try:
        for replica in range(first):
            start(replica)
        t0 = first_step(events, groups[0], f"{name} (see {folder})", COMMITTED)
        end = t0 + (math.inf if until else plan.minutes * MIN / plan.compress)
        for action in [] if until else actions:
            time.sleep(max(0.0, t0 + action.at - time.monotonic()))
            if action.kind == "start":
                start(action.replica)
            elif action.kind == "kill":
                groups[action.replica].kill()
            done.append({**asdict(action), "late_s": round(time.monotonic() - t0 - action.at, 3)})
            log.info("%s: %.1fs %s replica %d", name, action.at, action.kind, action.replica)
        deadline = time.monotonic() + 120 + until
        while time.monotonic() < min(end, deadline) and (
            not until or steps_logged(events, COMMITTED) < until * plan.max_groups
        ):
            time.sleep(0.2)
        window = time.monotonic() - t0
    finally:
        for node in groups.values():
            node.kill()
        fidelity._stop(light)
    return read_torchft(Replayed(name, first, window, window * plan.compress, actions=done), events, plan)


def read_torchft(out: Replayed, events: Path, plan: Replay) -> Replayed:
    """What a torchft run's event log holds: committed steps, replica 0's loss at each, the global batches."""
    logged = read_log(str(events)).events
    steps = fidelity.torchft_steps(torchft_setup(plan), logged)
    out.steps = len(steps)
    out.computed_again = len({e["step"] for e in of_kind(logged, "ft_step") if not e["committed"]})
    # replica 0's own loss: the same samples in both runs (its share of each step), never healing
    out.losses = {s: step.by_replica[0][0] for s, step in steps.items() if 0 in step.by_replica}
    out.batches = [len(steps[s].replicas) * M // plan.max_groups for s in sorted(steps)]
    out.m_every_step = all(b == M for b in out.batches)
    out.failures = sum(a["kind"] == "kill" for a in out.actions)
    out.joins = sum(a["kind"] == "start" for a in out.actions)
    return out


def drift(run: Replayed, reference: Replayed) -> dict[str, Any]:
    """Per-step relative deviation of replica 0's loss (its samples are the same in both runs: this is the
    weights' drift) from the failure-free run's, over the steps both committed."""
    devs = [
        abs(loss - reference.losses[s]) / abs(reference.losses[s])
        for s, loss in sorted(run.losses.items())
        if s in reference.losses
    ]
    return {
        "steps_compared": len(devs),
        "max_rel_loss_dev": max(devs, default=None),
        "median_rel_loss_dev": statistics.median(devs) if devs else None,
        "global_batch_samples": [min(run.batches, default=0), max(run.batches, default=0)],
    }


def _at_start(changes: list[tuple[float, int]], replay: Replay) -> int:
    """The groups the trace makes at the window's start."""
    before = [n for t, n in changes if t <= replay.start_min * MIN]
    if not before:
        raise ValueError(f"the trace starts after minute {replay.start_min}")
    return before[-1]


def read_replay(out: Replayed, *events: str) -> Replayed:
    """What the event logs of one replay hold (a last line cut by the SIGKILL is left out)."""
    read = read_log(*events)
    logged, out.computed_again = read.events, len(of_kind(read.duplicates, "step"))
    steps = of_kind(logged, "step")
    out.steps, out.leaves, out.failures = len(steps), len(of_kind(logged, "left")), len(of_kind(logged, "failure"))
    out.joins = len(of_kind(logged, "rejoined"))
    out.m_every_step = all(len(e["microbatches"]) == M for e in steps)
    members = {e["step"]: len(e["members"]) for e in steps}
    # a crash loses at most the failed group's quota of the step in flight; a leave loses nothing
    out.redone_at_most = sum(-(-M // members.get(f["step"] - 1, 1)) for f in of_kind(logged, "failure"))
    for e in of_kind(logged, "param_digest"):
        out.digests.setdefault(e["step"], set()).add(e["digest"])
    return out


def twin(steps: int, folder: Path) -> dict[int, str]:
    """The failure-free run of one group in exact mode, on the replays' schedule (the same ``training.steps``,
    so the same learning rates), stopped once it committed ``steps``: its parameter digest at every step."""
    dump = folder / "twin"
    args = launcher(dump, 1, *recover_flags(transport.free_port(), 1, 12.0))
    events = dump / "recover_events.jsonl"
    node = Node(args, {**os.environ, keys.SECRET_ENV: "bench-spot-twin"}, folder / "twin.log")
    try:
        deadline = time.monotonic() + 120 + steps  # a step takes well under a second
        while steps_logged(events) < steps + 1:
            if time.monotonic() > deadline or node.proc.poll() is not None:
                raise RuntimeError(f"the twin stopped before step {steps} (exit {node.proc.poll()}), see {folder}")
            time.sleep(0.2)
    finally:
        node.kill()
    return {e["step"]: e["digest"] for e in of_kind(read_log(str(events)).events, "param_digest")}


def exact_verdict(replayed: Replayed, reference: dict[int, str]) -> dict[str, Any]:
    """Every replica's digest of every step the replay committed against the twin's."""
    differ = [s for s, seen in sorted(replayed.digests.items()) if seen != {reference.get(s)}]
    return {"steps_compared": len(replayed.digests), "steps_differing": differ[:20], "equal": not differ}


def run(plan: Replay, systems: list[str], folder: Path, ckpt_every: int) -> dict[str, Any]:
    """Each system over the same window, then the twin over as many steps as the longest titan_recover replay."""
    changes = group_changes(read_capacity_trace(TRACE.read_text()), plan.nodes_per_group, plan.max_groups, 1)

    def one(system: str) -> Replayed:
        if system == "restart":
            return restarts(plan, changes, folder, ckpt_every)
        if system == "membership":
            return torchft_run(plan, *schedule(changes, plan, plan.max_groups, notices=False), folder, system)
        return replay(system, plan, changes, folder)

    replays = [one(system) for system in systems]
    rows = {r.system: r.row() for r in replays}
    ours = [r for r in replays if r.system in ("elastic", "fixed")]
    if ours:
        reference = twin(max(r.steps for r in ours), folder)
        for r in ours:
            rows[r.system]["exact"] = exact_verdict(r, reference)
    for r in replays:
        if r.system == "membership":
            ff = torchft_run(plan, plan.max_groups, [], folder, "membership-twin", until=max(r.losses, default=1))
            rows[r.system]["drift"] = drift(r, ff)
    for row in rows.values():
        log.info(
            "%-10s %5d steps (%.0f per trace hour), %d computed again, %d leaves, %d failures, %d joins, "
            "<= %d microbatches redone, M every step: %s, digests equal to the twin's: %s, drift: %s",
            row["system"], row["steps"], row["steps_per_trace_hour"], row["steps_computed_again"], row["leaves"],
            row["failures"], row["joins"], row["microbatches_redone_at_most"], row["m_every_step"],
            row.get("exact", {}).get("equal", "-"), row.get("drift", {}).get("max_rel_loss_dev", "-"),
        )  # fmt: skip
    return {
        "job": (
            f"the tests' tiny llama3, single-rank replica groups, M = {M} (local batch 1), exact mode, float32 "
            f"on a {os.cpu_count()}-core CPU; one group per {plan.nodes_per_group} trace nodes, 1 to "
            f"{plan.max_groups} groups"
        ),
        "replay": asdict(plan),
        "trace": str(TRACE.relative_to(ROOT)),
        "systems": rows,
    }


def main() -> None:
    logs.setup("bench", __name__, "bench")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--start-min", type=float, default=Replay.start_min)
    parser.add_argument("--minutes", type=float, default=Replay.minutes)
    parser.add_argument("--compress", type=float, default=Replay.compress)
    parser.add_argument("--systems", default="elastic,fixed,restart,membership")
    parser.add_argument("--ckpt-every", type=int, default=CKPT_EVERY, help="checkpoint-and-restart's interval, steps")
    args = parser.parse_args()
    plan = Replay(start_min=args.start_min, minutes=args.minutes, compress=args.compress)
    with tempfile.TemporaryDirectory() as scratch:
        result = run(plan, args.systems.split(","), Path(scratch), args.ckpt_every)
    result["command"] = "python -m bench.spot " + " ".join(sys.argv[1:])
    result |= headlines(result["systems"], plan.max_groups, os.cpu_count() or 1)
    result["simulator"] = spot_trace()
    result["sim_spot_vs_elastic"] = result["simulator"]["tokens_per_hour_vs_elastic"]
    log.info(
        "steps per trace hour / elastic's: %s%s",
        ", ".join(f"{name} {ratio:.3f}" for name, ratio in result["spot_steps_vs_elastic"].items()),
        f" ({result['spot_steps_vs_elastic_caveat']})" if result["spot_steps_vs_elastic_caveat"] else "",
    )
    log.info("-> %s", write_result("spot", result))


def steps_caveat(max_groups: int, cores: int) -> str | None:
    """What the replay's step ratios are not, where the groups outnumber the cores (None where they do not)."""
    if cores >= max_groups:
        return None
    return (
        f"on {cores} cores, up to {max_groups} single-rank groups: more groups add contention, not compute, so "
        "these ratios are not elasticity's gain or loss; the simulator's sim_spot_vs_elastic is"
    )


def headlines(rows: dict[str, dict[str, Any]], max_groups: int, cores: int) -> dict[str, Any]:
    """The report's figures: each system's steps per trace hour against titan_recover elastic's, with its caveat
    on a machine with fewer cores than groups, the exact verdict and the batch-follows-membership run's drift."""
    elastic = rows.get("elastic", {}).get("steps_per_trace_hour")
    return {
        "spot_steps_vs_elastic": {
            name: row["steps_per_trace_hour"] / elastic for name, row in rows.items() if elastic and name != "elastic"
        },
        "spot_steps_vs_elastic_caveat": steps_caveat(max_groups, cores),
        "spot_exact_every_step": all(row["exact"]["equal"] for row in rows.values() if "exact" in row),
        "spot_membership_max_rel_loss_dev": rows.get("membership", {}).get("drift", {}).get("max_rel_loss_dev"),
    }


if __name__ == "__main__":
    main()
