"""The ``[recover]`` section of a TorchTitan job config.

Loaded through TorchTitan's ``job.custom_config_module = "titan_recover.config"``,
so it is set from TOML or from the CLI as ``--recover.key value`` like any other
section. R and the shard degree are TorchTitan's own
``parallelism.data_parallel_replicate_degree`` / ``data_parallel_shard_degree``:
the same TOML describes stock HSDP (``enable = false``) and titan_recover.
"""

import dataclasses
import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_recover.control import keys
from titan_recover.control.addresses import (
    NODES_SCHEME,
    check_bindable,
    check_port_free,
    parse_etcd_url,
    parse_host,
    parse_nodes_url,
)
from titan_recover.control.protocol import MAX_DOMAIN
from titan_recover.policy import fault_plan, workload

log = logging.getLogger(__name__)

BACKENDS = ("auto", "nccl", "gloo")
"""Values of ``recover.replicate_backend`` (``titan_recover.node.devices`` resolves "auto")."""

WARM = ("auto", "on", "off")
"""Values of ``recover.warm`` (``titan_recover.node.warm.off_because`` resolves "auto")."""

REPLACE = ("auto", "on", "off")
"""Values of ``recover.replace`` (``titan_recover.coordinator.slurm.Submitter.of`` resolves "auto")."""


class ConfigError(ValueError):
    """A config value titan_recover cannot run with; the message names the key."""


