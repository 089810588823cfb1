"""Which GPUs a host's replica groups get, and which backend the replicate dimension uses.

Decided once per host by the launcher, from facts alone (the host's GPU ids, its
replica groups, ranks per group, whether torch has NCCL), so the rules are testable
without a GPU:

- every rank of a group gets a GPU of its own: TorchTitan runs the group's FSDP/TP/PP
  on NCCL, which rejects two ranks of one communicator on one device;
- groups get disjoint GPUs while the host has enough, and share them beyond that
  (e.g. two one-rank groups on one GPU, for trying titan_recover on a workstation);
- the replicate dimension runs on NCCL only where every rank on the host has its own
  GPU; ``auto`` falls back to gloo where GPUs are shared, and always on CPU.
"""

from dataclasses import dataclass

from titan_recover.config import ConfigError


@dataclass(frozen=True)
class DevicePlan:
    backend: str
    """The replicate dimension's backend: "nccl" or "gloo"."""

    visible: list[str | None]
    """CUDA_VISIBLE_DEVICES of each local group; None leaves the environment alone (CPU)."""

    reason: str
    """Why this backend, for the launcher's log."""


def host_gpus(cuda_visible: str | None, device_count: int) -> list[str]:
    """The GPU ids this host lets the launcher hand out (``CUDA_VISIBLE_DEVICES`` narrows them)."""
    if cuda_visible is None:
        return [str(i) for i in range(device_count)]
    return [d.strip() for d in cuda_visible.split(",") if d.strip()][:device_count]


def plan(requested: str, gpus: list[str], groups: int, ranks: int, nccl_available: bool) -> DevicePlan:
    """The backend and GPUs for ``groups`` replica groups of ``ranks`` ranks on one host
    (``requested`` is one of BACKENDS, checked by ``config.validate``)."""
    if not gpus:
        if requested == "nccl":
            raise ConfigError('recover.replicate_backend = "nccl" needs CUDA GPUs, and this host has none: use "gloo" or "auto"')
        return DevicePlan("gloo", [None] * groups, "no GPUs on this host")
    if ranks > len(gpus):
        raise ConfigError(
            f"a replica group of {ranks} ranks (dp_shard x tp x pp) needs {ranks} GPUs, one per rank, "
            f"and this host has {len(gpus)}: lower the group's parallel degrees or spread groups over more hosts"
        )
    visible: list[str | None] = [
        ",".join(gpus[(g * ranks + i) % len(gpus)] for i in range(ranks)) for g in range(groups)
    ]
    shared = groups * ranks > len(gpus)
    why_not = (
        f"{groups} groups x {ranks} ranks share {len(gpus)} GPUs, and NCCL needs one GPU per rank" if shared
        else "this torch was built without NCCL" if not nccl_available
        else ""
    )
    if requested == "nccl" and why_not:
        raise ConfigError(f'recover.replicate_backend = "nccl" cannot run here: {why_not}; use "gloo" or "auto"')
    if requested == "gloo":
        return DevicePlan("gloo", visible, "asked for in [recover] replicate_backend")
    if why_not:
        return DevicePlan("gloo", visible, why_not)
    return DevicePlan("nccl", visible, "every rank has a GPU of its own")
