"""The launcher behind ``run_train.sh``: the coordinator and one torchrun job per replica group.

``[recover] enable = true``: a ``NodeLauncher`` per node runs its phases (start the coordinator or,
on etcd, a candidate; start the groups; register and claim them; watch, restart and fence them;
drain), restarting only a failed group, which rejoins from a live peer. torchrun's own
``--max_restarts`` is not used: with ``--standalone`` in torch 2.13 a restarted group read its
previous incarnation's gloo addresses and failed to connect. ``enable = false``: one torchrun world,
stock TorchTitan, restarted as a whole (checkpoint-and-restart) on the same budget. docs/design.md,
docs/multi-node.md and docs/trust-model.md say the rest.
"""

import contextlib
import dataclasses
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from titan_recover import config, titan
from titan_recover.control import claims, keys, transport
from titan_recover.control.addresses import LOOPBACK, NODES_SCHEME, local_host, node_host, route_address
from titan_recover.control.board import BoardMissing
from titan_recover.control.client import ControlClient
from titan_recover.control.keys import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_LEFT,
    EXIT_OK,
    EXIT_QUARANTINED,
    EXIT_STOPPED,
)
from titan_recover.control.lifeline import AliveClock, Heartbeat, one_line, store_errors
from titan_recover.control.protocol import Launcher, Replacing
from titan_recover.control.sealed import Run, given_secret
from titan_recover.data.tokens import DataError
from titan_recover.launch import members, preflight
from titan_recover.launch.stores import ControlStore, store_of
from titan_recover.launch.torchruns import Span, Torchruns, torchrun, torchrun_grace, with_threads
from titan_recover.node import devices, memory, warm
from titan_recover.node.agent import NodeAgent
from titan_recover.node.channel import remove_orphans, shm_dir
from titan_recover.node.procs import EXITING_S, cpu_ticks, exit_lost, on_notice, stop_within
from titan_recover.observability import logs
from titan_recover.observability.events import NODE_ENV, EventLog, event_files, events_path, rotate_events
from titan_recover.observability.summary import format_summary, last_leader_file, summarize_events
from titan_recover.policy.restarts import RestartBudget
from titan_recover.titan import cpu_shim

if TYPE_CHECKING:  # the etcd extra's client: imported where a run is on etcd
    from titan_recover.launch.keeper import Keeper


def parse_replicas(value: str | None, replicas: int, started: int | None = None) -> list[int]:
    """The replica groups this node launches, from ``$TITAN_RECOVER_REPLICAS`` (unset: the ``started``
    ones the run starts, spares included; ``replicas`` counts every id, those up to ``recover.max_replicas``
    included).

    Checked before anything starts: a bad id would end in a traceback, or in groups that never
    come (an id out of range, or one listed twice) while the coordinator waits for them.
    """
    if value is None:
        return list(range(replicas if started is None else started))
    fix = (
        f"set it to the comma-separated replica groups this node launches, ids 0..{replicas - 1} "
        "(parallelism.data_parallel_replicate_degree + recover.spares, or recover.max_replicas "
        f"= {replicas}), e.g. 0,1; or unset it to launch the run's own"
    )
    ids: list[int] = []
    for item in value.split(","):
        if not re.fullmatch(r"-?\d+", item.strip(), re.ASCII):
            what = "an empty entry" if not item.strip() else f"{item.strip()!r} is not a replica id"
            raise config.ConfigError(f"{keys.REPLICAS_ENV}={value!r}: {what}; {fix}")
        r = int(item)
        if not 0 <= r < replicas:
            raise config.ConfigError(f"{keys.REPLICAS_ENV}={value!r}: replica {r} is out of range; {fix}")
        if r in ids:
            raise config.ConfigError(f"{keys.REPLICAS_ENV}={value!r}: replica {r} is listed twice; {fix}")
        ids.append(r)
    return ids


def parse_any(value: str | None, replicas: int) -> int | None:
    """How many free replica ids this node asks for (``$TITAN_RECOVER_REPLICAS=any`` or ``any:N``), or None
    when it names its ids (``parse_replicas``)."""
    if value is None or not value.strip().startswith("any"):
        return None
    found = re.fullmatch(r"any(?::(\d+))?", value.strip(), re.ASCII)
    count = int(found.group(1) or 1) if found else 0
    if not 1 <= count <= replicas:
        raise config.ConfigError(
            f"{keys.REPLICAS_ENV}={value!r}: write any (one free replica id) or any:N, N from 1 to {replicas} "
            "(the run's replica ids)"
        )
    return count


def parse_group_node(value: str | None, parts: int) -> int:
    """This node's part of its replica groups, from ``$TITAN_RECOVER_GROUP_NODE`` (unset: 0),
    checked before anything starts."""
    if value is None:
        return 0
    fix = f"set it to 0..{parts - 1} (recover.group_nodes = {parts}: the part of its replica groups this node runs)"
    if not re.fullmatch(r"\d+", value.strip(), re.ASCII) or not int(value) < parts:
        raise config.ConfigError(f"{keys.GROUP_NODE_ENV}={value!r} is not a part of a replica group; {fix}")
    return int(value)


log = logging.getLogger(__name__)
START_PROBE_S = 0.5  # how often a starting coordinator's CPU time is read


def device_plan(rc: config.Recover, groups: int, ranks: int) -> devices.DevicePlan:
    """This host's device plan; a ``config.ConfigError`` if it cannot run the groups."""
    gpus = devices.host_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
    return devices.plan(rc.replicate_backend, gpus, groups, ranks, dist.is_nccl_available(), rc.nccl_rank_per_host)


