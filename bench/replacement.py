"""Node 0 of a three-node Slurm job lost whole (issue 68), side by side on one real Slurm of namespace nodes
(``titan_recover.tools.clusters.slurm_local``, Debian's Slurm 22.05): how long until the run computes again, with
the defaults (the etcd the run forms on its nodes: node 0's loss is a group failure) against node 0's TCPStore
(``CONTROL_STORE=tcpstore``: the job requeued and resumed from its last DCP checkpoint); and, with the defaults,
the node the run asks Slurm for: from its request to the first step it computes in the run.

Four Slurm nodes, the job on three (one single-rank group of the tiny llama3 each, fp32, M = 6, ``--steps``
steps), the fourth idle: the replacement job, and the requeued job, start there without waiting for node 0's
repair. Slurm here marks a node down after ``SlurmdTimeout`` = 2 s (a real cluster's default is 300 s, which the
requeue waits for and the defaults do not), and the 120 s Slurm holds a requeued job before it starts again is
skipped (``scontrol update StartTime=now``, as ``tests/test_slurm.py`` does): the requeue's figure is its
least. The defaults: every group holds after step 4's commit while node 0 is killed, the survivors go on once
the failure's epoch is out, and hold again after step 5's commit until the replacement is admitted (the run
would end before it otherwise). The TCPStore: node 0 killed once the step-4 checkpoint is written (checkpoints
every 2 steps). Rounds alternate the two.

    .venv/bin/python -m bench.replacement [--rounds 2] [--steps 8]   # root, Slurm, munge, etcd on PATH

Writes bench/results/replacement.json.
"""

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, job, write_result
from titan_recover.control import etcd_process, keys
from titan_recover.observability import logs
from titan_recover.tools.clusters import slurm_local
from titan_recover.tools.clusters.partitions import events

log = logging.getLogger(__name__)
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY")
RUN_S = 300.0  # a job's bound, start to end
REPLACE_AFTER_S = 30.0  # how long a group stays out before the run asks for a node (the default is 60 s)


def submit(slurm: slurm_local.SlurmCluster, out: Path, steps: int, *overrides: str, env: dict[str, str]) -> str:
    """The bench's job on three nodes, logging to ``out``.out and dumping to ``out``; its Slurm job id."""
    _, path, *args = job(out, tiny=True)
    tmp = Path(f"{out}.tmp")  # the job's temporary folder: its etcd members' data
    tmp.mkdir()
    layout = ("--training.global_batch_size", "12", "--training.steps", str(steps))
    return slurm.sbatch(
        ["--nodes=3", f"--output={out}.out", "scripts/slurm/train.sbatch", path, *args, *layout, *overrides],
        env={keys.SECRET_FILE_ENV: f"{out}.secret", "TMPDIR": str(tmp), **env},
        cwd=ROOT,
    )


def first_step_after(dump: Path, since: float, members: set[int] | None = None) -> float:
    """Seconds from ``since`` (wall clock) to the first step committed after it (with ``members`` among its
    groups, where given)."""
    times = [
        e["time"]
        for e in events(dump)
        if e["event"] == "step" and e["time"] > since and (members is None or members <= set(e["members"]))
    ]
    if not times:
        raise RuntimeError(f"no step after {since} in {dump}")
    return min(times) - since


def on_the_defaults(slurm: slurm_local.SlurmCluster, out: Path, steps: int) -> dict[str, float]:
    """Node 0 killed while every group holds after step 4's commit: seconds from the kill to the survivors' first
    step, and from the run's replacement request to the first step with group 0 back."""
    wait = "; ".join(f"sleep replica={r} step=4 phase=optimizer seconds=60 until=epoch" for r in (1, 2))
    # the survivors hold after step 5's commit until the replacement is admitted: the run does not end first
    hold = "; ".join(f"sleep replica={r} step=5 phase=optimizer seconds=180 until=epoch" for r in (1, 2))
    plan = f"sleep replica=0 step=4 phase=optimizer seconds=60; {wait}; {hold}"
    extra = ("--recover.fault_plan", plan, "--recover.replace_after_s", f"{REPLACE_AFTER_S:g}")
    job_id = submit(slurm, out, steps, *extra, env={})
    held = lambda: {e["replica"] for e in events(out) if e["event"] == "fault_injected"} == {0, 1, 2}  # noqa: E731
    slurm.wait(held, RUN_S, "every group's hold")
    killed = time.time()
    slurm.fail(0)
    fields = slurm.wait_job(job_id, ENDED, RUN_S)
    requested = [e for e in events(out) if e["event"] == "replacement_requested"]
    if fields["Restarts"] != "0" or len(requested) != 1:
        raise RuntimeError(f"the defaults: Restarts {fields['Restarts']}, requests {requested}: see {out}.out")
    slurm.wait_job(requested[0]["job"], ENDED, 60)
    return {
        "node0_killed_first_step_s": first_step_after(out, killed),
        "replacement_request_after_kill_s": requested[0]["time"] - killed,
        "replacement_first_step_s": first_step_after(out, requested[0]["time"], {0}),
    }


