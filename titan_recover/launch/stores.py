"""The two control stores a run can use, and what each decides for a node's launcher.

- ``TcpStore`` (the default): the coordinator's own TCPStore. The first launcher binds the port, starts
  the one coordinator on it and names the run; the other launchers find the run at its address. The
  coordinator's end is the run's: exit 0 is done (the run said so), any other exit is the run lost.
- ``Etcd`` (``[recover] control_store = "etcd://..."``): every launcher runs a coordinator candidate
  beside it and one, holding the lease, leads; the leader serves the node messages on a board. The run's
  id is the user's, the same on every node, so the first node begins the run or, when it already runs
  (a replaced pod, the same command again), joins it. A candidate's exit says nothing about the run: it
  is started again.

``NodeLauncher`` asks its control store (``store_of``) at each of these points instead of branching on
which one it is; ``check`` runs before anything starts.
"""

import json
import logging
import secrets
import socket
import subprocess
import time
from typing import Any, Protocol

from titan_recover import config, titan
from titan_recover.control import keys, transport
from titan_recover.control.addresses import parse_host_port, resolve
from titan_recover.control.board import Board
from titan_recover.control.client import ControlClient
from titan_recover.control.keys import EXIT_OK, EXIT_STOPPED
from titan_recover.control.sealed import Run
from titan_recover.observability.events import rotate_events

RESTART_POLL_S = 0.5  # how often a node of a run that stopped in order looks whether its first node restarted it
log = logging.getLogger(__name__)


class NodeLauncher(Protocol):
    """The node launcher's side of a control store's start (``launch.launcher.NodeLauncher``)."""

    address: str | None
    env: dict[str, str]
    first: bool
    run: Run | None
    rc: config.Recover
    job_config: Any

    def name_run(self, run_id: str) -> Run: ...

    def start_coordinator_here(self) -> None: ...

    def start_candidate(self) -> None: ...


class ControlStore(Protocol):
    """What the control store decides for a node's launcher: ``TcpStore`` or ``Etcd``."""

    coordinator: str  # what this launcher's coordinator process is called in its lines
    notice_stops_run: bool  # a notice to the node running the coordinator stops the whole run in order

    def check(self, rc: config.Recover, address: str | None) -> str | None:
        """This node's settings for the store, before anything starts: a ``ConfigError`` naming the
        problem; what to log, if anything."""
        ...

    def new_run_id(self, first: bool) -> str | None:
        """The run's id when the user set none: a fresh one, None to ask the coordinator, or a
        ``ConfigError``."""
        ...

    def begins_new_run(self, first: bool) -> bool:
        """Whether this launcher knows, before anything starts, that it begins a new run (whose event
        log starts empty); otherwise it learns so only from the store, if at all."""
        ...

    def start(self, launcher: NodeLauncher) -> None:
        """Names the run and starts this launcher's coordinator process, if it runs one."""
        ...

    def board(self, run: Run) -> Board | None:
        """Where this launcher's node messages go, when not to the coordinator itself."""
        ...

    def ended_by(self, coordinator: subprocess.Popen | None) -> bool:
        """Whether the coordinator process's exit says the run ended (done)."""
        ...

    def lost_by(self, coordinator: subprocess.Popen | None) -> bool:
        """Whether the coordinator process's exit is the run lost (not the run's end, nor a candidate's)."""
        ...

    def exiting(self, address: str) -> bool:
        """Whether the coordinator at ``address`` is closing (its port refuses): its exit code, a moment
        later, says more than its silence (a frozen one would never answer again)."""
        ...

    def leads(self, run: Run, coordinator: subprocess.Popen, timeout_s: float) -> bool:
        """Whether ``coordinator``, this launcher's, leads the run as one candidate of several."""
        ...


