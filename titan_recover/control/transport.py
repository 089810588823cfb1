"""The control store's transport: torch's TCPStore (the coordinator serves it) or an etcd cluster.

Serving, connecting (to the run's keys, sealed with its secret: ``sealed``), and probing
whether a coordinator still listens. The etcd client is imported only here (the ``etcd`` extra).
"""

import os
import socket
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, TypeVar

import torch.distributed as dist

from titan_recover.control import keys
from titan_recover.control.addresses import (
    LOOPBACK,
    first_endpoint,
    is_etcd,
    local_host,
    parse_etcd_url,
    parse_host_port,
)
from titan_recover.control.sealed import Run, SealedStore

if TYPE_CHECKING:  # the etcd extra's client: imported only where a run on etcd needs it (``etcd``)
    from titan_recover.control.etcd_store import EtcdStore

HELLO_WAIT_S = 10.0  # how long a client waits for the hello (the coordinator sets it right after listening)
LISTEN_POLL_S = 0.1  # how often a starting client probes the coordinator's port
# one try of a TCPStore client's handshake: between tries, a port that accepted and now refuses is a coordinator
# gone (its launcher with it), not one still starting
HANDSHAKE_TRY_S = 2.0


T = TypeVar("T")


def call_within(seconds: float, call: Callable[[], T], name: str) -> T:
    """``call()`` in a daemon thread given ``seconds``: its result, its exception, or TimeoutError.
    For a store call that can block past any timeout of its own (a TCPStore client of a frozen
    server); the thread is left behind, blocked, and the caller drops its client."""
    box: Future[T] = Future()

    def run() -> None:
        try:
            box.set_result(call())
        except Exception as e:
            box.set_exception(e)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(seconds)
    if not box.done():
        raise TimeoutError(f"no answer within {seconds:g}s")
    return box.result()  # the call's exception raised again here


class WrongRunError(RuntimeError):
    """The store at the coordinator's address does not know this run's secret."""


class CoordinatorGone(RuntimeError):
    """The coordinator ended before it served the run: the one this process started, or one whose port
    accepted this client and then refused it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def listen(bind: str, port: int) -> int:
    """A listening socket on ``bind:port`` only; its file descriptor, which the caller then owns.

    TCPStore's own server listens on every interface whatever host it is given, so
    the coordinator binds the socket itself and hands it over (``master_listen_fd``).
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
            0
        ]
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


def coordinator_address() -> str:
    """``host:port`` of the coordinator's store, or the ``etcd://`` URL of the run's etcd
    cluster, from the environment the launcher sets."""
    address = os.environ.get(keys.COORDINATOR_ENV, "")
    try:
        first_endpoint(address)
    except ValueError:
        raise RuntimeError(
            f"{keys.COORDINATOR_ENV} must be host:port of the titan_recover coordinator, got {address!r}; "
            "start training with run_train.sh"
        ) from None
    return address


def in_run(store: dist.Store, run: Run) -> SealedStore:
    """``store`` seen through the run: its keys only, every value sealed with its secret."""
    return SealedStore(dist.PrefixStore(run.prefix, store), run)


def listening_port(fd: int) -> int:
    """The port the listening socket ``fd`` is bound to (``fd`` stays open)."""
    sock = socket.socket(fileno=fd)
    try:
        return sock.getsockname()[1]
    finally:
        sock.detach()


def serve(
    port: int, timeout_s: float, bind: str = LOOPBACK, run: Run | None = None, fd: int | None = None
) -> SealedStore:
    """The coordinator's store server, reachable on ``bind`` only (loopback unless other nodes need it),
    holding the keys of ``run`` (default: the one in this process's environment), on the listening
    socket ``fd`` when its launcher bound it (no other process can take the port in between)."""
    return _serve(listen(bind, port) if fd is None else fd, port, timeout_s, bind, run or Run.from_env())


def serve_any_port(bind: str, timeout_s: float, run: Run) -> tuple[SealedStore, int]:
    """A store server of ``run`` on a free port of ``bind``; the server and that port."""
    fd = listen(bind, 0)
    port = listening_port(fd)
    return _serve(fd, port, timeout_s, bind, run), port


def _serve(fd: int, port: int, timeout_s: float, bind: str, run: Run) -> SealedStore:
    tcp = dist.TCPStore(
        local_host(bind),
        port,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=fd,
    )
    in_run(tcp, Run(run.secret, "")).set(keys.CURRENT_RUN, run.id)  # how a launcher given only the secret finds the run
    server = in_run(tcp, run)
    server.set(keys.HELLO, "titan_recover")
    return server


# every etcd client made, kept: a PrefixStore over one holds only its C++ half, its Python methods must stay.
# Per (address, timeout, thread): the clients made there, each with the timeout it was made with.
_ETCD_CLIENTS: dict[tuple[str, float, int], list[tuple["EtcdStore", timedelta]]] = {}


def etcd(address: str, timeout_s: float) -> "EtcdStore":
    """A client of the etcd cluster at ``address`` (the ``etcd`` extra's client, imported only here).

    The calling thread's client for ``address`` and ``timeout_s`` is reused (a lifeline reconnects
    after every error: a client each time would never be freed), unless its user changed its
    timeout since; threads never share one (a request holds its client's lock)."""
    from threading import get_ident

    try:
        from titan_recover.control.etcd_store import EtcdStore
    except ImportError as e:
        raise RuntimeError(
            f"[recover] control_store names etcd but its client is missing ({e}): pip install 'titan_recover[etcd]'"
        ) from None
    made = _ETCD_CLIENTS.setdefault((address, timeout_s, get_ident()), [])
    for client, timeout in made:
        if client.timeout == timeout:
            return client
    client = EtcdStore(parse_etcd_url(address), timeout_s)
    made.append((client, client.timeout))
    return client


