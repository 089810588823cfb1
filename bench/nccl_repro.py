"""Standalone check of three ProcessGroupNCCL behaviours (torch 2.11, one GPU): the watchdog's sleep of
4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC after a failed Work, errors raised at a collective's launch on a
non-blocking communicator, and the first group's heartbeat monitor acting on another group's failure.

Needs torch with a GPU and this checkout (no TorchTitan); bench/gpu_check.sh runs it on a GPU:
    python3 bench/nccl_repro.py            # every case, about 3 minutes
    python3 bench/nccl_repro.py --case B   # one case
Case B's settings are the ones titan_recover builds its replicate groups with (``collectives.NCCL_GROUP_ENV``),
case F's the ones the launcher gives the ranks' first group (``TORCH_NCCL_DUMP_ON_TIMEOUT=0``).

Each case starts WORLD processes on GPU 0, each posing as its own host (NCCL_HOSTID, sockets over
loopback), like bench.nccl_probe. Every rank first makes a stand-in for TorchTitan's default group
(the first ProcessGroupNCCL of the process, so uid 0, TORCH_NCCL_ASYNC_ERROR_HANDLING=3), then a
replicate group with the case's settings. The last rank SIGKILLs itself while the others' all-reduce
on the replicate group is in flight. Survivors: poll is_completed, wait() (raises), abort(), drop the
group (its destructor joins the watchdog thread), build a new group without the dead rank, all-reduce,
check the sum, then linger to see whether the uid-0 group's heartbeat monitor kills the process.
Printed per survivor: detect/abort/dtor/reform seconds, the sum's correctness, and how the process ended.
"""

import argparse
import datetime
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

