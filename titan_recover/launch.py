"""The launcher behind ``run_train.sh``: coordinator + one torchrun job per replica group.

``[recover] enable = true``: starts the coordinator (unless ``$TITAN_RECOVER_COORDINATOR``
points at one on another node; with an etcd ``control_store`` every launcher starts a
coordinator candidate, one leads, and a candidate that dies before the run ends is started
again), then R ``torchrun`` jobs of dp_shard x tp x pp ranks each,
and restarts a group's torchrun when it fails, up to ``[recover] max_restarts``
times within ``restart_window_s`` (titan_recover.restarts): only the failed group restarts, and it rejoins from a live peer.
Each launcher first claims its groups in the coordinator's store (titan_recover.claims): a group runs
under one launcher, a dead launcher's groups go to the one started in its place, and incarnation
numbers are the store's, so a replacement's groups rejoin. Only the launcher that starts the
coordinator starts a new event log; the others append to it. When the
coordinator fences a group that is hung rather than dead (e.g. SIGSTOP), this
launcher SIGKILLs its ranks first. (torchrun's own ``--max_restarts`` is not used:
with ``--standalone`` in torch 2.13 a restarted group read its previous attempt's
gloo addresses and failed to connect.)
``enable = false``: one ``torchrun`` world of R x dp_shard x tp x pp ranks, stock TorchTitan,
restarted as a whole on failure (checkpoint-and-restart), on the same budget.
The coordinator listens on loopback unless ``[recover] coordinator_bind`` says otherwise, and every
process of the run reaches its keys through the run's secret, ``$TITAN_RECOVER_SECRET`` (made here
for a single-node run, given by the user for a multi-node one): see the README's trust model.
Either way the run ends with a summary from ``recover_events.jsonl``.
"""

import ctypes
import faulthandler
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from titan_recover import claims, config, cpu_shim, devices, node_channel, store
from titan_recover.agent import NodeAgent
from titan_recover.events import events_path
from titan_recover.restarts import RestartBudget
from titan_recover.summary import format_summary, summarize_events
from titan_recover.tokens import DataError

REPLICAS_ENV = store.REPLICAS_ENV  # comma-separated replica ids this node launches


def parse_replicas(value: str | None, replicas: int) -> list[int]:
    """The replica groups this node launches, from ``$TITAN_RECOVER_REPLICAS`` (unset: all of them,
    spares included: ``replicas`` counts every id).

    Checked before anything starts: a bad id used to end in a traceback, or in groups that
    never come (an id out of range, or one listed twice) while the coordinator waits for them.
    """
    if value is None:
        return list(range(replicas))
    fix = (
        f"set it to the comma-separated replica groups this node launches, ids 0..{replicas - 1} "
        f"(parallelism.data_parallel_replicate_degree + recover.spares = {replicas}), e.g. 0,1; or unset it to launch all"
    )
    ids: list[int] = []
    for item in value.split(","):
        if not re.fullmatch(r"-?\d+", item.strip(), re.ASCII):
            what = "an empty entry" if not item.strip() else f"{item.strip()!r} is not a replica id"
            raise config.ConfigError(f"{REPLICAS_ENV}={value!r}: {what}; {fix}")
        r = int(item)
        if not 0 <= r < replicas:
            raise config.ConfigError(f"{REPLICAS_ENV}={value!r}: replica {r} is out of range; {fix}")
        if r in ids:
            raise config.ConfigError(f"{REPLICAS_ENV}={value!r}: replica {r} is listed twice; {fix}")
        ids.append(r)
    return ids


def parse_group_node(value: str | None, parts: int) -> int:
    """This node's part of its replica groups, from ``$TITAN_RECOVER_GROUP_NODE`` (unset: 0),
    checked before anything starts."""
    if value is None:
        return 0
    fix = f"set it to 0..{parts - 1} (recover.group_nodes = {parts}: the part of its replica groups this node runs)"
    if not re.fullmatch(r"\d+", value.strip(), re.ASCII) or not int(value) < parts:
        raise config.ConfigError(f"{store.GROUP_NODE_ENV}={value!r} is not a part of a replica group; {fix}")
    return int(value)


