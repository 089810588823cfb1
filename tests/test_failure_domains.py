"""Failure domains of the host-memory snapshots' copies: where a node's domain comes from (its environment, the
config), the launcher record that carries it (old JSON without one still reads), which shards one domain's loss
would take whole (``policy.domains``), the coordinator's warning and ``domains`` event read from real claims in a
real TCPStore, and the check's line."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from launcher_in_process import run_main

from titan_recover import config
from titan_recover.config import ConfigError, CoordinatorSettings, Recover
from titan_recover.control import claims, keys, transport
from titan_recover.control.client import ControlClient
from titan_recover.control.protocol import MAX_DOMAIN, Launcher, MessageError
from titan_recover.control.sealed import SealedStore
from titan_recover.coordinator.shell import Coordinator, serve
from titan_recover.launch import check
from titan_recover.policy.domains import exposure, part_ranks, warning
from titan_recover.titan.jobs import TRAIN_CONFIGS

pytestmark = pytest.mark.unit

# ------------------------------------------------------------------ which shards one domain holds whole


def test_part_p_of_a_group_runs_a_contiguous_block_of_its_ranks() -> None:
    assert [list(part_ranks(p, 8, 2)) for p in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(part_ranks(p, 6, 3)) for p in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert list(part_ranks(0, 4, 1)) == [0, 1, 2, 3]


def test_one_domain_names_nothing_to_spread() -> None:
    found = exposure({0: [(0, "rack-a")], 1: [(0, "rack-a")]}, group_ranks=4, parts=1)
    assert found.domains == ("rack-a",) and found.single == {} and found.unknown == ()


def test_two_domains_with_every_shard_in_both_name_nothing() -> None:
    found = exposure({0: [(0, "rack-a")], 1: [(0, "rack-b")]}, group_ranks=4, parts=1)
    assert found.domains == ("rack-a", "rack-b") and found.single == {} and found.shards == ()


def test_two_domains_where_one_holds_every_copy_of_each_shard() -> None:
    """Groups spanning two nodes, part 0 of both in rack a and part 1 of both in rack b: losing rack a loses shards
    0 and 1, losing rack b shards 2 and 3, although the run spans both racks."""
    placement = {0: [(0, "rack-a"), (1, "rack-b")], 1: [(0, "rack-a"), (1, "rack-b")]}
    found = exposure(placement, group_ranks=4, parts=2)
    assert found.single == {"rack-a": (0, 1), "rack-b": (2, 3)} and found.shards == (0, 1, 2, 3)
    text = warning(found)
    assert "shard(s) [0, 1] all in 'rack-a'" in text and "shard(s) [2, 3] all in 'rack-b'" in text
    assert "Spread the replica groups' nodes over domains" in text


def test_one_group_left_names_nothing_to_spread() -> None:
    """While the other groups are away (fenced in a loss), each shard has the one copy: no placement could spread it."""
    assert exposure({1: [(0, "rack-a"), (1, "rack-b")]}, group_ranks=2, parts=2).single == {}


def test_spanning_groups_crossed_over_domains_spread_every_shard() -> None:
    placement = {0: [(0, "rack-a"), (1, "rack-b")], 1: [(0, "rack-b"), (1, "rack-a")]}
    assert exposure(placement, group_ranks=4, parts=2).single == {}


def test_one_part_in_one_domain_names_only_that_parts_shards() -> None:
    """Three groups of three parts: the parts 1 are all in rack b, the others spread."""
    placement = {
        0: [(0, "a"), (1, "b"), (2, "c")],
        1: [(0, "c"), (1, "b"), (2, "a")],
        2: [(0, "a"), (1, "b"), (2, "b")],
    }
    assert exposure(placement, group_ranks=6, parts=3).single == {"b": (2, 3)}


def test_a_copy_of_unknown_domain_may_be_elsewhere_so_its_shard_is_not_named() -> None:
    placement = {0: [(0, "rack-a"), (1, "rack-b")], 1: [(0, ""), (1, "rack-b")], 2: [(0, "rack-a"), (1, "rack-b")]}
    found = exposure(placement, group_ranks=2, parts=2)
    assert found.single == {"rack-b": (1,)} and found.unknown == (1,)
    nothing_known = exposure({0: [(0, "")], 1: [(0, "")]}, group_ranks=2, parts=1)
    assert nothing_known.domains == () and nothing_known.single == {} and nothing_known.unknown == (0, 1)


# ------------------------------------------------------------------ the launcher record and where its domain comes from


def test_a_launcher_without_a_domain_writes_the_bytes_it_always_did() -> None:
    assert Launcher("x", "h", 1).dumps() == json.dumps({"host": "h", "launcher": "x", "pid": 1}, sort_keys=True)
    placed = Launcher("x", "h", 1, "s0.leaf3")
    assert json.loads(placed.dumps()) == {"host": "h", "launcher": "x", "pid": 1, "domain": "s0.leaf3"}
    assert Launcher.loads("owner/0", placed.dumps().encode()) == placed
    assert Launcher.this("rack-7").domain == "rack-7" and Launcher.this().domain == ""


def test_an_old_launcher_record_without_a_domain_reads_as_unknown() -> None:
    old = b'{"host": "h", "launcher": "h:1:ab", "pid": 1}'  # as every launcher wrote it before domains
    assert Launcher.loads("owner/3", old) == Launcher("h:1:ab", "h", 1, "")


@pytest.mark.parametrize("bad", [7, None, ["rack"], "r" * (MAX_DOMAIN + 1)])
def test_a_domain_that_is_not_a_short_string_is_refused_naming_the_key(bad: object) -> None:
    raw = json.dumps({"host": "h", "launcher": "x", "pid": 1, "domain": bad}).encode()
    with pytest.raises(MessageError, match=r"store key 'owner/3'.*domain"):
        Launcher.loads("owner/3", raw)


def test_the_environment_wins_over_the_config_and_empty_is_unknown() -> None:
    rc = Recover(failure_domain="rack-1")
    assert config.failure_domain(rc, {keys.FAILURE_DOMAIN_ENV: "leaf-2"}) == "leaf-2"
    assert config.failure_domain(rc, {keys.FAILURE_DOMAIN_ENV: " "}) == "rack-1"  # set empty: the config's
    assert config.failure_domain(rc, {}) == "rack-1"
    assert config.failure_domain(Recover(), {}) == ""


def test_a_domain_other_launchers_would_refuse_is_refused_naming_where_it_came_from() -> None:
    with pytest.raises(ConfigError, match=keys.FAILURE_DOMAIN_ENV):
        config.failure_domain(Recover(), {keys.FAILURE_DOMAIN_ENV: "x" * (MAX_DOMAIN + 1)})
    with pytest.raises(ConfigError, match="recover.failure_domain"):
        config.failure_domain(Recover(failure_domain="x" * (MAX_DOMAIN + 1)), {})


# ------------------------------------------------------------------ the coordinator, on a real store


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., tuple[Coordinator, SealedStore]]]:
    """A coordinator of ``replicas`` groups of ``ranks`` ranks on its own TCPStore, and a client of it."""
    made: list[Coordinator] = []

    def make(replicas: int, ranks: int, **recover: Any) -> tuple[Coordinator, SealedStore]:
        job = SimpleNamespace(
            recover=Recover(enable=True, **recover),
            parallelism=SimpleNamespace(
                data_parallel_replicate_degree=replicas,
                data_parallel_shard_degree=ranks,
                tensor_parallel_degree=1,
                pipeline_parallel_degree=1,
            ),
            training=SimpleNamespace(
                steps=10, global_batch_size=4 * ranks, seq_len=16, mixed_precision_param="float32"
            ),
            checkpoint=SimpleNamespace(enable=False, folder="checkpoint"),
        )
        port = transport.free_port()
        c = serve(CoordinatorSettings.of(job, str(tmp_path)), port)
        made.append(c)
        return c, transport.connect(f"127.0.0.1:{port}", timeout_s=10)

    yield make
    for c in made:
        del c.control.store  # the coordinator's TCPStore server stops with its last reference


def domain_events(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "recover_events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "domains"]


def claim(client: SealedStore, launcher: Launcher, replicas: list[int], part: int) -> None:
    claims.claim(ControlClient(client), launcher, replicas, 1.0, logging.info, part)


def test_the_coordinator_warns_once_every_part_is_claimed_and_again_when_a_group_moves(
    make, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two groups of 4 ranks spanning 2 nodes each, with part 0 of both on rack a's nodes and part 1 on rack b's:
    nothing is said while a part is unclaimed; then one warning and one ``domains`` event naming each rack's
    shards; nothing more while the claims stay; once group 1 runs crossed over (restarted on other nodes) an event
    and a line saying every shard is spread."""
    c, client = make(replicas=2, ranks=4, group_nodes=2, snapshot_interval=2, heartbeat_timeout_s=5.0)
    a0, a1 = Launcher("a0:1:aa", "a0", 1, "rack-a"), Launcher("a1:1:aa", "a1", 1, "rack-a")
    b0, b1 = Launcher("b0:1:bb", "b0", 1, "rack-b"), Launcher("b1:1:bb", "b1", 1, "rack-b")
    claim(client, a0, [0], 0)
    claim(client, a1, [1], 0)
    claim(client, b0, [0], 1)
    now = time.monotonic()
    caplog.set_level(logging.INFO, logger="titan_recover.coordinator.shell")
    c._check_domains(now)
    assert domain_events(tmp_path) == []  # group 1's part 1 is not claimed yet
    claim(client, b1, [1], 1)
    c._check_domains(now + 1)  # read once per heartbeat timeout
    assert domain_events(tmp_path) == []
    c._check_domains(now + 5)
    (event,) = domain_events(tmp_path)
    assert event["domains"] == ["rack-a", "rack-b"] and event["unknown"] == 0
    assert event["shards"] == {"rack-a": [0, 1], "rack-b": [2, 3]}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "shard(s) [0, 1] all in 'rack-a'" in warned[0]
    c._check_domains(now + 10)
    assert len(domain_events(tmp_path)) == 1  # the same placement: nothing new
    claims.release(ControlClient(client), a1, [1], 0)
    claims.release(ControlClient(client), b1, [1], 1)
    claim(client, Launcher("b2:1:cc", "b2", 1, "rack-b"), [1], 0)
    claim(client, Launcher("a2:1:cc", "a2", 1, "rack-a"), [1], 1)
    c._check_domains(now + 15)
    spread = domain_events(tmp_path)[-1]
    assert len(domain_events(tmp_path)) == 2 and spread["shards"] == {}
    assert [r for r in caplog.records if r.levelno == logging.WARNING] != [] and any(
        "every shard now has host-memory copies in more than one failure domain" in r.getMessage()
        for r in caplog.records
    )