WORLD = 3
log = logging.getLogger(__name__)
CASES = {
    # name: (replicate-group env, uid-0 group env, linger seconds, what we expect)
    "A": (
        {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "5000"},
        {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"},
        2,
        "dtor ~20 s (= 4 x 5000 ms watchdog sleep)",
    ),
    "B": (
        {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0"},
        {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"},
        2,
        "dtor < 1 s, reform < 2 s, ok",
    ),
    "C": (
        {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0"},
        {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"},
        2,
        "as B",
    ),
    "D": (
        {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000"},
        {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"},
        10,
        "survivors SIGABRT ~4 s after the fault",
    ),
    "E": (
        {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0"},
        {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "15"},
        40,
        "reform ok, then the uid-0 group's monitor SIGABRTs survivors ~15-20 s after the fault",
    ),
    "F": (
        {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0"},
        {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "15"},
        40,
        "survivors alive after 40 s",
    ),
    "G": (
        {
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
            "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0",
            "REPRO_LAUNCH_AFTER_DEATH": "1",
        },
        {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"},
        2,
        "launching the all-reduce after the peer died raises DistBackendError at launch "
        "(NCCLUtils.cpp:210 / ProcessGroupNCCL.cpp:3780)",
    ),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, linger: float) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=30))
    rep_env = json.loads(os.environ["REPRO_REP_ENV"])
    pg0_env = json.loads(os.environ["REPRO_PG0_ENV"])

    # uid 0: stands in for TorchTitan's default group (mode 3, its own DUMP_ON_TIMEOUT / heartbeat settings)
    os.environ.update(pg0_env)
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"
    pg0 = dist.ProcessGroupNCCL(dist.PrefixStore("pg0/", store), rank, world, dist.ProcessGroupNCCL.Options())

    # replicate groups: settings are read by each ProcessGroupNCCL's constructor
    os.environ.update({k: v for k, v in rep_env.items() if k.startswith("TORCH_")})

    def make(prefix: str, r: int, n: int):
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.blocking = 0
        opts._timeout = datetime.timedelta(seconds=30)
        g = dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), r, n, opts)
        g.eager_connect_single_device(dev)
        return g

    g = make("e1/", rank, world)
    t = torch.ones(64 << 20, device=dev)  # 256 MiB: the collective is in flight when the peer dies
    g.allreduce([t]).wait()
    torch.cuda.synchronize()
    store.set(f"warm/{rank}", "1")
    store.wait([f"warm/{r}" for r in range(world)])

    victim = rank == world - 1
    after_death = rep_env.get("REPRO_LAUNCH_AFTER_DEATH") == "1"
    if victim:
        time.sleep(0.3 if not after_death else 0.0)
        os.kill(os.getpid(), signal.SIGKILL)
    if after_death:
        time.sleep(3.0)  # the peer is dead and NCCL has noticed before we launch
    t_fault = time.time()
    rec: dict = {"rank": rank}
    try:
        w = g.allreduce([t])
        while not w.is_completed():
            if time.time() - t_fault > 25:
                break
            time.sleep(0.001)
        rec["detect"] = round(time.time() - t_fault, 3)
        try:
            w.wait()
            rec["wait_error"] = None
        except Exception as e:  # noqa: BLE001
            rec["wait_error"] = str(e).splitlines()[0][:160]
        del w
    except Exception as e:  # noqa: BLE001  (case G: raised by the launch itself)
        rec["launch_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    t1 = time.time()
    g.abort()
    rec["abort"] = round(time.time() - t1, 3)
    t2 = time.time()
    del g  # ~ProcessGroupNCCL: Watchdog::join(), HeartbeatMonitor::join()
    rec["dtor"] = round(time.time() - t2, 3)
    t3 = time.time()
    g2 = make("e2/", rank, world - 1)
    x = torch.full((1024,), float(rank + 1), device=dev)
    g2.allreduce([x]).wait()
    torch.cuda.synchronize()
    rec["reform"] = round(time.time() - t3, 3)
    rec["ok"] = bool(x[0].item() == sum(range(1, world)))
    rec["since_fault"] = round(time.time() - t_fault, 3)
    print("RESULT " + json.dumps(rec), flush=True)
    end = time.time() + linger
    while time.time() < end:  # keep the process (and the uid-0 group) alive
        time.sleep(0.5)
    print("RESULT " + json.dumps({"rank": rank, "alive_after_s": round(time.time() - t_fault, 1)}), flush=True)
    g2.abort()
    pg0.abort()
    os._exit(0)


def run_case(name: str) -> None:
    rep_env, pg0_env, linger, expect = CASES[name]
    port = free_port()
    procs = []
    t0 = time.time()
    for r in range(WORLD):
        env = dict(os.environ)
        env.update(
            {
                "NCCL_HOSTID": f"repro-host-{r}",
                "NCCL_SOCKET_IFNAME": "lo",
                "NCCL_IB_DISABLE": "1",
                "NCCL_DEBUG": "WARN",
                "TORCH_NCCL_NONBLOCKING_TIMEOUT": "30",
                "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
                "TORCH_FR_BUFFER_SIZE": "0",
                "REPRO_REP_ENV": json.dumps(rep_env),
                "REPRO_PG0_ENV": json.dumps(pg0_env),
            }
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", str(r), "--port", str(port), "--linger", str(linger)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    log.info(f"== case {name}: expect {expect}")
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        results = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        notable = [
            ln
            for ln in out.splitlines()
            if any(
                k in ln
                for k in (
                    "signal dumping",
                    "Some NCCL operations",
                    "Terminating the process",
                    "terminate called",
                    "NCCLUtils.cpp",
                    "ProcessGroupNCCL.cpp:37",
                )
            )
        ]
        log.info("\n    ".join([f"  rank {r}: rc={p.returncode} t={time.time() - t0:.1f}s", *results, *notable[:6]]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--linger", type=float, default=2)
    ap.add_argument("--case", choices=sorted(CASES))
    a = ap.parse_args()
    from titan_recover.observability import logs

    logs.setup("bench", __name__)
    if a.worker is not None:
        worker(a.worker, WORLD, a.port, a.linger)
        return
    for name in [a.case] if a.case else sorted(CASES):
        run_case(name)


if __name__ == "__main__":
    main()