def on_the_tcpstore(slurm: slurm_local.SlurmCluster, out: Path, steps: int) -> dict[str, float]:
    """Node 0 killed once the step-4 checkpoint is written: seconds from the kill to the requeued job's first
    step (Slurm's hold of a requeued job skipped)."""
    checkpoint = ("--checkpoint.enable", "--checkpoint.interval", "2", "--recover.coordinator_timeout_s", "15")
    job_id = submit(slurm, out, steps, "--recover.fault_plan", "none", *checkpoint, env={"CONTROL_STORE": "tcpstore"})
    slurm.wait((out / "checkpoint" / "step-4" / ".metadata").exists, RUN_S, "the step-4 checkpoint")
    killed = time.time()
    slurm.fail(0)
    slurm.wait_job(job_id, ("PENDING",), 120)  # requeued by node 1's node.sh once Slurm finds node 0 down
    slurm.client(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
    fields = slurm.wait_job(job_id, ENDED, RUN_S)
    if (fields["JobState"], fields["Restarts"]) != ("COMPLETED", "1"):
        raise RuntimeError(f"the TCPStore: {fields['JobState']}, Restarts {fields['Restarts']}: see {out}.out")
    return {"node0_killed_first_step_s": first_step_after(out, killed)}


def ready(slurm: slurm_local.SlurmCluster) -> None:
    """Every node idle again: node 0 repaired after a round, the jobs of the round ended."""
    slurm.wait(lambda: not slurm.queued(), 120, "the round's jobs ended")
    if slurm.down(0):
        slurm.start_node(0)
    slurm.wait(lambda: set(slurm.states().values()) == {"idle"}, 60, "every node idle")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="alternated defaults / TCPStore runs")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    logs.setup("bench", "__main__")
    reason = slurm_local.unavailable() or etcd_process.unavailable()
    if reason:
        print(f"bench.replacement cannot run here: {reason}", file=sys.stderr)
        return 2
    runs: dict[str, list[dict[str, float]]] = {"defaults": [], "tcpstore": []}
    with tempfile.TemporaryDirectory(prefix="replacement-") as work:
        with slurm_local.SlurmCluster(4, Path(work) / "slurm") as slurm:
            for r in range(args.rounds):
                for name, case in (("defaults", on_the_defaults), ("tcpstore", on_the_tcpstore)):
                    ready(slurm)
                    figures = case(slurm, Path(work) / f"{name}-{r}", args.steps)
                    runs[name].append({k: round(v, 2) for k, v in figures.items()})
                    log.info(f"round {r + 1}: {name}: {runs[name][-1]}")

    def median(name: str, key: str) -> float:
        return round(statistics.median(run[key] for run in runs[name]), 2)

    ratio = median("tcpstore", "node0_killed_first_step_s") / median("defaults", "node0_killed_first_step_s")
    result = {
        "issue": 68,
        "setup": (
            f"Slurm 22.05 on 4 network-namespace nodes of one {len(os.sched_getaffinity(0))}-core machine, the job "
            f"on 3 (one single-rank group each, llama3 tiny, fp32, M = 6, {args.steps} steps), the fourth idle; "
            f"SlurmdTimeout 2 s; the requeued job's 120 s hold skipped; replace_after_s {REPLACE_AFTER_S:g}; "
            f"etcd {etcd_process.release()}"
        ),
        "command": f"python -m bench.replacement --rounds {args.rounds} --steps {args.steps}",
        "runs": runs,
        "node0_killed_first_step_s": {name: median(name, "node0_killed_first_step_s") for name in runs},
        "tcpstore_over_defaults_node0_killed_ratio": round(ratio, 2),
        "replacement_first_step_s": median("defaults", "replacement_first_step_s"),
    }
    path = write_result("replacement", result)
    log.info(
        f"node 0 killed -> first step: {result['node0_killed_first_step_s']} (TCPStore / defaults {ratio:.2f}); "
        f"a replacement's request -> its first step: {result['replacement_first_step_s']} s; {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
