"""The preflight: before a run trusts NCCL to abort and the replicate dimension to re-form, it checks
the torch and NCCL releases, the PyTorch NCCL settings of the environment and the timeouts against each other.

Pure decisions from facts (the torch and NCCL versions, the environment, the ``[recover]`` keys, TorchTitan's
``[comm]`` keys, whether the snapshot folder's directory is here), so every rule is unit-tested without a GPU. The
launcher runs it on every run and logs each finding (the torch release first, before it reads the job); a refusal
stops it with exit 2 naming the setting, and ``TITAN_RECOVER_PREFLIGHT=warn`` turns refusals into warnings for an
operator who knows better.
The self-test prints the same findings.

The timeout hierarchy, innermost first (each bound must end before the next one starts to matter):

    heartbeat_timeout_s   a silent rank is declared failed (detect)
    collective_timeout_s  a replicate collective or rendezvous gives up on a peer
    comm.train_timeout_seconds
                          TorchTitan's in-group collectives: a rank waits in them while a groupmate's
                          replicate collective waits out a failed peer, so this must outlast the two above
"""

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

REFUSE, WARN, OK = "refuse", "warn", "ok"
OVERRIDE_ENV = "TITAN_RECOVER_PREFLIGHT"
TRUE, FALSE = ("1", "y", "yes", "t", "true"), ("0", "n", "no", "f", "false")  # c10d's getCvarBool
PG_NCCL = "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp (torch 2.11)"
DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
TRACE_BUF_FLAG = "--comm.trace_buf_size"
IN_GROUP_FLAG = "--comm.train_timeout_seconds"
KILLS_SURVIVORS = (
    "every failure of a replicate group sets ProcessGroupNCCL::shouldDump_, a process-wide flag never reset "
    "(Watchdog::runLoop -> broadcastDumpSignal), and the heartbeat monitor of the process's first NCCL group "
    "(TorchTitan's default group) acts on it when that group was made with TORCH_NCCL_DUMP_ON_TIMEOUT on: it "
    "dumps, waits TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (480 s) and aborts the process, so every survivor of a "
    "replicate failure would be killed 8 minutes later"
)


SUPPORTED_TORCH = ((2, 11), (2, 15))
"""The torch releases titan_recover supports, (major, minor) from the first included to the first excluded: what
it has run on, 2.11 (one H200, TorchTitan 0.2.2), 2.13.0 (TorchTitan 0.2.2's pin, every CI run) and 2.14.1
(TorchTitan 0.3.0's pin), and 2.12 between them. Below 2.11 nothing ran, and this module's NCCL rules are read
from torch 2.11's ProcessGroupNCCL; from 2.15 (its pre-releases included, as containers ship them) that code may
have moved. What would break is failure handling, which a failure-free run never exercises: the launcher refuses
outside the range (``OVERRIDE_ENV`` turns it into a warning) rather than fail at the first fault hours in."""
TORCH_FIX = (
    "./run_train.sh makes ./.venv with torch 2.13.0 (TorchTitan 0.2.2) or ./.venv-0.3.0 with 2.14.1 "
    "(TORCHTITAN=0.3.0); an environment of your own needs a torch in that range"
)


@dataclass(frozen=True)
class Finding:
    level: str  # REFUSE, WARN or OK
    rule: str  # what was checked, e.g. "nccl-version"
    text: str
    source: str = ""  # where the rule comes from (an issue, a measurement)

    def line(self) -> str:
        return f"preflight {self.level}: {self.rule}: {self.text}" + (f" [{self.source}]" if self.source else "")


@dataclass(frozen=True)
class Timeouts:
    """The bounds a recovery meets, from the ``[recover]`` keys and TorchTitan's comm section."""

    detect_s: float
    collective_s: float
    in_group_s: float | None  # None: this TorchTitan line has no such key

    @property
    def survivor_wait_s(self) -> float:
        """The longest a surviving rank may wait in its group for a groupmate still in a replicate collective."""
        return self.collective_s + self.detect_s

    def line(self) -> str:
        group = "" if self.in_group_s is None else f" < in-group collectives {self.in_group_s:g}s"
        return (
            f"timeouts: detect {self.detect_s:g}s < replicate collective {self.collective_s:g}s "
            f"(a survivor waits up to {self.survivor_wait_s:g}s){group}"
        )


