"""Abandoned replicate-dim collectives are freed: memory, threads and descriptors stay flat
failure after failure (real gloo groups, a real peer process that breaks every epoch)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from titan_recover.control import transport
from titan_recover.observability import resources
from titan_recover.policy.membership import Membership
from titan_recover.rank.collectives import CollectiveAborted, ReplicateProcessGroups

ROOT = Path(__file__).resolve().parents[1]
FAILURES = 10
LIBC = ctypes.CDLL(None)

# The peer: replica 1 of every epoch's group. It joins the group and never takes part in the
# all-reduce (hung, or alive but a step behind), and keeps its end open (one store connection for
# all its groups, so the server's descriptors here are the survivor's alone): the survivor gives up
# when the epoch moves on, and its all-reduce ends at the group timeout.
PEER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from titan_recover.control import transport
client = transport.connect(sys.argv[1], 30)
kept = []
for epoch in range(1, int(sys.argv[2]) + 1):
    kept.append(dist.ProcessGroupGloo(dist.PrefixStore(f"replicate/e{epoch}/s0/", client), 1, 2, timedelta(seconds=2)))
time.sleep(600)
"""


def test_a_survivor_holds_no_more_after_ten_broken_epochs() -> None:
    port = transport.free_port()
    server = transport.serve(port, 30)
    address = f"127.0.0.1:{port}"
    groups = ReplicateProcessGroups(transport.connect(address, 30), replica=0, group_rank=0, timeout_s=2)
    peer = subprocess.Popen([sys.executable, "-c", PEER, address, str(FAILURES + 2)], cwd=ROOT)
    try:

        def broken_epoch(epoch: int) -> None:
            flat = torch.ones(2 << 20)  # 8 MiB, like a flattened gradient: kept forever, it would show
            launched = time.monotonic()
            try:
                groups.allreduce(
                    Membership(epoch, (0, 1)), [flat, torch.ones(4)], abort=lambda: time.monotonic() > launched + 0.5
                )
            except CollectiveAborted:
                return
            raise AssertionError(f"epoch {epoch}: the all-reduce should have broken")

        def drained() -> dict[str, float]:
            deadline = time.monotonic() + 10  # gloo ends a hung peer's collective at the 2 s timeout
            while groups.parked()["entries"] and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.2)  # gloo's threads exit after the group is dropped
            LIBC.malloc_trim(0)  # freed heap pages back to the OS: RSS shows what is held, not what malloc keeps
            return {**resources.usage(), **groups.parked()}

        for epoch in (1, 2):  # warm-up: allocator and first-group costs
            broken_epoch(epoch)
        before = drained()
        for epoch in range(3, FAILURES + 3):
            broken_epoch(epoch)
        after = drained()
    finally:
        peer.kill()
        peer.wait()
        del server
    assert after["entries"] == 0 and after["mb"] == 0, after
    assert after["threads"] <= before["threads"] + 2, (before, after)  # was +3 per failure
    assert after["fds"] <= before["fds"] + 4, (before, after)  # was +4 per failure (a store clone each, both ends here)
    assert after["rss_mb"] <= before["rss_mb"] + 40, (before, after)  # 10 kept buffers would be +80 MiB


# A rank of replica 0 at the end of its run: an all-reduce still waits on a live peer that no longer takes
# part (epoch 1), and with ``rendezvous`` a group's rendezvous waits for a peer that never comes (epoch 2).
# It then stops as RecoverTrainer does (close, then procs.leave). Before, its teardown waited out the
# group timeout (destroying a gloo group with a pending collective blocks until the collective times
# out: 59.7 s of 60 measured) and left the rendezvous thread blocked in C++, where the end of its wait
# during the teardown aborts the process ("terminate called without an active exception", SIGABRT):
# the exit-time wait of a survivor after the last step.
STOPPING_RANK = """
import sys, threading, time
import torch
from titan_recover.node import procs
from titan_recover.rank.collectives import CollectiveAborted, ReplicateProcessGroups
from titan_recover.control import transport
from titan_recover.policy.membership import Membership

def main():
    groups = ReplicateProcessGroups(transport.connect(sys.argv[1], 30), replica=0, group_rank=0, timeout_s=60)
    # each ends 1 s after its all-reduce is launched or its rendezvous begins
    for epoch in range(1, int(sys.argv[2]) + 1):
        launched = [time.monotonic() + (60 if epoch == 1 else 0)]
        try:
            groups.allreduce(Membership(epoch, (0, 1)), [torch.ones(1 << 16)],
                             abort=lambda: time.monotonic() > launched[0] + 1,
                             on_launched=lambda: launched.__setitem__(0, time.monotonic()))
        except CollectiveAborted as e:
            print(f"epoch {epoch}: {e}", flush=True)
    print("parked", groups.parked()["entries"], flush=True)
    kept = groups.close()
    print("kept", kept, "threads", sorted(t.name for t in threading.enumerate()), flush=True)
    print("left at", time.time(), flush=True)

procs.leave(main)
"""

# Replica 1: it joins epoch 1's group, then neither all-reduces nor ends (hung, or still in its own step).
HUNG_PEER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from titan_recover.control import keys, transport
store = transport.connect(sys.argv[1], 30).process_group_store(keys.replicate_group_prefix(1, 0))
group = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=60))
time.sleep(600)
"""


@pytest.mark.parametrize("rendezvous", [False, True], ids=["collective", "collective-and-rendezvous"])
def test_a_stopping_rank_leaves_at_once_while_its_peers_wait_no_more(rendezvous: bool) -> None:
    port = transport.free_port()
    server = transport.serve(port, 30)  # the coordinator outlives the rank, as in a run
    address = f"127.0.0.1:{port}"
    peer = subprocess.Popen([sys.executable, "-c", HUNG_PEER, address], cwd=ROOT)
    try:
        rank = subprocess.run(
            [sys.executable, "-c", STOPPING_RANK, address, "2" if rendezvous else "1"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        exited = time.time()
    finally:
        peer.kill()
        peer.wait()
        del server
    out = rank.stdout + rank.stderr
    assert rank.returncode == 0, out
    assert "epoch 1: all-reduce in epoch 1: the epoch ended first" in out, out
    if rendezvous:
        assert "epoch 2: pg/replicate/e2/s0/ ended while building its group" in out, out
    assert f"parked {1 + rendezvous}" in out, out  # the pending all-reduce (and the waiting rendezvous)
    kept = next(line for line in out.splitlines() if line.startswith("kept"))
    assert kept.startswith("kept 1 threads ['MainThread']"), out  # any rendezvous ended, its thread joined
    left = float(next(line for line in out.splitlines() if line.startswith("left at")).split()[-1])
    assert exited - left < 10, out  # not the 60 s group timeout
    for sign in ("Traceback", "terminate called", "Fatal Python error"):
        assert sign not in out, out
