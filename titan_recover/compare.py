"""Checks a run's event log against a reference run's: the trajectory invariant.

Every step committed once, every step summing microbatches 0..M-1, the same
``data_digest`` per step as the reference, and losses within a relative tolerance. A step's
line logged again (lines are written at least once, see ``events``) is counted once; the steps a resume
from host memory computed again count as their second commit. With
``--exact`` (runs with ``[recover] exact``) every loss must be the same bits, and every parameter
digest a replica logged must equal the reference's at that step.

    python -m titan_recover.compare REFERENCE RUN [--rel-tol 1e-3 | --exact]
    (each an event log, or a dump folder: every node's event log in it)
"""

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

from titan_recover.control.keys import EXIT_FAILED, EXIT_OK
from titan_recover.observability.events import Log, event_files, read_log, undo_resumed


@dataclass
class Comparison:
    """``exact``: mismatches of what must be equal bit for bit (steps, microbatches, data);
    ``loss``: steps whose loss is off by more than the tolerance. Kept apart because over
    hundreds of steps float rounding alone (another summation order) moves the loss."""

    steps: int = 0
    digest_steps: int = 0  # steps whose parameter digests were compared (``exact``)
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


def _digests(events: Iterable[dict[str, Any]]) -> dict[int, set[str]]:
    """Step -> the parameter digests its replicas logged."""
    out: dict[int, set[str]] = {}
    for e in events:
        if e["event"] == "param_digest":
            out.setdefault(e["step"], set()).add(e["digest"])
    return out


def compare_runs(
    reference: Iterable[dict[str, Any]], run: Iterable[dict[str, Any]], rel_tol: float, exact: bool = False
) -> Comparison:
    """``exact``: losses compared bit for bit (``rel_tol`` unused), and the parameter digests too."""
    (reference, _), (run, _) = undo_resumed(reference), undo_resumed(run)  # a resume's steps count once, as redone
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
        if exact and g["loss"] != r["loss"]:
            out.exact.append(f"step {step}: loss {float(g['loss']).hex()} != {float(r['loss']).hex()} (rel {rel:.2e})")
        elif not exact and rel > rel_tol:
            out.loss[step] = f"step {step}: loss {g['loss']:.6f} vs {r['loss']:.6f} (rel {rel:.2e})"
        out.steps += 1
    if not out.steps:
        out.exact.append(
            "no step committed in both runs: nothing was compared (did both runs die before their first step?)"
        )
    if exact:
        _compare_digests(_digests(reference), _digests(run), out)
    return out


def _compare_digests(ref: dict[int, set[str]], got: dict[int, set[str]], out: Comparison) -> None:
    for step in sorted(set(ref) & set(got)):
        if len(ref[step]) != 1:
            out.exact.append(f"step {step}: the reference's replicas disagree: {sorted(ref[step])}")
        elif got[step] != ref[step]:
            out.exact.append(f"step {step}: parameter digests {sorted(got[step])} != {sorted(ref[step])}")
        out.digest_steps += 1
    if not out.digest_steps:
        out.exact.append("no step has parameter digests in both runs: run both with recover.digest_interval 1")


def _read(path: str) -> Log:
    """An event log, or every node's event log in a dump folder."""
    if not os.path.isdir(path):
        return read_log(path)
    files = event_files(path)
    if not files:
        raise ValueError(f"{path} holds no event log (recover_events*.jsonl): name a run's dump folder or its log")
    return read_log(*files)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference", help="an event log, or a dump folder")
    parser.add_argument("run", help="an event log, or a dump folder")
    parser.add_argument("--rel-tol", type=float, default=1e-3)
    parser.add_argument(
        "--exact",
        action="store_true",
        help="losses and parameter digests must be the same bits (runs with [recover] exact)",
    )
    args = parser.parse_args(argv)
    try:
        reference, run = _read(args.reference), _read(args.run)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    for log in (reference, run):
        if log.duplicates:
            print(f"note {', '.join(log.files)}: {len(log.duplicates)} line(s) logged again, counted once")
        if log.skipped:
            print(f"note: {len(log.skipped)} line(s) that are no event skipped, the first {log.skipped[0]}")
    c = compare_runs(reference.events, run.events, args.rel_tol, exact=args.exact)
    for p in c.problems:
        print(f"MISMATCH {p}")
    digests = f", parameter digests of {c.digest_steps} steps" if args.exact else ""
    print(
        f"{c.steps} steps compared{digests}, max relative loss deviation {c.max_rel_loss_dev:.2e}: "
        f"{('the same bits' if args.exact else 'same trajectory') if not c.problems else 'DIFFERENT'}"
    )
    return EXIT_FAILED if c.problems else EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
