"""Process plumbing for the coordinator's state: torch's TCPStore, JSON values only.

Every key titan_recover uses is named here. Values are JSON (never pickle) so a
peer's bytes can never run code; a value that does not decode to the expected
shape raises ``MessageError`` naming the key.
"""

import json
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

COORDINATOR_ENV = "TITAN_RECOVER_COORDINATOR"  # host:port of the coordinator's store
REPLICA_ENV = "TITAN_RECOVER_REPLICA"  # this process's replica group id
SECRET_ENV = "TITAN_RECOVER_SECRET"  # this run's secret: every key of the run is stored under it
HELLO = "hello"  # the coordinator sets it on start: a client that cannot read it is not in this run
HELLO_WAIT_S = 10.0  # how long a client waits for it (the coordinator sets it right after listening)

EPOCH = "epoch"
REPORTS = "reports"
FATAL = "fatal"
STATUS = "status"
PROGRESS = "progress"  # {"step", "epoch", "time"} of the last committed step
REPLICATE_BACKEND = "replicate_backend"  # "gloo" or "nccl": the first rank sets it, every other must match
ATTEMPT_ENV = "TITAN_RECOVER_ATTEMPT"  # incarnation of this replica group: 0, then +1 per restart


def attempt() -> int:
    """This process's incarnation of its replica group (the launcher counts restarts)."""
    return int(os.environ.get(ATTEMPT_ENV, "0"))


def members_key(epoch: int) -> str:
    return f"members/{epoch}"


def heartbeat_key(replica: int, shard: int) -> str:
    return f"hb/{replica}/{shard}"


def ok_key(step: int, epoch: int) -> str:
    return f"ok/{step}/{epoch}"


def decision_key(step: int, epoch: int) -> str:
    return f"decision/{step}/{epoch}"


def report_key(index: int) -> str:
    return f"report/{index}"


def fault_key(replica: int) -> str:
    return f"fault/{replica}"


def finished_key(replica: int) -> str:
    return f"finished/{replica}"


def join_key(replica: int) -> str:
    """{"attempt"}: a (re)started replica group asks to be admitted."""
    return f"join/{replica}"


def join_ready_key(replica: int, attempt: int) -> str:
    """Counter: how many ranks of that incarnation are up and waiting."""
    return f"join/{replica}/{attempt}"


def admitted_key(replica: int) -> str:
    """{"attempt", "epoch"}: the coordinator's answer to a join request."""
    return f"admitted/{replica}"


def fenced_key(replica: int) -> str:
    """{"attempt", "epoch"}: that incarnation is out; its launcher kills what is left of it."""
    return f"fenced/{replica}"


def pid_key(replica: int, attempt: int, shard: int) -> str:
    """{"pid", "host"} of one rank, so the launcher can kill a hung (fenced) incarnation."""
    return f"pid/{replica}/{attempt}/{shard}"


def transfer_key(replica: int, shard: int) -> str:
    """{"bytes", "transfer_s", "step", "epoch"} of a joiner rank's last state transfer."""
    return f"transfer/{replica}/{shard}"


def digest_key(step: int) -> str:
    """The first replica's parameter digest at ``step``; later replicas compare to it."""
    return f"param_digest/{step}"


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


def coordinator_address() -> str:
    """``host:port`` of the coordinator's store, from the environment the launcher sets."""
    address = os.environ.get(COORDINATOR_ENV, "")
    host, sep, port = address.rpartition(":")
    if not host or not sep or not port.isdigit():
        raise RuntimeError(
            f"{COORDINATOR_ENV} must be host:port of the titan_recover coordinator, got {address!r}; "
            "start training with run_train.sh"
        )
    return address


def connect(address: str, timeout_s: float = 60.0, secret: str | None = None) -> dist.PrefixStore:
    """A client of the coordinator's store at ``host:port``, in the run whose secret is ``secret``
    (default: ``$TITAN_RECOVER_SECRET``); a ``WrongRunError`` if that store does not serve the run."""
    secret = secret or run_secret()
    host, _, port = address.rpartition(":")
    client = in_run(dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s)), secret)
    try:
        wait_for(client, HELLO, min(timeout_s, HELLO_WAIT_S))
    except TimeoutError:
        raise WrongRunError(
            f"the coordinator at {address} does not serve this run (wrong or missing {SECRET_ENV}, or another job "
            f"on that port): give every launcher of the run the same {SECRET_ENV}, or use another coordinator_port"
        ) from None
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
    """Tells the coordinator about a failure seen from here."""
    index = store.add(REPORTS, 1)
    put_json(store, report_key(index), {**record, "time": time.time()})


class Heartbeat:
    """Bumps this rank's heartbeat counter from a daemon thread with its own store client."""

    def __init__(self, address: str, replica: int, shard: int, interval_s: float) -> None:
        self._store = connect(address)
        self._key = heartbeat_key(replica, shard)
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="titan-recover-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.add(self._key, 1)
            except Exception:  # the coordinator is gone: the run is ending
                return
            self._stop.wait(self._interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._interval + 1)