def run_preflight(job_config: Any, backend: str, env: dict[str, str]) -> preflight.Preflight:
    """Logs every finding of the preflight and adds the environment it derives to ``env`` (its job
    flags are the caller's); a ``config.ConfigError`` naming each refused setting."""
    checked = preflight.on_this_node(job_config, backend, env)
    for finding in checked.findings:
        (log.warning if finding.level == preflight.WARN else log.info)(finding.line())
    if checked.refusals:
        overridable = any(f.rule != preflight.SNAPSHOT_DIR for f in checked.refusals)
        raise config.ConfigError(
            "the preflight refuses this run:\n  "
            + "\n  ".join(f.line() for f in checked.refusals)
            + (f"\n(set {preflight.OVERRIDE_ENV}=warn to run anyway)" if overridable else "")
        )
    env.update(checked.env)
    return checked


def coordinator_bind(configured: str, local: list[int], replicas: int, parts: int = 1) -> str:
    """Where the coordinator this launcher starts listens: loopback when every replica group
    runs on this node, else the address the user chose ([recover] coordinator_bind).

    A multi-node run must choose it: listening on every interface by default would open
    the store to any host that can route to this one.
    """
    if configured:
        return configured
    if sorted(local) == list(range(replicas)) and parts == 1:
        return LOOPBACK
    others = sorted(set(range(replicas)) - set(local))
    what = (
        f"replica groups {others} run"
        if others
        else f"the replica groups span {parts} nodes (recover.group_nodes), whose parts run"
    )
    raise config.ConfigError(
        f"{what} on other nodes, which cannot reach a coordinator on loopback: set "
        "[recover] coordinator_bind to this node's address on the network they share (or 0.0.0.0 for every interface)"
    )


def choose_secret(env: dict[str, str], only_this_node: bool) -> str:
    """The run's secret: the user's (``$TITAN_RECOVER_SECRET``, or the file ``$TITAN_RECOVER_SECRET_FILE``
    names), or a fresh one when this launcher starts the coordinator and every replica group, so no other
    launcher needs to know it."""
    try:
        given = given_secret(env)
    except ValueError as e:
        raise config.ConfigError(str(e)) from None
    if given:
        return given
    if only_this_node:
        return secrets.token_hex(16)
    raise config.ConfigError(
        f"a multi-node run needs one secret on every node: set {keys.SECRET_ENV} to the same value for each "
        f"node's launcher, e.g. export {keys.SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(16))')"
    )


LEADS_POLL_S = 0.5  # how often a launcher whose groups left reads whether its candidate still leads the run
STOP_SEEN_S = 5.0  # how long a launcher whose groups were the run's last members waits to see the stop pushed
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


def choose_run_id(env: dict[str, str], first: bool, store: ControlStore) -> str | None:
    """The run's id: the user's (or the scheduler's) ``$TITAN_RECOVER_RUN_ID``; else a fresh one
    when this launcher starts the coordinator's store, or None for a launcher that joins one (it
    asks the coordinator: ``transport.find_run``). On etcd the id is what tells a relaunched node
    (same id: it rejoins the run) from a new run (new id: it never reads the old run's keys)."""
    given = env.get(keys.RUN_ENV, "")
    if given:
        if not RUN_ID.fullmatch(given):
            raise config.ConfigError(
                f"{keys.RUN_ENV}={given!r} is not a run id: use 1-128 letters, digits and ._:@- "
                "(e.g. the scheduler's job id)"
            )
        return given
    return store.new_run_id(first)


def run_stock(job_config: Any, argv: list[str]) -> int:
    """Checkpoint-and-restart: the whole world restarts, up to ``max_restarts`` times within
    ``restart_window_s``, and TorchTitan resumes from its latest DCP checkpoint (from step 0 when there is none)."""
    par, rc = job_config.parallelism, job_config.recover
    budget = RestartBudget(rc.max_restarts, rc.restart_window_s)
    nproc = par.data_parallel_replicate_degree * config.group_ranks(par)
    log.info(f"[recover] enable = false: stock TorchTitan HSDP, {nproc} ranks in one torchrun world")
    incarnation = 0
    while True:
        env = with_threads({**os.environ, keys.INCARNATION_ENV: str(incarnation)}, nproc)
        code = subprocess.call(torchrun(nproc, argv, "hsdp"), env=env)
        now = time.monotonic()
        if code == 0:
            return code
        if not budget.take(now):
            log.info(f"torchrun exited with code {code}; {budget.refusal(now)}; not restarting the job")
            return code
        incarnation += 1
        log.info(
            f"torchrun exited with code {code}; restarting the whole job ({budget.used(now)}, attempt {incarnation})"
        )