def wait_for(store: dist.Store, key: str, timeout_s: float, poll_s: float = 0.002) -> None:
    """Polls until ``key`` exists (``TCPStore.wait`` logs a warning per timeout)."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"store key {key!r} did not appear within {timeout_s:g}s")
        time.sleep(poll_s)


def wait_listening(address: str, timeout_s: float, gone: Callable[[], str | None] = lambda: None) -> None:
    """Returns once something accepts connections at ``host:port``, probing with plain sockets.

    The TCPStore client retries a refused connection with exponential backoff: a coordinator
    that came up 45 s after its client started was found 21 s later (measured, torch 2.13).
    ``gone`` says why waiting is pointless (the coordinator's process ended), or None.
    """
    host, port = parse_host_port(address)
    deadline = time.monotonic() + timeout_s
    while True:
        why = gone()
        if why is not None:
            raise CoordinatorGone(why)
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"nothing listens at {address} after {timeout_s:g}s ([recover] startup_timeout_s): is the run's "
                "coordinator (its first launcher) running, and is that address reachable from this host?"
            )
        time.sleep(LISTEN_POLL_S)


def _tcp_client(address: str, timeout_s: float, gone: Callable[[], str | None]) -> dist.TCPStore:
    """A client of the TCPStore at ``address`` once it listens, its handshake tried ``HANDSHAKE_TRY_S`` at a time
    within ``timeout_s``: a launcher's bound port accepts before its coordinator serves, and a client that waited
    out the whole bound in one try missed the port closing when that launcher lost it (600 s, measured)."""
    start = time.monotonic()
    wait_listening(address, timeout_s, gone)
    host, port = parse_host_port(address)
    while True:
        left = max(1.0, timeout_s - (time.monotonic() - start))
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=min(left, HANDSHAKE_TRY_S)))
        except dist.DistError:
            if time.monotonic() - start >= timeout_s:
                raise
            why = gone()
            if why is None and connection_refused(address):
                why = f"its port at {address} accepted this client, then refused it: the coordinator is gone"
            if why is not None:
                raise CoordinatorGone(why) from None
            continue
        store.set_timeout(timedelta(seconds=left))
        return store


def _wrong_run(address: str) -> WrongRunError:
    return WrongRunError(
        f"the coordinator at {address} does not serve this run (wrong or missing {keys.SECRET_ENV} or {keys.RUN_ENV}, "
        f"or another job on that port): give every launcher of the run the same {keys.SECRET_ENV}, or use another "
        "coordinator_port"
    )


def connect(
    address: str, timeout_s: float = 60.0, run: Run | None = None, gone: Callable[[], str | None] = lambda: None
) -> SealedStore:
    """A client of the coordinator's store at ``host:port`` (or of the etcd cluster at an ``etcd://``
    URL) in ``run`` (default: the one in this process's environment); a ``WrongRunError`` if that
    store does not serve the run. Waits for the store to listen within ``timeout_s``
    (``wait_listening``, which ``gone`` may cut short)."""
    run = run or Run.from_env()
    if is_etcd(address):  # its members are up before the run; the first launcher says hello
        client = in_run(etcd(address, timeout_s), run)
        try:
            wait_for(client, keys.HELLO, timeout_s, poll_s=0.05)
        except TimeoutError:
            raise WrongRunError(
                f"the etcd cluster at {address} holds no run {run.id!r} with this {keys.SECRET_ENV} "
                f"after {timeout_s:g}s: give every launcher of the run the same {keys.SECRET_ENV} and "
                f"{keys.RUN_ENV}, and start the run's first node"
            ) from None
        return client
    client = in_run(_tcp_client(address, timeout_s, gone), run)
    try:
        wait_for(client, keys.HELLO, min(timeout_s, HELLO_WAIT_S))
    except TimeoutError:
        raise _wrong_run(address) from None
    client.set_timeout(timedelta(seconds=timeout_s))
    return client


def find_run(address: str, timeout_s: float, secret: str, gone: Callable[[], str | None] = lambda: None) -> Run:
    """The run the coordinator at ``host:port`` serves, for a launcher given only the run's secret."""
    finder = in_run(_tcp_client(address, timeout_s, gone), Run(secret, ""))
    try:
        wait_for(finder, keys.CURRENT_RUN, min(timeout_s, HELLO_WAIT_S))
    except TimeoutError:
        raise _wrong_run(address) from None
    return Run(secret, finder.get(keys.CURRENT_RUN).decode())


def connection_refused(address: str) -> bool:
    """Whether nothing listens at ``host:port`` any more (a killed coordinator), in at most a second.

    A TCPStore client retries a refused connection until its timeout; a plain socket says at once.
    """
    if is_etcd(address):  # etcd: only when every member refuses (one member lost is invisible)
        return all(connection_refused(f"{host}:{port}") for host, port in parse_etcd_url(address))
    try:
        with socket.create_connection(parse_host_port(address), timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # unreachable or slow: the silence bound decides
        return False
