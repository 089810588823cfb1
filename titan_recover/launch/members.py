"""A control plane the run forms on its own nodes: ``[recover] control_store = "nodes://h1,h2,h3"``.

The launcher on each host of the list runs one etcd member, and the members bootstrap one cluster at the
start (``--initial-cluster`` is the list, the token the run's id): nobody runs etcd off the compute nodes,
and no node is special, since a majority of the members (2 of 3, 3 of 5) carries the run through the loss of
any node. Every process then uses the cluster as ``etcd://h1:2379,h2:2379,h3:2379``, exactly as an etcd the
user runs (``launch.stores.Etcd``): the launcher rewrites ``recover.control_store`` before anything starts.

A member lives as long as its launcher (``die_with_parent``), its data in this host's temporary folder under
the run's id and its set of members: the same node started again with the same id and members (a relaunched
launcher, a job requeued onto the same nodes) restarts its member from that data and it catches up with the
others; other members (a job requeued elsewhere) form a cluster of their own. The etcd binaries come from
``PATH``, as for ``tools.etcd_local``: Debian's 3.4.23, or 3.5.4 and later (3.5.0-3.5.3 carry
etcd-io/etcd#13766, data lost by a member SIGKILLed with its node, which is what a node loss does to a member
here).
"""

import contextlib
import hashlib
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from titan_recover import config
from titan_recover.control import keys, transport
from titan_recover.control.addresses import ETCD_SCHEME, NODES_SCHEME, parse_nodes_url, resolve
from titan_recover.control.etcd_process import CTL_TIMEOUT_S, member_command, release, unavailable
from titan_recover.node.procs import die_with_parent, stop_within
from titan_recover.policy import etcd_members

SERVE_POLL_S = 0.5  # how often a launcher asks whether the members serve yet
SAY_EVERY_S = 10.0  # how often it says it still waits
LINGER_S = 15.0  # how long a member may outlive its launcher's end while the run's leader still holds its lease
LISTED_S = 5.0  # how long a starting member host asks the members that listen for the cluster's members
LISTED_PROBE_S = 1.0  # one member's connect, and its answer
log = logging.getLogger(__name__)


def bindable(ip: str) -> bool:
    """Whether ``ip`` is one of this host's addresses (a socket can listen on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class Members:
    """The members a ``nodes://`` URL names: member i (``m<i>``) on ``hosts[i]`` (``ips[i]``), clients on
    ``ports[i]``, peers on the port after it."""

    hosts: tuple[str, ...]
    ips: tuple[str, ...]
    ports: tuple[int, ...]

    @classmethod
    def of(cls, url: str, lookup: Callable[[str], str] = resolve) -> "Members":
        """ValueError naming what is wrong with ``url`` (a host that does not resolve too)."""
        listed = parse_nodes_url(url)
        return cls(tuple(h for h, _ in listed), tuple(lookup(h) for h, _ in listed), tuple(p for _, p in listed))

    @property
    def nodes_url(self) -> str:
        """The ``nodes://`` URL of these members, every port given."""
        return NODES_SCHEME + ",".join(f"{h}:{p}" for h, p in zip(self.hosts, self.ports))

    @property
    def etcd_url(self) -> str:
        """What every process of the run dials: ``etcd://host:port,...``."""
        return ETCD_SCHEME + ",".join(f"{h}:{p}" for h, p in zip(self.hosts, self.ports))

    def client(self, i: int) -> str:
        return f"http://{self.ips[i]}:{self.ports[i]}"

    def peer(self, i: int) -> str:
        return f"http://{self.ips[i]}:{self.ports[i] + 1}"

    @property
    def cluster(self) -> str:
        return ",".join(f"m{i}={self.peer(i)}" for i in range(len(self.hosts)))

    @property
    def digest(self) -> str:
        """A short name of this set of members: a member's data and token are those of its set's cluster."""
        return hashlib.sha256(self.cluster.encode()).hexdigest()[:8]

    def here(self, local: Callable[[str], bool] = bindable) -> int | None:
        """Which member this host runs (its address among the list), or None."""
        return next((i for i, ip in enumerate(self.ips) if local(ip)), None)


def data_dir(run_id: str, members: Members, member: int) -> str:
    """Member ``member``'s data on this host: kept across the launcher's restarts for the same run id and the same
    members. A run requeued onto other nodes forms a new cluster: a member's data names its old peers, and would
    never reach a quorum of the new ones."""
    return os.path.join(tempfile.gettempdir(), "titan_recover-etcd", run_id, members.digest, f"m{member}")


