"""CPU support for TorchTitan, in one place.

TorchTitan assumes CUDA: ``torchtitan.tools.utils`` falls back to ``"cuda"`` when no
accelerator is present, and several modules bind ``device_type``/``device_module`` at
import time, so the adapter (``titan_recover.titan``) imports TorchTitan inside
``cpu_device()``. On gloo, FSDP2's PREMUL_SUM reduction (used when TorchTitan sets a gradient
divide factor) is rejected, so FSDP modules are switched to plain SUM reductions.
TorchTitan's profiler passes no device activity on a CPU, which torch rejects: it is dropped.
Parameters are float32 on a CPU unless the job names a precision (``precision_args``).
Mixture-of-experts layers count tokens per expert with ``torch.histc``, which has no CPU kernel
for integer indices, and permute tokens with a Triton kernel: on a CPU the count is exact
integer arithmetic, the permutation TorchTitan's own CPU version, and the experts' grouped
matmul keeps the parameters' dtype instead of casting to bfloat16 (``moe_on_cpu``). TorchTitan 0.3's
expert parallelism exchanges tokens with a list all-to-all of uneven chunks, which gloo refuses: on a CPU
such an exchange goes through ``all_to_all_single``. FlexAttention has no CPU backward: gpt_oss's runs as
dense attention there (``flex_attention_on_cpu``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from types import SimpleNamespace
from typing import Any, Iterator

import tomli
import torch

PRECISION_FLAGS = ("--training.mixed_precision_param", "--training.mixed-precision-param")


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


class _CpuProfile(torch.profiler.profile):
    """TorchTitan lists ``[CPU, <device activity>]`` and the device activity is None when there
    is no accelerator, which torch rejects ("Expected ProfilerActivity or dict, got NoneType")."""

    def __init__(self, *args: Any, activities: Any = None, **kwargs: Any) -> None:
        if activities is not None:
            activities = [a for a in activities if a is not None]
        super().__init__(*args, activities=activities, **kwargs)


@contextlib.contextmanager
def cpu_device() -> Iterator[None]:
    """Inside it, torch's device look-ups answer "cpu" when there is no accelerator (and torch's
    profiler drops the missing device activity for good); the TorchTitan adapter imports
    TorchTitan inside it, since TorchTitan binds its device type at import."""
    if not needed():
        yield
        return
    torch.profiler.profile = _CpuProfile  # type: ignore[misc]  # the shim swaps torch's class for its CPU stand-in
    torch.histc = _on_cpu(torch.histc, _histc)
    torch.distributed.all_to_all = _on_cpu(torch.distributed.all_to_all, _all_to_all)
    import torch._utils as tu

    saved = tu._get_available_device_type, tu._get_device_module
    tu._get_available_device_type = lambda: "cpu"
    tu._get_device_module = lambda device_type=None: _CpuDeviceModule()  # type: ignore[assignment]  # torch's is an lru_cache
    try:
        yield
    finally:
        tu._get_available_device_type, tu._get_device_module = saved


def _on_cpu(original: Any, shim: Any) -> Any:
    """``original`` wrapped by ``shim`` (called with it first), once: a real function with the
    original's name, as torch.compile's tracer expects of torch's functions."""
    if getattr(original, "_cpu_shim", False):
        return original

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return shim(original, *args, **kwargs)

    wrapper._cpu_shim = True  # type: ignore[attr-defined]  # marks it wrapped: the shim is applied once
    return wrapper


