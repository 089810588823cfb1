"""Coordinator fail-over on etcd, against the only alternative today: a full DCP restart.

On a real 3-member etcd cluster on this machine (the etcd on PATH), float32, the tiny
llama3 flavor (a step of ~0.1 s does not hide the disruption) in single-rank replica groups,
M = 8 microbatches per step:

- ``coordinator_failover_s``: R launchers, one per replica group, as R nodes would run them,
  each with a coordinator candidate beside it. After step ``KILL_AFTER`` the leader is
  SIGKILLed: seconds to the next committed step (its commit record's time). Also the
  seconds to the new leader's first event (``leader_takeover_s``).
- ``node_failover_s``: the same, but the leader's whole node is SIGKILLed (its launcher's
  process group: launcher, candidate, torchrun, rank): a replica group dies with the leader,
  and the survivors' next step needs the new leader to fence it.
- ``dcp_restart_s``: the same job in stock TorchTitan (one torchrun world of R ranks, a DCP
  checkpoint every ``DCP_EVERY`` steps), a rank SIGKILLed at step ``DCP_KILL``: seconds to the
  restarted job's first committed step; the steps it had to compute again are given too.
- ``etcd_step_time_ratio``: the README's main job (2 groups x FSDP 2) without failures,
  ``control_store`` etcd against the embedded TCPStore, runs alternated, ratio of median steps.
- Store load on the same failure-free runs: etcd requests/s (the members' own gRPC request
  counters, summed), and the latency of a probe client's read (``check``) and write (``add``)
  against each store every 0.2 s while the run trains.

    .venv/bin/python -m bench.failover [--replicas 2 4] [--repeats 2] [--ff-pairs 2]  -> bench/results/failover.json
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

from bench.common import (
    CONFIG,
    PRECISION,
    RESULTS,
    ROOT,
    launch,
    phase_medians,
    recovery_phases,
    step_gaps,
    timeline,
    write_result,
)
from titan_recover.control import etcd_process, keys, transport
from titan_recover.control.sealed import Run
from titan_recover.observability.events import of_kind, read_events
from titan_recover.tools.etcd_local import LocalEtcd

STEPS, KILL_AFTER = 40, 10
DCP_EVERY, DCP_KILL = 5, 8
FF_STEPS = 20
PROBE_S = 1.0  # the probe is load too: on etcd each add is a Raft write (at 0.2 s it was a third of the run's writes)
WAIT_S = 300.0


def shape(replicas: int) -> list[str]:
    """The fail-over jobs: the tiny model, so that a step (~0.1 s) does not hide the disruption."""
    return [
        *PRECISION,
        "--model.flavor",
        "tiny",
        "--training.seq_len",
        "64",
        "--lr_scheduler.warmup_steps",
        "2",
        "--parallelism.data_parallel_replicate_degree",
        str(replicas),
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--training.global_batch_size",
        "16",
        "--metrics.log_freq",
        "5",
    ]


def events_of(dump: str) -> list[dict]:
    """The run's events so far (a line still being written is left for the next look)."""
    path = Path(dump) / "recover_events.jsonl"
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


