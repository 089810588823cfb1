"""Network faults on a cluster of network namespaces (``tools.clusters.netns``), as scenarios both the tests
(``tests/test_partitions.py``, ``tests/test_partitions_etcd.py``) and the benchmark (``bench.partitions``,
which measures them) run.

Two nodes (addresses 198.18.0.1-2), replica group i on node i, the coordinator's TCPStore on node 0 bound
to its address: ``cut_off`` (node 1 unplugged for 8 s after step 2), ``coordinator_cut_off`` (node 0
unplugged for good), ``paused`` (node 1 SIGSTOPped for 20 s), ``replaced`` (node 1's processes SIGKILLed,
the same command started again), ``latency_loss`` (50 ms each way and 1% loss between the nodes). On etcd,
three nodes, each running an etcd member on its address, the launchers (and so the coordinator
candidates) on nodes 0 and 1: ``leader_cut_off`` (the coordinator leader's node unplugged for 8 s, past
its lease), ``etcd_member_cut_off`` (node 2, its member leading Raft, unplugged for 8 s). Each scenario
takes the job's layout as trailing overrides (the tests run single-rank groups); every wait is bounded
and raises ``Hang`` saying what it awaited.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from titan_recover.control import keys
from titan_recover.control.addresses import NODES_SCHEME
from titan_recover.observability.events import NODE_ENV, event_files, of_kind
from titan_recover.titan.jobs import job
from titan_recover.tools.clusters.netns import Cluster, Node
from titan_recover.tools.etcd_local import LocalEtcd

ROOT = Path(__file__).resolve().parents[3]  # the checkout the launchers run in

PORT = 29510  # every node has its own port space: a fixed port, as on a real cluster
ETCD_NODES = 3  # on etcd: a member on each node, launchers on the first two
RUN_ID = "partitions"  # the run's id on etcd (each scenario has an etcd cluster of its own)
# what a coordinator does not write: a node's lines of these kinds are its ranks' and its launcher's
NOT_COORDINATORS = ("fault_injected", "param_digest", "param_digest_mismatch", "rank_memory", "group_started")


def hold(replica: int) -> str:
    """``replica`` holds step 5 until an epoch admits a fenced group back."""
    return f"sleep replica={replica} step=5 phase=optimizer seconds=120 until=epoch"


HOLD = hold(0)
# replica 1 takes 3 s over step 3's forward: a fault applied once step 2 is logged lands before step 3 commits
STALL = "sleep replica=1 step=3 phase=forward seconds=3"
STEPS, MICROBATCHES = 6, 4
CUT_S, PAUSE_S, TIMEOUT_S = 8.0, 20.0, 10.0
MEMBER_LOST_S, REPLACE_HOLD_S = 5.0, 75  # ``members_lost_one_after_another``'s


class Hang(AssertionError):
    """A wait ran past its bound: what was awaited, and every node's output."""


