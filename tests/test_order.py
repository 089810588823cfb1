"""Sample order: a seeded bijection per data epoch, no table, no repeats (pure, microseconds)."""

import pytest

from titan_recover.data.order import epoch_key, epochs_started, permute, window_of

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097])
def test_permute_is_a_bijection(n: int) -> None:
    key = epoch_key(3, 0)
    image = [permute(i, n, key) for i in range(n)]
    assert sorted(image) == list(range(n))


def test_permute_shuffles_and_depends_on_key() -> None:
    n = 1000
    a = [permute(i, n, epoch_key(0, 0)) for i in range(n)]
    b = [permute(i, n, epoch_key(0, 1)) for i in range(n)]
    c = [permute(i, n, epoch_key(1, 0)) for i in range(n)]
    assert a != b and a != c and b != c
    assert sum(x == i for i, x in enumerate(a)) < 20  # not close to the identity
    # consecutive indices land far apart (samples of a step come from all over the corpus)
    assert sum(abs(a[i + 1] - a[i]) > 10 for i in range(n - 1)) > 900


def test_permute_at_corpus_scale_is_cheap_and_in_range() -> None:
    n = 3 * 10**8 + 7  # ~10^8 windows: nothing of size n is built
    key = epoch_key(0, 0)
    values = {permute(i, n, key) for i in range(2000)}
    assert len(values) == 2000 and all(0 <= v < n for v in values)


def test_window_of_covers_every_window_once_per_epoch() -> None:
    windows = 257
    for epoch in range(3):
        seen = [window_of(epoch * windows + p, windows, seed=5) for p in range(windows)]
        assert {e for e, _ in seen} == {epoch}
        assert sorted(w for _, w in seen) == list(range(windows))
    first = [window_of(p, windows, 5)[1] for p in range(windows)]
    second = [window_of(windows + p, windows, 5)[1] for p in range(windows)]
    assert first != second  # each epoch has its own order
    assert window_of(123, windows, 5) == window_of(123, windows, 5)


def test_epochs_started() -> None:
    assert epochs_started(0, 16, 100) == []  # epoch 0 is not an event
    assert epochs_started(96, 16, 100) == [1]
    assert epochs_started(100, 16, 100) == [1]
    assert epochs_started(101, 16, 100) == []
    assert epochs_started(0, 250, 100) == [1, 2]  # a corpus smaller than a step
    assert epochs_started(84, 16, 100) == []


@pytest.mark.parametrize(
    "call",
    [
        lambda: permute(0, 0, 1),
        lambda: permute(5, 5, 1),
        lambda: permute(-1, 5, 1),
        lambda: window_of(-1, 10, 0),
        lambda: epoch_key(-1, 0),
        lambda: epochs_started(0, 1, 0),
    ],
)
def test_bad_arguments_are_errors(call) -> None:
    with pytest.raises(ValueError):
        call()
