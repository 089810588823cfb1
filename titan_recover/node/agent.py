"""A node's agent: the launcher's side of the control plane, once per node instead of once per rank.

- **Liveness per node.** The ranks of each local replica group beat into a shared-memory
  channel (``node.channel``); the agent folds them into one node message, written by its
  lifeline thread every ``heartbeat_interval_s`` under its launcher key: per group its
  incarnation, how many local ranks have beaten, are ready to join or have finished, how
  long the most silent one has been silent, and a rank whose main loop is stuck. The
  coordinator reads every node's message in one ``multi_get``: its work grows with nodes.
- **Hangs found on the node.** A rank silent for ``hang_timeout_s`` (the run's
  ``heartbeat_timeout_s``) is reported by its agent at once, like a process exit: its
  detection costs the timeout plus one lifeline interval whatever the number of nodes,
  instead of waiting for the coordinator's pass over every node message (the silence in
  the message stays the backstop, and what finds a whole node gone).
- **Snapshot memory.** The message carries the bytes of the launcher's host-memory snapshot folder
  (``node.memory``), summed from the files' sizes at most once per ``SNAPSHOT_MEASURE_S``: the
  coordinator reports each node's figure and its peak (``observability.host_memory``).
- **Epochs pushed.** One thread per node blocks on the store until the next epoch's
  members are published (``TCPStore.wait``: the server answers when the key is set) and
  writes the epoch into every local channel, where ranks read it from memory.
"""

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from titan_recover.control.client import ControlClient
from titan_recover.control.protocol import MessageError, NodeGroup, NodeMessage, Report, Stuck
from titan_recover.control.sealed import Run
from titan_recover.control.transport import connect
from titan_recover.node import memory
from titan_recover.node.channel import (
    BEAT,
    DONE,
    FATAL,
    FINISHED,
    LEAVE,
    PID,
    READY,
    RUNNING,
    STARTING,
    STATE,
    STEP,
    STUCK,
    Channel,
)

SNAPSHOT_MEASURE_S = 2.0  # the snapshot folder's size is measured at most this often (a walk of its few files)
EPOCH_WAIT_S = 24 * 3600.0  # one wait per epoch; a lost coordinator is the lifeline's to find, within its bound


@dataclass
class SlotWatch:
    """When each local rank of one incarnation last beat, as this agent saw it."""

    beats: np.ndarray
    changed: np.ndarray
    most_silent: int = 0  # the live local rank that beat longest ago, at the last entry

    @staticmethod
    def new(slots: int, now: float) -> "SlotWatch":
        return SlotWatch(np.zeros(slots, dtype=np.int64), np.full(slots, now))

    def entry(self, incarnation: int, slots: np.ndarray, now: float) -> NodeGroup:
        """This incarnation's part of the node message, from its slots (rows of beat, state, pid, step)."""
        beat, state = slots[:, BEAT], slots[:, STATE]
        moved = beat != self.beats
        self.changed[moved] = now
        self.beats = beat.copy()
        finished = state == FINISHED
        live = (beat > 0) & ~finished
        if live.any():
            self.most_silent = int(np.flatnonzero(live)[np.argmin(self.changed[live])])
        stuck = np.flatnonzero(state == STUCK)
        return NodeGroup(
            attempt=incarnation,
            ranks=int(((beat > 0) | finished).sum()),
            ready=int((state == READY).sum()),
            finished=int(finished.sum()),
            silent_s=round(float((now - self.changed[live]).max()), 3) if live.any() else 0.0,
            stuck=Stuck(int(stuck[0]), int(slots[stuck[0], STEP])) if len(stuck) else None,
        )


