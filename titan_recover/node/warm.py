"""Warm incarnations: a replica group's next incarnation, started before it is needed.

A restarted group spends most of its downtime importing torch and TorchTitan (13-31 s on a
2-core host; state transfer is under a second). So, once a group trains, its launcher starts
the group's next incarnation under a torchrun of its own with ``$TITAN_RECOVER_WARM`` set:
its ranks import everything, parse the job and check its model, then wait here, before the
Trainer is built: before ``set_device`` (no CUDA context, no accelerator memory) and before
``init_process_group``. When the group fails, the launcher reaps the failed torchrun and
writes this incarnation's ``Activation`` (its incarnation number, assigned now, and its node
channel) to the file the variable names; the ranks read it, take it as their environment
and build the model as any restart does.

No fork server: a fork after torch's import, with threads and OpenMP pools alive (or CUDA),
is unsafe; a warm incarnation is a fresh ``exec`` like a cold one, only earlier.

Pure pieces (the message, the host-memory fit) are testable without processes; the
launcher's side is ``launch.torchruns``.
"""

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from titan_recover.control import keys
from titan_recover.node.channel import CHANNEL_ENV
from titan_recover.observability import resources

WARM_ENV = "TITAN_RECOVER_WARM"  # a warm rank's activation file: it waits until the file exists
POLL_S = 0.02  # how often a warm rank looks for its activation: ~50 stat calls a second, no CPU to speak of
RANK_BYTES = 1536 * 2**20  # host memory a warm rank may hold (measured 527-539 MiB on CPU, torch 2.13): the fit check
log = logging.getLogger(__name__)


class WarmError(ValueError):
    """An activation file that is not what the launcher writes: the warm rank stops, naming it."""


@dataclass(frozen=True)
class Activation:
    """What makes a warm incarnation the group's current one: the incarnation number the store gave
    it when the group failed, and the node channel the launcher opened for that incarnation."""

    replica: int
    incarnation: int
    channel: str

    def dumps(self) -> str:
        return json.dumps({"replica": self.replica, "attempt": self.incarnation, "channel": self.channel})

    @classmethod
    def parse(cls, text: str, replica: int) -> "Activation":
        """The launcher's message for this warm rank of ``replica``; ``WarmError`` naming what is wrong."""
        try:
            rec: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise WarmError(f"the activation is not JSON ({e})") from None
        if not isinstance(rec, dict) or set(rec) != {"replica", "attempt", "channel"}:
            raise WarmError(f"the activation must be an object with replica, attempt and channel: {text[:200]!r}")
        got, incarnation, channel = rec["replica"], rec["attempt"], rec["channel"]
        if type(got) is not int or got != replica:
            raise WarmError(f"the activation names replica {got!r}; this warm rank stands in for replica {replica}")
        if type(incarnation) is not int or incarnation < 1:
            raise WarmError(f"the activation's attempt {incarnation!r} is not a restart's (an int >= 1)")
        if not isinstance(channel, str) or not channel:
            raise WarmError(f"the activation's channel {channel!r} is not a file path")
        return cls(got, incarnation, channel)

    def write(self, path: str) -> None:
        """Atomically: a rank polling ``path`` reads the whole message or nothing."""
        partial = f"{path}.partial"
        with open(partial, "w") as f:
            f.write(self.dumps())
        os.replace(partial, path)


def ready_file(path: str, local_rank: int) -> str:
    """The file a warm rank creates beside its activation file once it waits: the launcher counts them."""
    return f"{path}.ready{local_rank}"


def off_because(setting: str, spans: bool, available_bytes: int, cores: int, training: int, waiting: int) -> str:
    """Why this node's groups get no warm incarnations ("" where they do): ``recover.warm`` is
    ``setting``, a node runs ``training`` ranks and would keep ``waiting`` more; ``spans``: its
    groups span nodes. Host memory is never overridden: running out of it kills training ranks."""
    if setting == "off":
        return "recover.warm = off"
    if spans:
        return "each group spans nodes, and its torchrun starts with its other parts"
    if waiting * RANK_BYTES > available_bytes // 2:
        return (
            f"{waiting} waiting ranks need up to {waiting * RANK_BYTES / 2**30:.1f} GiB of host memory and the node "
            f"has {available_bytes / 2**30:.1f} GiB available (half of it stays free)"
        )
    if setting == "auto" and cores < training + waiting:
        return (
            f"the node has {cores} cores for {training} training ranks: {waiting} more ranks importing beside them "
            "would slow training (recover.warm = on starts them anyway)"
        )
    return ""


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """MemAvailable, the kernel's estimate of what a new process may take without swapping (0 if unknown)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def stand_by(build: Callable[[Any], Any], ready: Callable[[Any], None]) -> Callable[[Any], Any]:
    """``build`` (the trainer factory) as a cold rank calls it; a warm rank (``$TITAN_RECOVER_WARM``
    set) first runs ``ready(job_config)`` (the job's checks: they import the model's modules) and
    waits for its activation. The wait is bounded by the launcher: the rank dies with its torchrun
    (parent-death signal), which dies with the launcher, and the launcher kills it at the run's end."""
    path = os.environ.get(WARM_ENV)
    if not path:
        return build

    def warm_build(job_config: Any) -> Any:
        replica = int(os.environ[keys.REPLICA_ENV])
        start = time.monotonic()
        ready(job_config)
        open(ready_file(path, int(os.environ.get("LOCAL_RANK", "0"))), "w").close()
        log.info(
            f"warm incarnation of replica group {replica}: ready in {time.monotonic() - start:.1f}s after parsing, "
            f"holding {resources.usage()['rss_mb']:.0f} MiB; waiting to stand in when the group fails"
        )
        while not os.path.exists(path):
            time.sleep(POLL_S)
        with open(path) as f:
            activation = Activation.parse(f.read(), replica)
        os.environ[keys.INCARNATION_ENV] = str(activation.incarnation)
        os.environ[CHANNEL_ENV] = activation.channel
        log.info(f"warm incarnation of replica group {replica} activated as attempt {activation.incarnation}")
        return build(job_config)

    return warm_build
