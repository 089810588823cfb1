"""Multi-node launchers: claims of replica groups, a node's launcher lost and started again."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import ROOT, Node, Run, assert_all_rejoined, assert_same_trajectory, events
from launcher_in_process import error_lines, launch_argv

from titan_recover.control import claims, keys, protocol, store_api, transport
from titan_recover.control.client import ControlClient
from titan_recover.control.protocol import Launcher, NodeMessage, Rendezvous
from titan_recover.control.sealed import SealedStore
from titan_recover.coordinator import slurm
from titan_recover.titan.jobs import job
from titan_recover.tools.clusters.partitions import wait_until


@pytest.fixture
def client() -> Iterator[ControlClient]:
    port = transport.free_port()
    server = transport.serve(port, 5)
    yield ControlClient(transport.connect(f"127.0.0.1:{port}", timeout_s=5))
    del server


class Lifeline:
    """Writes a launcher's node message like its ``lifeline.Heartbeat`` does, until stopped."""

    def __init__(self, client: ControlClient, launcher: Launcher) -> None:
        self.stopped = threading.Event()
        # a connection of its own, as the lifeline's
        own = SealedStore(store_api.api(client.store.inner).clone(), client.store.run)
        self.thread = threading.Thread(target=self._beat, args=(own, launcher.key), daemon=True)
        self.thread.start()

    def _beat(self, client: dist.Store, key: str) -> None:
        seq = 0
        while not self.stopped.wait(0.1):
            seq += 1
            client.set(key, NodeMessage(seq, {}).dumps())

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


def test_a_live_launchers_claim_is_refused_quickly_and_a_silent_ones_taken_over(client: ControlClient) -> None:
    first, second = Launcher.this(), Launcher.this()
    lines: list[str] = []
    lifeline = Lifeline(client, first)
    claims.claim(client, first, [0, 1], stale_s=5.0, log=lines.append)
    assert lines == [] and claims.holds(client, first, 0) and claims.holds(client, first, 1)
    assert [client.next_incarnation(r) for r in (0, 1)] == [0, 0]  # their first starts
    started = time.monotonic()
    with pytest.raises(claims.ClaimRefused) as info:
        claims.claim(client, second, [2, 1], stale_s=5.0, log=lines.append)
    assert time.monotonic() - started < 2.0  # a live owner answers within its beat, not the whole bound
    message = str(info.value)
    assert message.startswith(f"replica groups [1] already run under a live launcher ([1] by {first})"), message
    assert f"on host {first.host} (pid {first.pid})" in message and keys.REPLICAS_ENV in message
    assert claims.holds(client, first, 1) and client.store.get(keys.owner_key(2)) == b""  # its claim on 2 released
    lifeline.stop()  # the first launcher dies
    claims.claim(client, second, [2, 1], stale_s=0.5, log=lines.append)
    assert claims.holds(client, second, 1) and claims.holds(client, second, 2) and not claims.holds(client, first, 1)
    assert lines[-1] == f"took over replica groups [1] from {first}, which shows no sign of life"
    assert client.next_incarnation(1) == 1  # the replacement's group rejoins; a new group starts at 0
    assert client.next_incarnation(2) == 0


def test_a_node_asking_for_any_free_ids_gets_unused_ones_first_then_those_of_silent_launchers(
    client: ControlClient,
) -> None:
    """Members' ids are never given; ids never claimed come first, then those of a launcher that shows no sign
    of life (its group left or failed with its node); a live launcher's ids are not; too few free is refused,
    releasing what it took."""
    live, dead, asking = Launcher.this(), Launcher.this(), Launcher.this()
    lifeline = Lifeline(client, live)
    try:
        claims.claim(client, live, [0, 4], stale_s=5.0, log=print)  # 0 a member, 4 its waiting spare
        claims.claim(client, dead, [2], stale_s=5.0, log=print)  # it never beats: its node is gone
        lines: list[str] = []
        assert claims.claim_free(client, asking, 1, range(5), (0, 1), 0.5, lines.append, client.node_message_raw) == [3]
        started = time.monotonic()
        got = claims.claim_free(client, asking, 1, range(5), (0, 1, 3), 0.5, lines.append, client.node_message_raw)
        assert got == [2] and claims.holds(client, asking, 2) and time.monotonic() - started >= 0.5
        assert lines == [f"took replica id 2 over from {dead}, which shows no sign of life"]
        with pytest.raises(claims.ClaimRefused, match=r"asks for 2 free replica id\(s\) and 0 of 0..4 are free"):
            claims.claim_free(client, Launcher.this(), 2, range(5), (0, 1, 2, 3), 0.5, print, client.node_message_raw)
        assert claims.holds(client, live, 4)  # a live launcher's spare is not free
    finally:
        lifeline.stop()


