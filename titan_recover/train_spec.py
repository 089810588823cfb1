"""``<family>_recover``: a TorchTitan text model with titan_recover's addressable data.

Importing this module (the TOML names it with ``experimental.custom_import``) registers
``llama3_recover`` and ``qwen3_recover``; ``model.name`` picks one. Everything but the data
is the family's own: model, flavors, optimizers, loss, parallelize (plus SUM reductions
for gloo on CPU) and a ``tiny`` flavor for CPU tests. Another model whose data is text
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