class TcpStore:
    """The coordinator's own TCPStore, its coordinator started by the first launcher."""

    coordinator = "coordinator"
    notice_stops_run = True  # the run's store lives in the coordinator: it goes with its node

    def check(self, rc: config.Recover, address: str | None) -> str | None:
        if address is not None:
            check_coordinator(address)
        else:  # this launcher starts the coordinator, listening there, and it may serve the page
            config.check_coordinator_bind(rc)
            config.check_status_page(rc, port=True)
        return None

    def new_run_id(self, first: bool) -> str | None:
        return secrets.token_hex(8) if first else None

    def begins_new_run(self, first: bool) -> bool:
        return first  # the first launcher starts the coordinator, and with it the run

    def start(self, launcher: NodeLauncher) -> None:
        if launcher.address is None:
            launcher.start_coordinator_here()
        elif launcher.run is None:
            found = transport.find_run(launcher.address, launcher.rc.startup_timeout_s, launcher.env[keys.SECRET_ENV])
            launcher.name_run(found.id)

    def board(self, run: Run) -> Board | None:
        return None

    def ended_by(self, coordinator: subprocess.Popen | None) -> bool:
        return coordinator is not None and coordinator.poll() in (EXIT_OK, EXIT_STOPPED)  # done, or stopped in order

    def lost_by(self, coordinator: subprocess.Popen | None) -> bool:
        return coordinator is not None and coordinator.poll() is not None

    def exiting(self, address: str) -> bool:
        return transport.connection_refused(address)

    def leads(self, run: Run, coordinator: subprocess.Popen, timeout_s: float) -> bool:
        return False  # the one coordinator: its node stops the run rather than leave it


