"""The replicate dimension's recovery on its own, as the self-test checks it on a node: ``REPLICAS``
single-rank replicas all-reduce step after step through titan_recover's ``ReplicateProcessGroups``
(NCCL on a GPU, gloo on CPU) while the conductor, playing the coordinator, injects ``FAULTS``.

Each fault hits a replica inside a collective (an all-reduce, or a state transfer to it from a donor);
the conductor detects it as the run would (a SIGKILLed process exits; a SIGSTOPped one stops beating),
publishes the epoch without it and, for a stopped one, SIGKILLs it as its launcher would. Every
survivor logs its steps and aborts as JSON lines; ``summarize`` gives per fault the seconds from the
fault to each recovery phase (``events.RECOVERY_PHASES``): ``detect`` (the verdict published),
``abort`` (the last survivor's collective torn down: NCCL aborted, gloo parked), ``reform`` (the last
survivor's first collective of the new epoch launched, its group built) and ``first_good_step`` (the
last survivor's first all-reduce of the new epoch summed right); and whether the survivors' memory came
back: nothing held by abandoned collectives once closed, and on a GPU no more allocated than before.

    python -m titan_recover.rank.probe --rank ADDRESS REPLICA BACKEND   (a replica; the self-test starts them)
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from titan_recover.control import keys
from titan_recover.control.sealed import Run
from titan_recover.node import devices, procs
from titan_recover.observability.events import RECOVERY_PHASES

REPLICAS = 5
STEPS = 11
# (replica, step, signal, inside which collective): each removes one replica, leaving 4, 3 and 2
FAULTS = ((4, 2, "SIGKILL", "all-reduce"), (3, 5, "SIGKILL", "state transfer"), (2, 8, "SIGSTOP", "all-reduce"))
DONOR = 0  # sends the state in the transfer fault
CHUNKS = 8  # the transfer's pieces: the joiner hangs after the first, so the donor is mid-transfer
BEAT_S = 0.05
SILENT_S = 1.0  # a replica that has not beaten for this long is declared failed
TIMEOUT_S = 60.0  # the groups' timeout, and every wait's bound
WAIT_S = 180.0  # the whole probe's bound


def tensor_elements(backend: str) -> int:
    """64 MiB of float32 on a GPU; 4 MiB on CPU (gloo on a 2-core machine)."""
    return (64 if backend == "nccl" else 4) * 2**18


def rank(address: str, replica: int, backend: str) -> None:
    """One replica: all-reduces until it is fenced out or STEPS are done; at its fault point it hangs
    inside the collective until the conductor's signal."""
    import torch

    from titan_recover.control import transport
    from titan_recover.policy.membership import Membership
    from titan_recover.rank.collectives import CollectiveAborted, ReplicateProcessGroups

    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = transport.connect(address, TIMEOUT_S)
    groups = ReplicateProcessGroups(
        store, replica=replica, group_rank=0, timeout_s=TIMEOUT_S, backend=backend, device=device, host="127.0.0.1"
    )
    doomed = {r: (s, during) for r, s, _, during in FAULTS}
    beats = transport.connect(address, TIMEOUT_S)
    threading.Thread(target=_beat, args=(beats, replica), daemon=True).start()

    def say(**record: Any) -> None:
        allocated = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None
        print(
            "PROBE " + json.dumps({"replica": replica, "t": time.time(), "allocated_mb": allocated, **record}),
            flush=True,
        )

    def hang() -> None:
        store.set(f"probe/launched/{replica}", str(time.time()))
        time.sleep(WAIT_S)  # until the conductor's signal

    step, launched_in = 0, -1
    while True:
        epoch = int(store.get("probe/epoch"))
        members = tuple(json.loads(store.get(f"probe/members/{epoch}")))
        if replica not in members or step >= STEPS:
            say(event="done", epoch=epoch, step=step, kept=groups.close())
            return
        tensor = torch.ones(tensor_elements(backend), device=device)
        moved = lambda: int(store.get("probe/epoch")) > epoch  # noqa: E731

        def launched() -> None:
            nonlocal launched_in
            if launched_in != epoch:
                launched_in = epoch
                say(event="launched", epoch=epoch, step=step)
            if doomed.get(replica) == (step, "all-reduce"):
                hang()

        start = time.time()
        try:
            groups.allreduce(Membership(epoch, members), [tensor], abort=moved, on_launched=launched)
        except CollectiveAborted as e:  # the step is done again in the next epoch, as the trainer does
            say(
                event="aborted",
                epoch=epoch,
                step=step,
                during="all-reduce",
                seconds=time.time() - start,
                error=str(e)[:300],
            )
            _wait_until(
                moved, start + WAIT_S, f"replica {replica} never saw epoch {epoch} end after its all-reduce broke"
            )
            continue
        say(event="step", epoch=epoch, step=step, members=list(members), ok=bool((tensor == len(members)).all()))
        joiner = next((r for r, (s, during) in doomed.items() if s == step and during == "state transfer"), None)
        step += 1
        if joiner is not None and joiner in members and replica in (joiner, DONOR):
            start = time.time()
            try:
                _transfer(groups, epoch, joiner, replica == DONOR, device, backend, moved, hang)
            except CollectiveAborted as e:
                say(
                    event="aborted",
                    epoch=epoch,
                    step=step,
                    during="state transfer",
                    seconds=time.time() - start,
                    error=str(e)[:300],
                )


