"""Tests for titan_recover.data: corpus, tokenizer, token files, addressing, digests."""

from __future__ import annotations

import hashlib
import itertools
import json
import os

import numpy as np
import pytest
import torch
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from titan_recover.data import (
    TOKENIZER_DIR,
    TokenFile,
    load_microbatch,
    piece_digest,
    prepare_from_hf,
    prepare_token_file,
    sample_indices,
    synthetic_corpus,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer() -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def token_path(tmp_path_factory) -> str:
    return prepare_token_file(str(tmp_path_factory.mktemp("tokens") / "train.bin"), 20_000)


def _expected_stream(tok: HuggingFaceTokenizer, docs, num_tokens: int) -> np.ndarray:
    """Reference: per-document HuggingFaceTokenizer.encode with BOS/EOS, concatenated."""
    out: list[int] = []
    for doc in docs:
        out += tok.encode(doc, add_bos=True, add_eos=True)
        if len(out) >= num_tokens:
            break
    return np.array(out[:num_tokens], dtype=np.uint16)


# ------------------------------------------------------------------ tokenizer


def test_tokenizer_loads_with_bos_eos_and_round_trips(tokenizer):
    assert tokenizer.get_vocab_size() == 2048
    assert tokenizer.bos_id is not None and tokenizer.eos_id is not None
    assert tokenizer.bos_id != tokenizer.eos_id
    assert tokenizer.id_to_token(tokenizer.bos_id) == "<|begin_of_text|>"
    assert tokenizer.id_to_token(tokenizer.eos_id) == "<|end_of_text|>"
    for text in [next(iter(synthetic_corpus(1, seed=5))),
                 "Unseen words: zebra, quixotic, ünïcode 日本 and 12345!"]:
        ids = tokenizer.encode(text, add_bos=True, add_eos=True)
        assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
        assert all(0 <= i < 2048 for i in ids)
        assert tokenizer.decode(ids[1:-1]) == text
    # BPE really merged: corpus words are far fewer tokens than bytes.
    text = "The farmer planted the golden seeds near the barn."
    assert len(tokenizer.encode(text)) < len(text.encode()) / 3


def test_shipped_tokenizer_is_small_and_reproducible(tmp_path):
    sizes = [os.path.getsize(os.path.join(TOKENIZER_DIR, f))
             for f in ("tokenizer.json", "tokenizer_config.json")]
    assert sum(sizes) < 300_000
    train_tokenizer(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(tmp_path / name) as f, open(os.path.join(TOKENIZER_DIR, name)) as g:
            assert json.load(f) == json.load(g), name


# ------------------------------------------------------------------ corpus


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


# ------------------------------------------------------------------ token file


def test_prepare_token_file_deterministic_and_idempotent(tmp_path, tokenizer):
    a = prepare_token_file(str(tmp_path / "a" / "x.bin"), 30_000)  # creates the dir
    b = prepare_token_file(str(tmp_path / "y.bin"), 30_000)
    data = open(a, "rb").read()
    assert data == open(b, "rb").read()
    assert len(data) == 60_000
    expected = _expected_stream(tokenizer, synthetic_corpus(10_000), 30_000)
    np.testing.assert_array_equal(np.frombuffer(data, dtype="<u2"), expected)

    meta = json.load(open(a + ".json"))
    assert meta["num_tokens"] == 30_000 and meta["dtype"] == "uint16"
    assert meta["seed"] == 0 and meta["vocab_size"] == 2048
    assert len(meta["tokenizer_sha256"]) == 64
    assert meta["data_sha256"] == hashlib.sha256(data).hexdigest()

    before = os.stat(a)
    assert prepare_token_file(a, 30_000) == a
    after = os.stat(a)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not [f for f in os.listdir(tmp_path / "a") if f.endswith(".tmp")]

    # Different parameters at the same path rewrite it.
    prepare_token_file(a, 30_000, seed=1)
    assert open(a, "rb").read() != data
    assert json.load(open(a + ".json"))["seed"] == 1
    prepare_token_file(a, 1_000)
    assert open(a, "rb").read() == data[:2_000]


def test_interrupted_rewrite_never_pairs_stale_sidecar(tmp_path, monkeypatch):
    import titan_recover.data as data_mod

    path = prepare_token_file(str(tmp_path / "t.bin"), 4_000, seed=0)
    original = open(path, "rb").read()
    real_write = data_mod._atomic_write

    def crash_on_sidecar(target: str, payload: bytes) -> None:
        if target.endswith(".json"):
            raise KeyboardInterrupt("killed between tokens and sidecar")
        real_write(target, payload)

    monkeypatch.setattr(data_mod, "_atomic_write", crash_on_sidecar)
    with pytest.raises(KeyboardInterrupt):
        prepare_token_file(path, 4_000, seed=1)
    monkeypatch.undo()
    assert open(path, "rb").read() != original  # new tokens were published ...
    with pytest.raises(ValueError, match="missing"):  # ... but nothing vouches for them
        TokenFile(path)
    prepare_token_file(path, 4_000, seed=0)
    assert open(path, "rb").read() == original
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_racing_identical_writer_keeps_file_readable(tmp_path, monkeypatch):
    """A rank that lost the start-up race rewrites identical bytes; readers never fail."""
    import titan_recover.data as data_mod

    path = prepare_token_file(str(tmp_path / "t.bin"), 4_000)
    original = open(path, "rb").read()
    real_write = data_mod._atomic_write
    writes = []

    def check_readable_then_write(target: str, payload: bytes) -> None:
        assert TokenFile(path).num_tokens == 4_000
        writes.append(target)
        real_write(target, payload)

    monkeypatch.setattr(data_mod, "_file_is_current", lambda *args: False)
    monkeypatch.setattr(data_mod, "_atomic_write", check_readable_then_write)
    prepare_token_file(path, 4_000)
    assert writes == [path, path + ".json"]
    assert open(path, "rb").read() == original


def test_prepare_token_file_rejects_bad_num_tokens(tmp_path):
    with pytest.raises(ValueError, match="num_tokens"):
        prepare_token_file(str(tmp_path / "x.bin"), 0)


def test_token_file_rejects_truncated_and_missing_sidecar(tmp_path):
    path = prepare_token_file(str(tmp_path / "t.bin"), 5_000)
    assert TokenFile(path).num_tokens == 5_000

    with open(path, "r+b") as f:
        f.truncate(9_998)
    with pytest.raises(ValueError, match="size 9998") as e:
        TokenFile(path)
    assert path in str(e.value)

    prepare_token_file(path, 5_000)  # repairs the truncated file
    assert TokenFile(path).num_tokens == 5_000

    with open(path, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match="size 10002") as e:
        TokenFile(path)
    assert path in str(e.value)
    prepare_token_file(path, 5_000)

    sidecar = path + ".json"
    with open(sidecar, "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="cannot read metadata") as e:
        TokenFile(path)
    assert sidecar in str(e.value)

    with open(sidecar, "w") as f:
        json.dump({"num_tokens": 5_000, "dtype": "int32"}, f)
    with pytest.raises(ValueError, match="corrupt metadata"):
        TokenFile(path)

    os.remove(sidecar)
    with pytest.raises(ValueError, match="missing") as e:
        TokenFile(path)
    assert path in str(e.value) and sidecar in str(e.value)


def test_window_formula_and_wraparound(token_path):
    tf = TokenFile(token_path)
    raw = np.fromfile(token_path, dtype="<u2")
    seq_len = 64
    span = tf.num_tokens - seq_len - 1
    for s in (0, 1, 7, 311, 10**9 + 3):
        start = (s * seq_len) % span
        w = tf.window(s, seq_len)
        assert w.shape == (seq_len + 1,)
        np.testing.assert_array_equal(w, raw[start:start + seq_len + 1])
    # Consecutive samples tile the stream with a one-token overlap for the label.
    assert tf.window(1, seq_len)[0] == tf.window(0, seq_len)[-1]
    with pytest.raises(ValueError, match="too few"):
        tf.window(0, tf.num_tokens)
    with pytest.raises(ValueError, match="sample_index"):
        tf.window(-1, seq_len)


# ------------------------------------------------------------------ addressing


def test_sample_indices_disjoint_and_contiguous():
    M, S, b = 3, 4, 2
    seen: list[int] = []
    for step in (1, 2, 3):
        step_indices = set()
        for m, s in itertools.product(range(M), range(S)):
            r = sample_indices(step, m, s, num_microbatches=M, shards=S, local_batch=b)
            assert len(r) == b
            assert step_indices.isdisjoint(r)
            step_indices.update(r)
        assert step_indices == set(range((step - 1) * M * S * b, step * M * S * b))
        seen += sorted(step_indices)
    assert len(seen) == len(set(seen)) == 3 * M * S * b
    assert sample_indices(2, 1, 3, num_microbatches=M, shards=S, local_batch=b) == range(38, 40)


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


def test_load_microbatch_identical_across_opens(token_path):
    kw = dict(num_microbatches=2, shards=3, local_batch=4, seq_len=32)
    x1, y1 = load_microbatch(TokenFile(token_path), 5, 1, 2, **kw)
    x2, y2 = load_microbatch(TokenFile(token_path), 5, 1, 2, **kw)
    assert x1.dtype == y1.dtype == torch.int64
    assert x1.shape == y1.shape == (4, 32)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(y1[:, :-1], x1[:, 1:])  # labels are inputs shifted by one

    tf = TokenFile(token_path)
    idx = sample_indices(5, 1, 2, num_microbatches=2, shards=3, local_batch=4)
    for row, s in enumerate(idx):
        w = torch.from_numpy(tf.window(s, 32).astype(np.int64))
        assert torch.equal(x1[row], w[:-1]) and torch.equal(y1[row], w[1:])

    x3, _ = load_microbatch(tf, 5, 1, 1, **kw)
    assert not torch.equal(x1, x3)


# ------------------------------------------------------------------ digest


def test_piece_digest(token_path):
    x, y = load_microbatch(TokenFile(token_path), 1, 0, 0, num_microbatches=1, shards=1,
                           local_batch=2, seq_len=16)
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


# ------------------------------------------------------------------ HF datasets


def test_prepare_from_hf_local_dataset(tmp_path, monkeypatch, tokenizer):
    from datasets import load_dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    docs = list(synthetic_corpus(60, seed=11))
    data_file = tmp_path / "local.jsonl"
    data_file.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cache = str(tmp_path / "hf_cache")
    monkeypatch.setitem(DATASETS, "titan_recover_local", DatasetConfig(
        path=str(data_file),
        loader=lambda p: load_dataset("json", data_files=p, split="train", cache_dir=cache),
        sample_processor=lambda sample: sample["text"],
    ))

    path = str(tmp_path / "hf.bin")
    assert prepare_from_hf("titan_recover_local", None, path, 3_000) == path
    np.testing.assert_array_equal(np.fromfile(path, dtype="<u2"),
                                  _expected_stream(tokenizer, docs, 3_000))
    meta = json.load(open(path + ".json"))
    assert meta["dataset"] == "titan_recover_local" and meta["num_tokens"] == 3_000
    assert TokenFile(path).num_tokens == 3_000

    mtime = os.stat(path).st_mtime_ns
    prepare_from_hf("titan_recover_local", None, path, 3_000)
    assert os.stat(path).st_mtime_ns == mtime

    with pytest.raises(ValueError, match="yielded only"):
        prepare_from_hf("titan_recover_local", None, str(tmp_path / "big.bin"), 10**7)
