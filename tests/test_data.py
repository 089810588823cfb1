"""Tests for titan_recover.data: corpus, tokenizer, token files, addressing, digests."""

from __future__ import annotations

import hashlib
import itertools
import json
import os

import pytest
import torch

from titan_recover import titan
from titan_recover.data import prepare
from titan_recover.data.addressing import load_samples, piece_digest, sample_indices
from titan_recover.data.synthetic import TOKENIZER_DIR, synthetic_corpus, train_tokenizer
from titan_recover.data.tokens import TokenDataset


@pytest.fixture(scope="module")
def tokenizer() -> titan.Tokenizer:
    return titan.Tokenizer(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> TokenDataset:
    folder = str(tmp_path_factory.mktemp("tokens"))
    prepare.prepare_synthetic(folder, TOKENIZER_DIR, 20_000, 2, 0, workers=1, progress=False)
    return TokenDataset(folder)


# ------------------------------------------------------------------ tokenizer


@pytest.mark.unit
def test_tokenizer_loads_with_bos_eos_and_round_trips(tokenizer):
    assert tokenizer.get_vocab_size() == 2048
    assert tokenizer.bos_id is not None and tokenizer.eos_id is not None
    assert tokenizer.bos_id != tokenizer.eos_id
    assert tokenizer.id_to_token(tokenizer.bos_id) == "<|begin_of_text|>"
    assert tokenizer.id_to_token(tokenizer.eos_id) == "<|end_of_text|>"
    for text in [next(iter(synthetic_corpus(1, seed=5))), "Unseen words: zebra, quixotic, ünïcode 日本 and 12345!"]:
        ids = tokenizer.encode(text, add_bos=True, add_eos=True)
        assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
        assert all(0 <= i < 2048 for i in ids)
        assert tokenizer.decode(ids[1:-1]) == text
    # BPE really merged: corpus words are far fewer tokens than bytes.
    text = "The farmer planted the golden seeds near the barn."
    assert len(tokenizer.encode(text)) < len(text.encode()) / 3


def test_shipped_tokenizer_is_small_and_reproducible(tmp_path):
    sizes = [os.path.getsize(os.path.join(TOKENIZER_DIR, f)) for f in ("tokenizer.json", "tokenizer_config.json")]
    assert sum(sizes) < 300_000
    train_tokenizer(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(tmp_path / name) as f, open(os.path.join(TOKENIZER_DIR, name)) as g:
            assert json.load(f) == json.load(g), name


# ------------------------------------------------------------------ corpus


@pytest.mark.unit
def test_corpus_is_deterministic_and_structured():
    a = list(synthetic_corpus(200, seed=3))
    assert a == list(synthetic_corpus(200, seed=3))
    assert a[:20] == list(synthetic_corpus(20, seed=3))  # prefix-stable
    assert a != list(synthetic_corpus(200, seed=4))
    assert len(a) == 200 and all(doc.endswith((".", "!")) for doc in a)
    # Pinned text: identical on every machine / Python version (the shipped tokenizer
    # and every prepared token file depend on it).
    digest = hashlib.sha256("\n".join(synthetic_corpus(20, seed=0)).encode()).hexdigest()
    assert digest == "5ed95e5d147713aa0a8872ca5012b6084f5f65ccda1d0ddff9425206b7da1685"
    # A small vocabulary with skewed (learnable) frequencies, not uniform noise.
    words = [w.strip(".,!").lower() for doc in a for w in doc.split()]
    words = [w for w in words if not w.isdigit()]
    counts = sorted((words.count(w) for w in set(words)), reverse=True)
    assert 200 < len(counts) < 700
    assert sum(counts[:20]) > 0.3 * len(words)


# ------------------------------------------------------------------ addressing


@pytest.mark.unit
def test_sample_indices_disjoint_and_contiguous():
    M, S, b = 3, 4, 2
    seen: list[int] = []
    for step in (1, 2, 3):
        step_indices: set[int] = set()
        for m, s in itertools.product(range(M), range(S)):
            r = sample_indices(step, m, s, num_microbatches=M, shards=S, local_batch=b)
            assert len(r) == b
            assert step_indices.isdisjoint(r)
            step_indices.update(r)
        assert step_indices == set(range((step - 1) * M * S * b, step * M * S * b))
        seen += sorted(step_indices)
    assert len(seen) == len(set(seen)) == 3 * M * S * b
    assert sample_indices(2, 1, 3, num_microbatches=M, shards=S, local_batch=b) == range(38, 40)


@pytest.mark.unit
@pytest.mark.parametrize(
    "args, kwargs, name",
    [
        ((0, 0, 0), {}, "step"),
        ((1, 3, 0), {}, "microbatch"),
        ((1, -1, 0), {}, "microbatch"),
        ((1, 0, 2), {}, "shard"),
        ((1, 0, -1), {}, "shard"),
        ((1, 0, 0), {"num_microbatches": 0}, "num_microbatches"),
        ((1, 0, 0), {"shards": 0}, "shards"),
        ((1, 0, 0), {"local_batch": 0}, "local_batch"),
    ],
)
def test_sample_indices_validation(args, kwargs, name):
    sizes = {"num_microbatches": 3, "shards": 2, "local_batch": 4, **kwargs}
    with pytest.raises(ValueError, match=rf"^{name} must"):
        sample_indices(*args, **sizes)


def test_load_samples_identical_across_opens(dataset):
    kw = dict(seq_len=32, seed=7, vocab_size=2048)
    samples = sample_indices(5, 1, 2, num_microbatches=2, shards=3, local_batch=4)
    x1, y1 = load_samples(dataset, samples, **kw)
    x2, y2 = load_samples(TokenDataset(dataset.folder), samples, **kw)
    assert x1.dtype == y1.dtype == torch.int64
    assert x1.shape == y1.shape == (4, 32)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(y1[:, :-1], x1[:, 1:])  # labels are inputs shifted by one
    x3, _ = load_samples(dataset, sample_indices(5, 1, 1, num_microbatches=2, shards=3, local_batch=4), **kw)
    assert not torch.equal(x1, x3)
    x4, _ = load_samples(dataset, samples, **{**kw, "seed": 8})  # another order
    assert not torch.equal(x1, x4)


# ------------------------------------------------------------------ digest


def test_piece_digest(dataset):
    x, y = load_samples(dataset, [0, 1], seq_len=16, seed=0, vocab_size=2048)
    d = piece_digest(x, y)
    assert 0 <= d < 2**40
    raw = hashlib.blake2b(x.numpy().tobytes() + y.numpy().tobytes()).digest()
    assert d == int.from_bytes(raw[:5], "big")
    assert piece_digest(x.clone(), y.clone()) == d
    assert piece_digest(x.t().contiguous().t(), y) == d  # layout does not matter
    assert piece_digest(y, x) != d
    x2 = x.clone()
    x2[1, 7] += 1
    assert piece_digest(x2, y) != d
