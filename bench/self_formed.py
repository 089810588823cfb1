"""The etcd a run forms on its own nodes (``control_store = "nodes://..."``, issue 68): what a step costs on it
against node 0's TCPStore, measured side by side, and what node 0's loss costs on it.

Three network-namespace nodes (``titan_recover.tools.clusters.netns``), replica group i (one rank, the tiny
llama3, fp32, M = 6: ``--training.global_batch_size 12``) on node i, ``--steps`` steps. Pairs of failure-free
runs, alternated: every process on node 0's TCPStore (the coordinator bound to its address), then on an etcd
whose three members the launchers start themselves (one per node, a coordinator candidate beside each). The
mean step time of each run (steps after the first two, which include the process groups' first rendezvous),
and the ratio of the medians. A third run of each pair keeps the members' data on tmpfs (``/dev/shm``), where an
fsync costs nothing: its ratio to the run with the data on the disk (the default, ``$TMPDIR``) is what the members'
fsyncs cost a step. Then node 0 SIGKILLed whole after step 3 on the self-formed etcd
(``partitions.self_formed_node0_killed``): seconds from the kill to the first step committed after it, and to the
next leader's event where node 0's candidate led. Last, on five nodes
(``partitions.members_lost_one_after_another``: members on nodes 0-2, nodes 3 and 4 volunteering, one single-rank
group each, M = 10), the three members' nodes SIGKILLed whole one after another: seconds from each of the first two
kills to its volunteer's member starting, and the run checked to end on nodes 3 and 4 with every step once, on
members none of its processes began with. Beside the self-formed runs, the largest etcd member's peak resident
memory (sampled every 0.5 s).

    .venv/bin/python -m bench.self_formed [--pairs 2] [--steps 20]    # root, iproute2, nftables, etcd on PATH

Writes bench/results/self_formed.json.
"""

import argparse
import logging
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path

from bench.common import step_gaps, write_result
from titan_recover.control import etcd_process
from titan_recover.observability import logs
from titan_recover.tools.clusters import netns
from titan_recover.tools.clusters.netns import Cluster
from titan_recover.tools.clusters.partitions import (
    ETCD_NODES,
    Outcome,
    failure_free_on_three,
    members_lost_one_after_another,
    nodes_url,
    self_formed_node0_killed,
)

log = logging.getLogger(__name__)
LAYOUT = ("--parallelism.data_parallel_replicate_degree", "3", "--parallelism.data_parallel_shard_degree", "1")
FIVE = ("--parallelism.data_parallel_replicate_degree", "5", "--parallelism.data_parallel_shard_degree", "1")
WARMUP_STEPS = 2  # the first steps include the process groups' first rendezvous


def mean_step_s(outcome: Outcome) -> float:
    gaps = step_gaps(sorted(outcome.of("step"), key=lambda e: e["step"]))
    return statistics.mean(s for step, s in gaps.items() if step > WARMUP_STEPS + 1)


class MemberMemory:
    """The etcd members' resident memory while a run goes on, sampled every ``SAMPLE_S`` from ``/proc`` (the bench's
    own members: nothing else on the machine runs etcd meanwhile): the largest member's peak, and the members'
    peak together."""

    SAMPLE_S = 0.5

    def __init__(self) -> None:
        self.peak_mb, self.peak_total_mb = 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "MemberMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.SAMPLE_S):
            sizes = [rss_mb(pid) for pid in Path("/proc").iterdir() if pid.name.isdigit() and comm(pid) == "etcd"]
            self.peak_mb = max([self.peak_mb, *sizes])
            self.peak_total_mb = max(self.peak_total_mb, sum(sizes))


def comm(proc: Path) -> str:
    try:
        return (proc / "comm").read_text().strip()
    except OSError:
        return ""


