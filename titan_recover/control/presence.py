"""Which coordinator candidates of a run on etcd live, and which were told that their node goes away.

Each candidate shows itself under ``keys.CANDIDATES`` + its id (a ``protocol.Candidate``), put with an etcd
lease of its own that it keeps alive: one that dies, or freezes past the lease, drops out of the list by
itself. A notice (SIGTERM) to its node rewrites it at once, ``noticed``.

A noticed candidate hands the lead to one that is not (its node stays, so the run goes on there), but when
every live candidate was noticed (the whole job is preempted) none would outlast it: it leads on, so that
someone publishes the epochs and the stop the groups wait for (``leads_on``). Noticed candidates keep
campaigning meanwhile, for the leader may die first.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterable

from titan_recover.control import keys
from titan_recover.control.etcd_store import EtcdStore, put_op
from titan_recover.control.protocol import Candidate, MessageError
from titan_recover.control.sealed import ForgedRecord, Run

log = logging.getLogger(__name__)


def leads_on(noticed: bool, others_noticed: Iterable[bool]) -> bool:
    """Whether a candidate keeps the lead, or campaigns for it: its node stays, or every other live
    candidate's node goes away too (none would lead longer)."""
    return not noticed or all(others_noticed)


class Presence:
    """This candidate's entry among the run's candidates, kept alive by a daemon thread until ``close``."""

    def __init__(self, store: EtcdStore, run: Run, ttl_s: float) -> None:
        self.store, self.run = store, run
        self.ttl_s = max(2, round(ttl_s))
        self.key = f"{keys.CANDIDATES}{uuid.uuid4().hex}"
        self.noticed = False
        self._written: bool | None = None  # ``noticed`` as last put (None: not put under the current lease)
        self._lease = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ignored: set[str] = set()  # entries found forged or malformed (warned once each)
        self._put()
        threading.Thread(target=self._keep, name="titan-recover-presence", daemon=True).start()

    def notice(self) -> None:
        """This node goes away: said at once by the keeper thread (safe in a signal handler)."""
        self.noticed = True
        self._wake.set()

    def _put(self) -> None:
        noticed = self.noticed
        if self._written is None:
            self._lease = int(self.store.post("lease/grant", {"TTL": self.ttl_s})["ID"])
        record = Candidate(os.getpid(), socket.gethostname(), noticed).dumps()
        value = self.run.seal(self.key, record)
        self.store.txn([], [put_op(f"{self.run.prefix}/{self.key}", value, self._lease)])
        self._written = noticed

    def _keep(self) -> None:
        """Refreshes the lease every third of its TTL, and puts the entry again once the notice came or the
        lease was lost (this process frozen past it); a failed request is tried again on the next round."""
        while not self._stop.is_set():
            self._wake.wait(self.ttl_s / 3)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if self._written is not None and self._written == self.noticed:
                    answer = self.store.post("lease/keepalive", {"ID": self._lease})
                    if int(answer.get("result", {}).get("TTL", -1)) > 0:
                        continue
                    self._written = None  # expired: a new lease, and the entry put again
                self._put()
            except Exception as e:  # no member answered within the store's timeout: the next round tries again
                log.debug(f"candidate presence not refreshed: {e}")

    def others(self) -> list[Candidate]:
        """Every other live candidate of the run; an entry not sealed with the run's secret, or malformed, is
        no candidate of it."""
        prefix = f"{self.run.prefix}/{keys.CANDIDATES}"
        found = []
        for full, raw in self.store.read_under(prefix).items():
            key = full[len(self.run.prefix) + 1 :]
            if key == self.key:
                continue
            try:
                found.append(Candidate.loads(key, self.run.unseal(key, raw)))
            except (ForgedRecord, MessageError) as e:
                if key not in self._ignored:  # said once: it is read again on every look
                    self._ignored.add(key)
                    log.warning(f"ignoring a candidate entry: {e}")
        return found

    def leads_on(self) -> bool:
        """Whether this candidate keeps the lead, or campaigns for it, now (``leads_on``)."""
        return not self.noticed or leads_on(True, (c.noticed for c in self.others()))

    def close(self) -> None:
        """Drops out of the list at once (it would expire with its lease otherwise)."""
        self._stop.set()
        self._wake.set()
        try:
            self.store.post("kv/lease/revoke", {"ID": self._lease})
        except Exception:
            pass  # it expires on its own
