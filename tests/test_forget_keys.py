"""``ControlClient``'s forgetting calls on both real stores: an epoch's keys go, including the
rendezvous keys gloo names itself, and nothing of a later epoch whose number starts the same."""

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist
from conftest import local_etcd

from titan_recover.control import addresses, keys, transport
from titan_recover.control.client import COMMIT, ControlClient
from titan_recover.control.etcd_store import EtcdStore
from titan_recover.control.sealed import Run, SealedStore

RUN = Run("s3cret", "forget")


@pytest.fixture(params=["tcp", "etcd"])
def store(request: pytest.FixtureRequest) -> Iterator[SealedStore]:
    if request.param == "tcp":
        tcp = dist.TCPStore(
            "127.0.0.1", transport.free_port(), is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False
        )
        yield transport.in_run(tcp, RUN)
        return
    cluster = local_etcd(3)
    raw = EtcdStore(addresses.parse_etcd_url(cluster.url), 5.0)  # a PrefixStore holds only its C++ half: kept here
    try:
        yield transport.in_run(raw, RUN)
    finally:
        cluster.stop()


def test_an_epochs_members_and_group_rendezvous_keys_are_forgotten(store: SealedStore) -> None:
    client = ControlClient(store)
    for epoch in (3, 13):
        store.set(keys.members_key(epoch), "m")
        store.set(keys.replicate_group_prefix(epoch, 0) + "/0/1", "gloo")  # a name gloo chose
        store.set(keys.transfer_group_prefix(epoch, 1, 2) + "/0/0", "gloo")
    client.forget_epochs(range(3, 4))
    gone = [
        keys.members_key(3),
        keys.replicate_group_prefix(3, 0) + "/0/1",
        keys.transfer_group_prefix(3, 1, 2) + "/0/0",
    ]
    kept = [
        keys.members_key(13),
        keys.replicate_group_prefix(13, 0) + "/0/1",
        keys.transfer_group_prefix(13, 1, 2) + "/0/0",
    ]
    assert not any(store.inner.check([k]) for k in gone)
    assert all(store.inner.check([k]) for k in kept)


def test_a_steps_keys_are_forgotten(store: SealedStore) -> None:
    client = ControlClient(store)
    for step in (1, 2):
        for name in (
            keys.step_key(step),
            keys.digest_key(step, 0),
            keys.digest_key(step, 1),
            keys.decision_key(step, 0),
        ):
            store.set(name, "x")
        client.vote(step, 0, "0.0", expected=3, outcome=COMMIT)  # a third vote would decide
        client.vote(step, 0, "1.0", expected=3, outcome=COMMIT)
    client.forget_steps(range(1, 2), range(0, 1), replicas=2)
    assert not store.inner.check([keys.step_key(1)]) and client.votes(1, 0) == 0
    assert not store.inner.check([keys.digest_key(1, 1)]) and not store.inner.check([keys.decision_key(1, 0)])
    assert (
        store.inner.check([keys.step_key(2), keys.digest_key(2, 1), keys.decision_key(2, 0)])
        and client.votes(2, 0) == 2
    )
