"""Coordinator fail-over on etcd: one candidate per node, one leader at a time.

A candidate campaigns by creating the run's leader key, attached to an etcd lease of
``leader_lease_s``, in a transaction that succeeds only while the key does not exist.
The winner keeps its lease alive from a thread and acts through a store guarded by
that key (``EtcdStore(guard=...)``): every write it makes is conditional on the key
still holding its own value. When it dies or freezes, the lease expires, etcd deletes
the key, and the next candidate's campaign succeeds; a frozen leader that resumes
finds its writes refused (``LeadershipLost``) and campaigns again as a follower.

The leader also compacts etcd's history (every put keeps a revision until then; node
messages alone write ~10 per node per second): a cluster set up without auto-compaction
would otherwise fill its space quota and refuse every write.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from typing import Callable

from etcd3gw.utils import _encode

from titan_recover.control.etcd_store import EtcdError, EtcdStore, LeadershipLost, put_op

CAMPAIGN_WAIT_S = 1.0  # longest a follower waits between tries: it watches the key, and tries once it is deleted
COMPACT_EVERY_S = 60.0  # how often the leader compacts etcd's history
KEEP_HISTORY_S = 300.0  # the history kept (nothing of the run reads an older revision; an operator may)
log = logging.getLogger(__name__)


class Lease:
    """This candidate's campaign for ``key`` on ``store`` (an unguarded EtcdStore)."""

    def __init__(self, store: EtcdStore, key: str, ttl_s: float) -> None:
        self.store, self.key, self.ttl_s = store, key, ttl_s
        self.value = json.dumps({"id": uuid.uuid4().hex, "pid": os.getpid(), "host": socket.gethostname()})
        self._id: int | None = None
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    def campaign(self, ended: Callable[[], bool], may_lead: Callable[[], bool] = lambda: True) -> EtcdStore | None:
        """Blocks until this candidate leads (the store to act through, every write guarded by
        the lease), or returns None once ``ended()`` says the run is over; it tries only while
        ``may_lead()`` (asked again every ``CAMPAIGN_WAIT_S``)."""
        while not ended():
            if not may_lead():
                time.sleep(CAMPAIGN_WAIT_S)
                continue
            grant = self.store.post("lease/grant", {"TTL": max(2, round(self.ttl_s))})
            lease = int(grant["ID"])
            won = self.store.txn(
                [{"key": _encode(self.key), "target": "CREATE", "result": "EQUAL", "create_revision": 0}],
                [put_op(self.key, self.value.encode(), lease)],
            ).get("succeeded", False)
            if won:
                self._id = lease
                self._lost.clear()
                self._stop = threading.Event()  # this term's: a previous term's threads stay stopped
                self._keeper = threading.Thread(
                    target=self._keep, args=(self._stop,), name="titan-recover-lease", daemon=True
                )
                self._keeper.start()
                threading.Thread(
                    target=self._compact, args=(self._stop,), name="titan-recover-compact", daemon=True
                ).start()
                return self.store.guarded((self.key, self.value))
            self.store.post("kv/lease/revoke", {"ID": lease})
            held, revision = self.store.read_at(self.key)
            if held is not None:  # its leader's lease expiring deletes it: tried again at once
                self.store.await_change(self.key, revision, CAMPAIGN_WAIT_S, deletes=True)
        return None

    def _keep(self, stop: threading.Event) -> None:
        """Refreshes the lease every third of its TTL; an expired one (this process was frozen
        longer than the TTL) is lost for good: another candidate may lead by now."""
        while not stop.wait(self.ttl_s / 3):
            try:
                answer = self.store.post("lease/keepalive", {"ID": self._id})
                if int(answer.get("result", {}).get("TTL", -1)) <= 0:
                    self._lost.set()
                    return
            except Exception:  # no member answered within the store's timeout: the guard decides
                continue

    def _compact(self, stop: threading.Event) -> None:
        """While this candidate leads, compacts etcd's history older than ``KEEP_HISTORY_S`` every
        ``COMPACT_EVERY_S``, through a client of its own (a slow member never delays a keep-alive)."""
        store = EtcdStore(self.store.endpoints, self.store.timeout.total_seconds())
        seen: deque[tuple[float, int]] = deque()  # (when, the revision then), oldest first
        while not stop.wait(COMPACT_EVERY_S) and not self._lost.is_set():
            try:
                now = time.monotonic()
                seen.append((now, store.revision()))
                while len(seen) > 1 and seen[1][0] <= now - KEEP_HISTORY_S:
                    seen.popleft()
                if seen[0][0] <= now - KEEP_HISTORY_S:
                    store.compact(seen.popleft()[1])
            except EtcdError as e:  # tried again next time
                log.warning(f"could not compact etcd's history: {e}")

    def check(self) -> None:
        """Raises LeadershipLost once the keeper found the lease expired."""
        if self._lost.is_set():
            raise LeadershipLost(f"this candidate's lease on {self.key!r} expired (was it frozen?)")

    def resign(self) -> None:
        """Gives the lease back at once (a clean end, or a lost leadership)."""
        self._stop.set()
        if self._id is not None:
            try:
                self.store.post("kv/lease/revoke", {"ID": self._id})
            except Exception:
                pass  # it expires on its own
            self._id = None
