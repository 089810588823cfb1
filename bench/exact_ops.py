"""Where ``[recover] exact``'s time goes, op by op, beside the plain job's (issue 41, item 6).

For each microbatch length the default job runs failure-free in interleaved pairs, exact off and on,
and the ratio of their median step times is printed. Then each mode runs once more with TorchTitan's
profiler on its last step: replica 0 rank 0's trace is summed by op (self time: an op's duration less
its children's), so the table shows which ops exact mode adds or makes longer, in ms per step.

    .venv/bin/python -m bench.exact_ops [--seq-lens 128 2048] [--pairs 2] [--steps 6]

A long microbatch is one sequence per rank (``local_batch_size`` 1, M = 2): fixed work per step.
Writes bench/results/exact_ops.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from bench.common import FLAGS, PRECISION, launch, write_result
from bench.exact import step_time

log = logging.getLogger("titan_recover.bench.exact_ops")

MODES = {"plain": [], "exact": ["--recover.exact"]}
TOP = 12  # the ops with the largest exact - plain difference that the table and the result keep


def self_ms(trace: dict) -> tuple[dict[str, float], float]:
    """Per op name its self time summed over the trace's CPU threads, and the profiled step's
    length (TorchTitan's ``ProfilerStep`` annotation), in ms."""
    threads: dict[int, list[dict]] = defaultdict(list)
    step_ms = 0.0
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "cpu_op":
            threads[e["tid"]].append(e)
        elif str(e.get("name", "")).startswith("ProfilerStep#"):
            step_ms = max(step_ms, e["dur"] / 1000)
    totals: dict[str, float] = defaultdict(float)
    for events in threads.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ops: list[tuple[float, str]] = []  # (end, name) of the ops enclosing the next one
        for e in events:
            while open_ops and open_ops[-1][0] <= e["ts"]:
                open_ops.pop()
            if open_ops:
                totals[open_ops[-1][1]] -= e["dur"]
            totals[e["name"]] += e["dur"]
            open_ops.append((e["ts"] + e["dur"], e["name"]))
    return {name: us / 1000 for name, us in totals.items()}, step_ms


def profiled(shape: list[str], mode: str, steps: int) -> tuple[dict[str, float], float]:
    """One failure-free run of ``mode`` with the profiler on its last step: replica 0 rank 0's op times."""
    section = FLAGS["profiler"]
    with tempfile.TemporaryDirectory() as dump:
        launch([*shape, *MODES[mode], f"{section}.enable_profiling", f"{section}.profile_freq", str(steps),
                f"{section}.save_traces_folder", "traces"], f"{mode}, profiled", dump=Path(dump))
        (trace,) = Path(dump, "traces", "replica0").glob("iteration_*/rank0_trace.json")
        return self_ms(json.loads(trace.read_text()))


def split(seq_len: int, pairs: int, steps: int) -> dict:
    """The step-time ratio at ``seq_len`` and the per-op table behind it."""
    sizes = [] if seq_len <= 128 else ["--training.local_batch_size", "1", "--training.global_batch_size", "4"]
    shape = [*PRECISION, "--recover.fault_plan", "none", "--training.steps", str(steps),
             "--training.seq_len", str(seq_len), *sizes]
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(pairs):
        for mode, extra in MODES.items():
            events, _ = launch([*shape, *extra], f"seq_len {seq_len}, {mode}")
            times[mode].append(step_time(events))
            log.info(f"seq_len {seq_len} pair {i}: {mode} {times[mode][-1]:.3f} s/step")
    ops = {mode: profiled(shape, mode, steps) for mode in MODES}
    (plain, plain_step), (exact, exact_step) = ops["plain"], ops["exact"]
    names = sorted(set(plain) | set(exact), key=lambda n: exact.get(n, 0.0) - plain.get(n, 0.0), reverse=True)[:TOP]
    table = {n: {"plain_ms": round(plain.get(n, 0.0), 2), "exact_ms": round(exact.get(n, 0.0), 2)} for n in names}
    ratio = statistics.median(times["exact"]) / statistics.median(times["plain"])
    log.info(f"seq_len {seq_len}: exact/plain step time {ratio:.3f}; profiled step {plain_step:.0f} ms plain, "
             f"{exact_step:.0f} ms exact; ops exact adds most to (ms per step, plain -> exact):")
    for n, row in table.items():
        log.info(f"  {n:<40} {row['plain_ms']:>9.2f} -> {row['exact_ms']:>9.2f}")
    return {"seq_len": seq_len, "exact_step_time_ratio": round(ratio, 3),
            "step_time_s": {mode: [round(t, 4) for t in ts] for mode, ts in times.items()},
            "profiled_step_ms": {"plain": round(plain_step, 1), "exact": round(exact_step, 1)}, "ops": table}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[128, 2048])
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="steps of each run (the first two are left out of step times)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[exact_ops] %(message)s", stream=sys.stdout)
    rows = [split(s, a.pairs, a.steps) for s in a.seq_lens]
    path = write_result("exact_ops", {
        "issue": 41, "command": "python -m bench.exact_ops " + " ".join(argv if argv is not None else sys.argv[1:]),
        "precision": PRECISION[-1], "device": "cpu", "rows": rows})
    log.info(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
