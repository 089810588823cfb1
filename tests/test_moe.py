"""Mixture-of-experts models: the CPU shim's pieces, and each MoE family that trains on a CPU killed
(mid-backward, or with expert parallelism inside the experts' token exchange) and rejoined against its
failure-free twin in exact mode, so every loss, parameter and expert bias (the parameter digests cover
persistent buffers) must be the same bits; qwen3 on TorchTitan 0.3 (the lines tier). Each model's
optimizer balances experts (deepseek_v3, llama4, gpt_oss, 0.3's qwen3 and Kimi K2): the bias must move,
from the counts of every group's microbatches. gpt_oss's FlexAttention (its attention sinks need the log-sum-exp) has no
backward on a CPU: there the CPU shim computes it as dense attention; qwen3_5's gated DeltaNet has
GPU kernels only: there the shim runs flash-linear-attention's recurrent reference. 0.3's Kimi K2,
gpt_oss and qwen3_5 recipes run by hand (``TORCHTITAN=0.3.0 ./run_tests.sh tests/test_moe.py``): CI's 0.3
tier has qwen3's only, for time."""

from pathlib import Path

import pytest
import torch
from conftest import SINGLES, run_job
from launcher_in_process import launch

from titan_recover.compare import compare_runs
from titan_recover.rank import balancing, transfer
from titan_recover.titan import cpu_shim
from titan_recover.titan.jobs import LINE

MOE = "the <family>_recover models are TorchTitan 0.2 registrations (0.3 builds its models in recipes)"
EXACT = ["--recover.exact", "--recover.digest_interval", "1", "--training.steps", "8"]
HOLD = "sleep replica=0 step=5 phase=optimizer seconds=120 until=epoch"  # the survivor waits for the rejoin
MID_BACKWARD = [*SINGLES, "--recover.fault_plan", f"kill replica=1 rank=0 step=3 phase=backward; {HOLD}"]
# expert parallelism over a 2-rank group: rank 1 dies in the middle MoE layer after its tokens went out to
# rank 0's experts, and rank 0 waits for its experts' outputs; the default 2 x 2 layout, M = 4
EP2_IN_EXPERTS = [
    "--parallelism.expert_parallel_degree",
    "2",
    "--recover.fault_plan",
    f"kill replica=1 rank=1 step=3 phase=experts; {HOLD}",
]


@pytest.mark.unit
@pytest.mark.parametrize(
    "values, bins, low, high",
    [([0, 3, 3, 1, 7, 7, 7], 8, 0, 8), ([2, 5, 9, 11, 12, -1, 13], 5, 2, 12), ([4, 4], 4, 0, 4), ([], 3, 0, 3)],
)
def test_the_integer_count_is_histc_on_the_same_values_as_floats(values: list, bins: int, low: int, high: int) -> None:
    ints = torch.tensor(values, dtype=torch.int64)
    counted = cpu_shim._histc(torch.histc, ints, bins=bins, min=low, max=high)
    assert counted.dtype == torch.int64
    assert counted.tolist() == torch.histc(ints.double(), bins=bins, min=low, max=high).long().tolist()


@pytest.mark.unit
def test_replicate_summed_counts_go_back_into_the_layers_buffers() -> None:
    layers = [torch.tensor([1.0, 0.0, 3.0]), torch.tensor([2.0, 2.0])]
    flat = balancing.gather(layers)
    assert flat.dtype == torch.float64 and flat.tolist() == [1, 0, 3, 2, 2]
    flat += torch.tensor([4.0, 1.0, 0.0, 0.0, 5.0], dtype=torch.float64)  # another group's counts
    balancing.scatter(layers, flat)
    assert [c.tolist() for c in layers] == [[5, 1, 3], [2, 7]]
    balancing.reset(layers)
    assert all(not c.any() for c in layers)


@pytest.mark.unit
def test_state_holds_persistent_buffers_and_not_a_steps_counts() -> None:
    class Moe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Linear(2, 4)
            self.register_buffer("expert_bias", torch.zeros(4))
            self.register_buffer("tokens_per_expert", torch.zeros(4), persistent=False)

    model = torch.nn.Sequential(Moe())
    assert [name for name, _ in transfer.persistent_buffers(model)] == ["0.expert_bias"]
    names = [name for name, _ in transfer.model_tensors(model)]
    assert names == ["0.gate.weight", "0.gate.bias", "0.expert_bias"]


@pytest.mark.unit
def test_the_dense_flex_attention_is_flex_attention_with_its_log_sum_exp() -> None:
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    def sliding_causal(b: object, h: object, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (q >= kv) & (q - kv < 16)

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 64, heads, 16, generator=gen) for heads in (4, 2, 2))  # (B, L, N, H): GQA
    mask = create_block_mask(sliding_causal, 2, None, 64, 64, device="cpu")
    q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))  # (B, N, L, H)
    out, aux = flex_attention(q_, k_, v_, block_mask=mask, scale=0.3, enable_gqa=True, return_aux=AuxRequest(lse=True))
    lse = aux.lse
    assert lse is not None
    as_0_3 = cpu_shim._dense_flex_0_3(
        None, None, q, k, v, attention_masks=mask, scale=0.3, enable_gqa=True, out_transform=lambda o, s: (o, s)
    )
    torch.testing.assert_close(as_0_3, (out.transpose(1, 2), lse.transpose(1, 2)), rtol=1e-5, atol=1e-5)
    as_0_2 = cpu_shim._dense_flex_0_2(
        None, None, q_, k_, v_, block_mask=mask, scale=0.3, enable_gqa=True, return_lse=True
    )
    torch.testing.assert_close(as_0_2, (out, lse), rtol=1e-5, atol=1e-5)


