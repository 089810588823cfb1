"""The launcher's identification of a fenced incarnation's ranks (real processes)."""

import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, coordinator_command
from test_store import accepts, non_loopback_ip

from titan_recover.config import ConfigError
from titan_recover.control import addresses, keys, transport
from titan_recover.control.client import ControlClient
from titan_recover.control.sealed import Run
from titan_recover.launch import launcher, torchruns
from titan_recover.launch.torchruns import is_incarnation
from titan_recover.node.warm import WARM_ENV
from titan_recover.titan.jobs import job


def test_is_incarnation_reads_the_rank_environment() -> None:
    env = {**os.environ, keys.REPLICA_ENV: "3", keys.INCARNATION_ENV: "1", WARM_ENV: "/dev/shm/w"}
    code = "import time; print('up', flush=True); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    incarnation_1 = f"{keys.INCARNATION_ENV}=1"
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "up\n"  # past exec: /proc/<pid>/environ is its own
        assert is_incarnation(proc.pid, 3, incarnation_1)
        assert is_incarnation(proc.pid, 3, f"{WARM_ENV}=/dev/shm/w")  # a warm incarnation's own activation file
        assert not is_incarnation(proc.pid, 3, f"{WARM_ENV}=/dev/shm/other")
        assert not is_incarnation(proc.pid, 3, f"{keys.INCARNATION_ENV}=0")  # an older incarnation's pid record
        assert not is_incarnation(proc.pid, 1, incarnation_1)
        assert not is_incarnation(os.getpid(), 3, incarnation_1)  # not a rank at all
    finally:
        proc.kill()
        proc.wait()
    assert not is_incarnation(proc.pid, 3, incarnation_1)  # gone


@pytest.mark.unit
def test_ranks_on_a_host_share_its_cores(monkeypatch) -> None:
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 8)
    assert torchruns.with_threads({"A": "1"}, 4) == {"A": "1", "OMP_NUM_THREADS": "2"}
    assert torchruns.with_threads({}, 16) == {"OMP_NUM_THREADS": "1"}
    assert torchruns.with_threads({"OMP_NUM_THREADS": "3"}, 4) == {"OMP_NUM_THREADS": "3"}  # the user's choice wins


@pytest.mark.unit
def test_the_launchers_flags_replace_the_asked_ones_ahead_of_any_subcommand() -> None:
    job = ["--module", "m", "--config", "c", "--recover.replicate-backend", "auto", "activation-checkpoint:full"]
    assert launcher.with_flags(job, {"--recover.replicate_backend": "gloo"}) == [
        "--recover.replicate_backend",
        "gloo",
        "--module",
        "m",
        "--config",
        "c",
        "activation-checkpoint:full",
    ]
    assert launcher.with_flags(
        ["--recover.replicate_backend=nccl", "--x", "1", "--comm.train_timeout_seconds", "100"],
        {"--recover.replicate_backend": "nccl", "--comm.train_timeout_seconds": "250"},
    ) == ["--recover.replicate_backend", "nccl", "--comm.train_timeout_seconds", "250", "--x", "1"]


@pytest.mark.unit
def test_coordinator_listens_on_loopback_when_every_group_is_local() -> None:
    assert launcher.coordinator_bind("", [0, 1], 2) == "127.0.0.1"
    assert launcher.coordinator_bind("", [1, 0], 2) == "127.0.0.1"
    assert launcher.coordinator_bind("10.0.0.5", [0, 1], 2) == "10.0.0.5"  # the user's choice wins


@pytest.mark.unit
def test_coordinator_of_a_multi_node_run_needs_an_address() -> None:
    assert launcher.coordinator_bind("0.0.0.0", [0, 1], 4) == "0.0.0.0"
    assert launcher.coordinator_bind("10.0.0.5", [0], 2) == "10.0.0.5"
    with pytest.raises(ConfigError) as info:
        launcher.coordinator_bind("", [0, 1], 4)
    assert "[2, 3]" in str(info.value) and "coordinator_bind" in str(info.value)


@pytest.mark.unit
def test_a_single_node_launcher_makes_a_fresh_secret_per_run() -> None:
    first, second = launcher.choose_secret({}, only_this_node=True), launcher.choose_secret({}, only_this_node=True)
    assert len(first) == 32 and first != second
    assert launcher.choose_secret({keys.SECRET_ENV: "given"}, only_this_node=True) == "given"  # the user's wins


@pytest.mark.unit
def test_a_multi_node_launcher_needs_the_users_secret() -> None:
    assert launcher.choose_secret({keys.SECRET_ENV: "shared"}, only_this_node=False) == "shared"
    for env in ({}, {keys.SECRET_ENV: ""}):
        with pytest.raises(ConfigError) as info:
            launcher.choose_secret(env, only_this_node=False)
        assert f"set {keys.SECRET_ENV} to the same value" in str(info.value)


def test_the_coordinator_serves_its_run_only_on_loopback(tmp_path) -> None:
    """The real coordinator process as a single-node launcher starts it (no coordinator_bind)."""
    port = transport.free_port()
    env = {**os.environ, keys.COORDINATOR_ENV: f"127.0.0.1:{port}", keys.SECRET_ENV: "this-run"}
    cmd = coordinator_command(job(tmp_path))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = transport.connect(f"127.0.0.1:{port}", timeout_s=60, run=Run("this-run", ""))
        assert ControlClient(client).epoch() == 0
        with pytest.raises(transport.WrongRunError):
            transport.connect(f"127.0.0.1:{port}", timeout_s=1, run=Run("another-run", ""))
        ip = non_loopback_ip()
        if ip is not None:
            assert not accepts(ip, port)
    finally:
        proc.kill()
        proc.wait()