def endpoints_file(run_id: str, members: Members) -> str:
    """Where this node's processes keep the members' addresses they last read (``keys.ETCD_ENDPOINTS_ENV``): a
    process that slept through the loss of every member it knew dials those."""
    return os.path.join(tempfile.gettempdir(), f"titan_recover-etcd-{run_id}-{members.digest}.json")


@dataclass(frozen=True)
class Member:
    """This host's etcd member: its name, process, data folder and client address (``http://ip:port``)."""

    name: str
    proc: subprocess.Popen
    folder: str
    client: str


def form(url: str, environ: Mapping[str, str], dump: str, timeout_s: float) -> tuple[str, Member | None]:
    """Starts this host's member of ``nodes://`` ``url`` (if it names this host) and waits, at most ``timeout_s``
    (``startup_timeout_s``), until the members serve: the ``etcd://`` URL of the cluster and the member's
    process (None on a host without one). ``config.ConfigError`` naming the problem."""
    run_id = environ.get(keys.RUN_ENV, "")
    if not run_id:
        raise config.ConfigError(
            f"recover.control_store = {url!r} needs {keys.RUN_ENV}, the same on every node (the job's id): its "
            "members' cluster is the run's"
        )
    members = resolved(url, timeout_s)
    mine, member = members.here(), None
    if mine is not None:
        if (why := unavailable()) is not None:
            raise config.ConfigError(f"recover.control_store = {url!r} runs an etcd member on this node: {why}")
        folder = data_dir(run_id, members, mine)
        kept = os.path.isdir(folder)
        if etcd_members.volunteers_instead(listed(members, mine), members.peer(mine), kept):
            log.warning(
                f"etcd member m{mine} of {url} ran on this node before, and the run's etcd "
                + ("removed it" if kept else "goes on without it, its data gone with the node")
                + ": this node volunteers, and the run's keepers add it back as a new member"
            )
            shutil.rmtree(folder, ignore_errors=True)
            mine = None
    if mine is not None:
        token = f"titan_recover-{run_id}-{members.digest}"
        member = start(f"m{mine}", members.client(mine), members.peer(mine), folder, members.cluster, dump, token)
        log.info(
            f"etcd member m{mine} of {url} started here (pid {member.proc.pid}, {release()}, data in {folder}"
            + (", kept from this run's earlier start" if kept else "")
            + ")"
        )
    wait_serving(members.etcd_url, None if member is None else member.proc, timeout_s)
    return members.etcd_url, member


def resolved(url: str, timeout_s: float, lookup: Callable[[str], str] = resolve) -> Members:
    """The members ``url`` names, each host resolved. A host that does not resolve yet is looked up again, at most
    ``timeout_s``: a pod's name (Kubernetes' headless Service) exists only once its pod does, and a Job's pods
    start in any order. ``config.ConfigError`` at once for a malformed URL, after the bound naming the host."""
    try:
        parse_nodes_url(url)
    except ValueError as e:
        raise config.ConfigError(f"recover.control_store: {e}") from None
    start = said = time.monotonic()
    while True:
        try:
            return Members.of(url, lookup)
        except ValueError as e:
            why = str(e)
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise config.ConfigError(
                f"recover.control_store = {url!r}: {why} after {timeout_s:g}s (recover.startup_timeout_s): name "
                "each member node by a name every node resolves once that node is up"
            )
        if time.monotonic() - said > SAY_EVERY_S:
            said = time.monotonic()
            log.info(f"waiting for the etcd member nodes' names to resolve ({waited:.0f}s): {why}")
        time.sleep(SERVE_POLL_S)


