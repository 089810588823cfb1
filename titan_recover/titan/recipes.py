"""The plugin's configs for TorchTitan 0.3 (``--module titan_recover.recipes --config <name>``), each
equal in model, data, parallelism and schedule to its TOML twin in ``train_configs/`` (TorchTitan 0.2).

Attention is SDPA, as TorchTitan 0.2's llama3 uses, also because 0.3's default (flex attention) has
no backward on a CPU; on a CPU, FSDP reduces with SUM (gloo has no PREMUL_SUM).
"""

# the import order matters here (see the module docstring): not sorted
# isort: skip_file
import dataclasses
from typing import Any, Callable

import torch

from titan_recover.titan import cpu_shim
from titan_recover.config import Recover
from titan_recover.titan.v0_3 import Trainer

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402  (v0_3 bound the device first)
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models import deepseek_v3, gpt_oss, kimi_k2_7, llama3, qwen3
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.gpt_oss.model import Attention as GptOssAttention
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.protocols.model_spec import ModelSpec

ASSETS = "./titan_recover/assets/tokenizer"


def _on_cpu(parallelize: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    def parallelize_fn(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        model = cpu_shim.gated_delta_on_cpu(cpu_shim.flex_attention_on_cpu(cpu_shim.moe_on_cpu(model)))
        return cpu_shim.force_sum_reduction(parallelize(model, **kwargs))

    return parallelize_fn


def _llama3_tiny() -> ModelSpec:
    """TorchTitan 0.2's ``llama3_recover`` ``tiny`` flavor (dim 64, 2 layers, 4 heads, the synthetic
    tokenizer's 2,048 ids), built like 0.3's debugmodel (its layer builders are the module's own)."""
    dim, heads, vocab = 64, 4, 2048
    model = llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True,
            n_layers=2,
            dim=dim,
            n_heads=heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=131072, theta=500000, scaling="llama"),
            attn_backend="flex",
            tp_gemm_backend="default",
        ),
    )
    return dataclasses.replace(llama3.model_registry("debugmodel"), flavor="tiny", model=model)


def _qwen3_tiny(moe: bool = False) -> ModelSpec:
    """TorchTitan 0.2's ``qwen3_recover`` ``tiny`` flavor (dim 64, 2 layers, 4 heads of 16, 2 KV heads,
    QK norm, hidden 192), untied like it: 0.3's qwen3 flavors tie the embedding and output weights. With
    ``moe``, its ``tiny_moe``: a mixture-of-experts layer in each block (4 experts of hidden size 64,
    top-2, softmax routing), which 0.3's optimizer hook balances."""
    dim, head_dim, vocab = 64, 16, 2048
    common: dict[str, Any] = dict(fuse_qkv=True, n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim)
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=4096, theta=1000000.0)
    layers = (
        qwen3._build_qwen3_moe_layers(
            **common,
            moe_hidden_dim=64,
            num_experts=4,
            top_k=2,
            attn_backend="flex",
            moe_comm_backend="standard",
            rope=rope,
        )
        if moe
        else qwen3._build_qwen3_layers(**common, hidden_dim=192, attn_backend="flex", rope=rope)
    )
    model = qwen3.Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=qwen3._qwen3_norm(dim),
        enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=qwen3._LINEAR_INIT),
        layers=layers,
    )
    base = "debugmodel_moe" if moe else "debugmodel"
    return dataclasses.replace(qwen3.model_registry(base), flavor="tiny_moe" if moe else "tiny", model=model)


def _tiny_decoder(spec: ModelSpec, family: Any, layers: list, **fields: Any) -> ModelSpec:
    """``spec`` at the tiny flavors' size: dim 64, the synthetic tokenizer's 2,048 ids, ``layers``, and the
    embedding, final norm (unless ``fields`` name one) and output head with ``family``'s (its module's)
    initializers."""
    dim, vocab = 64, 2048
    norm = fields.pop("norm", None) or RMSNorm.Config(normalized_shape=dim, param_init=family._NORM_INIT)
    model = dataclasses.replace(
        spec.model,
        vocab_size=vocab,
        dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=family._EMBEDDING_INIT),
        norm=norm,
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=family._output_linear_init(dim)),
        layers=layers,
        **fields,
    )
    return dataclasses.replace(spec, flavor="tiny", model=model)


