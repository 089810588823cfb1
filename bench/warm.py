"""Warm incarnations against cold restarts, side by side in one run, on the default job.

The default job (``train_configs/llama3_debug_cpu.toml``: llama3 debugmodel, 2 replica groups x 2
FSDP ranks, float32 on a CPU) trains ``STEPS`` steps, and rank 1 of replica 1 is SIGKILLed
mid-backward at step ``KILL_STEP``, late enough that a warm incarnation started at the group's
first step has imported by then on this 2-core machine (the JSON says whether it had). Runs
alternate ``recover.warm = on`` and ``off`` (``on``: this host has fewer cores than training plus
waiting ranks, where ``auto`` keeps them off).

Each rejoin's downtime is the coordinator's ``rejoined.downtime_s``: the failure to the first step
committed with the group back. Each run's recovery is split into the run's own phases
(``observability.phases``: seconds from the fault to ``detect``, ``abort``, ``reform``,
``first_good_step``, ``restart``, ``admit``, ``rejoin``), as its summary, status page and
Prometheus give them.

    .venv/bin/python -m bench.warm [--repeats 3]   -> bench/results/warm.json
"""

import argparse
import statistics

from bench.common import launch, phase_medians, write_result
from titan_recover.observability import phases
from titan_recover.observability.events import of_kind

STEPS, KILL_STEP = 40, 20
KILL = f"kill replica=1 rank=1 step={KILL_STEP} phase=backward"


def run(warm: bool) -> dict:
    """One run of the default job with the kill; its rejoin's downtime and the downtime's parts."""
    setting = "on" if warm else "off"
    events, wall = launch(
        ["--training.steps", str(STEPS), "--recover.warm", setting, "--recover.fault_plan", KILL],
        f"the default job with recover.warm = {setting}",
    )
    (failure,) = of_kind(events, "failure")
    (recovery,) = phases.recoveries(events)
    rejoined = [e for e in of_kind(events, "rejoined") if e["replica"] == 1][0]
    ready = [e for e in of_kind(events, "warm_ready") if e["replica"] == 1 and e["time"] < failure["time"]]
    return {
        "warm": warm,
        "started_warm": recovery["warm"],
        "warm_ready_before_kill": bool(ready),
        "warm_import_s": ready[0]["seconds"] if ready else None,
        "rejoin_downtime_s": rejoined["downtime_s"],
        "phases": recovery["phases"],
        "transfer_s": rejoined["transfer_s"],
        "rejoined_at_step": rejoined["step"],
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = []
    for i in range(args.repeats):
        for warm in (True, False) if i % 2 == 0 else (False, True):  # alternate which goes first
            row = run(warm)
            runs.append(row)
            print(
                f"warm={row['warm']!s:5} downtime {row['rejoin_downtime_s']:.2f}s; from the fault: "
                f"{phases.timeline(row)}; warm ready before the kill: {row['warm_ready_before_kill']}",
                flush=True,
            )
    warm_down = statistics.median(r["rejoin_downtime_s"] for r in runs if r["warm"])
    cold_down = statistics.median(r["rejoin_downtime_s"] for r in runs if not r["warm"])
    medians = {
        kind: phase_medians([r for r in runs if r["warm"] == warm]) for kind, warm in (("warm", True), ("cold", False))
    }
    result = {
        "job": f"train_configs/llama3_debug_cpu.toml, {STEPS} steps, {KILL}, float32",
        "warm_rejoin_downtime_s": warm_down,
        "cold_rejoin_downtime_s": cold_down,
        "ratio_warm_to_cold": warm_down / cold_down,
        "phases_median_s": medians,
        "runs": runs,
    }
    path = write_result("warm", result)
    print(f"warm {warm_down:.2f}s vs cold {cold_down:.2f}s rejoin downtime (medians) -> {path}")


if __name__ == "__main__":
    main()
