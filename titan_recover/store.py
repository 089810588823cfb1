"""Process plumbing for the coordinator's state: torch's TCPStore, JSON values only.

Every key titan_recover uses is named here. Values are JSON (never pickle) so a
peer's bytes can never run code; a value that does not decode to the expected
shape raises ``MessageError`` naming the key.
"""

import json
import os
import re
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

COORDINATOR_ENV = "TITAN_RECOVER_COORDINATOR"  # host:port of the coordinator's store
REPLICA_ENV = "TITAN_RECOVER_REPLICA"  # this process's replica group id
REPLICAS_ENV = "TITAN_RECOVER_REPLICAS"  # comma-separated replica group ids a node's launcher runs
GROUP_NODE_ENV = "TITAN_RECOVER_GROUP_NODE"  # which of the recover.group_nodes parts of its groups a node runs
SECRET_ENV = "TITAN_RECOVER_SECRET"  # this run's secret: every key of the run is stored under it
HELLO = "hello"  # the coordinator sets it on start: a client that cannot read it is not in this run
HELLO_WAIT_S = 10.0  # how long a client waits for it (the coordinator sets it right after listening)

EPOCH = "epoch"
REPORTS = "reports"
FATAL = "fatal"
STATUS = "status"
START_STEP = "start_step"  # the step the run resumed from (0, or a DCP checkpoint's): records start after it
ALIVE = "coordinator/alive"  # the coordinator bumps it every pass: a frozen coordinator stops it
COORDINATOR_STATE = "coordinator/state"  # what a new coordinator leader restores (``coordinator.read_state``)
PROBE_S = 0.5  # how often a lifeline reads ALIVE; the coordinator lingers longer than that at the end
REPLICATE_BACKEND = "replicate_backend"  # "gloo" or "nccl": the first rank sets it, every other must match
ATTEMPT_ENV = "TITAN_RECOVER_ATTEMPT"  # incarnation of this replica group: 0, then +1 per restart


def attempt() -> int:
    """This process's incarnation of its replica group (counted in the store: ``incarnation_key``)."""
    return int(os.environ.get(ATTEMPT_ENV, "0"))


def members_key(epoch: int) -> str:
    return f"members/{epoch}"


def leader_key(secret: str) -> str:
    """The etcd key of the run's coordinator leader (its lease's), outside the run's ``PrefixStore``:
    the guard of every leader write compares it as stored."""
    return f"run/{secret}/coordinator/leader"


def ok_key(step: int, epoch: int) -> str:
    return f"ok/{step}/{epoch}"


def decision_key(step: int, epoch: int) -> str:
    return f"decision/{step}/{epoch}"


def report_key(index: int) -> str:
    return f"report/{index}"


def step_key(step: int) -> str:
    """The record of committed ``step``: the first member to commit it writes it, the coordinator logs it."""
    return f"step/{step}"


def fault_key(replica: int) -> str:
    return f"fault/{replica}"


def admitted_key(replica: int, attempt: int) -> str:
    """{"attempt", "epoch"}: the coordinator's answer to that incarnation's ranks being ready to
    join (their node agents say so); it comes with a new epoch, which is when a joiner looks."""
    return f"admitted/{replica}/{attempt}"


def fenced_key(replica: int) -> str:
    """{"attempt", "epoch"}: that incarnation is out; its launcher kills what is left of it."""
    return f"fenced/{replica}"


def owner_key(replica: int, part: int = 0) -> str:
    """{"launcher", "host", "pid"}: the launcher that runs this replica group (``claims``), or
    part ``part`` of it when a group spans nodes."""
    return f"owner/{replica}" if part == 0 else f"owner/{replica}/{part}"


def joined_key(replica: int, part: int) -> str:
    """An integer: the incarnation of ``replica`` that its part ``part`` last started, so a
    launcher taking that part over never joins an incarnation its dead predecessor was part of."""
    return f"joined/{replica}/{part}"


def rendezvous_key(replica: int) -> str:
    """{"attempt", "host", "port"}: where the torchrun of this group's current incarnation meets,
    when the group spans nodes; written by the launcher of part 0 at each start (``read_rendezvous``)."""
    return f"rendezvous/{replica}"


def read_rendezvous(client: dist.TCPStore, replica: int) -> dict[str, Any] | None:
    """Part 0's rendezvous record of ``replica``, checked field by field (None before the first)."""
    key = rendezvous_key(replica)
    if not client.check([key]):
        return None
    rec = get_json(client, key, ("attempt", "host", "port"))
    if not (is_int(rec["attempt"]) and rec["attempt"] >= 0 and isinstance(rec["host"], str) and rec["host"]
            and is_int(rec["port"]) and 0 < rec["port"] < 65536):
        raise MessageError(f"store key {key!r}: attempt must be an integer >= 0, host a name, port in 1..65535: {rec!r:.200}")
    return rec


