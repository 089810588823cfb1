"""Sample order over a whole corpus: global sample index -> (data epoch, window). Pure.

The address ``(step, microbatch, shard)`` gives a global sample index
(``data.sample_indices``); this module maps that index to one of the corpus's ``N``
windows. Epoch ``e`` covers indices ``[e*N, (e+1)*N)`` and visits every window once,
in an order drawn by a seeded Feistel bijection over ``[0, N)`` (cycle-walking over
the next power of four), so no table of ``N`` entries is ever built: at 10^8 windows
a rank still holds nothing but the seed. Every epoch has its own key, so the order
changes at each epoch; every process computes the same window for the same index.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
_ROUNDS = 6


def _mix(x: int) -> int:
    """splitmix64's finalizer: a fixed 64-bit mixing function (pure integer arithmetic)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def epoch_key(seed: int, epoch: int) -> int:
    """The permutation key of one data epoch."""
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got {seed}, {epoch}")
    return _mix(_mix(seed) ^ epoch)


def permute(index: int, n: int, key: int) -> int:
    """The image of ``index`` under the bijection of ``[0, n)`` chosen by ``key``.

    A balanced Feistel network on ``2 * half`` bits (the smallest even width holding
    ``n - 1``) is a bijection of ``[0, 4**half)``; applying it until the value falls
    below ``n`` (cycle walking) restricts it to a bijection of ``[0, n)``. Since
    ``4**half < 4n``, that takes fewer than four rounds of the network on average.
    """
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if not 0 <= index < n:
        raise ValueError(f"index must be in [0, {n}), got {index}")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    keys = [_mix(key + r) for r in range(_ROUNDS)]
    x = index
    while True:
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        x = (left << half) | right
        if x < n:
            return x


def window_of(sample: int, windows: int, seed: int) -> tuple[int, int]:
    """``(epoch, window)`` of global sample ``sample`` in a corpus of ``windows`` windows."""
    if sample < 0:
        raise ValueError(f"sample must be >= 0, got {sample}")
    epoch, position = divmod(sample, windows)
    return epoch, permute(position, windows, epoch_key(seed, epoch))


def epochs_started(first: int, count: int, windows: int) -> list[int]:
    """The data epochs (after epoch 0) whose first sample lies in ``[first, first + count)``."""
    if windows <= 0:
        raise ValueError(f"windows must be positive, got {windows}")
    start = -(-first // windows)  # first epoch boundary at or after ``first``
    return [e for e in range(max(start, 1), (first + count - 1) // windows + 1)]
