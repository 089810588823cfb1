"""Checks a run's event log against a reference run's: the trajectory invariant.

Every step committed once, every step summing microbatches 0..M-1, the same
``data_digest`` per step as the reference, and losses within a relative tolerance.

    python -m titan_recover.compare REFERENCE.jsonl RUN.jsonl [--rel-tol 1e-3]
"""

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

from titan_recover.events import read_events


@dataclass
class Comparison:
    steps: int = 0
    max_rel_loss_dev: float = 0.0
    problems: list[str] = field(default_factory=list)


def _steps(events: Iterable[dict[str, Any]], name: str, problems: list[str]) -> dict[int, dict[str, Any]]:
    steps: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["event"] == "step":
            if e["step"] in steps:
                problems.append(f"{name}: step {e['step']} committed twice")
            steps[e["step"]] = e
    return steps


def compare_runs(reference: Iterable[dict[str, Any]], run: Iterable[dict[str, Any]], rel_tol: float) -> Comparison:
    out = Comparison()
    ref, got = _steps(reference, "reference", out.problems), _steps(run, "run", out.problems)
    if sorted(ref) != sorted(got):
        out.problems.append(f"steps differ: reference {sorted(ref)}, run {sorted(got)}")
    for step in sorted(set(ref) & set(got)):
        r, g = ref[step], got[step]
        m = len(r["microbatches"])
        if g["microbatches"] != list(range(m)):
            out.problems.append(f"step {step}: microbatches {g['microbatches']}, expected 0..{m - 1}")
        if g["data_digest"] != r["data_digest"]:
            out.problems.append(f"step {step}: data_digest {g['data_digest']} != {r['data_digest']}")
        rel = abs(g["loss"] - r["loss"]) / abs(r["loss"])
        out.max_rel_loss_dev = max(out.max_rel_loss_dev, rel)
        if rel > rel_tol:
            out.problems.append(f"step {step}: loss {g['loss']:.6f} vs {r['loss']:.6f} (rel {rel:.2e})")
        out.steps += 1
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference")
    parser.add_argument("run")
    parser.add_argument("--rel-tol", type=float, default=1e-3)
    args = parser.parse_args(argv)
    c = compare_runs(read_events(args.reference), read_events(args.run), args.rel_tol)
    for p in c.problems:
        print(f"MISMATCH {p}")
    print(f"{c.steps} steps compared, max relative loss deviation {c.max_rel_loss_dev:.2e}: "
          f"{'same trajectory' if not c.problems else 'DIFFERENT'}")
    return 1 if c.problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
