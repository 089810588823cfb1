"""Fault-tolerant replicate-dimension collectives.

For shard index ``k`` the live replicas' rank ``k`` form one gloo process group per
membership epoch, built under the store prefix ``replicate/e<epoch>/s<k>``: a rank of
an old epoch can never join a newer group. Collectives are asynchronous and polled,
so they return within a bounded time once the epoch moves on (a peer died or hung);
an abandoned group and its buffers are parked, never reused or freed mid-flight.
Callers pass fresh buffers (out-of-place), so a broken collective never touches
local gradients.
"""

import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from titan_recover.membership import Membership

POLL_S = (0.0005, 0.005)  # first and longest pause while waiting: quick for short waits, light for long ones


def backoff(pause: float) -> float:
    """Sleeps ``pause`` and returns the next one (doubling up to the longest)."""
    time.sleep(pause)
    return min(2 * pause, POLL_S[1])


class CollectiveAborted(RuntimeError):
    """The collective did not finish for this epoch; retry in the next one."""


class ReplicateGroups:
    """This rank's replicate-dim process groups, one per epoch."""

    def __init__(self, store: dist.Store, replica: int, shard: int, timeout_s: float) -> None:
        self.store = store
        self.replica = replica
        self.shard = shard
        self.timeout = timedelta(seconds=timeout_s)
        self._groups: dict[int, dist.ProcessGroupGloo | None] = {}
        self._parked: list[object] = []  # abandoned groups/work/buffers: kept alive, never reused

    def _connect(self, prefix: str, rank: int, size: int, abort: Callable[[], bool]) -> dist.ProcessGroupGloo:
        """A gloo group under ``prefix``; raises CollectiveAborted if ``abort()`` first.

        The rendezvous gets a store connection of its own (``clone``): its blocking
        ``get`` of a dead peer's address must not hold up this rank's other store calls.
        """
        store = dist.PrefixStore(prefix, self.store.clone())
        result: list[object] = []

        def build() -> None:
            try:
                result.append(dist.ProcessGroupGloo(store, rank, size, self.timeout))
            except Exception as e:  # a peer never showed up
                result.append(e)

        # rendezvous blocks until every member connects; poll so a dead member
        # only costs us until the coordinator moves the epoch on
        thread = threading.Thread(target=build, daemon=True)
        thread.start()
        pause = POLL_S[0]
        while not result:
            if abort():
                self._parked.append(thread)
                raise CollectiveAborted(f"{prefix} ended while building its group")
            pause = backoff(pause)
        if isinstance(result[0], Exception):
            raise CollectiveAborted(f"building {prefix} failed: {result[0]}")
        return result[0]  # type: ignore[return-value]

    def _build(self, membership: Membership, abort: Callable[[], bool]) -> dist.ProcessGroupGloo | None:
        if membership.epoch in self._groups:
            return self._groups[membership.epoch]
        size = len(membership.members)
        group = None
        if size > 1:
            prefix = f"replicate/e{membership.epoch}/s{self.shard}/"
            group = self._connect(prefix, membership.members.index(self.replica), size, abort)
        # older epochs' groups are done with; park them (destroying may block on dead peers)
        for epoch in [e for e in self._groups if e < membership.epoch]:
            self._parked.append(self._groups.pop(epoch))
        self._groups[membership.epoch] = group
        return group

    def _wait(self, works: list[dist.Work], tensors: list[torch.Tensor], abort: Callable[[], bool], what: str) -> None:
        pause = POLL_S[0]
        while not all(w.is_completed() for w in works):
            if abort():
                self._parked.append((works, tensors))
                raise CollectiveAborted(f"{what}: the epoch ended first")
            pause = backoff(pause)
        try:
            for w in works:
                w.wait()
        except Exception as e:
            self._parked.append((works, tensors))
            raise CollectiveAborted(f"{what} failed: {e}") from e

    def pair(self, epoch: int, joiner: int, donor: bool, abort: Callable[[], bool]) -> dist.ProcessGroupGloo:
        """The two-rank group (donor = rank 0) that hands ``joiner`` its state in ``epoch``."""
        group = self._connect(f"transfer/e{epoch}/s{self.shard}/r{joiner}/", 0 if donor else 1, 2, abort)
        self._parked.append(group)  # one transfer only
        return group

    def broadcast(self, group: dist.ProcessGroupGloo, tensor: torch.Tensor, abort: Callable[[], bool]) -> None:
        """Sends ``tensor`` from rank 0 of ``group`` into the others' ``tensor``, or raises CollectiveAborted."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait([group.broadcast([tensor], opts)], [tensor], abort, "state transfer")

    def allreduce(
        self,
        membership: Membership,
        tensors: list[torch.Tensor],
        abort: Callable[[], bool],
        on_launched: Callable[[], None] = lambda: None,
    ) -> None:
        """Sums ``tensors`` in place across the epoch's members, or raises CollectiveAborted.

        ``on_launched`` runs once the all-reduce is in flight (a fault injection point).
        """
        group = self._build(membership, abort)
        if group is None:
            on_launched()
            return
        works = [group.allreduce([t]) for t in tensors]
        on_launched()
        self._wait(works, tensors, abort, f"all-reduce in epoch {membership.epoch}")