_TINY_MLA: dict[str, Any] = dict(
    n_layers=2,
    n_dense_layers=1,
    dim=64,
    n_heads=4,
    q_lora_rank=0,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    dense_hidden_dim=128,
    moe_hidden_dim=64,
    num_experts=4,
    router_top_k=2,
    attn_backend="flex",
    moe_comm_backend="standard",
    non_blocking_capacity_factor=None,
)
"""deepseek_v3 ``tiny``'s sizes (0.2's ``deepseek_v3_recover`` flavor): dim 64, a dense block (hidden size
128) then an MoE block (4 experts of hidden size 64, top-2), MLA with 4 heads (KV rank 32, no q-LoRA)."""


def _deepseek_v3_tiny() -> ModelSpec:
    """deepseek_v3 at ``_TINY_MLA``'s sizes with 1 shared expert and softmax routing."""
    spec = deepseek_v3.model_registry("debugmodel")
    rope = dataclasses.replace(spec.model.layers[0].attention.rope, dim=_TINY_MLA["qk_rope_head_dim"])
    layers = deepseek_v3._build_dsv3_layers(
        **_TINY_MLA, mscale=0.70, num_shared_experts=1, router_score_func="softmax", rope=rope
    )
    return _tiny_decoder(spec, deepseek_v3, layers, mtp_layers=[])


def _kimi_k2_7_tiny() -> ModelSpec:
    """Kimi K2's text tower (Moonlight's: sigmoid routing with normalized, scaled weights, 2 shared
    experts) at ``_TINY_MLA``'s sizes; no vision tower."""
    spec = kimi_k2_7.model_registry("moonlight-16B-A3B")
    layers = kimi_k2_7._build_kimi_layers(
        **_TINY_MLA,
        mscale=1.0,
        num_shared_experts=2,
        router_score_func="sigmoid",
        router_route_scale=2.446,
        router_route_norm=True,
        rope=ComplexRoPE.Config(dim=_TINY_MLA["qk_rope_head_dim"], max_seq_len=4096, theta=50000.0),
    )
    return _tiny_decoder(spec, kimi_k2_7, layers, vision_encoder=None)


def _gpt_oss_tiny() -> ModelSpec:
    """TorchTitan 0.2's ``gpt_oss_recover`` ``tiny`` flavor: dim 64, 2 blocks (sliding-window attention
    over 16 tokens, then full), 4 heads of 16 and 2 KV heads with attention sinks, 4 experts of hidden
    size 64 with biases, top-2. Its attention stays FlexAttention: the sinks need the softmax's
    log-sum-exp, which SDPA does not return."""
    dim, head_dim = 64, 16
    spec = gpt_oss.model_registry("debugmodel", attn_backend="flex")
    rope = dataclasses.replace(spec.model.layers[0].attention.rope, dim=head_dim)
    layers = gpt_oss._build_gptoss_layers(
        dim=dim,
        n_layers=2,
        hidden_dim=64,
        num_experts=4,
        top_k=2,
        load_balance_coeff=1e-3,
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=rope,
    )
    for layer_id, layer in enumerate(layers):  # 0.3's builder gives every flavor the 20B's attention widths
        layer.attention = gpt_oss._make_gptoss_attn_config(
            dim=dim,
            layer_id=layer_id,
            attn_backend="flex",
            n_heads=4,
            n_kv_heads=2,
            head_dim=head_dim,
            sliding_window_size=16 if layer_id % 2 == 0 else None,
            rope=rope,
        )
    return _tiny_decoder(spec, gpt_oss, layers)


