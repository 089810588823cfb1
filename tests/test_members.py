"""``control_store = "nodes://..."``: the etcd cluster the run's launchers form on its own nodes, its pure parts
(the URL, which member a host runs, the members' flags). The run on a namespace cluster whose node 0 is killed
whole is ``tests/test_partitions_etcd.py``'s."""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from titan_recover import config
from titan_recover.control import keys
from titan_recover.control.addresses import parse_etcd_url, parse_nodes_url
from titan_recover.control.etcd_store import client_endpoints, cluster_of, followed
from titan_recover.launch import members
from titan_recover.launch.members import Members
from titan_recover.policy import etcd_members

pytestmark = pytest.mark.unit

ADDRESSES = {"n0": "10.0.0.1", "n1": "10.0.0.2", "n2": "10.0.0.3"}


def test_a_nodes_url_names_three_or_five_hosts_each_with_etcds_port_unless_given() -> None:
    assert parse_nodes_url("nodes://n0,n1:2479, n2") == [("n0", 2379), ("n1", 2479), ("n2", 2379)]
    assert len(parse_nodes_url("nodes://a,b,c,d,e")) == 5


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("etcd://n0:2379,n1:2379,n2:2379", "does not start with nodes://"),
        ("nodes://n0,n1", "names 2 node(s): etcd members on 3 or 5 nodes"),
        ("nodes://a,b,c,d", "names 4 node(s)"),
        ("nodes://n0,n1,n0:2479", "lists a host twice"),
        ("nodes://127.0.0.1,n1,n2", "'127.0.0.1' is loopback"),
        ("nodes://localhost,n1,n2", "'localhost' is loopback"),
        ("nodes://n0:65535,n1,n2", "leaves no peer port after it"),
        ("nodes://n0:0,n1,n2", "out of range"),
        ("nodes://[::1],n1,n2", "IPv6 is not supported"),
        ("nodes://n0,,n2", "is not a host name"),
    ],
)
def test_a_bad_nodes_url_is_refused_naming_what_is_wrong(url: str, named: str) -> None:
    with pytest.raises(ValueError, match=None) as refused:
        parse_nodes_url(url)
    assert named in str(refused.value), refused.value


def test_the_config_refuses_a_bad_nodes_url_saying_what_each_form_means() -> None:
    rc = config.Recover(control_store="nodes://n0,n1")
    with pytest.raises(config.ConfigError) as refused:
        config._check_control_store(rc)
    assert "recover.control_store" in str(refused.value) and "nodes://host,host,host" in str(refused.value)


def test_the_members_flags_make_one_cluster_every_process_dials_by_the_hosts_names() -> None:
    m = Members.of("nodes://n0,n1:2479,n2", ADDRESSES.__getitem__)
    assert m.etcd_url == "etcd://n0:2379,n1:2479,n2:2379"
    assert m.cluster == "m0=http://10.0.0.1:2380,m1=http://10.0.0.2:2480,m2=http://10.0.0.3:2380"
    assert (m.client(1), m.peer(1)) == ("http://10.0.0.2:2479", "http://10.0.0.2:2480")


def test_a_host_runs_the_member_whose_address_is_its_own_or_none() -> None:
    m = Members.of("nodes://n0,n1,n2", ADDRESSES.__getitem__)
    assert m.here(lambda ip: ip == "10.0.0.3") == 2
    assert m.here(lambda ip: False) is None


def test_a_nodes_store_without_the_runs_id_is_refused_before_any_member_starts() -> None:
    with pytest.raises(config.ConfigError, match=keys.RUN_ENV):
        members.form("nodes://n0,n1,n2", {}, "/nonexistent", 1.0)


