"""Order-independent gradient sums for ``[recover] exact``: the same bits whoever computed what.

Floating-point addition is not associative, so a gradient summed over microbatches (and then over
replica groups) depends on who computed which microbatch and in which order. In exact mode each
rank rounds every microbatch's gradient (its own shards, right after that microbatch's backward)
onto a fixed-point grid of step ``2**grid_exponent`` and adds the grid points into a total held
as integer-valued float64: float64 holds every integer below ``2**53`` exactly, so while the sum
stays below that every addition is exact, hence the same in any order, inside a group over its
microbatches and across groups in the replicate all-reduce. The total is converted back once.
(float64 rather than int64: the same bytes in the all-reduce, and no conversion copies; measured
19 ms instead of 24 ms per 5.3M-element microbatch on this CPU, 35 instead of 44 to convert back.)

The grid is the same on every member because it comes from committed data only: every term is
below ``2**bound``, where ``bound`` is the largest max-abs exponent of the previous committed
step's microbatch gradients plus ``MARGIN_BITS`` (``FIRST_BOUND`` before any step), and M terms
below that sum below ``2**53`` (``grid_exponent``). Each microbatch also counts its max-abs exponent in a
histogram that is summed with the gradients; a term at or above ``2**bound`` is left out, and
after the all-reduce every member reads the same histogram, so every member sees the overflow
alike and the step is redone with ``bound`` set to the step's largest exponent: the same grid
everywhere, a deterministic redo. A NaN or inf is never summed: every replica would compute it
again, so the run stops (``NonFinite``).
"""

from __future__ import annotations

import math
import os

import torch

HEADROOM_BITS = 52  # float64's exact integers (below 2**53), less one for the rounding of each term
MARGIN_BITS = 8  # a step's gradients may grow 256-fold over the last committed step's before a redo
FIRST_BOUND = 1 + MARGIN_BITS  # before any committed step: terms below 2**9
LOW_EXPONENT, HIGH_EXPONENT = -160, 140  # the histogram's range: float32 and bfloat16 max-abs exponents
BINS = HIGH_EXPONENT - LOW_EXPONENT + 1


class NonFinite(ValueError):
    """A microbatch's gradient holds a NaN or an inf."""


def grid_exponent(bound: int, terms: int) -> int:
    """The finest grid on which ``terms`` values below ``2**bound``, each rounded to it, sum
    exactly in float64: each is at most ``2**(bound - exponent) <= 2**HEADROOM_BITS / terms``."""
    if terms < 1:
        raise ValueError(f"a sum needs at least one term, got {terms}")
    return bound - HEADROOM_BITS + (terms - 1).bit_length()


def exponent(value: float) -> int:
    """The ``e`` with ``2**(e-1) <= value < 2**e`` for a finite ``value > 0``."""
    return math.frexp(value)[1]


def largest_exponent(histogram: torch.Tensor) -> int | None:
    """The largest exponent a (summed) histogram counts, or None when it counts nothing."""
    seen = torch.nonzero(histogram).flatten()
    return None if seen.numel() == 0 else int(seen[-1]) + LOW_EXPONENT


class ExactSum:
    """One rank's fixed-point sum of its microbatch gradients in a step, and the grid's bound.

    ``bound`` is trainer state: a rejoiner takes it from its donor with the parameters."""

    def __init__(self, numel: int, terms: int, device: torch.device, bound: int = FIRST_BOUND) -> None:
        self.terms, self.bound = terms, bound
        self.total = torch.zeros(numel, dtype=torch.float64, device=device)
        self.histogram = torch.zeros(BINS, dtype=torch.int64, device=device)

    def reset(self) -> None:
        """Forgets the step's terms (a new step, or a redo)."""
        self.total.zero_()
        self.histogram.zero_()

    def add(self, grads: list[torch.Tensor], where: str) -> None:
        """Adds one microbatch's gradient (this rank's shards, in parameter order); ``where``
        names the step and microbatch in a ``NonFinite``. One host sync (the largest magnitude, which
        decides the histogram bin and whether the terms fit the grid) instead of one per parameter,
        and multi-tensor (``_foreach``) kernels for the grid points: one launch per op on CUDA.
        ``aminmax`` rather than ``_foreach_norm(inf)``: 5 ms instead of 26 ms per 6.2M elements on CPU."""
        with torch.profiler.record_function("exact.add"):  # its share of a step in profiler traces (bench.exact_ops)
            self._add(grads, where)

    def _add(self, grads: list[torch.Tensor], where: str) -> None:
        live = [g for g in grads if g.numel()]
        if not live:
            return
        ends = torch.stack([end for g in live for end in torch.aminmax(g)])  # promotes a mixed list exactly
        biggest = float(ends.abs().max())  # NaN when any is NaN
        if not math.isfinite(biggest):
            raise NonFinite(
                f"the gradient of {where} holds a NaN or an inf: every replica would compute it again, "
                "so the run stops (lower the learning rate, or resume from an earlier checkpoint)"
            )
        if biggest == 0.0:
            return
        e = exponent(biggest)
        self.histogram[min(max(e, LOW_EXPONENT), HIGH_EXPONENT) - LOW_EXPONENT] += 1
        if e > self.bound:  # off the grid: every member reads it in the histogram and redoes the step
            return
        scale = math.ldexp(1.0, -grid_exponent(self.bound, self.terms))  # a power of two: the product is exact
        points = torch._foreach_mul(grads, scale)
        torch._foreach_round_(points)
        sums = [t.view_as(g) for t, g in zip(self.total.split([g.numel() for g in grads]), grads)]
        torch._foreach_add_(sums, points)  # integers: exact in float64

    def redo_bound(self, histogram: torch.Tensor) -> int | None:
        """After the all-reduce: the coarser bound the step must be redone with, or None when every
        term fitted. Every member holds the same summed histogram, so every member answers alike."""
        top = largest_exponent(histogram)
        return top if top is not None and top > self.bound else None

    def scale(self, grads: list[torch.Tensor]) -> None:
        """Gradients that hold the all-reduced grid points (copied in, rounded to their dtype) as
        values: scaled by the grid's step, a power of two. The same bits for the same total."""
        with torch.profiler.record_function("exact.scale"):
            torch._foreach_mul_(grads, math.ldexp(1.0, grid_exponent(self.bound, self.terms)))

    def committed(self, histogram: torch.Tensor) -> None:
        """The next step's bound, from this committed step's largest exponent (kept if all were zero)."""
        top = largest_exponent(histogram)
        if top is not None:
            self.bound = top + MARGIN_BITS


def pin_kernels() -> None:
    """The kernel settings exact mode relies on, before the model is built. On CPU one intra-op
    thread: the launcher splits cores by the ranks on a node, and a matmul's blocking (hence its
    float sums) may follow the thread count, which would then differ between 2, 3 and 4 groups. On
    CUDA deterministic algorithms, with the cuBLAS workspace they need: the switch changes only the
    kernels that have a nondeterministic variant (index and scatter accumulation, the attention
    backward's atomics), and not filling new memory with NaN, which only unmasks kernels that read
    what they never wrote and costs a write of every allocation."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]  # a module property