def _beat(store: Any, replica: int) -> None:
    while True:
        store.set(f"probe/beat/{replica}", str(time.time()))
        time.sleep(BEAT_S)


def _transfer(
    groups: Any, epoch: int, joiner: int, donor: bool, device: Any, backend: str, moved: Any, hang: Any
) -> None:
    """The donor sends CHUNKS pieces of state to the joiner, which hangs after the first."""
    import torch

    with groups.pair(epoch, joiner, donor, abort=moved) as pair:
        for chunk in range(CHUNKS):
            if not donor and chunk == 1:
                hang()
            groups.broadcast(pair, torch.full((tensor_elements(backend),), float(chunk), device=device), abort=moved)


@dataclass
class Fault:
    replica: int
    signal: str
    during: str
    t: float  # sent
    verdict_t: float  # the new epoch published
    epoch: int
    members: list[int]


def conduct(backend: str, env: dict[str, str]) -> tuple[list[Fault], dict[int, int | None], list[dict]]:
    """Starts the replicas, injects FAULTS, and returns the faults, the survivors' exit codes (None:
    still running at the bound, then killed) and every replica's records."""
    from titan_recover.control import transport

    run = Run(os.urandom(16).hex(), "selftest-probe")
    port = transport.free_port()
    server = transport.serve(port, TIMEOUT_S, run=run)  # noqa: F841 (it serves while the probe runs)
    address = f"127.0.0.1:{port}"
    client = transport.connect(address, TIMEOUT_S, run=run)
    members = list(range(REPLICAS))
    client.set("probe/members/1", json.dumps(members))
    client.set("probe/epoch", "1")
    env = {**env, keys.SECRET_ENV: run.secret, keys.RUN_ENV: run.id}
    if backend == "nccl":
        env.update(devices.RANK_PER_HOST_NCCL)  # the replicas share the GPU, each posing as a host
    replicas = {
        r: subprocess.Popen(
            [sys.executable, "-m", "titan_recover.rank.probe", "--rank", address, str(r), backend],
            env={**env, "NCCL_HOSTID": f"titan-recover-probe-{r}"},
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(REPLICAS)
    }
    deadline = time.time() + WAIT_S
    faults: list[Fault] = []
    try:
        for replica, _, name, during in FAULTS:
            _wait_until(
                lambda: client.check([f"probe/launched/{replica}"]),
                deadline,
                f"replica {replica} never reached its fault point ({during})",
            )
            time.sleep(0.3)  # the others are in the collective, waiting on it
            t = time.time()
            replicas[replica].send_signal(getattr(signal, name))
            _wait_until(
                lambda: _failed(replicas[replica], client, replica),
                deadline,
                f"replica {replica}'s {name} was never detected",
            )
            members.remove(replica)
            client.set(f"probe/members/{len(faults) + 2}", json.dumps(members))
            client.set("probe/epoch", str(len(faults) + 2))
            faults.append(Fault(replica, name, during, t, time.time(), len(faults) + 2, list(members)))
            replicas[replica].kill()  # a stopped replica is killed by its launcher once fenced
            replicas[replica].wait()
        codes = {r: _exit_code(replicas[r], deadline) for r in members}
    finally:
        for proc in replicas.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    records = [
        json.loads(line[len("PROBE ") :])
        for proc in replicas.values()
        for line in (proc.stdout.read() if proc.stdout else "").splitlines()
        if line.startswith("PROBE ")
    ]
    return faults, codes, records


def _wait_until(done: Any, deadline: float, what: str) -> None:
    while not done():
        if time.time() > deadline:
            raise TimeoutError(f"{what} within {WAIT_S:g}s")
        time.sleep(0.005)


def _failed(proc: subprocess.Popen, client: Any, replica: int) -> bool:
    """Dead (its exit is seen at once), or silent for SILENT_S (stopped or hung)."""
    return proc.poll() is not None or time.time() - float(client.get(f"probe/beat/{replica}")) > SILENT_S


def _exit_code(proc: subprocess.Popen, deadline: float) -> int | None:
    try:
        return proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        return None


def summarize(faults: list[Fault], records: list[dict]) -> list[dict]:
    """Per fault: each phase's seconds from the fault (the slowest survivor's), per survivor's figures,
    and whether the memory of the survivors that ran to the end came back."""
    out = []
    finished = {rec["replica"] for rec in records if rec["event"] == "done"}
    for f in faults:
        mine = {r: [rec for rec in records if rec["replica"] == r] for r in f.members}
        survivors: list[dict[str, Any]] = []
        for r, recs in mine.items():
            aborted = next((rec for rec in recs if rec["event"] == "aborted" and rec["t"] >= f.t), None)
            launched = next((rec for rec in recs if rec["event"] == "launched" and rec["epoch"] >= f.epoch), None)
            good = next((rec for rec in recs if rec["event"] == "step" and rec["epoch"] >= f.epoch), None)
            before = [rec["allocated_mb"] for rec in recs if rec["event"] == "step" and rec["t"] < f.t]
            done = next((rec for rec in recs if rec["event"] == "done"), None)
            survivors.append(
                {
                    "replica": r,
                    "aborted_during": aborted and aborted["during"],
                    "abort": aborted and round(aborted["t"] - f.t, 3),
                    "reform": launched and round(launched["t"] - f.t, 3),
                    "first_good_step": good and round(good["t"] - f.t, 3),
                    "sum_right": bool(good and good["ok"]),
                    "allocated_mb_before": before[-1] if before else None,
                    "allocated_mb_at_end": done and done["allocated_mb"],
                    "kept_after_close": done and done["kept"],
                }
            )
        phases: dict[str, float | None] = {"detect": round(f.verdict_t - f.t, 3)}
        for phase in RECOVERY_PHASES[1:]:
            values = [s[phase] for s in survivors]
            phases[phase] = None if None in values else max(values)
        out.append(
            {
                "fault": f.signal,
                "during": f.during,
                "replica": f.replica,
                "survivors": survivors,
                "phases": phases,
                "memory_returned": all(_returned(s) for s in survivors if s["replica"] in finished),
            }
        )
    return out


def _returned(survivor: dict) -> bool:
    """Nothing left held by abandoned collectives, and on a GPU no more allocated at the end than before the fault."""
    before, end = survivor["allocated_mb_before"], survivor["allocated_mb_at_end"]
    return survivor["kept_after_close"] == 0 and (before is None or (end is not None and end <= before))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        procs.die_with_parent()
        procs.leave(lambda: rank(sys.argv[2], int(sys.argv[3]), sys.argv[4]))
    sys.exit("usage: python -m titan_recover.rank.probe --rank ADDRESS REPLICA BACKEND (the self-test starts these)")