def test_unknown_domains_are_said_once_and_never_warned_about(
    make, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    c, client = make(replicas=2, ranks=1, snapshot_interval=2, heartbeat_timeout_s=5.0)
    claim(client, Launcher("n0:1:aa", "n0", 1), [0], 0)
    claim(client, Launcher("n1:1:bb", "n1", 1), [1], 0)
    caplog.set_level(logging.INFO, logger="titan_recover.coordinator.shell")
    now = time.monotonic()
    for i in range(3):
        c._check_domains(now + 5 * i)
    said = [r for r in caplog.records if "failure domains" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO and keys.FAILURE_DOMAIN_ENV in said[0].getMessage()
    assert [e["unknown"] for e in domain_events(tmp_path)] == [2]


def test_without_snapshots_the_claims_are_not_read_for_domains(make, tmp_path: Path) -> None:
    c, client = make(replicas=2, ranks=1, snapshot_interval=0)
    claim(client, Launcher("n0:1:aa", "n0", 1, "rack-a"), [0], 0)
    claim(client, Launcher("n1:1:bb", "n1", 1, "rack-a"), [1], 0)
    c._check_domains(time.monotonic())
    assert domain_events(tmp_path) == []


# ------------------------------------------------------------------ ./run_train.sh --check


@pytest.mark.toml("the shipped TOML configs")
@pytest.mark.parametrize(
    "env, line",
    [
        ({keys.FAILURE_DOMAIN_ENV: "s0.leaf3"}, f"'s0.leaf3' ({keys.FAILURE_DOMAIN_ENV})"),
        ({keys.FAILURE_DOMAIN_ENV: None}, f"unknown: set {keys.FAILURE_DOMAIN_ENV}"),
    ],
)
def test_the_check_prints_the_nodes_failure_domain(
    env: dict[str, str | None], line: str, capfd: pytest.CaptureFixture[str]
) -> None:
    done = run_main(
        check.main, [check.FLAG, "--job.config_file", str(TRAIN_CONFIGS / "llama3_debug_cpu.toml")], capfd, env
    )
    assert done.returncode == 0, done.stdout
    (shown,) = [ln for ln in done.stdout.splitlines() if ln.startswith("  failure domain")]
    assert shown.split(" : ", 1)[1].startswith(line), shown
