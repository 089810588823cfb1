"""``llama3_recover``: TorchTitan's llama3 TrainSpec with titan_recover's addressable data.

Registered in TorchTitan's registry on import (the TOML names it with
``model.name = "llama3_recover"`` and ``experimental.custom_import``). Everything
else is llama3's own: model, flavors, optimizers, loss, parallelize.
"""

import dataclasses
from typing import Any

import torch

from titan_recover import cpu_shim

cpu_shim.apply()  # before any torchtitan module binds the device type

from torchtitan.models import llama3
from torchtitan.models.llama3 import TransformerModelArgs
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

from titan_recover.dataloader import build_addressable_dataloader

NAME = "llama3_recover"

# A flavor small enough for multi-process tests on a 2-core machine.
MODEL_ARGS = {
    **llama3.llama3_args,
    "tiny": TransformerModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=2048, rope_theta=500000),
}


def _parallelize(model: torch.nn.Module, parallel_dims: Any, job_config: Any) -> torch.nn.Module:
    model = llama3.parallelize_llama(model, parallel_dims, job_config)
    if cpu_shim.needed():
        cpu_shim.force_sum_reduction(model)
    return model


def get_train_spec() -> TrainSpec:
    return dataclasses.replace(
        llama3.get_train_spec(),
        model_args=MODEL_ARGS,
        parallelize_fn=_parallelize,
        build_dataloader_fn=build_addressable_dataloader,
        build_validator_fn=None,
    )


register_train_spec(NAME, get_train_spec())
