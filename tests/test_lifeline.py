"""A launcher's watch of its coordinator: a launcher that was paused, a coordinator that crashed,
a store error in the launcher's main thread. Pure verdict logic, a lifeline process that is
SIGSTOPped, the launcher's loop over real child processes, and whole runs of real launchers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
from conftest import ROOT
from test_nodes import Node, events, wait_until
from test_store import COORDINATOR

from titan_recover.control import keys, transport
from titan_recover.control.etcd_store import EtcdUnavailable
from titan_recover.control.lifeline import AliveClock
from titan_recover.launch import launcher, stores
from titan_recover.node.channel import DONE, FATAL
from titan_recover.titan.jobs import job

# ---- the verdict, pure ------------------------------------------------------------------


@pytest.mark.unit
def test_the_coordinator_is_silent_only_while_its_alive_counter_stands_still() -> None:
    clock = AliveClock(timeout_s=4.0, start=100.0)
    clock.read(7, 100.0)
    assert clock.silent(103.5) == 3.5
    clock.read(8, 103.0)  # it moved
    assert clock.silent(106.5) == 3.5
    clock.read(8, 107.5)  # read again, unmoved
    assert clock.silent(107.5) == 4.5


@pytest.mark.unit
def test_a_watcher_that_was_paused_gives_the_coordinator_a_full_bound_from_when_it_runs_again() -> None:
    clock = AliveClock(timeout_s=4.0, start=0.0)
    clock.read(5, 0.0)
    for t in (0.25, 0.5, 0.75):
        assert clock.tick(t, wait_s=0.25) == 0.0  # on time
    assert clock.tick(1.9, wait_s=0.25) == 0.0  # late on a busy host, less than half the bound: still watching
    assert clock.silent(1.9) == 1.9
    assert clock.tick(12.0, wait_s=0.25) == pytest.approx(9.85)  # stopped ~10 s (SIGSTOP, a paused VM)
    assert clock.silent(12.0) == 0.0  # what it did not watch is not the coordinator's silence
    assert clock.tick(12.25, wait_s=0.25) == 0.0
    assert clock.silent(15.9) < 4.0 <= clock.silent(16.0)  # a coordinator frozen all along is still found


@pytest.mark.unit
def test_a_coordinator_that_never_showed_life_is_given_the_startup_bound() -> None:
    """A candidate on a loaded host still importing or electing a leader is not lost after
    ``coordinator_timeout_s``; once it has shown life, the shorter bound holds."""
    clock = AliveClock(timeout_s=30.0, start=0.0, startup_s=600.0)
    clock.read(0, 0.0)  # the counter exists, nobody bumped it yet
    assert clock.bound() == 600.0
    clock.read(1, 45.0)
    assert clock.bound() == 30.0


# ---- a lifeline whose process is paused ---------------------------------------------------

LAUNCHER = """
import sys, time
from titan_recover.control.lifeline import Heartbeat
lifeline = Heartbeat(sys.argv[1], "launcher/test", 0.05, coordinator_timeout_s=float(sys.argv[2]),
                     on_lost=lambda reason: print(f"LOST: {reason}", flush=True), message=lambda: "{}")
