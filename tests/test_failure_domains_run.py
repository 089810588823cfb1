"""Failure domains end to end: two launchers on one host stand for two nodes in two racks, each told its rack by
``TITAN_RECOVER_FAILURE_DOMAIN``; the groups span both (part 0 of each on A, part 1 on B), so every copy of shard 0
is in rack a and every copy of shard 1 in rack b. The coordinator reads that from the launchers' claims and warns,
and the run goes on to its end."""

from __future__ import annotations

from pathlib import Path

from conftest import Node, events, on_nodes

from titan_recover.control import keys


def test_groups_whose_parts_share_a_rack_are_warned_about_from_the_launchers_domains(tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    args, env, coordinator = on_nodes(
        dump,
        "domains-test-secret",
        "--training.steps",
        "4",
        "--recover.group_nodes",
        "2",
        "--recover.snapshot_interval",
        "2",
        "--recover.fault_plan",
        "",  # no failure: the warning comes from where the groups run
    )
    env = {**env, keys.REPLICAS_ENV: "0,1"}
    env_a = {**env, keys.GROUP_NODE_ENV: "0", keys.FAILURE_DOMAIN_ENV: "rack-a"}
    env_b = {
        **env,
        keys.GROUP_NODE_ENV: "1",
        keys.FAILURE_DOMAIN_ENV: "rack-b",
        keys.COORDINATOR_ENV: coordinator,
    }
    with Node("a", dump, args, env_a) as a, Node("b", dump, args, env_b) as b:
        assert a.wait(timeout=300) == 0, a.output()[-3000:] + b.output()[-3000:]
        assert b.wait(timeout=60) == 0, b.output()[-3000:]
    found = [e for e in events(dump) if e["event"] == "domains"]
    assert len(found) == 1, found
    assert found[0]["domains"] == ["rack-a", "rack-b"] and found[0]["unknown"] == 0
    assert found[0]["shards"] == {"rack-a": [0], "rack-b": [1]}
    assert "shard(s) [0] all in 'rack-a'; shard(s) [1] all in 'rack-b'" in a.output(), a.output()[-3000:]
    assert sorted(e["step"] for e in events(dump) if e["event"] == "step") == [1, 2, 3, 4]
