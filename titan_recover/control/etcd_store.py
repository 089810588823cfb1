"""The etcd control store: the run's state on a Raft-replicated store.

``[recover] control_store = "etcd://h1:2379,h2:2379,h3:2379"``. ``EtcdStore`` is a
``torch.distributed.Store`` written in Python over etcd's JSON gateway (etcd3gw: base64
JSON, never pickle), so every caller of the TCPStore API (the coordinator, node agents,
ranks, ``PrefixStore``, and the replicate groups' gloo rendezvous) uses it unchanged:

- **Member loss is invisible.** A request that finds its member gone, or without a
  leader, is sent to the next endpoint until the store's timeout runs out. The endpoints follow
  the cluster's members (read again after every fail-over and every ``FOLLOW_S``, shared by the
  process's stores): a run whose launchers replace a lost member with one on another node
  (``launch.keeper``) is dialled there. A process idle while every member it knew was replaced
  (a rank held in a long step) finds the addresses its node's other processes last read in the
  node's file (``keys.ETCD_ENDPOINTS_ENV``), which every store that follows writes.
- **Counters are exact.** ``add`` is a compare-and-swap on the key's revision that also
  records its sequence number and result under a marker key of this client; a request whose
  answer was lost (its member died mid-request) is looked up there, never applied twice.
  The marker lives on a lease of this client's: a client that is gone leaves no key behind.
- **Writes can be fenced.** A store made with ``guard=(key, value)`` does every write in
  a transaction conditional on ``key`` still holding ``value`` (the coordinator's leader
  lease, see ``leader``); when it does not, the write is not made and ``LeadershipLost``
  is raised: a stale leader can never publish.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.parse
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING

import requests
import torch.distributed as dist
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import Etcd3Exception, InternalServerError, PreconditionFailedError
from etcd3gw.utils import _decode, _encode

from titan_recover.control.addresses import ETCD_SCHEME, parse_etcd_url, resolve
from titan_recover.control.keys import ETCD_ENDPOINTS_ENV

REQUEST_S = 2.0  # one HTTP request; a member cut off from the quorum is left after this
RETRY_S = (0.002, 0.25)  # first and longest pause before asking every member again
WATCH_S = 5.0  # longest single watch of a blocking get/wait: a member cut off from the quorum may keep
# a watch open and silent, so the key is read again (a linearizable read, which fails over) this often
REQUIRE_LEADER = {"Grpc-Metadata-hasleader": "true"}  # etcd cancels such a watch when its member loses the leader
MIN_MEMBERS = 3  # fewer cannot lose one member and keep a majority
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
MARKERS = "titan_recover/adds/"  # the clients' add markers, one per live client
MAX_COUNTERS = 64  # counters whose last value a client remembers (see ``EtcdStore.add``)
MARKER_TTL_S = 600.0  # a gone client's marker is deleted by etcd within this (longer for long store timeouts)
REFUSED_CODES = {3, 5, 11}  # gRPC InvalidArgument, NotFound, OutOfRange: the request is wrong, not the member
FOLLOW_S = 30.0  # how often a client reads the cluster's members again, besides after every fail-over
MEMBER_LIST = "cluster/member/list"
MAX_MEMBERS = 16  # the most members a client takes from a member list (a run forms 3 or 5)
log = logging.getLogger(__name__)


class LeadershipLost(RuntimeError):
    """A guarded write found the lease key no longer holding this leader's value."""


class EtcdError(RuntimeError):
    """The etcd cluster did not carry a request out (what a caller retries or reports)."""


class EtcdUnavailable(EtcdError):
    """No endpoint of the etcd cluster answered within the store's timeout."""


class EtcdRefused(EtcdError):
    """The cluster answered and refused the request itself (a compacted revision, an unknown lease):
    no other member would take it."""


def _b(data: str | bytes) -> bytes:
    return data if isinstance(data, bytes) else data.encode()


class Cluster:
    """One etcd cluster's client addresses as this process last read them, shared by every store of the process
    that dials it: one that follows the membership moves them all (a store used rarely, as a rank's report of its
    own failure, would otherwise begin with addresses long gone)."""

    def __init__(self, endpoints: list[tuple[str, int]]) -> None:
        self.endpoints = list(endpoints)
        self.version = 0  # moved on by each follow that changed them
        self.next_follow = time.monotonic() + FOLLOW_S


