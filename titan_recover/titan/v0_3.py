"""TorchTitan 0.3.x (Python configs chosen by ``--module``/``--config``, components built from their
``Config``): the adapter's module for this line.

``common`` is imported first: TorchTitan 0.3 still binds its device type at import.
``[recover]`` is a section of the job config (``Trainer.Config.recover``, ``--recover.<key>``); the
plugin's configs are ``titan_recover.recipes``. The trainer builds titan_recover's data through
``build_dataloader`` and a checkpointer whose ``_save``/``_load`` ask the guard first.
"""

# the import order matters here (see the module docstring): not sorted
# isort: skip_file
import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable

import torch
import tyro

from titan_recover.config import ConfigError, Recover, check_experts_faults

from titan_recover.titan import common  # binds TorchTitan's device type first
from titan_recover.titan.common import (  # noqa: F401 (the interface)
    clip_grad_norm,
    comm_setting,
    newest_checkpoint,
    save_or_report,
    text_datasets,
)

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import ConfigManager
from torchtitan.models.common.attention import FlexAttention, VarlenAttention
from torchtitan.models.common.moe import MoE
from torchtitan.tools.logging import init_logger
from torchtitan.tools.profiler import Profiler
from torchtitan.trainer import Trainer as TitanTrainer

__all__ = ["BaseDataLoader", "IGNORE_INDEX"]