print("up", flush=True)
time.sleep(float(sys.argv[3]))
lifeline.stop()  # as a launcher does at its end: no store call of its threads left running into exit
print("done", flush=True)
"""


@contextlib.contextmanager
def watched(bound_s: float, lives_s: float) -> Iterator[tuple[int, subprocess.Popen, subprocess.Popen]]:
    """A coordinator-like process bumping its alive counter, and a process running a lifeline to it
    with ``bound_s`` for ``lives_s``, both up: (port, coordinator, watcher); both killed at the end."""
    port = transport.free_port()
    coordinator = subprocess.Popen(
        [sys.executable, "-c", COORDINATOR, str(port)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    watcher: subprocess.Popen | None = None
    try:
        assert coordinator.stdout is not None
        assert coordinator.stdout.readline() == "up\n"
        watcher = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, f"127.0.0.1:{port}", str(bound_s), str(lives_s)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert watcher.stdout is not None
        assert watcher.stdout.readline() == "up\n"
        time.sleep(1.0)  # watching a live coordinator
        yield port, coordinator, watcher
    finally:
        for proc in (coordinator, watcher):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_lifeline_paused_past_the_bound_finds_its_coordinator_alive_when_it_resumes() -> None:
    """A lifeline with a 2 s bound SIGSTOPped for 4 s: resumed, it declares nobody lost."""
    with watched(2.0, 9) as (_, _, watcher):
        os.kill(watcher.pid, signal.SIGSTOP)
        time.sleep(4.0)
        os.kill(watcher.pid, signal.SIGCONT)
        out, _ = watcher.communicate(timeout=60)
    assert "LOST" not in out, out
    assert out.endswith("done\n"), out
    assert "this launcher did not run for" in out, out  # it says why its groups may have been fenced


def test_a_lifeline_still_finds_a_frozen_coordinator_within_its_bound_and_a_probe() -> None:
    with watched(2.0, 30) as (port, coordinator, watcher):
        os.kill(coordinator.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        assert watcher.stdout is not None
        line = watcher.stdout.readline()
        took = time.monotonic() - frozen
    assert line.startswith(f"LOST: no sign of life from the coordinator at 127.0.0.1:{port}"), line
    assert 1.0 <= took <= 2.0 + 3.0, took  # the bound (from the last reading before the freeze), then a fresh probe


# ---- the launcher's loop and end, over real child processes -----------------------------


class Lost(Exception):
    """``exit_lost`` would have ended the process with this reason."""


class Groups:
    """Stands for ``Torchruns``: ``watch`` raises each of ``errors`` in turn, then finds the run done."""

    def __init__(self, agent: SimpleNamespace, errors: list[Exception]) -> None:
        self.agent, self.errors = agent, errors
        self.procs: dict[int, subprocess.Popen] = {}
        self.outcome: int | None = None
        self.killed = False
        self.leave_by: dict[int, float] = {}  # no notice: nothing leaves

    def watch(self, client: object) -> bool:
        if self.errors:
            raise self.errors.pop(0)
        self.agent.flags, self.outcome = DONE, 0
        return False

    def done(self) -> bool:
        return False

    def kill(self) -> None:
        self.killed = True

    def gone(self) -> bool:
        return False

    def stop_standbys(self) -> None:
        """None to stop: the run has no warm incarnations."""


class Lifeline:
    """Stands for ``Heartbeat``: the coordinator lives, and the run has not ended."""

    ending = False

    def settle(self) -> None:
        time.sleep(0.05)

    def stop(self) -> None:
        pass


def child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def node_launcher(coordinator: subprocess.Popen, etcd: bool, errors: list[Exception], timeout_s: float = 2.0) -> Any:
    """A ``NodeLauncher`` past ``register``, with a real coordinator process and stand-ins for the rest
    (typed ``Any``: its groups, agent, lifeline and configs are the stand-ins above, not what it declares)."""
    nl: Any = object.__new__(launcher.NodeLauncher)
    nl.rc = SimpleNamespace(coordinator_timeout_s=timeout_s)
    nl.job_config = SimpleNamespace(
        checkpoint=SimpleNamespace(enable=False), job=SimpleNamespace(dump_folder="outputs"), dump_folder="outputs"
    )  # where TorchTitan 0.2, then 0.3, keeps it
    nl.address = "etcd://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3" if etcd else "127.0.0.1:1"
    nl.store = stores.Etcd(nl.address) if etcd else stores.TcpStore()
    nl.coordinator = coordinator
    nl.agent = SimpleNamespace(flags=0, never_admitted=lambda r: False)
    nl.groups = Groups(nl.agent, errors)
    nl.lifeline = Lifeline()
    nl.lost_once = launcher.threading.Lock()
    nl.noticed = None
    nl.snapshots = None  # no snapshot folder made
    return nl


@pytest.fixture
def lost(monkeypatch: pytest.MonkeyPatch) -> None:
    def exit_lost(who: str, reason: str, hint: str) -> None:
        raise Lost(reason)

    monkeypatch.setattr(launcher, "exit_lost", exit_lost)


@pytest.mark.parametrize(
    "etcd, error",
    [
        (False, dist.DistStoreError("wait timeout after 600000ms")),
        (True, EtcdUnavailable("no etcd member answered within 600s")),
    ],
)
def test_a_store_error_while_the_coordinator_lives_is_retried_and_its_end_is_waited_for_within_a_bound(
    lost: None, etcd: bool, error: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    """The coordinator (a real process) lives on and is frozen at the run's end: the launcher retries
    its failed store calls, then stops the coordinator after the bound instead of hanging on it."""
    coordinator = child("import time; time.sleep(120)")
    nl = node_launcher(coordinator, etcd, [error, error])
    try:
        nl.loop(client=None)
        assert not nl.groups.errors and nl.agent.flags == DONE  # retried until the run ended
        start = time.monotonic()
        assert nl.drain() == 0
        assert time.monotonic() - start < 2.0 + 5.0
        assert coordinator.poll() is not None  # stopped, not left behind
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()
    assert "retrying" in caplog.text and "was still running 2s after the run ended: stopped" in caplog.text, caplog.text


def test_an_etcd_candidate_that_crashed_does_not_silence_the_lost_coordinator(lost: None) -> None:
    """On etcd the local candidate's exit code says nothing about the run: a launcher whose lifeline
    finds the coordinator silent stops, whatever its candidate did."""
    candidate = child("raise SystemExit(1)")
    candidate.wait(timeout=60)
    nl = node_launcher(candidate, etcd=True, errors=[])
    with pytest.raises(Lost, match="no sign of life"):
        nl.on_lost("no sign of life from the coordinator at etcd://x for 30s")
    assert nl.groups.killed


def test_a_coordinator_that_crashed_before_the_run_ended_is_lost(lost: None) -> None:
    coordinator = child("raise RuntimeError('a bug')")
    coordinator.wait(timeout=60)
    nl = node_launcher(coordinator, etcd=False, errors=[])
    with pytest.raises(
        Lost, match=rf"the coordinator at 127.0.0.1:1 \(pid {coordinator.pid}\) exited with code 1 before the run ended"
    ):
        nl.loop(client=None)
    assert nl.groups.killed


def test_a_coordinator_that_ended_the_run_is_not_lost(lost: None) -> None:
    for flags, code in ((DONE, 0), (FATAL, 1)):
        coordinator = child(f"raise SystemExit({code})")
        coordinator.wait(timeout=60)
        nl = node_launcher(coordinator, etcd=False, errors=[])
        nl.agent.flags = flags
        nl.on_lost("the coordinator at 127.0.0.1:1 refused the connection: its process is gone")  # returns
        nl.loop(client=None)
        assert nl.drain() == code and not nl.groups.killed


# ---- whole runs ---------------------------------------------------------------------------


def launcher_args(dump: Path, port: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "titan_recover.launch",
        *job(dump, tiny=True),
        "--training.steps",
        "4",
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--training.global_batch_size",
        "8",
        "--recover.coordinator_port",
        str(port),
        "--recover.coordinator_bind",
        "127.0.0.1",
        *extra,
    ]


def steps(dump: Path) -> list[int]:
    return [e["step"] for e in events(dump) if e["event"] == "step"]


def test_the_coordinators_launcher_paused_past_the_coordinator_timeout_carries_on_and_the_run_finishes(
    tmp_path: Path,
) -> None:
    """Launchers A (the coordinator, its child, and replica 0) and B (replica 1) stand for two nodes. Once
    step 1 is logged, A's launcher process alone is SIGSTOPped for 7 s, past coordinator_timeout_s (4 s):
    the coordinator runs on. A's ranks find their launcher silent and stop, replica 0 is fenced, and
    replica 1 holds step 2 for 20 s. Resumed, A's launcher finds the coordinator alive (no lost line, the
    coordinator is not killed) and restarts replica 0; every step is logged once and both end with exit 0."""
    dump, port = tmp_path / "dump", transport.free_port()
    args = launcher_args(
        dump,
        port,
        "--recover.coordinator_timeout_s",
        "4",
        "--recover.collective_timeout_s",
        "60",
        "--recover.fault_plan",
        "sleep replica=1 step=2 phase=optimizer seconds=20",
    )
    env = {**os.environ, keys.SECRET_ENV: "pause-test-secret", "PYTHONUNBUFFERED": "1"}
    with (
        Node("a", dump, args, {**env, keys.REPLICAS_ENV: "0"}) as a,
        Node("b", dump, args, {**env, keys.REPLICAS_ENV: "1", keys.COORDINATOR_ENV: f"127.0.0.1:{port}"}) as b,
    ):
        wait_until("step 1", lambda: 1 in steps(dump), 240, [a, b])
        os.kill(a.proc.pid, signal.SIGSTOP)
        time.sleep(7.0)
        os.kill(a.proc.pid, signal.SIGCONT)
        assert a.wait(timeout=180) == 0, a.output()[-3000:] + b.output()[-3000:]
        assert b.wait(timeout=60) == 0, b.output()[-3000:]
    assert sorted(steps(dump)) == [1, 2, 3, 4]
    assert "this launcher did not run for" in a.output(), a.output()[-3000:]
    for node in (a, b):
        assert "error: launcher: lost the titan_recover coordinator" not in node.output(), node.output()[-3000:]
        assert "titan_recover/launcher.py" not in node.output(), node.output()[-3000:]


CRASH = """
import os, sys
if sys.orig_argv[1:3] == ["-m", "titan_recover.coordinator"]:
    from titan_recover.control.client import ControlClient
    beat = ControlClient.beat_alive

    def beat_or_crash(self):
        if os.path.exists(os.environ["TITAN_TEST_CRASH"]):
            raise RuntimeError("injected coordinator crash")
        beat(self)

    ControlClient.beat_alive = beat_or_crash
