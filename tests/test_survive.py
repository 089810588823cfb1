"""What a long run meets, with real processes: a frozen or killed coordinator, a rank that
stops making progress, a leader dying right after a commit, a replica whose parameters
diverge, and an error that is the job's own rather than a failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, SINGLES, Run, assert_same_trajectory, run_job

from titan_recover.control import keys, transport
from titan_recover.titan.jobs import job

NO_RESTART = ["--recover.max_restarts", "0"]  # the survivors finish the run; a restart would only cost seconds


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _tree(pid: int) -> list[int]:
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(_children(p))
    return tree


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _steps_logged(dump: Path) -> int:
    path = dump / "recover_events.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"event": "step"' in line)


def _described(pids: list[int]) -> list[str]:
    out = []
    for p in pids:
        try:
            out.append(f"{p}: {Path(f'/proc/{p}/cmdline').read_bytes().replace(bytes(1), b' ').decode()[:200]}")
        except OSError:
            pass
    return out


def _kernel_view(pid: int) -> str:
    """What the kernel says of a process that ignores SIGUSR1: its state and signal masks, and
    every thread's state, wait channel, syscall and kernel stack (a hang below Python)."""
    proc = Path(f"/proc/{pid}")
    lines = []
    try:
        lines += [
            x
            for x in (proc / "status").read_text().splitlines()
            if x.split(":")[0] in ("State", "Threads", "SigQ", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
        ]
        for task in sorted((proc / "task").iterdir()):
            info = {}
            for name in ("comm", "wchan", "syscall", "stack"):
                try:
                    info[name] = (task / name).read_text().strip()
                except OSError as e:
                    info[name] = f"({e.strerror})"
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            lines.append(
                f"task {task.name} {info['comm']} state {state} wchan {info['wchan']} syscall {info['syscall']}"
            )
            lines += ["    " + x for x in info["stack"].splitlines()]
    except OSError as e:
        lines.append(f"({pid}: {e.strerror})")
    return "\n".join(lines)


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["SIGSTOP", "SIGKILL"])
def test_a_frozen_or_killed_coordinator_stops_every_process_with_one_line(tmp_path: Path, sig: signal.Signals) -> None:
    cmd = [
        sys.executable,
        "-m",
        "titan_recover.launch",
        *job(tmp_path, tiny=True),
        *(SINGLES if sig == signal.SIGKILL else []),  # a frozen coordinator takes down 2-rank groups, too
        "--training.steps",
        "500",
        "--recover.fault_plan",
        "none",
        "--recover.coordinator_timeout_s",
        "4",
    ]
    # output to files: a pipe would also wait for every process that inherited it, and the
    # launcher's own exit is what is measured here (leftovers are checked below, by name)
    out_path, err_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    coordinator, run = None, []
    try:
        deadline = time.monotonic() + 240
        while _steps_logged(tmp_path) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
            time.sleep(0.2)
        run = _tree(proc.pid)
        (coordinator,) = [
            p for p in _children(proc.pid) if b"titan_recover.coordinator" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        os.kill(coordinator, sig)
        start = time.monotonic()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGUSR1)  # the launcher prints every thread's stack (launch.dumps_stacks)
            time.sleep(2)
            pytest.fail(
                f"the launcher still ran 60s after the coordinator got {sig.name}; alive: "
                f"{_described([p for p in _tree(proc.pid) if _alive(p)])}\nlauncher {proc.pid}, as the "
                f"kernel sees it:\n{_kernel_view(proc.pid)}\n{err_path.read_text()[-6000:]}"
            )
        took = time.monotonic() - start
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in run) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in run if _alive(p)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in run:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    err_text = err_path.read_text()
    assert proc.returncode == 3, err_text[-3000:]
    (line,) = [x for x in err_text.splitlines() if x.startswith("error: launcher: lost the titan_recover coordinator")]
    assert "127.0.0.1:" in line and "To resume, run the same command again" in line
    assert ("no sign of life" if sig == signal.SIGSTOP else "signal 9") in line, line
    assert took < (4 + 10 if sig == signal.SIGSTOP else 10), took  # the bound, not a TCP timeout
    assert not left, _described(left)  # no rank, agent or coordinator is left behind


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_coordinator_killed_or_frozen_before_it_serves_stops_both_nodes_within_the_bound(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """Two launchers on this host stand for two nodes: A starts the coordinator and replica 0, B runs replica 1 and
    dials A's port. The coordinator is killed or frozen the moment its process starts (while it still imports
    torch): neither launcher may wait out ``startup_timeout_s`` (600 s). A: killed, within a handshake try (in CI it
    once waited, the coordinator killed before A's own connect had found it); frozen, within
    ``coordinator_timeout_s`` (5 s here), its CPU time standing still (before, the main job's 7 processes waited
    without a word, 150 s watched).
    B, frozen case: once A is gone, its port refuses B's next handshake try (``transport.HANDSHAKE_TRY_S``;
    before, B's one try waited out the whole bound). Both exit 3 with the lost line, and no process is left. In
    the killed case A's port closes before B first dials it, and B cannot tell a coordinator gone from one not
    started yet: it waits ``startup_timeout_s`` (node 0 is still special on the TCPStore), so it is stopped."""
    dump = tmp_path / "dump"
    port = transport.free_port()
    args = [
        sys.executable,
        "-m",
        "titan_recover.launch",
        *job(dump, tiny=True),
        *SINGLES,
        "--recover.fault_plan",
        "none",
        "--recover.coordinator_timeout_s",
        "5",
        "--recover.coordinator_port",
        str(port),
        "--recover.coordinator_bind",
        "127.0.0.1",
    ]
    env = {**os.environ, keys.SECRET_ENV: "frozen-coordinator-test-secret", "PYTHONUNBUFFERED": "1"}
    env_b = {**env, keys.REPLICAS_ENV: "1", keys.COORDINATOR_ENV: f"127.0.0.1:{port}"}
    logs = {name: tmp_path / f"{name}.log" for name in "ab"}
    nodes = {}  # plain processes, not the tests' forked launchers: what is timed is each one's own exit
    for name, node_env in (("a", {**env, keys.REPLICAS_ENV: "0"}), ("b", env_b)):
        with logs[name].open("w") as out:
            nodes[name] = subprocess.Popen(
                args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=node_env
            )
    a, b = nodes["a"], nodes["b"]
    tree: list[int] = []
    try:
        deadline, coordinator = time.monotonic() + 120, None
        while coordinator is None:
            assert a.poll() is None and time.monotonic() < deadline, logs["a"].read_text()[-3000:]
            found = [p for p in _tree(a.pid) if b"titan_recover.coordinator" in _cmdline(p)]
            coordinator = found[0] if found else None
            time.sleep(0.02)
        tree = _tree(a.pid) + _tree(b.pid)
        os.kill(coordinator, sig)
        start = time.monotonic()
        code_a = a.wait(timeout=60)
        took_a = time.monotonic() - start
        if sig == signal.SIGKILL:  # A's port closed before B dialled it: B cannot tell "gone" from "not yet up"
            b.kill()
        code_b = b.wait(timeout=60)
        took_b = time.monotonic() - start
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in tree if _alive(p)]
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for p in tree:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    print(f"{sig.name} -> A exited {code_a} after {took_a:.1f}s, B {code_b} after {took_b:.1f}s")

    def lost_line(node: str) -> str:
        (line,) = [x for x in logs[node].read_text().splitlines() if x.startswith("error: launcher: lost the titan_")]
        assert "To resume, run the same command again" in line, line
        return line

    assert code_a == 3, logs["a"].read_text()[-3000:]
    if sig == signal.SIGKILL:
        assert f"(pid {coordinator}) died of signal 9" in lost_line("a")
        assert took_a < transport.HANDSHAKE_TRY_S + 5, took_a  # its handshake's next try, not startup_timeout_s
    else:
        assert f"(pid {coordinator}) used no CPU for 5s while starting" in lost_line("a")
        assert 5 <= took_a < 5 + 10, took_a  # the bound, not startup_timeout_s
        assert code_b == 3, logs["b"].read_text()[-3000:]
        assert f"its port at 127.0.0.1:{port} accepted this client, then refused it" in lost_line("b")
        assert took_b < took_a + transport.HANDSHAKE_TRY_S + 10, (took_a, took_b)
    assert not left, _described(left)  # no rank, agent or coordinator is left behind


