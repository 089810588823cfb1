"""The GPU check's verdicts (``bench/gpu_check.sh`` runs everything, then this): reads what the runs left in
the check's folder and writes ``summary.json`` there, one entry per part, each with ``passed`` and its
figures, and logs a line per part.

- the kill pairs of ``bench/nccl.sh`` (dense mid all-reduce, MoE EP 2 mid-forward, exact mode mid-backward):
  every step once, M microbatches, the twin's data digest and losses (exact: bits and parameter digests);
- the survivor of a replicate peer's death, alive and committing well past the shortened heartbeat timeout;
  beside it the same run with TorchTitan's dump on timeout back on (what the preflight refuses): recorded,
  it passes either way (on a CPU there is no NCCL monitor to kill it);
- the node self-test's JSON; ``bench.exact_ops``'s ratios; the standalone NCCL reproduction's lines.

    python -m bench.gpu_check FOLDER [--heartbeat-s 30]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from titan_recover.compare import compare_runs
from titan_recover.observability import logs
from titan_recover.observability.events import read_events

PAIRS = {"dense": False, "moe_ep2": False, "exact_dense": True}  # name: exact
MARGIN_S = 10.0  # the survivor must commit this long past the heartbeat timeout
log = logging.getLogger(__name__)


def events(folder: Path, name: str) -> list[dict[str, Any]]:
    path = folder / f"{name}.jsonl"
    return list(read_events(str(path))) if path.exists() else []


def exit_code(folder: Path, name: str) -> int | None:
    path = folder / f"{name}.rc"
    return int(path.read_text()) if path.exists() else None


def pair(folder: Path, name: str, exact: bool) -> dict[str, Any]:
    ref, run = events(folder, f"{name}_ref"), events(folder, f"{name}_kill")
    codes = {"twin": exit_code(folder, f"{name}_ref"), "kill": exit_code(folder, f"{name}_kill")}
    compared = compare_runs(ref, run, rel_tol=1e-3, exact=exact)
    failures = [e for e in run if e["event"] == "failure"]
    rejoined = [e for e in run if e["event"] == "rejoined"]
    problems = [f"{who} exited with code {code}" for who, code in codes.items() if code != 0] + compared.problems
    if not failures:
        problems.append("the kill was never seen as a failure")
    return {
        "passed": not problems,
        "problems": problems,
        "exit_codes": codes,
        "steps_compared": compared.steps,
        "max_rel_loss_dev": compared.max_rel_loss_dev,
        "failures": [f"replica {e['replica']} at step {e['step']}: {e['cause']}" for e in failures],
        "rejoined": [{k: e.get(k) for k in ("replica", "step", "downtime_s", "transfer_s")} for e in rejoined],
    }


def survivor(folder: Path, name: str, heartbeat_s: float) -> dict[str, Any]:
    """How long replica 0 went on committing after replica 1's death, and how its run ended."""
    run = events(folder, name)
    code = exit_code(folder, name)
    failure = next((e for e in run if e["event"] == "failure"), None)
    steps = [e for e in run if e["event"] == "step"]
    after = max((e["time"] for e in steps), default=0.0) - failure["time"] if failure else None
    problems = [] if code == 0 else [f"exited with code {code}"]
    if failure is None:
        problems.append("the kill was never seen as a failure")
    elif after is None or after < heartbeat_s + MARGIN_S:
        problems.append(f"its last step came {after:.1f}s after the failure, not past {heartbeat_s + MARGIN_S:g}s")
    return {
        "passed": not problems,
        "problems": problems,
        "exit_code": code,
        "steps": len({e["step"] for e in steps}),
        "committing_s_after_failure": None if after is None else round(after, 1),
        "heartbeat_timeout_s": heartbeat_s,
    }


def read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--heartbeat-s", type=float, default=30.0)
    args = parser.parse_args(argv)
    nccl = args.folder / "logs" / "nccl"
    parts: dict[str, Any] = {f"pair {name}": pair(nccl, name, exact) for name, exact in PAIRS.items()}
    parts["survivor"] = survivor(nccl, "survivor", args.heartbeat_s)
    control = survivor(nccl, "survivor_dump_on", args.heartbeat_s)
    parts["survivor with dump on timeout (recorded)"] = {**control, "passed": True, "as_run": control["passed"]}
    selftest = read_json(args.folder / "selftest.json")
    parts["self-test"] = {"passed": bool(selftest and selftest["passed"]), "ran": selftest is not None}
    exact_ops = read_json(args.folder / "exact_ops.json")
    parts["exact_ops"] = {"passed": exact_ops is not None, "rows": exact_ops and exact_ops["rows"]}
    repro = args.folder / "logs" / "nccl_repro.txt"
    parts["nccl_repro"] = {"passed": True, "lines": repro.read_text().splitlines()[-60:] if repro.exists() else []}
    verdict = {"passed": all(p["passed"] for p in parts.values()), "parts": parts}
    (args.folder / "summary.json").write_text(json.dumps(verdict, indent=1) + "\n")
    for name, part in parts.items():
        figures = {k: v for k, v in part.items() if k not in ("passed", "problems", "lines")}
        log.info(f"{'PASS' if part['passed'] else 'FAIL'} {name}: {part.get('problems') or ''} {figures}")
    log.info(f"{'every part passed' if verdict['passed'] else 'FAILED'}; {args.folder / 'summary.json'}")
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    logs.setup("bench", __name__, "bench")
    sys.exit(main(sys.argv[1:]))
