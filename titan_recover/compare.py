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
    """``exact``: mismatches of what must be equal bit for bit (steps, microbatches, data);
    ``loss``: steps whose loss is off by more than the tolerance. Kept apart because over
    hundreds of steps float rounding alone (another summation order) moves the loss."""

    steps: int = 0
    max_rel_loss_dev: float = 0.0
    exact: list[str] = field(default_factory=list)
    loss: dict[int, str] = field(default_factory=dict)  # step -> what is off

    @property
    def problems(self) -> list[str]:
        return self.exact + list(self.loss.values())


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
    ref, got = _steps(reference, "reference", out.exact), _steps(run, "run", out.exact)
    if sorted(ref) != sorted(got):
        out.exact.append(f"steps differ: reference {sorted(ref)}, run {sorted(got)}")
    for step in sorted(set(ref) & set(got)):
        r, g = ref[step], got[step]
        m = len(r["microbatches"])
        if g["microbatches"] != list(range(m)):
            out.exact.append(f"step {step}: microbatches {g['microbatches']}, expected 0..{m - 1}")
        if g["data_digest"] != r["data_digest"]:
            out.exact.append(f"step {step}: data_digest {g['data_digest']} != {r['data_digest']}")
        rel = abs(g["loss"] - r["loss"]) / abs(r["loss"])
        out.max_rel_loss_dev = max(out.max_rel_loss_dev, rel)
        if rel > rel_tol:
            out.loss[step] = f"step {step}: loss {g['loss']:.6f} vs {r['loss']:.6f} (rel {rel:.2e})"
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