@dataclass
class Recover:
    enable: bool = False
    """Run the replicate dimension as fault-tolerant replica groups. false = stock TorchTitan HSDP."""

    policy: str = "balanced"
    """Workload policy that hands microbatch ids to live replicas (see titan_recover.policy.workload)."""

    exact: bool = False
    """Bit-exact recovery: the parameters, optimizer state and loss after every step are the same
    bits as the failure-free run's, whatever failed and whoever took over which microbatch, and
    with 2, 3 or 4 replica groups of the same shard degree. Each microbatch's gradient is summed
    on an agreed fixed-point grid as exact integers (order-free; see titan_recover.rank.exact), and a CPU rank
    runs one intra-op thread. Replica groups of FSDP ranks only (tensor/pipeline parallel 1)."""

    speed_smoothing: float = 0.3
    """Weight of the newest step in each replica's measured seconds per microbatch (an
    exponential average); the ``speed`` policy's quotas come from these measurements."""

    rebalance_threshold: float = 0.1
    """The ``speed`` policy moves work between replicas only when that cuts the predicted step
    time by more than this fraction, so measurement noise does not reshuffle quotas."""

    spares: int = 0
    """Hot spare replica groups started with the job (ids R .. R+spares-1): each builds the model,
    connects and waits outside the membership, costing no collective. On a failure the coordinator
    admits a ready spare at once (state from a live peer); the failed group restarts and waits as
    a spare. Each holds the devices of one replica group."""

    max_replicas: int = 0
    """The most replica groups that may be members at once (0: ``data_parallel_replicate_degree``, R, a
    fixed-size run). Above R, a group started later (a node given new ids R+spares .. max_replicas-1 in
    ``TITAN_RECOVER_REPLICAS``, or ``any`` free ones, with the coordinator's address) is admitted at a step
    boundary while fewer are members, takes its state from a live peer and a share of the M microbatches:
    the trajectory does not change (M is fixed), and each step gets faster where each rank has its own
    device. Hot spares then join whenever fewer than this many are members. At most M (a member with no
    microbatch would idle) (docs/elasticity.md)."""

    replace: str = "auto"
    """Ask the scheduler for a node when a replica group stays out of the run longer than replace_after_s (its
    node lost): a job that joins the run for free replica ids (as a ``JOIN_RUN`` job does), never on a node still
    in the run's job, at most max_replacements at once, none once the run ended, those still open cancelled then
    (docs/multi-node.md#capacity-back-by-itself). "auto": on where the run's batch script handed the coordinator
    the command to submit one (``scripts/slurm/train.sbatch``, one node per group; on etcd every candidate has it):
    a request costs a queued job that leaves at once when nothing is missing, and without it a lost node's groups
    stay out until someone submits a job by hand. "on": the same, and a run without that command says so at its
    start. "off": never asks; a run goes on with the groups it has."""

    replace_after_s: float = 60.0
    """How long a replica group stays out of the run before the run asks for a replacement. Above a group's own
    restart (its launcher's: 3 s warm, 20 s cold on the default job, docs/benchmarks.md), so a group coming back
    by itself costs no request, and short beside the queue wait and start of a new job."""

    max_replacements: int = 2
    """The most replacement requests open at once (submitted, not yet joined or ended): a rack lost costs this
    many queued jobs at a time, not one per node."""

    warm: str = "auto"
    """Keep each replica group's next incarnation warm (titan_recover.node.warm): once a group trains,
    its launcher starts another torchrun for it whose ranks import torch and TorchTitan, parse the
    job and wait before building anything (no accelerator memory, no process group). A restart
    activates it: the failed group is back without the seconds a new process spends importing.
    "auto": on where it fits: the node has a core per training and per waiting rank (the waiting
    ranks' imports would otherwise slow training), and twice 1.5 GiB of free host memory per waiting
    rank (one holds about 0.5-0.7 GiB). "on": despite too few cores. "off": restarts import anew.
    Groups spanning nodes restart cold."""

    min_replicas: int = 1
    """Stop with an error when fewer replica groups than this are left."""

    fault_plan: str = "none"
    """Failures to inject, e.g. "kill replica=1 rank=1 step=10 phase=backward" (see titan_recover.policy.fault_plan)."""

    heartbeat_interval_s: float = 0.1
    """How often every rank beats into its node channel, and every node agent (launcher) writes
    its node message, the coordinator's one read per node (on etcd at least every 0.4 s:
    ``node_message_interval_s``)."""

    heartbeat_timeout_s: float = 5.0
    """A rank whose heartbeat stalls this long is declared failed (hangs, SIGSTOP). One bound with
    three readers, on purpose: the coordinator's failure detector (and a waiting spare's drop), a
    node agent reporting its own silent rank at once, and claims, which take over a launcher whose
    node message has not changed this long (a launcher is as dead as the groups it carries)."""

    report_confirm_s: float = 1.0
    """After a survivor reports a collective error, fence replicas silent for this long."""

    collective_timeout_s: float = 30.0
    """Timeout of the replicate-dimension process groups (building and all-reduce)."""

    startup_timeout_s: float = 600.0
    """How long a replica group may take to send its first heartbeat."""

    notice_budget_s: float = 12.0
    """How long a node told it will go away (SIGTERM to its launcher, or to every process of the node)
    gives its replica groups to leave at a step boundary: each finishes the step it is in and leaves
    before the next, its quota taken by the others, nothing computed again. A group still in its step
    after this long is killed and failed at once (today's in-step recovery, with no detection time).
    Set it a few seconds under the scheduler's grace: Kubernetes' 30 s by default, GKE's 15 s
    (docs/elasticity.md)."""

    coordinator_timeout_s: float = 30.0
    """Every process of the run stops, with one line saying how to resume, when the coordinator
    shows no sign of life this long (frozen or its host gone); a killed one is noticed at once."""

    progress_timeout_s: float = 600.0
    """A rank whose main loop makes no progress this long (deadlock, hung read or save) is fenced,
    even though its heartbeat thread runs. Keep it above the longest pause of the loop:
    a checkpoint save, the first step's compilation."""

    max_step_retries: int = 3
    """A step whose replicate collectives break this many times with nobody silent is not retried
    again: the replicas that never reported a break (the ones the others waited for) are fenced,
    or, if every replica reported one, the run stops naming them."""

    coordinator_port: int = 0
    """TCP port of the coordinator's store; 0 picks a free one."""

    coordinator_bind: str = ""
    """Address the coordinator's store listens on: an IPv4 address of its node, or a host name that
    resolves to one (IPv6 is not supported). "" = loopback (127.0.0.1), for a run whose
    replica groups all run on the coordinator's node; a multi-node run must name an address the
    other nodes reach, e.g. this node's IP on the cluster network (or 0.0.0.0: every interface)."""

    group_nodes: int = 1
    """Nodes one replica group spans (a 70B model with TP 8 x PP 4 needs 32 GPUs per group): each
    group's dp_shard x tp x pp ranks are split evenly over this many nodes, whose launchers are
    told their part by $TITAN_RECOVER_GROUP_NODE (0..group_nodes-1). The launchers of a group start
    its torchrun together with a multi-node rendezvous (part 0's launcher picks the port), and when
    any part fails the whole group restarts as its next incarnation and rejoins."""

    max_restarts: int = 3
    """How often the launcher may restart a failed replica group (which then rejoins from a live
    peer) within restart_window_s; a group that fails more often is left out. With enable = false:
    restarts of the whole job (checkpoint-and-restart)."""

    restart_window_s: float = 3600.0
    """Restarts of a group older than this no longer count against max_restarts, so a long run
    keeps healing occasional failures and gives up only on a group that keeps failing."""

    sdc_check: bool = False
    """Silent-data-corruption checks (exact mode only): at a step drawn with probability sdc_check_rate from
    data_seed and the step, one microbatch, drawn too, is computed again by the replica group after its owner,
    and the two groups' digests of its gradient are compared bit for bit before the step commits. A mismatch
    asks a third group; the group outvoted two to one fails in that step and the others compute its
    microbatches. See docs/sdc-checks.md."""

    sdc_check_rate: float = 0.05
    """The share of steps sdc_check checks, in (0, 1]: each check costs one microbatch's forward and backward
    on one group (at 1 and M = 8 on 4 groups, about a quarter of a group's step)."""

    sdc_quarantine_window_s: float = 86400.0
    """A replica group outvoted by sdc_check twice within this many seconds is quarantined: fenced, never
    readmitted, its launcher restarting it no more (a device wrong once may have been hit by a particle; wrong
    twice, it is bad); the other groups of its node with it, where a group on another node goes on."""

    digest_interval: int = 10
    """Every this many steps (and at the last) each replica logs a digest of its parameters."""

    snapshot_interval: int = 10
    """Every this many committed steps each rank copies its committed state into its node's memory
    (files in its launcher's folder under ``snapshot_dir``), off the step's path. When every replica
    group is lost at once while their nodes' launchers live, the restarted ranks resume from the newest
    step whose every shard has a verified copy, computing at most this many steps again instead of
    going back to the last DCP checkpoint. 0 = off."""

    snapshot_keep: int = 1
    """Complete snapshots kept per shard on each node, besides the one being written. More lets a run
    roll back further (past a corrupted copy), at (keep + 1) x the state's size in host memory."""

    snapshot_dir: str = ""
    """The tmpfs under which each launcher makes its snapshot folder (mode 0700, removed when the
    launcher exits; a dead launcher's is removed by the next on the node). "" = /dev/shm where the host
    has it writable, else the temp dir. A container's /dev/shm is often 64 MiB and counts against its
    memory limit: raise it (Docker ``--shm-size``, a Kubernetes ``emptyDir`` with ``medium: Memory``)
    or name another tmpfs. Checked on each node by its launcher: an existing writable directory."""

    failure_domain: str = ""
    """This node's failure domain (its rack, leaf switch or power feed): what one loss takes down together.
    $TITAN_RECOVER_FAILURE_DOMAIN wins where set and not empty (a scheduler sets it per node: ``scripts/node.sh``
    from Slurm's SLURM_TOPOLOGY_ADDR). The coordinator warns when every host-memory copy of some shard sits in
    one domain (docs/host-memory.md#failure-domains). "" = unknown."""

    data_seed: int = 0
    """Seed of the sample order: each data epoch visits every window of the corpus once, in an
    order drawn from this seed and the epoch (see titan_recover.data.order)."""

    control_store: str = ""
    """Where the coordinator's state lives. "" = its own TCPStore (one coordinator; if its node
    dies the run stops with a resume hint). "etcd://host:port,host:port,host:port" = an etcd
    cluster of at least 3 members: a coordinator candidate runs beside every launcher, one leads
    on an etcd lease, and when it dies another takes over within seconds, restoring the state from
    etcd; ranks and launchers carry on. Needs the etcd3gw client (pip extra "etcd").
    "nodes://host,host,host" (3 or 5 of the run's nodes, each host[:port], default port 2379, peers on
    the next): the same, on an etcd cluster the launchers on those nodes run themselves, one member each
    (launch.members; the etcd binaries on PATH, docs/etcd-operations.md#on-the-runs-own-nodes)."""

    member_replace_after_s: float = 30.0
    """With control_store = "nodes://...": how long a member of the run's etcd stays unreachable before the
    launchers remove it and start one in its place on a node without one (a node that volunteers: four or more
    nodes). Above a member's own restart with its launcher, and short beside the time to a second loss; a member
    cut off this long and then back finds itself removed, and its node volunteers again
    (docs/etcd-operations.md#a-lost-member-replaced)."""

    leader_lease_s: float = 3.0
    """TTL of the coordinator leader's etcd lease: a dead leader is replaced this long after its
    last refresh. Must stay below coordinator_timeout_s (every process waits that long for a leader)."""

    status_port: int = 0
    """Port of the run's status page: ``/`` (groups, failures, rejoins, plots), ``/status.json`` and
    Prometheus's ``/metrics``, served by the coordinator (on etcd: the leader, which logs the page's
    address whenever leadership moves). 0 = no page. Read-only; nothing secret is on it."""

    status_bind: str = "127.0.0.1"
    """Address the status page listens on: loopback unless set (0.0.0.0: every interface; a run on
    etcd serves it from whichever node leads, so name an address every node has, e.g. 0.0.0.0)."""

    replicate_backend: str = "auto"
    """Backend of the replicate-dimension groups: "nccl", "gloo", or "auto" (NCCL where every
    rank has a GPU of its own, else gloo); the launcher resolves "auto" (see titan_recover.node.devices)."""

    nccl_rank_per_host: bool = False
    """Let ranks share GPUs with every communicator on NCCL (the replicate dimension and FSDP inside
    a group, e.g. 2 groups x 2 ranks on one GPU): each rank sees one GPU and poses to NCCL as a host
    of its own, NCCL connecting them over loopback sockets. For tests and the self-test on a small
    node; one node only; its timings are not performance figures (see titan_recover.node.devices)."""