class GuardedCheckpointer(CheckpointManager):
    """TorchTitan's DCP checkpointer, saving only while ``saves()`` and loading only if ``loads``
    (``guard_checkpointer``); the hooks 0.3 leaves to subclasses."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    saves: Callable[[], bool] = staticmethod(lambda: True)
    loads: bool = True
    failed: Callable[[int, str], None] = staticmethod(lambda step, why: None)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self.saves():
            return False
        saved = save_or_report(
            lambda: super(GuardedCheckpointer, self)._save(curr_step, last_step), curr_step, self, self.failed
        )
        return bool(saved)

    def save_whole(self, step: int) -> None:
        common.save_whole(self, lambda: self.save(step), step)

    def _load(self, step: int = -1) -> bool:
        return super()._load(step) if self.loads else False


class _TrainerData(BaseDataLoader):
    """The dataloader slot of the config: its ``build`` asks the trainer (``Trainer.build_dataloader``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        build_fn: Annotated[Callable[..., BaseDataLoader] | None, tyro.conf.Suppress] = None

        def build(self, **kwargs: Any) -> BaseDataLoader:
            assert self.build_fn is not None
            return self.build_fn(**kwargs)


class GuardedProfiler(Profiler):
    """TorchTitan's profilers, surviving a folder that cannot take their traces
    (``common.surviving_profiler``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Profiler.Config):
        pass

    def build_torch_profiler(self, **kwargs: Any) -> Any:
        build = super(GuardedProfiler, self).build_torch_profiler
        return common.surviving_profiler(lambda: build(**kwargs), "a profiler trace", "on_trace_ready")

    def build_memory_profiler(self, **kwargs: Any) -> Any:
        build = super(GuardedProfiler, self).build_memory_profiler
        return common.surviving_profiler(lambda: build(**kwargs), "a memory snapshot", "step")


def _fields(config: Any) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


class Trainer(TitanTrainer):
    """TorchTitan's trainer with the ``recover`` section, titan_recover's data and the guarded checkpointer and
    profilers."""

    @dataclass(kw_only=True, slots=True)
    class Config(TitanTrainer.Config):
        recover: Recover = field(default_factory=Recover)
        """titan_recover: the fault-tolerant replicate dimension (see titan_recover.config.Recover)."""

    def __init__(self, config: "Trainer.Config") -> None:
        config.checkpoint = GuardedCheckpointer.Config(**_fields(config.checkpoint))
        config.profiler = GuardedProfiler.Config(**_fields(config.profiler))
        data = config.dataloader
        config.dataloader = _TrainerData.Config(
            dataset=data.dataset,
            dataset_path=data.dataset_path,
            build_fn=lambda **kwargs: self.build_dataloader(config, **kwargs),
        )
        super().__init__(config)

    @property
    def job_config(self) -> "Trainer.Config":
        """The job config under the name the rest of titan_recover (and TorchTitan 0.2) uses."""
        return self.config

    def build_dataloader(
        self, job_config: "Trainer.Config", *, dp_world_size: int, dp_rank: int, tokenizer: Any, **_: Any
    ) -> BaseDataLoader:
        """The data of this trainer (titan_recover's trainers give their addressable loader)."""
        raise NotImplementedError


JobConfig = Trainer.Config


def Tokenizer(path: str) -> HuggingFaceTokenizer:  # noqa: N802  the class's name on the other line
    """TorchTitan's Hugging Face tokenizer over the folder ``path``."""
    return HuggingFaceTokenizer.Config().build(tokenizer_path=path)


def run(trainer_factory: Callable[[JobConfig], Trainer]) -> None:
    """TorchTitan's entry point, building ``trainer_factory``'s trainer from the parsed config."""
    init_logger()
    config = ConfigManager().parse_args()
    trainer = None
    try:
        trainer = trainer_factory(config)
        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def load_config(argv: list[str]) -> JobConfig:
    """The job config from ``--module M --config F`` and ``--section.key value``, ``recover`` checked."""
    return common.load_config(
        argv, "build the recipe's config from titan_recover.titan.Trainer.Config (see titan_recover.recipes)"
    )


def check_model(job_config: JobConfig) -> None:
    """The recipe chose the model; a config without one cannot train, nor a fault in experts it lacks."""
    spec = job_config.model_spec
    if spec is None:
        raise ConfigError("the config has no model_spec: the recipe (--module/--config) must set one")
    has_experts = any(True for _ in spec.model.traverse(MoE.Config))
    check_experts_faults(job_config.recover, f"model {spec.name} flavor {spec.flavor!r}", has_experts)


def guard_checkpointer(
    trainer: Trainer, saves: Callable[[], bool], loads: bool, failed: Callable[[int, str], None]
) -> None:
    """From here on the trainer's DCP checkpoints are written only while ``saves()``, and
    read at the start only if ``loads``; a save the disk does not take goes to ``failed``."""
    checkpointer = trainer.checkpointer
    checkpointer.saves, checkpointer.loads, checkpointer.failed = saves, loads, failed


def count_tokens(trainer: Trainer, labels: torch.Tensor) -> None:
    """A microbatch's tokens in the throughput counter (0.3 counts ``ntokens_seen`` itself, in
    ``post_dataloading_process``: counting it here too would double it)."""
    trainer.metrics_processor.ntokens_since_last_log += labels.numel()


def expert_counts(trainer: Trainer) -> list[torch.Tensor]:
    """The ``tokens_per_expert_E`` buffers the load-balancing pre-hook reads (every MoE layer; none if
    their ``load_balance_coeff`` is unset); none where the model spec registers no such hook."""
    if trainer.job_config.model_spec.post_optimizer_build_fn is not register_moe_load_balancing_hook:
        return []
    layers = [
        block.moe
        for part in trainer.model_parts
        for block in part.get_submodule("layers").values()
        if getattr(block, "moe_enabled", False)
    ]
    return [] if any(m.load_balance_coeff is None for m in layers) else [m.tokens_per_expert_E for m in layers]


def _masked_attention(job_config: JobConfig) -> bool:
    """Whether the model's attention takes masks (FlexAttention, varlen), which 0.3's trainer builds
    only from token positions (its text loader yields them; titan_recover's gives tokens only)."""
    attention = getattr(job_config.model_spec.model, "first_attention", None)
    return isinstance(getattr(attention, "inner_attention", None), (FlexAttention.Config, VarlenAttention.Config))


NO_VISION_TOKENS = {"image_id": -1, "video_id": -1}
"""The vision token ids a text batch gives a multimodal decoder: ids no token has."""


def _text_of_multimodal(trainer: Trainer) -> bool:
    """Whether the model is a multimodal decoder (qwen3_5) trained on text: its RoPE needs each token's
    position, and its embedding looks up the tokenizer's vision token ids even in a batch without images
    (0.3's multimodal loader gives both; titan_recover's gives tokens)."""
    return "mrope_positions" in inspect.signature(trainer.model_parts[0].forward).parameters


def model_inputs(trainer: Trainer, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[Any, Any]:
    """One microbatch for ``forward_backward_step``: with pipeline stages 0.3 takes it as lists of
    pipeline microbatches (``parallelism.pipeline_parallel_microbatch_size`` samples each). A model
    with masked attention, or a multimodal one, also gets each sample's positions (0 to seq_len - 1: a
    sample is one document), from which the trainer builds its causal masks; a multimodal one also
    vision token ids that match no token."""
    batch: dict[str, Any] = {"input": inputs}
    multimodal = _text_of_multimodal(trainer)
    if multimodal or _masked_attention(trainer.config):
        batch["positions"] = torch.arange(inputs.size(1), device=inputs.device).expand_as(inputs)
    if multimodal:
        batch["special_tokens"] = NO_VISION_TOKENS
    if not trainer.parallel_dims.pp_enabled:
        return batch, labels
    size = trainer.config.parallelism.pipeline_parallel_microbatch_size
    parts = {key: value.split(size) for key, value in batch.items() if isinstance(value, torch.Tensor)}
    rest = {key: value for key, value in batch.items() if not isinstance(value, torch.Tensor)}
    return [{**dict(zip(parts, values)), **rest} for values in zip(*parts.values())], list(labels.split(size))


def dump_folder(job_config: JobConfig) -> str:
    return job_config.dump_folder


def assets_path(job_config: JobConfig) -> str:
    return job_config.hf_assets_path


def model_name(job_config: JobConfig) -> tuple[str, str]:
    """(name, flavor) of the job's model."""
    spec = job_config.model_spec
    return spec.name, spec.flavor


def model_vocab_size(job_config: JobConfig) -> int:
    return job_config.model_spec.model.vocab_size


def dataset(job_config: JobConfig) -> tuple[str, str | None]:
    """(name, folder) of the job's dataset."""
    return job_config.dataloader.dataset, job_config.dataloader.dataset_path


ASSETS_KEY = "hf_assets_path"


def profiler(job_config: JobConfig) -> Any:
    return job_config.profiler


def config_file(job_config: JobConfig) -> None:
    """0.3 has no config file: the recipe states the precision."""
    return None


def metric_logger(job_config: JobConfig, parallel_dims: Any, log_dir: str) -> Any:
    """TorchTitan's TensorBoard/W&B loggers of the job, writing to ``log_dir`` (TorchTitan's own
    builder adds a folder per start time: a restarted group would start a new run)."""
    from torchtitan.components.metrics import WandBLogger, _get_metrics_rank

    logs_here = torch.distributed.get_rank() == _get_metrics_rank(
        parallel_dims=parallel_dims, pp_schedule=job_config.parallelism.pipeline_parallel_schedule
    )
    return common.metric_logger(
        job_config.metrics, log_dir, logs_here, lambda log_dir: WandBLogger(log_dir, config_dict=job_config.to_dict())
    )
