"""Host-memory snapshots on the default job, side by side in one run: what they cost, what they hold, what they save.

The default job (``train_configs/llama3_debug_cpu.toml``: llama3 debugmodel, 2 replica groups x 2 FSDP ranks under
one launcher, CPU float32):

1. Step time: failure-free runs alternating ``recover.snapshot_interval`` 0 (off), 1 and 10 (the default); each
   interval's mean step time (the gaps between consecutive step events after the first ``WARMUP_STEPS``, snapshot
   steps included) over the same round's interval 0, and within each interval-10 run (free of drift between runs)
   the step after a snapshot against the run's other steps (medians). Each snapshot's bytes per rank (its file,
   sampled) and per node (every rank of this launcher copies its shard), the copy's seconds on the step's path and
   the file's on the writer's thread (group rank 0's "previous snapshot" log lines), and what a GPU's host link
   would carry per step (the bytes over the interval).
2. Every replica group lost (each rank SIGKILLed mid-backward at step ``K + K // 2 + 1``, about the mean loss of a
   kill at a uniform time) -> the first step committed after it. From memory: snapshots every K steps; the
   ``resumed`` event's seconds (from the kill) and ``resuming``'s steps computed again. From DCP: the same job and
   kill with snapshots off and a checkpoint every K steps (the same K, so both go back to the same step): the run
   stops FATAL and the same command with no fault plan resumes from the checkpoint at once (on this host, no
   scheduler's delay: a lower bound on a real restart); from the first kill to the second run's first step.
3. Memory per node: the bytes under ``recover.snapshot_dir`` (a private folder under /dev/shm holding this launcher's
   folder) at their peak, sampled every ``SAMPLE_S`` in every run with snapshots.

``--quick``: one round of 12 steps (interval 10 takes one snapshot, whose seconds go unlogged: a write's figures
are logged at the next snapshot), K = 5, the resume runs ending at the lost step; the full run: two rounds of 31 steps
(three snapshots at 10), K = 10.

    .venv/bin/python -m bench.host_memory [--quick]   -> bench/results/host_memory.json
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TypedDict

from bench.common import PRECISION, ROOT, job, step_gaps, write_result
from titan_recover.observability.events import of_kind

WARMUP_STEPS = 3
INTERVALS = (0, 1, 10)
SAMPLE_S = 0.05
RUN_TIMEOUT_S = 900
RANKS_PER_NODE = 4  # the default job's 2 groups x 2 ranks, under one launcher
SNAPSHOT_LINE = re.compile(r"previous snapshot: ([\d.]+) MiB copied in ([\d.]+)s, written in ([\d.]+)s")
MiB = 2**20


class Plan(TypedDict):
    rounds: int  # rounds of the step-time runs, each interval once per round
    steps: int  # steps of a step-time run
    k: int  # snapshot and checkpoint interval of the resume runs
    resume_steps: int  # steps of a resume run


FULL: Plan = {"rounds": 2, "steps": 31, "k": 10, "resume_steps": 20}
QUICK: Plan = {"rounds": 1, "steps": 12, "k": 5, "resume_steps": 8}


class Sampler:
    """Samples the bytes under a folder every ``SAMPLE_S`` on a thread of its own: the peak, and the largest
    complete snapshot file (one rank's state)."""

    def __init__(self, root: Path) -> None:
        self.root, self.peak, self.largest_file = root, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shm-sampler", daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            total = 0
            for folder, _, names in os.walk(self.root):
                for name in names:
                    try:
                        size = os.stat(os.path.join(folder, name)).st_size
                    except FileNotFoundError:  # renamed or pruned meanwhile
                        continue
                    total += size
                    if name.endswith(".snapshot"):
                        self.largest_file = max(self.largest_file, size)
            self.peak = max(self.peak, total)


class Run(TypedDict):
    rc: int
    events: list[dict[str, Any]]
    output: str
    started: float
    ended: float


def launch(dump: Path, args: list[str], what: str, fails: bool = False) -> Run:
    """One launcher run of the default job in ``dump``; its events (the raw lines written since it started: a
    step computed again appears twice), output and wall-clock bounds. Its exit must be 0 unless ``fails``."""
    cmd = [sys.executable, "-m", "titan_recover.launch", *job(dump), *PRECISION, *args]
    started = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    ended = time.time()
    output = proc.stdout + proc.stderr
    if (proc.returncode != 0) != fails:
        raise RuntimeError(f"{what}: exit {proc.returncode}, expected {'non-zero' if fails else 0}:\n{output[-4000:]}")
    path = dump / "recover_events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    events = [e for e in map(json.loads, lines) if e["time"] >= started]
    return {"rc": proc.returncode, "events": events, "output": output, "started": started, "ended": ended}


def kill_step(k: int) -> int:
    """Where every rank is killed with snapshots or checkpoints every ``k`` steps: about half an interval after one,
    the mean loss of a kill at a uniform time."""
    return k + k // 2 + 1


def every_rank_killed(step: int) -> str:
    return "; ".join(f"kill replica={r} rank={k} step={step} phase=backward" for r in (0, 1) for k in (0, 1))


def step_time_run(interval: int, steps: int, shm: Path) -> dict[str, Any]:
    """One failure-free run with snapshots every ``interval`` steps: its mean and median step time, the
    snapshots' sizes and seconds, the folder's peak."""
    args = [
        "--training.steps",
        str(steps),
        "--recover.fault_plan",
        "none",
        "--recover.snapshot_interval",
        str(interval),
    ]
    with tempfile.TemporaryDirectory() as scratch, Sampler(shm) as sampled:
        run = launch(Path(scratch), [*args, "--recover.snapshot_dir", str(shm)], f"snapshot_interval {interval}")
    by_step = step_gaps(of_kind(run["events"], "step")[WARMUP_STEPS:])  # the gap ending at each step
    gaps = list(by_step.values())
    after = [g for s, g in by_step.items() if interval > 1 and (s - 1) % interval == 0]  # the snapshot's next step
    others = [g for s, g in by_step.items() if interval > 1 and (s - 1) % interval]
    logged = [tuple(map(float, m)) for m in SNAPSHOT_LINE.findall(run["output"])]
    return {
        "interval": interval,
        "mean_step_s": statistics.mean(gaps),
        "median_step_s": statistics.median(gaps),
        "gaps_measured": len(gaps),
        # within the run, so free of drift between runs: the step after a snapshot against the run's other steps
        "snapshot_step_extra_s": statistics.median(after) - statistics.median(others) if after and others else None,
        "snapshot_file_bytes": sampled.largest_file or None,
        "payload_mib_logged": logged[0][0] if logged else None,
        "copy_s_median": statistics.median(c for _, c, _ in logged) if logged else None,
        "write_s_median": statistics.median(w for _, _, w in logged) if logged else None,
        "snapshots_logged": len(logged),
        "peak_folder_bytes": sampled.peak,
        "wall_s": run["ended"] - run["started"],
        "gaps_s": {str(s): g for s, g in by_step.items()},
    }


def from_memory(plan: Plan, shm: Path) -> dict[str, Any]:
    """Every rank killed at the plan's step with snapshots every K: the resume from the nodes' memory."""
    k, kill = plan["k"], kill_step(plan["k"])
    args = [
        *("--training.steps", str(plan["resume_steps"]), "--recover.snapshot_interval", str(k)),
        *("--recover.snapshot_dir", str(shm), "--recover.fault_plan", every_rank_killed(kill)),
    ]
    with tempfile.TemporaryDirectory() as scratch, Sampler(shm) as sampled:
        run = launch(Path(scratch), args, "the resume from memory")
    events = run["events"]
    killed = min(e["time"] for e in of_kind(events, "fault_injected"))
    (resuming,) = of_kind(events, "resuming")
    (resumed,) = of_kind(events, "resumed")
    again = [e for e in of_kind(events, "step") if e["time"] > killed]
    lost = next(e for e in again if e["step"] == kill)
    return {
        "kill_step": kill,
        "resumed_from_step": resuming["step"],
        "first_step_s": resumed["seconds"],
        "back_to_lost_step_s": lost["time"] - killed,
        "steps_computed_again": resuming["recomputed"],
        "steps_committed_twice": sum(1 for e in again if e["step"] < kill),
        "peak_folder_bytes": sampled.peak,
        "wall_s": run["ended"] - run["started"],
    }


def from_dcp(plan: Plan) -> dict[str, Any]:
    """The same kill with snapshots off and DCP every K: the run stops, and the same command resumes it."""
    k, kill = plan["k"], kill_step(plan["k"])
    args = [
        *("--training.steps", str(plan["resume_steps"]), "--recover.snapshot_interval", "0"),
        *("--checkpoint.enable", "--checkpoint.interval", str(k), "--checkpoint.no-last-save-model-only"),
    ]
    with tempfile.TemporaryDirectory() as scratch:
        lost = launch(
            Path(scratch), [*args, "--recover.fault_plan", every_rank_killed(kill)], "the DCP run", fails=True
        )
        back = launch(Path(scratch), [*args, "--recover.fault_plan", "none"], "the DCP restart")
    if not of_kind(lost["events"], "fatal"):
        raise RuntimeError("the DCP run failed without its FATAL stop:\n" + lost["output"][-4000:])
    killed = min(e["time"] for e in of_kind(lost["events"], "fault_injected"))
    last_committed = max(e["step"] for e in of_kind(lost["events"], "step"))
    steps = of_kind(back["events"], "step")
    return {
        "kill_step": kill,
        "resumed_from_step": steps[0]["step"] - 1,
        "first_step_s": steps[0]["time"] - killed,
        "stopped_s": lost["ended"] - killed,  # the kill to the FATAL command's exit
        "back_to_lost_step_s": next(e for e in steps if e["step"] == kill)["time"] - killed,
        "steps_computed_again": sum(1 for e in steps if e["step"] <= last_committed),
        "wall_s": lost["ended"] - lost["started"] + back["ended"] - back["started"],
    }


def seconds(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.3f}s"


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def run(plan: Plan, shm: Path) -> dict[str, Any]:
    rounds = []
    for i in range(plan["rounds"]):
        order = INTERVALS if i % 2 == 0 else INTERVALS[::-1]  # alternate which goes first
        row = {}
        for interval in order:
            row[interval] = step_time_run(interval, plan["steps"], shm)
            r = row[interval]
            print(
                f"round {i + 1} interval {interval:2d}: mean step {r['mean_step_s']:.3f}s (median "
                f"{r['median_step_s']:.3f}s), snapshot file {r['snapshot_file_bytes']} B, copy (median) "
                f"{seconds(r['copy_s_median'])}, step after a snapshot {seconds(r['snapshot_step_extra_s'])} longer, "
                f"peak folder {r['peak_folder_bytes'] / MiB:.1f} MiB",
                flush=True,
            )
        rounds.append(row)
    ratios = {n: spread([r[n]["mean_step_s"] / r[0]["mean_step_s"] for r in rounds]) for n in INTERVALS if n}
    memory = from_memory(plan, shm)
    print(f"from memory: {memory}", flush=True)
    dcp = from_dcp(plan)
    print(f"from DCP: {dcp}", flush=True)
    with_snapshots = [r[n] for r in rounds for n in INTERVALS if n]
    rank_bytes = max(r["snapshot_file_bytes"] or 0 for r in with_snapshots)
    step_s = statistics.median(r[0]["mean_step_s"] for r in rounds)
    copies = [r["copy_s_median"] for r in with_snapshots if r["copy_s_median"] is not None]
    writes = [r["write_s_median"] for r in with_snapshots if r["write_s_median"] is not None]
    extra = [e for r in rounds if (e := r[10]["snapshot_step_extra_s"]) is not None]
    peak = max([memory["peak_folder_bytes"], *(r["peak_folder_bytes"] for r in with_snapshots)])
    return {
        "setup": {
            "config": "train_configs/llama3_debug_cpu.toml",
            "device": "cpu",
            "precision": PRECISION[-1],
            "replica_groups": 2,
            "ranks_per_group": 2,
            "ranks_per_node": RANKS_PER_NODE,
            "snapshot_keep": 1,
            "warmup_steps_skipped": WARMUP_STEPS,
            "intervals": list(INTERVALS),
            "kill": "every rank of both groups SIGKILLed mid-backward at kill_step",
            **plan,
        },
        "step_time_ratio_vs_off": {str(n): v for n, v in ratios.items()},
        "snapshot_default_step_time_ratio": ratios[10]["median"],
        "snapshot_every_step_time_ratio": ratios[1]["median"],
        "snapshot_default_step_extra_s": statistics.median(extra) if extra else None,
        "snapshot_bytes_per_rank": rank_bytes,
        "snapshot_bytes_per_node": rank_bytes * RANKS_PER_NODE,
        "snapshot_bytes_note": "per rank: one snapshot file (its shard's state and header); per node: what this "
        "launcher's 4 ranks copy at each snapshot (both groups, both shards; the folder keeps one file per shard)",
        "snapshot_copy_s_median": statistics.median(copies) if copies else None,
        "snapshot_write_s_median": statistics.median(writes) if writes else None,
        "host_link_bytes_per_step_per_rank": {str(n): rank_bytes / n for n in INTERVALS if n},
        "host_link_bytes_per_s_per_rank": {str(n): rank_bytes / (n * step_s) for n in INTERVALS if n},
        "host_link_note": "bytes a GPU's host link would carry per step at each interval (one rank's state over the "
        "interval), and per second at this CPU's failure-free step time; here the copy is a CPU memcpy",
        "peak_node_bytes": peak,
        "peak_node_copies_of_rank_state": peak / rank_bytes if rank_bytes else None,
        "from_memory": memory,
        "from_dcp": dcp,
        "host_memory_resume_s": memory["first_step_s"],
        "host_memory_dcp_restart_s": dcp["first_step_s"],
        "resume_memory_vs_dcp_ratio": memory["first_step_s"] / dcp["first_step_s"],
        "rounds": [{str(n): v for n, v in r.items()} for r in rounds],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round of 12 steps, K = 5")
    plan = QUICK if parser.parse_args().quick else FULL
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    shm = Path(tempfile.mkdtemp(prefix="bench-host-memory-", dir=base))  # this bench's launchers' folders only
    try:
        result = run(plan, shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    path = write_result("host_memory", result)
    for n, r in result["step_time_ratio_vs_off"].items():
        print(f"step time snapshot_interval {n} / 0: median {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f})")
    print(
        "interval 10, within its runs: the step after a snapshot "
        f"{seconds(result['snapshot_default_step_extra_s'])} longer than the others"
    )
    per_rank = result["snapshot_bytes_per_rank"]
    print(
        f"each snapshot: {per_rank / MiB:.1f} MiB per rank, {result['snapshot_bytes_per_node'] / MiB:.1f} MiB per node "
        f"({RANKS_PER_NODE} ranks), copy (median) {seconds(result['snapshot_copy_s_median'])}; "
        "host link per rank per step: "
        + ", ".join(f"interval {n}: {b / MiB:.2f} MiB" for n, b in result["host_link_bytes_per_step_per_rank"].items())
    )
    print(
        f"peak under the snapshot folder: {result['peak_node_bytes'] / MiB:.1f} MiB "
        f"({result['peak_node_copies_of_rank_state']:.1f} x one rank's state)"
    )
    m, d = result["from_memory"], result["from_dcp"]
    print(
        f"every group lost at step {m['kill_step']}, K = {plan['k']}: from memory first step {m['first_step_s']:.1f}s "
        f"({m['steps_computed_again']} step(s) again), from DCP {d['first_step_s']:.1f}s ({d['steps_computed_again']} "
        f"again); ratio {result['resume_memory_vs_dcp_ratio']:.2f}; wrote {path}"
    )


if __name__ == "__main__":
    main()
