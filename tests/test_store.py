"""Tests for the control plane's transport (serve, connect, the run's secret), its client
(``ControlClient``) and its records (``protocol``) against a real TCPStore server on a free port."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch.distributed as dist
from conftest import ROOT

from titan_recover.control import keys, lifeline, protocol, transport
from titan_recover.control.client import ControlClient
from titan_recover.control.protocol import Fence, Membership, MessageError, NodeMessage, Rendezvous, Report, StepRecord
from titan_recover.control.sealed import Run, SealedStore


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[SealedStore, str]]:
    port = transport.free_port()
    srv = transport.serve(port, 5)
    yield srv, f"127.0.0.1:{port}"
    del srv


@pytest.fixture
def client(server: tuple[SealedStore, str]) -> SealedStore:
    return transport.connect(server[1], timeout_s=5)


@pytest.fixture
def key(request: pytest.FixtureRequest) -> str:
    """A key of its own for every test (the server is shared by the module)."""
    return f"test/{request.node.name}"


@pytest.mark.unit
def test_free_port_is_bindable() -> None:
    port = transport.free_port()
    assert 0 < port < 65536


@pytest.mark.unit
def test_key_names() -> None:
    assert keys.members_key(3) == "members/3"
    assert keys.launcher_key("h:1:ab") == "launcher/h:1:ab"
    assert keys.node_key(3) == "node/3"
    assert keys.ok_key(5, 2) == "ok/5/2"
    assert keys.decision_key(5, 2) == "decision/5/2"
    assert keys.report_key(4) == "report/4"
    assert keys.fault_key(1) == "fault/1"


def test_records_round_trip_between_clients(server: tuple[SealedStore, str], client: SealedStore, key: str) -> None:
    step = StepRecord(
        step=7,
        epoch=3,
        members=[0, 2],
        microbatches=[[0, 1], [2]],
        data_digest="ünïcode ✓",
        loss=1.5,
        grad_norm=None,
        time=12.5,
        samples={"x": [1.5, None, True]},
    )
    report = Report(epoch=3, cause="ünïcode ✓", replica=2, suspect=0)
    ControlClient(client).put(key, step)
    ControlClient(client).put(key + "/report", report)
    other = transport.connect(server[1], timeout_s=5)
    assert ControlClient(other).read(key, StepRecord) == step
    assert ControlClient(server[0]).read(key, StepRecord) == step
    assert ControlClient(other).read(key + "/report", Report) == report
    assert json.loads(client.get(key).decode()) == step.to_json()  # it is plain JSON text in the store
    assert ControlClient(client).read(key + "/missing", StepRecord) is None  # nothing written there yet


@pytest.mark.parametrize("value", [[1, 2], "text", 7, None])
def test_json_non_objects_round_trip_without_required_fields(client: SealedStore, key: str, value: object) -> None:
    client.set(key, json.dumps(value))
    assert protocol.decode_json(key, client.get(key)) == value


def test_non_utf8_bytes_raise_message_error(client: SealedStore, key: str) -> None:
    client.set(key, b"\xff\xfe\x80garbage")
    with pytest.raises(MessageError) as info:
        ControlClient(client).read(key, Report)
    assert repr(key) in str(info.value)
    assert "does not hold JSON" in str(info.value)


def test_non_json_text_raises_message_error(client: SealedStore, key: str) -> None:
    client.set(key, "{epoch: 1")
    with pytest.raises(MessageError) as info:
        ControlClient(client).read(key, Fence)
    assert repr(key) in str(info.value)
    assert "does not hold JSON" in str(info.value)
    assert "{epoch: 1" in str(info.value)


def test_pickle_bytes_are_not_unpickled(client: SealedStore, key: str) -> None:
    import pickle

    client.set(key, pickle.dumps({"epoch": 1}))
    with pytest.raises(MessageError, match=repr(key)):
        ControlClient(client).read(key, Fence)
    with pytest.raises(MessageError, match=repr(key)):
        Fence.loads(key, pickle.dumps(Fence(attempt=1, epoch=2)))


def test_list_where_object_required_raises(client: SealedStore, key: str) -> None:
    client.set(key, json.dumps([{"attempt": 0, "epoch": 1}]))  # malformed on purpose
    with pytest.raises(MessageError) as info:
        ControlClient(client).read(key, Fence)
    assert repr(key) in str(info.value)
    assert "must hold a JSON object" in str(info.value)


def test_missing_required_fields_are_named(client: SealedStore, key: str) -> None:
    client.set(key, json.dumps({"attempt": 1, "extra": 2}))  # malformed on purpose: no host, no port
    with pytest.raises(MessageError) as info:
        ControlClient(client).read(key, Rendezvous)
    msg = str(info.value)
    assert repr(key) in msg
    assert "lacks fields" in msg
    assert "['host', 'port']" in msg
    with pytest.raises(MessageError, match=re.escape("lacks fields ['host', 'port']")):
        Rendezvous.loads(key, client.get(key))
    assert protocol.decode_json(key, client.get(key), ("attempt",)) == {"attempt": 1, "extra": 2}


@pytest.mark.unit
def test_decode_json_directly() -> None:
    assert protocol.decode_json("k", b'{"a": 1}', ("a",)) == {"a": 1}
    with pytest.raises(MessageError, match="'k'"):
        protocol.decode_json("k", b"", ())
    with pytest.raises(MessageError, match="store key 'k' does not hold JSON"):
        protocol.decode_json("k", b"{a: 1}", ("a",))
    with pytest.raises(MessageError, match="store key 'k' must hold a JSON object"):
        protocol.decode_json("k", b"[1]", ("a",))
    with pytest.raises(MessageError, match=re.escape("store key 'k' lacks fields ['b']")):
        protocol.decode_json("k", b'{"a": 1}', ("a", "b"))


@pytest.mark.unit
def test_records_load_their_own_dumps() -> None:
    for record in (
        Report(epoch=0, cause="boom", replica=1),
        Rendezvous(2, "10.0.0.5", 29600),
        Fence(attempt=1, epoch=2),
        NodeMessage(3, {}),
        Membership(2, (0, 1)),
    ):
        assert type(record).loads("k", record.dumps().encode()) == record
        assert type(record).from_json("k", record.to_json()) == record


def test_decode_int(client: SealedStore, key: str) -> None:
    client.set(key, "42")
    assert protocol.decode_int(key, client.get(key)) == 42
    assert client.add(key + "/counter", 5) == 5
    assert protocol.decode_int(key + "/counter", client.inner.get(key + "/counter")) == 5  # counters are not sealed
    c = ControlClient(client)
    assert c.joined(9, 1) is None  # an integer the client reads: none yet
    c.set_joined(9, 1, 4)
    assert c.joined(9, 1) == 4


@pytest.mark.parametrize("raw", [b"forty-two", b"", b"1.5", b"\xff\xfe", b'{"epoch": 1}'])
def test_decode_int_on_garbage_raises_message_error(client: SealedStore, key: str, raw: bytes) -> None:
    client.set(key, raw)
    with pytest.raises(MessageError) as info:
        protocol.decode_int(key, client.get(key))
    assert repr(key) in str(info.value)
    assert "must hold an integer" in str(info.value)


def test_report_increments_counter_and_stores_record() -> None:
    # a store of its own so that REPORTS starts at zero
    port = transport.free_port()
    srv = transport.serve(port, 5)
    c = ControlClient(transport.connect(f"127.0.0.1:{port}", timeout_s=5))
    before = time.time()
    c.report(Report(epoch=0, cause="boom", replica=1))
    c.report(Report(epoch=0, cause="bang", replica=0, suspect=0))
    after = time.time()
    assert c.report_count() == 2
    assert protocol.decode_int(keys.REPORTS, c.store.inner.get(keys.REPORTS)) == 2
    first, second = ControlClient(srv).read_report(1), ControlClient(srv).read_report(2)
    assert first is not None and second is not None
    assert (first.replica, first.epoch, first.suspect, first.cause) == (1, 0, None, "boom")
    assert second.cause == "bang" and second.suspect == 0
    assert before <= first.time <= second.time <= after
    assert Report.loads(keys.report_key(1), srv.get(keys.report_key(1))) == first  # JSON with its time, in the store
    assert not srv.check([keys.report_key(0)])  # indices start at 1, as the coordinator reads them
    assert not srv.check([keys.report_key(3)])
    assert ControlClient(srv).read_report(3) is None


def test_wait_for_returns_once_the_key_exists(client: SealedStore, key: str) -> None:
    client.set(key, "x")
    transport.wait_for(client, key, timeout_s=1.0)


def test_wait_for_times_out_naming_the_key(client: SealedStore, key: str) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        transport.wait_for(client, key + "/never", timeout_s=0.2)
    assert repr(key + "/never") in str(info.value)
    assert "0.2s" in str(info.value)
    assert time.monotonic() - start < 4.0  # well before the store's own 5 s timeout


@pytest.mark.unit
def test_coordinator_address_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(keys.COORDINATOR_ENV, "10.0.0.5:29500")
    assert transport.coordinator_address() == "10.0.0.5:29500"


@pytest.mark.unit
@pytest.mark.parametrize("value", [None, "", "localhost", "localhost:", ":29500", "host:port", "host:12a"])
def test_coordinator_address_unset_or_malformed(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(keys.COORDINATOR_ENV, raising=False)
    else:
        monkeypatch.setenv(keys.COORDINATOR_ENV, value)
    with pytest.raises(RuntimeError) as info:
        transport.coordinator_address()
    msg = str(info.value)
    assert keys.COORDINATOR_ENV in msg
    assert "run_train.sh" in msg
    assert repr(value or "") in msg


def wait_until(predicate: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until ``predicate()`` held; fails the test after ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s}s"
        time.sleep(0.01)
    return time.monotonic() - start


def never_lost(reason: str) -> None:
    raise AssertionError(f"lifeline declared the coordinator lost: {reason}")


class Messages:
    """A node message with a sequence number, as ``agent.NodeAgent.message`` makes one."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self) -> str:
        self.seq += 1
        return NodeMessage(self.seq, {}).dumps()


