"""The node self-test: what an operator runs on a new node, driver or NCCL release before trusting a
week-long run to it. It runs, on this node's GPUs (one GPU: its ranks pose as hosts, see
``devices``) or on its CPUs where it has none:

- ``preflight``: the launcher's checks of the NCCL release, its settings and the timeouts;
- ``collectives``: the replicate dimension alone (``probe``), a peer SIGKILLed mid all-reduce and mid
  state transfer and one SIGSTOPped: the survivors abort, re-form and go on within ``BOUND_S`` of the
  fault, each phase timed (``events.RECOVERY_PHASES``), their memory back, no process left wedged;
- ``default job``: the default job with a kill and a rejoin, against its failure-free twin;
- ``exact``: ``[recover] exact`` with a kill at R = 2 and at R = 3, bit-equal to the failure-free R = 2 run.

It prints a table and writes the results as JSON (``--out``); exit 0 only when every check passed.

    python -m titan_recover.selftest [--out FILE] [--only collectives,exact] [--work DIR]
"""

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from titan_recover.compare import compare_runs
from titan_recover.config import Recover
from titan_recover.control import keys
from titan_recover.control.keys import EXIT_FAILED, EXIT_OK
from titan_recover.launch import preflight
from titan_recover.observability import logs
from titan_recover.observability.events import RECOVERY_PHASES, read_log
from titan_recover.observability.summary import summarize_events
from titan_recover.rank import probe
from titan_recover.titan.jobs import job

CHECKS = ("preflight", "collectives", "default job", "exact")
BOUND_S = 10.0  # a survivor's first good step after a fault, at the latest (detection of a stopped peer: 1 s)
STEPS = 8
KILL = "kill replica=1 rank=0 step=3 phase=backward"
HOLD = "sleep replica=0 step=5 phase=optimizer seconds=120 until=epoch"  # the survivor waits for the rejoin
EXACT = ["--recover.exact", "--recover.digest_interval", "1", "--training.global_batch_size", "24"]  # M = 6
ONE_RANK = [
    "--parallelism.data_parallel_shard_degree",
    "1",
]  # exact mode's check: single-rank groups start fastest (M = 12)
SPIKE = ["--optimizer.lr", "3", "--lr_scheduler.warmup_steps", "0"]
"""A learning rate that makes step 2's gradients ~2**5 where step 1's were below 2**-6: past the grid's 8-bit
margin, so every run redoes step 2 on the coarser grid (measured: bound 2 -> 6); the losses stay finite."""
RUN_TIMEOUT_S = 600
log = logging.getLogger(__name__)


def host() -> dict[str, Any]:
    """What this node is: the versions each figure depends on."""
    import torch

    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchtitan": metadata.version("torchtitan"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "cuda": torch.version.cuda,
        "gpus": torch.cuda.device_count(),
    }
    version = preflight.nccl_version()
    facts["nccl"] = None if version is None else ".".join(map(str, version))
    if facts["gpus"]:
        facts["device"] = torch.cuda.get_device_name(0)
        facts["driver"] = _driver()
    return facts


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None


def backend(facts: dict[str, Any]) -> str:
    return "nccl" if facts["gpus"] and facts["nccl"] else "gloo"


def check_preflight(facts: dict[str, Any], work: Path) -> dict[str, Any]:
    """The launcher's preflight for the default job on this node, with this environment."""
    from titan_recover import titan

    comm = preflight.comm_facts(titan.load_config(job(work / "preflight", tiny=True)))
    checked = preflight.check(preflight.nccl_version(), backend(facts), os.environ, Recover(), comm)
    return {
        "passed": not checked.refusals,
        "findings": [f.line() for f in checked.findings],
        "summary": f"{len(checked.findings)} findings, {len(checked.refusals)} refused, "
        f"{sum(f.level == preflight.WARN for f in checked.findings)} warned",
    }


def check_collectives(facts: dict[str, Any], work: Path) -> dict[str, Any]:
    """The probe's faults on this node's replicate backend, with the preflight's settings for the ranks."""
    env = {**os.environ, **preflight.check(None, backend(facts), os.environ, Recover(), {}).env}
    faults, codes, records = probe.conduct(backend(facts), env)
    recoveries = probe.summarize(faults, records)
    problems = collective_problems(recoveries, codes)
    worst = {phase: max((r["phases"][phase] or 0.0) for r in recoveries) for phase in RECOVERY_PHASES}
    return {
        "passed": not problems,
        "problems": problems,
        "backend": backend(facts),
        "bound_s": BOUND_S,
        "recoveries": recoveries,
        "survivor_exit_codes": codes,
        "memory_returned": all(r["memory_returned"] for r in recoveries),
        "summary": f"{backend(facts)}, {len(recoveries)} faults, slowest "
        + ", ".join(f"{p} {s:.2f}s" for p, s in worst.items()),
    }