@dataclass
class Preflight:
    findings: list[Finding] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # settings the launcher adds for the ranks (unset ones only)
    flags: dict[str, str] = field(
        default_factory=dict
    )  # job flags the launcher adds (values the user left at the default)

    @property
    def refusals(self) -> list[Finding]:
        return [f for f in self.findings if f.level == REFUSE]


def timeouts(rc: Any, in_group_s: float | None) -> Timeouts:
    return Timeouts(detect_s=rc.heartbeat_timeout_s, collective_s=rc.collective_timeout_s, in_group_s=in_group_s)


# (lowest bad, highest bad, why, source): releases whose abort is known to hang or crash
BAD_NCCL: tuple[tuple[tuple[int, int, int], tuple[int, int, int], str, str], ...] = (
    (
        (0, 0, 0),
        (2, 26, 1),
        "ncclCommAbort can hang (fixed in NCCL 2.26.2): a survivor aborting a broken "
        "replicate communicator would wedge",
        "pytorch/pytorch#149153",
    ),
    (
        (2, 28, 3),
        (2, 28, 8),
        "NVIDIA's resiliency tooling advises against these releases for aborting and "
        "re-forming communicators in a live process",
        "NVIDIA/nvidia-resiliency-ext, as cited by titan_recover issue 41",
    ),
)
SHRINK_HANG_FROM = (2, 31, 2)  # ncclCommShrink then abort and destroy hangs: pytorch/pytorch#194679


def nccl_version_finding(version: tuple[int, int, int]) -> Finding:
    text = ".".join(map(str, version))
    for low, high, why, source in BAD_NCCL:
        if low <= version <= high:
            return Finding(
                REFUSE,
                "nccl-version",
                f"NCCL {text}: {why}; use NCCL 2.26.2 or newer outside "
                "2.28.3-2.28.8 (a torch build bundling one, or NCCL's own package)",
                source,
            )
    shrink = (
        (
            " (its shrink-then-abort hang, pytorch/pytorch#194679, does not apply: titan_recover never shrinks "
            "a communicator, it builds a new one per epoch)"
        )
        if version >= SHRINK_HANG_FROM
        else ""
    )
    return Finding(OK, "nccl-version", f"NCCL {text}: no known abort defect{shrink}")


def flag(value: str | None) -> bool | None:
    """An environment flag as c10d reads it (``getCvarBool``): None where unset or not a flag."""
    low = (value or "").strip().lower()
    return True if low in TRUE else False if low in FALSE else None


def dump_on_timeout_finding(env: Mapping[str, str], out: Preflight) -> Finding:
    value = env.get(DUMP_ON_TIMEOUT)
    if value is None:
        out.env[DUMP_ON_TIMEOUT] = "0"
        return Finding(
            OK,
            DUMP_ON_TIMEOUT,
            "unset (torch's default is on): the ranks get 0, so TorchTitan's first NCCL group never acts on a "
            "replicate group's failure; NCCL flight-recorder dumps on a timeout are off (docs/gpus.md says how "
            "to have them in a debugging run)",
        )
    if flag(value) is False:
        return Finding(OK, DUMP_ON_TIMEOUT, f"{value!r}: off")
    return Finding(
        REFUSE,
        DUMP_ON_TIMEOUT,
        f"{value!r}: {KILLS_SURVIVORS}; unset it (titan_recover then sets 0)",
        f"{PG_NCCL}: HeartbeatMonitor::runLoop, checkDumpSignal = dumpOnTimeoutOrEx_ && uid 0",
    )


def trace_buffer_finding(trace_buf: tuple[float, float] | None, out: Preflight) -> Finding | None:
    """TorchTitan sets TORCH_NCCL_DUMP_ON_TIMEOUT=1 whenever its flight recorder is on
    (``comm.trace_buf_size`` > 0, by default 20000): left at the default it is turned off, set by the
    user it is refused."""
    rule = "comm.trace_buf_size"
    if trace_buf is None:
        return None
    value, default = trace_buf
    if value <= 0:
        return Finding(OK, rule, f"{value:g}: TorchTitan's flight recorder is off")
    why = (
        f"above 0, TorchTitan's init_distributed sets {DUMP_ON_TIMEOUT}=1 for its groups "
        "(torchtitan/distributed/utils.py), and "
    )
    if value == default:
        out.flags[TRACE_BUF_FLAG] = "0"
        return Finding(
            OK,
            rule,
            f"lowered from TorchTitan's default {value:g} to 0: {why}{KILLS_SURVIVORS}",
        )
    return Finding(
        REFUSE,
        rule,
        f"{value:g}: {why}{KILLS_SURVIVORS}; leave it at TorchTitan's default (titan_recover then sets 0) or set 0",
        f"{PG_NCCL}: HeartbeatMonitor::runLoop",
    )


