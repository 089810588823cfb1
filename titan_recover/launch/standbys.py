"""A node's warm incarnations (``node.warm``): at most one per replica group, started once the
group trains, activated by its restart.

``Standbys`` owns their torchruns and their files: it starts one when a group's current
incarnation trains (so that start is not slowed by the warm one's imports), notices when its
ranks all wait (the event log's ``warm_ready``), and one that died unused is started again after
``RETRY_S``, up to ``TRIES`` per group, then the group restarts cold. ``take`` hands a group's
live one to its restart once the failed incarnation's ranks are gone (their memory, a GPU's
included, is free); ``Standby.activate`` writes its ``Activation``.
"""

import logging
import os
import secrets
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

from titan_recover.control import keys
from titan_recover.node.agent import NodeAgent
from titan_recover.node.channel import shm_dir
from titan_recover.node.procs import die_with_parent, holds_memory
from titan_recover.node.warm import WARM_ENV, Activation, ready_file

RETRY_S = 30.0  # a warm incarnation that died unused is started again after this long
TRIES = 3  # warm incarnations of one group that may die unused before the group restarts cold only
REAP_S = 10.0  # how long a failed incarnation's ranks may take to be gone before its warm successor builds
log = logging.getLogger(__name__)


@dataclass
class Standby:
    """One group's warm incarnation: its torchrun, the file that activates it, when it started."""

    replica: int
    proc: subprocess.Popen
    path: str
    since: float
    ready: bool = False

    def files(self, ranks: int) -> list[str]:
        return [self.path, *(ready_file(self.path, k) for k in range(ranks))]

    def activate(self, incarnation: int, channel: str) -> subprocess.Popen:
        """Makes it incarnation ``incarnation`` of the group, with that node channel; its torchrun."""
        Activation(self.replica, incarnation, channel).write(self.path)
        log.info(
            f"replica group {self.replica}: its warm incarnation ({'waiting' if self.ready else 'still importing'}) "
            f"takes over as attempt {incarnation}"
        )
        return self.proc


class Standbys:
    """This node's warm incarnations; ``command(replica)`` is a group's torchrun command line."""

    def __init__(
        self,
        command: Callable[[int], list[str]],
        envs: dict[int, dict[str, str]],
        ranks: int,
        agent: NodeAgent,
        clock: Callable[[], float],
        on_ready: Callable[[int, float], object],
    ) -> None:
        self.command, self.envs, self.ranks, self.agent, self.clock = command, envs, ranks, agent, clock
        self.on_ready = on_ready  # (replica, seconds from its start until all its ranks waited)
        self.waiting: dict[int, Standby] = {}
        self.activated: dict[int, Standby] = {}  # group -> the warm incarnation that became its current one
        self.lost: dict[int, int] = {}  # group -> its warm incarnations that died unused
        self.after: dict[int, float] = {}  # group -> when its next warm incarnation may start

    def has(self, replica: int) -> bool:
        return replica in self.waiting

    def keep(self, procs: dict[int, subprocess.Popen], given_up: set[int]) -> None:
        """One look: notices warm incarnations that died or became ready, and starts one for each
        group that trains and has none."""
        now = self.clock()
        for r, standby in list(self.waiting.items()):
            if standby.proc.poll() is not None:
                del self.waiting[r]
                self._lost(standby)
            elif not standby.ready and all(os.path.exists(ready_file(standby.path, k)) for k in range(self.ranks)):
                standby.ready = True
                log.info(f"replica group {r}: its warm incarnation waits, {now - standby.since:.1f}s after its start")
                self.on_ready(r, now - standby.since)
        for r, proc in procs.items():
            if (
                r in self.waiting
                or r in given_up
                or proc.poll() is not None
                or self.lost.get(r, 0) >= TRIES
                or now < self.after.get(r, 0.0)
                or not self.agent.training(r)
            ):
                continue
            path = os.path.join(shm_dir(), f"titan_recover-{os.getpid()}-r{r}-warm-{secrets.token_hex(4)}")
            env = {**self.envs[r], keys.REPLICA_ENV: str(r), WARM_ENV: path}
            warm = subprocess.Popen(self.command(r), env=env, preexec_fn=die_with_parent)
            self.waiting[r] = Standby(r, warm, path, now)
            log.info(f"replica group {r} trains: its next incarnation starts warm (pid {warm.pid})")

    def take(self, replica: int, failed: list[int]) -> Standby | None:
        """The group's live warm incarnation, once the ``failed`` incarnation's rank pids are gone;
        None to start cold. The incarnation it replaces forgets its own files."""
        if replica in self.activated:
            self._remove(self.activated.pop(replica))
        standby = self.waiting.pop(replica, None)
        if standby is None:
            return None
        if standby.proc.poll() is not None:
            self._lost(standby)
            return None
        deadline = time.monotonic() + REAP_S
        while any(holds_memory(p) for p in failed):
            if time.monotonic() > deadline:
                log.warning(
                    f"replica group {replica}: ranks of the failed incarnation still alive {REAP_S:g}s after its "
                    "torchrun exited; its warm incarnation builds beside them"
                )
                break
            time.sleep(0.02)
        self.activated[replica] = standby
        return standby

    def drop(self, replica: int) -> None:
        """Kills the warm incarnation of ``replica``, if it has one (the group leaves: nothing will restart)."""
        standby = self.waiting.pop(replica, None)
        if standby is not None:
            if standby.proc.poll() is None:
                standby.proc.kill()
                standby.proc.wait()
            self._remove(standby)

    def stop(self) -> None:
        """Kills every waiting warm incarnation (the run ends, or this launcher does) and removes every file."""
        for standby in self.waiting.values():
            if standby.proc.poll() is None:
                standby.proc.kill()
                standby.proc.wait()
        for standby in [*self.waiting.values(), *self.activated.values()]:
            self._remove(standby)
        self.waiting.clear()
        self.activated.clear()

    def _lost(self, standby: Standby) -> None:
        r = standby.replica
        lost = self.lost[r] = self.lost.get(r, 0) + 1
        self.after[r] = self.clock() + RETRY_S
        again = (
            f"another starts in {RETRY_S:g}s" if lost < TRIES else f"{lost} died: the group restarts cold from now on"
        )
        log.warning(
            f"the warm incarnation of replica group {r} exited with code {standby.proc.returncode} before it "
            f"was needed (its log is above); {again}"
        )
        self._remove(standby)

    def _remove(self, standby: Standby) -> None:
        for path in standby.files(self.ranks):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