class NodeLauncher:
    """One node's launcher of a run with ``[recover] enable = true``, in named phases:
    ``start_coordinator`` (or a candidate, on etcd), ``start_groups``, ``register``, ``loop``, ``drain``.

    ``first``: this launcher starts the run and its coordinator; other nodes' launchers join it.
    """

    def __init__(
        self, job_config: Any, argv: list[str], local: list[int] | int, address: str | None, part: int
    ) -> None:
        """``local``: this node's replica ids, or how many free ones it asks for (chosen in ``start_coordinator``)."""
        rc, par = job_config.recover, job_config.parallelism
        self.wanted = local if isinstance(local, int) else 0
        self.job_config, self.rc, self.part = job_config, rc, part
        self.local: list[int] = [] if isinstance(local, int) else local
        self.first = address is None
        if self.wanted and (self.first or rc.group_nodes > 1):
            raise config.ConfigError(
                f"{keys.REPLICAS_ENV}=any is for a node that joins a running run (set {keys.COORDINATOR_ENV}), "
                "its groups on this node alone (recover.group_nodes = 1): name the ids otherwise"
            )
        self.store = store_of(rc)
        self.drain_budget_s = rc.notice_budget_s  # a drain signals no torchrun: its budget is never cut
        self.grace = torchrun_grace(torch.__version__, rc.notice_budget_s)
        if self.grace.cut:  # a SIGTERM notice's budget, as this launcher and the coordinator's settings read it
            log.warning(self.grace.cut)
            rc.notice_budget_s = self.grace.budget_s
        self.replicas = config.replica_ids(job_config)
        self.ranks = config.group_ranks(par) // rc.group_nodes  # of each group, on this node
        # the run is this launcher's alone: it starts the coordinator and every replica group, whole
        self.only_this_node = self.first and sorted(self.local) == list(range(self.replicas)) and rc.group_nodes == 1
        self.plan = device_plan(rc, self.wanted or len(self.local), self.ranks)
        if self.plan.rank_per_host and not self.only_this_node:
            raise config.ConfigError(
                f"recover.nccl_rank_per_host is for a run on one node, and this launcher runs "
                f"replica groups {local} of 0..{self.replicas - 1}: unset it"
            )
        self.env = with_threads(dict(os.environ), (self.wanted or len(self.local)) * self.ranks)
        checked = run_preflight(job_config, self.plan.backend, self.env)
        self.argv = with_flags(argv, {"--recover.replicate_backend": self.plan.backend, **checked.flags})
        self.env[keys.SECRET_ENV] = choose_secret(self.env, self.only_this_node)
        run_id = choose_run_id(self.env, self.first, self.store)
        self.run = None if run_id is None else self.name_run(run_id)
        self.address = address
        self.coordinator: subprocess.Popen | None = None
        self.lifeline: Heartbeat | None = None
        self.lost_once = threading.Lock()
        self.me = Launcher.this(config.failure_domain(rc, os.environ))  # its claims tell the coordinator where
        self.noticed: float | None = None  # when SIGTERM told this node it goes away (wall clock)
        self.snapshots: str | None = None  # this launcher's snapshot folder (node.memory), once made

    def notice(self) -> None:
        """SIGTERM's handler: this node goes away. It only notes the time; the loop acts on it."""
        if self.noticed is None:
            self.noticed = time.time()

    # ---- phases -------------------------------------------------------------------------

    def name_run(self, run_id: str) -> Run:
        self.env[keys.RUN_ENV] = run_id
        self.run = Run(self.env[keys.SECRET_ENV], run_id)
        return self.run

    def start_coordinator(self) -> None:
        """Names the run and starts the coordinator (first launcher) or a candidate (beside every
        launcher on etcd), as the control store decides."""
        self.store.start(self)
        if self.wanted:
            self.local = self.claim_free()

    def claim_free(self) -> list[int]:
        """The free replica ids this node asked for, claimed before its groups start (``claims.claim_free``)."""
        run, rc = self.run, self.rc
        assert run is not None, "the run is named first"
        client = ControlClient(transport.connect(str(self.address), rc.startup_timeout_s, run))
        members = client.membership(client.epoch()).members
        try:
            free = claims.claim_free(
                client,
                self.me,
                self.wanted,
                range(self.replicas),
                members,
                rc.heartbeat_timeout_s,
                log.info,
                self.message_of(client),
                rc.coordinator_timeout_s,
            )
        except claims.ClaimRefused:
            answer_replacement(client, [])
            raise
        answer_replacement(client, free)
        log.info(f"{keys.REPLICAS_ENV}=any: replica ids {free} are free (members {list(members)}); this node runs them")
        return free

    def message_of(self, client: ControlClient) -> Callable[[Launcher], bytes | None]:
        """How a claimant reads another launcher's node message: from the store, or on etcd the leader's board,
        None while no leader serves one (a launcher started again at once on the lost leader's node reads
        before the next leader is elected; ``claims.silent`` waits for it)."""
        assert self.run is not None
        reader = self.store.board(self.run)
        if reader is None:
            return client.node_message_raw

        def read(owner: Launcher) -> bytes | None:
            try:
                return reader.read(client.store, owner.key)
            except (BoardMissing, dist.DistError, OSError):
                return None

        return read

    def start_coordinator_here(self) -> None:
        """The run's coordinator, on a port bound here and handed over: no other process can take a
        picked port meanwhile."""
        rc = self.rc
        bind = coordinator_bind(rc.coordinator_bind, self.local, self.replicas, rc.group_nodes)
        try:  # where GLOO_SOCKET_IFNAME names the interface, the groups do not listen on the ranks' route
            host = local_host(bind) if self.only_this_node or self.env.get("GLOO_SOCKET_IFNAME") else node_host(bind)
        except ValueError as e:
            raise config.ConfigError(
                f"recover.coordinator_bind = {bind}: {e}; set it to this node's address on the network the nodes share"
            ) from None
        try:
            fd = transport.listen(bind, rc.coordinator_port)
        except RuntimeError as e:
            raise config.ConfigError(f"recover.coordinator_port = {rc.coordinator_port}: {e}") from None
        try:
            self.address = self.env[keys.COORDINATOR_ENV] = f"{host}:{transport.listening_port(fd)}"
            self.coordinator = subprocess.Popen(
                self._candidate(), env={**self.env, keys.LISTEN_FD_ENV: str(fd)}, pass_fds=(fd,)
            )
        finally:
            os.close(fd)
        threading.Thread(
            target=self._watch_start, args=(self.coordinator,), name="titan-recover-start-watch", daemon=True
        ).start()

    def _watch_start(self, coordinator: subprocess.Popen) -> None:
        """Until the lifeline sees the coordinator's first beat (its watch bounds the silence from then on), the
        coordinator's process must use CPU within ``coordinator_timeout_s``: its imports, its store's start and
        its reading of the dump folder all do, on a loaded host too. One whose count stands still that long is
        frozen or blocked while starting, and the run is lost, as it would be once serving; without this, every
        process waited out ``startup_timeout_s`` (connecting to its store, then the lifeline's first bound)."""
        clock = AliveClock(self.rc.coordinator_timeout_s, time.monotonic())
        while coordinator.poll() is None and not (self.lifeline is not None and self.lifeline.seen_alive):
            now = time.monotonic()
            clock.tick(now, START_PROBE_S)  # this launcher paused: not the coordinator's silence
            ticks = cpu_ticks(coordinator.pid)
            if ticks is None:  # no /proc here: startup_timeout_s bounds it
                return
            clock.read(ticks, now)
            if clock.silent(now) >= clock.timeout_s:
                self.on_lost(
                    f"the coordinator (pid {coordinator.pid}) used no CPU for {clock.timeout_s:g}s while starting, "
                    "before it served (stopped, or blocked)"
                )
                return
            time.sleep(START_PROBE_S)

    def start_candidate(self) -> None:
        """A coordinator candidate beside this launcher (on etcd): it leads once it holds the lease."""
        self.coordinator = subprocess.Popen(self._candidate(), env=self.env)

    def _candidate(self) -> list[str]:
        """The coordinator's command line: the job's settings as a record, so it imports no TorchTitan."""
        settings = config.CoordinatorSettings.of(self.job_config, titan.dump_folder(self.job_config))
        settings = dataclasses.replace(
            settings, recover=dataclasses.replace(settings.recover, replicate_backend=self.plan.backend)
        )
        return [sys.executable, "-m", "titan_recover.coordinator", "--settings", settings.to_json()]

    def start_groups(self) -> "Torchruns":
        """This node's replica groups; the first launcher's start at once as their first incarnation
        (the store is new): their ranks import and build the model while the coordinator comes up."""
        rc, par, address = self.rc, self.job_config.parallelism, str(self.address)
        span = Span(self.part, rc.group_nodes, route_address(address), rc.startup_timeout_s)
        spares = [r for r in self.local if config.is_spare(r, self.job_config)]
        log.info(
            f"coordinator at {address}; starting replica groups {self.local} of {self.replicas}"
            f"{f' ({spares} as hot spares)' if spares else ''}, "
            f"{config.group_ranks(par)} ranks each (dp_shard "
            f"{par.data_parallel_shard_degree} x tp {par.tensor_parallel_degree} "
            f"x pp {par.pipeline_parallel_degree})"
            + (
                f"; each spans {span.parts} nodes: this node runs part "
                f"{self.part}, {self.ranks} ranks of each, meeting at {span.host}"
                if span.parts > 1
                else ""
            )
        )
        gpus = "" if self.plan.visible[0] is None else f"; GPUs per group: {' | '.join(map(str, self.plan.visible))}"
        log.info(f"replicate dimension on {self.plan.backend} ({self.plan.reason}){gpus}")
        assert self.run is not None, "start_coordinator() first"
        orphans = remove_orphans()
        if orphans:
            log.info(f"removed {len(orphans)} channel file(s) of launchers that are gone from {shm_dir()}")
        snapshots = self.snapshot_env(self.run)
        envs = {
            r: {**self.env, **devices.group_env(visible, self.plan.rank_per_host), **self.notice_env(), **snapshots}
            for r, visible in zip(self.local, self.plan.visible)
        }
        self.agent = NodeAgent(
            address, self.run, self.ranks, hang_timeout_s=rc.heartbeat_timeout_s, snapshots=self.snapshots or ""
        )
        self.events = EventLog(titan.dump_folder(self.job_config))
        self.groups = Torchruns(
            self.argv,
            envs,
            self.ranks,
            rc.max_restarts,
            rc.restart_window_s,
            self.me,
            self.agent,
            span,
            on_start=self._started,
            warm=self.keeps_warm(span),
            on_warm=lambda replica, seconds: self.events.emit("warm_ready", replica=replica, seconds=seconds),
            notice_budget_s=self.drain_budget_s,
            grace=self.grace.flags,
        )
        if self.first and self.part == 0:
            for r in self.local:
                self.groups.start(r, 0)
        return self.groups

    def stops_run(self) -> bool:
        """Whether a notice to this node stops the whole run in order: it runs the coordinator, and on a
        TCPStore the run's store goes with it."""
        return self.coordinator is not None and self.store.notice_stops_run

    def snapshot_env(self, run: Run) -> dict[str, str]:
        """The ranks' snapshot settings, the same for every incarnation: this launcher's folder, made here when
        ``recover.snapshot_interval`` is on ("" when off), and how many ranks on this node share it. Folders of
        launchers that are gone are removed first: a SIGKILLed one leaves its folder in memory."""
        rc = self.rc
        under = memory.root(rc.snapshot_dir)
        for name, size in memory.sweep_orphans(under):
            log.info(f"removed the snapshot folder {name} of a launcher that is gone from {under}: {size:,} bytes")
        if rc.snapshot_interval:
            try:
                self.snapshots = memory.make_folder(under, run.public_id)
            except OSError as e:
                raise config.ConfigError(
                    f"recover.snapshot_dir: cannot make this launcher's snapshot folder under {under} ({e}); name "
                    "a writable tmpfs folder, or set recover.snapshot_interval = 0 for no snapshots"
                ) from None
            log.info(
                f"snapshots: every {rc.snapshot_interval} committed steps, {rc.snapshot_keep} kept per shard, "
                f"in {self.snapshots}"
            )
        ranks = len(self.local) * self.ranks
        return {keys.SNAPSHOT_DIR_ENV: self.snapshots or "", keys.NODE_RANKS_ENV: str(ranks)}

    def free_snapshots(self) -> None:
        """Removes this launcher's snapshot folder, once, and says how much memory that gave back."""
        folder, self.snapshots = self.snapshots, None
        if folder is None:
            return
        freed = memory.free_folder(folder)
        left = (
            "; a rank still writing left files there, which the next launcher here removes"
            if os.path.lexists(folder)
            else ""
        )
        log.info(f"removed this launcher's snapshot folder {folder}: {freed:,} bytes freed{left}")

    def notice_env(self) -> dict[str, str]:
        """The ranks' environment for a notice: where it stops the run, a rank's own SIGTERM (Slurm's, to every
        process) is left to the coordinator, which stops every group at one step boundary."""
        return {keys.NOTICE_STOPS_RUN_ENV: "1"} if self.stops_run() else {}

    def keeps_warm(self, span: Span) -> bool:
        """Whether this node's groups get warm incarnations (``[recover] warm``, where they fit); the log says which."""
        ranks = len(self.local) * self.ranks
        why = warm.off_because(
            self.rc.warm, span.parts > 1, warm.host_available_bytes(), os.cpu_count() or 1, ranks, ranks
        )
        if why:
            log.info(f"warm incarnations: off ({why}); a failed group restarts cold, importing from nothing")
            return False
        log.info(
            "warm incarnations: on; once a group trains, its next incarnation starts and waits imported "
            f"(up to {warm.RANK_BYTES / 2**30:.1f} GiB host memory per rank, no accelerator memory), so a restart "
            "skips the imports (recover.warm = off: none)"
        )
        return True

    def _started(self, replica: int, incarnation: int, warm: bool) -> None:
        """The event log says where and when each incarnation started, and whether warm (the status page's restarts)."""
        self.events.emit(
            "group_started", replica=replica, attempt=incarnation, host=self.me.host, part=self.part, warm=warm
        )

    def register(self) -> ControlClient | None:
        """Connects (the coordinator may still be starting, or die doing so), names this node, starts
        its lifeline and epoch push, and claims its groups; None when the coordinator ended first."""
        rc, run = self.rc, self.run
        if run is None:
            raise RuntimeError("register() before the run is named: start_coordinator() and start_groups() first")
        try:
            client = ControlClient(
                transport.connect(str(self.address), rc.startup_timeout_s, run, gone=self._coordinator_gone)
            )
        except transport.CoordinatorGone as e:
            self.on_lost(str(e))
            return None
        board = self.store.board(run)
        if board is None:
            client.register(self.me, self.agent.message())
        else:
            client.name_node(self.me)  # its lifeline writes its message on the board
        self.lifeline = Heartbeat(
            str(self.address),
            self.me.key,
            config.node_message_interval_s(rc),
            rc.coordinator_timeout_s,
            self.on_lost,
            lambda: self.agent.message().dumps(),
            run=run,
            startup_timeout_s=rc.startup_timeout_s,
            ended=lambda: bool(self.agent.flags),
            board=board,
        )
        self.agent.start(on_error=log.warning)
        message_of = self.message_of(client)  # its own board reader: the lifeline's is used by the lifeline's thread
        try:
            taken = claims.claim(
                client,
                self.me,
                self.local,
                rc.heartbeat_timeout_s,
                log.info,
                self.part,
                message_of,
                rc.coordinator_timeout_s,
            )
        except store_errors(str(self.address)) as e:  # its store closed meanwhile: the run ended, or was lost
            self.on_lost(f"its store failed while this launcher claimed replica ids {self.local} ({one_line(e)})")
            return None
        for r in self.local:
            self.groups.begin(client, r, r in taken)
        return client

    def loop(self, client: ControlClient) -> None:
        """Watches the groups (restarts, fences, hang reports) until the run ends. A coordinator that
        exits before the run ended is lost (``on_lost``), or, on etcd, a candidate that did is started again.

        A failed store call is retried while the lifeline finds the coordinator alive (a lost
        one ends this process in ``on_lost``); failing for ``coordinator_timeout_s`` in a row
        counts as lost too: this launcher cannot take part in the run."""
        lifeline = self.lifeline
        assert lifeline is not None, "register() first"
        errors = store_errors(str(self.address))
        failing_since: float | None = None
        while True:
            coordinator = self.coordinator
            if coordinator is not None and coordinator.poll() is not None:
                if self._run_ended():
                    return
                if self.store.lost_by(coordinator):
                    self.on_lost(self._exit_reason(coordinator))
                    return
                if self.noticed is None:
                    log.info(
                        f"{self.store.coordinator} exited with code {coordinator.returncode} before the run ended; "
                        "starting another (the leader's lease passes to a live candidate)"
                    )
                    self.start_candidate()
                else:
                    self.coordinator = None  # this node goes away: another node's candidate leads
            if self.coordinator is None and self.groups.done() and not self.groups.leave_by:
                return
            if self.noticed is not None:
                self.act_on_notice(self.noticed)
            try:
                running = self.groups.watch(client)
            except errors as e:
                if lifeline.ending:
                    return  # the run ended and the coordinator's store with it: expected, not lost
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                    log.warning(
                        f"a call to the control store failed ({one_line(e)}); retrying while the "
                        "coordinator's lifeline finds it alive"
                    )
                elif now - failing_since >= self.rc.coordinator_timeout_s:
                    self.on_lost(
                        f"this launcher's calls to the control store at {self.address} failed for "
                        f"{now - failing_since:.0f}s ({one_line(e)})"
                    )
                    return
                lifeline.settle()  # a lost coordinator ends this process in on_lost
                continue
            failing_since = None
            if not running:
                return
            time.sleep(0.05)

    def act_on_notice(self, noticed: float) -> None:
        """This node goes away (SIGTERM at ``noticed``): where it runs the TCPStore's coordinator, the coordinator
        stops the whole run in order (every group at one step boundary, its state saved first);
        else its groups leave at their step boundary, and its coordinator candidate, told too, gives up the lead."""
        coordinator = self.coordinator
        if self.stops_run():
            if not self.groups.stopping:
                log.info(
                    "this node goes away (SIGTERM) and runs the run's coordinator: the run stops in order at a "
                    "step boundary"
                )
                self.groups.stopping = True
                self.groups.stop_standbys()
                assert coordinator is not None
                coordinator.send_signal(signal.SIGTERM)
            return
        if set(self.groups.procs) - set(self.groups.leave_by):
            budget = self.rc.notice_budget_s - (time.time() - noticed)
            log.info(f"this node goes away (SIGTERM): its replica groups {self.local} leave the run")
            self.groups.leave(noticed, budget, list(self.groups.procs), "its node goes away")
            if coordinator is not None and coordinator.poll() is None:
                coordinator.send_signal(signal.SIGTERM)  # a candidate: it gives up the lead, if it has it

    def drain(self, client: ControlClient | None = None) -> int:
        """Stops what is left once the run ended; the run's exit code as this node sees it (``client``: the
        launcher's, to read whether its groups' leave stopped the run)."""
        if self.lifeline is not None:
            self.lifeline.stop()  # the run is ending and the store ends with it
        self.groups.stop_standbys()
        if self.groups.outcome is None and self.groups.gone():
            left = f"this node left the run on notice: replica groups {self.groups.left} at a step boundary" + (
                f", {sorted(self.groups.given_up)} failed at once" if self.groups.given_up else ""
            )
            led = self.lead_to_the_end()
            ended = self.coordinator is not None and self.coordinator.returncode == EXIT_STOPPED
            if (led and ended) or self.stopped_by_leaving(client):
                how = f"its {self.store.coordinator} led the run's stop in order" if led else "the run stopped in order"
                log.info(f"{left}; {how}")
                return EXIT_STOPPED
            log.info(f"{left}; the run goes on without them")
            return EXIT_LEFT
        coordinator = self.coordinator
        if coordinator is not None:
            bound = self.rc.coordinator_timeout_s
            if not stop_within(coordinator, bound):
                log.warning(
                    f"the {self.store.coordinator} (pid {coordinator.pid}) was still running "
                    f"{bound:g}s after the run ended: stopped"
                )
            if not self._run_ended():
                self.on_lost(self._exit_reason(coordinator))
        procs = list(self.groups.procs.values())
        deadline = time.monotonic() + 30
        for r, proc in self.groups.procs.items():
            if proc.poll() is None and self.agent.never_admitted(r):
                log.info(f"replica group {r} was still starting or waiting to rejoin when the run ended: stopped")
                proc.kill()
            if not stop_within(proc, max(0.1, deadline - time.monotonic())):
                log.info(
                    f"replica group {r} was still running 30s after the "
                    "run ended (starting, rejoining or hung): stopped"
                )
        # the run's outcome, as the coordinator ended it
        if coordinator is not None and coordinator.returncode in (EXIT_OK, EXIT_FAILED, EXIT_STOPPED):
            return int(coordinator.returncode)
        if procs and self.groups.quarantined >= set(self.groups.procs):
            log.warning(
                f"every replica group of this node ({sorted(self.groups.quarantined)}) is quarantined: SDC checks "
                "found wrong gradients here, and the run goes on without this node; check or replace its devices "
                "before it runs again"
            )
            return EXIT_QUARANTINED
        # the run's status, as on the coordinator's node: a group still starting or rejoining at the end does not fail
        # it
        return self.groups.outcome if self.groups.outcome is not None else max(p.returncode for p in procs)

    def lead_to_the_end(self) -> bool:
        """This node's groups left on notice. Where its candidate leads the run even so (every live candidate's
        node goes away: ``control.presence``), the run is stopping with no candidate to take over: the launcher
        waits while the candidate leads, until it ends with the run, at most until the notice's budget is spent
        (``close`` stops it then). Whether it led (its exit code, once it ended, says how the run ended; one
        still lingering after the end has none yet)."""
        coordinator, run = self.coordinator, self.run
        if self.noticed is None or coordinator is None or run is None:
            return False
        deadline = self.noticed + self.rc.notice_budget_s
        led = False
        while coordinator.poll() is None and time.time() < deadline:
            try:
                if not self.store.leads(run, coordinator, self.rc.coordinator_timeout_s):
                    break
            except Exception as e:  # etcd unreachable: the candidate cannot lead either
                log.warning(f"cannot read who leads the run ({one_line(e)}): the {self.store.coordinator} stops")
                break
            if not led:
                led = True
                log.info(
                    f"this node's {self.store.coordinator} leads the run, every live candidate's node going away: "
                    f"it leads on until the run ends (at most {deadline - time.time():.1f}s more)"
                )
            with contextlib.suppress(subprocess.TimeoutExpired):
                coordinator.wait(timeout=LEADS_POLL_S)
        if not led:
            return False
        with contextlib.suppress(subprocess.TimeoutExpired):  # it gives the lease back as it ends, then exits
            coordinator.wait(timeout=min(EXITING_S, max(1.0, deadline - time.time())))
        return True

    def stopped_by_leaving(self, client: ControlClient | None) -> bool:
        """Whether the run stopped in order as this node's groups left: the stop recorded already (a candidate
        here that led it may still be lingering), or this node's groups were the run's last members. Their exit can
        come before the epoch push that says so: the stop is waited for, at most ``STOP_SEEN_S``, only where no
        member is left elsewhere (a node leaving a run that goes on exits at once)."""
        if client is None:
            return False
        deadline = time.monotonic() + STOP_SEEN_S
        try:
            if client.stopped_in_order():
                return True
            if not set(client.membership(client.epoch()).members) <= set(self.groups.left):
                return False
            while not self.agent.flags and time.monotonic() < deadline:
                time.sleep(LEADS_POLL_S / 5)
            return client.stopped_in_order()
        except Exception as e:  # the store gone with the run: nothing says it stopped in order
            log.warning(f"cannot read whether the run stopped in order ({one_line(e)}): this node says it left")
            return False

    def close(self) -> None:
        """Frees everything this launcher started, whatever happened."""
        if self.lifeline is not None:
            self.lifeline.stop()  # what follows stops the coordinator on purpose
        if hasattr(self, "groups"):
            self.groups.kill()
            self.agent.close()
            self.events.close()
        if self.coordinator is not None:
            stop_within(self.coordinator, 0.0)
        self.free_snapshots()

    # ---- the coordinator lost ---------------------------------------------------------------

    def on_lost(self, reason: str) -> None:
        """The run cannot go on: stop everything this launcher started, say why and how to resume."""
        if not self.lost_once.acquire(blocking=False):
            return
        coordinator = self.coordinator
        # one whose port closed is exiting, and its exit code says more; a frozen one would never answer again
        exiting = coordinator is not None and self.store.exiting(str(self.address))
        exited = coordinator is not None and stop_within(coordinator, EXITING_S if exiting else 0.0)
        if self._run_ended():
            return  # the coordinator ended the run (done or fatal) and closed its store: not lost
        self.groups.kill()
        self.free_snapshots()  # exit_lost ends the process at once: close() never runs
        if exited and coordinator is not None and self.store.lost_by(coordinator):  # a candidate's end is not the run's
            reason = self._exit_reason(coordinator)
        exit_lost("launcher", reason, config.resume_hint(self.job_config, titan.dump_folder(self.job_config)))

    def _exit_reason(self, coordinator: subprocess.Popen) -> str:
        code = coordinator.returncode
        how = (
            f"died of signal {-code}"
            if code < 0
            else f"exited with code {code} before the run ended (its output above says why)"
        )
        return f"the coordinator at {self.address} (pid {coordinator.pid}) {how}"

    def _run_ended(self) -> bool:
        """Whether the coordinator ended the run: done or fatal as the epoch push read them, or, on the
        TCPStore, a coordinator that exited 0 (only done does that). On etcd a candidate's exit code
        says nothing about the run, and exit 1 may be a traceback: neither counts."""
        coordinator = self.coordinator
        return bool(self.agent.flags) or self.store.ended_by(coordinator)

    def _coordinator_gone(self) -> str | None:
        coordinator = self.coordinator
        if coordinator is None or not self.store.lost_by(coordinator):  # a candidate's end is not the run's
            return None
        return self._exit_reason(coordinator)