def check_control_store(url: str) -> str:
    """The etcd cluster of ``[recover] control_store``, checked before anything starts."""
    try:
        from titan_recover.etcd_store import check_cluster
    except ImportError as e:
        raise config.ConfigError(f"recover.control_store names etcd but its client is missing ({e}): "
                                 "pip install 'titan_recover[etcd]'") from None
    try:
        return check_cluster(url, timeout_s=5.0)
    except ValueError as e:
        raise config.ConfigError(f"recover.control_store: {e}") from None


def check_coordinator(address: str, control_store: str = "") -> str:
    """``$TITAN_RECOVER_COORDINATOR`` checked as ``host:port`` before anything starts (a bad one
    failed only once the replica groups were up), or, with an etcd control store, as that
    store's URL; returns it."""
    if control_store:
        if address != control_store:
            raise config.ConfigError(
                f"{store.COORDINATOR_ENV}={address!r} differs from recover.control_store={control_store!r}: with an "
                f"etcd control store, set it to the same URL on every node after the first (or unset it on the first)"
            )
        return address
    host, _, port = address.rpartition(":")
    fix = "set it to host:port of the coordinator another node's launcher started, or unset it to start one here"
    if not host or any(c.isspace() for c in host) or not re.fullmatch(r"\d+", port, re.ASCII):
        raise config.ConfigError(f"{store.COORDINATOR_ENV}={address!r} is not host:port; {fix}")
    if not 0 < int(port) < 65536:
        raise config.ConfigError(f"{store.COORDINATOR_ENV}={address!r}: port {int(port)} is out of range 1..65535; {fix}")
    return address


def log(msg: str) -> None:
    print(f"[titan_recover launcher] {msg}", flush=True)


PR_SET_PDEATHSIG = 1
LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: a forked child must not dlopen (threads may hold its lock)


def die_with_parent() -> None:
    """Asks the kernel to SIGKILL this process when its parent dies: a SIGKILLed
    launcher (or torchrun agent) then leaves no orphaned rank behind."""
    parent = os.getppid()
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def dumps_stacks() -> None:
    """``kill -USR1 <pid>`` prints every thread's stack to this process's stderr: what a
    process that looks hung is doing, without stopping it (launcher, coordinator, ranks)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


class Rendezvous(NamedTuple):
    """Where the torchrun agents of one incarnation of a group that spans nodes meet: a static
    rendezvous on part 0's host, at a port its launcher picked for that incarnation alone."""

    host: str
    port: int
    part: int
    parts: int
    timeout_s: float

    def args(self) -> list[str]:
        return ["--nnodes", str(self.parts), "--node-rank", str(self.part), "--master-addr", self.host,
                "--master-port", str(self.port), "--rdzv-conf", f"timeout={int(self.timeout_s)}"]


def torchrun(nproc: int, argv: list[str], role: str, rendezvous: Rendezvous | None = None) -> list[str]:
    where = ["--standalone", "--nnodes", "1"] if rendezvous is None else rendezvous.args()
    return [
        sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={nproc}",
        "--max_restarts", "0", "--role", role, "--tee", "3", "--local-ranks-filter", "0",
        "-m", "titan_recover.train", *argv,
    ]


def node_address(coordinator: str) -> str:
    """This node's address as the coordinator's network sees it (the local end of a route to
    the coordinator; nothing is sent): where part 0 of a group asks the other parts to meet."""
    if store.is_etcd(coordinator):
        coordinator = "{}:{}".format(*store.parse_etcd_url(coordinator)[0])
    host, _, port = coordinator.rpartition(":")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host.strip("[]"), int(port)))
        return s.getsockname()[0]