"""


def test_a_coordinator_that_dies_from_a_traceback_mid_run_is_lost_on_every_node(tmp_path: Path) -> None:
    """The coordinator raises mid-run (a ``sitecustomize`` in its process raises from its alive beat once
    the test creates a file): a traceback, exit 1, no done or fatal. Its own launcher (A) and B's
    both stop at once with the lost line (exit 3), and no launcher prints a traceback."""
    dump, port, trigger = tmp_path / "dump", transport.free_port(), tmp_path / "crash-now"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(CRASH)
    args = launcher_args(dump, port, "--recover.fault_plan", "sleep replica=0 step=2 phase=optimizer seconds=60")
    env = {
        **os.environ,
        keys.SECRET_ENV: "crash-test-secret",
        "PYTHONUNBUFFERED": "1",
        "TITAN_TEST_CRASH": str(trigger),
        "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    with (
        Node("a", dump, args, {**env, keys.REPLICAS_ENV: "0"}) as a,
        Node("b", dump, args, {**env, keys.REPLICAS_ENV: "1", keys.COORDINATOR_ENV: f"127.0.0.1:{port}"}) as b,
    ):
        wait_until("step 1", lambda: 1 in steps(dump), 240, [a, b])
        trigger.touch()
        crashed = time.monotonic()
        assert a.wait(timeout=60) == 3, a.output()[-3000:]
        took = time.monotonic() - crashed
        assert b.wait(timeout=60) == 3, b.output()[-3000:]
    assert "RuntimeError: injected coordinator crash" in a.output()  # the coordinator's own traceback
    line = f"error: launcher: lost the titan_recover coordinator: the coordinator at 127.0.0.1:{port}"
    assert f"{line} (pid " in a.output() and "exited with code 1 before the run ended" in a.output(), a.output()[-3000:]
    assert line in b.output(), b.output()[-3000:]  # its port refused the connection
    assert took < 30.0, took  # at once, not after the 30 s a group gets to finish
    for node in (a, b):
        assert "titan_recover/launcher.py" not in node.output(), node.output()[-3000:]