def collective_problems(recoveries: list[dict], codes: dict[int, int | None]) -> list[str]:
    """What the probe's recoveries did wrong: a phase missing or past ``BOUND_S``, a wrong sum, memory
    not back, a survivor still running at the bound (wedged) or exiting with an error."""
    problems = [
        f"{r['fault']} during {r['during']}: {phase} "
        + ("never happened" if r["phases"][phase] is None else f"{r['phases'][phase]:.2f}s > {BOUND_S:g}s")
        for r in recoveries
        for phase in RECOVERY_PHASES
        if r["phases"][phase] is None or r["phases"][phase] > BOUND_S
    ]
    problems += [
        f"{r['fault']} during {r['during']}: a survivor's first all-reduce of the new epoch summed wrong"
        for r in recoveries
        if not all(s["sum_right"] for s in r["survivors"] if s["first_good_step"] is not None)
    ]
    problems += [
        f"{r['fault']} during {r['during']}: survivors' memory not back" for r in recoveries if not r["memory_returned"]
    ]
    problems += [f"survivor {r} still running at the bound (wedged)" for r, code in codes.items() if code is None]
    problems += [f"survivor {r} exited with code {code}" for r, code in codes.items() if code not in (0, None)]
    return problems


def launch(dump: Path, *overrides: str) -> tuple[int, str]:
    """One run of the launcher on the tests' tiny job; its exit code and the tail of its output."""
    cmd = [sys.executable, "-m", "titan_recover.launch", *job(dump, tiny=True), *overrides]
    log.info(f"running {' '.join(overrides) or 'the failure-free job'} (dump {dump})")
    env = {k: v for k, v in os.environ.items() if k != keys.SECRET_ENV}  # each launcher makes its own
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env={**env, "PYTHONUNBUFFERED": "1"}
    )
    dump.mkdir(parents=True, exist_ok=True)  # a launcher that stopped at its checks made no dump folder
    (dump / "selftest_output.log").write_text(done.stdout + done.stderr)
    return done.returncode, (done.stdout + done.stderr)[-1500:]


def placement(facts: dict[str, Any], ranks: int = 4) -> list[str]:
    """Fewer GPUs than the job's ``ranks``: the ranks share them, posing as hosts."""
    return ["--recover.nccl_rank_per_host"] if 0 < facts["gpus"] < ranks else []


def check_default_job(facts: dict[str, Any], work: Path) -> dict[str, Any]:
    steps = ["--training.steps", str(STEPS), *placement(facts)]
    twin_code, twin_tail = launch(work / "twin", *steps, "--recover.fault_plan", "none")
    code, tail = launch(work / "job", *steps, "--recover.fault_plan", f"{KILL}; {HOLD}")
    problems = [
        f"{what} exited with code {c}: {t[-600:]}"
        for what, c, t in (("the failure-free twin", twin_code, twin_tail), ("the job", code, tail))
        if c != 0
    ]
    summary: dict[str, Any] = {}
    if not problems:
        ran = read_log(str(work / "job" / "recover_events.jsonl")).events
        twin = read_log(str(work / "twin" / "recover_events.jsonl")).events
        compared = compare_runs(twin, ran, rel_tol=1e-3)
        summary = summarize_events(str(work / "job" / "recover_events.jsonl"), last_step=STEPS)
        problems += compared.problems
        if compared.steps != STEPS:
            problems.append(f"{compared.steps} steps compared, {STEPS} expected")
        if not summary["failures"]:
            problems.append("the kill was never detected as a failure")
        if not summary["rejoined"]:
            problems.append("the restarted group never rejoined")
    rejoin = (summary.get("rejoined") or [{}])[0]
    said = (
        f"{STEPS} steps the same as the twin's; in-step recovery {summary['recovery_latency_s']} s; rejoined at "
        f"step {rejoin.get('step')}, {rejoin.get('downtime_s', 0):.1f} s after the failure"
        if summary
        else "did not run"
    )
    return {
        "passed": not problems,
        "problems": problems,
        "steps": STEPS,
        "fault_plan": f"{KILL}; {HOLD}",
        "recovery_latency_s": summary.get("recovery_latency_s"),
        "rejoined": summary.get("rejoined"),
        "summary": said,
    }


