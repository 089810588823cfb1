"""``python -m titan_recover.launch --check`` (``./run_train.sh --check``): what a run of the job would do on this
node, or each problem that would stop it, with nothing started.

The launcher's own checks, in its order and with its functions (the torch release, the config, this node's part
of the run, the control store, the GPUs and the replicate backend, the preflight, the data), each problem
collected instead of ending the check; then what they decided, printed: R, M and each group's failure-free quota,
the timeouts, the control store, the backend and NCCL settings, the GPUs, the groups on this node, the host-memory
snapshots (how often, how many, their folder's filesystem and its room), the node's failure domain, the data and
how much of it the run reads. No process, process group or training: the store's checks bind a port and close it,
the data check reads the first microbatch. Exit 0 where the launcher would start the run, 2 where not.
"""

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_recover import config, titan
from titan_recover.control import transport
from titan_recover.control.addresses import LOOPBACK
from titan_recover.control.keys import (
    COORDINATOR_ENV,
    EXIT_BAD_INPUT,
    EXIT_OK,
    FAILURE_DOMAIN_ENV,
    GROUP_NODE_ENV,
    REPLICAS_ENV,
    RUN_ENV,
)
from titan_recover.data.tokens import DataError
from titan_recover.launch import launcher, preflight
from titan_recover.launch.stores import store_of
from titan_recover.node import devices, memory, warm
from titan_recover.policy import workload

FLAG = "--check"
NCCL_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES")
"""The environment the check shows as it is: what NCCL, gloo and the GPUs' placement read."""


@dataclass
class Report:
    """What the run would do (``lines``, each a label and its text) and what stops it (``problems``, each
    naming the key or variable to change)."""

    lines: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def add(self, label: str, text: str) -> None:
        self.lines.append((label, text))

    def render(self, job: str) -> str:
        width = max((len(label) for label, _ in self.lines), default=0)
        out = [f"check of {job} on this node:"]
        out += [f"  {label:<{width}} : {text}" for label, text in self.lines]
        if self.problems:
            out.append(f"{len(self.problems)} problem(s), each naming what to change:")
            out += [f"  - {problem}" for problem in self.problems]
            out.append("verdict: the launcher would stop before starting anything (exit 2)")
        else:
            out.append("verdict: the launcher would start this run (exit 0); ./run_train.sh without --check runs it")
        return "\n".join(out)


def layout(job_config: Any) -> list[tuple[str, str]]:
    """R, the groups' ranks, M and each group's failure-free quota, as the coordinator hands them out."""
    tr, par, rc = job_config.training, job_config.parallelism, job_config.recover
    replicas, m = par.data_parallel_replicate_degree, config.num_microbatches(job_config)
    quotas = workload.get_policy(rc.policy)(tuple(range(replicas)), m, None)
    extra = [f"{rc.spares} hot spare(s)"] if rc.spares else []
    extra += [f"up to {config.max_members(job_config)} members (recover.max_replicas)"] if rc.max_replicas else []
    return [
        (
            "replica groups",
            f"R = {replicas} (parallelism.data_parallel_replicate_degree), each {config.group_ranks(par)} ranks "
            f"(dp_shard {par.data_parallel_shard_degree} x tp {par.tensor_parallel_degree} x pp "
            f"{par.pipeline_parallel_degree})" + "".join(f"; {e}" for e in extra),
        ),
        (
            "microbatches",
            f"M = global_batch_size / (local_batch_size x data_parallel_shard_degree) = {tr.global_batch_size} / "
            f"({tr.local_batch_size} x {par.data_parallel_shard_degree}) = {m} per step, every step, whoever fails",
        ),
        ("quotas", f"failure-free, policy {rc.policy}: " + ", ".join(f"replica {r}: {q}" for r, q in quotas.items())),
        (
            "steps",
            f"{tr.steps:,} (training.steps), {tr.global_batch_size * tr.seq_len:,} tokens each; injected faults: "
            + ("none" if rc.fault_plan == "none" else f"{rc.fault_plan} (recover.fault_plan)"),
        ),
    ]


def timeouts(rc: config.Recover, in_group_s: float | None) -> str:
    """The bounds a failure meets, innermost first (``in_group_s``: TorchTitan's, as the preflight leaves it)."""
    group = "" if in_group_s is None else f", TorchTitan's in-group collectives {in_group_s:g}s"
    lease = f", etcd leader lease {rc.leader_lease_s:g}s" if rc.control_store else ""
    return (
        f"heartbeat every {rc.heartbeat_interval_s:g}s, a silent rank failed after {rc.heartbeat_timeout_s:g}s "
        f"(detection), replicate collective {rc.collective_timeout_s:g}s{group}; notice budget "
        f"{rc.notice_budget_s:g}s, coordinator {rc.coordinator_timeout_s:g}s{lease}, startup "
        f"{rc.startup_timeout_s:g}s, progress {rc.progress_timeout_s:g}s"
    )