def _qwen3_5_tiny() -> ModelSpec:
    """Qwen3.5's hybrid MoE decoder at tiny sizes: dim 64, 2 blocks (gated DeltaNet, then full attention
    with its output gate and partial RoPE over 8 of 16 dims; the real flavors have 3 DeltaNet blocks per
    attention block, which on a CPU cost a step 3 s), 4 experts of hidden size 64, top-2, and a shared
    expert; a one-layer vision tower that text batches leave unused. Imported here: its module needs
    flash-linear-attention (``fla``), which only this family uses."""
    from torchtitan.models import qwen3_5

    dim = 64
    spec = qwen3_5.model_registry("debugmodel_moe", moe_comm_backend="standard")
    layers = qwen3_5._build_qwen35_moe_layers(
        rope=qwen3_5.MRoPE.Config(dim=8, max_seq_len=4096, theta=10_000_000.0, mrope_section=[2, 1, 1]),
        attn_backend="flex",
        n_layers=2,
        full_attention_interval=2,
        dim=dim,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        rotary_dim=8,
        moe_hidden_dim=64,
        num_experts=4,
        top_k=2,
        shared_expert_hidden_dim=64,
        n_key_heads=2,
        n_value_heads=4,
        key_head_dim=16,
        value_head_dim=16,
        moe_comm_backend="standard",
    )
    vision = qwen3_5._qwen35_vision_encoder_config(
        dim=32,
        ffn_dim=64,
        num_layers=1,
        num_heads=2,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=dim,
        num_position_embeddings=64,
    )
    return _tiny_decoder(spec, qwen3_5, layers, norm=qwen3_5._offset_norm(dim), vision_encoder=vision)


MODELS: dict[tuple[str, str], Callable[[], ModelSpec]] = {
    ("llama3", "debugmodel"): lambda: llama3.model_registry("debugmodel"),
    ("llama3", "8B"): lambda: llama3.model_registry("8B"),
    ("llama3", "tiny"): _llama3_tiny,
    ("qwen3", "tiny"): _qwen3_tiny,
    ("qwen3", "tiny_moe"): lambda: _qwen3_tiny(moe=True),
    ("qwen3", "debugmodel_moe"): lambda: qwen3.model_registry("debugmodel_moe"),
    ("deepseek_v3", "tiny"): _deepseek_v3_tiny,
    ("kimi_k2_7", "tiny"): _kimi_k2_7_tiny,
    ("gpt_oss", "tiny"): _gpt_oss_tiny,
    ("qwen3_5", "tiny"): _qwen3_5_tiny,
}


def model_spec(family: str, flavor: str) -> ModelSpec:
    """``family``'s ``flavor`` with SDPA attention (but where attention sinks need FlexAttention's
    log-sum-exp) and, on a CPU, SUM reductions and experts in their own dtype."""
    spec = MODELS[family, flavor]()
    for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        if not isinstance(parent, GptOssAttention.Config):
            setattr(parent, attr, ScaledDotProductAttention.Config())
    spec.parallelize_fn = _on_cpu(spec.parallelize_fn)
    return spec


KILL = "kill replica=1 rank=1 step=5 phase=backward"
"""The jobs' failure: a rank of replica 1 SIGKILLed mid-backward at step 5."""


def cpu_job(
    name: str, spec: ModelSpec, parallelism: ParallelismConfig | None = None, fault_plan: str = KILL
) -> Trainer.Config:
    """The CPU jobs' common settings (as in their TOMLs): 2 replica groups x 2 FSDP ranks unless
    ``parallelism`` says otherwise, float32 parameters, 30 steps of 16 samples of 128 tokens, the
    synthetic corpus, one injected failure (``fault_plan``), the failed group restarted and rejoined."""
    return Trainer.Config(
        dump_folder=f"./outputs/{name}",
        hf_assets_path=ASSETS,
        model_spec=spec,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=5, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ),
        training=TrainingConfig(
            local_batch_size=2,
            global_batch_size=16,
            seq_len=128,
            max_norm=1.0,
            steps=30,
            gc_freq=50,
            mixed_precision_param="float32",
            disable_cuda_graphs=True,
        ),
        dataloader=BaseDataLoader.Config(dataset="synthetic", dataset_path="./data/synthetic"),
        metrics=MetricsProcessor.Config(log_freq=5),
        parallelism=parallelism or ParallelismConfig(data_parallel_replicate_degree=2, data_parallel_shard_degree=2),
        activation_checkpoint=None,
        checkpoint=CheckpointManager.Config(enable=False),
        debug=DebugConfig(seed=42),  # every replica group must initialize identical weights
        recover=Recover(
            enable=True,
            policy="balanced",
            min_replicas=1,
            fault_plan=fault_plan,
            max_restarts=3,
            digest_interval=10,
            heartbeat_interval_s=0.1,
            heartbeat_timeout_s=5.0,
        ),
    )


