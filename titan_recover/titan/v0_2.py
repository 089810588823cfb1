"""TorchTitan 0.2.x (TOML configs, the ``TrainSpec`` registry): the adapter's module for this line.

``common`` is imported first: it binds TorchTitan's device type.
The job's ``[recover]`` section comes in through TorchTitan's ``job.custom_config_module``
(``titan_recover.config``), and the models through ``experimental.custom_import``
(``titan_recover.train_spec``, which calls ``register_model``).
"""

# the import order matters here (see the module docstring): not sorted
# isort: skip_file
import contextlib
import dataclasses
import importlib
from typing import Any, Callable, Iterator

import torch

from titan_recover.titan import cpu_shim
from titan_recover.config import ConfigError, check_experts_faults

from titan_recover.titan import common  # binds TorchTitan's device type first
from titan_recover.titan.common import (  # noqa: F401 (the interface)
    clip_grad_norm,
    comm_setting,
    newest_checkpoint,
    save_or_report,
    text_datasets,
)

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
from torchtitan.components.tokenizer import HuggingFaceTokenizer as Tokenizer
from torchtitan.config import JobConfig
from torchtitan.models import _supported_models
from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs
from torchtitan.models.gpt_oss.model.args import GptOssModelArgs
from torchtitan.models.llama3 import TransformerModelArgs
from torchtitan.models.llama4.model.args import RoPEScalingArgs
from torchtitan.models.llama4.model.args import TransformerModelArgs as Llama4ModelArgs
from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3 import Qwen3ModelArgs
from torchtitan.protocols import train_spec as specs
import torchtitan.train
from torchtitan.train import Trainer, main

__all__ = ["BaseDataLoader", "IGNORE_INDEX", "JobConfig", "Tokenizer", "Trainer"]

SUFFIX = "_recover"


# Flavors small enough for multi-process tests on a 2-core machine (the synthetic tokenizer's vocabulary);
# the mixture-of-experts ones have 4 experts, 2 per token, and each family's own router and balancing.
def _moe(**kwargs: Any) -> MoEArgs:
    return MoEArgs(**{"num_experts": 4, "top_k": 2, **kwargs})


_SOFTMAX = {"score_func": "softmax", "score_before_experts": False}
TINY: dict[str, dict[str, Any]] = {
    "llama3": {"tiny": TransformerModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=2048, rope_theta=500000)},
    "qwen3": {
        flavor: Qwen3ModelArgs(
            vocab_size=2048,
            max_seq_len=4096,
            head_dim=16,
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            qk_norm=True,
            hidden_dim=192,
            rope_theta=1000000,
            **moe,
        )
        for flavor, moe in (
            ("tiny", {}),
            (
                "tiny_moe",
                {
                    "moe_enabled": True,
                    "moe_inter_dim": 64,
                    "moe_args": _moe(num_shared_experts=0, route_norm=True, **_SOFTMAX),
                },
            ),
        )
    },
    "deepseek_v3": {
        "tiny": DeepSeekV3ModelArgs(
            vocab_size=2048,
            dim=64,
            inter_dim=128,
            moe_inter_dim=64,
            n_layers=2,
            n_dense_layers=1,
            n_heads=4,
            moe_args=_moe(num_shared_experts=1, **_SOFTMAX),
            q_lora_rank=0,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            mscale=0.70,
        )
    },
    "llama4": {
        "tiny": Llama4ModelArgs(
            dim=64,
            n_layers=2,
            n_heads=4,
            vocab_size=2048,
            rope_theta=500000,
            rope_scaling_args=RoPEScalingArgs(),
            moe_args=_moe(),
            interleave_moe_layer_step=1,
        )
    },
    "gpt_oss": {
        "tiny": GptOssModelArgs(
            vocab_size=2048,
            dim=64,
            moe_inter_dim=64,
            n_layers=2,
            head_dim=16,
            n_heads=4,
            n_kv_heads=2,
            sliding_window_size=16,
            moe_args=_moe(num_shared_experts=0, route_norm=True, gate_bias=True, **_SOFTMAX),
        )
    },
}
FAMILIES = tuple(TINY)
"""The model families titan_recover registers with its data (``<family>_recover``)."""


def run(trainer_factory: Callable[[JobConfig], Trainer]) -> None:
    """TorchTitan's entry point: parses the command line and trains with ``trainer_factory``'s trainer."""
    main(trainer_factory)  # main only calls it with the job config


def load_config(argv: list[str]) -> JobConfig:
    """The job config from ``--job.config_file X.toml`` and ``--section.key value``, ``[recover]`` checked."""
    return common.load_config(argv, 'set [job] custom_config_module = "titan_recover.config" in the TOML')