def read_seq(s: SealedStore, key: str) -> int:
    return NodeMessage.loads(key, s.get(key)).seq if s.check([key]) else 0


def test_lifeline_writes_the_node_message_every_interval_then_stops(server: tuple[SealedStore, str], key: str) -> None:
    srv, address = server
    lost: list[str] = []
    hb = lifeline.Heartbeat(
        address, key, interval_s=0.05, coordinator_timeout_s=1e6, on_lost=lost.append, message=Messages()
    )
    try:
        seen = [read_seq(srv, key)]
        deadline = time.monotonic() + 10.0
        while seen[-1] < 6 and time.monotonic() < deadline:  # ~0.3 s at 50 ms per beat
            time.sleep(0.01)
            seen.append(read_seq(srv, key))
        assert seen[-1] >= 6, f"node message only reached seq {seen[-1]}"
        assert seen == sorted(seen)  # it only ever grows
        assert len(set(seen)) >= 3  # it moved several times while we watched
    finally:
        hb.stop()
    assert not any(t.is_alive() for t in hb._threads)
    assert lost == []
    stopped = read_seq(srv, key)
    deadline = time.monotonic() + 0.2  # four intervals
    while time.monotonic() < deadline:
        assert read_seq(srv, key) == stopped
        time.sleep(0.01)