def test_a_member_nodes_name_that_does_not_resolve_yet_is_looked_up_again_within_the_bound() -> None:
    """A pod's name exists once its pod does (a Job's pods start in any order): the launcher asks again, and names
    the host after ``startup_timeout_s``; a malformed URL is refused at once."""
    up = {"n0": "10.0.0.1", "n1": "10.0.0.2"}

    def lookup(host: str) -> str:
        if host not in up:
            up["n2"] = "10.0.0.3"  # up at the next look
            raise ValueError(f"host {host!r} does not resolve to an IPv4 address")
        return up[host]

    assert members.resolved("nodes://n0,n1,n2", 5.0, lookup).ips == ("10.0.0.1", "10.0.0.2", "10.0.0.3")
    t0 = time.monotonic()
    with pytest.raises(
        config.ConfigError, match=r"host 'n9' does not resolve .* after 0.2s \(recover.startup_timeout_s"
    ):
        members.resolved("nodes://n0,n1,n9", 0.2, lookup)
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(config.ConfigError, match="names 2 node"):
        members.resolved("nodes://n0,n1", 60.0, lookup)


def test_a_members_data_is_kept_for_the_same_run_on_the_same_members_and_not_shared_with_other_members() -> None:
    """A relaunch (or a job requeued onto the same nodes) finds its member's data; a job requeued onto other nodes
    starts a cluster of its own, whose members' data would otherwise name peers that are not there."""
    same = Members.of("nodes://10.0.0.1,10.0.0.2,10.0.0.3")
    moved = Members.of("nodes://10.0.0.1,10.0.0.2,10.0.0.4")
    assert members.data_dir("7", same, 1) == members.data_dir("7", Members.of("nodes://10.0.0.1,10.0.0.2,10.0.0.3"), 1)
    assert members.data_dir("7", same, 1) != members.data_dir("7", moved, 1)
    assert members.data_dir("7", same, 1) != members.data_dir("8", same, 1)
    assert members.data_dir("7", same, 1).endswith(f"/7/{same.digest}/m1") and len(same.digest) == 8


# --- a lost member replaced (``policy.etcd_members``, the keepers' decision) -------------------------------------

PEERS = {f"m{i}": f"http://10.0.0.{i + 1}:2380" for i in range(6)}
SPARE = etcd_members.Volunteer("10.0.0.4", PEERS["m3"])


def seen(*live: str, silent: tuple[str, ...] = (), unstarted: tuple[str, ...] = ()) -> list[etcd_members.Seen]:
    """Members by name: ``live`` answering, ``silent`` not; ``unstarted`` added with these peers' names, no name."""
    return [
        *(etcd_members.Seen(f"id-{n}", n, PEERS[n], True) for n in live),
        *(etcd_members.Seen(f"id-{n}", n, PEERS[n], False) for n in silent),
        *(etcd_members.Seen(f"id-{n}", "", PEERS[n], False) for n in unstarted),
    ]


def test_a_member_silent_for_the_bound_is_removed_by_the_lowest_live_members_keeper_first() -> None:
    keeping = etcd_members.Keeping(3, after_s=10.0)
    members = seen("m1", "m2", silent=("m0",))
    assert keeping.decide(members, [SPARE], "m1", now=100.0) is None  # silent since now
    assert keeping.decide(members, [SPARE], "m1", now=109.9) is None
    assert keeping.decide(members, [SPARE], "m2", now=110.0) is None  # not the lowest live member's keeper
    change = keeping.decide(members, [SPARE], "m1", now=110.0)
    assert change == etcd_members.Remove(members[2], 10.0)


def test_a_member_that_answers_again_starts_its_bound_over() -> None:
    keeping = etcd_members.Keeping(3, after_s=10.0)
    keeping.decide(seen("m1", "m2", silent=("m0",)), [SPARE], "m1", now=100.0)
    keeping.decide(seen("m0", "m1", "m2"), [SPARE], "m1", now=105.0)
    assert keeping.decide(seen("m1", "m2", silent=("m0",)), [SPARE], "m1", now=112.0) is None
    assert isinstance(keeping.decide(seen("m1", "m2", silent=("m0",)), [SPARE], "m1", 122.0), etcd_members.Remove)


def test_a_keeper_that_sees_no_majority_answer_changes_nothing() -> None:
    """A keeper cut off sees the live side silent: it must not try to remove it."""
    keeping = etcd_members.Keeping(3, after_s=1.0)
    members = seen("m0", silent=("m1", "m2"))
    keeping.decide(members, [SPARE], "m0", now=0.0)
    assert keeping.decide(members, [SPARE], "m0", now=60.0) is None


