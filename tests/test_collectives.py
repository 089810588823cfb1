"""Abandoned replicate-dim collectives are freed: memory, threads and descriptors stay flat
failure after failure (real gloo groups, a real peer process that breaks every epoch)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import cast

import pytest
import torch
import torch.distributed as dist

from titan_recover.control import transport
from titan_recover.node import procs
from titan_recover.observability import resources
from titan_recover.policy.membership import Membership
from titan_recover.rank.collectives import NCCL_GROUP_ENV, CollectiveAborted, GroupBackend, ReplicateProcessGroups

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
from titan_recover.rank.collectives import NCCL_GROUP_ENV, CollectiveAborted, GroupBackend, ReplicateProcessGroups
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


class CheckedGroups(ReplicateProcessGroups):
    """Replicate groups as torch wraps them under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: each gloo group inside a
    ``ProcessGroupWrapper``, which checks every collective with its peers over a second gloo group before it
    launches it, so a launch raises at once where a peer is dead, as an NCCL launch does once its
    communicator has seen the peer die (``NCCLComm::waitReady``)."""

    def _new_group(self, store: dist.Store, rank: int, size: int) -> GroupBackend:
        from torch._C._distributed_c10d import _ProcessGroupWrapper

        checks = cast(dist.ProcessGroupGloo, super()._new_group(dist.PrefixStore("check/", store), rank, size))
        inner = cast(dist.ProcessGroupGloo, super()._new_group(store, rank, size))
        return cast(GroupBackend, _ProcessGroupWrapper(inner, checks))


# Replica 1: joins epoch 1's all-reduce group and a state transfer pair once each, then dies (SIGKILL).
DYING_PEER = """
import os, signal, sys
import torch
sys.path.insert(0, sys.argv[2])
from test_collectives import CheckedGroups
from titan_recover.control import transport
from titan_recover.policy.membership import Membership
groups = CheckedGroups(transport.connect(sys.argv[1], 30), replica=1, group_rank=0, timeout_s=30, host="127.0.0.1")
groups.allreduce(Membership(1, (0, 1)), [torch.ones(4)], abort=lambda: False)
with groups.pair(1, joiner=1, donor=False, abort=lambda: False) as pair:
    groups.broadcast(pair, torch.zeros(4), abort=lambda: False)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_launch_that_raises_because_a_peer_died_is_an_aborted_collective_not_the_ranks_failure() -> None:
    """Real gloo groups whose peer was SIGKILLed before the launch: the all-reduce and the state transfer
    each end as a ``CollectiveAborted`` of their epoch at once, the broken group is given up (nothing left
    parked), the broken epoch's group is not built again, and the next epoch's all-reduce runs."""
    port = transport.free_port()
    server = transport.serve(port, 30)
    address = f"127.0.0.1:{port}"
    groups = CheckedGroups(transport.connect(address, 30), replica=0, group_rank=0, timeout_s=30, host="127.0.0.1")
    peer = subprocess.Popen([sys.executable, "-c", DYING_PEER, address, str(ROOT / "tests")], cwd=ROOT)
    try:
        both = Membership(1, (0, 1))
        total = torch.ones(4)
        groups.allreduce(both, [total], abort=lambda: False)
        assert total.tolist() == [2.0] * 4
        with groups.pair(1, joiner=1, donor=True, abort=lambda: False) as pair:
            groups.broadcast(pair, torch.full((4,), 7.0), abort=lambda: False)
            assert peer.wait(timeout=30) == -signal.SIGKILL
            start = time.monotonic()
            with pytest.raises(CollectiveAborted, match="state transfer failed at its launch: RuntimeError"):
                groups.broadcast(pair, torch.ones(4), abort=lambda: False)
        with pytest.raises(CollectiveAborted, match="all-reduce in epoch 1 failed at its launch: RuntimeError"):
            groups.allreduce(both, [torch.ones(4)], abort=lambda: False)
        with pytest.raises(CollectiveAborted, match="epoch 1's replicate group broke here"):  # its keys are spent:
            groups.allreduce(both, [torch.ones(4)], abort=lambda: False)  # no second rendezvous under them
        elapsed = time.monotonic() - start
        alone = torch.ones(4)
        groups.allreduce(Membership(2, (0,)), [alone], abort=lambda: False)  # the next epoch goes on
        deadline = time.monotonic() + 10
        while groups.parked()["entries"] and time.monotonic() < deadline:
            time.sleep(0.05)
        left = groups.parked()
        kept = groups.close()
    finally:
        peer.kill()
        peer.wait()
        del server
    print(f"both launches refused within {elapsed:.3f}s; parked after: {left}; kept at close: {kept}")
    assert elapsed < 5, elapsed  # at the launch, not at the 30 s group timeout
    assert alone.tolist() == [1.0] * 4
    assert left == {"entries": 0, "mb": 0.0} and kept == 0, (left, kept)


@pytest.mark.unit
def test_each_nccl_group_is_built_with_settings_that_let_a_survivor_abort_and_go_on() -> None:
    """What torch 2.11's ProcessGroupNCCL reads in its constructor (docs/gpus.md): no 4 x 15 s sleep in the
    watchdog after a failed Work, abort the communicator and keep the process, no dump signal acted on."""
    assert NCCL_GROUP_ENV["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] == "0"
    assert NCCL_GROUP_ENV["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert NCCL_GROUP_ENV["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


@pytest.mark.unit
def test_settings_for_one_constructor_are_set_only_while_it_runs_and_one_thread_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # as TorchTitan leaves it for its own groups
    monkeypatch.delenv("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", raising=False)
    seen: list[tuple[str | None, str | None]] = []
    inside = threading.Event()

    def other_thread() -> None:
        inside.wait()
        with procs.environ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}):  # waits for the first block to end
            seen.append((os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), "other"))

    thread = threading.Thread(target=other_thread)
    thread.start()
    with pytest.raises(ValueError):
        with procs.environ(NCCL_GROUP_ENV):
            inside.set()
            time.sleep(0.1)  # the other thread is now waiting for its turn
            seen.append(
                (os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"], os.environ["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"])
            )
            raise ValueError("a constructor that raised")
    thread.join(5)
    assert seen == [("2", "0"), ("0", "other")], seen
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC" not in os.environ
