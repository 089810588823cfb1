"""What ``[recover] exact`` costs and whether it holds (issue 31).

- the step-time ratio, exact on / off, on the default job without faults, in interleaved pairs;
- the same bits with 2, 3 and 4 replica groups (``train_configs/llama3_exact_cpu.toml``, M = 12),
  failure-free, and with one kill at each count, all compared with ``compare --exact`` against the
  failure-free R = 2 run;
- with ``--etcd``, the same on a local 3-member etcd (``control_store``): a kill, the restarted
  group's rejoin, then a hang (SIGSTOP) of the other group, its fencing, restart and rejoin.

    .venv/bin/python -m bench.exact [--pairs 2] [--steps 12] [--exact-steps 8] [--etcd]

Writes bench/results/exact.json. The many-fault check on the TCPStore is ``bench.soak --exact``
(``bench/results/exact_soak.json``): its faults count in ``exact_faults`` when it found no mismatch,
and ``exact_param_digests_equal`` then covers its steps too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import statistics
import sys
from typing import Any

from bench.common import PRECISION, RESULTS, launch, step_gaps, write_result
from titan_recover.compare import compare_runs
from titan_recover.control import keys
from titan_recover.observability import logs
from titan_recover.observability.events import of_kind

log = logging.getLogger(__name__)

KILLS = {
    2: "kill replica=1 rank=1 step=3 phase=backward",
    3: "kill replica=2 rank=0 step=3 phase=forward",
    4: "kill replica=3 rank=1 step=3 phase=allreduce",
}
ETCD_PLAN = (
    "kill replica=1 rank=1 step=2 phase=backward; sleep replica=0 step=3 phase=optimizer seconds=120 until=epoch; "
    "stop replica=0 rank=0 step=5 phase=forward"
)
"""On etcd: replica 1 killed in step 2; replica 0 carries on alone and waits in step 3 for its rejoin; replica 0
hangs in step 5, replica 1 carries on alone until replica 0's next incarnation rejoins."""


def on_etcd(shape: list[str]) -> list[dict]:
    """The exact job with ``ETCD_PLAN`` on a fresh local 3-member etcd, as one node's launcher."""
    from titan_recover.tools.etcd_local import LocalEtcd

    cluster = LocalEtcd(3).start()
    saved = dict(os.environ)
    os.environ.update(
        {keys.SECRET_ENV: secrets.token_hex(16), keys.RUN_ENV: secrets.token_hex(8), keys.REPLICAS_ENV: "0,1"}
    )  # the run's first node: it begins the run
    try:
        events, _ = launch(
            [*shape, "--recover.fault_plan", ETCD_PLAN, "--recover.control_store", cluster.url],
            "exact R=2 on etcd",
            "llama3_exact_cpu",
        )
        return events
    finally:
        os.environ.clear()
        os.environ.update(saved)
        cluster.stop()


def step_time(events: list[dict]) -> float:
    """The median time between consecutive steps, the first two left out (warm-up)."""
    gaps = step_gaps(of_kind(events, "step"))
    return statistics.median(v for k, v in gaps.items() if k > 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--steps", type=int, default=12, help="steps of each default-job run timed")
    p.add_argument("--exact-steps", type=int, default=8, help="steps of each replica-count run")
    p.add_argument("--etcd", action="store_true", help="also the kill-hang-rejoin run on a local etcd")
    a = p.parse_args(argv)
    logs.setup("bench", __name__, "bench")
    base = [*PRECISION, "--recover.fault_plan", "none", "--training.steps", str(a.steps)]
    times: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(a.pairs):
        for mode, extra in (("off", []), ("on", ["--recover.exact"])):
            events, _ = launch([*base, *extra], f"default job, exact {mode}")
            times[mode].append(step_time(events))
            log.info(f"pair {i}: exact {mode}: {times[mode][-1]:.3f} s/step")
    ratio = statistics.median(times["on"]) / statistics.median(times["off"])

    runs: dict[str, list[dict]] = {}
    for replicas in (2, 3, 4):
        shape = [
            *PRECISION,
            "--training.steps",
            str(a.exact_steps),
            "--parallelism.data_parallel_replicate_degree",
            str(replicas),
        ]
        runs[f"free{replicas}"], _ = launch(
            [*shape, "--recover.fault_plan", "none"], f"exact R={replicas}", "llama3_exact_cpu"
        )
        runs[f"kill{replicas}"], _ = launch(
            [*shape, "--recover.fault_plan", KILLS[replicas]], f"exact R={replicas} kill", "llama3_exact_cpu"
        )
        log.info(f"R={replicas}: done")
    if a.etcd:
        runs["etcd2"] = on_etcd([*PRECISION, "--training.steps", str(a.exact_steps)])
    reference = runs["free2"]
    comparisons = {
        name: compare_runs(reference, events, 0.0, exact=True) for name, events in runs.items() if name != "free2"
    }
    for name, c in comparisons.items():
        log.info(f"{name} vs free2: {c.steps} steps, {c.digest_steps} digest steps, problems {c.exact[:3]}")
    faults = {name: len(of_kind(events, "failure")) for name, events in runs.items()}
    soak_path = RESULTS / "exact_soak.json"
    soak: dict[str, Any] = (json.loads(soak_path.read_text()) if soak_path.exists() else None) or {}
    soak_exact = soak.get("exact") or {}
    if soak_exact:
        faults["soak"] = len(soak["faults"])
    result = {
        "issue": 31,
        "command": "python -m bench.exact " + " ".join(argv if argv is not None else sys.argv[1:]),
        "precision": PRECISION[-1],
        "exact_step_time_ratio": round(ratio, 3),
        "step_time_s": {mode: [round(t, 4) for t in ts] for mode, ts in times.items()},
        "exact_faults": sum(faults.values()),
        "faults_by_run": faults,
        "exact_max_rel_loss_dev": max(
            [c.max_rel_loss_dev for c in comparisons.values()] + [soak_exact.get("max_rel_loss_dev", 0.0)]
        ),
        "exact_param_digests_equal": int(
            all(not c.exact for c in comparisons.values()) and not soak_exact.get("mismatches", 0)
        ),
        "soak": {
            "command": soak["command"],
            "steps": soak_exact["steps"],
            "digest_steps": soak_exact["digest_steps"],
            "mismatches": soak_exact["mismatches"],
            "faults_by_kind": soak.get("faults_by_kind"),
        }
        if soak_exact
        else None,
        "exact_replica_counts": [2, 3, 4],
        "compared": {
            name: {"steps": c.steps, "digest_steps": c.digest_steps, "mismatches": c.exact[:5]}
            for name, c in comparisons.items()
        },
        "redos": sum(len(of_kind(events, "exact_redo")) for events in runs.values()),
    }
    path = write_result("exact", result)
    log.info(
        f"exact/plain step time {ratio:.3f}; {result['exact_faults']} faults; "
        f"digests equal: {result['exact_param_digests_equal']}; wrote {path}"
    )
    return 0 if result["exact_param_digests_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