def launcher_key(launcher: str) -> str:
    """A launcher's node message (``agent.NodeAgent.message``), rewritten by its lifeline every
    heartbeat interval; one that stops changing lets others take its claims over."""
    return f"launcher/{launcher}"


NODES = "nodes"  # counter: launchers registered so far; node_key(1..n) name them


def node_key(index: int) -> str:
    """The launcher id of the ``index``-th launcher to register (its message is under ``launcher_key``)."""
    return f"node/{index}"


def incarnation_key(replica: int) -> str:
    """Counter: incarnations of this replica group started so far, by any launcher of the run."""
    return f"incarnation/{replica}"


def transfer_key(replica: int, group_rank: int) -> str:
    """{"bytes", "transfer_s", "step", "epoch"} of a joiner rank's last state transfer."""
    return f"transfer/{replica}/{group_rank}"


def digest_key(step: int, replica: int) -> str:
    """A replica's parameter digest at ``step``; each member compares every member's."""
    return f"param_digest/{step}/{replica}"


class MessageError(ValueError):
    """A store value that is not the JSON message expected under its key."""


class WrongRunError(RuntimeError):
    """The store at the coordinator's address does not know this run's secret."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


LOOPBACK = "127.0.0.1"


def local_host(bind: str) -> str:
    """The host a client on this machine dials to reach a store listening on ``bind``."""
    return {"0.0.0.0": LOOPBACK, "::": "::1"}.get(bind, bind)


def listen(bind: str, port: int) -> int:
    """A listening socket on ``bind:port`` only; its file descriptor, which the caller then owns.

    TCPStore's own server listens on every interface whatever host it is given, so
    the coordinator binds the socket itself and hands it over (``master_listen_fd``).
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise RuntimeError(f"cannot listen on {bind}:{port}: {e}; check [recover] coordinator_bind") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a fixed port is free again right after a run
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        raise RuntimeError(
            f"cannot listen on {bind}:{port}: {e}; is another job using that port? "
            "Set [recover] coordinator_port to a free port (0 picks one), or fix [recover] coordinator_bind"
        ) from e
    return sock.detach()


def run_secret() -> str:
    """This run's secret, from the environment the launcher sets."""
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise RuntimeError(
            f"{SECRET_ENV} is not set: start training with run_train.sh, whose launcher makes one per run; "
            "in a multi-node run give every node's launcher the same value"
        )
    return secret


def in_run(tcp: dist.TCPStore, secret: str) -> dist.PrefixStore:
    """``tcp`` seen through the run's secret: a process that lacks it never reads or writes these keys."""
    return dist.PrefixStore(f"run/{secret}", tcp)


def serve(port: int, timeout_s: float, bind: str = LOOPBACK, secret: str | None = None) -> dist.PrefixStore:
    """The coordinator's store server, reachable on ``bind`` only (loopback unless other nodes need it),
    holding the keys of the run whose secret is ``secret`` (default: ``$TITAN_RECOVER_SECRET``)."""
    secret = secret or run_secret()
    tcp = dist.TCPStore(
        local_host(bind), port, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
        master_listen_fd=listen(bind, port),
    )
    server = in_run(tcp, secret)
    server.set(HELLO, "titan_recover")
    return server


ETCD_SCHEME = "etcd://"


def is_etcd(address: str) -> bool:
    """Whether a control-store address names an etcd cluster (else it is a TCPStore's host:port)."""
    return address.startswith(ETCD_SCHEME)


def parse_etcd_url(url: str) -> list[tuple[str, int]]:
    """``etcd://host:port,host:port,...`` -> its endpoints; ValueError naming what is wrong."""
    if not is_etcd(url):
        raise ValueError(f"{url!r} does not start with {ETCD_SCHEME}")
    endpoints = []
    for item in url[len(ETCD_SCHEME):].split(","):
        m = re.fullmatch(r"([A-Za-z0-9.\-]+|\[[0-9a-fA-F:]+\]):(\d{1,5})", item.strip(), re.ASCII)
        if m is None or not 0 < int(m.group(2)) < 65536:
            raise ValueError(f"{url!r}: {item.strip()!r} is not host:port (port 1..65535)")
        endpoints.append((m.group(1).strip("[]"), int(m.group(2))))
    if len(set(endpoints)) != len(endpoints):
        raise ValueError(f"{url!r} lists an endpoint twice")
    return endpoints