class Launcher:
    """One node's launcher, started inside its namespace; its output goes to ``<name>.log``."""

    def __init__(
        self, cluster: Cluster, node: Node, dump: Path, args: list[str], env: dict[str, str], name: str = ""
    ) -> None:
        self.log = dump.parent / f"{name or f'node{node.index}'}.log"
        self.proc = cluster.spawn(node, args, cwd=ROOT, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text()


@dataclass
class Outcome:
    """What a scenario left: its events, each launcher's exit code and output, and its timings."""

    events: list[dict]
    exits: list[int | None]
    outputs: list[str]
    timings: dict[str, float] = field(default_factory=dict)

    def of(self, kind: str) -> list[dict]:
        return of_kind(self.events, kind)


def file_events(path: Path, start: int = 0) -> list[dict]:
    """The events of one file from byte ``start`` on, as written (a line still being written, after the
    last newline, is left for later)."""
    with path.open("rb") as f:
        f.seek(start)
        return [json.loads(line) for line in f.read().decode().split("\n")[:-1] if line.strip()]


def events(dump: Path) -> list[dict]:
    """The run's events so far, from every node's file, as written: a step logged twice is there twice."""
    return [e for path in event_files(str(dump)) for e in file_events(Path(path))]


def steps(dump: Path) -> list[int]:
    return [e["step"] for e in events(dump) if e["event"] == "step"]


def leaders(dump: Path) -> list[dict]:
    """The coordinator leaders so far (etcd), in order: each one's ``leader`` event (each node has a file)."""
    return sorted((e for e in events(dump) if e["event"] == "leader"), key=lambda e: e["time"])


def coordinators(lines: list[dict]) -> list[dict]:
    """The events among ``lines`` that a coordinator wrote: every kind but the ranks' and the launcher's."""
    return [e for e in lines if e["event"] not in NOT_COORDINATORS and e.get("process") != "rank"]


def node_of(cluster: Cluster, pid: int) -> Node:
    return next(n for n in cluster.nodes if pid in cluster.pids(n))


def node_name(node: Node) -> str:
    """What names a node on etcd (``node_envs``): its event file is ``recover_events.<name>.jsonl``."""
    return f"node{node.index}"


def node_log(dump: Path, node: Node) -> Path:
    return dump / f"recover_events.{node_name(node)}.jsonl"


class Polled(Protocol):
    """A launcher's process as ``wait_until`` asks it whether it ended: a ``subprocess.Popen``, or a test's own."""

    def poll(self) -> int | None: ...


class Watched(Protocol):
    """What ``wait_until`` watches of a launcher: the bench's ``Launcher`` or a test's own."""

    @property
    def proc(self) -> Polled: ...

    @property
    def log(self) -> Path: ...

    def output(self) -> str: ...


def wait_until(what: str, predicate: Callable[[], bool], timeout: float, launchers: Sequence[Watched]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        ended = [la for la in launchers if la.proc.poll() is not None]
        if time.monotonic() > deadline or ended:
            tails = "\n".join(f"--- {la.log.name}\n{la.output()[-3000:]}" for la in launchers)
            raise Hang(f"{what}: {'timed out' if not ended else f'{ended[0].log.name} exited'}\n{tails}")
        time.sleep(0.1)


def launcher_args(dump: Path, control: Node | LocalEtcd | str, plan: str, *extra: str) -> list[str]:
    """A launcher's command: the job with fault plan ``plan``, its control store the TCPStore coordinator
    on node ``control`` (bound to its address), the etcd cluster ``control`` or the ``control_store`` URL
    ``control``. Each scenario passes on its ``layout`` overrides last (the tests run single-rank groups; the
    benchmark, the job as it is)."""
    if isinstance(control, Node):
        store = ["--recover.coordinator_port", str(PORT), "--recover.coordinator_bind", control.address]
    else:
        store = ["--recover.control_store", control if isinstance(control, str) else control.url]
    return [
        sys.executable,
        "-m",
        "titan_recover.launch",
        *job(dump, tiny=True),
        "--recover.fault_plan",
        plan,
        *store,
        *extra,
    ]


def node_envs(cluster: Cluster, store: str | None = None, nodes: int = 2) -> list[dict[str, str]]:
    """Replica group i on node i of the first ``nodes``; node 0 starts the run, the others dial node 0's
    coordinator, or the etcd ``store`` (an ``etcd://`` or ``nodes://`` URL), where each node logs to a file of its
    own: a line's node is known (a coordinator leader cut off must log nothing once its lease ended)."""
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env.update({keys.SECRET_ENV: "partition-test-secret", "PYTHONUNBUFFERED": "1"})
    coordinator = f"{cluster.nodes[0].address}:{PORT}" if store is None else store
    on_etcd = {} if store is None else {keys.RUN_ENV: RUN_ID}
    return [
        {
            **env,
            **on_etcd,
            keys.REPLICAS_ENV: str(n.index),
            **({keys.COORDINATOR_ENV: coordinator} if n.index else {}),
            **({NODE_ENV: node_name(n)} if store else {}),
        }
        for n in cluster.nodes[:nodes]
    ]


@contextlib.contextmanager
def two_nodes(cluster: Cluster, dump: Path, args: list[str], etcd: LocalEtcd | None = None) -> Iterator[list[Launcher]]:
    """Node 0's and node 1's launchers; one still running at the end is left to the cluster's teardown."""
    env0, env1 = node_envs(cluster, None if etcd is None else etcd.url)
    yield [Launcher(cluster, cluster.nodes[0], dump, args, env0), Launcher(cluster, cluster.nodes[1], dump, args, env1)]


@contextlib.contextmanager
def etcd_members(cluster: Cluster) -> Iterator[LocalEtcd]:
    """An etcd cluster of ``ETCD_NODES`` members, member i in node i's namespace on its address, node 2's
    (no launcher there) leading Raft; stopped and its data removed when the block ends, also when it
    fails. Leading from the start: etcd renews every lease when a member starts leading, so leadership
    moved just before a fault would delay the lease's expiry (a case moves it again before its fault
    only if an election moved it meanwhile)."""
    etcd = LocalEtcd(
        ETCD_NODES,
        hosts=[n.address for n in cluster.nodes[:ETCD_NODES]],
        spawn=lambda i, argv, **popen: cluster.spawn(cluster.nodes[i], argv, **popen),
    ).start()
    try:
        etcd.move_leader(etcd.names[2])
        yield etcd
    finally:
        etcd.stop()


def finish(dump: Path, launchers: list[Launcher], timings: dict[str, float], timeout: float = 240) -> Outcome:
    """Waits for every launcher's end (bounded: a hang raises ``Hang``); the outcome of the scenario."""
    deadline = time.monotonic() + timeout
    for launcher in launchers:
        try:
            launcher.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise Hang(f"{launcher.log.name} still running {timeout:g}s on:\n{launcher.output()[-3000:]}") from None
    return Outcome(events(dump), [la.proc.returncode for la in launchers], [la.output() for la in launchers], timings)


def failure_free(cluster: Cluster, dump: Path, *layout: str) -> Outcome:
    with two_nodes(cluster, dump, launcher_args(dump, cluster.nodes[0], "none", *layout)) as launchers:
        return finish(dump, launchers, {})


def failure_free_on_etcd(cluster: Cluster, dump: Path, *layout: str) -> Outcome:
    """The same job on etcd, a member per node: the etcd cases' reference."""
    with (
        etcd_members(cluster) as etcd,
        two_nodes(cluster, dump, launcher_args(dump, etcd, "none", *layout), etcd) as launchers,
    ):
        return finish(dump, launchers, {})


def fenced_and_back(
    dump: Path,
    launchers: list[Launcher],
    fault: contextlib.AbstractContextManager,
    for_s: float,
    after: str,
    during: Callable[[], dict[str, float]] = dict,
) -> dict[str, float]:
    """``fault`` from after step 2 for ``for_s``, ``during()`` run as soon as it is on: its timings, the
    seconds until a group was fenced, and from the fault's end until it rejoined (``rejoined_after_<after>_s``)."""
    wait_until("step 2", lambda: 2 in steps(dump), 240, launchers)
    with fault:
        start = time.monotonic()
        timings = during()
        wait_until("a group fenced", lambda: any(e["event"] == "failure" for e in events(dump)), 30, launchers)
        fenced = time.monotonic() - start
        time.sleep(max(0.0, for_s - (time.monotonic() - start)))
    back = time.monotonic()
    wait_until("the group rejoined", lambda: any(e["event"] == "rejoined" for e in events(dump)), 240, launchers)
    return {**timings, "fenced_s": fenced, f"rejoined_after_{after}_s": time.monotonic() - back}


def cut_off(cluster: Cluster, dump: Path, *layout: str) -> Outcome:
    """Node 1's cable pulled for 8 s after step 2 (heartbeat_timeout_s is 5), then plugged back."""
    args = launcher_args(dump, cluster.nodes[0], f"{STALL}; {HOLD}", "--recover.collective_timeout_s", "60", *layout)
    with two_nodes(cluster, dump, args) as launchers:
        timings = fenced_and_back(dump, launchers, cluster.unplugged(cluster.nodes[1]), CUT_S, "reconnect")
        return finish(dump, launchers, timings)


def coordinator_cut_off(cluster: Cluster, dump: Path, *layout: str) -> Outcome:
    """Node 0 (the TCPStore coordinator's node) unplugged for good after step 2, coordinator_timeout_s 10."""
    # step 3 neither committed nor recorded before the cut
    plan = f"{STALL}; sleep replica=0 step=3 phase=optimizer seconds=20"
    args = launcher_args(
        dump,
        cluster.nodes[0],
        plan,
        "--recover.coordinator_timeout_s",
        str(TIMEOUT_S),
        "--recover.max_restarts",
        "0",
        *layout,
    )
    with two_nodes(cluster, dump, args) as launchers:
        wait_until("step 2", lambda: 2 in steps(dump), 240, launchers)
        with cluster.unplugged(cluster.nodes[0]):
            cut = time.monotonic()
            try:
                launchers[1].proc.wait(timeout=4 * TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise Hang(
                    f"node 1 still running {4 * TIMEOUT_S:g}s after its coordinator's node was cut off"
                ) from None
            stopped = time.monotonic() - cut
            left = len(cluster.pids(cluster.nodes[1]))
            outcome = finish(dump, launchers, {"other_node_stopped_s": stopped})
        outcome.timings["processes_left_on_node_1"] = left
        return outcome


def paused(cluster: Cluster, dump: Path, *layout: str) -> Outcome:
    """Every process of node 1 SIGSTOPped for 20 s (2 x coordinator_timeout_s) after step 2."""
    args = launcher_args(
        dump,
        cluster.nodes[0],
        f"{STALL}; {HOLD}",
        "--recover.coordinator_timeout_s",
        str(TIMEOUT_S),
        "--recover.collective_timeout_s",
        "60",
        *layout,
    )
    with two_nodes(cluster, dump, args) as launchers:
        timings = fenced_and_back(dump, launchers, cluster.paused(cluster.nodes[1]), PAUSE_S, "resume")
        return finish(dump, launchers, timings)


def replaced(cluster: Cluster, dump: Path, *layout: str) -> Outcome:
    """Node 1 replaced as a new pod: its processes SIGKILLed after step 2, the same command started again."""
    args = launcher_args(dump, cluster.nodes[0], HOLD, "--recover.collective_timeout_s", "60", *layout)
    with two_nodes(cluster, dump, args) as launchers:
        wait_until("step 2", lambda: 2 in steps(dump), 240, launchers)
        cluster.kill(cluster.nodes[1])
        again = time.monotonic()
        launchers[1] = Launcher(cluster, cluster.nodes[1], dump, args, node_envs(cluster)[1], name="node1-again")
        wait_until("replica 1 rejoined", lambda: any(e["event"] == "rejoined" for e in events(dump)), 240, launchers)
        return finish(dump, launchers, {"rejoined_after_restart_s": time.monotonic() - again})


def latency_loss(cluster: Cluster, dump: Path, *layout: str) -> Outcome:
    """50 ms more each way on every connection between the nodes and 1% loss, from the start."""
    with cluster.delayed(50), cluster.dropping(cluster.nodes[1], percent=1):
        with two_nodes(cluster, dump, launcher_args(dump, cluster.nodes[0], "none", *layout)) as launchers:
            return finish(dump, launchers, {}, timeout=600)


def leader_cut_off(cluster: Cluster, dump: Path, *layout: str) -> Outcome:
    """On etcd: the coordinator leader's node unplugged for 8 s after step 2, past the leader's lease (3 s)
    and heartbeat_timeout_s (5 s). etcd's Raft leader is on node 2 (no launcher): the takeover waits for
    the lease alone (a Raft leader cut off is ``etcd_member_cut_off``'s). Timings: the cut to the
    new leader's event (``takeover_s``), the nodes of both leaders, the cut-off group's fencing and return,
    and the lines a coordinator on the old leader's node wrote from the takeover on (``old_leader_writes``)."""
    plan = f"{STALL}; {hold(0)}; {hold(1)}"  # whichever group is cut off, the other holds step 5 for its return
    with etcd_members(cluster) as etcd:
        args = launcher_args(dump, etcd, plan, "--recover.collective_timeout_s", "60", *layout)
        with two_nodes(cluster, dump, args, etcd) as launchers:
            wait_until("step 2", lambda: 2 in steps(dump), 240, launchers)
            etcd.move_leader(etcd.names[2])
            before = leaders(dump)
            old = node_of(cluster, before[-1]["pid"])
            since: dict[str, int] = {}  # the old leader's node log's size at the takeover

            def takeover() -> dict[str, float]:
                cut = time.time()
                wait_until("a new leader", lambda: len(leaders(dump)) > len(before), 60, launchers)
                since["bytes"] = node_log(dump, old).stat().st_size
                new = leaders(dump)[len(before)]
                return {
                    "takeover_s": new["time"] - cut,
                    "leader_node": old.index,
                    "new_leader_node": node_of(cluster, new["pid"]).index,
                }

            timings = fenced_and_back(dump, launchers, cluster.unplugged(old), CUT_S, "reconnect", takeover)
            outcome = finish(dump, launchers, timings)
    outcome.timings["old_leader_writes"] = len(coordinators(file_events(node_log(dump, old), since["bytes"])))
    return outcome


def etcd_member_cut_off(cluster: Cluster, dump: Path, *layout: str) -> Outcome:
    """On etcd: node 2 (its member only, leading Raft, so the other two must elect a leader)
    unplugged for 8 s after step 2, while replica 0 takes 10 s over step 4 so the run goes on after the
    reconnection. Timing: from the reconnection until node 2's member serves again (a linearizable read)."""
    with etcd_members(cluster) as etcd:
        args = launcher_args(dump, etcd, "sleep replica=0 step=4 phase=forward seconds=10", *layout)
        with two_nodes(cluster, dump, args, etcd) as launchers:
            wait_until("step 2", lambda: 2 in steps(dump), 240, launchers)
            member = etcd.names[2]
            etcd.move_leader(member)
            with cluster.unplugged(cluster.nodes[2]):
                time.sleep(CUT_S)
            back = time.monotonic()
            try:
                etcd.wait_serving(member, 60)
            except RuntimeError as e:
                raise Hang(f"node 2's etcd member after the reconnection: {e}") from None
            return finish(dump, launchers, {"rejoined_after_reconnect_s": time.monotonic() - back})


def nodes_url(cluster: Cluster) -> str:
    """The control store the launchers of the first ``ETCD_NODES`` nodes form themselves (``launch.members``)."""
    return NODES_SCHEME + ",".join(n.address for n in cluster.nodes[:ETCD_NODES])


def three_nodes(
    cluster: Cluster, dump: Path, store: str | None, *layout: str, plan: str = "none", nodes: int = ETCD_NODES
) -> list[Launcher]:
    """Launchers on the first ``nodes`` nodes (``ETCD_NODES``), replica group i on node i, on node 0's TCPStore
    (``store`` None) or on the control store ``store`` (``nodes_url``: the members the first ``ETCD_NODES`` nodes
    form themselves), fault plan ``plan``."""
    (dump.parent / "tmp").mkdir(parents=True, exist_ok=True)  # the members' data: this scenario's own
    return [again(cluster, dump, store, i, *layout, plan=plan, nodes=nodes) for i in range(nodes)]


def again(
    cluster: Cluster, dump: Path, store: str | None, i: int, *layout: str, plan: str, nodes: int, name: str = ""
) -> Launcher:
    """``three_nodes``' launcher of node ``i``: the same command started again, where ``name`` is given."""
    args = launcher_args(dump, cluster.nodes[0] if store is None else store, plan, *layout)
    env = {**node_envs(cluster, store, nodes)[i], "TMPDIR": str(dump.parent / "tmp")}
    return Launcher(cluster, cluster.nodes[i], dump, args, env, name=name)


def failure_free_on_three(cluster: Cluster, dump: Path, store: str | None, *layout: str) -> Outcome:
    """``three_nodes``' run, no fault: what a step costs on that control store."""
    return finish(dump, three_nodes(cluster, dump, store, *layout), {})


def self_formed_member_cut_off(cluster: Cluster, dump: Path, *layout: str) -> Outcome:
    """On the etcd the three nodes form themselves: node 2 (its member, its coordinator candidate and replica group
    2) unplugged for 8 s after step 2, then plugged back. The other two members keep quorum, replica 2 is fenced
    on its silent heartbeat and rejoins once its node is back (its member catching up), replicas 0 and 1 holding
    step 5 until it does."""
    plan = f"sleep replica=2 step=3 phase=forward seconds=3; {hold(0)}; {hold(1)}"
    timeout = ("--recover.collective_timeout_s", "60")  # the cut is seen by the heartbeat, as in ``cut_off``
    launchers = three_nodes(cluster, dump, nodes_url(cluster), *timeout, *layout, plan=plan)
    timings = fenced_and_back(dump, launchers, cluster.unplugged(cluster.nodes[2]), CUT_S, "reconnect")
    return finish(dump, launchers, timings)


def self_formed_node0_killed(cluster: Cluster, dump: Path, *layout: str) -> Outcome:
    """Three nodes with ``control_store = "nodes://..."``: each launcher runs an etcd member and a coordinator
    candidate beside replica group i, node 0's launcher begins the run. After step 3 every process of node 0
    (its launcher, its group, its etcd member and the candidate that leads, if it does) is SIGKILLed, and it is
    not started again: nodes 1 and 2 go on with two groups of three. Timings: the kill to the first step
    committed after it (``first_step_s``) and to the next leader's event, if node 0's led (``new_leader_s``)."""
    launchers = three_nodes(cluster, dump, nodes_url(cluster), *layout)
    wait_until("step 3", lambda: 3 in steps(dump), 300, launchers)
    before = leaders(dump)
    led = node_of(cluster, before[-1]["pid"]).index == 0 if before else False
    cluster.kill(cluster.nodes[0])
    killed = time.time()
    wait_until("a step after node 0's loss", lambda: max(steps(dump)) > 3, 120, launchers[1:])
    outcome = finish(dump, launchers[1:], {})
    after = [e["time"] for e in outcome.of("step") if e["time"] > killed]
    outcome.timings["first_step_s"] = min(after) - killed if after else float("nan")
    if led:
        new = [e["time"] for e in leaders(dump) if e["time"] > killed]
        outcome.timings["new_leader_s"] = min(new) - killed if new else float("nan")
    return outcome


def members_lost_one_after_another(cluster: Cluster, dump: Path, *layout: str) -> Outcome:
    """Five nodes with ``control_store = "nodes://<nodes 0-2>"``: etcd members on nodes 0-2, nodes 3 and 4
    volunteer, replica group i on node i. Every group holds after step 2's commit (``REPLACE_HOLD_S``, none in a
    collective) while nodes 0, 1 and 2 are SIGKILLed whole one after another, each once the member lost before
    it was replaced (``member_replace_after_s``: ``MEMBER_LOST_S``): m3 starts on node 3 in m0's place, m4 on node
    4 in m1's. Node 2's loss then leaves m3 and m4 of three, a quorum, and none of the endpoints every process
    began with: each must have followed the membership. Groups 3 and 4 end the run. Timings: each kill to its
    replacement's start (``replaced_m0_s``, ``replaced_m1_s``)."""
    plan = "; ".join(f"sleep replica={r} step=2 phase=optimizer seconds={REPLACE_HOLD_S}" for r in range(5))
    extra = ("--recover.member_replace_after_s", str(MEMBER_LOST_S))
    launchers = three_nodes(cluster, dump, nodes_url(cluster), *extra, *layout, plan=plan, nodes=5)
    wait_until("every group's hold", lambda: holding(dump) == set(range(5)), 300, launchers)
    timings: dict[str, float] = {}
    for lost, volunteer in ((0, 3), (1, 4)):
        cluster.kill(cluster.nodes[lost])
        killed = time.monotonic()
        started = f"etcd member m{volunteer} starts on this node"
        live = launchers[lost + 1 :]
        wait_until(f"m{volunteer} on node {volunteer}", lambda: started in launchers[volunteer].output(), 90, live)
        timings[f"replaced_m{lost}_s"] = time.monotonic() - killed
    cluster.kill(cluster.nodes[2])
    return finish(dump, launchers[3:], timings, timeout=300)


def member_node_replaced(cluster: Cluster, dump: Path, *layout: str) -> Outcome:
    """Three nodes on ``nodes://`` (a member each), every group holding after step 2's commit: node 0 SIGKILLed
    whole, its member's data removed (a new machine, a new pod), and its command started again at once. Its
    launcher volunteers instead of starting m0 empty; m0, silent for ``member_replace_after_s`` (``MEMBER_LOST_S``),
    is removed and node 0 added back as m3, and its group rejoins (replicas 1 and 2 hold steps 2, 3 and 4 until the
    next epoch: node 0's loss, its admission, node 1's loss). Then node 1 is SIGKILLed: m2 and m3 are a quorum of
    three (without the replacement, m0 and m1 lost of three would stop the run), and nodes 0 and 2 end the run.
    Timings: the relaunch to m3's start (``m3_started_s``) and to replica 0's rejoin (``rejoined_s``)."""
    plan = "; ".join(
        [
            "sleep replica=0 step=2 phase=optimizer seconds=180",  # node 0 is lost here
            *(f"sleep replica={r} step={s} phase=optimizer seconds=180 until=epoch" for r in (1, 2) for s in (2, 3, 4)),
        ]
    )
    store, extra = nodes_url(cluster), ("--recover.member_replace_after_s", str(MEMBER_LOST_S))
    launchers = three_nodes(cluster, dump, store, *extra, *layout, plan=plan)
    wait_until("every group's hold", lambda: holding(dump) == {0, 1, 2}, 300, launchers)
    cluster.kill(cluster.nodes[0])
    for data in (dump.parent / "tmp" / "titan_recover-etcd").glob("*/*/m0"):
        shutil.rmtree(data)
    relaunched = time.monotonic()
    launchers[0] = again(cluster, dump, store, 0, *extra, *layout, plan=plan, nodes=3, name="node0-again")
    started = "etcd member m3 starts on this node"
    wait_until("m3 on node 0", lambda: started in launchers[0].output(), 120, launchers)
    timings = {"m3_started_s": time.monotonic() - relaunched}
    rejoined = lambda: any(e["event"] == "rejoined" for e in events(dump))  # noqa: E731
    wait_until("replica 0 rejoined", rejoined, 240, launchers)
    timings["rejoined_s"] = time.monotonic() - relaunched
    held = lambda: {e["replica"] for e in events(dump) if e["event"] == "fault_injected" and e.get("step") == 4}  # noqa: E731
    wait_until("replicas 1 and 2 holding step 4", lambda: held() == {1, 2}, 240, launchers)
    cluster.kill(cluster.nodes[1])
    return finish(dump, [launchers[0], launchers[2]], timings, timeout=300)


def holding(dump: Path) -> set[int]:
    """The replicas whose step-2 hold has begun."""
    return {e["replica"] for e in events(dump) if e["event"] == "fault_injected" and e.get("step") == 2}


CASES: dict[str, Callable[[Cluster, Path], Outcome]] = {
    "cut_off": cut_off,
    "coordinator_cut_off": coordinator_cut_off,
    "paused": paused,
    "replaced": replaced,
    "latency_loss": latency_loss,
    "leader_cut_off": leader_cut_off,
    "etcd_member_cut_off": etcd_member_cut_off,
}
ON_ETCD = ("failure_free_on_etcd", "leader_cut_off", "etcd_member_cut_off")  # run on ETCD_NODES nodes
