"""The node messages of a run on etcd, on a board that its coordinator leader serves.

Every launcher writes its node message every ``heartbeat_interval_s``. On etcd each would be a
Raft entry that every member appends and syncs to disk: this machine's 3 members top out near
400 such writes/s (``bench.etcd_nodes``), about 200 nodes, and a 16,384-rank run asks ten times
that. Liveness needs no durability (a new leader gives every group one heartbeat timeout anyway),
so the leader serves the node messages from a TCPStore of its own, sealed with the run's secret
like every value, and writes only the board's address to etcd (``keys.BOARD``). Everything that
must survive the leader (epochs, steps, claims, reports) stays in etcd.

A launcher finds the board through etcd and looks again after any error: a new leader serves a
new board, and the old one's is closed (or dead with it).
"""

import gc
import logging
from datetime import timedelta

from titan_recover.control import keys
from titan_recover.control.addresses import route_address
from titan_recover.control.protocol import BoardAddress
from titan_recover.control.sealed import Run, SealedStore
from titan_recover.control.transport import connect, connection_refused, serve_any_port

CONNECT_S = 2.0  # a board that does not answer within this is a dead or frozen leader's: look again
log = logging.getLogger("titan_recover.coordinator")


class BoardMissing(RuntimeError):
    """No coordinator leader serves a board (yet), or the one named in etcd does not answer."""


class LeaderBoard:
    """The leader's side: serves the board, publishes its address, and frees its port on ``close``.

    The TCPStore server lives as long as its Python object: this class holds the only reference,
    so ``close`` ends it (clients of a closed board get errors and look again)."""

    def __init__(self, etcd_url: str, run: Run, timeout_s: float) -> None:
        host = route_address(etcd_url)  # the interface the other nodes reach etcd from reaches this host too
        self._store: SealedStore | None
        self._store, port = serve_any_port(host, timeout_s, run)
        self.where = BoardAddress(host, port)

    def messages(self, names: list[str]) -> list[bytes]:
        """The node messages under ``names`` (b"" for one not written since this board opened)."""
        assert self._store is not None, "the board is closed"
        return [raw or b"" for raw in self._store.multi_read(names)]

    def close(self) -> None:
        self._store = None
        gc.collect()  # a reference cycle must not keep the server listening
        if not connection_refused(self.where.address):
            log.warning(f"the node board at {self.where.address} still listens after it was closed")


class Board:
    """A launcher's writer and reader of the board, found through its etcd client ``etcd``."""

    def __init__(self, run: Run) -> None:
        self._run = run
        self._client: SealedStore | None = None

    def _store(self, etcd: SealedStore) -> SealedStore:
        if self._client is None:
            raw = etcd.read(keys.BOARD)
            if raw is None:
                raise BoardMissing("no coordinator leader serves the node messages yet")
            where = BoardAddress.loads(keys.BOARD, raw)
            if connection_refused(where.address):
                raise BoardMissing(f"the node board at {where.address} refuses connections: its leader is gone")
            self._client = connect(where.address, CONNECT_S, self._run)
            self._client.set_timeout(timedelta(seconds=CONNECT_S))
        return self._client

    def set(self, etcd: SealedStore, key: str, value: str) -> None:
        try:
            self._store(etcd).set(key, value)
        except Exception:
            self._client = None  # looked up again next time
            raise

    def read(self, etcd: SealedStore, key: str) -> bytes:
        """The value under ``key`` (b"" while there is none)."""
        try:
            return self._store(etcd).read(key) or b""
        except Exception:
            self._client = None
            raise
