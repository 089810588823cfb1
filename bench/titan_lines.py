"""Both TorchTitan lines side by side: the default job on TorchTitan 0.2.2 (TOML) and 0.3.0 (recipes).

Each line is measured in its own environment (``./.venv``, ``./.venv-0.3.0``; ``scripts/bootstrap.sh``
makes a missing one), one line after the other on the same machine:

- failure-free step time with and without recover mode, alternated in pairs as ``bench.overhead``
  runs them (``overhead_ratio``: recover / stock, the median over pairs);
- the default job's own failure (a rank of replica 1 killed at step 5, restart, rejoin) against its
  failure-free twin: recovery latency, rejoin downtime, the max relative loss deviation.

    .venv/bin/python -m bench.titan_lines [--pairs 2] [--steps 20]   -> bench/results/titan_lines.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from importlib import metadata

from bench import overhead
from bench.common import PRECISION, ROOT, launch, write_result
from titan_recover.compare import compare_runs
from titan_recover.observability.events import of_kind

LINES = {"0.2.2": ".venv", "0.3.0": ".venv-0.3.0"}
"""$TORCHTITAN values and their environments (scripts/bootstrap.sh)."""


def measure_line(pairs: int, steps: int) -> dict:
    """This environment's line: the overhead pairs, then the kill run and its failure-free twin."""
    import torch

    rows = [
        {"stock": overhead.measure("stock", steps, []), "recover": overhead.measure("recover", steps, [])}
        for _ in range(pairs)
    ]
    ratios = [r["recover"]["step_s"] / r["stock"]["step_s"] for r in rows]
    kill, kill_wall = launch(PRECISION, "the default job (its kill at step 5)")
    twin, twin_wall = launch(["--recover.fault_plan", "none", *PRECISION], "its failure-free twin")
    comparison = compare_runs(twin, kill, rel_tol=1e-6)
    return {
        "torchtitan": metadata.version("torchtitan"),
        "torch": torch.__version__,
        "pairs": rows,
        "overhead_ratio": statistics.median(ratios),
        "overhead_ratios": ratios,
        "recovery_latency_s": [e["latency_s"] for e in of_kind(kill, "recovered")],
        "rejoin_downtime_s": [e["downtime_s"] for e in of_kind(kill, "rejoined")],
        "failures": len(of_kind(kill, "failure")),
        "steps": len(of_kind(kill, "step")),
        "max_rel_loss_dev": comparison.max_rel_loss_dev,
        "comparison_problems": comparison.problems,
        "wall_s": {"kill_run": kill_wall, "failure_free_twin": twin_wall},
    }


def run_line(line: str, pairs: int, steps: int) -> dict:
    """``measure_line`` in ``line``'s environment, made first when missing."""
    env = {**os.environ, "TORCHTITAN": line}
    subprocess.run(["bash", "-c", "source ./scripts/bootstrap.sh"], cwd=ROOT, env=env, check=True)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        python = str(ROOT / LINES[line] / "bin" / "python")
        subprocess.run(
            [python, "-m", "bench.titan_lines", "--one", out.name, "--pairs", str(pairs), "--steps", str(steps)],
            cwd=ROOT,
            env=env,
            check=True,
        )
        return json.loads(open(out.name).read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # measure this environment's line into this file
    args = parser.parse_args()
    if args.one:
        with open(args.one, "w") as f:
            json.dump(measure_line(args.pairs, args.steps), f)
        return
    lines = {}
    for line in LINES:
        lines[line] = result = run_line(line, args.pairs, args.steps)
        print(
            f"TorchTitan {line}: overhead_ratio {result['overhead_ratio']:.3f} {result['overhead_ratios']}, "
            f"recovery {result['recovery_latency_s']} s, rejoin downtime {result['rejoin_downtime_s']} s, "
            f"max rel loss dev {result['max_rel_loss_dev']:.2e}",
            flush=True,
        )
    path = write_result(
        "titan_lines",
        {
            "setup": {
                "job": "the default job (llama3 debugmodel, 2 groups x 2 FSDP ranks, M = 4) on each line",
                "precision": PRECISION[-1],
                "pairs": args.pairs,
                "overhead_steps": args.steps,
                "cpus": os.cpu_count(),
                "command": "python -m bench.titan_lines " + " ".join(sys.argv[1:]),
            },
            "lines": lines,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
