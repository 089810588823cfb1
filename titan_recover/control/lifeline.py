"""A launcher's lifeline to the coordinator: the node message it writes, and the watch that
finds the coordinator lost. Daemon threads with their own store client."""

import threading
import time
from typing import Callable

import torch.distributed as dist

from titan_recover.control import keys
from titan_recover.control.transport import connect, connection_refused

PROBE_S = 0.5  # how often a lifeline reads ALIVE; the coordinator lingers longer than that at the end


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
    """

    def __init__(
        self,
        address: str,
        key: str,
        interval_s: float,
        coordinator_timeout_s: float,
        on_lost: Callable[[str], None],
        message: Callable[[], str],
        secret: str | None = None,
        ended: Callable[[], bool] = lambda: False,
    ) -> None:
        self._address, self._key, self._interval, self._secret = address, key, interval_s, secret
        self._timeout, self._on_lost, self._message, self._ended = coordinator_timeout_s, on_lost, message, ended
        self._alive = (-1, time.monotonic())  # the coordinator's alive counter, and when it last moved
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
        client: dist.Store | None = None
        next_probe = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if client is None:
                    client = connect(self._address, min(self._timeout, 60.0), self._secret)
                client.set(self._key, self._message())
                if now >= next_probe:
                    alive = int(client.add(keys.ALIVE, 0))
                    if alive != self._alive[0]:
                        self._alive = (alive, time.monotonic())
                    next_probe = now + min(PROBE_S, self._timeout / 4)
                self._error, self._contact = "", time.monotonic()
            except Exception as e:  # retried on a fresh connection; the watch bounds how long
                client, self._error = None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                self._refused = connection_refused(self._address)
            self._stop.wait(self._interval)

    @property
    def ending(self) -> bool:
        return self._ended()

    def verdict(self) -> str | None:
        """Why the coordinator counts as lost, or None while it lives (or the run is ending)."""
        if self.ending or self._stop.is_set():
            return None
        if self._refused:
            return f"the coordinator at {self._address} refused the connection: its process is gone"
        silent = time.monotonic() - self._alive[1]
        if silent >= self._timeout:
            error = f" (last error: {self._error})" if self._error else ""
            return f"no sign of life from the coordinator at {self._address} for {silent:.0f}s{error}"
        return None

    def _watch(self) -> None:
        while not self._stop.wait(min(0.25, self._timeout / 4)):
            reason = self.verdict()
            if reason is not None:
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