def _histc(
    histc: Any, input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0, **kwargs: Any
) -> torch.Tensor:
    """``torch.histc``, and for integer tensors on a CPU (which it refuses) the same count done
    exactly: bins of width (max - min) / bins, a value equal to max in the last one."""
    if input.is_floating_point() or input.device.type != "cpu" or kwargs or not min < max:
        return histc(input, bins, min, max, **kwargs)
    low, high = int(min), int(max)
    if (low, high) != (min, max):
        raise ValueError(f"histc of integers with fractional bounds [{min}, {max}] is not supported on a CPU")
    values = input.reshape(-1)
    values = values[(values >= low) & (values <= high)]
    index = ((values - low) * bins // (high - low)).clamp_(max=bins - 1)
    return torch.bincount(index, minlength=bins).to(input.dtype)


def _all_to_all(
    all_to_all: Any, outputs: list[torch.Tensor], inputs: list[torch.Tensor], group: Any = None, async_op: bool = False
) -> Any:
    """``torch.distributed.all_to_all``, and for CPU chunks of different lengths (gloo's takes equal chunks
    only, "invalid tensor size at index 1") the same exchange as one ``all_to_all_single`` with splits:
    TorchTitan 0.3's expert parallelism sends each rank as many tokens as its experts were routed."""
    if async_op or inputs[0].device.type != "cpu" or len({t.shape for t in (*outputs, *inputs)}) == 1:
        return all_to_all(outputs, inputs, group=group, async_op=async_op)
    received = inputs[0].new_empty((sum(len(t) for t in outputs), *outputs[0].shape[1:]))
    sizes = [len(t) for t in outputs]
    torch.distributed.all_to_all_single(
        received,
        torch.cat([t.reshape(len(t), *outputs[0].shape[1:]) for t in inputs]),
        sizes,
        [len(t) for t in inputs],
        group=group,
    )
    for output, part in zip(outputs, received.split(sizes)):
        output.copy_(part)
    return None


def _permute_on_cpu(generate: Any, tokens_per_expert: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """TorchTitan's token permutation, with its CPU implementation for CPU tensors (it never asks
    for it, and its Triton kernel has no CPU driver)."""
    kwargs.setdefault("use_cpu", tokens_per_expert.device.type == "cpu")
    return generate(tokens_per_expert, *args, **kwargs)


def _grouped_experts(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, num_tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """The SwiGLU experts as TorchTitan computes them with grouped matmuls, in the parameters' dtype."""
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    h = torch.nn.functional.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)


def _experts_in_own_dtype(experts: Any, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """TorchTitan 0.3's ``GroupedExperts.forward`` without its cast to bfloat16 (its weights are
    plain tensors or, sharded, DTensors whose local shards the experts compute with)."""
    w1, w2, w3 = (
        w.to_local() if hasattr(w, "to_local") else w for w in (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD)
    )
    return _grouped_experts(w1, w2, w3, x, num_tokens_per_expert)


def _gpt_oss_experts_in_own_dtype(experts: Any, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """TorchTitan 0.3's ``GptOssGroupedExperts.forward`` (biased SwiGLU experts) without its casts
    to bfloat16, for a CPU without tensor parallelism."""
    from torchtitan.models.gpt_oss.moe import swiglu

    w1, b1, w2, b2 = (
        w.to_local() if hasattr(w, "to_local") else w
        for w in (experts.mlp1_weight_EGD, experts.mlp1_bias_EG, experts.mlp2_weight_EDF, experts.mlp2_bias_ED)
    )
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    rows = torch.cat([num_tokens_per_expert, (x.shape[0] - offsets[-1]).unsqueeze(0).to(offsets.dtype)]).long()

    def biases(b: torch.Tensor) -> torch.Tensor:  # each row's expert's bias; zeros for the padding rows
        return torch.cat([b, b.new_zeros(1, b.shape[-1])]).repeat_interleave(rows, dim=0, output_size=x.shape[0])

    h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets) + biases(b1)
    h = swiglu(h, limit=experts.swiglu_limit)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets) + biases(b2)


_OWN_DTYPE_EXPERTS = {"GroupedExperts": _experts_in_own_dtype, "GptOssGroupedExperts": _gpt_oss_experts_in_own_dtype}
"""TorchTitan 0.3's expert classes, by name, and their forward in the parameters' dtype."""


def moe_on_cpu(model: torch.nn.Module) -> torch.nn.Module:
    """On a CPU, ``model``'s experts run grouped matmuls in their own dtype and (TorchTitan 0.2) permute
    tokens with TorchTitan's CPU code; returns ``model``. Both lines' grouped matmul casts to bfloat16
    (emulated and lossy here), and the per-expert loop that 0.2's llama4, deepseek_v3 and gpt_oss pick
    without an SM90 GPU writes a whole-tensor gradient per expert in backward: 34 s of backward for
    qwen3's 64-expert debugmodel_moe against 1.2 s with grouped matmuls, whose float32 results equal
    the loop's. 0.3's token permutation is plain torch already."""
    experts = next((m for m in model.modules() if type(m).__name__ in _OWN_DTYPE_EXPERTS), None)
    if not needed() or experts is None:
        return model
    if not hasattr(experts, "use_grouped_mm"):  # TorchTitan 0.3
        cls, forward = type(experts), _OWN_DTYPE_EXPERTS[type(experts).__name__]
        cls.forward = _on_cpu(cls.forward, lambda _, *args: forward(*args))
        return model
    import torchtitan.models.moe.moe as moe
    import torchtitan.models.moe.utils as moe_utils

    moe_utils.generate_permute_indices = _on_cpu(moe_utils.generate_permute_indices, _permute_on_cpu)
    moe._run_experts_grouped_mm = _grouped_experts
    for module in model.modules():
        if isinstance(module, moe.GroupedExperts):
            module.use_grouped_mm = True
    return model


def _dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, scale: float | None, enable_gqa: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's output and log-sum-exp (natural log, as FlexAttention's) for ``(B, N, L, H)``
    tensors, as dense math: the block mask's own ``mask_mod`` made a boolean mask."""
    from torch.nn.attention.flex_attention import create_mask

    if enable_gqa:
        k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
    batch, heads = block_mask.shape[:2]
    mask = create_mask(block_mask.mask_mod, batch, heads, q.size(2), k.size(2), device=q.device)
    scores = (q @ k.transpose(-2, -1)) * (q.size(-1) ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def _dense_flex_0_3(flex: Any, module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
    """TorchTitan 0.3's ``FlexAttention.forward`` (``(B, L, N, H)`` tensors; the log-sum-exp goes to
    ``out_transform``, which gpt_oss's attention sinks are) on CPU tensors."""
    if q.device.type != "cpu" or kw.get("score_mod") is not None:
        return flex(module, q, k, v, **kw)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, N, L, H)
    out, lse = _dense_attention(q, k, v, kw["attention_masks"], kw.get("scale"), kw.get("enable_gqa", False))
    transform = kw.get("out_transform")
    return out.transpose(1, 2) if transform is None else transform(out.transpose(1, 2), lse.transpose(1, 2))


def _dense_flex_0_2(flex: Any, module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
    """TorchTitan 0.2's ``FlexAttentionWrapper.forward`` (``(B, N, L, H)`` tensors, the log-sum-exp
    returned beside the output if ``return_lse``) on CPU tensors."""
    if q.device.type != "cpu" or kw.get("score_mod") is not None or kw.get("block_mask") is None:
        return flex(module, q, k, v, **kw)
    out, lse = _dense_attention(q, k, v, kw["block_mask"], kw.get("scale"), kw.get("enable_gqa", False))
    return (out, lse) if kw.get("return_lse") else out


_DENSE_FLEX = {"FlexAttention": _dense_flex_0_3, "FlexAttentionWrapper": _dense_flex_0_2}
"""Each line's FlexAttention module, by class name, and its forward as dense math on a CPU."""


def flex_attention_on_cpu(model: torch.nn.Module) -> torch.nn.Module:
    """On a CPU, ``model``'s FlexAttention layers compute dense attention (torch has no FlexAttention
    backward there); returns ``model``. Only gpt_oss keeps FlexAttention on a CPU: its attention sinks
    need the log-sum-exp, which SDPA does not return (0.3's recipes make every other attention SDPA)."""
    flex = next((m for m in model.modules() if type(m).__name__ in _DENSE_FLEX), None)
    if needed() and flex is not None:
        cls = type(flex)
        cls.forward = _on_cpu(cls.forward, _DENSE_FLEX[cls.__name__])
    return model


def _recurrent_gated_delta(
    kernel: Any,
    module: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    **varlen: Any,
) -> torch.Tensor:
    """0.3's ``GatedDeltaKernel.forward`` (qwen3_5's gated DeltaNet: Q/K heads repeated to V's, then
    flash-linear-attention's chunked kernel with its L2 norm of Q and K) as fla's own recurrent
    reference, in float32: the same rule token by token, which tiny models' sequences afford. Packed
    documents (``cu_seqlens``) are not taken: the recipes give each sample one document."""
    if varlen.get("cu_seqlens") is not None:
        raise NotImplementedError("titan_recover's CPU gated DeltaNet takes one document per sample (no cu_seqlens)")
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    if q.shape[2] != v.shape[2]:
        q, k = (x.repeat_interleave(v.shape[2] // q.shape[2], dim=2) for x in (q, k))
    q, k = (torch.nn.functional.normalize(x.float(), dim=-1) for x in (q, k))
    return naive_recurrent_gated_delta_rule(q, k, v, beta, g)[0].to(v.dtype)


def gated_delta_on_cpu(model: torch.nn.Module) -> torch.nn.Module:
    """On a CPU, ``model``'s gated DeltaNet kernels (qwen3_5 on 0.3: flash-linear-attention's Triton
    kernels, which need a GPU) run as ``_recurrent_gated_delta``; returns ``model``."""
    kernel = next((m for m in model.modules() if type(m).__name__ == "GatedDeltaKernel"), None)
    if needed() and kernel is not None:
        cls = type(kernel)
        cls.forward = _on_cpu(cls.forward, _recurrent_gated_delta)
    return model


def force_sum_reduction(model: torch.nn.Module) -> torch.nn.Module:
    """On CPU, make FSDP2 reduce ``model``'s gradients with SUM (gloo rejects PREMUL_SUM/AVG); returns it.

    TorchTitan already disables FSDP's gradient division and scales the loss by
    the global token count, so SUM gives the same gradients.
    """
    from torch.distributed.fsdp import FSDPModule

    if not needed():
        return model
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def _names_precision(argv: list[str], config_file: str | None) -> bool:
    """Whether the command line or the TOML (None: a Python recipe, which always does) chooses the
    parameter precision."""
    if config_file is None or any(a.split("=", 1)[0] in PRECISION_FLAGS for a in argv):
        return True
    try:
        with open(config_file, "rb") as f:
            return "mixed_precision_param" in tomli.load(f).get("training", {})
    except OSError:
        return False  # no TOML: TorchTitan's defaults apply


def precision_args(argv: list[str], job_config: Any, config_file: str | None) -> list[str]:
    """On a CPU, parameters are float32 unless the TOML or the command line asks otherwise.

    TorchTitan's default, bfloat16, is emulated on CPUs without AVX-512-BF16/AMX: a step of
    the default job took 15.4 s against 1.16 s in float32 on an AVX2 machine (13x), and a
    result must not depend on which CPU ran it. Returns ``argv`` with the choice made explicit,
    so ranks, coordinator and stock runs all see it; ``job_config`` is updated to match.
    """
    if not needed() or _names_precision(argv, config_file):
        return argv
    job_config.training.mixed_precision_param = "float32"
    return [*argv, PRECISION_FLAGS[0], "float32"]
