"""Hot spares against restart-and-rejoin, side by side in one run, at R = 2, 4, 8.

For each R (single-rank replica groups of the tiny model, M = 2R, float32) four runs,
interleaved so that machine noise spreads over all of them:

- ``ff`` with ``spares = 0`` and ``spares = 1``: the failure-free step time over the last
  ``STEADY`` of ``FF_STEPS`` steps, when the spare has long finished starting and only waits
  (does a waiting spare cost the members anything?);
- ``kill`` with ``spares = 0`` and ``spares = 1``: replica 1 SIGKILLed mid-backward at step 3.
  Replica 0 pauses 45 s after step 9 so that the run outlives the restarted group's start
  (the 5 steps after the failure, 4..8, are not touched by the pause).

Downtime, failure to full membership, is counted the same way for both:
failure -> admission (coordinator's events) + the joiner's state transfer + one failure-free
step. With a spare, the spare's first commit comes before the pause, so the coordinator's own
``rejoined.downtime_s`` (failure to the first step committed with the spare) is also given.

The failure-free pair is repeated ``--ff-repeats`` times (this 2-core machine's step time
varies by +-25% between runs of the same job) and ratios are of medians.

    .venv/bin/python -m bench.spares [--replicas 2 4 8] [--repeats 1] [--ff-repeats 2]   -> bench/results/spares.json
"""

import argparse
import statistics
from typing import Any

from bench.common import PRECISION, launch, phase_medians, recovery_phases, step_gaps, timeline, write_result
from titan_recover.observability.events import of_kind

KILL = "kill replica=1 step=3 phase=backward; sleep replica=0 step=9 phase=optimizer seconds=45"
AFTER = range(4, 9)  # the 5 steps after the failure
FF_STEPS, STEADY = 300, 100


def run(replicas: int, spares: int, kill: bool) -> dict:
    steps = 12 if kill else FF_STEPS
    events, _ = launch(
        [
            "--model.flavor",
            "tiny",
            "--training.seq_len",
            "64",
            "--training.steps",
            str(steps),
            "--metrics.log_freq",
            "50",
            "--lr_scheduler.warmup_steps",
            "2",
            *PRECISION,
            "--parallelism.data_parallel_replicate_degree",
            str(replicas),
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--training.global_batch_size",
            str(4 * replicas),
            "--recover.spares",
            str(spares),
            "--recover.collective_timeout_s",
            "120",
            "--recover.fault_plan",
            KILL if kill else "none",
        ],
        f"R={replicas} spares={spares} {'kill' if kill else 'failure-free'}",
    )
    gaps = step_gaps(of_kind(events, "step"))
    row: dict = {"replicas": replicas, "spares": spares, "kill": kill}
    if not kill:
        ready = [e["time"] for e in of_kind(events, "spare_ready")]
        steady = [s for s in range(steps - STEADY + 1, steps + 1) if s in gaps]
        row["step_s"] = statistics.median(gaps[s] for s in steady)
        row["spare_ready_before_window"] = all(t < of_kind(events, "step")[steps - STEADY - 1]["time"] for t in ready)
        return row
    (failure,) = of_kind(events, "failure")
    admitted = [e for e in of_kind(events, "admitted") if e["time"] > failure["time"]][0]
    back = [e for e in of_kind(events, "rejoined") if e["replica"] == admitted["replica"]][0]
    row.update(
        {
            "admitted_replica": admitted["replica"],
            "admission_s": admitted["time"] - failure["time"],
            "transfer_s": back["transfer_s"],
            "after_failure_step_s": statistics.median(gaps[s] for s in AFTER if s in gaps),
            "recovery_latency_s": of_kind(events, "recovered")[0]["latency_s"],
            # the failed group's own (with a spare its restart comes after the spare took its place)
            "phases": recovery_phases(events),
        }
    )
    if spares:
        row["rejoined_downtime_s"] = back["downtime_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--ff-repeats", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for repeat in range(max(args.repeats, args.ff_repeats)):
        for replicas in args.replicas:
            kinds = [False] * (repeat < args.ff_repeats) + [True] * (repeat < args.repeats)
            for kill in kinds:
                for spares in (0, 1):
                    row = run(replicas, spares, kill)
                    rows.append(row)
                    print(
                        f"repeat {repeat + 1} "
                        + ", ".join(
                            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in row.items()
                            if k != "phases"
                        )
                        + (f"; from the fault: {timeline(row['phases'])}" if kill else ""),
                        flush=True,
                    )

    def med(key: str, replicas: int, spares: int, kill: bool) -> float:
        return statistics.median(
            r[key] for r in rows if (r["replicas"], r["spares"], r["kill"]) == (replicas, spares, kill)
        )

    per_r: dict[str, dict[str, Any]] = {}
    for r in args.replicas:
        step = med("step_s", r, 0, False)
        downtime = {s: med("admission_s", r, s, True) + med("transfer_s", r, s, True) + step for s in (0, 1)}
        per_r[str(r)] = {
            "failure_free_step_s": step,
            "spare_failure_free_step_ratio": med("step_s", r, 1, False) / step,
            "spare_rejoin_downtime_s": downtime[1],
            "restart_rejoin_downtime_s": downtime[0],
            "spare_rejoined_downtime_s": med("rejoined_downtime_s", r, 1, True),
            "detection_s": med("recovery_latency_s", r, 1, True),
            "after_failure_step_ratio": {str(s): med("after_failure_step_s", r, s, True) / step for s in (0, 1)},
            "phases_median_s": {
                f"spares={s}": phase_medians([x for x in rows if x["kill"] and (x["replicas"], x["spares"]) == (r, s)])
                for s in (0, 1)
            },
        }
        print(
            f"R={r}: downtime with a spare {downtime[1]:.2f}s, by restart {downtime[0]:.2f}s; "
            f"failure-free step {step:.3f}s, with a waiting spare x{per_r[str(r)]['spare_failure_free_step_ratio']:.3f}"
        )
    worst = max(per_r.values(), key=lambda v: v["spare_rejoin_downtime_s"])
    result = {
        "setup": {
            "model": "llama3 tiny",
            "precision": PRECISION[-1],
            "shards": 1,
            "microbatches": "2R",
            "fault_plan": KILL,
            "repeats": args.repeats,
            "ff_repeats": args.ff_repeats,
            "failure_free_steps": FF_STEPS,
            "steady_steps": STEADY,
            "command": "python -m bench.spares "
            + " ".join(
                [
                    "--replicas",
                    *map(str, args.replicas),
                    "--repeats",
                    str(args.repeats),
                    "--ff-repeats",
                    str(args.ff_repeats),
                ]
            ),
        },
        "runs": rows,
        "by_replicas": per_r,
        "spare_rejoin_downtime_s": worst["spare_rejoin_downtime_s"],  # the largest R's or the worst
        "restart_rejoin_downtime_s": max(v["restart_rejoin_downtime_s"] for v in per_r.values()),
        "spare_failure_free_step_ratio": max(v["spare_failure_free_step_ratio"] for v in per_r.values()),
    }
    print(f"wrote {write_result('spares', result)}")


if __name__ == "__main__":
    main()
