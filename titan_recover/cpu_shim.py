"""CPU support for TorchTitan 0.2.2, in one place.

TorchTitan assumes CUDA: ``torchtitan.tools.utils`` falls back to ``"cuda"`` when no
accelerator is present, and several modules bind ``device_type``/``device_module`` at
import time. ``apply()`` must therefore run before any other torchtitan module is
imported. On gloo, FSDP2's PREMUL_SUM reduction (used when TorchTitan sets a gradient
divide factor) is rejected, so FSDP modules are switched to plain SUM reductions.
"""

from __future__ import annotations

import os
import platform
import sys
from types import SimpleNamespace

import torch


def needed() -> bool:
    """True when there is no accelerator, so TorchTitan must be pointed at the CPU."""
    return not torch.cuda.is_available()


def _memory_total() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class _CpuDeviceModule(SimpleNamespace):
    """The subset of ``torch.cuda``'s API TorchTitan calls, answered for the CPU."""

    @staticmethod
    def set_device(device: object) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(device: object = None) -> str:
        return platform.processor() or platform.machine() or "cpu"

    @staticmethod
    def get_device_properties(device: object = None) -> SimpleNamespace:
        return SimpleNamespace(total_memory=_memory_total())

    @staticmethod
    def memory_stats(device: object = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: object = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def synchronize(device: object = None) -> None:
        pass

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def is_available() -> bool:
        return True


def apply() -> None:
    """Point TorchTitan at the CPU when there is no accelerator. Idempotent.

    ``import torchtitan`` already imports modules that bind the device, so the
    device is decided while ``torchtitan.tools.utils`` is first imported: torch's
    device look-ups are swapped for the CPU answers just for that import.
    """
    if not needed():
        return
    if "torchtitan.tools.utils" in sys.modules:
        if sys.modules["torchtitan.tools.utils"].device_type != "cpu":
            raise RuntimeError(
                "torchtitan was imported before titan_recover.cpu_shim.apply(); "
                "import titan_recover.train (or call apply()) first"
            )
        return
    import torch._utils as tu

    saved = tu._get_available_device_type, tu._get_device_module
    tu._get_available_device_type = lambda: "cpu"
    tu._get_device_module = lambda device_type=None: _CpuDeviceModule()
    try:
        import torchtitan.tools.utils  # noqa: F401  binds "cpu" for every torchtitan module
    finally:
        tu._get_available_device_type, tu._get_device_module = saved


def force_sum_reduction(model: torch.nn.Module) -> None:
    """Make FSDP2 reduce gradients with SUM (gloo rejects PREMUL_SUM/AVG).

    TorchTitan already disables FSDP's gradient division and scales the loss by
    the global token count, so SUM gives the same gradients.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
