"""Liveness on etcd, under load: what node messages cost a real 3-member etcd cluster.

The measurement that moved a run's node messages off etcd onto the leader's board
(``control.board``): it writes them to etcd as runs once did, to show where that stops.

    .venv/bin/python -m bench.etcd_nodes [--nodes 64 256 1024] [--seconds 20] [--workers 4]

Each simulated node writes a real, sealed node message (one replica group of 8 ranks) every
``config.node_message_interval_s`` of an etcd run (0.4 s; the stored results ran at 0.5 s) through the run's client, as
its
launcher's lifeline does; the coordinator's read of every node message (``ControlClient.node_messages``)
runs at the same interval. Per size: node messages demanded and written per second, write latency
(p50, p99), the coordinator's read of all of them (p50, p99), and the CPU the etcd members used
(cores). Load generators and etcd share this machine's cores, as in ``bench.failover``: a size whose
writes fall short of the demand is past what this machine sustains, not a measure of etcd alone.
"""

import argparse
import logging
import multiprocessing as mp
import multiprocessing.synchronize
import os
import secrets
import threading
import time

from bench.common import write_result
from titan_recover import config
from titan_recover.control import etcd_process, keys, transport
from titan_recover.control.client import ControlClient
from titan_recover.control.protocol import NodeGroup, NodeMessage
from titan_recover.control.sealed import Run
from titan_recover.observability import logs
from titan_recover.tools.etcd_local import LocalEtcd

log = logging.getLogger(__name__)
INTERVAL_S = config.node_message_interval_s(config.Recover(control_store="etcd://h:1,h:2,h:3"))


def message(seq: int) -> NodeMessage:
    return NodeMessage(seq, {0: NodeGroup(attempt=0, ranks=8, ready=0, finished=0, silent_s=0.05)})


def writer(
    url: str,
    run: Run,
    nodes: list[int],
    seconds: float,
    ready: "mp.synchronize.Barrier",
    out: "mp.Queue[tuple[int, list[float]]]",
) -> None:
    """Writes the messages of ``nodes`` every interval for ``seconds``, from when every writer is ready."""
    client = ControlClient(transport.in_run(transport.etcd(url, 30.0), run))
    ready.wait()
    latencies: list[float] = []
    written, seq = 0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tick = time.monotonic()
        seq += 1
        for node in nodes:
            start = time.perf_counter()
            client.put(keys.launcher_key(f"node{node}"), message(seq))
            latencies.append(time.perf_counter() - start)
            written += 1
            if time.monotonic() >= end:
                break
        time.sleep(max(0.0, tick + INTERVAL_S - time.monotonic()))
    out.put((written, latencies))


def etcd_cpu_s(cluster: LocalEtcd) -> float:
    total = 0.0
    for proc in cluster.procs.values():
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50_ms": 1000 * xs[len(xs) // 2], "p99_ms": 1000 * xs[min(len(xs) - 1, int(0.99 * len(xs)))]}


def measure(cluster: LocalEtcd, nodes: int, seconds: float, workers: int) -> dict:
    run = Run(secrets.token_hex(16), secrets.token_hex(8))
    reader = ControlClient(transport.in_run(transport.etcd(cluster.url, 30.0), run))
    names = [keys.launcher_key(f"node{n}") for n in range(nodes)]
    for name in names:  # every message exists before the reads begin, as after registration
        reader.store.set(name, message(0).dumps())
    spawn = mp.get_context("spawn")  # a forked writer would share this process's cached etcd client, socket and all
    out: "mp.Queue[tuple[int, list[float]]]" = spawn.Queue()
    ready = spawn.Barrier(workers + 1)  # the clock starts once every writer has imported and connected
    procs = [
        spawn.Process(target=writer, args=(cluster.url, run, list(range(w, nodes, workers)), seconds, ready, out))
        for w in range(workers)
    ]
    reads: list[float] = []
    stop = threading.Event()

    def read_all() -> None:
        while not stop.wait(INTERVAL_S):
            start = time.perf_counter()
            reader.node_messages(names)
            reads.append(time.perf_counter() - start)

    for p in procs:
        p.start()
    ready.wait(timeout=120)
    cpu = etcd_cpu_s(cluster)
    started = time.monotonic()
    thread = threading.Thread(target=read_all, daemon=True)
    thread.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    wall = time.monotonic() - started
    stop.set()
    thread.join()
    for p in procs:
        p.join(timeout=30)
    written = sum(n for n, _ in results)
    return {
        "nodes": nodes,
        "ranks": 8 * nodes,
        "seconds": wall,
        "demanded_writes_per_s": nodes / INTERVAL_S,
        "writes_per_s": written / wall,
        "write": quantiles([x for _, lat in results for x in lat]),
        "read_all": quantiles(reads),
        "etcd_cpu_cores": (etcd_cpu_s(cluster) - cpu) / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    logs.setup("bench", __name__, "bench")
    cluster = LocalEtcd(3).start()
    try:
        sizes = []
        for nodes in args.nodes:
            sizes.append(measure(cluster, nodes, args.seconds, args.workers))
            s = sizes[-1]
            log.info(
                f"{nodes} nodes: {s['writes_per_s']:.0f} of {s['demanded_writes_per_s']:.0f} node messages/s written, "
                f"write p50 {s['write']['p50_ms']:.1f} ms p99 {s['write']['p99_ms']:.1f} ms, read of all p50 "
                f"{s['read_all']['p50_ms']:.1f} ms, etcd {s['etcd_cpu_cores']:.2f} cores"
            )
    finally:
        cluster.stop()
    path = write_result(
        "etcd_nodes",
        {
            "setup": {
                "etcd": f"3 members on this machine (etcd {etcd_process.release()})",
                "interval_s": INTERVAL_S,
                "workers": args.workers,
                "cores": os.cpu_count(),
            },
            "sizes": sizes,
        },
    )
    log.info(f"wrote {path}")


if __name__ == "__main__":
    main()