def with_flags(argv: list[str], flags: dict[str, str]) -> list[str]:
    """``argv`` with ``flags`` (the replicate backend the launcher resolved, a derived timeout) in place of
    the same flags there. In front: TorchTitan 0.3's parser scopes every flag after a subcommand
    (``activation-checkpoint:full``) to it."""
    names = {flag.replace("-", "_") for flag in flags}
    rest, skip = [], False
    for arg in argv:
        name = arg.split("=", 1)[0].replace("-", "_")
        if skip or name in names:
            skip = not skip and "=" not in arg  # the next token is its value
            continue
        rest.append(arg)
    return [*(token for flag, value in flags.items() for token in (flag, value)), *rest]


def run_recover(
    job_config: Any, argv: list[str], local: list[int] | int, coordinator_address: str | None, part: int = 0
) -> int:
    """The replica groups ``local`` of this node, or how many free ones it asks for (their part ``part`` when
    they span nodes), and the coordinator unless ``coordinator_address`` names one."""
    launcher = NodeLauncher(job_config, argv, local, coordinator_address, part)
    try:
        on_notice(launcher.notice)  # this node goes away: it leaves the run, or stops it where the run's store is
        try:
            launcher.start_coordinator()
        except transport.CoordinatorGone as e:  # the run's, on another node: nothing started here yet
            exit_lost("launcher", str(e), config.resume_hint(job_config, titan.dump_folder(job_config)))
        launcher.start_groups()
        client = launcher.register()
        if client is None:  # the coordinator ended on its own (0 or 1) and said why
            return int(launcher.coordinator.returncode) if launcher.coordinator is not None else 1
        launcher.loop(client)
        return launcher.drain(client)
    finally:
        launcher.close()