@dataclass
class NodeAgent:
    """The channels of this node's replica groups, the node message and the epoch push."""

    address: str
    run: Run
    slots: int  # local ranks per group
    channels: dict[int, Channel] = field(default_factory=dict)  # replica -> its current incarnation's channel
    incarnations: dict[int, int] = field(default_factory=dict)
    watches: dict[int, SlotWatch] = field(default_factory=dict)
    hang_timeout_s: float = 0.0  # > 0: report a rank silent this long (0: leave it to the coordinator)
    epoch: int = -1
    flags: int = 0  # the run's, from the store (FATAL, DONE)
    notices: dict[int, float] = field(default_factory=dict)  # group -> when it was told to leave (wall clock)
    seq: int = 0
    snapshots: str = ""  # the launcher's snapshot folder ("": snapshots off)
    _snapshot_bytes: int | None = None  # its size as last measured
    _measured_at: float = -SNAPSHOT_MEASURE_S  # when (monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _waiter: threading.Thread | None = None
    _hangs: list[Report] = field(default_factory=list)  # reports for the launcher to send
    _hung: set[tuple[int, int]] = field(default_factory=set)  # (replica, incarnation) already reported

    def open(self, replica: int, incarnation: int) -> str:
        """A fresh channel for this incarnation of ``replica``; its path, for the ranks' environment.
        The previous incarnation's file is unlinked: its leftovers cannot pass for the new one."""
        channel = Channel.create(replica, incarnation, self.slots)
        with self._lock:
            old = self.channels.get(replica)
            channel.publish(self.epoch, self._channel_flags(replica), self.notices.get(replica))
            self.channels[replica], self.incarnations[replica] = channel, incarnation
            self.watches[replica] = SlotWatch.new(self.slots, time.monotonic())
        if old is not None:
            old.remove()
        return channel.path

    def pids(self, replica: int, incarnation: int) -> dict[int, int]:
        """Local rank -> pid, as the ranks of that incarnation wrote them into their slots
        (none if it is not the current one)."""
        with self._lock:
            if self.incarnations.get(replica) != incarnation or replica not in self.channels:
                return {}
            slots = self.channels[replica].read_slots()
        return {k: int(p) for k, p in enumerate(slots[:, PID]) if p > 0}

    def training(self, replica: int) -> bool:
        """Every rank of the current incarnation of ``replica`` trains: admitted (RUNNING), or in the
        first incarnation (whose ranks stay STARTING) past its first step."""
        with self._lock:
            if replica not in self.channels:
                return False
            slots = self.channels[replica].read_slots()
        state, step = slots[:, STATE], slots[:, STEP]
        return bool(((state == RUNNING) | ((state == STARTING) & (step > 0))).all())

    def finished(self, replica: int) -> bool:
        """Every rank of the current incarnation of ``replica`` finished in order (the run's end, or a
        leave at a step boundary): none died in a step."""
        with self._lock:
            if replica not in self.channels:
                return False
            states = self.channels[replica].read_slots()[:, STATE]
        return bool((states == FINISHED).all())

    def never_admitted(self, replica: int) -> bool:
        """The current incarnation of ``replica`` is a restart none of whose ranks was ever admitted:
        it holds nothing the run needs (a first incarnation's ranks stay STARTING until they finish)."""
        with self._lock:
            if self.incarnations.get(replica, 0) == 0 or replica not in self.channels:
                return False
            states = self.channels[replica].read_slots()[:, STATE]
        return not np.isin(states, (RUNNING, STUCK, FINISHED)).any()

    def message(self) -> NodeMessage:
        """The node message: an entry for every local group, written by the lifeline thread."""
        now = time.monotonic()
        with self._lock:
            self.seq += 1
            for channel in self.channels.values():
                channel.tick()  # the ranks watch this move
            groups = {
                r: self.watches[r].entry(self.incarnations[r], channel.read_slots(), now)
                for r, channel in self.channels.items()
            }
            for r, entry in groups.items():
                self._check_hang(r, entry.silent_s)
            seq = self.seq
        return NodeMessage(seq, groups, self._measure_snapshots(now))

    def _measure_snapshots(self, now: float) -> int | None:
        """The snapshot folder's bytes, measured again once ``SNAPSHOT_MEASURE_S`` passed (sizes only, no
        contents read); None with snapshots off. Outside the lock: the epoch push never waits for the walk."""
        if not self.snapshots:
            return None
        if now - self._measured_at >= SNAPSHOT_MEASURE_S or self._snapshot_bytes is None:
            self._snapshot_bytes, self._measured_at = memory.folder_bytes(self.snapshots), now
        return self._snapshot_bytes

    def _check_hang(self, replica: int, silent_s: float) -> None:
        """Queues one report per incarnation whose most silent live rank passed ``hang_timeout_s``."""
        hung = (replica, self.incarnations[replica])
        if self.hang_timeout_s <= 0 or silent_s <= self.hang_timeout_s or hung in self._hung:
            return
        self._hung.add(hung)
        rank, incarnation = self.watches[replica].most_silent, hung[1]
        cause = (
            f"heartbeat silent for {silent_s:.2f}s (local rank {rank} of attempt {incarnation}, seen by its node agent)"
        )
        self._hangs.append(
            Report(epoch=max(self.epoch, 0), cause=cause, replica=replica, suspect=replica, attempt=incarnation)
        )

    def take_hangs(self) -> list[Report]:
        """The hang reports queued since the last call (the launcher writes them to the store)."""
        with self._lock:
            hangs, self._hangs = self._hangs, []
        return hangs

    def _channel_flags(self, replica: int) -> int:
        return self.flags | (LEAVE if replica in self.notices else 0)

    def _publish(self, epoch: int, flags: int) -> None:
        with self._lock:
            self.epoch, self.flags = epoch, flags
            for replica, channel in self.channels.items():
                channel.publish(epoch, self._channel_flags(replica))

    def leave(self, noticed: float, replicas: list[int]) -> None:
        """Tells the ranks of these local groups to leave (their node goes away, or the operator drains them;
        told at ``noticed``, wall clock): each leaves at its next step boundary (``ReplicaManager.start_step``)."""
        with self._lock:
            for replica in replicas:
                self.notices.setdefault(replica, noticed)
                if replica in self.channels:
                    self.channels[replica].publish(self.epoch, self._channel_flags(replica), self.notices[replica])

    def start(self, on_error: Callable[[str], None]) -> None:
        """Starts pushing epochs into the channels (a daemon thread with its own store client)."""
        self._waiter = threading.Thread(
            target=self._push_epochs, args=(on_error,), name="titan-recover-epochs", daemon=True
        )
        self._waiter.start()

    def _push_epochs(self, on_error: Callable[[str], None]) -> None:
        client: ControlClient | None = None
        while not self.flags:
            try:
                if client is None:
                    client = ControlClient(connect(self.address, 60.0, self.run))
                epoch = client.epoch()
                flags = (FATAL if client.stopped() else 0) | (DONE if client.finished() else 0)
                self._publish(epoch, flags)
                if not flags:
                    client.wait_epoch_after(epoch, EPOCH_WAIT_S)
            except MessageError as e:
                on_error(f"malformed epoch in the coordinator's store: {e}")
                time.sleep(1.0)
            except Exception:  # a reset or a timeout: a fresh connection (the lifeline bounds a lost coordinator)
                client = None
                time.sleep(0.1)

    def close(self) -> None:
        """Unlinks every channel file (ranks still running keep their mappings)."""
        with self._lock:
            for channel in self.channels.values():
                channel.remove()