def control_store(rc: config.Recover, address: str | None, bind: str) -> str:
    """Where the run's control state lives, as this node's launcher would reach it."""
    if rc.control_store:
        return (
            f"etcd at {rc.control_store}: a coordinator candidate beside this launcher, one leads on a lease "
            f"({RUN_ENV} names the run)"
        )
    if address is not None:
        now = (
            " (nothing listens there now: the launcher waits recover.startup_timeout_s for it)"
            if transport.connection_refused(address)
            else ""
        )
        return f"the TCPStore of the coordinator at {address} ({COORDINATOR_ENV}), started by another node{now}"
    port = f"port {rc.coordinator_port}" if rc.coordinator_port else "a free port (recover.coordinator_port = 0)"
    return f"TCPStore: this launcher starts the coordinator, listening on {bind}, {port}"


def nccl_settings(checked: preflight.Preflight, env: Mapping[str, str]) -> str:
    """What the ranks get from the preflight, and the environment NCCL, gloo and placement read, as it is."""
    given = [f"{k}={v}" for k, v in checked.env.items()] + [f"{k} {v}" for k, v in checked.flags.items()]
    found = [f"{k}={v}" for k, v in sorted(env.items()) if k.startswith(NCCL_ENV_PREFIXES)]
    return (
        f"the ranks get {', '.join(given) or 'nothing added'}; the environment has "
        f"{', '.join(found) or 'no NCCL_*, TORCH_NCCL_*, GLOO_SOCKET_IFNAME or CUDA_VISIBLE_DEVICES'}"
    )


