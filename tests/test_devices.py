"""Tests for titan_recover.node.devices: GPUs per replica group and the replicate backend.

Pure decisions from a host's facts; the launcher test at the end runs the real
launcher on this (GPU-less) machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launcher_in_process import launch_argv

from titan_recover.config import ConfigError
from titan_recover.control import transport
from titan_recover.node import devices
from titan_recover.node.devices import host_gpus, plan
from titan_recover.policy.membership import Membership
from titan_recover.rank.collectives import CollectiveAborted, ReplicateProcessGroups

ROOT = Path(__file__).resolve().parents[1]
GPUS8 = [str(i) for i in range(8)]


@pytest.mark.unit
def test_cpu_host_runs_gloo_and_leaves_the_environment_alone() -> None:
    for requested in ("auto", "gloo"):
        p = plan(requested, [], groups=2, ranks=2, nccl_available=False)
        assert (p.backend, p.visible) == ("gloo", [None, None])
    assert "no GPUs" in plan("auto", [], 2, 2, True).reason


@pytest.mark.unit
def test_nccl_on_a_cpu_host_names_the_key_and_the_way_out() -> None:
    with pytest.raises(ConfigError, match=r'recover.replicate_backend = "nccl" needs CUDA GPUs.*use "gloo" or "auto"'):
        plan("nccl", [], groups=2, ranks=1, nccl_available=False)


@pytest.mark.unit
def test_groups_get_disjoint_gpus_and_nccl_when_the_host_has_enough() -> None:
    p = plan("auto", GPUS8, groups=2, ranks=4, nccl_available=True)
    assert p.backend == "nccl"
    assert p.visible == ["0,1,2,3", "4,5,6,7"]
    assert plan("nccl", GPUS8, groups=8, ranks=1, nccl_available=True).visible == GPUS8


@pytest.mark.unit
def test_groups_share_gpus_beyond_the_hosts_count_and_auto_falls_back_to_gloo() -> None:
    one = plan("auto", ["0"], groups=2, ranks=1, nccl_available=True)
    assert (one.backend, one.visible) == ("gloo", ["0", "0"])
    assert "2 groups x 1 ranks share 1 GPUs" in one.reason
    # every rank of a group still has a GPU of its own (NCCL inside the group needs it)
    three = plan("auto", ["0", "1", "2"], groups=2, ranks=2, nccl_available=True)
    assert three.visible == ["0,1", "2,0"]
    for visible in three.visible:
        assert visible is not None and len(set(visible.split(","))) == 2


@pytest.mark.unit
def test_nccl_asked_for_where_it_cannot_run_says_why() -> None:
    with pytest.raises(ConfigError, match="share 1 GPUs, and NCCL needs one GPU per rank"):
        plan("nccl", ["0"], groups=2, ranks=1, nccl_available=True)
    with pytest.raises(ConfigError, match="built without NCCL"):
        plan("nccl", GPUS8, groups=2, ranks=2, nccl_available=False)
    no_nccl = plan("auto", GPUS8, groups=2, ranks=2, nccl_available=False)
    assert no_nccl.backend == "gloo" and "without NCCL" in no_nccl.reason


@pytest.mark.unit
def test_gloo_asked_for_keeps_the_gpus_but_not_nccl() -> None:
    p = plan("gloo", GPUS8, groups=2, ranks=2, nccl_available=True)
    assert (p.backend, p.visible) == ("gloo", ["0,1", "2,3"])


@pytest.mark.unit
def test_a_group_larger_than_the_host_is_refused() -> None:
    with pytest.raises(
        ConfigError, match="a replica group of 4 ranks .* needs 4 GPUs, one per rank, and this host has 2"
    ):
        plan("auto", ["0", "1"], groups=1, ranks=4, nccl_available=True)


@pytest.mark.unit
def test_host_gpus_follow_cuda_visible_devices() -> None:
    assert host_gpus(None, 3) == ["0", "1", "2"]
    assert host_gpus("4, 6", 2) == ["4", "6"]
    assert host_gpus("", 0) == []
    assert plan("auto", host_gpus("4,6", 2), groups=2, ranks=1, nccl_available=True).visible == ["4", "6"]


@pytest.mark.unit
def test_rank_per_host_runs_every_communicator_on_nccl_with_shared_gpus() -> None:
    p = plan("auto", ["0"], groups=2, ranks=2, nccl_available=True, rank_per_host=True)
    assert (p.backend, p.visible, p.rank_per_host) == ("nccl", ["0,0", "0,0"], True)
    assert "each rank posing as a host of its own" in p.reason and "not a performance setup" in p.reason
    assert plan("nccl", ["0", "1"], groups=2, ranks=2, nccl_available=True, rank_per_host=True).visible == [
        "0,1",
        "0,1",
    ]
    own = plan("auto", GPUS8, groups=2, ranks=4, nccl_available=True, rank_per_host=True)  # enough GPUs: not needed
    assert (own.backend, own.visible, own.rank_per_host) == ("nccl", ["0,1,2,3", "4,5,6,7"], False)
    assert own.reason.endswith("; recover.nccl_rank_per_host not needed")
    # gloo asked for: the replicate dimension on gloo, FSDP inside the groups still NCCL, so ranks still pose as hosts
    assert plan("gloo", ["0"], groups=2, ranks=2, nccl_available=True, rank_per_host=True).rank_per_host
    with pytest.raises(
        ConfigError, match="recover.nccl_rank_per_host needs NCCL, and this torch was built without NCCL"
    ):
        plan("auto", ["0"], groups=2, ranks=2, nccl_available=False, rank_per_host=True)
    cpu = plan("auto", [], groups=2, ranks=2, nccl_available=False, rank_per_host=True)
    assert (cpu.backend, cpu.rank_per_host) == ("gloo", False) and "has nothing to do" in cpu.reason
    with pytest.raises(ConfigError, match="or \\(tests only\\) set recover.nccl_rank_per_host"):
        plan("auto", ["0"], groups=1, ranks=2, nccl_available=True)


@pytest.mark.unit
def test_a_rank_per_host_rank_sees_its_gpu_as_cuda0_and_has_a_host_id_of_its_own() -> None:
    group = devices.group_env("0,1", rank_per_host=True)
    assert group == {"CUDA_VISIBLE_DEVICES": "0,1", devices.RANK_GPUS_ENV: "0,1", **devices.RANK_PER_HOST_NCCL}
    assert devices.group_env("0,0", rank_per_host=True)["CUDA_VISIBLE_DEVICES"] == "0"
    assert devices.group_env("2,3", rank_per_host=False) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert devices.group_env(None, rank_per_host=False) == {}
    env = {**group, "LOCAL_RANK": "1", "TITAN_RECOVER_REPLICA": "3"}
    mine = devices.rank_env(env, host="h")
    assert mine == {
        "CUDA_VISIBLE_DEVICES": "1",
        "LOCAL_RANK": "0",
        devices.SLOT_ENV: "1",
        "NCCL_HOSTID": "h-titan-recover-g3-r1",
    }
    assert devices.local_rank({**env, **mine}) == 1 and devices.local_rank({"LOCAL_RANK": "2"}) == 2
    assert devices.rank_env({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0,1"}) == {}  # not rank per host: untouched
    with pytest.raises(ConfigError, match="names no GPU for local rank 2"):
        devices.rank_env({**env, "LOCAL_RANK": "2"})


RANK_SCRIPT = """
import json, os
from titan_recover.node import devices
os.environ.update(devices.rank_env(os.environ))
print(json.dumps({k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "NCCL_HOSTID", "NCCL_NET")}
                 | {"slot": devices.local_rank(os.environ)}), flush=True)
