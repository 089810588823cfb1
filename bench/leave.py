"""A node's notice against its loss, side by side in one run: what a leave on notice saves.

Two launchers on this host stand for two nodes (A: the coordinator and replica 0; B: replica 1), on the
default job's model as single-rank groups (llama3 debugmodel, M = 4, float32 on a CPU). Once step ``AT`` is
logged, node B either gets SIGTERM (a notice: its group leaves at the step boundary, docs/elasticity.md)
or loses its whole process tree to SIGKILL (a preemption without notice: the node is gone, found by the
heartbeat timeout). Runs alternate which comes first.

Per run: the survivor's stall (the gaps of the step in which the membership changed and the one after,
less two median gaps of replica 0's steps alone after it), the part of it not spent computing microbatches
(``idle_s``: waiting for the leaver or for the new membership, re-forming groups; the rest is the survivor's
own compute slowed, on one host, by the leaving node's processes as they exit), how many of the survivor's
all-reduces in the changed step were given up (``aborted``), how the coordinator learned of it (a ``left``
event, or a ``failure`` and its detection), and whether every step still summed M microbatches.

``--leaver-hold-s S``: replica 1 holds S seconds in the optimizer step of steps ``AT`` + 1 and + 2, after their
commit, as a leaver slow after its last commit would (a big model's optimizer step, a checkpoint save as the
step's leader): what the others wait for when the leave is reported only as the next step begins.

    .venv/bin/python -m bench.leave [--pairs 2]                    -> bench/results/leave.json
    .venv/bin/python -m bench.leave --pairs 1 --leaver-hold-s 1    -> bench/results/leave_held.json
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, job, step_gaps, write_result
from titan_recover.control import keys, transport
from titan_recover.observability.events import of_kind, read_events

STEPS, AT, M = 30, 8, 4
GROUPS = ["--parallelism.data_parallel_shard_degree", "1", "--training.global_batch_size", str(2 * M)]


def start(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """One node's launcher, in a session of its own (its whole tree can be SIGKILLed)."""
    return subprocess.Popen(
        args, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def run(notice: bool, hold_s: float = 0.0) -> dict:
    """One run; node B noticed (SIGTERM) or lost (SIGKILL of its tree) once step ``AT`` is logged; replica 1
    holding ``hold_s`` in the optimizer step of the two steps after it."""
    plan = "; ".join(f"sleep replica=1 step={AT + k} phase=optimizer seconds={hold_s:g}" for k in (1, 2) if hold_s)
    with tempfile.TemporaryDirectory() as scratch:
        dump = Path(scratch) / "dump"
        port = transport.free_port()
        args = [
            sys.executable,
            "-m",
            "titan_recover.launch",
            *job(dump),
            "--training.steps",
            str(STEPS),
            *GROUPS,
            "--recover.fault_plan",
            plan or "none",
            "--recover.max_restarts",
            "0",  # the lost group stays out, as the one that left: the same members after either
            "--recover.coordinator_port",
            str(port),
            "--recover.coordinator_bind",
            "127.0.0.1",
        ]
        env = {**os.environ, keys.SECRET_ENV: "bench-leave-secret"}
        env_b = {**env, keys.REPLICAS_ENV: "1", keys.COORDINATOR_ENV: f"127.0.0.1:{port}"}
        a, b = start(args, {**env, keys.REPLICAS_ENV: "0"}), start(args, env_b)
        try:
            events = dump / "recover_events.jsonl"
            deadline = time.monotonic() + 600
            while not (events.exists() and f'"step": {AT},' in events.read_text()):
                if time.monotonic() > deadline or a.poll() is not None or b.poll() is not None:
                    raise RuntimeError(f"the run never reached step {AT} (exit codes {a.poll()}, {b.poll()})")
                time.sleep(0.05)
            sent = time.time()
            if notice:
                b.send_signal(signal.SIGTERM)
            else:
                os.killpg(b.pid, signal.SIGKILL)
            code_b = b.wait(timeout=120)
            gone_s = time.time() - sent
            if a.wait(timeout=600) != 0:
                raise RuntimeError(f"node A's run failed (exit {a.returncode})")
        finally:
            for proc in (a, b):
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        log = list(read_events(str(events)))
    steps = sorted(of_kind(log, "step"), key=lambda e: e["step"])
    changed = next(e["step"] for e in steps if e["members"] == [0])
    gaps = step_gaps(steps)
    alone = statistics.median(gaps[s] for s in gaps if s > changed + 1)
    idle = {
        e["step"]: gaps[e["step"]] - e["quotas"]["0"] * e["seconds_per_microbatch"]["0"]
        for e in steps
        if e["step"] in gaps
    }
    idle_alone = statistics.median(idle[s] for s in idle if s > changed + 1)
    moments = [e for e in of_kind(log, "recovery_moments") if e["replica"] == 0 and e["step"] == changed]
    failures = of_kind(log, "failure")
    return {
        "notice": notice,
        "node_b_exit": code_b,
        "node_b_gone_s": round(gone_s, 3),
        "changed_at_step": changed,
        "stall_s": round(gaps[changed] + gaps.get(changed + 1, alone) - 2 * alone, 3),
        "step_alone_s": round(alone, 3),
        "idle_s": round(idle[changed] + idle.get(changed + 1, idle_alone) - 2 * idle_alone, 3),
        "aborted": moments[0]["aborted"] if moments else None,
        "left": len(of_kind(log, "left")),
        "failures": len(failures),
        "detection_s": round(failures[0]["detected"] - sent, 3) if failures else None,
        "m_every_step": all(len(e["microbatches"]) == M for e in steps),
        "steps": len(steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--leaver-hold-s", type=float, default=0.0, help="replica 1 slow after its commits (s)")
    args = parser.parse_args()
    runs = []
    for i in range(args.pairs):
        for notice in (True, False) if i % 2 == 0 else (False, True):  # alternate which goes first
            row = run(notice, args.leaver_hold_s)
            runs.append(row)
            print(
                f"{'notice (SIGTERM)' if notice else 'node lost (SIGKILL)':19} stall {row['stall_s']:.2f}s "
                f"(idle {row['idle_s']:.2f}s, all-reduces aborted {row['aborted']}), "
                f"changed at step {row['changed_at_step']}, left {row['left']}, failures {row['failures']}, "
                f"detection {row['detection_s']}s, M every step {row['m_every_step']}",
                flush=True,
            )
    leave, lost, idle_notice, idle_lost = (
        round(statistics.median(r[key] for r in runs if r["notice"] == notice), 3)
        for key, notice in (("stall_s", True), ("stall_s", False), ("idle_s", True), ("idle_s", False))
    )
    result = {
        "job": (
            f"two launchers on one host, 2 single-rank groups of train_configs/llama3_debug_cpu.toml, M = {M}, "
            f"{STEPS} steps, "
            f"node B noticed or lost once step {AT} is logged, float32 on a CPU"
            + (
                f", replica 1 held {args.leaver_hold_s:g}s in the optimizer of steps {AT + 1}-{AT + 2}"
                if args.leaver_hold_s
                else ""
            )
        ),
        "stall_s_notice": leave,
        "stall_s_lost": lost,
        "stall_saved_s": round(lost - leave, 3),
        "idle_s_notice": idle_notice,
        "idle_s_lost": idle_lost,
        "runs": runs,
    }
    path = write_result("leave_held" if args.leaver_hold_s else "leave", result)
    print(
        f"the survivor's stall: {leave:.2f}s on a notice, {lost:.2f}s when the node is lost (idle "
        f"{idle_notice:.2f}s and {idle_lost:.2f}s of it) -> {path}"
    )


if __name__ == "__main__":
    main()