ETCD_NODE_MESSAGE_S = 0.4
"""The shortest interval between a launcher's node messages on etcd."""


def failure_domain(rc: Recover, env: Mapping[str, str]) -> str:
    """This node's failure domain: $TITAN_RECOVER_FAILURE_DOMAIN where set and not empty, else ``[recover]
    failure_domain`` ("" = unknown). Every launcher's claims carry it, so a name other launchers would refuse is
    refused here."""
    from_env = env.get(keys.FAILURE_DOMAIN_ENV, "").strip()
    domain = from_env or rc.failure_domain.strip()
    if len(domain) > MAX_DOMAIN:
        where = keys.FAILURE_DOMAIN_ENV if from_env else "recover.failure_domain"
        raise ConfigError(f"{where} is {len(domain)} characters long: name the domain in at most {MAX_DOMAIN}")
    return domain


def node_message_interval_s(rc: Recover) -> float:
    """How often each launcher writes its node message and the coordinator reads them:
    ``heartbeat_interval_s``, but at least ``ETCD_NODE_MESSAGE_S`` on etcd, where the coordinator's
    pass that reads them also reads etcd (the node messages themselves are on the leader's board,
    ``control.board``). Failure detection is bounded by ``heartbeat_timeout_s`` either way."""
    return max(rc.heartbeat_interval_s, ETCD_NODE_MESSAGE_S) if rc.control_store else rc.heartbeat_interval_s


