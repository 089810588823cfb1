"""The etcd control store over a long run: the same ``compare_set`` as TCPStore (released claims can be
claimed again), exact counters when one store object is shared by threads, and bounded state:
per-client markers that go with their client, one client per thread and address, and a history
that the run's leader compacts itself (a real cluster has no auto-compaction unless told)."""

from __future__ import annotations

import random
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist
from etcd3gw.exceptions import ConnectionFailedError
from test_etcd_store import client, cluster, raw  # noqa: F401  # the fixtures: both stores, one etcd cluster

from titan_recover.control import claims, etcd_store, keys, leader, transport
from titan_recover.control.client import ControlClient
from titan_recover.control.etcd_store import EtcdStore, put_op
from titan_recover.control.protocol import Launcher, NodeMessage
from titan_recover.control.sealed import Run
from titan_recover.tools.etcd_local import LocalEtcd


def test_compare_set_expecting_empty_takes_a_key_holding_empty(client: dist.Store) -> None:  # noqa: F811
    client.set("released", "")
    assert client.compare_set("released", "", "mine") == b"mine"  # TCPStore: "" matches missing or empty
    assert client.get("released") == b"mine"
    assert client.compare_set("released", "mine", "") == b""
    assert client.compare_set("released", "", "again") == b"again"
    assert client.compare_set("held", "", "first") == b"first"
    assert client.compare_set("held", "", "second") == b"first"  # a value other than "": not set, its value


def test_a_claim_released_after_a_refusal_is_claimed_by_another_launcher_on_etcd(cluster: LocalEtcd) -> None:  # noqa: F811
    run = Run(Run.from_env().secret, uuid.uuid4().hex)
    store = raw(cluster)  # kept: the PrefixStore over it holds only its C++ half
    control = ControlClient(transport.in_run(store, run))
    assert control.begin()
    first, second, third = Launcher.this(), Launcher.this(), Launcher.this()
    stopped = threading.Event()

    def beat() -> None:  # the first launcher's lifeline: its node message changes, as a live one's does
        seq = 0
        while not stopped.wait(0.1):
            seq += 1
            control.write_node(first, NodeMessage(seq, {}))

    lifeline = threading.Thread(target=beat, daemon=True)
    lifeline.start()
    try:
        claims.claim(control, first, [1], stale_s=5.0, log=print)
        with pytest.raises(claims.ClaimRefused, match=r"replica groups \[1\] already run under a live launcher"):
            claims.claim(control, second, [2, 1], stale_s=5.0, log=print)
        assert control.store.get(keys.owner_key(2)) == b""  # the refused launcher released group 2
        assert claims.claim(control, third, [2], stale_s=5.0, log=print) == []
        assert claims.holds(control, third, 2) and claims.holds(control, first, 1)
    finally:
        stopped.set()
        lifeline.join()


def lose_answers(store: EtcdStore, rate: float, seed: int) -> list[int]:
    """Makes ``rate`` of the store's counter writes apply on etcd while their answer is lost, as
    when the member died mid-request; the list counts them."""
    rng, lost = random.Random(seed), []
    for c in store._clients:

        def post(url: str, *args: object, _post=c.post, **kwargs: object) -> object:
            answer = _post(url, *args, **kwargs)
            if url.endswith("kv/txn") and "request_put" in str(kwargs.get("json")) and rng.random() < rate:
                lost.append(1)
                raise ConnectionFailedError("answer lost")
            return answer

        c.post = post  # type: ignore[method-assign]  # this client loses some answers
    return lost