def wait_for(what: str, predicate: Callable[[], object], procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"{what}: {'timed out' if time.monotonic() > deadline else 'a launcher failed'}")
        time.sleep(0.05)


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def failover(url: str, replicas: int, node: bool) -> dict:
    """R launchers on etcd; the leader (``node``: its launcher's whole tree) SIGKILLed after step KILL_AFTER."""
    with tempfile.TemporaryDirectory() as dump:
        args = [
            sys.executable,
            "-m",
            "titan_recover.launch",
            "--job.config_file",
            str(CONFIG),
            "--job.dump_folder",
            dump,
            *shape(replicas),
            "--training.steps",
            str(STEPS),
            "--recover.control_store",
            url,
            "--recover.fault_plan",
            "none",
        ]
        env = {
            **os.environ,
            keys.SECRET_ENV: secrets.token_hex(16),
            keys.RUN_ENV: secrets.token_hex(8),
            "PYTHONUNBUFFERED": "1",
        }
        logs = [open(Path(dump) / f"node{r}.log", "w") for r in range(replicas)]
        procs = [
            subprocess.Popen(
                args,
                cwd=ROOT,
                stdout=logs[r],
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**env, keys.REPLICAS_ENV: str(r), **({keys.COORDINATOR_ENV: url} if r else {})},
            )
            for r in range(replicas)
        ]
        try:
            wait_for(
                f"step {KILL_AFTER}", lambda: KILL_AFTER in [e["step"] for e in of_kind(events_of(dump), "step")], procs
            )
            leader = of_kind(events_of(dump), "leader")[-1]["pid"]
            killed_at = time.time()
            if node:
                launcher = parent(leader)
                os.killpg(launcher, signal.SIGKILL)
                procs = [p for p in procs if p.pid != launcher]
            else:
                os.kill(leader, signal.SIGKILL)
            for p in procs:
                if p.wait(timeout=WAIT_S) != 0:
                    raise RuntimeError(
                        f"a launcher exited with {p.returncode}: " + (Path(dump) / "node0.log").read_text()[-3000:]
                    )
            events = list(read_events(str(Path(dump) / "recover_events.jsonl")))
            coordinator_lines = [
                line
                for r in range(replicas)
                for line in (Path(dump) / f"node{r}.log").read_text().splitlines()
                if "coordinator" in line
            ]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            for f in logs:
                f.close()
    steps = of_kind(events, "step")
    if sorted(e["step"] for e in steps) != list(range(1, STEPS + 1)):
        raise RuntimeError(f"steps logged: {sorted(e['step'] for e in steps)}")
    after = min(e["time"] for e in steps if e["time"] > killed_at)
    new_leaders = [e for e in of_kind(events, "leader") if e["time"] > killed_at]
    normal = statistics.median(step_gaps([e for e in steps if e["time"] < killed_at]).values())
    return {
        "failover_s": after - killed_at,
        "leader_takeover_s": new_leaders[0]["time"] - killed_at,
        "takeover_step": new_leaders[0]["step"],
        "step_s": normal,
        "leaders_after_kill": [{"pid": e["pid"], "after_s": e["time"] - killed_at} for e in new_leaders],
        **({"coordinator_log": coordinator_lines} if len(new_leaders) > 1 else {}),
        "failures": [{k: e[k] for k in ("replica", "step")} for e in of_kind(events, "failure")],
        # the group lost with the leader's node (a leader alone takes no group with it: no phase reached)
        "phases": recovery_phases(events),
        "members_at_end": steps[-1]["members"],
    }


def dcp_restart(replicas: int) -> dict:
    """Stock TorchTitan, one world of R ranks, DCP every DCP_EVERY steps, rank of replica 1 SIGKILLed at DCP_KILL."""
    events, wall = launch(
        [
            *shape(replicas),
            "--training.steps",
            str(STEPS),
            "--recover.no-enable",
            "--checkpoint.enable",
            "--checkpoint.interval",
            str(DCP_EVERY),
            "--checkpoint.folder",
            "checkpoint",
            "--recover.fault_plan",
            f"kill replica=1 step={DCP_KILL}",
        ],
        "stock DCP run",
    )
    steps = of_kind(events, "step")
    [fault] = of_kind(events, "fault_injected")
    first = next(e for e in steps if e["time"] > fault["time"])
    normal = statistics.median(
        g for s, g in step_gaps([e for e in steps if e["time"] < fault["time"]]).items() if (s - 1) % DCP_EVERY
    )
    return {
        "restart_s": first["time"] - fault["time"],
        "resumed_at_step": first["step"],
        "steps_computed_again": DCP_KILL - first["step"],
        "step_s": normal,
        "wall_s": wall,
    }