"""


def test_torchruns_workers_share_one_environment_and_each_makes_its_own(tmp_path: Path) -> None:
    """torchrun hands every local worker the group's environment: the ranks of two groups on one
    GPU end with one GPU each as cuda:0, their own slots and four distinct NCCL host ids."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    seen = []
    for replica, visible in enumerate(
        plan("auto", ["0"], groups=2, ranks=2, nccl_available=True, rank_per_host=True).visible
    ):
        env = {
            **os.environ,
            **devices.group_env(visible, True),
            "TITAN_RECOVER_REPLICA": str(replica),
            "PYTHONPATH": str(ROOT),
        }
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        seen += [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted(s["slot"] for s in seen) == [0, 0, 1, 1]
    assert {(s["CUDA_VISIBLE_DEVICES"], s["LOCAL_RANK"], s["NCCL_NET"]) for s in seen} == {("0", "0", "Socket")}
    assert len({s["NCCL_HOSTID"] for s in seen}) == 4


@pytest.fixture
def address() -> Iterator[str]:
    port = transport.free_port()
    server = transport.serve(port, timeout_s=10)
    yield f"127.0.0.1:{port}"
    del server


def test_replica_groups_on_different_backends_are_refused(address: str) -> None:
    ReplicateProcessGroups(transport.connect(address, 10), replica=0, group_rank=0, timeout_s=10, backend="gloo")
    ReplicateProcessGroups(transport.connect(address, 10), replica=1, group_rank=0, timeout_s=10, backend="gloo")
    with pytest.raises(
        ConfigError, match="replica 2 runs the replicate dimension on nccl, another replica group on gloo"
    ):
        ReplicateProcessGroups(transport.connect(address, 10), replica=2, group_rank=0, timeout_s=10, backend="nccl")


class _StuckGroup:
    """Stands in for an NCCL communicator whose peer died: its work never completes.

    Only the bookkeeping is under test here (which groups get aborted, and how often);
    real NCCL needs GPUs, which this suite never has.
    """

    def __init__(self) -> None:
        self.aborts = 0
        self.launched = False

    def allreduce(self, tensors: list[torch.Tensor], *opts: object) -> object:
        self.launched = True
        return type("Work", (), {"is_completed": lambda self: False})()

    broadcast = allreduce

    def abort(self) -> None:
        self.aborts += 1


def new_group(made: list[_StuckGroup]) -> _StuckGroup:
    """Stands for ``_new_group``: a stuck group, kept in ``made``."""
    made.append(_StuckGroup())
    return made[-1]


def test_abandoned_nccl_groups_are_aborted_once(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", raising=False)
    made: list[_StuckGroup] = []
    groups = ReplicateProcessGroups(
        transport.connect(address, 10), replica=0, group_rank=0, timeout_s=7, backend="nccl"
    )
    assert os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "7"
    monkeypatch.setattr(groups, "_new_group", lambda *args: new_group(made))

    def epoch_over() -> bool:  # the coordinator moves on once the all-reduce is stuck in flight
        return made[-1].launched if made else False

    with pytest.raises(CollectiveAborted, match="all-reduce in epoch 1: the epoch ended first"):
        groups.allreduce(Membership(1, (0, 1)), [torch.zeros(3)], abort=epoch_over)
    assert [g.aborts for g in made] == [1]
    # the next epoch builds a new group; the aborted one is not aborted again
    with pytest.raises(CollectiveAborted, match="epoch 2"):
        groups.allreduce(Membership(2, (0, 1)), [torch.zeros(3)], abort=epoch_over)
    assert [g.aborts for g in made] == [1, 1]
    # a transfer pair is aborted once the transfer is over, and once only if it broke
    with groups.pair(epoch=3, joiner=1, donor=True, abort=lambda: False) as pair:
        assert pair is made[-1] and made[-1].aborts == 0
    assert [g.aborts for g in made] == [1, 1, 1]
    with pytest.raises(CollectiveAborted, match="state transfer"):
        with groups.pair(epoch=4, joiner=1, donor=True, abort=epoch_over) as pair:
            groups.broadcast(pair, torch.zeros(3), abort=epoch_over)
    assert [g.aborts for g in made] == [1, 1, 1, 1]


def test_gloo_groups_are_parked_not_aborted(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[_StuckGroup] = []
    groups = ReplicateProcessGroups(
        transport.connect(address, 10), replica=0, group_rank=0, timeout_s=7, backend="gloo"
    )
    monkeypatch.setattr(groups, "_new_group", lambda *args: new_group(made))
    with pytest.raises(CollectiveAborted, match="the epoch ended first"):
        groups.allreduce(Membership(1, (0, 1)), [torch.zeros(3)], abort=lambda: bool(made) and made[0].launched)
    assert made[0].aborts == 0  # gloo has no abort that is safe with a dead peer: parked instead


@pytest.mark.skipif(dist.is_nccl_available(), reason="checks the refusal on a host without NCCL")
def test_launcher_refuses_nccl_without_gpus_before_starting_anything(capfd: pytest.CaptureFixture[str]) -> None:
    config = ["--job.config_file", str(ROOT / "train_configs" / "llama3_debug_cpu.toml")]
    proc = launch_argv([*config, "--recover.replicate_backend", "nccl"], capfd)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert 'recover.replicate_backend = "nccl" needs CUDA GPUs' in proc.stderr
    assert "replica group" not in proc.stdout  # no coordinator, no group
