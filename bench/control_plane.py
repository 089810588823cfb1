"""Control-plane load test: the real coordinator and store, simulated nodes and ranks that
speak the protocol but train nothing, at 1,024 / 4,096 / 16,384 ranks by default and up to 100,000
(8 per node, one replica group per node); today's design and the one it replaced, side by side.

    .venv/bin/python -m bench.control_plane [--ranks 1024 4096 16384] [--workers 4] [--before-rev ff61664]

- ``after``: this tree. Each simulated node is a real ``agent.NodeAgent`` whose launcher claims its
  group as a launcher does (a node silent for a while is then kept, not forgotten): its 8 ranks beat
  into real shared-memory channels, its node message is written every heartbeat interval
  (the request its lifeline makes), its epoch thread blocks on the store, and each rank
  reads its channel every 20 ms.
- ``before``: the coordinator of ``--before-rev`` (extracted with ``git archive``) and the
  requests ranks and launchers made then, key for key: every rank bumped ``hb/<r>/<k>``
  every 0.1 s, probed the coordinator every 0.5 s (3 requests) and, while waiting or in a
  collective, checked ``fatal`` and read ``epoch`` every 20 ms; every launcher bumped its
  counter every 0.1 s, probed every 0.5 s and looked at ``fatal``, ``status`` and its
  group's ``fenced`` key every 50 ms. A load generator on a 2-core machine cannot issue
  that many: it issues them as fast as it can, and ``demanded_requests_per_s`` says how
  many the protocol asked for.

Measured per design and size: a process death (its agent reports the exit) and a hung rank
(from its last beat; after: its agent reports it at the timeout) to the new epoch, the
slowest rank to see that epoch, the coordinator process's CPU, resident memory and threads (it
also runs the store server) and store requests per second (the generator's and the coordinator's
own, counted) against those the protocol demands: where the generator serves fewer, the figures
measure the generator on this machine's cores as much as the coordinator; after, also how often the
generator wrote each node's message and the coordinator read them all (the protocol: every 0.1 s),
which says which of the two lagged. After (this tree) also
the killed group back: its restarted ranks all waiting to join (their node message says so) to
the epoch that admits it (``rejoin_admission_s``). A whole node's death (agent and ranks
silent) is measured too: only the heartbeat bound can find it, in both designs.

    .venv/bin/python -m bench.control_plane --designs after --ranks 32768 65536 100000   (the TCPStore)
"""

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.common import CONFIG, RESULTS, ROOT, write_result
from titan_recover.observability import resources

RANKS_PER_NODE = 8
WAIT_S = 120.0  # bound on any one measured event
HEARTBEAT_TIMEOUT_S = 5.0  # the run's default recover.heartbeat_timeout_s

COORDINATOR_MAIN = """
import json, sys, threading, time
from titan_recover import config

counts_path, port = sys.argv[1], int(sys.argv[2])
# the "before" tree parsed the job with config.load; later ones through the TorchTitan adapter
if hasattr(config, "load"):
    job = config.load(sys.argv[3:])
else:
    from titan_recover import titan
    job = titan.load_config(sys.argv[3:])
try:  # the coordinator's lines as its entry point sets them up (trees with logs.get did it on import)
    from titan_recover.observability import logs
    if not hasattr(logs, "get"):
        logs.setup("coordinator")
except ImportError:
    pass
try:  # the layered tree: the coordinator takes a settings record
    from titan_recover.coordinator import shell
    c = shell.serve(config.CoordinatorSettings.of(job, titan.dump_folder(job)), port)
except ImportError:
    from titan_recover import coordinator
    # the "before" tree predates coordinator.serve
    c = coordinator.serve(job, port) if hasattr(coordinator, "serve") else coordinator.Coordinator(job, port)


class Counting:
    '''The coordinator's store, counting the requests the coordinator makes and its reads of every node
    message (one multi_get of the launcher keys each).'''
    def __init__(self, inner):
        self.inner, self.n, self.node_reads = inner, 0, 0
    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr
        def call(*a, **k):
            self.n += 1
            self.node_reads += name == "multi_get" and any(str(k).startswith("launcher/") for k in a[0][:1])
            return attr(*a, **k)
        return call


# this tree's coordinator reaches its store through its ControlClient; the "before" tree's held it itself
holder = c.control if hasattr(c, "control") else c
holder.store = counting = Counting(holder.store)


def dump():
    while True:
        with open(counts_path + ".tmp", "w") as f:
            json.dump({"requests": counting.n, "node_reads": counting.node_reads, "time": time.time()}, f)
        import os; os.replace(counts_path + ".tmp", counts_path)
        time.sleep(0.25)


threading.Thread(target=dump, daemon=True).start()
sys.exit(c.run())
"""