def with_threads(env: dict[str, str], local_ranks: int) -> dict[str, str]:
    """Splits this host's cores among its ranks (unless ``OMP_NUM_THREADS`` is set).

    torchrun sets one thread per rank only when it starts several; a replica group of
    one rank would otherwise take every core, and R such groups on one host oversubscribe
    it, which made CPU steps 10-20x slower while OpenMP threads spun against each other.
    """
    if "OMP_NUM_THREADS" in env:
        return env
    return {**env, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // local_ranks))}


def is_incarnation(pid: int, replica: int, attempt: int) -> bool:
    """Whether ``pid`` is a rank of that incarnation (its environment says so), not a reused pid."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = set(f.read().split(b"\0"))
    except OSError:  # gone already
        return False
    return {f"{store.REPLICA_ENV}={replica}".encode(), f"{store.ATTEMPT_ENV}={attempt}".encode()} <= env


def kill_fenced(client: object, agent: NodeAgent, replica: int, handled: dict[int, int]) -> None:
    """SIGKILLs the ranks of a fenced incarnation of ``replica`` that run on this node
    (their pids are in its channel).

    A fenced group may be hung (SIGSTOP, a wedged collective) rather than dead;
    torchrun only restarts a group once one of its processes exits.
    """
    key = store.fenced_key(replica)
    if not client.check([key]):  # type: ignore[attr-defined]
        return
    attempt = store.get_json(client, key, ("attempt",))["attempt"]  # type: ignore[arg-type]
    if handled.get(replica, -1) >= attempt:
        return
    handled[replica] = attempt
    for local_rank, pid in agent.pids(replica, attempt).items():
        if not is_incarnation(pid, replica, attempt):
            continue  # the pid now belongs to someone else
        try:
            os.kill(pid, signal.SIGKILL)
            log(f"killed local rank {local_rank} of fenced replica {replica} (attempt {attempt}, pid {pid})")
        except ProcessLookupError:
            pass  # already gone


def with_gpus(env: dict[str, str], visible: str | None) -> dict[str, str]:
    """``env`` with the GPUs a group may use (unchanged on a CPU host)."""
    return env if visible is None else {**env, "CUDA_VISIBLE_DEVICES": visible}


def device_plan(requested: str, groups: int, ranks: int) -> devices.DevicePlan:
    """This host's device plan; a ``config.ConfigError`` if it cannot run the groups."""
    gpus = devices.host_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
    return devices.plan(requested, gpus, groups, ranks, dist.is_nccl_available())


def coordinator_bind(configured: str, local: list[int], replicas: int, parts: int = 1) -> str:
    """Where the coordinator this launcher starts listens: loopback when every replica group
    runs on this node, else the address the user chose ([recover] coordinator_bind).

    A multi-node run must choose it: listening on every interface by default would open
    the store to any host that can route to this one.
    """
    if configured:
        return configured
    if sorted(local) == list(range(replicas)) and parts == 1:
        return store.LOOPBACK
    others = sorted(set(range(replicas)) - set(local))
    what = f"replica groups {others} run" if others else f"the replica groups span {parts} nodes (recover.group_nodes), whose parts run"
    raise config.ConfigError(
        f"{what} on other nodes, which cannot reach a coordinator on loopback: set "
        "[recover] coordinator_bind to this node's address on the network they share (or 0.0.0.0 for every interface)"
    )


def run_secret(env: dict[str, str], only_this_node: bool) -> str:
    """The run's secret: the user's ``$TITAN_RECOVER_SECRET``, or a fresh one when this launcher
    starts the coordinator and every replica group, so no other launcher needs to know it."""
    if env.get(store.SECRET_ENV):
        return env[store.SECRET_ENV]
    if only_this_node:
        return secrets.token_hex(16)
    raise config.ConfigError(
        f"a multi-node run needs one secret on every node: set {store.SECRET_ENV} to the same value for each "
        f"node's launcher, e.g. export {store.SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(16))')"
    )


class Span(NamedTuple):
    """Which part of its replica groups this node runs, when they span ``parts`` nodes."""

    part: int = 0
    parts: int = 1
    host: str = store.LOOPBACK  # this node's address, where part 0 has the others meet
    timeout_s: float = 600.0  # how long a group's torchrun waits for all its parts to meet

    @property
    def suffix(self) -> str:
        return f" (part {self.part} of {self.parts})" if self.parts > 1 else ""

    def of(self, replica: int) -> str:
        return f"replica group {replica}{self.suffix}"


class ReplicaGroups:
    """This node's replica groups (or its part of each, ``Span``): one torchrun job each,
    restarted when it fails while this launcher still holds its claim (``claims``).

    Part 0 of a group that spans nodes restarts it (its budget, its incarnation numbers) and
    publishes where each incarnation meets; the launchers of the other parts follow it: when
    their part exits they report it and wait for part 0's next incarnation.
    """

    def __init__(
        self,
        argv: list[str],
        envs: dict[int, dict[str, str]],
        shards: int,
        max_restarts: int,
        restart_window_s: float,
        launcher: claims.Launcher,
        agent: NodeAgent,
        span: Span = Span(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.argv, self.envs, self.shards, self.launcher, self.clock = argv, envs, shards, launcher, clock
        self.agent, self.span = agent, span
        self.meetings: dict[int, Rendezvous] = {}  # groups that span nodes: where the current incarnation meets
        self.waiting: dict[int, int] = {}  # parts > 0: group -> the lowest incarnation of part 0's it may join
        self.fences_read = (-2, 0.0)  # the epoch at the last look for fenced incarnations, and when
        self.attempts: dict[int, int] = {}  # the incarnation each group runs, numbered by the store (claims.incarnation)
        self.budgets = {r: RestartBudget(max_restarts, restart_window_s) for r in envs}
        self.procs: dict[int, subprocess.Popen] = {}
        self.given_up: set[int] = set()
        self.killed: dict[int, int] = {}
        self.outcome: int | None = None  # the run's exit status (1: fatal) once the coordinator ended it

    def start(self, replica: int, attempt: int, meet: tuple[str, int] | None = None) -> None:
        """Starts that incarnation; a group that spans nodes meets at ``meet`` (part 0 picks a port)."""
        span = self.span
        if span.parts > 1:
            host, port = meet or (span.host, store.free_port())
            self.meetings[replica] = Rendezvous(host, port, span.part, span.parts, span.timeout_s)
        self.attempts[replica] = attempt
        self.waiting.pop(replica, None)
        self.procs[replica] = self._start(replica)

    def _start(self, replica: int) -> subprocess.Popen:
        attempt = self.attempts[replica]
        env = {**self.envs[replica], store.REPLICA_ENV: str(replica), store.ATTEMPT_ENV: str(attempt),
               node_channel.CHANNEL_ENV: self.agent.open(replica, attempt)}
        return subprocess.Popen(torchrun(self.shards, self.argv, f"replica{replica}", self.meetings.get(replica)),
                                env=env, preexec_fn=die_with_parent)

    def publish(self, client: object, replica: int) -> None:
        """Part 0 says where the current incarnation of a group that spans nodes meets."""
        if self.span.parts > 1 and self.span.part == 0:
            meet = self.meetings[replica]
            store.put_json(client, store.rendezvous_key(replica),  # type: ignore[arg-type]
                           {"attempt": self.attempts[replica], "host": meet.host, "port": meet.port})

    def follow(self, client: object, replica: int, taken_over: bool) -> None:
        """Parts > 0: wait for an incarnation of part 0's to join. A launcher that took this part
        over skips the incarnation its dead predecessor started (its ranks died with it) and
        reports it, so the group restarts now rather than when the coordinator finds it silent."""
        floor = 0
        key = store.joined_key(replica, self.span.part)
        if taken_over and client.check([key]):  # type: ignore[attr-defined]
            floor = store.get_int(client, key) + 1  # type: ignore[arg-type]
            epoch = store.get_int(client, store.EPOCH)  # type: ignore[arg-type]
            cause = f"{self.span.of(replica)} lost with its launcher (attempt {floor - 1})"
            store.report(client, {"replica": replica, "epoch": epoch, "suspect": replica, "attempt": floor - 1,  # type: ignore[arg-type]
                                  "cause": cause})
        self.waiting[replica] = floor

    def _join(self, client: object, replica: int) -> None:
        """Starts this part of part 0's latest incarnation of ``replica``, if it may join it."""
        rec = store.read_rendezvous(client, replica)  # type: ignore[arg-type]
        if rec is None or rec["attempt"] < self.waiting[replica]:
            return
        fenced = store.fenced_key(replica)
        if client.check([fenced]) and store.get_json(client, fenced, ("attempt",))["attempt"] >= rec["attempt"]:  # type: ignore[attr-defined,arg-type]
            return  # out already: part 0 publishes the next one
        client.set(store.joined_key(replica, self.span.part), str(rec["attempt"]))  # type: ignore[attr-defined]
        log(f"{self.span.of(replica)}: joining incarnation {rec['attempt']} at {rec['host']}:{rec['port']}")
        self.start(replica, rec["attempt"], (rec["host"], rec["port"]))

    def kill(self) -> None:
        """SIGKILLs every group's torchrun agent; its ranks die with it (``die_with_parent``)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()

    def watch(self, client: object) -> bool:
        """One look: kill fenced leftovers, report and restart failed groups; False once the run is ending."""
        flags = self.agent.flags  # pushed with the epoch
        if flags:
            self.outcome = 1 if flags & node_channel.FATAL else 0
            return False  # restart nothing
        now = self.clock()
        for rec in self.agent.take_hangs():  # a rank of a local group stopped beating: fenced now
            store.report(client, rec)  # type: ignore[arg-type]
        look = (self.agent.epoch, now) if self.agent.epoch != self.fences_read[0] or now - self.fences_read[1] >= store.PROBE_S else None
        for r, proc in list(self.procs.items()):
            if look:  # a fence comes with a new epoch (a waiting spare's, within PROBE_S)
                kill_fenced(client, self.agent, r, self.killed)
            code = proc.poll()
            if code in (None, 0) or r in self.given_up or r in self.waiting:
                continue
            if not claims.holds(client, self.launcher, r, self.span.part):  # type: ignore[arg-type]
                log(f"{self.span.of(r)} exited with code {code}; another launcher took it over (this one looked dead): "
                    "leaving it to that one")
                self.given_up.add(r)
                continue
            # the group is certainly dead: say so first (faster than heartbeats), then restart it
            now = self.clock()
            restart = self.span.part > 0 or self.budgets[r].take(now)  # part 0 restarts a group that spans nodes
            epoch = max(self.agent.epoch, 0)
            cause = f"torchrun of replica {r}{self.span.suffix} exited with code {code}" + ("" if restart else " (no restarts left in the window)")
            store.report(client, {"replica": r, "epoch": epoch, "suspect": r, "attempt": self.attempts[r], "cause": cause})  # type: ignore[arg-type]
            if self.span.part > 0:
                log(f"{self.span.of(r)} exited with code {code}; waiting for part 0 to start its next incarnation")
                self.waiting[r] = self.attempts[r] + 1
                continue
            if not restart:
                log(
                    f"replica group {r} exited with code {code}; {self.budgets[r].refusal(now)}; not restarting it; "
                    "the run goes on with the other groups"
                )
                self.given_up.add(r)
                continue
            attempt = claims.incarnation(client, r)  # type: ignore[arg-type]
            log(f"{self.span.of(r)} exited with code {code}; {self.budgets[r].used(now)} (attempt {attempt})")
            self.start(r, attempt)
            self.publish(client, r)
        for r in list(self.waiting):
            self._join(client, r)
        if look:
            self.fences_read = look
        return True

    def done(self) -> bool:
        return not self.waiting and all(p.poll() is not None for p in self.procs.values()) and not any(
            p.returncode != 0 and r not in self.given_up for r, p in self.procs.items()
        )


def run_stock(job_config: object, argv: list[str]) -> int:
    """Checkpoint-and-restart: the whole world restarts, up to ``max_restarts`` times within
    ``restart_window_s``, and TorchTitan resumes from its latest DCP checkpoint (from step 0 when there is none)."""
    par = job_config.parallelism  # type: ignore[attr-defined]
    rc = job_config.recover  # type: ignore[attr-defined]
    budget = RestartBudget(rc.max_restarts, rc.restart_window_s)
    nproc = par.data_parallel_replicate_degree * config.group_ranks(par)
    log(f"[recover] enable = false: stock TorchTitan HSDP, {nproc} ranks in one torchrun world")
    attempt = 0
    while True:
        env = with_threads({**os.environ, store.ATTEMPT_ENV: str(attempt)}, nproc)
        code = subprocess.call(torchrun(nproc, argv, "hsdp"), env=env)
        now = time.monotonic()
        if code == 0:
            return code
        if not budget.take(now):
            log(f"torchrun exited with code {code}; {budget.refusal(now)}; not restarting the job")
            return code
        attempt += 1
        log(f"torchrun exited with code {code}; restarting the whole job ({budget.used(now)}, attempt {attempt})")


def run_recover(
    job_config: object, argv: list[str], local: list[int], coordinator_address: str | None, part: int = 0
) -> int:
    """The replica groups ``local`` of this node (their part ``part`` when they span nodes), and the
    coordinator unless ``coordinator_address`` names one."""
    rc = job_config.recover  # type: ignore[attr-defined]
    par = job_config.parallelism  # type: ignore[attr-defined]
    replicas = config.replica_ids(job_config)
    ranks = config.group_ranks(par) // rc.group_nodes  # of each group, on this node
    plan = device_plan(rc.replicate_backend, len(local), ranks)
    argv = [*argv, "--recover.replicate_backend", plan.backend]
    env = with_threads(dict(os.environ), len(local) * ranks)
    first = coordinator_address is None  # this launcher starts the run; other nodes' launchers join it
    only_this_node = first and sorted(local) == list(range(replicas)) and rc.group_nodes == 1
    env[store.SECRET_ENV] = run_secret(env, only_this_node)
    etcd = bool(rc.control_store)  # a coordinator candidate beside every launcher, one leads
    coordinator, address = None, coordinator_address
    candidate = [sys.executable, "-m", "titan_recover.coordinator", *argv]
    if etcd:
        address = env[store.COORDINATOR_ENV] = rc.control_store
        if first:
            store.begin_run(store.etcd(address, rc.startup_timeout_s), env[store.SECRET_ENV])
        coordinator = subprocess.Popen(candidate, env=env)
    elif address is None:
        host = store.local_host(coordinator_bind(rc.coordinator_bind, local, replicas, rc.group_nodes))
        address = env[store.COORDINATOR_ENV] = f"{host}:{rc.coordinator_port or store.free_port()}"
        coordinator = subprocess.Popen(candidate, env=env)
    span = Span(part, rc.group_nodes, node_address(address), rc.startup_timeout_s)
    spares = [r for r in local if config.is_spare(r, job_config)]
    log(
        f"coordinator at {address}; starting replica groups {local} of {replicas}"
        f"{f' ({spares} as hot spares)' if spares else ''}, "
        f"{config.group_ranks(par)} ranks each (dp_shard {par.data_parallel_shard_degree} x tp {par.tensor_parallel_degree} "
        f"x pp {par.pipeline_parallel_degree})"
        + (f"; each spans {span.parts} nodes: this node runs part {part}, {ranks} ranks of each, meeting at {span.host}"
           if span.parts > 1 else "")
    )
    gpus = "" if plan.visible[0] is None else f"; GPUs per group: {' | '.join(map(str, plan.visible))}"
    log(f"replicate dimension on {plan.backend} ({plan.reason}){gpus}")
    envs = {r: with_gpus(env, visible) for r, visible in zip(local, plan.visible)}
    me = claims.Launcher.this()
    agent = NodeAgent(address, env[store.SECRET_ENV], ranks, hang_timeout_s=rc.heartbeat_timeout_s)
    groups = ReplicaGroups(argv, envs, ranks, rc.max_restarts, rc.restart_window_s, me, agent, span)
    if first and part == 0:
        # started at once, as their first incarnation (the store is new): their ranks import and build
        # the model while the coordinator comes up; they are claimed as soon as it is up
        for r in local:
            groups.start(r, 0)
    lost_once = threading.Lock()

    def on_lost(reason: str) -> None:
        """The run cannot go on: stop everything this launcher started, say why and how to resume."""
        if not lost_once.acquire(blocking=False):
            return
        if coordinator is not None and coordinator.poll() in (0, 1):
            return  # it finished (done or fatal) and closed its store: not lost
        groups.kill()
        if coordinator is not None:
            if coordinator.poll() is None:
                coordinator.kill()  # frozen: it would never answer again
            elif coordinator.returncode < 0:
                reason = f"the coordinator at {address} (pid {coordinator.pid}) died of signal {-coordinator.returncode}"
        store.exit_lost("launcher", reason, config.resume_hint(job_config))

    def coordinator_gone() -> str | None:
        if etcd or coordinator is None or coordinator.poll() is None:  # a candidate's end is not the run's
            return None
        return f"the coordinator at {address} exited with code {coordinator.returncode} before it served the run"

    lifeline: store.Heartbeat | None = None
    try:
        try:  # it may still be starting, or die doing so
            client = store.connect(address, rc.startup_timeout_s, env[store.SECRET_ENV], gone=coordinator_gone)
        except store.CoordinatorGone as e:
            on_lost(str(e))
            return coordinator.returncode  # type: ignore[union-attr]  # 0 or 1: it ended on its own and said why
        client.set(me.key, agent.message())  # the node's message exists before anyone reads it
        client.set(store.node_key(int(client.add(store.NODES, 1))), me.id)  # the coordinator reads it from now on
        lifeline = store.Heartbeat(address, me.key, rc.heartbeat_interval_s, rc.coordinator_timeout_s, on_lost,
                                   agent.message, secret=env[store.SECRET_ENV], ended=lambda: bool(agent.flags))
        agent.start(on_error=log)
        taken = claims.claim(client, me, local, rc.heartbeat_timeout_s, log, part)
        for r in local:
            if part > 0:  # part 0 starts each incarnation; this part joins it
                groups.follow(client, r, r in taken)
                continue
            attempt = claims.incarnation(client, r)  # 0 for the groups started above
            if r not in groups.procs:  # >= 1 for a group that ran under a launcher now dead: it rejoins
                groups.start(r, attempt)
            groups.publish(client, r)
        while True:
            if etcd and coordinator.poll() is not None and not agent.flags:  # type: ignore[union-attr]
                log(f"coordinator candidate exited with code {coordinator.returncode} before the run ended; "  # type: ignore[union-attr]
                    "starting another (the leader's lease passes to a live candidate)")
                coordinator = subprocess.Popen(candidate, env=env)
            elif coordinator is not None and coordinator.poll() is not None:
                break
            if coordinator is None and groups.done():
                break
            try:
                if not groups.watch(client):
                    lifeline.stop()  # the run is ending and the store ends with it
                    if coordinator is not None:
                        coordinator.wait()
                    break
            except dist.DistError:
                lifeline.settle()  # a lost coordinator ends this process in on_lost
                if coordinator is not None:
                    coordinator.wait(timeout=10)  # it finished and took its store along
                elif not lifeline.ending:
                    raise
                break  # the run ended and the coordinator's store with it: expected, not lost
            time.sleep(0.05)
        lifeline.stop()
        if coordinator is not None and coordinator.returncode not in (0, 1):
            on_lost(f"the coordinator at {address} exited with code {coordinator.returncode}")
        procs = list(groups.procs.values())
        deadline = time.monotonic() + 30
        for r, proc in groups.procs.items():
            if proc.poll() is None and agent.never_admitted(r):
                log(f"replica group {r} was still starting or waiting to rejoin when the run ended: stopped")
                proc.kill()
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log(f"replica group {r} was still running 30s after the run ended (starting, rejoining or hung): stopped")
                proc.kill()
                proc.wait()
        if coordinator is not None:
            return coordinator.returncode
        # the run's status, as on the coordinator's node: a group still starting or rejoining at the end does not fail it
        return groups.outcome if groups.outcome is not None else max(p.returncode for p in procs)
    finally:
        if lifeline is not None:
            lifeline.stop()  # what follows stops the coordinator on purpose
        groups.kill()
        agent.close()
        if coordinator is not None and coordinator.poll() is None:
            coordinator.kill()


def main(argv: list[str]) -> int:
    cpu_shim.apply()  # before torchtitan binds its device type: the data check imports its models
    local: list[int] = []
    address: str | None = None
    part = 0
    try:
        job_config = config.load(argv)
        if job_config.recover.enable:  # the node's environment, checked before the data and any process
            local = parse_replicas(os.environ.get(REPLICAS_ENV), config.replica_ids(job_config))
            part = parse_group_node(os.environ.get(store.GROUP_NODE_ENV), job_config.recover.group_nodes)
            address = os.environ.get(store.COORDINATOR_ENV)
            if address is not None:
                check_coordinator(address, job_config.recover.control_store)
            if job_config.recover.control_store:  # reachable, and able to lose a member, before anything starts
                log(check_control_store(job_config.recover.control_store))
    except config.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from titan_recover.dataloader import check_data

    try:
        log(check_data(job_config))  # prepared (synthetic) and checked once, before any rank starts
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cpu_argv = cpu_shim.precision_args(argv, job_config)
    if cpu_argv != argv:
        log("no accelerator: parameters in float32 (bfloat16 is emulated on most CPUs, ~13x slower); "
            "--training.mixed_precision_param bfloat16 to override")
    argv = cpu_argv
    path = events_path(job_config.job.dump_folder)
    first = address is None  # this launcher starts the run and its coordinator; other nodes' launchers join it
    if first and os.path.exists(path):
        os.remove(path)  # a new run's log; a joining launcher (another node, or a replacement) only appends
    start = time.time()
    try:
        if job_config.recover.enable:
            code = run_recover(job_config, argv, local, address, part)
        else:
            code = run_stock(job_config, argv)
    except config.ConfigError as e:  # the host cannot run this layout: nothing was started
        print(f"error: {e}", file=sys.stderr)
        return 2
    except claims.ClaimRefused as e:  # another launcher runs these groups: what this one started is stopped
        print(f"error: {e}", file=sys.stderr)
        return 2
    tr = job_config.training
    if not first:
        log(f"the run's summary is printed by the launcher that started its coordinator ({address}); "
            f"this node's ranks logged their events to {path}")
    elif os.path.exists(path):
        print(format_summary(summarize_events(path), tr.global_batch_size * tr.seq_len), flush=True)
    log(f"{'finished' if code == 0 else 'FAILED'} in {time.time() - start:.1f}s; events: {path}")
    return code


if __name__ == "__main__":
    dumps_stacks()
    exit_code = main(sys.argv[1:])
    # Not sys.exit: the node agent's epoch thread may be blocked in a store wait or connect (C++, GIL
    # released). Returning from it during interpreter shutdown unwinds through a noexcept frame and aborts
    # the launcher (SIGABRT, "terminate called without an active exception") instead of exiting with its
    # code. main has stopped and reaped everything it started; nothing is left for finalizers to do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
