"""``control_store = "nodes://..."``: the etcd cluster the run's launchers form on its own nodes, its pure parts
(the URL, which member a host runs, the members' flags). The run on a namespace cluster whose node 0 is killed
whole is ``tests/test_partitions_etcd.py``'s."""

from __future__ import annotations

import pytest

from titan_recover import config
from titan_recover.control import keys
from titan_recover.control.addresses import parse_nodes_url
from titan_recover.launch import members
from titan_recover.launch.members import Members

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


def test_a_members_data_is_kept_for_the_same_run_on_the_same_members_and_not_shared_with_other_members() -> None:
    """A relaunch (or a job requeued onto the same nodes) finds its member's data; a job requeued onto other nodes
    starts a cluster of its own, whose members' data would otherwise name peers that are not there."""
    same = Members.of("nodes://10.0.0.1,10.0.0.2,10.0.0.3")
    moved = Members.of("nodes://10.0.0.1,10.0.0.2,10.0.0.4")
    assert members.data_dir("7", same, 1) == members.data_dir("7", Members.of("nodes://10.0.0.1,10.0.0.2,10.0.0.3"), 1)
    assert members.data_dir("7", same, 1) != members.data_dir("7", moved, 1)
    assert members.data_dir("7", same, 1) != members.data_dir("8", same, 1)
    assert members.data_dir("7", same, 1).endswith(f"/7/{same.digest}/m1") and len(same.digest) == 8