@dataclass(frozen=True)
class CoordinatorSettings:
    """What the coordinator needs of the job, parsed once by the launcher and handed over as JSON
    (``--settings``): the control-plane process imports no TorchTitan and never re-reads the config."""

    recover: Recover
    replicas: int
    """``parallelism.data_parallel_replicate_degree``: the members of epoch 0."""
    replica_ids: int
    """Replica ids of the run (``replica_ids``): the groups it starts, members and hot spares, and those
    nodes started later may bring."""
    max_members: int
    """``recover.max_replicas`` (0: ``replicas``): the most members at once."""
    group_ranks: int
    steps: int
    tokens_per_step: int
    precision: str
    dump_folder: str
    resume_hint: str
    """The line every process prints when the run stops for good."""
    stop_hint: str
    """The line every process prints when the run stopped in order."""

    @classmethod
    def of(cls, job_config: Any, dump_folder: str) -> "CoordinatorSettings":
        tr, par = job_config.training, job_config.parallelism
        return cls(
            recover=job_config.recover,
            replicas=par.data_parallel_replicate_degree,
            replica_ids=replica_ids(job_config),
            max_members=max_members(job_config),
            group_ranks=group_ranks(par),
            steps=tr.steps,
            tokens_per_step=tr.global_batch_size * tr.seq_len,
            precision=tr.mixed_precision_param,
            dump_folder=dump_folder,
            resume_hint=resume_hint(job_config, dump_folder),
            stop_hint=stop_hint(job_config, dump_folder),
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CoordinatorSettings":
        """The settings the launcher wrote; ConfigError naming what is wrong (a hand-started coordinator)."""
        try:
            fields = json.loads(text)
            recover = Recover(**fields.pop("recover"))
            settings = cls(recover=recover, **fields)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ConfigError(
                f"coordinator --settings is not a settings record ({e}): start the coordinator "
                "with run_train.sh, whose launcher writes it"
            ) from None
        _check_types(settings, "coordinator --settings")
        return settings


@dataclass
class JobConfig:
    recover: Recover = field(default_factory=Recover)


def validate(job_config: Any) -> Recover:
    """Checks ``[recover]`` and the parallelism it relies on; returns the section.

    The checks run in this order, and the first that fails raises its ``ConfigError``."""
    rc: Recover = job_config.recover
    _check_types(rc, "recover")
    _check_minimums(rc, _COUNTS)
    _check_timeouts(rc)
    _check_heartbeats(rc)
    _check_rebalancing(rc)
    _check_minimums(rc, {"data_seed": 0})
    _check_coordinator_port(rc)
    _check_coordinator_bind(rc)
    _check_status_page(rc)
    _check_control_store(rc)
    _check_leader_lease(rc)
    _check_backend(rc)
    _check_warm(rc)
    _check_replace(rc)
    _check_policy(rc)
    plan = _parse_fault_plan(rc)
    _check_degrees(rc, job_config.parallelism)
    _derive_global_batch(job_config)
    _check_training(job_config.training)
    _check_group_nodes(rc, job_config.parallelism)
    _check_fault_plan(plan, job_config)
    _check_faults_outside_cuda_graphs(plan, cuda_graphs(job_config))
    _check_context_parallel(job_config.parallelism)
    _check_exact(rc, job_config.parallelism)
    _check_sdc(rc)
    _check_batch(job_config)
    return rc


_COUNTS = {
    "spares": 0,
    "max_replicas": 0,
    "min_replicas": 1,
    "max_restarts": 0,
    "max_step_retries": 1,
    "group_nodes": 1,
    "digest_interval": 1,
    "snapshot_interval": 0,
    "snapshot_keep": 1,
    "max_replacements": 1,
}
"""Integer keys of ``[recover]`` and their smallest allowed value."""

_TRAINING_COUNTS = ("local_batch_size", "global_batch_size", "seq_len", "steps")
"""Keys of ``[training]`` that the microbatch layout and the fault plan divide by or count to: each >= 1."""

_SECONDS = (
    "heartbeat_interval_s",
    "heartbeat_timeout_s",
    "report_confirm_s",
    "collective_timeout_s",
    "startup_timeout_s",
    "notice_budget_s",
    "coordinator_timeout_s",
    "progress_timeout_s",
    "restart_window_s",
    "leader_lease_s",
    "replace_after_s",
    "member_replace_after_s",
    "sdc_quarantine_window_s",
)
"""Durations of ``[recover]``: each a finite number of seconds > 0."""


_ACCEPTS: dict[type, type | tuple[type, ...]] = {bool: bool, int: int, float: (int, float), str: str}
"""What a field annotated with each class accepts (an int where a float goes)."""


def _check_types(section: Any, name: str) -> None:
    for f in dataclasses.fields(section):
        value, kind = getattr(section, f.name), f.type
        if isinstance(kind, type) and dataclasses.is_dataclass(kind) and isinstance(value, kind):
            _check_types(value, f"{name}.{f.name}")
            continue
        if not isinstance(kind, type):
            raise TypeError(f"{name}.{f.name} is annotated {kind!r}: only bool, int, float or str fields are checked")
        expected = _ACCEPTS[kind]
        ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
        if not ok:
            raise ConfigError(f"{name}.{f.name} must be of type {kind.__name__}, got {value!r}")


def _check_minimums(rc: Recover, minimums: dict[str, int]) -> None:
    for key, low in minimums.items():
        if getattr(rc, key) < low:
            raise ConfigError(f"recover.{key} must be >= {low}, got {getattr(rc, key)}")


def _check_timeouts(rc: Recover) -> None:
    for key in _SECONDS:
        if not math.isfinite(getattr(rc, key)) or getattr(rc, key) <= 0:
            raise ConfigError(f"recover.{key} must be a finite number > 0, got {getattr(rc, key)}")


def _check_heartbeats(rc: Recover) -> None:
    if rc.heartbeat_timeout_s <= 2 * rc.heartbeat_interval_s:
        raise ConfigError(
            "recover.heartbeat_timeout_s must be more than twice "
            f"recover.heartbeat_interval_s, got {rc.heartbeat_timeout_s} "
            f"and {rc.heartbeat_interval_s}"
        )
    if rc.heartbeat_timeout_s <= 2 * node_message_interval_s(rc):
        raise ConfigError(
            f"recover.heartbeat_timeout_s must be more than {2 * node_message_interval_s(rc):g}s on etcd "
            f"(node messages are written every {node_message_interval_s(rc):g}s there), got {rc.heartbeat_timeout_s}"
        )
    if rc.report_confirm_s <= 2 * node_message_interval_s(rc):
        raise ConfigError(
            f"recover.report_confirm_s must be more than {2 * node_message_interval_s(rc):g}s, twice the node "
            f"message interval (a healthy replica's beats reach the coordinator up to two intervals late "
            f"and it would be fenced), got {rc.report_confirm_s}"
        )


def _check_rebalancing(rc: Recover) -> None:
    for key in ("speed_smoothing", "rebalance_threshold"):
        if not 0 < getattr(rc, key) <= 1:
            raise ConfigError(f"recover.{key} must be in (0, 1], got {getattr(rc, key)}")


def _check_coordinator_port(rc: Recover) -> None:
    if not 0 <= rc.coordinator_port < 65536:
        raise ConfigError(f"recover.coordinator_port out of range: {rc.coordinator_port}")


_BIND_FIX = (
    "set it to this node's address on the network the other nodes share (an IPv4 address or a host name), "
    '0.0.0.0 for every interface, or "" for loopback (a run on one node)'
)


def _check_coordinator_bind(rc: Recover) -> None:
    if not rc.coordinator_bind:
        return
    try:
        parse_host(rc.coordinator_bind)
    except ValueError as e:
        raise ConfigError(f"recover.coordinator_bind: {e}; {_BIND_FIX}") from None


def check_coordinator_bind(rc: Recover) -> None:
    """The launcher that starts the coordinator checks that this host can listen on ``coordinator_bind``
    before it starts anything; other nodes are given the same TOML and never listen there."""
    if not rc.coordinator_bind:
        return
    try:
        check_bindable(rc.coordinator_bind)
    except ValueError as e:
        raise ConfigError(f"recover.coordinator_bind = {rc.coordinator_bind!r}: {e}; {_BIND_FIX}") from None


_STATUS_FIX = "set recover.status_port to a free port (e.g. 8765), or 0 for no status page"


def _check_status_page(rc: Recover) -> None:
    if not 0 <= rc.status_port < 65536:
        raise ConfigError(f"recover.status_port out of range: {rc.status_port}; {_STATUS_FIX}")
    try:
        parse_host(rc.status_bind)
    except ValueError as e:
        raise ConfigError(
            f"recover.status_bind: {e}; name an IPv4 address of this host, 127.0.0.1 or 0.0.0.0"
        ) from None


def check_status_page(rc: Recover, port: bool = True) -> None:
    """Before anything starts: the status page can listen where it is asked to (its address resolves
    to one of this host's, and, with ``port``, the port is free). A launcher checks it where a
    coordinator may lead."""
    if not rc.status_port:
        return
    try:
        ip = check_bindable(rc.status_bind)
    except ValueError as e:
        raise ConfigError(
            f"recover.status_bind = {rc.status_bind!r}: {e}; name an address of this host, 127.0.0.1 or 0.0.0.0"
        ) from None
    if not port:
        return
    try:
        check_port_free(ip, rc.status_port)
    except OSError as e:
        raise ConfigError(
            f"recover.status_port = {rc.status_port}: cannot listen on {ip}:{rc.status_port} "
            f"({e.strerror}); {_STATUS_FIX}"
        ) from None


def _check_control_store(rc: Recover) -> None:
    if not rc.control_store:
        return
    try:
        (parse_nodes_url if rc.control_store.startswith(NODES_SCHEME) else parse_etcd_url)(rc.control_store)
    except ValueError as e:
        raise ConfigError(
            f'recover.control_store: {e}; use "" (the coordinator\'s own TCPStore), '
            '"etcd://host:port,host:port,host:port" or "nodes://host,host,host" (etcd members on those nodes)'
        ) from None


def _check_leader_lease(rc: Recover) -> None:
    if not 2 <= rc.leader_lease_s < rc.coordinator_timeout_s:
        raise ConfigError(
            f"recover.leader_lease_s must be >= 2 (etcd's shortest lease) and below "
            f"recover.coordinator_timeout_s, got {rc.leader_lease_s} and {rc.coordinator_timeout_s}"
        )


def _check_warm(rc: Recover) -> None:
    if rc.warm not in WARM:
        raise ConfigError(f"recover.warm must be one of {', '.join(WARM)}, got {rc.warm!r}")


def _check_replace(rc: Recover) -> None:
    if rc.replace not in REPLACE:
        raise ConfigError(f"recover.replace must be one of {', '.join(REPLACE)}, got {rc.replace!r}")


def _check_backend(rc: Recover) -> None:
    if rc.replicate_backend not in BACKENDS:
        raise ConfigError(
            f"recover.replicate_backend must be one of {', '.join(BACKENDS)}, got {rc.replicate_backend!r}"
        )
    if rc.nccl_rank_per_host and rc.group_nodes > 1:
        raise ConfigError(
            f"recover.nccl_rank_per_host is for one node (ranks pose as hosts over loopback), and "
            f"recover.group_nodes = {rc.group_nodes}: unset it"
        )


def _check_policy(rc: Recover) -> None:
    try:
        workload.get_policy(rc.policy)
    except workload.WorkloadError as e:
        raise ConfigError(f"recover.policy: {e}") from e


def _parse_fault_plan(rc: Recover) -> tuple[fault_plan.Fault, ...]:
    try:
        return fault_plan.parse_fault_plan(rc.fault_plan)
    except fault_plan.FaultPlanError as e:
        raise ConfigError(f"recover.fault_plan: {e}") from e


def check_experts_faults(rc: Recover, model: str, has_experts: bool) -> None:
    """A ``phase=experts`` fault fires in a mixture-of-experts layer: ``model`` (its name and flavor,
    for the message) must have one, or the fault would never fire."""
    if has_experts or not any(f.phase == "experts" for f in _parse_fault_plan(rc)):
        return
    raise ConfigError(
        f"recover.fault_plan: phase=experts fires inside a mixture-of-experts layer, and {model} has none: "
        "choose phase=forward or backward, or a flavor with experts"
    )


def _check_degrees(rc: Recover, par: Any) -> None:
    replicas, shards = par.data_parallel_replicate_degree, par.data_parallel_shard_degree
    if replicas < 1:
        raise ConfigError(f"parallelism.data_parallel_replicate_degree must be >= 1, got {replicas}")
    if shards < 1:
        raise ConfigError(
            f"parallelism.data_parallel_shard_degree must be set explicitly (>= 1) with titan_recover, got {shards}"
        )
    if rc.min_replicas > replicas:
        raise ConfigError(
            f"recover.min_replicas ({rc.min_replicas}) is more than "
            f"parallelism.data_parallel_replicate_degree ({replicas})"
        )
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree"):
        if getattr(par, key) < 1:
            raise ConfigError(f"parallelism.{key} must be >= 1, got {getattr(par, key)}")


DERIVED = -1
"""TorchTitan's default ``training.global_batch_size``: ``local_batch_size`` times the data-parallel degree."""


def _derive_global_batch(job_config: Any) -> None:
    """TorchTitan's ``global_batch_size = -1`` (its default: no gradient accumulation) becomes what it
    means, ``local_batch_size`` x dp_shard x dp_replicate: M = R microbatches, one per replica group."""
    tr, par = job_config.training, job_config.parallelism
    if tr.global_batch_size != DERIVED or tr.local_batch_size < 1:
        return
    tr.global_batch_size = tr.local_batch_size * par.data_parallel_shard_degree * par.data_parallel_replicate_degree
    log.info(
        f"training.global_batch_size = -1 (TorchTitan's default: local_batch_size x the data-parallel degree, no "
        f"gradient accumulation) is {tr.global_batch_size}: M = {par.data_parallel_replicate_degree} microbatches "
        "per step, one per replica group; set it to a multiple of that for more"
    )


def _check_training(tr: Any) -> None:
    for key in _TRAINING_COUNTS:
        if getattr(tr, key) < 1:
            raise ConfigError(f"training.{key} must be an integer >= 1, got {getattr(tr, key)}")


def _check_group_nodes(rc: Recover, par: Any) -> None:
    if group_ranks(par) % rc.group_nodes:
        raise ConfigError(
            f"recover.group_nodes ({rc.group_nodes}) must divide the ranks of a replica group evenly "
            f"(dp_shard x tp x pp = {group_ranks(par)}): every node of a group runs the same number of them"
        )


def _check_fault_plan(plan: tuple[fault_plan.Fault, ...], job_config: Any) -> None:
    """Every fault must be able to fire: one that never does would pass a test silently."""
    for f in plan:
        _check_fault_target(f, job_config)
        _check_fault_join(f, job_config)
        _check_fault_step(f, job_config.training.steps)
        _check_fault_incarnation(f, job_config.recover.max_restarts)
        _check_fault_flip(f, job_config.recover)


def _check_fault_flip(f: fault_plan.Fault, rc: Recover) -> None:
    if f.action == "flip" and not (rc.enable and rc.exact):
        raise ConfigError(
            f"recover.fault_plan: 'flip replica={f.replica}' flips a microbatch's own gradient before it is summed, "
            "which only exact mode holds apart (elsewhere the backward adds it into the step's at once): set "
            "--recover.exact"
        )


def _check_fault_target(f: fault_plan.Fault, job_config: Any) -> None:
    ids, ranks = replica_ids(job_config), group_ranks(job_config.parallelism)
    if f.replica >= ids or f.rank >= ranks:
        raise ConfigError(
            f"recover.fault_plan: '{f.action} replica={f.replica} rank={f.rank}' names no rank: "
            f"the job has {ids} replica groups "
            f"(0..{ids - 1}{', spares included' if job_config.recover.spares else ''}) "
            f"of {ranks} ranks (0..{ranks - 1})"
        )


def _check_fault_join(f: fault_plan.Fault, job_config: Any) -> None:
    if f.phase == "join" and f.incarnation == 0 and not is_spare(f.replica, job_config):
        raise ConfigError(
            f"recover.fault_plan: '{f.action} replica={f.replica} phase=join attempt=0' can never fire: replica "
            f"{f.replica} starts as a member and joins only once restarted (attempt >= 1); only a hot spare "
            f"(replica {job_config.parallelism.data_parallel_replicate_degree}..{replica_ids(job_config) - 1}) "
            "joins in its first incarnation"
        )


def _check_fault_step(f: fault_plan.Fault, steps: int) -> None:
    if f.step is not None and f.step > steps:
        raise ConfigError(
            f"recover.fault_plan: '{f.action} replica={f.replica} step={f.step}' can never fire: "
            f"the run ends at training.steps = {steps}"
        )


def _check_fault_incarnation(f: fault_plan.Fault, max_restarts: int) -> None:
    # with restarts counted per window any incarnation can come in a long enough run; with none, only incarnation 0
    if f.incarnation > 0 and max_restarts == 0:
        raise ConfigError(
            f"recover.fault_plan: '{f.action} replica={f.replica} phase={f.phase} attempt={f.incarnation}' can "
            "never fire: recover.max_restarts = 0 allows no restart, so only attempt 0 ever runs"
        )


def cuda_graphs(job_config: Any) -> bool:
    """Whether TorchTitan replays each microbatch's forward and backward as a CUDA graph (0.3's default
    on NVIDIA GPUs; TorchTitan 0.2 has no such setting)."""
    enabled = not getattr(job_config.training, "disable_cuda_graphs", True)
    return enabled and torch.cuda.is_available() and torch.version.hip is None


def _check_faults_outside_cuda_graphs(plan: tuple[fault_plan.Fault, ...], graphed: bool) -> None:
    """A graph replay runs no Python hooks: a forward/backward fault would fire at capture or never."""
    for f in plan:
        if graphed and f.phase in ("forward", "backward"):
            raise ConfigError(
                f"recover.fault_plan: '{f.action} replica={f.replica} phase={f.phase}' can never fire inside a "
                "CUDA graph replay; set --training.disable_cuda_graphs, or use phase=allreduce or optimizer"
            )


def _check_exact(rc: Recover, par: Any) -> None:
    if rc.exact and (par.tensor_parallel_degree != 1 or par.pipeline_parallel_degree != 1):
        raise ConfigError(
            "recover.exact needs replica groups of FSDP ranks only: parallelism.tensor_parallel_degree = "
            f"{par.tensor_parallel_degree} and parallelism.pipeline_parallel_degree = {par.pipeline_parallel_degree} "
            "must both be 1 (their sums inside a group are not made order-free), or set recover.exact = false"
        )


def _check_sdc(rc: Recover) -> None:
    if rc.sdc_check and not (rc.enable and rc.exact):
        raise ConfigError(
            "recover.sdc_check compares two replica groups' gradients of one microbatch bit for bit, which only "
            "exact mode makes the same on every group (elsewhere the kernels' sums may differ in their last bits, "
            "and a check could not tell a bad device from rounding): set --recover.exact, or recover.sdc_check = false"
        )
    if not 0.0 < rc.sdc_check_rate <= 1.0:
        raise ConfigError(
            f"recover.sdc_check_rate = {rc.sdc_check_rate!r}: the share of steps checked, in (0, 1] "
            "(turn the checks off with recover.sdc_check = false)"
        )


def _check_context_parallel(par: Any) -> None:
    if par.context_parallel_degree != 1:
        raise ConfigError(
            f"parallelism.context_parallel_degree must be 1 with titan_recover (got {par.context_parallel_degree}): "
            "context parallelism inside a replica group is not supported yet"
        )


def _check_batch(job_config: Any) -> None:
    tr, par = job_config.training, job_config.parallelism
    per_microbatch = tr.local_batch_size * par.data_parallel_shard_degree
    replicas = par.data_parallel_replicate_degree
    if tr.global_batch_size % (per_microbatch * replicas):
        raise ConfigError(
            f"training.global_batch_size ({tr.global_batch_size}) must be a "
            "multiple of training.local_batch_size * data_parallel_shard_degree * "
            f"data_parallel_replicate_degree ({per_microbatch * replicas})"
        )
    most, rc = max_members(job_config), job_config.recover
    if rc.max_replicas and rc.max_replicas < replicas:
        raise ConfigError(
            f"recover.max_replicas ({rc.max_replicas}) is below parallelism.data_parallel_replicate_degree "
            f"({replicas}): set it to 0 (a fixed R) or to R or more"
        )
    if most > num_microbatches(job_config):
        raise ConfigError(
            f"recover.max_replicas ({most}) is more than the {num_microbatches(job_config)} microbatches of a step "
            "(training.global_batch_size / (local_batch_size * data_parallel_shard_degree)): a member would idle"
        )


def resume_hint(job_config: Any, dump_folder: str) -> str:
    """What to do after the run stopped for good: the DCP checkpoint (under ``dump_folder``) is the backstop."""
    ckpt = job_config.checkpoint
    if ckpt.enable:
        where = os.path.join(dump_folder, ckpt.folder)
        return f"To resume, run the same command again: TorchTitan resumes from the last checkpoint in {where}"
    return (
        "To resume, run the same command again; [checkpoint] enable = false, so the run starts over "
        "(enable checkpoints to resume where it stopped)"
    )


def stop_folder(job_config: Any, dump_folder: str) -> str:
    """Where the groups that stop in order save the state of the stop's step (``rank.snapshot`` files, one copy
    per shard), DCP checkpoints on or off: beside TorchTitan's ``step-N`` folders, which it never reads."""
    return os.path.join(dump_folder, job_config.checkpoint.folder, "stop")


def stop_hint(job_config: Any, dump_folder: str) -> str:
    """What to do after the run stopped in order: the same command resumes from the state saved at the stop."""
    return (
        "To resume, run the same command again: it resumes from the state saved at the stop in "
        f"{stop_folder(job_config, dump_folder)}"
    )


def started_ids(job_config: Any) -> int:
    """How many replica groups the run starts (ids 0 .. n-1): the first ``data_parallel_replicate_degree``
    are the members of epoch 0, the rest hot spares."""
    return job_config.parallelism.data_parallel_replicate_degree + job_config.recover.spares


def max_members(job_config: Any) -> int:
    """The most replica groups that may be members at once (``recover.max_replicas``, 0 meaning R)."""
    return job_config.recover.max_replicas or job_config.parallelism.data_parallel_replicate_degree


def replica_ids(job_config: Any) -> int:
    """How many replica ids the run has (0 .. n-1): the groups it starts, and the ids up to
    ``recover.max_replicas`` that nodes started later may bring."""
    return max(started_ids(job_config), max_members(job_config))


def is_spare(replica: int, job_config: Any) -> bool:
    """Whether ``replica`` starts as a hot spare, outside the members of epoch 0."""
    return replica >= job_config.parallelism.data_parallel_replicate_degree


def group_ranks(par: Any) -> int:
    """Ranks in one replica group: its TorchTitan world, dp_shard x tp x pp."""
    return par.data_parallel_shard_degree * par.tensor_parallel_degree * par.pipeline_parallel_degree


def group_coordinates(rank: int, par: Any) -> tuple[int, int]:
    """(replica, rank inside its group) of a global rank of the stock HSDP world.

    TorchTitan lays the world out as (pp, dp_replicate, dp_shard, tp); a replica group's
    own world is (pp, dp_shard, tp), so a rank keeps its (pp, dp_shard, tp) coordinate.
    """
    tp, shards, replicas = (
        par.tensor_parallel_degree,
        par.data_parallel_shard_degree,
        par.data_parallel_replicate_degree,
    )
    rest, t = divmod(rank, tp)
    rest, s = divmod(rest, shards)
    p, r = divmod(rest, replicas)
    return r, (p * shards + s) * tp + t


def reports_data(group_rank: int, par: Any) -> bool:
    """Whether this rank speaks for its data shard in the step tally: with TP every rank of
    a shard reads the same microbatch, and with PP only the last stage has the loss."""
    tp, shards = par.tensor_parallel_degree, par.data_parallel_shard_degree
    stage = group_rank // (shards * tp)
    return group_rank % tp == 0 and stage == par.pipeline_parallel_degree - 1


def num_microbatches(job_config: Any) -> int:
    """M: global microbatches per step; one microbatch is local_batch_size samples on each shard."""
    tr, par = job_config.training, job_config.parallelism
    return tr.global_batch_size // (tr.local_batch_size * par.data_parallel_shard_degree)
