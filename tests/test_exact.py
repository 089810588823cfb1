"""The fixed-point sums of ``[recover] exact``: the same bits in any order and any split over groups."""

import math
import random

import pytest
import torch

from titan_recover.rank.exact import (
    FIRST_BOUND,
    MARGIN_BITS,
    ExactSum,
    NonFinite,
    exponent,
    grid_exponent,
    largest_exponent,
)

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def microbatch_grads(m: int, n: int, seed: int = 0, scale: float = 1.0) -> list[list[torch.Tensor]]:
    """Per microbatch, two "parameters" of gradient-like float32 values over 6 orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        flat = torch.randn(n, generator=g) * torch.logspace(-6, 0, n) * scale
        out.append([flat[: n // 3], flat[n // 3 :]])
    return out


def split_sum(
    grads: list[list[torch.Tensor]], groups: list[list[int]], bound: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group sums its microbatches in its own order; then the replicate all-reduce (a plain sum)."""
    total = torch.zeros(sum(p.numel() for p in grads[0]), dtype=torch.float64)
    histogram = None
    for group in groups:
        mine = ExactSum(total.numel(), len(grads), CPU, bound)
        for m in group:
            mine.add(grads[m], f"microbatch {m}")
        total += mine.total
        histogram = mine.histogram.clone() if histogram is None else histogram + mine.histogram
    assert histogram is not None
    return total, histogram


def random_split(rng: random.Random, m: int) -> list[list[int]]:
    order = rng.sample(range(m), m)
    cut = sorted(rng.sample(range(1, m), rng.randint(0, 3)))  # 1 to 4 replica groups
    return [order[a:b] for a, b in zip([0, *cut], [*cut, m])]


def test_any_order_and_any_split_over_groups_gives_the_same_bits() -> None:
    grads = microbatch_grads(8, 4096)
    reference, _ = split_sum(grads, [list(range(8))], FIRST_BOUND)
    rng, float_sums = random.Random(0), set()
    for _ in range(20):
        groups = random_split(rng, 8)
        total, _ = split_sum(grads, groups, FIRST_BOUND)
        assert torch.equal(total, reference)
        order = [m for g in groups for m in g]
        float_sums.add(sum((torch.cat(grads[m]) for m in order), torch.zeros(4096)).numpy().tobytes())
    assert len(float_sums) > 1  # the float32 sums in those orders do differ: the test can fail
    parts = [reference[: 4096 // 3].float(), reference[4096 // 3 :].float()]  # copied into the gradients
    ExactSum(4096, 8, CPU).scale(parts)
    wide = sum((torch.cat(g).double() for g in grads), torch.zeros(4096, dtype=torch.float64))
    exact = torch.cat(parts)
    assert float((exact.double() - wide).abs().max()) <= float(wide.abs().max()) * 2**-23  # float32 rounding of the sum


def test_an_overflowing_step_is_seen_alike_and_redone_on_the_same_coarser_grid() -> None:
    grads = microbatch_grads(8, 1024, seed=1, scale=2.0**12)  # far above the first grid's 2**9
    rng = random.Random(1)
    redone = set()
    for _ in range(10):
        groups = random_split(rng, 8)
        _, histogram = split_sum(grads, groups, FIRST_BOUND)
        bound = ExactSum(1, 8, CPU).redo_bound(histogram)
        biggest = max(float(torch.cat(g).abs().max()) for g in grads)
        assert bound == math.frexp(biggest)[1] > FIRST_BOUND  # every member reads the same histogram
        total, again = split_sum(grads, groups, bound)
        assert ExactSum(1, 8, CPU, bound).redo_bound(again) is None
        redone.add(total.numpy().tobytes())
        assert torch.equal(total, total.round())  # integers throughout
    assert len(redone) == 1


def test_terms_at_the_bound_sum_exactly_in_float64() -> None:
    bound, terms = 3, 8
    top = torch.nextafter(torch.full((4,), 2.0**bound), torch.zeros(4))  # the largest float32 below 2**bound
    mine = ExactSum(4, terms, CPU, bound)
    for _ in range(terms):
        mine.add([top], "the top")
        mine.add([-top], "the bottom")
    assert float(mine.total.abs().max()) == 0.0
    for _ in range(terms):
        mine.add([top], "the top")
    assert 0 < float(mine.total.max()) < 2.0**53  # every partial sum an integer float64 holds exactly
    out = mine.total.float()
    mine.scale([out])
    assert torch.equal(out, top * terms)


def test_all_zero_gradients_sum_to_zero_and_keep_the_bound() -> None:
    mine = ExactSum(16, 4, CPU, bound=5)
    for _ in range(4):
        mine.add([torch.zeros(16)], "zeros")
    assert float(mine.total.abs().sum()) == 0.0 and largest_exponent(mine.histogram) is None
    assert mine.redo_bound(mine.histogram) is None
    mine.committed(mine.histogram)
    assert mine.bound == 5
    mine.add([torch.full((16,), 0.75)], "three quarters")
    mine.committed(mine.histogram)
    assert mine.bound == 0 + MARGIN_BITS  # 0.75 < 2**0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nan_or_inf_is_never_summed(bad: float) -> None:
    mine = ExactSum(3, 2, CPU)
    with pytest.raises(NonFinite, match="step 7 microbatch 2 holds a NaN or an inf"):
        mine.add([torch.tensor([1.0, bad, 0.5])], "step 7 microbatch 2")
    assert float(mine.total.abs().sum()) == 0.0


def test_grid_exponent_leaves_room_for_the_terms() -> None:
    assert grid_exponent(0, 1) == -52
    assert grid_exponent(0, 8) == -49 and grid_exponent(0, 9) == -48
    with pytest.raises(ValueError, match="at least one term"):
        grid_exponent(0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shaped_and_empty_shards_land_on_their_own_grid_points(dtype: torch.dtype) -> None:
    """A rank's shards as FSDP leaves them (matrices, vectors, an empty shard) go onto the flat sum in
    parameter order, each element rounded once to the grid: the same points as one element at a time."""
    g = torch.Generator().manual_seed(3)
    grads = [
        (torch.randn(3, 5, generator=g) * 0.1).to(dtype),
        torch.zeros(0, dtype=dtype),
        (torch.randn(7, generator=g) * 10).to(dtype),
    ]
    mine = ExactSum(22, 4, CPU, bound=FIRST_BOUND)
    mine.add(grads, "shards")
    step = 2.0 ** grid_exponent(FIRST_BOUND, 4)
    expected = [round(float(v) / step) for t in grads for v in t.flatten()]
    assert mine.total.tolist() == expected
    assert largest_exponent(mine.histogram) == exponent(max(float(t.abs().max()) for t in grads if t.numel()))