def llama3_debug_cpu() -> Trainer.Config:
    """The default job (``train_configs/llama3_debug_cpu.toml``): llama3 debugmodel, 2 replica groups x
    2 FSDP ranks on CPU, a rank of replica 1 SIGKILLed mid-backward at step 5, the group restarted and
    rejoined from replica 0's state. Failure-free twin: ``--recover.fault_plan none``."""
    return cpu_job("llama3_debug_cpu", model_spec("llama3", "debugmodel"))


def llama3_exact_cpu() -> Trainer.Config:
    """``train_configs/llama3_exact_cpu.toml``: the default job with ``[recover] exact`` and a global
    batch of 48 (M = 12), which 2, 3 and 4 replica groups divide; a parameter digest every step."""
    config = cpu_job("llama3_exact_cpu", model_spec("llama3", "debugmodel"))
    config.training.global_batch_size = 48
    config.recover.exact, config.recover.digest_interval = True, 1
    return config


def llama3_tiny_cpu() -> Trainer.Config:
    """The default job with the ``tiny`` flavor: the tests' model (``--model.flavor tiny`` on 0.2)."""
    return cpu_job("llama3_debug_cpu", model_spec("llama3", "tiny"))


def qwen3_debug_cpu() -> Trainer.Config:
    """``train_configs/qwen3_debug_cpu.toml``: the default job's layout and failure with qwen3 ``tiny``."""
    return cpu_job("qwen3_debug_cpu", model_spec("qwen3", "tiny"))


def _expert_parallel_job(name: str, spec: ModelSpec) -> Trainer.Config:
    """The default job's layout with each group's experts sharded over its 2 ranks (expert parallelism), a
    rank of replica 1 SIGKILLed at step 5 inside an MoE layer, after its tokens went out to the other
    rank's experts; 100 steps, so the restarted group is back before the end."""
    config = cpu_job(
        name,
        spec,
        ParallelismConfig(data_parallel_replicate_degree=2, data_parallel_shard_degree=2, expert_parallel_degree=2),
        fault_plan="kill replica=1 rank=1 step=5 phase=experts",
    )
    config.training.steps = 100  # a tiny step takes about 0.6 s: 30 of them end before a restart is back
    return config


def qwen3_moe_cpu() -> Trainer.Config:
    """``train_configs/qwen3_moe_cpu.toml``: qwen3 ``tiny_moe`` in ``_expert_parallel_job``."""
    return _expert_parallel_job("qwen3_moe_cpu", model_spec("qwen3", "tiny_moe"))


def deepseek_v3_cpu() -> Trainer.Config:
    """deepseek_v3 ``tiny`` (0.2's ``--model.name deepseek_v3_recover --model.flavor tiny``) in
    ``_expert_parallel_job``."""
    return _expert_parallel_job("deepseek_v3_cpu", model_spec("deepseek_v3", "tiny"))


def qwen3_moe_debug_cpu() -> Trainer.Config:
    """qwen3's own ``debugmodel_moe`` (64 experts, top-8, 8 layers) in the default job's layout and failure."""
    return cpu_job("qwen3_moe_debug_cpu", model_spec("qwen3", "debugmodel_moe"))


def kimi_k2_7_cpu() -> Trainer.Config:
    """Kimi K2's text tower at ``tiny`` size (``_kimi_k2_7_tiny``) in ``_expert_parallel_job``."""
    return _expert_parallel_job("kimi_k2_7_cpu", model_spec("kimi_k2_7", "tiny"))


def gpt_oss_cpu() -> Trainer.Config:
    """gpt_oss ``tiny`` (0.2's ``--model.name gpt_oss_recover --model.flavor tiny``) in
    ``_expert_parallel_job``; on a CPU its FlexAttention runs as the CPU shim's dense equivalent."""
    return _expert_parallel_job("gpt_oss_cpu", model_spec("gpt_oss", "tiny"))


