"""The replicate dimension on NCCL, one GPU: titan_recover's ``ReplicateProcessGroups`` with a peer
SIGKILLed, then a peer SIGSTOPped, while the others are in an all-reduce.

``R`` single-rank replicas share GPU 0, each with an ``NCCL_HOSTID`` of its own (NCCL refuses two
ranks of one communicator on one GPU otherwise), and all-reduce a 64 MiB tensor step after step. This
process plays the coordinator: it serves the store, SIGKILLs replica R-1 once it has launched its
all-reduce of step 3, publishes the epoch without it, then does the same to replica R-2 at step 6 with
SIGSTOP. Each rank logs, as JSON lines, every step (members, seconds, whether the sum is right, GPU
memory) and every abort (how long it took, the error). The summary gives, per fault and survivor:
``abort`` (the fault to the survivor's CollectiveAborted), ``reform`` (the fault to the first good
all-reduce of the new epoch, its group built), and the device's memory in use (all processes) before
the fault and at the end. No TorchTitan: only torch and titan_recover's collectives, as a GPU node has
them. ``bench/results/nccl_probe.json``: one H200, torch 2.11.0+cu130, NCCL 2.28.9,
``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (with torch's default the survivor whose all-reduce saw the
dead peer was torn down by the watchdog, SIGABRT, and the others waited for it).

    PYTHONPATH=. TITAN_RECOVER_SECRET=<32 hex> python3 -m bench.nccl_probe [--backend gloo] [--out FILE]

Run it with the environment a rank would have; ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` decides whether
the NCCL watchdog tears a survivor down when its collective sees the peer's death.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPLICAS = 4
MIB = 64
STEPS = 12
FAULTS = ((REPLICAS - 1, 3, "SIGKILL"), (REPLICAS - 2, 6, "SIGSTOP"))  # (replica, step, signal)
WAIT_S = 300.0
log = logging.getLogger("titan_recover.bench.nccl_probe")


def rank(address: str, replica: int, backend: str) -> None:
    """One replica: all-reduces until it is fenced out or STEPS are done; its fault point (if any) hangs
    it after its all-reduce of that step is launched, until this probe's parent signals it."""
    import torch

    from titan_recover.collectives import CollectiveAborted, ReplicateProcessGroups
    from titan_recover.control import transport
    from titan_recover.membership import Membership

    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = transport.connect(address, 60)
    groups = ReplicateProcessGroups(store, replica=replica, group_rank=0, timeout_s=60, backend=backend,
                                    device=device, host="127.0.0.1")
    doomed = {r: s for r, s, _ in FAULTS}

    def memory_mb() -> float | None:
        if device.type != "cuda":
            return None
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**20

    def say(**record: object) -> None:
        print("PROBE " + json.dumps({"replica": replica, "t": time.time(), **record}), flush=True)

    step = 0
    while True:
        epoch = int(store.get("probe/epoch"))
        members = tuple(json.loads(store.get(f"probe/members/{epoch}")))
        if replica not in members or step >= STEPS:
            kept = groups.close()
            say(event="done", epoch=epoch, step=step, device_mb=memory_mb(), kept=kept)
            return
        tensor = torch.ones(MIB * 2**18, device=device)

        def launched() -> None:
            if doomed.get(replica) == step:
                store.set(f"probe/launched/{replica}", str(time.time()))
                time.sleep(WAIT_S)  # until the parent's signal

        start = time.time()
        try:
            groups.allreduce(Membership(epoch, members), [tensor], abort=lambda: int(store.get("probe/epoch")) > epoch,
                             on_launched=launched)
        except CollectiveAborted as e:
            say(event="aborted", epoch=epoch, step=step, seconds=time.time() - start, error=str(e)[:300],
                device_mb=memory_mb())
            continue
        ok = bool((tensor == len(members)).all())
        say(event="step", epoch=epoch, step=step, members=list(members), seconds=time.time() - start, ok=ok,
            device_mb=memory_mb())
        step += 1


