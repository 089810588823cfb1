"""One straggler: step time with the ``balanced`` and ``speed`` policies against the ideal,
side by side in one run.

Two single-rank replica groups of the tiny model, M = 16 (float32). Replica 1 is made
``F`` times slower (``slow replica=1 factor=F``: every microbatch sleeps (F - 1) times its
compute) for F = 2 and 4. Step time is the median gap between steps over the last
``STEADY`` steps (the speed policy has settled by then).

The ideal is M microbatches at the summed speed of the replicas as they ran: per step,
``gap - max_r(q_r * t_r) + M / sum_r(1 / t_r)`` from the step's own quotas ``q_r`` and
measured seconds per microbatch ``t_r`` (what is not compute, the all-reduce and the
commit, stays as it was). ``T_ff * R / (R - 1 + 1/F)``, the failure-free step at
R - 1 + 1/F replicas' worth of speed, is given too (``ideal_from_failure_free_s``), but
on this 2-core CPU it does not hold: while the straggler sleeps, the other replica gets
the core it shared, and runs faster than in the failure-free run.
Every run's data digests and losses are checked against the failure-free run
(trajectory within 1e-3).

    .venv/bin/python -m bench.stragglers [--steps 40]   -> bench/results/stragglers.json
"""

import argparse
import statistics

from bench.common import PRECISION, launch, step_gaps, write_result
from titan_recover.compare import compare_runs
from titan_recover.observability.events import of_kind

R, M, STEADY = 2, 16, 20
FACTORS = (2, 4)


def run(steps: int, policy: str, factor: int | None) -> tuple[list[dict], float]:
    plan = f"slow replica=1 factor={factor}" if factor else "none"
    events, _ = launch(
        [
            "--model.flavor",
            "tiny",
            "--training.seq_len",
            "64",
            "--training.steps",
            str(steps),
            "--lr_scheduler.warmup_steps",
            "2",
            "--metrics.log_freq",
            "10",
            *PRECISION,
            "--parallelism.data_parallel_replicate_degree",
            str(R),
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--training.global_batch_size",
            str(2 * M),
            "--recover.policy",
            policy,
            "--recover.fault_plan",
            plan,
        ],
        f"{policy} {plan}",
    )
    return events, statistics.median(_steady(events, steps).values())


def _steady(events: list[dict], steps: int) -> dict[int, float]:
    gaps = step_gaps(of_kind(events, "step"))
    return {s: gaps[s] for s in range(steps - STEADY + 1, steps + 1) if s in gaps}


def ideal_step_s(events: list[dict], steps: int) -> float:
    """Median over the steady steps of the step at the replicas' summed measured speed."""
    records = {e["step"]: e for e in of_kind(events, "step")}
    ideals = []
    for step, gap in _steady(events, steps).items():
        quotas, seconds = records[step]["quotas"], records[step]["seconds_per_microbatch"]
        compute = max(quotas[r] * seconds[r] for r in quotas)
        ideals.append(gap - compute + M / sum(1 / t for t in seconds.values()))
    return statistics.median(ideals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    reference, ff = run(args.steps, "balanced", None)
    print(f"failure-free, no straggler: {ff:.4f} s/step", flush=True)
    rows = []
    for factor in FACTORS:
        row: dict = {"factor": factor, "ideal_from_failure_free_s": ff * R / (R - 1 + 1 / factor)}
        for policy in ("balanced", "speed"):
            events, step = run(args.steps, policy, factor)
            ideal = ideal_step_s(events, args.steps)
            cmp = compare_runs(reference, events, 1e-3)
            last = of_kind(events, "step")[-1]
            row[policy] = {
                "step_s": step,
                "ideal_step_s": ideal,
                "vs_ideal": step / ideal,
                "seconds_per_microbatch": last["seconds_per_microbatch"],
                "final_quotas": last["quotas"],
                "same_trajectory": not cmp.problems,
                "max_rel_loss_dev": cmp.max_rel_loss_dev,
                "problems": cmp.problems[:5],
            }
            print(
                f"F={factor} {policy:8s}: {step:.4f} s/step, {step / ideal:.3f} x ideal ({ideal:.4f}); quotas "
                f"{last['quotas']}; trajectory {'same' if not cmp.problems else 'DIFFERENT'} "
                f"(max loss dev {cmp.max_rel_loss_dev:.2e})",
                flush=True,
            )
        rows.append(row)
    result = {
        "setup": {
            "model": "llama3 tiny",
            "precision": PRECISION[-1],
            "replicas": R,
            "microbatches": M,
            "steps": args.steps,
            "steady_steps": STEADY,
            "command": f"python -m bench.stragglers --steps {args.steps}",
        },
        "failure_free_step_s": ff,
        "runs": rows,
        "straggler_speed_vs_ideal": {str(r["factor"]): r["speed"]["vs_ideal"] for r in rows},
        "straggler_balanced_vs_ideal": {str(r["factor"]): r["balanced"]["vs_ideal"] for r in rows},
    }
    print(f"wrote {write_result('stragglers', result)}")


if __name__ == "__main__":
    main()