class ResettingProxy:
    """A TCP proxy in front of a store server that can reset every connection through it."""

    def __init__(self, target_port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target = target_port
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.listener.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self.target))
            self.pairs.append((a, b))
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def reset_all(self) -> None:
        for a, b in self.pairs:
            for s in (a, b):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
                s.close()
        self.pairs = []


def test_lifeline_survives_a_connection_reset(server: tuple[SealedStore, str], key: str) -> None:
    """A transient reset must not end the lifeline (it would fence a healthy node)."""
    srv, _ = server
    proxy = ResettingProxy(int(server[1].rpartition(":")[2]))
    hb = lifeline.Heartbeat(
        f"127.0.0.1:{proxy.port}", key, 0.02, coordinator_timeout_s=1e6, on_lost=never_lost, message=Messages()
    )
    try:
        wait_until(lambda: read_seq(srv, key) >= 3, 10)
        for _ in range(3):
            proxy.reset_all()
            before = read_seq(srv, key)
            wait_until(lambda: read_seq(srv, key) >= before + 3, 10)  # beating again, on a new connection
        assert all(t.is_alive() for t in hb._threads)
    finally:
        hb.stop()


COORDINATOR = """
import sys, time
from titan_recover.control import keys, transport
srv = transport.serve(int(sys.argv[1]), 30)
print("up", flush=True)
while True:
    srv.add(keys.ALIVE, 1)
    time.sleep(0.02)
"""


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL])
def test_lifeline_notices_a_frozen_or_killed_coordinator(sig: signal.Signals) -> None:
    """A real coordinator-like process; every store call against a SIGSTOPped server would
    block, so the verdict comes from a second thread within the bound."""
    port = transport.free_port()
    proc = subprocess.Popen([sys.executable, "-c", COORDINATOR, str(port)], stdout=subprocess.PIPE, text=True)
    lost: list[tuple[float, str]] = []
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "up\n"
        hb = lifeline.Heartbeat(
            f"127.0.0.1:{port}",
            "launcher/test",
            0.05,
            coordinator_timeout_s=2.0,
            on_lost=lambda reason: lost.append((time.monotonic(), reason)),
            message=Messages(),
        )
        time.sleep(1.0)
        assert lost == []  # alive and answering: no verdict
        os.kill(proc.pid, sig)
        start = time.monotonic()
        wait_until(lambda: bool(lost), 10)
        took = lost[0][0] - start
        if sig == signal.SIGSTOP:
            assert "no sign of life" in lost[0][1] and f"127.0.0.1:{port}" in lost[0][1]
            assert 1.0 <= took <= 2.0 + 2.0, took  # the bound, not a TCP timeout
        else:
            assert "refused" in lost[0][1]
            assert took < 2.0, took  # a dead process is noticed before the silence bound
        hb.stop()
    finally:
        proc.kill()
        proc.wait()