def rss_mb(proc: Path) -> float:
    try:
        status = (proc / "status").read_text()
    except OSError:
        return 0.0
    kb = [line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")]
    return int(kb[0]) / 1024 if kb else 0.0


def checked(outcome: Outcome, steps: int, what: str) -> Outcome:
    """``outcome``, or RuntimeError where its run did not end well: a failed run's step times measure nothing."""
    logged = sorted(e["step"] for e in outcome.of("step"))
    if logged != list(range(1, steps + 1)) or any(outcome.exits):
        raise RuntimeError(f"{what}: steps {logged}, exits {outcome.exits}:\n{outcome.outputs[0][-3000:]}")
    return outcome


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2, help="alternated TCPStore / self-formed etcd runs")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    logs.setup("bench", "__main__")
    reason = netns.unavailable() or etcd_process.unavailable()
    if reason:
        print(f"bench.self_formed cannot run here: {reason}", file=sys.stderr)
        return 2
    layout = (*LAYOUT, "--training.global_batch_size", "12", "--training.steps", str(args.steps))
    step_s: dict[str, list[float]] = {"tcpstore": [], "self_formed_etcd": [], "self_formed_etcd_data_on_tmpfs": []}
    member_mb: list[float] = []  # each self-formed run's largest member's peak RSS
    with (
        tempfile.TemporaryDirectory(prefix="self-formed-") as work,
        tempfile.TemporaryDirectory(prefix="self-formed-", dir="/dev/shm") as memory_work,
    ):
        for pair in range(args.pairs):
            for name in step_s:
                dump = Path(memory_work if name.endswith("tmpfs") else work) / f"{name}-{pair}" / "dump"
                dump.parent.mkdir()  # the members' data goes beside it (``partitions.three_nodes``)
                with Cluster(ETCD_NODES) as cluster, MemberMemory() as memory:
                    store = None if name == "tcpstore" else nodes_url(cluster)
                    outcome = checked(failure_free_on_three(cluster, dump, store, *layout), args.steps, name)
                if store is not None:
                    member_mb.append(round(memory.peak_mb, 1))
                step_s[name].append(round(mean_step_s(outcome), 4))
                log.info(f"pair {pair + 1}: {name}: {step_s[name][-1]:.3f} s per step")
        dump = Path(work) / "node0-killed" / "dump"
        dump.parent.mkdir()
        with Cluster(ETCD_NODES) as cluster:
            killed = self_formed_node0_killed(cluster, dump, *layout)
        if killed.exits != [0, 0]:
            raise RuntimeError(f"node 0 killed: the other nodes exited {killed.exits}:\n{killed.outputs[0][-3000:]}")
        dump = Path(work) / "members-lost" / "dump"
        dump.parent.mkdir()
        steps = ("--training.global_batch_size", "20", "--training.steps", str(args.steps))
        with Cluster(5) as cluster:
            lost = checked(members_lost_one_after_another(cluster, dump, *FIVE, *steps), args.steps, "members lost")
        last = max(lost.of("step"), key=lambda e: e["step"])
        if last["members"] != [3, 4]:
            raise RuntimeError(f"members lost: the run ended with groups {last['members']}, not nodes 3 and 4's")
    ratio = statistics.median(step_s["self_formed_etcd"]) / statistics.median(step_s["tcpstore"])
    fsync = statistics.median(step_s["self_formed_etcd"]) / statistics.median(step_s["self_formed_etcd_data_on_tmpfs"])
    result = {
        "issue": 68,
        "setup": (
            f"3 network-namespace nodes on one {len(os.sched_getaffinity(0))}-core machine, replica "
            f"group i (llama3 tiny, one rank, fp32) on node i, M = 6, {args.steps} steps; the etcd members "
            f"(etcd {etcd_process.release()}) started by the launchers, one per node"
        ),
        "command": f"python -m bench.self_formed --pairs {args.pairs} --steps {args.steps}",
        "step_s": step_s,
        "self_formed_over_tcpstore_step_ratio": round(ratio, 3),
        "data_on_disk_over_tmpfs_step_ratio": round(fsync, 3),
        "member_peak_rss_mb": member_mb,
        "node0_killed": {k: round(v, 2) for k, v in killed.timings.items()},
        "members_lost_one_after_another": {k: round(v, 2) for k, v in lost.timings.items()},
    }
    path = write_result("self_formed", result)
    log.info(
        f"step time, self-formed etcd / TCPStore: {ratio:.3f}; members' data on the disk / on tmpfs: {fsync:.3f}; "
        f"node 0 killed: {result['node0_killed']}; members lost: {result['members_lost_one_after_another']}; {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