def begin_run(client: dist.Store, secret: str) -> None:
    """Starts a run on a shared store (etcd): clears what an earlier run with the same secret left
    (a new leader would take it over), then says hello to the run's other processes."""
    client.delete_prefix(f"run/{secret}/")
    in_run(client, secret).set(HELLO, "titan_recover")


def coordinator_address() -> str:
    """``host:port`` of the coordinator's store, or the ``etcd://`` URL of the run's etcd
    cluster, from the environment the launcher sets."""
    address = os.environ.get(COORDINATOR_ENV, "")
    if is_etcd(address):
        parse_etcd_url(address)
        return address
    host, sep, port = address.rpartition(":")
    if not host or not sep or not port.isdigit():
        raise RuntimeError(
            f"{COORDINATOR_ENV} must be host:port of the titan_recover coordinator, got {address!r}; "
            "start training with run_train.sh"
        )
    return address


def etcd(address: str, timeout_s: float) -> dist.Store:
    """A client of the etcd cluster at ``address`` (the ``etcd`` extra's client, imported only here)."""
    try:
        from titan_recover.etcd_store import EtcdStore
    except ImportError as e:
        raise RuntimeError(f"[recover] control_store names etcd but its client is missing ({e}): "
                           "pip install 'titan_recover[etcd]'") from None
    client = EtcdStore(parse_etcd_url(address), timeout_s)
    _ETCD_CLIENTS.append(client)  # a PrefixStore over it holds only its C++ half: its Python methods must stay
    return client


_ETCD_CLIENTS: list[dist.Store] = []


class CoordinatorGone(RuntimeError):
    """The coordinator this process started ended before it served the run."""


LISTEN_POLL_S = 0.1  # how often a starting client probes the coordinator's port


def wait_listening(address: str, timeout_s: float, gone: Callable[[], str | None] = lambda: None) -> None:
    """Returns once something accepts connections at ``host:port``, probing with plain sockets.

    The TCPStore client retries a refused connection with exponential backoff: a coordinator
    that came up 45 s after its client started was found 21 s later (measured, torch 2.13).
    ``gone`` says why waiting is pointless (the coordinator's process ended), or None.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        why = gone()
        if why is not None:
            raise CoordinatorGone(why)
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"nothing listens at {address} after {timeout_s:g}s ([recover] startup_timeout_s): is the run's "
                "coordinator (its first launcher) running, and is that address reachable from this host?"
            )
        time.sleep(LISTEN_POLL_S)


def connect(
    address: str, timeout_s: float = 60.0, secret: str | None = None, gone: Callable[[], str | None] = lambda: None
) -> dist.PrefixStore:
    """A client of the coordinator's store at ``host:port``, in the run whose secret is ``secret``
    (default: ``$TITAN_RECOVER_SECRET``); a ``WrongRunError`` if that store does not serve the run.
    Waits for the store to listen within ``timeout_s`` (``wait_listening``, which ``gone`` may cut short)."""
    secret = secret or run_secret()
    if is_etcd(address):  # its members are up before the run; the first launcher says hello
        client = in_run(etcd(address, timeout_s), secret)
        try:
            wait_for(client, HELLO, timeout_s, poll_s=0.05)
        except TimeoutError:
            raise WrongRunError(f"the etcd cluster at {address} holds no run with this {SECRET_ENV} after "
                                f"{timeout_s:g}s: give every launcher of the run the same {SECRET_ENV}") from None
        return client
    start = time.monotonic()
    wait_listening(address, timeout_s, gone)
    host, _, port = address.rpartition(":")
    left = max(1.0, timeout_s - (time.monotonic() - start))
    client = in_run(dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=left)), secret)
    try:
        wait_for(client, HELLO, min(timeout_s, HELLO_WAIT_S))
    except TimeoutError:
        raise WrongRunError(
            f"the coordinator at {address} does not serve this run (wrong or missing {SECRET_ENV}, or another job "
            f"on that port): give every launcher of the run the same {SECRET_ENV}, or use another coordinator_port"
        ) from None
    client.set_timeout(timedelta(seconds=timeout_s))
    return client


def put_json(store: dist.TCPStore, key: str, value: Any) -> None:
    store.set(key, json.dumps(value))


def decode_json(key: str, raw: bytes, required: tuple[str, ...] = ()) -> Any:
    try:
        value = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MessageError(f"store key {key!r} does not hold JSON: {raw[:80]!r} ({e})") from e
    if required:
        if not isinstance(value, dict):
            raise MessageError(f"store key {key!r} must hold a JSON object, got {value!r}")
        missing = [f for f in required if f not in value]
        if missing:
            raise MessageError(f"store key {key!r} lacks fields {missing}: {value!r}")
    return value


def get_json(store: dist.TCPStore, key: str, required: tuple[str, ...] = ()) -> Any:
    return decode_json(key, store.get(key), required)


def get_int(store: dist.TCPStore, key: str) -> int:
    raw = store.get(key)
    try:
        return int(raw)
    except ValueError as e:
        raise MessageError(f"store key {key!r} must hold an integer, got {raw[:80]!r}") from e


def wait_for(store: dist.TCPStore, key: str, timeout_s: float, poll_s: float = 0.002) -> None:
    """Polls until ``key`` exists (``TCPStore.wait`` logs a warning per timeout)."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"store key {key!r} did not appear within {timeout_s:g}s")
        time.sleep(poll_s)