def answer_replacement(client: ControlClient, replicas: list[int]) -> None:
    """On a node the run asked its scheduler for ($TITAN_RECOVER_REPLACEMENT: the request's number): tells the
    coordinator which free ids it took, none when there were none to take (it leaves at once)."""
    request = os.environ.get(keys.REPLACEMENT_ENV, "")
    if request.isdigit():
        job = os.environ.get("SLURM_JOB_ID", "")
        client.put(keys.replacement_key(int(request)), Replacing(tuple(replicas), job))


@dataclasses.dataclass(frozen=True)
class NodeJob:
    """The job and this node's part of it, as its command line and environment say."""

    job_config: Any
    local: list[int] | int  # the replica ids this node launches, or how many free ones it asks for (any:N)
    part: int  # its part of each of its replica groups
    address: str | None  # the coordinator it joins (None: it starts the run)


def node_job(argv: list[str], environ: Mapping[str, str]) -> NodeJob:
    """The job config from ``argv`` and this node's part of it from ``environ``, checked as the launcher checks
    them before anything starts (``config.ConfigError`` naming the problem); the control store's own check,
    which may reach the network, is the caller's. The manual's commands are checked with it too."""
    job_config = titan.load_config(argv)
    titan.check_model(job_config)
    if not job_config.recover.enable:
        return NodeJob(job_config, [], 0, None)
    wanted = parse_any(environ.get(keys.REPLICAS_ENV), config.replica_ids(job_config))
    local = wanted or parse_replicas(
        environ.get(keys.REPLICAS_ENV), config.replica_ids(job_config), config.started_ids(job_config)
    )
    part = parse_group_node(environ.get(keys.GROUP_NODE_ENV), job_config.recover.group_nodes)
    return NodeJob(job_config, local, part, environ.get(keys.COORDINATOR_ENV))