def gpus_seen(env: Mapping[str, str]) -> str:
    """The GPUs the launcher may hand out on this host (``CUDA_VISIBLE_DEVICES`` narrows them)."""
    gpus = devices.host_gpus(env.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
    if not gpus:
        return "none: the ranks run on the CPU (gloo, float32 unless the job names a precision)"
    return f"{len(gpus)} ({', '.join(gpus)}), {torch.cuda.get_device_name(0)}"


def snapshots(rc: config.Recover) -> str:
    """Host-memory snapshots as this node's launcher would keep them: how often, how many, and the filesystem its
    folder would be on with the room there."""
    if not rc.snapshot_interval:
        return "off (recover.snapshot_interval = 0): losing every group at once goes back to the last checkpoint"
    under = memory.root(rc.snapshot_dir)
    head = (
        f"every {rc.snapshot_interval} committed steps (recover.snapshot_interval), {rc.snapshot_keep} kept per "
        f"shard besides the one being written (recover.snapshot_keep)"
    )
    if not os.path.isdir(under):
        return f"{head}; {under} is not a directory on this node"
    kind = memory.filesystem(under) or "filesystem unknown"
    disk = "" if kind == "tmpfs" else ", not tmpfs: the copies would be written to disk"
    free = shutil.disk_usage(under).free
    return f"{head}; each launcher's folder under {under} ({kind}{disk}), {free:,} bytes ({free / 2**30:.1f} GiB) free"


def failure_domain(rc: config.Recover, env: Mapping[str, str], report: Report) -> str:
    """This node's failure domain as its launcher's claims would carry it, and where it comes from; a name the
    launcher refuses is a problem (once: ``NodeLauncher``'s own refusal may name it too)."""
    try:
        domain = config.failure_domain(rc, env)
    except config.ConfigError as e:
        if str(e) not in report.problems:
            report.problems.append(str(e))
        return "refused (below)"
    unused = "" if rc.snapshot_interval else " (not used: recover.snapshot_interval = 0)"
    if not domain:
        return (
            f"unknown: set {FAILURE_DOMAIN_ENV} (under Slurm node.sh takes it from SLURM_TOPOLOGY_ADDR) or "
            "[recover] failure_domain, and the coordinator warns when every host-memory copy of a shard sits in "
            "one domain" + unused
        )
    source = FAILURE_DOMAIN_ENV if env.get(FAILURE_DOMAIN_ENV, "").strip() else "recover.failure_domain"
    return f"{domain!r} ({source})" + unused


def check_node(node: "launcher.NodeJob", argv: list[str], report: Report) -> None:
    """This node's part of a ``[recover] enable = true`` run: what ``NodeLauncher`` would decide, shown, and its
    refusal (the first of: the device plan, the preflight's refusals, the secret, the run id) as a problem."""
    job_config, rc, env = node.job_config, node.job_config.recover, os.environ
    replicas, ranks = config.replica_ids(job_config), config.group_ranks(job_config.parallelism) // rc.group_nodes
    groups = node.local if isinstance(node.local, int) else len(node.local)
    which = (
        f"{groups} free replica id(s) it asks the run for ({REPLICAS_ENV}={env[REPLICAS_ENV]})"
        if isinstance(node.local, int)
        else f"replica groups {node.local} of 0..{replicas - 1}"
        + ("" if REPLICAS_ENV in env else f" ({REPLICAS_ENV} unset: the run's own)")
    )
    spans = f"; part {node.part} ({GROUP_NODE_ENV}) of groups spanning {rc.group_nodes} nodes"
    report.add(
        "this node",
        f"{which}, {ranks} ranks of each here: {groups * ranks} ranks" + (spans if rc.group_nodes > 1 else ""),
    )
    bind, said = rc.coordinator_bind or LOOPBACK, None
    try:
        said = store_of(rc).check(rc, node.address)
        if node.address is None and not rc.control_store and isinstance(node.local, list):
            bind = launcher.coordinator_bind(rc.coordinator_bind, node.local, replicas, rc.group_nodes)
    except config.ConfigError as e:
        report.problems.append(str(e))
    report.add("control store", control_store(rc, node.address, bind) + (f"; {said}" if said else ""))
    report.add("GPUs seen", gpus_seen(env))
    try:
        plan: devices.DevicePlan | None = launcher.device_plan(rc, groups, ranks)
    except config.ConfigError:
        plan = None  # NodeLauncher's own refusal below names it
    if plan is not None:
        placed = "" if plan.visible[0] is None else f"; GPUs per group: {' | '.join(map(str, plan.visible))}"
        report.add("replicate backend", f"{plan.backend} ({plan.reason}){placed}")
        checked = preflight.on_this_node(job_config, plan.backend, env)
        raised = checked.flags.get(preflight.IN_GROUP_FLAG)
        in_group = preflight.comm_facts(job_config).get("train_timeout_seconds", (None, None))[0]
        report.add("timeouts", timeouts(rc, float(raised) if raised else in_group))
        report.add("NCCL settings", nccl_settings(checked, env))
        report.lines += [("preflight", f"{f.level}: {f.rule}: {f.text}") for f in checked.findings]
    try:
        launcher.NodeLauncher(job_config, argv, node.local, node.address, node.part)
    except config.ConfigError as e:
        report.problems.append(str(e))
    why = warm.off_because(
        rc.warm, rc.group_nodes > 1, warm.host_available_bytes(), os.cpu_count() or 1, groups * ranks, groups * ranks
    )
    report.add("warm restarts", f"off ({why})" if why else "on: each group's next incarnation waits imported")
    report.add("snapshots", snapshots(rc))
    report.add("failure domain", failure_domain(rc, env, report))


def check_data(job_config: Any, report: Report) -> None:
    """The job's tokenizer and dataset folder, each problem on its own, then the data as the launcher checks it."""
    from titan_recover.data import addressing

    problems = len(report.problems)
    try:
        addressing.check_tokenizer_folder(titan.assets_path(job_config), titan.ASSETS_KEY)
    except DataError as e:
        report.problems.append(str(e))
    try:
        folder = addressing.dataset_folder(job_config)
    except DataError as e:
        report.problems.append(str(e))
        return
    if folder is None:
        report.add(
            "data",
            f"the synthetic corpus, prepared at {titan.dataset(job_config)[1] or addressing.DEFAULT_SYNTHETIC_DIR} "
            f"by the run's first launch ({addressing.SYNTHETIC_TOKENS:,} tokens, under a minute)",
        )
    elif len(report.problems) == problems:
        try:
            report.add("data", addressing.check_data(job_config).removeprefix("data: "))
        except DataError as e:
            report.problems.append(str(e))


def check(argv: list[str]) -> tuple[str, Report]:
    """The job of ``argv`` (the launcher's command line, ``--check`` taken out) on this node: its name and report."""
    report = Report()
    supported = preflight.torch_finding(torch.__version__, os.path.dirname(torch.__file__), os.environ)
    report.add("torch", f"{supported.level}: {supported.text}; TorchTitan line {titan.LINE}")
    if supported.level == preflight.REFUSE:  # the launcher stops here, before TorchTitan's import
        report.problems.append(supported.text)
        return "the job", report
    try:
        node = launcher.node_job(argv, os.environ)
    except config.ConfigError as e:
        report.problems.append(str(e))
        return "the job", report
    job_config = node.job_config
    report.lines += layout(job_config)
    if job_config.recover.enable:
        check_node(node, argv, report)
    else:
        par, rc = job_config.parallelism, job_config.recover
        world = par.data_parallel_replicate_degree * config.group_ranks(par)
        report.add(
            "stock",
            f"[recover] enable = false: stock TorchTitan HSDP, {world} ranks in one torchrun world, the whole job "
            "restarted from its last checkpoint up to "
            f"{rc.max_restarts} times in {rc.restart_window_s:g}s",
        )
        report.add("GPUs seen", gpus_seen(os.environ))
    check_data(job_config, report)
    return titan.config_file(job_config) or "the job", report


def main(argv: list[str]) -> int:
    """``python -m titan_recover.launch --check ARGV``: prints the report; 0 where the run would start, else 2.
    No ``logs.setup``: the report says what the launcher would log, and warnings still reach stderr."""
    job, report = check([a for a in argv if a != FLAG])
    print(report.render(job), flush=True)
    return EXIT_BAD_INPUT if report.problems else EXIT_OK
