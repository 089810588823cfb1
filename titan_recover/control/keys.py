"""Every name the control plane uses: store keys (under the run's prefix) and environment variables.

Values under these keys are records of ``protocol`` (JSON, never pickle), or plain
integers for counters.
"""

import os

# environment the launcher sets for the processes it starts
COORDINATOR_ENV = "TITAN_RECOVER_COORDINATOR"  # host:port of the coordinator's store, or the etcd:// URL
REPLICA_ENV = "TITAN_RECOVER_REPLICA"  # this process's replica group id
REPLICAS_ENV = "TITAN_RECOVER_REPLICAS"  # comma-separated replica group ids a node's launcher runs
GROUP_NODE_ENV = "TITAN_RECOVER_GROUP_NODE"  # which node part of its replica groups a node runs (recover.group_nodes)
SECRET_ENV = "TITAN_RECOVER_SECRET"  # this run's secret: it seals every record of the run (``sealed``)
SECRET_FILE_ENV = "TITAN_RECOVER_SECRET_FILE"  # a file holding it, read where SECRET_ENV is unset (``sealed``)
RUN_ENV = "TITAN_RECOVER_RUN_ID"  # this run's id: a new id is a new run; the same id relaunched rejoins it
LISTEN_FD_ENV = "TITAN_RECOVER_LISTEN_FD"  # the listening socket its launcher bound and handed to the coordinator
INCARNATION_ENV = "TITAN_RECOVER_ATTEMPT"  # incarnation of this replica group: 0, then +1 per restart
NOTICE_STOPS_RUN_ENV = "TITAN_RECOVER_NOTICE_STOPS_RUN"  # "1": a SIGTERM here stops the whole run (its coordinator)
SNAPSHOT_DIR_ENV = "TITAN_RECOVER_SNAPSHOTS"  # this launcher's snapshot folder (node.memory); unset or "": none
NODE_RANKS_ENV = "TITAN_RECOVER_NODE_RANKS"  # ranks this launcher runs on its node, all groups: they share it
FAILURE_DOMAIN_ENV = "TITAN_RECOVER_FAILURE_DOMAIN"  # this node's failure domain (a rack, a switch); "": unknown
ETCD_ENDPOINTS_ENV = "TITAN_RECOVER_ETCD_ENDPOINTS"  # a node-local file: the run's etcd members' addresses, as
# its processes last read them (``etcd_store``); where none of a process's own answers, it dials those
REPLACEMENT_ENV = "TITAN_RECOVER_REPLACEMENT"  # set on a node the run asked its scheduler for: the request's number


def incarnation() -> int:
    """This process's incarnation of its replica group (counted in the store: ``incarnation_key``)."""
    return int(os.environ.get(INCARNATION_ENV, "0"))


# exit codes of every titan_recover process, what its supervisor (the launcher, Slurm, Kubernetes) acts on
EXIT_OK = 0
EXIT_FAILED = 1  # the run (or the check) failed or stopped for good; its last line says why
EXIT_BAD_INPUT = 2  # a config value, the environment or the data cannot run: fix it, a restart fails the same way
EXIT_COORDINATOR_LOST = 3  # no sign of life from the coordinator: every process stops; the same command resumes
EXIT_LEFT = 4  # this node was told it goes away and left the run (its groups at a step boundary); the run goes on
EXIT_STOPPED = 5  # the run stopped in order at a step boundary (its coordinator's or every node went away); resume it
EXIT_QUARANTINED = 6  # SDC checks quarantined every group of this node; the run goes on: check or replace the node


HELLO = "hello"  # the coordinator sets it on start: a client that cannot read it is not in this run
EPOCH = "epoch"
REPORTS = "reports"  # counter: report slots reserved so far
FATAL = "fatal"
STATUS = "status"
START_STEP = "start_step"  # the step the run resumed from (0, or a DCP checkpoint's): records start after it
ALIVE = "coordinator/alive"  # the coordinator bumps it every pass: a frozen coordinator stops it
COORDINATOR_STATE = "coordinator/state"  # what a new coordinator leader restores (``protocol.CoordinatorState``)
BOARD = "coordinator/board"  # on etcd: where the leader serves the node messages (``protocol.BoardAddress``)
CANDIDATES = "candidates/"  # on etcd: each live coordinator candidate, under its lease (``protocol.Candidate``)
REPLICATE_BACKEND = "replicate_backend"  # "gloo" or "nccl": the first rank sets it, every other must match
NODES = "nodes"  # counter: launchers registered so far; node_key(1..n) name them


NO_PASS = (
    "ok/",
    "decision/",
    "param_digest/",
    "pg/",
    ALIVE,
    COORDINATOR_STATE,
    BOARD,
    CANDIDATES,
    "members/",
    EPOCH,
    "fenced/",
    "admitted/",
    "drain/",
    "snapshots/",
)
"""Keys whose writes wake no coordinator pass on etcd: the ranks' own per-step agreement and the
coordinator's own writes (node messages are not in etcd: ``board``)."""

CURRENT_RUN = "current"  # in the namespace of the run with no id: the id of the run a TCPStore serves
PROCESS_GROUPS = "pg/"  # the replicate-dim process groups' own rendezvous (names chosen by gloo/NCCL)


