"""Keeping the etcd a run forms on its nodes whole (``nodes://``, ``launch.members``): each launcher's keeper
thread, imported only where the run forms one (it needs the ``etcd`` extra's client)."""

import json
import logging
import shutil
import threading
import time
import urllib.parse

from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import Etcd3Exception

from titan_recover.control import keys
from titan_recover.control.addresses import parse_etcd_url, route_address
from titan_recover.control.etcd_store import MAX_MEMBERS, EtcdError, EtcdStore
from titan_recover.launch.members import Member, Members, data_dir, start
from titan_recover.policy import etcd_members

KEEP_S = 2.0  # how often a keeper looks at the members, a volunteer at its offer
PROBE_S = 1.0  # one member's status request
REQUEST_BOUND_S = 5.0  # a keeper's request to the cluster, fail-over included
VOLUNTEER_TTL_S = 15.0  # an offer outlives its node by this
PREFIX = "titan_recover/etcd"  # the keepers' keys: the cluster is this run's alone (its token names the run)
FORMED_KEY = f"{PREFIX}/nodes"  # the nodes:// URL the run's etcd was formed from, read by a node that joins it
RECHECK_S = 30.0  # how often a node that does not offer looks whether it should
MAX_VOLUNTEERS = 4  # nodes that offer at once: a member lost needs one, and keepers read every offer each pass
log = logging.getLogger(__name__)


class Keeper(threading.Thread):
    """This node's part in keeping the run's etcd whole when nodes are lost (``policy.etcd_members``).

    On a node with a member, every ``KEEP_S``: the members listed, each one's client address asked for its status,
    and the keeper of the lowest live member removes a member silent for ``after_s``, then adds a volunteer in
    its place and tells it so. On a node without one: it volunteers (at most ``MAX_VOLUNTEERS`` nodes at once,
    each on a lease: a node gone leaves no offer) and, told it was added, starts its member from an empty folder;
    it catches up from the live members, and this node keeps from then on. A node whose member exits (removed
    while cut off, or failed) removes its data and volunteers again. Nothing here stops the run: an answer that
    does not come is asked for again next pass."""

    def __init__(self, url: str, spec: Members, run_id: str, dump: str, member: Member | None, after_s: float) -> None:
        super().__init__(name="titan-recover-etcd-keeper", daemon=True)
        self.spec, self.run_id, self.dump = spec, run_id, dump
        self.prefix = PREFIX
        self.member = member  # read by the launcher at its end (``linger``, ``retire``)
        self.store = EtcdStore(parse_etcd_url(url), REQUEST_BOUND_S)  # this thread's own client
        self.keeping = etcd_members.Keeping(len(spec.hosts), after_s)
        self.halt = threading.Event()
        self.probes: dict[str, Etcd3Client] = {}
        self.lease: int | None = None
        self.next_offer = 0.0  # when a node that does not offer (enough do) looks again
        self.said = ""  # the last problem logged (each said once)
        self.published = False  # whether FORMED_KEY was written by this keeper
        ip = route_address(f"{spec.ips[0]}:{spec.ports[0]}")
        self.me = etcd_members.Volunteer(ip, f"http://{ip}:{spec.ports[0] + 1}")
        self.client = f"http://{ip}:{spec.ports[0]}"

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=2 * REQUEST_BOUND_S)

    def run(self) -> None:
        while not self.halt.wait(KEEP_S):
            try:
                if not self.published:
                    self.store.set(FORMED_KEY, self.spec.nodes_url)
                    self.published = True
                if self.member is not None and self.member.proc.poll() is not None:
                    self._lost_own()
                if self.member is not None:
                    self._keep()
                else:
                    self._volunteer()
            except (EtcdError, Etcd3Exception, OSError, ValueError, KeyError, TypeError) as e:
                if str(e) != self.said:
                    self.said = str(e)
                    log.info(f"etcd keeper: {type(e).__name__}: {e} (asked again in {KEEP_S:g}s)")

    def _answers(self, url: str) -> bool:
        """Whether the member at client address ``url`` answers a status request within ``PROBE_S``."""
        parsed = urllib.parse.urlsplit(url)
        if parsed.hostname is None or parsed.port is None:
            return False
        client = self.probes.setdefault(
            url, Etcd3Client(parsed.hostname, parsed.port, timeout=PROBE_S, api_path="/v3/")
        )
        try:
            client.status()
        except (Etcd3Exception, OSError):
            return False
        return True

    def _keep(self) -> None:
        assert self.member is not None
        seen = []
        for m in self.store.follow()[:MAX_MEMBERS]:  # every pass: the node's file stays current for its ranks
            peers, clients, name = m.get("peerURLs") or [""], m.get("clientURLs") or [], str(m.get("name", ""))
            answers = bool(name and clients) and self._answers(str(clients[0]))
            seen.append(etcd_members.Seen(str(m["ID"]), name, str(peers[0]), answers))
        offered = [v for raw in self.store.read_under(keys.etcd_volunteers(self.prefix)).values() if (v := offer(raw))]
        change = self.keeping.decide(seen, offered, self.member.name, time.monotonic())
        if isinstance(change, etcd_members.Remove):
            lost = change.member
            self.store.remove_member(lost.id)
            log.warning(
                f"etcd member {lost.name or '(added, never started)'} at {lost.peer} silent for "
                f"{change.silent_s:.0f}s: removed from the run's etcd ({len(seen) - 1} members left)"
            )
        elif isinstance(change, etcd_members.Add):
            self.store.add_member(change.volunteer.peer)
            told = {"name": change.name, "cluster": change.cluster}
            self.store.set(keys.etcd_assigned(self.prefix, change.volunteer.host), json.dumps(told))
            log.warning(f"etcd member {change.name} added on {change.volunteer.host}, which starts it")

    def _volunteer(self) -> None:
        if self.lease is None and time.monotonic() < self.next_offer:
            return
        raw = self.store.read(keys.etcd_assigned(self.prefix, self.me.host))
        if raw is not None:
            self._join(json.loads(raw))
            return
        if self.lease is not None and self.store.keep_alive(self.lease):
            return
        self.lease = None
        if len(self.store.read_under(keys.etcd_volunteers(self.prefix))) >= MAX_VOLUNTEERS:
            self.next_offer = time.monotonic() + RECHECK_S  # enough nodes offer: a thousand nodes ask rarely
            return
        lease = self.store.grant(VOLUNTEER_TTL_S)
        mine = json.dumps({"host": self.me.host, "peer": self.me.peer}).encode()
        self.store.put_on(keys.etcd_volunteers(self.prefix) + self.me.host, mine, lease)
        self.lease = lease

    def _join(self, told: object) -> None:
        """Starts the member this node was added as (``told``: its name and ``--initial-cluster``)."""
        if not (isinstance(told, dict) and isinstance(told.get("name"), str) and isinstance(told.get("cluster"), str)):
            raise ValueError(f"a malformed etcd member assignment for {self.me.host}: {told!r}")
        name, cluster = told["name"], told["cluster"]
        if etcd_members.index_of(name) < 0 or f"{name}={self.me.peer}" not in cluster.split(","):
            raise ValueError(f"an etcd member assignment for {self.me.host} that does not name it: {told!r}")
        folder = data_dir(self.run_id, self.spec, etcd_members.index_of(name))
        shutil.rmtree(folder, ignore_errors=True)  # a member added joins empty, its data sent by the leader
        member = start(name, self.client, self.me.peer, folder, cluster, self.dump)
        log.warning(f"etcd member {name} starts on this node (pid {member.proc.pid}), in the run's etcd")
        self.member = member
        self.store.delete_key(keys.etcd_assigned(self.prefix, self.me.host))
        self.store.delete_key(keys.etcd_volunteers(self.prefix) + self.me.host)
        self.lease = None

    def _lost_own(self) -> None:
        assert self.member is not None
        log.warning(
            f"this node's etcd member {self.member.name} exited ({self.member.proc.returncode}; removed from the "
            f"run's etcd while cut off, or failed: its log in {self.dump}): its data goes, and this node volunteers"
        )
        shutil.rmtree(self.member.folder, ignore_errors=True)
        self.member = None