def etcd_requests(cluster: LocalEtcd) -> dict[str, float]:
    """Requests the members served so far, by method (their gRPC counters: the JSON gateway calls
    through them), and the CPU seconds their processes used."""
    counts: dict[str, int] = {}
    cpu = 0.0
    for name, port in cluster.client_ports.items():
        if cluster.procs[name].poll() is not None:
            continue
        for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode().splitlines():
            if line.startswith("grpc_server_handled_total{") and 'grpc_type="unary"' in line:
                method = line.split('grpc_method="', 1)[1].split('"', 1)[0]
                counts[method] = counts.get(method, 0) + int(float(line.rsplit(" ", 1)[1]))
        with open(f"/proc/{cluster.procs[name].pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return {**{m: n for m, n in counts.items() if n}, "cpu_s": cpu}


class Probe:
    """A client timing one read and one write against the run's store every PROBE_S while it trains."""

    def __init__(self, address: str, run: Run) -> None:
        self.address, self.run = address, run
        self.reads: list[float] = []
        self.writes: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        client = None
        while not self.stop.wait(PROBE_S):
            try:
                client = client or transport.connect(self.address, 2.0, self.run)
                t0 = time.perf_counter()
                client.check([keys.EPOCH])
                t1 = time.perf_counter()
                client.add("bench/probe", 1)
                t2 = time.perf_counter()
                self.reads.append(t1 - t0)
                self.writes.append(t2 - t1)
            except Exception:  # before the run's store is up, or after it closed
                client = None

    def summary(self) -> dict:
        self.stop.set()
        self.thread.join()
        q = lambda xs, p: 1000 * sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
        return {
            "samples": len(self.reads),
            "read_ms_p50": q(self.reads, 0.5),
            "read_ms_p99": q(self.reads, 0.99),
            "write_ms_p50": q(self.writes, 0.5),
            "write_ms_p99": q(self.writes, 0.99),
        }


def failure_free(cluster: LocalEtcd | None) -> dict:
    """The README's main job without its failure, on etcd or on the TCPStore; a probe times the store."""
    secret, port = secrets.token_hex(16), transport.free_port()
    address = cluster.url if cluster else f"127.0.0.1:{port}"
    extra = ["--recover.control_store", cluster.url] if cluster else ["--recover.coordinator_port", str(port)]
    before = etcd_requests(cluster) if cluster else {}
    run = Run(secret, secrets.token_hex(8))
    os.environ[keys.SECRET_ENV], os.environ[keys.RUN_ENV] = run.secret, run.id  # the launcher takes the run from here
    probe = Probe(address, run)
    try:
        events, wall = launch(
            [*PRECISION, "--training.steps", str(FF_STEPS), "--recover.fault_plan", "none", *extra], "failure-free run"
        )
    finally:
        latency = probe.summary()
        del os.environ[keys.SECRET_ENV], os.environ[keys.RUN_ENV]
    steps = of_kind(events, "step")
    result: dict[str, Any] = {
        "store": "etcd" if cluster else "tcpstore",
        "step_s": statistics.median(step_gaps(steps).values()),
        # the first member's rank 0: its vote to the decision, each step
        "commit_round_s": statistics.median(e["commit_round_s"] for e in steps),
        "wall_s": wall,
        "store_latency": latency,
    }
    if cluster:
        after = etcd_requests(cluster)
        result["etcd_requests_per_s"] = {k: (v - before.get(k, 0)) / wall for k, v in after.items() if k != "cpu_s"}
        result["etcd_cpu_cores"] = (after["cpu_s"] - before["cpu_s"]) / wall  # the 3 members together
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--ff-pairs", type=int, default=2, help="0: the committed failover.json's failure-free keys are kept"
    )
    parser.add_argument(
        "--step-time-only",
        action="store_true",
        help="only the failure-free pairs: their keys replace those of the committed failover.json",
    )
    args = parser.parse_args()
    cluster = LocalEtcd(3).start()
    try:
        ff = []
        for _ in range(args.ff_pairs):
            for etcd in (None, cluster):
                ff.append(failure_free(etcd))
                print(
                    f"failure-free on {ff[-1]['store']}: step {ff[-1]['step_s']:.3f}s, "
                    f"commit round {1000 * ff[-1]['commit_round_s']:.1f} ms",
                    flush=True,
                )
        if args.step_time_only:
            step_time(ff)
            return
        per_r = {}
        for r in args.replicas:
            runs: dict[str, list[dict]] = {"leader": [], "node": []}
            for _ in range(args.repeats):
                for kind in runs:
                    runs[kind].append(failover(cluster.url, r, node=kind == "node"))
                    split = runs[kind][-1]["phases"]
                    print(
                        f"R={r} {kind} killed: next step after {runs[kind][-1]['failover_s']:.2f}s "
                        f"(new leader after {runs[kind][-1]['leader_takeover_s']:.2f}s)"
                        + (
                            f"; its group's recovery from the fault: {timeline(split)}"
                            if any(v is not None for v in split.values())
                            else ""
                        ),
                        flush=True,
                    )
            dcp = dcp_restart(r)
            print(f"R={r} DCP restart: {dcp['restart_s']:.2f}s", flush=True)
            per_r[str(r)] = {
                "coordinator_failover_s": statistics.median(x["failover_s"] for x in runs["leader"]),
                "node_failover_s": statistics.median(x["failover_s"] for x in runs["node"]),
                "dcp_restart_s": dcp["restart_s"],
                "node_phases_median_s": phase_medians(runs["node"]),
                "runs": runs,
                "dcp": dcp,
            }
    finally:
        cluster.stop()
    first = str(args.replicas[0])
    committed = json.loads((RESULTS / "failover.json").read_text()) if not ff else {}
    kept = {k: committed["setup"][k] for k in ("failure_free_pairs_run", "ff_pairs") if k in committed.get("setup", {})}
    result = {
        "setup": {
            "etcd": f"3 members on this machine (etcd {etcd_process.release()})",
            "model": "llama3 tiny (fail-over, DCP) / debugmodel 2x2 (failure-free)",
            "precision": "float32",
            "steps": STEPS,
            "kill_after_step": KILL_AFTER,
            "microbatches": 8,
            "leader_lease_s": 3.0,
            "dcp_every": DCP_EVERY,
            "dcp_kill_step": DCP_KILL,
            "ff_steps": FF_STEPS,
            **kept,
        },
        # the keys, at the first R measured; every R under by_replicas
        "coordinator_failover_s": per_r[first]["coordinator_failover_s"],
        "node_failover_s": per_r[first]["node_failover_s"],
        "dcp_restart_s": per_r[first]["dcp_restart_s"],
        "by_replicas": per_r,
        **(step_keys(ff) if ff else {k: committed[k] for k in STEP_KEYS}),
    }
    path = write_result("failover", result)
    print(f"{'R':>3s} {'leader killed':>14s} {'node killed':>12s} {'DCP restart':>12s}")
    for r, x in per_r.items():
        print(f"{r:>3s} {x['coordinator_failover_s']:13.2f}s {x['node_failover_s']:11.2f}s {x['dcp_restart_s']:11.2f}s")
    print(f"{step_line(result)}; wrote {path}")