def test_the_leader_dying_right_after_a_commit_loses_no_step(tmp_path: Path, two_singles: Run) -> None:
    """Replica 0 (the leader, which used to log steps) dies after step 3 was agreed: replica 1
    applies step 3 and its record is the one logged; every step once. (No restart: none is checked.)"""
    run = run_job(
        tmp_path,
        *SINGLES,
        *NO_RESTART,
        "--recover.fault_plan",
        "kill replica=0 rank=0 step=3 phase=optimizer",
    )
    assert run.returncode == 0, run.output[-3000:]
    assert sorted(run.steps()) == list(range(1, 11))
    assert_same_trajectory(two_singles, run, rel_tol=1e-3, num_microbatches=4)
    assert [e["replica"] for e in run.of("failure")] == [0]


def test_a_rank_sleeping_past_the_collective_timeout_is_fenced_after_bounded_retries(
    tmp_path: Path, two_singles: Run
) -> None:
    run = run_job(
        tmp_path,
        *SINGLES,
        *NO_RESTART,
        "--recover.fault_plan",
        "sleep replica=1 rank=0 step=3 seconds=120",
        "--recover.collective_timeout_s",
        "3",
        "--recover.max_step_retries",
        "2",
    )
    assert run.returncode == 0, run.output[-3000:]
    (failure,) = run.of("failure")
    assert failure["replica"] == 1 and "never did" in failure["cause"], failure
    retries = [line for line in run.output.splitlines() if "retrying step 3 with the same members" in line]
    assert len(retries) == 2 and "(retry 2 of at most 2)" in retries[-1], retries
    assert_same_trajectory(two_singles, run, rel_tol=1e-3, num_microbatches=4)


