"""Recovery latency against the number of replica groups, side by side in one run.

For each R (single-process replica groups of the tiny model, M = 2R microbatches),
runs the same failure and reads the coordinator's ``recovered`` event: seconds from
the failure to the new epoch published. Two failures:

- ``kill``: replica 1 SIGKILLed mid-backward; survivors' all-reduce breaks, they
  report, the coordinator fences the replica silent for ``report_confirm_s``.
- ``stop``: replica 1 SIGSTOPed (a hang); only its heartbeat going silent for
  ``heartbeat_timeout_s`` tells.

With ``--rejoin`` the failed group also restarts: ``restart_s`` is failure to its
admission (process start, imports, model build), ``transfer_s`` and ``bytes`` its
state transfer. Its ``downtime_s`` (failure to first commit back) here includes the
30 s the survivor is made to sleep so that the short run outlives the restart.

    .venv/bin/python -m bench.recovery_latency [--replicas 2 4 8] [--repeats 2] [--rejoin]
        [--models llama3_recover:tiny deepseek_v3_recover:tiny]

Writes bench/results/recovery_latency.json (recovery_latency_rejoin.json with --rejoin); with more
than one of ``--models`` (``name:flavor``, each run in turn, so the same noise falls on each),
recovery_latency_models.json (``_rejoin`` added with --rejoin).
"""

import argparse
import statistics

from bench.common import launch, phase_medians, recovery_phases, timeline, write_result
from titan_recover.observability.events import of_kind

FAULTS = {
    "kill": "kill replica=1 step=3 phase=backward",
    "stop": "stop replica=1 step=3 phase=backward",
}
WAIT = "sleep replica=0 step=4 phase=optimizer seconds=30"  # keeps the run going while the group restarts
DENSE = "llama3_recover:tiny"


def run(replicas: int, fault: str, rejoin: bool, model: str = DENSE) -> dict:
    plan = FAULTS[fault] + (f"; {WAIT}" if rejoin else "")
    name, flavor = model.split(":")
    events, _ = launch(
        [
            "--model.name",
            name,
            "--model.flavor",
            flavor,
            "--training.seq_len",
            "64",
            "--training.steps",
            "8",
            "--lr_scheduler.warmup_steps",
            "2",
            "--parallelism.data_parallel_replicate_degree",
            str(replicas),
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--training.global_batch_size",
            str(4 * replicas),
            "--recover.max_restarts",
            "1" if rejoin else "0",
            "--recover.fault_plan",
            plan,
        ],
        f"{model} R={replicas} {fault}",
    )
    (recovered,) = of_kind(events, "recovered")
    result = {
        "model": model,
        "replicas": replicas,
        "fault": fault,
        "latency_s": recovered["latency_s"],
        "phases": recovery_phases(events),
    }
    back = of_kind(events, "rejoined")
    if rejoin and back:
        (failure,) = of_kind(events, "failure")
        admitted = of_kind(events, "admitted")[0]
        result["restart_s"] = admitted["time"] - failure["time"]
        result.update({k: back[0][k] for k in ("downtime_s", "transfer_s", "bytes")})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), choices=list(FAULTS))
    parser.add_argument("--rejoin", action="store_true", help="also restart the failed group and time its rejoin")
    parser.add_argument("--models", nargs="+", default=[DENSE], help="name:flavor of each model to run, in turn")
    args = parser.parse_args()
    rows = []
    for repeat in range(args.repeats):
        for fault in args.faults:
            for replicas in args.replicas:  # interleaved, so machine noise spreads over every R and model
                for model in args.models:
                    row = run(replicas, fault, args.rejoin, model)
                    rows.append(row)
                    print(
                        f"repeat {repeat + 1} {fault:4s} R={replicas} {model}: "
                        + ", ".join(
                            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in row.items()
                            if k not in ("replicas", "fault", "model", "phases")
                        )
                        + f"; from the fault: {timeline(row['phases'])}",
                        flush=True,
                    )
    print("\nmedians over repeats (s)")
    print("         " + "  ".join(f"R={r:<5d}" for r in args.replicas))
    summary: dict[str, dict] = {}
    for key in ("latency_s", "restart_s", "transfer_s", "downtime_s") if args.rejoin else ("latency_s",):
        print(f"{key}:")
        for fault in args.faults:
            for model in args.models:
                label = fault if args.models == [DENSE] else f"{model} {fault}"
                medians = [
                    statistics.median(
                        x.get(key, float("nan"))
                        for x in rows
                        if (x["fault"], x["replicas"], x["model"]) == (fault, r, model)
                    )
                    for r in args.replicas
                ]
                summary.setdefault(key, {})[label] = dict(zip(map(str, args.replicas), medians))
                print(f"  {label:5s}  " + "  ".join(f"{m:<7.3f}" for m in medians))
    split = {
        f"{model} {fault} R={r}": phase_medians(
            [x for x in rows if (x["fault"], x["replicas"], x["model"]) == (fault, r, model)]
        )
        for fault in args.faults
        for model in args.models
        for r in args.replicas
    }
    print("phases, medians (s from the fault):")
    for label, split_medians in split.items():
        print(f"  {label}: {timeline(split_medians)}")
    name = "recovery_latency" + ("_models" if len(args.models) > 1 else "") + ("_rejoin" if args.rejoin else "")
    path = write_result(name, {"runs": rows, "median": summary, "phases_median_s": split})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
