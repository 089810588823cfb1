"""The plugin's configs for TorchTitan 0.3 (``--module titan_recover.recipes --config <name>``), each
equal in model, data, parallelism and schedule to its TOML twin in ``train_configs/`` (TorchTitan 0.2).

Attention is SDPA, as TorchTitan 0.2's llama3 uses, also because 0.3's default (flex attention) has
no backward on a CPU; on a CPU, FSDP reduces with SUM (gloo has no PREMUL_SUM).
"""

import dataclasses
from typing import Any, Callable

import torch

from titan_recover import cpu_shim
from titan_recover.config import Recover
from titan_recover.titan.v0_3 import Trainer

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402  (v0_3 bound the device first)
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.models import llama3
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.protocols.model_spec import ModelSpec

ASSETS = "./titan_recover/assets/tokenizer"


def _with_sum_reduction(parallelize: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    def parallelize_fn(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        model = parallelize(model, **kwargs)
        if cpu_shim.needed():
            cpu_shim.force_sum_reduction(model)
        return model

    return parallelize_fn


def _llama3_tiny() -> ModelSpec:
    """TorchTitan 0.2's ``llama3_recover`` ``tiny`` flavor (dim 64, 2 layers, 4 heads, the synthetic
    tokenizer's 2,048 ids), built like 0.3's debugmodel (its layer builders are the module's own)."""
    dim, heads, vocab = 64, 4, 2048
    model = llama3.Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=2, dim=dim, n_heads=heads, hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=131072, theta=500000, scaling="llama"),
            attn_backend="flex", tp_gemm_backend="default",
        ),
    )
    return dataclasses.replace(llama3.model_registry("debugmodel"), flavor="tiny", model=model)


FLAVORS: dict[str, Callable[[], ModelSpec]] = {
    "debugmodel": lambda: llama3.model_registry("debugmodel"),
    "tiny": _llama3_tiny,
}


def model_spec(flavor: str) -> ModelSpec:
    """llama3 ``flavor`` with SDPA attention and, on a CPU, SUM reductions."""
    spec = FLAVORS[flavor]()
    for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    spec.parallelize_fn = _with_sum_reduction(spec.parallelize_fn)
    return spec


def llama3_debug_cpu(flavor: str = "debugmodel") -> Trainer.Config:
    """The default job (``train_configs/llama3_debug_cpu.toml``): llama3 debugmodel, 2 replica groups x
    2 FSDP ranks on CPU, a rank of replica 1 SIGKILLed mid-backward at step 5, the group restarted and
    rejoined from replica 0's state. Failure-free twin: ``--recover.fault_plan none``."""
    spec = model_spec(flavor)
    return Trainer.Config(
        dump_folder="./outputs/llama3_debug_cpu",
        hf_assets_path=ASSETS,
        model_spec=spec,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=5, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=2, global_batch_size=16, seq_len=128, max_norm=1.0, steps=30,
                                gc_freq=50, mixed_precision_param="float32", disable_cuda_graphs=True),
        dataloader=BaseDataLoader.Config(dataset="synthetic", dataset_path="./data/synthetic"),
        metrics=MetricsProcessor.Config(log_freq=5),
        parallelism=ParallelismConfig(data_parallel_replicate_degree=2, data_parallel_shard_degree=2),
        activation_checkpoint=None,
        checkpoint=CheckpointManager.Config(enable=False),
        debug=DebugConfig(seed=42),  # every replica group must initialize identical weights
        recover=Recover(
            enable=True, policy="balanced", min_replicas=1, fault_plan="kill replica=1 rank=1 step=5 phase=backward",
            max_restarts=3, digest_interval=10, heartbeat_interval_s=0.1, heartbeat_timeout_s=5.0,
        ),
    )


def llama3_tiny_cpu() -> Trainer.Config:
    """The default job with the ``tiny`` flavor: the tests' model (``--model.flavor tiny`` on 0.2)."""
    return llama3_debug_cpu("tiny")
