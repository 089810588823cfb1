"""Which GPUs a host's replica groups get, and which backend the replicate dimension uses.

Decided once per host by the launcher, from facts alone (the host's GPU ids, its
replica groups, ranks per group, whether torch has NCCL), so the rules are testable
without a GPU:

- every rank of a group gets a GPU of its own: TorchTitan runs the group's FSDP/TP/PP
  on NCCL, which rejects two ranks of one communicator on one device;
- groups get disjoint GPUs while the host has enough, and share them beyond that
  (e.g. two one-rank groups on one GPU, for trying titan_recover on a workstation);
- the replicate dimension runs on NCCL only where every rank on the host has its own
  GPU; ``auto`` falls back to gloo where GPUs are shared, and always on CPU;
- with ``[recover] nccl_rank_per_host`` (one node; for tests and self-tests, not performance)
  ranks may share GPUs and every communicator is NCCL: each rank sees its one GPU as
  ``cuda:0`` and poses to NCCL as a host of its own (``NCCL_HOSTID``), so NCCL, which refuses
  two ranks of one communicator on one GPU of one host, connects them over its socket
  transport on loopback. The launcher sets the group's part (``group_env``); each
  rank sets its own before its first CUDA or NCCL call (``rank_env``), since torchrun gives
  every local worker the same environment.
"""

import socket
from dataclasses import dataclass, replace
from typing import Mapping

from titan_recover.config import ConfigError
from titan_recover.control.keys import REPLICA_ENV


@dataclass(frozen=True)
class DevicePlan:
    backend: str
    """The replicate dimension's backend: "nccl" or "gloo"."""

    visible: list[str | None]
    """CUDA_VISIBLE_DEVICES of each local group; None leaves the environment alone (CPU)."""

    reason: str
    """Why this backend, for the launcher's log."""

    rank_per_host: bool = False
    """Ranks share GPUs, each posing to NCCL as a host of its own (``nccl_rank_per_host``)."""


RANK_GPUS_ENV = "TITAN_RECOVER_RANK_GPUS"  # the GPU of each local rank of a group, comma-separated (rank per host)
SLOT_ENV = "TITAN_RECOVER_LOCAL_RANK"  # a rank's torchrun LOCAL_RANK, kept where LOCAL_RANK is rewritten to 0
# NCCL between ranks posing as hosts of one machine: its socket transport over loopback, nothing that
# needs one host (NVLink SHARP, multi-node NVLink) or a NIC (InfiniBand)
RANK_PER_HOST_NCCL = {
    "NCCL_NET": "Socket",
    "NCCL_IB_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_MNNVL_ENABLE": "0",
    "NCCL_NVLS_ENABLE": "0",
}


def host_gpus(cuda_visible: str | None, device_count: int) -> list[str]:
    """The GPU ids this host lets the launcher hand out (``CUDA_VISIBLE_DEVICES`` narrows them)."""
    if cuda_visible is None:
        return [str(i) for i in range(device_count)]
    return [d.strip() for d in cuda_visible.split(",") if d.strip()][:device_count]


def plan(
    requested: str, gpus: list[str], groups: int, ranks: int, nccl_available: bool, rank_per_host: bool = False
) -> DevicePlan:
    """The backend and GPUs for ``groups`` replica groups of ``ranks`` ranks on one host
    (``requested`` is one of BACKENDS, checked by ``config.validate``)."""
    if not gpus:
        if requested == "nccl":
            raise ConfigError(
                'recover.replicate_backend = "nccl" needs CUDA GPUs, and this host has none: use "gloo" or "auto"'
            )
        return DevicePlan(
            "gloo",
            [None] * groups,
            "no GPUs on this host" + (" (recover.nccl_rank_per_host has nothing to do)" if rank_per_host else ""),
        )
    if ranks > len(gpus) and not rank_per_host:
        raise ConfigError(
            f"a replica group of {ranks} ranks (dp_shard x tp x pp) needs {ranks} GPUs, one per rank, "
            f"and this host has {len(gpus)}: lower the group's parallel degrees, spread groups over more hosts, "
            "or (tests only) set recover.nccl_rank_per_host"
        )
    visible: list[str | None] = [
        ",".join(gpus[(g * ranks + i) % len(gpus)] for i in range(ranks)) for g in range(groups)
    ]
    shared = groups * ranks > len(gpus)
    if rank_per_host and not shared:  # every rank has a GPU of its own: NCCL as usual, on its fast transports
        usual = plan(requested, gpus, groups, ranks, nccl_available)
        return replace(usual, reason=f"{usual.reason}; recover.nccl_rank_per_host not needed")
    why_not = (
        "this torch was built without NCCL"
        if not nccl_available
        else f"{groups} groups x {ranks} ranks share {len(gpus)} GPUs, and NCCL needs one GPU per rank"
        if shared and not rank_per_host
        else ""
    )
    if rank_per_host and not nccl_available:
        raise ConfigError(f"recover.nccl_rank_per_host needs NCCL, and {why_not}: unset it")
    if requested == "nccl" and why_not:
        raise ConfigError(f'recover.replicate_backend = "nccl" cannot run here: {why_not}; use "gloo" or "auto"')
    if requested == "gloo":
        return DevicePlan("gloo", visible, "asked for in [recover] replicate_backend", rank_per_host)
    if why_not:
        return DevicePlan("gloo", visible, why_not)
    if rank_per_host:
        return DevicePlan(
            "nccl",
            visible,
            f"{groups} groups x {ranks} ranks on {len(gpus)} GPUs, each rank posing as "
            "a host of its own (recover.nccl_rank_per_host: NCCL over loopback sockets, not a "
            "performance setup)",
            True,
        )
    return DevicePlan("nccl", visible, "every rank has a GPU of its own")


def group_env(visible: str | None, rank_per_host: bool) -> dict[str, str]:
    """What a group's torchrun adds to the environment: its GPUs (nothing on a CPU host), and in
    rank-per-host mode each rank's GPU and NCCL's transport for ranks posing as hosts."""
    if visible is None:
        return {}
    if not rank_per_host:
        return {"CUDA_VISIBLE_DEVICES": visible}
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(dict.fromkeys(visible.split(","))),
        RANK_GPUS_ENV: visible,
        **RANK_PER_HOST_NCCL,
    }


def rank_env(env: Mapping[str, str], host: str | None = None) -> dict[str, str]:
    """What a rank changes in its own environment before CUDA or NCCL start: in rank-per-host mode
    its one GPU as ``cuda:0`` (TorchTitan binds ``cuda:{LOCAL_RANK}``), its torchrun LOCAL_RANK kept
    for its node slot, and an ``NCCL_HOSTID`` no other rank of the node has; nothing otherwise."""
    if RANK_GPUS_ENV not in env:
        return {}
    local = int(env["LOCAL_RANK"])
    gpus = env[RANK_GPUS_ENV].split(",")
    if not 0 <= local < len(gpus):
        raise ConfigError(f"{RANK_GPUS_ENV}={env[RANK_GPUS_ENV]!r} names no GPU for local rank {local}")
    replica = env.get(REPLICA_ENV, "0")
    return {
        "CUDA_VISIBLE_DEVICES": gpus[local],
        "LOCAL_RANK": "0",
        SLOT_ENV: str(local),
        "NCCL_HOSTID": f"{host or socket.gethostname()}-titan-recover-g{replica}-r{local}",
    }


def local_rank(env: Mapping[str, str]) -> int:
    """This rank's torchrun LOCAL_RANK (its node slot), also where ``rank_env`` rewrote it."""
    return int(env.get(SLOT_ENV) or env["LOCAL_RANK"])