def test_a_stuck_main_loop_is_fenced_although_its_heartbeat_thread_runs(tmp_path: Path, two_singles: Run) -> None:
    run = run_job(
        tmp_path,
        *SINGLES,
        *NO_RESTART,
        "--recover.fault_plan",
        "sleep replica=1 rank=0 step=3 seconds=120",
        "--recover.progress_timeout_s",
        "5",
    )
    assert run.returncode == 0, run.output[-3000:]
    (failure,) = run.of("failure")
    assert failure["replica"] == 1 and "made no progress" in failure["cause"] and "step 3" in failure["cause"], failure
    assert_same_trajectory(two_singles, run, rel_tol=1e-3, num_microbatches=4)


def test_a_diverged_replica_leaves_and_rejoins_with_a_live_peers_state(tmp_path: Path) -> None:
    # replica 0 sleeps at step 3 until replica 1's restart is admitted (as in test_rejoin): the tiny
    # model's steps are faster than a restart (60 s at most: 30 was not always enough on a busy 2-core machine)
    plan = (
        "corrupt replica=1 rank=0 step=2 phase=optimizer; "
        "sleep replica=0 rank=0 step=3 phase=optimizer seconds=60 until=epoch"
    )
    run = run_job(tmp_path, *SINGLES, "--recover.fault_plan", plan, "--recover.digest_interval", "2")
    assert run.returncode == 0, run.output[-3000:]
    (mismatch,) = run.of("param_digest_mismatch")
    assert (mismatch["replica"], mismatch["step"]) == (1, 2)  # the corrupted one, not the leader
    (failure,) = run.of("failure")
    assert failure["replica"] == 1 and "diverged" in failure["cause"]
    assert [e["replica"] for e in run.of("rejoined")] == [1]
    assert sorted(run.steps()) == list(range(1, 11)) and run.steps()[10]["members"] == [0, 1]
    digests = {e["replica"]: e["digest"] for e in run.of("param_digest") if e["step"] == 10}
    assert sorted(digests) == [0, 1] and len(set(digests.values())) == 1, digests


def test_the_jobs_own_error_stops_the_run_at_once(tmp_path: Path) -> None:
    """Every replica raises the same error at step 2 (as a code or config error would, e.g.
    FlexAttention, which has no CPU backward): no restart loop, the error is printed as the job's."""
    plan = "raise replica=0 rank=0 step=2 phase=forward; raise replica=1 rank=0 step=2 phase=forward"
    run = run_job(tmp_path, *SINGLES, "--recover.fault_plan", plan)
    assert run.returncode != 0
    assert len(run.of("fatal")) == 1, run.output[-3000:]  # once seen with no event file at all: its output says why
    (fatal,) = run.of("fatal")
    assert (
        "the job's own error" in fatal["error"]
        and "at step 2: InjectedError: injected error at step 2" in fatal["error"]
    ), fatal
    assert not run.of("admitted")  # nothing was restarted and let in again
    assert "the job's own error" in run.output
