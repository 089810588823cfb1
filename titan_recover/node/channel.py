"""The local channel between a node's agent (its launcher) and the ranks of one replica group.

A rank never polls the coordinator's store for liveness or epochs: at thousands of ranks
those polls, not failures, would set recovery time. Instead each incarnation of a group gets
a small shared-memory file on its node (``$TITAN_RECOVER_CHANNEL``), a fixed array of int64:

    header: magic, epoch, flags (fatal, done, leave), agent beat, the node's notice (wall-clock ms)
    one slot per local rank (``LOCAL_RANK``): beat, state, pid, step

The agent pushes the epoch (it waits on the store, one wait per node) and bumps its beat;
each rank's ``RankBeat`` thread bumps its slot while its main loop makes progress. Reads
and writes are aligned 8-byte stores: no lock, no syscall, nothing from the network.
"""

import logging
import mmap
import os
import re
import secrets
import tempfile
import threading
import time
from typing import Callable

import numpy as np

from titan_recover.node.procs import pid_alive

CHANNEL_ENV = "TITAN_RECOVER_CHANNEL"  # path of this incarnation's channel file
MAGIC = 0x7469_7461_6E72_6563  # "titanrec": a file that is not a channel is refused
HEADER, SLOT = 8, 4  # int64 words
log = logging.getLogger(__name__)

EPOCH, FLAGS, AGENT_BEAT, NOTICE_MS = 1, 2, 3, 4
FATAL, DONE, LEAVE = 1, 2, 4  # flag bits: the run failed / finished / this node was told it goes away
BEAT, STATE, PID, STEP = 0, 1, 2, 3  # slot words

# a rank's state, as its slot says
STARTING, READY, RUNNING, STUCK, FINISHED = 0, 1, 2, 3, 4


class ChannelError(RuntimeError):
    """The channel file is missing, too small or not a titan_recover channel."""