def check_model(job_config: JobConfig) -> None:
    """``model.name`` names a registered TrainSpec, after ``experimental.custom_import`` (which registers
    the job's own) is imported: TorchTitan's own refusal is a traceback, in every rank."""
    module = job_config.experimental.custom_import
    if module:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(
                f"experimental.custom_import {module!r} cannot be imported ({e}); set it to the module "
                "that registers the job's model, e.g. titan_recover.train_spec"
            ) from None
    name, flavor = job_config.model.name, job_config.model.flavor
    try:
        args = model_flavors(name).get(flavor)
    except ValueError:
        registered = sorted(specs._extra_train_specs)  # TorchTitan lists them nowhere else
        raise ConfigError(
            f"model.name {name!r} is not a registered model; registered by experimental.custom_import "
            f"({module!r}): {', '.join(registered) or 'none'}; TorchTitan's own: {', '.join(sorted(_supported_models))}"
        ) from None
    has_experts = bool(getattr(args, "moe_enabled", hasattr(args, "moe_args")))
    check_experts_faults(job_config.recover, f"model.flavor {flavor!r} of {name}", has_experts)


class _GuardedCheckpointer:
    """The trainer's CheckpointManager, saving only while ``saves()`` and loading only if ``loads``.
    0.2's Trainer builds its CheckpointManager inline, so the manager is wrapped, not subclassed."""

    def __init__(
        self, inner: CheckpointManager, saves: Callable[[], bool], loads: bool, failed: Callable[[int, str], None]
    ) -> None:
        self._inner, self._saves, self._loads, self._failed = inner, saves, loads, failed

    def save(self, curr_step: int, last_step: bool = False) -> None:
        if self._saves():
            save_or_report(lambda: self._inner.save(curr_step, last_step), curr_step, self._inner, self._failed)

    def save_whole(self, step: int) -> None:
        common.save_whole(self._inner, lambda: self.save(step), step)

    def load(self, step: int = -1) -> bool:
        return self._inner.load(step) if self._loads else False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _surviving(enter: Callable[..., Any], what: str, write: str) -> Callable[..., Any]:
    """``enter`` (one of 0.2's profiler context managers) whose profiler survives a folder that cannot take
    its traces (``common.surviving_profiler``)."""

    @contextlib.contextmanager
    def surviving(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with contextlib.ExitStack() as stack:
            yield common.surviving_profiler(lambda: stack.enter_context(enter(*args, **kwargs)), what, write)

    return surviving


# 0.2's Trainer.train enters its profilers by these names, inside the loop this line cannot subclass
torchtitan.train.maybe_enable_profiling = _surviving(
    torchtitan.train.maybe_enable_profiling, "a profiler trace", "on_trace_ready"
)
torchtitan.train.maybe_enable_memory_snapshot = _surviving(
    torchtitan.train.maybe_enable_memory_snapshot, "a memory snapshot", "step"
)


def guard_checkpointer(
    trainer: Trainer, saves: Callable[[], bool], loads: bool, failed: Callable[[int, str], None]
) -> None:
    """From here on the trainer's DCP checkpoints are written only while ``saves()``, and
    read at the start only if ``loads``; a save the disk does not take goes to ``failed``."""
    trainer.checkpointer = _GuardedCheckpointer(trainer.checkpointer, saves, loads, failed)


def _router_biases_zeroed(model: torch.nn.Module) -> torch.nn.Module:
    """``model``, whose ``init_weights`` also zeroes its MoE routers' gate biases (gpt_oss has them), as
    TorchTitan 0.3 initializes them: 0.2.2 initializes the gate's weight only, so its bias keeps whatever
    memory it was given, different in every process, and replica groups (stock HSDP's replicas too)
    start from different weights. Found by the replica digests: gpt_oss's groups differed after step 1."""
    gates: list[Any] = [m.gate for m in model.modules() if type(m).__name__ == "TokenChoiceTopKRouter"]
    init_weights = getattr(model, "init_weights", None)
    if init_weights is None or not any(gate.bias is not None for gate in gates):
        return model

    def init_and_zero(*args: Any, **kwargs: Any) -> None:
        init_weights(*args, **kwargs)
        with torch.no_grad():
            for gate in gates:
                if gate.bias is not None:
                    gate.bias.zero_()

    model.init_weights = init_and_zero  # type: ignore[assignment]  # TorchTitan calls it after parallelizing
    return model


def _adapted(parallelize: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    """TorchTitan's ``parallelize`` of a model, after the router biases' initialization and the CPU
    shim's MoE and FlexAttention pieces, and with SUM reductions on a CPU; a tied flavor is refused."""

    def parallelize_fn(model: torch.nn.Module, parallel_dims: Any, job_config: Any) -> torch.nn.Module:
        if getattr(model, "enable_weight_tying", False) and parallel_dims.fsdp_enabled:
            raise ValueError(
                f"model.flavor {job_config.model.flavor!r} ties its embedding and output weights, which TorchTitan "
                "0.2.2 shards in two FSDP groups and torch 2.13's FSDP2 rejects; choose an untied flavor (e.g. tiny)"
            )
        model = cpu_shim.flex_attention_on_cpu(cpu_shim.moe_on_cpu(_router_biases_zeroed(model)))
        return cpu_shim.force_sum_reduction(parallelize(model, parallel_dims, job_config))

    return parallelize_fn


def register_model(
    family: str, build_dataloader: Callable[..., BaseDataLoader], flavors: dict[str, Any] | None = None
) -> str:
    """Registers ``<family>_recover``: TorchTitan's ``family`` spec (plus the tiny flavors where
    there are some, and ``flavors``) with ``build_dataloader``'s data, SUM reductions and MoE
    layers that run on a CPU, and no validation (a streaming HF set); returns the name."""
    base = specs.get_train_spec(family)
    spec = dataclasses.replace(
        base,
        model_args={**base.model_args, **TINY.get(family, {}), **(flavors or {})},
        parallelize_fn=_adapted(base.parallelize_fn),
        build_dataloader_fn=build_dataloader,
        build_validator_fn=None,
    )
    name = family + SUFFIX
    specs.register_train_spec(name, spec)
    return name


def model_flavors(name: str) -> dict[str, Any]:
    """The model args of each flavor of model ``name``; ValueError when no model has that name."""
    return specs.get_train_spec(name).model_args


def model_vocab_size(job_config: JobConfig) -> int:
    """The embedding rows of the job's model (its TrainSpec's flavor); ConfigError for an unknown flavor."""
    name, flavor = job_config.model.name, job_config.model.flavor
    flavors = model_flavors(name)
    if flavor not in flavors:
        raise ConfigError(f"model.flavor {flavor!r} is not a flavor of {name} ({sorted(flavors)})")
    return flavors[flavor].vocab_size


def count_tokens(trainer: Trainer, labels: torch.Tensor) -> None:
    """A microbatch's tokens: those seen (checkpointed) and the throughput counter's."""
    trainer.ntokens_seen += labels.numel()
    trainer.metrics_processor.ntokens_since_last_log += labels.numel()


def expert_counts(trainer: Trainer) -> list[torch.Tensor]:
    """The ``tokens_per_expert`` buffers the optimizer's load-balancing pre-hook reads, as it finds
    them (every MoE layer, none if one has no ``load_balance_coeff``); none where the model's spec
    builds its optimizers without the hook (0.2's qwen3)."""
    if trainer.train_spec.build_optimizers_fn is not build_optimizers_with_moe_load_balancing:
        return []
    layers = [
        block.moe
        for part in trainer.model_parts
        for block in part.get_submodule("layers").values()
        if block.moe_enabled
    ]
    return [] if any(m.load_balance_coeff is None for m in layers) else [m.tokens_per_expert for m in layers]


def model_inputs(
    trainer: Trainer, inputs: torch.Tensor, labels: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One microbatch for ``forward_backward_step`` (the pipeline schedule splits it itself)."""
    return {"input": inputs}, labels


def dump_folder(job_config: JobConfig) -> str:
    return job_config.job.dump_folder


def assets_path(job_config: JobConfig) -> str:
    return job_config.model.hf_assets_path


def model_name(job_config: JobConfig) -> tuple[str, str]:
    """(name, flavor) of the job's model."""
    return job_config.model.name, job_config.model.flavor


def dataset(job_config: JobConfig) -> tuple[str, str | None]:
    """(name, folder) of the job's dataset."""
    return job_config.training.dataset, job_config.training.dataset_path


ASSETS_KEY = "model.hf_assets_path"


def profiler(job_config: JobConfig) -> Any:
    return job_config.profiling


def config_file(job_config: JobConfig) -> str:
    """The TOML the job was read from (it may state the parameters' precision)."""
    return job_config.job.config_file


def metric_logger(job_config: JobConfig, parallel_dims: Any, log_dir: str) -> Any:
    """TorchTitan's TensorBoard/W&B loggers of the job, writing to ``log_dir`` (TorchTitan's own
    builder adds a folder per start time: a restarted group would start a new run)."""
    from torchtitan.components.metrics import WandBLogger, _get_metrics_rank

    logs_here = torch.distributed.get_rank() == _get_metrics_rank(parallel_dims, job_config)
    return common.metric_logger(
        job_config.metrics, log_dir, logs_here, lambda log_dir: WandBLogger(log_dir, job_config)
    )
