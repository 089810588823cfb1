"""Warm incarnations (titan_recover.node.warm, titan_recover.launch.standbys): the activation message
and the host-memory fit (pure), a warm rank's wait and the launcher's standbys over real processes
(a warm one that dies, one taken over once the failed ranks are gone), and a whole run whose killed
group comes back as its warm incarnation."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import run_job

from titan_recover.compare import compare_runs
from titan_recover.control import keys
from titan_recover.launch import standbys
from titan_recover.launch.standbys import Standbys
from titan_recover.node import warm
from titan_recover.node.channel import CHANNEL_ENV, CHANNEL_FILE, shm_dir
from titan_recover.node.procs import pid_alive
from titan_recover.node.warm import WARM_ENV, Activation, WarmError

# ---- the activation and the fit, pure ----------------------------------------------------


@pytest.mark.unit
def test_an_activation_reads_back_as_written_and_anything_else_is_named() -> None:
    message = Activation(2, 3, "/dev/shm/titan_recover-1-r2-a3-ab")
    assert Activation.parse(message.dumps(), replica=2) == message
    bad = {
        "{": "not JSON",
        "[]": "must be an object",
        json.dumps({"replica": 2, "attempt": 3}): "must be an object",
        json.dumps({"replica": 1, "attempt": 3, "channel": "c"}): "stands in for replica 2",
        json.dumps({"replica": 2, "attempt": 0, "channel": "c"}): "is not a restart's",
        json.dumps({"replica": 2, "attempt": True, "channel": "c"}): "is not a restart's",
        json.dumps({"replica": 2, "attempt": 3, "channel": ""}): "is not a file path",
    }
    for text, why in bad.items():
        with pytest.raises(WarmError, match=why):
            Activation.parse(text, replica=2)


@pytest.mark.unit
def test_warm_ranks_go_where_the_node_has_the_memory_and_auto_where_it_has_the_cores(tmp_path: Path) -> None:
    plenty = 64 * 2**30
    assert warm.off_because("auto", False, plenty, cores=8, training=4, waiting=4) == ""
    assert "recover.warm = off" in warm.off_because("off", False, plenty, 8, 4, 4)
    assert "spans nodes" in warm.off_because("on", True, plenty, 8, 4, 4)
    cores = warm.off_because("auto", False, plenty, cores=2, training=4, waiting=4)
    assert "2 cores for 4 training ranks" in cores and "recover.warm = on" in cores
    assert warm.off_because("on", False, plenty, cores=2, training=4, waiting=4) == ""  # on: despite the cores
    need = 4 * warm.RANK_BYTES
    assert warm.off_because("on", False, 2 * need, 8, 4, 4) == ""
    memory = warm.off_because("on", False, 2 * need - 1, 8, 4, 4)  # never overridden
    assert "4 waiting ranks need up to 6.0 GiB of host memory" in memory, memory
    assert "recover.warm" not in memory
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   12000000 kB\n")
    assert warm.host_available_bytes(str(meminfo)) == 12000000 * 1024
    assert warm.host_available_bytes(str(tmp_path / "none")) == 0


@pytest.mark.unit
def test_a_warm_rank_checks_the_job_then_waits_for_its_activation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "activation")
    checked: list[str] = []
    built = lambda config: (config, os.environ[keys.INCARNATION_ENV], os.environ[CHANNEL_ENV])  # noqa: E731
    monkeypatch.delenv(WARM_ENV, raising=False)
    assert warm.stand_by(built, checked.append) is built  # a cold rank builds at once
    monkeypatch.setenv(WARM_ENV, path)
    monkeypatch.setenv(keys.REPLICA_ENV, "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv(keys.INCARNATION_ENV, raising=False)
    monkeypatch.delenv(CHANNEL_ENV, raising=False)

    def launcher() -> None:
        while not os.path.exists(warm.ready_file(path, 0)):  # the rank says it waits
            time.sleep(0.01)
        Activation(1, 4, "/dev/shm/ch").write(path)

    thread = threading.Thread(target=launcher)
    thread.start()
    assert warm.stand_by(built, checked.append)("job") == ("job", "4", "/dev/shm/ch")
    thread.join()
    assert checked == ["job"]  # checked (importing the model's modules) before it waited


@pytest.mark.unit
def test_a_warm_rank_refuses_an_activation_for_another_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "activation"
    path.write_text(Activation(0, 1, "/dev/shm/ch").dumps())
    monkeypatch.setenv(WARM_ENV, str(path))
    monkeypatch.setenv(keys.REPLICA_ENV, "1")
    with pytest.raises(WarmError, match="names replica 0; this warm rank stands in for replica 1"):
        warm.stand_by(lambda config: config, lambda config: None)("job")


# ---- the launcher's standbys, over real processes ----------------------------------------

WAITS = "import os, sys, time; open(os.environ['TITAN_RECOVER_WARM'] + '.ready0', 'w').close(); time.sleep(60)"


class Trains:
    """The agent's view the standbys read: which groups train."""

    def __init__(self, *replicas: int) -> None:
        self.replicas = set(replicas)

    def training(self, replica: int) -> bool:
        return replica in self.replicas


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def wait_for(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_group_that_trains_gets_one_warm_incarnation_and_a_dead_one_is_replaced_then_given_up(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    now = [0.0]
    ready: list[tuple[int, float]] = []
    group = sleeper()
    pool = Standbys(
        lambda r: [sys.executable, "-c", WAITS],
        {0: dict(os.environ), 1: dict(os.environ)},
        1,
        Trains(0),  # type: ignore[arg-type]
        lambda: now[0],
        lambda r, s: ready.append((r, s)),
    )
    procs = {0: group, 1: group}
    try:
        pool.keep(procs, set())
        assert set(pool.waiting) == {0}  # group 1 does not train yet: its own start goes first
        first = pool.waiting[0]
        assert first.proc.pid != group.pid and os.path.dirname(first.path) in ("/dev/shm", "/tmp")
        now[0] = 7.0

        def looked_ready() -> bool:
            pool.keep(procs, set())
            return first.ready

        wait_for(looked_ready, "the warm rank's ready file")
        assert ready == [(0, 7.0)]
        for lost in range(1, standbys.TRIES + 1):
            standby = pool.waiting[0]
            standby.proc.kill()
            standby.proc.wait()
            pool.keep(procs, set())  # noticed
            assert 0 not in pool.waiting and pool.lost[0] == lost
            assert not any(os.path.exists(f) for f in standby.files(1))
            now[0] += standbys.RETRY_S - 1
            pool.keep(procs, set())
            assert 0 not in pool.waiting  # not before RETRY_S
            now[0] += 1
            pool.keep(procs, set())
        assert 0 not in pool.waiting  # TRIES died unused: the group restarts cold from now on
        assert f"{standbys.TRIES} died: the group restarts cold from now on" in caplog.text
    finally:
        pool.stop()
        group.kill()
        group.wait()


def test_a_warm_incarnation_takes_over_only_once_the_failed_ranks_are_gone() -> None:
    failed = sleeper()
    pool = Standbys(
        lambda r: [sys.executable, "-c", WAITS],
        {1: dict(os.environ)},
        1,
        Trains(1),  # type: ignore[arg-type]
        time.monotonic,
        lambda r, s: None,
    )
    try:
        pool.keep({1: failed}, set())
        standby = pool.waiting[1]
        threading.Timer(0.5, failed.kill).start()
        start = time.monotonic()
        assert pool.take(1, [failed.pid]) is standby
        assert time.monotonic() - start >= 0.4  # it waited for the failed rank to be gone
        proc = standby.activate(3, "/dev/shm/channel")
        assert proc is standby.proc and Activation.parse(Path(standby.path).read_text(), 1).incarnation == 3
        assert pool.take(1, []) is None  # none waits now: cold, and the activated one's files are gone
        assert not any(os.path.exists(f) for f in standby.files(1))
    finally:
        standby.proc.kill()
        standby.proc.wait()
        pool.stop()


# ---- a whole run ------------------------------------------------------------------------


def test_a_killed_group_comes_back_as_its_warm_incarnation_on_the_same_trajectory(tmp_path: Path) -> None:
    """A tiny 2 x 2 run with warm incarnations: replica 1 is killed once its warm incarnation was started
    (it may still be importing on a loaded host), that incarnation becomes number 1, rejoins, and the run's
    losses are its failure-free twin's (the twin without warm incarnations: they change nothing it computes)."""
    steps = ["--training.steps", "40", "--recover.digest_interval", "10"]
    # replica 0 waits at step 25 until replica 1 is back: on a loaded host its warm incarnation may still be importing
    fault = (
        "kill replica=1 rank=1 step=20 phase=backward; sleep replica=0 step=25 phase=optimizer seconds=120 until=epoch"
    )
    reference = run_job(tmp_path / "reference", *steps, "--recover.fault_plan", "none")
    assert reference.returncode == 0, reference.output[-3000:]
    run = run_job(tmp_path / "run", *steps, "--recover.warm", "on", "--recover.fault_plan", fault)
    assert run.returncode == 0, run.output[-3000:]
    assert "warm incarnations: on" in run.output
    started = {(e["replica"], e["attempt"]): e["warm"] for e in run.of("group_started")}
    assert started == {(0, 0): False, (1, 0): False, (1, 1): True}, started
    assert run.of("rejoined") and run.of("rejoined")[0]["replica"] == 1, run.output[-3000:]
    assert "its warm incarnation" in run.output and "takes over as attempt 1" in run.output
    result = compare_runs(reference.events, run.events, rel_tol=1e-5)
    assert not result.problems, result.problems
    assert result.steps == 40
    leftovers = [m for m in map(CHANNEL_FILE.fullmatch, os.listdir(shm_dir())) if m and "-warm-" in m.group(0)]
    assert not [m.group(0) for m in leftovers if not pid_alive(int(m.group(1)))]  # its launcher removed its files