def test_sigusr1_prints_every_threads_stack_and_the_process_goes_on() -> None:
    code = (
        "import os, signal, sys, threading, time\n"
        "from titan_recover.node.procs import dumps_stacks\n"
        "dumps_stacks()\n"
        "threading.Thread(target=time.sleep, args=(5,), name='sleeper', daemon=True).start()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "print('still running', flush=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "still running\n", r.stderr[-2000:]
    assert "Current thread" in r.stderr and "Thread 0x" in r.stderr, r.stderr[-2000:]  # the main thread and the sleeper


@pytest.mark.unit
def test_a_group_spanning_nodes_meets_at_part_0s_rendezvous_and_needs_a_reachable_coordinator() -> None:
    meet = torchruns.Meeting("10.0.0.5", 29600, 1, 4, 600.0)
    cmd = torchruns.torchrun(2, ["--x.y", "1"], "replica3", meet)
    assert cmd[cmd.index("--nnodes") : cmd.index("--nproc_per_node=2")] == [
        "--nnodes",
        "4",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.5",
        "--master-port",
        "29600",
        "--rdzv-conf",
        "timeout=600",
    ]
    assert "--standalone" not in cmd and "--standalone" in torchruns.torchrun(2, [], "replica0")
    assert torchruns.Span(1, 4).of(3) == "replica group 3 (part 1 of 4)" and torchruns.Span().of(3) == "replica group 3"
    # every group here, but half of each elsewhere
    with pytest.raises(ConfigError, match="the replica groups span 2 nodes"):
        launcher.coordinator_bind("", [0, 1], 2, parts=2)
    assert launcher.coordinator_bind("127.0.0.1", [0, 1], 2, parts=2) == "127.0.0.1"
    assert addresses.route_address("127.0.0.1:29500") == "127.0.0.1"


@pytest.mark.unit
@pytest.mark.parametrize(
    "version,budget,grace",
    [
        ("2.13.0+cpu", 12.0, torchruns.Grace(12.0, ("--shutdown-timeout", "22"), None)),  # this machine's
        ("2.14.1", 100.0, torchruns.Grace(100.0, ("--shutdown-timeout", "110"), None)),  # AWS spot's budget
        ("2.12.0", 12.5, torchruns.Grace(12.5, ("--shutdown-timeout", "23"), None)),  # the first with the flag
        ("2.12.0a0+git1234", 60.0, torchruns.Grace(60.0, ("--shutdown-timeout", "70"), None)),
        ("3.0.0", 5.0, torchruns.Grace(5.0, ("--shutdown-timeout", "15"), None)),
        ("2.11.0", 12.0, torchruns.Grace(12.0, (), None)),  # the GPU machine's: within torchrun's 30 s
        ("2.11.0", 20.0, torchruns.Grace(20.0, (), None)),
    ],
)
def test_torchrun_is_told_the_notice_budget_where_it_can_be(
    version: str, budget: float, grace: torchruns.Grace
) -> None:
    assert torchruns.torchrun_grace(version, budget) == grace


@pytest.mark.unit
@pytest.mark.parametrize("version", ["2.11.0", "2.9.1+cu128", "unknown"])
def test_before_torch_2_12_a_budget_torchrun_would_cut_short_is_cut_saying_why(version: str) -> None:
    grace = torchruns.torchrun_grace(version, 100.0)
    assert (grace.budget_s, grace.flags) == (20, ())
    assert grace.cut is not None
    assert grace.cut.startswith(
        "recover.notice_budget_s = 100s is cut to 20s for a SIGTERM notice (a drain keeps 100s)"
    )
    assert f"torch {version}'s torchrun SIGKILLs its ranks 30s after its own SIGTERM" in grace.cut
    assert "torch >= 2.12" in grace.cut


@pytest.mark.unit
def test_the_installed_torchrun_takes_the_shutdown_flags_before_the_module() -> None:
    from torch.distributed.run import get_args_parser

    grace = torchruns.torchrun_grace(torch.__version__, 12.0)
    cmd = torchruns.torchrun(2, ["--x.y", "1"], "replica0", grace=grace.flags)
    args = get_args_parser().parse_args(cmd[3:])  # past python -m torch.distributed.run
    assert (args.training_script, args.training_script_args) == ("titan_recover.train", ["--x.y", "1"])
    assert args.shutdown_timeout == (22 if grace.flags else None)


def test_a_rank_whose_parent_died_before_it_asked_to_die_with_it_does_not_live_on() -> None:
    """A torchrun agent SIGKILLed while its rank still imports (seconds, before ``die_with_parent``):
    the rank, adopted by init by then, must end instead of waiting for a coordinator that is gone."""
    child = "import time; time.sleep(1.0); from titan_recover import procs; procs.die_with_parent(); time.sleep(60)"
    parent = (
        f"import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', {child!r}], "
        "stdout=subprocess.DEVNULL).pid, flush=True)"
    )
    out = subprocess.run([sys.executable, "-c", parent], cwd=ROOT, capture_output=True, text=True, timeout=30)
    pid = int(out.stdout)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, 9)
    raise AssertionError(f"the orphaned child {pid} lived on")