@pytest.mark.unit
@pytest.mark.lines
def test_the_cpu_gated_delta_rule_is_the_rule_with_normalized_queries_and_keys() -> None:
    """qwen3_5's DeltaNet kernel on a CPU against the gated delta rule written out here, token by token:
    the state decays by exp(g), takes the key's correction of its value scaled by beta, and is read by the
    query; Q/K heads repeated to V's 4, queries and keys L2-normalized, the query scaled by 1/sqrt(K)."""
    pytest.importorskip("fla", reason="flash-linear-attention: TorchTitan 0.3.0's environment has it")
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 32, 2, 8, generator=gen) for _ in range(2))  # (B, L, N, K), 2 key heads
    v = torch.randn(2, 32, 4, 8, generator=gen)  # 4 value heads
    g, beta = -torch.rand(2, 32, 4, generator=gen), torch.rand(2, 32, 4, generator=gen)
    got = cpu_shim._recurrent_gated_delta(None, None, q, k, v, g, beta)
    q, k = (torch.nn.functional.normalize(x.repeat_interleave(2, dim=2), dim=-1) for x in (q, k))
    state, want = torch.zeros(2, 4, 8, 8), []
    for t in range(32):
        state = state * g[:, t].exp()[..., None, None]
        correction = (v[:, t] - torch.einsum("bnk,bnkv->bnv", k[:, t], state)) * beta[:, t, :, None]
        state = state + torch.einsum("bnk,bnv->bnkv", k[:, t], correction)
        want.append(torch.einsum("bnk,bnkv->bnv", q[:, t] / 8**0.5, state))
    torch.testing.assert_close(got, torch.stack(want, dim=1), rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="one document per sample"):
        cpu_shim._recurrent_gated_delta(None, None, q, k, v, g, beta, cu_seqlens=torch.tensor([0, 16, 32]))


def on_0_2(name: str, fault: list[str]) -> object:
    """``name``'s tiny flavor, a 0.2.2 model, in the default job's TOML; its optimizer balances experts."""
    model = ["--model.name", name, "--model.flavor", "tiny"]
    return pytest.param("llama3_debug_cpu", model, fault, marks=pytest.mark.toml(MOE))


def on_0_3(recipe: str) -> object:
    """A TorchTitan 0.3 MoE recipe outside the lines tier (see the module's docstring)."""
    reason = "a TorchTitan 0.3 recipe (0.2's gpt_oss runs in its TOML case; Kimi K2 and qwen3_5 are 0.3's)"
    return pytest.param(recipe, [], EP2_IN_EXPERTS, marks=pytest.mark.skipif(LINE == "0.2", reason=reason))


@pytest.mark.parametrize(
    "config, model, fault",
    [
        on_0_2("deepseek_v3_recover", MID_BACKWARD),
        on_0_2("llama4_recover", EP2_IN_EXPERTS),
        on_0_2("gpt_oss_recover", EP2_IN_EXPERTS),
        pytest.param(  # qwen3's tiny MoE recipe
            "qwen3_moe_cpu",
            [],
            EP2_IN_EXPERTS,
            marks=[
                pytest.mark.lines,
                pytest.mark.skipif(
                    LINE == "0.2",
                    reason="for CI time, on TorchTitan 0.3 only, whose qwen3 balances experts (0.2's builds no hook; "
                    "0.2's kill in the experts' exchange is llama4's)",
                ),
            ],
        ),
        on_0_3("kimi_k2_7_cpu"),
        on_0_3("gpt_oss_cpu"),
        on_0_3("qwen3_5_cpu"),
    ],
    ids=[
        "deepseek_v3-mid-backward",
        "llama4-ep2-in-experts",
        "gpt_oss-ep2-in-experts",
        "qwen3-ep2-in-experts",
        "kimi_k2_7-recipe-ep2-in-experts",
        "gpt_oss-recipe-ep2-in-experts",
        "qwen3_5-recipe-ep2-in-experts",
    ],
)
def test_a_kill_keeps_every_bit_and_the_expert_bias(
    tmp_path: Path, config: str, model: list[str], fault: list[str]
) -> None:
    job = [*EXACT, *model]
    # the twin is one replica group: exact mode's bits are the same whatever the membership, and half the ranks
    alone = ["--parallelism.data_parallel_replicate_degree", "1", "--recover.fault_plan", "none"]
    reference = run_job(tmp_path / "reference", *fault, *job, *alone, config=config)
    assert reference.returncode == 0, reference.output[-3000:]
    run = run_job(tmp_path / "run", *fault, *job, config=config)
    assert run.returncode == 0, run.output[-3000:]
    assert run.of("failure") and run.of("rejoined"), run.output[-3000:]
    phase = fault[-1].split("phase=")[1].split(";")[0]
    assert [(e["replica"], e["phase"]) for e in run.of("fault_injected")][0] == (1, phase)
    result = compare_runs(reference.events, run.events, rel_tol=0.0, exact=True)
    assert not result.problems, result.problems
    assert result.steps == 8 and result.digest_steps == 8
    assert run.steps()[8]["members"] == [0, 1]
    biases = [e["buffers"] for e in reference.of("param_digest") if e["replica"] == 0]
    assert len(biases) == 8 and None not in biases
    assert len(set(biases)) > 1, biases  # moved by the balancing hook


@pytest.mark.lines
def test_a_fault_in_experts_is_refused_for_a_model_without_them(capfd: pytest.CaptureFixture[str]) -> None:
    r = launch(capfd, "--recover.fault_plan", "kill replica=1 step=2 phase=experts")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "phase=experts fires inside a mixture-of-experts layer" in r.stderr
    assert "choose phase=forward or backward" in r.stderr