def test_after_the_removal_a_volunteer_is_added_with_every_started_member_and_a_new_name() -> None:
    keeping = etcd_members.Keeping(3, after_s=10.0)
    change = keeping.decide(seen("m1", "m2"), [SPARE], "m1", now=0.0)
    assert change == etcd_members.Add(SPARE, "m3", f"m1={PEERS['m1']},m2={PEERS['m2']},m3={PEERS['m3']}")


def test_without_a_volunteer_a_lost_member_stays_listed() -> None:
    """Three nodes: removing the lost member would leave two of two, no quorum more than two of three live."""
    keeping = etcd_members.Keeping(3, after_s=10.0)
    members = seen("m1", "m2", silent=("m0",))
    keeping.decide(members, [], "m1", now=0.0)
    assert keeping.decide(members, [], "m1", now=60.0) is None
    assert keeping.decide(members, [SPARE], "m1", now=61.0) == etcd_members.Remove(members[2], 61.0)


def test_nothing_is_added_without_a_volunteer_nor_a_volunteer_that_is_a_member_already() -> None:
    keeping = etcd_members.Keeping(3, after_s=10.0)
    assert keeping.decide(seen("m1", "m2"), [], "m1", now=0.0) is None
    member = etcd_members.Volunteer("10.0.0.2", PEERS["m1"])
    assert keeping.decide(seen("m1", "m2"), [member], "m1", now=0.0) is None
    assert keeping.decide(seen("m1", "m2"), [member, SPARE], "m1", now=0.0) == etcd_members.Add(
        SPARE, "m3", f"m1={PEERS['m1']},m2={PEERS['m2']},m3={PEERS['m3']}"
    )


def test_a_member_added_and_never_started_is_waited_for_then_removed() -> None:
    keeping = etcd_members.Keeping(3, after_s=10.0)
    members = seen("m1", "m2", unstarted=("m3",))
    other = etcd_members.Volunteer("10.0.0.5", PEERS["m4"])
    assert keeping.decide(members, [other], "m1", now=0.0) is None  # its node starts it
    assert keeping.decide(members, [other], "m1", now=9.0) is None
    assert keeping.decide(members, [other], "m1", now=10.0) == etcd_members.Remove(members[2], 10.0)


def test_a_whole_cluster_is_left_alone_and_five_members_are_kept_as_five() -> None:
    assert etcd_members.Keeping(3, after_s=1.0).decide(seen("m0", "m1", "m2"), [SPARE], "m0", now=0.0) is None
    five = etcd_members.Keeping(5, after_s=1.0)
    change = five.decide(seen("m0", "m1", "m2", "m4"), [etcd_members.Volunteer("10.0.0.6", PEERS["m5"])], "m0", 0.0)
    assert isinstance(change, etcd_members.Add) and change.name == "m5", change


def test_a_clients_endpoints_are_the_started_members_client_addresses_and_nothing_malformed() -> None:
    listed = [
        {"ID": "1", "name": "m0", "clientURLs": ["http://10.0.0.1:2379"]},
        {"ID": "2", "name": "", "peerURLs": ["http://10.0.0.4:2380"]},  # added, not started: no client address
        {"ID": "3", "name": "m2", "clientURLs": ["https://10.0.0.3:2379"]},  # not what the run's members serve
        {"ID": "4", "name": "m3", "clientURLs": ["http://10.0.0.4"]},  # no port
        {"ID": "5", "name": "m4", "clientURLs": [7]},
        "not a member",
        {"ID": "6", "name": "m5", "clientURLs": ["http://n5:2479"]},
    ]
    assert client_endpoints(listed) == {"1": ("10.0.0.1", 2379), "6": ("n5", 2479)}
    assert client_endpoints("not a list") == {}  # type: ignore[arg-type]


