"""A node's replica groups: one torchrun job each, restarted when it fails, killed when fenced.

``Torchruns`` is the launcher's view of the groups (or of its node part of each, ``Span``)
it runs: it starts each incarnation under torchrun, reports and restarts a failed one within
its restart budget while this launcher holds the claim, kills the ranks of a fenced one, and,
for a group that spans nodes, publishes (node part 0) or follows (other parts) where each
incarnation's torchrun agents meet.
"""

import logging
import math
import os
import signal
import subprocess
import sys
import time
from typing import Callable, NamedTuple

from titan_recover.control import claims, keys, transport
from titan_recover.control.addresses import LOOPBACK
from titan_recover.control.client import ControlClient
from titan_recover.control.keys import EXIT_FAILED, EXIT_OK, EXIT_STOPPED
from titan_recover.control.lifeline import PROBE_S
from titan_recover.control.protocol import Fence, Launcher, Rendezvous, Report
from titan_recover.launch import preflight
from titan_recover.launch.standbys import Standbys
from titan_recover.node.agent import NodeAgent
from titan_recover.node.channel import CHANNEL_ENV, FATAL
from titan_recover.node.procs import die_with_parent
from titan_recover.node.warm import WARM_ENV
from titan_recover.policy.restarts import RestartBudget
from titan_recover.policy.roster import GiveUp, on_exit

DRAIN_PROBE_S = 2.0  # how often a launcher looks for the operator's drains of its groups (one read per node)
TORCHRUN_GRACE_S = 30  # torchrun SIGKILLs its ranks this long after its own SIGTERM, unless told otherwise
SHUTDOWN_TIMEOUT_SINCE = (2, 12)  # the first torch whose torchrun takes --shutdown-timeout (pytorch PR 172596)
SHUTDOWN_MARGIN_S = 10
"""torchrun's SIGKILL must come after titan_recover's own verdict on a notice. Both clocks start at one SIGTERM
(Slurm signals the node's processes together); once the budget is spent the launcher kills a group still in
its step at its next look and reports it failed, and on the coordinator's node the coordinator declares the
stop failed; then the ranks exit. 10 s leaves room for all of that, so torchrun's kill is only a backstop; a
longer torchrun grace costs nothing, since the scheduler's own SIGKILL (KillWait) ends every process anyway."""
log = logging.getLogger(__name__)


class Grace(NamedTuple):
    """A notice's budget as the run uses it, and what torchrun is told of it."""

    budget_s: float  # recover.notice_budget_s for a SIGTERM notice, cut where torchrun would kill the ranks first
    flags: tuple[str, ...]  # torchrun's, before its module
    cut: str | None  # why budget_s is below the config's (the launcher logs it at start); None: it is not


def torchrun_grace(torch_version: str, budget_s: float) -> Grace:
    """Where torchrun itself gets the notice's SIGTERM (Slurm and systemd signal every process of the node),
    it SIGKILLs its ranks ``TORCHRUN_GRACE_S`` later whatever ``recover.notice_budget_s`` says. From torch 2.12
    its ``--shutdown-timeout`` is set to the budget plus ``SHUTDOWN_MARGIN_S``; before (or for a version it
    cannot read), a SIGTERM notice's budget is cut to ``TORCHRUN_GRACE_S - SHUTDOWN_MARGIN_S``, whichever
    scheduler sends it (the launcher cannot tell which notices reach torchrun too); a drain signals no torchrun,
    and keeps the config's."""
    found = preflight.release(torch_version)
    if found is not None and found >= SHUTDOWN_TIMEOUT_SINCE:
        return Grace(budget_s, ("--shutdown-timeout", str(math.ceil(budget_s) + SHUTDOWN_MARGIN_S)), None)
    cap = TORCHRUN_GRACE_S - SHUTDOWN_MARGIN_S
    if budget_s <= cap:
        return Grace(budget_s, (), None)
    return Grace(
        cap,
        (),
        f"recover.notice_budget_s = {budget_s:g}s is cut to {cap}s for a SIGTERM notice (a drain keeps "
        f"{budget_s:g}s): torch {torch_version}'s torchrun SIGKILLs its "
        f"ranks {TORCHRUN_GRACE_S}s after its own SIGTERM (Slurm and systemd signal every process of the node), and "
        f"only torch >= {'.'.join(map(str, SHUTDOWN_TIMEOUT_SINCE))} lets the launcher lengthen that "
        f"(--shutdown-timeout); {SHUTDOWN_MARGIN_S}s are kept for the launcher's own verdict. Install torch >= "
        f"{'.'.join(map(str, SHUTDOWN_TIMEOUT_SINCE))} for a longer budget",
    )


