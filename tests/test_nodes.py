"""Multi-node launchers: claims of replica groups."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from titan_recover import claims, store


@pytest.fixture
def client() -> Iterator[dist.Store]:
    port = store.free_port()
    server = store.serve(port, 5)
    yield store.connect(f"127.0.0.1:{port}", timeout_s=5)
    del server


class Lifeline:
    """Beats a launcher's counter like its ``store.Heartbeat`` does, until stopped."""

    def __init__(self, client: dist.Store, launcher: claims.Launcher) -> None:
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, args=(client.clone(), launcher.key), daemon=True)
        self.thread.start()

    def _beat(self, client: dist.Store, key: str) -> None:
        while not self.stopped.wait(0.1):
            client.add(key, 1)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


def test_a_live_launchers_claim_is_refused_quickly_and_a_silent_ones_taken_over(client: dist.Store) -> None:
    first, second, lines = claims.Launcher.this(), claims.Launcher.this(), []
    lifeline = Lifeline(client, first)
    claims.claim(client, first, [0, 1], stale_s=5.0, log=lines.append)
    assert lines == [] and claims.holds(client, first, 0) and claims.holds(client, first, 1)
    assert [claims.incarnation(client, r) for r in (0, 1)] == [0, 0]  # their first starts
    started = time.monotonic()
    with pytest.raises(claims.ClaimRefused) as info:
        claims.claim(client, second, [2, 1], stale_s=5.0, log=lines.append)
    assert time.monotonic() - started < 2.0  # a live owner answers within its beat, not the whole bound
    message = str(info.value)
    assert message.startswith(f"replica groups [1] already run under a live launcher ([1] by {first})"), message
    assert f"on host {first.host} (pid {first.pid})" in message and store.REPLICAS_ENV in message
    assert claims.holds(client, first, 1) and client.get(store.owner_key(2)) == b""  # its claim on 2 released
    lifeline.stop()  # the first launcher dies
    claims.claim(client, second, [2, 1], stale_s=0.5, log=lines.append)
    assert claims.holds(client, second, 1) and claims.holds(client, second, 2) and not claims.holds(client, first, 1)
    assert lines[-1] == f"took over replica groups [1] from {first}, which shows no sign of life"
    assert claims.incarnation(client, 1) == 1  # the replacement's group rejoins; a new group starts at 0
    assert claims.incarnation(client, 2) == 0


def test_a_malformed_claim_is_refused_naming_the_key(client: dist.Store) -> None:
    client.set(store.owner_key(0), '{"launcher": 7, "host": "h", "pid": 1}')
    with pytest.raises(claims.ClaimRefused, match=r"cannot tell who runs replica groups \[0\]: store key 'owner/0'"):
        claims.claim(client, claims.Launcher.this(), [0], stale_s=0.1, log=print)

