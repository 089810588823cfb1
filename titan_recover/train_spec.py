"""``<family>_recover``: a TorchTitan text model's TrainSpec with titan_recover's addressable data.

Importing this module (the TOML names it with ``experimental.custom_import``) registers
``llama3_recover`` and ``qwen3_recover`` in TorchTitan's registry; ``model.name`` picks one.
Everything but the data is the family's own: model, flavors, optimizers, loss,
parallelize (plus SUM reductions for gloo on CPU) and a ``tiny`` flavor for CPU tests.
Another model whose data is text tokens is one call away, from the user's own
``custom_import`` module: ``titan_recover.train_spec.register("my_model")``.
"""

import dataclasses
from typing import Any, Callable

import torch

from titan_recover import cpu_shim

cpu_shim.apply()  # before any torchtitan module binds the device type

from torchtitan.models.llama3 import TransformerModelArgs
from torchtitan.models.qwen3 import Qwen3ModelArgs
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

from titan_recover.dataloader import build_addressable_dataloader

SUFFIX = "_recover"

# Flavors small enough for multi-process tests on a 2-core machine (the synthetic tokenizer's vocabulary).
TINY: dict[str, Any] = {
    "llama3": TransformerModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=2048, rope_theta=500000),
    "qwen3": Qwen3ModelArgs(vocab_size=2048, max_seq_len=4096, head_dim=16, dim=64, n_layers=2, n_heads=4,
                            n_kv_heads=2, qk_norm=True, hidden_dim=192, rope_theta=1000000),
}


def _with_sum_reduction(parallelize: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    def parallelize_fn(model: torch.nn.Module, parallel_dims: Any, job_config: Any) -> torch.nn.Module:
        if getattr(model, "enable_weight_tying", False) and parallel_dims.fsdp_enabled:
            raise ValueError(
                f"model.flavor {job_config.model.flavor!r} ties its embedding and output weights, which TorchTitan "
                "0.2.2 shards in two FSDP groups and torch 2.13's FSDP2 rejects; choose an untied flavor (e.g. tiny)"
            )
        model = parallelize(model, parallel_dims, job_config)
        if cpu_shim.needed():
            cpu_shim.force_sum_reduction(model)
        return model

    return parallelize_fn


def recover_spec(base: TrainSpec, flavors: dict[str, Any]) -> TrainSpec:
    """``base`` with the addressable dataloader; validation (a streaming HF set) is left out."""
    return dataclasses.replace(
        base,
        model_args={**base.model_args, **flavors},
        parallelize_fn=_with_sum_reduction(base.parallelize_fn),
        build_dataloader_fn=build_addressable_dataloader,
        build_validator_fn=None,
    )


def register(family: str, flavors: dict[str, Any] | None = None) -> str:
    """Registers ``<family>_recover`` from TorchTitan's ``family`` spec; returns the name."""
    name = family + SUFFIX
    tiny = {"tiny": TINY[family]} if family in TINY else {}
    register_train_spec(name, recover_spec(get_train_spec(family), {**tiny, **(flavors or {})}))
    return name


for _family in TINY:
    register(_family)