class Meeting(NamedTuple):
    """Where the torchrun agents of one incarnation of a group that spans nodes meet: a static
    rendezvous on part 0's host, at a port its launcher picked for that incarnation alone."""

    host: str
    port: int
    part: int
    parts: int
    timeout_s: float

    def args(self) -> list[str]:
        return [
            "--nnodes",
            str(self.parts),
            "--node-rank",
            str(self.part),
            "--master-addr",
            self.host,
            "--master-port",
            str(self.port),
            "--rdzv-conf",
            f"timeout={int(self.timeout_s)}",
        ]


def torchrun(
    nproc: int, argv: list[str], role: str, meeting: Meeting | None = None, grace: tuple[str, ...] = ()
) -> list[str]:
    """The command of one torchrun job; ``grace``: its shutdown flags (``torchrun_grace``)."""
    where = ["--standalone", "--nnodes", "1"] if meeting is None else meeting.args()
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *where,
        f"--nproc_per_node={nproc}",
        "--max_restarts",
        "0",
        "--role",
        role,
        "--tee",
        "3",
        "--local-ranks-filter",
        "0",
        *grace,
        "-m",
        "titan_recover.train",
        *argv,
    ]


def with_threads(env: dict[str, str], local_ranks: int) -> dict[str, str]:
    """Splits this host's cores among its ranks (unless ``OMP_NUM_THREADS`` is set).

    torchrun sets one thread per rank only when it starts several; a replica group of
    one rank would otherwise take every core, and R such groups on one host oversubscribe
    it, which made CPU steps 10-20x slower while OpenMP threads spun against each other.
    """
    if "OMP_NUM_THREADS" in env:
        return env
    return {**env, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // local_ranks))}


def is_incarnation(pid: int, replica: int, mark: str) -> bool:
    """Whether ``pid`` is a rank of the incarnation of ``replica`` whose start environment holds
    ``mark`` (``Torchruns.marks``), not a reused pid."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = set(f.read().split(b"\0"))
    except OSError:  # gone already
        return False
    return {f"{keys.REPLICA_ENV}={replica}".encode(), mark.encode()} <= env


def kill_fenced(fence: Fence | None, agent: NodeAgent, replica: int, mark: str, handled: dict[int, int]) -> bool:
    """SIGKILLs the ranks of the incarnation of ``replica`` that ``fence`` fenced that run on
    this node (their pids are in its channel; ``mark`` is the current incarnation's, see ``is_incarnation``).

    A fenced group may be hung (SIGSTOP, a wedged collective) rather than dead;
    torchrun only restarts a group once one of its processes exits. Whether the fence was new.
    """
    if fence is None:
        return False
    incarnation = fence.attempt
    if handled.get(replica, -1) >= incarnation:
        return False
    handled[replica] = incarnation
    for local_rank, pid in agent.pids(replica, incarnation).items():
        if not is_incarnation(pid, replica, mark):
            continue  # the pid now belongs to someone else
        try:
            os.kill(pid, signal.SIGKILL)
            log.info(f"killed local rank {local_rank} of fenced replica {replica} (attempt {incarnation}, pid {pid})")
        except ProcessLookupError:
            pass  # already gone
    return True


class Span(NamedTuple):
    """Which part of its replica groups this node runs, when they span ``parts`` nodes."""

    part: int = 0
    parts: int = 1
    host: str = LOOPBACK  # this node's address, where part 0 has the others meet
    timeout_s: float = 600.0  # how long a group's torchrun waits for all its parts to meet

    @property
    def suffix(self) -> str:
        return f" (part {self.part} of {self.parts})" if self.parts > 1 else ""

    def of(self, replica: int) -> str:
        return f"replica group {replica}{self.suffix}"


class LeaderPart:
    """Node part 0 of its groups (every group of a single-node run): it numbers and starts each
    incarnation, restarts a failed one within its budget, and says where one that spans nodes meets."""

    def begin(self, groups: "Torchruns", client: ControlClient, replica: int, taken_over: bool) -> None:
        incarnation = client.next_incarnation(replica)  # 0 for a group started before the store was up
        if replica not in groups.procs:  # >= 1 for a group that ran under a launcher now dead: it rejoins
            groups.start(replica, incarnation)
        self.publish(groups, client, replica)

    def publish(self, groups: "Torchruns", client: ControlClient, replica: int) -> None:
        if groups.span.parts > 1:
            meet = groups.meetings[replica]
            client.publish_rendezvous(replica, Rendezvous(groups.incarnations[replica], meet.host, meet.port))

    def exited(self, groups: "Torchruns", client: ControlClient, replica: int, code: int) -> None:
        now = groups.clock()
        budget = groups.budgets[replica]
        state = client.read_state()
        if state is not None and replica in state.quarantined:
            groups.report_exit(client, replica, code, " (quarantined)", final=True)
            log.info(
                f"replica group {replica} exited with code {code}; it is quarantined (SDC checks outvoted it, or a "
                f"group on its node, twice, at step {state.quarantined[replica]}): not restarting it; the run goes on "
                "with the other groups"
            )
            groups.given_up.add(replica)
            groups.quarantined.add(replica)
            return
        decision = on_exit(budget, now)
        if isinstance(decision, GiveUp):
            groups.report_exit(client, replica, code, " (no restarts left in the window)", final=True)
            log.info(
                f"replica group {replica} exited with code {code}; {decision.why}; not restarting it; "
                "the run goes on with the other groups"
            )
            groups.given_up.add(replica)
            return
        budget.record(now)
        groups.report_exit(client, replica, code, "")
        incarnation = client.next_incarnation(replica)
        log.info(f"{groups.span.of(replica)} exited with code {code}; {budget.used(now)} (attempt {incarnation})")
        groups.start(replica, incarnation)
        self.publish(groups, client, replica)

    def poll(self, groups: "Torchruns", client: ControlClient) -> None:
        """Nothing to wait for: this part starts each incarnation itself."""


class FollowerPart:
    """Node parts > 0 of groups that span nodes: they join the incarnations node part 0 starts,
    and when their part exits they report it and wait for part 0's next one."""

    def begin(self, groups: "Torchruns", client: ControlClient, replica: int, taken_over: bool) -> None:
        """Waits for an incarnation of part 0's to join. A launcher that took this part over skips
        the incarnation its dead predecessor started (its ranks died with it) and reports it, so
        the group restarts now rather than when the coordinator finds it silent."""
        floor = 0
        joined = client.joined(replica, groups.span.part) if taken_over else None
        if joined is not None:
            floor = joined + 1
            cause = f"{groups.span.of(replica)} lost with its launcher (attempt {joined})"
            client.report(Report(epoch=client.epoch(), cause=cause, replica=replica, suspect=replica, attempt=joined))
        groups.waiting[replica] = floor

    def exited(self, groups: "Torchruns", client: ControlClient, replica: int, code: int) -> None:
        groups.report_exit(client, replica, code, "")
        log.info(f"{groups.span.of(replica)} exited with code {code}; waiting for part 0 to start its next incarnation")
        groups.waiting[replica] = groups.incarnations[replica] + 1

    def poll(self, groups: "Torchruns", client: ControlClient) -> None:
        """Starts this part of part 0's latest incarnation of each waiting group, if it may join it."""
        for replica in list(groups.waiting):
            meet = client.read_rendezvous(replica)
            if meet is None or meet.attempt < groups.waiting[replica]:
                continue
            fence = client.read_fence(replica)
            if fence is not None and fence.attempt >= meet.attempt:
                continue  # out already: part 0 publishes the next one
            client.set_joined(replica, groups.span.part, meet.attempt)
            log.info(f"{groups.span.of(replica)}: joining incarnation {meet.attempt} at {meet.host}:{meet.port}")
            groups.start(replica, meet.attempt, (meet.host, meet.port))


class Torchruns:
    """This node's replica groups (or its node part of each, ``Span``): one torchrun job each,
    restarted when it fails while this launcher still holds its claim (``claims``). What a
    node part does about starts and exits is its strategy's: ``LeaderPart`` or ``FollowerPart``.

    With ``warm``, each group that trains gets a warm incarnation (``standbys.Standbys``), and a
    restart activates it instead of starting a torchrun from nothing.
    """

    def __init__(
        self,
        argv: list[str],
        envs: dict[int, dict[str, str]],
        local_ranks: int,
        max_restarts: int,
        restart_window_s: float,
        launcher: Launcher,
        agent: NodeAgent,
        span: Span = Span(),
        clock: Callable[[], float] = time.monotonic,
        on_start: Callable[[int, int, bool], None] = lambda replica, incarnation, warm: None,
        warm: bool = False,
        on_warm: Callable[[int, float], object] = lambda replica, seconds: None,
        notice_budget_s: float = 12.0,
        grace: tuple[str, ...] = (),
    ) -> None:
        """``grace``: torchrun's shutdown flags (``torchrun_grace``)."""
        self.argv, self.envs, self.local_ranks, self.launcher, self.clock = argv, envs, local_ranks, launcher, clock
        self.on_start = on_start  # (replica, incarnation, warm): an incarnation started here (the event log says so)
        self.notice_budget_s = notice_budget_s  # how long a drained group may take to leave
        self.grace = grace
        # the torchrun of a group spanning nodes starts with its other parts: no warm one
        self.standbys = (
            Standbys(
                lambda r: torchrun(local_ranks, argv, f"replica{r}", grace=grace),
                envs,
                local_ranks,
                agent,
                clock,
                on_warm,
            )
            if warm and span.parts == 1
            else None
        )
        self.marks: dict[int, str] = {}  # group -> the start environment entry its current incarnation's ranks have
        self.agent, self.span = agent, span
        self.part = FollowerPart() if span.part > 0 else LeaderPart()
        self.meetings: dict[int, Meeting] = {}  # groups that span nodes: where the current incarnation meets
        self.waiting: dict[int, int] = {}  # parts > 0: group -> the lowest incarnation of part 0's it may join
        self.fences_read = (-2, 0.0)  # the epoch at the last look for fenced incarnations, and when
        self.incarnations: dict[
            int, int
        ] = {}  # the incarnation each group runs, numbered by the store (ControlClient.next_incarnation)
        self.budgets = {r: RestartBudget(max_restarts, restart_window_s) for r in envs}
        self.procs: dict[int, subprocess.Popen] = {}
        self.given_up: set[int] = set()
        self.quarantined: set[int] = set()  # given up for good: SDC checks quarantined them (or their node)
        self.killed: dict[int, int] = {}
        self.outcome: int | None = None  # the run's exit status (1: fatal) once the coordinator ended it
        self.leave_by: dict[int, float] = {}  # groups told to leave (their node goes away, or drained) -> by when
        self.left: list[int] = []  # groups that left at a step boundary
        self.stopping = False  # the run stops in order (this node runs its coordinator and goes away): no restarts
        self.drains_read = -DRAIN_PROBE_S  # when this launcher last looked for the operator's drains

    def start(self, replica: int, incarnation: int, meet: tuple[str, int] | None = None) -> None:
        """Starts that incarnation; a group that spans nodes meets at ``meet`` (part 0 picks a port)."""
        span = self.span
        if span.parts > 1:
            host, port = meet or (span.host, transport.free_port())
            self.meetings[replica] = Meeting(host, port, span.part, span.parts, span.timeout_s)
        standby = None
        if self.standbys is not None and replica in self.incarnations:
            failed = self.agent.pids(replica, self.incarnations[replica]).values()
            standby = self.standbys.take(
                replica, [p for p in failed if is_incarnation(p, replica, self.marks[replica])]
            )
        self.incarnations[replica] = incarnation
        self.waiting.pop(replica, None)
        if standby is None:
            self.procs[replica], self.marks[replica] = self._start(replica), f"{keys.INCARNATION_ENV}={incarnation}"
        else:
            self.procs[replica] = standby.activate(incarnation, self.agent.open(replica, incarnation))
            self.marks[replica] = f"{WARM_ENV}={standby.path}"
        self.on_start(replica, incarnation, standby is not None)

    def _start(self, replica: int) -> subprocess.Popen:
        incarnation = self.incarnations[replica]
        env = {
            **self.envs[replica],
            keys.REPLICA_ENV: str(replica),
            keys.INCARNATION_ENV: str(incarnation),
            CHANNEL_ENV: self.agent.open(replica, incarnation),
        }
        return subprocess.Popen(
            torchrun(self.local_ranks, self.argv, f"replica{replica}", self.meetings.get(replica), self.grace),
            env=env,
            preexec_fn=die_with_parent,
        )

    def begin(self, client: ControlClient, replica: int, taken_over: bool) -> None:
        """Once this launcher holds its claims: starts, or waits to join, the group's current incarnation."""
        self.part.begin(self, client, replica, taken_over)

    def report_exit(self, client: ControlClient, replica: int, code: int, note: str, final: bool = False) -> None:
        """The group is certainly dead: say so first (faster than heartbeats); ``final``: it is not restarted."""
        self.report_gone(
            client, replica, f"torchrun of replica {replica}{self.span.suffix} exited with code {code}{note}", final
        )

    def report_gone(self, client: ControlClient, replica: int, cause: str, final: bool = False) -> None:
        client.report(
            Report(
                epoch=max(self.agent.epoch, 0),
                cause=cause,
                replica=replica,
                suspect=replica,
                attempt=self.incarnations[replica],
                final=final,
            )
        )

    def stop_standbys(self) -> None:
        """Kills the warm incarnations (the run ended: nothing will restart)."""
        if self.standbys is not None:
            self.standbys.stop()

    def kill(self) -> None:
        """SIGKILLs every group's torchrun agent (warm ones too); its ranks die with it (``die_with_parent``)."""
        self.stop_standbys()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()

    def leave(self, noticed: float, budget_s: float, replicas: list[int], why: str) -> None:
        """These groups were told at ``noticed`` (wall clock) to leave within ``budget_s`` (``why``: their node
        goes away, or the operator drained them): each leaves at its next step boundary (its ranks read LEAVE
        in their channel), is not restarted, and its warm incarnation stops."""
        new = [r for r in replicas if r in self.procs and r not in self.leave_by]
        for r in new:
            self.leave_by[r] = self.clock() + budget_s
            if self.standbys is not None:
                self.standbys.drop(r)
            log.info(
                f"{self.span.of(r)} leaves at its next step boundary ({why}), within recover.notice_budget_s "
                f"= {budget_s:g}s"
            )
        self.agent.leave(noticed, new)

    def _leaving(self, client: ControlClient, r: int, proc: subprocess.Popen, now: float) -> None:
        """One look at a group told to leave: once its ranks all finished, it left; one that exited otherwise,
        or is still in its step when the budget is spent (killed then), is failed at once, so the others
        recover in-step without waiting for a detection."""
        if r in self.left or r in self.given_up:
            return
        code = proc.poll()
        if code is not None and self.agent.finished(r):
            self.left.append(r)
            log.info(f"{self.span.of(r)} left at a step boundary (its torchrun exited with code {code})")
        elif code is not None or now >= self.leave_by[r] or self.agent.never_admitted(r):
            if code is None:
                proc.kill()
                proc.wait()
            self.given_up.add(r)
            cause = (
                f"replica {r}{self.span.suffix} did not leave at a step boundary within "
                f"recover.notice_budget_s of its notice (torchrun exit code {proc.returncode})"
            )
            log.info(f"{cause}: reported failed at once")
            if not self.agent.never_admitted(r):
                self.report_gone(client, r, cause)

    def gone(self) -> bool:
        """Every group here left (or failed on its way out): this launcher has nothing left to run."""
        return bool(self.leave_by) and all(r in self.left or r in self.given_up for r in self.procs)

    def watch(self, client: ControlClient) -> bool:
        """One look: kill fenced leftovers, report and restart failed groups, have drained ones leave; False
        once the run is ending, or once every group here left."""
        flags = self.agent.flags  # pushed with the epoch
        if flags:
            self.outcome = EXIT_FAILED if flags & FATAL else EXIT_STOPPED if client.stopped_in_order() else EXIT_OK
            return False  # restart nothing
        now = self.clock()
        for report in self.agent.take_hangs():  # a rank of a local group stopped beating: fenced now
            client.report(report)
        look = (
            (self.agent.epoch, now)
            if self.agent.epoch != self.fences_read[0] or now - self.fences_read[1] >= PROBE_S
            else None
        )
        # a fence comes with a new epoch (a waiting spare's, within PROBE_S); a drain within DRAIN_PROBE_S
        fences = client.read_fences(list(self.procs)) if look else {}
        drains = {}
        if look and now - self.drains_read >= DRAIN_PROBE_S:
            drains, self.drains_read = client.read_drains(list(self.procs)), now
        for r, drain in drains.items():
            if drain is not None and drain.attempt == self.incarnations.get(r):
                self.leave(drain.time, self.notice_budget_s, [r], f"drained by the operator: {drain.reason}")
        for r, proc in list(self.procs.items()):
            if r in self.leave_by:  # it exits by itself: its fence (the coordinator's, after its leave) kills nothing
                self._leaving(client, r, proc, now)
                continue
            fence = fences.get(r)
            if look and kill_fenced(fence, self.agent, r, self.marks[r], self.killed):
                if (
                    fence is not None
                    and fence.attempt == self.incarnations[r]
                    and self.standbys
                    and self.standbys.has(r)
                ):
                    proc.kill()  # its torchrun need not wind down: the warm incarnation takes over at once
            code = proc.poll()
            if code in (None, 0) or r in self.given_up or r in self.waiting or self.stopping:
                continue  # stopping: torchrun's agent may exit of the node's SIGTERM after its ranks stopped
            if not claims.holds(client, self.launcher, r, self.span.part):
                log.info(
                    f"{self.span.of(r)} exited with code {code}; another launcher took it over (this one looked dead): "
                    "leaving it to that one"
                )
                self.given_up.add(r)
                continue
            self.part.exited(self, client, r, code)
        self.part.poll(self, client)
        if self.standbys is not None:
            self.standbys.keep(self.procs, self.given_up | set(self.leave_by))
        if look:
            self.fences_read = look
        return not self.gone()

    def done(self) -> bool:
        return (
            not self.waiting
            and all(p.poll() is not None for p in self.procs.values())
            and not any(
                p.returncode != 0 and r not in self.given_up and r not in self.left for r, p in self.procs.items()
            )
        )