def test_a_process_started_now_is_given_the_members_as_this_process_last_read_them() -> None:
    """What a replacement job the run submits joins (``Submitter``'s ``JOIN_RUN``): not the URL the run began with
    where a lost member was replaced since."""
    url = "etcd://10.9.0.1:2379,10.9.0.2:2379,10.9.0.3:2379"  # a cluster no other test dials
    assert followed(url) == url  # no client of it in this process
    cluster_of(parse_etcd_url(url)).endpoints = [("10.9.0.2", 2379), ("10.9.0.4", 2379)]  # as ``follow`` leaves it
    assert followed(url) == "etcd://10.9.0.2:2379,10.9.0.4:2379"
    named = "etcd://localhost:12379,127.0.0.1:12380,127.0.0.1:12381"  # the same members, read back as addresses
    cluster_of(parse_etcd_url(named)).endpoints = [("127.0.0.1", 12380), ("127.0.0.1", 12379), ("127.0.0.1", 12381)]
    assert followed(named) == named


def test_a_member_host_back_without_its_data_or_removed_volunteers_and_otherwise_starts_its_member() -> None:
    peer = PEERS["m0"]
    started = {peer: True, PEERS["m1"]: True, PEERS["m2"]: True}
    assert not etcd_members.volunteers_instead(None, peer, kept=False)  # nobody answers: the run's first start
    assert not etcd_members.volunteers_instead({**started, peer: False}, peer, kept=False)  # first start, host late
    assert not etcd_members.volunteers_instead(started, peer, kept=True)  # restarted with its data: it catches up
    assert etcd_members.volunteers_instead(started, peer, kept=False)  # its data gone with the node
    removed = {PEERS["m1"]: True, PEERS["m2"]: True, PEERS["m3"]: True}
    assert etcd_members.volunteers_instead(removed, peer, kept=True)  # replaced meanwhile: its data is of no use


def test_a_lost_members_own_node_volunteering_replaces_it_once_the_bound_is_over() -> None:
    """Three nodes, node 0 back without its data: its offer is at m0's own peer address."""
    keeping = etcd_members.Keeping(3, after_s=10.0)
    members = seen("m1", "m2", silent=("m0",))
    back = etcd_members.Volunteer("10.0.0.1", PEERS["m0"])
    assert keeping.decide(members, [back], "m1", now=0.0) is None
    assert keeping.decide(members, [back], "m1", now=10.0) == etcd_members.Remove(members[2], 10.0)
    change = keeping.decide(seen("m1", "m2"), [back], "m1", now=11.0)
    assert change == etcd_members.Add(back, "m3", f"m1={PEERS['m1']},m2={PEERS['m2']},m3={PEERS['m0']}")


@contextlib.contextmanager
def answering(body: bytes) -> Iterator[int]:
    """A member's client port on loopback that answers every request with ``body``; its port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_starting_member_host_reads_the_running_members_from_another_and_nothing_where_none_listens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    local = ("127.0.0.1", "127.0.0.1")
    alone = Members(("n0", "n1"), local, (free_port(), free_port()))
    begun = time.monotonic()
    assert members.listed(alone, 0) is None  # the run's first start: nobody to ask, and no wait
    assert time.monotonic() - begun < 1.0
    # etcd 3.4.23's answer while m0 and m1 of a first start run and m2 has not started: named, no client address
    running = (
        b'{"members": [{"name": "m1", "peerURLs": ["http://10.0.0.2:2380"], "clientURLs": ["http://10.0.0.2:2379"]},'
        b' {"name": "m2", "peerURLs": ["http://10.0.0.3:2380"]}]}'
    )
    with answering(running) as port:
        assert members.listed(Members(("n0", "n1"), local, (free_port(), port)), 0) == {
            "http://10.0.0.2:2380": True,
            "http://10.0.0.3:2380": False,
        }
    with answering(b'{"members": "m0"}') as port:  # not etcd's answer: not taken, said, and the wait bounded
        assert members.listed(Members(("n0", "n1"), local, (free_port(), port)), 0, timeout_s=0.5) is None
    assert "in a form not etcd's" in caplog.text
