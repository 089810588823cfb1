"""A launcher's lifeline to the coordinator: the node message it writes, and the watch that
finds the coordinator lost. Daemon threads with their own store client."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch.distributed as dist

from titan_recover.control import keys
from titan_recover.control.addresses import is_etcd
from titan_recover.control.board import Board
from titan_recover.control.sealed import Run, SealedStore
from titan_recover.control.transport import call_within, connect, connection_refused

if TYPE_CHECKING:
    from titan_recover.control.etcd_store import Changes

PROBE_S = 0.5  # how often a lifeline reads ALIVE; the coordinator lingers longer than that at the end
CONFIRM_S = 1.0  # the fresh probe before a verdict: a live coordinator answers a new client well within it
log = logging.getLogger(__name__)


def one_line(e: BaseException) -> str:
    """An error in one short line, for a log line (torch's store errors run on for lines)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def store_errors(address: str) -> tuple[type[Exception], ...]:
    """What a control store call raises when the store is unreachable or slow: torch's store
    errors and, on etcd, its client's. Transient while the lifeline finds the coordinator alive."""
    if not is_etcd(address):
        return (dist.DistError,)
    from titan_recover.control.etcd_store import EtcdError  # the etcd extra: only a run on etcd has it

    return (dist.DistError, EtcdError)


@dataclass
class AliveClock:
    """The coordinator's alive counter as one watcher saw it, and how long it has stood still.

    Silence counts only while the watcher runs: a watcher that did not run (its process
    stopped: SIGSTOP, a paused VM) saw nothing meanwhile, so when it wakes far later than it
    asked, the coordinator gets a full ``timeout_s`` from then. A frozen coordinator is still
    found one bound after the watcher resumed.
    """

    timeout_s: float
    start: float  # when watching began
    value: int = -1
    # the bound before the counter first moved past 0 (a coordinator still starting, a leader being elected)
    startup_s: float = 0.0
    since: float = field(init=False)  # when the counter last moved, or the watcher last woke from a pause
    last_tick: float = field(init=False)

    def __post_init__(self) -> None:
        self.since = self.last_tick = self.start

    def read(self, value: int, now: float) -> bool:
        """A reading of the counter; whether it moved since the last one."""
        moved = value != self.value
        if moved:
            self.value, self.since = value, now
        return moved

    def tick(self, now: float, wait_s: float) -> float:
        """The watcher woke, having asked to sleep ``wait_s``; how long it was paused (0.0: it was not).
        Late by half the bound or more counts as paused: such a pause alone could pass for silence."""
        late = now - self.last_tick - wait_s
        self.last_tick = now
        if late < self.timeout_s / 2:
            return 0.0
        self.since = now
        return late

    def silent(self, now: float) -> float:
        return now - self.since

    def bound(self) -> float:
        """How long a silence may last: ``startup_s`` until the coordinator first showed life (on a
        loaded host its imports and, on etcd, its election take a while), ``timeout_s`` after."""
        return self.timeout_s if self.value > 0 else max(self.timeout_s, self.startup_s)


def alive_reading(client: SealedStore, watch: Changes | None = None) -> int | None:
    """The coordinator's alive counter: from ``watch``'s events when it saw a put, None when it saw
    none (no request: the counter stood still), read through ``client`` when there is no watch or
    it (re)started and anything may have moved."""
    seen = watch.wait(0) if watch is not None else None
    if seen is not None and not seen:
        return None
    raw = watch.value("") if watch is not None and seen else None
    return int(raw) if raw is not None else int(client.add(keys.ALIVE, 0))


class Heartbeat:
    """A launcher's lifeline to the coordinator, run by daemon threads with their own store client.

    - Writes ``message()`` (the node agent's message: ``agent.NodeAgent.message``) under
      ``key`` every ``interval_s``: the coordinator's only per-node read, and the sign of
      life other launchers look at before taking this one's replica groups over (``claims``).
    - Retries a failed store call on a fresh connection: a transient reset must not
      fence a healthy node.
    - Watches the coordinator: its alive counter must move within ``coordinator_timeout_s``
      and its port must not refuse connections, or ``on_lost(reason)`` runs, from a
      second thread so that a store call blocked on a frozen server cannot hide it.
      Once the run is ending (``ended()``: the coordinator published done or fatal) a
      vanished coordinator is expected.
    - Loses only what it saw: time this launcher did not run (``AliveClock``) is not the
      coordinator's silence, and before a verdict a fresh probe (a new client, within
      ``CONFIRM_S``) reads the counter again. A launcher that was paused carries on (its
      groups may have been fenced meanwhile, and rejoin); a frozen coordinator is found
      within ``coordinator_timeout_s + CONFIRM_S``.
    """

    def __init__(
        self,
        address: str,
        key: str,
        interval_s: float,
        coordinator_timeout_s: float,
        on_lost: Callable[[str], None],
        message: Callable[[], str],
        run: Run | None = None,
        ended: Callable[[], bool] = lambda: False,
        startup_timeout_s: float = 0.0,
        board: Board | None = None,
    ) -> None:
        self._address, self._key, self._interval, self._run, self._board = address, key, interval_s, run, board
        self._board_error = ""  # the last failed write to the board, logged once until one succeeds
        self._board_reached = False
        self._timeout, self._on_lost, self._message, self._ended = coordinator_timeout_s, on_lost, message, ended
        self._clock = AliveClock(coordinator_timeout_s, time.monotonic(), startup_s=startup_timeout_s)
        self._lock = threading.Lock()  # the clock: read by the beat, ticked by the watch
        self._refused = False
        self._error = ""
        self._contact = 0.0  # when a store call last succeeded
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._beat, name="titan-recover-heartbeat", daemon=True),
            threading.Thread(target=self._watch, name="titan-recover-watch", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _beat(self) -> None:
        client: SealedStore | None = None
        watch: Changes | None = None  # on etcd, the alive counter's puts: no read while it moves
        next_probe = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if client is None:
                    client = connect(self._address, min(self._timeout, 60.0), self._run)
                    watch = watch or client.watch(keys.ALIVE)
                if self._board is None:
                    client.set(self._key, self._message())
                if now >= next_probe:
                    self._read(client, watch)
                    next_probe = now + min(PROBE_S, self._timeout / 4)
                self._error, self._refused, self._contact = "", False, time.monotonic()
            except Exception as e:  # retried on a fresh connection; the watch bounds how long
                client, self._error = None, one_line(e)
                self._refused = connection_refused(self._address)
            if self._board is not None and client is not None and not self._ended():  # the leader's board closes
                self._write_board(client)
            self._stop.wait(self._interval)
        if watch is not None:
            watch.close()

    def _write_board(self, client: SealedStore) -> None:
        """The node message, on the leader's board (etcd runs). A failure is not the coordinator's
        loss (its alive counter in etcd says that): it is logged once, and the board looked up again."""
        assert self._board is not None
        try:
            self._board.set(client, self._key, self._message())
        except Exception as e:
            if not self._board_error and self._board_reached:  # before the first leader's board: expected
                log.warning(
                    f"this node's message did not reach the coordinator's board ({one_line(e)}); "
                    "looking it up again every heartbeat interval"
                )
            self._board_error = one_line(e)
            return
        if self._board_error and self._board_reached:
            log.info("this node's message reaches the coordinator's board again")
        self._board_error, self._board_reached = "", True

    @property
    def seen_alive(self) -> bool:
        """Whether the coordinator's alive counter has moved past 0 here: it serves, and this watch bounds its
        silence by ``coordinator_timeout_s`` from now on."""
        with self._lock:
            return self._clock.value > 0

    @property
    def ending(self) -> bool:
        return self._ended()

    def _read(self, client: SealedStore, watch: Changes | None = None) -> bool:
        """Reads the alive counter through ``client``, or from ``watch`` (etcd) while the watch runs:
        its events carry the counter's puts, so a moving counter costs no request (a linearizable
        read each, every ``PROBE_S``, from every launcher, otherwise); whether it moved since the
        last reading."""
        alive = alive_reading(client, watch)
        if alive is None:
            return False
        with self._lock:
            return self._clock.read(alive, time.monotonic())

    def verdict(self) -> str | None:
        """Why the coordinator counts as lost by the readings so far, or None while it lives (or the
        run is ending); the watch confirms it with a fresh probe before acting on it."""
        if self.ending or self._stop.is_set():
            return None
        if self._refused:
            return f"the coordinator at {self._address} refused the connection: its process is gone"
        with self._lock:
            silent, bound, started = self._clock.silent(time.monotonic()), self._clock.bound(), self._clock.value > 0
        if silent >= bound:
            error = f" (last error: {self._error})" if self._error else ""
            never = "" if started else " (it never showed one since this launcher started: [recover] startup_timeout_s)"
            return f"no sign of life from the coordinator at {self._address} for {silent:.0f}s{never}{error}"
        return None

    def fresh_sign_of_life(self) -> bool:
        """Whether the coordinator's alive counter moved since this lifeline last read it, read again
        on a new client within ``CONFIRM_S`` (the beat's own client may be the one that is stuck).
        A thread of its own: a client of a frozen TCPStore server blocks past any timeout."""
        if connection_refused(self._address):
            return False
        try:
            return call_within(
                CONFIRM_S, lambda: self._read(connect(self._address, CONFIRM_S, self._run)), "titan-recover-probe"
            )
        except Exception as e:  # unreachable or too slow: no sign of life
            log.debug(f"probe of the coordinator at {self._address} failed: {e!r}")
            return False

    def _watch(self) -> None:
        wait = min(0.25, self._timeout / 4)
        while not self._stop.wait(wait):
            with self._lock:
                paused = self._clock.tick(time.monotonic(), wait)
            if paused:
                log.warning(
                    f"this launcher did not run for {paused:.1f}s (stopped, e.g. SIGSTOP or a paused VM, or starved "
                    f"of CPU): the coordinator gets {self._timeout:g}s from now to show a sign of life; this "
                    "node's replica groups may have been fenced meanwhile, and rejoin"
                )
            reason = self.verdict()
            if reason is None:
                continue
            if self.fresh_sign_of_life():
                log.warning(f"{reason}, as this launcher saw it; a fresh probe found it alive: carrying on")
                continue
            if self.verdict() is not None:  # the run did not end while the probe ran
                self._on_lost(reason)
                return

    def settle(self, timeout_s: float = 3.0) -> None:
        """After a failed store call in the main thread: waits until the lifeline reaches
        the coordinator again (the error was local) or finds it lost (``on_lost`` runs)."""
        start = time.monotonic()
        while time.monotonic() < start + timeout_s and self._contact <= start:
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2 * self._interval + 1)
