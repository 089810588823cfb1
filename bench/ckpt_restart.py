"""Effective throughput: titan_recover against checkpoint-and-restart, same successive failures.

Both run the default model with R = 2 single-rank replica groups (M = 4 microbatches)
for N steps while replica 1 is SIGKILLed mid-backward three times: the first incarnation
at step a, and each later one at its b-th step (``step=+b``: counted from the step it
first computes, however long its restart took):

- checkpoint-and-restart: stock TorchTitan HSDP (``--recover.no-enable``) with a DCP
  checkpoint every K steps; on a failure the launcher restarts the whole torchrun job,
  which resumes from the latest checkpoint. K is swept and the best K is the baseline.
- titan_recover: the survivor finishes every step with all M microbatches while the
  killed group restarts and rejoins from it.

Reported per run, for the same N steps: training time (first step's start to the last
commit) and tokens committed per second over it (N x global batch x seq_len / time), the
same over the whole command (which adds one job start and end, the same for both and
amortized in a long run), and the costs the simulator needs (step time, checkpoint save,
restart, detection, rejoin), read from the event logs.

    .venv/bin/python -m bench.ckpt_restart [--quick]     -> bench/results/ckpt_restart.json
"""

import argparse
import statistics
from typing import Any, TypedDict

from bench.common import launch, step_gaps, write_result
from titan_recover.observability.events import of_kind

SHAPE = ["--parallelism.data_parallel_shard_degree", "1", "--training.global_batch_size", "8"]
TOKENS_PER_STEP = 8 * 128  # global batch x seq_len of the default config


class Plan(TypedDict):
    steps: int
    kills: tuple[str, ...]  # the step replica 1's i-th incarnation is killed at (fault plan's step=)
    ks: tuple[int, ...]  # the checkpoint intervals compared


FULL: Plan = {"steps": 60, "kills": ("8", "+12", "+12"), "ks": (3, 5, 10, 20)}
QUICK: Plan = {"steps": 40, "kills": ("5", "+8", "+8"), "ks": (5, 10)}


def fault_plan(kills: tuple[str, ...]) -> str:
    return "; ".join(f"kill replica=1 step={s} attempt={i}" for i, s in enumerate(kills))


def measure(system: str, steps: int, kills: tuple[str, ...], k: int | None = None) -> dict:
    args = [
        *SHAPE,
        "--training.steps",
        str(steps),
        "--recover.fault_plan",
        fault_plan(kills),
        "--recover.max_restarts",
        str(len(kills)),
    ]
    if k is not None:
        args += [
            "--recover.no-enable",
            "--checkpoint.enable",
            "--checkpoint.interval",
            str(k),
            "--checkpoint.folder",
            "checkpoint",
        ]
    events, wall = launch(args, f"{system} run")
    step_events = of_kind(events, "step")
    faults = of_kind(events, "fault_injected")
    if len(faults) != len(kills):  # the run ended before an incarnation reached its step: said, and kept
        print(f"{system}: {len(faults)} of {len(kills)} kills fired (the run ended first)", flush=True)
    final = {e["step"]: e for e in step_events}
    if sorted(final) != list(range(1, steps + 1)):
        raise RuntimeError(f"{system}: committed steps {sorted(final)} are not 1..{steps}")
    run: dict[str, Any] = {
        "system": system,
        "ckpt_every": k,
        "kills_fired": len(faults),
        "kill_steps": [f["step"] for f in faults],
        "wall_s": wall,
        "steps_computed": len(step_events),
        "losses": [final[s]["loss"] for s in range(1, steps + 1)],
        "digests": [final[s]["data_digest"] for s in range(1, steps + 1)],
    }
    if k is None:
        full = [e for e in step_events if len(e["members"]) == 2]
        run["step_s"] = statistics.median(step_gaps(full).values())
        run["detect_s"] = [e["latency_s"] for e in of_kind(events, "recovered")]
        failed = [e["time"] for e in of_kind(events, "failure")]
        run["rejoin_s"] = [a["time"] - f for a, f in zip(of_kind(events, "admitted"), failed)]
        run["transfer_s"] = [e["transfer_s"] for e in of_kind(events, "rejoined")]
    else:
        gaps = step_gaps(step_events)
        normal = statistics.median(g for s, g in gaps.items() if (s - 1) % k)
        run["step_s"] = normal
        run["ckpt_save_s"] = max(0.0, statistics.median(g for s, g in gaps.items() if (s - 1) % k == 0) - normal)
        restarts = []
        for fault in faults:  # fault -> the restarted job's first step, less that step's own compute
            first = next(e for e in step_events if e["time"] > fault["time"])
            restarts.append(first["time"] - fault["time"] - normal)
        run["restart_s"] = restarts
    # training time: the first step's start (one step before its event) to the last commit
    run["train_s"] = step_events[-1]["time"] - step_events[0]["time"] + run["step_s"]
    run["tokens_per_s"] = steps * TOKENS_PER_STEP / run["train_s"]
    run["command_tokens_per_s"] = steps * TOKENS_PER_STEP / wall
    return run


def run(quick: bool) -> dict:
    plan = QUICK if quick else FULL
    runs = [measure("titan_recover", plan["steps"], plan["kills"])]
    print(f"titan_recover: {runs[0]['wall_s']:.1f} s", flush=True)
    for k in plan["ks"]:
        runs.append(measure(f"ckpt-restart K={k}", plan["steps"], plan["kills"], k))
        print(f"ckpt-restart K={k}: {runs[-1]['wall_s']:.1f} s", flush=True)
    recover, baselines = runs[0], runs[1:]
    best = max(baselines, key=lambda r: r["tokens_per_s"])
    best_command = max(baselines, key=lambda r: r["command_tokens_per_s"])
    same_data = all(r["digests"] == recover["digests"] for r in baselines)
    return {
        "setup": {
            "replica_groups": 2,
            "ranks_per_group": 1,
            "microbatches": 4,
            "model": "llama3 debugmodel",
            "tokens_per_step": TOKENS_PER_STEP,
            **plan,
        },
        "runs": runs,
        "best_ckpt_every": best["ckpt_every"],
        "same_data_every_step": same_data,
        "every_kill_fired": all(r["kills_fired"] == len(plan["kills"]) for r in runs),
        "ckpt_restart_effective_throughput_ratio": recover["tokens_per_s"] / best["tokens_per_s"],
        "command_wall_ratio": recover["command_tokens_per_s"] / best_command["command_tokens_per_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    result = run(parser.parse_args().quick)
    path = write_result("ckpt_restart", result)
    print(f"{'system':20s} {'training s':>10s} {'tokens/s':>9s} {'command s':>9s} {'steps computed':>14s}")
    for r in result["runs"]:
        print(
            f"{r['system']:20s} {r['train_s']:10.1f} {r['tokens_per_s']:9.0f} "
            f"{r['wall_s']:9.1f} {r['steps_computed']:14d}"
        )
    print(
        f"effective throughput titan_recover / best checkpoint-and-restart (K = {result['best_ckpt_every']}): "
        f"{result['ckpt_restart_effective_throughput_ratio']:.2f}x over training time, "
        f"{result['command_wall_ratio']:.2f}x over the whole command; wrote {path}"
    )


if __name__ == "__main__":
    main()