def shm_dir() -> str:
    """Where channel files live: tmpfs when the host has it (no disk writes per beat)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


CHANNEL_FILE = re.compile(
    r"titan_recover-(\d+)-r\d+-(?:a\d+|warm)-[0-9a-f]+(?:\.partial|\.ready\d+)?"
)  # titan_recover-<agent pid>-r<replica>-a<incarnation>-<random>, and a warm incarnation's activation (node.warm)


def remove_orphans(directory: str | None = None) -> list[str]:
    """Removes the channel files of agents that are gone (a SIGKILLed launcher cannot remove its
    own): over a long run with replaced launchers they would pile up in ``/dev/shm``. The files removed."""
    directory = directory or shm_dir()
    removed = []
    for name in os.listdir(directory):
        match = CHANNEL_FILE.fullmatch(name)
        if match is None or pid_alive(int(match.group(1))):
            continue
        try:
            os.remove(os.path.join(directory, name))
            removed.append(name)
        except OSError:  # another user's, or removed meanwhile
            continue
    return removed


class Channel:
    """A mapped channel file; ``create`` (the agent) or ``open`` (a rank)."""

    def __init__(self, path: str, words: np.ndarray, mm: mmap.mmap) -> None:
        self.path, self.words, self._mm = path, words, mm
        self.slots = (len(words) - HEADER) // SLOT

    @staticmethod
    def create(replica: int, incarnation: int, slots: int, directory: str | None = None) -> "Channel":
        path = os.path.join(
            directory or shm_dir(), f"titan_recover-{os.getpid()}-r{replica}-a{incarnation}-{secrets.token_hex(4)}"
        )
        size = 8 * (HEADER + SLOT * slots)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        words = np.frombuffer(mm, dtype=np.int64)
        words[EPOCH] = -1  # not known yet
        words[0] = MAGIC
        return Channel(path, words, mm)

    @staticmethod
    def open(path: str) -> "Channel":
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise ChannelError(
                f"{CHANNEL_ENV}={path!r}: cannot open the node channel ({e}); start ranks with run_train.sh"
            ) from e
        try:
            size = os.fstat(fd).st_size
            if size < 8 * (HEADER + SLOT) or size % 8:
                raise ChannelError(f"{CHANNEL_ENV}={path!r}: {size} bytes is not a node channel")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        words = np.frombuffer(mm, dtype=np.int64)
        if int(words[0]) != MAGIC:
            raise ChannelError(f"{CHANNEL_ENV}={path!r} is not a titan_recover node channel")
        return Channel(path, words, mm)

    # ---- agent side -------------------------------------------------------------------

    def publish(self, epoch: int, flags: int, notice: float | None = None) -> None:
        if notice is not None:  # before the flags: a rank that sees LEAVE sees when the notice came
            self.words[NOTICE_MS] = round(notice * 1000)
        self.words[FLAGS] = flags  # before the epoch: a rank that sees the epoch sees the flags
        self.words[EPOCH] = epoch

    def tick(self) -> None:
        self.words[AGENT_BEAT] += 1

    def read_slots(self) -> np.ndarray:
        """A copy of every slot: rows of (beat, state, pid, step)."""
        return self.words[HEADER:].reshape(self.slots, SLOT).copy()

    def remove(self) -> None:
        """Unlinks the file: a leftover rank of this incarnation keeps its mapping, nobody new opens it."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # ---- rank side --------------------------------------------------------------------

    def epoch(self) -> int:
        return int(self.words[EPOCH])

    def flags(self) -> int:
        return int(self.words[FLAGS])

    def agent_beat(self) -> int:
        return int(self.words[AGENT_BEAT])

    def notice(self) -> float:
        """When the node's agent heard that the node goes away (wall clock; 0.0: no notice)."""
        return int(self.words[NOTICE_MS]) / 1000

    def _slot(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise ChannelError(f"local rank {slot} has no slot in {self.path} ({self.slots} slots)")
        return HEADER + SLOT * slot

    def beat(self, slot: int) -> None:
        self.words[self._slot(slot) + BEAT] += 1

    def set_step(self, slot: int, step: int) -> None:
        """The step the rank works on: the agent names it when it reports the rank stuck."""
        self.words[self._slot(slot) + STEP] = step

    def set_state(self, slot: int, state: int) -> None:
        base = self._slot(slot)
        self.words[base + PID] = os.getpid()
        self.words[base + STATE] = state


class RankBeat:
    """A rank's liveness, told to its node agent through the channel by a daemon thread.

    - Beats its slot every ``interval_s``, but only while the main loop shows progress
      (``tick``) within ``progress_timeout_s``: a rank whose main thread is stuck marks its
      slot STUCK and stops beating, so its group is fenced instead of holding every retry up.
      A SIGSTOPped rank beats no more either; a slow one, whose thread runs, keeps beating.
    - Watches the agent: if its beat stops for ``agent_timeout_s`` (a frozen launcher cannot
      kill or restart anything), ``on_lost(reason)`` runs.

    The first beat is the constructor's, in the main thread: a slot that never beat counts as a
    rank still starting (its agent measures no silence, the coordinator waits ``startup_timeout_s``),
    and a rank can train its first steps before the thread's first beat, one interval later or more
    under load, then hang there unseen.
    """

    def __init__(
        self,
        channel: Channel,
        slot: int,
        interval_s: float,
        progress_timeout_s: float,
        agent_timeout_s: float,
        on_lost: Callable[[str], None],
    ) -> None:
        self.channel, self.slot = channel, slot
        self._interval, self._progress_timeout, self._agent_timeout = interval_s, progress_timeout_s, agent_timeout_s
        self._on_lost = on_lost
        self._tick = (time.monotonic(), "start")
        self._stop = threading.Event()
        channel.beat(slot)  # an out-of-range slot fails here, in the main thread
        self._thread = threading.Thread(target=self._run, name="titan-recover-beat", daemon=True)
        self._thread.start()

    def tick(self, where: str) -> None:
        """Called by the main loop whenever it makes progress; ``where`` names the place."""
        self._tick = (time.monotonic(), where)

    def idle(self) -> tuple[float, str]:
        """Seconds since the main loop's last progress, and where that was."""
        return time.monotonic() - self._tick[0], self._tick[1]

    def _run(self) -> None:
        agent = (self.channel.agent_beat(), time.monotonic())
        while not self._stop.wait(self._interval):
            now = time.monotonic()
            if self.idle()[0] < self._progress_timeout:
                self.channel.beat(self.slot)
            elif self.channel.words[self.channel._slot(self.slot) + STATE] != STUCK:
                idle, where = self.idle()
                log.warning(
                    f"local rank {self.slot}: the main loop made no progress for {idle:.0f}s "
                    f"(last: {where}); it stops beating and its node agent reports it"
                )
                self.channel.set_state(self.slot, STUCK)
            beat = self.channel.agent_beat()
            if beat != agent[0]:
                agent = (beat, now)
            elif now - agent[1] >= self._agent_timeout and not self.channel.flags():
                self._on_lost(f"its node agent (the launcher) showed no sign of life for {now - agent[1]:.0f}s")
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self._interval + 1)