def summarize(records: list[dict], faults: list[dict]) -> list[dict]:
    """Per fault and survivor: seconds to the abort and to the first good step of the new epoch."""
    out = []
    for fault in faults:
        for r in fault["members"]:
            mine = [rec for rec in records if rec["replica"] == r]
            aborted = next((rec for rec in mine if rec["event"] == "aborted" and rec["t"] >= fault["t"]), None)
            good = next((rec for rec in mine if rec["event"] == "step" and rec["epoch"] >= fault["epoch"]), None)
            before = [rec["device_mb"] for rec in mine if rec["event"] == "step" and rec["t"] < fault["t"]]
            out.append({"fault": fault["signal"], "replica": fault["replica"], "survivor": r,
                        "abort_s": None if aborted is None else round(aborted["t"] - fault["t"], 3),
                        "reform_s": None if good is None else round(good["t"] - fault["t"], 3),
                        "first_good_ok": None if good is None else good["ok"],
                        "device_mb_before": before[-1] if before else None,
                        "device_mb_at_end": next((rec["device_mb"] for rec in mine if rec["event"] == "done"), None)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--out", type=Path, default=Path("bench/results/nccl_probe.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="[nccl_probe] %(message)s")
    from titan_recover.control import transport

    port = transport.free_port()
    server = transport.serve(port, 60)  # noqa: F841: serves while the probe runs
    address = f"127.0.0.1:{port}"
    client = transport.connect(address, 60)
    members = list(range(REPLICAS))
    client.set("probe/members/1", json.dumps(members))
    client.set("probe/epoch", "1")
    procs = {r: subprocess.Popen([sys.executable, "-m", "bench.nccl_probe", "--rank", address, str(r), args.backend],
                                 env={**os.environ, "NCCL_HOSTID": f"probe-host-{r}"}, stdout=subprocess.PIPE, text=True)
             for r in range(REPLICAS)}
    deadline = time.time() + WAIT_S
    epoch, faults = 1, []
    for replica, _, name in FAULTS:
        while not client.check([f"probe/launched/{replica}"]):
            if time.time() > deadline:
                raise SystemExit(f"replica {replica} never reached its fault point within {WAIT_S:g}s")
            time.sleep(0.01)
        time.sleep(0.5)  # the others are in the all-reduce, waiting on it
        t = time.time()
        procs[replica].send_signal(getattr(signal, name))
        members.remove(replica)
        epoch += 1
        client.set(f"probe/members/{epoch}", json.dumps(members))
        client.set("probe/epoch", str(epoch))
        faults.append({"replica": replica, "signal": name, "t": t, "epoch": epoch, "members": list(members)})
        log.info(f"{name} to replica {replica}; epoch {epoch}: members {members}")
    codes = {r: procs[r].wait(timeout=max(1.0, deadline - time.time())) for r in members}
    for r, proc in procs.items():
        if r not in members:
            proc.kill()
            proc.wait()
    records = [json.loads(line[6:]) for proc in procs.values() for line in (proc.stdout.read() if proc.stdout else "").splitlines()
               if line.startswith("PROBE ")]
    result = {"backend": args.backend, "replicas": REPLICAS, "tensor_mib": MIB, "survivor_exit_codes": codes,
              "env": {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL_", "NCCL_"))},
              "recoveries": summarize(records, faults), "records": records}
    if args.backend == "nccl":
        import torch
        result["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                              "nccl": ".".join(map(str, torch.cuda.nccl.version())), "device": torch.cuda.get_device_name(0)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for row in result["recoveries"]:
        log.info(json.dumps(row))
    log.info(f"survivors exited {codes}; wrote {args.out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        from titan_recover import procs

        procs.leave(lambda: rank(sys.argv[2], int(sys.argv[3]), sys.argv[4]))
    main()