# --- who may connect: the interface the coordinator's store listens on -----------------


def non_loopback_ip() -> str | None:
    """An IPv4 address of this machine other than loopback (the route a UDP socket would take)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except ConnectionRefusedError:
        return False


@pytest.fixture(scope="module")
def lan_ip() -> str:
    ip = non_loopback_ip()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect to")
    return ip


def test_serve_listens_on_loopback_by_default(lan_ip: str) -> None:
    port = transport.free_port()
    srv = transport.serve(port, 5)
    assert accepts("127.0.0.1", port)
    assert not accepts(lan_ip, port)  # another host could not reach it either
    del srv


def test_serve_listens_on_the_address_it_is_given(lan_ip: str) -> None:
    port = transport.free_port()
    srv = transport.serve(port, 5, bind=lan_ip)
    assert accepts(lan_ip, port)
    assert not accepts("127.0.0.1", port)
    client = transport.connect(f"{lan_ip}:{port}", timeout_s=5)
    client.set("k", "v")
    assert srv.get("k") == b"v"
    del srv


def test_serve_on_all_interfaces_when_asked(lan_ip: str) -> None:
    port = transport.free_port()
    srv = transport.serve(port, 5, bind="0.0.0.0")
    assert accepts("127.0.0.1", port) and accepts(lan_ip, port)
    del srv


def test_serve_on_a_taken_port_names_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError) as info:
            transport.serve(port, 5)
    msg = str(info.value)
    assert f"127.0.0.1:{port}" in msg and "coordinator_port" in msg


# --- who may connect: the run's secret ----------------------------------------------------

SERVE = """
import sys
from titan_recover.control import transport
from titan_recover.control.client import ControlClient
from titan_recover.control.protocol import Membership
srv = transport.serve(int(sys.argv[1]), 30)
ControlClient(srv).publish(Membership(3, (0, 1)))
print("up", flush=True)
sys.stdin.read()  # serves until the test closes stdin
"""


@contextmanager
def coordinator_process(secret: str) -> Iterator[str]:
    """A store server in a process of its own, run with ``secret``; yields its address."""
    port = transport.free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(port)],
        cwd=ROOT,
        env={**os.environ, keys.SECRET_ENV: secret},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    stdin, stdout = proc.stdin, proc.stdout
    assert stdin is not None and stdout is not None  # both piped
    try:
        assert stdout.readline() == "up\n"
        yield f"127.0.0.1:{port}"
    finally:
        stdin.close()
        proc.wait(timeout=10)


def test_a_client_of_another_run_is_refused_within_a_bound() -> None:
    with coordinator_process("run-a-secret") as address:
        start = time.monotonic()
        with pytest.raises(transport.WrongRunError) as info:
            transport.connect(address, timeout_s=2, run=Run("run-b-secret", ""))
        assert time.monotonic() - start < 5
        msg = str(info.value)
        assert f"the coordinator at {address} does not serve this run" in msg
        assert keys.SECRET_ENV in msg and "another job on that port" in msg
        assert ControlClient(transport.connect(address, timeout_s=2, run=Run("run-a-secret", ""))).epoch() == 3


def test_a_client_with_the_runs_secret_in_its_environment_connects(monkeypatch: pytest.MonkeyPatch) -> None:
    with coordinator_process("run-a-secret") as address:
        monkeypatch.setenv(keys.SECRET_ENV, "run-a-secret")
        assert ControlClient(transport.connect(address, timeout_s=2)).epoch() == 3
        monkeypatch.setenv(keys.SECRET_ENV, "run-b-secret")
        with pytest.raises(transport.WrongRunError):
            transport.connect(address, timeout_s=1)


def test_without_a_secret_nothing_connects_or_serves(
    monkeypatch: pytest.MonkeyPatch, server: tuple[SealedStore, str]
) -> None:
    monkeypatch.delenv(keys.SECRET_ENV)
    for call in (lambda: transport.connect(server[1], timeout_s=1), lambda: transport.serve(transport.free_port(), 1)):
        with pytest.raises(RuntimeError) as info:
            call()
        assert f"{keys.SECRET_ENV} is not set" in str(info.value)


def test_the_runs_keys_are_out_of_reach_without_its_secret(
    server: tuple[SealedStore, str], client: SealedStore, key: str
) -> None:
    host, _, port = server[1].rpartition(":")
    stray = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))  # no secret
    ControlClient(client).put(key, Fence(attempt=0, epoch=1))
    assert not stray.check([key])
    stray.set(key, "overwritten by a stray client")
    assert ControlClient(server[0]).read(key, Fence) == Fence(attempt=0, epoch=1)


def test_a_runs_store_does_what_the_trainer_asks(
    server: tuple[SealedStore, str], client: SealedStore, key: str
) -> None:
    other = transport.connect(server[1], timeout_s=5)
    other.set(key, "v")
    assert client.get(key) == b"v"
    assert client.compare_set(key + "/cs", "", "first") == b"first"
    assert other.compare_set(key + "/cs", "", "second") == b"first"
    assert client.add(key + "/n", 2) == 2 and other.add(key + "/n", 3) == 5
    assert other.check([key, key + "/cs"]) and not other.check([key + "/missing"])
    other.multi_set([key + "/a", key + "/b"], ["1", "2"])
    assert client.multi_get([key + "/a", key + "/b"]) == [b"1", b"2"]
    other.wait([key + "/a"])
    group_store = client.process_group_store(f"{keys.PROCESS_GROUPS}{key}/e1/s0/")  # as collectives nests it
    assert isinstance(group_store, dist.PrefixStore) and isinstance(client.inner, dist.PrefixStore)
    assert group_store.underlying_store is not client.inner.underlying_store  # a connection of its own
    group_store.set("addr", "x")
    assert not server[0].check(["addr"]) and group_store.get("addr") == b"x"
    assert client.delete_key(key) and not server[0].check([key])
