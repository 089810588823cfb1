"""Abandoned replicate-dim collectives are freed: memory, threads and descriptors stay flat
failure after failure (real gloo groups, a real peer process that breaks every epoch)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import time
from pathlib import Path

import torch

from titan_recover import resources
from titan_recover.control import transport
from titan_recover.collectives import CollectiveAborted, ReplicateProcessGroups
from titan_recover.membership import Membership

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
                groups.allreduce(Membership(epoch, (0, 1)), [flat, torch.ones(4)],
                                 abort=lambda: time.monotonic() > launched + 0.5)
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
