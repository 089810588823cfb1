"""Fault-tolerant replicate-dimension collectives.

For group rank ``k`` the live replicas' rank ``k`` form one process group per
membership epoch, built under the store prefix ``replicate/e<epoch>/s<k>``: a rank of
an old epoch can never join a newer group. Collectives are asynchronous and polled,
so they return within a bounded time once the epoch moves on (a peer died or hung);
an abandoned group and its buffers are parked, never reused or freed mid-flight, and
released once nothing runs on them any more (gloo ends a collective with a dead peer at
its timeout), on a thread of their own, since a group's destructor joins its threads;
so memory, threads and descriptors do not grow failure after failure, and no step
waits for a teardown. Callers pass fresh buffers (out-of-place), so a broken collective
never touches local gradients. Whatever a dead peer makes a group raise, at a
collective's launch, its wait or its abort, is a ``CollectiveAborted`` of that epoch,
never this rank's own failure.

The groups are gloo, or NCCL where every rank has a GPU of its own (see
``titan_recover.node.devices``). An abandoned NCCL group is aborted (``ncclCommAbort``):
a collective whose peer died would otherwise spin on the GPU forever and wedge the
rank's later kernels. Its communicators are non-blocking, so building and aborting
never wait on a dead peer, and each is built with ``NCCL_GROUP_ENV`` (docs/gpus.md).
"""

import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Iterator, Protocol, Sequence, cast

import torch
import torch.distributed as dist

from titan_recover.config import ConfigError
from titan_recover.control.keys import REPLICATE_BACKEND, replicate_group_prefix, transfer_group_prefix
from titan_recover.control.sealed import SealedStore
from titan_recover.node import procs
from titan_recover.policy.membership import Membership

log = logging.getLogger(__name__)

POLL_S = (0.0005, 0.005)  # first and longest pause while waiting: quick for short waits, light for long ones
CLOSE_WAIT_S = 1.0  # how long a stopping rank gives its replicate-dim collectives to end
RELEASE_WAIT_S = 10.0  # ...and the releaser to destroy what ended (gloo's pair threads join; seconds on a busy host)
NCCL_NONBLOCKING_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"  # bounds a non-blocking communicator's setup
NCCL_GROUP_ENV = {
    # the watchdog sleeps 4x this after every failed Work, holding the group's work list: a survivor
    # stalled 60 s at the default, its group's destructor (which joins the watchdog) with it
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0",
    # a failed Work aborts the communicator and leaves the process alone (CleanUpOnly); TorchTitan sets 3
    # (tear the process down) for its own groups
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # this group's heartbeat monitor, if it is the process's first (a probe's), never acts on a dump signal
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    # no abort that signals a dump, no error keys written to the control plane's store
    "TORCH_NCCL_EXTRA_DUMP_ON_EXEC": "0",
    "TORCH_NCCL_PROPAGATE_ERROR": "0",
    # the watchdog, not a blocking wait(), ends a failed Work: collectives here are polled
    "TORCH_NCCL_BLOCKING_WAIT": "0",
}
"""What each replicate or transfer group's ProcessGroupNCCL reads from the environment in its constructor,
set for that constructor alone (torch 2.11, ProcessGroupNCCL.cpp: the constructor and
Watchdog::runLoop; docs/gpus.md has the lines)."""


def backoff(pause: float, longest: float = POLL_S[1]) -> float:
    """Sleeps ``pause`` and returns the next one (doubling up to ``longest``)."""
    time.sleep(pause)
    return min(2 * pause, longest)


class CollectiveAborted(RuntimeError):
    """The collective did not finish for this epoch; retry in the next one."""


class GroupBackend(Protocol):
    """A process group's backend as torch builds it (``ProcessGroupGloo``, ``ProcessGroupNCCL``): the calls
    made on it here, which torch's stub leaves off its ``Backend`` class."""

    def abort(self) -> None: ...

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...


