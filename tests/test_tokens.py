"""Dataset folders on disk: the formats users have (datatrove, Megatron), written by those
libraries' own writers, read back token for token; manifests, checks, large vocabularies."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_data_cli, write_jsonl, write_standin_tokenizer

from titan_recover.data import prepare, tokens
from titan_recover.data.synthetic import TOKENIZER_DIR, synthetic_corpus
from titan_recover.data.tokens import DataError, Manifest, TokenDataset

SHIPPED_JSON = os.path.join(TOKENIZER_DIR, "tokenizer.json")


def shard_tokens(dataset: TokenDataset) -> list[np.ndarray]:
    return [np.fromfile(dataset.path(s), dtype=dataset.dtype) for s in dataset.manifest.shards]


def assert_windows_match_files(dataset: TokenDataset, seq_len: int, vocab: int) -> None:
    """Every window is the slice of its shard that the layout says (per shard, stride seq_len)."""
    w = 0
    for arr in shard_tokens(dataset):
        for k in range((arr.size - 1) // seq_len):
            np.testing.assert_array_equal(
                dataset.window(w, seq_len, vocab), arr[k * seq_len : k * seq_len + seq_len + 1]
            )
            w += 1
    assert w == dataset.num_windows(seq_len)


def big_docs(n: int, vocab: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(3, vocab)}" for _ in range(rng.randrange(5, 60))) for _ in range(n)]


# ------------------------------------------------------------------ large vocabularies


def test_vocabulary_beyond_uint16_round_trips(tmp_path: Path) -> None:
    from titan_recover import titan

    tok_dir = write_standin_tokenizer(tmp_path / "tok", 70_000)
    docs = big_docs(400, 70_000)
    write_jsonl(tmp_path / "a.jsonl", docs[:200])
    write_jsonl(tmp_path / "b.jsonl", docs[200:])
    tasks = prepare.file_tasks([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], task_bytes=20_000)
    m = prepare.prepare(str(tmp_path / "out"), tasks, str(tok_dir), {"files": "ab"}, workers=2, progress=False)
    assert m.dtype == "uint32" and m.vocab_size == 70_000 and len(m.shards) > 2
    assert m.max_token_id > 65_535 and m.num_documents == 400
    tok = titan.Tokenizer(str(tok_dir))
    expected = np.concatenate([tok.encode(d, add_bos=True, add_eos=True) for d in docs])
    dataset = TokenDataset(str(tmp_path / "out"))
    np.testing.assert_array_equal(np.concatenate(shard_tokens(dataset)), expected)
    assert (expected > 65_535).sum() > 500  # these ids would not survive a uint16 file
    assert_windows_match_files(dataset, 32, 70_000)


@pytest.mark.unit
def test_token_width_from_vocabulary() -> None:
    assert tokens.dtype_for_vocab(2048) == "uint16"
    assert tokens.dtype_for_vocab(65_536) == "uint16"
    assert tokens.dtype_for_vocab(65_537) == "uint32"
    assert tokens.dtype_for_vocab(128_256) == "uint32"
    with pytest.raises(DataError):
        tokens.dtype_for_vocab(0)


# ------------------------------------------------------------------ formats users have


def datatrove_docs(texts: list[str]) -> list:
    from datatrove.data import Document

    return [Document(text=t, id=str(i)) for i, t in enumerate(texts)]


def test_datatrove_folder_written_by_datatrove_is_read_token_for_token(tmp_path: Path) -> None:
    from datatrove.pipeline.tokens import DocumentTokenizer
    from tokenizers import Tokenizer

    texts = list(synthetic_corpus(120, seed=9))
    out = tmp_path / "dt"
    for rank in range(2):  # two datatrove tasks, each split into several files
        step = DocumentTokenizer(
            output_folder=str(out),
            tokenizer_name_or_path=SHIPPED_JSON,
            save_filename="corpus",
            eos_token="<|end_of_text|>",
            max_tokens_per_file=3000,
            shuffle_documents=False,
            seed=0,
        )
        step.run(iter(datatrove_docs(texts[rank::2])), rank=rank, world_size=2)
    files = sorted(out.glob("*.ds"))
    assert len(files) >= 2

    r = run_data_cli("index", str(out), "--tokenizer", TOKENIZER_DIR)
    assert r.returncode == 0, r.stderr
    dataset = TokenDataset(str(out))
    assert dataset.manifest.layout == "datatrove" and dataset.manifest.dtype == "uint16"
    assert [s.file for s in dataset.manifest.shards] == [f.name for f in files]
    assert dataset.manifest.num_documents == 120
    # token for token: the documents datatrove wrote are the tokenizer's encoding of the texts + EOS
    tok = Tokenizer.from_file(SHIPPED_JSON)
    eos = tok.token_to_id("<|end_of_text|>")
    written = {
        tuple(a.tolist())
        for arr, f in zip(shard_tokens(dataset), files)
        for a in np.split(arr, np.fromfile(f"{f}.index", dtype="<u8").astype(np.int64)[:-1])
    }
    assert written == {tuple(tok.encode(t).ids + [eos]) for t in texts}
    assert_windows_match_files(dataset, 16, 2048)


def test_our_folder_is_read_by_datatrove(tmp_path: Path) -> None:
    """The other direction: datatrove's own reader reads what ``prepare`` wrote."""
    from datatrove.utils.dataset import DatatroveFolderDataset

    folder = str(tmp_path / "ours")
    prepare.prepare_synthetic(folder, TOKENIZER_DIR, 6_000, 3, 1, workers=1, progress=False)
    ours = TokenDataset(folder)
    seq = 31
    theirs = DatatroveFolderDataset(folder, seq_len=seq, filename_pattern="*.ds", token_size=2)
    stream = np.concatenate([a[: (a.size // (seq + 1)) * (seq + 1)] for a in shard_tokens(ours)])
    read = np.concatenate([theirs[i]["input_ids"].numpy() for i in range(len(theirs))])
    np.testing.assert_array_equal(read, stream)


def test_megatron_indexed_datasets_written_by_megatron_are_read(tmp_path: Path) -> None:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

    tok_dir = write_standin_tokenizer(tmp_path / "tok", 70_000)
    rng = random.Random(3)
    out = tmp_path / "mg"
    out.mkdir()
    docs = []
    for part in range(2):  # two .bin/.idx pairs, as preprocess_data.py writes per input file
        builder = IndexedDatasetBuilder(str(out / f"part{part}_text_document.bin"), dtype=DType.optimal_dtype(70_000))
        for _ in range(50):
            doc = [rng.randrange(0, 70_000) for _ in range(rng.randrange(1, 80))]
            docs.append(doc)
            builder.add_document(torch.tensor(doc), lengths=[len(doc)])
        builder.finalize(str(out / f"part{part}_text_document.idx"))
    r = run_data_cli("index", str(out), "--tokenizer", str(tok_dir))
    assert r.returncode == 0, r.stderr
    dataset = TokenDataset(str(out))
    m = dataset.manifest
    assert (m.layout, m.dtype, len(m.shards), m.num_documents) == ("megatron", "int32", 2, 100)
    np.testing.assert_array_equal(np.concatenate(shard_tokens(dataset)), np.concatenate(docs))
    for i, shard in enumerate(m.shards):  # and Megatron's own reader agrees
        theirs = IndexedDataset(str(out / shard.file)[: -len(".bin")])
        np.testing.assert_array_equal(np.concatenate([theirs[j] for j in range(len(theirs))]), shard_tokens(dataset)[i])
    assert_windows_match_files(dataset, 24, 70_000)


@pytest.mark.unit
def test_index_refuses_a_wrong_token_width(tmp_path: Path) -> None:
    from datatrove.pipeline.tokens import DocumentTokenizer

    out = tmp_path / "dt"
    DocumentTokenizer(output_folder=str(out), tokenizer_name_or_path=SHIPPED_JSON, shuffle_documents=False).run(
        iter(datatrove_docs(list(synthetic_corpus(20)))), rank=0, world_size=1
    )
    with pytest.raises(
        DataError,
        match=r"\.ds(\.index: documents end at token .* is the token width right"
        r"|: \d+ bytes is not a whole number of 4-byte)",
    ):
        tokens.index_folder(str(out), TOKENIZER_DIR, 2048, dtype="uint32")


# ------------------------------------------------------------------ manifest and checks


@pytest.fixture
def small(tmp_path: Path) -> TokenDataset:
    folder = str(tmp_path / "small")
    prepare.prepare_synthetic(folder, TOKENIZER_DIR, 5_000, 2, 0, workers=1, progress=False)
    return TokenDataset(folder)


def test_manifest_round_trip_and_bad_fields(small: TokenDataset) -> None:
    raw = json.loads(Path(small.folder, "manifest.json").read_text())
    assert Manifest.from_json(raw, "m") == small.manifest
    bad: list[tuple[dict[str, Any], str]] = [
        ({"schema": "x"}, "schema"),
        ({"layout": "arrow"}, "layout"),
        ({"dtype": "float32"}, "dtype"),
        ({"tokenizer": {"sha256": 1}}, "tokenizer"),
        ({"shards": []}, "shards must be a non-empty list"),
        ({"shards": [{**raw["shards"][0], "tokens": -1}]}, r"shards\[0\]"),
        ({"shards": [{**raw["shards"][0], "file": "../../etc/passwd"}]}, "inside the dataset folder"),
        ({"num_tokens": 1}, "num_tokens is 1"),
    ]
    for change, message in bad:
        with pytest.raises(DataError, match=message):
            Manifest.from_json({**raw, **change}, "m")


def test_missing_or_unreadable_manifest_says_what_to_do(tmp_path: Path, small: TokenDataset) -> None:
    with pytest.raises(DataError, match="no such dataset folder"):
        TokenDataset(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="manifest.json is missing: prepare .* index"):
        TokenDataset(str(tmp_path / "empty"))
    Path(small.folder, "manifest.json").write_text("{")
    with pytest.raises(DataError, match="cannot read the manifest"):
        TokenDataset(small.folder)


def test_truncated_shard_and_checksums(small: TokenDataset) -> None:
    path = small.path(small.manifest.shards[1])
    assert tokens.verify(small.folder) == []
    with open(path, "r+b") as f:  # same size, one token changed: only verify sees it
        f.seek(100)
        f.write(b"\x01\x00")
    TokenDataset(small.folder)
    (problem,) = tokens.verify(small.folder)
    assert path in problem and "sha256" in problem
    r = run_data_cli("verify", small.folder)
    assert r.returncode == 1 and path in r.stderr
    os.truncate(path, 999)
    with pytest.raises(DataError, match=r"999 bytes, but manifest.json lists 2500 uint16 tokens") as e:
        TokenDataset(small.folder)
    assert path in str(e.value)


def test_tokenizer_and_vocabulary_checks(tmp_path: Path, small: TokenDataset) -> None:
    small.check_tokenizer(TOKENIZER_DIR, 2048, "model.hf_assets_path")
    small.check_vocab(2048, "the model")
    other = write_standin_tokenizer(tmp_path / "other", 3000)
    with pytest.raises(DataError, match=r"manifest.json: tokenized with another tokenizer .* set model.hf_assets_path"):
        small.check_tokenizer(str(other), 3000, "model.hf_assets_path")
    with pytest.raises(DataError, match=r"token ids go up to \d+, but the model has a vocabulary of 1000"):
        small.check_vocab(1000, "the model")


def test_out_of_range_token_at_run_time_names_file_and_offset(small: TokenDataset) -> None:
    shard = small.manifest.shards[0]
    path = small.path(shard)
    data = np.fromfile(path, dtype="<u2")
    data[70] = 5000  # beyond the 2048-entry vocabulary; the manifest still says ids < 2048
    data.tofile(path)
    dataset = TokenDataset(small.folder)  # sizes still match
    dataset.window(0, 64, 2048)  # tokens 0..64 are fine
    with pytest.raises(DataError, match=rf"{path}: token id 5000 at token offset 70 \(byte 140\)"):
        dataset.window(1, 64, 2048)


@pytest.mark.unit
def test_interrupted_shard_leaves_nothing(tmp_path: Path) -> None:
    writer = tokens.ShardWriter(str(tmp_path / "00000.ds"), "uint16")
    writer.add([1, 2, 3])
    writer.abandon()
    assert os.listdir(tmp_path) == []
    writer = tokens.ShardWriter(str(tmp_path / "00000.ds"), "uint16")
    with pytest.raises(DataError, match="outside uint16"):
        writer.add([70_000])
    writer.abandon()
