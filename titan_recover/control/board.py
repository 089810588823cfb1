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
import socket
import time
from datetime import timedelta
from typing import Callable, TypeVar

import torch.distributed as dist

from titan_recover.control import keys
from titan_recover.control.addresses import route_address
from titan_recover.control.protocol import BoardAddress
from titan_recover.control.sealed import Run, SealedStore
from titan_recover.control.transport import call_within, connection_refused, in_run, serve_any_port

OP_S = 0.5  # a board that does not answer within this (a dead, frozen or cut-off leader's): look again
RETRY_S = 1.0  # a board that failed is tried again after this, unless etcd names a new one
log = logging.getLogger(__name__)
T = TypeVar("T")


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
    """A launcher's writer and reader of the board, found through its etcd client ``etcd``. One
    thread at a time uses an instance.

    A TCPStore client of a frozen server blocks past any timeout (and a set gets no answer, so
    writes to it would seem to succeed): every board call runs in a thread of its own, given
    ``OP_S``, and ends with a round trip. A call that overruns is left behind, blocked until that
    server dies or wakes, and the board is looked up again (the same address not before ``RETRY_S``,
    unless the leader that serves it answers again then)."""

    def __init__(self, run: Run) -> None:
        self._run = run
        self._client: SealedStore | None = None
        self._at: BoardAddress | None = None  # the board ``_client`` talks to
        self._failed = ("", 0.0)  # the board address that last failed, and when

    def _where(self, etcd: SealedStore) -> BoardAddress:
        """The board to call: the one ``_client`` talks to, else the one etcd names now."""
        if self._client is not None and self._at is not None:
            return self._at
        raw = etcd.read(keys.BOARD)
        if raw is None:
            raise BoardMissing("no coordinator leader serves the node messages yet")
        where = BoardAddress.loads(keys.BOARD, raw)
        failed, when = self._failed
        if where.address == failed and time.monotonic() - when < RETRY_S:
            raise BoardMissing(f"the node board at {where.address} failed {time.monotonic() - when:.1f}s ago")
        return where

    def _connect(self, where: BoardAddress) -> SealedStore:
        try:
            socket.create_connection((where.host, where.port), timeout=OP_S).close()
        except OSError as e:
            raise BoardMissing(f"the node board at {where.address} does not answer ({e}): its leader is gone") from None
        # not transport.connect, which waits for a starting server: a beat must not wait on a lost one
        client = in_run(
            dist.TCPStore(where.host, where.port, is_master=False, timeout=timedelta(seconds=OP_S)), self._run
        )
        if not client.check([keys.HELLO]):
            raise BoardMissing(f"the node board at {where.address} does not serve this run")
        return client

    def _call(self, etcd: SealedStore, op: Callable[[SealedStore], T]) -> T:
        where, known = self._where(etcd), self._client

        def call() -> tuple[SealedStore, T]:
            client = known or self._connect(where)
            return client, op(client)

        try:
            self._client, result = call_within(2 * OP_S, call, "titan-recover-board")  # a connect and a call
        except Exception as e:
            self._client, self._failed = None, (where.address, time.monotonic())
            if isinstance(e, TimeoutError):
                raise BoardMissing(f"the node board at {where.address} did not answer within {2 * OP_S:g}s") from None
            raise
        self._at, self._failed = where, ("", 0.0)
        return result

    def set(self, etcd: SealedStore, key: str, value: str) -> None:
        def write(client: SealedStore) -> None:
            client.set(key, value)
            client.inner.check([key])  # a round trip: a set gets no answer

        self._call(etcd, write)

    def read(self, etcd: SealedStore, key: str) -> bytes:
        """The value under ``key`` (b"" while there is none)."""
        return self._call(etcd, lambda client: client.read(key) or b"")