@dataclass
class Parked:
    """What an abandoned group or collective still holds until nothing runs on it."""

    group: object = None
    works: list[dist.Work] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    builder: threading.Thread | None = None  # a rendezvous thread that may still return a group
    built: list[GroupBackend | Exception] = field(default_factory=list)  # ...into this list
    store: dist.Store | None = None  # the rendezvous's own connection, held so that its socket stays open
    socket: int | None = None  # ...and that socket's descriptor

    def busy(self) -> bool:
        return (self.builder is not None and self.builder.is_alive()) or not all(w.is_completed() for w in self.works)

    def cancel(self) -> None:
        """Ends a rendezvous still waiting on its store for a peer: its socket is shut down."""
        if self.builder is not None and self.builder.is_alive() and self.socket is not None:
            procs.shut_down(self.socket)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def release(self, backend: str) -> None:
        """Drops what this entry holds, here: a group's destructor runs in the calling thread (it releases
        the GIL while it joins the group's threads). A rendezvous that finished after we gave up on it
        handed back a group no one will use: an NCCL one is aborted first."""
        for late in self.built:
            if backend == "nccl" and not isinstance(late, Exception):
                abort_quietly(late)
        self.group, self.store, self.builder = None, None, None
        self.works.clear()
        self.tensors.clear()
        self.built.clear()


def abort_quietly(group: GroupBackend) -> None:
    """Aborts ``group``; it raises when the abort outlasts the group timeout or its communicator already
    failed, and the group is given up either way."""
    error = None
    try:
        group.abort()
    except Exception as e:  # noqa: BLE001  (torch raises DistBackendError or RuntimeError)
        error = f"{type(e).__name__}: {e}"
    if error is not None:
        log.warning(f"aborting an abandoned replicate group raised (it is given up all the same): {error}")


