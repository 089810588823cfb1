"""The node board of a run on etcd: the leader serves the node messages from a TCPStore of its own.

Here the store that names the board is a TCPStore too (the board only reads ``keys.BOARD`` from
it); runs on a real etcd cover the rest (``test_failover``, ``test_partitions``)."""

import secrets
import time
from datetime import timedelta
from typing import Iterator

import pytest
import torch.distributed as dist

from titan_recover.control import board, keys, transport
from titan_recover.control.board import Board, BoardMissing, LeaderBoard
from titan_recover.control.client import ControlClient
from titan_recover.control.protocol import BoardAddress, MessageError
from titan_recover.control.sealed import Run, SealedStore

URL = "etcd://127.0.0.1:2379"  # only its route is taken: loopback


@pytest.fixture
def run() -> Run:
    return Run(secrets.token_hex(16), "board-test")


@pytest.fixture
def names(run: Run) -> Iterator[SealedStore]:
    """The store a launcher finds the board in (etcd in a run)."""
    port = transport.free_port()
    server = transport.serve(port, 5, run=run)
    yield transport.connect(f"127.0.0.1:{port}", timeout_s=5, run=run)
    del server


def publish(names: SealedStore, board: LeaderBoard) -> None:
    ControlClient(names).put(keys.BOARD, board.where)


def test_node_messages_go_to_the_leaders_board_and_a_new_leaders_board_is_found_after_the_old_one_closed(
    run: Run, names: SealedStore
) -> None:
    launcher = Board(run)
    with pytest.raises(BoardMissing, match="no coordinator leader serves the node messages yet"):
        launcher.set(names, "launcher/a", "m1")
    first = LeaderBoard(URL, run, 5)
    publish(names, first)
    assert first.where.host == "127.0.0.1"
    launcher.set(names, "launcher/a", "m1")
    assert first.messages(["launcher/a", "launcher/b"]) == [b"m1", b""]  # b: not written since it opened
    assert launcher.read(names, "launcher/a") == b"m1"

    first.close()
    assert transport.connection_refused(first.where.address)  # its port is free: nothing is left serving
    failures = []
    for _ in range(3):  # a write already on its way when the server closed may be taken by the socket
        start = time.monotonic()
        try:
            launcher.set(names, "launcher/a", "m2")  # etcd still names the old board
        except (dist.DistError, BoardMissing) as e:
            failures.append(e)
        assert time.monotonic() - start < 2 * board.OP_S  # a beat never waits long on a lost board
    assert len(failures) >= 2, failures

    second = LeaderBoard(URL, run, 5)
    publish(names, second)
    launcher.set(names, "launcher/a", "m3")  # looked up again
    assert second.messages(["launcher/a"]) == [b"m3"]
    second.close()


def test_a_message_not_sealed_with_the_runs_secret_is_not_read(run: Run) -> None:
    board = LeaderBoard(URL, run, 5)
    try:
        outsider = dist.TCPStore(board.where.host, board.where.port, is_master=False, timeout=timedelta(seconds=5))
        transport.in_run(outsider, Run(secrets.token_hex(16), run.id)).set("launcher/a", "forged")
        assert board.messages(["launcher/a"]) == [b""]
    finally:
        board.close()


@pytest.mark.unit
def test_a_board_address_is_validated() -> None:
    assert BoardAddress.loads(keys.BOARD, b'{"host": "10.0.0.5", "port": 29600}').address == "10.0.0.5:29600"
    with pytest.raises(MessageError, match="port in 1..65535"):
        BoardAddress.loads(keys.BOARD, b'{"host": "10.0.0.5", "port": 0}')