STEP_KEYS = (
    "etcd_step_time_ratio",
    "commit_round_s",
    "step_s",
    "failure_free",
    "etcd_requests_per_s",
    "etcd_cpu_cores",
    "tcpstore_requests_per_s",
)
"""failover.json's keys from the failure-free pairs (``step_keys``)."""


def step_keys(ff: list[dict]) -> dict[str, Any]:
    """The failure-free pairs' keys of failover.json: step times and commit rounds by control store, etcd's load."""

    def median(key: str, store: str) -> float:
        return statistics.median(x[key] for x in ff if x["store"] == store)

    return {
        "etcd_step_time_ratio": median("step_s", "etcd") / median("step_s", "tcpstore"),
        "commit_round_s": {b: median("commit_round_s", b) for b in ("etcd", "tcpstore")},
        "step_s": {b: median("step_s", b) for b in ("etcd", "tcpstore")},
        "failure_free": ff,
        "etcd_requests_per_s": statistics.median(
            sum(x["etcd_requests_per_s"].values()) for x in ff if x["store"] == "etcd"
        ),
        "etcd_cpu_cores": median("etcd_cpu_cores", "etcd"),
        "tcpstore_requests_per_s": None,  # TCPStore counts no requests; the probe's latency is measured for both
    }


def step_line(result: dict[str, Any]) -> str:
    step, vote = result["step_s"], result["commit_round_s"]
    return (
        f"failure-free step: etcd {step['etcd']:.3f}s, TCPStore {step['tcpstore']:.3f}s "
        f"(ratio {result['etcd_step_time_ratio']:.3f}); commit round etcd {1000 * vote['etcd']:.1f} ms, "
        f"TCPStore {1000 * vote['tcpstore']:.1f} ms; etcd served {result['etcd_requests_per_s']:.0f} requests/s "
        f"on {result['etcd_cpu_cores']:.2f} cores"
    )


def step_time(ff: list[dict]) -> None:
    """``--step-time-only``: the committed failover.json with its failure-free keys from these pairs."""
    path = RESULTS / "failover.json"
    result = {**json.loads(path.read_text()), **step_keys(ff)}
    result["setup"] = {**result["setup"], "failure_free_pairs_run": time.strftime("%Y-%m-%d"), "ff_pairs": len(ff) // 2}
    write_result("failover", result)
    print(f"{step_line(result)}; wrote {path} (its fail-over keys as committed)")


if __name__ == "__main__":
    main()