def report(store: dist.TCPStore, record: dict[str, Any]) -> None:
    """Tells the coordinator about a failure seen from here.

    A slot is reserved (``add``) then written (``set``); a reporter that dies in
    between leaves an empty slot, which the coordinator skips after a grace period.
    """
    index = store.add(REPORTS, 1)
    put_json(store, report_key(index), {**record, "time": time.time()})


NODE_GROUP_FIELDS = ("attempt", "ranks", "ready", "finished", "silent_s")


def read_node_message(key: str, raw: bytes) -> dict[int, dict[str, Any]]:
    """A node message's groups (replica -> its entry), checked field by field."""
    rec = decode_json(key, raw, ("seq", "groups"))
    if not is_int(rec["seq"]) or not isinstance(rec["groups"], dict):
        raise MessageError(f"store key {key!r}: seq must be an integer and groups an object: {rec!r:.200}")
    groups: dict[int, dict[str, Any]] = {}
    for replica, entry in rec["groups"].items():
        if not (isinstance(replica, str) and replica.isdigit() and isinstance(entry, dict)):
            raise MessageError(f"store key {key!r}: group {replica!r} is not a replica id with an object: {entry!r:.200}")
        missing = [f for f in NODE_GROUP_FIELDS if f not in entry]
        counts = [entry.get(f) for f in NODE_GROUP_FIELDS[:4]]
        silent = entry.get("silent_s")
        if missing or not all(is_int(v) and v >= 0 for v in counts) or isinstance(silent, bool) \
                or not isinstance(silent, (int, float)) or not 0 <= silent < float("inf"):
            raise MessageError(f"store key {key!r}: group {replica} needs non-negative integers "
                               f"{list(NODE_GROUP_FIELDS[:4])} and seconds silent_s: {entry!r:.200}")
        stuck = entry.get("stuck")
        if stuck is not None and not (isinstance(stuck, dict) and all(is_int(stuck.get(f)) for f in ("rank", "step"))):
            raise MessageError(f"store key {key!r}: group {replica}: stuck needs integers rank and step: {stuck!r:.200}")
        groups[int(replica)] = entry
    return groups


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_report(store: dist.TCPStore, key: str) -> dict[str, Any]:
    """A failure report, checked field by field: a peer's bytes are validated, never trusted."""
    rec = get_json(store, key, ("epoch", "cause"))
    if not is_int(rec["epoch"]) or rec["epoch"] < 0:
        raise MessageError(f"store key {key!r}: epoch must be a non-negative integer, got {rec['epoch']!r}")
    for field in ("suspect", "replica", "step", "attempt"):
        value = rec.get(field)
        if value is not None and (not is_int(value) or value < 0):
            raise MessageError(f"store key {key!r}: {field} must be a non-negative integer, got {value!r}")
    if not isinstance(rec["cause"], str) or not isinstance(rec.get("error", ""), str):
        raise MessageError(f"store key {key!r}: cause and error must be strings: {rec!r:.200}")
    return rec


def connection_refused(address: str) -> bool:
    """Whether nothing listens at ``host:port`` any more (a killed coordinator), in at most a second.

    A TCPStore client retries a refused connection until its timeout; a plain socket says at once.
    """
    if is_etcd(address):  # etcd: only when every member refuses (one member lost is invisible)
        return all(connection_refused(f"{host}:{port}") for host, port in parse_etcd_url(address))
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # unreachable or slow: the silence bound decides
        return False


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
        client: dist.TCPStore | None = None
        next_probe = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if client is None:
                    client = connect(self._address, min(self._timeout, 60.0), self._secret)
                client.set(self._key, self._message())
                if now >= next_probe:
                    alive = int(client.add(ALIVE, 0))
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


EXIT_COORDINATOR_LOST = 3


def exit_lost(who: str, reason: str, hint: str) -> None:
    """Ends this process at once with one line: the run cannot go on without its coordinator."""
    print(f"error: {who}: lost the titan_recover coordinator: {reason}. {hint}", file=sys.stderr, flush=True)
    os._exit(EXIT_COORDINATOR_LOST)