_CLUSTERS: dict[tuple[tuple[str, int], ...], Cluster] = {}  # by the addresses a store was first given
_CLUSTERS_LOCK = threading.Lock()


def cluster_of(endpoints: list[tuple[str, int]]) -> Cluster:
    with _CLUSTERS_LOCK:
        return _CLUSTERS.setdefault(tuple(endpoints), Cluster(endpoints))


def followed(url: str) -> str:
    """The ``etcd://`` ``url`` as this process's clients of that cluster last read its members (the addresses a
    process started now should dial: some of those the run began with may be gone); ``url`` where none has."""
    began = parse_etcd_url(url)
    with _CLUSTERS_LOCK:
        known = _CLUSTERS.get(tuple(began))
    if known is None or set(known.endpoints) in ({*began}, {(_address(h), p) for h, p in began}):
        return url  # the same members, by the names the run was given
    return ETCD_SCHEME + ",".join(f"{h}:{p}" for h, p in known.endpoints)


def _address(host: str) -> str:
    try:
        return resolve(host)
    except ValueError:
        return host


class EtcdStore(dist.Store):
    """The TCPStore API on etcd, with fail-over across ``endpoints`` (see the module doc)."""

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        timeout_s: float,
        guard: tuple[str, str] | None = None,
        cluster: Cluster | None = None,
    ) -> None:
        super().__init__()
        self._cluster = cluster or cluster_of(endpoints)
        self._version = -1  # the cluster's version ``_clients`` were made for
        self._clients: list[Etcd3Client] = []
        self._current = 0
        self._dial()
        self._guard = guard
        self._marker = f"{MARKERS}{uuid.uuid4().hex}"
        self._marker_lease: tuple[int, float] | None = None  # its id, and when it expires (monotonic)
        self._seq = 0
        self._counters: dict[str, tuple[int, int]] = {}  # key -> (value, mod_revision) as this client last wrote it
        self._lock = threading.Lock()  # one store object is shared by threads (gloo's rendezvous, a lifeline)
        self._add_lock = threading.Lock()  # one add at a time: the marker tells only the last add's fate
        self.set_timeout(timedelta(seconds=timeout_s))

    if TYPE_CHECKING:  # torch's Store has it (what ``set_timeout`` set); its stub lacks it

        @property
        def timeout(self) -> timedelta: ...

    def guarded(self, guard: tuple[str, str]) -> EtcdStore:
        """A store like this one whose writes are all conditional on ``guard``; its first request goes
        to the member that last answered this one (a member cut off would cost a request's timeout)."""
        store = EtcdStore(self.endpoints, self.timeout.total_seconds(), guard=guard, cluster=self._cluster)
        store._current = self._current
        return store

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        return self._cluster.endpoints

    def _dial(self) -> list[Etcd3Client]:
        """A client per endpoint, made again where a store of this process followed the membership since."""
        if self._version != self._cluster.version:
            version, endpoints = self._cluster.version, self._cluster.endpoints
            self._clients = [Etcd3Client(host, port, timeout=REQUEST_S, api_path="/v3/") for host, port in endpoints]
            self._version, self._current = version, 0
        return self._clients

    # ---- transport ------------------------------------------------------------------

    def post(self, path: str, body: dict) -> dict:
        """One request, to the member that last answered, then to the others in turn, until the
        store's timeout; ``EtcdUnavailable`` naming every member's last error after that."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        errors: dict[str, str] = {}
        pause = RETRY_S[0]
        while True:
            clients, first = self._dial(), self._current  # a follow may replace them meanwhile
            for i in range(len(clients)):
                index = (first + i) % len(clients)
                client = clients[index]
                try:
                    with self._lock:
                        answer = client.post(client.get_url(path), json=body)
                    self._current = index
                    if path != MEMBER_LIST and (errors or time.monotonic() > self._cluster.next_follow):
                        self._follow()
                    return answer
                except PreconditionFailedError:
                    raise  # the request itself is wrong: no other member would take it
                except Etcd3Exception as e:  # gone, no leader, timed out: try the next member
                    if (why := _refusal(e)) is not None:
                        raise EtcdRefused(f"etcd refused {path}: {why}") from None
                    errors[f"{client.host}:{client.port}"] = f"{type(e).__name__}: {str(e.detail_text or e)[:120]}"
            if self._reread():  # the node's file names others: they are tried at once
                continue
            if time.monotonic() > deadline:
                raise EtcdUnavailable(
                    f"no etcd member answered within {self.timeout.total_seconds():g}s: "
                    + "; ".join(f"{k}: {v}" for k, v in errors.items())
                )
            time.sleep(pause)
            pause = min(2 * pause, RETRY_S[1])

    def txn(self, compare: list[dict], success: list[dict], failure: list[dict] | None = None) -> dict:
        return self.post("kv/txn", {"compare": compare, "success": success, "failure": failure or []})

    def _guarded(self, compare: list[dict], success: list[dict], failure: list[dict] | None = None) -> dict:
        """A write transaction, conditional on the guard too; LeadershipLost when the guard failed."""
        if self._guard is None:
            return self.txn(compare, success, failure)
        key, value = self._guard
        lease = {"key": _encode(key), "target": "VALUE", "result": "EQUAL", "value": _encode(value)}
        if not compare:
            answer = self.txn([lease], success)
            if not answer.get("succeeded"):
                raise LeadershipLost(f"the leader key {key!r} no longer holds this leader's lease")
            return answer
        # the guard first: an inner txn runs the caller's own compare only while we lead
        answer = self.txn(
            [lease], [{"request_txn": {"compare": compare, "success": success, "failure": failure or []}}]
        )
        if not answer.get("succeeded"):
            raise LeadershipLost(f"the leader key {key!r} no longer holds this leader's lease")
        return {**answer["responses"][0]["response_txn"], "header": answer["header"]}  # the inner one's is empty

    def confirm_guard(self) -> None:
        """Raises LeadershipLost unless the guard key still holds this store's value."""
        self._guarded([], [])

    def read(self, key: str) -> bytes | None:
        """The value under ``key``, or None while there is none: one request (check and get are two)."""
        rec = self.range(key)
        return None if rec is None else rec["value"]

    def range(self, key: str, revision: int = 0) -> dict | None:
        """The key's record (``value`` decoded, ``mod_revision``), or None when it does not exist."""
        return self.read_at(key, revision)[0]

    def read_at(self, key: str, revision: int = 0) -> tuple[dict | None, int]:
        """The key's record (see ``range``) and the cluster's revision it was read at."""
        body = {"key": _encode(key), **({"revision": revision} if revision else {})}
        answer = self.post("kv/range", body)
        kvs = answer.get("kvs", [])
        at = int(answer["header"]["revision"])
        if not kvs:
            return None, at
        return {"value": _decode(kvs[0].get("value", "")), "mod_revision": int(kvs[0]["mod_revision"])}, at

    def await_change(self, key: str, revision: int, seconds: float, deletes: bool = False) -> bytes | None:
        """Returns once ``key`` may have been written (or, with ``deletes``, deleted) after ``revision``
        (a watch saw it), after about ``seconds``, or at any error; the value a put wrote when the
        watch saw one (no read needed), None otherwise: the caller reads the key again. One watch
        stream on a connection of its own, so a blocking wait never holds the store's lock."""
        client = self._dial()[self._current]
        body: dict[str, dict[str, str | int | list[str]]] = {
            "create_request": {
                "key": _encode(key),
                "start_revision": revision + 1,
                "filters": ["NOPUT" if deletes else "NODELETE"],
            }
        }
        try:
            with requests.post(
                client.get_url("watch"),
                json=body,
                stream=True,
                headers=REQUIRE_LEADER,
                timeout=(REQUEST_S, max(seconds, 0.01)),
            ) as answer:
                for line in answer.iter_lines():
                    result = json.loads(line).get("result", {}) if line else {}
                    if result.get("canceled"):
                        return None
                    if events := result.get("events"):
                        return None if deletes else _decode(events[0]["kv"].get("value", ""))
        except (requests.RequestException, ValueError, KeyError, TypeError):
            return None
        return None

    def delete(self, keys: list[str], prefixes: list[str] | tuple[str, ...] = ()) -> None:
        """Deletes ``keys`` and every key under each of ``prefixes``, up to ``MAX_TXN_OPS`` of them
        in one transaction (one Raft entry, not one each)."""
        ops = [{"request_delete_range": {"key": _encode(k)}} for k in keys]
        ops += [{"request_delete_range": under(p)} for p in prefixes]
        for i in range(0, len(ops), MAX_TXN_OPS):
            self._guarded([], ops[i : i + MAX_TXN_OPS])

    def vote(
        self, tally: str, voter: str, decision: str, expected: int, undecided: bytes, outcome: bytes
    ) -> tuple[int, bytes | None]:
        """``voter``'s vote in one transaction (one Raft write): the ``tally`` key's version counts the
        votes. The last vote (the version at ``expected - 1``, ``voter`` not counted yet, ``decision``
        still ``undecided``: missing when empty) writes the tally, its voter key and ``outcome``
        together, so the decision costs no write of its own; any other vote writes the tally and its
        voter key only if that key is absent (a vote resent after a lost answer counts once, and
        cannot reach ``expected`` early). The votes counted and the decision after it (None: none)."""
        never_voted = _missing(voter)
        votes = [put_op(tally, b""), put_op(voter, b"")]
        reads = [{"request_range": {"key": _encode(tally)}}, {"request_range": {"key": _encode(decision)}}]
        last = {"key": _encode(tally), "target": "VERSION", "result": "EQUAL", "version": expected - 1}
        answer = self._guarded(
            [last, never_voted, _holds(decision, undecided)],
            [*votes, put_op(decision, outcome)],
            [{"request_txn": {"compare": [never_voted], "success": votes, "failure": []}}, *reads],
        )
        if answer.get("succeeded"):
            return expected, outcome
        counted, decided = (r["response_range"].get("kvs", []) for r in answer["responses"][1:])
        return (
            int(counted[0]["version"]) if counted else 0,
            _decode(decided[0].get("value", "")) if decided else None,
        )

    def decide_short(self, tally: str, decision: str, expected: int, undecided: bytes, outcome: bytes) -> bytes | None:
        """Writes ``outcome`` (an abort) only while ``decision`` is ``undecided`` and the ``tally`` of
        ``vote`` is below ``expected``: it can never overwrite, nor race past, the last vote's
        decision. The decision after the call (None: none)."""
        short = {"key": _encode(tally), "target": "VERSION", "result": "LESS", "version": expected}
        read = [{"request_range": {"key": _encode(decision)}}]
        answer = self._guarded([short, _holds(decision, undecided)], [put_op(decision, outcome)], read)
        if answer.get("succeeded"):
            return outcome
        kvs = answer["responses"][0]["response_range"].get("kvs", [])
        return _decode(kvs[0].get("value", "")) if kvs else None

    def version(self, key: str) -> int:
        """How many times ``key`` was written since it was created (0: missing): ``vote``'s count."""
        kvs = self.post("kv/range", {"key": _encode(key)}).get("kvs", [])
        return int(kvs[0]["version"]) if kvs else 0

    def members(self) -> list[dict]:
        return self.post(MEMBER_LIST, {}).get("members", [])

    def _follow(self) -> None:
        """``follow`` after a fail-over or ``FOLLOW_S``: a member list that does not come leaves the endpoints."""
        try:
            self.follow()
        except EtcdError as e:
            log.debug(f"etcd store: the members were not read ({e}); the endpoints stay {self.endpoints}")

    def follow(self) -> list[dict]:
        """Reads the members (returned; ``EtcdError`` where none answers) and dials their client addresses from
        now on, the member that answered first (a member added and not started yet has none), every store of the
        cluster in this process with it; a change is written to the node's file (``keys.ETCD_ENDPOINTS_ENV``)."""
        self._cluster.next_follow = time.monotonic() + FOLLOW_S
        answer = self.post(MEMBER_LIST, {})
        members = answer.get("members", [])
        listed = client_endpoints(members)
        if not listed or set(listed.values()) == set(self.endpoints):
            return members
        answering = str(answer.get("header", {}).get("member_id", ""))
        first = [e for id_, e in listed.items() if id_ == answering] or list(listed.values())[:1]
        endpoints = first + [e for e in listed.values() if e not in first]
        log.info(f"etcd store: the cluster's members moved: endpoints {endpoints} (were {self.endpoints})")
        self._adopt(endpoints)
        if path := os.environ.get(ETCD_ENDPOINTS_ENV):
            try:
                with open(f"{path}.{os.getpid()}", "w") as out:
                    json.dump(endpoints, out)
                os.replace(f"{path}.{os.getpid()}", path)
            except OSError as e:
                log.debug(f"etcd store: {path} not written ({e})")
        return members

    def _adopt(self, endpoints: list[tuple[str, int]]) -> None:
        with _CLUSTERS_LOCK:
            self._cluster.endpoints = endpoints
            self._cluster.version += 1

    def _reread(self) -> bool:
        """Where the node's file (``keys.ETCD_ENDPOINTS_ENV``) names other addresses than this process dials
        (what another process of the node read from the members since): adopts them, True."""
        path = os.environ.get(ETCD_ENDPOINTS_ENV)
        if not path:
            return False
        try:
            with open(path) as f:
                listed = json.load(f)
        except (OSError, ValueError):
            return False
        endpoints = [(e[0], e[1]) for e in listed if _endpoint(e)][:MAX_MEMBERS] if isinstance(listed, list) else []
        if not endpoints or set(endpoints) == set(self.endpoints):
            return False
        log.info(f"etcd store: no member it knew answered: endpoints {endpoints} from {path}")
        self._adopt(endpoints)
        return True

    def remove_member(self, member_id: str) -> None:
        """Removes member ``member_id`` from the cluster (a lost one): EtcdRefused where it is not a member."""
        self.post("cluster/member/remove", {"ID": member_id})

    def add_member(self, peer: str) -> str:
        """Adds a member whose peers reach it at ``peer``: its id. It counts in the quorum from now on, started
        or not: add one only where every other member answers (``policy.etcd_members``)."""
        return str(self.post("cluster/member/add", {"peerURLs": [peer]})["member"]["ID"])

    def grant(self, ttl_s: float) -> int:
        """A lease of ``ttl_s`` seconds: its id (a key put on it goes when it expires)."""
        return int(self.post("lease/grant", {"TTL": max(1, round(ttl_s))})["ID"])

    def keep_alive(self, lease: int) -> bool:
        """Renews ``lease``; False where it expired already."""
        answer = self.post("lease/keepalive", {"ID": lease})
        return int(answer.get("result", answer).get("TTL", 0)) > 0

    def put_on(self, key: str, value: bytes, lease: int) -> None:
        """``key`` set to ``value`` on ``lease``."""
        self._guarded([], [put_op(key, value, lease)])

    def revision(self) -> int:
        """The cluster's current revision (a linearizable read)."""
        return int(self.post("kv/range", {"key": _encode(MARKERS), "count_only": True})["header"]["revision"])

    def compact(self, revision: int) -> None:
        """Drops the history older than ``revision`` (every member frees those pages for reuse; the
        database file only shrinks on a defragmentation). A history compacted further already is left."""
        try:
            self.post("kv/compaction", {"revision": revision})
        except EtcdRefused as e:
            if "has been compacted" not in str(e):
                raise

    def db_size(self) -> tuple[int, int]:
        """The answering member's database file size and the bytes of it in use, in bytes."""
        status = self.post("maintenance/status", {})
        return int(status["dbSize"]), int(status["dbSizeInUse"])

    # ---- the torch.distributed.Store API --------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self._guarded([], [put_op(key, _b(value))])

    def get_within(self, key: str, seconds: float) -> bytes | None:
        """The value of ``key`` once it exists, or None after ``seconds``: read, and while missing,
        watched from the revision it was read at (no write in between is missed, no request is
        made while nothing happens, and the value comes with the watch's event)."""
        deadline = time.monotonic() + seconds
        while True:
            rec, revision = self.read_at(key)
            if rec is not None:
                return rec["value"]
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            value = self.await_change(key, revision, min(left, WATCH_S))
            if value is not None:
                return value

    def _until(self, key: str, limit: timedelta) -> bytes:
        """The value of ``key`` once it exists, within ``limit`` (``get_within``), or DistStoreError."""
        value = self.get_within(key, limit.total_seconds())
        if value is None:
            raise dist.DistStoreError(f"etcd store: key {key!r} did not appear within {limit.total_seconds():g}s")
        return value

    def get(self, key: str) -> bytes:
        """Blocks until ``key`` exists, like TCPStore (gloo's rendezvous relies on it)."""
        return self._until(key, self.timeout)

    def check(self, keys: list[str]) -> bool:
        return all(self.range(k) is not None for k in keys)

    def read_many(self, keys: list[str]) -> list[bytes | None]:
        """The values under ``keys``, None for a missing one: one request per ``MAX_TXN_OPS`` keys
        (etcd's default limit of operations in a transaction)."""
        values: list[list[dict]] = []
        for i in range(0, len(keys), MAX_TXN_OPS):
            answer = self.txn([], [{"request_range": {"key": _encode(k)}} for k in keys[i : i + MAX_TXN_OPS]])
            values += [r["response_range"].get("kvs", []) for r in answer.get("responses", [])]
        return [_decode(kvs[0].get("value", "")) if kvs else None for kvs in values]

    def read_under(self, prefix: str) -> dict[str, bytes]:
        """Every key under ``prefix`` and its value, in one request (for a few keys: a range is not paged)."""
        answer = self.post("kv/range", under(prefix))
        return {_decode(kv["key"]).decode(): _decode(kv.get("value", "")) for kv in answer.get("kvs", [])}

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """``read_many``, blocking for the missing keys like TCPStore."""
        values = self.read_many(keys)
        found = [v for v in values if v is not None]
        if len(found) == len(values):
            return found
        return [self.get(k) for k in keys]

    def add(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the integer under ``key`` (missing: 0) exactly once. One request when
        nobody else changed the key since this client last did (a transaction whose failure branch
        reads the key and this client's marker, so a retry needs no read of its own)."""
        if amount == 0:
            rec = self.range(key)
            return int(rec["value"]) if rec is not None else 0
        with self._add_lock:
            self._seq += 1
            seen = self._counters.pop(key, None)  # (value, mod_revision), or None: guessed missing
            while True:
                new = (seen[0] if seen is not None else 0) + amount
                same = (
                    {"key": _encode(key), "target": "MOD", "result": "EQUAL", "mod_revision": seen[1]}
                    if seen is not None
                    else _missing(key)
                )
                mark = f"{self._seq} {new}".encode()
                reads = [{"request_range": {"key": _encode(key)}}, {"request_range": {"key": _encode(self._marker)}}]
                try:
                    # a request resent to another member after its first one was applied fails ``same``: the marker says
                    # so
                    answer = self._guarded(
                        [same], [put_op(key, str(new).encode()), put_op(self._marker, mark, self._lease())], reads
                    )
                except EtcdRefused as e:
                    if "lease not found" not in str(e):
                        raise
                    self._marker_lease = None  # expired while this process was frozen: a fresh one
                    continue
                if answer.get("succeeded"):
                    self._remember(key, new, int(answer["header"]["revision"]))
                    return new
                current, marker = (r["response_range"].get("kvs", []) for r in answer["responses"])
                seq, _, written = (_decode(marker[0].get("value", "")) if marker else b"").decode().partition(" ")
                if seq == str(self._seq):  # applied, its answer lost: what it wrote
                    return int(written)
                seen = (int(_decode(current[0].get("value", ""))), int(current[0]["mod_revision"])) if current else None

    def _remember(self, key: str, value: int, revision: int) -> None:
        """Keeps what this client wrote to a counter, for its next add; the oldest are dropped past
        ``MAX_COUNTERS`` (a step's vote counter is used once)."""
        self._counters[key] = (value, revision)
        while len(self._counters) > MAX_COUNTERS:
            del self._counters[next(iter(self._counters))]

    def _lease(self) -> int:
        """The lease of this client's marker: one that outlives any lookup of the marker after a
        lost answer (within two requests' timeouts), granted anew once that is no longer sure."""
        need = 2 * self.timeout.total_seconds()
        now = time.monotonic()
        if self._marker_lease is None or now + need > self._marker_lease[1]:
            ttl = max(MARKER_TTL_S, 2 * need)
            self._marker_lease = (int(self.post("lease/grant", {"TTL": round(ttl)})["ID"]), now + ttl)
        return self._marker_lease[0]

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """TCPStore's semantics: ``desired`` is set if the key holds ``expected`` (or is missing and
        ``expected`` is empty); returns the value after the call (``expected`` if missing otherwise)."""
        expected, desired = _b(expected), _b(desired)
        holds = {"key": _encode(key), "target": "VALUE", "result": "EQUAL", "value": _encode(expected)}
        read = [{"request_range": {"key": _encode(key)}}]
        if expected:
            answer = self._guarded([holds], [put_op(key, desired)], read)
        else:  # missing, or holding "" (etcd's value compare fails on a missing key): two tries in one txn
            missing = _missing(key)
            answer = self._guarded(
                [missing],
                [put_op(key, desired)],
                [{"request_txn": {"compare": [holds], "success": [put_op(key, desired)], "failure": read}}],
            )
            if not answer.get("succeeded"):
                answer = answer["responses"][0]["response_txn"]
        if answer.get("succeeded"):
            return desired
        kvs = answer["responses"][0]["response_range"].get("kvs", [])
        return _decode(kvs[0].get("value", "")) if kvs else expected

    def delete_key(self, key: str) -> bool:
        answer = self._guarded([], [{"request_delete_range": {"key": _encode(key)}}])
        return int(answer["responses"][0]["response_delete_range"].get("deleted", 0)) > 0

    deleteKey = delete_key  # the name torch's C++ side calls

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.timeout).total_seconds()
        for key in keys:
            try:
                self._until(key, timedelta(seconds=max(0.0, deadline - time.monotonic())))
            except dist.DistStoreError:
                raise dist.DistStoreError(
                    f"etcd store: keys {keys} did not all appear within {(timeout or self.timeout).total_seconds():g}s"
                ) from None

    def clone(self) -> EtcdStore:
        """Itself: every call is one short request under the lock, so a blocking ``get`` in one
        thread never holds up another's calls (and the C++ side keeps no clone's Python object alive)."""
        return self


class Changes:
    """Puts under ``prefix`` as a wake-up: one watch stream, held by a thread, instead of reading
    keys in a loop to find whether any changed. ``wait`` returns at the first put since its last
    call (one whose key, after ``prefix``, starts with none of ``ignore``) or after ``timeout_s``,
    with the keys put meanwhile, so the caller reads only those. A broken watch is made again
    from the last revision it saw, and its ``wait`` answers None (anything may have changed):
    the caller reads everything, so a missed event costs at most one timeout."""

    def __init__(self, store: EtcdStore, prefix: str, ignore: tuple[str, ...] = ()) -> None:
        self.store, self.prefix, self.ignore = store, prefix, ignore
        self._changed, self._stop = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        # put since the last ``wait``, after the prefix; None: unknown (at first too)
        self._keys: set[str] | None = None
        self._values: dict[str, bytes] = {}  # the value each key's latest put since the last ``wait`` wrote
        self._seen: dict[str, bytes] = {}  # ... as ``wait`` last took them (``value``): none kept longer
        self._thread = threading.Thread(target=self._run, name="titan-recover-changes", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body: dict = {**under(self.prefix), "filters": ["NODELETE"]}
        revision = 0
        while not self._stop.is_set():
            try:
                revision = revision or self.store.revision()
                client = self.store._dial()[self.store._current]
                request = {"create_request": {**body, "start_revision": revision + 1}}
                with requests.post(
                    client.get_url("watch"),
                    json=request,
                    stream=True,
                    headers=REQUIRE_LEADER,
                    timeout=(REQUEST_S, WATCH_S),
                ) as answer:
                    for line in answer.iter_lines():
                        result = json.loads(line).get("result", {}) if line else {}
                        if result.get("canceled") or self._stop.is_set():
                            break
                        for event in result.get("events", []):
                            revision = int(event["kv"]["mod_revision"])
                            key = _decode(event["kv"]["key"]).decode(errors="replace")[len(self.prefix) :]
                            if not key.startswith(self.ignore):
                                self._put(key, _decode(event["kv"].get("value", "")))
            except (requests.RequestException, ValueError, KeyError, EtcdError):
                pass
            self._put(None)  # the watch ended (a silent member, an error, a compaction): read everything once
            revision = 0  # from now on (a linearizable read fails over to a member in the quorum)
            self._stop.wait(0.1)

    def _put(self, key: str | None, value: bytes = b"") -> None:
        with self._lock:
            if key is None or self._keys is None:
                self._keys = None
            else:
                self._keys.add(key)
            if key is not None:
                self._values[key] = value
            self._changed.set()

    def value(self, key: str) -> bytes | None:
        """What the latest put of ``key`` (after the prefix) before the last ``wait`` wrote (None: none)."""
        with self._lock:
            return self._seen.get(key)

    def wait(self, timeout_s: float) -> set[str] | None:
        """The keys (after the prefix) put before ``timeout_s`` passed, empty when none was;
        None when the watch broke meanwhile and any key may have changed."""
        self._changed.wait(timeout_s)
        with self._lock:
            keys, self._keys = self._keys, set()
            self._seen, self._values = self._values, {}
            self._changed.clear()
        return keys

    def close(self) -> None:
        self._stop.set()


def client_endpoints(members: list) -> dict[str, tuple[str, int]]:
    """Each member's first client address (id -> (host, port)), from a member list: the started members, at
    most ``MAX_MEMBERS``; entries that are not well-formed are left out."""
    found: dict[str, tuple[str, int]] = {}
    for member in members[:MAX_MEMBERS] if isinstance(members, list) else []:
        urls = member.get("clientURLs") if isinstance(member, dict) else None
        if not isinstance(urls, list) or not urls or not isinstance(urls[0], str):
            continue
        try:
            parsed = urllib.parse.urlsplit(urls[0])
            host, port = parsed.hostname, parsed.port
        except ValueError:
            continue
        if parsed.scheme == "http" and host and port:
            found[str(member.get("ID", ""))] = (host, port)
    return found


def _endpoint(entry: object) -> bool:
    """Whether an entry of the node's file is a ``[host, port]`` pair."""
    return (
        isinstance(entry, list)
        and len(entry) == 2
        and isinstance(entry[0], str)
        and isinstance(entry[1], int)
        and 0 < entry[1] < 65536
    )


def _refusal(e: Etcd3Exception) -> str | None:
    """etcd's message when ``e`` is the cluster refusing the request itself (see ``REFUSED_CODES``)."""
    try:
        answer = json.loads(e.detail_text or "")
    except ValueError:
        return None
    return str(answer.get("message", "")) if isinstance(answer, dict) and answer.get("code") in REFUSED_CODES else None


def under(prefix: str) -> dict:
    """The key range of every key starting with ``prefix``, as etcd's JSON gateway takes it."""
    start = _b(prefix)
    return {"key": _encode(start), "range_end": _encode(start[:-1] + bytes([start[-1] + 1]))}


def _missing(key: str) -> dict:
    """A transaction's compare: ``key`` does not exist."""
    return {"key": _encode(key), "target": "CREATE", "result": "EQUAL", "create_revision": 0}


def _holds(key: str, value: bytes) -> dict:
    """A transaction's compare: ``key`` holds ``value``, or is missing when ``value`` is empty."""
    if not value:
        return _missing(key)
    return {"key": _encode(key), "target": "VALUE", "result": "EQUAL", "value": _encode(value)}


def put_op(key: str, value: bytes, lease: int = 0) -> dict:
    """A transaction's put, as etcd's JSON gateway takes it (base64 key and value)."""
    return {"request_put": {"key": _encode(key), "value": _encode(value), **({"lease": lease} if lease else {})}}


def check_cluster(url: str, timeout_s: float) -> str:
    """The cluster behind ``url`` checked before anything starts: reachable, and with at least
    ``MIN_MEMBERS`` members; a line describing it. ``ValueError`` naming the problem otherwise."""
    endpoints = parse_etcd_url(url)
    probe = EtcdStore(endpoints, timeout_s)
    try:
        members = probe.members()
        probe.range("titan_recover/probe")  # a linearizable read: the cluster has a leader and a quorum
    except (EtcdUnavailable, InternalServerError) as e:
        raise ValueError(
            f"cannot reach the etcd cluster at {url}: {e}; is etcd running, and are those its client addresses?"
        ) from None
    if len(members) < MIN_MEMBERS:
        raise ValueError(
            f"the etcd cluster at {url} has {len(members)} member(s); coordinator fail-over needs at "
            f"least {MIN_MEMBERS} (a majority must survive the loss of one): add members"
        )
    return f"etcd cluster at {url}: {len(members)} members"
