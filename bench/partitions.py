"""Network faults on a cluster of network namespaces (issue 28): the job's partition cases
(``titan_recover.tools.clusters.partitions``, which the tests run too), each checked against the failure-free
run on the same cluster, and the step time that latency and loss between nodes cost, side by side with
no shaping.

Two nodes (``titan_recover.tools.clusters.netns``, addresses 198.18.0.1-2), replica group i (FSDP 2, the
tiny llama3, fp32, 6 steps) on node i, the coordinator's TCPStore on node 0 bound to its address.
Cases: ``cut_off`` (node 1 unplugged for 8 s after step 2), ``coordinator_cut_off`` (node 0 unplugged
for good), ``paused`` (node 1 SIGSTOPped for 20 s), ``replaced`` (node 1's processes SIGKILLed, the
same command started again), ``latency_loss`` (50 ms each way and 1% loss between the nodes).
On etcd, three nodes, each running an etcd member on its address, the launchers (and so the coordinator
candidates) on nodes 0 and 1 as above: ``leader_cut_off`` (the coordinator leader's node unplugged for 8 s,
past its lease), ``etcd_member_cut_off`` (node 2, its member leading Raft, unplugged for 8 s); these are
checked against the failure-free run on etcd.
``tests/test_partitions.py`` runs the same scenarios and asserts on them.

    .venv/bin/python -m bench.partitions [--pairs 2]    # root, iproute2 and nftables

Writes bench/results/partitions.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.common import step_gaps, write_result
from titan_recover.compare import compare_runs
from titan_recover.tools.clusters import netns
from titan_recover.tools.clusters.netns import Cluster
from titan_recover.tools.clusters.partitions import (
    CASES,
    ETCD_NODES,
    MICROBATCHES,
    ON_ETCD,
    STEPS,
    Hang,
    Outcome,
    failure_free,
    failure_free_on_etcd,
    latency_loss,
)


def violations(reference: Outcome, outcome: Outcome, survivors: list[int]) -> list[str]:
    """The invariants, as problems: the failure-free data, M microbatches and losses within 1e-3 at every
    step, each step logged once; exit 0 and equal parameter digests at the end for the ``survivors``."""
    result = compare_runs(reference.events, outcome.events, 1e-3)
    problems = list(result.problems)
    problems += [
        f"step {e['step']}: {len(e['microbatches'])} microbatches"
        for e in outcome.of("step")
        if len(e["microbatches"]) != MICROBATCHES
    ]
    logged = [e["step"] for e in outcome.of("step")]
    problems += (
        [f"steps logged {logged}, not 1..{STEPS} once each"] if sorted(logged) != list(range(1, STEPS + 1)) else []
    )
    problems += [f"node {i} exited {outcome.exits[i]}" for i in survivors if outcome.exits[i] != 0]
    digests = {e["replica"]: e["digest"] for e in outcome.of("param_digest") if e["step"] == STEPS}
    problems += [f"parameter digests at step {STEPS}: {digests}"] if len(set(digests.values())) != 1 else []
    return problems


def mean_step_s(outcome: Outcome) -> float:
    return statistics.mean(step_gaps(outcome.of("step")).values())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2, help="alternated unshaped / latency-and-loss runs")
    args = parser.parse_args(argv)
    reason = netns.unavailable()
    if reason:
        print(f"bench.partitions cannot run here: {reason}", file=sys.stderr)
        return 2
    cases: dict[str, dict] = {}
    plain: list[float] = []
    shaped: list[float] = []
    with tempfile.TemporaryDirectory(prefix="partitions-") as work:

        def run(name: str, scenario: Callable[[Cluster, Path], Outcome]) -> tuple[Outcome | None, str | None]:
            dump = Path(work) / f"{name}-{len(os.listdir(work))}" / "dump"
            dump.parent.mkdir()
            with Cluster(ETCD_NODES if name in ON_ETCD else 2) as cluster:
                try:
                    return scenario(cluster, dump), None
                except Hang as e:
                    return None, str(e).splitlines()[0]

        reference, hang = run("failure_free", failure_free)
        if reference is None:
            raise RuntimeError(f"the failure-free run on the namespace cluster did not finish: {hang}")
        on_etcd, hang = run("failure_free_on_etcd", failure_free_on_etcd)
        if on_etcd is None:
            raise RuntimeError(f"the failure-free run on etcd on the namespace cluster did not finish: {hang}")
        plain.append(mean_step_s(reference))
        for name, scenario in CASES.items():
            outcome, hang = run(name, scenario)
            survivors = [0] if name == "coordinator_cut_off" else [0, 1]
            problems = (
                [] if outcome is None else violations(on_etcd if name in ON_ETCD else reference, outcome, survivors)
            )
            if outcome is not None and name == "coordinator_cut_off":
                problems = [p for p in problems if "parameter digests" not in p]  # replica 1 is gone by design
                if outcome.exits[1] != 3:
                    problems.append(f"node 1 exited {outcome.exits[1]}, not 3")
            if outcome is not None and name == "leader_cut_off" and outcome.timings["old_leader_writes"]:
                problems.append(
                    f"the old leader's node logged {outcome.timings['old_leader_writes']:g} coordinator "
                    "event(s) after the takeover"
                )
            if (
                outcome is not None
                and name == "etcd_member_cut_off"
                and (outcome.of("failure") or len(outcome.of("leader")) != 1)
            ):
                problems.append(
                    f"a member cut off was seen: {len(outcome.of('failure'))} failure(s), "
                    f"{len(outcome.of('leader'))} coordinator leader(s)"
                )
            cases[name] = {
                "hang": hang,
                "violations": problems,
                "timings": {k: round(v, 2) for k, v in (outcome.timings if outcome else {}).items()},
                "failures": []
                if outcome is None
                else [{k: e[k] for k in ("replica", "step", "cause")} for e in outcome.of("failure")],
            }
            if name == "latency_loss" and outcome is not None:
                shaped.append(mean_step_s(outcome))
            print(
                f"{name}: {'HANG ' + hang if hang else 'ok' if not problems else problems} {cases[name]['timings']}",
                flush=True,
            )
        for _ in range(args.pairs - 1):  # more side-by-side pairs for the step-time ratio
            for name, scenario, into in (("failure_free", failure_free, plain), ("latency_loss", latency_loss, shaped)):
                outcome, hang = run(name, scenario)
                if outcome is not None:
                    into.append(mean_step_s(outcome))
    recoveries = [v for c in cases.values() for k, v in c["timings"].items() if k.startswith("rejoined_after")]
    result = {
        "issue": 28,
        "setup": "2 network-namespace nodes on one 2-core machine, replica group i (llama3 tiny, FSDP 2, fp32) "
        f"on node i, {STEPS} steps, M = {MICROBATCHES}; TCPStore coordinator on node 0 at 198.18.0.1; "
        f"the etcd cases on {ETCD_NODES} nodes, an etcd member on each at its address, leader lease 3 s",
        "command": "python -m bench.partitions " + " ".join(argv),
        "partition_cases": list(cases),
        "partition_invariant_violations": sum(len(c["violations"]) for c in cases.values()),
        "partition_hangs": sum(c["hang"] is not None for c in cases.values()),
        "partition_max_recovery_s": round(max(recoveries), 2) if recoveries else None,
        "latency_loss_step_time_ratio": round(statistics.median(shaped) / statistics.median(plain), 2)
        if shaped
        else None,
        "step_s": {"unshaped": [round(s, 3) for s in plain], "latency_50ms_loss_1pct": [round(s, 3) for s in shaped]},
        "cases": cases,
    }
    path = write_result("partitions", result)
    print(
        f"{len(cases)} cases, {result['partition_invariant_violations']} "
        f"violations, {result['partition_hangs']} hangs; "
        f"latency and loss step time ratio {result['latency_loss_step_time_ratio']} -> {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
