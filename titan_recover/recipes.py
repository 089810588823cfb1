"""The plugin's TorchTitan 0.3 configs: ``--module titan_recover.recipes --config <name>`` (they live
in the adapter, ``titan_recover.titan.recipes``, since they are made of TorchTitan's components)."""

from titan_recover.titan.recipes import (
    deepseek_v3_cpu,
    gpt_oss_cpu,
    kimi_k2_7_cpu,
    llama3_8b_hsdp_gpu,
    llama3_8b_hsdp_tp_gpu,
    llama3_debug_cpu,
    llama3_exact_cpu,
    llama3_pp_cpu,
    llama3_tiny_cpu,
    llama3_tp_cpu,
    qwen3_5_cpu,
    qwen3_debug_cpu,
    qwen3_moe_cpu,
    qwen3_moe_debug_cpu,
)

__all__ = [
    "deepseek_v3_cpu",
    "gpt_oss_cpu",
    "kimi_k2_7_cpu",
    "llama3_8b_hsdp_gpu",
    "llama3_8b_hsdp_tp_gpu",
    "llama3_debug_cpu",
    "llama3_exact_cpu",
    "llama3_pp_cpu",
    "llama3_tiny_cpu",
    "llama3_tp_cpu",
    "qwen3_5_cpu",
    "qwen3_debug_cpu",
    "qwen3_moe_cpu",
    "qwen3_moe_debug_cpu",
]
