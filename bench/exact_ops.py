"""Where ``[recover] exact``'s time goes, op by op, beside the plain job's (issue 41, item 6).

For each microbatch length the default job runs failure-free in interleaved pairs, exact off and on,
and the ratio of their median step times is printed. Then each mode runs once more with TorchTitan's
profiler on its last step: in replica 0 rank 0's trace, the time inside exact mode's annotations
(``exact.add`` per microbatch, ``exact.scale`` per step) and each op's self time there (its duration
less its children's), in ms per step. (A difference of whole steps' op times would be mostly the
noise of 4 ranks sharing 2 cores.)

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
from typing import Any

from bench.common import FLAGS, PRECISION, device, launch, write_result
from bench.exact import step_time
from titan_recover.observability import logs

log = logging.getLogger(__name__)

MODES = {"plain": [], "exact": ["--recover.exact"]}
TOP = 10  # exact mode's own ops that the log and the result keep, the longest first


def op_times(trace: dict) -> dict[str, Any]:
    """A profiler trace's figures in ms: ``step`` (TorchTitan's ``ProfilerStep`` annotation), ``ops`` (each
    op's self time, its duration less its child ops', summed over the CPU threads), ``exact`` (the same for
    the ops inside exact mode's ``exact.*`` annotations) and ``scopes`` (each annotation's whole time)."""
    threads: dict[int, list[dict]] = defaultdict(list)
    out: dict[str, Any] = {
        "step": 0.0,
        "ops": defaultdict(float),
        "exact": defaultdict(float),
        "scopes": defaultdict(float),
    }
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            threads[e["tid"]].append(e)
    for events in threads.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        frames: list[tuple[float, dict, bool]] = []  # (end, event, inside exact.*) of what encloses the next one
        for e in events:
            while frames and frames[-1][0] <= e["ts"]:
                frames.pop()
            inside = bool(frames) and frames[-1][2]
            ms = e["dur"] / 1000
            if e["cat"] == "user_annotation":
                if e["name"].startswith("ProfilerStep#"):
                    out["step"] = max(out["step"], ms)
                if e["name"].startswith("exact."):
                    out["scopes"][e["name"]] += ms
                    inside = True
            else:
                parent = next((f for f in reversed(frames) if f[1]["cat"] == "cpu_op"), None)
                for table in ("ops", "exact") if inside else ("ops",):
                    out[table][e["name"]] += ms
                    if parent is not None and (table == "ops" or parent[2]):
                        out[table][parent[1]["name"]] -= ms
            frames.append((e["ts"] + e["dur"], e, inside))
    return {k: round(v, 3) if isinstance(v, float) else {n: round(t, 3) for n, t in v.items()} for k, v in out.items()}


def profiled(shape: list[str], mode: str, steps: int) -> dict[str, Any]:
    """One failure-free run of ``mode`` with the profiler on its last step: replica 0 rank 0's figures."""
    section = FLAGS["profiler"]
    with tempfile.TemporaryDirectory() as dump:
        launch(
            [
                *shape,
                *MODES[mode],
                f"{section}.enable_profiling",
                f"{section}.profile_freq",
                str(steps),
                f"{section}.save_traces_folder",
                "traces",
            ],
            f"{mode}, profiled",
            dump=Path(dump),
        )
        (trace,) = Path(dump, "traces", "replica0").glob("iteration_*/rank0_trace.json")
        return op_times(json.loads(trace.read_text()))


def split(seq_len: int, pairs: int, steps: int) -> dict:
    """The step-time ratio at ``seq_len`` and, from one profiled step, what exact mode's own ops take."""
    sizes = [] if seq_len <= 128 else ["--training.local_batch_size", "1", "--training.global_batch_size", "4"]
    shape = [
        *PRECISION,
        "--recover.fault_plan",
        "none",
        "--training.steps",
        str(steps),
        "--training.seq_len",
        str(seq_len),
        *sizes,
    ]
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(pairs):
        for mode, extra in MODES.items():
            events, _ = launch([*shape, *extra], f"seq_len {seq_len}, {mode}")
            times[mode].append(step_time(events))
            log.info(f"seq_len {seq_len} pair {i}: {mode} {times[mode][-1]:.3f} s/step")
    ratio = statistics.median(times["exact"]) / statistics.median(times["plain"])
    plain, exact = (profiled(shape, mode, steps) for mode in MODES)
    own = dict(sorted(exact["exact"].items(), key=lambda kv: -kv[1])[:TOP])
    log.info(
        f"seq_len {seq_len}: exact/plain step time {ratio:.3f}; profiled step {plain['step']:.0f} ms plain, "
        f"{exact['step']:.0f} ms exact, of which " + ", ".join(f"{n} {ms:.1f} ms" for n, ms in exact["scopes"].items())
    )
    for name, ms in own.items():
        log.info(f"  {name:<28} {ms:>8.2f} ms")
    return {
        "seq_len": seq_len,
        "exact_step_time_ratio": round(ratio, 3),
        "step_time_s": {mode: [round(t, 4) for t in ts] for mode, ts in times.items()},
        "profiled_step_ms": {"plain": plain["step"], "exact": exact["step"]},
        "exact_scopes_ms": exact["scopes"],
        "exact_ops_ms": own,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[128, 2048])
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="steps of each run (the first two are left out of step times)")
    a = p.parse_args(argv)
    logs.setup("bench", __name__, "bench")
    rows = [split(s, a.pairs, a.steps) for s in a.seq_lens]
    path = write_result(
        "exact_ops",
        {
            "issue": 41,
            "command": "python -m bench.exact_ops " + " ".join(argv if argv is not None else sys.argv[1:]),
            "precision": PRECISION[-1],
            "device": device(),
            "rows": rows,
        },
    )
    log.info(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