def listed(members: Members, mine: int, timeout_s: float = LISTED_S) -> dict[str, bool] | None:
    """The run's cluster's members as another host's member lists them (peer address: whether it ever started,
    that is published its client address), or None where no other member listens (the run's first start: they
    start with this one) or none that listens answers within ``timeout_s``."""
    from etcd3gw.client import Etcd3Client  # the etcd extra: a nodes:// run has it
    from etcd3gw.exceptions import Etcd3Exception

    deadline = time.monotonic() + timeout_s
    while True:
        listening = False
        for i in (i for i in range(len(members.hosts)) if i != mine):
            try:
                socket.create_connection((members.ips[i], members.ports[i]), timeout=LISTED_PROBE_S).close()
            except OSError:
                continue
            listening = True
            client = Etcd3Client(members.ips[i], members.ports[i], timeout=LISTED_PROBE_S, api_path="/v3/")
            try:
                answer = client.post(client.get_url("cluster/member/list"), json={})
            except (Etcd3Exception, OSError, ValueError) as e:  # asked again below
                log.debug(f"m{i} did not list the members: {type(e).__name__}: {e}")
                continue
            found = answer.get("members") if isinstance(answer, dict) else None
            if not isinstance(found, list) or not all(isinstance(m, dict) for m in found):
                log.warning(f"m{i} listed the members in a form not etcd's: {str(answer)[:200]}")
                continue
            return {_first(m.get("peerURLs")): bool(_first(m.get("clientURLs"))) for m in found}
        if not listening:
            return None
        if time.monotonic() > deadline:
            log.warning(f"the run's etcd members listen but did not list themselves within {timeout_s:g}s")
            return None
        time.sleep(SERVE_POLL_S)


def _first(urls: object) -> str:
    return str(urls[0]) if isinstance(urls, list) and urls else ""


def start(name: str, client: str, peer: str, folder: str, cluster: str, dump: str, token: str = "") -> Member:
    """Member ``name``'s etcd started on this host, logging to ``dump``/etcd.<name>.log: a member of a new
    cluster (``token`` its name), or, without a token, one added to the running cluster (``Keeper``)."""
    os.makedirs(dump, exist_ok=True)
    state = "new" if token else "existing"
    with open(os.path.join(dump, f"etcd.{name}.log"), "ab") as out:
        argv = member_command(name, client, peer, folder, cluster, token or name, state)
        proc = subprocess.Popen(argv, stdout=out, stderr=out, preexec_fn=die_with_parent)
    return Member(name, proc, folder, client)


def wait_serving(url: str, member: subprocess.Popen | None, timeout_s: float) -> None:
    """Returns once the cluster at ``url`` answers a linearizable read (a leader and a quorum: the other nodes'
    launchers started their members); ``config.ConfigError`` after ``timeout_s`` or if this host's member exits."""
    from titan_recover.launch.stores import check_control_store

    start = said = time.monotonic()
    while True:
        try:
            check_control_store(url)  # the launcher's own check says what it found
            return
        except config.ConfigError as e:
            why = str(e)
        if member is not None and member.poll() is not None:
            raise config.ConfigError(f"this node's etcd member exited with {member.returncode}: see its log; {why}")
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise config.ConfigError(
                f"the etcd members of the run did not serve within recover.startup_timeout_s = {timeout_s:g}s "
                f"({why}): start the launchers of the nodes the control store names"
            )
        if time.monotonic() - said > SAY_EVERY_S:
            said = time.monotonic()
            log.info(f"waiting for the run's etcd members ({waited:.0f}s): {why}")
        time.sleep(SERVE_POLL_S)


def linger(member: Member, leader_key: str, bound_s: float = LINGER_S) -> None:
    """At its launcher's end, this node's member serves on while the run's leader holds its lease (at most
    ``bound_s``, read through the member itself: the members the run began with may be gone): the leader resigns
    last, after its final writes, and the members of the launchers that end first must not take its quorum away.
    Returns at once where the cluster does not answer."""
    if member.proc.poll() is not None:
        return
    deadline = time.monotonic() + bound_s
    try:
        store = transport.etcd(ETCD_SCHEME + member.client.removeprefix("http://"), 2.0)
        while store.read(leader_key) and time.monotonic() < deadline:
            time.sleep(SERVE_POLL_S)
    except Exception as e:  # no quorum (the other members' launchers ended first), or no answer: nothing to serve
        log.debug(f"this node's etcd member stops with its launcher ({type(e).__name__}: {e})")


def retire(member: Member) -> None:
    """At the end of a run that finished, this node's member stops and its data goes (a few tens of MB, its write-
    ahead log preallocated): nothing reads a finished run's keys, and the same command again starts a new run, as
    on a TCPStore. A run that stopped in order or failed keeps it for the same command to go on from."""
    member.proc.terminate()
    stop_within(member.proc, CTL_TIMEOUT_S)
    shutil.rmtree(member.folder, ignore_errors=True)
    members = os.path.dirname(member.folder)
    for folder in (members, os.path.dirname(members)):  # the members' and the run's folders, where empty now
        with contextlib.suppress(OSError):
            os.rmdir(folder)
