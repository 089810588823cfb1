"""What ``[recover] sdc_check`` costs and how soon it catches a bad device (issue 69, item 5).

- **cost**: the exact job (``llama3_exact_cpu``: 2 groups x 2 FSDP ranks, M = 12) failure-free, in interleaved
  triples: checks off, at the default rate, at every step; the ratios of the median step times to "off";
- **catch delay**: a group wrong on every microbatch from step 1 is caught at the first checked step whose
  microbatch it computes (as owner or as the member after the owner). Over many seeds, the steps until then,
  from the very functions a rank decides by (``policy.sdc``'s draw, ``policy.workload``'s assignment), against
  the expected ``1 / (rate * 2q / M)`` (q microbatches per group); a real run's catch is the tests' part
  (``tests/test_sdc_runs.py``);
- **false positives**: a failure-free run of three single-rank groups checking every step, for at least 2,000
  checks: the mismatches (0 expected in exact mode) and the checks made, from its events.

    .venv/bin/python -m bench.sdc [--parts cost delay free] [--triples 2] [--steps 20] [--seeds 2000] [--checks 2000]

Writes bench/results/sdc.json: the parts run replace theirs, each with the command that measured it (the cost
wants a machine nobody else loads; the false-positive run takes minutes).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from typing import Any

from bench.common import PRECISION, RESULTS, launch, write_result
from bench.exact import step_time
from titan_recover.config import Recover
from titan_recover.observability import logs
from titan_recover.observability.events import of_kind
from titan_recover.policy import sdc, workload

log = logging.getLogger(__name__)

RATES = {"off": None, "default": Recover.sdc_check_rate, "every_step": 1.0}
LAYOUTS = ((2, 12), (3, 12), (4, 8), (8, 16))  # (groups, M) for the catch delay
FREE = [  # three single-rank groups, M = 6: the false-positive run
    "--parallelism.data_parallel_replicate_degree",
    "3",
    "--parallelism.data_parallel_shard_degree",
    "1",
    "--training.global_batch_size",
    "12",
    "--recover.digest_interval",
    "100",
]


def checks(rate: float | None) -> list[str]:
    return [] if rate is None else ["--recover.sdc_check", "--recover.sdc_check_rate", str(rate)]


def steps_to_catch(seed: int, rate: float, groups: int, num_microbatches: int, bad: int, limit: int) -> int | None:
    """The first step (from 1) whose check draws a microbatch ``bad`` computes, or None within ``limit``."""
    members = tuple(range(groups))
    owners = {m: r for r, ms in workload.assign("balanced", members, num_microbatches).items() for m in ms}
    for step in range(1, limit + 1):
        m = sdc.checked_microbatch(seed, step, rate, num_microbatches)
        if m is not None and bad in (owners[m], sdc.after(owners[m], members)):
            return step
    return None


def catch_delay(seeds: int, rate: float, groups: int, num_microbatches: int) -> dict[str, Any]:
    """Steps until a bad group is caught, over ``seeds`` seeds (the bad group: seed mod groups)."""
    q = num_microbatches // groups
    expected = 1 / (rate * 2 * q / num_microbatches)
    limit = int(50 * expected)
    found = [steps_to_catch(s, rate, groups, num_microbatches, s % groups, limit) for s in range(seeds)]
    caught = [f for f in found if f is not None]
    return {
        "groups": groups,
        "microbatches": num_microbatches,
        "rate": rate,
        "seeds": seeds,
        "mean_steps": round(statistics.fmean(caught), 2),
        "median_steps": statistics.median(caught),
        "p95_steps": sorted(caught)[int(0.95 * len(caught)) - 1],
        "expected_mean_steps": round(expected, 2),
        "not_caught_within": {"steps": limit, "seeds": len(found) - len(caught)},
    }


def cost(triples: int, steps: int) -> dict[str, Any]:
    """The step-time ratios of the checks at the default rate and at every step to none, in interleaved runs."""
    times: dict[str, list[float]] = {mode: [] for mode in RATES}
    base = [*PRECISION, "--recover.fault_plan", "none", "--training.steps", str(steps)]
    for i in range(triples):
        for mode, rate in RATES.items():
            events, _ = launch([*base, *checks(rate)], f"exact job, checks {mode}", "llama3_exact_cpu")
            times[mode].append(step_time(events))
            log.info(
                f"triple {i}: checks {mode}: {times[mode][-1]:.3f} s/step, {len(of_kind(events, 'sdc_checked'))} checks"
            )
    off = statistics.median(times["off"])
    ratios = {mode: round(statistics.median(ts) / off, 3) for mode, ts in times.items() if mode != "off"}
    log.info(f"step time against checks off: {ratios}")
    return {"step_time_ratio": ratios, "step_time_s": {mode: [round(t, 4) for t in ts] for mode, ts in times.items()}}


def delay(seeds: int) -> dict[str, Any]:
    delays = [catch_delay(seeds, rate, g, m) for g, m in LAYOUTS for rate in (Recover.sdc_check_rate, 1.0)]
    for d in delays:
        log.info(
            f"R={d['groups']} M={d['microbatches']} rate {d['rate']}: caught after {d['mean_steps']} steps on average "
            f"(expected {d['expected_mean_steps']}), p95 {d['p95_steps']}"
        )
    return {"catch_delay": delays}


def free(steps: int) -> dict[str, Any]:
    """A failure-free run checking every step: its checks and mismatches."""
    events, wall = launch(
        [*PRECISION, *FREE, *checks(1.0), "--recover.fault_plan", "none", "--training.steps", str(steps)],
        f"failure-free, {steps} steps each checked",
        "llama3_exact_cpu",
    )
    found = {
        "steps": len(of_kind(events, "step")),
        "checks": len(of_kind(events, "sdc_checked")),
        "mismatches": len(of_kind(events, "sdc_mismatch")),
        "wall_s": round(wall, 1),
    }
    log.info(f"failure-free: {found['checks']} checks, {found['mismatches']} mismatches in {wall:.0f}s")
    return {"false_positives": found}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=("cost", "delay", "free"), default=["cost", "delay", "free"])
    p.add_argument("--triples", type=int, default=2, help="interleaved (off, default, every step) cost runs")
    p.add_argument("--steps", type=int, default=20, help="steps of each cost run")
    p.add_argument("--seeds", type=int, default=2000, help="seeds of the catch-delay count")
    p.add_argument("--checks", type=int, default=2000, help="checks (steps) of the false-positive run")
    a = p.parse_args(argv)
    logs.setup("bench", __name__, "bench")
    command = "python -m bench.sdc " + " ".join(argv if argv is not None else sys.argv[1:])
    path = RESULTS / "sdc.json"
    result: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    result |= {"issue": 69, "precision": PRECISION[-1]}
    runs = {"cost": lambda: cost(a.triples, a.steps), "delay": lambda: delay(a.seeds), "free": lambda: free(a.checks)}
    for part in a.parts:
        result[part] = {"command": command, **runs[part]()}
    print(write_result("sdc", result))
    return 0 if result.get("free", {}).get("false_positives", {}).get("mismatches", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
