"""``<family>_recover``: a TorchTitan text model with titan_recover's addressable data.

Importing this module (the TOML names it with ``experimental.custom_import``) registers
``llama3_recover``, ``qwen3_recover`` and the mixture-of-experts families ``deepseek_v3_recover``,
``llama4_recover`` and ``gpt_oss_recover``; ``model.name`` picks one. Everything but the data
is the family's own: model, flavors, optimizers (with their expert load balancing), loss,
parallelize (plus SUM reductions for gloo and MoE layers that run on a CPU) and ``tiny``
flavors for CPU tests (qwen3's MoE one is ``tiny_moe``). Another model whose data is text
tokens is one call away, from the user's own ``custom_import`` module:
``titan_recover.train_spec.register("my_model")``.
"""

from typing import Any

from titan_recover.data.dataloader import build_addressable_dataloader
from titan_recover.titan import v0_2  # TOML jobs: TorchTitan 0.2's registry of TrainSpecs


def register(family: str, flavors: dict[str, Any] | None = None) -> str:
    """Registers ``<family>_recover`` from TorchTitan's ``family`` model; returns the name."""
    return v0_2.register_model(family, build_addressable_dataloader, flavors)


for _family in v0_2.FAMILIES:
    register(_family)