@pytest.mark.unit
def test_an_owner_whose_message_cannot_be_read_yet_is_judged_from_its_first_reading() -> None:
    """On etcd between two coordinator leaders no board serves the node messages (a launcher started again at
    once on the lost leader's node asks before the next leader is elected): no reading is neither life nor
    silence. A dead owner is silent ``stale_s`` after its first reading, a live one is seen changing, and one
    never read within ``stale_s + unreadable_s`` is a refusal that names it."""
    owner = Launcher.this()
    start = time.monotonic()

    def reader(*values: bytes) -> Callable[[Launcher], bytes | None]:
        """None for the first 0.3 s, then ``values`` one a call, the last one from then on."""
        left = list(values)
        return lambda o: None if time.monotonic() - start < 0.3 else left.pop(0) if len(left) > 1 else left[0]

    assert claims.silent(reader(b"1"), {owner}, stale_s=0.5, unreadable_s=5.0) == {owner}
    assert time.monotonic() - start >= 0.3 + 0.5  # from its first reading, not from the first try
    start = time.monotonic()
    assert claims.silent(reader(b"1", b"2"), {owner}, stale_s=0.5, unreadable_s=5.0) == set()
    start = time.monotonic()
    with pytest.raises(claims.ClaimRefused, match=r"cannot tell whether .* node message could not be read for 1s"):
        claims.silent(lambda o: None, {owner}, stale_s=0.5, unreadable_s=0.5)
    assert 1.0 <= time.monotonic() - start < 2.0


def test_a_malformed_claim_is_refused_naming_the_key(client: ControlClient) -> None:
    client.store.set(keys.owner_key(0), json.dumps({"launcher": 7, "host": "h", "pid": 1}))  # malformed on purpose
    with pytest.raises(claims.ClaimRefused, match=r"cannot tell who runs replica groups \[0\]: store key 'owner/0'"):
        claims.claim(client, Launcher.this(), [0], stale_s=0.1, log=print)


STEPS, HOLD = 10, 4
# Replica 0, alone by then, holds step 4 while node B's replacement starts and is admitted (it imports torch
# twice over, launcher and rank, and waits out the dead launcher's claim) and a duplicate launcher is refused.
# On a busy machine that can take longer than the hold: the steps after it leave more time, as they slow down too.
HOLDS = f"sleep replica=0 step={HOLD} phase=optimizer seconds=60"