def desync_debug_findings(env: Mapping[str, str]) -> list[Finding]:
    """Desync debugging is on for every NCCL group of a process where either setting asks for it; a
    group's timeout then runs the desync debugger, which reads its peers' keys from the group's store
    (the control plane's, for a replicate group, where a dead peer's never come), and no-handling
    error mode turns into tear-down."""
    why = (
        "turns on desync debugging in every NCCL group of the process (desyncDebug_, read in the "
        "ProcessGroupNCCL constructor): a replicate group's timeout then waits on a dead peer's trace keys in "
        "the control plane's store, every collective is timed with CUDA events, and error handling 0 becomes 3 "
        "(tear the process down)"
    )
    found = []
    if flag(env.get("TORCH_NCCL_DESYNC_DEBUG")):
        found.append(
            Finding(
                REFUSE,
                "TORCH_NCCL_DESYNC_DEBUG",
                f"{env['TORCH_NCCL_DESYNC_DEBUG']!r} {why}; unset it for a run with NCCL replicate groups",
                f"{PG_NCCL}: the constructor (desyncDebug_) and Watchdog::runLoop",
            )
        )
    if env.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL":
        found.append(
            Finding(
                REFUSE,
                "TORCH_DISTRIBUTED_DEBUG",
                f"DETAIL {why}; use INFO (or unset it) for a run with NCCL replicate groups",
                f"{PG_NCCL}: the constructor (dist_debug_level_ >= Detail)",
            )
        )
    return found


def nvls_finding(env: Mapping[str, str]) -> Finding:
    if env.get("NCCL_NVLS_ENABLE") == "0":
        return Finding(OK, "NCCL_NVLS_ENABLE", "0: no NVLink SHARP buffers per communicator")
    return Finding(
        WARN,
        "NCCL_NVLS_ENABLE",
        "NVLink SHARP is on where the node has it: each communicator takes "
        "multicast buffers, and titan_recover builds a new replicate communicator every epoch; set "
        "NCCL_NVLS_ENABLE=0 unless the self-test's memory check passed on this node with it on",
    )


def monitoring_finding(env: Mapping[str, str]) -> Finding | None:
    if env.get("TORCH_NCCL_ENABLE_MONITORING") != "0":
        return None
    return Finding(
        WARN,
        "TORCH_NCCL_ENABLE_MONITORING",
        "0: a rank whose NCCL abort hangs is then ended only by "
        "recover.progress_timeout_s, not by PyTorch's watchdog monitor",
    )


def timeout_finding(t: Timeouts, default_s: float | None, out: Preflight) -> Finding:
    """TorchTitan's in-group timeout against the survivors' wait: left at TorchTitan's default it is
    raised to twice that wait where it is shorter; set by the user it is refused there."""
    rule = "comm.train_timeout_seconds"
    if t.in_group_s is None:
        return Finding(OK, rule, t.line() + " (this TorchTitan line has no in-group timeout key)")
    if t.in_group_s > t.survivor_wait_s:
        return Finding(OK, rule, t.line())
    if t.in_group_s == default_s:
        raised = float(math.ceil(2 * t.survivor_wait_s))
        out.flags[IN_GROUP_FLAG] = str(int(raised))
        return Finding(
            OK,
            rule,
            f"raised from TorchTitan's default {t.in_group_s:g}s to {raised:g}s; "
            + Timeouts(t.detect_s, t.collective_s, raised).line(),
        )
    return Finding(
        REFUSE,
        rule,
        f"{t.in_group_s:g}s: a rank waits in its group's collectives while a groupmate's "
        f"replicate collective waits out a failed peer, up to recover.collective_timeout_s + "
        f"recover.heartbeat_timeout_s = {t.survivor_wait_s:g}s, so the surviving group would time out "
        f"and die; raise comm.train_timeout_seconds above {t.survivor_wait_s:g} (or leave it at "
        "TorchTitan's default: titan_recover then sets it) or lower recover.collective_timeout_s",
    )


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string ("2.11.0+cu130", "2.15.0a0+git1234"), None where it has none."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def torch_finding(version: str, where: str, env: Mapping[str, str]) -> Finding:
    """The torch the launcher runs on (``version``, imported from ``where``) against ``SUPPORTED_TORCH``."""
    (low, high), rule = SUPPORTED_TORCH, "torch-version"
    supported = f"{low[0]}.{low[1]} <= torch < {high[0]}.{high[1]}"
    found = release(version)
    if found is not None and low <= found < high:
        return Finding(OK, rule, f"torch {version} ({where}): within {supported}")
    refusal = Finding(
        REFUSE,
        rule,
        f"torch {version} ({where}) is outside the releases titan_recover supports, {supported} (run on 2.11, "
        f"2.13.0 and 2.14.1): {TORCH_FIX}; or set {OVERRIDE_ENV}=warn to run on it anyway",
    )
    return overridden([refusal], env)[0]