def check_exact(facts: dict[str, Any], work: Path) -> dict[str, Any]:
    """The failure-free R = 2 run, then a kill at R = 2 and at R = 3: the same bits every step, step 2
    redone on the coarser grid in each (``SPIKE``)."""
    base = [*EXACT, *SPIKE, *ONE_RANK]
    runs = {
        "free": launch(work / "exact_free", *base, *placement(facts, 2), "--recover.fault_plan", "none"),
        "R=2": launch(
            work / "exact_two",
            *base,
            *placement(facts, 2),
            "--recover.fault_plan",
            "kill replica=1 rank=0 step=3 phase=backward",
        ),
        "R=3": launch(
            work / "exact_three",
            *base,
            *placement(facts, 3),
            "--parallelism.data_parallel_replicate_degree",
            "3",
            "--recover.fault_plan",
            "kill replica=2 rank=0 step=2 phase=forward",
        ),
    }
    problems = [f"{name} exited with code {code}: {tail[-600:]}" for name, (code, tail) in runs.items() if code != 0]
    verdicts: dict[str, str] = {}
    redone: dict[str, list[int]] = {}
    if not problems:
        events = {
            name: read_log(str(work / folder / "recover_events.jsonl")).events
            for name, folder in (("free", "exact_free"), ("R=2", "exact_two"), ("R=3", "exact_three"))
        }
        redone = {name: sorted({e["step"] for e in ev if e["event"] == "exact_redo"}) for name, ev in events.items()}
        for name in ("R=2", "R=3"):
            compared = compare_runs(events["free"], events[name], 0.0, exact=True)
            verdicts[name] = (
                f"the same bits ({compared.steps} steps, {compared.digest_steps} digests)"
                if not compared.problems
                else "DIFFERENT"
            )
            problems += [f"{name}: {p}" for p in compared.problems]
            if not any(e["event"] == "failure" for e in events[name]):
                problems.append(f"{name}: the kill was never detected as a failure")
    return {
        "passed": not problems,
        "problems": problems,
        "verdicts": verdicts,
        "redone_steps": redone,
        "summary": "; ".join(f"{k}: {v}" for k, v in verdicts.items()) or "did not run",
    }


RUNNERS: dict[str, Callable[[dict[str, Any], Path], dict[str, Any]]] = {
    "preflight": check_preflight,
    "collectives": check_collectives,
    "default job": check_default_job,
    "exact": check_exact,
}


def run(only: list[str], work: Path) -> dict[str, Any]:
    facts = host()
    log.info(
        f"self-test on {facts['host']}: {facts['gpus']} GPU(s), torch {facts['torch']}, NCCL {facts['nccl']}; "
        f"replicate backend {backend(facts)}"
    )
    results: dict[str, Any] = {"host": facts, "checks": {}}
    start = time.monotonic()
    for name in only:
        t = time.monotonic()
        try:
            result = RUNNERS[name](facts, work)
        except Exception as e:  # a check that could not run fails, saying why; the others still run
            log.exception(f"{name} could not run")
            result = {"passed": False, "problems": [f"{type(e).__name__}: {e}"], "summary": "could not run"}
        result["seconds"] = round(time.monotonic() - t, 1)
        results["checks"][name] = result
        log.info(f"{name}: {'passed' if result['passed'] else 'FAILED'} in {result['seconds']}s: {result['summary']}")
    results["seconds"] = round(time.monotonic() - start, 1)
    results["passed"] = all(c["passed"] for c in results["checks"].values())
    return results


def table(results: dict[str, Any]) -> str:
    width = max(len(n) for n in results["checks"])
    lines = [f"{'check'.ljust(width)}  result  seconds  what it saw"]
    for name, c in results["checks"].items():
        lines.append(f"{name.ljust(width)}  {'pass' if c['passed'] else 'FAIL':6}  {c['seconds']:7.1f}  {c['summary']}")
        lines += [f"{''.ljust(width)}  problem: {p}" for p in c.get("problems", [])]
    verdict = "PASSED" if results["passed"] else "FAILED"
    return "\n".join(lines + [f"self-test {verdict} in {results['seconds']:.0f}s"])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated checks of: {', '.join(CHECKS)}")
    parser.add_argument("--work", type=Path, help="keep the runs' dump folders here (default: a temporary folder)")
    args = parser.parse_args(argv)
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    if unknown := [c for c in only if c not in CHECKS]:
        parser.error(f"--only: no check named {', '.join(map(repr, unknown))}; the checks are {', '.join(CHECKS)}")
    with tempfile.TemporaryDirectory(prefix="titan_recover_selftest_") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = run(only, work)
    print(table(results), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        log.info(f"wrote {args.out}")
    return EXIT_OK if results["passed"] else EXIT_FAILED


if __name__ == "__main__":
    logs.setup("selftest", __name__)
    sys.exit(main(sys.argv[1:]))