class Releaser:
    """A thread that releases parked entries once nothing runs on them, so that no step waits for a
    group's destructor (NCCL's joins the watchdog and heartbeat monitor; gloo's its pair threads).
    What waits for it, or is being released, still counts as parked."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._queue: list[Parked] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False

    def release(self, entries: list[Parked]) -> None:
        if not entries:
            return
        with self._lock:
            self._queue.extend(entries)
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name="replicate-releaser", daemon=True)
                self._thread.start()
            self._wake.notify()

    def pending(self) -> tuple[int, int]:
        """How many entries wait for their release or are in it, and the bytes their buffers hold."""
        with self._lock:
            return len(self._queue), sum(p.nbytes() for p in self._queue)

    def stop(self, deadline: float) -> None:
        """Releases what is queued and ends the thread, waiting until ``deadline`` (monotonic) at most."""
        with self._lock:
            thread, self._stopping = self._thread, True
            self._wake.notify()
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stopping:
                    self._wake.wait()
                if not self._queue:
                    self._thread = None
                    return
                entry = self._queue[0]
            entry.release(self.backend)
            with self._lock:
                self._queue.pop(0)


UNFREED: list[Parked] = []  # what close() could not free: referenced until the process leaves (procs.leave)


class ReplicateProcessGroups:
    """This rank's replicate-dim process groups, one per epoch."""

    def __init__(
        self,
        store: SealedStore,
        replica: int,
        group_rank: int,
        timeout_s: float,
        backend: str = "gloo",
        device: torch.device = torch.device("cpu"),
        host: str = "",
    ) -> None:
        self.store = store
        # gloo listens on ``host``, the address the other nodes reach (the host name may resolve to
        # loopback, as Debian's 127.0.1.1 does); GLOO_SOCKET_IFNAME, where set, chooses instead
        self.host = "" if os.environ.get("GLOO_SOCKET_IFNAME") else host
        self.replica = replica
        self.group_rank = group_rank  # this rank's index inside its replica group
        self.timeout = timedelta(seconds=timeout_s)
        self.backend = backend
        self.device = device if backend == "nccl" else torch.device("cpu")  # where transfer buffers live
        self._groups: dict[int, GroupBackend | None] = {}
        # the newest epoch whose group this rank gave up (none yet: epoch 0 is the run's first): its rendezvous
        # keys are spent, and a second rendezvous under them would reach the first one's peers and wait out the
        # group timeout
        self._spent = -1
        self._parked: list[Parked] = []  # abandoned groups/work/buffers: kept until idle, never reused
        self._releaser = Releaser(backend)  # ...then released off the step's path
        # a recovery's moments on this rank (wall clock, for the event log's recovery phases): when it gave up
        # a group of an ended epoch, and when it had the next epoch's; ``moments`` reads and clears them
        self.torn_down: float | None = None
        self.reformed: float | None = None
        agreed = store.compare_set(REPLICATE_BACKEND, "", backend).decode()
        if agreed != backend:
            raise ConfigError(
                f"replica {replica} runs the replicate dimension on {backend}, another replica group on {agreed}: "
                "every host must agree; set recover.replicate_backend explicitly on all of them"
            )
        if backend == "nccl":
            os.environ.setdefault(NCCL_NONBLOCKING_TIMEOUT_ENV, str(max(1, int(timeout_s))))

    def _new_group(self, store: dist.Store, rank: int, size: int) -> GroupBackend:
        if self.backend == "gloo":
            gloo = dist.ProcessGroupGloo
            opts = gloo._Options()  # type: ignore[attr-defined]  # torch's stub has Options (devices), not _Options
            opts._devices = [gloo.create_device(hostname=self.host) if self.host else gloo.create_default_device()]
            opts._timeout = self.timeout
            return cast(GroupBackend, gloo(store, rank, size, opts))
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.blocking = 0  # setup and abort return instead of waiting on a dead peer
        opts._timeout = self.timeout
        with procs.environ(NCCL_GROUP_ENV):
            group = dist.ProcessGroupNCCL(store, rank, size, opts)
        group.eager_connect_single_device(self.device)  # connect now, inside the abortable rendezvous
        return cast(GroupBackend, group)

    def _discard(
        self, group: GroupBackend | None, works: Sequence[dist.Work] = (), tensors: Sequence[torch.Tensor] = ()
    ) -> None:
        """Parks a group that will not be used again (an NCCL one is aborted first), with
        the collectives still in flight on it and their buffers."""
        if group is None and not works:
            return
        if group is not None and self.backend == "nccl" and not any(p.group is group for p in self._parked):
            abort_quietly(group)
        self._parked.append(Parked(group, list(works), list(tensors)))
        self._reap()

    def _reap(self) -> None:
        """Hands what is parked to the releaser once nothing runs on it: its collectives ended (a dead
        peer's at the group timeout) and no rendezvous thread can still hand a group back."""
        self._releaser.release([p for p in self._parked if not p.busy()])
        self._parked = [p for p in self._parked if p.busy()]

    def close(self, wait_s: float = CLOSE_WAIT_S) -> int:
        """Ends what this rank's groups still run, when the rank stops: every group is discarded (NCCL
        ones aborted), rendezvous still waiting for a peer are cut off and their threads joined, and
        collectives get ``wait_s`` to end. What still runs after that (a gloo collective waiting on a
        peer that finished or died: gloo cannot cancel it) is kept in ``UNFREED``, not destroyed, since
        its destructor would wait out the group timeout; the rank leaves without its teardown. The
        releaser gets ``RELEASE_WAIT_S`` for what ended; what it has not released by then (a destructor
        that hangs) is left to it.
        Returns how many entries were kept or left."""
        for epoch in list(self._groups):
            self._discard(self._groups.pop(epoch))
        for p in self._parked:
            p.cancel()
        deadline = time.monotonic() + wait_s
        pause = POLL_S[0]
        while any(p.busy() for p in self._parked) and time.monotonic() < deadline:
            pause = backoff(pause)
        self._reap()
        kept, self._parked = self._parked, []
        UNFREED.extend(kept)
        self._releaser.stop(time.monotonic() + RELEASE_WAIT_S)
        return len(kept) + self._releaser.pending()[0]

    def parked(self) -> dict[str, float]:
        """What abandoned collectives hold right now (for the event log's resources events)."""
        self._reap()
        releasing, nbytes = self._releaser.pending()
        nbytes += sum(p.nbytes() for p in self._parked)
        return {"entries": len(self._parked) + releasing, "mb": round(nbytes / 2**20, 1)}

    def _connect(self, prefix: str, rank: int, size: int, abort: Callable[[], bool]) -> GroupBackend:
        """A group under ``prefix``; raises CollectiveAborted if ``abort()`` first.

        The rendezvous gets a store connection of its own (``process_group_store``): its blocking
        ``get`` of a dead peer's address must not hold up this rank's other store calls, and shutting
        its socket down ends that wait (``Parked.cancel``).
        """
        before = procs.sockets()
        store = self.store.process_group_store(prefix)
        opened = procs.sockets() - before  # its socket, where the clone opened exactly one (a TCPStore's)
        fd = opened.pop()[0] if len(opened) == 1 else None
        result: list[GroupBackend | Exception] = []

        def build() -> None:
            try:
                result.append(self._new_group(store, rank, size))
            except Exception as e:  # a peer never showed up
                result.append(e.with_traceback(None))  # no frame cycle: freed without a gc pass

        # rendezvous blocks until every member connects; poll so a dead member
        # only costs us until the coordinator moves the epoch on
        thread = threading.Thread(target=build, daemon=True)
        thread.start()
        pause = POLL_S[0]
        while not result:
            if abort():
                self._parked.append(Parked(builder=thread, built=result, store=store, socket=fd))
                raise CollectiveAborted(f"{prefix} ended while building its group")
            pause = backoff(pause)
        built = result[0]
        if isinstance(built, Exception):
            raise CollectiveAborted(f"building {prefix} failed: {built}")
        return built

    def _build(self, membership: Membership, abort: Callable[[], bool]) -> GroupBackend | None:
        if membership.epoch in self._groups:
            return self._groups[membership.epoch]
        if membership.epoch <= self._spent:
            raise CollectiveAborted(
                f"epoch {membership.epoch}'s replicate group broke here, and an epoch's group is built once: "
                "wait for a newer epoch"
            )
        size = len(membership.members)
        group = None
        if size > 1:
            prefix = replicate_group_prefix(membership.epoch, self.group_rank)
            group = self._connect(prefix, membership.members.index(self.replica), size, abort)
        # older epochs' groups are done with; park them (destroying may block on dead peers)
        for epoch in [e for e in self._groups if e < membership.epoch]:
            self._give_up(self._groups.pop(epoch))
        if self.torn_down is not None and self.reformed is None:
            self.reformed = time.time()
        self._groups[membership.epoch] = group
        return group

    def _give_up(
        self, group: GroupBackend | None, works: Sequence[dist.Work] = (), tensors: Sequence[torch.Tensor] = ()
    ) -> None:
        """``_discard``, for a group whose epoch ended (a recovery's abort)."""
        if self.torn_down is None:
            self.torn_down = time.time()
        self._discard(group, works, tensors)

    def moments(self) -> tuple[float | None, float | None]:
        """When this rank gave up an ended epoch's group and formed the next one since the last call (wall clock)."""
        moments = self.torn_down, self.reformed
        self.torn_down = self.reformed = None
        return moments

    def _run(
        self,
        group: GroupBackend,
        launches: Iterator[dist.Work],
        tensors: list[torch.Tensor],
        abort: Callable[[], bool],
        what: str,
        on_launched: Callable[[], None] = lambda: None,
    ) -> None:
        """Launches a collective's pieces and waits for them. A launch that raises (NCCL does, at once,
        when its communicator has seen a peer die) gives the group up as a failed wait does."""
        works: list[dist.Work] = []
        error = None
        try:
            works.extend(launches)
        except Exception as e:  # raised below, outside this frame's reference cycle with ``e``
            error = f"{what} failed at its launch: {type(e).__name__}: {e}"
        if error is not None:
            self._give_up(group, works, tensors)
            raise CollectiveAborted(error)
        on_launched()
        self._wait(group, works, tensors, abort, what)

    def _wait(
        self,
        group: GroupBackend,
        works: list[dist.Work],
        tensors: list[torch.Tensor],
        abort: Callable[[], bool],
        what: str,
    ) -> None:
        pause = POLL_S[0]
        while not all(w.is_completed() for w in works):
            if abort():
                self._give_up(group, works, tensors)
                raise CollectiveAborted(f"{what}: the epoch ended first")
            pause = backoff(pause)
        error = None
        try:
            for w in works:
                w.wait()
        except Exception as e:  # raised below, outside this frame's reference cycle with ``e``,
            error = f"{what} failed: {e}"  # so the group and its buffers are freed without a gc pass
        if error is not None:
            self._give_up(group, works, tensors)
            raise CollectiveAborted(error)

    @contextmanager
    def pair(self, epoch: int, joiner: int, donor: bool, abort: Callable[[], bool]) -> Iterator[GroupBackend]:
        """The two-rank group (donor = rank 0) that hands ``joiner`` its state in ``epoch``; one transfer only."""
        group = self._connect(transfer_group_prefix(epoch, self.group_rank, joiner), 0 if donor else 1, 2, abort)
        try:
            yield group
        finally:
            self._discard(group)

    def broadcast(self, group: GroupBackend, tensor: torch.Tensor, abort: Callable[[], bool]) -> None:
        """Sends ``tensor`` from rank 0 of ``group`` into the others' ``tensor``, or raises CollectiveAborted."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        launches = (group.broadcast([t], opts) for t in (tensor,))
        self._run(group, launches, [tensor], abort, "state transfer")

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
        try:
            group = self._build(membership, abort)
            if group is None:
                on_launched()
                return
            launches = (group.allreduce([t]) for t in tensors)
            self._run(group, launches, tensors, abort, f"all-reduce in epoch {membership.epoch}", on_launched)
        except CollectiveAborted:
            self._groups.pop(membership.epoch, None)  # discarded; the caller moves on to a newer epoch
            self._spent = max(self._spent, membership.epoch)
            raise