def overridden(findings: list[Finding], env: Mapping[str, str]) -> list[Finding]:
    """``findings`` with each refusal turned into a warning where ``OVERRIDE_ENV`` says so."""
    if env.get(OVERRIDE_ENV) != "warn":
        return findings
    return [
        Finding(WARN, f.rule, f"{f.text} (refusal turned into a warning by {OVERRIDE_ENV}=warn)", f.source)
        if f.level == REFUSE
        else f
        for f in findings
    ]


def check(
    nccl_version: tuple[int, int, int] | None,
    backend: str,
    env: Mapping[str, str],
    rc: Any,
    comm: Mapping[str, tuple[float, float]],
) -> Preflight:
    """The findings for a run whose replicate dimension runs on ``backend``; ``nccl_version`` None:
    no NCCL on this host (a CPU run). ``comm``: TorchTitan's ``[comm]`` keys and their defaults
    (``comm_facts``; a key this TorchTitan line lacks is left out)."""
    out = Preflight()
    value, default = comm.get("train_timeout_seconds", (None, None))
    out.findings.append(timeout_finding(timeouts(rc, value), default, out))
    if nccl_version is not None:
        out.findings.append(nccl_version_finding(nccl_version))
    if backend == "nccl":
        out.findings.append(dump_on_timeout_finding(env, out))
        if (trace := trace_buffer_finding(comm.get("trace_buf_size"), out)) is not None:
            out.findings.append(trace)
        out.findings.extend(desync_debug_findings(env))
        out.findings.append(nvls_finding(env))
        if (monitoring := monitoring_finding(env)) is not None:
            out.findings.append(monitoring)
    out.findings = overridden(out.findings, env)
    return out


SNAPSHOT_DIR = "recover.snapshot_dir"


def snapshot_dir_finding(rc: Any) -> Finding | None:
    """With snapshots on, the folder ``recover.snapshot_dir`` names must be a directory this node's launcher can
    make its own folder in; each node has its own filesystem, so only its launcher can tell. ``OVERRIDE_ENV``
    does not turn this refusal into a warning: the launcher could not run without the folder."""
    where = rc.snapshot_dir
    if not rc.snapshot_interval or not where:
        return None
    if os.path.isdir(where) and os.access(where, os.W_OK | os.X_OK):
        return None
    what = "is not writable by this user" if os.path.isdir(where) else "is not a directory on this node"
    return Finding(
        REFUSE,
        SNAPSHOT_DIR,
        f"{SNAPSHOT_DIR} = {where!r} {what}: name a writable tmpfs folder every node has (e.g. /dev/shm), "
        '"" for /dev/shm, or recover.snapshot_interval = 0 for no snapshots',
    )


def on_this_node(job_config: Any, backend: str, env: Mapping[str, str]) -> Preflight:
    """The findings for this job on this node: its NCCL, ``env``, the job's keys and its snapshot folder (for the
    launcher and --check)."""
    out = check(nccl_version(), backend, env, job_config.recover, comm_facts(job_config))
    if (snapshots := snapshot_dir_finding(job_config.recover)) is not None:
        out.findings.append(snapshots)
    return out


COMM_KEYS = ("train_timeout_seconds", "trace_buf_size")


def comm_facts(job_config: Any) -> dict[str, tuple[float, float]]:
    """The job's TorchTitan ``[comm]`` keys the rules read, each with its default."""
    from titan_recover import titan

    return {key: found for key in COMM_KEYS if (found := titan.comm_setting(job_config, key)) is not None}


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL this torch loads (not ``$NCCL_VERSION``, which containers set to what they shipped), or
    None without CUDA or NCCL: the one fact the preflight reads from the process."""
    import torch
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    version = torch.cuda.nccl.version()
    return version if isinstance(version, tuple) else (version // 10000, version // 100 % 100, version % 100)