def offer(raw: bytes) -> etcd_members.Volunteer | None:
    """A volunteer's offer as its node wrote it, or None where it is not one (left out, not fatal)."""
    try:
        told = json.loads(raw)
    except ValueError:
        return None
    if isinstance(told, dict) and isinstance(told.get("host"), str) and isinstance(told.get("peer"), str):
        return etcd_members.Volunteer(told["host"], told["peer"])
    return None


def joining(url: str, run_id: str, dump: str, after_s: float) -> Keeper | None:
    """On a node that joins a run by its ``etcd://`` ``url`` (a replacement job's ``JOIN_RUN``), where the run formed
    that etcd on its nodes (its keepers wrote ``FORMED_KEY``): a keeper that volunteers, so the node takes the place
    of a member lost with its node (on three nodes, the only way back to three members). None on an etcd the user
    runs, which the run never changes."""
    try:
        raw = EtcdStore(parse_etcd_url(url), REQUEST_BOUND_S).read(FORMED_KEY)
    except (EtcdError, Etcd3Exception, OSError) as e:
        log.warning(
            f"the run's etcd did not say whether it was formed on the run's nodes ({type(e).__name__}: {e}): "
            "this node joins without volunteering for an etcd member"
        )
        return None
    if raw is None:
        return None
    formed = raw.decode(errors="replace")
    try:
        spec = Members.of(formed)
    except ValueError as e:
        log.warning(
            f"the run's etcd names the nodes it was formed on as {formed[:200]!r} ({e}): this node joins "
            "without volunteering for an etcd member"
        )
        return None
    return Keeper(url, spec, run_id, dump, None, after_s)