def volunteer(rc: config.Recover, run_id: str, dump: str) -> "Keeper | None":
    """On a node that joins a run on etcd (``JOIN_RUN``) formed on the run's own nodes: its keeper, started, which
    volunteers for a lost member's place (``keeper.joining``); None on an etcd the user runs."""
    from titan_recover.launch.keeper import joining  # the etcd extra's client: a run on etcd has it

    keeper = joining(rc.control_store, run_id, dump, rc.member_replace_after_s)
    if keeper is not None:
        spec = keeper.spec
        os.environ[keys.ETCD_ENDPOINTS_ENV] = members.endpoints_file(run_id, spec)  # for every process here
        log.info(f"the run formed its etcd on its nodes ({spec.nodes_url}): this node volunteers for a lost member")
        keeper.start()
    return keeper


def main(argv: list[str]) -> int:
    logs.setup("launcher")  # the process's entry point (python -m titan_recover.launch)
    supported = preflight.torch_finding(torch.__version__, os.path.dirname(torch.__file__), os.environ)
    if supported.level == preflight.REFUSE:  # before TorchTitan's import, which may fail on it less clearly
        print(f"error: {supported.text}", file=sys.stderr)
        return EXIT_BAD_INPUT
    (log.warning if supported.level == preflight.WARN else log.info)(supported.line())
    member = None  # this node's etcd member, where the run forms its control store on its nodes
    keeper: "Keeper | None" = None  # ... and this node's part in replacing a lost one
    try:
        node = node_job(argv, os.environ)
        nodes_url = node.job_config.recover.control_store
        if node.job_config.recover.enable and nodes_url.startswith(NODES_SCHEME):  # every process dials etcd://
            dump = titan.dump_folder(node.job_config)
            etcd_url, member = members.form(nodes_url, os.environ, dump, node.job_config.recover.startup_timeout_s)
            if os.environ.get(keys.COORDINATOR_ENV) == nodes_url:
                os.environ[keys.COORDINATOR_ENV] = etcd_url
            argv = with_flags(argv, {"--recover.control_store": etcd_url})
            node = node_job(argv, os.environ)
            from titan_recover.launch.keeper import Keeper  # the etcd extra's client: here only

            spec, run_id = members.Members.of(nodes_url), os.environ[keys.RUN_ENV]
            os.environ[keys.ETCD_ENDPOINTS_ENV] = members.endpoints_file(run_id, spec)  # for every process here
            keeper = Keeper(etcd_url, spec, run_id, dump, member, node.job_config.recover.member_replace_after_s)
            keeper.start()
        job_config, local, part, address = node.job_config, node.local, node.part, node.address
        store = store_of(job_config.recover)
        if job_config.recover.enable:  # the node's environment, checked before the data and any process
            said = store.check(job_config.recover, address)
            if said:
                log.info(said)
            if keeper is None and job_config.recover.control_store and os.environ.get(keys.RUN_ENV):
                keeper = volunteer(job_config.recover, os.environ[keys.RUN_ENV], titan.dump_folder(job_config))
    except config.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from titan_recover.data.addressing import check_data

    try:
        log.info(check_data(job_config))  # prepared (synthetic) and checked once, before any rank starts
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    cpu_argv = cpu_shim.precision_args(argv, job_config, titan.config_file(job_config))
    if cpu_argv != argv:
        log.info(
            "no accelerator: parameters in float32 (bfloat16 is emulated on most CPUs, ~13x slower); "
            "--training.mixed_precision_param bfloat16 to override"
        )
    argv = cpu_argv
    path = events_path(titan.dump_folder(job_config))
    first = address is None  # this launcher starts the run and its coordinator; other nodes' launchers join it
    if store.begins_new_run(first):  # the run before's logs (a requeued or resumed job's too) are kept aside
        moved = rotate_events(titan.dump_folder(job_config))
        if moved:
            log.info(f"the event logs of the run before this one in {titan.dump_folder(job_config)} are in {moved}")
    start = time.time()
    try:
        if job_config.recover.enable:
            code = run_recover(job_config, argv, local, address, part)
        else:
            code = run_stock(job_config, argv)
    except config.ConfigError as e:  # the host cannot run this layout: nothing was started
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except claims.ClaimRefused as e:  # another launcher runs these groups: what this one started is stopped
        request = os.environ.get(keys.REPLACEMENT_ENV)
        if request:  # the run asked for this node, and its groups came back meanwhile: nothing to do, exit 0
            log.info(
                f"replacement request {request}: no free replica id to take (the groups it was for are back in the "
                "run): this node leaves, exit 0"
            )
            return EXIT_OK
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    tr = job_config.training
    files = event_files(titan.dump_folder(job_config))
    led_last = last_leader_file(files) if os.environ.get(NODE_ENV) else None  # each node logs to its own file
    if path != led_last and (led_last is not None or not first):
        by = (
            f"whose coordinator candidate led last ({led_last})"
            if led_last
            else f"that started its coordinator ({address})"
        )
        log.info(f"the run's summary is printed by the launcher {by}; this node's ranks logged their events to {path}")
    elif files:
        try:  # the summary is a report: a log it cannot make sense of never costs the run its exit code
            summary = summarize_events(*files, last_step=tr.steps if code == 0 else None)
        except (OSError, KeyError, TypeError) as e:
            log.warning(f"no summary: the event logs {files} could not be read ({e!r})")
        else:
            print(format_summary(summary, tr.global_batch_size * tr.seq_len), flush=True)
    outcome = {
        EXIT_OK: "finished",
        EXIT_LEFT: "left the run on notice",
        EXIT_QUARANTINED: "quarantined: the run goes on without this node",
        EXIT_STOPPED: "stopped in order at a step boundary, its nodes going away. "
        + config.stop_hint(job_config, titan.dump_folder(job_config)),
    }.get(code, "FAILED")
    log.info(f"{outcome} in {time.time() - start:.1f}s; events: {path}")
    if keeper is not None:  # the member this node runs now (it may have started one, or lost its own)
        keeper.stop()
        member = keeper.member
        with contextlib.suppress(OSError):
            os.remove(os.environ[keys.ETCD_ENDPOINTS_ENV])
    if member is not None:  # the leader's final writes need the members' quorum
        members.linger(member, keys.leader_key(Run.from_env(os.environ).prefix))
        if code == EXIT_OK:
            members.retire(member)
    return code