def qwen3_5_cpu() -> Trainer.Config:
    """Qwen3.5's hybrid MoE decoder at tiny size (``_qwen3_5_tiny``) in ``_expert_parallel_job``; on a
    CPU its gated DeltaNet runs as the CPU shim's recurrence. Needs ``fla-core`` (TorchTitan 0.3.0's
    environment has it)."""
    return _expert_parallel_job("qwen3_5_cpu", model_spec("qwen3_5", "tiny"))


def llama3_tp_cpu() -> Trainer.Config:
    """``train_configs/llama3_tp_cpu.toml``: 2 replica groups x (FSDP 2 x TP 2) on CPU."""
    return cpu_job(
        "llama3_tp_cpu",
        model_spec("llama3", "debugmodel"),
        ParallelismConfig(data_parallel_replicate_degree=2, data_parallel_shard_degree=2, tensor_parallel_degree=2),
    )


def llama3_pp_cpu() -> Trainer.Config:
    """``train_configs/llama3_pp_cpu.toml``: 2 replica groups x (2 pipeline stages (1F1B) x FSDP 2) on
    CPU, 2 pipeline microbatches per replica microbatch; a last-stage rank is the one killed."""
    return cpu_job(
        "llama3_pp_cpu",
        model_spec("llama3", "debugmodel"),
        ParallelismConfig(
            data_parallel_replicate_degree=2,
            data_parallel_shard_degree=2,
            pipeline_parallel_degree=2,
            pipeline_parallel_schedule="1F1B",
            pipeline_parallel_microbatch_size=1,
        ),
        fault_plan="kill replica=1 rank=3 step=5 phase=backward",
    )


def gpu_job(name: str, parallelism: ParallelismConfig, global_batch_size: int) -> Trainer.Config:
    """The GPU jobs' common settings (as in their TOMLs): llama3 8B in bfloat16 parameters, seq_len 8192,
    selective activation checkpointing, c4 prepared by ``titan_recover.data prepare``, a DCP checkpoint
    every 500 steps as a backstop only, no injected failure. CUDA graphs stay on (TorchTitan 0.3's
    default): the plugin reads each microbatch's loss before the next replay, and a fault plan that
    fires inside the graphed forward/backward is refused at start."""
    spec = model_spec("llama3", "8B")
    return Trainer.Config(
        dump_folder=f"./outputs/{name}",
        hf_assets_path="./assets/hf/Llama-3.1-8B",  # tokenizer: TorchTitan's scripts/download_hf_assets.py
        model_spec=spec,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=200),
        training=TrainingConfig(
            local_batch_size=1, global_batch_size=global_batch_size, seq_len=8192, max_norm=1.0, steps=1000
        ),
        dataloader=BaseDataLoader.Config(dataset="c4", dataset_path="./data/c4_llama3"),
        metrics=MetricsProcessor.Config(log_freq=10),
        parallelism=parallelism,
        activation_checkpoint=SelectiveAC.Config(),
        checkpoint=CheckpointManager.Config(enable=True, folder="checkpoint", interval=500),
        debug=DebugConfig(seed=42),
        recover=Recover(
            enable=True,
            policy="balanced",
            min_replicas=1,
            fault_plan="none",
            max_restarts=3,
            heartbeat_timeout_s=10.0,
            collective_timeout_s=120.0,
            replicate_backend="auto",
        ),
    )


def llama3_8b_hsdp_gpu() -> Trainer.Config:
    """``train_configs/llama3_8b_hsdp_gpu.toml``: llama3 8B, 2 replica groups (one per node) x FSDP over
    a node's 8 GPUs; M = 64 / (1 x 8) = 8 microbatches per step. Not run: no GPU was lent."""
    return gpu_job(
        "llama3_8b_hsdp", ParallelismConfig(data_parallel_replicate_degree=2, data_parallel_shard_degree=8), 64
    )


def llama3_8b_hsdp_tp_gpu() -> Trainer.Config:
    """``train_configs/llama3_8b_hsdp_tp_gpu.toml``: llama3 8B, 2 replica groups x (FSDP 4 x TP 2) inside
    a node; M = 32 / (1 x 4) = 8 microbatches per step. Not run: no GPU was lent."""
    return gpu_job(
        "llama3_8b_hsdp_tp",
        ParallelismConfig(data_parallel_replicate_degree=2, data_parallel_shard_degree=4, tensor_parallel_degree=2),
        32,
    )