class Etcd:
    """An etcd cluster, a coordinator candidate beside every launcher."""

    coordinator = "coordinator candidate"
    notice_stops_run = False  # another node's candidate leads once this one is gone

    def __init__(self, url: str) -> None:
        self.url = url

    def check(self, rc: config.Recover, address: str | None) -> str | None:
        if address is not None and address != self.url:
            raise config.ConfigError(
                f"{keys.COORDINATOR_ENV}={address!r} differs from recover.control_store={self.url!r}: with an "
                f"etcd control store, set it to the same URL on every node after the first (or unset it on the first)"
            )
        config.check_status_page(rc, port=False)  # a leader on this host may hold the port already
        return check_control_store(self.url)  # reachable, and able to lose a member

    def new_run_id(self, first: bool) -> str | None:
        raise config.ConfigError(
            f"a run on etcd needs {keys.RUN_ENV}, the same on every node: the job's id (scripts/node.sh uses "
            f"$SLURM_JOB_ID under Slurm, the Job's uid on Kubernetes). A node started again with the same id "
            "rejoins the run; a new id starts a new run"
        )

    def begins_new_run(self, first: bool) -> bool:
        return False  # the run may be running already: ``_begin_or_join`` finds out from etcd

    def start(self, launcher: NodeLauncher) -> None:
        launcher.address = launcher.env[keys.COORDINATOR_ENV] = self.url
        if launcher.first:
            self._begin_or_join(launcher)
        else:
            self._await_restart(launcher)
        launcher.start_candidate()

    def _begin_or_join(self, launcher: NodeLauncher) -> None:
        """The first node starts the run, unless it is running already: then this launcher is a
        relaunched node (a replaced pod, the same command again) and joins it like any other. A run that
        stopped in order is begun again (its keys cleared: the stop folder holds what it resumes from). A new run's
        event log (every node's file in the shared dump folder, the run before's moved aside) is started afresh
        before its hello, which
        every other process of the run waits for before it writes (a candidate, a launcher's connect)."""
        run = launcher.run
        assert run is not None, "a run on etcd is named by its id"
        raw = transport.etcd(self.url, launcher.rc.startup_timeout_s)
        client = ControlClient(transport.in_run(raw, run))
        if client.stopped_in_order():  # the same commands again resume it: from the state saved at the stop
            raw.delete([], [f"{run.prefix}/"])
            log.info(f"run {run.id!r} stopped in order: it starts again on {self.url}, from what it saved at the stop")
        if not client.begun():  # a new run's log starts afresh before its hello: every other node waits for that
            moved = rotate_events(titan.dump_folder(launcher.job_config))
            if moved:
                log.info(f"the event logs of the run before this one are in {moved}")
        if client.begin():
            return
        ended = client.ended()
        if ended is not None:
            raise config.ConfigError(
                f"run {run.id!r} on {self.url} has ended already ({ended}): start a new run with a new {keys.RUN_ENV}"
            )
        log.info(f"run {run.id!r} is already running on {self.url}: this launcher joins it")
        launcher.first = False

    def _await_restart(self, launcher: NodeLauncher) -> None:
        """A run that stopped in order is started again by its first node, which clears what the stop left
        in etcd (``_begin_or_join``): another node started with it waits for that, up to
        ``startup_timeout_s``, rather than join the stopped run."""
        run, bound = launcher.run, launcher.rc.startup_timeout_s
        assert run is not None, "a run on etcd is named by its id"
        client = ControlClient(transport.in_run(transport.etcd(self.url, bound), run))
        deadline = time.monotonic() + bound
        if client.stopped_in_order():
            log.info(f"run {run.id!r} stopped in order: waiting up to {bound:g}s for its first node to start it again")
        while client.stopped_in_order():
            if time.monotonic() > deadline:
                raise config.ConfigError(
                    f"run {run.id!r} on {self.url} stopped in order, and its first node (the launcher without "
                    f"{keys.COORDINATOR_ENV}) did not start it again within recover.startup_timeout_s = {bound:g}s: "
                    "start the same command there"
                )
            time.sleep(RESTART_POLL_S)

    def board(self, run: Run) -> Board | None:
        return Board(run)  # the leader serves the node messages

    def ended_by(self, coordinator: subprocess.Popen | None) -> bool:
        return False  # a candidate's exit code says nothing about the run, and exit 1 may be a traceback

    def lost_by(self, coordinator: subprocess.Popen | None) -> bool:
        return False  # another candidate leads, or takes the lease over

    def exiting(self, address: str) -> bool:
        return False  # the lease passes on; the lifeline judges the leader

    def leads(self, run: Run, coordinator: subprocess.Popen, timeout_s: float) -> bool:
        """As the leader key names its holder (``control.leader.Lease``: its pid and host)."""
        raw = transport.etcd(self.url, timeout_s).read(keys.leader_key(run.prefix))
        try:
            holder = json.loads(raw) if raw else {}
        except ValueError:
            return False
        return isinstance(holder, dict) and (holder.get("pid"), holder.get("host")) == (
            coordinator.pid,
            socket.gethostname(),
        )


def store_of(rc: config.Recover) -> ControlStore:
    return Etcd(rc.control_store) if rc.control_store else TcpStore()


def check_control_store(url: str) -> str:
    """The etcd cluster of ``[recover] control_store``, checked before anything starts."""
    try:
        from titan_recover.control.etcd_store import check_cluster
    except ImportError as e:
        raise config.ConfigError(
            f"recover.control_store names etcd but its client is missing ({e}): pip install 'titan_recover[etcd]'"
        ) from None
    try:
        return check_cluster(url, timeout_s=5.0)
    except ValueError as e:
        raise config.ConfigError(f"recover.control_store: {e}") from None


def check_coordinator(address: str) -> str:
    """``$TITAN_RECOVER_COORDINATOR`` checked as ``host:port`` of a host that resolves, before anything
    starts (a bad one failed only once the replica groups were up); returns it."""
    fix = "set it to host:port of the coordinator another node's launcher started, or unset it to start one here"
    try:
        host, _ = parse_host_port(address)
    except ValueError as e:
        raise config.ConfigError(f"{keys.COORDINATOR_ENV}={e}; {fix}") from None
    try:
        resolve(host)
    except ValueError as e:
        raise config.ConfigError(f"{keys.COORDINATOR_ENV}={address!r}: {e}; {fix}") from None
    return address