def leader_key(prefix: str) -> str:
    """The etcd key of the run's coordinator leader (its lease's), outside the run's ``PrefixStore``
    (``prefix`` is the run's): the guard of every leader write compares it as stored."""
    return f"{prefix}/coordinator/leader"


def etcd_volunteers(prefix: str) -> str:
    """Where nodes without an etcd member of a run's own (``nodes://``) offer to run one, each under its address
    (on a lease of its own: a node gone leaves no offer)."""
    return f"{prefix}/etcd/volunteers/"


def etcd_assigned(prefix: str, host: str) -> str:
    """Where a keeper tells volunteer ``host`` the member it was added as (``launch.members``)."""
    return f"{prefix}/etcd/assigned/{host}"


def replicate_group_prefix(epoch: int, shard: int) -> str:
    return f"{PROCESS_GROUPS}replicate/e{epoch}/s{shard}/"


def transfer_group_prefix(epoch: int, shard: int, joiner: int) -> str:
    return f"{PROCESS_GROUPS}transfer/e{epoch}/s{shard}/r{joiner}/"


def process_group_prefixes(epoch: int) -> tuple[str, str]:
    """Where every replicate and transfer group of ``epoch`` meets (each shard's, each joiner's)."""
    return f"{PROCESS_GROUPS}replicate/e{epoch}/", f"{PROCESS_GROUPS}transfer/e{epoch}/"


def members_key(epoch: int) -> str:
    return f"members/{epoch}"


VOTE_TALLY = "#"  # on etcd, the key under a vote's prefix whose version counts the votes (voters: "<replica>.<rank>")


def ok_key(step: int, epoch: int, round: int = 0) -> str:
    """The commit votes of ``step`` in ``epoch``: a counter on the TCPStore; on etcd the prefix of
    one key per voter and of the ``VOTE_TALLY`` key (``SealedStore.vote``). A step redone in the
    same epoch (``[recover] exact`` on a coarser grid) votes again in its next ``round``."""
    return f"ok/{step}/{epoch}" + (f"/{round}" if round else "")


def decision_key(step: int, epoch: int) -> str:
    return f"decision/{step}/{epoch}"


def report_key(index: int) -> str:
    return f"report/{index}"


def step_key(step: int) -> str:
    """The record of committed ``step``: the first member to commit it writes it, the coordinator logs it."""
    return f"step/{step}"


def fault_key(replica: int) -> str:
    return f"fault/{replica}"


def snapshots_key(replica: int, incarnation: int, group_rank: int) -> str:
    """The snapshot steps that incarnation's rank verified on its node (``protocol.Snapshots``), written while
    it waits to join a run whose every group lost its state."""
    return f"snapshots/{replica}/{incarnation}/{group_rank}"


def admitted_key(replica: int, incarnation: int) -> str:
    """The coordinator's answer to that incarnation's ranks being ready to join (their node agents
    say so); it comes with a new epoch, which is when a joiner looks."""
    return f"admitted/{replica}/{incarnation}"


def fenced_key(replica: int) -> str:
    """That incarnation is out; its launcher kills what is left of it."""
    return f"fenced/{replica}"


def drain_key(replica: int) -> str:
    """An operator asks that incarnation to leave at a step boundary (``protocol.Drain``); its launcher reads it."""
    return f"drain/{replica}"


def replacement_key(request: int) -> str:
    """What the node of replacement request ``request`` took (``protocol.Replacing``); the coordinator reads it."""
    return f"replacement/{request}"


def owner_key(replica: int, part: int = 0) -> str:
    """The launcher that runs this replica group (``claims``), or node part ``part`` of it when a
    group spans nodes."""
    return f"owner/{replica}" if part == 0 else f"owner/{replica}/{part}"


def joined_key(replica: int, part: int) -> str:
    """An integer: the incarnation of ``replica`` that its node part ``part`` last started, so a
    launcher taking that part over never joins an incarnation its dead predecessor was part of."""
    return f"joined/{replica}/{part}"


def rendezvous_key(replica: int) -> str:
    """Where the torchrun of this group's current incarnation meets, when the group spans nodes;
    written by the launcher of node part 0 at each start."""
    return f"rendezvous/{replica}"


def launcher_key(launcher: str) -> str:
    """A launcher's node message, rewritten by its lifeline every heartbeat interval; one that
    stops changing lets others take its claims over."""
    return f"launcher/{launcher}"


def node_key(index: int) -> str:
    """The launcher id of the ``index``-th launcher to register (its message is under ``launcher_key``)."""
    return f"node/{index}"


def incarnation_key(replica: int) -> str:
    """Counter: incarnations of this replica group started so far, by any launcher of the run."""
    return f"incarnation/{replica}"


def transfer_key(replica: int, group_rank: int) -> str:
    """A joiner rank's last state transfer."""
    return f"transfer/{replica}/{group_rank}"


def digest_key(step: int, replica: int) -> str:
    """A replica's parameter digest at ``step``; each member compares every member's."""
    return f"param_digest/{step}/{replica}"