def test_adds_from_many_threads_on_one_store_stay_exact_while_answers_are_lost(cluster: LocalEtcd) -> None:  # noqa: F811
    shared, key = raw(cluster, 30), f"votes/{uuid.uuid4().hex}"
    lost = lose_answers(shared, rate=0.3, seed=1)
    seen: list[int] = []

    def count() -> None:
        for _ in range(40):
            seen.append(shared.add(key, 1))

    threads = [threading.Thread(target=count) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(lost) > 10  # the case under test happened
    assert raw(cluster).add(key, 0) == 320 and sorted(seen) == list(range(1, 321))  # none applied twice


def test_a_clients_add_marker_goes_with_it(cluster: LocalEtcd, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setattr(etcd_store, "MARKER_TTL_S", 2.0)
    store = raw(cluster, timeout_s=0.5)
    store.add(f"n/{uuid.uuid4().hex}", 1)
    assert store.range(store._marker) is not None
    deadline = time.monotonic() + 15
    while store.range(store._marker) is not None:  # its client is gone: nothing renews the marker's lease
        assert time.monotonic() < deadline, "the marker of a client that stopped outlived its lease"
        time.sleep(0.2)


def test_reconnects_reuse_the_threads_etcd_client(cluster: LocalEtcd) -> None:  # noqa: F811
    first = transport.etcd(cluster.url, 5.0)
    assert all(transport.etcd(cluster.url, 5.0) is first for _ in range(5))  # a lifeline reconnecting in a loop
    assert transport.etcd(cluster.url, 7.0) is not first  # another timeout, another client
    other: list[dist.Store] = []
    t = threading.Thread(target=lambda: other.append(transport.etcd(cluster.url, 5.0)))
    t.start()
    t.join()
    assert other[0] is not first  # a thread never waits behind another's requests
    first.set_timeout(timedelta(seconds=9))  # its caller's own setting: not handed to the next
    assert transport.etcd(cluster.url, 5.0) is not first


def fill(store: EtcdStore, txns: int, value: bytes) -> None:
    """``txns`` revisions of 64 puts each: the history a run's node messages write."""
    for _ in range(txns):
        store.txn([], [put_op(f"fill/{i}", value) for i in range(64)])


def test_compacting_the_history_stops_the_database_growing(cluster: LocalEtcd) -> None:  # noqa: F811
    store = EtcdStore(raw(cluster).endpoints[:1], 30)  # one member, the one measured

    def compacted_round() -> tuple[int, int]:
        fill(store, 100, bytes(1024))  # ~6 MB of history
        written = store.db_size()[1]
        store.compact(store.revision())
        deadline = time.monotonic() + 20
        while (size := store.db_size())[1] > written / 2:  # the member frees the pages in the background
            assert time.monotonic() < deadline, f"compaction freed nothing: {size} after writing {written}"
            time.sleep(0.1)
        return size

    sizes = [compacted_round() for _ in range(5)]  # (file, in use) after each; in use is bounded by the wait
    files = [file for file, _ in sizes]  # each round reuses the pages the last one freed (a few pages of slack)
    assert max(files[2:]) < 1.05 * max(files[:2]) + 65536, sizes
    fill(store, 300, bytes(1024))  # the same history, never compacted
    assert store.db_size()[1] > sizes[-1][0] + 10_000_000, sizes  # it all stays, beyond the file's size so far


def test_the_leader_compacts_the_history_older_than_its_window(
    cluster: LocalEtcd,  # noqa: F811 (the fixture, by name)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(leader, "COMPACT_EVERY_S", 0.5)
    monkeypatch.setattr(leader, "KEEP_HISTORY_S", 1.0)
    store = raw(cluster)
    store.set("history", "old")
    old = store.revision()
    lease = leader.Lease(raw(cluster), f"run/compact-test/{uuid.uuid4().hex}", 3.0)
    assert lease.campaign(ended=lambda: False) is not None
    try:
        deadline = time.monotonic() + 20
        while True:
            store.set("history", "new")
            try:
                store.range("history", old)
            except etcd_store.EtcdRefused as e:
                assert "compacted" in str(e)
                break
            assert time.monotonic() < deadline, "the leader did not compact its history"
            time.sleep(0.2)
        assert store.range("history") is not None  # the current revision stays
    finally:
        lease.resign()