def extract(rev: str, into: str) -> str:
    """``titan_recover/`` as it was at ``rev``, for the before design's coordinator."""
    archive = os.path.join(into, "before.tar")
    subprocess.run(["git", "archive", "-o", archive, rev, "titan_recover"], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the load generator (one process per slice of the nodes) --------------------------------


class Counter:
    """A store client that counts its requests."""

    def __init__(self, client: object) -> None:
        self.client, self.n = client, 0

    def __getattr__(self, name: str):
        attr = getattr(self.client, name)

        def call(*a, **k):
            self.n += 1
            return attr(*a, **k)

        return call


def identity(secret: str) -> Any:
    """How the tree on the path names a run to ``connect``: a ``sealed.Run`` (this tree) or the bare
    secret (the before tree)."""
    try:
        from titan_recover.control.sealed import Run
    except ImportError:
        return secret
    return Run(secret, "")


def worker(design: str, nodes: list[int], address: str, secret: str, inbox: mp.Queue, outbox: mp.Queue) -> None:
    """Simulates ``nodes`` until told to stop; answers commands with measurements."""
    from titan_recover.control import claims, keys, lifeline, transport
    from titan_recover.control.client import ControlClient
    from titan_recover.control.protocol import Launcher, Report

    client = Counter(transport.connect(address, 60.0, identity(secret)))
    control = ControlClient(client)  # type: ignore[arg-type]  # its requests are counted too
    dead: set[int] = set()  # groups whose ranks are gone (killed, or their node died)
    hung: set[int] = set()  # groups one of whose ranks beats no more
    down: set[int] = set()  # nodes that are gone, agent and all
    last_beat = {n: time.time() for n in nodes}  # when rank 0 of each node last beat: a hang counts from there
    seen: dict[int, dict[int, float]] = {}  # epoch -> node -> when its slowest rank first saw it
    newest = {n: -1 for n in nodes}
    written = 0  # node messages written

    def saw(n: int, epoch: int) -> None:
        """Node ``n``'s ranks have all read ``epoch`` (and so every epoch before it) by now."""
        for e in range(newest[n] + 1, epoch + 1):
            seen.setdefault(e, {})[n] = time.time()
        newest[n] = max(newest[n], epoch)

    if design == "after":
        from titan_recover.node.agent import NodeAgent
        from titan_recover.node.channel import BEAT, HEADER, READY, SLOT, STATE, Channel

        agents = {
            n: NodeAgent(address, identity(secret), RANKS_PER_NODE, hang_timeout_s=HEARTBEAT_TIMEOUT_S) for n in nodes
        }
        channels = {}
        launchers_of = {n: Launcher(f"sim{n}", "localhost", os.getpid()) for n in nodes}
        for n, agent in agents.items():
            path = agent.open(n, 0)
            channels[n] = Channel.open(path)
            control.register(launchers_of[n], agent.message())
            agent.start(on_error=print)
            claims.claim(control, launchers_of[n], [n], HEARTBEAT_TIMEOUT_S, lambda _: None)  # as launch.py does
        slot_beats = {n: c.words[HEADER + BEAT :: SLOT] for n, c in channels.items()}
    outbox.put(("up", nodes[0]))
    next_beat = next_probe = next_launcher = time.monotonic()
    while True:
        now = time.monotonic()
        while not inbox.empty():
            cmd, node = inbox.get()
            if cmd == "stop":
                outbox.put(("requests", client.n))
                outbox.close()
                outbox.join_thread()  # the answer is out before the process ends
                # not a return: the agents' epoch threads sit in a C++ store wait, which aborts
                # the process at interpreter shutdown ("terminate called without an active exception")
                os._exit(0)
            if cmd == "requests":
                outbox.put(("requests", client.n))
            elif cmd == "written":
                outbox.put(("written", written))
            elif cmd == "kill":  # its torchrun exited: the agent (launcher) reports it, as launch.py does
                dead.add(node)
                t = time.time()
                if design == "after":
                    agents[node].channels.pop(node).remove()
                cause = f"torchrun of replica {node} exited"
                if design == "after":
                    control.report(Report(epoch=0, cause=cause, replica=node, suspect=node))
                else:  # the report as the before tree wrote and read it (its reader refuses this tree's "error": null)
                    index = int(client.add(keys.REPORTS, 1))
                    client.set(
                        keys.report_key(index),
                        json.dumps({"replica": node, "epoch": 0, "suspect": node, "cause": cause, "time": time.time()}),
                    )
                outbox.put(("killed", t))
            elif cmd == "restart":  # the killed group's next incarnation, every rank up and waiting to join
                path = agents[node].open(node, 1)
                channels[node] = Channel.open(path)
                channels[node].words[HEADER + STATE :: SLOT] = READY
                slot_beats[node] = channels[node].words[HEADER + BEAT :: SLOT]
                dead.discard(node)
                outbox.put(("restarted", time.time()))
            elif cmd == "hang":
                hung.add(node)
                outbox.put(("hung", last_beat[node]))
            elif cmd == "node_down":
                down.add(node)
                dead.add(node)
                outbox.put(("down", time.time()))
            elif cmd == "seen":  # the slowest live rank of this worker to see epoch ``node``
                live = [t for n, t in seen.get(node, {}).items() if n not in dead]
                complete = len(live) == len([n for n in nodes if n not in dead])
                outbox.put(("seen", max(live) if live and complete else None))
        if design == "after":
            if now >= next_beat:  # every rank's beat thread, then every node's lifeline write
                for n in nodes:
                    if n not in dead:
                        beats = slot_beats[n]
                        if n in hung:
                            beats[1:] += 1  # rank 0 beats no more
                        else:
                            beats += 1
                            last_beat[n] = time.time()
                for n in nodes:
                    if n not in down:
                        control.write_node(launchers_of[n], agents[n].message())
                        written += 1
                        for rec in agents[n].take_hangs():  # the launcher's watch loop reports them
                            control.report(rec)
                if now >= next_probe:
                    for n in nodes:
                        if n not in down:
                            client.add(keys.ALIVE, 0)
                    next_probe = now + lifeline.PROBE_S
                next_beat = now + 0.1
            for n in nodes:  # every rank reads its channel (8 ranks: the same word)
                saw(n, channels[n].epoch())
            time.sleep(max(0.0, 0.02 - (time.monotonic() - now)))
        else:
            heartbeats = now >= next_beat
            probes = now >= next_probe
            launchers = now >= next_launcher
            for n in nodes:
                if n in down:
                    continue
                if launchers:  # launch.py's watch loop every 50 ms
                    client.check([keys.FATAL])
                    client.check([keys.STATUS])
                    client.check([keys.fenced_key(n)])
                if heartbeats:  # its lifeline
                    client.add(f"launcher/sim{n}", 1)
                if probes:
                    client.add(keys.ALIVE, 0)
                    client.check([keys.STATUS])
                    client.check([keys.FATAL])
                if n in dead:
                    continue
                for k in range(RANKS_PER_NODE):
                    if heartbeats and not (n in hung and k == 0):
                        client.add(f"hb/{n}/{k}", 1)
                        if k == 0:
                            last_beat[n] = time.time()
                    if probes:
                        client.add(keys.ALIVE, 0)
                        client.check([keys.STATUS])
                        client.check([keys.FATAL])
                    client.check([keys.FATAL])  # _store_epoch, every 20 ms while waiting
                    epoch = int(client.get(keys.EPOCH))
                    if k == RANKS_PER_NODE - 1:  # the node's last rank to read in this round
                        saw(n, epoch)
            next_beat = now + 0.1 if heartbeats else next_beat
            next_probe = now + lifeline.PROBE_S if probes else next_probe
            next_launcher = now + 0.05 if launchers else next_launcher
            time.sleep(max(0.0, 0.02 - (time.monotonic() - now)))


# ---- one run: a design at one size --------------------------------------------------------


def demanded(design: str, nodes: int) -> float:
    """Requests per second the protocol asks of the generator (nodes, ranks), without the coordinator's."""
    if design == "after":
        return nodes * (10 + 2)  # node message every 0.1 s, alive probe every 0.5 s
    per_rank = 10 + 3 * 2 + 2 * 50  # heartbeat, probe, fatal + epoch every 20 ms
    per_launcher = 10 + 3 * 2 + 3 * 20
    return nodes * (RANKS_PER_NODE * per_rank + per_launcher)


def run(design: str, ranks: int, workers: int, tree: str, scratch: str) -> dict:
    from torch.distributed import DistStoreError

    from titan_recover.control import keys, transport
    from titan_recover.control.client import ControlClient

    nodes = ranks // RANKS_PER_NODE
    port, secret = transport.free_port(), f"bench{os.getpid()}{design}{ranks}"
    address = f"127.0.0.1:{port}"
    dump = tempfile.mkdtemp(dir=scratch)
    counts = os.path.join(dump, "counts.json")
    env = {**os.environ, keys.SECRET_ENV: secret, keys.COORDINATOR_ENV: address, "PYTHONPATH": tree}
    args = [
        "--job.config_file",
        str(CONFIG),
        "--job.dump_folder",
        dump,
        "--parallelism.data_parallel_replicate_degree",
        str(nodes),
        "--parallelism.data_parallel_shard_degree",
        str(RANKS_PER_NODE),
        "--training.steps",
        "1000000",
        "--recover.min_replicas",
        "1",
        "--training.local_batch_size",
        "1",
        "--training.global_batch_size",
        str(ranks),
    ]
    coordinator = subprocess.Popen(
        [sys.executable, "-c", COORDINATOR_MAIN, counts, str(port), *args],
        cwd=tree,
        env=env,
        stdout=open(os.path.join(dump, "coordinator.log"), "w"),
        stderr=subprocess.STDOUT,
    )
    ctx = mp.get_context("spawn")
    procs, inboxes, outboxes = [], [], []
    try:
        main = transport.connect(
            address,
            120.0,
            identity(secret),
            gone=lambda: None if coordinator.poll() is None else "the coordinator exited",
        )
        slices = [list(range(nodes))[i::workers] for i in range(workers)]
        for part in slices:
            inbox, outbox = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=worker, args=(design, part, address, secret, inbox, outbox), daemon=True)
            p.start()
            procs.append(p)
            inboxes.append(inbox)
            outboxes.append(outbox)
        for outbox in outboxes:
            assert outbox.get(timeout=WAIT_S)[0] == "up"
        time.sleep(5.0)  # every node has beaten for a while

        def ask(i: int, cmd: str, arg: int = -1) -> Any:  # what the worker answers (a measurement)
            inboxes[i].put((cmd, arg))
            return outboxes[i].get(timeout=WAIT_S)[1]

        def tally() -> tuple[int, int, int]:
            """Store requests (the generator's and the coordinator's), node messages the generator wrote, and
            the coordinator's reads of every node message (after; 0 before) so far."""
            coordinator_counts = json.loads(Path(counts).read_text())
            asked = sum(ask(i, "requests") for i in range(workers)) + coordinator_counts["requests"]
            written = sum(ask(i, "written") for i in range(workers)) if design == "after" else 0
            return asked, written, coordinator_counts.get("node_reads", 0)

        # steady state: coordinator CPU and store requests over a window without failures
        window = 10.0
        cpu0, (req0, wrote0, read0), t0 = cpu_seconds(coordinator.pid), tally(), time.monotonic()
        time.sleep(window)
        cpu1, (req1, wrote1, read1), t1 = cpu_seconds(coordinator.pid), tally(), time.monotonic()
        held = resources.usage(coordinator.pid)

        def next_epoch(epoch: int) -> float | None:
            """When the epoch after ``epoch`` was published; None when not within ``WAIT_S`` (recorded, not
            fatal: the size at which the control plane stops keeping up is a result)."""
            try:
                main.wait([keys.members_key(epoch + 1)], timedelta(seconds=WAIT_S))
            except DistStoreError:
                missed.append(epoch + 1)
                return None
            return time.time()

        def since(start: float, woke: float | None) -> float | None:
            return None if woke is None else round(woke - start, 3)

        def propagation(epoch: int, published: float | None) -> float | None:
            deadline = time.monotonic() + WAIT_S
            while published is not None and time.monotonic() < deadline:
                slowest = [ask(i, "seen", epoch) for i in range(workers)]
                if None not in slowest:
                    return max(slowest) - published
                time.sleep(0.2)
            return None

        missed: list[int] = []
        epoch = ControlClient(main).epoch()
        killed = ask(0, "kill", slices[0][0])
        woke = next_epoch(epoch)
        death = since(killed, woke)
        prop = [propagation(epoch + 1, woke)]
        admission = None
        if design == "after" and woke is not None:  # the killed group back: its restarted ranks' join to its admission
            epoch = ControlClient(main).epoch()
            restarted = ask(0, "restart", slices[0][0])
            admission = since(restarted, next_epoch(epoch))
            if admission is not None and slices[0][0] not in ControlClient(main).membership(epoch + 1).members:
                raise RuntimeError(f"epoch {epoch + 1} after the restart does not admit group {slices[0][0]}")
        epoch = ControlClient(main).epoch()
        hung = ask(1 % workers, "hang", slices[1 % workers][1])
        woke = next_epoch(epoch)
        hang = since(hung, woke)
        prop.append(propagation(epoch + 1, woke))
        epoch = ControlClient(main).epoch()
        gone = ask(2 % workers, "node_down", slices[2 % workers][2])
        node_death = since(gone, next_epoch(epoch))
        for inbox in inboxes:
            inbox.put(("stop", -1))
        propagated = [s for s in prop if s is not None]
        return {
            "death_detect_s": death,
            "rejoin_admission_s": admission,
            "hang_detect_s": hang,
            "node_death_detect_s": node_death,
            "epoch_propagation_s": None if len(propagated) < len(prop) else round(max(propagated), 3),
            "coordinator_cpu_cores": round((cpu1 - cpu0) / (t1 - t0), 3),
            "coordinator_memory_mib": held["rss_mb"],
            "coordinator_threads": held["threads"],
            "store_requests_per_s": round((req1 - req0) / (t1 - t0)),
            "demanded_requests_per_s": demanded(design, nodes),
            # how often each node's message was written (the protocol: every 0.1 s) and the coordinator read them all
            "node_message_interval_s": round(nodes * (t1 - t0) / (wrote1 - wrote0), 3) if wrote1 > wrote0 else None,
            "coordinator_read_interval_s": round((t1 - t0) / (read1 - read0), 3) if read1 > read0 else None,
            "epochs_not_published": missed,  # within WAIT_S of their failure (or restart)
            # node reads the coordinator took for a stalled store, granting every group a new timeout
            "stall_graces": Path(dump, "coordinator.log").read_text().count("no node message read"),
        }
    except BaseException:
        print(Path(dump, "coordinator.log").read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        coordinator.kill()
        coordinator.wait()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--workers", type=int, default=4, help="load generator processes")
    ap.add_argument("--before-rev", default="ff61664", help="the commit of the per-rank design")
    ap.add_argument("--designs", nargs="+", default=["before", "after"], choices=["before", "after"])
    args = ap.parse_args(argv)
    bad = [n for n in args.ranks if n % RANKS_PER_NODE or n // RANKS_PER_NODE < 3 * args.workers]
    if bad:
        ap.error(f"--ranks {bad}: each must be a multiple of {RANKS_PER_NODE} with at least 3 nodes per worker")
    result: dict = {
        "ranks": args.ranks,
        "ranks_per_node": RANKS_PER_NODE,
        "workers": args.workers,
        "before_rev": args.before_rev,
        "cpus": os.cpu_count(),
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
    }
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"after": str(ROOT), "before": extract(args.before_rev, tempfile.mkdtemp(dir=scratch))}
        for design in args.designs:
            result[design] = {"ranks": args.ranks}
            for ranks in args.ranks:
                start = time.monotonic()
                row = run(design, ranks, args.workers, trees[design], scratch)
                print(f"{design:6} {ranks:6} ranks: {json.dumps(row)} ({time.monotonic() - start:.0f}s)", flush=True)
                for key, value in row.items():  # one list per measure, a value per size
                    result[design].setdefault(key, []).append(value)
    kept = RESULTS / "control_plane.json"
    if kept.exists():  # a design not run this time keeps its committed figures, at its own sizes
        before = json.loads(kept.read_text())
        for design in {"before", "after"} - set(args.designs):
            if design in before:
                result[design] = {"ranks": before[design].get("ranks", before["ranks"]), **before[design]}
    print(f"wrote {write_result('control_plane', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