def test_a_lost_nodes_launcher_started_again_brings_its_group_back(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Two launchers on one host stand for two nodes: A runs the coordinator and replica 0, B replica 1.

    B's whole tree is SIGKILLed after step 1: replica 1 is failed and replica 0 goes on alone. B's
    command, started again (B2), takes B's claim over; a third launcher claiming replica 1 while B2
    lives is refused (exit 2; in the test's process, where starting any process fails the test). Replica 1
    comes back as incarnation 1 by state transfer; A and B2 end with exit 0, every step is logged once and
    nothing of the first part is lost.

    A runs as under ``scripts/slurm/train.sbatch`` (the replacement command handed over, ``SLURM_JOB_ID``) on a
    site that forbids submitting from compute nodes (an ``sbatch`` that refuses, first on its PATH): replica 1
    out for ``replace_after_s`` (1 s), its coordinator tries to ask for a node once, says so in one line with the
    command to run, and asks no more. A node started from that command once B2 holds replica 1 (a replacement
    that arrives after the group came back) finds no free id, says so and exits 0, and the run records that.
    """
    dump = tmp_path / "dump"
    port, secret = transport.free_port(), "nodes-test-secret"
    args = [
        sys.executable,
        "-m",
        "titan_recover.launch",
        *job(dump, tiny=True),
        "--training.steps",
        str(STEPS),
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--training.global_batch_size",
        "8",
        "--recover.fault_plan",
        HOLDS,
        "--recover.collective_timeout_s",
        "90",  # the joiner waits for its donor through the hold
        "--recover.coordinator_port",
        str(port),
        "--recover.coordinator_bind",
        "127.0.0.1",
        "--recover.replace_after_s",
        "1",
    ]
    env = {**os.environ, keys.SECRET_ENV: secret, "PYTHONUNBUFFERED": "1"}
    env_a = {**env, keys.REPLICAS_ENV: "0", **forbidding_slurm(tmp_path, port)}
    env_b = {**env, keys.REPLICAS_ENV: "1", keys.COORDINATOR_ENV: f"127.0.0.1:{port}"}
    steps = lambda: [e for e in events(dump) if e["event"] == "step"]  # noqa: E731
    with Node("a", dump, args, env_a) as a, Node("b", dump, args, env_b) as b:
        wait_until("step 1", lambda: len(steps()) >= 1, 240, [a, b])
        b.kill_node()
        with Node("b2", dump, args, env_b) as b2:
            client = transport.connect(
                f"127.0.0.1:{port}", timeout_s=30, run=transport.find_run(f"127.0.0.1:{port}", 30, secret)
            )
            owner = lambda: Launcher.loads(keys.owner_key(1), client.get(keys.owner_key(1)))  # noqa: E731
            wait_until("B2 takes replica 1 over", lambda: owner().pid == b2.proc.pid, 120, [a, b2])
            duplicate = launch_argv(args[3:], capfd, env_b)  # the same group while B2 lives
            # the node of request 1, started by hand from the refused command's line, once B2 took replica 1 back
            late = launch_argv(args[3:], capfd, {**env_b, keys.REPLICAS_ENV: "any:1", keys.REPLACEMENT_ENV: "1"})
            assert a.wait(timeout=180) == 0, a.output()[-3000:]
            assert b2.wait(timeout=60) == 0, b2.output()[-3000:]
    assert duplicate.returncode == 2, duplicate.stderr[-3000:]
    [refused] = error_lines(duplicate.stderr)
    assert refused.startswith(
        f"error: replica groups [1] already run under a live launcher ([1] by the launcher on host "
        f"{socket.gethostname()} (pid {b2.proc.pid}))"
    ), duplicate.stderr[-3000:]
    run = Run(0, a.output(), events(dump))
    assert sorted(run.steps()) == list(range(1, STEPS + 1))  # each once (Run.steps); B2 erased none of B's time
    [failure] = run.of("failure")
    assert failure["replica"] == 1 and 2 <= failure["step"] <= HOLD, failure
    [recovered] = run.of("recovered")
    assert recovered["members"] == [0]
    [admitted] = run.of("admitted")
    assert admitted["replica"] == 1 and admitted["attempt"] == 1  # the store's incarnation count, not 0 again
    [rejoined] = run.of("rejoined")
    # before or after the hold: B2 can even be admitted before replica 0 commits the failure's step (seen once)
    assert rejoined["replica"] == 1 and rejoined["step"] >= failure["step"] and rejoined["bytes"] > 0
    for s, e in run.steps().items():  # both, replica 0 alone, both again
        assert e["members"] == ([0] if failure["step"] <= s < rejoined["step"] else [0, 1]), (s, e)
    assert_all_rejoined(run, 2, STEPS)
    assert "took over replica groups [1] from the launcher on host" in b2.output()
    assert "the run's summary is printed by the launcher that started its coordinator" in b2.output()
    assert "rejoined             : 1" in a.output() and "failures             : 1" in a.output()
    for node in (a, b2):
        assert "Traceback" not in node.output(), node.output()[-3000:]
    [not_asked] = run.of("replacement_failed")
    assert not_asked["replicas"] == [1] and not_asked["job"] is None, not_asked
    assert not_asked["error"] == f"sbatch exited 1: {REFUSAL}", not_asked
    command = f"cd {tmp_path} && env JOIN_RUN=127.0.0.1:{port} TITAN_RECOVER_RUN_ID="
    said = [line for line in a.output().splitlines() if "could not ask the scheduler for a replacement" in line]
    assert len(said) == 1 and f"To bring them back, run: {command}" in said[0], said
    assert not run.of("replacement_requested"), run.of("replacement_requested")
    assert late.returncode == 0, late.stderr[-3000:]
    assert "replacement request 1: no free replica id to take" in late.stdout + late.stderr, late.stderr[-3000:]
    [arrived_late] = run.of("replacement_left")
    assert (arrived_late["request"], arrived_late["replicas"]) == (1, []), arrived_late
    assert "request 1 for replica group(s) [1]: left at once: no free replica id" in a.output()


REFUSAL = "sbatch: error: Batch job submission failed: Access/permission denied"


def forbidding_slurm(tmp_path: Path, port: int) -> dict[str, str]:
    """A launcher's environment as ``scripts/slurm/train.sbatch`` makes it for the run's first node, on a site that
    forbids submitting from compute nodes: its ``sbatch`` (first on PATH) refuses every job, ``squeue`` answers
    nothing."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, body in (("sbatch", f"echo '{REFUSAL}' >&2; exit 1"), ("squeue", "exit 1")):
        (bin_ / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_ / name).chmod(0o755)
    return {
        "PATH": f"{bin_}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        slurm.SCRIPT_ENV: str(ROOT / "scripts" / "slurm" / "train.sbatch"),
        slurm.ARGS_ENV: "train_configs/x.toml",
        slurm.DIR_ENV: str(tmp_path),
        slurm.JOIN_ENV: f"127.0.0.1:{port}",
        keys.SECRET_FILE_ENV: str(tmp_path / "secret"),
    }


def spanning(dump: Path, port: int, plan: str) -> list[str]:
    """A launcher's command for groups that span two nodes (FSDP 2: one rank of each group per node)."""
    return [
        sys.executable,
        "-m",
        "titan_recover.launch",
        *job(dump, tiny=True),
        "--recover.group_nodes",
        "2",
        "--recover.fault_plan",
        plan,
        "--recover.collective_timeout_s",
        "90",
        "--recover.coordinator_port",
        str(port),
        "--recover.coordinator_bind",
        "127.0.0.1",
    ]


def node_env(port: int | None, replicas: str, part: int) -> dict[str, str]:
    env = {
        **os.environ,
        keys.SECRET_ENV: "span-test-secret",
        "PYTHONUNBUFFERED": "1",
        keys.REPLICAS_ENV: replicas,
        keys.GROUP_NODE_ENV: str(part),
    }
    return env if port is None else {**env, keys.COORDINATOR_ENV: f"127.0.0.1:{port}"}


def test_a_group_spanning_two_nodes_loses_a_rank_on_one_restarts_on_both_and_rejoins(
    tmp_path: Path, failure_free: Run
) -> None:
    """``recover.group_nodes = 2``: each of the 2 groups (FSDP 2) has one rank on launcher A and one on B.

    Rank 1 of replica 1 (B's part) is SIGKILLed mid-backward at step 2: B reports its part, the coordinator
    fences the group, A kills its part and starts incarnation 1 at a fresh rendezvous port, B joins it; the
    group rejoins by transfer. The run keeps the failure-free trajectory of the same groups on one node.
    """
    dump, port = tmp_path / "dump", transport.free_port()
    args = spanning(
        dump,
        port,
        "kill replica=1 rank=1 step=2 phase=backward; sleep replica=0 step=3 phase=optimizer seconds=120 until=epoch",
    )
    with Node("a", dump, args, node_env(None, "0,1", 0)) as a, Node("b", dump, args, node_env(port, "0,1", 1)) as b:
        assert a.wait(timeout=300) == 0, a.output()[-3000:] + b.output()[-3000:]
        assert b.wait(timeout=60) == 0, b.output()[-3000:]
    run = Run(0, a.output(), events(dump))
    assert_same_trajectory(failure_free, run, rel_tol=1e-3, num_microbatches=4)
    [failure] = run.of("failure")
    assert failure["replica"] == 1, failure  # found by its rank on A (its group broke) or by B's report
    [admitted] = run.of("admitted")
    assert (admitted["replica"], admitted["attempt"]) == (1, 1)
    [rejoined] = run.of("rejoined")
    assert rejoined["replica"] == 1 and rejoined["bytes"] > 0
    assert_all_rejoined(run, 2, 6)
    # A's part of the fenced group ended: killed by A, or first on its own when its rank saw the group break
    assert (
        "killed local rank 0 of fenced replica 1 (attempt 0" in a.output()
        or "replica group 1 (part 0 of 2) exited with code 1; restart 1 of 3" in a.output()
    ), a.output()[-3000:]
    assert "replica group 1 (part 1 of 2) exited with code 1; waiting for part 0" in b.output()
    assert "replica group 1 (part 1 of 2): joining incarnation 1 at 127.0.0.1:" in b.output()
    assert "replica group 0 (part 1 of 2): joining incarnation 1" not in b.output()  # the other group went on


def test_a_node_lost_under_a_spanning_group_is_taken_over_and_the_group_restarts_on_both(
    tmp_path: Path, failure_free: Run
) -> None:
    """Three launchers: A runs part 0 of groups 0 and 1 (and the coordinator), B part 1 of group 0, C part 1 of
    group 1. C's whole tree is SIGKILLed after step 1: group 1 loses a part, A restarts it as incarnation 1;
    C's command started again (C2) takes C's claim over, skips the incarnation C was part of and joins A's next
    one; group 1 rejoins by transfer and the run keeps the failure-free trajectory."""
    dump, port = tmp_path / "dump", transport.free_port()
    args = spanning(dump, port, "sleep replica=0 step=3 phase=optimizer seconds=45")
    steps = lambda: [e for e in events(dump) if e["event"] == "step"]  # noqa: E731
    with (
        Node("a", dump, args, node_env(None, "0,1", 0)) as a,
        Node("b", dump, args, node_env(port, "0", 1)) as b,
        Node("c", dump, args, node_env(port, "1", 1)) as c,
    ):
        wait_until("step 1", lambda: len(steps()) >= 1, 240, [a, b, c])
        c.kill_node()
        with Node("c2", dump, args, node_env(port, "1", 1)) as c2:
            assert a.wait(timeout=240) == 0, a.output()[-3000:] + c2.output()[-3000:]
            assert b.wait(timeout=60) == 0 and c2.wait(timeout=60) == 0, b.output()[-3000:] + c2.output()[-3000:]
    run = Run(0, a.output(), events(dump))
    assert_same_trajectory(failure_free, run, rel_tol=1e-3, num_microbatches=4)
    [failure] = run.of("failure")
    assert failure["replica"] == 1, failure
    [admitted] = run.of("admitted")
    assert admitted["replica"] == 1 and admitted["attempt"] >= 1, admitted
    [rejoined] = run.of("rejoined")
    assert rejoined["replica"] == 1 and rejoined["bytes"] > 0
    assert_all_rejoined(run, 2, 6)
    assert "took over replica groups [1] (their part 1) from the launcher on host" in c2.output()
    assert f"replica group 1 (part 1 of 2): joining incarnation {admitted['attempt']} at 127.0.0.1:" in c2.output()
    assert "joining incarnation 0" not in c2.output()  # the one its dead predecessor was part of
    assert "joining incarnation" not in b.output().split("joining incarnation 0", 1)[1]  # group 0 went on


def test_each_part_of_a_group_is_claimed_on_its_own_and_its_rendezvous_is_validated(client: ControlClient) -> None:
    first, second = Launcher.this(), Launcher.this()
    lines: list[str] = []
    lifelines = [Lifeline(client, first), Lifeline(client, second)]
    assert claims.claim(client, first, [0], stale_s=5.0, log=lines.append, part=0) == []
    assert claims.claim(client, second, [0], stale_s=5.0, log=lines.append, part=1) == []  # another part: no clash
    assert (
        claims.holds(client, first, 0)
        and claims.holds(client, second, 0, part=1)
        and not claims.holds(client, first, 0, part=1)
    )
    with pytest.raises(
        claims.ClaimRefused, match=r"replica groups \[0\] \(their part 1\) already run under a live launcher"
    ):
        claims.claim(client, Launcher.this(), [0], stale_s=5.0, log=lines.append, part=1)
    for lifeline in lifelines:
        lifeline.stop()
    third = Launcher.this()
    assert claims.claim(client, third, [0], stale_s=0.5, log=lines.append, part=0) == [
        0
    ]  # taken over: the caller is told
    assert client.read_rendezvous(0) is None
    client.publish_rendezvous(0, Rendezvous(2, "10.0.0.5", 29600))
    assert client.read_rendezvous(0) == Rendezvous(2, "10.0.0.5", 29600)
    assert json.loads(client.store.get(keys.rendezvous_key(0))) == {"attempt": 2, "host": "10.0.0.5", "port": 29600}
    client.store.set(
        keys.rendezvous_key(0), json.dumps({"attempt": 2, "host": "10.0.0.5", "port": 0})
    )  # malformed on purpose
    with pytest.raises(protocol.MessageError, match="store key 'rendezvous/0'"):
        client.read_rendezvous(0)
